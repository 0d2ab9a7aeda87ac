/* qm_kernel_scalar.c - the readable specification of the quantised matmul,
 * (the kernel selection is in qm_kernel_select.c).
 *
 * W[n, c] = scale[n, b] * (q[n, c] - zp[n, b]) with b = c / block; then
 * y[r, n] = sum over c = 0..k-1, in column order, of W[n, c] * x[r, c]:
 * dequantise then dot, as onnxruntime's exact path does. */
#include <stdlib.h>
#include <string.h>

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

const qm__kernel qm__kernel_scalar = {
    .name = "scalar",
    .x_stride = qm__scalar_x_stride,
    .prep = qm__scalar_prep,
    .gemv = qm__scalar_matmul,
    .gemm = qm__scalar_matmul,
    .gemm_row_pad = 1,
};

size_t qm__kernel_scratch_floats(const qm__qmat *m)
{
    /* GEMM: one dequantised tile and its transposed panel; GEMV: per-row
     * scales and zero points of up to 4 rows; plus slack for alignment. */
    size_t tile = (size_t)2 * QM__TILE_ROWS * QM__GEMM_KT;
    size_t rows = (size_t)8 * m->nblk;
    return (tile > rows ? tile : rows) + 64;
}
