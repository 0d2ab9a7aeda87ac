/* qm_kernel_i8.h - the fast-mode (int8 activation) kernel body, included by
 * qm_kernel_i8_avx2.c, qm_kernel_i8_avxvnni.c and qm_kernel_i8_avx512vnni.c,
 * each compiled for its instruction set. Private to engine/.
 *
 * The includer defines QM__I8_FN (the entry's name), QM__I8_DOT4(w, x) and
 * QM__I8_DOT8(w, x): 8 dword lanes, lane i the exact sum over columns
 * 4i..4i+3 of u8 code times s8 input (32 columns), as vpdpbusd computes it,
 * and QM__I8_OFF8 = 0 (an offset its 8-bit dot would subtract from every
 * code; the zero-point term then uses zp - OFF8). With the same lanes and
 * this one template, every fast kernel gives the same output bits.
 *
 * Weight rows are taken 4 at a time and input rows 4 at a time; every
 * (row, input) pair owns one 8-lane f32 accumulator fed, per 32-column
 * sub-block j of weight block b, with cvt(S_j) * (scale_b * dx_j), and one
 * scalar zero-point term sum_b scale_b * (zp_b - OFF8) * xs_b; the output is
 * the fixed-order lane sum minus that term. The sequence of operations of a
 * pair never depends on which rows share a call, so the bits of an output
 * do not depend on the row count, the tiling or the threads. The codes of
 * 4 weight rows (a few KiB) are re-read from L1 for each group of 4 inputs;
 * from memory they are read once per call. */
#ifndef QM_KERNEL_I8_H
#define QM_KERNEL_I8_H

#include <immintrin.h>
#include <string.h>

#include "qm_kernels.h"

#define QM_I8_AI static inline __attribute__((always_inline))

/* 32 codes of sub-block j of a row as u8, in the prepared input order. */
QM_I8_AI __m256i qm__i8_wload(const uint8_t *row, size_t rb, size_t j, const int BITS)
{
    if (BITS == 4) {
        size_t off = 16 * j;
        __m128i b;
        if (__builtin_expect(off + 16 <= rb, 1)) {
            b = _mm_loadu_si128((const __m128i *)(row + off));
        } else {
            uint8_t tmp[16] = {0};
            if (off < rb)
                memcpy(tmp, row + off, rb - off);
            b = _mm_loadu_si128((const __m128i *)tmp);
        }
        const __m128i lo4 = _mm_set1_epi8(15);
        __m128i lo = _mm_and_si128(b, lo4);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), lo4);
        return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    }
    size_t off = 32 * j;
    if (__builtin_expect(off + 32 <= rb, 1))
        return _mm256_loadu_si256((const __m256i *)(row + off));
    uint8_t tmp[32] = {0};
    if (off < rb)
        memcpy(tmp, row + off, rb - off);
    return _mm256_loadu_si256((const __m256i *)tmp);
}

QM_I8_AI float qm__i8_hsum(__m256 v)
{
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

QM_I8_AI void qm__i8_tile(const qm__qmat *m, uint32_t n, const int NR, const float *xq,
                          size_t ldx, const int R, float *y, size_t ldy, const int BITS)
{
    const size_t kp = ((size_t)m->k + 31) / 32 * 32, nsb = kp / 32;
    const uint32_t spb = qm__i8_spb(m);
    const size_t rb = m->row_bytes;
    const int off = BITS == 8 ? QM__I8_OFF8 : 0;
    const uint8_t *row[4];
    const int8_t *xc[4];
    const float *dx[4], *xs[4];
    __m256 acc[4][4];
    float corr[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) {
        row[i] = m->w + (size_t)(n + i) * rb;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            acc[i][r] = _mm256_setzero_ps();
            corr[i][r] = 0.0f;
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const float *xr = xq + (size_t)r * ldx;
        xc[r] = (const int8_t *)xr;
        dx[r] = xr + kp / 4;
        xs[r] = dx[r] + nsb;
    }
    size_t j = 0;
    for (uint32_t b = 0; b < m->nblk; b++) {
        size_t je = j + spb < nsb ? j + spb : nsb;
        __m256 scv[4];
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            float sc = qm__qmat_scale(m, n + i, b);
            float zc = sc * (float)(qm__qmat_zp(m, n + i, b) - off);
            scv[i] = _mm256_set1_ps(sc);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                corr[i][r] += zc * xs[r][b];
        }
        if (NR == 4 && (b & 3) == 0) {
            size_t poff = j * 4 * BITS + 4 * rb;
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
                _mm_prefetch((const char *)(row[i] + poff), _MM_HINT_T0);
        }
        for (; j < je; j++) {
            __m256i xv[4];
            __m256 dxv[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                xv[r] = _mm256_loadu_si256((const __m256i *)(xc[r] + 32 * j));
                dxv[r] = _mm256_broadcast_ss(dx[r] + j);
            }
#pragma GCC unroll 4
            for (int i = 0; i < NR; i++) {
                __m256i w = qm__i8_wload(row[i], rb, j, BITS);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    __m256i s = BITS == 4 ? QM__I8_DOT4(w, xv[r]) : QM__I8_DOT8(w, xv[r]);
                    acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                                _mm256_mul_ps(scv[i], dxv[r]), acc[i][r]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            y[(size_t)r * ldy + n + i] = qm__i8_hsum(acc[i][r]) - corr[i][r];
}

#define QM__I8_ROWS(R, BITS)                                                                       \
    do {                                                                                           \
        uint32_t n = n0;                                                                           \
        for (; n + 4 <= n1; n += 4)                                                                \
            qm__i8_tile(m, n, 4, xr, ldx, R, yr, ldy, BITS);                                       \
        for (; n < n1; n++)                                                                        \
            qm__i8_tile(m, n, 1, xr, ldx, R, yr, ldy, BITS);                                       \
    } while (0)

#define QM__I8_BODY(BITS)                                                                          \
    do {                                                                                           \
        for (uint32_t r0 = 0; r0 < nx; r0 += 4) {                                                  \
            uint32_t R = nx - r0 < 4 ? nx - r0 : 4;                                                \
            const float *xr = xq + (size_t)r0 * ldx;                                               \
            float *yr = y + (size_t)r0 * ldy;                                                      \
            if (R == 4)                                                                            \
                QM__I8_ROWS(4, BITS);                                                              \
            else if (R == 3)                                                                       \
                QM__I8_ROWS(3, BITS);                                                              \
            else if (R == 2)                                                                       \
                QM__I8_ROWS(2, BITS);                                                              \
            else                                                                                   \
                QM__I8_ROWS(1, BITS);                                                              \
        }                                                                                          \
    } while (0)

static void qm__i8mm_q4(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq, size_t ldx,
                        uint32_t nx, float *y, size_t ldy)
{
    QM__I8_BODY(4);
}

static void qm__i8mm_q8(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq, size_t ldx,
                        uint32_t nx, float *y, size_t ldy)
{
    QM__I8_BODY(8);
}

void QM__I8_FN(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq, size_t ldx,
               uint32_t nx, float *y, size_t ldy)
{
    if (m->bits == 4)
        qm__i8mm_q4(m, n0, n1, xq, ldx, nx, y, ldy);
    else
        qm__i8mm_q8(m, n0, n1, xq, ldx, nx, y, ldy);
}

#endif
