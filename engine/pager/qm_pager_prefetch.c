/* qm_pager_prefetch.c - routing history, prediction of the next layer call,
 * prefetch into free or evictable slots after each forward call.
 *
 * A wrong prediction costs bandwidth and maybe a later miss, never
 * correctness: prefetched units land in slots like demand copies and are
 * waited for (fence) before their first use. */
#include <string.h>

#include "qm_alloc.h"
#include "qm_clock.h"
#include "qm_half.h"
#include "qm_kernels.h"
#include "qm_pager_copy.h"
#include "qm_pager_prefetch.h"

/* A source whose measured precision (experts it predicted that the call
 * they were about used) over its last QM__PF_WINDOW predicted experts falls
 * below the threshold is switched off, and probed on one forward call in
 * QM__PF_PROBE_EVERY (it predicts and is scored, and fetches nothing) to
 * see whether it has become useful again. */
#define QM__PF_WINDOW 128u
#define QM__PF_PROBE_EVERY 8u
#define QM__PF_DEFAULT_MIN_PRECISION 0.5
#define QM__PF_USEFUL_MIN_ISSUED 16u
#define QM__PF_HOLD_WINDOWS 8u

/* Router prediction runs the next layer's router on the current hidden
 * states: T*E*H multiply-adds. Above this many tokens (prefill) the history
 * alone predicts, so prediction never costs more than a small fraction of
 * the layer's own work. */
#define QM__ROUTER_PREDICT_MAX_TOKENS 64u

static void qm__pf_score(qm_pager *p, uint32_t layer, const uint32_t *route, size_t n);

void qm__pager_history_record(qm_pager *p, uint32_t layer, const uint32_t *route, size_t n)
{
    if (layer >= p->n_layers)
        return;
    qm__pf_score(p, layer, route, n);
    qm__layer *L = &p->layers[layer];
    if (!L->paged || !L->hist)
        return;
    uint64_t *bits = L->hist + (size_t)L->hist_pos * L->words64;
    memset(bits, 0, (size_t)L->words64 * sizeof *bits);
    for (size_t i = 0; i < n; i++)
        if (route[i] < L->n_experts)
            bits[route[i] / 64] |= 1ull << (route[i] % 64);
    L->hist_pos = (L->hist_pos + 1) % p->opt.history;
    if (L->hist_count < p->opt.history)
        L->hist_count++;
}

/* The arguments of a warm or prefetch call (qm_pager.c's qm_pager_warm too). */
int qm__pager_check_call(const qm_pager *p, const char *fn, uint32_t layer,
                         const uint32_t *experts, size_t n, qm_status *st)
{
    if (!p || (n && !experts))
        return qm_status_set(st, QM_EINVAL, "%s: NULL argument", fn);
    if (layer >= p->n_layers)
        return qm_status_set(st, QM_EINVAL, "layer %u out of range (%u layers)", layer,
                             p->n_layers);
    return 0;
}

/* Source `source`'s count of prefetches issued, or of those used before
 * eviction (`useful`); NULL for an explicit prefetch (no source). */
static uint64_t *qm__pf_count(qm_pager *p, uint8_t source, int useful)
{
    qm_pager_stats *s = &p->stats;
    switch (source) {
    case QM__PF_ROUTER: return useful ? &s->prefetch_router_useful : &s->prefetch_router_issued;
    case QM__PF_HISTORY: return useful ? &s->prefetch_history_useful : &s->prefetch_history_issued;
    case QM__PF_LOOKAHEAD:
        return useful ? &s->prefetch_lookahead_useful : &s->prefetch_lookahead_issued;
    default: return NULL;
    }
}

void qm__pager_prefetch_useful(qm_pager *p, uint8_t source)
{
    p->stats.prefetch_useful++;
    uint64_t *by_source = qm__pf_count(p, source, 1);
    if (by_source)
        (*by_source)++;
}

static void qm__pf_issued(qm_pager *p, uint8_t source)
{
    uint64_t *by_source = qm__pf_count(p, source, 0);
    if (by_source)
        (*by_source)++;
}

/* ---- Prediction, measured ------------------------------------------------ */

/* The statistics of `source`: predicted, correct, actual, gated. */
static uint64_t *qm__pf_counters(qm_pager *p, uint8_t source)
{
    static uint64_t none[4];
    switch (source) {
    case QM__PF_ROUTER: return &p->stats.predict_router_predicted;
    case QM__PF_HISTORY: return &p->stats.predict_history_predicted;
    case QM__PF_LOOKAHEAD: return &p->stats.predict_lookahead_predicted;
    default: return none;
    }
}

static uint64_t *qm__pf_gated(qm_pager *p, uint8_t source)
{
    switch (source) {
    case QM__PF_ROUTER: return &p->stats.predict_router_gated;
    case QM__PF_HISTORY: return &p->stats.predict_history_gated;
    default: return &p->stats.predict_lookahead_gated;
    }
}

static uint64_t qm__popcount(const uint64_t *bits, size_t words)
{
    uint64_t n = 0;
    for (size_t i = 0; i < words; i++)
        n += (uint64_t)__builtin_popcountll(bits[i]);
    return n;
}

/* The gate's decision after `predicted` more experts, `correct` of them
 * used: a full window below the threshold switches the source off, one at
 * or above it on again. A window whose prefetches were mostly not used
 * before eviction (useful < threshold x issued, over at least
 * QM__PF_USEFUL_MIN_ISSUED of them) holds the source off for
 * QM__PF_HOLD_WINDOWS windows whatever its precision: a guess can be right
 * about the call and still be evicted before it, when the budget is small
 * (GPT-OSS-20B shape at 1/3 of its GGUF: router precision 0.55, one
 * prefetch in three used). Then it fetches for one window again. */
static void qm__pf_gate(qm_pager *p, uint8_t source, uint64_t predicted, uint64_t correct)
{
    p->pf_win_predicted[source] += predicted;
    p->pf_win_correct[source] += correct;
    if (p->pf_win_predicted[source] < QM__PF_WINDOW)
        return;
    double min = p->opt.prefetch_min_precision;
    if (min == 0.0 || (min < 0 && source == QM__PF_LOOKAHEAD))
        min = QM__PF_DEFAULT_MIN_PRECISION; /* the lookahead always earns its prefetch */
    int imprecise =
        min > 0 && (double)p->pf_win_correct[source] < min * (double)p->pf_win_predicted[source];
    p->pf_win_predicted[source] = p->pf_win_correct[source] = 0;
    const uint64_t *issued = qm__pf_count(p, source, 0), *useful = qm__pf_count(p, source, 1);
    uint64_t di = 0, du = 0;
    if (issued && useful) {
        di = *issued - p->pf_win_issued0[source];
        du = *useful - p->pf_win_useful0[source];
        p->pf_win_issued0[source] = *issued;
        p->pf_win_useful0[source] = *useful;
    }
    if (p->pf_hold[source])
        p->pf_hold[source]--;
    else if (min > 0 && di >= QM__PF_USEFUL_MIN_ISSUED && (double)du < min * (double)di)
        p->pf_hold[source] = QM__PF_HOLD_WINDOWS;
    p->pf_off[source] = imprecise || p->pf_hold[source] > 0;
    uint32_t bit = 1u << (source - QM__PF_ROUTER);
    p->stats.prefetch_sources_off =
        p->pf_off[source] ? p->stats.prefetch_sources_off | bit : p->stats.prefetch_sources_off & ~bit;
}

/* A call of `layer` used route[0..n): the predictions about it are scored
 * (per source: predicted, of them used, used) and fed to the gates. */
static void qm__pf_score(qm_pager *p, uint32_t layer, const uint32_t *route, size_t n)
{
    if (!p->pf_bits)
        return;
    uint64_t *used = p->pf_bits + (size_t)QM__PF_SOURCES * QM__PF_PENDING * p->pred_words;
    int any = 0;
    for (uint8_t s = 0; s < QM__PF_SOURCES && !any; s++)
        for (uint32_t i = 0; i < QM__PF_PENDING; i++)
            any |= p->pf_pending[s][i].valid && p->pf_pending[s][i].layer == layer;
    if (!any)
        return;
    memset(used, 0, p->pred_words * sizeof *used);
    uint32_t E = p->layers[layer].n_experts;
    for (size_t i = 0; i < n; i++)
        if (route[i] < E && route[i] / 64 < p->pred_words)
            used[route[i] / 64] |= 1ull << (route[i] % 64);
    uint64_t actual = qm__popcount(used, p->pred_words);
    for (uint8_t s = 0; s < QM__PF_SOURCES; s++) {
        for (uint32_t i = 0; i < QM__PF_PENDING; i++) {
            qm__pf_pending *pd = &p->pf_pending[s][i];
            if (!pd->valid || pd->layer != layer)
                continue;
            uint64_t predicted = qm__popcount(pd->bits, p->pred_words), correct = 0;
            for (size_t w = 0; w < p->pred_words; w++)
                correct += (uint64_t)__builtin_popcountll(pd->bits[w] & used[w]);
            uint64_t *c = qm__pf_counters(p, s);
            c[0] += predicted;
            c[1] += correct;
            c[2] += actual;
            qm__pf_gate(p, s, predicted, correct);
            pd->valid = 0;
        }
    }
}

/* The cleared pending set of `source` for the next call of `layer` (its
 * own earlier one, else a free one, else the oldest's); NULL without
 * measurement memory. */
static uint64_t *qm__pf_slot(qm_pager *p, uint8_t source, uint32_t layer)
{
    if (!p->pf_bits || source >= QM__PF_SOURCES)
        return NULL;
    qm__pf_pending *pend = p->pf_pending[source], *slot = NULL;
    for (uint32_t i = 0; i < QM__PF_PENDING && !slot; i++)
        if (pend[i].valid && pend[i].layer == layer)
            slot = &pend[i];
    for (uint32_t i = 0; i < QM__PF_PENDING && !slot; i++)
        if (!pend[i].valid)
            slot = &pend[i];
    if (!slot) { /* the oldest goes (index 0); the newer moves down */
        qm__pf_pending oldest = pend[0];
        memmove(pend, pend + 1, (QM__PF_PENDING - 1) * sizeof *pend);
        pend[QM__PF_PENDING - 1] = oldest;
        slot = &pend[QM__PF_PENDING - 1];
    }
    memset(slot->bits, 0, p->pred_words * sizeof *slot->bits);
    slot->valid = 1;
    slot->layer = layer;
    return slot->bits;
}

/* Remembers what `source` predicted for the next call of `layer`. */
static void qm__pf_remember(qm_pager *p, uint8_t source, uint32_t layer, const uint32_t *experts,
                            size_t n)
{
    uint64_t *bits = qm__pf_slot(p, source, layer);
    for (size_t i = 0; bits && i < n; i++)
        if (experts[i] / 64 < p->pred_words)
            bits[experts[i] / 64] |= 1ull << (experts[i] % 64);
}

/* The history's prediction for `layer`: every expert of its remembered
 * calls (the router's picks among them included, so each source is scored
 * on what it says alone). */
static void qm__pf_remember_history(qm_pager *p, uint32_t layer)
{
    const qm__layer *L = &p->layers[layer];
    if (!L->hist || !L->hist_count)
        return;
    uint64_t *bits = qm__pf_slot(p, QM__PF_HISTORY, layer);
    size_t words = L->words64 < p->pred_words ? L->words64 : p->pred_words;
    for (uint32_t h = 0; bits && h < L->hist_count; h++)
        for (size_t w = 0; w < words; w++)
            bits[w] |= L->hist[(size_t)h * L->words64 + w];
}

/* Prefetches experts[i] tagged sources[i] (NULL: explicit). */
static int qm__prefetch(qm_pager *p, uint32_t layer, const uint32_t *experts,
                        const uint8_t *sources, size_t n, qm_status *st)
{
    int checked = qm__pager_check_call(p, "qm_pager_prefetch", layer, experts, n, st);
    if (checked)
        return checked;
    qm__layer *L = &p->layers[layer];
    if (!L->paged || p->n_slots == 0)
        return 0;
    /* Mark the predicted set so one prediction never evicts another. */
    for (size_t i = 0; i < n; i++)
        if (experts[i] < L->n_experts)
            L->mark[experts[i]] = 1;
    int issued = 0, rc = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t e = experts[i];
        if (e < L->n_experts && L->slot_of[e] >= 0)
            (void)qm__pager_copy_resume(p, L->slot_of[e]); /* guessed again: reads on */
        if (e >= L->n_experts || L->slot_of[e] >= 0)
            continue; /* out of range, resident, in flight, or a duplicate already issued */
        int32_t s = qm__pager_free_slot(p);
        if (s < 0) {
            size_t nc = 0;
            for (uint32_t k = 0; k < p->n_slots; k++) {
                const qm__slot *sl = &p->slots[k];
                if (!qm__pager_evictable(p, (int32_t)k))
                    continue;
                if (sl->layer == layer && L->mark[sl->expert])
                    continue;
                p->cand_slots[nc++] = (int32_t)k;
            }
            if (nc == 0)
                break;
            s = qm__pager_pick_victim(p, nc);
            qm__pager_evict(p, s);
        }
        uint8_t source = sources ? sources[i] : QM__PF_EXPLICIT;
        rc = qm__pager_claim(p, s, layer, e, QM__CLAIM_PREFETCH, source, st);
        if (rc)
            break;
        rc = qm__pager_copy_unit(p, s, st);
        if (rc) {
            qm__pager_drop(p, s);
            break;
        }
        p->stats.prefetch_issued++;
        p->stats.bytes_paged_h2d += L->unit_bytes;
        qm__pf_issued(p, source);
        issued++;
    }
    for (size_t i = 0; i < n; i++)
        if (experts[i] < L->n_experts)
            L->mark[experts[i]] = 0;
    return rc ? rc : issued;
}

int qm__pager_prefetch_experts(qm_pager *p, uint32_t layer, const uint32_t *experts, size_t n,
                               qm_status *st)
{
    return qm__prefetch(p, layer, experts, NULL, n, st);
}

/* Appends the next layer's router top-k for the call's tokens to list. */
static size_t qm__predict_router(qm_pager *p, const qm_moe_call *call, uint32_t next,
                                 uint32_t *list, size_t n_list, size_t cap)
{
    const qm__layer *L = &p->layers[next];
    const qm_bank_config *cfg = p->cfg;
    uint32_t T = call->n_tokens;
    if (!L->view->t[QM_T_ROUTER_WEIGHT].present || T > QM__ROUTER_PREDICT_MAX_TOKENS ||
        !call->hidden)
        return n_list;
    size_t H = cfg->hidden, E = cfg->experts, K = cfg->k;
    if (p->pred_cap_tokens < T) {
        if (qm__pager_regrow((void **)&p->pred_x, (size_t)T * H, sizeof(float)) ||
            qm__pager_regrow((void **)&p->pred_logits, (size_t)T * E, sizeof(float)) ||
            qm__pager_regrow((void **)&p->pred_experts, (size_t)T * K, sizeof(uint32_t)) ||
            qm__pager_regrow((void **)&p->pred_weights, (size_t)T * K, sizeof(float)))
            return n_list; /* prediction is optional: skip it */
        p->pred_cap_tokens = T;
    }
    const float *x = call->hidden;
    if (call->dtype != QM_DTYPE_F32) {
        qm__load_hidden(call->dtype, call->hidden, (size_t)T * H, p->pred_x);
        x = p->pred_x;
    }
    qm_status tmp;
    /* The pager's compact copy of the router (bf16: half the bytes of the
     * bank's f32, in one block) where it has one. */
    qm_layer_view copy;
    const qm_layer_view *v = L->view;
    if (L->pred_router) {
        copy = *L->view;
        copy.t[QM_T_ROUTER_WEIGHT].data = L->pred_router;
        copy.t[QM_T_ROUTER_WEIGHT].dtype = QM_DTYPE_BF16;
        copy.t[QM_T_ROUTER_WEIGHT].nbytes = (uint64_t)E * H * 2;
        v = &copy;
    }
    if (qm_moe_router_predict(cfg, v, x, T, p->pred_logits, &tmp))
        return n_list;
    if (qm_moe_route_layer(cfg, v, p->pred_logits, T, p->pred_experts, p->pred_weights,
                           &tmp))
        return n_list;
    for (size_t i = 0; i < (size_t)T * K && n_list < cap; i++) {
        uint32_t e = p->pred_experts[i];
        if (e >= E || L->mark[e])
            continue;
        L->mark[e] = 1;
        list[n_list++] = e;
    }
    return n_list;
}

static size_t qm__predict_history(qm_pager *p, uint32_t next, uint32_t *list, size_t n_list,
                                  size_t cap)
{
    const qm__layer *L = &p->layers[next];
    for (uint32_t e = 0; e < L->n_experts && n_list < cap; e++) {
        if (L->mark[e])
            continue;
        for (uint32_t h = 0; h < L->hist_count; h++) {
            if (L->hist[(size_t)h * L->words64 + e / 64] >> (e % 64) & 1) {
                L->mark[e] = 1;
                list[n_list++] = e;
                break;
            }
        }
    }
    return n_list;
}

/* Whether `source` predicts on this call: on, or off but probed (scored,
 * not fetched: qm__pf_fetches). Counts the calls an off source fetches
 * nothing. */
static int qm__pf_runs(qm_pager *p, uint8_t source, int probe)
{
    if (!p->pf_off[source])
        return 1;
    p->stats.prefetch_gated++;
    (*qm__pf_gated(p, source))++;
    return probe;
}

/* Whether what `source` predicts on this call is fetched: only while it is
 * on. A probe of an off source is scored and nothing more: its guesses are
 * below the gate's precision, and under a memory cap the disk is the bound,
 * so each wrong one would take a demand read's time. */
static int qm__pf_fetches(const qm_pager *p, uint8_t source)
{
    return !p->pf_off[source];
}

/* Takes list[from..n) back out of the prefetch (their marks cleared). */
static size_t qm__pf_unlist(qm__layer *N, const uint32_t *list, size_t from, size_t n)
{
    for (size_t i = from; i < n; i++)
        N->mark[list[i]] = 0;
    return from;
}

/* Whether this forward call probes the sources that fetch nothing on it
 * (switched off, or held by the trial): one call in QM__PF_PROBE_EVERY,
 * drawn by a hash of the call count rather than every eighth call, which
 * for a model of 8, 16, 32 or 48 layers would be one layer's calls only. */
static int qm__pf_probe(qm_pager *p)
{
    uint64_t z = ++p->forward_calls * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return ((z ^ (z >> 31)) % QM__PF_PROBE_EVERY) == 0;
}

/* The router of the layer two calls ahead on this call's hidden states.
 * Prefetched (after the next layer's, so it never takes their place) only
 * once its measured precision has reached the gate's threshold: it starts
 * off, since a wrong guess two calls ahead costs the next layer's
 * prefetches their slots. It runs (a router GEMV on the call's critical
 * path) on the calls it fetches for, and on probe calls while it is off or
 * the trial holds prefetch, where it is only measured. */
static void qm__predict_lookahead(qm_pager *p, const qm_moe_call *call, uint32_t ahead,
                                  size_t cap, int held, int probe)
{
    qm__layer *A = &p->layers[ahead];
    if (!A->paged || !p->pred_list2 || ahead == call->layer)
        return;
    const int off = p->pf_off[QM__PF_LOOKAHEAD];
    if (off) {
        p->stats.prefetch_gated++;
        p->stats.predict_lookahead_gated++;
    }
    if ((off || held) && !probe)
        return;
    size_t n = qm__predict_router(p, call, ahead, p->pred_list2, 0, cap);
    for (size_t i = 0; i < n; i++)
        A->mark[p->pred_list2[i]] = 0;
    if (!n)
        return;
    qm__pf_remember(p, QM__PF_LOOKAHEAD, ahead, p->pred_list2, n);
    if (off || held)
        return; /* measured only (the trial's hold is counted once a call) */
    for (size_t i = 0; i < n; i++)
        p->pred_src[i] = QM__PF_LOOKAHEAD;
    qm_status tmp;
    (void)qm__prefetch(p, ahead, p->pred_list2, p->pred_src, n, &tmp);
}

/* The trial's state in the statistics: bit 3 of prefetch_sources_off
 * while it holds prefetch, and what it measured. */
static void qm__pf_trial_publish(qm_pager *p)
{
    const qm__pf_trial *t = &p->trial;
    const uint32_t bit = 1u << 3;
    p->stats.prefetch_sources_off =
        t->held ? p->stats.prefetch_sources_off | bit : p->stats.prefetch_sources_off & ~bit;
    p->stats.prefetch_trial_decisions = t->decisions;
    p->stats.prefetch_trial_decisions_held = t->decisions_held;
    p->stats.prefetch_trial_fetch_ns_per_token = t->ns_per_token[0];
    p->stats.prefetch_trial_held_ns_per_token = t->ns_per_token[1];
}

static void qm__prefetch_now(qm_pager *p, const qm_moe_call *call, uint32_t k)
{
    /* Every call is timed, whether or not the next layer is paged, once
     * the budget is full (its first eviction): before, a prefetch lands in
     * a free slot and evicts nothing, and a filling cache's misses would
     * weigh on whichever mode came first. */
    int held = p->stats.evictions ? qm__pf_trial_call(&p->trial, call->n_tokens, qm__now_us()) : 0;
    qm__pf_trial_publish(p);
    uint32_t next = (call->layer + 1) % p->n_layers;
    qm__layer *N = &p->layers[next];
    if (!N->paged)
        return;
    if (!p->pred_list) {
        size_t cap = 2 * p->pred_words * 64;
        p->pred_list = qm_malloc(sizeof(uint32_t) * cap);
        p->pred_list2 = qm_malloc(sizeof(uint32_t) * cap);
        p->pred_src = qm_malloc(cap);
        if (!p->pred_list || !p->pred_list2 || !p->pred_src) {
            /* Prefetch is best effort; drop all, so a half-made set is
             * never taken as ready on the next call. */
            qm_free(p->pred_list);
            qm_free(p->pred_list2);
            qm_free(p->pred_src);
            p->pred_list = p->pred_list2 = NULL;
            p->pred_src = NULL;
            return;
        }
    }
    size_t need = (size_t)call->n_tokens * k;
    size_t cap = p->opt.max_prefetch ? p->opt.max_prefetch : 2 * need;
    if (cap > N->n_experts)
        cap = N->n_experts;
    /* A switched-off source still runs on one call in QM__PF_PROBE_EVERY so
     * its precision keeps being measured; so does the router while the
     * trial holds prefetch (its GEMV is the costly part of a prediction,
     * and a held call would only score it). */
    int probe = qm__pf_probe(p);
    /* Nothing missed for two tokens (every call of every layer twice): what
     * the session uses is resident, and the routers' GEMVs (the next
     * layer's, the one after) would predict what is there; they run on
     * probe calls only, until a call misses again. */
    const int quiet = !probe && p->calls_since_miss >= 2u * p->n_layers;
    size_t n = 0;
    int fetch_router = qm__pf_fetches(p, QM__PF_ROUTER);
    int fetch_history = qm__pf_fetches(p, QM__PF_HISTORY);
    if (!quiet && qm__pf_runs(p, QM__PF_ROUTER, probe) && (!held || probe))
        n = qm__predict_router(p, call, next, p->pred_list, 0, cap);
    for (size_t i = 0; i < n; i++)
        p->pred_src[i] = QM__PF_ROUTER;
    if (n)
        qm__pf_remember(p, QM__PF_ROUTER, next, p->pred_list, n);
    if (!fetch_router)
        n = qm__pf_unlist(N, p->pred_list, 0, n);
    if (qm__pf_runs(p, QM__PF_HISTORY, probe)) {
        /* Scored on its own: what the history says, router's picks included. */
        size_t h0 = n;
        n = qm__predict_history(p, next, p->pred_list, n, cap);
        for (size_t i = h0; i < n; i++)
            p->pred_src[i] = QM__PF_HISTORY;
        qm__pf_remember_history(p, next);
        if (!fetch_history)
            n = qm__pf_unlist(N, p->pred_list, h0, n);
    }
    for (size_t i = 0; i < n; i++)
        N->mark[p->pred_list[i]] = 0;
    /* Held by the trial: the history predicted and scored all the same,
     * the router on probe calls (the gates keep measuring), nothing read. */
    qm_status tmp;
    if (held)
        p->stats.prefetch_trial_held++;
    else
        (void)qm__prefetch(p, next, p->pred_list, p->pred_src, n, &tmp);
    if (p->n_layers > 2)
        qm__predict_lookahead(p, call, (call->layer + 2) % p->n_layers, need, held || quiet,
                              probe);
}

int qm__pager_prefetch_keep(qm_pager *p, const qm_moe_call *call, uint32_t k)
{
    if (!p->opt.prefetch || p->n_slots == 0)
        return 0;
    const uint32_t T = call->n_tokens;
    const size_t TH = (size_t)T * p->cfg->hidden;
    const float *x = NULL;
    if (call->hidden && T <= QM__ROUTER_PREDICT_MAX_TOKENS) {
        if (p->pf_x_cap < TH) {
            if (qm__pager_regrow((void **)&p->pf_x, TH, sizeof(float)))
                return -1;
            p->pf_x_cap = TH;
        }
        qm__load_hidden(call->dtype, call->hidden, TH, p->pf_x);
        x = p->pf_x;
    }
    p->pf_call = (qm_moe_call){
        .layer = call->layer, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T};
    p->pf_k = k;
    p->pf_deferred = 1;
    return 0;
}

void qm__pager_prefetch_next(qm_pager *p, const qm_moe_call *call, uint32_t k)
{
    if (p->opt.prefetch && p->n_slots)
        qm__prefetch_now(p, call, k);
}

void qm__pager_prefetch_kept(qm_pager *p)
{
    if (!p->pf_deferred)
        return;
    p->pf_deferred = 0;
    qm__prefetch_now(p, &p->pf_call, p->pf_k);
}

/* The prediction's router copies: every paged layer's router weight in
 * bf16, one block. The bank's own is f32 as often as not, read through its
 * mapping one 4 KiB page at a time; the copy is half the bytes and stays
 * in the pager's memory. A T = 1 prediction on the Qwen3-30B-A3B shape
 * (2048 x 128) took 170 us of CPU with the routing's exact GEMV (double
 * sums, the bits the routing needs and prediction does not), 57 us with
 * qm_moe_router_predict on the bank's f32, 24-29 us on this copy (one
 * daemon, llama.cpp decoding, thread CPU time; 2026-12-05). */
static int qm__pred_routers(qm_pager *p, qm_status *st)
{
    if (!p->opt.prefetch)
        return 0;
    const size_t E = p->cfg->experts, H = p->cfg->hidden;
    size_t n = 0;
    for (uint32_t l = 0; l < p->n_layers; l++) {
        const qm__layer *L = &p->layers[l];
        const qm_tensor_view *tw = &L->view->t[QM_T_ROUTER_WEIGHT];
        n += L->paged && !L->absent && tw->present && tw->nbytes >= (uint64_t)E * H * 2;
    }
    if (!n)
        return 0;
    p->pred_routers = qm_malloc(n * E * H * sizeof(uint16_t));
    if (!p->pred_routers)
        return qm_status_set(st, QM_ENOMEM, "out of memory for the prediction's router copies");
    uint16_t *at = p->pred_routers;
    for (uint32_t l = 0; l < p->n_layers; l++) {
        qm__layer *L = &p->layers[l];
        const qm_tensor_view *tw = &L->view->t[QM_T_ROUTER_WEIGHT];
        if (!L->paged || L->absent || !tw->present || tw->nbytes < (uint64_t)E * H * 2)
            continue;
        for (size_t i = 0; i < E * H; i++)
            at[i] = qm_f32_to_bf16(qm__load_float(tw->data, tw->dtype, i));
        L->pred_router = at;
        at += E * H;
    }
    p->stats.host_bytes += n * E * H * sizeof(uint16_t);
    return 0;
}

int qm__pager_prefetch_start(qm_pager *p, qm_status *st)
{
    uint32_t max_experts = 1;
    for (uint32_t l = 0; l < p->n_layers; l++) {
        qm__layer *L = &p->layers[l];
        if (L->n_experts > max_experts)
            max_experts = L->n_experts;
        if (!L->paged)
            continue;
        L->words64 = (L->n_experts + 63) / 64;
        L->hist = qm_calloc((size_t)L->words64 * p->opt.history, sizeof(uint64_t));
        if (!L->hist)
            return qm_status_set(st, QM_ENOMEM, "out of memory for routing history");
        p->stats.host_bytes += (uint64_t)L->words64 * p->opt.history * 8 + L->n_experts * 6u;
    }
    int rc = qm__pred_routers(p, st);
    if (rc)
        return rc;
    /* Measurement: one bitset per pending prediction, and the scored call's. */
    p->pred_words = (max_experts + 63) / 64;
    size_t sets = (size_t)QM__PF_SOURCES * QM__PF_PENDING + 1;
    p->pf_bits = qm_calloc(sets * p->pred_words, sizeof *p->pf_bits);
    if (!p->pf_bits)
        return qm_status_set(st, QM_ENOMEM, "out of memory for prefetch measurement");
    for (uint32_t s = 0; s < QM__PF_SOURCES; s++)
        for (uint32_t i = 0; i < QM__PF_PENDING; i++)
            p->pf_pending[s][i].bits = p->pf_bits + ((size_t)s * QM__PF_PENDING + i) * p->pred_words;
    p->pf_off[QM__PF_LOOKAHEAD] = 1; /* until measured precise enough */
    /* The trial (qm_pager_trial.h): by default where a prefetch is a
     * disk read; a token is a call of each layer this pager serves. */
    uint32_t served = 0;
    for (uint32_t l = 0; l < p->n_layers; l++)
        served += !p->layers[l].absent;
    qm__pf_trial_init(&p->trial,
                      p->opt.prefetch_trial == 1 || (p->opt.prefetch_trial == 0 && p->disk),
                      served);
    p->stats.prefetch_sources_off = 1u << (QM__PF_LOOKAHEAD - QM__PF_ROUTER);
    p->stats.host_bytes += sets * p->pred_words * 8;
    return 0;
}

void qm__pager_prefetch_free(qm_pager *p)
{
    for (uint32_t l = 0; p->layers && l < p->n_layers; l++) {
        qm_free(p->layers[l].hist);
        p->layers[l].hist = NULL;
    }
    qm_free(p->pred_x);
    qm_free(p->pred_routers);
    p->pred_routers = NULL;
    qm_free(p->pf_x);
    p->pf_deferred = 0;
    qm_free(p->pred_logits);
    qm_free(p->pred_experts);
    qm_free(p->pred_weights);
    qm_free(p->pred_list);
    qm_free(p->pred_list2);
    qm_free(p->pred_src);
    qm_free(p->pf_bits);
}
