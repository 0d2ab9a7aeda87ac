/* test_hybrid.c - hybrid execution (engine/pager/qm_hybrid.c, policy_params.on_miss):
 * outputs bitwise equal to the CPU backend's whole-bank reference whatever
 * runs where (fake non-host-visible device and CPU backend, policies x
 * budgets x prefetch), the counters (hits + paged + host = accesses), host
 * never copying on demand, auto's measured model and its choice at both
 * ends of the copy cost, admission into free slots, the budget held. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "paging_helpers.h"
#include "qm_alloc.h"
#include "qm_placement.h"

typedef struct hy_case {
    qm_backend *be;
    const char *policy;
    uint64_t budget;
    int prefetch, on_miss;
} hy_case;

/* Runs set through a pager made for `c`; every output bitwise equal to the
 * reference. Returns 1 when the budget is below the plan's minimum. */
static int run_hybrid(const pf_bank *b, const hy_case *c, const pg_set *set, qm_pager_stats *out)
{
    const qm_bank_config *cfg = qm_bank_get_config(b->bank);
    qm_policy pol = {0};
    new_policy(c->policy, b, set, &pol);
    qm_residency_plan *plan = make_plan(b, &pol, 1, c->budget);
    qm_pager_options o = {.prefetch = c->prefetch, .on_miss = c->on_miss, .host_threads = 1,
                          .no_preload = 1};
    qm_status st = {0};
    uint64_t min = 0;
    ck_assert_int_eq(qm_pager_min_budget(c->be, b->bank, plan, &o, &min, &st), 0);
    if (c->budget < min) {
        qm_plan_free(plan);
        qm_policy_destroy(&pol);
        return 1;
    }
    g_budget = c->budget;
    qm_pager *pg = NULL;
    int rc = qm_pager_new(c->be, b->bank, plan, &pol, &o, &pg, &st);
    ck_assert_msg(rc == 0, "%s on_miss %d: %s", c->policy, c->on_miss, st.msg);
    qm_pager_set_alloc_hook(pg, budget_hook, NULL);
    qm_pager_stats s0;
    qm_pager_stats_get(pg, &s0);
    uint64_t accesses = 0, host_experts = 0;
    float out_buf[8 * 256];
    for (size_t i = 0; i < set->n; i++) {
        const pg_call *k = &set->calls[i];
        ck_assert_uint_le(k->T * cfg->hidden, 8 * 256);
        memset(out_buf, 0x7f, sizeof(float) * k->T * cfg->hidden);
        qm_moe_call mc = {.layer = k->layer, .dtype = QM_DTYPE_F32, .hidden = k->x,
                          .n_tokens = k->T, .logits = k->logits, .output = out_buf};
        qm_moe_stats ms = {0};
        rc = qm_pager_forward(pg, &mc, &ms, &st);
        ck_assert_msg(rc == 0, "%s call %zu: %s", c->policy, i, st.msg);
        ck_assert_msg(memcmp(out_buf, k->ref, sizeof(float) * k->T * cfg->hidden) == 0,
                      "%s budget %llu prefetch %d on_miss %d: call %zu differs", c->policy,
                      (unsigned long long)c->budget, c->prefetch, c->on_miss, i);
        ck_assert_uint_eq(ms.host_experts + ms.device_experts, k->n_uniq);
        accesses += k->n_uniq;
        host_experts += ms.host_experts;
    }
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.hits + s.misses + s.host_runs + s.whole_bank_accesses, accesses);
    ck_assert_uint_eq(s.host_runs, host_experts);
    ck_assert_uint_le(s.resident_bytes, c->budget);
    ck_assert_uint_eq(s.budget_violations, 0);
    if (c->on_miss == QM_ON_MISS_HOST)
        ck_assert_uint_eq(s.misses, 0); /* never a demand copy */
    if (c->on_miss == QM_ON_MISS_PAGE)
        ck_assert_uint_eq(s.host_runs, 0);
    if (out)
        *out = s;
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    return 0;
}

START_TEST(test_hybrid_outputs_bitwise_equal_reference_everywhere)
{
    const pf_spec *sp = &fixture.spec;
    qm_backend *dev = NULL;
    ck_assert_int_eq(pf_fake_device_new(&dev), 0);
    pg_set set;
    make_calls(&fixture.bank, fixture.cpu, 24, 21, &set);
    uint64_t U = unit_bytes(&fixture.bank), total = (uint64_t)sp->layers * sp->experts * U;
    const uint64_t budgets[] = {U, sp->k * U, total / 4, total / 2};
    const char *policies[] = {"lru", "lfu", "static_hot", "belady"};
    qm_backend *bes[] = {dev, fixture.cpu};
    int ran = 0;
    for (int om = QM_ON_MISS_HOST; om <= QM_ON_MISS_AUTO; om++)
        for (size_t be = 0; be < 2; be++)
            for (size_t p = 0; p < 4; p++)
                for (size_t bi = 0; bi < 4; bi++)
                    for (int pf = 0; pf < 2; pf++) {
                        hy_case c = {bes[be], policies[p], budgets[bi], pf, om};
                        ran += !run_hybrid(&fixture.bank, &c, &set, NULL);
                    }
    ck_assert_int_ge(ran, 2 * 2 * 4 * 3 * 2);
    free_calls(&set);
    qm_backend_free(dev);
}
END_TEST

START_TEST(test_host_runs_every_miss_on_host_and_copies_nothing)
{
    const pf_spec *sp = &fixture.spec;
    qm_backend *dev = NULL;
    ck_assert_int_eq(pf_fake_device_new(&dev), 0);
    pg_set set;
    make_calls(&fixture.bank, fixture.cpu, 12, 5, &set);
    qm_pager_stats s;
    hy_case c = {dev, "lru", sp->k * unit_bytes(&fixture.bank), 0, QM_ON_MISS_HOST};
    ck_assert_int_eq(run_hybrid(&fixture.bank, &c, &set, &s), 0);
    ck_assert_uint_eq(s.bytes_paged_h2d, 0);
    ck_assert_uint_eq(s.hits, 0); /* nothing preloaded, nothing paged */
    ck_assert_uint_gt(s.host_runs, 0);
    ck_assert_uint_eq(s.host_admits, 0);
    ck_assert_uint_eq(s.resident_bytes, 0);
    free_calls(&set);
    qm_backend_free(dev);
}
END_TEST

/* auto at both ends of the copy cost: a copy that takes ages sends every
 * miss to the host (after the calibration's one unit); a device twice the
 * host's threads with free copies... still must stay bitwise. */
START_TEST(test_auto_sends_misses_to_host_when_copies_are_slow)
{
    const pf_spec *sp = &fixture.spec;
    qm_backend *dev = NULL;
    pf_dev_model m = {.threads = 1, .gbps = 0.001, .latency_us = 2000}; /* ~ms per unit */
    ck_assert_int_eq(pf_fake_device_new_model(&m, &dev), 0);
    pg_set set;
    make_calls(&fixture.bank, fixture.cpu, 12, 9, &set);
    qm_pager_stats s;
    uint64_t U = unit_bytes(&fixture.bank);
    hy_case c = {dev, "lru", (uint64_t)sp->layers * sp->experts * U / 2, 0, QM_ON_MISS_AUTO};
    ck_assert_int_eq(run_hybrid(&fixture.bank, &c, &set, &s), 0);
    ck_assert_uint_eq(s.misses, 0);
    ck_assert_uint_gt(s.host_runs, 0);
    ck_assert(s.model_copy_us > 1000.0);
    ck_assert(s.model_host_us > 0.0);
    /* Free room is admitted after the calls (plus the calibration's unit). */
    ck_assert_uint_gt(s.host_admits, 0);
    ck_assert_uint_eq(s.bytes_paged_h2d, s.host_admits * U);
    free_calls(&set);
    qm_backend_free(dev);
}
END_TEST

START_TEST(test_auto_pages_when_the_model_says_copies_are_cheap)
{
    /* A CPU backend: the "copy" is a memcpy, the device is the host. With
     * free slots admitted and hits served, auto reaches hits; outputs are
     * bitwise (run_hybrid) and the model is published. */
    const pf_spec *sp = &fixture.spec;
    pg_set set;
    make_calls(&fixture.bank, fixture.cpu, 24, 13, &set);
    qm_pager_stats s;
    uint64_t U = unit_bytes(&fixture.bank);
    hy_case c = {fixture.cpu, "lru", (uint64_t)sp->layers * sp->experts * U, 1,
                 QM_ON_MISS_AUTO};
    ck_assert_int_eq(run_hybrid(&fixture.bank, &c, &set, &s), 0);
    ck_assert_uint_gt(s.hits, 0);
    ck_assert(s.model_copy_us > 0.0);
    ck_assert(s.model_dev_us > 0.0);
    free_calls(&set);
}
END_TEST

START_TEST(test_on_miss_names_round_trip_and_bad_value_refused)
{
    for (int i = QM_ON_MISS_PAGE; i <= QM_ON_MISS_AUTO; i++)
        ck_assert_int_eq(qm_on_miss_parse(qm_on_miss_name(i)), i);
    ck_assert_int_eq(qm_on_miss_parse("gpu"), -1);
    ck_assert_int_eq(qm_on_miss_parse(NULL), -1);
    ck_assert_ptr_null(qm_on_miss_name(3));
    qm_policy pol = {0};
    ck_assert_int_eq(qm_policy_new("lru", NULL, &pol, &fixture.st), 0);
    qm_residency_plan *plan = make_plan(&fixture.bank, &pol, 1, 4 * unit_bytes(&fixture.bank));
    qm_pager_options o = {.on_miss = 7};
    qm_pager *pg = NULL;
    ck_assert_int_eq(qm_pager_new(fixture.cpu, fixture.bank.bank, plan, &pol, &o, &pg,
                                  &fixture.st),
                     QM_EINVAL);
    ck_assert_ptr_null(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
}
END_TEST

/* ---- Allocation failures ------------------------------------------------------------ */

static unsigned long g_alloc_n, g_fail_at;
static int g_failed;
static void *fail_malloc(size_t n, void *ud)
{
    (void)ud;
    if (++g_alloc_n == g_fail_at) {
        g_failed = 1;
        return NULL;
    }
    return malloc(n);
}
static void *fail_realloc(void *p, size_t n, void *ud)
{
    (void)ud;
    if (++g_alloc_n == g_fail_at) {
        g_failed = 1;
        return NULL;
    }
    return realloc(p, n);
}
static void fail_free(void *p, void *ud)
{
    (void)ud;
    free(p);
}
static const qm_alloc_hooks fail_hooks = {fail_malloc, fail_realloc, fail_free, NULL};

/* One session on two fake devices with on_miss auto (calibration, host runs,
 * admissions, a pager per device), a few calls; the Nth allocation fails.
 * Returns 1 when nothing failed (N past the last allocation). */
static int run_failing(const pg_set *set, unsigned long fail_at)
{
    const pf_bank *b = &fixture.bank;
    qm_backend *dev[2] = {NULL, NULL};
    ck_assert_int_eq(pf_fake_device_new(&dev[0]), 0);
    ck_assert_int_eq(pf_fake_device_new(&dev[1]), 0);
    qm_policy pol = {0};
    new_policy("lru", b, set, &pol);
    uint64_t total = qm_bank_expert_bytes_total(b->bank);
    qm_residency_plan *plan = make_plan(b, &pol, 1, total / 2);
    qm_status st = {0};
    qm_placement pl = {0};
    qm_multipager *mp = NULL;
    qm_pager_options o = {.on_miss = QM_ON_MISS_AUTO, .host_backend = fixture.cpu,
                          .no_preload = 1, .prefetch = 1};
    g_alloc_n = 0;
    g_fail_at = fail_at;
    g_failed = 0;
    qm_alloc_set_hooks(&fail_hooks);
    int rc = qm_placement_make(b->bank, 2, NULL, total / 2, &pl, &st);
    if (rc == 0)
        rc = qm_multipager_new(dev, b->bank, plan, &pol, &o, &pl, &mp, &st);
    const uint32_t H = qm_bank_get_config(b->bank)->hidden;
    float out[8 * 64];
    ck_assert_uint_le(H, 64);
    for (size_t i = 0; rc == 0 && i < 6; i++) {
        const pg_call *c = &set->calls[i];
        qm_moe_call mc = {.layer = c->layer, .dtype = QM_DTYPE_F32, .hidden = c->x,
                          .n_tokens = c->T, .logits = c->logits, .output = out};
        rc = qm_multipager_forward(mp, &mc, NULL, &st);
        if (rc == 0)
            ck_assert_msg(memcmp(out, c->ref, sizeof(float) * c->T * H) == 0, "call %zu differs",
                          i);
    }
    qm_alloc_set_hooks(NULL);
    if (rc)
        ck_assert_msg(g_failed && rc == QM_ENOMEM, "fail at %lu: rc %d (%s)", fail_at, rc,
                      st.msg);
    int clean = !g_failed;
    free_two_devices(mp, &pl, plan, &pol, dev);
    return clean;
}

START_TEST(test_every_allocation_failure_is_enomem_and_leaks_nothing)
{
    pg_set set;
    make_calls(&fixture.bank, fixture.cpu, 6, 41, &set);
    unsigned long n = 1;
    while (!run_failing(&set, n))
        n++;
    ck_assert_uint_gt(n, 10); /* it did walk through the allocations */
    free_calls(&set);
}
END_TEST

static Suite *hybrid_suite(void)
{
    Suite *s = suite_create("paging_hybrid");
    TCase *tc = tcase_create("hybrid");
    tcase_add_checked_fixture(tc, pg_fixture_setup, pg_fixture_teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_hybrid_outputs_bitwise_equal_reference_everywhere);
    tcase_add_test(tc, test_host_runs_every_miss_on_host_and_copies_nothing);
    tcase_add_test(tc, test_auto_sends_misses_to_host_when_copies_are_slow);
    tcase_add_test(tc, test_auto_pages_when_the_model_says_copies_are_cheap);
    tcase_add_test(tc, test_on_miss_names_round_trip_and_bad_value_refused);
    tcase_add_test(tc, test_every_allocation_failure_is_enomem_and_leaks_nothing);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(hybrid_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
