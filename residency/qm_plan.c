/* qm_plan.c - qm_plan_residency, the one place plans are made, and the plan
 * as pure data. Every decision is validated before it is accepted; an
 * invalid one degrades its own bank and nothing else. */
#include "qm_residency.h"
#include "qm_residency_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"

struct qm_residency_plan {
    char *policy_name;
    int has_budget;
    uint64_t budget_bytes;
    qm_plan_bank *banks; /* ascending bank id */
    size_t n_banks;
    size_t resident;
    size_t degraded;
};

const char *qm_degradation_kind_name(qm_degradation_kind kind)
{
    switch (kind) {
    case QM_DEGRADATION_NONE:
        return NULL;
    case QM_DEGRADATION_NON_PAGEABLE_CATALOG:
        return "non_pageable_catalog";
    case QM_DEGRADATION_POLICY_DECLINED_SPLIT:
        return "policy_declined_split";
    case QM_DEGRADATION_REJECTED_BY_VALIDATION:
        return "rejected_by_validation";
    }
    return NULL;
}

/* ---- Making a plan ------------------------------------------------------- */

typedef struct bank_order {
    uint32_t bank_id;
    size_t index;
} bank_order;

static int cmp_bank_order(const void *a, const void *b)
{
    const bank_order *x = a, *y = b;
    return (x->bank_id > y->bank_id) - (x->bank_id < y->bank_id);
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

static void bank_set_whole(qm_plan_bank *b, qm_degradation_kind reason, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Turns the bank into whole-bank resident with `reason` (NONE: plain
 * resident) and frees any per-expert arrays it held. */
static void bank_set_whole(qm_plan_bank *b, qm_degradation_kind reason, const char *fmt, ...)
{
    qm_free((void *)b->decision.experts);
    qm_free((void *)b->decision.pinned);
    memset(&b->decision, 0, sizeof b->decision);
    b->decision.kind = QM_DECISION_WHOLE_BANK;
    b->decision.reason = reason;
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(b->decision.detail, sizeof b->decision.detail, fmt, ap);
        va_end(ap);
    }
}

#define REJECT(b, ...) (bank_set_whole((b), QM_DEGRADATION_REJECTED_BY_VALIDATION, __VA_ARGS__), 0)

static void bank_set_non_pageable(qm_plan_bank *b, qm_nonpageable_reason reason, const char *detail)
{
    const char *name = qm_nonpageable_reason_name(reason);
    if (detail && detail[0])
        bank_set_whole(b, QM_DEGRADATION_NON_PAGEABLE_CATALOG, "%s: %s", name, detail);
    else
        bank_set_whole(b, QM_DEGRADATION_NON_PAGEABLE_CATALOG, "%s", name);
}

/* Copies `n` indices into a new sorted array; NULL on no memory. */
static uint32_t *sorted_copy(const uint32_t *src, size_t n)
{
    uint32_t *copy = qm_malloc(n * sizeof *copy);
    if (!copy) return NULL;
    memcpy(copy, src, n * sizeof *copy);
    qsort(copy, n, sizeof *copy, cmp_u32);
    return copy;
}

/* Validates a per-expert decision and stores it in `b`, or degrades `b`.
 * Returns 0, or QM_ENOMEM (b is then left whole-bank, owning nothing). */
static int accept_per_expert(qm_plan_bank *b, const qm_region_catalog *cat,
                             qm_nonpageable_reason cat_reason, const char *cat_detail,
                             const qm_residency_decision *d, const qm_plan_options *opt)
{
    uint32_t n_in_bank = b->n_experts_in_bank;
    uint32_t id = b->bank_id;
    if (d->n_experts == 0)
        return REJECT(b, "rule empty_experts: a per-expert decision for bank %u lists no expert",
                      id);
    if (!d->experts)
        return REJECT(b, "rule null_experts: bank %u: %zu experts announced, array is NULL", id,
                      d->n_experts);
    /* More entries than experts means a repeat or an out-of-range index;
     * refusing here also keeps a lying length from making us read far. */
    if (d->n_experts > n_in_bank)
        return REJECT(b, "rule too_many_experts: bank %u lists %zu experts, it has %u", id,
                      d->n_experts, n_in_bank);
    for (size_t i = 0; i < d->n_experts; i++) {
        uint32_t e = d->experts[i];
        if (e >= n_in_bank)
            return REJECT(b, "rule expert_out_of_range: experts[%zu] = %u, bank %u has %u experts",
                          i, e, id, n_in_bank);
        size_t n_regions = 0;
        qm_catalog_regions(cat, e, &n_regions);
        if (n_regions == 0 || qm_catalog_expert_bytes(cat, e) == 0)
            return REJECT(b,
                          "rule expert_without_region: experts[%zu] = %u has no bytes in bank %u",
                          i, e, id);
    }
    if (cat_reason != QM_NONPAGEABLE_NONE)
        return REJECT(
            b, "rule per_expert_over_non_pageable_catalog: bank %u cannot be split (%s%s%s)", id,
            qm_nonpageable_reason_name(cat_reason), cat_detail[0] ? ": " : "", cat_detail);
    if (d->n_pinned && !d->pinned)
        return REJECT(b, "rule null_pinned: bank %u: %zu pinned announced, array is NULL", id,
                      d->n_pinned);
    if (d->n_pinned > d->n_experts)
        return REJECT(b, "rule too_many_pinned: bank %u pins %zu of %zu experts", id, d->n_pinned,
                      d->n_experts);

    uint32_t *experts = sorted_copy(d->experts, d->n_experts);
    if (!experts) goto fail_experts;
    uint32_t *pinned = NULL;
    if (d->n_pinned) {
        pinned = sorted_copy(d->pinned, d->n_pinned);
        if (!pinned) goto fail_pinned;
    }
    /* From here on the bank owns both arrays: REJECT frees them. */
    b->decision.experts = experts;
    b->decision.pinned = pinned;
    for (size_t i = 1; i < d->n_experts; i++)
        if (experts[i] == experts[i - 1])
            return REJECT(b, "rule duplicate_expert: expert %u is listed more than once in bank %u",
                          experts[i], id);
    for (size_t i = 0; i < d->n_pinned; i++) {
        uint32_t p = d->pinned[i];
        if (!bsearch(&p, experts, d->n_experts, sizeof *experts, cmp_u32))
            return REJECT(
                b, "rule pinned_not_candidate: pinned[%zu] = %u is not among bank %u's experts", i,
                p, id);
    }
    for (size_t i = 1; i < d->n_pinned; i++)
        if (pinned[i] == pinned[i - 1])
            return REJECT(b, "rule duplicate_pinned: expert %u is pinned more than once in bank %u",
                          pinned[i], id);
    if (opt->has_budget && d->n_pinned) {
        /* Pins hold slots, and a slot is the bank's largest unit. */
        unsigned long long pinned_bytes;
        if (qm_mul_u64(d->n_pinned, b->bytes_per_expert, &pinned_bytes) ||
            pinned_bytes > opt->budget_bytes)
            return REJECT(b, "rule pinned_over_budget: bank %u pins %zu x %llu bytes, budget %llu",
                          id, d->n_pinned, (unsigned long long)b->bytes_per_expert,
                          (unsigned long long)opt->budget_bytes);
    }
    b->decision.kind = QM_DECISION_PER_EXPERT;
    b->decision.reason = QM_DEGRADATION_NONE;
    b->decision.detail[0] = '\0';
    b->decision.n_experts = d->n_experts;
    b->decision.n_pinned = d->n_pinned;
    return 0;

fail_pinned:
    qm_free(experts);
fail_experts:
    bank_set_whole(b, QM_DEGRADATION_NONE, NULL);
    return QM_ENOMEM;
}

static int plan_bank(qm_plan_bank *b, const qm_region_catalog *cat, const qm_policy *policy,
                     const qm_plan_options *opt)
{
    b->bank_id = qm_catalog_bank_id(cat);
    b->n_experts_in_bank = qm_catalog_expert_count(cat);
    b->bytes_per_expert = qm_catalog_bytes_per_expert(cat);
    b->bank_bytes = qm_catalog_total_bytes(cat);
    b->decision.kind = QM_DECISION_WHOLE_BANK;

    char cat_detail[QM_DECISION_DETAIL_MAX];
    qm_nonpageable_reason cat_reason = qm__catalog_reason_ex(cat, cat_detail, sizeof cat_detail);

    qm_policy_input in = {
        .bank_id = b->bank_id,
        .catalog = cat,
        .has_budget = opt->has_budget,
        .budget_bytes = opt->budget_bytes,
    };
    qm_residency_decision d;
    int rc = qm_policy_decide(policy, &in, &d);

    /* The split threshold is the planner's, not the policy's: it cannot see
     * it, so a bank below it stays whole whatever was decided. */
    if (cat_reason == QM_NONPAGEABLE_NONE && b->bytes_per_expert < opt->min_split_bytes) {
        bank_set_non_pageable(b, QM_NONPAGEABLE_BELOW_SPLIT_THRESHOLD, NULL);
        snprintf(b->decision.detail, sizeof b->decision.detail,
                 "%s: expert unit %llu bytes < min_split_bytes %llu",
                 qm_nonpageable_reason_name(QM_NONPAGEABLE_BELOW_SPLIT_THRESHOLD),
                 (unsigned long long)b->bytes_per_expert, (unsigned long long)opt->min_split_bytes);
        return 0;
    }
    /* Out of memory is not a wrong decision: degrading the bank would hand
     * the caller a different plan (whole banks, over a budget that holds the
     * split) for a transient failure. The plan fails instead. */
    if (rc == QM_ENOMEM) return rc;
    if (rc < 0)
        return REJECT(b, "rule decide_failed: policy '%s' returned %s for bank %u",
                      policy->iface->name, qm_err_name(rc), b->bank_id);
    switch (d.kind) {
    case QM_DECISION_WHOLE_BANK:
        if (cat_reason != QM_NONPAGEABLE_NONE) {
            bank_set_non_pageable(b, cat_reason, cat_detail);
        } else if (d.reason == QM_DEGRADATION_NONE) {
            bank_set_whole(b, QM_DEGRADATION_NONE, NULL);
        } else if (d.reason == QM_DEGRADATION_POLICY_DECLINED_SPLIT) {
            bank_set_whole(b, QM_DEGRADATION_POLICY_DECLINED_SPLIT, NULL);
        } else {
            /* The other reasons are the planner's to give. */
            const char *name = qm_degradation_kind_name(d.reason);
            if (name)
                return REJECT(b, "rule reserved_reason: policy gave reason %s for pageable bank %u",
                              name, b->bank_id);
            return REJECT(b, "rule unknown_reason: policy gave reason #%d for bank %u",
                          (int)d.reason, b->bank_id);
        }
        return 0;
    case QM_DECISION_PER_EXPERT:
        return accept_per_expert(b, cat, cat_reason, cat_detail, &d, opt);
    }
    return REJECT(b, "rule unknown_decision_kind: kind %d for bank %u", (int)d.kind, b->bank_id);
}

int qm_plan_residency(const qm_region_catalog *const *catalogs, size_t n_catalogs,
                      const qm_policy *policy, const qm_plan_options *options,
                      qm_residency_plan **out, qm_status *st)
{
    static const qm_plan_options no_options = {0};
    if (!out) return qm_status_set(st, QM_EINVAL, "no plan to fill");
    *out = NULL;
    int rc = qm_policy_check(policy, st);
    if (rc < 0) return rc;
    if (n_catalogs && !catalogs)
        return qm_status_set(st, QM_EINVAL, "%zu catalogs announced, array is NULL", n_catalogs);
    for (size_t i = 0; i < n_catalogs; i++)
        if (!catalogs[i]) return qm_status_set(st, QM_EINVAL, "catalogs[%zu] is NULL", i);
    const qm_plan_options *opt = options ? options : &no_options;

    bank_order *order = qm_calloc(n_catalogs ? n_catalogs : 1, sizeof *order);
    if (!order) goto fail_order;
    for (size_t i = 0; i < n_catalogs; i++) {
        order[i].bank_id = qm_catalog_bank_id(catalogs[i]);
        order[i].index = i;
    }
    qsort(order, n_catalogs, sizeof *order, cmp_bank_order);
    for (size_t i = 1; i < n_catalogs; i++) {
        if (order[i].bank_id == order[i - 1].bank_id) {
            rc = qm_status_set(st, QM_EINVAL, "bank id %u appears in catalogs[%zu] and [%zu]",
                               order[i].bank_id, order[i - 1].index, order[i].index);
            qm_free(order);
            return rc;
        }
    }

    qm_residency_plan *plan = qm_calloc(1, sizeof *plan);
    if (!plan) goto fail_plan;
    plan->policy_name = qm_strdup(policy->iface->name);
    if (!plan->policy_name) goto fail_fill;
    plan->banks = qm_calloc(n_catalogs ? n_catalogs : 1, sizeof *plan->banks);
    if (!plan->banks) goto fail_fill;
    plan->n_banks = n_catalogs;
    plan->has_budget = opt->has_budget ? 1 : 0;
    plan->budget_bytes = opt->has_budget ? opt->budget_bytes : 0;
    for (size_t i = 0; i < n_catalogs; i++) {
        qm_plan_bank *b = &plan->banks[i];
        if (plan_bank(b, catalogs[order[i].index], policy, opt) < 0) goto fail_fill;
        if (b->decision.kind == QM_DECISION_WHOLE_BANK) {
            if (b->decision.reason == QM_DEGRADATION_NONE)
                plan->resident++;
            else
                plan->degraded++;
        }
    }
    qm_free(order);
    *out = plan;
    return 0;

fail_fill:
    qm_plan_free(plan);
fail_plan:
    qm_free(order);
fail_order:
    return qm_status_set(st, QM_ENOMEM, "out of memory making a plan of %zu banks", n_catalogs);
}

void qm_plan_free(qm_residency_plan *plan)
{
    if (!plan) return;
    for (size_t i = 0; plan->banks && i < plan->n_banks; i++) {
        qm_free((void *)plan->banks[i].decision.experts);
        qm_free((void *)plan->banks[i].decision.pinned);
    }
    qm_free(plan->banks);
    qm_free(plan->policy_name);
    qm_free(plan);
}

/* ---- Queries --------------------------------------------------------------- */

const char *qm_plan_policy_name(const qm_residency_plan *plan)
{
    return plan ? plan->policy_name : "";
}
int qm_plan_has_budget(const qm_residency_plan *plan)
{
    return plan ? plan->has_budget : 0;
}
uint64_t qm_plan_budget(const qm_residency_plan *plan)
{
    return plan ? plan->budget_bytes : 0;
}
void qm_plan_set_budget(qm_residency_plan *plan, uint64_t budget_bytes)
{
    if (!plan)
        return;
    plan->has_budget = 1;
    plan->budget_bytes = budget_bytes;
}
size_t qm_plan_total(const qm_residency_plan *plan)
{
    return plan ? plan->n_banks : 0;
}
size_t qm_plan_resident_count(const qm_residency_plan *plan)
{
    return plan ? plan->resident : 0;
}
size_t qm_plan_degraded_count(const qm_residency_plan *plan)
{
    return plan ? plan->degraded : 0;
}
size_t qm_plan_per_expert_count(const qm_residency_plan *plan)
{
    return plan ? plan->n_banks - plan->resident - plan->degraded : 0;
}

const qm_plan_bank *qm_plan_bank_at(const qm_residency_plan *plan, size_t i)
{
    if (!plan || i >= plan->n_banks) return NULL;
    return &plan->banks[i];
}

const qm_plan_bank *qm_plan_find_bank(const qm_residency_plan *plan, uint32_t bank_id)
{
    size_t lo = 0, hi = plan ? plan->n_banks : 0;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        uint32_t id = plan->banks[mid].bank_id;
        if (id == bank_id) return &plan->banks[mid];
        if (id < bank_id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}
