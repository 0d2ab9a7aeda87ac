/* paging_fixture.c - see paging_fixture.h. */
#include "paging_fixture.h"

#include <check.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "qm_alloc.h"
#include "qm_backend_impl.h"

uint64_t pf_rand(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

float pf_uniform(uint64_t *s, float lo, float hi)
{
    return lo + (hi - lo) * (float)((pf_rand(s) >> 40) * (1.0 / 16777216.0));
}

pf_spec pf_default_spec(void)
{
    return (pf_spec){.layers = 3, .experts = 8, .hidden = 32, .inter = 16, .k = 2, .bits = 4,
                     .router = 1, .seed = 7};
}

typedef struct pf_tensor {
    char name[64];
    const char *dtype;
    uint64_t shape[3];
    uint32_t ndim;
    uint64_t offset, bytes;
    int is_f32;
} pf_tensor;

static void add(pf_tensor *t, size_t *n, uint64_t *off, uint32_t l, const char *suffix,
                int is_f32, uint64_t a, uint64_t b, uint64_t c, uint32_t ndim)
{
    pf_tensor *x = &t[(*n)++];
    snprintf(x->name, sizeof x->name, "layers.%u.%s", l, suffix);
    x->dtype = is_f32 ? "F32" : "U8";
    x->shape[0] = a;
    x->shape[1] = b;
    x->shape[2] = c;
    x->ndim = ndim;
    x->is_f32 = is_f32;
    x->bytes = (is_f32 ? 4 : 1) * a * (ndim > 1 ? b : 1) * (ndim > 2 ? c : 1);
    /* Gaps between tensors are legal; keep every tensor 64-byte aligned. */
    *off = (*off + 63) / 64 * 64;
    x->offset = *off;
    *off += x->bytes;
}

void pf_bank_open(const pf_spec *sp, pf_bank *out)
{
    pf_tensor t[64];
    size_t n = 0;
    uint64_t off = 0;
    uint32_t E = sp->experts, H = sp->hidden, I = sp->inter, pack = 8 / sp->bits;
    ck_assert_uint_le(sp->layers * 7, 64);
    for (uint32_t l = 0; l < sp->layers; l++) {
        add(t, &n, &off, l, "fc1.weight", 0, E, I, H / pack, 3);
        add(t, &n, &off, l, "fc1.scales", 1, E, I, 0, 2);
        add(t, &n, &off, l, "fc1.bias", 1, E, I, 0, 2);
        add(t, &n, &off, l, "fc2.weight", 0, E, H, I / pack, 3);
        add(t, &n, &off, l, "fc2.scales", 1, E, H, 0, 2);
        add(t, &n, &off, l, "fc2.bias", 1, E, H, 0, 2);
        if (sp->router) {
            add(t, &n, &off, l, "router.weight", 1, E, H, 0, 2);
            add(t, &n, &off, l, "router.bias", 1, E, 0, 0, 1);
        }
    }
    char *hdr = malloc(16384);
    ck_assert_ptr_nonnull(hdr);
    int w = snprintf(hdr, 16384,
                     "{\"__metadata__\":{\"qmoe.format\":\"1\",\"qmoe.layers\":\"%u\","
                     "\"qmoe.experts\":\"%u\",\"qmoe.hidden_size\":\"%u\",\"qmoe.inter_size\":"
                     "\"%u\",\"qmoe.k\":\"%u\",\"qmoe.activation\":\"silu\",\"qmoe.bits\":\"%u\","
                     "\"qmoe.block_size\":\"0\"}",
                     sp->layers, E, H, I, sp->k, sp->bits);
    for (size_t i = 0; i < n; i++) {
        w += snprintf(hdr + w, 16384 - (size_t)w, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%llu",
                      t[i].name, t[i].dtype, (unsigned long long)t[i].shape[0]);
        for (uint32_t d = 1; d < t[i].ndim; d++)
            w += snprintf(hdr + w, 16384 - (size_t)w, ",%llu", (unsigned long long)t[i].shape[d]);
        w += snprintf(hdr + w, 16384 - (size_t)w, "],\"data_offsets\":[%llu,%llu]}",
                      (unsigned long long)t[i].offset,
                      (unsigned long long)(t[i].offset + t[i].bytes));
    }
    w += snprintf(hdr + w, 16384 - (size_t)w, "}");
    ck_assert_int_lt(w, 16000);
    size_t hlen = ((size_t)w + 7) / 8 * 8;
    while ((size_t)w < hlen)
        hdr[w++] = ' ';
    out->size = 8 + hlen + off;
    out->image = calloc(1, out->size);
    ck_assert_ptr_nonnull(out->image);
    uint64_t hl = hlen;
    memcpy(out->image, &hl, 8);
    memcpy(out->image + 8, hdr, hlen);
    free(hdr);
    uint8_t *data = out->image + 8 + hlen;
    uint64_t s = sp->seed * 1000003 + 1;
    for (size_t i = 0; i < n; i++) {
        uint8_t *p = data + t[i].offset;
        if (!t[i].is_f32) {
            for (uint64_t b = 0; b < t[i].bytes; b++)
                p[b] = (uint8_t)pf_rand(&s);
            continue;
        }
        int scales = strstr(t[i].name, "scales") != NULL;
        for (uint64_t b = 0; b < t[i].bytes / 4; b++) {
            float v = scales ? pf_uniform(&s, 0.01f, 0.05f) : pf_uniform(&s, -0.5f, 0.5f);
            memcpy(p + 4 * b, &v, 4);
        }
    }
    qm_status st = {0};
    int rc = qm_bank_open_memory(out->image, out->size, &out->bank, &st);
    ck_assert_msg(rc == 0, "bank image rejected: %s", st.msg);
}

void pf_bank_close(pf_bank *b)
{
    qm_bank_close(b->bank);
    free(b->image);
    memset(b, 0, sizeof *b);
}

void pf_route_logits(uint32_t E, const uint32_t *experts, uint32_t n, float *logits)
{
    for (uint32_t e = 0; e < E; e++)
        logits[e] = -30.0f - (float)e * 0.01f; /* softmax weight ~1e-15: dropped if chosen */
    for (uint32_t j = 0; j < n; j++)
        logits[experts[j]] = 4.0f - 0.5f * (float)j;
}

/* ---- The fake device ---------------------------------------------------------- */

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
