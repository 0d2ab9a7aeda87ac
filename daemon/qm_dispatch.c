/* qm_dispatch.c - from decoded requests to responses: the method table,
 * roles, ordering, every method of PROTOCOL.md.
 *
 * Ordering: a request that names a session with queued work joins that
 * session's FIFO (as a barrier job the worker passes straight through), so
 * responses about one session leave in request order; everything else is
 * answered at once. Every accepted request is answered exactly once (never a
 * notification), also when the connection has gone: the reply is dropped. */
#include "qm_dispatch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_daemon.h"
#include "qm_log.h"
#include "qm_models.h"
#include "qm_sessions.h"
#include "qm_shm.h"

/* ---- replies ---- */

struct qm_reply {
    qm_conn *conn;
    int is_batch;
    size_t n, pending;
    char **parts; /* NULL: no response (notification) */
    size_t *lens;
};

int qm_reply_abandoned(const qm_reply *r) { return qm_conn_gone(r->conn); }

static qm_reply *reply_new(qm_conn *c, size_t n, int is_batch)
{
    qm_reply *r = qm_calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->parts = qm_calloc(n, sizeof *r->parts);
    if (!r->parts)
        goto fail_parts;
    r->lens = qm_calloc(n, sizeof *r->lens);
    if (!r->lens)
        goto fail_lens;
    r->conn = c;
    r->n = r->pending = n;
    r->is_batch = is_batch;
    qm_conn_reply_begin(c);
    return r;

fail_lens:
    qm_free(r->parts);
fail_parts:
    qm_free(r);
    return NULL;
}

static void reply_send(qm_reply *r)
{
    qm_buf b;
    qm_buf_init(&b);
    size_t present = 0;
    for (size_t i = 0; i < r->n; i++)
        present += r->parts[i] != NULL;
    if (present == 1 && r->n == 1 && !r->is_batch) {
        /* The common case: one answer, written as it is (no copy). */
        char *p = qm_realloc(r->parts[0], r->lens[0] + 1);
        if (p) {
            p[r->lens[0]] = '\n';
            qm_conn_write(r->conn, p, r->lens[0] + 1);
            r->parts[0] = NULL;
            present = 0;
        }
    }
    if (present) {
        if (r->is_batch)
            qm_buf_append(&b, "[", 1);
        size_t k = 0;
        for (size_t i = 0; i < r->n; i++) {
            if (!r->parts[i])
                continue;
            if (k++)
                qm_buf_append(&b, ",", 1);
            qm_buf_append(&b, r->parts[i], r->lens[i]);
        }
        if (r->is_batch)
            qm_buf_append(&b, "]", 1);
        qm_buf_append(&b, "\n", 1);
        if (!b.oom) {
            size_t len;
            char *data = qm_buf_take(&b, &len);
            qm_conn_write(r->conn, data, len);
        } else {
            qm_log(QM_LOG_ERR, "out of memory assembling a response; dropping connection %llu",
                   (unsigned long long)qm_conn_id(r->conn));
            qm_conn_drop(r->conn);
        }
    }
    qm_buf_free(&b);
    for (size_t i = 0; i < r->n; i++)
        qm_free(r->parts[i]);
    qm_free(r->parts);
    qm_free(r->lens);
    qm_conn *c = r->conn;
    qm_free(r);
    qm_conn_reply_done(c);
}

static void reply_fill(qm_reply *r, size_t slot, char *data, size_t len)
{
    r->parts[slot] = data;
    r->lens[slot] = len;
    if (--r->pending == 0)
        reply_send(r);
}

/* Takes the writer's bytes as slot's part. When they ran out of memory, a
 * short error for the same id takes their place: with id null the client
 * could not tell which request failed (RELIABILITY.md B13). */
static void fill_from_buf(qm_daemon *d, qm_reply *r, size_t slot, qm_buf *b, const char *id)
{
    if (b->oom) {
        qm_buf_reset(b);
        qm_jw w;
        qm_jw_init(&w, b);
        qm_rpc_error(&w, id, QM_RPC_INTERNAL_ERROR, "out of memory encoding the response", NULL);
        d->counters.errors++;
    }
    size_t len;
    char *data = qm_buf_take(b, &len);
    reply_fill(r, slot, data, len);
}

static void answer_error(qm_daemon *d, qm_reply *r, size_t slot, const char *id, int notification,
                         int rpc_code, const char *reason, const char *field)
{
    d->counters.errors++;
    if (notification) {
        reply_fill(r, slot, NULL, 0);
        return;
    }
    qm_buf b;
    qm_buf_init(&b);
    qm_jw w;
    qm_jw_init(&w, &b);
    qm_rpc_error(&w, id, rpc_code, reason, field);
    fill_from_buf(d, r, slot, &b, id);
}

static void answer_status(qm_daemon *d, qm_reply *r, size_t slot, const qm_request *req,
                          const qm_status *st)
{
    answer_error(d, r, slot, req->id, req->id == NULL, qm_rpc_code_from_status(st->code), st->msg,
                 st->field);
}

/* ---- methods answered on the loop thread ---- */

static void write_status(qm_daemon *d, qm_jw *w)
{
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "version", QMOE_VERSION);
    qm_jw_member_u64(w, "uptime_s", (qm_now_us() - d->start_us) / 1000000);
    const qm_devices *ds = &d->devices;
    /* "backend" and "device" are device 0's, the bytes summed over the devices. */
    qm_jw_member_str(w, "backend", qm_backend_name(ds->dev[0].backend));
    qm_jw_key(w, "device");
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "name", ds->dev[0].info.name);
    qm_jw_member_u64(w, "total_bytes", qm_devices_total_bytes(ds));
    qm_jw_member_u64(w, "budget_bytes", qm_devices_budget(ds));
    qm_jw_member_u64(w, "used_bytes", qm_devices_admitted(ds));
    qm_jw_obj_end(w);
    qm_jw_key(w, "devices");
    qm_jw_arr_begin(w);
    for (uint32_t i = 0; i < ds->n; i++) {
        const qm_device *dv = &ds->dev[i];
        qm_jw_obj_begin(w);
        qm_jw_member_str(w, "name", dv->name);
        qm_jw_member_str(w, "kind", dv->info.kind);
        qm_jw_member_str(w, "description", dv->info.name);
        qm_jw_member_u64(w, "total_bytes", dv->info.total_bytes);
        qm_jw_member_u64(w, "budget_bytes", dv->budget);
        qm_jw_member_u64(w, "used_bytes", dv->admitted);
        qm_jw_obj_end(w);
    }
    qm_jw_arr_end(w);
    qm_jw_member_u64(w, "models", d->n_models);
    qm_jw_member_u64(w, "sessions", d->n_sessions);
    qm_jw_member_u64(w, "connections", qm_server_connections(d));
    qm_jw_key(w, "draining");
    qm_jw_bool(w, d->draining);
    qm_jw_obj_end(w);
}

static void write_plan_summary(qm_jw *w, const qm_session *s)
{
    size_t total = qm_plan_total(s->plan), resident = qm_plan_resident_count(s->plan),
           degraded = qm_plan_degraded_count(s->plan);
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "policy", s->policy_name);
    qm_jw_member_u64(w, "budget_bytes", s->budget_bytes);
    qm_jw_member_u64(w, "total", total);
    qm_jw_member_u64(w, "resident", resident);
    qm_jw_member_u64(w, "degraded", degraded);
    qm_jw_member_u64(w, "per_expert", total - resident - degraded);
    if (s->last_stats.pins_released)
        qm_jw_member_u64(w, "pins_released", s->last_stats.pins_released);
    qm_jw_obj_end(w);
}

/* The members session.list and session.create share. */
static void write_session_bytes(qm_jw *w, const qm_session *s)
{
    qm_jw_member_u64(w, "budget_bytes", s->budget_bytes);
    qm_jw_member_u64(w, "resident_bytes", s->counters.resident_bytes);
    qm_jw_member_u64(w, "workspace_bytes", s->workspace_bytes);
}

static void write_session_entry(qm_jw *w, const qm_session *s)
{
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "session", s->id);
    qm_jw_member_str(w, "model", s->model->name);
    qm_jw_member_str(w, "policy", s->policy_name);
    qm_jw_member_u64(w, "owner_uid", s->owner_uid);
    write_session_bytes(w, s);
    qm_jw_key(w, "created_at");
    qm_jw_i64(w, s->created_at);
    qm_jw_obj_end(w);
}

static void write_resize_result(qm_jw *w, const qm_session *s)
{
    qm_jw_obj_begin(w);
    qm_jw_member_u64(w, "budget_bytes", s->budget_bytes);
    qm_jw_member_u64(w, "resident_bytes", s->counters.resident_bytes);
    qm_jw_key(w, "plan_summary");
    write_plan_summary(w, s);
    qm_jw_obj_end(w);
}

static void write_create_result(qm_jw *w, const qm_session *s)
{
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "session", s->id);
    qm_jw_key(w, "plan_summary");
    write_plan_summary(w, s);
    write_session_bytes(w, s);
    qm_jw_obj_end(w);
}

/* ---- the methods answered on the loop thread ---- */

static int empty_result(qm_jw *w)
{
    qm_jw_obj_begin(w);
    qm_jw_obj_end(w);
    return 0;
}

static int daemon_status(qm_call *k, qm_status *st)
{
    (void)st;
    write_status(k->d, k->w);
    return 0;
}

static int daemon_shutdown(qm_call *k, qm_status *st)
{
    (void)st;
    k->drain = 1;
    return empty_result(k->w);
}

static int model_load(qm_call *k, qm_status *st)
{
    qm_daemon *d = k->d;
    const qm_params *p = &k->req->params;
    qm_model *m;
    uint64_t t0 = qm_now_us();
    char *resolved = NULL;
    int rc = qm_model_path_allowed(d, p->path, &resolved, st);
    if (rc == 0)
        rc = qm_model_load(d, p->name, resolved ? resolved : p->path, &m, st);
    qm_free(resolved);
    if (rc < 0)
        return rc;
    char args[160];
    snprintf(args, sizeof args, "{\"model\":\"%s\",\"layers\":%u}", m->name, m->n_layers);
    qm_trace_add(&d->trace, "model.load", t0 - d->start_us, qm_now_us() - t0, NULL, args, NULL);
    qm_log(QM_LOG_INFO, "model %s loaded from %s (%u layers, %llu expert bytes)", m->name,
           m->path, m->n_layers, (unsigned long long)m->bytes_total);
    qm_jw_model_summary(k->w, m);
    return 0;
}

static int model_unload(qm_call *k, qm_status *st)
{
    int rc = qm_model_unload(k->d, k->req->params.name, k->req->params.force, st);
    return rc < 0 ? rc : empty_result(k->w);
}

/* A list method's result: {"KEY": [ ... ]}. */
static void list_result_begin(qm_jw *w, const char *key)
{
    qm_jw_obj_begin(w);
    qm_jw_key(w, key);
    qm_jw_arr_begin(w);
}

static void list_result_end(qm_jw *w)
{
    qm_jw_arr_end(w);
    qm_jw_obj_end(w);
}

static int model_list(qm_call *k, qm_status *st)
{
    (void)st;
    qm_jw *w = k->w;
    list_result_begin(w, "models");
    for (qm_model *m = k->d->models; m; m = m->next)
        qm_jw_model_summary(w, m);
    list_result_end(w);
    return 0;
}

static int session_close(qm_call *k, qm_status *st)
{
    qm_session *s = qm_session_find(k->d, k->req->params.session);
    if (!s)
        return qm_status_set_field(st, QM_ENOT_FOUND, "session", "no session with that id");
    qm_log(QM_LOG_INFO, "session %s closed by uid %u", s->id, (unsigned)k->peer->uid);
    qm_session_close(k->d, s);
    return empty_result(k->w);
}

static int session_list(qm_call *k, qm_status *st)
{
    (void)st;
    qm_jw *w = k->w;
    list_result_begin(w, "sessions");
    for (qm_session *s = k->d->sessions; s; s = s->next)
        if (k->peer->is_admin || s->owner_uid == k->peer->uid)
            write_session_entry(w, s);
    list_result_end(w);
    return 0;
}

static int telemetry_get(qm_call *k, qm_status *st)
{
    return qm_telemetry_get(k->d, k->peer, &k->req->params, k->w, st);
}

static int telemetry_trace(qm_call *k, qm_status *st)
{
    return qm_telemetry_trace(k->d, &k->req->params, k->w, st);
}

static int telemetry_metrics(qm_call *k, qm_status *st)
{
    qm_buf text;
    qm_buf_init(&text);
    int rc = qm_telemetry_metrics(k->d, k->peer, &text);
    if (rc == 0) {
        qm_jw_obj_begin(k->w);
        qm_jw_key(k->w, "text");
        qm_jw_str_n(k->w, text.data ? text.data : "", text.len);
        qm_jw_obj_end(k->w);
    } else {
        qm_status_set(st, rc, "out of memory writing metrics");
    }
    qm_buf_free(&text);
    return rc;
}

/* session.map: the descriptor that came with the request's first byte
 * (qm_conn_take_fds), checked and mapped; the map id is daemon-wide unique. */
static int session_map(qm_call *k, qm_status *st)
{
    qm_daemon *d = k->d;
    const qm_params *p = &k->req->params;
    qm_session *s = qm_session_find(d, p->session);
    if (!s)
        return qm_status_set_field(st, QM_ENOT_FOUND, "session", "no session with that id");
    qm_fds none = QM_FDS_NONE, *f = k->fds ? k->fds : &none;
    if (f->count == 0)
        return qm_status_set_field(st, QM_EINVAL, "fd",
                                   "no descriptor came with session.map: send one sealed memfd "
                                   "as SCM_RIGHTS on the sendmsg that carries the request "
                                   "line's first byte");
    if (f->count > 1)
        return qm_status_set_field(st, QM_EINVAL, "fd",
                                   "%u descriptors came with session.map; expected exactly one "
                                   "(all were closed)",
                                   f->count);
    int fd = f->fd;
    *f = QM_FDS_NONE;
    qm_shm_map *m;
    int rc = qm_shm_map_fd(fd, p->bytes, &m, st);
    if (rc < 0)
        return rc;
    m->id = ++d->next_map_id;
    rc = qm_shm_session_add(s, m, d->cfg.max_mapped_bytes, st);
    if (rc < 0) {
        qm_shm_unref(m);
        return rc;
    }
    qm_log(QM_LOG_DEBUG, "session %s mapped %llu bytes as map %llu", s->id,
           (unsigned long long)m->bytes, (unsigned long long)m->id);
    qm_jw_obj_begin(k->w);
    qm_jw_member_u64(k->w, "map", m->id);
    qm_jw_member_u64(k->w, "bytes", m->bytes);
    qm_jw_obj_end(k->w);
    return 0;
}

static int session_unmap(qm_call *k, qm_status *st)
{
    qm_session *s = qm_session_find(k->d, k->req->params.session);
    if (!s)
        return qm_status_set_field(st, QM_ENOT_FOUND, "session", "no session with that id");
    int rc = qm_shm_session_remove(s, k->req->params.map, st);
    return rc < 0 ? rc : empty_result(k->w);
}

/* ---- the method table ---- */

/* X(method, handler, role, session, queued, job kind): one row per method
 * of QM_METHOD_MAP (checked below). session.create and session.infer have
 * no loop-thread handler: their job's worker writes the answer. session.plan
 * always takes the session's queue: its resident_now comes from the pager,
 * which belongs to the worker running the session's jobs, and it is ordered
 * with the session's inferences. session.resize is a job of that FIFO too:
 * inferences queued before it finish under the old budget, later ones run
 * under the new; its growth is admitted on the loop before it is queued. A method answered at once has job kind
 * BARRIER: the job it would become behind its session's queued work. */
#define QM__DAEMON_METHODS(X)                                                                      \
    X(DAEMON_STATUS, daemon_status, USER, UNUSED, NEVER, BARRIER)                                  \
    X(DAEMON_SHUTDOWN, daemon_shutdown, ADMIN, UNUSED, NEVER, BARRIER)                             \
    X(MODEL_LOAD, model_load, ADMIN, UNUSED, NEVER, BARRIER)                                       \
    X(MODEL_UNLOAD, model_unload, ADMIN, UNUSED, NEVER, BARRIER)                                   \
    X(MODEL_LIST, model_list, USER, UNUSED, NEVER, BARRIER)                                        \
    X(SESSION_CREATE, NULL, USER, UNUSED, ALWAYS, CREATE)                                          \
    X(SESSION_CLOSE, session_close, USER, REQUIRED, BEHIND, BARRIER)                               \
    X(SESSION_LIST, session_list, USER, UNUSED, NEVER, BARRIER)                                    \
    X(SESSION_PLAN, NULL, USER, REQUIRED, ALWAYS, PLAN)                                            \
    X(SESSION_RESIZE, NULL, USER, REQUIRED, ALWAYS, RESIZE)                                        \
    X(SESSION_INFER, NULL, USER, REQUIRED, ALWAYS, INFER)                                          \
    X(SESSION_MAP, session_map, USER, REQUIRED, BEHIND, BARRIER)                                   \
    X(SESSION_UNMAP, session_unmap, USER, REQUIRED, BEHIND, BARRIER)                               \
    X(TELEMETRY_GET, telemetry_get, USER, OPTIONAL, BEHIND, BARRIER)                               \
    X(TELEMETRY_TRACE, telemetry_trace, ADMIN, UNUSED, NEVER, BARRIER)                             \
    X(TELEMETRY_METRICS, telemetry_metrics, USER, UNUSED, NEVER, BARRIER)

#define QM__METHOD_ROW(m, fn, role, session, queued, kind)                                         \
    [QM_METHOD_##m] = {QM_METHOD_##m, fn, QM_ROLE_##role, QM_SESSION_##session, QM_QUEUE_##queued, \
                       QM_JOB_##kind},
static const qm_method_entry method_table[] = {QM__DAEMON_METHODS(QM__METHOD_ROW)};
#undef QM__METHOD_ROW

/* Every method exactly once: as many rows as methods, and a method listed
 * twice would be an overridden initialiser (-Woverride-init, an error). */
#define QM__COUNT_ROW(...) +1
_Static_assert(0 QM__DAEMON_METHODS(QM__COUNT_ROW) == QM_METHOD_COUNT,
               "QM__DAEMON_METHODS must list every method of QM_METHOD_MAP");
#undef QM__COUNT_ROW

const qm_method_entry *qm_method_entry_get(qm_method m)
{
    return (unsigned)m < QM_METHOD_COUNT ? &method_table[m] : NULL;
}

qm_route qm_dispatch_route(const qm_method_entry *e, const qm_peer *peer, int draining,
                           int names_session, const qm_session *s)
{
    qm_route r = {QM_ROUTE_REFUSE, QM_REFUSE_NONE, e->job_kind};
    if (draining) {
        r.refusal = QM_REFUSE_DRAINING;
        return r;
    }
    if (e->role == QM_ROLE_ADMIN && !peer->is_admin) {
        r.refusal = QM_REFUSE_NOT_ADMIN;
        return r;
    }
    int scoped = e->session == QM_SESSION_REQUIRED ||
                 (e->session == QM_SESSION_OPTIONAL && names_session);
    if (scoped && !s) {
        r.refusal = QM_REFUSE_NO_SESSION;
        return r;
    }
    if (scoped && !peer->is_admin && s->owner_uid != peer->uid) {
        r.refusal = QM_REFUSE_NOT_OWNER;
        return r;
    }
    int behind = e->queued == QM_QUEUE_BEHIND && scoped && s->queue.pending > 0;
    r.kind = e->queued == QM_QUEUE_ALWAYS || behind ? QM_ROUTE_QUEUE : QM_ROUTE_ANSWER;
    return r;
}

static void answer_sync(qm_daemon *d, qm_conn *c, qm_reply *r, size_t slot, qm_request *req,
                        qm_fds *fds)
{
    qm_buf b;
    qm_buf_init(&b);
    qm_jw w;
    qm_jw_init(&w, &b);
    qm_status st;
    qm_status_clear(&st);
    const qm_method_entry *e = qm_method_entry_get(req->method);
    qm_call call = {.d = d, .peer = qm_conn_peer(c), .req = req, .w = &w, .fds = fds};
    qm_rpc_result_begin(&w, req->id);
    int rc = e && e->handler
                 ? e->handler(&call, &st)
                 : qm_status_set(&st, QM_EINTERNAL, "method has no synchronous handler");
    if (rc < 0) {
        qm_buf_free(&b);
        answer_status(d, r, slot, req, &st);
        return;
    }
    qm_rpc_result_end(&w);
    if (!req->id) {
        qm_buf_free(&b);
        reply_fill(r, slot, NULL, 0);
    } else {
        fill_from_buf(d, r, slot, &b, req->id);
    }
    if (call.drain) {
        qm_log(QM_LOG_NOTICE, "daemon.shutdown requested by uid %u", (unsigned)call.peer->uid);
        qm_daemon_begin_drain(d, "daemon.shutdown");
    }
}

/* session.infer checks that need the model, before queueing. */
static int check_infer(const qm_session *s, const qm_params *p, qm_status *st)
{
    const qm_bank_config *cfg = qm_bank_get_config(s->model->bank);
    if (p->layer >= cfg->layers)
        return qm_status_set_field(st, QM_EINVAL, "layer",
                                   "layer %u is out of range; the model has %u layers", p->layer,
                                   cfg->layers);
    if (p->hidden.shape[1] != cfg->hidden)
        return qm_status_set_field(st, QM_EINVAL, "hidden.shape",
                                   "hidden.shape is [%llu, %llu]; expected [T, %u]",
                                   (unsigned long long)p->hidden.shape[0],
                                   (unsigned long long)p->hidden.shape[1], cfg->hidden);
    if (p->hidden.shape[0] > UINT32_MAX)
        return qm_status_set_field(st, QM_EINVAL, "hidden.shape", "too many tokens");
    if (p->has_topk) {
        /* Routing supplied by the engine: checked here so a bad id is the
         * request's -32602, not a worker's failure. */
        if (p->topk_ids.shape[1] > cfg->experts)
            return qm_status_set_field(st, QM_EINVAL, "topk_ids",
                                       "topk_ids has %llu columns but the model has %u experts",
                                       (unsigned long long)p->topk_ids.shape[1], cfg->experts);
        return qm_moe_topk_check(p->topk_ids.data, (uint32_t)p->hidden.shape[0], cfg->experts,
                                 (uint32_t)p->topk_ids.shape[1], st);
    }
    if (p->has_router_logits) {
        if (p->router_logits.shape[1] != cfg->experts)
            return qm_status_set_field(st, QM_EINVAL, "router_logits.shape",
                                       "router_logits.shape is [%llu, %llu]; expected [%llu, %u]",
                                       (unsigned long long)p->router_logits.shape[0],
                                       (unsigned long long)p->router_logits.shape[1],
                                       (unsigned long long)p->hidden.shape[0], cfg->experts);
    } else {
        const qm_layer_view *lv = qm_bank_layer(s->model->bank, p->layer);
        if (!lv || !lv->t[QM_T_ROUTER_WEIGHT].present)
            return qm_status_set_field(st, QM_EINVAL, "router_logits",
                                       "router_logits is required: layer %u of the bank holds "
                                       "no router weight",
                                       p->layer);
    }
    return 0;
}

/* The error a refused request gets: what the route said, in a sentence. */
static void answer_refusal(qm_daemon *d, qm_reply *r, size_t slot, const qm_request *req,
                           const qm_peer *peer, const qm_session *s, qm_refusal why)
{
    char reason[200];
    int notification = req->id == NULL;
    switch (why) {
    case QM_REFUSE_DRAINING:
        answer_error(d, r, slot, req->id, notification, QM_RPC_SHUTTING_DOWN,
                     "the daemon is draining and takes no new requests", NULL);
        return;
    case QM_REFUSE_NOT_ADMIN:
        snprintf(reason, sizeof reason,
                 "%s needs an admin (uid 0, the daemon's uid%s%s); you are uid %u",
                 qm_method_name(req->method), d->cfg.admin_group ? " or group " : "",
                 d->cfg.admin_group ? d->cfg.admin_group : "", (unsigned)peer->uid);
        answer_error(d, r, slot, req->id, notification, QM_RPC_PERMISSION_DENIED, reason, NULL);
        return;
    case QM_REFUSE_NO_SESSION:
        answer_error(d, r, slot, req->id, notification, QM_RPC_NOT_FOUND,
                     "no session with that id", "session");
        return;
    case QM_REFUSE_NOT_OWNER:
        snprintf(reason, sizeof reason,
                 "session belongs to uid %u; only its owner or an admin may use it",
                 (unsigned)s->owner_uid);
        answer_error(d, r, slot, req->id, notification, QM_RPC_PERMISSION_DENIED, reason,
                     "session");
        return;
    case QM_REFUSE_NONE:
        break;
    }
    answer_error(d, r, slot, req->id, notification, QM_RPC_INTERNAL_ERROR,
                 "request refused for no reason", NULL);
}

static void handle_request(qm_daemon *d, qm_conn *c, qm_reply *r, size_t slot, qm_request *req,
                           uint64_t decode_us)
{
    qm_status st;
    qm_status_clear(&st);
    d->counters.requests++;
    const qm_method_entry *e = qm_method_entry_get(req->method);
    const qm_peer *peer = qm_conn_peer(c);
    const char *sid = req->params.session;
    qm_session *s = e->session != QM_SESSION_UNUSED && sid ? qm_session_find(d, sid) : NULL;
    /* The descriptor a session.map brought travels with it until its
     * handler takes it; whatever is left is closed here or with its job. */
    qm_fds fds = req->method == QM_METHOD_SESSION_MAP ? qm_conn_take_fds(c) : QM_FDS_NONE;
    qm_route route = qm_dispatch_route(e, peer, d->draining, sid != NULL, s);
    if (route.kind == QM_ROUTE_REFUSE) {
        qm_fds_close(&fds);
        answer_refusal(d, r, slot, req, peer, s, route.refusal);
        return;
    }
    if (route.kind == QM_ROUTE_ANSWER) {
        answer_sync(d, c, r, slot, req, &fds);
        qm_fds_close(&fds);
        return;
    }
    /* Mapped tensors point into the session's maps, which the job holds
     * until it is done (PROTOCOL.md "Shared-memory tensors"). */
    qm_map_refs maps = {0};
    if (route.job_kind == QM_JOB_INFER &&
        (qm_shm_resolve(s, &req->params, req->params.hidden.nbytes, &maps, &st) < 0 ||
         check_infer(s, &req->params, &st) < 0)) {
        qm_map_refs_release(&maps);
        answer_status(d, r, slot, req, &st);
        return;
    }
    /* The pager may copy whole banks and pins: built on a worker. */
    if (route.job_kind == QM_JOB_CREATE &&
        qm_session_prepare(d, &req->params, peer->uid, &s, &st) < 0) {
        answer_status(d, r, slot, req, &st);
        return;
    }
    if (route.job_kind == QM_JOB_RESIZE &&
        qm_session_resize_reserve(d, s, req->params.budget_bytes, &st) < 0) {
        answer_status(d, r, slot, req, &st);
        return;
    }
    qm_job *job = qm_calloc(1, sizeof *job);
    if (!job) {
        qm_fds_close(&fds);
        qm_map_refs_release(&maps);
        if (route.job_kind == QM_JOB_CREATE)
            qm_session_abort(d, s);
        if (route.job_kind == QM_JOB_RESIZE)
            qm_session_resize_finish(d, s, 0, 0);
        answer_error(d, r, slot, req->id, req->id == NULL, QM_RPC_RESOURCE_EXHAUSTED,
                     "out of memory queueing the request", NULL);
        return;
    }
    job->kind = route.job_kind;
    job->d = d;
    job->session = s;
    job->reply = r;
    job->slot = slot;
    job->decode_us = decode_us;
    job->req = *req; /* moved: the frame no longer owns it */
    memset(req, 0, sizeof *req);
    job->fds = fds;
    job->maps = maps;
    qm_buf_init(&job->response);
    s->refs++;
    int rc = qm_pool_submit(d, job);
    if (rc < 0) {
        *req = job->req; /* give it back so the frame frees it */
        memset(&job->req, 0, sizeof job->req);
        if (route.job_kind == QM_JOB_RESIZE)
            qm_session_resize_finish(d, s, 0, 0);
        qm_session_unref(d, s);
        if (route.job_kind == QM_JOB_CREATE)
            qm_session_abort(d, s);
        qm_job_free(job);
        char reason[128];
        snprintf(reason, sizeof reason, "queue_depth %u reached; retry later",
                 d->cfg.queue_depth);
        answer_error(d, r, slot, req->id, req->id == NULL, QM_RPC_OVERLOADED, reason, NULL);
    }
}

void qm_dispatch_frame(qm_conn *c, qm_rpc_frame *frame, uint64_t decode_us)
{
    qm_daemon *d = qm_conn_daemon(c);
    qm_reply *r = reply_new(c, frame->n, frame->is_batch);
    if (!r) {
        qm_log(QM_LOG_ERR, "out of memory for a reply; dropping connection %llu",
               (unsigned long long)qm_conn_id(c));
        qm_conn_drop(c);
        return;
    }
    /* The reply is sent when its last slot fills, which may be inside this
     * loop: hold it open until every item has been looked at. */
    r->pending++;
    for (size_t i = 0; i < frame->n; i++) {
        qm_rpc_item *it = &frame->items[i];
        if (!it->ok) {
            d->counters.requests++;
            answer_error(d, r, i, it->req.id, it->notification, it->rpc_code, it->status.msg,
                         it->status.field);
            continue;
        }
        handle_request(d, c, r, i, &it->req, decode_us);
    }
    if (--r->pending == 0)
        reply_send(r);
}

/* Disk reads and stalls between two readings of a session's pager stats. */
static void qm_counters_add_paging(qm_counters *sc, qm_counters *dc, const qm_pager_stats *was,
                                   const qm_pager_stats *now)
{
    uint64_t disk = now->disk_bytes_read - was->disk_bytes_read,
             stall = now->stall_us - was->stall_us;
    sc->bytes_read_disk += disk;
    dc->bytes_read_disk += disk;
    sc->stall_us += stall;
    dc->stall_us += stall;
}

static void account_infer(qm_daemon *d, qm_session *s, qm_job *job)
{
    qm_counters *sc = &s->counters, *dc = &d->counters;
    uint64_t latency = qm_now_us() - job->enqueue_us;
    sc->requests++;
    if (job->rc < 0) {
        sc->errors++;
        return;
    }
    const qm_pager_stats *now = &job->pstats, *was = &s->last_stats;
    uint64_t hits = (now->hits - was->hits) + (now->whole_bank_accesses - was->whole_bank_accesses);
    uint64_t misses = now->misses - was->misses, paged = now->bytes_paged_h2d - was->bytes_paged_h2d,
             ev = now->evictions - was->evictions,
             pi = now->prefetch_issued - was->prefetch_issued,
             pu = now->prefetch_useful - was->prefetch_useful;
    sc->tokens += job->tokens;
    dc->tokens += job->tokens;
    sc->expert_hits += hits;
    dc->expert_hits += hits;
    sc->expert_misses += misses;
    dc->expert_misses += misses;
    sc->expert_host_runs += now->host_runs - was->host_runs;
    dc->expert_host_runs += now->host_runs - was->host_runs;
    sc->bytes_paged_h2d += paged;
    dc->bytes_paged_h2d += paged;
    sc->evictions += ev;
    dc->evictions += ev;
    sc->prefetch_issued += pi;
    dc->prefetch_issued += pi;
    sc->prefetch_useful += pu;
    dc->prefetch_useful += pu;
    qm_counters_add_paging(sc, dc, was, now);
    sc->resident_bytes = now->resident_bytes;
    s->last_stats = *now;
    if (s->model->hotness && job->route_experts)
        qm_hotness_record(s->model->hotness, job->req.params.layer, job->route_experts,
                          job->n_routes);
    qm_hist_add(&sc->latency, latency);
    qm_hist_add(&dc->latency, latency);
    /* The span's args, {"layer":..,"compute_us":..}, by hand: every inference
     * writes one (six names + six 20-digit numbers fit the 192 bytes). */
    static const char *const keys[] = {"{\"layer\":",   ",\"tokens\":",   ",\"hits\":",
                                       ",\"misses\":", ",\"queue_us\":", ",\"compute_us\":"};
    const uint64_t vals[] = {job->req.params.layer, job->tokens, hits, misses,
                             job->start_us - job->enqueue_us, job->mstats.compute_us};
    char args[192];
    size_t n = 0;
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        size_t kl = strlen(keys[i]);
        memcpy(args + n, keys[i], kl);
        n += kl;
        n += qm_fmt_u64(args + n, vals[i], 0);
    }
    memcpy(args + n, "}", 2);
    qm_trace_add(&d->trace, "session.infer", job->enqueue_us - d->start_us, latency, s->id, args,
                 NULL);
}

/* A job the loop answers from the session's state (create, resize). */
static void answer_session_result(qm_daemon *d, qm_job *job,
                                  void (*write)(qm_jw *w, const qm_session *s))
{
    if (!job->req.id) {
        reply_fill(job->reply, job->slot, NULL, 0);
        return;
    }
    qm_buf b;
    qm_buf_init(&b);
    qm_jw w;
    qm_jw_init(&w, &b);
    qm_rpc_result_begin(&w, job->req.id);
    write(&w, job->session);
    qm_rpc_result_end(&w);
    fill_from_buf(d, job->reply, job->slot, &b, job->req.id);
}

void qm_dispatch_job_done(qm_daemon *d, qm_job *job)
{
    qm_session *s = job->session;
    s->queue.pending--;
    if (job->kind == QM_JOB_BARRIER) {
        /* Its turn in the session's order: answer it now, as if synchronous. */
        answer_sync(d, job->reply->conn, job->reply, job->slot, &job->req, &job->fds);
    } else if (job->kind == QM_JOB_CREATE) {
        if (job->rc == 0 && !s->model->registered)
            job->rc = qm_status_set_field(&job->st, QM_ENOT_FOUND, "model",
                                          "model '%s' was unloaded while the session was built",
                                          s->model->name);
        if (job->rc < 0) {
            qm_session_abort(d, s);
            answer_status(d, job->reply, job->slot, &job->req, &job->st);
        } else {
            qm_session_commit(d, s);
            answer_session_result(d, job, write_create_result);
        }
    } else if (job->kind == QM_JOB_RESIZE) {
        qm_session_resize_finish(d, s, job->rc == 0, job->req.params.budget_bytes);
        if (!atomic_load(&s->closed)) {
            /* What the resize evicted and re-copied counts like paging. */
            const qm_pager_stats *now = &job->pstats, *was = &s->last_stats;
            s->counters.evictions += now->evictions - was->evictions;
            d->counters.evictions += now->evictions - was->evictions;
            s->counters.bytes_paged_h2d += now->bytes_paged_h2d - was->bytes_paged_h2d;
            d->counters.bytes_paged_h2d += now->bytes_paged_h2d - was->bytes_paged_h2d;
            qm_counters_add_paging(&s->counters, &d->counters, was, now);
            s->counters.resident_bytes = now->resident_bytes;
            s->last_stats = *now;
        }
        if (job->rc == 0)
            qm_log(QM_LOG_INFO, "session %s resized: budget %llu, resident %llu, pins released %llu",
                   s->id, (unsigned long long)s->budget_bytes,
                   (unsigned long long)s->counters.resident_bytes,
                   (unsigned long long)s->last_stats.pins_released);
        if (job->rc < 0)
            answer_status(d, job->reply, job->slot, &job->req, &job->st);
        else
            answer_session_result(d, job, write_resize_result);
    } else {
        /* A skipped inference was neither served nor failed: not counted. */
        if (job->kind == QM_JOB_INFER && !job->cancelled)
            account_infer(d, s, job);
        if (job->rc < 0) {
            answer_status(d, job->reply, job->slot, &job->req, &job->st);
        } else if (!job->req.id) {
            reply_fill(job->reply, job->slot, NULL, 0);
        } else {
            size_t len;
            char *data = qm_buf_take(&job->response, &len);
            reply_fill(job->reply, job->slot, data, len);
        }
    }
    qm_session_unref(d, s);
    qm_job_free(job);
}
