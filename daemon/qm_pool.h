/* qm_pool.h - jobs and the worker pool (qm_worker.c; the work itself in
 * qm_infer.c).
 *
 * A job is one request that needs a worker, or that waits its turn behind
 * one: it is queued on its session's FIFO, so one session's jobs run in
 * order, one at a time, while different sessions run on different workers.
 * The loop thread builds a job and gets it back when done
 * (qm_dispatch_job_done); in between only the worker running it touches it. */
#ifndef QM_POOL_H
#define QM_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "qm_moe.h"
#include "qm_pager.h"
#include "qm_protocol.h"
#include "qm_server.h"
#include "qm_shm.h"

typedef struct qm_daemon qm_daemon;
typedef struct qm_session qm_session;
typedef struct qm_reply qm_reply;
typedef struct qm_job qm_job;
typedef struct qm_pool qm_pool;

typedef enum qm_job_kind {
    QM_JOB_INFER,  /* the worker runs the layer and encodes the response */
    QM_JOB_CREATE, /* the worker builds a new session's pager */
    QM_JOB_BARRIER, /* the worker passes it through; the loop answers it in order */
    QM_JOB_PLAN,    /* session.plan: the worker reads the pager's residency now */
    QM_JOB_RESIZE   /* session.resize: the worker changes the pager's budget */
} qm_job_kind;

struct qm_job {
    qm_job *next;
    qm_job_kind kind;
    qm_daemon *d;
    qm_session *session;
    qm_reply *reply;
    size_t slot;
    qm_request req; /* owned */
    qm_fds fds;      /* session.map's descriptor, owned (closed by qm_job_free) */
    qm_map_refs maps; /* the session's maps its tensors use (released by qm_job_free) */
    uint64_t enqueue_us, start_us, end_us;
    uint64_t decode_us; /* the frame's decoding on the loop thread (whole batch) */
    /* results (worker) */
    int rc;
    int cancelled; /* skipped: its client went away before it ran */
    qm_status st;
    qm_buf response;
    qm_moe_stats mstats;
    qm_pager_stats pstats;
    uint32_t tokens;
    uint32_t *route_experts; /* [tokens * k], for the hotness profile */
    size_t n_routes;
};

/* A session's place in the pool, embedded in the session. */
typedef struct qm_job_queue {
    qm_job *head, *tail; /* its FIFO (pool lock) */
    int scheduled;       /* on the run queue or running (pool lock) */
    qm_session *runq_next; /* (pool lock) */
    size_t pending;      /* jobs enqueued and not yet completed (loop thread) */
} qm_job_queue;

/* Starts n_threads workers for d (d->pool); QM_EINVAL for a bad
 * QMOED_FAULT_ALLOC, QM_ENOMEM. */
int qm_pool_start(qm_daemon *d, uint32_t n_threads);
void qm_pool_stop(qm_daemon *d); /* joins the workers and frees d->pool; accepts none */
/* Queues a job on its session's FIFO (takes ownership). QM_EOVERLOADED when
 * queue_depth inferences are already waiting. */
int qm_pool_submit(qm_daemon *d, qm_job *job);
/* Jobs submitted and not yet handed back to the loop (0 without a pool). */
size_t qm_pool_queued(const qm_pool *p);
void qm_job_free(qm_job *job); /* accepts NULL */

/* The work of a job on a worker thread (qm_infer.c): session.infer runs the
 * layer and encodes the response; session.plan reads the pager's residency
 * and encodes the plan. Results land in the job. */
void qm_job_run(qm_job *job);
void qm_job_run_plan(qm_job *job);
/* session.resize: changes the pager's budget (the loop answers, reserving
 * and releasing the daemon-wide budget: qm_session_resize_*). */
void qm_job_run_resize(qm_job *job);

#endif
