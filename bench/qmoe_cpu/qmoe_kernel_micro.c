/* qmoe_kernel_micro - every CPU kernel of this build on one matrix, one
 * thread, timed by thread CPU time (a shared machine's other processes cost
 * wall time, not this thread's CPU time): what the measured kernel choice
 * of engine/kernels/qm_kernel_select.c weighs, on a larger matrix (docs/BENCHMARKS.md).
 *
 *   qmoe_kernel_micro [--rows 512] [--cols 2880] [--bits 4|8] [--inputs 1] [--reps 30]
 *                     [--hugepages 1]
 *
 * Random codes, f32 scales, blocks of 32: the matrix (rows x cols x bits/8
 * bytes) is meant to stay in L2, so this measures each kernel's compute, not
 * the memory. --inputs <= 4 runs the GEMV path of the exact kernels, more
 * the GEMM path. The fast kernels are the fast table's rows
 * (engine/kernels/qm_kernel_isa.h), each as it serves (NAME), its two paths
 * at this input count (NAME-gemv, NAME-gemm) and, for a row that reads the
 * r8 layout (4-bit, rows a multiple of 8), the same codes interleaved
 * (NAME-r8, the layout a fast whole-bank session gets). One JSON line per
 * kernel: best time over --reps (after one warm-up), weight GB/s per core
 * (codes; read_gbps_per_core: codes and scales) and GFLOP/s per core. A
 * "read" line before and after the kernels times a plain read of the same
 * bytes the same way: with a matrix far larger than the caches (e.g.
 * --rows 131072 --cols 2048: 128 MiB of 4-bit codes) a decode kernel's
 * read_gbps_per_core over it is its share of a core's read bandwidth,
 * robust to a shared machine's time-slicing (thread CPU time). Kernels this
 * CPU cannot run are skipped with a line saying why. The last lines: the
 * self-check's cost, and how long the default exact choice's calibration
 * took (thread CPU time) and what it chose. Not a test. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "qm_kernel_check.h"
#include "qm_kernel_isa.h"
#include "qm_r8.h"

static double cpu_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

/* A kernel's line: weight_gbps_per_core counts the codes, read_gbps_per_core
 * the codes and the f32 scales (what it reads of the matrix). */
static void report(const char *mode, const char *name, uint32_t n, uint32_t k, uint32_t bits,
                   uint32_t nx, double us)
{
    double codes = (double)n * k * bits / 8, scales = (double)n * (k / 32) * 4;
    printf("{\"mode\":\"%s\",\"kernel\":\"%s\",\"rows\":%u,\"cols\":%u,\"bits\":%u,\"inputs\":%u,"
           "\"best_us\":%.1f,\"weight_gbps_per_core\":%.2f,\"read_gbps_per_core\":%.2f,"
           "\"gflops_per_core\":%.1f}\n",
           mode, name, n, k, bits, nx, us, codes / us / 1e3, (codes + scales) / us / 1e3,
           2.0 * n * k * nx / us / 1e3);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
/* The bytes [p, p + n) summed with 256-bit loads into 8 accumulators: the
 * read bandwidth a core reaches (n a multiple of 256). */
__attribute__((target("avx2"))) static uint64_t read_sum(const uint8_t *p, size_t n)
{
    __m256i a[8];
    for (int i = 0; i < 8; i++)
        a[i] = _mm256_setzero_si256();
    for (size_t o = 0; o + 256 <= n; o += 256)
        for (int i = 0; i < 8; i++)
            a[i] = _mm256_add_epi64(a[i], _mm256_loadu_si256((const __m256i *)(p + o + 32 * i)));
    uint64_t s[4], t = 0;
    for (int i = 1; i < 8; i++)
        a[0] = _mm256_add_epi64(a[0], a[i]);
    _mm256_storeu_si256((__m256i *)s, a[0]);
    for (int i = 0; i < 4; i++)
        t += s[i];
    return t;
}
#else
static uint64_t read_sum(const uint8_t *p, size_t n)
{
    uint64_t t = 0;
    for (size_t o = 0; o < n; o += 8) {
        uint64_t v;
        memcpy(&v, p + o, 8);
        t += v;
    }
    return t;
}
#endif

/* A plain read of the matrix's codes and scales, timed like the kernels
 * (thread CPU time, best of reps): each kernel's read_gbps_per_core over
 * this line's is its share of what one core reads (from memory when the
 * matrix is far larger than the caches). */
static void read_line(const qm__qmat *m, uint32_t reps)
{
    size_t codes = (size_t)m->n * m->row_bytes, scales = (size_t)m->n * m->nblk * 4;
    double best = 1e300;
    volatile uint64_t sink = 0;
    for (uint32_t rep = 0; rep <= reps; rep++) {
        double t0 = cpu_us();
        sink += read_sum(m->w, codes / 256 * 256) + read_sum(m->scales, scales / 256 * 256);
        double dt = cpu_us() - t0;
        if (rep && dt < best)
            best = dt;
    }
    (void)sink;
    printf("{\"mode\":\"read\",\"kernel\":\"read\",\"bytes\":%zu,\"best_us\":%.1f,"
           "\"read_gbps_per_core\":%.2f}\n", codes + scales, best, (codes + scales) / best / 1e3);
}

static int hugepages; /* --hugepages 1: the large buffers asked for 2 MiB pages */

/* A buffer of n bytes; with --hugepages, 2 MiB aligned and madvise'd for
 * transparent huge pages (what the kernels' TLB misses cost, from memory). */
static void *big_alloc(size_t n)
{
    if (!hugepages)
        return malloc(n);
    size_t al = (size_t)2 << 20, len = (n + al - 1) / al * al;
    void *p = aligned_alloc(al, len);
    if (p)
        madvise(p, len, MADV_HUGEPAGE);
    return p;
}

static void skipped(const char *mode, const char *name, const char *why)
{
    printf("{\"mode\":\"%s\",\"kernel\":\"%s\",\"skipped\":\"%s\"}\n", mode, name, why);
}

/* The scalar kernel and every row of the exact table this CPU runs. */
static void exact_kernels(const qm__qmat *m, const float *x, uint32_t nx, int gemm, uint32_t reps,
                          float *y, float *scratch)
{
    for (size_t i = 0; i <= qm__exact_count(); i++) {
        const qm__kernel *k = i ? qm__exact_at(i - 1) : &qm__kernel_scalar;
        char why[128];
        if (!qm__cpu_needs(k->needs, why, sizeof why)) {
            skipped("exact", k->name, why);
            continue;
        }
        size_t ld = (k->x_stride(m, gemm) + 15) & ~(size_t)15;
        uint32_t rows = (nx + 11) / 12 * 12; /* room for any gemm_row_pad */
        float *xp = calloc(ld * rows, sizeof(float));
        for (uint32_t r = 0; r < nx; r++)
            k->prep(m, gemm, x + (size_t)r * m->k, xp + r * ld);
        report("exact", k->name, m->n, m->k, m->bits, nx,
               qm__kernel_best_sweep(gemm ? k->gemm : k->gemv, m, xp, ld, nx, y, scratch,
                                     i ? reps : 1));
        free(xp);
    }
}

/* The scalar fast kernel and every row of the fast table this CPU runs:
 * as it serves, its two paths, and on r8 codes where it reads them. */
static void fast_kernels(const qm__qmat *m, const float *x, uint32_t nx, uint32_t reps, float *y)
{
    size_t ld = (qm__i8_x_stride(m) + 15) & ~(size_t)15;
    float *xq = calloc(ld * nx, sizeof(float));
    for (uint32_t r = 0; r < nx; r++)
        qm__i8_prep(m, x + (size_t)r * m->k, xq + r * ld);
    qm__qmat mi = *m;
    int r8 = (m->bits == 4 || m->bits == 8) && m->n % 8 == 0;
    uint8_t *wi = big_alloc((size_t)m->n * m->row_bytes), *tmp = malloc(8 * m->row_bytes);
    memcpy(wi, m->w, (size_t)m->n * m->row_bytes);
    if (r8)
        qm__r8_interleave(wi, m->n, m->row_bytes, tmp);
    mi.w = wi;
    mi.r8 = 1;
    float *scratch = malloc(sizeof(float) * qm__kernel_scratch_floats(&mi));
    report("fast", "scalar", m->n, m->k, m->bits, nx,
           qm__kernel_best_sweep(qm__i8kernel_scalar.mm, m, xq, ld, nx, y, scratch, 1));
    for (size_t i = 0; i < qm__i8isa_count(); i++) {
        const qm__i8isa *row = qm__i8isa_at(i);
        char why[128], name[64];
        if (row->not_built || !qm__cpu_needs(row->needs, why, sizeof why)) {
            skipped("fast", row->kernel.name, row->not_built ? row->not_built : why);
            continue;
        }
        qm__mm_fn *fns[4] = {row->kernel.mm, row->gemv, row->gemm, row->kernel.mm};
        static const char *const suffix[4] = {"", "-gemv", "-gemm", "-r8"};
        for (int f = 0; f < 4; f++) {
            snprintf(name, sizeof name, "%s%s", row->kernel.name, suffix[f]);
            int reads = m->bits == 8 ? row->reads_r8_q8 : row->reads_r8;
            if (f == 3 && (!reads || !r8)) {
                skipped("fast", name, reads ? "not an r8 shape (4- or 8-bit, rows of 8)"
                                            : "this kernel does not read r8 of this width");
                continue;
            }
            report("fast", name, m->n, m->k, m->bits, nx,
                   qm__kernel_best_sweep(fns[f], f == 3 ? &mi : m, xq, ld, nx, y, scratch, reps));
        }
    }
    free(wi), free(tmp), free(xq), free(scratch);
}

int main(int argc, char **argv)
{
    uint32_t N = 512, K = 2880, bits = 4, nx = 1, reps = 30;
    for (int i = 1; i + 1 < argc; i += 2) {
        uint32_t v = (uint32_t)strtoul(argv[i + 1], NULL, 10);
        if (!strcmp(argv[i], "--rows"))
            N = v;
        else if (!strcmp(argv[i], "--cols"))
            K = v;
        else if (!strcmp(argv[i], "--bits"))
            bits = v;
        else if (!strcmp(argv[i], "--inputs"))
            nx = v;
        else if (!strcmp(argv[i], "--reps"))
            reps = v;
        else if (!strcmp(argv[i], "--hugepages"))
            hugepages = (int)v;
        else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    unsetenv("QMOE_KERNEL_CACHE"); /* the self-check runs here, not from a cache */
    if ((bits != 4 && bits != 8) || K % 32 || N % 16 || !N || !nx || !reps) {
        fprintf(stderr, "want --bits 4|8, --cols a multiple of 32, --rows of 16\n");
        return 2;
    }
    uint32_t nblk = K / 32;
    uint8_t *w = big_alloc((size_t)N * K);
    float *sc = big_alloc(sizeof(float) * N * nblk), *x = malloc(sizeof(float) * K * nx);
    float *y = malloc(sizeof(float) * N * nx);
    uint32_t s = 1;
    for (size_t i = 0; i < (size_t)N * K; i++)
        w[i] = (uint8_t)((s = s * 1664525u + 1013904223u) >> 24);
    for (size_t i = 0; i < (size_t)N * nblk; i++)
        sc[i] = 0.001f * (float)(1 + i % 5);
    for (size_t i = 0; i < (size_t)K * nx; i++)
        x[i] = (float)((int)((s = s * 1664525u + 1013904223u) >> 25) - 64) / 64.0f;
    qm__qmat m = {.w = w, .row_bytes = (size_t)K * bits / 8, .scales = sc,
                  .scale_dtype = QM_DTYPE_F32, .n = N, .k = K, .bits = bits, .nblk = nblk,
                  .block = 32};
    float *scratch = malloc(sizeof(float) * qm__kernel_scratch_floats(&m));
    int gemm = nx > QM__GEMV_MAX_ROWS;
    read_line(&m, reps);
    exact_kernels(&m, x, nx, gemm, reps, y, scratch);
    fast_kernels(&m, x, nx, reps, y);
    read_line(&m, reps);
    /* The self-check (qm_kernel_check.c, wall time; no cache), then the
     * default exact choice's calibration (qm_kernel_select.c), thread CPU time. */
    unsetenv("QMOE_KERNEL");
    unsetenv("QMOE_KERNEL_CACHE");
    double t0 = cpu_us();
    const qm_kernel_check *kc = qm_kernel_check_run();
    printf("{\"self_check_ms\":%.2f,\"self_check_cpu_ms\":%.2f,\"verified\":%u,\"refused\":%u}\n",
           kc->ms, (cpu_us() - t0) / 1e3, kc->verified, kc->refused);
    t0 = cpu_us();
    const char *choice = qm__kernel_recalibrate();
    printf("{\"calibration_ms\":%.2f,\"choice\":\"%s\"}\n", (cpu_us() - t0) / 1e3, choice);
    free(w);
    free(sc);
    free(x);
    free(y);
    free(scratch);
    return 0;
}
