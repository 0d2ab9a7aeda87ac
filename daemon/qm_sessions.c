/* qm_sessions.c - the registry's sessions: unguessable ids, owner, policy,
 * plan, a placement over the daemon's devices with one pager per device
 * that holds layers, and admission of their budgets against the devices'.
 * Loop thread only, except what qm_sessions.h gives a worker. */
#include "qm_registry_impl.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "qm_alloc.h"
#include "qm_budget.h"
#include "qm_fault.h"
#include "qm_log.h"
#include "qm_placement.h"
#include "qm_plan_json.h"
#include "qm_share.h"

struct qm_session {
    char id[QM_SESSION_ID_LEN + 1];
    uid_t owner_uid;
    qm_model *model;
    char policy_name[16];
    int precision_fast;       /* session.create precision "fast" (fixed for the session) */
    qm_policy policy;
    qm_residency_plan *plan;
    /* Its layers over the daemon's devices (engine/pager/qm_placement.h; one
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
    qm_budget_auto auto_budget; /* budget "auto": its size, why, the pressure watcher's state */
    uint64_t workspace_bytes; /* fixed at creation */
    uint64_t admitted_bytes;  /* what the devices hold for it (budget shares + workspaces);
                               * while resizes are queued, the largest they may set */
    uint32_t resizes_pending; /* session.resize jobs queued and not yet done */
    int64_t created_at;       /* unix seconds */
    qm_touches touches;       /* the open connections that used it, its orphan mark */
    /* Shared residency (qm_share.h): the pool it draws from instead of
     * pagers of its own, whether it joined, the budget it gave the pool and
     * its own counters (worker, in its FIFO). NULL: pagers of its own. */
    qm_share *share;
    int share_joined;
    uint64_t share_budget;
    qm_pager_stats share_stats;
    int refs;                 /* registry + queued jobs */
    atomic_int closed;        /* set by the loop; workers answer not_found after it */
    qm_counters counters;
    qm_pager_stats last_stats; /* the pagers' cumulative stats after the last job */
    qm_span plan_span;
    qm_job_queue queue;        /* its FIFO of jobs (qm_pool.h) */
    qm_shm_set maps;           /* session.map's (qm_shm.h) */
    qm_session *next;
};

qm_session *qm_session_find(const qm_registry *r, const char *id)
{
    for (qm_session *s = r->sessions; s; s = s->next)
        if (strcmp(s->id, id) == 0)
            return s;
    return NULL;
}

static void session_free(qm_session *s)
{
    qm_shm_set_release_all(&s->maps);
    qm_touches_free(&s->touches);
    if (s->share_joined)
        qm_share_leave(s->share, s->share_budget);
    qm_share_unref(s->share);
    qm_multipager_free(s->pagers);
    qm_placement_free(&s->placement);
    qm_free(s->trace_path);
    qm_plan_free(s->plan);
    qm_policy_destroy(&s->policy);
    qm_model_unref(s->model);
    qm_free(s);
}

void qm_session_ref(qm_session *s) { s->refs++; }

void qm_session_unref(qm_session *s)
{
    if (s && --s->refs == 0)
        session_free(s);
}

/* Gives the session's reservation back, on every device it holds. */
static void session_release_admission(qm_registry *r, qm_session *s)
{
    for (uint32_t i = 0; i < r->devices->n; i++)
        r->devices->dev[i].admitted -= s->device_admitted[i];
}

void qm_session_close(qm_registry *r, qm_session *s)
{
    for (qm_session **pp = &r->sessions; *pp; pp = &(*pp)->next) {
        if (*pp == s) {
            *pp = s->next;
            r->n_sessions--;
            session_release_admission(r, s);
            atomic_store(&s->closed, 1);
            s->next = NULL;
            /* Its maps go now; jobs still queued hold the ones they use. */
            qm_shm_set_release_all(&s->maps);
            qm_session_unref(s);
            return;
        }
    }
}

void qm__sessions_close_model(qm_registry *r, const qm_model *m)
{
    for (qm_session *s = r->sessions, *next; s; s = next) {
        next = s->next;
        if (!m || s->model == m)
            qm_session_close(r, s);
    }
}

size_t qm__sessions_of_model(const qm_registry *r, const qm_model *m)
{
    size_t n = 0;
    for (const qm_session *s = r->sessions; s; s = s->next)
        n += s->model == m;
    return n;
}

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

/* What the devices' budgets have free. */
static uint64_t devices_free(const qm_registry *r)
{
    uint64_t sum = 0;
    for (uint32_t i = 0; i < r->devices->n; i++)
        sum += device_free(&r->devices->dev[i]);
    return sum;
}

/* The budget a request's form asks for, in bytes (qm_budget.h); `s` is the
 * session a resize changes (its resident bytes are in use already, its
 * admission free for it), NULL for a creation. */
static int resolve_budget(const qm_registry *r, const qm_model *m, const qm_budget_spec *spec,
                          uint64_t workspace, const qm_session *s, uint64_t *bytes,
                          qm_budget_auto *autob, qm_status *st)
{
    qm_budget_ask ask = {.spec = spec,
                         .model_bytes = m->bytes_total,
                         .workspace = workspace,
                         .credit = s ? s->counters.resident_bytes : 0,
                         .device_free = devices_free(r) + (s ? s->budget_bytes : 0),
                         .host_memory = qm_devices_host_visible(r->devices)};
    return qm_budget_resolve(r->cfg, &ask, bytes, autob, st);
}

/* A session that device i cannot take at `budget`: `need` bytes there (its
 * `share` of the budget + a workspace) against `free_bytes` (a resize counts
 * what the session holds there already). With one device the device's
 * budget is the daemon-wide budget, and the sentence says so. */
static int device_refusal(const qm_registry *r, uint32_t i, unsigned long long need, uint64_t share,
                          uint64_t budget, uint64_t workspace, uint64_t free_bytes, qm_status *st)
{
    const qm_device *dv = &r->devices->dev[i];
    if (r->devices->n == 1)
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

/* The session's layers placed by what each device has free beyond a
 * workspace (engine/pager/qm_placement.h; a device that cannot hold a workspace
 * gets no layers unless none can; one device holds them all), and each
 * device that gets layers charged its share of the budget plus a workspace
 * (its pager's scratch). QM_ERESOURCE_EXHAUSTED naming the device when one
 * cannot take its share. */
static int admit_on_devices(qm_registry *r, const qm_model *m, uint64_t budget,
                            uint64_t workspace, qm_placement *pl, uint64_t *dev_need,
                            qm_status *st)
{
    const qm_devices *ds = r->devices;
    uint64_t free_bytes[QM_CONFIG_MAX_DEVICES], weight[QM_CONFIG_MAX_DEVICES];
    for (uint32_t i = 0; i < ds->n; i++) {
        free_bytes[i] = device_free(&ds->dev[i]);
        weight[i] = free_bytes[i] > workspace ? free_bytes[i] - workspace : 0;
    }
    int rc = qm_placement_make(m->bank, ds->n, weight, budget, pl, st);
    if (rc < 0)
        return rc;
    for (uint32_t i = 0; i < ds->n; i++) {
        unsigned long long need = 0;
        if (!pl->bytes[i])
            continue;
        if (qm_add_u64(pl->budget[i], workspace, &need) < 0 || need > free_bytes[i]) {
            rc = device_refusal(r, i, need, pl->budget[i], budget, workspace, free_bytes[i], st);
            qm_placement_free(pl);
            return rc;
        }
        dev_need[i] = need;
    }
    return 0;
}

/* policy_params.share_residency: what may share (docs/PAGING.md "Shared
 * residency"), refused naming the member and the rule. */
static int share_check(const qm_registry *r, const qm_policy_params_wire *pw, qm_status *st)
{
    const char *f = "policy_params.share_residency";
    const qm_device *d = &r->devices->dev[0];
    int kind = qm_backend_kind_find(d->info.kind, strlen(d->info.kind));
    unsigned caps = kind < 0 ? 0 : qm_backend_kind_caps((size_t)kind);
    if (r->devices->n != 1 || !(caps & QM_BACKEND_CAP_SHARED_POOL)) {
        char kinds[96] = ""; /* the registry's kinds that share pools */
        for (size_t i = 0; i < qm_backend_kind_count(); i++)
            if (qm_backend_kind_caps(i) & QM_BACKEND_CAP_SHARED_POOL)
                snprintf(kinds + strlen(kinds), sizeof kinds - strlen(kinds), "%s%s",
                         kinds[0] ? " or " : "", qm_backend_kind_name(i));
        return qm_status_set_field(st, QM_EINVAL, f,
                                   "policy_params.share_residency needs a daemon with one device "
                                   "of the %s backend; this one serves %u device%s (%s%s)",
                                   kinds, r->devices->n, r->devices->n == 1 ? "" : "s", d->name,
                                   r->devices->n > 1 ? ", ..." : "");
    }
    const char *other = pw->hot ? "hot" : pw->record_trace ? "record_trace"
                        : pw->has_min_split_bytes ? "min_split_bytes" : NULL;
    if (other)
        return qm_status_set_field(st, QM_EINVAL, f,
                                   "policy_params.share_residency cannot be combined with "
                                   "policy_params.%s (the pool has one plan and one recording)",
                                   other);
    return 0;
}

/* The pool s joins: the one of its model, policy and knobs, or a new one
 * with a policy, plan and placement of its own made from the same
 * parameters (the first member's budget until members join it). */
static int share_find_or_make(qm_registry *r, qm_session *s, const qm_policy_params_wire *pw,
                              const qm_policy_params *pp, uint64_t budget, qm_status *st)
{
    int rc = share_check(r, pw, st);
    if (rc < 0)
        return rc;
    const char *names[QM_POLICY_VALUES_MAX];
    double values[QM_POLICY_VALUES_MAX];
    for (size_t i = 0; i < pp->n_values && i < QM_POLICY_VALUES_MAX; i++) {
        names[i] = pp->values[i].name;
        values[i] = pp->values[i].value;
    }
    int prefetch = pw->has_prefetch ? pw->prefetch : 1;
    int on_miss = qm_on_miss_parse(pw->on_miss);
    char key[256];
    qm_share_key(key, sizeof key, s->model->name, s->policy_name, prefetch, on_miss, names, values,
                 pp->n_values);
    qm_share *p = qm_share_find(r->shares, s->model->bank, key);
    if (p) {
        qm_share_ref(p);
        s->share = p;
        return 0;
    }
    qm_policy policy = {0};
    qm_residency_plan *plan = NULL;
    qm_placement pl = {0};
    qm_plan_options opts = {.has_budget = 1, .budget_bytes = budget};
    rc = qm_policy_new(s->policy_name, pp, &policy, st);
    if (rc == 0)
        rc = qm_plan_residency((const qm_region_catalog *const *)s->model->catalogs,
                               s->model->n_layers, &policy, &opts, &plan, st);
    if (rc == 0)
        rc = qm_placement_make(s->model->bank, 1, NULL, budget, &pl, st);
    qm_pager_options o = {.prefetch = prefetch, .on_miss = on_miss < 0 ? QM_ON_MISS_PAGE : on_miss};
    const char *src = r->cfg->paging_source;
    if (rc == 0 && (strcmp(src, "direct") == 0 ||
                    (strcmp(src, "auto") == 0 && qm_devices_host_visible(r->devices) &&
                     qm_plan_per_expert_count(plan) > 0)))
        o.source = QM_PAGER_SOURCE_DIRECT;
    if (rc == 0) {
        s->share = qm_share_new(&r->shares, s->model->bank, key, &policy, &plan, &pl, &o);
        if (!s->share)
            rc = qm_status_set(st, QM_ENOMEM, "out of memory");
    }
    qm_placement_free(&pl);
    qm_plan_free(plan);
    qm_policy_destroy(&policy);
    return rc;
}

int qm_session_prepare(qm_registry *r, const qm_params *p, uid_t owner, qm_session **out,
                       qm_status *st)
{
    const char *policy = p->policy ? p->policy : qm_policy_default_name();
    if (qm_policy_params_check(policy, NULL, st) < 0) /* the name: offered over the socket? */
        return QM_EINVAL;
    qm_model *m = qm_model_find(r, p->model);
    if (!m)
        return qm_status_set_field(st, QM_ENOT_FOUND, "model", "no model named '%.64s' is loaded",
                                   p->model);
    if (qm_model_check(m, st) < 0)
        return QM_EINVALID_MODEL;
    const qm_bank_config *cfg = qm_bank_get_config(m->bank);
    const qm_policy_params_wire *pw = &p->policy_params;
    if (pw->record_trace) {
        /* The decoder refused '/', "." and ".."; a name ending in .hot would
         * overwrite a model's hotness profile in the same directory. */
        size_t n = strlen(pw->record_trace);
        if (!r->cfg->state_dir)
            return qm_status_set_field(st, QM_EINVAL, "policy_params.record_trace",
                                       "policy_params.record_trace needs a state dir; this "
                                       "daemon runs without one (state_dir)");
        if (n >= 4 && strcmp(pw->record_trace + n - 4, ".hot") == 0)
            return qm_status_set_field(st, QM_EINVAL, "policy_params.record_trace",
                                       "policy_params.record_trace must not end in .hot (the "
                                       "state dir's hotness profiles)");
    }
    /* Which knobs (and hot lists) the policy takes: its own declaration. */
    static const uint32_t *const no_list = NULL;
    qm_policy_value values[QM_POLICY_VALUES_MAX];
    for (size_t i = 0; i < pw->n_values && i < QM_POLICY_VALUES_MAX; i++)
        values[i] = (qm_policy_value){pw->values[i].name, pw->values[i].value};
    qm_policy_params probe = {.version = QM_POLICY_PARAMS_VERSION,
                              .values = values,
                              .n_values = pw->n_values,
                              .hot = pw->hot ? &no_list : NULL};
    if (qm_policy_params_check(policy, &probe, st) < 0)
        return QM_EINVAL;
    for (size_t i = 0; i < pw->n_hot; i++) {
        char field[96];
        if (pw->hot[i].layer >= cfg->layers) {
            snprintf(field, sizeof field, "policy_params.hot[%zu].layer", i);
            return qm_status_set_field(st, QM_EINVAL, field,
                                       "layer %u is out of range; the model has %u layers",
                                       pw->hot[i].layer, cfg->layers);
        }
        for (size_t j = 0; j < pw->hot[i].n_experts; j++) {
            if (pw->hot[i].experts[j] >= cfg->experts) {
                snprintf(field, sizeof field, "policy_params.hot[%zu].experts[%zu]", i, j);
                return qm_status_set_field(st, QM_EINVAL, field,
                                           "expert %u is out of range; the model has %u experts",
                                           pw->hot[i].experts[j], cfg->experts);
            }
        }
    }
    if (r->n_sessions >= r->cfg->max_sessions) {
        qm_limit_hit(r->limits, QM_LIMIT_MAX_SESSIONS, "max_sessions %u reached",
                     r->cfg->max_sessions);
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED,
                             "max_sessions %u reached; close a session first",
                             r->cfg->max_sessions);
    }
    uint64_t workspace = r->cfg->session_workspace_bytes;
    /* Bytes, "N%" or "auto" to bytes (qm_budget.h). */
    uint64_t budget;
    qm_budget_auto autob;
    int rc = resolve_budget(r, m, &p->budget, workspace, NULL, &budget, &autob, st);
    if (rc < 0)
        return rc;
    qm_placement pl = {0};
    uint64_t dev_need[QM_CONFIG_MAX_DEVICES] = {0};
    rc = admit_on_devices(r, m, budget, workspace, &pl, dev_need, st);
    if (rc < 0)
        return rc == QM_ENOMEM ? rc : QM_ERESOURCE_EXHAUSTED;
    uint64_t need = 0;
    for (uint32_t i = 0; i < r->devices->n; i++)
        need += dev_need[i];

    qm_session *s = qm_calloc(1, sizeof *s);
    if (!s) {
        qm_placement_free(&pl);
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    }
    s->placement = pl;
    for (uint32_t i = 0; i < r->devices->n; i++)
        snprintf(s->device_names[i], sizeof s->device_names[i], "%s", r->devices->dev[i].name);
    rc = random_id(s->id, st);
    if (rc < 0)
        goto fail;
    s->owner_uid = owner;
    s->model = m;
    m->refs++;
    snprintf(s->policy_name, sizeof s->policy_name, "%s", policy);
    s->precision_fast = p->precision_fast;
    s->budget_bytes = budget;
    s->auto_budget = autob;
    s->workspace_bytes = workspace;
    s->admitted_bytes = need;
    s->created_at = (int64_t)time(NULL);
    if (pw->record_trace) {
        size_t n = strlen(r->cfg->state_dir) + strlen(pw->record_trace) + 2;
        s->trace_path = qm_malloc(n);
        if (!s->trace_path) {
            rc = qm_status_set(st, QM_ENOMEM, "out of memory");
            goto fail;
        }
        snprintf(s->trace_path, n, "%s/%s", r->cfg->state_dir, pw->record_trace);
    }

    /* The hot lists of a policy that takes them, indexed by layer. */
    const uint32_t **hot = NULL;
    size_t *hot_len = NULL;
    /* Knobs given are passed as given (pin_fraction 0 included); the
     * policy's declared default covers the rest. */
    qm_policy_params pp = {.version = QM_POLICY_PARAMS_VERSION,
                           .values = values,
                           .n_values = pw->n_values};
    if (pw->hot) {
        hot = qm_calloc(cfg->layers, sizeof *hot);
        hot_len = qm_calloc(cfg->layers, sizeof *hot_len);
        if (!hot || !hot_len) {
            qm_free(hot);
            qm_free(hot_len);
            rc = qm_status_set(st, QM_ENOMEM, "out of memory");
            goto fail;
        }
        for (size_t i = 0; i < pw->n_hot; i++) {
            hot[pw->hot[i].layer] = pw->hot[i].experts;
            hot_len[pw->hot[i].layer] = pw->hot[i].n_experts;
        }
        pp.hot = hot;
        pp.hot_len = hot_len;
        pp.n_hot_banks = cfg->layers;
    }
    if (!pw->hot && qm_policy_accepts_hot(policy) && m->hotness &&
        qm_hotness_records(m->hotness) > 0) {
        /* No hot lists given: the model's persisted profile supplies them. */
        rc = qm_hotness_policy_params(m->hotness, &pp, st);
        if (rc < 0)
            goto fail;
    }
    rc = qm_policy_new(policy, &pp, &s->policy, st);
    if (rc == 0 && pw->share_residency)
        rc = share_find_or_make(r, s, pw, &pp, budget, st);
    qm_free(hot);
    qm_free(hot_len);
    if (rc < 0)
        goto fail;

    uint64_t t0 = qm_now_us();
    qm_plan_options opts = {.has_budget = 1, .budget_bytes = budget,
                            .min_split_bytes = pw->has_min_split_bytes ? pw->min_split_bytes : 0};
    rc = qm_plan_residency((const qm_region_catalog *const *)m->catalogs, m->n_layers, &s->policy,
                           &opts, &s->plan, st);
    if (rc < 0)
        goto fail;
    uint64_t plan_us = qm_now_us() - t0;

    s->plan_start_us = t0;
    s->plan_us = plan_us;
    /* The budget travels in the plan (qm_plan_budget); the pager reads it there. */
    s->pager_options = (qm_pager_options){.prefetch = pw->has_prefetch ? pw->prefetch : 1,
                                          .on_miss = qm_on_miss_parse(pw->on_miss)};
    if (s->pager_options.on_miss < 0)
        s->pager_options.on_miss = QM_ON_MISS_PAGE; /* absent */
    /* paging_source: auto reads a paged session's units from disk on a
     * host-visible backend (the CPU), so its budget bounds the memory the
     * bank takes instead of the page cache holding the file. */
    const char *src = r->cfg->paging_source;
    if (strcmp(src, "direct") == 0 ||
        (strcmp(src, "auto") == 0 && qm_devices_host_visible(r->devices) &&
         qm_plan_per_expert_count(s->plan) > 0))
        s->pager_options.source = QM_PAGER_SOURCE_DIRECT;
    /* A fast session of its own on the CPU: its whole banks in the decode
     * GEMV's r8 layout (a copy in its arena; the pager decides whether this
     * process's kernels read it: docs/PAGING.md). A shared pool stays in
     * the bank's layout: its members may be exact. */
    s->pager_options.interleave = r->cfg->cpu_repack && s->precision_fast && !s->share &&
                                  qm_devices_host_visible(r->devices);
    /* Reserved now, so creations in flight cannot overcommit the device
     * budget while their pagers are built off the loop thread. */
    s->refs = 1;
    r->n_sessions++;
    for (uint32_t i = 0; i < r->devices->n; i++)
        r->devices->dev[i].admitted += s->device_admitted[i] = dev_need[i];
    *out = s;
    return 0;
fail:
    session_free(s);
    return rc;
}

/* "session ID", or "session ID, device NAME" when it spans several. */
static void session_where(const qm_session *s, uint32_t i, char *out, size_t cap)
{
    if (s->placement.n_devices > 1)
        snprintf(out, cap, "session %s, device %s", s->id, s->device_names[i]);
    else
        snprintf(out, cap, "session %s", s->id);
}

int qm_session_build(const qm_registry *r, qm_session *s, qm_status *st)
{
    /* The pagers read the mapping (whole banks, pins, preload): the bank
     * file must be whole before, and still after. */
    qm_backend *backends[QM_CONFIG_MAX_DEVICES];
    qm_devices_backends(r->devices, backends);
    int rc = qm_model_check(s->model, st);
    if (s->share) {
        if (rc == 0)
            rc = qm_share_join(s->share, backends, s->budget_bytes, &s->share_stats, st);
        if (rc == 0) {
            s->share_joined = 1; /* from here a failure leaves through session_free */
            s->share_budget = s->budget_bytes;
            rc = qm_model_check(s->model, st);
        }
        if (rc < 0)
            return rc;
        s->last_stats = s->share_stats;
        qm_log(QM_LOG_INFO, "session %s shares the residency of model %s (policy %s)", s->id,
               s->model->name, s->policy_name);
        return 0;
    }
    if (rc == 0)
        rc = qm_multipager_new(backends, s->model->bank, s->plan, &s->policy, &s->pager_options,
                               &s->placement, &s->pagers, st);
    if (rc == 0)
        rc = qm_model_check(s->model, st);
    if (rc == 0 && s->trace_path) {
        rc = qm_multipager_record_trace(s->pagers, s->trace_path, st);
        if (rc < 0) {
            if (st)
                snprintf(st->field, sizeof st->field, "policy_params.record_trace");
        } else {
            qm_log(QM_LOG_INFO, "session %s records its routing to %s", s->id, s->trace_path);
        }
    }
    if (rc < 0)
        return rc;
    qm_session_stats(s, &s->last_stats);
    unsigned long fail_read = qm_fault_read_at();
    for (uint32_t i = 0; i < s->placement.n_devices; i++) {
        qm_pager *pg = qm_multipager_pager(s->pagers, i);
        const char *why = "";
        if (!pg)
            continue;
        char where[96];
        session_where(s, i, where, sizeof where);
        int direct = qm_pager_source_info(pg, &why) == QM_PAGER_SOURCE_DIRECT;
        if (direct && fail_read)
            qm_pager_set_read_hook(pg, qm_fault_read_hook, (void *)(uintptr_t)fail_read);
        if (direct)
            qm_log(QM_LOG_INFO, "%s pages from disk: O_DIRECT reads of %s%s%s", where,
                   qm_bank_path(s->model->bank), *why ? "; " : "", why);
        else if (*why)
            qm_log(QM_LOG_WARNING, "%s: %s", where, why);
    }
    return 0;
}

void qm_session_commit(qm_registry *r, qm_session *s)
{
    s->counters.resident_bytes = s->last_stats.resident_bytes;
    char args[192];
    snprintf(args, sizeof args, "{\"policy\":\"%s\",\"resident\":%zu,\"degraded\":%zu,\"total\":%zu}",
             s->policy_name, qm_plan_resident_count(s->plan), qm_plan_degraded_count(s->plan),
             qm_plan_total(s->plan));
    qm_trace_add(r->trace, "session.residency_plan", s->plan_start_us, s->plan_us, s->id, args,
                 &s->plan_span);
    s->next = r->sessions;
    r->sessions = s;
    qm_log(QM_LOG_INFO,
           "session %s created: model %s, policy %s, budget %llu%s%s%s, uid %u, %llu bytes of "
           "whole banks mapped in, %llu laid out for the fast CPU decode (r8)",
           s->id, s->model->name, s->policy_name, (unsigned long long)s->budget_bytes,
           s->auto_budget.on ? " (" : "", s->auto_budget.on ? s->auto_budget.why : "",
           s->auto_budget.on ? ")" : "", (unsigned)s->owner_uid, (unsigned long long)s->last_stats.bytes_prefaulted_at_create,
           (unsigned long long)s->last_stats.bytes_interleaved_at_create);
}

/* What the session holds on each device at `budget`: its share
 * (qm_placement_split) plus a workspace where it has layers. */
static int session_device_need(const qm_session *s, uint64_t budget, uint64_t *share,
                               uint64_t *need)
{
    qm_placement_split(&s->placement, budget, share);
    for (uint32_t i = 0; i < s->placement.n_devices; i++) {
        unsigned long long n = 0;
        if (share[i] && qm_add_u64(share[i], s->workspace_bytes, &n) < 0)
            return -1;
        need[i] = n;
    }
    return 0;
}

/* A growth that device i cannot take: `more` bytes beyond what the session
 * holds there. */
static int resize_refusal(const qm_registry *r, const qm_session *s, uint32_t i, uint64_t need,
                          uint64_t share, uint64_t budget, uint64_t more, uint64_t free_bytes,
                          qm_status *st)
{
    if (r->devices->n == 1)
        return qm_status_set_field(
            st, QM_ERESOURCE_EXHAUSTED, "budget_bytes",
            "growing the session to a budget of %llu needs %llu more bytes but only %llu "
            "bytes of the daemon-wide budget %llu are free",
            (unsigned long long)budget, (unsigned long long)more, (unsigned long long)free_bytes,
            (unsigned long long)r->devices->dev[i].budget);
    return device_refusal(r, i, need, share, budget, s->workspace_bytes,
                          free_bytes + s->device_admitted[i], st);
}

int qm_session_resize_reserve(qm_registry *r, qm_session *s, uint64_t budget, qm_status *st)
{
    /* Growth admitted per device against that device's free budget (the
     * refusal of session.create's admission), all or nothing. */
    uint64_t share[QM_PLACEMENT_MAX_DEVICES], need[QM_PLACEMENT_MAX_DEVICES];
    const uint32_t n = s->placement.n_devices;
    if (session_device_need(s, budget, share, need) < 0)
        return qm_status_set_field(st, QM_ERESOURCE_EXHAUSTED, "budget_bytes",
                                   "budget_bytes %llu overflows", (unsigned long long)budget);
    for (uint32_t i = 0; i < n; i++) {
        if (need[i] <= s->device_admitted[i])
            continue;
        uint64_t more = need[i] - s->device_admitted[i];
        uint64_t free_bytes = device_free(&r->devices->dev[i]);
        if (more > free_bytes)
            return resize_refusal(r, s, i, need[i], share[i], budget, more, free_bytes, st);
    }
    for (uint32_t i = 0; i < n; i++) {
        if (need[i] <= s->device_admitted[i])
            continue;
        uint64_t more = need[i] - s->device_admitted[i];
        r->devices->dev[i].admitted += more;
        s->admitted_bytes += more;
        s->device_admitted[i] = need[i];
    }
    s->resizes_pending++;
    return 0;
}

void qm_session_resize_finish(qm_registry *r, qm_session *s, int ok, uint64_t budget)
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
    for (uint32_t i = 0; i < s->placement.n_devices; i++) {
        if (s->device_admitted[i] <= need[i])
            continue;
        uint64_t less = s->device_admitted[i] - need[i];
        r->devices->dev[i].admitted -= less;
        s->admitted_bytes -= less;
        s->device_admitted[i] = need[i];
    }
}

void qm_session_abort(qm_registry *r, qm_session *s)
{
    atomic_store(&s->closed, 1); /* never served: nothing may mark or use it */
    r->n_sessions--;
    session_release_admission(r, s);
    qm_session_unref(s);
}

int qm_session_forward(qm_session *s, const qm_moe_call *call, qm_moe_stats *mstats,
                       qm_status *st)
{
    if (s->share)
        return qm_share_forward(s->share, call, mstats, s->share_budget, &s->share_stats, st);
    return qm_multipager_forward(s->pagers, call, mstats, st);
}

int qm_session_resize(qm_session *s, uint64_t budget, qm_status *st)
{
    int rc;
    if (s->share) {
        rc = qm_share_resize(s->share, s->share_budget, budget, &s->share_stats, st);
        if (rc == 0)
            s->share_budget = budget;
    } else {
        rc = qm_multipager_resize(s->pagers, budget, st);
    }
    if (rc == 0) { /* in the session's FIFO: no other job reads them now */
        qm_placement_split(&s->placement, budget, s->placement.budget);
        qm_plan_set_budget(s->plan, budget);
    }
    return rc;
}

void qm_session_stats(const qm_session *s, qm_pager_stats *out)
{
    if (s->share)
        *out = s->share_stats;
    else
        qm_multipager_stats(s->pagers, out);
}

qm_pager *qm_session_pager_of(const qm_session *s, uint32_t layer)
{
    if (s->share) /* one device */
        return s->share_joined ? qm_multipager_pager(s->share->pagers, 0) : NULL;
    return layer < s->placement.n_layers
               ? qm_multipager_pager(s->pagers, s->placement.device_of[layer])
               : NULL;
}

/* ---- what the rest of the daemon reads ---- */

qm_session *qm_session_next(const qm_session *s) { return s->next; }
const char *qm_session_id(const qm_session *s) { return s->id; }
uid_t qm_session_owner(const qm_session *s) { return s->owner_uid; }
qm_model *qm_session_model(const qm_session *s) { return s->model; }
const char *qm_session_policy(const qm_session *s) { return s->policy_name; }

qm_precision qm_session_precision(const qm_session *s)
{
    return s->precision_fast ? QM_PRECISION_FAST : QM_PRECISION_EXACT;
}

uint64_t qm_session_budget(const qm_session *s) { return s->budget_bytes; }
uint64_t qm_session_workspace(const qm_session *s) { return s->workspace_bytes; }
int64_t qm_session_created_at(const qm_session *s) { return s->created_at; }
const qm_residency_plan *qm_session_plan(const qm_session *s) { return s->plan; }
const qm_span *qm_session_plan_span(const qm_session *s) { return &s->plan_span; }
qm_counters *qm_session_counters(qm_session *s) { return &s->counters; }
uint64_t qm_session_resident_bytes(const qm_session *s) { return s->counters.resident_bytes; }
const qm_pager_stats *qm_session_last_stats(const qm_session *s) { return &s->last_stats; }

void qm_session_note_stats(qm_session *s, const qm_pager_stats *now, qm_pager_stats *was)
{
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

int qm_session_budget_for(const qm_registry *r, const qm_session *s, const qm_budget_spec *spec,
                          uint64_t *bytes, qm_budget_auto *autob, qm_status *st)
{
    return resolve_budget(r, s->model, spec, 0, s, bytes, autob, st);
}

uint64_t qm_session_min_budget(const qm_registry *r, const qm_session *s)
{
    uint64_t min = s->budget_bytes;
    qm_status st;
    qm_status_clear(&st);
    if (qm_pager_min_budget(r->devices->dev[0].backend, s->model->bank, s->plan,
                            &s->pager_options, &min, &st) < 0)
        return s->budget_bytes;
    return min;
}

/* Whole-bank banks get no resident_now: they are resident for the session's
 * life, which the plan's decision already says (docs/PROTOCOL.md). */
int qm_session_plan_json(qm_session *s, char **json, size_t *len, qm_status *st)
{
    /* A sharing session reads the pool's residency (its own plan and
     * counters otherwise), with the pool held still. */
    const int has_pagers = s->pagers || s->share_joined;
    if (s->share)
        pthread_mutex_lock(&s->share->lock);
    size_t n = qm_plan_total(s->plan);
    qm_plan_json_bank_state *banks = qm_calloc(n ? n : 1, sizeof *banks);
    uint32_t **lists = qm_calloc(n ? n : 1, sizeof *lists);
    int rc = 0;
    if (!banks || !lists) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory reading the residency");
        goto free_lists;
    }
    qm_plan_json_state state = {.banks = banks, .n_banks = 0};
    /* The placement is shown when the session spans several devices. */
    const qm_placement *pl = &s->placement;
    const int placed = pl->n_devices > 1;
    for (size_t i = 0; i < n && has_pagers; i++) {
        uint32_t layer = qm_plan_bank_at(s->plan, i)->bank_id; /* bank id = layer */
        qm_pager *pager = qm_session_pager_of(s, layer);
        qm_plan_json_bank_state *b = &banks[state.n_banks];
        *b = (qm_plan_json_bank_state){.bank_id = layer};
        if (placed && layer < pl->n_layers) {
            b->has_device = 1; /* every bank names its device, whole or paged */
            b->device = pl->device_of[layer];
        }
        int count = pager && qm_pager_layer_is_paged(pager, layer) == 1
                        ? qm_pager_resident_experts(pager, layer, NULL, 0)
                        : -1;
        if (b->has_device || count >= 0)
            state.n_banks++;
        if (count < 0)
            continue;
        lists[i] = qm_malloc(((size_t)count + 1) * sizeof **lists);
        if (!lists[i]) {
            rc = qm_status_set(st, QM_ENOMEM, "out of memory reading the residency");
            goto free_lists;
        }
        size_t cap = (size_t)count;
        count = qm_pager_resident_experts(pager, layer, lists[i], cap);
        b->has_resident_now = 1;
        b->resident_now = lists[i];
        b->n_resident_now = count < 0 ? 0 : (size_t)count < cap ? (size_t)count : cap;
        /* Pins a resize released: after the resident list, in the same buffer. */
        int nrel = qm_pager_pins_released(pager, layer, NULL, 0);
        if (nrel > 0) {
            uint32_t *grown = qm_realloc(lists[i], (b->n_resident_now + (size_t)nrel) *
                                                        sizeof **lists);
            if (!grown) {
                rc = qm_status_set(st, QM_ENOMEM, "out of memory reading the residency");
                goto free_lists;
            }
            lists[i] = grown;
            b->resident_now = grown;
            b->pins_released = grown + b->n_resident_now;
            nrel = qm_pager_pins_released(pager, layer, grown + b->n_resident_now,
                                          (size_t)nrel);
            b->n_pins_released = nrel < 0 ? 0 : (size_t)nrel;
        }
    }
    const char *names[QM_CONFIG_MAX_DEVICES];
    if (placed) {
        for (uint32_t i = 0; i < pl->n_devices && i < QM_CONFIG_MAX_DEVICES; i++)
            names[i] = s->device_names[i];
        state.placement_rule = QM_PLACEMENT_RULE;
        state.device_names = names;
        state.device_budgets = pl->budget;
        state.n_devices = pl->n_devices;
    }
    if (has_pagers) {
        qm_pager_stats ps;
        qm_session_stats(s, &ps);
        state.has_resident_bytes = 1;
        state.resident_bytes = ps.resident_bytes;
        state.on_miss = qm_on_miss_name(s->pager_options.on_miss);
        state.expert_hits = ps.hits + ps.whole_bank_accesses;
        state.expert_misses = ps.misses;
        state.expert_host_runs = ps.host_runs;
    }
    qm_buf auto_text; /* budget "auto": what it came to and why (qm_budget.h) */
    qm_buf_init(&auto_text);
    if (s->auto_budget.on) {
        qm_jw aw;
        qm_jw_init(&aw, &auto_text);
        qm_budget_auto_json(&aw, &s->auto_budget);
        if (qm_buf_append(&auto_text, "", 1) == 0 && !auto_text.oom)
            state.budget_auto_json = auto_text.data; /* NUL-terminated */
    }
    rc = qm_plan_to_json_ex(s->plan, &state, json, len, st);
    qm_buf_free(&auto_text);
free_lists:
    if (s->share)
        pthread_mutex_unlock(&s->share->lock);
    for (size_t i = 0; lists && i < n; i++)
        qm_free(lists[i]);
    qm_free(lists);
    qm_free(banks);
    return rc;
}
