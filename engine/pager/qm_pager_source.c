/* qm_pager_source.c - the pager's expert source: demand paging in waves.
 * acquire maps each requested expert to its slot (a hit), or claims a free
 * or evictable slot and copies it in (a miss), as many as fit at once, and
 * lands the wave's copies before handing out their pointers; release drops
 * the wave's holds. The policy sees every access; victims are its choice
 * (qm_pager_slots.c). */
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

static void qm__undo_round(qm_pager *p, size_t n_wave)
{
    for (size_t i = 0; i < n_wave; i++) {
        qm__slot *sl = &p->slots[p->wave_slots[i]];
        if (sl->refs)
            sl->refs--;
    }
}

static int qm__source_acquire(void *ctx, uint32_t layer, const uint32_t *experts, size_t n,
                              qm_expert_weights *weights, size_t *n_ready, qm_status *st)
{
    qm_pager *p = ctx;
    *n_ready = 0;
    if (layer >= p->n_layers)
        return qm_status_set(st, QM_EINVAL, "layer %u out of range (%u layers)", layer,
                             p->n_layers);
    qm__layer *L = &p->layers[layer];
    if (L->absent)
        return qm_status_set_field(st, QM_EINVAL, "layer",
                                   "layer %u is placed on another device", layer);
    for (size_t i = 0; i < n; i++)
        if (experts[i] >= L->n_experts)
            return qm_status_set(st, QM_EINVAL, "expert %u out of range (%u experts)",
                                 experts[i], L->n_experts);
    if (!L->paged) {
        for (size_t i = 0; i < n; i++)
            qm__fill_weights(L, NULL, experts[i], 0, &weights[i]);
        p->stats.whole_bank_accesses += n;
        *n_ready = n;
        return 0;
    }
    size_t i = 0, n_wave = 0;
    int rc = 0;
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
            sl->refs++;
            sl->last_use = p->tick++;
            p->wave_slots[n_wave++] = s;
            continue;
        }
        /* A miss: find room before telling the policy about the access, so a
         * round that must end here does not count the access twice. */
        s = qm__pager_free_slot(p);
        size_t nc = 0;
        if (s < 0) {
            nc = qm__collect_candidates(p, layer, experts + i, n - i, 1);
            if (nc == 0 && n_wave == 0)
                nc = qm__collect_candidates(p, layer, experts + i, n - i, 2);
            if (nc == 0)
                break; /* end of this wave */
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
        p->wave_slots[n_wave++] = s;
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
    /* Land the copies of this round (and prefetches it hit) before use;
     * the time spent waiting is the forward call's stall. */
    uint64_t t_stall = 0;
    for (size_t w = 0; rc == 0 && w < n_wave; w++) {
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
        /* Land whatever is still in flight, then drop what did not land; the
         * rest stays resident. */
        for (size_t w = 0; w < n_wave; w++) {
            int32_t s = p->wave_slots[w];
            if (p->slots[s].state == QM__SLOT_LOADING)
                (void)qm__pager_copy_wait(p, s, NULL);
            if (p->slots[s].state == QM__SLOT_LOADING) {
                p->slots[s].refs = 0;
                qm__pager_drop(p, s);
            }
        }
        qm__undo_round(p, n_wave);
        return rc;
    }
    if (i < n)
        p->stats.waves++;
    for (size_t w = 0; w < n_wave; w++) {
        int32_t s = p->wave_slots[w];
        qm__fill_weights(L, p->slots[s].base, p->slots[s].expert, 1, &weights[w]);
    }
    *n_ready = i;
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
        if (s >= 0 && p->slots[s].refs > 0)
            p->slots[s].refs--;
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
    p->source.release = qm__source_release;
}
