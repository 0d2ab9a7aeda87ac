/* qm_kernel_avx512.c - AVX-512 GEMV (compiled with -mavx512f -mavx512bw -mavx512vl).
 *
 * Same scheme as the AVX2 GEMV with 32-column chunks and 16 lanes: 4-bit
 * chunks are prepared as [16 even columns, 16 odd columns]. Blocks of 16
 * columns and the GEMM path use the AVX2 code (its own input layout, chosen
 * by the same predicate in prep and gemv). Selected at run time only on
 * CPUs with AVX-512F/BW/VL; the development machine has none, so this file
 * is compile-tested there and must be run on an AVX-512 host to be tested. */
#include <immintrin.h>
#include <string.h>

#include "qm_kernels.h"

#define QM_AI static inline __attribute__((always_inline))

static int qm__avx512_own(const qm__qmat *m, int gemm)
{
    return !gemm && (m->nblk == 1 || m->block % 32 == 0);
}

static size_t qm__round32(size_t v)
{
    return (v + 31) & ~(size_t)31;
}

static size_t qm__avx512_x_stride(const qm__qmat *m, int gemm)
{
    if (!qm__avx512_own(m, gemm))
        return qm__avx2_x_stride(m, gemm);
    return qm__round32(m->k) + (size_t)16 * m->nblk;
}

static void qm__avx512_prep(const qm__qmat *m, int gemm, const float *x, float *xp)
{
    if (!qm__avx512_own(m, gemm)) {
        qm__avx2_prep(m, gemm, x, xp);
        return;
    }
    size_t kp = qm__round32(m->k);
    for (size_t g = 0; g < kp; g += 32) {
        for (size_t j = 0; j < 32; j++) {
            size_t c = g + j;
            float v = c < m->k ? x[c] : 0.0f;
            size_t pos = m->bits == 4 ? g + (j & 1) * 16 + j / 2 : c;
            xp[pos] = v;
        }
    }
    size_t nch = kp / 32;
    size_t cpb = m->nblk == 1 ? nch : m->block / 32;
    float *xs = xp + kp;
    for (size_t b = 0; b < m->nblk; b++) {
        __m512 s = _mm512_setzero_ps();
        size_t c0 = b * cpb, c1 = c0 + cpb < nch ? c0 + cpb : nch;
        for (size_t c = c0; c < c1; c++) {
            s = _mm512_add_ps(s, _mm512_loadu_ps(xp + 32 * c));
            s = _mm512_add_ps(s, _mm512_loadu_ps(xp + 32 * c + 16));
        }
        _mm512_storeu_ps(xs + 16 * b, s);
    }
}

QM_AI void qm__load_chunk32(const uint8_t *row, size_t row_bytes, uint32_t c, const int BITS,
                            __m512 *w0, __m512 *w1)
{
    size_t off = (size_t)c * 4 * BITS; /* 16 (4-bit) or 32 (8-bit) bytes per chunk */
    const uint8_t *p = row + off;
    uint8_t tmp[32];
    if (off + 4 * BITS > row_bytes) {
        memset(tmp, 0, sizeof tmp);
        memcpy(tmp, p, row_bytes - off);
        p = tmp;
    }
    if (BITS == 4) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        *w0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
        *w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    } else {
        *w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
        *w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    }
}

QM_AI void qm__gemv512_group(const qm__qmat *m, uint32_t n, const int NR, const float *xp,
                             size_t ldx, const int R, float *y, size_t ldy, float *scratch,
                             const int BITS)
{
    const uint32_t kp = (uint32_t)qm__round32(m->k), nch = kp / 32;
    const uint32_t cpb = m->nblk == 1 ? nch : m->block / 32;
    const uint8_t *row[4];
    const float *par[4];
    __m512 yacc[4][2];
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) {
        row[i] = m->w + (size_t)(n + i) * m->row_bytes;
        float *p = scratch + (size_t)i * 2 * m->nblk;
        for (uint32_t b = 0; b < m->nblk; b++) {
            p[b] = qm__qmat_scale(m, n + i, b);
            p[m->nblk + b] = (float)qm__qmat_zp(m, n + i, b);
        }
        par[i] = p;
#pragma GCC unroll 2
        for (int r = 0; r < R; r++)
            yacc[i][r] = _mm512_setzero_ps();
    }
    uint32_t c = 0;
    for (uint32_t b = 0; b < m->nblk; b++) {
        uint32_t ce = c + cpb < nch ? c + cpb : nch;
        __m512 a0[4][2], a1[4][2];
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++)
#pragma GCC unroll 2
            for (int r = 0; r < R; r++)
                a0[i][r] = a1[i][r] = _mm512_setzero_ps();
        for (; c < ce; c++) {
#pragma GCC unroll 4
            for (int i = 0; i < NR; i++) {
                __m512 w0, w1;
                qm__load_chunk32(row[i], m->row_bytes, c, BITS, &w0, &w1);
#pragma GCC unroll 2
                for (int r = 0; r < R; r++) {
                    const float *xv = xp + (size_t)r * ldx + 32 * (size_t)c;
                    a0[i][r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xv), a0[i][r]);
                    a1[i][r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xv + 16), a1[i][r]);
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            __m512 sc = _mm512_set1_ps(par[i][b]);
            __m512 zp = _mm512_set1_ps(par[i][m->nblk + b]);
#pragma GCC unroll 2
            for (int r = 0; r < R; r++) {
                const float *xs = xp + (size_t)r * ldx + kp + 16 * (size_t)b;
                __m512 blk = _mm512_add_ps(a0[i][r], a1[i][r]);
                blk = _mm512_fnmadd_ps(zp, _mm512_loadu_ps(xs), blk);
                yacc[i][r] = _mm512_fmadd_ps(blk, sc, yacc[i][r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) {
            /* Fixed-order reduction: 16 -> 8 -> 4 -> 2 -> 1. */
            __m512 v = yacc[i][r];
            __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
            __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            q = _mm_add_ps(q, _mm_movehl_ps(q, q));
            q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
            y[(size_t)r * ldy + n + i] = _mm_cvtss_f32(q);
        }
}

#define QM__GEMV512_BODY(BITS)                                                                     \
    do {                                                                                           \
        uint32_t r = 0;                                                                            \
        for (; r + 2 <= nx; r += 2) {                                                              \
            uint32_t n = n0;                                                                       \
            for (; n + 2 <= n1; n += 2)                                                            \
                qm__gemv512_group(m, n, 2, xp + r * ldx, ldx, 2, y + r * ldy, ldy, scratch, BITS);\
            for (; n < n1; n++)                                                                    \
                qm__gemv512_group(m, n, 1, xp + r * ldx, ldx, 2, y + r * ldy, ldy, scratch, BITS);\
        }                                                                                          \
        for (; r < nx; r++) {                                                                      \
            uint32_t n = n0;                                                                       \
            for (; n + 4 <= n1; n += 4)                                                            \
                qm__gemv512_group(m, n, 4, xp + r * ldx, ldx, 1, y + r * ldy, ldy, scratch, BITS);\
            for (; n < n1; n++)                                                                    \
                qm__gemv512_group(m, n, 1, xp + r * ldx, ldx, 1, y + r * ldy, ldy, scratch, BITS);\
        }                                                                                          \
    } while (0)

static void qm__gemv512_q4(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp,
                           size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    QM__GEMV512_BODY(4);
}

static void qm__gemv512_q8(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp,
                           size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    QM__GEMV512_BODY(8);
}

static void qm__avx512_gemv(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp,
                            size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    if (!qm__avx512_own(m, 0))
        qm__avx2_gemv(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
    else if (m->bits == 4)
        qm__gemv512_q4(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
    else
        qm__gemv512_q8(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
}

const qm__kernel qm__kernel_avx512 = {
    .name = "avx512",
    .x_stride = qm__avx512_x_stride,
    .prep = qm__avx512_prep,
    .gemv = qm__avx512_gemv,
    .gemm = qm__avx2_gemm,
    .gemm_row_pad = 6, /* the AVX2 GEMM's QM__GEMM_MR */
};
