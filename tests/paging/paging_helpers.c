/* paging_helpers.c - shared by the paging suites: random call sets with
 * whole-bank references, policies, plans, scripted calls, the budget hook. */
#include "paging_helpers.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint64_t g_budget;
uint64_t g_allocs;

void budget_hook(void *ud, uint64_t resident, uint64_t budget)
{
    (void)ud;
    g_allocs++;
    ck_assert_msg(resident <= budget, "resident %llu > budget %llu", (unsigned long long)resident,
                  (unsigned long long)budget);
    ck_assert_msg(resident <= g_budget, "resident %llu > test budget %llu",
                  (unsigned long long)resident, (unsigned long long)g_budget);
}

void uniq_sorted(const uint32_t *route, size_t n, uint32_t *out, size_t *n_out)
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
void make_calls(const pf_bank *b, qm_backend *cpu, size_t n, uint64_t seed, pg_set *set)
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

void free_calls(pg_set *set)
{
    for (size_t i = 0; i < set->n; i++) {
        free(set->calls[i].x);
        free(set->calls[i].logits);
        free(set->calls[i].ref);
    }
    free(set->calls);
    free(set->future);
}

uint64_t unit_bytes(const pf_bank *b)
{
    return qm_bank_layer(b->bank, 0)->bytes_per_expert;
}

/* Hottest-first lists: layer l lists experts (l + 3 i) mod E. */
uint32_t g_hot[8][64];
size_t g_hot_len[8];
const uint32_t *g_hot_ptr[8];

void new_policy(const char *name, const pf_bank *b, const pg_set *set, qm_policy *pol)
{
    qm_status st = {0};
    const qm_bank_config *cfg = qm_bank_get_config(b->bank);
    int rc;
    if (!strcmp(name, "belady")) {
        rc = qm_policy_belady_new(set->future, set->n_future, pol, &st);
    } else {
        qm_policy_params pp = {.version = QM_POLICY_PARAMS_VERSION};
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

qm_residency_plan *make_plan(const pf_bank *b, const qm_policy *pol, int has_budget,
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

qm_pager *lru_pager(const pf_bank *b, qm_backend *be, qm_policy *pol, uint64_t budget,
                           int prefetch, qm_residency_plan **plan)
{
    qm_status st = {0};
    *plan = make_plan(b, pol, 1, budget);
    /* No gating: the model does not gate prefetch sources; nor does the
     * trial hold them (it starts held: its own tests in test_paging_edges.c). */
    qm_pager_options o = {.prefetch = prefetch, .history = 1, .prefetch_min_precision = -1,
                          .no_preload = 1, .prefetch_trial = 2};
    qm_pager *pg = NULL;
    int rc = qm_pager_new(be, b->bank, *plan, pol, &o, &pg, &st);
    ck_assert_msg(rc == 0, "pager: %s", st.msg);
    return pg;
}

void call_experts(qm_pager *pg, const pf_bank *b, uint32_t layer, const uint32_t *ex,
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

pg_fixture fixture;

void pg_fixture_setup(void)
{
    memset(&fixture, 0, sizeof fixture);
    fixture.spec = pf_default_spec();
    pf_bank_open(&fixture.spec, &fixture.bank);
    int rc = qm_backend_cpu_new(1, &fixture.cpu, &fixture.st);
    ck_assert_msg(rc == 0, "cpu backend: %s", fixture.st.msg);
}

void pg_fixture_teardown(void)
{
    qm_pager_free(fixture.pager);
    qm_plan_free(fixture.plan);
    qm_policy_destroy(&fixture.pol);
    qm_backend_free(fixture.cpu);
    pf_bank_close(&fixture.bank);
    memset(&fixture, 0, sizeof fixture);
}

void pg_fixture_reopen(const pf_spec *spec)
{
    pf_bank_close(&fixture.bank);
    fixture.spec = *spec;
    pf_bank_open(&fixture.spec, &fixture.bank);
}

qm_pager *pg_fixture_lru_pager(uint64_t budget, int prefetch)
{
    ck_assert_msg(!fixture.pager, "one fixture pager per test");
    int rc = qm_policy_new("lru", NULL, &fixture.pol, &fixture.st);
    ck_assert_msg(rc == 0, "policy lru: %s", fixture.st.msg);
    fixture.pager = lru_pager(&fixture.bank, fixture.cpu, &fixture.pol, budget, prefetch,
                              &fixture.plan);
    return fixture.pager;
}

void free_two_devices(qm_multipager *mp, qm_placement *pl, qm_residency_plan *plan,
                      qm_policy *pol, qm_backend *dev[2])
{
    qm_multipager_free(mp);
    qm_placement_free(pl);
    qm_plan_free(plan);
    qm_policy_destroy(pol);
    qm_backend_free(dev[0]);
    qm_backend_free(dev[1]);
}

uint64_t pg_rss_anon(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[128];
    unsigned long long kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "RssAnon: %llu kB", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return (uint64_t)kb * 1024;
}

void pg_fixture_big_units(void)
{
    pf_spec big = pf_default_spec();
    big.hidden = 256;
    big.inter = 512;
    big.bits = 8;
    big.experts = 16;
    big.layers = 2;
    pg_fixture_reopen(&big);
    ck_assert_uint_ge(unit_bytes(&fixture.bank), 256 << 10); /* slots of many pages */
}

