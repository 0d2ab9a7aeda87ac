/* qm_kernel_i8_avx512vnni.c - fast-mode kernel on AVX-512 VNNI (compiled
 * with -mavx512f -mavx512vl -mavx512vnni): one 512-bit vpdpbusd covers two
 * 32-column sub-blocks (u8 codes x s8 inputs summed by 4 into s32 lanes,
 * exact); its low half is accumulator A (even sub-blocks) and its high half
 * B (odd ones) of the canonical order in qm_kernel_i8.h, so the output bits
 * are those of the 256-bit kernels. 4 weight rows x 4 inputs per pass. */
#include <immintrin.h>

#include "qm_kernel_i8.h"

/* Sub-blocks j, j + 1 of a row as 64 u8 codes [j | j + 1] in prepared order. */
QM_I8_AI __m512i qm__i8_wpair512(const uint8_t *row, size_t rb, size_t j, const int BITS)
{
    uint8_t tmp[64];
    if (BITS == 4) {
        __m256i v = _mm256_loadu_si256((const __m256i *)qm__i8_bytes(row, rb, 16 * j, 32, tmp));
        const __m256i lo4 = _mm256_set1_epi8(15);
        __m256i lo = _mm256_and_si256(v, lo4);                        /* [lo_j | lo_j+1] */
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);  /* [hi_j | hi_j+1] */
        __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)); /* lo_j hi_j lo_j+1 hi_j+1 */
    }
    return _mm512_loadu_si512((const void *)qm__i8_bytes(row, rb, 32 * j, 64, tmp));
}

QM_I8_AI void qm__i8_tile512(const qm__qmat *m, uint32_t n, const int NR, const float *xq,
                             size_t ldx, const int R, float *y, size_t ldy, float *scratch,
                             const int BITS)
{
    const size_t nsb = qm__i8_nsb(m);
    const uint32_t spb = qm__i8_spb(m), nblk = m->nblk;
    const int pair_same = nblk == 1 || spb % 2 == 0; /* j, j + 1 always in one block */
    const size_t rb = m->row_bytes;
    qm__i8_tile_ptrs p;
    qm__i8_tile_setup(m, n, NR, xq, ldx, R, scratch, &p);
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[i][r] = _mm512_setzero_ps();
    for (size_t j = 0; j < nsb; j += 2) {
        qm__i8_prefetch(&p, NR, j, BITS, rb);
        __m512i xv[4];
        __m512 dv[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            xv[r] = _mm512_loadu_si512((const void *)(p.xc[r] + 32 * j));
            dv[r] = _mm512_loadu_ps(p.dx[r] + 8 * j);
        }
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            __m512i w = qm__i8_wpair512(p.row[i], rb, j, BITS);
            __m512 sv;
            if (pair_same) {
                sv = _mm512_set1_ps(qm__i8_sc(p.sc[i], j, spb, nblk));
            } else {
                __m256 s0 = _mm256_set1_ps(qm__i8_sc(p.sc[i], j, spb, nblk));
                __m256 s1 = _mm256_set1_ps(qm__i8_sc(p.sc[i], j + 1, spb, nblk));
                sv = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(s0)),
                                                         _mm256_castps_pd(s1), 1));
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv[r]);
                acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(sv, dv[r]),
                                            acc[i][r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m512 v = acc[i][r];
            __m256 ab = _mm256_add_ps(_mm512_castps512_ps256(v),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
            y[(size_t)r * ldy + n + i] = qm__i8_hsum(ab) - qm__i8_corr(m, p.sc[i], p.zsc[i], p.xs[r]);
        }
}

#define QM__I8_ROWS512(R, BITS)                                                                    \
    do {                                                                                           \
        uint32_t n = n0;                                                                           \
        for (; n + 4 <= n1; n += 4)                                                                \
            qm__i8_tile512(m, n, 4, xr, ldx, R, yr, ldy, scratch, BITS);                           \
        for (; n < n1; n++)                                                                        \
            qm__i8_tile512(m, n, 1, xr, ldx, R, yr, ldy, scratch, BITS);                           \
    } while (0)

#define QM__I8_BODY512(BITS)                                                                       \
    do {                                                                                           \
        for (uint32_t r0 = 0; r0 < nx; r0 += 4) {                                                  \
            uint32_t R = nx - r0 < 4 ? nx - r0 : 4;                                                \
            const float *xr = xq + (size_t)r0 * ldx;                                               \
            float *yr = y + (size_t)r0 * ldy;                                                      \
            if (R == 4)                                                                            \
                QM__I8_ROWS512(4, BITS);                                                           \
            else if (R == 3)                                                                       \
                QM__I8_ROWS512(3, BITS);                                                           \
            else if (R == 2)                                                                       \
                QM__I8_ROWS512(2, BITS);                                                           \
            else                                                                                   \
                QM__I8_ROWS512(1, BITS);                                                           \
        }                                                                                          \
    } while (0)

static void qm__i8mm512_q4(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                           size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    QM__I8_BODY512(4);
}

static void qm__i8mm512_q8(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                           size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    QM__I8_BODY512(8);
}

void qm__i8mm_avx512vnni(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                         size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    if (m->bits == 4)
        qm__i8mm512_q4(m, n0, n1, xq, ldx, nx, y, ldy, scratch);
    else
        qm__i8mm512_q8(m, n0, n1, xq, ldx, nx, y, ldy, scratch);
}
