/* qm_reclaim.c - orphan reclaim: the timer that closes sessions orphaned
 * for session_orphan_timeout_s and unmaps maps orphaned as long
 * (qm_reclaim.h), and the marks it reads (qm_touches.h, qm_shm.h) set
 * where a session's or a map's use changes. Loop thread only. */
#include "qm_reclaim.h"

#include <string.h>
#include <time.h>

#include "qm_alloc.h"
#include "qm_log.h"
#include "qm_models.h"

static uint64_t timeout_us(const qm_reclaim *rc)
{
    return (uint64_t)rc->cfg->session_orphan_timeout_s * 1000000u;
}

/* Orphaned with no touch since, nothing queued or running, and its time up. */
static int is_due(qm_session *s, uint64_t now_us, uint64_t limit_us)
{
    const qm_touches *t = qm_session_touches(s);
    return t->orphaned_us && !t->n && !t->lost && qm_session_queued(s) == 0 &&
           now_us - t->orphaned_us >= limit_us;
}

/* A session not orphaned itself: its maps orphaned for the timeout are
 * unmapped (an orphaned session's go with it, on its own clock). */
static void reclaim_maps(qm_reclaim *rc, qm_session *s, uint64_t now_us, uint64_t limit)
{
    if (qm_session_touches(s)->orphaned_us)
        return;
    uint64_t bytes = 0;
    size_t n = qm_shm_set_reclaim(qm_session_maps(s), now_us, limit, &bytes);
    if (!n)
        return;
    qm_log(QM_LOG_NOTICE, "session %s: %zu map%s (%llu bytes) reclaimed: the connection that "
           "last used %s closed %u s ago and none has since (session_orphan_timeout_s); the "
           "session stays",
           qm_session_id(s), n, n == 1 ? "" : "s", (unsigned long long)bytes,
           n == 1 ? "it" : "them", rc->cfg->session_orphan_timeout_s);
    rc->counters->maps_reclaimed += n;
}

size_t qm_reclaim_due(qm_reclaim *rc, uint64_t now_us)
{
    uint64_t limit = timeout_us(rc);
    size_t closed = 0;
    if (!limit)
        return 0;
    for (qm_session *s = rc->sessions->first, *next; s; s = next) {
        next = qm_session_next(s);
        if (!is_due(s, now_us, limit)) {
            reclaim_maps(rc, s, now_us, limit);
            continue;
        }
        const qm_touches *t = qm_session_touches(s);
        qm_log(QM_LOG_NOTICE, "session %s reclaimed: no open connection had used it for %llu s "
               "(session_orphan_timeout_s %u); model %s, uid %u, budget %llu and %u maps "
               "returned", qm_session_id(s),
               (unsigned long long)((now_us - t->orphaned_us) / 1000000u),
               rc->cfg->session_orphan_timeout_s, qm_session_model(s)->name,
               (unsigned)qm_session_owner(s), (unsigned long long)qm_session_budget(s),
               qm_session_maps(s)->count);
        qm_session_close(rc->sessions, s);
        rc->counters->sessions_reclaimed++;
        closed++;
    }
    return closed;
}

static void timer_cb(uv_timer_t *h)
{
    qm_reclaim *rc = h->data;
    qm_reclaim_due(rc, qm_now_us());
    qm_reclaim_arm(rc);
}

void qm_reclaim_init(qm_reclaim *rc, uv_loop_t *loop, qm_sessions *sessions,
                     const qm_config *cfg, qm_counters *counters)
{
    memset(rc, 0, sizeof *rc);
    rc->sessions = sessions;
    rc->cfg = cfg;
    rc->counters = counters;
    uv_timer_init(loop, &rc->timer);
    rc->timer.data = rc;
    /* An armed reclaim never keeps a stopping loop alive. */
    uv_unref((uv_handle_t *)&rc->timer);
}

/* Armed for the first orphaned session's due time. One with work queued
 * (an orphan's own jobs, or an auto budget's resize the memory watcher
 * queued after it was orphaned) is not due while it has some: its last
 * job's hand-back arms this again (qm_reclaim_check). Were it counted, its
 * passed due time would restart the timer at 0 ms from its own callback,
 * which libuv runs again in the same pass: the loop thread would spin
 * there for ever and never hand that job back (a soak found it). At least
 * 1 ms for the same reason. */
void qm_reclaim_arm(qm_reclaim *rc)
{
    if (uv_is_closing((uv_handle_t *)&rc->timer))
        return;
    uint64_t limit = timeout_us(rc), first = 0;
    for (qm_session *s = limit ? rc->sessions->first : NULL; s;
         s = qm_session_next(s)) {
        const qm_touches *t = qm_session_touches(s);
        uint64_t due = 0;
        if (!t->orphaned_us)
            due = qm_shm_set_next_due(qm_session_maps(s), limit);
        else if (!t->n && !t->lost && !qm_session_queued(s))
            due = t->orphaned_us + limit;
        if (due && (!first || due < first))
            first = due;
    }
    if (!first) {
        uv_timer_stop(&rc->timer);
        return;
    }
    uint64_t now = qm_now_us();
    uint64_t ms = first > now ? (first - now + 999u) / 1000u : 1;
    uv_timer_start(&rc->timer, timer_cb, ms ? ms : 1, 0);
}

/* Marks s orphaned when nothing holds it any more: 1 when newly marked. */
static int mark(qm_reclaim *rc, qm_session *s, uint64_t now_us)
{
    if (!qm_touches_mark(qm_session_touches(s), qm_session_queued(s), now_us))
        return 0;
    if (rc->cfg->session_orphan_timeout_s)
        qm_log(QM_LOG_INFO, "session %s orphaned: no open connection has used it; reclaimed in "
               "%u s unless a client does (session_orphan_timeout_s)", qm_session_id(s),
               rc->cfg->session_orphan_timeout_s);
    else
        qm_log(QM_LOG_INFO, "session %s orphaned: no open connection has used it; kept until "
               "closed (session_orphan_timeout_s 0)", qm_session_id(s));
    return 1;
}

void qm_reclaim_conn_closed(qm_reclaim *rc, uint64_t conn_id)
{
    int marked = 0;
    uint64_t now = qm_now_us();
    for (qm_session *s = rc->sessions->first; s; s = qm_session_next(s))
        if (qm_touches_forget(qm_session_touches(s), conn_id)) {
            marked |= qm_shm_set_conn_closed(qm_session_maps(s), conn_id, now) > 0;
            marked |= mark(rc, s, now);
        }
    if (marked)
        qm_reclaim_arm(rc);
}

void qm_reclaim_touch(qm_session *s, uint64_t conn_id)
{
    qm_touches *t = qm_session_touches(s);
    if (t->orphaned_us)
        qm_shm_set_restart_clocks(qm_session_maps(s), qm_now_us());
    qm_touches_add(t, conn_id);
}

/* After a job of s was handed back: s newly orphaned, or orphaned before
 * and now without work queued (due again), arms the timer. */
void qm_reclaim_check(qm_reclaim *rc, qm_session *s)
{
    if (qm_session_closed(s))
        return;
    if (mark(rc, s, qm_now_us()) ||
        (qm_session_touches(s)->orphaned_us && !qm_session_queued(s)))
        qm_reclaim_arm(rc);
}
