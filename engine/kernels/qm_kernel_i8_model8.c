/* qm_kernel_i8_model8.c - the AVX-VNNI kernel's GEMM (qm_kernel_i8_gemm.h,
 * 8 rows per vector, QM__I8_AVXVNNI_NR inputs per pass, the u8 panel) with
 * vpdpbusd modelled in C; its decode, qm_kernel_i8_model_gemv.c. Tests only. */
#define QM__G_VL 8
#include "qm_kernel_i8_model_v.h"

#define QM__G_VA qm__mvi
#define QM__G_VW qm__mvw
#define QM__G_ACC0() qm__mv_zeroi()
#define QM__G_LOADW(p) qm__mv_loadw(p)
#define QM__G_NR QM__I8_AVXVNNI_NR
#define QM__G_FN qm__model8_gemm
#define QM__G_MICRO qm__model8_micro
#define QM__G_DPBUSD(a, w, x4) qm__mv_dpbusd(a, w, x4)
static qm__mm_fn qm__model8_gemm;
#include "qm_kernel_i8_gemm.h"

static void qm__model8_mm(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                          size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__i8_split(QM__I8_VNNI_GEMM_MIN, qm__model_vnni_gemv, qm__model8_gemm, m, n0, n1, xq, ldx,
                 nx, y, ldy, scratch);
}

/* The avxvnni row's model (its .model). */
const qm__i8isa qm__i8model_avxvnni = {.kernel = {.name = "model-avxvnni", .mm = qm__model8_mm},
                                       .gemv = qm__model_vnni_gemv,
                                       .gemm = qm__model8_gemm,
                                       .reads_r8 = 1,
                                       .reads_r8_q8 = 1};
