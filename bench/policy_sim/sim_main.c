/* sim_main.c - policy_sim's driver: traces x budgets x policies, Markdown out.
 * See policy_sim.c for the cache model and docs/BENCHMARKS.md, "Residency
 * against Belady", for results. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_hotness.h"
#include "qm_residency.h"
#include "sim.h"

typedef struct sim_opts {
    uint32_t tokens, experts; /* experts: of a .npy trace, 0 = largest id + 1 */
    double expert_mib;
    double predict_acc;
    double lfu_decay, pin_fraction, next_use_decay; /* < 0: the policy's default */
    double prior_weight;      /* next_use's prior_weight; < 0: its default */
    const char *profile_path; /* the profile from this trace (all of it), not the first half */
    uint64_t seed;
    int quick, no_prefetch, prefetch_all;
    int warm; /* replays start from the profile's hottest experts (warm_from_profile) */
    int no_prior; /* policies that take a prior do without the profile's */
} sim_opts;

/* belady first (the yardstick), then the policies compared: --policies, or
 * every policy the residency registry offers but the default (whole_bank,
 * which pages nothing), in registry order. */
static const char *k_policies[16] = {"belady"};
static int N_POLICIES = 1;

static void offered_policies(void)
{
    for (size_t i = 0; i < qm_policy_count() && N_POLICIES < 16; i++)
        if (qm_policy_offered_at(i) && strcmp(qm_policy_name_at(i), qm_policy_default_name()) != 0)
            k_policies[N_POLICIES++] = qm_policy_name_at(i);
}
static const double k_budgets[] = {0.10, 0.25, 0.50, 0.75};
enum { N_BUDGETS = 4 };

/* Pins come from the real planner: catalogs with one region per expert. */
static int plan_pins(const sim_trace *tr, const qm_policy *pol, uint64_t unit, uint64_t budget,
                     uint8_t *pinned)
{
    uint32_t L = tr->layers, E = tr->experts;
    qm_region_catalog **cats = calloc(L, sizeof *cats);
    qm_residency_plan *plan = NULL;
    int rc = -1;
    if (!cats)
        return -1;
    for (uint32_t l = 0; l < L; l++) {
        if (qm_catalog_new(l, E, &cats[l]))
            goto out;
        for (uint32_t e = 0; e < E; e++)
            if (qm_catalog_add_region(cats[l], e, (qm_region){0, (uint64_t)e * unit, unit}))
                goto out;
    }
    qm_plan_options po = {.has_budget = 1, .budget_bytes = budget};
    qm_status st;
    if (qm_plan_residency((const qm_region_catalog *const *)cats, L, pol, &po, &plan, &st)) {
        fprintf(stderr, "policy_sim: plan failed: %s\n", st.msg);
        goto out;
    }
    memset(pinned, 0, (size_t)L * E);
    for (size_t i = 0; i < qm_plan_total(plan); i++) {
        const qm_plan_bank *b = qm_plan_bank_at(plan, i);
        if (b->decision.kind != QM_DECISION_PER_EXPERT) {
            fprintf(stderr, "policy_sim: bank %u not split (%s)\n", b->bank_id, b->decision.detail);
            goto out;
        }
        for (size_t j = 0; j < b->decision.n_pinned; j++)
            pinned[(size_t)b->bank_id * E + b->decision.pinned[j]] = 1;
    }
    rc = 0;
out:
    qm_plan_free(plan);
    for (uint32_t l = 0; l < L; l++)
        qm_catalog_free(cats[l]);
    free(cats);
    return rc;
}

/* Hottest-first lists per layer from tokens [0, t1) (the "profile"): the
 * routing recorded into a hotness profile without decay, as the daemon
 * records a session's, and its lists as static_hot gets them. */
typedef struct hot_lists {
    qm_hotness *profile;
    qm_policy_params lists; /* hot, hot_len, n_hot_banks; prior, prior_len, n_prior_banks */
    uint32_t *warm;         /* keys of every profiled expert, hottest first across layers */
    size_t n_warm;
} hot_lists;

/* The warm start the daemon's warm_from_profile gives a new session
 * (qm_hotness_hottest_all, as daemon/qm_sessions.c's choose_profile_warm):
 * every expert the profile counted, hottest first across layers. */
static int make_warm(const sim_trace *tr, hot_lists *h)
{
    size_t nk = (size_t)tr->layers * tr->experts;
    uint32_t *layers = calloc(nk ? nk : 1, sizeof *layers);
    uint32_t *experts = calloc(nk ? nk : 1, sizeof *experts);
    h->warm = calloc(nk ? nk : 1, sizeof *h->warm);
    long n = layers && experts && h->warm
                 ? qm_hotness_hottest_all(h->profile, layers, experts, nk)
                 : -1;
    for (long i = 0; i < n; i++)
        h->warm[i] = layers[i] * tr->experts + experts[i];
    h->n_warm = n > 0 ? (size_t)n : 0;
    free(layers);
    free(experts);
    return n < 0 ? -1 : 0;
}

static int make_hot(const sim_trace *tr, uint32_t t1, hot_lists *h)
{
    qm_hotness_key key = {.layers = tr->layers, .experts = tr->experts};
    qm_status st;
    uint32_t *route = calloc(tr->k ? tr->k : 1, sizeof *route);
    int rc = route ? qm_hotness_new(&key, 1.0, &h->profile, &st) : -1;
    for (uint32_t t = 0; rc == 0 && t < t1; t++)
        for (uint32_t l = 0; l < tr->layers; l++) {
            size_t n = 0;
            for (uint32_t j = 0; j < tr->k; j++) {
                int16_t e = tr->ids[((size_t)t * tr->layers + l) * tr->k + j];
                if (e >= 0)
                    route[n++] = (uint32_t)e;
            }
            qm_hotness_record(h->profile, l, route, n);
        }
    if (rc == 0)
        rc = qm_hotness_policy_params(h->profile, &h->lists, &st);
    if (rc == 0)
        rc = qm_hotness_policy_prior(h->profile, &h->lists, &st);
    if (rc == 0)
        rc = make_warm(tr, h);
    free(route);
    return rc;
}

static const sim_opts *g_opts;

/* The profile a replay starts from: the first half of its own trace, or
 * all of --profile-trace (another session's routing of the same model). */
static int profile_of(const sim_trace *tr, hot_lists *h)
{
    if (!g_opts->profile_path)
        return make_hot(tr, tr->tokens / 2, h);
    sim_trace other;
    char err[256];
    if (sim_trace_load_any(g_opts->profile_path, tr->experts, &other, err, sizeof err)) {
        fprintf(stderr, "policy_sim: --profile-trace: %s\n", err);
        return -1;
    }
    int rc = -1;
    if (other.layers != tr->layers || other.experts != tr->experts)
        fprintf(stderr, "policy_sim: --profile-trace has %u layers x %u experts, the trace %u x %u\n",
                other.layers, other.experts, tr->layers, tr->experts);
    else
        rc = make_hot(&other, other.tokens, h);
    sim_trace_free(&other);
    return rc;
}

static void free_hot(hot_lists *h)
{
    qm_hotness_free(h->profile);
    free(h->warm);
}

static int new_policy(const char *name, const sim_trace *tr, uint32_t t0, uint32_t t1,
                      const hot_lists *hot, qm_policy *pol)
{
    qm_status st;
    if (!strcmp(name, "belady")) {
        qm_expert_ref *fut;
        size_t n;
        if (sim_future(tr, t0, t1, &fut, &n))
            return -1;
        int rc = qm_policy_belady_new(fut, n, pol, &st);
        free(fut);
        return rc;
    }
    qm_policy_value vals[2];
    qm_policy_params pp = {.version = QM_POLICY_PARAMS_VERSION, .values = vals};
    if (!strcmp(name, "lfu") && g_opts->lfu_decay >= 0)
        vals[pp.n_values++] = (qm_policy_value){"decay", g_opts->lfu_decay};
    if (!strcmp(name, "next_use") && g_opts->next_use_decay >= 0)
        vals[pp.n_values++] = (qm_policy_value){"decay", g_opts->next_use_decay};
    if (!strcmp(name, "next_use") && g_opts->prior_weight >= 0)
        vals[pp.n_values++] = (qm_policy_value){"prior_weight", g_opts->prior_weight};
    if (!strcmp(name, "static_hot")) {
        if (g_opts->pin_fraction >= 0)
            vals[pp.n_values++] = (qm_policy_value){"pin_fraction", g_opts->pin_fraction};
        pp.hot = hot->lists.hot;
        pp.hot_len = hot->lists.hot_len;
        pp.n_hot_banks = hot->lists.n_hot_banks;
    }
    /* The profile's frequencies, as the daemon gives a session the
     * model's persisted profile (daemon/qm_sessions.c). */
    if (qm_policy_accepts_prior(name) && !g_opts->no_prior) {
        pp.prior = hot->lists.prior;
        pp.prior_len = hot->lists.prior_len;
        pp.n_prior_banks = hot->lists.n_prior_banks;
        pp.prior_visits = hot->lists.prior_visits;
    }
    int rc = qm_policy_new(name, &pp, pol, &st);
    if (rc)
        fprintf(stderr, "policy_sim: %s: %s\n", name, st.msg);
    return rc;
}

/* One policy at one budget over the evaluation half. */
static int run_one(const char *name, const sim_trace *tr, uint32_t cap, uint64_t unit,
                   const hot_lists *hot, const sim_prefetch *pf, sim_result *r)
{
    uint32_t t0 = tr->tokens / 2, t1 = tr->tokens;
    qm_policy pol = {0};
    uint8_t *pinned = calloc((size_t)tr->layers * tr->experts, 1);
    int rc = -1;
    if (!pinned || new_policy(name, tr, t0, t1, hot, &pol))
        goto out;
    if (plan_pins(tr, &pol, unit, (uint64_t)cap * unit, pinned))
        goto out;
    rc = g_opts->warm ? sim_run_warm(tr, t0, t1, cap, &pol, pinned, pf, hot->warm, hot->n_warm, r)
                      : sim_run(tr, t0, t1, cap, &pol, pinned, pf, r);
    /* Count pin loads as fetches: each costs the hit of its first access. */
    r->hits -= r->preloaded < r->hits ? r->preloaded : r->hits;
    r->misses += r->preloaded;
out:
    qm_policy_destroy(&pol);
    free(pinned);
    return rc;
}

/* Hit rate of the best fixed set of `cap` experts for the replayed half,
 * chosen with hindsight: the ceiling of any frequency-based policy on a trace
 * without temporal structure. */
static double static_oracle(const sim_trace *tr, uint32_t cap)
{
    size_t nk = (size_t)tr->layers * tr->experts;
    uint64_t *cnt = calloc(nk, sizeof *cnt);
    uint32_t *order = malloc(nk * sizeof *order);
    if (!cnt || !order) {
        free(cnt);
        free(order);
        return 0;
    }
    qm_expert_ref *fut;
    size_t n;
    if (sim_future(tr, tr->tokens / 2, tr->tokens, &fut, &n)) {
        free(cnt);
        free(order);
        return 0;
    }
    for (size_t i = 0; i < n; i++)
        cnt[(size_t)fut[i].bank * tr->experts + fut[i].expert]++;
    for (size_t i = 0; i < nk; i++) {
        size_t j = i;
        while (j > 0 && cnt[order[j - 1]] < cnt[i]) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = (uint32_t)i;
    }
    uint64_t hits = 0;
    for (size_t i = 0; i < cap && i < nk; i++)
        hits += cnt[order[i]];
    double rate = n ? 100.0 * (double)hits / (double)n : 100.0;
    free(fut);
    free(cnt);
    free(order);
    return rate;
}

static uint32_t cap_of(const sim_trace *tr, double frac)
{
    uint32_t total = tr->layers * tr->experts;
    uint32_t cap = (uint32_t)floor(frac * total + 0.5);
    return cap < tr->k ? tr->k : cap;
}

static double pct(uint64_t a, uint64_t b)
{
    return b ? 100.0 * (double)a / (double)b : 100.0;
}

static int policy_table(const char *label, const sim_trace *tr, const sim_opts *o, double *worst50)
{
    hot_lists hot = {0};
    if (profile_of(tr, &hot))
        return -1;
    uint64_t unit = (uint64_t)(o->expert_mib * 1048576.0);
    for (int b = 0; b < N_BUDGETS; b++) {
        uint32_t cap = cap_of(tr, k_budgets[b]);
        sim_result res[16] = {{0}};
        for (int p = 0; p < N_POLICIES; p++)
            if (run_one(k_policies[p], tr, cap, unit, &hot, NULL, &res[p])) {
                free_hot(&hot);
                return -1;
            }
        uint64_t acc = res[0].hits + res[0].misses;
        int best = 1;
        for (int p = 2; p < N_POLICIES; p++)
            if (res[p].hits > res[best].hits)
                best = p;
        double best_frac = pct(res[best].hits, res[0].hits);
        if (b == 2 && best_frac < *worst50)
            *worst50 = best_frac;
        double gb = (double)res[best].misses * (double)unit / 1e9;
        printf("| %s | %.0f%% (%u) | %.1f | %.1f |", label, 100 * k_budgets[b], cap,
               pct(res[0].hits, acc), static_oracle(tr, cap));
        for (int p = 1; p < N_POLICIES; p++)
            printf(" %.1f (%.0f) |", pct(res[p].hits, acc), pct(res[p].hits, res[0].hits));
        printf(" %s %.1f%% | %.1f / %.1f | %.2f / %.2f |\n", k_policies[best], best_frac, gb,
               (double)res[0].misses * (double)unit / 1e9, gb / 25.0, gb / 55.0);
    }
    free_hot(&hot);
    return 0;
}

/* Misses without prefetch, with the history, the modelled router and both;
 * hits with prefetch against Belady's without (prefetch turns misses into
 * hits Belady's eviction alone cannot have). `--prefetch-all`: every
 * compared policy at every budget, else lru, lfu and next_use at 25% and 50%. */
static int prefetch_row(const char *label, const char *pol, const sim_trace *tr,
                        const sim_opts *o, double frac, const hot_lists *hot, double *worst_hist,
                        double *worst_router)
{
    uint64_t unit = (uint64_t)(o->expert_mib * 1048576.0);
    uint32_t cap = cap_of(tr, frac);
    sim_prefetch none = {0}, hist = {.history = 1, .seed = o->seed},
                 router = {.router_acc = o->predict_acc, .seed = o->seed},
                 both = {.history = 1, .router_acc = o->predict_acc, .seed = o->seed};
    sim_result r0, rh, rr, rb, rmin;
    if (run_one(pol, tr, cap, unit, hot, &none, &r0) ||
        run_one(pol, tr, cap, unit, hot, &hist, &rh) ||
        run_one(pol, tr, cap, unit, hot, &router, &rr) ||
        run_one(pol, tr, cap, unit, hot, &both, &rb) ||
        run_one("belady", tr, cap, unit, hot, &none, &rmin))
        return -1;
    double th = r0.misses ? 100.0 * ((double)r0.misses - (double)rh.misses) / r0.misses : 0;
    double tr_ = r0.misses ? 100.0 * ((double)r0.misses - (double)rr.misses) / r0.misses : 0;
    double tb = r0.misses ? 100.0 * ((double)r0.misses - (double)rb.misses) / r0.misses : 0;
    if (th < *worst_hist)
        *worst_hist = th;
    if (tb < *worst_router)
        *worst_router = tb;
    double gb0 = (double)r0.misses * unit / 1e9;
    double gbb = (double)(rb.misses + rb.prefetch_issued) * unit / 1e9;
    printf("| %s | %s | %.0f%% | %llu | %llu (%.1f%%) | %llu (%.1f%%) | %llu (%.1f%%) | "
           "%.1f%% | %.0f / %.0f / %.0f | %.1f -> %.1f |\n",
           label, pol, 100 * frac, (unsigned long long)r0.misses, (unsigned long long)rh.misses,
           th, (unsigned long long)rr.misses, tr_, (unsigned long long)rb.misses, tb,
           pct(rb.prefetch_useful, rb.prefetch_issued), pct(r0.hits, rmin.hits),
           pct(rh.hits, rmin.hits), pct(rb.hits, rmin.hits), gb0, gbb);
    return 0;
}

static int prefetch_table(const char *label, const sim_trace *tr, const sim_opts *o,
                          double *worst_hist, double *worst_router)
{
    hot_lists hot = {0};
    if (profile_of(tr, &hot))
        return -1;
    static const char *const few[] = {"lru", "lfu", "next_use"};
    static const double few_fr[] = {0.25, 0.50};
    const char *const *pols = o->prefetch_all ? k_policies + 1 : few;
    int n_pols = o->prefetch_all ? N_POLICIES - 1 : 3;
    const double *fr = o->prefetch_all ? k_budgets : few_fr;
    int n_fr = o->prefetch_all ? N_BUDGETS : 2;
    int rc = 0;
    for (int p = 0; p < n_pols && rc == 0; p++)
        for (int b = 0; b < n_fr && rc == 0; b++)
            rc = prefetch_row(label, pols[p], tr, o, fr[b], &hot, worst_hist, worst_router);
    free_hot(&hot);
    return rc;
}

static void usage(void)
{
    fprintf(stderr, "usage: policy_sim [--trace FILE.qmtr|.npy|.jsonl [--experts E]] [--tokens N] "
                    "[--expert-mib M] "
                    "[--predict-acc Q] [--lfu-decay D] [--next-use-decay D] [--pin-fraction F] "
                    "[--policies a,b,...] [--seed S] [--quick] [--no-prefetch] "
                    "[--prefetch-all] [--warm] [--no-prior] [--prior-weight W] [--profile-trace FILE]\n");
}

int main(int argc, char **argv)
{
    sim_opts o = {.tokens = 4000, .expert_mib = 84.0, .predict_acc = 0.85, .seed = 1,
                  .lfu_decay = -1, .pin_fraction = -1, .next_use_decay = -1, .prior_weight = -1};
    g_opts = &o;
    offered_policies();
    const char *trace_path = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--quick")) {
            o.quick = 1;
            continue;
        }
        if (!strcmp(a, "--warm")) { /* replays start as warm_from_profile starts a session */
            o.warm = 1;
            continue;
        }
        if (!strcmp(a, "--no-prior")) { /* next_use starts without the profile's frequencies */
            o.no_prior = 1;
            continue;
        }
        if (!strcmp(a, "--no-prefetch")) { /* only the policy table */
            o.no_prefetch = 1;
            continue;
        }
        if (!strcmp(a, "--prefetch-all")) { /* every policy and budget in the prefetch table */
            o.prefetch_all = 1;
            continue;
        }
        if (!v) {
            usage();
            return 2;
        }
        if (!strcmp(a, "--trace"))
            trace_path = v;
        else if (!strcmp(a, "--tokens"))
            o.tokens = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--expert-mib"))
            o.expert_mib = strtod(v, NULL);
        else if (!strcmp(a, "--predict-acc"))
            o.predict_acc = strtod(v, NULL);
        else if (!strcmp(a, "--lfu-decay"))
            o.lfu_decay = strtod(v, NULL);
        else if (!strcmp(a, "--experts"))
            o.experts = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--next-use-decay"))
            o.next_use_decay = strtod(v, NULL);
        else if (!strcmp(a, "--prior-weight"))
            o.prior_weight = strtod(v, NULL);
        else if (!strcmp(a, "--profile-trace"))
            o.profile_path = v;
        else if (!strcmp(a, "--policies")) {
            /* belady stays first: every column is measured against it */
            static char list[256];
            snprintf(list, sizeof list, "%s", v);
            N_POLICIES = 1;
            for (char *tok = strtok(list, ","); tok && N_POLICIES < 16; tok = strtok(NULL, ","))
                if (strcmp(tok, "belady") != 0) k_policies[N_POLICIES++] = tok;
            if (N_POLICIES < 2) {
                usage();
                return 2;
            }
        } else if (!strcmp(a, "--pin-fraction"))
            o.pin_fraction = strtod(v, NULL);
        else if (!strcmp(a, "--seed"))
            o.seed = strtoull(v, NULL, 10);
        else {
            usage();
            return 2;
        }
        i++;
    }
    if (o.quick)
        o.tokens = 400;
    char argv_decay[32], argv_pin[32];
    snprintf(argv_decay, sizeof argv_decay, "%g", o.lfu_decay);
    snprintf(argv_pin, sizeof argv_pin, "%g", o.pin_fraction);
    printf("policy_sim: tokens %u (the profile, of static_hot, next_use's prior and --warm: %s%s; "
           "the second half is replayed), "
           "expert unit %.1f MiB, modelled router prediction accuracy %.2f, lfu decay %s, "
           "static_hot pin_fraction %s, seed %llu; pin loads count as misses%s\n\n",
           o.tokens, o.profile_path ? "all of " : "the first half",
           o.profile_path ? o.profile_path : "", o.expert_mib, o.predict_acc,
           o.lfu_decay < 0 ? "default" : argv_decay,
           o.pin_fraction < 0 ? "default" : argv_pin, (unsigned long long)o.seed,
           o.warm ? "; every replay (Belady's too) starts from the profile's hottest experts "
                    "across layers, as warm_from_profile starts a session (not counted as misses)"
                  : "");
    char head[1024];
    size_t hl = (size_t)snprintf(head, sizeof head,
                                 "| trace | budget (slots) | belady hit%% | hindsight top-C hit%% |");
    for (int p = 1; p < N_POLICIES; p++)
        hl += (size_t)snprintf(head + hl, sizeof head - hl, " %s hit%% (%%MIN) |", k_policies[p]);
    hl += (size_t)snprintf(head + hl, sizeof head - hl,
                           " best shipped (%%MIN) | GB moved best / MIN | transfer s @25 / @55 GB/s "
                           "|\n|---|---|---|---|");
    for (int p = 1; p < N_POLICIES; p++)
        hl += (size_t)snprintf(head + hl, sizeof head - hl, "---|");
    snprintf(head + hl, sizeof head - hl, "---|---|---|\n");
    const char *phead = "| trace | policy | budget | misses, no prefetch | history prefetch "
                        "(misses -> hits) | router prefetch | both | useful/issued (both) | "
                        "hits %MIN: none / history / both | GB moved no pf -> both |\n"
                        "|---|---|---|---|---|---|---|---|---|---|\n";
    double worst50 = 1e9, wh = 1e9, wr = 1e9;
    if (trace_path) {
        sim_trace tr;
        char err[256];
        if (sim_trace_load_any(trace_path, o.experts, &tr, err, sizeof err)) {
            fprintf(stderr, "policy_sim: %s\n", err);
            return 1;
        }
        fputs(head, stdout);
        int rc = policy_table(trace_path, &tr, &o, &worst50);
        if (!o.no_prefetch) {
            printf("\n");
            fputs(phead, stdout);
            rc |= prefetch_table(trace_path, &tr, &o, &wh, &wr);
        }
        sim_trace_free(&tr);
        return rc ? 1 : 0;
    }
    struct shape {
        const char *name;
        uint32_t layers, experts, k;
    } shapes[] = {{"E8k2L32", 32, 8, 2}, {"E64k8L16", 16, 64, 8}};
    const double alphas[] = {0.0, 0.6, 1.0, 1.4};
    const double locs[] = {0.0, 0.5};
    fputs(head, stdout);
    double worst50_skewed = 1e9;
    for (size_t s = 0; s < 2; s++)
        for (size_t a = 0; a < 4; a++)
            for (size_t p = 0; p < 2; p++) {
                sim_trace tr;
                uint32_t tokens = shapes[s].experts > 8 ? o.tokens / 2 : o.tokens;
                if (sim_trace_generate(&tr, tokens, shapes[s].layers, shapes[s].experts,
                                       shapes[s].k, alphas[a], locs[p], o.seed + 17 * a + p))
                    return 1;
                char label[96];
                snprintf(label, sizeof label, "%s a=%.1f p=%.1f", shapes[s].name, alphas[a], locs[p]);
                double w = 1e9;
                if (policy_table(label, &tr, &o, &w)) {
                    sim_trace_free(&tr);
                    return 1;
                }
                if (alphas[a] >= 1.0 && w < worst50_skewed)
                    worst50_skewed = w;
                if (w < worst50)
                    worst50 = w;
                sim_trace_free(&tr);
                fflush(stdout);
            }
    printf("\nbest shipped policy at 50%% budget: worst %.1f%% of Belady's hits over skewed "
           "traces (alpha >= 1.0), %.1f%% over all (target >= 90%% on skewed)\n\n",
           worst50_skewed, worst50);
    fputs(phead, stdout);
    const double plocs[] = {0.3, 0.6, 0.9};
    for (size_t s = 0; s < 2; s++)
        for (size_t p = 0; p < 3; p++) {
            sim_trace tr;
            uint32_t tokens = shapes[s].experts > 8 ? o.tokens / 2 : o.tokens;
            if (sim_trace_generate(&tr, tokens, shapes[s].layers, shapes[s].experts, shapes[s].k,
                                   1.0, plocs[p], o.seed + 101 + p))
                return 1;
            char label[96];
            snprintf(label, sizeof label, "%s a=1.0 p=%.1f", shapes[s].name, plocs[p]);
            if (prefetch_table(label, &tr, &o, &wh, &wr)) {
                sim_trace_free(&tr);
                return 1;
            }
            sim_trace_free(&tr);
            fflush(stdout);
        }
    printf("\nprefetch on locality traces: worst %.1f%% of would-be misses turned into hits with "
           "history alone, %.1f%% with history + modelled router (target >= 30%%)\n",
           wh, wr);
    return 0;
}
