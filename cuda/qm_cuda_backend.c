/* qm_cuda_backend.c - the CUDA backend: device, arenas, host-to-device copies
 * and their fences, host registration, device info.
 *
 * Copies run on their own stream and expert kernels on another, so a pager
 * that issues the next experts' copies before running the current ones
 * overlaps the two (double buffering is the pager's order of calls; this file
 * makes it possible). Every CUDA call is checked; failures become QM_E*
 * codes with a sentence, never an abort. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_cuda_internal.h"
#include "qm_cuda_kind.h"

static const qm_backend_iface qm__cuda_iface;
static int qm__cuda_fence_wait(void *ctx, qm_fence *fence, qm_status *st);

/* ---- lifetime ---- */

static void qm__cuda_destroy(void *ctx)
{
    qm__cuda_ctx *c = ctx;
    if (!c) return;
    (void)cudaSetDevice(c->device);
    if (c->copy_stream) (void)cudaStreamSynchronize(c->copy_stream);
    if (c->compute_stream) (void)cudaStreamSynchronize(c->compute_stream);
    for (size_t i = 0; i < c->n_regs; i++)
        if (!c->regs[i].borrowed) (void)cudaHostUnregister((void *)c->regs[i].start);
    qm_free(c->regs);
    for (unsigned i = 0; i < QM__CUDA_BOUNCE_COUNT; i++) {
        if (c->bounce[i]) (void)cudaFreeHost(c->bounce[i]);
        if (c->bounce_event[i]) (void)cudaEventDestroy(c->bounce_event[i]);
    }
    for (unsigned i = 0; i < QM__CUDA_FENCE_RING; i++) {
        if (c->fence_event[i]) (void)cudaEventDestroy(c->fence_event[i]);
    }
    qm__cuda_scratch_free(&c->scratch);
    qm__cuda_passes_free(c);
    if (c->copy_stream) (void)cudaStreamDestroy(c->copy_stream);
    if (c->compute_stream) (void)cudaStreamDestroy(c->compute_stream);
    (void)cudaGetLastError();
    pthread_mutex_destroy(&c->copy_lock);
    pthread_mutex_destroy(&c->run_lock);
    qm_free(c);
}

static qm_cuda_kernels qm__cuda_kernels_from_env(void)
{
    const char *v = getenv("QMOE_CUDA_KERNELS");
    if (!v) return QM_CUDA_KERNELS_AUTO;
    if (strcmp(v, "gemv") == 0) return QM_CUDA_KERNELS_GEMV;
    if (strcmp(v, "gemm") == 0) return QM_CUDA_KERNELS_GEMM;
    if (strcmp(v, "naive") == 0) return QM_CUDA_KERNELS_NAIVE;
    return QM_CUDA_KERNELS_AUTO;
}

/* The devices the driver lists (> 0), or QM_EDEVICE saying why none. */
static int qm__cuda_device_count(int *count, qm_status *st)
{
    *count = 0;
    cudaError_t err = cudaGetDeviceCount(count);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        *count = 0;
        return qm_status_set(st, QM_EDEVICE, "no CUDA device: %s", cudaGetErrorString(err));
    }
    if (*count <= 0) return qm_status_set(st, QM_EDEVICE, "no CUDA device: the driver lists none");
    return 0;
}

int qm_backend_cuda_new(int device, qm_backend **out, qm_status *st)
{
    int rc = 0, count = 0;
    qm__cuda_ctx *c = NULL;
    if (!out) return qm_status_set(st, QM_EINVAL, "qm_backend_cuda_new: out is NULL");
    *out = NULL;

    if ((rc = qm__cuda_device_count(&count, st)) < 0) return rc;
    if (device < 0 || device >= count)
        return qm_status_set(st, QM_EDEVICE, "no CUDA device %d: the driver lists %d (0..%d)",
                             device, count, count - 1);

    c = qm_calloc(1, sizeof *c);
    if (!c) return qm_status_set(st, QM_ENOMEM, "cannot allocate the CUDA backend context");
    c->device = device;
    c->kernels = qm__cuda_kernels_from_env();
    c->gemm_min_rows = QM__CUDA_GEMM_MIN_ROWS_DEFAULT;
    const char *routing = getenv("QMOE_CUDA_ROUTING");
    c->route_on_device = !(routing && strcmp(routing, "host") == 0);
    const char *tcs = getenv("QMOE_CUDA_TENSOR_CORES");
    c->tensor_cores = !(tcs && strcmp(tcs, "0") == 0);
    pthread_mutex_init(&c->copy_lock, NULL);
    pthread_mutex_init(&c->run_lock, NULL);

    QM__CU(c, cudaSetDevice(device), "cudaSetDevice");
    struct cudaDeviceProp prop;
    QM__CU(c, cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    snprintf(c->name, sizeof c->name, "%s", prop.name);
    c->cc_major = prop.major;
    int ro = 0;
    if (cudaDeviceGetAttribute(&ro, cudaDevAttrHostRegisterReadOnlySupported, device) !=
        cudaSuccess) {
        (void)cudaGetLastError();
        ro = 0;
    }
    c->readonly_register = ro;

    QM__CU(c, cudaStreamCreateWithFlags(&c->copy_stream, cudaStreamNonBlocking),
           "cudaStreamCreate (copy)");
    QM__CU(c, cudaStreamCreateWithFlags(&c->compute_stream, cudaStreamNonBlocking),
           "cudaStreamCreate (compute)");
    for (unsigned i = 0; i < QM__CUDA_FENCE_RING; i++)
        QM__CU(c, cudaEventCreateWithFlags(&c->fence_event[i], cudaEventDisableTiming),
               "cudaEventCreate (fence)");
    for (unsigned i = 0; i < QM__CUDA_BOUNCE_COUNT; i++) {
        QM__CU(c, cudaEventCreateWithFlags(&c->bounce_event[i], cudaEventDisableTiming),
               "cudaEventCreate (bounce)");
        QM__CU(c, cudaMallocHost(&c->bounce[i], QM__CUDA_BOUNCE_BYTES),
               "cudaMallocHost (bounce buffer)");
    }
    return qm__backend_wrap(&qm__cuda_iface, c, out, st);

fail:
    qm__cuda_destroy(c);
    return rc;
}

/* ---- info and arenas ---- */

static int qm__cuda_info(void *ctx, qm_device_info *out)
{
    qm__cuda_ctx *c = ctx;
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "%.127s", c->name);
    snprintf(out->kind, sizeof out->kind, "cuda");
    int rc = qm__cuda_enter(c, NULL);
    if (rc < 0) return rc;
    size_t free_b = 0, total_b = 0;
    cudaError_t err = cudaMemGetInfo(&free_b, &total_b);
    if (err != cudaSuccess) return qm__cuda_fail(c, err, NULL, "cudaMemGetInfo");
    out->total_bytes = total_b;
    out->free_bytes = free_b;
    return 0;
}

static int qm__cuda_arena_alloc(void *ctx, qm_arena *arena, uint64_t bytes, qm_status *st)
{
    qm__cuda_ctx *c = ctx;
    int rc = qm__cuda_enter(c, st);
    if (rc < 0) return rc;
    arena->base = NULL;
    arena->handle = NULL;
    if (bytes == 0) return 0;
    if (bytes > (uint64_t)SIZE_MAX)
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED, "arena of %llu bytes is too large",
                             (unsigned long long)bytes);
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, (size_t)bytes);
    if (err != cudaSuccess) {
        rc = qm__cuda_fail(c, err, st, "cudaMalloc (arena)");
        if (rc == QM_ERESOURCE_EXHAUSTED) {
            size_t free_b = 0, total_b = 0;
            if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) (void)cudaGetLastError();
            qm_status_set(st, rc,
                          "cannot allocate an arena of %llu bytes on %s: %llu of %llu bytes free",
                          (unsigned long long)bytes, c->name, (unsigned long long)free_b,
                          (unsigned long long)total_b);
        }
        return rc;
    }
    arena->base = p;
    return 0;
}

static void qm__cuda_arena_release(void *ctx, qm_arena *arena)
{
    qm__cuda_ctx *c = ctx;
    if (!arena || !arena->base) return;
    (void)cudaSetDevice(c->device);
    /* cudaFree waits for work that may still read the arena. */
    if (cudaFree(arena->base) != cudaSuccess) (void)cudaGetLastError();
    arena->base = NULL;
}

/* ---- copies and fences ---- */

static int qm__cuda_is_registered(const qm__cuda_ctx *c, const void *src, uint64_t bytes)
{
    uintptr_t s = (uintptr_t)src;
    for (size_t i = 0; i < c->n_regs; i++) {
        const qm__cuda_registration *r = &c->regs[i];
        if (s >= r->start && bytes <= r->bytes && s - r->start <= r->bytes - bytes) return 1;
    }
    return 0;
}

/* Copies through the pinned ring: the host fills buffer i while the device
 * still drains buffer i - 1. Caller holds copy_lock. */
static int qm__cuda_copy_bounced(qm__cuda_ctx *c, uint8_t *dst, const uint8_t *src, uint64_t bytes,
                                 qm_status *st)
{
    int rc = 0;
    while (bytes > 0) {
        unsigned slot = c->bounce_next;
        size_t n = bytes < QM__CUDA_BOUNCE_BYTES ? (size_t)bytes : QM__CUDA_BOUNCE_BYTES;
        if (c->bounce_pending[slot]) {
            QM__CU(c, cudaEventSynchronize(c->bounce_event[slot]),
                   "cudaEventSynchronize (bounce buffer)");
            c->bounce_pending[slot] = 0;
        }
        memcpy(c->bounce[slot], src, n);
        QM__CU(c, cudaMemcpyAsync(dst, c->bounce[slot], n, cudaMemcpyHostToDevice, c->copy_stream),
               "cudaMemcpyAsync (bounce to device)");
        QM__CU(c, cudaEventRecord(c->bounce_event[slot], c->copy_stream),
               "cudaEventRecord (bounce buffer)");
        c->bounce_pending[slot] = 1;
        c->bounce_next = (slot + 1) % QM__CUDA_BOUNCE_COUNT;
        dst += n;
        src += n;
        bytes -= n;
    }
    return 0;
fail:
    return rc;
}

static int qm__cuda_copy_h2d(void *ctx, void *dst, const void *src, uint64_t bytes, qm_fence *fence,
                             qm_status *st)
{
    qm__cuda_ctx *c = ctx;
    int rc = qm__cuda_enter(c, st);
    if (fence) {
        fence->seq = 0;
        fence->handle = NULL;
    }
    if (rc < 0) return rc;
    if (bytes == 0) return 0;
    if (!dst || !src)
        return qm_status_set(st, QM_EINVAL, "copy_h2d: NULL %s", dst ? "source" : "destination");

    pthread_mutex_lock(&c->copy_lock);
    if (qm__cuda_is_registered(c, src, bytes)) {
        QM__CU(c, cudaMemcpyAsync(dst, src, (size_t)bytes, cudaMemcpyHostToDevice, c->copy_stream),
               "cudaMemcpyAsync (registered host to device)");
        c->stats.bytes_direct += bytes;
    } else {
        rc = qm__cuda_copy_bounced(c, dst, src, bytes, st);
        if (rc < 0) goto fail;
        c->stats.bytes_bounced += bytes;
    }
    c->stats.copies++;
    uint64_t seq = ++c->copy_seq;
    unsigned slot = (unsigned)(seq % QM__CUDA_FENCE_RING);
    QM__CU(c, cudaEventRecord(c->fence_event[slot], c->copy_stream), "cudaEventRecord (fence)");
    c->fence_event_seq[slot] = seq;
    pthread_mutex_unlock(&c->copy_lock);
    if (fence) {
        fence->seq = seq;
        fence->handle = c->fence_event[slot];
        return 0;
    }
    qm_fence local = {.seq = seq, .handle = NULL};
    return qm__cuda_fence_wait(c, &local, st);

fail:
    pthread_mutex_unlock(&c->copy_lock);
    return rc;
}

static int qm__cuda_fence_wait(void *ctx, qm_fence *fence, qm_status *st)
{
    qm__cuda_ctx *c = ctx;
    if (!fence || fence->seq == 0) return 0;
    int rc = qm__cuda_enter(c, st);
    if (rc < 0) return rc;
    pthread_mutex_lock(&c->copy_lock);
    if (fence->seq > c->copy_seq) {
        pthread_mutex_unlock(&c->copy_lock);
        return qm_status_set(st, QM_EINVAL, "fence %llu was not issued by this backend",
                             (unsigned long long)fence->seq);
    }
    if (fence->seq <= c->done_seq) {
        pthread_mutex_unlock(&c->copy_lock);
        fence->seq = 0;
        fence->handle = NULL;
        return 0;
    }
    unsigned slot = (unsigned)(fence->seq % QM__CUDA_FENCE_RING);
    cudaEvent_t ev = c->fence_event[slot];
    uint64_t ev_seq = c->fence_event_seq[slot]; /* >= fence->seq */
    pthread_mutex_unlock(&c->copy_lock);

    cudaError_t err = cudaEventSynchronize(ev);
    if (err != cudaSuccess) return qm__cuda_fail(c, err, st, "cudaEventSynchronize (fence)");
    pthread_mutex_lock(&c->copy_lock);
    if (ev_seq > c->done_seq) c->done_seq = ev_seq;
    pthread_mutex_unlock(&c->copy_lock);
    fence->seq = 0;
    fence->handle = NULL;
    return 0;
}

static int qm__cuda_synchronize(void *ctx, qm_status *st)
{
    qm__cuda_ctx *c = ctx;
    int rc = qm__cuda_enter(c, st);
    if (rc < 0) return rc;
    QM__CU(c, cudaStreamSynchronize(c->copy_stream), "cudaStreamSynchronize (copy)");
    QM__CU(c, cudaStreamSynchronize(c->compute_stream), "cudaStreamSynchronize (compute)");
    pthread_mutex_lock(&c->copy_lock);
    c->done_seq = c->copy_seq;
    pthread_mutex_unlock(&c->copy_lock);
    return 0;
fail:
    return rc;
}

/* ---- host registration (the iface's register_host / unregister_host) ---- */

static int qm__cuda_register_host(void *ctx, const void *ptr, size_t bytes, qm_status *st)
{
    qm__cuda_ctx *c = ctx;
    if (!ptr || bytes == 0) return qm_status_set(st, QM_EINVAL, "register_host: empty range");
    int rc = qm__cuda_enter(c, st);
    if (rc < 0) return rc;
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t pg = page > 0 ? (uintptr_t)page : 4096u;
    uintptr_t start = (uintptr_t)ptr & ~(pg - 1);
    uintptr_t end = ((uintptr_t)ptr + bytes + pg - 1) & ~(pg - 1);
    if (end < start) return qm_status_set(st, QM_EINVAL, "register_host: range wraps around");

    pthread_mutex_lock(&c->copy_lock);
    for (size_t i = 0; i < c->n_regs; i++) {
        const qm__cuda_registration *r = &c->regs[i];
        if (start < r->start + r->bytes && r->start < end) {
            pthread_mutex_unlock(&c->copy_lock);
            return qm_status_set(st, QM_ECONFLICT,
                                 "register_host: range overlaps an earlier registration");
        }
    }
    if (c->n_regs == c->regs_cap) {
        size_t cap = c->regs_cap ? 2 * c->regs_cap : 8;
        qm__cuda_registration *n = qm_realloc(c->regs, cap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&c->copy_lock);
            return qm_status_set(st, QM_ENOMEM, "register_host: cannot grow the table");
        }
        c->regs = n;
        c->regs_cap = cap;
    }
    /* Mapped banks are read-only: ask for a read-only registration first.
     * Portable: the pinning serves every device's context, so the daemon's
     * other devices find the range registered already and borrow it. */
    cudaError_t err = cudaErrorNotSupported;
    int borrowed = 0;
    if (c->readonly_register)
        err = cudaHostRegister((void *)start, end - start,
                               cudaHostRegisterReadOnly | cudaHostRegisterPortable);
    if (err != cudaSuccess && err != cudaErrorHostMemoryAlreadyRegistered) {
        (void)cudaGetLastError();
        err = cudaHostRegister((void *)start, end - start, cudaHostRegisterPortable);
    }
    if (err == cudaErrorHostMemoryAlreadyRegistered) {
        (void)cudaGetLastError();
        err = cudaSuccess;
        borrowed = 1;
    }
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        pthread_mutex_unlock(&c->copy_lock);
        if (qm__cuda_is_sticky(err)) return qm__cuda_fail(c, err, st, "cudaHostRegister");
        return qm_status_set(st, QM_EUNSUPPORTED,
                             "cudaHostRegister of %zu bytes refused: %s; copies will use the "
                             "pinned bounce buffers",
                             (size_t)(end - start), cudaGetErrorString(err));
    }
    c->regs[c->n_regs++] = (qm__cuda_registration){
        .ptr = ptr, .start = start, .bytes = end - start, .borrowed = borrowed};
    pthread_mutex_unlock(&c->copy_lock);
    return 0;
}

static int qm__cuda_unregister_host(void *ctx, const void *ptr, qm_status *st)
{
    qm__cuda_ctx *c = ctx;
    (void)cudaSetDevice(c->device);
    pthread_mutex_lock(&c->copy_lock);
    for (size_t i = 0; i < c->n_regs; i++) {
        if (c->regs[i].ptr != ptr) continue;
        /* Copies in flight may still read the range. */
        (void)cudaStreamSynchronize(c->copy_stream);
        c->done_seq = c->copy_seq;
        if (!c->regs[i].borrowed) (void)cudaHostUnregister((void *)c->regs[i].start);
        (void)cudaGetLastError();
        c->regs[i] = c->regs[--c->n_regs];
        pthread_mutex_unlock(&c->copy_lock);
        return 0;
    }
    pthread_mutex_unlock(&c->copy_lock);
    return qm_status_set(st, QM_ENOT_FOUND, "unregister_host: %p was not registered", ptr);
}

static const qm_backend_iface qm__cuda_iface = {
    .version = QM_BACKEND_IFACE_VERSION,
    .name = "cuda",
    .host_visible = 0,
    .alignment = 256, /* cudaMalloc's; also keeps slot starts 16-byte aligned for the GEMV */
    .routes = QM_BACKEND_ROUTES_LEGACY, /* the device's routing knows the legacy rule only */
    .info = qm__cuda_info,
    .arena_alloc = qm__cuda_arena_alloc,
    .arena_release = qm__cuda_arena_release,
    .copy_h2d = qm__cuda_copy_h2d,
    .fence_wait = qm__cuda_fence_wait,
    .run_experts = qm__cuda_run_experts,
    .synchronize = qm__cuda_synchronize,
    .destroy = qm__cuda_destroy,
    .route = qm__cuda_route,
    .run_routed = qm__cuda_run_routed,
    .combine = qm__cuda_combine,
    .pass_release = qm__cuda_pass_release,
    .register_host = qm__cuda_register_host,
    .unregister_host = qm__cuda_unregister_host,
};

/* ---- What the registry's row calls (qm_cuda_kind.c) ---- */

int qm__cuda_open(const qm_backend_open_options *o, qm_backend **out, qm_status *st)
{
    if (o->index > INT32_MAX)
        return qm_status_set(st, QM_EDEVICE, "no CUDA device %u", o->index);
    return qm_backend_cuda_new((int)o->index, out, st);
}

int qm__cuda_probe(uint32_t *n_devices, qm_status *st)
{
    int count = 0;
    int rc = qm__cuda_device_count(&count, st);
    *n_devices = rc < 0 ? 0 : (uint32_t)count;
    return rc;
}

/* ---- CUDA-only extras (qm_cuda.h) ---- */

static qm__cuda_ctx *qm__cuda_of(qm_backend *be)
{
    return (be && be->iface == &qm__cuda_iface) ? be->ctx : NULL;
}

int qm_backend_cuda_set_kernels(qm_backend *be, qm_cuda_kernels kernels, uint32_t gemm_min_rows)
{
    qm__cuda_ctx *c = qm__cuda_of(be);
    if (!c || kernels < QM_CUDA_KERNELS_AUTO || kernels > QM_CUDA_KERNELS_NAIVE) return QM_EINVAL;
    pthread_mutex_lock(&c->run_lock);
    c->kernels = kernels;
    c->gemm_min_rows = gemm_min_rows ? gemm_min_rows : QM__CUDA_GEMM_MIN_ROWS_DEFAULT;
    pthread_mutex_unlock(&c->run_lock);
    return 0;
}

/* Sets the int switch at offset `member` of the context to 0 or 1, under
 * run_lock: a run sees it before or after, never half-way. */
static int qm__cuda_set_switch(qm_backend *be, size_t member, int on)
{
    qm__cuda_ctx *c = qm__cuda_of(be);
    if (!c) return QM_EINVAL;
    pthread_mutex_lock(&c->run_lock);
    *(int *)((char *)c + member) = on != 0;
    pthread_mutex_unlock(&c->run_lock);
    return 0;
}

int qm_backend_cuda_set_routing(qm_backend *be, int on_device)
{
    return qm__cuda_set_switch(be, offsetof(qm__cuda_ctx, route_on_device), on_device);
}

int qm_backend_cuda_set_tensor_cores(qm_backend *be, int on)
{
    return qm__cuda_set_switch(be, offsetof(qm__cuda_ctx, tensor_cores), on);
}

int qm_backend_cuda_stats(qm_backend *be, qm_cuda_stats *out)
{
    qm__cuda_ctx *c = qm__cuda_of(be);
    if (!c || !out) return QM_EINVAL;
    pthread_mutex_lock(&c->copy_lock);
    pthread_mutex_lock(&c->run_lock);
    *out = c->stats;
    pthread_mutex_unlock(&c->run_lock);
    pthread_mutex_unlock(&c->copy_lock);
    return 0;
}
