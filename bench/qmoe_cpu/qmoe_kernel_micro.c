/* qmoe_kernel_micro - every CPU kernel of this build on one matrix, one
 * thread, timed by thread CPU time (a shared machine's other processes cost
 * wall time, not this thread's CPU time): what the measured kernel choice
 * of engine/kernels/qm_kernel_select.c weighs, on a larger matrix (docs/BENCHMARKS.md).
 *
 *   qmoe_kernel_micro [--rows 512] [--cols 2880] [--bits 4|8] [--inputs 1] [--reps 30]
 *
 * Random codes, f32 scales, blocks of 32: the matrix (rows x cols x bits/8
 * bytes) is meant to stay in L2, so this measures each kernel's compute, not
 * the memory. --inputs <= 4 runs the GEMV path of the exact kernels, more
 * the GEMM path; the fast kernels have one entry for both. One JSON line per
 * kernel: best time over --reps (after one warm-up), weight GB/s per core
 * (GEMV) or GFLOP/s per core. Kernels this CPU cannot run are skipped with a
 * line saying so. The last line: how long the default exact choice's
 * calibration took (thread CPU time) and what it chose. Not a test. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "qm_kernels.h"
#include "qm_r8.h"

static double cpu_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

static void report(const char *mode, const char *name, uint32_t n, uint32_t k, uint32_t bits,
                   uint32_t nx, double us)
{
    printf("{\"mode\":\"%s\",\"kernel\":\"%s\",\"rows\":%u,\"cols\":%u,\"bits\":%u,\"inputs\":%u,"
           "\"best_us\":%.1f,\"weight_gbps_per_core\":%.2f,\"gflops_per_core\":%.1f}\n",
           mode, name, n, k, bits, nx, us, (double)n * k * bits / 8 / us / 1e3,
           2.0 * n * k * nx / us / 1e3);
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
        else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if ((bits != 4 && bits != 8) || K % 32 || N % 16 || !N || !nx || !reps) {
        fprintf(stderr, "want --bits 4|8, --cols a multiple of 32, --rows of 16\n");
        return 2;
    }
    uint32_t nblk = K / 32;
    uint8_t *w = malloc((size_t)N * K);
    float *sc = malloc(sizeof(float) * N * nblk), *x = malloc(sizeof(float) * K * nx);
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
    /* QMOE_KERNEL values and the kernel each names ("avx2": the AVX2
     * kernel with the canonical 4-bit GEMV, AVX-512's co-candidate). */
    static const char *const exact[][2] = {{"scalar", "scalar"},
                                           {"avx2-canonical", "avx2"},
                                           {"avx2-folded", "avx2-folded"},
                                           {"avx512", "avx512"}};
    for (int e = 0; e < 4; e++) {
        setenv("QMOE_KERNEL", exact[e][0], 1);
        const qm__kernel *k = qm__kernel_select();
        if (strcmp(k->name, exact[e][1]) != 0) {
            printf("{\"mode\":\"exact\",\"kernel\":\"%s\",\"skipped\":\"this CPU cannot run it\"}\n",
                   exact[e][1]);
            continue;
        }
        size_t ld = (k->x_stride(&m, gemm) + 15) & ~(size_t)15;
        uint32_t rows = (nx + 11) / 12 * 12; /* room for any gemm_row_pad */
        float *xp = calloc(ld * rows, sizeof(float));
        for (uint32_t r = 0; r < nx; r++)
            k->prep(&m, gemm, x + (size_t)r * K, xp + r * ld);
        double best = 1e300;
        for (uint32_t rep = 0; rep <= (e ? reps : 1); rep++) {
            double t0 = cpu_us();
            for (uint32_t n0 = 0; n0 < N; n0 += QM__TILE_ROWS)
                (gemm ? k->gemm : k->gemv)(&m, n0, n0 + QM__TILE_ROWS, xp, ld, nx, y, N, scratch);
            double dt = cpu_us() - t0;
            if (rep && dt < best)
                best = dt;
        }
        report("exact", k->name, N, K, bits, nx, best);
        free(xp);
    }
    /* The fast kernels, and the AVX2 kernel's two paths at any input count
     * (where its GEMV / GEMM split should lie). */
    static const char *const fast[] = {"scalar",    "avx2",      "avxvnni",         "avx512vnni",
                                       "amx",       "avx2-gemv", "avx2-gemm",       "avx512vnni-gemv",
                                       "avx512vnni-gemm"};
    for (int e = 0; e < 9; e++) {
        int path = e >= 5 ? (e - 5) % 2 : -1;
        const char *base = e >= 7 ? "avx512vnni" : e >= 5 ? "avx2" : fast[e];
        setenv("QMOE_KERNEL", base, 1);
        const qm__i8kernel *k = qm__i8kernel_select();
        if (strcmp(k->name, base) != 0) {
            printf("{\"mode\":\"fast\",\"kernel\":\"%s\",\"skipped\":\"this CPU cannot run it\"}\n",
                   fast[e]);
            continue;
        }
        size_t ld = (qm__i8_x_stride(&m) + 15) & ~(size_t)15;
        float *xq = calloc(ld * nx, sizeof(float));
        for (uint32_t r = 0; r < nx; r++)
            qm__i8_prep(&m, x + (size_t)r * K, xq + r * ld);
        double best = 1e300;
        for (uint32_t rep = 0; rep <= (e ? reps : 1); rep++) {
            double t0 = cpu_us();
            for (uint32_t n0 = 0; n0 < N; n0 += QM__TILE_ROWS)
#if defined(QMOE_X86_KERNELS)
                if (path >= 0 && e >= 7)
                    qm__i8mm_avx512vnni_path(path, &m, n0, n0 + QM__TILE_ROWS, xq, ld, nx, y, N,
                                             scratch);
                else if (path >= 0)
                    qm__i8mm_avx2_path(path, &m, n0, n0 + QM__TILE_ROWS, xq, ld, nx, y, N, scratch);
                else
#endif
                    k->mm(&m, n0, n0 + QM__TILE_ROWS, xq, ld, nx, y, N, scratch);
            double dt = cpu_us() - t0;
            if (rep && dt < best)
                best = dt;
        }
        report("fast", fast[e], N, K, bits, nx, best);
        free(xq);
    }
    /* The AVX2 decode GEMV on the same codes in the r8 layout (qm_r8.h:
     * 4-bit, rows a multiple of 8), the engine's layout for it. */
    setenv("QMOE_KERNEL", "avx2", 1);
    const qm__i8kernel *a2 = qm__i8kernel_select();
    if (bits == 4 && N % 8 == 0 && strcmp(a2->name, "avx2") == 0 &&
        qm__i8kernel_r8_native(a2, nx)) {
        qm__qmat mi = m;
        uint8_t *wi = malloc((size_t)N * m.row_bytes), *tmp = malloc(8 * m.row_bytes);
        memcpy(wi, w, (size_t)N * m.row_bytes);
        qm__r8_interleave(wi, N, m.row_bytes, tmp);
        mi.w = wi;
        mi.r8 = 1;
        size_t ld = (qm__i8_x_stride(&m) + 15) & ~(size_t)15;
        float *xq = calloc(ld * nx, sizeof(float));
        float *sr8 = malloc(sizeof(float) * qm__kernel_scratch_floats(&mi));
        for (uint32_t r = 0; r < nx; r++)
            qm__i8_prep(&m, x + (size_t)r * K, xq + r * ld);
        double best = 1e300;
        for (uint32_t rep = 0; rep <= reps; rep++) {
            double t0 = cpu_us();
            for (uint32_t n0 = 0; n0 < N; n0 += QM__TILE_ROWS)
                a2->mm(&mi, n0, n0 + QM__TILE_ROWS, xq, ld, nx, y, N, sr8);
            double dt = cpu_us() - t0;
            if (rep && dt < best)
                best = dt;
        }
        report("fast", "avx2-r8", N, K, bits, nx, best);
        free(wi), free(tmp), free(xq), free(sr8);
    } else {
        printf("{\"mode\":\"fast\",\"kernel\":\"avx2-r8\",\"skipped\":\"%s\"}\n",
               strcmp(a2->name, "avx2") ? "this CPU cannot run it"
                                        : "not an r8 shape (4-bit, rows of 8, at most 4 inputs)");
    }
    /* The default exact choice's calibration (qm_kernel_select.c), thread CPU time. */
    unsetenv("QMOE_KERNEL");
    unsetenv("QMOE_KERNEL_CACHE");
    double t0 = cpu_us();
    const char *choice = qm__kernel_recalibrate();
    printf("{\"calibration_ms\":%.2f,\"choice\":\"%s\"}\n", (cpu_us() - t0) / 1e3, choice);
    free(w);
    free(sc);
    free(x);
    free(y);
    free(scratch);
    return 0;
}
