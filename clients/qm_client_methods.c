/* qm_client_methods.c - one typed helper per PROTOCOL.md method: build the
 * params tree, make the call, copy the result into cJSON-free C structs. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_client_internal.h"

#define QM__NOMEM(err) qm__client_fail((err), QM_CLIENT_ENOMEM, "out of memory")

static uint64_t qm__u64(const qm_cval *o, const char *key)
{
    uint64_t v = 0;
    return qm_cval_get_u64(o, key, &v) == 0 ? v : 0;
}

static double qm__dbl(const qm_cval *o, const char *key)
{
    double v = 0;
    return qm_cval_get_double(o, key, &v) == 0 ? v : 0;
}

/* A member of a result struct read from the JSON member of its own name;
 * the tables below list a struct's u64 members and its owned strings once,
 * for the decoder and, for the strings, the destructor. */
typedef struct qm__field {
    const char *key;
    size_t off;
} qm__field;
#define QM__FIELD(type, member) {#member, offsetof(type, member)}
#define QM__N_FIELDS(table) (sizeof(table) / sizeof((table)[0]))

static void qm__read_u64s(const qm_cval *o, void *item, const qm__field *f, size_t n)
{
    for (size_t i = 0; i < n; i++)
        *(uint64_t *)((char *)item + f[i].off) = qm__u64(o, f[i].key);
}

/* -1 when out of memory (the strings copied so far stay with item). */
static int qm__dup_strs(const qm_cval *o, void *item, const qm__field *f, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (qm__client_dup_member(o, f[i].key, (char **)((char *)item + f[i].off)) < 0)
            return -1;
    return 0;
}

static void qm__free_strs(void *item, const qm__field *f, size_t n)
{
    for (size_t i = 0; i < n; i++)
        qm_free(*(char **)((char *)item + f[i].off));
}

/* A count the daemon may send as a number or as the list itself. */
static uint64_t qm__count(const qm_cval *o, const char *key)
{
    const qm_cval *v = qm_cval_get(o, key);
    if (v && (v->type == QM_CVAL_ARRAY || v->type == QM_CVAL_OBJECT))
        return v->count;
    return qm__u64(o, key);
}

static qm_cval *qm__params(void) { return qm_cval_new(QM_CVAL_OBJECT); }

/* Adds a string member; on failure frees `p` and returns NULL. */
static qm_cval *qm__with_str(qm_cval *p, const char *key, const char *s)
{
    if (!p || qm_cval_append(p, key, qm_cval_new_string(s)) < 0) {
        qm_cval_free(p);
        return NULL;
    }
    return p;
}

static qm_cval *qm__with_num(qm_cval *p, const char *key, double v)
{
    if (!p || qm_cval_append(p, key, qm_cval_new_number(v)) < 0) {
        qm_cval_free(p);
        return NULL;
    }
    return p;
}

static int qm__bad_result(qm_client_error *err, const char *method, const char *what)
{
    return qm__client_fail(err, QM_CLIENT_EPROTO, "qmoed's answer to %s lacks %s", method, what);
}

/* Fills one zeroed item of a list from its object; QM_CLIENT_ENOMEM leaves
 * what it filled to the list's free function. */
typedef int (*qm__item_from_fn)(const qm_cval *o, void *item);
typedef void (*qm__items_free_fn)(void *items, size_t count);

/* Calls `method` (`p`: its params, consumed) and decodes the result's array
 * member `key` (`what` names it in the error) into a new array of
 * `size`-byte items: *items and *count, or NULL and 0 with nothing left to
 * free. */
static int qm__call_list(qm_client *c, const char *method, qm_cval *p, const char *key,
                         const char *what, size_t size, qm__item_from_fn from,
                         qm__items_free_fn free_items, void **items, size_t *count,
                         qm_client_error *err)
{
    qm_cval *r = NULL;
    char *out = NULL;
    *items = NULL;
    *count = 0;
    int rc = qm__client_call(c, method, p, &r, err);
    if (rc < 0)
        return rc;
    const qm_cval *list = qm_cval_get(r, key);
    if (!list || list->type != QM_CVAL_ARRAY)
        rc = qm__bad_result(err, method, what);
    else if (!(out = qm_calloc(list->count ? list->count : 1, size)))
        rc = QM__NOMEM(err);
    for (size_t i = 0; rc == 0 && i < list->count; i++) {
        if (from(list->items[i], out + i * size) < 0) {
            free_items(out, i + 1);
            rc = QM__NOMEM(err);
        }
    }
    if (rc == 0) {
        *items = out;
        *count = list->count;
    }
    qm_cval_free(r);
    return rc;
}

/* Calls a method whose result carries nothing the caller keeps. */
static int qm__call_plain(qm_client *c, const char *method, qm_cval *p, qm_client_error *err)
{
    qm_cval *r = NULL;
    int rc = qm__client_call(c, method, p, &r, err);
    qm_cval_free(r);
    return rc;
}

/* ---------- daemon.status ---------- */

static const qm__field qm__device_u64s[] = {
    QM__FIELD(qm_client_device, total_bytes),
    QM__FIELD(qm_client_device, budget_bytes),
    QM__FIELD(qm_client_device, used_bytes),
};
static const qm__field qm__device_strs[] = {
    QM__FIELD(qm_client_device, name),
    QM__FIELD(qm_client_device, kind),
    QM__FIELD(qm_client_device, description),
};

static void qm__devices_free(qm_client_device *d, size_t n)
{
    for (size_t i = 0; d && i < n; i++)
        qm__free_strs(&d[i], qm__device_strs, QM__N_FIELDS(qm__device_strs));
    qm_free(d);
}

/* A "devices" array (daemon.status, a plan's placement); absent: none. */
static int qm__devices(const qm_cval *o, qm_client_device **out, size_t *n)
{
    const qm_cval *a = qm_cval_get(o, "devices");
    *out = NULL;
    *n = 0;
    if (!a || a->type != QM_CVAL_ARRAY)
        return 0;
    *out = qm_calloc(a->count ? a->count : 1, sizeof(**out));
    if (!*out)
        return QM_CLIENT_ENOMEM;
    *n = a->count;
    for (size_t i = 0; i < a->count; i++) {
        const qm_cval *e = a->items[i];
        qm_client_device *d = &(*out)[i];
        qm__read_u64s(e, d, qm__device_u64s, QM__N_FIELDS(qm__device_u64s));
        if (qm__dup_strs(e, d, qm__device_strs, QM__N_FIELDS(qm__device_strs)) < 0)
            return QM_CLIENT_ENOMEM;
    }
    return 0;
}

static const qm__field qm__kernel_strs[] = {
    QM__FIELD(qm_client_kernel, precision),
    QM__FIELD(qm_client_kernel, name),
    QM__FIELD(qm_client_kernel, reason),
};

/* daemon.status "kernels": its members and its three lists, each item with
 * its list's name as its state; absent: none. */
static int qm__kernels(const qm_cval *r, qm_client_status *out)
{
    static const char *const lists[] = {"verified", "refused", "unavailable"};
    const qm_cval *k = qm_cval_get(r, "kernels");
    if (!k || k->type != QM_CVAL_OBJECT)
        return 0;
    out->kernels_check_ms = qm__dbl(k, "check_ms");
    const qm_cval *cached = qm_cval_get(k, "cached");
    out->kernels_cached = cached && cached->type == QM_CVAL_BOOL && cached->boolean;
    if (qm__client_dup_member(k, "cpu", &out->kernels_cpu) < 0 ||
        qm__client_dup_member(k, "flags", &out->kernels_flags) < 0)
        return QM_CLIENT_ENOMEM;
    size_t total = 0;
    for (size_t l = 0; l < 3; l++) {
        const qm_cval *a = qm_cval_get(k, lists[l]);
        total += a && a->type == QM_CVAL_ARRAY ? a->count : 0;
    }
    out->kernels = qm_calloc(total ? total : 1, sizeof(*out->kernels));
    if (!out->kernels)
        return QM_CLIENT_ENOMEM;
    for (size_t l = 0; l < 3; l++) {
        const qm_cval *a = qm_cval_get(k, lists[l]);
        for (size_t i = 0; a && a->type == QM_CVAL_ARRAY && i < a->count; i++) {
            qm_client_kernel *kv = &out->kernels[out->n_kernels++];
            if (qm__dup_strs(a->items[i], kv, qm__kernel_strs, QM__N_FIELDS(qm__kernel_strs)) < 0 ||
                !(kv->state = qm_strdup(lists[l])))
                return QM_CLIENT_ENOMEM;
        }
    }
    return 0;
}

void qm_client_status_free(qm_client_status *s)
{
    if (!s)
        return;
    qm_free(s->version);
    qm_free(s->backend);
    qm_free(s->device_name);
    qm__devices_free(s->devices, s->n_devices);
    qm_free(s->kernels_cpu);
    qm_free(s->kernels_flags);
    for (size_t i = 0; s->kernels && i < s->n_kernels; i++) {
        qm__free_strs(&s->kernels[i], qm__kernel_strs, QM__N_FIELDS(qm__kernel_strs));
        qm_free(s->kernels[i].state);
    }
    qm_free(s->kernels);
    memset(s, 0, sizeof(*s));
}

int qm_client_daemon_status(qm_client *c, qm_client_status *out, qm_client_error *err)
{
    qm_cval *r = NULL;
    memset(out, 0, sizeof(*out));
    int rc = qm__client_call(c, "daemon.status", NULL, &r, err);
    if (rc < 0)
        return rc;
    if (r->type != QM_CVAL_OBJECT) {
        rc = qm__bad_result(err, "daemon.status", "an object");
        goto out;
    }
    const qm_cval *dev = qm_cval_get(r, "device");
    out->uptime_s = qm__dbl(r, "uptime_s");
    out->device_total_bytes = qm__u64(dev, "total_bytes");
    out->device_budget_bytes = qm__u64(dev, "budget_bytes");
    out->device_used_bytes = qm__u64(dev, "used_bytes");
    out->models = qm__count(r, "models");
    out->sessions = qm__count(r, "sessions");
    out->connections = qm__count(r, "connections");
    if (qm__client_dup_member(r, "version", &out->version) < 0 ||
        qm__client_dup_member(r, "backend", &out->backend) < 0 ||
        qm__client_dup_member(dev, "name", &out->device_name) < 0 ||
        qm__devices(r, &out->devices, &out->n_devices) < 0 || qm__kernels(r, out) < 0) {
        qm_client_status_free(out);
        rc = QM__NOMEM(err);
    }
out:
    qm_cval_free(r);
    return rc;
}

/* ---------- models ---------- */

static const qm__field qm__model_u64s[] = {
    QM__FIELD(qm_client_model, layers),
    QM__FIELD(qm_client_model, experts),
    QM__FIELD(qm_client_model, hidden_size),
    QM__FIELD(qm_client_model, inter_size),
    QM__FIELD(qm_client_model, k),
    QM__FIELD(qm_client_model, bits),
    QM__FIELD(qm_client_model, block_size),
    QM__FIELD(qm_client_model, bytes_total),
    QM__FIELD(qm_client_model, bytes_per_expert),
};
static const qm__field qm__model_strs[] = {
    QM__FIELD(qm_client_model, name),
    QM__FIELD(qm_client_model, path),
    QM__FIELD(qm_client_model, activation),
};

void qm_client_model_free(qm_client_model *m)
{
    if (!m)
        return;
    qm__free_strs(m, qm__model_strs, QM__N_FIELDS(qm__model_strs));
    memset(m, 0, sizeof(*m));
}

void qm_client_models_free(qm_client_model *models, size_t count)
{
    for (size_t i = 0; models && i < count; i++)
        qm_client_model_free(&models[i]);
    qm_free(models);
}

static void qm__models_free(void *models, size_t count) { qm_client_models_free(models, count); }

static int qm__model_from(const qm_cval *o, void *item)
{
    qm_client_model *m = item;
    memset(m, 0, sizeof(*m));
    qm__read_u64s(o, m, qm__model_u64s, QM__N_FIELDS(qm__model_u64s));
    if (qm__dup_strs(o, m, qm__model_strs, QM__N_FIELDS(qm__model_strs)) < 0) {
        qm_client_model_free(m);
        return QM_CLIENT_ENOMEM;
    }
    return 0;
}

int qm_client_model_load(qm_client *c, const char *name, const char *path,
                         qm_client_model *out, qm_client_error *err)
{
    qm_cval *r = NULL;
    if (out)
        memset(out, 0, sizeof(*out));
    if (!name || !path)
        return qm__client_fail(err, QM_CLIENT_EINVAL, "model.load needs a name and a path");
    qm_cval *p = qm__with_str(qm__with_str(qm__params(), "name", name), "path", path);
    if (!p)
        return QM__NOMEM(err);
    int rc = qm__client_call(c, "model.load", p, &r, err);
    if (rc == 0) /* what a restarted daemon may be given again */
        qm_client_set_model_bank(c, name, path, NULL);
    if (rc == 0 && out && qm__model_from(r, out) < 0)
        rc = QM__NOMEM(err);
    qm_cval_free(r);
    return rc;
}

int qm_client_model_unload(qm_client *c, const char *name, int force, qm_client_error *err)
{
    if (!name)
        return qm__client_fail(err, QM_CLIENT_EINVAL, "model.unload needs a name");
    qm_cval *p = qm__with_str(qm__params(), "name", name);
    if (p && force && qm_cval_append(p, "force", qm_cval_new_bool(1)) < 0) {
        qm_cval_free(p);
        p = NULL;
    }
    if (!p)
        return QM__NOMEM(err);
    return qm__call_plain(c, "model.unload", p, err);
}

int qm_client_model_list(qm_client *c, qm_client_model **models, size_t *count,
                         qm_client_error *err)
{
    return qm__call_list(c, "model.list", NULL, "models", "a models array", sizeof(**models),
                         qm__model_from, qm__models_free, (void **)models, count, err);
}

/* ---------- sessions ---------- */

void qm_client_plan_summary_free(qm_client_plan_summary *s)
{
    if (!s)
        return;
    qm_free(s->policy);
    qm_free(s->budget_auto);
    memset(s, 0, sizeof(*s));
}

/* The result's plan_summary (session.create, session.resize); QM_CLIENT_ENOMEM. */
static int qm__read_summary(const qm_cval *r, qm_client_plan_summary *summary)
{
    const qm_cval *s = qm_cval_get(r, "plan_summary");
    summary->budget_bytes = qm__u64(s, "budget_bytes");
    summary->total = qm__u64(s, "total");
    summary->resident = qm__u64(s, "resident");
    summary->degraded = qm__u64(s, "degraded");
    summary->pins_released = qm__u64(s, "pins_released");
    summary->workspace_bytes = qm__u64(s, "workspace_bytes");
    if (!summary->workspace_bytes)
        summary->workspace_bytes = qm__u64(r, "workspace_bytes");
    const qm_cval *a = qm_cval_get(r, "budget_auto");
    if (a && a->type == QM_CVAL_OBJECT &&
        qm__client_dup_member(a, "reason", &summary->budget_auto) < 0)
        return QM_CLIENT_ENOMEM;
    return qm__client_dup_member(s, "policy", &summary->policy) < 0 ? QM_CLIENT_ENOMEM : 0;
}

int qm_client_session_create(qm_client *c, const qm_client_session_params *sp,
                             char **session_id, qm_client_plan_summary *summary,
                             qm_client_error *err)
{
    qm_cval *r = NULL, *pp = NULL;
    *session_id = NULL;
    if (summary)
        memset(summary, 0, sizeof(*summary));
    if (!sp || !sp->model)
        return qm__client_fail(err, QM_CLIENT_EINVAL, "session.create needs a model name");
    if (sp->policy_params_json) {
        qm_status st = {0};
        if (qm_cval_parse(sp->policy_params_json, strlen(sp->policy_params_json), &pp, &st) < 0)
            return qm__client_fail(err, QM_CLIENT_EINVAL, "policy_params are not valid JSON: %s",
                                   st.msg);
        if (pp->type != QM_CVAL_OBJECT) {
            qm_cval_free(pp);
            return qm__client_fail(err, QM_CLIENT_EINVAL, "policy_params must be a JSON object");
        }
    }
    qm_cval *p = qm__with_str(qm__params(), "model", sp->model);
    if (p && sp->policy)
        p = qm__with_str(p, "policy", sp->policy);
    if (p && sp->budget)
        p = qm__with_str(p, "budget", sp->budget);
    else if (p && sp->has_budget)
        p = qm__with_num(p, "budget_bytes", (double)sp->budget_bytes);
    if (p && sp->precision)
        p = qm__with_str(p, "precision", sp->precision);
    if (p && pp) {
        int arc = qm_cval_append(p, "policy_params", pp);
        pp = NULL;
        if (arc < 0) {
            qm_cval_free(p);
            p = NULL;
        }
    }
    qm_cval_free(pp);
    if (!p)
        return QM__NOMEM(err);
    /* Kept to re-create the session after a restart (NULL: not kept),
     * without client_pending_bytes: by then the client has taken them. */
    char *sent = qm_cval_print(p, 0, NULL);
    if (sp->client_pending_bytes)
        p = qm__with_num(p, "client_pending_bytes", (double)sp->client_pending_bytes);
    if (!p) {
        qm_free(sent);
        return QM__NOMEM(err);
    }
    int rc = qm__client_own_reserve(c, err);
    if (rc < 0) {
        qm_free(sent);
        qm_cval_free(p);
        return rc;
    }
    rc = qm__client_call(c, "session.create", p, &r, err);
    if (rc < 0) {
        qm_free(sent);
        return rc;
    }
    if (!qm_cval_get_string(r, "session")) {
        rc = qm__bad_result(err, "session.create", "a session id");
        goto out;
    }
    if (qm__client_dup_member(r, "session", session_id) < 0) {
        rc = QM__NOMEM(err);
        goto out;
    }
    if (summary && qm__read_summary(r, summary) < 0) {
        qm_free(*session_id);
        *session_id = NULL;
        rc = QM__NOMEM(err);
    }
    /* Owned from here (even when the caller got ENOMEM and no id): the
     * handle closes it at qm_client_close or exit. */
    qm__client_own(c, qm_cval_get_string(r, "session"));
    if (sent) {
        const qm_cval *ps = qm_cval_get(r, "plan_summary");
        qm__client_keep(c, qm_cval_get_string(r, "session"), sent, sp->model,
                        qm__u64(ps, "per_expert") > 0);
        sent = NULL;
    }
out:
    qm_free(sent);
    qm_cval_free(r);
    return rc;
}

/* session.resize with the budget as bytes (text NULL) or as text, and the
 * client's pending bytes when `pending` is not NULL (with "auto"). */
static int qm__resize(qm_client *c, const char *session, uint64_t budget_bytes, const char *text,
                      const uint64_t *pending, uint64_t *resident_bytes,
                      qm_client_plan_summary *summary, qm_client_error *err)
{
    qm_cval *r = NULL;
    if (summary)
        memset(summary, 0, sizeof(*summary));
    if (!session)
        return qm__client_fail(err, QM_CLIENT_EINVAL, "session.resize needs a session id");
    qm_cval *p = qm__with_str(qm__params(), "session", session);
    if (p && text)
        p = qm__with_str(p, "budget", text);
    else if (p)
        p = qm__with_num(p, "budget_bytes", (double)budget_bytes);
    if (p && pending)
        p = qm__with_num(p, "client_pending_bytes", (double)*pending);
    if (!p)
        return QM__NOMEM(err);
    int rc = qm__client_call(c, "session.resize", p, &r, err);
    if (rc < 0)
        return rc;
    qm__client_keep_budget(c, session, budget_bytes, text);
    if (resident_bytes)
        *resident_bytes = qm__u64(r, "resident_bytes");
    if (summary && qm__read_summary(r, summary) < 0)
        rc = QM__NOMEM(err);
    qm_cval_free(r);
    return rc;
}

int qm_client_session_resize(qm_client *c, const char *session, uint64_t budget_bytes,
                             uint64_t *resident_bytes, qm_client_plan_summary *summary,
                             qm_client_error *err)
{
    return qm__resize(c, session, budget_bytes, NULL, NULL, resident_bytes, summary, err);
}

int qm_client_session_resize_to(qm_client *c, const char *session, const char *budget,
                                uint64_t *resident_bytes, qm_client_plan_summary *summary,
                                qm_client_error *err)
{
    if (!budget)
        return qm__client_fail(err, QM_CLIENT_EINVAL, "session.resize needs a budget");
    return qm__resize(c, session, 0, budget, NULL, resident_bytes, summary, err);
}

int qm_client_session_resize_auto(qm_client *c, const char *session,
                                  uint64_t client_pending_bytes, uint64_t *resident_bytes,
                                  qm_client_plan_summary *summary, qm_client_error *err)
{
    return qm__resize(c, session, 0, "auto", &client_pending_bytes, resident_bytes, summary,
                      err);
}

int qm_client_session_close(qm_client *c, const char *session, qm_client_error *err)
{
    if (!session)
        return qm__client_fail(err, QM_CLIENT_EINVAL, "session.close needs a session id");
    qm_cval *p = qm__with_str(qm__params(), "session", session);
    if (!p)
        return QM__NOMEM(err);
    int rc = qm__call_plain(c, "session.close", p, err);
    if (rc == 0 || rc == -32001) { /* closed, or gone already */
        qm__client_disown(c, session);
        qm__client_unkeep(c, session);
        pthread_mutex_lock(&c->lock);
        qm__client_rings_forget(c, session); /* the daemon closed its rings */
        pthread_mutex_unlock(&c->lock);
    }
    return rc;
}

int qm_client_session_detach(qm_client *c, const char *session, qm_client_error *err)
{
    if (err)
        memset(err, 0, sizeof(*err));
    if (!c || !session)
        return qm__client_fail(err, QM_CLIENT_EINVAL, "no client handle or session id given");
    if (!qm__client_disown(c, session))
        return qm__client_fail(err, QM_CLIENT_EINVAL,
                               "session %.64s is not one this handle owns (created or adopted)",
                               session);
    qm__client_unkeep(c, session); /* another process carries it on */
    return 0;
}

int qm_client_session_adopt(qm_client *c, const char *session, qm_client_error *err)
{
    if (!c || !session)
        return qm__client_fail(err, QM_CLIENT_EINVAL, "no client handle or session id given");
    int rc = qm__client_own_reserve(c, err);
    if (rc < 0)
        return rc;
    /* A request naming it: it must exist and be the caller's, and the
     * daemon counts this connection as using it from now on. */
    qm_cval *p = qm__with_str(qm__params(), "session", session);
    if (!p)
        return QM__NOMEM(err);
    rc = qm__call_plain(c, "telemetry.get", p, err);
    if (rc < 0)
        return rc;
    qm__client_disown(c, session); /* adopted twice: recorded once */
    qm__client_own(c, session);
    return 0;
}

/* A count or time that may be absent or null: -1 then. */
static int64_t qm__opt_count(const qm_cval *o, const char *key)
{
    const qm_cval *v = qm_cval_get(o, key);
    if (!v)
        return -1;
    if (v->type == QM_CVAL_ARRAY)
        return (int64_t)v->count;
    if (v->type == QM_CVAL_NUMBER && v->number >= 0)
        return (int64_t)v->number;
    return -1;
}

static const qm__field qm__session_u64s[] = {
    QM__FIELD(qm_client_session_info, owner_uid),
    QM__FIELD(qm_client_session_info, budget_bytes),
    QM__FIELD(qm_client_session_info, resident_bytes),
};
static const qm__field qm__session_strs[] = {
    QM__FIELD(qm_client_session_info, session),
    QM__FIELD(qm_client_session_info, model),
    QM__FIELD(qm_client_session_info, policy),
};

void qm_client_sessions_free(qm_client_session_info *s, size_t count)
{
    for (size_t i = 0; s && i < count; i++)
        qm__free_strs(&s[i], qm__session_strs, QM__N_FIELDS(qm__session_strs));
    qm_free(s);
}

static void qm__sessions_free(void *s, size_t count) { qm_client_sessions_free(s, count); }

static int qm__session_from(const qm_cval *o, void *item)
{
    qm_client_session_info *s = item;
    qm__read_u64s(o, s, qm__session_u64s, QM__N_FIELDS(qm__session_u64s));
    s->created_at = qm__dbl(o, "created_at");
    s->orphaned_since = qm__opt_count(o, "orphaned_since");
    s->reclaim_in_s = qm__opt_count(o, "reclaim_in_s");
    if (qm__dup_strs(o, s, qm__session_strs, QM__N_FIELDS(qm__session_strs)) < 0)
        return QM_CLIENT_ENOMEM;
    return 0;
}

int qm_client_session_list(qm_client *c, qm_client_session_info **sessions, size_t *count,
                           qm_client_error *err)
{
    return qm__call_list(c, "session.list", NULL, "sessions", "a sessions array",
                         sizeof(**sessions), qm__session_from, qm__sessions_free,
                         (void **)sessions, count, err);
}

/* ---------- session.plan ---------- */

void qm_client_plan_free(qm_client_plan *p)
{
    if (!p)
        return;
    for (size_t i = 0; p->banks && i < p->n_banks; i++) {
        qm_client_plan_bank *b = &p->banks[i];
        qm_free(b->decision);
        qm_free(b->reason_kind);
        qm_free(b->reason_detail);
        qm_free(b->experts);
        qm_free(b->pinned);
    }
    qm_free(p->banks);
    qm_free(p->policy);
    qm_free(p->on_miss);
    qm_free(p->placement_rule);
    qm_free(p->budget_auto);
    qm__devices_free(p->devices, p->n_devices);
    memset(p, 0, sizeof(*p));
}

/* Copies an array of expert indices; a missing or null member gives none. */
static int qm__indices(const qm_cval *o, const char *key, uint32_t **out, size_t *n)
{
    const qm_cval *a = qm_cval_get(o, key);
    *out = NULL;
    *n = 0;
    if (!a || a->type != QM_CVAL_ARRAY)
        return 0;
    *out = qm_calloc(a->count ? a->count : 1, sizeof(**out));
    if (!*out)
        return QM_CLIENT_ENOMEM;
    for (size_t i = 0; i < a->count; i++)
        (*out)[i] = a->items[i]->type == QM_CVAL_NUMBER ? (uint32_t)a->items[i]->number : 0;
    *n = a->count;
    return 0;
}

/* "resident now" is a count, or the list of resident experts; -1 when absent. */
int qm_client_session_plan(qm_client *c, const char *session, qm_client_plan *out,
                           qm_client_error *err)
{
    qm_cval *r = NULL;
    memset(out, 0, sizeof(*out));
    if (!session)
        return qm__client_fail(err, QM_CLIENT_EINVAL, "session.plan needs a session id");
    qm_cval *p = qm__with_str(qm__params(), "session", session);
    if (!p)
        return QM__NOMEM(err);
    int rc = qm__client_call(c, "session.plan", p, &r, err);
    if (rc < 0)
        return rc;
    const qm_cval *banks = qm_cval_get(r, "banks");
    if (!banks || banks->type != QM_CVAL_ARRAY) {
        rc = qm__bad_result(err, "session.plan", "a banks array");
        goto out;
    }
    out->budget_bytes = qm__u64(r, "budget_bytes");
    out->total = qm__u64(r, "total");
    out->resident = qm__u64(r, "resident");
    out->degraded = qm__u64(r, "degraded");
    out->resident_bytes = qm__opt_count(r, "resident_bytes");
    const qm_cval *ex = qm_cval_get(r, "execution");
    if (ex && ex->type == QM_CVAL_OBJECT) {
        if (qm__client_dup_member(ex, "on_miss", &out->on_miss) < 0)
            goto fail_nomem;
        out->expert_hits = qm__u64(ex, "expert_hits");
        out->expert_misses = qm__u64(ex, "expert_misses");
        out->expert_host_runs = qm__u64(ex, "expert_host_runs");
    }
    const qm_cval *ba = qm_cval_get(r, "budget_auto");
    if (ba && ba->type == QM_CVAL_OBJECT) {
        if (qm__client_dup_member(ba, "reason", &out->budget_auto) < 0)
            goto fail_nomem;
        out->budget_auto_target = qm__u64(ba, "target_bytes");
        out->budget_auto_reserve = qm__u64(ba, "reserve_bytes");
        out->budget_auto_ceiling = qm__u64(ba, "ceiling_bytes"); /* null: 0 */
    }
    const qm_cval *pl = qm_cval_get(r, "placement");
    if (pl && pl->type == QM_CVAL_OBJECT &&
        (qm__client_dup_member(pl, "rule", &out->placement_rule) < 0 ||
         qm__devices(pl, &out->devices, &out->n_devices) < 0))
        goto fail_nomem;
    out->banks = qm_calloc(banks->count ? banks->count : 1, sizeof(*out->banks));
    if (!out->banks || qm__client_dup_member(r, "policy", &out->policy) < 0)
        goto fail_nomem;
    out->n_banks = banks->count;
    for (size_t i = 0; i < banks->count; i++) {
        const qm_cval *o = banks->items[i];
        qm_client_plan_bank *b = &out->banks[i];
        b->bank = qm__u64(o, "bank");
        b->layer = qm__u64(o, "layer");
        b->bytes_per_expert = qm__u64(o, "bytes_per_expert");
        b->resident_now = qm__opt_count(o, "resident_now");
        if (b->resident_now < 0)
            b->resident_now = qm__opt_count(o, "resident_experts");
        b->bank_bytes = qm__opt_count(o, "bank_bytes");
        b->device = qm__opt_count(o, "device");
        const qm_cval *ex = qm_cval_get(o, "experts");
        b->has_experts = ex && ex->type == QM_CVAL_ARRAY;
        const qm_cval *reason = qm_cval_get(o, "reason");
        if (qm__client_dup_member(o, "decision", &b->decision) < 0 ||
            qm__client_dup_member(reason, "kind", &b->reason_kind) < 0 ||
            qm__client_dup_member(reason, "detail", &b->reason_detail) < 0 ||
            qm__indices(o, "experts", &b->experts, &b->n_experts) < 0 ||
            qm__indices(o, "pinned", &b->pinned, &b->n_pinned) < 0)
            goto fail_nomem;
    }
    goto out;
fail_nomem:
    qm_client_plan_free(out);
    rc = QM__NOMEM(err);
out:
    qm_cval_free(r);
    return rc;
}

/* ---------- session.infer ---------- */

void qm_client_infer_result_free(qm_client_infer_result *r)
{
    if (!r)
        return;
    qm_free(r->output.data);
    qm_free(r->routing_offsets); /* with routing_experts and routing_weights */
    memset(r, 0, sizeof(*r));
}

static int qm__tensor_param(qm_cval *p, const char *key, const qm_client_tensor *t,
                            qm_client_error *err)
{
    qm_cval *tv = NULL;
    qm_status st = {0};
    if (t->ndim < 1 || t->ndim > QM_CLIENT_MAX_DIMS || (!t->data && t->nbytes))
        return qm__client_fail(err, QM_CLIENT_EINVAL, "%s: a tensor needs 1 to %d dimensions",
                               key, QM_CLIENT_MAX_DIMS);
    int rc = qm__client_codec_tensor_encode((qm_cdtype)t->dtype, t->shape, t->ndim,
                                           t->data ? t->data : "", t->nbytes, &tv, &st);
    if (rc < 0)
        return qm__client_fail(err, rc == QM_ENOMEM ? QM_CLIENT_ENOMEM : QM_CLIENT_EINVAL,
                               "%s: %s", key, st.msg);
    if (qm_cval_append(p, key, tv) < 0)
        return QM__NOMEM(err);
    return 0;
}

static int qm__routing(const qm_cval *routing, qm_client_infer_result *out)
{
    size_t pairs = 0;
    for (size_t t = 0; t < routing->count; t++)
        pairs += routing->items[t]->type == QM_CVAL_ARRAY ? routing->items[t]->count : 0;
    /* The three arrays have one lifetime: one block, offsets, weights, experts. */
    size_t n_off = routing->count + 1, n = pairs ? pairs : 1;
    unsigned long long head, bytes;
    if (qm_mul_u64(n_off, sizeof(size_t), &head) ||
        qm_mul_u64(n, sizeof(double) + sizeof(uint32_t), &bytes) ||
        qm_add_u64(bytes, head, &bytes) || bytes > SIZE_MAX)
        return QM_CLIENT_ENOMEM;
    out->routing_offsets = qm_calloc(1, (size_t)bytes);
    if (!out->routing_offsets)
        return QM_CLIENT_ENOMEM;
    out->routing_weights = (double *)(out->routing_offsets + n_off);
    out->routing_experts = (uint32_t *)(out->routing_weights + n);
    size_t k = 0;
    for (size_t t = 0; t < routing->count; t++) {
        const qm_cval *tok = routing->items[t];
        out->routing_offsets[t] = k;
        for (size_t j = 0; tok->type == QM_CVAL_ARRAY && j < tok->count; j++, k++) {
            const qm_cval *pair = tok->items[j];
            const qm_cval *e = qm_cval_at(pair, 0), *w = qm_cval_at(pair, 1);
            out->routing_experts[k] = e && e->type == QM_CVAL_NUMBER ? (uint32_t)e->number : 0;
            out->routing_weights[k] = w && w->type == QM_CVAL_NUMBER ? w->number : NAN;
        }
    }
    out->routing_offsets[routing->count] = k;
    out->routing_tokens = routing->count;
    return 0;
}

static int qm__infer_once(qm_client *c, const char *session, uint64_t layer,
                          const qm_client_tensor *hidden, const qm_client_tensor *router_logits,
                          const qm_client_tensor *topk_ids, const qm_client_tensor *topk_weights,
                          int return_routing, qm_client_infer_result *out, qm_client_error *err)
{
    qm_cval *r = NULL;
    memset(out, 0, sizeof(*out));
    if (!session || !hidden)
        return qm__client_fail(err, QM_CLIENT_EINVAL, "session.infer needs a session and hidden");
    if (!topk_ids != !topk_weights)
        return qm__client_fail(err, QM_CLIENT_EINVAL,
                               "session.infer takes topk_ids and topk_weights together");
    qm_cval *p = qm__with_num(qm__with_str(qm__params(), "session", session), "layer",
                              (double)layer);
    if (!p)
        return QM__NOMEM(err);
    int rc = qm__tensor_param(p, "hidden", hidden, err);
    if (rc == 0 && router_logits)
        rc = qm__tensor_param(p, "router_logits", router_logits, err);
    if (rc == 0 && topk_ids)
        rc = qm__tensor_param(p, "topk_ids", topk_ids, err);
    if (rc == 0 && topk_weights)
        rc = qm__tensor_param(p, "topk_weights", topk_weights, err);
    if (rc == 0 && return_routing && qm_cval_append(p, "return_routing", qm_cval_new_bool(1)) < 0)
        rc = QM__NOMEM(err);
    if (rc < 0) {
        qm_cval_free(p);
        return rc;
    }
    rc = qm__client_call(c, "session.infer", p, &r, err);
    if (rc < 0)
        return rc;
    qm_status st = {0};
    qm_cdtype dt;
    int trc = qm__client_codec_tensor_decode(qm_cval_get(r, "output"), &dt, out->output.shape,
                                            &out->output.ndim, &out->output.data,
                                            &out->output.nbytes, &st);
    if (trc < 0) {
        rc = qm__client_fail(err, trc == QM_ENOMEM ? QM_CLIENT_ENOMEM : QM_CLIENT_EPROTO,
                             "qmoed's output tensor is unreadable: %s", st.msg);
        goto fail;
    }
    out->output.dtype = (qm_client_dtype)dt;
    const qm_cval *stats = qm_cval_get(r, "stats");
    out->stats.hits = qm__u64(stats, "hits");
    out->stats.misses = qm__u64(stats, "misses");
    out->stats.bytes_paged = qm__u64(stats, "bytes_paged");
    out->stats.queue_us = qm__u64(stats, "queue_us");
    out->stats.compute_us = qm__u64(stats, "compute_us");
    const qm_cval *routing = qm_cval_get(r, "routing");
    if (routing && routing->type == QM_CVAL_ARRAY && qm__routing(routing, out) < 0) {
        rc = QM__NOMEM(err);
        goto fail;
    }
    qm_cval_free(r);
    return 0;
fail:
    qm_client_infer_result_free(out);
    qm_cval_free(r);
    return rc;
}

/* A layer call, retried once when the daemon went away and the session came
 * back (qm__client_resume). */
static int qm__infer(qm_client *c, const char *session, uint64_t layer,
                     const qm_client_tensor *hidden, const qm_client_tensor *router_logits,
                     const qm_client_tensor *topk_ids, const qm_client_tensor *topk_weights,
                     int return_routing, qm_client_infer_result *out, qm_client_error *err)
{
    uint64_t gen = c ? qm__client_generation(c) : 0;
    qm__client_answered_on = 0;
    int rc = qm__infer_once(c, session, layer, hidden, router_logits, topk_ids, topk_weights,
                            return_routing, out, err);
    if (rc < 0 && c && qm__client_resume(c, session, gen, rc, err) == 0)
        rc = qm__infer_once(c, session, layer, hidden, router_logits, topk_ids, topk_weights,
                            return_routing, out, err);
    if (rc == 0)
        qm__client_note_call(c, session, qm__client_answered_on);
    return rc;
}

int qm_client_session_infer(qm_client *c, const char *session, uint64_t layer,
                            const qm_client_tensor *hidden,
                            const qm_client_tensor *router_logits, int return_routing,
                            qm_client_infer_result *out, qm_client_error *err)
{
    return qm__infer(c, session, layer, hidden, router_logits, NULL, NULL, return_routing, out,
                     err);
}

int qm_client_session_infer_routed(qm_client *c, const char *session, uint64_t layer,
                                   const qm_client_tensor *hidden,
                                   const qm_client_tensor *topk_ids,
                                   const qm_client_tensor *topk_weights, int return_routing,
                                   qm_client_infer_result *out, qm_client_error *err)
{
    return qm__infer(c, session, layer, hidden, NULL, topk_ids, topk_weights, return_routing, out,
                     err);
}

/* ---------- telemetry ---------- */

static const qm__field qm__counter_u64s[] = {
    QM__FIELD(qm_client_counters, requests),
    QM__FIELD(qm_client_counters, errors),
    QM__FIELD(qm_client_counters, tokens),
    QM__FIELD(qm_client_counters, expert_hits),
    QM__FIELD(qm_client_counters, expert_misses),
    QM__FIELD(qm_client_counters, bytes_paged_h2d),
    QM__FIELD(qm_client_counters, evictions),
    QM__FIELD(qm_client_counters, prefetch_issued),
    QM__FIELD(qm_client_counters, prefetch_useful),
    QM__FIELD(qm_client_counters, resident_bytes),
    QM__FIELD(qm_client_counters, expert_host_runs),
    QM__FIELD(qm_client_counters, predict_router_predicted),
    QM__FIELD(qm_client_counters, predict_router_correct),
    QM__FIELD(qm_client_counters, predict_router_actual),
    QM__FIELD(qm_client_counters, predict_router_gated),
    QM__FIELD(qm_client_counters, predict_history_predicted),
    QM__FIELD(qm_client_counters, predict_history_correct),
    QM__FIELD(qm_client_counters, predict_history_actual),
    QM__FIELD(qm_client_counters, predict_history_gated),
    QM__FIELD(qm_client_counters, predict_lookahead_predicted),
    QM__FIELD(qm_client_counters, predict_lookahead_correct),
    QM__FIELD(qm_client_counters, predict_lookahead_actual),
    QM__FIELD(qm_client_counters, predict_lookahead_gated),
    QM__FIELD(qm_client_counters, bytes_read_disk),
    QM__FIELD(qm_client_counters, stall_us),
    QM__FIELD(qm_client_counters, disk_busy_us),
    QM__FIELD(qm_client_counters, read_calls),
    QM__FIELD(qm_client_counters, reads_in_flight_sum),
    QM__FIELD(qm_client_counters, reads_in_flight_peak),
    QM__FIELD(qm_client_counters, prefetch_parked),
};

static void qm__counters_from(const qm_cval *o, qm_client_counters *k)
{
    qm__read_u64s(o, k, qm__counter_u64s, QM__N_FIELDS(qm__counter_u64s));
    k->p50_us = qm__dbl(o, "p50_us");
    k->p99_us = qm__dbl(o, "p99_us");
}

static const qm__field qm__counted_strs[] = {
    QM__FIELD(qm_client_session_counters, session),
    QM__FIELD(qm_client_session_counters, model),
};

void qm_client_telemetry_free(qm_client_telemetry *t)
{
    if (!t)
        return;
    for (size_t i = 0; t->sessions && i < t->n_sessions; i++)
        qm__free_strs(&t->sessions[i], qm__counted_strs, QM__N_FIELDS(qm__counted_strs));
    qm_free(t->sessions);
    memset(t, 0, sizeof(*t));
}

static int qm__session_counters(const qm_cval *o, qm_client_session_counters *s)
{
    qm__counters_from(o, &s->counters);
    if (qm__dup_strs(o, s, qm__counted_strs, QM__N_FIELDS(qm__counted_strs)) < 0)
        return QM_CLIENT_ENOMEM;
    return 0;
}

int qm_client_telemetry_get(qm_client *c, const char *session, qm_client_telemetry *out,
                            qm_client_error *err)
{
    qm_cval *r = NULL, *p = NULL;
    memset(out, 0, sizeof(*out));
    if (session && !(p = qm__with_str(qm__params(), "session", session)))
        return QM__NOMEM(err);
    int rc = qm__client_call(c, "telemetry.get", p, &r, err);
    if (rc < 0)
        return rc;
    if (r->type != QM_CVAL_OBJECT) {
        rc = qm__bad_result(err, "telemetry.get", "an object");
        goto out;
    }
    if (session) {
        out->sessions = qm_calloc(1, sizeof(*out->sessions));
        if (!out->sessions)
            goto fail_nomem;
        out->n_sessions = 1;
        if (qm__session_counters(r, &out->sessions[0]) < 0)
            goto fail_nomem;
        goto out;
    }
    out->has_daemon = 1;
    qm__counters_from(qm_cval_get(r, "daemon"), &out->daemon);
    const qm_cval *list = qm_cval_get(r, "sessions");
    size_t n = list && list->type == QM_CVAL_ARRAY ? list->count : 0;
    out->sessions = qm_calloc(n ? n : 1, sizeof(*out->sessions));
    if (!out->sessions)
        goto fail_nomem;
    out->n_sessions = n;
    for (size_t i = 0; i < n; i++)
        if (qm__session_counters(list->items[i], &out->sessions[i]) < 0)
            goto fail_nomem;
    goto out;
fail_nomem:
    qm_client_telemetry_free(out);
    rc = QM__NOMEM(err);
out:
    qm_cval_free(r);
    return rc;
}

void qm_client_spans_free(qm_client_span *spans, size_t count)
{
    for (size_t i = 0; spans && i < count; i++) {
        qm_free(spans[i].name);
        qm_free(spans[i].session);
        qm_free(spans[i].args_json);
    }
    qm_free(spans);
}

static void qm__spans_free(void *spans, size_t count) { qm_client_spans_free(spans, count); }

static int qm__span_from(const qm_cval *o, void *item)
{
    qm_client_span *s = item;
    s->start_us = qm__dbl(o, "start_us");
    s->dur_us = qm__dbl(o, "dur_us");
    s->args_json = qm_cval_print(qm_cval_get(o, "args"), 0, NULL);
    if (!s->args_json || qm__client_dup_member(o, "name", &s->name) < 0 ||
        qm__client_dup_member(o, "session", &s->session) < 0)
        return QM_CLIENT_ENOMEM;
    return 0;
}

int qm_client_telemetry_trace(qm_client *c, const char *session, uint64_t limit,
                              qm_client_span **spans, size_t *count, qm_client_error *err)
{
    qm_cval *p = qm__params();
    *spans = NULL;
    *count = 0;
    if (p && session)
        p = qm__with_str(p, "session", session);
    if (p && limit)
        p = qm__with_num(p, "limit", (double)limit);
    if (!p)
        return QM__NOMEM(err);
    return qm__call_list(c, "telemetry.trace", p, "spans", "a spans array", sizeof(**spans),
                         qm__span_from, qm__spans_free, (void **)spans, count, err);
}

int qm_client_telemetry_metrics(qm_client *c, char **text, qm_client_error *err)
{
    qm_cval *r = NULL;
    *text = NULL;
    int rc = qm__client_call(c, "telemetry.metrics", NULL, &r, err);
    if (rc < 0)
        return rc;
    if (!qm_cval_get_string(r, "text"))
        rc = qm__bad_result(err, "telemetry.metrics", "a text member");
    else if (qm__client_dup_member(r, "text", text) < 0)
        rc = QM__NOMEM(err);
    qm_cval_free(r);
    return rc;
}

int qm_client_daemon_shutdown(qm_client *c, qm_client_error *err)
{
    return qm__call_plain(c, "daemon.shutdown", NULL, err);
}
