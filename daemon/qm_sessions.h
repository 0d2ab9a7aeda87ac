/* qm_sessions.h - the registry's sessions (qm_sessions.c) and their
 * admission against the devices' budgets: each device that holds some of
 * the session's layers (one device holds them all) is charged its share of
 * the budget plus a workspace.
 *
 * A session is opaque and owned by the loop thread: the registry and the
 * jobs queued for it each hold a reference. While one of its jobs runs,
 * the worker running it alone uses its pagers (the calls marked "worker"). */
#ifndef QM_SESSIONS_H
#define QM_SESSIONS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "qm_budget.h"
#include "qm_moe.h"
#include "qm_pager.h"
#include "qm_pool.h"
#include "qm_protocol.h"
#include "qm_reclaim.h"
#include "qm_registry.h"
#include "qm_residency.h"
#include "qm_shm.h"
#include "qm_telemetry.h"

/* session.create in three steps: prepare (loop: checks, policy, plan,
 * admission reserved; *out has the registry's reference), build (worker:
 * the pagers, which may copy whole banks and pins), then commit (loop:
 * registered) or abort (loop: reservation released, that reference
 * dropped). */
int qm_session_prepare(qm_registry *r, const qm_params *p, uid_t owner, qm_session **out,
                       qm_status *st);
int qm_session_build(const qm_registry *r, qm_session *s, qm_status *st);
void qm_session_commit(qm_registry *r, qm_session *s);
void qm_session_abort(qm_registry *r, qm_session *s);
qm_session *qm_session_find(const qm_registry *r, const char *id); /* borrowed; NULL: none */
/* Unregisters, gives its budget back and drops the registry's reference
 * (jobs may hold more; they answer not_found). */
void qm_session_close(qm_registry *r, qm_session *s);
void qm_session_ref(qm_session *s);
void qm_session_unref(qm_session *s); /* accepts NULL */

/* session.resize on the loop thread. reserve: before the job is queued,
 * admits a growth to `budget` on each device that holds layers (reserved
 * now, so a later creation cannot take it; QM_ERESOURCE_EXHAUSTED naming
 * the bytes free otherwise). finish: when the job is done (ok: the worker
 * applied it) or was never queued (ok = 0): the budget in force becomes
 * `budget` when ok, and once no resize is pending the reservation shrinks
 * to the budget in force. */
int qm_session_resize_reserve(qm_registry *r, qm_session *s, uint64_t budget, qm_status *st);
/* The bytes session.resize's budget form asks for s (qm_budget.h: "N%" of
 * its model, "auto" counting the session's resident bytes as its own),
 * and for "auto" what it came to in *autob (zeroed otherwise). */
int qm_session_budget_for(const qm_registry *r, const qm_session *s, const qm_budget_spec *spec,
                          uint64_t *bytes, qm_budget_auto *autob, qm_status *st);
void qm_session_resize_finish(qm_registry *r, qm_session *s, int ok, uint64_t budget);

/* The session's pagers, one per device that holds layers (worker, while
 * the session's job runs): the forward call, the counters summed over its
 * devices, a budget change (the placement's shares and the plan's budget
 * follow), the pager
 * that serves `layer` (NULL when none), and the plan JSON with the
 * residency now (*json is the caller's). */
int qm_session_forward(qm_session *s, const qm_moe_call *call, qm_moe_stats *mstats,
                       qm_status *st);
void qm_session_stats(const qm_session *s, qm_pager_stats *out);
int qm_session_resize(qm_session *s, uint64_t budget, qm_status *st);
qm_pager *qm_session_pager_of(const qm_session *s, uint32_t layer);
int qm_session_plan_json(qm_session *s, char **json, size_t *len, qm_status *st);

/* What the rest of the daemon reads of a session (loop thread; the
 * strings live as long as the session). */
qm_session *qm_session_next(const qm_session *s); /* the registry's next; NULL at the end */
const char *qm_session_id(const qm_session *s);
uid_t qm_session_owner(const qm_session *s);
qm_model *qm_session_model(const qm_session *s); /* borrowed */
const char *qm_session_policy(const qm_session *s);
qm_precision qm_session_precision(const qm_session *s); /* any thread: fixed */
uint64_t qm_session_budget(const qm_session *s);      /* the budget in force */
uint64_t qm_session_workspace(const qm_session *s);
int64_t qm_session_created_at(const qm_session *s); /* unix seconds */
const qm_residency_plan *qm_session_plan(const qm_session *s);
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
/* The open connections that used it and its orphan mark (qm_reclaim.h):
 * dispatch records every request that names it, session.create its
 * creator. */
qm_touches *qm_session_touches(qm_session *s);
/* Its auto budget (qm_budget.h; `on` 0 when its budget is not auto): the
 * watcher and session.resize change it, loop thread. */
qm_budget_auto *qm_session_auto_budget(qm_session *s);
/* The least budget its pagers take (whole banks + pins + one expert unit;
 * qm_pager_min_budget over its plan); its budget now when that cannot be
 * computed. */
uint64_t qm_session_min_budget(const qm_registry *r, const qm_session *s);

#endif
