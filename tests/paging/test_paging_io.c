/* test_paging_io.c - the disk source's I/O engine (engine/pager/qm_pager_io.c):
 * every miss of a call in flight at once (counted), with outputs bitwise
 * those of one read at a time and of whole_bank; io_uring and the pool of
 * preadv threads (forced) both; demand reads issued before prefetches, and
 * a demand for a unit whose prefetch is in flight waits for that read, and
 * one that must evict such a unit waits for its read as a counted stall; a
 * failed or short read among many fails only the call that needed it,
 * naming the file and the offset, the others land, and the next call reads
 * that expert again; an expert in use is never evicted while prefetches
 * run; whole banks at creation read with many reads in flight; prefetch
 * reads only on an idle disk, two at most; a prefetch the call of its
 * layer did not ask for parked (nothing more read), read on from there
 * when a call asks for it, given back unread when evicted, and the first
 * victim when a slot must be given back.
 *
 * A bank file on a filesystem that takes O_DIRECT is needed (see
 * paging_disk_fixture.h); without one the checks are skipped with a note.
 * Where the kernel refuses io_uring the auto engine runs the pool, which
 * the tests accept after printing why. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "paging_disk_fixture.h"
#include "qm_pager_io.h"

/* The engines a pager can be asked for that read in parallel. */
static const int ENGINES[] = {QM_PAGER_IO_AUTO, QM_PAGER_IO_THREADS};
#define N_ENGINES 2

/* The engine a pager runs is the one asked for (auto: io_uring, or the
 * pool with the kernel's reason printed). */
static void check_engine(qm_pager *pg, int asked, uint32_t want_depth)
{
    uint32_t depth = 0;
    const char *why = NULL;
    int kind = qm_pager_io_info(pg, &depth, &why);
    if (asked == QM_PAGER_IO_THREADS) {
        ck_assert_int_eq(kind, QM_PAGER_IO_THREADS);
    } else if (kind != QM_PAGER_IO_URING) {
        ck_assert_int_eq(kind, QM_PAGER_IO_THREADS);
        ck_assert_msg(*why, "the pool ran without saying why io_uring did not");
        fprintf(stderr, "test_paging_io: io_uring refused here (%s): the pool ran\n", why);
    } else {
        ck_assert_msg(*why == '\0', "io_uring runs, yet: %s", why);
    }
    if (want_depth)
        ck_assert_uint_eq(depth, want_depth);
}

/* Present expert tensors of a layer: the regions (reads) of one unit. */
static uint32_t regions_per_unit(uint32_t layer)
{
    const qm_layer_view *lv = qm_bank_layer(fixture.bank.bank, layer);
    uint32_t n = 0;
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++)
        n += lv->t[t].present && lv->t[t].nbytes > 0;
    return n;
}

/* A hook that holds every read `g_sleep_us` (the pool's run on its own
 * threads: they stay in flight meanwhile) and fails read number g_fail_at. */
static int g_fail_at, g_reads, g_sleep_us;
static int slow_read(void *ud, uint64_t off, uint64_t len)
{
    (void)ud;
    (void)off;
    (void)len;
    int n = __atomic_add_fetch(&g_reads, 1, __ATOMIC_SEQ_CST);
    if (g_sleep_us)
        usleep((useconds_t)g_sleep_us);
    return n == g_fail_at ? EIO : 0;
}

static void hook_reset(int fail_at, int sleep_us)
{
    g_reads = 0;
    g_fail_at = fail_at;
    g_sleep_us = sleep_us;
}

/* T = 4 tokens of `layer` routed over all of its 8 experts (2t, 2t+1),
 * and the whole-bank output (a bank that can give it). */
typedef struct wide_call {
    float x[4 * 64], logits[4 * 8], ref[4 * 64], out[4 * 64];
    qm_moe_call mc;
} wide_call;

static void wide_call_make(wide_call *w, qm_bank *bank, uint32_t layer)
{
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    ck_assert_uint_le(cfg->hidden, 64);
    ck_assert_uint_eq(cfg->experts, 8);
    uint64_t s = 5;
    for (uint32_t i = 0; i < 4 * cfg->hidden; i++)
        w->x[i] = pf_uniform(&s, -1, 1);
    for (uint32_t t = 0; t < 4; t++) {
        uint32_t ex[2] = {2 * t, 2 * t + 1};
        pf_route_logits(cfg->experts, ex, 2, w->logits + t * cfg->experts);
    }
    qm_expert_source direct;
    qm_expert_source_direct(bank, &direct);
    w->mc = (qm_moe_call){.layer = layer, .dtype = QM_DTYPE_F32, .hidden = w->x, .n_tokens = 4,
                          .logits = w->logits, .output = w->ref};
    qm_status st = {0};
    ck_assert_int_eq(qm_moe_forward(fixture.cpu, bank, &w->mc, &direct, NULL, &st), 0);
    w->mc.output = w->out;
}

static int wide_call_run(wide_call *w, qm_pager *pg, qm_moe_stats *ms, qm_status *st)
{
    memset(w->out, 0x7f, sizeof w->out);
    return qm_pager_forward(pg, &w->mc, ms, st);
}

static int wide_call_same(const wide_call *w, qm_bank *bank)
{
    size_t n = sizeof(float) * 4 * qm_bank_get_config(bank)->hidden;
    return memcmp(w->out, w->ref, n) == 0;
}

/* A pager over the whole model (a slot for every expert, nothing
 * preloaded: every first access misses), no prefetch. */
static qm_pager *room_for_all(qm_bank *bank, int engine, uint32_t depth, qm_policy *pol,
                              qm_residency_plan **plan)
{
    uint64_t total = qm_bank_expert_bytes_total(bank);
    qm_pager_options o = {.io_engine = engine, .io_depth = depth, .no_preload = 1};
    return direct_pager_opt(bank, "lru", total, &o, NULL, pol, plan);
}

START_TEST(test_a_call_missing_every_expert_has_their_reads_in_flight_together)
{
    if (!g_have_direct)
        return;
    dcase dc;
    dcase_open(&dc, g_dir, "wide", 0, 0);
    wide_call w;
    wide_call_make(&w, dc.bank, 1);
    const uint32_t R = regions_per_unit(1), depth = 32;
    ck_assert_uint_ge(R, 2);
    const int engines[] = {QM_PAGER_IO_AUTO, QM_PAGER_IO_THREADS, QM_PAGER_IO_SERIAL};
    for (int ei = 0; ei < 3; ei++) {
        for (int d1 = 0; d1 < 2; d1++) {
            qm_policy pol = {0};
            qm_residency_plan *plan = NULL;
            qm_pager *pg = room_for_all(dc.bank, engines[ei], d1 ? 1 : depth, &pol, &plan);
            if (engines[ei] != QM_PAGER_IO_SERIAL)
                check_engine(pg, engines[ei], d1 ? 1 : depth);
            /* The pool's reads wait in its threads: every one in flight. */
            hook_reset(0, engines[ei] == QM_PAGER_IO_THREADS ? 3000 : 0);
            qm_pager_set_read_hook(pg, slow_read, NULL);
            qm_moe_stats ms = {0};
            qm_status st = {0};
            ck_assert_msg(wide_call_run(&w, pg, &ms, &st) == 0, "%s", st.msg);
            ck_assert_msg(wide_call_same(&w, dc.bank), "engine %d depth %u: output differs",
                          engines[ei], d1 ? 1 : depth);
            qm_pager_stats s;
            qm_pager_stats_get(pg, &s);
            ck_assert_uint_eq(s.misses, 8);
            ck_assert_uint_eq(ms.waves, 1);
            ck_assert_uint_ge(ms.batches, 1);
            ck_assert_uint_eq(s.read_calls, 1);
            ck_assert_uint_eq(s.reads_in_flight_sum, s.reads_in_flight_peak);
            if (engines[ei] == QM_PAGER_IO_SERIAL || d1) {
                ck_assert_uint_eq(s.reads_in_flight_peak, 1);
            } else if (engines[ei] == QM_PAGER_IO_THREADS) {
                /* 8 units of R regions: all of them at once, up to the depth. */
                uint32_t want = 8 * R < depth ? 8 * R : depth;
                ck_assert_msg(s.reads_in_flight_peak == want, "%llu reads in flight, want %u",
                              (unsigned long long)s.reads_in_flight_peak, want);
            } else {
                /* io_uring: at least one unit's regions go out together. */
                ck_assert_uint_ge(s.reads_in_flight_peak, R);
            }
            ck_assert_uint_gt(s.disk_busy_us, 0);
            free_pager(pg, plan, &pol);
        }
    }
    dcase_close(&dc);
}
END_TEST

START_TEST(test_every_engine_and_depth_gives_whole_bank_bits)
{
    if (!g_have_direct)
        return;
    const pf_spec *sp = &fixture.spec;
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    dcase dc;
    dcase_open(&dc, g_dir, "bits", 24, 71);
    uint64_t U = unit_bytes(&fixture.bank), total = (uint64_t)sp->layers * sp->experts * U;
    const uint64_t budgets[] = {U, sp->k * U, total / 2};
    const char *policies[] = {"lru", "next_use", "static_hot"};
    const uint32_t depths[] = {1, 3, 32};
    for (int ei = 0; ei < N_ENGINES; ei++)
        for (int di = 0; di < 3; di++)
            for (int pi = 0; pi < 3; pi++)
                for (int bi = 0; bi < 3; bi++)
                    for (int pf = 0; pf < 2; pf++) {
                        qm_policy pol = {0};
                        qm_residency_plan *plan = NULL;
                        qm_pager_options o = {.prefetch = pf, .io_engine = ENGINES[ei],
                                              .io_depth = depths[di]};
                        qm_pager *pg = direct_pager_opt(dc.bank, policies[pi], budgets[bi], &o,
                                                        &dc.set, &pol, &plan);
                        check_engine(pg, ENGINES[ei], depths[di]);
                        qm_status st = {0};
                        for (size_t i = 0; i < dc.set.n; i++) {
                            const pg_call *c = &dc.set.calls[i];
                            ck_assert_msg(run_call(pg, c, dc.out, &st) == 0, "%s", st.msg);
                            ck_assert_msg(
                                memcmp(dc.out, c->ref, sizeof(float) * c->T * cfg->hidden) == 0,
                                "engine %d depth %u %s budget %llu prefetch %d: call %zu "
                                "differs",
                                ENGINES[ei], depths[di], policies[pi],
                                (unsigned long long)budgets[bi], pf, i);
                        }
                        qm_pager_stats s;
                        qm_pager_stats_get(pg, &s);
                        ck_assert_uint_eq(s.disk_errors, 0);
                        ck_assert_uint_le(s.resident_bytes, budgets[bi]);
                        ck_assert_uint_le(s.reads_in_flight_peak, depths[di]);
                        ck_assert_uint_ge(s.disk_bytes_read,
                                          s.bytes_paged_h2d + s.bytes_loaded_at_create);
                        free_pager(pg, plan, &pol);
                    }
    dcase_close(&dc);
}
END_TEST

START_TEST(test_a_failed_read_among_many_fails_only_its_call_and_is_read_again)
{
    if (!g_have_direct)
        return;
    dcase dc;
    dcase_open(&dc, g_dir, "fail", 0, 0);
    wide_call w;
    wide_call_make(&w, dc.bank, 1);
    const uint32_t R = regions_per_unit(1);
    const int fail_at[] = {1, (int)R + 1, (int)(4 * R), (int)(8 * R)};
    for (int ei = 0; ei < N_ENGINES; ei++)
        for (int fi = 0; fi < 4; fi++) {
            qm_policy pol = {0};
            qm_residency_plan *plan = NULL;
            qm_pager *pg = room_for_all(dc.bank, ENGINES[ei], 32, &pol, &plan);
            hook_reset(fail_at[fi], ENGINES[ei] == QM_PAGER_IO_THREADS ? 1000 : 0);
            qm_pager_set_read_hook(pg, slow_read, NULL);
            qm_moe_stats ms = {0};
            qm_status st = {0};
            /* The call fails, naming the file and the offset of the read... */
            ck_assert_int_eq(wide_call_run(&w, pg, &ms, &st), QM_EIO);
            ck_assert_msg(strstr(st.msg, "Input/output error") && strstr(st.msg, dc.path) &&
                              strstr(st.msg, "at offset"),
                          "%s", st.msg);
            /* ... the other seven experts landed and stay resident ... */
            uint32_t res[8];
            ck_assert_int_eq(qm_pager_resident_experts(pg, 1, res, 8), 7);
            qm_pager_stats s0, s1;
            qm_pager_stats_get(pg, &s0);
            ck_assert_uint_eq(s0.disk_errors, 1);
            /* ... and the same call again reads the eighth, and only it. */
            ck_assert_msg(wide_call_run(&w, pg, &ms, &st) == 0, "retry: %s", st.msg);
            ck_assert(wide_call_same(&w, dc.bank));
            qm_pager_stats_get(pg, &s1);
            ck_assert_uint_eq(s1.misses - s0.misses, 1);
            ck_assert_uint_eq(s1.hits - s0.hits, 7);
            ck_assert_uint_eq(s1.disk_errors, 1);
            ck_assert_uint_eq(s1.disk_reads - s0.disk_reads, R);
            free_pager(pg, plan, &pol);
        }
    dcase_close(&dc);
}
END_TEST

START_TEST(test_a_short_read_among_many_fails_only_its_call)
{
    if (!g_have_direct)
        return;
    const pf_spec *sp = &fixture.spec;
    for (int ei = 0; ei < N_ENGINES; ei++) {
        dcase dc;
        dcase_open(&dc, g_dir, "short", 0, 0);
        qm_policy pol = {0};
        qm_residency_plan *plan = NULL;
        qm_pager *pg = room_for_all(dc.bank, ENGINES[ei], 32, &pol, &plan);
        /* Cut the file in the middle of the last layer's last expert tensor
         * in the file: the experts before the cut read whole, the others
         * come back short. */
        const qm_layer_view *last = qm_bank_layer(dc.bank, sp->layers - 1);
        uint64_t map_bytes;
        const uint8_t *map = qm_bank_mapping(dc.bank, &map_bytes);
        const qm_tensor_view *end = NULL;
        for (int t = 0; t < QM_T_EXPERT_COUNT; t++)
            if (last->t[t].present && (!end || last->t[t].data > end->data))
                end = &last->t[t];
        uint64_t cut = (uint64_t)((const uint8_t *)end->data - map) + end->nbytes / 2;
        ck_assert_int_eq(truncate(dc.path, (off_t)cut), 0);
        wide_call w; /* its reference from the bank in memory: the file is cut */
        wide_call_make(&w, fixture.bank.bank, sp->layers - 1);
        qm_status st = {0};
        ck_assert_int_eq(wide_call_run(&w, pg, NULL, &st), QM_EIO);
        ck_assert_msg(strstr(st.msg, "truncated") && strstr(st.msg, dc.path) &&
                          strstr(st.msg, "at offset"),
                      "%s", st.msg);
        qm_pager_stats s;
        qm_pager_stats_get(pg, &s);
        ck_assert_uint_ge(s.disk_errors, 1);
        uint32_t res[8];
        int n = qm_pager_resident_experts(pg, sp->layers - 1, res, 8);
        ck_assert_msg(n >= 1 && n < 8, "%d experts resident after the short reads", n);
        /* Layer 0 lies before the cut: served. */
        w.mc.layer = 0;
        ck_assert_msg(wide_call_run(&w, pg, NULL, &st) == 0, "%s", st.msg);
        free_pager(pg, plan, &pol);
        dcase_close(&dc);
    }
}
END_TEST

/* Experts held by a call (some handed out, some still being read) keep
 * their slots and their bytes while prefetches for other experts run. */
START_TEST(test_an_expert_in_use_is_never_evicted_under_concurrent_prefetch)
{
    if (!g_have_direct)
        return;
    dcase dc;
    dcase_open(&dc, g_dir, "inuse", 0, 0);
    const qm_layer_view *lv = qm_bank_layer(dc.bank, 1);
    const uint64_t slice = qm_expert_slice_bytes(&lv->t[QM_T_FC1_WEIGHT], fixture.spec.experts);
    const uint64_t U = unit_bytes(&fixture.bank);
    for (int ei = 0; ei < N_ENGINES; ei++) {
        qm_policy pol = {0};
        qm_residency_plan *plan = NULL;
        qm_pager_options o = {.io_engine = ENGINES[ei], .no_preload = 1};
        qm_pager *pg = direct_pager_opt(dc.bank, "lru", 6 * U, &o, NULL, &pol, &plan);
        hook_reset(0, ENGINES[ei] == QM_PAGER_IO_THREADS ? 2000 : 0);
        qm_pager_set_read_hook(pg, slow_read, NULL);
        qm_expert_source *src = qm_pager_source(pg);
        uint32_t left[4] = {0, 1, 2, 3}, got[4];
        size_t n_left = 4, n_got = 0, idx[4];
        qm_expert_weights wts[4], held[4];
        qm_status st = {0};
        ck_assert(src->acquire_some != NULL);
        while (n_left) {
            size_t ready = 0;
            ck_assert_int_ge(src->acquire_some(src->ctx, 1, left, n_left, idx, wts, &ready, &st),
                             0);
            ck_assert_uint_ge(ready, 1);
            for (size_t i = 0; i < ready; i++) {
                got[n_got] = left[idx[i]];
                held[n_got++] = wts[i];
                left[idx[i]] = UINT32_MAX;
            }
            size_t k = 0;
            for (size_t i = 0; i < n_left; i++)
                if (left[i] != UINT32_MAX)
                    left[k++] = left[i];
            n_left = k;
            /* Between hand-outs, while reads are in flight: prefetch the
             * other experts of the layer and another layer's, more than
             * the two free slots hold. */
            const uint32_t others[4] = {4, 5, 6, 7}, all[8] = {0, 1, 2, 3, 4, 5, 6, 7};
            ck_assert_int_ge(qm_pager_prefetch(pg, 1, others, 4, &st), 0);
            ck_assert_int_ge(qm_pager_prefetch(pg, 2, all, 8, &st), 0);
        }
        uint32_t res[8];
        int n = qm_pager_resident_experts(pg, 1, res, 8);
        for (uint32_t e = 0; e < 4; e++) {
            int found = 0;
            for (int i = 0; i < n; i++)
                found |= res[i] == e;
            ck_assert_msg(found, "held expert %u was evicted", e);
        }
        ck_assert_int_eq(qm_pager_sync(pg, &st), 0);
        for (size_t i = 0; i < n_got; i++)
            ck_assert_msg(memcmp(held[i].ptr[QM_T_FC1_WEIGHT],
                                 (const uint8_t *)lv->t[QM_T_FC1_WEIGHT].data + got[i] * slice,
                                 slice) == 0,
                          "held expert %u was overwritten", got[i]);
        src->release(src->ctx, 1, got, n_got);
        qm_pager_stats s;
        qm_pager_stats_get(pg, &s);
        ck_assert_uint_gt(s.prefetch_issued, 0);
        ck_assert_uint_le(s.resident_bytes, 6 * U);
        free_pager(pg, plan, &pol);
    }
    dcase_close(&dc);
}
END_TEST

/* A call that needs a unit whose prefetch is still being read waits for
 * that read: the unit is read once. */
START_TEST(test_a_demand_for_a_unit_in_flight_waits_for_its_prefetch)
{
    if (!g_have_direct)
        return;
    dcase dc;
    dcase_open(&dc, g_dir, "once", 0, 0);
    const uint32_t R = regions_per_unit(1);
    for (int ei = 0; ei < N_ENGINES; ei++) {
        qm_policy pol = {0};
        qm_residency_plan *plan = NULL;
        qm_pager *pg = room_for_all(dc.bank, ENGINES[ei], 4, &pol, &plan);
        hook_reset(0, 20000); /* the pool's prefetch is still in flight when the call comes */
        qm_pager_set_read_hook(pg, slow_read, NULL);
        uint32_t e = 3;
        qm_status st = {0};
        ck_assert_int_eq(qm_pager_prefetch(pg, 1, &e, 1, &st), 1);
        uint64_t seed = 1;
        call_experts(pg, &fixture.bank, 1, &e, 1, &seed);
        qm_pager_stats s;
        qm_pager_stats_get(pg, &s);
        ck_assert_uint_eq(s.hits, 1);
        ck_assert_uint_eq(s.misses, 0);
        ck_assert_uint_eq(s.prefetch_useful, 1);
        ck_assert_uint_eq(s.disk_reads, R);
        free_pager(pg, plan, &pol);
    }
    dcase_close(&dc);
}
END_TEST

/* A call whose miss can only take the slot of a prefetch still being
 * read waits for that read (a copy never lands in a slot handed out):
 * the wait is the call's stall and is counted as one. The pool of
 * threads, whose hook holds a read in flight on its worker. */
START_TEST(test_waiting_for_a_prefetch_in_flight_to_evict_it_counts_as_stall)
{
    if (!g_have_direct)
        return;
    dcase dc;
    dcase_open(&dc, g_dir, "evictwait", 0, 0);
    const uint64_t U = unit_bytes(&fixture.bank);
    qm_policy pol = {0};
    qm_residency_plan *plan = NULL;
    qm_pager_options o = {.io_engine = QM_PAGER_IO_THREADS, .io_depth = 1, .no_preload = 1};
    qm_pager *pg = direct_pager_opt(dc.bank, "lru", U, &o, NULL, &pol, &plan);
    hook_reset(0, 60000);
    qm_pager_set_read_hook(pg, slow_read, NULL);
    uint32_t e = 3, other = 5;
    qm_status st = {0};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ck_assert_int_eq(qm_pager_prefetch(pg, 1, &e, 1, &st), 1);
    while (__atomic_load_n(&g_reads, __ATOMIC_SEQ_CST) < 1) /* its first read is in the hook */
        usleep(100);
    g_sleep_us = 0; /* the rest, and the demand's own reads, are quick */
    uint64_t seed = 1;
    call_experts(pg, &fixture.bank, 1, &other, 1, &seed);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double waited_us = (t1.tv_sec - t0.tv_sec) * 1e6 + (t1.tv_nsec - t0.tv_nsec) / 1e3;
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.misses, 1);
    ck_assert_uint_eq(s.evictions, 1);
    ck_assert_uint_eq(s.prefetch_useful, 0);
    /* The prefetch's first read slept 60 ms; the call began right after
     * issuing it, so most of that was the call's wait. */
    ck_assert_msg(waited_us >= 50000, "the call did not wait for the read in flight (%.0f us)",
                  waited_us);
    ck_assert_msg(s.stall_us >= 40000, "stall_us %llu after a %.0f us wait for the victim's read",
                  (unsigned long long)s.stall_us, waited_us);
    free_pager(pg, plan, &pol);
    dcase_close(&dc);
}
END_TEST

START_TEST(test_whole_banks_at_creation_are_read_with_many_reads_in_flight)
{
    if (!g_have_direct)
        return;
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    dcase dc;
    dcase_open(&dc, g_dir, "whole", 12, 83);
    const uint32_t R = regions_per_unit(0);
    for (int ei = 0; ei < N_ENGINES; ei++) {
        qm_policy pol = {0};
        qm_residency_plan *plan = NULL;
        hook_reset(0, 0);
        qm_pager_options o = {.io_engine = ENGINES[ei], .io_depth = 32};
        qm_pager *pg = direct_pager_opt(dc.bank, "whole_bank", qm_bank_expert_bytes_total(dc.bank),
                                        &o, &dc.set, &pol, &plan);
        qm_pager_stats s;
        qm_pager_stats_get(pg, &s);
        ck_assert_uint_eq(s.bytes_loaded_at_create, qm_bank_expert_bytes_total(dc.bank));
        /* Every layer's tensors were issued before the first was waited. */
        ck_assert_uint_ge(s.reads_in_flight_peak, R);
        ck_assert_uint_ge(s.disk_bytes_read, s.bytes_loaded_at_create);
        qm_status st = {0};
        for (size_t i = 0; i < dc.set.n; i++) {
            const pg_call *c = &dc.set.calls[i];
            ck_assert_msg(run_call(pg, c, dc.out, &st) == 0, "%s", st.msg);
            ck_assert(memcmp(dc.out, c->ref, sizeof(float) * c->T * cfg->hidden) == 0);
        }
        free_pager(pg, plan, &pol);
    }
    dcase_close(&dc);
}
END_TEST

/* ---- The engine itself: demand before prefetch ------------------------------------------ */

#define ORDER_MAX 32
static int g_order[ORDER_MAX], g_n_order;
static int record_read(void *ud, uint64_t off, uint64_t len)
{
    (void)ud;
    (void)len;
    int i = __atomic_fetch_add(&g_n_order, 1, __ATOMIC_SEQ_CST);
    if (i < ORDER_MAX)
        g_order[i] = (int)(off / QM__IO_ALIGN);
    usleep(10000); /* each read takes a while: the queue builds up */
    return 0;
}

static int position(int block)
{
    for (int i = 0; i < g_n_order && i < ORDER_MAX; i++)
        if (g_order[i] == block)
            return i;
    return -1;
}

START_TEST(test_the_engine_issues_demand_reads_before_queued_prefetches)
{
    if (!g_have_direct)
        return;
    /* A file of 8 blocks, block i filled with i. */
    char path[600];
    snprintf(path, sizeof path, "%s/qm_io_order_XXXXXX", g_dir);
    int wfd = mkstemp(path);
    ck_assert_int_ge(wfd, 0);
    static uint8_t blocks[8 * QM__IO_ALIGN];
    for (int i = 0; i < 8; i++)
        memset(blocks + i * QM__IO_ALIGN, i, QM__IO_ALIGN);
    ck_assert_int_eq(write(wfd, blocks, sizeof blocks), (ssize_t)sizeof blocks);
    close(wfd);
    int fd = open(path, O_RDONLY | O_DIRECT);
    ck_assert_int_ge(fd, 0);
    uint8_t *raw = malloc(8 * QM__IO_ALIGN + QM__IO_ALIGN);
    uint8_t *buf = (uint8_t *)(((uintptr_t)raw + QM__IO_ALIGN - 1) & ~(uintptr_t)(QM__IO_ALIGN - 1));
    qm__io *io = NULL;
    char why[256];
    qm_status st = {0};
    /* The pool: its hook runs on the reading thread, so reads queue up
     * behind the two in flight. Depth 2: prefetches may hold one. */
    ck_assert_int_eq(qm__io_new(fd, QM_PAGER_IO_THREADS, 2, &io, why, sizeof why, &st), 0);
    g_n_order = 0;
    qm__io_set_hook(io, record_read, NULL);
    qm__io_req req[8];
    memset(req, 0, sizeof req);
    for (int i = 0; i < 8; i++)
        req[i] = (qm__io_req){.n_reg = 1,
                              .reg = {{buf + i * QM__IO_ALIGN, (uint64_t)i * QM__IO_ALIGN,
                                       QM__IO_ALIGN, QM__IO_ALIGN}}};
    /* Blocks 0..4 prefetched, then 5 and 6 on demand, then 4 promoted. */
    for (int i = 0; i < 5; i++)
        qm__io_submit(io, &req[i], QM__IO_PREFETCH);
    qm__io_submit(io, &req[5], QM__IO_DEMAND);
    qm__io_submit(io, &req[6], QM__IO_DEMAND);
    qm__io_promote(io, &req[4]);
    for (int i = 0; i < 7; i++)
        qm__io_wait(io, &req[i]);
    qm__io_stats s;
    qm__io_stats_get(io, &s, 0);
    qm__io_free(io);
    /* Prefetch 0 went out alone; the demands, then the promoted prefetch,
     * passed prefetches 1..3 that were queued before them. */
    ck_assert_int_eq(g_n_order, 7);
    ck_assert_int_eq(position(0), 0);
    ck_assert_msg(position(5) < position(1) && position(6) < position(1) &&
                      position(4) < position(1),
                  "order %d %d %d %d %d %d %d", g_order[0], g_order[1], g_order[2], g_order[3],
                  g_order[4], g_order[5], g_order[6]);
    ck_assert_uint_eq(s.reads, 7);
    ck_assert_uint_le(s.peak, 2);
    for (int i = 0; i < 7; i++) {
        ck_assert(req[i].done && !req[i].err && !req[i].truncated);
        ck_assert_uint_eq(buf[i * QM__IO_ALIGN + 17], (uint8_t)i);
    }
    free(raw);
    close(fd);
    unlink(path);
}
END_TEST

/* ---- The engine itself: prefetch only on an idle disk, parked prefetches ---------------- */

static uint64_t g_start_us[8];
static int timed_read(void *ud, uint64_t off, uint64_t len)
{
    (void)ud;
    (void)len;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    uint64_t b = off / QM__IO_ALIGN;
    if (b < 8)
        g_start_us[b] = (uint64_t)t.tv_sec * 1000000u + (uint64_t)t.tv_nsec / 1000u;
    __atomic_add_fetch(&g_n_order, 1, __ATOMIC_SEQ_CST);
    usleep(20000);
    return 0;
}

/* A file of 8 blocks, block i filled with i, opened O_DIRECT; the aligned
 * buffer its blocks are read into. */
typedef struct eight_blocks {
    char path[600];
    int fd;
    uint8_t *raw, *buf;
} eight_blocks;

static void eight_blocks_open(eight_blocks *e)
{
    snprintf(e->path, sizeof e->path, "%s/qm_io_eight_XXXXXX", g_dir);
    int wfd = mkstemp(e->path);
    ck_assert_int_ge(wfd, 0);
    static uint8_t blocks[8 * QM__IO_ALIGN];
    for (int i = 0; i < 8; i++)
        memset(blocks + i * QM__IO_ALIGN, i, QM__IO_ALIGN);
    ck_assert_int_eq(write(wfd, blocks, sizeof blocks), (ssize_t)sizeof blocks);
    close(wfd);
    e->fd = open(e->path, O_RDONLY | O_DIRECT);
    ck_assert_int_ge(e->fd, 0);
    e->raw = calloc(1, 9 * QM__IO_ALIGN);
    e->buf = (uint8_t *)(((uintptr_t)e->raw + QM__IO_ALIGN - 1) & ~(uintptr_t)(QM__IO_ALIGN - 1));
}

static void eight_blocks_close(eight_blocks *e)
{
    free(e->raw);
    close(e->fd);
    unlink(e->path);
}

static qm__io_region block_region(const eight_blocks *e, int i)
{
    return (qm__io_region){e->buf + i * QM__IO_ALIGN, (uint64_t)i * QM__IO_ALIGN, QM__IO_ALIGN,
                           QM__IO_ALIGN};
}

/* An engine of `depth` reading e's file, every read stamped and held
 * 20 ms (timed_read), the buffer cleared. */
static qm__io *timed_engine(eight_blocks *e, int engine, uint32_t depth)
{
    memset(e->buf, 0xee, 8 * QM__IO_ALIGN);
    qm__io *io = NULL;
    char why[256];
    qm_status st = {0};
    ck_assert_int_eq(qm__io_new(e->fd, engine, depth, &io, why, sizeof why, &st), 0);
    g_n_order = 0;
    memset(g_start_us, 0, sizeof g_start_us);
    qm__io_set_hook(io, timed_read, NULL);
    return io;
}

/* Both engines (io_uring runs the hook under its lock as it issues a read,
 * the pool on the worker that reads it: either way a read's start is
 * stamped before the read). */
START_TEST(test_prefetch_reads_wait_for_an_idle_disk_two_at_most)
{
    if (!g_have_direct)
        return;
    eight_blocks e;
    eight_blocks_open(&e);
    for (int ei = 0; ei < N_ENGINES; ei++) {
        /* Depth 8: before, prefetches could hold 4 reads beside the demand's. */
        qm__io *io = timed_engine(&e, ENGINES[ei], 8);
        qm__io_req req[6];
        memset(req, 0, sizeof req);
        for (int i = 0; i < 6; i++)
            req[i] = (qm__io_req){.n_reg = 1, .reg = {block_region(&e, i)}};
        qm__io_submit(io, &req[0], QM__IO_DEMAND);
        for (int i = 1; i < 6; i++)
            qm__io_submit(io, &req[i], QM__IO_PREFETCH);
        for (int i = 0; i < 6; i++)
            qm__io_wait(io, &req[i]);
        qm__io_stats s;
        qm__io_stats_get(io, &s, 0);
        qm__io_free(io);
        /* No prefetch read started while the demand read (20 ms in its hook)
         * was in flight, and never more than two prefetch reads at once. */
        for (int i = 1; i < 6; i++)
            ck_assert_msg(g_start_us[i] >= g_start_us[0] + 19000,
                          "prefetch block %d started %lld us after the demand read", i,
                          (long long)g_start_us[i] - (long long)g_start_us[0]);
        ck_assert_uint_le(s.peak, 2);
        ck_assert_uint_eq(s.reads, 6);
        for (int i = 0; i < 6; i++)
            ck_assert_uint_eq(e.buf[i * QM__IO_ALIGN + 5], (uint8_t)i);
    }
    eight_blocks_close(&e);
}
END_TEST

START_TEST(test_a_parked_prefetch_reads_nothing_more_until_taken_up)
{
    if (!g_have_direct)
        return;
    eight_blocks e;
    eight_blocks_open(&e);
    for (int ei = 0; ei < N_ENGINES; ei++) {
        qm__io *io = timed_engine(&e, ENGINES[ei], 4);
        /* One prefetch of four one-block regions: two go out, two wait. */
        qm__io_req r;
        memset(&r, 0, sizeof r);
        r.n_reg = 4;
        for (int i = 0; i < 4; i++)
            r.reg[i] = block_region(&e, 1 + i);
        qm__io_submit(io, &r, QM__IO_PREFETCH);
        ck_assert_int_eq(qm__io_park(io, &r), 1);
        ck_assert_int_eq(qm__io_park(io, &r), 0); /* nothing queued any more */
        ck_assert(qm__io_parked(io, &r));
        qm__io_settle(io, &r);
        qm__io_stats s;
        qm__io_stats_get(io, &s, 0);
        ck_assert_uint_eq(s.reads, 2);
        ck_assert(!qm__io_done(io, &r));
        usleep(50000); /* an idle disk: still nothing more of it */
        qm__io_stats_get(io, &s, 0);
        ck_assert_uint_eq(s.reads, 2);
        /* A demand read meanwhile goes, and the drain does not wait for the
         * parked request. */
        qm__io_req d;
        memset(&d, 0, sizeof d);
        d.n_reg = 1;
        d.reg[0] = block_region(&e, 6);
        qm__io_submit(io, &d, QM__IO_DEMAND);
        qm__io_wait(io, &d);
        qm__io_drain(io);
        /* Taken up again: the rest, from where it stopped, each block once. */
        ck_assert_int_eq(qm__io_unpark(io, &r, QM__IO_PREFETCH), 1);
        ck_assert_int_eq(qm__io_unpark(io, &r, QM__IO_PREFETCH), 0);
        qm__io_wait(io, &r);
        qm__io_stats_get(io, &s, 0);
        qm__io_free(io);
        ck_assert(r.done && !r.err && !r.truncated);
        ck_assert_uint_eq(s.reads, 5);
        for (int i = 1; i <= 6; i++)
            if (i != 5) /* blocks 1-4 the prefetch's, 6 the demand's */
                ck_assert_uint_eq(e.buf[i * QM__IO_ALIGN + 9], (uint8_t)i);
    }
    eight_blocks_close(&e);
}
END_TEST

/* A bank file for a parking test and the regions (reads) of one of its
 * units: 0 (closed, a note printed) when a unit has too few regions for a
 * prefetch to be parked part way (two reads go out, the rest wait). */
static int park_case_open(dcase *dc, const char *name, uint32_t *R)
{
    dcase_open(dc, g_dir, name, 0, 0);
    *R = regions_per_unit(1);
    if (*R >= 3)
        return 1;
    fprintf(stderr, "test_paging_io: %u regions a unit, too few to park a prefetch part way\n", *R);
    dcase_close(dc);
    return 0;
}

/* A pager whose prefetch of expert 3 has two reads held in the hook (the
 * pool: they stay in flight) and the rest of its unit queued. */
static qm_pager *prefetch_held(dcase *dc, uint64_t budget, qm_policy *pol,
                               qm_residency_plan **plan, uint32_t R)
{
    qm_pager_options o = {.io_engine = QM_PAGER_IO_THREADS, .io_depth = 4, .no_preload = 1};
    qm_pager *pg = direct_pager_opt(dc->bank, "lru", budget, &o, NULL, pol, plan);
    hook_reset(0, 100000);
    qm_pager_set_read_hook(pg, slow_read, NULL);
    uint32_t e = 3;
    qm_status st = {0};
    ck_assert_int_eq(qm_pager_prefetch(pg, 1, &e, 1, &st), 1);
    while (__atomic_load_n(&g_reads, __ATOMIC_SEQ_CST) < 2)
        usleep(100);
    g_sleep_us = 0; /* those two stay asleep; every later read is quick */
    ck_assert_uint_ge(R, 3);
    return pg;
}

START_TEST(test_a_prefetch_the_call_did_not_ask_for_is_parked_and_read_on_when_asked)
{
    if (!g_have_direct)
        return;
    dcase dc;
    uint32_t R = 0;
    if (!park_case_open(&dc, "park", &R))
        return;
    qm_policy pol = {0};
    qm_residency_plan *plan = NULL;
    qm_pager *pg = prefetch_held(&dc, qm_bank_expert_bytes_total(dc.bank), &pol, &plan, R);
    uint32_t other = 5;
    uint64_t seed = 1;
    call_experts(pg, &fixture.bank, 1, &other, 1, &seed); /* layer 1's call, without 3 */
    usleep(150000); /* the prefetch's two reads leave the hook and land */
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.prefetch_parked, 1);
    ck_assert_uint_eq(s.disk_reads, 2 + R); /* the prefetch's two, the miss's unit */
    /* A call of that layer asking for all of its experts: 3 read on from
     * where it stopped (each unit read once), the bits of whole_bank. */
    wide_call w;
    wide_call_make(&w, dc.bank, 1);
    qm_moe_stats ms = {0};
    qm_status st = {0};
    ck_assert_msg(wide_call_run(&w, pg, &ms, &st) == 0, "%s", st.msg);
    ck_assert(wide_call_same(&w, dc.bank));
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.prefetch_useful, 1);
    ck_assert_uint_eq(s.disk_reads, 8 * R);
    ck_assert_uint_eq(s.prefetch_parked, 1);
    free_pager(pg, plan, &pol);
    dcase_close(&dc);
}
END_TEST

START_TEST(test_evicting_a_parked_prefetch_reads_none_of_its_rest)
{
    if (!g_have_direct)
        return;
    dcase dc;
    uint32_t R = 0;
    if (!park_case_open(&dc, "parkevict", &R))
        return;
    qm_policy pol = {0};
    qm_residency_plan *plan = NULL;
    /* One slot: the miss can only take the parked prefetch's. */
    qm_pager *pg = prefetch_held(&dc, unit_bytes(&fixture.bank), &pol, &plan, R);
    uint32_t other = 5;
    uint64_t seed = 1;
    call_experts(pg, &fixture.bank, 1, &other, 1, &seed);
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.prefetch_parked, 1);
    ck_assert_uint_eq(s.evictions, 1);
    ck_assert_uint_eq(s.misses, 1);
    ck_assert_uint_eq(s.disk_reads, 2 + R);
    /* 3 again: a miss read whole, the output right. */
    uint32_t three = 3;
    call_experts(pg, &fixture.bank, 1, &three, 1, &seed);
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.misses, 2);
    ck_assert_uint_eq(s.disk_reads, 2 + 2 * R);
    free_pager(pg, plan, &pol);
    dcase_close(&dc);
}
END_TEST

START_TEST(test_a_parked_prefetch_is_the_first_victim)
{
    if (!g_have_direct)
        return;
    dcase dc;
    uint32_t R = 0;
    if (!park_case_open(&dc, "parkvictim", &R))
        return;
    qm_policy pol = {0};
    qm_residency_plan *plan = NULL;
    /* Two slots, LRU: expert 1 used, then 3 prefetched (inserted later). */
    qm_pager_options o = {.io_engine = QM_PAGER_IO_THREADS, .io_depth = 4, .no_preload = 1};
    qm_pager *pg = direct_pager_opt(dc.bank, "lru", 2 * unit_bytes(&fixture.bank), &o, NULL, &pol,
                                    &plan);
    hook_reset(0, 0);
    qm_pager_set_read_hook(pg, slow_read, NULL);
    uint32_t one = 1, three = 3, five = 5;
    uint64_t seed = 1;
    call_experts(pg, &fixture.bank, 1, &one, 1, &seed);
    g_sleep_us = 100000;
    qm_status st = {0};
    ck_assert_int_eq(qm_pager_prefetch(pg, 1, &three, 1, &st), 1);
    while (__atomic_load_n(&g_reads, __ATOMIC_SEQ_CST) < (int)R + 2)
        usleep(100);
    g_sleep_us = 0;
    /* 5 parks 3 and takes its slot, though LRU's victim is 1. */
    call_experts(pg, &fixture.bank, 1, &five, 1, &seed);
    call_experts(pg, &fixture.bank, 1, &one, 1, &seed);
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.prefetch_parked, 1);
    ck_assert_uint_eq(s.evictions, 1);
    ck_assert_uint_eq(s.misses, 2);
    ck_assert_uint_eq(s.hits, 1);
    free_pager(pg, plan, &pol);
    dcase_close(&dc);
}
END_TEST

static Suite *io_suite(void)
{
    Suite *s = suite_create("paging_io");
    TCase *tc = tcase_create("io");
    tcase_add_checked_fixture(tc, pg_fixture_setup, pg_fixture_teardown);
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, test_a_call_missing_every_expert_has_their_reads_in_flight_together);
    tcase_add_test(tc, test_every_engine_and_depth_gives_whole_bank_bits);
    tcase_add_test(tc, test_a_failed_read_among_many_fails_only_its_call_and_is_read_again);
    tcase_add_test(tc, test_a_short_read_among_many_fails_only_its_call);
    tcase_add_test(tc, test_an_expert_in_use_is_never_evicted_under_concurrent_prefetch);
    tcase_add_test(tc, test_a_demand_for_a_unit_in_flight_waits_for_its_prefetch);
    tcase_add_test(tc, test_waiting_for_a_prefetch_in_flight_to_evict_it_counts_as_stall);
    tcase_add_test(tc, test_whole_banks_at_creation_are_read_with_many_reads_in_flight);
    tcase_add_test(tc, test_the_engine_issues_demand_reads_before_queued_prefetches);
    tcase_add_test(tc, test_prefetch_reads_wait_for_an_idle_disk_two_at_most);
    tcase_add_test(tc, test_a_parked_prefetch_reads_nothing_more_until_taken_up);
    tcase_add_test(tc, test_a_prefetch_the_call_did_not_ask_for_is_parked_and_read_on_when_asked);
    tcase_add_test(tc, test_evicting_a_parked_prefetch_reads_none_of_its_rest);
    tcase_add_test(tc, test_a_parked_prefetch_is_the_first_victim);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    find_direct_dir();
    SRunner *sr = srunner_create(io_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
