/* pf_fake_device.c - see pf_fake_device.h. */
#include "pf_fake_device.h"

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

/* The emulated device of the engine (qm_backend_emu.c), with the model's
 * threads (0 = 1) and copy costs. */
int pf_fake_device_new(qm_backend **out)
{
    return pf_fake_device_new_model(&(pf_dev_model){.threads = 1}, out);
}

int pf_fake_device_new_model(const pf_dev_model *model, qm_backend **out)
{
    qm_emu_options o = {.threads = model->threads ? model->threads : 1,
                        .gbps = model->gbps,
                        .latency_us = model->latency_us,
                        .total_bytes = 1ull << 32};
    qm_status st;
    return qm_backend_emu_new(&o, out, &st);
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

/* Host-visible arenas: the CPU backend's own. */
static int slow_arena_alloc(void *vctx, qm_arena *arena, uint64_t bytes, qm_status *st)
{
    pf_slow *s = vctx;
    return s->cpu->iface->arena_alloc(s->cpu->ctx, arena, bytes, st);
}

static void slow_arena_release(void *vctx, qm_arena *arena)
{
    pf_slow *s = vctx;
    s->cpu->iface->arena_release(s->cpu->ctx, arena);
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
    .arena_alloc = slow_arena_alloc,
    .arena_release = slow_arena_release,
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
