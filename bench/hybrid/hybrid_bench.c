/* hybrid_bench.c - hybrid execution vs paging (issue 18, "Benchmarks on
 * this machine"): on_miss page, host and auto through the paging authority
 * on an emulated device whose copies cost a modelled PCIe link.
 *
 *   hybrid_bench --bank FILE [--gbps 25] [--latency-us 10] [--dev-threads 2]
 *                [--host-threads 1] [--reps 3] [--tokens 1,16,512]
 *                [--budgets 25,50] [--calls-1 N] [--alpha 1.0] [--seed S]
 *                [--host-slowdown F]
 *
 * The device (tests/paging/pf_fake_device.c): not host visible, its own
 * arena; a copy of B bytes lands B / gbps + latency after it is issued or
 * after the copy before it lands (one in-order stream), enforced by sleeping
 * in the fence wait; it computes with the CPU kernels on --dev-threads
 * workers. The host runs misses with the same kernels on --host-threads
 * workers, then sleeps (F - 1) times their time: a host F times slower than
 * the device (tests/paging/pf_fake_device.c pf_slow_host_new). Policy lru,
 * prefetch off (the comparison is of the answer to a miss), no preload.
 *
 * Each cell: the same calls (layers cycled; T tokens per call, routed by
 * logits with a Zipf skew over experts, fresh per call) through a fresh
 * pager per mode, modes alternating per rep; the first pass over the layers
 * is warm-up. Outputs of every mode are checked bitwise against the first
 * mode's (the CPU kernels everywhere, so they must agree). Reported: median
 * seconds per layer call, and auto against the better fixed rule. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../bench_pager.h"
#include "../bench_util.h"
#include "pf_fake_device.h"
#include "qm_moe.h"
#include "qm_pager.h"
#include "qm_residency.h"

typedef struct calls_t {
    uint32_t n, T, H, E;
    float *x, *logits; /* [n][T][H], [n][T][E] */
    float *ref;        /* [n][T][H] first mode's outputs */
    int have_ref;
} calls_t;

static void make_calls(const qm_bank_config *cfg, uint32_t n, uint32_t T, double alpha,
                       uint64_t seed, calls_t *c)
{
    c->n = n;
    c->T = T;
    c->H = cfg->hidden;
    c->E = cfg->experts;
    c->x = malloc(sizeof(float) * n * T * c->H);
    c->logits = malloc(sizeof(float) * n * T * c->E);
    c->ref = malloc(sizeof(float) * n * T * c->H);
    c->have_ref = 0;
    uint64_t s = seed;
    for (size_t i = 0; i < (size_t)n * T * c->H; i++)
        c->x[i] = (float)(2 * rng_unif01(&s) - 1);
    /* Zipf-like popularity per layer: expert e's logit bias -alpha*log(1+rank),
     * ranks permuted per layer; Gumbel noise per token picks the top-k. */
    for (uint32_t i = 0; i < n; i++) {
        uint32_t layer = i % cfg->layers;
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t e = 0; e < c->E; e++) {
                uint32_t rank = (e * 7 + layer * 5) % c->E;
                double g = -log(-log(rng_unif01(&s) * 0.999998 + 0.000001));
                c->logits[((size_t)i * T + t) * c->E + e] =
                    (float)(-alpha * log(1.0 + rank) + g);
            }
    }
}

static void free_calls(calls_t *c)
{
    free(c->x);
    free(c->logits);
    free(c->ref);
}

typedef struct result_t {
    double secs_per_call;
    qm_pager_stats st;
} result_t;

static int run_mode(qm_backend *dev, const qm_bank *bank, int on_miss, qm_backend *host,
                    double frac, calls_t *c, result_t *out)
{
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    qm_status st = {0};
    qm_policy pol = {0};
    qm_residency_plan *plan = NULL;
    qm_pager *pg = NULL;
    qm_pager_options o = {.on_miss = on_miss, .host_backend = host, .no_preload = 1};
    int rc = bench_pager_new(dev, bank, "lru", frac, &o, &pol, &plan, &pg, &st);
    float *y = malloc(sizeof(float) * c->T * c->H);
    double t0 = 0;
    const uint32_t warm = cfg->layers;
    for (uint32_t i = 0; rc == 0 && i < c->n; i++) {
        if (i == warm)
            t0 = now_s();
        qm_moe_call mc = {.layer = i % cfg->layers, .dtype = QM_DTYPE_F32,
                          .hidden = c->x + (size_t)i * c->T * c->H, .n_tokens = c->T,
                          .logits = c->logits + (size_t)i * c->T * c->E, .output = y};
        rc = qm_pager_forward(pg, &mc, NULL, &st);
        float *ref = c->ref + (size_t)i * c->T * c->H;
        if (rc == 0 && !c->have_ref)
            memcpy(ref, y, sizeof(float) * c->T * c->H);
        else if (rc == 0 && memcmp(ref, y, sizeof(float) * c->T * c->H)) {
            fprintf(stderr, "hybrid_bench: on_miss %s call %u differs\n", qm_on_miss_name(on_miss),
                    i);
            rc = -1;
        }
    }
    if (rc == 0) {
        c->have_ref = 1;
        out->secs_per_call = (now_s() - t0) / (double)(c->n - warm);
        qm_pager_stats_get(pg, &out->st);
    } else if (st.msg[0]) {
        fprintf(stderr, "hybrid_bench: %s\n", st.msg);
    }
    free(y);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    return rc;
}

static int parse_list(const char *s, uint32_t *out, int cap)
{
    int n = 0;
    for (const char *p = s; *p && n < cap;) {
        out[n++] = (uint32_t)strtoul(p, (char **)&p, 10);
        if (*p == ',')
            p++;
        else
            break;
    }
    return n;
}

int main(int argc, char **argv)
{
    const char *path = NULL;
    double gbps = 25, lat = 10, alpha = 1.0, slowdown = 1.0;
    uint32_t dev_threads = 1, host_threads = 1, reps = 3, calls1 = 400;
    uint32_t Ts[8] = {1, 16, 512}, budgets[8] = {25, 50};
    int nT = 3, nB = 2;
    uint64_t seed = 1;
    const bench_arg args[] = {
        {"--bank", BENCH_ARG_STR, &path},
        {"--gbps", BENCH_ARG_DBL, &gbps},
        {"--latency-us", BENCH_ARG_DBL, &lat},
        {"--dev-threads", BENCH_ARG_U32, &dev_threads},
        {"--host-threads", BENCH_ARG_U32, &host_threads},
        {"--reps", BENCH_ARG_U32, &reps},
        {"--calls-1", BENCH_ARG_U32, &calls1},
        {"--host-slowdown", BENCH_ARG_DBL, &slowdown},
        {"--alpha", BENCH_ARG_DBL, &alpha},
        {"--seed", BENCH_ARG_U64, &seed},
    };
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (bench_arg_set(args, sizeof args / sizeof *args, a, v))
            continue;
        if (!strcmp(a, "--tokens"))
            nT = parse_list(v, Ts, 8);
        else if (!strcmp(a, "--budgets"))
            nB = parse_list(v, budgets, 8);
    }
    if (!path || reps == 0 || reps > 31) {
        fprintf(stderr, "usage: hybrid_bench --bank FILE [--gbps G] [--latency-us L] "
                        "[--dev-threads N] [--host-threads N] [--reps 1..31] [--tokens 1,16,512] "
                        "[--budgets 25,50] [--calls-1 N] [--alpha A] [--seed S]\n");
        return 2;
    }
    qm_status st = {0};
    qm_bank *bank = NULL;
    qm_backend *dev = NULL, *host = NULL;
    if (qm_bank_open(path, &bank, &st)) {
        fprintf(stderr, "hybrid_bench: %s\n", st.msg);
        return 1;
    }
    pf_dev_model model = {.threads = dev_threads, .gbps = gbps, .latency_us = lat};
    if (pf_fake_device_new_model(&model, &dev) ||
        pf_slow_host_new(slowdown, host_threads, &host)) {
        fprintf(stderr, "hybrid_bench: no emulated device\n");
        return 1;
    }
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    uint64_t unit = qm_bank_layer(bank, 0)->bytes_per_expert;
    printf("hybrid_bench: bank %s: %u layers x %u experts (top-%u), hidden %u, %.2f MiB per expert; "
           "emulated device: copy = bytes / %.3g GB/s + %.0f us (%.0f us per expert), compute on %u "
           "CPU thread(s); host: the same kernels on %u thread(s), modelled %.1fx slower (sleep); lru, "
           "prefetch off; %u reps, median\n\n",
           path, cfg->layers, cfg->experts, cfg->k, cfg->hidden, (double)unit / 1048576.0, gbps,
           lat, (double)unit / (gbps * 1e3) + lat, dev_threads, host_threads, slowdown, reps);
    printf("| T | budget | page ms/call | host ms/call | auto ms/call | auto / best fixed | "
           "auto: hits / paged / on host per call |\n|---|---|---|---|---|---|---|\n");
    int worst_fail = 0;
    for (int ti = 0; ti < nT; ti++) {
        uint32_t T = Ts[ti];
        /* ~constant work per cell: fewer calls as T grows, at least 3 passes. */
        uint32_t n = calls1 / (T < 16 ? 1 : T / 8);
        if (n < 4 * cfg->layers)
            n = 4 * cfg->layers;
        for (int bi = 0; bi < nB; bi++) {
            calls_t c;
            make_calls(cfg, n, T, alpha, seed + T, &c);
            double secs[3][32];
            result_t last[3];
            for (uint32_t r = 0; r < reps; r++)
                for (int m = 0; m < 3; m++) {
                    int mode = (m + (int)r) % 3; /* rotate which mode runs first */
                    result_t res;
                    if (run_mode(dev, bank, mode, host, budgets[bi] / 100.0, &c, &res))
                        return 1;
                    secs[mode][r] = res.secs_per_call;
                    last[mode] = res;
                }
            double med[3];
            for (int m = 0; m < 3; m++) {
                qsort(secs[m], reps, sizeof(double), cmp_double);
                med[m] = secs[m][reps / 2];
            }
            double best = med[0] < med[1] ? med[0] : med[1];
            double ratio = med[2] / best;
            worst_fail |= ratio > 1.05;
            double calls = (double)(n - cfg->layers);
            const qm_pager_stats *a = &last[2].st;
            printf("| %u | %u%% | %.3f | %.3f | %.3f | %.3f | %.1f / %.1f / %.1f |\n", T,
                   budgets[bi], med[0] * 1e3, med[1] * 1e3, med[2] * 1e3, ratio,
                   (double)a->hits / (double)n, (double)a->misses / (double)n,
                   (double)a->host_runs / (double)n);
            (void)calls;
            if (getenv("HYBRID_BENCH_MODEL"))
                fprintf(stderr, "  auto model: copy %.0f us, host %.0f + %.1f/row us, device %.0f + "
                                "%.1f/row us\n",
                        a->model_copy_us, a->model_host_us - a->model_host_row_us,
                        a->model_host_row_us, a->model_dev_us - a->model_dev_row_us,
                        a->model_dev_row_us);
            free_calls(&c);
        }
    }
    printf("\nauto within 5%% of the better fixed rule everywhere: %s\n",
           worst_fail ? "no" : "yes");
    qm_backend_free(dev);
    qm_backend_free(host);
    qm_bank_close(bank);
    return 0;
}
