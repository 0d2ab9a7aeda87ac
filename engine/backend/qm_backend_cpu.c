/* qm_backend_cpu.c - the CPU backend: a host arena as "device memory",
 * memcpy as the copy path, and expert FFNs on a persistent thread pool
 * (qm_cpu_ffn.c: a task owns whole output elements and no reduction is ever
 * split, so the bits of every output are the same whatever the thread
 * count or the order in which tasks run). */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <pthread.h>

#include "qm_alloc.h"
#include "qm_backend_impl.h"
#include "qm_cpu_ffn.h"

#define QM__CPU_ALIGN 64u
/* Arenas of at least one huge page start on one and ask for transparent
 * huge pages (madvise MADV_HUGEPAGE; the system's THP setting "madvise" or
 * "always" grants them, "never" not): the decode kernels stream their
 * experts from it, and with 4 KiB pages every 4 KiB of a stream is a TLB
 * miss, dear under a hypervisor's nested paging. On the AVX-512 VNNI Zen 4
 * VM of December 2026 one core's r8 decode GEMV read 17.5 GB/s from 2 MiB
 * pages against 11.5 GB/s from 4 KiB ones (qmoe_kernel_micro --hugepages,
 * 90 MiB of codes). */
#define QM__CPU_HUGE ((uint64_t)2 << 20)

typedef struct qm__cpu {
    unsigned threads;
    qm__pool *pool;
    pthread_mutex_t lock; /* one run_experts at a time: ffn's scratch is shared */
    qm__cpu_ffn ffn;      /* the expert FFNs (qm_cpu_ffn.c) */
    atomic_uint_fast64_t arena_bytes; /* sum of live arenas, exact */
    atomic_uint_fast64_t copy_seq;
    char name[128];
} qm__cpu;

/* ---- device memory ---- */

static int qm__cpu_info(void *vctx, qm_device_info *out)
{
    qm__cpu *cx = vctx;
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "%s", cx->name);
    snprintf(out->kind, sizeof out->kind, "cpu");
    long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES);
    long page = sysconf(_SC_PAGESIZE);
    out->total_bytes = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    out->free_bytes = avail > 0 && page > 0 ? (uint64_t)avail * (uint64_t)page : 0;
    return 0;
}

static int qm__cpu_arena_alloc(void *vctx, qm_arena *arena, uint64_t bytes, qm_status *st)
{
    qm__cpu *cx = vctx;
    unsigned long long total;
    uint64_t align = bytes >= QM__CPU_HUGE ? QM__CPU_HUGE : QM__CPU_ALIGN;
    if (qm_add_u64(bytes, align, &total) < 0 || total > SIZE_MAX)
        return qm_status_set(st, QM_ENOMEM, "arena of %llu bytes does not fit in memory",
                             (unsigned long long)bytes);
    /* qm_malloc (not aligned_alloc) so allocation-failure tests reach it; aligned by hand. */
    void *raw = qm_malloc((size_t)total);
    if (!raw)
        return qm_status_set(st, QM_ENOMEM, "cannot allocate a host arena of %llu bytes",
                             (unsigned long long)bytes);
    uintptr_t p = ((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1);
    if (align == QM__CPU_HUGE) /* a hint: refused (THP off), 4 KiB pages serve */
        (void)madvise((void *)p, (size_t)(bytes & ~(QM__CPU_HUGE - 1)), MADV_HUGEPAGE);
    arena->base = (void *)p;
    arena->handle = raw;
    arena->size = bytes;
    atomic_fetch_add(&cx->arena_bytes, bytes);
    return 0;
}

static void qm__cpu_arena_release(void *vctx, qm_arena *arena)
{
    qm__cpu *cx = vctx;
    if (!arena->handle)
        return;
    atomic_fetch_sub(&cx->arena_bytes, arena->size);
    qm_free(arena->handle);
    arena->handle = NULL;
    arena->base = NULL;
}

static int qm__cpu_copy_h2d(void *vctx, void *dst, const void *src, uint64_t bytes,
                            qm_fence *fence, qm_status *st)
{
    qm__cpu *cx = vctx;
    (void)st;
    if (bytes)
        memcpy(dst, src, (size_t)bytes);
    if (fence) { /* the copy has landed on return: the fence is already complete */
        fence->seq = atomic_fetch_add(&cx->copy_seq, 1) + 1;
        fence->handle = NULL;
    }
    return 0;
}

static int qm__cpu_run_locked(void *vctx, const qm_expert_batch *b, qm_status *st)
{
    qm__cpu *cx = vctx;
    pthread_mutex_lock(&cx->lock);
    int rc = qm__cpu_ffn_run(&cx->ffn, b, st);
    pthread_mutex_unlock(&cx->lock);
    return rc;
}

static void qm__cpu_destroy(void *vctx)
{
    qm__cpu *cx = vctx;
    if (!cx)
        return;
    qm__pool_free(cx->pool);
    pthread_mutex_destroy(&cx->lock);
    qm__cpu_ffn_release(&cx->ffn);
    qm_free(cx);
}

static const qm_backend_iface qm__cpu_iface = {
    .version = QM_BACKEND_IFACE_VERSION,
    .name = "cpu",
    .host_visible = 1,
    .alignment = QM__CPU_ALIGN,
    .info = qm__cpu_info,
    .arena_alloc = qm__cpu_arena_alloc,
    .arena_release = qm__cpu_arena_release,
    .copy_h2d = qm__cpu_copy_h2d,
    .fence_wait = NULL, /* copies are synchronous */
    .run_experts = qm__cpu_run_locked,
    .synchronize = NULL,
    .destroy = qm__cpu_destroy,
};

int qm_backend_cpu_new(uint32_t threads, qm_backend **out, qm_status *st)
{
    *out = NULL;
    if (threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        threads = n > 0 ? (uint32_t)n : 1;
    }
    if (threads > 1024)
        return qm_status_set(st, QM_EINVAL, "%u CPU threads requested, at most 1024", threads);
    qm__cpu *cx = qm_calloc(1, sizeof *cx);
    if (!cx)
        return qm_status_set(st, QM_ENOMEM, "out of memory creating the CPU backend");
    if (qm__cpu_ffn_init(&cx->ffn) < 0) {
        qm_free(cx);
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED, "cannot make the CPU backend's locks");
    }
    pthread_mutex_init(&cx->lock, NULL);
    atomic_init(&cx->arena_bytes, 0);
    atomic_init(&cx->copy_seq, 0);
    cx->threads = threads;
    cx->ffn.kernel = qm__kernel_select();
    cx->ffn.i8 = qm__i8kernel_select();
    cx->ffn.schedule = qm__cpu_schedule_from_env();
    snprintf(cx->name, sizeof cx->name, "cpu (%s; fast %s; %u threads)",
             qm__kernel_describe(cx->ffn.kernel), qm__i8kernel_describe(cx->ffn.i8), threads);
    if (qm__pool_new(threads, &cx->pool) < 0) {
        qm__cpu_destroy(cx);
        return qm_status_set(st, QM_ENOMEM, "cannot start %u CPU worker threads", threads);
    }
    cx->ffn.pool = cx->pool;
    cx->ffn.threads = threads;
    return qm__backend_wrap(&qm__cpu_iface, cx, out, st);
}

static int qm__cpu_open(const qm_backend_open_options *o, qm_backend **out, qm_status *st)
{
    return qm_backend_cpu_new(o->threads, out, st);
}

const qm__backend_kind qm__backend_cpu_kind = {
    .version = QM_BACKEND_KIND_VERSION,
    .name = "cpu",
    .summary = "the host's CPU: SIMD kernels on a thread pool, weights read in place",
    .caps = QM_BACKEND_CAP_HOST | QM_BACKEND_CAP_SHARED_POOL | QM_BACKEND_CAP_CODEBOOK,
    .open = qm__cpu_open,
};
