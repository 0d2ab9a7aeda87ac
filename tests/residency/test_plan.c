/* test_plan.c - residency planning as RESIDENCY.md states it: catalogs, the
 * default policy, reasons, substitutability, order, counts, JSON. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_plan_json.h"
#include "qm_residency.h"
#include "qm_test_policies.h"
#include "rt_util.h"

#define MAX_CATS 16

typedef struct fixture {
    qm_region_catalog *cats[MAX_CATS];
    size_t n;
} fixture;

static void fx_free(fixture *fx)
{
    for (size_t i = 0; i < fx->n; i++)
        qm_catalog_free(fx->cats[i]);
    fx->n = 0;
}

/* Bank 0: 4 experts x 2 regions x 100 B (pageable, 200 B per expert).
 * Bank 1: not expert-major, with a detail.  Bank 2: 2 experts x 1 x 50 B. */
static void fx_mixed(fixture *fx)
{
    fx->n = 0;
    fx->cats[fx->n++] = rt_catalog(0, 4, 2, 100);
    fx->cats[fx->n] = rt_catalog(1, 4, 2, 100);
    qm_catalog_set_nonpageable(fx->cats[fx->n++], QM_NONPAGEABLE_NOT_EXPERT_MAJOR,
                               "fc1: leading dim 3 != experts 4");
    fx->cats[fx->n++] = rt_catalog(2, 2, 1, 50);
    for (size_t i = 0; i < fx->n; i++)
        ck_assert_ptr_nonnull(fx->cats[i]);
}

static qm_residency_plan *plan_with(const fixture *fx, qm_policy *pol, const qm_plan_options *opt)
{
    qm_residency_plan *plan = NULL;
    qm_status st;
    qm_status_clear(&st);
    int rc =
        qm_plan_residency((const qm_region_catalog *const *)fx->cats, fx->n, pol, opt, &plan, &st);
    ck_assert_msg(rc == 0, "plan failed: %d %s", rc, st.msg);
    char why[256];
    ck_assert_msg(rt_plan_check(plan, (const qm_region_catalog *const *)fx->cats, fx->n, opt, why,
                                sizeof why) == 0,
                  "invariant broken: %s", why);
    return plan;
}

static qm_residency_plan *plan_named(const fixture *fx, const char *name,
                                     const qm_plan_options *opt)
{
    qm_policy pol;
    qm_status st;
    ck_assert_msg(qm_policy_new(name, NULL, &pol, &st) == 0, "%s", st.msg);
    qm_residency_plan *plan = plan_with(fx, &pol, opt);
    qm_policy_destroy(&pol);
    return plan;
}

static char *json_of(const qm_residency_plan *plan)
{
    char *text = NULL;
    size_t len = 0;
    qm_status st;
    ck_assert_msg(qm_plan_to_json(plan, &text, &len, &st) == 0, "%s", st.msg);
    ck_assert_uint_eq(len, strlen(text));
    return text;
}

/* ---- Catalogs ------------------------------------------------------------ */

START_TEST(test_catalog_reports_shape_and_bytes)
{
    qm_region_catalog *cat = rt_catalog(7, 3, 2, 64);
    ck_assert_ptr_nonnull(cat);
    ck_assert_uint_eq(qm_catalog_bank_id(cat), 7);
    ck_assert_uint_eq(qm_catalog_expert_count(cat), 3);
    ck_assert_uint_eq(qm_catalog_expert_bytes(cat, 1), 128);
    ck_assert_uint_eq(qm_catalog_bytes_per_expert(cat), 128);
    ck_assert_uint_eq(qm_catalog_total_bytes(cat), 384);
    size_t n = 0;
    const qm_region *r = qm_catalog_regions(cat, 2, &n);
    ck_assert_uint_eq(n, 2);
    ck_assert_uint_eq(r[0].tensor, 0);
    ck_assert_uint_eq(r[1].tensor, 1);
    ck_assert_uint_eq(r[1].offset, (1 * 3 + 2) * 64);
    ck_assert_int_eq(qm_catalog_reason(cat), QM_NONPAGEABLE_NONE);
    ck_assert_str_eq(qm_catalog_reason_detail(cat), "");
    ck_assert_int_eq(qm_catalog_add_region(cat, 3, (qm_region){0, 0, 1}), QM_EINVAL);
    ck_assert_ptr_null(qm_catalog_regions(cat, 3, &n));
    ck_assert_uint_eq(n, 0);
    qm_catalog_free(cat);
    qm_catalog_free(NULL);
}
END_TEST

START_TEST(test_catalog_computes_missing_region_single_expert_and_empty_unit)
{
    qm_region_catalog *one = rt_catalog(0, 1, 1, 8);
    ck_assert_int_eq(qm_catalog_reason(one), QM_NONPAGEABLE_SINGLE_EXPERT);
    qm_region_catalog *zero = rt_catalog(0, 0, 1, 8);
    ck_assert_int_eq(qm_catalog_reason(zero), QM_NONPAGEABLE_SINGLE_EXPERT);
    qm_region_catalog *missing = NULL;
    ck_assert_int_eq(qm_catalog_new(0, 3, &missing), 0);
    qm_catalog_add_region(missing, 0, (qm_region){0, 0, 8});
    qm_catalog_add_region(missing, 2, (qm_region){0, 16, 8});
    ck_assert_int_eq(qm_catalog_reason(missing), QM_NONPAGEABLE_MISSING_REGION);
    qm_catalog_add_region(missing, 1, (qm_region){0, 8, 0});
    ck_assert_int_eq(qm_catalog_reason(missing), QM_NONPAGEABLE_EMPTY_UNIT);
    qm_catalog_set_nonpageable(missing, QM_NONPAGEABLE_MISALIGNED, "offset 3 % 256");
    ck_assert_int_eq(qm_catalog_reason(missing), QM_NONPAGEABLE_MISALIGNED);
    ck_assert_str_eq(qm_catalog_reason_detail(missing), "offset 3 % 256");
    qm_catalog_free(one);
    qm_catalog_free(zero);
    qm_catalog_free(missing);
}
END_TEST

START_TEST(test_reason_names_are_stable_snake_case)
{
    ck_assert_str_eq(qm_nonpageable_reason_name(QM_NONPAGEABLE_NONE), "pageable");
    ck_assert_str_eq(qm_nonpageable_reason_name(QM_NONPAGEABLE_NOT_EXPERT_MAJOR),
                     "not_expert_major");
    ck_assert_str_eq(qm_nonpageable_reason_name(QM_NONPAGEABLE_BLOCK_STRADDLES_EXPERTS),
                     "block_straddles_experts");
    ck_assert_str_eq(qm_nonpageable_reason_name(QM_NONPAGEABLE_BELOW_SPLIT_THRESHOLD),
                     "below_split_threshold");
    ck_assert_ptr_nonnull(qm_nonpageable_reason_name((qm_nonpageable_reason)99));
    ck_assert_str_eq(qm_degradation_kind_name(QM_DEGRADATION_REJECTED_BY_VALIDATION),
                     "rejected_by_validation");
    ck_assert_ptr_null(qm_degradation_kind_name(QM_DEGRADATION_NONE));
}
END_TEST

START_TEST(test_catalog_detail_is_truncated_not_overrun)
{
    char longer[600];
    memset(longer, 'x', sizeof longer - 1);
    longer[sizeof longer - 1] = '\0';
    qm_region_catalog *cat = rt_catalog(0, 2, 1, 8);
    qm_catalog_set_nonpageable(cat, QM_NONPAGEABLE_MISALIGNED, longer);
    ck_assert_uint_eq(strlen(qm_catalog_reason_detail(cat)), QM_DECISION_DETAIL_MAX - 1);
    fixture fx = {.cats = {cat}, .n = 1};
    qm_residency_plan *plan = plan_named(&fx, "whole_bank", NULL);
    const qm_plan_bank *b = qm_plan_bank_at(plan, 0);
    ck_assert_uint_eq(strlen(b->decision.detail), QM_DECISION_DETAIL_MAX - 1);
    ck_assert(strncmp(b->decision.detail, "misaligned: xxx", 15) == 0);
    qm_plan_free(plan);
    fx_free(&fx);
}
END_TEST

/* ---- The default policy -------------------------------------------------- */

START_TEST(test_whole_bank_keeps_every_pageable_bank_resident)
{
    fixture fx = {0};
    for (uint32_t b = 0; b < 5; b++)
        fx.cats[fx.n++] = rt_catalog(b, 8, 3, 1024);
    const qm_plan_options budgets[] = {{0},
                                       {.has_budget = 1, .budget_bytes = 0},
                                       {.has_budget = 1, .budget_bytes = 1},
                                       {.has_budget = 1, .budget_bytes = UINT64_MAX}};
    for (size_t i = 0; i < sizeof budgets / sizeof *budgets; i++) {
        qm_residency_plan *plan = plan_named(&fx, "whole_bank", &budgets[i]);
        ck_assert_str_eq(qm_plan_policy_name(plan), "whole_bank");
        ck_assert_uint_eq(qm_plan_total(plan), 5);
        ck_assert_uint_eq(qm_plan_resident_count(plan), 5);
        ck_assert_uint_eq(qm_plan_degraded_count(plan), 0);
        for (size_t k = 0; k < 5; k++) {
            const qm_plan_bank *b = qm_plan_bank_at(plan, k);
            ck_assert_int_eq(b->decision.kind, QM_DECISION_WHOLE_BANK);
            ck_assert_int_eq(b->decision.reason, QM_DEGRADATION_NONE);
            ck_assert_str_eq(b->decision.detail, "");
            ck_assert_uint_eq(b->bank_bytes, 8 * 3 * 1024);
        }
        qm_plan_free(plan);
    }
    fx_free(&fx);
}
END_TEST

START_TEST(test_whole_bank_surfaces_the_catalog_reason_unchanged)
{
    static const struct {
        qm_nonpageable_reason reason;
        const char *detail;
        const char *expect;
    } cases[] = {
        {QM_NONPAGEABLE_NOT_EXPERT_MAJOR, "fc2 is [H, E*I]", "not_expert_major: fc2 is [H, E*I]"},
        {QM_NONPAGEABLE_MISALIGNED, NULL, "misaligned"},
        {QM_NONPAGEABLE_BLOCK_STRADDLES_EXPERTS, "block 64 at 960",
         "block_straddles_experts: block 64 at 960"},
        {QM_NONPAGEABLE_MISSING_REGION, "", "missing_region"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        fixture fx = {0};
        fx.cats[fx.n] = rt_catalog(3, 4, 1, 64);
        qm_catalog_set_nonpageable(fx.cats[fx.n++], cases[i].reason, cases[i].detail);
        const char *policies[] = {"whole_bank", "lru", "lfu", "static_hot"};
        for (size_t p = 0; p < 4; p++) {
            qm_residency_plan *plan = plan_named(&fx, policies[p], NULL);
            const qm_plan_bank *b = qm_plan_bank_at(plan, 0);
            ck_assert_int_eq(b->decision.kind, QM_DECISION_WHOLE_BANK);
            ck_assert_int_eq(b->decision.reason, QM_DEGRADATION_NON_PAGEABLE_CATALOG);
            ck_assert_str_eq(b->decision.detail, cases[i].expect);
            ck_assert_uint_eq(qm_plan_degraded_count(plan), 1);
            ck_assert_uint_eq(qm_plan_resident_count(plan), 0);
            qm_plan_free(plan);
        }
        fx_free(&fx);
    }
}
END_TEST

START_TEST(test_computed_reasons_name_the_expert)
{
    fixture fx = {0};
    ck_assert_int_eq(qm_catalog_new(4, 3, &fx.cats[0]), 0);
    fx.n = 1;
    qm_catalog_add_region(fx.cats[0], 0, (qm_region){0, 0, 8});
    qm_catalog_add_region(fx.cats[0], 1, (qm_region){0, 8, 8});
    qm_residency_plan *plan = plan_named(&fx, "whole_bank", NULL);
    ck_assert_str_eq(qm_plan_bank_at(plan, 0)->decision.detail,
                     "missing_region: expert 2 has no region");
    qm_plan_free(plan);
    fx_free(&fx);
}
END_TEST

START_TEST(test_min_split_bytes_keeps_small_units_whole)
{
    fixture fx;
    fx_mixed(&fx);
    qm_plan_options opt = {.min_split_bytes = 100}; /* bank 2 has 50 B units, bank 0 has 200 */
    qm_residency_plan *plan = plan_named(&fx, "lru", &opt);
    ck_assert_int_eq(qm_plan_find_bank(plan, 0)->decision.kind, QM_DECISION_PER_EXPERT);
    const qm_plan_bank *b2 = qm_plan_find_bank(plan, 2);
    ck_assert_int_eq(b2->decision.kind, QM_DECISION_WHOLE_BANK);
    ck_assert_int_eq(b2->decision.reason, QM_DEGRADATION_NON_PAGEABLE_CATALOG);
    ck_assert_str_eq(b2->decision.detail,
                     "below_split_threshold: expert unit 50 bytes < min_split_bytes 100");
    ck_assert_uint_eq(qm_plan_degraded_count(plan), 2);
    qm_plan_free(plan);
    opt.min_split_bytes = 0; /* the default: every pageable bank may split */
    plan = plan_named(&fx, "lru", &opt);
    ck_assert_uint_eq(qm_plan_per_expert_count(plan), 2);
    qm_plan_free(plan);
    fx_free(&fx);
}
END_TEST

/* ---- Substitutability ------------------------------------------------------ */

START_TEST(test_every_policy_plans_the_same_banks_and_only_splits_pageable_ones)
{
    fixture fx;
    fx_mixed(&fx);
    qm_plan_options opt = {.has_budget = 1, .budget_bytes = 4096};
    /* Every registered policy (belady too), and the test's own. */
    const char *names[QM_TEST_MAX_POLICIES + 1];
    size_t n = qm_test_policies(names, 1, NULL);
    names[n++] = "test_split_all";
    for (size_t p = 0; p < n; p++) {
        qm_policy pol;
        qm_status st;
        if (!strcmp(names[p], "test_split_all"))
            rt_policy_split_all(&pol);
        else if (!strcmp(names[p], "belady"))
            ck_assert_int_eq(qm_policy_belady_new(NULL, 0, &pol, &st), 0);
        else
            ck_assert_int_eq(qm_policy_new(names[p], NULL, &pol, &st), 0);
        qm_residency_plan *plan = plan_with(&fx, &pol, &opt);
        ck_assert_str_eq(qm_plan_policy_name(plan), names[p]);
        ck_assert_uint_eq(qm_plan_total(plan), 3);
        for (size_t i = 0; i < 3; i++)
            ck_assert_uint_eq(qm_plan_bank_at(plan, i)->bank_id, i);
        /* The non-pageable bank is the same whatever the policy. */
        const qm_plan_bank *b1 = qm_plan_find_bank(plan, 1);
        ck_assert_int_eq(b1->decision.reason, QM_DEGRADATION_NON_PAGEABLE_CATALOG);
        ck_assert_str_eq(b1->decision.detail, "not_expert_major: fc1: leading dim 3 != experts 4");
        size_t expect_split = strcmp(names[p], "whole_bank") ? 2 : 0;
        ck_assert_uint_eq(qm_plan_per_expert_count(plan), expect_split);
        if (expect_split) {
            const qm_plan_bank *b0 = qm_plan_find_bank(plan, 0);
            ck_assert_uint_eq(b0->decision.n_experts, 4);
            ck_assert_uint_eq(b0->bytes_per_expert, 200);
        }
        qm_plan_free(plan);
        qm_policy_destroy(&pol);
    }
    fx_free(&fx);
}
END_TEST

START_TEST(test_policy_registry_rejects_unknown_names_and_bad_params)
{
    qm_policy pol;
    qm_status st;
    qm_status_clear(&st);
    ck_assert_int_eq(qm_policy_new("mru", NULL, &pol, &st), QM_EINVAL);
    ck_assert_ptr_nonnull(strstr(st.msg, "whole_bank, static_hot, lru, lfu"));
    ck_assert_ptr_null(strstr(st.msg, "belady")); /* not offered */
    ck_assert_str_eq(st.field, "policy");
    ck_assert_ptr_null(pol.iface);
    ck_assert_int_eq(qm_policy_new("belady", NULL, &pol, &st), QM_EINVAL);
    qm_policy_value v = {"decay", 1.5};
    qm_policy_params params = {.version = QM_POLICY_PARAMS_VERSION, .values = &v, .n_values = 1};
    ck_assert_int_eq(qm_policy_new("lfu", &params, &pol, &st), QM_EINVAL);
    ck_assert_str_eq(st.field, "policy_params.decay");
    v = (qm_policy_value){"pin_fraction", -0.1};
    ck_assert_int_eq(qm_policy_new("static_hot", &params, &pol, &st), QM_EINVAL);
    ck_assert_str_eq(st.field, "policy_params.pin_fraction");
    /* A knob the policy does not declare, named with who takes it. */
    ck_assert_int_eq(qm_policy_new("lru", &params, &pol, &st), QM_EINVAL);
    ck_assert_str_eq(st.field, "policy_params.pin_fraction");
    ck_assert_ptr_nonnull(strstr(st.msg, "applies to policy static_hot only"));
    v = (qm_policy_value){"decay", 0.5};
    params.version = 1; /* the unversioned layout */
    ck_assert_int_eq(qm_policy_new("lfu", &params, &pol, &st), QM_EINVAL);
    ck_assert_str_eq(st.field, "policy_params");
    params.version = QM_POLICY_PARAMS_VERSION;
    qm_policy_value twice[] = {{"decay", 0.5}, {"decay", 0.6}};
    params.values = twice;
    params.n_values = 2;
    ck_assert_int_eq(qm_policy_new("lfu", &params, &pol, &st), QM_EINVAL);
    ck_assert_str_eq(st.field, "policy_params.decay");
    /* The daemon's checks: offered names only. */
    ck_assert_int_eq(qm_policy_params_check("belady", NULL, &st), QM_EINVAL);
    ck_assert_str_eq(st.field, "policy");
    ck_assert_int_eq(qm_policy_params_check("lfu", &params, &st), QM_EINVAL);
    params.n_values = 1;
    ck_assert_int_eq(qm_policy_params_check("lfu", &params, &st), 0);
    ck_assert_int_eq(qm_policy_new(NULL, NULL, &pol, &st), 0); /* default */
    ck_assert_str_eq(pol.iface->name, "whole_bank");
    qm_policy_destroy(&pol);
    qm_policy_destroy(&pol); /* idempotent */
    qm_policy_destroy(NULL);
}
END_TEST

/* The registry is the one list: names offered in order, every policy makes
 * and validates through it, and a knob two policies share has one range
 * (the wire decoder checks a value before it knows the policy). */
START_TEST(test_registry_lists_every_policy_and_shared_knobs_have_one_range)
{
    char names[256];
    size_t len = qm_policy_names(names, sizeof names);
    /* The list is the registry's offered policies in its order; the shipped
     * ones are all there. */
    char walked[256] = "";
    for (size_t i = 0; i < qm_policy_count(); i++)
        if (qm_policy_offered_at(i))
            snprintf(walked + strlen(walked), sizeof walked - strlen(walked), "%s%s",
                     walked[0] ? ", " : "", qm_policy_name_at(i));
    ck_assert_str_eq(names, walked);
    ck_assert_uint_eq(len, strlen(names));
    const char *shipped[] = {"whole_bank", "static_hot", "lru", "lfu", "arc", "layered_lru", "next_use"};
    for (size_t i = 0; i < sizeof shipped / sizeof *shipped; i++)
        ck_assert_msg(strstr(names, shipped[i]), "%s missing from %s", shipped[i], names);
    char tiny[8];
    ck_assert_uint_eq(qm_policy_names(tiny, sizeof tiny), len); /* snprintf-like */
    ck_assert_str_eq(tiny, "whole_b");
    size_t offered = 0;
    for (size_t i = 0; i < qm_policy_count(); i++) {
        const char *name = qm_policy_name_at(i);
        ck_assert_ptr_nonnull(qm_policy_summary_at(i));
        offered += (size_t)qm_policy_offered_at(i);
        qm_policy pol;
        qm_status st;
        int rc = qm_policy_new(name, NULL, &pol, &st);
        if (!qm_policy_offered_at(i)) { /* belady needs a future */
            ck_assert_int_eq(rc, QM_EINVAL);
            continue;
        }
        ck_assert_msg(rc == 0, "%s: %s", name, st.msg);
        ck_assert_str_eq(pol.iface ? "made" : "", "made");
        qm_policy_destroy(&pol);
        for (size_t j = 0; j < qm_policy_param_count(i); j++) {
            const qm_policy_param_spec *a = qm_policy_param_at(i, j);
            const char *pn = qm_policy_param_name(a);
            const qm_policy_param_spec *first = qm_policy_param_find(pn, strlen(pn));
            double amin, amax, adef, fmin, fmax;
            int aint, fint;
            qm_policy_param_range(a, &amin, &amax, &adef, &aint);
            qm_policy_param_range(first, &fmin, &fmax, NULL, &fint);
            ck_assert_msg(amin == fmin && amax == fmax && aint == fint,
                          "%s.%s: range differs from its first declaration", name, pn);
            ck_assert(adef >= amin && adef <= amax);
            /* Each bound is accepted, just outside is refused naming the knob. */
            qm_policy_value v = {pn, amax};
            qm_policy_params p = {.version = QM_POLICY_PARAMS_VERSION, .values = &v,
                                  .n_values = 1};
            ck_assert_int_eq(qm_policy_new(name, &p, &pol, &st), 0);
            qm_policy_destroy(&pol);
            v.value = amin - 0.5;
            ck_assert_int_eq(qm_policy_new(name, &p, &pol, &st), QM_EINVAL);
            char field[96];
            snprintf(field, sizeof field, "policy_params.%s", pn);
            ck_assert_str_eq(st.field, field);
        }
    }
    ck_assert_uint_ge(offered, 7);
    ck_assert_ptr_null(qm_policy_param_find("nope", 4));
    ck_assert(qm_policy_accepts_hot("static_hot") && !qm_policy_accepts_hot("next_use"));
}
END_TEST

START_TEST(test_planner_refuses_a_policy_of_another_version)
{
    static qm_policy_iface iface = {.version = QM_POLICY_IFACE_VERSION + 1, .name = "future"};
    qm_policy pol = {.iface = &iface};
    fixture fx;
    fx_mixed(&fx);
    qm_residency_plan *plan = (qm_residency_plan *)&fx; /* must be reset to NULL */
    qm_status st;
    ck_assert_int_eq(
        qm_plan_residency((const qm_region_catalog *const *)fx.cats, fx.n, &pol, NULL, &plan, &st),
        QM_EINVAL);
    ck_assert_ptr_null(plan);
    ck_assert_ptr_nonnull(strstr(st.msg, "version"));
    iface.version = QM_POLICY_IFACE_VERSION; /* right version, but no decide */
    ck_assert_int_eq(qm_policy_check(&pol, &st), QM_EINVAL);
    ck_assert_ptr_nonnull(strstr(st.msg, "decide"));
    fx_free(&fx);
}
END_TEST

START_TEST(test_planner_rejects_duplicate_bank_ids_and_null_catalogs)
{
    fixture fx = {0};
    fx.cats[fx.n++] = rt_catalog(5, 2, 1, 8);
    fx.cats[fx.n++] = rt_catalog(5, 2, 1, 8);
    qm_policy pol;
    qm_policy_new("whole_bank", NULL, &pol, NULL);
    qm_residency_plan *plan = NULL;
    qm_status st;
    ck_assert_int_eq(
        qm_plan_residency((const qm_region_catalog *const *)fx.cats, 2, &pol, NULL, &plan, &st),
        QM_EINVAL);
    ck_assert_ptr_nonnull(strstr(st.msg, "bank id 5"));
    const qm_region_catalog *with_null[2] = {fx.cats[0], NULL};
    ck_assert_int_eq(qm_plan_residency(with_null, 2, &pol, NULL, &plan, &st), QM_EINVAL);
    ck_assert_int_eq(qm_plan_residency(NULL, 1, &pol, NULL, &plan, &st), QM_EINVAL);
    ck_assert_int_eq(qm_plan_residency(NULL, 0, &pol, NULL, NULL, &st), QM_EINVAL);
    ck_assert_ptr_null(plan);
    fx_free(&fx);
}
END_TEST

/* ---- Order, counts, edge cases ----------------------------------------------- */

START_TEST(test_plan_iterates_in_ascending_bank_id_whatever_the_input_order)
{
    fixture fx = {0};
    const uint32_t ids[] = {9, 2, 40, 0, 7};
    for (size_t i = 0; i < 5; i++)
        fx.cats[fx.n++] = rt_catalog(ids[i], 2, 1, 16);
    qm_residency_plan *plan = plan_named(&fx, "lru", NULL);
    const uint32_t sorted[] = {0, 2, 7, 9, 40};
    for (size_t i = 0; i < 5; i++)
        ck_assert_uint_eq(qm_plan_bank_at(plan, i)->bank_id, sorted[i]);
    ck_assert_ptr_null(qm_plan_bank_at(plan, 5));
    ck_assert_ptr_null(qm_plan_find_bank(plan, 3));
    ck_assert_uint_eq(qm_plan_find_bank(plan, 40)->bank_id, 40);
    /* Reversing the input gives the same bytes. */
    fixture rev = {0};
    for (size_t i = 0; i < 5; i++)
        rev.cats[rev.n++] = fx.cats[4 - i];
    qm_residency_plan *again = plan_named(&rev, "lru", NULL);
    char *a = json_of(plan), *b = json_of(again);
    ck_assert_str_eq(a, b);
    qm_free(a);
    qm_free(b);
    qm_plan_free(again);
    qm_plan_free(plan);
    fx_free(&fx);
}
END_TEST

START_TEST(test_resident_and_degraded_counts_are_disjoint_and_sum_with_splits)
{
    fixture fx;
    fx_mixed(&fx);
    fx.cats[fx.n++] = rt_catalog(3, 1, 1, 8); /* single expert: degraded */
    qm_residency_plan *plan = plan_named(&fx, "whole_bank", NULL);
    ck_assert_uint_eq(qm_plan_resident_count(plan), 2);
    ck_assert_uint_eq(qm_plan_degraded_count(plan), 2);
    ck_assert_uint_eq(qm_plan_per_expert_count(plan), 0);
    qm_plan_free(plan);
    plan = plan_named(&fx, "lfu", NULL);
    ck_assert_uint_eq(qm_plan_resident_count(plan), 0);
    ck_assert_uint_eq(qm_plan_degraded_count(plan), 2);
    ck_assert_uint_eq(qm_plan_per_expert_count(plan), 2);
    qm_plan_free(plan);
    fx_free(&fx);
}
END_TEST

START_TEST(test_zero_banks_make_an_empty_plan)
{
    qm_policy pol;
    qm_policy_new("lru", NULL, &pol, NULL);
    qm_residency_plan *plan = NULL;
    qm_plan_options opt = {.has_budget = 1, .budget_bytes = 10};
    ck_assert_int_eq(qm_plan_residency(NULL, 0, &pol, &opt, &plan, NULL), 0);
    ck_assert_uint_eq(qm_plan_total(plan), 0);
    ck_assert_uint_eq(qm_plan_resident_count(plan), 0);
    ck_assert_uint_eq(qm_plan_degraded_count(plan), 0);
    ck_assert_ptr_null(qm_plan_bank_at(plan, 0));
    ck_assert_ptr_null(qm_plan_find_bank(plan, 0));
    char *text = json_of(plan);
    ck_assert_str_eq(text, "{\"policy\":\"lru\",\"budget_bytes\":10,\"total\":0,\"resident\":0,"
                           "\"degraded\":0,\"banks\":[]}");
    qm_free(text);
    qm_plan_free(plan);
    qm_plan_free(NULL);
    qm_policy_destroy(&pol);
}
END_TEST

START_TEST(test_single_expert_bank_stays_whole_even_for_a_splitting_policy)
{
    fixture fx = {0};
    fx.cats[fx.n++] = rt_catalog(0, 1, 3, 64);
    qm_policy pol;
    rt_policy_split_all(&pol);
    qm_residency_plan *plan = plan_with(&fx, &pol, NULL);
    const qm_plan_bank *b = qm_plan_bank_at(plan, 0);
    ck_assert_int_eq(b->decision.kind, QM_DECISION_WHOLE_BANK);
    ck_assert_int_eq(b->decision.reason, QM_DEGRADATION_NON_PAGEABLE_CATALOG);
    ck_assert_str_eq(b->decision.detail, "single_expert: bank 0 has 1 expert(s)");
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    fx_free(&fx);
}
END_TEST

/* ---- JSON ------------------------------------------------------------------------ */

START_TEST(test_plan_json_has_the_protocol_shape)
{
    fixture fx;
    fx_mixed(&fx);
    const uint32_t hot0[] = {3, 1, 3, 99};
    const uint32_t *hot[] = {hot0};
    const size_t hot_len[] = {4};
    qm_policy_params params = {.version = QM_POLICY_PARAMS_VERSION, .hot = hot, .hot_len = hot_len, .n_hot_banks = 1};
    qm_policy pol;
    ck_assert_int_eq(qm_policy_new("static_hot", &params, &pol, NULL), 0);
    qm_plan_options opt = {.has_budget = 1, .budget_bytes = 1000};
    qm_residency_plan *plan = plan_with(&fx, &pol, &opt);
    char *text = json_of(plan);
    ck_assert_str_eq(
        text,
        "{\"policy\":\"static_hot\",\"budget_bytes\":1000,\"total\":3,\"resident\":0,"
        "\"degraded\":1,\"banks\":["
        "{\"bank\":0,\"layer\":0,\"decision\":\"per_expert_candidate\",\"reason\":null,"
        "\"experts\":[0,1,2,3],\"pinned\":[1,3],\"bytes_per_expert\":200},"
        "{\"bank\":1,\"layer\":1,\"decision\":\"whole_bank_resident\",\"reason\":{\"kind\":"
        "\"non_pageable_catalog\",\"detail\":\"not_expert_major: fc1: leading dim 3 != experts "
        "4\"},\"experts\":null},"
        "{\"bank\":2,\"layer\":2,\"decision\":\"per_expert_candidate\",\"reason\":null,"
        "\"experts\":[0,1],\"pinned\":[],\"bytes_per_expert\":50}]}");
    /* Serialising the same plan twice gives the same bytes. */
    char *again = json_of(plan);
    ck_assert_str_eq(text, again);
    qm_free(again);
    qm_free(text);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    fx_free(&fx);
}
END_TEST

static int decline_decide(void *ctx, const qm_policy_input *in, qm_residency_decision *out)
{
    (void)ctx;
    out->kind = QM_DECISION_WHOLE_BANK;
    out->reason = in->bank_id == 0 ? QM_DEGRADATION_POLICY_DECLINED_SPLIT : QM_DEGRADATION_NONE;
    return in->bank_id == 2 ? QM_EINTERNAL : 0;
}

START_TEST(test_plan_json_writes_each_reason_kind_and_null_budget)
{
    static const qm_policy_iface iface = {
        .version = QM_POLICY_IFACE_VERSION, .name = "decliner", .decide = decline_decide};
    qm_policy pol = {.iface = &iface};
    fixture fx;
    fx_mixed(&fx);
    qm_residency_plan *plan = plan_with(&fx, &pol, NULL);
    char *text = json_of(plan);
    ck_assert_str_eq(
        text,
        "{\"policy\":\"decliner\",\"budget_bytes\":null,\"total\":3,\"resident\":0,"
        "\"degraded\":3,\"banks\":["
        "{\"bank\":0,\"layer\":0,\"decision\":\"whole_bank_resident\",\"reason\":{\"kind\":"
        "\"policy_declined_split\"},\"experts\":null},"
        "{\"bank\":1,\"layer\":1,\"decision\":\"whole_bank_resident\",\"reason\":{\"kind\":"
        "\"non_pageable_catalog\",\"detail\":\"not_expert_major: fc1: leading dim 3 != experts "
        "4\"},\"experts\":null},"
        "{\"bank\":2,\"layer\":2,\"decision\":\"whole_bank_resident\",\"reason\":{\"kind\":"
        "\"rejected_by_validation\",\"detail\":\"rule decide_failed: policy 'decliner' returned "
        "INTERNAL for bank 2\"},\"experts\":null}]}");
    qm_free(text);
    qm_plan_free(plan);
    fx_free(&fx);
}
END_TEST

START_TEST(test_plan_json_adds_layer_and_resident_now_from_state)
{
    fixture fx;
    fx_mixed(&fx);
    qm_residency_plan *plan = plan_named(&fx, "lru", NULL);
    const uint32_t now0[] = {2, 0};
    qm_plan_json_bank_state banks[] = {
        {.bank_id = 2, .has_layer = 1, .layer = 12, .has_resident_now = 1},
        {.bank_id = 0, .has_resident_now = 1, .resident_now = now0, .n_resident_now = 2},
        {.bank_id = 77, .has_layer = 1, .layer = 1}, /* no such bank: ignored */
    };
    qm_plan_json_state state = {.banks = banks,
                                .n_banks = 3,
                                .has_resident_bytes = 1,
                                .resident_bytes = 9007199254740993ULL}; /* 2^53 + 1: exact */
    char *text = NULL;
    ck_assert_int_eq(qm_plan_to_json_ex(plan, &state, &text, NULL, NULL), 0);
    ck_assert_str_eq(
        text,
        "{\"policy\":\"lru\",\"budget_bytes\":null,\"total\":3,\"resident\":0,\"degraded\":1,"
        "\"resident_bytes\":9007199254740993,\"banks\":["
        "{\"bank\":0,\"layer\":0,\"decision\":\"per_expert_candidate\",\"reason\":null,"
        "\"experts\":[0,1,2,3],\"pinned\":[],\"bytes_per_expert\":200,\"resident_now\":[2,0]},"
        "{\"bank\":1,\"layer\":1,\"decision\":\"whole_bank_resident\",\"reason\":{\"kind\":"
        "\"non_pageable_catalog\",\"detail\":\"not_expert_major: fc1: leading dim 3 != experts "
        "4\"},\"experts\":null},"
        "{\"bank\":2,\"layer\":12,\"decision\":\"per_expert_candidate\",\"reason\":null,"
        "\"experts\":[0,1],\"pinned\":[],\"bytes_per_expert\":50,\"resident_now\":[]}]}");
    qm_free(text);
    /* Several devices: "placement" after "resident_bytes", "device" per bank
     * before resident_now (new members only). */
    const char *names[] = {"cuda:0", "cuda:1"};
    const uint64_t budgets[] = {300, 700};
    banks[1].has_device = 1; /* bank 0 */
    banks[1].device = 0;
    banks[0].has_device = 1; /* bank 2 */
    banks[0].device = 1;
    state.placement_rule = "layers_contiguous";
    state.device_names = names;
    state.device_budgets = budgets;
    state.n_devices = 2;
    ck_assert_int_eq(qm_plan_to_json_ex(plan, &state, &text, NULL, NULL), 0);
    ck_assert_ptr_nonnull(strstr(text, "\"resident_bytes\":9007199254740993,\"placement\":{\"rule\":"
                                       "\"layers_contiguous\",\"devices\":[{\"name\":\"cuda:0\","
                                       "\"budget_bytes\":300},{\"name\":\"cuda:1\",\"budget_bytes\":"
                                       "700}]},\"banks\":["));
    ck_assert_ptr_nonnull(strstr(text, "\"bytes_per_expert\":200,\"device\":0,\"resident_now\":[2,0]}"));
    ck_assert_ptr_nonnull(strstr(text, "\"bytes_per_expert\":50,\"device\":1,\"resident_now\":[]}"));
    char *again = NULL;
    ck_assert_int_eq(qm_plan_to_json_ex(plan, &state, &again, NULL, NULL), 0);
    ck_assert_str_eq(text, again); /* deterministic */
    qm_free(again);
    qm_free(text);
    /* A NULL state is the plain plan. */
    char *plain = NULL, *plain2 = json_of(plan);
    ck_assert_int_eq(qm_plan_to_json_ex(plan, NULL, &plain, NULL, NULL), 0);
    ck_assert_str_eq(plain, plain2);
    qm_free(plain);
    qm_free(plain2);
    ck_assert_int_eq(qm_plan_to_json(NULL, &plain, NULL, NULL), QM_EINVAL);
    ck_assert_int_eq(qm_plan_to_json(plan, NULL, NULL, NULL), QM_EINVAL);
    qm_plan_free(plan);
    fx_free(&fx);
}
END_TEST

START_TEST(test_plan_json_escapes_details)
{
    fixture fx = {0};
    fx.cats[fx.n] = rt_catalog(0, 2, 1, 8);
    qm_catalog_set_nonpageable(fx.cats[fx.n++], QM_NONPAGEABLE_MISALIGNED, "a \"q\"\n\\ b");
    qm_residency_plan *plan = plan_named(&fx, "whole_bank", NULL);
    char *text = json_of(plan);
    ck_assert_ptr_nonnull(strstr(text, "\"detail\":\"misaligned: a \\\"q\\\"\\n\\\\ b\""));
    ck_assert_ptr_null(strchr(text, '\n'));
    qm_free(text);
    qm_plan_free(plan);
    fx_free(&fx);
}
END_TEST

static Suite *plan_suite(void)
{
    Suite *s = suite_create("residency_plan");
    TCase *c = tcase_create("catalog");
    tcase_add_test(c, test_catalog_reports_shape_and_bytes);
    tcase_add_test(c, test_catalog_computes_missing_region_single_expert_and_empty_unit);
    tcase_add_test(c, test_reason_names_are_stable_snake_case);
    tcase_add_test(c, test_catalog_detail_is_truncated_not_overrun);
    suite_add_tcase(s, c);
    c = tcase_create("default_policy");
    tcase_add_test(c, test_whole_bank_keeps_every_pageable_bank_resident);
    tcase_add_test(c, test_whole_bank_surfaces_the_catalog_reason_unchanged);
    tcase_add_test(c, test_computed_reasons_name_the_expert);
    tcase_add_test(c, test_min_split_bytes_keeps_small_units_whole);
    suite_add_tcase(s, c);
    c = tcase_create("substitutability");
    tcase_add_test(c, test_every_policy_plans_the_same_banks_and_only_splits_pageable_ones);
    tcase_add_test(c, test_policy_registry_rejects_unknown_names_and_bad_params);
    tcase_add_test(c, test_registry_lists_every_policy_and_shared_knobs_have_one_range);
    tcase_add_test(c, test_planner_refuses_a_policy_of_another_version);
    tcase_add_test(c, test_planner_rejects_duplicate_bank_ids_and_null_catalogs);
    suite_add_tcase(s, c);
    c = tcase_create("order_and_counts");
    tcase_add_test(c, test_plan_iterates_in_ascending_bank_id_whatever_the_input_order);
    tcase_add_test(c, test_resident_and_degraded_counts_are_disjoint_and_sum_with_splits);
    tcase_add_test(c, test_zero_banks_make_an_empty_plan);
    tcase_add_test(c, test_single_expert_bank_stays_whole_even_for_a_splitting_policy);
    suite_add_tcase(s, c);
    c = tcase_create("json");
    tcase_add_test(c, test_plan_json_has_the_protocol_shape);
    tcase_add_test(c, test_plan_json_writes_each_reason_kind_and_null_budget);
    tcase_add_test(c, test_plan_json_adds_layer_and_resident_now_from_state);
    tcase_add_test(c, test_plan_json_escapes_details);
    suite_add_tcase(s, c);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(plan_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
