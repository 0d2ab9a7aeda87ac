/* qm_cuda_route.cu - routing, token permutation and combine of an MoE layer
 * on the device, with the semantics of engine/forward/qm_moe.c (the CPU engine is
 * the reference; ../shared/BANK_FORMAT.md):
 *
 *   router logits  warp per (token, expert): products and sums in double
 *                  (the host also sums in double), one rounding to f32;
 *   top-k softmax  thread per token: the host's selection loop verbatim
 *                  (ties to the larger index, NaN never beats a number),
 *                  softmax over the k in f32 with exp in double (correctly
 *                  rounded, as glibc's expf nearly always is), drop <= 1e-8;
 *   permutation    a stable counting sort by expert without atomics, so
 *                  rows are ordered as the host groups them (tokens
 *                  ascending within an expert) and runs are deterministic;
 *   combine        route order j = 0..k-1, f32 multiply then add with no
 *                  fused multiply-add (the host is built with
 *                  -ffp-contract=off: C11 ISO mode), fc2 bias already in y.
 * Only the routes (ids, weights, per-expert counts) go back to the host. */
#include "qm_cuda_device.cuh"

namespace
{

#define QM_ROUTE_BLOCK 256u

__global__ void __launch_bounds__(256)
    qm_k_router_logits(const float *x, uint32_t n_tokens, uint32_t hidden, uint32_t n_experts,
                       const void *w, uint32_t w_dtype, const void *b, uint32_t b_dtype,
                       float *logits)
{
    const uint32_t lane = threadIdx.x & 31u;
    const uint64_t p = (uint64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (p >= (uint64_t)n_tokens * n_experts) return; /* whole warps: the shuffles stay full */
    const uint32_t t = (uint32_t)(p / n_experts), e = (uint32_t)(p % n_experts);
    const float *xr = x + (size_t)t * hidden;
    /* (double)a * (double)b is exact for two floats, so a fused or a
     * separate multiply-add gives the same bits. */
    double acc = 0.0;
    for (uint32_t c = lane; c < hidden; c += 32)
        acc += (double)qm_load_real(w, w_dtype, (size_t)e * hidden + c) * (double)xr[c];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) {
        if (b) acc += (double)qm_load_real(b, b_dtype, e);
        logits[p] = (float)acc;
    }
}

__global__ void qm_k_topk(const float *logits, uint32_t n_tokens, uint32_t n_experts, uint32_t k,
                          uint32_t *experts, float *weights)
{
    const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_tokens) return;
    const float *l = logits + (size_t)t * n_experts;
    uint32_t *ex = experts + (size_t)t * k;
    float *w = weights + (size_t)t * k;
    for (uint32_t j = 0; j < k; j++) {
        uint32_t best = QM__CUDA_DROPPED;
        for (uint32_t e = 0; e < n_experts; e++) {
            int taken = 0;
            for (uint32_t i = 0; i < j; i++)
                taken |= ex[i] == e;
            if (taken) continue;
            if (best == QM__CUDA_DROPPED || l[e] >= l[best] || (isnan(l[best]) && !isnan(l[e])))
                best = e;
        }
        ex[j] = best;
        w[j] = l[best]; /* the selected logit until the softmax below */
    }
    const float v0 = w[0]; /* the largest */
    float sum = 0.0f;
    for (uint32_t j = 0; j < k; j++) {
        w[j] = (float)exp((double)__fsub_rn(w[j], v0));
        sum = __fadd_rn(sum, w[j]);
    }
    for (uint32_t j = 0; j < k; j++) {
        w[j] = __fdiv_rn(w[j], sum);
        if (!(w[j] > 1e-8f)) {
            w[j] = 0.0f;
            ex[j] = QM__CUDA_DROPPED;
        }
    }
}

/* Block e: the rank of each route to expert e among the routes to e, in
 * token order, by a block-wide scan over the tokens; counts[e] at the end. */
__global__ void __launch_bounds__(256)
    qm_k_rank(const uint32_t *experts, uint32_t n_tokens, uint32_t k, uint32_t *counts,
              uint32_t *rank)
{
    __shared__ uint32_t scan[QM_ROUTE_BLOCK];
    __shared__ uint32_t running;
    const uint32_t e = blockIdx.x, tid = threadIdx.x;
    if (tid == 0) running = 0;
    __syncthreads();
    for (uint32_t base = 0; base < n_tokens; base += QM_ROUTE_BLOCK) {
        const uint32_t t = base + tid;
        uint32_t jj = QM__CUDA_DROPPED;
        if (t < n_tokens) {
            for (uint32_t j = 0; j < k; j++) {
                if (experts[(size_t)t * k + j] == e) {
                    jj = j; /* a token picks an expert at most once */
                    break;
                }
            }
        }
        scan[tid] = jj != QM__CUDA_DROPPED;
        __syncthreads();
        for (uint32_t off = 1; off < QM_ROUTE_BLOCK; off <<= 1) { /* inclusive, Hillis-Steele */
            uint32_t v = tid >= off ? scan[tid - off] : 0u;
            __syncthreads();
            scan[tid] += v;
            __syncthreads();
        }
        if (jj != QM__CUDA_DROPPED) rank[(size_t)t * k + jj] = running + scan[tid] - 1;
        __syncthreads(); /* every thread has read `running` */
        if (tid == QM_ROUTE_BLOCK - 1) running += scan[tid];
        __syncthreads();
    }
    if (tid == 0) counts[e] = running;
}

__global__ void qm_k_offsets(const uint32_t *counts, uint32_t n_experts, uint32_t *offsets)
{
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    uint32_t s = 0;
    for (uint32_t e = 0; e < n_experts; e++) {
        offsets[e] = s;
        s += counts[e];
    }
    offsets[n_experts] = s;
}

__global__ void qm_k_slots(const uint32_t *experts, uint32_t n_routes, uint32_t k,
                           const uint32_t *offsets, const uint32_t *rank, uint32_t *slot_of,
                           uint32_t *perm_token)
{
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_routes) return;
    const uint32_t e = experts[i];
    if (e == QM__CUDA_DROPPED) {
        slot_of[i] = QM__CUDA_DROPPED;
        return;
    }
    const uint32_t s = offsets[e] + rank[i];
    slot_of[i] = s;
    perm_token[s] = i / k;
}

__global__ void qm_k_combine(const float *y, const uint32_t *slot_of, const float *weights,
                             uint32_t n_tokens, uint32_t k, uint32_t hidden, float *out)
{
    const uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (uint64_t)n_tokens * hidden) return;
    const uint32_t t = (uint32_t)(idx / hidden), c = (uint32_t)(idx % hidden);
    float o = 0.0f;
    for (uint32_t j = 0; j < k; j++) {
        const size_t i = (size_t)t * k + j;
        const uint32_t s = slot_of[i];
        if (s == QM__CUDA_DROPPED) continue;
        o = __fadd_rn(o, __fmul_rn(weights[i], y[(size_t)s * hidden + c]));
    }
    out[idx] = o;
}

unsigned qm_blocks(uint64_t n, unsigned per)
{
    return (unsigned)((n + per - 1) / per);
}

} /* namespace */

extern "C" int qm__cuda_launch_router_logits(const float *x, uint32_t n_tokens, uint32_t hidden,
                                             uint32_t n_experts, const void *w, uint32_t w_dtype,
                                             const void *b, uint32_t b_dtype, float *logits,
                                             void *stream)
{
    uint64_t pairs = (uint64_t)n_tokens * n_experts;
    if (pairs == 0) return (int)cudaSuccess;
    return (int)qm_launch(qm_k_router_logits, dim3(qm_blocks(pairs, 8)), dim3(256),
                          (cudaStream_t)stream, x, n_tokens, hidden, n_experts, w, w_dtype, b,
                          b_dtype, logits);
}

extern "C" int qm__cuda_launch_topk(const float *logits, uint32_t n_tokens, uint32_t n_experts,
                                    uint32_t k, uint32_t *experts, float *weights, void *stream)
{
    if (n_tokens == 0 || k == 0) return (int)cudaSuccess;
    return (int)qm_launch(qm_k_topk, dim3(qm_blocks(n_tokens, 128)), dim3(128),
                          (cudaStream_t)stream, logits, n_tokens, n_experts, k, experts, weights);
}

extern "C" int qm__cuda_launch_permute(const uint32_t *experts, uint32_t n_tokens,
                                       uint32_t n_experts, uint32_t k, uint32_t *counts,
                                       uint32_t *offsets, uint32_t *rank, uint32_t *slot_of,
                                       uint32_t *perm_token, void *stream)
{
    if (n_experts == 0) return (int)cudaSuccess;
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t err = qm_launch(qm_k_rank, dim3(n_experts), dim3(QM_ROUTE_BLOCK), s, experts,
                                n_tokens, k, counts, rank);
    if (err != cudaSuccess) return (int)err;
    err = qm_launch(qm_k_offsets, dim3(1), dim3(1), s, (const uint32_t *)counts, n_experts,
                    offsets);
    if (err != cudaSuccess) return (int)err;
    const uint32_t n_routes = n_tokens * k;
    if (n_routes == 0) return (int)cudaSuccess;
    return (int)qm_launch(qm_k_slots, dim3(qm_blocks(n_routes, 256)), dim3(256), s, experts,
                          n_routes, k, (const uint32_t *)offsets, (const uint32_t *)rank, slot_of,
                          perm_token);
}

extern "C" int qm__cuda_launch_combine(const float *y, const uint32_t *slot_of,
                                       const float *weights, uint32_t n_tokens, uint32_t k,
                                       uint32_t hidden, float *out, void *stream)
{
    uint64_t total = (uint64_t)n_tokens * hidden;
    if (total == 0) return (int)cudaSuccess;
    return (int)qm_launch(qm_k_combine, dim3(qm_blocks(total, 256)), dim3(256),
                          (cudaStream_t)stream, y, slot_of, weights, n_tokens, k, hidden, out);
}
