/* policy_sim.c - replays routing traces through the shipped residency policies
 * (their real run-time hooks, through the real planner) and Belady's MIN, at
 * budgets given as a share of all experts, and models prefetch.
 *
 * The cache model is the paging authority's, minus the bytes: one global pool
 * of equal slots per session, pins from the plan, the experts of the current
 * (token, layer) step in use and never evicted, hooks called in the
 * authority's order (on_access, then choose_victim + on_evict, then on_insert),
 * invalid victims replaced by LRU. Each step's experts are accessed in
 * ascending order, as qm_moe_forward asks for them.
 *
 *   policy_sim                         built-in trace matrix, Markdown tables
 *   policy_sim --trace FILE [...]      one trace: .qmtr, JSON lines or .npy (sim_readers.c)
 * Options: --tokens N --expert-mib M --predict-acc Q --seed S --quick --experts E
 *          --policies a,b --lfu-decay D --next-use-decay D --pin-fraction F --no-prefetch */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bench_util.h"
#include "qm_residency.h"
#include "sim.h"

/* ---- Trace ----------------------------------------------------------------------- */

void sim_trace_free(sim_trace *tr)
{
    if (tr)
        free(tr->ids);
}

/* Same model as tools/qmoe_trace.py (another random stream). */
int sim_trace_generate(sim_trace *tr, uint32_t tokens, uint32_t layers, uint32_t experts,
                       uint32_t k, double alpha, double locality, uint64_t seed)
{
    memset(tr, 0, sizeof *tr);
    tr->tokens = tokens;
    tr->layers = layers;
    tr->experts = experts;
    tr->k = k;
    tr->ids = malloc(sizeof(int16_t) * tokens * layers * k);
    uint32_t *perm = malloc(sizeof(uint32_t) * layers * experts);
    double *cum = malloc(sizeof(double) * layers * experts);
    if (!tr->ids || !perm || !cum) {
        free(perm);
        free(cum);
        return -1;
    }
    uint64_t s = seed * 0x2545f4914f6cdd1dull + 1;
    for (uint32_t l = 0; l < layers; l++) {
        uint32_t *p = perm + l * experts;
        for (uint32_t e = 0; e < experts; e++)
            p[e] = e;
        for (uint32_t e = experts; e > 1; e--) {
            uint32_t j = (uint32_t)(rng_next(&s) % e);
            uint32_t t = p[e - 1];
            p[e - 1] = p[j];
            p[j] = t;
        }
        double acc = 0;
        for (uint32_t r = 0; r < experts; r++) {
            acc += 1.0 / pow((double)(r + 1), alpha);
            cum[l * experts + r] = acc;
        }
    }
    for (uint32_t t = 0; t < tokens; t++) {
        for (uint32_t l = 0; l < layers; l++) {
            int16_t *row = tr->ids + ((size_t)t * layers + l) * k;
            if (t > 0 && rng_unif01(&s) < locality) {
                memcpy(row, row - (size_t)layers * k, sizeof(int16_t) * k);
                continue;
            }
            const double *c = cum + l * experts;
            for (uint32_t j = 0; j < k; j++) {
                for (int tries = 0;; tries++) {
                    double u = rng_unif01(&s) * c[experts - 1];
                    uint32_t lo = 0, hi = experts - 1;
                    while (lo < hi) {
                        uint32_t mid = (lo + hi) / 2;
                        if (c[mid] > u)
                            hi = mid;
                        else
                            lo = mid + 1;
                    }
                    uint32_t e = perm[l * experts + lo];
                    if (tries > 64)
                        e = perm[l * experts + (lo + tries) % experts];
                    int dup = 0;
                    for (uint32_t i = 0; i < j; i++)
                        dup |= row[i] == (int16_t)e;
                    if (!dup) {
                        row[j] = (int16_t)e;
                        break;
                    }
                }
            }
        }
    }
    free(perm);
    free(cum);
    return 0;
}

int sim_trace_load(const char *path, sim_trace *tr, char *err, size_t err_cap)
{
    memset(tr, 0, sizeof *tr);
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, err_cap, "%s: cannot open", path);
        return -1;
    }
    unsigned char h[40];
    uint32_t v[8];
    if (fread(h, 1, 40, f) != 40 || memcmp(h, "QMTRACE\0", 8)) {
        snprintf(err, err_cap, "%s: not a qmoe trace (bad magic or short)", path);
        fclose(f);
        return -1;
    }
    memcpy(v, h + 8, sizeof v); /* version tokens layers k experts flags meta_len reserved */
    if (v[0] != 1 || !v[2] || !v[3] || !v[4] || v[4] > 32767 || v[3] > v[4]) {
        snprintf(err, err_cap, "%s: unsupported version or shape", path);
        fclose(f);
        return -1;
    }
    uint64_t off = 40 + (uint64_t)v[6];
    off += (8 - off % 8) % 8;
    uint64_t n = (uint64_t)v[1] * v[2] * v[3];
    tr->tokens = v[1];
    tr->layers = v[2];
    tr->k = v[3];
    tr->experts = v[4];
    tr->ids = malloc(n * sizeof(int16_t) + 1);
    if (!tr->ids || fseek(f, (long)off, SEEK_SET) || fread(tr->ids, 2, n, f) != n) {
        snprintf(err, err_cap, "%s: truncated payload", path);
        fclose(f);
        sim_trace_free(tr);
        return -1;
    }
    fclose(f);
    for (uint64_t i = 0; i < n; i++) {
        if (tr->ids[i] < -1 || tr->ids[i] >= (int)tr->experts) {
            snprintf(err, err_cap, "%s: expert id %d out of range", path, tr->ids[i]);
            sim_trace_free(tr);
            return -1;
        }
    }
    return 0;
}

/* ---- The run ------------------------------------------------------------------------ */

/* Steps [t0, t1) as sorted distinct experts per (token, layer). */
static size_t step_experts(const sim_trace *tr, uint32_t t, uint32_t l, uint32_t *out)
{
    const int16_t *row = tr->ids + ((size_t)t * tr->layers + l) * tr->k;
    size_t n = 0;
    for (uint32_t j = 0; j < tr->k; j++) {
        if (row[j] < 0)
            continue;
        uint32_t e = (uint32_t)row[j];
        size_t i = n;
        int dup = 0;
        for (size_t q = 0; q < n; q++)
            dup |= out[q] == e;
        if (dup)
            continue;
        while (i > 0 && out[i - 1] > e) {
            out[i] = out[i - 1];
            i--;
        }
        out[i] = e;
        n++;
    }
    return n;
}

int sim_future(const sim_trace *tr, uint32_t t0, uint32_t t1, qm_expert_ref **out, size_t *n_out)
{
    size_t cap = (size_t)(t1 - t0) * tr->layers * tr->k, n = 0;
    qm_expert_ref *f = malloc(sizeof *f * (cap ? cap : 1));
    uint32_t ex[256];
    if (!f || tr->k > 256)
        return -1;
    for (uint32_t t = t0; t < t1; t++)
        for (uint32_t l = 0; l < tr->layers; l++) {
            size_t m = step_experts(tr, t, l, ex);
            for (size_t i = 0; i < m; i++)
                f[n++] = (qm_expert_ref){l, ex[i]};
        }
    *out = f;
    *n_out = n;
    return 0;
}

/* Slots are numbered like the authority's (lowest free first, a victim's
 * slot reused) so that candidates reach the policy in the same order: ties
 * (Belady's "never again", LRU fallback) then break the same way. Pins hold
 * slots of their own and are never candidates. */
typedef struct sim_cache {
    uint32_t L, E, cap, n_slots;
    uint8_t *resident, *pinned, *in_use, *prefetched, *predicted;
    uint64_t *last_use;
    uint32_t *slot_key; /* [n_slots] key or UINT32_MAX */
    uint32_t *key_slot; /* [keys] */
    uint32_t n_used, n_pinned;
    qm_expert_ref *cand;
    uint32_t *cand_key;
} sim_cache;

/* Evictable candidates: resident, unpinned, not in use by this round, not
 * protected (the rest of the step, or the prediction being prefetched). */
static uint32_t collect(sim_cache *c, const uint8_t *protect)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < c->n_slots; i++) {
        uint32_t key = c->slot_key[i];
        if (key == UINT32_MAX || c->in_use[key] || (protect && protect[key]))
            continue;
        c->cand[n] = (qm_expert_ref){key / c->E, key % c->E};
        c->cand_key[n++] = key;
    }
    return n;
}

static uint32_t choose(sim_cache *c, const qm_policy *pol, sim_result *r, uint32_t n)
{
    size_t v = SIZE_MAX;
    if (qm_policy_choose_victim(pol, c->cand, n, &v) == 0 && v < n)
        return c->cand_key[v];
    r->fallbacks++;
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (c->last_use[c->cand_key[i]] < c->last_use[c->cand_key[best]])
            best = i;
    return c->cand_key[best];
}

static void evict(sim_cache *c, const qm_policy *pol, uint32_t key)
{
    c->slot_key[c->key_slot[key]] = UINT32_MAX;
    c->n_used--;
    c->resident[key] = 0;
    c->prefetched[key] = 0;
    qm_policy_on_evict(pol, (qm_expert_ref){key / c->E, key % c->E});
}

static void insert(sim_cache *c, const qm_policy *pol, uint32_t key, uint64_t tick)
{
    uint32_t s = 0;
    while (c->slot_key[s] != UINT32_MAX)
        s++;
    c->slot_key[s] = key;
    c->key_slot[key] = s;
    c->n_used++;
    c->resident[key] = 1;
    c->last_use[key] = tick;
    qm_policy_on_insert(pol, (qm_expert_ref){key / c->E, key % c->E}, tick);
}

static int is_full(const sim_cache *c)
{
    return c->n_used >= c->n_slots;
}

int sim_run(const sim_trace *tr, uint32_t t0, uint32_t t1, uint32_t cap_slots,
            const qm_policy *pol, const uint8_t *pinned, const sim_prefetch *pf,
            sim_result *r)
{
    return sim_run_warm(tr, t0, t1, cap_slots, pol, pinned, pf, NULL, 0, r);
}

int sim_run_warm(const sim_trace *tr, uint32_t t0, uint32_t t1, uint32_t cap_slots,
                 const qm_policy *pol, const uint8_t *pinned, const sim_prefetch *pf,
                 const uint32_t *warm, size_t n_warm, sim_result *r)
{
    memset(r, 0, sizeof *r);
    sim_cache c = {.L = tr->layers, .E = tr->experts, .cap = cap_slots};
    size_t nk = (size_t)c.L * c.E;
    c.resident = calloc(nk, 1);
    c.pinned = calloc(nk, 1);
    c.in_use = calloc(nk, 1);
    c.prefetched = calloc(nk, 1);
    c.predicted = calloc(nk, 1);
    c.last_use = calloc(nk, sizeof *c.last_use);
    c.slot_key = malloc((cap_slots + 1) * sizeof *c.slot_key);
    c.key_slot = calloc(nk, sizeof *c.key_slot);
    c.cand = calloc(nk, sizeof *c.cand);
    c.cand_key = calloc(nk, sizeof *c.cand_key);
    uint32_t *ex = calloc(tr->k + 1, sizeof *ex), *nx = calloc(tr->k + 1, sizeof *nx);
    uint32_t *pred = calloc(2 * tr->k + 2, sizeof *pred);
    int rc = -1;
    if (!c.resident || !c.pinned || !c.in_use || !c.prefetched || !c.predicted || !c.last_use ||
        !c.slot_key || !c.key_slot || !c.cand || !c.cand_key || !ex || !nx || !pred)
        goto out;
    if (pinned) {
        memcpy(c.pinned, pinned, nk);
        for (size_t i = 0; i < nk; i++)
            c.n_pinned += pinned[i] != 0;
    }
    /* Pins are copied in at creation: fetches like any other. */
    r->preloaded = c.n_pinned;
    c.n_slots = c.cap > c.n_pinned ? c.cap - c.n_pinned : 0;
    for (uint32_t i = 0; i <= cap_slots; i++)
        c.slot_key[i] = UINT32_MAX;
    uint64_t tick = 0, seed = pf ? pf->seed : 1;
    /* A warm start: as qm_pager_warm loads one, in order, at the same tick. */
    for (size_t i = 0; i < n_warm && !is_full(&c); i++) {
        uint32_t key = warm[i];
        if (key >= nk || c.resident[key] || c.pinned[key])
            continue;
        insert(&c, pol, key, tick);
        r->warmed++;
    }
    for (uint32_t t = t0; t < t1; t++) {
        for (uint32_t l = 0; l < c.L; l++) {
            size_t m = step_experts(tr, t, l, ex);
            /* Rounds ("waves") exactly as the authority's acquire runs them. */
            size_t i = 0;
            while (i < m) {
                size_t n_wave = 0, start = i;
                for (size_t j = i; j < m; j++)
                    c.predicted[l * c.E + ex[j]] = 1; /* protect the rest of the step */
                for (; i < m; i++) {
                    uint32_t key = l * c.E + ex[i];
                    qm_expert_ref ref = {l, ex[i]};
                    c.predicted[key] = 0;
                    if (c.pinned[key]) {
                        r->hits++;
                        qm_policy_on_access(pol, ref, tick++, 1);
                        n_wave++;
                        continue;
                    }
                    if (c.resident[key]) {
                        r->hits++;
                        if (c.prefetched[key]) {
                            r->prefetch_useful++;
                            c.prefetched[key] = 0;
                        }
                        qm_policy_on_access(pol, ref, tick, 1);
                        c.last_use[key] = tick++;
                        c.in_use[key] = 1;
                        n_wave++;
                        continue;
                    }
                    uint32_t nc = 0;
                    if (is_full(&c)) {
                        nc = collect(&c, c.predicted);
                        if (nc == 0 && n_wave == 0)
                            nc = collect(&c, NULL);
                        if (nc == 0) {
                            c.predicted[key] = 1;
                            break;
                        }
                    }
                    r->misses++;
                    qm_policy_on_access(pol, ref, tick, 0);
                    if (nc) {
                        evict(&c, pol, choose(&c, pol, r, nc));
                        r->evictions++;
                    }
                    insert(&c, pol, key, tick++);
                    c.in_use[key] = 1;
                    n_wave++;
                }
                for (size_t j = start; j < m; j++) {
                    c.in_use[l * c.E + ex[j]] = 0;
                    c.predicted[l * c.E + ex[j]] = 0;
                }
                if (i < m)
                    r->waves++;
                if (i == start) {
                    r->uncached += m - i; /* cannot happen with >= 1 unpinned slot */
                    break;
                }
            }
            if (!pf || (!pf->history && pf->router_acc <= 0))
                continue;
            /* Prefetch for the next layer call, as the authority does after one. */
            uint32_t nl = (l + 1) % c.L, nt = l + 1 == c.L ? t + 1 : t;
            size_t np = 0;
            if (pf->router_acc > 0 && nt < tr->tokens) {
                /* Modelled next-layer router: each true expert is predicted
                 * with probability router_acc, else a uniformly random one. */
                size_t mn = step_experts(tr, nt, nl, nx);
                for (size_t q = 0; q < mn; q++)
                    pred[np++] = rng_unif01(&seed) < pf->router_acc
                                     ? nx[q]
                                     : (uint32_t)(rng_next(&seed) % c.E);
            }
            if (pf->history && nt > t0)
                np += step_experts(tr, nt - 1, nl, pred + np);
            for (size_t q = 0; q < np; q++)
                c.predicted[nl * c.E + pred[q]] = 1;
            for (size_t q = 0; q < np; q++) {
                uint32_t key = nl * c.E + pred[q];
                if (c.resident[key] || c.pinned[key])
                    continue;
                uint32_t nc = 0;
                if (is_full(&c)) {
                    nc = collect(&c, c.predicted);
                    if (nc == 0)
                        break;
                    evict(&c, pol, choose(&c, pol, r, nc));
                    r->evictions++;
                }
                insert(&c, pol, key, tick);
                c.prefetched[key] = 1;
                r->prefetch_issued++;
            }
            for (size_t q = 0; q < np; q++)
                c.predicted[nl * c.E + pred[q]] = 0;
        }
    }
    rc = 0;
out:
    free(c.resident);
    free(c.pinned);
    free(c.in_use);
    free(c.prefetched);
    free(c.predicted);
    free(c.last_use);
    free(c.slot_key);
    free(c.key_slot);
    free(c.cand);
    free(c.cand_key);
    free(ex);
    free(nx);
    free(pred);
    return rc;
}
