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
#include <stdatomic.h>
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

/* Router logits, one token and expert at a time: the specification. The
 * sum runs c = 0..H-1 in double, each product exact (two floats), each
 * addition rounded once. */
static void qm__router_logits_scalar(const qm_bank_config *cfg, const qm_layer_view *layer,
                                     const float *x, uint32_t n_tokens, float *logits)
{
    const qm_tensor_view *tw = &layer->t[QM_T_ROUTER_WEIGHT];
    const qm_tensor_view *tb = &layer->t[QM_T_ROUTER_BIAS];
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
}

static int qm__routing_scalar_forced;

void qm__routing_force_scalar(int on)
{
    qm__routing_scalar_forced = on;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define QM__ROUTER_SIMD 1

/* Experts per block (four vectors of 4 doubles), columns per panel, and
 * tokens per pass over a panel. */
#define QM__RL_EB 16u
#define QM__RL_CB 128u
#define QM__RL_TB 32u

#define QM__RL_TARGET __attribute__((target("avx2,f16c")))

/* Four weights of a router row from column c, as f32 (the values
 * qm__load_float gives: f32 as is, bf16 shifted, f16 converted exactly). */
QM__RL_TARGET static inline __m128 qm__rl_load4(const void *row, qm_dtype dt, uint32_t c)
{
    if (dt == QM_DTYPE_F32)
        return _mm_loadu_ps((const float *)row + c);
    __m128i h = _mm_loadl_epi64((const __m128i *)((const uint16_t *)row + c));
    if (dt == QM_DTYPE_BF16)
        return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
    return _mm_cvtph_ps(h);
}

/* panel[c][j] = (double) W[e0 + j][c0 + c] for c < n, j < 16 (0 past E). */
QM__RL_TARGET static void qm__rl_panel(const qm_tensor_view *tw, uint32_t E, uint32_t H,
                                       uint32_t e0, uint32_t c0, uint32_t n, double *panel)
{
    const size_t es = tw->dtype == QM_DTYPE_F32 ? 4 : 2;
    for (uint32_t g = 0; g < QM__RL_EB / 4; g++) {
        uint32_t eg = e0 + 4 * g;
        uint32_t c = 0;
        if (eg + 4 <= E) {
            const uint8_t *r[4];
            for (int i = 0; i < 4; i++)
                r[i] = (const uint8_t *)tw->data + (size_t)(eg + i) * H * es;
            for (; c + 4 <= n; c += 4) {
                __m128 w0 = qm__rl_load4(r[0], tw->dtype, c0 + c);
                __m128 w1 = qm__rl_load4(r[1], tw->dtype, c0 + c);
                __m128 w2 = qm__rl_load4(r[2], tw->dtype, c0 + c);
                __m128 w3 = qm__rl_load4(r[3], tw->dtype, c0 + c);
                _MM_TRANSPOSE4_PS(w0, w1, w2, w3);
                _mm256_storeu_pd(panel + (size_t)(c + 0) * QM__RL_EB + 4 * g, _mm256_cvtps_pd(w0));
                _mm256_storeu_pd(panel + (size_t)(c + 1) * QM__RL_EB + 4 * g, _mm256_cvtps_pd(w1));
                _mm256_storeu_pd(panel + (size_t)(c + 2) * QM__RL_EB + 4 * g, _mm256_cvtps_pd(w2));
                _mm256_storeu_pd(panel + (size_t)(c + 3) * QM__RL_EB + 4 * g, _mm256_cvtps_pd(w3));
            }
        }
        for (; c < n; c++)
            for (uint32_t i = 0; i < 4; i++)
                panel[(size_t)c * QM__RL_EB + 4 * g + i] =
                    eg + i < E ? (double)qm__load_float(tw->data, tw->dtype,
                                                        (size_t)(eg + i) * H + c0 + c)
                               : 0.0;
    }
}

/* acc[t][0..16) += the panel's columns times x[t][c0..c0 + n), for nt
 * tokens: per lane (one expert) and token the scalar's sequence of exact
 * products and rounded additions, in column order (a multiply, then an add
 * with the sum first: no FMA, so even NaN payloads follow the scalar). */
QM__RL_TARGET static void qm__rl_accumulate(const double *panel, uint32_t n, const float *x,
                                            size_t ldx, uint32_t nt, __m256d (*acc)[4])
{
    uint32_t t = 0;
    for (; t + 2 <= nt; t += 2) {
        const float *x0 = x + (size_t)t * ldx, *x1 = x0 + ldx;
        __m256d a0 = acc[t][0], a1 = acc[t][1], a2 = acc[t][2], a3 = acc[t][3];
        __m256d b0 = acc[t + 1][0], b1 = acc[t + 1][1], b2 = acc[t + 1][2], b3 = acc[t + 1][3];
        for (uint32_t c = 0; c < n; c++) {
            const double *p = panel + (size_t)c * QM__RL_EB;
            __m256d w0 = _mm256_loadu_pd(p), w1 = _mm256_loadu_pd(p + 4);
            __m256d w2 = _mm256_loadu_pd(p + 8), w3 = _mm256_loadu_pd(p + 12);
            __m256d u = _mm256_set1_pd((double)x0[c]), v = _mm256_set1_pd((double)x1[c]);
            a0 = _mm256_add_pd(a0, _mm256_mul_pd(w0, u));
            a1 = _mm256_add_pd(a1, _mm256_mul_pd(w1, u));
            a2 = _mm256_add_pd(a2, _mm256_mul_pd(w2, u));
            a3 = _mm256_add_pd(a3, _mm256_mul_pd(w3, u));
            b0 = _mm256_add_pd(b0, _mm256_mul_pd(w0, v));
            b1 = _mm256_add_pd(b1, _mm256_mul_pd(w1, v));
            b2 = _mm256_add_pd(b2, _mm256_mul_pd(w2, v));
            b3 = _mm256_add_pd(b3, _mm256_mul_pd(w3, v));
        }
        acc[t][0] = a0, acc[t][1] = a1, acc[t][2] = a2, acc[t][3] = a3;
        acc[t + 1][0] = b0, acc[t + 1][1] = b1, acc[t + 1][2] = b2, acc[t + 1][3] = b3;
    }
    for (; t < nt; t++) {
        const float *x0 = x + (size_t)t * ldx;
        __m256d a0 = acc[t][0], a1 = acc[t][1], a2 = acc[t][2], a3 = acc[t][3];
        for (uint32_t c = 0; c < n; c++) {
            const double *p = panel + (size_t)c * QM__RL_EB;
            __m256d u = _mm256_set1_pd((double)x0[c]);
            a0 = _mm256_add_pd(a0, _mm256_mul_pd(_mm256_loadu_pd(p), u));
            a1 = _mm256_add_pd(a1, _mm256_mul_pd(_mm256_loadu_pd(p + 4), u));
            a2 = _mm256_add_pd(a2, _mm256_mul_pd(_mm256_loadu_pd(p + 8), u));
            a3 = _mm256_add_pd(a3, _mm256_mul_pd(_mm256_loadu_pd(p + 12), u));
        }
        acc[t][0] = a0, acc[t][1] = a1, acc[t][2] = a2, acc[t][3] = a3;
    }
}

/* The scalar's logits, bit for bit: blocks of 16 experts, panels of 128
 * columns converted to double once per block of 32 tokens, each (token,
 * expert) sum in its own lane in column order. */
QM__RL_TARGET static void qm__router_logits_avx2(const qm_bank_config *cfg,
                                                 const qm_layer_view *layer, const float *x,
                                                 uint32_t n_tokens, float *logits)
{
    const qm_tensor_view *tw = &layer->t[QM_T_ROUTER_WEIGHT];
    const qm_tensor_view *tb = &layer->t[QM_T_ROUTER_BIAS];
    const uint32_t E = cfg->experts, H = cfg->hidden;
    double panel[QM__RL_CB * QM__RL_EB];
    __m256d acc[QM__RL_TB][4];
    double lanes[QM__RL_EB];
    for (uint32_t t0 = 0; t0 < n_tokens; t0 += QM__RL_TB) {
        uint32_t nt = n_tokens - t0 < QM__RL_TB ? n_tokens - t0 : QM__RL_TB;
        for (uint32_t e0 = 0; e0 < E; e0 += QM__RL_EB) {
            for (uint32_t t = 0; t < nt; t++)
                for (int g = 0; g < 4; g++)
                    acc[t][g] = _mm256_setzero_pd();
            for (uint32_t c0 = 0; c0 < H; c0 += QM__RL_CB) {
                uint32_t n = H - c0 < QM__RL_CB ? H - c0 : QM__RL_CB;
                qm__rl_panel(tw, E, H, e0, c0, n, panel);
                qm__rl_accumulate(panel, n, x + (size_t)t0 * H + c0, H, nt, acc);
            }
            for (uint32_t t = 0; t < nt; t++) {
                for (int g = 0; g < 4; g++)
                    _mm256_storeu_pd(lanes + 4 * g, acc[t][g]);
                for (uint32_t j = 0; j < QM__RL_EB && e0 + j < E; j++) {
                    double a = lanes[j];
                    if (tb->present)
                        a += qm__load_float(tb->data, tb->dtype, e0 + j);
                    logits[(size_t)(t0 + t) * E + e0 + j] = (float)a;
                }
            }
        }
    }
}

static int qm__router_simd_ok(void)
{
    static atomic_int ok = -1; /* every thread computes the same answer */
    int v = atomic_load_explicit(&ok, memory_order_relaxed);
    if (v < 0) {
        unsigned a, b, c, d;
        __builtin_cpu_init();
        /* F16C: CPUID.1:ECX bit 29 (not every compiler's __builtin_cpu_supports names it). */
        v = __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1);
        atomic_store_explicit(&ok, v, memory_order_relaxed);
    }
    return v;
}
#endif

#ifdef QM__ROUTER_SIMD
/* The prediction's logits: each (token, expert) a dot product in f32 with
 * FMA, 8 lanes and 4 accumulators, the weights read row by row once per
 * token (a decode's prediction has one token: one pass over the router). */
__attribute__((target("avx2,fma,f16c"))) static void
qm__router_predict_avx2(const qm_tensor_view *tw, const qm_tensor_view *tb, uint32_t E, uint32_t H,
                        const float *x, uint32_t n_tokens, float *logits)
{
    const size_t es = tw->dtype == QM_DTYPE_F32 ? 4 : 2;
    for (uint32_t t = 0; t < n_tokens; t++) {
        const float *xt = x + (size_t)t * H;
        for (uint32_t e = 0; e < E; e++) {
            const uint8_t *row = (const uint8_t *)tw->data + (size_t)e * H * es;
            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                           _mm256_setzero_ps()};
            uint32_t c = 0;
            for (; c + 32 <= H; c += 32)
                for (int i = 0; i < 4; i++) {
                    uint32_t ci = c + 8 * (uint32_t)i;
                    __m256 w;
                    if (tw->dtype == QM_DTYPE_F32)
                        w = _mm256_loadu_ps((const float *)row + ci);
                    else {
                        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + ci));
                        w = tw->dtype == QM_DTYPE_BF16
                                ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                : _mm256_cvtph_ps(h);
                    }
                    a[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xt + ci), a[i]);
                }
            __m256 s = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
            __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            q = _mm_add_ps(q, _mm_movehl_ps(q, q));
            q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
            float sum = _mm_cvtss_f32(q);
            for (; c < H; c++)
                sum += qm__load_float(tw->data, tw->dtype, (size_t)e * H + c) * xt[c];
            if (tb->present)
                sum += qm__load_float(tb->data, tb->dtype, e);
            logits[(size_t)t * E + e] = sum;
        }
    }
}

static int qm__router_predict_simd_ok(void)
{
    static atomic_int ok = -1;
    int v = atomic_load_explicit(&ok, memory_order_relaxed);
    if (v < 0) {
        __builtin_cpu_init();
        v = qm__router_simd_ok() && __builtin_cpu_supports("fma");
        atomic_store_explicit(&ok, v, memory_order_relaxed);
    }
    return v;
}
#endif

/* logits = x . W^T + b: the routing's exact GEMV, or (fast) the
 * prediction's f32 one where this CPU runs it. */
static int qm__router_gemv(const qm_bank_config *cfg, const qm_layer_view *layer, const float *x,
                           uint32_t n_tokens, float *logits, int fast, qm_status *st)
{
    const qm_tensor_view *tw = &layer->t[QM_T_ROUTER_WEIGHT];
    if (!tw->present)
        return qm_status_set(st, QM_EINVAL,
                             "layer %u has no router weight: pass router_logits", layer->index);
#ifdef QM__ROUTER_SIMD
    if (!qm__routing_scalar_forced && qm__router_simd_ok() &&
        (tw->dtype == QM_DTYPE_F32 || tw->dtype == QM_DTYPE_F16 || tw->dtype == QM_DTYPE_BF16)) {
        if (fast && qm__router_predict_simd_ok())
            qm__router_predict_avx2(tw, &layer->t[QM_T_ROUTER_BIAS], cfg->experts, cfg->hidden,
                                    x, n_tokens, logits);
        else
            qm__router_logits_avx2(cfg, layer, x, n_tokens, logits);
        return 0;
    }
#endif
    (void)fast;
    qm__router_logits_scalar(cfg, layer, x, n_tokens, logits);
    return 0;
}

int qm_moe_router_predict(const qm_bank_config *cfg, const qm_layer_view *layer, const float *x,
                          uint32_t n_tokens, float *logits, qm_status *st)
{
    return qm__router_gemv(cfg, layer, x, n_tokens, logits, 1, st);
}

int qm_moe_router_logits(const qm_bank_config *cfg, const qm_layer_view *layer, const float *x,
                         uint32_t n_tokens, float *logits, qm_status *st)
{
    return qm__router_gemv(cfg, layer, x, n_tokens, logits, 0, st);
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
