/* qm_cuda_emu.h - just enough of CUDA to run cuda/qm_cuda_kernels.cu on the
 * CPU (compiled as C++ with QM_CUDA_EMULATE), so that CI machines without a
 * GPU still execute every kernel path against the CPU backend.
 *
 * A launch runs its blocks one after another; the threads of a block are
 * fibers switched at barriers (__syncthreads, and warp shuffles, which wait
 * for every live thread of the block: stronger than a warp, and enough for
 * kernels whose exits are warp- or block-uniform, as ours are). Device
 * memory is host memory (qm_cuda_emu.cpp fakes the runtime calls). This
 * checks indexing, packing, tiling and reduction logic; it says nothing
 * about speed, memory coalescing or real-hardware races. */
#ifndef QM_CUDA_EMU_H
#define QM_CUDA_EMU_H

#include <cuda_runtime_api.h>
#include <vector_functions.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <functional>

#undef __shared__
#define __shared__ static /* one block runs at a time */
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

extern thread_local dim3 threadIdx, blockIdx, blockDim;

void qm_emu_launch(dim3 grid, dim3 block, const std::function<void()> &fn);
void qm_emu_barrier(void);
double qm_emu_exchange(double v, unsigned src_lane);
float qm_emu_half_to_float(unsigned short h);

static inline void __syncthreads(void)
{
    qm_emu_barrier();
}
static inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask)
{
    (void)mask;
    return (float)qm_emu_exchange(v, (threadIdx.x & 31u) ^ (unsigned)lane_mask);
}
static inline double __shfl_xor_sync(unsigned mask, double v, int lane_mask)
{
    (void)mask;
    return qm_emu_exchange(v, (threadIdx.x & 31u) ^ (unsigned)lane_mask);
}
/* Rounded single operations: kept apart by `volatile` so that the host
 * compiler cannot fuse a multiply into an add (what the _rn forms promise). */
static inline float __fmul_rn(float a, float b)
{
    volatile float r = a * b;
    return r;
}
static inline float __fadd_rn(float a, float b)
{
    volatile float r = a + b;
    return r;
}
static inline float __fsub_rn(float a, float b)
{
    volatile float r = a - b;
    return r;
}
static inline float __fdiv_rn(float a, float b)
{
    volatile float r = a / b;
    return r;
}
template <typename T> static inline T __ldg(const T *p)
{
    return *p;
}
static inline float __uint_as_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline unsigned min(unsigned a, unsigned b)
{
    return a < b ? a : b;
}

#endif
