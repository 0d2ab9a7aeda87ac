/* qm_telemetry.h - what the daemon counts (qm_telemetry.c): the clock,
 * counters and latency histograms, the pager's work folded into them, the
 * limits hit, and the trace ring. Plain data, loop thread only: workers
 * hand their numbers back with the finished job, so nothing here takes a
 * lock. The telemetry.* methods that show it are qm_method_telemetry.c. */
#ifndef QM_TELEMETRY_H
#define QM_TELEMETRY_H

#include <stddef.h>
#include <stdint.h>

#include "qm_protocol.h"

typedef struct qm_pager_stats qm_pager_stats; /* engine/pager/qm_pager.h */

uint64_t qm_now_us(void); /* monotonic: every span, latency and timeout reads it */

#define QM_HIST_BUCKETS 256

typedef struct qm_hist {
    uint64_t count;
    uint64_t buckets[QM_HIST_BUCKETS];
} qm_hist;

void qm_hist_add(qm_hist *h, uint64_t value_us);
uint64_t qm_hist_quantile(const qm_hist *h, double q); /* bucket upper bound; 0 when empty */

/* The counters of the daemon and of each session. Every one is a row of
 * the table in qm_telemetry.c: its name and help (telemetry.get, the
 * metrics) and, for the pager's, the pager statistics it sums. */
typedef struct qm_counters {
    uint64_t requests, errors, tokens, expert_hits, expert_misses, bytes_paged_h2d, evictions,
        prefetch_issued, prefetch_useful, resident_bytes, bytes_read_disk, stall_us,
        expert_host_runs;
    /* Prediction, per source (router, history, lookahead): experts
     * predicted, of them used by the call they were about, the experts those
     * calls used, forward calls the source sat out (gated). */
    uint64_t predict_router_predicted, predict_router_correct, predict_router_actual,
        predict_router_gated, predict_history_predicted, predict_history_correct,
        predict_history_actual, predict_history_gated, predict_lookahead_predicted,
        predict_lookahead_correct, predict_lookahead_actual, predict_lookahead_gated;
    /* Prefetch per source: experts it copied in, of them used before
     * eviction; (source, call) pairs a switched-off source fetched nothing. */
    uint64_t prefetch_router_issued, prefetch_router_useful, prefetch_history_issued,
        prefetch_history_useful, prefetch_lookahead_issued, prefetch_lookahead_useful,
        prefetch_gated;
    /* Prefetch reads parked part way: the call they guessed for did not
     * ask for their expert (config prefetch_park). */
    uint64_t prefetch_parked;
    /* The prefetch trial (engine/pager/qm_pager_trial.h): forward calls
     * whose predictions it held; its decisions, of them to hold. */
    uint64_t prefetch_trial_held, prefetch_trial_decisions, prefetch_trial_decisions_held;
    /* Direct disk paging's I/O engine: time with reads in flight, calls
     * with reads in flight and the sum of each one's most, the most. */
    uint64_t disk_busy_us, read_calls, reads_in_flight_sum, reads_in_flight_peak;
    /* Paged experts' weights laid out in the r8 layout after they landed. */
    uint64_t bytes_interleaved_paged;
    /* Routing traces (record_trace, record_routing): token rows written,
     * recordings stopped (a file at max_trace_bytes, a failed write). */
    uint64_t routing_trace_tokens, routing_trace_stops;
    /* Auto budgets (qm_budget.h, qm_pressure.h): what the memory watcher
     * shrank and grew, and the auto budgets in force (a gauge); shrinks
     * that were relapses (qm_budget.h). */
    uint64_t auto_shrinks, auto_grows, auto_shrunk_bytes, auto_grown_bytes, auto_budget_bytes;
    uint64_t auto_relapses;
    qm_hist latency; /* session.infer end to end, microseconds */
    /* Daemon-wide only, outside the table: sessions the orphan reclaim
     * closed and maps it unmapped in sessions that lived on (qm_reclaim.h);
     * memory pressure events the watcher received (qm_pressure.h). */
    uint64_t sessions_reclaimed, maps_reclaimed;
    uint64_t memory_pressure_events;
} qm_counters;

/* What a session's pager did between two readings of its statistics (one
 * job's work), added to the session's counters and the daemon's: every
 * counter the table feeds from the pager, resident_bytes set to now's. */
void qm_counters_add_paging(qm_counters *session, qm_counters *daemon, const qm_pager_stats *was,
                            const qm_pager_stats *now);
void qm_jw_counters(qm_jw *w, const qm_counters *c); /* the counter members, no braces */
/* Counter i as one reading of a pager's statistics gives it: the sum of
 * the statistics its row names, so the table is the one definition of
 * each (expert_hits: hits + whole_bank_accesses); 0 for a counter the
 * pager does not feed. What a job did is the difference of two readings. */
uint64_t qm_counter_paging(size_t i, const qm_pager_stats *s);
/* The index of the counter named `name` (qm_counter_count() when none). */
size_t qm_counter_index(const char *name);

/* The counters in table order, for the metrics: name, help, whether it is
 * a counter (else a gauge), and its value in c. i < qm_counter_count(). */
size_t qm_counter_count(void);
const char *qm_counter_name(size_t i);
const char *qm_counter_help(size_t i);
int qm_counter_is_total(size_t i);
uint64_t qm_counter_value(const qm_counters *c, size_t i);

/* Every configured bound: counted each time it triggers, logged once. */
enum {
    QM_LIMIT_MAX_REQUEST_BYTES,
    QM_LIMIT_MAX_NESTING,
    QM_LIMIT_MAX_BATCH,
    QM_LIMIT_MAX_CONNECTIONS,
    QM_LIMIT_MAX_SESSIONS,
    QM_LIMIT_MAX_OUTPUT_BYTES,
    QM_LIMIT_QUEUE_DEPTH,
    QM_LIMIT_IDLE_TIMEOUT,
    QM_LIMIT_FRAMES_PER_WAKEUP,
    QM_LIMIT_FRAME_TIMEOUT,
    QM_LIMIT_OUTPUT_STALL,
    QM_LIMIT_MAX_RINGS,
    QM_LIMIT_MAX_CONNECTIONS_PER_UID,
    QM_LIMIT_MAX_SESSIONS_PER_UID,
    QM_LIMIT_COUNT
};
extern const char *const qm_limit_names[QM_LIMIT_COUNT]; /* the config keys */

typedef struct qm_limits {
    uint64_t hits[QM_LIMIT_COUNT];
    int logged[QM_LIMIT_COUNT];
} qm_limits;

/* Counts a hit and logs the first one of each limit (the sentence says
 * what happened). */
void qm_limit_hit(qm_limits *l, int limit, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Counts without logging (a caller that logs per connection itself). */
void qm_limit_count(qm_limits *l, int limit);

typedef struct qm_span {
    uint64_t seq;
    char name[32];
    uint64_t start_us, dur_us;
    char session[QM_SESSION_ID_LEN + 1]; /* "" when none */
    char args[192];                      /* a JSON object */
} qm_span;

typedef struct qm_trace {
    qm_span *ring;
    size_t cap, head, count; /* head = next slot to write */
    uint64_t next_seq;
    uint64_t start_us; /* the daemon's start: spans' times count from it */
} qm_trace;

int qm_trace_init(qm_trace *t, size_t cap, uint64_t start_us);
void qm_trace_free(qm_trace *t);
/* Records a span that began at monotonic time start_us (qm_now_us);
 * returns a copy through *out (may be NULL). */
void qm_trace_add(qm_trace *t, const char *name, uint64_t start_us, uint64_t dur_us,
                  const char *session, const char *args, qm_span *out);
/* The i-th span of the ring, oldest first (i < t->count). */
const qm_span *qm_trace_at(const qm_trace *t, size_t i);

#endif
