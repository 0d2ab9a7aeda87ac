/* qm_pager_prefetch.c - routing history, prediction of the next layer call,
 * prefetch into free or evictable slots after each forward call.
 *
 * A wrong prediction costs bandwidth and maybe a later miss, never
 * correctness: prefetched units land in slots like demand copies and are
 * waited for (fence) before their first use. */
#include <string.h>

#include "qm_alloc.h"
#include "qm_pager_copy.h"
#include "qm_pager_prefetch.h"

/* A source whose useful/issued ratio over its last window falls below the
 * threshold is switched off, and probed on one forward call in
 * QM__PF_PROBE_EVERY to see whether it has become useful again. */
#define QM__PF_WINDOW 128u
#define QM__PF_PROBE_EVERY 8u
#define QM__PF_DEFAULT_MIN_PRECISION 0.25

/* Router prediction runs the next layer's router on the current hidden
 * states: T*E*H multiply-adds. Above this many tokens (prefill) the history
 * alone predicts, so prediction never costs more than a small fraction of
 * the layer's own work. */
#define QM__ROUTER_PREDICT_MAX_TOKENS 64u

void qm__pager_history_record(qm_pager *p, uint32_t layer, const uint32_t *route, size_t n)
{
    if (layer >= p->n_layers)
        return;
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

void qm__pager_prefetch_useful(qm_pager *p, uint8_t source)
{
    p->stats.prefetch_useful++;
    if (source >= QM__PF_SOURCES)
        return;
    p->pf_win_useful[source]++;
    if (source == QM__PF_ROUTER)
        p->stats.prefetch_router_useful++;
    else if (source == QM__PF_HISTORY)
        p->stats.prefetch_history_useful++;
}

static void qm__pf_issued(qm_pager *p, uint8_t source)
{
    if (source == QM__PF_ROUTER)
        p->stats.prefetch_router_issued++;
    else if (source == QM__PF_HISTORY)
        p->stats.prefetch_history_issued++;
    if (++p->pf_win_issued[source] < QM__PF_WINDOW)
        return;
    double min = p->opt.prefetch_min_precision;
    if (min == 0.0)
        min = QM__PF_DEFAULT_MIN_PRECISION;
    /* Useful counts of this window may belong to the previous one's issues:
     * a smoothing that errs toward keeping a source on. */
    p->pf_off[source] = min > 0 && (double)p->pf_win_useful[source] < min * QM__PF_WINDOW;
    p->pf_win_issued[source] = 0;
    p->pf_win_useful[source] = 0;
}

/* Prefetches experts[i] tagged sources[i] (NULL: explicit). */
static int qm__prefetch(qm_pager *p, uint32_t layer, const uint32_t *experts,
                        const uint8_t *sources, size_t n, qm_status *st)
{
    if (!p || (n && !experts))
        return qm_status_set(st, QM_EINVAL, "qm_pager_prefetch: NULL argument");
    if (layer >= p->n_layers)
        return qm_status_set(st, QM_EINVAL, "layer %u out of range (%u layers)", layer,
                             p->n_layers);
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

int qm_pager_prefetch(qm_pager *p, uint32_t layer, const uint32_t *experts, size_t n,
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
        const uint16_t *h = call->hidden;
        for (size_t i = 0; i < (size_t)T * H; i++)
            p->pred_x[i] = call->dtype == QM_DTYPE_F16 ? qm_f16_to_f32(h[i]) : qm_bf16_to_f32(h[i]);
        x = p->pred_x;
    }
    qm_status tmp;
    if (qm_moe_router_logits(cfg, L->view, x, T, p->pred_logits, &tmp))
        return n_list;
    if (qm_moe_route_layer(cfg, L->view, p->pred_logits, T, p->pred_experts, p->pred_weights,
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

void qm__pager_prefetch_next(qm_pager *p, const qm_moe_call *call)
{
    if (!p->opt.prefetch || p->n_slots == 0)
        return;
    uint32_t next = (call->layer + 1) % p->n_layers;
    qm__layer *N = &p->layers[next];
    if (!N->paged)
        return;
    if (!p->pred_list) {
        p->pred_list = qm_malloc(sizeof(uint32_t) * N->n_experts);
        p->pred_src = qm_malloc(N->n_experts);
        if (!p->pred_list || !p->pred_src) {
            /* Prefetch is best effort; drop both, so a half-made pair is
             * never taken as ready on the next call. */
            qm_free(p->pred_list);
            qm_free(p->pred_src);
            p->pred_list = NULL;
            p->pred_src = NULL;
            return;
        }
    }
    size_t need = (size_t)call->n_tokens * qm_moe_call_k(p->cfg, call);
    size_t cap = p->opt.max_prefetch ? p->opt.max_prefetch : 2 * need;
    if (cap > N->n_experts)
        cap = N->n_experts;
    /* A switched-off source still runs on one call in QM__PF_PROBE_EVERY so
     * its precision keeps being measured. */
    int probe = p->forward_calls++ % QM__PF_PROBE_EVERY == 0;
    size_t n = 0;
    if (!p->pf_off[QM__PF_ROUTER] || probe)
        n = qm__predict_router(p, call, next, p->pred_list, 0, cap);
    else
        p->stats.prefetch_gated++;
    for (size_t i = 0; i < n; i++)
        p->pred_src[i] = QM__PF_ROUTER;
    size_t n_router = n;
    if (!p->pf_off[QM__PF_HISTORY] || probe)
        n = qm__predict_history(p, next, p->pred_list, n, cap);
    else
        p->stats.prefetch_gated++;
    for (size_t i = n_router; i < n; i++)
        p->pred_src[i] = QM__PF_HISTORY;
    for (size_t i = 0; i < n; i++)
        N->mark[p->pred_list[i]] = 0;
    qm_status tmp;
    (void)qm__prefetch(p, next, p->pred_list, p->pred_src, n, &tmp);
}

int qm__pager_prefetch_start(qm_pager *p, qm_status *st)
{
    for (uint32_t l = 0; l < p->n_layers; l++) {
        qm__layer *L = &p->layers[l];
        if (!L->paged)
            continue;
        L->words64 = (L->n_experts + 63) / 64;
        L->hist = qm_calloc((size_t)L->words64 * p->opt.history, sizeof(uint64_t));
        if (!L->hist)
            return qm_status_set(st, QM_ENOMEM, "out of memory for routing history");
        p->stats.host_bytes += (uint64_t)L->words64 * p->opt.history * 8 + L->n_experts * 6u;
    }
    return 0;
}

void qm__pager_prefetch_free(qm_pager *p)
{
    for (uint32_t l = 0; p->layers && l < p->n_layers; l++) {
        qm_free(p->layers[l].hist);
        p->layers[l].hist = NULL;
    }
    qm_free(p->pred_x);
    qm_free(p->pred_logits);
    qm_free(p->pred_experts);
    qm_free(p->pred_weights);
    qm_free(p->pred_list);
    qm_free(p->pred_src);
}
