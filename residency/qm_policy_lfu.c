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
    e->last_tick = qm__tick_stamp(tick);
}

typedef struct lfu_scan {
    const lfu_ctx *lfu;
    uint64_t clock; /* of the bank of the candidate being ranked */
} lfu_scan;

static void lfu_scan_bank(void *ctx, uint32_t bank, qm__bank_phase *ph)
{
    (void)ph;
    lfu_scan *scan = ctx;
    scan->clock = bank_clock(scan->lfu, bank);
}

/* The least frequently used goes first; equal counts (e.g. all faded to 0)
 * to the least recent. */
static double lfu_rank(void *ctx, const qm__ref_entry *e, const qm__bank_phase *ph, int *list)
{
    (void)ph;
    (void)list;
    const lfu_scan *scan = ctx;
    return e ? -aged(scan->lfu, e, scan->clock) : 0.0;
}

static int lfu_choose_victim(void *ctx, const qm_expert_ref *candidates, size_t n, size_t *victim)
{
    lfu_scan scan = {.lfu = ctx};
    *victim = qm__victim_scan1(&scan.lfu->base.history, candidates, n, lfu_scan_bank, lfu_rank,
                               &scan);
    return 0;
}

QM__SPLIT_IFACE(lfu_iface, "lfu", .on_access = lfu_on_access, .choose_victim = lfu_choose_victim,
                .destroy = qm__split_destroy);

static const qm_policy_param_spec lfu_params[] = {
    {.name = "decay", .min = 0.0, .max = 1.0, .def = QM_POLICY_LFU_DEFAULT_DECAY,
     .doc = "multiplicative decay of a count per access to its bank (1 = no aging)"},
};

static int lfu_new(const qm_policy_params *params, qm_policy *out, qm_status *st)
{
    double decay = QM__POLICY_PARAM(params, lfu_params, "decay");
    lfu_ctx *lfu = qm__policy_alloc(&lfu_iface, sizeof *lfu, out, st);
    if (!lfu) return QM_ENOMEM;
    lfu->decay = decay;
    lfu->log_decay = decay > 0.0 ? log(decay) : 0.0;
    return 0;
}

const qm__policy_desc qm__policy_lfu_desc = {
    QM__POLICY_OFFERED(
        lfu_iface, "pages every expert; evicts the least frequently used, counts aged by decay"),
    QM__POLICY_PARAMS(lfu_params),
    .create = lfu_new,
};
