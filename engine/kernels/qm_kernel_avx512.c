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
 * Accumulation is f32 FMA per lane in column order within a lane, then a
 * fixed 16 -> 8 -> 4 -> 2 -> 1 reduction: the order depends only on the
 * geometry. This is the 4-bit GEMV's canonical order (qm__q4_canon): the
 * AVX2 GEMV runs it on two 8-lane halves and gives the same bits, so the
 * choice between the two is measured (qm_kernel_select.c). 4-bit blocks
 * of 16 columns use the AVX2 GEMV (the same predicate picks the input
 * layout in qm__avx2_prep and the path here).
 *
 * 8-bit rows run the AVX2 GEMV's own order with 16 lanes (qm__gemv512_q8):
 * one 16-column chunk is one vector [a0 | a1] of the AVX2 kernel's two
 * accumulators, the block fold and the final reduction are its operations
 * on 8 lanes, so the 8-bit GEMVs of both ISAs give the same bits and the
 * faster one may be chosen per CPU by measurement.
 *
 * Prefill (GEMM) is qm_gemm_packed_avx512.c: the AVX2 GEMM's order, so
 * the same bits, from a panel built straight from the codes. */
#include <immintrin.h>
#include <string.h>

#include "qm_kernels.h"

#define QM_AI static inline __attribute__((always_inline))

static size_t qm__round32(size_t v)
{
    return (v + 31) & ~(size_t)31;
}

/* Scale of (row n, block b); FAST: f32 scales. */
QM_AI float qm__s512(const qm__qmat *m, uint32_t n, uint32_t b, const int FAST)
{
    if (FAST) {
        float f;
        memcpy(&f, (const uint8_t *)m->scales + 4 * ((size_t)n * m->nblk + b), 4);
        return f;
    }
    return qm__qmat_scale_f16c(m, n, b);
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

/* Asks for the next 4 weight rows (contiguous after row[0..3]); off includes the 4 rows. */
QM_AI void qm__prefetch_next4(const uint8_t *const row[4], size_t off)
{
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        _mm_prefetch((const char *)(row[i] + off), QM__PF_HINT);
}

/* The AVX2 GEMV's reduction (qm__hsum8): 8 -> 4 -> 2 -> 1. */
QM_AI float qm__hsum8_512(__m256 h)
{
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
}

/* One 32-column chunk of NR weight rows x R input rows: the 16 codes of a
 * row's chunk zero-extended to dwords, vpermps on the low nibble (it reads
 * only bits 3:0 of each index, so no mask) and on the high nibble, one FMA
 * each per input row. row[i] points at the chunk's 16 bytes (BYTES: whole)
 * or at the row (a tail chunk through qm__chunk_bytes). */
QM_AI void qm__q4_chunk(const uint8_t *const row[4], const int NR, const __m512 lut[4],
                        const float *xv, size_t ldx, const int R, __m512 acc[4][4],
                        int whole, size_t rb, uint32_t c)
{
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) {
        __m128i b = whole ? _mm_loadu_si128((const __m128i *)row[i])
                          : qm__chunk_bytes(row[i], rb, c, 4, 0);
        __m512i v = _mm512_cvtepu8_epi32(b);
        __m512 w0 = _mm512_permutexvar_ps(v, lut[i]);
        __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut[i]);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const float *x = xv + (size_t)r * ldx;
            acc[i][r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), acc[i][r]);
            acc[i][r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), acc[i][r]);
        }
    }
}

/* The tables of block b of NR rows: lut[q] = (q - zp) * scale, 16 lanes.
 * FAST (f32 scales, no zero points): the scale through the row's scale
 * pointer and the constant iota - 8, the same product. */
QM_AI void qm__q4_luts(const qm__qmat *m, uint32_t n, const int NR, uint32_t b,
                       const float *const srow[4], __m512 centred, __m512 lut[4], const int FAST)
{
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) {
        if (FAST) {
            float s;
            memcpy(&s, srow[i] + b, 4);
            lut[i] = _mm512_mul_ps(_mm512_set1_ps(s), centred);
        } else {
            lut[i] = _mm512_mul_ps(
                _mm512_set1_ps(qm__s512(m, n + i, b, FAST)),
                _mm512_sub_ps(iota, _mm512_set1_ps(qm__z512(m, n + i, b, 4, FAST))));
        }
    }
}

/* Chunk c whole (its 16 bytes inside each row) at cur, then cur and xv
 * stepped past it. */
QM_AI void qm__q4_whole(const uint8_t *cur[4], const int NR, const __m512 lut[4],
                        const float **xv, size_t ldx, const int R, __m512 acc[4][4], size_t rb,
                        uint32_t c)
{
    qm__q4_chunk(cur, NR, lut, *xv, ldx, R, acc, 1, rb, c);
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
        cur[i] += 16;
    *xv += 32;
}

/* NR weight rows (n..n+NR-1) x R input rows, R <= 4, NR in {1, 4}. The
 * chunks that lie whole inside the row run with pointers stepped 16 bytes
 * (and 32 input floats) at a time and, for f32 scales, the scales read
 * through a pointer per row; the last chunk of a row whose bytes end short
 * of it goes through qm__chunk_bytes. Same operations per lane, in the same
 * order, as before: only the address arithmetic differs. */
QM_AI void qm__gemv512(const qm__qmat *m, uint32_t n, const int NR, const float *xp, size_t ldx,
                       const int R, float *y, size_t ldy, const int FAST)
{
    const uint32_t kp = (uint32_t)qm__round32(m->k), nch = kp / 32;
    const uint32_t cpb = m->nblk == 1 ? nch : m->block / 32;
    const size_t rb = m->row_bytes;
    /* Chunks whose 16 bytes all lie inside the row. */
    const uint32_t nwhole = rb / 16 < nch ? (uint32_t)(rb / 16) : nch;
    const uint8_t *row[4], *cur[4];
    const float *srow[4];
    __m512 acc[4][4];
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    /* FAST: no zero points, so every table is scale * (iota - 8). */
    const __m512 centred = _mm512_sub_ps(iota, _mm512_set1_ps(8.0f));
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) {
        row[i] = m->w + (size_t)(n + i) * rb;
        cur[i] = row[i];
        srow[i] = FAST ? (const float *)m->scales + (size_t)(n + i) * m->nblk : NULL;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[i][r] = _mm512_setzero_ps();
    }
    uint32_t c = 0;
    const float *xv = xp;
    __m512 lut[4];
    if (cpb == 1) {
        /* Blocks of 32 columns (the usual layout): one chunk per block, in
         * one loop with no per-block bookkeeping. */
        for (; c < nwhole; c++) {
            qm__q4_luts(m, n, NR, c, srow, centred, lut, FAST);
            if (NR == 4 && (c & 1) == 0)
                qm__prefetch_next4(row, (size_t)c * 16 + 4 * rb);
            qm__q4_whole(cur, NR, lut, &xv, ldx, R, acc, rb, c);
        }
        for (; c < nch; c++) {
            qm__q4_luts(m, n, NR, c, srow, centred, lut, FAST);
            qm__q4_chunk(row, NR, lut, xv, ldx, R, acc, 0, rb, c);
            xv += 32;
        }
    } else {
        for (uint32_t b = 0; b < m->nblk; b++) {
            uint32_t ce = c + cpb < nch ? c + cpb : nch;
            qm__q4_luts(m, n, NR, b, srow, centred, lut, FAST);
            if (NR == 4 && (b & 1) == 0)
                qm__prefetch_next4(row, (size_t)c * 16 + 4 * rb);
            uint32_t cw = ce < nwhole ? ce : nwhole;
            for (; c < cw; c++)
                qm__q4_whole(cur, NR, lut, &xv, ldx, R, acc, rb, c);
            for (; c < ce; c++) {
                qm__q4_chunk(row, NR, lut, xv, ldx, R, acc, 0, rb, c);
                xv += 32;
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
            y[(size_t)r * ldy + n + i] = qm__hsum8_512(h);
        }
}


/* 8-bit GEMV in the AVX2 GEMV's order (qm_kernel_avx2.c, input rows
 * prepared by qm__avx2_prep): NR weight rows x R input rows; each (row,
 * input) pair runs exactly the AVX2 operation sequence
 *   per chunk   [a0 | a1] += w * x        (one 16-lane FMA = its two 8-lane FMAs)
 *   per block   blk = (a0 + a1) - zp * xsum_block; y += blk * scale
 *   at the end  the same 8 -> 4 -> 2 -> 1 reduction,
 * so both give the same bits. Tail bytes past the row read as zero, as there. */
QM_AI void qm__gemv512_avx2order(const qm__qmat *m, uint32_t n, const int NR, const float *xp,
                                 size_t ldx, const int R, float *y, size_t ldy, const int FAST)
{
    const uint32_t kp = (m->k + 15) & ~15u, nch = kp / 16;
    const uint32_t cpb = m->nblk == 1 ? nch : m->block / 16;
    const size_t rb = m->row_bytes;
    const uint8_t *row[4];
    __m512 acc[4][4];
    __m256 yv[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) {
        row[i] = m->w + (size_t)(n + i) * rb;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            acc[i][r] = _mm512_setzero_ps();
            yv[i][r] = _mm256_setzero_ps();
        }
    }
    uint32_t c = 0;
    for (uint32_t b = 0; b < m->nblk; b++) {
        uint32_t ce = c + cpb < nch ? c + cpb : nch;
        if (NR == 4 && (b & 3) == 0)
            qm__prefetch_next4(row, (size_t)c * 16 + 4 * rb);
        for (; c < ce; c++) {
#pragma GCC unroll 4
            for (int i = 0; i < NR; i++) {
                __m512 w = _mm512_cvtepi32_ps(
                    _mm512_cvtepu8_epi32(qm__chunk_bytes(row[i], rb, c >> 1, 8, (int)(c & 1))));
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    acc[i][r] = _mm512_fmadd_ps(
                        w, _mm512_loadu_ps(xp + (size_t)r * ldx + 16 * (size_t)c), acc[i][r]);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            __m256 scv = _mm256_set1_ps(qm__s512(m, n + i, b, FAST));
            __m256 zpv = _mm256_set1_ps(qm__z512(m, n + i, b, 8, FAST));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m512 a = acc[i][r];
                __m256 blk = _mm256_add_ps(
                    _mm512_castps512_ps256(a),
                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
                blk = _mm256_fnmadd_ps(
                    zpv, _mm256_loadu_ps(xp + (size_t)r * ldx + kp + 8 * (size_t)b), blk);
                yv[i][r] = _mm256_fmadd_ps(blk, scv, yv[i][r]);
                acc[i][r] = _mm512_setzero_ps();
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            y[(size_t)r * ldy + n + i] = qm__hsum8_512(yv[i][r]);
        }
}

/* R input rows through KERNEL: weight rows NR at a time, then single rows. */
#define QM__GEMV512_R(KERNEL, R, NR, FAST)                                                         \
    do {                                                                                           \
        uint32_t n = n0;                                                                           \
        for (; n + (NR) <= n1; n += (NR))                                                          \
            KERNEL(m, n, NR, xq, ldx, R, yq, ldy, FAST);                                           \
        for (; n < n1; n++)                                                                        \
            KERNEL(m, n, 1, xq, ldx, R, yq, ldy, FAST);                                            \
    } while (0)

/* Every input row (at most 4 per call: QM__GEMV_MAX_ROWS) in groups of up
 * to 4; NR34 weight rows at a time for 3 or 4 input rows, 4 for fewer. */
#define QM__GEMV512_FN(NAME, KERNEL, FAST, NR34)                                                   \
    static void NAME(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp, size_t ldx,    \
                     uint32_t nx, float *y, size_t ldy)                                            \
    {                                                                                              \
        for (uint32_t r0 = 0; r0 < nx; r0 += 4) {                                                  \
            uint32_t R = nx - r0 < 4 ? nx - r0 : 4;                                                \
            const float *xq = xp + (size_t)r0 * ldx;                                               \
            float *yq = y + (size_t)r0 * ldy;                                                      \
            if (R == 1)                                                                            \
                QM__GEMV512_R(KERNEL, 1, 4, FAST);                                                 \
            else if (R == 2)                                                                       \
                QM__GEMV512_R(KERNEL, 2, 4, FAST);                                                 \
            else if (R == 3)                                                                       \
                QM__GEMV512_R(KERNEL, 3, NR34, FAST);                                              \
            else                                                                                   \
                QM__GEMV512_R(KERNEL, 4, NR34, FAST);                                              \
        }                                                                                          \
    }

/* 4-bit table lookup: 4 x 4 accumulators; 8-bit AVX2 order: NR * R <= 8 pairs. */
QM__GEMV512_FN(qm__gemv512_q4f, qm__gemv512, 1, 4)
QM__GEMV512_FN(qm__gemv512_q4g, qm__gemv512, 0, 4)
QM__GEMV512_FN(qm__gemv512_q8f, qm__gemv512_avx2order, 1, 2)
QM__GEMV512_FN(qm__gemv512_q8g, qm__gemv512_avx2order, 0, 2)

static void qm__avx512_gemv(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp,
                            size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    int fast = m->scale_dtype == QM_DTYPE_F32 && !m->zp;
    if (m->bits == 8)
        (fast ? qm__gemv512_q8f : qm__gemv512_q8g)(m, n0, n1, xp, ldx, nx, y, ldy);
    else if (!qm__q4_canon(m, 0))
        qm__avx2_gemv(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
    else
        (fast ? qm__gemv512_q4f : qm__gemv512_q4g)(m, n0, n1, xp, ldx, nx, y, ldy);
}

/* A row of the exact table (qm_kernel_isa.c). */
const qm__kernel qm__kernel_avx512 = {
    .name = "avx512",
    .needs = "avx2 fma f16c avx512f avx512bw avx512vl",
    .x_stride = qm__avx2_x_stride,
    .prep = qm__avx2_prep,
    .gemv = qm__avx512_gemv,
    .gemm = qm__avx512_gemm_packed,
    .gemm_row_pad = 1,
};
