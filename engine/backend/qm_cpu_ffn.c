/* qm_cpu_ffn.c - the CPU backend's expert FFNs: see qm_cpu_ffn.h. */
#include "qm_cpu_ffn.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_r8.h"

#define QM__CPU_ALIGN 64u
/* Fused schedule: at most this many 16-row tiles per task, and about this
 * many tasks per thread (fewer claims of the shared counter, still enough
 * to balance the threads). A task's rows are one stream of a matrix; the
 * threads claim tasks in turn, so a task is also how long each thread's
 * stream runs before it jumps: 16 tiles (96-256 KiB of 4-bit codes on the
 * fine-grained shapes) took 4-12% off every call of a Zen 4 core pair
 * against 4 tiles; on Zen 3 4-32 measured the same (the old
 * docs/BENCHMARKS.md, `git show 0eb56d2:docs/BENCHMARKS.md`: "A Zen 4 core
 * pair" and "Against ggml's repacked Q4_0, and an interleaved layout"). */
#define QM__MAX_TILES_PER_TASK 16u
#define QM__TASKS_PER_THREAD 32u
/* Pauses a waiting task spins before it sleeps (some tens of microseconds). */
#define QM__SPINS 1024u

enum { QM__TASK_TOKENS = 0, QM__TASK_PREP, QM__TASK_FC1, QM__TASK_FC3, QM__TASK_FC2, QM__TASK_ACT };

/* A task: `count` items from `first` of kind `kind` for job `job` (tiles
 * of a matrix; tokens of the used-token list for QM__TASK_TOKENS). */
typedef struct qm__task {
    uint32_t job, first, count;
    uint8_t kind;
} qm__task;

/* What the fused schedule's tasks wait for, per job. */
typedef struct qm__job_sync {
    atomic_int prepared;     /* the job's input rows are ready */
    atomic_uint fc1_left;    /* fc1/fc3 tasks not done; the last one runs the activation */
    atomic_int activated;    /* the job's fc2 input rows are ready */
} qm__job_sync;

typedef struct qm__job_geo {
    qm__qmat fc1, fc2, fc3;
    const void *b1, *b2, *b3;
    int gemm;
    size_t xrow;   /* first prepared row (padded) */
    size_t hrow;   /* first unpadded row */
    uint32_t xrows; /* prepared rows incl. padding */
} qm__job_geo;

typedef struct qm__run {
    qm__cpu_ffn *f;
    const qm_expert_batch *b;
    const qm__kernel *k;
    const qm__i8kernel *i8; /* non-NULL: fast mode (int8 activations) */
    int cb4;                /* a code book read in 4 bits (qm__cb_native) */
    uint32_t H, I, N1;
    int swiglu, has_fc3;
    qm_dtype b1_dt, b2_dt, b3_dt;
    qm__job_geo *geo;
    float *X, *H1, *H3, *A, *Y2, *wscratch;
    size_t ldx, lda, ws_floats;
    qm__task *tasks;
    /* Fused schedule */
    qm__job_sync *sync;
    /* Fast mode, fused: each token used by a job quantised once into TX. */
    float *TX;
    size_t tx_floats;    /* floats qm__i8_prep writes per row */
    uint32_t *tok_slot;  /* [n_tokens] row of TX, UINT32_MAX when unused */
    uint32_t *tok_used;  /* [n_used] the tokens, ascending */
    uint32_t n_used;
    atomic_uint tokens_left; /* QM__TASK_TOKENS tasks not done */
    /* The call's combine (qm_combine), when this run holds every route:
     * fc2's rows in ranges of `range_tiles` tiles, every job's range r
     * alike; the task that finishes range r's last job sums its columns,
     * while they are in cache. */
    qm_combine *combine;
    uint32_t range_tiles;
    atomic_uint *range_left; /* [ranges]: jobs whose fc2 tiles there are not done */
} qm__run;

int qm__cpu_schedule_from_env(void)
{
    const char *s = getenv("QMOE_CPU_SCHEDULE");
    return s && strcmp(s, "phased") == 0 ? QM__CPU_SCHEDULE_PHASED : QM__CPU_SCHEDULE_FUSED;
}

static int qm__make_qmat(const qm_bank_config *cfg, const qm_layer_view *lv, int wt,
                         const qm_expert_weights *w, uint32_t n, uint32_t k, int cb4, qm__qmat *m,
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
    if (cfg->codebook) {
        /* Read in 4 bits by the fast GEMV, or as the 8-bit matrix of the
         * same weights by any kernel (qm__qmat.cb). */
        m->cb = qm_codebook_values(cfg->codebook);
        if (!m->cb || m->bits != 4 || tz->present)
            return qm_status_set(st, QM_EINVAL, "layer %u: %s: a code book needs 4-bit codes "
                                 "and no zero points", lv->index, name);
        if (!cb4)
            m->bits = 8;
    }
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
    m->r8 = (int)((w->r8 >> wt) & 1u);
    m->r8_rows = !m->r8 && w->r8_part == (uint32_t)wt && w->r8_part_rows < n ? w->r8_part_rows : 0;
    if (m->r8_rows % QM__TILE_ROWS)
        return qm_status_set(st, QM_EINVAL, "layer %u: %s in r8 up to row %u, not a tile's edge",
                             lv->index, name, m->r8_rows);
    if ((m->r8 || m->r8_rows) && !qm__r8_eligible(cfg, lv, wt))
        return qm_status_set(st, QM_EINVAL, "layer %u: %s cannot be in the r8 layout", lv->index,
                             name);
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

/* ---- The work of one task, shared by both schedules ---- */

/* Job j's input rows: the fc1 kernel's prepared rows, zero padding rows. */
static void qm__prep_job(qm__run *R, size_t j)
{
    const qm_expert_job *job = &R->b->jobs[j];
    qm__job_geo *g = &R->geo[j];
    for (uint32_t r = 0; r < g->xrows; r++) {
        float *dst = R->X + (g->xrow + r) * R->ldx;
        if (r < job->n_rows && R->i8 && R->TX)
            memcpy(dst, R->TX + (size_t)R->tok_slot[job->rows[r]] * R->ldx,
                   R->tx_floats * sizeof(float));
        else if (r < job->n_rows && R->i8)
            qm__i8_prep(&g->fc1, R->b->x + (size_t)job->rows[r] * R->H, dst);
        else if (r < job->n_rows)
            R->k->prep(&g->fc1, g->gemm, R->b->x + (size_t)job->rows[r] * R->H, dst);
        else
            memset(dst, 0, R->ldx * sizeof(float));
    }
}

/* Fast mode: tokens tok_used[first .. first + count) quantised into TX (the
 * same bits as quantising each route's copy: qm__i8_prep depends only on
 * the row and fc1's geometry, the same for every job of the batch). */
static void qm__prep_tokens(qm__run *R, uint32_t first, uint32_t count)
{
    const qm__qmat *m = &R->geo[0].fc1;
    for (uint32_t i = first; i < first + count; i++)
        qm__i8_prep(m, R->b->x + (size_t)R->tok_used[i] * R->H,
                    R->TX + (size_t)R->tok_slot[R->tok_used[i]] * R->ldx);
}

static void qm__run_matrix(qm__run *R, const qm__qmat *m, int gemm, uint32_t n0, uint32_t n1,
                           const float *xp, size_t ldx, uint32_t nx, float *y, size_t ldy,
                           float *scratch)
{
    qm__qmat t;
    if (m->r8_rows) {
        /* Laid out in part: the rows below the edge in r8, the rest in rows
         * (tiles start on the edge's multiples of 16: one side or the other). */
        uint32_t edge = m->r8_rows;
        t = *m;
        t.r8_rows = 0;
        if (n0 < edge && n1 > edge) {
            qm__run_matrix(R, m, gemm, n0, edge, xp, ldx, nx, y, ldy, scratch);
            qm__run_matrix(R, m, gemm, edge, n1, xp, ldx, nx, y, ldy, scratch);
            return;
        }
        t.r8 = n0 < edge;
        m = &t;
    }
    if (m->cb && (m->bits == 8 || !m->r8)) {
        /* A code book (qm__qmat.cb) the kernel does not read as it lies:
         * the tile at the front of this worker's scratch (qm_codebook.c),
         * the rest of it the kernel's. In 4 bits, a tile in rows laid out
         * in r8 (the fast GEMV reads a code book from r8 only); in 8 bits,
         * its rows (from either layout) as 8-bit codes. */
        uint8_t *tile = (uint8_t *)scratch;
        size_t es = m->scale_dtype == QM_DTYPE_F32 ? 4 : 2;
        t = *m;
        t.n = n1 - n0;
        t.scales = (const uint8_t *)m->scales + (size_t)n0 * m->nblk * es;
        t.w = m->w + (size_t)n0 * m->row_bytes; /* n0 a tile's start: a group's in r8 */
        if (m->bits == 4) {
            qm__r8_interleave_from(t.w, t.n, m->row_bytes, tile, m->n - n1, 0);
            t.r8 = 1;
        } else {
            qm__cb_rows(&t, 0, t.n, tile);
            t.cb = NULL;
            t.r8 = 0;
            t.row_bytes = m->k;
        }
        t.w = tile;
        scratch += qm__cb_tile_floats(m);
        y += n0;
        n1 -= n0;
        n0 = 0;
        m = &t;
    }
    if (m->r8 && !(R->i8 && qm__i8kernel_r8_native(R->i8, nx, m->bits))) {
        /* A kernel that reads rows: the tile's rows back in row order at the
         * front of this worker's scratch (qm__kernel_scratch_floats counts
         * them), the rest of the scratch the kernel's. */
        qm__r8_rows(m->w, m->row_bytes, n0, n1, (uint8_t *)scratch);
        size_t es = m->scale_dtype == QM_DTYPE_F32 ? 4 : 2;
        t = *m;
        t.r8 = 0;
        t.w = (const uint8_t *)scratch;
        t.n = n1 - n0;
        t.scales = (const uint8_t *)m->scales + (size_t)n0 * m->nblk * es;
        scratch += qm__r8_tile_floats(m);
        y += n0;
        n1 -= n0;
        n0 = 0;
        m = &t;
    }
    if (R->i8)
        R->i8->mm(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
    else if (gemm)
        R->k->gemm(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
    else
        R->k->gemv(m, n0, n1, xp, ldx, nx, y, ldy, scratch);
}

/* Tile t of fc1 (mat 1) or fc3 (mat 3) of job j, its bias added. */
static void qm__fc1_tile(qm__run *R, uint32_t j, uint32_t t, int mat, unsigned worker)
{
    const qm_expert_job *job = &R->b->jobs[j];
    qm__job_geo *g = &R->geo[j];
    const qm__qmat *m = mat == 3 ? &g->fc3 : &g->fc1;
    float *out = mat == 3 ? R->H3 : R->H1;
    size_t ldy = mat == 3 ? R->I : R->N1;
    const void *bias = mat == 3 ? g->b3 : g->b1;
    qm_dtype bdt = mat == 3 ? R->b3_dt : R->b1_dt;
    uint32_t n0 = t * QM__TILE_ROWS;
    uint32_t n1 = n0 + QM__TILE_ROWS < m->n ? n0 + QM__TILE_ROWS : m->n;
    float *y = out + g->hrow * ldy;
    qm__run_matrix(R, m, g->gemm, n0, n1, R->X + g->xrow * R->ldx, R->ldx, job->n_rows, y, ldy,
                   R->wscratch + worker * R->ws_floats);
    for (uint32_t r = 0; r < job->n_rows; r++)
        qm__add_bias(y + r * ldy, bias, bdt, n0, n1);
}

/* Job j's activation, prepared as fc2's input rows (zero padding rows). */
static void qm__act_job(qm__run *R, size_t j, unsigned worker)
{
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

/* Tile t of fc2 of job j, written with its bias to each route's output row. */
static void qm__fc2_tile(qm__run *R, uint32_t j, uint32_t t, unsigned worker)
{
    const qm_expert_job *job = &R->b->jobs[j];
    qm__job_geo *g = &R->geo[j];
    uint32_t n0 = t * QM__TILE_ROWS;
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

/* After fc2's tiles [first, first + count) of one job (one range): the
 * job that finishes the range last sums its columns (the seq_cst RMW sees
 * every other job's rows there). */
static void qm__fc2_range_done(qm__run *R, uint32_t first, uint32_t count)
{
    if (!R->combine || atomic_fetch_sub(&R->range_left[first / R->range_tiles], 1) != 1)
        return;
    uint32_t c1 = (first + count) * QM__TILE_ROWS;
    qm_combine_columns(R->combine, R->b->y, R->b->n_tokens, R->H, first * QM__TILE_ROWS,
                       c1 < R->H ? c1 : R->H);
}

/* Appends the jobs' fc2 tasks, `per` tiles each, and with a combine each
 * range's count of jobs. Job after job, except with a combine and only
 * GEMV jobs (decode): range after range (range r of every job, then r + 1),
 * so that a range's jobs finish close together and its rows are summed
 * while in cache; GEMM jobs keep their activations in cache job by job. */
static size_t qm__add_fc2(qm__run *R, size_t nt, uint32_t per);

/* ---- The phased schedule: four pool runs, a barrier after each ---- */

static void qm__phased_prep(void *arg, size_t j, unsigned worker)
{
    (void)worker;
    qm__prep_job(arg, j);
}

static void qm__phased_act(void *arg, size_t j, unsigned worker)
{
    qm__act_job(arg, j, worker);
}

static void qm__phased_tile(void *arg, size_t t, unsigned worker)
{
    qm__run *R = arg;
    const qm__task *task = &R->tasks[t];
    if (task->kind == QM__TASK_FC2) {
        qm__fc2_tile(R, task->job, task->first, worker);
        qm__fc2_range_done(R, task->first, 1);
    } else
        qm__fc1_tile(R, task->job, task->first, task->kind == QM__TASK_FC3 ? 3 : 1, worker);
}

static size_t qm__tiles(uint32_t rows)
{
    return (rows + QM__TILE_ROWS - 1) / QM__TILE_ROWS;
}

/* Appends the tasks of `tiles` tiles of kind `kind` of job j, `per` tiles a task. */
static size_t qm__add_tiles(qm__task *tasks, size_t nt, uint32_t j, size_t tiles, uint32_t per,
                            uint8_t kind)
{
    for (uint32_t t = 0; t < tiles; t += per) {
        uint32_t n = tiles - t < per ? (uint32_t)(tiles - t) : per;
        tasks[nt++] = (qm__task){.job = j, .first = t, .count = n, .kind = kind};
    }
    return nt;
}

static size_t qm__add_fc2(qm__run *R, size_t nt, uint32_t per)
{
    const qm_expert_batch *b = R->b;
    size_t tiles = qm__tiles(R->H);
    unsigned jobs = 0;
    int gemm = 0;
    for (size_t j = 0; j < b->n_jobs; j++) {
        jobs += b->jobs[j].n_rows != 0;
        gemm |= R->geo[j].gemm;
    }
    if (R->combine) {
        R->range_tiles = per;
        for (uint32_t t = 0, r = 0; t < tiles; t += per, r++)
            atomic_store_explicit(&R->range_left[r], jobs, memory_order_relaxed);
    }
    if (!R->combine || gemm) {
        for (size_t j = 0; j < b->n_jobs; j++)
            if (b->jobs[j].n_rows)
                nt = qm__add_tiles(R->tasks, nt, (uint32_t)j, tiles, per, QM__TASK_FC2);
        return nt;
    }
    for (uint32_t t = 0; t < tiles; t += per) {
        uint32_t n = tiles - t < per ? (uint32_t)(tiles - t) : per;
        for (size_t j = 0; j < b->n_jobs; j++)
            if (b->jobs[j].n_rows)
                R->tasks[nt++] = (qm__task){
                    .job = (uint32_t)j, .first = t, .count = n, .kind = QM__TASK_FC2};
    }
    return nt;
}

/* A batch whose weights are fewer than this many bytes runs on the calling
 * thread alone: waking a worker on an idle vCPU costs the caller about 13 us
 * in the wake-up call and the worker arrives 27-37 us later (a 2-CPU VM,
 * measured), while one thread reads this much in about 30 us. */
#define QM__WAKE_MIN_BYTES (512u << 10)

static size_t qm__qmat_bytes(const qm__qmat *m)
{
    return m->w ? (size_t)m->n * m->row_bytes : 0;
}

/* The pool, or the caller alone for a small batch (QM__WAKE_MIN_BYTES). */
static void qm__run_tasks(qm__cpu_ffn *f, const qm__run *R, size_t n, qm__task_fn fn, void *arg)
{
    size_t bytes = 0;
    for (size_t j = 0; j < R->b->n_jobs && bytes < QM__WAKE_MIN_BYTES; j++)
        if (R->b->jobs[j].n_rows)
            bytes += qm__qmat_bytes(&R->geo[j].fc1) + qm__qmat_bytes(&R->geo[j].fc2) +
                     qm__qmat_bytes(&R->geo[j].fc3);
    if (bytes < QM__WAKE_MIN_BYTES)
        qm__pool_run_here(f->pool, n, fn, arg);
    else
        qm__pool_run(f->pool, n, fn, arg);
}

static void qm__run_phased(qm__cpu_ffn *f, qm__run *R)
{
    const qm_expert_batch *b = R->b;
    qm__run_tasks(f, R, b->n_jobs, qm__phased_prep, R);
    size_t nt = 0;
    for (size_t j = 0; j < b->n_jobs; j++) {
        if (!b->jobs[j].n_rows)
            continue;
        nt = qm__add_tiles(R->tasks, nt, (uint32_t)j, qm__tiles(R->N1), 1, QM__TASK_FC1);
        if (R->has_fc3)
            nt = qm__add_tiles(R->tasks, nt, (uint32_t)j, qm__tiles(R->I), 1, QM__TASK_FC3);
    }
    qm__run_tasks(f, R, nt, qm__phased_tile, R);
    qm__run_tasks(f, R, b->n_jobs, qm__phased_act, R);
    nt = qm__add_fc2(R, 0, 1);
    qm__run_tasks(f, R, nt, qm__phased_tile, R);
}

/* ---- The fused schedule: one pool run, per-job dependencies ---- */

static inline void qm__relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Waits for a flag or a count some running thread sets: spins a few
 * microseconds (a dependency is one task away), then sleeps on the batch's
 * condition variable, so a waiter never holds a core the thread it waits
 * for may need. The flags and `sleepers` are sequentially consistent: either
 * the setter sees a sleeper and wakes it, or the sleeper sees the flag. */
static int qm__ready(atomic_int *flag, atomic_uint *count)
{
    return flag ? atomic_load(flag) != 0 : atomic_load(count) == 0;
}

static void qm__wait(qm__cpu_ffn *f, atomic_int *flag, atomic_uint *count)
{
    for (unsigned spins = 0; spins < QM__SPINS; spins++) {
        if (qm__ready(flag, count))
            return;
        qm__relax();
    }
    atomic_fetch_add(&f->sleepers, 1);
    pthread_mutex_lock(&f->mu);
    while (!qm__ready(flag, count))
        pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
    atomic_fetch_sub(&f->sleepers, 1);
}

/* After a flag is set (or a count reached 0): wakes the sleepers, if any. */
static void qm__wake(qm__cpu_ffn *f)
{
    if (atomic_load(&f->sleepers) == 0)
        return;
    pthread_mutex_lock(&f->mu);
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

static void qm__fused_task(void *arg, size_t t, unsigned worker)
{
    qm__run *R = arg;
    qm__cpu_ffn *f = R->f;
    const qm__task *task = &R->tasks[t];
    qm__job_sync *js = &R->sync[task->job];
    switch (task->kind) {
    case QM__TASK_TOKENS:
        qm__prep_tokens(R, task->first, task->count);
        if (atomic_fetch_sub(&R->tokens_left, 1) == 1)
            qm__wake(f);
        return;
    case QM__TASK_PREP:
        if (R->TX)
            qm__wait(f, NULL, &R->tokens_left);
        qm__prep_job(R, task->job);
        atomic_store(&js->prepared, 1);
        qm__wake(f);
        return;
    case QM__TASK_FC1:
    case QM__TASK_FC3:
        qm__wait(f, &js->prepared, NULL);
        for (uint32_t i = 0; i < task->count; i++)
            qm__fc1_tile(R, task->job, task->first + i, task->kind == QM__TASK_FC3 ? 3 : 1,
                         worker);
        /* The last one sees every other block's rows of H1/H3 (seq_cst RMW). */
        if (atomic_fetch_sub(&js->fc1_left, 1) == 1) {
            qm__act_job(R, task->job, worker);
            atomic_store(&js->activated, 1);
            qm__wake(f);
        }
        return;
    case QM__TASK_FC2:
        qm__wait(f, &js->activated, NULL);
        for (uint32_t i = 0; i < task->count; i++)
            qm__fc2_tile(R, task->job, task->first + i, worker);
        qm__fc2_range_done(R, task->first, task->count);
        return;
    default:
        return;
    }
}

static void qm__run_fused(qm__cpu_ffn *f, qm__run *R, size_t total_tiles)
{
    const qm_expert_batch *b = R->b;
    /* Tiles per task: a few, so the counter is claimed less often, while each
     * thread still gets about QM__TASKS_PER_THREAD tasks. */
    size_t per = total_tiles / ((size_t)f->threads * QM__TASKS_PER_THREAD);
    uint32_t tpt = per < 1 ? 1 : per > QM__MAX_TILES_PER_TASK ? QM__MAX_TILES_PER_TASK
                                                              : (uint32_t)per;
    size_t nt = 0;
    if (R->TX) {
        uint32_t chunk = (uint32_t)((R->n_used + f->threads * 4 - 1) / (f->threads * 4));
        if (chunk == 0)
            chunk = 1;
        uint32_t n_chunks = 0;
        for (uint32_t i = 0; i < R->n_used; i += chunk, n_chunks++)
            R->tasks[nt++] = (qm__task){.first = i,
                                        .count = R->n_used - i < chunk ? R->n_used - i : chunk,
                                        .kind = QM__TASK_TOKENS};
        atomic_store_explicit(&R->tokens_left, n_chunks, memory_order_relaxed);
    }
    for (size_t j = 0; j < b->n_jobs; j++) {
        qm__job_sync *js = &R->sync[j];
        atomic_store_explicit(&js->prepared, 0, memory_order_relaxed);
        atomic_store_explicit(&js->activated, 0, memory_order_relaxed);
        if (!b->jobs[j].n_rows) {
            atomic_store_explicit(&js->fc1_left, 0, memory_order_relaxed);
            continue;
        }
        R->tasks[nt++] = (qm__task){.job = (uint32_t)j, .kind = QM__TASK_PREP};
    }
    for (size_t j = 0; j < b->n_jobs; j++) {
        if (!b->jobs[j].n_rows)
            continue;
        size_t before = nt;
        nt = qm__add_tiles(R->tasks, nt, (uint32_t)j, qm__tiles(R->N1), tpt, QM__TASK_FC1);
        if (R->has_fc3)
            nt = qm__add_tiles(R->tasks, nt, (uint32_t)j, qm__tiles(R->I), tpt, QM__TASK_FC3);
        atomic_store_explicit(&R->sync[j].fc1_left, (unsigned)(nt - before),
                              memory_order_relaxed);
    }
    nt = qm__add_fc2(R, nt, tpt);
    /* The pool's start publishes these stores to the workers. */
    qm__run_tasks(f, R, nt, qm__fused_task, R);
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

/* Grows *items (*cap items of `elem` bytes) to hold n, contents kept;
 * QM_ENOMEM leaves it as it was. */
static int qm__grow_array(void **items, size_t *cap, size_t n, size_t elem)
{
    if (n <= *cap)
        return 0;
    void *t = qm_realloc(*items, n * elem);
    if (!t)
        return QM_ENOMEM;
    *items = t;
    *cap = n;
    return 0;
}

/* Grows the shared scratch; contents are not kept. */
static int qm__ffn_reserve(qm__cpu_ffn *f, size_t floats, size_t tasks, size_t jobs,
                           size_t ranges)
{
    if (floats > f->scratch_floats) {
        qm_free(f->scratch_raw);
        f->scratch = NULL;
        f->scratch_floats = 0;
        f->scratch_raw = NULL;
        if (floats > (SIZE_MAX - QM__CPU_ALIGN) / sizeof(float))
            return QM_ENOMEM;
        void *raw = qm_malloc(floats * sizeof(float) + QM__CPU_ALIGN);
        if (!raw)
            return QM_ENOMEM;
        f->scratch_raw = raw;
        f->scratch = (float *)(((uintptr_t)raw + QM__CPU_ALIGN - 1) &
                               ~(uintptr_t)(QM__CPU_ALIGN - 1));
        f->scratch_floats = floats;
    }
    if (qm__grow_array((void **)&f->tasks, &f->tasks_cap, tasks, sizeof(qm__task)) < 0 ||
        qm__grow_array((void **)&f->sync, &f->sync_cap, jobs, sizeof(qm__job_sync)) < 0 ||
        qm__grow_array(&f->left, &f->left_cap, ranges, sizeof(atomic_uint)) < 0)
        return QM_ENOMEM;
    return 0;
}

/* Fast mode, fused: the tokens the batch's jobs use, each given a row of TX. */
static void qm__map_tokens(qm__run *R)
{
    const qm_expert_batch *b = R->b;
    for (uint32_t t = 0; t < b->n_tokens; t++)
        R->tok_slot[t] = UINT32_MAX;
    for (size_t j = 0; j < b->n_jobs; j++)
        for (uint32_t r = 0; r < b->jobs[j].n_rows; r++)
            R->tok_slot[b->jobs[j].rows[r]] = 0;
    R->n_used = 0;
    for (uint32_t t = 0; t < b->n_tokens; t++)
        if (R->tok_slot[t] == 0) {
            R->tok_slot[t] = R->n_used;
            R->tok_used[R->n_used++] = t;
        }
}

/* The run's shape from the batch's config and layer: activation, fc3, the
 * precision it runs at, the biases' types. */
static int qm__run_begin(qm__cpu_ffn *f, const qm_expert_batch *b, qm__run *R, qm_status *st)
{
    const qm_bank_config *cfg = b->config;
    const qm_layer_view *lv = b->layer;
    if (!cfg || !lv || (!b->x && b->n_tokens) || !b->y)
        return qm_status_set(st, QM_EINVAL, "run_experts: batch lacks config, layer, x or y");
    *R = (qm__run){.f = f, .b = b, .k = f->kernel, .H = cfg->hidden, .I = cfg->inter};
    R->swiglu = cfg->activation == QM_ACT_SWIGLU;
    R->has_fc3 = R->swiglu && cfg->swiglu_fusion == 0;
    R->N1 = R->swiglu && !R->has_fc3 ? 2 * R->I : R->I;
    if (R->swiglu && cfg->swiglu_fusion > 2)
        return qm_status_set(st, QM_EINVAL, "swiglu_fusion %u is not 0, 1 or 2",
                             cfg->swiglu_fusion);
    /* Fast mode needs weight blocks of whole 32-column sub-blocks; other
     * layouts (blocks of 16) run exact. */
    if (b->precision == QM_PRECISION_FAST && f->i8 &&
        (cfg->block_size == 0 || cfg->block_size % 32 == 0 ||
         lv->t[QM_T_FC1_WEIGHT + 1].ndim != 3))
        R->i8 = f->i8;
    R->b1_dt = lv->t[QM_T_FC1_BIAS].dtype;
    R->b2_dt = lv->t[QM_T_FC2_BIAS].dtype;
    R->b3_dt = lv->t[QM_T_FC3_BIAS].dtype;
    return 0;
}

/* 1 when this run reads its code book in 4 bits (qm__qmat.cb): fast mode
 * on SIMD rows that read 4-bit r8 at every input count the batch's jobs
 * have (their GEMV and GEMM look the codes up), and every matrix one the
 * r8 layout takes. Otherwise (exact, the scalar kernel, other shapes) the
 * kernels read the 8-bit codes of the same weights, a tile at a time: the
 * same bits either way (tests/engine/test_engine_fast.c). */
static int qm__cb_native(const qm__run *R)
{
    const qm_expert_batch *b = R->b;
    const qm_bank_config *cfg = b->config;
    if (!cfg->codebook || !R->i8)
        return 0;
    for (size_t j = 0; j < b->n_jobs; j++)
        if (b->jobs[j].n_rows && !qm__i8kernel_r8_native(R->i8, b->jobs[j].n_rows, 4))
            return 0;
    return qm__r8_eligible(cfg, b->layer, QM_T_FC1_WEIGHT) &&
           qm__r8_eligible(cfg, b->layer, QM_T_FC2_WEIGHT) &&
           (!R->has_fc3 || qm__r8_eligible(cfg, b->layer, QM_T_FC3_WEIGHT));
}

/* What the jobs' geometry adds up to: rows of X and of the hidden
 * activations, tasks of each phase, the kernels' per-thread scratch. */
typedef struct {
    size_t xrows, hrows, n_tasks1, n_tasks2, ws;
} qm__run_size;

/* Job j's geometry (its matrices, biases and rows in the scratch), added
 * to *sz. */
static int qm__job_geometry(qm__run *R, size_t j, qm__run_size *sz, qm_status *st)
{
    const qm_expert_batch *b = R->b;
    const qm_bank_config *cfg = b->config;
    const qm_layer_view *lv = b->layer;
    const qm_expert_job *job = &b->jobs[j];
    qm__job_geo *g = &R->geo[j];
    if (job->expert >= cfg->experts || (job->n_rows && (!job->rows || !job->out_index)))
        return qm_status_set(st, QM_EINVAL, "job %zu: expert %u out of range or rows missing", j,
                             job->expert);
    for (uint32_t r = 0; r < job->n_rows; r++)
        if (job->rows[r] >= b->n_tokens)
            return qm_status_set(st, QM_EINVAL, "job %zu: row %u >= %u tokens", j,
                                 job->rows[r], b->n_tokens);
    const qm_expert_weights *w = &job->weights;
    int rc = qm__make_qmat(cfg, lv, QM_T_FC1_WEIGHT, w, R->N1, R->H, R->cb4, &g->fc1, st);
    if (rc == 0)
        rc = qm__make_qmat(cfg, lv, QM_T_FC2_WEIGHT, w, R->H, R->I, R->cb4, &g->fc2, st);
    if (rc == 0 && R->has_fc3)
        rc = qm__make_qmat(cfg, lv, QM_T_FC3_WEIGHT, w, R->I, R->H, R->cb4, &g->fc3, st);
    if (rc < 0)
        return rc;
    g->b1 = lv->t[QM_T_FC1_BIAS].present ? job->weights.ptr[QM_T_FC1_BIAS] : NULL;
    g->b2 = lv->t[QM_T_FC2_BIAS].present ? job->weights.ptr[QM_T_FC2_BIAS] : NULL;
    g->b3 = lv->t[QM_T_FC3_BIAS].present ? job->weights.ptr[QM_T_FC3_BIAS] : NULL;
    g->gemm = job->n_rows > QM__GEMV_MAX_ROWS;
    g->xrows = g->gemm && !R->i8 ? (uint32_t)qm__round_up(job->n_rows, R->k->gemm_row_pad)
                                 : job->n_rows;
    g->xrow = sz->xrows;
    g->hrow = sz->hrows;
    sz->xrows += g->xrows;
    sz->hrows += job->n_rows;
    if (job->n_rows) {
        sz->n_tasks1 += qm__tiles(R->N1) + (R->has_fc3 ? qm__tiles(R->I) : 0);
        sz->n_tasks2 += qm__tiles(R->H);
    }
    sz->ws = qm__max3(sz->ws, qm__kernel_scratch_floats(&g->fc1),
                      qm__kernel_scratch_floats(&g->fc2));
    if (R->has_fc3)
        sz->ws = qm__max3(sz->ws, qm__kernel_scratch_floats(&g->fc3), 0);
    return 0;
}

/* The run's buffers, cut from the shared scratch (grown to fit), and its
 * task list; fast mode, fused, also maps the tokens used. */
static int qm__run_scratch(qm__cpu_ffn *f, qm__run *R, const qm__run_size *sz, int fused,
                           qm_status *st)
{
    const qm_expert_batch *b = R->b;
    const qm__qmat *m1 = &R->geo[0].fc1, *m2 = &R->geo[0].fc2;
    if (R->i8) {
        R->ldx = qm__round_up(qm__max3(qm__i8_x_stride(m1), 1, 1), 16);
        R->lda = qm__round_up(qm__max3(qm__i8_x_stride(m2), 1, 1), 16);
    } else {
        R->ldx = qm__round_up(qm__max3(f->kernel->x_stride(m1, 0), f->kernel->x_stride(m1, 1), 1),
                              16);
        R->lda = qm__round_up(qm__max3(f->kernel->x_stride(m2, 0), f->kernel->x_stride(m2, 1), 1),
                              16);
    }
    R->ws_floats = qm__round_up(sz->ws + R->I, 16);
    /* Fast mode, fused: one quantised row per token used (at most the
     * routes' rows), and the token maps. */
    const int dedupe = fused && R->i8;
    const size_t hrows = sz->hrows;
    const size_t n_tx = dedupe ? (hrows < b->n_tokens ? hrows : b->n_tokens) : 0;
    size_t off_x = 0, off_h1 = off_x + sz->xrows * R->ldx;
    size_t off_h3 = off_h1 + hrows * R->N1;
    size_t off_a = off_h3 + (R->has_fc3 ? hrows * R->I : 0);
    size_t off_y2 = off_a + sz->xrows * R->lda;
    size_t off_ws = off_y2 + hrows * R->H;
    size_t off_tx = off_ws + (size_t)f->threads * R->ws_floats;
    size_t off_tok = off_tx + n_tx * R->ldx;
    size_t total = off_tok + (dedupe ? (size_t)b->n_tokens + n_tx : 0);
    size_t max_tasks = fused ? (size_t)f->threads * 4 + 1 + b->n_jobs + sz->n_tasks1 + sz->n_tasks2
                             : (sz->n_tasks1 > sz->n_tasks2 ? sz->n_tasks1 : sz->n_tasks2);
    if (qm__ffn_reserve(f, total, max_tasks, fused ? b->n_jobs : 0,
                        R->combine ? qm__tiles(R->H) : 0) < 0)
        return qm_status_set(st, QM_ENOMEM, "out of memory for %zu floats of expert scratch",
                             total);
    float *s = f->scratch;
    R->X = s + off_x;
    R->H1 = s + off_h1;
    R->H3 = s + off_h3;
    R->A = s + off_a;
    R->Y2 = s + off_y2;
    R->wscratch = s + off_ws;
    R->tasks = f->tasks;
    R->sync = f->sync;
    R->range_left = f->left;
    if (dedupe) {
        R->TX = s + off_tx;
        R->tx_floats = qm__i8_x_stride(m1);
        R->tok_slot = (uint32_t *)(s + off_tok);
        R->tok_used = R->tok_slot + b->n_tokens;
        qm__map_tokens(R);
    }
    return 0;
}

/* Whether the batch's `rows` rows are every route its combine sums (the
 * forward offers one only then; checked, as a backend checks its input). */
static int qm__covers_routes(const qm_expert_batch *b, size_t rows)
{
    const qm_combine *c = b->combine;
    if (!c || !c->out || !c->weights || !c->experts || c->k == 0)
        return 0;
    size_t routes = 0, n = (size_t)b->n_tokens * c->k;
    for (size_t i = 0; i < n; i++)
        routes += c->experts[i] != UINT32_MAX;
    return routes == rows;
}

int qm__cpu_ffn_run(qm__cpu_ffn *f, const qm_expert_batch *b, qm_status *st)
{
    qm__run R;
    int rc = qm__run_begin(f, b, &R, st);
    if (rc < 0)
        return rc;
    R.geo = qm_calloc(b->n_jobs, sizeof *R.geo);
    if (!R.geo)
        return qm_status_set(st, QM_ENOMEM, "out of memory for %zu expert jobs", b->n_jobs);
    qm__run_size sz = {0};
    R.cb4 = qm__cb_native(&R);
    for (size_t j = 0; j < b->n_jobs && rc == 0; j++)
        rc = qm__job_geometry(&R, j, &sz, st);
    const int fused = f->schedule == QM__CPU_SCHEDULE_FUSED;
    if (rc == 0 && sz.hrows && qm__covers_routes(b, sz.hrows))
        R.combine = b->combine;
    if (rc == 0 && sz.hrows)
        rc = qm__run_scratch(f, &R, &sz, fused, st);
    if (rc == 0 && sz.hrows) {
        if (fused)
            qm__run_fused(f, &R, sz.n_tasks1 + sz.n_tasks2);
        else
            qm__run_phased(f, &R);
        if (R.combine)
            R.combine->done = 1;
    }
    qm_free(R.geo);
    return rc;
}

int qm__cpu_ffn_init(qm__cpu_ffn *f)
{
    memset(f, 0, sizeof *f);
    if (pthread_mutex_init(&f->mu, NULL))
        return QM_ERESOURCE_EXHAUSTED;
    if (pthread_cond_init(&f->cv, NULL)) {
        pthread_mutex_destroy(&f->mu);
        return QM_ERESOURCE_EXHAUSTED;
    }
    atomic_init(&f->sleepers, 0);
    f->inited = 1;
    return 0;
}

void qm__cpu_ffn_release(qm__cpu_ffn *f)
{
    qm_free(f->scratch_raw);
    qm_free(f->tasks);
    qm_free(f->sync);
    qm_free(f->left);
    f->scratch_raw = NULL;
    f->scratch = NULL;
    f->scratch_floats = 0;
    f->tasks = NULL;
    f->tasks_cap = 0;
    f->sync = NULL;
    f->sync_cap = 0;
    f->left = NULL;
    f->left_cap = 0;
    if (f->inited) {
        pthread_cond_destroy(&f->cv);
        pthread_mutex_destroy(&f->mu);
        f->inited = 0;
    }
}
