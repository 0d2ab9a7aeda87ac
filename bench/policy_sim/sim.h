/* sim.h - the trace-driven cache model of bench/policy_sim, also used by
 * tests/paging to check the paging authority's counters against it. */
#ifndef QM_POLICY_SIM_H
#define QM_POLICY_SIM_H

#include <stddef.h>
#include <stdint.h>

#include "qm_residency.h"

/* [tokens, layers, k] expert ids, -1 = none (docs/TRACES.md payload). */
typedef struct sim_trace {
    uint32_t tokens, layers, experts, k;
    int16_t *ids;
} sim_trace;

typedef struct sim_prefetch {
    int history;       /* predict the next layer call from the previous token's experts there */
    double router_acc; /* > 0: modelled next-layer router, each true expert found with this probability */
    uint64_t seed;
} sim_prefetch;

typedef struct sim_result {
    uint64_t hits, misses, evictions, waves, fallbacks, uncached;
    uint64_t prefetch_issued, prefetch_useful;
    uint64_t preloaded; /* pins copied in at creation (fetches before the replay) */
    uint64_t warmed;    /* sim_run_warm's warm start (loaded before the session answers) */
} sim_result;

int sim_trace_generate(sim_trace *tr, uint32_t tokens, uint32_t layers, uint32_t experts,
                       uint32_t k, double alpha, double locality, uint64_t seed);
int sim_trace_load(const char *path, sim_trace *tr, char *err, size_t err_cap);
/* sim_readers.c: a .npy [tokens, layers, k] integer array (vLLM's
 * routed_experts; `experts` 0 = largest id + 1) and the JSON-lines form of
 * docs/TRACES.md; _any picks by content (.npy magic, '{', else .qmtr). */
int sim_trace_load_npy(const char *path, uint32_t experts, sim_trace *tr, char *err,
                       size_t err_cap);
int sim_trace_load_jsonl(const char *path, sim_trace *tr, char *err, size_t err_cap);
int sim_trace_load_any(const char *path, uint32_t experts, sim_trace *tr, char *err,
                       size_t err_cap);
void sim_trace_free(sim_trace *tr);
/* The access sequence of tokens [t0, t1): per (token, layer) its distinct
 * experts ascending. Caller frees *out with free(). */
int sim_future(const sim_trace *tr, uint32_t t0, uint32_t t1, qm_expert_ref **out, size_t *n_out);
/* Replays tokens [t0, t1) with `cap_slots` expert slots (pins included),
 * `pinned` ([layers*experts] flags, may be NULL), `pf` (NULL: no prefetch). */
int sim_run(const sim_trace *tr, uint32_t t0, uint32_t t1, uint32_t cap_slots,
            const qm_policy *pol, const uint8_t *pinned, const sim_prefetch *pf, sim_result *r);
/* The same from a warm start, as the daemon's warm_from_profile loads one:
 * before the replay, warm[0..n_warm) (keys layer * experts + expert, hottest
 * first) go into free slots in that order, at tick 0, until none is free
 * (the policy sees each on_insert; counted in r->warmed, not as misses). */
int sim_run_warm(const sim_trace *tr, uint32_t t0, uint32_t t1, uint32_t cap_slots,
                 const qm_policy *pol, const uint8_t *pinned, const sim_prefetch *pf,
                 const uint32_t *warm, size_t n_warm, sim_result *r);

#endif
