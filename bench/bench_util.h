/* bench_util.h - clock, PRNG (splitmix64) and qsort comparator shared by the
 * bench programs (ggml/ggml_moe_bench.c is built outside CMake by
 * ggml/build.sh, so this is a header of static inline functions; each program
 * includes it by a path relative to its own folder). */
#ifndef QMOE_BENCH_UTIL_H
#define QMOE_BENCH_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* splitmix64 */
static inline uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* uniform in [0, 1) from the top 53 bits */
static inline double rng_unif01(uint64_t *s)
{
    return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

static inline float rng_uniform(uint64_t *s, float lo, float hi)
{
    return lo + (hi - lo) * (float)((double)(rng_next(s) >> 11) / 9007199254740992.0);
}

static inline int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Ends a JSON line whose "samples_ms":[ is already printed: the samples
 * (%.4f, comma-separated) and "]}\n". */
static inline void print_samples_end(const double *ms, unsigned n)
{
    for (unsigned i = 0; i < n; i++)
        printf("%s%.4f", i ? "," : "", ms[i]);
    printf("]}\n");
}

/* "--name value" options by table: bench_arg_set stores v into the entry
 * named a (atoi / strtoul / strtoull / strtod, base 10, as the programs did
 * by hand) and returns 1, or returns 0 where no entry has that name. */
typedef enum {
    BENCH_ARG_STR,
    BENCH_ARG_INT,
    BENCH_ARG_U32,
    BENCH_ARG_U64,
    BENCH_ARG_DBL
} bench_arg_kind;

typedef struct bench_arg {
    const char *name;
    bench_arg_kind kind;
    void *dst;
} bench_arg;

static inline int bench_arg_set(const bench_arg *t, size_t n, const char *a, const char *v)
{
    for (size_t i = 0; i < n; i++) {
        if (strcmp(t[i].name, a))
            continue;
        switch (t[i].kind) {
        case BENCH_ARG_STR:
            *(const char **)t[i].dst = v;
            break;
        case BENCH_ARG_INT:
            *(int *)t[i].dst = atoi(v);
            break;
        case BENCH_ARG_U32:
            *(uint32_t *)t[i].dst = (uint32_t)strtoul(v, NULL, 10);
            break;
        case BENCH_ARG_U64:
            *(uint64_t *)t[i].dst = strtoull(v, NULL, 10);
            break;
        case BENCH_ARG_DBL:
            *(double *)t[i].dst = strtod(v, NULL);
            break;
        }
        return 1;
    }
    return 0;
}

#endif
