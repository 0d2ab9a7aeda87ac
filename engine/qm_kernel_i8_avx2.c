/* qm_kernel_i8_avx2.c - fast-mode kernel on AVX2 (compiled with -mavx2 -mfma):
 * vpmaddubsw (u8 x s8 -> s16 pairs) then vpmaddwd by ones (-> s32).
 * 4-bit codes (<= 15) times |x| <= 127: a pair is at most 3810, no
 * saturation. 8-bit codes are first made signed (q - 128) and their sign
 * moved onto x, so |w| <= 128 and a pair is at most 32512 < 32767. */
#include <immintrin.h>

static inline __m256i qm__dot4_avx2(__m256i w, __m256i x)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

static inline __m256i qm__dot8_avx2(__m256i w, __m256i x)
{
    __m256i ws = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(x, ws)),
                             _mm256_set1_epi16(1));
}

#define QM__I8_FN qm__i8mm_avx2
#define QM__I8_DOT4(w, x) qm__dot4_avx2(w, x)
#define QM__I8_DOT8(w, x) qm__dot8_avx2(w, x)
#define QM__I8_OFF8 128
#include "qm_kernel_i8.h"
