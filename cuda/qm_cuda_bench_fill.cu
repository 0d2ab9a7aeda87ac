/* qm_cuda_bench_fill.cu - device-side random fill for the CUDA benchmark:
 * gigabytes of expert weights generated where they live, not on the host. */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace
{

__device__ __forceinline__ uint32_t qm_hash(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

__global__ void qm_k_fill_bytes(uint8_t *p, size_t n, uint64_t seed)
{
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    for (; i < n; i += (size_t)gridDim.x * blockDim.x * 4) {
        uint32_t h = qm_hash(seed + i);
        for (int j = 0; j < 4 && i + j < n; j++)
            p[i + j] = (uint8_t)(h >> (8 * j));
    }
}

/* f16 values uniform in [lo, hi). */
__global__ void qm_k_fill_half(unsigned short *p, size_t n, uint64_t seed, float lo, float hi)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float u = (float)(qm_hash(seed + i) >> 8) * (1.0f / 16777216.0f);
        p[i] = __half_as_ushort(__float2half(lo + (hi - lo) * u));
    }
}

} /* namespace */

extern "C" int qm__cuda_bench_fill_bytes(void *p, size_t n, uint64_t seed)
{
    qm_k_fill_bytes<<<1024, 256>>>((uint8_t *)p, n, seed);
    return (int)cudaGetLastError();
}

extern "C" int qm__cuda_bench_fill_half(void *p, size_t n, uint64_t seed, float lo, float hi)
{
    qm_k_fill_half<<<1024, 256>>>((unsigned short *)p, n, seed, lo, hi);
    return (int)cudaGetLastError();
}
