/* qm_registry.c - models (loaded once, shared, reference counted) and
 * sessions (unguessable ids, owner, policy, plan, pager), with admission
 * against the daemon-wide device budget. Loop thread only. */
#include "qm_models.h"
#include "qm_sessions.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>

#include "qm_alloc.h"
#include "qm_fault.h"
#include "qm_daemon.h"
#include "qm_log.h"
#include "qm_sigbus.h"
#include "qm_plan_json.h"

static void model_save_hotness(qm_model *m)
{
    if (!m->hotness || !m->hotness_path || qm_hotness_records(m->hotness) == m->hotness_saved)
        return;
    qm_status st;
    qm_status_clear(&st);
    if (qm_hotness_save(m->hotness, m->hotness_path, &st) < 0) {
        qm_log(QM_LOG_WARNING, "cannot save the hotness profile of %s: %s", m->name, st.msg);
        return;
    }
    m->hotness_saved = qm_hotness_records(m->hotness);
}

void qm_models_save_hotness(qm_daemon *d)
{
    for (qm_model *m = d->models; m; m = m->next)
        model_save_hotness(m);
}

/* Where the backend can (CUDA: cudaHostRegister), the whole mapping is
 * registered once with every device of the daemon (any of them may hold
 * layers of it: a session's placement), so paging copies are one DMA each
 * instead of going through bounce buffers. A refusal only costs speed (on
 * that device); backends with nothing to register (CPU) answer 0. */
static void model_register_host(qm_daemon *d, qm_model *m)
{
    uint64_t bytes;
    const void *base = qm_bank_mapping(m->bank, &bytes);
    for (uint32_t i = 0; i < d->devices.n; i++) {
        qm_backend *be = d->devices.dev[i].backend;
        const char *name = d->devices.dev[i].name;
        qm_status st;
        qm_status_clear(&st);
        int rc = qm_backend_register_host(be, base, (size_t)bytes, &st);
        if (rc > 0) {
            m->host_registered[m->n_host_registered++] = be;
            qm_log(QM_LOG_INFO, "model %s: %llu mapped bytes registered with %s", m->name,
                   (unsigned long long)bytes, name);
        } else if (rc < 0) {
            qm_log(QM_LOG_WARNING, "model %s: cannot register the mapping with %s (%s); copies "
                   "go through bounce buffers", m->name, name, st.msg);
        }
    }
}

static void model_unregister_host(qm_model *m)
{
    while (m->n_host_registered > 0) {
        qm_backend *be = m->host_registered[--m->n_host_registered];
        qm_status st;
        qm_status_clear(&st);
        if (qm_backend_unregister_host(be, qm_bank_mapping(m->bank, NULL), &st) < 0)
            qm_log(QM_LOG_WARNING, "model %s: cannot unregister the mapping: %s", m->name,
                   st.msg);
        m->host_registered[m->n_host_registered] = NULL;
    }
}

static void model_free(qm_model *m)
{
    if (!m)
        return;
    model_unregister_host(m);
    qm_sigbus_unregister(m->guard_slot);
    model_save_hotness(m);
    qm_hotness_free(m->hotness);
    qm_free(m->hotness_path);
    for (uint32_t i = 0; m->catalogs && i < m->n_layers; i++)
        qm_catalog_free(m->catalogs[i]);
    qm_free(m->catalogs);
    qm_bank_close(m->bank);
    qm_free(m->path);
    qm_free(m);
}

void qm_model_unref(qm_model *m)
{
    if (m && --m->refs == 0)
        model_free(m);
}

qm_model *qm_model_find(qm_daemon *d, const char *name)
{
    for (qm_model *m = d->models; m; m = m->next)
        if (strcmp(m->name, name) == 0)
            return m;
    return NULL;
}

int qm_model_load(qm_daemon *d, const char *name, const char *path, qm_model **out,
                  qm_status *st)
{
    if (qm_model_find(d, name))
        return qm_status_set_field(st, QM_ECONFLICT, "name",
                                   "a model named '%s' is already loaded; unload it first", name);
    qm_model *m = qm_calloc(1, sizeof *m);
    if (!m)
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    m->guard_slot = -1;
    snprintf(m->name, sizeof m->name, "%s", name);
    m->path = qm_strdup(path);
    int rc = m->path ? 0 : qm_status_set(st, QM_ENOMEM, "out of memory");
    /* A FIFO or device would block open(2) on the loop thread: only regular
     * files get that far (the loader checks again on the open fd). */
    struct stat sb;
    if (rc == 0 && stat(path, &sb) < 0)
        rc = qm_status_set(st, QM_EINVALID_MODEL, "cannot open %.200s: %s", path,
                           strerror(errno));
    else if (rc == 0 && !S_ISREG(sb.st_mode))
        rc = qm_status_set(st, QM_EINVALID_MODEL, "%.200s is not a regular file", path);
    if (rc == 0)
        rc = qm_bank_open(path, &m->bank, st);
    if (rc < 0) {
        /* Every way a bank file can be unusable is the client's invalid_model. */
        if (rc != QM_ENOMEM)
            rc = QM_EINVALID_MODEL;
        if (st) {
            st->code = rc;
            snprintf(st->field, sizeof st->field, "path");
        }
        goto free_model;
    }
    uint64_t mapped_bytes;
    const void *mapped = qm_bank_mapping(m->bank, &mapped_bytes);
    m->guard_slot = qm_sigbus_register(mapped, mapped_bytes);
    const qm_bank_config *cfg = qm_bank_get_config(m->bank);
    m->n_layers = cfg->layers;
    m->catalogs = qm_calloc(m->n_layers ? m->n_layers : 1, sizeof *m->catalogs);
    if (!m->catalogs) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory");
        goto free_model;
    }
    for (uint32_t l = 0; l < m->n_layers; l++) {
        rc = qm_bank_build_catalog(m->bank, l, &m->catalogs[l], st);
        if (rc < 0)
            goto free_model;
    }
    /* The profile persists across restarts in the state dir; a missing or
     * mismatched file starts an empty one. */
    qm_hotness_key key;
    qm_hotness_key_of_bank(m->bank, &key);
    char warning[256] = "";
    if (d->cfg.state_dir) {
        size_t n = strlen(d->cfg.state_dir) + strlen(name) + 8;
        m->hotness_path = qm_malloc(n);
        if (!m->hotness_path) {
            rc = qm_status_set(st, QM_ENOMEM, "out of memory");
            goto free_model;
        }
        snprintf(m->hotness_path, n, "%s/%s.hot", d->cfg.state_dir, name);
        rc = qm_hotness_load(m->hotness_path, &key, QM_HOTNESS_DEFAULT_DECAY, &m->hotness,
                             warning, sizeof warning, st);
    } else {
        rc = qm_hotness_new(&key, QM_HOTNESS_DEFAULT_DECAY, &m->hotness, st);
    }
    if (rc < 0)
        goto free_model;
    if (warning[0])
        qm_log(QM_LOG_WARNING, "model %s: %s", name, warning);
    m->hotness_saved = qm_hotness_records(m->hotness);
    m->bytes_total = qm_bank_expert_bytes_total(m->bank);
    const qm_layer_view *lv = qm_bank_layer(m->bank, 0);
    m->bytes_per_expert = lv ? lv->bytes_per_expert : 0;
    model_register_host(d, m);
    m->refs = 1;
    m->registered = 1;
    m->next = d->models;
    d->models = m;
    d->n_models++;
    if (out)
        *out = m;
    return 0;
free_model:
    model_free(m);
    return rc;
}

/* Symlinks and ".." are resolved on both sides before comparing, so a path
 * cannot step out of a directory; the resolved path is what gets opened. */
int qm_model_path_allowed(qm_daemon *d, const char *path, char **resolved, qm_status *st)
{
    *resolved = NULL;
    if (!d->cfg.model_dirs)
        return 0;
    char *real = realpath(path, NULL);
    if (!real)
        return qm_status_set_field(st, QM_EINVALID_MODEL, "path", "cannot open %.200s: %s",
                                   path, strerror(errno));
    const char *dirs = d->cfg.model_dirs;
    while (*dirs) {
        size_t n = strcspn(dirs, ":");
        char dir[4096];
        if (n > 0 && n < sizeof dir) {
            memcpy(dir, dirs, n);
            dir[n] = '\0';
            char *rdir = realpath(dir, NULL);
            if (rdir) {
                size_t rn = strlen(rdir);
                int inside = strncmp(real, rdir, rn) == 0 &&
                             (real[rn] == '/' || (rn == 1 && rdir[0] == '/'));
                free(rdir);
                if (inside) {
                    *resolved = qm_strdup(real);
                    free(real);
                    return *resolved ? 0 : qm_status_set(st, QM_ENOMEM, "out of memory");
                }
            }
        }
        dirs += n;
        if (*dirs == ':')
            dirs++;
    }
    free(real);
    return qm_status_set_field(st, QM_EPERMISSION, "path",
                               "%.200s is outside the directories of config key model_dirs "
                               "(%.200s)",
                               path, d->cfg.model_dirs[0] ? d->cfg.model_dirs : "empty: none");
}

void qm_jw_model_summary(qm_jw *w, const qm_model *m)
{
    const qm_bank_config *c = qm_bank_get_config(m->bank);
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "name", m->name);
    qm_jw_member_str(w, "path", m->path);
    qm_jw_member_u64(w, "layers", c->layers);
    qm_jw_member_u64(w, "experts", c->experts);
    qm_jw_member_u64(w, "hidden_size", c->hidden);
    qm_jw_member_u64(w, "inter_size", c->inter);
    qm_jw_member_u64(w, "k", c->k);
    qm_jw_member_str(w, "activation", qm_activation_name(c->activation));
    qm_jw_member_u64(w, "bits", c->bits);
    qm_jw_member_u64(w, "block_size", c->block_size);
    qm_jw_member_u64(w, "bytes_total", m->bytes_total);
    qm_jw_member_u64(w, "bytes_per_expert", m->bytes_per_expert);
    /* An imported bank's qmoe.layer_map: engines tag their MoE layers with
     * it (docs/ENGINES.md). Absent when the bank has none (identity). */
    const uint32_t *map = qm_bank_layer_map(m->bank);
    if (map) {
        qm_jw_key(w, "layer_map");
        qm_jw_arr_begin(w);
        for (uint32_t l = 0; l < c->layers; l++)
            qm_jw_u64(w, map[l]);
        qm_jw_arr_end(w);
    }
    qm_jw_obj_end(w);
}

int qm_model_unload(qm_daemon *d, const char *name, int force, qm_status *st)
{
    qm_model *m = qm_model_find(d, name);
    if (!m)
        return qm_status_set_field(st, QM_ENOT_FOUND, "name", "no model named '%s' is loaded",
                                   name);
    size_t users = 0;
    for (qm_session *s = d->sessions; s; s = s->next)
        users += s->model == m;
    if (users && !force)
        return qm_status_set_field(st, QM_EIN_USE, "name",
                                   "model '%s' has %zu open sessions; close them or pass force",
                                   name, users);
    for (qm_session *s = d->sessions, *next; s; s = next) {
        next = s->next;
        if (s->model == m)
            qm_session_close(d, s);
    }
    for (qm_model **pp = &d->models; *pp; pp = &(*pp)->next) {
        if (*pp == m) {
            *pp = m->next;
            break;
        }
    }
    d->n_models--;
    m->registered = 0;
    qm_log(QM_LOG_INFO, "model %s unloaded%s", name, users ? " (sessions closed)" : "");
    qm_model_unref(m);
    return 0;
}

/* ---- sessions ---- */

qm_session *qm_session_find(qm_daemon *d, const char *id)
{
    for (qm_session *s = d->sessions; s; s = s->next)
        if (strcmp(s->id, id) == 0)
            return s;
    return NULL;
}

static void session_free(qm_session *s)
{
    qm_shm_session_release_all(s);
    qm_multipager_free(s->pagers);
    qm_placement_free(&s->placement);
    qm_free(s->trace_path);
    qm_plan_free(s->plan);
    qm_policy_destroy(&s->policy);
    qm_model_unref(s->model);
    qm_free(s);
}

void qm_session_unref(qm_daemon *d, qm_session *s)
{
    (void)d;
    if (s && --s->refs == 0)
        session_free(s);
}

/* Gives the session's reservation back, on every device it holds. */
static void session_release_admission(qm_daemon *d, qm_session *s)
{
    for (uint32_t i = 0; i < d->devices.n; i++)
        d->devices.dev[i].admitted -= s->device_admitted[i];
}

void qm_session_close(qm_daemon *d, qm_session *s)
{
    for (qm_session **pp = &d->sessions; *pp; pp = &(*pp)->next) {
        if (*pp == s) {
            *pp = s->next;
            d->n_sessions--;
            session_release_admission(d, s);
            atomic_store(&s->closed, 1);
            s->next = NULL;
            /* Its maps go now; jobs still queued hold the ones they use. */
            qm_shm_session_release_all(s);
            qm_session_unref(d, s);
            return;
        }
    }
}

void qm_registry_free_all(qm_daemon *d)
{
    while (d->sessions)
        qm_session_close(d, d->sessions);
    while (d->models) {
        qm_model *m = d->models;
        d->models = m->next;
        d->n_models--;
        qm_model_unref(m);
    }
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

/* A session that device i cannot take at `budget`: `need` bytes there (its
 * `share` of the budget + a workspace) against `free_bytes` (a resize counts
 * what the session holds there already). With one device the device's
 * budget is the daemon-wide budget, and the sentence says so. */
static int device_refusal(const qm_daemon *d, uint32_t i, unsigned long long need, uint64_t share,
                          uint64_t budget, uint64_t workspace, uint64_t free_bytes, qm_status *st)
{
    const qm_device *dv = &d->devices.dev[i];
    if (d->devices.n == 1)
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
 * workspace (engine/qm_placement.h; a device that cannot hold a workspace
 * gets no layers unless none can; one device holds them all), and each
 * device that gets layers charged its share of the budget plus a workspace
 * (its pager's scratch). QM_ERESOURCE_EXHAUSTED naming the device when one
 * cannot take its share. */
static int admit_on_devices(qm_daemon *d, const qm_model *m, uint64_t budget, uint64_t workspace,
                            qm_placement *pl, uint64_t *dev_need, qm_status *st)
{
    const qm_devices *ds = &d->devices;
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
            rc = device_refusal(d, i, need, pl->budget[i], budget, workspace, free_bytes[i], st);
            qm_placement_free(pl);
            return rc;
        }
        dev_need[i] = need;
    }
    return 0;
}

int qm_session_prepare(qm_daemon *d, const qm_params *p, uid_t owner, qm_session **out,
                       qm_status *st)
{
    const char *policy = p->policy ? p->policy : "whole_bank";
    if (qm_policy_params_check(policy, NULL, st) < 0) /* the name: offered over the socket? */
        return QM_EINVAL;
    qm_model *m = qm_model_find(d, p->model);
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
        if (!d->cfg.state_dir)
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
    if (d->n_sessions >= d->cfg.max_sessions) {
        qm_limit_hit(d, QM_LIMIT_MAX_SESSIONS, "max_sessions %u reached", d->cfg.max_sessions);
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED,
                             "max_sessions %u reached; close a session first",
                             d->cfg.max_sessions);
    }
    uint64_t budget = p->has_budget ? p->budget_bytes : m->bytes_total;
    uint64_t workspace = d->cfg.session_workspace_bytes;
    qm_placement pl = {0};
    uint64_t dev_need[QM_CONFIG_MAX_DEVICES] = {0};
    int rc = admit_on_devices(d, m, budget, workspace, &pl, dev_need, st);
    if (rc < 0)
        return rc == QM_ENOMEM ? rc : QM_ERESOURCE_EXHAUSTED;
    uint64_t need = 0;
    for (uint32_t i = 0; i < d->devices.n; i++)
        need += dev_need[i];

    qm_session *s = qm_calloc(1, sizeof *s);
    if (!s) {
        qm_placement_free(&pl);
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    }
    s->placement = pl;
    for (uint32_t i = 0; i < d->devices.n; i++)
        snprintf(s->device_names[i], sizeof s->device_names[i], "%s", d->devices.dev[i].name);
    rc = random_id(s->id, st);
    if (rc < 0)
        goto fail;
    s->owner_uid = owner;
    s->model = m;
    m->refs++;
    snprintf(s->policy_name, sizeof s->policy_name, "%s", policy);
    s->precision_fast = p->precision_fast;
    s->budget_bytes = budget;
    s->workspace_bytes = workspace;
    s->admitted_bytes = need;
    s->created_at = (int64_t)time(NULL);
    if (pw->record_trace) {
        size_t n = strlen(d->cfg.state_dir) + strlen(pw->record_trace) + 2;
        s->trace_path = qm_malloc(n);
        if (!s->trace_path) {
            rc = qm_status_set(st, QM_ENOMEM, "out of memory");
            goto fail;
        }
        snprintf(s->trace_path, n, "%s/%s", d->cfg.state_dir, pw->record_trace);
    }

    /* static_hot's hot lists, indexed by layer. */
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
    const char *src = d->cfg.paging_source;
    if (strcmp(src, "direct") == 0 ||
        (strcmp(src, "auto") == 0 && qm_devices_host_visible(&d->devices) &&
         qm_plan_per_expert_count(s->plan) > 0))
        s->pager_options.source = QM_PAGER_SOURCE_DIRECT;
    /* Reserved now, so creations in flight cannot overcommit the device
     * budget while their pagers are built off the loop thread. */
    s->refs = 1;
    d->n_sessions++;
    for (uint32_t i = 0; i < d->devices.n; i++)
        d->devices.dev[i].admitted += s->device_admitted[i] = dev_need[i];
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

int qm_session_build(qm_daemon *d, qm_session *s, qm_status *st)
{
    /* The pagers read the mapping (whole banks, pins, preload): the bank
     * file must be whole before, and still after. */
    qm_backend *backends[QM_CONFIG_MAX_DEVICES];
    qm_devices_backends(&d->devices, backends);
    int rc = qm_model_check(s->model, st);
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

void qm_session_commit(qm_daemon *d, qm_session *s)
{
    s->counters.resident_bytes = s->last_stats.resident_bytes;
    char args[192];
    snprintf(args, sizeof args, "{\"policy\":\"%s\",\"resident\":%zu,\"degraded\":%zu,\"total\":%zu}",
             s->policy_name, qm_plan_resident_count(s->plan), qm_plan_degraded_count(s->plan),
             qm_plan_total(s->plan));
    qm_trace_add(&d->trace, "session.residency_plan", s->plan_start_us - d->start_us, s->plan_us,
                 s->id, args, &s->plan_span);
    s->next = d->sessions;
    d->sessions = s;
    qm_log(QM_LOG_INFO, "session %s created: model %s, policy %s, budget %llu, uid %u", s->id,
           s->model->name, s->policy_name, (unsigned long long)s->budget_bytes,
           (unsigned)s->owner_uid);
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
static int resize_refusal(const qm_daemon *d, const qm_session *s, uint32_t i, uint64_t need,
                          uint64_t share, uint64_t budget, uint64_t more, uint64_t free_bytes,
                          qm_status *st)
{
    if (d->devices.n == 1)
        return qm_status_set_field(
            st, QM_ERESOURCE_EXHAUSTED, "budget_bytes",
            "growing the session to a budget of %llu needs %llu more bytes but only %llu "
            "bytes of the daemon-wide budget %llu are free",
            (unsigned long long)budget, (unsigned long long)more, (unsigned long long)free_bytes,
            (unsigned long long)d->devices.dev[i].budget);
    return device_refusal(d, i, need, share, budget, s->workspace_bytes,
                          free_bytes + s->device_admitted[i], st);
}

int qm_session_resize_reserve(qm_daemon *d, qm_session *s, uint64_t budget, qm_status *st)
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
        uint64_t free_bytes = device_free(&d->devices.dev[i]);
        if (more > free_bytes)
            return resize_refusal(d, s, i, need[i], share[i], budget, more, free_bytes, st);
    }
    for (uint32_t i = 0; i < n; i++) {
        if (need[i] <= s->device_admitted[i])
            continue;
        uint64_t more = need[i] - s->device_admitted[i];
        d->devices.dev[i].admitted += more;
        s->admitted_bytes += more;
        s->device_admitted[i] = need[i];
    }
    s->resizes_pending++;
    return 0;
}

void qm_session_resize_finish(qm_daemon *d, qm_session *s, int ok, uint64_t budget)
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
        d->devices.dev[i].admitted -= less;
        s->admitted_bytes -= less;
        s->device_admitted[i] = need[i];
    }
}

void qm_session_abort(qm_daemon *d, qm_session *s)
{
    d->n_sessions--;
    session_release_admission(d, s);
    qm_session_unref(d, s);
}

int qm_session_forward(qm_session *s, const qm_moe_call *call, qm_moe_stats *mstats,
                       qm_status *st)
{
    return qm_multipager_forward(s->pagers, call, mstats, st);
}

int qm_session_resize(qm_session *s, uint64_t budget, qm_status *st)
{
    int rc = qm_multipager_resize(s->pagers, budget, st);
    if (rc == 0) /* in the session's FIFO: no other job reads it now */
        qm_placement_split(&s->placement, budget, s->placement.budget);
    return rc;
}

void qm_session_stats(const qm_session *s, qm_pager_stats *out)
{
    qm_multipager_stats(s->pagers, out);
}

qm_pager *qm_session_pager_of(const qm_session *s, uint32_t layer)
{
    return layer < s->placement.n_layers
               ? qm_multipager_pager(s->pagers, s->placement.device_of[layer])
               : NULL;
}
