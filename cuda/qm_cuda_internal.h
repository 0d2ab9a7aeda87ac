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

    qm_cuda_stats stats; /* under copy_lock (copies) or run_lock (batches) */
} qm__cuda_ctx;

/* Maps a failed CUDA call into the project's codes, with a sentence naming
 * `what`, and marks the backend lost on sticky (context-destroying) errors.
 * Out of memory -> QM_ERESOURCE_EXHAUSTED. Returns the code. */
int qm__cuda_fail(qm__cuda_ctx *c, cudaError_t err, qm_status *st, const char *what);
/* Makes the backend's device current on this thread; QM_EDEVICE when lost. */
int qm__cuda_enter(qm__cuda_ctx *c, qm_status *st);

int qm__cuda_run_experts(void *ctx, const qm_expert_batch *batch, qm_status *st);
void qm__cuda_scratch_free(qm__cuda_scratch *s);

#endif
