/* test_daemon_units.c - the daemon's pieces that need no socket: latency
 * histograms, the trace ring, flags and the config file, the systemd
 * helpers. The wire behaviour is tested end to end in test_qmoed.py. */
#include <check.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_backend.h"
#include "qm_config.h"
#include "qm_idle_hint.h"
#include "qm_log.h"
#include "qm_notify.h"
#include "qm_pool.h"
#include "qm_server.h"
#include "qm_moe.h"
#include "qm_pager.h"
#include "qm_protocol.h"
#include "qm_reclaim.h"
#include "qm_sigbus.h"
#include "qm_telemetry.h"

START_TEST(test_hist_quantiles_are_bucket_upper_bounds_within_25_percent)
{
    qm_hist h;
    memset(&h, 0, sizeof h);
    ck_assert_uint_eq(qm_hist_quantile(&h, 0.5), 0);
    for (uint64_t v = 1; v <= 1000; v++)
        qm_hist_add(&h, v);
    uint64_t p50 = qm_hist_quantile(&h, 0.5), p99 = qm_hist_quantile(&h, 0.99);
    ck_assert_msg(p50 >= 500 && p50 <= 625, "p50 = %llu", (unsigned long long)p50);
    ck_assert_msg(p99 >= 990 && p99 <= 1237, "p99 = %llu", (unsigned long long)p99);
    qm_hist_add(&h, UINT64_MAX); /* the last bucket holds anything */
    ck_assert_uint_eq(h.count, 1001);
}
END_TEST

START_TEST(test_trace_ring_keeps_the_newest_spans)
{
    qm_trace t;
    ck_assert_int_eq(qm_trace_init(&t, 4, 1000), 0);
    qm_span out;
    for (int i = 0; i < 6; i++)
        qm_trace_add(&t, "session.infer", 1000 + (uint64_t)i, 1, "s", NULL, &out);
    ck_assert_uint_eq(t.count, 4);
    ck_assert_uint_eq(out.seq, 6);
    ck_assert_str_eq(out.args, "{}");
    /* Oldest first, times from the daemon's start. */
    for (size_t i = 0; i < t.count; i++)
        ck_assert_uint_eq(qm_trace_at(&t, i)->start_us, 2 + i);
    qm_trace_free(&t);
}
END_TEST

/* A job's paging lands in the session's counters and the daemon's, each
 * counter from the statistics its row names; the others stay. */
START_TEST(test_paging_counters_sum_the_growth_of_their_pager_statistics)
{
    qm_pager_stats was = {.hits = 5, .whole_bank_accesses = 2, .misses = 1, .evictions = 4,
                          .bytes_paged_h2d = 100, .prefetch_issued = 3, .prefetch_useful = 1,
                          .disk_bytes_read = 7, .stall_us = 9, .host_runs = 2,
                          .resident_bytes = 500};
    qm_pager_stats now = was;
    now.hits += 10;
    now.whole_bank_accesses += 3;
    now.misses += 2;
    now.evictions += 1;
    now.bytes_paged_h2d += 4096;
    now.prefetch_issued += 6;
    now.prefetch_useful += 5;
    now.disk_bytes_read += 8192;
    now.stall_us += 11;
    now.host_runs += 4;
    now.resident_bytes = 300;
    now.waves += 99; /* no counter reads it */
    qm_counters session = {.requests = 1, .tokens = 2}, daemon = {.requests = 8, .errors = 3};
    qm_counters_add_paging(&session, &daemon, &was, &now);
    qm_counters_add_paging(&session, &daemon, &now, &now); /* nothing new */
    const qm_counters *both[2] = {&session, &daemon};
    for (int i = 0; i < 2; i++) {
        const qm_counters *c = both[i];
        ck_assert_uint_eq(c->expert_hits, 13);
        ck_assert_uint_eq(c->expert_misses, 2);
        ck_assert_uint_eq(c->evictions, 1);
        ck_assert_uint_eq(c->bytes_paged_h2d, 4096);
        ck_assert_uint_eq(c->prefetch_issued, 6);
        ck_assert_uint_eq(c->prefetch_useful, 5);
        ck_assert_uint_eq(c->bytes_read_disk, 8192);
        ck_assert_uint_eq(c->stall_us, 11);
        ck_assert_uint_eq(c->expert_host_runs, 4);
    }
    ck_assert_uint_eq(session.resident_bytes, 300);
    ck_assert_uint_eq(daemon.resident_bytes, 0); /* the sum over sessions, made when read */
    ck_assert_uint_eq(session.requests, 1);
    ck_assert_uint_eq(session.tokens, 2);
    ck_assert_uint_eq(daemon.requests, 8);
    ck_assert_uint_eq(daemon.errors, 3);
    /* Every counter has a name and help, in telemetry.get's order. */
    ck_assert_str_eq(qm_counter_name(0), "requests");
    for (size_t i = 0; i < qm_counter_count(); i++)
        ck_assert(qm_counter_name(i) && qm_counter_help(i) && qm_counter_help(i)[0]);
    ck_assert_ptr_null(qm_counter_name(qm_counter_count()));
}
END_TEST

static char *write_temp(const char *text)
{
    static char path[64];
    snprintf(path, sizeof path, "/tmp/qmoed-unit-XXXXXX");
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

START_TEST(test_flags_override_the_config_file)
{
    char *path = write_temp("{\"max_batch\": 3, \"socket\": \"/tmp/a.sock\", "
                            "\"models\": {\"m\": \"/from/file\"}}");
    char *argv[] = {"qmoed", "--set", "max_batch=5", "--config", path, "--model", "m=/from/flag",
                    "--device-budget", "2G", "--log-level", "debug", NULL};
    qm_config cfg;
    qm_config_defaults(&cfg);
    qm_status st;
    qm_status_clear(&st);
    ck_assert_int_eq(qm_config_from_args(&cfg, 11, argv, &st), 0);
    ck_assert_uint_eq(cfg.max_batch, 5);
    ck_assert_str_eq(cfg.socket_path, "/tmp/a.sock");
    ck_assert_uint_eq(cfg.n_models, 1);
    ck_assert_str_eq(cfg.models[0].path, "/from/flag");
    ck_assert(cfg.has_device_budget && cfg.device_budget == 2ull << 30);
    ck_assert_int_eq(cfg.log_level, QM_LOG_DEBUG);
    qm_config_free(&cfg);
    unlink(path);
}
END_TEST

START_TEST(test_config_rejects_unknown_keys_and_bad_values)
{
    qm_config cfg;
    qm_status st;
    char *path = write_temp("{\"max_batchh\": 1}");
    qm_config_defaults(&cfg);
    ck_assert_int_eq(qm_config_load_file(&cfg, path, 0, &st), QM_EINVAL);
    ck_assert_ptr_nonnull(strstr(st.msg, "max_batchh"));
    unlink(path);
    char *a1[] = {"qmoed", "--set", "max_nesting=1", NULL};
    optind = 1;
    ck_assert_int_eq(qm_config_from_args(&cfg, 3, a1, &st), QM_EINVAL);
    ck_assert_ptr_nonnull(strstr(st.msg, "2..1000"));
    char *a2[] = {"qmoed", "--log-level", "loud", NULL};
    ck_assert_int_eq(qm_config_from_args(&cfg, 3, a2, &st), QM_EINVAL);
    char *a3[] = {"qmoed", "--model", "noequals", NULL};
    ck_assert_int_eq(qm_config_from_args(&cfg, 3, a3, &st), QM_EINVAL);
    char *a4[] = {"qmoed", "--backend", "tpu", NULL};
    ck_assert_int_eq(qm_config_from_args(&cfg, 3, a4, &st), QM_EINVAL);
    qm_config_free(&cfg);
}
END_TEST

/* The wire's enums are the engine's registries: the names of
 * policy_params.on_miss are qm_on_miss_at's, in order, each landing its
 * value; precision's land qm_precision; and paging_source (a config key)
 * takes every name of the pager's registry and only those. */
static const qm_wire_param *row_of(const qm_wire_rows *rows, const char *member)
{
    for (size_t i = 0; rows && i < rows->n; i++)
        if (strcmp(rows->rows[i].member, member) == 0)
            return &rows->rows[i];
    return NULL;
}

START_TEST(test_the_wires_enums_are_the_registries)
{
    const qm_wire_rows *create = qm_wire_params(QM_METHOD_SESSION_CREATE);
    const qm_wire_param *pp = row_of(create, "policy_params");
    ck_assert_ptr_nonnull(pp);
    const qm_wire_param *on_miss = row_of(pp->object, "on_miss");
    ck_assert_ptr_nonnull(on_miss);
    size_t n = 0;
    int value;
    for (const char *name; (name = qm_on_miss_at(n, &value)) != NULL; n++) {
        ck_assert_ptr_nonnull(on_miss->names[n]);
        ck_assert_str_eq(on_miss->names[n], name);
        ck_assert_int_eq(value, (int)n); /* the row lands the index */
    }
    ck_assert_ptr_null(on_miss->names[n]);
    const qm_wire_param *precision = row_of(create, "precision");
    ck_assert_str_eq(precision->names[QM_PRECISION_EXACT], "exact");
    ck_assert_str_eq(precision->names[QM_PRECISION_FAST], "fast");
    ck_assert_ptr_null(precision->names[2]);
    qm_config cfg;
    qm_status st;
    qm_config_defaults(&cfg);
    for (size_t i = 0; qm_pager_source_at(i, &value); i++) {
        char set[64];
        snprintf(set, sizeof set, "paging_source=%s", qm_pager_source_at(i, NULL));
        char *args[] = {"qmoed", "--set", set, NULL};
        optind = 1;
        ck_assert_int_eq(qm_config_from_args(&cfg, 3, args, &st), 0);
        ck_assert_int_eq(cfg.paging_source, value);
    }
    char *bad[] = {"qmoed", "--set", "paging_source=nvme", NULL};
    optind = 1;
    ck_assert_int_eq(qm_config_from_args(&cfg, 3, bad, &st), QM_EINVAL);
    for (size_t i = 0; qm_pager_source_at(i, NULL); i++)
        ck_assert_ptr_nonnull(strstr(st.msg, qm_pager_source_at(i, NULL)));
    qm_config_free(&cfg);
}
END_TEST

/* --backend and --device take the backend registry's kinds, and their
 * errors name every kind that would do: nothing is typed in qm_config.c. */
START_TEST(test_backend_and_device_kinds_come_from_the_registry)
{
    qm_config cfg;
    qm_status st;
    char bad_backend[QM_STATUS_MSG_MAX] = "", bad_device[QM_STATUS_MSG_MAX] = "";
    char *a1[] = {"qmoed", "--backend", "tpu", NULL};
    char *a2[] = {"qmoed", "--device", "tpu:0", NULL};
    qm_config_defaults(&cfg);
    optind = 1;
    ck_assert_int_eq(qm_config_from_args(&cfg, 3, a1, &st), QM_EINVAL);
    snprintf(bad_backend, sizeof bad_backend, "%s", st.msg);
    qm_config_free(&cfg);
    qm_config_defaults(&cfg);
    optind = 1;
    ck_assert_int_eq(qm_config_from_args(&cfg, 3, a2, &st), QM_EINVAL);
    snprintf(bad_device, sizeof bad_device, "%s", st.msg);
    qm_config_free(&cfg);
    ck_assert_msg(strstr(bad_backend, " or auto"), "%s", bad_backend);
    size_t numbered = 0;
    for (size_t i = 0; i < qm_backend_kind_count(); i++) {
        const char *kind = qm_backend_kind_name(i);
        unsigned caps = qm_backend_kind_caps(i);
        ck_assert_msg(strstr(bad_backend, kind), "%s: not in '%s'", kind, bad_backend);
        char backend[32], list[48];
        snprintf(backend, sizeof backend, "%s", kind);
        snprintf(list, sizeof list, "%s:0,%s:2", kind, kind);
        char *b[] = {"qmoed", "--backend", backend, NULL};
        char *l[] = {"qmoed", "--device", list, NULL};
        qm_config_defaults(&cfg);
        optind = 1;
        ck_assert_msg(qm_config_from_args(&cfg, 3, b, &st) == 0, "%s: %s", kind, st.msg);
        ck_assert_str_eq(cfg.backend, kind);
        qm_config_free(&cfg);
        qm_config_defaults(&cfg);
        optind = 1;
        int rc = qm_config_from_args(&cfg, 3, l, &st);
        if (caps & QM_BACKEND_CAP_NUMBERED) {
            numbered++;
            ck_assert_msg(rc == 0, "%s: %s", list, st.msg);
            ck_assert_str_eq(cfg.device_kind, kind);
            ck_assert_uint_eq(cfg.n_devices, 2);
            ck_assert_msg(strstr(bad_device, kind), "%s: not in '%s'", kind, bad_device);
        } else {
            ck_assert_msg(rc == QM_EINVAL && strstr(st.msg, "unknown kind"), "%s: %d %s", list,
                          rc, st.msg);
        }
        if (caps & QM_BACKEND_CAP_HOST) {
            qm_config_free(&cfg);
            qm_config_defaults(&cfg);
            ck_assert_str_eq(cfg.backend, kind); /* the default */
        }
        qm_config_free(&cfg);
    }
    ck_assert_uint_gt(numbered, 0);
}
END_TEST

START_TEST(test_device_lists_and_budgets_per_device)
{
    qm_config cfg;
    qm_status st;
    char *path = write_temp("{\"device\": \"emu:0,emu:3\", \"device_budget\": \"1G,512M\", "
                            "\"emu_copy_mbps\": 16000}");
    char *a1[] = {"qmoed", "--config", path, NULL};
    qm_config_defaults(&cfg);
    optind = 1;
    ck_assert_int_eq(qm_config_from_args(&cfg, 3, a1, &st), 0);
    ck_assert_uint_eq(cfg.n_devices, 2);
    ck_assert_str_eq(cfg.device_kind, "emu");
    ck_assert_str_eq(cfg.backend, "emu"); /* the list's kind, no backend given */
    ck_assert_uint_eq(cfg.device_index[1], 3);
    ck_assert_uint_eq(cfg.n_device_budgets, 2);
    ck_assert_uint_eq(cfg.device_budgets[0], 1ull << 30);
    ck_assert_uint_eq(cfg.device_budgets[1], 512ull << 20);
    ck_assert_uint_eq(cfg.emu_copy_mbps, 16000);
    qm_config_free(&cfg);
    unlink(path);
    /* One budget for every device; a number in the file. */
    path = write_temp("{\"device_budget\": 4096}");
    qm_config_defaults(&cfg);
    ck_assert_int_eq(qm_config_load_file(&cfg, path, 0, &st), 0);
    ck_assert(cfg.has_device_budget && cfg.n_device_budgets == 1 && cfg.device_budget == 4096);
    qm_config_free(&cfg);
    unlink(path);
    /* Refused: a backend of another kind, a budget count that fits neither
     * rule, a zero budget. */
    char *a2[] = {"qmoed", "--backend", "cpu", "--device", "emu:0,emu:1", NULL};
    char *a3[] = {"qmoed", "--device", "emu:0,emu:1,emu:2", "--device-budget", "1G,2G", NULL};
    char *a4[] = {"qmoed", "--device-budget", "1G,0", NULL};
    char *a5[] = {"qmoed", "--device-budget", "1G,123456789012345678901234567890123", NULL};
    struct {
        char **argv;
        const char *field, *says;
    } bad[] = {{a2, "device", "backend is cpu"},
               {a3, "device_budget", "2 values for 3 devices"},
               {a4, "device_budget", "value 2 must be a positive"},
               {a5, "device_budget", "value 2 must be a positive"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int argc = 0;
        while (bad[i].argv[argc])
            argc++;
        qm_config_defaults(&cfg);
        optind = 1;
        ck_assert_int_eq(qm_config_from_args(&cfg, argc, bad[i].argv, &st), QM_EINVAL);
        ck_assert_str_eq(st.field, bad[i].field);
        ck_assert_msg(strstr(st.msg, bad[i].says), "%s", st.msg);
        qm_config_free(&cfg);
    }
}
END_TEST

START_TEST(test_reload_changes_only_reloadable_keys)
{
    qm_config cfg;
    qm_config_defaults(&cfg);
    qm_status st;
    char *path = write_temp("{\"socket\": \"/tmp/new.sock\", \"max_batch\": 9, \"workers\": 7, "
                            "\"admin_group\": \"wheel\", \"models\": {\"x\": \"/x\"}}");
    ck_assert_int_eq(qm_config_load_file(&cfg, path, 1, &st), 0);
    ck_assert_ptr_null(cfg.socket_path);
    ck_assert_uint_eq(cfg.workers, 2);
    ck_assert_uint_eq(cfg.n_models, 0);
    ck_assert_uint_eq(cfg.max_batch, 9);
    ck_assert_str_eq(cfg.admin_group, "wheel");
    qm_config_free(&cfg);
    unlink(path);
}
END_TEST

/* SIGHUP's reload: what a fresh start with the same command line and
 * today's file would give, for the reloadable keys only, all or nothing. */
static void rewrite(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

START_TEST(test_reload_is_a_fresh_parse_all_or_nothing_with_flags_over_the_file)
{
    char *path = write_temp("{\"max_batch\": 2, \"max_nesting\": 9, \"admin_group\": \"wheel\"}");
    char *argv[] = {"qmoed", "--config", path, "--set", "max_nesting=10", NULL};
    int argc = 5;
    qm_config cfg;
    qm_config_defaults(&cfg);
    qm_status st;
    qm_status_clear(&st);
    optind = 1;
    ck_assert_int_eq(qm_config_from_args(&cfg, argc, argv, &st), 0);
    ck_assert_uint_eq(cfg.max_batch, 2);
    ck_assert_uint_eq(cfg.max_nesting, 10); /* the flag over the file */
    ck_assert_str_eq(cfg.admin_group, "wheel");
    /* A file that does not load changes nothing: not the keys before the
     * bad one either (admin_group was taken from such a file before). */
    rewrite(path, "{\"admin_group\": \"staff\", \"max_batch\": 8, \"max_sessions\": 0}");
    ck_assert_int_eq(qm_config_reload(&cfg, argc, argv, &st), QM_EINVAL);
    ck_assert_str_eq(st.field, "max_sessions");
    ck_assert_str_eq(cfg.admin_group, "wheel");
    ck_assert_uint_eq(cfg.max_batch, 2);
    /* The flag still wins over the file; keys taken out of the file go
     * back to their defaults; keys that need a restart stay. */
    rewrite(path, "{\"max_nesting\": 20, \"max_sessions\": 5, \"workers\": 7}");
    ck_assert_int_eq(qm_config_reload(&cfg, argc, argv, &st), 0);
    ck_assert_uint_eq(cfg.max_nesting, 10);
    ck_assert_uint_eq(cfg.max_sessions, 5);
    ck_assert_uint_eq(cfg.max_batch, 128);
    ck_assert_ptr_null(cfg.admin_group);
    ck_assert_uint_eq(cfg.workers, 2);
    ck_assert_str_eq(cfg.config_path, path);
    /* A file that is gone: the old configuration stays. */
    unlink(path);
    ck_assert_int_lt(qm_config_reload(&cfg, argc, argv, &st), 0);
    ck_assert_uint_eq(cfg.max_sessions, 5);
    qm_config_free(&cfg);
}
END_TEST

/* A session is orphaned once every connection that touched it has closed
 * and nothing of it is queued; a touch clears the mark. */
START_TEST(test_orphan_mark_needs_every_toucher_gone_and_nothing_queued)
{
    qm_touches t;
    memset(&t, 0, sizeof t);
    qm_touches_add(&t, 7);
    qm_touches_add(&t, 9);
    qm_touches_add(&t, 7); /* recorded once */
    ck_assert_uint_eq(t.n, 2);
    ck_assert_int_eq(qm_touches_forget(&t, 7), 1);
    ck_assert_int_eq(qm_touches_forget(&t, 7), 0);
    ck_assert_int_eq(qm_touches_mark(&t, 0, 1000), 0); /* 9 is still open */
    ck_assert_int_eq(qm_touches_forget(&t, 9), 1);
    ck_assert_int_eq(qm_touches_mark(&t, 1, 1000), 0); /* a job still queued or running */
    ck_assert_int_eq(qm_touches_mark(&t, 0, 1000), 1);
    ck_assert_int_eq(qm_touches_mark(&t, 0, 2000), 0); /* already marked: the clock holds */
    ck_assert_uint_eq(t.orphaned_us, 1000);
    ck_assert_int_gt(t.orphaned_at, 0);
    /* 2 s timeout: 1.5 s left rounds up to 2, past due is 0, timeout 0 never. */
    ck_assert_int_eq(qm_touches_reclaim_in_s(&t, 2, 500000), 2);
    ck_assert_int_eq(qm_touches_reclaim_in_s(&t, 2, 1000 + 2000000), 0);
    ck_assert_int_eq(qm_touches_reclaim_in_s(&t, 0, 500000), -1);
    qm_touches_add(&t, 11); /* a client came back */
    ck_assert_uint_eq(t.orphaned_us, 0);
    ck_assert_int_eq(qm_touches_reclaim_in_s(&t, 2, 500000), -1);
    for (uint64_t i = 100; i < 140; i++) /* grows past its first capacity */
        qm_touches_add(&t, i);
    ck_assert_uint_eq(t.n, 41);
    qm_touches_free(&t);
    ck_assert_uint_eq(t.n, 0);
}
END_TEST

static void *fail_realloc(void *ptr, size_t size, void *ud)
{
    (void)ptr, (void)size, (void)ud;
    return NULL;
}
static void *plain_malloc(size_t size, void *ud)
{
    (void)ud;
    return malloc(size);
}
static void plain_free(void *ptr, void *ud)
{
    (void)ud;
    free(ptr);
}

/* A touch that cannot be recorded keeps the session for good: forgetting
 * it could reclaim a session in use. */
START_TEST(test_a_touch_lost_to_out_of_memory_never_orphans)
{
    qm_touches t;
    memset(&t, 0, sizeof t);
    qm_alloc_hooks h = {plain_malloc, fail_realloc, plain_free, NULL};
    qm_alloc_set_hooks(&h);
    qm_touches_add(&t, 3);
    qm_alloc_set_hooks(NULL);
    ck_assert_int_eq(t.lost, 1);
    ck_assert_int_eq(qm_touches_forget(&t, 3), 0);
    ck_assert_int_eq(qm_touches_mark(&t, 0, 1000), 0);
    qm_touches_free(&t);
}
END_TEST

START_TEST(test_orphan_timeout_is_a_reloadable_key_with_a_flag)
{
    qm_config cfg;
    qm_config_defaults(&cfg);
    ck_assert_uint_eq(cfg.session_orphan_timeout_s, 300);
    qm_status st;
    char *argv[] = {"qmoed", "--session-orphan-timeout", "0", NULL};
    ck_assert_int_eq(qm_config_from_args(&cfg, 3, argv, &st), 0);
    ck_assert_uint_eq(cfg.session_orphan_timeout_s, 0);
    char *path = write_temp("{\"session_orphan_timeout_s\": 2}");
    ck_assert_int_eq(qm_config_load_file(&cfg, path, 1, &st), 0);
    ck_assert_uint_eq(cfg.session_orphan_timeout_s, 2);
    qm_config_free(&cfg);
    unlink(path);
}
END_TEST

START_TEST(test_notify_sends_one_datagram_and_is_silent_without_socket)
{
    unsetenv("NOTIFY_SOCKET");
    ck_assert_int_eq(qm_notify("READY=1"), 0);
    char path[64];
    snprintf(path, sizeof path, "/tmp/qmoed-notify-%d", (int)getpid());
    unlink(path);
    int fd = socket(AF_UNIX, SOCK_DGRAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    setenv("NOTIFY_SOCKET", path, 1);
    ck_assert_int_eq(qm_notify("READY=1\nSTATUS=serving"), 0);
    char buf[64] = {0};
    ck_assert_int_eq(recv(fd, buf, sizeof buf - 1, 0), 22);
    ck_assert_str_eq(buf, "READY=1\nSTATUS=serving");
    close(fd);
    unlink(path);
    unsetenv("NOTIFY_SOCKET");
}
END_TEST

START_TEST(test_socket_activation_and_watchdog_need_our_pid)
{
    setenv("LISTEN_PID", "1", 1);
    setenv("LISTEN_FDS", "1", 1);
    ck_assert_int_eq(qm_listen_fd_from_env(), -1);
    unsetenv("LISTEN_PID");
    unsetenv("LISTEN_FDS");
    setenv("WATCHDOG_USEC", "2000000", 1);
    unsetenv("WATCHDOG_PID");
    ck_assert_uint_eq(qm_watchdog_usec(), 2000000);
    setenv("WATCHDOG_PID", "1", 1);
    ck_assert_uint_eq(qm_watchdog_usec(), 0);
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
}
END_TEST

/* A read of a bank page past the file's new end patches in zeros and
 * poisons the bank instead of killing the process. */
START_TEST(test_sigbus_in_a_truncated_bank_mapping_reads_zeros_and_poisons)
{
    long page = sysconf(_SC_PAGESIZE);
    char path[] = "/tmp/qmoed-sigbus-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    unlink(path);
    char *fill = malloc((size_t)page * 3);
    memset(fill, 0x5a, (size_t)page * 3);
    ck_assert_int_eq(write(fd, fill, (size_t)page * 3), page * 3);
    free(fill);
    volatile unsigned char *m = mmap(NULL, (size_t)page * 3, PROT_READ, MAP_SHARED, fd, 0);
    ck_assert_ptr_ne((void *)m, MAP_FAILED);
    ck_assert_int_eq(qm_sigbus_install(), 0);
    int slot = qm_sigbus_register((const void *)m, (uint64_t)page * 3);
    ck_assert_int_ge(slot, 0);
    ck_assert_int_eq(qm_sigbus_poisoned(slot), 0);
    ck_assert_int_eq(m[2 * page], 0x5a);
    ck_assert_int_eq(ftruncate(fd, page), 0);
    ck_assert_int_eq(m[0], 0x5a);            /* still in the file */
    ck_assert_int_eq(m[2 * page + 7], 0);    /* past the end: SIGBUS, patched */
    ck_assert_int_eq(qm_sigbus_poisoned(slot), 1);
    qm_sigbus_unregister(slot);
    munmap((void *)m, (size_t)page * 3);
    close(fd);
}
END_TEST

/* ---- the start-up line about a guest that halts idle vCPUs ---- */

static void idle_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert_msg(f != NULL, "cannot write %s", path);
    fputs(text, f);
    fclose(f);
}

START_TEST(test_idle_hint_only_for_haltpoll_that_never_polls)
{
    char dir[] = "/tmp/qm-idle-XXXXXX", drv[64], poll[64], msg[512];
    ck_assert(mkdtemp(dir) != NULL);
    snprintf(drv, sizeof drv, "%s/driver", dir);
    snprintf(poll, sizeof poll, "%s/poll", dir);
    /* The machines measured: haltpoll, polling 0. */
    idle_file(drv, "haltpoll\n");
    idle_file(poll, "0\n");
    msg[0] = '\0';
    ck_assert_int_eq(qm_idle_hint(drv, poll, msg, sizeof msg), 1);
    ck_assert_msg(strstr(msg, "halts an idle vCPU at once") && strstr(msg, poll) &&
                      strstr(msg, "On a virtual machine"),
                  "%s", msg);
    /* The guest polls before it halts: nothing to say. */
    idle_file(poll, "200000\n");
    ck_assert_int_eq(qm_idle_hint(drv, poll, msg, sizeof msg), 0);
    /* Not a number, or empty: nothing said rather than a guess. */
    idle_file(poll, "0x\n");
    ck_assert_int_eq(qm_idle_hint(drv, poll, msg, sizeof msg), 0);
    idle_file(poll, "");
    ck_assert_int_eq(qm_idle_hint(drv, poll, msg, sizeof msg), 0);
    /* Another idle driver (bare metal, or a guest without haltpoll). */
    idle_file(poll, "0\n");
    idle_file(drv, "intel_idle\n");
    ck_assert_int_eq(qm_idle_hint(drv, poll, msg, sizeof msg), 0);
    /* Files missing (no cpuidle, no haltpoll module). */
    idle_file(drv, "haltpoll\n");
    unlink(poll);
    ck_assert_int_eq(qm_idle_hint(drv, poll, msg, sizeof msg), 0);
    unlink(drv);
    ck_assert_int_eq(qm_idle_hint(drv, poll, msg, sizeof msg), 0);
    ck_assert_int_eq(rmdir(dir), 0);
}
END_TEST

/* ---- the compute pool at exit ---- */

static struct {
    int ran, done, discarded, discarded_ran;
    sem_t release; /* blocking_run waits on it */
    sem_t started;
} pool_t;

static void counting_run(qm_job *job)
{
    (void)job;
    __atomic_fetch_add(&pool_t.ran, 1, __ATOMIC_SEQ_CST);
}

static void blocking_run(qm_job *job)
{
    counting_run(job);
    sem_post(&pool_t.started);
    while (sem_wait(&pool_t.release) != 0)
        ;
}

static void no_finish(qm_job *job) { (void)job; }

static const qm_job_ops counting_ops = {.run = counting_run, .finish = no_finish};
static const qm_job_ops blocking_ops = {.run = blocking_run, .finish = no_finish};

static void pool_t_done(void *arg, qm_job *job)
{
    (void)arg;
    pool_t.done++;
    qm_job_free(job);
}

static void pool_t_discard(void *arg, qm_job *job)
{
    (void)arg;
    pool_t.discarded++;
    pool_t.discarded_ran += job->end_us != 0;
    qm_job_free(job);
}

static qm_job *pool_t_job(const qm_job_ops *ops, qm_job_queue *q)
{
    qm_job *job = qm_calloc(1, sizeof *job);
    ck_assert_ptr_nonnull(job);
    job->ops = ops;
    job->queue = q;
    job->fds = QM_FDS_NONE;
    return job;
}

static void pool_t_close_walk(uv_handle_t *h, void *arg)
{
    (void)arg;
    if (!uv_is_closing(h))
        uv_close(h, NULL);
}

static void *release_later(void *arg)
{
    (void)arg;
    usleep(100 * 1000);
    sem_post(&pool_t.release);
    return NULL;
}

/* A ring's call run on its thread as the loop stops (done, never taken)
 * and a session's job queued behind a running one when the workers stop
 * (never run): both reach the discard hook, so their session references
 * and memory are given back (the leak CI's LeakSanitizer found). */
START_TEST(test_pool_stop_discards_the_jobs_the_loop_never_took)
{
    memset(&pool_t, 0, sizeof pool_t);
    ck_assert_int_eq(sem_init(&pool_t.release, 0, 0), 0);
    ck_assert_int_eq(sem_init(&pool_t.started, 0, 0), 0);
    uv_loop_t loop;
    ck_assert_int_eq(uv_loop_init(&loop), 0);
    qm_pool_hooks hooks = {.done = pool_t_done, .discard = pool_t_discard};
    qm_pool *p;
    ck_assert_int_eq(qm_pool_start(&loop, 1, &hooks, &p), 0);
    qm_job_queue ring_q = {0}, session_q = {0};

    /* Run at once on this thread, lazily: the loop is not told. */
    ck_assert_int_eq(qm_pool_run_or_queue(p, pool_t_job(&counting_ops, &ring_q)), 1);
    ck_assert_int_eq(pool_t.ran, 1);
    /* A worker holds the session with a job that blocks; one waits. */
    ck_assert_int_eq(qm_pool_submit(p, pool_t_job(&blocking_ops, &session_q), 8), 0);
    ck_assert_int_eq(qm_pool_submit(p, pool_t_job(&counting_ops, &session_q), 8), 0);
    while (sem_wait(&pool_t.started) != 0)
        ;
    ck_assert_uint_eq(qm_pool_queued(p), 3);
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, release_later, NULL), 0);
    /* The loop never runs again: the daemon's order at exit. */
    qm_pool_stop(p);
    pthread_join(t, NULL);

    ck_assert_int_eq(pool_t.done, 0);
    ck_assert_int_eq(pool_t.ran, 2); /* the queued job never ran */
    ck_assert_int_eq(pool_t.discarded, 3);
    ck_assert_int_eq(pool_t.discarded_ran, 2);
    ck_assert_uint_eq(atomic_load(&ring_q.pending), 0);
    ck_assert_uint_eq(atomic_load(&session_q.pending), 0);
    /* Its handles go with the loop (the daemon closes them with the rest). */
    uv_walk(&loop, pool_t_close_walk, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    ck_assert_int_eq(uv_loop_close(&loop), 0);
    sem_destroy(&pool_t.release);
    sem_destroy(&pool_t.started);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("daemon");
    TCase *tc = tcase_create("telemetry");
    tcase_add_test(tc, test_hist_quantiles_are_bucket_upper_bounds_within_25_percent);
    tcase_add_test(tc, test_trace_ring_keeps_the_newest_spans);
    tcase_add_test(tc, test_paging_counters_sum_the_growth_of_their_pager_statistics);
    suite_add_tcase(s, tc);
    tc = tcase_create("config");
    tcase_add_test(tc, test_flags_override_the_config_file);
    tcase_add_test(tc, test_config_rejects_unknown_keys_and_bad_values);
    tcase_add_test(tc, test_backend_and_device_kinds_come_from_the_registry);
    tcase_add_test(tc, test_the_wires_enums_are_the_registries);
    tcase_add_test(tc, test_device_lists_and_budgets_per_device);
    tcase_add_test(tc, test_reload_changes_only_reloadable_keys);
    tcase_add_test(tc, test_reload_is_a_fresh_parse_all_or_nothing_with_flags_over_the_file);
    tcase_add_test(tc, test_orphan_timeout_is_a_reloadable_key_with_a_flag);
    suite_add_tcase(s, tc);
    tc = tcase_create("reclaim");
    tcase_add_test(tc, test_orphan_mark_needs_every_toucher_gone_and_nothing_queued);
    tcase_add_test(tc, test_a_touch_lost_to_out_of_memory_never_orphans);
    suite_add_tcase(s, tc);

    tc = tcase_create("systemd");
    tcase_add_test(tc, test_notify_sends_one_datagram_and_is_silent_without_socket);
    tcase_add_test(tc, test_socket_activation_and_watchdog_need_our_pid);
    suite_add_tcase(s, tc);
    tc = tcase_create("idle");
    tcase_add_test(tc, test_idle_hint_only_for_haltpoll_that_never_polls);
    suite_add_tcase(s, tc);
    tc = tcase_create("pool");
    tcase_add_test(tc, test_pool_stop_discards_the_jobs_the_loop_never_took);
    suite_add_tcase(s, tc);
    tc = tcase_create("sigbus");
    tcase_add_test(tc, test_sigbus_in_a_truncated_bank_mapping_reads_zeros_and_poisons);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
