/* bench_bank_open - what opening a bank costs: qm_bank_open (mmap + header
 * parse + validation) plus the region catalog of every layer, then close.
 *
 *   bench_bank_open FILE [REPEATS]
 *
 * The first run follows posix_fadvise(DONTNEED) on the file, so its header
 * comes from disk (as far as the kernel lets an unprivileged process drop
 * clean pages); the rest are warm. Prints one line per statistic, in ms. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../bench_util.h"
#include "qm_bank.h"
#include "qm_residency.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int open_and_catalog(const char *path, double *ms, uint64_t *file_bytes, uint32_t *layers,
                            uint64_t *regions)
{
    qm_status st;
    qm_bank *bank = NULL;
    double t0 = now_ms();
    if (qm_bank_open(path, &bank, &st) != 0) {
        fprintf(stderr, "bench_bank_open: %s: %s\n", path, st.msg);
        return -1;
    }
    const qm_bank_config *c = qm_bank_get_config(bank);
    uint64_t n = 0;
    for (uint32_t l = 0; l < c->layers; l++) {
        qm_region_catalog *cat = NULL;
        if (qm_bank_build_catalog(bank, l, &cat, &st) != 0) {
            fprintf(stderr, "bench_bank_open: catalog %u: %s\n", l, st.msg);
            qm_bank_close(bank);
            return -1;
        }
        for (uint32_t e = 0; e < qm_catalog_expert_count(cat); e++) {
            size_t k = 0;
            qm_catalog_regions(cat, e, &k);
            n += k;
        }
        qm_catalog_free(cat);
    }
    *file_bytes = qm_bank_file_bytes(bank);
    *layers = c->layers;
    *regions = n;
    qm_bank_close(bank);
    *ms = now_ms() - t0;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2 || argc > 3 || strcmp(argv[1], "--help") == 0) {
        fprintf(stderr, "usage: bench_bank_open FILE [REPEATS (default 21)]\n");
        return 2;
    }
    int repeats = argc == 3 ? atoi(argv[2]) : 21;
    if (repeats < 1 || repeats > 100000)
        repeats = 21;
    int fd = open(argv[1], O_RDONLY);
    if (fd >= 0) {
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
    }
    double *ms = calloc((size_t)repeats + 1, sizeof *ms);
    uint64_t bytes = 0, regions = 0;
    uint32_t layers = 0;
    double cold;
    if (!ms || open_and_catalog(argv[1], &cold, &bytes, &layers, &regions) != 0)
        return 1;
    for (int i = 0; i < repeats; i++)
        if (open_and_catalog(argv[1], &ms[i], &bytes, &layers, &regions) != 0)
            return 1;
    qsort(ms, (size_t)repeats, sizeof *ms, cmp_double);
    printf("file %s\nfile_bytes %llu\nlayers %u\nregions %llu\n", argv[1],
           (unsigned long long)bytes, layers, (unsigned long long)regions);
    printf("first_open_ms %.3f\nmedian_ms %.3f\nmin_ms %.3f\nmax_ms %.3f\nrepeats %d\n", cold,
           ms[repeats / 2], ms[0], ms[repeats - 1], repeats);
    free(ms);
    return 0;
}
