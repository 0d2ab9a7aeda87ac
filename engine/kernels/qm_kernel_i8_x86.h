/* qm_kernel_i8_x86.h - AVX2 code every x86 fast kernel shares (each
 * includer is compiled with at least -mavx2 -mfma -mf16c): the packers and
 * row parameters of qm_kernel_i8.h on vectors (tested against the C ones
 * byte for byte), and the decode GEMV, a 256-bit body whose dot product
 * the includer names:
 *   QM__V_FN                 the GEMV's name
 *   QM__V_DOT4(lo, hi, xl, xh)  8 int32 lanes, lanes 0-3 summing sub-block j
 *                            and 4-7 sub-block j + 1 (lo/hi: the low/high
 *                            nibbles of the 32 code bytes of j, j + 1)
 *   QM__V_DOT8(w, x, x16)    8 int32 lanes summing one 8-bit sub-block (w:
 *                            its 32 code bytes, x / x16: its s8 / s16 inputs)
 * or, for a vpdpbusd ISA (u8 x s8 summed by 4, exact for 4-bit and 8-bit
 * codes alike), only
 *   QM__V_DPBUSD(acc, w, x)  acc plus, per int32 lane, the dot of its 4 u8
 *                            bytes of w with its 4 s8 bytes of x
 * from which both dot products follow.
 * Private to engine/. */
#ifndef QM_KERNEL_I8_X86_H
#define QM_KERNEL_I8_X86_H

#include <immintrin.h>

#include "qm_kernel_i8.h"

/* 8 x 8 int32 transpose: r[i] lane g -> r[g] lane i. */
QM__I8_AI void qm__x_tr8(__m256i r[8])
{
    __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    r[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
    r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
    r[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
    r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
    r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
    r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
    r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
    r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

/* Bytes [off, off + len) of a row (len <= 64), zeros past its end. */
QM__I8_AI const uint8_t *qm__x_bytes(const qm__qmat *m, const uint8_t *row, size_t off,
                                     size_t len, uint8_t *tmp)
{
    if (__builtin_expect(off + len <= m->row_bytes, 1))
        return row + off;
    memset(tmp, 0, len);
    if (off < m->row_bytes)
        memcpy(tmp, row + off, m->row_bytes - off);
    return tmp;
}

/* A 4-bit row's nibbles lo (even columns) and hi (odd) as the u8 panel's
 * codes: as they are, or looked up to QM__CB_ZP + cb[q] for a code book
 * (qm__qmat.cb). */
QM__I8_AI __m256i qm__x_nibbles_u8(const qm__qmat *m, __m128i lo, __m128i hi)
{
    if (m->cb) {
        const __m128i lut = _mm_add_epi8(_mm_loadu_si128((const __m128i *)m->cb),
                                         _mm_set1_epi8(QM__CB_ZP));
        lo = _mm_shuffle_epi8(lut, lo);
        hi = _mm_shuffle_epi8(lut, hi);
    }
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* Sub-block j of row i (i < nr; else zeros) as 8 dwords of u8 codes in
 * prepared order (a code book's looked up). */
QM__I8_AI __m256i qm__x_row_u8(const qm__qmat *m, uint32_t n0, uint32_t nr, uint32_t i, size_t j)
{
    uint8_t tmp[32];
    if (i >= nr)
        return _mm256_setzero_si256();
    const uint8_t *row = m->w + (size_t)(n0 + i) * m->row_bytes;
    if (m->r8 && m->bits == 8) { /* 8-bit r8 (qm_r8.h): the row's 8 runs of 4 bytes */
        const uint8_t *g = m->w + qm__r8_offset(m->row_bytes, n0 + i, 32 * j);
        int32_t d[8];
        for (int q = 0; q < 8; q++)
            memcpy(&d[q], g + 32 * q, 4);
        return _mm256_setr_epi32(d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]);
    }
    if (m->r8) { /* 4-bit r8 (qm_r8.h): the row's 4 runs of 4 bytes in its group */
        const uint8_t *g = m->w + qm__r8_offset(m->row_bytes, n0 + i, 16 * j);
        int32_t d[4];
        for (int q = 0; q < 4; q++)
            memcpy(&d[q], g + 32 * q, 4);
        __m128i v = _mm_setr_epi32(d[0], d[1], d[2], d[3]);
        const __m128i lo4 = _mm_set1_epi8(15);
        __m128i lo = _mm_and_si128(v, lo4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
        return qm__x_nibbles_u8(m, lo, hi);
    }
    if (m->bits == 8)
        return _mm256_loadu_si256((const __m256i *)qm__x_bytes(m, row, 32 * j, 32, tmp));
    __m128i v = _mm_loadu_si128((const __m128i *)qm__x_bytes(m, row, 16 * j, 16, tmp));
    const __m128i lo4 = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(v, lo4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
    return qm__x_nibbles_u8(m, lo, hi);
}

/* qm__i8_pack_u8_c on vectors. A whole group of an 8-bit r8 matrix is
 * copied as it lies: its sub-block's 8 runs of 8 rows x 4 bytes are the
 * panel's 8 row dwords already (what the transpose makes of rows). */
static inline void qm__x_pack_u8(const qm__qmat *m, uint32_t n0, uint32_t nr, size_t j0,
                                 size_t j1, uint8_t *pan)
{
    for (size_t j = j0; j < j1; j++)
        for (uint32_t h = 0; h < 16; h += 8) {
            if (m->r8 && m->bits == 8 && h + 8 <= nr && (n0 + h) % 8 == 0) {
                const uint8_t *g = m->w + qm__r8_offset(m->row_bytes, n0 + h, 32 * j);
                uint8_t *p = pan + 512 * (j - j0) + 4 * h;
                for (int q = 0; q < 8; q++)
                    _mm256_storeu_si256((__m256i *)(p + 64 * q),
                                        _mm256_loadu_si256((const __m256i *)(g + 32 * q)));
                continue;
            }
            __m256i r[8];
            for (uint32_t i = 0; i < 8; i++)
                r[i] = qm__x_row_u8(m, n0, nr, h + i, j);
            qm__x_tr8(r);
            uint8_t *p = pan + 512 * (j - j0) + 4 * h;
            for (int g = 0; g < 8; g++)
                _mm256_storeu_si256((__m256i *)(p + 64 * g), r[g]);
        }
}

/* A whole group of an 8-bit r8 matrix (qm_r8.h, rows n..n+7, no zero
 * points: the implicit zp for all) at sub-block j as qm__x_pack_s16 lays
 * it out, lo[g] / hi[g] lane i = row i's columns 2g, 2g + 1 / 16 + 2g,
 * 17 + 2g less zp: each run (4 columns of the 8 rows) widened and its
 * lanes put in place, with no gather of rows. */
QM__I8_AI void qm__x_r8q8_s16(const qm__qmat *m, uint32_t n, size_t j, short zp, __m256i lo[8],
                              __m256i hi[8])
{
    const uint8_t *g = m->w + (size_t)n * m->row_bytes + 256 * j;
    const __m256i z = _mm256_set1_epi16(zp), ev = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int q = 0; q < 8; q++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(g + 32 * q));
        /* rows 0-3 and 4-7: per row, the pairs (4q, 4q + 1), (4q + 2, 4q + 3) */
        __m256i a = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), z);
        __m256i b = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)), z);
        a = _mm256_permutevar8x32_epi32(a, ev);
        b = _mm256_permutevar8x32_epi32(b, ev);
        __m256i *o = q < 4 ? lo + 2 * q : hi + 2 * (q - 4);
        o[0] = _mm256_permute2x128_si256(a, b, 0x20);
        o[1] = _mm256_permute2x128_si256(a, b, 0x31);
    }
}

/* qm__i8_pack_s16_c on vectors. */
static inline void qm__x_pack_s16(const qm__qmat *m, uint32_t n0, uint32_t nr, size_t j0,
                                  size_t j1, uint8_t *pan)
{
    uint32_t spb = qm__i8_spb(m);
    for (size_t j = j0; j < j1; j++)
        for (uint32_t h = 0; h < 16; h += 8) {
            __m256i lo[8], hi[8];
            if (m->r8 && m->bits == 8 && h + 8 <= nr && !m->zp) {
                qm__x_r8q8_s16(m, n0 + h, j,
                               (short)qm__qmat_zp(m, n0 + h, (uint32_t)(j / spb)), lo, hi);
                uint8_t *p = pan + 1024 * (j - j0) + 4 * h;
                for (int g = 0; g < 8; g++) {
                    _mm256_storeu_si256((__m256i *)(p + 64 * g), lo[g]);
                    _mm256_storeu_si256((__m256i *)(p + 64 * (g + 8)), hi[g]);
                }
                continue;
            }
            for (uint32_t i = 0; i < 8; i++) {
                __m256i v = qm__x_row_u8(m, n0, nr, h + i, j);
                __m256i zp = _mm256_set1_epi16(
                    h + i < nr ? (short)qm__qmat_zp(m, n0 + h + i, (uint32_t)(j / spb)) : 0);
                lo[i] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), zp);
                hi[i] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)), zp);
                if (h + i >= nr)
                    lo[i] = hi[i] = _mm256_setzero_si256();
            }
            qm__x_tr8(lo);
            qm__x_tr8(hi);
            uint8_t *p = pan + 1024 * (j - j0) + 4 * h;
            for (int g = 0; g < 8; g++) {
                _mm256_storeu_si256((__m256i *)(p + 64 * g), lo[g]);
                _mm256_storeu_si256((__m256i *)(p + 64 * (g + 8)), hi[g]);
            }
        }
}

/* 8 scales of row n from block b0 as f32 (zeros past nblk). */
QM__I8_AI __m256i qm__x_scales8(const qm__qmat *m, uint32_t n, uint32_t b0)
{
    uint32_t cnt = m->nblk - b0 < 8 ? m->nblk - b0 : 8;
    size_t i = (size_t)n * m->nblk + b0;
    if (m->scale_dtype == QM_DTYPE_F32) {
        float tmp[8] = {0};
        const float *p = (const float *)m->scales + i;
        if (cnt < 8) {
            memcpy(tmp, p, 4 * cnt);
            p = tmp;
        }
        return _mm256_castps_si256(_mm256_loadu_ps(p));
    }
    uint16_t tmp[8] = {0};
    const uint16_t *p = (const uint16_t *)m->scales + i;
    if (cnt < 8) {
        memcpy(tmp, p, 2 * cnt);
        p = tmp;
    }
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (m->scale_dtype == QM_DTYPE_F16)
        return _mm256_castps_si256(_mm256_cvtph_ps(h));
    return _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16); /* bf16 */
}

/* qm__i8_params8_c on vectors (the scales of 8 rows; zero points in C). */
static inline void qm__x_params8(const qm__qmat *m, uint32_t n0, uint32_t nr, uint32_t h,
                                 float *sct, int32_t *zpt)
{
    if (zpt || nr < h + 8) {
        qm__i8_params8_c(m, n0, nr, h, sct, zpt);
        return;
    }
    uint32_t b0 = 0;
    for (; b0 + 8 <= m->nblk; b0 += 8) { /* whole groups of 8 blocks: plain loads */
        size_t at = (size_t)(n0 + h) * m->nblk + b0;
        __m256i r[8];
        if (m->scale_dtype == QM_DTYPE_F32) {
            const float *p = (const float *)m->scales + at;
#pragma GCC unroll 8
            for (uint32_t i = 0; i < 8; i++)
                r[i] = _mm256_castps_si256(_mm256_loadu_ps(p + (size_t)i * m->nblk));
        } else {
            const uint16_t *p = (const uint16_t *)m->scales + at;
            int f16 = m->scale_dtype == QM_DTYPE_F16;
#pragma GCC unroll 8
            for (uint32_t i = 0; i < 8; i++) {
                __m128i v = _mm_loadu_si128((const __m128i *)(p + (size_t)i * m->nblk));
                r[i] = f16 ? _mm256_castps_si256(_mm256_cvtph_ps(v))
                           : _mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16); /* bf16 */
            }
        }
        qm__x_tr8(r);
#pragma GCC unroll 8
        for (int b = 0; b < 8; b++)
            _mm256_storeu_si256((__m256i *)(sct + 16 * (size_t)(b0 + b) + h), r[b]);
    }
    for (; b0 < m->nblk; b0 += 8) {
        __m256i r[8];
        for (uint32_t i = 0; i < 8; i++)
            r[i] = qm__x_scales8(m, n0 + h + i, b0);
        qm__x_tr8(r);
        for (int b = 0; b < 8; b++)
            _mm256_storeu_si256((__m256i *)(sct + 16 * (size_t)(b0 + b) + h), r[b]);
    }
}

/* qm__i8_params_c on vectors. */
static inline void qm__x_params(const qm__qmat *m, uint32_t n0, uint32_t nr, float *sct,
                                int32_t *zpt)
{
    qm__x_params8(m, n0, nr, 0, sct, zpt);
    qm__x_params8(m, n0, nr, 8, sct, zpt);
}

/* Prefetches the scales of rows [n, n + 8) of m (those that exist). */
QM__I8_AI void qm__x_prefetch_scales(const qm__qmat *m, uint32_t n)
{
    size_t es = m->scale_dtype == QM_DTYPE_F32 ? 4 : 2;
    uint32_t end = n + 8 < m->n ? n + 8 : m->n;
    if (n >= end)
        return;
    const char *p = (const char *)m->scales + (size_t)n * m->nblk * es;
    size_t bytes = (size_t)(end - n) * m->nblk * es;
    for (size_t o = 0; o < bytes; o += 64)
        _mm_prefetch(p + o, QM__PF_HINT);
}

#endif /* QM_KERNEL_I8_X86_H */

/* The GEMV, once per inclusion with QM__V_FN defined. */
#ifdef QM__V_FN
#ifdef QM__V_DPBUSD
static inline __m256i qm__v_dpbusd_dot4(__m256i lo, __m256i hi, __m256i xl, __m256i xh)
{
    return QM__V_DPBUSD(QM__V_DPBUSD(_mm256_setzero_si256(), lo, xl), hi, xh);
}
#define QM__V_DOT4(lo, hi, xl, xh) qm__v_dpbusd_dot4(lo, hi, xl, xh)
#define QM__V_DOT8(w, x, x16)                                                                      \
    QM__V_DPBUSD(_mm256_setzero_si256(), _mm256_loadu_si256((const __m256i *)(w)),                 \
                 _mm256_loadu_si256((const __m256i *)(x)))
#endif
/* Where sub-block j stands: its block b and place w in it, stepped without
 * a division. */
typedef struct qm__v_pos {
    uint32_t b, w;
} qm__v_pos;

/* The epilogue of one sub-block j at p for 8 rows (lanes) of group h; ZP
 * and SPB1 (blocks of one sub-block) are constants at each call site. */
QM__I8_AI void qm__v_epi(const qm__i8_xrow *x, const float *sct, const int32_t *zpt, uint32_t spb,
                         size_t nse, size_t j, qm__v_pos *p, uint32_t h, __m256i s, __m256 *t,
                         __m256 *acc, const int ZP, const int SPB1)
{
    if (ZP)
        s = _mm256_sub_epi32(
            s, _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(zpt + 16 * (size_t)p->b + h)),
                                  _mm256_set1_epi32(x->sumq[j])));
    else
        s = _mm256_sub_epi32(s, _mm256_set1_epi32(x->zsum[j]));
    __m256 t0 = SPB1 || p->w == 0 ? _mm256_setzero_ps() : *t;
    *t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(x->dx[j]), t0);
    if (SPB1 || p->w + 1 == spb || j + 1 == nse) {
        *acc = _mm256_fmadd_ps(*t, _mm256_loadu_ps(sct + 16 * (size_t)p->b + h), *acc);
        p->b++;
        p->w = 0;
    } else {
        p->w++;
    }
}

/* 32 code bytes of a row from byte off (zeros past its end). */
QM__I8_AI __m256i qm__v_load32(const qm__qmat *m, const uint8_t *row, size_t off)
{
    uint8_t tmp[32];
    return _mm256_loadu_si256((const __m256i *)qm__x_bytes(m, row, off, 32, tmp));
}

/* Rows h..h+7 (pointers row[], clamped to the call's last row) times one
 * input: 4-bit, two sub-blocks per step; the 8 rows' 8-lane sums reduce to
 * one vector per sub-block (row i in lane i). Sub-blocks from jt on may
 * reach past a row's bytes and are read through a copy. */
/* One line of each of the 8 next rows at byte offset off (none when next
 * is NULL). */
QM__I8_AI void qm__v_prefetch8(const uint8_t *const *next, size_t off)
{
    if (!next) return;
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        _mm_prefetch((const char *)next[i] + off, QM__PF_HINT);
}

/* The int32 lanes of 8 rows (row r at p[r * stride]) reduced by the hadd
 * tree to one sum per row and 128-bit half: *lo holds rows 0-7's sums of
 * their first half, *hi those of their second. */
QM__I8_AI void qm__v_reduce8(const __m256i *p, size_t stride, __m256i *lo, __m256i *hi)
{
    __m256i X = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[stride]),
                                  _mm256_hadd_epi32(p[2 * stride], p[3 * stride]));
    __m256i Y = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4 * stride], p[5 * stride]),
                                  _mm256_hadd_epi32(p[6 * stride], p[7 * stride]));
    *lo = _mm256_permute2x128_si256(X, Y, 0x20);
    *hi = _mm256_permute2x128_si256(X, Y, 0x31);
}

QM__I8_AI __m256 qm__v_rows_q4(const qm__qmat *m, const uint8_t *const row[8],
                               const uint8_t *const *next, const qm__i8_xrow *x, const float *sct, const int32_t *zpt,
                               uint32_t h, const int ZP, const int SPB1)
{
    const size_t nsb = qm__i8_nsb(m), nse = qm__i8_nse(m);
    const size_t jt = m->row_bytes / 32 * 2; /* pairs [j, j + 2) below jt lie within the row */
    const uint32_t spb = qm__i8_spb(m);
    const __m256i lo4 = _mm256_set1_epi8(15);
    __m256 t = _mm256_setzero_ps(), acc = _mm256_setzero_ps();
    qm__v_pos pos = {0, 0};
    for (size_t j = 0; j < nsb; j += 2) {
        __m256i xa = _mm256_loadu_si256((const __m256i *)(x->q + 32 * j));
        __m256i xb = _mm256_loadu_si256((const __m256i *)(x->q + 32 * j + 32));
        __m256i xl = _mm256_permute2x128_si256(xa, xb, 0x20);
        __m256i xh = _mm256_permute2x128_si256(xa, xb, 0x31);
        if ((j & 2) == 0) /* one line of each next row per 64 bytes */
            qm__v_prefetch8(next, 16 * j);
        __m256i p[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            __m256i v = j < jt ? _mm256_loadu_si256((const __m256i *)(row[i] + 16 * j))
                               : qm__v_load32(m, row[i], 16 * j);
            __m256i lo = _mm256_and_si256(v, lo4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
            p[i] = QM__V_DOT4(lo, hi, xl, xh);
        }
        __m256i lo, hi;
        qm__v_reduce8(p, 1, &lo, &hi);
        qm__v_epi(x, sct, zpt, spb, nse, j, &pos, h, lo, &t, &acc, ZP, SPB1);
        if (j + 1 < nse) qm__v_epi(x, sct, zpt, spb, nse, j + 1, &pos, h, hi, &t, &acc, ZP, SPB1);
    }
    return acc;
}

/* The same for 8-bit codes, one sub-block per step. */
QM__I8_AI __m256 qm__v_rows_q8(const qm__qmat *m, const uint8_t *const row[8],
                               const uint8_t *const *next, const qm__i8_xrow *x, const float *sct, const int32_t *zpt,
                               uint32_t h, const int ZP, const int SPB1)
{
    const size_t nse = qm__i8_nse(m), jt = m->row_bytes / 32;
    const uint32_t spb = qm__i8_spb(m);
    __m256 t = _mm256_setzero_ps(), acc = _mm256_setzero_ps();
    qm__v_pos pos = {0, 0};
    for (size_t j = 0; j < nse; j++) {
        if ((j & 1) == 0) qm__v_prefetch8(next, 32 * j);
        __m256i p[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            uint8_t tmp[32];
            const uint8_t *w = j < jt ? row[i] + 32 * j : qm__x_bytes(m, row[i], 32 * j, 32, tmp);
            p[i] = QM__V_DOT8(w, x->q + 32 * j, x->q16 + 32 * j);
        }
        __m256i lo, hi;
        qm__v_reduce8(p, 1, &lo, &hi);
        qm__v_epi(x, sct, zpt, spb, nse, j, &pos, h, _mm256_add_epi32(lo, hi), &t, &acc, ZP, SPB1);
    }
    return acc;
}

/* One 4-bit row's two sub-blocks at p, as QM__V_DOT4's 8 lanes. */
QM__I8_AI __m256i qm__v_dot_at(const uint8_t *p, __m256i lo4, __m256i xl, __m256i xh)
{
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return QM__V_DOT4(_mm256_and_si256(v, lo4), _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4), xl,
                      xh);
}

#ifdef QM__V_DPBUSD512
/* Two chunks of one 4-bit row at p (64 bytes) in one 512-bit vector, xp
 * as qm__v_xpairs orders it: each 256-bit half is qm__v_dot_at's lanes of
 * its chunk. The nibbles are split with 32-bit shifts (AVX-512F): the byte
 * mask drops what crosses a byte either way. */
QM__I8_AI __m512i qm__v_dot2_at(const uint8_t *p, const __m256i *xp)
{
    const __m512i lo4 = _mm512_set1_epi8(15);
    __m512i v = _mm512_loadu_si512((const void *)p);
    __m512i lo = _mm512_and_si512(v, lo4), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), lo4);
    return QM__V_DPBUSD512(QM__V_DPBUSD512(_mm512_setzero_si512(), lo,
                                           _mm512_loadu_si512((const void *)xp)),
                           hi, _mm512_loadu_si512((const void *)(xp + 2)));
}
#endif

/* Whether m is the common case qm__v_b32 runs: implicit zero point,
 * blocks of 32 columns (one sub-block each), whole pairs of sub-blocks and
 * rows of exactly those bytes (Q4_0 and Q8_0, and the symmetric banks every
 * family imports to). */
QM__I8_AI int qm__v_is_b32(const qm__qmat *m)
{
    return (m->bits == 4 || m->bits == 8) && !m->zp && qm__i8_spb(m) == 1 && m->k % 64 == 0 &&
           m->row_bytes == (size_t)m->k * m->bits / 8;
}

/* One input's codes for qm__v_pass1's 4-bit dot products: per pair of
 * sub-blocks q, the (xl, xh) vectors qm__v_rows_q4 builds in its loop,
 * built once a call. */
QM__I8_AI void qm__v_xpairs(const qm__i8_xrow *x, size_t np, __m256i *xp)
{
    for (size_t q = 0; q < np; q++) {
        __m256i xa = _mm256_loadu_si256((const __m256i *)(x->q + 64 * q));
        __m256i xb = _mm256_loadu_si256((const __m256i *)(x->q + 64 * q + 32));
        xp[2 * q] = _mm256_permute2x128_si256(xa, xb, 0x20);
        xp[2 * q + 1] = _mm256_permute2x128_si256(xa, xb, 0x31);
    }
#ifdef QM__V_DPBUSD512
    /* For qm__v_dot2_at: each whole pair of chunks (c, c + 1) as the
     * 512-bit [xl c | xl c+1], [xh c | xh c+1]; an odd last chunk stays. */
    for (size_t q = 0; q + 2 <= np; q += 2) {
        __m256i xh0 = xp[2 * q + 1];
        xp[2 * q + 1] = xp[2 * q + 2];
        xp[2 * q + 2] = xh0;
    }
#endif
}

/* The first of qm__v_b32's two passes over a group of 8 rows from r0 (rb
 * bytes apart): each row's nc 32-byte chunks in order, so the group is
 * read as one linear stream (8 rows read side by side, as qm__v_rows_q4
 * does, reach about two thirds of the read bandwidth of a linear read on
 * Zen 3: docs/BENCHMARKS.md), chunk c of row i giving part[i nc + c]:
 * 4-bit, QM__V_DOT4's lanes of sub-blocks 2c and 2c + 1 (xp: the input's
 * pairs); 8-bit, QM__V_DOT8's of sub-block c. pf: the next group's bytes,
 * prefetched one line per 64 bytes read (NULL: none). */
QM__I8_AI void qm__v_pass1(const uint8_t *r0, size_t rb, size_t nc, const char *pf,
                           const __m256i *xp, const qm__i8_xrow *x, __m256i *part, const int BITS)
{
    const __m256i lo4 = _mm256_set1_epi8(15);
    for (uint32_t i = 0; i < 8; i++) {
        const uint8_t *r = r0 + i * rb;
        __m256i *pi = part + i * nc;
        const char *pfi = pf ? pf + i * rb : NULL;
        size_t c = 0;
#ifdef QM__V_DPBUSD512
        if (BITS == 4)
            for (; c + 2 <= nc; c += 2) {
                if (pfi)
                    _mm_prefetch(pfi + 32 * c, QM__PF_HINT);
                _mm512_storeu_si512((void *)(pi + c), qm__v_dot2_at(r + 32 * c, xp + 2 * c));
            }
#endif
        for (; c < nc; c++) {
            if (pfi && (c & 1) == 0)
                _mm_prefetch(pfi + 32 * c, QM__PF_HINT);
            pi[c] = BITS == 4 ? qm__v_dot_at(r + 32 * c, lo4, xp[2 * c], xp[2 * c + 1])
                              : QM__V_DOT8(r + 32 * c, x->q + 32 * c, x->q16 + 32 * c);
        }
    }
}

/* qm__v_pass1 of 4-bit codes for two inputs at once (their pairs xp0 /
 * xp1, lanes into part0 / part1): each chunk is loaded and split into its
 * nibbles once for both; every lane's sum is the one qm__v_pass1 makes. */
QM__I8_AI void qm__v_pass1_2(const uint8_t *r0, size_t rb, size_t nc, const char *pf,
                             const __m256i *xp0, const __m256i *xp1, __m256i *part0,
                             __m256i *part1)
{
    const __m256i lo4 = _mm256_set1_epi8(15);
    for (uint32_t i = 0; i < 8; i++) {
        const uint8_t *r = r0 + i * rb;
        __m256i *p0 = part0 + i * nc, *p1 = part1 + i * nc;
        const char *pfi = pf ? pf + i * rb : NULL;
        size_t c = 0;
#ifdef QM__V_DPBUSD512
        const __m512i lo4z = _mm512_set1_epi8(15);
        for (; c + 2 <= nc; c += 2) {
            if (pfi)
                _mm_prefetch(pfi + 32 * c, QM__PF_HINT);
            __m512i v = _mm512_loadu_si512((const void *)(r + 32 * c));
            __m512i lo = _mm512_and_si512(v, lo4z);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), lo4z);
            const __m256i *a = xp0 + 2 * c, *b = xp1 + 2 * c;
            _mm512_storeu_si512(
                (void *)(p0 + c),
                QM__V_DPBUSD512(QM__V_DPBUSD512(_mm512_setzero_si512(), lo,
                                                _mm512_loadu_si512((const void *)a)),
                                hi, _mm512_loadu_si512((const void *)(a + 2))));
            _mm512_storeu_si512(
                (void *)(p1 + c),
                QM__V_DPBUSD512(QM__V_DPBUSD512(_mm512_setzero_si512(), lo,
                                                _mm512_loadu_si512((const void *)b)),
                                hi, _mm512_loadu_si512((const void *)(b + 2))));
        }
#endif
        for (; c < nc; c++) {
            if (pfi && (c & 1) == 0)
                _mm_prefetch(pfi + 32 * c, QM__PF_HINT);
            __m256i v = _mm256_loadu_si256((const __m256i *)(r + 32 * c));
            __m256i lo = _mm256_and_si256(v, lo4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
            p0[c] = QM__V_DOT4(lo, hi, xp0[2 * c], xp0[2 * c + 1]);
            p1[c] = QM__V_DOT4(lo, hi, xp1[2 * c], xp1[2 * c + 1]);
        }
    }
}

/* One sub-block's epilogue on 8 rows at once, blocks of one sub-block:
 * t = fma(S - zsum, dx, +0), acc = fma(t, scale, acc) (the canonical order). */
QM__I8_AI __m256 qm__v_epi_b32(const qm__i8_xrow *x, const float *sct, uint32_t h, size_t j,
                               __m256i s, __m256 acc)
{
    s = _mm256_sub_epi32(s, _mm256_set1_epi32(x->zsum[j]));
    __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(x->dx[j]),
                               _mm256_setzero_ps());
    return _mm256_fmadd_ps(t, _mm256_loadu_ps(sct + 16 * j + h), acc);
}

/* The second pass: per chunk c, the 8 rows' lanes reduced to one per row
 * (the hadd tree of qm__v_rows_q4 / _q8) and finished: 4-bit, sub-blocks
 * 2c and 2c + 1 (one per 128-bit half); 8-bit, sub-block c (both halves
 * added). */
QM__I8_AI __m256 qm__v_pass2(const __m256i *part, size_t nc, const qm__i8_xrow *x,
                             const float *sct, uint32_t h, const int BITS)
{
    __m256 acc = _mm256_setzero_ps();
    for (size_t c = 0; c < nc; c++) {
        __m256i lo, hi;
        qm__v_reduce8(part + c, nc, &lo, &hi);
        if (BITS == 4) {
            acc = qm__v_epi_b32(x, sct, h, 2 * c, lo, acc);
            acc = qm__v_epi_b32(x, sct, h, 2 * c + 1, hi, acc);
        } else {
            acc = qm__v_epi_b32(x, sct, h, c, _mm256_add_epi32(lo, hi), acc);
        }
    }
    return acc;
}

/* The whole groups of a call in the common case, in two passes each: the
 * codes (qm__v_pass1), then the group's scales (taken now, so their
 * latency hid behind the code reads; this call's and the next call's are
 * prefetched at its start), the reduction and the epilogue. The same exact
 * sums and float operations as qm__v_rows, so the same bits. Returns the
 * rows done. */
static uint32_t qm__v_b32(const qm__qmat *m, uint32_t n0, uint32_t nr, const float *xq, size_t ldx,
                          uint32_t nx, float *y, size_t ldy, const qm__i8_scratch *s)
{
    const uint32_t full = nr / 8 * 8;
    const size_t nc = m->row_bytes / 32;
    __m256i *part = (__m256i *)s->pan, *xp = part + 8 * nc; /* 8 x nc parts, then nsb pairs */
    for (uint32_t h = 0; h < nr + 16; h += 8)
        qm__x_prefetch_scales(m, n0 + h);
    for (uint32_t r = 0; r < nx; r++) {
        qm__i8_xrow x = qm__i8_xrow_at(m, xq + (size_t)r * ldx);
        if (m->bits == 4)
            qm__v_xpairs(&x, nc, xp);
        for (uint32_t h = 0; h < full; h += 8) {
            const uint8_t *r0 = m->w + (size_t)(n0 + h) * m->row_bytes;
            const char *pf = !r && n0 + h + 16 <= m->n ? (const char *)r0 + 8 * m->row_bytes : NULL;
            if (m->bits == 4)
                qm__v_pass1(r0, m->row_bytes, nc, pf, xp, &x, part, 4);
            else
                qm__v_pass1(r0, m->row_bytes, nc, pf, xp, &x, part, 8);
            if (!r)
                qm__x_params8(m, n0, nr, h, s->sct, NULL);
            _mm256_storeu_ps(y + (size_t)r * ldy + n0 + h,
                             m->bits == 4 ? qm__v_pass2(part, nc, &x, s->sct, h, 4)
                                          : qm__v_pass2(part, nc, &x, s->sct, h, 8));
        }
    }
    return full;
}

/* qm__v_b32 for 4-bit codes and two or more inputs: inputs two at a time
 * (a group's codes loaded and split into nibbles once for both), an odd
 * last one alone. The same sums and epilogue, so the same bits. */
static uint32_t qm__v_b32_pairs(const qm__qmat *m, uint32_t n0, uint32_t nr, const float *xq,
                                size_t ldx, uint32_t nx, float *y, size_t ldy,
                                const qm__i8_scratch *s)
{
    const uint32_t full = nr / 8 * 8;
    const size_t nc = m->row_bytes / 32;
    /* Two inputs' 8 x nc parts, then their nsb pairs each. */
    __m256i *part0 = (__m256i *)s->pan, *part1 = part0 + 8 * nc;
    __m256i *xp0 = part1 + 8 * nc, *xp1 = xp0 + 2 * nc;
    for (uint32_t h = 0; h < nr + 16; h += 8)
        qm__x_prefetch_scales(m, n0 + h);
    for (uint32_t r = 0; r < nx; r += 2) {
        const int two = r + 1 < nx;
        qm__i8_xrow x0 = qm__i8_xrow_at(m, xq + (size_t)r * ldx);
        qm__i8_xrow x1 = two ? qm__i8_xrow_at(m, xq + (size_t)(r + 1) * ldx) : x0;
        qm__v_xpairs(&x0, nc, xp0);
        if (two)
            qm__v_xpairs(&x1, nc, xp1);
        for (uint32_t h = 0; h < full; h += 8) {
            const uint8_t *r0 = m->w + (size_t)(n0 + h) * m->row_bytes;
            const char *pf = !r && n0 + h + 16 <= m->n ? (const char *)r0 + 8 * m->row_bytes : NULL;
            if (two)
                qm__v_pass1_2(r0, m->row_bytes, nc, pf, xp0, xp1, part0, part1);
            else
                qm__v_pass1(r0, m->row_bytes, nc, pf, xp0, &x0, part0, 4);
            if (!r)
                qm__x_params8(m, n0, nr, h, s->sct, NULL);
            float *y0 = y + (size_t)r * ldy + n0 + h;
            _mm256_storeu_ps(y0, qm__v_pass2(part0, nc, &x0, s->sct, h, 4));
            if (two)
                _mm256_storeu_ps(y0 + ldy, qm__v_pass2(part1, nc, &x1, s->sct, h, 4));
        }
    }
    return full;
}

/* One group of 8 rows times one input, specialised on zero points and
 * blocks of one sub-block. */
QM__I8_AI __m256 qm__v_rows(const qm__qmat *m, const uint8_t *const row[8],
                            const uint8_t *const *next, const qm__i8_xrow *x, const float *sct,
                            const int32_t *zpt, uint32_t h)
{
    int spb1 = qm__i8_spb(m) == 1;
    if (m->bits == 4) {
        if (zpt)
            return spb1 ? qm__v_rows_q4(m, row, next, x, sct, zpt, h, 1, 1)
                        : qm__v_rows_q4(m, row, next, x, sct, zpt, h, 1, 0);
        return spb1 ? qm__v_rows_q4(m, row, next, x, sct, zpt, h, 0, 1)
                    : qm__v_rows_q4(m, row, next, x, sct, zpt, h, 0, 0);
    }
    if (zpt)
        return spb1 ? qm__v_rows_q8(m, row, next, x, sct, zpt, h, 1, 1)
                    : qm__v_rows_q8(m, row, next, x, sct, zpt, h, 1, 0);
    return spb1 ? qm__v_rows_q8(m, row, next, x, sct, zpt, h, 0, 1)
                : qm__v_rows_q8(m, row, next, x, sct, zpt, h, 0, 0);
}

#ifdef QM__V_R8
/* One step of an r8 group's sub-block: S plus, per row (lane), the dot of
 * its 4 low-nibble codes (lo) with the input's 4 bytes xl and of its 4
 * high-nibble codes (hi) with xh (each broadcast to every lane); and the
 * rows' int32 sums of a sub-block's accumulators A (QM__V_R8_ACCS of them:
 * step q of the 4 goes to A[q % QM__V_R8_ACCS]). A vpdpbusd ISA sums into
 * int32 lanes directly, in two accumulators so that no chain of dependent
 * vpdpbusd is longer than 4; AVX2 sums vpmaddubsw pairs in int16 lanes (8
 * steps of |s| <= 3810 a sub-block: no wrap) and widens once. Integer
 * sums: any split gives the same ones. */
#ifdef QM__V_DPBUSD
#define QM__V_R8_ACCS 2
#define QM__V_R8_STEP(S, lo, hi, xl, xh) S = QM__V_DPBUSD(QM__V_DPBUSD(S, lo, xl), hi, xh)
#define QM__V_R8_SUMS(A) _mm256_add_epi32((A)[0], (A)[1])
#define QM__V_R8_SUMS_N(A, N) QM__V_R8_SUMS(A)
#else
#define QM__V_R8_ACCS 1
#define QM__V_R8_STEP(S, lo, hi, xl, xh)                                                          \
    S = _mm256_add_epi16(_mm256_add_epi16(S, _mm256_maddubs_epi16(lo, xl)),                       \
                         _mm256_maddubs_epi16(hi, xh))
#define QM__V_R8_SUMS(A) _mm256_madd_epi16((A)[0], _mm256_set1_epi16(1))
#define QM__V_R8_SUMS_N(A, N)                                                                      \
    ((N) == 2 ? _mm256_add_epi32(QM__V_R8_SUMS(A),                                                 \
                                 _mm256_madd_epi16((A)[1], _mm256_set1_epi16(1)))                  \
              : QM__V_R8_SUMS(A))
#endif

/* A group of 8 rows of an r8 matrix (qm_r8.h) at p times NX (1-4) inputs
 * x: per sub-block j, 4 loads of 8 rows x 4 code bytes, each nibble half
 * against its 4 input bytes broadcast (QM__V_R8_STEP), one int32 sum per
 * row, then the canonical epilogue (qm__v_epi_b32). The same integer sums
 * as qm__v_b32, so the same bits. pf: the next group (NULL: none), one
 * line asked for per 64 bytes read.
 *
 * CB (a 4-bit code-book view, qm__qmat.cb): each nibble looked up first
 * (vpshufb) to QM__CB_ZP + cb[q], 0..24, whose zero point the input's zsum
 * carries: the integers sum (cb[q]) x, those of the int8 matrix of codes
 * 128 + cb[q], hence its bits. On AVX2 two int16 accumulators a sub-block
 * then (4 vpmaddubsw pairs each of at most 2 * 24 * 127: no wrap). */
QM__I8_AI void qm__v_r8_group(const qm__qmat *m, const uint8_t *p, const char *pf,
                              const qm__i8_xrow *x, const float *sct, uint32_t h, float *y,
                              size_t ldy, const int CB, const int NX)
{
    const size_t nsb = m->k / 32;
    const __m256i lo4 = _mm256_set1_epi8(15);
    __m256i lut = lo4;
    if (CB) {
        uint8_t t[32];
        for (int i = 0; i < 32; i++)
            t[i] = (uint8_t)(QM__CB_ZP + m->cb[i & 15]);
        lut = _mm256_loadu_si256((const __m256i *)t);
    }
    const int ACCS = CB ? 2 : QM__V_R8_ACCS;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (size_t j = 0; j < nsb; j++, p += 128) {
        if (pf) {
            _mm_prefetch(pf + 128 * j, QM__PF_HINT);
            _mm_prefetch(pf + 128 * j + 64, QM__PF_HINT);
        }
        __m256i s0[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        __m256i s1[2] = {s0[0], s0[0]}, s2[2] = {s0[0], s0[0]}, s3[2] = {s0[0], s0[0]};
#pragma GCC unroll 4
        for (size_t q = 0; q < 4; q++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * q));
            __m256i lo = _mm256_and_si256(v, lo4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
            if (CB) {
                lo = _mm256_shuffle_epi8(lut, lo);
                hi = _mm256_shuffle_epi8(lut, hi);
            }
            size_t o = 32 * j + 4 * q, a = q % ACCS;
#define QM__R8_STEP(S, I)                                                                          \
    do {                                                                                           \
        int32_t xl_, xh_;                                                                          \
        memcpy(&xl_, x[I].q + o, 4);                                                               \
        memcpy(&xh_, x[I].q + o + 16, 4);                                                          \
        QM__V_R8_STEP(S[a], lo, hi, _mm256_set1_epi32(xl_), _mm256_set1_epi32(xh_));               \
    } while (0)
            QM__R8_STEP(s0, 0);
            if (NX > 1)
                QM__R8_STEP(s1, 1);
            if (NX > 2)
                QM__R8_STEP(s2, 2);
            if (NX > 3)
                QM__R8_STEP(s3, 3);
#undef QM__R8_STEP
        }
        acc0 = qm__v_epi_b32(&x[0], sct, h, j, QM__V_R8_SUMS_N(s0, ACCS), acc0);
        if (NX > 1)
            acc1 = qm__v_epi_b32(&x[1], sct, h, j, QM__V_R8_SUMS_N(s1, ACCS), acc1);
        if (NX > 2)
            acc2 = qm__v_epi_b32(&x[2], sct, h, j, QM__V_R8_SUMS_N(s2, ACCS), acc2);
        if (NX > 3)
            acc3 = qm__v_epi_b32(&x[3], sct, h, j, QM__V_R8_SUMS_N(s3, ACCS), acc3);
    }
    _mm256_storeu_ps(y, acc0);
    if (NX > 1)
        _mm256_storeu_ps(y + ldy, acc1);
    if (NX > 2)
        _mm256_storeu_ps(y + 2 * ldy, acc2);
    if (NX > 3)
        _mm256_storeu_ps(y + 3 * ldy, acc3);
}
#undef QM__V_R8_ACCS
#undef QM__V_R8_STEP
#undef QM__V_R8_SUMS
#undef QM__V_R8_SUMS_N

#ifdef QM__V_R8_Q8
/* A group of 8 rows of an 8-bit r8 matrix (qm_r8.h: sub-block j is the
 * group's bytes 256j..256j+255, 8 runs of 8 rows x 4 code bytes) at p times
 * NX (1-4) inputs x: per run, one load against the run's 4 input bytes
 * broadcast, each row's sum in its own int32 lane, in two accumulators a
 * sub-block (no chain of dependent vpdpbusd longer than 4). A vpdpbusd ISA
 * takes the codes c (u8) as they are, exact in int32 (at most 4 x 255 x
 * 127 a step): the row layout's integers. AVX2's vpmaddubsw takes u8 x s8
 * too, but codes c (0..255) times |x| <= 127 would saturate its pairs: the
 * code with its top bit flipped is c - 128 (s8), and |c - 128| (u8, at most
 * 128) against x with the sign of c - 128 makes pairs of at most 2 * 128 *
 * 127 = 32512, widened at once; that sums (c - 128) x, the row layout's
 * sum less its zsum, which is added back. The canonical epilogue
 * (qm__v_epi_b32) takes zsum off again: the same integers, hence the same
 * bits, as qm__v_b32. pf: the next group (NULL: none), one line asked for
 * per 64 bytes read. */
QM__I8_AI void qm__v_r8q8_group(const qm__qmat *m, const uint8_t *p, const char *pf,
                                const qm__i8_xrow *x, const float *sct, uint32_t h, float *y,
                                size_t ldy, const int NX)
{
    const size_t nsb = m->k / 32;
#ifndef QM__V_DPBUSD
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
#endif
    __m256 acc[4];
    for (int i = 0; i < NX; i++)
        acc[i] = _mm256_setzero_ps();
    for (size_t j = 0; j < nsb; j++, p += 256) {
        if (pf)
            for (int l = 0; l < 4; l++)
                _mm_prefetch(pf + 256 * j + 64 * l, QM__PF_HINT);
        __m256i sum[4][2];
        for (int i = 0; i < NX; i++)
            sum[i][0] = sum[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (size_t q = 0; q < 8; q++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(p + 32 * q));
#ifndef QM__V_DPBUSD
            w = _mm256_xor_si256(w, flip);
            __m256i aw = _mm256_abs_epi8(w);
#endif
            for (int i = 0; i < NX; i++) {
                int32_t xb;
                memcpy(&xb, x[i].q + 32 * j + 4 * q, 4);
                __m256i xv = _mm256_set1_epi32(xb), *s = &sum[i][q % 2];
#ifdef QM__V_DPBUSD
                *s = QM__V_DPBUSD(*s, w, xv);
#else
                __m256i t = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w));
                *s = _mm256_add_epi32(*s, _mm256_madd_epi16(t, ones));
#endif
            }
        }
        for (int i = 0; i < NX; i++) {
            __m256i s = _mm256_add_epi32(sum[i][0], sum[i][1]);
#ifndef QM__V_DPBUSD
            s = _mm256_add_epi32(s, _mm256_set1_epi32(x[i].zsum[j]));
#endif
            acc[i] = qm__v_epi_b32(&x[i], sct, h, j, s, acc[i]);
        }
    }
    for (int i = 0; i < NX; i++)
        _mm256_storeu_ps(y + (size_t)i * ldy, acc[i]);
}
#endif

/* fn(args..., NX) with NX the constant 1-4 that cnt is. */
#define QM__V_BY_NX(fn, cnt, ...)                                                                  \
    ((cnt) == 1   ? fn(__VA_ARGS__, 1)                                                             \
     : (cnt) == 2 ? fn(__VA_ARGS__, 2)                                                             \
     : (cnt) == 3 ? fn(__VA_ARGS__, 3)                                                             \
                  : fn(__VA_ARGS__, 4))

/* Rows [n0, n0 + nr) of an r8 matrix (n0 and nr multiples of 8) times nx
 * inputs, up to 4 at a time: each group's scales taken once, the next
 * group's codes and scales prefetched while the first inputs run. One
 * group, one stream, on 256-bit vectors on every ISA: reading a call's two
 * groups side by side on 512-bit vectors (one vpdpbusd for both) was
 * slower from memory, two streams a group apart (Zen 4, qmoe_cpu_bench
 * --r8 1, Qwen3 shape, T = 1: 0.65 against 0.61 ms a call on 2 threads,
 * 0.90 against 0.78 on one; T = 4 and 8 4-10% too). On AVX2 the same
 * (Zen 3, 2026-12-06): two groups at T = 1 with the input's broadcasts
 * and the epilogue's shared, 10% faster than one on a matrix in L3
 * (qmoe_kernel_micro), was 9% slower from memory on the Qwen3 shape (0.865
 * against 0.786 ms a call, 8 rounds alternated) and level on GPT-OSS's and
 * Mixtral's; and the s16 sums kept in place with inline asm (GCC spills
 * the tree it makes of them at 2-4 inputs), 13-19% faster in L3 at 2 and
 * 4 inputs, was level from memory. From memory a call is bound by the
 * reads, not by these instructions. */
static void qm__v_r8(const qm__qmat *m, uint32_t n0, uint32_t nr, const float *xq, size_t ldx,
                     uint32_t nx, float *y, size_t ldy, const qm__i8_scratch *s)
{
    const size_t gb = 8 * m->row_bytes;
    for (uint32_t h = 0; h < nr; h += 8) {
        const uint8_t *p = m->w + (size_t)(n0 + h) * m->row_bytes;
        const char *pf = n0 + h + 16 <= m->n ? (const char *)p + gb : NULL;
        qm__x_params8(m, n0, nr, h, s->sct, NULL);
        qm__x_prefetch_scales(m, n0 + h + 8);
        for (uint32_t r = 0; r < nx; r += 4) {
            qm__i8_xrow x[4];
            uint32_t cnt = nx - r < 4 ? nx - r : 4;
            for (uint32_t i = 0; i < cnt; i++)
                x[i] = qm__i8_xrow_at(m, xq + (size_t)(r + i) * ldx);
            float *yo = y + (size_t)r * ldy + n0 + h;
            const char *pfr = r ? NULL : pf;
#ifdef QM__V_R8_Q8
            if (m->bits == 8) {
                QM__V_BY_NX(qm__v_r8q8_group, cnt, m, p, pfr, x, s->sct, h, yo, ldy);
                continue;
            }
#endif
            if (m->cb)
                QM__V_BY_NX(qm__v_r8_group, cnt, m, p, pfr, x, s->sct, h, yo, ldy, 1);
            else
                QM__V_BY_NX(qm__v_r8_group, cnt, m, p, pfr, x, s->sct, h, yo, ldy, 0);
        }
    }
}
#undef QM__V_BY_NX
#endif

/* Rows [n0, n1) times nx inputs, 8 rows at a time, one input at a time.
 * Each group's scales are taken just before it, and while a group runs its
 * first input the next 8 rows' codes (one line per 64 bytes read) and
 * scales (of this call or the next tile) are prefetched: rows of an expert are short streams (1-4 KiB) that the
 * hardware prefetcher would reach only late. */
static void QM__V_FN(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq, size_t ldx,
                     uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__i8_scratch s = qm__i8_scratch_at(m, scratch);
    uint32_t nr = n1 - n0;
#ifdef QM__V_R8
    if (m->r8) {
        qm__v_r8(m, n0, nr, xq, ldx, nx, y, ldy, &s);
        return;
    }
#endif
    int32_t *zpt = m->zp ? s.zpt : NULL;
    uint32_t h0 = !qm__v_is_b32(m)            ? 0
                  : m->bits == 4 && nx > 1 ? qm__v_b32_pairs(m, n0, nr, xq, ldx, nx, y, ldy, &s)
                                           : qm__v_b32(m, n0, nr, xq, ldx, nx, y, ldy, &s);
    for (uint32_t h = h0; h < nr; h += 8) {
        qm__x_params8(m, n0, nr, h, s.sct, zpt);
        qm__x_prefetch_scales(m, n0 + h + 8);
        const uint8_t *row[8], *next[8];
        for (uint32_t i = 0; i < 8; i++) {
            row[i] = m->w + (size_t)(n0 + (h + i < nr ? h + i : nr - 1)) * m->row_bytes;
            uint32_t nn = n0 + h + 8 + i < m->n ? n0 + h + 8 + i : m->n - 1;
            next[i] = m->w + (size_t)nn * m->row_bytes;
        }

        uint32_t cnt = nr - h < 8 ? nr - h : 8;
        for (uint32_t r = 0; r < nx; r++) {
            qm__i8_xrow x = qm__i8_xrow_at(m, xq + (size_t)r * ldx);
            __m256 acc = qm__v_rows(m, row, r ? NULL : next, &x, s.sct, zpt, h);
            float out[8];
            _mm256_storeu_ps(out, acc);
            memcpy(y + (size_t)r * ldy + n0 + h, out, sizeof(float) * cnt);
        }
    }
}
#endif /* QM__V_FN */
