/* engine_sim.c - a layer call's cost in the regime an engine calls qmoed in
 * (issue 22): between two MoE layers the engine's own threads run the
 * attention on every core, so the daemon's threads have all gone to sleep
 * when the call comes, and while the call runs the engine's other threads
 * sleep too (llama.cpp's adapter parks them on a condition variable).
 *
 * N engine threads each stream over a private buffer for --gap-us (the
 * attention: cores busy, caches evicted), meet, and thread 0 writes one
 * token's hidden state and fresh routing (K distinct random experts, as the
 * engine's router would pick them) into the session's map and calls
 * session.infer (mapped, output_to) on the next layer while the others sleep
 * on a condition variable; then all go on. Per call: the time thread 0 spent
 * in the call, the daemon's compute_us and queue_us, and the call's cost
 * beyond the compute (e2e - compute_us).
 *
 * usage: qmoe-engine-sim --socket PATH --model NAME [--calls N] [--warmup W]
 *                        [--gap-us G] [--engine-threads N] [--gap-mib M]
 *                        [--precision exact|fast] [--seed S]
 * prints one JSON object. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bench_util.h"
#include "bench_client.h"

typedef struct sim {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned arrived, nth;
    unsigned long gen;
    int stop;
    double gap_us;
    size_t gap_bytes;
} sim;

static double now_us(void)
{
    return now_s() * 1e6;
}

/* Everyone meets; the last to arrive goes on at once, the others sleep. */
static void meet(sim *s)
{
    pthread_mutex_lock(&s->mu);
    unsigned long g = s->gen;
    if (++s->arrived == s->nth) {
        s->arrived = 0;
        s->gen++;
        pthread_cond_broadcast(&s->cv);
    } else {
        while (s->gen == g)
            pthread_cond_wait(&s->cv, &s->mu);
    }
    pthread_mutex_unlock(&s->mu);
}

/* The attention's stand-in: reads and writes a private buffer for gap_us. */
static double attention(const sim *s, float *buf, size_t *pos)
{
    double t0 = now_us(), acc = 0;
    size_t n = s->gap_bytes / sizeof(float);
    while (now_us() - t0 < s->gap_us) {
        for (size_t i = 0; i < 16384; i++) {
            size_t j = (*pos + i) % n;
            acc += buf[j];
            buf[j] = (float)acc * 0.5f;
        }
        *pos = (*pos + 16384) % n;
    }
    return acc;
}

typedef struct helper_arg {
    sim *s;
    float *buf;
} helper_arg;

static void *helper(void *arg)
{
    helper_arg *h = arg;
    size_t pos = 0;
    volatile double sink = 0;
    for (;;) {
        meet(h->s); /* the call's start: sleep through it */
        if (h->s->stop) /* written before that meeting */
            break;
        meet(h->s); /* the call's end */
        sink += attention(h->s, h->buf, &pos);
    }
    (void)sink;
    return NULL;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv)
{
    const char *sock = NULL, *model = NULL, *precision = "fast";
    int calls = 400, warmup = 40, nth = 2;
    double gap_us = 1000, gap_mib = 64;
    uint64_t seed = 1;
    const bench_arg args[] = {
        {"--socket", BENCH_ARG_STR, &sock},       {"--model", BENCH_ARG_STR, &model},
        {"--calls", BENCH_ARG_INT, &calls},       {"--warmup", BENCH_ARG_INT, &warmup},
        {"--gap-us", BENCH_ARG_DBL, &gap_us},     {"--gap-mib", BENCH_ARG_DBL, &gap_mib},
        {"--engine-threads", BENCH_ARG_INT, &nth}, {"--precision", BENCH_ARG_STR, &precision},
        {"--seed", BENCH_ARG_U64, &seed},
    };
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!bench_arg_set(args, sizeof args / sizeof *args, argv[i], argv[i + 1])) {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (!sock || !model || calls < 1 || warmup < 0 || nth < 1) {
        fprintf(stderr, "usage: qmoe-engine-sim --socket PATH --model NAME [--calls N] "
                        "[--warmup W] [--gap-us G] [--engine-threads N] [--gap-mib M] "
                        "[--precision exact|fast] [--seed S]\n");
        return 2;
    }
    qm_client_model shape;
    qm_client *c = bench_connect(sock, model, &shape);
    if (!c)
        return 1;
    uint64_t H = shape.hidden_size, E = shape.experts, K = shape.k, L = shape.layers;
    if (!K || K > E || !L) {
        fprintf(stderr, "model %s: no routing shape (k %llu of %llu experts)\n", model,
                (unsigned long long)K, (unsigned long long)E);
        return 1;
    }
    qm_client_error err;
    char *sid;
    qm_client_session_params sp = {.model = model, .precision = precision};
    if (qm_client_session_create(c, &sp, &sid, NULL, &err) < 0) {
        fprintf(stderr, "session: %s\n", err.reason);
        return 1;
    }
    size_t xbytes = H * sizeof(float), rbytes = K * 4;
    size_t ids_off = (xbytes + 63) / 64 * 64, w_off = ids_off + (rbytes + 63) / 64 * 64;
    size_t out_off = w_off + (rbytes + 63) / 64 * 64;
    qm_client_map m;
    if (qm_client_map_create(c, sid, out_off + xbytes, &m, &err) < 0) {
        fprintf(stderr, "map: %s\n", err.reason);
        return 1;
    }
    sim s = {.nth = (unsigned)nth, .gap_us = gap_us,
             .gap_bytes = (size_t)(gap_mib * 1048576.0)};
    pthread_mutex_init(&s.mu, NULL);
    pthread_cond_init(&s.cv, NULL);
    float **bufs = calloc((size_t)nth, sizeof *bufs);
    for (int t = 0; t < nth; t++) {
        bufs[t] = malloc(s.gap_bytes);
        for (size_t i = 0; i < s.gap_bytes / sizeof(float); i++)
            bufs[t][i] = (float)(i % 97) * 0.01f;
    }
    pthread_t *th = calloc((size_t)nth, sizeof *th);
    helper_arg *ha = calloc((size_t)nth, sizeof *ha);
    for (int t = 1; t < nth; t++) {
        ha[t] = (helper_arg){&s, bufs[t]};
        pthread_create(&th[t], NULL, helper, &ha[t]);
    }
    double *e2e = calloc((size_t)calls, sizeof *e2e), *comp = calloc((size_t)calls, sizeof *comp);
    double *queue = calloc((size_t)calls, sizeof *queue), *ov = calloc((size_t)calls, sizeof *ov);
    float *x = (float *)m.data;
    int32_t *ids = (int32_t *)((char *)m.data + ids_off);
    float *w = (float *)((char *)m.data + w_off);
    qm_client_region ri = {QM_CLIENT_I32, 1, K, ids_off}, rw = {QM_CLIENT_F32, 1, K, w_off};
    qm_client_mapped_infer q = {.session = sid, .map = &m,
                                .hidden = {QM_CLIENT_F32, 1, H, 0},
                                .topk_ids = &ri, .topk_weights = &rw, .output_offset = out_off};
    size_t pos = 0;
    volatile double sink = 0;
    uint64_t rng = seed;
    double t_all0 = 0, sum_gap = 0;
    for (int i = -warmup; i < calls; i++) {
        if (i == 0)
            t_all0 = now_us();
        double g0 = now_us();
        sink += attention(&s, bufs[0], &pos);
        meet(&s); /* the others park for the call */
        if (i >= 0)
            sum_gap += now_us() - g0;
        for (uint64_t h = 0; h < H; h++)
            x[h] = rng_uniform(&rng, -1.0f, 1.0f);
        for (uint64_t j = 0; j < K; j++) {
            int32_t e;
            int dup;
            do {
                e = (int32_t)(rng_next(&rng) % E);
                dup = 0;
                for (uint64_t p = 0; p < j; p++)
                    dup |= ids[p] == e;
            } while (dup);
            ids[j] = e;
            w[j] = 1.0f / (float)K;
        }
        q.layer = (uint64_t)(i + warmup) % L;
        qm_client_infer_stats st;
        double t0 = now_us();
        if (qm_client_session_infer_mapped(c, &q, &st, &err) < 0) {
            fprintf(stderr, "infer: %s\n", err.reason);
            return 1;
        }
        double t1 = now_us();
        meet(&s);
        if (i >= 0) {
            e2e[i] = t1 - t0;
            comp[i] = (double)st.compute_us;
            queue[i] = (double)st.queue_us;
            ov[i] = e2e[i] - comp[i];
        }
    }
    double wall = now_us() - t_all0;
    s.stop = 1;
    meet(&s);
    for (int t = 1; t < nth; t++)
        pthread_join(th[t], NULL);
    double se = 0, sc = 0, sq = 0;
    for (int i = 0; i < calls; i++) {
        se += e2e[i];
        sc += comp[i];
        sq += queue[i];
    }
    printf("{\"model\":\"%s\",\"hidden\":%llu,\"experts\":%llu,\"k\":%llu,\"layers\":%llu,"
           "\"precision\":\"%s\",\"engine_threads\":%d,\"gap_us\":%.0f,\"calls\":%d,"
           "\"e2e_us_mean\":%.1f,\"compute_us_mean\":%.1f,\"queue_us_mean\":%.1f,"
           "\"overhead_us_mean\":%.1f,",
           model, (unsigned long long)H, (unsigned long long)E, (unsigned long long)K,
           (unsigned long long)L, precision, nth, gap_us, calls, se / calls, sc / calls,
           sq / calls, (se - sc) / calls);
    printf("\"overhead_us_p50\":%.1f,\"compute_us_p50\":%.1f,\"e2e_us_p50\":%.1f,"
           "\"gap_us_mean\":%.1f,\"wall_per_call_us\":%.1f}\n",
           median(ov, calls), median(comp, calls), median(e2e, calls), sum_gap / calls,
           wall / calls);
    (void)sink;
    qm_client_map_release(c, &m, &err);
    qm_client_session_close(c, sid, &err);
    qm_client_string_free(sid);
    qm_client_close(c);
    for (int t = 0; t < nth; t++)
        free(bufs[t]);
    free(bufs);
    free(th);
    free(ha);
    free(e2e);
    free(comp);
    free(queue);
    free(ov);
    return 0;
}
