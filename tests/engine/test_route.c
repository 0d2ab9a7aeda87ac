/* test_route.c - routing by a bank's rule (softmax or sigmoid score,
 * renormalised or not, scaled, group-limited, correction bias) against a
 * float64 reference written from transformers' implementations, and routing
 * supplied by the engine (topk_ids/topk_weights) through the forward pass. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_fixture.h"
#include "qm_backend.h"
#include "qm_moe.h"
#include "qm_moe_internal.h"

/* ---- float64 reference of the rule ------------------------------------------ */

/* transformers (Mixtral/Qwen/OLMoE TopKRouter, DeepseekV2Moe, DeepseekV3TopkRouter):
 * scores over E, choice = scores + bias, groups scored by max or top-2 sum,
 * topk_group groups kept and the rest masked to 0.0, top-k of the choice,
 * weights = unbiased scores gathered, / (sum + 1e-20) when normalised, x scale. */
static void ref_route(const qm_routing_rule *r, const float *bias, const float *l, uint32_t E,
                      uint32_t k, uint32_t *sel, double *w)
{
    double score[256], choice[256], gs[64];
    int taken[256] = {0}, gkeep[64] = {0};
    double m = -INFINITY, sum = 0;
    for (uint32_t e = 0; e < E; e++)
        m = l[e] > m ? l[e] : m;
    for (uint32_t e = 0; e < E; e++) {
        score[e] = r->score == QM_ROUTE_SCORE_SIGMOID ? 1.0 / (1.0 + exp(-(double)l[e]))
                                                      : exp((double)l[e] - m);
        sum += score[e];
    }
    for (uint32_t e = 0; e < E; e++) {
        if (r->score == QM_ROUTE_SCORE_SOFTMAX)
            score[e] /= sum;
        choice[e] = score[e] + (bias ? bias[e] : 0.0);
    }
    uint32_t G = r->groups, per = E / G;
    if (G > 1) {
        for (uint32_t g = 0; g < G; g++) {
            double a = -INFINITY, b = -INFINITY;
            for (uint32_t i = 0; i < per; i++) {
                double c = choice[g * per + i];
                if (c > a) {
                    b = a;
                    a = c;
                } else if (c > b) {
                    b = c;
                }
            }
            gs[g] = r->group_score == QM_GROUP_SCORE_TOP2_SUM ? a + b : a;
        }
        for (uint32_t j = 0; j < r->topk_groups; j++) {
            int best = -1;
            for (uint32_t g = 0; g < G; g++)
                if (!gkeep[g] && (best < 0 || gs[g] >= gs[best]))
                    best = (int)g;
            gkeep[best] = 1;
        }
        for (uint32_t e = 0; e < E; e++)
            if (!gkeep[e / per])
                choice[e] = 0.0;
    }
    double wsum = 0;
    for (uint32_t j = 0; j < k; j++) {
        int best = -1;
        for (uint32_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || choice[e] >= choice[best]))
                best = (int)e;
        taken[best] = 1;
        sel[j] = (uint32_t)best;
        w[j] = score[best];
        wsum += w[j];
    }
    for (uint32_t j = 0; j < k; j++)
        w[j] = (r->normalize ? w[j] / (wsum + 1e-20) : w[j]) * r->scale;
}

static float normal(uint64_t *s)
{
    float u = tl_uniform(s, 1e-7f, 1.0f), v = tl_uniform(s, 0.0f, 1.0f);
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}

typedef struct mode {
    const char *family;
    qm_routing_rule rule;
    uint32_t E, k;
    int with_bias;
} mode;

static const mode MODES[] = {
    {"mixtral", {QM_ROUTE_SCORE_SOFTMAX, 1, 1.0f, 1, 1, QM_GROUP_SCORE_MAX}, 8, 2, 0},
    {"qwen3 norm_topk_prob=false / olmoe",
     {QM_ROUTE_SCORE_SOFTMAX, 0, 1.0f, 1, 1, QM_GROUP_SCORE_MAX}, 64, 8, 0},
    {"deepseek_v2 greedy", {QM_ROUTE_SCORE_SOFTMAX, 0, 16.0f, 1, 1, QM_GROUP_SCORE_MAX}, 64, 6, 0},
    {"deepseek_v2 group_limited_greedy",
     {QM_ROUTE_SCORE_SOFTMAX, 0, 16.0f, 8, 3, QM_GROUP_SCORE_MAX}, 64, 6, 0},
    {"deepseek_v3", {QM_ROUTE_SCORE_SIGMOID, 1, 2.5f, 8, 4, QM_GROUP_SCORE_TOP2_SUM}, 256, 8, 1},
    {"sigmoid, no groups, not normalised",
     {QM_ROUTE_SCORE_SIGMOID, 0, 1.0f, 1, 1, QM_GROUP_SCORE_MAX}, 16, 4, 1},
};

START_TEST(test_each_routing_mode_matches_float64_reference)
{
    const mode *md = &MODES[_i];
    const uint32_t T = 200, E = md->E, k = md->k;
    uint64_t seed = 1000 + (uint64_t)_i;
    float *lg = malloc(sizeof(float) * T * E), bias[256];
    for (size_t i = 0; i < (size_t)T * E; i++)
        lg[i] = 2.0f * normal(&seed);
    for (uint32_t e = 0; e < E; e++)
        bias[e] = md->with_bias ? 0.1f * normal(&seed) : 0.0f;
    uint32_t *ex = malloc(sizeof(uint32_t) * T * k);
    float *w = malloc(sizeof(float) * T * k);
    qm_status st = {0};
    ck_assert_int_eq(qm_moe_route_rule(&md->rule, md->with_bias ? bias : NULL, lg, T, E, k, ex,
                                       w, &st),
                     0);
    for (uint32_t t = 0; t < T; t++) {
        uint32_t sel[16];
        double rw[16];
        ref_route(&md->rule, md->with_bias ? bias : NULL, lg + (size_t)t * E, E, k, sel, rw);
        for (uint32_t j = 0; j < k; j++) {
            ck_assert_msg(ex[t * k + j] == sel[j], "%s: token %u route %u: expert %u, reference %u",
                          md->family, t, j, ex[t * k + j], sel[j]);
            ck_assert_msg(fabs(w[t * k + j] - rw[j]) <= 1e-6 * (fabs(rw[j]) > 1 ? fabs(rw[j]) : 1),
                          "%s: token %u route %u: weight %.9g, reference %.9g", md->family, t, j,
                          (double)w[t * k + j], rw[j]);
        }
    }
    free(lg);
    free(ex);
    free(w);
}
END_TEST

/* Mixtral's rule (softmax over E, top-k, renormalise) is the legacy rule in
 * other words: same experts, weights within 1e-6; and LEGACY is the legacy
 * function bit for bit. */
START_TEST(test_softmax_normalised_rule_agrees_with_legacy_rule)
{
    const uint32_t T = 100, E = 8, k = 2;
    uint64_t seed = 77;
    float lg[100 * 8], w1[200], w2[200], w3[200];
    uint32_t e1[200], e2[200], e3[200];
    for (size_t i = 0; i < sizeof lg / sizeof lg[0]; i++)
        lg[i] = 3.0f * normal(&seed);
    qm_routing_rule legacy = {0}, mixtral = {QM_ROUTE_SCORE_SOFTMAX, 1, 1.0f, 1, 1, 0};
    qm_status st = {0};
    qm_moe_route(lg, T, E, k, e1, w1);
    ck_assert_int_eq(qm_moe_route_rule(&legacy, NULL, lg, T, E, k, e2, w2, &st), 0);
    ck_assert(memcmp(e1, e2, sizeof e1) == 0 && memcmp(w1, w2, sizeof w1) == 0);
    ck_assert_int_eq(qm_moe_route_rule(&mixtral, NULL, lg, T, E, k, e3, w3, &st), 0);
    for (uint32_t i = 0; i < T * k; i++) {
        if (e1[i] == QM_ROUTE_DROPPED)
            continue; /* the legacy rule drops weights <= 1e-8 */
        ck_assert_uint_eq(e1[i], e3[i]);
        ck_assert_msg(fabsf(w1[i] - w3[i]) <= 1e-6f, "route %u: %.9g vs %.9g", i, (double)w1[i],
                      (double)w3[i]);
    }
}
END_TEST

/* Group of the single best expert loses under top2_sum when its second is
 * weak, and wins under max; the correction bias moves selection, never the
 * weights. */
START_TEST(test_group_score_and_correction_bias_select_as_deepseek)
{
    /* 4 groups of 2. Group 0: {3.0, -3.0}; group 1: {1.0, 1.0}; groups 2, 3 low. */
    const float lg[8] = {3.0f, -3.0f, 1.0f, 1.0f, -2.0f, -2.5f, -2.0f, -2.5f};
    uint32_t ex[2];
    float w[2];
    qm_status st = {0};
    qm_routing_rule top2 = {QM_ROUTE_SCORE_SIGMOID, 1, 1.0f, 4, 1, QM_GROUP_SCORE_TOP2_SUM};
    ck_assert_int_eq(qm_moe_route_rule(&top2, NULL, lg, 1, 8, 2, ex, w, &st), 0);
    ck_assert_msg((ex[0] == 2 || ex[0] == 3) && (ex[1] == 2 || ex[1] == 3) && ex[0] != ex[1],
                  "top2_sum kept group %u/%u, expected group 1", ex[0], ex[1]);
    ck_assert_float_eq_tol(w[0], 0.5f, 1e-7f);
    qm_routing_rule mx = top2;
    mx.group_score = QM_GROUP_SCORE_MAX;
    ck_assert_int_eq(qm_moe_route_rule(&mx, NULL, lg, 1, 8, 2, ex, w, &st), 0);
    ck_assert_uint_eq(ex[0], 0);
    ck_assert_uint_eq(ex[1], 1);
    /* Bias: expert 7 selected because of it, its weight is its plain sigmoid. */
    float bias[8] = {0, 0, 0, 0, 0, 0, 0, 5.0f};
    qm_routing_rule plain = {QM_ROUTE_SCORE_SIGMOID, 0, 1.0f, 1, 1, QM_GROUP_SCORE_MAX};
    ck_assert_int_eq(qm_moe_route_rule(&plain, bias, lg, 1, 8, 2, ex, w, &st), 0);
    ck_assert_uint_eq(ex[0], 7);
    ck_assert_uint_eq(ex[1], 0);
    ck_assert_float_eq_tol(w[0], 1.0 / (1.0 + exp(2.5)), 1e-7);
    ck_assert_float_eq_tol(w[1], 1.0 / (1.0 + exp(-3.0)), 1e-7);
}
END_TEST

/* ---- the forward pass ---------------------------------------------------------- */

static qm_backend *cpu(void)
{
    qm_backend *be = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_cpu_new(2, &be, &st), 0);
    return be;
}

static int run(qm_backend *be, tl_layer *L, const qm_moe_call *c, float *out, qm_status *st)
{
    qm_expert_source src;
    tl_source(L, &src);
    qm_moe_call call = *c;
    call.output = out;
    return qm__moe_forward_layer(be, &L->cfg, &L->lv, &call, &src, NULL, NULL, st);
}

/* Supplied routing equal to what the legacy rule chose gives the very same
 * bits: both combine w[t,j] * y in j order. */
START_TEST(test_supplied_routing_equal_to_own_routing_is_bitwise_identical)
{
    tl_layer L;
    tl_spec s = tl_default_spec(21);
    s.E = 8;
    s.k = 3;
    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
    qm_backend *be = cpu();
    const uint32_t T = 9, H = s.H, E = s.E, k = s.k;
    float *x = malloc(sizeof(float) * T * H), lg[9 * 8], rw[27];
    float *a = malloc(sizeof(float) * T * H), *b = malloc(sizeof(float) * T * H);
    uint32_t re[27];
    int32_t ids[27];
    tl_random_inputs(22, T, H, E, x, lg);
    qm_status st = {0};
    qm_moe_call c = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T, .logits = lg,
                     .route_experts = re, .route_weights = rw};
    ck_assert_int_eq(run(be, &L, &c, a, &st), 0);
    for (uint32_t i = 0; i < T * k; i++)
        ids[i] = re[i] == QM_ROUTE_DROPPED ? -1 : (int32_t)re[i];
    qm_moe_call d = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T, .topk_ids = ids,
                     .topk_weights = rw, .topk_k = k};
    ck_assert_msg(run(be, &L, &d, b, &st) == 0, "%s", st.msg);
    ck_assert(memcmp(a, b, sizeof(float) * T * H) == 0);
    free(x);
    free(a);
    free(b);
    qm_backend_free(be);
    tl_layer_free(&L);
}
END_TEST

/* Weights as given (no softmax, no renormalisation, no threshold), any k'
 * in 1..E, -1 = no route: out[t] = sum_j w[t,j] y_{ids[t,j]}(x_t), checked
 * against single-expert runs of the same engine combined in double. */
START_TEST(test_supplied_routing_is_used_exactly_as_given)
{
    tl_layer L;
    tl_spec s = tl_default_spec(31);
    s.E = 6;
    s.k = 2;
    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
    qm_backend *be = cpu();
    const uint32_t T = 4, H = s.H, E = s.E;
    float *x = malloc(sizeof(float) * T * H), lg[4 * 6];
    tl_random_inputs(32, T, H, E, x, lg);
    /* k' = 6 (all experts), with -1 holes and weights that do not sum to 1. */
    int32_t ids[4 * 6] = {5, 0, -1, 2, 1, 3, -1, -1, -1, -1, -1, 4,
                          0, 1, 2, 3, 4, 5, 3, -1, 1, -1, 0, -1};
    float w[4 * 6];
    uint64_t seed = 5;
    for (int i = 0; i < 24; i++)
        w[i] = tl_uniform(&seed, -2.0f, 3.0f);
    w[6] = 1e-12f; /* no drop threshold: a tiny weight on -1 is ignored, on an id kept */
    w[12] = 1e-12f;
    float *out = malloc(sizeof(float) * T * H), *one = malloc(sizeof(float) * H);
    qm_status st = {0};
    qm_moe_call c = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T, .topk_ids = ids,
                     .topk_weights = w, .topk_k = 6};
    ck_assert_msg(run(be, &L, &c, out, &st) == 0, "%s", st.msg);
    for (uint32_t t = 0; t < T; t++) {
        double ref[256] = {0};
        for (uint32_t j = 0; j < 6; j++) {
            int32_t id = ids[t * 6 + j];
            if (id < 0)
                continue;
            float one_w = 1.0f;
            qm_moe_call e1 = {.dtype = QM_DTYPE_F32, .hidden = x + (size_t)t * H, .n_tokens = 1,
                              .topk_ids = &id, .topk_weights = &one_w, .topk_k = 1};
            ck_assert_int_eq(run(be, &L, &e1, one, &st), 0);
            for (uint32_t h = 0; h < H; h++)
                ref[h] += (double)w[t * 6 + j] * one[h];
        }
        double num = 0, den = 0;
        for (uint32_t h = 0; h < H; h++) {
            num += (out[t * H + h] - ref[h]) * (out[t * H + h] - ref[h]);
            den += ref[h] * ref[h];
        }
        ck_assert_msg(num <= 1e-10 * (den + 1e-30), "token %u: rel err %.3g", t,
                      sqrt(num / (den + 1e-30)));
    }
    free(x);
    free(out);
    free(one);
    qm_backend_free(be);
    tl_layer_free(&L);
}
END_TEST

static void expect_bad(tl_layer *L, qm_backend *be, const int32_t *ids, uint32_t k,
                       const char *needle)
{
    uint32_t H = L->spec.H;
    float x[2 * 256] = {0}, w[16] = {0}, out[2 * 256];
    qm_status st = {0};
    qm_moe_call c = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = 2, .topk_ids = ids,
                     .topk_weights = w, .topk_k = k};
    (void)H;
    int rc = run(be, L, &c, out, &st);
    ck_assert_msg(rc == QM_EINVAL, "expected EINVAL, got %d (%s)", rc, st.msg);
    ck_assert_str_eq(st.field, "topk_ids");
    ck_assert_msg(strstr(st.msg, needle), "message \"%s\" lacks \"%s\"", st.msg, needle);
}

START_TEST(test_supplied_routing_rejects_bad_ids_naming_topk_ids)
{
    tl_layer L;
    tl_spec s = tl_default_spec(41);
    s.E = 4;
    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
    qm_backend *be = cpu();
    const int32_t out_of_range[4] = {0, 1, 2, 4};
    const int32_t below[4] = {0, -2, 1, 2};
    const int32_t repeated[4] = {0, 1, 3, 3};
    const int32_t holes_ok_but_k0[2] = {0, 0};
    const int32_t wide[10] = {0};
    expect_bad(&L, be, out_of_range, 2, "topk_ids[1][1] = 4 but it must be in [-1, 4)");
    expect_bad(&L, be, below, 2, "topk_ids[0][1] = -2");
    expect_bad(&L, be, repeated, 2, "topk_ids[1] names expert 3 twice");
    expect_bad(&L, be, holes_ok_but_k0, 0, "topk_ids has 0 columns but it must have 1..4");
    expect_bad(&L, be, wide, 5, "topk_ids has 5 columns");
    /* Repeated -1 is fine. */
    const int32_t holes[4] = {-1, -1, 2, -1};
    float x[2 * 256] = {0}, w[4] = {1, 1, 1, 1}, out[2 * 256];
    qm_status st = {0};
    qm_moe_call c = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = 2, .topk_ids = holes,
                     .topk_weights = w, .topk_k = 2};
    ck_assert_msg(run(be, &L, &c, out, &st) == 0, "%s", st.msg);
    for (uint32_t h = 0; h < s.H; h++)
        ck_assert(out[h] == 0.0f); /* token 0 routes nowhere */
    qm_backend_free(be);
    tl_layer_free(&L);
}
END_TEST

/* A layer with a routing rule and a correction bias routes by it in the
 * forward pass: same bits as supplying the rule's own routes. */
/* v stored at dst as dtype dt (f32, f16 or bf16); returns the value stored. */
static float store_weight(uint8_t *dst, qm_dtype dt, float v)
{
    if (dt == QM_DTYPE_F32) {
        memcpy(dst, &v, 4);
        return v;
    }
    uint16_t h = dt == QM_DTYPE_F16 ? qm_f32_to_f16(v) : qm_f32_to_bf16(v);
    memcpy(dst, &h, 2);
    return dt == QM_DTYPE_F16 ? qm_f16_to_f32(h) : qm_bf16_to_f32(h);
}

/* A layer view of router weight w [E][H] and, with `bias`, bias b [E], of dtype dt. */
static qm_layer_view router_view(qm_dtype dt, uint32_t E, uint32_t H, const void *w, const void *b,
                                 int bias)
{
    const size_t es = dt == QM_DTYPE_F32 ? 4 : 2;
    qm_layer_view lv = {.index = 0};
    lv.t[QM_T_ROUTER_WEIGHT] = (qm_tensor_view){.present = 1, .dtype = dt, .ndim = 2,
                                                .shape = {E, H}, .data = w,
                                                .nbytes = (uint64_t)E * H * es};
    if (bias)
        lv.t[QM_T_ROUTER_BIAS] = (qm_tensor_view){.present = 1, .dtype = dt, .ndim = 1,
                                                  .shape = {E}, .data = b,
                                                  .nbytes = (uint64_t)E * es};
    return lv;
}

/* Router logits on this CPU's SIMD path are the scalar specification's bits
 * (per expert and token, the same exact products and rounded additions in
 * column order): every weight dtype, with and without a bias, expert and
 * column counts off the SIMD blocks (16 experts, 4 and 128 columns), token
 * counts off its pairs and blocks of 32, and rows whose sums cancel (where
 * the order of the additions shows), against qm__routing_force_scalar. */
START_TEST(test_router_logits_simd_gives_the_scalar_bits)
{
    static const uint32_t Es[] = {1, 5, 16, 37, 128}, Hs[] = {1, 3, 4, 130, 257};
    static const uint32_t Ts[] = {1, 2, 3, 35};
    static const qm_dtype dts[] = {QM_DTYPE_F32, QM_DTYPE_F16, QM_DTYPE_BF16};
    uint64_t seed = 71;
    size_t compared = 0;
    for (size_t ie = 0; ie < 5; ie++) {
        for (size_t ih = 0; ih < 5; ih++) {
            const uint32_t E = Es[ie], H = Hs[ih], T = Ts[(ie + ih) % 4];
            const qm_dtype dt = dts[(ie * 5 + ih) % 3];
            const int bias = (ie + ih) % 2;
            const size_t es = dt == QM_DTYPE_F32 ? 4 : 2;
            uint8_t *w = malloc((size_t)E * H * es), *b = malloc((size_t)E * es);
            float *x = malloc(sizeof(float) * T * H);
            float *want = malloc(sizeof(float) * T * E), *got = malloc(sizeof(float) * T * E);
            /* Even experts' rows start with +big and end with -big, so their
             * partial sums sit near big while small terms come and go: a sum
             * in another order, or not in double, shows in the float logit. */
            const float big = ldexpf(1.0f, dt == QM_DTYPE_F16 ? 15 : 40);
            for (size_t i = 0; i < (size_t)E * H + E; i++) {
                /* Magnitudes from 2^-30 (f16 subnormals) to 2^-2. */
                float v = tl_uniform(&seed, -1, 1) * ldexpf(1.0f, (int)(tl_rand(&seed) % 29) - 30);
                size_t e = i / H, c = i % H;
                if (i < (size_t)E * H && e % 2 == 0 && H >= 2 && (c == 0 || c == H - 1))
                    v = c == 0 ? big : -big;
                store_weight(i < (size_t)E * H ? w + i * es : b + (i - (size_t)E * H) * es, dt, v);
            }
            for (size_t i = 0; i < (size_t)T * H; i++)
                x[i] = i % H == H - 1 ? x[i - (H - 1)] : tl_uniform(&seed, -4, 4);
            qm_bank_config cfg = {.experts = E, .hidden = H};
            qm_layer_view lv = router_view(dt, E, H, w, b, bias);
            qm_status st = {0};
            qm__routing_force_scalar(1);
            ck_assert_int_eq(qm_moe_router_logits(&cfg, &lv, x, T, want, &st), 0);
            qm__routing_force_scalar(0);
            ck_assert_int_eq(qm_moe_router_logits(&cfg, &lv, x, T, got, &st), 0);
            for (size_t i = 0; i < (size_t)T * E; i++)
                ck_assert_msg(memcmp(&got[i], &want[i], 4) == 0,
                              "E %u H %u T %u dtype %d bias %d: logit %zu is %a, scalar %a", E, H,
                              T, (int)dt, bias, i, (double)got[i], (double)want[i]);
            compared += (size_t)T * E;
            free(w);
            free(b);
            free(x);
            free(want);
            free(got);
        }
    }
    printf("router logits: %zu compared with the scalar specification\n", compared);
}
END_TEST

/* The prediction's logits (qm_moe_router_predict: f32 FMA, any order) are
 * the routing's to within f32 rounding of their sum of magnitudes, every
 * weight dtype, with and without a bias, off its blocks of 32 columns. */
START_TEST(test_router_predict_is_the_logits_to_f32_rounding)
{
    static const uint32_t Es[] = {1, 7, 128}, Hs[] = {1, 31, 32, 100, 2048};
    static const qm_dtype dts[] = {QM_DTYPE_F32, QM_DTYPE_F16, QM_DTYPE_BF16};
    uint64_t seed = 73;
    for (size_t ie = 0; ie < 3; ie++)
        for (size_t ih = 0; ih < 5; ih++)
            for (size_t id = 0; id < 3; id++) {
                const uint32_t E = Es[ie], H = Hs[ih], T = 1 + (uint32_t)(ih % 3);
                const qm_dtype dt = dts[id];
                const int bias = (ie + ih + id) % 2;
                const size_t es = dt == QM_DTYPE_F32 ? 4 : 2;
                uint8_t *w = malloc((size_t)E * H * es + 1), *b = malloc((size_t)E * es + 1);
                float *wf = malloc(sizeof(float) * ((size_t)E * H + E));
                float *x = malloc(sizeof(float) * T * H);
                float *want = malloc(sizeof(float) * T * E), *got = malloc(sizeof(float) * T * E);
                for (size_t i = 0; i < (size_t)E * H + E; i++)
                    wf[i] = store_weight(i < (size_t)E * H ? w + i * es
                                                           : b + (i - (size_t)E * H) * es,
                                         dt, tl_uniform(&seed, -1, 1));
                for (size_t i = 0; i < (size_t)T * H; i++)
                    x[i] = tl_uniform(&seed, -4, 4);
                qm_bank_config cfg = {.experts = E, .hidden = H};
                qm_layer_view lv = router_view(dt, E, H, w, b, bias);
                qm_status st = {0};
                ck_assert_int_eq(qm_moe_router_logits(&cfg, &lv, x, T, want, &st), 0);
                ck_assert_int_eq(qm_moe_router_predict(&cfg, &lv, x, T, got, &st), 0);
                for (uint32_t t = 0; t < T; t++)
                    for (uint32_t e = 0; e < E; e++) {
                        double mag = bias ? fabs(wf[(size_t)E * H + e]) : 0;
                        for (uint32_t c = 0; c < H; c++)
                            mag += fabs((double)wf[(size_t)e * H + c] * x[(size_t)t * H + c]);
                        size_t i = (size_t)t * E + e;
                        ck_assert_msg(fabs((double)got[i] - want[i]) <= 1e-5 * mag + 1e-30,
                                      "E %u H %u T %u dtype %d bias %d: %g, logits %g (sum of "
                                      "magnitudes %g)",
                                      E, H, T, (int)dt, bias, (double)got[i], (double)want[i], mag);
                    }
                free(w), free(b), free(wf), free(x), free(want), free(got);
            }
}
END_TEST

START_TEST(test_forward_routes_by_the_bank_rule)
{
    tl_layer L;
    tl_spec s = tl_default_spec(51);
    s.E = 8;
    s.k = 2;
    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
    float bias[8] = {0.3f, -0.1f, 0.0f, 0.2f, -0.4f, 0.1f, 0.0f, 0.05f};
    L.cfg.routing = (qm_routing_rule){QM_ROUTE_SCORE_SIGMOID, 1, 2.5f, 4, 2,
                                      QM_GROUP_SCORE_TOP2_SUM};
    qm_tensor_view *cb = &L.lv.t[QM_T_ROUTER_CORRECTION_BIAS];
    *cb = (qm_tensor_view){.present = 1, .dtype = QM_DTYPE_F32, .ndim = 1, .shape = {8},
                           .nbytes = sizeof bias, .data = bias};
    qm_backend *be = cpu();
    const uint32_t T = 7, H = s.H, E = s.E, k = s.k;
    float *x = malloc(sizeof(float) * T * H), lg[7 * 8], w[14], rw[14];
    float *a = malloc(sizeof(float) * T * H), *b = malloc(sizeof(float) * T * H);
    uint32_t ex[14], re[14];
    int32_t ids[14];
    tl_random_inputs(52, T, H, E, x, lg);
    qm_status st = {0};
    ck_assert_int_eq(qm_moe_route_rule(&L.cfg.routing, bias, lg, T, E, k, ex, w, &st), 0);
    qm_moe_call c = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T, .logits = lg,
                     .route_experts = re, .route_weights = rw};
    ck_assert_msg(run(be, &L, &c, a, &st) == 0, "%s", st.msg);
    ck_assert(memcmp(re, ex, sizeof ex) == 0 && memcmp(rw, w, sizeof w) == 0);
    for (uint32_t i = 0; i < T * k; i++)
        ids[i] = (int32_t)ex[i];
    qm_moe_call d = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T, .topk_ids = ids,
                     .topk_weights = w, .topk_k = k};
    ck_assert_msg(run(be, &L, &d, b, &st) == 0, "%s", st.msg);
    ck_assert(memcmp(a, b, sizeof(float) * T * H) == 0);
    cb->present = 0; /* tl_layer_free must not free the stack array */
    free(x);
    free(a);
    free(b);
    qm_backend_free(be);
    tl_layer_free(&L);
}
END_TEST

static Suite *route_suite(void)
{
    Suite *s = suite_create("route");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_each_routing_mode_matches_float64_reference, 0,
                        (int)(sizeof MODES / sizeof MODES[0]));
    tcase_add_test(tc, test_softmax_normalised_rule_agrees_with_legacy_rule);
    tcase_add_test(tc, test_group_score_and_correction_bias_select_as_deepseek);
    tcase_add_test(tc, test_supplied_routing_equal_to_own_routing_is_bitwise_identical);
    tcase_add_test(tc, test_supplied_routing_is_used_exactly_as_given);
    tcase_add_test(tc, test_supplied_routing_rejects_bad_ids_naming_topk_ids);
    tcase_add_test(tc, test_forward_routes_by_the_bank_rule);
    tcase_add_test(tc, test_router_logits_simd_gives_the_scalar_bits);
    tcase_add_test(tc, test_router_predict_is_the_logits_to_f32_rounding);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(route_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
