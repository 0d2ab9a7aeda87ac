/* qm_policy_lfu.c - lfu with aging: each expert's count is multiplied by
 * `decay` per access to its bank, so popularity that stopped fades. Counts
 * are aged lazily (count, clock at last update), so every hook is O(1) and
 * choose_victim O(n candidates). */
#include "qm_residency.h"
#include "qm_policy_impl.h"
#include "qm_residency_impl.h"

#include <math.h>

#include "qm_alloc.h"

typedef struct lfu_ctx {
    /* history: per expert, count as of `clock`, last_tick = 1 + latest
     * access tick; per bank (qm__bank_key), clock = accesses to the bank. */
    qm__split_base base;
    double decay;
    double log_decay; /* log(decay), when 0 < decay < 1 */
} lfu_ctx;

static uint64_t bank_clock(const lfu_ctx *lfu, uint32_t bank)
{
    const qm__ref_entry *b = qm__ref_map_find(&lfu->base.history, qm__bank_key(bank));
    return b ? b->clock : 0;
}

static double aged(const lfu_ctx *lfu, const qm__ref_entry *e, uint64_t now)
{
    if (now <= e->clock || lfu->decay == 1.0) return e->count;
    if (lfu->decay == 0.0) return 0.0;
    /* exp of a precomputed log: this runs per candidate on every miss. */
    return e->count * exp((double)(now - e->clock) * lfu->log_decay);
}

static void lfu_on_access(void *ctx, qm_expert_ref ref, uint64_t tick, int hit)
{
    (void)hit;
    lfu_ctx *lfu = ctx;
    qm__ref_entry *b = qm__ref_map_upsert(&lfu->base.history, qm__bank_key(ref.bank));
    qm__ref_entry *e = qm__ref_map_upsert(&lfu->base.history, qm__ref_key(ref));
    if (!b || !e) return; /* no memory: this access is not counted */
    /* The upsert of e may have moved b: look the clock up again. */
    b = qm__ref_map_find(&lfu->base.history, qm__bank_key(ref.bank));
    uint64_t now = ++b->clock;
    e->count = aged(lfu, e, now) + 1.0;
    e->clock = now;
    e->last_tick = tick == UINT64_MAX ? tick : tick + 1;
}

static int lfu_choose_victim(void *ctx, const qm_expert_ref *candidates, size_t n, size_t *victim)
{
    lfu_ctx *lfu = ctx;
    size_t best = 0;
    double best_count = INFINITY;
    uint64_t best_tick = UINT64_MAX;
    uint32_t clock_bank = 0;
    uint64_t clock = bank_clock(lfu, 0);
    for (size_t i = 0; i < n; i++) {
        /* Candidates mostly share a bank: look its clock up only on a change. */
        if (candidates[i].bank != clock_bank) {
            clock_bank = candidates[i].bank;
            clock = bank_clock(lfu, clock_bank);
        }
        const qm__ref_entry *e = qm__ref_map_find(&lfu->base.history, qm__ref_key(candidates[i]));
        double count = e ? aged(lfu, e, clock) : 0.0;
        uint64_t tick = e ? e->last_tick : 0;
        /* Equal counts (e.g. all faded to 0): the least recent goes first. */
        if (count < best_count || (count == best_count && tick < best_tick)) {
            best_count = count;
            best_tick = tick;
            best = i;
        }
    }
    *victim = best;
    return 0;
}

static void lfu_destroy(void *ctx)
{
    lfu_ctx *lfu = ctx;
    if (!lfu) return;
    qm__split_release(&lfu->base);
    qm_free(lfu);
}

static const qm_policy_iface lfu_iface = {
    .version = QM_POLICY_IFACE_VERSION,
    .name = "lfu",
    .decide = qm__split_decide,
    .on_access = lfu_on_access,
    .choose_victim = lfu_choose_victim,
    .destroy = lfu_destroy,
};

static const qm_policy_param_spec lfu_params[] = {
    {.name = "decay", .min = 0.0, .max = 1.0, .def = QM_POLICY_LFU_DEFAULT_DECAY,
     .doc = "multiplicative decay of a count per access to its bank (1 = no aging)"},
};

static int lfu_new(const qm_policy_params *params, qm_policy *out, qm_status *st)
{
    double decay = qm__policy_param(params, &qm__policy_lfu_desc, "decay");
    lfu_ctx *lfu = qm__policy_alloc(&lfu_iface, sizeof *lfu, out, st);
    if (!lfu) return QM_ENOMEM;
    lfu->decay = decay;
    lfu->log_decay = decay > 0.0 ? log(decay) : 0.0;
    return 0;
}

const qm__policy_desc qm__policy_lfu_desc = {
    .version = QM_POLICY_DESC_VERSION,
    .name = "lfu",
    .summary = "pages every expert; evicts the least frequently used, counts aged by decay",
    .offered = 1,
    .params = lfu_params,
    .n_params = sizeof lfu_params / sizeof lfu_params[0],
    .create = lfu_new,
};
