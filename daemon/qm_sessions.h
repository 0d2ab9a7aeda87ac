/* qm_sessions.h - the sessions (qm_sessions.c), the registry's second list
 * (qm_registry.h), and their admission against the devices' budgets: each
 * device that holds some of the session's layers (one device holds them
 * all) is charged its share of the budget plus a workspace.
 *
 * A session is opaque and owned by the loop thread: the list and the jobs
 * queued for it each hold a reference. While one of its jobs runs, the
 * worker running it alone uses its pagers (the calls marked "worker"). */
#ifndef QM_SESSIONS_H
#define QM_SESSIONS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "qm_budget.h"
#include "qm_config.h"
#include "qm_devices.h"
#include "qm_moe.h"
#include "qm_pager.h"
#include "qm_placement.h"
#include "qm_pool.h"
#include "qm_protocol.h"
#include "qm_models.h"
#include "qm_residency.h"
#include "qm_shm.h"
#include "qm_telemetry.h"
#include "qm_touches.h"

typedef struct qm_session qm_session;

/* The open sessions, newest first, and what their admission borrows: the
 * configuration (reloaded in place), the devices, the limit counters and
 * the trace ring, all the daemon's for as long as the list lives. */
typedef struct qm_sessions {
    const qm_config *cfg;
    qm_devices *devices;
    qm_limits *limits;
    qm_trace *trace;
    qm_session *first; /* the next of each is qm_session_next(s) */
    size_t n;          /* sessions, those being created included */
    /* Sessions per owner, those being created included (max_sessions_per_uid). */
    struct qm_sessions_owner {
        uid_t uid;
        uint32_t n;
    } *owners;
    size_t n_owners;
    uint64_t next_map_id;    /* qm_sessions_new_map_id */
    struct qm_expert_pool *shares; /* shared-residency pools (qm_expert_pool.h) */
    /* Called as each session closes, however it closes (session.close,
     * model.unload with force, the orphan reclaim, the daemon's exit),
     * after it left the list and while it still lives: the daemon ends
     * its call rings there (qm_ring.h). NULL: nothing. */
    void (*on_close)(void *arg, qm_session *s);
    void *on_close_arg;
} qm_sessions;

/* Closes every session of model m, or every session when m is NULL
 * (model.unload with force, the daemon's exit). */
void qm_sessions_close_model(qm_sessions *ss, const qm_model *m);
/* Frees the sessions-per-owner table (the daemon's exit, after every
 * session closed). */
void qm_sessions_free_owners(qm_sessions *ss);
/* How many sessions use model m. */
size_t qm_sessions_of_model(const qm_sessions *ss, const qm_model *m);
/* A daemon-wide unique id for a session's shared-memory map (qm_shm.h). */
uint64_t qm_sessions_new_map_id(qm_sessions *ss);

/* session.create's parameters as the sessions read them: decoded once from
 * the wire (qm_method_session.c), names resolved to the registries'
 * values, defaults filled. Strings and hot lists are borrowed from the
 * request, for as long as qm_session_prepare runs. */
typedef struct qm_session_spec {
    const char *model;
    const char *policy; /* a name the residency registry offers */
    /* budget: expert bytes; has_budget 0: the model's expert bytes */
    int has_budget;
    uint64_t budget_bytes;
    /* budget "auto": what it came to and why (qm_sessions_budget); NULL otherwise */
    const qm_budget_auto *auto_budget;
    qm_precision precision;
    int prefetch;        /* policy_params.prefetch (default 1) */
    int on_miss;         /* QM_ON_MISS_* (default page) */
    int share;           /* policy_params.share_residency */
    int has_min_split_bytes;
    uint64_t min_split_bytes;
    qm_policy_value values[QM_POLICY_VALUES_MAX]; /* the policy's knobs given, names static */
    size_t n_values;
    const qm_hot_layer *hot; /* policy_params.hot, NULL when absent */
    size_t n_hot;
    const char *record_trace; /* a file name in the state dir, NULL when absent */
    /* A session re-created after a restart (docs/ENGINES.md "Across a
     * daemon restart"): the id it takes again (session.create `session`,
     * 32 lowercase hex digits; NULL: a new random one), and the experts
     * `warm` lists, range-checked here and loaded by qm_session_warm. */
    const char *id;
    const qm_hot_layer *warm;
    size_t n_warm;
    int warm_from_profile; /* policy_params.warm_from_profile: 0, 1, or -1 = the config's */
} qm_session_spec;

/* session.create in three steps: prepare (loop: checks, policy, plan,
 * admission reserved; *out has the registry's reference), build (worker:
 * the pagers, which may copy whole banks and pins), then commit (loop:
 * registered) or abort (loop: reservation released, that reference
 * dropped). */
int qm_session_prepare(qm_sessions *ss, const qm_models *ms, const qm_session_spec *spec,
                       uid_t owner, qm_session **out, qm_status *st);
int qm_session_build(const qm_sessions *ss, qm_session *s, qm_status *st);
/* Worker, after qm_session_build: loads session.create's `warm` lists
 * (qm_pager_warm, in order, while free slots last) and waits for them.
 * Nothing for a shared-residency session. Returns the experts loaded or a
 * negative error (a read that failed). */
int qm_session_warm(qm_session *s, const qm_hot_layer *warm, size_t n, qm_status *st);
/* Worker, after qm_session_build, for a session.create without `warm`:
 * the experts qm_session_prepare chose from the model's hotness profile
 * (config warm_from_profile), loaded the same way. Returns the experts
 * loaded (0: none chosen) or a negative error. */
int qm_session_warm_from_profile(qm_session *s, qm_status *st);
void qm_session_commit(qm_sessions *ss, qm_session *s);
void qm_session_abort(qm_sessions *ss, qm_session *s);
qm_session *qm_session_find(const qm_sessions *ss, const char *id); /* borrowed; NULL: none */
/* 0 when no registered session has `id`, else QM_ECONFLICT naming field
 * "session" (session.create re-creating a session under its old id). */
int qm_session_id_free(const qm_sessions *ss, const char *id, qm_status *st);
/* Unregisters, gives its budget back and drops the registry's reference
 * (jobs may hold more; they answer not_found). */
void qm_session_close(qm_sessions *ss, qm_session *s);
void qm_session_ref(qm_session *s);
void qm_session_unref(qm_session *s); /* accepts NULL */

/* session.resize on the loop thread. reserve: before the job is queued,
 * admits a growth to `budget` on each device that holds layers (reserved
 * now, so a later creation cannot take it; QM_ERESOURCE_EXHAUSTED naming
 * the bytes free otherwise). finish: when the job is done (ok: the worker
 * applied it) or was never queued (ok = 0): the budget in force becomes
 * `budget` when ok, and once no resize is pending the reservation shrinks
 * to the budget in force. */
int qm_session_resize_reserve(qm_sessions *ss, qm_session *s, uint64_t budget, qm_status *st);
void qm_session_resize_finish(qm_sessions *ss, qm_session *s, int ok, uint64_t budget);

/* The expert bytes every session holds resident, as of each one's last job
 * (an auto budget's reserve counts the rest of a cgroup's use apart from
 * them). */
uint64_t qm_sessions_resident_bytes(const qm_sessions *ss);

/* The bytes a budget's wire form asks for (qm_budget.h): "N%" of model m,
 * "auto" from the memory bounds now and the devices' free budget, for a
 * creation (s NULL, with a workspace to come) or a resize of s (its
 * resident bytes counted as its own, its admission free for it); for
 * "auto" what it came to in *autob (zeroed otherwise), `pending` (the
 * call's client_pending_bytes) left free beside the reserve. */
int qm_sessions_budget(const qm_sessions *ss, const qm_model *m, const qm_session *s,
                       const qm_budget_spec *spec, uint64_t pending, uint64_t *bytes,
                       qm_budget_auto *autob, qm_status *st);

/* The session's pagers, one per device that holds layers (worker, while
 * the session's job runs): the forward call, the counters summed over its
 * devices, a budget change (the placement's shares and the plan's budget
 * follow), and the pager that serves `layer` (NULL when none).
 * qm_session_after_forward: the prefetch a forward call left, run by the
 * same job (qm_pager_options.defer_prefetch); qm_session_tidy: that and
 * the work that only speeds later calls, once the engine is not waiting
 * (qm_pager_tidy). */
int qm_session_forward(qm_session *s, const qm_moe_call *call, qm_moe_stats *mstats,
                       qm_status *st);
void qm_session_after_forward(qm_session *s);
void qm_session_tidy(qm_session *s);
void qm_session_stats(const qm_session *s, qm_pager_stats *out);
int qm_session_resize(qm_session *s, uint64_t budget, qm_status *st);
qm_pager *qm_session_pager_of(const qm_session *s, uint32_t layer);
/* Its residency read still (session.plan, worker): between hold and
 * release nothing changes the pool it draws from (a shared pool's other
 * members wait). built: its pagers exist (it joined its pool). */
void qm_session_hold(qm_session *s);
void qm_session_release(qm_session *s);
int qm_session_built(const qm_session *s);

/* What the rest of the daemon reads of a session (loop thread; the
 * strings live as long as the session). */
qm_session *qm_session_next(const qm_session *s); /* the list's next; NULL at the end */
const char *qm_session_id(const qm_session *s);
uid_t qm_session_owner(const qm_session *s);
qm_model *qm_session_model(const qm_session *s); /* borrowed */
const char *qm_session_policy(const qm_session *s);
qm_precision qm_session_precision(const qm_session *s); /* any thread: fixed */
uint64_t qm_session_budget(const qm_session *s);      /* the budget in force */
uint64_t qm_session_workspace(const qm_session *s);
int64_t qm_session_created_at(const qm_session *s); /* unix seconds */
const qm_residency_plan *qm_session_plan(const qm_session *s);
/* Its layers over the daemon's devices and the name of device i there. */
const qm_placement *qm_session_placement(const qm_session *s);
const char *qm_session_device_name(const qm_session *s, uint32_t i);
int qm_session_on_miss(const qm_session *s); /* QM_ON_MISS_* */
const qm_span *qm_session_plan_span(const qm_session *s);
qm_counters *qm_session_counters(qm_session *s);
uint64_t qm_session_resident_bytes(const qm_session *s); /* as of the last job */
/* The pagers' statistics as of the last job handed back, and the next
 * reading stored in their place (the previous copied to *was; may be NULL). */
const qm_pager_stats *qm_session_last_stats(const qm_session *s);
void qm_session_note_stats(qm_session *s, const qm_pager_stats *now, qm_pager_stats *was);
qm_job_queue *qm_session_queue(qm_session *s); /* its FIFO in the pool */
size_t qm_session_queued(const qm_session *s); /* jobs queued and not yet handed back */
qm_shm_set *qm_session_maps(qm_session *s);    /* session.map's maps */
int qm_session_closed(const qm_session *s);    /* any thread */
/* The open connections that used it and its orphan mark (qm_touches.h):
 * dispatch records every request that names it, session.create its
 * creator. */
qm_touches *qm_session_touches(qm_session *s);
/* Its auto budget (qm_budget.h; `on` 0 when its budget is not auto): the
 * watcher (qm_pressure.h) and session.resize change it, loop thread. */
qm_budget_auto *qm_session_auto_budget(qm_session *s);
/* Replaces the session's auto budget (NULL: no longer auto), and writes
 * it as session.plan's budget_auto (1) or nothing (0, not auto): the loop
 * replaces it while a worker may write the plan of a later request. */
void qm_session_set_auto_budget(qm_session *s, const qm_budget_auto *a);
int qm_session_auto_budget_json(qm_session *s, qm_jw *w);
/* The least budget its pagers take (whole banks + pins + one expert unit;
 * qm_pager_min_budget over its plan); its budget now when that cannot be
 * computed. */
uint64_t qm_session_min_budget(const qm_sessions *ss, const qm_session *s);

#endif
