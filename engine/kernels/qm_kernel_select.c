/* qm_kernel_select.c - which kernel runs on this CPU.
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
 * Candidates: AVX-512 and AVX2 where the CPU has AVX-512F/BW/VL (the AVX2
 * 4-bit GEMV then in the canonical order, qm__kernel_avx2); else AVX2
 * alone, nothing to measure, and its 4-bit GEMV of 1-row jobs (decode)
 * takes the AVX2 kernel's own folded order (qm__kernel_avx2_folded: zero
 * point and scale once per block, 1.28x faster than the canonical order
 * there; 2-4 rows keep the canonical one, 1.15-1.45x faster than folded;
 * docs/BENCHMARKS.md): with one candidate no measurement can change bits.
 * QMOE_KERNEL_CACHE=<file> keeps the measured choice across restarts,
 * keyed by the CPU's brand string, the candidate kernels and a version (a
 * stale, invalid or corrupt file is ignored with a line on stderr and
 * rewritten). QMOE_KERNEL=measure measures every class without the cache,
 * =table takes the fixed per-ISA table without measuring (the widest
 * kernel, but AVX2 for the 8-bit GEMV), =scalar|avx2|avx512 forces one
 * kernel for every class (an unavailable one falls back to the default;
 * avx2 is the AVX2 kernel the default uses on this CPU, so forcing it or
 * avx512 never changes bits), =avx2-canonical|avx2-folded forces the AVX2
 * kernel with that 4-bit GEMV order (benchmarks, tests).
 *
 * Fast mode: every SIMD fast kernel produces the same bits (qm_kernel_i8.h),
 * so its choice is always measured, once per process, among the available
 * ones (AVX-512 VNNI, AVX-VNNI, AVX2), per class (decode, prefill; 4/8-bit);
 * QMOE_KERNEL=scalar|avx2|avxvnni|avx512vnni (avx512 = avx512vnni,
 * avx2-canonical|avx2-folded = avx2) forces one.
 *
 * qm__kernel_describe() / qm__i8kernel_describe() name the choice; the CPU
 * backend puts them in its device name (daemon.status device.name,
 * qmoe-bank run --verbose). */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_kernels.h"

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

#if defined(QMOE_X86_KERNELS)
static const qm__i8kernel qm__i8kernel_avx2 = {.name = "avx2", .mm = qm__i8mm_avx2};
static const qm__i8kernel qm__i8kernel_avx512vnni = {.name = "avx512vnni",
                                                     .mm = qm__i8mm_avx512vnni};
#if defined(QMOE_AVXVNNI_KERNEL)
static const qm__i8kernel qm__i8kernel_avxvnni = {.name = "avxvnni", .mm = qm__i8mm_avxvnni};
#endif
static const qm__i8kernel qm__i8kernel_amx = {.name = "amx", .mm = qm__i8mm_amx};
#endif

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

/* The best of `reps` sweeps of `fn` (a kernel's gemv, gemm or fast-mode
 * mm) over every row tile of m, in thread CPU microseconds; one more sweep
 * first warms the caches. */
static double qm__best_sweep(qm__mm_fn *fn, const qm__qmat *m, const float *xp, size_t ld,
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
    double best = qm__best_sweep(gemm ? k->gemm : k->gemv, m, xp, ld, nx, y, scratch,
                                 gemm ? 3 : 7);
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
    double best = qm__best_sweep(k->mm, m, xq, ld, nx, y, scratch, nx > 4 ? 3 : 7);
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

/* The fast kernels this CPU runs, widest first. */
static int qm__i8_cands(const qm__i8kernel **cands)
{
    int nc = 0;
#if defined(QMOE_X86_KERNELS)
    if (qm__cpu_has_amx())
        cands[nc++] = &qm__i8kernel_amx;
    if (qm__cpu_has_avx512vnni())
        cands[nc++] = &qm__i8kernel_avx512vnni;
#if defined(QMOE_AVXVNNI_KERNEL)
    if (qm__cpu_has_avxvnni())
        cands[nc++] = &qm__i8kernel_avxvnni;
#endif
    if (qm__cpu_has_avx2())
        cands[nc++] = &qm__i8kernel_avx2;
#endif
    if (nc == 0)
        cands[nc++] = &qm__i8kernel_scalar;
    return nc;
}

static qm__i8kernel_timer qm__i8timer = qm__time_i8;

void qm__i8kernel_set_timer(qm__i8kernel_timer fn)
{
    qm__i8timer = fn ? fn : qm__time_i8;
}

/* Every fast kernel gives the same bits, so each class (decode = jobs of
 * at most QM__GEMV_MAX_ROWS rows, prefill; 4/8-bit) takes the fastest
 * candidate on the calibration matrix (1 and QM__CAL_GEMM_ROWS inputs), a
 * narrower one only when more than 10% faster; kept in QMOE_KERNEL_CACHE
 * beside the exact choice. */
static void qm__i8_auto_calibrate(void)
{
    const qm__i8kernel *cands[5];
    const char *names[5];
    int nc = qm__i8_cands(cands), idx[4] = {0, 0, 0, 0}, from_cache = 0;
    for (int c = 0; c < nc; c++)
        names[c] = cands[c]->name;
    const char *cache = getenv("QMOE_KERNEL_CACHE");
    uint8_t *w;
    float *sc, *x;
    if (nc > 1 && cache && *cache && qm__cache_load(cache, "qmoe-fast-kernels", names, nc, idx) == 0) {
        from_cache = 1;
    } else if (nc > 1 && qm__cal_data(&w, &sc, &x) == 0) {
        for (int b8 = 0; b8 < 2; b8++) {
            qm__qmat m = {.w = w, .row_bytes = QM__CAL_K * (b8 ? 8u : 4u) / 8u, .scales = sc,
                          .scale_dtype = QM_DTYPE_F32, .n = QM__CAL_N, .k = QM__CAL_K,
                          .bits = b8 ? 8u : 4u, .nblk = QM__CAL_K / 32, .block = 32};
            for (int pf = 0; pf < 2; pf++) {
                double us[5];
                for (int c = 0; c < nc; c++)
                    us[c] = qm__i8timer(cands[c], &m, pf ? QM__CAL_GEMM_ROWS : 1, x);
                idx[2 * pf + b8] = qm__kernel_pick(us, nc);
            }
        }
        qm_free(w);
        qm_free(sc);
        qm_free(x);
        if (cache && *cache)
            qm__cache_save(cache, "qmoe-fast-kernels", names, nc, idx);
    }
    for (int b8 = 0; b8 < 2; b8++)
        for (int pf = 0; pf < 2; pf++)
            qm__i8auto.k[b8][pf] = cands[idx[2 * pf + b8]];
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

/* mode 0: default (measured, or the cache), 1: measured without the cache,
 * 2: the fixed table. */
static void qm__auto_calibrate(int mode)
{
    qm__auto_choice *ch = &qm__choice[mode];
    const qm__kernel *cands[4];
    int nc = 0;
#if defined(QMOE_X86_KERNELS)
    if (qm__cpu_has_avx512())
        cands[nc++] = &qm__kernel_avx512;
    if (qm__cpu_has_avx2())
        cands[nc++] = &qm__kernel_avx2;
#endif
    for (int b8 = 0; b8 < 2; b8++) {
        ch->gemv[b8] = ch->gemm[b8] = nc ? cands[0] : &qm__kernel_scalar;
        ch->gemv_us[b8] = ch->gemm_us[b8] = 0.0;
    }
    /* The fixed table: the widest kernel, AVX2 for the 8-bit GEMV. */
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
        uint8_t *w;
        float *sc, *x;
        uint32_t nblk = QM__CAL_K / 32;
        if (qm__cal_data(&w, &sc, &x) == 0) {
            for (int b8 = 0; b8 < 2; b8++) {
                qm__qmat m = {.w = w, .row_bytes = QM__CAL_K * (b8 ? 8u : 4u) / 8u,
                              .scales = sc, .scale_dtype = QM_DTYPE_F32, .n = QM__CAL_N,
                              .k = QM__CAL_K, .bits = b8 ? 8u : 4u, .nblk = nblk, .block = 32};
                for (int gemm = 0; gemm < 2; gemm++) {
                    double us[4];
                    for (int c = 0; c < nc; c++)
                        us[c] = qm__timer(cands[c], &m, gemm, x);
                    int best = qm__kernel_pick(us, nc);
                    if (gemm) {
                        ch->gemm[b8] = cands[best];
                        ch->gemm_us[b8] = us[best];
                    } else {
                        ch->gemv[b8] = cands[best];
                        ch->gemv_us[b8] = us[best];
                    }
                }
            }
            qm_free(w);
            qm_free(sc);
            qm_free(x);
            if (cache && *cache) {
                const qm__kernel *save[4] = {ch->gemv[0], ch->gemv[1], ch->gemm[0], ch->gemm[1]};
                const char *names[4];
                int idx[4];
                for (int c = 0; c < nc; c++)
                    names[c] = cands[c]->name;
                for (int i = 0; i < 4; i++)
                    for (int c = 0; c < nc; c++)
                        if (save[i] == cands[c])
                            idx[i] = c;
                qm__cache_save(cache, "qmoe-kernels", names, nc, idx);
            }
        }
    }
#if defined(QMOE_X86_KERNELS)
    if (nc == 1 && cands[0] == &qm__kernel_avx2) /* no AVX-512: the only candidate */
        ch->gemv[0] = &qm__kernel_avx2_folded;
#endif
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

static int qm__avx512_hidden; /* tests: qm__kernel_hide_avx512 */

void qm__kernel_hide_avx512(int hide)
{
    qm__avx512_hidden = hide;
}

#if defined(QMOE_X86_KERNELS)
int qm__cpu_has_avx2(void)
{
    __builtin_cpu_init();
    /* F16C is not a feature name every compiler's builtin knows; every CPU
     * with AVX2 and FMA (Haswell, Zen and later) has it. */
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

int qm__cpu_has_avx512(void)
{
    return !qm__avx512_hidden && qm__cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

int qm__cpu_has_avx512vnni(void)
{
    return qm__cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
}

/* CPUID.(EAX=7, ECX=1):EAX bit 4; GCC 12's builtin has no name for it. */
int qm__cpu_has_avxvnni(void)
{
#if defined(QMOE_AVXVNNI_KERNEL)
    unsigned a, b, c, d;
    if (!qm__cpu_has_avx2())
        return 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
    if (a < 7)
        return 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
    return (a >> 4) & 1;
#else
    return 0;
#endif
}

/* ---- AMX: the CPU's flags, the OS's tile state, this process's permission ---- */

#define QM__ARCH_GET_XCOMP_PERM 0x1022
#define QM__ARCH_REQ_XCOMP_PERM 0x1023
#define QM__XFEATURE_XTILEDATA 18

static pthread_mutex_t qm__amx_lock = PTHREAD_MUTEX_INITIALIZER;
static int qm__amx_state;         /* 0: not asked yet, 1: usable, -1: not */
static const char *qm__amx_reason; /* why not */
static char qm__amx_reason_buf[128];
static int qm__amx_fake_cpu;
static int (*qm__amx_perm_hook)(void);

/* CPUID.(7,0):EDX bits 24 (AMX-TILE) and 25 (AMX-INT8), and XCR0 bits 17
 * and 18 (the OS saves XTILECFG / XTILEDATA). */
static int qm__cpu_amx_flags(void)
{
    unsigned a, b, c, d;
    if (!qm__cpu_has_avx512vnni())
        return 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
    if (a < 7)
        return 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1) || !((d >> 25) & 1))
        return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((lo >> 17) & 3) == 3;
}

/* Linux asks each process to request the tile state before its first tile
 * instruction (a larger signal frame); a kernel without the call, or one
 * that refuses, leaves AMX off. */
static int qm__amx_request(void)
{
    if (qm__amx_perm_hook)
        return qm__amx_perm_hook();
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, QM__ARCH_GET_XCOMP_PERM, &features) == 0 &&
        ((features >> QM__XFEATURE_XTILEDATA) & 1))
        return 0;
    if (syscall(SYS_arch_prctl, QM__ARCH_REQ_XCOMP_PERM, QM__XFEATURE_XTILEDATA) != 0)
        return errno ? errno : -1;
    return 0;
}

int qm__cpu_has_amx(void)
{
    pthread_mutex_lock(&qm__amx_lock);
    if (qm__amx_state == 0) {
        int flags = qm__amx_fake_cpu || qm__cpu_amx_flags();
        int refused = flags ? qm__amx_request() : 0;
        if (!flags) {
            qm__amx_reason = "no AMX-INT8 on this CPU (or the OS does not save the tile state)";
        } else if (refused) {
            snprintf(qm__amx_reason_buf, sizeof qm__amx_reason_buf,
                     "tile permission refused (arch_prctl ARCH_REQ_XCOMP_PERM: %s)",
                     refused > 0 ? strerror(refused) : "refused");
            qm__amx_reason = qm__amx_reason_buf;
        } else {
            qm__amx_reason = NULL;
        }
        qm__amx_state = qm__amx_reason ? -1 : 1;
    }
    int ok = qm__amx_state == 1;
    pthread_mutex_unlock(&qm__amx_lock);
    return ok;
}

const char *qm__amx_why_not(void)
{
    return qm__cpu_has_amx() ? NULL : qm__amx_reason;
}

void qm__kernel_amx_hook(int fake_cpu, int (*perm)(void))
{
    pthread_mutex_lock(&qm__amx_lock);
    qm__amx_fake_cpu = fake_cpu;
    qm__amx_perm_hook = perm;
    qm__amx_state = 0;
    pthread_mutex_unlock(&qm__amx_lock);
}
#endif

const qm__kernel *qm__kernel_select(void)
{
    const char *force = getenv("QMOE_KERNEL");
    if (force && strcmp(force, "scalar") == 0)
        return &qm__kernel_scalar;
#if defined(QMOE_X86_KERNELS)
    if (force && strncmp(force, "avx2", 4) == 0 && qm__cpu_has_avx2()) {
        if (strcmp(force, "avx2") == 0) /* the one the default uses (qm__auto_calibrate) */
            return qm__cpu_has_avx512() ? &qm__kernel_avx2 : &qm__kernel_avx2_folded;
        if (strcmp(force, "avx2-canonical") == 0)
            return &qm__kernel_avx2;
        if (strcmp(force, "avx2-folded") == 0)
            return &qm__kernel_avx2_folded;
    }
    if (force && strcmp(force, "avx512") == 0 && qm__cpu_has_avx512())
        return &qm__kernel_avx512;
    if (!qm__cpu_has_avx2())
        return &qm__kernel_scalar;
    int mode = !force                          ? 0
               : strcmp(force, "measure") == 0 ? 1
               : strcmp(force, "table") == 0   ? 2
                                               : 0;
    static void (*const init[3])(void) = {qm__auto_default, qm__auto_measured, qm__auto_table};
    pthread_once(&qm__choice_once[mode], init[mode]);
    return &qm__kernel_auto[mode];
#else
    return &qm__kernel_scalar;
#endif
}

const qm__i8kernel *qm__i8kernel_select(void)
{
    const char *force = getenv("QMOE_KERNEL");
    if (force && strcmp(force, "scalar") == 0)
        return &qm__i8kernel_scalar;
#if defined(QMOE_X86_KERNELS)
    if (force && strncmp(force, "avx2", 4) == 0 && qm__cpu_has_avx2()) /* avx2[-order] */
        return &qm__i8kernel_avx2;
    if (force && (strcmp(force, "avx512") == 0 || strcmp(force, "avx512vnni") == 0) &&
        qm__cpu_has_avx512vnni())
        return &qm__i8kernel_avx512vnni;
#if defined(QMOE_AVXVNNI_KERNEL)
    if (force && strcmp(force, "avxvnni") == 0 && qm__cpu_has_avxvnni())
        return &qm__i8kernel_avxvnni;
#endif
    if (force && strcmp(force, "amx") == 0 && qm__cpu_has_amx())
        return &qm__i8kernel_amx;
    if (!qm__cpu_has_avx2())
        return &qm__i8kernel_scalar;
    pthread_once(&qm__i8auto_once, qm__i8_auto_calibrate);
    return &qm__i8kernel_auto;
#else
    return &qm__i8kernel_scalar;
#endif
}

int qm__i8kernel_r8_native(const qm__i8kernel *k, uint32_t nx)
{
    if (!k || nx == 0)
        return 0;
#if defined(QMOE_X86_KERNELS)
    if (k == &qm__i8kernel_auto) {
        pthread_once(&qm__i8auto_once, qm__i8_auto_calibrate);
        k = qm__i8auto.k[0][nx > QM__GEMV_MAX_ROWS];
    }
    return k == &qm__i8kernel_avx2;
#else
    return 0;
#endif
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
