/* pf_fake_device.c - see pf_fake_device.h. */
#include "pf_fake_device.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "qm_backend_impl.h"

static double pf_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* Sleeps most of the way, then spins: a modelled copy of a few microseconds
 * must not cost a scheduler tick. */
static void pf_sleep_until(double t_us)
{
    double left;
    while ((left = t_us - pf_now_us()) > 0) {
        if (left > 200) {
            struct timespec ts = {0, (long)((left - 100) * 1e3)};
            nanosleep(&ts, NULL);
        }
    }
}

typedef struct pf_copy {
    void *dst;
    const void *src;
    uint64_t bytes;
    double land_us; /* modelled landing time */
} pf_copy;

typedef struct pf_dev {
    qm_backend *cpu;
    pf_dev_model model;
    double stream_us; /* when the last copy issued lands (modelled) */
    pthread_mutex_t mu;
    pf_copy *pending;
    size_t n, cap;
    uint64_t issued, landed; /* copy sequence numbers */
} pf_dev;

static int dev_info(void *ctx, qm_device_info *out)
{
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "fake device (deferred copies)");
    snprintf(out->kind, sizeof out->kind, "fake");
    out->total_bytes = out->free_bytes = 1ull << 32;
    return 0;
}

static int dev_arena_alloc(void *ctx, qm_arena *arena, uint64_t bytes, qm_status *st)
{
    void *p = NULL;
    if (posix_memalign(&p, 256, bytes ? bytes : 1))
        return qm_status_set(st, QM_ENOMEM, "fake device: no memory");
    memset(p, 0xA5, bytes); /* garbage: a read before the copy lands shows */
    arena->base = p;
    arena->handle = p;
    arena->size = bytes;
    return 0;
}

static void dev_arena_release(void *ctx, qm_arena *arena)
{
    free(arena->handle);
    arena->handle = arena->base = NULL;
}

static int dev_copy(void *vctx, void *dst, const void *src, uint64_t bytes, qm_fence *fence,
                    qm_status *st)
{
    pf_dev *d = vctx;
    pthread_mutex_lock(&d->mu);
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 64;
        pf_copy *p = realloc(d->pending, cap * sizeof *p);
        if (!p) {
            pthread_mutex_unlock(&d->mu);
            return qm_status_set(st, QM_ENOMEM, "fake device: no memory");
        }
        d->pending = p;
        d->cap = cap;
    }
    double land = 0;
    if (d->model.gbps > 0) {
        double now = pf_now_us();
        land = (d->stream_us > now ? d->stream_us : now) + (double)bytes / (d->model.gbps * 1e3) +
               d->model.latency_us;
        d->stream_us = land;
    }
    d->pending[d->n++] = (pf_copy){dst, src, bytes, land};
    fence->seq = ++d->issued;
    fence->handle = d;
    pthread_mutex_unlock(&d->mu);
    return 0;
}

/* In-order "stream": waiting a fence lands every copy issued before it. */
static int dev_fence_wait(void *vctx, qm_fence *fence, qm_status *st)
{
    pf_dev *d = vctx;
    if (!fence->seq)
        return 0;
    pthread_mutex_lock(&d->mu);
    if (fence->seq > d->landed) {
        size_t todo = (size_t)(fence->seq - d->landed);
        for (size_t i = 0; i < todo; i++)
            memcpy(d->pending[i].dst, d->pending[i].src, d->pending[i].bytes);
        pf_sleep_until(d->pending[todo - 1].land_us);
        memmove(d->pending, d->pending + todo, (d->n - todo) * sizeof *d->pending);
        d->n -= todo;
        d->landed = fence->seq;
    }
    pthread_mutex_unlock(&d->mu);
    fence->seq = 0;
    return 0;
}

static int dev_run(void *vctx, const qm_expert_batch *batch, qm_status *st)
{
    pf_dev *d = vctx;
    return qm_backend_run_experts(d->cpu, batch, st);
}

static void dev_destroy(void *vctx)
{
    pf_dev *d = vctx;
    if (!d)
        return;
    qm_backend_free(d->cpu);
    pthread_mutex_destroy(&d->mu);
    free(d->pending);
    free(d);
}

static const qm_backend_iface pf_dev_iface = {
    .version = QM_BACKEND_IFACE_VERSION,
    .name = "fake",
    .host_visible = 0,
    .alignment = 256,
    .info = dev_info,
    .arena_alloc = dev_arena_alloc,
    .arena_release = dev_arena_release,
    .copy_h2d = dev_copy,
    .fence_wait = dev_fence_wait,
    .run_experts = dev_run,
    .destroy = dev_destroy,
};

int pf_fake_device_new(qm_backend **out)
{
    return pf_fake_device_new_model(&(pf_dev_model){.threads = 1}, out);
}

int pf_fake_device_new_model(const pf_dev_model *model, qm_backend **out)
{
    pf_dev *d = calloc(1, sizeof *d);
    if (!d)
        return QM_ENOMEM;
    d->model = *model;
    pthread_mutex_init(&d->mu, NULL);
    qm_status st;
    int rc = qm_backend_cpu_new(model->threads ? model->threads : 1, &d->cpu, &st);
    if (rc) {
        dev_destroy(d);
        return rc;
    }
    return qm__backend_wrap(&pf_dev_iface, d, out, &st);
}

/* ---- A slowed host ---------------------------------------------------------- */

typedef struct pf_slow {
    qm_backend *cpu;
    double slowdown;
} pf_slow;

static int slow_info(void *ctx, qm_device_info *out)
{
    (void)ctx;
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "slowed host (modelled)");
    snprintf(out->kind, sizeof out->kind, "cpu");
    out->total_bytes = out->free_bytes = 1ull << 32;
    return 0;
}

static int slow_copy(void *ctx, void *dst, const void *src, uint64_t bytes, qm_fence *fence,
                     qm_status *st)
{
    (void)ctx;
    (void)fence;
    (void)st;
    memcpy(dst, src, bytes);
    return 0;
}

static int slow_run(void *vctx, const qm_expert_batch *batch, qm_status *st)
{
    pf_slow *s = vctx;
    double t0 = pf_now_us();
    int rc = qm_backend_run_experts(s->cpu, batch, st);
    double t1 = pf_now_us();
    pf_sleep_until(t1 + (s->slowdown - 1.0) * (t1 - t0));
    return rc;
}

static void slow_destroy(void *vctx)
{
    pf_slow *s = vctx;
    if (!s)
        return;
    qm_backend_free(s->cpu);
    free(s);
}

static const qm_backend_iface pf_slow_iface = {
    .version = QM_BACKEND_IFACE_VERSION,
    .name = "slow_host",
    .host_visible = 1,
    .alignment = 64,
    .info = slow_info,
    .arena_alloc = dev_arena_alloc,
    .arena_release = dev_arena_release,
    .copy_h2d = slow_copy,
    .run_experts = slow_run,
    .destroy = slow_destroy,
};

int pf_slow_host_new(double slowdown, uint32_t threads, qm_backend **out)
{
    pf_slow *s = calloc(1, sizeof *s);
    if (!s)
        return QM_ENOMEM;
    s->slowdown = slowdown < 1 ? 1 : slowdown;
    qm_status st;
    int rc = qm_backend_cpu_new(threads ? threads : 1, &s->cpu, &st);
    if (rc) {
        slow_destroy(s);
        return rc;
    }
    return qm__backend_wrap(&pf_slow_iface, s, out, &st);
}
