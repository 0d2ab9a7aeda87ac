/* paging_disk_fixture.h - what the disk source's suites (test_paging_disk.c,
 * test_paging_io.c) share: a directory that takes O_DIRECT, the fixture's
 * bank written to a file there, pagers reading it with the disk source. */
#ifndef PAGING_DISK_FIXTURE_H
#define PAGING_DISK_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include "paging_helpers.h"

/* A directory whose filesystem takes O_DIRECT reads (QMOE_TEST_DISK_DIR,
 * else the working directory, /var/tmp or /tmp), or "" with g_have_direct
 * 0 and a note on stderr: find_direct_dir() fills them. */
extern char g_dir[512];
extern int g_have_direct;
void find_direct_dir(void);

/* The fixture's bank image written to dir/name, opened from the file
 * (its path in path[0..cap)). */
qm_bank *file_bank(const char *dir, const char *name, char *path, size_t cap);

/* One test's bank file, calls (with whole-bank references) and output buffer. */
typedef struct dcase {
    char path[700];
    qm_bank *bank;
    pg_set set;
    float *out;
} dcase;

void dcase_open(dcase *c, const char *dir, const char *name, size_t n_calls, uint64_t seed);
void dcase_close(dcase *c); /* and removes the file */

/* A pager of `policy` at `budget` over `bank` with the disk source and the
 * other options of *opt (the test fails when it cannot be made). */
qm_pager *direct_pager_opt(qm_bank *bank, const char *policy, uint64_t budget,
                           const qm_pager_options *opt, const pg_set *set, qm_policy *pol,
                           qm_residency_plan **plan);
qm_pager *direct_pager(qm_bank *bank, const char *policy, uint64_t budget, int prefetch,
                       int copy_thread, const pg_set *set, qm_policy *pol,
                       qm_residency_plan **plan);
/* The ways the disk source reads, which its tests run over: io_uring (the
 * pool where the kernel refuses it), the pool of preadv threads, the serial
 * engine on the copy thread, and serially on the caller's thread. */
typedef struct read_path {
    const char *name;
    int io_engine, copy_thread;
} read_path;
#define N_READ_PATHS 4
extern const read_path g_read_paths[N_READ_PATHS];
/* The options of read path `rp` with prefetch `prefetch`. */
qm_pager_options read_path_options(int rp, int prefetch);

/* One forward call of c into out (filled with a pattern first). */
int run_call(qm_pager *pg, const pg_call *c, float *out, qm_status *st);
void free_pager(qm_pager *pg, qm_residency_plan *plan, qm_policy *pol);

#endif
