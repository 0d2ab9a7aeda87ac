/* test_validation.c - fail-closed validation: every kind of invalid decision
 * degrades its own bank, with a message naming the rule and the index, and
 * nothing else in the plan changes. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_residency.h"
#include "rt_util.h"

#define N_BANKS 4
#define BAD_BANK 2
#define EXPERTS 4
#define UNIT 64

typedef struct case_setup {
    qm_region_catalog *cats[N_BANKS];
    qm_plan_options opt;
} case_setup;

static void setup_for(rt_invalid_kind kind, case_setup *cs)
{
    memset(cs, 0, sizeof *cs);
    for (uint32_t b = 0; b < N_BANKS; b++) {
        if (b == BAD_BANK && kind == RT_INVALID_NO_REAL_REGION) {
            /* Expert 3's only region is empty: listing it names no real bytes. */
            ck_assert_int_eq(qm_catalog_new(b, EXPERTS, &cs->cats[b]), 0);
            for (uint32_t e = 0; e < EXPERTS; e++)
                qm_catalog_add_region(cs->cats[b], e,
                                      (qm_region){0, (uint64_t)e * UNIT, e == 3 ? 0 : UNIT});
        } else {
            cs->cats[b] = rt_catalog(b, EXPERTS, 1, UNIT);
        }
        ck_assert_ptr_nonnull(cs->cats[b]);
    }
    if (kind == RT_INVALID_PER_EXPERT_ON_NON_PAGEABLE)
        qm_catalog_set_nonpageable(cs->cats[BAD_BANK], QM_NONPAGEABLE_MISALIGNED, "offset 3");
    if (kind == RT_INVALID_PINNED_OVER_BUDGET) {
        cs->opt.has_budget = 1;
        cs->opt.budget_bytes = (EXPERTS - 1) * UNIT; /* one slot short of pinning all */
    }
}

static void teardown(case_setup *cs)
{
    for (size_t b = 0; b < N_BANKS; b++)
        qm_catalog_free(cs->cats[b]);
}

/* Plans with the invalid policy; checks the bad bank is degraded with the
 * rule's name and every other bank is split as split_all would. Returns the
 * bad bank's detail (static buffer). */
static const char *plan_invalid(rt_invalid_kind kind)
{
    static char detail[QM_DECISION_DETAIL_MAX];
    case_setup cs;
    setup_for(kind, &cs);
    const qm_region_catalog *const *cats = (const qm_region_catalog *const *)cs.cats;
    qm_policy pol;
    ck_assert_int_eq(rt_policy_invalid(kind, BAD_BANK, &pol), 0);
    qm_residency_plan *plan = NULL;
    qm_status st;
    ck_assert_msg(qm_plan_residency(cats, N_BANKS, &pol, &cs.opt, &plan, &st) == 0,
                  "an invalid decision must not fail the plan: %s", st.msg);
    char why[256];
    ck_assert_msg(rt_plan_check(plan, cats, N_BANKS, &cs.opt, why, sizeof why) == 0, "%s", why);

    const qm_plan_bank *bad = qm_plan_find_bank(plan, BAD_BANK);
    ck_assert_int_eq(bad->decision.kind, QM_DECISION_WHOLE_BANK);
    ck_assert_int_eq(bad->decision.reason, QM_DEGRADATION_REJECTED_BY_VALIDATION);
    const char *rule = rt_invalid_rule(kind);
    ck_assert_msg(strncmp(bad->decision.detail, rule, strlen(rule)) == 0,
                  "kind %d: detail '%s' does not start with '%s'", kind, bad->decision.detail,
                  rule);
    ck_assert_ptr_null(bad->decision.experts);
    ck_assert_uint_eq(qm_plan_degraded_count(plan), 1);
    ck_assert_uint_eq(qm_plan_resident_count(plan), 0);
    for (uint32_t b = 0; b < N_BANKS; b++) {
        if (b == BAD_BANK) continue;
        const qm_plan_bank *ok = qm_plan_find_bank(plan, b);
        ck_assert_int_eq(ok->decision.kind, QM_DECISION_PER_EXPERT);
        ck_assert_uint_eq(ok->decision.n_experts, EXPERTS);
        for (uint32_t e = 0; e < EXPERTS; e++)
            ck_assert_uint_eq(ok->decision.experts[e], e);
        ck_assert_uint_eq(ok->decision.n_pinned, 0);
    }
    snprintf(detail, sizeof detail, "%s", bad->decision.detail);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    teardown(&cs);
    return detail;
}

START_TEST(test_each_invalid_kind_degrades_only_its_bank)
{
    plan_invalid((rt_invalid_kind)_i);
}
END_TEST

START_TEST(test_plan_rejects_out_of_range_expert_naming_the_index)
{
    ck_assert_str_eq(plan_invalid(RT_INVALID_OUT_OF_RANGE),
                     "rule expert_out_of_range: experts[1] = 4, bank 2 has 4 experts");
}
END_TEST

START_TEST(test_plan_rejects_duplicate_expert)
{
    ck_assert_str_eq(plan_invalid(RT_INVALID_DUPLICATE),
                     "rule duplicate_expert: expert 0 is listed more than once in bank 2");
}
END_TEST

START_TEST(test_plan_rejects_per_expert_over_non_pageable_catalog)
{
    ck_assert_str_eq(plan_invalid(RT_INVALID_PER_EXPERT_ON_NON_PAGEABLE),
                     "rule per_expert_over_non_pageable_catalog: bank 2 cannot be split "
                     "(misaligned: offset 3)");
}
END_TEST

START_TEST(test_plan_rejects_expert_without_a_real_region)
{
    ck_assert_str_eq(plan_invalid(RT_INVALID_NO_REAL_REGION),
                     "rule expert_without_region: experts[3] = 3 has no bytes in bank 2");
}
END_TEST

START_TEST(test_plan_rejects_pinned_expert_that_is_not_a_candidate)
{
    ck_assert_str_eq(plan_invalid(RT_INVALID_PINNED_NOT_CANDIDATE),
                     "rule pinned_not_candidate: pinned[0] = 3 is not among bank 2's experts");
}
END_TEST

START_TEST(test_plan_rejects_pinned_bytes_over_budget)
{
    ck_assert_str_eq(plan_invalid(RT_INVALID_PINNED_OVER_BUDGET),
                     "rule pinned_over_budget: bank 2 pins 4 x 64 bytes, budget 192");
}
END_TEST

START_TEST(test_plan_degrades_bank_whose_decide_failed)
{
    ck_assert_str_eq(plan_invalid(RT_INVALID_DECIDE_ERROR),
                     "rule decide_failed: policy 'test_invalid' returned INTERNAL for bank 2");
}
END_TEST

/* A policy whose decide runs out of memory (as lru's scratch can). */
static int nomem_decide(void *ctx, const qm_policy_input *in, qm_residency_decision *out)
{
    (void)ctx;
    (void)in;
    memset(out, 0, sizeof *out);
    return QM_ENOMEM;
}
static const qm_policy_iface nomem_iface = {
    .version = QM_POLICY_IFACE_VERSION, .name = "nomem", .decide = nomem_decide};

/* RELIABILITY.md B11: the bank used to be degraded to whole, so qmoed then
 * refused the session with a false "budget_bytes is below the minimum". */
START_TEST(test_plan_fails_with_out_of_memory_when_decide_runs_out_of_memory)
{
    qm_region_catalog *cat = rt_catalog(0, EXPERTS, 1, UNIT);
    qm_policy pol = {.iface = &nomem_iface};
    qm_plan_options opt = {.has_budget = 1, .budget_bytes = 2 * UNIT};
    qm_residency_plan *plan = NULL;
    qm_status st;
    qm_status_clear(&st);
    ck_assert_int_eq(
        qm_plan_residency((const qm_region_catalog *const *)&cat, 1, &pol, &opt, &plan, &st),
        QM_ENOMEM);
    ck_assert_ptr_null(plan);
    ck_assert_msg(strstr(st.msg, "out of memory") != NULL, "message: %s", st.msg);
    qm_catalog_free(cat);
}
END_TEST

/* A policy that pins every expert of every bank. */
static uint32_t all4[EXPERTS] = {0, 1, 2, 3};
static int pin_all_decide(void *ctx, const qm_policy_input *in, qm_residency_decision *out)
{
    (void)ctx;
    (void)in;
    out->kind = QM_DECISION_PER_EXPERT;
    out->experts = all4;
    out->n_experts = EXPERTS;
    out->pinned = all4;
    out->n_pinned = EXPERTS;
    return 0;
}
static const qm_policy_iface pin_all_iface = {
    .version = QM_POLICY_IFACE_VERSION, .name = "pin_all", .decide = pin_all_decide};

START_TEST(test_pins_exactly_filling_the_budget_or_without_budget_are_accepted)
{
    qm_region_catalog *cat = rt_catalog(0, EXPERTS, 1, UNIT);
    qm_policy pol = {.iface = &pin_all_iface};
    const qm_plan_options opts[] = {{0}, {.has_budget = 1, .budget_bytes = EXPERTS * UNIT}};
    for (size_t i = 0; i < 2; i++) {
        qm_residency_plan *plan = NULL;
        ck_assert_int_eq(qm_plan_residency((const qm_region_catalog *const *)&cat, 1, &pol,
                                           &opts[i], &plan, NULL),
                         0);
        const qm_plan_bank *b = qm_plan_bank_at(plan, 0);
        ck_assert_int_eq(b->decision.kind, QM_DECISION_PER_EXPERT);
        ck_assert_uint_eq(b->decision.n_pinned, EXPERTS);
        qm_plan_free(plan);
    }
    qm_catalog_free(cat);
}
END_TEST

START_TEST(test_pinned_bytes_that_overflow_are_over_budget)
{
    qm_region_catalog *cat = rt_catalog(0, EXPERTS, 1, (uint64_t)1 << 63);
    qm_policy pol = {.iface = &pin_all_iface};
    qm_plan_options opt = {.has_budget = 1, .budget_bytes = UINT64_MAX};
    qm_residency_plan *plan = NULL;
    ck_assert_int_eq(
        qm_plan_residency((const qm_region_catalog *const *)&cat, 1, &pol, &opt, &plan, NULL), 0);
    const qm_plan_bank *b = qm_plan_bank_at(plan, 0);
    ck_assert_int_eq(b->decision.reason, QM_DEGRADATION_REJECTED_BY_VALIDATION);
    ck_assert(strncmp(b->decision.detail, "rule pinned_over_budget", 23) == 0);
    ck_assert_uint_eq(b->bank_bytes, UINT64_MAX); /* saturated, not wrapped */
    qm_plan_free(plan);
    qm_catalog_free(cat);
}
END_TEST

/* Same decision array for experts and pinned, as the hostile policy does;
 * a length longer than the bank must be refused without being read. */
static uint32_t tiny[1] = {0};
static int lying_decide(void *ctx, const qm_policy_input *in, qm_residency_decision *out)
{
    (void)ctx;
    (void)in;
    out->kind = QM_DECISION_PER_EXPERT;
    out->experts = tiny;
    out->n_experts = SIZE_MAX;
    return 0;
}
static const qm_policy_iface lying_iface = {
    .version = QM_POLICY_IFACE_VERSION, .name = "liar", .decide = lying_decide};

START_TEST(test_a_lying_length_is_refused_without_reading_past_the_array)
{
    qm_region_catalog *cat = rt_catalog(0, EXPERTS, 1, UNIT);
    qm_policy pol = {.iface = &lying_iface};
    qm_residency_plan *plan = NULL;
    ck_assert_int_eq(
        qm_plan_residency((const qm_region_catalog *const *)&cat, 1, &pol, NULL, &plan, NULL), 0);
    const qm_plan_bank *b = qm_plan_bank_at(plan, 0);
    ck_assert_int_eq(b->decision.reason, QM_DEGRADATION_REJECTED_BY_VALIDATION);
    ck_assert(strncmp(b->decision.detail, "rule too_many_experts", 21) == 0);
    qm_plan_free(plan);
    qm_catalog_free(cat);
}
END_TEST

static Suite *validation_suite(void)
{
    Suite *s = suite_create("residency_validation");
    TCase *c = tcase_create("each_rule");
    tcase_add_loop_test(c, test_each_invalid_kind_degrades_only_its_bank, 0, RT_INVALID_COUNT);
    tcase_add_test(c, test_plan_rejects_out_of_range_expert_naming_the_index);
    tcase_add_test(c, test_plan_rejects_duplicate_expert);
    tcase_add_test(c, test_plan_rejects_per_expert_over_non_pageable_catalog);
    tcase_add_test(c, test_plan_rejects_expert_without_a_real_region);
    tcase_add_test(c, test_plan_rejects_pinned_expert_that_is_not_a_candidate);
    tcase_add_test(c, test_plan_rejects_pinned_bytes_over_budget);
    tcase_add_test(c, test_plan_degrades_bank_whose_decide_failed);
    tcase_add_test(c, test_plan_fails_with_out_of_memory_when_decide_runs_out_of_memory);
    suite_add_tcase(s, c);
    c = tcase_create("boundaries");
    tcase_add_test(c, test_pins_exactly_filling_the_budget_or_without_budget_are_accepted);
    tcase_add_test(c, test_pinned_bytes_that_overflow_are_over_budget);
    tcase_add_test(c, test_a_lying_length_is_refused_without_reading_past_the_array);
    suite_add_tcase(s, c);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(validation_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
