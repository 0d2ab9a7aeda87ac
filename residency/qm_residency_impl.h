/* qm_residency_impl.h - private to residency/: the (bank, expert) ->
 * history map the shipped policies' run-time hooks share, and their helpers
 * (the plug-in interface itself is qm_policy_impl.h). Not installed, not included outside this folder. */
#ifndef QM_RESIDENCY_IMPL_H
#define QM_RESIDENCY_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "qm_residency.h"
#include "qm_policy_impl.h"

/* The catalog's reason, set or computed, with a detail for computed ones
 * ("expert 3 has no region"). */
qm_nonpageable_reason qm__catalog_reason_ex(const qm_region_catalog *cat, char *detail,
                                            size_t detail_cap);

/* ---- (bank, expert) -> history, open addressing ------------------------- */

/* What a policy remembers about one key. The fields mean what the policy
 * using the map says (lru: last_tick; lfu: count at clock; belady: next use
 * in last_tick). */
typedef struct qm__ref_entry {
    uint64_t key;
    uint64_t last_tick;
    uint64_t clock;
    double count;
    uint64_t visit; /* layer-aware policies: its bank's visit number at its latest use */
    double aux;     /* next_use, per bank: summed reuse estimates of its latest visit */
    int used;
} qm__ref_entry;

typedef struct qm__ref_map {
    qm__ref_entry *slots;
    size_t cap; /* power of two, or 0 */
    size_t len;
} qm__ref_map;

/* A hostile caller could feed endless distinct refs; past this many keys the
 * map stops remembering new ones (ranking quality drops, nothing else). */
#define QM__REF_MAP_MAX_KEYS ((size_t)1 << 20)

static inline uint64_t qm__ref_key(qm_expert_ref ref)
{
    return ((uint64_t)ref.bank << 32) | ref.expert;
}
/* The key a policy uses for per-bank state (no expert has index UINT32_MAX:
 * expert indices are < a uint32 count). */
static inline uint64_t qm__bank_key(uint32_t bank)
{
    return ((uint64_t)bank << 32) | UINT32_MAX;
}

/* Makes room for `n` keys in total; 0 or QM_ENOMEM (map unchanged). */
int qm__ref_map_reserve(qm__ref_map *map, size_t n);
/* NULL when absent. */
qm__ref_entry *qm__ref_map_find(const qm__ref_map *map, uint64_t key);
/* The entry for key, added zeroed (but for key/used) when absent; NULL when
 * it cannot be added (no memory, or QM__REF_MAP_MAX_KEYS reached). */
qm__ref_entry *qm__ref_map_upsert(qm__ref_map *map, uint64_t key);
void qm__ref_map_free(qm__ref_map *map);

/* ---- Helpers of the shipped policies ------------------------------------- */

/* What every splitting policy keeps: run-time history and decide()'s answer.
 * A policy whose ctx starts with one uses qm__split_decide as its decide
 * method and qm__split_release in its destroy. */
typedef struct qm__split_base {
    qm__ref_map history;
    uint32_t *experts; /* decide()'s answer, valid until the next decide */
    size_t experts_cap;
} qm__split_base;

/* decide() of the splitting policies (ctx starts with a qm__split_base):
 * every expert of a pageable bank, history reserved for them. */
int qm__split_decide(void *ctx, const qm_policy_input *in, qm_residency_decision *out);
void qm__split_release(qm__split_base *base);
/* destroy() of a splitting policy: releases the qm__split_base its ctx
 * starts with, then the ctx (which owns nothing else, or has freed it).
 * Accepts NULL. */
void qm__split_destroy(void *ctx);
/* The members every splitting policy's iface has besides its hooks: the
 * interface version, its name and qm__split_decide. Last in the iface, so
 * clang-format keeps one member a line:
 *   static const qm_policy_iface lru_iface = {.on_access = ..., QM__SPLIT_POLICY("lru")}; */
#define QM__SPLIT_POLICY(policy_name)                                                              \
    .version = QM_POLICY_IFACE_VERSION, .name = (policy_name), .decide = qm__split_decide
/* VAR, the iface of the splitting policy POLICY_NAME whose hooks are the
 * designated members after it:
 *   QM__SPLIT_IFACE(lru_iface, "lru", .on_access = lru_on_access, ...); */
#define QM__SPLIT_IFACE(var, policy_name, ...)                                                     \
    static const qm_policy_iface var = {QM__SPLIT_POLICY(policy_name), __VA_ARGS__}
/* A zeroed ctx of `size` bytes for `iface`, installed in *out; NULL (with
 * "out of memory creating policy '<name>'" in st) when it cannot be had. */
void *qm__policy_alloc(const qm_policy_iface *iface, size_t size, qm_policy *out, qm_status *st);

/* The history stamp of an access at `tick`: 1 + tick (0 stays "never"),
 * saturating. */
static inline uint64_t qm__tick_stamp(uint64_t tick)
{
    return tick == UINT64_MAX ? tick : tick + 1;
}

/* Shared by the splitting policies: a per-expert decision listing every
 * expert of a pageable bank (whole-bank for a non-pageable one, so the
 * planner surfaces the catalog's reason). `*scratch` / `*scratch_cap` is the
 * policy's own buffer, grown as needed; it stays valid until the next call. */
int qm__decide_split_all(const qm_policy_input *in, uint32_t **scratch, size_t *scratch_cap,
                         qm_residency_decision *out);
/* Reserves history for a bank's experts so run-time hooks rarely allocate;
 * best effort (a failure only means the hooks allocate later). */
void qm__ref_map_reserve_bank(qm__ref_map *map, const qm_policy_input *in);

/* ---- Layer phase: when is a bank next visited? -------------------------- */

/* MoE routing visits the banks in a cycle (layer 0..L-1, then the next
 * token). The clock learns each bank's visit period from its own history
 * (per bank in the map, qm__bank_key: clock = visits so far, last_tick =
 * tick the latest visit started, count = smoothed ticks between visits), so
 * no visiting order is assumed. A visit starts when an access goes to
 * another bank than the one before. */
typedef struct qm__layer_clock {
    uint64_t now;      /* tick of the latest access */
    uint32_t cur_bank; /* the bank being visited */
    int has_cur;
    double period_all; /* smoothed period over every bank: for a bank seen once */
} qm__layer_clock;

/* Notes an access to `bank` at `tick`; returns the bank's visit number (0
 * when its entry cannot be kept: no memory). */
uint64_t qm__layer_clock_access(qm__layer_clock *lc, qm__ref_map *map, uint32_t bank,
                                uint64_t tick);

typedef struct qm__bank_phase {
    double until;    /* ticks until the bank's next visit (>= 0) */
    double period;   /* ticks between its visits (> 0) */
    uint64_t visits; /* its visits so far */
    int current;     /* it is the bank being visited */
} qm__bank_phase;

void qm__layer_clock_phase(const qm__layer_clock *lc, const qm__ref_map *map, uint32_t bank,
                           qm__bank_phase *out);
/* Visits of the bank an expert last used at visit `visit` has had since
 * without it (the visit in progress not counted). */
uint64_t qm__visits_since(const qm__bank_phase *ph, uint64_t visit);
/* Layered-LRU's estimate of the ticks until that expert is used again:
 * until + period * visits_since (recency counted in its own bank's visits). */
double qm__layered_next_use(const qm__bank_phase *ph, uint64_t visit);

/* ---- choose_victim: the scan every shipped ranking policy runs ----------- */

/* A candidate's rank as a victim, larger going first; `e` is its history
 * (NULL: never seen), `ph` what the bank callback left for its bank (zeroed
 * without one). Writes *list (0 or 1) for a policy that ranks two lists
 * apart (arc's T1 / T2); it is 0 unless written. */
typedef double (*qm__victim_rank_fn)(void *ctx, const qm__ref_entry *e, const qm__bank_phase *ph,
                                     int *list);
/* Optional: called before the first candidate and again whenever a
 * candidate's bank differs from the one before (candidates mostly share a
 * bank), to look up the per-bank state the ranks need. */
typedef void (*qm__victim_bank_fn)(void *ctx, uint32_t bank, qm__bank_phase *ph);

/* Per list, the candidate of the largest rank; equal ranks go to the least
 * recent (smallest last_tick, never seen counting as 0), then to the first.
 * best[list] is n for a list no candidate is in. Inline: it runs on every
 * miss, and a policy's constant bank and rank get inlined into its copy. */
static inline void qm__victim_scan(const qm__ref_map *history, const qm_expert_ref *candidates,
                                   size_t n, qm__victim_bank_fn bank, qm__victim_rank_fn rank,
                                   void *ctx, size_t best[2])
{
    double best_rank[2] = {0.0, 0.0};
    uint64_t best_tick[2] = {0, 0};
    qm__bank_phase ph = {0};
    best[0] = best[1] = n;
    for (size_t i = 0; i < n; i++) {
        if (bank && (i == 0 || candidates[i].bank != candidates[i - 1].bank))
            bank(ctx, candidates[i].bank, &ph);
        const qm__ref_entry *e = qm__ref_map_find(history, qm__ref_key(candidates[i]));
        int list = 0;
        double r = rank(ctx, e, &ph, &list);
        uint64_t t = e ? e->last_tick : 0;
        if (best[list] == n || r > best_rank[list] ||
            (r == best_rank[list] && t < best_tick[list])) {
            best[list] = i;
            best_rank[list] = r;
            best_tick[list] = t;
        }
    }
}

/* The scan of a policy that ranks one list: its pick (n > 0, so there is one). */
static inline size_t qm__victim_scan1(const qm__ref_map *history, const qm_expert_ref *candidates,
                                      size_t n, qm__victim_bank_fn bank, qm__victim_rank_fn rank,
                                      void *ctx)
{
    size_t best[2];
    qm__victim_scan(history, candidates, n, bank, rank, ctx, best);
    return best[0];
}

/* What the layer-aware policies (layered_lru, next_use, arc) start their
 * ctx with: the splitting base and the layer clock. */
typedef struct qm__layered_base {
    qm__split_base split;
    qm__layer_clock clock;
} qm__layered_base;

/* The bank callback of a layer-aware policy (ctx starts with a
 * qm__layered_base): the bank's phase. */
void qm__layered_bank_phase(void *ctx, uint32_t bank, qm__bank_phase *ph);

#endif
