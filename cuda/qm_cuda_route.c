/* qm_cuda_route.c - a layer call routed on the device: the optional route /
 * run_routed / combine / pass_release methods of the backend interface.
 *
 * route:      x (and the router weight, or the caller's logits) go up once;
 *             logits, top-k softmax and the permutation by expert run as
 *             five launches; only the routes (ids, weights, per-expert
 *             counts: T*k*8 + E*4 bytes) come back, for the pager.
 * run_routed: per wave, the job table goes up; FC1/act/FC2 read x through
 *             the pass's permutation and write their rows into the pass's
 *             y, in expert order (nothing comes back).
 * combine:    one launch sums each token's routes in route order; the
 *             output (T*H f32) comes back.
 * All calls are synchronous on return (the pager may evict the experts of
 * a wave as soon as run_routed returns) and serialised by run_lock, like
 * run_experts. */
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_cuda_internal.h"

#define QM__ALIGN256(n) (((n) + 255u) & ~(size_t)255u)

static void qm__cuda_pass_destroy(qm__cuda_pass *p)
{
    if (!p) return;
    void *dev[] = {p->x, p->logits, p->router, p->res, p->idx, p->y, p->h1, p->h3, p->a, p->jobs};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) {
        if (dev[i]) (void)cudaFree(dev[i]);
    }
    void *host[] = {p->host_io, p->host_res, p->host_jobs};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) {
        if (host[i]) (void)cudaFreeHost(host[i]);
    }
    qm_free(p->offsets);
    qm_free(p->ran);
    qm_free(p);
}

void qm__cuda_passes_free(qm__cuda_ctx *c)
{
    while (c->pass_pool) {
        qm__cuda_pass *p = c->pass_pool;
        c->pass_pool = p->next;
        qm__cuda_pass_destroy(p);
    }
}

void qm__cuda_pass_release(void *ctx, void *pass)
{
    qm__cuda_ctx *c = ctx;
    qm__cuda_pass *p = pass;
    if (!p) return;
    pthread_mutex_lock(&c->run_lock);
    p->next = c->pass_pool;
    c->pass_pool = p;
    pthread_mutex_unlock(&c->run_lock);
}

static int qm__real_dtype(qm_dtype d, uint32_t *out)
{
    switch (d) {
    case QM_DTYPE_F32:
        *out = QM__CUDA_F32;
        return 1;
    case QM_DTYPE_F16:
        *out = QM__CUDA_F16;
        return 1;
    case QM_DTYPE_BF16:
        *out = QM__CUDA_BF16;
        return 1;
    default:
        return 0;
    }
}

int qm__cuda_route(void *ctx, const qm_routing_request *rq, void **pass_out, qm_status *st)
{
    qm__cuda_ctx *c = ctx;
    *pass_out = NULL;
    if (!c->route_on_device)
        return qm_status_set(st, QM_EUNSUPPORTED, "device routing is switched off");
    int rc = qm__cuda_enter(c, st);
    if (rc < 0) return rc;
    if (!rq || !rq->config || !rq->layer || !rq->x || !rq->experts || !rq->weights)
        return qm_status_set(st, QM_EINVAL, "route: incomplete request");
    const qm_bank_config *cfg = rq->config;
    const uint32_t T = rq->n_tokens, E = cfg->experts, k = cfg->k, H = cfg->hidden;
    if (T == 0 || E == 0 || H == 0 || k == 0 || k > E)
        return qm_status_set(st, QM_EINVAL, "route: %u tokens, %u experts, k = %u, hidden %u", T,
                             E, k, H);
    if ((uint64_t)T * k > UINT32_MAX / 2 || (uint64_t)T * H > UINT32_MAX / 2 * 4ull)
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED, "route: %u tokens exceed one call", T);

    /* The router, when the caller gave no logits: the bank's tensors go up
     * with x (184 KB for GPT-OSS-20B's f16 router): no device cache to go
     * stale when a bank is closed and another mapped at the same address. */
    const qm_tensor_view *tw = &rq->layer->t[QM_T_ROUTER_WEIGHT];
    const qm_tensor_view *tb = &rq->layer->t[QM_T_ROUTER_BIAS];
    uint32_t w_dt = QM__CUDA_F32, b_dt = QM__CUDA_F32;
    size_t aux_bytes, w_bytes = 0, b_bytes = 0;
    if (rq->logits) {
        aux_bytes = (size_t)T * E * 4;
    } else {
        if (!tw->present || !tw->data)
            return qm_status_set(st, QM_EINVAL,
                                 "layer %u has no router weight: pass router_logits",
                                 rq->layer->index);
        w_bytes = (size_t)E * H * qm_dtype_size(tw->dtype);
        if (!qm__real_dtype(tw->dtype, &w_dt) || tw->nbytes < w_bytes)
            return qm_status_set(st, QM_EINVALID_MODEL,
                                 "layer %u router weight: %s, %llu bytes for [%u, %u]",
                                 rq->layer->index, qm_dtype_name(tw->dtype),
                                 (unsigned long long)tw->nbytes, E, H);
        if (tb->present) {
            b_bytes = (size_t)E * qm_dtype_size(tb->dtype);
            if (!tb->data || !qm__real_dtype(tb->dtype, &b_dt) || tb->nbytes < b_bytes)
                return qm_status_set(st, QM_EINVALID_MODEL, "layer %u router bias: bad dtype/size",
                                     rq->layer->index);
        }
        aux_bytes = QM__ALIGN256(w_bytes) + b_bytes;
    }

    pthread_mutex_lock(&c->run_lock);
    qm__cuda_pass *p = c->pass_pool;
    if (p) {
        c->pass_pool = p->next;
        p->next = NULL;
    } else {
        p = qm_calloc(1, sizeof *p);
        if (!p) {
            pthread_mutex_unlock(&c->run_lock);
            return qm_status_set(st, QM_ENOMEM, "route: cannot allocate a pass");
        }
    }
    const size_t TK = (size_t)T * k;
    const size_t x_bytes = QM__ALIGN256((size_t)T * H * 4);
    const size_t res_elems = 2 * TK + E + (E + 1);
    if ((rc = qm__cuda_reserve(c, (void **)&p->x, &p->x_cap, (size_t)T * H, 4, 0, st)) < 0 ||
        (rq->logits &&
         (rc = qm__cuda_reserve(c, (void **)&p->logits, &p->logits_cap, (size_t)T * E, 4, 0, st)) <
             0) ||
        (!rq->logits &&
         ((rc = qm__cuda_reserve(c, (void **)&p->logits, &p->logits_cap, (size_t)T * E, 4, 0,
                                 st)) < 0 ||
          (rc = qm__cuda_reserve(c, &p->router, &p->router_cap, aux_bytes, 1, 0, st)) < 0)) ||
        (rc = qm__cuda_reserve(c, &p->res, &p->res_cap, res_elems, 4, 0, st)) < 0 ||
        (rc = qm__cuda_reserve(c, (void **)&p->idx, &p->idx_cap, 3 * TK, 4, 0, st)) < 0 ||
        (rc = qm__cuda_reserve(c, &p->host_io, &p->host_io_cap, x_bytes + aux_bytes, 1, 1, st)) <
            0 ||
        (rc = qm__cuda_reserve(c, &p->host_res, &p->host_res_cap, res_elems * 4, 1, 1, st)) < 0)
        goto fail;
    if (p->host_cap_e < (size_t)E + 1) {
        qm_free(p->offsets);
        qm_free(p->ran);
        p->offsets = qm_malloc(((size_t)E + 1) * sizeof *p->offsets);
        p->ran = qm_malloc((size_t)E + 1);
        p->host_cap_e = 0;
        if (!p->offsets || !p->ran) {
            rc = qm_status_set(st, QM_ENOMEM, "route: cannot allocate the pass's tables");
            goto fail;
        }
        p->host_cap_e = (size_t)E + 1;
    }
    p->n_tokens = T;
    p->n_experts = E;
    p->k = k;
    p->hidden = H;
    p->n_active = 0;
    p->tc = !c->tensor_cores || c->cc_major < 8 ? 0
            : rq->act_dtype == QM_DTYPE_F16     ? 1
            : rq->act_dtype == QM_DTYPE_BF16    ? 2
                                                : 0;

    uint8_t *io = p->host_io;
    memcpy(io, rq->x, (size_t)T * H * 4);
    if (rq->logits) {
        memcpy(io + x_bytes, rq->logits, aux_bytes);
    } else {
        memcpy(io + x_bytes, tw->data, w_bytes);
        if (b_bytes) memcpy(io + x_bytes + QM__ALIGN256(w_bytes), tb->data, b_bytes);
    }
    uint32_t *d_exp = p->res;
    float *d_w = (float *)(d_exp + TK);
    uint32_t *d_counts = (uint32_t *)(d_w + TK), *d_offsets = d_counts + E;
    uint32_t *d_rank = p->idx, *d_slot = p->idx + TK, *d_perm = p->idx + 2 * TK;

    cudaStream_t cs = c->compute_stream;
    QM__CU(c, cudaMemcpyAsync(p->x, io, (size_t)T * H * 4, cudaMemcpyHostToDevice, cs),
           "cudaMemcpyAsync (x)");
    if (rq->logits) {
        QM__CU(c, cudaMemcpyAsync(p->logits, io + x_bytes, aux_bytes, cudaMemcpyHostToDevice, cs),
               "cudaMemcpyAsync (router logits)");
    } else {
        QM__CU(c, cudaMemcpyAsync(p->router, io + x_bytes, aux_bytes, cudaMemcpyHostToDevice, cs),
               "cudaMemcpyAsync (router weight)");
        const uint8_t *rw = p->router;
        QM__CU(c,
               (cudaError_t)qm__cuda_launch_router_logits(
                   p->x, T, H, E, rw, w_dt, b_bytes ? rw + QM__ALIGN256(w_bytes) : NULL, b_dt,
                   p->logits, cs),
               "router logits kernel launch");
    }
    QM__CU(c, (cudaError_t)qm__cuda_launch_topk(p->logits, T, E, k, d_exp, d_w, cs),
           "top-k kernel launch");
    QM__CU(c,
           (cudaError_t)qm__cuda_launch_permute(d_exp, T, E, k, d_counts, d_offsets, d_rank, d_slot,
                                                d_perm, cs),
           "permutation kernel launch");
    QM__CU(c,
           cudaMemcpyAsync(p->host_res, p->res, (2 * TK + E) * 4, cudaMemcpyDeviceToHost, cs),
           "cudaMemcpyAsync (routes)");
    QM__CU(c, cudaStreamSynchronize(cs), "routing kernels");

    const uint32_t *h_exp = p->host_res;
    const float *h_w = (const float *)(h_exp + TK);
    p->counts = (uint32_t *)(h_w + TK);
    memcpy(rq->experts, h_exp, TK * 4);
    memcpy(rq->weights, h_w, TK * 4);
    if (rq->counts) memcpy(rq->counts, p->counts, (size_t)E * 4);
    uint32_t sum = 0;
    for (uint32_t e = 0; e < E; e++) {
        p->offsets[e] = sum;
        sum += p->counts[e];
        p->ran[e] = 0;
    }
    p->offsets[E] = sum;
    if (sum > TK) {
        rc = qm_status_set(st, QM_EINTERNAL, "route: %u routes counted for %zu", sum, TK);
        goto fail;
    }
    p->n_active = sum;
    c->stats.routes++;
    *pass_out = p;
    return qm__cuda_unlock_run(c, 0);

fail: /* the pass goes back to the pool */
    p->next = c->pass_pool;
    c->pass_pool = p;
    return qm__cuda_unlock_run(c, rc);
}

/* Jobs laid out as the pass's rows: a run is a sequence of jobs whose rows
 * follow each other in y (the engine's waves take consecutive experts, so
 * one run per wave); each run is one FC1/act/FC2 launch set. */
int qm__cuda_run_routed(void *ctx, void *pass, const qm_expert_batch *batch, qm_status *st)
{
    qm__cuda_ctx *c = ctx;
    qm__cuda_pass *p = pass;
    int rc = qm__cuda_enter(c, st);
    if (rc < 0) return rc;
    if (!p || !batch || !batch->config || !batch->layer || (batch->n_jobs && !batch->jobs))
        return qm_status_set(st, QM_EINVAL, "run_routed: incomplete batch");
    const qm_bank_config *cfg = batch->config;
    const qm_layer_view *lv = batch->layer;
    if (cfg->experts != p->n_experts || cfg->k != p->k || cfg->hidden != p->hidden)
        return qm_status_set(st, QM_EINVAL, "run_routed: the batch's layer is not the pass's");
    qm__cuda_geom g;
    if ((rc = qm__cuda_geom_of(cfg, lv, &g, st)) < 0) return rc;
    const uint32_t H = cfg->hidden, I = cfg->inter;
    uint32_t n_active = 0, max_run = 0, run_rows = 0;
    uint32_t prev_end = UINT32_MAX;
    for (size_t j = 0; j < batch->n_jobs; j++) {
        const qm_expert_job *job = &batch->jobs[j];
        if (job->expert >= p->n_experts)
            return qm_status_set(st, QM_EINVAL, "run_routed: expert %u of %u", job->expert,
                                 p->n_experts);
        if (job->n_rows != p->counts[job->expert])
            return qm_status_set(st, QM_EINVAL,
                                 "run_routed: job for expert %u has %u rows, the routing %u",
                                 job->expert, job->n_rows, p->counts[job->expert]);
        if (job->n_rows == 0) continue;
        if ((rc = qm__cuda_check_job(&g, lv, job, st)) < 0) return rc;
        uint32_t first = p->offsets[job->expert];
        run_rows = first == prev_end ? run_rows + job->n_rows : job->n_rows;
        if (run_rows > max_run) max_run = run_rows;
        prev_end = first + job->n_rows;
        n_active++;
    }
    if (n_active == 0) return 0;

    pthread_mutex_lock(&c->run_lock);
    if ((rc = qm__cuda_reserve(c, (void **)&p->y, &p->y_cap, (size_t)p->n_active * H, 4, 0, st)) <
            0 ||
        (rc = qm__cuda_reserve(c, (void **)&p->jobs, &p->jobs_cap, n_active, sizeof(qm__cuda_job),
                               0, st)) < 0 ||
        (rc = qm__cuda_reserve(c, (void **)&p->h1, &p->h1_cap, (size_t)max_run * g.n1, 4, 0, st)) <
            0 ||
        (g.use_fc3 &&
         (rc = qm__cuda_reserve(c, (void **)&p->h3, &p->h3_cap, (size_t)max_run * I, 4, 0, st)) <
             0) ||
        (rc = qm__cuda_reserve(c, (void **)&p->a, &p->a_cap, (size_t)max_run * I, 4, 0, st)) < 0 ||
        (rc = qm__cuda_reserve(c, &p->host_jobs, &p->host_jobs_cap,
                               (size_t)n_active * sizeof(qm__cuda_job), 1, 1, st)) < 0)
        goto fail;

    /* The whole table first (vec16 depends on every job's pointers, as in
     * run_experts), each entry's row0 relative to the start of its run. */
    qm__cuda_job *hjobs = p->host_jobs;
    int vec16[QM__CUDA_MATS];
    memcpy(vec16, g.vec16, sizeof vec16);
    uint32_t a = 0, base = 0, end = UINT32_MAX;
    for (size_t j = 0; j < batch->n_jobs; j++) {
        const qm_expert_job *job = &batch->jobs[j];
        if (job->n_rows == 0) continue;
        const uint32_t first = p->offsets[job->expert];
        if (first != end) base = first; /* a new run */
        qm__cuda_fill_job(&g, lv, job, &hjobs[a], vec16);
        hjobs[a].row0 = first - base;
        hjobs[a].n_rows = job->n_rows;
        end = first + job->n_rows;
        a++;
    }
    cudaStream_t cs = c->compute_stream;
    QM__CU(c,
           cudaMemcpyAsync(p->jobs, hjobs, (size_t)n_active * sizeof *hjobs,
                           cudaMemcpyHostToDevice, cs),
           "cudaMemcpyAsync (job table)");
    const uint32_t *perm = p->idx + 2 * (size_t)p->n_tokens * p->k;
    uint32_t start = 0;
    while (start < n_active) {
        /* The run [start, stop): entries whose row0 keeps growing from 0. */
        uint32_t stop = start + 1, lo = hjobs[start].n_rows, hi = lo;
        uint32_t rows = hjobs[start].n_rows;
        while (stop < n_active && hjobs[stop].row0 == rows && hjobs[stop].row0 != 0) {
            rows += hjobs[stop].n_rows;
            if (hjobs[stop].n_rows < lo) lo = hjobs[stop].n_rows;
            if (hjobs[stop].n_rows > hi) hi = hjobs[stop].n_rows;
            stop++;
        }
        /* Its base row in y: the first job's rows start there. */
        uint32_t run_base = 0;
        for (size_t j = 0, idx = 0; j < batch->n_jobs; j++) {
            if (batch->jobs[j].n_rows == 0) continue;
            if (idx++ == start) {
                run_base = p->offsets[batch->jobs[j].expert];
                break;
            }
        }
        /* Runs reuse h1/a: the stream orders each after the previous one. */
        rc = qm__cuda_launch_ffn(c, &g, vec16, p->jobs + start, stop - start, lo, hi, rows, p->x,
                                 perm + run_base, H, p->h1, p->h3, p->a,
                                 p->y + (size_t)run_base * H, p->tc, cs, st);
        if (rc < 0) goto fail;
        start = stop;
    }
    QM__CU(c, cudaStreamSynchronize(cs), "expert kernels (routed)");
    for (size_t j = 0; j < batch->n_jobs; j++)
        p->ran[batch->jobs[j].expert] = 1;
    c->stats.batches++;
    rc = 0;
fail:
    return qm__cuda_unlock_run(c, rc);
}

int qm__cuda_combine(void *ctx, void *pass, float *out, qm_status *st)
{
    qm__cuda_ctx *c = ctx;
    qm__cuda_pass *p = pass;
    int rc = qm__cuda_enter(c, st);
    if (rc < 0) return rc;
    if (!p || !out) return qm_status_set(st, QM_EINVAL, "combine: no pass or output");
    for (uint32_t e = 0; e < p->n_experts; e++) {
        if (p->counts[e] && !p->ran[e])
            return qm_status_set(st, QM_EINVAL, "combine: expert %u's %u rows were never run", e,
                                 p->counts[e]);
    }
    const uint32_t T = p->n_tokens, H = p->hidden;
    const size_t TK = (size_t)T * p->k;
    const float *d_w = (const float *)((const uint32_t *)p->res + TK);
    const uint32_t *d_slot = p->idx + TK;
    pthread_mutex_lock(&c->run_lock);
    cudaStream_t cs = c->compute_stream;
    if (p->n_active == 0) {
        /* Every route dropped: nothing was run and y was never allocated. */
        memset(out, 0, (size_t)T * H * 4);
        return qm__cuda_unlock_run(c, 0);
    }
    /* The output overwrites x, which no later call of this pass reads. */
    QM__CU(c,
           (cudaError_t)qm__cuda_launch_combine(p->y, d_slot, d_w, T, p->k, H, p->x, cs),
           "combine kernel launch");
    QM__CU(c, cudaMemcpyAsync(p->host_io, p->x, (size_t)T * H * 4, cudaMemcpyDeviceToHost, cs),
           "cudaMemcpyAsync (output)");
    QM__CU(c, cudaStreamSynchronize(cs), "combine kernel");
    memcpy(out, p->host_io, (size_t)T * H * 4);
    rc = 0;
fail:
    return qm__cuda_unlock_run(c, rc);
}
