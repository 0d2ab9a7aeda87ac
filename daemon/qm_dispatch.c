/* qm_dispatch.c - from decoded requests to answers: the method table,
 * roles, ordering, and every job's way through its operations.
 *
 * Ordering: a request that names a session with queued work joins that
 * session's FIFO (as a barrier job the worker passes straight through), so
 * answers about one session leave in request order; everything else is
 * answered at once or becomes its method's job. */
#include "qm_dispatch.h"

#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_log.h"
#include "qm_reclaim.h"
#include "qm_sessions.h"

/* ---- the method table ---- */

#define QM__METHOD_ROW_REF(m, ...) [QM_METHOD_##m] = &qm__method_row_##m,
static const qm_method_entry *const method_table[QM_METHOD_COUNT] = {
    QM_METHOD_MAP(QM__METHOD_ROW_REF)};
#undef QM__METHOD_ROW_REF

const qm_method_entry *qm_method_entry_get(qm_method m)
{
    return (unsigned)m < QM_METHOD_COUNT ? method_table[m] : NULL;
}

qm_route qm_dispatch_route(const qm_method_entry *e, const qm_peer *peer, int draining,
                           int names_session, const qm_route_session *s)
{
    qm_route r = {QM_ROUTE_REFUSE, QM_REFUSE_NONE};
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
    if (scoped && !peer->is_admin && s->owner != peer->uid) {
        r.refusal = QM_REFUSE_NOT_OWNER;
        return r;
    }
    int behind = e->queued == QM_QUEUE_BEHIND && scoped && s->queued > 0;
    r.kind = e->queued == QM_QUEUE_ALWAYS || behind ? QM_ROUTE_QUEUE : QM_ROUTE_ANSWER;
    return r;
}

/* ---- methods answered on the loop thread ---- */

static void answer_with_handler(const qm_method_ctx *mx, const qm_peer *peer, qm_reply *r,
                                size_t slot, const qm_request *req, qm_fds *fds)
{
    qm_buf b;
    qm_buf_init(&b);
    qm_jw w;
    qm_jw_init(&w, &b);
    qm_status st;
    qm_status_clear(&st);
    const qm_method_entry *e = qm_method_entry_get(req->method);
    qm_call call = {
        .mx = mx, .peer = peer, .conn = qm_reply_conn(r), .req = req, .w = &w, .fds = fds};
    qm_rpc_result_begin(&w, req->id);
    int rc = e && e->handler
                 ? e->handler(&call, &st)
                 : qm_status_set(&st, QM_EINTERNAL, "method has no synchronous handler");
    if (rc < 0) {
        qm_buf_free(&b);
        qm_reply_status(r, slot, req, &st);
        return;
    }
    qm_rpc_result_end(&w);
    if (!req->id) {
        qm_buf_free(&b);
        qm_reply_fill(r, slot, NULL, 0);
    } else {
        qm_reply_take_buf(r, slot, &b, req->id);
    }
    if (call.drain) {
        qm_log(QM_LOG_NOTICE, "daemon.shutdown requested by uid %u", (unsigned)peer->uid);
        mx->begin_drain(mx->life, "daemon.shutdown");
    }
}

/* A loop-answered method queued behind its session's work: its turn in the
 * session's order, then the handler answers it. */
static void barrier_finish(qm_job *job)
{
    answer_with_handler(job->mx, qm_conn_peer(qm_reply_conn(job->reply)), job->reply, job->slot,
                        &job->req, &job->fds);
}

static const qm_job_ops barrier_ops = {.finish = barrier_finish};

/* ---- routing, queueing, and the way back ---- */

/* The error a refused request gets: what the route said, in a sentence. */
static void answer_refusal(const qm_method_ctx *mx, qm_reply *r, size_t slot,
                           const qm_request *req, const qm_peer *peer, const qm_route_session *s,
                           qm_refusal why)
{
    char reason[200];
    int notification = req->id == NULL;
    const char *group = mx->cfg->admin_group;
    switch (why) {
    case QM_REFUSE_DRAINING:
        qm_reply_error(r, slot, req->id, notification, QM_RPC_SHUTTING_DOWN,
                       "the daemon is draining and takes no new requests", NULL);
        return;
    case QM_REFUSE_NOT_ADMIN:
        snprintf(reason, sizeof reason,
                 "%s needs an admin (uid 0, the daemon's uid%s%s); you are uid %u",
                 qm_method_name(req->method), group ? " or group " : "", group ? group : "",
                 (unsigned)peer->uid);
        qm_reply_error(r, slot, req->id, notification, QM_RPC_PERMISSION_DENIED, reason, NULL);
        return;
    case QM_REFUSE_NO_SESSION:
        qm_reply_error(r, slot, req->id, notification, QM_RPC_NOT_FOUND,
                       "no session with that id", "session");
        return;
    case QM_REFUSE_NOT_OWNER:
        snprintf(reason, sizeof reason,
                 "session belongs to uid %u; only its owner or an admin may use it",
                 (unsigned)s->owner);
        qm_reply_error(r, slot, req->id, notification, QM_RPC_PERMISSION_DENIED, reason,
                       "session");
        return;
    case QM_REFUSE_NONE:
        break;
    }
    qm_reply_error(r, slot, req->id, notification, QM_RPC_INTERNAL_ERROR,
                   "request refused for no reason", NULL);
}

/* A queued request: admitted by its operations, then on its session's
 * FIFO; the job owns the request from here on. */
static void queue_request(const qm_method_ctx *mx, const qm_method_entry *e, qm_conn *c,
                          qm_reply *r, size_t slot, qm_request *req, qm_session *s,
                          qm_fds fds, qm_frame_times times)
{
    qm_job *job = qm_calloc(1, sizeof *job);
    if (!job) {
        qm_fds_close(&fds);
        qm_reply_error(r, slot, req->id, req->id == NULL, QM_RPC_RESOURCE_EXHAUSTED,
                       "out of memory queueing the request", NULL);
        return;
    }
    job->ops = e->job ? e->job : &barrier_ops;
    job->mx = mx;
    job->session = s;
    job->reply = r;
    job->slot = slot;
    job->peer_uid = qm_conn_peer(c)->uid;
    job->conn_id = qm_conn_id(c);
    job->read_us = times.read_us;
    job->decode_us = times.decode_us;
    job->req = *req; /* moved: the frame no longer owns it */
    memset(req, 0, sizeof *req);
    job->fds = fds;
    qm_buf_init(&job->response);
    qm_status st;
    qm_status_clear(&st);
    /* Admission may make the session (session.create). */
    if (job->ops->admit && job->ops->admit(job, &st) < 0) {
        qm_reply_status(r, slot, &job->req, &st);
        qm_job_free(job);
        return;
    }
    s = job->session;
    job->queue = qm_session_queue(s);
    qm_session_ref(s);
    if (qm_pool_submit(mx->pool, job, mx->cfg->queue_depth) < 0) {
        qm_limit_hit(mx->limits, QM_LIMIT_QUEUE_DEPTH,
                     "queue_depth %u reached: answering overloaded", mx->cfg->queue_depth);
        if (job->ops->undo)
            job->ops->undo(job);
        qm_session_unref(s);
        char reason[128];
        snprintf(reason, sizeof reason, "queue_depth %u reached; retry later",
                 mx->cfg->queue_depth);
        qm_reply_error(r, slot, job->req.id, job->req.id == NULL, QM_RPC_OVERLOADED, reason,
                       NULL);
        qm_job_free(job);
    }
}

static void handle_request(const qm_method_ctx *mx, qm_conn *c, qm_reply *r, size_t slot,
                           qm_request *req, qm_frame_times times)
{
    mx->counters->requests++;
    const qm_method_entry *e = qm_method_entry_get(req->method);
    const qm_peer *peer = qm_conn_peer(c);
    const char *sid = req->params.session;
    qm_session *s = e->session != QM_SESSION_UNUSED && sid
                        ? qm_session_find(mx->sessions, sid)
                        : NULL;
    qm_route_session target = {0};
    if (s)
        target = (qm_route_session){qm_session_owner(s), qm_session_queued(s)};
    /* The descriptors a request brought travel with it until its handler
     * takes them; whatever is left is closed here or with its job. */
    qm_fds fds = e->takes_fds ? qm_conn_take_fds(c) : QM_FDS_NONE;
    qm_route route =
        qm_dispatch_route(e, peer, mx->draining(mx->life), sid != NULL, s ? &target : NULL);
    if (route.kind == QM_ROUTE_REFUSE) {
        qm_fds_close(&fds);
        answer_refusal(mx, r, slot, req, peer, &target, route.refusal);
        return;
    }
    if (s)
        qm_reclaim_touch(s, qm_conn_id(c));
    if (route.kind == QM_ROUTE_ANSWER) {
        answer_with_handler(mx, peer, r, slot, req, &fds);
        qm_fds_close(&fds);
        return;
    }
    queue_request(mx, e, c, r, slot, req, s, fds, times);
}

void qm_dispatch_frame(const qm_method_ctx *mx, qm_conn *c, qm_rpc_frame *frame,
                       qm_frame_times times)
{
    /* Ring calls answered and not yet counted are counted first. */
    qm_pool_collect(mx->pool);
    qm_reply *r = qm_reply_new(c, frame->n, frame->is_batch, mx->counters);
    if (!r) {
        qm_log(QM_LOG_ERR, "out of memory for a reply; dropping connection %llu",
               (unsigned long long)qm_conn_id(c));
        qm_conn_drop(c);
        return;
    }
    /* The reply is sent when its last slot fills and this frame lets go of
     * it: every item is looked at first. */
    for (size_t i = 0; i < frame->n; i++) {
        qm_rpc_item *it = &frame->items[i];
        if (!it->ok) {
            mx->counters->requests++;
            qm_reply_error(r, i, it->req.id, it->notification, it->rpc_code, it->status.msg,
                           it->status.field);
            continue;
        }
        handle_request(mx, c, r, i, &it->req, times);
    }
    qm_reply_release(r);
}

void qm_dispatch_job_done(const qm_method_ctx *mx, qm_job *job)
{
    job->ops->finish(job);
    /* Its last job handed back may leave the session orphaned (its
     * connections closed while it ran). */
    if (job->session && mx->reclaim)
        qm_reclaim_check(mx->reclaim, job->session);
    qm_session_unref(job->session);
    qm_job_free(job);
}

void qm_dispatch_job_discard(qm_job *job)
{
    /* Its frame's answer is written by no one: the slot is settled empty,
     * which lets the reply go, and with it its hold on the connection (a
     * closed one: nothing is written). */
    if (job->reply)
        qm_reply_fill(job->reply, job->slot, NULL, 0);
    qm_session_unref(job->session);
    qm_job_free(job);
}
