/* paging_disk.c - CPU decode of a bank larger than its budget: the pager
 * reading misses from disk (O_DIRECT into a locked arena) against the bank
 * served by its mapping and the page cache, or held whole in memory. One
 * configuration per process, so that bench/paging_disk/run.sh can run each
 * inside the same memory limit (a cgroup) after dropping the file from the
 * page cache, and bench/paging_disk/io.py can set one against another.
 *
 *   paging_disk --bank FILE --mode direct|mmap|whole|resident [--budget FRAC]
 *               [--policy P] [--tokens N] [--warm W] [--threads T]
 *               [--alpha A] [--locality L] [--seed S] [--trace FILE]
 *               [--io auto|threads|serial] [--io-depth D]
 *               [--precision exact|fast] [--no-prefetch]
 *
 * whole: no pager, every expert read in place from the mapping (the page
 * cache decides what stays: today's CPU serving). resident: a whole_bank
 * pager, every bank in memory before the first call (mapped in, or laid out
 * r8 in its arena for fast precision, as the daemon runs a whole_bank
 * session). mmap: a pager at FRAC of the expert bytes copying misses from
 * the mapping. direct: the same pager reading misses from the file with
 * O_DIRECT (paging_source direct) through the I/O engine --io (auto:
 * io_uring, else the pool; serial: the engine before it, one read at a time
 * and a call waiting for all its misses) with --io-depth reads in flight.
 * Routing: a synthetic decode trace (bench/policy_sim's Zipf alpha +
 * locality model), the same for every mode with the same seed, or a
 * recorded one (--trace, docs/TRACES.md); hidden states are fresh per
 * token. Before the bank is opened the file is dropped from the page cache
 * (posix_fadvise DONTNEED). W warm-up tokens are not timed. Prints one
 * JSON line: tokens/s and layer calls/s, disk bytes read per token (the
 * process's /proc/self/io read_bytes, which counts page-cache fills and
 * O_DIRECT reads alike, and the pager's own count), hit rate, misses per
 * token, stall per token, reads in flight (mean of each call's most, and
 * the most), the disk's rate while reads were in flight, peak RSS. */
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

typedef struct bench_cfg {
    const char *path, *mode, *policy, *trace, *io, *precision, *trial;
    double frac, alpha, locality;
    uint32_t tokens, warm, threads, io_depth;
    uint64_t seed;
    int prefetch;
} bench_cfg;

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

static int parse_args(int argc, char **argv, bench_cfg *c)
{
    *c = (bench_cfg){.mode = "direct", .policy = "lru", .io = "auto", .precision = "exact",
                     .frac = 0.5, .alpha = 1.0, .locality = 0.3, .tokens = 64, .warm = 8,
                     .threads = 2, .seed = 1, .prefetch = 1, .trial = "auto"};
    const bench_arg args[] = {
        {"--bank", BENCH_ARG_STR, &c->path},         {"--mode", BENCH_ARG_STR, &c->mode},
        {"--budget", BENCH_ARG_DBL, &c->frac},       {"--policy", BENCH_ARG_STR, &c->policy},
        {"--tokens", BENCH_ARG_U32, &c->tokens},     {"--warm", BENCH_ARG_U32, &c->warm},
        {"--threads", BENCH_ARG_U32, &c->threads},   {"--alpha", BENCH_ARG_DBL, &c->alpha},
        {"--locality", BENCH_ARG_DBL, &c->locality}, {"--seed", BENCH_ARG_U64, &c->seed},
        {"--trace", BENCH_ARG_STR, &c->trace},       {"--io", BENCH_ARG_STR, &c->io},
        {"--io-depth", BENCH_ARG_U32, &c->io_depth}, {"--precision", BENCH_ARG_STR, &c->precision},
        {"--prefetch-trial", BENCH_ARG_STR, &c->trial},
    };
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--no-prefetch")) {
            c->prefetch = 0;
            continue;
        }
        if (!v || !bench_arg_set(args, sizeof args / sizeof *args, a, v))
            return -1;
        i++;
    }
    const char *modes[] = {"direct", "mmap", "whole", "resident"};
    int mode_ok = 0;
    for (int i = 0; i < 4; i++)
        mode_ok |= !strcmp(c->mode, modes[i]);
    if (!c->path || c->tokens == 0 || !mode_ok || c->frac <= 0 || c->frac > 1 ||
        qm_pager_io_parse(c->io) < 0 ||
        (strcmp(c->precision, "exact") && strcmp(c->precision, "fast")) ||
        (strcmp(c->trial, "auto") && strcmp(c->trial, "on") && strcmp(c->trial, "off")))
        return -1;
    return 0;
}

/* Drops the file from the page cache: drop_caches needs root and is
 * global; this is per file and works for the owner. */
static int drop_cache(const char *path)
{
    int fd = open(path, O_RDONLY);
    /* Dirty pages (a bank just written) are not dropped: write them first. */
    if (fd < 0 || fdatasync(fd) != 0 || posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) {
        perror(path);
        if (fd >= 0)
            close(fd);
        return -1;
    }
    close(fd);
    return 0;
}

static qm_pager *make_pager(const bench_cfg *c, qm_backend *be, qm_bank *bank, qm_policy *pol,
                            qm_residency_plan **plan, qm_status *st)
{
    int direct = !strcmp(c->mode, "direct"), resident = !strcmp(c->mode, "resident");
    qm_pager_options o = {.prefetch = c->prefetch,
                          .prefetch_trial = !strcmp(c->trial, "on")    ? 1
                                            : !strcmp(c->trial, "off") ? 2
                                                                       : 0,
                          .source = direct ? QM_PAGER_SOURCE_DIRECT : QM_PAGER_SOURCE_MMAP,
                          .io_engine = qm_pager_io_parse(c->io),
                          .io_depth = c->io_depth,
                          .interleave = resident && !strcmp(c->precision, "fast")};
    qm_pager *pg = NULL;
    if (bench_pager_new(be, bank, resident ? "whole_bank" : c->policy, resident ? 0 : c->frac, &o,
                        pol, plan, &pg, st)) {
        qm_pager_free(pg);
        return NULL;
    }
    const char *why = "";
    if (direct && qm_pager_source_info(pg, &why) != QM_PAGER_SOURCE_DIRECT) {
        qm_status_set(st, QM_EINVAL, "direct source refused: %s", why);
        qm_pager_free(pg);
        return NULL;
    }
    if (*why)
        fprintf(stderr, "paging_disk: note: %s\n", why);
    return pg;
}

/* The timed decode: one T = 1 call per layer per token. */
static int decode(const bench_cfg *c, const qm_bank_config *cfg, const sim_trace *tr,
                  qm_backend *be, qm_bank *bank, qm_pager *pg, qm_pager_stats *p0,
                  qm_pager_stats *p1, uint64_t *io_bytes, double *secs, qm_status *st)
{
    qm_expert_source in_place;
    qm_expert_source_direct(bank, &in_place);
    float *x = malloc(sizeof(float) * cfg->hidden), *logits = malloc(sizeof(float) * cfg->experts);
    float *y = malloc(sizeof(float) * cfg->hidden);
    qm_precision prec = !strcmp(c->precision, "fast") ? QM_PRECISION_FAST : QM_PRECISION_EXACT;
    uint64_t s = c->seed * 7919u, io0 = 0;
    double t0 = 0;
    int rc = x && logits && y ? 0 : qm_status_set(st, QM_ENOMEM, "out of memory");
    for (uint32_t t = 0; rc == 0 && t < c->warm + c->tokens; t++) {
        if (t == c->warm) {
            if (pg)
                qm_pager_stats_get(pg, p0);
            io0 = proc_read_bytes();
            t0 = now_s();
        }
        for (uint32_t l = 0; rc == 0 && l < cfg->layers; l++) {
            for (uint32_t h = 0; h < cfg->hidden; h++)
                x[h] = (float)((rng_next(&s) >> 40) * (2.0 / 16777216.0) - 1.0);
            for (uint32_t e = 0; e < cfg->experts; e++)
                logits[e] = -30.0f;
            const int16_t *row = tr->ids + ((size_t)(t % tr->tokens) * tr->layers + l) * tr->k;
            for (uint32_t j = 0; j < tr->k && j < cfg->k; j++)
                if (row[j] >= 0 && (uint32_t)row[j] < cfg->experts)
                    logits[row[j]] = 2.0f - 0.25f * (float)j;
            qm_moe_call mc = {.layer = l, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = 1,
                              .logits = logits, .output = y, .precision = prec};
            qm_moe_stats ms = {0};
            rc = pg ? qm_pager_forward(pg, &mc, &ms, st)
                    : qm_moe_forward(be, bank, &mc, &in_place, &ms, st);
        }
    }
    *secs = now_s() - t0;
    *io_bytes = proc_read_bytes() - io0;
    if (pg)
        qm_pager_stats_get(pg, p1);
    free(x);
    free(logits);
    free(y);
    return rc;
}

static void print_row(const bench_cfg *c, const qm_bank_config *cfg, qm_bank *bank,
                      qm_pager *pg, const qm_pager_stats *p0, const qm_pager_stats *p1,
                      uint64_t io, double secs, double t_create)
{
    int whole = !strcmp(c->mode, "whole"), resident = !strcmp(c->mode, "resident");
    uint64_t hits = p1->hits - p0->hits, misses = p1->misses - p0->misses;
    uint64_t calls = p1->read_calls - p0->read_calls;
    uint32_t depth = 0;
    const char *why = "";
    int engine = pg ? qm_pager_io_info(pg, &depth, &why) : -1;
    const qm_layer_view *lv = qm_bank_layer(bank, 0);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double busy = (double)(p1->disk_busy_us - p0->disk_busy_us) / 1e6;
    double disk = (double)(p1->disk_bytes_read - p0->disk_bytes_read);
    printf("{\"mode\":\"%s\",\"policy\":\"%s\",\"budget\":%.2f,\"prefetch\":%d,"
           "\"precision\":\"%s\",\"io\":\"%s\",\"io_depth\":%u,\"layers\":%u,\"experts\":%u,"
           "\"k\":%u,\"expert_gib\":%.2f,\"expert_bytes\":%llu,\"tokens\":%u,\"warm\":%u,"
           "\"tokens_per_s\":%.3f,\"calls_per_s\":%.1f,\"disk_mib_per_token\":%.2f,"
           "\"pager_disk_mib_per_token\":%.2f,\"hit_rate\":%.3f,\"misses_per_token\":%.2f,"
           "\"stall_ms_per_token\":%.2f,\"reads_in_flight_mean\":%.1f,"
           "\"reads_in_flight_peak\":%llu,\"disk_mb_per_s\":%.0f,\"stall_s\":%.2f,\"secs\":%.2f,"
           "\"create_s\":%.2f,\"maxrss_mib\":%.0f}\n",
           c->mode, whole || resident ? "-" : c->policy, whole || resident ? 1.0 : c->frac,
           c->prefetch, c->precision, engine >= 0 ? qm_pager_io_name(engine) : "-", depth,
           cfg->layers, cfg->experts, cfg->k, qm_bank_expert_bytes_total(bank) / 1073741824.0,
           (unsigned long long)(lv ? lv->bytes_per_expert : 0), c->tokens, c->warm,
           c->tokens / secs, (double)c->tokens * cfg->layers / secs,
           io / 1048576.0 / c->tokens, disk / 1048576.0 / c->tokens,
           hits + misses ? (double)hits / (double)(hits + misses) : 1.0,
           (double)misses / c->tokens, (double)(p1->stall_us - p0->stall_us) / 1e3 / c->tokens,
           calls ? (double)(p1->reads_in_flight_sum - p0->reads_in_flight_sum) / (double)calls
                 : 0.0,
           (unsigned long long)p1->reads_in_flight_peak, busy > 0 ? disk / busy / 1e6 : 0.0,
           (p1->stall_us - p0->stall_us) / 1e6, secs, t_create, ru.ru_maxrss / 1024.0);
    if (*why)
        fprintf(stderr, "paging_disk: I/O engine note: %s\n", why);
}

int main(int argc, char **argv)
{
    bench_cfg c;
    if (parse_args(argc, argv, &c)) {
        fprintf(stderr, "usage: paging_disk --bank FILE --mode direct|mmap|whole|resident "
                        "[--budget FRAC] [--policy P] [--tokens N] [--warm W] [--threads T] "
                        "[--alpha A] [--locality L] [--seed S] [--trace FILE] "
                        "[--io auto|threads|serial] [--io-depth D] [--precision exact|fast] "
                        "[--no-prefetch] [--prefetch-trial auto|on|off]\n");
        return 2;
    }
    if (drop_cache(c.path))
        return 1;
    qm_bank *bank = NULL;
    qm_backend *be = NULL;
    const qm_bank_config *cfg = bench_open_cpu("paging_disk", c.path, c.threads, &bank, &be);
    if (!cfg)
        return 1;
    qm_status st = {0};
    sim_trace tr;
    char err[256] = "";
    if (c.trace ? sim_trace_load_any(c.trace, cfg->experts, &tr, err, sizeof err)
                : sim_trace_generate(&tr, c.tokens + c.warm, cfg->layers, cfg->experts, cfg->k,
                                     c.alpha, c.locality, c.seed)) {
        fprintf(stderr, "paging_disk: trace: %s\n", err);
        return 1;
    }
    if (tr.layers != cfg->layers) {
        fprintf(stderr, "paging_disk: the trace has %u layers, the bank %u\n", tr.layers,
                cfg->layers);
        return 1;
    }
    qm_policy pol = {0};
    qm_residency_plan *plan = NULL;
    qm_pager *pg = NULL;
    double t_create = now_s();
    if (strcmp(c.mode, "whole") && !(pg = make_pager(&c, be, bank, &pol, &plan, &st)))
        goto fail;
    t_create = now_s() - t_create;
    qm_pager_stats p0 = {0}, p1 = {0};
    uint64_t io = 0;
    double secs = 0;
    if (decode(&c, cfg, &tr, be, bank, pg, &p0, &p1, &io, &secs, &st))
        goto fail;
    print_row(&c, cfg, bank, pg, &p0, &p1, io, secs, t_create);
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
