/* qm_backend.h - the device backend, seen from its users (pager, forward pass, daemon).
 *
 * A backend is { iface, ctx }: CPU and CUDA are two instances of the same
 * interface (qm_backend_impl.h), neither special-cased. "Device memory" is
 * whatever the backend's arenas hold: a host arena for CPU, cudaMalloc for CUDA. */
#ifndef QM_BACKEND_H
#define QM_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "qm_bank.h"
#include "qm_error.h"

typedef struct qm_backend qm_backend;
typedef struct qm_arena qm_arena; /* one device allocation, carved by the caller */

typedef struct qm_device_info {
    char name[128];       /* "cpu (AVX2+FMA, 2 threads)", "NVIDIA H200" */
    char kind[16];        /* "cpu", "cuda" or "emu" */
    uint64_t total_bytes; /* device memory (CPU: physical RAM) */
    uint64_t free_bytes;
} qm_device_info;

/* Completion of an asynchronous copy. Opaque value owned by the caller
 * (embed it); qm_backend_fence_wait blocks until the copy it was issued
 * with has landed. A zeroed fence is complete. */
typedef struct qm_fence {
    uint64_t seq;
    void *handle;
} qm_fence;

/* Per-expert weight pointers as the backend's kernels read them: pointer
 * i is tensor i (enum qm_bank_tensor, < QM_T_EXPERT_COUNT) of this expert,
 * NULL when the layer lacks it. They point into device memory (an arena)
 * or, for backends with host_visible = 1, may point into the mapped bank. */
typedef struct qm_expert_weights {
    const void *ptr[QM_T_EXPERT_COUNT];
} qm_expert_weights;

/* One expert's work in a layer call: rows of x to run through the FFN.
 * Output row r is written to y + out_index[r] * hidden. */
typedef struct qm_expert_job {
    uint32_t expert;
    qm_expert_weights weights;
    const uint32_t *rows; /* token indices into x, ascending */
    const uint32_t *out_index;
    uint32_t n_rows;
} qm_expert_job;

/* Arithmetic of a session (PROTOCOL.md session.create `precision`). EXACT:
 * f32, within 1e-5 of onnxruntime's exact path. FAST: activations quantised
 * per 32 columns to int8 and integer dot products (CPU backend; the bound is
 * in docs/ARCHITECTURE.md); a backend without it runs EXACT. */
typedef enum qm_precision { QM_PRECISION_EXACT = 0, QM_PRECISION_FAST = 1 } qm_precision;

/* A batch of expert jobs of one layer. x: [T, hidden] f32 host memory;
 * y: host memory with room for every out_index. The backend may run jobs
 * in any order and in parallel; each job's result must not depend on that
 * order or on the thread count (bitwise). */
typedef struct qm_expert_batch {
    const qm_bank_config *config;
    const qm_layer_view *layer; /* dtypes and shapes of the tensors */
    const float *x;
    uint32_t n_tokens;
    float *y;
    const qm_expert_job *jobs;
    size_t n_jobs;
    qm_precision precision; /* zero-initialised: exact */
} qm_expert_batch;

/* ---- Calls (the only call sites of the iface; optional methods defaulted here) ---- */

/* Creates the CPU backend: `threads` workers (0 = number of cores). */
int qm_backend_cpu_new(uint32_t threads, qm_backend **out, qm_status *st);
/* The emulated device (qm_backend_emu.c): not host visible, so the pager
 * copies everything it runs, but its arenas are host memory and its
 * compute is the CPU kernels, so outputs are the CPU backend's bit for bit.
 * Copies land when their fence is waited (in issue order); with gbps > 0
 * each takes bytes / gbps + latency_us on one in-order stream, slept in the
 * wait. For running several devices and paging where no GPU is (the
 * daemon's --backend emu, the paging suites). host_visible = 1 and a
 * compute_slowdown make it a modelled host instead (bench/hybrid). */
typedef struct qm_emu_options {
    uint32_t index;          /* names it: "emu:<index>" */
    uint32_t threads;        /* its CPU backend's workers (0 = cores) */
    double gbps;             /* modelled copy bandwidth, GB/s (0: copies cost nothing) */
    double latency_us;       /* added to each copy when gbps > 0 */
    uint64_t total_bytes;    /* the memory it reports (0: the host's physical RAM) */
    int host_visible;        /* 1: kernels may read host memory (no copies needed) */
    double compute_slowdown; /* > 1: sleeps (x - 1) times each kernel call's time */
} qm_emu_options;
int qm_backend_emu_new(const qm_emu_options *opt, qm_backend **out, qm_status *st);
/* The emulated device's register_host keeps the ranges registered with it
 * (up to QM_EMU_MAX_REGISTRATIONS; overlaps QM_ECONFLICT; copies are the
 * same either way): how many it holds now, their bytes in *bytes (may be
 * NULL). 0 for another backend. */
#define QM_EMU_MAX_REGISTRATIONS 64
size_t qm_backend_emu_registered(qm_backend *be, uint64_t *bytes);
/* The CUDA backend's constructor is in cuda/qm_cuda.h. */
void qm_backend_free(qm_backend *be); /* accepts NULL */

const char *qm_backend_name(const qm_backend *be); /* "cpu" / "cuda" / "emu" */
int qm_backend_info(qm_backend *be, qm_device_info *out);
/* 1 when kernels can read host memory directly (CPU): whole-bank banks then
 * need no copy. */
int qm_backend_host_visible(const qm_backend *be);
/* Copy granularity: regions should be aligned to it for zero-waste slots. */
size_t qm_backend_alignment(const qm_backend *be);

/* One arena per session: `bytes` of device memory, never grown. */
int qm_arena_new(qm_backend *be, uint64_t bytes, qm_arena **out, qm_status *st);
void qm_arena_free(qm_backend *be, qm_arena *arena);
/* Device address of arena + offset (offset < size). */
void *qm_arena_at(qm_arena *arena, uint64_t offset);
uint64_t qm_arena_size(const qm_arena *arena);

/* Asynchronous host-to-device copy on the backend's copy path. `src` must
 * stay valid until the fence completes (the mapped bank always does). */
int qm_backend_copy_h2d(qm_backend *be, void *dst, const void *src, uint64_t bytes,
                        qm_fence *fence, qm_status *st);
int qm_backend_fence_wait(qm_backend *be, qm_fence *fence, qm_status *st);

/* Runs the FFN of every job (FC1 -> activation -> FC2, biases included, no
 * routing weight applied). Synchronous on return. */
int qm_backend_run_experts(qm_backend *be, const qm_expert_batch *batch, qm_status *st);
int qm_backend_synchronize(qm_backend *be, qm_status *st);

/* Makes [ptr, ptr + bytes) (typically a whole mapped bank, once, after
 * qm_bank_open) faster to copy from where the backend can: CUDA pins it
 * (cudaHostRegister) so each copy is one DMA. Returns 1 when registered
 * (the range must stay mapped until qm_backend_unregister_host or
 * qm_backend_free), 0 when the backend has nothing to register (CPU), or a
 * negative code: QM_EUNSUPPORTED when the driver refuses (copies still
 * work, slower), QM_ECONFLICT when the range overlaps an earlier one. */
int qm_backend_register_host(qm_backend *be, const void *ptr, size_t bytes, qm_status *st);
/* Undoes a registration made with the same `ptr` (0), QM_ENOT_FOUND if none;
 * 0 on backends with nothing to register. */
int qm_backend_unregister_host(qm_backend *be, const void *ptr, qm_status *st);

#endif
