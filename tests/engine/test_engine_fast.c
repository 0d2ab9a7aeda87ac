/* test_engine_fast.c - fast mode (precision "fast": int8 activations,
 * integer dot products) on every fast kernel this CPU runs (and the models
 * of those it cannot, engine/kernels/qm_kernel_i8_model*.c), all with the scalar
 * specification's bits, against the float64 reference with the bound
 * derived in docs/ARCHITECTURE.md:
 *
 *   |y_fast[n] - y[n]| <= sum_j (dx_j / 2) * sum_{c in j} |W[n,c]|
 *                         + 1e-5 * sum_c |W[n,c]| * |x[c]|
 *
 * (the first term: each activation moves by at most half its sub-block's
 * step dx_j = max|x_j| / 127; the integer sums are exact; the second term
 * covers the f32 rounding of the two fma chains, sub-blocks within a block
 * and blocks within the row.)
 * Plus: the layer forward in fast mode on each kernel, bitwise identical
 * across thread counts and expert orders, and the exact mode untouched. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_fixture.h"
#include "qm_backend_impl.h"
#include "qm_kernels.h"
#include "qm_moe.h"
#include "qm_moe_internal.h"
#include "qm_kernel_isa.h"

/* The fast kernels by QMOE_KERNEL name: "scalar", every row of the fast
 * table (qm_kernel_isa.h), and "auto" (the measured choice); their count. */
#define N_I8_MAX 16
static const char *I8[N_I8_MAX];
static int N_I8;

static void i8_names(void)
{
    N_I8 = 0;
    I8[N_I8++] = "scalar";
    for (size_t i = 0; i < qm__i8isa_count() && N_I8 < N_I8_MAX - 1; i++)
        I8[N_I8++] = qm__i8isa_at(i)->kernel.name;
    I8[N_I8++] = "auto";
}

/* The fast kernel QMOE_KERNEL=name selects, or NULL (said once, with the
 * reason) when this CPU cannot run it. */
static const qm__i8kernel *i8_kernel(const char *name)
{
    static int reported[N_I8_MAX];
    setenv("QMOE_KERNEL", name, 1);
    const qm__i8kernel *k = qm__i8kernel_select();
    unsetenv("QMOE_KERNEL");
    if (strcmp(k->name, name) == 0 || strcmp(name, "auto") == 0)
        return k;
    int i = qm__i8isa_find(name);
    for (int n = 0; n < N_I8; n++)
        if (strcmp(I8[n], name) == 0 && !reported[n] && i >= 0) {
            reported[n] = 1;
            const qm__i8isa *row = qm__i8isa_at((size_t)i);
            char why[160] = "the self-check refused it";
            if (row->not_built)
                snprintf(why, sizeof why, "%s", row->not_built);
            else
                qm__cpu_needs(row->needs, why, sizeof why);
            fprintf(stderr, "fast kernel %s: this CPU cannot run it (%s); skipped here%s\n", name,
                    why, row->model ? ", its model runs" : "");
        }
    return NULL;
}

/* The i-th kernel of the bound test: the named ones, then the rows'
 * software models (their GEMV needs AVX2; NULL past the end or not here). */
static const qm__i8kernel *bound_kernel(int i, int *named)
{
    *named = i < N_I8;
    if (i < N_I8)
        return i8_kernel(I8[i]);
    int m = i - N_I8;
    for (size_t r = 0; r < qm__i8isa_count(); r++)
        if (qm__i8isa_at(r)->model && m-- == 0)
            return i8_kernel("avx2") ? &qm__i8isa_at(r)->model->kernel : NULL;
    return NULL;
}

/* fc1 of expert e of a fixture layer as a kernel matrix. */
static void fc1_qmat(const tl_layer *L, uint32_t e, qm__qmat *m)
{
    qm_expert_weights w;
    tl_expert_weights(L, e, &w);
    const qm_tensor_view *tw = &L->lv.t[QM_T_FC1_WEIGHT], *ts = &L->lv.t[QM_T_FC1_WEIGHT + 1],
                         *tz = &L->lv.t[QM_T_FC1_WEIGHT + 2];
    memset(m, 0, sizeof *m);
    m->w = w.ptr[QM_T_FC1_WEIGHT];
    m->row_bytes = (size_t)tw->shape[2];
    m->scales = w.ptr[QM_T_FC1_WEIGHT + 1];
    m->scale_dtype = ts->dtype;
    m->n = L->n[0];
    m->k = L->kk[0];
    m->bits = L->spec.bits;
    m->nblk = ts->ndim == 3 ? (uint32_t)ts->shape[2] : 1;
    if (m->nblk <= 1) {
        m->nblk = 1;
        m->block = m->k;
    } else {
        m->block = L->spec.block_size;
    }
    if (tz->present && w.ptr[QM_T_FC1_WEIGHT + 2]) {
        m->zp = w.ptr[QM_T_FC1_WEIGHT + 2];
        m->zp_blockwise = tz->ndim == 3;
        m->zp_row_bytes = m->zp_blockwise ? (size_t)tz->shape[2] : 0;
    }
}

/* Every weight variant fast mode takes (bits, blocks of 32..128 and row-wise,
 * zero points, scale dtypes, K not a multiple of 32, tiles ending in a partial
 * group of 8 rows), row counts 1..7 and 37,
 * each output within the derived bound. */
START_TEST(test_fast_kernels_within_derived_bound)
{
    static const uint32_t BS[] = {0, 32, 64, 128};
    static const qm_dtype DT[] = {QM_DTYPE_F32, QM_DTYPE_F16, QM_DTYPE_BF16};
    static const uint32_t NX[] = {1, 2, 3, 4, 5, 7, 37};
    int cases = 0, ran[N_I8_MAX] = {0};
    i8_names();
    double worst = 0; /* error / bound */
    for (int bits = 4; bits <= 8; bits += 4)
        for (int bi = 0; bi < 4; bi++)
            for (int asym = 0; asym <= 1; asym++)
                for (int kk = 0; kk < 3; kk++) {
                    tl_spec s = tl_default_spec(9000 + (uint64_t)cases);
                    s.H = kk == 1 ? 200 : 256; /* 200: a partial last sub-block */
                    s.I = kk == 2 ? 44 : 40;   /* 44: a tile ending in a partial group of rows */
                    s.E = 2;
                    s.k = 1;
                    s.bits = (uint32_t)bits;
                    s.block_size = BS[bi];
                    if (s.block_size && s.H % s.block_size)
                        s.H = 192 + s.block_size; /* whole blocks but K % 32 may still be 0 */
                    s.asym = asym;
                    s.scale_dtype = DT[cases % 3];
                    s.act = QM_ACT_SILU;
                    tl_layer L;
                    ck_assert_int_eq(tl_layer_build(&s, &L), 0);
                    qm__qmat m;
                    fc1_qmat(&L, 1, &m);
                    ck_assert(qm__i8_ok(&m));
                    uint32_t N = m.n, K = m.k;
                    size_t ld = (qm__i8_x_stride(&m) + 15) & ~(size_t)15;
                    float *x = malloc(sizeof(float) * 37 * K);
                    float *xq = calloc(ld * 37, sizeof(float));
                    float *y = malloc(sizeof(float) * 37 * N);
                    float *scratch = malloc(sizeof(float) * qm__kernel_scratch_floats(&m));
                    uint64_t rs = 77 + (uint64_t)cases;
                    for (uint32_t i = 0; i < 37 * K; i++) /* mixed magnitudes per sub-block */
                        x[i] = tl_uniform(&rs, -1, 1) * ((i / 7) % 5 == 0 ? 8.0f : 1.0f);
                    for (uint32_t r = 0; r < 37; r++)
                        qm__i8_prep(&m, x + (size_t)r * K, xq + r * ld);
                    const double *W = L.deq[0] + (size_t)1 * N * K;
                    /* Every fast kernel gives the scalar kernel's bits (qm_kernel_i8.h). */
                    float *simd_y[sizeof NX / sizeof NX[0]] = {0};
                    for (int ki = 0; ki < N_I8 + (int)qm__i8isa_count(); ki++) {
                        int named;
                        const qm__i8kernel *k = bound_kernel(ki, &named);
                        if (!k)
                            continue;
                        if (named)
                            ran[ki]++;
                        for (size_t ni = 0; ni < sizeof NX / sizeof NX[0]; ni++) {
                            uint32_t nx = NX[ni];
                            for (uint32_t n0 = 0; n0 < N; n0 += QM__TILE_ROWS)
                                k->mm(&m, n0, n0 + QM__TILE_ROWS < N ? n0 + QM__TILE_ROWS : N, xq,
                                      ld, nx, y, N, scratch);
                            if (!simd_y[ni]) {
                                simd_y[ni] = malloc(sizeof(float) * nx * N);
                                memcpy(simd_y[ni], y, sizeof(float) * nx * N);
                            } else {
                                ck_assert_msg(memcmp(simd_y[ni], y, sizeof(float) * nx * N) == 0,
                                              "%s: bits differ from the scalar kernel's "
                                              "(bits %d bs %u nx %u)",
                                              k->name, bits, s.block_size, nx);
                            }
                            for (uint32_t r = 0; r < nx; r++)
                                for (uint32_t n = 0; n < N; n++) {
                                    const float *xr = x + (size_t)r * K;
                                    double ref = 0, qb = 0, ab = 0;
                                    for (uint32_t j = 0; j * 32 < K; j++) {
                                        double amax = 0, wl1 = 0;
                                        for (uint32_t c = 32 * j; c < K && c < 32 * j + 32; c++) {
                                            amax = fmax(amax, fabs(xr[c]));
                                            wl1 += fabs(W[(size_t)n * K + c]);
                                        }
                                        qb += 0.5 * (amax / 127.0) * wl1;
                                    }
                                    for (uint32_t c = 0; c < K; c++) {
                                        ref += W[(size_t)n * K + c] * xr[c];
                                        ab += fabs(W[(size_t)n * K + c] * xr[c]);
                                    }
                                    double bound = qb * (1 + 1e-6) + 1e-5 * ab + 1e-30;
                                    double err = fabs(y[(size_t)r * N + n] - ref);
                                    ck_assert_msg(err <= bound,
                                                  "%s bits %d bs %u asym %d K %u nx %u row %u "
                                                  "input %u: |err| %.3g > bound %.3g",
                                                  k->name, bits, s.block_size, asym, K, nx, n, r,
                                                  err, bound);
                                    if (err / bound > worst)
                                        worst = err / bound;
                                }
                        }
                    }
                    for (size_t ni = 0; ni < sizeof NX / sizeof NX[0]; ni++)
                        free(simd_y[ni]);
                    free(x);
                    free(xq);
                    free(y);
                    free(scratch);
                    tl_layer_free(&L);
                    cases++;
                }
    fprintf(stderr, "fast kernels: %d weight variants; worst error / bound %.3f; runs:", cases,
            worst);
    for (int ki = 0; ki < N_I8; ki++)
        fprintf(stderr, " %s %d", I8[ki], ran[ki]);
    fprintf(stderr, "\n");
}
END_TEST

static qm_backend *backend(const char *kernel, unsigned threads)
{
    qm_backend *be = NULL;
    qm_status st = {0};
    setenv("QMOE_KERNEL", kernel, 1);
    ck_assert_msg(qm_backend_cpu_new(threads, &be, &st) == 0, "%s", st.msg);
    unsetenv("QMOE_KERNEL");
    return be;
}

static void forward(qm_backend *be, tl_layer *L, uint32_t T, const float *x, const float *lg,
                    float *out, qm_precision p)
{
    qm_expert_source src;
    tl_source(L, &src);
    qm_moe_call call = {.layer = 0, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T,
                        .logits = lg, .output = out, .precision = p};
    qm_status st = {0};
    ck_assert_msg(qm__moe_forward_layer(be, &L->cfg, &L->lv, &call, &src, NULL, NULL, &st) == 0, "%s",
                  st.msg);
}

/* A whole swiglu layer in fast mode: within 2% (relative L2) of the float64
 * reference on every fast kernel (the per-matmul bound above, through the
 * activation; measured here at about 0.3-0.5%), bitwise identical for 1 and
 * 3 threads; blocks of 16 run exact. */
START_TEST(test_fast_layer_close_and_thread_independent)
{
    static const uint32_t BS[] = {32, 64, 0, 16};
    i8_names();
    for (int bits = 4; bits <= 8; bits += 4)
        for (int bi = 0; bi < 4; bi++) {
            tl_spec s = tl_default_spec(4242 + (uint64_t)(bits * 10 + bi));
            s.H = 192;
            s.I = 96;
            s.E = 8;
            s.k = 2;
            s.bits = (uint32_t)bits;
            s.block_size = BS[bi];
            s.asym = bi == 1;
            s.act = QM_ACT_SWIGLU;
            s.fusion = 1;
            tl_layer L;
            ck_assert_int_eq(tl_layer_build(&s, &L), 0);
            for (uint32_t T = 1; T <= 41; T += 40) {
                float *x = malloc(sizeof(float) * T * s.H), *lg = malloc(sizeof(float) * T * s.E);
                float *o1 = malloc(sizeof(float) * T * s.H), *o3 = malloc(sizeof(float) * T * s.H);
                float *oe = malloc(sizeof(float) * T * s.H);
                double *ref = malloc(sizeof(double) * T * s.H);
                tl_random_inputs(31 + T, T, s.H, s.E, x, lg);
                tl_reference(&L, x, lg, T, ref);
                for (int ki = 0; ki < N_I8; ki++) {
                    if (!i8_kernel(I8[ki]))
                        continue;
                    qm_backend *b1 = backend(I8[ki], 1), *b3 = backend(I8[ki], 3);
                    forward(b1, &L, T, x, lg, o1, QM_PRECISION_FAST);
                    forward(b3, &L, T, x, lg, o3, QM_PRECISION_FAST);
                    forward(b3, &L, T, x, lg, oe, QM_PRECISION_EXACT);
                    double err = tl_rel_err_f(o1, ref, (size_t)T * s.H);
                    double eerr = tl_rel_err_f(oe, ref, (size_t)T * s.H);
                    ck_assert_msg(memcmp(o1, o3, sizeof(float) * T * s.H) == 0,
                                  "%s bits %d bs %u T %u: 1 and 3 threads differ", I8[ki], bits,
                                  s.block_size, T);
                    ck_assert_msg(err <= 2e-2, "%s bits %d bs %u T %u: fast rel err %.3g",
                                  I8[ki], bits, s.block_size, T, err);
                    ck_assert_msg(eerr <= 1e-5, "%s bits %d bs %u T %u: exact rel err %.3g",
                                  I8[ki], bits, s.block_size, T, eerr);
                    if (s.block_size == 16) /* runs exact */
                        ck_assert_msg(err <= 1e-5, "bs 16 should run exact: %.3g", err);
                    else
                        ck_assert_msg(err > 1e-7, "fast mode did not run (err %.3g)", err);
                    qm_backend_free(b1);
                    qm_backend_free(b3);
                }
                free(x);
                free(lg);
                free(o1);
                free(o3);
                free(oe);
                free(ref);
            }
            tl_layer_free(&L);
        }
}
END_TEST

/* A 4-bit code-book layer (e2m1) computes as the int8 layer of the same
 * weights, bit for bit, in both precisions, on every kernel this CPU runs,
 * for GEMV and GEMM row counts and 1 and 3 threads (qm_codebook.c decodes
 * its tiles into those 8-bit codes); within the bounds above of the
 * float64 reference; and the decoder's SIMD bytes are the C ones. */
START_TEST(test_codebook_layer_is_its_int8_layer)
{
    /* Blocks of 32 and K % 64 == 0 (case 0; case 3 in r8): the fast
     * kernels read 4 bits (a row tile laid out in r8 in the scratch first
     * in case 0); exact precision and the other cases, 8-bit tiles. */
    static const uint32_t BS[] = {32, 64, 0, 32}, IS[] = {128, 96, 160, 128};
    static const uint32_t TS[] = {1, 3, 9, 41};
    i8_names();
    for (int bi = 0; bi < 4; bi++) {
        tl_spec s = tl_default_spec(777 + (uint64_t)bi);
        s.H = 192;
        s.I = IS[bi];
        s.E = 8;
        s.k = 2;
        s.bits = 4;
        s.block_size = BS[bi];
        s.codebook = QM_CODEBOOK_E2M1;
        s.act = QM_ACT_SWIGLU;
        s.fusion = 1;
        s.scale_dtype = bi == 1 ? QM_DTYPE_F16 : QM_DTYPE_F32;
        tl_spec s8 = s;
        s8.bits = 8;
        tl_layer L, L8;
        ck_assert_int_eq(tl_layer_build(&s, &L), 0);
        ck_assert_int_eq(tl_layer_build(&s8, &L8), 0);
        ck_assert(L.cfg.codebook == QM_CODEBOOK_E2M1 && L8.cfg.codebook == QM_CODEBOOK_NONE);
        ck_assert(memcmp(L.deq[1], L8.deq[1], sizeof(double) * s.E * s.H * s.I) == 0);

        /* The decoder: SIMD bytes against the C ones, and the int8 codes. */
        qm__qmat m;
        fc1_qmat(&L, 3, &m);
        m.cb = qm_codebook_values(QM_CODEBOOK_E2M1);
        uint8_t *a = malloc((size_t)m.n * m.k), *c = malloc((size_t)m.n * m.k);
        qm__cb_rows(&m, 0, m.n, a);
        qm__cb_rows_c(&m, 0, m.n, c);
        ck_assert(memcmp(a, c, (size_t)m.n * m.k) == 0);
        qm__qmat m8;
        fc1_qmat(&L8, 3, &m8);
        ck_assert(memcmp(a, m8.w, (size_t)m.n * m.k) == 0);
        free(a);
        free(c);
        if (bi == 3)
            tl_layer_r8(&L);

        for (size_t ti = 0; ti < sizeof TS / sizeof TS[0]; ti++) {
            uint32_t T = TS[ti];
            size_t no = (size_t)T * s.H;
            float *x = malloc(sizeof(float) * T * s.H), *lg = malloc(sizeof(float) * T * s.E);
            float *o[4], *o8[2];
            for (int i = 0; i < 4; i++)
                o[i] = malloc(sizeof(float) * no);
            for (int i = 0; i < 2; i++)
                o8[i] = malloc(sizeof(float) * no);
            double *ref = malloc(sizeof(double) * no);
            tl_random_inputs(55 + T, T, s.H, s.E, x, lg);
            tl_reference(&L, x, lg, T, ref);
            for (int ki = 0; ki < N_I8; ki++) {
                if (!i8_kernel(I8[ki]))
                    continue;
                qm_backend *b1 = backend(I8[ki], 1), *b3 = backend(I8[ki], 3);
                forward(b1, &L, T, x, lg, o[0], QM_PRECISION_FAST);
                forward(b3, &L, T, x, lg, o[1], QM_PRECISION_FAST);
                forward(b1, &L, T, x, lg, o[2], QM_PRECISION_EXACT);
                forward(b3, &L, T, x, lg, o[3], QM_PRECISION_EXACT);
                forward(b3, &L8, T, x, lg, o8[0], QM_PRECISION_FAST);
                forward(b3, &L8, T, x, lg, o8[1], QM_PRECISION_EXACT);
                const char *what[] = {"fast, 1 thread", "fast, 3 threads", "exact, 1 thread",
                                      "exact, 3 threads"};
                for (int i = 0; i < 4; i++)
                    ck_assert_msg(memcmp(o[i], o8[i / 2], sizeof(float) * no) == 0,
                                  "%s bs %u T %u %s: the code-book layer is not its int8 layer",
                                  I8[ki], s.block_size, T, what[i]);
                double err = tl_rel_err_f(o[0], ref, no), eerr = tl_rel_err_f(o[2], ref, no);
                ck_assert_msg(err <= 2e-2 && err > 1e-7, "%s bs %u T %u: fast rel err %.3g",
                              I8[ki], s.block_size, T, err);
                ck_assert_msg(eerr <= 1e-5, "%s bs %u T %u: exact rel err %.3g", I8[ki],
                              s.block_size, T, eerr);
                qm_backend_free(b1);
                qm_backend_free(b3);
            }
            free(x);
            free(lg);
            for (int i = 0; i < 4; i++)
                free(o[i]);
            for (int i = 0; i < 2; i++)
                free(o8[i]);
            free(ref);
        }
        tl_layer_free(&L);
        tl_layer_free(&L8);
    }
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("engine_fast");
    TCase *tc = tcase_create("fast");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_fast_kernels_within_derived_bound);
    tcase_add_test(tc, test_fast_layer_close_and_thread_independent);
    tcase_add_test(tc, test_codebook_layer_is_its_int8_layer);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
