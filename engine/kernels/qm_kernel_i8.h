/* qm_kernel_i8.h - what every fast-mode (int8 activation) kernel shares,
 * in portable C: the prepared input row, the per-call row parameters, the
 * packed weight panels of the GEMMs, the scratch layout, the AMX tile
 * configuration. Included by qm_kernel_scalar.c (the specification), the
 * SIMD kernels (qm_kernel_i8_*.c) and the software models of the
 * instructions this CPU may lack (qm_kernel_i8_model*.c, tests only).
 * Private to engine/.
 *
 * The canonical order (qm_kernels.h "Fast mode"), which every fast kernel
 * follows to the bit: for output (row n, input r)
 *
 *   S_j = sum over the 32 columns c of sub-block j of (q[n,c] - zp[n,b]) * qx[r,c]
 *         (an exact int32, however a kernel sums it);
 *   acc = +0; for each weight block b in order:
 *       t = +0; for each sub-block j of b below nse in order: t = fma(float(S_j), dx_j, t);
 *       acc = fma(t, scale[n,b], acc);
 *   y = acc.
 *
 * Every operation after the integer sums is elementwise per output, so a
 * kernel may hold outputs in vector lanes any way it likes (rows, inputs)
 * and give the same bits: the GEMV, the GEMMs and the AMX tiles do. */
#ifndef QM_KERNEL_I8_H
#define QM_KERNEL_I8_H

#include <stdint.h>
#include <string.h>

#include "qm_kernels.h"
#include "qm_r8.h"

#define QM__I8_AI static inline __attribute__((always_inline))

/* ---- the prepared input row (qm__i8_prep) ----
 * bytes [0, 32 nsb): the s8 codes, each sub-block's 32 in prepared order
 *   (4-bit weights: [16 even columns | 16 odd columns], so a byte's low
 *   and high nibbles meet their inputs at p and p + 16; 8-bit: natural);
 * 8-bit weights only: the same codes as s16, natural order (32 nsb int16);
 * then dx[nsb] (f32), sumq[nsb] (int32: the sum of the sub-block's codes)
 * and zsum[nsb] = sumq << (bits - 1) (the implicit zero point's share;
 * QM__CB_ZP * sumq for a 4-bit code-book view). */
typedef struct qm__i8_xrow {
    const int8_t *q;
    const int16_t *q16; /* 8-bit weights only */
    const float *dx;
    const int32_t *sumq, *zsum;
} qm__i8_xrow;

/* Sub-blocks that belong to a weight block: min(nsb, nblk * spb); the
 * rest of the prepared row (a padding sub-block of a row-wise matrix) is
 * zeros that no block owns. */
static inline size_t qm__i8_nse(const qm__qmat *m)
{
    size_t nsb = qm__i8_nsb(m), own = (size_t)m->nblk * qm__i8_spb(m);
    return nsb < own ? nsb : own;
}

/* Floats before dx in a prepared row. */
static inline size_t qm__i8_dx_off(const qm__qmat *m)
{
    size_t nsb = qm__i8_nsb(m);
    return nsb * 8 + (m->bits == 8 ? nsb * 16 : 0);
}

/* The same parts of a prepared row being written (the quantisers). */
typedef struct qm__i8_xout {
    int8_t *q;
    int16_t *q16; /* 8-bit weights only */
    float *dx;
    int32_t *sumq, *zsum;
} qm__i8_xout;

static inline qm__i8_xout qm__i8_xout_at(const qm__qmat *m, float *xq)
{
    size_t nsb = qm__i8_nsb(m);
    float *dx = xq + qm__i8_dx_off(m);
    qm__i8_xout x = {.q = (int8_t *)xq,
                     .q16 = m->bits == 8 ? (int16_t *)(xq + nsb * 8) : NULL,
                     .dx = dx,
                     .sumq = (int32_t *)(dx + nsb),
                     .zsum = (int32_t *)(dx + 2 * nsb)};
    return x;
}

/* Sub-block j's scale and sums, from its absolute maximum and the sum of
 * its codes. */
static inline void qm__i8_xout_sums(const qm__i8_xout *x, const qm__qmat *m, size_t j, float amax,
                                    int32_t sum)
{
    x->dx[j] = amax / 127.0f;
    x->sumq[j] = sum;
    x->zsum[j] = sum * (m->cb && m->bits == 4 ? QM__CB_ZP : 1 << (m->bits - 1));
}

static inline qm__i8_xrow qm__i8_xrow_at(const qm__qmat *m, const float *xq)
{
    /* Read only: the row is written through qm__i8_xout alone. */
    qm__i8_xout o = qm__i8_xout_at(m, (float *)xq);
    qm__i8_xrow x = {.q = o.q, .q16 = o.q16, .dx = o.dx, .sumq = o.sumq, .zsum = o.zsum};
    return x;
}

/* Column (within its sub-block) of prepared position p. */
static inline uint32_t qm__i8_pos_col(const qm__qmat *m, uint32_t p)
{
    return m->bits == 4 ? (p < 16 ? 2 * p : 2 * (p - 16) + 1) : p;
}

/* Where sub-block j's block starts (first) and ends (last) in the order. */
static inline int qm__i8_first(uint32_t spb, size_t j)
{
    return j % spb == 0;
}
static inline int qm__i8_last(uint32_t spb, size_t nse, size_t j)
{
    return (j + 1) % spb == 0 || j + 1 == nse;
}

/* ---- a call's rows: parameters, panels, scratch ----
 * A call owns rows [n0, n1) of W, at most QM__TILE_ROWS (16). Its scale of
 * block b for row n0 + i sits at sct[16 b + i]; with zero points zpt[16 b
 * + i] likewise (int32); rows past n1 hold 0. The GEMMs' panel holds the
 * rows' codes of each sub-block j as 8 groups g of 16 rows x 4 bytes:
 *   u8:  pan[512 j + 64 g + 4 i + e] = code of prepared position 4g + e
 *        (what vpdpbusd lanes and AMX B tiles read: an 8 x 64-byte tile);
 *   s16: pan[1024 j + 64 g + 4 i + 2 e] = q - zp of column 2g + e, as
 *        int16 (the 8-bit panel of the AVX2 GEMM, for vpmaddwd);
 * rows past n1 hold 0, and bytes past a row's end count as code 0 (their
 * inputs are 0). */
#define QM__I8_TG 64u /* inputs per pass of a GEMM (its accumulators) */

/* Each kernel's blocking, shared with its model: inputs per micro-kernel
 * pass, and the input count from which a call runs the GEMM (below it the
 * GEMV, or for AMX the AVX-512 VNNI kernel: a tile of fewer inputs is
 * mostly empty). */
#define QM__I8_AVXVNNI_NR 4
#define QM__I8_AVX512VNNI_NR 8
#define QM__I8_VNNI_GEMM_MIN 4u /* AVX-VNNI: not measured (no such CPU here yet) */
/* AVX-512 VNNI, by code width: measured on a Zen 4 core
 * (qmoe_kernel_micro --inputs N, its avx512vnni-gemv / -gemm lines,
 * docs/BENCHMARKS.md): the 4-bit GEMV, which pairs its inputs, is as fast
 * as the GEMM up to 7 inputs; the 8-bit GEMV, one input at a time, loses
 * to the GEMM from 3. */
#define QM__I8_AVX512VNNI_GEMM_MIN(m) ((m)->bits == 4 ? 8u : 3u)
#define QM__I8_AMX_MIN 5u

/* A fast entry's split by input count: calls of fewer than `min` inputs run
 * `small`, the others `gemm` (both constant where it is inlined). */
QM__I8_AI void qm__i8_split(uint32_t min, qm__mm_fn *small, qm__mm_fn *gemm, const qm__qmat *m,
                            uint32_t n0, uint32_t n1, const float *xq, size_t ldx, uint32_t nx,
                            float *y, size_t ldy, float *scratch)
{
    if (nx < min)
        small(m, n0, n1, xq, ldx, nx, y, ldy, scratch);
    else
        gemm(m, n0, n1, xq, ldx, nx, y, ldy, scratch);
}

typedef struct qm__i8_scratch {
    float *sct;
    int32_t *zpt;
    uint8_t *pan;
    float *tacc, *acc; /* [QM__I8_TG][16] each */
    int32_t *cbuf;     /* AMX: one C tile, 16 x 16 */
} qm__i8_scratch;

/* Floats of scratch a fast kernel may use for matrix m (any kernel). */
static inline size_t qm__i8_scratch_floats(const qm__qmat *m)
{
    size_t nb8 = ((size_t)m->nblk + 7) / 8 * 8;
    size_t pan = qm__i8_nsb(m) * 1024 / 4; /* the larger (s16) panel */
    return 2 * 16 * nb8 + pan + 2 * 16 * QM__I8_TG + 256 + 64;
}

static inline qm__i8_scratch qm__i8_scratch_at(const qm__qmat *m, float *scratch)
{
    size_t nb8 = ((size_t)m->nblk + 7) / 8 * 8;
    float *p = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    qm__i8_scratch s;
    s.sct = p;
    s.zpt = (int32_t *)(p + 16 * nb8);
    s.tacc = p + 2 * 16 * nb8;
    s.acc = s.tacc + 16 * QM__I8_TG;
    s.cbuf = (int32_t *)(s.acc + 16 * QM__I8_TG);
    s.pan = (uint8_t *)(s.cbuf + 256);
    return s;
}

/* Scales (and zero points, when zpt is not NULL) of the call's rows h..h+7
 * (h a multiple of 8; rows from nr on hold 0) into lanes h..h+7. */
static inline void qm__i8_params8_c(const qm__qmat *m, uint32_t n0, uint32_t nr, uint32_t h,
                                    float *sct, int32_t *zpt)
{
    size_t nb8 = ((size_t)m->nblk + 7) / 8 * 8;
    for (size_t b = 0; b < nb8; b++)
        for (uint32_t i = h; i < h + 8; i++) {
            int in = i < nr && b < m->nblk;
            sct[16 * b + i] = in ? qm__qmat_scale(m, n0 + i, (uint32_t)b) : 0.0f;
            if (zpt)
                zpt[16 * b + i] = in ? qm__qmat_zp(m, n0 + i, (uint32_t)b) : 0;
        }
}

/* Scales (and zero points, when zpt is not NULL) of rows [n0, n0 + nr). */
static inline void qm__i8_params_c(const qm__qmat *m, uint32_t n0, uint32_t nr, float *sct,
                                   int32_t *zpt)
{
    qm__i8_params8_c(m, n0, nr, 0, sct, zpt);
    qm__i8_params8_c(m, n0, nr, 8, sct, zpt);
}

/* Byte o of row n of m, in either layout (r8: qm_r8.h), 0 past its end. */
static inline uint8_t qm__i8_code_byte(const qm__qmat *m, uint32_t n, size_t o)
{
    if (o >= m->row_bytes)
        return 0;
    return m->r8 ? m->w[qm__r8_offset(m->row_bytes, n, o)] : m->w[(size_t)n * m->row_bytes + o];
}

/* The u8 panel of sub-blocks [j0, j1) of rows [n0, n0 + nr), from pan
 * (either layout; a 4-bit code book's codes looked up to QM__CB_ZP +
 * cb[q], whose zero point the input's zsum carries). */
static inline void qm__i8_pack_u8_c(const qm__qmat *m, uint32_t n0, uint32_t nr, size_t j0,
                                    size_t j1, uint8_t *pan)
{
    memset(pan, 0, 512 * (j1 - j0));
    for (uint32_t i = 0; i < nr; i++) {
        for (size_t j = j0; j < j1; j++)
            for (uint32_t p = 0; p < 32; p++) {
                uint32_t c = qm__i8_pos_col(m, p);
                uint8_t v;
                if (m->bits == 4) {
                    v = (uint8_t)((qm__i8_code_byte(m, n0 + i, 16 * j + c / 2) >> (4 * (c & 1))) &
                                  15);
                    if (m->cb) /* a code book's code, looked up (qm__qmat.cb) */
                        v = (uint8_t)(QM__CB_ZP + m->cb[v]);
                } else
                    v = qm__i8_code_byte(m, n0 + i, 32 * j + c);
                pan[512 * (j - j0) + 64 * (p / 4) + 4 * i + p % 4] = v;
            }
    }
}

/* The s16 (q - zp) panel of 8-bit sub-blocks [j0, j1) of rows [n0, n0 + nr). */
static inline void qm__i8_pack_s16_c(const qm__qmat *m, uint32_t n0, uint32_t nr, size_t j0,
                                     size_t j1, uint8_t *pan)
{
    memset(pan, 0, 1024 * (j1 - j0));
    uint32_t spb = qm__i8_spb(m);
    for (uint32_t i = 0; i < nr; i++) {
        for (size_t j = j0; j < j1; j++) {
            int zp = qm__qmat_zp(m, n0 + i, (uint32_t)(j / spb));
            for (uint32_t c = 0; c < 32; c++) {
                int16_t v = (int16_t)(qm__i8_code_byte(m, n0 + i, 32 * j + c) - zp);
                memcpy(pan + 1024 * (j - j0) + 64 * (c / 2) + 4 * i + 2 * (c % 2), &v, 2);
            }
        }
    }
}

/* ---- AMX ----
 * The 64-byte tile configuration ldtilecfg reads (palette 1): C = tmm0
 * (M rows of 16 int32), A = tmm1 (M inputs x 32 s8 codes of a sub-block),
 * B = tmm2 (the u8 panel of that sub-block: 8 rows of 64 bytes). */
typedef struct qm__amx_cfg {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} qm__amx_cfg;

static inline void qm__amx_cfg_make(qm__amx_cfg *c, uint32_t M)
{
    memset(c, 0, sizeof *c);
    c->palette = 1;
    c->colsb[0] = 64;
    c->rows[0] = (uint8_t)M;
    c->colsb[1] = 32;
    c->rows[1] = (uint8_t)M;
    c->colsb[2] = 64;
    c->rows[2] = 8;
}

#endif
