/* qm_cuda_internal.h - the CUDA backend's context, shared by its two host
 * files (qm_cuda_backend.c: device, arenas, copies, fences; qm_cuda_run.c:
 * run_experts). Private to cuda/. */
#ifndef QM_CUDA_INTERNAL_H
#define QM_CUDA_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "qm_backend_impl.h"
#include "qm_cuda.h"
#include "qm_cuda_kernels.h"

/* Fence events are a ring indexed by copy sequence number. A fence older
 * than the ring finds a later event in its slot; waiting on that one is
 * still correct (the copy stream is in order), only later. */
#define QM__CUDA_FENCE_RING 256u
/* Pinned bounce buffers for copies from unregistered memory: while the
 * device reads one, the host fills the next. */
#define QM__CUDA_BOUNCE_COUNT 4u
#define QM__CUDA_BOUNCE_BYTES ((size_t)8 << 20)
#define QM__CUDA_GEMM_MIN_ROWS_DEFAULT 16u

typedef struct qm__cuda_registration {
    const void *ptr; /* as the caller passed it */
    uintptr_t start; /* page-aligned range actually registered */
    size_t bytes;
    int borrowed; /* registered by another device's backend (portable): not ours to unregister */
} qm__cuda_registration;

/* Device and pinned scratch of run_experts, grown on demand and kept, so a
 * steady workload allocates nothing per call. */
typedef struct qm__cuda_scratch {
    float *x, *h1, *h3, *a, *y; /* device */
    uint32_t *rows;
    qm__cuda_job *jobs;
    size_t x_cap, h1_cap, h3_cap, a_cap, y_cap, rows_cap, jobs_cap; /* elements */
    float *host_x, *host_y;                                         /* pinned */
    void *host_table;                                               /* pinned: jobs then rows */
    size_t host_x_cap, host_y_cap, host_table_cap; /* bytes for host_table, elements else */
} qm__cuda_scratch;

/* A layer call routed on the device (qm_cuda_route.c): x, the routes, their
 * permutation and the experts' outputs stay here from route to combine.
 * Passes are pooled in the context and keep their buffers, so a steady
 * workload allocates nothing per call; two sessions at once use two passes. */
typedef struct qm__cuda_pass {
    struct qm__cuda_pass *next; /* pool */
    uint32_t n_tokens, n_experts, k, hidden;
    uint32_t n_active;   /* routes not dropped = rows of y */
    int tc;              /* tensor cores for the GEMM-sized jobs: 0 no, 1 f16, 2 bf16 */
    uint32_t *counts;    /* host [E]: routes per expert (in host_res) */
    uint32_t *offsets;   /* host [E + 1]: first row of each expert in y */
    uint8_t *ran;        /* host [E]: the expert's rows of y are computed */
    size_t host_cap_e;   /* capacity of offsets/ran (experts) */
    /* device; caps in elements (bytes for router) */
    float *x;            /* [T, H]; the combine's output reuses it */
    float *logits;       /* [T, E] */
    void *router;        /* router weight then bias, as in the bank */
    void *res;           /* experts [T*k] | weights [T*k] | counts [E] | offsets [E + 1] */
    uint32_t *idx;       /* rank [T*k] | slot_of [T*k] | perm_token [T*k] */
    float *y, *h1, *h3, *a;
    qm__cuda_job *jobs;
    size_t x_cap, logits_cap, router_cap, res_cap, idx_cap, y_cap, h1_cap, h3_cap, a_cap, jobs_cap;
    /* pinned */
    void *host_io;       /* x (and logits or router) up; the output down */
    void *host_res;      /* res down */
    void *host_jobs;     /* job table up */
    size_t host_io_cap, host_res_cap, host_jobs_cap; /* bytes */
} qm__cuda_pass;

typedef struct qm__cuda_ctx {
    int device;
    char name[256];
    int readonly_register; /* cudaHostRegisterReadOnly supported */
    int lost;              /* a sticky CUDA error happened: every call fails */
    char lost_reason[96];

    cudaStream_t copy_stream, compute_stream;

    pthread_mutex_t copy_lock; /* sequence, fence ring, bounce ring, registrations, stats */
    uint64_t copy_seq, done_seq;
    cudaEvent_t fence_event[QM__CUDA_FENCE_RING];
    uint64_t fence_event_seq[QM__CUDA_FENCE_RING];
    void *bounce[QM__CUDA_BOUNCE_COUNT];
    cudaEvent_t bounce_event[QM__CUDA_BOUNCE_COUNT];
    int bounce_pending[QM__CUDA_BOUNCE_COUNT];
    unsigned bounce_next;
    qm__cuda_registration *regs;
    size_t n_regs, regs_cap;

    pthread_mutex_t run_lock; /* scratch and the compute stream's batch */
    qm__cuda_scratch scratch;
    qm_cuda_kernels kernels;
    uint32_t gemm_min_rows;
    int route_on_device;       /* 1: the optional route methods answer (default) */
    int tensor_cores;          /* 1: f16/bf16 routed calls use the WMMA GEMM (default) */
    int cc_major;              /* compute capability: tensor-core GEMM needs 8+ */
    qm__cuda_pass *pass_pool;  /* idle passes, under run_lock */

    qm_cuda_stats stats; /* under copy_lock (copies) or run_lock (batches) */
} qm__cuda_ctx;

/* Maps a failed CUDA call into the project's codes, with a sentence naming
 * `what`, and marks the backend lost on sticky (context-destroying) errors.
 * Out of memory -> QM_ERESOURCE_EXHAUSTED. Returns the code. */
int qm__cuda_fail(qm__cuda_ctx *c, cudaError_t err, qm_status *st, const char *what);
/* 1 for the errors that leave the device unusable (the context is lost). */
int qm__cuda_is_sticky(cudaError_t err);

/* Checks one CUDA call; on failure sets rc and st (qm__cuda_fail) and jumps
 * to the caller's `fail` label. */
#define QM__CU(c, call, what)                                                                      \
    do {                                                                                           \
        cudaError_t qm__e = (call);                                                                \
        if (qm__e != cudaSuccess) {                                                                \
            rc = qm__cuda_fail((c), qm__e, st, (what));                                            \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)
/* Makes the backend's device current on this thread; QM_EDEVICE when lost. */
int qm__cuda_enter(qm__cuda_ctx *c, qm_status *st);
/* After a failed launch sequence: leaves the compute stream idle (unless the
 * device is lost) so its scratch can be reused by the next call, and clears
 * non-sticky errors. */
void qm__cuda_settle(qm__cuda_ctx *c);
/* The one exit of a call holding run_lock: settles after a failure (rc < 0,
 * in or before its launches), then releases the lock. Returns rc. */
int qm__cuda_unlock_run(qm__cuda_ctx *c, int rc);

int qm__cuda_run_experts(void *ctx, const qm_expert_batch *batch, qm_status *st);
void qm__cuda_scratch_free(qm__cuda_scratch *s);

/* Makes *buf hold at least `need` elements of `size` bytes (device or pinned,
 * grown with headroom, never shrunk; counts scratch_grows). */
int qm__cuda_reserve(qm__cuda_ctx *c, void **buf, size_t *cap, size_t need, size_t size,
                     int pinned, qm_status *st);

/* The layer's matrices as the kernels see them, checked against its shapes. */
typedef struct qm__cuda_geom {
    qm__cuda_mat mats[QM__CUDA_MATS];
    int use_fc3;
    uint32_t n1; /* fc1 outputs: 2I for fused swiglu, else I */
    qm__cuda_act act;
    int vec16[QM__CUDA_MATS]; /* layer allows the 16-byte GEMV (pointers checked per job) */
} qm__cuda_geom;
int qm__cuda_geom_of(const qm_bank_config *cfg, const qm_layer_view *lv, qm__cuda_geom *g,
                     qm_status *st);
/* Checks that `job` has every weight pointer the layer needs. */
int qm__cuda_check_job(const qm__cuda_geom *g, const qm_layer_view *lv, const qm_expert_job *job,
                       qm_status *st);
/* Fills the device job entry of `job` (row0 and n_rows by the caller);
 * clears vec16[m] when a weight pointer is not 16-byte aligned. */
void qm__cuda_fill_job(const qm__cuda_geom *g, const qm_layer_view *lv, const qm_expert_job *job,
                       qm__cuda_job *dj, int vec16[QM__CUDA_MATS]);
/* FC1 (FC3), activation and FC2 over n_jobs jobs (a device table) of R
 * batch rows: input row b is x + x_rows[b] * H, output row b is y + b * H. */
/* tc: 0, or 1 / 2 for f16 / bf16 tensor cores on the GEMM-sized jobs
 * (honoured only with the AUTO kernel choice). */
int qm__cuda_launch_ffn(qm__cuda_ctx *c, const qm__cuda_geom *g, const int vec16[QM__CUDA_MATS],
                        const qm__cuda_job *jobs_dev, uint32_t n_jobs, uint32_t min_rows,
                        uint32_t max_rows, uint32_t R, const float *x, const uint32_t *x_rows,
                        uint32_t hidden, float *h1, float *h3, float *a, float *y, int tc,
                        cudaStream_t cs, qm_status *st);

/* Device routing (qm_cuda_route.c): the optional methods of the interface. */
int qm__cuda_route(void *ctx, const qm_routing_request *rq, void **pass, qm_status *st);
int qm__cuda_run_routed(void *ctx, void *pass, const qm_expert_batch *batch, qm_status *st);
int qm__cuda_combine(void *ctx, void *pass, float *out, qm_status *st);
void qm__cuda_pass_release(void *ctx, void *pass);
void qm__cuda_passes_free(qm__cuda_ctx *c); /* the pool, at destroy */

#endif
