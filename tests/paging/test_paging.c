/* test_paging.c - the paging authority (engine/pager/qm_pager*): outputs bitwise equal to
 * whole_bank over policies x budgets x prefetch x copy paths, the budget on every
 * allocation, counters against a hand-computed sequence and the policy_sim model. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "paging_helpers.h"
#include "qm_kernel_isa.h"
#include "qm_test_policies.h"
#include "sim.h"

enum { MODE_CPU_THREAD, MODE_CPU_DIRECT, MODE_FAKE_DEVICE, N_MODES };

/* One policy x budget x prefetch x mode: every output bitwise equal to the
 * whole-bank reference, the budget held on every allocation. Returns 1 when
 * the budget is below the plan's minimum (skipped). */
static int run_case(const pf_bank *b, qm_backend *be, const char *policy, int has_budget,
                    uint64_t budget, int prefetch, int mode, const pg_set *set)
{
    const qm_bank_config *cfg = qm_bank_get_config(b->bank);
    qm_policy pol = {0};
    new_policy(policy, b, set, &pol);
    qm_residency_plan *plan = make_plan(b, &pol, has_budget, budget);
    qm_pager_options o = {.prefetch = prefetch,
                          .copy_thread = mode == MODE_CPU_DIRECT ? 2 : 0,
                          .copy_whole_banks = mode == MODE_CPU_DIRECT};
    qm_status st = {0};
    uint64_t min = 0;
    ck_assert_int_eq(qm_pager_min_budget(be, b->bank, plan, &o, &min, &st), 0);
    if (has_budget && budget < min) {
        qm_plan_free(plan);
        qm_policy_destroy(&pol);
        return 1;
    }
    qm_pager *pg = NULL;
    g_budget = has_budget ? budget : UINT64_MAX;
    int rc = qm_pager_new(be, b->bank, plan, &pol, &o, &pg, &st);
    ck_assert_msg(rc == 0, "%s budget %llu: %s", policy, (unsigned long long)budget, st.msg);
    qm_pager_set_alloc_hook(pg, budget_hook, NULL);
    uint64_t accesses = 0;
    float *out = malloc(sizeof(float) * 8 * cfg->hidden);
    for (size_t i = 0; i < set->n; i++) {
        const pg_call *c = &set->calls[i];
        memset(out, 0x7f, sizeof(float) * c->T * cfg->hidden);
        qm_moe_call mc = {.layer = c->layer, .dtype = QM_DTYPE_F32, .hidden = c->x,
                          .n_tokens = c->T, .logits = c->logits, .output = out};
        qm_moe_stats ms = {0};
        rc = qm_pager_forward(pg, &mc, &ms, &st);
        ck_assert_msg(rc == 0, "%s call %zu: %s", policy, i, st.msg);
        ck_assert_msg(memcmp(out, c->ref, sizeof(float) * c->T * cfg->hidden) == 0,
                      "%s budget %llu prefetch %d mode %d: call %zu (layer %u) differs from "
                      "whole_bank",
                      policy, (unsigned long long)budget, prefetch, mode, i, c->layer);
        accesses += c->n_uniq;
    }
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_le(s.resident_bytes, g_budget);
    ck_assert_uint_eq(s.budget_violations, 0);
    ck_assert_uint_eq(s.hits + s.misses + s.whole_bank_accesses, accesses);
    if (strcmp(policy, "whole_bank") != 0) /* the shipped ones always answer validly */
        ck_assert_uint_eq(s.policy_fallbacks, 0);
    free(out);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    return 0;
}

/* ---- Outputs and accounting -------------------------------------------------------- */

START_TEST(test_outputs_bitwise_equal_whole_bank_for_every_policy_budget_and_prefetch)
{
    const pf_spec *sp = &fixture.spec;
    qm_backend *dev = NULL;
    ck_assert_int_eq(pf_fake_device_new(&dev), 0);
    pg_set set;
    make_calls(&fixture.bank, fixture.cpu, 24, 11, &set);
    uint64_t U = unit_bytes(&fixture.bank), total = (uint64_t)sp->layers * sp->experts * U;
    const uint64_t budgets[] = {U, 2 * U, sp->k * U, total / 4, total / 2, total, 0};
    const char *policies[QM_TEST_MAX_POLICIES];
    const size_t n_policies = qm_test_policies(policies, 1, NULL); /* belady too */
    ck_assert_uint_ge(n_policies, 8);
    int ran = 0, skipped = 0;
    for (size_t p = 0; p < n_policies; p++)
        for (size_t bi = 0; bi < 7; bi++)
            for (int pf = 0; pf < 2; pf++)
                for (int mode = 0; mode < N_MODES; mode++) {
                    int r = run_case(&fixture.bank, mode == MODE_FAKE_DEVICE ? dev : fixture.cpu,
                                     policies[p], budgets[bi] != 0, budgets[bi], pf, mode, &set);
                    ran += !r;
                    skipped += r;
                }
    /* whole_bank runs only at total/none; everything else at every budget. */
    ck_assert_int_ge(ran, (int)(n_policies - 1) * 7 * 2 * N_MODES);
    ck_assert_int_eq(skipped, 5 * 2 * N_MODES); /* whole_bank below the whole model */
    ck_assert_uint_gt(g_allocs, 0);
    free_calls(&set);
    qm_backend_free(dev);
}
END_TEST

START_TEST(test_whole_bank_on_host_visible_backend_copies_nothing_and_counts_bytes)
{
    qm_policy pol = {0};
    ck_assert_int_eq(qm_policy_new("whole_bank", NULL, &pol, &fixture.st), 0);
    qm_residency_plan *plan = make_plan(&fixture.bank, &pol, 0, 0);
    qm_pager *pg = NULL;
    ck_assert_int_eq(
        qm_pager_new(fixture.cpu, fixture.bank.bank, plan, &pol, NULL, &pg, &fixture.st), 0);
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.arena_bytes, 0);
    ck_assert_uint_eq(s.n_slots, 0);
    ck_assert_uint_eq(s.bytes_loaded_at_create, 0);
    ck_assert_uint_eq(s.resident_bytes, qm_bank_expert_bytes_total(fixture.bank.bank));
    uint32_t r[16];
    ck_assert_int_eq(qm_pager_resident_experts(pg, 1, r, 16), (int)fixture.spec.experts);
    ck_assert_int_eq(qm_pager_layer_is_paged(pg, 1), 0);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
}
END_TEST

/* ---- Counters against simple models ------------------------------------------------- */

START_TEST(test_lru_counters_match_hand_computed_sequence)
{
    pf_spec sp = pf_default_spec();
    sp.router = 0;
    pg_fixture_reopen(&sp);
    qm_pager *pg = pg_fixture_lru_pager(2 * unit_bytes(&fixture.bank), 0);
    /* a b a c b with two slots: miss miss hit miss(evict b) miss(evict a). */
    const uint32_t seq[] = {1, 4, 1, 6, 4};
    uint64_t s = 3;
    for (int i = 0; i < 5; i++)
        call_experts(pg, &fixture.bank, 0, &seq[i], 1, &s);
    qm_pager_stats ps;
    qm_pager_stats_get(pg, &ps);
    ck_assert_uint_eq(ps.hits, 1);
    ck_assert_uint_eq(ps.misses, 4);
    ck_assert_uint_eq(ps.evictions, 2);
    ck_assert_uint_eq(ps.bytes_paged_h2d, 4 * unit_bytes(&fixture.bank));
    ck_assert_uint_eq(ps.resident_bytes, 2 * unit_bytes(&fixture.bank));
    uint32_t r[8];
    ck_assert_int_eq(qm_pager_resident_experts(pg, 0, r, 8), 2);
    ck_assert_uint_eq(r[0], 4);
    ck_assert_uint_eq(r[1], 6);
}
END_TEST

START_TEST(test_counters_match_policy_sim_model_for_every_policy_and_capacity)
{
    pf_spec sp = pf_default_spec();
    sp.router = 0; /* prefetch predicts from history only, as the model does */
    pg_fixture_reopen(&sp);
    /* Every offered policy that pages (all but whole_bank), then belady:
     * the others are checked against it. */
    const char *policies[QM_TEST_MAX_POLICIES + 1];
    size_t n_offered = qm_test_policies(policies, 0, "whole_bank");
    policies[n_offered] = "belady";
    const int NP = (int)n_offered + 1;
    const uint32_t caps[] = {1, 2, 3, 5, 8, 13, 24};
    for (int loc = 0; loc < 2; loc++) {
        sim_trace tr;
        ck_assert_int_eq(sim_trace_generate(&tr, 40, sp.layers, sp.experts, sp.k, 1.0,
                                            loc ? 0.7 : 0.0, 5 + loc),
                         0);
        qm_expert_ref *fut;
        size_t nf;
        ck_assert_int_eq(sim_future(&tr, 0, tr.tokens, &fut, &nf), 0);
        uint64_t demand_hits[QM_TEST_MAX_POLICIES + 1][7] = {{0}};
        for (int p = 0; p < NP; p++)
            for (size_t ci = 0; ci < 7; ci++)
                for (int pf = 0; pf < 2; pf++) {
                    qm_policy pol = {0}, pol2 = {0};
                    if (p == NP - 1) {
                        ck_assert_int_eq(qm_policy_belady_new(fut, nf, &pol, &fixture.st), 0);
                        ck_assert_int_eq(qm_policy_belady_new(fut, nf, &pol2, &fixture.st), 0);
                    } else {
                        ck_assert_int_eq(qm_policy_new(policies[p], NULL, &pol, &fixture.st), 0);
                        ck_assert_int_eq(qm_policy_new(policies[p], NULL, &pol2, &fixture.st), 0);
                    }
                    qm_residency_plan *plan;
                    qm_pager *pg = lru_pager(&fixture.bank, fixture.cpu, &pol,
                                             caps[ci] * unit_bytes(&fixture.bank), pf, &plan);
                    uint64_t s = 9;
                    for (uint32_t t = 0; t < tr.tokens; t++)
                        for (uint32_t l = 0; l < tr.layers; l++) {
                            const int16_t *row = tr.ids + ((size_t)t * tr.layers + l) * tr.k;
                            uint32_t ex[8];
                            for (uint32_t j = 0; j < tr.k; j++)
                                ex[j] = (uint32_t)row[j];
                            call_experts(pg, &fixture.bank, l, ex, tr.k, &s);
                        }
                    sim_prefetch spf = {.history = 1};
                    sim_result r;
                    ck_assert_int_eq(
                        sim_run(&tr, 0, tr.tokens, caps[ci], &pol2, NULL, pf ? &spf : NULL, &r),
                        0);
                    qm_pager_stats ps;
                    qm_pager_stats_get(pg, &ps);
                    ck_assert_msg(ps.hits == r.hits && ps.misses == r.misses &&
                                      ps.evictions == r.evictions && ps.waves == r.waves &&
                                      ps.prefetch_issued == r.prefetch_issued &&
                                      ps.prefetch_useful == r.prefetch_useful,
                                  "%s cap %u prefetch %d locality %d: pager hits %llu misses %llu "
                                  "evictions %llu waves %llu pf %llu/%llu; model %llu %llu %llu "
                                  "%llu %llu/%llu",
                                  policies[p], caps[ci], pf, loc, (unsigned long long)ps.hits,
                                  (unsigned long long)ps.misses, (unsigned long long)ps.evictions,
                                  (unsigned long long)ps.waves,
                                  (unsigned long long)ps.prefetch_issued,
                                  (unsigned long long)ps.prefetch_useful,
                                  (unsigned long long)r.hits, (unsigned long long)r.misses,
                                  (unsigned long long)r.evictions, (unsigned long long)r.waves,
                                  (unsigned long long)r.prefetch_issued,
                                  (unsigned long long)r.prefetch_useful);
                    ck_assert_uint_eq(ps.policy_fallbacks, 0);
                    ck_assert_uint_le(ps.resident_bytes, caps[ci] * unit_bytes(&fixture.bank));
                    if (!pf)
                        demand_hits[p][ci] = ps.hits;
                    qm_pager_free(pg);
                    qm_plan_free(plan);
                    qm_policy_destroy(&pol);
                    qm_policy_destroy(&pol2);
                }
        /* Through the authority too, Belady's MIN is never beaten on demand paging. */
        for (size_t ci = 0; ci < 7; ci++)
            for (int p = 0; p < NP - 1; p++)
                ck_assert_msg(demand_hits[NP - 1][ci] >= demand_hits[p][ci],
                              "cap %u: belady %llu hits < %s %llu", caps[ci],
                              (unsigned long long)demand_hits[NP - 1][ci], policies[p],
                              (unsigned long long)demand_hits[p][ci]);
        free(fut);
        sim_trace_free(&tr);
    }
}
END_TEST

/* The cyclic pattern: every token routes every layer to the same k experts,
 * and the budget holds fewer than one token's experts. Global LRU evicts
 * exactly what the next layer needs and never hits; the layer-aware
 * policies keep a fixed set and get close to Belady. */
START_TEST(test_cyclic_pattern_sends_lru_to_zero_and_the_guarded_policies_near_belady)
{
    const uint32_t L = 8, E = 4, K = 2, T = 60, cap = 10; /* 16 experts a token, 10 slots */
    sim_trace tr = {.tokens = T, .layers = L, .experts = E, .k = K};
    tr.ids = calloc((size_t)T * L * K, sizeof *tr.ids);
    ck_assert_ptr_nonnull(tr.ids);
    for (uint32_t t = 0; t < T; t++)
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t j = 0; j < K; j++)
                tr.ids[((size_t)t * L + l) * K + j] = (int16_t)((l + j) % E);
    qm_expert_ref *fut;
    size_t nf;
    ck_assert_int_eq(sim_future(&tr, 0, T, &fut, &nf), 0);
    qm_status st = {0};
    qm_policy bel = {0};
    ck_assert_int_eq(qm_policy_belady_new(fut, nf, &bel, &st), 0);
    sim_result rb;
    ck_assert_int_eq(sim_run(&tr, 0, T, cap, &bel, NULL, NULL, &rb), 0);
    ck_assert_uint_gt(rb.hits, 0);
    const char *names[] = {"lru", "arc", "layered_lru", "next_use"};
    for (int i = 0; i < 4; i++) {
        qm_policy pol = {0};
        ck_assert_int_eq(qm_policy_new(names[i], NULL, &pol, &st), 0);
        sim_result r;
        ck_assert_int_eq(sim_run(&tr, 0, T, cap, &pol, NULL, NULL, &r), 0);
        if (i == 0)
            ck_assert_msg(r.hits == 0, "lru hit %llu times on a cycle longer than the cache",
                          (unsigned long long)r.hits);
        else /* at least 80% of the optimum's hits */
            ck_assert_msg(r.hits * 5 >= rb.hits * 4, "%s: %llu hits, belady %llu", names[i],
                          (unsigned long long)r.hits, (unsigned long long)rb.hits);
        qm_policy_destroy(&pol);
    }
    qm_policy_destroy(&bel);
    free(fut);
    sim_trace_free(&tr);
}
END_TEST

/* Bytes an lru pager at `budget` asked for the r8 layout lays out. */
static uint64_t lru_interleaved_bytes(const pf_bank *b, uint64_t budget)
{
    qm_policy pol = {0};
    new_policy("lru", b, NULL, &pol);
    qm_residency_plan *plan = make_plan(b, &pol, 1, budget);
    qm_pager_options o = {.interleave = 1};
    qm_pager *pg = NULL;
    ck_assert_int_eq(qm_pager_new(fixture.cpu, b->bank, plan, &pol, &o, &pg, &fixture.st), 0);
    qm_pager_stats ps;
    qm_pager_stats_get(pg, &ps);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    return ps.bytes_interleaved_at_create;
}

/* One kernel's (QMOE_KERNEL=force, or the measured choice when NULL) whole
 * bank in the r8 layout against the bank read in place: the same bits,
 * fast and exact, at every row count, on one and two threads. */
static void interleaved_same_bits(const char *force)
{
    const pf_bank *b = &fixture.bank;
    const qm_bank_config *cfg = qm_bank_get_config(b->bank);
    const pf_spec sp = fixture.spec;
    if (force)
        setenv("QMOE_KERNEL", force, 1);
    int native = qm__i8kernel_r8_native(qm__i8kernel_select(), 1, cfg->bits);
    if (!native)
        fprintf(stderr,
                "test_interleaved_whole_banks_same_bits: fast kernel %s does not read "
                "%u-bit r8 here: the pager must leave banks in place, checked\n",
                force ? force : "(the choice)", cfg->bits);
    static const uint32_t TS[] = {1, 2, 3, 4, 5, 9, 17};
    uint64_t rs = 99;
    for (unsigned threads = 1; threads <= 2; threads++) {
        qm_backend *be = NULL;
        ck_assert_int_eq(qm_backend_cpu_new(threads, &be, &fixture.st), 0);
        qm_policy pol = {0};
        new_policy("whole_bank", b, NULL, &pol);
        qm_residency_plan *plan = make_plan(b, &pol, 0, 0);
        qm_pager_options o = {.interleave = 1};
        qm_pager *pg = NULL;
        ck_assert_msg(qm_pager_new(be, b->bank, plan, &pol, &o, &pg, &fixture.st) == 0, "%s",
                      fixture.st.msg);
        qm_pager_stats ps;
        qm_pager_stats_get(pg, &ps);
        uint64_t weights = 0;
        for (uint32_t l = 0; l < cfg->layers; l++)
            weights += qm_bank_layer(b->bank, l)->t[QM_T_FC1_WEIGHT].nbytes +
                       qm_bank_layer(b->bank, l)->t[QM_T_FC2_WEIGHT].nbytes;
        ck_assert_uint_eq(ps.bytes_interleaved_at_create, native ? weights : 0);
        for (size_t ti = 0; ti < sizeof TS / sizeof TS[0]; ti++)
            for (int prec = 0; prec < 2; prec++) {
                uint32_t T = TS[ti], l = (uint32_t)(ti % cfg->layers);
                float *x = malloc(sizeof(float) * T * sp.hidden);
                float *lg = malloc(sizeof(float) * T * sp.experts);
                float *ref = malloc(sizeof(float) * T * sp.hidden);
                float *out = malloc(sizeof(float) * T * sp.hidden);
                for (size_t i = 0; i < (size_t)T * sp.hidden; i++)
                    x[i] = pf_uniform(&rs, -1.0f, 1.0f);
                for (size_t i = 0; i < (size_t)T * sp.experts; i++)
                    lg[i] = pf_uniform(&rs, -2.0f, 2.0f);
                qm_moe_call c = {.layer = l, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T,
                                 .logits = lg, .output = ref,
                                 .precision = prec ? QM_PRECISION_FAST : QM_PRECISION_EXACT};
                qm_expert_source src;
                qm_expert_source_direct(b->bank, &src);
                ck_assert_int_eq(qm_moe_forward(be, b->bank, &c, &src, NULL, &fixture.st), 0);
                c.output = out;
                qm_moe_stats ms = {0};
                ck_assert_msg(qm_pager_forward(pg, &c, &ms, &fixture.st) == 0, "%s",
                              fixture.st.msg);
                ck_assert_msg(memcmp(out, ref, sizeof(float) * T * sp.hidden) == 0,
                              "%s %s T %u threads %u: the r8 bank's output differs",
                              force ? force : "(the choice)", prec ? "fast" : "exact", T, threads);
                free(x), free(lg), free(ref), free(out);
            }
        qm_pager_free(pg);
        qm_plan_free(plan);
        qm_policy_destroy(&pol);
        qm_backend_free(be);
    }
    unsetenv("QMOE_KERNEL");
}

/* One paged call of layer l routed to experts a and b (logits), T tokens,
 * against the bank read in place: the same bits. */
static void paged_call_same_bits(qm_pager *pg, qm_backend *be, uint32_t l, uint32_t a,
                                 uint32_t b, uint32_t T, int fast, uint64_t *rs, const char *what)
{
    const pf_bank *bk = &fixture.bank;
    const pf_spec sp = fixture.spec;
    float *x = malloc(sizeof(float) * T * sp.hidden), *lg = malloc(sizeof(float) * T * sp.experts);
    float *ref = malloc(sizeof(float) * T * sp.hidden), *out = malloc(sizeof(float) * T * sp.hidden);
    for (size_t i = 0; i < (size_t)T * sp.hidden; i++)
        x[i] = pf_uniform(rs, -1.0f, 1.0f);
    for (uint32_t t = 0; t < T; t++)
        for (uint32_t e = 0; e < sp.experts; e++)
            lg[(size_t)t * sp.experts + e] =
                e == a ? 4.0f : e == b ? 3.0f + pf_uniform(rs, 0.0f, 0.5f) : pf_uniform(rs, -2, 0);
    qm_moe_call c = {.layer = l, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T, .logits = lg,
                     .output = ref, .precision = fast ? QM_PRECISION_FAST : QM_PRECISION_EXACT};
    qm_expert_source src;
    qm_expert_source_direct(bk->bank, &src);
    ck_assert_int_eq(qm_moe_forward(be, bk->bank, &c, &src, NULL, &fixture.st), 0);
    c.output = out;
    qm_moe_stats ms = {0};
    ck_assert_msg(qm_pager_forward(pg, &c, &ms, &fixture.st) == 0, "%s", fixture.st.msg);
    ck_assert_msg(memcmp(out, ref, sizeof(float) * T * sp.hidden) == 0,
                  "%s: layer %u experts %u,%u T %u %s: the paged output differs", what, l, a, b, T,
                  fast ? "fast" : "exact");
    qm_pager_tidy(pg); /* as the daemon, after the answer */
    free(x), free(lg), free(ref), free(out);
}

/* A fast session's paged units laid out in r8 after they landed, once
 * used (qm_pager_tidy): the same bits before and
 * after, through evictions (a unit read again is in rows until laid out
 * again), fast and exact, T = 1 and 3. */
static void interleaved_slots_same_bits(const char *force, uint32_t piece)
{
    const pf_bank *b = &fixture.bank;
    if (force)
        setenv("QMOE_KERNEL", force, 1);
    int native =
        qm__i8kernel_r8_native(qm__i8kernel_select(), 1, qm_bank_get_config(b->bank)->bits);
    qm_backend *be = NULL;
    ck_assert_int_eq(qm_backend_cpu_new(2, &be, &fixture.st), 0);
    qm_policy pol = {0};
    new_policy("lru", b, NULL, &pol);
    qm_residency_plan *plan = make_plan(b, &pol, 1, 4 * unit_bytes(b));
    qm_pager_options o = {.interleave = 1, .no_preload = 1, .r8_piece_bytes = piece};
    qm_pager *pg = NULL;
    ck_assert_msg(qm_pager_new(be, b->bank, plan, &pol, &o, &pg, &fixture.st) == 0, "%s",
                  fixture.st.msg);
    const char *what = force ? force : "(the choice)";
    uint64_t rs = 7;
    qm_pager_stats ps;
    /* Experts 0 and 1 of layer 0, hit after the first call. */
    for (int i = 0; i < 16; i++)
        paged_call_same_bits(pg, be, 0, 0, 1, i % 5 == 4 ? 3 : 1, i % 2, &rs, what);
    qm_pager_stats_get(pg, &ps);
    if (piece) /* one tile a tidy: units in part, the kernels taking each tile in its layout */
        ck_assert(native ? ps.bytes_interleaved_paged > 0 && ps.units_interleaved_paged < 2
                         : ps.bytes_interleaved_paged == 0);
    else
        ck_assert_uint_eq(ps.units_interleaved_paged, native ? 2 : 0);
    /* Churn: every unit of layers 0 and 1 in turn through 4 slots. */
    for (uint32_t e = 0; e < 8; e += 2)
        for (uint32_t l = 0; l < 2; l++)
            paged_call_same_bits(pg, be, l, e, e + 1, 1 + e % 3, e % 4 == 0, &rs, what);
    /* Back to 0 and 1: read again in rows, then laid out again once
     * used. */
    for (int i = 0; i < 120; i++)
        paged_call_same_bits(pg, be, 0, 0, 1, 1, i % 2, &rs, what);
    qm_pager_stats_get(pg, &ps);
    ck_assert_uint_ge(ps.evictions, 8);
    if (native)
        ck_assert_uint_ge(ps.units_interleaved_paged, piece ? 2 : 4);
    else
        ck_assert_uint_eq(ps.bytes_interleaved_paged, 0);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    qm_backend_free(be);
    unsetenv("QMOE_KERNEL");
}

/* Fast sessions' whole banks in the r8 layout (opt.interleave, engine/kernels/qm_r8.h):
 * the same bits as the bank read in place, fast and exact, at every row
 * count (the fast decode GEMVs read r8 themselves; prefill GEMMs pack from
 * it; exact kernels get rows back), on one and two threads, with the
 * measured choice and with each fast row of this CPU that reads r8 forced
 * (AVX-512 VNNI and AVX2 on a Zen 4); a paged session's units, laid out
 * after they landed, alike. */
START_TEST(test_interleaved_whole_banks_same_bits)
{
    /* 4-bit and 8-bit banks (r8 is a layout of bytes; which kernels read
     * it depends on the width: qm_kernel_isa.h's reads_r8, reads_r8_q8). */
    for (uint32_t bits = 4; bits <= 8; bits += 4) {
        pf_spec sp = pf_default_spec();
        sp.hidden = 128;
        sp.inter = 64;
        sp.block = 32;
        sp.bits = bits;
        pg_fixture_reopen(&sp);
        interleaved_same_bits(NULL);
        interleaved_slots_same_bits(NULL, 0);
        interleaved_slots_same_bits(NULL, 1);
        int forced = 0;
        for (size_t i = 0; i < qm__i8isa_count(); i++) {
            const qm__i8isa *row = qm__i8isa_at(i);
            setenv("QMOE_KERNEL", row->kernel.name, 1);
            int here = strcmp(qm__i8kernel_select()->name, row->kernel.name) == 0;
            unsetenv("QMOE_KERNEL");
            if (here && (bits == 8 ? row->reads_r8_q8 : row->reads_r8)) {
                interleaved_same_bits(row->kernel.name);
                interleaved_slots_same_bits(row->kernel.name, 0);
                interleaved_slots_same_bits(row->kernel.name, 1);
                fprintf(stderr,
                        "test_interleaved_whole_banks_same_bits: %s read the %u-bit r8 bank\n",
                        row->kernel.name, bits);
                forced++;
            }
        }
        if (!forced)
            fprintf(stderr,
                    "test_interleaved_whole_banks_same_bits: no fast row here reads %u-bit "
                    "r8\n",
                    bits);
    }
    /* Paged: no whole bank, nothing laid out at creation (units are, once
     * they land and are reused: interleaved_slots_same_bits). */
    ck_assert_uint_eq(lru_interleaved_bytes(&fixture.bank, 2 * unit_bytes(&fixture.bank)), 0);
}
END_TEST

static Suite *paging_suite(void)
{
    Suite *s = suite_create("paging");
    TCase *tc = tcase_create("pager");
    tcase_add_checked_fixture(tc, pg_fixture_setup, pg_fixture_teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_outputs_bitwise_equal_whole_bank_for_every_policy_budget_and_prefetch);
    tcase_add_test(tc, test_whole_bank_on_host_visible_backend_copies_nothing_and_counts_bytes);
    tcase_add_test(tc, test_lru_counters_match_hand_computed_sequence);
    tcase_add_test(tc, test_counters_match_policy_sim_model_for_every_policy_and_capacity);
    tcase_add_test(tc, test_cyclic_pattern_sends_lru_to_zero_and_the_guarded_policies_near_belady);
    tcase_add_test(tc, test_interleaved_whole_banks_same_bits);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(paging_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
