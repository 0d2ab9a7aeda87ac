/* qm_method_session.c - the session.* methods but session.infer
 * (qm_infer.c): create, plan and resize as jobs in the session's order;
 * close, list, map and unmap answered on the loop thread (PROTOCOL.md). */
#include "qm_methods.h"

#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_log.h"
#include "qm_placement.h"
#include "qm_plan_json.h"
#include "qm_pressure.h"
#include "qm_models.h"
#include "qm_sessions.h"
#include "qm_shm.h"

/* ---- what the session jobs share ---- */

int qm__job_session_closed(qm_job *job)
{
    if (!qm_session_closed(job->session))
        return 0;
    job->rc = qm_status_set_field(&job->st, QM_ENOT_FOUND, "session",
                                  "the session was closed before this request ran");
    return 1;
}

void qm__job_answer(qm_job *job)
{
    if (job->rc < 0) {
        qm_reply_status(job->reply, job->slot, &job->req, &job->st);
    } else if (!job->req.id) {
        qm_reply_fill(job->reply, job->slot, NULL, 0);
    } else {
        size_t len;
        char *data = qm_buf_take(&job->response, &len);
        qm_reply_fill(job->reply, job->slot, data, len);
    }
}

/* ---- results ---- */

static void write_plan_summary(qm_jw *w, const qm_session *s)
{
    const qm_residency_plan *plan = qm_session_plan(s);
    size_t total = qm_plan_total(plan), resident = qm_plan_resident_count(plan),
           degraded = qm_plan_degraded_count(plan);
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "policy", qm_session_policy(s));
    qm_jw_member_u64(w, "budget_bytes", qm_session_budget(s));
    qm_jw_member_u64(w, "total", total);
    qm_jw_member_u64(w, "resident", resident);
    qm_jw_member_u64(w, "degraded", degraded);
    qm_jw_member_u64(w, "per_expert", total - resident - degraded);
    uint64_t released = qm_session_last_stats(s)->pins_released;
    if (released)
        qm_jw_member_u64(w, "pins_released", released);
    qm_jw_obj_end(w);
}

/* The members session.list and session.create share. */
static void write_session_bytes(qm_jw *w, const qm_session *s)
{
    qm_jw_member_u64(w, "budget_bytes", qm_session_budget(s));
    qm_jw_member_u64(w, "resident_bytes", qm_session_resident_bytes(s));
    qm_jw_member_u64(w, "workspace_bytes", qm_session_workspace(s));
}

/* Budget "auto": what it came to and why (qm_budget.h), a last member. */
static void write_budget_auto(qm_jw *w, qm_session *s)
{
    const qm_budget_auto *a = qm_session_auto_budget(s);
    if (!a->on)
        return;
    qm_jw_key(w, "budget_auto");
    qm_budget_auto_json(w, a);
}

/* session.create's answer: the session, and the experts `warm` loaded when
 * it was given. */
typedef struct create_answer {
    const qm_session *s;
    int warm;
    uint32_t warmed;
} create_answer;

static void write_create_result(qm_jw *w, const void *arg)
{
    const create_answer *a = arg;
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "session", qm_session_id(a->s));
    qm_jw_key(w, "plan_summary");
    write_plan_summary(w, a->s);
    write_session_bytes(w, a->s);
    if (a->warm)
        qm_jw_member_u64(w, "warmed", a->warmed);
    write_budget_auto(w, (qm_session *)a->s);
    qm_jw_obj_end(w);
}

static void write_resize_result(qm_jw *w, const void *arg)
{
    qm_session *s = (qm_session *)arg;
    qm_jw_obj_begin(w);
    qm_jw_member_u64(w, "budget_bytes", qm_session_budget(s));
    qm_jw_member_u64(w, "resident_bytes", qm_session_resident_bytes(s));
    qm_jw_key(w, "plan_summary");
    write_plan_summary(w, s);
    write_budget_auto(w, s);
    qm_jw_obj_end(w);
}

/* ---- session.create: prepared on the loop, built on a worker ---- */

/* session.create's params as the sessions read them (qm_session_spec):
 * defaults filled. The wire's enums land their index, which is the
 * engine's value (precision, on_miss: tests/daemon checks the lists). */
static void create_spec(const qm_params *p, qm_session_spec *out)
{
    const qm_policy_params_wire *pw = &p->policy_params;
    *out = (qm_session_spec){
        .model = p->model,
        .policy = p->policy ? p->policy : qm_policy_default_name(),
        .has_budget = p->has_budget,
        .budget_bytes = p->budget_bytes,
        .precision = (qm_precision)p->precision,
        .prefetch = pw->has_prefetch ? pw->prefetch : 1,
        .on_miss = pw->has_on_miss ? pw->on_miss : QM_ON_MISS_PAGE,
        .share = pw->has_share_residency && pw->share_residency,
        .has_min_split_bytes = pw->has_min_split_bytes,
        .min_split_bytes = pw->has_min_split_bytes ? pw->min_split_bytes : 0,
        .n_values = pw->n_values < QM_POLICY_VALUES_MAX ? pw->n_values : QM_POLICY_VALUES_MAX,
        .hot = pw->hot,
        .n_hot = pw->n_hot,
        .record_trace = pw->record_trace,
        .id = p->session,
        .warm = p->warm,
        .n_warm = p->n_warm,
        .warm_from_profile = pw->has_warm_from_profile ? pw->warm_from_profile : -1};
    for (size_t i = 0; i < out->n_values; i++)
        out->values[i] = (qm_policy_value){pw->values[i].name, pw->values[i].value};
}

static int create_admit(qm_job *job, qm_status *st)
{
    qm_session *s;
    qm_session_spec spec;
    create_spec(&job->req.params, &spec);
    /* "N%" and "auto" to bytes (qm_budget.h); an unknown model is
     * prepare's to refuse. */
    const qm_params *p = &job->req.params;
    const qm_model *m = qm_model_find(job->mx->models, p->model);
    qm_budget_auto autob;
    memset(&autob, 0, sizeof autob);
    int rc = 0;
    if (m && p->budget.form != QM_BUDGET_BYTES && p->budget.form != QM_BUDGET_NONE)
        rc = qm_sessions_budget(job->mx->sessions, m, NULL, &p->budget, p->client_pending_bytes,
                                &spec.budget_bytes, &autob, st);
    if (rc < 0)
        return rc;
    spec.auto_budget = autob.on ? &autob : NULL;
    rc = qm_session_prepare(job->mx->sessions, job->mx->models, &spec, job->peer_uid, &s, st);
    if (rc < 0)
        return rc;
    job->session = s;
    /* Its build allocates the budget: pressure events wait (again at its commit). */
    if (autob.on)
        qm_pressure_watch(job->mx->pressure);
    return 0;
}

/* The pagers may copy whole banks and pins: built on a worker; then the
 * experts of `warm` (a re-created session's old residency) are loaded.
 * Warming is best effort: a read that fails leaves a colder session, not
 * a failed one. job->tokens counts the experts warmed. */
static void create_run(qm_job *job)
{
    const qm_params *p = &job->req.params;
    job->rc = qm_session_build(job->mx->sessions, job->session, &job->st);
    if (job->rc < 0)
        return;
    qm_status wst = {0};
    if (p->n_warm == 0) { /* a new session: the model's hottest experts, if chosen */
        if (qm_session_warm_from_profile(job->session, &wst) < 0)
            qm_log(QM_LOG_WARNING, "session %s: warming it from the hotness profile stopped: %s",
                   qm_session_id(job->session), wst.msg);
        return;
    }
    int got = qm_session_warm(job->session, p->warm, p->n_warm, &wst);
    if (got < 0)
        qm_log(QM_LOG_WARNING, "session %s: warming it stopped: %s",
               qm_session_id(job->session), wst.msg);
    job->tokens = got > 0 ? (uint32_t)got : 0;
}

static void create_finish(qm_job *job)
{
    qm_session *s = job->session;
    const qm_model *m = qm_session_model(s);
    if (job->rc == 0 && !m->registered)
        job->rc = qm_status_set_field(&job->st, QM_ENOT_FOUND, "model",
                                      "model '%s' was unloaded while the session was built",
                                      m->name);
    /* Two re-creations of one id raced past prepare's check: the first wins. */
    if (job->rc == 0 && job->req.params.session)
        job->rc = qm_session_id_free(job->mx->sessions, qm_session_id(s), &job->st);
    if (job->rc < 0) {
        qm_session_abort(job->mx->sessions, s);
        qm_reply_status(job->reply, job->slot, &job->req, &job->st);
        return;
    }
    qm_session_commit(job->mx->sessions, s);
    if (qm_session_auto_budget(s)->on)
        qm_pressure_watch(job->mx->pressure);
    /* Its creator has touched it, unless its connection closed while the
     * session was built: then it is orphaned from the start (marked when
     * the job is handed back). */
    qm_conn *creator = qm_reply_conn(job->reply);
    if (!qm_conn_gone(creator))
        qm_touches_add(qm_session_touches(s), qm_conn_id(creator));
    create_answer a = {s, job->req.params.warm != NULL, job->tokens};
    qm_reply_result(job->reply, job->slot, &job->req, write_create_result, &a);
}

static void create_undo(qm_job *job) { qm_session_abort(job->mx->sessions, job->session); }

static const qm_job_ops create_ops = {
    .admit = create_admit, .run = create_run, .finish = create_finish, .undo = create_undo};

/* ---- session.plan: the residency read by the worker that owns the pagers ---- */

/* Layer `layer`'s residency now into b: the experts resident there and,
 * after them in the same buffer (*list, the caller's), the pins a resize
 * released. Nothing for a whole bank (resident for the session's life,
 * which the plan's decision already says: docs/PROTOCOL.md). */
static int bank_residency(qm_pager *pager, uint32_t layer, qm_plan_json_bank_state *b,
                          uint32_t **list, qm_status *st)
{
    int count = pager && qm_pager_layer_is_paged(pager, layer) == 1
                    ? qm_pager_resident_experts(pager, layer, NULL, 0)
                    : -1;
    if (count < 0)
        return 0;
    *list = qm_malloc(((size_t)count + 1) * sizeof **list);
    if (!*list)
        return qm_status_set(st, QM_ENOMEM, "out of memory reading the residency");
    size_t cap = (size_t)count;
    count = qm_pager_resident_experts(pager, layer, *list, cap);
    b->has_resident_now = 1;
    b->resident_now = *list;
    b->n_resident_now = count < 0 ? 0 : (size_t)count < cap ? (size_t)count : cap;
    int nrel = qm_pager_pins_released(pager, layer, NULL, 0);
    if (nrel <= 0)
        return 0;
    uint32_t *grown = qm_realloc(*list, (b->n_resident_now + (size_t)nrel) * sizeof **list);
    if (!grown)
        return qm_status_set(st, QM_ENOMEM, "out of memory reading the residency");
    *list = grown;
    b->resident_now = grown;
    b->pins_released = grown + b->n_resident_now;
    nrel = qm_pager_pins_released(pager, layer, grown + b->n_resident_now, (size_t)nrel);
    b->n_pins_released = nrel < 0 ? 0 : (size_t)nrel;
    return 0;
}

/* The plan's run-time state (session held still): each bank's residency
 * and device (the placement is shown when the session spans several
 * devices), and the residency counters. banks[], lists[] and names[]
 * back it. */
static int plan_state(qm_session *s, qm_plan_json_state *state,
                      qm_plan_json_bank_state *banks, uint32_t **lists, const char **names,
                      qm_status *st)
{
    const qm_residency_plan *plan = qm_session_plan(s);
    const qm_placement *pl = qm_session_placement(s);
    const int built = qm_session_built(s), placed = pl->n_devices > 1;
    for (size_t i = 0; i < qm_plan_total(plan) && built; i++) {
        uint32_t layer = qm_plan_bank_at(plan, i)->bank_id; /* bank id = layer */
        qm_plan_json_bank_state *b = &banks[state->n_banks];
        *b = (qm_plan_json_bank_state){.bank_id = layer};
        if (placed && layer < pl->n_layers) {
            b->has_device = 1; /* every bank names its device, whole or paged */
            b->device = pl->device_of[layer];
        }
        int rc = bank_residency(qm_session_pager_of(s, layer), layer, b, &lists[i], st);
        if (rc < 0)
            return rc;
        if (b->has_device || b->has_resident_now)
            state->n_banks++;
    }
    if (placed) {
        for (uint32_t i = 0; i < pl->n_devices && i < QM_CONFIG_MAX_DEVICES; i++)
            names[i] = qm_session_device_name(s, i);
        state->placement_rule = QM_PLACEMENT_RULE;
        state->device_names = names;
        state->device_budgets = pl->budget;
        state->n_devices = pl->n_devices;
    }
    if (built) {
        qm_pager_stats ps;
        qm_session_stats(s, &ps);
        state->has_resident_bytes = 1;
        state->resident_bytes = ps.resident_bytes;
        state->on_miss = qm_on_miss_name(qm_session_on_miss(s));
        /* The telemetry table's definitions, as every count of them. */
        state->expert_hits = qm_counter_paging(qm_counter_index("expert_hits"), &ps);
        state->expert_misses = qm_counter_paging(qm_counter_index("expert_misses"), &ps);
        state->expert_host_runs = qm_counter_paging(qm_counter_index("expert_host_runs"), &ps);
    }
    return 0;
}

/* The session's plan with its residency now (*json is the caller's). A
 * sharing session reads its pool's residency (its own plan and counters). */
static int plan_json(qm_session *s, char **json, size_t *len, qm_status *st)
{
    size_t n = qm_plan_total(qm_session_plan(s));
    qm_plan_json_bank_state *banks = qm_calloc(n ? n : 1, sizeof *banks);
    uint32_t **lists = qm_calloc(n ? n : 1, sizeof *lists);
    const char *names[QM_CONFIG_MAX_DEVICES];
    qm_plan_json_state state = {.banks = banks};
    int rc = banks && lists ? 0 : qm_status_set(st, QM_ENOMEM, "out of memory reading the residency");
    /* Budget "auto": what it came to and why (qm_budget.h). */
    qm_buf auto_text;
    qm_buf_init(&auto_text);
    qm_jw aw;
    qm_jw_init(&aw, &auto_text);
    if (qm_session_auto_budget_json(s, &aw) && qm_buf_append(&auto_text, "", 1) == 0 &&
        !auto_text.oom)
        state.budget_auto_json = auto_text.data; /* NUL-terminated */
    qm_session_hold(s);
    if (rc == 0)
        rc = plan_state(s, &state, banks, lists, names, st);
    if (rc == 0)
        rc = qm_plan_to_json_ex(qm_session_plan(s), &state, json, len, st);
    qm_session_release(s);
    qm_buf_free(&auto_text);
    for (size_t i = 0; lists && i < n; i++)
        qm_free(lists[i]);
    qm_free(lists);
    qm_free(banks);
    return rc;
}

static void plan_run(qm_job *job)
{
    if (qm__job_session_closed(job))
        return;
    if (!job->req.id)
        return; /* a notification: nothing to answer */
    char *json;
    size_t len;
    job->rc = plan_json(job->session, &json, &len, &job->st);
    if (job->rc < 0)
        return;
    qm_jw w;
    qm_jw_init(&w, &job->response);
    qm_rpc_result_begin(&w, job->req.id);
    qm_jw_raw(&w, json, len);
    qm_rpc_result_end(&w);
    qm_free(json);
    if (job->response.oom)
        job->rc = qm_status_set(&job->st, QM_ENOMEM, "out of memory encoding the plan");
}

static const qm_job_ops plan_ops = {.run = plan_run, .finish = qm__job_answer};

/* ---- session.resize: growth admitted on the loop, applied in the FIFO ---- */

static int resize_admit(qm_job *job, qm_status *st)
{
    /* "N%" and "auto" come to bytes now (qm_budget.h); "auto" keeps why. */
    qm_params *p = &job->req.params;
    qm_budget_auto autob;
    int rc = qm_sessions_budget(job->mx->sessions, qm_session_model(job->session), job->session,
                                &p->budget, p->client_pending_bytes, &p->budget_bytes, &autob,
                                st);
    if (rc == 0 && autob.on) {
        job->budget_auto = qm_malloc(sizeof autob);
        if (!job->budget_auto)
            return qm_status_set(st, QM_ENOMEM, "out of memory");
        *job->budget_auto = autob;
    }
    return rc < 0 ? rc
                  : qm_session_resize_reserve(job->mx->sessions, job->session, p->budget_bytes,
                                              st);
}

/* Every earlier job of the session has finished (its FIFO): they ran under
 * the old budget, every later one runs under the new. */
static void resize_run(qm_job *job)
{
    if (qm__job_session_closed(job))
        return;
    job->rc = qm_session_resize(job->session, job->req.params.budget_bytes, &job->st);
    qm_session_stats(job->session, &job->pstats);
}

static void resize_finish(qm_job *job)
{
    const qm_method_ctx *mx = job->mx;
    qm_session *s = job->session;
    qm_session_resize_finish(mx->sessions, s, job->rc == 0, job->req.params.budget_bytes);
    if (!qm_session_closed(s)) {
        /* What the resize evicted and re-copied counts like paging. */
        qm_pager_stats was;
        qm_session_note_stats(s, &job->pstats, &was);
        qm_counters_add_paging(qm_session_counters(s), mx->counters, &was, &job->pstats);
    }
    if (job->rc < 0) {
        qm_reply_status(job->reply, job->slot, &job->req, &job->st);
        return;
    }
    /* A budget given as bytes or "N%" ends "auto": the watcher leaves the
     * session alone from then on; "auto" sizes it again. */
    qm_budget_auto *a = qm_session_auto_budget(s);
    qm_session_set_auto_budget(s, job->budget_auto);
    if (job->budget_auto)
        qm_pressure_watch(job->mx->pressure);
    qm_log(QM_LOG_INFO, "session %s resized: budget %llu%s%s, resident %llu, pins released %llu",
           qm_session_id(s), (unsigned long long)qm_session_budget(s), a->on ? "; " : "",
           a->on ? a->why : "",
           (unsigned long long)qm_session_resident_bytes(s),
           (unsigned long long)qm_session_last_stats(s)->pins_released);
    qm_reply_result(job->reply, job->slot, &job->req, write_resize_result, s);
}

static void resize_undo(qm_job *job)
{
    qm_session_resize_finish(job->mx->sessions, job->session, 0, 0);
}

static const qm_job_ops resize_ops = {
    .admit = resize_admit, .run = resize_run, .finish = resize_finish, .undo = resize_undo};

/* ---- answered on the loop thread ---- */

static int empty_result(qm_jw *w)
{
    qm_jw_obj_begin(w);
    qm_jw_obj_end(w);
    return 0;
}

static int session_close(qm_call *k, qm_status *st)
{
    qm_session *s = qm_session_find(k->mx->sessions, k->req->params.session);
    if (!s)
        return qm_status_set_field(st, QM_ENOT_FOUND, "session", "no session with that id");
    qm_log(QM_LOG_INFO, "session %s closed by uid %u", qm_session_id(s), (unsigned)k->peer->uid);
    qm_session_close(k->mx->sessions, s);
    return empty_result(k->w);
}

/* orphaned_since: when no open connection had used it any more, nothing
 * queued (unix seconds), null while one has; reclaim_in_s: seconds until
 * the reclaim closes it, null when it is not orphaned or never will be. */
static void write_orphan_state(qm_jw *w, qm_session *s, uint32_t timeout_s, uint64_t now_us)
{
    const qm_touches *t = qm_session_touches(s);
    qm_jw_key(w, "orphaned_since");
    if (t->orphaned_us)
        qm_jw_i64(w, t->orphaned_at);
    else
        qm_jw_null(w);
    int64_t left = qm_touches_reclaim_in_s(t, timeout_s, now_us);
    qm_jw_key(w, "reclaim_in_s");
    if (left >= 0)
        qm_jw_i64(w, left);
    else
        qm_jw_null(w);
}

static int session_list(qm_call *k, qm_status *st)
{
    (void)st;
    qm_jw *w = k->w;
    uint64_t now = qm_now_us();
    qm_jw_obj_begin(w);
    qm_jw_key(w, "sessions");
    qm_jw_arr_begin(w);
    for (qm_session *s = k->mx->sessions->first; s; s = qm_session_next(s)) {
        if (!k->peer->is_admin && qm_session_owner(s) != k->peer->uid)
            continue;
        qm_jw_obj_begin(w);
        qm_jw_member_str(w, "session", qm_session_id(s));
        qm_jw_member_str(w, "model", qm_session_model(s)->name);
        qm_jw_member_str(w, "policy", qm_session_policy(s));
        qm_jw_member_u64(w, "owner_uid", qm_session_owner(s));
        write_session_bytes(w, s);
        qm_jw_key(w, "created_at");
        qm_jw_i64(w, qm_session_created_at(s));
        write_orphan_state(w, s, k->mx->cfg->session_orphan_timeout_s, now);
        /* Its session.map maps (changed on this thread only). */
        qm_jw_member_u64(w, "maps", qm_session_maps(s)->count);
        qm_jw_member_u64(w, "mapped_bytes", qm_session_maps(s)->bytes);
        qm_jw_obj_end(w);
    }
    qm_jw_arr_end(w);
    qm_jw_obj_end(w);
    return 0;
}

/* The one descriptor that came with the request's first byte
 * (qm_conn_take_fds), taken from the call (the caller closes it). */
static int take_one_fd(qm_call *k, int *fd, qm_status *st)
{
    const char *method = qm_method_name(k->req->method);
    qm_fds none = QM_FDS_NONE, *f = k->fds ? k->fds : &none;
    if (f->count == 0)
        return qm_status_set_field(st, QM_EINVAL, "fd",
                                   "no descriptor came with %s: send one sealed memfd as "
                                   "SCM_RIGHTS on the sendmsg that carries the request line's "
                                   "first byte",
                                   method);
    if (f->count > 1)
        return qm_status_set_field(st, QM_EINVAL, "fd",
                                   "%u descriptors came with %s; expected exactly one (all were "
                                   "closed)",
                                   f->count, method);
    *fd = f->fd;
    *f = QM_FDS_NONE;
    return 0;
}

/* session.map: the descriptor, checked and mapped; the map id is
 * daemon-wide unique. */
static int session_map(qm_call *k, qm_status *st)
{
    const qm_method_ctx *mx = k->mx;
    const qm_params *p = &k->req->params;
    qm_session *s = qm_session_find(mx->sessions, p->session);
    if (!s)
        return qm_status_set_field(st, QM_ENOT_FOUND, "session", "no session with that id");
    int fd = -1;
    int rc = take_one_fd(k, &fd, st);
    if (rc < 0)
        return rc;
    qm_shm_map *m;
    rc = qm_shm_map_fd(fd, p->bytes, &m, st);
    if (rc < 0)
        return rc;
    m->id = qm_sessions_new_map_id(mx->sessions);
    rc = qm_shm_set_add(qm_session_maps(s), m, mx->cfg->max_mapped_bytes, qm_conn_id(k->conn), st);
    if (rc < 0) {
        qm_shm_unref(m);
        return rc;
    }
    qm_log(QM_LOG_DEBUG, "session %s mapped %llu bytes as map %llu", qm_session_id(s),
           (unsigned long long)m->bytes, (unsigned long long)m->id);
    qm_jw_obj_begin(k->w);
    qm_jw_member_u64(k->w, "map", m->id);
    qm_jw_member_u64(k->w, "bytes", m->bytes);
    qm_jw_obj_end(k->w);
    return 0;
}

static int session_unmap(qm_call *k, qm_status *st)
{
    qm_session *s = qm_session_find(k->mx->sessions, k->req->params.session);
    if (!s)
        return qm_status_set_field(st, QM_ENOT_FOUND, "session", "no session with that id");
    int rc = qm_shm_set_remove(qm_session_maps(s), k->req->params.map, st);
    return rc < 0 ? rc : empty_result(k->w);
}

/* session.ring: the descriptor, a sealed memfd of at least QM_RING_BYTES,
 * becomes the session's call ring on this connection (qm_ring.h). */
static int session_ring(qm_call *k, qm_status *st)
{
    qm_session *s = qm_session_find(k->mx->sessions, k->req->params.session);
    if (!s)
        return qm_status_set_field(st, QM_ENOT_FOUND, "session", "no session with that id");
    int fd = -1;
    uint64_t id;
    int rc = take_one_fd(k, &fd, st);
    if (rc == 0)
        rc = qm_ring_open(k->mx->rings, s, k->conn, fd, k->req->params.anticipate, &id, st);
    if (rc < 0)
        return rc;
    qm_jw_obj_begin(k->w);
    qm_jw_member_u64(k->w, "ring", id);
    qm_jw_member_u64(k->w, "bytes", QM_RING_BYTES);
    qm_jw_member_u64(k->w, "version", QM_RING_VERSION);
    qm_jw_obj_end(k->w);
    return 0;
}

/* session.plan always takes the session's queue: its resident_now comes
 * from the pagers, which belong to the worker running the session's jobs,
 * and it is ordered with the session's inferences. session.resize is a job
 * of that FIFO too: inferences queued before it finish under the old
 * budget, later ones run under the new; its growth is admitted on the loop
 * before it is queued. */
QM__METHOD_ROW(SESSION_CREATE, .role = QM_ROLE_USER, .session = QM_SESSION_UNUSED,
               .queued = QM_QUEUE_ALWAYS, .job = &create_ops);
QM__METHOD_ROW(SESSION_CLOSE, .handler = session_close, .role = QM_ROLE_USER,
               .session = QM_SESSION_REQUIRED, .queued = QM_QUEUE_BEHIND);
QM__METHOD_ROW(SESSION_LIST, .handler = session_list, .role = QM_ROLE_USER,
               .session = QM_SESSION_UNUSED, .queued = QM_QUEUE_NEVER);
QM__METHOD_ROW(SESSION_PLAN, .role = QM_ROLE_USER, .session = QM_SESSION_REQUIRED,
               .queued = QM_QUEUE_ALWAYS, .job = &plan_ops);
QM__METHOD_ROW(SESSION_RESIZE, .role = QM_ROLE_USER, .session = QM_SESSION_REQUIRED,
               .queued = QM_QUEUE_ALWAYS, .job = &resize_ops);
QM__METHOD_ROW(SESSION_MAP, .handler = session_map, .role = QM_ROLE_USER,
               .session = QM_SESSION_REQUIRED, .queued = QM_QUEUE_BEHIND, .takes_fds = 1);
QM__METHOD_ROW(SESSION_UNMAP, .handler = session_unmap, .role = QM_ROLE_USER,
               .session = QM_SESSION_REQUIRED, .queued = QM_QUEUE_BEHIND);
QM__METHOD_ROW(SESSION_RING, .handler = session_ring, .role = QM_ROLE_USER,
               .session = QM_SESSION_REQUIRED, .queued = QM_QUEUE_BEHIND, .takes_fds = 1);
