/* qm_telemetry.h - counters, latency histograms, the trace ring, and the
 * telemetry.* methods (qm_telemetry.c). Loop thread only: workers hand their
 * numbers back with the finished job, so nothing here takes a lock. */
#ifndef QM_TELEMETRY_H
#define QM_TELEMETRY_H

#include <stddef.h>
#include <stdint.h>

#include "qm_protocol.h"

#define QM_HIST_BUCKETS 256

typedef struct qm_hist {
    uint64_t count;
    uint64_t buckets[QM_HIST_BUCKETS];
} qm_hist;

void qm_hist_add(qm_hist *h, uint64_t value_us);
uint64_t qm_hist_quantile(const qm_hist *h, double q); /* bucket upper bound; 0 when empty */

typedef struct qm_counters {
    uint64_t requests, errors, tokens, expert_hits, expert_misses, bytes_paged_h2d, evictions,
        prefetch_issued, prefetch_useful, resident_bytes, bytes_read_disk, stall_us,
        expert_host_runs;
    qm_hist latency; /* session.infer end to end, microseconds */
} qm_counters;

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
} qm_trace;

int qm_trace_init(qm_trace *t, size_t cap);
void qm_trace_free(qm_trace *t);
/* Records a span; returns a copy through *out (may be NULL). */
void qm_trace_add(qm_trace *t, const char *name, uint64_t start_us, uint64_t dur_us,
                  const char *session, const char *args, qm_span *out);

void qm_jw_counters(qm_jw *w, const qm_counters *c); /* the counter members, no braces */

typedef struct qm_daemon qm_daemon;
typedef struct qm_peer qm_peer;
/* The telemetry.* methods: write the result value, or return an error in st.
 * `peer` decides which sessions are visible (its own, or all for an admin). */
int qm_telemetry_get(qm_daemon *d, const qm_peer *peer, const qm_params *p, qm_jw *w,
                     qm_status *st);
int qm_telemetry_trace(qm_daemon *d, const qm_params *p, qm_jw *w, qm_status *st);
/* Prometheus text (sessions the peer may see only). */
int qm_telemetry_metrics(qm_daemon *d, const qm_peer *peer, qm_buf *b);

#endif
