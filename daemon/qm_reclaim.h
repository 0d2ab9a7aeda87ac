/* qm_reclaim.h - orphan reclaim (qm_reclaim.c): which open connections
 * have touched each session, when a session became orphaned, and the loop
 * timer that closes a session left orphaned for session_orphan_timeout_s,
 * as session.close would (docs/OPERATIONS.md "Orphaned sessions").
 *
 * A session is orphaned when no open connection has touched it (created
 * it, named it in a request, mapped memory into it) and nothing of it is
 * queued or running. The mark is set where that changes (a connection
 * closed, a job handed back, a creation committed) and cleared by the next
 * touch; sessions are closed only from the timer's callback, a safe point
 * of the loop outside every connection's and job's callback chain
 * (STYLE.md: Redis's "mark, free at a safe point"). Loop thread only. */
#ifndef QM_RECLAIM_H
#define QM_RECLAIM_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "qm_config.h"
#include "qm_registry.h"
#include "qm_telemetry.h"

/* One session's touches (embedded in the session; zeroed is none). */
typedef struct qm_touches {
    uint64_t *conns;      /* ids of the open connections that touched it */
    uint32_t n, cap;
    int lost;             /* a touch could not be recorded (out of memory): never orphaned */
    uint64_t orphaned_us; /* qm_now_us when it became orphaned; 0: it is not */
    int64_t orphaned_at;  /* the same moment in unix seconds (session.list) */
} qm_touches;

/* Connection conn_id touched it: recorded once, and the orphan mark is
 * cleared. */
void qm_touches_add(qm_touches *t, uint64_t conn_id);
/* Connection conn_id closed: 1 when it had touched it. */
int qm_touches_forget(qm_touches *t, uint64_t conn_id);
/* Marks it orphaned at now_us when no open connection has touched it and
 * `queued` (its jobs not yet handed back) is 0: 1 when newly marked. */
int qm_touches_mark(qm_touches *t, size_t queued, uint64_t now_us);
void qm_touches_free(qm_touches *t);

/* Seconds left before an orphaned session is reclaimed (rounded up, 0 when
 * due), or -1 when it is not orphaned or timeout_s is 0 (never). */
int64_t qm_touches_reclaim_in_s(const qm_touches *t, uint32_t timeout_s, uint64_t now_us);

/* The reclaimer: a timer on the loop, armed for the earliest deadline of
 * the orphaned sessions. It borrows the registry, the configuration
 * (session_orphan_timeout_s, reloaded in place) and the daemon's counters
 * (sessions_reclaimed) for as long as it lives. */
typedef struct qm_reclaim {
    uv_timer_t timer;
    qm_registry *registry;
    const qm_config *cfg;
    qm_counters *counters;
} qm_reclaim;

void qm_reclaim_init(qm_reclaim *rc, uv_loop_t *loop, qm_registry *r, const qm_config *cfg,
                     qm_counters *counters);
/* Connection conn_id closed: every session forgets it, and those it leaves
 * orphaned are marked. */
void qm_reclaim_conn_closed(qm_reclaim *rc, uint64_t conn_id);
/* A session whose state changed (a job handed back, a creation
 * committed): marked, and the timer armed, when that left it orphaned.
 * Accepts a closed session (nothing to do). */
void qm_reclaim_check(qm_reclaim *rc, qm_session *s);
/* After a mark or a change of session_orphan_timeout_s: the timer for the
 * earliest deadline (stopped when there is none or the timeout is 0). */
void qm_reclaim_arm(qm_reclaim *rc);
/* Closes every session whose deadline passed by now_us (the timer's work;
 * the unit tests call it with a clock of their own). The number closed. */
size_t qm_reclaim_due(qm_reclaim *rc, uint64_t now_us);

#endif
