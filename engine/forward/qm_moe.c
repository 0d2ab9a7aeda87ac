/* qm_moe.c - the forward pass of one MoE layer: route -> group -> waves ->
 * combine, with its scratch kept per session, and the direct expert source
 * over an open bank. Routing goes through the backend's wrappers
 * (qm__backend_route: the backend's own routing, or the host routing of
 * qm_host_route.c), except under hybrid execution, which routes and
 * combines on the host whatever the backend.
 *
 * A backend with the optional routing methods (qm_backend_impl.h: CUDA)
 * routes, permutes the token rows and combines itself, with the same
 * semantics; only the routes come back here, for the expert source (the pager). */
#include <stdint.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_backend_impl.h"
#include "qm_clock.h"
#include "qm_host_route.h"
#include "qm_kernels.h"
#include "qm_moe_internal.h"

uint32_t qm_moe_call_k(const qm_bank_config *cfg, const qm_moe_call *call)
{
    return call && call->topk_ids ? call->topk_k : cfg->k;
}

uint64_t qm__expert_slice(const qm_tensor_view *tv, uint32_t n_experts)
{
    return tv->present && n_experts ? tv->nbytes / n_experts : 0;
}

void qm_expert_weights_from_unit(const qm_layer_view *layer, uint32_t n_experts, uint32_t expert,
                                 const uint8_t *unit_base, qm_expert_weights *out)
{
    (void)expert; /* the unit already is this expert's bytes */
    uint64_t off = 0;
    out->r8 = out->r8_part = out->r8_part_rows = 0;
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        const qm_tensor_view *tv = &layer->t[t];
        if (!tv->present) {
            out->ptr[t] = NULL;
            continue;
        }
        out->ptr[t] = unit_base + off;
        off += qm__expert_slice(tv, n_experts);
    }
}

void qm__mapped_weights(const qm_layer_view *layer, uint32_t n_experts, uint32_t expert,
                        qm_expert_weights *out)
{
    out->r8 = out->r8_part = out->r8_part_rows = 0;
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        const qm_tensor_view *tv = &layer->t[t];
        out->ptr[t] = tv->present ? (const uint8_t *)tv->data +
                                        expert * qm__expert_slice(tv, n_experts)
                                  : NULL;
    }
}

void qm__load_hidden(qm_dtype dt, const void *src, size_t n, float *dst)
{
    if (dt == QM_DTYPE_F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    for (size_t i = 0; i < n; i++)
        dst[i] = qm__load_float(src, dt, i);
}

static void qm__store_output(qm_dtype dt, const float *src, size_t n, void *dst)
{
    if (dt == QM_DTYPE_F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
    for (size_t i = 0; i < n; i++)
        d[i] = dt == QM_DTYPE_F16 ? qm_f32_to_f16(src[i]) : qm_f32_to_bf16(src[i]);
}

struct qm__moe_scratch {
    qm__block block; /* the forward pass's own buffers (qm__call_buffers) */
    qm__host_pass host;
};

int qm__moe_scratch_new(qm__moe_scratch **out, qm_status *st)
{
    *out = qm_calloc(1, sizeof **out);
    return *out ? 0 : qm_status_set(st, QM_ENOMEM, "out of memory for forward scratch");
}

static void qm__scratch_clear(qm__moe_scratch *s)
{
    qm__block_free(&s->block);
    qm__host_pass_clear(&s->host);
}

void qm__moe_scratch_free(qm__moe_scratch *s)
{
    if (!s)
        return;
    qm__scratch_clear(s);
    qm_free(s);
}

size_t qm__moe_scratch_bytes(const qm__moe_scratch *s)
{
    return s ? s->block.cap + s->host.block.cap : 0;
}

/* ---- The forward pass ------------------------------------------------------ */

/* The forward pass's own buffers, carved from the scratch per call. */
typedef struct qm__call_buffers {
    float *x;                /* [T, H] the hidden states in f32 */
    uint32_t *experts;       /* [T, k] routes, when the call keeps none */
    float *weights;          /* [T, k] */
    uint32_t *counts;        /* [E] the routing's count per expert */
    uint32_t *tally;         /* [E] the routes' count per expert (checks counts) */
    uint32_t *uniq;          /* [E] experts with routes, ascending */
    qm_expert_weights *wts;  /* [E] their weights, as the source made them usable */
    qm_expert_job *jobs;     /* [E] a wave's jobs */
    uint8_t *on_host;        /* [E] hybrid execution: uniq[i] runs on the host */
    size_t *ready_idx;       /* [E] acquire_some: indexes into the experts left */
    uint32_t *got;           /* [E] acquire_some: the experts of one batch */
    float *out;              /* [T, H] the combine, f32 */
} qm__call_buffers;

static void qm__layout_call(qm__carver *c, const qm__dims *d, void *out)
{
    qm__call_buffers *b = out;
    const uint64_t TK = (uint64_t)d->T * d->k, TH = (uint64_t)d->T * d->H;
    b->x = qm__carve(c, TH, sizeof(float));
    b->experts = qm__carve(c, TK, sizeof(uint32_t));
    b->weights = qm__carve(c, TK, sizeof(float));
    b->counts = qm__carve(c, d->E, sizeof(uint32_t));
    b->tally = qm__carve(c, d->E, sizeof(uint32_t));
    b->uniq = qm__carve(c, d->E, sizeof(uint32_t));
    b->wts = qm__carve(c, d->E, sizeof(qm_expert_weights));
    b->jobs = qm__carve(c, d->E, sizeof(qm_expert_job));
    b->on_host = qm__carve(c, d->E, sizeof(uint8_t));
    b->ready_idx = qm__carve(c, d->E, sizeof(size_t));
    b->got = qm__carve(c, d->E, sizeof(uint32_t));
    b->out = qm__carve(c, TH, sizeof(float));
}

/* Experts with routes, ascending, after checking the routing's counts
 * against the routes themselves. */
static int qm__group(const uint32_t *route_e, size_t n_routes, uint32_t E,
                     const uint32_t *counts, uint32_t *tally, uint32_t *uniq, size_t *n_uniq,
                     qm_status *st)
{
    memset(tally, 0, (size_t)E * sizeof(uint32_t));
    for (size_t i = 0; i < n_routes; i++) {
        uint32_t e = route_e[i];
        if (e == QM_ROUTE_DROPPED)
            continue;
        if (e >= E)
            return qm_status_set(st, QM_EINTERNAL, "routing sent a token to expert %u of %u", e,
                                 E);
        tally[e]++;
    }
    size_t n = 0;
    for (uint32_t e = 0; e < E; e++) {
        if (tally[e] != counts[e])
            return qm_status_set(st, QM_EINTERNAL,
                                 "backend routing counted %u routes to expert %u, the routes say %u",
                                 counts[e], e, tally[e]);
        if (tally[e])
            uniq[n++] = e;
    }
    *n_uniq = n;
    return 0;
}

/* One batch of experts on the backend: jobs[0..n) over got[0..n). */
static int qm__run_batch(qm_backend *be, qm_routed_pass *pass, qm_expert_batch *batch,
                         const qm__call_buffers *b, size_t n, qm_moe_stats *stats, qm_status *st)
{
    uint64_t t0 = qm__now_us();
    batch->jobs = b->jobs;
    batch->n_jobs = n;
    int rc = qm__backend_run_routed(be, pass, batch, st);
    stats->device_us += qm__now_us() - t0;
    stats->device_experts += (uint32_t)n;
    for (size_t i = 0; i < n; i++)
        stats->device_rows += b->jobs[i].n_rows;
    stats->batches++;
    return rc;
}

/* Experts in waves of whatever the source can make usable at once. */
static int qm__run_waves(qm_backend *be, qm_routed_pass *pass, qm_expert_batch *batch,
                         qm_expert_source *source, uint32_t layer, const qm__call_buffers *b,
                         size_t n_uniq, qm_moe_stats *stats, qm_status *st)
{
    qm_combine *combine = batch->combine;
    for (size_t done_n = 0; done_n < n_uniq;) {
        size_t left = n_uniq - done_n, ready = 0;
        /* A source that predates qm_expert_weights.r8 leaves it 0: row order. */
        memset(b->wts + done_n, 0, left * sizeof *b->wts);
        uint64_t t0 = qm__now_us();
        int rc = source->acquire(source->ctx, layer, b->uniq + done_n, left, b->wts + done_n,
                                 &ready, st);
        uint64_t t1 = qm__now_us();
        stats->acquire_us += t1 - t0;
        if (rc < 0)
            return rc;
        if (ready == 0 || ready > left)
            return qm_status_set(st, QM_EINTERNAL,
                                 "expert source made %zu of %zu experts usable (want 1..%zu)",
                                 ready, left, left);
        for (size_t i = 0; i < ready; i++) {
            uint32_t e = b->uniq[done_n + i];
            b->jobs[i] = (qm_expert_job){
                .expert = e, .weights = b->wts[done_n + i], .n_rows = b->counts[e]};
        }
        /* One wave holds every route: the backend may combine them. */
        batch->combine = ready == n_uniq ? combine : NULL;
        rc = qm__run_batch(be, pass, batch, b, ready, stats, st);
        batch->combine = combine;
        if (source->release)
            source->release(source->ctx, layer, b->uniq + done_n, ready);
        if (rc < 0)
            return rc;
        done_n += ready;
        stats->waves++;
    }
    return 0;
}

/* Experts as the source makes them usable (acquire_some): resident ones at
 * once, the others as their copies land; uniq[0..n_left) stays the
 * experts not run yet, ascending. Each batch runs in expert order, like a
 * wave, and the combine sums in route order: the same bits in any order. */
static int qm__run_landed(qm_backend *be, qm_routed_pass *pass, qm_expert_batch *batch,
                          qm_expert_source *source, uint32_t layer, const qm__call_buffers *b,
                          size_t n_left, qm_moe_stats *stats, qm_status *st)
{
    qm_combine *combine = batch->combine;
    const size_t n_all = n_left;
    while (n_left > 0) {
        size_t ready = 0;
        memset(b->wts, 0, n_left * sizeof *b->wts);
        uint64_t t0 = qm__now_us();
        int rc = source->acquire_some(source->ctx, layer, b->uniq, n_left, b->ready_idx, b->wts,
                                      &ready, st);
        stats->acquire_us += qm__now_us() - t0;
        if (rc < 0)
            return rc; /* the source let go of what it had not returned */
        int bad = ready == 0 || ready > n_left;
        for (size_t i = 0; !bad && i < ready; i++) {
            bad = b->ready_idx[i] >= n_left || b->on_host[b->ready_idx[i]];
            if (!bad)
                b->on_host[b->ready_idx[i]] = 1; /* taken */
        }
        if (bad) {
            memset(b->on_host, 0, n_left);
            if (source->release)
                source->release(source->ctx, layer, b->uniq, n_left);
            return qm_status_set(st, QM_EINTERNAL,
                                 "expert source made %zu of %zu experts usable, or one twice",
                                 ready, n_left);
        }
        stats->waves += rc == 1;
        /* Expert order within the batch (insertion: a batch is small). */
        for (size_t i = 0; i < ready; i++) {
            size_t j = i, idx = b->ready_idx[i];
            qm_expert_weights w = b->wts[i];
            for (; j > 0 && b->got[j - 1] > b->uniq[idx]; j--) {
                b->got[j] = b->got[j - 1];
                b->jobs[j] = b->jobs[j - 1];
            }
            b->got[j] = b->uniq[idx];
            b->jobs[j] = (qm_expert_job){
                .expert = b->uniq[idx], .weights = w, .n_rows = b->counts[b->uniq[idx]]};
        }
        batch->combine = ready == n_all ? combine : NULL; /* every route in one batch */
        rc = qm__run_batch(be, pass, batch, b, ready, stats, st);
        batch->combine = combine;
        if (source->release)
            source->release(source->ctx, layer, b->got, ready);
        size_t k = 0;
        for (size_t i = 0; i < n_left; i++)
            if (!b->on_host[i])
                b->uniq[k++] = b->uniq[i];
        memset(b->on_host, 0, n_left);
        n_left = k;
        if (rc < 0) {
            if (source->release && n_left)
                source->release(source->ctx, layer, b->uniq, n_left);
            return rc;
        }
    }
    return 0;
}

/* Hybrid execution: asks the source which experts run on the host, runs
 * them there from the bank mapping (one batch), and leaves the others in
 * uniq[0..*n_uniq) for the waves. */
static int qm__run_on_host(qm_routed_pass *pass, qm_expert_batch *batch,
                           qm_expert_source *source, const qm_layer_view *layer,
                           const qm__call_buffers *b, size_t *n_uniq, qm_moe_stats *stats,
                           qm_status *st)
{
    const uint32_t E = batch->config->experts;
    size_t n = *n_uniq, n_host = 0, n_dev = 0;
    memset(b->on_host, 0, n);
    int rc = source->split(source->ctx, layer->index, batch->n_tokens, b->uniq, b->counts, n,
                           b->on_host, st);
    if (rc < 0)
        return rc;
    for (size_t i = 0; i < n; i++) {
        uint32_t e = b->uniq[i];
        if (!b->on_host[i]) {
            b->uniq[n_dev++] = e; /* stays ascending */
            continue;
        }
        b->jobs[n_host] = (qm_expert_job){.expert = e, .n_rows = b->counts[e]};
        qm__mapped_weights(layer, E, e, &b->jobs[n_host].weights);
        stats->host_rows += b->counts[e];
        n_host++;
    }
    *n_uniq = n_dev;
    stats->host_experts = (uint32_t)n_host;
    if (n_host == 0)
        return 0;
    batch->jobs = b->jobs;
    batch->n_jobs = n_host;
    uint64_t t0 = qm__now_us();
    qm_expert_batch routed;
    rc = qm__host_batch(pass->host, batch, &routed, st);
    if (rc == 0)
        rc = qm_backend_run_experts(source->host, &routed, st);
    stats->host_us = qm__now_us() - t0;
    return rc;
}

static int qm__forward(qm_backend *be, const qm_bank_config *cfg, const qm_layer_view *layer,
                       const qm_moe_call *call, qm_expert_source *source, qm__moe_scratch *s,
                       qm_moe_stats *stats, qm_status *st)
{
    const uint32_t T = call->n_tokens, E = cfg->experts, k = qm_moe_call_k(cfg, call),
                   H = cfg->hidden;
    const size_t TH = (size_t)T * H;
    qm__dims d = {.T = T, .E = E, .k = k, .H = H, .need_logits = !call->logits};
    qm__call_buffers b;
    int rc = qm__block_carve(&s->block, qm__layout_call, &d, &b, st);
    if (rc < 0)
        return rc;
    uint32_t *route_e = call->route_experts ? call->route_experts : b.experts;
    float *route_w = call->route_weights ? call->route_weights : b.weights;

    /* 1. Route: on the backend, or on the host (the default). */
    qm__load_hidden(call->dtype, call->hidden, TH, b.x);
    qm_routing_request rq = {.config = cfg,
                           .layer = layer,
                           .x = b.x,
                           .logits = call->logits,
                           .n_tokens = T,
                           .experts = route_e,
                           .weights = route_w,
                           .counts = b.counts,
                           .act_dtype = call->dtype,
                           .topk_ids = call->topk_ids,
                           .topk_weights = call->topk_weights,
                           .k = k};
    qm_routed_pass pass = {.host = &s->host};
    /* Hybrid execution routes on the host: its results and the device's
     * meet in the host's combine. */
    const int hybrid = source->split && source->host;
    rc = hybrid ? qm__host_route(pass.host, &rq, st) : qm__backend_route(be, &rq, &pass, st);
    if (rc < 0)
        return rc;

    /* 2. Group: the experts this call needs. */
    size_t n_uniq = 0;
    rc = qm__group(route_e, (size_t)T * k, E, b.counts, b.tally, b.uniq, &n_uniq, st);
    if (rc < 0)
        goto release_pass;

    /* 3. Waves. */
    /* An f32 output is summed into in place (aligned: the map's offsets
     * need not be; only the caller's own rows are written and read back);
     * another dtype from the pass's f32 rows. */
    float *out = call->dtype == QM_DTYPE_F32 && (uintptr_t)call->output % sizeof(float) == 0
                     ? (float *)call->output
                     : b.out;
    /* The sum is offered to the backend with a batch of every route; never
     * in hybrid execution, whose host share is summed with the device's. */
    qm_combine combine = {.out = out, .weights = route_w, .experts = route_e, .k = k};
    qm_expert_batch batch = {.config = cfg,
                             .layer = layer,
                             .x = b.x,
                             .n_tokens = T,
                             .precision = call->precision,
                             .combine = hybrid ? NULL : &combine};
    uint64_t t0 = qm__now_us();
    if (hybrid && (rc = qm__run_on_host(&pass, &batch, source, layer, &b, &n_uniq, stats, st)) < 0)
        goto release_pass;
    if (source->acquire_some) {
        memset(b.on_host, 0, n_uniq); /* marks the experts each batch took */
        rc = qm__run_landed(be, &pass, &batch, source, layer->index, &b, n_uniq, stats, st);
    } else {
        rc = qm__run_waves(be, &pass, &batch, source, layer->index, &b, n_uniq, stats, st);
    }
    if (rc < 0)
        goto release_pass;
    stats->compute_us = qm__now_us() - t0;

    /* 4. Combine, unless the backend did. */
    if (!combine.done)
        rc = qm__backend_combine(be, &pass, out, st);
    if (rc == 0 && out != call->output)
        qm__store_output(call->dtype, out, TH, call->output);

release_pass:
    qm__backend_pass_release(be, &pass);
    return rc;
}

int qm__moe_forward_layer(qm_backend *be, const qm_bank_config *cfg, const qm_layer_view *layer,
                          const qm_moe_call *call, qm_expert_source *source,
                          qm__moe_scratch *scratch, qm_moe_stats *stats, qm_status *st)
{
    qm_moe_stats local = {0};
    if (!stats)
        stats = &local;
    memset(stats, 0, sizeof *stats);
    if (!be || !cfg || !layer || !call || !source || !source->acquire)
        return qm_status_set(st, QM_EINVAL, "forward: backend, layer, call or source missing");
    if (source->version != QM_EXPERT_SOURCE_VERSION)
        return qm_status_set(st, QM_EINVAL, "forward: expert source of version %d (want %d)",
                             source->version, QM_EXPERT_SOURCE_VERSION);
    if (call->dtype != QM_DTYPE_F32 && call->dtype != QM_DTYPE_F16 &&
        call->dtype != QM_DTYPE_BF16)
        return qm_status_set(st, QM_EINVAL, "hidden dtype must be f32, f16 or bf16");
    const uint32_t k = qm_moe_call_k(cfg, call);
    if (call->n_tokens == 0)
        return 0; /* an empty batch is an empty result */
    if (!call->hidden || !call->output)
        return qm_status_set(st, QM_EINVAL, "forward: hidden or output missing");
    if (call->topk_ids && (k == 0 || k > cfg->experts))
        return qm_status_set_field(st, QM_EINVAL, "topk_ids",
                                   "topk_ids has %u columns but it must have 1..%u (experts)", k,
                                   cfg->experts);
    if (k == 0 || k > cfg->experts)
        return qm_status_set(st, QM_EINVAL, "k = %u with %u experts", k, cfg->experts);
    if (call->topk_ids && !call->topk_weights)
        return qm_status_set_field(st, QM_EINVAL, "topk_weights",
                                   "topk_ids given without topk_weights");
    /* Refused before any backend is asked. */
    if (!call->topk_ids && !call->logits && !layer->t[QM_T_ROUTER_WEIGHT].present)
        return qm_status_set(st, QM_EINVAL, "layer %u has no router weight: pass router_logits",
                             layer->index);
    if (scratch)
        return qm__forward(be, cfg, layer, call, source, scratch, stats, st);
    qm__moe_scratch once = {0};
    int rc = qm__forward(be, cfg, layer, call, source, &once, stats, st);
    qm__scratch_clear(&once);
    return rc;
}

int qm_moe_forward(qm_backend *be, const qm_bank *bank, const qm_moe_call *call,
                   qm_expert_source *source, qm_moe_stats *stats, qm_status *st)
{
    const qm_layer_view *layer = NULL;
    int rc = qm__moe_layer_of(bank, call, &layer, st);
    if (rc < 0)
        return rc;
    return qm__moe_forward_layer(be, qm_bank_get_config(bank), layer, call, source, NULL, stats,
                                 st);
}

int qm__moe_layer_of(const qm_bank *bank, const qm_moe_call *call, const qm_layer_view **out,
                     qm_status *st)
{
    *out = NULL;
    if (!bank || !call)
        return qm_status_set(st, QM_EINVAL, "forward: bank or call missing");
    *out = qm_bank_layer(bank, call->layer);
    if (!*out)
        return qm_status_set_field(st, QM_EINVAL, "layer", "layer %u out of range (bank has %u)",
                                   call->layer, qm_bank_get_config(bank)->layers);
    return 0;
}

/* ---- The direct expert source ---------------------------------------------- */

static int qm__direct_acquire(void *ctx, uint32_t layer, const uint32_t *experts, size_t n,
                              qm_expert_weights *weights, size_t *n_ready, qm_status *st)
{
    const qm_bank *bank = ctx;
    const qm_layer_view *lv = qm_bank_layer(bank, layer);
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    *n_ready = 0;
    if (!lv)
        return qm_status_set(st, QM_EINVAL, "layer %u out of range", layer);
    for (size_t i = 0; i < n; i++) {
        if (experts[i] >= cfg->experts)
            return qm_status_set(st, QM_EINVAL, "expert %u out of range", experts[i]);
        qm__mapped_weights(lv, cfg->experts, experts[i], &weights[i]);
    }
    *n_ready = n; /* everything is mapped: one wave */
    return 0;
}

static void qm__direct_release(void *ctx, uint32_t layer, const uint32_t *experts, size_t n)
{
    (void)ctx;
    (void)layer;
    (void)experts;
    (void)n;
}

void qm_expert_source_direct(const qm_bank *bank, qm_expert_source *out)
{
    out->version = QM_EXPERT_SOURCE_VERSION;
    out->ctx = (void *)bank;
    out->acquire = qm__direct_acquire;
    out->release = qm__direct_release;
    out->split = NULL;
    out->host = NULL;
    out->acquire_some = NULL; /* everything is mapped: acquire gives it all at once */
}
