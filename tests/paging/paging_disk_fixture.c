/* paging_disk_fixture.c - see paging_disk_fixture.h. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "paging_disk_fixture.h"

#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

char g_dir[512];
int g_have_direct;

/* A directory whose filesystem takes O_DIRECT reads, or "" (the fallback
 * is checked anyway). */
void find_direct_dir(void)
{
    const char *cands[] = {getenv("QMOE_TEST_DISK_DIR"), ".", "/var/tmp", "/tmp"};
    for (size_t i = 0; i < sizeof cands / sizeof *cands; i++) {
        if (!cands[i] || !*cands[i])
            continue;
        char path[600];
        snprintf(path, sizeof path, "%s/qm_direct_probe_XXXXXX", cands[i]);
        int fd = mkstemp(path);
        if (fd < 0)
            continue;
        static char block[8192];
        int ok = write(fd, block, sizeof block) == (ssize_t)sizeof block;
        close(fd);
        int dfd = ok ? open(path, O_RDONLY | O_DIRECT) : -1;
        void *buf = NULL;
        if (dfd >= 0 && posix_memalign(&buf, 4096, 4096) == 0 && pread(dfd, buf, 4096, 0) == 4096)
            snprintf(g_dir, sizeof g_dir, "%s", cands[i]);
        free(buf);
        if (dfd >= 0)
            close(dfd);
        unlink(path);
        if (g_dir[0])
            break;
    }
    g_have_direct = g_dir[0] != 0;
    if (!g_have_direct)
        fprintf(stderr, "test_paging_disk: no directory takes O_DIRECT here; direct-only "
                        "checks skipped\n");
}

/* The fixture's bank image written to dir/name, opened from the file. */
qm_bank *file_bank(const char *dir, const char *name, char *path, size_t cap)
{
    snprintf(path, cap, "%s/%s.%d.bank", dir, name, (int)getpid());
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(fixture.bank.image, 1, fixture.bank.size, f), fixture.bank.size);
    ck_assert_int_eq(fclose(f), 0);
    qm_bank *b = NULL;
    qm_status st = {0};
    ck_assert_msg(qm_bank_open(path, &b, &st) == 0, "%s: %s", path, st.msg);
    return b;
}

void dcase_open(dcase *c, const char *dir, const char *name, size_t n_calls, uint64_t seed)
{
    memset(c, 0, sizeof *c);
    c->bank = file_bank(dir, name, c->path, sizeof c->path);
    if (n_calls)
        make_calls(&fixture.bank, fixture.cpu, n_calls, seed, &c->set);
    c->out = malloc(sizeof(float) * 8 * qm_bank_get_config(fixture.bank.bank)->hidden);
}

void dcase_close(dcase *c)
{
    free(c->out);
    if (c->set.calls)
        free_calls(&c->set);
    qm_bank_close(c->bank);
    unlink(c->path);
}

qm_pager *direct_pager_opt(qm_bank *bank, const char *policy, uint64_t budget,
                           const qm_pager_options *opt, const pg_set *set, qm_policy *pol,
                           qm_residency_plan **plan)
{
    pf_bank fb = fixture.bank;
    fb.bank = bank;
    new_policy(policy, &fb, set, pol);
    *plan = make_plan(&fb, pol, 1, budget);
    qm_pager_options o = *opt;
    o.source = QM_PAGER_SOURCE_DIRECT;
    qm_pager *pg = NULL;
    qm_status st = {0};
    int rc = qm_pager_new(fixture.cpu, bank, *plan, pol, &o, &pg, &st);
    ck_assert_msg(rc == 0, "%s budget %llu: %s", policy, (unsigned long long)budget, st.msg);
    return pg;
}

qm_pager *direct_pager(qm_bank *bank, const char *policy, uint64_t budget, int prefetch,
                       int copy_thread, const pg_set *set, qm_policy *pol,
                       qm_residency_plan **plan)
{
    qm_pager_options o = {.prefetch = prefetch, .copy_thread = copy_thread};
    return direct_pager_opt(bank, policy, budget, &o, set, pol, plan);
}

int run_call(qm_pager *pg, const pg_call *c, float *out, qm_status *st)
{
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    memset(out, 0x7f, sizeof(float) * c->T * cfg->hidden);
    qm_moe_call mc = {.layer = c->layer, .dtype = QM_DTYPE_F32, .hidden = c->x,
                      .n_tokens = c->T, .logits = c->logits, .output = out};
    qm_moe_stats ms = {0};
    return qm_pager_forward(pg, &mc, &ms, st);
}

void free_pager(qm_pager *pg, qm_residency_plan *plan, qm_policy *pol)
{
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(pol);
}


const read_path g_read_paths[N_READ_PATHS] = {
    {"auto (io_uring)", QM_PAGER_IO_AUTO, 0},
    {"threads", QM_PAGER_IO_THREADS, 0},
    {"serial, copy thread", QM_PAGER_IO_SERIAL, 0},
    {"serial, inline", QM_PAGER_IO_SERIAL, 2},
};

qm_pager_options read_path_options(int rp, int prefetch)
{
    return (qm_pager_options){.prefetch = prefetch,
                              .io_engine = g_read_paths[rp].io_engine,
                              .copy_thread = g_read_paths[rp].copy_thread};
}
