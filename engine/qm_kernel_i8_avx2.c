/* qm_kernel_i8_avx2.c - fast-mode kernel on AVX2 (compiled with -mavx2 -mfma):
 * vpmaddubsw (u8 x s8 -> s16 pairs) then vpmaddwd by ones (-> s32).
 * 4-bit codes (<= 15) times |x| <= 127: a pair is at most 3810, no
 * saturation. 8-bit codes would saturate vpmaddubsw (255 * 127 * 2), so they
 * are widened to 16 bits and multiplied with vpmaddwd. Both produce lane i =
 * the exact sum over columns 4i..4i+3, as vpdpbusd does: every fast kernel
 * gives the same integers in the same lanes, hence the same output bits. */
#include <immintrin.h>

static inline __m256i qm__dot4_avx2(__m256i w, __m256i x)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

static inline __m256i qm__dot8_avx2(__m256i w, __m256i x)
{
    /* pl lane i: columns 2i, 2i+1 (0..15); ph: the same for 16..31. */
    __m256i pl = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(w)),
                                   _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x)));
    __m256i ph = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1)),
                                   _mm256_cvtepi8_epi16(_mm256_extracti128_si256(x, 1)));
    /* hadd: [0-3, 4-7, 16-19, 20-23 | 8-11, 12-15, 24-27, 28-31]; then 64-bit
     * pairs (0, 2, 1, 3) put the groups of 4 columns in order. */
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(pl, ph), 0xD8);
}

#define QM__I8_FN qm__i8mm_avx2
#define QM__I8_DOT4(w, x) qm__dot4_avx2(w, x)
#define QM__I8_DOT8(w, x) qm__dot8_avx2(w, x)
#include "qm_kernel_i8.h"
