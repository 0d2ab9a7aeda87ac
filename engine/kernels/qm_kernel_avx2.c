/* qm_kernel_avx2.c - AVX2+FMA quantised matmul (compiled with -mavx2 -mfma -mf16c).
 *
 * Input rows are prepared once per job: for 4-bit weights each group of 16
 * columns is reordered to [even columns, odd columns] so that the low and
 * high nibbles of 8 packed bytes multiply contiguous x vectors without a
 * shuffle; 8-bit weights keep the natural order. The GEMV path also stores,
 * per block, the lane-wise sum of x, so the zero point is applied once per
 * block: partial = sum q*x - zp * sum x, then y += scale * partial. The GEMM
 * path builds a column-major f32 panel of 16 W rows x 256 columns straight
 * from the codes (w = (q - zp) * scale, a byte transpose, no f32 tile) and
 * reuses it for every input row in an up-to-6 x 16 outer-product kernel
 * (no horizontal sums): the AVX-512 packed GEMM's order and bits.
 *
 * 4-bit GEMVs with blocks of whole 32-column chunks run the canonical order
 * instead (qm__q4_canon, qm__gemv_canon below): the same bits as the
 * AVX-512 table-lookup GEMV, so the faster of the two can be measured.
 * qm__kernel_avx2_folded keeps the folded order for them when the job has
 * one input row (1.28x faster there; at 2-4 rows the canonical order is
 * 1.15-1.45x faster and runs: docs/BENCHMARKS.md): the 4-bit GEMV of CPUs
 * without AVX-512, where no other SIMD kernel is a candidate
 * (qm_kernel_select.c). */
#include <immintrin.h>
#include <string.h>

#include "qm_gemm_tiles.h"
#include "qm_kernels.h"

#define QM_AI static inline __attribute__((always_inline))

static size_t qm__round16(size_t v)
{
    return (v + 15) & ~(size_t)15;
}

static size_t qm__round32(size_t v)
{
    return (v + 31) & ~(size_t)31;
}

/* canon: the 4-bit GEMV's canonical order (its input: every 32 columns as
 * [16 even, 16 odd]); else the AVX2 order (16-column groups, 4-bit ones as
 * [8 even, 8 odd]; the GEMV then adds per block the lane-wise sums of x). */
static size_t qm__x_stride_order(const qm__qmat *m, int gemm, int canon)
{
    if (canon)
        return qm__round32(m->k);
    size_t kp = qm__round16(m->k);
    return gemm ? kp : kp + (size_t)8 * m->nblk;
}

static void qm__prep_order(const qm__qmat *m, int gemm, const float *x, float *xp, int canon)
{
    if (canon) { /* every 32 columns: [16 even, 16 odd] */
        size_t kp = qm__round32(m->k);
        for (size_t g = 0; g < kp; g += 32)
            for (size_t j = 0; j < 32; j++) {
                size_t c = g + j;
                xp[g + (j & 1) * 16 + j / 2] = c < m->k ? x[c] : 0.0f;
            }
        return;
    }
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
    if (__builtin_expect(off + 2 * BITS > row_bytes, 0)) { /* row tail: never read past the row */
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

#define qm__scale(m, n, b) qm__qmat_scale_f16c(m, n, b)

QM_AI float qm__zp(const qm__qmat *m, uint32_t n, uint32_t b)
{
    return m->zp ? (float)qm__qmat_zp(m, n, b) : (float)(1 << (m->bits - 1));
}

/* Weight rows n..n+NR-1 times input rows 0..R-1 (NR * R <= 4). Accumulators
 * are named variables (an array would be spilled to the stack). Every
 * (row, input) pair runs the same operation sequence whatever NR and R are:
 * grouping only interleaves independent chains, so results never depend on
 * the grouping:
 *   per chunk   a0 += w_even * x_even; a1 += w_odd * x_odd
 *   per block   blk = (a0 + a1) - zp * xsum_block; y += blk * scale
 *   at the end  hsum(y) in a fixed order. */
#define QM__ACC_DECL(i)                                                                            \
    __m256 a0_##i = _mm256_setzero_ps(), a1_##i = _mm256_setzero_ps(), y_##i = _mm256_setzero_ps()
#define QM__ACC_FMA(i, w0, w1, xv)                                                                 \
    do {                                                                                           \
        a0_##i = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xv), a0_##i);                                 \
        a1_##i = _mm256_fmadd_ps(w1, _mm256_loadu_ps((xv) + 8), a1_##i);                           \
    } while (0)
#define QM__ACC_BLOCK(i, zpv, scv, xsp)                                                            \
    do {                                                                                           \
        __m256 blk_ = _mm256_add_ps(a0_##i, a1_##i);                                               \
        blk_ = _mm256_fnmadd_ps(zpv, _mm256_loadu_ps(xsp), blk_);                                  \
        y_##i = _mm256_fmadd_ps(blk_, scv, y_##i);                                                 \
        a0_##i = _mm256_setzero_ps();                                                              \
        a1_##i = _mm256_setzero_ps();                                                              \
    } while (0)

/* Decode reads 4 rows at a time as 4 interleaved streams; asking for the
 * next 4 rows' lines one group ahead took a DRAM-streaming GEMV from
 * 3.2-3.5 to 4.5-6.5 GB/s per core here. -DQM__GEMV_PREFETCH=0 turns it off. */
#ifndef QM__GEMV_PREFETCH
#define QM__GEMV_PREFETCH 1
#endif

/* Loads chunk c of a row known to hold all of it (no tail check). */
QM_AI void qm__load_chunk_full(const uint8_t *row, uint32_t c, const int BITS, __m256 *w0,
                               __m256 *w1)
{
    const uint8_t *p = row + (size_t)c * 2 * BITS;
    if (BITS == 4) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
        *w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
        *w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    } else {
        *w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
        *w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
    }
}

/* Loads chunk c of a row: without the tail check when c < nfull, the
 * chunks the row holds whole. */
QM_AI void qm__load_chunk_any(const uint8_t *row, size_t row_bytes, uint32_t c, uint32_t nfull,
                              const int BITS, __m256 *w0, __m256 *w1)
{
    if (c < nfull)
        qm__load_chunk_full(row, c, BITS, w0, w1);
    else
        qm__load_chunk(row, row_bytes, c, BITS, w0, w1);
}

QM_AI float qm__scale_f32(const uint8_t *row_scales, uint32_t b)
{
    float f;
    memcpy(&f, row_scales + 4 * (size_t)b, 4);
    return f;
}

/* The symmetric layouts the hot loops specialise on (their FAST argument):
 * 0 anything else (zero points, bf16 scales), 1 f32 scales, 2 f16 scales;
 * neither has a zero-point tensor. */
static inline int qm__sym_scales(const qm__qmat *m)
{
    if (m->zp)
        return 0;
    return m->scale_dtype == QM_DTYPE_F32 ? 1 : m->scale_dtype == QM_DTYPE_F16 ? 2 : 0;
}

/* Bytes of one scale in a symmetric layout. */
#define QM__SYM_SCALE_BYTES(FAST) ((FAST) == 2 ? 2 : 4)

/* Scale b of a row in symmetric layout FAST (1 or 2). */
QM_AI float qm__scale_sym(const uint8_t *row_scales, uint32_t b, const int FAST)
{
    if (FAST == 2) {
        uint16_t h;
        memcpy(&h, row_scales + 2 * (size_t)b, 2);
        return _cvtsh_ss(h);
    }
    return qm__scale_f32(row_scales, b);
}

/* 4 weight rows x 1 input row: the decode hot loop. CPB > 0 fixes the chunks
 * per block at compile time; FAST: the symmetric layout (qm__sym_scales). */
QM_AI void qm__gemv_4x1_impl(const qm__qmat *m, uint32_t n, const float *xp, float *y,
                             const int BITS, const uint32_t CPB, const int FAST)
{
    const uint32_t kp = (uint32_t)qm__round16(m->k), nch = kp / 16;
    const uint32_t cpb = CPB ? CPB : (m->nblk == 1 ? nch : m->block / 16);
    const size_t rb = m->row_bytes;
    const uint32_t nfull = (uint32_t)(rb / (2 * BITS)); /* chunks wholly inside a row */
    const uint8_t *r0 = m->w + (size_t)n * rb, *r1 = r0 + rb, *r2 = r1 + rb, *r3 = r2 + rb;
    const size_t srow = (size_t)m->nblk * QM__SYM_SCALE_BYTES(FAST);
    const uint8_t *s0 = (const uint8_t *)m->scales + (size_t)n * srow, *s1 = s0 + srow,
                  *s2 = s1 + srow, *s3 = s2 + srow;
    const __m256 zsym = _mm256_set1_ps((float)(1 << (BITS - 1)));
    QM__ACC_DECL(0);
    QM__ACC_DECL(1);
    QM__ACC_DECL(2);
    QM__ACC_DECL(3);
    uint32_t c = 0;
    for (uint32_t b = 0; b < m->nblk; b++) {
        uint32_t ce = c + cpb < nch ? c + cpb : nch;
        const float *xv = xp + 16 * (size_t)c;
        if (QM__GEMV_PREFETCH && (b & 3) == 0) {
            /* The next 4 rows (contiguous after these), same offset. */
            size_t off = (size_t)c * 2 * BITS + 4 * rb;
            _mm_prefetch((const char *)(r0 + off), QM__PF_HINT);
            _mm_prefetch((const char *)(r1 + off), QM__PF_HINT);
            _mm_prefetch((const char *)(r2 + off), QM__PF_HINT);
            _mm_prefetch((const char *)(r3 + off), QM__PF_HINT);
        }
        if (ce - c == cpb && ce <= nfull) { /* whole block, no row tail */
#pragma GCC unroll 8
            for (uint32_t j = 0; j < cpb; j++, xv += 16) {
                __m256 w0, w1;
                qm__load_chunk_full(r0, c + j, BITS, &w0, &w1);
                QM__ACC_FMA(0, w0, w1, xv);
                qm__load_chunk_full(r1, c + j, BITS, &w0, &w1);
                QM__ACC_FMA(1, w0, w1, xv);
                qm__load_chunk_full(r2, c + j, BITS, &w0, &w1);
                QM__ACC_FMA(2, w0, w1, xv);
                qm__load_chunk_full(r3, c + j, BITS, &w0, &w1);
                QM__ACC_FMA(3, w0, w1, xv);
            }
            c = ce;
        } else {
            for (; c < ce; c++, xv += 16) {
                __m256 w0, w1;
                qm__load_chunk(r0, rb, c, BITS, &w0, &w1);
                QM__ACC_FMA(0, w0, w1, xv);
                qm__load_chunk(r1, rb, c, BITS, &w0, &w1);
                QM__ACC_FMA(1, w0, w1, xv);
                qm__load_chunk(r2, rb, c, BITS, &w0, &w1);
                QM__ACC_FMA(2, w0, w1, xv);
                qm__load_chunk(r3, rb, c, BITS, &w0, &w1);
                QM__ACC_FMA(3, w0, w1, xv);
            }
        }
        const float *xs = xp + kp + 8 * (size_t)b;
        if (FAST) {
            QM__ACC_BLOCK(0, zsym, _mm256_set1_ps(qm__scale_sym(s0, b, FAST)), xs);
            QM__ACC_BLOCK(1, zsym, _mm256_set1_ps(qm__scale_sym(s1, b, FAST)), xs);
            QM__ACC_BLOCK(2, zsym, _mm256_set1_ps(qm__scale_sym(s2, b, FAST)), xs);
            QM__ACC_BLOCK(3, zsym, _mm256_set1_ps(qm__scale_sym(s3, b, FAST)), xs);
        } else {
            QM__ACC_BLOCK(0, _mm256_set1_ps(qm__zp(m, n, b)), _mm256_set1_ps(qm__scale(m, n, b)), xs);
            QM__ACC_BLOCK(1, _mm256_set1_ps(qm__zp(m, n + 1, b)), _mm256_set1_ps(qm__scale(m, n + 1, b)), xs);
            QM__ACC_BLOCK(2, _mm256_set1_ps(qm__zp(m, n + 2, b)), _mm256_set1_ps(qm__scale(m, n + 2, b)), xs);
            QM__ACC_BLOCK(3, _mm256_set1_ps(qm__zp(m, n + 3, b)), _mm256_set1_ps(qm__scale(m, n + 3, b)), xs);
        }
    }
    y[n] = qm__hsum8(y_0);
    y[n + 1] = qm__hsum8(y_1);
    y[n + 2] = qm__hsum8(y_2);
    y[n + 3] = qm__hsum8(y_3);
}

/* One dispatcher per weight width: the scale layout picks which compile-time
 * specialisation of qm__gemv_4x1_impl runs (cpb: 16-wide chunks per block;
 * CPB_A is tested first, as each width always did, which keeps the code
 * generated for it as it was). */
#define QM__GEMV_4X1_DISPATCH(NAME, BITS, CPB_A, CPB_B)                                            \
    static void NAME(const qm__qmat *m, uint32_t n, const float *xp, float *y)                     \
    {                                                                                              \
        int fast = qm__sym_scales(m);                                                              \
        uint32_t cpb = m->nblk == 1 ? 0 : m->block / 16;                                           \
        if (fast == 1 && cpb == (CPB_A))                                                           \
            qm__gemv_4x1_impl(m, n, xp, y, BITS, CPB_A, 1);                                        \
        else if (fast == 1 && cpb == (CPB_B))                                                      \
            qm__gemv_4x1_impl(m, n, xp, y, BITS, CPB_B, 1);                                        \
        else if (fast == 1)                                                                        \
            qm__gemv_4x1_impl(m, n, xp, y, BITS, 0, 1);                                            \
        else if (fast == 2 && cpb == (CPB_A))                                                      \
            qm__gemv_4x1_impl(m, n, xp, y, BITS, CPB_A, 2);                                        \
        else if (fast == 2 && cpb == (CPB_B))                                                      \
            qm__gemv_4x1_impl(m, n, xp, y, BITS, CPB_B, 2);                                        \
        else if (fast == 2)                                                                        \
            qm__gemv_4x1_impl(m, n, xp, y, BITS, 0, 2);                                            \
        else                                                                                       \
            qm__gemv_4x1_impl(m, n, xp, y, BITS, 0, 0);                                            \
    }

QM__GEMV_4X1_DISPATCH(qm__gemv_4x1_q4, 4, 2, 4)
QM__GEMV_4X1_DISPATCH(qm__gemv_4x1_q8, 8, 4, 2)

#define qm__gemv_4x1(m, n, xp, y, BITS)                                                            \
    ((BITS) == 4 ? qm__gemv_4x1_q4(m, n, xp, y) : qm__gemv_4x1_q8(m, n, xp, y))

/* 1 weight row x 1 input row. */
QM_AI void qm__gemv_1x1(const qm__qmat *m, uint32_t n, const float *xp, float *y, const int BITS)
{
    const uint32_t kp = (uint32_t)qm__round16(m->k), nch = kp / 16;
    const uint32_t cpb = m->nblk == 1 ? nch : m->block / 16;
    const uint8_t *r0 = m->w + (size_t)n * m->row_bytes;
    QM__ACC_DECL(0);
    uint32_t c = 0;
    for (uint32_t b = 0; b < m->nblk; b++) {
        uint32_t ce = c + cpb < nch ? c + cpb : nch;
        for (; c < ce; c++) {
            __m256 w0, w1;
            qm__load_chunk(r0, m->row_bytes, c, BITS, &w0, &w1);
            QM__ACC_FMA(0, w0, w1, xp + 16 * (size_t)c);
        }
        QM__ACC_BLOCK(0, _mm256_set1_ps(qm__zp(m, n, b)), _mm256_set1_ps(qm__scale(m, n, b)),
                      xp + kp + 8 * (size_t)b);
    }
    y[n] = qm__hsum8(y_0);
}

/* 2 weight rows x 2 input rows (x rows at xp and xp + ldx, y rows at y and y + ldy). */
QM_AI void qm__gemv_2x2_impl(const qm__qmat *m, uint32_t n, const float *xp, size_t ldx, float *y,
                             size_t ldy, const int BITS, const int FAST)
{
    const uint32_t kp = (uint32_t)qm__round16(m->k), nch = kp / 16;
    const uint32_t cpb = m->nblk == 1 ? nch : m->block / 16;
    const size_t rb = m->row_bytes;
    const uint32_t nfull = (uint32_t)(rb / (2 * BITS));
    const uint8_t *r0 = m->w + (size_t)n * rb, *r1 = r0 + rb;
    const size_t srow = (size_t)m->nblk * QM__SYM_SCALE_BYTES(FAST);
    const uint8_t *sr0 = (const uint8_t *)m->scales + (size_t)n * srow, *sr1 = sr0 + srow;
    const __m256 zsym = _mm256_set1_ps((float)(1 << (BITS - 1)));
    const float *xq = xp + ldx;
    QM__ACC_DECL(0); /* row n, input 0 */
    QM__ACC_DECL(1); /* row n, input 1 */
    QM__ACC_DECL(2); /* row n+1, input 0 */
    QM__ACC_DECL(3); /* row n+1, input 1 */
    uint32_t c = 0;
    for (uint32_t b = 0; b < m->nblk; b++) {
        uint32_t ce = c + cpb < nch ? c + cpb : nch;
        for (; c < ce; c++) {
            __m256 w0, w1;
            qm__load_chunk_any(r0, rb, c, nfull, BITS, &w0, &w1);
            QM__ACC_FMA(0, w0, w1, xp + 16 * (size_t)c);
            QM__ACC_FMA(1, w0, w1, xq + 16 * (size_t)c);
            qm__load_chunk_any(r1, rb, c, nfull, BITS, &w0, &w1);
            QM__ACC_FMA(2, w0, w1, xp + 16 * (size_t)c);
            QM__ACC_FMA(3, w0, w1, xq + 16 * (size_t)c);
        }
        __m256 z0, s0, z1, s1;
        if (FAST) {
            z0 = z1 = zsym;
            s0 = _mm256_set1_ps(qm__scale_sym(sr0, b, FAST));
            s1 = _mm256_set1_ps(qm__scale_sym(sr1, b, FAST));
        } else {
            z0 = _mm256_set1_ps(qm__zp(m, n, b));
            s0 = _mm256_set1_ps(qm__scale(m, n, b));
            z1 = _mm256_set1_ps(qm__zp(m, n + 1, b));
            s1 = _mm256_set1_ps(qm__scale(m, n + 1, b));
        }
        QM__ACC_BLOCK(0, z0, s0, xp + kp + 8 * (size_t)b);
        QM__ACC_BLOCK(1, z0, s0, xq + kp + 8 * (size_t)b);
        QM__ACC_BLOCK(2, z1, s1, xp + kp + 8 * (size_t)b);
        QM__ACC_BLOCK(3, z1, s1, xq + kp + 8 * (size_t)b);
    }
    y[n] = qm__hsum8(y_0);
    y[ldy + n] = qm__hsum8(y_1);
    y[n + 1] = qm__hsum8(y_2);
    y[ldy + n + 1] = qm__hsum8(y_3);
}

/* The 2 x 2 GEMV of BITS-bit codes as NAME, its scale path chosen once a call. */
#define QM__GEMV_2X2_DISPATCH(NAME, BITS)                                                          \
    static void NAME(const qm__qmat *m, uint32_t n, const float *xp, size_t ldx, float *y,         \
                     size_t ldy)                                                                   \
    {                                                                                              \
        int fast = qm__sym_scales(m);                                                              \
        if (fast == 1)                                                                             \
            qm__gemv_2x2_impl(m, n, xp, ldx, y, ldy, BITS, 1);                                     \
        else if (fast == 2)                                                                        \
            qm__gemv_2x2_impl(m, n, xp, ldx, y, ldy, BITS, 2);                                     \
        else                                                                                       \
            qm__gemv_2x2_impl(m, n, xp, ldx, y, ldy, BITS, 0);                                     \
    }
QM__GEMV_2X2_DISPATCH(qm__gemv_2x2_q4, 4)
QM__GEMV_2X2_DISPATCH(qm__gemv_2x2_q8, 8)

#define qm__gemv_2x2(m, n, xp, ldx, y, ldy, BITS)                                                  \
    ((BITS) == 4 ? qm__gemv_2x2_q4(m, n, xp, ldx, y, ldy) : qm__gemv_2x2_q8(m, n, xp, ldx, y, ldy))

#define QM__GEMV_BODY(BITS)                                                                        \
    do {                                                                                           \
        (void)scratch;                                                                             \
        uint32_t r = 0;                                                                            \
        for (; r + 2 <= nx; r += 2) {                                                              \
            uint32_t n = n0;                                                                       \
            for (; n + 2 <= n1; n += 2)                                                            \
                qm__gemv_2x2(m, n, xp + r * ldx, ldx, y + r * ldy, ldy, BITS);                     \
            for (; n < n1; n++) {                                                                  \
                qm__gemv_1x1(m, n, xp + r * ldx, y + r * ldy, BITS);                               \
                qm__gemv_1x1(m, n, xp + (r + 1) * ldx, y + (r + 1) * ldy, BITS);                   \
            }                                                                                      \
        }                                                                                          \
        for (; r < nx; r++) {                                                                      \
            uint32_t n = n0;                                                                       \
            for (; n + 4 <= n1; n += 4)                                                            \
                qm__gemv_4x1(m, n, xp + r * ldx, y + r * ldy, BITS);                               \
            for (; n < n1; n++)                                                                    \
                qm__gemv_1x1(m, n, xp + r * ldx, y + r * ldy, BITS);                               \
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

/* ---- 4-bit GEMV in the canonical order (qm__q4_canon) ----
 * The AVX-512 kernel's 16 lanes as two 8-lane accumulators: a 32-column
 * chunk is 16 bytes of a row; bytes 0-7 feed a (canonical lanes 0-7), bytes
 * 8-15 feed b (lanes 8-15); each lane adds its even column (low nibble), then
 * its odd one (high nibble), with w = scale * (q - zp) rounded once (the
 * value of the AVX-512 kernel's table); at the end a + b is its 16 -> 8 step
 * and qm__hsum8 the rest. q - zp is an exact int32 and exact as f32. */

/* 8 codes' bytes at byte offset off of a row, as dwords; zero past the row
 * (as the AVX-512 kernel reads them). */
QM_AI __m256i qm__bytes8(const uint8_t *row, size_t rb, size_t off)
{
    if (__builtin_expect(off + 8 <= rb, 1))
        return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + off)));
    uint8_t tmp[8] = {0};
    if (off < rb)
        memcpy(tmp, row + off, rb - off);
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)tmp));
}

/* scale * (code - zp) for 8 codes (dwords). */
QM_AI __m256 qm__deq8(__m256i q, __m256i zp, __m256 sc)
{
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, zp)), sc);
}

/* Chunk c (32 columns) of NR weight rows into their accumulators with R
 * input rows; TAIL: the chunk may reach past the row (bytes read as zero). */
QM_AI void qm__canon_chunk(const uint8_t *const row[4], size_t rb, uint32_t c, const int NR,
                           const float *xp, size_t ldx, const int R, const __m256 sc[4],
                           const __m256i zp[4], __m256i lo4, __m256 a[4][4], __m256 b[4][4],
                           const int TAIL)
{
    const size_t off = 16 * (size_t)c;
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) {
        __m256i v0, v1;
        if (TAIL) {
            v0 = qm__bytes8(row[i], rb, off);
            v1 = qm__bytes8(row[i], rb, off + 8);
        } else {
            v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row[i] + off)));
            v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row[i] + off + 8)));
        }
        __m256 w00 = qm__deq8(_mm256_and_si256(v0, lo4), zp[i], sc[i]);
        __m256 w01 = qm__deq8(_mm256_srli_epi32(v0, 4), zp[i], sc[i]);
        __m256 w10 = qm__deq8(_mm256_and_si256(v1, lo4), zp[i], sc[i]);
        __m256 w11 = qm__deq8(_mm256_srli_epi32(v1, 4), zp[i], sc[i]);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const float *xv = xp + (size_t)r * ldx + 32 * (size_t)c;
            a[i][r] = _mm256_fmadd_ps(w00, _mm256_loadu_ps(xv), a[i][r]);
            a[i][r] = _mm256_fmadd_ps(w01, _mm256_loadu_ps(xv + 16), a[i][r]);
            b[i][r] = _mm256_fmadd_ps(w10, _mm256_loadu_ps(xv + 8), b[i][r]);
            b[i][r] = _mm256_fmadd_ps(w11, _mm256_loadu_ps(xv + 24), b[i][r]);
        }
    }
}

/* The scales and zero points of block blk of rows n..n+NR-1, as vectors. */
QM_AI void qm__canon_block_params(const qm__qmat *m, uint32_t n, const int NR, uint32_t blk,
                                  __m256 sc[4], __m256i zp[4], const int FAST)
{
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) {
        if (FAST) {
            size_t srow = (size_t)(n + i) * m->nblk * QM__SYM_SCALE_BYTES(FAST);
            sc[i] = _mm256_set1_ps(qm__scale_sym((const uint8_t *)m->scales + srow, blk, FAST));
            zp[i] = _mm256_set1_epi32(8);
        } else {
            sc[i] = _mm256_set1_ps(qm__scale(m, n + i, blk));
            zp[i] = _mm256_set1_epi32(m->zp ? qm__qmat_zp(m, n + i, blk) : 8);
        }
    }
}

/* Asks for the lines of the next NR rows that chunks [c, ce) start, one
 * group of rows ahead. */
QM_AI void qm__canon_prefetch(const uint8_t *const row[4], size_t rb, const int NR, uint32_t c,
                              uint32_t ce)
{
    if (!QM__GEMV_PREFETCH)
        return;
    for (size_t off = (16 * (size_t)c + 63) & ~(size_t)63; off < 16 * (size_t)ce; off += 64)
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++)
            _mm_prefetch((const char *)(row[i] + off + NR * rb), QM__PF_HINT);
}

/* NR weight rows (n..n+NR-1) x R input rows, NR * R <= 4 (8 accumulators).
 * CPB > 0 fixes the chunks per block at compile time; FAST: the symmetric
 * layout (qm__sym_scales). */
QM_AI void qm__gemv_canon(const qm__qmat *m, uint32_t n, const int NR, const float *xp,
                          size_t ldx, const int R, float *y, size_t ldy, const uint32_t CPB,
                          const int FAST)
{
    const uint32_t nch = (uint32_t)(qm__round32(m->k) / 32);
    const uint32_t cpb = CPB ? CPB : m->nblk == 1 ? nch : m->block / 32;
    const size_t rb = m->row_bytes;
    const uint32_t nfull = (uint32_t)(rb / 16); /* chunks wholly inside a row */
    /* Blocks of cpb chunks, all inside the row: no tail checks. */
    uint32_t nbf = (nfull < nch ? nfull : nch) / cpb;
    nbf = nbf < m->nblk ? nbf : m->nblk;
    const __m256i lo4 = _mm256_set1_epi32(15);
    const uint8_t *row[4];
    __m256 a[4][4], b[4][4], sc[4];
    __m256i zp[4];
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) {
        row[i] = m->w + (size_t)(n + i) * rb;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            a[i][r] = b[i][r] = _mm256_setzero_ps();
    }
    uint32_t c = 0, blk = 0;
    for (; blk < nbf; blk++, c += cpb) {
        qm__canon_block_params(m, n, NR, blk, sc, zp, FAST);
        qm__canon_prefetch(row, rb, NR, c, c + cpb);
#pragma GCC unroll 4
        for (uint32_t j = 0; j < cpb; j++)
            qm__canon_chunk(row, rb, c + j, NR, xp, ldx, R, sc, zp, lo4, a, b, 0);
    }
    for (; blk < m->nblk; blk++) {
        uint32_t ce = c + cpb < nch ? c + cpb : nch;
        qm__canon_block_params(m, n, NR, blk, sc, zp, FAST);
        for (; c < ce; c++)
            qm__canon_chunk(row, rb, c, NR, xp, ldx, R, sc, zp, lo4, a, b, 1);
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            y[(size_t)r * ldy + n + i] = qm__hsum8(_mm256_add_ps(a[i][r], b[i][r]));
}

/* Weight rows NR at a time (then single rows) times R input rows. */
#define QM__CANON_ROWS(R, NR, CPB, FAST)                                                           \
    do {                                                                                           \
        uint32_t n = n0;                                                                           \
        for (; n + (NR) <= n1; n += (NR))                                                          \
            qm__gemv_canon(m, n, NR, xq, ldx, R, yq, ldy, CPB, FAST);                              \
        for (; n < n1; n++)                                                                        \
            qm__gemv_canon(m, n, 1, xq, ldx, R, yq, ldy, CPB, FAST);                               \
    } while (0)

/* Input rows 4 at a time; weight rows 2 at a time for 1 or 2 inputs (4
 * rows x 1 input spilled accumulators to the stack: 16 ymm registers), 1
 * for 3 or 4. */
QM_AI void qm__gemv_q4_canon_impl(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp,
                                  size_t ldx, uint32_t nx, float *y, size_t ldy,
                                  const uint32_t CPB, const int FAST)
{
    for (uint32_t r0 = 0; r0 < nx; r0 += 4) {
        uint32_t R = nx - r0 < 4 ? nx - r0 : 4;
        const float *xq = xp + (size_t)r0 * ldx;
        float *yq = y + (size_t)r0 * ldy;
        if (R == 1)
            QM__CANON_ROWS(1, 2, CPB, FAST);
        else if (R == 2)
            QM__CANON_ROWS(2, 2, CPB, FAST);
        else if (R == 3)
            QM__CANON_ROWS(3, 1, CPB, FAST);
        else
            QM__CANON_ROWS(4, 1, CPB, FAST);
    }
}

/* Blocks of 32 and 64 columns with f32 scales and no zero points (the
 * common banks) get a compile-time chunk count. */
static void qm__gemv_q4_canon(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp,
                              size_t ldx, uint32_t nx, float *y, size_t ldy)
{
    int fast = qm__sym_scales(m);
    uint32_t cpb = m->nblk == 1 ? 0 : m->block / 32;
    if (fast == 1 && cpb == 1)
        qm__gemv_q4_canon_impl(m, n0, n1, xp, ldx, nx, y, ldy, 1, 1);
    else if (fast == 1 && cpb == 2)
        qm__gemv_q4_canon_impl(m, n0, n1, xp, ldx, nx, y, ldy, 2, 1);
    else if (fast == 1)
        qm__gemv_q4_canon_impl(m, n0, n1, xp, ldx, nx, y, ldy, 0, 1);
    else if (fast == 2 && cpb == 1)
        qm__gemv_q4_canon_impl(m, n0, n1, xp, ldx, nx, y, ldy, 1, 2);
    else if (fast == 2 && cpb == 2)
        qm__gemv_q4_canon_impl(m, n0, n1, xp, ldx, nx, y, ldy, 2, 2);
    else if (fast == 2)
        qm__gemv_q4_canon_impl(m, n0, n1, xp, ldx, nx, y, ldy, 0, 2);
    else
        qm__gemv_q4_canon_impl(m, n0, n1, xp, ldx, nx, y, ldy, 0, 0);
}

static void qm__gemv_order(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp,
                           size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch,
                           int canon)
{
    if (canon)
        qm__gemv_q4_canon(m, n0, n1, xp, ldx, nx, y, ldy);
    else if (m->bits == 4)
        qm__gemv_q4(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
    else
        qm__gemv_q8(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
}

/* The canonical kernel's entries (the AVX-512 table borrows them) and the
 * folded kernel's: the same code, the order chosen per matrix. */
size_t qm__avx2_x_stride(const qm__qmat *m, int gemm)
{
    return qm__x_stride_order(m, gemm, qm__q4_canon(m, gemm));
}

void qm__avx2_prep(const qm__qmat *m, int gemm, const float *x, float *xp)
{
    qm__prep_order(m, gemm, x, xp, qm__q4_canon(m, gemm));
}

void qm__avx2_gemv(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp, size_t ldx,
                   uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__gemv_order(m, n0, n1, xp, ldx, nx, y, ldy, scratch, qm__q4_canon(m, 0));
}

/* The folded kernel: where qm__q4_canon applies, a prepared row holds both
 * inputs, the canonical one then the folded one (prep does not know how
 * many rows the job has); a 1-row GEMV runs the folded order, 2-4 rows the
 * canonical one (faster there: it dequantises once for every input row). */
static size_t qm__avx2_folded_x_stride(const qm__qmat *m, int gemm)
{
    size_t canon = qm__q4_canon(m, gemm) ? qm__round32(m->k) : 0;
    return canon + qm__x_stride_order(m, gemm, 0);
}

static void qm__avx2_folded_prep(const qm__qmat *m, int gemm, const float *x, float *xp)
{
    if (qm__q4_canon(m, gemm)) {
        qm__prep_order(m, gemm, x, xp, 1);
        xp += qm__round32(m->k);
    }
    qm__prep_order(m, gemm, x, xp, 0);
}

static void qm__avx2_folded_gemv(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp,
                                 size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    int canon = qm__q4_canon(m, 0);
    if (canon && nx == 1)
        xp += qm__round32(m->k);
    qm__gemv_order(m, n0, n1, xp, ldx, nx, y, ldy, scratch, canon && nx > 1);
}

/* ---- The GEMM (jobs of more than QM__GEMV_MAX_ROWS input rows) ----
 *
 * The GEMM class's order, shared with the AVX-512 packed GEMM
 * (qm_gemm_packed_avx512.c), so the two give the same bits: K is cut into
 * tiles of QM__GEMM_KT prepared columns; within a tile each output
 * accumulates w * x with one f32 FMA per column in prepared order,
 * starting from zero, with w = (q - zp) * scale rounded to f32 once; the
 * tile's sum is stored to the output (first tile) or added to it.
 *
 * One call owns 16 W rows (QM__TILE_ROWS). Per tile their weights become a
 * column-major f32 panel wt[len][16] (16 KiB: L1) that every input row then
 * reuses, built straight from the codes eight rows at a time: the rows'
 * code bytes of one 16-column chunk are transposed as bytes (unpack stages
 * on 128-bit registers), so that each panel half-column is one widening,
 * one convert and one multiply by the eight rows' scales of its block
 * (the implicit zero point subtracted on the bytes first, exactly, or an
 * explicit one subtracted in f32). No f32 tile and no f32 transpose: that
 * pair cost as much as the FMAs at 8-12 input rows.
 *
 * Input rows run in balanced groups of at most QM__PK2_MAXR (two ymm
 * accumulators each: 12 of the 16 registers), never padded with zero rows,
 * so a job of 8 rows runs 4 + 4, not 6 + 6. Which rows share a group
 * changes no bits: a row's accumulators see the same operations whatever
 * runs beside them. */

/* Most input rows of one register block. */
#define QM__PK2_MAXR 6u
/* Blocks one tile can touch: blocks are multiples of 16 columns. */
#define QM__PK2_MAXB (QM__GEMM_KT / 16u + 1u)

/* Scales and zero points of blocks [b0, b0 + nb) of rows [n0, n0 + nr):
 * sv[j * 16 + i] for row n0 + i (scale 0 for rows past nr: their lanes
 * are never stored). zv is filled only for explicit zero points. */
static void qm__pk2_params(const qm__qmat *m, uint32_t n0, uint32_t nr, uint32_t b0, uint32_t nb,
                           float *sv, float *zv)
{
    memset(sv, 0, sizeof(float) * 16 * nb);
    if (m->scale_dtype == QM_DTYPE_F32) { /* plain loads, the common case */
        const float *s = (const float *)m->scales + (size_t)n0 * m->nblk + b0;
        for (uint32_t i = 0; i < nr; i++, s += m->nblk)
            for (uint32_t j = 0; j < nb; j++)
                memcpy(&sv[j * 16 + i], s + j, 4);
    } else if (m->scale_dtype == QM_DTYPE_F16) { /* 8 at a time by vcvtph2ps */
        const uint16_t *h = (const uint16_t *)m->scales + (size_t)n0 * m->nblk + b0;
        for (uint32_t i = 0; i < nr; i++, h += m->nblk) {
            uint32_t j = 0;
            for (; j + 8 <= nb; j += 8) {
                float t[8];
                _mm256_storeu_ps(t, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
                for (uint32_t u = 0; u < 8; u++)
                    sv[(j + u) * 16 + i] = t[u];
            }
            for (; j < nb; j++)
                sv[j * 16 + i] = _cvtsh_ss(h[j]);
        }
    } else {
        for (uint32_t i = 0; i < nr; i++)
            for (uint32_t j = 0; j < nb; j++)
                sv[j * 16 + i] = qm__qmat_scale_f16c(m, n0 + i, b0 + j);
    }
    if (m->zp) {
        for (uint32_t j = 0; j < nb; j++)
            for (uint32_t i = 0; i < 16; i++)
                zv[j * 16 + i] = i < nr ? (float)qm__qmat_zp(m, n0 + i, b0 + j) : 0.0f;
    }
}

/* Bytes [off, off + N) of a row (N = 8 or 16) as the low bytes of a
 * register; zeros past row_bytes (never read) and for a row past the
 * panel's (row NULL). */
QM_AI __m128i qm__pk2_load(const qm__qmat *m, const uint8_t *row, size_t off, const int N)
{
    if (__builtin_expect(row && off + N <= m->row_bytes, 1))
        return N == 8 ? _mm_loadl_epi64((const __m128i *)(row + off))
                      : _mm_loadu_si128((const __m128i *)(row + off));
    uint8_t t[16] = {0};
    if (row && off < m->row_bytes)
        memcpy(t, row + off, m->row_bytes - off < (size_t)N ? m->row_bytes - off : (size_t)N);
    return _mm_loadu_si128((const __m128i *)t);
}

/* Bytes 0-7 of 8 rows (r[0..7]) transposed: c[t] holds byte 2t of the 8
 * rows in its low 8 bytes and byte 2t + 1 in its high 8. */
QM_AI void qm__pk2_transpose8(const __m128i r[8], __m128i c[4])
{
    __m128i a0 = _mm_unpacklo_epi8(r[0], r[1]), a1 = _mm_unpacklo_epi8(r[2], r[3]);
    __m128i a2 = _mm_unpacklo_epi8(r[4], r[5]), a3 = _mm_unpacklo_epi8(r[6], r[7]);
    __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
    __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
    c[0] = _mm_unpacklo_epi32(b0, b2);
    c[1] = _mm_unpackhi_epi32(b0, b2);
    c[2] = _mm_unpacklo_epi32(b1, b3);
    c[3] = _mm_unpackhi_epi32(b1, b3);
}

/* One panel half-column: 8 rows' codes (low 8 bytes of q; signed bytes
 * q - zp when ZP is 0, unsigned codes when 1) times the rows' scales. */
QM_AI void qm__pk2_col(__m128i q, const int ZP, __m256 zv, __m256 sv, float *dst)
{
    __m256 w;
    if (ZP)
        w = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), zv);
    else
        w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    _mm256_store_ps(dst, _mm256_mul_ps(w, sv));
}

/* The two half-columns of a transposed register: its low 8 bytes to column
 * d0, its high 8 to column d1 (16 floats apart per column). */
QM_AI void qm__pk2_col2(__m128i q, const int ZP, __m256 zv, __m256 sv, float *d0, float *d1)
{
    qm__pk2_col(q, ZP, zv, sv, d0);
    qm__pk2_col(_mm_unpackhi_epi64(q, q), ZP, zv, sv, d1);
}

/* Panel rows 8h..8h+7 (rows[0..7], NULL past the matrix's) of one
 * 16-column chunk at code byte offset off into d = wt + chunk * 256 + 8h. */
QM_AI void qm__pk2_chunk(const qm__qmat *m, const uint8_t *const *rows, size_t off, const int BITS,
                         const int ZP, __m256 zv, __m256 sv, float *d)
{
    __m128i r[8], c[4];
    if (BITS == 4) {
        /* 8 code bytes a row: byte e holds column 2e (low nibble, prepared
         * position e) and 2e + 1 (high nibble, position 8 + e). */
        for (int i = 0; i < 8; i++)
            r[i] = qm__pk2_load(m, rows[i], off, 8);
        qm__pk2_transpose8(r, c);
        const __m128i lo4 = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
        for (int t = 0; t < 4; t++) {
            __m128i lo = _mm_and_si128(c[t], lo4);
            __m128i hi = _mm_and_si128(_mm_srli_epi16(c[t], 4), lo4);
            if (!ZP) { /* q - 8 on the bytes: exact, and a signed widening */
                lo = _mm_sub_epi8(lo, eight);
                hi = _mm_sub_epi8(hi, eight);
            }
            qm__pk2_col2(lo, ZP, zv, sv, d + 16 * (2 * t), d + 16 * (2 * t + 1));
            qm__pk2_col2(hi, ZP, zv, sv, d + 16 * (8 + 2 * t), d + 16 * (9 + 2 * t));
        }
    } else {
        /* 16 code bytes a row, natural order; the implicit zero point 128
         * is a flip of each byte's top bit (q - 128 as a signed byte). */
        for (int i = 0; i < 8; i++)
            r[i] = qm__pk2_load(m, rows[i], off, 16);
        if (!ZP)
            for (int i = 0; i < 8; i++)
                r[i] = _mm_xor_si128(r[i], _mm_set1_epi8((char)0x80));
        for (int half = 0; half < 2; half++) {
            qm__pk2_transpose8(r, c);
            for (int t = 0; t < 4; t++)
                qm__pk2_col2(c[t], ZP, zv, sv, d + 16 * (8 * half + 2 * t),
                             d + 16 * (8 * half + 2 * t + 1));
            for (int i = 0; i < 8; i++) /* bytes 8-15 down for the second half */
                r[i] = _mm_srli_si128(r[i], 8);
        }
    }
}

/* Rows [n0, n0 + nr) x prepared columns [kt0, kt0 + len) of W as the panel
 * wt[len][16]; len is a multiple of 16. */
QM_AI void qm__pk2_panel_t(const qm__qmat *m, uint32_t n0, uint32_t nr, uint32_t kt0, uint32_t len,
                           float *wt, float *sv, float *zv, const int BITS, const int ZP)
{
    const uint32_t cpb = m->nblk == 1 ? UINT32_MAX : m->block / 16; /* chunks per block */
    const uint32_t b0 = m->nblk == 1 ? 0 : kt0 / 16 / cpb;
    const uint32_t b1 = m->nblk == 1 ? 0 : (kt0 + len - 1) / 16 / cpb;
    qm__pk2_params(m, n0, nr, b0, b1 - b0 + 1, sv, zv);
    const uint8_t *rows[16];
    for (uint32_t i = 0; i < 16; i++)
        rows[i] = i < nr ? m->w + (size_t)(n0 + i) * m->row_bytes : NULL;
    /* The tile's code lines into L1 first (the previous tile's prefetch
     * left them in L2): the chunk loop's loads then overlap. */
    {
        size_t off = (size_t)kt0 * BITS / 8, run = (size_t)len * BITS / 8;
        for (uint32_t i = 0; i < nr; i++) {
            const uint8_t *p = rows[i] + off;
            for (size_t o = 0; o < run; o += 64)
                _mm_prefetch((const char *)(p + o), _MM_HINT_T0);
        }
    }
    const __m256 z0 = _mm256_setzero_ps();
    for (uint32_t g = 0; g < len / 16; g++) { /* one 16-column chunk */
        uint32_t j = m->nblk == 1 ? 0 : (kt0 / 16 + g) / cpb - b0;
        size_t off = (size_t)(kt0 / 16 + g) * 2 * BITS;
        for (int h = 0; h < 2; h++) {
            if (8 * (uint32_t)h >= nr) { /* no rows in this half: zeros */
                for (int c = 0; c < 16; c++)
                    _mm256_store_ps(wt + (size_t)g * 256 + 16 * c + 8 * h, z0);
                continue;
            }
            __m256 s = _mm256_loadu_ps(sv + 16 * j + 8 * h);
            __m256 z = ZP ? _mm256_loadu_ps(zv + 16 * j + 8 * h) : z0;
            qm__pk2_chunk(m, rows + 8 * h, off, BITS, ZP, z, s, wt + (size_t)g * 256 + 8 * h);
        }
    }
}

static void qm__pk2_panel(const qm__qmat *m, uint32_t n0, uint32_t nr, uint32_t kt0, uint32_t len,
                          float *wt, float *sv, float *zv)
{
    if (m->bits == 4) {
        if (m->zp)
            qm__pk2_panel_t(m, n0, nr, kt0, len, wt, sv, zv, 4, 1);
        else
            qm__pk2_panel_t(m, n0, nr, kt0, len, wt, sv, zv, 4, 0);
    } else if (m->zp) {
        qm__pk2_panel_t(m, n0, nr, kt0, len, wt, sv, zv, 8, 1);
    } else {
        qm__pk2_panel_t(m, n0, nr, kt0, len, wt, sv, zv, 8, 0);
    }
}

/* The codes and scales of tile kt0 of rows [n0, n0 + nr) into L2: 16 short
 * runs at a row stride, a pattern the hardware prefetcher follows poorly;
 * asked for while the previous tile's FMAs run. */
static void qm__pk2_prefetch(const qm__qmat *m, uint32_t n0, uint32_t nr, uint32_t kt0)
{
    size_t off = (size_t)kt0 * m->bits / 8;
    size_t run = (size_t)QM__GEMM_KT * m->bits / 8;
    size_t ssz = m->scale_dtype == QM_DTYPE_F32 ? 4 : 2;
    size_t soff = m->nblk == 1 ? 0 : (size_t)kt0 / m->block * ssz;
    for (uint32_t n = n0; n < n0 + nr; n++) {
        const uint8_t *r = m->w + (size_t)n * m->row_bytes;
        for (size_t o = off; o < off + run && o < m->row_bytes; o += 64)
            _mm_prefetch((const char *)(r + o), QM__PF_HINT);
        _mm_prefetch((const char *)m->scales + ((size_t)n * m->nblk) * ssz + soff, QM__PF_HINT);
    }
}

/* R input rows x the panel's 16 outputs over one tile; the tile's sums are
 * stored to (first tile) or added to y's first nr columns. R is a constant
 * after inlining, so the accumulators stay in registers. */
QM_AI void qm__pk2_block(const float *wt, uint32_t len, const float *x, size_t ldx, float *y,
                         size_t ldy, uint32_t nr, int add, const uint32_t R)
{
    __m256 a0[QM__PK2_MAXR], a1[QM__PK2_MAXR];
#pragma GCC unroll 6
    for (uint32_t r = 0; r < R; r++)
        a0[r] = a1[r] = _mm256_setzero_ps();
    /* One pointer per row, advanced every 4 columns and hidden from the
     * optimiser (the empty asm), so that each broadcast is base +
     * constant, not base + index (the AVX-512 GEMM's measured choice). */
    const float *xr[QM__PK2_MAXR];
#pragma GCC unroll 6
    for (uint32_t r = 0; r < R; r++)
        xr[r] = x + r * ldx;
    for (const float *wc = wt, *we = wt + 16 * (size_t)len; wc < we; wc += 64) {
#pragma GCC unroll 4
        for (uint32_t u = 0; u < 4; u++) {
            __m256 w0 = _mm256_load_ps(wc + 16 * u), w1 = _mm256_load_ps(wc + 16 * u + 8);
#pragma GCC unroll 6
            for (uint32_t r = 0; r < R; r++) {
                __m256 b = _mm256_broadcast_ss(xr[r] + u);
                a0[r] = _mm256_fmadd_ps(w0, b, a0[r]);
                a1[r] = _mm256_fmadd_ps(w1, b, a1[r]);
            }
        }
#pragma GCC unroll 6
        for (uint32_t r = 0; r < R; r++) {
            xr[r] += 4;
            __asm__("" : "+r"(xr[r]));
        }
    }
#pragma GCC unroll 6
    for (uint32_t r = 0; r < R; r++) {
        float *out = y + r * ldy;
        if (nr == 16) {
            __m256 v0 = a0[r], v1 = a1[r];
            if (add) {
                v0 = _mm256_add_ps(_mm256_loadu_ps(out), v0);
                v1 = _mm256_add_ps(_mm256_loadu_ps(out + 8), v1);
            }
            _mm256_storeu_ps(out, v0);
            _mm256_storeu_ps(out + 8, v1);
        } else { /* a short last tile: never write past nr */
            float p[16];
            _mm256_storeu_ps(p, a0[r]);
            _mm256_storeu_ps(p + 8, a1[r]);
            for (uint32_t j = 0; j < nr; j++)
                out[j] = add ? out[j] + p[j] : p[j];
        }
    }
}

#define QM__PK2_CASE(R)                                                                            \
    case R:                                                                                        \
        qm__pk2_block(wt, len, x, ldx, y, ldy, nr, add, R);                                        \
        break

static void qm__pk2_rows(uint32_t rows, const float *wt, uint32_t len, const float *x, size_t ldx,
                         float *y, size_t ldy, uint32_t nr, int add)
{
    switch (rows) {
        QM__PK2_CASE(1);
        QM__PK2_CASE(2);
        QM__PK2_CASE(3);
        QM__PK2_CASE(4);
        QM__PK2_CASE(5);
        QM__PK2_CASE(6);
    default:
        break;
    }
}

/* A short last panel's outputs past nr are never written. */
QM__PACKED_GEMM(qm__avx2_gemm, qm__pk2_panel, qm__pk2_prefetch, qm__pk2_rows, QM__PK2_MAXR,
                QM__PK2_MAXB, nr)

#define QM__AVX2_TABLE(NAME, PREFIX, ...)                                                          \
    {                                                                                              \
        .name = NAME, .needs = "avx2 fma f16c", .x_stride = PREFIX##_x_stride,                     \
        .prep = PREFIX##_prep, .gemv = PREFIX##_gemv, .gemm = qm__avx2_gemm, .gemm_row_pad = 1,    \
        __VA_ARGS__                                                                                \
    }

/* Rows of the exact table (qm_kernel_isa.c). */
const qm__kernel qm__kernel_avx2_folded =
    QM__AVX2_TABLE("avx2-folded", qm__avx2_folded, .variant = 1);
const qm__kernel qm__kernel_avx2 = QM__AVX2_TABLE("avx2", qm__avx2, .aliases = "avx2-canonical",
                                                  .alone = &qm__kernel_avx2_folded);
