/* qm_kernel_avx512.c - AVX-512 GEMV (compiled with -mavx512f -mavx512bw -mavx512vl).
 *
 * Decode (jobs of 1..4 input rows) dequantises each weight exactly as the
 * scalar specification does, w = scale * (q - zp), and multiplies it by
 * every input row while it is in a register: the weights are read once per
 * call whatever the row count. 4-bit codes go through a per-block table:
 * lut[q] = (q - zp) * scale for the 16 codes is one 16-lane vector, built
 * once per (row, block), and vpermps turns 16 codes (zero-extended to
 * dwords) into 16 dequantised weights. Each 32-column chunk of a 4-bit row
 * is 16 bytes: low nibbles are the even columns, high nibbles the odd ones,
 * so the prepared input stores every 32 columns as [16 even, 16 odd].
 * 8-bit rows convert the codes and use (q - zp) * scale directly.
 * Accumulation is f32 FMA per lane in column order within a lane, then a
 * fixed 16 -> 1 reduction: the order depends only on the geometry.
 * Blocks of 16 columns and the GEMM path use the AVX2 code (its own input
 * layout, chosen by the same predicate in prep and gemv). */
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
    return qm__round32(m->k);
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
}

/* Scale of (row n, block b); FAST: f32 scales. */
QM_AI float qm__s512(const qm__qmat *m, uint32_t n, uint32_t b, const int FAST)
{
    size_t i = (size_t)n * m->nblk + b;
    if (FAST || m->scale_dtype == QM_DTYPE_F32) {
        float f;
        memcpy(&f, (const uint8_t *)m->scales + 4 * i, 4);
        return f;
    }
    if (m->scale_dtype == QM_DTYPE_F16) {
        uint16_t h;
        memcpy(&h, (const uint8_t *)m->scales + 2 * i, 2);
        return _cvtsh_ss(h);
    }
    return qm__load_float(m->scales, m->scale_dtype, i);
}

/* Zero point of (row n, block b) as f32; FAST: no zero-point tensor. */
QM_AI float qm__z512(const qm__qmat *m, uint32_t n, uint32_t b, const int BITS, const int FAST)
{
    if (FAST || !m->zp)
        return (float)(1 << (BITS - 1));
    return (float)qm__qmat_zp(m, n, b);
}

/* The 16 bytes of chunk c of a row; bytes past the row read as zero (their
 * columns meet zero inputs, and the table of code 0 is finite). */
QM_AI __m128i qm__chunk_bytes(const uint8_t *row, size_t row_bytes, uint32_t c, const int BITS,
                              int half)
{
    size_t off = (size_t)c * 4 * BITS + (size_t)half * 16;
    if (__builtin_expect(off + 16 <= row_bytes, 1))
        return _mm_loadu_si128((const __m128i *)(row + off));
    if (off >= row_bytes)
        return _mm_setzero_si128();
    __mmask16 k = (__mmask16)((1u << (row_bytes - off)) - 1u);
    return _mm_maskz_loadu_epi8(k, row + off);
}

/* NR weight rows (n..n+NR-1) x R input rows, R <= 4, NR in {1, 4}. */
QM_AI void qm__gemv512(const qm__qmat *m, uint32_t n, const int NR, const float *xp, size_t ldx,
                       const int R, float *y, size_t ldy, const int BITS, const int FAST)
{
    const uint32_t kp = (uint32_t)qm__round32(m->k), nch = kp / 32;
    const uint32_t cpb = m->nblk == 1 ? nch : m->block / 32;
    const size_t rb = m->row_bytes;
    const uint8_t *row[4];
    __m512 acc[4][4];
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lo4 = _mm512_set1_epi32(15);
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) {
        row[i] = m->w + (size_t)(n + i) * rb;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[i][r] = _mm512_setzero_ps();
    }
    uint32_t c = 0;
    for (uint32_t b = 0; b < m->nblk; b++) {
        uint32_t ce = c + cpb < nch ? c + cpb : nch;
        __m512 lut[4], zpv[4], scv[4];
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            scv[i] = _mm512_set1_ps(qm__s512(m, n + i, b, FAST));
            zpv[i] = _mm512_set1_ps(qm__z512(m, n + i, b, BITS, FAST));
            if (BITS == 4)
                lut[i] = _mm512_mul_ps(scv[i], _mm512_sub_ps(iota, zpv[i]));
            else
                lut[i] = zpv[i];
        }
        if (NR == 4 && (b & 1) == 0) {
            /* The next 4 rows (contiguous after these), same offset. */
            size_t off = (size_t)c * 4 * BITS + 4 * rb;
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
                _mm_prefetch((const char *)(row[i] + off), _MM_HINT_T0);
        }
        for (; c < ce; c++) {
#pragma GCC unroll 4
            for (int i = 0; i < NR; i++) {
                __m512 w0, w1;
                if (BITS == 4) {
                    __m512i v = _mm512_cvtepu8_epi32(qm__chunk_bytes(row[i], rb, c, 4, 0));
                    w0 = _mm512_permutexvar_ps(_mm512_and_si512(v, lo4), lut[i]);
                    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut[i]);
                } else {
                    __m512 q0 = _mm512_cvtepi32_ps(
                        _mm512_cvtepu8_epi32(qm__chunk_bytes(row[i], rb, c, 8, 0)));
                    __m512 q1 = _mm512_cvtepi32_ps(
                        _mm512_cvtepu8_epi32(qm__chunk_bytes(row[i], rb, c, 8, 1)));
                    w0 = _mm512_mul_ps(scv[i], _mm512_sub_ps(q0, zpv[i]));
                    w1 = _mm512_mul_ps(scv[i], _mm512_sub_ps(q1, zpv[i]));
                }
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const float *xv = xp + (size_t)r * ldx + 32 * (size_t)c;
                    acc[i][r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xv), acc[i][r]);
                    acc[i][r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xv + 16), acc[i][r]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            /* Fixed-order reduction: 16 -> 8 -> 4 -> 2 -> 1. */
            __m512 v = acc[i][r];
            __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
            __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            q = _mm_add_ps(q, _mm_movehl_ps(q, q));
            q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
            y[(size_t)r * ldy + n + i] = _mm_cvtss_f32(q);
        }
}

/* One row count R: groups of 4 weight rows, then single rows. */
#define QM__GEMV512_R(R, BITS, FAST)                                                               \
    do {                                                                                           \
        uint32_t n = n0;                                                                           \
        for (; n + 4 <= n1; n += 4)                                                                \
            qm__gemv512(m, n, 4, xp, ldx, R, y, ldy, BITS, FAST);                                  \
        for (; n < n1; n++)                                                                        \
            qm__gemv512(m, n, 1, xp, ldx, R, y, ldy, BITS, FAST);                                  \
    } while (0)

#define QM__GEMV512_FN(NAME, BITS, FAST)                                                           \
    static void NAME(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp, size_t ldx,    \
                     uint32_t nx, float *y, size_t ldy)                                            \
    {                                                                                              \
        /* All input rows in one pass (at most 4 per call: QM__GEMV_MAX_ROWS). */                  \
        for (uint32_t r0 = 0; r0 < nx; r0 += 4) {                                                  \
            uint32_t R = nx - r0 < 4 ? nx - r0 : 4;                                                \
            const float *xq = xp + (size_t)r0 * ldx;                                               \
            float *yq = y + (size_t)r0 * ldy;                                                      \
            {                                                                                      \
                const float *xp_ = xq;                                                             \
                float *y_ = yq;                                                                    \
                {                                                                                  \
                    const float *xp = xp_;                                                         \
                    float *y = y_;                                                                 \
                    if (R == 1)                                                                    \
                        QM__GEMV512_R(1, BITS, FAST);                                              \
                    else if (R == 2)                                                               \
                        QM__GEMV512_R(2, BITS, FAST);                                              \
                    else if (R == 3)                                                               \
                        QM__GEMV512_R(3, BITS, FAST);                                              \
                    else                                                                           \
                        QM__GEMV512_R(4, BITS, FAST);                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

QM__GEMV512_FN(qm__gemv512_q4f, 4, 1)
QM__GEMV512_FN(qm__gemv512_q4g, 4, 0)
QM__GEMV512_FN(qm__gemv512_q8f, 8, 1)
QM__GEMV512_FN(qm__gemv512_q8g, 8, 0)

static void qm__avx512_gemv(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp,
                            size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    int fast = m->scale_dtype == QM_DTYPE_F32 && !m->zp;
    if (!qm__avx512_own(m, 0))
        qm__avx2_gemv(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
    else if (m->bits == 4)
        (fast ? qm__gemv512_q4f : qm__gemv512_q4g)(m, n0, n1, xp, ldx, nx, y, ldy);
    else
        (fast ? qm__gemv512_q8f : qm__gemv512_q8g)(m, n0, n1, xp, ldx, nx, y, ldy);
}

const qm__kernel qm__kernel_avx512 = {
    .name = "avx512",
    .x_stride = qm__avx512_x_stride,
    .prep = qm__avx512_prep,
    .gemv = qm__avx512_gemv,
    .gemm = qm__avx2_gemm,
    .gemm_row_pad = 6, /* the AVX2 GEMM's QM__GEMM_MR */
};
