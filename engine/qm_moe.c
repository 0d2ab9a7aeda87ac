/* qm_moe.c - routing, router logits, token grouping, the expert-source
 * protocol (waves) and the combine of one MoE layer. A backend with the
 * optional routing methods (qm_backend_impl.h: CUDA) does the routing, the
 * token permutation and the combine itself, with the same semantics; only
 * the routes come back here, for the expert source (the pager). */
#include <math.h>
#include <string.h>
#include <time.h>

#include "qm_alloc.h"
#include "qm_backend_impl.h"
#include "qm_kernels.h"
#include "qm_moe_internal.h"

void qm_moe_route(const float *logits, uint32_t n_tokens, uint32_t n_experts, uint32_t k,
                  uint32_t *experts, float *weights)
{
    for (uint32_t t = 0; t < n_tokens; t++) {
        const float *l = logits + (size_t)t * n_experts;
        uint32_t *ex = experts + (size_t)t * k;
        float *w = weights + (size_t)t * k;
        float val[k > 0 ? k : 1];
        /* Selection by repeated maximum: strictly greater wins, equal values go
         * to the larger index (onnxruntime's CPU kernel); NaN never beats a number. */
        for (uint32_t j = 0; j < k; j++) {
            uint32_t best = UINT32_MAX;
            for (uint32_t e = 0; e < n_experts; e++) {
                int taken = 0;
                for (uint32_t i = 0; i < j; i++)
                    taken |= ex[i] == e;
                if (taken)
                    continue;
                if (best == UINT32_MAX || l[e] >= l[best] || (isnan(l[best]) && !isnan(l[e])))
                    best = e;
            }
            ex[j] = best;
            val[j] = l[best];
        }
        /* Softmax over the k selected logits; val[0] is the largest. */
        float sum = 0.0f;
        for (uint32_t j = 0; j < k; j++) {
            w[j] = expf(val[j] - val[0]);
            sum += w[j];
        }
        for (uint32_t j = 0; j < k; j++) {
            w[j] /= sum;
            if (!(w[j] > 1e-8f)) {
                w[j] = 0.0f;
                ex[j] = QM_ROUTE_DROPPED;
            }
        }
    }
}

int qm_moe_router_logits(const qm_bank_config *cfg, const qm_layer_view *layer, const float *x,
                         uint32_t n_tokens, float *logits, qm_status *st)
{
    const qm_tensor_view *tw = &layer->t[QM_T_ROUTER_WEIGHT];
    const qm_tensor_view *tb = &layer->t[QM_T_ROUTER_BIAS];
    if (!tw->present)
        return qm_status_set(st, QM_EINVAL,
                             "layer %u has no router weight: pass router_logits", layer->index);
    const uint32_t E = cfg->experts, H = cfg->hidden;
    for (uint32_t t = 0; t < n_tokens; t++) {
        const float *xr = x + (size_t)t * H;
        for (uint32_t e = 0; e < E; e++) {
            /* Accumulated in double: routing must not hinge on f32 rounding. */
            double acc = 0.0;
            for (uint32_t c = 0; c < H; c++)
                acc += (double)qm__load_float(tw->data, tw->dtype, (size_t)e * H + c) * xr[c];
            if (tb->present)
                acc += qm__load_float(tb->data, tb->dtype, e);
            logits[(size_t)t * E + e] = (float)acc;
        }
    }
    return 0;
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

static uint64_t qm__now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void qm__load_hidden(qm_dtype dt, const void *src, size_t n, float *dst)
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

int qm__moe_forward_layer(qm_backend *be, const qm_bank_config *cfg, const qm_layer_view *layer,
                          const qm_moe_call *call, qm_expert_source *source, qm_moe_stats *stats,
                          qm_status *st)
{
    qm_moe_stats local = {0};
    if (!stats)
        stats = &local;
    memset(stats, 0, sizeof *stats);
    if (!be || !cfg || !layer || !call || !source || !source->acquire)
        return qm_status_set(st, QM_EINVAL, "forward: backend, layer, call or source missing");
    if (call->dtype != QM_DTYPE_F32 && call->dtype != QM_DTYPE_F16 &&
        call->dtype != QM_DTYPE_BF16)
        return qm_status_set(st, QM_EINVAL, "hidden dtype must be f32, f16 or bf16");
    const uint32_t T = call->n_tokens, E = cfg->experts, k = cfg->k, H = cfg->hidden;
    if (T == 0)
        return 0; /* an empty batch is an empty result */
    if (!call->hidden || !call->output)
        return qm_status_set(st, QM_EINVAL, "forward: hidden or output missing");
    if (k == 0 || k > E)
        return qm_status_set(st, QM_EINVAL, "k = %u with %u experts", k, E);

    int rc = 0;
    size_t TK = (size_t)T * k, TH = (size_t)T * H;
    float *x = qm_malloc(TH * sizeof(float));
    float *logits = qm_malloc((size_t)T * E * sizeof(float));
    uint32_t *route_e = qm_malloc(TK * sizeof(uint32_t));
    float *route_w = qm_malloc(TK * sizeof(float));
    float *y = qm_malloc(TK * H * sizeof(float));
    float *out = qm_malloc(TH * sizeof(float));
    uint32_t *count = qm_calloc((size_t)E + 1, sizeof(uint32_t));
    uint32_t *rows = qm_malloc(TK * sizeof(uint32_t));
    uint32_t *out_index = qm_malloc(TK * sizeof(uint32_t));
    uint32_t *uniq = qm_malloc((size_t)E * sizeof(uint32_t));
    qm_expert_weights *wts = qm_malloc((size_t)E * sizeof(qm_expert_weights));
    qm_expert_job *jobs = qm_malloc((size_t)E * sizeof(qm_expert_job));
    uint32_t *dev_count = qm_malloc((size_t)E * sizeof(uint32_t));
    void *pass = NULL; /* the backend's routed pass, when it routes */
    if (!x || !logits || !route_e || !route_w || !y || !out || !count || !rows || !out_index ||
        !uniq || !wts || !jobs || !dev_count) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory for a %u-token forward pass", T);
        goto done;
    }

    /* 1. Routing: on the backend when it offers it, else here. */
    qm__load_hidden(call->dtype, call->hidden, TH, x);
    if (qm__backend_can_route(be)) {
        if (!call->logits && !layer->t[QM_T_ROUTER_WEIGHT].present) {
            rc = qm_status_set(st, QM_EINVAL, "layer %u has no router weight: pass router_logits",
                               layer->index);
            goto done;
        }
        qm_route_request rq = {.config = cfg,
                               .layer = layer,
                               .x = x,
                               .logits = call->logits,
                               .n_tokens = T,
                               .experts = route_e,
                               .weights = route_w,
                               .counts = dev_count,
                               .act_dtype = call->dtype};
        qm_status rst = {0};
        rc = qm__backend_route(be, &rq, &pass, &rst);
        if (rc < 0 && rc != QM_EUNSUPPORTED) {
            if (st)
                *st = rst;
            goto done;
        }
        rc = 0;
    }
    if (!pass) {
        if (call->logits) {
            memcpy(logits, call->logits, (size_t)T * E * sizeof(float));
        } else {
            rc = qm_moe_router_logits(cfg, layer, x, T, logits, st);
            if (rc < 0)
                goto done;
        }
        qm_moe_route(logits, T, E, k, route_e, route_w);
    }
    if (call->route_experts)
        memcpy(call->route_experts, route_e, TK * sizeof(uint32_t));
    if (call->route_weights)
        memcpy(call->route_weights, route_w, TK * sizeof(float));

    /* 2. Group routes by expert (tokens ascending within an expert). */
    for (size_t i = 0; i < TK; i++)
        if (route_e[i] != QM_ROUTE_DROPPED)
            count[route_e[i] + 1]++;
    size_t n_uniq = 0;
    for (uint32_t e = 0; e < E; e++) {
        if (pass && count[e + 1] != dev_count[e]) {
            rc = qm_status_set(st, QM_EINTERNAL,
                               "backend routing counted %u routes to expert %u, the routes say %u",
                               dev_count[e], e, count[e + 1]);
            goto done;
        }
        if (count[e + 1])
            uniq[n_uniq++] = e;
        count[e + 1] += count[e]; /* count[e] = first slot of expert e */
    }
    if (!pass) {
        uint32_t *fill = qm_malloc((size_t)E * sizeof(uint32_t));
        if (!fill) {
            rc = qm_status_set(st, QM_ENOMEM, "out of memory grouping tokens");
            goto done;
        }
        memcpy(fill, count, (size_t)E * sizeof(uint32_t));
        for (size_t i = 0; i < TK; i++) {
            uint32_t e = route_e[i];
            if (e == QM_ROUTE_DROPPED)
                continue;
            rows[fill[e]] = (uint32_t)(i / k);
            out_index[fill[e]] = (uint32_t)i;
            fill[e]++;
        }
        qm_free(fill);
    }

    /* 3. Experts, in waves of whatever the source can make usable at once. */
    qm_expert_batch batch = {.config = cfg, .layer = layer, .x = x, .n_tokens = T, .y = y,
                             .precision = call->precision};
    uint64_t t0 = qm__now_us();
    for (size_t done_n = 0; done_n < n_uniq;) {
        size_t ready = 0;
        rc = source->acquire(source->ctx, layer->index, uniq + done_n, n_uniq - done_n,
                             wts + done_n, &ready, st);
        if (rc < 0)
            goto done;
        if (ready == 0 || ready > n_uniq - done_n) {
            rc = qm_status_set(st, QM_EINTERNAL,
                               "expert source made %zu of %zu experts usable (want 1..%zu)",
                               ready, n_uniq - done_n, n_uniq - done_n);
            goto done;
        }
        for (size_t i = 0; i < ready; i++) {
            uint32_t e = uniq[done_n + i];
            jobs[i] = (qm_expert_job){.expert = e,
                                      .weights = wts[done_n + i],
                                      .rows = pass ? NULL : rows + count[e],
                                      .out_index = pass ? NULL : out_index + count[e],
                                      .n_rows = count[e + 1] - count[e]};
        }
        batch.jobs = jobs;
        batch.n_jobs = ready;
        if (pass)
            rc = qm__backend_run_routed(be, pass, &batch, st);
        else
            rc = qm_backend_run_experts(be, &batch, st);
        if (source->release)
            source->release(source->ctx, layer->index, uniq + done_n, ready);
        if (rc < 0)
            goto done;
        done_n += ready;
        stats->waves++;
    }
    stats->compute_us = qm__now_us() - t0;

    /* 4. Combine in route order j = 0..k-1: the same sums whatever order the
     * experts ran in. The fc2 bias is inside y, so inside the weighted sum. */
    if (pass) {
        rc = qm__backend_combine(be, pass, out, st);
        if (rc < 0)
            goto done;
    }
    for (uint32_t t = 0; t < T && !pass; t++) {
        float *o = out + (size_t)t * H;
        for (uint32_t c = 0; c < H; c++)
            o[c] = 0.0f;
        for (uint32_t j = 0; j < k; j++) {
            size_t i = (size_t)t * k + j;
            if (route_e[i] == QM_ROUTE_DROPPED)
                continue;
            const float *yr = y + i * H;
            float w = route_w[i];
            for (uint32_t c = 0; c < H; c++)
                o[c] += w * yr[c];
        }
    }
    qm__store_output(call->dtype, out, TH, call->output);

done:
    qm__backend_pass_release(be, pass);
    qm_free(dev_count);
    qm_free(x);
    qm_free(logits);
    qm_free(route_e);
    qm_free(route_w);
    qm_free(y);
    qm_free(out);
    qm_free(count);
    qm_free(rows);
    qm_free(out_index);
    qm_free(uniq);
    qm_free(wts);
    qm_free(jobs);
    return rc;
}
