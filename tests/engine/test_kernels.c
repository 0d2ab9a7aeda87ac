/* test_kernels.c - the kernels' choice (qm_kernel_select.c) and the
 * fast-mode kernels' bits.
 *
 * Exact mode:
 *  - Every SIMD kernel pair of a class gives the same bits (4-bit and 8-bit
 *    GEMV; GEMM 4/8-bit) on random shapes with tails: K not a multiple of
 *    the block or of 16/32, odd N, T = 1..4 (GEMV) and larger (GEMM),
 *    f32/f16 scales, with and without zero points.
 *  - Every 4-bit GEMV kernel, the scalar one included wherever the
 *    canonical order applies (qm__q4_canon), gives the same bits; the
 *    folded AVX2 4-bit GEMV (CPUs without AVX-512) is within the bound of
 *    a float64 reference, and the choice takes it when AVX-512 is hidden.
 *  - The calibration takes the fastest kernel per class, a narrower one
 *    only by a margin, when fed fake timings (an injected timer).
 *  - A corrupt or foreign cache file is ignored; a valid one is used.
 * Fast mode (qm_kernel_i8.h's canonical order):
 *  - Every fast kernel this CPU runs, each one's GEMV and GEMM path at every
 *    input count, and the models of the ones it cannot run (their own
 *    blocking and packing with vpdpbusd and the AMX tiles in C), give the
 *    scalar specification's bits on random shapes: every block size,
 *    row-wise, K and N tails, f32/f16/bf16 scales, zero points or not,
 *    1..70 inputs; and an input's outputs in a GEMM call are its bits
 *    alone (the GEMV's).
 *  - The vector packers and row parameters are the C ones byte for byte.
 *  - AMX with the tile permission refused (a hook) is not offered, and
 *    QMOE_KERNEL=amx falls back.
 * Kernels this CPU cannot run are named on stderr, with the reason, and
 * skipped (their models still run). */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_kernel_check.h"
#include "qm_kernel_i8.h"
#include "qm_kernel_isa.h"
#include "qm_kernels.h"
#include "qm_r8.h"
#if defined(QMOE_I8_MODELS)
#include "qm_kernel_i8_model.h"
#endif

/* The kernel QMOE_KERNEL=value selects, or NULL (said once) when it is not
 * the one named `want` (this CPU cannot run it). */
static const qm__kernel *kernel_as(const char *value, const char *want)
{
    static int said_avx2, said_avx512;
    setenv("QMOE_KERNEL", value, 1);
    const qm__kernel *k = qm__kernel_select();
    unsetenv("QMOE_KERNEL");
    if (strcmp(k->name, want) == 0) return k;
    int *said = strncmp(want, "avx2", 4) == 0 ? &said_avx2 : &said_avx512;
    if (!*said)
        fprintf(stderr, "kernel %s: this CPU cannot run it; its tests are skipped here\n", value);
    *said = 1;
    return NULL;
}

/* The canonical-order AVX2 kernel (AVX-512's co-candidate) is "avx2". */
static const qm__kernel *kernel(const char *name)
{
    return strcmp(name, "avx2") == 0 ? kernel_as("avx2-canonical", "avx2") : kernel_as(name, name);
}

static uint32_t rng = 2463534242u;
static uint32_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    return rng;
}

/* y = W x for nx rows with kernel k (its own preparation), gemm or gemv path. */
static void run(const qm__kernel *k, const qm__qmat *m, int gemm, const float *x, uint32_t nx,
                float *y)
{
    size_t ld = (k->x_stride(m, gemm) + 15) & ~(size_t)15;
    uint32_t rows = (nx + 11) / 12 * 12 + 12;
    float *xp = qm_calloc(ld * rows + qm__kernel_scratch_floats(m), sizeof(float));
    ck_assert_ptr_nonnull(xp);
    float *scratch = xp + ld * rows;
    for (uint32_t r = 0; r < nx; r++)
        k->prep(m, gemm, x + (size_t)r * m->k, xp + r * ld);
    for (uint32_t n0 = 0; n0 < m->n; n0 += QM__TILE_ROWS) {
        uint32_t n1 = n0 + QM__TILE_ROWS < m->n ? n0 + QM__TILE_ROWS : m->n;
        (gemm ? k->gemm : k->gemv)(m, n0, n1, xp, ld, nx, y, m->n, scratch);
    }
    qm_free(xp);
}

/* A random quantised matrix and its buffers. */
typedef struct rand_mat {
    qm__qmat m;
    uint8_t *w, *zp;
    uint16_t *s16;
    float *s32;
} rand_mat;

/* bits, block (0: row-wise), k, n; rows 0-2 bytes longer than their codes,
 * f16 or f32 scales, zero points or not, all at random. */
static void rand_mat_new(rand_mat *r, uint32_t bits, uint32_t block, uint32_t k, uint32_t n)
{
    uint32_t nblk = block ? (k + block - 1) / block : 1;
    size_t rb = ((size_t)k * bits + 7) / 8 + next() % 3;
    int f16 = next() % 2, asym = next() % 2;
    size_t zprb = (nblk * bits + 7) / 8;
    r->w = malloc((size_t)n * rb);
    r->s16 = malloc(2 * (size_t)n * nblk);
    r->s32 = malloc(4 * (size_t)n * nblk);
    r->zp = malloc((size_t)n * zprb);
    ck_assert(r->w && r->s16 && r->s32 && r->zp);
    for (size_t i = 0; i < (size_t)n * rb; i++)
        r->w[i] = (uint8_t)next();
    for (size_t i = 0; i < (size_t)n * zprb; i++)
        r->zp[i] = (uint8_t)next();
    for (size_t i = 0; i < (size_t)n * nblk; i++) {
        r->s32[i] = (float)(1 + next() % 1000) * 1e-4f;
        r->s16[i] = (uint16_t)(0x1000 + next() % 0x2000); /* positive normal f16 */
    }
    r->m = (qm__qmat){.w = r->w,
                      .row_bytes = rb,
                      .scales = f16 ? (void *)r->s16 : (void *)r->s32,
                      .scale_dtype = f16 ? QM_DTYPE_F16 : QM_DTYPE_F32,
                      .zp = asym ? r->zp : NULL,
                      .zp_blockwise = 1,
                      .zp_row_bytes = zprb,
                      .n = n,
                      .k = k,
                      .bits = bits,
                      .nblk = nblk,
                      .block = block ? block : k};
}

static void rand_mat_free(rand_mat *r)
{
    free(r->w), free(r->s16), free(r->s32), free(r->zp);
}

/* T random input rows of k columns. */
static float *rand_inputs(uint32_t T, uint32_t k)
{
    float *x = malloc(4 * (size_t)T * k);
    ck_assert_ptr_nonnull(x);
    for (size_t i = 0; i < (size_t)T * k; i++)
        x[i] = ((float)(next() % 20001) - 10000.0f) * 1e-3f;
    return x;
}

/* A random k for blocks of `block` columns (0: row-wise): often not a
 * multiple of the block, of 16 or of 32. */
static uint32_t rand_k(uint32_t block)
{
    uint32_t k =
        block ? block * (1 + next() % 6) - (next() % 2 ? 0 : next() % block) : 1 + next() % 700;
    return k < 2 ? 2 : k;
}

START_TEST(test_measured_classes_same_bits)
{
    const qm__kernel *a = kernel("avx2"), *b = kernel("avx512");
    if (!a || !b) return;
    static const uint32_t BLOCKS[] = {0, 16, 32, 64, 128};
    static const uint32_t TS[] = {1, 2, 3, 4, 5, 7, 12, 13, 25};
    int checked = 0;
    for (int it = 0; it < 160; it++) {
        uint32_t bits = it & 1 ? 8 : 4;
        uint32_t T = TS[(it / 2) % 9];
        int gemm = T > QM__GEMV_MAX_ROWS;
        uint32_t block = BLOCKS[next() % 5];
        uint32_t k = rand_k(block), n = 1 + next() % 41;
        rand_mat r;
        rand_mat_new(&r, bits, block, k, n);
        float *x = rand_inputs(T, k), *ya = malloc(4 * (size_t)T * n),
              *yb = malloc(4 * (size_t)T * n);
        run(a, &r.m, gemm, x, T, ya);
        run(b, &r.m, gemm, x, T, yb);
        ck_assert_msg(memcmp(ya, yb, 4 * (size_t)T * n) == 0,
                      "%s %u-bit n %u k %u block %u T %u f16 %d zp %d: avx2 and avx512 differ",
                      gemm ? "gemm" : "gemv", bits, n, k, block, T,
                      r.m.scale_dtype == QM_DTYPE_F16, r.m.zp != NULL);
        checked++;
        rand_mat_free(&r);
        free(x), free(ya), free(yb);
    }
    ck_assert_int_gt(checked, 150);
}
END_TEST

/* Case `it` of the 4-bit GEMV tests: blocks 16/32/64/128 and row-wise in
 * turn, odd and even N (one 16-row tile or several, a short last one),
 * 1..4 inputs; two output buffers. */
typedef struct q4_case {
    rand_mat r;
    uint32_t block, T, n, k;
    float *x, *y0, *y1;
} q4_case;

static void q4_case_new(q4_case *c, int it)
{
    static const uint32_t BLOCKS[] = {0, 16, 32, 64, 128};
    c->block = BLOCKS[it % 5];
    c->T = 1 + (it / 5) % 4;
    c->k = rand_k(c->block);
    c->n = 1 + next() % 53;
    rand_mat_new(&c->r, 4, c->block, c->k, c->n);
    c->x = rand_inputs(c->T, c->k);
    c->y0 = malloc(4 * (size_t)c->T * c->n);
    c->y1 = malloc(4 * (size_t)c->T * c->n);
    ck_assert(c->y0 && c->y1);
}

static void q4_case_free(q4_case *c)
{
    rand_mat_free(&c->r);
    free(c->x), free(c->y0), free(c->y1);
}

/* Every 4-bit GEMV kernel of this CPU against the first one that ran: the
 * scalar kernel wherever the canonical order applies (blocks of 16: the
 * SIMD kernels only), AVX2, AVX-512; 200 q4_case shapes. */
START_TEST(test_q4_gemv_same_bits_every_kernel)
{
    const qm__kernel *ks[3] = {&qm__kernel_scalar, kernel("avx2"), kernel("avx512")};
    if (!ks[1] && !ks[2]) {
        fprintf(stderr, "q4 gemv: no SIMD kernel on this CPU, nothing to compare\n");
        return;
    }
    int compared = 0, with_scalar = 0;
    for (int it = 0; it < 200; it++) {
        q4_case c;
        q4_case_new(&c, it);
        const char *ref_name = NULL;
        for (int i = 0; i < 3; i++) {
            if (!ks[i] || (i == 0 && !qm__q4_canon(&c.r.m, 0)))
                continue;
            run(ks[i], &c.r.m, 0, c.x, c.T, ref_name ? c.y1 : c.y0);
            if (!ref_name) {
                ref_name = ks[i]->name;
                continue;
            }
            ck_assert_msg(memcmp(c.y0, c.y1, 4 * (size_t)c.T * c.n) == 0,
                          "n %u k %u block %u T %u f16 %d zp %d: %s and %s differ", c.n, c.k,
                          c.block, c.T, c.r.m.scale_dtype == QM_DTYPE_F16, c.r.m.zp != NULL,
                          ref_name, ks[i]->name);
            compared++;
            with_scalar += ref_name == ks[0]->name;
        }
        q4_case_free(&c);
    }
    ck_assert_int_gt(compared, 150);
    ck_assert_int_gt(with_scalar, 100);
}
END_TEST

/* The folded AVX2 4-bit GEMV (the default of CPUs without AVX-512) against
 * a float64 reference, per output: |y - ref| <= 1e-5 * sum_c |W[n,c] x[c]|
 * (the exact mode's 1e-5 relative, docs/ARCHITECTURE.md); and against the
 * canonical AVX2 kernel: the same bits where it runs the same code (blocks
 * of 16; 2-4 input rows), other bits at 1 row. 200 q4_case shapes. */
START_TEST(test_q4_gemv_folded_within_bound)
{
    const qm__kernel *f = kernel_as("avx2-folded", "avx2-folded"), *can = kernel("avx2");
    if (!f || !can) return;
    double worst = 0;
    int differ = 0;
    for (int it = 0; it < 200; it++) {
        q4_case c;
        q4_case_new(&c, it);
        const qm__qmat *m = &c.r.m;
        run(f, m, 0, c.x, c.T, c.y0);
        run(can, m, 0, c.x, c.T, c.y1);
        size_t ny = (size_t)c.T * c.n;
        if (!qm__q4_canon(m, 0) || c.T > 1)
            ck_assert_msg(memcmp(c.y0, c.y1, 4 * ny) == 0,
                          "n %u k %u block %u T %u: folded and canonical differ", c.n, c.k,
                          c.block, c.T);
        else
            differ += memcmp(c.y0, c.y1, 4 * ny) != 0;
        for (uint32_t t = 0; t < c.T; t++)
            for (uint32_t row = 0; row < c.n; row++) {
                const uint8_t *wr = m->w + (size_t)row * m->row_bytes;
                const float *xr = c.x + (size_t)t * c.k;
                double ref = 0, ab = 0;
                for (uint32_t col = 0; col < c.k; col++) {
                    uint32_t b = col / m->block;
                    int q = (wr[col / 2] >> (4 * (col & 1))) & 15;
                    double w = (double)qm__qmat_scale(m, row, b) * (q - qm__qmat_zp(m, row, b));
                    ref += w * xr[col];
                    ab += fabs(w * xr[col]);
                }
                double err = fabs(c.y0[(size_t)t * c.n + row] - ref), bound = 1e-5 * ab + 1e-30;
                ck_assert_msg(err <= bound, "n %u k %u block %u T %u row %u: err %.3g > %.3g", c.n,
                              c.k, c.block, c.T, row, err, bound);
                worst = err / bound > worst ? err / bound : worst;
            }
        q4_case_free(&c);
    }
    ck_assert_int_gt(differ, 30); /* of 40 1-row cases: the two orders really are two */
    fprintf(stderr, "q4 gemv folded: worst error %.3g of the bound\n", worst);
}
END_TEST

/* Without AVX-512 the AVX2 kernel is the only candidate: the default's
 * 4-bit GEMV is the folded one, QMOE_KERNEL=avx2 names it, avx512 falls
 * back to the default; with AVX-512 back, the canonical one again. */
START_TEST(test_no_avx512_takes_folded)
{
    if (!kernel("avx2")) return;
    unsetenv("QMOE_KERNEL_CACHE");
    qm__kernel_hide_avx512(1);
    const char *d = qm__kernel_recalibrate();
    ck_assert_msg(strstr(d, "gemv avx2-folded/avx2, gemm avx2/avx2"), "%s", d);
    const qm__kernel *a = kernel_as("avx2", "avx2-folded");
    ck_assert_ptr_nonnull(a);
    ck_assert_ptr_eq(a, kernel_as("avx2-folded", "avx2-folded"));
    setenv("QMOE_KERNEL", "avx512", 1);
    ck_assert_str_ne(qm__kernel_select()->name, "avx512");
    unsetenv("QMOE_KERNEL");
    qm__kernel_hide_avx512(0);
    d = qm__kernel_recalibrate();
    if (kernel("avx512")) {
        ck_assert_msg(!strstr(d, "avx2-folded"), "%s", d);
        ck_assert_ptr_nonnull(kernel_as("avx2", "avx2"));
    }
}
END_TEST

/* Case `it` of the GEMM tests: 4- and 8-bit in turn, T from TS (14
 * entries), blocks 16..128 and row-wise in turn every bdiv cases, a K that
 * often ends in a partial block (and is rarely a multiple of 16 or of the
 * 256-column tile), N 1..50 (short last panels); the matrix into r. */
static void gemm_case_new(int it, const uint32_t TS[14], int bdiv, rand_mat *r, uint32_t *T,
                          uint32_t *block)
{
    static const uint32_t BLOCKS[] = {0, 16, 32, 64, 128};
    *T = TS[(it / 2) % 14];
    *block = BLOCKS[(it / bdiv) % 5];
    uint32_t k = 17 + next() % 800;
    if (*block && next() % 2)
        k = *block * (1 + next() % (900 / *block)) - 1; /* a partial last block */
    uint32_t n = 1 + next() % 50;
    rand_mat_new(r, it & 1 ? 8 : 4, *block, k, n);
}

/* The GEMM class (jobs of more than 4 rows): the AVX-512 packed GEMM
 * (qm_gemm_packed_avx512.c) and the AVX2 GEMM give the same bits on
 * shapes that leave every tail: N not a multiple of the 16-row panel, K
 * not a multiple of the 256-column tile, of 16 or of the block; blocks
 * 16..128 and row-wise; 4/8-bit; f32/f16 scales; zero points or not; row
 * counts that make every register block size (1..12 rows per group). The
 * shared result is within the derived bound of the float64 sum:
 * |y - ref| <= (k + 4) * 2^-24 * sum |w x| (w rounded once, k FMAs and one
 * add per tile). And a row's output does not depend on the other rows of
 * the call: the last s rows alone give the same bits. */
START_TEST(test_gemm_packed_same_bits_tails_and_reference)
{
    const qm__kernel *a = kernel("avx2"), *b = kernel("avx512");
    if (!a || !b) return;
    static const uint32_t TS[] = {5, 6, 7, 8, 13, 14, 15, 16, 27, 28, 29, 43, 64, 71};
    for (int it = 0; it < 70; it++) {
        rand_mat r;
        uint32_t T, block;
        gemm_case_new(it, TS, 2, &r, &T, &block);
        uint32_t bits = r.m.bits, k = r.m.k, n = r.m.n;
        int f16 = r.m.scale_dtype == QM_DTYPE_F16, asym = r.m.zp != NULL;
        float *x = rand_inputs(T, k), *ya = malloc(4 * (size_t)T * n),
              *yb = malloc(4 * (size_t)T * n), *ys = malloc(4 * (size_t)T * n);
        run(a, &r.m, 1, x, T, ya);
        run(b, &r.m, 1, x, T, yb);
        ck_assert_msg(memcmp(ya, yb, 4 * (size_t)T * n) == 0,
                      "%u-bit n %u k %u block %u T %u f16 %d zp %d: avx2 and avx512 GEMMs differ",
                      bits, n, k, block, T, f16, asym);
        for (uint32_t t = 0; t < T; t++) {
            for (uint32_t o = 0; o < n; o++) {
                const uint8_t *row = r.m.w + (size_t)o * r.m.row_bytes;
                double ref = 0.0, mag = 0.0;
                for (uint32_t c = 0; c < k; c++) {
                    uint32_t bb = c / r.m.block;
                    double w = (double)qm__qmat_scale(&r.m, o, bb) *
                               (qm__qmat_code(&r.m, row, c) - qm__qmat_zp(&r.m, o, bb));
                    ref += w * x[(size_t)t * k + c];
                    mag += fabs(w * x[(size_t)t * k + c]);
                }
                double err = fabs(ya[(size_t)t * n + o] - ref);
                ck_assert_msg(err <= (k + 4) * ldexp(mag, -24),
                              "%u-bit n %u k %u block %u T %u: row %u out %u err %g of %g", bits,
                              n, k, block, T, t, o, err, mag);
            }
        }
        uint32_t s = 5 + next() % (T - 4); /* 5..T rows: still the GEMM path */
        run(b, &r.m, 1, x + (size_t)(T - s) * k, s, ys);
        ck_assert_msg(memcmp(ys, yb + (size_t)(T - s) * n, 4 * (size_t)s * n) == 0,
                      "%u-bit n %u k %u T %u: the last %u rows alone differ", bits, n, k, T, s);
        rand_mat_free(&r);
        free(x), free(ya), free(yb), free(ys);
    }
}
END_TEST

/* The GEMM class's order in plain C (qm_kernel_avx2.c): per tile of
 * QM__GEMM_KT prepared columns (4-bit: every 16 columns as [8 even, 8 odd]),
 * each output sums fmaf(w, x, acc) over the tile's columns in that order
 * from zero, w = (float)(q - zp) * scale rounded once (codes past the
 * row's bytes 0, x past k 0), and the tile's sum is stored to the output
 * (first tile) or added to it. */
static void gemm_model(const qm__qmat *m, const float *x, uint32_t nx, float *y)
{
    const uint32_t kp = (m->k + 15) & ~15u, pack = 8 / m->bits;
    for (uint32_t t = 0; t < nx; t++)
        for (uint32_t o = 0; o < m->n; o++) {
            const uint8_t *row = m->w + (size_t)o * m->row_bytes;
            float out = 0.0f;
            for (uint32_t kt0 = 0; kt0 < kp; kt0 += QM__GEMM_KT) {
                uint32_t kt1 = kt0 + QM__GEMM_KT < kp ? kt0 + QM__GEMM_KT : kp;
                float acc = 0.0f;
                for (uint32_t p = kt0; p < kt1; p++) {
                    uint32_t g = p & ~15u, j = p & 15u;
                    uint32_t c = m->bits == 4 ? g + (j < 8 ? 2 * j : 2 * (j - 8) + 1) : p;
                    uint32_t b = m->nblk == 1 ? 0 : c / m->block;
                    int q = c / pack < m->row_bytes ? qm__qmat_code(m, row, c) : 0;
                    float w = (float)(q - qm__qmat_zp(m, o, b)) * qm__qmat_scale(m, o, b);
                    acc = fmaf(w, c < m->k ? x[(size_t)t * m->k + c] : 0.0f, acc);
                }
                out = kt0 == 0 ? acc : out + acc;
            }
            y[(size_t)t * m->n + o] = out;
        }
}

/* Each kernel of ks (NULL: skipped) on rand_mat r with T random inputs
 * against gemm_model, bit for bit; counts the comparisons; frees r. */
static void gemm_vs_model(const qm__kernel *const ks[2], rand_mat *r, uint32_t T, int *compared)
{
    uint32_t n = r->m.n, k = r->m.k;
    float *x = rand_inputs(T, k), *ym = malloc(4 * (size_t)T * n), *yk = malloc(4 * (size_t)T * n);
    ck_assert(ym && yk);
    gemm_model(&r->m, x, T, ym);
    for (int i = 0; i < 2; i++) {
        if (!ks[i])
            continue;
        run(ks[i], &r->m, 1, x, T, yk);
        ck_assert_msg(memcmp(ym, yk, 4 * (size_t)T * n) == 0,
                      "%s gemm %u-bit n %u k %u block %u nblk %u T %u f16 %d zp %d: not the "
                      "model's bits",
                      ks[i]->name, r->m.bits, n, k, r->m.block, r->m.nblk, T,
                      r->m.scale_dtype == QM_DTYPE_F16, r->m.zp != NULL);
        (*compared)++;
    }
    rand_mat_free(r);
    free(x), free(ym), free(yk);
}

/* Every SIMD GEMM this CPU runs (AVX2; the AVX-512 packed one) gives the C
 * model's bits, and so each other's, on shapes that leave every tail (N
 * not a multiple of the 16-row panel, K not one of the 256-column tile, of
 * 16 or of the block; blocks 16..128 and row-wise; 4/8-bit; f32/f16
 * scales; zero points or not) at row counts that make every register
 * block size of either kernel. */
START_TEST(test_gemm_every_kernel_model_bits)
{
    const qm__kernel *ks[2] = {kernel("avx2"), kernel("avx512")};
    if (!ks[0] && !ks[1]) {
        fprintf(stderr, "gemm: no SIMD kernel on this CPU, nothing to compare\n");
        return;
    }
    static const uint32_t TS[] = {5, 6, 7, 8, 9, 11, 12, 13, 17, 19, 24, 25, 37, 71};
    int compared = 0;
    for (int it = 0; it < 140; it++) {
        rand_mat r;
        uint32_t T, block;
        gemm_case_new(it, TS, 3, &r, &T, &block);
        gemm_vs_model(ks, &r, T, &compared);
    }
    /* Short rows: K of 2..40 (one or a few 16-column chunks, row-wise or
     * blocks of 16/32), N of one panel or less. */
    for (int it = 0; it < 40; it++) {
        static const uint32_t SB[] = {0, 16, 32};
        uint32_t k = 2 + next() % 39, n = 1 + next() % 20;
        rand_mat r;
        rand_mat_new(&r, it & 1 ? 8 : 4, SB[it % 3], k, n);
        gemm_vs_model(ks, &r, 5 + it % 9, &compared);
    }
    ck_assert_int_ge(compared, 180);
}
END_TEST

/* Fake timings: avx512 takes fake_wide us, avx2 fake_narrow, or on the
 * 4-bit GEMV fake_q4_gemv_narrow where that is set (> 0). */
static double fake_wide, fake_narrow, fake_q4_gemv_narrow;
static double fake_timer(const qm__kernel *k, const qm__qmat *m, int gemm, const float *x)
{
    (void)x;
    if (strcmp(k->name, "avx512") == 0)
        return fake_wide;
    return fake_q4_gemv_narrow > 0 && m->bits == 4 && !gemm ? fake_q4_gemv_narrow : fake_narrow;
}

START_TEST(test_pick_with_margin)
{
    double t1[] = {100.0, 95.0};
    ck_assert_int_eq(qm__kernel_pick(t1, 2), 0); /* 5% faster: not enough */
    double t2[] = {100.0, 80.0};
    ck_assert_int_eq(qm__kernel_pick(t2, 2), 1);
    double t3[] = {50.0, 80.0};
    ck_assert_int_eq(qm__kernel_pick(t3, 2), 0);
    double t4[] = {-1.0, 80.0}; /* the wide one could not run */
    ck_assert_int_eq(qm__kernel_pick(t4, 2), 1);
    double t5[] = {100.0, 95.0, 70.0};
    ck_assert_int_eq(qm__kernel_pick(t5, 3), 2);
}
END_TEST

START_TEST(test_calibration_takes_fastest)
{
    if (!kernel("avx2") || !kernel("avx512")) return;
    unsetenv("QMOE_KERNEL_CACHE");
    qm__kernel_set_timer(fake_timer);
    fake_wide = 50.0, fake_narrow = 100.0;
    const char *d = qm__kernel_recalibrate();
    ck_assert_msg(strstr(d, "gemv avx512/avx512, gemm avx512/avx512"), "%s", d);
    fake_wide = 100.0, fake_narrow = 50.0; /* every class measured, the 4-bit GEMV too */
    d = qm__kernel_recalibrate();
    ck_assert_msg(strstr(d, "gemv avx2/avx2, gemm avx2/avx2"), "%s", d);
    fake_wide = 100.0, fake_narrow = 95.0; /* within the margin: the wider stays */
    d = qm__kernel_recalibrate();
    ck_assert_msg(strstr(d, "gemv avx512/avx512, gemm avx512/avx512"), "%s", d);
    /* AVX2 faster on the 4-bit GEMV alone (the Zen 4): only that class moves */
    fake_wide = 100.0, fake_narrow = 120.0, fake_q4_gemv_narrow = 40.0;
    d = qm__kernel_recalibrate();
    ck_assert_msg(strstr(d, "gemv avx2/avx512, gemm avx512/avx512"), "%s", d);
    fake_q4_gemv_narrow = 0.0;
    qm__kernel_set_timer(NULL);
    qm__kernel_recalibrate();
}
END_TEST

START_TEST(test_cache)
{
    const qm__kernel *a = kernel("avx2"), *b = kernel("avx512");
    if (!a || !b) return;
    char path[] = "/tmp/qmoe-kcache-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    FILE *f = fdopen(fd, "w");
    fputs("garbage\x01\x02 not a cache\n", f);
    fclose(f);
    const qm__kernel *cands[2] = {b, a}, *out[4];
    ck_assert_int_eq(qm__kernel_cache_load(path, cands, 2, out), -1);
    setenv("QMOE_KERNEL_CACHE", path, 1);
    qm__kernel_set_timer(fake_timer);
    fake_wide = 100.0, fake_narrow = 50.0;
    const char *d = qm__kernel_recalibrate(); /* corrupt: measured, then written */
    ck_assert_msg(strstr(d, "measured:") && strstr(d, "gemv avx2/avx2, gemm avx2/avx2"), "%s",
                  d);
    ck_assert_int_eq(qm__kernel_cache_load(path, cands, 2, out), 0);
    ck_assert_ptr_eq(out[0], a);
    ck_assert_ptr_eq(out[2], a);
    fake_wide = 50.0, fake_narrow = 100.0; /* the cache wins over a new measurement */
    d = qm__kernel_recalibrate();
    ck_assert_msg(strstr(d, "(cached)") && strstr(d, "gemv avx2/avx2, gemm avx2/avx2"), "%s", d);
    /* another kernel set: ignored */
    const qm__kernel *other[1] = {a};
    ck_assert_int_eq(qm__kernel_cache_load(path, other, 1, out), -1);
    /* a cache naming an unknown kernel: ignored */
    f = fopen(path, "r+");
    char line[512];
    ck_assert_ptr_nonnull(fgets(line, sizeof line, f));
    char *bar = strrchr(line, '|');
    ck_assert_ptr_nonnull(bar);
    snprintf(bar, sizeof line - (size_t)(bar - line), "|avx2 avx2 nope avx2\n");
    rewind(f);
    fputs(line, f);
    fclose(f);
    ck_assert_int_eq(qm__kernel_cache_load(path, cands, 2, out), -1);
    unsetenv("QMOE_KERNEL_CACHE");
    qm__kernel_set_timer(NULL);
    qm__kernel_recalibrate();
    remove(path);
}
END_TEST


/* ---- fast mode ---- */

/* A random matrix for the fast kernels: bits, block (0: row-wise), k, n;
 * scales f32, f16 or bf16; zero points or not (blockwise, or packed along
 * rows for row-wise); rows 0-2 bytes longer than their codes. */
typedef struct fmat {
    qm__qmat m;
    uint8_t *w, *zp;
    void *sc;
} fmat;

static void fmat_new(fmat *f, uint32_t bits, uint32_t block, uint32_t k, uint32_t n)
{
    uint32_t nblk = block ? (k + block - 1) / block : 1;
    size_t rb = ((size_t)k * bits + 7) / 8 + next() % 3;
    int dt = next() % 3, asym = next() % 2, along_rows = nblk == 1 && next() % 2;
    size_t zprb = ((size_t)nblk * bits + 7) / 8, zpbytes = along_rows ? (n * bits + 7) / 8 : n * zprb;
    f->w = malloc((size_t)n * rb);
    f->zp = malloc(zpbytes + 1);
    f->sc = malloc(4 * (size_t)n * nblk);
    ck_assert(f->w && f->zp && f->sc);
    for (size_t i = 0; i < (size_t)n * rb; i++)
        f->w[i] = (uint8_t)next();
    for (size_t i = 0; i < zpbytes; i++)
        f->zp[i] = (uint8_t)next();
    for (size_t i = 0; i < (size_t)n * nblk; i++) {
        float v = (float)(1 + next() % 1000) * 1e-4f * (next() % 8 ? 1.0f : -1.0f);
        if (dt == 0) {
            ((float *)f->sc)[i] = v;
        } else if (dt == 1) {
            ((uint16_t *)f->sc)[i] = (uint16_t)(0x1000 + next() % 0x2000 + (next() % 8 ? 0 : 0x8000));
        } else {
            uint32_t u;
            memcpy(&u, &v, 4);
            ((uint16_t *)f->sc)[i] = (uint16_t)(u >> 16);
        }
    }
    static const qm_dtype DT[] = {QM_DTYPE_F32, QM_DTYPE_F16, QM_DTYPE_BF16};
    f->m = (qm__qmat){.w = f->w, .row_bytes = rb, .scales = f->sc, .scale_dtype = DT[dt],
                      .zp = asym ? f->zp : NULL, .zp_blockwise = !along_rows,
                      .zp_row_bytes = along_rows ? 0 : zprb, .n = n, .k = k, .bits = bits,
                      .nblk = nblk, .block = block ? block : k};
}

static void fmat_free(fmat *f)
{
    free(f->w), free(f->zp), free(f->sc);
}

/* Why fast row `name` cannot serve here (not built, CPU features, or
 * refused by the self-check). */
static void fast_why(const char *name, char *why, size_t cap)
{
    int i = qm__i8isa_find(name);
    snprintf(why, cap, "the self-check refused it");
    if (i < 0)
        snprintf(why, cap, "no such row");
    else if (qm__i8isa_at((size_t)i)->not_built)
        snprintf(why, cap, "%s", qm__i8isa_at((size_t)i)->not_built);
    else
        qm__cpu_needs(qm__i8isa_at((size_t)i)->needs, why, cap);
}

/* The fast kernel QMOE_KERNEL=name selects, or NULL with the reason said
 * once when this CPU cannot run it. */
static const qm__i8kernel *fast_kernel(const char *name)
{
    static char said[16][16];
    setenv("QMOE_KERNEL", name, 1);
    const qm__i8kernel *k = qm__i8kernel_select();
    unsetenv("QMOE_KERNEL");
    if (strcmp(k->name, name) == 0)
        return k;
    for (int i = 0; i < 16; i++) {
        if (strcmp(said[i], name) == 0)
            break;
        if (!said[i][0]) {
            snprintf(said[i], sizeof said[i], "%s", name);
            char why[160];
            fast_why(name, why, sizeof why);
            int row = qm__i8isa_find(name);
            fprintf(stderr, "fast kernel %s: this CPU cannot run it (%s); skipped here%s\n", name,
                    why, row >= 0 && qm__i8isa_at((size_t)row)->model ? ", its model runs" : "");
            break;
        }
    }
    return NULL;
}

/* y = W x for nx prepared rows, the calls split in 16-row tiles as the
 * backend splits them. */
static void fast_run(void (*mm)(const qm__qmat *, uint32_t, uint32_t, const float *, size_t,
                                uint32_t, float *, size_t, float *),
                     const qm__qmat *m, const float *xq, size_t ld, uint32_t nx, float *y,
                     float *scratch)
{
    for (uint32_t n0 = 0; n0 < m->n; n0 += QM__TILE_ROWS)
        mm(m, n0, n0 + QM__TILE_ROWS < m->n ? n0 + QM__TILE_ROWS : m->n, xq, ld, nx, y, m->n,
           scratch);
}

typedef struct fast_cand {
    char name[48];
    qm__mm_fn *mm;
    int reads_r8, reads_r8_q8;
} fast_cand;

/* A row's three entries (as it serves, its GEMV and GEMM paths at every
 * input count) as candidates, under its name. */
static int row_cands(const qm__i8isa *row, fast_cand *c)
{
    static const char *const path[3] = {"", " (gemv path)", " (gemm path)"};
    qm__mm_fn *fn[3] = {row->kernel.mm, row->gemv, row->gemm};
    for (int p = 0; p < 3; p++) {
        snprintf(c[p].name, sizeof c[p].name, "%s%s", row->kernel.name, path[p]);
        c[p].mm = fn[p];
        c[p].reads_r8 = row->reads_r8;
        c[p].reads_r8_q8 = row->reads_r8_q8;
    }
    return 3;
}

/* The fast table walked: every row this CPU runs (its three entries), the
 * measured choice, and every row's software model (their GEMV is AVX2
 * code: where AVX2 runs); at most 40. */
static int fast_cands(fast_cand *c)
{
    int n = 0;
    for (size_t i = 0; i < qm__i8isa_count(); i++)
        if (fast_kernel(qm__i8isa_at(i)->kernel.name))
            n += row_cands(qm__i8isa_at(i), c + n);
    c[n++] = (fast_cand){"auto", qm__i8kernel_select()->mm, 0, 0};
    for (size_t i = 0; i < qm__i8isa_count() && fast_kernel("avx2"); i++)
        if (qm__i8isa_at(i)->model)
            n += row_cands(qm__i8isa_at(i)->model, c + n);
    return n;
}

/* Prepares nx inputs x of m into xq (ld floats apart), runs the scalar
 * specification into ys and every candidate into y, and asserts each
 * output's bits equal (what: the case, for the message). Returns nc. */
static int fast_same_bits(const fast_cand *c, int nc, const qm__qmat *m, const float *x,
                          uint32_t nx, float *xq, size_t ld, float *ys, float *y, float *scratch,
                          const char *what)
{
    const uint32_t k = m->k, n = m->n;
    for (uint32_t r = 0; r < nx; r++)
        qm__i8_prep(m, x + (size_t)r * k, xq + r * ld);
    fast_run(qm__i8kernel_scalar.mm, m, xq, ld, nx, ys, scratch);
    for (int ci = 0; ci < nc; ci++) {
        memset(y, 0xa5, 4 * (size_t)nx * n);
        fast_run(c[ci].mm, m, xq, ld, nx, y, scratch);
        for (size_t i = 0; i < (size_t)nx * n; i++)
            ck_assert_msg(memcmp(&y[i], &ys[i], 4) == 0,
                          "%s: %s: output [%zu][%zu] %.9g, the specification %.9g", c[ci].name,
                          what, i / n, i % n, y[i], ys[i]);
    }
    return nc;
}

/* Random shapes: every fast kernel and path, models included, gives the
 * scalar specification's bits; an input's outputs in a call of many are
 * its outputs alone. */
START_TEST(test_fast_kernels_same_bits_as_the_specification)
{
    static const uint32_t BLOCKS[] = {0, 32, 64, 128, 256};
    static const uint32_t NX[] = {1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 24, 33, 65, 70};
    fast_cand c[40];
    int nc = fast_cands(c), runs = 0;
    for (int it = 0; it < 60; it++) {
        uint32_t bits = it & 1 ? 8 : 4, block = BLOCKS[(it / 2) % 5];
        uint32_t nx = NX[it % 15];
        uint32_t k = block ? block * (1 + next() % 4) - (next() % 2 ? 0 : 32 * (next() % (block / 32)))
                           : 1 + next() % 700;
        if (block && it % 7 == 3)
            k -= next() % 31; /* a partial last sub-block: not a multiple of 32 */
        if (k < 2)
            k = 2;
        uint32_t n = 1 + next() % 41;
        fmat f;
        fmat_new(&f, bits, block, k, n);
        const qm__qmat *m = &f.m;
        ck_assert(qm__i8_ok(m));
        size_t ld = (qm__i8_x_stride(m) + 15) & ~(size_t)15;
        float *x = rand_inputs(nx, k), *xq = calloc(ld * nx, sizeof(float));
        float *ys = malloc(4 * (size_t)nx * n), *y = malloc(4 * (size_t)nx * n);
        float *scratch = malloc(sizeof(float) * qm__kernel_scratch_floats(m));
        ck_assert(xq && ys && y && scratch);
        if (it % 5 == 4) /* whole sub-blocks of zeros, and a zero input row */
            for (uint32_t i = 0; i < nx * k; i++)
                if ((i / 32) % 3 == 1 || i < k)
                    x[i] = 0.0f;
        char what[128];
        snprintf(what, sizeof what, "%u-bit block %u k %u n %u nx %u dtype %d zp %d (along rows %d)",
                 bits, block, k, n, nx, (int)m->scale_dtype, m->zp != NULL, !m->zp_blockwise);
        runs += fast_same_bits(c, nc, m, x, nx, xq, ld, ys, y, scratch, what);
        /* The last input alone: the same bits (auto: the decode class). */
        fast_run(qm__i8kernel_select()->mm, m, xq + (size_t)(nx - 1) * ld, ld, 1, y, scratch);
        ck_assert_msg(memcmp(y, ys + (size_t)(nx - 1) * n, 4 * (size_t)n) == 0,
                      "input %u alone differs from its outputs in a call of %u", nx - 1, nx);
#if defined(QMOE_I8_MODELS)
        const char *why = NULL;
        ck_assert_msg(qm__amx_model_faults(&why) == 0, "AMX model: %s", why);
#endif
        free(x), free(xq), free(ys), free(y), free(scratch);
        fmat_free(&f);
    }
    fprintf(stderr, "fast kernels: %d kernels and paths, %d runs, all the specification's bits\n",
            nc, runs);
}
END_TEST

/* The decode GEMV's common case (Q4_0 / Q8_0 rows: blocks of 32, no zero
 * point, rows of exactly their codes), which the random shapes above reach
 * only now and then: every count of 32-byte chunks a row can have, odd and
 * even (the AVX-512 VNNI kernel reads chunk pairs 64 bytes at a time and an
 * odd last chunk alone), a partial last group of 8 rows, 1-5 inputs
 * (paired and alone), every scale dtype: the specification's bits. */
START_TEST(test_fast_decode_every_chunk_count)
{
    static const uint32_t CHUNKS[] = {1, 2, 3, 4, 5, 7, 12, 45};
    static const uint32_t NX[] = {1, 2, 3, 5};
    fast_cand c[40];
    int nc = fast_cands(c), runs = 0;
    for (int it = 0; it < 64; it++) {
        uint32_t bits = it & 1 ? 8 : 4, k = 64 * CHUNKS[(it / 2) % 8], nx = NX[(it / 16) % 4];
        uint32_t n = it % 3 ? 21 : 40;
        fmat f;
        fmat_new(&f, bits, 32, k, n);
        f.m.zp = NULL;
        f.m.row_bytes = (size_t)k * bits / 8;
        const qm__qmat *m = &f.m;
        size_t ld = (qm__i8_x_stride(m) + 15) & ~(size_t)15;
        float *x = rand_inputs(nx, k), *xq = calloc(ld * nx, sizeof(float));
        float *ys = malloc(4 * (size_t)nx * n), *y = malloc(4 * (size_t)nx * n);
        float *scratch = malloc(sizeof(float) * qm__kernel_scratch_floats(m));
        ck_assert(xq && ys && y && scratch);
        char what[96];
        snprintf(what, sizeof what, "%u-bit k %u (%u chunks) n %u nx %u dtype %d", bits, k,
                 k * bits / 256, n, nx, (int)m->scale_dtype);
        runs += fast_same_bits(c, nc, m, x, nx, xq, ld, ys, y, scratch, what);
        free(x), free(xq), free(ys), free(y), free(scratch);
        fmat_free(&f);
    }
    fprintf(stderr, "fast decode rows of 1-45 chunks: %d kernels and paths, %d runs, all the "
                    "specification's bits\n", nc, runs);
}
END_TEST

/* The r8 layout (qm_r8.h): interleaving and taking rows back is the
 * identity; every fast row that reads r8 of a width (qm_kernel_isa.h,
 * reads_r8 for 4-bit, reads_r8_q8 for 8-bit: on this CPU, or through its
 * model), as it serves and on its GEMV and GEMM paths forced at every
 * input count, gives the row layout's specification bits on an r8 matrix
 * of that width (8-bit: with codes 0, the -128 of the sign trick, against
 * inputs of +-127, the largest pairs); qm__i8kernel_r8_native answers each
 * row's flags. */
/* The layout's byte map (qm__r8_offset) on rows of an odd number of
 * sub-blocks too (the AVX2 transpose takes two a step, the last alone),
 * in place and out of place on every ISA path. */
START_TEST(test_r8_interleave_is_its_byte_map)
{
    static const size_t RB[] = {16, 48, 80, 1440, 2880};
    for (size_t ri = 0; ri < sizeof RB / sizeof RB[0]; ri++) {
        const size_t rb = RB[ri];
        const uint32_t n = 24;
        uint8_t *w = malloc(n * rb), *want = malloc(n * rb), *got = malloc(n * rb);
        uint8_t *tmp = malloc(8 * rb);
        ck_assert(w && want && got && tmp);
        for (size_t i = 0; i < n * rb; i++)
            w[i] = (uint8_t)(i * 131 + i / 251);
        for (uint32_t r = 0; r < n; r++)
            for (size_t o = 0; o < rb; o++)
                want[qm__r8_offset(rb, r, o)] = w[(size_t)r * rb + o];
        for (int isa = 0; isa < 2; isa++) {
            memset(got, 0, n * rb);
            qm__r8_interleave_from(w, n, rb, got, 0, isa);
            ck_assert_msg(memcmp(got, want, n * rb) == 0, "row_bytes %zu isa %d", rb, isa);
        }
        memcpy(got, w, n * rb);
        qm__r8_interleave(got, n, rb, tmp);
        ck_assert_msg(memcmp(got, want, n * rb) == 0, "row_bytes %zu in place", rb);
        free(w);
        free(want);
        free(got);
        free(tmp);
    }
}
END_TEST

START_TEST(test_r8_layout_same_bits)
{
    static const uint32_t NX[] = {1, 2, 3, 4, 5, 8, 13, 24};
    ck_assert(!qm__i8kernel_r8_native(&qm__i8kernel_scalar, 1, 4));
    ck_assert(!qm__i8kernel_r8_native(&qm__i8kernel_scalar, 1, 8));
    for (size_t i = 0; i < qm__i8isa_count(); i++) {
        const qm__i8kernel *k = fast_kernel(qm__i8isa_at(i)->kernel.name);
        int r8 = qm__i8isa_at(i)->reads_r8, q8 = qm__i8isa_at(i)->reads_r8_q8;
        if (k)
            ck_assert(
                qm__i8kernel_r8_native(k, 1, 4) == r8 && qm__i8kernel_r8_native(k, 4, 4) == r8 &&
                qm__i8kernel_r8_native(k, 40, 4) == r8 && qm__i8kernel_r8_native(k, 1, 8) == q8 &&
                qm__i8kernel_r8_native(k, 40, 8) == q8 && !qm__i8kernel_r8_native(k, 1, 2));
    }
    fast_cand c[40];
    int nc = fast_cands(c), runs = 0, readers = 0, readers8 = 0;
    for (int ci = 0; ci < nc; ci++)
        readers += c[ci].reads_r8, readers8 += c[ci].reads_r8_q8;
    if (!readers)
        fprintf(stderr,
                "r8 layout: no kernel here reads 4-bit r8, only the layout's round trip runs\n");
    if (!readers8)
        fprintf(stderr,
                "r8 layout: no kernel here reads 8-bit r8, only the layout's round trip runs\n");
    for (int it = 0; it < 96; it++) {
        uint32_t bits = it < 48 ? 4 : 8;
        uint32_t k = it % 8 == 0 ? 2048 : 64 * (1 + next() % 12), n = 8 * (1 + next() % 9);
        uint32_t nx = NX[it % 8];
        fmat f;
        fmat_new(&f, bits, 32, k, n);
        f.m.zp = NULL;
        f.m.row_bytes = (size_t)k * bits / 8;
        if (bits == 8)
            for (uint32_t r = 0; r < n; r++)
                f.w[(size_t)r * k] = f.w[(size_t)r * k + 1] = 0;
        const qm__qmat *m = &f.m;
        size_t bytes = (size_t)n * m->row_bytes;
        uint8_t *wi = malloc(bytes), *back = malloc(bytes), *tmp = malloc(8 * m->row_bytes);
        ck_assert(wi && back && tmp);
        memcpy(wi, f.w, bytes);
        qm__r8_interleave(wi, n, m->row_bytes, tmp);
        ck_assert(n == 8 || memcmp(wi, f.w, bytes) != 0);
        qm__r8_rows(wi, m->row_bytes, 0, n, back);
        ck_assert_msg(memcmp(back, f.w, bytes) == 0, "k %u n %u: rows back differ", k, n);
        /* Out of place (a code-book tile in rows), the best ISA here and
         * SSE2 / C: the same bytes as in place. */
        for (int isa = 0; isa < 2; isa++) {
            memset(back, 0xa5, bytes);
            qm__r8_interleave_from(f.w, n, m->row_bytes, back, next() % 16, isa);
            ck_assert_msg(memcmp(back, wi, bytes) == 0, "k %u n %u isa %d: out of place differs", k,
                          n, isa);
        }
        uint32_t n0 = 8 * (next() % (n / 8)); /* a tile from a group boundary */
        qm__r8_rows(wi, m->row_bytes, n0, n, back);
        ck_assert(memcmp(back, f.w + (size_t)n0 * m->row_bytes, bytes - n0 * m->row_bytes) == 0);
        qm__qmat mi = *m;
        mi.w = wi;
        mi.r8 = 1;
        size_t ld = (qm__i8_x_stride(m) + 15) & ~(size_t)15;
        float *x = rand_inputs(nx, k), *xq = calloc(ld * nx, sizeof(float));
        float *ys = malloc(4 * (size_t)nx * n), *y = malloc(4 * (size_t)nx * n);
        float *scratch = malloc(sizeof(float) * qm__kernel_scratch_floats(&mi));
        ck_assert(x && xq && ys && y && scratch);
        for (uint32_t r = 0; r < nx && bits == 8; r++) /* the block's +-127 on the two zeros */
            x[(size_t)r * k] = x[(size_t)r * k + 1] = r % 2 ? 20.0f : -20.0f;
        for (uint32_t r = 0; r < nx; r++)
            qm__i8_prep(m, x + (size_t)r * k, xq + r * ld);
        fast_run(qm__i8kernel_scalar.mm, m, xq, ld, nx, ys, scratch);
        for (int ci = 0; ci < nc; ci++) {
            if (!(bits == 8 ? c[ci].reads_r8_q8 : c[ci].reads_r8)) continue;
            memset(y, 0xa5, 4 * (size_t)nx * n);
            fast_run(c[ci].mm, &mi, xq, ld, nx, y, scratch);
            for (size_t i = 0; i < (size_t)nx * n; i++)
                ck_assert_msg(memcmp(&y[i], &ys[i], 4) == 0,
                              "%s on %u-bit r8, k %u n %u nx %u dtype %d: output [%zu][%zu] "
                              "%.9g, the specification %.9g",
                              c[ci].name, bits, k, n, nx, (int)m->scale_dtype, i / n, i % n, y[i],
                              ys[i]);
            runs++;
        }
        free(x), free(xq), free(ys), free(y), free(scratch);
        free(wi), free(back), free(tmp);
        fmat_free(&f);
    }
    fprintf(stderr,
            "r8 layout: %d runs of %d 4-bit and %d 8-bit r8 readers (kernels, paths, "
            "models), all the specification's bits\n",
            runs, readers, readers8);
}
END_TEST

/* A 4-bit code book read in 4 bits (qm__qmat.cb with bits 4, r8): its
 * 8-bit tiles decoded from rows and from r8 (C and SIMD) are the int8
 * matrix's codes; every fast row that reads 4-bit r8 (on this CPU, or
 * through its model), as it serves and on its GEMV and GEMM paths forced,
 * at 1 to 24 inputs, gives the specification's bits of the int8 matrix of
 * codes 128 + cb[q] with the same scales; with every code 12 against
 * inputs of 127 too (AVX2's int16 sums at their largest). */
START_TEST(test_codebook_is_its_int8_matrix)
{
    static const uint32_t NX[] = {1, 2, 3, 4, 5, 8, 13, 24};
    const int8_t *cb = qm_codebook_values(QM_CODEBOOK_E2M1);
    fast_cand c[40];
    int nc = fast_cands(c), runs = 0;
    for (int it = 0; it < 32; it++) {
        uint32_t k = it % 6 == 0 ? 2880 : 64 * (1 + next() % 12), n = 8 * (1 + next() % 9);
        uint32_t nx = NX[it % 8];
        int full = it % 4 == 3;
        fmat f;
        fmat_new(&f, 4, 32, k, n);
        qm__qmat m4 = f.m;
        m4.zp = NULL;
        m4.row_bytes = (size_t)k / 2;
        m4.cb = cb;
        for (size_t i = 0; full && i < (size_t)n * m4.row_bytes; i++)
            f.w[i] = 0x77; /* e2m1 code 7: 12 */
        uint8_t *w8 = malloc((size_t)n * k), *wi = malloc((size_t)n * m4.row_bytes);
        uint8_t *tmp = malloc(8 * m4.row_bytes);
        ck_assert(w8 && wi && tmp);
        qm__cb_rows_c(&m4, 0, n, w8);
        memcpy(wi, f.w, (size_t)n * m4.row_bytes);
        qm__r8_interleave(wi, n, m4.row_bytes, tmp);
        qm__qmat m8 = m4, mi = m4;
        m8.cb = NULL;
        m8.bits = 8;
        m8.w = w8;
        m8.row_bytes = k;
        mi.w = wi;
        mi.r8 = 1;
        /* The 8-bit tiles decoded from r8 (SIMD where it runs) and from rows. */
        uint8_t *d8 = malloc((size_t)n * k);
        ck_assert(d8);
        for (int simd = 0; simd < 2; simd++) {
            memset(d8, 0x5a, (size_t)n * k);
            (simd ? qm__cb_rows : qm__cb_rows_c)(&mi, 0, n, d8);
            ck_assert_msg(memcmp(d8, w8, (size_t)n * k) == 0, "k %u n %u: %s r8 decode", k, n,
                          simd ? "SIMD" : "C");
            memset(d8, 0x5a, (size_t)n * k);
            (simd ? qm__cb_rows : qm__cb_rows_c)(&m4, 0, n, d8);
            ck_assert(memcmp(d8, w8, (size_t)n * k) == 0);
        }
        free(d8);
        size_t ld4 = (qm__i8_x_stride(&mi) + 15) & ~(size_t)15;
        size_t ld8 = (qm__i8_x_stride(&m8) + 15) & ~(size_t)15;
        float *x = rand_inputs(nx, k);
        float *xq4 = calloc(ld4 * nx, sizeof(float)), *xq8 = calloc(ld8 * nx, sizeof(float));
        float *ys = malloc(4 * (size_t)nx * n), *y = malloc(4 * (size_t)nx * n);
        size_t sf = qm__kernel_scratch_floats(&m8) + qm__kernel_scratch_floats(&mi);
        float *scratch = malloc(sizeof(float) * sf);
        ck_assert(x && xq4 && xq8 && ys && y && scratch);
        for (size_t i = 0; full && i < (size_t)nx * k; i++)
            x[i] = 1.0f;
        for (uint32_t r = 0; r < nx; r++) {
            qm__i8_prep(&mi, x + (size_t)r * k, xq4 + r * ld4);
            qm__i8_prep(&m8, x + (size_t)r * k, xq8 + r * ld8);
        }
        fast_run(qm__i8kernel_scalar.mm, &m8, xq8, ld8, nx, ys, scratch);
        for (int ci = 0; ci < nc; ci++) {
            if (!c[ci].reads_r8)
                continue;
            memset(y, 0xa5, 4 * (size_t)nx * n);
            fast_run(c[ci].mm, &mi, xq4, ld4, nx, y, scratch);
            for (size_t i = 0; i < (size_t)nx * n; i++)
                ck_assert_msg(memcmp(&y[i], &ys[i], 4) == 0,
                              "%s on an e2m1 code book in r8, k %u n %u nx %u%s: output "
                              "[%zu][%zu] %.9g, the int8 matrix's %.9g",
                              c[ci].name, k, n, nx, full ? " (every code 12)" : "", i / n, i % n,
                              y[i], ys[i]);
            runs++;
        }
        free(x), free(xq4), free(xq8), free(ys), free(y), free(scratch);
        free(w8), free(wi), free(tmp);
        fmat_free(&f);
    }
    if (!runs)
        fprintf(stderr, "code book: no kernel here reads 4-bit r8; not run\n");
    else
        fprintf(stderr, "code book: %d runs of 4-bit readers (kernels, paths, models), all the "
                        "int8 matrix's bits\n", runs);
}
END_TEST

#if defined(QMOE_X86_KERNELS)
/* The vector packers and row parameters give the C ones' bytes: u8 panels
 * (4- and 8-bit), s16 panels, scales (f32/f16/bf16, zero points), short
 * row tiles and row tails. */
START_TEST(test_fast_packers_match_c)
{
    if (!fast_kernel("avx2"))
        return;
    for (int it = 0; it < 40; it++) {
        uint32_t bits = it & 1 ? 8 : 4, block = it % 3 ? 32u << (it % 3) : 0;
        uint32_t k = block ? block * (1 + next() % 5) : 2 + next() % 500;
        uint32_t n = 1 + next() % 40;
        fmat f;
        fmat_new(&f, bits, block, k, n);
        const qm__qmat *m = &f.m;
        size_t nsb = qm__i8_nsb(m), nb8 = ((size_t)m->nblk + 7) / 8 * 8;
        uint8_t *pa = malloc(1024 * nsb), *pc = malloc(1024 * nsb);
        float *sa = malloc(4 * 16 * nb8), *sc = malloc(4 * 16 * nb8);
        int32_t *za = malloc(4 * 16 * nb8), *zc = malloc(4 * 16 * nb8);
        for (uint32_t n0 = 0; n0 < n; n0 += 16) {
            uint32_t nr = n - n0 < 16 ? n - n0 : 16;
            qm__i8_pack_avx2(m, n0, nr, 0, nsb, 0, pa);
            qm__i8_pack_u8_c(m, n0, nr, 0, nsb, pc);
            ck_assert_msg(memcmp(pa, pc, 512 * nsb) == 0, "u8 panel %u-bit k %u rows %u+%u", bits,
                          k, n0, nr);
            if (bits == 8) {
                qm__i8_pack_avx2(m, n0, nr, 1, nsb, 1, pa);
                qm__i8_pack_s16_c(m, n0, nr, 1, nsb, pc);
                ck_assert_msg(memcmp(pa, pc, 1024 * (nsb - 1)) == 0, "s16 panel k %u rows %u+%u",
                              k, n0, nr);
            }
            int32_t *zpa = m->zp ? za : NULL, *zpc = m->zp ? zc : NULL;
            qm__i8_params_avx2(m, n0, nr, sa, zpa);
            qm__i8_params_c(m, n0, nr, sc, zpc);
            ck_assert_msg(memcmp(sa, sc, 4 * 16 * nb8) == 0, "scales dtype %d rows %u+%u",
                          (int)m->scale_dtype, n0, nr);
            if (m->zp)
                ck_assert(memcmp(za, zc, 4 * 16 * nb8) == 0);
        }
        free(pa), free(pc), free(sa), free(sc), free(za), free(zc);
        fmat_free(&f);
    }
    /* r8 matrices (qm_r8.h) of either width: the vector packers give the
     * panels the C packer makes of the same rows in row order, whole
     * groups and a half tile alike (the VNNI and AMX GEMMs pack 8-bit r8
     * through qm__x_pack_u8; AVX2's through the s16 packer). */
    for (int it = 0; it < 24; it++) {
        /* r8 takes k in whole 64-column pairs of sub-blocks (qm__r8_eligible) */
        uint32_t bits = it & 1 ? 8 : 4, k = 64 * (1 + next() % 12), n = 8 * (1 + next() % 9);
        fmat f;
        fmat_new(&f, bits, 32, k, n);
        f.m.zp = NULL;
        f.m.row_bytes = (size_t)k * bits / 8;
        const qm__qmat *m = &f.m;
        size_t nsb = qm__i8_nsb(m), bytes = (size_t)n * m->row_bytes;
        uint8_t *wi = malloc(bytes), *tmp = malloc(8 * m->row_bytes);
        uint8_t *pa = malloc(1024 * nsb), *pc = malloc(1024 * nsb);
        ck_assert(wi && tmp && pa && pc);
        memcpy(wi, f.w, bytes);
        qm__r8_interleave(wi, n, m->row_bytes, tmp);
        qm__qmat mi = *m;
        mi.w = wi;
        mi.r8 = 1;
        for (uint32_t n0 = 0; n0 < n; n0 += 16) {
            uint32_t nr = n - n0 < 16 ? n - n0 : 16;
            memset(pa, 0x5a, 1024 * nsb);
            qm__i8_pack_avx2(&mi, n0, nr, 0, nsb, 0, pa);
            qm__i8_pack_u8_c(m, n0, nr, 0, nsb, pc);
            ck_assert_msg(memcmp(pa, pc, 512 * nsb) == 0, "u8 panel of %u-bit r8, k %u rows %u+%u",
                          bits, k, n0, nr);
            if (bits == 8 && nsb > 1) {
                qm__i8_pack_avx2(&mi, n0, nr, 1, nsb, 1, pa);
                qm__i8_pack_s16_c(m, n0, nr, 1, nsb, pc);
                ck_assert_msg(memcmp(pa, pc, 1024 * (nsb - 1)) == 0,
                              "s16 panel of 8-bit r8, k %u rows %u+%u", k, n0, nr);
            }
        }
        free(wi), free(tmp), free(pa), free(pc);
        fmat_free(&f);
    }
}
END_TEST

/* The AVX2 quantiser gives the C specification's bytes: k with tails,
 * 4- and 8-bit layouts, zero sub-blocks, ties at .5, large, tiny,
 * subnormal, infinite and NaN inputs. */
START_TEST(test_fast_prep_avx2_matches_c)
{
    if (!fast_kernel("avx2"))
        return;
    for (int it = 0; it < 200; it++) {
        uint32_t bits = it & 1 ? 8 : 4, k = 1 + next() % 400;
        qm__qmat m = {.n = 1, .k = k, .bits = bits, .nblk = 1, .block = k};
        size_t st = qm__i8_x_stride(&m);
        float *x = malloc(4 * (size_t)k), *a = malloc(4 * st), *c = malloc(4 * st);
        for (uint32_t i = 0; i < k; i++) {
            uint32_t r = next() % 100;
            x[i] = r < 70   ? ((float)(next() % 20001) - 10000.0f) * 1e-3f
                   : r < 80 ? (float)((int)(next() % 255) - 127) * 0.5f /* ties after scaling */
                   : r < 85 ? 0.0f
                   : r < 90 ? ((float)(next() % 3) - 1.0f) * 1e-40f /* subnormal */
                   : r < 95 ? (float)(next() % 7) * 1e30f
                            : (float)(next() % 5);
            if (it % 50 == 7 && r == 99)
                x[i] = next() % 2 ? INFINITY : NAN;
            if ((i / 32) % 5 == 3)
                x[i] = 0.0f;
        }
        memset(a, 0x5a, 4 * st);
        memset(c, 0x5a, 4 * st);
        qm__i8_prep_avx2(&m, x, a);
        qm__i8_prep_c(&m, x, c);
        ck_assert_msg(memcmp(a, c, 4 * st) == 0, "%u-bit k %u: the AVX2 quantiser differs", bits,
                      k);
        free(x), free(a), free(c);
    }
}
END_TEST

static int refuse_perm(void)
{
    return 1; /* EPERM */
}

static int grant_perm(void)
{
    return 0;
}

/* The tile permission refused: AMX is not offered, QMOE_KERNEL=amx falls
 * back to the measured choice and the reason names the refusal; granted
 * (on a CPU made to look like it has AMX), it is. Nothing here runs a tile
 * instruction. */
START_TEST(test_amx_permission_refused_falls_back)
{
    const char *real = qm__amx_why_not();
    fprintf(stderr, "amx on this CPU: %s\n", real ? real : "usable");
    qm__kernel_amx_hook(1, refuse_perm);
    ck_assert_int_eq(qm__cpu_has_amx(), 0);
    const char *why = qm__amx_why_not();
    ck_assert_msg(why && strstr(why, "permission refused"), "%s", why ? why : "(null)");
    setenv("QMOE_KERNEL", "amx", 1);
    const qm__i8kernel *k = qm__i8kernel_select();
    unsetenv("QMOE_KERNEL");
    ck_assert_str_ne(k->name, "amx");
    ck_assert_ptr_eq(k, qm__i8kernel_select()); /* the measured choice */
    qm__kernel_amx_hook(1, grant_perm);
    ck_assert_int_eq(qm__cpu_has_amx(), 1);
    ck_assert_ptr_null(qm__amx_why_not());
    qm__kernel_amx_hook(0, NULL);
    ck_assert_int_eq(qm__cpu_has_amx(), real == NULL);
}
END_TEST

/* The fast choice per class on fake timings (AMX made to look present and
 * granted, and verified, which the self-check never ran here; fastest at
 * prefill only; no kernel runs), kept in the cache file beside the exact
 * choice, each mode's line kept when the other is written. */
static double fake_i8(const qm__i8kernel *k, const qm__qmat *m, uint32_t nx, const float *x)
{
    (void)m, (void)x;
    if (strcmp(k->name, "amx") == 0)
        return nx > 1 ? fake_wide : 100.0;
    return 50.0;
}

/* The AMX row's needs other than AMX itself (AVX-512 and the rest): what
 * faking AMX cannot give a CPU. 1 when this CPU has them all; else 0 and
 * why. */
static int amx_rest_present(char *why, size_t cap)
{
    const char *needs = qm__i8isa_at((size_t)qm__i8isa_find("amx"))->needs;
    char rest[160] = "";
    size_t o = 0;
    for (const char *p = needs; *p && o < sizeof rest - 1;) {
        size_t n = strcspn(p, " ");
        if (n && strncmp(p, "amx-", 4) != 0)
            o += (size_t)snprintf(rest + o, sizeof rest - o, "%s%.*s", o ? " " : "", (int)n, p);
        p += n + (p[n] == ' ');
    }
    return qm__cpu_needs(rest, why, cap);
}

START_TEST(test_fast_calibration_and_cache)
{
    if (!fast_kernel("avx2"))
        return;
    char why[160];
    if (!amx_rest_present(why, sizeof why)) {
        /* The fake makes AMX look present; the AMX row also needs AVX-512,
         * which a CPU without it cannot be made to run. */
        fprintf(stderr, "fast calibration and cache: skipped here (%s: the AMX row cannot be "
                        "faked onto this CPU)\n",
                why);
        return;
    }
    char path[] = "/tmp/qmoe-kcache-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    remove(path);
    setenv("QMOE_KERNEL_CACHE", path, 1);
    qm__kernel_amx_hook(1, grant_perm);
    size_t amx = (size_t)qm__i8isa_find("amx");
    qm__kcheck_assume(1, amx, 1);
    qm__i8kernel_set_timer(fake_i8);
    fake_wide = 10.0;
    const char *d = qm__i8kernel_recalibrate();
    ck_assert_msg(strstr(d, "measured: q4 ") && strstr(d, "/amx, q8 ") && !strstr(d, "q4 amx"),
                  "%s", d);
    char line[2][512] = {{0}};
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    ck_assert_ptr_nonnull(fgets(line[0], sizeof line[0], f));
    fclose(f);
    ck_assert_msg(strncmp(line[0], "qmoe-fast-kernels 6|", 20) == 0, "%s", line[0]);
    fake_wide = 500.0; /* the cache wins over a new measurement */
    d = qm__i8kernel_recalibrate();
    ck_assert_msg(strstr(d, "(cached)") && strstr(d, "/amx"), "%s", d);
    /* The exact mode's line joins it, first (written here directly: this
     * CPU may have one exact candidate, nothing to measure or keep). */
    const char *ex[2] = {"avx512", "avx2"};
    const int exi[4] = {1, 0, 0, 0};
    qm__cache_save(path, "qmoe-kernels", ex, 2, exi);
    f = fopen(path, "r");
    ck_assert_ptr_nonnull(fgets(line[0], sizeof line[0], f));
    ck_assert_ptr_nonnull(fgets(line[1], sizeof line[1], f));
    fclose(f);
    ck_assert_msg(strncmp(line[0], "qmoe-kernels 6|", 15) == 0, "%s", line[0]);
    ck_assert_msg(strncmp(line[1], "qmoe-fast-kernels 6|", 20) == 0, "%s", line[1]);
    const qm__kernel *ek[2] = {&qm__kernel_avx512, &qm__kernel_avx2}, *eo[4];
    ck_assert_int_eq(qm__kernel_cache_load(path, ek, 2, eo), 0);
    ck_assert(eo[0] == &qm__kernel_avx2 && eo[1] == &qm__kernel_avx512);
    d = qm__i8kernel_recalibrate();
    ck_assert_msg(strstr(d, "(cached)"), "%s", d);
    qm__kernel_amx_hook(0, NULL); /* another kernel set: measured again */
    qm__kcheck_assume(1, amx, 0);
    fake_wide = 10.0;
    d = qm__i8kernel_recalibrate();
    ck_assert_msg(!strstr(d, "(cached)") && !strstr(d, "amx"), "%s", d);
    unsetenv("QMOE_KERNEL_CACHE");
    qm__i8kernel_set_timer(NULL);
    qm__i8kernel_recalibrate();
    remove(path);
}
END_TEST
#endif


/* ---- the self-check (qm_kernel_check.c) ---- */

/* The verdict of (precision, name), or NULL. */
static const qm_kernel_verdict *verdict(const qm_kernel_check *kc, const char *prec,
                                        const char *name)
{
    for (unsigned i = 0; i < kc->n; i++)
        if (!strcmp(kc->v[i].precision, prec) && !strcmp(kc->v[i].name, name))
            return &kc->v[i];
    return NULL;
}

/* Every row of both tables has a verdict; each row this CPU runs is
 * verified (the kernels are right here), each other one unavailable with
 * why; the check costs little. */
START_TEST(test_self_check_verifies_this_cpu)
{
    unsetenv("QMOE_KERNEL_CACHE");
    qm__kcheck_rerun();
    const qm_kernel_check *kc = qm_kernel_check_run();
    ck_assert_uint_eq(kc->n, qm__exact_count() + qm__i8isa_count());
    ck_assert_uint_eq(kc->refused, 0);
    for (size_t i = 0; i < qm__i8isa_count(); i++) {
        const qm__i8isa *row = qm__i8isa_at(i);
        const qm_kernel_verdict *v = verdict(kc, "fast", row->kernel.name);
        char why[160];
        int runs = !row->not_built && qm__cpu_needs(row->needs, why, sizeof why);
        ck_assert_ptr_nonnull(v);
        ck_assert_int_eq(v->kind, runs ? QM_KERNEL_VERIFIED : QM_KERNEL_UNAVAILABLE);
        ck_assert(runs || v->reason[0]);
    }
    for (size_t i = 0; i < qm__exact_count(); i++) {
        const qm_kernel_verdict *v = verdict(kc, "exact", qm__exact_at(i)->name);
        ck_assert_ptr_nonnull(v);
        ck_assert(v->kind == QM_KERNEL_VERIFIED || v->kind == QM_KERNEL_UNAVAILABLE);
    }
    ck_assert_msg(!kc->cached && kc->ms > 0, "%d %g", kc->cached, kc->ms);
    fprintf(stderr, "self-check on %s (%s): %u verified, %.2f ms (wall)\n", kc->cpu, kc->flags,
            kc->verified, kc->ms);
}
END_TEST

/* The decode kernel the measured choice serves here (NULL: scalar). */
static const qm__i8isa *chosen_decode_row(void)
{
    const char *d = qm__i8kernel_recalibrate(); /* "measured: q4 A[/B], q8 ..." */
    const char *q4 = strstr(d, "q4 ");
    for (size_t i = 0; q4 && i < qm__i8isa_count(); i++) {
        const char *name = qm__i8isa_at(i)->kernel.name;
        size_t n = strlen(name);
        if (!strncmp(q4 + 3, name, n) && strchr("/, ", q4[3 + n]))
            return qm__i8isa_at(i);
    }
    return NULL;
}

/* A test hook breaks one lane of the chosen decode kernel: the check
 * refuses it (its reason names the output), it is no candidate, forcing
 * it falls back and qm_kernel_check_forced says why, the choice's outputs
 * keep the specification's bits; undone, it is verified again. The same
 * for an exact kernel, caught by the bound. */
START_TEST(test_self_check_refuses_a_broken_lane)
{
    unsetenv("QMOE_KERNEL_CACHE");
    const qm__i8isa *row = chosen_decode_row();
    if (!row) {
        fprintf(stderr, "broken lane: no SIMD fast kernel here, nothing to break\n");
        return;
    }
    char spec[64], why[160];
    const char *name = row->kernel.name;
    snprintf(spec, sizeof spec, "fast:%s:5", name);
    ck_assert_int_eq(qm__kernel_break(spec, why, sizeof why), 0);
    qm__kcheck_rerun();
    const qm_kernel_check *kc = qm_kernel_check_run();
    const qm_kernel_verdict *v = verdict(kc, "fast", name);
    ck_assert_int_eq(v->kind, QM_KERNEL_REFUSED);
    ck_assert_msg(strstr(v->reason, "output [0][5]"), "%s", v->reason);
    const char *d = qm__i8kernel_recalibrate();
    ck_assert_msg(!strstr(d, name), "%s still chosen: %s", name, d);
    setenv("QMOE_KERNEL", name, 1);
    ck_assert_str_ne(qm__i8kernel_select()->name, name);
    qm_status st = {0};
    ck_assert_int_eq(qm_kernel_check_forced(&st), QM_EINVAL);
    ck_assert_msg(strstr(st.msg, "refused by the self-check") && strstr(st.msg, name), "%s",
                  st.msg);
    unsetenv("QMOE_KERNEL");
    /* What serves now gives the specification's bits on the broken lane. */
    fmat f;
    fmat_new(&f, 4, 32, 256, 24);
    f.m.zp = NULL;
    f.m.row_bytes = 128;
    size_t ld = (qm__i8_x_stride(&f.m) + 15) & ~(size_t)15;
    float *x = rand_inputs(1, 256), *xq = calloc(ld, sizeof(float));
    float *ys = malloc(4 * 24), *y = malloc(4 * 24);
    float *scratch = malloc(sizeof(float) * qm__kernel_scratch_floats(&f.m));
    qm__i8_prep(&f.m, x, xq);
    fast_run(qm__i8kernel_scalar.mm, &f.m, xq, ld, 1, ys, scratch);
    fast_run(qm__i8kernel_select()->mm, &f.m, xq, ld, 1, y, scratch);
    ck_assert(memcmp(y, ys, 4 * 24) == 0);
    free(x), free(xq), free(ys), free(y), free(scratch);
    fmat_free(&f);
    /* An exact kernel's broken lane is outside the bound. */
    int ei = qm__exact_count() ? 0 : -1;
    while (ei >= 0 && (size_t)ei < qm__exact_count() &&
           !qm__cpu_needs(qm__exact_at((size_t)ei)->needs, why, sizeof why))
        ei++;
    if (ei >= 0 && (size_t)ei < qm__exact_count()) {
        snprintf(spec, sizeof spec, "exact:%s", qm__exact_at((size_t)ei)->name);
        ck_assert_int_eq(qm__kernel_break(spec, why, sizeof why), 0);
        qm__kcheck_rerun();
        v = verdict(qm_kernel_check_run(), "exact", qm__exact_at((size_t)ei)->name);
        ck_assert_int_eq(v->kind, QM_KERNEL_REFUSED);
        ck_assert_msg(strstr(v->reason, "bound"), "%s", v->reason);
    }
    ck_assert_int_ne(qm__kernel_break("fast:nope", why, sizeof why), 0);
    ck_assert_int_ne(qm__kernel_break("fast:avx2:16", why, sizeof why), 0);
    ck_assert_int_ne(qm__kernel_break("slow:avx2", why, sizeof why), 0);
    qm__kernel_break(NULL, why, sizeof why);
    qm__kcheck_rerun();
    ck_assert_int_eq(verdict(qm_kernel_check_run(), "fast", name)->kind, QM_KERNEL_VERIFIED);
    qm__i8kernel_recalibrate();
}
END_TEST

/* The cache file's text (at most 4 KiB). */
static void read_text(const char *path, char *out, size_t cap)
{
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(out, 1, cap - 1, f) : 0;
    out[n] = 0;
    if (f)
        fclose(f);
}

static void write_text(const char *path, const char *text, size_t n)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fwrite(text, 1, n, f);
    fclose(f);
}

/* The self-check's verdicts in the kernel cache: a second start reads
 * them; a cache file truncated anywhere, garbage, written by another
 * version or another binary is ignored (the check runs again) and
 * rewritten whole, never trusted. */
START_TEST(test_self_check_cache_never_trusts_a_bad_file)
{
    char path[] = "/tmp/qmoe-kcheck-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    remove(path);
    setenv("QMOE_KERNEL_CACHE", path, 1);
    qm__kcheck_rerun();
    ck_assert(!qm_kernel_check_run()->cached);
    qm__kernel_recalibrate();
    qm__i8kernel_recalibrate();
    char good[4096], now[4096];
    read_text(path, good, sizeof good);
    ck_assert_msg(strncmp(good, "qmoe-kernel-check 6|", 20) == 0, "%s", good);
    qm__kcheck_rerun();
    ck_assert(qm_kernel_check_run()->cached);
    size_t len = strlen(good), line = strcspn(good, "\n") + 1;
    /* Truncated at every few bytes of the check's line, and mid-file. */
    for (size_t cut = 1; cut < len; cut += cut < line ? 7 : 23) {
        write_text(path, good, cut);
        qm__kcheck_rerun();
        ck_assert_msg(!qm_kernel_check_run()->cached || cut >= line,
                      "a file cut at byte %zu of %zu was trusted", cut, len);
        read_text(path, now, sizeof now);
        ck_assert_msg(strncmp(now, good, line) == 0, "cut at %zu: the line not rewritten", cut);
    }
    /* Garbage, and one byte changed anywhere in the line. */
    write_text(path, "\x01garbage|||\nqmoe-kernel-check 6|x|y|z|00000000\n", 48);
    qm__kcheck_rerun();
    ck_assert(!qm_kernel_check_run()->cached);
    for (size_t at = 0; at + 1 < line; at += 5) {
        memcpy(now, good, len + 1);
        now[at] = now[at] == 'x' ? 'y' : 'x';
        write_text(path, now, len);
        qm__kcheck_rerun();
        ck_assert_msg(!qm_kernel_check_run()->cached, "byte %zu changed: trusted", at);
    }
    /* Another version and another binary, each line whole (its checksum
     * recomputed the way the writer makes it). */
    for (int which = 0; which < 2; which++) {
        memcpy(now, good, line);
        now[line] = 0;
        char *bar = strchr(now, '|');
        if (which == 0)
            bar[-1] = '5'; /* "qmoe-kernel-check 5|" */
        else
            bar[1] = bar[1] == 'a' ? 'b' : 'a'; /* the build id's first digit */
        char *last = strrchr(now, '|');
        uint32_t h = 2166136261u;
        for (const char *p = now; p < last; p++)
            h = (h ^ (uint8_t)*p) * 16777619u;
        snprintf(last, sizeof now - (size_t)(last - now), "|%08x\n", h);
        write_text(path, now, strlen(now));
        qm__kcheck_rerun();
        ck_assert_msg(!qm_kernel_check_run()->cached, "%s trusted",
                      which ? "another binary's line" : "another version's line");
        read_text(path, now, sizeof now);
        ck_assert(strncmp(now, good, line) == 0);
    }
    unsetenv("QMOE_KERNEL_CACHE");
    remove(path);
    qm__kcheck_rerun();
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kernels");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60); /* seconds of wall time: the shared machines of CI are slow */
    tcase_add_test(tc, test_measured_classes_same_bits);
    tcase_add_test(tc, test_q4_gemv_same_bits_every_kernel);
    tcase_add_test(tc, test_q4_gemv_folded_within_bound);
    tcase_add_test(tc, test_no_avx512_takes_folded);
    tcase_add_test(tc, test_gemm_packed_same_bits_tails_and_reference);
    tcase_add_test(tc, test_gemm_every_kernel_model_bits);
    tcase_add_test(tc, test_pick_with_margin);
    tcase_add_test(tc, test_calibration_takes_fastest);
    tcase_add_test(tc, test_cache);
    tcase_add_test(tc, test_fast_kernels_same_bits_as_the_specification);
    tcase_add_test(tc, test_fast_decode_every_chunk_count);
    tcase_add_test(tc, test_r8_interleave_is_its_byte_map);
    tcase_add_test(tc, test_r8_layout_same_bits);
    tcase_add_test(tc, test_codebook_is_its_int8_matrix);
    tcase_add_test(tc, test_self_check_verifies_this_cpu);
    tcase_add_test(tc, test_self_check_refuses_a_broken_lane);
    tcase_add_test(tc, test_self_check_cache_never_trusts_a_bad_file);
#if defined(QMOE_X86_KERNELS)
    tcase_add_test(tc, test_fast_packers_match_c);
    tcase_add_test(tc, test_fast_prep_avx2_matches_c);
    tcase_add_test(tc, test_amx_permission_refused_falls_back);
    tcase_add_test(tc, test_fast_calibration_and_cache);
#endif
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
