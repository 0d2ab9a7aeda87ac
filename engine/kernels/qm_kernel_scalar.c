/* qm_kernel_scalar.c - the readable specification of the quantised matmul,
 * (the kernel selection is in qm_kernel_select.c).
 *
 * W[n, c] = scale[n, b] * (q[n, c] - zp[n, b]) with b = c / block; then
 * y[r, n] = sum over c = 0..k-1, in column order, of W[n, c] * x[r, c]:
 * dequantise then dot, as onnxruntime's exact path does. The 4-bit GEMV
 * with blocks of whole 32-column chunks sums in the canonical order every
 * GEMV kernel follows instead (qm__scalar_q4_canon_dot). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qm_kernel_i8.h"
#include "qm_kernels.h"

static size_t qm__scalar_x_stride(const qm__qmat *m, int gemm)
{
    (void)gemm;
    return m->k;
}

static void qm__scalar_prep(const qm__qmat *m, int gemm, const float *x, float *xp)
{
    (void)gemm;
    memcpy(xp, x, (size_t)m->k * sizeof(float));
}

static void qm__scalar_matmul(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp,
                              size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    (void)scratch;
    for (uint32_t n = n0; n < n1; n++) {
        const uint8_t *row = m->w + (size_t)n * m->row_bytes;
        for (uint32_t r = 0; r < nx; r++) {
            const float *x = xp + (size_t)r * ldx;
            float acc = 0.0f;
            for (uint32_t c = 0; c < m->k; c++) {
                uint32_t b = c / m->block;
                float w = qm__qmat_scale(m, n, b) *
                          (float)(qm__qmat_code(m, row, c) - qm__qmat_zp(m, n, b));
                acc += w * x[c];
            }
            y[(size_t)r * ldy + n] = acc;
        }
    }
}

/* The 4-bit GEMV's canonical order (qm__q4_canon), which the AVX2 and
 * AVX-512 GEMVs run on vectors: 16 lanes; for each 32-column chunk, lane j
 * adds w * x of column 32c + 2j, then of column 32c + 2j + 1 (one fused
 * multiply-add each, w = scale * (q - zp) rounded once); columns from k up
 * to a multiple of 32 count with x = 0 and their code read from the row
 * (0 past its bytes); then lane j += lane j + 8, j += j + 4, j += j + 2,
 * and lane 0 + lane 1 is the output. */
static float qm__scalar_q4_canon_dot(const qm__qmat *m, uint32_t n, const float *x)
{
    const uint8_t *row = m->w + (size_t)n * m->row_bytes;
    uint32_t kp = (m->k + 31) & ~31u;
    uint32_t cols_per_block = m->nblk == 1 ? kp : m->block;
    float acc[16] = {0};
    for (uint32_t c0 = 0; c0 < kp; c0 += 32) {
        uint32_t b = c0 / cols_per_block;
        float scale = qm__qmat_scale(m, n, b);
        int zp = qm__qmat_zp(m, n, b);
        for (uint32_t j = 0; j < 16; j++)
            for (uint32_t h = 0; h < 2; h++) {
                uint32_t c = c0 + 2 * j + h;
                int q = c / 2 < m->row_bytes ? (row[c / 2] >> (4 * h)) & 15 : 0;
                float w = scale * (float)(q - zp);
                acc[j] = fmaf(w, c < m->k ? x[c] : 0.0f, acc[j]);
            }
    }
    for (uint32_t half = 8; half >= 1; half /= 2)
        for (uint32_t j = 0; j < half; j++)
            acc[j] += acc[j + half];
    return acc[0];
}

static void qm__scalar_gemv(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp,
                            size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    if (!qm__q4_canon(m, 0)) {
        qm__scalar_matmul(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
        return;
    }
    for (uint32_t n = n0; n < n1; n++)
        for (uint32_t r = 0; r < nx; r++)
            y[(size_t)r * ldy + n] = qm__scalar_q4_canon_dot(m, n, xp + (size_t)r * ldx);
}

/* ---- fast mode: the specification (qm_kernels.h, qm_kernel_i8.h) ---- */

size_t qm__i8_x_stride(const qm__qmat *m)
{
    return qm__i8_dx_off(m) + 3 * qm__i8_nsb(m);
}

void qm__i8_prep(const qm__qmat *m, const float *x, float *xq)
{
#if defined(QMOE_X86_KERNELS)
    /* A benign race: every thread stores the same value. The CPU is asked
     * here, not through qm_kernel_select.c, which calls this file. */
    static int avx2 = -1;
    if (avx2 < 0) {
        __builtin_cpu_init();
        avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    if (avx2) {
        qm__i8_prep_avx2(m, x, xq);
        return;
    }
#endif
    qm__i8_prep_c(m, x, xq);
}

/* The quantiser as the specification writes it; qm__i8_prep_avx2 gives its bytes. */
void qm__i8_prep_c(const qm__qmat *m, const float *x, float *xq)
{
    size_t nsb = qm__i8_nsb(m);
    const qm__i8_xout o = qm__i8_xout_at(m, xq);
    for (size_t j = 0; j < nsb; j++) {
        float amax = 0.0f;
        for (size_t t = 0; t < 32; t++) {
            size_t c = 32 * j + t;
            float a = c < m->k ? fabsf(x[c]) : 0.0f;
            amax = a > amax ? a : amax;
        }
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (uint32_t p = 0; p < 32; p++) {
            size_t c = 32 * j + qm__i8_pos_col(m, p);
            long v = c < m->k ? lrintf(x[c] * id) : 0;
            v = v > 127 ? 127 : v < -127 ? -127 : v;
            o.q[32 * j + p] = (int8_t)v;
            if (o.q16) o.q16[32 * j + p] = (int16_t)v;
            sum += (int32_t)v;
        }
        qm__i8_xout_sums(&o, m, j, amax, sum);
    }
}

/* The canonical order of qm_kernel_i8.h, one output at a time. */
static void qm__scalar_i8mm(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                            size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    size_t nse = qm__i8_nse(m);
    uint32_t spb = qm__i8_spb(m);
    (void)scratch;
    for (uint32_t n = n0; n < n1; n++) {
        const uint8_t *row = m->w + (size_t)n * m->row_bytes;
        for (uint32_t r = 0; r < nx; r++) {
            qm__i8_xrow x = qm__i8_xrow_at(m, xq + (size_t)r * ldx);
            float acc = 0.0f;
            for (uint32_t b = 0; b < m->nblk; b++) {
                int zp = qm__qmat_zp(m, n, b);
                float t = 0.0f;
                for (size_t j = (size_t)b * spb; j < (size_t)(b + 1) * spb && j < nse; j++) {
                    int32_t s = 0;
                    for (uint32_t p = 0; p < 32; p++) {
                        uint32_t c = (uint32_t)(32 * j) + qm__i8_pos_col(m, p);
                        if (c < m->k)
                            s += (qm__qmat_code(m, row, c) - zp) * x.q[32 * j + p];
                    }
                    t = fmaf((float)s, x.dx[j], t);
                }
                acc = fmaf(t, qm__qmat_scale(m, n, b), acc);
            }
            y[(size_t)r * ldy + n] = acc;
        }
    }
}

const qm__kernel qm__kernel_scalar = {
    .name = "scalar",
    .x_stride = qm__scalar_x_stride,
    .prep = qm__scalar_prep,
    .gemv = qm__scalar_gemv,
    .gemm = qm__scalar_matmul,
    .gemm_row_pad = 1,
};

const qm__i8kernel qm__i8kernel_scalar = {.name = "scalar", .mm = qm__scalar_i8mm};

size_t qm__r8_tile_floats(const qm__qmat *m)
{
    return ((size_t)QM__TILE_ROWS * m->row_bytes / 4 + 15) & ~(size_t)15;
}

size_t qm__kernel_scratch_floats(const qm__qmat *m)
{
    /* Exact GEMM: one dequantised tile and its transposed panel; exact
     * GEMV: per-row scales and zero-point products of up to 4 rows (blocks
     * padded to 8); fast mode: qm_kernel_i8.h's row parameters, panel and
     * accumulators; plus slack for alignment. */
    size_t tile = (size_t)2 * QM__TILE_ROWS * QM__GEMM_KT;
    size_t rows = (size_t)8 * (((size_t)m->nblk + 7) / 8 * 8);
    size_t fast = qm__i8_scratch_floats(m);
    size_t most = tile > rows ? tile : rows;
    return (most > fast ? most : fast) + 64 + (m->r8 || m->r8_rows ? qm__r8_tile_floats(m) : 0) +
           (m->cb ? qm__cb_tile_floats(m) : 0);
}
