/* layout_ab - the 4-bit fast GEMV's inner loops on two layouts of the same
 * bytes, one thread, thread CPU time (issues 22 and 23: is llama.cpp's
 * repacked Q4_0, rows interleaved eight at a time, worth a layout of ours?).
 *
 *   layout_ab [--rows N] [--cols K] [--reps R] [--prefetch 0|1] [--threads T]
 *
 * row: the bank's layout and the two passes of qm_kernel_i8_x86.h's
 *   qm__v_b32 (per group of 8 rows, each row's 32-byte chunks dotted with
 *   the input into a scratch of lane sums, then the 8 rows' sums reduced by
 *   hadd and finished sub-block by sub-block). --prefetch 1: the next
 *   group's bytes prefetched during the first pass, as the engine does.
 * interleaved: the same codes permuted so that each 32-byte load holds 4
 *   code bytes of each of 8 rows (lane r = row r): a sub-block's exact sums
 *   come out one row per lane, with no reduction. The epilogue is the
 *   canonical one (t = fma(S - zsum, dx, +0), acc = fma(t, scale, acc),
 *   sub-block by sub-block), so both give the same bits: checked.
 *
 * The engine's own kernel is not called (its scratch, scales conversion
 * and tiling are left out of both sides alike): this measures what the
 * layout alone changes. --threads T > 1: T threads split the groups, and
 * the times are wall clock between barriers (the engine's regime at T = 2
 * and rows from memory: a core's share of the read bandwidth against its
 * compute). Rows x cols / 2 bytes of codes: 256 x 2048 stays in
 * L2, 65536 x 2048 (64 MiB) comes from memory. Prints one JSON line. Not a
 * test. */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../bench_util.h"

static double clock_us(clockid_t c)
{
    struct timespec t;
    clock_gettime(c, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

typedef struct shape {
    size_t rb;  /* bytes of a row */
    size_t nc;  /* 32-byte chunks of a row (two sub-blocks each) */
    size_t nsb; /* sub-blocks of 32 columns */
} shape;

/* Pass 1 of the row layout: part[i nc + c] = row i's chunk c against the
 * input's pairs xp, as 8 int32 lane sums (widen) or, for row16, the 16
 * int16 sums before vpmaddwd (4 columns each, |s| <= 7620). pf: the next
 * group (NULL: no prefetch). */
static inline __attribute__((always_inline)) void pass1(const shape *g, const uint8_t *r0,
                                                        const uint8_t *pf, const __m256i *xp,
                                                        __m256i *part, const int widen)
{
    /* In locals: a store through __m256i * may alias *g. */
    const size_t rb = g->rb, nc = g->nc;
    const __m256i lo4 = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1);
    for (size_t i = 0; i < 8; i++) {
        const uint8_t *r = r0 + i * rb;
        __m256i *pi = part + i * nc;
        for (size_t c = 0; c < nc; c++) {
            if (pf && (c & 1) == 0)
                _mm_prefetch((const char *)pf + i * rb + 32 * c, _MM_HINT_T0);
            __m256i v = _mm256_loadu_si256((const __m256i *)(r + 32 * c));
            __m256i s = _mm256_add_epi16(
                _mm256_maddubs_epi16(_mm256_and_si256(v, lo4), xp[2 * c]),
                _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo4), xp[2 * c + 1]));
            pi[c] = widen ? _mm256_madd_epi16(s, one) : s;
        }
    }
}

__attribute__((noinline)) static void row_pass1(const shape *g, const uint8_t *r0,
                                                const uint8_t *pf, const __m256i *xp,
                                                __m256i *part)
{
    pass1(g, r0, pf, xp, part, 1);
}

static inline __m256 epilogue(__m256i S, int32_t zsum, float dx, const float *sc, __m256 acc)
{
    __m256i s = _mm256_sub_epi32(S, _mm256_set1_epi32(zsum));
    __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dx), _mm256_setzero_ps());
    return _mm256_fmadd_ps(t, _mm256_loadu_ps(sc), acc);
}

/* Chunk c's two sub-blocks finished from the 8 rows' reduced sums X, Y
 * (the hadd tree's halves: sub-block 2c low, 2c + 1 high). */
static inline __m256 epilogue2(__m256i X, __m256i Y, size_t c, const int32_t *zsum, const float *dx,
                               const float *sct, __m256 acc)
{
    acc =
        epilogue(_mm256_permute2x128_si256(X, Y, 0x20), zsum[2 * c], dx[2 * c], sct + 16 * c, acc);
    return epilogue(_mm256_permute2x128_si256(X, Y, 0x31), zsum[2 * c + 1], dx[2 * c + 1],
                    sct + 16 * c + 8, acc);
}

/* Pass 2: the 8 rows' lane sums reduced per chunk, then finished. */
__attribute__((noinline)) static __m256 row_pass2(const shape *g, const __m256i *part,
                                                  const int32_t *zsum, const float *dx,
                                                  const float *sct)
{
    size_t nc = g->nc;
    __m256 acc = _mm256_setzero_ps();
    for (size_t c = 0; c < nc; c++) {
        __m256i X = _mm256_hadd_epi32(_mm256_hadd_epi32(part[c], part[nc + c]),
                                      _mm256_hadd_epi32(part[2 * nc + c], part[3 * nc + c]));
        __m256i Y = _mm256_hadd_epi32(_mm256_hadd_epi32(part[4 * nc + c], part[5 * nc + c]),
                                      _mm256_hadd_epi32(part[6 * nc + c], part[7 * nc + c]));
        acc = epilogue2(X, Y, c, zsum, dx, sct, acc);
    }
    return acc;
}

/* The row layout with the madd deferred: pass 1 keeps each chunk's int16
 * lane sums, pass 2 reduces 8 rows by two hadd16 levels (16 columns,
 * <= 30480: no saturation) and one madd. */
__attribute__((noinline)) static void row16_pass1(const shape *g, const uint8_t *r0,
                                                  const uint8_t *pf, const __m256i *xp,
                                                  __m256i *part)
{
    pass1(g, r0, pf, xp, part, 0);
}

__attribute__((noinline)) static __m256 row16_pass2(const shape *g, const __m256i *part,
                                                    const int32_t *zsum, const float *dx,
                                                    const float *sct)
{
    size_t nc = g->nc;
    const __m256i one = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (size_t c = 0; c < nc; c++) {
        __m256i X = _mm256_madd_epi16(
            _mm256_hadd_epi16(_mm256_hadd_epi16(part[c], part[nc + c]),
                              _mm256_hadd_epi16(part[2 * nc + c], part[3 * nc + c])), one);
        __m256i Y = _mm256_madd_epi16(
            _mm256_hadd_epi16(_mm256_hadd_epi16(part[4 * nc + c], part[5 * nc + c]),
                              _mm256_hadd_epi16(part[6 * nc + c], part[7 * nc + c])), one);
        acc = epilogue2(X, Y, c, zsum, dx, sct, acc);
    }
    return acc;
}

/* The interleaved layout: per sub-block j, 4 loads of 8 rows x 4 bytes,
 * each against its 4 input bytes (xb: low nibbles, then high) broadcast. */
__attribute__((noinline)) static __m256 interleaved(const shape *g, const uint8_t *p,
                                                    const int32_t *xb, const int32_t *zsum,
                                                    const float *dx, const float *sct)
{
    const size_t nsb = g->nsb;
    const __m256i lo4 = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (size_t j = 0; j < nsb; j++, p += 128) {
        const int32_t *xj = xb + 8 * j;
        __m256i s16 = _mm256_setzero_si256(); /* 8 steps of <= 3810: no saturation */
        for (int q = 0; q < 4; q++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * q));
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(v, lo4),
                                                             _mm256_set1_epi32(xj[2 * q])));
            s16 = _mm256_add_epi16(
                s16, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo4),
                                          _mm256_set1_epi32(xj[2 * q + 1])));
        }
        acc = epilogue(_mm256_madd_epi16(s16, one), zsum[j], dx[j], sct + 8 * j, acc);
    }
    return acc;
}

/* One thread's share: groups [g0, g1) of every variant, reps + 1 times
 * (the first not counted), between barriers; thread 0 keeps the times. */
typedef struct job {
    const shape *g;
    const uint8_t *w, *wi;
    const __m256i *xp;
    const int32_t *xb, *zsum;
    const float *dx, *sct;
    float *y_row, *y_il, *y_r16;
    size_t g0, g1, groups;
    uint32_t reps, prefetch, nthreads, tid;
    pthread_barrier_t *bar;
    double best[3];
} job;

static void *run_job(void *arg)
{
    job *j = arg;
    const shape *g = j->g;
    __m256i *part = aligned_alloc(64, 256 * g->nc);
    clockid_t clk = j->nthreads > 1 ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID;
    for (int v = 0; v < 3; v++)
        j->best[v] = 1e300;
    for (uint32_t rep = 0; rep <= j->reps; rep++)
        for (int v = 0; v < 3; v++) {
            pthread_barrier_wait(j->bar);
            double t0 = clock_us(clk);
            for (size_t gr = j->g0; gr < j->g1; gr++) {
                const uint8_t *r0 = j->w + gr * 8 * g->rb;
                const uint8_t *pf = j->prefetch && gr + 1 < j->groups ? r0 + 8 * g->rb : NULL;
                const float *sc = j->sct + gr * 8 * g->nsb;
                if (v == 0) {
                    row_pass1(g, r0, pf, j->xp, part);
                    _mm256_storeu_ps(j->y_row + 8 * gr, row_pass2(g, part, j->zsum, j->dx, sc));
                } else if (v == 1) {
                    _mm256_storeu_ps(j->y_il + 8 * gr, interleaved(g, j->wi + gr * 8 * g->rb,
                                                                   j->xb, j->zsum, j->dx, sc));
                } else {
                    row16_pass1(g, r0, pf, j->xp, part);
                    _mm256_storeu_ps(j->y_r16 + 8 * gr,
                                     row16_pass2(g, part, j->zsum, j->dx, sc));
                }
            }
            pthread_barrier_wait(j->bar);
            double dt = clock_us(clk) - t0;
            if (rep && dt < j->best[v])
                j->best[v] = dt;
        }
    free(part);
    return NULL;
}

int main(int argc, char **argv)
{
    uint32_t rows = 256, cols = 2048, reps = 200, prefetch = 1, threads = 1;
    const bench_arg args[] = {
        {"--rows", BENCH_ARG_U32, &rows},
        {"--cols", BENCH_ARG_U32, &cols},
        {"--reps", BENCH_ARG_U32, &reps},
        {"--prefetch", BENCH_ARG_U32, &prefetch},
        {"--threads", BENCH_ARG_U32, &threads},
    };
    for (int i = 1; i + 1 < argc; i += 2)
        if (!bench_arg_set(args, sizeof args / sizeof *args, argv[i], argv[i + 1])) {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    if (!rows || rows % 8 || !cols || cols % 64 || !reps || !threads || threads > 64 ||
        rows / 8 < threads) {
        fprintf(stderr, "want --rows a multiple of 8, --cols of 64, 1-64 --threads\n");
        return 2;
    }
    shape g = {.rb = cols / 2, .nc = cols / 64, .nsb = cols / 32};
    size_t bytes = (size_t)rows * g.rb, groups = rows / 8;
    uint8_t *w = aligned_alloc(64, bytes), *wi = aligned_alloc(64, bytes);
    int8_t *x = aligned_alloc(64, cols);
    __m256i *xp = aligned_alloc(64, 64 * g.nc);
    int32_t *xb = aligned_alloc(64, 32 * g.nsb), *zsum = malloc(4 * g.nsb);
    float *dx = malloc(4 * g.nsb), *sct = aligned_alloc(64, 32 * g.nsb * groups);
    float *y_row = malloc(4 * (size_t)rows), *y_il = malloc(4 * (size_t)rows);
    float *y_r16 = malloc(4 * (size_t)rows);
    uint64_t s = 1;
    for (size_t i = 0; i < bytes; i++)
        w[i] = (uint8_t)rng_next(&s);
    for (size_t i = 0; i < cols; i++)
        x[i] = (int8_t)(rng_next(&s) % 255 - 127);
    for (size_t j = 0; j < g.nsb; j++) {
        zsum[j] = (int32_t)(rng_next(&s) % 4096);
        dx[j] = rng_uniform(&s, 0.001f, 0.01f);
    }
    for (size_t i = 0; i < 8 * g.nsb * groups; i++)
        sct[i] = rng_uniform(&s, 0.5f, 1.5f);
    /* The row layout's input pairs: low nibbles of chunk c's byte i meet
     * xl[64 c + i], high nibbles xl[64 c + 32 + i]. */
    for (size_t c = 0; c < g.nc; c++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(x + 64 * c));
        __m256i b = _mm256_loadu_si256((const __m256i *)(x + 64 * c + 32));
        xp[2 * c] = _mm256_permute2x128_si256(a, b, 0x20);
        xp[2 * c + 1] = _mm256_permute2x128_si256(a, b, 0x31);
    }
    const int8_t *xl = (const int8_t *)xp;
    /* Sub-block j = 2c + h is the 128-bit half h of chunk c; its bytes
     * 4q..4q+3 go to load q, lane r of group row r. */
    for (size_t j = 0; j < g.nsb; j++) {
        size_t c = j / 2, h = j % 2;
        for (size_t q = 0; q < 4; q++) {
            int8_t lo[4], hi[4];
            for (size_t b = 0; b < 4; b++) {
                lo[b] = xl[64 * c + 16 * h + 4 * q + b];
                hi[b] = xl[64 * c + 32 + 16 * h + 4 * q + b];
            }
            memcpy(&xb[8 * j + 2 * q], lo, 4);
            memcpy(&xb[8 * j + 2 * q + 1], hi, 4);
        }
    }
    for (size_t gr = 0; gr < groups; gr++)
        for (size_t j = 0; j < g.nsb; j++)
            for (size_t q = 0; q < 4; q++)
                for (size_t r = 0; r < 8; r++)
                    memcpy(wi + gr * 8 * g.rb + 128 * j + 32 * q + 4 * r,
                           w + (gr * 8 + r) * g.rb + 32 * (j / 2) + 16 * (j % 2) + 4 * q, 4);
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, threads);
    job jobs[64];
    pthread_t tids[64];
    for (uint32_t t = 0; t < threads; t++) {
        jobs[t] = (job){.g = &g, .w = w, .wi = wi, .xp = xp, .xb = xb, .zsum = zsum, .dx = dx,
                        .sct = sct, .y_row = y_row, .y_il = y_il, .y_r16 = y_r16,
                        .g0 = groups * t / threads, .g1 = groups * (t + 1) / threads,
                        .groups = groups, .reps = reps, .prefetch = prefetch,
                        .nthreads = threads, .tid = t, .bar = &bar};
        if (t)
            pthread_create(&tids[t], NULL, run_job, &jobs[t]);
    }
    run_job(&jobs[0]);
    for (uint32_t t = 1; t < threads; t++)
        pthread_join(tids[t], NULL);
    pthread_barrier_destroy(&bar);
    double best_row = jobs[0].best[0], best_il = jobs[0].best[1], best_r16 = jobs[0].best[2];
    int same = memcmp(y_row, y_il, 4 * (size_t)rows) == 0 &&
               memcmp(y_row, y_r16, 4 * (size_t)rows) == 0;
    printf("{\"rows\":%u,\"cols\":%u,\"threads\":%u,\"code_bytes\":%zu,\"prefetch\":%u,"
           "\"row_us\":%.1f,"
           "\"row_gbps\":%.2f,\"interleaved_us\":%.1f,\"interleaved_gbps\":%.2f,"
           "\"interleaved_speedup\":%.3f,\"row16_us\":%.1f,\"row16_speedup\":%.3f,"
           "\"same_bits\":%s}\n",
           rows, cols, threads, bytes, prefetch, best_row, bytes / best_row / 1e3, best_il,
           bytes / best_il / 1e3, best_row / best_il, best_r16, best_row / best_r16,
           same ? "true" : "false");
    free(w);
    free(wi);
    free(x);
    free(xp);
    free(xb);
    free(zsum);
    free(dx);
    free(sct);
    free(y_row);
    free(y_il);
    free(y_r16);
    return same ? 0 : 1;
}
