/* test_engine.c - the CPU backend and the MoE forward pass, against a float64
 * reference, across kernel paths, thread counts, expert orders and waves. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_fixture.h"
#include "qm_alloc.h"
#include "qm_backend_impl.h"
#include "qm_cuda.h"
#include "qm_moe.h"
#include "qm_moe_internal.h"

static const qm_activation ACTS[] = {QM_ACT_RELU, QM_ACT_GELU, QM_ACT_SILU, QM_ACT_IDENTITY,
                                     QM_ACT_SWIGLU, QM_ACT_SWIGLU, QM_ACT_SWIGLU};
static const uint32_t FUSIONS[] = {1, 1, 1, 1, 1, 2, 0};
static const qm_dtype DTS[] = {QM_DTYPE_F32, QM_DTYPE_F16, QM_DTYPE_BF16};

/* Every kernel path: "avx2" the AVX2 kernel this CPU's default uses,
 * "avx2-folded" the AVX2 one with the folded 4-bit GEMV (the default's on
 * CPUs without AVX-512), "auto" the default (measured per class, or the
 * cache), "measure" every class measured in this process without the
 * cache, "table" the fixed per-ISA table (qm_kernel_select.c). */
static const char *const KERNELS[] = {"scalar", "avx2",    "avx2-folded", "avx512",
                                      "auto",   "measure", "table"};
#define N_KERNELS 7

static int cpu_has(const char *kernel)
{
    static int reported;
    __builtin_cpu_init();
    int has;
    if (strcmp(kernel, "scalar") == 0 || strcmp(kernel, "auto") == 0 ||
        strcmp(kernel, "measure") == 0 || strcmp(kernel, "table") == 0)
        has = 1;
    else if (strncmp(kernel, "avx2", 4) == 0)
        has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    else
        has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vl");
    if (!has && !(reported & (1 << (kernel[3] & 7)))) {
        reported |= 1 << (kernel[3] & 7);
        fprintf(stderr, "kernel %s: this CPU cannot run it; its tests are skipped here\n", kernel);
    }
    return has;
}

static qm_backend *new_backend(const char *kernel, unsigned threads)
{
    qm_backend *be = NULL;
    qm_status st = {0};
    setenv("QMOE_KERNEL", kernel, 1);
    int rc = qm_backend_cpu_new(threads, &be, &st);
    ck_assert_msg(rc == 0, "cpu backend: %s", st.msg);
    qm_device_info info;
    ck_assert_int_eq(qm_backend_info(be, &info), 0);
    const char *want = kernel;
    if (strcmp(kernel, "auto") == 0 || strcmp(kernel, "measure") == 0 ||
        strcmp(kernel, "table") == 0)
        want = !__builtin_cpu_supports("avx2") ? "scalar"
               : kernel[0] == 'a'              ? "measured"
               : kernel[0] == 't'              ? "table:"
                                               : "all measured:";
    ck_assert_msg(strstr(info.name, want) != NULL, "wanted %s kernels, got '%s'", kernel,
                  info.name);
    return be;
}

/* Runs one f32 forward; returns the status code. */
static int forward_f32(qm_backend *be, tl_layer *L, uint32_t T, const float *x, const float *logits,
                       float *out, qm_expert_source *src, qm_moe_stats *stats)
{
    qm_expert_source local;
    if (!src) {
        tl_source(L, &local);
        src = &local;
    }
    qm_moe_call call = {.layer = 0, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T,
                        .logits = logits, .output = out};
    qm_status st = {0};
    int rc = qm__moe_forward_layer(be, &L->cfg, &L->lv, &call, src, NULL, stats, &st);
    if (rc != 0)
        fprintf(stderr, "forward: %s\n", st.msg);
    return rc;
}

static double check_against_reference(qm_backend *be, tl_layer *L, uint32_t T, uint64_t seed,
                                      float *out_copy)
{
    uint32_t H = L->spec.H, E = L->spec.E;
    float *x = malloc(sizeof(float) * T * H), *lg = malloc(sizeof(float) * T * E);
    float *out = malloc(sizeof(float) * T * H);
    double *ref = malloc(sizeof(double) * T * H);
    tl_random_inputs(seed, T, H, E, x, lg);
    ck_assert_int_eq(forward_f32(be, L, T, x, lg, out, NULL, NULL), 0);
    tl_reference(L, x, lg, T, ref);
    double err = tl_rel_err_f(out, ref, (size_t)T * H);
    if (out_copy)
        memcpy(out_copy, out, sizeof(float) * T * H);
    free(x);
    free(lg);
    free(out);
    free(ref);
    return err;
}

/* Every variant (bits, block size, symmetry, activation/fusion, scale and bias
 * dtypes, biases, GEMV and GEMM row counts) on every kernel path of this CPU,
 * against the float64 reference; paths also agree with each other. */
START_TEST(test_every_variant_matches_float64_reference)
{
    static const uint32_t BS[] = {0, 16, 32, 64, 128};
    const char *const *kernels = KERNELS;
    int n_cases = 0;
    double worst = 0;
    for (int bits = 4; bits <= 8; bits += 4)
        for (size_t bi = 0; bi < sizeof BS / sizeof BS[0]; bi++)
            for (int asym = 0; asym <= 1; asym++)
                for (size_t ai = 0; ai < sizeof ACTS / sizeof ACTS[0]; ai++) {
                    uint64_t seed = 1000 + (uint64_t)n_cases;
                    tl_spec s = tl_default_spec(seed);
                    s.H = 136;
                    s.I = 72;
                    s.bits = (uint32_t)bits;
                    s.block_size = BS[bi];
                    s.asym = asym;
                    s.act = ACTS[ai];
                    s.fusion = FUSIONS[ai];
                    s.bias = (n_cases % 3) != 0;
                    s.scale_dtype = DTS[n_cases % 3];
                    s.bias_dtype = DTS[(n_cases / 3) % 3];
                    s.limit = (n_cases % 2) ? 7.0f : 0.5f; /* 0.5 exercises the clamps */
                    tl_layer L;
                    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
                    for (int T = 3; T <= 37; T += 34) {
                        float first[37 * 136];
                        int have_first = 0;
                        for (int ki = 0; ki < N_KERNELS; ki++) {
                            if (!cpu_has(kernels[ki]))
                                continue;
                            qm_backend *be = new_backend(kernels[ki], 2);
                            float out[37 * 136];
                            double err = check_against_reference(be, &L, (uint32_t)T, seed + 7, out);
                            ck_assert_msg(err <= 1e-5,
                                          "%s bits %d bs %u asym %d act %d fusion %u T %d "
                                          "(seed %llu): rel err %.3g > 1e-5",
                                          kernels[ki], bits, BS[bi], asym, (int)s.act, s.fusion, T,
                                          (unsigned long long)seed, err);
                            if (err > worst)
                                worst = err;
                            if (have_first) {
                                double d = 0, nrm = 0;
                                for (int i = 0; i < T * 136; i++) {
                                    d += (out[i] - first[i]) * (double)(out[i] - first[i]);
                                    nrm += first[i] * (double)first[i];
                                }
                                ck_assert_msg(sqrt(d / nrm) <= 1e-5, "%s disagrees with scalar: %.3g",
                                              kernels[ki], sqrt(d / nrm));
                            } else {
                                memcpy(first, out, sizeof(float) * T * 136);
                                have_first = 1;
                            }
                            qm_backend_free(be);
                        }
                    }
                    tl_layer_free(&L);
                    n_cases++;
                }
    fprintf(stderr, "variants: %d layers x 2 row counts, worst rel err %.3g\n", n_cases, worst);
}
END_TEST

/* Block size 256 and shapes with long rows (several 256-column GEMM tiles). */
START_TEST(test_block_256_and_long_rows_match_reference)
{
    const char *const *kernels = KERNELS;
    for (int ki = 0; ki < N_KERNELS; ki++) {
        if (!cpu_has(kernels[ki]))
            continue;
        for (int bits = 4; bits <= 8; bits += 4) {
            tl_spec s = tl_default_spec(77 + (uint64_t)bits);
            s.H = 600;
            s.I = 330;
            s.E = 8;
            s.k = 4;
            s.bits = (uint32_t)bits;
            s.block_size = 256;
            s.asym = bits == 8;
            s.act = QM_ACT_SWIGLU;
            s.fusion = 1;
            tl_layer L;
            ck_assert_int_eq(tl_layer_build(&s, &L), 0);
            qm_backend *be = new_backend(kernels[ki], 2);
            for (uint32_t T = 1; T <= 40; T += 39) {
                double err = check_against_reference(be, &L, T, 5, NULL);
                ck_assert_msg(err <= 1e-5, "%s bits %d T %u: rel err %.3g", kernels[ki], bits, T,
                              err);
            }
            qm_backend_free(be);
            tl_layer_free(&L);
        }
    }
}
END_TEST

/* A last block shorter than the others while the row has no byte tail
 * (K = 80 with blocks of 32 or 64; K = 48): the decode kernels' whole-block
 * fast path must not run past the block. f32 symmetric scales select it. */
START_TEST(test_partial_last_block_matches_reference)
{
    const char *const *kernels = KERNELS;
    static const uint32_t BS[] = {32, 64};
    for (int ki = 0; ki < N_KERNELS; ki++) {
        if (!cpu_has(kernels[ki]))
            continue;
        qm_backend *be = new_backend(kernels[ki], 2);
        for (int bits = 4; bits <= 8; bits += 4)
            for (int bi = 0; bi < 2; bi++)
                for (int asym = 0; asym <= 1; asym++) {
                    tl_spec s = tl_default_spec(500 + (uint64_t)(bits * 4 + bi * 2 + asym));
                    s.H = 80;
                    s.I = 48;
                    s.E = 8;
                    s.bits = (uint32_t)bits;
                    s.block_size = BS[bi];
                    s.asym = asym;
                    s.act = QM_ACT_SWIGLU;
                    tl_layer L;
                    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
                    for (uint32_t T = 1; T <= 41; T += 20) {
                        double err = check_against_reference(be, &L, T, 9 + T, NULL);
                        ck_assert_msg(err <= 1e-5, "%s bits %d bs %u asym %d T %u: rel err %.3g",
                                      kernels[ki], bits, BS[bi], asym, T, err);
                    }
                    tl_layer_free(&L);
                }
        qm_backend_free(be);
    }
}
END_TEST

/* An expert source made for another layout of qm_expert_source is refused
 * before anything runs, naming both versions. */
START_TEST(test_forward_refuses_an_expert_source_of_another_version)
{
    qm_backend *be = new_backend("scalar", 1);
    tl_spec s = tl_default_spec(77);
    tl_layer L;
    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
    uint32_t T = 2, H = L.spec.H, E = L.spec.E;
    float *x = malloc(sizeof(float) * T * H), *lg = malloc(sizeof(float) * T * E);
    float *out = malloc(sizeof(float) * T * H);
    tl_random_inputs(3, T, H, E, x, lg);
    qm_expert_source src;
    tl_source(&L, &src);
    ck_assert_int_eq(forward_f32(be, &L, T, x, lg, out, &src, NULL), 0);
    src.version = QM_EXPERT_SOURCE_VERSION + 1;
    qm_moe_call call = {.layer = 0, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T,
                        .logits = lg, .output = out};
    qm_status st = {0};
    ck_assert_int_eq(qm__moe_forward_layer(be, &L.cfg, &L.lv, &call, &src, NULL, NULL, &st),
                     QM_EINVAL);
    ck_assert_msg(strstr(st.msg, "expert source of version 3 (want 2)") != NULL, "%s", st.msg);
    free(x);
    free(lg);
    free(out);
    tl_layer_free(&L);
    qm_backend_free(be);
}
END_TEST

/* f16 and bf16 hidden states: f32 arithmetic, output rounded to the input dtype. */
START_TEST(test_f16_and_bf16_activations_round_once)
{
    for (int di = 1; di <= 2; di++) {
        qm_dtype dt = DTS[di];
        tl_spec s = tl_default_spec(31 + (uint64_t)di);
        s.act = QM_ACT_SWIGLU;
        s.scale_dtype = dt;
        s.bias_dtype = dt;
        tl_layer L;
        ck_assert_int_eq(tl_layer_build(&s, &L), 0);
        qm_backend *be = new_backend(cpu_has("avx2") ? "avx2" : "scalar", 2);
        uint32_t T = 9, H = s.H;
        float x[9 * 88], lg[9 * 4], xr[9 * 88], outf[9 * 88];
        uint16_t xh[9 * 88], oh[9 * 88];
        double ref[9 * 88];
        tl_random_inputs(99, T, H, s.E, x, lg);
        for (uint32_t i = 0; i < T * H; i++) {
            xh[i] = dt == QM_DTYPE_F16 ? qm_f32_to_f16(x[i]) : qm_f32_to_bf16(x[i]);
            xr[i] = dt == QM_DTYPE_F16 ? qm_f16_to_f32(xh[i]) : qm_bf16_to_f32(xh[i]);
        }
        qm_expert_source src;
        tl_source(&L, &src);
        qm_moe_call call = {.dtype = dt, .hidden = xh, .n_tokens = T, .logits = lg, .output = oh};
        qm_status st = {0};
        ck_assert_int_eq(qm__moe_forward_layer(be, &L.cfg, &L.lv, &call, &src, NULL, NULL, &st), 0);
        for (uint32_t i = 0; i < T * H; i++)
            outf[i] = dt == QM_DTYPE_F16 ? qm_f16_to_f32(oh[i]) : qm_bf16_to_f32(oh[i]);
        tl_reference(&L, xr, lg, T, ref);
        double err = tl_rel_err_f(outf, ref, (size_t)T * H);
        double tol = dt == QM_DTYPE_F16 ? 1e-3 : 8e-3;
        ck_assert_msg(err <= tol, "%s: rel err %.3g > %.3g", dt == QM_DTYPE_F16 ? "f16" : "bf16", err, tol);
        qm_backend_free(be);
        tl_layer_free(&L);
    }
}
END_TEST

/* A layer whose call has both GEMV (few rows) and GEMM (many rows) experts. */
static void mixed_layer(tl_layer *L, uint64_t seed)
{
    tl_spec s = tl_default_spec(seed);
    s.E = 8;
    s.k = 2;
    s.H = 200;
    s.I = 120;
    s.act = QM_ACT_SWIGLU;
    s.asym = 1;
    ck_assert_int_eq(tl_layer_build(&s, L), 0);
}

/* Logits that send most tokens to experts 0 and 1 and a few elsewhere. */
static void skewed_logits(uint32_t T, uint32_t E, float *lg, uint64_t seed)
{
    uint64_t s = seed;
    for (uint32_t t = 0; t < T; t++)
        for (uint32_t e = 0; e < E; e++)
            lg[t * E + e] = tl_uniform(&s, -1, 1) + (e < 2 && t % 5 != 0 ? 3.0f : 0.0f);
}

START_TEST(test_outputs_bitwise_identical_across_thread_counts)
{
    const char *const *kernels = KERNELS;
    tl_layer L;
    mixed_layer(&L, 5);
    uint32_t T = 41, H = L.spec.H, E = L.spec.E;
    float *x = malloc(sizeof(float) * T * H), *lg = malloc(sizeof(float) * T * E);
    float *out[3];
    tl_random_inputs(11, T, H, E, x, lg);
    skewed_logits(T, E, lg, 12);
    for (int ki = 0; ki < N_KERNELS; ki++) {
        if (!cpu_has(kernels[ki]))
            continue;
        for (unsigned th = 1; th <= 3; th++) {
            qm_backend *be = new_backend(kernels[ki], th);
            out[th - 1] = malloc(sizeof(float) * T * H);
            ck_assert_int_eq(forward_f32(be, &L, T, x, lg, out[th - 1], NULL, NULL), 0);
            qm_backend_free(be);
        }
        ck_assert_msg(memcmp(out[0], out[1], sizeof(float) * T * H) == 0,
                      "%s: 1 and 2 threads differ", kernels[ki]);
        ck_assert_msg(memcmp(out[0], out[2], sizeof(float) * T * H) == 0,
                      "%s: 1 and 3 threads differ", kernels[ki]);
        for (int i = 0; i < 3; i++)
            free(out[i]);
    }
    free(x);
    free(lg);
    tl_layer_free(&L);
}
END_TEST

/* The CPU backend's fused schedule (one pool run per batch, per-job
 * dependencies, row blocks of several tiles, fast mode's tokens quantised
 * once, the routes summed by range as they land) against the phased one (a
 * barrier after each phase, one tile per task) and against the forward's
 * own sum after a wave per expert, on many small experts with few rows
 * each, and with fc3 and GEMM jobs: the same bits, on every SIMD kernel
 * path of this CPU, in both precisions, with 1, 2 and 3 threads. */
/* The fixture's source one expert a wave: no batch holds every route of
 * a call, so the forward sums them (qm_combine), not the backend. */
static int one_per_wave(void *ctx, uint32_t layer, const uint32_t *experts, size_t n,
                        qm_expert_weights *weights, size_t *n_ready, qm_status *st)
{
    qm_expert_source inner;
    tl_source(ctx, &inner);
    return inner.acquire(ctx, layer, experts, n < 1 ? n : 1, weights, n_ready, st);
}

static void run_schedule(const char *kernel, const char *schedule, unsigned threads, tl_layer *L,
                         const uint32_t *tokens, int n_tokens, const float *x, const float *lg,
                         float *out)
{
    setenv("QMOE_CPU_SCHEDULE", schedule, 1);
    qm_backend *be = new_backend(kernel, threads);
    const uint32_t H = L->spec.H;
    qm_expert_source src;
    tl_source(L, &src);
    if (strcmp(schedule, "waves") == 0) { /* the fused schedule, a wave per expert */
        unsetenv("QMOE_CPU_SCHEDULE");
        src.acquire = one_per_wave;
    }
    size_t off = 0;
    for (int p = 0; p < 2; p++) {
        for (int i = 0; i < n_tokens; i++) {
            qm_moe_call call = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = tokens[i],
                                .logits = lg, .output = out + off,
                                .precision = p ? QM_PRECISION_FAST : QM_PRECISION_EXACT};
            qm_status st = {0};
            ck_assert_msg(qm__moe_forward_layer(be, &L->cfg, &L->lv, &call, &src, NULL, NULL,
                                                &st) == 0,
                          "%s %s: %s", kernel, schedule, st.msg);
            off += (size_t)tokens[i] * H;
        }
    }
    qm_backend_free(be);
    unsetenv("QMOE_CPU_SCHEDULE");
}

START_TEST(test_fused_schedule_gives_the_phased_bits)
{
    static const uint32_t tokens[] = {1, 3, 16, 128};
    const int n_tokens = 4; /* 128: jobs of ~12 rows, the GEMM path */
    for (int shape = 0; shape < 2; shape++) {
        tl_layer L;
        tl_spec sp = tl_default_spec(41 + shape);
        sp.E = 64;
        sp.k = 6;
        sp.H = 96;
        sp.I = 64;
        sp.act = QM_ACT_SWIGLU;
        sp.fusion = shape ? 0 : 1; /* shape 1: separate fc3, 8-bit asymmetric */
        sp.bits = shape ? 8 : 4;
        sp.asym = shape;
        ck_assert_int_eq(tl_layer_build(&sp, &L), 0);
        const uint32_t H = L.spec.H, E = L.spec.E, T = 128;
        size_t total = 0;
        for (int i = 0; i < n_tokens; i++)
            total += (size_t)tokens[i] * H;
        total *= 2;
        float *x = malloc(sizeof(float) * T * H), *lg = malloc(sizeof(float) * T * E);
        float *want = malloc(sizeof(float) * total), *got = malloc(sizeof(float) * total);
        tl_random_inputs(43 + shape, T, H, E, x, lg);
        /* The SIMD kernels by name ("auto", "measure" and "table" pick among
         * them; the scalar one shares their schedule and is slow). */
        for (int ki = 1; ki < 4; ki++) {
            if (!cpu_has(KERNELS[ki]))
                continue;
            run_schedule(KERNELS[ki], "phased", 2, &L, tokens, n_tokens, x, lg, want);
            /* fused: the backend sums the routes as its last tiles land
             * (qm_combine); waves: the forward sums them after the batches */
            static const char *const other[] = {"fused", "waves"};
            for (int o = 0; o < 2; o++)
                for (unsigned th = 1; th <= 3; th++) {
                    memset(got, 0xff, sizeof(float) * total);
                    run_schedule(KERNELS[ki], other[o], th, &L, tokens, n_tokens, x, lg, got);
                    for (size_t i = 0; i < total; i++)
                        ck_assert_msg(memcmp(&got[i], &want[i], sizeof(float)) == 0,
                                      "shape %d, kernel %s, %s, %u threads: output %zu is %a, "
                                      "phased %a",
                                      shape, KERNELS[ki], other[o], th, i, (double)got[i],
                                      (double)want[i]);
                }
        }
        free(x);
        free(lg);
        free(want);
        free(got);
        tl_layer_free(&L);
    }
}
END_TEST

/* The AVX-512 GEMM runs the AVX2 GEMM's panels with wider vectors and the
 * same per-lane order, and both GEMVs run one order per weight width
 * (qm__q4_canon for 4 bits): decode (jobs of <= 4 rows) and prefill give
 * the same bits on both, so the measured kernel choice changes no output. */
START_TEST(test_layer_bits_same_on_avx2_and_avx512)
{
    if (!cpu_has("avx2") || !cpu_has("avx512"))
        return;
    for (int bits = 4; bits <= 8; bits += 4) {
        tl_spec s = tl_default_spec(600 + (uint64_t)bits);
        s.H = 300; /* several 256-column tiles, a short last one */
        s.I = 40;  /* a short last 16-row tile */
        s.E = 2;
        s.k = 2;
        s.bits = (uint32_t)bits;
        s.block_size = 32;
        s.asym = bits == 8;
        s.act = QM_ACT_SWIGLU;
        tl_layer L;
        ck_assert_int_eq(tl_layer_build(&s, &L), 0);
        uint32_t H = s.H;
        qm_backend *b2 = new_backend("avx2", 2), *b5 = new_backend("avx512", 2);
        /* Both experts get all T rows (k = E = 2): GEMV for 1 and 3, GEMM for 29. */
        static const uint32_t TS[] = {1, 3, 29};
        for (size_t ti = 0; ti < sizeof TS / sizeof TS[0]; ti++) {
            uint32_t T = TS[ti];
            float *x = malloc(sizeof(float) * T * H), *lg = malloc(sizeof(float) * T * s.E);
            float *o2 = malloc(sizeof(float) * T * H), *o5 = malloc(sizeof(float) * T * H);
            tl_random_inputs(3, T, H, s.E, x, lg);
            ck_assert_int_eq(forward_f32(b2, &L, T, x, lg, o2, NULL, NULL), 0);
            ck_assert_int_eq(forward_f32(b5, &L, T, x, lg, o5, NULL, NULL), 0);
            ck_assert_msg(memcmp(o2, o5, sizeof(float) * T * H) == 0,
                          "bits %d T %u: avx2 and avx512 outputs differ", bits, T);
            free(x);
            free(lg);
            free(o2);
            free(o5);
        }
        qm_backend_free(b2);
        qm_backend_free(b5);
        tl_layer_free(&L);
    }
}
END_TEST

/* A hostile source: makes one expert usable per acquire (or `step`), and
 * checks the protocol (ascending, distinct, release of what was acquired). */
typedef struct one_at_a_time {
    tl_layer *L;
    size_t step;
    int acquired, released, outstanding;
} one_at_a_time;

static int oaat_acquire(void *ctx, uint32_t layer, const uint32_t *experts, size_t n,
                        qm_expert_weights *weights, size_t *n_ready, qm_status *st)
{
    one_at_a_time *s = ctx;
    (void)layer;
    (void)st;
    ck_assert_int_eq(s->outstanding, 0);
    for (size_t i = 1; i < n; i++)
        ck_assert_uint_lt(experts[i - 1], experts[i]);
    size_t r = n < s->step ? n : s->step;
    for (size_t i = 0; i < r; i++)
        tl_expert_weights(s->L, experts[i], &weights[i]);
    *n_ready = r;
    s->acquired += (int)r;
    s->outstanding = (int)r;
    return 0;
}

static void oaat_release(void *ctx, uint32_t layer, const uint32_t *experts, size_t n)
{
    one_at_a_time *s = ctx;
    (void)layer;
    (void)experts;
    ck_assert_int_eq((int)n, s->outstanding);
    s->released += (int)n;
    s->outstanding = 0;
}

START_TEST(test_waves_give_bitwise_identical_outputs)
{
    tl_layer L;
    mixed_layer(&L, 6);
    uint32_t T = 41, H = L.spec.H, E = L.spec.E;
    float *x = malloc(sizeof(float) * T * H), *lg = malloc(sizeof(float) * T * E);
    float *a = malloc(sizeof(float) * T * H), *b = malloc(sizeof(float) * T * H);
    tl_random_inputs(13, T, H, E, x, lg);
    skewed_logits(T, E, lg, 14);
    qm_backend *be = new_backend(cpu_has("avx2") ? "avx2" : "scalar", 2);
    qm_moe_stats st1, st2;
    ck_assert_int_eq(forward_f32(be, &L, T, x, lg, a, NULL, &st1), 0);
    ck_assert_uint_eq(st1.waves, 1);
    for (size_t step = 1; step <= 3; step++) {
        one_at_a_time s = {.L = &L, .step = step};
        qm_expert_source src = {.version = QM_EXPERT_SOURCE_VERSION,
                                .ctx = &s,
                                .acquire = oaat_acquire,
                                .release = oaat_release};
        ck_assert_int_eq(forward_f32(be, &L, T, x, lg, b, &src, &st2), 0);
        ck_assert_int_eq(s.acquired, s.released);
        ck_assert_msg(st2.waves == (uint32_t)((s.acquired + step - 1) / step),
                      "step %zu: %u waves for %d experts", step, st2.waves, s.acquired);
        ck_assert_msg(memcmp(a, b, sizeof(float) * T * H) == 0, "step %zu changed the bits", step);
    }
    qm_backend_free(be);
    free(x);
    free(lg);
    free(a);
    free(b);
    tl_layer_free(&L);
}
END_TEST

/* The backend may run jobs in any order: results of each job do not change. */
START_TEST(test_expert_order_does_not_change_bits)
{
    tl_layer L;
    mixed_layer(&L, 7);
    uint32_t T = 30, H = L.spec.H, E = L.spec.E;
    float *x = malloc(sizeof(float) * T * H), *lg = malloc(sizeof(float) * T * E);
    tl_random_inputs(15, T, H, E, x, lg);
    /* Expert e gets tokens t with t % (e + 1) == 0: row counts 30, 15, 10, ... */
    uint32_t rows[8][30], outi[8][30], n[8] = {0};
    size_t total = 0;
    for (uint32_t e = 0; e < E; e++)
        for (uint32_t t = 0; t < T; t++)
            if (t % (e + 1) == 0) {
                rows[e][n[e]] = t;
                outi[e][n[e]++] = (uint32_t)total++;
            }
    float *ya = calloc(total * H, sizeof(float)), *yb = calloc(total * H, sizeof(float));
    qm_expert_job ja[8], jb[8];
    for (uint32_t e = 0; e < E; e++) {
        ja[e] = (qm_expert_job){.expert = e, .rows = rows[e], .out_index = outi[e], .n_rows = n[e]};
        tl_expert_weights(&L, e, &ja[e].weights);
        jb[E - 1 - e] = ja[e];
    }
    qm_backend *be = new_backend(cpu_has("avx2") ? "avx2" : "scalar", 3);
    qm_status st = {0};
    qm_expert_batch ba = {.config = &L.cfg, .layer = &L.lv, .x = x, .n_tokens = T, .y = ya,
                          .jobs = ja, .n_jobs = E};
    qm_expert_batch bb = ba;
    bb.y = yb;
    bb.jobs = jb;
    ck_assert_int_eq(qm_backend_run_experts(be, &ba, &st), 0);
    ck_assert_int_eq(qm_backend_run_experts(be, &bb, &st), 0);
    ck_assert(memcmp(ya, yb, sizeof(float) * total * H) == 0);
    /* One expert per batch, last first. */
    memset(yb, 0, sizeof(float) * total * H);
    for (int e = (int)E - 1; e >= 0; e--) {
        bb.jobs = &ja[e];
        bb.n_jobs = 1;
        ck_assert_int_eq(qm_backend_run_experts(be, &bb, &st), 0);
    }
    ck_assert(memcmp(ya, yb, sizeof(float) * total * H) == 0);
    qm_backend_free(be);
    free(x);
    free(lg);
    free(ya);
    free(yb);
    tl_layer_free(&L);
}
END_TEST

START_TEST(test_zero_tokens_give_empty_result)
{
    tl_layer L;
    tl_spec s = tl_default_spec(3);
    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
    qm_backend *be = new_backend("scalar", 1);
    qm_expert_source src;
    tl_source(&L, &src);
    qm_moe_call call = {.dtype = QM_DTYPE_F32, .n_tokens = 0};
    qm_moe_stats stats = {.waves = 99};
    qm_status st = {0};
    ck_assert_int_eq(qm__moe_forward_layer(be, &L.cfg, &L.lv, &call, &src, NULL, &stats, &st), 0);
    ck_assert_uint_eq(stats.waves, 0);
    qm_backend_free(be);
    tl_layer_free(&L);
}
END_TEST

START_TEST(test_routing_ties_go_to_larger_index)
{
    float lg[] = {1.0f, 3.0f, 3.0f, 2.0f, 3.0f};
    uint32_t ex[3];
    float w[3];
    qm_moe_route(lg, 1, 5, 3, ex, w);
    ck_assert_uint_eq(ex[0], 4);
    ck_assert_uint_eq(ex[1], 2);
    ck_assert_uint_eq(ex[2], 1);
    ck_assert_float_eq_tol(w[0], 1.0f / 3, 1e-7);
    ck_assert_float_eq_tol(w[0] + w[1] + w[2], 1.0f, 1e-6);
}
END_TEST

START_TEST(test_routing_softmax_over_k_and_drop_tiny)
{
    float lg[] = {0.0f, -40.0f, 1.0f, -0.5f};
    uint32_t ex[3];
    float w[3];
    /* k = 2: experts 2 then 0, weights softmax(1, 0). */
    qm_moe_route(lg, 1, 4, 2, ex, w);
    ck_assert_uint_eq(ex[0], 2);
    ck_assert_uint_eq(ex[1], 0);
    ck_assert_float_eq_tol(w[0], 1.0 / (1.0 + exp(-1.0)), 1e-6);
    /* k = 4 reaches the -40 logit: exp(-41) / sum <= 1e-8, dropped. */
    uint32_t ex4[4];
    float w4[4];
    qm_moe_route(lg, 1, 4, 4, ex4, w4);
    ck_assert_uint_eq(ex4[3], QM_ROUTE_DROPPED);
    ck_assert_float_eq(w4[3], 0.0f);
    ck_assert_uint_eq(ex4[2], 3);
}
END_TEST

START_TEST(test_dropped_route_contributes_nothing)
{
    tl_layer L;
    tl_spec s = tl_default_spec(4);
    s.k = 3;
    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
    qm_backend *be = new_backend("scalar", 1);
    uint32_t T = 2, H = s.H;
    float x[2 * 88], lg[2 * 4], a[2 * 88], b[2 * 88];
    tl_random_inputs(8, T, H, 4, x, lg);
    lg[3] = lg[4 + 3] = -100.0f; /* third route of each token: weight e^-100ish, dropped */
    lg[2] = lg[4 + 2] = -200.0f;
    ck_assert_int_eq(forward_f32(be, &L, T, x, lg, a, NULL, NULL), 0);
    L.cfg.k = 2;
    ck_assert_int_eq(forward_f32(be, &L, T, x, lg, b, NULL, NULL), 0);
    ck_assert(memcmp(a, b, sizeof a) == 0);
    qm_backend_free(be);
    tl_layer_free(&L);
}
END_TEST

START_TEST(test_router_logits_come_from_bank_router)
{
    tl_layer L;
    tl_spec s = tl_default_spec(9);
    s.router = 1;
    s.E = 6;
    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
    uint32_t T = 5, H = s.H, E = s.E;
    float x[5 * 88], lg[5 * 6], mine[5 * 6], a[5 * 88], b[5 * 88];
    tl_random_inputs(10, T, H, E, x, lg);
    qm_status st = {0};
    ck_assert_int_eq(qm_moe_router_logits(&L.cfg, &L.lv, x, T, mine, &st), 0);
    for (uint32_t t = 0; t < T; t++)
        for (uint32_t e = 0; e < E; e++) {
            double acc = L.router_b[e];
            for (uint32_t c = 0; c < H; c++)
                acc += L.router_w[e * H + c] * x[t * H + c];
            ck_assert_float_eq_tol(mine[t * E + e], acc, 1e-6 * (1 + fabs(acc)));
        }
    qm_backend *be = new_backend("scalar", 1);
    ck_assert_int_eq(forward_f32(be, &L, T, x, NULL, a, NULL, NULL), 0);
    ck_assert_int_eq(forward_f32(be, &L, T, x, mine, b, NULL, NULL), 0);
    ck_assert(memcmp(a, b, sizeof a) == 0);
    qm_backend_free(be);
    tl_layer_free(&L);
}
END_TEST

START_TEST(test_missing_router_is_einval_with_message)
{
    tl_layer L;
    tl_spec s = tl_default_spec(9);
    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
    qm_backend *be = new_backend("scalar", 1);
    float x[88] = {1}, out[88];
    qm_expert_source src;
    tl_source(&L, &src);
    qm_moe_call call = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = 1, .output = out};
    qm_status st = {0};
    ck_assert_int_eq(qm__moe_forward_layer(be, &L.cfg, &L.lv, &call, &src, NULL, NULL, &st), QM_EINVAL);
    ck_assert_msg(strstr(st.msg, "router") != NULL, "message: %s", st.msg);
    qm_backend_free(be);
    tl_layer_free(&L);
}
END_TEST

START_TEST(test_arena_is_aligned_and_sized_exactly)
{
    qm_backend *be = new_backend("scalar", 1);
    qm_status st = {0};
    qm_arena *a = NULL;
    ck_assert_str_eq(qm_backend_name(be), "cpu");
    ck_assert_int_eq(qm_backend_host_visible(be), 1);
    ck_assert_uint_eq(qm_backend_alignment(be), 64);
    ck_assert_int_eq(qm_arena_new(be, 1000003, &a, &st), 0);
    ck_assert_uint_eq(qm_arena_size(a), 1000003);
    ck_assert_uint_eq((uintptr_t)qm_arena_at(a, 0) % 64, 0);
    uint8_t src[4096];
    for (int i = 0; i < 4096; i++)
        src[i] = (uint8_t)(i * 7);
    qm_fence f = {0};
    ck_assert_int_eq(qm_backend_copy_h2d(be, qm_arena_at(a, 999000), src, 1000, &f, &st), 0);
    ck_assert_int_eq(qm_backend_fence_wait(be, &f, &st), 0);
    ck_assert(memcmp(qm_arena_at(a, 999000), src, 1000) == 0);
    ck_assert_uint_gt(f.seq, 0);
    ck_assert_int_eq(qm_backend_synchronize(be, &st), 0);
    qm_arena *none = (qm_arena *)1;
    ck_assert_int_eq(qm_arena_new(be, 0, &none, &st), QM_EINVAL);
    ck_assert_ptr_null(none);
    qm_arena_free(be, a);
    qm_arena_free(be, NULL);
    qm_backend_free(be);
    qm_backend_free(NULL);
}
END_TEST

static int fake_info(void *ctx, qm_device_info *out)
{
    (void)ctx;
    memset(out, 0, sizeof *out);
    return 0;
}
static int destroyed;
static void fake_destroy(void *ctx)
{
    (void)ctx;
    destroyed++;
}

START_TEST(test_backend_wrap_rejects_other_iface_version)
{
    qm_backend_iface iface = {.version = QM_BACKEND_IFACE_VERSION + 1, .name = "fake",
                              .info = fake_info, .destroy = fake_destroy};
    qm_backend *be = (qm_backend *)1;
    qm_status st = {0};
    destroyed = 0;
    ck_assert_int_eq(qm__backend_wrap(&iface, NULL, &be, &st), QM_EUNSUPPORTED);
    ck_assert_ptr_null(be);
    ck_assert_int_eq(destroyed, 1);
    ck_assert_msg(strstr(st.msg, "version") != NULL, "%s", st.msg);
}
END_TEST

static int stub_arena_alloc(void *ctx, qm_arena *a, uint64_t bytes, qm_status *st)
{
    (void)ctx;
    (void)a;
    (void)bytes;
    return qm_status_set(st, QM_EUNSUPPORTED, "no arenas here");
}
static void stub_arena_release(void *ctx, qm_arena *a)
{
    (void)ctx;
    (void)a;
}
static int stub_copy(void *ctx, void *dst, const void *src, uint64_t n, qm_fence *f, qm_status *st)
{
    (void)ctx;
    (void)dst;
    (void)src;
    (void)n;
    (void)f;
    return qm_status_set(st, QM_EUNSUPPORTED, "no copies here");
}
static int stub_run(void *ctx, const qm_expert_batch *b, qm_status *st)
{
    (void)ctx;
    (void)b;
    return qm_status_set(st, QM_EUNSUPPORTED, "no kernels here");
}
static int stub_route(void *ctx, const qm_routing_request *rq, void **pass, qm_status *st)
{
    (void)ctx;
    (void)rq;
    *pass = NULL;
    return qm_status_set(st, QM_EUNSUPPORTED, "no routing here");
}
static int stub_register(void *ctx, const void *p, size_t n, qm_status *st)
{
    (void)ctx;
    (void)p;
    (void)n;
    return qm_status_set(st, QM_EUNSUPPORTED, "no registration here");
}

START_TEST(test_backend_wrap_wants_each_optional_group_whole)
{
    qm_backend_iface routing = {.version = QM_BACKEND_IFACE_VERSION, .name = "half-routing",
                                .info = fake_info, .arena_alloc = stub_arena_alloc,
                                .arena_release = stub_arena_release, .copy_h2d = stub_copy,
                                .run_experts = stub_run, .destroy = fake_destroy,
                                .route = stub_route};
    qm_backend *be = (qm_backend *)1;
    qm_status st = {0};
    destroyed = 0;
    ck_assert_int_eq(qm__backend_wrap(&routing, NULL, &be, &st), QM_EINVAL);
    ck_assert_ptr_null(be);
    ck_assert_int_eq(destroyed, 1);
    ck_assert_msg(strstr(st.msg, "all four or none") != NULL, "%s", st.msg);

    qm_backend_iface reg = routing;
    reg.name = "half-registration";
    reg.route = NULL;
    reg.register_host = stub_register;
    be = (qm_backend *)1;
    ck_assert_int_eq(qm__backend_wrap(&reg, NULL, &be, &st), QM_EINVAL);
    ck_assert_ptr_null(be);
    ck_assert_int_eq(destroyed, 2);
    ck_assert_msg(strstr(st.msg, "both or none") != NULL, "%s", st.msg);
}
END_TEST

/* A backend that runs its experts on an inner CPU backend, with allocation
 * counting paused while the CPU backend runs: what is left is the engine's
 * own allocations. Its routing methods, when present, always decline. */
typedef struct counting_backend {
    qm_backend *cpu;
    int route_calls, run_routed_calls;
} counting_backend;

static unsigned long n_allocs;
static int counting;
static void *count_malloc(size_t n, void *ud)
{
    (void)ud;
    n_allocs += counting;
    return malloc(n);
}
static void *count_realloc(void *p, size_t n, void *ud)
{
    (void)ud;
    n_allocs += counting;
    return realloc(p, n);
}
static void count_free(void *p, void *ud)
{
    (void)ud;
    free(p);
}
static const qm_alloc_hooks count_hooks = {count_malloc, count_realloc, count_free, NULL};

static int cb_run(void *ctx, const qm_expert_batch *b, qm_status *st)
{
    counting_backend *cb = ctx;
    int was = counting;
    counting = 0;
    int rc = qm_backend_run_experts(cb->cpu, b, st);
    counting = was;
    return rc;
}
static int cb_route(void *ctx, const qm_routing_request *rq, void **pass, qm_status *st)
{
    (void)rq;
    counting_backend *cb = ctx;
    cb->route_calls++;
    *pass = NULL;
    return qm_status_set(st, QM_EUNSUPPORTED, "routing declined");
}
static int cb_run_routed(void *ctx, void *pass, const qm_expert_batch *b, qm_status *st)
{
    (void)pass;
    (void)b;
    counting_backend *cb = ctx;
    cb->run_routed_calls++;
    return qm_status_set(st, QM_EINTERNAL, "a declined pass was run");
}
static int cb_combine(void *ctx, void *pass, float *out, qm_status *st)
{
    (void)ctx;
    (void)pass;
    (void)out;
    return qm_status_set(st, QM_EINTERNAL, "a declined pass was combined");
}
static void cb_pass_release(void *ctx, void *pass)
{
    (void)ctx;
    (void)pass;
}

static qm_backend *counting_backend_new(counting_backend *cb, qm_backend_iface *iface,
                                        int with_routing)
{
    memset(iface, 0, sizeof *iface);
    iface->version = QM_BACKEND_IFACE_VERSION;
    iface->name = with_routing ? "declining" : "counting";
    iface->info = fake_info;
    iface->arena_alloc = stub_arena_alloc;
    iface->arena_release = stub_arena_release;
    iface->copy_h2d = stub_copy;
    iface->run_experts = cb_run;
    iface->destroy = fake_destroy;
    if (with_routing) {
        iface->routes = QM_BACKEND_ROUTES_LEGACY;
        iface->route = cb_route;
        iface->run_routed = cb_run_routed;
        iface->combine = cb_combine;
        iface->pass_release = cb_pass_release;
    }
    qm_backend *be = NULL;
    qm_status st = {0};
    ck_assert_msg(qm__backend_wrap(iface, cb, &be, &st) == 0, "wrap: %s", st.msg);
    return be;
}

/* A session's scratch grows to its largest call and stays: the forward pass
 * allocates nothing per call after that (route, group, waves, combine). */
START_TEST(test_forward_with_kept_scratch_allocates_nothing_per_call)
{
    tl_layer L;
    tl_spec sp = tl_default_spec(31);
    sp.E = 8;
    sp.k = 3;
    sp.router = 1;
    ck_assert_int_eq(tl_layer_build(&sp, &L), 0);
    const uint32_t T = 9, H = L.spec.H, E = L.spec.E;
    float *x = malloc(sizeof(float) * T * H), *lg = malloc(sizeof(float) * T * E);
    float *want = malloc(sizeof(float) * T * H), *got = malloc(sizeof(float) * T * H);
    tl_random_inputs(32, T, H, E, x, lg);
    counting_backend cb = {.cpu = new_backend("scalar", 2)};
    qm_backend_iface iface;
    qm_backend *be = counting_backend_new(&cb, &iface, 0);
    ck_assert_int_eq(forward_f32(cb.cpu, &L, T, x, NULL, want, NULL, NULL), 0);

    qm__moe_scratch *scratch = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm__moe_scratch_new(&scratch, &st), 0);
    qm_expert_source src;
    tl_source(&L, &src);
    qm_alloc_set_hooks(&count_hooks);
    unsigned long per_call[4];
    size_t bytes_after_first = 0;
    /* T, T, a smaller call, T again; the bank's router (logits NULL) on the
     * first two, the caller's logits on the others. */
    static const uint32_t tokens[4] = {T, T, 4, T};
    for (int i = 0; i < 4; i++) {
        qm_moe_call call = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = tokens[i],
                            .logits = i < 2 ? NULL : lg, .output = got};
        n_allocs = 0;
        counting = 1;
        int rc = qm__moe_forward_layer(be, &L.cfg, &L.lv, &call, &src, scratch, NULL, &st);
        counting = 0;
        per_call[i] = n_allocs;
        ck_assert_msg(rc == 0, "call %d: %s", i, st.msg);
        if (i == 0)
            bytes_after_first = qm__moe_scratch_bytes(scratch);
        if (i == 1)
            ck_assert_msg(memcmp(got, want, sizeof(float) * T * H) == 0,
                          "kept scratch changed the bits");
    }
    qm_alloc_set_hooks(NULL);
    printf("forward allocations per call with a kept scratch: %lu, %lu, %lu, %lu (%zu bytes)\n",
           per_call[0], per_call[1], per_call[2], per_call[3], qm__moe_scratch_bytes(scratch));
    ck_assert_uint_gt(per_call[0], 0);
    for (int i = 1; i < 4; i++)
        ck_assert_msg(per_call[i] == 0, "call %d allocated %lu times", i, per_call[i]);
    ck_assert_uint_eq(qm__moe_scratch_bytes(scratch), bytes_after_first);

    /* Without a kept scratch a call makes its own: a bounded few. */
    qm_moe_call call = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T, .output = got};
    qm_alloc_set_hooks(&count_hooks);
    n_allocs = 0;
    counting = 1;
    ck_assert_int_eq(qm__moe_forward_layer(be, &L.cfg, &L.lv, &call, &src, NULL, NULL, &st), 0);
    counting = 0;
    qm_alloc_set_hooks(NULL);
    printf("forward allocations of a one-shot call: %lu\n", n_allocs);
    ck_assert_uint_le(n_allocs, 2);
    ck_assert(memcmp(got, want, sizeof(float) * T * H) == 0);

    qm__moe_scratch_free(scratch);
    qm__moe_scratch_free(NULL);
    qm_backend_free(be);
    qm_backend_free(cb.cpu);
    free(x);
    free(lg);
    free(want);
    free(got);
    tl_layer_free(&L);
}
END_TEST

/* A backend whose routing declines (QM_EUNSUPPORTED, as CUDA's when switched
 * off) gets the host routing: the CPU backend's bits, its own routed methods
 * never called. */
START_TEST(test_declined_backend_routing_falls_back_to_the_host)
{
    tl_layer L;
    mixed_layer(&L, 33);
    const uint32_t T = 17, H = L.spec.H, E = L.spec.E;
    float *x = malloc(sizeof(float) * T * H), *lg = malloc(sizeof(float) * T * E);
    float *want = malloc(sizeof(float) * T * H), *got = malloc(sizeof(float) * T * H);
    tl_random_inputs(34, T, H, E, x, lg);
    counting_backend cb = {.cpu = new_backend("scalar", 2)};
    qm_backend_iface iface;
    qm_backend *be = counting_backend_new(&cb, &iface, 1);
    ck_assert_int_eq(forward_f32(cb.cpu, &L, T, x, lg, want, NULL, NULL), 0);
    ck_assert_int_eq(forward_f32(be, &L, T, x, lg, got, NULL, NULL), 0);
    ck_assert_int_eq(cb.route_calls, 1);
    ck_assert_int_eq(cb.run_routed_calls, 0);
    ck_assert(memcmp(got, want, sizeof(float) * T * H) == 0);
    qm_backend_free(be);
    qm_backend_free(cb.cpu);
    free(x);
    free(lg);
    free(want);
    free(got);
    tl_layer_free(&L);
}
END_TEST

/* register_host is optional: the CPU backend has nothing to register. */
START_TEST(test_register_host_defaults_to_nothing_to_do)
{
    qm_backend *be = new_backend("scalar", 1);
    static const char bank[4096];
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_register_host(be, bank, sizeof bank, &st), 0);
    ck_assert_int_eq(qm_backend_unregister_host(be, bank, &st), 0);
    qm_backend_free(be);
}
END_TEST

START_TEST(test_cuda_without_cuda_is_unsupported)
{
#ifdef QMOE_HAVE_CUDA
    fprintf(stderr, "skipped: built with CUDA, the stub is not compiled\n");
#else
    qm_backend *be = (qm_backend *)1;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_cuda_new(0, &be, &st), QM_EUNSUPPORTED);
    ck_assert_ptr_null(be);
    ck_assert_msg(strstr(st.msg, "without CUDA") != NULL, "%s", st.msg);
#endif
}
END_TEST

START_TEST(test_half_conversions_round_to_nearest_even)
{
    ck_assert_uint_eq(qm_f32_to_f16(1.0f), 0x3c00);
    ck_assert_uint_eq(qm_f32_to_f16(-2.0f), 0xc000);
    ck_assert_uint_eq(qm_f32_to_f16(65504.0f), 0x7bff);
    ck_assert_uint_eq(qm_f32_to_f16(65520.0f), 0x7c00);         /* rounds up to inf */
    ck_assert_uint_eq(qm_f32_to_f16(1.0f + 1.0f / 2048), 0x3c00); /* tie to even */
    ck_assert_uint_eq(qm_f32_to_f16(1.0f + 3.0f / 2048), 0x3c02); /* tie to even (up) */
    ck_assert_uint_eq(qm_f32_to_f16(5.9604644775390625e-8f), 0x0001); /* smallest subnormal */
    ck_assert_uint_eq(qm_f32_to_f16(2.98e-8f), 0x0000);
    ck_assert_float_eq(qm_f16_to_f32(0x0001), 5.9604644775390625e-8f);
    ck_assert_float_eq(qm_f16_to_f32(0x3555), 0.333251953125f);
    ck_assert(isinf(qm_f16_to_f32(0x7c00)));
    ck_assert(isnan(qm_f16_to_f32(0x7e00)));
    ck_assert(isnan(qm_f16_to_f32(qm_f32_to_f16(NAN))));
    for (uint32_t h = 0; h < 0x7c00; h++) /* every finite f16 survives a round trip */
        ck_assert_uint_eq(qm_f32_to_f16(qm_f16_to_f32((uint16_t)h)), h);
    ck_assert_uint_eq(qm_f32_to_bf16(1.0f), 0x3f80);
    ck_assert_uint_eq(qm_f32_to_bf16(1.00390625f), 0x3f80); /* tie to even */
    ck_assert_uint_eq(qm_f32_to_bf16(1.01171875f), 0x3f82); /* tie to even (up) */
    ck_assert_float_eq(qm_bf16_to_f32(0xc000), -2.0f);
    ck_assert(isnan(qm_bf16_to_f32(qm_f32_to_bf16(NAN))));
}
END_TEST

START_TEST(test_weights_from_unit_follow_tensor_order)
{
    tl_layer L;
    tl_spec s = tl_default_spec(21);
    s.asym = 1;
    s.act = QM_ACT_SWIGLU;
    s.fusion = 0;
    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
    /* Build expert 2's unit: its slices concatenated in tensor order. */
    uint8_t *unit = malloc(L.lv.bytes_per_expert);
    qm_expert_weights direct, from_unit;
    tl_expert_weights(&L, 2, &direct);
    size_t off = 0;
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        if (!L.lv.t[t].present)
            continue;
        size_t n = L.lv.t[t].nbytes / s.E;
        memcpy(unit + off, direct.ptr[t], n);
        off += n;
    }
    ck_assert_uint_eq(off, L.lv.bytes_per_expert);
    qm_expert_weights_from_unit(&L.lv, s.E, 2, unit, &from_unit);
    off = 0;
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        if (!L.lv.t[t].present) {
            ck_assert_ptr_null(from_unit.ptr[t]);
            continue;
        }
        ck_assert_ptr_eq(from_unit.ptr[t], unit + off);
        off += L.lv.t[t].nbytes / s.E;
    }
    /* Running the expert from the unit gives the same bits as from the layer. */
    qm_backend *be = new_backend("scalar", 1);
    float x[88], y1[88], y2[88];
    float lg[4];
    tl_random_inputs(3, 1, 88, 4, x, lg);
    uint32_t row = 0, oi = 0;
    qm_expert_job job = {.expert = 2, .weights = direct, .rows = &row, .out_index = &oi, .n_rows = 1};
    qm_expert_batch b = {.config = &L.cfg, .layer = &L.lv, .x = x, .n_tokens = 1, .y = y1,
                         .jobs = &job, .n_jobs = 1};
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_run_experts(be, &b, &st), 0);
    job.weights = from_unit;
    b.y = y2;
    ck_assert_int_eq(qm_backend_run_experts(be, &b, &st), 0);
    ck_assert(memcmp(y1, y2, sizeof y1) == 0);
    qm_backend_free(be);
    free(unit);
    tl_layer_free(&L);
}
END_TEST

START_TEST(test_bad_jobs_are_rejected_with_a_message)
{
    tl_layer L;
    tl_spec s = tl_default_spec(22);
    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
    qm_backend *be = new_backend("scalar", 2);
    float x[88] = {0}, y[88];
    uint32_t row = 5, oi = 0;
    qm_expert_job job = {.expert = 1, .rows = &row, .out_index = &oi, .n_rows = 1};
    tl_expert_weights(&L, 1, &job.weights);
    qm_expert_batch b = {.config = &L.cfg, .layer = &L.lv, .x = x, .n_tokens = 1, .y = y,
                         .jobs = &job, .n_jobs = 1};
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_run_experts(be, &b, &st), QM_EINVAL); /* row 5 of 1 token */
    row = 0;
    job.expert = 9;
    ck_assert_int_eq(qm_backend_run_experts(be, &b, &st), QM_EINVAL);
    job.expert = 1;
    job.weights.ptr[QM_T_FC2_SCALES] = NULL;
    ck_assert_int_eq(qm_backend_run_experts(be, &b, &st), QM_EINVAL);
    ck_assert_msg(strstr(st.msg, "fc2") != NULL, "%s", st.msg);
    qm_backend_free(be);
    tl_layer_free(&L);
}
END_TEST

static Suite *engine_suite(void)
{
    Suite *s = suite_create("engine");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_every_variant_matches_float64_reference);
    tcase_add_test(tc, test_block_256_and_long_rows_match_reference);
    tcase_add_test(tc, test_partial_last_block_matches_reference);
    tcase_add_test(tc, test_forward_refuses_an_expert_source_of_another_version);
    tcase_add_test(tc, test_f16_and_bf16_activations_round_once);
    tcase_add_test(tc, test_outputs_bitwise_identical_across_thread_counts);
    tcase_add_test(tc, test_fused_schedule_gives_the_phased_bits);
    tcase_add_test(tc, test_layer_bits_same_on_avx2_and_avx512);
    tcase_add_test(tc, test_waves_give_bitwise_identical_outputs);
    tcase_add_test(tc, test_expert_order_does_not_change_bits);
    tcase_add_test(tc, test_zero_tokens_give_empty_result);
    tcase_add_test(tc, test_routing_ties_go_to_larger_index);
    tcase_add_test(tc, test_routing_softmax_over_k_and_drop_tiny);
    tcase_add_test(tc, test_dropped_route_contributes_nothing);
    tcase_add_test(tc, test_router_logits_come_from_bank_router);
    tcase_add_test(tc, test_missing_router_is_einval_with_message);
    tcase_add_test(tc, test_arena_is_aligned_and_sized_exactly);
    tcase_add_test(tc, test_backend_wrap_rejects_other_iface_version);
    tcase_add_test(tc, test_backend_wrap_wants_each_optional_group_whole);
    tcase_add_test(tc, test_forward_with_kept_scratch_allocates_nothing_per_call);
    tcase_add_test(tc, test_declined_backend_routing_falls_back_to_the_host);
    tcase_add_test(tc, test_register_host_defaults_to_nothing_to_do);
    tcase_add_test(tc, test_cuda_without_cuda_is_unsupported);
    tcase_add_test(tc, test_half_conversions_round_to_nearest_even);
    tcase_add_test(tc, test_weights_from_unit_follow_tensor_order);
    tcase_add_test(tc, test_bad_jobs_are_rejected_with_a_message);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(engine_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
