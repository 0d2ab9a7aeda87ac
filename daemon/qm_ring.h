/* qm_ring.h - call rings (qm_ring.c; PROTOCOL.md "session.ring"): a
 * session's shared call region, opened over the socket, whose calls one
 * thread of the daemon takes straight from the region and computes, with
 * no loop-thread hop and no JSON.
 *
 * A ring call is a session.infer with mapped tensors: its job (qm_ring_job,
 * operations in qm_infer.c) runs in the session's FIFO like a socket
 * inference, on the ring's own thread when the FIFO is idle (the usual
 * case) or on a worker behind the session's queued work, and is handed back
 * to the loop, which counts it as it counts a socket inference.
 *
 * A ring belongs to the connection that opened it (the loop closes it when
 * that connection closes: a client that died leaves no thread waiting) and
 * to its session (closed with it). Ring threads read only their region,
 * their session's maps (under the set's lock) and what a job reaches.
 * Everything here is loop thread only unless marked. */
#ifndef QM_RING_H
#define QM_RING_H

#include <stdint.h>

#include <uv.h>

#include "qm_pool.h"
#include "qm_ring_wire.h"
#include "qm_server.h"

typedef struct qm_ring qm_ring;
typedef struct qm_rings qm_rings;
typedef struct qm_session qm_session;
typedef struct qm_method_ctx qm_method_ctx; /* qm_methods.h */

/* A ring call's job: the job first (qm_job_free frees the whole). */
typedef struct qm_ring_job {
    qm_job job;
    qm_ring *ring;   /* until qm_ring_post */
    uint32_t seq;    /* the call number it answers */
    int admitted;    /* its maps resolved and shapes checked: counted as the session's */
    uint64_t answered_us; /* qm_now_us when its answer was posted (its latency ends there) */
} qm_ring_job;

/* The operations of a ring call's job (qm_infer.c): run resolves, checks,
 * computes and posts the answer; finish counts it. */
extern const qm_job_ops qm__ring_infer_ops;

/* The daemon's rings, for the loop `loop`; mx (borrowed, for the daemon's
 * life) gives the jobs what they reach: pool, counters, config (max_rings),
 * limits. *out is the caller's (qm_rings_stop, then qm_rings_free).
 * QM_ENOMEM. */
int qm_rings_new(uv_loop_t *loop, const qm_method_ctx *mx, qm_rings **out);
/* session.ring: checks fd as session.map checks a memfd (sealed,
 * QM_RING_BYTES at least, read-write), maps it, writes the header and
 * starts the ring's thread; the connection c is held while the ring is
 * open. Closes fd in every case. QM_EINVAL (field fd), QM_ERESOURCE_EXHAUSTED
 * at max_rings (counted), QM_ENOMEM. *id: the ring's number. anticipate:
 * the thread wakes ahead of each call it expects from the ring's tempo and
 * spins for it (session.ring's `anticipate`; PROTOCOL.md). */
int qm_ring_open(qm_rings *rs, qm_session *s, qm_conn *c, int fd, int anticipate, uint64_t *id,
                 qm_status *st);
/* Closing, by cause: the connection that opened it closed (calls in flight
 * are skipped: nobody reads them), its session closed (they fail with
 * not_found), the daemon drains (they finish; the ring takes no more). The
 * region then says closed, with the JSON-RPC code and reason a client
 * reports, and any client waiting on it is woken. */
void qm_rings_conn_closed(qm_rings *rs, uint64_t conn_id);
void qm_rings_session_closed(qm_rings *rs, const qm_session *s);
void qm_rings_drain(qm_rings *rs);
uint32_t qm_rings_open_count(const qm_rings *rs);

/* At exit, after the loop ran its last: stop closes every ring and joins
 * its thread (a call queued on a worker is left to the pool); free, after
 * the pool stopped, releases the rest. Both accept NULL. */
void qm_rings_stop(qm_rings *rs);
void qm_rings_free(qm_rings *rs);

/* Any thread, for a ring call's job: 1 when nobody will read its answer
 * (the ring's connection closed); qm_ring_post writes the answer, sets the
 * answered number, wakes the client, and lets go of the ring (rj->ring is
 * NULL after). A NULL answer (a call skipped because its connection
 * closed) writes nothing: the ring closes with the connection's code. */
int qm_ring_abandoned(const qm_ring *r);
/* 1 when the ring anticipates its calls (opened with `anticipate`: the
 * engine leaves a CPU idle between them). */
int qm_ring_anticipates(const qm_ring *r);
void qm_ring_post(qm_ring_job *rj, qm_ring_answer *a);

#endif
