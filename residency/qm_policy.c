/* qm_policy.c - the policy seam: the only call sites of qm_policy_iface
 * (version check, optional methods defaulted here), helpers shared by the
 * splitting policies, and the default policy, whole_bank. The names live in
 * qm_policy_registry.c. */
#include "qm_residency.h"
#include "qm_policy_impl.h"
#include "qm_residency_impl.h"

#include <string.h>

#include "qm_alloc.h"

int qm_policy_check(const qm_policy *policy, qm_status *st)
{
    if (!policy || !policy->iface) return qm_status_set(st, QM_EINVAL, "policy has no interface");
    const qm_policy_iface *iface = policy->iface;
    if (iface->version != QM_POLICY_IFACE_VERSION)
        return qm_status_set(st, QM_EINVAL, "policy interface version %d, expected %d",
                             iface->version, QM_POLICY_IFACE_VERSION);
    if (!iface->name || !iface->name[0]) return qm_status_set(st, QM_EINVAL, "policy has no name");
    if (!iface->decide)
        return qm_status_set(st, QM_EINVAL, "policy '%s' has no decide method", iface->name);
    return 0;
}

int qm_policy_decide(const qm_policy *policy, const qm_policy_input *in, qm_residency_decision *out)
{
    if (!out) return QM_EINVAL;
    memset(out, 0, sizeof *out);
    if (!policy || !policy->iface || !policy->iface->decide || !in) return QM_EINVAL;
    return policy->iface->decide(policy->ctx, in, out);
}

void qm_policy_on_access(const qm_policy *policy, qm_expert_ref ref, uint64_t tick, int hit)
{
    if (policy && policy->iface && policy->iface->on_access)
        policy->iface->on_access(policy->ctx, ref, tick, hit);
}

void qm_policy_on_insert(const qm_policy *policy, qm_expert_ref ref, uint64_t tick)
{
    if (policy && policy->iface && policy->iface->on_insert)
        policy->iface->on_insert(policy->ctx, ref, tick);
}

void qm_policy_on_evict(const qm_policy *policy, qm_expert_ref ref)
{
    if (policy && policy->iface && policy->iface->on_evict)
        policy->iface->on_evict(policy->ctx, ref);
}

int qm_policy_choose_victim(const qm_policy *policy, const qm_expert_ref *candidates, size_t n,
                            size_t *victim)
{
    if (!candidates || n == 0 || !victim) return QM_EINVAL;
    /* No opinion: the caller keeps its own LRU, so that is the default. */
    if (!policy || !policy->iface || !policy->iface->choose_victim) return QM_EUNSUPPORTED;
    size_t pick = n; /* out of range unless the policy writes a real index */
    int rc = policy->iface->choose_victim(policy->ctx, candidates, n, &pick);
    if (rc < 0) return rc;
    if (rc > 0 || pick >= n) return QM_EINVAL;
    *victim = pick;
    return 0;
}

void qm_policy_destroy(qm_policy *policy)
{
    if (!policy) return;
    if (policy->iface && policy->iface->destroy) policy->iface->destroy(policy->ctx);
    policy->iface = NULL;
    policy->ctx = NULL;
}

/* ---- Shared helpers of the splitting policies ---------------------------- */

int qm__decide_split_all(const qm_policy_input *in, uint32_t **scratch, size_t *scratch_cap,
                         qm_residency_decision *out)
{
    out->kind = QM_DECISION_WHOLE_BANK;
    if (qm_catalog_reason(in->catalog) != QM_NONPAGEABLE_NONE)
        return 0; /* the planner surfaces the catalog's own reason */
    uint32_t n = qm_catalog_expert_count(in->catalog);
    if (*scratch_cap < n) {
        uint32_t *grown = qm_realloc(*scratch, (size_t)n * sizeof **scratch);
        if (!grown) return QM_ENOMEM;
        *scratch = grown;
        *scratch_cap = n;
    }
    for (uint32_t e = 0; e < n; e++)
        (*scratch)[e] = e;
    out->kind = QM_DECISION_PER_EXPERT;
    out->experts = *scratch;
    out->n_experts = n;
    return 0;
}

void qm__ref_map_reserve_bank(qm__ref_map *map, const qm_policy_input *in)
{
    size_t more = (size_t)qm_catalog_expert_count(in->catalog) + 1; /* + the bank's clock */
    (void)qm__ref_map_reserve(map, map->len + more);
}

int qm__split_decide(void *ctx, const qm_policy_input *in, qm_residency_decision *out)
{
    qm__split_base *base = ctx;
    int rc = qm__decide_split_all(in, &base->experts, &base->experts_cap, out);
    if (rc == 0 && out->kind == QM_DECISION_PER_EXPERT) qm__ref_map_reserve_bank(&base->history, in);
    return rc;
}

void *qm__policy_alloc(const qm_policy_iface *iface, size_t size, qm_policy *out, qm_status *st)
{
    void *ctx = qm_calloc(1, size);
    if (!ctx) {
        qm_status_set(st, QM_ENOMEM, "out of memory creating policy '%s'", iface->name);
        return NULL;
    }
    out->iface = iface;
    out->ctx = ctx;
    return ctx;
}

void qm__split_release(qm__split_base *base)
{
    qm__ref_map_free(&base->history);
    qm_free(base->experts);
}

void qm__split_destroy(void *ctx)
{
    if (!ctx) return;
    qm__split_release(ctx);
    qm_free(ctx);
}

void qm__layered_bank_phase(void *ctx, uint32_t bank, qm__bank_phase *ph)
{
    const qm__layered_base *base = ctx;
    qm__layer_clock_phase(&base->clock, &base->split.history, bank, ph);
}

/* ---- whole_bank: the default; equal to having no residency machinery ----- */

static int whole_bank_decide(void *ctx, const qm_policy_input *in, qm_residency_decision *out)
{
    (void)ctx;
    (void)in;
    out->kind = QM_DECISION_WHOLE_BANK; /* the planner adds the catalog's reason if any */
    return 0;
}

static const qm_policy_iface whole_bank_iface = {
    .version = QM_POLICY_IFACE_VERSION,
    .name = "whole_bank",
    .decide = whole_bank_decide,
};

const qm__policy_desc qm__policy_whole_bank_desc = {
    /* no ctx */
    QM__POLICY_OFFERED(whole_bank_iface, "every bank whole-bank resident; the same as no "
                                         "residency machinery (default)"),
};
