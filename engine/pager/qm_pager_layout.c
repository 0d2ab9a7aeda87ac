/* qm_pager_layout.c - see qm_pager_layout.h. */
#include "qm_pager_layout.h"

#include <string.h>

#include "qm_alloc.h"

uint64_t qm__align_up(uint64_t v, uint64_t a)
{
    return a <= 1 ? v : (v + a - 1) / a * a;
}

static int qm__direct_layout(const qm_pager_options *opt)
{
    return opt && opt->source == QM_PAGER_SOURCE_DIRECT;
}

uint64_t qm__pager_align(const qm_backend *be, const qm_pager_options *opt)
{
    uint64_t align = qm_backend_alignment(be);
    if (align < QM__UNIT_SLICE_ALIGN)
        align = QM__UNIT_SLICE_ALIGN;
    if (qm__direct_layout(opt) && align < QM__DISK_BLOCK)
        align = QM__DISK_BLOCK;
    return align;
}

uint64_t qm__slice_phase(const qm__layer *L, int t, uint32_t e)
{
    return L->direct ? (L->file_off[t] + (uint64_t)e * L->slice[t]) % QM__DISK_BLOCK : 0;
}

int qm__copies_whole(const qm_pager_options *opt, const qm_backend *be)
{
    return !qm_backend_host_visible(be) || (opt && opt->copy_whole_banks);
}

void qm__layer_pins(const qm_plan_bank *pb, uint32_t n_experts, uint8_t *pin)
{
    /* Experts the decision does not let us page stay resident: pinned, with
     * the decision's own pins. */
    memset(pin, 1, n_experts);
    for (size_t i = 0; i < pb->decision.n_experts; i++)
        if (pb->decision.experts[i] < n_experts)
            pin[pb->decision.experts[i]] = 0;
    for (size_t i = 0; i < pb->decision.n_pinned; i++)
        if (pb->decision.pinned[i] < n_experts)
            pin[pb->decision.pinned[i]] = 1;
}

/* The disk source's window for slice t: whole blocks holding the slice at
 * any phase it takes (one phase when the slice is a whole number of
 * blocks, else any). */
static uint64_t qm__slice_window(const qm__layer *L, int t)
{
    const uint64_t B = QM__DISK_BLOCK, slice = L->slice[t];
    if (slice % B == 0)
        return qm__align_up(L->file_off[t] % B + slice, B);
    return qm__align_up(slice, B) + B;
}

/* The layout of layer l's tensors: slices in a slot, offsets in a whole
 * copy; with the disk source (map: the bank's mapping) each where a
 * block-aligned read puts it. */
static void qm__layout_tensors(const qm_layer_view *v, uint32_t n_experts, const uint8_t *map,
                               qm__layer *L, uint64_t *whole, uint64_t *whole_span)
{
    uint64_t off = 0, toff = 0;
    *whole = 0;
    L->direct = map != NULL;
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        if (!v->t[t].present)
            continue;
        L->slice[t] = qm_expert_slice_bytes(&v->t[t], n_experts);
        L->unit_off[t] = off;
        L->tensor_off[t] = toff;
        *whole += v->t[t].nbytes;
        if (map) {
            L->file_off[t] = (uint64_t)((const uint8_t *)v->t[t].data - map);
            off += qm__slice_window(L, t);
            L->tensor_off[t] += L->file_off[t] % QM__DISK_BLOCK;
            toff = qm__align_up(L->tensor_off[t] + v->t[t].nbytes, QM__DISK_BLOCK);
            continue;
        }
        off = qm__align_up(off + L->slice[t], QM__UNIT_SLICE_ALIGN);
        toff = qm__align_up(toff + v->t[t].nbytes, QM__UNIT_SLICE_ALIGN);
    }
    L->unit_bytes = v->bytes_per_expert;
    L->unit_span = off;
    *whole_span = toff;
}

int qm__layout(const qm_backend *be, const qm_bank *bank, const qm_residency_plan *plan,
               const qm_pager_options *opt, qm__layer *layers, uint8_t *pins, qm__sizing *sz,
               qm_status *st)
{
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    const uint64_t align = qm__pager_align(be, opt);
    uint64_t map_bytes = 0;
    const uint8_t *map = qm__direct_layout(opt) ? qm_bank_mapping(bank, &map_bytes) : NULL;
    memset(sz, 0, sizeof *sz);
    for (size_t i = 0; i < qm_plan_total(plan); i++) {
        const qm_plan_bank *pb = qm_plan_bank_at(plan, i);
        if (pb->bank_id >= cfg->layers)
            return qm_status_set(st, QM_EINVAL, "plan names bank %u but the model has %u layers",
                                 pb->bank_id, cfg->layers);
    }
    const int copy_whole = qm__copies_whole(opt, be);
    for (uint32_t l = 0; l < cfg->layers; l++) {
        qm__layer *L = &layers[l];
        const qm_layer_view *v = qm_bank_layer(bank, l);
        if (!v)
            return qm_status_set(st, QM_EINVAL, "bank has no layer %u", l);
        L->view = v;
        L->n_experts = cfg->experts;
        uint64_t whole, whole_span;
        qm__layout_tensors(v, cfg->experts, map, L, &whole, &whole_span);
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
                sz->whole_arena += qm__align_up(whole_span, align);
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
        qm__layer_pins(pb, cfg->experts, pins);
        for (uint32_t e = 0; e < cfg->experts; e++) {
            if (pins[e]) {
                sz->pinned_count++;
                sz->pinned_bytes += L->unit_bytes;
            } else {
                sz->unpinned_count++;
            }
        }
        if (L->unit_bytes > sz->max_unit)
            sz->max_unit = L->unit_bytes;
        if (L->unit_span > sz->slot_size)
            sz->slot_size = L->unit_span;
    }
    sz->slot_size = qm__align_up(sz->slot_size, align);
    return 0;
}

uint64_t qm__min_budget(const qm__sizing *sz)
{
    return sz->whole_accounted + sz->pinned_bytes + (sz->unpinned_count ? sz->max_unit : 0);
}

/* The budget travels in one place, the plan: with none, room for every
 * expert (the "whole model"). */
void qm__budget_in_force(const qm_residency_plan *plan, const qm_pager_options *opt, int *has,
                         uint64_t *budget)
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

uint32_t qm__slots_for(const qm__sizing *sz, uint64_t budget, uint32_t n_pinned)
{
    uint64_t paged = (uint64_t)sz->pinned_count + sz->unpinned_count;
    if (paged == 0)
        return 0;
    uint64_t unpinned = paged - n_pinned;
    uint64_t room = unpinned;
    if (sz->max_unit > 0)
        room = (budget - sz->whole_accounted - sz->pinned_bytes) / sz->max_unit;
    return (uint32_t)(n_pinned + (room < unpinned ? room : unpinned));
}

int qm__budget_refused(uint64_t budget, uint64_t whole, uint64_t pinned, uint64_t unit,
                       qm_status *st)
{
    return qm_status_set_field(
        st, QM_ERESOURCE_EXHAUSTED, "budget_bytes",
        "budget_bytes %llu is below the minimum of %llu bytes for this plan (whole banks "
        "%llu + pinned experts %llu + one expert unit %llu)",
        (unsigned long long)budget, (unsigned long long)(whole + pinned + unit),
        (unsigned long long)whole, (unsigned long long)pinned, (unsigned long long)unit);
}

void qm__fill_weights(const qm__layer *L, const uint8_t *unit_base, uint32_t e, int from_slot,
                      qm_expert_weights *w)
{
    w->r8 = !from_slot && L->whole_base ? L->r8 : 0;
    w->r8_part = w->r8_part_rows = 0;
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        if (!L->view->t[t].present) {
            w->ptr[t] = NULL;
        } else if (from_slot) {
            w->ptr[t] = unit_base + L->unit_off[t] + qm__slice_phase(L, t, e);
        } else if (L->whole_base) {
            w->ptr[t] = L->whole_base + L->tensor_off[t] + (uint64_t)e * L->slice[t];
        } else {
            w->ptr[t] = (const uint8_t *)L->view->t[t].data + (uint64_t)e * L->slice[t];
        }
    }
}

int qm_pager_min_budget(qm_backend *backend, const qm_bank *bank, const qm_residency_plan *plan,
                        const qm_pager_options *options, uint64_t *out, qm_status *st)
{
    if (!backend || !bank || !plan || !out)
        return qm_status_set(st, QM_EINVAL, "qm_pager_min_budget: NULL argument");
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    qm__layer *layers = qm_calloc(cfg->layers ? cfg->layers : 1, sizeof *layers);
    uint8_t *pins = qm_malloc(cfg->experts ? cfg->experts : 1);
    int rc = QM_ENOMEM;
    if (!layers || !pins) {
        qm_status_set(st, QM_ENOMEM, "out of memory");
        goto done;
    }
    qm__sizing sz;
    rc = qm__layout(backend, bank, plan, options, layers, pins, &sz, st);
    if (rc == 0)
        *out = qm__min_budget(&sz);
done:
    qm_free(layers);
    qm_free(pins);
    return rc;
}
