/* paging_e2e.c - decode through the paging authority on the CPU backend with
 * real copies, against the whole bank read in place (no pager), side by side.
 *
 *   paging_e2e --bank FILE [--calls N] [--reps R] [--alpha A] [--locality P]
 *              [--threads T] [--seed S] [--routing trace|router] [--drift D]
 *              [--configs 1,2,...]   (rows of the table to run besides row 0)
 *
 * Each "call" is one layer of one decode token (T = 1), layers cycled in
 * order. --routing trace (default): routing from a synthetic trace
 * (bench/policy_sim's model, Zipf alpha + locality), hidden states drawn
 * fresh per call, so router-based prediction has nothing to go on.
 * --routing router: the bank's own routers route (the bank needs them) and
 * the hidden state is a residual stream, x_{l+1} = x_l + D * noise, fresh
 * per token: the setting next-layer router prediction is meant for. Configurations run alternately, R
 * times; the first 10% of each run is warm-up and not timed. Outputs are
 * checked bitwise against the whole-bank run. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../bench_pager.h"
#include "../bench_util.h"
#include "qm_moe.h"
#include "qm_pager.h"
#include "qm_residency.h"
#include "sim.h"

typedef struct cfg_t {
    const char *policy; /* NULL: no pager (whole bank in place) */
    double frac;        /* budget as a share of all expert bytes; 0 = none */
    int prefetch;
} cfg_t;

typedef struct run_out {
    double secs;
    qm_pager_stats st;
} run_out;

/* Runs `calls` layer calls; returns 0 and the timed seconds. */
static int g_router_routing;
static double g_drift = 0.3;

static int run(qm_backend *be, const qm_bank *bank, const cfg_t *c, const sim_trace *tr,
               uint32_t calls, uint64_t seed, float *outs, int check, run_out *ro)
{
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    qm_status st = {0};
    qm_policy pol = {0};
    qm_residency_plan *plan = NULL;
    qm_pager *pg = NULL;
    int rc = -1;
    memset(ro, 0, sizeof *ro);
    if (c->policy) {
        qm_pager_options o = {.prefetch = c->prefetch};
        if ((rc = bench_pager_new(be, bank, c->policy, c->frac, &o, &pol, &plan, &pg, &st)))
            goto out;
    }
    qm_expert_source direct;
    qm_expert_source_direct(bank, &direct);
    float *x = malloc(sizeof(float) * cfg->hidden), *logits = malloc(sizeof(float) * cfg->experts);
    float *y = malloc(sizeof(float) * cfg->hidden);
    uint64_t s = seed;
    uint32_t warm = calls / 10;
    double t0 = 0;
    rc = 0;
    for (uint32_t i = 0; i < calls && rc == 0; i++) {
        if (i == warm) {
            if (pg)
                qm_pager_stats_get(pg, &ro->st); /* baseline, subtracted below */
            t0 = now_s();
        }
        uint32_t t = i / tr->layers, l = i % tr->layers;
        double amp = g_router_routing && l > 0 ? g_drift : 1.0;
        for (uint32_t h = 0; h < cfg->hidden; h++) {
            float noise = (float)((rng_next(&s) >> 40) * (2.0 / 16777216.0) - 1.0);
            x[h] = g_router_routing && l > 0 ? x[h] + (float)amp * noise : noise;
        }
        for (uint32_t e = 0; e < cfg->experts; e++)
            logits[e] = -30.0f;
        const int16_t *row = tr->ids + ((size_t)t * tr->layers + l) * tr->k;
        for (uint32_t j = 0; j < tr->k; j++)
            logits[row[j]] = 2.0f - 0.25f * (float)j;
        qm_moe_call mc = {.layer = l, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = 1,
                          .logits = g_router_routing ? NULL : logits, .output = y};
        qm_moe_stats ms = {0};
        rc = pg ? qm_pager_forward(pg, &mc, &ms, &st)
                : qm_moe_forward(be, bank, &mc, &direct, &ms, &st);
        if (outs && !check)
            memcpy(outs + (size_t)i * cfg->hidden, y, sizeof(float) * cfg->hidden);
        if (outs && check && memcmp(outs + (size_t)i * cfg->hidden, y, sizeof(float) * cfg->hidden)) {
            fprintf(stderr, "paging_e2e: call %u differs from the whole-bank output\n", i);
            rc = -1;
        }
    }
    ro->secs = now_s() - t0;
    if (pg) {
        qm_pager_stats a;
        qm_pager_stats_get(pg, &a);
        a.hits -= ro->st.hits;
        a.misses -= ro->st.misses;
        a.bytes_paged_h2d -= ro->st.bytes_paged_h2d;
        a.prefetch_issued -= ro->st.prefetch_issued;
        a.prefetch_useful -= ro->st.prefetch_useful;
        a.evictions -= ro->st.evictions;
        a.prefetch_router_issued -= ro->st.prefetch_router_issued;
        a.prefetch_router_useful -= ro->st.prefetch_router_useful;
        a.prefetch_history_issued -= ro->st.prefetch_history_issued;
        a.prefetch_history_useful -= ro->st.prefetch_history_useful;
        a.prefetch_gated -= ro->st.prefetch_gated;
        ro->st = a;
    }
    free(x);
    free(logits);
    free(y);
out:
    if (rc)
        fprintf(stderr, "paging_e2e: %s: %s\n", c->policy ? c->policy : "whole", st.msg);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    return rc;
}

/* Each prediction source measured against the call it was about, over the
 * whole run (warm-up included; resident or not): precision, recall, and the
 * calls its gate held it off. */
static void predict_table(const cfg_t *cfgs, const run_out *last, int n)
{
    printf("\n| session | budget | prefetch | router precision / recall, gated calls | history "
           "precision / recall, gated | lookahead (layer + 2) precision / recall, gated, "
           "prefetched |\n|---|---|---|---|---|---|\n");
    for (int c = 0; c < n; c++) {
        const qm_pager_stats *p = &last[c].st;
        if (!cfgs[c].policy || !cfgs[c].prefetch)
            continue;
        double q[6] = {(double)p->predict_router_predicted, (double)p->predict_router_actual,
                       (double)p->predict_history_predicted, (double)p->predict_history_actual,
                       (double)p->predict_lookahead_predicted,
                       (double)p->predict_lookahead_actual};
        double hit[3] = {(double)p->predict_router_correct, (double)p->predict_history_correct,
                         (double)p->predict_lookahead_correct};
        char cell[3][64];
        for (int s = 0; s < 3; s++)
            snprintf(cell[s], sizeof cell[s], "%.2f / %.2f", q[2 * s] ? hit[s] / q[2 * s] : 0.0,
                     q[2 * s + 1] ? hit[s] / q[2 * s + 1] : 0.0);
        printf("| %s | %.0f%% | on | %s, %llu | %s, %llu | %s, %llu, %llu |\n", cfgs[c].policy,
               100 * cfgs[c].frac, cell[0], (unsigned long long)p->predict_router_gated, cell[1],
               (unsigned long long)p->predict_history_gated, cell[2],
               (unsigned long long)p->predict_lookahead_gated,
               (unsigned long long)p->prefetch_lookahead_issued);
    }
}

int main(int argc, char **argv)
{
    const char *path = NULL;
    uint32_t calls = 2400, reps = 3, threads = 1;
    double alpha = 1.0, locality = 0.3;
    const char *only = NULL; /* --configs 0,1,2: a subset of the table's rows */
    uint64_t seed = 1;
    const bench_arg args[] = {
        {"--bank", BENCH_ARG_STR, &path},       {"--calls", BENCH_ARG_U32, &calls},
        {"--reps", BENCH_ARG_U32, &reps},       {"--threads", BENCH_ARG_U32, &threads},
        {"--alpha", BENCH_ARG_DBL, &alpha},     {"--locality", BENCH_ARG_DBL, &locality},
        {"--configs", BENCH_ARG_STR, &only},    {"--drift", BENCH_ARG_DBL, &g_drift},
        {"--seed", BENCH_ARG_U64, &seed},
    };
    for (int i = 1; i + 1 < argc; i += 2) {
        if (bench_arg_set(args, sizeof args / sizeof *args, argv[i], argv[i + 1]))
            continue;
        if (!strcmp(argv[i], "--routing"))
            g_router_routing = !strcmp(argv[i + 1], "router");
    }
    if (!path || reps == 0 || reps > 64 || calls < 20) {
        fprintf(stderr, "usage: paging_e2e --bank FILE [--calls N>=20] [--reps 1..64] [--alpha A] "
                        "[--locality P] [--threads T] [--seed S] [--routing trace|router] "
                        "[--drift D]\n");
        return 2;
    }
    qm_bank *bank = NULL;
    qm_backend *be = NULL;
    const qm_bank_config *cfg = bench_open_cpu("paging_e2e", path, threads, &bank, &be);
    if (!cfg)
        return 1;
    uint32_t tokens = (calls + cfg->layers - 1) / cfg->layers;
    sim_trace tr;
    if (sim_trace_generate(&tr, tokens, cfg->layers, cfg->experts, cfg->k, alpha, locality, seed))
        return 1;
    char route_desc[96];
    if (g_router_routing)
        snprintf(route_desc, sizeof route_desc,
                 "the bank's routers on a residual stream (drift %.2f per layer)", g_drift);
    else
        snprintf(route_desc, sizeof route_desc, "trace, Zipf alpha %.2f, locality %.2f", alpha,
                 locality);
    if (g_router_routing && !qm_bank_layer(bank, 0)->t[QM_T_ROUTER_WEIGHT].present) {
        fprintf(stderr, "paging_e2e: --routing router needs a bank with router weights\n");
        return 2;
    }
    qm_device_info di;
    qm_backend_info(be, &di);
    uint64_t total = qm_bank_expert_bytes_total(bank);
    printf("paging_e2e: %s; bank %s: %u layers x %u experts, %.1f MiB per expert, %.1f MiB of "
           "experts (working set); decode T=1, %u layer calls per run (10%% warm-up), %u reps "
           "alternating; routing: %s, seed %llu\n\n",
           di.name, path, cfg->layers, cfg->experts,
           qm_bank_layer(bank, 0)->bytes_per_expert / 1048576.0, total / 1048576.0, calls, reps,
           route_desc, (unsigned long long)seed);
    const cfg_t all[] = {{NULL, 0, 0},     {"lru", 0, 0},   {"lru", 0, 1},
                         {"lru", 0.5, 0},  {"lru", 0.5, 1}, {"lfu", 0.5, 1},
                         {"lru", 0.25, 0}, {"lru", 0.25, 1}};
    enum { N_ALL = sizeof all / sizeof all[0] };
    /* Row 0 (the whole bank in place) always runs: every ratio needs it. */
    cfg_t cfgs[N_ALL];
    int N = 0;
    cfgs[N++] = all[0];
    for (int c = 1; c < N_ALL; c++) {
        char key[8];
        snprintf(key, sizeof key, "%d", c);
        int want = !only;
        for (const char *q = only; q && *q;) {
            size_t len = strcspn(q, ",");
            if (len == strlen(key) && !strncmp(q, key, len))
                want = 1;
            q += len + (q[len] == ',');
        }
        if (want)
            cfgs[N++] = all[c];
    }
    float *ref = malloc(sizeof(float) * calls * cfg->hidden);
    double secs[N_ALL][64];
    run_out last[N_ALL];
    for (uint32_t r = 0; r < reps; r++)
        for (int c = 0; c < N; c++) {
            if (run(be, bank, &cfgs[c], &tr, calls, seed + r, r == 0 ? ref : NULL,
                    r == 0 && c > 0, &last[c]))
                return 1;
            secs[c][r] = last[c].secs;
        }
    printf("| session | budget | prefetch | layer calls/s median (min-max) | vs whole bank "
           "(median of per-rep ratios) | hit rate | GB paged | prefetch useful / issued: all "
           "(router, history), calls gated |\n"
           "|---|---|---|---|---|---|---|---|\n");
    uint32_t timed = calls - calls / 10;
    for (int c = 0; c < N; c++) {
        double s[64], ratio[64];
        for (uint32_t r = 0; r < reps; r++) {
            s[r] = secs[c][r];
            ratio[r] = secs[0][r] / secs[c][r];
        }
        qsort(s, reps, sizeof *s, cmp_double);
        qsort(ratio, reps, sizeof *ratio, cmp_double);
        const qm_pager_stats *p = &last[c].st;
        char budget[32];
        if (!cfgs[c].policy)
            snprintf(budget, sizeof budget, "-");
        else if (cfgs[c].frac > 0)
            snprintf(budget, sizeof budget, "%.0f%%", 100 * cfgs[c].frac);
        else
            snprintf(budget, sizeof budget, "100%% (none)");
        double acc = (double)(p->hits + p->misses);
        char hit[32] = "-";
        if (cfgs[c].policy && acc > 0)
            snprintf(hit, sizeof hit, "%.1f%%", 100.0 * (double)p->hits / acc);
        printf("| %s | %s | %s | %.0f (%.0f-%.0f) | %.3f | %s | %.2f | %llu / %llu (%llu / %llu, "
               "%llu / %llu), %llu |\n",
               cfgs[c].policy ? cfgs[c].policy : "whole bank, no pager", budget,
               cfgs[c].policy ? (cfgs[c].prefetch ? "on" : "off") : "-",
               timed / s[reps / 2], timed / s[reps - 1], timed / s[0], ratio[reps / 2], hit,
               p->bytes_paged_h2d / 1e9, (unsigned long long)p->prefetch_useful,
               (unsigned long long)p->prefetch_issued,
               (unsigned long long)p->prefetch_router_useful,
               (unsigned long long)p->prefetch_router_issued,
               (unsigned long long)p->prefetch_history_useful,
               (unsigned long long)p->prefetch_history_issued,
               (unsigned long long)p->prefetch_gated);
    }
    predict_table(cfgs, last, N);
    free(ref);
    sim_trace_free(&tr);
    qm_backend_free(be);
    qm_bank_close(bank);
    return 0;
}
