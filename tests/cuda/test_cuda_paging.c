/* test_cuda_paging.c - the paging authority (engine/pager/qm_pager*) on the CUDA
 * backend: whole banks and expert units copied into a device arena through
 * copy_h2d and fences, outputs bitwise identical across policies, budgets and
 * prefetch on the same backend, within 1e-5 of the CPU backend, and the
 * budget held on every allocation.
 *
 * Reuses the paging suites' bank fixture and helpers (tests/paging/). Built
 * twice like test_cuda: on the device (exit 77 without one) and emulated. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "paging_helpers.h"
#include "qm_cuda_bench_e2e.h"
#include "qm_backend.h"
#include "qm_cuda.h"

static double rel_err(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return isfinite(num) ? sqrt(num / (den > 0 ? den : 1)) : INFINITY;
}

/* Runs every call of `set` through a pager on `be`, writing call i's output
 * to outs[i] (caller-allocated). Returns 1 when the budget is below the
 * plan's minimum (skipped), else 0. */
static int run_pager(const pf_bank *b, qm_backend *be, const char *policy, int has_budget,
                     uint64_t budget, int prefetch, const pg_set *set, float **outs)
{
    const qm_bank_config *cfg = qm_bank_get_config(b->bank);
    qm_policy pol = {0};
    new_policy(policy, b, set, &pol);
    qm_residency_plan *plan = make_plan(b, &pol, has_budget, budget);
    qm_pager_options o = {.prefetch = prefetch};
    qm_status st = {0};
    uint64_t min = 0;
    ck_assert_int_eq(qm_pager_min_budget(be, b->bank, plan, &o, &min, &st), 0);
    if (has_budget && budget < min) {
        qm_plan_free(plan);
        qm_policy_destroy(&pol);
        return 1;
    }
    g_budget = has_budget ? budget : UINT64_MAX;
    qm_pager *pg = NULL;
    int rc = qm_pager_new(be, b->bank, plan, &pol, &o, &pg, &st);
    ck_assert_msg(rc == 0, "%s budget %llu: %s", policy, (unsigned long long)budget, st.msg);
    qm_pager_set_alloc_hook(pg, budget_hook, NULL);
    uint64_t accesses = 0;
    for (size_t i = 0; i < set->n; i++) {
        const pg_call *c = &set->calls[i];
        for (size_t j = 0; j < (size_t)c->T * cfg->hidden; j++)
            outs[i][j] = NAN;
        qm_moe_call mc = {.layer = c->layer,
                          .dtype = QM_DTYPE_F32,
                          .hidden = c->x,
                          .n_tokens = c->T,
                          .logits = c->logits,
                          .output = outs[i]};
        qm_moe_stats ms = {0};
        rc = qm_pager_forward(pg, &mc, &ms, &st);
        ck_assert_msg(rc == 0, "%s call %zu: %s", policy, i, st.msg);
        accesses += c->n_uniq;
    }
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_le(s.resident_bytes, g_budget);
    ck_assert_uint_eq(s.budget_violations, 0);
    ck_assert_uint_eq(s.hits + s.misses + s.whole_bank_accesses, accesses);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    return 0;
}

static void check_bank(const pf_spec *sp, size_t n_calls)
{
#ifdef QM_TEST_EMULATED
    n_calls /= 2; /* emulated kernels are slow; CI runs this */
#endif
    pf_bank b;
    pf_bank_open(sp, &b);
    const qm_bank_config *cfg = qm_bank_get_config(b.bank);
    qm_backend *cpu = NULL, *cuda = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_cpu_new(1, &cpu, &st), 0);
    ck_assert_msg(qm_backend_cuda_new(0, &cuda, &st) == 0, "cuda: %s", st.msg);
    pg_set set;
    make_calls(&b, cpu, n_calls, 23, &set);
    float **ref = calloc(set.n, sizeof *ref), **out = calloc(set.n, sizeof *out);
    for (size_t i = 0; i < set.n; i++) {
        ref[i] = malloc(sizeof(float) * set.calls[i].T * cfg->hidden);
        out[i] = malloc(sizeof(float) * set.calls[i].T * cfg->hidden);
    }
    /* The CUDA whole-bank run is this backend's reference; it must agree
     * with the CPU backend's whole-bank outputs. */
    ck_assert_int_eq(run_pager(&b, cuda, "whole_bank", 0, 0, 0, &set, ref), 0);
    double worst = 0;
    for (size_t i = 0; i < set.n; i++) {
        double e = rel_err(ref[i], set.calls[i].ref, (size_t)set.calls[i].T * cfg->hidden);
        if (!(e <= worst)) worst = e;
    }
    printf("paging E%u H%u I%u bits%u: cuda whole_bank vs cpu rel err %.3g\n", cfg->experts,
           cfg->hidden, cfg->inter, cfg->bits, worst);
    ck_assert_msg(worst <= 1e-5, "cuda vs cpu: %.3g", worst);

    uint64_t U = unit_bytes(&b), total = (uint64_t)cfg->layers * cfg->experts * U;
    const uint64_t budgets[] = {U, 2 * U, cfg->k * U, total / 4, total / 2, total};
    const char *policies[] = {"lru", "lfu", "static_hot", "belady"};
    int ran = 0;
    for (size_t p = 0; p < 4; p++)
        for (size_t bi = 0; bi < 6; bi++)
            for (int pf = 0; pf < 2; pf++) {
                if (run_pager(&b, cuda, policies[p], 1, budgets[bi], pf, &set, out)) continue;
                ran++;
                for (size_t i = 0; i < set.n; i++)
                    ck_assert_msg(
                        memcmp(out[i], ref[i], sizeof(float) * set.calls[i].T * cfg->hidden) == 0,
                        "%s budget %llu prefetch %d: call %zu (layer %u) differs from "
                        "whole_bank on cuda",
                        policies[p], (unsigned long long)budgets[bi], pf, i, set.calls[i].layer);
            }
    printf("paging: %d policy x budget x prefetch runs bitwise equal to whole_bank\n", ran);
    ck_assert_int_ge(ran, 4 * 4 * 2);
    qm_cuda_stats cs;
    ck_assert_int_eq(qm_backend_cuda_stats(cuda, &cs), 0);
    ck_assert_uint_gt(cs.copies, 0);
    for (size_t i = 0; i < set.n; i++) {
        free(ref[i]);
        free(out[i]);
    }
    free(ref);
    free(out);
    free_calls(&set);
    qm_backend_free(cpu);
    qm_backend_free(cuda);
    pf_bank_close(&b);
}

START_TEST(test_cuda_pager_outputs_bitwise_equal_across_policies_and_budgets)
{
    pf_spec sp = pf_default_spec();
    check_bank(&sp, 24);
}
END_TEST

START_TEST(test_cuda_pager_int8_wider_layer)
{
    pf_spec sp = pf_default_spec();
    sp.bits = 8;
    sp.hidden = 64;
    sp.inter = 48;
    sp.seed = 19;
    check_bank(&sp, 18);
}
END_TEST

/* The bench's end-to-end measurement (qmoe-cuda-bench, bench/cuda/verify.sh)
 * at a size the emulation affords: a pager per budget driving this backend
 * through fresh routing (device routing, bf16 router) every layer call. */
START_TEST(test_cuda_e2e_pager_throughput_rows_are_consistent)
{
    qm_backend *cuda = NULL;
    qm_status st = {0};
    ck_assert_msg(qm_backend_cuda_new(0, &cuda, &st) == 0, "cuda: %s", st.msg);
    qm_e2e_spec sp = {.layers = 2, .experts = 8, .hidden = 64, .inter = 32, .k = 2,
                      .tokens = {1, 16}, .n_tokens = 2, .budget_pct = {100, 50, 25},
                      .n_budgets = 3, .seconds = 0, .min_steps = 4, .max_steps = 4,
                      .prefetch = 1};
    qm_e2e_row rows[6];
    qm_cuda_stats c0, c1;
    ck_assert_int_eq(qm_backend_cuda_stats(cuda, &c0), 0);
    int rc = qm_e2e_run(cuda, &sp, rows, NULL, &st);
    ck_assert_msg(rc == 0, "e2e: %s", st.msg);
    ck_assert_int_eq(qm_backend_cuda_stats(cuda, &c1), 0);
    /* 3 budgets x (1 check call + 2 points x (warm-up + 4 steps) x 2 layers). */
    ck_assert_uint_eq(c1.routes - c0.routes, 3 * (1 + 2 * 5 * 2));
    for (int i = 0; i < 6; i++) {
        const qm_e2e_row *r = &rows[i];
        printf("e2e budget %u%% T=%u: %.0f tok/s, %llu bytes paged, hits %llu misses %llu, "
               "bitwise %d\n",
               r->budget_pct, r->tokens, r->tokens_per_s, (unsigned long long)r->bytes_paged,
               (unsigned long long)r->hits, (unsigned long long)r->misses,
               r->bitwise_equal_to_full);
        ck_assert_uint_eq(r->steps, 4);
        ck_assert(r->tokens_per_s > 0);
        ck_assert(r->bitwise_equal_to_full);
        if (r->budget_pct == 100) {
            ck_assert_uint_eq(r->bytes_paged, 0); /* everything resident from creation */
            ck_assert_uint_eq(r->misses, 0);
        }
        if (r->budget_pct == 25) {
            ck_assert_uint_gt(r->misses, 0);
            ck_assert_uint_gt(r->bytes_paged, 0);
        }
    }
    qm_backend_free(cuda);
}
END_TEST

int main(void)
{
    qm_backend *probe = NULL;
    qm_status st = {0};
    int rc = qm_backend_cuda_new(0, &probe, &st);
    if (rc == QM_EDEVICE) {
        printf("SKIP cuda paging suite: %s\n", st.msg);
        return 77;
    }
    if (rc != 0) {
        printf("cuda backend creation failed: %s (%s)\n", st.msg, qm_err_name(rc));
        return 1;
    }
    qm_backend_free(probe);
    Suite *s = suite_create("cuda_paging");
    TCase *tc = tcase_create("pager");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_cuda_pager_outputs_bitwise_equal_across_policies_and_budgets);
    tcase_add_test(tc, test_cuda_pager_int8_wider_layer);
    suite_add_tcase(s, tc);
    TCase *e2e = tcase_create("e2e");
    tcase_set_timeout(e2e, 300);
    tcase_add_test(e2e, test_cuda_e2e_pager_throughput_rows_are_consistent);
    suite_add_tcase(s, e2e);
    SRunner *sr = srunner_create(s);
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? 0 : 1;
}
