/* qm_cuda_kernels.cu - dequantise-matmul and activation kernels of the CUDA
 * backend (../shared/BANK_FORMAT.md semantics).
 *
 * W[n, c] = scale[n, b] * (q[n, c] - zp[n, b]), b = c >> block_shift (or
 * scale[n, b] * e2m1[q[n, c]] for a code-book bank, the CB instances), then
 * y = W . x + bias, all in f32. Three implementations of the matmul:
 *   gemv  - one warp per output feature, 16-byte weight loads spread over the
 *           warp's lanes (coalesced), a few token rows per pass (decode);
 *   gemm  - 64x64 output tiles, weights dequantised into shared memory 32
 *           columns at a time, 4x4 register micro-tiles (prefill);
 *   naive - one thread per output element: the readable reference the tests
 *           hold the fast ones to.
 * Scales, biases and zero points may sit at any byte offset in an arena
 * slot (a unit's tensors are laid end to end), so their loads check
 * alignment and fall back to byte loads rather than fault. */
#include "qm_cuda_device.cuh"

namespace
{

/* ---- naive: one thread per (row, feature) ---- */

template <int BITS, bool CB>
__global__ void qm_k_naive(const qm__cuda_job *jobs, int mat, qm__cuda_mat m, const float *in,
                           const uint32_t *in_rows, uint32_t in_stride, float *out,
                           uint32_t out_stride)
{
    constexpr uint32_t PACK = 8 / BITS, MASK = (1u << BITS) - 1;
    const qm__cuda_job *job = &jobs[blockIdx.y];
    uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (uint64_t)job->n_rows * m.n) return;
    uint32_t r = (uint32_t)(idx / m.n), n = (uint32_t)(idx % m.n);
    uint32_t brow = job->row0 + r;
    const float *x = in + (size_t)(in_rows ? in_rows[brow] : brow) * in_stride;
    const uint8_t *wrow = job->w[mat] + (size_t)n * m.row_bytes;
    float acc = 0.0f;
    for (uint32_t c = 0; c < m.k; c++) {
        uint32_t b = qm_block_of(m, c);
        float s = qm_load_real(job->scales[mat], m.scale_dtype, (size_t)n * m.nblk + b);
        int q = (int)((wrow[c / PACK] >> ((c % PACK) * BITS)) & MASK);
        float w = s * (float)qm_code_value<CB>(q, qm_zero_point<BITS>(job->zp[mat], m, n, b));
        acc = fmaf(w, x[c], acc);
    }
    if (job->bias[mat]) acc += qm_load_real(job->bias[mat], m.bias_dtype, n);
    out[(size_t)brow * out_stride + n] = acc;
}

/* ---- gemv: warp per output feature ---- */

/* Adds the columns [c0, c0 + 4 * PACK) held in `word` (4 packed bytes, one
 * block: blocks are >= 16 columns and words are aligned to their width). */
template <int BITS, bool CB, int TT, bool VECX>
__device__ __forceinline__ void qm_dot_word(uint32_t word, float s, int z, uint32_t c0,
                                            const float *const (&xr)[TT], float (&acc)[TT])
{
    constexpr int COLS = 4 * (8 / BITS);
    constexpr uint32_t MASK = (1u << BITS) - 1;
    float w[COLS];
#pragma unroll
    for (int i = 0; i < COLS; i++)
        w[i] = s * (float)qm_code_value<CB>((int)((word >> (i * BITS)) & MASK), z);
#pragma unroll
    for (int t = 0; t < TT; t++) {
        if (VECX) {
            const float4 *xv = (const float4 *)(xr[t] + c0);
#pragma unroll
            for (int v = 0; v < COLS / 4; v++) {
                float4 xx = xv[v];
                acc[t] = fmaf(w[4 * v + 0], xx.x, acc[t]);
                acc[t] = fmaf(w[4 * v + 1], xx.y, acc[t]);
                acc[t] = fmaf(w[4 * v + 2], xx.z, acc[t]);
                acc[t] = fmaf(w[4 * v + 3], xx.w, acc[t]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < COLS; i++)
                acc[t] = fmaf(w[i], xr[t][c0 + i], acc[t]);
        }
    }
}

/* One 16-byte chunk of a weight row: 4 words, each inside one block. */
template <int BITS, bool CB, int TT>
__device__ __forceinline__ void qm_dot_chunk(uint4 v, uint32_t chunk, uint32_t n,
                                             const qm__cuda_mat &m, const void *scales,
                                             const uint8_t *zp, float s_row, int z_row,
                                             const float *const (&xr)[TT], float (&acc)[TT])
{
    constexpr uint32_t PACK = 8 / BITS;
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int wi = 0; wi < 4; wi++) {
        uint32_t c0 = (chunk * 16 + wi * 4) * PACK;
        float s = s_row;
        int z = z_row;
        qm_block_scale<BITS>(m, scales, zp, n, c0, s, z);
        qm_dot_word<BITS, CB, TT, true>(words[wi], s, z, c0, xr, acc);
    }
}

template <int BITS, bool CB, bool VEC16, int TT>
__global__ void __launch_bounds__(256)
    qm_k_gemv(const qm__cuda_job *jobs, int mat, qm__cuda_mat m, uint32_t rows_lo, uint32_t rows_hi,
              const float *in, const uint32_t *in_rows, uint32_t in_stride, float *out,
              uint32_t out_stride)
{
    constexpr uint32_t PACK = 8 / BITS, MASK = (1u << BITS) - 1;
    const qm__cuda_job *job = &jobs[blockIdx.y];
    const uint32_t n_rows = job->n_rows;
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= m.n || n_rows == 0 || n_rows < rows_lo || n_rows >= rows_hi)
        return; /* whole warps leave together: the shuffles below stay full */
    const uint8_t *wrow = job->w[mat] + (size_t)n * m.row_bytes;
    const void *scales = job->scales[mat];
    const uint8_t *zp = job->zp[mat];
    float s_row = 0.0f;
    int z_row = 0;
    if (m.nblk == 1) {
        s_row = qm_load_real(scales, m.scale_dtype, n);
        z_row = qm_zero_point<BITS>(zp, m, n, 0);
    }
    const float bias = job->bias[mat] ? qm_load_real(job->bias[mat], m.bias_dtype, n) : 0.0f;

    for (uint32_t r0 = 0; r0 < n_rows; r0 += TT) {
        const float *xr[TT];
        float acc[TT];
#pragma unroll
        for (int t = 0; t < TT; t++) {
            uint32_t r = min(r0 + (uint32_t)t, n_rows - 1); /* tail rows repeat the last */
            uint32_t brow = job->row0 + r;
            xr[t] = in + (size_t)(in_rows ? in_rows[brow] : brow) * in_stride;
            acc[t] = 0.0f;
        }
        if (VEC16) {
            /* Two 16-byte loads in flight per lane before the first use. */
            const uint32_t nchunks = m.row_bytes / 16;
            const uint4 *wv = (const uint4 *)wrow;
            for (uint32_t ch = lane; ch < nchunks; ch += 64) {
                uint4 v0 = __ldg(wv + ch);
                const bool two = ch + 32 < nchunks;
                uint4 v1 = two ? __ldg(wv + ch + 32) : make_uint4(0, 0, 0, 0);
                qm_dot_chunk<BITS, CB, TT>(v0, ch, n, m, scales, zp, s_row, z_row, xr, acc);
                if (two)
                    qm_dot_chunk<BITS, CB, TT>(v1, ch + 32, n, m, scales, zp, s_row, z_row, xr,
                                               acc);
            }
        } else {
            for (uint32_t byte = lane; byte < m.row_bytes; byte += 32) {
                uint32_t c0 = byte * PACK;
                float s = s_row;
                int z = z_row;
                qm_block_scale<BITS>(m, scales, zp, n, c0, s, z);
                uint32_t bits = wrow[byte];
#pragma unroll
                for (uint32_t i = 0; i < PACK; i++) {
                    if (PACK > 1 && c0 + i >= m.k)
                        break; /* the last byte of an odd row is half padding */
                    float w = s * (float)qm_code_value<CB>((int)((bits >> (i * BITS)) & MASK), z);
#pragma unroll
                    for (int t = 0; t < TT; t++)
                        acc[t] = fmaf(w, xr[t][c0 + i], acc[t]);
                }
            }
        }
#pragma unroll
        for (int t = 0; t < TT; t++) {
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], off);
        }
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < TT; t++) {
                if (r0 + (uint32_t)t < n_rows)
                    out[(size_t)(job->row0 + r0 + t) * out_stride + n] = acc[t] + bias;
            }
        }
    }
}

/* ---- gemm: 64 features x 64 rows per block, 32 columns per step ---- */

#define QM_GEMM_BM 64
#define QM_GEMM_BN 64
#define QM_GEMM_BK 32

template <int BITS, bool CB>
__global__ void __launch_bounds__(256)
    qm_k_gemm(const qm__cuda_job *jobs, int mat, qm__cuda_mat m, uint32_t rows_lo, const float *in,
              const uint32_t *in_rows, uint32_t in_stride, float *out, uint32_t out_stride)
{
    /* +1 column of padding: the loaders write down a column (32 lanes, 32 rows). */
    __shared__ float ws[QM_GEMM_BK][QM_GEMM_BM + 1];
    __shared__ float xs[QM_GEMM_BK][QM_GEMM_BN + 1];
    const qm__cuda_job *job = &jobs[blockIdx.z];
    const uint32_t n_rows = job->n_rows;
    const uint32_t t0 = blockIdx.y * QM_GEMM_BN, n0 = blockIdx.x * QM_GEMM_BM;
    if (t0 >= n_rows || n_rows < rows_lo) return; /* the whole block: before any barrier */
    const uint32_t tid = threadIdx.x, tx = tid & 15u, ty = tid >> 4;
    qm_tile_loader ld;
    qm_tile_loader_init(ld, job, mat, t0, in, in_rows, in_stride);
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            acc[i][j] = 0.0f;

    for (uint32_t k0 = 0; k0 < m.k; k0 += QM_GEMM_BK) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const uint32_t r = ld.row_base + 8 * i;
            qm_tile_load<BITS, CB>(ld, m, n0, k0, i, ws[ld.col][r], xs[ld.col][r]);
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < QM_GEMM_BK; kk++) {
            float a[4], bx[4];
#pragma unroll
            for (int i = 0; i < 4; i++)
                a[i] = ws[kk][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; j++)
                bx[j] = xs[kk][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    acc[i][j] = fmaf(a[i], bx[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint32_t nn = n0 + ty * 4 + i;
        if (nn >= m.n) continue;
        float bias = job->bias[mat] ? qm_load_real(job->bias[mat], m.bias_dtype, nn) : 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            uint32_t t = t0 + tx * 4 + j;
            if (t < n_rows) out[(size_t)(job->row0 + t) * out_stride + nn] = acc[i][j] + bias;
        }
    }
}

/* ---- activation ---- */

__device__ __forceinline__ float qm_sigmoid(float v)
{
    return 1.0f / (1.0f + expf(-v));
}

__global__ void qm_k_activation(qm__cuda_act act, uint32_t n_rows, const float *h1, const float *h3,
                                float *a)
{
    uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (uint64_t)n_rows * act.inter) return;
    uint32_t r = (uint32_t)(idx / act.inter), i = (uint32_t)(idx % act.inter);
    const float *h = h1 + (size_t)r * act.h1_stride;
    float v;
    switch (act.kind) {
    case QM__CUDA_ACT_RELU:
        v = fmaxf(h[i], 0.0f);
        break;
    case QM__CUDA_ACT_GELU: {
        float x = h[i];
        v = 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
        break;
    }
    case QM__CUDA_ACT_SILU:
        v = h[i] * qm_sigmoid(h[i]);
        break;
    case QM__CUDA_ACT_SWIGLU: {
        float g, l;
        if (act.fusion == 1) {
            g = h[2 * i];
            l = h[2 * i + 1];
        } else if (act.fusion == 2) {
            g = h[i];
            l = h[act.inter + i];
        } else {
            g = h[i];
            l = h3[(size_t)r * act.inter + i];
        }
        float G = fminf(g, act.limit);
        float L = fmaxf(fminf(l, act.limit), -act.limit);
        v = G * qm_sigmoid(act.alpha * G) * (L + act.beta);
        break;
    }
    default:
        v = h[i];
        break;
    }
    a[idx] = v;
}

/* GEMV over jobs with rows in [1, rows_hi): TT rows per pass, from the
 * largest such job. A job's bits never depend on the other jobs of the
 * batch (the path is a function of its own row count, and no kernel mixes
 * rows), which keeps outputs identical across waves and policies. */
template <int BITS, bool CB>
cudaError_t qm_launch_gemv(const qm__cuda_job *jobs, uint32_t n_jobs, uint32_t max_rows, int mat,
                           const qm__cuda_mat &m, bool vec16, uint32_t rows_hi, const float *in,
                           const uint32_t *in_rows, uint32_t in_stride, float *out,
                           uint32_t out_stride, cudaStream_t s)
{
    dim3 grid((m.n + 7) / 8, n_jobs);
    uint32_t tt = max_rows >= 8 ? 8 : max_rows >= 4 ? 4 : max_rows >= 2 ? 2 : 1;
    void (*k)(const qm__cuda_job *, int, qm__cuda_mat, uint32_t, uint32_t, const float *,
              const uint32_t *, uint32_t, float *, uint32_t);
    if (vec16)
        k = tt == 8   ? qm_k_gemv<BITS, CB, true, 8>
            : tt == 4 ? qm_k_gemv<BITS, CB, true, 4>
            : tt == 2 ? qm_k_gemv<BITS, CB, true, 2>
                      : qm_k_gemv<BITS, CB, true, 1>;
    else
        k = tt == 8   ? qm_k_gemv<BITS, CB, false, 8>
            : tt == 4 ? qm_k_gemv<BITS, CB, false, 4>
            : tt == 2 ? qm_k_gemv<BITS, CB, false, 2>
                      : qm_k_gemv<BITS, CB, false, 1>;
    return qm_launch(k, grid, dim3(256), s, jobs, mat, m, 1u, rows_hi, in, in_rows, in_stride, out,
                     out_stride);
}

template <int BITS, bool CB>
cudaError_t qm_launch_bits(const qm__cuda_job *jobs, uint32_t n_jobs, uint32_t min_rows,
                           uint32_t max_rows, int mat, const qm__cuda_mat &m, bool vec16,
                           qm__cuda_path path, uint32_t gemm_min_rows, const float *in,
                           const uint32_t *in_rows, uint32_t in_stride, float *out,
                           uint32_t out_stride, cudaStream_t s)
{
    if (path == QM__CUDA_PATH_NAIVE) {
        uint64_t total = (uint64_t)max_rows * m.n;
        dim3 grid((unsigned)((total + 255) / 256), n_jobs);
        return qm_launch(qm_k_naive<BITS, CB>, grid, dim3(256), s, jobs, mat, m, in, in_rows,
                         in_stride, out, out_stride);
    }
    const int tc = path == QM__CUDA_PATH_AUTO_TC_F16    ? 1
                   : path == QM__CUDA_PATH_AUTO_TC_BF16 ? 2
                                                        : 0;
    uint32_t gemm_lo = path == QM__CUDA_PATH_GEMM   ? 1u
                       : path == QM__CUDA_PATH_GEMV ? UINT32_MAX
                                                    : gemm_min_rows;
    if (min_rows < gemm_lo) {
        uint32_t gemv_max = max_rows < gemm_lo ? max_rows : gemm_lo - 1;
        cudaError_t err = qm_launch_gemv<BITS, CB>(jobs, n_jobs, gemv_max, mat, m, vec16, gemm_lo,
                                                   in, in_rows, in_stride, out, out_stride, s);
        if (err != cudaSuccess) return err;
    }
    if (max_rows >= gemm_lo && tc)
        return (cudaError_t)qm__cuda_launch_gemm_tc(jobs, n_jobs, max_rows, gemm_lo, mat, &m, tc,
                                                     in, in_rows, in_stride, out, out_stride, s);
    if (max_rows >= gemm_lo) {
        dim3 grid((m.n + QM_GEMM_BM - 1) / QM_GEMM_BM, (max_rows + QM_GEMM_BN - 1) / QM_GEMM_BN,
                  n_jobs);
        return qm_launch(qm_k_gemm<BITS, CB>, grid, dim3(256), s, jobs, mat, m, gemm_lo, in,
                         in_rows, in_stride, out, out_stride);
    }
    return cudaSuccess;
}

} /* namespace */

extern "C" int qm__cuda_launch_matmul(const qm__cuda_job *jobs_dev, uint32_t n_jobs,
                                      uint32_t min_rows, uint32_t max_rows, int mat,
                                      const qm__cuda_mat *m, int vec16, qm__cuda_path path,
                                      uint32_t gemm_min_rows, const float *in,
                                      const uint32_t *in_rows, uint32_t in_stride, float *out,
                                      uint32_t out_stride, void *stream)
{
    if (n_jobs == 0 || max_rows == 0 || m->n == 0) return (int)cudaSuccess;
    if (gemm_min_rows == 0) gemm_min_rows = 1;
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t err;
    if (m->codebook && m->bits != 4) return (int)cudaErrorInvalidValue;
    switch (m->bits) {
    case 2:
        err = qm_launch_bits<2, false>(jobs_dev, n_jobs, min_rows, max_rows, mat, *m, vec16 != 0,
                                       path, gemm_min_rows, in, in_rows, in_stride, out, out_stride,
                                       s);
        break;
    case 4:
        err = m->codebook ? qm_launch_bits<4, true>(jobs_dev, n_jobs, min_rows, max_rows, mat, *m,
                                                    vec16 != 0, path, gemm_min_rows, in, in_rows,
                                                    in_stride, out, out_stride, s)
                          : qm_launch_bits<4, false>(jobs_dev, n_jobs, min_rows, max_rows, mat, *m,
                                                     vec16 != 0, path, gemm_min_rows, in, in_rows,
                                                     in_stride, out, out_stride, s);
        break;
    case 8:
        err = qm_launch_bits<8, false>(jobs_dev, n_jobs, min_rows, max_rows, mat, *m, vec16 != 0,
                                       path, gemm_min_rows, in, in_rows, in_stride, out, out_stride,
                                       s);
        break;
    default:
        err = cudaErrorInvalidValue;
        break;
    }
    return (int)err;
}

extern "C" int qm__cuda_launch_activation(const qm__cuda_act *act, uint32_t n_rows, const float *h1,
                                          const float *h3, float *a, void *stream)
{
    uint64_t total = (uint64_t)n_rows * act->inter;
    if (total == 0) return (int)cudaSuccess;
    unsigned blocks = (unsigned)((total + 255) / 256);
    return (int)qm_launch(qm_k_activation, dim3(blocks), dim3(256), (cudaStream_t)stream, *act,
                          n_rows, h1, h3, a);
}
