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

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QM__CB_X86 1
#endif

size_t qm__cb_tile_floats(const qm__qmat *m)
{
    /* The 8-bit tile (k bytes a row), then rows in 4 bits (k / 2) and the
     * r8 interleave's 8 rows of them. */
    return ((size_t)QM__TILE_ROWS * m->k + (size_t)(QM__TILE_ROWS + 8) * ((m->k + 1) / 2) + 63) /
               4 / 16 * 16 + 16;
}

void qm__cb_rows_c(const qm__qmat *m, uint32_t n0, uint32_t n1, uint8_t *out)
{
    for (uint32_t n = n0; n < n1; n++) {
        const uint8_t *src = m->w + (size_t)n * m->row_bytes;
        uint8_t *dst = out + (size_t)(n - n0) * m->k;
        for (uint32_t c = 0; c < m->k; c++)
            dst[c] = (uint8_t)(128 + m->cb[(src[c / 2] >> (4 * (c & 1))) & 15]);
    }
}

#if QM__CB_X86
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
            dst[c] = (uint8_t)(128 + m->cb[(src[c / 2] >> (4 * (c & 1))) & 15]);
    }
}
#endif

void qm__cb_rows(const qm__qmat *m, uint32_t n0, uint32_t n1, uint8_t *out)
{
#if QM__CB_X86
    if (__builtin_cpu_supports("ssse3")) {
        qm__cb_rows_ssse3(m, n0, n1, out);
        return;
    }
#endif
    qm__cb_rows_c(m, n0, n1, out);
}
