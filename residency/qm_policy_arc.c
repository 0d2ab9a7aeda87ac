/* qm_policy_arc.c - arc: Adaptive Replacement Cache (Megiddo & Modha, FAST
 * 2003), learning online between recency and frequency.
 *
 * Resident experts are in T1 (used once since they came in) or T2 (used
 * again); the ghosts of recent evictions are in B1 / B2. A miss on a B1
 * ghost means T1 was too small: the target size p of T1 grows; a miss on a
 * B2 ghost shrinks it. The victim is T1's least recent when |T1| > p (or
 * = p after a B2 ghost hit), else T2's, taken among the candidates the
 * paging authority offers (a list with none there gives way to the other).
 * "Least recent" is layer-aware, as in layered_lru: the expert whose
 * LRU-estimated next use (its bank's next visit + its bank's period per
 * visit it was skipped in) is furthest, so arc does not fall into the
 * cyclic pattern that takes plain LRU to 0% at small budgets.
 * The cache size c is what the policy sees resident (inserts - evictions).
 * Ghosts are the last c evictions, kept in a ring, so every hook is O(1)
 * expected and choose_victim O(n candidates). */
#include "qm_residency.h"
#include "qm_policy_impl.h"
#include "qm_residency_impl.h"

#include <math.h>

#include "qm_alloc.h"

/* An expert's list, in qm__ref_entry.clock. */
enum { ARC_NONE = 0, ARC_T1, ARC_T2, ARC_B1, ARC_B2, ARC_IN_T1, ARC_IN_T2 };

typedef struct arc_ghost {
    uint64_t key, seq;
} arc_ghost;

typedef struct arc_ctx {
    /* history, per expert: clock = list, last_tick = 1 + latest access
     * tick, visit = its bank's visit then, count = eviction sequence
     * number while a ghost. */
    qm__layered_base base;
    size_t t1, t2, b1, b2;
    double p;             /* target |T1| */
    int last_miss_b2;     /* the current miss hit a B2 ghost */
    uint64_t evict_seq;
    arc_ghost *ring;      /* the last evictions, oldest at head */
    size_t ring_cap, ring_head, ring_len;
} arc_ctx;

static void forget_ghost(arc_ctx *a, qm__ref_entry *e)
{
    if (e->clock == ARC_B1 && a->b1) a->b1--;
    if (e->clock == ARC_B2 && a->b2) a->b2--;
    e->clock = ARC_NONE;
}

static void arc_on_access(void *ctx, qm_expert_ref ref, uint64_t tick, int hit)
{
    arc_ctx *a = ctx;
    uint64_t visits =
        qm__layer_clock_access(&a->base.clock, &a->base.split.history, ref.bank, tick);
    qm__ref_entry *e = qm__ref_map_upsert(&a->base.split.history, qm__ref_key(ref));
    a->last_miss_b2 = 0;
    if (!e) return; /* no memory: the expert is treated as new */
    e->last_tick = qm__tick_stamp(tick);
    e->visit = visits;
    if (hit) {
        if (e->clock == ARC_T1) {
            e->clock = ARC_T2;
            a->t1--;
            a->t2++;
        }
        return; /* T2 stays; a pinned expert (never inserted) stays outside */
    }
    double c = (double)(a->t1 + a->t2);
    if (e->clock == ARC_B1) {
        double step = a->b1 && a->b2 > a->b1 ? (double)a->b2 / (double)a->b1 : 1.0;
        a->p = a->p + step < c ? a->p + step : c;
        forget_ghost(a, e);
        e->clock = ARC_IN_T2;
    } else if (e->clock == ARC_B2) {
        double step = a->b2 && a->b1 > a->b2 ? (double)a->b1 / (double)a->b2 : 1.0;
        a->p = a->p > step ? a->p - step : 0.0;
        forget_ghost(a, e);
        e->clock = ARC_IN_T2;
        a->last_miss_b2 = 1;
    } else if (e->clock != ARC_T1 && e->clock != ARC_T2) {
        e->clock = ARC_IN_T1;
    }
}

static void arc_on_insert(void *ctx, qm_expert_ref ref, uint64_t tick)
{
    arc_ctx *a = ctx;
    qm__ref_entry *e = qm__ref_map_upsert(&a->base.split.history, qm__ref_key(ref));
    if (!e) return;
    if (e->clock == ARC_T1 || e->clock == ARC_T2) return; /* already counted */
    forget_ghost(a, e); /* a prefetched ghost comes back as new */
    int to_t2 = e->clock == ARC_IN_T2;
    e->clock = to_t2 ? ARC_T2 : ARC_T1;
    if (to_t2)
        a->t2++;
    else
        a->t1++;
    if (e->last_tick == 0) e->last_tick = qm__tick_stamp(tick);
}

/* Keeps the ring at most c long (c = experts resident), dropping the oldest
 * ghosts; grows it as c grows (no memory: fewer ghosts). */
static void ring_push(arc_ctx *a, uint64_t key, uint64_t seq)
{
    size_t c = a->t1 + a->t2 + 1; /* the size before this eviction */
    if (a->ring_cap < c) {
        size_t cap = a->ring_cap ? 2 * a->ring_cap : 16;
        while (cap < c)
            cap *= 2;
        arc_ghost *grown = qm_malloc(cap * sizeof *grown);
        if (grown) {
            for (size_t i = 0; i < a->ring_len; i++)
                grown[i] = a->ring[(a->ring_head + i) % a->ring_cap];
            qm_free(a->ring);
            a->ring = grown;
            a->ring_cap = cap;
            a->ring_head = 0;
        }
    }
    if (a->ring_cap == 0) return;
    size_t keep = c < a->ring_cap ? c : a->ring_cap;
    while (a->ring_len >= keep && a->ring_len > 0) {
        arc_ghost old = a->ring[a->ring_head];
        a->ring_head = (a->ring_head + 1) % a->ring_cap;
        a->ring_len--;
        qm__ref_entry *g = qm__ref_map_find(&a->base.split.history, old.key);
        if (g && (g->clock == ARC_B1 || g->clock == ARC_B2) && (uint64_t)g->count == old.seq)
            forget_ghost(a, g);
    }
    a->ring[(a->ring_head + a->ring_len) % a->ring_cap] = (arc_ghost){key, seq};
    a->ring_len++;
}

static void arc_on_evict(void *ctx, qm_expert_ref ref)
{
    arc_ctx *a = ctx;
    uint64_t key = qm__ref_key(ref);
    qm__ref_entry *e = qm__ref_map_find(&a->base.split.history, key);
    if (!e || (e->clock != ARC_T1 && e->clock != ARC_T2)) return;
    if (e->clock == ARC_T1) {
        a->t1--;
        e->clock = ARC_B1;
        a->b1++;
    } else {
        a->t2--;
        e->clock = ARC_B2;
        a->b2++;
    }
    e->count = (double)++a->evict_seq;
    ring_push(a, key, a->evict_seq);
}

/* Within its list, the least recent (layer-aware) goes first; unknown
 * experts count as T1 and as never used. */
static double arc_rank(void *ctx, const qm__ref_entry *e, const qm__bank_phase *ph, int *list)
{
    (void)ctx;
    *list = e && e->clock == ARC_T2 ? 1 : 0;
    return e && e->visit ? qm__layered_next_use(ph, e->visit) : INFINITY;
}

static int arc_choose_victim(void *ctx, const qm_expert_ref *candidates, size_t n, size_t *victim)
{
    arc_ctx *a = ctx;
    size_t best[2];
    qm__victim_scan(&a->base.split.history, candidates, n, qm__layered_bank_phase, arc_rank, a,
                    best);
    double t1 = (double)a->t1;
    int from_t1 = a->t1 > 0 && (t1 > a->p || (a->last_miss_b2 && t1 == a->p));
    size_t pick = from_t1 ? best[0] : best[1];
    if (pick == n) pick = from_t1 ? best[1] : best[0];
    *victim = pick;
    return 0;
}

static void arc_destroy(void *ctx)
{
    arc_ctx *a = ctx;
    if (!a) return;
    qm_free(a->ring);
    qm__split_destroy(a); /* a starts with the split base */
}

QM__SPLIT_IFACE(arc_iface, "arc", .on_access = arc_on_access, .on_insert = arc_on_insert,
                .on_evict = arc_on_evict, .choose_victim = arc_choose_victim,
                .destroy = arc_destroy);

const qm__policy_desc qm__policy_arc_desc = {
    QM__POLICY_OFFERED(arc_iface, "Adaptive Replacement Cache: balances recency and frequency "
                                  "online from the ghosts of recent evictions"),
    .ctx_size = sizeof(arc_ctx),
};
