/* qm_telemetry.c - the clock, counters, latency histograms, limit hits and
 * the trace ring.
 *
 * All of it lives on the loop thread: workers hand their numbers back with
 * the finished job, so nothing here needs a lock. */
#include "qm_telemetry.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "qm_alloc.h"
#include "qm_log.h"
#include "qm_pager.h"

uint64_t qm_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

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

int qm_trace_init(qm_trace *t, size_t cap, uint64_t start_us)
{
    memset(t, 0, sizeof *t);
    t->ring = qm_calloc(cap, sizeof *t->ring);
    if (!t->ring)
        return QM_ENOMEM;
    t->cap = cap;
    t->next_seq = 1;
    t->start_us = start_us;
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
    s->start_us = start_us - t->start_us;
    s->dur_us = dur_us;
    copy_str(s->session, sizeof s->session, session ? session : "");
    copy_str(s->args, sizeof s->args, args && args[0] ? args : "{}");
    if (out)
        *out = *s;
    t->head = (t->head + 1) % t->cap;
    if (t->count < t->cap)
        t->count++;
}

/* The counters, in the order telemetry.get and the metrics list them; a
 * counter the pager feeds names the statistics whose growth it sums. */
typedef struct metric_def {
    const char *name, *help;
    int counter; /* 1 a total, 0 a gauge; METRIC_PEAK a gauge of the largest value seen */
    size_t offset;
    size_t from[2]; /* offsets in qm_pager_stats; NO_STAT: none */
} metric_def;

#define COFF(f) offsetof(qm_counters, f)
#define POFF(f) offsetof(qm_pager_stats, f)
#define NO_STAT SIZE_MAX
#define NOT_PAGED {NO_STAT, NO_STAT}
#define METRIC_PEAK 2
static const metric_def metrics[] = {
    {"requests", "Requests answered.", 1, COFF(requests), NOT_PAGED},
    {"errors", "Requests answered with an error.", 1, COFF(errors), NOT_PAGED},
    {"tokens", "Tokens run through session.infer.", 1, COFF(tokens), NOT_PAGED},
    {"expert_hits", "Expert accesses that found the expert resident.", 1, COFF(expert_hits),
     {POFF(hits), POFF(whole_bank_accesses)}},
    {"expert_misses", "Expert accesses that paged the expert in.", 1, COFF(expert_misses),
     {POFF(misses), NO_STAT}},
    {"bytes_paged_h2d", "Bytes copied host to device after session creation.", 1,
     COFF(bytes_paged_h2d), {POFF(bytes_paged_h2d), NO_STAT}},
    {"evictions", "Experts evicted.", 1, COFF(evictions), {POFF(evictions), NO_STAT}},
    {"prefetch_issued", "Experts copied in by prefetch.", 1, COFF(prefetch_issued),
     {POFF(prefetch_issued), NO_STAT}},
    {"prefetch_useful", "Prefetched experts used before eviction.", 1, COFF(prefetch_useful),
     {POFF(prefetch_useful), NO_STAT}},
    {"resident_bytes", "Expert-weight bytes resident now.", 0, COFF(resident_bytes), NOT_PAGED},
    {"bytes_read_disk", "Bytes read from bank files by direct disk paging (O_DIRECT).", 1,
     COFF(bytes_read_disk), {POFF(disk_bytes_read), NO_STAT}},
    {"stall_us", "Microseconds inferences waited for expert copies or disk reads to land.", 1,
     COFF(stall_us), {POFF(stall_us), NO_STAT}},
    {"expert_host_runs",
     "Expert accesses run on the host CPU from the bank mapping instead of being paged in "
     "(policy_params.on_miss host or auto).",
     1, COFF(expert_host_runs), {POFF(host_runs), NO_STAT}},
    {"predict_router_predicted", "Experts predicted by the next layer's router on the call's hidden states (resident or not).", 1,
     COFF(predict_router_predicted), {POFF(predict_router_predicted), NO_STAT}},
    {"predict_router_correct", "Experts predicted by router that the call they were about used.", 1,
     COFF(predict_router_correct), {POFF(predict_router_correct), NO_STAT}},
    {"predict_router_actual", "Experts used by the calls router made a prediction about.", 1,
     COFF(predict_router_actual), {POFF(predict_router_actual), NO_STAT}},
    {"predict_router_gated", "Forward calls on which router was switched off (imprecise, or its prefetches evicted unused).", 1,
     COFF(predict_router_gated), {POFF(predict_router_gated), NO_STAT}},
    {"predict_history_predicted", "Experts predicted by the next layer's recent calls (resident or not).", 1,
     COFF(predict_history_predicted), {POFF(predict_history_predicted), NO_STAT}},
    {"predict_history_correct", "Experts predicted by history that the call they were about used.", 1,
     COFF(predict_history_correct), {POFF(predict_history_correct), NO_STAT}},
    {"predict_history_actual", "Experts used by the calls history made a prediction about.", 1,
     COFF(predict_history_actual), {POFF(predict_history_actual), NO_STAT}},
    {"predict_history_gated", "Forward calls on which history was switched off (imprecise, or its prefetches evicted unused).", 1,
     COFF(predict_history_gated), {POFF(predict_history_gated), NO_STAT}},
    {"predict_lookahead_predicted", "Experts predicted by the router of the layer after next on the call's hidden states (resident or not).", 1,
     COFF(predict_lookahead_predicted), {POFF(predict_lookahead_predicted), NO_STAT}},
    {"predict_lookahead_correct", "Experts predicted by lookahead that the call they were about used.", 1,
     COFF(predict_lookahead_correct), {POFF(predict_lookahead_correct), NO_STAT}},
    {"predict_lookahead_actual", "Experts used by the calls lookahead made a prediction about.", 1,
     COFF(predict_lookahead_actual), {POFF(predict_lookahead_actual), NO_STAT}},
    {"predict_lookahead_gated", "Forward calls on which lookahead was switched off (imprecise, or its prefetches evicted unused).", 1,
     COFF(predict_lookahead_gated), {POFF(predict_lookahead_gated), NO_STAT}},
    {"prefetch_router_issued", "Experts copied in by prefetch on the guess of the next layer's router.", 1,
     COFF(prefetch_router_issued), {POFF(prefetch_router_issued), NO_STAT}},
    {"prefetch_router_useful", "Experts router prefetched that were used before eviction.", 1,
     COFF(prefetch_router_useful), {POFF(prefetch_router_useful), NO_STAT}},
    {"prefetch_history_issued", "Experts copied in by prefetch on the guess of the next layer's recent calls.", 1,
     COFF(prefetch_history_issued), {POFF(prefetch_history_issued), NO_STAT}},
    {"prefetch_history_useful", "Experts history prefetched that were used before eviction.", 1,
     COFF(prefetch_history_useful), {POFF(prefetch_history_useful), NO_STAT}},
    {"prefetch_lookahead_issued", "Experts copied in by prefetch on the guess of the router of the layer after next.", 1,
     COFF(prefetch_lookahead_issued), {POFF(prefetch_lookahead_issued), NO_STAT}},
    {"prefetch_lookahead_useful", "Experts lookahead prefetched that were used before eviction.", 1,
     COFF(prefetch_lookahead_useful), {POFF(prefetch_lookahead_useful), NO_STAT}},
    {"prefetch_gated", "Forward calls times prediction sources that fetched nothing, switched off (imprecise, or their prefetches evicted unused).", 1,
     COFF(prefetch_gated), {POFF(prefetch_gated), NO_STAT}},
    {"prefetch_parked", "Prefetch reads stopped part way because the call they guessed for did not ask for their expert.", 1,
     COFF(prefetch_parked), {POFF(prefetch_parked), NO_STAT}},
    {"prefetch_trial_held", "Forward calls whose predictions were not fetched: the prefetch trial timed the session faster without them.", 1,
     COFF(prefetch_trial_held), {POFF(prefetch_trial_held), NO_STAT}},
    {"prefetch_trial_decisions", "Times the prefetch trial compared the session's speed with prefetch fetched and held.", 1,
     COFF(prefetch_trial_decisions), {POFF(prefetch_trial_decisions), NO_STAT}},
    {"prefetch_trial_decisions_held", "Prefetch trial decisions that held prefetch (it was slower).", 1,
     COFF(prefetch_trial_decisions_held), {POFF(prefetch_trial_decisions_held), NO_STAT}},
    {"disk_busy_us",
     "Microseconds direct disk paging had at least one read in flight; bytes_read_disk / "
     "disk_busy_us is the disk's measured read rate.",
     1, COFF(disk_busy_us), {POFF(disk_busy_us), NO_STAT}},
    {"read_calls", "Inferences with disk reads in flight while they ran.", 1, COFF(read_calls),
     {POFF(read_calls), NO_STAT}},
    {"reads_in_flight_sum",
     "Sum over read_calls of the most disk reads in flight at once during each (its mean per "
     "call: reads_in_flight_sum / read_calls).",
     1, COFF(reads_in_flight_sum), {POFF(reads_in_flight_sum), NO_STAT}},
    {"reads_in_flight_peak", "Most disk reads in flight at once.", METRIC_PEAK,
     COFF(reads_in_flight_peak), {POFF(reads_in_flight_peak), NO_STAT}},
    {"bytes_interleaved_paged",
     "Weight bytes of paged experts laid out in the fast decode GEMV's r8 layout after they "
     "landed and were reused, after session creation (fast sessions on the CPU).",
     1, COFF(bytes_interleaved_paged), {POFF(bytes_interleaved_paged), NO_STAT}},
    {"routing_trace_tokens",
     "Token rows written to routing traces (policy_params.record_trace, record_routing).", 1,
     COFF(routing_trace_tokens), {POFF(trace_tokens), NO_STAT}},
    {"routing_trace_stops",
     "Routing recordings stopped: the file reached max_trace_bytes, or a write failed (logged).",
     1, COFF(routing_trace_stops), {POFF(trace_full), POFF(trace_errors)}},
    {"auto_shrinks", "Times the memory watcher shrank an auto budget (pressure, or a limit "
     "leaving less than auto_budget_reserve).", 1, COFF(auto_shrinks), NOT_PAGED},
    {"auto_grows", "Times the memory watcher grew an auto budget back toward its auto size.", 1,
     COFF(auto_grows), NOT_PAGED},
    {"auto_shrunk_bytes", "Bytes of budget the memory watcher took from auto budgets.", 1,
     COFF(auto_shrunk_bytes), NOT_PAGED},
    {"auto_grown_bytes", "Bytes of budget the memory watcher gave back to auto budgets.", 1,
     COFF(auto_grown_bytes), NOT_PAGED},
    {"auto_budget_bytes", "Budget bytes in force of the sessions whose budget is auto.", 0,
     COFF(auto_budget_bytes), NOT_PAGED},
    {"auto_relapses", "Auto budget shrinks for memory pressure within twice "
     "auto_budget_grow_after_s of the watcher growing it: each doubles the quiet wait before "
     "the next growth (up to 8 times) and stops that growth at the budget it left.",
     1, COFF(auto_relapses), NOT_PAGED},
};
#define N_METRICS (sizeof metrics / sizeof metrics[0])

static uint64_t *counter_slot(qm_counters *c, const metric_def *m)
{
    return (uint64_t *)((char *)c + m->offset);
}

static uint64_t stat_at(const qm_pager_stats *s, size_t offset)
{
    uint64_t v;
    memcpy(&v, (const char *)s + offset, sizeof v);
    return v;
}

uint64_t qm_counter_paging(size_t i, const qm_pager_stats *s)
{
    uint64_t v = 0;
    for (int j = 0; i < N_METRICS && j < 2; j++)
        if (metrics[i].from[j] != NO_STAT)
            v += stat_at(s, metrics[i].from[j]);
    return v;
}

size_t qm_counter_index(const char *name)
{
    size_t i = 0;
    while (i < N_METRICS && strcmp(metrics[i].name, name) != 0)
        i++;
    return i;
}

void qm_counters_add_paging(qm_counters *session, qm_counters *daemon, const qm_pager_stats *was,
                            const qm_pager_stats *now)
{
    for (size_t i = 0; i < N_METRICS; i++) {
        const metric_def *m = &metrics[i];
        if (m->from[0] == NO_STAT)
            continue;
        if (m->counter == METRIC_PEAK) {
            uint64_t v = qm_counter_paging(i, now);
            if (v > *counter_slot(session, m))
                *counter_slot(session, m) = v;
            if (v > *counter_slot(daemon, m))
                *counter_slot(daemon, m) = v;
            continue;
        }
        uint64_t delta = qm_counter_paging(i, now) - qm_counter_paging(i, was);
        *counter_slot(session, m) += delta;
        *counter_slot(daemon, m) += delta;
    }
    session->resident_bytes = now->resident_bytes;
}

size_t qm_counter_count(void) { return N_METRICS; }
const char *qm_counter_name(size_t i) { return i < N_METRICS ? metrics[i].name : NULL; }
const char *qm_counter_help(size_t i) { return i < N_METRICS ? metrics[i].help : NULL; }
int qm_counter_is_total(size_t i) { return i < N_METRICS && metrics[i].counter == 1; }

uint64_t qm_counter_value(const qm_counters *c, size_t i)
{
    uint64_t v = 0;
    if (i < N_METRICS)
        memcpy(&v, (const char *)c + metrics[i].offset, sizeof v);
    return v;
}

void qm_jw_counters(qm_jw *w, const qm_counters *c)
{
    for (size_t i = 0; i < N_METRICS; i++)
        qm_jw_member_u64(w, metrics[i].name, qm_counter_value(c, i));
    qm_jw_member_u64(w, "p50_us", qm_hist_quantile(&c->latency, 0.50));
    qm_jw_member_u64(w, "p99_us", qm_hist_quantile(&c->latency, 0.99));
}

const char *const qm_limit_names[QM_LIMIT_COUNT] = {
    "max_request_bytes", "max_nesting",  "max_batch",      "max_connections",  "max_sessions",
    "max_output_bytes",  "queue_depth",  "idle_timeout_s", "frames_per_wakeup",
    "frame_timeout_s",   "output_stall", "max_rings",      "max_connections_per_uid",
    "max_sessions_per_uid",
};

void qm_limit_count(qm_limits *l, int limit) { l->hits[limit]++; }

/* Counted every time, logged the first time per limit (and per connection
 * for the output limit, logged by its caller). */
void qm_limit_hit(qm_limits *l, int limit, const char *fmt, ...)
{
    l->hits[limit]++;
    if (l->logged[limit])
        return;
    l->logged[limit] = 1;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    qm_log(QM_LOG_WARNING, "limit %s: %s (logged once; see qmoed_limit_hits_total)",
           qm_limit_names[limit], msg);
}

const qm_span *qm_trace_at(const qm_trace *t, size_t i)
{
    return &t->ring[(t->head + t->cap - t->count + i) % t->cap];
}
