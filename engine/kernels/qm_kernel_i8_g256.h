/* qm_kernel_i8_g256.h - the int8 GEMM template's (qm_kernel_i8_gemm.h)
 * operations on 256-bit vectors, shared by the AVX2 and AVX-VNNI kernels:
 * included once by each, after qm_kernel_i8_x86.h, in a file compiled for
 * AVX2; the file then sets QM__G_NR and each instance's macros (QM__G_FN,
 * QM__G_STEP, ...). */
#ifndef QM_KERNEL_I8_G256_H
#define QM_KERNEL_I8_G256_H

static inline __m256i qm__g256_bcast4(const uint8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

#define QM__G_VL 8
#define QM__G_VI __m256i
#define QM__G_VF __m256
#define QM__G_VLOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define QM__G_SUBZ(s, z) _mm256_sub_epi32(s, _mm256_set1_epi32(z))
#define QM__G_SUBZP(s, zp, q)                                                                      \
    _mm256_sub_epi32(s, _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(zp)),               \
                                           _mm256_set1_epi32(q)))
#define QM__G_CVT(s) _mm256_cvtepi32_ps(s)
#define QM__G_LOADF(p) _mm256_loadu_ps(p)
#define QM__G_STOREF(p, v) _mm256_storeu_ps(p, v)
#define QM__G_SETF(f) _mm256_set1_ps(f)
#define QM__G_ZEROF() _mm256_setzero_ps()
#define QM__G_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define QM__G_VA __m256i
#define QM__G_VW __m256i
#define QM__G_ACC0() _mm256_setzero_si256()
#define QM__G_LOADW(p) _mm256_loadu_si256((const __m256i *)(p))
#define QM__G_PARAMS(m, n0, nr, sct, zpt) qm__x_params(m, n0, nr, sct, zpt)

#endif
