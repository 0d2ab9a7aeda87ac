/* qm_cuda_kernels.h - the MoE expert kernels of the CUDA backend, seen from
 * the host code (C). Private to cuda/.
 *
 * One layer call runs as three launches over every job of the batch at once
 * (the grid's job dimension indexes a device-side job table), so a decode
 * step costs three launches whatever k is, not three per expert:
 *   1. FC1 (and FC3) dequantise-matmul: h[row, n] = W[n, :] . x[row, :] + b[n]
 *   2. activation, swiglu forms included: a[row, i]
 *   3. FC2 dequantise-matmul: y[row, n] = W2[n, :] . a[row, :] + b2[n]
 * Rows are "batch rows": the job's rows laid end to end (job.row0 + r). */
#ifndef QM_CUDA_KERNELS_H
#define QM_CUDA_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { QM__CUDA_FC1 = 0, QM__CUDA_FC2 = 1, QM__CUDA_FC3 = 2, QM__CUDA_MATS = 3 };

/* Scale and bias element types (values of qm_dtype, repeated so that this
 * header needs no other project header). */
enum { QM__CUDA_F32 = 0, QM__CUDA_F16 = 1, QM__CUDA_BF16 = 2 };

/* One expert's job, as the kernels read it (device copy of a host array). */
typedef struct qm__cuda_job {
    const uint8_t *w[QM__CUDA_MATS];   /* packed codes [N, row_bytes] */
    const void *scales[QM__CUDA_MATS]; /* [N, nblk] */
    const uint8_t *zp[QM__CUDA_MATS];  /* NULL: implicit 2^(bits-1) */
    const void *bias[QM__CUDA_MATS];   /* NULL: none */
    uint32_t row0;                     /* first batch row */
    uint32_t n_rows;
} qm__cuda_job;

/* Geometry of one of the layer's matrices, the same for every expert. */
typedef struct qm__cuda_mat {
    uint32_t n, k;         /* output features, input columns */
    uint32_t bits;         /* 2, 4 or 8 */
    uint32_t codebook;     /* 1: 4-bit codes through the e2m1 code book, no zero points */
    uint32_t row_bytes;    /* bytes per packed row: ceil(k * bits / 8) */
    uint32_t nblk;         /* scales per row; 1 = row-wise */
    uint32_t block_shift;  /* log2(block size) when nblk > 1 */
    uint32_t zp_blockwise; /* 1: zp [n, zp_row_bytes] along blocks; 0: along rows */
    uint32_t zp_row_bytes;
    uint32_t scale_dtype, bias_dtype;
} qm__cuda_mat;

enum {
    QM__CUDA_ACT_RELU = 0,
    QM__CUDA_ACT_GELU,
    QM__CUDA_ACT_SILU,
    QM__CUDA_ACT_SWIGLU,
    QM__CUDA_ACT_IDENTITY
};

typedef struct qm__cuda_act {
    uint32_t kind;      /* QM__CUDA_ACT_* */
    uint32_t fusion;    /* swiglu: 0 g from fc1 / l from fc3, 1 interleaved, 2 concatenated */
    uint32_t inter;     /* I: output columns */
    uint32_t h1_stride; /* columns of the fc1 output buffer (N1) */
    float alpha, beta, limit;
} qm__cuda_act;

/* Matmul implementation. AUTO: GEMV (warp per output feature, 16-byte loads)
 * for jobs of fewer than gemm_min_rows rows, shared-memory tiled GEMM for
 * the others (chosen per job, so a job's result never depends on the rest
 * of its batch). NAIVE: one thread per output element, the
 * readable reference the tests compare the fast ones with. */
typedef enum qm__cuda_path {
    QM__CUDA_PATH_AUTO = 0,
    QM__CUDA_PATH_GEMV,
    QM__CUDA_PATH_GEMM,
    QM__CUDA_PATH_NAIVE,
    /* AUTO with the GEMM-sized jobs on tensor cores (qm_cuda_tc.cu, sm_80+),
     * operands rounded to f16 / bf16: for layer calls whose activations are
     * f16 / bf16. Chosen by the host code, never by the public knob. */
    QM__CUDA_PATH_AUTO_TC_F16,
    QM__CUDA_PATH_AUTO_TC_BF16,
} qm__cuda_path;

/* out[(job.row0 + r) * out_stride + n] = W_mat(job)[n, :] . in(row) + bias[n]
 * for every job and r < job.n_rows, n < m->n. min_rows/max_rows: the
 * smallest and largest n_rows of the (non-empty) jobs. The input row of
 * batch row `b` is in + (in_rows ? in_rows[b] : b) * in_stride. `vec16`:
 * every job's weight pointer is 16-byte aligned, row_bytes % 16 == 0,
 * row_bytes * 8 / bits == k and in_stride % 4 == 0 (the host checks).
 * Returns a cudaError_t value. */
int qm__cuda_launch_matmul(const qm__cuda_job *jobs_dev, uint32_t n_jobs, uint32_t min_rows,
                           uint32_t max_rows, int mat, const qm__cuda_mat *m, int vec16,
                           qm__cuda_path path, uint32_t gemm_min_rows, const float *in,
                           const uint32_t *in_rows, uint32_t in_stride, float *out,
                           uint32_t out_stride, void *stream);

/* The tensor-core GEMM over the jobs with n_rows >= rows_lo; tc = 1: f16
 * operands, 2: bf16; f32 accumulation and bias. Same contract as
 * qm__cuda_launch_matmul otherwise. */
int qm__cuda_launch_gemm_tc(const qm__cuda_job *jobs, uint32_t n_jobs, uint32_t max_rows,
                            uint32_t rows_lo, int mat, const qm__cuda_mat *m, int tc,
                            const float *in, const uint32_t *in_rows, uint32_t in_stride,
                            float *out, uint32_t out_stride, void *stream);

/* a[b, i] for every batch row b < n_rows (h3 used only for swiglu fusion 0). */
int qm__cuda_launch_activation(const qm__cuda_act *act, uint32_t n_rows, const float *h1,
                               const float *h3, float *a, void *stream);

/* ---- routing, permutation and combine (qm_cuda_route.cu) ----
 * The semantics of the engine's host routing (engine/forward/qm_routing.c:
 * qm_moe_route, qm_moe_router_logits; engine/forward/qm_host_route.c: the grouping
 * by expert and the combine), on the device. */

#define QM__CUDA_DROPPED 0xffffffffu /* QM_ROUTE_DROPPED */

/* logits[t, e] = sum_c w[e, c] * x[t, c] (+ b[e]), products and sum in
 * double (exact products, lane-strided partial sums, a fixed-order warp
 * reduction), rounded to f32 once. w: [E, H] of w_dtype; b: [E] or NULL. */
int qm__cuda_launch_router_logits(const float *x, uint32_t n_tokens, uint32_t hidden,
                                  uint32_t n_experts, const void *w, uint32_t w_dtype,
                                  const void *b, uint32_t b_dtype, float *logits, void *stream);

/* Top-k (ties to the larger index, NaN never beats a number), softmax over
 * the k, weights <= 1e-8 dropped: experts/weights [T, k]. One thread per token. */
int qm__cuda_launch_topk(const float *logits, uint32_t n_tokens, uint32_t n_experts, uint32_t k,
                         uint32_t *experts, float *weights, void *stream);

/* Groups the routes by expert, tokens ascending within an expert (a stable
 * counting sort, no atomics: deterministic). counts [E]; offsets [E + 1]
 * (exclusive prefix); slot_of [T*k]: the route's row in expert order
 * (QM__CUDA_DROPPED for dropped routes); perm_token [T*k]: the token of each
 * slot (the first sum(counts) entries are written); rank [T*k]: scratch.
 * Three launches. */
int qm__cuda_launch_permute(const uint32_t *experts, uint32_t n_tokens, uint32_t n_experts,
                            uint32_t k, uint32_t *counts, uint32_t *offsets, uint32_t *rank,
                            uint32_t *slot_of, uint32_t *perm_token, void *stream);

/* out[t, c] = sum over j = 0..k-1 of weights[t, j] * y[slot_of[t, j], c],
 * in that order, multiply then add in f32 (no fused multiply-add: the host
 * combine's order and rounding), dropped routes skipped. */
int qm__cuda_launch_combine(const float *y, const uint32_t *slot_of, const float *weights,
                            uint32_t n_tokens, uint32_t k, uint32_t hidden, float *out,
                            void *stream);

#ifdef __cplusplus
}
#endif

#endif
