/* qm_kernel_i8_amx.c - fast-mode kernel on AMX-INT8 (compiled with -mavx2
 * -mfma -mf16c -mavx512f -mavx512vl; the tile instructions are inline
 * assembly, so no -mamx flag is needed and each one's memory effects are
 * stated): qm_kernel_i8_gemm.h's AMX GEMM, tdpbsud of M <= 16 inputs' s8
 * codes (A) by the u8 panel of the call's 16 rows (B) per sub-block, the
 * epilogue on AVX-512. Calls of fewer than QM__I8_AMX_MIN inputs run the
 * AVX-512 VNNI kernel. Runs only after the process was granted the tile
 * state (qm_kernel_select.c asks once); its model (qm_kernel_i8_model.c)
 * runs the same blocking in the tests.
 *
 * The configuration goes to ldtilecfg as a 64-byte memory operand: GCC
 * 12's _tile_loadconfig declares an 8-byte read, so at -O2 the rest of the
 * configuration need not be stored before the instruction runs. Tile loads
 * and stores clobber memory (GCC's _tile_loadd declares no memory read). */
#include "qm_kernel_i8_x86.h"
#include "qm_kernel_i8_v512.h"
#include "qm_kernel_isa.h"

#define QM__G_PARAMS(m, n0, nr, sct, zpt) qm__x_params(m, n0, nr, sct, zpt)
#define QM__G_PACK(m, n0, nr, j0, j1, pan) qm__x_pack_u8(m, n0, nr, j0, j1, pan)
#define QM__T_FN qm__amx_gemm
#define QM__T_CFG(cfg) __asm__ volatile("ldtilecfg %0" ::"m"(*(const qm__amx_cfg *)(cfg)))
#define QM__T_ZERO_C() __asm__ volatile("tilezero %%tmm0" ::)
#define QM__T_LOAD_A(p, stride)                                                                    \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm1" ::"r"((const void *)(p)), "r"((long)(stride))   \
                     : "memory")
#define QM__T_LOAD_B(p)                                                                            \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm2" ::"r"((const void *)(p)), "r"(64L) : "memory")
#define QM__T_DP() __asm__ volatile("tdpbsud %%tmm2, %%tmm1, %%tmm0" ::)
#define QM__T_STORE_C(p)                                                                           \
    __asm__ volatile("tilestored %%tmm0, (%0,%1,1)" ::"r"((void *)(p)), "r"(64L) : "memory")
#define QM__T_RELEASE() __asm__ volatile("tilerelease" ::)
static qm__mm_fn qm__amx_gemm;
#include "qm_kernel_i8_gemm.h"

static void qm__i8mm_amx(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                         size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__i8_split(QM__I8_AMX_MIN, qm__i8mm_avx512vnni, qm__amx_gemm, m, n0, n1, xq, ldx, nx, y,
                 ldy, scratch);
}

/* Its row of the fast table (qm_kernel_isa.c): its decode path is the
 * AVX-512 VNNI kernel's entry (r8 included), its packer reads r8 too. */
QM__I8ISA_MODEL(amx);
const qm__i8isa qm__i8isa_amx = {
    .kernel = {.name = "amx", .mm = qm__i8mm_amx},
    .needs = "avx2 fma f16c avx512f avx512bw avx512vl avx512vnni amx-tile amx-int8",
    .gemv = qm__i8mm_avx512vnni,
    .gemm = qm__amx_gemm,
    .reads_r8 = 1,
    .reads_r8_q8 = 1,
    .model = &qm__i8model_amx,
};
