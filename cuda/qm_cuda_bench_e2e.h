/* qm_cuda_bench_e2e.h - end-to-end layer throughput through the paging
 * authority on a backend (qmoe-cuda-bench; its small form runs in
 * test_cuda_paging, emulated and on the device). Private to cuda/ and its tests.
 *
 * A bank of `layers` GPT-OSS-like layers (swiglu interleaved, alpha 1.702,
 * beta 1, limit 7, int4 block 32, f16 scales and biases, bf16 router) is
 * built in host memory, registered with the backend when it is CUDA (direct
 * DMA), and served by one pager per budget (100/50/25 % of every expert's
 * bytes, policy lru, prefetch on as in the daemon). Each step runs T tokens
 * through every layer in order with fresh hidden states, so routing (on the
 * device's router when the backend routes) is fresh every call. */
#ifndef QM_CUDA_BENCH_E2E_H
#define QM_CUDA_BENCH_E2E_H

#include <stddef.h>
#include <stdint.h>

#include "qm_backend.h"

typedef struct qm_e2e_spec {
    uint32_t layers, experts, hidden, inter, k;
    uint32_t tokens[4]; /* T of each measured point (n_tokens of them) */
    uint32_t n_tokens;
    uint32_t budget_pct[4]; /* e.g. 100, 50, 25 */
    uint32_t n_budgets;
    double seconds; /* per point, after one warm-up step */
    uint32_t max_steps, min_steps;
    int prefetch;
} qm_e2e_spec;

typedef struct qm_e2e_row {
    uint32_t budget_pct, tokens;
    uint64_t budget_bytes, model_bytes;
    uint32_t steps;             /* each step: T tokens through every layer */
    double seconds;
    double tokens_per_s;        /* of the whole layer stack */
    double ms_per_layer_call;
    uint64_t bytes_paged;       /* host-to-device bytes during the measured steps */
    double paged_gb_per_s;
    uint64_t hits, misses, prefetch_issued, prefetch_useful;
    int bitwise_equal_to_full; /* the first point's check output equals the 100 % one */
} qm_e2e_row;

/* Fills rows[0 .. n_budgets * n_tokens) and calls report() with one line per
 * row (and a header) when report is not NULL. */
int qm_e2e_run(qm_backend *be, const qm_e2e_spec *spec, qm_e2e_row *rows,
               void (*report)(const char *fmt, ...), qm_status *st);

#endif
