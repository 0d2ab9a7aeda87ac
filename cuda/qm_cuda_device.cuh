/* qm_cuda_device.cuh - what the CUDA backend's kernel files share: the
 * launch seam (the one place the CPU emulation of tests/cuda/emu replaces),
 * loads of f32/f16/bf16 values at any byte offset, zero points and blocks. Included inside an
 * anonymous namespace by each .cu file. Private to cuda/. */
#ifndef QM_CUDA_DEVICE_CUH
#define QM_CUDA_DEVICE_CUH

#include <stdint.h>

#ifdef QM_CUDA_EMULATE
/* tests/cuda/emu: the same source run on the CPU, one fiber per thread. */
#include "qm_cuda_emu.h"
#else
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

#include "qm_cuda_kernels.h"

namespace
{

__device__ __forceinline__ float qm_half_to_float(unsigned short h)
{
#ifdef QM_CUDA_EMULATE
    return qm_emu_half_to_float(h);
#else
    return __half2float(__ushort_as_half(h));
#endif
}

/* Every launch goes through here: one place that checks the launch, and
 * the one seam the CPU emulation of the tests replaces. */
template <typename... P, typename... A>
cudaError_t qm_launch(void (*kernel)(P...), dim3 grid, dim3 block, cudaStream_t stream, A... args)
{
#ifdef QM_CUDA_EMULATE
    (void)stream;
    qm_emu_launch(grid, block, [=] { kernel(args...); });
#else
    kernel<<<grid, block, 0, stream>>>(args...);
#endif
    return cudaGetLastError();
}

__device__ __forceinline__ float qm_load_real(const void *base, uint32_t dtype, size_t i)
{
    if (dtype == QM__CUDA_F32) {
        const unsigned char *p = (const unsigned char *)base + 4 * i;
        if (((uintptr_t)p & 3u) == 0) return __ldg((const float *)p);
        uint32_t u = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
                     ((uint32_t)p[3] << 24);
        return __uint_as_float(u);
    }
    const unsigned char *p = (const unsigned char *)base + 2 * i;
    unsigned short h;
    if (((uintptr_t)p & 1u) == 0)
        h = __ldg((const unsigned short *)p);
    else
        h = (unsigned short)((unsigned)p[0] | ((unsigned)p[1] << 8));
    if (dtype == QM__CUDA_BF16) return __uint_as_float((uint32_t)h << 16);
    return qm_half_to_float(h);
}

/* Zero point of (row n, block b) as an integer code. */
template <int BITS>
__device__ __forceinline__ int qm_zero_point(const uint8_t *zp, const qm__cuda_mat &m, uint32_t n,
                                             uint32_t b)
{
    constexpr uint32_t PACK = 8 / BITS, MASK = (1u << BITS) - 1;
    if (!zp) return 1 << (BITS - 1);
    uint32_t byte, idx;
    if (m.zp_blockwise) {
        byte = __ldg(zp + (size_t)n * m.zp_row_bytes + b / PACK);
        idx = b % PACK;
    } else {
        byte = __ldg(zp + n / PACK);
        idx = n % PACK;
    }
    return (int)((byte >> (idx * BITS)) & MASK);
}

__device__ __forceinline__ uint32_t qm_block_of(const qm__cuda_mat &m, uint32_t c)
{
    return m.nblk > 1 ? (c >> m.block_shift) : 0u;
}

} /* namespace */

#endif
