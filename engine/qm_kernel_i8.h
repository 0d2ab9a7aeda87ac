/* qm_kernel_i8.h - the fast-mode (int8 activation) kernels' shared code,
 * included by qm_kernel_i8_avx2.c, qm_kernel_i8_avxvnni.c (256-bit body
 * below) and qm_kernel_i8_avx512vnni.c (its own 512-bit body). Private to
 * engine/.
 *
 * Canonical arithmetic of one output (row n, input r), which every SIMD
 * fast kernel follows to the bit:
 *   S_j   = exact int32 dot of sub-block j (32 columns) in 8 lanes, lane i =
 *           columns 4i..4i+3 of the prepared order (what vpdpbusd gives);
 *   A, B  = 8-lane f32 accumulators, A over even sub-blocks, B over odd:
 *           acc = fma(cvt(S_j), sc[b(j)] * dx_j, acc) in sub-block order;
 *   main  = hsum8(A + B) (fixed order 8 -> 4 -> 2 -> 1);
 *   corr  = dot8(zsc, xs) with zsc[b] = sc[b] * zp[b] when the matrix has
 *           zero points, else zp * dot8(sc, xs) (dot8: 8-lane FMA over the
 *           blocks, zero-padded to a multiple of 8, then hsum8);
 *   y     = main - corr.
 * A 256-bit body keeps A and B in two registers; the 512-bit body keeps them
 * as the two halves of one. Sub-blocks past k have zero codes and dx = 0,
 * so their terms are exact zeros whatever scale they meet.
 *
 * The 256-bit includer defines QM__I8_FN, QM__I8_DOT4(w, x) and
 * QM__I8_DOT8(w, x) (8 dword lanes as above, 32 u8 codes x 32 s8 inputs). */
#ifndef QM_KERNEL_I8_H
#define QM_KERNEL_I8_H

#include <immintrin.h>
#include <string.h>

#include "qm_kernels.h"

#define QM_I8_AI static inline __attribute__((always_inline))

QM_I8_AI float qm__i8_hsum(__m256 v)
{
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* sum over blocks of a[b] * xs[b]; both padded with zeros to nb8 = 8k. */
QM_I8_AI float qm__i8_dot8(const float *a, const float *xs, size_t nb8)
{
    __m256 c = _mm256_setzero_ps();
    for (size_t b = 0; b < nb8; b += 8)
        c = _mm256_fmadd_ps(_mm256_loadu_ps(a + b), _mm256_loadu_ps(xs + b), c);
    return qm__i8_hsum(c);
}

/* Row n's scales as f32 into sc[0..nb8) (zeros past nblk), and, with zero
 * points, zsc[b] = sc[b] * zp[b]. */
static inline void qm__i8_row_params(const qm__qmat *m, uint32_t n, float *sc, float *zsc)
{
    size_t nb8 = ((size_t)m->nblk + 7) / 8 * 8;
    if (m->scale_dtype == QM_DTYPE_F32)
        memcpy(sc, (const uint8_t *)m->scales + (size_t)n * m->nblk * 4, (size_t)m->nblk * 4);
    else
        for (uint32_t b = 0; b < m->nblk; b++)
            sc[b] = qm__qmat_scale(m, n, b);
    for (size_t b = m->nblk; b < nb8; b++)
        sc[b] = 0.0f;
    if (m->zp)
        for (size_t b = 0; b < nb8; b++)
            zsc[b] = b < m->nblk ? sc[b] * (float)qm__qmat_zp(m, n, (uint32_t)b) : 0.0f;
}

QM_I8_AI float qm__i8_corr(const qm__qmat *m, const float *sc, const float *zsc, const float *xs)
{
    size_t nb8 = ((size_t)m->nblk + 7) / 8 * 8;
    if (m->zp)
        return qm__i8_dot8(zsc, xs, nb8);
    return (float)(1 << (m->bits - 1)) * qm__i8_dot8(sc, xs, nb8);
}

/* Scale of sub-block j (blocks past the last read the last: their terms are zeros). */
QM_I8_AI float qm__i8_sc(const float *sc, size_t j, uint32_t spb, uint32_t nblk)
{
    size_t b = j / spb;
    return sc[b < nblk ? b : nblk - 1];
}

/* Bytes [off, off + len) of a row, zeros past its end. */
QM_I8_AI const uint8_t *qm__i8_bytes(const uint8_t *row, size_t rb, size_t off, size_t len,
                                      uint8_t *tmp)
{
    if (__builtin_expect(off + len <= rb, 1))
        return row + off;
    memset(tmp, 0, len);
    if (off < rb)
        memcpy(tmp, row + off, rb - off);
    return tmp;
}

/* Pointers of a tile of NR weight rows x R inputs; the rows' scales (and
 * zero-point products) converted into scratch, or read in place. */
typedef struct qm__i8_tile_ptrs {
    const uint8_t *row[4];
    const float *sc[4], *zsc[4];
    const int8_t *xc[4];
    const float *dx[4], *xs[4];
} qm__i8_tile_ptrs;

QM_I8_AI void qm__i8_tile_setup(const qm__qmat *m, uint32_t n, const int NR, const float *xq,
                                size_t ldx, const int R, float *scratch, qm__i8_tile_ptrs *p)
{
    const size_t nsb = qm__i8_nsb(m), nb8 = ((size_t)m->nblk + 7) / 8 * 8;
    /* f32 scales in whole groups of 8 blocks, no zero points: the rows'
     * scales are read where they lie (the same values the copy would hold,
     * and no padding is needed), not copied per tile. */
    const int direct = m->scale_dtype == QM_DTYPE_F32 && !m->zp && m->nblk % 8 == 0;
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) {
        p->row[i] = m->w + (size_t)(n + i) * m->row_bytes;
        if (direct) {
            p->sc[i] = (const float *)m->scales + (size_t)(n + i) * m->nblk;
            p->zsc[i] = NULL;
            continue;
        }
        float *s = scratch + (size_t)i * 2 * nb8;
        qm__i8_row_params(m, n + i, s, s + nb8);
        p->sc[i] = s;
        p->zsc[i] = s + nb8;
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const float *xr = xq + (size_t)r * ldx;
        p->xc[r] = (const int8_t *)xr;
        p->dx[r] = xr + nsb * 8;
        p->xs[r] = p->dx[r] + nsb * 8;
    }
}

/* Once per 64 bytes of codes (4 sub-blocks of 4-bit codes, 2 of 8-bit;
 * called for even j), the same bytes of the next 4 rows (contiguous after
 * these). */
QM_I8_AI void qm__i8_prefetch(const qm__i8_tile_ptrs *p, const int NR, size_t j, const int BITS,
                              size_t rb)
{
    if (NR == 4 && (BITS == 8 || (j & 3) == 0)) {
        size_t poff = j * 4 * BITS + 4 * rb;
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            _mm_prefetch((const char *)(p->row[i] + poff), _MM_HINT_T0);
    }
}

#ifdef QM__I8_FN
/* Sub-blocks j and j + 1 of a row as two vectors of 32 u8 codes in the
 * prepared order. */
QM_I8_AI void qm__i8_wpair(const uint8_t *row, size_t rb, size_t j, const int BITS, __m256i *w0,
                           __m256i *w1)
{
    uint8_t tmp[64];
    if (BITS == 4) {
        __m256i v = _mm256_loadu_si256((const __m256i *)qm__i8_bytes(row, rb, 16 * j, 32, tmp));
        const __m256i lo4 = _mm256_set1_epi8(15);
        __m256i lo = _mm256_and_si256(v, lo4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        *w0 = _mm256_permute2x128_si256(lo, hi, 0x20);
        *w1 = _mm256_permute2x128_si256(lo, hi, 0x31);
    } else {
        const uint8_t *p = qm__i8_bytes(row, rb, 32 * j, 64, tmp);
        *w0 = _mm256_loadu_si256((const __m256i *)p);
        *w1 = _mm256_loadu_si256((const __m256i *)(p + 32));
    }
}

/* NR weight rows x R inputs (NR * R <= 4: 2 accumulators each in 16 registers). */
QM_I8_AI void qm__i8_tile(const qm__qmat *m, uint32_t n, const int NR, const float *xq,
                          size_t ldx, const int R, float *y, size_t ldy, float *scratch,
                          const int BITS)
{
    const size_t nsb = qm__i8_nsb(m);
    const uint32_t spb = qm__i8_spb(m), nblk = m->nblk;
    const size_t rb = m->row_bytes;
    qm__i8_tile_ptrs p;
    qm__i8_tile_setup(m, n, NR, xq, ldx, R, scratch, &p);
    __m256 A[4][4], B[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            A[i][r] = B[i][r] = _mm256_setzero_ps();
    for (size_t j = 0; j < nsb; j += 2) {
        qm__i8_prefetch(&p, NR, j, BITS, rb);
        __m256i x0[4], x1[4];
        __m256 d0[4], d1[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            x0[r] = _mm256_loadu_si256((const __m256i *)(p.xc[r] + 32 * j));
            x1[r] = _mm256_loadu_si256((const __m256i *)(p.xc[r] + 32 * j + 32));
            d0[r] = _mm256_loadu_ps(p.dx[r] + 8 * j);
            d1[r] = _mm256_loadu_ps(p.dx[r] + 8 * j + 8);
        }
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            __m256i w0, w1;
            qm__i8_wpair(p.row[i], rb, j, BITS, &w0, &w1);
            __m256 s0 = _mm256_set1_ps(qm__i8_sc(p.sc[i], j, spb, nblk));
            __m256 s1 = _mm256_set1_ps(qm__i8_sc(p.sc[i], j + 1, spb, nblk));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m256i p0 = BITS == 4 ? QM__I8_DOT4(w0, x0[r]) : QM__I8_DOT8(w0, x0[r]);
                __m256i p1 = BITS == 4 ? QM__I8_DOT4(w1, x1[r]) : QM__I8_DOT8(w1, x1[r]);
                A[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_mul_ps(s0, d0[r]),
                                          A[i][r]);
                B[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_mul_ps(s1, d1[r]),
                                          B[i][r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            y[(size_t)r * ldy + n + i] = qm__i8_hsum(_mm256_add_ps(A[i][r], B[i][r])) -
                                         qm__i8_corr(m, p.sc[i], p.zsc[i], p.xs[r]);
}

/* Decode: 4 rows x 1 input; otherwise 2 rows x 2 inputs; then the leftovers. */
#define QM__I8_BODY(BITS)                                                                          \
    do {                                                                                           \
        uint32_t r0 = 0;                                                                           \
        for (; r0 + 2 <= nx; r0 += 2) {                                                            \
            const float *xr = xq + (size_t)r0 * ldx;                                               \
            float *yr = y + (size_t)r0 * ldy;                                                      \
            uint32_t n = n0;                                                                       \
            for (; n + 2 <= n1; n += 2)                                                            \
                qm__i8_tile(m, n, 2, xr, ldx, 2, yr, ldy, scratch, BITS);                          \
            for (; n < n1; n++)                                                                    \
                qm__i8_tile(m, n, 1, xr, ldx, 2, yr, ldy, scratch, BITS);                          \
        }                                                                                          \
        for (; r0 < nx; r0++) {                                                                    \
            const float *xr = xq + (size_t)r0 * ldx;                                               \
            float *yr = y + (size_t)r0 * ldy;                                                      \
            uint32_t n = n0;                                                                       \
            for (; n + 4 <= n1; n += 4)                                                            \
                qm__i8_tile(m, n, 4, xr, ldx, 1, yr, ldy, scratch, BITS);                          \
            for (; n < n1; n++)                                                                    \
                qm__i8_tile(m, n, 1, xr, ldx, 1, yr, ldy, scratch, BITS);                          \
        }                                                                                          \
    } while (0)

static void qm__i8mm_q4(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq, size_t ldx,
                        uint32_t nx, float *y, size_t ldy, float *scratch)
{
    QM__I8_BODY(4);
}

static void qm__i8mm_q8(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq, size_t ldx,
                        uint32_t nx, float *y, size_t ldy, float *scratch)
{
    QM__I8_BODY(8);
}

void QM__I8_FN(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq, size_t ldx,
               uint32_t nx, float *y, size_t ldy, float *scratch)
{
    if (m->bits == 4)
        qm__i8mm_q4(m, n0, n1, xq, ldx, nx, y, ldy, scratch);
    else
        qm__i8mm_q8(m, n0, n1, xq, ldx, nx, y, ldy, scratch);
}
#endif /* QM__I8_FN */

#endif
