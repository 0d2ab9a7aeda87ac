/* qm_sessions.c - the sessions: unguessable ids, owner, a recipe (policy,
 * plan, placement over the daemon's devices, pager options) made by one
 * function for every session, the pool of experts it draws from (its own,
 * or one shared with the model's sessions that share), and admission of
 * their budgets against the devices'. Loop thread only, except what
 * qm_sessions.h gives a worker. */
#include "qm_sessions.h"

#include <errno.h>
#ifdef __GLIBC__
#include <malloc.h> /* malloc_trim */
#include <pthread.h>
#endif
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_expert_pool.h"
#include "qm_fault.h"
#include "qm_log.h"
#include "qm_placement.h"

struct qm_session {
    char id[QM_SESSION_ID_LEN + 1];
    uid_t owner_uid;
    qm_model *model;
    char policy_name[16];
    qm_precision precision;   /* fixed for the session */
    /* Its policy, plan, layers over the daemon's devices (one device holds
     * them all) and pager options; the pool it draws from (its own, which
     * borrows the recipe and has one pager per device that holds layers,
     * or a shared one) and its membership there (worker, while a job of
     * this session runs). */
    qm_pool_recipe recipe;
    qm_expert_pool *pool;
    qm_pool_member member;
    uint64_t device_admitted[QM_CONFIG_MAX_DEVICES]; /* its part of each device's budget */
    char device_names[QM_CONFIG_MAX_DEVICES][16];    /* the daemon's, for its plan */
    char *trace_path;         /* policy_params.record_trace in the state dir, or NULL */
    int trace_by_daemon;      /* trace_path is record_routing's: failing it fails no session */
    int recreated;            /* created under an id a session had (after a restart) */
    /* warm_from_profile: the model's hottest experts at creation, hottest
     * first across layers, one entry each (qm_session_warm_from_profile) */
    qm_hot_layer *profile_warm;
    uint32_t *profile_warm_experts;
    size_t n_profile_warm;
    uint64_t prior_records; /* its policy's prior: the profile's records then (0: none) */
    uint64_t plan_start_us, plan_us;
    uint64_t budget_bytes;    /* expert-weight budget */
    qm_budget_auto auto_budget; /* budget "auto": its size, why, the pressure watcher's state */
    /* Held while the loop replaces auto_budget (a session.resize done) and
     * while a worker writes it into a plan: the plan of the request after
     * the resize may run before the loop hears the resize finished. */
    pthread_mutex_t auto_mu;
    uint64_t workspace_bytes; /* fixed at creation */
    uint64_t admitted_bytes;  /* what the devices hold for it (budget shares + workspaces);
                               * while resizes are queued, the largest they may set */
    uint32_t resizes_pending; /* session.resize jobs queued and not yet done */
    int64_t created_at;       /* unix seconds */
    qm_touches touches;       /* the open connections that used it, its orphan mark */
    atomic_int refs;          /* registry + queued jobs + call rings (taken by a ring's thread too) */
    atomic_int closed;        /* set by the loop; workers answer not_found after it */
    qm_counters counters;
    qm_pager_stats last_stats; /* the pagers' cumulative stats after the last job */
    qm_span plan_span;
    qm_job_queue queue;        /* its FIFO of jobs (qm_pool.h) */
    qm_shm_set maps;           /* session.map's (qm_shm.h) */
    qm_session *next;
};

qm_session *qm_session_find(const qm_sessions *ss, const char *id)
{
    for (qm_session *s = ss->first; s; s = s->next)
        if (strcmp(s->id, id) == 0)
            return s;
    return NULL;
}

int qm_session_id_free(const qm_sessions *ss, const char *id, qm_status *st)
{
    if (!qm_session_find(ss, id))
        return 0;
    return qm_status_set_field(st, QM_ECONFLICT, "session",
                               "session %s exists; re-creating a session under its id needs a "
                               "daemon that no longer has it",
                               id);
}

static void session_free(qm_session *s)
{
    qm_shm_set_release_all(&s->maps);
    qm_shm_set_destroy(&s->maps);
    qm_touches_free(&s->touches);
    /* The operator's recording (record_routing) of a session that recorded
     * no token goes with it: a daemon whose clients open sessions and close
     * them unused would otherwise leave a file a session (a re-creation
     * after a restart finds none and starts anew). A pool others share
     * may still write to the file: its file stays. */
    int drop_trace = 0;
    if (s->trace_path && s->trace_by_daemon && s->pool && s->member.joined &&
        !qm_expert_pool_is_shared(s->pool)) {
        qm_pager_stats ps;
        qm_session_stats(s, &ps);
        drop_trace = ps.trace_tokens == 0;
    }
    qm_status st = {0};
    if (s->pool && qm_expert_pool_leave(s->pool, &s->member, &st) < 0)
        qm_log(QM_LOG_WARNING, "shared residency pool: giving back a member's %llu bytes "
               "failed (%s); the pool keeps them until its next member leaves",
               (unsigned long long)s->member.budget, st.msg);
    qm_expert_pool_unref(s->pool);
    if (drop_trace && unlink(s->trace_path) == 0)
        qm_log(QM_LOG_DEBUG, "session %s recorded no token: its routing trace %s removed", s->id,
               s->trace_path);
    qm_pool_recipe_free(&s->recipe);
    pthread_mutex_destroy(&s->auto_mu);
    qm_free(s->trace_path);
    qm_free(s->profile_warm);
    qm_free(s->profile_warm_experts);
    qm_model_unref(s->model);
    qm_free(s);
#ifdef __GLIBC__
    /* What the session's threads allocated is free now, much of it in the
     * heaps of the threads that ran its calls (a ring's own thread has an
     * arena of its own), where glibc keeps it resident: give the free pages
     * back, so a daemon's memory returns after its sessions go. */
    malloc_trim(0);
#endif
}

void qm_session_ref(qm_session *s) { atomic_fetch_add(&s->refs, 1); }

/* The last reference goes on the loop thread: a ring's thread only takes
 * references while its ring holds one. */
void qm_session_unref(qm_session *s)
{
    if (s && atomic_fetch_sub(&s->refs, 1) == 1)
        session_free(s);
}

/* Gives the session's reservation back, on every device it holds. */
static void session_release_admission(qm_sessions *ss, qm_session *s)
{
    for (uint32_t i = 0; i < ss->devices->n; i++)
        ss->devices->dev[i].admitted -= s->device_admitted[i];
}

/* The sessions of `uid` (0 when none), a slot made for it when `make`
 * (NULL without memory). */
static uint32_t *owner_count(qm_sessions *ss, uid_t uid, int make)
{
    for (size_t i = 0; i < ss->n_owners; i++)
        if (ss->owners[i].uid == uid)
            return &ss->owners[i].n;
    if (!make)
        return NULL;
    struct qm_sessions_owner *o =
        qm_realloc(ss->owners, (ss->n_owners + 1) * sizeof *ss->owners);
    if (!o)
        return NULL;
    ss->owners = o;
    o[ss->n_owners] = (struct qm_sessions_owner){.uid = uid, .n = 0};
    return &o[ss->n_owners++].n;
}

static void owner_less(qm_sessions *ss, uid_t uid)
{
    uint32_t *n = owner_count(ss, uid, 0);
    if (n && *n)
        (*n)--;
}

void qm_session_close(qm_sessions *ss, qm_session *s)
{
    for (qm_session **pp = &ss->first; *pp; pp = &(*pp)->next) {
        if (*pp == s) {
            *pp = s->next;
            ss->n--;
            owner_less(ss, s->owner_uid);
            session_release_admission(ss, s);
            atomic_store(&s->closed, 1);
            s->next = NULL;
            /* Its maps go now; jobs still queued hold the ones they use. */
            qm_shm_set_release_all(&s->maps);
            if (ss->on_close)
                ss->on_close(ss->on_close_arg, s);
            qm_session_unref(s);
            return;
        }
    }
}

void qm_sessions_close_model(qm_sessions *ss, const qm_model *m)
{
    for (qm_session *s = ss->first, *next; s; s = next) {
        next = s->next;
        if (!m || s->model == m)
            qm_session_close(ss, s);
    }
}

size_t qm_sessions_of_model(const qm_sessions *ss, const qm_model *m)
{
    size_t n = 0;
    for (const qm_session *s = ss->first; s; s = s->next)
        n += s->model == m;
    return n;
}

uint64_t qm_sessions_new_map_id(qm_sessions *ss) { return ++ss->next_map_id; }

static int random_id(char out[QM_SESSION_ID_LEN + 1], qm_status *st)
{
    uint8_t raw[16];
    size_t got = 0;
    while (got < sizeof raw) {
        ssize_t n = getrandom(raw + got, sizeof raw - got, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return qm_status_set(st, QM_EINTERNAL, "getrandom failed: %s", strerror(errno));
        }
        got += (size_t)n;
    }
    for (size_t i = 0; i < sizeof raw; i++)
        snprintf(out + 2 * i, 3, "%02x", raw[i]);
    return 0;
}

/* What device i has free for sessions. */
static uint64_t device_free(const qm_device *dv)
{
    return dv->budget > dv->admitted ? dv->budget - dv->admitted : 0;
}

/* A session that device i cannot take at `budget`: `need` bytes there (its
 * `share` of the budget + a workspace) against `free_bytes` (a resize counts
 * what the session holds there already). With one device the device's
 * budget is the daemon-wide budget, and the sentence says so. */
static int device_refusal(const qm_sessions *ss, uint32_t i, unsigned long long need, uint64_t share,
                          uint64_t budget, uint64_t workspace, uint64_t free_bytes, qm_status *st)
{
    const qm_device *dv = &ss->devices->dev[i];
    if (ss->devices->n == 1)
        return qm_status_set_field(st, QM_ERESOURCE_EXHAUSTED, "budget_bytes",
                                   "session needs %llu bytes (budget %llu + workspace %llu) but "
                                   "only %llu bytes of the daemon-wide budget %llu are free",
                                   need, (unsigned long long)budget,
                                   (unsigned long long)workspace, (unsigned long long)free_bytes,
                                   (unsigned long long)dv->budget);
    return qm_status_set_field(st, QM_ERESOURCE_EXHAUSTED, "budget_bytes",
                               "session needs %llu bytes on device %s (its share %llu of the "
                               "budget %llu + workspace %llu) but only %llu bytes of that "
                               "device's budget %llu are free",
                               need, dv->name, (unsigned long long)share,
                               (unsigned long long)budget, (unsigned long long)workspace,
                               (unsigned long long)free_bytes, (unsigned long long)dv->budget);
}

/* What each device has free for sessions, and the weights a session's
 * layers are placed by: what is free beyond a workspace (a device that
 * cannot hold a workspace gets no layers unless none can). */
static void device_weights(const qm_sessions *ss, uint64_t workspace, uint64_t *free_bytes,
                           uint64_t *weight)
{
    for (uint32_t i = 0; i < ss->devices->n; i++) {
        free_bytes[i] = device_free(&ss->devices->dev[i]);
        weight[i] = free_bytes[i] > workspace ? free_bytes[i] - workspace : 0;
    }
}

/* Each device that holds layers of placement pl is charged its share of the
 * budget plus a workspace (its pager's scratch) into dev_need;
 * QM_ERESOURCE_EXHAUSTED naming the device when one cannot take it. */
static int admit_on_devices(const qm_sessions *ss, const qm_placement *pl, uint64_t budget,
                            uint64_t workspace, const uint64_t *free_bytes, uint64_t *dev_need,
                            qm_status *st)
{
    for (uint32_t i = 0; i < ss->devices->n; i++) {
        unsigned long long need = 0;
        if (!pl->bytes[i])
            continue;
        if (qm_add_u64(pl->budget[i], workspace, &need) < 0 || need > free_bytes[i])
            return device_refusal(ss, i, need, pl->budget[i], budget, workspace, free_bytes[i],
                                  st);
        dev_need[i] = need;
    }
    return 0;
}

/* policy_params.share_residency: what may share (docs/PAGING.md "Shared
 * residency"), refused naming the member and the rule. */
static int share_check(const qm_sessions *ss, const qm_session_spec *spec, qm_status *st)
{
    const char *f = "policy_params.share_residency";
    const qm_device *d = &ss->devices->dev[0];
    int kind = qm_backend_kind_find(d->info.kind, strlen(d->info.kind));
    unsigned caps = kind < 0 ? 0 : qm_backend_kind_caps((size_t)kind);
    if (ss->devices->n != 1 || !(caps & QM_BACKEND_CAP_SHARED_POOL)) {
        char kinds[96] = ""; /* the registry's kinds that share pools */
        for (size_t i = 0; i < qm_backend_kind_count(); i++)
            if (qm_backend_kind_caps(i) & QM_BACKEND_CAP_SHARED_POOL)
                snprintf(kinds + strlen(kinds), sizeof kinds - strlen(kinds), "%s%s",
                         kinds[0] ? " or " : "", qm_backend_kind_name(i));
        return qm_status_set_field(st, QM_EINVAL, f,
                                   "policy_params.share_residency needs a daemon with one device "
                                   "of the %s backend; this one serves %u device%s (%s%s)",
                                   kinds, ss->devices->n, ss->devices->n == 1 ? "" : "s", d->name,
                                   ss->devices->n > 1 ? ", ..." : "");
    }
    const char *other = spec->hot ? "hot" : spec->record_trace ? "record_trace"
                        : spec->has_min_split_bytes ? "min_split_bytes" : NULL;
    if (other)
        return qm_status_set_field(st, QM_EINVAL, f,
                                   "policy_params.share_residency cannot be combined with "
                                   "policy_params.%s (the pool has one plan and one recording)",
                                   other);
    return 0;
}

/* Where a session's pager reads units and how: the configuration's
 * paging_source for a plan (auto reads a paged session's units from disk
 * on a host-visible backend, the CPU, so its budget bounds the memory the
 * bank takes instead of the page cache holding the file), and io_engine
 * and io_depth for the disk source's reads. */
static void session_disk_options(const qm_sessions *ss, const qm_residency_plan *plan,
                                 qm_pager_options *o)
{
    int source = ss->cfg->paging_source;
    if (source == QM_PAGER_SOURCE_AUTO)
        source = qm_devices_host_visible(ss->devices) && qm_plan_per_expert_count(plan) > 0
                     ? QM_PAGER_SOURCE_DIRECT
                     : QM_PAGER_SOURCE_MMAP;
    o->source = source;
    o->io_engine = ss->cfg->io_engine;
    o->io_depth = ss->cfg->io_depth;
}

/* The one recipe of every pool, a session's own and a shared one: the
 * model's layers placed over n_devices by `weights` (NULL: equal), the
 * policy by name with pp's knobs and hot lists, the plan at `budget` (its
 * start and duration in *plan_start_us and *plan_us when not NULL), and
 * the pager options the spec and the configuration give. */
static int make_recipe(const qm_sessions *ss, const qm_model *m, const qm_session_spec *spec,
                       const qm_policy_params *pp, uint64_t budget, uint32_t n_devices,
                       const uint64_t *weights, qm_pool_recipe *out, uint64_t *plan_start_us,
                       uint64_t *plan_us, qm_status *st)
{
    int rc = qm_placement_make(m->bank, n_devices, weights, budget, &out->placement, st);
    if (rc == 0)
        rc = qm_policy_new(spec->policy, pp, &out->policy, st);
    if (rc < 0)
        return rc;
    uint64_t t0 = qm_now_us();
    qm_plan_options opts = {
        .has_budget = 1, .budget_bytes = budget, .min_split_bytes = spec->min_split_bytes};
    rc = qm_plan_residency((const qm_region_catalog *const *)m->catalogs, m->n_layers,
                           &out->policy, &opts, &out->plan, st);
    if (rc < 0)
        return rc;
    if (plan_us) {
        *plan_start_us = t0;
        *plan_us = qm_now_us() - t0;
    }
    /* The budget travels in the plan (qm_plan_budget); the pager reads it
     * there. A fast session of its own on the CPU holds its whole banks in
     * the decode GEMV's r8 layout (a copy in its arena; the pager decides
     * whether this process's kernels read it: docs/PAGING.md); a shared
     * pool stays in the bank's layout: its members may be exact. */
    out->options = (qm_pager_options){
        .prefetch = spec->prefetch,
        /* Timed where a prefetch is a disk read (the pager's automatic). */
        .prefetch_trial = ss->cfg->prefetch_trial ? 0 : 2,
        .keep_unasked_prefetch = !ss->cfg->prefetch_park,
        .on_miss = spec->on_miss,
        /* The prefetch after a call runs where the job says
         * (qm_session_after_forward: a ring's after its answer when the
         * engine leaves a CPU idle, qm_infer.c). */
        .defer_prefetch = 1,
        .interleave = ss->cfg->cpu_repack && spec->precision == QM_PRECISION_FAST &&
                      !spec->share && qm_devices_host_visible(ss->devices)};
    session_disk_options(ss, out->plan, &out->options);
    return 0;
}

/* The shared pool s joins: the one of its model, policy and knobs, or a
 * new one whose recipe is made as a session's is, over the one device (the
 * first member's budget until members join it). */
static int join_shared_pool(qm_sessions *ss, qm_session *s, const qm_session_spec *spec,
                            const qm_policy_params *pp, qm_status *st)
{
    int rc = share_check(ss, spec, st);
    if (rc < 0)
        return rc;
    char key[256];
    qm_expert_pool_key(key, sizeof key, s->model->name, s->policy_name, spec->prefetch,
                       spec->on_miss, spec->values, spec->n_values);
    s->pool = qm_expert_pool_find(ss->shares, s->model->bank, key);
    if (s->pool) {
        qm_expert_pool_ref(s->pool);
        return 0;
    }
    qm_pool_recipe r = {0};
    rc = make_recipe(ss, s->model, spec, pp, s->budget_bytes, 1, NULL, &r, NULL, NULL, st);
    if (rc == 0 && !(s->pool = qm_expert_pool_shared(&ss->shares, s->model->bank, key, &r)))
        rc = qm_status_set(st, QM_ENOMEM, "out of memory");
    qm_pool_recipe_free(&r);
    return rc;
}

/* policy_params.hot or session.create's warm against the model: every
 * layer and expert in range (`name` the member, for the field). */
static int check_lists(const qm_hot_layer *lists, size_t n, const char *name,
                       const qm_bank_config *cfg, qm_status *st)
{
    char field[96];
    for (size_t i = 0; i < n; i++) {
        if (lists[i].layer >= cfg->layers) {
            snprintf(field, sizeof field, "%s[%zu].layer", name, i);
            return qm_status_set_field(st, QM_EINVAL, field,
                                       "layer %u is out of range; the model has %u layers",
                                       lists[i].layer, cfg->layers);
        }
        for (size_t j = 0; j < lists[i].n_experts; j++) {
            if (lists[i].experts[j] >= cfg->experts) {
                snprintf(field, sizeof field, "%s[%zu].experts[%zu]", name, i, j);
                return qm_status_set_field(st, QM_EINVAL, field,
                                           "expert %u is out of range; the model has %u experts",
                                           lists[i].experts[j], cfg->experts);
            }
        }
    }
    return 0;
}

/* What session.create needs of the model and the daemon before anything
 * is made: the policy offered, the model loaded and whole, a state dir for
 * record_trace, the knobs (and hot lists) the policy takes, hot lists in
 * the model's range, room for one more session. *out: the model. */
static int check_create(const qm_sessions *ss, const qm_models *ms, const qm_session_spec *spec,
                        qm_model **out, qm_status *st)
{
    if (qm_policy_params_check(spec->policy, NULL, st) < 0) /* offered over the socket? */
        return QM_EINVAL;
    qm_model *m = qm_model_find(ms, spec->model);
    if (!m)
        return qm_status_set_field(st, QM_ENOT_FOUND, "model", "no model named '%.64s' is loaded",
                                   spec->model);
    if (qm_model_check(m, st) < 0)
        return QM_EINVALID_MODEL;
    const qm_bank_config *cfg = qm_bank_get_config(m->bank);
    for (uint32_t i = 0; cfg->codebook && i < ss->devices->n; i++) {
        const qm_device *d = &ss->devices->dev[i];
        int kind = qm_backend_kind_find(d->info.kind, strlen(d->info.kind));
        if (kind < 0 || !(qm_backend_kind_caps((size_t)kind) & QM_BACKEND_CAP_CODEBOOK))
            return qm_status_set_field(st, QM_EUNSUPPORTED, "model",
                                       "model '%.64s' reads its 4-bit codes through the %s code "
                                       "book, which device %s (the %s backend) does not compute: "
                                       "import it with --mxfp4 int8 for this device",
                                       m->name, qm_codebook_name(cfg->codebook), d->name,
                                       d->info.kind);
    }
    if (spec->record_trace) {
        /* The decoder refused '/', "." and ".."; a name ending in .hot would
         * overwrite a model's hotness profile in the same directory, a
         * session of any user being able to name one. */
        size_t n = strlen(spec->record_trace);
        if (!ss->cfg->state_dir)
            return qm_status_set_field(st, QM_EINVAL, "policy_params.record_trace",
                                       "policy_params.record_trace needs a state dir; this "
                                       "daemon runs without one (state_dir)");
        if (n >= 4 && strcmp(spec->record_trace + n - 4, ".hot") == 0)
            return qm_status_set_field(st, QM_EINVAL, "policy_params.record_trace",
                                       "policy_params.record_trace must not end in .hot (the "
                                       "state dir's hotness profiles)");
        /* Nor the kernel cache or a save's temporary file (NAME.hot.tmp.PID,
         * kernels.cache.PID.tmp). */
        if (strncmp(spec->record_trace, "kernels.cache", 13) == 0 ||
            strstr(spec->record_trace, ".hot.tmp."))
            return qm_status_set_field(st, QM_EINVAL, "policy_params.record_trace",
                                       "policy_params.record_trace must not name the state "
                                       "dir's kernel cache (kernels.cache) or a profile's "
                                       "temporary file (.hot.tmp.)");
    }
    /* Which knobs (and hot lists) the policy takes: its own declaration. */
    static const uint32_t *const no_list = NULL;
    qm_policy_params probe = {.version = QM_POLICY_PARAMS_VERSION,
                              .values = spec->values,
                              .n_values = spec->n_values,
                              .hot = spec->hot ? &no_list : NULL};
    if (qm_policy_params_check(spec->policy, &probe, st) < 0)
        return QM_EINVAL;
    if (check_lists(spec->hot, spec->n_hot, "policy_params.hot", cfg, st) < 0 ||
        check_lists(spec->warm, spec->n_warm, "warm", cfg, st) < 0)
        return QM_EINVAL;
    if (spec->id && qm_session_id_free(ss, spec->id, st) < 0)
        return QM_ECONFLICT;
    if (ss->n >= ss->cfg->max_sessions) {
        qm_limit_hit(ss->limits, QM_LIMIT_MAX_SESSIONS, "max_sessions %u reached",
                     ss->cfg->max_sessions);
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED,
                             "max_sessions %u reached; close a session first",
                             ss->cfg->max_sessions);
    }
    *out = m;
    return 0;
}

/* A new session of model m (a reference taken) for `owner`: its id, policy
 * name, precision, budget, workspace and record_trace path. *out is set
 * even on an error after its allocation (for session_free). */
static int session_new(const qm_sessions *ss, qm_model *m, const qm_session_spec *spec,
                       uid_t owner, qm_session **out, qm_status *st)
{
    qm_session *s = *out = qm_calloc(1, sizeof *s);
    if (!s)
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    qm_shm_set_init(&s->maps);
    pthread_mutex_init(&s->auto_mu, NULL);
    for (uint32_t i = 0; i < ss->devices->n; i++)
        snprintf(s->device_names[i], sizeof s->device_names[i], "%s", ss->devices->dev[i].name);
    s->owner_uid = owner;
    s->model = m;
    m->refs++;
    snprintf(s->policy_name, sizeof s->policy_name, "%s", spec->policy);
    s->precision = spec->precision;
    s->budget_bytes = spec->has_budget ? spec->budget_bytes : m->bytes_total;
    if (spec->auto_budget)
        s->auto_budget = *spec->auto_budget;
    s->workspace_bytes = ss->cfg->session_workspace_bytes;
    s->created_at = (int64_t)time(NULL);
    int rc = 0;
    if (spec->id) { /* a re-creation: checked by check_create */
        snprintf(s->id, sizeof s->id, "%s", spec->id);
        s->recreated = 1;
    }
    else
        rc = random_id(s->id, st);
    if (rc == 0 && spec->record_trace) {
        size_t n = strlen(ss->cfg->state_dir) + strlen(spec->record_trace) + 2;
        s->trace_path = qm_malloc(n);
        if (!s->trace_path)
            return qm_status_set(st, QM_ENOMEM, "out of memory");
        snprintf(s->trace_path, n, "%s/%s", ss->cfg->state_dir, spec->record_trace);
    } else if (rc == 0 && ss->cfg->record_routing && ss->cfg->state_dir &&
               strcmp(spec->policy, "whole_bank") != 0) {
        /* The operator's recording (config record_routing) of a session that
         * pages (whole_bank computes in place, outside the pager that
         * records): one file per session id, so a session re-created after
         * a restart goes on with it. */
        size_t n = strlen(ss->cfg->state_dir) + sizeof "/routing-.qmtr" + strlen(s->id);
        s->trace_path = qm_malloc(n);
        if (!s->trace_path)
            return qm_status_set(st, QM_ENOMEM, "out of memory");
        snprintf(s->trace_path, n, "%s/routing-%s.qmtr", ss->cfg->state_dir, s->id);
        s->trace_by_daemon = 1;
    }
    return rc;
}

/* The policy's parameters: the knobs given (pin_fraction 0 included; the
 * policy's declared default covers the rest), the hot lists of a policy
 * that takes them, indexed by layer: the request's (in *hot and *hot_len,
 * the caller's to free) or, when it gave none, the model's persisted
 * profile; and for a policy that takes a prior (next_use), the profile's
 * per-visit frequencies. The profile's arrays stay valid until its next
 * record, which only the loop makes: the policy copies them before. */
static int policy_params_of(const qm_model *m, const qm_session_spec *spec,
                            const uint32_t ***hot, size_t **hot_len, qm_policy_params *pp,
                            qm_status *st)
{
    uint32_t layers = qm_bank_get_config(m->bank)->layers;
    *pp = (qm_policy_params){
        .version = QM_POLICY_PARAMS_VERSION, .values = spec->values, .n_values = spec->n_values};
    if (qm_policy_accepts_prior(spec->policy) && m->hotness &&
        qm_hotness_records(m->hotness) > 0) {
        int rc = qm_hotness_policy_prior(m->hotness, pp, st);
        if (rc) return rc;
    }
    if (!spec->hot) {
        if (qm_policy_accepts_hot(spec->policy) && m->hotness &&
            qm_hotness_records(m->hotness) > 0)
            return qm_hotness_policy_params(m->hotness, pp, st);
        return 0;
    }
    *hot = qm_calloc(layers, sizeof **hot);
    *hot_len = qm_calloc(layers, sizeof **hot_len);
    if (!*hot || !*hot_len)
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    for (size_t i = 0; i < spec->n_hot; i++) {
        (*hot)[spec->hot[i].layer] = spec->hot[i].experts;
        (*hot_len)[spec->hot[i].layer] = spec->hot[i].n_experts;
    }
    pp->hot = *hot;
    pp->hot_len = *hot_len;
    pp->n_hot_banks = layers;
    return 0;
}

/* Whether the request set knob `name` to 0. */
static int knob_is_zero(const qm_session_spec *spec, const char *name)
{
    for (size_t i = 0; i < spec->n_values; i++)
        if (spec->values[i].name && !strcmp(spec->values[i].name, name))
            return spec->values[i].value == 0.0;
    return 0;
}

/* warm_from_profile (loop thread, where the profile lives): a new session
 * that pages, of its own pool and given no `warm`, gets the model's
 * hottest experts across layers by their decayed counts, as many as its
 * budget holds experts, to load once built. Nothing when the profile is
 * empty; out of memory only leaves the session cold. */
static void choose_profile_warm(const qm_sessions *ss, const qm_model *m,
                                const qm_session_spec *spec, qm_session *s)
{
    int on = spec->warm_from_profile >= 0 ? spec->warm_from_profile : ss->cfg->warm_from_profile;
    if (!on || spec->n_warm || spec->share ||
        strcmp(spec->policy, "whole_bank") == 0 || !m->hotness ||
        qm_hotness_records(m->hotness) == 0 || !m->bytes_per_expert)
        return;
    const qm_bank_config *cfg = qm_bank_get_config(m->bank);
    uint64_t fit = s->budget_bytes / m->bytes_per_expert;
    size_t cells = (size_t)cfg->layers * cfg->experts;
    size_t n = fit < cells ? (size_t)fit : cells;
    uint32_t *layers = n ? qm_malloc(n * sizeof *layers) : NULL;
    if (n) {
        s->profile_warm = qm_calloc(n, sizeof *s->profile_warm);
        s->profile_warm_experts = qm_malloc(n * sizeof *s->profile_warm_experts);
    }
    long all = layers && s->profile_warm && s->profile_warm_experts
                   ? qm_hotness_hottest_all(m->hotness, layers, s->profile_warm_experts, n)
                   : 0;
    if (all > 0) {
        if ((size_t)all < n)
            n = (size_t)all;
        for (size_t i = 0; i < n; i++)
            s->profile_warm[i] = (qm_hot_layer){layers[i], &s->profile_warm_experts[i], 1};
        s->n_profile_warm = n;
    } else {
        qm_free(s->profile_warm);
        qm_free(s->profile_warm_experts);
        s->profile_warm = NULL;
        s->profile_warm_experts = NULL;
    }
    qm_free(layers);
}

/* One uid may not take every session from the others. */
static int check_owner(qm_sessions *ss, uid_t owner, qm_status *st)
{
    uint32_t cap = ss->cfg->max_sessions_per_uid;
    const uint32_t *n = owner_count(ss, owner, 0);
    if (!cap || !n || *n < cap)
        return 0;
    qm_limit_hit(ss->limits, QM_LIMIT_MAX_SESSIONS_PER_UID,
                 "max_sessions_per_uid %u reached by uid %u", cap, (unsigned)owner);
    return qm_status_set(st, QM_ERESOURCE_EXHAUSTED,
                         "max_sessions_per_uid %u reached for uid %u; close one of its sessions "
                         "first",
                         cap, (unsigned)owner);
}

void qm_sessions_free_owners(qm_sessions *ss)
{
    qm_free(ss->owners);
    ss->owners = NULL;
    ss->n_owners = 0;
}

int qm_session_prepare(qm_sessions *ss, const qm_models *ms, const qm_session_spec *spec,
                       uid_t owner, qm_session **out, qm_status *st)
{
    qm_model *m = NULL;
    qm_session *s = NULL;
    uint32_t *mine = owner_count(ss, owner, 1);
    if (!mine)
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    int rc = check_create(ss, ms, spec, &m, st);
    if (rc == 0)
        rc = check_owner(ss, owner, st);
    if (rc == 0)
        rc = session_new(ss, m, spec, owner, &s, st);
    if (rc < 0)
        goto fail;
    uint64_t free_bytes[QM_CONFIG_MAX_DEVICES], weight[QM_CONFIG_MAX_DEVICES];
    uint64_t dev_need[QM_CONFIG_MAX_DEVICES] = {0};
    device_weights(ss, s->workspace_bytes, free_bytes, weight);
    const uint32_t **hot = NULL;
    size_t *hot_len = NULL;
    qm_policy_params pp;
    rc = policy_params_of(m, spec, &hot, &hot_len, &pp, st);
    if (rc == 0 && pp.prior && !knob_is_zero(spec, "prior_weight"))
        s->prior_records = qm_hotness_records(m->hotness);
    if (rc == 0)
        rc = make_recipe(ss, m, spec, &pp, s->budget_bytes, ss->devices->n, weight, &s->recipe,
                         &s->plan_start_us, &s->plan_us, st);
    if (rc == 0)
        rc = admit_on_devices(ss, &s->recipe.placement, s->budget_bytes, s->workspace_bytes,
                              free_bytes, dev_need, st);
    if (rc == 0 && spec->share)
        rc = join_shared_pool(ss, s, spec, &pp, st);
    else if (rc == 0 && !(s->pool = qm_expert_pool_own(m->bank, &s->recipe)))
        rc = qm_status_set(st, QM_ENOMEM, "out of memory");
    qm_free(hot);
    qm_free(hot_len);
    if (rc < 0)
        goto fail;
    choose_profile_warm(ss, m, spec, s);
    /* Reserved now, so creations in flight cannot overcommit the device
     * budget while their pagers are built off the loop thread. */
    atomic_init(&s->refs, 1);
    ss->n++;
    (*owner_count(ss, owner, 0))++;
    for (uint32_t i = 0; i < ss->devices->n; i++) {
        ss->devices->dev[i].admitted += s->device_admitted[i] = dev_need[i];
        s->admitted_bytes += dev_need[i];
    }
    *out = s;
    return 0;
fail:
    if (s)
        session_free(s);
    return rc;
}

/* "session ID", or "session ID, device NAME" when it spans several. */
static void session_where(const qm_session *s, uint32_t i, char *out, size_t cap)
{
    if (s->recipe.placement.n_devices > 1)
        snprintf(out, cap, "session %s, device %s", s->id, s->device_names[i]);
    else
        snprintf(out, cap, "session %s", s->id);
}

/* Logs where each device's pager reads its units from (and hooks the
 * injected read faults onto the disk source, QMOED_FAULT_READ). */
static void log_sources(const qm_session *s)
{
    unsigned long fail_read = qm_fault_read_at();
    for (uint32_t i = 0; i < s->recipe.placement.n_devices; i++) {
        qm_pager *pg = qm_multipager_pager(qm_expert_pool_pagers(s->pool), i);
        const char *why = "";
        if (!pg)
            continue;
        char where[96];
        session_where(s, i, where, sizeof where);
        int direct = qm_pager_source_info(pg, &why) == QM_PAGER_SOURCE_DIRECT;
        if (direct && fail_read)
            qm_pager_set_read_hook(pg, qm_fault_read_hook, (void *)(uintptr_t)fail_read);
        if (direct) {
            uint32_t depth = 0;
            const char *io_why = "";
            int engine = qm_pager_io_info(pg, &depth, &io_why);
            qm_log(QM_LOG_INFO,
                   "%s pages from disk: O_DIRECT reads of %s through %s, %u in flight at "
                   "most%s%s%s%s%s",
                   where, qm_bank_path(s->model->bank), qm_pager_io_name(engine), depth,
                   *io_why ? " (" : "", io_why, *io_why ? ")" : "", *why ? "; " : "", why);
        } else if (*why) {
            qm_log(QM_LOG_WARNING, "%s: %s", where, why);
        }
    }
}

static void log_trace(qm_session *s, int resumed)
{
    if (!resumed) {
        qm_log(QM_LOG_INFO, "session %s records its routing to %s", s->id, s->trace_path);
        return;
    }
    qm_pager_stats ps;
    qm_session_stats(s, &ps);
    if (ps.trace_full)
        qm_log(QM_LOG_WARNING,
               "session %s does not go on recording its routing to %s: the file is at "
               "max_trace_bytes already (%llu tokens in it)",
               s->id, s->trace_path, (unsigned long long)ps.trace_tokens);
    else
        qm_log(QM_LOG_INFO, "session %s goes on recording its routing to %s (%llu tokens there)",
               s->id, s->trace_path, (unsigned long long)ps.trace_tokens);
}

int qm_session_build(const qm_sessions *ss, qm_session *s, qm_status *st)
{
    /* The pagers read the mapping (whole banks, pins, preload): the bank
     * file must be whole before, and still after. From the join on, a
     * failure leaves the pool through session_free. */
    qm_backend *backends[QM_CONFIG_MAX_DEVICES];
    qm_devices_backends(ss->devices, backends);
    int rc = qm_model_check(s->model, st);
    if (rc == 0)
        rc = qm_expert_pool_join(s->pool, backends, &s->member, s->budget_bytes, st);
    if (rc == 0)
        rc = qm_model_check(s->model, st);
    /* A session re-created under its id (after a restart) goes on with the
     * trace its first life recorded, when the file is one of this model's
     * shape; a new session starts the file anew. */
    if (rc == 0 && s->trace_path && s->trace_by_daemon) {
        /* The operator's recording (record_routing): a failure is logged and
         * the session goes on without it. */
        qm_status tst;
        qm_status_clear(&tst);
        int r = qm_multipager_record_trace(qm_expert_pool_pagers(s->pool), s->trace_path,
                                           s->recreated, ss->cfg->max_trace_bytes, &tst);
        if (r < 0)
            qm_log(QM_LOG_WARNING, "session %s does not record its routing (record_routing): %s",
                   s->id, tst.msg);
        else
            log_trace(s, r);
    } else if (rc == 0 && s->trace_path) {
        rc = qm_multipager_record_trace(qm_expert_pool_pagers(s->pool), s->trace_path, s->recreated,
                                        ss->cfg->max_trace_bytes, st);
        if (rc < 0) {
            if (st)
                snprintf(st->field, sizeof st->field, "policy_params.record_trace");
        } else {
            log_trace(s, rc);
            rc = 0;
        }
    }
    if (rc < 0)
        return rc;
    qm_session_stats(s, &s->last_stats);
    if (qm_expert_pool_is_shared(s->pool))
        qm_log(QM_LOG_INFO, "session %s shares the residency of model %s (policy %s)", s->id,
               s->model->name, s->policy_name);
    else
        log_sources(s);
    return 0;
}

int qm_session_warm(qm_session *s, const qm_hot_layer *warm, size_t n, qm_status *st)
{
    if (n == 0 || qm_expert_pool_is_shared(s->pool))
        return 0; /* a shared pool is as warm as its other members keep it */
    uint64_t t0 = qm_now_us();
    int total = 0;
    for (size_t i = 0; i < n; i++) {
        qm_pager *pg = qm_session_pager_of(s, warm[i].layer);
        int got = pg ? qm_pager_warm(pg, warm[i].layer, warm[i].experts, warm[i].n_experts, st)
                     : 0;
        if (got < 0)
            return got;
        total += got;
    }
    const qm_multipager *mp = qm_expert_pool_pagers(s->pool);
    uint64_t laid = 0, t1 = qm_now_us();
    for (uint32_t d = 0; d < s->recipe.placement.n_devices; d++) {
        qm_pager *pg = qm_multipager_pager(mp, d);
        int rc = pg ? qm_pager_sync(pg, st) : 0;
        if (rc < 0)
            return rc;
        t1 = qm_now_us();
        laid += qm_pager_interleave_resident(pg); /* a fast session's: its decode's layout */
    }
    qm_session_stats(s, &s->last_stats);
    char r8[80] = "";
    if (laid)
        snprintf(r8, sizeof r8, " (%.1f MB of them laid out for the fast CPU decode in %.1f ms)",
                 (double)laid / 1e6, (double)(qm_now_us() - t1) / 1000.0);
    qm_log(QM_LOG_INFO, "session %s warmed: %d experts loaded in %.1f ms%s", s->id, total,
           (double)(t1 - t0) / 1000.0, r8);
    return total;
}

int qm_session_warm_from_profile(qm_session *s, qm_status *st)
{
    if (!s->n_profile_warm)
        return 0;
    int got = qm_session_warm(s, s->profile_warm, s->n_profile_warm, st);
    if (got >= 0)
        qm_log(QM_LOG_INFO, "session %s started from the hotness profile of %s: %d of its %zu "
               "hottest experts loaded", s->id, s->model->name, got, s->n_profile_warm);
    qm_free(s->profile_warm);
    qm_free(s->profile_warm_experts);
    s->profile_warm = NULL;
    s->profile_warm_experts = NULL;
    s->n_profile_warm = 0;
    return got;
}

void qm_session_commit(qm_sessions *ss, qm_session *s)
{
    s->counters.resident_bytes = s->last_stats.resident_bytes;
    char args[192];
    snprintf(args, sizeof args, "{\"policy\":\"%s\",\"resident\":%zu,\"degraded\":%zu,\"total\":%zu}",
             s->policy_name, qm_plan_resident_count(s->recipe.plan),
             qm_plan_degraded_count(s->recipe.plan), qm_plan_total(s->recipe.plan));
    qm_trace_add(ss->trace, "session.residency_plan", s->plan_start_us, s->plan_us, s->id, args,
                 &s->plan_span);
    s->next = ss->first;
    ss->first = s;
    char prior[96] = "";
    if (s->prior_records)
        snprintf(prior, sizeof prior, "; the policy's expert frequencies start from the hotness "
                 "profile (%llu records)", (unsigned long long)s->prior_records);
    qm_log(QM_LOG_INFO,
           "session %s created: model %s, policy %s, budget %llu%s%s%s, uid %u, %llu bytes of "
           "whole banks mapped in, %llu laid out for the fast CPU decode (r8)%s",
           s->id, s->model->name, s->policy_name, (unsigned long long)s->budget_bytes,
           s->auto_budget.on ? " (" : "", s->auto_budget.on ? s->auto_budget.why : "",
           s->auto_budget.on ? ")" : "", (unsigned)s->owner_uid,
           (unsigned long long)s->last_stats.bytes_prefaulted_at_create,
           (unsigned long long)s->last_stats.bytes_interleaved_at_create, prior);
    /* Fast mode reads weight blocks of whole 32-column sub-blocks: a bank
     * with blocks of 16 (a GGUF's Q6_K, as in a Q4_K_M file, imported at 8
     * bits) computes in exact precision whatever the session asked. */
    const qm_bank_config *cfg = qm_bank_get_config(s->model->bank);
    if (s->precision == QM_PRECISION_FAST && cfg && cfg->block_size % 32 != 0)
        qm_log(QM_LOG_WARNING,
               "session %s asked for fast precision, but model %s has weight blocks of %u "
               "columns, which no fast kernel reads (they take whole 32-column blocks): its calls "
               "compute in exact precision (f32 activations, slower); a bank imported with "
               "blocks of 32 (qmoe-bank import gguf --requant-bits 4) runs fast",
               s->id, s->model->name, cfg->block_size);
}

/* What the session holds on each device at `budget`: its share
 * (qm_placement_split) plus a workspace where it has layers. */
static int session_device_need(const qm_session *s, uint64_t budget, uint64_t *share,
                               uint64_t *need)
{
    qm_placement_split(&s->recipe.placement, budget, share);
    for (uint32_t i = 0; i < s->recipe.placement.n_devices; i++) {
        unsigned long long n = 0;
        if (share[i] && qm_add_u64(share[i], s->workspace_bytes, &n) < 0)
            return -1;
        need[i] = n;
    }
    return 0;
}

/* A growth that device i cannot take: `more` bytes beyond what the session
 * holds there. */
static int resize_refusal(const qm_sessions *ss, const qm_session *s, uint32_t i, uint64_t need,
                          uint64_t share, uint64_t budget, uint64_t more, uint64_t free_bytes,
                          qm_status *st)
{
    if (ss->devices->n == 1)
        return qm_status_set_field(
            st, QM_ERESOURCE_EXHAUSTED, "budget_bytes",
            "growing the session to a budget of %llu needs %llu more bytes but only %llu "
            "bytes of the daemon-wide budget %llu are free",
            (unsigned long long)budget, (unsigned long long)more, (unsigned long long)free_bytes,
            (unsigned long long)ss->devices->dev[i].budget);
    return device_refusal(ss, i, need, share, budget, s->workspace_bytes,
                          free_bytes + s->device_admitted[i], st);
}

int qm_session_resize_reserve(qm_sessions *ss, qm_session *s, uint64_t budget, qm_status *st)
{
    /* Growth admitted per device against that device's free budget (the
     * refusal of session.create's admission), all or nothing. */
    uint64_t share[QM_PLACEMENT_MAX_DEVICES], need[QM_PLACEMENT_MAX_DEVICES];
    const uint32_t n = s->recipe.placement.n_devices;
    if (session_device_need(s, budget, share, need) < 0)
        return qm_status_set_field(st, QM_ERESOURCE_EXHAUSTED, "budget_bytes",
                                   "budget_bytes %llu overflows", (unsigned long long)budget);
    for (uint32_t i = 0; i < n; i++) {
        if (need[i] <= s->device_admitted[i])
            continue;
        uint64_t more = need[i] - s->device_admitted[i];
        uint64_t free_bytes = device_free(&ss->devices->dev[i]);
        if (more > free_bytes)
            return resize_refusal(ss, s, i, need[i], share[i], budget, more, free_bytes, st);
    }
    for (uint32_t i = 0; i < n; i++) {
        if (need[i] <= s->device_admitted[i])
            continue;
        uint64_t more = need[i] - s->device_admitted[i];
        ss->devices->dev[i].admitted += more;
        s->admitted_bytes += more;
        s->device_admitted[i] = need[i];
    }
    s->resizes_pending++;
    return 0;
}

void qm_session_resize_finish(qm_sessions *ss, qm_session *s, int ok, uint64_t budget)
{
    if (s->resizes_pending)
        s->resizes_pending--;
    if (ok)
        s->budget_bytes = budget;
    /* A closed session gave its whole reservation back when it closed. */
    if (s->resizes_pending || atomic_load(&s->closed))
        return;
    /* Each device keeps what the budget in force needs there. */
    uint64_t share[QM_PLACEMENT_MAX_DEVICES], need[QM_PLACEMENT_MAX_DEVICES];
    if (session_device_need(s, s->budget_bytes, share, need) < 0)
        return;
    for (uint32_t i = 0; i < s->recipe.placement.n_devices; i++) {
        if (s->device_admitted[i] <= need[i])
            continue;
        uint64_t less = s->device_admitted[i] - need[i];
        ss->devices->dev[i].admitted -= less;
        s->admitted_bytes -= less;
        s->device_admitted[i] = need[i];
    }
}

void qm_session_abort(qm_sessions *ss, qm_session *s)
{
    atomic_store(&s->closed, 1); /* never served: nothing may mark or use it */
    ss->n--;
    owner_less(ss, s->owner_uid);
    session_release_admission(ss, s);
    qm_session_unref(s);
}

int qm_session_forward(qm_session *s, const qm_moe_call *call, qm_moe_stats *mstats,
                       qm_status *st)
{
    return qm_expert_pool_forward(s->pool, &s->member, call, mstats, st);
}

void qm_session_after_forward(qm_session *s)
{
    qm_expert_pool_after_forward(s->pool, &s->member, 0);
}

void qm_session_tidy(qm_session *s) { qm_expert_pool_after_forward(s->pool, &s->member, 1); }

int qm_session_resize(qm_session *s, uint64_t budget, qm_status *st)
{
    int rc = qm_expert_pool_resize(s->pool, &s->member, budget, st);
    if (rc == 0) { /* in the session's FIFO: no other job reads them now */
        qm_placement_split(&s->recipe.placement, budget, s->recipe.placement.budget);
        qm_plan_set_budget(s->recipe.plan, budget);
    }
    return rc;
}

void qm_session_stats(const qm_session *s, qm_pager_stats *out)
{
    qm_expert_pool_stats(s->pool, &s->member, out);
}

qm_pager *qm_session_pager_of(const qm_session *s, uint32_t layer)
{
    return s->member.joined ? qm_expert_pool_pager_of(s->pool, layer) : NULL;
}

/* ---- what the rest of the daemon reads ---- */

qm_session *qm_session_next(const qm_session *s) { return s->next; }
const char *qm_session_id(const qm_session *s) { return s->id; }
uid_t qm_session_owner(const qm_session *s) { return s->owner_uid; }
qm_model *qm_session_model(const qm_session *s) { return s->model; }
const char *qm_session_policy(const qm_session *s) { return s->policy_name; }

qm_precision qm_session_precision(const qm_session *s) { return s->precision; }

uint64_t qm_session_budget(const qm_session *s) { return s->budget_bytes; }
uint64_t qm_session_workspace(const qm_session *s) { return s->workspace_bytes; }
int64_t qm_session_created_at(const qm_session *s) { return s->created_at; }
const qm_residency_plan *qm_session_plan(const qm_session *s) { return s->recipe.plan; }
const qm_placement *qm_session_placement(const qm_session *s) { return &s->recipe.placement; }
const char *qm_session_device_name(const qm_session *s, uint32_t i) { return s->device_names[i]; }
int qm_session_on_miss(const qm_session *s) { return s->recipe.options.on_miss; }
int qm_session_built(const qm_session *s) { return s->member.joined; }
void qm_session_hold(qm_session *s) { qm_expert_pool_lock(s->pool); }
void qm_session_release(qm_session *s) { qm_expert_pool_unlock(s->pool); }
const qm_span *qm_session_plan_span(const qm_session *s) { return &s->plan_span; }
qm_counters *qm_session_counters(qm_session *s) { return &s->counters; }
uint64_t qm_session_resident_bytes(const qm_session *s) { return s->counters.resident_bytes; }
const qm_pager_stats *qm_session_last_stats(const qm_session *s) { return &s->last_stats; }

void qm_session_note_stats(qm_session *s, const qm_pager_stats *now, qm_pager_stats *was)
{
    /* A recording that stopped says so once (inference went on). */
    if (s->trace_path && now->trace_full > s->last_stats.trace_full)
        qm_log(QM_LOG_WARNING,
               "session %s stopped recording its routing to %s: the file reached max_trace_bytes "
               "(%llu tokens in it)",
               s->id, s->trace_path, (unsigned long long)now->trace_tokens);
    else if (s->trace_path && now->trace_errors > s->last_stats.trace_errors)
        qm_log(QM_LOG_WARNING,
               "session %s stopped recording its routing to %s: a write failed (%llu tokens in it)",
               s->id, s->trace_path, (unsigned long long)now->trace_tokens);
    if (was)
        *was = s->last_stats;
    s->last_stats = *now;
}

qm_job_queue *qm_session_queue(qm_session *s) { return &s->queue; }
size_t qm_session_queued(const qm_session *s) { return s->queue.pending; }
qm_shm_set *qm_session_maps(qm_session *s) { return &s->maps; }
int qm_session_closed(const qm_session *s) { return atomic_load(&((qm_session *)s)->closed); }

qm_touches *qm_session_touches(qm_session *s) { return &s->touches; }
qm_budget_auto *qm_session_auto_budget(qm_session *s) { return &s->auto_budget; }

void qm_session_set_auto_budget(qm_session *s, const qm_budget_auto *a)
{
    pthread_mutex_lock(&s->auto_mu);
    if (a)
        s->auto_budget = *a;
    else
        memset(&s->auto_budget, 0, sizeof s->auto_budget);
    pthread_mutex_unlock(&s->auto_mu);
}

int qm_session_auto_budget_json(qm_session *s, qm_jw *w)
{
    pthread_mutex_lock(&s->auto_mu);
    int on = s->auto_budget.on;
    if (on)
        qm_budget_auto_json(w, &s->auto_budget);
    pthread_mutex_unlock(&s->auto_mu);
    return on;
}

uint64_t qm_sessions_resident_bytes(const qm_sessions *ss)
{
    uint64_t sum = 0;
    for (const qm_session *it = ss->first; it; it = it->next)
        sum += it->counters.resident_bytes;
    return sum;
}

int qm_sessions_budget(const qm_sessions *ss, const qm_model *m, const qm_session *s,
                       const qm_budget_spec *spec, uint64_t pending, uint64_t *bytes,
                       qm_budget_auto *autob, qm_status *st)
{
    uint64_t free_bytes = 0;
    for (uint32_t i = 0; i < ss->devices->n; i++)
        free_bytes += device_free(&ss->devices->dev[i]);
    qm_budget_ask ask = {.spec = spec,
                         .model_bytes = m->bytes_total,
                         .workspace = s ? 0 : ss->cfg->session_workspace_bytes,
                         .pending = pending,
                         .credit = s ? s->counters.resident_bytes : 0,
                         .held = qm_sessions_resident_bytes(ss),
                         .device_free = free_bytes + (s ? s->budget_bytes : 0),
                         .host_memory = qm_devices_host_visible(ss->devices)};
    return qm_budget_resolve(ss->cfg, &ask, bytes, autob, st);
}

uint64_t qm_session_min_budget(const qm_sessions *ss, const qm_session *s)
{
    uint64_t min = s->budget_bytes;
    qm_status st;
    qm_status_clear(&st);
    if (qm_pager_min_budget(ss->devices->dev[0].backend, s->model->bank, s->recipe.plan,
                            &s->recipe.options, &min, &st) < 0)
        return s->budget_bytes;
    return min;
}
