/* qm_backend.h - the device backend, seen from its users (pager, forward pass, daemon).
 *
 * A backend is { iface, ctx }: CPU and CUDA are two instances of the same
 * interface (qm_backend_impl.h), neither special-cased. "Device memory" is
 * whatever the backend's arenas hold: a host arena for CPU, cudaMalloc for CUDA.
 * The registry below lists every backend kind a build has; users that pick
 * a backend by configuration (the daemon) open it there and name none. */
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
    char kind[16];        /* the backend's kind (qm_backend_kind_name): "cpu", "cuda", ... */
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
    /* Bit t set: weight tensor t's codes are in the r8 layout (qm_r8.h: a
     * host-visible backend's whole bank the pager laid out for the fast
     * CPU GEMV); 0: row order, as in the bank. Backends without the CPU
     * kernels never see it set. */
    uint32_t r8;
    /* And weight tensor r8_part, its bit clear, in r8 for its first
     * r8_part_rows rows (a multiple of 16), in row order after them: a
     * paged unit the pager lays out a piece at a time; r8_part_rows 0:
     * none. */
    uint32_t r8_part, r8_part_rows;
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

/* A layer call's combine: out[t] = the sum over j = 0..k-1, in that order,
 * of weights[t*k+j] * y[t*k+j] (rows of `hidden`), skipping a dropped route
 * (experts[t*k+j] == UINT32_MAX, QM_ROUTE_DROPPED). The forward offers it
 * with a batch that holds every route of its call (one wave); a backend
 * that sums the routes itself, with qm_combine_columns and so with the
 * same bits, sets `done`, and the forward does not sum them again. */
typedef struct qm_combine {
    float *out;              /* [n_tokens, hidden] */
    const float *weights;    /* [n_tokens * k] */
    const uint32_t *experts; /* [n_tokens * k] */
    uint32_t k;
    int done;
} qm_combine;

/* Columns [c0, c1) of c->out for every token, from y ([n_tokens * k,
 * hidden] rows by route): the one definition of the sum's order. */
void qm_combine_columns(const qm_combine *c, const float *y, uint32_t n_tokens, uint32_t hidden,
                        uint32_t c0, uint32_t c1);

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
    /* NULL, or the call's combine when this batch holds every one of its
     * routes: a host backend may sum them as its last tiles land, while
     * they are in its cache (qm_combine). */
    qm_combine *combine;
} qm_expert_batch;

/* ---- The backend registry (qm_backend_registry.c, library qmoe_backends) ----
 *
 * One row per backend kind, in the order kinds are listed (help, errors):
 * the kind's name, a summary, what it offers, and how to open one of its
 * devices. Adding a backend: its own files and one row there. */

/* What a kind offers its users (qm_backend_kind_caps). */
enum {
    /* The host itself: one device, named by the kind alone ("cpu"); what
     * --backend auto falls back to. */
    QM_BACKEND_CAP_HOST = 1u << 0,
    /* Numbered devices, named KIND:N ("cuda:1"), that a device list names. */
    QM_BACKEND_CAP_NUMBERED = 1u << 1,
    /* --backend auto tries its device 0 before the host. */
    QM_BACKEND_CAP_AUTO = 1u << 2,
    /* One pager on it may serve several sessions' calls (shared residency,
     * docs/PAGING.md), as its tests show. */
    QM_BACKEND_CAP_SHARED_POOL = 1u << 3,
    /* It computes code-book banks (qmoe.codebook, docs/BANK_FORMAT.md). */
    QM_BACKEND_CAP_CODEBOOK = 1u << 4,
};

/* How to open a device; a kind reads what applies to it. */
typedef struct qm_backend_open_options {
    uint32_t index;   /* the device of a numbered kind (0 otherwise) */
    uint32_t threads; /* host compute threads, where the kind runs on the host (0 = cores) */
    double copy_gbps; /* a modelled copy bandwidth in GB/s, where the kind models one (0: free) */
} qm_backend_open_options;

size_t qm_backend_kind_count(void);
/* Kind i's name ("cpu"), one-line summary and QM_BACKEND_CAP_* bits: static
 * strings; NULL (0) when i is out of range. */
const char *qm_backend_kind_name(size_t i);
const char *qm_backend_kind_summary(size_t i);
unsigned qm_backend_kind_caps(size_t i);
/* The index of the kind named by the n bytes at name, or -1. */
int qm_backend_kind_find(const char *name, size_t n);
/* Opens device o->index of kind i (o NULL: every default); the caller owns
 * *out (qm_backend_free). QM_EINVAL for an i out of range, else the kind's
 * answer (QM_EUNSUPPORTED when not built in, QM_EDEVICE when the device is
 * absent), with a sentence. */
int qm_backend_kind_open(size_t i, const qm_backend_open_options *o, qm_backend **out,
                         qm_status *st);
/* How many devices of kind i this process can open (*n_devices >= 1, 0 on
 * error), or why it can open none (QM_EUNSUPPORTED, QM_EDEVICE), with a
 * sentence. Opens nothing. */
int qm_backend_kind_probe(size_t i, uint32_t *n_devices, qm_status *st);
/* The names of the kinds that have every bit of `caps` (0: every kind), in
 * registry order, joined by `sep`, the last two by `last_sep` ("cpu, cuda or
 * emu"); writes what fits into buf (NUL-terminated when cap > 0) and returns
 * the length it needed, like snprintf. */
size_t qm_backend_kind_names(unsigned caps, const char *sep, const char *last_sep, char *buf,
                             size_t cap);

/* ---- Calls (the only call sites of the iface; optional methods defaulted here) ---- */

/* Creates the CPU backend: `threads` workers (0 = number of cores). The
 * engine's own host backend (hybrid execution's host runs); the registry
 * opens it as kind "cpu". */
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

const char *qm_backend_name(const qm_backend *be); /* its kind's name: "cpu", "cuda", ... */
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
