/* paging_disk.c - CPU decode of a bank larger than its budget: the pager
 * reading misses from disk (O_DIRECT into a locked arena) against the bank
 * served by its mapping and the page cache. One configuration per process,
 * so that bench/paging_disk/run.sh can run each inside the same memory
 * limit (a cgroup) after dropping the file from the page cache.
 *
 *   paging_disk --bank FILE --mode direct|mmap|whole [--budget FRAC]
 *               [--policy P] [--tokens N] [--warm W] [--threads T]
 *               [--alpha A] [--locality L] [--seed S] [--no-prefetch]
 *
 * whole: no pager, every expert read in place from the mapping (the page
 * cache decides what stays: today's CPU serving). mmap: a pager at FRAC of
 * the expert bytes copying misses from the mapping. direct: the same pager
 * reading misses from the file with O_DIRECT (paging_source direct).
 * Routing: a synthetic decode trace (bench/policy_sim's Zipf alpha +
 * locality model), the same for every mode with the same seed; hidden
 * states are fresh per token. Before the bank is opened the file is dropped
 * from the page cache (posix_fadvise DONTNEED). W warm-up tokens are not
 * timed. Prints one JSON line: tokens/s, disk bytes read per token (the
 * process's /proc/self/io read_bytes, which counts page-cache fills and
 * O_DIRECT reads alike), hit rate, stall time, peak RSS. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "../bench_pager.h"
#include "../bench_util.h"
#include "qm_moe.h"
#include "qm_pager.h"
#include "qm_residency.h"
#include "sim.h"

static uint64_t proc_read_bytes(void)
{
    FILE *f = fopen("/proc/self/io", "r");
    char line[128];
    unsigned long long v = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "read_bytes: %llu", &v) == 1)
            break;
    if (f)
        fclose(f);
    return v;
}

int main(int argc, char **argv)
{
    const char *path = NULL, *mode = "direct", *policy = "lru";
    double frac = 0.5, alpha = 1.0, locality = 0.3;
    uint32_t tokens = 64, warm = 8, threads = 2;
    uint64_t seed = 1;
    int prefetch = 1;
    const bench_arg args[] = {
        {"--bank", BENCH_ARG_STR, &path},       {"--mode", BENCH_ARG_STR, &mode},
        {"--budget", BENCH_ARG_DBL, &frac},     {"--policy", BENCH_ARG_STR, &policy},
        {"--tokens", BENCH_ARG_U32, &tokens},   {"--warm", BENCH_ARG_U32, &warm},
        {"--threads", BENCH_ARG_U32, &threads}, {"--alpha", BENCH_ARG_DBL, &alpha},
        {"--locality", BENCH_ARG_DBL, &locality}, {"--seed", BENCH_ARG_U64, &seed},
    };
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--no-prefetch")) {
            prefetch = 0;
            continue;
        }
        if (!v)
            break;
        i++;
        bench_arg_set(args, sizeof args / sizeof *args, a, v);
    }
    int whole = !strcmp(mode, "whole"), direct = !strcmp(mode, "direct");
    if (!path || tokens == 0 || (!whole && !direct && strcmp(mode, "mmap")) || frac <= 0 ||
        frac > 1) {
        fprintf(stderr, "usage: paging_disk --bank FILE --mode direct|mmap|whole [--budget FRAC] "
                        "[--policy P] [--tokens N] [--warm W] [--threads T] [--alpha A] "
                        "[--locality L] [--seed S] [--no-prefetch]\n");
        return 2;
    }
    /* Cold start: the file leaves the page cache (drop_caches needs root
     * and is global; this is per file and works for the owner). */
    int fd = open(path, O_RDONLY);
    /* Dirty pages (a bank just written) are not dropped: write them first. */
    if (fd < 0 || fdatasync(fd) != 0 || posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) {
        perror(path);
        return 1;
    }
    close(fd);
    qm_bank *bank = NULL;
    qm_backend *be = NULL;
    const qm_bank_config *cfg = bench_open_cpu("paging_disk", path, threads, &bank, &be);
    if (!cfg)
        return 1;
    qm_status st = {0};
    sim_trace tr;
    if (sim_trace_generate(&tr, tokens + warm, cfg->layers, cfg->experts, cfg->k, alpha, locality,
                           seed))
        return 1;
    uint64_t total = qm_bank_expert_bytes_total(bank);
    qm_policy pol = {0};
    qm_residency_plan *plan = NULL;
    qm_pager *pg = NULL;
    double t_create = now_s();
    if (!whole) {
        qm_pager_options o = {.prefetch = prefetch,
                              .source = direct ? QM_PAGER_SOURCE_DIRECT : QM_PAGER_SOURCE_MMAP};
        if (bench_pager_new(be, bank, policy, frac, &o, &pol, &plan, &pg, &st))
            goto fail;
        const char *why = "";
        if (direct && qm_pager_source_info(pg, &why) != QM_PAGER_SOURCE_DIRECT) {
            fprintf(stderr, "paging_disk: direct source refused: %s\n", why);
            return 1;
        }
        if (*why)
            fprintf(stderr, "paging_disk: note: %s\n", why);
    }
    t_create = now_s() - t_create;
    qm_expert_source in_place;
    qm_expert_source_direct(bank, &in_place);
    float *x = malloc(sizeof(float) * cfg->hidden), *logits = malloc(sizeof(float) * cfg->experts);
    float *y = malloc(sizeof(float) * cfg->hidden);
    uint64_t s = seed * 7919u;
    qm_pager_stats p0 = {0}, p1 = {0};
    uint64_t io0 = 0;
    double t0 = 0;
    for (uint32_t t = 0; t < warm + tokens; t++) {
        if (t == warm) {
            if (pg)
                qm_pager_stats_get(pg, &p0);
            io0 = proc_read_bytes();
            t0 = now_s();
        }
        for (uint32_t l = 0; l < cfg->layers; l++) {
            for (uint32_t h = 0; h < cfg->hidden; h++)
                x[h] = (float)((rng_next(&s) >> 40) * (2.0 / 16777216.0) - 1.0);
            for (uint32_t e = 0; e < cfg->experts; e++)
                logits[e] = -30.0f;
            const int16_t *row = tr.ids + ((size_t)t * tr.layers + l) * tr.k;
            for (uint32_t j = 0; j < tr.k; j++)
                logits[row[j]] = 2.0f - 0.25f * (float)j;
            qm_moe_call mc = {.layer = l, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = 1,
                              .logits = logits, .output = y};
            qm_moe_stats ms = {0};
            int rc = pg ? qm_pager_forward(pg, &mc, &ms, &st)
                        : qm_moe_forward(be, bank, &mc, &in_place, &ms, &st);
            if (rc)
                goto fail;
        }
    }
    double secs = now_s() - t0;
    uint64_t io = proc_read_bytes() - io0;
    if (pg)
        qm_pager_stats_get(pg, &p1);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    uint64_t hits = p1.hits - p0.hits, misses = p1.misses - p0.misses;
    printf("{\"mode\":\"%s\",\"policy\":\"%s\",\"budget\":%.2f,\"prefetch\":%d,\"layers\":%u,"
           "\"experts\":%u,\"k\":%u,\"expert_gib\":%.2f,\"tokens\":%u,\"warm\":%u,"
           "\"tokens_per_s\":%.3f,\"disk_mib_per_token\":%.1f,\"pager_disk_mib_per_token\":%.1f,"
           "\"hit_rate\":%.3f,\"stall_s\":%.2f,\"secs\":%.2f,\"create_s\":%.2f,"
           "\"maxrss_mib\":%.0f}\n",
           mode, whole ? "-" : policy, whole ? 1.0 : frac, prefetch, cfg->layers, cfg->experts,
           cfg->k, total / 1073741824.0, tokens, warm, tokens / secs,
           io / 1048576.0 / tokens, (p1.disk_bytes_read - p0.disk_bytes_read) / 1048576.0 / tokens,
           hits + misses ? (double)hits / (double)(hits + misses) : 1.0,
           (p1.stall_us - p0.stall_us) / 1e6, secs, t_create, ru.ru_maxrss / 1024.0);
    free(x);
    free(logits);
    free(y);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    sim_trace_free(&tr);
    qm_backend_free(be);
    qm_bank_close(bank);
    return 0;
fail:
    fprintf(stderr, "paging_disk: %s\n", st.msg);
    return 1;
}
