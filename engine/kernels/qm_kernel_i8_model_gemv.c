/* qm_kernel_i8_model_gemv.c - the VNNI kernels' decode GEMV
 * (qm_kernel_i8_x86.h with vpdpbusd as their QM__V_DPBUSD)
 * with vpdpbusd modelled in C on the same 256-bit registers' worth of
 * data; compiled with -mavx2 -mfma -mf16c. Tests only. */
#include "qm_kernel_i8_model.h"
#include "qm_kernel_i8_x86.h"

/* vpdpbusd ymm: acc lane l plus the dot of w's and x's bytes 4l..4l+3. */
static inline __m256i qm__model_dpbusd256(__m256i acc, __m256i w, __m256i x)
{
    int32_t a[8];
    uint8_t wb[32], xb[32];
    _mm256_storeu_si256((__m256i *)a, acc);
    _mm256_storeu_si256((__m256i *)wb, w);
    _mm256_storeu_si256((__m256i *)xb, x);
    for (int l = 0; l < 8; l++)
        a[l] = qm__model_dpbd(a[l], wb + 4 * l, xb + 4 * l);
    return _mm256_loadu_si256((const __m256i *)a);
}

#define QM__V_FN qm__model_gemv_body
#define QM__V_R8 1 /* reads r8 matrices, as the VNNI kernels' GEMV does */
#define QM__V_R8_Q8 1 /* 8-bit ones too */
#define QM__V_DPBUSD(acc, w, x) qm__model_dpbusd256(acc, w, x)
#include "qm_kernel_i8_x86.h"

void qm__model_vnni_gemv(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                         size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__model_gemv_body(m, n0, n1, xq, ldx, nx, y, ldy, scratch);
}
