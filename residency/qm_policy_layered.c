/* qm_policy_layered.c - layer-aware policies: layered_lru and next_use.
 *
 * MoE routing visits the banks (layers) in a cycle: layer 0, 1, ..., L-1,
 * then the next token. A global LRU ranks by raw recency, so at the moment
 * layer l misses it evicts the experts of layer l+1, used longest ago and
 * needed next: the cyclic pattern that sends LRU to 0% once the budget holds
 * less than one token's experts. Both policies rank candidates by the layer
 * phase (ticks until their bank's next visit, learnt per bank by
 * qm__layer_clock, no visiting order assumed) and evict the one that is
 * expected to wait longest for a hit:
 *   layered_lru: until + period * visits_since, LRU's guess of the next use
 *                with recency counted in visits of the expert's own bank
 *                (the Layered-LRU idea of Angelopoulos et al., arXiv
 *                2509.02408): an expert of the layer just visited goes
 *                before an equally recent one of the layer visited next.
 *   next_use:    (until + period / 20) / p, slot time per expected hit,
 *                p = the chance of a use at a visit of its bank: a decayed
 *                per-visit frequency, plus a reuse bump for an expert used
 *                at the bank's last visit. The bump is learnt online (how
 *                much more often such experts came back than their
 *                frequency said), so routing with little token-to-token
 *                reuse ranks by frequency and routing with much ranks
 *                closer to recency. Given a prior (the share of each bank's
 *                visits that used each expert in earlier sessions: the
 *                model's persisted profile), an expert's count starts as if
 *                the session had routed at that frequency for the last
 *                `prior_weight` visits of the bank, and fades at the
 *                policy's decay as the session's own uses come in; an
 *                expert the session has not used yet (warm start,
 *                prefetch) goes before any it has used, the prior ranking
 *                those among themselves: a profile of other prompts then
 *                never holds a slot against the session's own experts.
 * Ties go to the least recent. Hooks are O(1) expected, choose_victim
 * O(n candidates). */
#include "qm_residency.h"
#include "qm_policy_impl.h"
#include "qm_residency_impl.h"

#include <math.h>
#include <string.h>

#include "qm_alloc.h"

/* Per expert (qm__ref_key): last_tick = 1 + tick of its latest access;
 * visit = its bank's visit number then; count = its decayed uses per visit
 * (next_use). Per bank: the layer clock's entries (qm__layer_clock). */
typedef struct layered_ctx {
    qm__layered_base base;
    int use_frequency; /* 0: layered_lru, 1: next_use */
    double decay;      /* next_use: weight kept per visit of the bank */
    /* next_use: how much more likely an expert used at its bank's last visit
     * is used again than its frequency says, learnt online: per visit, the
     * reuses of the previous visit's experts minus what their frequencies
     * predicted, over how many there were. */
    double bump;
    uint64_t cur_n, cur_reused;      /* this visit: distinct experts, reused from the last one */
    double cur_fsum;                 /* ... their frequencies before this visit */
    uint64_t prev_n;                 /* the same bank's previous visit */
    double prev_fsum;
    /* next_use: policy_params.prior, flattened: bank b's experts at
     * prior[prior_off[b] .. prior_off[b + 1]). */
    double *prior;
    size_t *prior_off;
    size_t n_prior_banks;
    double prior_weight; /* the count a use at every visit would have had */
} layered_ctx;

/* The prior's per-visit frequency of an expert (0 without one). */
static double prior_of(const layered_ctx *lc, uint64_t key)
{
    uint64_t b = key >> 32, e = key & 0xffffffffu;
    if (!lc->prior || b >= lc->n_prior_banks || e >= lc->prior_off[b + 1] - lc->prior_off[b])
        return 0.0;
    return lc->prior[lc->prior_off[b] + e];
}

/* The expert's history, made on first sight: with a prior, its count starts
 * as if it had been used at that frequency over the last `prior_weight`
 * visits of its bank (at most the decay's whole memory, 1 / (1 - decay):
 * the frequency's steady state, and at most the visits the profile saw),
 * dated before the bank's first visit (aged() fades it from there). */
static qm__ref_entry *history_of(layered_ctx *lc, qm_expert_ref ref)
{
    qm__ref_entry *e = qm__ref_map_upsert(&lc->base.split.history, qm__ref_key(ref));
    if (e && e->last_tick == 0 && e->visit == 0 && e->count == 0.0 && lc->prior &&
        lc->decay > 0.0 && lc->decay < 1.0)
        e->count = prior_of(lc, e->key) * lc->prior_weight;
    return e;
}

static double aged(const layered_ctx *lc, const qm__ref_entry *e, uint64_t bank_visits)
{
    if (bank_visits <= e->visit || lc->decay == 1.0) return e->count;
    if (lc->decay == 0.0) return 0.0;
    return e->count * pow(lc->decay, (double)(bank_visits - e->visit));
}

static double frequency(const layered_ctx *lc, const qm__ref_entry *e, uint64_t bank_visits)
{
    double f = lc->decay < 1.0 ? aged(lc, e, bank_visits) * (1.0 - lc->decay)
                               : e->count / (double)(bank_visits ? bank_visits : 1);
    return f < 1.0 ? f : 1.0;
}

/* A visit ends: learn the reuse bump from it, keep its figures on its bank
 * for the bank's next visit, and load that bank's previous ones. */
static void switch_visit(layered_ctx *lc, uint32_t next_bank)
{
    if (lc->base.clock.has_cur) {
        if (lc->prev_n) {
            double sample = ((double)lc->cur_reused - lc->prev_fsum) / (double)lc->prev_n;
            lc->bump = 0.98 * lc->bump + 0.02 * sample;
        }
        qm__ref_entry *b =
            qm__ref_map_find(&lc->base.split.history, qm__bank_key(lc->base.clock.cur_bank));
        if (b) {
            b->visit = lc->cur_n;
            b->aux = lc->cur_fsum;
        }
    }
    const qm__ref_entry *nb = qm__ref_map_find(&lc->base.split.history, qm__bank_key(next_bank));
    lc->prev_n = nb ? nb->visit : 0;
    lc->prev_fsum = nb ? nb->aux : 0.0;
    lc->cur_n = lc->cur_reused = 0;
    lc->cur_fsum = 0.0;
}

static void layered_on_access(void *ctx, qm_expert_ref ref, uint64_t tick, int hit)
{
    (void)hit;
    layered_ctx *lc = ctx;
    if (lc->use_frequency && (!lc->base.clock.has_cur || lc->base.clock.cur_bank != ref.bank))
        switch_visit(lc, ref.bank);
    uint64_t visits =
        qm__layer_clock_access(&lc->base.clock, &lc->base.split.history, ref.bank, tick);
    qm__ref_entry *e = history_of(lc, ref);
    if (!e) return; /* no memory: this expert just looks colder than it is */
    if (e->last_tick == 0 || e->visit != visits) { /* once per visit: a batch counts as one use */
        int reused = e->visit && e->visit + 1 == visits;
        e->count = aged(lc, e, visits) + 1.0;
        e->visit = visits;
        if (lc->use_frequency) { /* what frequency alone predicts for the next visit */
            lc->cur_n++;
            lc->cur_fsum += frequency(lc, e, visits);
            lc->cur_reused += (uint64_t)reused;
        }
    }
    e->visit = visits;
    e->last_tick = qm__tick_stamp(tick);
}

/* Prefetched or preloaded: resident but not used yet; recency only. */
static void layered_on_insert(void *ctx, qm_expert_ref ref, uint64_t tick)
{
    layered_ctx *lc = ctx;
    qm__ref_entry *e = history_of(lc, ref);
    if (e && e->last_tick == 0) e->last_tick = qm__tick_stamp(tick);
}

/* How long keeping the expert is expected to wait for a hit: larger = the
 * better victim. */
static double wait_of(const layered_ctx *lc, const qm__ref_entry *e, const qm__bank_phase *ph)
{
    if (!e || (e->visit == 0 && !(e->count > 0.0)))
        return INFINITY; /* never used, no prior: nothing says it is needed */
    if (!lc->use_frequency) return qm__layered_next_use(ph, e->visit);
    /* p: chance of a use at a visit of its bank. A decayed frequency (its
     * steady state is the per-visit frequency), plus the learnt reuse bump
     * when it was used at the bank's last visit. */
    double p = frequency(lc, e, ph->visits);
    if (e->visit && qm__visits_since(ph, e->visit) == 0) p += lc->bump;
    if (p > 1.0) p = 1.0;
    if (!(p > 1e-6)) p = 1e-6; /* a negative bump: rare, not never */
    /* Slot time per expected hit: the ticks until its bank's next visit
     * (plus a little, so a bank visited next still weighs its p) over p. */
    return (ph->until + 0.05 * ph->period) / p;
}

/* Equal estimates: the scan sends the least recent first. next_use ranks
 * the experts this session has not used yet (loaded at its start or
 * prefetched: only the prior, if any, says they are needed) in a list of
 * their own, evicted before any it has used. */
static double layered_rank(void *ctx, const qm__ref_entry *e, const qm__bank_phase *ph, int *list)
{
    const layered_ctx *lc = ctx;
    if (lc->use_frequency && (!e || e->visit == 0))
        *list = 1;
    return wait_of(lc, e, ph);
}

static int layered_choose_victim(void *ctx, const qm_expert_ref *candidates, size_t n,
                                 size_t *victim)
{
    layered_ctx *lc = ctx;
    size_t best[2];
    qm__victim_scan(&lc->base.split.history, candidates, n, qm__layered_bank_phase, layered_rank,
                    lc, best);
    *victim = best[1] < n ? best[1] : best[0];
    return 0;
}

static void layered_destroy(void *ctx)
{
    layered_ctx *lc = ctx;
    if (lc) {
        qm_free(lc->prior);
        qm_free(lc->prior_off);
    }
    qm__split_destroy(ctx); /* lc starts with the split base */
}

/* layered_lru and next_use: the same hooks under two names. */
#define QM__LAYERED_IFACE(var, policy_name)                                                        \
    QM__SPLIT_IFACE(var, policy_name, .on_access = layered_on_access,                              \
                    .on_insert = layered_on_insert, .choose_victim = layered_choose_victim,        \
                    .destroy = layered_destroy)
QM__LAYERED_IFACE(layered_lru_iface, "layered_lru");
QM__LAYERED_IFACE(next_use_iface, "next_use");

/* A copy of the prior, flattened (the policy owns what it keeps). */
static int copy_prior(layered_ctx *lc, const qm_policy_params *params, qm_status *st)
{
    size_t nb = params->n_prior_banks, total = 0;
    for (size_t b = 0; b < nb; b++)
        total += params->prior[b] ? params->prior_len[b] : 0;
    lc->prior_off = qm_calloc(nb + 1, sizeof *lc->prior_off);
    lc->prior = qm_calloc(total ? total : 1, sizeof *lc->prior);
    if (!lc->prior_off || !lc->prior)
        return qm_status_set(st, QM_ENOMEM, "out of memory for next_use's prior");
    for (size_t b = 0, at = 0; b < nb; b++) {
        size_t n = params->prior[b] ? params->prior_len[b] : 0;
        if (n) memcpy(lc->prior + at, params->prior[b], n * sizeof *lc->prior);
        at += n;
        lc->prior_off[b + 1] = at;
    }
    lc->n_prior_banks = nb;
    return 0;
}

static int layered_make(const qm_policy_iface *iface, double decay, qm_policy *out,
                        qm_status *st)
{
    layered_ctx *lc = qm__policy_alloc(iface, sizeof *lc, out, st);
    if (!lc) return QM_ENOMEM;
    lc->use_frequency = iface == &next_use_iface;
    lc->decay = decay;
    lc->bump = 0.1; /* a prior (Mixtral-like routing); learnt from the first visits on */
    return 0;
}

static int layered_lru_new(const qm_policy_params *params, qm_policy *out, qm_status *st)
{
    (void)params;
    return layered_make(&layered_lru_iface, 1.0, out, st);
}

static const qm_policy_param_spec next_use_params[] = {
    {.name = "decay", .min = 0.0, .max = 1.0, .def = QM_POLICY_NEXT_USE_DEFAULT_DECAY,
     .doc = "weight a use keeps per later visit of its layer (memory ~1/(1-decay) visits)"},
    {.name = "prior_weight", .min = 0.0, .max = 1000000.0,
     .def = QM_POLICY_NEXT_USE_DEFAULT_PRIOR_WEIGHT,
     .doc = "visits of its layer the model's persisted profile counts as at the start (0: none)"},
};

static int next_use_new(const qm_policy_params *params, qm_policy *out, qm_status *st)
{
    double decay = QM__POLICY_PARAM(params, next_use_params, "decay");
    double weight = QM__POLICY_PARAM(params, next_use_params, "prior_weight");
    int rc = layered_make(&next_use_iface, decay, out, st);
    if (rc || !params->prior || !params->n_prior_banks || weight <= 0.0 || decay <= 0.0 ||
        decay >= 1.0)
        return rc;
    layered_ctx *lc = out->ctx;
    /* Never more than the decay remembers, nor than the profile saw. */
    if (weight > 1.0 / (1.0 - decay)) weight = 1.0 / (1.0 - decay);
    if (params->prior_visits > 0.0 && weight > params->prior_visits)
        weight = params->prior_visits;
    lc->prior_weight = weight;
    if ((rc = copy_prior(lc, params, st)) != 0) qm_policy_destroy(out);
    return rc;
}

const qm__policy_desc qm__policy_layered_lru_desc = {
    QM__POLICY_OFFERED(layered_lru_iface,
                       "evicts the expert whose layer-aware LRU estimate of its next use is "
                       "furthest (recency counted in visits of its own layer)"),
    .create = layered_lru_new,
};

const qm__policy_desc qm__policy_next_use_desc = {
    QM__POLICY_OFFERED(next_use_iface,
                       "evicts the expert whose estimated next use is furthest (its layer's next "
                       "visit plus a per-visit decayed frequency); recommended for paged sessions"),
    QM__POLICY_PARAMS(next_use_params),
    .accepts_prior = 1,
    .create = next_use_new,
};
