/* qm_cuda_tc.cu - the tensor-core dequantise-GEMM (WMMA 16x16x16, sm_80+)
 * for prefill jobs of f16/bf16 layer calls.
 *
 * The same tiling as the f32 shared-memory GEMM of qm_cuda_kernels.cu (64
 * features x 64 rows per block, 32 columns per step): weights are
 * dequantised in f32 (W = scale * (q - zp), or scale * e2m1[q] for a
 * code-book bank) and rounded once to the call's 16-bit type as they go
 * into shared memory, the input rows likewise; eight
 * warps each own two 16x16 f32 accumulators and issue WMMA on the tile;
 * the bias is added in f32 at the end. Rounding the operands to 16 bits is
 * the precision the caller asked for (its activations are f16/bf16); the
 * f32 path stays the shared-memory GEMM. */
#include "qm_cuda_device.cuh"

#ifndef QM_CUDA_EMULATE
#include <cuda_bf16.h>
#include <mma.h>
#endif

namespace
{

using namespace nvcuda;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
template <typename T> __device__ __forceinline__ T qm_to16(float v);
template <> __device__ __forceinline__ __half qm_to16<__half>(float v)
{
    return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 qm_to16<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}
#endif

#define QM_TC_BM 64            /* features per block */
#define QM_TC_BN 64            /* rows per block */
#define QM_TC_BK 32            /* columns per step */
#define QM_TC_LD (QM_TC_BK + 8) /* 16-bit leading dimension: a multiple of 8 */
#define QM_TC_LDC (QM_TC_BM + 4) /* f32 leading dimension: a multiple of 4 */

template <int BITS, bool CB, typename T>
__global__ void __launch_bounds__(256)
    qm_k_gemm_tc(const qm__cuda_job *jobs, int mat, qm__cuda_mat m, uint32_t rows_lo,
                 const float *in, const uint32_t *in_rows, uint32_t in_stride, float *out,
                 uint32_t out_stride)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    /* WMMA pointers must be 32-byte aligned: the tiles' row strides (80 and
     * 272 bytes) and the 16-row/16-column offsets used below keep them so. */
    __shared__ __align__(32) T xs[QM_TC_BN][QM_TC_LD]; /* rows x columns */
    __shared__ __align__(32) T ws[QM_TC_BM][QM_TC_LD]; /* features x columns */
    __shared__ __align__(32) float cs[QM_TC_BN][QM_TC_LDC];
    const qm__cuda_job *job = &jobs[blockIdx.z];
    const uint32_t n_rows = job->n_rows;
    const uint32_t t0 = blockIdx.y * QM_TC_BN, n0 = blockIdx.x * QM_TC_BM;
    if (t0 >= n_rows || n_rows < rows_lo) return; /* the whole block: before any barrier */
    const uint32_t tid = threadIdx.x, warp = tid >> 5;
    qm_tile_loader ld;
    qm_tile_loader_init(ld, job, mat, t0, in, in_rows, in_stride);
    /* Warp w: row tile w % 4, feature tiles 2 (w / 4) and 2 (w / 4) + 1. */
    const uint32_t wr = warp & 3u, wf = (warp >> 2) * 2u;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
    wmma::fill_fragment(acc[0], 0.0f);
    wmma::fill_fragment(acc[1], 0.0f);

    for (uint32_t k0 = 0; k0 < m.k; k0 += QM_TC_BK) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const uint32_t r = ld.row_base + 8 * i;
            float wv, xv;
            qm_tile_load<BITS, CB>(ld, m, n0, k0, i, wv, xv);
            ws[r][ld.col] = qm_to16<T>(wv);
            xs[r][ld.col] = qm_to16<T>(xv);
        }
        __syncthreads();
#pragma unroll
        for (uint32_t kk = 0; kk < QM_TC_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
            wmma::load_matrix_sync(a, &xs[wr * 16][kk], QM_TC_LD);
#pragma unroll
            for (uint32_t f = 0; f < 2; f++) {
                /* B[k][n] = W[n][k]: the feature-major tile read column-major. */
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bf;
                wmma::load_matrix_sync(bf, &ws[(wf + f) * 16][kk], QM_TC_LD);
                wmma::mma_sync(acc[f], a, bf, acc[f]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (uint32_t f = 0; f < 2; f++)
        wmma::store_matrix_sync(&cs[wr * 16][(wf + f) * 16], acc[f], QM_TC_LDC,
                                wmma::mem_row_major);
    __syncthreads();
    /* Out along features (coalesced), bias in f32. */
    for (uint32_t idx = tid; idx < QM_TC_BN * QM_TC_BM; idx += blockDim.x) {
        const uint32_t r = idx / QM_TC_BM, f = idx % QM_TC_BM;
        const uint32_t t = t0 + r, nn = n0 + f;
        if (t >= n_rows || nn >= m.n) continue;
        float bias = job->bias[mat] ? qm_load_real(job->bias[mat], m.bias_dtype, nn) : 0.0f;
        out[(size_t)(job->row0 + t) * out_stride + nn] = cs[r][f] + bias;
    }
#endif /* older devices: never launched (the host checks the compute capability) */
}

template <int BITS, bool CB>
cudaError_t qm_launch_tc_bits(const qm__cuda_job *jobs, uint32_t n_jobs, uint32_t max_rows,
                              uint32_t rows_lo, int mat, const qm__cuda_mat &m, int tc,
                              const float *in, const uint32_t *in_rows, uint32_t in_stride,
                              float *out, uint32_t out_stride, cudaStream_t s)
{
    dim3 grid((m.n + QM_TC_BM - 1) / QM_TC_BM, (max_rows + QM_TC_BN - 1) / QM_TC_BN, n_jobs);
    if (tc == 2)
        return qm_launch(qm_k_gemm_tc<BITS, CB, __nv_bfloat16>, grid, dim3(256), s, jobs, mat, m,
                         rows_lo, in, in_rows, in_stride, out, out_stride);
    return qm_launch(qm_k_gemm_tc<BITS, CB, __half>, grid, dim3(256), s, jobs, mat, m, rows_lo, in,
                     in_rows, in_stride, out, out_stride);
}

} /* namespace */

extern "C" int qm__cuda_launch_gemm_tc(const qm__cuda_job *jobs, uint32_t n_jobs,
                                       uint32_t max_rows, uint32_t rows_lo, int mat,
                                       const qm__cuda_mat *m, int tc, const float *in,
                                       const uint32_t *in_rows, uint32_t in_stride, float *out,
                                       uint32_t out_stride, void *stream)
{
    if (n_jobs == 0 || max_rows < rows_lo || m->n == 0) return (int)cudaSuccess;
    cudaStream_t s = (cudaStream_t)stream;
    if (m->codebook && m->bits != 4) return (int)cudaErrorInvalidValue;
    switch (m->bits) {
    case 2:
        return (int)qm_launch_tc_bits<2, false>(jobs, n_jobs, max_rows, rows_lo, mat, *m, tc, in,
                                                in_rows, in_stride, out, out_stride, s);
    case 4:
        if (m->codebook)
            return (int)qm_launch_tc_bits<4, true>(jobs, n_jobs, max_rows, rows_lo, mat, *m, tc, in,
                                                   in_rows, in_stride, out, out_stride, s);
        return (int)qm_launch_tc_bits<4, false>(jobs, n_jobs, max_rows, rows_lo, mat, *m, tc, in,
                                                in_rows, in_stride, out, out_stride, s);
    case 8:
        return (int)qm_launch_tc_bits<8, false>(jobs, n_jobs, max_rows, rows_lo, mat, *m, tc, in,
                                                in_rows, in_stride, out, out_stride, s);
    default:
        return (int)cudaErrorInvalidValue;
    }
}
