/* qm_gemm_packed_avx512.c - the AVX-512 kernel's exact-mode GEMM (compiled
 * with -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl).
 *
 * The order of every output is the GEMM class's, shared with the AVX2 GEMM
 * (qm_kernel_avx2.c), so both give the same bits: K is cut into tiles of
 * QM__GEMM_KT prepared columns (for 4-bit weights each 16 columns are
 * [8 even, 8 odd], qm__avx2_prep); within a tile each output accumulates
 * w * x with one f32 FMA per column in that order, starting from zero, with
 * w = (q - zp) * scale rounded to f32 once; the tile's sum is added to the
 * output, tiles in order. What this file changes is the work around it:
 *
 *  - The panel. One call owns 16 W rows (QM__TILE_ROWS); per tile their
 *    weights are dequantised once into a column-major f32 panel (16 floats
 *    per column, 16 KiB: L1) that every input row then reuses. It is built
 *    straight from the codes: one 16-lane gather takes 4 code bytes of each
 *    of the 16 rows (8 columns of 4-bit, 4 of 8-bit), and each panel column
 *    is then a shift, a table lookup (4-bit: vpermps of q - 8 for the
 *    implicit zero point, else of q and a subtract) or a convert and
 *    subtract (8-bit), and a multiply by the 16 rows' scales of its block:
 *    no f32 tile, no transpose.
 *  - The micro-kernel. Input rows run in balanced groups of at most 12
 *    (6..12 when there are more than 12), each
 *    group one register block of that many zmm accumulators (16 outputs
 *    each): per column one panel load and, per row, one FMA with the input
 *    broadcast from memory. Groups are never padded with zero rows, and the
 *    last group is never left with too few chains to hide the FMA latency.
 *
 * Which rows share a group or a call changes no bits: a row's accumulator
 * sees the same operations whatever runs next to it. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "qm_gemm_tiles.h"
#include "qm_kernels.h"

#define QM_AI static inline __attribute__((always_inline))

/* Most input rows of one register block: 12 accumulators. 14 would fit
 * the 32 vector registers, but GCC keeps one general register per row
 * pointer, more of them spill, and 14 measured 10-25% slower here. */
#define QM__PK_MAXR 12u
/* Blocks one tile can touch: blocks are multiples of 16 columns. */
#define QM__PK_MAXB (QM__GEMM_KT / 16u + 1u)

/* Scales and zero points of the tile's blocks [b0, b0 + nb), per row:
 * sv[j * 16 + i] for row n0 + i (0 for rows past nr: their lanes are never
 * stored). */
static void qm__pk_block_params(const qm__qmat *m, uint32_t n0, uint32_t nr, uint32_t b0,
                                uint32_t nb, float *sv, float *zv)
{
    const __m512 zsym = _mm512_set1_ps((float)(1 << (m->bits - 1)));
    for (uint32_t j = 0; j < nb; j++) {
        _mm512_storeu_ps(sv + 16 * j, _mm512_setzero_ps());
        _mm512_storeu_ps(zv + 16 * j, zsym);
    }
    if (m->scale_dtype == QM_DTYPE_F32) { /* plain loads, the common case */
        const float *s = (const float *)m->scales + (size_t)n0 * m->nblk + b0;
        for (uint32_t i = 0; i < nr; i++, s += m->nblk)
            for (uint32_t j = 0; j < nb; j++)
                memcpy(&sv[j * 16 + i], s + j, 4);
    } else {
        for (uint32_t i = 0; i < nr; i++)
            for (uint32_t j = 0; j < nb; j++)
                sv[j * 16 + i] = qm__qmat_scale_f16c(m, n0 + i, b0 + j);
    }
    if (m->zp)
        for (uint32_t i = 0; i < nr; i++)
            for (uint32_t j = 0; j < nb; j++)
                zv[j * 16 + i] = (float)qm__qmat_zp(m, n0 + i, b0 + j);
}

/* Bytes [off, off + 4) of each of the nr rows as one dword per row (lanes
 * past nr: 0); bytes past row_bytes read as 0, never read. */
QM_AI __m512i qm__pk_word(const qm__qmat *m, const uint8_t *base, size_t off, uint32_t nr,
                          __m512i vidx, int gather)
{
    if (__builtin_expect(gather && off + 4 <= m->row_bytes, 1)) {
        __mmask16 rows = (__mmask16)((1u << nr) - 1u);
        return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, vidx, base + off, 1);
    }
    uint32_t v[16] = {0};
    for (uint32_t i = 0; i < nr; i++) {
        const uint8_t *row = base + (size_t)i * m->row_bytes;
        if (off < m->row_bytes)
            memcpy(&v[i], row + off, m->row_bytes - off < 4 ? m->row_bytes - off : 4);
    }
    return _mm512_loadu_si512(v);
}

/* Panel column from 16 code indices (low bits of each dword): 4-bit. */
QM_AI void qm__pk_col4(__m512i q, __m512 lut, int zp, __m512 zv, __m512 sv, float *dst)
{
    __m512 w = _mm512_permutexvar_ps(q, lut);
    if (zp)
        w = _mm512_sub_ps(w, zv);
    _mm512_storeu_ps(dst, _mm512_mul_ps(w, sv));
}

/* 8-bit: the code is the dword's low byte. */
QM_AI void qm__pk_col8(__m512i q, __m512 zv, __m512 sv, float *dst)
{
    __m512 w = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(255)));
    _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_sub_ps(w, zv), sv));
}

/* Rows [n0, n0 + nr) x prepared columns [kt0, kt0 + len) of W as the panel
 * wt[len][16]; len is a multiple of 16. */
static void qm__pk_panel(const qm__qmat *m, uint32_t n0, uint32_t nr, uint32_t kt0, uint32_t len,
                         float *wt, float *sv, float *zv)
{
    const uint32_t cpb = m->nblk == 1 ? UINT32_MAX : m->block / 16; /* chunks per block */
    const uint32_t b0 = m->nblk == 1 ? 0 : kt0 / 16 / cpb;
    const uint32_t b1 = m->nblk == 1 ? 0 : (kt0 + len - 1) / 16 / cpb;
    qm__pk_block_params(m, n0, nr, b0, b1 - b0 + 1, sv, zv);
    const uint8_t *base = m->w + (size_t)n0 * m->row_bytes;
    /* Dword offsets of the 16 rows for the gather (a 32-bit index). */
    const int gather = m->row_bytes <= (size_t)INT32_MAX / 16;
    const __m512i vidx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                              12, 13, 14, 15),
                                            _mm512_set1_epi32(gather ? (int)m->row_bytes : 0));
    const int zp = m->zp != NULL;
    /* 4-bit: lut[q] = q - zp for the implicit zero point, else q. */
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 lut4 = zp ? lut : _mm512_sub_ps(lut, _mm512_set1_ps(8.0f));
    for (uint32_t g = 0; g < len / 16; g++) { /* one 16-column chunk */
        uint32_t j = m->nblk == 1 ? 0 : (kt0 / 16 + g) / cpb - b0;
        const __m512 s = _mm512_loadu_ps(sv + 16 * j), z = _mm512_loadu_ps(zv + 16 * j);
        float *d = wt + (size_t)g * 256;
        if (m->bits == 4) {
            /* 8 code bytes: byte e holds column 2e (low nibble, prepared
             * position e) and 2e + 1 (high nibble, position 8 + e). */
            size_t off = (size_t)(kt0 / 16 + g) * 8;
            for (uint32_t h = 0; h < 2; h++) {
                __m512i v = qm__pk_word(m, base, off + 4 * h, nr, vidx, gather);
                float *dl = d + 64 * h, *dh = d + 128 + 64 * h;
                qm__pk_col4(v, lut4, zp, z, s, dl);
                qm__pk_col4(_mm512_srli_epi32(v, 4), lut4, zp, z, s, dh);
                qm__pk_col4(_mm512_srli_epi32(v, 8), lut4, zp, z, s, dl + 16);
                qm__pk_col4(_mm512_srli_epi32(v, 12), lut4, zp, z, s, dh + 16);
                qm__pk_col4(_mm512_srli_epi32(v, 16), lut4, zp, z, s, dl + 32);
                qm__pk_col4(_mm512_srli_epi32(v, 20), lut4, zp, z, s, dh + 32);
                qm__pk_col4(_mm512_srli_epi32(v, 24), lut4, zp, z, s, dl + 48);
                qm__pk_col4(_mm512_srli_epi32(v, 28), lut4, zp, z, s, dh + 48);
            }
        } else {
            size_t off = (size_t)(kt0 / 16 + g) * 16;
            for (uint32_t h = 0; h < 4; h++) {
                __m512i v = qm__pk_word(m, base, off + 4 * h, nr, vidx, gather);
                float *dd = d + 64 * h;
                qm__pk_col8(v, z, s, dd);
                qm__pk_col8(_mm512_srli_epi32(v, 8), z, s, dd + 16);
                qm__pk_col8(_mm512_srli_epi32(v, 16), z, s, dd + 32);
                qm__pk_col8(_mm512_srli_epi32(v, 24), z, s, dd + 48);
            }
        }
    }
}

/* Every cache line of bytes [p, p + len) to L1. */
QM_AI void qm__pk_prefetch_run(const uint8_t *p, size_t len)
{
    const uint8_t *e = p + len;
    for (p = (const uint8_t *)((uintptr_t)p & ~(uintptr_t)63); p < e; p += 64)
        _mm_prefetch((const char *)p, QM__PF_HINT);
}

/* The codes and scales of tile kt0: 16 short runs at a row stride, which
 * the hardware prefetchers follow poorly; without them near, the gathers
 * and scale loads wait on memory. Inlined: a separate function of
 * prefetches alone has no visible effect, and GCC drops the call. */
QM_AI void qm__pk_prefetch(const qm__qmat *m, uint32_t n0, uint32_t nr, uint32_t kt0)
{
    const size_t ssz = m->scale_dtype == QM_DTYPE_F32 ? 4 : 2;
    const uint8_t *sc = (const uint8_t *)m->scales + (size_t)n0 * m->nblk * ssz;
    size_t off = (size_t)kt0 * m->bits / 8, run = (size_t)QM__GEMM_KT * m->bits / 8;
    if (off + run > m->row_bytes)
        run = m->row_bytes - off;
    size_t b0 = m->nblk == 1 ? 0 : (size_t)kt0 / m->block;
    size_t b1 = m->nblk == 1 ? 1 : ((size_t)kt0 + QM__GEMM_KT + m->block - 1) / m->block;
    if (b1 > m->nblk)
        b1 = m->nblk;
    for (uint32_t i = 0; i < nr; i++) {
        qm__pk_prefetch_run(m->w + (size_t)(n0 + i) * m->row_bytes + off, run);
        qm__pk_prefetch_run(sc + ((size_t)i * m->nblk + b0) * ssz, (b1 - b0) * ssz);
    }
}

/* R input rows x the panel's 16 outputs over one tile; the tile's sums are
 * stored to (first tile) or added to y. R is a constant after inlining, so
 * the accumulators stay in registers. */
QM_AI void qm__pk_block(const float *wt, uint32_t len, const float *x, size_t ldx, float *y,
                        size_t ldy, __mmask16 mask, int add, const uint32_t R)
{
    __m512 acc[QM__PK_MAXR];
#pragma GCC unroll 12
    for (uint32_t r = 0; r < R; r++)
        acc[r] = _mm512_setzero_ps();
    /* One pointer per row, advanced every 4 columns and hidden from the
     * optimiser (the empty asm): left alone, GCC turns x[r * ldx + c] into
     * row pointers indexed by one shared counter, and an FMA with an
     * indexed memory operand issues as two uops; base + constant stays
     * one. Measured 1.2-1.5x faster per core here, the same operations in
     * the same order; the loop runs on the panel pointer (no counter: one
     * general register fewer to spill, 8-15% more). len is a multiple of
     * 16. */
    const float *xr[QM__PK_MAXR];
#pragma GCC unroll 12
    for (uint32_t r = 0; r < R; r++)
        xr[r] = x + r * ldx;
    for (const float *wc = wt, *we = wt + 16 * (size_t)len; wc < we; wc += 64) {
#pragma GCC unroll 4
        for (uint32_t u = 0; u < 4; u++) {
            __m512 w = _mm512_loadu_ps(wc + 16 * u);
#pragma GCC unroll 12
            for (uint32_t r = 0; r < R; r++)
                acc[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(xr[r][u]), acc[r]);
        }
#pragma GCC unroll 12
        for (uint32_t r = 0; r < R; r++) {
            xr[r] += 4;
            __asm__("" : "+r"(xr[r]));
        }
    }
#pragma GCC unroll 12
    for (uint32_t r = 0; r < R; r++) {
        float *out = y + r * ldy;
        __m512 v = acc[r];
        if (add)
            v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out), v);
        _mm512_mask_storeu_ps(out, mask, v);
    }
}

#define QM__PK_CASE(R)                                                                             \
    case R:                                                                                        \
        qm__pk_block(wt, len, x, ldx, y, ldy, mask, add, R);                                       \
        break

static void qm__pk_rows(uint32_t rows, const float *wt, uint32_t len, const float *x, size_t ldx,
                        float *y, size_t ldy, __mmask16 mask, int add)
{
    switch (rows) {
        QM__PK_CASE(1);
        QM__PK_CASE(2);
        QM__PK_CASE(3);
        QM__PK_CASE(4);
        QM__PK_CASE(5);
        QM__PK_CASE(6);
        QM__PK_CASE(7);
        QM__PK_CASE(8);
        QM__PK_CASE(9);
        QM__PK_CASE(10);
        QM__PK_CASE(11);
        QM__PK_CASE(12);
    default:
        break;
    }
}

/* The lanes past nr are masked: never loaded, never stored. */
QM__PACKED_GEMM(qm__avx512_gemm_packed, qm__pk_panel, qm__pk_prefetch, qm__pk_rows, QM__PK_MAXR,
                QM__PK_MAXB, (__mmask16)((1u << nr) - 1u))
