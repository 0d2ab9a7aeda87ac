/* qm_reclaim.h - orphan reclaim (qm_reclaim.c): the loop timer that closes
 * a session left orphaned (qm_touches.h) for session_orphan_timeout_s, as
 * session.close would, and unmaps a map orphaned as long in a session that
 * lives on (qm_shm.h: its connection closed; docs/PROTOCOL.md "Lifecycle").
 * Sessions and maps are closed only from the timer's callback, a safe point of the loop
 * outside every connection's and job's callback chain (STYLE.md: Redis's
 * "mark, free at a safe point"). Loop thread only. */
#ifndef QM_RECLAIM_H
#define QM_RECLAIM_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "qm_config.h"
#include "qm_sessions.h"
#include "qm_telemetry.h"
#include "qm_touches.h"

/* The reclaimer: a timer on the loop, armed for the earliest deadline of
 * the orphaned sessions and maps. It borrows the sessions, the
 * configuration (session_orphan_timeout_s, reloaded in place) and the
 * daemon's counters (sessions_reclaimed, maps_reclaimed) for as long as it
 * lives. */
typedef struct qm_reclaim {
    uv_timer_t timer;
    qm_sessions *sessions;
    const qm_config *cfg;
    qm_counters *counters;
} qm_reclaim;

void qm_reclaim_init(qm_reclaim *rc, uv_loop_t *loop, qm_sessions *sessions,
                     const qm_config *cfg, qm_counters *counters);
/* Connection conn_id closed: every session forgets it, those it leaves
 * orphaned are marked, and so are the maps it held. */
void qm_reclaim_conn_closed(qm_reclaim *rc, uint64_t conn_id);
/* A request on connection conn_id named s: s is held by it (its orphan
 * mark cleared), and when s was orphaned its maps' clocks start again. */
void qm_reclaim_touch(qm_session *s, uint64_t conn_id);
/* A session whose state changed (a job handed back, a creation
 * committed): marked, and the timer armed, when that left it orphaned or
 * left an orphan without work queued. Accepts a closed session (nothing
 * to do). */
void qm_reclaim_check(qm_reclaim *rc, qm_session *s);
/* After a mark or a change of session_orphan_timeout_s: the timer for the
 * earliest deadline (stopped when there is none or the timeout is 0). */
void qm_reclaim_arm(qm_reclaim *rc);
/* Closes every session whose deadline passed by now_us, and unmaps every
 * map whose deadline passed in a session that is not orphaned (the timer's
 * work; the unit tests call it with a clock of their own). The number of
 * sessions closed. */
size_t qm_reclaim_due(qm_reclaim *rc, uint64_t now_us);

#endif
