/* qm_touches.c - one session's touches: the open connections that used it,
 * and its orphan mark (qm_touches.h). Loop thread only. */
#include "qm_touches.h"

#include <string.h>
#include <time.h>

#include "qm_alloc.h"
#include "qm_log.h"

void qm_touches_add(qm_touches *t, uint64_t conn_id)
{
    t->orphaned_us = 0;
    t->orphaned_at = 0;
    for (uint32_t i = 0; i < t->n; i++)
        if (t->conns[i] == conn_id)
            return;
    if (t->n == t->cap) {
        uint32_t cap = t->cap ? 2 * t->cap : 4;
        uint64_t *grown = qm_realloc(t->conns, cap * sizeof *grown);
        if (!grown) {
            /* Forgetting a touch could reclaim a session in use: keep it
             * for good instead (the conservative side, today's rule). */
            if (!t->lost)
                qm_log(QM_LOG_WARNING, "out of memory recording a connection's use of a "
                       "session: that session is never reclaimed as orphaned");
            t->lost = 1;
            return;
        }
        t->conns = grown;
        t->cap = cap;
    }
    t->conns[t->n++] = conn_id;
}

int qm_touches_forget(qm_touches *t, uint64_t conn_id)
{
    for (uint32_t i = 0; i < t->n; i++) {
        if (t->conns[i] == conn_id) {
            t->conns[i] = t->conns[--t->n];
            return 1;
        }
    }
    return 0;
}

int qm_touches_mark(qm_touches *t, size_t queued, uint64_t now_us)
{
    if (t->orphaned_us || t->n || t->lost || queued)
        return 0;
    t->orphaned_us = now_us ? now_us : 1;
    t->orphaned_at = (int64_t)time(NULL);
    return 1;
}

void qm_touches_free(qm_touches *t)
{
    qm_free(t->conns);
    memset(t, 0, sizeof *t);
}

int64_t qm_touches_reclaim_in_s(const qm_touches *t, uint32_t timeout_s, uint64_t now_us)
{
    if (!t->orphaned_us || !timeout_s)
        return -1;
    uint64_t due = t->orphaned_us + (uint64_t)timeout_s * 1000000u;
    return due > now_us ? (int64_t)((due - now_us + 999999u) / 1000000u) : 0;
}
