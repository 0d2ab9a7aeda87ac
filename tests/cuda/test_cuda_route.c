/* test_cuda_route.c - routing on the device (the backend's optional route /
 * run_routed / combine methods) against the CPU engine's routing, which is
 * the reference: expert ids identical, weights within 1e-6 relative, the
 * per-expert counts, ties, NaN/inf logits, dropped routes, k = 1 and k = E,
 * T = 0, 1 and 333, router logits from f32/f16/bf16 router weights, and the
 * whole layer routed on the device against the same layer routed on the
 * host (same backend) and on the CPU backend. Part of test_cuda and
 * test_cuda_emu (case "route"). */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_fixture.h"
#include "qm_backend_impl.h"
#include "qm_cuda.h"
#include "qm_moe_internal.h"

#define TOL_W 1e-6 /* route weights, relative */

enum { PAT_RANDOM, PAT_TIES, PAT_EQUAL, PAT_DROP, PAT_SPECIAL, PAT_COUNT, PAT_ALL_NAN = PAT_COUNT };
static const char *const PAT_NAMES[] = {"random", "ties",    "all-equal",
                                        "drops",  "nan/inf", "all-nan"};

static void make_logits(int pat, uint64_t seed, uint32_t T, uint32_t E, float *lg)
{
    uint64_t r = seed;
    for (uint32_t t = 0; t < T; t++) {
        float *l = lg + (size_t)t * E;
        for (uint32_t e = 0; e < E; e++) {
            switch (pat) {
            case PAT_RANDOM:
                l[e] = tl_uniform(&r, -4, 4);
                break;
            case PAT_TIES: /* three values: most selections are ties */
                l[e] = (float)((int)(tl_rand(&r) % 3) - 1);
                break;
            case PAT_EQUAL:
                l[e] = 0.25f;
                break;
            case PAT_ALL_NAN: /* every route dropped: nothing to run, zeros out */
                l[e] = NAN;
                break;
            case PAT_DROP: /* one clear winner, the rest e^-40 below: dropped */
                l[e] = e == t % E ? 1.0f : -39.0f - tl_uniform(&r, 0, 1);
                break;
            default: { /* NaN, +-inf and numbers mixed; some tokens all NaN */
                uint64_t v = tl_rand(&r) % 8;
                l[e] = t % 7 == 3 ? NAN
                       : v == 0   ? NAN
                       : v == 1   ? -INFINITY
                       : v == 2 && t % 5 == 0 ? INFINITY
                                              : tl_uniform(&r, -2, 2);
                break;
            }
            }
        }
    }
}

static int weights_close(float a, float b)
{
    if (a == b) return 1;
    return fabs((double)a - (double)b) <= TOL_W * fabs((double)b);
}

/* Routes on the backend (logits given, or from the layer's router when lg
 * is NULL) and compares with the host routing of `want_lg`. Returns the
 * number of routes whose id differs or whose weight is off. */
static int check_route(qm_backend *cuda, const qm_bank_config *cfg, const qm_layer_view *lv,
                       uint32_t T, const float *x, const float *lg, const float *want_lg,
                       const char *what)
{
    const uint32_t E = cfg->experts, k = cfg->k;
    const size_t TK = (size_t)T * k;
    uint32_t *he = malloc(TK * 4), *de = malloc(TK * 4), *dc = malloc((size_t)E * 4);
    float *hw = malloc(TK * 4), *dw = malloc(TK * 4);
    uint32_t *hc = calloc(E, 4);
    ck_assert(he && de && dc && hw && dw && hc);
    qm_moe_route(want_lg, T, E, k, he, hw);
    for (size_t i = 0; i < TK; i++)
        if (he[i] != QM_ROUTE_DROPPED) hc[he[i]]++;
    memset(de, 0xab, TK * 4);
    qm_routing_request rq = {.config = cfg,
                           .layer = lv,
                           .x = x,
                           .logits = lg,
                           .n_tokens = T,
                           .experts = de,
                           .weights = dw,
                           .counts = dc};
    qm_routed_pass pass = {0};
    qm_status st = {0};
    int rc = qm__backend_route(cuda, &rq, &pass, &st);
    ck_assert_msg(rc == 0, "%s: route: %s", what, st.msg);
    ck_assert_ptr_nonnull(pass.backend_pass);
    qm__backend_pass_release(cuda, &pass);
    int bad = 0;
    for (size_t i = 0; i < TK; i++) {
        if (de[i] != he[i] || !weights_close(dw[i], hw[i])) {
            if (bad < 5)
                printf("%s: token %zu route %zu: device e%u w%.9g, host e%u w%.9g\n", what, i / k,
                       i % k, de[i], dw[i], he[i], hw[i]);
            bad++;
        }
    }
    for (uint32_t e = 0; e < E; e++)
        ck_assert_msg(dc[e] == hc[e], "%s: expert %u: device counts %u routes, host %u", what, e,
                      dc[e], hc[e]);
    free(he);
    free(de);
    free(dc);
    free(hw);
    free(dw);
    free(hc);
    return bad;
}

START_TEST(test_cuda_route_matches_host_routing_with_ties_drops_and_nan)
{
    static const uint32_t EK[][2] = {{1, 1}, {4, 1}, {8, 2}, {8, 8}, {5, 5}, {32, 4}, {128, 8}};
    static const uint32_t TS[] = {1, 2, 333};
    qm_backend *cuda = new_cuda();
    const uint32_t H = 8;
    int runs = 0, ties = 0;
    for (size_t c = 0; c < sizeof EK / sizeof EK[0]; c++) {
        qm_bank_config cfg = {.experts = EK[c][0], .k = EK[c][1], .hidden = H, .layers = 1};
        qm_layer_view lv;
        memset(&lv, 0, sizeof lv);
        for (size_t ti = 0; ti < sizeof TS / sizeof TS[0]; ti++) {
            const uint32_t T = TS[ti], E = cfg.experts;
            float *x = calloc((size_t)T * H, 4), *lg = malloc((size_t)T * E * 4);
            ck_assert(x && lg);
            for (int pat = 0; pat < PAT_COUNT; pat++) {
                make_logits(pat, 1000 + c * 31 + ti * 7 + (uint64_t)pat, T, E, lg);
                char what[96];
                snprintf(what, sizeof what, "E%u k%u T%u %s", E, cfg.k, T, PAT_NAMES[pat]);
                int bad = check_route(cuda, &cfg, &lv, T, x, lg, lg, what);
                ck_assert_msg(bad == 0, "%s: %d routes differ from the host's", what, bad);
                runs++;
                ties += pat == PAT_TIES || pat == PAT_EQUAL;
            }
            free(x);
            free(lg);
        }
    }
    printf("route: %d (E, k, T, pattern) runs identical to the host routing (%d with ties)\n",
           runs, ties);
    /* T = 0 never reaches the backend from the engine; the backend refuses it. */
    qm_bank_config cfg = {.experts = 4, .k = 2, .hidden = H, .layers = 1};
    qm_layer_view lv;
    memset(&lv, 0, sizeof lv);
    float x[8] = {0}, lg[4] = {0};
    uint32_t e[2];
    float w[2];
    qm_routing_request rq = {
        .config = &cfg, .layer = &lv, .x = x, .logits = lg, .n_tokens = 0, .experts = e, .weights = w};
    qm_routed_pass pass = {0};
    qm_status st = {0};
    ck_assert_int_eq(qm__backend_route(cuda, &rq, &pass, &st), QM_EINVAL);
    ck_assert_ptr_null(pass.backend_pass);
    qm_backend_free(cuda);
}
END_TEST

/* Router weights of `dt` replacing the fixture's f32 ones (same values rounded). */
static void *router_as(const tl_layer *L, qm_dtype dt, qm_layer_view *lv)
{
    const uint32_t E = L->spec.E, H = L->spec.H;
    const float *w32 = L->lv.t[QM_T_ROUTER_WEIGHT].data;
    if (dt == QM_DTYPE_F32) return NULL;
    uint16_t *w = malloc((size_t)E * H * 2 + (size_t)E * 2);
    ck_assert_ptr_nonnull(w);
    for (size_t i = 0; i < (size_t)E * H; i++)
        w[i] = dt == QM_DTYPE_F16 ? qm_f32_to_f16(w32[i]) : qm_f32_to_bf16(w32[i]);
    uint16_t *b = w + (size_t)E * H;
    const float *b32 = L->lv.t[QM_T_ROUTER_BIAS].data;
    for (uint32_t e = 0; e < E; e++)
        b[e] = dt == QM_DTYPE_F16 ? qm_f32_to_f16(b32[e]) : qm_f32_to_bf16(b32[e]);
    qm_tensor_view *tw = &lv->t[QM_T_ROUTER_WEIGHT], *tb = &lv->t[QM_T_ROUTER_BIAS];
    tw->dtype = dt;
    tw->data = w;
    tw->nbytes = (uint64_t)E * H * 2;
    tb->dtype = dt;
    tb->data = b;
    tb->nbytes = (uint64_t)E * 2;
    return w;
}

START_TEST(test_cuda_router_logits_route_like_the_host)
{
    static const uint32_t HS[] = {40, 130, 2880};
    static const uint32_t TS[] = {1, 333};
    qm_backend *cuda = new_cuda();
    for (size_t hi = 0; hi < sizeof HS / sizeof HS[0]; hi++) {
        tl_spec s = tl_default_spec(300 + hi);
        s.router = 1;
        s.H = HS[hi];
        s.E = hi == 2 ? 32 : 8;
        s.k = hi == 2 ? 4 : 2;
        s.I = 16;
        tl_layer L;
        ck_assert_int_eq(tl_layer_build(&s, &L), 0);
        for (int di = 0; di < 3; di++) {
            qm_dtype dt = di == 0 ? QM_DTYPE_F32 : di == 1 ? QM_DTYPE_F16 : QM_DTYPE_BF16;
            qm_layer_view lv = L.lv;
            void *owned = router_as(&L, dt, &lv);
            for (size_t ti = 0; ti < sizeof TS / sizeof TS[0]; ti++) {
                const uint32_t T = TS[ti];
#ifdef QM_TEST_EMULATED
                if (s.H == 2880 && T > 1) continue; /* slow in emulation; the device runs it */
#endif
                float *x = malloc((size_t)T * s.H * 4), *lg = malloc((size_t)T * s.E * 4);
                ck_assert(x && lg);
                tl_random_inputs(400 + ti, T, s.H, s.E, x, lg);
                qm_status st = {0};
                ck_assert_int_eq(qm_moe_router_logits(&L.cfg, &lv, x, T, lg, &st), 0);
                char what[96];
                snprintf(what, sizeof what, "router %s H%u E%u T%u", qm_dtype_name(dt), s.H, s.E,
                         T);
                int bad = check_route(cuda, &L.cfg, &lv, T, x, NULL, lg, what);
                ck_assert_msg(bad == 0, "%s: %d routes differ from the host's", what, bad);
                free(x);
                free(lg);
            }
            free(owned);
        }
        tl_layer_free(&L);
    }
    printf("route: router logits from f32/f16/bf16 router weights route like the host\n");
    qm_backend_free(cuda);
}
END_TEST

static int run_layer(qm_backend *be, tl_layer *L, qm_expert_source *src, uint32_t T,
                     const float *x, const float *lg, float *out, uint32_t *re, float *rw)
{
    qm_moe_call call = {.layer = 0,
                        .dtype = QM_DTYPE_F32,
                        .hidden = x,
                        .n_tokens = T,
                        .logits = lg,
                        .output = out,
                        .route_experts = re,
                        .route_weights = rw};
    qm_status st = {0};
    int rc = qm__moe_forward_layer(be, &L->cfg, &L->lv, &call, src, NULL, NULL, &st);
    if (rc != 0) fprintf(stderr, "forward on %s: %s\n", qm_backend_name(be), st.msg);
    return rc;
}

START_TEST(test_cuda_layer_routed_on_device_matches_host_routing)
{
    typedef struct { uint32_t E, k, T, step; int router, pat; } lc;
    static const lc CASES[] = {
        {8, 1, 1, 0, 0, PAT_RANDOM}, {8, 2, 333, 3, 0, PAT_RANDOM}, {8, 8, 333, 0, 0, PAT_TIES},
        {6, 6, 1, 2, 0, PAT_EQUAL},  {8, 4, 45, 1, 0, PAT_SPECIAL}, {8, 2, 333, 0, 1, -1},
        {4, 2, 17, 0, 0, PAT_DROP},  {4, 2, 3, 0, 0, PAT_ALL_NAN},
    };
    qm_backend *cpu = new_cpu(), *cuda = new_cuda();
    double worst_host = 0, worst_cpu = 0;
    for (size_t ci = 0; ci < sizeof CASES / sizeof CASES[0]; ci++) {
        const lc *c = &CASES[ci];
        tl_spec s = tl_default_spec(700 + ci);
        s.E = c->E;
        s.k = c->k;
        s.H = 64;
        s.I = 48;
        s.act = QM_ACT_SWIGLU;
        s.fusion = 1;
        s.bias = 1;
        s.router = c->router;
        tl_layer L;
        ck_assert_int_eq(tl_layer_build(&s, &L), 0);
        dev_layer D;
        dev_layer_init(&D, cuda, &L, (int)(ci % 2));
        D.step = c->step;
        const uint32_t T = c->T, H = s.H, E = s.E;
        const size_t TH = (size_t)T * H, TK = (size_t)T * s.k;
        float *x = malloc(TH * 4), *lg = malloc((size_t)T * E * 4);
        float *o_dev = malloc(TH * 4), *o_host = malloc(TH * 4), *o_cpu = malloc(TH * 4);
        uint32_t *e_dev = malloc(TK * 4), *e_host = malloc(TK * 4);
        float *w_dev = malloc(TK * 4), *w_host = malloc(TK * 4);
        ck_assert(x && lg && o_dev && o_host && o_cpu && e_dev && e_host && w_dev && w_host);
        tl_random_inputs(800 + ci, T, H, E, x, lg);
        if (c->pat >= 0) make_logits(c->pat, 900 + ci, T, E, lg);
        const float *use_lg = c->router ? NULL : lg;
        qm_expert_source dsrc, csrc;
        dev_source(&D, &dsrc);
        tl_source(&L, &csrc);

        qm_cuda_stats s0, s1;
        ck_assert_int_eq(qm_backend_cuda_stats(cuda, &s0), 0);
        for (size_t i = 0; i < TH; i++)
            o_dev[i] = o_host[i] = NAN;
        ck_assert_int_eq(run_layer(cuda, &L, &dsrc, T, x, use_lg, o_dev, e_dev, w_dev), 0);
        ck_assert_int_eq(qm_backend_cuda_stats(cuda, &s1), 0);
        ck_assert_uint_eq(s1.routes, s0.routes + 1); /* routed on the device */
        ck_assert_int_eq(D.acquired, D.released);

        ck_assert_int_eq(qm_backend_cuda_set_routing(cuda, 0), 0);
        ck_assert_int_eq(run_layer(cuda, &L, &dsrc, T, x, use_lg, o_host, e_host, w_host), 0);
        ck_assert_int_eq(qm_backend_cuda_stats(cuda, &s0), 0);
        ck_assert_uint_eq(s0.routes, s1.routes); /* ... and now on the host */
        ck_assert_int_eq(qm_backend_cuda_set_routing(cuda, 1), 0);
        ck_assert_int_eq(run_layer(cpu, &L, &csrc, T, x, use_lg, o_cpu, NULL, NULL), 0);

        for (size_t i = 0; i < TK; i++) {
            ck_assert_msg(e_dev[i] == e_host[i], "case %zu route %zu: expert %u vs %u", ci, i,
                          e_dev[i], e_host[i]);
            ck_assert_msg(weights_close(w_dev[i], w_host[i]), "case %zu route %zu: w %.9g vs %.9g",
                          ci, i, w_dev[i], w_host[i]);
        }
        double eh = rel_err(o_dev, o_host, TH), ec = rel_err(o_dev, o_cpu, TH);
        int all_zero = 1;
        for (size_t i = 0; i < TH; i++)
            all_zero &= o_host[i] == 0.0f;
        if (all_zero) /* every route dropped (rel_err is absolute then) */
            ck_assert_msg(eh == 0, "case %zu: all routes dropped, device output not zero", ci);
        printf("route: layer E%u k%u T%u waves-of-%u %s: device vs host routing %.3g, vs cpu "
               "backend %.3g\n",
               E, s.k, T, c->step, c->router ? "router" : PAT_NAMES[c->pat], eh, ec);
        ck_assert_msg(eh <= 1e-6, "case %zu: device vs host routing rel err %.3g", ci, eh);
        ck_assert_msg(ec <= 1e-5, "case %zu: vs cpu backend rel err %.3g", ci, ec);
        if (!(eh <= worst_host)) worst_host = eh;
        if (!(ec <= worst_cpu)) worst_cpu = ec;
        free(x);
        free(lg);
        free(o_dev);
        free(o_host);
        free(o_cpu);
        free(e_dev);
        free(e_host);
        free(w_dev);
        free(w_host);
        dev_layer_free(cuda, &D);
        tl_layer_free(&L);
    }
    printf("route: whole layer routed on the device: worst %.3g vs host routing, %.3g vs cpu\n",
           worst_host, worst_cpu);
    qm_backend_free(cpu);
    qm_backend_free(cuda);
}
END_TEST

/* Banks with a routing rule and routing supplied by the engine take the
 * host-routed path (docs/CUDA.md): the device routing is not used, the
 * experts still run on the device, and the output matches the CPU backend. */
START_TEST(test_cuda_rule_banks_and_supplied_routing_route_on_the_host)
{
    qm_backend *cpu = new_cpu(), *cuda = new_cuda();
    tl_spec s = tl_default_spec(960);
    s.E = 8;
    s.k = 2;
    s.H = 64;
    s.I = 48;
    s.act = QM_ACT_SWIGLU;
    s.fusion = 1;
    s.bias = 1;
    tl_layer L;
    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
    float bias[8] = {0.2f, -0.1f, 0.0f, 0.3f, -0.2f, 0.1f, 0.05f, 0.0f};
    dev_layer D;
    dev_layer_init(&D, cuda, &L, 0);
    const uint32_t T = 37, H = s.H, E = s.E;
    const size_t TH = (size_t)T * H;
    float *x = malloc(TH * 4), *lg = malloc((size_t)T * E * 4);
    float *o_dev = malloc(TH * 4), *o_cpu = malloc(TH * 4);
    int32_t *ids = malloc((size_t)T * 3 * 4);
    float *w = malloc((size_t)T * 3 * 4);
    ck_assert(x && lg && o_dev && o_cpu && ids && w);
    tl_random_inputs(961, T, H, E, x, lg);
    for (uint32_t t = 0; t < T; t++)
        for (uint32_t j = 0; j < 3; j++) {
            ids[t * 3 + j] = j == 2 && t % 3 == 0 ? -1 : (int32_t)((t + 3 * j) % E);
            w[t * 3 + j] = 0.25f + 0.5f * (float)j - 0.01f * (float)t;
        }
    qm_expert_source dsrc, csrc;
    dev_source(&D, &dsrc);
    tl_source(&L, &csrc);
    for (int mode = 0; mode < 2; mode++) {
        qm_moe_call call = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T, .logits = lg};
        if (mode == 0) { /* DeepSeek-V3's rule */
            L.cfg.routing = (qm_routing_rule){QM_ROUTE_SCORE_SIGMOID, 1, 2.5f, 4, 2,
                                              QM_GROUP_SCORE_TOP2_SUM};
            L.lv.t[QM_T_ROUTER_CORRECTION_BIAS] = (qm_tensor_view){
                .present = 1, .dtype = QM_DTYPE_F32, .ndim = 1, .shape = {8},
                .nbytes = sizeof bias, .data = bias};
        } else { /* engine-supplied, k' = 3 */
            L.cfg.routing = (qm_routing_rule){0};
            L.lv.t[QM_T_ROUTER_CORRECTION_BIAS].present = 0;
            call.logits = NULL;
            call.topk_ids = ids;
            call.topk_weights = w;
            call.topk_k = 3;
        }
        qm_cuda_stats s0, s1;
        qm_status st = {0};
        ck_assert_int_eq(qm_backend_cuda_stats(cuda, &s0), 0);
        call.output = o_dev;
        ck_assert_msg(qm__moe_forward_layer(cuda, &L.cfg, &L.lv, &call, &dsrc, NULL, NULL, &st) == 0,
                      "%s", st.msg);
        ck_assert_int_eq(qm_backend_cuda_stats(cuda, &s1), 0);
        ck_assert_uint_eq(s1.routes, s0.routes); /* not routed on the device */
        ck_assert_int_eq(D.acquired, D.released);
        call.output = o_cpu;
        ck_assert_msg(qm__moe_forward_layer(cpu, &L.cfg, &L.lv, &call, &csrc, NULL, NULL, &st) == 0,
                      "%s", st.msg);
        double e = rel_err(o_dev, o_cpu, TH);
        printf("route: %s on the CUDA backend (host-routed) vs cpu %.3g\n",
               mode == 0 ? "sigmoid/groups/bias rule" : "supplied topk_ids", e);
        ck_assert_msg(e <= 1e-5, "mode %d: vs cpu backend rel err %.3g", mode, e);
    }
    L.lv.t[QM_T_ROUTER_CORRECTION_BIAS].present = 0;
    free(x);
    free(lg);
    free(o_dev);
    free(o_cpu);
    free(ids);
    free(w);
    dev_layer_free(cuda, &D);
    tl_layer_free(&L);
    qm_backend_free(cpu);
    qm_backend_free(cuda);
}
END_TEST

START_TEST(test_cuda_routed_pass_refuses_misuse_and_the_backend_survives)
{
    tl_spec s = tl_default_spec(77);
    s.E = 4;
    s.k = 2;
    tl_layer L;
    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
    qm_backend *cuda = new_cuda();
    dev_layer D;
    dev_layer_init(&D, cuda, &L, 0);
    enum { T = 5 };
    float x[T * 256], lg[T * 4];
    ck_assert_uint_le(s.H, 256);
    tl_random_inputs(5, T, s.H, s.E, x, lg);
    uint32_t ex[T * 2], counts[4];
    float w[T * 2];
    qm_routing_request rq = {.config = &L.cfg,
                           .layer = &L.lv,
                           .x = x,
                           .logits = lg,
                           .n_tokens = T,
                           .experts = ex,
                           .weights = w,
                           .counts = counts};
    qm_routed_pass pass = {0};
    qm_status st = {0};
    ck_assert_int_eq(qm__backend_route(cuda, &rq, &pass, &st), 0);
    ck_assert_ptr_nonnull(pass.backend_pass);
    uint32_t e = 0;
    while (counts[e] == 0)
        e++;
    qm_expert_job job = {.expert = e, .n_rows = counts[e] + 1};
    dev_weights(&D, e, &job.weights);
    qm_expert_batch b = {.config = &L.cfg, .layer = &L.lv, .n_tokens = T, .jobs = &job, .n_jobs = 1};
    ck_assert_int_eq(qm__backend_run_routed(cuda, &pass, &b, &st), QM_EINVAL);
    ck_assert_msg(strstr(st.msg, "rows") != NULL, "%s", st.msg);
    float out[T * 256];
    ck_assert_int_eq(qm__backend_combine(cuda, &pass, out, &st), QM_EINVAL);
    ck_assert_msg(strstr(st.msg, "never run") != NULL, "%s", st.msg);
    qm__backend_pass_release(cuda, &pass);
    /* No router weight and no logits: refused before the device is asked. */
    qm_moe_call call = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T, .output = out};
    qm_expert_source src;
    dev_source(&D, &src);
    ck_assert_int_eq(qm__moe_forward_layer(cuda, &L.cfg, &L.lv, &call, &src, NULL, NULL, &st),
                     QM_EINVAL);
    ck_assert_msg(strstr(st.msg, "router") != NULL, "%s", st.msg);
    /* T = 0 through the engine: an empty result, nothing written. */
    out[0] = 42.0f;
    call.logits = lg;
    call.n_tokens = 0;
    ck_assert_int_eq(qm__moe_forward_layer(cuda, &L.cfg, &L.lv, &call, &src, NULL, NULL, &st), 0);
    ck_assert(out[0] == 42.0f);
    /* The backend still works, and reuses its pass: no new scratch. */
    call.n_tokens = T;
    ck_assert_int_eq(qm__moe_forward_layer(cuda, &L.cfg, &L.lv, &call, &src, NULL, NULL, &st), 0);
    qm_cuda_stats a, bb;
    ck_assert_int_eq(qm_backend_cuda_stats(cuda, &a), 0);
    ck_assert_int_eq(qm__moe_forward_layer(cuda, &L.cfg, &L.lv, &call, &src, NULL, NULL, &st), 0);
    ck_assert_int_eq(qm_backend_cuda_stats(cuda, &bb), 0);
    ck_assert_uint_eq(bb.scratch_grows, a.scratch_grows);
    ck_assert_uint_eq(bb.routes, a.routes + 1);
    dev_layer_free(cuda, &D);
    qm_backend_free(cuda);
    tl_layer_free(&L);
}
END_TEST

/* Prefill of f16/bf16 layer calls: the GEMM-sized jobs go to the WMMA
 * tensor-core GEMM (operands rounded to the call's type), the rest stays as
 * it was; both within the 16-bit tolerance of the CPU backend. */
START_TEST(test_cuda_f16_bf16_prefill_runs_on_tensor_cores_within_tolerance)
{
    qm_backend *cpu = new_cpu(), *cuda = new_cuda();
    /* f16 int4, bf16 int8 with zero points, f16 through the e2m1 code book. */
    for (int di = 0; di < 3; di++) {
        const qm_dtype dt = di == 1 ? QM_DTYPE_BF16 : QM_DTYPE_F16;
        tl_spec s = tl_default_spec(950 + (uint64_t)di);
        s.E = 4;
        s.k = 2;
        s.H = 128;
        s.I = 80; /* FC2's K = 80: a partial 32-column step */
        s.bits = di == 1 ? 8 : 4;
        s.codebook = di == 2 ? QM_CODEBOOK_E2M1 : QM_CODEBOOK_NONE;
        s.block_size = 32;
        s.act = QM_ACT_SWIGLU;
        s.fusion = 1;
        s.bias = 1;
        s.asym = di == 1;
        s.scale_dtype = dt;
        s.bias_dtype = dt;
        tl_layer L;
        ck_assert_int_eq(tl_layer_build(&s, &L), 0);
        dev_layer D;
        dev_layer_init(&D, cuda, &L, 0);
        enum { T = 150 }; /* ~75 rows per expert: two 64-row tiles */
        const uint32_t H = s.H;
        float *x = malloc(sizeof(float) * T * H), *lg = malloc(sizeof(float) * T * s.E);
        uint16_t *xh = malloc(2u * T * H), *oc = malloc(2u * T * H), *og = malloc(2u * T * H);
        float *fc = malloc(sizeof(float) * T * H), *fg = malloc(sizeof(float) * T * H);
        ck_assert(x && lg && xh && oc && og && fc && fg);
        tl_random_inputs(960 + (uint64_t)di, T, H, s.E, x, lg);
        for (uint32_t i = 0; i < T * H; i++)
            xh[i] = dt == QM_DTYPE_F16 ? qm_f32_to_f16(x[i]) : qm_f32_to_bf16(x[i]);
        qm_expert_source cs, ds;
        tl_source(&L, &cs);
        dev_source(&D, &ds);
        qm_status st = {0};
        qm_moe_call call = {.dtype = dt, .hidden = xh, .n_tokens = T, .logits = lg, .output = oc};
        ck_assert_int_eq(qm__moe_forward_layer(cpu, &L.cfg, &L.lv, &call, &cs, NULL, NULL, &st), 0);
        for (uint32_t i = 0; i < T * H; i++)
            fc[i] = dt == QM_DTYPE_F16 ? qm_f16_to_f32(oc[i]) : qm_bf16_to_f32(oc[i]);
        for (int on = 1; on >= 0; on--) {
            ck_assert_int_eq(qm_backend_cuda_set_tensor_cores(cuda, on), 0);
            qm_cuda_stats a, b;
            ck_assert_int_eq(qm_backend_cuda_stats(cuda, &a), 0);
            memset(og, 0xff, 2u * T * H); /* NaN in both types */
            call.output = og;
            ck_assert_int_eq(qm__moe_forward_layer(cuda, &L.cfg, &L.lv, &call, &ds, NULL, NULL, &st), 0);
            ck_assert_int_eq(qm_backend_cuda_stats(cuda, &b), 0);
            for (uint32_t i = 0; i < T * H; i++)
                fg[i] = dt == QM_DTYPE_F16 ? qm_f16_to_f32(og[i]) : qm_bf16_to_f32(og[i]);
            double e = rel_err(fg, fc, (size_t)T * H);
            printf("route: %s %s prefill T=%u, tensor cores %s (%llu launch sets): rel err vs "
                   "cpu %.3g\n",
                   qm_dtype_name(dt),
                   s.codebook    ? "e2m1"
                   : s.bits == 4 ? "int4"
                                 : "int8",
                   T, on ? "on" : "off", (unsigned long long)(b.tc_batches - a.tc_batches), e);
            ck_assert_msg(e <= 1e-2, "%s tensor cores %d: rel err %.3g", qm_dtype_name(dt), on, e);
            if (on)
                ck_assert_uint_gt(b.tc_batches, a.tc_batches);
            else
                ck_assert_uint_eq(b.tc_batches, a.tc_batches);
        }
        ck_assert_int_eq(qm_backend_cuda_set_tensor_cores(cuda, 1), 0);
        free(x);
        free(lg);
        free(xh);
        free(oc);
        free(og);
        free(fc);
        free(fg);
        dev_layer_free(cuda, &D);
        tl_layer_free(&L);
    }
    qm_backend_free(cpu);
    qm_backend_free(cuda);
}
END_TEST

TCase *cuda_route_tcase(void)
{
    TCase *tc = tcase_create("route");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_cuda_route_matches_host_routing_with_ties_drops_and_nan);
    tcase_add_test(tc, test_cuda_router_logits_route_like_the_host);
    tcase_add_test(tc, test_cuda_layer_routed_on_device_matches_host_routing);
    tcase_add_test(tc, test_cuda_rule_banks_and_supplied_routing_route_on_the_host);
    tcase_add_test(tc, test_cuda_routed_pass_refuses_misuse_and_the_backend_survives);
    tcase_add_test(tc, test_cuda_f16_bf16_prefill_runs_on_tensor_cores_within_tolerance);
    return tc;
}
