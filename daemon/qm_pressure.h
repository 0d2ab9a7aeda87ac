/* qm_pressure.h - the memory watcher of auto budgets (qm_pressure.c): while
 * sessions with budget "auto" are open it listens for memory pressure and
 * re-reads the memory bounds, and shrinks or grows their budgets through
 * the path of session.resize (a job on the session's FIFO: what is in
 * flight finishes under the old budget; outputs never change).
 * docs/OPERATIONS.md "Budgets that size themselves".
 *
 * Pressure comes from PSI triggers (/proc/pressure/memory, and the v2
 * memory.pressure of qmoed's own cgroup: a stall of auto_budget_pressure_ms
 * in a 2 s window) or cgroup v1's memory.pressure_level events
 * (cgroup.event_control and an eventfd, at auto_budget_pressure_level), each
 * a descriptor the loop polls; each source that cannot be armed is logged
 * once with the reason. Every auto_budget_check_ms the bounds are read
 * again (an operator may lower a limit, the daemon may have been moved to
 * another cgroup: the cgroup source follows it). Tests inject events
 * through QMOED_TEST_PRESSURE, a FIFO each line written to which is one
 * event.
 *
 * What a step does is qm_budget_step (qm_budget.h): a limit leaving less
 * than half the reserve shrinks the auto sessions by what is missing; a
 * pressure event by auto_budget_shrink_percent; auto_budget_grow_after_s
 * without either grows them back toward their auto size; pressure soon
 * after a growth is a relapse, which lengthens the wait and stops the next
 * growth lower (qm_budget.h, "Relapses"). Events within
 * auto_budget_grace_ms of an auto budget's making or growth are counted and
 * not acted on: that allocation (mlocked slots filled from disk) and the
 * engine loading beside it push page cache out of a capped cgroup, which
 * the kernel reports as pressure (measured: docs/OPERATIONS.md, "Under
 * pressure"). One resize per
 * session at a time; each change is logged and counted (auto_shrinks,
 * auto_grows, auto_shrunk_bytes, auto_grown_bytes, auto_relapses;
 * memory_pressure_events).
 * Loop thread only. */
#ifndef QM_PRESSURE_H
#define QM_PRESSURE_H

#include <stdint.h>

#include <uv.h>

#include "qm_memory.h"

typedef struct qm_method_ctx qm_method_ctx; /* qm_methods.h */
typedef struct qm__psource qm__psource;     /* a polled descriptor (qm_pressure.c) */

enum { QM__PSOURCE_SYSTEM, QM__PSOURCE_CGROUP, QM__PSOURCE_TEST, QM__PSOURCE_COUNT };

typedef struct qm_pressure {
    const qm_method_ctx *mx; /* borrowed: the daemon's */
    uv_loop_t *loop;
    uv_timer_t timer;
    int started, stopped;
    qm__psource *src[QM__PSOURCE_COUNT];
    char cgroup[QM_MEM_PATH_MAX]; /* the cgroup the cgroup source listens to */
    int rearm_cgroup;             /* its source closed with the last auto session */
    int logged[QM__PSOURCE_COUNT]; /* why a source is off: said once */
    int announced[QM__PSOURCE_COUNT]; /* that it listens: said once */
    uint64_t last_pressure_us;     /* the last event (0: none yet) */
    uint64_t last_step_us;         /* the last step a pressure event took */
    int pressure_pending;          /* an event not yet acted on */
    /* Events before this are counted and not acted on: an auto budget was
     * just made or grown (auto_budget_grace_ms). */
    uint64_t grace_until_us;
    /* Relapses (qm_budget.h): growths pressure followed, 0 to
     * QM_BUDGET_RELAPSES_MAX (the quiet wait doubles with each); when the
     * watcher last grew a budget (0: not since the last relapse). */
    uint32_t relapses;
    uint64_t last_grow_us;
} qm_pressure;

/* Starts the timer; the sources are armed at the first step that finds an
 * auto session, and closed at the first that finds none. `mx` must have
 * its pool. */
void qm_pressure_start(qm_pressure *p, uv_loop_t *loop, const qm_method_ctx *mx);
/* Closes its handles (the daemon's finish, before it closes the rest). */
void qm_pressure_stop(qm_pressure *p);
/* After the loop ran out: frees what the stop's closes left. */
void qm_pressure_free(qm_pressure *p);
/* One step now: what the timer and each event run. Returns the sessions
 * with an auto budget it found (0: none; the sources close and the timer
 * stops until qm_pressure_watch). */
size_t qm_pressure_step(qm_pressure *p, uint64_t now_us);
/* A session's budget became "auto" (created or resized so): the timer runs
 * again if it had stopped, and pressure events wait auto_budget_grace_ms
 * (what the session's allocation and its engine's loading evicted is not
 * a shortage). An idle daemon without auto budgets has no timer running
 * (docs/ARCHITECTURE.md, "The loop's timers"). */
void qm_pressure_watch(qm_pressure *p);

#endif
