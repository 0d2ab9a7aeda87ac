/* qm_backend_emu.c - the emulated device (qm_backend_emu_new): a backend
 * that is not host visible although its arenas are host memory (its CPU
 * backend's), so the pager treats them as opaque device memory: whole banks
 * are copied, every expert is copied in before use and every copy has a
 * fence. Copies are deferred until their fence is waited (in order, like
 * one stream), so a read before the wait sees the arena's fill pattern, not
 * the weights; with a modelled bandwidth the wait also sleeps until the
 * copy would have landed. Compute is the CPU backend's kernels, optionally
 * slowed. It lets the daemon run several devices (`--device emu:0,emu:1`)
 * where no GPU is; host_visible = 1 makes it a modelled host instead. */
#include "qm_backend_impl.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_clock.h"

/* Until the modelled landing time: sleeps to within 100 us of it, then
 * spins (a copy of a few microseconds must not cost a scheduler tick). */
static void emu_wait_until(double t_us)
{
    double now;
    while ((now = (double)qm__now_us()) < t_us)
        if (t_us - now > 200)
            usleep((useconds_t)(t_us - now - 100));
}

typedef struct emu_copy {
    void *dst;
    const void *src;
    uint64_t bytes;
    double land_us; /* modelled landing time */
} emu_copy;

typedef struct emu_dev {
    qm_backend_iface iface; /* emu_iface with the options' host_visible */
    qm_backend *cpu;
    qm_emu_options opt;
    double stream_us; /* when the last copy issued lands (modelled) */
    pthread_mutex_t mu;
    emu_copy *pending;
    size_t n, cap;
    uint64_t issued, landed; /* copy sequence numbers */
    /* register_host: the ranges held (copies do not change; it lets a
     * caller see what it registered with this device). */
    struct { const void *ptr; size_t bytes; } regs[QM_EMU_MAX_REGISTRATIONS];
    size_t n_regs;
} emu_dev;

static int emu_info(void *vctx, qm_device_info *out)
{
    emu_dev *d = vctx;
    qm_backend_info(d->cpu, out); /* the host's memory */
    const qm_emu_options *o = &d->opt;
    int n = snprintf(out->name, sizeof out->name, "emu:%u (emulated %s in host memory",
                     o->index, o->host_visible ? "host" : "device");
    if (o->gbps > 0 && n > 0 && (size_t)n < sizeof out->name)
        n += snprintf(out->name + n, sizeof out->name - (size_t)n,
                      ", copies at %.3g GB/s + %.3g us", o->gbps, o->latency_us);
    if (o->compute_slowdown > 1 && n > 0 && (size_t)n < sizeof out->name)
        n += snprintf(out->name + n, sizeof out->name - (size_t)n, ", compute %.3gx slower",
                      o->compute_slowdown);
    if (n > 0 && (size_t)n < sizeof out->name)
        snprintf(out->name + n, sizeof out->name - (size_t)n, ")");
    snprintf(out->kind, sizeof out->kind, "emu");
    if (o->total_bytes)
        out->total_bytes = out->free_bytes = o->total_bytes;
    return 0;
}

/* Arenas are the CPU backend's, filled with garbage so that a read before
 * the copy lands shows. */
static int emu_arena_alloc(void *vctx, qm_arena *arena, uint64_t bytes, qm_status *st)
{
    emu_dev *d = vctx;
    int rc = d->cpu->iface->arena_alloc(d->cpu->ctx, arena, bytes, st);
    if (rc == 0)
        memset(arena->base, 0xA5, (size_t)bytes);
    return rc;
}

static void emu_arena_release(void *vctx, qm_arena *arena)
{
    emu_dev *d = vctx;
    d->cpu->iface->arena_release(d->cpu->ctx, arena);
}

/* Queues the copy (the queue doubles when full; 64 first) with its modelled
 * landing time; its fence is the copy's sequence number. */
static int emu_copy_h2d(void *vctx, void *dst, const void *src, uint64_t bytes, qm_fence *fence,
                        qm_status *st)
{
    emu_dev *d = vctx;
    pthread_mutex_lock(&d->mu);
    size_t cap = d->n < d->cap ? d->cap : d->cap ? 2 * d->cap : 64;
    emu_copy *q = cap == d->cap ? d->pending : qm_realloc(d->pending, cap * sizeof *q);
    if (q) {
        d->pending = q;
        d->cap = cap;
        double land = 0;
        if (d->opt.gbps > 0) {
            double now = (double)qm__now_us();
            land = (d->stream_us > now ? d->stream_us : now) +
                   (double)bytes / (d->opt.gbps * 1e3) + d->opt.latency_us;
            d->stream_us = land;
        }
        q[d->n++] = (emu_copy){dst, src, bytes, land};
        fence->seq = ++d->issued;
        fence->handle = d;
    }
    pthread_mutex_unlock(&d->mu);
    return q ? 0 : qm_status_set(st, QM_ENOMEM, "emulated device: no memory for a copy");
}

/* In-order "stream": waiting a fence lands every copy issued before it. */
static int emu_fence_wait(void *vctx, qm_fence *fence, qm_status *st)
{
    (void)st;
    emu_dev *d = vctx;
    if (!fence->seq)
        return 0;
    pthread_mutex_lock(&d->mu);
    if (fence->seq > d->landed) {
        size_t todo = (size_t)(fence->seq - d->landed);
        for (size_t i = 0; i < todo; i++)
            memcpy(d->pending[i].dst, d->pending[i].src, d->pending[i].bytes);
        emu_wait_until(d->pending[todo - 1].land_us);
        memmove(d->pending, d->pending + todo, (d->n - todo) * sizeof *d->pending);
        d->n -= todo;
        d->landed = fence->seq;
    }
    pthread_mutex_unlock(&d->mu);
    fence->seq = 0;
    return 0;
}

/* The CPU kernels, then (compute_slowdown - 1) times their time asleep. */
static int emu_run(void *vctx, const qm_expert_batch *batch, qm_status *st)
{
    emu_dev *d = vctx;
    double t0 = (double)qm__now_us();
    int rc = qm_backend_run_experts(d->cpu, batch, st);
    if (d->opt.compute_slowdown > 1) {
        double t1 = (double)qm__now_us();
        emu_wait_until(t1 + (d->opt.compute_slowdown - 1.0) * (t1 - t0));
    }
    return rc;
}

static void emu_destroy(void *vctx)
{
    emu_dev *d = vctx;
    if (!d)
        return;
    qm_backend_free(d->cpu);
    pthread_mutex_destroy(&d->mu);
    qm_free(d->pending);
    qm_free(d);
}

static int emu_register_host(void *vctx, const void *ptr, size_t bytes, qm_status *st)
{
    emu_dev *d = vctx;
    if (!ptr || bytes == 0)
        return qm_status_set(st, QM_EINVAL, "register_host: empty range");
    const char *p = ptr;
    int rc = 0;
    pthread_mutex_lock(&d->mu);
    for (size_t i = 0; i < d->n_regs && !rc; i++) {
        const char *q = d->regs[i].ptr;
        if (p < q + d->regs[i].bytes && q < p + bytes)
            rc = qm_status_set(st, QM_ECONFLICT,
                               "register_host: range overlaps an earlier registration");
    }
    if (!rc && d->n_regs == QM_EMU_MAX_REGISTRATIONS)
        rc = qm_status_set(st, QM_ENOMEM, "register_host: %d ranges held already",
                           QM_EMU_MAX_REGISTRATIONS);
    if (!rc) {
        d->regs[d->n_regs].ptr = ptr;
        d->regs[d->n_regs++].bytes = bytes;
    }
    pthread_mutex_unlock(&d->mu);
    return rc;
}

static int emu_unregister_host(void *vctx, const void *ptr, qm_status *st)
{
    emu_dev *d = vctx;
    pthread_mutex_lock(&d->mu);
    for (size_t i = 0; i < d->n_regs; i++) {
        if (d->regs[i].ptr != ptr)
            continue;
        d->regs[i] = d->regs[--d->n_regs];
        pthread_mutex_unlock(&d->mu);
        return 0;
    }
    pthread_mutex_unlock(&d->mu);
    return qm_status_set(st, QM_ENOT_FOUND, "unregister_host: %p was not registered", ptr);
}

size_t qm_backend_emu_registered(qm_backend *be, uint64_t *bytes)
{
    if (bytes)
        *bytes = 0;
    if (!be || strcmp(qm_backend_name(be), "emu") != 0)
        return 0;
    emu_dev *d = be->ctx;
    pthread_mutex_lock(&d->mu);
    size_t n = d->n_regs;
    for (size_t i = 0; bytes && i < n; i++)
        *bytes += d->regs[i].bytes;
    pthread_mutex_unlock(&d->mu);
    return n;
}

static const qm_backend_iface emu_iface = {
    .version = QM_BACKEND_IFACE_VERSION,
    .name = "emu",
    .host_visible = 0,
    .alignment = 256,
    .info = emu_info,
    .arena_alloc = emu_arena_alloc,
    .arena_release = emu_arena_release,
    .copy_h2d = emu_copy_h2d,
    .fence_wait = emu_fence_wait,
    .run_experts = emu_run,
    .register_host = emu_register_host,
    .unregister_host = emu_unregister_host,
    .destroy = emu_destroy,
};

int qm_backend_emu_new(const qm_emu_options *opt, qm_backend **out, qm_status *st)
{
    *out = NULL;
    if (!opt)
        return qm_status_set(st, QM_EINVAL, "qm_backend_emu_new: NULL options");
    if (!(opt->gbps >= 0) || !(opt->latency_us >= 0) || !(opt->compute_slowdown >= 0))
        return qm_status_set(st, QM_EINVAL, "emulated device: a negative cost in its model");
    emu_dev *d = qm_calloc(1, sizeof *d);
    if (!d)
        return qm_status_set(st, QM_ENOMEM, "out of memory for the emulated device");
    d->opt = *opt;
    d->iface = emu_iface;
    d->iface.host_visible = !!opt->host_visible;
    d->iface.alignment = opt->host_visible ? 64 : 256;
    pthread_mutex_init(&d->mu, NULL);
    int rc = qm_backend_cpu_new(opt->threads, &d->cpu, st);
    if (rc) {
        emu_destroy(d);
        return rc;
    }
    return qm__backend_wrap(&d->iface, d, out, st);
}

static int emu_open(const qm_backend_open_options *o, qm_backend **out, qm_status *st)
{
    qm_emu_options eo = {.index = o->index, .threads = o->threads, .gbps = o->copy_gbps};
    return qm_backend_emu_new(&eo, out, st);
}

/* Any index names a device: each is host memory of its own. */
static int emu_probe(uint32_t *n_devices, qm_status *st)
{
    (void)st;
    *n_devices = 256;
    return 0;
}

const qm__backend_kind qm__backend_emu_kind = {
    .version = QM_BACKEND_KIND_VERSION,
    .name = "emu",
    .summary = "emulated devices in host memory, every expert copied in (tests)",
    .caps = QM_BACKEND_CAP_NUMBERED | QM_BACKEND_CAP_SHARED_POOL | QM_BACKEND_CAP_CODEBOOK,
    .open = emu_open,
    .probe = emu_probe,
};
