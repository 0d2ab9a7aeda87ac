/* qmoe_cpu_bench - times qm_moe_forward on the CPU backend over a bank file,
 * and the machine's read bandwidth, for bench/qmoe_cpu/run.py.
 *
 *   qmoe_cpu_bench --bank F --tokens T [--threads 2] [--iters 20] [--warmup 3]
 *                  [--seed S] [--stream-mib 2048] [--precision exact|fast]
 *                  [--fma-peak] [--i8-peak] [--r8 1]
 *
 * Each call gets fresh random hidden states and router logits (from --seed,
 * drawn outside the timed region) and the calls cycle through the bank's
 * layers, so decode reads weights from memory, not from the caches. Prints
 * one JSON object per measurement on stdout (a call's wall time, and the
 * process CPU time per call, cpu_ms_median). Not a test. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../bench_pager.h"
#include "../bench_util.h"
#include "qm_backend.h"
#include "qm_bank.h"
#include "qm_moe.h"

/* CPU time of the whole process (every worker thread), seconds: under a
 * loaded machine's time-slicing it moves far less than wall time. */
static double process_cpu_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* ---- STREAM-like read: each thread sums its half of a large buffer ---- */

typedef struct stream_arg {
    const uint64_t *p;
    size_t n;
    uint64_t sum;
} stream_arg;

/* 256-bit loads, 8 independent accumulators, 512 bytes per iteration: the
 * loop issues loads as fast as the core can, so the memory is the limit
 * (a scalar loop measured 2-3x less than the kernels' own traffic here). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
__attribute__((target("avx2"))) static uint64_t stream_sum256(const uint64_t *p, size_t n)
{
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
            a7 = a0;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        const __m256i *q = (const __m256i *)(p + i);
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(q + 0));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(q + 1));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(q + 2));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(q + 3));
        a4 = _mm256_add_epi64(a4, _mm256_loadu_si256(q + 4));
        a5 = _mm256_add_epi64(a5, _mm256_loadu_si256(q + 5));
        a6 = _mm256_add_epi64(a6, _mm256_loadu_si256(q + 6));
        a7 = _mm256_add_epi64(a7, _mm256_loadu_si256(q + 7));
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(q + 8));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(q + 9));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(q + 10));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(q + 11));
        a4 = _mm256_add_epi64(a4, _mm256_loadu_si256(q + 12));
        a5 = _mm256_add_epi64(a5, _mm256_loadu_si256(q + 13));
        a6 = _mm256_add_epi64(a6, _mm256_loadu_si256(q + 14));
        a7 = _mm256_add_epi64(a7, _mm256_loadu_si256(q + 15));
    }
    a0 = _mm256_add_epi64(_mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)),
                          _mm256_add_epi64(_mm256_add_epi64(a4, a5), _mm256_add_epi64(a6, a7)));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, a0);
    uint64_t s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < n; i++)
        s += p[i];
    return s;
}
#endif

static void *stream_read(void *v)
{
    stream_arg *a = v;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (__builtin_cpu_supports("avx2")) {
        a->sum = stream_sum256(a->p, a->n);
        return NULL;
    }
#endif
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 4 <= a->n; i += 4) {
        s0 += a->p[i];
        s1 += a->p[i + 1];
        s2 += a->p[i + 2];
        s3 += a->p[i + 3];
    }
    a->sum = s0 + s1 + s2 + s3;
    return NULL;
}

static void measure_stream(size_t mib, unsigned threads, int reps)
{
    size_t bytes = mib << 20, n = bytes / 8;
    uint64_t *buf = malloc(bytes);
    if (!buf) {
        fprintf(stderr, "stream: cannot allocate %zu MiB\n", mib);
        return;
    }
    for (size_t i = 0; i < n; i++)
        buf[i] = i * 0x9e3779b97f4a7c15ull;
    double *gbps = calloc((size_t)reps, sizeof(double));
    uint64_t check = 0;
    for (int r = 0; r < reps; r++) {
        pthread_t th[64];
        stream_arg args[64];
        size_t per = n / threads;
        double t0 = now_s();
        for (unsigned i = 0; i < threads; i++) {
            args[i] = (stream_arg){.p = buf + i * per, .n = per};
            pthread_create(&th[i], NULL, stream_read, &args[i]);
        }
        for (unsigned i = 0; i < threads; i++) {
            pthread_join(th[i], NULL);
            check += args[i].sum;
        }
        gbps[r] = (double)(per * threads * 8) / (now_s() - t0) / 1e9;
    }
    qsort(gbps, (size_t)reps, sizeof(double), cmp_double);
    printf("{\"what\":\"stream_read\",\"mib\":%zu,\"threads\":%u,\"median_gbps\":%.3f,"
           "\"min_gbps\":%.3f,\"max_gbps\":%.3f,\"check\":%llu}\n",
           mib, threads, gbps[reps / 2], gbps[0], gbps[reps - 1],
           (unsigned long long)(check & 0xff));
    free(gbps);
    free(buf);
}

/* ---- FMA peak: independent FMA chains in registers, per thread ---- */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
typedef struct fma_arg {
    long iters;
    float (*loop)(long iters); /* the peak loop this thread runs */
    double secs;
    float sink;
} fma_arg;

/* 12 independent chains in named registers (an array may live in memory). */
#define FMA_BODY(T, FMADD)                                                                         \
    T a0 = SET1(0.f), a1 = SET1(1.f), a2 = SET1(2.f), a3 = SET1(3.f), a4 = SET1(4.f),              \
      a5 = SET1(5.f), a6 = SET1(6.f), a7 = SET1(7.f), a8 = SET1(8.f), a9 = SET1(9.f),              \
      a10 = SET1(10.f), a11 = SET1(11.f), m = SET1(0.999999f), c = SET1(1e-7f);                    \
    for (long it = 0; it < iters; it++) {                                                          \
        a0 = FMADD(a0, m, c), a1 = FMADD(a1, m, c), a2 = FMADD(a2, m, c);                         \
        a3 = FMADD(a3, m, c), a4 = FMADD(a4, m, c), a5 = FMADD(a5, m, c);                         \
        a6 = FMADD(a6, m, c), a7 = FMADD(a7, m, c), a8 = FMADD(a8, m, c);                         \
        a9 = FMADD(a9, m, c), a10 = FMADD(a10, m, c), a11 = FMADD(a11, m, c);                     \
        __asm__ volatile("" ::: "memory");                                                         \
    }

/* The twelve accumulators of FMA_BODY summed in one fixed tree. */
#define FMA_SUM(ADD)                                                                               \
    ADD(ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7))),                         \
        ADD(ADD(a8, a9), ADD(a10, a11)))

__attribute__((target("avx2,fma"))) static float fma_loop256(long iters)
{
#define SET1 _mm256_set1_ps
    FMA_BODY(__m256, _mm256_fmadd_ps)
#undef SET1
    return _mm256_cvtss_f32(FMA_SUM(_mm256_add_ps));
}

__attribute__((target("avx512f"))) static float fma_loop512(long iters)
{
#define SET1 _mm512_set1_ps
    FMA_BODY(__m512, _mm512_fmadd_ps)
#undef SET1
    return _mm512_reduce_add_ps(FMA_SUM(_mm512_add_ps));
}

/* This thread's CPU time: a peak is what a core does while it runs, so
 * other processes of a shared machine do not lower it. */
static double thread_cpu_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *peak_thread(void *v)
{
    fma_arg *a = v;
    double t0 = thread_cpu_s();
    a->sink = a->loop(a->iters);
    a->secs = thread_cpu_s() - t0;
    return NULL;
}

/* Five runs of `loop` on `threads` threads, sorted: each the sum over the
 * threads of ops_per_iter * iterations / the thread's own CPU time, in G/s. */
static void peak_runs(float (*loop)(long), unsigned threads, double ops_per_iter, double g[5])
{
    for (int rep = 0; rep < 5; rep++) {
        pthread_t th[64];
        fma_arg args[64];
        unsigned n = threads > 64 ? 64 : threads;
        for (unsigned t = 0; t < n; t++) {
            args[t] = (fma_arg){.iters = 20000000, .loop = loop};
            pthread_create(&th[t], NULL, peak_thread, &args[t]);
        }
        double sum = 0;
        for (unsigned t = 0; t < n; t++) {
            pthread_join(th[t], NULL);
            sum += ops_per_iter * (double)args[t].iters / args[t].secs / 1e9;
        }
        g[rep] = sum;
    }
    qsort(g, 5, sizeof(double), cmp_double);
}

/* peak_runs, printed as one JSON line: the median, min and max "G<unit>/s"
 * (unit "gflops", "gops") of probe `what` for `isa`. */
static void peak_line(const char *what, const char *isa, const char *unit, float (*loop)(long),
                      unsigned threads, double ops_per_iter)
{
    double g[5];
    peak_runs(loop, threads, ops_per_iter, g);
    printf("{\"what\":\"%s\",\"isa\":\"%s\",\"threads\":%u,\"median_%s\":%.1f,"
           "\"min_%s\":%.1f,\"max_%s\":%.1f}\n",
           what, isa, threads, unit, g[2], unit, g[0], unit, g[4]);
}

/* Median over 5 runs of the summed per-thread GFLOP/s (2 flops per lane per
 * FMA), each thread timed by its own CPU time. */
static void measure_fma(unsigned threads)
{
    __builtin_cpu_init();
    for (int wide = 0; wide < 2; wide++) {
        if (wide && !__builtin_cpu_supports("avx512f"))
            continue;
        if (!__builtin_cpu_supports("fma"))
            continue;
        peak_line("fma_peak", wide ? "avx512" : "avx2", "gflops", wide ? fma_loop512 : fma_loop256,
                  threads, 2.0 * (wide ? 16 : 8) * 12);
    }
}

/* ---- int8 dot peak: the int8 dot step of each ISA in 12 independent chains ----
 * AVX2: vpmaddubsw (32 u8 x s8 products, summed in pairs) then vpaddw, the
 * step of qmoed's AVX2 fast GEMM and of ggml's Q4_0/Q8_0 dots; AVX-512
 * VNNI: vpdpbusd on 512 bits (64 products). Counted as 2 ops per product. */
#define I8_BODY(T, STEP)                                                                           \
    T a0 = SET1(0), a1 = SET1(1), a2 = SET1(2), a3 = SET1(3), a4 = SET1(4), a5 = SET1(5),          \
      a6 = SET1(6), a7 = SET1(7), a8 = SET1(8), a9 = SET1(9), a10 = SET1(10), a11 = SET1(11),      \
      w = SET1(0x05040302), x = SET1(0x01ff02fe);                                                  \
    for (long it = 0; it < iters; it++) {                                                          \
        a0 = STEP(a0, w, x), a1 = STEP(a1, w, x), a2 = STEP(a2, w, x), a3 = STEP(a3, w, x);       \
        a4 = STEP(a4, w, x), a5 = STEP(a5, w, x), a6 = STEP(a6, w, x), a7 = STEP(a7, w, x);       \
        a8 = STEP(a8, w, x), a9 = STEP(a9, w, x), a10 = STEP(a10, w, x), a11 = STEP(a11, w, x);   \
        __asm__ volatile("" : "+x"(w), "+x"(x));                                                   \
    }

#define I8_SUM(ADD)                                                                                \
    ADD(ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7))),                         \
        ADD(ADD(a8, a9), ADD(a10, a11)))

#define I8_STEP_AVX2(a, w, x) _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x))
__attribute__((target("avx2"))) static float i8_loop256(long iters)
{
#define SET1 _mm256_set1_epi32
    I8_BODY(__m256i, I8_STEP_AVX2)
#undef SET1
    return (float)_mm256_extract_epi16(I8_SUM(_mm256_add_epi16), 0);
}

__attribute__((target("avx512f,avx512vnni"))) static float i8_loop512(long iters)
{
#define SET1 _mm512_set1_epi32
    I8_BODY(__m512i, _mm512_dpbusd_epi32)
#undef SET1
    return (float)_mm512_reduce_add_epi32(I8_SUM(_mm512_add_epi32));
}

/* Median over 5 runs of the summed per-thread GOP/s. AMX (tdpbssd) is not
 * measured: it needs the tile permission, and the kernels say where it ran. */
static void measure_i8(unsigned threads)
{
    __builtin_cpu_init();
    for (int wide = 0; wide < 2; wide++) {
        if (wide ? !__builtin_cpu_supports("avx512vnni") : !__builtin_cpu_supports("avx2"))
            continue;
        peak_line("i8_peak", wide ? "avx512vnni" : "avx2", "gops", wide ? i8_loop512 : i8_loop256,
                  threads, 2.0 * (wide ? 64 : 32) * 12);
    }
}
#else
static void measure_fma(unsigned threads)
{
    (void)threads;
}
static void measure_i8(unsigned threads)
{
    (void)threads;
}
#endif

int main(int argc, char **argv)
{
    const char *bank_path = NULL;
    unsigned tokens = 1, threads = 2, iters = 20, warmup = 3;
    size_t stream_mib = 0;
    uint64_t seed = 1;
    int fast = 0, fma_peak = 0, i8_peak = 0, r8 = 0;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--fma-peak") || !strcmp(a, "--i8-peak")) {
            *(a[2] == 'f' ? &fma_peak : &i8_peak) = 1;
            i--;
            continue;
        }
        if (!v) {
            fprintf(stderr, "%s needs a value\n", a);
            return 2;
        }
        if (!strcmp(a, "--bank"))
            bank_path = v;
        else if (!strcmp(a, "--tokens"))
            tokens = (unsigned)atoi(v);
        else if (!strcmp(a, "--threads"))
            threads = (unsigned)atoi(v);
        else if (!strcmp(a, "--iters"))
            iters = (unsigned)atoi(v);
        else if (!strcmp(a, "--warmup"))
            warmup = (unsigned)atoi(v);
        else if (!strcmp(a, "--seed"))
            seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--precision") && (!strcmp(v, "exact") || !strcmp(v, "fast")))
            fast = !strcmp(v, "fast");
        else if (!strcmp(a, "--r8"))
            r8 = atoi(v);
        else if (!strcmp(a, "--stream-mib"))
            stream_mib = (size_t)atol(v);
        else {
            fprintf(stderr, "unknown option %s\n", a);
            return 2;
        }
    }
    if (stream_mib)
        measure_stream(stream_mib, threads, 7);
    if (fma_peak)
        measure_fma(threads);
    if (i8_peak)
        measure_i8(threads);
    if (!bank_path)
        return 0;
    if (iters == 0)
        iters = 1;

    qm_status st = {0};
    qm_bank *bank = NULL;
    qm_backend *be = NULL;
    if (qm_bank_open(bank_path, &bank, &st) < 0 || qm_backend_cpu_new(threads, &be, &st) < 0) {
        fprintf(stderr, "qmoe_cpu_bench: %s\n", st.msg);
        return 1;
    }
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    /* Fault the whole mapping in first: a serving daemon keeps its banks
     * mapped, and the peer holds its weights in memory too. */
    {
        uint8_t acc = 0;
        for (uint32_t l = 0; l < cfg->layers; l++) {
            const qm_layer_view *lv = qm_bank_layer(bank, l);
            for (int t = 0; t < QM_T_COUNT; t++) {
                const volatile uint8_t *d = lv->t[t].data;
                for (uint64_t off = 0; lv->t[t].present && off < lv->t[t].nbytes; off += 4096)
                    acc ^= d[off];
            }
        }
        (void)acc;
    }
    qm_device_info info;
    qm_backend_info(be, &info);
    qm_expert_source src;
    qm_expert_source_direct(bank, &src);
    /* --r8 1: the calls go through a whole-bank pager that lays the bank out
     * as a fast session of the daemon does (opt.interleave, qm_r8.h). */
    qm_policy pol = {0};
    qm_residency_plan *plan = NULL;
    qm_pager *pg = NULL;
    if (r8) {
        qm_pager_options o = {.interleave = 1};
        if (bench_pager_new(be, bank, "whole_bank", 0, &o, &pol, &plan, &pg, &st) < 0) {
            fprintf(stderr, "qmoe_cpu_bench: pager: %s\n", st.msg);
            return 1;
        }
        qm_pager_stats ps;
        qm_pager_stats_get(pg, &ps);
        fprintf(stderr, "qmoe_cpu_bench: %llu bytes of weights in the r8 layout\n",
                (unsigned long long)ps.bytes_interleaved_at_create);
    }
    size_t TH = (size_t)tokens * cfg->hidden, TE = (size_t)tokens * cfg->experts;
    float *x = malloc(TH * 4), *lg = malloc(TE * 4), *out = malloc(TH * 4);
    uint32_t *re = malloc((size_t)tokens * cfg->k * 4);
    double *ms = calloc(iters, sizeof(double)), *cpu = calloc(iters, sizeof(double));
    double bytes_sum = 0;
    uint64_t rng = seed;
    for (unsigned it = 0; it < warmup + iters; it++) {
        for (size_t i = 0; i < TH; i++)
            x[i] = rng_uniform(&rng, -1.0f, 1.0f);
        for (size_t i = 0; i < TE; i++)
            lg[i] = rng_uniform(&rng, -3.0f, 3.0f);
        uint32_t layer = it % cfg->layers;
        qm_moe_call call = {.layer = layer, .dtype = QM_DTYPE_F32, .hidden = x,
                            .n_tokens = tokens, .logits = lg, .output = out,
                            .route_experts = re,
                            .precision = fast ? QM_PRECISION_FAST : QM_PRECISION_EXACT};
        double t0 = now_s(), c0 = process_cpu_s();
        if ((pg ? qm_pager_forward(pg, &call, NULL, &st)
                : qm_moe_forward(be, bank, &call, &src, NULL, &st)) < 0) {
            fprintf(stderr, "qmoe_cpu_bench: forward: %s\n", st.msg);
            return 1;
        }
        double dt = now_s() - t0, dc = process_cpu_s() - c0;
        if (it < warmup)
            continue;
        ms[it - warmup] = dt * 1e3;
        cpu[it - warmup] = dc * 1e3;
        /* Bytes of every distinct expert this call touched. */
        char used[4096] = {0};
        uint64_t bytes = 0;
        const qm_layer_view *lv = qm_bank_layer(bank, layer);
        for (size_t i = 0; i < (size_t)tokens * cfg->k; i++)
            if (re[i] != QM_ROUTE_DROPPED && re[i] < 4096 && !used[re[i]]) {
                used[re[i]] = 1;
                bytes += lv->bytes_per_expert;
            }
        bytes_sum += (double)bytes;
    }
    double mean_bytes = bytes_sum / iters;
    double sorted[iters];
    memcpy(sorted, ms, sizeof sorted);
    qsort(sorted, iters, sizeof(double), cmp_double);
    double med = sorted[iters / 2];
    qsort(cpu, iters, sizeof(double), cmp_double);
    printf("{\"what\":\"qmoed\",\"precision\":\"%s\",\"backend\":\"%s\",\"tokens\":%u,\"threads\":%u,\"iters\":%u,"
           "\"median_ms\":%.4f,\"min_ms\":%.4f,\"max_ms\":%.4f,\"cpu_ms_median\":%.4f,"
           "\"bytes_per_call\":%.0f,\"gbps_median\":%.3f,\"samples_ms\":[",
           fast ? "fast" : "exact", info.name, tokens, threads, iters, med, sorted[0], sorted[iters - 1],
           cpu[iters / 2], mean_bytes, mean_bytes / (med * 1e-3) / 1e9);
    print_samples_end(ms, iters);
    free(x);
    free(lg);
    free(out);
    free(re);
    free(ms);
    free(cpu);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    qm_backend_free(be);
    qm_bank_close(bank);
    return 0;
}
