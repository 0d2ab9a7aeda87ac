/* qm_cuda.h - the CUDA backend's public header: its constructor, and what it
 * offers beyond the backend interface (engine/backend/qm_backend.h).
 *
 * The registry (backends/qm_backend_registry.c) opens it as kind "cuda"
 * through its row, qm__backend_cuda_kind; this header is for the users
 * that want CUDA itself (tests, bench). Always available: in a build
 * without CUDA (QMOE_HAVE_CUDA off) the library qmoe_cuda is a stub whose
 * constructor and row answer QM_EUNSUPPORTED, so nobody needs an #ifdef.
 * Host memory registration goes through the common
 * qm_backend_register_host. The extras are CUDA-only knobs (kernel choice,
 * routing, tensor cores); every one of them returns QM_EINVAL when `be` is
 * not a CUDA backend. */
#ifndef QM_CUDA_H
#define QM_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "qm_backend.h"

/* Creates the CUDA backend on `device`; QM_EUNSUPPORTED when built without
 * CUDA, QM_EDEVICE when no device answers. Free with qm_backend_free. */
int qm_backend_cuda_new(int device, qm_backend **out, qm_status *st);

typedef enum qm_cuda_kernels {
    QM_CUDA_KERNELS_AUTO = 0, /* GEMV for few rows per expert, tiled GEMM for many */
    QM_CUDA_KERNELS_GEMV,
    QM_CUDA_KERNELS_GEMM,
    QM_CUDA_KERNELS_NAIVE, /* one thread per output: the reference */
} qm_cuda_kernels;

/* Chooses the matmul kernels for later run_experts calls. `gemm_min_rows`
 * (AUTO only; 0 keeps the default, 16): the largest job's row count from
 * which the tiled GEMM runs. The environment variable QMOE_CUDA_KERNELS
 * (auto|gemv|gemm|naive) sets the initial choice at creation. */
int qm_backend_cuda_set_kernels(qm_backend *be, qm_cuda_kernels kernels, uint32_t gemm_min_rows);

/* Where layer calls are routed. on_device = 1 (the default): router logits,
 * top-k softmax, the permutation of token rows by expert and the combine run
 * on the device, and only the routes come back to the host (for the pager).
 * 0: the engine routes and combines on the host (the CPU backend's way) and
 * the device runs the expert FFNs only. The environment variable
 * QMOE_CUDA_ROUTING=host|device sets the initial choice at creation. */
int qm_backend_cuda_set_routing(qm_backend *be, int on_device);

/* Tensor cores (on by default, on devices of compute capability 8.0+):
 * routed layer calls whose activations are f16 or bf16 run their GEMM-sized
 * jobs (prefill) through a WMMA dequantise-GEMM with operands rounded to
 * that type and f32 accumulation; f32 calls always use the f32 GEMM.
 * QMOE_CUDA_TENSOR_CORES=0 switches them off at creation. */
int qm_backend_cuda_set_tensor_cores(qm_backend *be, int on);

typedef struct qm_cuda_stats {
    uint64_t copies;        /* copy_h2d calls */
    uint64_t bytes_direct;  /* copied straight from registered memory */
    uint64_t bytes_bounced; /* copied through the pinned bounce ring */
    uint64_t batches;       /* run_experts calls that ran kernels */
    uint64_t scratch_grows; /* device/pinned scratch reallocations (run_experts, routed passes) */
    uint64_t routes;        /* layer calls routed on the device */
    uint64_t tc_batches;    /* FFN launch sets with GEMM-sized jobs on tensor cores */
} qm_cuda_stats;

int qm_backend_cuda_stats(qm_backend *be, qm_cuda_stats *out);

#endif
