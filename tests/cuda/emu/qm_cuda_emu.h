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
#undef __align__
#define __align__(n) __attribute__((aligned(n)))

extern thread_local dim3 threadIdx, blockIdx, blockDim;

void qm_emu_launch(dim3 grid, dim3 block, const std::function<void()> &fn);
void qm_emu_barrier(void);
double qm_emu_exchange(double v, unsigned src_lane);
float qm_emu_half_to_float(unsigned short h);
unsigned short qm_emu_float_to_half(float f); /* round to nearest even */

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


/* ---- 16-bit types and WMMA (qm_cuda_tc.cu) ----
 * A fragment holds the whole 16x16 tile in every thread (as floats): each
 * lane of a warp loads, multiplies and stores all of it, so the results are
 * those of the hardware operation up to the order of the f32 sums; the
 * per-lane layout of real fragments is not modelled (the kernel never
 * touches fragment elements). */
struct __half {
    unsigned short x;
};
struct __nv_bfloat16 {
    unsigned short x;
};
static inline __half __float2half_rn(float f)
{
    __half h;
    h.x = qm_emu_float_to_half(f);
    return h;
}
static inline __nv_bfloat16 __float2bfloat16_rn(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    __nv_bfloat16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u)
        b.x = (unsigned short)((u >> 16) | 0x40u); /* quiet NaN */
    else
        b.x = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return b;
}
static inline float qm_emu_16_to_float(__half h)
{
    return qm_emu_half_to_float(h.x);
}
static inline float qm_emu_16_to_float(__nv_bfloat16 b)
{
    return __uint_as_float((uint32_t)b.x << 16);
}

namespace nvcuda
{
namespace wmma
{
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
    float v[16 * 16]; /* [row][col] of the tile (A: m x k, B: k x n, C: m x n) */
};

template <typename T>
static inline void load_matrix_sync(fragment<matrix_a, 16, 16, 16, T, row_major> &f, const T *p,
                                    unsigned ldm)
{
    for (int i = 0; i < 16; i++)
        for (int k = 0; k < 16; k++)
            f.v[i * 16 + k] = qm_emu_16_to_float(p[(size_t)i * ldm + k]);
}
template <typename T>
static inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, T, col_major> &f, const T *p,
                                    unsigned ldm)
{
    for (int k = 0; k < 16; k++)
        for (int n = 0; n < 16; n++)
            f.v[k * 16 + n] = qm_emu_16_to_float(p[k + (size_t)n * ldm]);
}
static inline void fill_fragment(fragment<accumulator, 16, 16, 16, float> &f, float v)
{
    for (int i = 0; i < 256; i++)
        f.v[i] = v;
}
template <typename T>
static inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d,
                            const fragment<matrix_a, 16, 16, 16, T, row_major> &a,
                            const fragment<matrix_b, 16, 16, 16, T, col_major> &b,
                            const fragment<accumulator, 16, 16, 16, float> &c)
{
    float r[256];
    for (int i = 0; i < 16; i++)
        for (int n = 0; n < 16; n++) {
            float s = c.v[i * 16 + n];
            for (int k = 0; k < 16; k++)
                s += a.v[i * 16 + k] * b.v[k * 16 + n]; /* exact: 16-bit operands */
            r[i * 16 + n] = s;
        }
    memcpy(d.v, r, sizeof r);
}
static inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &f,
                                     unsigned ldm, layout_t layout)
{
    for (int i = 0; i < 16; i++)
        for (int n = 0; n < 16; n++) {
            if (layout == mem_row_major)
                p[(size_t)i * ldm + n] = f.v[i * 16 + n];
            else
                p[i + (size_t)n * ldm] = f.v[i * 16 + n];
        }
}
} /* namespace wmma */
} /* namespace nvcuda */

#endif
