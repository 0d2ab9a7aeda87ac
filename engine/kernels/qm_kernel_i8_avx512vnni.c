/* qm_kernel_i8_avx512vnni.c - fast-mode kernel on AVX-512 VNNI (compiled
 * with -mavx2 -mfma -mf16c -mavx512f -mavx512vl -mavx512vnni): vpdpbusd,
 * u8 codes times s8 inputs summed by 4 into s32 lanes, exact, for 4-bit
 * and 8-bit codes alike. Decode: qm_kernel_i8_x86.h's GEMV with the
 * 256-bit (VL) vpdpbusd (r8 matrices one 8-row group at a time, as AVX2),
 * its row layout's 4-bit first pass on two 32-byte chunks per 512-bit
 * vpdpbusd (QM__V_DPBUSD512: the same lanes, half the instructions; level
 * with 256-bit from memory on Zen 4); prefill: qm_kernel_i8_gemm.h with a call's 16
 * rows in one 512-bit vector and the u8 panel, the blocking its model
 * (qm_kernel_i8_model.c, QM__I8_AVX512VNNI_NR) runs in the tests. */
#include "qm_kernel_i8_x86.h"
#include "qm_kernel_isa.h"

#define QM__V_FN qm__vnni512_gemv
#define QM__V_R8 1 /* reads r8 matrices (qm_r8.h) */
#define QM__V_R8_Q8 1 /* 8-bit ones too */
#define QM__V_DPBUSD(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#define QM__V_DPBUSD512(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#include "qm_kernel_i8_x86.h"
#undef QM__V_DPBUSD512

#include "qm_kernel_i8_v512.h"

static inline __m512i qm__vnni512_bcast4(const uint8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

#define QM__G_VA __m512i
#define QM__G_VW __m512i
#define QM__G_ACC0() _mm512_setzero_si512()
#define QM__G_LOADW(p) _mm512_loadu_si512((const void *)(p))
#define QM__G_NR QM__I8_AVX512VNNI_NR
#define QM__G_PARAMS(m, n0, nr, sct, zpt) qm__x_params(m, n0, nr, sct, zpt)
#define QM__G_FN qm__vnni512_gemm
#define QM__G_MICRO qm__vnni512_micro
#define QM__G_DPBUSD(a, w, x4) _mm512_dpbusd_epi32(a, w, qm__vnni512_bcast4(x4))
#define QM__G_PACK(m, n0, nr, j0, j1, pan) qm__x_pack_u8(m, n0, nr, j0, j1, pan)
static qm__mm_fn qm__vnni512_gemm;
#include "qm_kernel_i8_gemm.h"

void qm__i8mm_avx512vnni(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                         size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__i8_split(QM__I8_AVX512VNNI_GEMM_MIN(m), qm__vnni512_gemv, qm__vnni512_gemm, m, n0, n1, xq, ldx, nx, y, ldy, scratch);
}

/* Its row of the fast table (qm_kernel_isa.c). */
QM__I8ISA_MODEL(avx512vnni);
const qm__i8isa qm__i8isa_avx512vnni = {
    .kernel = {.name = "avx512vnni", .mm = qm__i8mm_avx512vnni},
    .aliases = "avx512",
    .needs = "avx2 fma f16c avx512f avx512bw avx512vl avx512vnni",
    .gemv = qm__vnni512_gemv,
    .gemm = qm__vnni512_gemm,
    .reads_r8 = 1,
    .reads_r8_q8 = 1,
    .model = &qm__i8model_avx512vnni,
};
