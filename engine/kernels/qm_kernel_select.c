/* qm_kernel_select.c - which kernel runs on this CPU.
 *
 * Candidates: the rows of the kernel tables (qm_kernel_isa.h) this process
 * can run (their CPU features present) and the self-check verified
 * (qm_kernel_check.h: a kernel that disagreed with the scalar
 * specification is never a candidate, never forced, never run).
 *
 * Exact mode: a kernel per shape class the engine distinguishes (GEMV =
 * decode jobs of <= QM__GEMV_MAX_ROWS rows, GEMM = longer jobs; 4-bit and
 * 8-bit weights). The candidate SIMD kernels of each class give the same
 * bits (4-bit GEMV: one canonical order, qm__q4_canon; 8-bit GEMV: the
 * AVX-512 one runs the AVX2 order; GEMM 4/8-bit: same panels, same
 * per-lane order), so every class's default is measured once per process:
 * each candidate on a 64 x 2880 matrix with blocks of 32 (L2-resident: the
 * kernel's compute, not the memory), thread CPU time, best of a few runs,
 * a narrower kernel taking a class only when more than 10% faster (no
 * flapping between near-equal kernels). Two processes that measure
 * differently (the daemon and `qmoe-bank run`) still give the same bits.
 * The exact table's rows are AVX-512 and AVX2 (canonical 4-bit GEMV); a
 * CPU with AVX2 alone has one candidate, nothing to measure, and its 4-bit
 * GEMV of 1-row jobs (decode) takes the row's `alone` variant, the AVX2
 * kernel's own folded order (qm__kernel_avx2_folded: zero point and scale
 * once per block, 1.28x faster than the canonical order there; 2-4 rows
 * keep the canonical one, 1.15-1.45x faster than folded;
 * docs/BENCHMARKS.md): with one candidate no measurement can change bits.
 * QMOE_KERNEL_CACHE=<file> keeps the measured choice across restarts
 * (qm_kernel_cache.c). QMOE_KERNEL=measure measures every class without
 * the cache, =table takes the fixed per-ISA table without measuring (the
 * widest kernel, but the narrowest for the 8-bit GEMV), =scalar or a row's
 * name forces one kernel for every class (an unavailable or refused one
 * falls back to the default; a row's name is the kernel the default uses
 * with that row, so forcing avx2 or avx512 never changes bits), a row's
 * alias forces exactly that row (avx2-canonical; avx2-folded by its name).
 *
 * Fast mode: every SIMD fast kernel produces the same bits (qm_kernel_i8.h),
 * so its choice is always measured, once per process, among the fast
 * table's candidates, per class (decode, prefill; 4/8-bit);
 * QMOE_KERNEL=scalar or a row's name or alias (avx512 = avx512vnni,
 * avx2-canonical|avx2-folded = avx2) forces one.
 *
 * qm__kernel_describe() / qm__i8kernel_describe() name the choice; the CPU
 * backend puts them in its device name (daemon.status device.name,
 * qmoe-bank run --verbose). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "qm_alloc.h"
#include "qm_kernel_isa.h"

typedef struct qm__auto_choice {
    const qm__kernel *gemv[2]; /* [0]: 4-bit, [1]: 8-bit */
    const qm__kernel *gemm[2];
    double gemv_us[2], gemm_us[2];
    char desc[160];
} qm__auto_choice;

/* [0]: the default (measured, or the cache), [1]: measured without the
 * cache (QMOE_KERNEL=measure), [2]: the fixed table (QMOE_KERNEL=table). */
static qm__auto_choice qm__choice[3];
static pthread_once_t qm__choice_once[3] = {PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT,
                                            PTHREAD_ONCE_INIT};

#define QM__AUTO_FNS(IDX)                                                                          \
    static const qm__kernel *qm__pick##IDX(const qm__qmat *m, int gemm)                            \
    {                                                                                              \
        int b8 = m->bits == 8;                                                                     \
        return gemm ? qm__choice[IDX].gemm[b8] : qm__choice[IDX].gemv[b8];                         \
    }                                                                                              \
    static size_t qm__x_stride##IDX(const qm__qmat *m, int gemm)                                   \
    {                                                                                              \
        return qm__pick##IDX(m, gemm)->x_stride(m, gemm);                                          \
    }                                                                                              \
    static void qm__prep##IDX(const qm__qmat *m, int gemm, const float *x, float *xp)              \
    {                                                                                              \
        qm__pick##IDX(m, gemm)->prep(m, gemm, x, xp);                                              \
    }                                                                                              \
    static void qm__gemv##IDX(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp,        \
                              size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)       \
    {                                                                                              \
        qm__pick##IDX(m, 0)->gemv(m, n0, n1, xp, ldx, nx, y, ldy, scratch);                        \
    }                                                                                              \
    static void qm__gemm##IDX(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp,        \
                              size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)       \
    {                                                                                              \
        qm__pick##IDX(m, 1)->gemm(m, n0, n1, xp, ldx, nx, y, ldy, scratch);                        \
    }

QM__AUTO_FNS(0)
QM__AUTO_FNS(1)
QM__AUTO_FNS(2)

static qm__kernel qm__kernel_auto[3] = {
    {.name = "default", .x_stride = qm__x_stride0, .prep = qm__prep0, .gemv = qm__gemv0,
     .gemm = qm__gemm0, .gemm_row_pad = 1},
    {.name = "measured", .x_stride = qm__x_stride1, .prep = qm__prep1, .gemv = qm__gemv1,
     .gemm = qm__gemm1, .gemm_row_pad = 1},
    {.name = "table", .x_stride = qm__x_stride2, .prep = qm__prep2, .gemv = qm__gemv2,
     .gemm = qm__gemm2, .gemm_row_pad = 1},
};

/* ---- fast mode ---- */

typedef struct qm__i8_auto_choice {
    const qm__i8kernel *k[2][2]; /* [8-bit][prefill] */
    int r8[2][2];                /* [8-bit][prefill]: that kernel reads r8 matrices of its bits */
    char desc[160];
} qm__i8_auto_choice;

static qm__i8_auto_choice qm__i8auto;
static pthread_once_t qm__i8auto_once = PTHREAD_ONCE_INIT;

static void qm__i8_auto_mm(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                           size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__i8auto.k[m->bits == 8][nx > QM__GEMV_MAX_ROWS]->mm(m, n0, n1, xq, ldx, nx, y, ldy,
                                                           scratch);
}

static const qm__i8kernel qm__i8kernel_auto = {.name = "auto", .mm = qm__i8_auto_mm};

/* This thread's CPU time: other processes on a shared machine cost wall
 * time, not this thread's CPU time. */
static double qm__now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

#define QM__CAL_N 64u
#define QM__CAL_K 2880u
#define QM__CAL_GEMM_ROWS 24u
#define QM__MAX_CANDS 8

double qm__kernel_best_sweep(qm__mm_fn *fn, const qm__qmat *m, const float *xp, size_t ld,
                             uint32_t nx, float *y, float *scratch, int reps)
{
    double best = 1e30;
    for (int rep = 0; rep <= reps; rep++) {
        double t0 = qm__now_us();
        for (uint32_t n0 = 0; n0 < m->n; n0 += QM__TILE_ROWS)
            fn(m, n0, n0 + QM__TILE_ROWS, xp, ld, nx, y, m->n, scratch);
        double dt = qm__now_us() - t0;
        if (rep > 0 && dt < best)
            best = dt;
    }
    return best;
}

/* Best of a few runs of one kernel on one class; a negative value: no memory. */
static double qm__time_kernel_real(const qm__kernel *k, const qm__qmat *m, int gemm,
                                   const float *x)
{
    uint32_t nx = gemm ? QM__CAL_GEMM_ROWS : 1;
    size_t ld = (k->x_stride(m, gemm) + 15) & ~(size_t)15;
    size_t sf = qm__kernel_scratch_floats(m);
    float *xp = qm_calloc(ld * nx + sf + (size_t)nx * m->n + 64, sizeof(float));
    if (!xp)
        return -1.0;
    float *scratch = xp + ld * nx, *y = scratch + sf;
    for (uint32_t r = 0; r < nx; r++)
        k->prep(m, gemm, x + (size_t)r * m->k, xp + r * ld);
    double best =
        qm__kernel_best_sweep(gemm ? k->gemm : k->gemv, m, xp, ld, nx, y, scratch, gemm ? 3 : 7);
    qm_free(xp);
    return best;
}

/* Best of a few runs of a fast-mode kernel; negative: no memory. */
static double qm__time_i8(const qm__i8kernel *k, const qm__qmat *m, uint32_t nx, const float *x)
{
    size_t ld = (qm__i8_x_stride(m) + 15) & ~(size_t)15;
    size_t sf = qm__kernel_scratch_floats(m);
    float *xq = qm_calloc(ld * nx + (size_t)nx * m->n + sf + 64, sizeof(float));
    if (!xq)
        return -1.0;
    float *y = xq + ld * nx, *scratch = y + (size_t)nx * m->n;
    for (uint32_t r = 0; r < nx; r++)
        qm__i8_prep(m, x + (size_t)r * m->k, xq + r * ld);
    double best = qm__kernel_best_sweep(k->mm, m, xq, ld, nx, y, scratch, nx > 4 ? 3 : 7);
    qm_free(xq);
    return best;
}

static uint32_t qm__gcd(uint32_t a, uint32_t b)
{
    while (b) {
        uint32_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* Deterministic synthetic weights, scales and inputs (NULL on no memory). */
static int qm__cal_data(uint8_t **w, float **sc, float **x)
{
    size_t wbytes = (size_t)QM__CAL_N * QM__CAL_K;
    uint32_t nblk = QM__CAL_K / 32;
    *w = qm_malloc(wbytes);
    *sc = qm_malloc(sizeof(float) * QM__CAL_N * nblk);
    *x = qm_malloc(sizeof(float) * QM__CAL_GEMM_ROWS * QM__CAL_K);
    if (!*w || !*sc || !*x) {
        qm_free(*w);
        qm_free(*sc);
        qm_free(*x);
        return -1;
    }
    uint32_t s = 12345u;
    for (size_t i = 0; i < wbytes; i++) {
        s = s * 1664525u + 1013904223u;
        (*w)[i] = (uint8_t)(s >> 24);
    }
    for (size_t i = 0; i < (size_t)QM__CAL_N * nblk; i++)
        (*sc)[i] = 0.001f * (float)(1 + i % 7);
    for (size_t i = 0; i < (size_t)QM__CAL_GEMM_ROWS * QM__CAL_K; i++)
        (*x)[i] = (float)((int)(i % 17) - 8) * 0.125f;
    return 0;
}

/* The calibration matrix of `bits` over the data of qm__cal_data. */
static qm__qmat qm__cal_mat(const uint8_t *w, const float *sc, uint32_t bits)
{
    return (qm__qmat){.w = w, .row_bytes = QM__CAL_K * bits / 8u, .scales = sc,
                      .scale_dtype = QM_DTYPE_F32, .n = QM__CAL_N, .k = QM__CAL_K, .bits = bits,
                      .nblk = QM__CAL_K / 32, .block = 32};
}

/* Fast row i can serve here: built, its CPU features present, verified. */
static int qm__i8_usable(size_t i)
{
    const qm__i8isa *row = qm__i8isa_at(i);
    char why[128];
    return !row->not_built && qm__cpu_needs(row->needs, why, sizeof why) && qm__kcheck_ok(1, i);
}

/* The fast kernels that may serve here, widest first; none: the scalar one. */
static int qm__i8_cands(const qm__i8kernel **cands)
{
    int nc = 0;
    for (size_t i = 0; i < qm__i8isa_count() && nc < QM__MAX_CANDS; i++)
        if (qm__i8_usable(i))
            cands[nc++] = &qm__i8isa_at(i)->kernel;
    if (nc == 0)
        cands[nc++] = &qm__i8kernel_scalar;
    return nc;
}

static qm__i8kernel_timer qm__i8timer = qm__time_i8;

void qm__i8kernel_set_timer(qm__i8kernel_timer fn)
{
    qm__i8timer = fn ? fn : qm__time_i8;
}

/* The measured fast choice of each class into idx[2 * prefill + 8-bit];
 * -1 on no memory (idx left as it was). */
static int qm__i8_measure(const qm__i8kernel *const *cands, int nc, int idx[4])
{
    uint8_t *w;
    float *sc, *x;
    if (qm__cal_data(&w, &sc, &x) != 0)
        return -1;
    for (int b8 = 0; b8 < 2; b8++) {
        qm__qmat m = qm__cal_mat(w, sc, b8 ? 8u : 4u);
        for (int pf = 0; pf < 2; pf++) {
            double us[QM__MAX_CANDS];
            for (int c = 0; c < nc; c++)
                us[c] = qm__i8timer(cands[c], &m, pf ? QM__CAL_GEMM_ROWS : 1, x);
            idx[2 * pf + b8] = qm__kernel_pick(us, nc);
        }
    }
    qm_free(w);
    qm_free(sc);
    qm_free(x);
    return 0;
}

/* Every fast kernel gives the same bits, so each class (decode = jobs of
 * at most QM__GEMV_MAX_ROWS rows, prefill; 4/8-bit) takes the fastest
 * candidate on the calibration matrix (1 and QM__CAL_GEMM_ROWS inputs), a
 * narrower one only when more than 10% faster; kept in QMOE_KERNEL_CACHE
 * beside the exact choice. */
static void qm__i8_auto_calibrate(void)
{
    const qm__i8kernel *cands[QM__MAX_CANDS];
    const char *names[QM__MAX_CANDS];
    int nc = qm__i8_cands(cands), idx[4] = {0, 0, 0, 0}, from_cache = 0;
    for (int c = 0; c < nc; c++)
        names[c] = cands[c]->name;
    const char *cache = getenv("QMOE_KERNEL_CACHE");
    if (nc > 1 && cache && *cache &&
        qm__cache_load(cache, "qmoe-fast-kernels", names, nc, idx) == 0)
        from_cache = 1;
    else if (nc > 1 && qm__i8_measure(cands, nc, idx) == 0 && cache && *cache)
        qm__cache_save(cache, "qmoe-fast-kernels", names, nc, idx);
    for (int b8 = 0; b8 < 2; b8++)
        for (int pf = 0; pf < 2; pf++)
            qm__i8auto.k[b8][pf] = cands[idx[2 * pf + b8]];
    for (int b8 = 0; b8 < 2; b8++)
        for (int pf = 0; pf < 2; pf++) {
            const qm__i8isa *row = qm__i8isa_of(qm__i8auto.k[b8][pf]);
            qm__i8auto.r8[b8][pf] = row && (b8 ? row->reads_r8_q8 : row->reads_r8);
        }
    /* "q4 A, q8 B", or "q4 A/C" when decode (A) and prefill (C) differ. */
    char part[2][64];
    for (int b8 = 0; b8 < 2; b8++) {
        if (qm__i8auto.k[b8][0] == qm__i8auto.k[b8][1])
            snprintf(part[b8], sizeof part[b8], "%s", qm__i8auto.k[b8][0]->name);
        else
            snprintf(part[b8], sizeof part[b8], "%s/%s", qm__i8auto.k[b8][0]->name,
                     qm__i8auto.k[b8][1]->name);
    }
    snprintf(qm__i8auto.desc, sizeof qm__i8auto.desc, "measured%s: q4 %s, q8 %s",
             from_cache ? " (cached)" : "", part[0], part[1]);
}

const char *qm__i8kernel_recalibrate(void)
{
    qm__i8_auto_calibrate();
    return qm__i8auto.desc;
}

/* ---- exact mode ---- */

static qm__kernel_timer qm__timer = qm__time_kernel_real;

void qm__kernel_set_timer(qm__kernel_timer fn)
{
    qm__timer = fn ? fn : qm__time_kernel_real;
}

int qm__kernel_pick(const double *us, int nc)
{
    int best = 0;
    for (int c = 1; c < nc; c++)
        if (us[best] <= 0.0 || (us[c] > 0.0 && us[c] < us[best] * 0.90))
            best = c;
    return best;
}

/* Exact row i can serve here: its CPU features present, verified. */
static int qm__exact_usable(size_t i)
{
    char why[128];
    return qm__cpu_needs(qm__exact_at(i)->needs, why, sizeof why) && qm__kcheck_ok(0, i);
}

/* The exact table's measured rows that may serve here, widest first. */
static int qm__exact_cands(const qm__kernel **cands)
{
    int nc = 0;
    for (size_t i = 0; i < qm__exact_count() && nc < QM__MAX_CANDS; i++)
        if (!qm__exact_at(i)->variant && qm__exact_usable(i))
            cands[nc++] = qm__exact_at(i);
    return nc;
}

/* The row k's `alone` names, if it may serve here; else k. */
static const qm__kernel *qm__exact_alone(const qm__kernel *k)
{
    int i = k->alone ? qm__exact_find(k->alone->name) : -1;
    return i >= 0 && qm__exact_usable((size_t)i) ? qm__exact_at((size_t)i) : k;
}

/* Measures every exact class among the candidates into ch (and saves the
 * choice in the cache when one is named). */
static void qm__exact_measure(qm__auto_choice *ch, const qm__kernel *const *cands, int nc,
                              const char *cache)
{
    uint8_t *w;
    float *sc, *x;
    if (qm__cal_data(&w, &sc, &x) != 0)
        return;
    for (int b8 = 0; b8 < 2; b8++) {
        qm__qmat m = qm__cal_mat(w, sc, b8 ? 8u : 4u);
        for (int gemm = 0; gemm < 2; gemm++) {
            double us[QM__MAX_CANDS];
            for (int c = 0; c < nc; c++)
                us[c] = qm__timer(cands[c], &m, gemm, x);
            int best = qm__kernel_pick(us, nc);
            (gemm ? ch->gemm : ch->gemv)[b8] = cands[best];
            (gemm ? ch->gemm_us : ch->gemv_us)[b8] = us[best];
        }
    }
    qm_free(w);
    qm_free(sc);
    qm_free(x);
    if (cache && *cache) {
        const qm__kernel *save[4] = {ch->gemv[0], ch->gemv[1], ch->gemm[0], ch->gemm[1]};
        const char *names[QM__MAX_CANDS];
        int idx[4] = {0, 0, 0, 0};
        for (int c = 0; c < nc; c++)
            names[c] = cands[c]->name;
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < nc; c++)
                if (save[i] == cands[c])
                    idx[i] = c;
        qm__cache_save(cache, "qmoe-kernels", names, nc, idx);
    }
}

/* mode 0: default (measured, or the cache), 1: measured without the cache,
 * 2: the fixed table. */
static void qm__auto_calibrate(int mode)
{
    qm__auto_choice *ch = &qm__choice[mode];
    const qm__kernel *cands[QM__MAX_CANDS];
    int nc = qm__exact_cands(cands);
    for (int b8 = 0; b8 < 2; b8++) {
        ch->gemv[b8] = ch->gemm[b8] = nc ? cands[0] : &qm__kernel_scalar;
        ch->gemv_us[b8] = ch->gemm_us[b8] = 0.0;
    }
    /* The fixed table: the widest kernel, the narrowest for the 8-bit GEMV. */
    ch->gemv[1] = nc ? cands[nc - 1] : &qm__kernel_scalar;
    const char *cache = mode == 0 ? getenv("QMOE_KERNEL_CACHE") : NULL;
    const qm__kernel *cached[4];
    int from_cache = 0;
    if (nc > 1 && mode != 2 && cache && *cache &&
        qm__kernel_cache_load(cache, cands, nc, cached) == 0) {
        ch->gemv[0] = cached[0];
        ch->gemv[1] = cached[1];
        ch->gemm[0] = cached[2];
        ch->gemm[1] = cached[3];
        from_cache = 1;
    } else if (nc > 1 && mode != 2) {
        qm__exact_measure(ch, cands, nc, cache);
    }
    if (nc == 1) /* the only candidate: its decode variant, if it has one */
        ch->gemv[0] = qm__exact_alone(cands[0]);
    uint32_t pad = 1;
    for (int b8 = 0; b8 < 2; b8++) {
        uint32_t p = ch->gemm[b8]->gemm_row_pad;
        pad = pad / qm__gcd(pad, p) * p;
    }
    qm__kernel_auto[mode].gemm_row_pad = pad;
    static const char *const what[] = {"measured", "all measured", "table"};
    snprintf(ch->desc, sizeof ch->desc, "%s%s: gemv %s/%s, gemm %s/%s", what[mode],
             from_cache ? " (cached)" : "", ch->gemv[0]->name, ch->gemv[1]->name,
             ch->gemm[0]->name, ch->gemm[1]->name);
}

const char *qm__kernel_recalibrate(void)
{
    qm__auto_calibrate(0);
    return qm__choice[0].desc;
}

static void qm__auto_default(void)
{
    qm__auto_calibrate(0);
}

static void qm__auto_measured(void)
{
    qm__auto_calibrate(1);
}

static void qm__auto_table(void)
{
    qm__auto_calibrate(2);
}

/* QMOE_KERNEL naming an exact row that may serve here: by its name, the
 * kernel the default uses with it (its `alone` when it is the only
 * candidate); by an alias, exactly it. NULL: no such row, or not here. */
static const qm__kernel *qm__exact_forced(const char *force)
{
    for (size_t i = 0; i < qm__exact_count(); i++) {
        const qm__kernel *k = qm__exact_at(i);
        int by_name = strcmp(k->name, force) == 0;
        if (!by_name && !qm__word_in(k->aliases, force))
            continue;
        if (!qm__exact_usable(i))
            return NULL;
        const qm__kernel *cands[QM__MAX_CANDS];
        return by_name && qm__exact_cands(cands) == 1 && cands[0] == k ? qm__exact_alone(k) : k;
    }
    return NULL;
}

const qm__kernel *qm__kernel_select(void)
{
    const char *force = getenv("QMOE_KERNEL");
    if (force && strcmp(force, "scalar") == 0)
        return &qm__kernel_scalar;
    const qm__kernel *forced = force ? qm__exact_forced(force) : NULL;
    if (forced)
        return forced;
    const qm__kernel *cands[QM__MAX_CANDS];
    if (qm__exact_cands(cands) == 0)
        return &qm__kernel_scalar;
    int mode = !force                          ? 0
               : strcmp(force, "measure") == 0 ? 1
               : strcmp(force, "table") == 0   ? 2
                                               : 0;
    static void (*const init[3])(void) = {qm__auto_default, qm__auto_measured, qm__auto_table};
    pthread_once(&qm__choice_once[mode], init[mode]);
    return &qm__kernel_auto[mode];
}

const qm__i8kernel *qm__i8kernel_select(void)
{
    const char *force = getenv("QMOE_KERNEL");
    if (force && strcmp(force, "scalar") == 0)
        return &qm__i8kernel_scalar;
    int i = force ? qm__i8isa_find(force) : -1;
    if (i >= 0 && qm__i8_usable((size_t)i))
        return &qm__i8isa_at((size_t)i)->kernel;
    const qm__i8kernel *cands[QM__MAX_CANDS];
    if (qm__i8_cands(cands) == 1 && cands[0] == &qm__i8kernel_scalar)
        return &qm__i8kernel_scalar;
    pthread_once(&qm__i8auto_once, qm__i8_auto_calibrate);
    return &qm__i8kernel_auto;
}

int qm__i8kernel_r8_native(const qm__i8kernel *k, uint32_t nx, uint32_t bits)
{
    if (!k || nx == 0 || (bits != 4 && bits != 8))
        return 0;
    if (k == &qm__i8kernel_auto) {
        pthread_once(&qm__i8auto_once, qm__i8_auto_calibrate);
        return qm__i8auto.r8[bits == 8][nx > QM__GEMV_MAX_ROWS];
    }
    const qm__i8isa *row = qm__i8isa_of(k);
    return row && (bits == 8 ? row->reads_r8_q8 : row->reads_r8);
}

const char *qm__i8kernel_describe(const qm__i8kernel *k)
{
    if (k == &qm__i8kernel_auto)
        return qm__i8auto.desc;
    return k->name;
}

const char *qm__kernel_describe(const qm__kernel *k)
{
    for (int i = 0; i < 3; i++)
        if (k == &qm__kernel_auto[i])
            return qm__choice[i].desc;
    return k->name;
}
