/* qm_kernel_i8_avxvnni.c - fast-mode kernel on AVX-VNNI (VEX vpdpbusd,
 * compiled with -mavx2 -mfma -mavxvnni): u8 codes times s8 inputs summed
 * by 4 into s32 lanes, exact (no saturation). */
#include <immintrin.h>

#define QM__I8_FN qm__i8mm_avxvnni
#define QM__I8_DOT4(w, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x)
#define QM__I8_DOT8(w, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x)
#include "qm_kernel_i8.h"
