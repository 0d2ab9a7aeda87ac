/* qm_budget.h - what a session's budget comes to (qm_budget.c): the
 * wire's forms (bytes, "N%" of the model's expert bytes, "auto") resolved
 * to bytes, the auto size and why, and how auto budgets follow memory
 * pressure (the step the watcher of qm_pressure.h takes). docs/OPERATIONS.md
 * "Budgets that size themselves".
 *
 * "auto": what the tightest bound on qmoed's memory has available now
 * (qm_memory.h: MemAvailable, every memory cgroup from qmoed's own up),
 * less what the reserve keeps free and the session's workspace, capped by
 * the model's expert bytes and by what the devices' budgets have free.
 * auto_budget_reserve is the share of everything but qmoed's experts: in a
 * memory cgroup, what that rest uses now (the cgroup's working set less
 * the experts qmoed's sessions hold) already counts toward it, and only the
 * part not in use is kept free; against MemAvailable (the whole machine,
 * whose other processes are not told apart) the whole reserve is kept free.
 * On a device whose memory is not the host's (a GPU) only the device's
 * free budget and the model bound it. Loop thread. */
#ifndef QM_BUDGET_H
#define QM_BUDGET_H

#include <stddef.h>
#include <stdint.h>

#include "qm_config.h"
#include "qm_memory.h"
#include "qm_protocol.h"

/* What set an auto size. */
typedef enum qm_auto_bound {
    QM_AUTO_BY_MEMORY, /* the tightest memory bound (`bound`) less the reserve */
    QM_AUTO_BY_MODEL,  /* the model's expert bytes: everything fits */
    QM_AUTO_BY_DEVICE  /* what the devices' budgets had free */
} qm_auto_bound;

/* A session's auto budget, embedded in the session (zeroed: its budget is
 * not auto). Loop thread. */
typedef struct qm_budget_auto {
    int on;
    uint64_t target;  /* the auto size: pressure shrinks from it, quiet grows back to it */
    uint64_t reserve; /* auto_budget_reserve when it was sized */
    uint64_t reserve_free; /* the part of it kept free (qm_budget_reserve_free) */
    uint64_t experts;      /* the expert bytes qmoed's sessions held then */
    uint64_t workspace;
    uint64_t client_pending; /* the client's pending bytes left free (its session.create's
                              * or session.resize's client_pending_bytes) */
    qm_auto_bound by;
    qm_mem_bound bound; /* the bound with the least room then (qm_budget_headroom) */
    int has_bound;      /* 0: the device's memory is not the host's */
    char why[720];      /* "budget auto: 3.10 GB = cgroup limit 4.00 GB - in use ... " */
    /* The watcher's (qm_pressure.c) */
    uint64_t floor;      /* the least a pressure shrink asks for; 0 until known */
    /* A relapse's mark (qm_budget_grow_target): quiet growth stops here,
     * 0 when none; when it was set or last reached. */
    uint64_t ceiling, ceiling_us;
    int pending;         /* a resize of the watcher's is queued */
    char change_why[200]; /* why the watcher's last resize was asked for (its log line) */
} qm_budget_auto;

/* What one session.create or session.resize asks for. */
typedef struct qm_budget_ask {
    const qm_budget_spec *spec; /* form NONE: the whole model */
    uint64_t model_bytes;       /* the model's expert bytes (bytes_total) */
    uint64_t workspace;         /* create: the workspace it will take; resize: 0 */
    uint64_t pending;           /* what the client takes after the call, left free
                                 * (client_pending_bytes of a create or a resize) */
    uint64_t credit;            /* resize: bytes of its own already counted in use */
    uint64_t held;              /* the expert bytes all qmoed's sessions hold now (its own too) */
    uint64_t device_free;       /* what the devices' budgets have free for it */
    int host_memory;            /* 1: the devices compute in host memory (the CPU) */
} qm_budget_ask;

/* The budget in bytes. For "auto" reads the memory bounds now and fills
 * *autob (else zeroes it). QM_ERESOURCE_EXHAUSTED, field "budget", when
 * auto finds nothing left (the sentence shows the arithmetic); QM_EIO when
 * no memory bound can be read. */
int qm_budget_resolve(const qm_config *cfg, const qm_budget_ask *ask, uint64_t *bytes,
                      qm_budget_auto *autob, qm_status *st);

/* The auto size from a reading of the memory bounds (`mem` NULL when the
 * devices' memory is not the host's): the arithmetic of qm_budget_resolve,
 * without reading anything (the unit tests). */
int qm_budget_auto_size(const qm_mem_state *mem, uint64_t reserve, const qm_budget_ask *ask,
                        uint64_t *bytes, qm_budget_auto *out, qm_status *st);

/* session.plan's, session.create's and session.resize's "budget_auto"
 * object (the value, no key). */
void qm_budget_auto_json(qm_jw *w, const qm_budget_auto *a);

/* The part of `reserve` a bound keeps free: against MemAvailable all of
 * it; in a cgroup, what the rest (its working set less the `held` expert
 * bytes, at least 0) does not use yet. */
uint64_t qm_budget_reserve_free(const qm_mem_bound *b, uint64_t reserve, uint64_t held);

/* The least, over the bounds, of what a bound has available less the
 * reserve it keeps free (negative: the reserve's free part is being
 * eaten); *which the bound it is (left alone when there is none: then 0).
 * What auto sizes from and the watcher steps on. */
int64_t qm_budget_headroom(const qm_mem_state *mem, uint64_t reserve, uint64_t held,
                           uint32_t *which);

/* One auto session as the watcher sees it. */
typedef struct qm_budget_view {
    uint64_t budget; /* in force */
    uint64_t target; /* its auto size */
    uint64_t floor;  /* the least it may go to */
    int pending;     /* a resize of it is queued: left alone this step */
} qm_budget_view;

/* One step of the watcher, pure. `headroom`: qm_budget_headroom's (negative:
 * the reserve's free part is being eaten). Below
 * -slack: the sessions give back the deficit between them, in proportion
 * to what each holds above its floor. Else a pressure event: each gives
 * back shrink_percent of its budget. Else, when `quiet` (no pressure and
 * no shrink for auto_budget_grow_after_s) and headroom is above slack: the
 * sessions below their target share the headroom, in proportion to what
 * each lacks. next[i] is the new budget (== budget: unchanged); returns how
 * many changed. */
size_t qm_budget_step(int64_t headroom, uint64_t slack, int pressure, int quiet,
                      uint32_t shrink_percent, const qm_budget_view *v, size_t n, uint64_t *next);

/* Relapses: memory pressure that shrinks auto budgets within twice
 * auto_budget_grow_after_s of the watcher growing them says the growth
 * brought it back (a reserve set too small, a rest that needs the memory
 * again). Without a brake the budgets would cycle: shrink, a quiet wait,
 * grow into the same pressure, and every cycle evicts and reads again
 * what the growth paged in. So each relapse doubles the quiet wait before
 * the next growth (up to QM_BUDGET_RELAPSES_MAX doublings) and marks, per
 * session, the budget the relapse's shrink left (its ceiling): quiet growth
 * goes that far, and above it only after the budget has held at the
 * ceiling for a whole wait without pressure; a growth past it that brings
 * pressure again is the next relapse, whose shrink sets a lower ceiling.
 * Once every auto budget has been at its auto size for twice
 * auto_budget_grow_after_s without pressure, the wait is the plain one. */
#define QM_BUDGET_RELAPSES_MAX 3u

/* The quiet wait before a growth, microseconds, after `relapses` relapses. */
uint64_t qm_budget_grow_wait_us(uint32_t grow_after_s, uint32_t relapses);

/* Whether a pressure shrink at `now` is a relapse: the watcher last grew
 * an auto budget at `grew_us` (0: not since the last relapse). */
int qm_budget_is_relapse(uint64_t now, uint64_t grew_us, uint32_t grow_after_s);

/* The size quiet growth aims for: the auto size, or a's ceiling while it
 * holds. A budget that has been at its ceiling for `wait_us` lifts it (a
 * is cleared of it) and aims for the auto size again. */
uint64_t qm_budget_grow_target(qm_budget_auto *a, uint64_t budget, uint64_t now, uint64_t wait_us);

#endif
