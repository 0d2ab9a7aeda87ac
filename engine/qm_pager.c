/* qm_pager.c - the paging authority: arena layout, slots, exact accounting,
 * pins, victim choice with validation, the expert source (acquire/release)
 * and the session's forward call. Copies live in qm_pager_copy.c,
 * prediction and prefetch in qm_pager_prefetch.c. */
#include <stdint.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_clock.h"
#include "qm_pager_impl.h"

static uint64_t qm__align_up(uint64_t v, uint64_t a)
{
    return a <= 1 ? v : (v + a - 1) / a * a;
}

/* ---- Layout ---------------------------------------------------------------- */

typedef struct qm__sizing {
    uint64_t whole_accounted; /* whole banks' bytes (budget) */
    uint64_t whole_arena;     /* whole banks' bytes copied into the arena (aligned) */
    uint64_t pinned_bytes;
    uint32_t pinned_count;
    uint32_t unpinned_count;
    uint64_t max_unit;  /* largest accounted unit over paged layers */
    uint64_t slot_size; /* largest unit span, aligned */
} qm__sizing;

static int qm__copies_whole(const qm_pager_options *opt, qm_backend *be)
{
    return !qm_backend_host_visible(be) || (opt && opt->copy_whole_banks);
}

/* Fills the per-layer tables from the bank and the plan. `layers` has
 * cfg->layers entries, zeroed. Allocates nothing when `p` is NULL-free run. */
static int qm__layout(qm_backend *be, const qm_bank *bank, const qm_residency_plan *plan,
                      const qm_pager_options *opt, qm__layer *layers, qm__sizing *sz,
                      int allocate, qm_status *st)
{
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    uint64_t align = qm_backend_alignment(be);
    if (align < QM__UNIT_SLICE_ALIGN)
        align = QM__UNIT_SLICE_ALIGN;
    memset(sz, 0, sizeof *sz);
    for (size_t i = 0; i < qm_plan_total(plan); i++) {
        const qm_plan_bank *pb = qm_plan_bank_at(plan, i);
        if (pb->bank_id >= cfg->layers)
            return qm_status_set(st, QM_EINVAL, "plan names bank %u but the model has %u layers",
                                 pb->bank_id, cfg->layers);
    }
    int copy_whole = qm__copies_whole(opt, be);
    for (uint32_t l = 0; l < cfg->layers; l++) {
        qm__layer *L = &layers[l];
        const qm_layer_view *v = qm_bank_layer(bank, l);
        if (!v)
            return qm_status_set(st, QM_EINVAL, "bank has no layer %u", l);
        L->view = v;
        L->n_experts = cfg->experts;
        uint64_t off = 0, whole = 0, toff = 0;
        for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
            if (!v->t[t].present)
                continue;
            L->slice[t] = qm_expert_slice_bytes(&v->t[t], cfg->experts);
            L->unit_off[t] = off;
            off = qm__align_up(off + L->slice[t], QM__UNIT_SLICE_ALIGN);
            L->tensor_off[t] = toff;
            toff = qm__align_up(toff + v->t[t].nbytes, QM__UNIT_SLICE_ALIGN);
            whole += v->t[t].nbytes;
        }
        L->unit_bytes = v->bytes_per_expert;
        L->unit_span = off;
        if (opt && opt->layer_mask && !opt->layer_mask[l]) {
            L->absent = 1; /* another device's: neither whole nor paged here */
            continue;
        }
        const qm_plan_bank *pb = qm_plan_find_bank(plan, l);
        if (!pb || pb->decision.kind != QM_DECISION_PER_EXPERT) {
            L->paged = 0;
            L->whole_bytes = whole;
            sz->whole_accounted += whole;
            if (copy_whole)
                sz->whole_arena += qm__align_up(toff, align);
            continue;
        }
        if (pb->n_experts_in_bank != cfg->experts)
            return qm_status_set(st, QM_EINVAL, "plan bank %u has %u experts, the model %u", l,
                                 pb->n_experts_in_bank, cfg->experts);
        if (pb->bytes_per_expert != v->bytes_per_expert)
            return qm_status_set(st, QM_EINVAL,
                                 "plan bank %u: bytes_per_expert %llu, the model's %llu", l,
                                 (unsigned long long)pb->bytes_per_expert,
                                 (unsigned long long)v->bytes_per_expert);
        L->paged = 1;
        /* Experts the decision does not let us page stay resident: pin them
         * with the decision's own pins. */
        uint8_t *pin = NULL;
        if (allocate) {
            L->slot_of = qm_malloc(sizeof(int32_t) * cfg->experts);
            L->pinned = qm_calloc(cfg->experts, 1);
            L->mark = qm_calloc(cfg->experts, 1);
            if (!L->slot_of || !L->pinned || !L->mark)
                return qm_status_set(st, QM_ENOMEM, "out of memory for the pager's expert map");
            for (uint32_t e = 0; e < cfg->experts; e++)
                L->slot_of[e] = -1;
            pin = L->pinned;
        } else {
            pin = qm_calloc(cfg->experts, 1);
            if (!pin)
                return qm_status_set(st, QM_ENOMEM, "out of memory");
        }
        memset(pin, 1, cfg->experts);
        for (size_t i = 0; i < pb->decision.n_experts; i++)
            if (pb->decision.experts[i] < cfg->experts)
                pin[pb->decision.experts[i]] = 0;
        for (size_t i = 0; i < pb->decision.n_pinned; i++)
            if (pb->decision.pinned[i] < cfg->experts)
                pin[pb->decision.pinned[i]] = 1;
        for (uint32_t e = 0; e < cfg->experts; e++) {
            if (pin[e]) {
                sz->pinned_count++;
                sz->pinned_bytes += L->unit_bytes;
            } else {
                sz->unpinned_count++;
            }
        }
        if (!allocate)
            qm_free(pin);
        if (L->unit_bytes > sz->max_unit)
            sz->max_unit = L->unit_bytes;
        if (L->unit_span > sz->slot_size)
            sz->slot_size = L->unit_span;
    }
    sz->slot_size = qm__align_up(sz->slot_size, align);
    return 0;
}

static uint64_t qm__min_budget(const qm__sizing *sz)
{
    return sz->whole_accounted + sz->pinned_bytes + (sz->unpinned_count ? sz->max_unit : 0);
}

/* The budget travels in one place, the plan: with none, room for every
 * expert (the "whole model"). */
static void qm__budget_in_force(const qm_residency_plan *plan, const qm_pager_options *opt,
                                int *has, uint64_t *budget)
{
    if (opt->budget_bytes) {
        *has = 1;
        *budget = opt->budget_bytes;
    } else if (qm_plan_has_budget(plan)) {
        *has = 1;
        *budget = qm_plan_budget(plan);
    } else {
        *has = 0;
        *budget = UINT64_MAX;
    }
}

static void qm__layers_free(qm__layer *layers, uint32_t n)
{
    if (!layers)
        return;
    for (uint32_t l = 0; l < n; l++) {
        qm_free(layers[l].slot_of);
        qm_free(layers[l].pinned);
        qm_free(layers[l].mark);
        qm_free(layers[l].hist);
    }
    qm_free(layers);
}

int qm_pager_min_budget(qm_backend *backend, const qm_bank *bank, const qm_residency_plan *plan,
                        const qm_pager_options *options, uint64_t *out, qm_status *st)
{
    if (!backend || !bank || !plan || !out)
        return qm_status_set(st, QM_EINVAL, "qm_pager_min_budget: NULL argument");
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    qm__layer *layers = qm_calloc(cfg->layers, sizeof *layers);
    if (!layers)
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    qm__sizing sz;
    int rc = qm__layout(backend, bank, plan, options, layers, &sz, 0, st);
    if (rc == 0)
        *out = qm__min_budget(&sz);
    qm__layers_free(layers, cfg->layers);
    return rc;
}

/* ---- Accounting -------------------------------------------------------------- */

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
    sl->refs = 0;
    qm_policy_on_evict(p->policy, (qm_expert_ref){sl->layer, sl->expert});
}

void qm__pager_evict(qm_pager *p, int32_t s)
{
    /* Never hand out a slot a copy may still be writing into. */
    if (p->slots[s].state == QM__SLOT_LOADING)
        (void)qm__pager_copy_wait(p, s, NULL);
    qm__pager_drop(p, s);
    p->stats.evictions++;
}

/* A slot whose prefetch copy is still in flight is evictable too (its copy
 * is waited for first, in qm__pager_evict): otherwise whether a prediction
 * can be displaced would depend on copy timing, and paging would not be
 * deterministic. */
static int qm__evictable(const qm_pager *p, int32_t s)
{
    const qm__slot *sl = &p->slots[s];
    return sl->state != QM__SLOT_FREE && !sl->pinned && sl->refs == 0;
}

int32_t qm__pager_pick_victim(qm_pager *p, size_t n)
{
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
            if (qm__evictable(p, s) && p->cand_refs[v].bank == sl->layer &&
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

/* ---- Creation ------------------------------------------------------------------ */

static int qm__copy_sync(qm_pager *p, void *dst, const void *src, uint64_t n, qm_status *st)
{
    if (p->disk)
        return qm__pager_disk_read(p, dst, src, n, st);
    qm_fence f = {0};
    int rc = qm_backend_copy_h2d(p->backend, dst, src, n, &f, st);
    if (rc == 0)
        rc = qm_backend_fence_wait(p->backend, &f, st);
    return rc;
}

/* Whole banks: accounted for the session's life; copied into the arena when
 * the backend cannot read the mapping. */
static int qm__load_whole(qm_pager *p, uint64_t *arena_off, uint64_t align, qm_status *st)
{
    int copy_whole = qm__copies_whole(&p->opt, p->backend);
    for (uint32_t l = 0; l < p->n_layers; l++) {
        qm__layer *L = &p->layers[l];
        if (L->paged || L->absent)
            continue;
        int rc = qm__pager_account_alloc(p, L->whole_bytes, st);
        if (rc)
            return rc;
        if (!copy_whole)
            continue;
        L->whole_base = qm_arena_at(p->arena, *arena_off);
        uint64_t span = 0;
        for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
            const qm_tensor_view *tv = &L->view->t[t];
            if (!tv->present || tv->nbytes == 0)
                continue;
            rc = qm__copy_sync(p, L->whole_base + L->tensor_off[t], tv->data, tv->nbytes, st);
            if (rc)
                return rc;
            p->stats.bytes_loaded_at_create += tv->nbytes;
            span = L->tensor_off[t] + tv->nbytes;
        }
        *arena_off += qm__align_up(span, align);
    }
    return 0;
}

static int qm__load_pins(qm_pager *p, qm_status *st)
{
    for (uint32_t l = 0; l < p->n_layers; l++) {
        qm__layer *L = &p->layers[l];
        if (!L->paged)
            continue;
        for (uint32_t e = 0; e < L->n_experts; e++) {
            if (!L->pinned[e])
                continue;
            int32_t s = qm__pager_free_slot(p);
            if (s < 0)
                return qm_status_set(st, QM_EINTERNAL, "no slot left for pinned expert %u/%u", l,
                                     e);
            int rc = qm__pager_claim(p, s, l, e, QM__CLAIM_PIN, QM__PF_NONE, st);
            if (rc)
                return rc;
            p->stats.n_pinned++;
            rc = qm__pager_copy_unit(p, s, st);
            if (rc == 0)
                rc = qm__pager_copy_wait(p, s, st);
            if (rc)
                return rc;
            p->stats.bytes_loaded_at_create += L->unit_bytes;
        }
    }
    return 0;
}

/* When the budget holds every expert, paging can only add first-touch
 * misses: load everything now (copies issued together, then waited), so a
 * 100% session hits from its first call. The experts stay evictable. */
static int qm__preload_all(qm_pager *p, qm_status *st)
{
    int rc = 0;
    for (uint32_t l = 0; l < p->n_layers && rc == 0; l++) {
        qm__layer *L = &p->layers[l];
        if (!L->paged)
            continue;
        for (uint32_t e = 0; e < L->n_experts && rc == 0; e++) {
            if (L->slot_of[e] >= 0)
                continue;
            int32_t s = qm__pager_free_slot(p);
            if (s < 0)
                return qm_status_set(st, QM_EINTERNAL, "no slot left to preload %u/%u", l, e);
            if ((rc = qm__pager_claim(p, s, l, e, QM__CLAIM_PRELOAD, QM__PF_NONE, st)))
                break;
            p->stats.bytes_loaded_at_create += L->unit_bytes;
            rc = qm__pager_copy_unit(p, s, st);
        }
    }
    int w = qm_pager_sync(p, rc ? NULL : st);
    return rc ? rc : w;
}

static int qm__source_acquire(void *ctx, uint32_t layer, const uint32_t *experts, size_t n,
                              qm_expert_weights *weights, size_t *n_ready, qm_status *st);
static void qm__source_release(void *ctx, uint32_t layer, const uint32_t *experts, size_t n);

int qm_pager_new(qm_backend *backend, const qm_bank *bank, const qm_residency_plan *plan,
                 const qm_policy *policy, const qm_pager_options *options, qm_pager **out,
                 qm_status *st)
{
    if (!backend || !bank || !plan || !out)
        return qm_status_set(st, QM_EINVAL, "qm_pager_new: NULL argument");
    *out = NULL;
    int rc = QM_ENOMEM;
    qm_pager *p = qm_calloc(1, sizeof *p);
    if (!p)
        return qm_status_set(st, QM_ENOMEM, "out of memory for the pager");
    p->backend = backend;
    p->bank = bank;
    p->cfg = qm_bank_get_config(bank);
    p->policy = policy;
    if (options)
        p->opt = *options;
    if (p->opt.history == 0)
        p->opt.history = 1;
    qm__pager_disk_open(p); /* before the layout: it may force whole banks into the arena */
    p->n_layers = p->cfg->layers;
    p->layers = qm_calloc(p->n_layers, sizeof *p->layers);
    if (!p->layers) {
        qm_status_set(st, QM_ENOMEM, "out of memory for the pager's layers");
        goto fail;
    }
    rc = qm__moe_scratch_new(&p->scratch, st);
    if (rc)
        goto fail;
    qm__sizing sz;
    rc = qm__layout(backend, bank, plan, &p->opt, p->layers, &sz, 1, st);
    if (rc)
        goto fail;
    qm__budget_in_force(plan, &p->opt, &p->has_budget, &p->budget);
    uint64_t min = qm__min_budget(&sz);
    if (p->has_budget && p->budget < min) {
        rc = qm_status_set_field(
            st, QM_ERESOURCE_EXHAUSTED, "budget_bytes",
            "budget_bytes %llu is below the minimum of %llu bytes for this plan (whole banks "
            "%llu + pinned experts %llu + one expert unit %llu)",
            (unsigned long long)p->budget, (unsigned long long)min,
            (unsigned long long)sz.whole_accounted, (unsigned long long)sz.pinned_bytes,
            (unsigned long long)(sz.unpinned_count ? sz.max_unit : 0));
        goto fail;
    }
    uint64_t n_paging = sz.unpinned_count;
    if (p->has_budget && sz.max_unit > 0) {
        uint64_t room = (p->budget - sz.whole_accounted - sz.pinned_bytes) / sz.max_unit;
        if (room < n_paging)
            n_paging = room;
    }
    p->n_slots = (uint32_t)(sz.pinned_count + n_paging);
    p->slot_cap = p->n_slots;
    p->whole_accounted = sz.whole_accounted;
    p->pinned_bytes = sz.pinned_bytes;
    p->max_unit = sz.max_unit;
    p->slot_size = sz.slot_size;
    p->whole_arena = sz.whole_arena;
    p->n_paged_experts = sz.pinned_count + sz.unpinned_count;
    unsigned long long slots_bytes = 0, arena_bytes = 0;
    if (qm_mul_u64(p->n_slots, sz.slot_size, &slots_bytes) ||
        qm_add_u64(slots_bytes, sz.whole_arena, &arena_bytes)) {
        rc = qm_status_set(st, QM_ERESOURCE_EXHAUSTED, "arena size overflows");
        goto fail;
    }
    if (arena_bytes > 0) {
        rc = qm_arena_new(backend, arena_bytes, &p->arena, st);
        if (rc)
            goto fail;
        qm__pager_disk_lock(p, p->arena);
    }
    if (p->n_slots) {
        p->slots = qm_calloc(p->n_slots, sizeof *p->slots);
        p->cand_slots = qm_calloc(p->n_slots, sizeof *p->cand_slots);
        p->cand_refs = qm_calloc(p->n_slots, sizeof *p->cand_refs);
        p->wave_slots = qm_calloc(p->n_slots, sizeof *p->wave_slots);
        if (!p->slots || !p->cand_slots || !p->cand_refs || !p->wave_slots) {
            rc = qm_status_set(st, QM_ENOMEM, "out of memory for %u slots", p->n_slots);
            goto fail;
        }
        for (uint32_t s = 0; s < p->n_slots; s++)
            p->slots[s].base = qm_arena_at(p->arena, sz.whole_arena + (uint64_t)s * sz.slot_size);
    }
    for (uint32_t l = 0; l < p->n_layers; l++) {
        qm__layer *L = &p->layers[l];
        if (!L->paged)
            continue;
        L->words64 = (L->n_experts + 63) / 64;
        L->hist = qm_calloc((size_t)L->words64 * p->opt.history, sizeof(uint64_t));
        if (!L->hist) {
            rc = qm_status_set(st, QM_ENOMEM, "out of memory for routing history");
            goto fail;
        }
        p->stats.host_bytes += (uint64_t)L->words64 * p->opt.history * 8 + L->n_experts * 6u;
    }
    uint64_t align = qm_backend_alignment(backend);
    if (align < QM__UNIT_SLICE_ALIGN)
        align = QM__UNIT_SLICE_ALIGN;
    uint64_t arena_off = 0;
    rc = qm__load_whole(p, &arena_off, align, st);
    if (rc)
        goto fail;
    int want_thread = p->opt.copy_thread == 1 ||
                      (p->opt.copy_thread != 2 && qm_backend_host_visible(backend));
    if (want_thread && p->n_slots) {
        rc = qm__pager_copy_start(p, st);
        if (rc)
            goto fail;
    }
    rc = qm__load_pins(p, st);
    if (rc)
        goto fail;
    if (!p->opt.no_preload && n_paging > 0 && n_paging == sz.unpinned_count) {
        rc = qm__preload_all(p, st);
        if (rc)
            goto fail;
    }

    p->source.version = QM_EXPERT_SOURCE_VERSION;
    p->source.ctx = p;
    p->source.acquire = qm__source_acquire;
    p->source.release = qm__source_release;
    rc = qm__hybrid_start(p, st);
    if (rc)
        goto fail;
    p->stats.budget_bytes = p->budget;
    p->stats.arena_bytes = arena_bytes;
    p->stats.slot_bytes = sz.slot_size;
    p->stats.n_slots = p->n_slots;
    uint64_t counted = (sz.whole_arena ? sz.whole_accounted : 0) + sz.pinned_bytes +
                       n_paging * sz.max_unit;
    p->stats.overhead_bytes = arena_bytes > counted ? arena_bytes - counted : 0;
    p->stats.host_bytes += sizeof *p + p->n_layers * sizeof *p->layers +
                           p->n_slots * (sizeof *p->slots + sizeof *p->cand_refs + 8) +
                           (p->use_thread ? (p->n_slots + 1) * sizeof(qm__copy_job) : 0);
    *out = p;
    return 0;
fail:
    qm_pager_free(p);
    return rc ? rc : QM_EINTERNAL;
}

void qm_pager_free(qm_pager *p)
{
    if (!p)
        return;
    qm__pager_copy_stop(p);
    qm__pager_trace_close(p);
    qm__hybrid_stop(p);
    if (p->backend && p->slots) {
        /* Land every device copy before the arena goes away. */
        for (uint32_t s = 0; s < p->n_slots; s++)
            for (uint32_t f = 0; f < p->slots[s].n_fences; f++)
                qm_backend_fence_wait(p->backend, &p->slots[s].fences[f], NULL);
    }
    if (p->arena) {
        qm__pager_disk_unlock(p, p->arena);
        qm_arena_free(p->backend, p->arena);
    }
    qm__pager_grow_free(p);
    qm__pager_disk_close(p);
    qm__layers_free(p->layers, p->n_layers);
    qm_free(p->slots);
    qm_free(p->cand_slots);
    qm_free(p->cand_refs);
    qm_free(p->wave_slots);
    qm_free(p->route_buf);
    qm__moe_scratch_free(p->scratch);
    qm_free(p->pred_x);
    qm_free(p->pred_logits);
    qm_free(p->pred_experts);
    qm_free(p->pred_weights);
    qm_free(p->pred_list);
    qm_free(p->pred_src);
    qm_free(p);
}

/* ---- The expert source ---------------------------------------------------------- */

void qm__fill_weights(const qm__layer *L, const uint8_t *unit_base, uint32_t e, int from_slot,
                      qm_expert_weights *w)
{
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        if (!L->view->t[t].present) {
            w->ptr[t] = NULL;
        } else if (from_slot) {
            w->ptr[t] = unit_base + L->unit_off[t];
        } else if (L->whole_base) {
            w->ptr[t] = L->whole_base + L->tensor_off[t] + (uint64_t)e * L->slice[t];
        } else {
            w->ptr[t] = (const uint8_t *)L->view->t[t].data + (uint64_t)e * L->slice[t];
        }
    }
}

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
        if (!qm__evictable(p, (int32_t)s))
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

/* ---- The forward call ----------------------------------------------------------------- */

int qm_pager_forward(qm_pager *p, const qm_moe_call *call, qm_moe_stats *mstats, qm_status *st)
{
    if (!p || !call)
        return qm_status_set(st, QM_EINVAL, "qm_pager_forward: NULL argument");
    if (call->layer < p->n_layers && p->layers[call->layer].absent)
        return qm_status_set_field(st, QM_EINVAL, "layer", "layer %u is placed on another device",
                                   call->layer);
    qm_moe_call c = *call;
    uint32_t route_k = qm_moe_call_k(p->cfg, call);
    size_t need = (size_t)call->n_tokens * route_k;
    if (!c.route_experts && need) {
        if (need > p->route_cap) {
            uint32_t *b = qm_realloc(p->route_buf, need * sizeof *b);
            if (!b)
                return qm_status_set(st, QM_ENOMEM, "out of memory for routing scratch");
            p->route_buf = b;
            p->route_cap = need;
        }
        c.route_experts = p->route_buf;
    }
    qm_moe_stats local;
    if (!mstats)
        mstats = &local;
    const qm_layer_view *layer = NULL;
    int rc = qm__moe_layer_of(p->bank, call, &layer, st);
    if (rc == 0)
        rc = qm__moe_forward_layer(p->backend, p->cfg, layer, &c, &p->source, p->scratch, mstats,
                                   st);
    if (rc || call->n_tokens == 0 || call->layer >= p->n_layers)
        return rc;
    rc = qm__hybrid_observe(p, mstats, st);
    if (rc)
        return rc;
    qm__pager_history_record(p, call->layer, c.route_experts, need);
    qm_pager *tp = p->trace_to ? p->trace_to : p;
    if (tp->trace)
        qm__pager_trace_record(tp, call->layer, c.route_experts, call->n_tokens, route_k);
    qm__pager_prefetch_next(p, call);
    return 0;
}

/* ---- Introspection ----------------------------------------------------------------- */

void qm_pager_stats_get(const qm_pager *p, qm_pager_stats *out)
{
    if (!out)
        return;
    if (!p) {
        memset(out, 0, sizeof *out);
        return;
    }
    *out = p->stats;
    qm__pager_disk_stats(p, out);
}

int qm_pager_layer_is_paged(const qm_pager *p, uint32_t layer)
{
    if (!p || layer >= p->n_layers)
        return QM_EINVAL;
    return p->layers[layer].paged;
}

const qm_backend *qm_pager_host_backend(const qm_pager *p)
{
    return p ? p->hybrid.host_be : NULL;
}

int qm_pager_resident_experts(const qm_pager *p, uint32_t layer, uint32_t *out, size_t cap)
{
    if (!p || layer >= p->n_layers)
        return QM_EINVAL;
    const qm__layer *L = &p->layers[layer];
    size_t n = 0;
    for (uint32_t e = 0; e < L->n_experts && !L->absent; e++) {
        if (L->paged && L->slot_of[e] < 0)
            continue;
        if (out && n < cap)
            out[n] = e;
        n++;
    }
    return (int)n;
}

void qm_pager_set_alloc_hook(qm_pager *p, qm_pager_alloc_cb cb, void *ud)
{
    if (!p)
        return;
    p->alloc_cb = cb;
    p->alloc_ud = ud;
}
