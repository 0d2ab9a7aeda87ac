/* qm_routing.c - all of the engine's routing math, on the host: router
 * logits (x . W^T + b, in double), the legacy top-k + softmax rule
 * (qm_moe_route), routing by a bank's rule (BANK_FORMAT.md "Banks imported
 * from real models"), and routing supplied by the engine (PROTOCOL.md). The
 * host routing (qm_host_route.c) and the pager's prediction call it; a
 * backend with its own routing (CUDA) implements the same semantics.
 *
 * The judge for a bank's rule is the model family's implementation in
 * Hugging Face transformers, so the arithmetic follows it: scores in f32
 * (softmax over all E logits or a sigmoid per logit), selection on score +
 * correction bias, group-limited selection that zeroes (masked_fill 0.0,
 * as transformers does, not -inf) the experts of the groups not kept, the
 * weights gathered from the unbiased scores, renormalised by their sum
 * (+1e-20) when asked, then scaled. No drop threshold: every selected
 * expert runs, as in transformers. Ties go to the larger expert index, as
 * in the legacy rule. */
#include <math.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_kernels.h"
#include "qm_moe.h"

void qm_moe_route(const float *logits, uint32_t n_tokens, uint32_t n_experts, uint32_t k,
                  uint32_t *experts, float *weights)
{
    for (uint32_t t = 0; t < n_tokens; t++) {
        const float *l = logits + (size_t)t * n_experts;
        uint32_t *ex = experts + (size_t)t * k;
        float *w = weights + (size_t)t * k;
        float val[k > 0 ? k : 1];
        /* Selection by repeated maximum: strictly greater wins, equal values go
         * to the larger index (onnxruntime's CPU kernel); NaN never beats a number. */
        for (uint32_t j = 0; j < k; j++) {
            uint32_t best = UINT32_MAX;
            for (uint32_t e = 0; e < n_experts; e++) {
                int taken = 0;
                for (uint32_t i = 0; i < j; i++)
                    taken |= ex[i] == e;
                if (taken)
                    continue;
                if (best == UINT32_MAX || l[e] >= l[best] || (isnan(l[best]) && !isnan(l[e])))
                    best = e;
            }
            ex[j] = best;
            val[j] = l[best];
        }
        /* Softmax over the k selected logits; val[0] is the largest. */
        float sum = 0.0f;
        for (uint32_t j = 0; j < k; j++) {
            w[j] = expf(val[j] - val[0]);
            sum += w[j];
        }
        for (uint32_t j = 0; j < k; j++) {
            w[j] /= sum;
            if (!(w[j] > 1e-8f)) {
                w[j] = 0.0f;
                ex[j] = QM_ROUTE_DROPPED;
            }
        }
    }
}

int qm_moe_router_logits(const qm_bank_config *cfg, const qm_layer_view *layer, const float *x,
                         uint32_t n_tokens, float *logits, qm_status *st)
{
    const qm_tensor_view *tw = &layer->t[QM_T_ROUTER_WEIGHT];
    const qm_tensor_view *tb = &layer->t[QM_T_ROUTER_BIAS];
    if (!tw->present)
        return qm_status_set(st, QM_EINVAL,
                             "layer %u has no router weight: pass router_logits", layer->index);
    const uint32_t E = cfg->experts, H = cfg->hidden;
    for (uint32_t t = 0; t < n_tokens; t++) {
        const float *xr = x + (size_t)t * H;
        for (uint32_t e = 0; e < E; e++) {
            /* Accumulated in double: routing must not hinge on f32 rounding. */
            double acc = 0.0;
            for (uint32_t c = 0; c < H; c++)
                acc += (double)qm__load_float(tw->data, tw->dtype, (size_t)e * H + c) * xr[c];
            if (tb->present)
                acc += qm__load_float(tb->data, tb->dtype, e);
            logits[(size_t)t * E + e] = (float)acc;
        }
    }
    return 0;
}

/* Index of the largest v[i] over i with !taken[i]; ties: larger index;
 * NaN never beats a number. UINT32_MAX when none is left. */
static uint32_t qm__argmax_free(const float *v, const uint8_t *taken, uint32_t n)
{
    uint32_t best = UINT32_MAX;
    for (uint32_t i = 0; i < n; i++) {
        if (taken[i])
            continue;
        if (best == UINT32_MAX || v[i] >= v[best] || (isnan(v[best]) && !isnan(v[i])))
            best = i;
    }
    return best;
}

static void qm__scores(qm_route_score kind, const float *l, uint32_t E, float *score)
{
    if (kind == QM_ROUTE_SCORE_SIGMOID) {
        for (uint32_t e = 0; e < E; e++)
            score[e] = 1.0f / (1.0f + expf(-l[e]));
        return;
    }
    float m = -INFINITY;
    for (uint32_t e = 0; e < E; e++)
        if (l[e] > m)
            m = l[e];
    float sum = 0.0f;
    for (uint32_t e = 0; e < E; e++) {
        score[e] = expf(l[e] - m);
        sum += score[e];
    }
    for (uint32_t e = 0; e < E; e++)
        score[e] /= sum;
}

int qm_moe_route_rule(const qm_routing_rule *rule, const float *correction_bias,
                      const float *logits, uint32_t n_tokens, uint32_t n_experts, uint32_t k,
                      uint32_t *experts, float *weights, qm_status *st)
{
    if (rule->score == QM_ROUTE_SCORE_LEGACY) {
        qm_moe_route(logits, n_tokens, n_experts, k, experts, weights);
        return 0;
    }
    const uint32_t E = n_experts;
    if (k == 0 || k > E)
        return qm_status_set(st, QM_EINVAL, "k = %u with %u experts", k, E);
    const uint32_t G = rule->groups > 1 && E % rule->groups == 0 ? rule->groups : 1;
    const uint32_t per_group = E / G;
    /* Heap, not stack: E reaches 65536 and this runs on worker threads. */
    float *score = qm_malloc(((size_t)2 * E + G) * sizeof(float));
    uint8_t *taken = qm_malloc(E);
    if (!score || !taken) {
        qm_free(score);
        qm_free(taken);
        return qm_status_set(st, QM_ENOMEM, "out of memory routing %u experts", E);
    }
    float *choice = score + E, *gscore = score + 2 * (size_t)E;
    for (uint32_t t = 0; t < n_tokens; t++) {
        const float *l = logits + (size_t)t * E;
        uint32_t *ex = experts + (size_t)t * k;
        float *w = weights + (size_t)t * k;
        qm__scores(rule->score, l, E, score);
        for (uint32_t e = 0; e < E; e++)
            choice[e] = correction_bias ? score[e] + correction_bias[e] : score[e];
        if (G > 1) {
            for (uint32_t g = 0; g < G; g++) {
                const float *c = choice + (size_t)g * per_group;
                memset(taken, 0, per_group);
                uint32_t a = qm__argmax_free(c, taken, per_group);
                if (rule->group_score == QM_GROUP_SCORE_TOP2_SUM) {
                    taken[a] = 1;
                    uint32_t b = qm__argmax_free(c, taken, per_group);
                    gscore[g] = c[a] + c[b];
                } else {
                    gscore[g] = c[a];
                }
            }
            memset(taken, 0, G);
            for (uint32_t j = 0; j < rule->topk_groups && j < G; j++)
                taken[qm__argmax_free(gscore, taken, G)] = 1;
            for (uint32_t e = 0; e < E; e++)
                if (!taken[e / per_group])
                    choice[e] = 0.0f;
        }
        memset(taken, 0, E);
        float sum = 0.0f;
        for (uint32_t j = 0; j < k; j++) {
            uint32_t e = qm__argmax_free(choice, taken, E);
            taken[e] = 1;
            ex[j] = e;
            w[j] = score[e];
            sum += w[j];
        }
        for (uint32_t j = 0; j < k; j++) {
            if (rule->normalize)
                w[j] /= sum + 1e-20f;
            w[j] *= rule->scale;
        }
    }
    qm_free(score);
    qm_free(taken);
    return 0;
}

int qm_moe_route_layer(const qm_bank_config *cfg, const qm_layer_view *layer,
                       const float *logits, uint32_t n_tokens, uint32_t *experts, float *weights,
                       qm_status *st)
{
    const qm_tensor_view *cb = &layer->t[QM_T_ROUTER_CORRECTION_BIAS];
    /* Validation made the bias F32 [E], aligned to its elements. */
    return qm_moe_route_rule(&cfg->routing, cb->present ? (const float *)cb->data : NULL,
                             logits, n_tokens, cfg->experts, cfg->k, experts, weights, st);
}

int qm_moe_topk_check(const int32_t *ids, uint32_t n_tokens, uint32_t n_experts, uint32_t k,
                      qm_status *st)
{
    if (k == 0 || k > n_experts)
        return qm_status_set_field(st, QM_EINVAL, "topk_ids",
                                   "topk_ids has %u columns but it must have 1..%u (experts)", k,
                                   n_experts);
    for (uint32_t t = 0; t < n_tokens; t++) {
        const int32_t *row = ids + (size_t)t * k;
        for (uint32_t j = 0; j < k; j++) {
            int32_t id = row[j];
            if (id < -1 || id >= (int64_t)n_experts)
                return qm_status_set_field(st, QM_EINVAL, "topk_ids",
                                           "topk_ids[%u][%u] = %d but it must be in [-1, %u)",
                                           t, j, (int)id, n_experts);
            for (uint32_t p = 0; id >= 0 && p < j; p++)
                if (row[p] == id)
                    return qm_status_set_field(st, QM_EINVAL, "topk_ids",
                                               "topk_ids[%u] names expert %d twice (columns %u "
                                               "and %u)", t, (int)id, p, j);
        }
    }
    return 0;
}

int qm_moe_route_supplied(const int32_t *ids, const float *w, uint32_t n_tokens,
                          uint32_t n_experts, uint32_t k, uint32_t *experts, float *weights,
                          qm_status *st)
{
    int rc = qm_moe_topk_check(ids, n_tokens, n_experts, k, st);
    if (rc < 0)
        return rc;
    for (size_t i = 0; i < (size_t)n_tokens * k; i++) {
        experts[i] = ids[i] < 0 ? QM_ROUTE_DROPPED : (uint32_t)ids[i];
        weights[i] = ids[i] < 0 ? 0.0f : w[i];
    }
    return 0;
}
