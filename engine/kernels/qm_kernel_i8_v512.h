/* qm_kernel_i8_v512.h - qm_kernel_i8_gemm.h's vector operations on
 * AVX-512F (16 rows per vector), for the AVX-512 VNNI and AMX kernels
 * (compiled with at least -mavx512f). Private to engine/. */
#ifndef QM_KERNEL_I8_V512_H
#define QM_KERNEL_I8_V512_H

#include <immintrin.h>

#define QM__G_VL 16
#define QM__G_VI __m512i
#define QM__G_VF __m512
#define QM__G_VLOADI(p) _mm512_loadu_si512((const void *)(p))
#define QM__G_SUBZ(s, z) _mm512_sub_epi32(s, _mm512_set1_epi32(z))
#define QM__G_SUBZP(s, zp, q)                                                                      \
    _mm512_sub_epi32(s, _mm512_mullo_epi32(_mm512_loadu_si512((const void *)(zp)),                  \
                                           _mm512_set1_epi32(q)))
#define QM__G_CVT(s) _mm512_cvtepi32_ps(s)
#define QM__G_LOADF(p) _mm512_loadu_ps(p)
#define QM__G_STOREF(p, v) _mm512_storeu_ps(p, v)
#define QM__G_SETF(f) _mm512_set1_ps(f)
#define QM__G_ZEROF() _mm512_setzero_ps()
#define QM__G_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)

#endif
