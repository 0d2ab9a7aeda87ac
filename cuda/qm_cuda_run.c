/* qm_cuda_run.c - run_experts on the device.
 *
 * One batch: x goes up once, with the job table (weight pointers, first
 * batch row, row count) and the token index of every batch row; FC1 (FC3),
 * activation and FC2 run as one launch each over all jobs; the batch rows
 * come back in one copy and the host scatters them to y + out_index * H.
 * The scratch behind this grows to the largest batch seen and is kept. */
#include <string.h>

#include "qm_alloc.h"
#include "qm_cuda_internal.h"

void qm__cuda_scratch_free(qm__cuda_scratch *s)
{
    void *dev[] = {s->x, s->h1, s->h3, s->a, s->y, s->rows, s->jobs};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) {
        if (dev[i]) (void)cudaFree(dev[i]);
    }
    void *host[] = {s->host_x, s->host_y, s->host_table};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) {
        if (host[i]) (void)cudaFreeHost(host[i]);
    }
    memset(s, 0, sizeof *s);
}

int qm__cuda_reserve(qm__cuda_ctx *c, void **buf, size_t *cap, size_t need, size_t size,
                     int pinned, qm_status *st)
{
    if (need <= *cap) return 0;
    size_t n = need + need / 4; /* headroom: slowly growing batches reallocate rarely */
    size_t bytes;
    if (__builtin_mul_overflow(n, size, &bytes))
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED, "run_experts scratch size overflows");
    if (*buf) {
        if (pinned)
            (void)cudaFreeHost(*buf);
        else
            (void)cudaFree(*buf);
        *buf = NULL;
        *cap = 0;
    }
    cudaError_t err = pinned ? cudaMallocHost(buf, bytes) : cudaMalloc(buf, bytes);
    if (err != cudaSuccess) {
        *buf = NULL;
        return qm__cuda_fail(c, err, st,
                             pinned ? "cudaMallocHost (run scratch)" : "cudaMalloc (run scratch)");
    }
    *cap = n;
    c->stats.scratch_grows++;
    return 0;
}

static int qm__is_real(qm_dtype d)
{
    return d == QM_DTYPE_F32 || d == QM_DTYPE_F16 || d == QM_DTYPE_BF16;
}

static uint32_t qm__cuda_dtype(qm_dtype d)
{
    return d == QM_DTYPE_F16 ? QM__CUDA_F16 : d == QM_DTYPE_BF16 ? QM__CUDA_BF16 : QM__CUDA_F32;
}

/* Geometry of matrix `first` (its weight tensor; scales, zero points and
 * bias follow in enum order) with n outputs and k inputs, cross-checked
 * against the layer's shapes: a mismatch would make the kernels read out of
 * bounds, so it is refused here. */
static int qm__cuda_describe(const qm_bank_config *cfg, const qm_layer_view *lv, int first,
                             uint32_t n, uint32_t k, qm__cuda_mat *m, qm_status *st)
{
    const qm_tensor_view *w = &lv->t[first], *s = &lv->t[first + 1], *zp = &lv->t[first + 2],
                         *b = &lv->t[first + 3];
    const char *what = qm_bank_tensor_suffix((qm_bank_tensor)first);
    uint32_t pack = 8 / cfg->bits;
    memset(m, 0, sizeof *m);
    m->n = n;
    m->k = k;
    m->bits = cfg->bits;
    m->codebook = cfg->codebook == QM_CODEBOOK_E2M1;
    m->row_bytes = (k + pack - 1) / pack;
    if (!w->present || !s->present)
        return qm_status_set(st, QM_EINVALID_MODEL, "layer %u lacks %s or its scales", lv->index,
                             what);
    if (w->ndim != 3 || w->shape[1] != n || w->shape[2] != m->row_bytes)
        return qm_status_set(
            st, QM_EINVALID_MODEL, "layer %u %s has shape [%llu, %llu, %llu], expected [E, %u, %u]",
            lv->index, what, (unsigned long long)w->shape[0], (unsigned long long)w->shape[1],
            (unsigned long long)w->shape[2], n, m->row_bytes);
    if (!qm__is_real(s->dtype) || (b->present && !qm__is_real(b->dtype)))
        return qm_status_set(st, QM_EINVALID_MODEL, "layer %u %s scales/bias dtype unsupported",
                             lv->index, what);
    m->scale_dtype = qm__cuda_dtype(s->dtype);
    m->bias_dtype = b->present ? qm__cuda_dtype(b->dtype) : QM__CUDA_F32;
    m->nblk = s->ndim == 3 ? (uint32_t)s->shape[2] : 1u;
    if (m->nblk > 1) {
        uint32_t bs = cfg->block_size;
        if (bs < 16 || (bs & (bs - 1)) != 0 || m->nblk != (k + bs - 1) / bs)
            return qm_status_set(st, QM_EINVALID_MODEL,
                                 "layer %u %s: %u scale blocks do not match block_size %u",
                                 lv->index, what, m->nblk, bs);
        m->block_shift = (uint32_t)__builtin_ctz(bs);
    }
    if (zp->present) {
        m->zp_blockwise = zp->ndim == 3;
        m->zp_row_bytes = m->zp_blockwise ? (uint32_t)zp->shape[2] : 0u;
        if (m->zp_blockwise && (uint64_t)m->zp_row_bytes * pack < m->nblk)
            return qm_status_set(st, QM_EINVALID_MODEL, "layer %u %s zero points too short",
                                 lv->index, what);
    }
    return 0;
}

static uint32_t qm__cuda_act_kind(qm_activation act)
{
    switch (act) {
    case QM_ACT_RELU:
        return QM__CUDA_ACT_RELU;
    case QM_ACT_GELU:
        return QM__CUDA_ACT_GELU;
    case QM_ACT_SILU:
        return QM__CUDA_ACT_SILU;
    case QM_ACT_SWIGLU:
        return QM__CUDA_ACT_SWIGLU;
    default:
        return QM__CUDA_ACT_IDENTITY;
    }
}

_Static_assert((int)QM_CUDA_KERNELS_GEMV == (int)QM__CUDA_PATH_GEMV &&
                   (int)QM_CUDA_KERNELS_GEMM == (int)QM__CUDA_PATH_GEMM &&
                   (int)QM_CUDA_KERNELS_NAIVE == (int)QM__CUDA_PATH_NAIVE,
               "qm_cuda_kernels and qm__cuda_path share their values");

static int qm__cuda_aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

int qm__cuda_geom_of(const qm_bank_config *cfg, const qm_layer_view *lv, qm__cuda_geom *g,
                     qm_status *st)
{
    memset(g, 0, sizeof *g);
    const uint32_t H = cfg->hidden, I = cfg->inter;
    if (cfg->bits != 2 && cfg->bits != 4 && cfg->bits != 8)
        return qm_status_set(st, QM_EUNSUPPORTED, "run_experts: %u-bit weights", cfg->bits);
    if (cfg->codebook && (cfg->codebook != QM_CODEBOOK_E2M1 || cfg->bits != 4))
        return qm_status_set(st, QM_EUNSUPPORTED, "run_experts: the %s code book on %u-bit codes",
                             qm_codebook_name(cfg->codebook), cfg->bits);
    if (H == 0 || I == 0)
        return qm_status_set(st, QM_EINVALID_MODEL, "run_experts: hidden %u, inter %u", H, I);
    const int swiglu = cfg->activation == QM_ACT_SWIGLU;
    g->use_fc3 = swiglu && cfg->swiglu_fusion == 0;
    g->n1 = (swiglu && !g->use_fc3) ? 2 * I : I;
    int rc;
    if ((rc = qm__cuda_describe(cfg, lv, QM_T_FC1_WEIGHT, g->n1, H, &g->mats[QM__CUDA_FC1], st)) <
            0 ||
        (rc = qm__cuda_describe(cfg, lv, QM_T_FC2_WEIGHT, H, I, &g->mats[QM__CUDA_FC2], st)) < 0)
        return rc;
    if (g->use_fc3 &&
        (rc = qm__cuda_describe(cfg, lv, QM_T_FC3_WEIGHT, I, H, &g->mats[QM__CUDA_FC3], st)) < 0)
        return rc;
    for (int m = 0; m < QM__CUDA_MATS; m++)
        g->vec16[m] = g->mats[m].row_bytes % 16 == 0 && g->mats[m].k % 4 == 0 &&
                      (uint64_t)g->mats[m].row_bytes * (8 / cfg->bits) == g->mats[m].k;
    g->act = (qm__cuda_act){
        .kind = qm__cuda_act_kind(cfg->activation),
        .fusion = cfg->swiglu_fusion,
        .inter = I,
        .h1_stride = g->n1,
        .alpha = cfg->alpha,
        .beta = cfg->beta,
        .limit = cfg->limit,
    };
    return 0;
}

int qm__cuda_check_job(const qm__cuda_geom *g, const qm_layer_view *lv, const qm_expert_job *job,
                       qm_status *st)
{
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        int needed = lv->t[t].present && (g->use_fc3 || t < QM_T_FC3_WEIGHT);
        if (needed && !job->weights.ptr[t])
            return qm_status_set(st, QM_EINVAL, "run_experts: expert %u has no %s pointer",
                                 job->expert, qm_bank_tensor_suffix((qm_bank_tensor)t));
    }
    return 0;
}

void qm__cuda_fill_job(const qm__cuda_geom *g, const qm_layer_view *lv, const qm_expert_job *job,
                       qm__cuda_job *dj, int vec16[QM__CUDA_MATS])
{
    memset(dj, 0, sizeof *dj);
    for (int m = 0; m < QM__CUDA_MATS; m++) {
        int first = m == QM__CUDA_FC1   ? QM_T_FC1_WEIGHT
                    : m == QM__CUDA_FC2 ? QM_T_FC2_WEIGHT
                                        : QM_T_FC3_WEIGHT;
        if (m == QM__CUDA_FC3 && !g->use_fc3) continue;
        dj->w[m] = job->weights.ptr[first];
        dj->scales[m] = job->weights.ptr[first + 1];
        dj->zp[m] = lv->t[first + 2].present ? job->weights.ptr[first + 2] : NULL;
        dj->bias[m] = lv->t[first + 3].present ? job->weights.ptr[first + 3] : NULL;
        if (!qm__cuda_aligned16(dj->w[m])) vec16[m] = 0;
    }
}

int qm__cuda_launch_ffn(qm__cuda_ctx *c, const qm__cuda_geom *g, const int vec16[QM__CUDA_MATS],
                        const qm__cuda_job *jobs_dev, uint32_t n_jobs, uint32_t min_rows,
                        uint32_t max_rows, uint32_t R, const float *x, const uint32_t *x_rows,
                        uint32_t hidden, float *h1, float *h3, float *a, float *y, int tc,
                        cudaStream_t cs, qm_status *st)
{
    int rc = 0;
    const uint32_t I = g->act.inter;
    qm__cuda_path path = (qm__cuda_path)c->kernels; /* the enums share their order */
    if (path == QM__CUDA_PATH_AUTO && tc) {
        path = tc == 2 ? QM__CUDA_PATH_AUTO_TC_BF16 : QM__CUDA_PATH_AUTO_TC_F16;
        if (max_rows >= c->gemm_min_rows) c->stats.tc_batches++;
    }
    QM__CU(c,
           (cudaError_t)qm__cuda_launch_matmul(jobs_dev, n_jobs, min_rows, max_rows, QM__CUDA_FC1,
                                               &g->mats[QM__CUDA_FC1], vec16[QM__CUDA_FC1], path,
                                               c->gemm_min_rows, x, x_rows, hidden, h1, g->n1, cs),
           "FC1 kernel launch");
    if (g->use_fc3)
        QM__CU(c,
               (cudaError_t)qm__cuda_launch_matmul(jobs_dev, n_jobs, min_rows, max_rows,
                                                   QM__CUDA_FC3, &g->mats[QM__CUDA_FC3],
                                                   vec16[QM__CUDA_FC3], path, c->gemm_min_rows, x,
                                                   x_rows, hidden, h3, I, cs),
               "FC3 kernel launch");
    QM__CU(c, (cudaError_t)qm__cuda_launch_activation(&g->act, R, h1, h3, a, cs),
           "activation kernel launch");
    QM__CU(c,
           (cudaError_t)qm__cuda_launch_matmul(jobs_dev, n_jobs, min_rows, max_rows, QM__CUDA_FC2,
                                               &g->mats[QM__CUDA_FC2], vec16[QM__CUDA_FC2], path,
                                               c->gemm_min_rows, a, NULL, I, y, hidden, cs),
           "FC2 kernel launch");
    return 0;
fail:
    return rc;
}

int qm__cuda_run_experts(void *ctx, const qm_expert_batch *batch, qm_status *st)
{
    qm__cuda_ctx *c = ctx;
    int rc = qm__cuda_enter(c, st);
    if (rc < 0) return rc;
    if (!batch || !batch->config || !batch->layer || (batch->n_jobs && !batch->jobs))
        return qm_status_set(st, QM_EINVAL, "run_experts: incomplete batch");
    const qm_bank_config *cfg = batch->config;
    const qm_layer_view *lv = batch->layer;
    const uint32_t H = cfg->hidden, I = cfg->inter;
    qm__cuda_geom g;
    if ((rc = qm__cuda_geom_of(cfg, lv, &g, st)) < 0) return rc;
    const uint32_t n1 = g.n1;
    const int use_fc3 = g.use_fc3;

    /* Count batch rows; validate every job before touching the device. */
    uint64_t total_rows = 0;
    uint32_t max_rows = 0, min_rows = UINT32_MAX, n_active = 0;
    for (size_t j = 0; j < batch->n_jobs; j++) {
        const qm_expert_job *job = &batch->jobs[j];
        if (job->n_rows == 0) continue;
        if (!job->rows || !job->out_index)
            return qm_status_set(st, QM_EINVAL, "run_experts: job %zu has no row lists", j);
        for (uint32_t r = 0; r < job->n_rows; r++) {
            if (job->rows[r] >= batch->n_tokens)
                return qm_status_set(st, QM_EINVAL, "run_experts: job %zu row %u is token %u of %u",
                                     j, r, job->rows[r], batch->n_tokens);
        }
        if ((rc = qm__cuda_check_job(&g, lv, job, st)) < 0) return rc;
        total_rows += job->n_rows;
        if (job->n_rows > max_rows) max_rows = job->n_rows;
        if (job->n_rows < min_rows) min_rows = job->n_rows;
        n_active++;
    }
    if (total_rows == 0) return 0;
    if (!batch->x || !batch->y) return qm_status_set(st, QM_EINVAL, "run_experts: NULL x or y");
    if (total_rows > UINT32_MAX / 2 || n_active > 65535)
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED,
                             "run_experts: %llu rows in %u jobs exceed one batch",
                             (unsigned long long)total_rows, n_active);
    const uint32_t R = (uint32_t)total_rows;

    pthread_mutex_lock(&c->run_lock);
    qm__cuda_scratch *s = &c->scratch;
    const size_t table_bytes = (size_t)n_active * sizeof(qm__cuda_job) + (size_t)R * 4;
    if ((rc = qm__cuda_reserve(c, (void **)&s->x, &s->x_cap, (size_t)batch->n_tokens * H, 4, 0,
                               st)) < 0 ||
        (rc = qm__cuda_reserve(c, (void **)&s->rows, &s->rows_cap, R, 4, 0, st)) < 0 ||
        (rc = qm__cuda_reserve(c, (void **)&s->jobs, &s->jobs_cap, n_active, sizeof(qm__cuda_job),
                               0, st)) < 0 ||
        (rc = qm__cuda_reserve(c, (void **)&s->h1, &s->h1_cap, (size_t)R * n1, 4, 0, st)) < 0 ||
        (use_fc3 &&
         (rc = qm__cuda_reserve(c, (void **)&s->h3, &s->h3_cap, (size_t)R * I, 4, 0, st)) < 0) ||
        (rc = qm__cuda_reserve(c, (void **)&s->a, &s->a_cap, (size_t)R * I, 4, 0, st)) < 0 ||
        (rc = qm__cuda_reserve(c, (void **)&s->y, &s->y_cap, (size_t)R * H, 4, 0, st)) < 0 ||
        (rc = qm__cuda_reserve(c, (void **)&s->host_x, &s->host_x_cap, (size_t)batch->n_tokens * H,
                               4, 1, st)) < 0 ||
        (rc = qm__cuda_reserve(c, (void **)&s->host_y, &s->host_y_cap, (size_t)R * H, 4, 1, st)) <
            0 ||
        (rc = qm__cuda_reserve(c, &s->host_table, &s->host_table_cap, table_bytes, 1, 1, st)) < 0)
        goto fail;

    /* Job table and the token of every batch row, in one pinned block. */
    qm__cuda_job *hjobs = s->host_table;
    uint32_t *hrows = (uint32_t *)((uint8_t *)s->host_table + (size_t)n_active * sizeof *hjobs);
    int vec16[QM__CUDA_MATS];
    memcpy(vec16, g.vec16, sizeof vec16);
    uint32_t row0 = 0, a = 0;
    for (size_t j = 0; j < batch->n_jobs; j++) {
        const qm_expert_job *job = &batch->jobs[j];
        if (job->n_rows == 0) continue;
        qm__cuda_job *dj = &hjobs[a++];
        qm__cuda_fill_job(&g, lv, job, dj, vec16);
        dj->row0 = row0;
        dj->n_rows = job->n_rows;
        memcpy(hrows + row0, job->rows, (size_t)job->n_rows * 4);
        row0 += job->n_rows;
    }
    memcpy(s->host_x, batch->x, (size_t)batch->n_tokens * H * 4);

    cudaStream_t cs = c->compute_stream;
    QM__CU(c,
           cudaMemcpyAsync(s->x, s->host_x, (size_t)batch->n_tokens * H * 4, cudaMemcpyHostToDevice,
                           cs),
           "cudaMemcpyAsync (x)");
    QM__CU(c,
           cudaMemcpyAsync(s->jobs, hjobs, (size_t)n_active * sizeof *hjobs, cudaMemcpyHostToDevice,
                           cs),
           "cudaMemcpyAsync (job table)");
    QM__CU(c, cudaMemcpyAsync(s->rows, hrows, (size_t)R * 4, cudaMemcpyHostToDevice, cs),
           "cudaMemcpyAsync (row index)");
    rc = qm__cuda_launch_ffn(c, &g, vec16, s->jobs, n_active, min_rows, max_rows, R, s->x, s->rows,
                             H, s->h1, s->h3, s->a, s->y, 0, cs, st);
    if (rc < 0) goto fail;
    QM__CU(c, cudaMemcpyAsync(s->host_y, s->y, (size_t)R * H * 4, cudaMemcpyDeviceToHost, cs),
           "cudaMemcpyAsync (y)");
    QM__CU(c, cudaStreamSynchronize(cs), "expert kernels");

    row0 = 0;
    for (size_t j = 0; j < batch->n_jobs; j++) {
        const qm_expert_job *job = &batch->jobs[j];
        for (uint32_t r = 0; r < job->n_rows; r++)
            memcpy(batch->y + (size_t)job->out_index[r] * H, s->host_y + (size_t)(row0 + r) * H,
                   (size_t)H * 4);
        row0 += job->n_rows;
    }
    c->stats.batches++;
    rc = 0;
fail:
    return qm__cuda_unlock_run(c, rc);
}
