/* test_budget.c - budgets that size themselves, as a specification: what
 * the memory bounds read (qm_memory.h, from fixture files), what "auto"
 * comes to and the sentence that says why, and the watcher's step under a
 * deficit, pressure and quiet (qm_budget.h). */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qm_budget.h"
#include "qm_config.h"
#include "qm_memory.h"

#define MB 1000000ull

static char g_root[64];

static void write_file(const char *dir, const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    ck_assert_msg(f != NULL, "cannot write %s", path);
    fputs(text, f);
    fclose(f);
}

static void make_dir(const char *path) { ck_assert_int_eq(mkdir(path, 0700), 0); }

static void fixture_root(void)
{
    snprintf(g_root, sizeof g_root, "/tmp/qm-budget-XXXXXX");
    ck_assert(mkdtemp(g_root) != NULL);
}

/* Removes the fixture tree (files two levels deep at most). */
static void fixture_remove(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
    ck_assert_int_eq(system(cmd), 0);
}

/* ---- reading the bounds ---- */

START_TEST(test_memory_reads_meminfo_and_every_limited_cgroup_up_the_chain)
{
    fixture_root();
    char meminfo[128], top[128], mid[128], leaf[128];
    snprintf(meminfo, sizeof meminfo, "%s/meminfo", g_root);
    write_file(g_root, "meminfo", "MemTotal:       1000000 kB\nMemFree: 10 kB\n"
                                  "MemAvailable:    800000 kB\n");
    snprintf(top, sizeof top, "%s/top", g_root);
    snprintf(mid, sizeof mid, "%s/top/mid", g_root);
    snprintf(leaf, sizeof leaf, "%s/top/mid/leaf", g_root);
    make_dir(top);
    make_dir(mid);
    make_dir(leaf);
    /* top: 600 MB limit, 100 MB in use of which 20 MB inactive page cache. */
    write_file(top, "memory.limit_in_bytes", "600000000\n");
    write_file(top, "memory.usage_in_bytes", "100000000\n");
    write_file(top, "memory.stat", "cache 50000000\ntotal_inactive_file 20000000\n");
    /* mid: no limit (the kernel's "unlimited"): not a bound, the walk goes on. */
    write_file(mid, "memory.limit_in_bytes", "9223372036854771712\n");
    write_file(mid, "memory.usage_in_bytes", "1\n");
    /* leaf: 200 MB, 170 MB in use, 30 MB of it inactive page cache and 50
     * MB active, 30 MB of which processes map (v1 counts the subtree): the
     * 20 MB of active pages no one maps are left out as well. */
    write_file(leaf, "memory.limit_in_bytes", "200000000\n");
    write_file(leaf, "memory.usage_in_bytes", "170000000\n");
    write_file(leaf, "memory.stat",
               "inactive_file 1\nactive_file 2\nmapped_file 3\ntotal_inactive_file 30000000\n"
               "total_active_file 50000000\ntotal_mapped_file 30000000\n");
    setenv("QMOED_TEST_MEMINFO", meminfo, 1);
    setenv("QMOED_TEST_CGROUP", leaf, 1);
    qm_mem_state m;
    qm_status st;
    qm_status_clear(&st);
    ck_assert_int_eq(qm_mem_read(&m, &st), 0);
    ck_assert_uint_eq(m.n, 3); /* host, leaf, top */
    ck_assert_int_eq(m.bounds[0].kind, QM_MEM_HOST);
    ck_assert_uint_eq(m.bounds[0].limit, 1000000ull * 1024);
    ck_assert_uint_eq(m.bounds[0].available, 800000ull * 1024);
    ck_assert_str_eq(m.bounds[1].path, leaf);
    ck_assert_int_eq(m.bounds[1].kind, QM_MEM_CGROUP_V1);
    ck_assert_uint_eq(m.bounds[1].usage, 120 * MB);
    ck_assert_uint_eq(m.bounds[1].cache, 50 * MB);
    ck_assert_uint_eq(m.bounds[1].available, 80 * MB);
    ck_assert_str_eq(m.bounds[2].path, top);
    ck_assert_uint_eq(m.bounds[2].available, 520 * MB);
    ck_assert_uint_eq(m.tightest, 1);
    ck_assert_uint_eq(qm_mem_available(&m), 80 * MB);
    ck_assert_str_eq(m.cgroup, leaf);
    char text[200];
    qm_mem_describe(&m.bounds[1], text, sizeof text);
    ck_assert_str_eq(text, "cgroup limit 200.0 MB - in use 120.0 MB");
    qm_mem_describe(&m.bounds[0], text, sizeof text);
    ck_assert_str_eq(text, "MemAvailable 819.2 MB");
    /* More mapped than active (mapped pages on the inactive list too):
     * the inactive pages alone are left out, never a mapped one. */
    write_file(leaf, "memory.stat",
               "total_inactive_file 30000000\ntotal_active_file 10000000\n"
               "total_mapped_file 25000000\n");
    ck_assert_int_eq(qm_mem_read(&m, &st), 0);
    ck_assert_uint_eq(m.bounds[1].usage, 140 * MB);
    ck_assert_uint_eq(m.bounds[1].cache, 30 * MB);
    /* Over its limit: nothing available, not a wrapped-around number. */
    write_file(leaf, "memory.usage_in_bytes", "900000000\n");
    ck_assert_int_eq(qm_mem_read(&m, &st), 0);
    ck_assert_uint_eq(m.bounds[1].available, 0);
    ck_assert_uint_eq(qm_mem_available(&m), 0);
    fixture_remove();
}
END_TEST

START_TEST(test_memory_reads_cgroup_v2_max_and_current)
{
    fixture_root();
    char leaf[128];
    snprintf(leaf, sizeof leaf, "%s/leaf", g_root);
    make_dir(leaf);
    write_file(g_root, "memory.max", "max\n"); /* the parent: no limit */
    write_file(g_root, "memory.current", "5\n");
    write_file(leaf, "memory.max", "4000000000\n");
    write_file(leaf, "memory.current", "500000000\n");
    write_file(leaf, "memory.stat",
               "anon 1\nactive_file 60000000\nfile_mapped 10000000\n"
               "inactive_file 50000000\n");
    setenv("QMOED_TEST_MEMINFO", "/nonexistent/meminfo", 1);
    setenv("QMOED_TEST_CGROUP", leaf, 1);
    qm_mem_state m;
    qm_status st;
    qm_status_clear(&st);
    ck_assert_int_eq(qm_mem_read(&m, &st), 0);
    ck_assert_uint_eq(m.n, 1); /* meminfo unreadable, the parent unlimited */
    ck_assert_int_eq(m.bounds[0].kind, QM_MEM_CGROUP_V2);
    ck_assert_int_eq(m.cgroup_kind, QM_MEM_CGROUP_V2);
    ck_assert_uint_eq(m.bounds[0].usage, 400 * MB);
    ck_assert_uint_eq(m.bounds[0].available, 3600 * MB);
    /* Nothing readable at all: an error that names meminfo. */
    setenv("QMOED_TEST_CGROUP", "/nonexistent/cgroup", 1);
    ck_assert_int_eq(qm_mem_read(&m, &st), QM_EIO);
    ck_assert_msg(strstr(st.msg, "/nonexistent/meminfo") != NULL, "%s", st.msg);
    fixture_remove();
}
END_TEST

START_TEST(test_bytes_for_people_use_decimal_units)
{
    char t[32];
    qm_mem_bytes_text(3100000000ull, t, sizeof t);
    ck_assert_str_eq(t, "3.10 GB");
    qm_mem_bytes_text(412300000ull, t, sizeof t);
    ck_assert_str_eq(t, "412.3 MB");
    qm_mem_bytes_text(96000, t, sizeof t);
    ck_assert_str_eq(t, "96.0 kB");
    qm_mem_bytes_text(512, t, sizeof t);
    ck_assert_str_eq(t, "512 bytes");
}
END_TEST

/* ---- what "auto" comes to ---- */

static qm_mem_state one_cgroup(uint64_t limit, uint64_t usage)
{
    qm_mem_state m;
    memset(&m, 0, sizeof m);
    m.n = 2;
    m.bounds[0] = (qm_mem_bound){.kind = QM_MEM_HOST, .limit = 24000 * MB, .usage = 4000 * MB,
                                 .available = 20000 * MB};
    m.bounds[1] = (qm_mem_bound){.kind = QM_MEM_CGROUP_V1, .limit = limit, .usage = usage,
                                 .available = limit > usage ? limit - usage : 0};
    snprintf(m.bounds[1].path, sizeof m.bounds[1].path, "/sys/fs/cgroup/memory/q");
    m.tightest = m.bounds[1].available < m.bounds[0].available ? 1 : 0;
    return m;
}

/* "auto" asked of a machine with one cgroup of `limit` and `usage`
 * (one_cgroup) and `reserve`: qm_budget_auto_size's code, the bytes (left
 * alone on an error), what it came to and its status. */
static int size_auto(uint64_t limit, uint64_t usage, uint64_t reserve, qm_budget_ask ask,
                     uint64_t *bytes, qm_budget_auto *a, qm_status *st)
{
    static const qm_budget_spec spec = {.form = QM_BUDGET_AUTO};
    ask.spec = &spec;
    ask.host_memory = 1;
    if (!ask.device_free)
        ask.device_free = UINT64_MAX;
    qm_mem_state m = one_cgroup(limit, usage);
    qm_status_clear(st);
    return qm_budget_auto_size(&m, reserve, &ask, bytes, a, st);
}

START_TEST(test_auto_is_the_tightest_bound_less_reserve_and_workspace)
{
    qm_budget_spec spec = {.form = QM_BUDGET_AUTO};
    qm_budget_ask ask = {.spec = &spec, .model_bytes = 10000 * MB, .workspace = 16 * MB,
                         .device_free = UINT64_MAX, .host_memory = 1};
    qm_mem_state m;
    qm_budget_auto a;
    uint64_t bytes = 0;
    qm_status st;
    /* In a cgroup the 400 MB in use (no experts of qmoed's among them)
     * count toward the reserve: 100 MB of it is kept free. */
    ck_assert_int_eq(size_auto(4000 * MB, 400 * MB, 500 * MB, ask, &bytes, &a, &st), 0);
    ck_assert_uint_eq(bytes, 3484 * MB);
    ck_assert_uint_eq(a.target, bytes);
    ck_assert_int_eq(a.on, 1);
    ck_assert_int_eq(a.by, QM_AUTO_BY_MEMORY);
    ck_assert_uint_eq(a.reserve, 500 * MB);
    ck_assert_uint_eq(a.reserve_free, 100 * MB);
    ck_assert_str_eq(a.why, "budget auto: 3.48 GB = cgroup limit 4.00 GB - in use 400.0 MB - "
                            "reserve 500.0 MB + its 400.0 MB in use - workspace 16.0 MB (cgroup v1 "
                            "/sys/fs/cgroup/memory/q)");
    /* The rest using more than the reserve: nothing more is kept. */
    ck_assert_int_eq(size_auto(4000 * MB, 700 * MB, 500 * MB, ask, &bytes, &a, &st), 0);
    ck_assert_uint_eq(bytes, 3284 * MB);
    ck_assert_uint_eq(a.reserve_free, 0);
    /* Against MemAvailable the whole reserve is kept free. */
    /* Without a cgroup limit: MemAvailable. */
    m = one_cgroup(UINT64_MAX / 2, 0);
    ask.model_bytes = 30000 * MB;
    ck_assert_int_eq(qm_budget_auto_size(&m, 500 * MB, &ask, &bytes, &a, &st), 0);
    ck_assert_uint_eq(bytes, 19484 * MB);
    ck_assert_str_eq(a.why, "budget auto: 19.48 GB = MemAvailable 20.00 GB - reserve 500.0 MB - "
                            "workspace 16.0 MB");
    /* Everything fits: the model, and what memory would have allowed. */
    ask.model_bytes = 2000 * MB;
    ck_assert_int_eq(qm_budget_auto_size(&m, 500 * MB, &ask, &bytes, &a, &st), 0);
    ck_assert_uint_eq(bytes, 2000 * MB);
    ck_assert_int_eq(a.by, QM_AUTO_BY_MODEL);
    ck_assert_msg(strstr(a.why, "= the model's expert bytes (memory allows 19.48 GB") != NULL,
                  "%s", a.why);
    /* The devices' free budget bounds it below both. */
    ask.device_free = 1016 * MB;
    ck_assert_int_eq(qm_budget_auto_size(&m, 500 * MB, &ask, &bytes, &a, &st), 0);
    ck_assert_uint_eq(bytes, 1000 * MB);
    ck_assert_int_eq(a.by, QM_AUTO_BY_DEVICE);
    /* A device whose memory is not the host's: memory is not read. */
    ask.device_free = 1016 * MB;
    ck_assert_int_eq(qm_budget_auto_size(NULL, 500 * MB, &ask, &bytes, &a, &st), 0);
    ck_assert_uint_eq(bytes, 1000 * MB);
    ck_assert_int_eq(a.has_bound, 0);
}
END_TEST

START_TEST(test_auto_with_nothing_left_is_refused_with_the_arithmetic)
{
    qm_budget_ask ask = {.model_bytes = 10000 * MB, .workspace = 16 * MB};
    qm_budget_auto a;
    uint64_t bytes = 7;
    qm_status st;
    ck_assert_int_eq(size_auto(1000 * MB, 990 * MB, 256 * MB, ask, &bytes, &a, &st),
                     QM_ERESOURCE_EXHAUSTED);
    ck_assert_uint_eq(bytes, 7);
    ck_assert_str_eq(st.field, "budget");
    ck_assert_str_eq(st.msg, "budget auto: nothing left for expert weights: cgroup limit 1.00 GB "
                             "- in use 990.0 MB - reserve 256.0 MB + its 256.0 MB in use - "
                             "workspace 16.0 MB (cgroup "
                             "v1 /sys/fs/cgroup/memory/q) = 0 bytes (free memory, or lower "
                             "auto_budget_reserve)");
}
END_TEST

START_TEST(test_a_resize_to_auto_counts_the_sessions_own_bytes)
{
    /* 800 MB of the 900 in use are experts: its own 600 and another
     * session's 200; the other 100 count toward the reserve. */
    qm_budget_ask ask = {.model_bytes = 10000 * MB, .credit = 600 * MB, .held = 800 * MB};
    qm_budget_auto a;
    uint64_t bytes = 0;
    qm_status st;
    ck_assert_int_eq(size_auto(1000 * MB, 900 * MB, 200 * MB, ask, &bytes, &a, &st), 0);
    ck_assert_uint_eq(bytes, 600 * MB);
    ck_assert_uint_eq(a.experts, 800 * MB);
    ck_assert_str_eq(a.why, "budget auto: 600.0 MB = cgroup limit 1.00 GB - in use 900.0 MB "
                            "(qmoed's experts 800.0 MB) + its own 600.0 MB - reserve 200.0 MB + "
                            "its 100.0 MB in use (cgroup v1 /sys/fs/cgroup/memory/q)");
}
END_TEST

/* The client's pending bytes are kept free beside what the reserve keeps. */
START_TEST(test_a_clients_pending_bytes_are_kept_free_beside_the_reserve)
{
    qm_budget_spec spec = {.form = QM_BUDGET_AUTO};
    qm_budget_ask ask = {.spec = &spec, .model_bytes = 10000 * MB, .workspace = 16 * MB,
                         .device_free = UINT64_MAX, .host_memory = 1, .pending = 430 * MB};
    qm_budget_auto a;
    uint64_t bytes = 0;
    qm_status st;
    /* 400 MB in use, reserve 500 MB: 100 MB kept free, and the 430 MB. */
    ck_assert_int_eq(size_auto(4000 * MB, 400 * MB, 500 * MB, ask, &bytes, &a, &st), 0);
    ck_assert_uint_eq(bytes, 3054 * MB);
    ck_assert_uint_eq(a.client_pending, 430 * MB);
    ck_assert_uint_eq(a.target, bytes);
    ck_assert_str_eq(a.why, "budget auto: 3.05 GB = cgroup limit 4.00 GB - in use 400.0 MB - "
                            "reserve 500.0 MB + its 400.0 MB in use - the client's pending 430.0 MB "
                            "- workspace 16.0 MB (cgroup v1 /sys/fs/cgroup/memory/q)");
    /* The rest already above the reserve: only the pending bytes are kept. */
    ck_assert_int_eq(size_auto(4000 * MB, 700 * MB, 500 * MB, ask, &bytes, &a, &st), 0);
    ck_assert_uint_eq(bytes, 2854 * MB);
    /* More than there is: refused, the arithmetic naming them. */
    ask.pending = 4000 * MB;
    ck_assert_int_eq(size_auto(4000 * MB, 400 * MB, 500 * MB, ask, &bytes, &a, &st),
                     QM_ERESOURCE_EXHAUSTED);
    ck_assert_msg(strstr(st.msg, "the client's pending 4.00 GB") != NULL, "%s", st.msg);
}
END_TEST

/* What the reserve keeps free, and the bound whose room is least after
 * it: not always the one with the least available. */
START_TEST(test_the_reserve_counts_what_the_rest_of_a_cgroup_uses)
{
    qm_mem_state m = one_cgroup(2000 * MB, 1500 * MB); /* 500 MB available */
    /* 1000 MB of the 1500 are qmoed's experts: the rest's 500 MB cover
     * a 400 MB reserve, which keeps nothing free; the host keeps all of
     * it (20000 MB available): the cgroup is the tightest. */
    ck_assert_uint_eq(qm_budget_reserve_free(&m.bounds[1], 400 * MB, 1000 * MB), 0);
    ck_assert_uint_eq(qm_budget_reserve_free(&m.bounds[0], 400 * MB, 1000 * MB), 400 * MB);
    uint32_t which = 9;
    ck_assert_int_eq(qm_budget_headroom(&m, 400 * MB, 1000 * MB, &which), (int64_t)(500 * MB));
    ck_assert_uint_eq(which, 1);
    /* With 1400 MB of experts the rest is 100 MB: 300 MB kept free. */
    ck_assert_uint_eq(qm_budget_reserve_free(&m.bounds[1], 400 * MB, 1400 * MB), 300 * MB);
    ck_assert_int_eq(qm_budget_headroom(&m, 400 * MB, 1400 * MB, &which), (int64_t)(200 * MB));
    /* Experts not charged here (more than its use): the rest is 0. */
    ck_assert_uint_eq(qm_budget_reserve_free(&m.bounds[1], 400 * MB, 9000 * MB), 400 * MB);
    /* A host with less room after its whole reserve bounds, though the
     * cgroup has less available; a reserve eaten gives a negative room. */
    m.bounds[0].available = 700 * MB;
    ck_assert_int_eq(qm_budget_headroom(&m, 400 * MB, 1000 * MB, &which), (int64_t)(300 * MB));
    ck_assert_uint_eq(which, 0);
    ck_assert_int_eq(qm_budget_headroom(&m, 900 * MB, 1000 * MB, &which), -(int64_t)(200 * MB));
    ck_assert_uint_eq(which, 0);
    /* No bound: unbounded. */
    m.n = 0;
    ck_assert_int_eq(qm_budget_headroom(&m, 400 * MB, 0, &which), INT64_MAX);
}
END_TEST

START_TEST(test_bytes_and_percent_need_no_memory_reading)
{
    qm_config cfg;
    qm_config_defaults(&cfg);
    qm_budget_spec spec = {.form = QM_BUDGET_PERCENT, .percent = 25};
    qm_budget_ask ask = {.spec = &spec, .model_bytes = 1000, .host_memory = 1};
    qm_budget_auto a;
    memset(&a, 0x5a, sizeof a);
    uint64_t bytes = 0;
    qm_status st;
    qm_status_clear(&st);
    setenv("QMOED_TEST_CGROUP", "/nonexistent", 1);
    setenv("QMOED_TEST_MEMINFO", "/nonexistent", 1);
    ck_assert_int_eq(qm_budget_resolve(&cfg, &ask, &bytes, &a, &st), 0);
    ck_assert_uint_eq(bytes, 250);
    ck_assert_int_eq(a.on, 0);
    spec = (qm_budget_spec){.form = QM_BUDGET_BYTES, .bytes = 77};
    ck_assert_int_eq(qm_budget_resolve(&cfg, &ask, &bytes, &a, &st), 0);
    ck_assert_uint_eq(bytes, 77);
    spec = (qm_budget_spec){.form = QM_BUDGET_NONE};
    ck_assert_int_eq(qm_budget_resolve(&cfg, &ask, &bytes, &a, &st), 0);
    ck_assert_uint_eq(bytes, 1000);
    /* auto with nothing to read: QM_EIO on field budget. */
    spec = (qm_budget_spec){.form = QM_BUDGET_AUTO};
    ck_assert_int_eq(qm_budget_resolve(&cfg, &ask, &bytes, &a, &st), QM_EIO);
    ck_assert_str_eq(st.field, "budget");
    qm_config_free(&cfg);
}
END_TEST

/* ---- the watcher's step ---- */

START_TEST(test_a_deficit_is_shared_above_the_floors_and_never_below_them)
{
    qm_budget_view v[3] = {{.budget = 600, .target = 600, .floor = 100},
                           {.budget = 300, .target = 300, .floor = 100},
                           {.budget = 100, .target = 400, .floor = 100}};
    uint64_t next[3];
    /* 150 missing: 500 and 200 above the floors give 5/7 and 2/7 of it,
     * each rounded up so that the deficit is covered. */
    ck_assert_uint_eq(qm_budget_step(-150, 0, 0, 0, 10, v, 3, next), 2);
    ck_assert_uint_eq(next[0], 600 - 108);
    ck_assert_uint_eq(next[1], 300 - 43);
    ck_assert_uint_eq(next[2], 100);
    /* More missing than there is: everyone at the floor. */
    ck_assert_uint_eq(qm_budget_step(-100000, 0, 0, 0, 10, v, 3, next), 2);
    ck_assert_uint_eq(next[0], 100);
    ck_assert_uint_eq(next[1], 100);
    /* Within the slack: the reserve absorbs it, nothing moves. */
    ck_assert_uint_eq(qm_budget_step(-150, 200, 0, 0, 10, v, 3, next), 0);
    /* A session with a resize queued is left alone; the others carry it. */
    v[1].pending = 1;
    ck_assert_uint_eq(qm_budget_step(-150, 0, 0, 0, 10, v, 3, next), 1);
    ck_assert_uint_eq(next[0], 450);
    ck_assert_uint_eq(next[1], 300);
}
END_TEST

START_TEST(test_pressure_shrinks_each_by_its_percent_down_to_its_floor)
{
    qm_budget_view v[2] = {{.budget = 1000, .target = 1000, .floor = 100},
                           {.budget = 105, .target = 400, .floor = 100}};
    uint64_t next[2];
    ck_assert_uint_eq(qm_budget_step(5000, 0, 1, 1, 10, v, 2, next), 2);
    ck_assert_uint_eq(next[0], 900);
    ck_assert_uint_eq(next[1], 100);
    /* Pressure wins over room to grow; at the floor nothing changes. */
    v[0].budget = 100;
    v[1].budget = 100;
    ck_assert_uint_eq(qm_budget_step(5000, 0, 1, 1, 10, v, 2, next), 0);
    /* Huge budgets: no overflow in the percentage. */
    qm_budget_view big = {.budget = UINT64_MAX - 1, .target = UINT64_MAX - 1, .floor = 0};
    ck_assert_uint_eq(qm_budget_step(0, 0, 1, 0, 50, &big, 1, next), 1);
    ck_assert_uint_ge(next[0], UINT64_MAX / 2 - 100);
    ck_assert_uint_le(next[0], UINT64_MAX / 2 + 100);
}
END_TEST

START_TEST(test_quiet_grows_back_toward_the_target_within_the_headroom)
{
    qm_budget_view v[3] = {{.budget = 400, .target = 1000, .floor = 100},
                           {.budget = 800, .target = 1000, .floor = 100},
                           {.budget = 500, .target = 500, .floor = 100}};
    uint64_t next[3];
    /* Not quiet yet: nothing grows. */
    ck_assert_uint_eq(qm_budget_step(10000, 0, 0, 0, 10, v, 3, next), 0);
    /* Room for all of it: each back to its target. */
    ck_assert_uint_eq(qm_budget_step(10000, 0, 0, 1, 10, v, 3, next), 2);
    ck_assert_uint_eq(next[0], 1000);
    ck_assert_uint_eq(next[1], 1000);
    ck_assert_uint_eq(next[2], 500);
    /* 400 of the 800 missing: shared 3:1 by what each lacks. */
    ck_assert_uint_eq(qm_budget_step(400, 0, 0, 1, 10, v, 3, next), 2);
    ck_assert_uint_eq(next[0], 700);
    ck_assert_uint_eq(next[1], 900);
    /* Headroom within the slack: it stays for the reserve. */
    ck_assert_uint_eq(qm_budget_step(400, 400, 0, 1, 10, v, 3, next), 0);
    /* Crumbs (under 1/64 of the target) wait for more. */
    ck_assert_uint_eq(qm_budget_step(8, 0, 0, 1, 10, v, 3, next), 0);
}
END_TEST

START_TEST(test_relapses_lengthen_the_wait_and_stop_growth_at_the_ceiling)
{
    /* The wait doubles with each relapse, up to 8 times the plain one. */
    ck_assert_uint_eq(qm_budget_grow_wait_us(30, 0), 30000000u);
    ck_assert_uint_eq(qm_budget_grow_wait_us(30, 1), 60000000u);
    ck_assert_uint_eq(qm_budget_grow_wait_us(30, 3), 240000000u);
    ck_assert_uint_eq(qm_budget_grow_wait_us(30, 9), 240000000u);
    /* Pressure within twice grow_after_s of a growth is a relapse; later,
     * or with no growth since the last relapse, it is not. */
    ck_assert(qm_budget_is_relapse(100000000u, 90000000u, 30));
    ck_assert(qm_budget_is_relapse(100000000u, 40000001u, 30));
    ck_assert(!qm_budget_is_relapse(100000000u, 40000000u, 30));
    ck_assert(!qm_budget_is_relapse(100000000u, 0, 30));
    ck_assert(!qm_budget_is_relapse(100000000u, 100000001u, 30)); /* a clock behind: no */

    qm_budget_auto a = {.on = 1, .target = 1000};
    /* No ceiling: growth aims for the auto size. */
    ck_assert_uint_eq(qm_budget_grow_target(&a, 500, 10, 5), 1000);
    /* A relapse's shrink left 800: growth stops there... */
    a.ceiling = 800;
    a.ceiling_us = 100;
    ck_assert_uint_eq(qm_budget_grow_target(&a, 640, 200, 50), 800);
    /* ...and while the budget is at it for less than a whole wait. */
    ck_assert_uint_eq(qm_budget_grow_target(&a, 800, 149, 50), 800);
    ck_assert_uint_eq(a.ceiling, 800);
    /* Below it, time alone lifts nothing. */
    ck_assert_uint_eq(qm_budget_grow_target(&a, 700, 100000, 50), 800);
    /* At it for the whole wait: lifted, and the auto size is the aim. */
    ck_assert_uint_eq(qm_budget_grow_target(&a, 800, 150, 50), 1000);
    ck_assert_uint_eq(a.ceiling, 0);
    /* A ceiling at or above the auto size is no ceiling. */
    a.ceiling = 1200;
    ck_assert_uint_eq(qm_budget_grow_target(&a, 500, 0, 50), 1000);

    /* Through the step: the view's target is the ceiling, so quiet with
     * room for all of it grows to 800, not 1000. */
    a.ceiling = 800;
    a.ceiling_us = 100;
    qm_budget_view v = {
        .budget = 640, .target = qm_budget_grow_target(&a, 640, 1000, 50), .floor = 100};
    uint64_t next;
    ck_assert_uint_eq(qm_budget_step(100000, 0, 0, 1, 10, &v, 1, &next), 1);
    ck_assert_uint_eq(next, 800);
}
END_TEST

START_TEST(test_auto_budget_config_keys_and_their_checks)
{
    qm_config cfg;
    qm_config_defaults(&cfg);
    ck_assert_uint_eq(cfg.auto_budget_reserve, 256ull << 20);
    ck_assert_uint_eq(cfg.auto_budget_check_ms, 1000);
    ck_assert_str_eq(cfg.auto_budget_pressure_level, "medium");
    ck_assert_uint_eq(cfg.auto_budget_grace_ms, 3000);
    char *argv[] = {"qmoed", "--set", "auto_budget_reserve=1G", "--set",
                    "auto_budget_pressure_level=low", "--set", "auto_budget_shrink_percent=25",
                    "--set", "auto_budget_grace_ms=0", NULL};
    qm_status st;
    qm_status_clear(&st);
    ck_assert_int_eq(qm_config_from_args(&cfg, 9, argv, &st), 0);
    ck_assert_uint_eq(cfg.auto_budget_reserve, 1ull << 30);
    ck_assert_str_eq(cfg.auto_budget_pressure_level, "low");
    ck_assert_uint_eq(cfg.auto_budget_shrink_percent, 25);
    ck_assert_uint_eq(cfg.auto_budget_grace_ms, 0);
    qm_config_free(&cfg);
    static const char *const bad[][2] = {
        {"auto_budget_pressure_level=high", "low, medium, critical"},
        {"auto_budget_shrink_percent=0", "1..90"},
        {"auto_budget_shrink_percent=95", "1..90"},
        {"auto_budget_pressure_ms=2001", "0..2000"},
        {"auto_budget_grace_ms=600001", "0..600000"},
        {"auto_budget_reserve=lots", "non-negative integer"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        qm_config_defaults(&cfg);
        char *a[] = {"qmoed", "--set", (char *)bad[i][0], NULL};
        qm_status_clear(&st);
        ck_assert_int_eq(qm_config_from_args(&cfg, 3, a, &st), QM_EINVAL);
        ck_assert_msg(strstr(st.msg, bad[i][1]) != NULL, "%s: %s", bad[i][0], st.msg);
        qm_config_free(&cfg);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("budget");
    TCase *tc = tcase_create("memory");
    tcase_add_test(tc, test_memory_reads_meminfo_and_every_limited_cgroup_up_the_chain);
    tcase_add_test(tc, test_memory_reads_cgroup_v2_max_and_current);
    tcase_add_test(tc, test_bytes_for_people_use_decimal_units);
    suite_add_tcase(s, tc);
    tc = tcase_create("auto");
    tcase_add_test(tc, test_auto_is_the_tightest_bound_less_reserve_and_workspace);
    tcase_add_test(tc, test_auto_with_nothing_left_is_refused_with_the_arithmetic);
    tcase_add_test(tc, test_a_resize_to_auto_counts_the_sessions_own_bytes);
    tcase_add_test(tc, test_the_reserve_counts_what_the_rest_of_a_cgroup_uses);
    tcase_add_test(tc, test_a_clients_pending_bytes_are_kept_free_beside_the_reserve);
    tcase_add_test(tc, test_bytes_and_percent_need_no_memory_reading);
    tcase_add_test(tc, test_auto_budget_config_keys_and_their_checks);
    suite_add_tcase(s, tc);
    tc = tcase_create("step");
    tcase_add_test(tc, test_a_deficit_is_shared_above_the_floors_and_never_below_them);
    tcase_add_test(tc, test_pressure_shrinks_each_by_its_percent_down_to_its_floor);
    tcase_add_test(tc, test_quiet_grows_back_toward_the_target_within_the_headroom);
    tcase_add_test(tc, test_relapses_lengthen_the_wait_and_stop_growth_at_the_ceiling);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
