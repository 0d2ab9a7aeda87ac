/* qm_telemetry.c - counters, latency histograms, the trace ring, and the
 * telemetry.* methods (JSON and Prometheus text).
 *
 * All of it lives on the loop thread: workers hand their numbers back with
 * the finished job, so nothing here needs a lock. */
#include "qm_telemetry.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_daemon.h"
#include "qm_models.h"
#include "qm_server.h"
#include "qm_sessions.h"

/* Log-linear buckets: 4 per power of two, so a quantile is within 25%. */
static unsigned hist_bucket(uint64_t v)
{
    if (v < 4)
        return (unsigned)v;
    unsigned e = 63u - (unsigned)__builtin_clzll(v);
    unsigned sub = (unsigned)(v >> (e - 2)) & 3u;
    return 4u * (e - 1u) + sub;
}

static uint64_t bucket_upper(unsigned b)
{
    if (b < 4)
        return b;
    unsigned e = b / 4 + 1, sub = b % 4;
    return ((uint64_t)(4 + sub + 1) << (e - 2)) - 1;
}

void qm_hist_add(qm_hist *h, uint64_t value_us)
{
    h->buckets[hist_bucket(value_us)]++;
    h->count++;
}

uint64_t qm_hist_quantile(const qm_hist *h, double q)
{
    if (h->count == 0)
        return 0;
    uint64_t rank = (uint64_t)(q * (double)h->count + 0.5);
    if (rank < 1)
        rank = 1;
    uint64_t seen = 0;
    for (unsigned b = 0; b < QM_HIST_BUCKETS; b++) {
        seen += h->buckets[b];
        if (seen >= rank)
            return bucket_upper(b);
    }
    return bucket_upper(QM_HIST_BUCKETS - 1);
}

int qm_trace_init(qm_trace *t, size_t cap)
{
    memset(t, 0, sizeof *t);
    t->ring = qm_calloc(cap, sizeof *t->ring);
    if (!t->ring)
        return QM_ENOMEM;
    t->cap = cap;
    t->next_seq = 1;
    return 0;
}

void qm_trace_free(qm_trace *t)
{
    qm_free(t->ring);
    memset(t, 0, sizeof *t);
}

/* snprintf(dst, size, "%s", src) without printf: spans are written per call. */
static void copy_str(char *dst, size_t size, const char *src)
{
    size_t n = strnlen(src, size - 1);
    memcpy(dst, src, n);
    dst[n] = '\0';
}

void qm_trace_add(qm_trace *t, const char *name, uint64_t start_us, uint64_t dur_us,
                  const char *session, const char *args, qm_span *out)
{
    qm_span *s = &t->ring[t->head];
    memset(s, 0, sizeof *s);
    s->seq = t->next_seq++;
    copy_str(s->name, sizeof s->name, name);
    s->start_us = start_us;
    s->dur_us = dur_us;
    copy_str(s->session, sizeof s->session, session ? session : "");
    copy_str(s->args, sizeof s->args, args && args[0] ? args : "{}");
    if (out)
        *out = *s;
    t->head = (t->head + 1) % t->cap;
    if (t->count < t->cap)
        t->count++;
}

/* The counters, in the order telemetry.get and the metrics list them. */
typedef struct metric_def {
    const char *name, *help;
    int counter;
    size_t offset;
} metric_def;

#define COFF(f) offsetof(qm_counters, f)
static const metric_def metrics[] = {
    {"requests", "Requests answered.", 1, COFF(requests)},
    {"errors", "Requests answered with an error.", 1, COFF(errors)},
    {"tokens", "Tokens run through session.infer.", 1, COFF(tokens)},
    {"expert_hits", "Expert accesses that found the expert resident.", 1, COFF(expert_hits)},
    {"expert_misses", "Expert accesses that paged the expert in.", 1, COFF(expert_misses)},
    {"bytes_paged_h2d", "Bytes copied host to device after session creation.", 1,
     COFF(bytes_paged_h2d)},
    {"evictions", "Experts evicted.", 1, COFF(evictions)},
    {"prefetch_issued", "Experts copied in by prefetch.", 1, COFF(prefetch_issued)},
    {"prefetch_useful", "Prefetched experts used before eviction.", 1, COFF(prefetch_useful)},
    {"resident_bytes", "Expert-weight bytes resident now.", 0, COFF(resident_bytes)},
    {"bytes_read_disk", "Bytes read from bank files by direct disk paging (O_DIRECT).", 1,
     COFF(bytes_read_disk)},
    {"stall_us", "Microseconds inferences waited for expert copies or disk reads to land.", 1,
     COFF(stall_us)},
    {"expert_host_runs",
     "Expert accesses run on the host CPU from the bank mapping instead of being paged in "
     "(policy_params.on_miss host or auto).",
     1, COFF(expert_host_runs)},
};

static uint64_t counter_at(const qm_counters *c, const metric_def *m)
{
    uint64_t v;
    memcpy(&v, (const char *)c + m->offset, sizeof v);
    return v;
}

void qm_jw_counters(qm_jw *w, const qm_counters *c)
{
    for (size_t i = 0; i < sizeof metrics / sizeof metrics[0]; i++)
        qm_jw_member_u64(w, metrics[i].name, counter_at(c, &metrics[i]));
    qm_jw_member_u64(w, "p50_us", qm_hist_quantile(&c->latency, 0.50));
    qm_jw_member_u64(w, "p99_us", qm_hist_quantile(&c->latency, 0.99));
}

static int can_see(const qm_peer *c, const qm_session *s)
{
    return c->is_admin || c->uid == s->owner_uid;
}

/* The daemon-wide resident figure is the sum over open sessions, now. */
static void refresh_resident(qm_daemon *d)
{
    uint64_t sum = 0;
    for (qm_session *s = d->sessions; s; s = s->next)
        sum += s->counters.resident_bytes;
    d->counters.resident_bytes = sum;
}

static void jw_session_counters(qm_jw *w, const qm_session *s)
{
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "session", s->id);
    qm_jw_member_str(w, "model", s->model->name);
    qm_jw_counters(w, &s->counters);
    qm_jw_obj_end(w);
}

int qm_telemetry_get(qm_daemon *d, const qm_peer *c, const qm_params *p, qm_jw *w,
                     qm_status *st)
{
    refresh_resident(d);
    if (p->session) {
        qm_session *s = qm_session_find(d, p->session);
        if (!s)
            return qm_status_set_field(st, QM_ENOT_FOUND, "session", "no session with that id");
        if (!can_see(c, s))
            return qm_status_set_field(st, QM_EPERMISSION, "session",
                                       "session belongs to uid %u; only its owner or an admin "
                                       "may read its telemetry",
                                       (unsigned)s->owner_uid);
        jw_session_counters(w, s);
        return 0;
    }
    qm_jw_obj_begin(w);
    qm_jw_key(w, "daemon");
    qm_jw_obj_begin(w);
    qm_jw_counters(w, &d->counters);
    qm_jw_obj_end(w);
    qm_jw_key(w, "sessions");
    qm_jw_arr_begin(w);
    for (qm_session *s = d->sessions; s; s = s->next) {
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
int qm_telemetry_trace(qm_daemon *d, const qm_params *p, qm_jw *w, qm_status *st)
{
    if (p->session && !qm_session_find(d, p->session))
        return qm_status_set_field(st, QM_ENOT_FOUND, "session", "no session with that id");
    size_t cap = d->trace.count + d->n_sessions;
    const qm_span **all = qm_calloc(cap ? cap : 1, sizeof *all);
    if (!all)
        return qm_status_set(st, QM_ENOMEM, "out of memory collecting spans");
    size_t n = 0;
    for (size_t i = 0; i < d->trace.count; i++) {
        size_t idx = (d->trace.head + d->trace.cap - d->trace.count + i) % d->trace.cap;
        all[n++] = &d->trace.ring[idx];
    }
    size_t in_ring = n;
    for (qm_session *s = d->sessions; s; s = s->next) {
        int dup = 0;
        for (size_t i = 0; i < in_ring && !dup; i++)
            dup = all[i]->seq == s->plan_span.seq;
        if (!dup)
            all[n++] = &s->plan_span;
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
    label_value(b, s->model->name);
    qm_buf_printf(b, "\",session=\"%s\"%s}", s->id, extra);
}

int qm_telemetry_metrics(qm_daemon *d, const qm_peer *c, qm_buf *b)
{
    refresh_resident(d);
    for (size_t i = 0; i < sizeof metrics / sizeof metrics[0]; i++) {
        const metric_def *m = &metrics[i];
        const char *suffix = m->counter ? "_total" : "";
        const char *type = m->counter ? "counter" : "gauge";
        qm_buf_printf(b, "# HELP qmoed_%s%s %s\n# TYPE qmoed_%s%s %s\n", m->name, suffix, m->help,
                      m->name, suffix, type);
        qm_buf_printf(b, "qmoed_%s%s %llu\n", m->name, suffix,
                      (unsigned long long)counter_at(&d->counters, m));
        qm_buf_printf(b, "# HELP qmoed_session_%s%s %s (per session)\n# TYPE qmoed_session_%s%s %s\n",
                      m->name, suffix, m->help, m->name, suffix, type);
        for (qm_session *s = d->sessions; s; s = s->next) {
            if (!can_see(c, s))
                continue;
            qm_buf_printf(b, "qmoed_session_%s%s", m->name, suffix);
            session_labels(b, s, "");
            qm_buf_printf(b, " %llu\n", (unsigned long long)counter_at(&s->counters, m));
        }
    }
    static const double qs[2] = {0.5, 0.99};
    qm_buf_printf(b, "# HELP qmoed_infer_latency_us session.infer latency, microseconds.\n"
                     "# TYPE qmoed_infer_latency_us summary\n");
    for (int i = 0; i < 2; i++)
        qm_buf_printf(b, "qmoed_infer_latency_us{quantile=\"%g\"} %llu\n", qs[i],
                      (unsigned long long)qm_hist_quantile(&d->counters.latency, qs[i]));
    qm_buf_printf(b, "qmoed_infer_latency_us_count %llu\n",
                  (unsigned long long)d->counters.latency.count);
    qm_buf_printf(b, "# HELP qmoed_session_infer_latency_us session.infer latency per session.\n"
                     "# TYPE qmoed_session_infer_latency_us summary\n");
    for (qm_session *s = d->sessions; s; s = s->next) {
        if (!can_see(c, s))
            continue;
        for (int i = 0; i < 2; i++) {
            char extra[32];
            snprintf(extra, sizeof extra, ",quantile=\"%g\"", qs[i]);
            qm_buf_append(b, "qmoed_session_infer_latency_us", 30);
            session_labels(b, s, extra);
            qm_buf_printf(b, " %llu\n",
                          (unsigned long long)qm_hist_quantile(&s->counters.latency, qs[i]));
        }
        qm_buf_append(b, "qmoed_session_infer_latency_us_count", 36);
        session_labels(b, s, "");
        qm_buf_printf(b, " %llu\n", (unsigned long long)s->counters.latency.count);
    }
    qm_buf_printf(b, "# HELP qmoed_limit_hits_total Times a configured limit was hit.\n"
                     "# TYPE qmoed_limit_hits_total counter\n");
    for (int i = 0; i < QM_LIMIT_COUNT; i++)
        qm_buf_printf(b, "qmoed_limit_hits_total{limit=\"%s\"} %llu\n", qm_limit_names[i],
                      (unsigned long long)d->limit_hits[i]);
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
                  d->n_models, d->n_sessions, qm_server_connections(d),
                  (unsigned long long)qm_devices_admitted(&d->devices),
                  (unsigned long long)((qm_now_us() - d->start_us) / 1000000));
    return b->oom ? QM_ENOMEM : 0;
}
