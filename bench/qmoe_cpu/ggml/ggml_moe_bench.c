/* ggml_moe_bench - llama.cpp's engine (ggml's CPU MUL_MAT_ID) on a MoE layer's
 * two expert matmuls, for bench/qmoe_cpu/run.py: the baseline qmoed's CPU
 * kernels are measured against. Built by build.sh against the ggml that the
 * pinned llama-cpp-python sdist carries; this file only calls ggml's API.
 *
 *   ggml_moe_bench --type q4_0|q8_0 --hidden H --inter I --experts E --k K
 *                  --layers L --tokens T [--threads 2] [--iters 20] [--warmup 3] [--seed S]
 *                  [--repack 1]
 *
 * Per layer: fc1 = mul_mat_id(W1 [E][2I][H], x [T][H], ids [T][K]) (gate and
 * up fused, as a swiglu layer's fc1) and fc2 = mul_mat_id(W2 [E][H][I],
 * a [T][K][I], ids), one graph, `threads` threads on a persistent pool.
 * The swiglu between them is left out (a few microseconds; fc2 gets its own
 * random input), so ggml is timed on the matmuls alone: in its favour.
 * Weights are random blocks (codes uniform, scales ~ 1 / (sqrt(K) * 8)); each
 * call gets fresh x, a and routing (K distinct experts per token, uniform),
 * drawn outside the timed region, and the calls cycle through L layers so
 * the weights come from memory (L * E * experts' bytes >> LLC). With
 * --repack 1 the expert tensors live in ggml's CPU_REPACK buffer (what
 * llama.cpp does by default on x86: Q4_0 rows interleaved eight at a time,
 * the GEMV and GEMM kernels that layout has) instead of plain blocks; the
 * harness refuses it for a type ggml would not repack. Prints one JSON
 * line. Not a test. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../bench_util.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

/* ggml's CPU_REPACK buffer type, from the CPU device's extra buffer types. */
static ggml_backend_buffer_type_t repack_buft(void)
{
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
    ggml_backend_dev_get_extra_bufts_t get =
        (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(
            reg, "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t *b = get ? get(dev) : NULL; b && *b; b++)
        if (!strcmp(ggml_backend_buft_name(*b), "CPU_REPACK"))
            return *b;
    return NULL;
}

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
    int repack = 0;
    uint64_t seed = 1;
    const bench_arg args[] = {
        {"--type", BENCH_ARG_STR, &type_s},    {"--hidden", BENCH_ARG_INT, &H},
        {"--inter", BENCH_ARG_INT, &I},        {"--experts", BENCH_ARG_INT, &E},
        {"--k", BENCH_ARG_INT, &K},            {"--layers", BENCH_ARG_INT, &L},
        {"--tokens", BENCH_ARG_INT, &T},       {"--threads", BENCH_ARG_INT, &threads},
        {"--iters", BENCH_ARG_INT, &iters},    {"--warmup", BENCH_ARG_INT, &warmup},
        {"--seed", BENCH_ARG_U64, &seed},     {"--repack", BENCH_ARG_INT, &repack},
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
    ggml_backend_buffer_type_t rbt = repack ? repack_buft() : NULL;
    if (repack && (!rbt || type != GGML_TYPE_Q4_0)) {
        fprintf(stderr, "--repack: %s\n", rbt ? "only q4_0 is repacked for this CPU by this ggml"
                                              : "this ggml has no CPU_REPACK buffer type");
        return 2;
    }
    /* With --repack, the weights in a context of their own, allocated in
     * the repack buffer and set through it (which interleaves them). */
    struct ggml_context *wctx = NULL;
    if (repack) {
        struct ggml_init_params wp = {.mem_size = (size_t)(2 * L + 4) * ggml_tensor_overhead(),
                                      .mem_buffer = NULL, .no_alloc = true};
        wctx = ggml_init(wp);
    }
    size_t wbytes = repack ? 0 : (size_t)L * E * (ggml_row_size(type, H) * 2 * I + ggml_row_size(type, I) * H);
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
    struct ggml_tensor **ws = calloc(2 * (size_t)L, sizeof *ws);
    for (int l = 0; l < L && repack; l++) {
        ws[2 * l] = ggml_new_tensor_3d(wctx, type, H, 2 * I, E);
        ws[2 * l + 1] = ggml_new_tensor_3d(wctx, type, I, H, E);
    }
    ggml_backend_buffer_t wbuf = repack ? ggml_backend_alloc_ctx_tensors_from_buft(wctx, rbt) : NULL;
    if (repack && !wbuf) {
        fprintf(stderr, "--repack: cannot allocate the weights in CPU_REPACK\n");
        return 1;
    }
    for (int l = 0; l < L; l++) {
        struct ggml_tensor *w1, *w2;
        if (repack) {
            /* Filled as plain blocks in a scratch tensor, then set. */
            w1 = ws[2 * l];
            w2 = ws[2 * l + 1];
            for (int m = 0; m < 2; m++) {
                struct ggml_tensor *w = m ? w2 : w1;
                struct ggml_init_params tp = {.mem_size = ggml_nbytes(w) + 2 * ggml_tensor_overhead(),
                                              .mem_buffer = NULL, .no_alloc = false};
                struct ggml_context *tctx = ggml_init(tp);
                struct ggml_tensor *t = ggml_new_tensor_3d(tctx, type, w->ne[0], w->ne[1], w->ne[2]);
                fill_quant(t, m ? I : H, &s);
                ggml_backend_tensor_set(w, t->data, 0, ggml_nbytes(w));
                ggml_free(tctx);
            }
        } else {
            w1 = ggml_new_tensor_3d(ctx, type, H, 2 * I, E);
            w2 = ggml_new_tensor_3d(ctx, type, I, H, E);
            fill_quant(w1, H, &s);
            fill_quant(w2, I, &s);
        }
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
    printf("{\"what\":\"ggml\",\"repack\":%s,\"type\":\"%s\",\"tokens\":%d,\"threads\":%d,\"iters\":%d,"
           "\"median_ms\":%.4f,\"min_ms\":%.4f,\"max_ms\":%.4f,\"samples_ms\":[",
           repack ? "true" : "false", type == GGML_TYPE_Q8_0 ? "q8_0" : "q4_0", T, threads, iters, sorted[iters / 2],
           sorted[0], sorted[iters - 1]);
    print_samples_end(ms, (unsigned)iters);
    ggml_threadpool_free(tp);
    ggml_free(ctx);
    if (wbuf)
        ggml_backend_buffer_free(wbuf);
    if (wctx)
        ggml_free(wctx);
    free(ws);
    free(wdata);
    free(ms);
    free(sorted);
    free(gf);
    return 0;
}
