/* qm_pager_slots.c - the bottom of the pager: slot claims, exact accounting
 * against the budget, and the choice of victims (the policy's answer,
 * validated, else LRU). It copies nothing and waits for nothing: the copy
 * path (qm_pager_copy.c) sits above it. */
#include <string.h>

#include "qm_alloc.h"
#include "qm_pager_disk.h"

int qm__pager_account_alloc(qm_pager *p, uint64_t bytes, qm_status *st)
{
    uint64_t next;
    if (qm_add_u64(p->stats.resident_bytes, bytes, (unsigned long long *)&next) ||
        (p->has_budget && next > p->budget)) {
        /* Cannot happen with the slot count fixed at creation; refusing keeps
         * the invariant even if that arithmetic is ever wrong. */
        p->stats.budget_violations++;
        return qm_status_set(st, QM_EINTERNAL,
                             "paging would exceed the budget: %llu resident + %llu > %llu",
                             (unsigned long long)p->stats.resident_bytes,
                             (unsigned long long)bytes, (unsigned long long)p->budget);
    }
    p->stats.resident_bytes = next;
    if (p->alloc_cb)
        p->alloc_cb(p->alloc_ud, p->stats.resident_bytes, p->budget);
    return 0;
}

int32_t qm__pager_free_slot(qm_pager *p)
{
    for (uint32_t s = 0; s < p->n_slots; s++)
        if (p->slots[s].state == QM__SLOT_FREE)
            return (int32_t)s;
    return -1;
}

int qm__pager_claim(qm_pager *p, int32_t s, uint32_t layer, uint32_t expert, qm__claim how,
                    uint8_t pf_source, qm_status *st)
{
    qm__layer *L = &p->layers[layer];
    int rc = qm__pager_account_alloc(p, L->unit_bytes, st);
    if (rc)
        return rc;
    qm__slot *sl = &p->slots[s];
    sl->layer = layer;
    sl->expert = expert;
    sl->pinned = how == QM__CLAIM_PIN;
    sl->prefetched = how == QM__CLAIM_PREFETCH ? pf_source : QM__PF_NONE;
    sl->by_prefetch = how == QM__CLAIM_PREFETCH;
    sl->waiting = 0;
    sl->parked = 0;
    sl->uses = 0;
    sl->r8 = sl->r8_part_rows = 0;
    sl->refs = how == QM__CLAIM_DEMAND;
    sl->last_use = p->tick;
    sl->unit_bytes = L->unit_bytes;
    sl->state = QM__SLOT_LOADING;
    L->slot_of[expert] = s;
    if (how != QM__CLAIM_PIN)
        qm_policy_on_insert(p->policy, (qm_expert_ref){layer, expert}, p->tick);
    return 0;
}

void qm__pager_drop(qm_pager *p, int32_t s)
{
    qm__slot *sl = &p->slots[s];
    qm__layer *L = &p->layers[sl->layer];
    L->slot_of[sl->expert] = -1;
    p->stats.resident_bytes -= sl->unit_bytes;
    sl->state = QM__SLOT_FREE;
    sl->prefetched = 0;
    sl->waiting = 0;
    sl->parked = 0;
    sl->refs = 0;
    qm_policy_on_evict(p->policy, (qm_expert_ref){sl->layer, sl->expert});
}

int qm__pager_evictable(const qm_pager *p, int32_t s)
{
    const qm__slot *sl = &p->slots[s];
    return sl->state != QM__SLOT_FREE && !sl->pinned && sl->refs == 0;
}

int32_t qm__pager_pick_victim(qm_pager *p, size_t n)
{
    /* A parked prefetch first: its unit is not there (what a policy ranks
     * is the expert, not the half-read slot). */
    for (size_t i = 0; i < n; i++)
        if (p->slots[p->cand_slots[i]].parked)
            return p->cand_slots[i];
    for (size_t i = 0; i < n; i++) {
        const qm__slot *sl = &p->slots[p->cand_slots[i]];
        p->cand_refs[i] = (qm_expert_ref){sl->layer, sl->expert};
    }
    size_t v = SIZE_MAX;
    if (p->policy && p->policy->iface) {
        int rc = qm_policy_choose_victim(p->policy, p->cand_refs, n, &v);
        if (rc == 0 && v < n) {
            int32_t s = p->cand_slots[v];
            const qm__slot *sl = &p->slots[s];
            /* The candidate array is const to the policy, but check what the
             * slot really holds rather than trusting the array. */
            if (qm__pager_evictable(p, s) && p->cand_refs[v].bank == sl->layer &&
                p->cand_refs[v].expert == sl->expert)
                return s;
        }
        p->stats.policy_fallbacks++;
    }
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (p->slots[p->cand_slots[i]].last_use < p->slots[p->cand_slots[best]].last_use)
            best = i;
    return p->cand_slots[best];
}

void qm__pager_grow_free(qm_pager *p)
{
    for (size_t i = 0; i < p->n_grow; i++) {
        qm__pager_disk_unlock(p, p->grow_arenas[i]);
        qm_arena_free(p->backend, p->grow_arenas[i]);
    }
    qm_free(p->grow_arenas);
    qm_free(p->grow_first);
    p->grow_arenas = NULL;
    p->grow_first = NULL;
    p->n_grow = 0;
}

void qm__pager_slot_weights(qm_pager *p, int32_t s, qm_expert_weights *w)
{
    qm__slot *sl = &p->slots[s];
    qm__fill_weights(&p->layers[sl->layer], sl->base, sl->expert, 1, w);
    w->r8 = sl->r8;
    w->r8_part = sl->r8_part;
    w->r8_part_rows = sl->r8_part_rows;
    if (sl->uses < UINT16_MAX)
        sl->uses++;
}

int qm__pager_regrow(void **buf, size_t n, size_t elem)
{
    void *b = qm_realloc(*buf, n * elem);
    if (!b)
        return QM_ENOMEM;
    *buf = b;
    return 0;
}

int qm__pager_scratch_regrow(qm_pager *p, uint32_t n_old, uint32_t n)
{
    qm_expert_ref *refs = qm_calloc(n, sizeof *refs + 2 * sizeof(int32_t));
    if (!refs)
        return QM_ENOMEM;
    int32_t *cand = (int32_t *)(refs + n), *wave = cand + n;
    if (n_old) {
        memcpy(refs, p->cand_refs, (size_t)n_old * sizeof *refs);
        memcpy(cand, p->cand_slots, (size_t)n_old * sizeof *cand);
        memcpy(wave, p->wave_slots, (size_t)n_old * sizeof *wave);
    }
    qm_free(p->cand_refs);
    p->cand_refs = refs;
    p->cand_slots = cand;
    p->wave_slots = wave;
    return 0;
}
