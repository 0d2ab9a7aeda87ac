/* qm_cuda_device.cuh - what the CUDA backend's kernel files share: the
 * launch seam (the one place the CPU emulation of tests/cuda/emu replaces),
 * loads of f32/f16/bf16 values at any byte offset, zero points, the code
 * book and blocks. Included inside an
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

/* The integer weight of code q before its scale: q - z, or with the code
 * book (CB; docs/BANK_FORMAT.md, "Code books") e2m1's entry, MXFP4's E2M1
 * doubled: {0, 1, 2, 3, 4, 6, 8, 12} for q < 8, their negatives for q >= 8,
 * z unused (a code-book bank has no zero points). No table: a thread's
 * local array indexed at run time would live in local memory. */
template <bool CB> __device__ __forceinline__ int qm_code_value(int q, int z)
{
    if (!CB) return q - z;
    const int m = q & 7;
    const int mag = m < 4 ? m : (2 + (m & 1)) << ((m >> 1) - 1);
    return (q & 8) ? -mag : mag;
}

__device__ __forceinline__ uint32_t qm_block_of(const qm__cuda_mat &m, uint32_t c)
{
    return m.nblk > 1 ? (c >> m.block_shift) : 0u;
}

/* Scale and zero point of column c0 of row n: (s, z) hold the row's own,
 * which stand when the row is one block. */
template <int BITS>
__device__ __forceinline__ void qm_block_scale(const qm__cuda_mat &m, const void *scales,
                                               const uint8_t *zp, uint32_t n, uint32_t c0, float &s,
                                               int &z)
{
    if (m.nblk > 1) {
        uint32_t b = c0 >> m.block_shift;
        s = qm_load_real(scales, m.scale_dtype, (size_t)n * m.nblk + b);
        z = qm_zero_point<BITS>(zp, m, n, b);
    }
}

/* A thread loading the tiles of a 64 x 64 GEMM block (256 threads): per
 * step of 32 columns, column `col` of its 8 rows row_base + 8i of the
 * weight tile (features from n0) and of the input tile (rows from t0). */
struct qm_tile_loader {
    const uint8_t *w;
    const void *scales;
    const uint8_t *zp;
    const float *xrow[8]; /* its input rows; nullptr past the job's */
    uint32_t col, row_base;
};

__device__ __forceinline__ void qm_tile_loader_init(qm_tile_loader &ld, const qm__cuda_job *job,
                                                    int mat, uint32_t t0, const float *in,
                                                    const uint32_t *in_rows, uint32_t in_stride)
{
    ld.col = threadIdx.x & 31u;
    ld.row_base = threadIdx.x >> 5;
    ld.w = job->w[mat];
    ld.scales = job->scales[mat];
    ld.zp = job->zp[mat];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        uint32_t t = t0 + ld.row_base + 8 * i;
        uint32_t brow = job->row0 + t;
        ld.xrow[i] =
            t < job->n_rows ? in + (size_t)(in_rows ? in_rows[brow] : brow) * in_stride : nullptr;
    }
}

/* Its row i at column k0 + col: the weight of feature n0 + row_base + 8i,
 * dequantized, and the input; 0 outside the matrix or the job's rows. */
template <int BITS, bool CB>
__device__ __forceinline__ void qm_tile_load(const qm_tile_loader &ld, const qm__cuda_mat &m,
                                             uint32_t n0, uint32_t k0, int i, float &wv, float &xv)
{
    constexpr uint32_t PACK = 8 / BITS, MASK = (1u << BITS) - 1;
    const uint32_t c = k0 + ld.col, nn = n0 + ld.row_base + 8 * i;
    const bool cin = c < m.k;
    wv = 0.0f;
    if (cin && nn < m.n) {
        const uint32_t b = qm_block_of(m, c);
        int q = (int)((ld.w[(size_t)nn * m.row_bytes + c / PACK] >> ((c % PACK) * BITS)) & MASK);
        float s = qm_load_real(ld.scales, m.scale_dtype, (size_t)nn * m.nblk + b);
        wv = s * (float)qm_code_value<CB>(q, qm_zero_point<BITS>(ld.zp, m, nn, b));
    }
    xv = cin && ld.xrow[i] ? ld.xrow[i][c] : 0.0f;
}

} /* namespace */

#endif
