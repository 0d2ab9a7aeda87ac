/* test_paging_disk.c - the pager's disk source (QM_PAGER_SOURCE_DIRECT):
 * outputs bitwise equal to whole_bank for every policy, budget, prefetch and
 * copy path with units read from the bank file by O_DIRECT; compute never
 * reads expert weights from the mapping (it is made unreadable while the
 * forward calls run); a filesystem without O_DIRECT (tmpfs) falls back to
 * the mapping and says why; a read error or a truncated file fails that
 * request only, and the pager serves the next ones.
 *
 * Direct reads need a filesystem that takes O_DIRECT: the bank file is
 * written to QMOE_TEST_DISK_DIR, else the working directory (the build
 * tree), else /var/tmp or /tmp; when none takes it, the direct-only checks
 * are skipped with a message (the fallback is still checked). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "paging_disk_fixture.h"

#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif

START_TEST(test_direct_reads_give_bitwise_whole_bank_outputs)
{
    if (!g_have_direct)
        return;
    const pf_spec *sp = &fixture.spec;
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    dcase dc;
    dcase_open(&dc, g_dir, "direct", 24, 23);
    qm_bank *bank = dc.bank;
    const pg_set *set = &dc.set;
    float *out = dc.out;
    uint64_t U = unit_bytes(&fixture.bank), total = (uint64_t)sp->layers * sp->experts * U;
    const uint64_t budgets[] = {U, sp->k * U, total / 2, total};
    const char *policies[] = {"whole_bank", "lru", "static_hot", "next_use"};
    for (size_t pi = 0; pi < 4; pi++)
        for (size_t bi = 0; bi < 4; bi++)
            for (int pf = 0; pf < 2; pf++)
                for (int rp = 0; rp < N_READ_PATHS; rp++) {
                    uint64_t budget = pi == 0 ? total : budgets[bi];
                    qm_policy pol = {0};
                    qm_residency_plan *plan = NULL;
                    qm_pager_options o = read_path_options(rp, pf);
                    qm_pager *pg = direct_pager_opt(bank, policies[pi], budget, &o, set, &pol,
                                                    &plan);
                    const char *why = NULL;
                    ck_assert_int_eq(qm_pager_source_info(pg, &why), QM_PAGER_SOURCE_DIRECT);
                    qm_status st = {0};
                    for (size_t i = 0; i < set->n; i++) {
                        const pg_call *c = &set->calls[i];
                        ck_assert_msg(run_call(pg, c, out, &st) == 0, "%s: %s", policies[pi],
                                      st.msg);
                        ck_assert_msg(memcmp(out, c->ref, sizeof(float) * c->T * cfg->hidden) ==
                                          0,
                                      "%s budget %llu prefetch %d %s: call %zu differs",
                                      policies[pi], (unsigned long long)budget, pf,
                                      g_read_paths[rp].name, i);
                    }
                    qm_pager_stats s;
                    qm_pager_stats_get(pg, &s);
                    /* Every byte that came in came from the file (whole banks
                     * and pins at creation, misses and prefetches after). */
                    ck_assert_uint_ge(s.disk_bytes_read,
                                      s.bytes_paged_h2d + s.bytes_loaded_at_create);
                    ck_assert_uint_gt(s.disk_reads, 0);
                    ck_assert_uint_eq(s.disk_errors, 0);
                    ck_assert_uint_le(s.resident_bytes, budget);
                    free_pager(pg, plan, &pol);
                }
    dcase_close(&dc);
}
END_TEST

START_TEST(test_compute_never_reads_expert_weights_from_the_mapping)
{
    if (!g_have_direct)
        return;
    const pf_spec *sp = &fixture.spec;
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    dcase dc;
    dcase_open(&dc, g_dir, "nomap", 24, 29);
    qm_bank *bank = dc.bank;
    pg_set set = dc.set;
    uint64_t U = unit_bytes(&fixture.bank), total = (uint64_t)sp->layers * sp->experts * U;
    uint64_t map_bytes = 0;
    void *map = (void *)qm_bank_mapping(bank, &map_bytes);
    float *out = dc.out;
    const char *policies[] = {"whole_bank", "lru"};
    for (int pi = 0; pi < 2; pi++) {
        qm_policy pol = {0};
        qm_residency_plan *plan = NULL;
        /* No prefetch (its router prediction reads the router weight). */
        qm_pager *pg = direct_pager(bank, policies[pi], pi ? 3 * U : total, 0, 0, &set, &pol,
                                    &plan);
        /* The mapping unreadable: a kernel reading an expert from it faults. */
        ck_assert_int_eq(mprotect(map, map_bytes, PROT_NONE), 0);
        qm_status st = {0};
        for (size_t i = 0; i < set.n; i++) {
            const pg_call *c = &set.calls[i];
            if (!c->logits)
                continue; /* the bank's router reads the mapping (not an expert) */
            ck_assert_msg(run_call(pg, c, out, &st) == 0, "%s", st.msg);
            ck_assert(memcmp(out, c->ref, sizeof(float) * c->T * cfg->hidden) == 0);
        }
        ck_assert_int_eq(mprotect(map, map_bytes, PROT_READ), 0);
        free_pager(pg, plan, &pol);
    }
    dcase_close(&dc);
}
END_TEST

START_TEST(test_tmpfs_falls_back_to_the_mapping_and_says_why)
{
    struct statfs fs;
    if (statfs("/dev/shm", &fs) != 0 || fs.f_type != TMPFS_MAGIC) {
        fprintf(stderr, "test_paging_disk: /dev/shm is not tmpfs; fallback check skipped\n");
        return;
    }
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    dcase dc;
    dcase_open(&dc, "/dev/shm", "tmpfs", 12, 31);
    qm_bank *bank = dc.bank;
    pg_set set = dc.set;
    const char *path = dc.path;
    qm_policy pol = {0};
    qm_residency_plan *plan = NULL;
    qm_pager *pg = direct_pager(bank, "lru", 3 * unit_bytes(&fixture.bank), 1, 0, &set, &pol,
                                &plan);
    const char *why = NULL;
    ck_assert_int_eq(qm_pager_source_info(pg, &why), QM_PAGER_SOURCE_MMAP);
    ck_assert_msg(strstr(why, "does not support O_DIRECT") && strstr(why, path) &&
                      strstr(why, "serving from the mapping"),
                  "why: %s", why);
    float *out = dc.out;
    qm_status st = {0};
    for (size_t i = 0; i < set.n; i++) {
        ck_assert_int_eq(run_call(pg, &set.calls[i], out, &st), 0);
        ck_assert(memcmp(out, set.calls[i].ref, sizeof(float) * set.calls[i].T * cfg->hidden) ==
                  0);
    }
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.disk_bytes_read, 0);
    /* A memory bank and mmap asked for: nothing to say. */
    free_pager(pg, plan, &pol);
    ck_assert_int_eq(qm_policy_new("lru", NULL, &pol, &fixture.st), 0);
    plan = make_plan(&fixture.bank, &pol, 1, 3 * unit_bytes(&fixture.bank));
    qm_pager_options o = {.source = QM_PAGER_SOURCE_DIRECT};
    ck_assert_int_eq(
        qm_pager_new(fixture.cpu, fixture.bank.bank, plan, &pol, &o, &pg, &fixture.st), 0);
    ck_assert_int_eq(qm_pager_source_info(pg, &why), QM_PAGER_SOURCE_MMAP);
    ck_assert_msg(strstr(why, "in memory") != NULL, "why: %s", why);
    free_pager(pg, plan, &pol);
    dcase_close(&dc);
}
END_TEST

static int g_fail_at, g_reads;
static int failing_read(void *ud, uint64_t off, uint64_t len)
{
    (void)ud;
    (void)off;
    (void)len;
    return __atomic_add_fetch(&g_reads, 1, __ATOMIC_SEQ_CST) == g_fail_at ? EIO : 0;
}

START_TEST(test_a_read_error_fails_that_request_only)
{
    if (!g_have_direct)
        return;
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    dcase dc;
    dcase_open(&dc, g_dir, "eio", 18, 37);
    qm_bank *bank = dc.bank;
    pg_set set = dc.set;
    const char *path = dc.path;
    float *out = dc.out;
    for (int rp = 0; rp < N_READ_PATHS; rp++)
        for (int fail_at = 1; fail_at <= 12; fail_at += 3) {
            qm_policy pol = {0};
            qm_residency_plan *plan = NULL;
            qm_pager_options o = read_path_options(rp, 1);
            qm_pager *pg = direct_pager_opt(bank, "lru", 2 * unit_bytes(&fixture.bank), &o, &set,
                                            &pol, &plan);
            g_reads = 0;
            g_fail_at = fail_at;
            qm_pager_set_read_hook(pg, failing_read, NULL);
            int failed = 0;
            for (size_t i = 0; i < set.n; i++) {
                qm_status st = {0};
                int rc = run_call(pg, &set.calls[i], out, &st);
                if (rc) {
                    /* That request fails cleanly, saying what happened... */
                    ck_assert_int_eq(rc, QM_EIO);
                    ck_assert_msg(strstr(st.msg, "Input/output error") && strstr(st.msg, path),
                                  "%s", st.msg);
                    failed++;
                    /* ... and the same request succeeds when sent again. */
                    rc = run_call(pg, &set.calls[i], out, &st);
                    ck_assert_msg(rc == 0, "retry: %s", st.msg);
                }
                ck_assert(memcmp(out, set.calls[i].ref,
                                 sizeof(float) * set.calls[i].T * cfg->hidden) == 0);
            }
            qm_pager_stats s;
            qm_pager_stats_get(pg, &s);
            ck_assert_uint_eq(s.disk_errors, 1);
            ck_assert_int_le(failed, 1); /* a failed prefetch costs no request */
            ck_assert_uint_le(s.resident_bytes, 2 * unit_bytes(&fixture.bank));
            free_pager(pg, plan, &pol);
        }
    dcase_close(&dc);
}
END_TEST

START_TEST(test_a_truncated_bank_file_fails_the_requests_that_read_past_its_end)
{
    if (!g_have_direct)
        return;
    const pf_spec *sp = &fixture.spec;
    dcase dc;
    dcase_open(&dc, g_dir, "trunc", 0, 0);
    qm_bank *bank = dc.bank;
    pg_set set = {0};
    const char *path = dc.path;
    qm_policy pol = {0};
    qm_residency_plan *plan = NULL;
    qm_pager *pg = direct_pager(bank, "lru", 2 * unit_bytes(&fixture.bank), 0, 0, &set, &pol,
                                &plan);
    /* Cut the file inside the last layer's experts. */
    const qm_layer_view *last = qm_bank_layer(bank, sp->layers - 1);
    uint64_t map_bytes;
    const uint8_t *map = qm_bank_mapping(bank, &map_bytes);
    uint64_t cut = (uint64_t)((const uint8_t *)last->t[QM_T_FC1_WEIGHT].data - map);
    ck_assert_int_eq(truncate(path, (off_t)cut), 0);
    uint64_t seed = 3;
    float x[256], logits[256], out[256];
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    for (uint32_t i = 0; i < cfg->hidden; i++)
        x[i] = pf_uniform(&seed, -1, 1);
    for (int round = 0; round < 2; round++) {
        uint32_t e = (uint32_t)round;
        pf_route_logits(cfg->experts, &e, 1, logits);
        qm_moe_call mc = {.layer = sp->layers - 1, .dtype = QM_DTYPE_F32, .hidden = x,
                          .n_tokens = 1, .logits = logits, .output = out};
        qm_moe_stats ms = {0};
        qm_status st = {0};
        ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &st), QM_EIO);
        ck_assert_msg(strstr(st.msg, "truncated") != NULL, "%s", st.msg);
        /* Layer 0 lies before the cut: still served. */
        mc.layer = 0;
        ck_assert_msg(qm_pager_forward(pg, &mc, &ms, &st) == 0, "%s", st.msg);
    }
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.disk_errors, 2);
    ck_assert_uint_le(s.resident_bytes, 2 * unit_bytes(&fixture.bank));
    free_pager(pg, plan, &pol);
    dcase_close(&dc);
}
END_TEST

START_TEST(test_direct_pager_resizes_and_reads_into_new_slots)
{
    if (!g_have_direct)
        return;
    const pf_spec *sp = &fixture.spec;
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    dcase dc;
    dcase_open(&dc, g_dir, "resize", 24, 41);
    qm_bank *bank = dc.bank;
    pg_set set = dc.set;
    uint64_t U = unit_bytes(&fixture.bank), total = (uint64_t)sp->layers * sp->experts * U;
    qm_policy pol = {0};
    qm_residency_plan *plan = NULL;
    qm_pager *pg = direct_pager(bank, "lru", 3 * U, 1, 0, &set, &pol, &plan);
    float *out = dc.out;
    const uint64_t steps[] = {total, U, total / 2, 2 * U};
    qm_status st = {0};
    for (size_t i = 0; i < set.n; i++) {
        if (i % 6 == 5)
            ck_assert_int_eq(qm_pager_resize(pg, steps[(i / 6) % 4], &st), 0);
        ck_assert_int_eq(run_call(pg, &set.calls[i], out, &st), 0);
        ck_assert(memcmp(out, set.calls[i].ref, sizeof(float) * set.calls[i].T * cfg->hidden) ==
                  0);
    }
    free_pager(pg, plan, &pol);
    dcase_close(&dc);
}
END_TEST

/* A shrink of a disk-source pager frees the locked, registered slots it
 * gives back (unlocked, unpinned by registering again, then dropped), and
 * the reads into slots a growth takes again land where compute reads: on
 * every read path, bitwise equal to whole_bank throughout. */
START_TEST(test_direct_shrink_frees_locked_slots_and_regrowth_reads_right)
{
    if (!g_have_direct)
        return;
    pg_fixture_big_units();
    const pf_spec big = fixture.spec;
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    uint64_t U = unit_bytes(&fixture.bank), total = (uint64_t)big.layers * big.experts * U;
    dcase dc;
    dcase_open(&dc, g_dir, "shrink", 16, 57);
    for (int rp = 0; rp < N_READ_PATHS; rp++) {
        qm_policy pol = {0};
        qm_residency_plan *plan = NULL;
        qm_pager_options o = read_path_options(rp, 0);
        qm_pager *pg = direct_pager_opt(dc.bank, "lru", total, &o, &dc.set, &pol, &plan);
        qm_status st = {0};
        uint64_t before = pg_rss_anon();
        ck_assert_int_eq(qm_pager_resize(pg, 2 * U, &st), 0);
        uint64_t after = pg_rss_anon();
        ck_assert_msg(before - after >= (total - 2 * U) * 8 / 10,
                      "%s: shrinking %llu to %llu bytes freed %lld bytes of RssAnon",
                      g_read_paths[rp].name, (unsigned long long)total,
                      (unsigned long long)(2 * U), (long long)(before - after));
        ck_assert_int_eq(qm_pager_resize(pg, total, &st), 0);
        for (size_t i = 0; i < dc.set.n; i++) {
            const pg_call *c = &dc.set.calls[i];
            ck_assert_int_eq(run_call(pg, c, dc.out, &st), 0);
            ck_assert_msg(memcmp(dc.out, c->ref, sizeof(float) * c->T * cfg->hidden) == 0,
                          "%s: call %zu after the regrowth differs", g_read_paths[rp].name, i);
        }
        free_pager(pg, plan, &pol);
    }
    dcase_close(&dc);
}
END_TEST

/* Resident kB of this process's mapping that holds addr (/proc/self/smaps),
 * or -1 when none does. */
static long mapping_rss_kb(const void *addr)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    ck_assert_ptr_nonnull(f);
    char line[512];
    int in = 0;
    long kb = -1;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) { /* a mapping's first line */
            in = (uintptr_t)addr >= lo && (uintptr_t)addr < hi;
            continue;
        }
        if (in && sscanf(line, "Rss: %ld kB", &kb) == 1)
            break;
    }
    fclose(f);
    return kb;
}

/* A whole bank the CPU kernels read in place is mapped in when the pager is
 * made, not by the first forward calls' page faults; banks in memory and
 * paged banks are not touched. */
START_TEST(test_whole_banks_read_in_place_are_mapped_in_at_creation)
{
    pf_spec big = pf_default_spec();
    big.hidden = 512; /* ~20 MB of experts: far more than a fault maps (2 MB folios) */
    big.inter = 1024;
    pg_fixture_reopen(&big);
    const pf_spec *sp = &fixture.spec;
    dcase dc;
    dcase_open(&dc, g_dir[0] ? g_dir : ".", "prefault", 4, 29);
    uint64_t in_place = 0;
    for (uint32_t l = 0; l < sp->layers; l++)
        for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
            const qm_tensor_view *tv = &qm_bank_layer(dc.bank, l)->t[t];
            in_place += tv->present ? tv->nbytes : 0;
        }
    uint64_t map_bytes = 0;
    const void *map = qm_bank_mapping(dc.bank, &map_bytes);
    long before = mapping_rss_kb(map);
    ck_assert_int_ge(before, 0);
    ck_assert_msg((uint64_t)before * 1024 < in_place / 2,
                  "the bank's mapping is already resident (%ld kB) before the pager", before);

    pf_bank fb = fixture.bank;
    fb.bank = dc.bank;
    qm_policy pol = {0};
    new_policy("whole_bank", &fb, &dc.set, &pol);
    qm_residency_plan *plan = make_plan(&fb, &pol, 0, 0);
    qm_pager_options o = {0};
    qm_pager *pg = NULL;
    qm_status st = {0};
    ck_assert_msg(qm_pager_new(fixture.cpu, dc.bank, plan, &pol, &o, &pg, &st) == 0, "%s", st.msg);
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.bytes_loaded_at_create, 0); /* read in place, not copied */
    ck_assert_uint_eq(s.bytes_prefaulted_at_create, in_place);
    long after = mapping_rss_kb(map);
    ck_assert_msg((uint64_t)after * 1024 + 4096 >= in_place,
                  "mapping resident %ld kB after creation, whole banks are %llu bytes", after,
                  (unsigned long long)in_place);
    for (size_t i = 0; i < dc.set.n; i++) {
        ck_assert_int_eq(run_call(pg, &dc.set.calls[i], dc.out, &st), 0);
        ck_assert(memcmp(dc.out, dc.set.calls[i].ref,
                         sizeof(float) * dc.set.calls[i].T * qm_bank_get_config(dc.bank)->hidden) ==
                  0);
    }
    free_pager(pg, plan, &pol);

    /* A paged session maps nothing in at creation: its budget bounds what it holds. */
    uint64_t U = unit_bytes(&fixture.bank);
    new_policy("lru", &fb, &dc.set, &pol);
    plan = make_plan(&fb, &pol, 1, sp->k * U);
    ck_assert_msg(qm_pager_new(fixture.cpu, dc.bank, plan, &pol, &o, &pg, &st) == 0, "%s", st.msg);
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.bytes_prefaulted_at_create, 0);
    free_pager(pg, plan, &pol);

    /* A bank in memory has no mapping to populate. */
    ck_assert_uint_eq(qm_bank_prefault(fixture.bank.bank, qm_bank_data(fixture.bank.bank), 4096), 0);
    dcase_close(&dc);
}
END_TEST

static Suite *disk_suite(void)
{
    Suite *s = suite_create("paging_disk");
    TCase *tc = tcase_create("disk");
    tcase_add_checked_fixture(tc, pg_fixture_setup, pg_fixture_teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_direct_reads_give_bitwise_whole_bank_outputs);
    tcase_add_test(tc, test_compute_never_reads_expert_weights_from_the_mapping);
    tcase_add_test(tc, test_tmpfs_falls_back_to_the_mapping_and_says_why);
    tcase_add_test(tc, test_a_read_error_fails_that_request_only);
    tcase_add_test(tc, test_a_truncated_bank_file_fails_the_requests_that_read_past_its_end);
    tcase_add_test(tc, test_direct_pager_resizes_and_reads_into_new_slots);
    tcase_add_test(tc, test_direct_shrink_frees_locked_slots_and_regrowth_reads_right);
    tcase_add_test(tc, test_whole_banks_read_in_place_are_mapped_in_at_creation);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    find_direct_dir();
    SRunner *sr = srunner_create(disk_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
