/* qm_cuda_bench.c - qmoe-cuda-bench: the CUDA backend against the device's
 * own ceilings, on a GPT-OSS-20B-like layer (H = I = 2880, E = 32, k = 4,
 * swiglu interleaved, int4 block 32, f16 scales and biases).
 *
 *   qmoe-cuda-bench [--out FILE] [--layers L] [--iters N] [--e2e-layers L2] [--e2e-seconds S]
 *
 * Measures, in one process: device-to-device copy bandwidth (bytes read +
 * written), pinned host-to-device bandwidth, copy_h2d from pageable
 * (bounce ring) and registered memory, the T = 1 expert kernels alone
 * (CUDA events) and the whole run_experts call, prefill batches, and how
 * much of a prefetch copy hides behind compute. Weights are random bytes
 * generated on the device over L layers (several times the L2), each call
 * routes to fresh random experts of a random layer, and one decode and one
 * prefill result are checked against the CPU backend first. Last, the
 * end-to-end layer throughput through the pager at 100/50/25 % budget
 * (qm_cuda_bench_e2e.c: L2 layers, default 4, T = 1 and 128, device
 * routing, fresh hidden states every call; --e2e-layers 0 skips it).
 * Exit 0 when it ran (targets are reported, not enforced), 2 when no
 * device answered. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "qm_alloc.h"
#include "qm_cuda_bench_e2e.h"
#include "qm_cuda_internal.h"

int qm__cuda_bench_fill_bytes(void *p, size_t n, uint64_t seed);
int qm__cuda_bench_fill_half(void *p, size_t n, uint64_t seed, float lo, float hi);

#define H_ 2880u
#define I_ 2880u
#define E_ 32u
#define K_ 4u
#define BS_ 32u
#define N1_ (2u * I_)

static FILE *g_out;

static void report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void report(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    if (g_out) {
        va_start(ap, fmt);
        vfprintf(g_out, fmt, ap);
        va_end(ap);
        fflush(g_out);
    }
    fflush(stdout);
}

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            report("CUDA error at %s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define QM(call)                                                                                   \
    do {                                                                                           \
        int r_ = (call);                                                                           \
        if (r_ != 0) {                                                                             \
            report("qmoe error at %s:%d: %s (%s)\n", __FILE__, __LINE__, st.msg, qm_err_name(r_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median, min and max of v[0..n) (sorted in place). */
static double median(double *v, int n, double *lo, double *hi)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    if (lo) *lo = v[0];
    if (hi) *hi = v[n - 1];
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 11);
}

/* ---- the layer: tensor order of a unit, sizes, views ---- */

static const int TENSORS[6] = {QM_T_FC1_WEIGHT, QM_T_FC1_SCALES, QM_T_FC1_BIAS,
                               QM_T_FC2_WEIGHT, QM_T_FC2_SCALES, QM_T_FC2_BIAS};
static uint64_t g_size[6], g_off[6], g_unit;

static void layer_init(qm_bank_config *cfg, qm_layer_view *lv)
{
    memset(cfg, 0, sizeof *cfg);
    *cfg = (qm_bank_config){.layers = 1,
                            .experts = E_,
                            .hidden = H_,
                            .inter = I_,
                            .k = K_,
                            .bits = 4,
                            .block_size = BS_,
                            .activation = QM_ACT_SWIGLU,
                            .swiglu_fusion = 1,
                            .normalize_routing = 1,
                            .alpha = 1.702f,
                            .beta = 1.0f,
                            .limit = 7.0f};
    memset(lv, 0, sizeof *lv);
    uint64_t shapes[6][3] = {{E_, N1_, H_ / 2}, {E_, N1_, H_ / BS_}, {E_, N1_, 0},
                             {E_, H_, I_ / 2},  {E_, H_, I_ / BS_},  {E_, H_, 0}};
    qm_dtype dts[6] = {QM_DTYPE_U8, QM_DTYPE_F16, QM_DTYPE_F16,
                       QM_DTYPE_U8, QM_DTYPE_F16, QM_DTYPE_F16};
    g_unit = 0;
    for (int i = 0; i < 6; i++) {
        qm_tensor_view *tv = &lv->t[TENSORS[i]];
        tv->present = 1;
        tv->dtype = dts[i];
        tv->ndim = shapes[i][2] ? 3 : 2;
        tv->shape[0] = shapes[i][0];
        tv->shape[1] = shapes[i][1];
        tv->shape[2] = shapes[i][2];
        uint64_t per = shapes[i][1] * (shapes[i][2] ? shapes[i][2] : 1) * qm_dtype_size(dts[i]);
        tv->nbytes = per * E_;
        g_size[i] = per;
        g_off[i] = g_unit;
        g_unit += (per + 255) & ~255ull;
    }
    lv->bytes_per_expert = g_unit;
}

static void weights_at(const uint8_t *unit, qm_expert_weights *w)
{
    memset(w, 0, sizeof *w);
    for (int i = 0; i < 6; i++)
        w->ptr[TENSORS[i]] = unit + g_off[i];
}

/* Bytes the kernels read per expert (weights, scales, biases). */
static uint64_t bytes_read_per_expert(void)
{
    uint64_t b = 0;
    for (int i = 0; i < 6; i++)
        b += g_size[i];
    return b;
}

/* Routes T tokens to k distinct random experts each; fills jobs (by expert,
 * ascending token rows). Returns the job count. */
typedef struct routing {
    uint32_t rows[E_][4096], outi[E_][4096], n[E_];
    qm_expert_job jobs[E_];
} routing;

static size_t route_random(routing *r, uint32_t T, const uint8_t *layer_base)
{
    memset(r->n, 0, sizeof r->n);
    for (uint32_t t = 0; t < T; t++) {
        uint32_t chosen[K_];
        for (uint32_t j = 0; j < K_; j++) {
            uint32_t e;
            int dup;
            do {
                e = rnd() % E_;
                dup = 0;
                for (uint32_t i = 0; i < j; i++)
                    dup |= chosen[i] == e;
            } while (dup);
            chosen[j] = e;
            r->rows[e][r->n[e]] = t;
            r->outi[e][r->n[e]] = t * K_ + j;
            r->n[e]++;
        }
    }
    size_t nj = 0;
    for (uint32_t e = 0; e < E_; e++) {
        if (!r->n[e]) continue;
        qm_expert_job *j = &r->jobs[nj++];
        j->expert = e;
        j->rows = r->rows[e];
        j->out_index = r->outi[e];
        j->n_rows = r->n[e];
        weights_at(layer_base + (uint64_t)e * g_unit, &j->weights);
    }
    return nj;
}

/* A batch of T random tokens over the layer at layer_base (route_random). */
static qm_expert_batch random_batch(routing *r, uint32_t T, const uint8_t *layer_base,
                                    const qm_bank_config *cfg, const qm_layer_view *lv,
                                    const float *x, float *y)
{
    size_t nj = route_random(r, T, layer_base);
    return (qm_expert_batch){.config = cfg, .layer = lv, .x = x, .n_tokens = T, .y = y,
                             .jobs = r->jobs, .n_jobs = nj};
}

static double rel_err(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return isfinite(num) ? sqrt(num / (den > 0 ? den : 1)) : INFINITY;
}

int main(int argc, char **argv)
{
    const char *out_path = NULL;
    uint32_t layers = 8, e2e_layers = 4;
    int iters = 60;
    double e2e_seconds = 2.0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--out") && i + 1 < argc)
            out_path = argv[++i];
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc)
            layers = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--e2e-layers") && i + 1 < argc)
            e2e_layers = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--e2e-seconds") && i + 1 < argc)
            e2e_seconds = atof(argv[++i]);
        else {
            fprintf(stderr,
                    "usage: %s [--out FILE] [--layers L] [--iters N] [--e2e-layers L2] "
                    "[--e2e-seconds S]\n",
                    argv[0]);
            return 64;
        }
    }
    if (layers < 1) layers = 1;
    if (iters < 5) iters = 5;
    if (out_path && !(g_out = fopen(out_path, "w"))) {
        perror(out_path);
        return 1;
    }

    qm_status st = {0};
    qm_backend *be = NULL;
    if (qm_backend_cuda_new(0, &be, &st) != 0) {
        report("no CUDA backend: %s\n", st.msg);
        return 2;
    }
    qm__cuda_ctx *c = be->ctx;
    qm_device_info info;
    QM(qm_backend_info(be, &info));
    report("# qmoe-cuda-bench: %s, %.1f GiB, seed 0x%llx\n", info.name,
           (double)info.total_bytes / (1u << 30), (unsigned long long)g_rng);
    report("%-44s %12s %8s  %s\n", "measure", "value", "unit", "note");

    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double *t = malloc(sizeof(double) * (size_t)(iters > 20 ? iters : 20));

    /* 1. device-to-device copy: the memory ceiling (read + written). */
    size_t d2d = (size_t)1 << 30;
    void *da, *db;
    CK(cudaMalloc(&da, d2d));
    CK(cudaMalloc(&db, d2d));
    CK((cudaError_t)qm__cuda_bench_fill_bytes(da, d2d, 1));
    double lo, hi;
    for (int i = 0; i < 13; i++) {
        CK(cudaEventRecord(e0, 0));
        CK(cudaMemcpyAsync(db, da, d2d, cudaMemcpyDeviceToDevice, 0));
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 3) t[i - 3] = ms * 1e-3;
    }
    double t_d2d = median(t, 10, &lo, &hi);
    double bw_d2d = 2.0 * (double)d2d / t_d2d / 1e9;
    report("%-44s %12.1f %8s  1 GiB x10, min/max %.1f/%.1f\n", "d2d copy bandwidth (read+write)",
           bw_d2d, "GB/s", 2.0 * d2d / hi / 1e9, 2.0 * d2d / lo / 1e9);
    CK(cudaFree(db));

    /* 2. host to device: pinned peak, then the backend's two copy paths. */
    size_t hbytes = (size_t)256 << 20;
    void *pinned;
    CK(cudaMallocHost(&pinned, hbytes));
    memset(pinned, 0x5a, hbytes);
    for (int i = 0; i < 8; i++) {
        double s = now_s();
        CK(cudaMemcpy(da, pinned, hbytes, cudaMemcpyHostToDevice));
        if (i >= 2) t[i - 2] = now_s() - s;
    }
    double bw_pinned = hbytes / median(t, 6, NULL, NULL) / 1e9;
    report("%-44s %12.2f %8s  256 MiB cudaMemcpy from cudaMallocHost\n", "h2d pinned peak",
           bw_pinned, "GB/s");
    CK(cudaFreeHost(pinned));
    uint8_t *pageable = NULL;
    if (posix_memalign((void **)&pageable, 4096, hbytes) != 0) return 1;
    for (size_t i = 0; i < hbytes; i++)
        pageable[i] = (uint8_t)(i * 2654435761u >> 13);
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            int rc = qm_backend_register_host(be, pageable, hbytes, &st);
            if (rc < 0) {
                report("%-44s %12s %8s  %s\n", "h2d copy_h2d registered", "n/a", "", st.msg);
                break;
            }
        }
        for (int i = 0; i < 6; i++) {
            qm_fence f;
            double s = now_s();
            QM(qm_backend_copy_h2d(be, da, pageable, hbytes, &f, &st));
            QM(qm_backend_fence_wait(be, &f, &st));
            if (i >= 1) t[i - 1] = now_s() - s;
        }
        double bw = hbytes / median(t, 5, NULL, NULL) / 1e9;
        report("%-44s %12.2f %8s  %.0f%% of pinned peak (target >= 85%%)\n",
               pass ? "h2d copy_h2d, registered (direct DMA)"
                    : "h2d copy_h2d, pageable (bounce ring)",
               bw, "GB/s", 100.0 * bw / bw_pinned);
    }
    CK(cudaFree(da));

    /* 3. the layer: `layers` x 32 experts of random weights on the device. */
    qm_bank_config cfg;
    qm_layer_view lv;
    layer_init(&cfg, &lv);
    uint64_t layer_bytes = g_unit * E_;
    qm_arena *arena = NULL;
    QM(qm_arena_new(be, layer_bytes * layers, &arena, &st));
    uint8_t *base = qm_arena_at(arena, 0);
    for (uint32_t l = 0; l < layers; l++) {
        for (uint32_t e = 0; e < E_; e++) {
            uint8_t *u = base + (uint64_t)(l * E_ + e) * g_unit;
            uint64_t seed = ((uint64_t)l << 32) ^ ((uint64_t)e << 8);
            CK((cudaError_t)qm__cuda_bench_fill_bytes(u + g_off[0], g_size[0], seed + 1));
            CK((cudaError_t)qm__cuda_bench_fill_half(u + g_off[1], g_size[1] / 2, seed + 2,
                                                     0.5f / (53.7f * 8), 1.5f / (53.7f * 8)));
            CK((cudaError_t)qm__cuda_bench_fill_half(u + g_off[2], g_size[2] / 2, seed + 3, -0.5f,
                                                     0.5f));
            CK((cudaError_t)qm__cuda_bench_fill_bytes(u + g_off[3], g_size[3], seed + 4));
            CK((cudaError_t)qm__cuda_bench_fill_half(u + g_off[4], g_size[4] / 2, seed + 5,
                                                     0.5f / (53.7f * 8), 1.5f / (53.7f * 8)));
            CK((cudaError_t)qm__cuda_bench_fill_half(u + g_off[5], g_size[5] / 2, seed + 6, -0.5f,
                                                     0.5f));
        }
    }
    CK(cudaDeviceSynchronize());
    report("%-44s %12.2f %8s  %u layers x %u experts x %.2f MB (unit)\n", "device working set",
           (double)layer_bytes * layers / 1e9, "GB", layers, E_, (double)g_unit / 1e6);

    const uint32_t TMAX = 512;
    float *x = malloc(sizeof(float) * TMAX * H_);
    float *y = malloc(sizeof(float) * TMAX * K_ * H_),
          *ycpu = malloc(sizeof(float) * TMAX * K_ * H_);
    routing *r = calloc(1, sizeof *r);
    if (!x || !y || !ycpu || !r) return 1;
    for (uint32_t i = 0; i < TMAX * H_; i++)
        x[i] = (float)((int)(rnd() % 2001) - 1000) * 1e-3f;

    /* 4. correctness once: decode and prefill against the CPU backend. */
    {
        qm_backend *cpu = NULL;
        QM(qm_backend_cpu_new(0, &cpu, &st));
        uint8_t *host_layer = malloc(layer_bytes);
        if (!host_layer) return 1;
        CK(cudaMemcpy(host_layer, base, layer_bytes, cudaMemcpyDeviceToHost));
        const uint32_t Ts[2] = {1, 64};
        for (int k = 0; k < 2; k++) {
            uint32_t T = Ts[k];
            qm_expert_batch b = random_batch(r, T, base, &cfg, &lv, x, y);
            size_t nj = b.n_jobs;
            for (size_t i = 0; i < (size_t)T * K_ * H_; i++)
                y[i] = NAN;
            QM(qm_backend_run_experts(be, &b, &st));
            for (size_t j = 0; j < nj; j++)
                weights_at(host_layer + (uint64_t)r->jobs[j].expert * g_unit, &r->jobs[j].weights);
            b.y = ycpu;
            QM(qm_backend_run_experts(cpu, &b, &st));
            double err = rel_err(y, ycpu, (size_t)T * K_ * H_);
            report("%-44s %12.2e %8s  %s (T=%u, %zu experts)\n", "check: cuda vs cpu rel err", err,
                   "", err <= 1e-5 ? "ok" : "MISMATCH", T, nj);
        }
        free(host_layer);
        qm_backend_free(cpu);
    }

    /* 5. decode, T = 1: the expert kernels alone (events), then whole calls. */
    const uint64_t per_expert = bytes_read_per_expert();
    {
        /* Device job tables of random (layer, 4 experts), prepared ahead. */
        enum { SETS = 64 };
        qm__cuda_job *hj = calloc((size_t)SETS * K_, sizeof *hj), *dj = NULL;
        uint32_t zero_rows[K_] = {0, 0, 0, 0};
        uint32_t *drows = NULL;
        float *dx = NULL, *dh1 = NULL, *da1 = NULL, *dy = NULL;
        CK(cudaMalloc((void **)&dj, (size_t)SETS * K_ * sizeof *hj));
        CK(cudaMalloc((void **)&drows, sizeof zero_rows));
        CK(cudaMalloc((void **)&dx, sizeof(float) * H_));
        CK(cudaMalloc((void **)&dh1, sizeof(float) * K_ * N1_));
        CK(cudaMalloc((void **)&da1, sizeof(float) * K_ * I_));
        CK(cudaMalloc((void **)&dy, sizeof(float) * K_ * H_));
        CK(cudaMemcpy(drows, zero_rows, sizeof zero_rows, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dx, x, sizeof(float) * H_, cudaMemcpyHostToDevice));
        for (int sidx = 0; sidx < SETS; sidx++) {
            uint32_t l = rnd() % layers;
            route_random(r, 1, base + (uint64_t)l * layer_bytes);
            for (uint32_t j = 0; j < K_; j++) {
                qm__cuda_job *q = &hj[sidx * K_ + j];
                const qm_expert_weights *w = &r->jobs[j].weights;
                q->w[0] = w->ptr[QM_T_FC1_WEIGHT];
                q->scales[0] = w->ptr[QM_T_FC1_SCALES];
                q->bias[0] = w->ptr[QM_T_FC1_BIAS];
                q->w[1] = w->ptr[QM_T_FC2_WEIGHT];
                q->scales[1] = w->ptr[QM_T_FC2_SCALES];
                q->bias[1] = w->ptr[QM_T_FC2_BIAS];
                q->row0 = j;
                q->n_rows = 1;
            }
        }
        CK(cudaMemcpy(dj, hj, (size_t)SETS * K_ * sizeof *hj, cudaMemcpyHostToDevice));
        qm__cuda_mat m1 = {.n = N1_,
                           .k = H_,
                           .bits = 4,
                           .row_bytes = H_ / 2,
                           .nblk = H_ / BS_,
                           .block_shift = 5,
                           .scale_dtype = QM__CUDA_F16,
                           .bias_dtype = QM__CUDA_F16};
        qm__cuda_mat m2 = m1;
        m2.n = H_;
        m2.k = I_;
        m2.row_bytes = I_ / 2;
        m2.nblk = I_ / BS_;
        qm__cuda_act act = {.kind = QM__CUDA_ACT_SWIGLU,
                            .fusion = 1,
                            .inter = I_,
                            .h1_stride = N1_,
                            .alpha = 1.702f,
                            .beta = 1.0f,
                            .limit = 7.0f};
        /* in_rows: every job reads token 0 (one row of x). */
        uint32_t *drows4 = NULL;
        CK(cudaMalloc((void **)&drows4, sizeof zero_rows));
        CK(cudaMemcpy(drows4, zero_rows, sizeof zero_rows, cudaMemcpyHostToDevice));
        cudaStream_t cs = c->compute_stream;
        for (int variant = 0; variant < 2; variant++) {
            for (int i = 0; i < iters + 5; i++) {
                const qm__cuda_job *js = dj + (size_t)(i % SETS) * K_;
                CK(cudaEventRecord(e0, cs));
                CK((cudaError_t)qm__cuda_launch_matmul(js, K_, 1, 1, QM__CUDA_FC1, &m1, 1,
                                                       QM__CUDA_PATH_GEMV, 16, dx, drows4, H_, dh1,
                                                       N1_, cs));
                if (variant == 1) {
                    CK((cudaError_t)qm__cuda_launch_activation(&act, K_, dh1, NULL, da1, cs));
                    CK((cudaError_t)qm__cuda_launch_matmul(js, K_, 1, 1, QM__CUDA_FC2, &m2, 1,
                                                           QM__CUDA_PATH_GEMV, 16, da1, NULL, I_,
                                                           dy, H_, cs));
                }
                CK(cudaEventRecord(e1, cs));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                if (i >= 5) t[i - 5] = ms * 1e-3;
            }
            double tm = median(t, iters, &lo, &hi);
            uint64_t bytes =
                variant == 0 ? K_ * (g_size[0] + g_size[1] + g_size[2]) : K_ * per_expert;
            double bw = bytes / tm / 1e9;
            report("%-44s %12.2f %8s  %.1f us, %.0f%% of d2d (target >= 80%%), min/max %.1f/%.1f "
                   "us\n",
                   variant == 0 ? "T=1 FC1 GEMV alone (4 experts), kernel"
                                : "T=1 FC1+act+FC2 (4 experts), kernels",
                   bw, "GB/s", tm * 1e6, 100.0 * bw / bw_d2d, lo * 1e6, hi * 1e6);
        }
        CK(cudaFree(dj));
        CK(cudaFree(drows));
        CK(cudaFree(drows4));
        CK(cudaFree(dx));
        CK(cudaFree(dh1));
        CK(cudaFree(da1));
        CK(cudaFree(dy));
        free(hj);
    }

    /* 6. whole run_experts calls (x up, 3 launches, y down, scatter). */
    const uint32_t Ts[4] = {1, 16, 128, 512};
    for (int k = 0; k < 4; k++) {
        uint32_t T = Ts[k];
        int n = T >= 128 ? (iters < 20 ? iters : 20) : iters;
        uint64_t experts_touched = 0;
        for (int i = 0; i < n + 3; i++) {
            uint32_t l = rnd() % layers;
            qm_expert_batch b =
                random_batch(r, T, base + (uint64_t)l * layer_bytes, &cfg, &lv, x, y);
            size_t nj = b.n_jobs;
            double s = now_s();
            QM(qm_backend_run_experts(be, &b, &st));
            if (i >= 3) {
                t[i - 3] = now_s() - s;
                experts_touched += nj;
            }
        }
        double tm = median(t, n, &lo, &hi);
        double bytes = (double)experts_touched / n * (double)per_expert;
        double flops = 2.0 * T * K_ * ((double)N1_ * H_ + (double)H_ * I_);
        report("%-44s %12.3f %8s  %.1f GB/s weights, %.2f TFLOP/s, min/max %.3f/%.3f ms\n",
               T == 1     ? "run_experts T=1 (whole call)"
               : T == 16  ? "run_experts T=16"
               : T == 128 ? "run_experts T=128"
                          : "run_experts T=512",
               tm * 1e3, "ms", bytes / tm / 1e9, flops / tm / 1e12, lo * 1e3, hi * 1e3);
    }

    /* 7. prefetch overlap: copy 4 units (registered host memory) while a
     * call runs; hidden = share of the shorter of the two that vanished. */
    {
        size_t ubytes = (size_t)(K_ * g_unit);
        uint8_t *host_units = NULL;
        if (posix_memalign((void **)&host_units, 4096, ubytes) != 0) return 1;
        CK(cudaMemcpy(host_units, base, ubytes, cudaMemcpyDeviceToHost));
        int registered = qm_backend_register_host(be, host_units, ubytes, &st) > 0;
        qm_arena *slots = NULL;
        QM(qm_arena_new(be, ubytes, &slots, &st));
        for (int k = 0; k < 2; k++) {
            uint32_t T = k == 0 ? 1 : 512;
            int n = 10;
            double tc[10], tr[10], to[10];
            for (int i = 0; i < n; i++) {
                uint32_t l = rnd() % layers;
                qm_expert_batch b =
                    random_batch(r, T, base + (uint64_t)l * layer_bytes, &cfg, &lv, x, y);
                qm_fence f;
                double s = now_s();
                QM(qm_backend_copy_h2d(be, qm_arena_at(slots, 0), host_units, ubytes, &f, &st));
                QM(qm_backend_fence_wait(be, &f, &st));
                tc[i] = now_s() - s;
                s = now_s();
                QM(qm_backend_run_experts(be, &b, &st));
                tr[i] = now_s() - s;
                s = now_s();
                QM(qm_backend_copy_h2d(be, qm_arena_at(slots, 0), host_units, ubytes, &f, &st));
                QM(qm_backend_run_experts(be, &b, &st));
                QM(qm_backend_fence_wait(be, &f, &st));
                to[i] = now_s() - s;
            }
            double mc = median(tc, n, NULL, NULL), mr = median(tr, n, NULL, NULL),
                   mo = median(to, n, NULL, NULL);
            double shorter = mc < mr ? mc : mr;
            double hidden = (mc + mr - mo) / shorter;
            report("%-44s %12.0f %8s  copy %.3f ms (%.1f GB/s, %s), compute %.3f ms, both %.3f ms "
                   "(target >= 50%%)\n",
                   T == 1 ? "prefetch hidden behind compute, T=1"
                          : "prefetch hidden behind compute, T=512",
                   100.0 * hidden, "%", mc * 1e3, ubytes / mc / 1e9,
                   registered ? "registered" : "bounce", mr * 1e3, mo * 1e3);
        }
        qm_arena_free(be, slots);
        if (registered) qm_backend_unregister_host(be, host_units, &st);
        free(host_units);
    }

    /* 8. end to end: the pager driving this backend at 100/50/25 % budget.
     * The layer arena above is released first: the pagers need the room. */
    if (e2e_layers > 0) {
        qm_arena_free(be, arena);
        arena = NULL;
        qm_e2e_spec sp = {.layers = e2e_layers, .experts = E_, .hidden = H_, .inter = I_, .k = K_,
                          .tokens = {1, 128}, .n_tokens = 2, .budget_pct = {100, 50, 25},
                          .n_budgets = 3, .seconds = e2e_seconds, .min_steps = 3,
                          .max_steps = 100000, .prefetch = 1};
        qm_e2e_row rows[6];
        if (qm_e2e_run(be, &sp, rows, report, &st) != 0)
            report("e2e: failed: %s (%s)\n", st.msg, qm_err_name(st.code));
    }

    qm_cuda_stats cs;
    qm_backend_cuda_stats(be, &cs);
    report("# stats: %llu copies, %.2f GB direct, %.2f GB bounced, %llu batches, %llu routed "
           "on the device, %llu scratch grows\n",
           (unsigned long long)cs.copies, cs.bytes_direct / 1e9, cs.bytes_bounced / 1e9,
           (unsigned long long)cs.batches, (unsigned long long)cs.routes,
           (unsigned long long)cs.scratch_grows);
    qm_arena_free(be, arena);
    qm_backend_free(be);
    free(pageable);
    free(x);
    free(y);
    free(ycpu);
    free(r);
    free(t);
    if (g_out) fclose(g_out);
    return 0;
}
