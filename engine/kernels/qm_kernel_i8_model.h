/* qm_kernel_i8_model.h - software models of the instructions of fast-mode
 * kernels this CPU may not run (vpdpbusd, the AMX tiles), in portable C,
 * for tests only: qm_kernel_i8_model*.c run each kernel's own blocking,
 * packing and epilogue (qm_kernel_i8_gemm.h, qm_kernel_i8_x86.h) with
 * these in place of the instructions, so only the instructions themselves
 * go untested on a CPU without them. Private to engine/ and tests/engine. */
#ifndef QM_KERNEL_I8_MODEL_H
#define QM_KERNEL_I8_MODEL_H

#include <stdint.h>

#include "qm_kernel_isa.h"

/* vpdpbusd, one 32-bit lane: acc + the 4 products of u8 w[0..3] by s8 x[0..3]. */
static inline int32_t qm__model_dpbd(int32_t acc, const uint8_t *w, const uint8_t *x)
{
    for (int e = 0; e < 4; e++)
        acc += (int32_t)w[e] * (int32_t)(int8_t)x[e];
    return acc;
}

/* The models are rows like their kernels' (qm__i8model_<name>, each its
 * kernel row's .model, qm_kernel_isa.h; never chosen): mm is the real
 * kernel's split, gemv and gemm its two paths at every input count. */
/* Faults the AMX model saw since the last call (a configuration ldtilecfg
 * would refuse, tiles used unconfigured, shapes tdpbsud would refuse); the
 * first one's description in why (may be NULL). Resets the count. */
int qm__amx_model_faults(const char **why);
/* The GEMV with vpdpbusd modelled (qm_kernel_i8_model_gemv.c, AVX2). */
qm__mm_fn qm__model_vnni_gemv;

#endif
