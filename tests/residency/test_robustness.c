/* test_robustness.c - the planner against a hostile policy over thousands of
 * seeded random catalogs, the shipped policies over the same catalogs, and
 * an allocation failure injected at every allocation site in turn. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_plan_json.h"
#include "qm_residency.h"
#include "qm_test_policies.h"
#include "rt_util.h"

#define MAX_BANKS 8
#define RANDOM_ROUNDS 3000

typedef struct world {
    qm_region_catalog *cats[MAX_BANKS];
    size_t n;
    qm_plan_options opt;
    uint32_t hot[MAX_BANKS][6];
    const uint32_t *hot_ptr[MAX_BANKS];
    size_t hot_len[MAX_BANKS];
} world;

static void world_free(world *w)
{
    for (size_t i = 0; i < w->n; i++)
        qm_catalog_free(w->cats[i]);
    w->n = 0;
}

/* Random but valid input: unique bank ids, any shape, any reason. */
static void world_random(world *w, uint64_t seed)
{
    memset(w, 0, sizeof *w);
    uint64_t r = seed * 2654435761u + 1;
    size_t n = rt_rand(&r) % (MAX_BANKS + 1);
    uint32_t base = rt_rand(&r) % 3 == 0 ? UINT32_MAX - MAX_BANKS : 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t id = base + (uint32_t)((i * 7 + seed) % MAX_BANKS); /* unique: 7 is coprime */
        uint32_t experts = (uint32_t)(rt_rand(&r) % 12);
        qm_region_catalog *cat = NULL;
        ck_assert_int_eq(qm_catalog_new(id, experts, &cat), 0);
        uint64_t offset = 0;
        for (uint32_t e = 0; e < experts; e++) {
            size_t regions = rt_rand(&r) % 8 == 0 ? 0 : 1 + rt_rand(&r) % 3;
            for (size_t k = 0; k < regions; k++) {
                uint64_t len = rt_rand(&r) % 9 == 0 ? 0 : rt_rand(&r) % 1000;
                ck_assert_int_eq(qm_catalog_add_region(cat, e, (qm_region){k, offset, len}), 0);
                offset += len;
            }
        }
        if (rt_rand(&r) % 4 == 0) {
            char detail[32];
            snprintf(detail, sizeof detail, "random %llu", (unsigned long long)(r % 1000));
            qm_catalog_set_nonpageable(cat, (qm_nonpageable_reason)(rt_rand(&r) % 12),
                                       rt_rand(&r) % 2 ? detail : NULL);
        }
        w->cats[w->n++] = cat;
        size_t hl = rt_rand(&r) % 7;
        for (size_t k = 0; k < hl; k++)
            w->hot[i][k] = (uint32_t)(rt_rand(&r) % 14);
        w->hot_ptr[i] = hl ? w->hot[i] : NULL;
        w->hot_len[i] = hl;
    }
    w->opt.has_budget = rt_rand(&r) % 3 != 0;
    w->opt.budget_bytes = rt_rand(&r) % 5 == 0 ? UINT64_MAX : rt_rand(&r) % 8000;
    w->opt.min_split_bytes = rt_rand(&r) % 3 == 0 ? rt_rand(&r) % 1500 : 0;
}

static void check_plan(world *w, qm_policy *pol, size_t round, int shipped)
{
    const qm_region_catalog *const *cats = (const qm_region_catalog *const *)w->cats;
    qm_residency_plan *plan = NULL;
    qm_status st;
    qm_status_clear(&st);
    int rc = qm_plan_residency(cats, w->n, pol, &w->opt, &plan, &st);
    ck_assert_msg(rc == 0, "round %zu policy %s: plan failed %d %s", round, pol->iface->name, rc,
                  st.msg);
    char why[256];
    ck_assert_msg(rt_plan_check(plan, cats, w->n, &w->opt, why, sizeof why) == 0,
                  "round %zu policy %s: %s", round, pol->iface->name, why);
    for (size_t i = 0; shipped && i < w->n; i++) {
        const qm_plan_bank *b = qm_plan_bank_at(plan, i);
        ck_assert_msg(b->decision.reason != QM_DEGRADATION_REJECTED_BY_VALIDATION,
                      "round %zu: shipped policy %s was rejected: %s", round, pol->iface->name,
                      b->decision.detail);
    }
    char *a = NULL, *b = NULL;
    ck_assert_int_eq(qm_plan_to_json(plan, &a, NULL, NULL), 0);
    ck_assert_int_eq(qm_plan_to_json(plan, &b, NULL, NULL), 0);
    ck_assert_str_eq(a, b);
    qm_free(a);
    qm_free(b);
    qm_plan_free(plan);
}

START_TEST(test_hostile_policy_never_breaks_plan_invariants)
{
    for (size_t round = 0; round < RANDOM_ROUNDS; round++) {
        world w;
        world_random(&w, round);
        qm_policy pol;
        ck_assert_int_eq(rt_policy_hostile(round + 1, &pol), 0);
        check_plan(&w, &pol, round, 0);
        /* Its run-time answers pass the wrapper only when they are real indices. */
        qm_expert_ref cands[5] = {{0, 0}, {0, 1}, {1, 0}, {2, 3}, {7, 7}};
        for (size_t k = 0; k < 20; k++) {
            size_t victim = 12345;
            size_t n = 1 + k % 5;
            qm_policy_on_access(&pol, cands[k % 5], k, 0);
            int vrc = qm_policy_choose_victim(&pol, cands, n, &victim);
            ck_assert(vrc < 0 || victim < n);
            ck_assert(vrc == 0 || victim == 12345);
        }
        qm_policy_destroy(&pol);
        world_free(&w);
    }
}
END_TEST

START_TEST(test_shipped_policies_are_never_rejected_on_random_catalogs)
{
    const char *names[QM_TEST_MAX_POLICIES];
    const size_t n_names = qm_test_policies(names, 0, NULL);
    ck_assert_uint_ge(n_names, 7);
    for (size_t round = 0; round < RANDOM_ROUNDS / 3; round++) {
        world w;
        world_random(&w, round + 100000);
        for (size_t p = 0; p < n_names; p++) {
            qm_policy_value pin = {"pin_fraction", 0.7};
            int hot_ok = qm_policy_accepts_hot(names[p]);
            qm_policy_params params = {.version = QM_POLICY_PARAMS_VERSION,
                                       .values = &pin,
                                       .n_values = hot_ok,
                                       .hot = hot_ok ? w.hot_ptr : NULL,
                                       .hot_len = w.hot_len,
                                       .n_hot_banks = MAX_BANKS};
            qm_policy pol;
            ck_assert_int_eq(qm_policy_new(names[p], &params, &pol, NULL), 0);
            check_plan(&w, &pol, round, 1);
            qm_policy_destroy(&pol);
        }
        world_free(&w);
    }
}
END_TEST

/* ---- Allocation failure at every site ------------------------------------------ */

/* Builds catalogs, a policy, a plan and its JSON, and drives the run-time
 * hooks; frees everything. Returns 0 or the first error. */
static int scenario(const char *policy, char *msg, size_t msg_cap)
{
    int rc = 0;
    qm_status st;
    qm_status_clear(&st);
    qm_region_catalog *cats[3] = {0};
    qm_policy pol = {0};
    qm_residency_plan *plan = NULL;
    char *json = NULL;
    for (uint32_t b = 0; b < 3; b++) {
        cats[b] = rt_catalog(b, 6, 3, 128); /* 3 regions: the region array grows */
        if (!cats[b]) {                     /* the catalog calls return bare codes, no sentence */
            rc = qm_status_set(&st, QM_ENOMEM, "catalog %u: out of memory", b);
            goto done;
        }
    }
    qm_catalog_set_nonpageable(cats[1], QM_NONPAGEABLE_MISALIGNED, "x");
    static const uint32_t hot0[] = {5, 4, 3}, hot2[] = {1};
    const uint32_t *hot[] = {hot0, NULL, hot2};
    const size_t hot_len[] = {3, 0, 1};
    qm_policy_params params = {.version = QM_POLICY_PARAMS_VERSION, .hot = hot,
                               .hot_len = hot_len, .n_hot_banks = 3};
    const qm_expert_ref future[] = {{0, 1}, {2, 3}, {0, 1}, {0, 2}, {2, 0}, {0, 5}};
    if (!qm_policy_accepts_hot(policy)) params.hot = NULL;
    if (strcmp(policy, "belady") == 0) /* not offered: made from its future */
        rc = qm_policy_belady_new(future, 6, &pol, &st);
    else
        rc = qm_policy_new(policy, &params, &pol, &st);
    if (rc) goto done;
    qm_plan_options opt = {.has_budget = 1, .budget_bytes = 4096};
    rc = qm_plan_residency((const qm_region_catalog *const *)cats, 3, &pol, &opt, &plan, &st);
    if (rc) goto done;
    char why[256];
    ck_assert_msg(
        rt_plan_check(plan, (const qm_region_catalog *const *)cats, 3, &opt, why, sizeof why) == 0,
        "%s", why);
    rc = qm_plan_to_json(plan, &json, NULL, &st);
    if (rc) goto done;
    for (uint64_t t = 0; t < 6; t++) {
        qm_policy_on_access(&pol, future[t], t, 0);
        qm_policy_on_insert(&pol, future[t], t);
        size_t victim;
        qm_expert_ref cands[2] = {future[t], future[(t + 1) % 6]};
        if (qm_policy_choose_victim(&pol, cands, 2, &victim) == 0) ck_assert_uint_lt(victim, 2);
        qm_policy_on_evict(&pol, future[t]);
    }
done:
    if (rc) snprintf(msg, msg_cap, "%s", st.msg);
    qm_free(json);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    for (size_t b = 0; b < 3; b++)
        qm_catalog_free(cats[b]);
    return rc;
}

START_TEST(test_allocation_failure_at_every_site_is_reported_and_leaks_nothing)
{
    const char *names[QM_TEST_MAX_POLICIES];
    ck_assert_uint_lt((size_t)_i, qm_test_policies(names, 1, NULL));
    const char *which = names[_i]; /* every registered policy, offered or not */
    long sites = 0;
    for (long fail_at = 1; fail_at < 10000; fail_at++) {
        char msg[QM_STATUS_MSG_MAX] = "";
        rt_alloc_install(fail_at);
        int rc = scenario(which, msg, sizeof msg);
        int failed = rt_alloc_failed();
        long live = rt_alloc_live();
        rt_alloc_uninstall();
        ck_assert_msg(live == 0, "policy %s, failing allocation %ld: %ld blocks leaked", which,
                      fail_at, live);
        if (!failed) {
            ck_assert_msg(rc == 0, "policy %s: no failure injected yet rc %d", which, rc);
            sites = fail_at - 1;
            break;
        }
        /* Either reported as out of memory with a sentence, or absorbed
         * (a best-effort reservation, a degraded bank) with a valid plan. */
        ck_assert_msg(rc == 0 || rc == QM_ENOMEM, "policy %s, failing allocation %ld: rc %d", which,
                      fail_at, rc);
        if (rc == QM_ENOMEM)
            ck_assert_msg(msg[0] != '\0',
                          "policy %s, failing allocation %ld: ENOMEM without a sentence", which,
                          fail_at);
    }
    ck_assert_msg(sites > 10, "policy %s: only %ld allocation sites exercised", which, sites);
}
END_TEST

static Suite *robustness_suite(void)
{
    Suite *s = suite_create("residency_robustness");
    TCase *c = tcase_create("random");
    tcase_set_timeout(c, 120);
    tcase_add_test(c, test_hostile_policy_never_breaks_plan_invariants);
    tcase_add_test(c, test_shipped_policies_are_never_rejected_on_random_catalogs);
    suite_add_tcase(s, c);
    c = tcase_create("allocation_failure");
    tcase_set_timeout(c, 120);
    const char *names[QM_TEST_MAX_POLICIES];
    tcase_add_loop_test(c, test_allocation_failure_at_every_site_is_reported_and_leaks_nothing, 0,
                        (int)qm_test_policies(names, 1, NULL));
    suite_add_tcase(s, c);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(robustness_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
