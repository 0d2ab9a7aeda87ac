/* test_paging.c - the paging authority (engine/qm_pager*): outputs, accounting,
 * counters against the policy_sim cache model, hostile policies, waves,
 * minimum budget, prefetch. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "paging_fixture.h"
#include "qm_moe.h"
#include "qm_pager.h"
#include "qm_residency.h"
#include "sim.h"

/* ---- Helpers -------------------------------------------------------------------- */

static uint64_t g_budget;  /* the hook's budget check */
static uint64_t g_allocs;

static void budget_hook(void *ud, uint64_t resident, uint64_t budget)
{
    (void)ud;
    g_allocs++;
    ck_assert_msg(resident <= budget, "resident %llu > budget %llu", (unsigned long long)resident,
                  (unsigned long long)budget);
    ck_assert_msg(resident <= g_budget, "resident %llu > test budget %llu",
                  (unsigned long long)resident, (unsigned long long)g_budget);
}

typedef struct pg_call {
    uint32_t layer, T;
    float *x, *logits; /* logits NULL: the bank's router */
    float *ref;        /* whole-bank output */
    uint32_t uniq[64];
    size_t n_uniq;
} pg_call;

typedef struct pg_set {
    pg_call *calls;
    size_t n;
    qm_expert_ref *future; /* every access, in the order the pager sees them */
    size_t n_future;
} pg_set;

static void uniq_sorted(const uint32_t *route, size_t n, uint32_t *out, size_t *n_out)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (route[i] == QM_ROUTE_DROPPED)
            continue;
        int dup = 0;
        for (size_t j = 0; j < m; j++)
            dup |= out[j] == route[i];
        if (dup)
            continue;
        size_t j = m++;
        while (j > 0 && out[j - 1] > route[i]) {
            out[j] = out[j - 1];
            j--;
        }
        out[j] = route[i];
    }
    *n_out = m;
}

/* Random calls over every layer; references through the direct source. */
static void make_calls(const pf_bank *b, qm_backend *cpu, size_t n, uint64_t seed, pg_set *set)
{
    const qm_bank_config *cfg = qm_bank_get_config(b->bank);
    static const uint32_t Ts[] = {1, 3, 2, 5, 1, 4};
    set->calls = calloc(n, sizeof *set->calls);
    set->future = calloc(n * 64, sizeof *set->future);
    set->n = n;
    set->n_future = 0;
    uint64_t s = seed;
    qm_expert_source direct;
    qm_expert_source_direct(b->bank, &direct);
    for (size_t i = 0; i < n; i++) {
        pg_call *c = &set->calls[i];
        c->layer = (uint32_t)(i % cfg->layers);
        c->T = Ts[i % 6];
        c->x = malloc(sizeof(float) * c->T * cfg->hidden);
        c->ref = malloc(sizeof(float) * c->T * cfg->hidden);
        for (size_t j = 0; j < (size_t)c->T * cfg->hidden; j++)
            c->x[j] = pf_uniform(&s, -1.0f, 1.0f);
        if (i % 3 != 2) {
            c->logits = malloc(sizeof(float) * c->T * cfg->experts);
            for (size_t j = 0; j < (size_t)c->T * cfg->experts; j++)
                c->logits[j] = pf_uniform(&s, -2.0f, 2.0f);
        }
        uint32_t route[64];
        ck_assert_uint_le(c->T * cfg->k, 64);
        qm_moe_call mc = {.layer = c->layer, .dtype = QM_DTYPE_F32, .hidden = c->x,
                          .n_tokens = c->T, .logits = c->logits, .output = c->ref,
                          .route_experts = route};
        qm_moe_stats ms = {0};
        qm_status st = {0};
        int rc = qm_moe_forward(cpu, b->bank, &mc, &direct, &ms, &st);
        ck_assert_msg(rc == 0, "reference forward: %s", st.msg);
        uniq_sorted(route, (size_t)c->T * cfg->k, c->uniq, &c->n_uniq);
        for (size_t j = 0; j < c->n_uniq; j++)
            set->future[set->n_future++] = (qm_expert_ref){c->layer, c->uniq[j]};
    }
}

static void free_calls(pg_set *set)
{
    for (size_t i = 0; i < set->n; i++) {
        free(set->calls[i].x);
        free(set->calls[i].logits);
        free(set->calls[i].ref);
    }
    free(set->calls);
    free(set->future);
}

static uint64_t unit_bytes(const pf_bank *b)
{
    return qm_bank_layer(b->bank, 0)->bytes_per_expert;
}

/* Hottest-first lists: layer l lists experts (l + 3 i) mod E. */
static uint32_t g_hot[8][64];
static size_t g_hot_len[8];
static const uint32_t *g_hot_ptr[8];

static void new_policy(const char *name, const pf_bank *b, const pg_set *set, qm_policy *pol)
{
    qm_status st = {0};
    const qm_bank_config *cfg = qm_bank_get_config(b->bank);
    int rc;
    if (!strcmp(name, "belady")) {
        rc = qm_policy_belady_new(set->future, set->n_future, pol, &st);
    } else {
        qm_policy_params pp = {0};
        if (!strcmp(name, "static_hot")) {
            for (uint32_t l = 0; l < cfg->layers && l < 8; l++) {
                for (uint32_t i = 0; i < cfg->experts; i++)
                    g_hot[l][i] = (l + 3 * i) % cfg->experts;
                g_hot_len[l] = cfg->experts / 2;
                g_hot_ptr[l] = g_hot[l];
            }
            pp.hot = g_hot_ptr;
            pp.hot_len = g_hot_len;
            pp.n_hot_banks = cfg->layers;
        }
        rc = qm_policy_new(name, &pp, pol, &st);
    }
    ck_assert_msg(rc == 0, "policy %s: %s", name, st.msg);
}

static qm_residency_plan *make_plan(const pf_bank *b, const qm_policy *pol, int has_budget,
                                   uint64_t budget)
{
    const qm_bank_config *cfg = qm_bank_get_config(b->bank);
    qm_region_catalog *cats[16];
    qm_status st = {0};
    for (uint32_t l = 0; l < cfg->layers; l++)
        ck_assert_int_eq(qm_bank_build_catalog(b->bank, l, &cats[l], &st), 0);
    qm_plan_options po = {.has_budget = has_budget, .budget_bytes = budget};
    qm_residency_plan *plan = NULL;
    int rc = qm_plan_residency((const qm_region_catalog *const *)cats, cfg->layers, pol, &po,
                               &plan, &st);
    ck_assert_msg(rc == 0, "plan: %s", st.msg);
    for (uint32_t l = 0; l < cfg->layers; l++)
        qm_catalog_free(cats[l]);
    return plan;
}

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
    if (!strcmp(policy, "belady") || !strcmp(policy, "lru") || !strcmp(policy, "lfu"))
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
    pf_spec sp = pf_default_spec();
    pf_bank b;
    pf_bank_open(&sp, &b);
    qm_backend *cpu = NULL, *dev = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_cpu_new(1, &cpu, &st), 0);
    ck_assert_int_eq(pf_fake_device_new(&dev), 0);
    pg_set set;
    make_calls(&b, cpu, 24, 11, &set);
    uint64_t U = unit_bytes(&b), total = (uint64_t)sp.layers * sp.experts * U;
    const uint64_t budgets[] = {U, 2 * U, sp.k * U, total / 4, total / 2, total, 0};
    const char *policies[] = {"whole_bank", "lru", "lfu", "static_hot", "belady"};
    int ran = 0, skipped = 0;
    for (size_t p = 0; p < 5; p++)
        for (size_t bi = 0; bi < 7; bi++)
            for (int pf = 0; pf < 2; pf++)
                for (int mode = 0; mode < N_MODES; mode++) {
                    int r = run_case(&b, mode == MODE_FAKE_DEVICE ? dev : cpu, policies[p],
                                     budgets[bi] != 0, budgets[bi], pf, mode, &set);
                    ran += !r;
                    skipped += r;
                }
    /* whole_bank runs only at total/none; everything else at every budget. */
    ck_assert_int_ge(ran, 4 * 7 * 2 * N_MODES);
    ck_assert_uint_gt(g_allocs, 0);
    free_calls(&set);
    qm_backend_free(cpu);
    qm_backend_free(dev);
    pf_bank_close(&b);
}
END_TEST

START_TEST(test_whole_bank_on_host_visible_backend_copies_nothing_and_counts_bytes)
{
    pf_spec sp = pf_default_spec();
    pf_bank b;
    pf_bank_open(&sp, &b);
    qm_backend *cpu = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_cpu_new(1, &cpu, &st), 0);
    qm_policy pol = {0};
    ck_assert_int_eq(qm_policy_new("whole_bank", NULL, &pol, &st), 0);
    qm_residency_plan *plan = make_plan(&b, &pol, 0, 0);
    qm_pager *pg = NULL;
    ck_assert_int_eq(qm_pager_new(cpu, b.bank, plan, &pol, NULL, &pg, &st), 0);
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.arena_bytes, 0);
    ck_assert_uint_eq(s.n_slots, 0);
    ck_assert_uint_eq(s.bytes_loaded_at_create, 0);
    ck_assert_uint_eq(s.resident_bytes, qm_bank_expert_bytes_total(b.bank));
    uint32_t r[16];
    ck_assert_int_eq(qm_pager_resident_experts(pg, 1, r, 16), (int)sp.experts);
    ck_assert_int_eq(qm_pager_layer_is_paged(pg, 1), 0);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    qm_backend_free(cpu);
    pf_bank_close(&b);
}
END_TEST

/* ---- Counters against simple models ------------------------------------------------- */

static qm_pager *lru_pager(const pf_bank *b, qm_backend *be, qm_policy *pol, uint64_t budget,
                           int prefetch, qm_residency_plan **plan)
{
    qm_status st = {0};
    *plan = make_plan(b, pol, 1, budget);
    /* No gating: the model does not gate prefetch sources. */
    qm_pager_options o = {.prefetch = prefetch, .history = 1, .prefetch_min_precision = -1};
    qm_pager *pg = NULL;
    int rc = qm_pager_new(be, b->bank, *plan, pol, &o, &pg, &st);
    ck_assert_msg(rc == 0, "pager: %s", st.msg);
    return pg;
}

static void call_experts(qm_pager *pg, const pf_bank *b, uint32_t layer, const uint32_t *ex,
                         uint32_t n, uint64_t *seed)
{
    const qm_bank_config *cfg = qm_bank_get_config(b->bank);
    float x[256], logits[256], out[256];
    ck_assert_uint_le(cfg->hidden, 256);
    for (uint32_t i = 0; i < cfg->hidden; i++)
        x[i] = pf_uniform(seed, -1, 1);
    pf_route_logits(cfg->experts, ex, n, logits);
    qm_moe_call mc = {.layer = layer, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = 1,
                      .logits = logits, .output = out};
    qm_moe_stats ms = {0};
    qm_status st = {0};
    int rc = qm_pager_forward(pg, &mc, &ms, &st);
    ck_assert_msg(rc == 0, "forward: %s", st.msg);
}

START_TEST(test_lru_counters_match_hand_computed_sequence)
{
    pf_spec sp = pf_default_spec();
    sp.router = 0;
    pf_bank b;
    pf_bank_open(&sp, &b);
    qm_backend *cpu = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_cpu_new(1, &cpu, &st), 0);
    qm_policy pol = {0};
    ck_assert_int_eq(qm_policy_new("lru", NULL, &pol, &st), 0);
    qm_residency_plan *plan;
    qm_pager *pg = lru_pager(&b, cpu, &pol, 2 * unit_bytes(&b), 0, &plan);
    /* a b a c b with two slots: miss miss hit miss(evict b) miss(evict a). */
    const uint32_t seq[] = {1, 4, 1, 6, 4};
    uint64_t s = 3;
    for (int i = 0; i < 5; i++)
        call_experts(pg, &b, 0, &seq[i], 1, &s);
    qm_pager_stats ps;
    qm_pager_stats_get(pg, &ps);
    ck_assert_uint_eq(ps.hits, 1);
    ck_assert_uint_eq(ps.misses, 4);
    ck_assert_uint_eq(ps.evictions, 2);
    ck_assert_uint_eq(ps.bytes_paged_h2d, 4 * unit_bytes(&b));
    ck_assert_uint_eq(ps.resident_bytes, 2 * unit_bytes(&b));
    uint32_t r[8];
    ck_assert_int_eq(qm_pager_resident_experts(pg, 0, r, 8), 2);
    ck_assert_uint_eq(r[0], 4);
    ck_assert_uint_eq(r[1], 6);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    qm_backend_free(cpu);
    pf_bank_close(&b);
}
END_TEST

START_TEST(test_counters_match_policy_sim_model_for_every_policy_and_capacity)
{
    pf_spec sp = pf_default_spec();
    sp.router = 0; /* prefetch predicts from history only, as the model does */
    pf_bank b;
    pf_bank_open(&sp, &b);
    qm_backend *cpu = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_cpu_new(1, &cpu, &st), 0);
    const char *policies[] = {"lru", "lfu", "belady"};
    const uint32_t caps[] = {1, 2, 3, 5, 8, 13, 24};
    for (int loc = 0; loc < 2; loc++) {
        sim_trace tr;
        ck_assert_int_eq(sim_trace_generate(&tr, 40, sp.layers, sp.experts, sp.k, 1.0,
                                            loc ? 0.7 : 0.0, 5 + loc),
                         0);
        qm_expert_ref *fut;
        size_t nf;
        ck_assert_int_eq(sim_future(&tr, 0, tr.tokens, &fut, &nf), 0);
        for (int p = 0; p < 3; p++)
            for (size_t ci = 0; ci < 7; ci++)
                for (int pf = 0; pf < 2; pf++) {
                    qm_policy pol = {0}, pol2 = {0};
                    if (p == 2) {
                        ck_assert_int_eq(qm_policy_belady_new(fut, nf, &pol, &st), 0);
                        ck_assert_int_eq(qm_policy_belady_new(fut, nf, &pol2, &st), 0);
                    } else {
                        ck_assert_int_eq(qm_policy_new(policies[p], NULL, &pol, &st), 0);
                        ck_assert_int_eq(qm_policy_new(policies[p], NULL, &pol2, &st), 0);
                    }
                    qm_residency_plan *plan;
                    qm_pager *pg = lru_pager(&b, cpu, &pol, caps[ci] * unit_bytes(&b), pf, &plan);
                    uint64_t s = 9;
                    for (uint32_t t = 0; t < tr.tokens; t++)
                        for (uint32_t l = 0; l < tr.layers; l++) {
                            const int16_t *row = tr.ids + ((size_t)t * tr.layers + l) * tr.k;
                            uint32_t ex[8];
                            for (uint32_t j = 0; j < tr.k; j++)
                                ex[j] = (uint32_t)row[j];
                            call_experts(pg, &b, l, ex, tr.k, &s);
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
                    ck_assert_uint_le(ps.resident_bytes, caps[ci] * unit_bytes(&b));
                    qm_pager_free(pg);
                    qm_plan_free(plan);
                    qm_policy_destroy(&pol);
                    qm_policy_destroy(&pol2);
                }
        free(fut);
        sim_trace_free(&tr);
    }
    qm_backend_free(cpu);
    pf_bank_close(&b);
}
END_TEST

/* ---- Hostile policy -------------------------------------------------------------------- */

typedef struct hostile {
    uint32_t *all;
    size_t n_all;
    uint64_t answers, invalid;
} hostile;

static int hostile_decide(void *ctx, const qm_policy_input *in, qm_residency_decision *out)
{
    hostile *h = ctx;
    uint32_t n = qm_catalog_expert_count(in->catalog);
    if (h->n_all < n) {
        h->all = realloc(h->all, n * sizeof *h->all);
        h->n_all = n;
    }
    for (uint32_t e = 0; e < n; e++)
        h->all[e] = e;
    out->kind = QM_DECISION_PER_EXPERT;
    out->experts = h->all;
    out->n_experts = n;
    return 0;
}

/* Cycles through every kind of bad answer, with a valid one now and then. */
static int hostile_choose(void *ctx, const qm_expert_ref *cand, size_t n, size_t *victim)
{
    hostile *h = ctx;
    switch (h->answers++ % 6) {
    case 0:
        h->invalid++;
        return -1; /* refuses */
    case 1:
        h->invalid++;
        *victim = n + 5; /* out of range */
        return 0;
    case 2:
        h->invalid++;
        *victim = SIZE_MAX;
        return 0;
    case 3:
        *victim = n - 1; /* valid */
        return 0;
    case 4: {
        /* Scribbles over the (const) candidates and names the scribbled one. */
        qm_expert_ref *w = (qm_expert_ref *)cand;
        w[0].expert = 999;
        w[0].bank = 77;
        h->invalid++;
        *victim = 0;
        return 0;
    }
    default:
        h->invalid++;
        *victim = (size_t)-7; /* garbage */
        return 0;
    }
}

static void hostile_destroy(void *ctx)
{
    hostile *h = ctx;
    free(h->all);
    free(h);
}

static const qm_policy_iface hostile_iface = {
    .version = QM_POLICY_IFACE_VERSION,
    .name = "hostile",
    .decide = hostile_decide,
    .choose_victim = hostile_choose,
    .destroy = hostile_destroy,
};

START_TEST(test_hostile_victims_fall_back_to_lru_and_keep_accounting_and_outputs)
{
    pf_spec sp = pf_default_spec();
    pf_bank b;
    pf_bank_open(&sp, &b);
    qm_backend *cpu = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_cpu_new(1, &cpu, &st), 0);
    pg_set set;
    make_calls(&b, cpu, 30, 21, &set);
    for (uint64_t cap = 1; cap <= 6; cap++) {
        hostile *h = calloc(1, sizeof *h);
        qm_policy pol = {.iface = &hostile_iface, .ctx = h};
        uint64_t budget = cap * unit_bytes(&b);
        qm_residency_plan *plan = make_plan(&b, &pol, 1, budget);
        qm_pager_options o = {.prefetch = (int)(cap % 2)};
        qm_pager *pg = NULL;
        ck_assert_int_eq(qm_pager_new(cpu, b.bank, plan, &pol, &o, &pg, &st), 0);
        g_budget = budget;
        qm_pager_set_alloc_hook(pg, budget_hook, NULL);
        float out[8 * 64];
        for (size_t i = 0; i < set.n; i++) {
            const pg_call *c = &set.calls[i];
            qm_moe_call mc = {.layer = c->layer, .dtype = QM_DTYPE_F32, .hidden = c->x,
                              .n_tokens = c->T, .logits = c->logits, .output = out};
            qm_moe_stats ms = {0};
            ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &st), 0);
            ck_assert_msg(memcmp(out, c->ref, sizeof(float) * c->T * sp.hidden) == 0,
                          "hostile policy changed call %zu's output", i);
        }
        qm_pager_stats s;
        qm_pager_stats_get(pg, &s);
        ck_assert_uint_gt(h->answers, 0);
        ck_assert_uint_eq(s.policy_fallbacks, h->invalid);
        ck_assert_uint_le(s.resident_bytes, budget);
        ck_assert_uint_eq(s.budget_violations, 0);
        qm_pager_free(pg);
        qm_plan_free(plan);
        qm_policy_destroy(&pol);
    }
    free_calls(&set);
    qm_backend_free(cpu);
    pf_bank_close(&b);
}
END_TEST

/* ---- Waves and the minimum budget ------------------------------------------------------- */

START_TEST(test_budget_below_one_request_runs_in_waves_with_same_output)
{
    pf_spec sp = pf_default_spec();
    pf_bank b;
    pf_bank_open(&sp, &b);
    qm_backend *cpu = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_cpu_new(1, &cpu, &st), 0);
    const qm_bank_config *cfg = qm_bank_get_config(b.bank);
    /* Four tokens over all eight experts of layer 1. */
    enum { T = 4 };
    float x[T * 32], logits[T * 8], ref[T * 32], out[T * 32];
    uint64_t s = 5;
    for (int i = 0; i < T * 32; i++)
        x[i] = pf_uniform(&s, -1, 1);
    for (uint32_t t = 0; t < T; t++) {
        uint32_t ex[2] = {2 * t, 2 * t + 1};
        pf_route_logits(cfg->experts, ex, 2, logits + t * cfg->experts);
    }
    qm_expert_source direct;
    qm_expert_source_direct(b.bank, &direct);
    qm_moe_call mc = {.layer = 1, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T,
                      .logits = logits, .output = ref};
    qm_moe_stats ms = {0};
    ck_assert_int_eq(qm_moe_forward(cpu, b.bank, &mc, &direct, &ms, &st), 0);
    for (uint64_t cap = 1; cap <= 3; cap++) {
        qm_policy pol = {0};
        ck_assert_int_eq(qm_policy_new("lru", NULL, &pol, &st), 0);
        qm_residency_plan *plan;
        qm_pager *pg = lru_pager(&b, cpu, &pol, cap * unit_bytes(&b), 1, &plan);
        mc.output = out;
        memset(&ms, 0, sizeof ms);
        ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &st), 0);
        ck_assert_msg(memcmp(out, ref, sizeof out) == 0, "waves changed the output (cap %llu)",
                      (unsigned long long)cap);
        qm_pager_stats ps;
        qm_pager_stats_get(pg, &ps);
        uint64_t rounds = (8 + cap - 1) / cap;
        ck_assert_uint_eq(ms.waves, rounds);
        ck_assert_uint_eq(ps.waves, rounds - 1);
        ck_assert_uint_eq(ps.misses, 8);
        ck_assert_uint_le(ps.resident_bytes, cap * unit_bytes(&b));
        qm_pager_free(pg);
        qm_plan_free(plan);
        qm_policy_destroy(&pol);
    }
    qm_backend_free(cpu);
    pf_bank_close(&b);
}
END_TEST

START_TEST(test_budget_below_one_expert_is_refused_naming_the_minimum)
{
    pf_spec sp = pf_default_spec();
    pf_bank b;
    pf_bank_open(&sp, &b);
    qm_backend *cpu = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_cpu_new(1, &cpu, &st), 0);
    const char *names[] = {"lru", "whole_bank"};
    uint64_t mins[] = {unit_bytes(&b), qm_bank_expert_bytes_total(b.bank)};
    for (int i = 0; i < 2; i++) {
        qm_policy pol = {0};
        ck_assert_int_eq(qm_policy_new(names[i], NULL, &pol, &st), 0);
        qm_residency_plan *plan = make_plan(&b, &pol, 1, mins[i] - 1);
        qm_pager *pg = (qm_pager *)&pol; /* must be reset to NULL */
        qm_status_clear(&st);
        int rc = qm_pager_new(cpu, b.bank, plan, &pol, NULL, &pg, &st);
        ck_assert_int_eq(rc, QM_ERESOURCE_EXHAUSTED);
        ck_assert_ptr_null(pg);
        char num[32];
        snprintf(num, sizeof num, "%llu", (unsigned long long)mins[i]);
        ck_assert_msg(strstr(st.msg, num) != NULL, "message '%s' lacks the minimum %s", st.msg,
                      num);
        ck_assert_str_eq(st.field, "budget_bytes");
        uint64_t min = 0;
        ck_assert_int_eq(qm_pager_min_budget(cpu, b.bank, plan, NULL, &min, &st), 0);
        ck_assert_uint_eq(min, mins[i]);
        qm_plan_free(plan);
        /* Exactly the minimum works. */
        plan = make_plan(&b, &pol, 1, mins[i]);
        ck_assert_int_eq(qm_pager_new(cpu, b.bank, plan, &pol, NULL, &pg, &st), 0);
        qm_pager_free(pg);
        qm_plan_free(plan);
        qm_policy_destroy(&pol);
    }
    qm_backend_free(cpu);
    pf_bank_close(&b);
}
END_TEST

/* ---- Prefetch ------------------------------------------------------------------------------ */

START_TEST(test_router_prefetch_makes_next_layer_call_all_hits)
{
    pf_spec sp = pf_default_spec();
    pf_bank b;
    pf_bank_open(&sp, &b);
    qm_backend *cpu = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_cpu_new(1, &cpu, &st), 0);
    qm_policy pol = {0};
    ck_assert_int_eq(qm_policy_new("lru", NULL, &pol, &st), 0);
    qm_residency_plan *plan;
    qm_pager *pg = lru_pager(&b, cpu, &pol, 4 * unit_bytes(&b), 1, &plan);
    float x[32], out[32];
    uint64_t s = 77;
    for (int i = 0; i < 32; i++)
        x[i] = pf_uniform(&s, -1, 1);
    qm_moe_call mc = {.layer = 0, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = 1,
                      .output = out};
    qm_moe_stats ms = {0};
    ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &st), 0);
    qm_pager_stats a;
    qm_pager_stats_get(pg, &a);
    ck_assert_uint_eq(a.misses, sp.k);
    ck_assert_uint_eq(a.prefetch_issued, sp.k); /* layer 1's router on the same hidden state */
    mc.layer = 1; /* same hidden, routed by layer 1's own router: exactly the prediction */
    ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &st), 0);
    qm_pager_stats c;
    qm_pager_stats_get(pg, &c);
    ck_assert_uint_eq(c.misses, a.misses);
    ck_assert_uint_eq(c.hits, sp.k);
    ck_assert_uint_eq(c.prefetch_useful, sp.k);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    qm_backend_free(cpu);
    pf_bank_close(&b);
}
END_TEST

START_TEST(test_prefetch_never_evicts_pinned_or_in_use_experts)
{
    pf_spec sp = pf_default_spec();
    pf_bank b;
    pf_bank_open(&sp, &b);
    qm_backend *cpu = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_cpu_new(1, &cpu, &st), 0);
    pg_set none = {0};
    qm_policy pol = {0};
    new_policy("static_hot", &b, &none, &pol);
    uint64_t U = unit_bytes(&b);
    /* pin_fraction 0.5 of 12 units over 3 listed banks: 2 pins per layer, 6 paging slots. */
    qm_residency_plan *plan = make_plan(&b, &pol, 1, 12 * U);
    qm_pager_options o = {.prefetch = 1};
    qm_pager *pg = NULL;
    ck_assert_int_eq(qm_pager_new(cpu, b.bank, plan, &pol, &o, &pg, &st), 0);
    qm_pager_stats s0;
    qm_pager_stats_get(pg, &s0);
    ck_assert_uint_eq(s0.n_pinned, 6);
    ck_assert_uint_eq(s0.n_slots, 12);
    qm_expert_source *src = qm_pager_source(pg);
    /* Hold six unpinned experts of layer 2 (hot list: 2, 5, 0, 3, ...: pins 2 and 5). */
    const uint32_t held[6] = {0, 1, 3, 4, 6, 7};
    qm_expert_weights w[6];
    size_t ready = 0;
    ck_assert_int_eq(src->acquire(src->ctx, 2, held, 6, w, &ready, &st), 0);
    ck_assert_uint_eq(ready, 6);
    const qm_layer_view *lv = qm_bank_layer(b.bank, 2);
    uint64_t slice = qm_expert_slice_bytes(&lv->t[QM_T_FC1_WEIGHT], sp.experts);
    /* Every slot is pinned or in use: prefetch must find nothing to evict. */
    const uint32_t want[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    ck_assert_int_eq(qm_pager_prefetch(pg, 0, want, 8, &st), 0);
    ck_assert_int_eq(qm_pager_prefetch(pg, 1, want, 8, &st), 0);
    for (int i = 0; i < 6; i++)
        ck_assert_msg(memcmp(w[i].ptr[QM_T_FC1_WEIGHT],
                             (const uint8_t *)lv->t[QM_T_FC1_WEIGHT].data + held[i] * slice,
                             slice) == 0,
                      "held expert %u was overwritten", held[i]);
    src->release(src->ctx, 2, held, 6);
    /* Released: now prefetch may take their slots, never the pins. */
    ck_assert_int_eq(qm_pager_prefetch(pg, 0, want, 8, &st), 6);
    ck_assert_int_eq(qm_pager_sync(pg, &st), 0);
    for (uint32_t l = 0; l < sp.layers; l++) {
        uint32_t r[8];
        int n = qm_pager_resident_experts(pg, l, r, 8);
        int has_a = 0, has_b = 0;
        for (int i = 0; i < n; i++) {
            has_a |= r[i] == g_hot[l][0];
            has_b |= r[i] == g_hot[l][1];
        }
        ck_assert_msg(has_a && has_b, "a pinned expert of layer %u was evicted", l);
    }
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_le(s.resident_bytes, 12 * U);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    qm_backend_free(cpu);
    pf_bank_close(&b);
}
END_TEST

START_TEST(test_imprecise_router_prediction_is_switched_off)
{
    pf_spec sp = pf_default_spec();
    sp.experts = 32; /* random guesses of 2 in 32: precision ~1/16 */
    pf_bank b;
    pf_bank_open(&sp, &b);
    qm_backend *cpu = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_cpu_new(1, &cpu, &st), 0);
    qm_policy pol = {0};
    ck_assert_int_eq(qm_policy_new("lru", NULL, &pol, &st), 0);
    qm_residency_plan *plan = make_plan(&b, &pol, 1, 8 * unit_bytes(&b));
    qm_pager_options o = {.prefetch = 1};
    qm_pager *pg = NULL;
    ck_assert_int_eq(qm_pager_new(cpu, b.bank, plan, &pol, &o, &pg, &st), 0);
    uint64_t s = 31;
    for (uint32_t i = 0; i < 600; i++) {
        /* Routed by random logits: the bank's routers predict nothing. */
        uint32_t ex[2] = {(uint32_t)(pf_rand(&s) % 16), 16 + (uint32_t)(pf_rand(&s) % 16)};
        call_experts(pg, &b, i % sp.layers, ex, 2, &s);
    }
    qm_pager_stats ps;
    qm_pager_stats_get(pg, &ps);
    ck_assert_uint_ge(ps.prefetch_router_issued, 128);
    ck_assert_uint_lt(ps.prefetch_router_useful * 4, ps.prefetch_router_issued);
    ck_assert_uint_gt(ps.prefetch_gated, 300); /* off on most calls after the first window */
    /* Probing continues: issued keeps growing, at about one call in eight. */
    ck_assert_uint_lt(ps.prefetch_router_issued, 600);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
    qm_backend_free(cpu);
    pf_bank_close(&b);
}
END_TEST

static void paging_more_tests(TCase *tc)
{
    tcase_add_test(tc, test_imprecise_router_prediction_is_switched_off);
    tcase_add_test(tc, test_hostile_victims_fall_back_to_lru_and_keep_accounting_and_outputs);
    tcase_add_test(tc, test_budget_below_one_request_runs_in_waves_with_same_output);
    tcase_add_test(tc, test_budget_below_one_expert_is_refused_naming_the_minimum);
    tcase_add_test(tc, test_router_prefetch_makes_next_layer_call_all_hits);
    tcase_add_test(tc, test_prefetch_never_evicts_pinned_or_in_use_experts);
}

static Suite *paging_suite(void)
{
    Suite *s = suite_create("paging");
    TCase *tc = tcase_create("pager");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_outputs_bitwise_equal_whole_bank_for_every_policy_budget_and_prefetch);
    tcase_add_test(tc, test_whole_bank_on_host_visible_backend_copies_nothing_and_counts_bytes);
    tcase_add_test(tc, test_lru_counters_match_hand_computed_sequence);
    tcase_add_test(tc, test_counters_match_policy_sim_model_for_every_policy_and_capacity);
    paging_more_tests(tc);
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
