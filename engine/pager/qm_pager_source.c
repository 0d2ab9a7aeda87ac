/* qm_pager_source.c - the pager's expert source: demand paging in rounds
 * (waves). A round maps each requested expert to its slot (a hit), or claims
 * a free or evictable slot and issues its copy (a miss), as many as fit at
 * once; every miss of the round is then in flight together. acquire_some
 * hands the round's experts out as they land (hits at once), so the forward
 * pass computes the resident experts while the misses are read; acquire
 * (the older contract) lands the whole round first. release drops the
 * holds. The policy sees every access, in request order; victims are its
 * choice (qm_pager_slots.c). */
#include "qm_pager_source.h"

#include "qm_clock.h"
#include "qm_pager_copy.h"
#include "qm_pager_prefetch.h"

static int qm__in_list(const uint32_t *list, size_t n, uint32_t e)
{
    /* `list` is ascending (the source's contract); a linear scan keeps this
     * correct even if a caller breaks that. */
    for (size_t i = 0; i < n; i++)
        if (list[i] == e)
            return 1;
    return 0;
}

/* Candidates for a demand miss. Tier 1 spares the experts this call still
 * needs (rest[0..n_rest)); tier 2 (only when nothing has been made ready in
 * this round) may take them, which costs a later miss but never correctness. */
static size_t qm__collect_candidates(qm_pager *p, uint32_t layer, const uint32_t *rest,
                                     size_t n_rest, int tier)
{
    size_t n = 0;
    for (uint32_t s = 0; s < p->n_slots; s++) {
        if (!qm__pager_evictable(p, (int32_t)s))
            continue;
        if (tier == 1 && p->slots[s].layer == layer &&
            qm__in_list(rest, n_rest, p->slots[s].expert))
            continue;
        p->cand_slots[n++] = (int32_t)s;
    }
    return n;
}

/* A prefetch for this call of `layer` still reading an expert the call did
 * not ask for guessed wrong: it is parked where it is (its chunks in flight
 * land, nothing more is issued), so the disk goes to this call's misses.
 * Its slot stays claimed: a later call that asks for the expert, or a
 * prediction that names it again, reads on from there; an eviction gives
 * the slot back without the rest (docs/PAGING.md, "The disk source"). */
static void qm__park_unasked(qm_pager *p, uint32_t layer, const uint32_t *experts, size_t n)
{
    if (p->opt.keep_unasked_prefetch)
        return;
    for (uint32_t s = 0; s < p->n_slots; s++) {
        const qm__slot *sl = &p->slots[s];
        if (sl->state != QM__SLOT_LOADING || !sl->prefetched || sl->layer != layer || sl->refs ||
            sl->parked || qm__in_list(experts, n, sl->expert))
            continue;
        if (qm__pager_copy_park(p, (int32_t)s)) {
            p->slots[s].parked = 1;
            p->stats.prefetch_parked++;
        }
    }
}

/* The experts of the round not handed out yet (wave_slots[0..wave_n))
 * leave it: their holds are dropped, and a slot whose copy failed or is
 * still loading is landed first, then given back. */
static void qm__abandon_round(qm_pager *p)
{
    for (size_t w = 0; w < p->wave_n; w++) {
        int32_t s = p->wave_slots[w];
        qm__slot *sl = &p->slots[s];
        sl->waiting = 0;
        if (sl->state == QM__SLOT_LOADING)
            (void)qm__pager_copy_wait(p, s, NULL);
        if (sl->state == QM__SLOT_LOADING) {
            sl->refs = 0;
            qm__pager_drop(p, s);
        } else if (sl->refs) {
            sl->refs--;
        }
    }
    p->wave_n = 0;
}

/* The layer of a request, after checking it: NULL with st set. */
static qm__layer *qm__request_layer(qm_pager *p, uint32_t layer, const uint32_t *experts,
                                    size_t n, qm_status *st)
{
    if (layer >= p->n_layers) {
        qm_status_set(st, QM_EINVAL, "layer %u out of range (%u layers)", layer, p->n_layers);
        return NULL;
    }
    qm__layer *L = &p->layers[layer];
    if (L->absent) {
        qm_status_set_field(st, QM_EINVAL, "layer", "layer %u is placed on another device", layer);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        if (experts[i] >= L->n_experts) {
            qm_status_set(st, QM_EINVAL, "expert %u out of range (%u experts)", experts[i],
                          L->n_experts);
            return NULL;
        }
    }
    return L;
}

/* One round: every requested expert it can hold at once, in order, is a
 * hit (held) or a miss (a slot claimed, its copy issued): wave_slots[0..
 * wave_n), each waiting. The policy's hooks run in request order whatever
 * the copies do, so counters never depend on timing. *claimed: how many of
 * experts[] the round took. On failure nothing stays held. */
static int qm__claim_round(qm_pager *p, uint32_t layer, const uint32_t *experts, size_t n,
                           size_t *claimed, qm_status *st)
{
    qm__layer *L = &p->layers[layer];
    size_t i = 0;
    int rc = 0;
    p->wave_n = 0;
    p->wave_layer = layer;
    for (; i < n; i++) {
        uint32_t e = experts[i];
        qm_expert_ref ref = {layer, e};
        int32_t s = L->slot_of[e];
        if (s >= 0) {
            qm__slot *sl = &p->slots[s];
            p->stats.hits++;
            qm_policy_on_access(p->policy, ref, p->tick, 1);
            if (sl->prefetched) {
                qm__pager_prefetch_useful(p, sl->prefetched);
                sl->prefetched = 0;
            }
            sl->parked = 0; /* asked for: read on (its promotion below) */
            if (sl->state == QM__SLOT_LOADING)
                qm__pager_copy_promote(p, s); /* a demand now: ahead of prefetches */
            sl->refs++;
            sl->last_use = p->tick++;
            sl->waiting = 1;
            p->wave_slots[p->wave_n++] = s;
            continue;
        }
        /* A miss: find room before telling the policy about the access, so a
         * round that must end here does not count the access twice. */
        s = qm__pager_free_slot(p);
        size_t nc = 0;
        if (s < 0) {
            nc = qm__collect_candidates(p, layer, experts + i, n - i, 1);
            if (nc == 0 && p->wave_n == 0)
                nc = qm__collect_candidates(p, layer, experts + i, n - i, 2);
            if (nc == 0)
                break; /* end of this round */
        }
        p->stats.misses++;
        qm_policy_on_access(p->policy, ref, p->tick, 0);
        if (s < 0) {
            s = qm__pager_pick_victim(p, nc);
            qm__pager_evict(p, s);
        }
        rc = qm__pager_claim(p, s, layer, e, QM__CLAIM_DEMAND, QM__PF_NONE, st);
        if (rc)
            break;
        p->tick++;
        p->slots[s].waiting = 1;
        p->wave_slots[p->wave_n++] = s;
        p->stats.bytes_paged_h2d += L->unit_bytes;
        rc = qm__pager_copy_unit(p, s, st);
        if (rc)
            break;
    }
    if (rc == 0 && i == 0 && n > 0)
        rc = qm_status_set(st, QM_ERESOURCE_EXHAUSTED,
                           "no slot can hold expert %u of layer %u: all %u slots are pinned or "
                           "in use",
                           experts[0], layer, p->n_slots);
    if (rc) {
        qm__abandon_round(p);
        return rc;
    }
    if (i < n)
        p->stats.waves++;
    *claimed = i;
    return 0;
}

/* Collects slot s's copy if it has landed (*ready 1) or is still in flight
 * (*ready 0). A read that failed fails the call, except for a unit a
 * prefetch claimed: no call asked for that read, so it is read again now,
 * on demand. */
static int qm__collect(qm_pager *p, int32_t s, int *ready, qm_status *st)
{
    qm__slot *sl = &p->slots[s];
    *ready = 0;
    if (sl->state != QM__SLOT_LOADING) {
        *ready = 1;
        return 0;
    }
    if (!qm__pager_copy_landed(p, s))
        return 0;
    int rc = qm__pager_copy_wait(p, s, st);
    if (rc && sl->by_prefetch) {
        sl->by_prefetch = 0;
        return qm__pager_copy_unit(p, s, st);
    }
    *ready = rc == 0;
    return rc;
}

/* Hands out the round's experts that have landed (waiting for one when
 * none has; every one with the serial engine, which computes nothing
 * before its misses are in), in landing order: ready_idx[j] their index in
 * experts[0..n), weights[j] their pointers. The time waited is the call's
 * stall. */
static int qm__hand_out(qm_pager *p, const uint32_t *experts, size_t n, size_t *ready_idx,
                        qm_expert_weights *weights, size_t *n_ready, qm_status *st)
{
    const int all = p->opt.io_engine == QM_PAGER_IO_SERIAL && p->disk;
    uint64_t t_stall = 0;
    size_t got = 0;
    int rc = 0;
    for (;;) {
        size_t loading = 0;
        for (size_t w = 0; w < p->wave_n && rc == 0; w++) {
            int ready = 0;
            rc = qm__collect(p, p->wave_slots[w], &ready, st);
            loading += !ready;
        }
        if (rc)
            break;
        if (loading == 0 || (!all && loading < p->wave_n))
            break;
        if (!t_stall)
            t_stall = qm__now_us();
        /* The slots still loading, first: wait for one of them. */
        size_t k = 0;
        for (size_t w = 0; w < p->wave_n; w++)
            if (p->slots[p->wave_slots[w]].state == QM__SLOT_LOADING)
                p->cand_slots[k++] = p->wave_slots[w];
        qm__pager_copy_wait_any(p, p->cand_slots, k);
    }
    if (t_stall)
        p->stats.stall_us += qm__now_us() - t_stall;
    if (rc) {
        qm__abandon_round(p);
        return rc;
    }
    size_t keep = 0;
    for (size_t w = 0; w < p->wave_n; w++) {
        int32_t s = p->wave_slots[w];
        qm__slot *sl = &p->slots[s];
        if (sl->state == QM__SLOT_LOADING) {
            p->wave_slots[keep++] = s;
            continue;
        }
        size_t j = 0;
        while (j < n && experts[j] != sl->expert)
            j++;
        sl->waiting = 0;
        if (j == n) { /* no longer asked for (the caller broke the contract): let it go */
            if (sl->refs)
                sl->refs--;
            continue;
        }
        ready_idx[got] = j;
        qm__pager_slot_weights(p, s, &weights[got]);
        got++;
    }
    p->wave_n = (uint32_t)keep;
    *n_ready = got;
    return 0;
}

/* (the expert source's acquire_some) A round of experts[0..n) claimed when
 * the last one is all handed out; then what has landed. */
static int qm__source_acquire_some(void *ctx, uint32_t layer, const uint32_t *experts, size_t n,
                                   size_t *ready_idx, qm_expert_weights *weights, size_t *n_ready,
                                   qm_status *st)
{
    qm_pager *p = ctx;
    *n_ready = 0;
    qm__layer *L = qm__request_layer(p, layer, experts, n, st);
    if (!L)
        return QM_EINVAL;
    if (!L->paged) {
        for (size_t i = 0; i < n; i++) {
            qm__fill_weights(L, NULL, experts[i], 0, &weights[i]);
            ready_idx[i] = i;
        }
        p->stats.whole_bank_accesses += n;
        *n_ready = n;
        return 1;
    }
    if (p->wave_n && p->wave_layer != layer)
        qm__abandon_round(p); /* a call that ended without releasing */
    int started = 0;
    if (p->wave_n == 0 && n > 0) {
        qm__park_unasked(p, layer, experts, n); /* later rounds: no prefetched slot was asked */
        size_t claimed = 0;
        int rc = qm__claim_round(p, layer, experts, n, &claimed, st);
        if (rc)
            return rc;
        started = 1;
    }
    int rc = qm__hand_out(p, experts, n, ready_idx, weights, n_ready, st);
    return rc ? rc : started;
}

/* (the expert source's acquire) One round, every copy of it landed before
 * it returns, in request order. */
static int qm__source_acquire(void *ctx, uint32_t layer, const uint32_t *experts, size_t n,
                              qm_expert_weights *weights, size_t *n_ready, qm_status *st)
{
    qm_pager *p = ctx;
    *n_ready = 0;
    qm__layer *L = qm__request_layer(p, layer, experts, n, st);
    if (!L)
        return QM_EINVAL;
    if (!L->paged) {
        for (size_t i = 0; i < n; i++)
            qm__fill_weights(L, NULL, experts[i], 0, &weights[i]);
        p->stats.whole_bank_accesses += n;
        *n_ready = n;
        return 0;
    }
    if (p->wave_n)
        qm__abandon_round(p);
    qm__park_unasked(p, layer, experts, n);
    size_t claimed = 0;
    int rc = qm__claim_round(p, layer, experts, n, &claimed, st);
    uint64_t t_stall = 0;
    for (size_t w = 0; rc == 0 && w < p->wave_n; w++) {
        int32_t s = p->wave_slots[w];
        if (p->slots[s].state != QM__SLOT_LOADING)
            continue;
        if (!t_stall)
            t_stall = qm__now_us();
        rc = qm__pager_copy_wait(p, s, st);
    }
    if (t_stall)
        p->stats.stall_us += qm__now_us() - t_stall;
    if (rc) {
        if (p->wave_n)
            qm__abandon_round(p);
        return rc;
    }
    for (size_t w = 0; w < p->wave_n; w++) {
        qm__slot *sl = &p->slots[p->wave_slots[w]];
        sl->waiting = 0;
        qm__pager_slot_weights(p, p->wave_slots[w], &weights[w]);
    }
    p->wave_n = 0;
    *n_ready = claimed;
    return 0;
}

static void qm__source_release(void *ctx, uint32_t layer, const uint32_t *experts, size_t n)
{
    qm_pager *p = ctx;
    if (layer >= p->n_layers || !p->layers[layer].paged)
        return;
    qm__layer *L = &p->layers[layer];
    for (size_t i = 0; i < n; i++) {
        if (experts[i] >= L->n_experts)
            continue;
        int32_t s = L->slot_of[experts[i]];
        if (s < 0)
            continue;
        qm__slot *sl = &p->slots[s];
        if (sl->waiting) {
            /* Released before it was handed out (a call that ended early):
             * it leaves the round; a copy in flight lands as a prefetch would. */
            sl->waiting = 0;
            size_t k = 0;
            for (size_t w = 0; w < p->wave_n; w++)
                if (p->wave_slots[w] != s)
                    p->wave_slots[k++] = p->wave_slots[w];
            p->wave_n = (uint32_t)k;
        }
        if (sl->refs > 0)
            sl->refs--;
    }
}

qm_expert_source *qm_pager_source(qm_pager *p)
{
    return p ? &p->source : NULL;
}

void qm__pager_source_init(qm_pager *p)
{
    p->source.version = QM_EXPERT_SOURCE_VERSION;
    p->source.ctx = p;
    p->source.acquire = qm__source_acquire;
    p->source.acquire_some = qm__source_acquire_some;
    p->source.release = qm__source_release;
}
