/* test_paging_resize.c - elastic budgets (qm_pager_resize): outputs bitwise
 * equal to whole_bank while the budget shrinks and grows between calls, for
 * every policy and copy path, resident bytes never above the budget in force
 * (checked on every allocation and after every resize), pins released
 * coldest first, the minimum refused with create's message shape, and
 * memory added by growth given back when the budget shrinks again; a
 * session over two emulated devices (qm_multipager_resize) resized the same
 * way, each device held to its share of every budget. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "paging_helpers.h"
#include "qm_placement.h"
#include "qm_test_policies.h"

enum { MODE_CPU_THREAD, MODE_CPU_DIRECT, MODE_FAKE_DEVICE, N_MODES };

static void resize_to(qm_pager *pg, uint64_t budget, const char *what)
{
    qm_status st = {0};
    /* No allocation happens inside a resize: the hook holds every later
     * one to the new budget. */
    g_budget = budget;
    int rc = qm_pager_resize(pg, budget, &st);
    ck_assert_msg(rc == 0, "%s: resize to %llu: %s", what, (unsigned long long)budget, st.msg);
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_le(s.resident_bytes, budget);
    ck_assert_uint_eq(s.budget_bytes, budget);
    ck_assert_uint_eq(s.budget_violations, 0);
}

START_TEST(test_outputs_bitwise_equal_while_the_budget_shrinks_and_grows)
{
    const pf_spec *sp = &fixture.spec;
    qm_backend *dev = NULL;
    ck_assert_int_eq(pf_fake_device_new(&dev), 0);
    pg_set set;
    make_calls(&fixture.bank, fixture.cpu, 30, 17, &set);
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    uint64_t U = unit_bytes(&fixture.bank), total = (uint64_t)sp->layers * sp->experts * U;
    /* From half the model: down to one unit, up past the creation size, and
     * back, so slots are given back, re-used and added by a new arena. */
    const uint64_t steps[] = {total / 4, U, total, 2 * U + U / 2, total / 2, 3 * U, total};
    const size_t n_steps = sizeof steps / sizeof steps[0];
    /* Every offered policy that pages (whole_bank cannot shrink below the model). */
    const char *policies[QM_TEST_MAX_POLICIES];
    const size_t n_policies = qm_test_policies(policies, 0, "whole_bank");
    ck_assert_uint_ge(n_policies, 6);
    float *out = malloc(sizeof(float) * 8 * cfg->hidden);
    for (size_t pi = 0; pi < n_policies; pi++)
        for (int pf = 0; pf < 2; pf++)
            for (int mode = 0; mode < N_MODES; mode++) {
                qm_policy pol = {0};
                new_policy(policies[pi], &fixture.bank, &set, &pol);
                qm_residency_plan *plan = make_plan(&fixture.bank, &pol, 1, total / 2);
                qm_pager_options o = {.prefetch = pf,
                                      .copy_thread = mode == MODE_CPU_DIRECT ? 2 : 0,
                                      .no_preload = 1};
                qm_pager *pg = NULL;
                qm_status st = {0};
                g_budget = total / 2;
                ck_assert_int_eq(qm_pager_new(mode == MODE_FAKE_DEVICE ? dev : fixture.cpu,
                                              fixture.bank.bank, plan, &pol, &o, &pg, &st),
                                 0);
                qm_pager_set_alloc_hook(pg, budget_hook, NULL);
                for (size_t i = 0; i < set.n; i++) {
                    if (i % 4 == 3)
                        resize_to(pg, steps[(i / 4) % n_steps], policies[pi]);
                    const pg_call *c = &set.calls[i];
                    qm_moe_call mc = {.layer = c->layer, .dtype = QM_DTYPE_F32, .hidden = c->x,
                                      .n_tokens = c->T, .logits = c->logits, .output = out};
                    qm_moe_stats ms = {0};
                    ck_assert_msg(qm_pager_forward(pg, &mc, &ms, &st) == 0, "%s call %zu: %s",
                                  policies[pi], i, st.msg);
                    ck_assert_msg(memcmp(out, c->ref, sizeof(float) * c->T * cfg->hidden) == 0,
                                  "%s prefetch %d mode %d: call %zu differs from whole_bank",
                                  policies[pi], pf, mode, i);
                }
                qm_pager_stats s;
                qm_pager_stats_get(pg, &s);
                ck_assert_uint_gt(s.resizes, 0);
                ck_assert_uint_eq(s.policy_fallbacks, 0);
                qm_pager_free(pg);
                qm_plan_free(plan);
                qm_policy_destroy(&pol);
            }
    free(out);
    free_calls(&set);
    qm_backend_free(dev);
}
END_TEST

START_TEST(test_shrinking_releases_the_coldest_pins_first_and_reports_them)
{
    pf_spec sp = pf_default_spec();
    sp.router = 0;
    pg_fixture_reopen(&sp);
    uint64_t U = unit_bytes(&fixture.bank);
    /* static_hot pins layer 0's hot list (0, 3, 6, ...) up to pin_fraction. */
    qm_policy_value v = {"pin_fraction", 1.0};
    qm_policy_params pp = {.version = QM_POLICY_PARAMS_VERSION, .values = &v, .n_values = 1};
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    uint32_t hot[2] = {2, 5};
    const uint32_t *hot_ptr[8] = {hot};
    size_t hot_len[8] = {2};
    pp.hot = hot_ptr;
    pp.hot_len = hot_len;
    pp.n_hot_banks = cfg->layers;
    ck_assert_int_eq(qm_policy_new("static_hot", &pp, &fixture.pol, &fixture.st), 0);
    fixture.plan = make_plan(&fixture.bank, &fixture.pol, 1, 6 * U);
    qm_pager_options o = {.no_preload = 1};
    ck_assert_int_eq(qm_pager_new(fixture.cpu, fixture.bank.bank, fixture.plan, &fixture.pol, &o,
                                  &fixture.pager, &fixture.st),
                     0);
    qm_pager *pg = fixture.pager;
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.n_pinned, 2);
    /* Touch 2 after 5: 5 is the colder pin. */
    uint64_t seed = 5;
    call_experts(pg, &fixture.bank, 0, &hot[1], 1, &seed);
    call_experts(pg, &fixture.bank, 0, &hot[0], 1, &seed);
    /* 2 pins + one unit = 3U: fits; 2U does not: one pin goes, the coldest. */
    resize_to(pg, 3 * U, "static_hot");
    uint32_t rel[4];
    ck_assert_int_eq(qm_pager_pins_released(pg, 0, rel, 4), 0);
    resize_to(pg, 2 * U, "static_hot");
    ck_assert_int_eq(qm_pager_pins_released(pg, 0, rel, 4), 1);
    ck_assert_uint_eq(rel[0], 5);
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.n_pinned, 1);
    ck_assert_uint_eq(s.pins_released, 1);
    resize_to(pg, U, "static_hot");
    ck_assert_int_eq(qm_pager_pins_released(pg, 0, rel, 4), 2);
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.n_pinned, 0);
    ck_assert_uint_le(s.resident_bytes, U);
    /* Released pins page like any expert: growing does not pin them again. */
    resize_to(pg, 8 * U, "static_hot");
    ck_assert_int_eq(qm_pager_pins_released(pg, 0, rel, 4), 2);
    call_experts(pg, &fixture.bank, 0, hot, 2, &seed);
    ck_assert_int_eq(qm_pager_pins_released(pg, 9, rel, 4), QM_EINVAL);
}
END_TEST

START_TEST(test_resize_below_the_minimum_is_refused_like_create)
{
    uint64_t U = unit_bytes(&fixture.bank);
    qm_pager *pg = pg_fixture_lru_pager(4 * U, 0);
    qm_status_clear(&fixture.st);
    ck_assert_int_eq(qm_pager_resize(pg, U - 1, &fixture.st), QM_ERESOURCE_EXHAUSTED);
    ck_assert_str_eq(fixture.st.field, "budget_bytes");
    char want[256];
    snprintf(want, sizeof want,
             "budget_bytes %llu is below the minimum of %llu bytes for this plan (whole banks 0 + "
             "pinned experts 0 + one expert unit %llu)",
             (unsigned long long)(U - 1), (unsigned long long)U, (unsigned long long)U);
    ck_assert_str_eq(fixture.st.msg, want);
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.budget_bytes, 4 * U); /* unchanged */
    ck_assert_uint_eq(s.resizes, 0);
    /* Exactly the minimum works; whole_bank's minimum is the whole model. */
    ck_assert_int_eq(qm_pager_resize(pg, U, &fixture.st), 0);
    qm_policy pol = {0};
    ck_assert_int_eq(qm_policy_new("whole_bank", NULL, &pol, &fixture.st), 0);
    uint64_t total = qm_bank_expert_bytes_total(fixture.bank.bank);
    qm_residency_plan *plan = make_plan(&fixture.bank, &pol, 1, total);
    qm_pager *wb = NULL;
    ck_assert_int_eq(
        qm_pager_new(fixture.cpu, fixture.bank.bank, plan, &pol, NULL, &wb, &fixture.st), 0);
    ck_assert_int_eq(qm_pager_resize(wb, total - 1, &fixture.st), QM_ERESOURCE_EXHAUSTED);
    ck_assert_int_eq(qm_pager_resize(wb, 2 * total, &fixture.st), 0);
    ck_assert_int_eq(qm_pager_resize(wb, total, &fixture.st), 0);
    ck_assert_int_eq(qm_pager_resize(NULL, total, &fixture.st), QM_EINVAL);
    qm_pager_free(wb);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
}
END_TEST

START_TEST(test_growth_adds_an_arena_and_shrinking_gives_it_back)
{
    const pf_spec *sp = &fixture.spec;
    uint64_t U = unit_bytes(&fixture.bank), total = (uint64_t)sp->layers * sp->experts * U;
    qm_pager *pg = pg_fixture_lru_pager(2 * U, 0);
    qm_pager_stats s0, s;
    qm_pager_stats_get(pg, &s0);
    ck_assert_uint_eq(s0.n_slots, 2);
    resize_to(pg, total, "lru");
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.n_slots, sp->layers * sp->experts);
    ck_assert_uint_gt(s.arena_bytes, s0.arena_bytes);
    /* Fill every slot, then shrink: survivors in the given-back slots move. */
    uint64_t seed = 9;
    for (uint32_t l = 0; l < sp->layers; l++)
        for (uint32_t e = 0; e < sp->experts; e++)
            call_experts(pg, &fixture.bank, l, &e, 1, &seed);
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.resident_bytes, total);
    resize_to(pg, 2 * U, "lru");
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.n_slots, 2);
    ck_assert_uint_eq(s.arena_bytes, s0.arena_bytes);
    ck_assert_uint_eq(s.resident_bytes, 2 * U);
    ck_assert_uint_eq(s.evictions, (uint64_t)sp->layers * sp->experts - 2);
    /* The survivors are the two most recent (LRU) and still serve hits. */
    uint64_t hits = s.hits;
    uint32_t last = sp->experts - 1, prev = sp->experts - 2;
    call_experts(pg, &fixture.bank, sp->layers - 1, &last, 1, &seed);
    call_experts(pg, &fixture.bank, sp->layers - 1, &prev, 1, &seed);
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.hits, hits + 2);
}
END_TEST


/* A shrink is less memory, not only a smaller number: the slots it gives
 * back leave the process (a memory cgroup sees them go, which is what an
 * auto budget under pressure is for), and a growth takes them again. */
START_TEST(test_shrinking_gives_the_slots_memory_back_to_the_system)
{
    pg_fixture_big_units();
    const pf_spec sp = fixture.spec;
    uint64_t U = unit_bytes(&fixture.bank), total = (uint64_t)sp.layers * sp.experts * U;
    qm_pager *pg = pg_fixture_lru_pager(total, 0);
    uint64_t seed = 3;
    for (uint32_t l = 0; l < sp.layers; l++)
        for (uint32_t e = 0; e < sp.experts; e++)
            call_experts(pg, &fixture.bank, l, &e, 1, &seed);
    uint64_t full = pg_rss_anon();
    resize_to(pg, 2 * U, "lru");
    uint64_t small = pg_rss_anon(), freed = full > small ? full - small : 0;
    ck_assert_msg(freed >= (total - 2 * U) * 9 / 10,
                  "shrinking from %llu to %llu bytes freed only %llu bytes of RssAnon",
                  (unsigned long long)total, (unsigned long long)(2 * U),
                  (unsigned long long)freed);
    /* Grown again and filled: the memory comes back, the outputs stay. */
    resize_to(pg, total, "lru");
    for (uint32_t l = 0; l < sp.layers; l++)
        for (uint32_t e = 0; e < sp.experts; e++)
            call_experts(pg, &fixture.bank, l, &e, 1, &seed);
    ck_assert_uint_ge(pg_rss_anon(), small + (total - 2 * U) * 9 / 10);
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.resident_bytes, total);
}
END_TEST

/* Two devices: each pager's allocations against its current share. */
static void share_hook(void *ud, uint64_t resident, uint64_t budget)
{
    ck_assert_uint_le(resident, budget);
    ck_assert_uint_le(resident, *(const uint64_t *)ud);
}

START_TEST(test_two_devices_resize_by_share_with_outputs_bitwise)
{
    const pf_spec *sp = &fixture.spec;
    qm_backend *dev[2] = {NULL, NULL};
    ck_assert_int_eq(pf_fake_device_new(&dev[0]), 0);
    ck_assert_int_eq(pf_fake_device_new(&dev[1]), 0);
    pg_set set;
    make_calls(&fixture.bank, fixture.cpu, 30, 23, &set);
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    uint64_t U = unit_bytes(&fixture.bank), total = (uint64_t)sp->layers * sp->experts * U;
    const uint64_t steps[] = {total / 4, 3 * U + 3, total, 5 * U + U / 2, total / 2, 4 * U, total};
    const size_t n_steps = sizeof steps / sizeof steps[0];
    const char *policies[] = {"lru", "lfu", "arc"};
    float *out = malloc(sizeof(float) * 8 * cfg->hidden);
    for (size_t pi = 0; pi < sizeof policies / sizeof *policies; pi++)
        for (int pf = 0; pf < 2; pf++)
            for (int om = QM_ON_MISS_PAGE; om <= QM_ON_MISS_HOST; om++) {
                qm_policy pol = {0};
                new_policy(policies[pi], &fixture.bank, &set, &pol);
                qm_residency_plan *plan = make_plan(&fixture.bank, &pol, 1, total / 2);
                qm_placement pl;
                ck_assert_int_eq(
                    qm_placement_make(fixture.bank.bank, 2, NULL, total / 2, &pl, &fixture.st), 0);
                uint64_t share[2] = {pl.budget[0], pl.budget[1]};
                qm_pager_options o = {.prefetch = pf, .on_miss = om, .host_threads = 1,
                                      .no_preload = 1};
                qm_multipager *mp = NULL;
                ck_assert_int_eq(qm_multipager_new(dev, fixture.bank.bank, plan, &pol, &o, &pl,
                                                   &mp, &fixture.st),
                                 0);
                for (uint32_t d = 0; d < 2; d++)
                    qm_pager_set_alloc_hook(qm_multipager_pager(mp, d), share_hook, &share[d]);
                for (size_t i = 0; i < set.n; i++) {
                    if (i % 4 == 3) {
                        uint64_t b = steps[(i / 4) % n_steps];
                        qm_placement_split(&pl, b, share);
                        ck_assert_uint_eq(share[0] + share[1], b);
                        ck_assert_msg(qm_multipager_resize(mp, b, &fixture.st) == 0,
                                      "resize to %llu: %s", (unsigned long long)b,
                                      fixture.st.msg);
                        for (uint32_t d = 0; d < 2; d++) {
                            qm_pager_stats sd;
                            qm_pager_stats_get(qm_multipager_pager(mp, d), &sd);
                            ck_assert_uint_eq(sd.budget_bytes, share[d]);
                            ck_assert_uint_le(sd.resident_bytes, share[d]);
                        }
                    }
                    const pg_call *c = &set.calls[i];
                    qm_moe_call mc = {.layer = c->layer, .dtype = QM_DTYPE_F32, .hidden = c->x,
                                      .n_tokens = c->T, .logits = c->logits, .output = out};
                    ck_assert_msg(qm_multipager_forward(mp, &mc, NULL, &fixture.st) == 0,
                                  "call %zu: %s", i, fixture.st.msg);
                    ck_assert_msg(memcmp(out, c->ref, sizeof(float) * c->T * cfg->hidden) == 0,
                                  "%s prefetch %d on_miss %d: call %zu differs", policies[pi],
                                  pf, om, i);
                }
                /* Below one device's minimum: refused naming the device, and
                 * every device keeps its budget. */
                uint64_t was[2] = {share[0], share[1]};
                ck_assert_int_eq(qm_multipager_resize(mp, U + U / 2, &fixture.st),
                                 QM_ERESOURCE_EXHAUSTED);
                ck_assert_str_eq(fixture.st.field, "budget_bytes");
                ck_assert_ptr_nonnull(strstr(fixture.st.msg, "device 0 (its share"));
                for (uint32_t d = 0; d < 2; d++) {
                    qm_pager_stats sd;
                    qm_pager_stats_get(qm_multipager_pager(mp, d), &sd);
                    ck_assert_uint_eq(sd.budget_bytes, was[d]);
                }
                qm_pager_stats s;
                qm_multipager_stats(mp, &s);
                ck_assert_uint_gt(s.resizes, 0);
                ck_assert_uint_eq(s.budget_violations, 0);
                qm_backend *none[2] = {NULL, NULL};
                free_two_devices(mp, &pl, plan, &pol, none);
            }
    free(out);
    free_calls(&set);
    free_two_devices(NULL, NULL, NULL, NULL, dev);
}
END_TEST

static Suite *resize_suite(void)
{
    Suite *s = suite_create("paging_resize");
    TCase *tc = tcase_create("resize");
    tcase_add_checked_fixture(tc, pg_fixture_setup, pg_fixture_teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_outputs_bitwise_equal_while_the_budget_shrinks_and_grows);
    tcase_add_test(tc, test_shrinking_releases_the_coldest_pins_first_and_reports_them);
    tcase_add_test(tc, test_resize_below_the_minimum_is_refused_like_create);
    tcase_add_test(tc, test_growth_adds_an_arena_and_shrinking_gives_it_back);
    tcase_add_test(tc, test_shrinking_gives_the_slots_memory_back_to_the_system);
    tcase_add_test(tc, test_two_devices_resize_by_share_with_outputs_bitwise);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(resize_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
