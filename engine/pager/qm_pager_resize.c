/* qm_pager_resize.c - elastic budgets: a live pager's budget changes
 * (session.resize). Shrinking releases pins that no longer fit (coldest
 * first), evicts by the policy down to the new budget and gives back the
 * highest slots; growing adds slots from memory given back earlier or from a
 * new arena. See qm_pager_resize in qm_pager.h and docs/PAGING.md. */
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_pager_copy.h"
#include "qm_pager_disk.h"
#include "qm_pager_prefetch.h"

static int qm__any_paged(const qm_pager *p)
{
    return p->sz.pinned_count + p->sz.unpinned_count > 0;
}

/* The coldest pinned slot (least recently used; lowest index on ties), or -1. */
static int32_t qm__coldest_pin(const qm_pager *p)
{
    int32_t best = -1;
    for (uint32_t s = 0; s < p->n_slots; s++) {
        const qm__slot *sl = &p->slots[s];
        if (sl->state == QM__SLOT_FREE || !sl->pinned)
            continue;
        if (best < 0 || sl->last_use < p->slots[best].last_use)
            best = (int32_t)s;
    }
    return best;
}

static void qm__release_pin(qm_pager *p, int32_t s)
{
    qm__slot *sl = &p->slots[s];
    sl->pinned = 0;
    p->layers[sl->layer].pinned[sl->expert] = 2; /* released (qm_pager_pins_released) */
    p->sz.pinned_bytes -= sl->unit_bytes;
    p->stats.n_pinned--;
    p->stats.pins_released++;
    /* From now on the policy sees it like any expert it admitted. */
    qm_policy_on_insert(p->policy, (qm_expert_ref){sl->layer, sl->expert}, sl->last_use);
}

static uint32_t qm__occupied(const qm_pager *p)
{
    uint32_t n = 0;
    for (uint32_t s = 0; s < p->n_slots; s++)
        n += p->slots[s].state != QM__SLOT_FREE;
    return n;
}

/* Moves the unit in slot `from` into free slot `to` (re-copied from the
 * bank); on failure the expert is dropped. */
static void qm__move_unit(qm_pager *p, int32_t from, int32_t to)
{
    qm__slot *a = &p->slots[from], *b = &p->slots[to];
    uint8_t *to_base = b->base, *from_base = a->base;
    *b = *a;
    b->base = to_base;
    b->copy_seq = 0;
    b->n_fences = 0;
    b->r8 = b->r8_part_rows = 0; /* re-copied from the bank */
    b->state = QM__SLOT_LOADING;
    b->parked = 0; /* read whole again */
    p->layers[b->layer].slot_of[b->expert] = to;
    memset(a, 0, sizeof *a);
    a->base = from_base;
    a->state = QM__SLOT_FREE;
    int rc = qm__pager_copy_unit(p, to, NULL);
    if (rc == 0)
        rc = qm__pager_copy_wait(p, to, NULL);
    if (rc) {
        if (b->pinned)
            qm__release_pin(p, to);
        qm__pager_evict(p, to);
        return;
    }
    p->stats.resize_moves++;
    p->stats.bytes_paged_h2d += b->unit_bytes;
}

/* The whole pages inside slot s: [*start, *start + *len). 0 when none. */
static int qm__slot_pages(const qm_pager *p, uint32_t s, uintptr_t *start, uint64_t *len)
{
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t mask = (uintptr_t)(page > 0 ? page : 4096) - 1;
    uintptr_t a = ((uintptr_t)p->slots[s].base + mask) & ~mask;
    uintptr_t e = ((uintptr_t)p->slots[s].base + (uintptr_t)p->sz.slot_size) & ~mask;
    if (!p->slots[s].base || e <= a)
        return 0;
    *start = a;
    *len = e - a;
    return 1;
}

/* Slots [from, to) given back by a shrink (take 0): in a host arena their
 * pages go back to the system (unlocked first where the disk source locked
 * them), so the smaller budget is less memory, as a memory cgroup counts
 * it; taken again by a growth (take 1): locked again as the arena was.
 * Device memory stays. */
static void qm__slots_memory(qm_pager *p, uint32_t from, uint32_t to, int take)
{
    if (!qm_backend_host_visible(p->backend))
        return;
    for (uint32_t s = from; s < to; s++) {
        uintptr_t a;
        uint64_t len;
        if (!qm__slot_pages(p, s, &a, &len))
            continue;
        if (take) {
            qm__pager_disk_lock_range(p, (void *)a, len);
        } else {
            qm__pager_disk_unlock_range(p, (void *)a, len);
            madvise((void *)a, (size_t)len, MADV_DONTNEED);
        }
    }
}

static int qm__shrink(qm_pager *p, uint64_t budget, uint32_t keep, qm_status *st)
{
    /* Evict by the policy until the survivors fit the kept slots and the
     * budget (each unit is at most max_unit, so `keep` slots fit). */
    while (qm__occupied(p) > keep || p->stats.resident_bytes > budget) {
        size_t nc = 0;
        for (uint32_t s = 0; s < p->n_slots; s++)
            if (qm__pager_evictable(p, (int32_t)s))
                p->cand_slots[nc++] = (int32_t)s;
        if (nc == 0)
            return qm_status_set(st, QM_EINTERNAL,
                                 "resize: nothing evictable with %llu bytes resident over a "
                                 "budget of %llu",
                                 (unsigned long long)p->stats.resident_bytes,
                                 (unsigned long long)budget);
        qm__pager_evict(p, qm__pager_pick_victim(p, nc));
    }
    /* Survivors in the slots given back move down into free kept ones. */
    uint32_t low = 0;
    for (uint32_t s = keep; s < p->n_slots; s++) {
        if (p->slots[s].state == QM__SLOT_FREE)
            continue;
        while (low < keep && p->slots[low].state != QM__SLOT_FREE)
            low++;
        if (low >= keep)
            return qm_status_set(st, QM_EINTERNAL, "resize: no free slot below %u", keep);
        qm__move_unit(p, (int32_t)s, (int32_t)low);
    }
    qm__slots_memory(p, keep, p->n_slots, 0);
    p->n_slots = keep;
    /* Arenas added by growing whose slots are all given back go. */
    while (p->n_grow > 0 && p->grow_first[p->n_grow - 1] >= keep) {
        qm_arena *a = p->grow_arenas[p->n_grow - 1];
        p->stats.arena_bytes -= qm_arena_size(a);
        p->slot_cap = p->grow_first[p->n_grow - 1];
        qm__pager_disk_unlock(p, a);
        qm_arena_free(p->backend, a);
        p->n_grow--;
    }
    qm__pager_disk_arenas(p); /* the slots given back hold no pin now */
    return 0;
}

static int qm__grow(qm_pager *p, uint32_t want, qm_status *st)
{
    if (want <= p->slot_cap) {
        for (uint32_t s = p->n_slots; s < want; s++)
            memset(&p->slots[s].layer, 0, sizeof *p->slots - offsetof(qm__slot, layer));
        qm__slots_memory(p, p->n_slots, want, 1);
        p->n_slots = want;
        qm__pager_disk_arenas(p); /* the slots taken again are registered */
        return 0;
    }
    uint32_t add = want - p->slot_cap;
    unsigned long long bytes;
    /* The slots start on the layout's alignment (the disk source's blocks). */
    const uint64_t align = qm__pager_align(p->backend, &p->opt);
    const uint64_t slack = align > qm_backend_alignment(p->backend) ? align : 0;
    if (qm_mul_u64(add, p->sz.slot_size, &bytes) || qm_add_u64(bytes, slack, &bytes))
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED, "arena size overflows");
    /* Every array first (a failure leaves the pager as it was: the arrays
     * are only larger), then the arena. */
    if (qm__pager_regrow((void **)&p->grow_arenas, p->n_grow + 1, sizeof *p->grow_arenas) ||
        qm__pager_regrow((void **)&p->grow_first, p->n_grow + 1, sizeof *p->grow_first) ||
        qm__pager_scratch_regrow(p, p->slot_cap, want))
        return qm_status_set(st, QM_ENOMEM, "out of memory growing to %u slots", want);
    int rc = qm__pager_slots_regrow(p, want, st);
    if (rc == 0)
        rc = qm__pager_disk_slots(p, want, st);
    if (rc)
        return rc;
    qm_arena *a = NULL;
    rc = qm_arena_new(p->backend, bytes, &a, st);
    if (rc)
        return rc;
    qm__pager_disk_lock(p, a);
    uintptr_t a0 = (uintptr_t)qm_arena_at(a, 0);
    uint64_t skew = slack ? (align - a0 % align) % align : 0;
    memset(&p->slots[p->slot_cap], 0, (size_t)add * sizeof *p->slots);
    for (uint32_t i = 0; i < add; i++)
        p->slots[p->slot_cap + i].base = qm_arena_at(a, skew + (uint64_t)i * p->sz.slot_size);
    p->grow_arenas[p->n_grow] = a;
    p->grow_first[p->n_grow] = p->slot_cap;
    p->n_grow++;
    p->stats.arena_bytes += bytes;
    for (uint32_t s = p->n_slots; s < p->slot_cap; s++)
        memset(&p->slots[s].layer, 0, sizeof *p->slots - offsetof(qm__slot, layer));
    qm__slots_memory(p, p->n_slots, p->slot_cap, 1);
    p->slot_cap = want;
    p->n_slots = want;
    qm__pager_disk_arenas(p); /* the new arena, and slots taken again */
    return 0;
}

int qm__pager_resize(qm_pager *p, uint64_t budget, qm_status *st)
{    uint64_t unit = qm__any_paged(p) ? p->sz.max_unit : 0;
    if (budget < p->sz.whole_accounted + unit)
        return qm__budget_refused(budget, p->sz.whole_accounted, 0, unit, st);
    int rc = qm_pager_sync(p, st);
    if (rc)
        return rc;
    if (budget < p->budget) {
        /* Pins that no longer leave room for one expert unit go, coldest first. */
        while (p->stats.n_pinned > 0 &&
               p->sz.whole_accounted + p->sz.pinned_bytes + unit > budget) {
            int32_t s = qm__coldest_pin(p);
            if (s < 0)
                break;
            qm__release_pin(p, s);
        }
    }
    uint32_t want = qm__slots_for(&p->sz, budget, p->stats.n_pinned);
    if (want < p->n_slots || p->stats.resident_bytes > budget)
        rc = qm__shrink(p, budget, want < p->n_slots ? want : p->n_slots, st);
    else if (want > p->n_slots)
        rc = qm__grow(p, want, st);
    if (rc)
        return rc;
    p->has_budget = 1;
    p->budget = budget;
    p->stats.budget_bytes = budget;
    p->stats.n_slots = p->n_slots;
    p->stats.resizes++;
    return 0;
}

int qm_pager_pins_released(const qm_pager *p, uint32_t layer, uint32_t *out, size_t cap)
{
    if (!p || layer >= p->n_layers)
        return QM_EINVAL;
    const qm__layer *L = &p->layers[layer];
    size_t n = 0;
    for (uint32_t e = 0; L->paged && e < L->n_experts; e++) {
        if (L->pinned[e] != 2)
            continue;
        if (out && n < cap)
            out[n] = e;
        n++;
    }
    return (int)n;
}
