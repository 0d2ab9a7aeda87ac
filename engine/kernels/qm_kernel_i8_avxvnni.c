/* qm_kernel_i8_avxvnni.c - fast-mode kernel on AVX-VNNI (VEX vpdpbusd,
 * compiled with -mavx2 -mfma -mf16c -mavxvnni): u8 codes times s8 inputs
 * summed by 4 into s32 lanes, exact (no saturation), for 4-bit and 8-bit
 * codes alike. Decode: qm_kernel_i8_x86.h's GEMV (r8 matrices included);
 * prefill: qm_kernel_i8_gemm.h on 8 rows per vector and the u8 panel, the
 * blocking its model (qm_kernel_i8_model8.c, QM__I8_AVXVNNI_NR) runs in
 * the tests. A compiler without -mavxvnni (GCC < 11, Clang < 12) builds
 * the row alone, which says so. */
#include "qm_kernel_isa.h"

#if defined(__AVXVNNI__)
#include "qm_kernel_i8_x86.h"

#define QM__V_FN qm__avxvnni_gemv
#define QM__V_R8 1 /* reads r8 matrices (qm_r8.h) */
#define QM__V_R8_Q8 1 /* 8-bit ones too */
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

static void qm__i8mm_avxvnni(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                             size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__i8_split(QM__I8_VNNI_GEMM_MIN, qm__avxvnni_gemv, qm__avxvnni_gemm, m, n0, n1, xq, ldx, nx,
                 y, ldy, scratch);
}
#define QM__AVXVNNI_BUILT NULL
#else
#define qm__i8mm_avxvnni NULL
#define qm__avxvnni_gemv NULL
#define qm__avxvnni_gemm NULL
#define QM__AVXVNNI_BUILT "this build's compiler has no -mavxvnni (GCC 11 or Clang 12 has)"
#endif

/* Its row of the fast table (qm_kernel_isa.c). */
QM__I8ISA_MODEL(avxvnni);
const qm__i8isa qm__i8isa_avxvnni = {
    .kernel = {.name = "avxvnni", .mm = qm__i8mm_avxvnni},
    .needs = "avx2 fma f16c avxvnni",
    .not_built = QM__AVXVNNI_BUILT,
    .gemv = qm__avxvnni_gemv,
    .gemm = qm__avxvnni_gemm,
    .reads_r8 = 1,
    .reads_r8_q8 = 1,
    .model = &qm__i8model_avxvnni,
};
