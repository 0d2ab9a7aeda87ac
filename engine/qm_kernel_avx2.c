/* qm_kernel_avx2.c - AVX2+FMA quantised matmul (compiled with -mavx2 -mfma -mf16c).
 *
 * Input rows are prepared once per job: for 4-bit weights each group of 16
 * columns is reordered to [even columns, odd columns] so that the low and
 * high nibbles of 8 packed bytes multiply contiguous x vectors without a
 * shuffle; 8-bit weights keep the natural order. The GEMV path also stores,
 * per block, the lane-wise sum of x, so the zero point is applied once per
 * block: partial = sum q*x - zp * sum x, then y += scale * partial. The GEMM
 * path dequantises a 16 x 256 tile of W to f32 once (w = (q - zp) * scale)
 * and reuses it for every input row. */
#include <immintrin.h>
#include <string.h>

#include "qm_kernels.h"

#define QM_AI static inline __attribute__((always_inline))

static size_t qm__round16(size_t v)
{
    return (v + 15) & ~(size_t)15;
}

size_t qm__avx2_x_stride(const qm__qmat *m, int gemm)
{
    size_t kp = qm__round16(m->k);
    return gemm ? kp : kp + (size_t)8 * m->nblk;
}

void qm__avx2_prep(const qm__qmat *m, int gemm, const float *x, float *xp)
{
    size_t kp = qm__round16(m->k);
    for (size_t g = 0; g < kp; g += 16) {
        for (size_t j = 0; j < 16; j++) {
            size_t c = g + j;
            float v = c < m->k ? x[c] : 0.0f;
            size_t pos = m->bits == 4 ? g + (j & 1) * 8 + j / 2 : c;
            xp[pos] = v;
        }
    }
    if (gemm)
        return;
    /* Lane-wise sum of both halves of every 16-column chunk of each block. */
    size_t nch = kp / 16;
    size_t cpb = m->nblk == 1 ? nch : m->block / 16;
    float *xs = xp + kp;
    for (size_t b = 0; b < m->nblk; b++) {
        __m256 s = _mm256_setzero_ps();
        size_t c0 = b * cpb, c1 = c0 + cpb < nch ? c0 + cpb : nch;
        for (size_t c = c0; c < c1; c++) {
            s = _mm256_add_ps(s, _mm256_loadu_ps(xp + 16 * c));
            s = _mm256_add_ps(s, _mm256_loadu_ps(xp + 16 * c + 8));
        }
        _mm256_storeu_ps(xs + 8 * b, s);
    }
}

QM_AI float qm__hsum8(__m256 v)
{
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* Codes of chunk c (16 columns) of a row, as two f32 vectors in prepared order. */
QM_AI void qm__load_chunk(const uint8_t *row, size_t row_bytes, uint32_t c, const int BITS,
                          __m256 *w0, __m256 *w1)
{
    size_t off = (size_t)c * 2 * BITS; /* bytes per chunk: 8 (4-bit) or 16 (8-bit) */
    const uint8_t *p = row + off;
    uint8_t tmp[16];
    if (off + 2 * BITS > row_bytes) { /* row tail: never read past the row */
        memset(tmp, 0, sizeof tmp);
        memcpy(tmp, p, row_bytes - off);
        p = tmp;
    }
    if (BITS == 4) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
        *w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
        *w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    } else {
        *w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
        *w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
    }
}

/* Per-row scales and zero points as floats, in scratch: [scales nblk][zps nblk]. */
static void qm__row_params(const qm__qmat *m, uint32_t n, float *out)
{
    if (m->scale_dtype == QM_DTYPE_F32) {
        memcpy(out, (const uint8_t *)m->scales + (size_t)n * m->nblk * 4, (size_t)m->nblk * 4);
    } else {
        for (uint32_t b = 0; b < m->nblk; b++)
            out[b] = qm__qmat_scale(m, n, b);
    }
    for (uint32_t b = 0; b < m->nblk; b++)
        out[m->nblk + b] = (float)qm__qmat_zp(m, n, b);
}

/* NR weight rows x R input rows. Each (row, input) pair runs the same
 * operation sequence whatever NR and R are: grouping only interleaves
 * independent chains, so results never depend on the grouping. */
QM_AI void qm__gemv_group(const qm__qmat *m, uint32_t n, const int NR, const float *xp,
                          size_t ldx, const int R, float *y, size_t ldy, float *scratch,
                          const int BITS)
{
    const uint32_t kp = (uint32_t)qm__round16(m->k), nch = kp / 16;
    const uint32_t cpb = m->nblk == 1 ? nch : m->block / 16;
    const uint8_t *row[4];
    const float *par[4];
    __m256 yacc[4][2];
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) {
        row[i] = m->w + (size_t)(n + i) * m->row_bytes;
        float *p = scratch + (size_t)i * 2 * m->nblk;
        qm__row_params(m, n + i, p);
        par[i] = p;
#pragma GCC unroll 2
        for (int r = 0; r < R; r++)
            yacc[i][r] = _mm256_setzero_ps();
    }
    uint32_t c = 0;
    for (uint32_t b = 0; b < m->nblk; b++) {
        uint32_t ce = c + cpb < nch ? c + cpb : nch;
        __m256 a0[4][2], a1[4][2];
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++)
#pragma GCC unroll 2
            for (int r = 0; r < R; r++)
                a0[i][r] = a1[i][r] = _mm256_setzero_ps();
        for (; c < ce; c++) {
#pragma GCC unroll 4
            for (int i = 0; i < NR; i++) {
                __m256 w0, w1;
                qm__load_chunk(row[i], m->row_bytes, c, BITS, &w0, &w1);
#pragma GCC unroll 2
                for (int r = 0; r < R; r++) {
                    const float *xv = xp + (size_t)r * ldx + 16 * (size_t)c;
                    a0[i][r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xv), a0[i][r]);
                    a1[i][r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xv + 8), a1[i][r]);
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            __m256 sc = _mm256_set1_ps(par[i][b]);
            __m256 zp = _mm256_set1_ps(par[i][m->nblk + b]);
#pragma GCC unroll 2
            for (int r = 0; r < R; r++) {
                const float *xs = xp + (size_t)r * ldx + kp + 8 * (size_t)b;
                __m256 blk = _mm256_add_ps(a0[i][r], a1[i][r]);
                blk = _mm256_fnmadd_ps(zp, _mm256_loadu_ps(xs), blk);
                yacc[i][r] = _mm256_fmadd_ps(blk, sc, yacc[i][r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 2
        for (int r = 0; r < R; r++)
            y[(size_t)r * ldy + n + i] = qm__hsum8(yacc[i][r]);
}

#define QM__GEMV_BODY(BITS)                                                                        \
    do {                                                                                           \
        uint32_t r = 0;                                                                            \
        for (; r + 2 <= nx; r += 2) {                                                              \
            uint32_t n = n0;                                                                       \
            for (; n + 2 <= n1; n += 2)                                                            \
                qm__gemv_group(m, n, 2, xp + r * ldx, ldx, 2, y + r * ldy, ldy, scratch, BITS);   \
            for (; n < n1; n++)                                                                    \
                qm__gemv_group(m, n, 1, xp + r * ldx, ldx, 2, y + r * ldy, ldy, scratch, BITS);   \
        }                                                                                          \
        for (; r < nx; r++) {                                                                      \
            uint32_t n = n0;                                                                       \
            for (; n + 4 <= n1; n += 4)                                                            \
                qm__gemv_group(m, n, 4, xp + r * ldx, ldx, 1, y + r * ldy, ldy, scratch, BITS);   \
            for (; n < n1; n++)                                                                    \
                qm__gemv_group(m, n, 1, xp + r * ldx, ldx, 1, y + r * ldy, ldy, scratch, BITS);   \
        }                                                                                          \
    } while (0)

static void qm__gemv_q4(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp, size_t ldx,
                        uint32_t nx, float *y, size_t ldy, float *scratch)
{
    QM__GEMV_BODY(4);
}

static void qm__gemv_q8(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp, size_t ldx,
                        uint32_t nx, float *y, size_t ldy, float *scratch)
{
    QM__GEMV_BODY(8);
}

void qm__avx2_gemv(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp, size_t ldx,
                   uint32_t nx, float *y, size_t ldy, float *scratch)
{
    if (m->bits == 4)
        qm__gemv_q4(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
    else
        qm__gemv_q8(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
}

/* Dequantises rows [n0, n1) x prepared columns [kt0, kt0 + len) into
 * tile[QM__TILE_ROWS][QM__GEMM_KT]; rows past n1 become zeros. */
static void qm__dequant_tile(const qm__qmat *m, uint32_t n0, uint32_t n1, uint32_t kt0,
                             uint32_t len, float *tile)
{
    const int bits = (int)m->bits;
    for (uint32_t i = 0; i < QM__TILE_ROWS; i++) {
        float *t = tile + (size_t)i * QM__GEMM_KT;
        uint32_t n = n0 + i;
        if (n >= n1) {
            memset(t, 0, (size_t)len * sizeof(float));
            continue;
        }
        const uint8_t *row = m->w + (size_t)n * m->row_bytes;
        uint32_t bprev = UINT32_MAX;
        __m256 sc = _mm256_setzero_ps(), zp = _mm256_setzero_ps();
        for (uint32_t cc = 0; cc < len; cc += 16) {
            uint32_t c = (kt0 + cc) / 16;
            uint32_t b = m->nblk == 1 ? 0 : (kt0 + cc) / m->block;
            if (b != bprev) {
                sc = _mm256_set1_ps(qm__qmat_scale(m, n, b));
                zp = _mm256_set1_ps((float)qm__qmat_zp(m, n, b));
                bprev = b;
            }
            __m256 w0, w1;
            if (bits == 4)
                qm__load_chunk(row, m->row_bytes, c, 4, &w0, &w1);
            else
                qm__load_chunk(row, m->row_bytes, c, 8, &w0, &w1);
            _mm256_storeu_ps(t + cc, _mm256_mul_ps(_mm256_sub_ps(w0, zp), sc));
            _mm256_storeu_ps(t + cc + 8, _mm256_mul_ps(_mm256_sub_ps(w1, zp), sc));
        }
    }
}

/* 4 input rows x 2 tile rows over one tile; sums added into y (or stored
 * for the first tile). */
QM_AI void qm__gemm_micro(const float *tile, uint32_t i, const float *xp, size_t ldx,
                          uint32_t len, float *part)
{
    const float *w0p = tile + (size_t)i * QM__GEMM_KT, *w1p = w0p + QM__GEMM_KT;
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (uint32_t cc = 0; cc < len; cc += 8) {
        __m256 w0 = _mm256_loadu_ps(w0p + cc), w1 = _mm256_loadu_ps(w1p + cc);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            __m256 xv = _mm256_loadu_ps(xp + (size_t)r * ldx + cc);
            acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
        part[2 * r] = qm__hsum8(acc[r][0]);
        part[2 * r + 1] = qm__hsum8(acc[r][1]);
    }
}

void qm__avx2_gemm(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp, size_t ldx,
                   uint32_t nx, float *y, size_t ldy, float *scratch)
{
    const uint32_t kp = (uint32_t)qm__round16(m->k);
    const uint32_t nrows = n1 - n0;
    float *tile = scratch;
    for (uint32_t kt0 = 0; kt0 < kp; kt0 += QM__GEMM_KT) {
        uint32_t len = kp - kt0 < QM__GEMM_KT ? kp - kt0 : QM__GEMM_KT;
        qm__dequant_tile(m, n0, n1, kt0, len, tile);
        for (uint32_t r0 = 0; r0 < nx; r0 += 4) {
            for (uint32_t i = 0; i < nrows; i += 2) {
                float part[8];
                qm__gemm_micro(tile, i, xp + (size_t)r0 * ldx + kt0, ldx, len, part);
                for (uint32_t r = 0; r < 4 && r0 + r < nx; r++) {
                    for (uint32_t j = 0; j < 2 && i + j < nrows; j++) {
                        float *out = y + (size_t)(r0 + r) * ldy + n0 + i + j;
                        *out = kt0 == 0 ? part[2 * r + j] : *out + part[2 * r + j];
                    }
                }
            }
        }
    }
}

const qm__kernel qm__kernel_avx2 = {
    .name = "avx2",
    .x_stride = qm__avx2_x_stride,
    .prep = qm__avx2_prep,
    .gemv = qm__avx2_gemv,
    .gemm = qm__avx2_gemm,
    .gemm_row_pad = 4,
};
