/* qm_kernel_i8_avx512vnni.c - fast-mode kernel on AVX-512 VNNI (EVEX
 * vpdpbusd on 256-bit vectors, compiled with -mavx512f -mavx512vl
 * -mavx512vnni): u8 codes times s8 inputs summed by 4 into s32 lanes, exact. */
#include <immintrin.h>

#define QM__I8_FN qm__i8mm_avx512vnni
#define QM__I8_DOT4(w, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
#define QM__I8_DOT8(w, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
#define QM__I8_OFF8 0
#include "qm_kernel_i8.h"
