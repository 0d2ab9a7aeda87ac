/* test_paging_edges.c - the paging authority at its edges: hostile policies,
 * waves, the minimum budget, prefetch safety and gating, preloading. */
#include <check.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "paging_helpers.h"
#include "qm_pager_trial.h"
#include "qm_policy_impl.h"
#include "qm_test_policies.h"
#include "sim.h"

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

/* A pager over the fixture's bank with `pol` at `budget`. */
static qm_pager *edge_pager(qm_policy *pol, uint64_t budget, const qm_pager_options *o,
                            qm_residency_plan **plan)
{
    *plan = make_plan(&fixture.bank, pol, 1, budget);
    qm_pager *pg = NULL;
    ck_assert_int_eq(qm_pager_new(fixture.cpu, fixture.bank.bank, *plan, pol, o, &pg, &fixture.st),
                     0);
    return pg;
}

/* Runs call c and checks its output bit for bit against the whole bank's. */
static void forward_same_bits(qm_pager *pg, const pg_call *c, size_t i)
{
    float out[8 * 64];
    qm_moe_call mc = {.layer = c->layer, .dtype = QM_DTYPE_F32, .hidden = c->x,
                      .n_tokens = c->T, .logits = c->logits, .output = out};
    qm_moe_stats ms = {0};
    ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &fixture.st), 0);
    ck_assert_msg(memcmp(out, c->ref, sizeof(float) * c->T * fixture.spec.hidden) == 0,
                  "call %zu's output changed", i);
}

START_TEST(test_hostile_victims_fall_back_to_lru_and_keep_accounting_and_outputs)
{
    pg_set set;
    make_calls(&fixture.bank, fixture.cpu, 30, 21, &set);
    for (uint64_t cap = 1; cap <= 6; cap++) {
        hostile *h = calloc(1, sizeof *h);
        qm_policy pol = {.iface = &hostile_iface, .ctx = h};
        uint64_t budget = cap * unit_bytes(&fixture.bank);
        qm_residency_plan *plan = NULL;
        qm_pager_options o = {.prefetch = (int)(cap % 2)};
        qm_pager *pg = edge_pager(&pol, budget, &o, &plan);
        g_budget = budget;
        qm_pager_set_alloc_hook(pg, budget_hook, NULL);
        for (size_t i = 0; i < set.n; i++)
            forward_same_bits(pg, &set.calls[i], i);
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
}
END_TEST

/* ---- A policy naming an expert in use --------------------------------------------------- */

/* Remembers the latest access (an expert the call holds while its wave
 * runs) and answers every victim choice by writing that expert into the
 * candidates and naming it. */
typedef struct in_use_namer {
    hostile base;
    qm_expert_ref last;
    int has_last;
    uint64_t named;
} in_use_namer;

static void namer_access(void *ctx, qm_expert_ref ref, uint64_t tick, int hit)
{
    (void)tick;
    (void)hit;
    in_use_namer *nm = ctx;
    nm->last = ref;
    nm->has_last = 1;
}

static int namer_choose(void *ctx, const qm_expert_ref *cand, size_t n, size_t *victim)
{
    in_use_namer *nm = ctx;
    if (!nm->has_last || n == 0)
        return -1;
    for (size_t i = 0; i < n; i++) {
        if (cand[i].bank == nm->last.bank && cand[i].expert == nm->last.expert) {
            *victim = i; /* a candidate after all: released, no longer in use */
            return 0;
        }
    }
    ((qm_expert_ref *)cand)[n - 1] = nm->last;
    *victim = n - 1;
    nm->named++;
    return 0;
}

static const qm_policy_iface namer_iface = {
    .version = QM_POLICY_IFACE_VERSION,
    .name = "in_use_namer",
    .decide = hostile_decide,
    .on_access = namer_access,
    .choose_victim = namer_choose,
    .destroy = hostile_destroy,
};

START_TEST(test_policy_naming_an_expert_in_use_is_overruled)
{
    pg_set set;
    make_calls(&fixture.bank, fixture.cpu, 40, 23, &set);
    for (int prefetch = 0; prefetch <= 1; prefetch++) {
        in_use_namer *nm = calloc(1, sizeof *nm);
        qm_policy pol = {.iface = &namer_iface, .ctx = nm};
        /* Room for one call's experts at once (one wave), so the experts a
         * call accessed stay resident until its own evictions are done. */
        uint64_t budget = (uint64_t)(8 * fixture.spec.k) * unit_bytes(&fixture.bank);
        qm_residency_plan *plan = NULL;
        qm_pager_options o = {.prefetch = prefetch, .no_preload = 1};
        qm_pager *pg = edge_pager(&pol, budget, &o, &plan);
        for (size_t i = 0; i < set.n; i++) {
            uint64_t named = nm->named;
            forward_same_bits(pg, &set.calls[i], i);
            if (prefetch || nm->named == named)
                continue;
            /* The expert it named was in use: still resident after the call. */
            uint32_t r[64];
            int nr = qm_pager_resident_experts(pg, nm->last.bank, r, 64);
            int found = 0;
            for (int j = 0; j < nr; j++)
                found |= r[j] == nm->last.expert;
            ck_assert_msg(found, "call %zu: expert %u of layer %u, in use, was evicted", i,
                          nm->last.expert, nm->last.bank);
        }
        qm_pager_stats s;
        qm_pager_stats_get(pg, &s);
        ck_assert_uint_gt(nm->named, 0);
        ck_assert_uint_eq(s.policy_fallbacks, nm->named); /* every such answer overruled */
        ck_assert_uint_le(s.resident_bytes, budget);
        qm_pager_free(pg);
        qm_plan_free(plan);
        qm_policy_destroy(&pol);
    }
    free_calls(&set);
}
END_TEST

/* ---- Claiming slots ------------------------------------------------------------------------ */

static int refusing_choose(void *ctx, const qm_expert_ref *cand, size_t n, size_t *victim)
{
    (void)ctx;
    (void)cand;
    (void)n;
    (void)victim;
    return -1; /* every victim falls back to the pager's LRU */
}

static const qm_policy_iface refusing_iface = {
    .version = QM_POLICY_IFACE_VERSION,
    .name = "refusing",
    .decide = hostile_decide,
    .choose_victim = refusing_choose,
    .destroy = hostile_destroy,
};

static qm_pager *claim_pager(const pf_bank *b, qm_backend *cpu, uint64_t slots, qm_policy *pol,
                             qm_residency_plan **plan)
{
    qm_status st = {0};
    pol->iface = &refusing_iface;
    pol->ctx = calloc(1, sizeof(hostile));
    *plan = make_plan(b, pol, 1, slots * unit_bytes(b));
    qm_pager_options o = {.no_preload = 1};
    qm_pager *pg = NULL;
    ck_assert_msg(qm_pager_new(cpu, b->bank, *plan, pol, &o, &pg, &st) == 0, "%s", st.msg);
    ck_assert_int_eq(qm_pager_layer_is_paged(pg, 1), 1);
    return pg;
}

static int acquire_one(qm_pager *pg, uint32_t e, qm_status *st)
{
    qm_expert_source *src = qm_pager_source(pg);
    qm_expert_weights w;
    size_t ready = 0;
    int rc = src->acquire(src->ctx, 1, &e, 1, &w, &ready, st);
    ck_assert(rc < 0 || ready == 1);
    return rc;
}

static void release_one(qm_pager *pg, uint32_t e)
{
    qm_expert_source *src = qm_pager_source(pg);
    src->release(src->ctx, 1, &e, 1);
}

static int is_resident(qm_pager *pg, uint32_t e)
{
    uint32_t r[8];
    int n = qm_pager_resident_experts(pg, 1, r, 8);
    for (int i = 0; i < n && i < 8; i++)
        if (r[i] == e)
            return 1;
    return 0;
}

/* A demand miss holds its slot until the wave is released; a prefetched
 * unit is held by nobody, so a demand miss may take its slot. */
START_TEST(test_demand_claims_are_held_until_release_prefetched_ones_are_not)
{
    qm_policy pol = {0};
    qm_residency_plan *plan;
    qm_pager *pg = claim_pager(&fixture.bank, fixture.cpu, 1, &pol, &plan);
    ck_assert_int_eq(acquire_one(pg, 1, &fixture.st), 0);
    ck_assert_int_eq(acquire_one(pg, 2, &fixture.st), QM_ERESOURCE_EXHAUSTED);
    ck_assert_msg(strstr(fixture.st.msg, "in use") != NULL, "%s", fixture.st.msg);
    ck_assert(is_resident(pg, 1));
    release_one(pg, 1);
    ck_assert_int_eq(acquire_one(pg, 2, &fixture.st), 0);
    release_one(pg, 2);
    uint32_t c = 3;
    ck_assert_int_eq(qm_pager_prefetch(pg, 1, &c, 1, &fixture.st), 1);
    ck_assert_int_eq(acquire_one(pg, 1, &fixture.st), 0); /* takes the prefetched unit's slot */
    ck_assert(is_resident(pg, 1) && !is_resident(pg, 3));
    release_one(pg, 1);
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.evictions, 3);
    ck_assert_uint_eq(s.prefetch_issued, 1);
    ck_assert_uint_eq(s.prefetch_useful, 0);
    ck_assert_uint_eq(s.resident_bytes, unit_bytes(&fixture.bank));
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
}
END_TEST

/* Every claim stamps the current tick, prefetches included: a unit
 * prefetched after an expert's last access is the more recent of the two
 * for the LRU fallback, whatever its slot was used for before. */
START_TEST(test_every_claim_stamps_the_current_tick)
{
    qm_policy pol = {0};
    qm_residency_plan *plan;
    qm_pager *pg = claim_pager(&fixture.bank, fixture.cpu, 2, &pol, &plan);
    const uint32_t A = 1, B = 2, C = 3, D = 4;
    ck_assert_int_eq(acquire_one(pg, A, &fixture.st), 0); /* slot 0, tick 0 */
    release_one(pg, A);
    ck_assert_int_eq(acquire_one(pg, B, &fixture.st), 0); /* slot 1, tick 1 */
    release_one(pg, B);
    ck_assert_int_eq(acquire_one(pg, A, &fixture.st), 0); /* a hit: tick 2 */
    release_one(pg, A);
    /* Evicts B (tick 1): C lands in slot 1 at tick 3. */
    ck_assert_int_eq(qm_pager_prefetch(pg, 1, &C, 1, &fixture.st), 1);
    ck_assert(is_resident(pg, A) && is_resident(pg, C) && !is_resident(pg, B));
    ck_assert_int_eq(acquire_one(pg, D, &fixture.st), 0); /* the LRU fallback: A (2) before C (3) */
    release_one(pg, D);
    ck_assert(is_resident(pg, C) && is_resident(pg, D) && !is_resident(pg, A));
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    ck_assert_uint_eq(s.policy_fallbacks, 2);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
}
END_TEST

/* ---- Waves and the minimum budget ------------------------------------------------------- */

START_TEST(test_budget_below_one_request_runs_in_waves_with_same_output)
{
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
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
    qm_expert_source_direct(fixture.bank.bank, &direct);
    qm_moe_call mc = {.layer = 1, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = T,
                      .logits = logits, .output = ref};
    qm_moe_stats ms = {0};
    ck_assert_int_eq(qm_moe_forward(fixture.cpu, fixture.bank.bank, &mc, &direct, &ms, &fixture.st),
                     0);
    for (uint64_t cap = 1; cap <= 3; cap++) {
        qm_policy pol = {0};
        ck_assert_int_eq(qm_policy_new("lru", NULL, &pol, &fixture.st), 0);
        qm_residency_plan *plan;
        qm_pager *pg =
            lru_pager(&fixture.bank, fixture.cpu, &pol, cap * unit_bytes(&fixture.bank), 1, &plan);
        mc.output = out;
        memset(&ms, 0, sizeof ms);
        ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &fixture.st), 0);
        ck_assert_msg(memcmp(out, ref, sizeof out) == 0, "waves changed the output (cap %llu)",
                      (unsigned long long)cap);
        qm_pager_stats ps;
        qm_pager_stats_get(pg, &ps);
        uint64_t rounds = (8 + cap - 1) / cap;
        ck_assert_uint_eq(ms.waves, rounds);
        ck_assert_uint_eq(ps.waves, rounds - 1);
        ck_assert_uint_eq(ps.misses, 8);
        ck_assert_uint_le(ps.resident_bytes, cap * unit_bytes(&fixture.bank));
        qm_pager_free(pg);
        qm_plan_free(plan);
        qm_policy_destroy(&pol);
    }
}
END_TEST

START_TEST(test_budget_below_one_expert_is_refused_naming_the_minimum)
{
    /* Every offered policy: one expert, or the whole model for whole_bank. */
    const char *names[QM_TEST_MAX_POLICIES];
    const size_t n = qm_test_policies(names, 0, NULL);
    uint64_t U = unit_bytes(&fixture.bank), mins[QM_TEST_MAX_POLICIES];
    for (size_t i = 0; i < n; i++)
        mins[i] = strcmp(names[i], "whole_bank") == 0
                      ? qm_bank_expert_bytes_total(fixture.bank.bank)
                      : U;
    for (size_t i = 0; i < n; i++) {
        qm_policy pol = {0};
        ck_assert_int_eq(qm_policy_new(names[i], NULL, &pol, &fixture.st), 0);
        qm_residency_plan *plan = make_plan(&fixture.bank, &pol, 1, mins[i] - 1);
        qm_pager *pg = (qm_pager *)&pol; /* must be reset to NULL */
        qm_status_clear(&fixture.st);
        int rc = qm_pager_new(fixture.cpu, fixture.bank.bank, plan, &pol, NULL, &pg, &fixture.st);
        ck_assert_int_eq(rc, QM_ERESOURCE_EXHAUSTED);
        ck_assert_ptr_null(pg);
        char num[32];
        snprintf(num, sizeof num, "%llu", (unsigned long long)mins[i]);
        ck_assert_msg(strstr(fixture.st.msg, num) != NULL, "message '%s' lacks the minimum %s",
                      fixture.st.msg, num);
        ck_assert_str_eq(fixture.st.field, "budget_bytes");
        uint64_t min = 0;
        ck_assert_int_eq(
            qm_pager_min_budget(fixture.cpu, fixture.bank.bank, plan, NULL, &min, &fixture.st), 0);
        ck_assert_uint_eq(min, mins[i]);
        qm_plan_free(plan);
        /* Exactly the minimum works. */
        plan = make_plan(&fixture.bank, &pol, 1, mins[i]);
        ck_assert_int_eq(
            qm_pager_new(fixture.cpu, fixture.bank.bank, plan, &pol, NULL, &pg, &fixture.st), 0);
        qm_pager_free(pg);
        qm_plan_free(plan);
        qm_policy_destroy(&pol);
    }
}
END_TEST

/* ---- Prefetch ------------------------------------------------------------------------------ */

/* n values drawn uniformly in [-1, 1) from `seed`. */
static void fill_uniform(float *x, size_t n, uint64_t seed)
{
    for (size_t i = 0; i < n; i++)
        x[i] = pf_uniform(&seed, -1, 1);
}

/* One call of mc through pg (asserted to succeed): the pager's stats after it. */
static qm_pager_stats forward_stats(qm_pager *pg, const qm_moe_call *mc)
{
    qm_moe_stats ms = {0};
    ck_assert_int_eq(qm_pager_forward(pg, mc, &ms, &fixture.st), 0);
    qm_pager_stats s;
    qm_pager_stats_get(pg, &s);
    return s;
}

START_TEST(test_router_prefetch_makes_next_layer_call_all_hits)
{
    qm_pager *pg = pg_fixture_lru_pager(4 * unit_bytes(&fixture.bank), 1);
    float x[32], out[32];
    fill_uniform(x, 32, 77);
    qm_moe_call mc = {.layer = 0, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = 1,
                      .output = out};
    qm_pager_stats a = forward_stats(pg, &mc);
    ck_assert_uint_eq(a.misses, fixture.spec.k);
    /* Layer 1's router on the same hidden state. */
    ck_assert_uint_eq(a.prefetch_issued, fixture.spec.k);
    mc.layer = 1; /* same hidden, routed by layer 1's own router: exactly the prediction */
    qm_pager_stats c = forward_stats(pg, &mc);
    ck_assert_uint_eq(c.misses, a.misses);
    ck_assert_uint_eq(c.hits, fixture.spec.k);
    ck_assert_uint_eq(c.prefetch_useful, fixture.spec.k);
}
END_TEST

/* With defer_prefetch (the daemon's), a forward call leaves its prefetch
 * for qm_pager_after_forward, which predicts from the hidden states the
 * call was given even after the caller reused its buffer; a forward that
 * comes first runs it itself. */
START_TEST(test_deferred_prefetch_runs_after_the_answer_from_the_calls_own_hidden_states)
{
    qm_policy pol = {0};
    ck_assert_int_eq(qm_policy_new("lru", NULL, &pol, &fixture.st), 0);
    qm_residency_plan *plan = make_plan(&fixture.bank, &pol, 1, 4 * unit_bytes(&fixture.bank));
    qm_pager_options o = {.prefetch = 1, .history = 1, .prefetch_min_precision = -1,
                          .no_preload = 1, .defer_prefetch = 1};
    qm_pager *pg = NULL;
    ck_assert_int_eq(qm_pager_new(fixture.cpu, fixture.bank.bank, plan, &pol, &o, &pg, &fixture.st),
                     0);
    const uint32_t k = fixture.spec.k;
    float x[32], x0[32], out[32];
    fill_uniform(x0, 32, 77);
    memcpy(x, x0, sizeof x);
    qm_moe_call mc = {.layer = 0, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = 1,
                      .output = out};
    qm_pager_stats a = forward_stats(pg, &mc);
    ck_assert_uint_eq(a.misses, k);
    ck_assert_uint_eq(a.prefetch_issued, 0); /* left for after the answer */
    fill_uniform(x, 32, 78);                 /* the caller reuses its buffer */
    qm_pager_after_forward(pg);
    qm_pager_stats b;
    qm_pager_stats_get(pg, &b);
    ck_assert_uint_eq(b.prefetch_issued, k);
    qm_pager_after_forward(pg); /* nothing left: nothing more */
    qm_pager_stats_get(pg, &b);
    ck_assert_uint_eq(b.prefetch_issued, k);
    /* Layer 1's router on the call's own hidden state: all hits. */
    memcpy(x, x0, sizeof x);
    mc.layer = 1;
    qm_pager_stats c = forward_stats(pg, &mc);
    ck_assert_uint_eq(c.misses, k);
    ck_assert_uint_eq(c.hits, k);
    /* Not run by the caller: the next forward runs it before its own. Layer
     * 1's call left layer 2's prediction; layer 2 with the same state hits. */
    mc.layer = 2;
    qm_pager_stats d = forward_stats(pg, &mc);
    ck_assert_uint_eq(d.prefetch_issued, 2 * k);
    ck_assert_uint_eq(d.misses, k);
    ck_assert_uint_eq(d.hits, 2 * k);
    qm_pager_free(pg); /* with layer 2's prefetch still left: dropped */
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
}
END_TEST

/* A session that has not missed for two tokens predicts with its routers
 * on probe calls only (their GEMVs would find what is resident), and again
 * on every call from the one after a miss. */
START_TEST(test_router_prediction_rests_while_nothing_misses)
{
    qm_pager *pg = pg_fixture_lru_pager(8 * unit_bytes(&fixture.bank), 1);
    const uint32_t L = fixture.spec.layers, k = fixture.spec.k;
    float x[32], out[32];
    fill_uniform(x, 32, 91);
    qm_moe_call mc = {.dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = 1, .output = out};
    qm_moe_stats ms = {0};
    qm_pager_stats a, b;
    /* Every layer routed by its own router on the same state: after the
     * first token all hit. */
    for (uint32_t t = 0; t < 3; t++)
        for (mc.layer = 0; mc.layer < L; mc.layer++)
            ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &fixture.st), 0);
    qm_pager_stats_get(pg, &a);
    const uint32_t calls = 40 * L;
    for (uint32_t t = 0; t < 40; t++)
        for (mc.layer = 0; mc.layer < L; mc.layer++)
            ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &fixture.st), 0);
    qm_pager_stats_get(pg, &b);
    ck_assert_uint_eq(b.misses, a.misses);
    uint64_t predicted = b.predict_router_predicted - a.predict_router_predicted;
    /* Probe calls only: one in 8 drawn, far below one prediction a call. */
    ck_assert_msg(predicted > 0 && predicted < (uint64_t)calls * k / 3,
                  "%llu experts predicted over %u quiet calls",
                  (unsigned long long)predicted, calls);
    /* A call that misses (another state: other experts), then the next
     * call predicts again. */
    float y[32];
    fill_uniform(y, 32, 92);
    mc.hidden = y;
    mc.layer = 0;
    uint64_t before = b.misses;
    for (int i = 0; i < 8 && b.misses == before; i++) {
        fill_uniform(y, 32, 93 + (uint64_t)i);
        ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &fixture.st), 0);
        qm_pager_stats_get(pg, &b);
    }
    ck_assert_uint_gt(b.misses, before);
    mc.layer = 1;
    ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &fixture.st), 0);
    qm_pager_stats c;
    qm_pager_stats_get(pg, &c);
    ck_assert_uint_ge(c.predict_router_predicted, b.predict_router_predicted + 1);
}
END_TEST

START_TEST(test_prefetch_never_evicts_pinned_or_in_use_experts)
{
    pg_set none = {0};
    qm_policy pol = {0};
    new_policy("static_hot", &fixture.bank, &none, &pol);
    uint64_t U = unit_bytes(&fixture.bank);
    /* pin_fraction 0.5 of 12 units over 3 listed banks: 2 pins per layer, 6 paging slots. */
    qm_residency_plan *plan = make_plan(&fixture.bank, &pol, 1, 12 * U);
    qm_pager_options o = {.prefetch = 1};
    qm_pager *pg = NULL;
    ck_assert_int_eq(qm_pager_new(fixture.cpu, fixture.bank.bank, plan, &pol, &o, &pg, &fixture.st),
                     0);
    qm_pager_stats s0;
    qm_pager_stats_get(pg, &s0);
    ck_assert_uint_eq(s0.n_pinned, 6);
    ck_assert_uint_eq(s0.n_slots, 12);
    qm_expert_source *src = qm_pager_source(pg);
    /* Hold six unpinned experts of layer 2 (hot list: 2, 5, 0, 3, ...: pins 2 and 5). */
    const uint32_t held[6] = {0, 1, 3, 4, 6, 7};
    qm_expert_weights w[6];
    size_t ready = 0;
    ck_assert_int_eq(src->acquire(src->ctx, 2, held, 6, w, &ready, &fixture.st), 0);
    ck_assert_uint_eq(ready, 6);
    const qm_layer_view *lv = qm_bank_layer(fixture.bank.bank, 2);
    uint64_t slice = qm_expert_slice_bytes(&lv->t[QM_T_FC1_WEIGHT], fixture.spec.experts);
    /* Every slot is pinned or in use: prefetch must find nothing to evict. */
    const uint32_t want[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    ck_assert_int_eq(qm_pager_prefetch(pg, 0, want, 8, &fixture.st), 0);
    ck_assert_int_eq(qm_pager_prefetch(pg, 1, want, 8, &fixture.st), 0);
    for (int i = 0; i < 6; i++)
        ck_assert_msg(memcmp(w[i].ptr[QM_T_FC1_WEIGHT],
                             (const uint8_t *)lv->t[QM_T_FC1_WEIGHT].data + held[i] * slice,
                             slice) == 0,
                      "held expert %u was overwritten", held[i]);
    src->release(src->ctx, 2, held, 6);
    /* Released: now prefetch may take their slots, never the pins. */
    ck_assert_int_eq(qm_pager_prefetch(pg, 0, want, 8, &fixture.st), 6);
    ck_assert_int_eq(qm_pager_sync(pg, &fixture.st), 0);
    for (uint32_t l = 0; l < fixture.spec.layers; l++) {
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
}
END_TEST

START_TEST(test_imprecise_router_prediction_is_switched_off)
{
    pf_spec sp = pf_default_spec();
    sp.experts = 32; /* random guesses of 2 in 32: precision ~1/16 */
    pg_fixture_reopen(&sp);
    qm_policy pol = {0};
    ck_assert_int_eq(qm_policy_new("lru", NULL, &pol, &fixture.st), 0);
    qm_residency_plan *plan = make_plan(&fixture.bank, &pol, 1, 8 * unit_bytes(&fixture.bank));
    qm_pager_options o = {.prefetch = 1};
    qm_pager *pg = NULL;
    ck_assert_int_eq(qm_pager_new(fixture.cpu, fixture.bank.bank, plan, &pol, &o, &pg, &fixture.st),
                     0);
    uint64_t s = 31;
    qm_pager_stats mid, ps;
    for (uint32_t i = 0; i < 600; i++) {
        /* Routed by random logits: the bank's routers predict nothing. */
        uint32_t ex[2] = {(uint32_t)(pf_rand(&s) % 16), 16 + (uint32_t)(pf_rand(&s) % 16)};
        call_experts(pg, &fixture.bank, i % sp.layers, ex, 2, &s);
        if (i == 299)
            qm_pager_stats_get(pg, &mid);
    }
    qm_pager_stats_get(pg, &ps);
    ck_assert_uint_gt(ps.prefetch_router_issued, 0); /* on until its first window */
    ck_assert_uint_lt(ps.prefetch_router_issued, 300);
    ck_assert_uint_lt(ps.prefetch_router_useful * 4, ps.prefetch_router_issued);
    ck_assert_uint_gt(ps.prefetch_gated, 300); /* off on most calls after the first window */
    ck_assert(ps.prefetch_sources_off & 1u);
    /* Probing continues (one call in eight is predicted and scored) but
     * fetches nothing while the source is off. */
    ck_assert_uint_ge(ps.predict_router_predicted, mid.predict_router_predicted + 32);
    ck_assert_uint_eq(ps.prefetch_router_issued, mid.prefetch_router_issued);
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
}
END_TEST

/* n forward calls of the fixture's bank, every one on hidden state x,
 * layers in turn from call `from`: the bank's routers route each layer the
 * same way every time. */
static void same_hidden_calls(qm_pager *pg, const float *x, uint32_t from, uint32_t n)
{
    float out[32];
    for (uint32_t i = from; i < from + n; i++) {
        qm_moe_call mc = {.layer = i % fixture.spec.layers, .dtype = QM_DTYPE_F32, .hidden = x,
                          .n_tokens = 1, .output = out};
        qm_moe_stats ms = {0};
        ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &fixture.st), 0);
    }
}

/* Each source is scored against the call it was about, resident or not:
 * with every call routed by the bank's routers on one hidden state, the
 * next layer's router and the lookahead (two calls ahead) are exact, and
 * the lookahead, off until measured, starts prefetching once a window says
 * so (with room for what it fetches: 6 units hold every layer's two
 * experts); with routing the routers do not predict, it stays off. */
START_TEST(test_prediction_is_measured_and_the_lookahead_earns_its_prefetch)
{
    float x[32];
    fill_uniform(x, 32, 5);
    qm_pager *pg = pg_fixture_lru_pager(6 * unit_bytes(&fixture.bank), 1);
    qm_pager_stats a;
    qm_pager_stats_get(pg, &a);
    ck_assert_uint_eq(a.prefetch_sources_off, 4); /* the lookahead, until measured */
    same_hidden_calls(pg, x, 0, 3 * 400);
    qm_pager_stats_get(pg, &a);
    ck_assert_uint_gt(a.predict_router_predicted, 0);
    ck_assert_uint_eq(a.predict_router_correct, a.predict_router_predicted);
    ck_assert_uint_eq(a.predict_router_actual, a.predict_router_correct);
    ck_assert_uint_eq(a.predict_lookahead_correct, a.predict_lookahead_predicted);
    ck_assert_uint_ge(a.predict_lookahead_predicted, 128); /* a full window */
    ck_assert_uint_eq(a.prefetch_sources_off, 0);
    ck_assert_uint_gt(a.predict_lookahead_gated, 0); /* off before its window */
}
END_TEST

/* A precise source whose prefetches are evicted before their call comes
 * (3 units for calls of 2 experts: the next layer's prefetch and its demand
 * take the lookahead's slots) wastes its reads: a window in which fewer
 * than half were used holds it off for 8 windows, precise as it is, and it
 * fetches nothing meanwhile. */
START_TEST(test_prefetches_evicted_before_use_hold_their_source_off)
{
    float x[32];
    fill_uniform(x, 32, 5);
    qm_pager *pg = pg_fixture_lru_pager(3 * unit_bytes(&fixture.bank), 1);
    same_hidden_calls(pg, x, 0, 3 * 400);
    qm_pager_stats a, b;
    qm_pager_stats_get(pg, &a);
    ck_assert_uint_eq(a.predict_lookahead_correct, a.predict_lookahead_predicted);
    ck_assert_uint_ge(a.prefetch_lookahead_issued, 16);
    ck_assert_uint_lt(2 * a.prefetch_lookahead_useful, a.prefetch_lookahead_issued);
    ck_assert(a.prefetch_sources_off & 4u);
    same_hidden_calls(pg, x, 3 * 400, 3 * 60);
    qm_pager_stats_get(pg, &b);
    ck_assert(b.prefetch_sources_off & 4u);
    ck_assert_uint_eq(b.prefetch_lookahead_issued, a.prefetch_lookahead_issued);
    ck_assert_uint_gt(b.predict_lookahead_predicted, a.predict_lookahead_predicted);
}
END_TEST

START_TEST(test_lookahead_the_routers_do_not_predict_stays_off)
{
    pf_spec sp = pf_default_spec();
    sp.experts = 32; /* random guesses of 2 in 32: precision ~1/16 */
    pg_fixture_reopen(&sp);
    uint64_t s = 9;
    qm_pager *pg = pg_fixture_lru_pager(3 * unit_bytes(&fixture.bank), 1);
    for (uint32_t i = 0; i < 600; i++) {
        /* Routed by random logits: the routers predict nothing. */
        uint32_t ex[2] = {(uint32_t)(pf_rand(&s) % 16), 16 + (uint32_t)(pf_rand(&s) % 16)};
        call_experts(pg, &fixture.bank, i % fixture.spec.layers, ex, 2, &s);
    }
    qm_pager_stats b;
    qm_pager_stats_get(pg, &b);
    ck_assert_uint_gt(b.predict_lookahead_predicted, 128);
    ck_assert_uint_lt(b.predict_lookahead_correct * 4, b.predict_lookahead_predicted);
    ck_assert_uint_eq(b.prefetch_lookahead_issued, 0);
    ck_assert(b.prefetch_sources_off & 4);
    /* measured the same way; the fixture's pager never gates the router */
    ck_assert_uint_lt(b.predict_router_correct * 4, b.predict_router_predicted);
}
END_TEST

START_TEST(test_budget_holding_every_expert_preloads_and_never_misses)
{
    pg_set set;
    make_calls(&fixture.bank, fixture.cpu, 12, 5, &set);
    uint64_t total = qm_bank_expert_bytes_total(fixture.bank.bank);
    for (int budgeted = 0; budgeted < 2; budgeted++) {
        qm_policy pol = {0};
        ck_assert_int_eq(qm_policy_new("lru", NULL, &pol, &fixture.st), 0);
        qm_residency_plan *plan = make_plan(&fixture.bank, &pol, budgeted, total);
        qm_pager *pg = NULL;
        ck_assert_int_eq(
            qm_pager_new(fixture.cpu, fixture.bank.bank, plan, &pol, NULL, &pg, &fixture.st), 0);
        qm_pager_stats s;
        qm_pager_stats_get(pg, &s);
        ck_assert_uint_eq(s.bytes_loaded_at_create, total);
        ck_assert_uint_eq(s.resident_bytes, total);
        float out[8 * 64];
        for (size_t i = 0; i < set.n; i++) {
            const pg_call *c = &set.calls[i];
            qm_moe_call mc = {.layer = c->layer, .dtype = QM_DTYPE_F32, .hidden = c->x,
                              .n_tokens = c->T, .logits = c->logits, .output = out};
            qm_moe_stats ms = {0};
            ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &fixture.st), 0);
            ck_assert(memcmp(out, c->ref, sizeof(float) * c->T * fixture.spec.hidden) == 0);
        }
        qm_pager_stats_get(pg, &s);
        ck_assert_uint_eq(s.misses, 0);
        ck_assert_uint_gt(s.hits, 0);
        ck_assert_uint_eq(s.bytes_paged_h2d, 0);
        ck_assert_uint_eq(s.evictions, 0);
        qm_pager_free(pg);
        qm_plan_free(plan);
        qm_policy_destroy(&pol);
    }
    free_calls(&set);
}
END_TEST

/* An lru pager of 4 units for the trace tests, and an empty file at
 * `path` (a mkstemp template) to record into. */
static qm_pager *trace_pager(qm_policy *pol, qm_residency_plan **plan, char *path)
{
    ck_assert_int_eq(qm_policy_new("lru", NULL, pol, &fixture.st), 0);
    qm_pager *pg =
        lru_pager(&fixture.bank, fixture.cpu, pol, 4 * unit_bytes(&fixture.bank), 1, plan);
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    return pg;
}

/* A trace stops at its file's bound (max_trace_bytes: a client's
 * record_trace must not fill the state dir's disk): the file holds the
 * whole tokens that fit and stays a valid trace, inference goes on, and a
 * trace gone on with that is at its bound already takes nothing more. */
START_TEST(test_recorded_trace_stops_at_its_bound)
{
    qm_policy pol = {0};
    qm_residency_plan *plan;
    char path[] = "/tmp/qm_trace_test.XXXXXX";
    qm_pager *pg = trace_pager(&pol, &plan, path);
    /* Unbounded first, to learn where rows start (3 layers x k 2 x 2 bytes
     * = 12 bytes a token). */
    ck_assert_int_eq(qm_pager_record_trace(pg, path, 0, 0, &fixture.st), 0);
    struct stat sb;
    ck_assert_int_eq(stat(path, &sb), 0);
    const uint64_t head = (uint64_t)sb.st_size, row = 3 * 2 * sizeof(int16_t);
    /* Room for 4 tokens and most of a fifth. */
    ck_assert_int_eq(qm_pager_record_trace(pg, path, 0, head + 4 * row + row - 1, &fixture.st), 0);
    uint64_t s = 7;
    for (uint32_t t = 0; t < 7; t++)
        for (uint32_t l = 0; l < 3; l++) {
            uint32_t ex[2] = {(t + l) % 8, (t + l + 3) % 8};
            call_experts(pg, &fixture.bank, l, ex, 2, &s);
        }
    qm_pager_stats ps;
    qm_pager_stats_get(pg, &ps);
    ck_assert_uint_eq(ps.trace_tokens, 4);
    ck_assert_uint_eq(ps.trace_full, 1);
    ck_assert_uint_eq(ps.trace_errors, 0);
    ck_assert_int_eq(stat(path, &sb), 0);
    ck_assert_uint_eq((uint64_t)sb.st_size, head + 4 * row);
    sim_trace tr;
    char err[256];
    ck_assert_msg(sim_trace_load(path, &tr, err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(tr.tokens, 4);
    for (uint32_t t = 0; t < 4; t++)
        for (uint32_t l = 0; l < 3; l++) {
            ck_assert_int_eq(tr.ids[(t * 3 + l) * 2], (int16_t)((t + l) % 8));
            ck_assert_int_eq(tr.ids[(t * 3 + l) * 2 + 1], (int16_t)((t + l + 3) % 8));
        }
    sim_trace_free(&tr);
    /* Gone on with under the same bound: full at once, the file as it was. */
    ck_assert_int_eq(qm_pager_record_trace(pg, path, 1, head + 4 * row + row - 1, &fixture.st), 1);
    qm_pager_stats_get(pg, &ps);
    ck_assert_uint_eq(ps.trace_full, 1);
    ck_assert_uint_eq(ps.trace_tokens, 4);
    uint32_t ex[2] = {1, 2};
    call_experts(pg, &fixture.bank, 0, ex, 2, &s);
    call_experts(pg, &fixture.bank, 1, ex, 2, &s);
    call_experts(pg, &fixture.bank, 2, ex, 2, &s);
    ck_assert_int_eq(stat(path, &sb), 0);
    ck_assert_uint_eq((uint64_t)sb.st_size, head + 4 * row);
    /* A larger bound goes on: one more token. */
    ck_assert_int_eq(qm_pager_record_trace(pg, path, 1, head + 5 * row, &fixture.st), 1);
    qm_pager_stats_get(pg, &ps);
    ck_assert_uint_eq(ps.trace_full, 0);
    for (uint32_t l = 0; l < 3; l++)
        call_experts(pg, &fixture.bank, l, ex, 2, &s);
    qm_pager_stats_get(pg, &ps);
    ck_assert_uint_eq(ps.trace_tokens, 5);
    ck_assert_uint_eq(ps.trace_full, 0);
    for (uint32_t l = 0; l < 3; l++)
        call_experts(pg, &fixture.bank, l, ex, 2, &s);
    qm_pager_stats_get(pg, &ps);
    ck_assert_uint_eq(ps.trace_tokens, 5);
    ck_assert_uint_eq(ps.trace_full, 1);
    ck_assert_int_eq(stat(path, &sb), 0);
    ck_assert_uint_eq((uint64_t)sb.st_size, head + 5 * row);
    qm_pager_free(pg);
    unlink(path);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
}
END_TEST

START_TEST(test_recorded_trace_holds_each_tokens_routing_in_layer_order)
{
    qm_policy pol = {0};
    qm_residency_plan *plan;
    char path[] = "/tmp/qm_trace_test.XXXXXX";
    qm_pager *pg = trace_pager(&pol, &plan, path);
    ck_assert_int_eq(qm_pager_record_trace(pg, path, 0, 0, &fixture.st), 0);
    uint64_t s = 1;
    /* Five decode tokens; token 2 of layer 1 has a single route (the other dropped). */
    int16_t want[10][3][2];
    for (uint32_t t = 0; t < 5; t++)
        for (uint32_t l = 0; l < 3; l++) {
            uint32_t ex[2] = {(t + l) % 8, (t + 2 * l + 3) % 8};
            if (ex[1] == ex[0])
                ex[1] = (ex[1] + 1) % 8;
            uint32_t n = (t == 2 && l == 1) ? 1 : 2;
            call_experts(pg, &fixture.bank, l, ex, n, &s);
            /* The route order is the router's: first expert, then the second (or -1). */
            want[t][l][0] = (int16_t)ex[0];
            want[t][l][1] = n == 2 ? (int16_t)ex[1] : -1;
        }
    /* Then a prefill of three tokens, layer by layer: rows complete only at layer 2. */
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    float x[3 * 32], logits[3 * 8], out[3 * 32];
    for (int i = 0; i < 3 * 32; i++)
        x[i] = pf_uniform(&s, -1, 1);
    for (uint32_t l = 0; l < 3; l++) {
        for (uint32_t t = 0; t < 3; t++) {
            uint32_t ex[2] = {t, 7 - l};
            pf_route_logits(cfg->experts, ex, 2, logits + t * cfg->experts);
            want[5 + t][l][0] = (int16_t)ex[0];
            want[5 + t][l][1] = (int16_t)ex[1];
        }
        qm_moe_call mc = {.layer = l, .dtype = QM_DTYPE_F32, .hidden = x, .n_tokens = 3,
                          .logits = logits, .output = out};
        qm_moe_stats ms = {0};
        ck_assert_int_eq(qm_pager_forward(pg, &mc, &ms, &fixture.st), 0);
        qm_pager_stats ps;
        qm_pager_stats_get(pg, &ps);
        ck_assert_uint_eq(ps.trace_tokens, l < 2 ? 5 : 8);
    }
    sim_trace tr;
    char err[256];
    ck_assert_msg(sim_trace_load(path, &tr, err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(tr.tokens, 8);
    ck_assert_uint_eq(tr.layers, 3);
    ck_assert_uint_eq(tr.k, 2);
    ck_assert_uint_eq(tr.experts, 8);
    for (uint32_t t = 0; t < 8; t++)
        for (uint32_t l = 0; l < 3; l++)
            for (uint32_t j = 0; j < 2; j++)
                ck_assert_msg(tr.ids[(t * 3 + l) * 2 + j] == want[t][l][j],
                              "token %u layer %u route %u: %d, want %d", t, l, j,
                              tr.ids[(t * 3 + l) * 2 + j], want[t][l][j]);
    sim_trace_free(&tr);
    qm_pager_stats ps;
    qm_pager_stats_get(pg, &ps);
    ck_assert_uint_eq(ps.trace_errors, 0);
    ck_assert_uint_eq(ps.trace_dropped, 0);
    /* Gone on with (a session re-created after a restart): a partial row
     * past the header's count (written before the count was) cut off, the
     * 8 rows kept, two more tokens after them. */
    int fd = open(path, O_WRONLY | O_APPEND);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, "\x01\x02\x03", 3), 3);
    close(fd);
    ck_assert_int_eq(qm_pager_record_trace(pg, path, 1, 0, &fixture.st), 1);
    qm_pager_stats_get(pg, &ps);
    ck_assert_uint_eq(ps.trace_tokens, 8);
    for (uint32_t t = 8; t < 10; t++)
        for (uint32_t l = 0; l < 3; l++) {
            uint32_t ex[2] = {t % 8, (t + l + 1) % 8};
            call_experts(pg, &fixture.bank, l, ex, 2, &s);
            want[t][l][0] = (int16_t)ex[0];
            want[t][l][1] = (int16_t)ex[1];
        }
    ck_assert_msg(sim_trace_load(path, &tr, err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(tr.tokens, 10);
    for (uint32_t t = 0; t < 10; t++)
        for (uint32_t l = 0; l < 3; l++)
            for (uint32_t j = 0; j < 2; j++)
                ck_assert_msg(tr.ids[(t * 3 + l) * 2 + j] == want[t][l][j],
                              "gone on with: token %u layer %u route %u: %d, want %d", t, l, j,
                              tr.ids[(t * 3 + l) * 2 + j], want[t][l][j]);
    sim_trace_free(&tr);
    /* A trace of another shape (16 experts) is not gone on with: started anew. */
    fd = open(path, O_RDWR);
    ck_assert_int_ge(fd, 0);
    uint32_t experts16 = 16;
    ck_assert_int_eq(pwrite(fd, &experts16, 4, 24), 4);
    close(fd);
    ck_assert_int_eq(qm_pager_record_trace(pg, path, 1, 0, &fixture.st), 0);
    qm_pager_stats_get(pg, &ps);
    ck_assert_uint_eq(ps.trace_tokens, 0);
    ck_assert_msg(sim_trace_load(path, &tr, err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(tr.tokens, 0);
    ck_assert_uint_eq(tr.experts, 8);
    sim_trace_free(&tr);
    ck_assert_int_eq(qm_pager_record_trace(pg, "/nonexistent-qm-dir/t.qmtr", 0, 0, &fixture.st), QM_EIO);
    /* A trace whose header cannot be written (a full disk; here a file
     * size limit) fails and leaves no file behind: a 0-byte .qmtr is no
     * trace, and a replay of the state dir's traces stumbled on it. */
    struct rlimit old_lim, small;
    ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &old_lim), 0);
    small = (struct rlimit){16, old_lim.rlim_max};
    signal(SIGXFSZ, SIG_IGN);
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &small), 0);
    ck_assert_int_eq(qm_pager_record_trace(pg, path, 0, 0, &fixture.st), QM_EIO);
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &old_lim), 0);
    ck_assert_msg(strstr(fixture.st.msg, "cannot write trace") != NULL, "%s", fixture.st.msg);
    ck_assert_int_eq(access(path, F_OK), -1);
    qm_pager_free(pg);
    unlink(path);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
}
END_TEST

/* ---- The prefetch trial (engine/pager/qm_pager_trial.h) ---- */

/* Runs n calls of the trial on a clock that advances by fetch_us or held_us
 * a call (by the mode the previous call left); every `every` calls (0:
 * never) adds an interruption that, were it timed, would make holding look
 * faster: while held, a prefill call of 512 tokens taking 10 ms (20 us a
 * token); while fetching, a 2 s pause before the call (pause). Returns the
 * calls that ran held; *decided_at: the calls at which the trial's first
 * decisions came (up to 4). */
static uint64_t trial_run(qm__pf_trial *t, uint32_t n, uint64_t fetch_us, uint64_t held_us,
                          uint32_t every, int pause, uint32_t *decided_at)
{
    uint64_t now = 1000000, held_calls = 0, seen = 0;
    int held = 0;
    for (uint32_t i = 0; i < n; i++) {
        now += held ? held_us : fetch_us;
        if (every && i % every == every - 1 && pause && !held)
            now += 2000000;
        if (every && i % every == every - 1 && !pause && held) {
            now += 10000;
            held = qm__pf_trial_call(t, 512, now);
            continue;
        }
        held = qm__pf_trial_call(t, 1, now);
        held_calls += (uint64_t)held;
        if (decided_at && t->decisions > seen && seen < 4)
            decided_at[seen++] = i;
    }
    return held_calls;
}

/* Timed faster without prefetch, the trial holds it from the start (two
 * tokens, then 32 windows of two tokens), measures (windows A B B A, held
 * first, a token left out after each switch), and keeps holding: measured
 * again less and less often. */
START_TEST(test_prefetch_trial_holds_prefetch_that_is_slower)
{
    qm__pf_trial t;
    qm__pf_trial_init(&t, 1, 8); /* 8 layers: windows of 16 calls */
    ck_assert_uint_eq(t.window_calls, 16);
    uint32_t at[4] = {0};
    uint64_t now = 1000000;
    for (uint32_t i = 0; i < 16 + 1 + 32 * 16; i++) /* held throughout, no decision yet */
        ck_assert_int_eq(qm__pf_trial_call(&t, 1, now += 200), 1);
    ck_assert_uint_eq(t.decisions, 0);
    qm__pf_trial_init(&t, 1, 8);
    uint64_t held = trial_run(&t, 20000, 200, 100, 0, 0, at);
    ck_assert_uint_ge(t.decisions, 3);
    ck_assert_uint_eq(t.decisions_held, t.decisions);
    ck_assert_uint_eq(t.ns_per_token[0], 200000);
    ck_assert_uint_eq(t.ns_per_token[1], 100000);
    /* The first decision: 16 calls held, 32 windows kept (1 + 32 x 16),
     * A (16), a token, B B, a token, A: at call 16 + 512 + 16 + 8 + 1 + 32
     * + 8 + 1 + 16. */
    ck_assert_uint_eq(at[0], 610);
    ck_assert_uint_gt(at[2] - at[1], at[1] - at[0]); /* measured less often */
    ck_assert_uint_gt(held, 20000 * 9 / 10);
}
END_TEST

/* Timed faster with prefetch, it is never held after the measurement
 * (held before it, for the first 66 tokens); a prefill or a pause (each
 * making holding look faster were it timed) restarts the window instead of
 * counting. */
START_TEST(test_prefetch_trial_keeps_prefetch_that_pays_and_times_only_decode)
{
    for (int variant = 0; variant < 3; variant++) {
        qm__pf_trial t;
        qm__pf_trial_init(&t, 1, 4); /* 4 layers: windows of the minimum, 16 calls */
        ck_assert_uint_eq(t.window_calls, QM__TRIAL_MIN_WINDOW_CALLS);
        uint64_t held = trial_run(&t, 20000, 100, 200, variant ? 40 : 0, variant == 2, NULL);
        ck_assert_msg(t.decisions >= 3, "variant %d: %llu decisions", variant,
                      (unsigned long long)t.decisions);
        ck_assert_msg(t.decisions_held == 0, "variant %d: held %llu times", variant,
                      (unsigned long long)t.decisions_held);
        /* The first tokens and the held windows of each measurement only. */
        ck_assert_uint_lt(held, 20000 / 10);
    }
    /* Within the margin: fetching wins. */
    qm__pf_trial t;
    qm__pf_trial_init(&t, 1, 8);
    trial_run(&t, 5000, 100, 99, 0, 0, NULL);
    ck_assert_uint_ge(t.decisions, 1);
    ck_assert_uint_eq(t.decisions_held, 0);
    /* Off: never held, nothing measured. */
    qm__pf_trial_init(&t, 0, 8);
    ck_assert_uint_eq(trial_run(&t, 5000, 200, 100, 0, 0, NULL), 0);
    ck_assert_uint_eq(t.decisions, 0);
}
END_TEST

/* In a pager: while the trial holds prefetch, nothing is read, the history
 * still predicts and is scored on every call and the router (a GEMV a call)
 * only on probe calls, each held call is counted, and bit 3 of
 * prefetch_sources_off says so; fetching comes with the first measurement.
 * Which mode wins depends on the clock; the order does not: from the
 * budget's first eviction, 2 tokens, 32 kept windows and window A are held
 * (2L + 33W calls), then a token and two windows (L + 2W + 1 calls, the
 * last switching back) fetch. */
START_TEST(test_prefetch_trial_in_the_pager_holds_reads_not_predictions)
{
    qm_policy pol = {0};
    ck_assert_int_eq(qm_policy_new("lru", NULL, &pol, &fixture.st), 0);
    qm_residency_plan *plan = make_plan(&fixture.bank, &pol, 1, 4 * unit_bytes(&fixture.bank));
    /* Never gated by precision: each call's prediction is fetched unless held. */
    qm_pager_options o = {.prefetch = 1, .prefetch_trial = 1, .prefetch_min_precision = -1};
    qm_pager *pg = NULL;
    ck_assert_int_eq(qm_pager_new(fixture.cpu, fixture.bank.bank, plan, &pol, &o, &pg, &fixture.st),
                     0);
    const uint32_t L = fixture.spec.layers, W = QM__TRIAL_MIN_WINDOW_CALLS; /* 3 layers */
    const uint32_t R = 2 * L + 33 * W; /* the held run */
    enum { N = 800 };
    static uint8_t held[N], bit[N];
    static uint64_t issued[N], predicted[N], history[N], held_total[N], decisions[N], evictions[N];
    uint64_t s = 5, held_before = 0;
    for (uint32_t i = 0; i < N; i++) {
        uint32_t ex[2] = {(uint32_t)(pf_rand(&s) % 4), 4 + (uint32_t)(pf_rand(&s) % 4)};
        call_experts(pg, &fixture.bank, i % L, ex, 2, &s);
        qm_pager_stats ps;
        qm_pager_stats_get(pg, &ps);
        held[i] = ps.prefetch_trial_held > held_before;
        held_before = ps.prefetch_trial_held;
        bit[i] = (ps.prefetch_sources_off & 8u) != 0;
        issued[i] = ps.prefetch_issued;
        predicted[i] = ps.predict_router_predicted;
        history[i] = ps.predict_history_predicted;
        held_total[i] = ps.prefetch_trial_held;
        decisions[i] = ps.prefetch_trial_decisions;
        evictions[i] = ps.evictions;
    }
    uint32_t h = 0;
    while (h < N && !held[h])
        h++;
    ck_assert_uint_gt(h, 0);
    ck_assert_uint_lt(h + R + L + 2 * W + L + W + 2, N);
    ck_assert_uint_eq(evictions[h - 1], 0); /* held from the budget's first eviction */
    ck_assert_uint_gt(evictions[h], 0);
    for (uint32_t i = h; i < h + R; i++) {
        ck_assert_msg(held[i] && bit[i], "call %u of the held run", i - h);
        ck_assert_uint_eq(issued[i], issued[h - 1]); /* nothing read */
    }
    ck_assert_uint_eq(decisions[h + R - 1], 0);
    /* The history scored on each held call; the router on a few only
     * (fetching, below, it predicts on every call: at least one expert each). */
    ck_assert_uint_ge(history[h + R - 1], history[h - 1] + R - 1);
    ck_assert_uint_lt(predicted[h + R - 1] - predicted[h - 1], R / 2);
    uint32_t after = h + R;
    ck_assert(!held[after] && !bit[after]);
    ck_assert_uint_gt(issued[after + L + W], issued[after - 1]); /* fetching */
    ck_assert_uint_ge(predicted[after + L + W] - predicted[after + W], L);
    ck_assert_uint_eq(held_total[after + L + 2 * W], R); /* the fetched run: nothing held */
    ck_assert_uint_eq(decisions[after + L + 2 * W], 0); /* the last A is not over */
    ck_assert_uint_eq(decisions[N - 1], 1);             /* it is now */
    qm_pager_free(pg);
    qm_plan_free(plan);
    qm_policy_destroy(&pol);
}
END_TEST

static void add_edge_tests(TCase *tc)
{
    tcase_add_test(tc, test_recorded_trace_holds_each_tokens_routing_in_layer_order);
    tcase_add_test(tc, test_recorded_trace_stops_at_its_bound);
    tcase_add_test(tc, test_budget_holding_every_expert_preloads_and_never_misses);
    tcase_add_test(tc, test_imprecise_router_prediction_is_switched_off);
    tcase_add_test(tc, test_policy_naming_an_expert_in_use_is_overruled);
    tcase_add_test(tc, test_prediction_is_measured_and_the_lookahead_earns_its_prefetch);
    tcase_add_test(tc, test_prefetches_evicted_before_use_hold_their_source_off);
    tcase_add_test(tc, test_lookahead_the_routers_do_not_predict_stays_off);
    tcase_add_test(tc, test_hostile_victims_fall_back_to_lru_and_keep_accounting_and_outputs);
    tcase_add_test(tc, test_demand_claims_are_held_until_release_prefetched_ones_are_not);
    tcase_add_test(tc, test_every_claim_stamps_the_current_tick);
    tcase_add_test(tc, test_budget_below_one_request_runs_in_waves_with_same_output);
    tcase_add_test(tc, test_budget_below_one_expert_is_refused_naming_the_minimum);
    tcase_add_test(tc, test_router_prefetch_makes_next_layer_call_all_hits);
    tcase_add_test(tc, test_router_prediction_rests_while_nothing_misses);
    tcase_add_test(tc, test_deferred_prefetch_runs_after_the_answer_from_the_calls_own_hidden_states);
    tcase_add_test(tc, test_prefetch_never_evicts_pinned_or_in_use_experts);
    tcase_add_test(tc, test_prefetch_trial_holds_prefetch_that_is_slower);
    tcase_add_test(tc, test_prefetch_trial_keeps_prefetch_that_pays_and_times_only_decode);
    tcase_add_test(tc, test_prefetch_trial_in_the_pager_holds_reads_not_predictions);
}

int main(void)
{
    Suite *s = suite_create("paging_edges");
    TCase *tc = tcase_create("edges");
    tcase_add_checked_fixture(tc, pg_fixture_setup, pg_fixture_teardown);
    tcase_set_timeout(tc, 120);
    add_edge_tests(tc);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
