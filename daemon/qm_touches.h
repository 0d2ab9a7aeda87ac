/* qm_touches.h - which open connections have touched a session (created
 * it, named it in a request, mapped memory into it) and when it became
 * orphaned: no open connection has touched it and nothing of it is queued
 * or running. The mark is set where that changes (a connection closed, a
 * job handed back, a creation committed) and cleared by the next touch;
 * the reclaimer (qm_reclaim.h) closes what stays orphaned. Loop thread only. */
#ifndef QM_TOUCHES_H
#define QM_TOUCHES_H

#include <stddef.h>
#include <stdint.h>

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

#endif
