/* qm_codebook.c - 4-bit code books (qm_bank.h qm_codebook): a tile of a
 * code-book matrix's rows decoded into the 8-bit codes 128 + cb[q] that
 * every kernel reads (qm_kernels.h, qm__qmat.cb).
 *
 * Why decode a tile rather than teach each kernel the table: the bytes a
 * decode call streams from memory are the 4-bit rows (half of the 8-bit
 * bank the same weights make), and the 16 rows of one tile, decoded, are
 * at most a few hundred KiB that the kernel then reads from the core's
 * caches; every kernel, exact or fast, on every ISA, computes the 8-bit
 * matrix it already computes, so its outputs are those of the int8 bank
 * holding the same weights, bit for bit (tests/engine/test_kernels.c). */
#include <string.h>

#include "qm_kernels.h"
#include "qm_r8.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QM__CB_X86 1
#endif

size_t qm__cb_tile_floats(const qm__qmat *m)
{
    /* The 8-bit tile (k bytes a row), or the 4-bit one laid out in r8
     * (k / 2 bytes a row, qm__r8_interleave_from) in its first half. */
    return ((size_t)QM__TILE_ROWS * m->k + 63) / 4 / 16 * 16 + 16;
}

/* Byte o of row n's codes, in either layout. */
static inline uint8_t qm__cb_byte(const qm__qmat *m, uint32_t n, size_t o)
{
    return m->r8 ? m->w[qm__r8_offset(m->row_bytes, n, o)] : m->w[(size_t)n * m->row_bytes + o];
}

void qm__cb_rows_c(const qm__qmat *m, uint32_t n0, uint32_t n1, uint8_t *out)
{
    for (uint32_t n = n0; n < n1; n++) {
        uint8_t *dst = out + (size_t)(n - n0) * m->k;
        for (uint32_t c = 0; c < m->k; c++)
            dst[c] = (uint8_t)(128 + m->cb[(qm__cb_byte(m, n, c / 2) >> (4 * (c & 1))) & 15]);
    }
}

#if QM__CB_X86
/* An r8 matrix (qm_r8.h), a group of 8 rows and a sub-block at a time:
 * its 4 runs (dword q of rows 0..7 each) transposed back into the rows'
 * 16 bytes (rows i and i + 4 in one vector's lanes), each nibble looked
 * up (vpshufb), even and odd columns interleaved, each row's 32 codes
 * stored: the rows are never copied back in 4 bits first. */
__attribute__((target("avx2"))) static void qm__cb_rows_r8_avx2(const qm__qmat *m, uint32_t n0,
                                                                 uint32_t n1, uint8_t *out)
{
    uint8_t t[32];
    for (int i = 0; i < 32; i++)
        t[i] = (uint8_t)(128 + m->cb[i & 15]);
    const __m256i lut = _mm256_loadu_si256((const __m256i *)t), lo4 = _mm256_set1_epi8(15);
    const size_t nsb = m->k / 32;
    for (uint32_t g = n0; g < n1; g += 8) {
        const uint8_t *p = m->w + (size_t)g * m->row_bytes;
        uint8_t *o = out + (size_t)(g - n0) * m->k;
        for (size_t j = 0; j < nsb; j++, p += 128) {
            __m256i r0 = _mm256_loadu_si256((const __m256i *)p);
            __m256i r1 = _mm256_loadu_si256((const __m256i *)(p + 32));
            __m256i r2 = _mm256_loadu_si256((const __m256i *)(p + 64));
            __m256i r3 = _mm256_loadu_si256((const __m256i *)(p + 96));
            __m256i a = _mm256_unpacklo_epi32(r0, r1), b = _mm256_unpackhi_epi32(r0, r1);
            __m256i c = _mm256_unpacklo_epi32(r2, r3), d = _mm256_unpackhi_epi32(r2, r3);
            __m256i rows[4] = {_mm256_unpacklo_epi64(a, c), _mm256_unpackhi_epi64(a, c),
                               _mm256_unpacklo_epi64(b, d), _mm256_unpackhi_epi64(b, d)};
            for (int i = 0; i < 4; i++) {
                __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(rows[i], lo4));
                __m256i hi = _mm256_shuffle_epi8(
                    lut, _mm256_and_si256(_mm256_srli_epi16(rows[i], 4), lo4));
                __m256i x0 = _mm256_unpacklo_epi8(lo, hi), x1 = _mm256_unpackhi_epi8(lo, hi);
                _mm256_storeu_si256((__m256i *)(o + (size_t)i * m->k + 32 * j),
                                    _mm256_permute2x128_si256(x0, x1, 0x20));
                _mm256_storeu_si256((__m256i *)(o + (size_t)(i + 4) * m->k + 32 * j),
                                    _mm256_permute2x128_si256(x0, x1, 0x31));
            }
        }
    }
}

/* 32 columns (16 source bytes) a step: each nibble looked up in the table
 * (pshufb), the even columns' (low nibbles) and the odd columns' (high)
 * interleaved back into column order. */
__attribute__((target("ssse3"))) static void qm__cb_rows_ssse3(const qm__qmat *m, uint32_t n0,
                                                                uint32_t n1, uint8_t *out)
{
    uint8_t t[16];
    for (int i = 0; i < 16; i++)
        t[i] = (uint8_t)(128 + m->cb[i]);
    const __m128i lut = _mm_loadu_si128((const __m128i *)t), lo4 = _mm_set1_epi8(15);
    size_t whole = m->k / 32 * 32;
    for (uint32_t n = n0; n < n1; n++) {
        const uint8_t *src = m->w + (size_t)n * m->row_bytes;
        uint8_t *dst = out + (size_t)(n - n0) * m->k;
        for (size_t c = 0; c < whole; c += 32) {
            __m128i v = _mm_loadu_si128((const __m128i *)(src + c / 2));
            __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(v, lo4));
            __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), lo4));
            _mm_storeu_si128((__m128i *)(dst + c), _mm_unpacklo_epi8(lo, hi));
            _mm_storeu_si128((__m128i *)(dst + c + 16), _mm_unpackhi_epi8(lo, hi));
        }
        for (size_t c = whole; c < m->k; c++)
            dst[c] = (uint8_t)(128 + m->cb[(qm__cb_byte(m, n, c / 2) >> (4 * (c & 1))) & 15]);
    }
}
#endif

void qm__cb_rows(const qm__qmat *m, uint32_t n0, uint32_t n1, uint8_t *out)
{
#if QM__CB_X86
    if (m->r8 && m->k % 32 == 0 && n0 % 8 == 0 && (n1 - n0) % 8 == 0 &&
        __builtin_cpu_supports("avx2")) {
        qm__cb_rows_r8_avx2(m, n0, n1, out);
        return;
    }
    if (!m->r8 && __builtin_cpu_supports("ssse3")) {
        qm__cb_rows_ssse3(m, n0, n1, out);
        return;
    }
#endif
    qm__cb_rows_c(m, n0, n1, out);
}
