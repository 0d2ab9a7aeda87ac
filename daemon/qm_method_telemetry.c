/* qm_method_telemetry.c - telemetry.get, telemetry.trace and
 * telemetry.metrics: the counters, spans and limit hits of qm_telemetry.h
 * as JSON and Prometheus text (PROTOCOL.md). A user sees only their own
 * sessions. */
#include "qm_methods.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_models.h"
#include "qm_sessions.h"

static int can_see(const qm_peer *c, const qm_session *s)
{
    return c->is_admin || c->uid == qm_session_owner(s);
}

/* The daemon-wide resident figure is the sum over open sessions, now; so
 * are the auto budgets in force (each session's gauge set here too). */
static void refresh_resident(const qm_method_ctx *mx)
{
    uint64_t sum = 0, auto_sum = 0;
    for (qm_session *s = mx->sessions->first; s; s = qm_session_next(s)) {
        sum += qm_session_resident_bytes(s);
        uint64_t a = qm_session_auto_budget(s)->on ? qm_session_budget(s) : 0;
        qm_session_counters(s)->auto_budget_bytes = a;
        auto_sum += a;
    }
    mx->counters->resident_bytes = sum;
    mx->counters->auto_budget_bytes = auto_sum;
}

static void jw_session_counters(qm_jw *w, qm_session *s)
{
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "session", qm_session_id(s));
    qm_jw_member_str(w, "model", qm_session_model(s)->name);
    qm_jw_counters(w, qm_session_counters(s));
    qm_jw_obj_end(w);
}

static int telemetry_get(qm_call *k, qm_status *st)
{
    const qm_method_ctx *mx = k->mx;
    const qm_peer *c = k->peer;
    const qm_params *p = &k->req->params;
    qm_jw *w = k->w;
    refresh_resident(mx);
    if (p->session) {
        qm_session *s = qm_session_find(mx->sessions, p->session);
        if (!s)
            return qm_status_set_field(st, QM_ENOT_FOUND, "session", "no session with that id");
        if (!can_see(c, s))
            return qm_status_set_field(st, QM_EPERMISSION, "session",
                                       "session belongs to uid %u; only its owner or an admin "
                                       "may read its telemetry",
                                       (unsigned)qm_session_owner(s));
        jw_session_counters(w, s);
        return 0;
    }
    qm_jw_obj_begin(w);
    qm_jw_key(w, "daemon");
    qm_jw_obj_begin(w);
    qm_jw_counters(w, mx->counters);
    qm_jw_member_u64(w, "sessions_reclaimed", mx->counters->sessions_reclaimed);
    qm_jw_member_u64(w, "maps_reclaimed", mx->counters->maps_reclaimed);
    qm_jw_member_u64(w, "memory_pressure_events", mx->counters->memory_pressure_events);
    qm_jw_obj_end(w);
    qm_jw_key(w, "sessions");
    qm_jw_arr_begin(w);
    for (qm_session *s = mx->sessions->first; s; s = qm_session_next(s)) {
        if (!can_see(c, s))
            continue;
        jw_session_counters(w, s);
    }
    qm_jw_arr_end(w);
    qm_jw_obj_end(w);
    return 0;
}

static int span_cmp(const void *a, const void *b)
{
    const qm_span *x = *(qm_span *const *)a, *y = *(qm_span *const *)b;
    if (x->start_us != y->start_us)
        return x->start_us < y->start_us ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

static void jw_span(qm_jw *w, const qm_span *s)
{
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "name", s->name);
    qm_jw_member_u64(w, "start_us", s->start_us);
    qm_jw_member_u64(w, "dur_us", s->dur_us);
    if (s->session[0]) {
        qm_jw_member_str(w, "session", s->session);
    }
    qm_jw_key(w, "args");
    qm_jw_raw(w, s->args, strlen(s->args));
    qm_jw_obj_end(w);
}

/* The ring plus every live session's plan span (kept with the session, so
 * it survives the ring wrapping), oldest first, the newest `limit`. */
static int telemetry_trace(qm_call *k, qm_status *st)
{
    const qm_method_ctx *mx = k->mx;
    const qm_params *p = &k->req->params;
    const qm_trace *trace = mx->trace;
    qm_jw *w = k->w;
    if (p->session && !qm_session_find(mx->sessions, p->session))
        return qm_status_set_field(st, QM_ENOT_FOUND, "session", "no session with that id");
    size_t cap = trace->count + mx->sessions->n;
    const qm_span **all = qm_calloc(cap ? cap : 1, sizeof *all);
    if (!all)
        return qm_status_set(st, QM_ENOMEM, "out of memory collecting spans");
    size_t n = 0;
    for (size_t i = 0; i < trace->count; i++)
        all[n++] = qm_trace_at(trace, i);
    size_t in_ring = n;
    for (qm_session *s = mx->sessions->first; s; s = qm_session_next(s)) {
        const qm_span *plan = qm_session_plan_span(s);
        int dup = 0;
        for (size_t i = 0; i < in_ring && !dup; i++)
            dup = all[i]->seq == plan->seq;
        if (!dup)
            all[n++] = plan;
    }
    qsort(all, n, sizeof *all, span_cmp);
    size_t keep = 0;
    for (size_t i = 0; i < n; i++)
        if (!p->session || strcmp(all[i]->session, p->session) == 0)
            all[keep++] = all[i];
    size_t from = p->has_limit && p->limit < keep ? keep - p->limit : 0;
    qm_jw_obj_begin(w);
    qm_jw_key(w, "spans");
    qm_jw_arr_begin(w);
    for (size_t i = from; i < keep; i++)
        jw_span(w, all[i]);
    qm_jw_arr_end(w);
    qm_jw_obj_end(w);
    qm_free(all);
    return 0;
}

/* ---- Prometheus text exposition ---- */

static void label_value(qm_buf *b, const char *s)
{
    for (; *s; s++) {
        if (*s == '\\' || *s == '"')
            qm_buf_printf(b, "\\%c", *s);
        else if (*s == '\n')
            qm_buf_append(b, "\\n", 2);
        else
            qm_buf_append(b, s, 1);
    }
}

static void session_labels(qm_buf *b, const qm_session *s, const char *extra)
{
    qm_buf_append(b, "{model=\"", 8);
    label_value(b, qm_session_model(s)->name);
    qm_buf_printf(b, "\",session=\"%s\"%s}", qm_session_id(s), extra);
}

/* Prometheus text (sessions the peer may see only). */
static int metrics_text(const qm_method_ctx *mx, const qm_peer *c, qm_buf *b)
{
    refresh_resident(mx);
    qm_session *first = mx->sessions->first;
    for (size_t i = 0; i < qm_counter_count(); i++) {
        const char *name = qm_counter_name(i), *help = qm_counter_help(i);
        const char *suffix = qm_counter_is_total(i) ? "_total" : "";
        const char *type = qm_counter_is_total(i) ? "counter" : "gauge";
        qm_buf_printf(b, "# HELP qmoed_%s%s %s\n# TYPE qmoed_%s%s %s\n", name, suffix, help, name,
                      suffix, type);
        qm_buf_printf(b, "qmoed_%s%s %llu\n", name, suffix,
                      (unsigned long long)qm_counter_value(mx->counters, i));
        qm_buf_printf(b, "# HELP qmoed_session_%s%s %s (per session)\n# TYPE qmoed_session_%s%s %s\n",
                      name, suffix, help, name, suffix, type);
        for (qm_session *s = first; s; s = qm_session_next(s)) {
            if (!can_see(c, s))
                continue;
            qm_buf_printf(b, "qmoed_session_%s%s", name, suffix);
            session_labels(b, s, "");
            qm_buf_printf(b, " %llu\n",
                          (unsigned long long)qm_counter_value(qm_session_counters(s), i));
        }
    }
    static const double qs[2] = {0.5, 0.99};
    qm_buf_printf(b, "# HELP qmoed_infer_latency_us session.infer latency, microseconds.\n"
                     "# TYPE qmoed_infer_latency_us summary\n");
    for (int i = 0; i < 2; i++)
        qm_buf_printf(b, "qmoed_infer_latency_us{quantile=\"%g\"} %llu\n", qs[i],
                      (unsigned long long)qm_hist_quantile(&mx->counters->latency, qs[i]));
    qm_buf_printf(b, "qmoed_infer_latency_us_count %llu\n",
                  (unsigned long long)mx->counters->latency.count);
    qm_buf_printf(b, "# HELP qmoed_session_infer_latency_us session.infer latency per session.\n"
                     "# TYPE qmoed_session_infer_latency_us summary\n");
    for (qm_session *s = first; s; s = qm_session_next(s)) {
        if (!can_see(c, s))
            continue;
        const qm_hist *latency = &qm_session_counters(s)->latency;
        for (int i = 0; i < 2; i++) {
            char extra[32];
            snprintf(extra, sizeof extra, ",quantile=\"%g\"", qs[i]);
            qm_buf_append(b, "qmoed_session_infer_latency_us", 30);
            session_labels(b, s, extra);
            qm_buf_printf(b, " %llu\n",
                          (unsigned long long)qm_hist_quantile(latency, qs[i]));
        }
        qm_buf_append(b, "qmoed_session_infer_latency_us_count", 36);
        session_labels(b, s, "");
        qm_buf_printf(b, " %llu\n", (unsigned long long)latency->count);
    }
    qm_buf_printf(b, "# HELP qmoed_sessions_reclaimed_total Orphaned sessions closed after "
                     "session_orphan_timeout_s.\n# TYPE qmoed_sessions_reclaimed_total counter\n"
                     "qmoed_sessions_reclaimed_total %llu\n",
                  (unsigned long long)mx->counters->sessions_reclaimed);
    qm_buf_printf(b, "# HELP qmoed_maps_reclaimed_total Maps unmapped after their connection "
                     "had been closed for session_orphan_timeout_s.\n"
                     "# TYPE qmoed_maps_reclaimed_total counter\nqmoed_maps_reclaimed_total %llu\n",
                  (unsigned long long)mx->counters->maps_reclaimed);
    qm_buf_printf(b, "# HELP qmoed_memory_pressure_events_total Memory pressure events the "
                     "auto-budget watcher received.\n"
                     "# TYPE qmoed_memory_pressure_events_total counter\n"
                     "qmoed_memory_pressure_events_total %llu\n",
                  (unsigned long long)mx->counters->memory_pressure_events);
    qm_buf_printf(b, "# HELP qmoed_limit_hits_total Times a configured limit was hit.\n"
                     "# TYPE qmoed_limit_hits_total counter\n");
    for (int i = 0; i < QM_LIMIT_COUNT; i++)
        qm_buf_printf(b, "qmoed_limit_hits_total{limit=\"%s\"} %llu\n", qm_limit_names[i],
                      (unsigned long long)mx->limits->hits[i]);
    qm_buf_printf(b,
                  "# HELP qmoed_models Models loaded.\n# TYPE qmoed_models gauge\nqmoed_models %zu\n"
                  "# HELP qmoed_sessions Sessions open.\n# TYPE qmoed_sessions gauge\n"
                  "qmoed_sessions %zu\n"
                  "# HELP qmoed_connections Client connections open.\n"
                  "# TYPE qmoed_connections gauge\nqmoed_connections %zu\n"
                  "# HELP qmoed_budget_used_bytes Device budget admitted to sessions.\n"
                  "# TYPE qmoed_budget_used_bytes gauge\nqmoed_budget_used_bytes %llu\n"
                  "# HELP qmoed_uptime_seconds Seconds since start.\n"
                  "# TYPE qmoed_uptime_seconds gauge\nqmoed_uptime_seconds %llu\n",
                  mx->models->n, mx->sessions->n,
                  qm_server_connections(mx->server),
                  (unsigned long long)qm_devices_admitted(mx->devices),
                  (unsigned long long)((qm_now_us() - mx->start_us) / 1000000));
    return b->oom ? QM_ENOMEM : 0;
}

static int telemetry_metrics(qm_call *k, qm_status *st)
{
    qm_buf text;
    qm_buf_init(&text);
    int rc = metrics_text(k->mx, k->peer, &text);
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

/* telemetry.get about a session waits behind its queued work, so its
 * counters include the requests sent before it. */
QM__METHOD_ROW(TELEMETRY_GET, .handler = telemetry_get, .role = QM_ROLE_USER,
               .session = QM_SESSION_OPTIONAL, .queued = QM_QUEUE_BEHIND);
QM__METHOD_ROW(TELEMETRY_TRACE, .handler = telemetry_trace, .role = QM_ROLE_ADMIN,
               .session = QM_SESSION_UNUSED, .queued = QM_QUEUE_NEVER);
QM__METHOD_ROW(TELEMETRY_METRICS, .handler = telemetry_metrics, .role = QM_ROLE_USER,
               .session = QM_SESSION_UNUSED, .queued = QM_QUEUE_NEVER);
