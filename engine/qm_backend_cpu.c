/* qm_backend_cpu.c - the CPU backend: a host arena as "device memory",
 * memcpy as the copy path, and expert FFNs on a persistent thread pool.
 *
 * run_experts works in four phases (prepare inputs, FC1/FC3, activation,
 * FC2), each split into tasks by job and by fixed 16-row output tiles.
 * A task owns whole output elements and no reduction is ever split, so the
 * bits of every output are the same whatever the thread count or the
 * order in which tasks run. */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <pthread.h>

#include "qm_alloc.h"
#include "qm_backend_impl.h"
#include "qm_kernels.h"
#include "qm_threadpool.h"

#define QM__CPU_ALIGN 64u

typedef struct qm__cpu {
    unsigned threads;
    qm__pool *pool;
    const qm__kernel *kernel;
    const qm__i8kernel *i8; /* fast mode */
    pthread_mutex_t lock; /* one run_experts at a time: the scratch below is shared */
    float *scratch;
    size_t scratch_floats;
    void *scratch_raw;
    void *tasks;
    size_t tasks_cap;
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
    if (qm_add_u64(bytes, QM__CPU_ALIGN, &total) < 0 || total > SIZE_MAX)
        return qm_status_set(st, QM_ENOMEM, "arena of %llu bytes does not fit in memory",
                             (unsigned long long)bytes);
    /* qm_malloc (not aligned_alloc) so allocation-failure tests reach it; aligned by hand. */
    void *raw = qm_malloc((size_t)total);
    if (!raw)
        return qm_status_set(st, QM_ENOMEM, "cannot allocate a host arena of %llu bytes",
                             (unsigned long long)bytes);
    uintptr_t p = ((uintptr_t)raw + QM__CPU_ALIGN - 1) & ~(uintptr_t)(QM__CPU_ALIGN - 1);
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

/* ---- expert FFNs ---- */

typedef struct qm__task {
    uint32_t job, tile;
    uint32_t mat; /* 1 = fc1, 3 = fc3, 2 = fc2 */
} qm__task;

typedef struct qm__job_geo {
    qm__qmat fc1, fc2, fc3;
    const void *b1, *b2, *b3;
    int gemm;
    size_t xrow;   /* first prepared row (padded) */
    size_t hrow;   /* first unpadded row */
    uint32_t xrows; /* prepared rows incl. padding */
} qm__job_geo;

typedef struct qm__run {
    qm__cpu *cx;
    const qm_expert_batch *b;
    const qm__kernel *k;
    const qm__i8kernel *i8; /* non-NULL: fast mode (int8 activations) */
    uint32_t H, I, N1;
    int swiglu, has_fc3;
    qm_dtype b1_dt, b2_dt, b3_dt;
    qm__job_geo *geo;
    float *X, *H1, *H3, *A, *Y2, *wscratch;
    size_t ldx, lda, ws_floats;
    qm__task *tasks;
} qm__run;

static int qm__make_qmat(const qm_bank_config *cfg, const qm_layer_view *lv, int wt,
                         const qm_expert_weights *w, uint32_t n, uint32_t k, qm__qmat *m,
                         qm_status *st)
{
    const qm_tensor_view *tw = &lv->t[wt], *ts = &lv->t[wt + 1], *tz = &lv->t[wt + 2];
    static const char *const names[] = {[QM_T_FC1_WEIGHT] = "fc1.weight",
                                        [QM_T_FC2_WEIGHT] = "fc2.weight",
                                        [QM_T_FC3_WEIGHT] = "fc3.weight"};
    const char *name = names[wt];
    if (!tw->present || !ts->present || !w->ptr[wt] || !w->ptr[wt + 1])
        return qm_status_set(st, QM_EINVAL, "layer %u: %s or its scales missing", lv->index, name);
    memset(m, 0, sizeof *m);
    m->bits = cfg->bits;
    if (m->bits != 4 && m->bits != 8)
        return qm_status_set(st, QM_EUNSUPPORTED, "layer %u: %u-bit weights are not supported",
                             lv->index, m->bits);
    m->n = n;
    m->k = k;
    m->w = w->ptr[wt];
    m->row_bytes = tw->ndim == 3 ? (size_t)tw->shape[2] : 0;
    if (tw->ndim != 3 || tw->shape[1] != n || m->row_bytes * 8 < (size_t)k * m->bits)
        return qm_status_set(st, QM_EINVAL, "layer %u: %s shape does not hold [E, %u, %u cols]",
                             lv->index, name, n, k);
    m->scales = w->ptr[wt + 1];
    m->scale_dtype = ts->dtype;
    if (ts->dtype != QM_DTYPE_F32 && ts->dtype != QM_DTYPE_F16 && ts->dtype != QM_DTYPE_BF16)
        return qm_status_set(st, QM_EINVAL, "layer %u: %s scales must be f32/f16/bf16",
                             lv->index, name);
    m->nblk = ts->ndim == 3 ? (uint32_t)ts->shape[2] : 1;
    if (m->nblk <= 1) {
        m->nblk = 1;
        m->block = k;
    } else {
        uint32_t bs = cfg->block_size;
        if (bs < 16 || (bs & (bs - 1)) || m->nblk != (k + bs - 1) / bs)
            return qm_status_set(st, QM_EINVAL,
                                 "layer %u: %s has %u scale blocks, block_size %u, %u columns",
                                 lv->index, name, m->nblk, bs, k);
        m->block = bs;
    }
    if (tz->present && w->ptr[wt + 2]) {
        m->zp = w->ptr[wt + 2];
        m->zp_blockwise = tz->ndim == 3;
        m->zp_row_bytes = m->zp_blockwise ? (size_t)tz->shape[2] : 0;
        uint32_t pack = 8 / m->bits;
        if (m->zp_blockwise && m->zp_row_bytes * pack < m->nblk)
            return qm_status_set(st, QM_EINVAL, "layer %u: %s zero points too short", lv->index,
                                 name);
    }
    return 0;
}

static void qm__add_bias(float *row, const void *bias, qm_dtype dt, uint32_t n0, uint32_t n1)
{
    if (!bias)
        return;
    for (uint32_t n = n0; n < n1; n++)
        row[n] += qm__load_float(bias, dt, n);
}

static inline float qm__sigmoid(float z)
{
    return 1.0f / (1.0f + expf(-z));
}

/* Activation of one row: h1 [N1] (and h3 [I] for unfused swiglu) -> a [I]. */
static void qm__activate(const qm_bank_config *cfg, const float *h1, const float *h3, uint32_t I,
                         float *a)
{
    switch (cfg->activation) {
    case QM_ACT_RELU:
        for (uint32_t i = 0; i < I; i++)
            a[i] = h1[i] > 0.0f ? h1[i] : 0.0f;
        break;
    case QM_ACT_GELU:
        for (uint32_t i = 0; i < I; i++) {
            float h = h1[i];
            a[i] = 0.5f * h * (1.0f + tanhf(0.7978845608028654f * (h + 0.044715f * h * h * h)));
        }
        break;
    case QM_ACT_SILU:
        for (uint32_t i = 0; i < I; i++)
            a[i] = h1[i] * qm__sigmoid(h1[i]);
        break;
    case QM_ACT_SWIGLU:
        for (uint32_t i = 0; i < I; i++) {
            float g, l;
            if (cfg->swiglu_fusion == 1) {
                g = h1[2 * i];
                l = h1[2 * i + 1];
            } else if (cfg->swiglu_fusion == 2) {
                g = h1[i];
                l = h1[I + i];
            } else {
                g = h1[i];
                l = h3[i];
            }
            float G = fminf(g, cfg->limit);
            float L = fmaxf(fminf(l, cfg->limit), -cfg->limit);
            a[i] = G * qm__sigmoid(cfg->alpha * G) * (L + cfg->beta);
        }
        break;
    case QM_ACT_IDENTITY:
    default:
        memcpy(a, h1, (size_t)I * sizeof(float));
        break;
    }
}

static void qm__phase_prep(void *arg, size_t j, unsigned worker)
{
    qm__run *R = arg;
    const qm_expert_job *job = &R->b->jobs[j];
    qm__job_geo *g = &R->geo[j];
    (void)worker;
    for (uint32_t r = 0; r < g->xrows; r++) {
        float *dst = R->X + (g->xrow + r) * R->ldx;
        if (r < job->n_rows && R->i8)
            qm__i8_prep(&g->fc1, R->b->x + (size_t)job->rows[r] * R->H, dst);
        else if (r < job->n_rows)
            R->k->prep(&g->fc1, g->gemm, R->b->x + (size_t)job->rows[r] * R->H, dst);
        else
            memset(dst, 0, R->ldx * sizeof(float));
    }
}

static void qm__run_matrix(qm__run *R, const qm__qmat *m, int gemm, uint32_t n0, uint32_t n1,
                           const float *xp, size_t ldx, uint32_t nx, float *y, size_t ldy,
                           float *scratch)
{
    if (R->i8)
        R->i8->mm(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
    else if (gemm)
        R->k->gemm(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
    else
        R->k->gemv(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
}

static void qm__phase_fc1(void *arg, size_t t, unsigned worker)
{
    qm__run *R = arg;
    const qm__task *task = &R->tasks[t];
    const qm_expert_job *job = &R->b->jobs[task->job];
    qm__job_geo *g = &R->geo[task->job];
    const qm__qmat *m = task->mat == 3 ? &g->fc3 : &g->fc1;
    float *out = task->mat == 3 ? R->H3 : R->H1;
    size_t ldy = task->mat == 3 ? R->I : R->N1;
    const void *bias = task->mat == 3 ? g->b3 : g->b1;
    qm_dtype bdt = task->mat == 3 ? R->b3_dt : R->b1_dt;
    uint32_t n0 = task->tile * QM__TILE_ROWS;
    uint32_t n1 = n0 + QM__TILE_ROWS < m->n ? n0 + QM__TILE_ROWS : m->n;
    float *y = out + g->hrow * ldy;
    qm__run_matrix(R, m, g->gemm, n0, n1, R->X + g->xrow * R->ldx, R->ldx, job->n_rows, y, ldy,
                   R->wscratch + worker * R->ws_floats);
    for (uint32_t r = 0; r < job->n_rows; r++)
        qm__add_bias(y + r * ldy, bias, bdt, n0, n1);
}

static void qm__phase_act(void *arg, size_t j, unsigned worker)
{
    qm__run *R = arg;
    const qm_expert_job *job = &R->b->jobs[j];
    qm__job_geo *g = &R->geo[j];
    /* The natural-order activation row lives after the kernel scratch. */
    float *a = R->wscratch + worker * R->ws_floats + (R->ws_floats - R->I);
    for (uint32_t r = 0; r < g->xrows; r++) {
        float *dst = R->A + (g->xrow + r) * R->lda;
        if (r < job->n_rows) {
            const float *h1 = R->H1 + (g->hrow + r) * R->N1;
            const float *h3 = R->has_fc3 ? R->H3 + (g->hrow + r) * R->I : NULL;
            qm__activate(R->b->config, h1, h3, R->I, a);
            if (R->i8)
                qm__i8_prep(&g->fc2, a, dst);
            else
                R->k->prep(&g->fc2, g->gemm, a, dst);
        } else {
            memset(dst, 0, R->lda * sizeof(float));
        }
    }
}

static void qm__phase_fc2(void *arg, size_t t, unsigned worker)
{
    qm__run *R = arg;
    const qm__task *task = &R->tasks[t];
    const qm_expert_job *job = &R->b->jobs[task->job];
    qm__job_geo *g = &R->geo[task->job];
    uint32_t n0 = task->tile * QM__TILE_ROWS;
    uint32_t n1 = n0 + QM__TILE_ROWS < R->H ? n0 + QM__TILE_ROWS : R->H;
    float *y2 = R->Y2 + g->hrow * R->H;
    qm__run_matrix(R, &g->fc2, g->gemm, n0, n1, R->A + g->xrow * R->lda, R->lda, job->n_rows, y2,
                   R->H, R->wscratch + worker * R->ws_floats);
    for (uint32_t r = 0; r < job->n_rows; r++) {
        float *dst = R->b->y + (size_t)job->out_index[r] * R->H;
        const float *src = y2 + (size_t)r * R->H;
        for (uint32_t n = n0; n < n1; n++)
            dst[n] = src[n] + (g->b2 ? qm__load_float(g->b2, R->b2_dt, n) : 0.0f);
    }
}

/* Grows the shared scratch; contents are not kept. */
static int qm__cpu_reserve(qm__cpu *cx, size_t floats, size_t tasks)
{
    if (floats > cx->scratch_floats) {
        qm_free(cx->scratch_raw);
        cx->scratch = NULL;
        cx->scratch_floats = 0;
        cx->scratch_raw = NULL;
        if (floats > (SIZE_MAX - QM__CPU_ALIGN) / sizeof(float))
            return QM_ENOMEM;
        void *raw = qm_malloc(floats * sizeof(float) + QM__CPU_ALIGN);
        if (!raw)
            return QM_ENOMEM;
        cx->scratch_raw = raw;
        cx->scratch = (float *)(((uintptr_t)raw + QM__CPU_ALIGN - 1) &
                                ~(uintptr_t)(QM__CPU_ALIGN - 1));
        cx->scratch_floats = floats;
    }
    if (tasks > cx->tasks_cap) {
        void *t = qm_realloc(cx->tasks, tasks * sizeof(qm__task));
        if (!t)
            return QM_ENOMEM;
        cx->tasks = t;
        cx->tasks_cap = tasks;
    }
    return 0;
}

static size_t qm__round_up(size_t v, size_t m)
{
    return (v + m - 1) / m * m;
}

static size_t qm__max3(size_t a, size_t b, size_t c)
{
    size_t m = a > b ? a : b;
    return m > c ? m : c;
}

static int qm__cpu_run_experts(void *vctx, const qm_expert_batch *b, qm_status *st)
{
    qm__cpu *cx = vctx;
    const qm_bank_config *cfg = b->config;
    const qm_layer_view *lv = b->layer;
    int rc = 0;
    if (!cfg || !lv || (!b->x && b->n_tokens) || !b->y)
        return qm_status_set(st, QM_EINVAL, "run_experts: batch lacks config, layer, x or y");
    qm__run R = {.cx = cx, .b = b, .k = cx->kernel, .H = cfg->hidden, .I = cfg->inter};
    R.swiglu = cfg->activation == QM_ACT_SWIGLU;
    R.has_fc3 = R.swiglu && cfg->swiglu_fusion == 0;
    R.N1 = R.swiglu && !R.has_fc3 ? 2 * R.I : R.I;
    if (R.swiglu && cfg->swiglu_fusion > 2)
        return qm_status_set(st, QM_EINVAL, "swiglu_fusion %u is not 0, 1 or 2",
                             cfg->swiglu_fusion);
    /* Fast mode needs weight blocks of whole 32-column sub-blocks; other
     * layouts (blocks of 16) run exact. */
    if (b->precision == QM_PRECISION_FAST && cx->i8 &&
        (cfg->block_size == 0 || cfg->block_size % 32 == 0 ||
         lv->t[QM_T_FC1_WEIGHT + 1].ndim != 3))
        R.i8 = cx->i8;
    R.b1_dt = lv->t[QM_T_FC1_BIAS].dtype;
    R.b2_dt = lv->t[QM_T_FC2_BIAS].dtype;
    R.b3_dt = lv->t[QM_T_FC3_BIAS].dtype;

    R.geo = qm_calloc(b->n_jobs, sizeof *R.geo);
    if (!R.geo)
        return qm_status_set(st, QM_ENOMEM, "out of memory for %zu expert jobs", b->n_jobs);

    /* Geometry of every job, and the scratch it needs. */
    size_t xrows = 0, hrows = 0, n_tasks1 = 0, n_tasks2 = 0, ws = 0;
    const uint32_t pad = cx->kernel->gemm_row_pad;
    for (size_t j = 0; j < b->n_jobs; j++) {
        const qm_expert_job *job = &b->jobs[j];
        qm__job_geo *g = &R.geo[j];
        if (job->expert >= cfg->experts || (job->n_rows && (!job->rows || !job->out_index))) {
            rc = qm_status_set(st, QM_EINVAL, "job %zu: expert %u out of range or rows missing",
                               j, job->expert);
            goto done;
        }
        for (uint32_t r = 0; r < job->n_rows; r++) {
            if (job->rows[r] >= b->n_tokens) {
                rc = qm_status_set(st, QM_EINVAL, "job %zu: row %u >= %u tokens", j,
                                   job->rows[r], b->n_tokens);
                goto done;
            }
        }
        rc = qm__make_qmat(cfg, lv, QM_T_FC1_WEIGHT, &job->weights, R.N1, R.H, &g->fc1, st);
        if (rc == 0)
            rc = qm__make_qmat(cfg, lv, QM_T_FC2_WEIGHT, &job->weights, R.H, R.I, &g->fc2, st);
        if (rc == 0 && R.has_fc3)
            rc = qm__make_qmat(cfg, lv, QM_T_FC3_WEIGHT, &job->weights, R.I, R.H, &g->fc3, st);
        if (rc < 0)
            goto done;
        g->b1 = lv->t[QM_T_FC1_BIAS].present ? job->weights.ptr[QM_T_FC1_BIAS] : NULL;
        g->b2 = lv->t[QM_T_FC2_BIAS].present ? job->weights.ptr[QM_T_FC2_BIAS] : NULL;
        g->b3 = lv->t[QM_T_FC3_BIAS].present ? job->weights.ptr[QM_T_FC3_BIAS] : NULL;
        g->gemm = job->n_rows > QM__GEMV_MAX_ROWS;
        g->xrows = g->gemm && !R.i8 ? (uint32_t)qm__round_up(job->n_rows, pad) : job->n_rows;
        g->xrow = xrows;
        g->hrow = hrows;
        xrows += g->xrows;
        hrows += job->n_rows;
        if (job->n_rows) {
            n_tasks1 += (R.N1 + QM__TILE_ROWS - 1) / QM__TILE_ROWS;
            if (R.has_fc3)
                n_tasks1 += (R.I + QM__TILE_ROWS - 1) / QM__TILE_ROWS;
            n_tasks2 += (R.H + QM__TILE_ROWS - 1) / QM__TILE_ROWS;
        }
        ws = qm__max3(ws, qm__kernel_scratch_floats(&g->fc1), qm__kernel_scratch_floats(&g->fc2));
        if (R.has_fc3)
            ws = qm__max3(ws, qm__kernel_scratch_floats(&g->fc3), 0);
    }
    if (hrows == 0)
        goto done;
    {
        const qm__qmat *m1 = &R.geo[0].fc1, *m2 = &R.geo[0].fc2;
        if (R.i8) {
            R.ldx = qm__round_up(qm__max3(qm__i8_x_stride(m1), 1, 1), 16);
            R.lda = qm__round_up(qm__max3(qm__i8_x_stride(m2), 1, 1), 16);
        } else {
            R.ldx = qm__round_up(qm__max3(cx->kernel->x_stride(m1, 0), cx->kernel->x_stride(m1, 1), 1), 16);
            R.lda = qm__round_up(qm__max3(cx->kernel->x_stride(m2, 0), cx->kernel->x_stride(m2, 1), 1), 16);
        }
        R.ws_floats = qm__round_up(ws + R.I, 16);
        size_t off_x = 0, off_h1 = off_x + xrows * R.ldx;
        size_t off_h3 = off_h1 + hrows * R.N1;
        size_t off_a = off_h3 + (R.has_fc3 ? hrows * R.I : 0);
        size_t off_y2 = off_a + xrows * R.lda;
        size_t off_ws = off_y2 + hrows * R.H;
        size_t total = off_ws + (size_t)cx->threads * R.ws_floats;
        size_t max_tasks = n_tasks1 > n_tasks2 ? n_tasks1 : n_tasks2;
        if (qm__cpu_reserve(cx, total, max_tasks) < 0) {
            rc = qm_status_set(st, QM_ENOMEM, "out of memory for %zu floats of expert scratch",
                               total);
            goto done;
        }
        float *s = cx->scratch;
        R.X = s + off_x;
        R.H1 = s + off_h1;
        R.H3 = s + off_h3;
        R.A = s + off_a;
        R.Y2 = s + off_y2;
        R.wscratch = s + off_ws;
        R.tasks = cx->tasks;
    }

    qm__pool_run(cx->pool, b->n_jobs, qm__phase_prep, &R);
    size_t nt = 0;
    for (size_t j = 0; j < b->n_jobs; j++) {
        if (!b->jobs[j].n_rows)
            continue;
        for (uint32_t t = 0; t * QM__TILE_ROWS < R.N1; t++)
            R.tasks[nt++] = (qm__task){.job = (uint32_t)j, .tile = t, .mat = 1};
        for (uint32_t t = 0; R.has_fc3 && t * QM__TILE_ROWS < R.I; t++)
            R.tasks[nt++] = (qm__task){.job = (uint32_t)j, .tile = t, .mat = 3};
    }
    qm__pool_run(cx->pool, nt, qm__phase_fc1, &R);
    qm__pool_run(cx->pool, b->n_jobs, qm__phase_act, &R);
    nt = 0;
    for (size_t j = 0; j < b->n_jobs; j++) {
        if (!b->jobs[j].n_rows)
            continue;
        for (uint32_t t = 0; t * QM__TILE_ROWS < R.H; t++)
            R.tasks[nt++] = (qm__task){.job = (uint32_t)j, .tile = t, .mat = 2};
    }
    qm__pool_run(cx->pool, nt, qm__phase_fc2, &R);
done:
    qm_free(R.geo);
    return rc;
}

static int qm__cpu_run_locked(void *vctx, const qm_expert_batch *b, qm_status *st)
{
    qm__cpu *cx = vctx;
    pthread_mutex_lock(&cx->lock);
    int rc = qm__cpu_run_experts(vctx, b, st);
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
    qm_free(cx->scratch_raw);
    qm_free(cx->tasks);
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
    pthread_mutex_init(&cx->lock, NULL);
    atomic_init(&cx->arena_bytes, 0);
    atomic_init(&cx->copy_seq, 0);
    cx->threads = threads;
    cx->kernel = qm__kernel_select();
    cx->i8 = qm__i8kernel_select();
    snprintf(cx->name, sizeof cx->name, "cpu (%s; fast %s; %u threads)",
             qm__kernel_describe(cx->kernel), qm__i8kernel_describe(cx->i8), threads);
    if (qm__pool_new(threads, &cx->pool) < 0) {
        qm__cpu_destroy(cx);
        return qm_status_set(st, QM_ENOMEM, "cannot start %u CPU worker threads", threads);
    }
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
    .caps = QM_BACKEND_CAP_HOST,
    .open = qm__cpu_open,
};
