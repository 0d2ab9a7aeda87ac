/* qm_sessions.h - sessions and their admission against the devices'
 * budgets (qm_registry.c): each device that holds some of the session's
 * layers (one device holds them all) is charged its share of the budget
 * plus a workspace.
 *
 * A session is owned by the loop thread (the registry and the jobs queued
 * for it each hold a reference); while one of its jobs runs, the worker
 * running it alone uses its pager. Members marked (pool lock) belong to the
 * worker pool (qm_pool.h). */
#ifndef QM_SESSIONS_H
#define QM_SESSIONS_H

#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include "qm_config.h"
#include "qm_pager.h"
#include "qm_placement.h"
#include "qm_pool.h"
#include "qm_protocol.h"
#include "qm_residency.h"
#include "qm_shm.h"
#include "qm_telemetry.h"

typedef struct qm_daemon qm_daemon;
typedef struct qm_model qm_model; /* qm_models.h */

struct qm_session {
    char id[QM_SESSION_ID_LEN + 1];
    uid_t owner_uid;
    qm_model *model;
    char policy_name[16];
    int precision_fast;       /* session.create precision "fast" (fixed for the session) */
    qm_policy policy;
    qm_residency_plan *plan;
    /* Its layers over the daemon's devices (engine/qm_placement.h; one
     * device holds them all), and one pager per device that holds layers
     * (worker, while a job of this session runs). */
    qm_placement placement;
    qm_multipager *pagers;
    uint64_t device_admitted[QM_CONFIG_MAX_DEVICES]; /* its part of each device's budget */
    char device_names[QM_CONFIG_MAX_DEVICES][16];    /* the daemon's, for its plan */
    qm_pager_options pager_options;
    char *trace_path;         /* policy_params.record_trace in the state dir, or NULL */
    uint64_t plan_start_us, plan_us;
    uint64_t budget_bytes;    /* expert-weight budget */
    uint64_t workspace_bytes; /* fixed at creation */
    uint64_t admitted_bytes;  /* budget + workspace, counted against the device budget; while
                               * resizes are queued, the largest budget they may set instead */
    uint32_t resizes_pending; /* session.resize jobs queued and not yet done (loop thread) */
    int64_t created_at;       /* unix seconds */
    int refs;                 /* registry + queued jobs (loop thread) */
    atomic_int closed;        /* set by the loop; workers answer not_found after it */
    qm_counters counters;
    qm_pager_stats last_stats; /* the pager's cumulative stats after the last job */
    qm_span plan_span;
    qm_job_queue queue;        /* its FIFO of jobs (qm_pool.h) */
    qm_shm_map *maps;          /* session.map's (qm_shm.h; loop thread) */
    uint32_t n_maps;
    uint64_t mapped_bytes;     /* counted against max_mapped_bytes */
    qm_session *next;
};

/* session.create in three steps: prepare (loop: checks, policy, plan,
 * admission reserved), build (worker: the pager, which may copy whole banks
 * and pins), then commit (loop: registered) or abort (loop: reservation
 * released, session freed). */
int qm_session_prepare(qm_daemon *d, const qm_params *p, uid_t owner, qm_session **out,
                       qm_status *st);
int qm_session_build(qm_daemon *d, qm_session *s, qm_status *st);
void qm_session_commit(qm_daemon *d, qm_session *s);
void qm_session_abort(qm_daemon *d, qm_session *s);
qm_session *qm_session_find(qm_daemon *d, const char *id); /* borrowed; NULL when none */
/* Unregisters and releases the registry's reference (jobs may hold more). */
void qm_session_close(qm_daemon *d, qm_session *s);
void qm_session_unref(qm_daemon *d, qm_session *s);
/* session.resize on the loop thread. reserve: before the job is queued,
 * admits a growth to `budget` against the daemon-wide budget (reserved now,
 * so a later creation cannot take it; QM_ERESOURCE_EXHAUSTED naming the
 * bytes free otherwise). finish: when the job is done (ok: the worker
 * applied it) or was never queued (ok = 0): the budget in force becomes
 * `budget` when ok, and once no resize is pending the reservation shrinks to
 * the budget in force. */
int qm_session_resize_reserve(qm_daemon *d, qm_session *s, uint64_t budget, qm_status *st);
void qm_session_resize_finish(qm_daemon *d, qm_session *s, int ok, uint64_t budget);
/* The session's pagers, one per device that holds layers (worker, while
 * the session's job runs): the forward call, the counters summed over its
 * devices, and the pager that serves `layer` (NULL when none). */
int qm_session_forward(qm_session *s, const qm_moe_call *call, qm_moe_stats *mstats,
                       qm_status *st);
void qm_session_stats(const qm_session *s, qm_pager_stats *out);
/* qm_multipager_resize over its devices (the placement's budgets follow);
 * on a worker, in the session's FIFO. */
int qm_session_resize(qm_session *s, uint64_t budget, qm_status *st);
qm_pager *qm_session_pager_of(const qm_session *s, uint32_t layer);
/* Closes every session and unloads every model (at exit). */
void qm_registry_free_all(qm_daemon *d);
/* The session's plan JSON with its pager's residency now (worker thread, or
 * any thread while no job of the session runs); *json is the caller's. */
int qm_session_plan_json(qm_session *s, char **json, size_t *len, qm_status *st);

#endif
