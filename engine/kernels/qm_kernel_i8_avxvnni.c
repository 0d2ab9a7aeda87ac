/* qm_kernel_i8_avxvnni.c - fast-mode kernel on AVX-VNNI (VEX vpdpbusd,
 * compiled with -mavx2 -mfma -mf16c -mavxvnni): u8 codes times s8 inputs
 * summed by 4 into s32 lanes, exact (no saturation), for 4-bit and 8-bit
 * codes alike. Decode: qm_kernel_i8_x86.h's GEMV; prefill:
 * qm_kernel_i8_gemm.h on 8 rows per vector and the u8 panel, the blocking
 * its model (qm_kernel_i8_model.c, QM__I8_AVXVNNI_NR) runs in the tests. */
#include "qm_kernel_i8_x86.h"

#define QM__V_FN qm__avxvnni_gemv
#define QM__V_DPBUSD(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#include "qm_kernel_i8_x86.h"

#include "qm_kernel_i8_g256.h"
#define QM__G_NR QM__I8_AVXVNNI_NR
#define QM__G_FN qm__avxvnni_gemm
#define QM__G_MICRO qm__avxvnni_micro
#define QM__G_DPBUSD(a, w, x4) _mm256_dpbusd_avx_epi32(a, w, qm__g256_bcast4(x4))
#define QM__G_PACK(m, n0, nr, j0, j1, pan) qm__x_pack_u8(m, n0, nr, j0, j1, pan)
static qm__mm_fn qm__avxvnni_gemm;
#include "qm_kernel_i8_gemm.h"

void qm__i8mm_avxvnni(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq, size_t ldx,
                      uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__i8_split(QM__I8_VNNI_GEMM_MIN, qm__avxvnni_gemv, qm__avxvnni_gemm, m, n0, n1, xq, ldx, nx, y, ldy, scratch);
}
