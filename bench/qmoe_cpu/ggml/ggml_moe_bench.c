/* ggml_moe_bench - llama.cpp's engine (ggml's CPU MUL_MAT_ID) on a MoE layer's
 * two expert matmuls, for bench/qmoe_cpu/run.py: the baseline qmoed's CPU
 * kernels are measured against. Built by build.sh against the ggml that the
 * pinned llama-cpp-python sdist carries; this file only calls ggml's API.
 *
 *   ggml_moe_bench --type q4_0|q8_0 --hidden H --inter I --experts E --k K
 *                  --layers L --tokens T [--threads 2] [--iters 20] [--warmup 3] [--seed S]
 *
 * Per layer: fc1 = mul_mat_id(W1 [E][2I][H], x [T][H], ids [T][K]) (gate and
 * up fused, as a swiglu layer's fc1) and fc2 = mul_mat_id(W2 [E][H][I],
 * a [T][K][I], ids), one graph, `threads` threads on a persistent pool.
 * The swiglu between them is left out (a few microseconds; fc2 gets its own
 * random input), so ggml is timed on the matmuls alone: in its favour.
 * Weights are random blocks (codes uniform, scales ~ 1 / (sqrt(K) * 8)); each
 * call gets fresh x, a and routing (K distinct experts per token, uniform),
 * drawn outside the timed region, and the calls cycle through L layers so
 * the weights come from memory (L * E * experts' bytes >> LLC). Prints one
 * JSON line. Not a test. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../bench_util.h"
#include "ggml-cpu.h"
#include "ggml.h"

/* Random blocks of a Q4_0 / Q8_0 tensor: each block is an f16 scale then codes. */
static void fill_quant(struct ggml_tensor *t, int k_cols, uint64_t *s)
{
    size_t bsz = ggml_type_size(t->type);
    size_t nb = ggml_nbytes(t) / bsz;
    uint8_t *p = t->data;
    float base = 1.0f / (sqrtf((float)k_cols) * 8.0f);
    for (size_t i = 0; i < nb; i++, p += bsz) {
        ggml_fp16_t d = ggml_fp32_to_fp16(base * rng_uniform(s, 0.5f, 1.5f));
        memcpy(p, &d, sizeof d);
        for (size_t j = sizeof d; j < bsz; j += 8) {
            uint64_t r = rng_next(s);
            memcpy(p + j, &r, bsz - j < 8 ? bsz - j : 8);
        }
    }
}

int main(int argc, char **argv)
{
    const char *type_s = "q4_0";
    int H = 2880, I = 2880, E = 32, K = 4, L = 2, T = 1, threads = 2, iters = 20, warmup = 3;
    uint64_t seed = 1;
    const bench_arg args[] = {
        {"--type", BENCH_ARG_STR, &type_s},    {"--hidden", BENCH_ARG_INT, &H},
        {"--inter", BENCH_ARG_INT, &I},        {"--experts", BENCH_ARG_INT, &E},
        {"--k", BENCH_ARG_INT, &K},            {"--layers", BENCH_ARG_INT, &L},
        {"--tokens", BENCH_ARG_INT, &T},       {"--threads", BENCH_ARG_INT, &threads},
        {"--iters", BENCH_ARG_INT, &iters},    {"--warmup", BENCH_ARG_INT, &warmup},
        {"--seed", BENCH_ARG_U64, &seed},
    };
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!bench_arg_set(args, sizeof args / sizeof *args, argv[i], argv[i + 1])) {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    enum ggml_type type = !strcmp(type_s, "q8_0") ? GGML_TYPE_Q8_0 : GGML_TYPE_Q4_0;
    if (K > E || iters < 1 || L < 1 || T < 1) {
        fprintf(stderr, "bad shape\n");
        return 2;
    }
    ggml_cpu_init();
    size_t wbytes = (size_t)L * E * (ggml_row_size(type, H) * 2 * I + ggml_row_size(type, I) * H);
    size_t abytes = sizeof(float) * ((size_t)T * H + (size_t)T * K * I +
                                     (size_t)L * T * K * (2 * (size_t)I + H)) +
                    sizeof(int32_t) * T * K;
    size_t mem = wbytes + abytes + (size_t)(8 * L + 16) * ggml_tensor_overhead() +
                 L * ggml_graph_overhead() + (64u << 20);
    struct ggml_init_params ip = {.mem_size = mem, .mem_buffer = NULL, .no_alloc = false};
    struct ggml_context *ctx = ggml_init(ip);
    if (!ctx) {
        fprintf(stderr, "ggml_init: cannot allocate %zu bytes\n", mem);
        return 1;
    }
    uint64_t s = seed * 7919 + 1;
    struct ggml_tensor *x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, H, 1, T);
    struct ggml_tensor *a = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, I, K, T);
    struct ggml_tensor *ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, K, T);
    struct ggml_cgraph **gf = calloc((size_t)L, sizeof *gf);
    for (int l = 0; l < L; l++) {
        struct ggml_tensor *w1 = ggml_new_tensor_3d(ctx, type, H, 2 * I, E);
        struct ggml_tensor *w2 = ggml_new_tensor_3d(ctx, type, I, H, E);
        fill_quant(w1, H, &s);
        fill_quant(w2, I, &s);
        struct ggml_tensor *h = ggml_mul_mat_id(ctx, w1, x, ids);
        struct ggml_tensor *y = ggml_mul_mat_id(ctx, w2, a, ids);
        gf[l] = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf[l], h);
        ggml_build_forward_expand(gf[l], y);
    }
    struct ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
    struct ggml_threadpool *tp = ggml_threadpool_new(&tpp);
    size_t work = 0;
    for (int l = 0; l < L; l++) {
        struct ggml_cplan cp = ggml_graph_plan(gf[l], threads, tp);
        if (cp.work_size > work)
            work = cp.work_size;
    }
    uint8_t *wdata = malloc(work + 64);
    double *ms = calloc((size_t)iters, sizeof(double));
    uint64_t rs = seed;
    for (int it = 0; it < warmup + iters; it++) {
        float *xd = x->data, *ad = a->data;
        int32_t *idd = ids->data;
        for (size_t i = 0; i < (size_t)T * H; i++)
            xd[i] = rng_uniform(&rs, -1.0f, 1.0f);
        for (size_t i = 0; i < (size_t)T * K * I; i++)
            ad[i] = rng_uniform(&rs, -1.0f, 1.0f);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++) {
                int e, dup;
                do {
                    e = (int)(rng_next(&rs) % (uint64_t)E);
                    dup = 0;
                    for (int q = 0; q < j; q++)
                        dup |= idd[t * K + q] == e;
                } while (dup);
                idd[t * K + j] = e;
            }
        int l = it % L;
        struct ggml_cplan cp = ggml_graph_plan(gf[l], threads, tp);
        cp.work_data = wdata;
        double t0 = now_s();
        if (ggml_graph_compute(gf[l], &cp) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "ggml_graph_compute failed\n");
            return 1;
        }
        double dt = now_s() - t0;
        if (it >= warmup)
            ms[it - warmup] = dt * 1e3;
    }
    double *sorted = malloc(sizeof(double) * (size_t)iters);
    memcpy(sorted, ms, sizeof(double) * (size_t)iters);
    qsort(sorted, (size_t)iters, sizeof(double), cmp_double);
    printf("{\"what\":\"ggml\",\"type\":\"%s\",\"tokens\":%d,\"threads\":%d,\"iters\":%d,"
           "\"median_ms\":%.4f,\"min_ms\":%.4f,\"max_ms\":%.4f,\"samples_ms\":[",
           type == GGML_TYPE_Q8_0 ? "q8_0" : "q4_0", T, threads, iters, sorted[iters / 2],
           sorted[0], sorted[iters - 1]);
    print_samples_end(ms, (unsigned)iters);
    ggml_threadpool_free(tp);
    ggml_free(ctx);
    free(wdata);
    free(ms);
    free(sorted);
    free(gf);
    return 0;
}
