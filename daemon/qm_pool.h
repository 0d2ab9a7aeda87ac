/* qm_pool.h - jobs and the worker pool (qm_worker.c).
 *
 * A job is one request that needs a worker, or that waits its turn behind
 * one: it is queued on its session's FIFO (a qm_job_queue the session
 * embeds), so one session's jobs run in order, one at a time, while
 * different sessions run on different workers. What a job does is its
 * operations, which its method's row names (qm_methods.h): the loop thread
 * admits it, a worker runs it, the loop finishes it (answers), or undoes
 * the admission of a job that was never queued. The pool knows no method:
 * it runs `run` on a worker and hands the job back to the loop. */
#ifndef QM_POOL_H
#define QM_POOL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "qm_moe.h"
#include "qm_pager.h"
#include "qm_protocol.h"
#include "qm_server.h"
#include "qm_shm.h"

typedef struct qm_session qm_session;
typedef struct qm_reply qm_reply;
typedef struct qm_job qm_job;
typedef struct qm_pool qm_pool;
typedef struct qm_method_ctx qm_method_ctx; /* qm_methods.h */

/* A job's operations; only `finish` is required. */
typedef struct qm_job_ops {
    /* Counts against queue_depth (the compute worth refusing: inferences). */
    int bounded;
    /* Loop thread, before the job is queued: checks and reservations. < 0
     * refuses the request (st says why) and nothing is queued. */
    int (*admit)(qm_job *job, qm_status *st);
    /* A worker: the work, its results into the job. None: the job only
     * keeps its place in the session's order (a barrier). */
    void (*run)(qm_job *job);
    /* Loop thread, when the worker is done: bookkeeping and the answer. */
    void (*finish)(qm_job *job);
    /* Loop thread, for an admitted job that was never queued (out of
     * memory, queue_depth): gives back what admit took. */
    void (*undo)(qm_job *job);
} qm_job_ops;

/* A session's place in the pool, embedded in the session. */
typedef struct qm_job_queue {
    qm_job *head, *tail;          /* its FIFO (pool lock) */
    int scheduled;                /* on the run queue or running (pool lock) */
    struct qm_job_queue *runq_next; /* (pool lock) */
    /* jobs submitted and not yet handed back: counted up where they are
     * submitted (the loop, or a ring's thread), down on the loop */
    atomic_size_t pending;
} qm_job_queue;

struct qm_job {
    qm_job *next;
    const qm_job_ops *ops;
    const qm_method_ctx *mx;  /* what its operations reach of the daemon */
    qm_session *session;      /* a reference; NULL until admit makes one (session.create) */
    qm_job_queue *queue;      /* the session's FIFO */
    qm_reply *reply;
    size_t slot;
    uid_t peer_uid;           /* who sent it */
    uint64_t conn_id;         /* the connection it came on (a ring call: the ring's) */
    qm_request req;   /* owned */
    qm_fds fds;       /* session.map's descriptor, owned (closed by qm_job_free) */
    qm_map_refs maps; /* the session's maps its tensors use (released by qm_job_free) */
    uint64_t read_us; /* its line read whole (qm_frame_times) */
    uint64_t enqueue_us, start_us, end_us;
    uint64_t decode_us; /* the frame's decoding on the loop thread (whole batch) */
    /* results (worker) */
    int rc;
    int cancelled; /* skipped: its client went away before it ran */
    qm_status st;
    qm_buf response;       /* the answer the worker encoded, when it did */
    qm_moe_stats mstats;
    qm_pager_stats pstats; /* the session's pager statistics after the work */
    uint32_t tokens;
    uint32_t *route_experts; /* [tokens * k], for the hotness profile */
    size_t n_routes;
    /* session.resize to "auto": what it came to (qm_budget.h), owned; set
     * by admit, the session's once the resize is applied. */
    struct qm_budget_auto *budget_auto;
};

/* The loop's side: done is called for each job a worker hands back (the
 * session's queue already counts it gone), then idle once the batch of
 * them is through. */
typedef struct qm_pool_hooks {
    void (*done)(void *arg, qm_job *job);
    void (*idle)(void *arg);
    /* qm_pool_stop, for each job the loop never took (done after it
     * stopped, or never run): release it (its session reference, its
     * memory); no answer, no bookkeeping. None: the jobs leak. */
    void (*discard)(void *arg, qm_job *job);
    void *arg;
} qm_pool_hooks;

/* Starts n_threads workers whose finished jobs come back on `loop`; *out
 * is the caller's (qm_pool_stop). QM_EINVAL for a bad QMOED_FAULT_ALLOC,
 * QM_ENOMEM. */
int qm_pool_start(uv_loop_t *loop, uint32_t n_threads, const qm_pool_hooks *hooks,
                  qm_pool **out);
/* Joins the workers, hands every job the loop did not take to
 * hooks.discard, frees p; accepts NULL. After the loop's last run and
 * after every thread that submits (rings) has ended. */
void qm_pool_stop(qm_pool *p);
/* Queues a job on its queue's FIFO (takes ownership). QM_EOVERLOADED,
 * the job still the caller's, when it is bounded and queue_depth bounded
 * jobs are already waiting. Loop thread. */
int qm_pool_submit(qm_pool *p, qm_job *job, uint32_t queue_depth);
/* Jobs submitted and not yet handed back to the loop (0 without a pool). */
size_t qm_pool_queued(const qm_pool *p);
/* A call ring's job (daemon/qm_ring.c), from the ring's own thread: counted
 * as submitted, then run at once on the calling thread when its session's
 * FIFO is idle (returns 1: `run` ran here, in the session's order, and the
 * job is on its way back to the loop, which takes it lazily: see
 * qm_worker.c), else queued behind the session's work for a worker
 * (returns 0). Never refused: a ring has one call in flight. Any thread. */
int qm_pool_run_or_queue(qm_pool *p, qm_job *job);
/* Hands the jobs done lazily (rings' calls) to the loop's hook now, in
 * order with every other job done: before a frame is dispatched, so what
 * it reads (telemetry) counts every call already answered. Loop thread;
 * accepts NULL. */
void qm_pool_collect(qm_pool *p);
/* Wakes the loop for the lazy jobs when the oldest was done older_than_us
 * ago or more (a ring's thread, before it sleeps and as it takes a call).
 * Returns the microseconds until the oldest is that old (0: none waits,
 * or the loop was woken). Any thread. */
uint64_t qm_pool_nudge(qm_pool *p, uint64_t older_than_us);
void qm_job_free(qm_job *job); /* accepts NULL; the session reference is the caller's */

#endif
