/* shm_bench.c - session.infer's cost outside the engine, mapped vs base64
 * (issue 14): one client (libqmoe-client), one session, T tokens of f32
 * hidden; each call timed end to end around the library call, minus the
 * engine's own compute_us from the answer's stats.
 *
 * usage: qmoe-shm-bench --socket PATH --model NAME --tokens T --requests N
 *                       [--warmup W] [--layer L]
 * prints one JSON object: {"tokens":T,"base64":{...},"mapped":{...}} with,
 * per mode, the means and medians of e2e_us, compute_us and overhead_us. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../bench_util.h"
#include "bench_client.h"

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void report(const char *name, double *e2e, double *comp, int n, int last)
{
    double se = 0, sc = 0;
    double *ov = malloc((size_t)n * sizeof *ov);
    for (int i = 0; i < n; i++) {
        se += e2e[i];
        sc += comp[i];
        ov[i] = e2e[i] - comp[i];
    }
    double mo = (se - sc) / n;
    printf("\"%s\":{\"e2e_us_mean\":%.1f,\"compute_us_mean\":%.1f,\"overhead_us_mean\":%.1f,"
           "\"overhead_us_p50\":%.1f,\"e2e_us_p50\":%.1f,\"overhead_of_engine\":%.6f}%s",
           name, se / n, sc / n, mo, median(ov, n), median(e2e, n), mo / (sc / n),
           last ? "" : ",");
    free(ov);
}

int main(int argc, char **argv)
{
    const char *sock = NULL, *model = "gptoss";
    int tokens = 1, requests = 50, warmup = 3;
    uint64_t layer = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--socket"))
            sock = argv[i + 1];
        else if (!strcmp(argv[i], "--model"))
            model = argv[i + 1];
        else if (!strcmp(argv[i], "--tokens"))
            tokens = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--requests"))
            requests = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--warmup"))
            warmup = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--layer"))
            layer = (uint64_t)atoll(argv[i + 1]);
    }
    qm_client_model shape;
    qm_client *c = bench_connect(sock, model, &shape);
    if (!c)
        return 1;
    uint64_t H = shape.hidden_size;
    qm_client_error err;
    char *sid;
    qm_client_session_params sp = {.model = model};
    if (qm_client_session_create(c, &sp, &sid, NULL, &err) < 0) {
        fprintf(stderr, "session: %s\n", err.reason);
        return 1;
    }
    size_t bytes = (size_t)tokens * H * sizeof(float);
    float *x = malloc(bytes);
    for (size_t i = 0; i < (size_t)tokens * H; i++)
        x[i] = (float)sin(0.001 * (double)i);
    /* The engine's own routing (as the transformers hook sends it): K
     * distinct experts per token, equal weights. */
    enum { K = 4 };
    size_t rbytes = (size_t)tokens * K * 4;
    int32_t *ids = malloc(rbytes);
    float *w = malloc(rbytes);
    for (int t = 0; t < tokens; t++)
        for (int j = 0; j < K; j++) {
            ids[t * K + j] = (int32_t)((t * 7 + j * 8) % 32);
            w[t * K + j] = 0.25f;
        }
    qm_client_map m;
    size_t ids_off = (bytes + 63) / 64 * 64, w_off = ids_off + (rbytes + 63) / 64 * 64;
    size_t out_off = w_off + (rbytes + 63) / 64 * 64;
    if (qm_client_map_create(c, sid, out_off + bytes, &m, &err) < 0) {
        fprintf(stderr, "map: %s\n", err.reason);
        return 1;
    }
    double *e2e = calloc((size_t)requests, sizeof *e2e), *comp = calloc((size_t)requests, sizeof *comp);
    printf("{\"tokens\":%d,\"hidden\":%llu,\"requests\":%d,", tokens, (unsigned long long)H,
           requests);
    /* base64: the library encodes hidden and decodes the output each call,
     * as any base64 client must. */
    qm_client_tensor h = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {(uint64_t)tokens, H},
                          .data = x, .nbytes = bytes};
    qm_client_tensor ti = {.dtype = QM_CLIENT_I32, .ndim = 2, .shape = {(uint64_t)tokens, K},
                           .data = ids, .nbytes = rbytes};
    qm_client_tensor tw = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {(uint64_t)tokens, K},
                           .data = w, .nbytes = rbytes};
    for (int i = -warmup; i < requests; i++) {
        qm_client_infer_result r;
        double t0 = now_us();
        if (qm_client_session_infer_routed(c, sid, layer, &h, &ti, &tw, 0, &r, &err) < 0) {
            fprintf(stderr, "infer: %s\n", err.reason);
            return 1;
        }
        double t1 = now_us();
        if (i >= 0) {
            e2e[i] = t1 - t0;
            comp[i] = (double)r.stats.compute_us;
        }
        qm_client_infer_result_free(&r);
    }
    report("base64", e2e, comp, requests, 0);
    /* mapped: the engine's tensor is written into the map (as an engine
     * would produce it there), the output read from it. */
    qm_client_region ri = {QM_CLIENT_I32, (uint64_t)tokens, K, ids_off},
                     rw = {QM_CLIENT_F32, (uint64_t)tokens, K, w_off};
    qm_client_mapped_infer q = {.session = sid, .layer = layer, .map = &m,
                                .hidden = {QM_CLIENT_F32, (uint64_t)tokens, H, 0},
                                .topk_ids = &ri, .topk_weights = &rw,
                                .output_offset = out_off};
    for (int i = -warmup; i < requests; i++) {
        qm_client_infer_stats st;
        double t0 = now_us();
        memcpy(m.data, x, bytes);
        memcpy((char *)m.data + ids_off, ids, rbytes);
        memcpy((char *)m.data + w_off, w, rbytes);
        if (qm_client_session_infer_mapped(c, &q, &st, &err) < 0) {
            fprintf(stderr, "infer mapped: %s\n", err.reason);
            return 1;
        }
        double t1 = now_us();
        if (i >= 0) {
            e2e[i] = t1 - t0;
            comp[i] = (double)st.compute_us;
        }
    }
    report("mapped", e2e, comp, requests, 0);
    /* Where the mapped call's time outside the engine goes, from the
     * daemon's own stats (the same call as JSON text, a few times). */
    char params[1024];
    snprintf(params, sizeof params,
             "{\"session\":\"%s\",\"layer\":%llu,\"hidden\":{\"dtype\":\"f32\",\"shape\":"
             "[%d,%llu],\"map\":%llu,\"offset\":0},\"topk_ids\":{\"dtype\":\"i32\",\"shape\":"
             "[%d,%d],\"map\":%llu,\"offset\":%zu},\"topk_weights\":{\"dtype\":\"f32\","
             "\"shape\":[%d,%d],\"map\":%llu,\"offset\":%zu},"
             "\"output_to\":{\"map\":%llu,\"offset\":%zu}}",
             sid, (unsigned long long)layer, tokens, (unsigned long long)H,
             (unsigned long long)m.id, tokens, K, (unsigned long long)m.id, ids_off, tokens, K,
             (unsigned long long)m.id, w_off, (unsigned long long)m.id, out_off);
    double sq = 0, sw = 0, sd = 0, sc2 = 0, se2 = 0;
    int nb = requests < 10 ? requests : 10;
    for (int i = 0; i < nb; i++) {
        char *res = NULL;
        double t0 = now_us();
        if (qm_client_call_json(c, "session.infer", params, 0, &res, &err) < 0) {
            fprintf(stderr, "infer json: %s\n", err.reason);
            return 1;
        }
        se2 += now_us() - t0;
        const char *keys[] = {"\"queue_us\":", "\"wall_us\":", "\"decode_us\":",
                              "\"compute_us\":"};
        double *dst[] = {&sq, &sw, &sd, &sc2};
        for (int k = 0; k < 4; k++) {
            const char *at = strstr(res, keys[k]);
            if (at)
                *dst[k] += atof(at + strlen(keys[k]));
        }
        qm_client_string_free(res);
    }
    printf("\"mapped_breakdown\":{\"calls\":%d,\"e2e_us_mean\":%.1f,\"compute_us_mean\":%.1f,"
           "\"queue_us_mean\":%.1f,\"worker_wall_us_mean\":%.1f,\"decode_us_mean\":%.1f}}\n",
           nb, se2 / nb, sc2 / nb, sq / nb, sw / nb, sd / nb);
    qm_client_map_release(c, &m, &err);
    qm_client_session_close(c, sid, &err);
    qm_client_string_free(sid);
    qm_client_close(c);
    free(x);
    free(ids);
    free(w);
    free(e2e);
    free(comp);
    return 0;
}
