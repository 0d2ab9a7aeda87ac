/* qm_pager.c - the top of the paging authority: a pager's creation (the
 * layout, the one arena carved into whole banks and slots, whole banks,
 * pins and the preload loaded), its teardown, the session's forward call
 * (the forward pass through the pager's source, then hybrid admissions,
 * history, trace and prefetch of the next layer) and introspection. Every
 * other pager file sits below this one (qm_pager_impl.h). */
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_hybrid.h"
#include "qm_pager_copy.h"
#include "qm_pager_disk.h"
#include "qm_pager_prefetch.h"
#include "qm_pager_source.h"
#include "qm_pager_trace.h"
#include "qm_r8.h"
#include "qm_kernels.h"

static void qm__layers_free(qm__layer *layers, uint32_t n)
{
    if (!layers)
        return;
    for (uint32_t l = 0; l < n; l++) {
        qm_free(layers[l].slot_of);
        qm_free(layers[l].pinned);
        qm_free(layers[l].mark);
    }
    qm_free(layers);
}

/* The maps of each paged layer, its pins from the plan. */
static int qm__layers_alloc(qm_pager *p, const qm_residency_plan *plan, qm_status *st)
{
    for (uint32_t l = 0; l < p->n_layers; l++) {
        qm__layer *L = &p->layers[l];
        if (!L->paged)
            continue;
        L->slot_of = qm_malloc(sizeof(int32_t) * L->n_experts);
        L->pinned = qm_calloc(L->n_experts, 1);
        L->mark = qm_calloc(L->n_experts, 1);
        if (!L->slot_of || !L->pinned || !L->mark)
            return qm_status_set(st, QM_ENOMEM, "out of memory for the pager's expert map");
        for (uint32_t e = 0; e < L->n_experts; e++)
            L->slot_of[e] = -1;
        qm__layer_pins(qm_plan_find_bank(plan, l), L->n_experts, L->pinned);
    }
    return 0;
}

/* Half of this machine's RAM (0 when unknown): the most a pager maps in or
 * lays out at creation. */
static uint64_t qm__half_ram(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page / 2 : 0;
}

/* Whether opt.interleave can apply at all: asked for, a host-visible
 * backend and a fast kernel that reads r8 itself. */
static int qm__r8_wanted(const qm_pager *p)
{
    return p->opt.interleave && qm_backend_host_visible(p->backend) &&
           qm__i8kernel_r8_native(qm__i8kernel_select(), 1, p->cfg->bits);
}

/* Whether opt.interleave applies to whole banks (qm_pager_options): it can
 * (qm__r8_wanted), a 4-bit weight tensor the layout takes, and the bank's
 * expert bytes within half the RAM. */
static int qm__interleave_applies(const qm_pager *p)
{
    if (!qm__r8_wanted(p))
        return 0;
    if (qm_bank_expert_bytes_total(p->bank) > qm__half_ram())
        return 0;
    static const int W[] = {QM_T_FC1_WEIGHT, QM_T_FC2_WEIGHT, QM_T_FC3_WEIGHT};
    for (uint32_t l = 0; l < p->cfg->layers; l++)
        for (int i = 0; i < 3; i++)
            if (qm__r8_eligible(p->cfg, qm_bank_layer(p->bank, l), W[i]))
                return 1;
    return 0;
}

/* A whole layer just copied into the arena: its weight tensors the layout
 * takes put in the r8 layout, expert by expert, in place. */
static int qm__interleave_layer(qm_pager *p, qm__layer *L, qm_status *st)
{
    static const int W[] = {QM_T_FC1_WEIGHT, QM_T_FC2_WEIGHT, QM_T_FC3_WEIGHT};
    for (int i = 0; i < 3; i++) {
        const qm_tensor_view *tv = &L->view->t[W[i]];
        if (!qm__r8_eligible(p->cfg, L->view, W[i]))
            continue;
        uint32_t n = (uint32_t)tv->shape[1];
        size_t rb = (size_t)tv->shape[2];
        uint8_t *tmp = qm_malloc(8 * rb);
        if (!tmp)
            return qm_status_set(st, QM_ENOMEM, "out of memory interleaving a whole bank");
        uint8_t *base = L->whole_base + L->tensor_off[W[i]];
        for (uint32_t e = 0; e < L->n_experts; e++)
            qm__r8_interleave(base + (uint64_t)e * L->slice[W[i]], n, rb, tmp);
        qm_free(tmp);
        L->r8 |= 1u << W[i];
        p->stats.bytes_interleaved_at_create += tv->nbytes;
    }
    return 0;
}

/* ---- Paged units in the r8 layout ----
 * A fast session's paged units land in the bank's row layout (a read
 * straight into the slot). Laying a unit out when it landed, on the call's
 * path, cost more than it saved (docs/PAGING.md); here it happens when the
 * caller says its engine is not waiting (qm_pager_tidy, after a call's
 * answer), QM__R8_PIECE_BYTES at a time, for a unit a call has used (not
 * one prefetched and never asked for), the most used first, whatever the
 * session's hit rate: gating it on a recent hit rate of 90% too (the
 * layout's cost against what a use saves) lost 5-8% of decode at 50% of a
 * GPT-OSS-shaped bank, and waiting for a second use 3-4% at 50% and 25%
 * and nothing at 10% (docs/PAGING.md, "After the answer"). A tensor laid
 * out in part is in r8 up to a row on a tile's edge (r8_part_rows):
 * the kernels take each 16-row tile in its own layout. What a session
 * loads at its creation (pins, the preload, qm_pager_warm: its hottest
 * experts) is laid out there, all at once (qm_pager_interleave_resident).
 * Outputs are the same bits in either layout. */
#define QM__R8_SLOT_MIN_USES 1
/* A piece after an answer: about 0.2 ms at 10-12 GB/s, less than the gap
 * between two layer calls of a decode on the e2e shapes, so the next call
 * seldom waits for it (a whole 14 MB GPT-OSS-20B-shaped unit took 1.5 ms,
 * which the next call waited for: 354 against 163 us beyond compute a
 * call at 50% of that bank). */
#define QM__R8_PIECE_BYTES (2u << 20)

static int qm__r8_slots_start(qm_pager *p, qm_status *st)
{
    if (!qm__r8_wanted(p))
        return 0;
    static const int W[] = {QM_T_FC1_WEIGHT, QM_T_FC2_WEIGHT, QM_T_FC3_WEIGHT};
    size_t tmp = 0;
    for (uint32_t l = 0; l < p->n_layers; l++) {
        qm__layer *L = &p->layers[l];
        if (!L->paged || L->absent)
            continue;
        for (int i = 0; i < 3; i++) {
            if (!qm__r8_eligible(p->cfg, L->view, W[i]))
                continue;
            L->r8_slot |= 1u << W[i];
            size_t need = 8 * (size_t)L->view->t[W[i]].shape[2];
            tmp = need > tmp ? need : tmp;
        }
    }
    if (tmp && !(p->r8_tmp = qm_malloc(tmp)))
        return qm_status_set(st, QM_ENOMEM, "out of memory for the r8 layout's scratch");
    return 0;
}

/* Slot sl's unit into the r8 layout, in place, from where it stands: the
 * tensor laid out in part first, then the others in order, `budget` bytes
 * at most (whole tiles of QM__TILE_ROWS rows, at least one). Nothing reads
 * or writes the slot meanwhile: its copy landed and no call holds it. */
static void qm__r8_slot(qm_pager *p, qm__slot *sl, uint64_t budget)
{
    const qm__layer *L = &p->layers[sl->layer];
    qm_expert_weights w;
    qm__fill_weights(L, sl->base, sl->expert, 1, &w);
    while (budget && (L->r8_slot & ~sl->r8)) {
        uint32_t t = sl->r8_part;
        if (!sl->r8_part_rows)
            for (t = 0; !(L->r8_slot >> t & 1u) || (sl->r8 >> t & 1u); t++)
                ;
        const qm_tensor_view *tv = &L->view->t[t];
        const uint32_t n = (uint32_t)tv->shape[1], from = sl->r8_part_rows;
        const size_t rb = (size_t)tv->shape[2];
        uint64_t rows = budget / rb / QM__TILE_ROWS * QM__TILE_ROWS;
        if (rows < QM__TILE_ROWS)
            rows = QM__TILE_ROWS;
        uint32_t to = rows >= n - from ? n : from + (uint32_t)rows;
        qm__r8_interleave((uint8_t *)w.ptr[t] + (size_t)from * rb, to - from, rb, p->r8_tmp);
        uint64_t done = (uint64_t)(to - from) * rb;
        p->stats.bytes_interleaved_paged += done;
        budget = done >= budget ? 0 : budget - done;
        if (to == n) {
            sl->r8 |= 1u << t;
            sl->r8_part_rows = 0;
            if (sl->r8 == L->r8_slot)
                p->stats.units_interleaved_paged++;
        } else {
            sl->r8_part = t;
            sl->r8_part_rows = to;
        }
    }
}

uint64_t qm_pager_interleave_resident(qm_pager *p)
{
    uint64_t was = p && p->r8_tmp ? p->stats.bytes_interleaved_paged : 0;
    for (uint32_t s = 0; p && p->r8_tmp && s < p->n_slots; s++) {
        qm__slot *sl = &p->slots[s];
        if (sl->state == QM__SLOT_RESIDENT && !sl->refs)
            qm__r8_slot(p, sl, UINT64_MAX);
    }
    return p ? p->stats.bytes_interleaved_paged - was : 0;
}

static void qm__r8_slot_step(qm_pager *p)
{
    if (!p->r8_tmp)
        return;
    qm__slot *best = NULL;
    for (uint32_t s = 0; s < p->n_slots; s++) {
        qm__slot *sl = &p->slots[s];
        if (sl->state != QM__SLOT_RESIDENT || sl->refs || sl->uses < QM__R8_SLOT_MIN_USES)
            continue;
        if (!(p->layers[sl->layer].r8_slot & ~sl->r8) || (best && best->uses >= sl->uses))
            continue;
        best = sl;
    }
    if (best)
        qm__r8_slot(p, best, p->opt.r8_piece_bytes ? p->opt.r8_piece_bytes : QM__R8_PIECE_BYTES);
}

/* ---- After a call's answer ---- */

/* What follows a forward call's compute: the next layers' prefetch, now,
 * or kept for qm__pager_settle (opt.defer_prefetch; at once when the
 * call's hidden states could not be copied). */
static void qm__after_call(qm_pager *p, const qm_moe_call *call, uint32_t k)
{
    if (p->opt.defer_prefetch && qm__pager_prefetch_keep(p, call, k) == 0)
        return;
    qm__pager_prefetch_next(p, call, k);
}

/* The work a forward call left for after its answer, run now if any:
 * before anything else touches the slots (a forward, prefetch, warm or
 * resize). */
static void qm__pager_settle(qm_pager *p) { qm__pager_prefetch_kept(p); }

void qm_pager_after_forward(qm_pager *p)
{
    if (p)
        qm__pager_settle(p);
}

void qm_pager_tidy(qm_pager *p)
{
    if (!p)
        return;
    qm__pager_settle(p);
    qm__r8_slot_step(p);
}

int qm_pager_prefetch(qm_pager *p, uint32_t layer, const uint32_t *experts, size_t n,
                      qm_status *st)
{
    if (p)
        qm__pager_settle(p);
    return qm__pager_prefetch_experts(p, layer, experts, n, st);
}

int qm_pager_resize(qm_pager *p, uint64_t budget, qm_status *st)
{
    if (!p)
        return qm_status_set(st, QM_EINVAL, "qm_pager_resize: NULL pager");
    qm__pager_settle(p);
    return qm__pager_resize(p, budget, st);
}

/* A whole bank read in place: its pages mapped now, not on the first
 * calls, while what is mapped in stays under half of the RAM (a bank
 * larger than that would only evict its own first pages). */
static void qm__prefault_whole(qm_pager *p, const qm__layer *L, uint64_t half_ram)
{
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        const qm_tensor_view *tv = &L->view->t[t];
        if (tv->present && p->stats.bytes_prefaulted_at_create + tv->nbytes <= half_ram)
            p->stats.bytes_prefaulted_at_create += qm_bank_prefault(p->bank, tv->data, tv->nbytes);
    }
}

/* Copies layer L's whole bank into its place in the arena (the disk
 * source's I/O engine has read it already). */
static int qm__copy_whole(qm_pager *p, qm__layer *L, qm_status *st)
{
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        const qm_tensor_view *tv = &L->view->t[t];
        if (!tv->present || tv->nbytes == 0)
            continue;
        p->stats.bytes_loaded_at_create += tv->nbytes;
        if (qm__pager_disk_async(p))
            continue;
        int rc = qm__pager_copy_now(p, L->whole_base + L->tensor_off[t], tv->data, tv->nbytes, st);
        if (rc)
            return rc;
        if (!p->disk) /* the copy is what runs: the mapping's pages need not stay */
            qm_bank_release_pages(p->bank, tv->data, tv->nbytes);
    }
    return 0;
}

/* Whole banks: accounted for the session's life; copied into the arena when
 * the backend cannot read the mapping (the disk source reads every layer's
 * at once). */
static int qm__load_whole(qm_pager *p, uint64_t arena_off, uint64_t align, qm_status *st)
{
    int copy_whole = qm__copies_whole(&p->opt, p->backend);
    const uint64_t half_ram = qm__half_ram();
    for (uint32_t l = 0; l < p->n_layers; l++) {
        qm__layer *L = &p->layers[l];
        if (L->paged || L->absent)
            continue;
        int rc = qm__pager_account_alloc(p, L->whole_bytes, st);
        if (rc)
            return rc;
        if (!copy_whole) {
            qm__prefault_whole(p, L, half_ram);
            continue;
        }
        L->whole_base = qm_arena_at(p->arena, arena_off);
        uint64_t span = 0;
        for (int t = 0; t < QM_T_EXPERT_COUNT; t++)
            if (L->view->t[t].present && L->view->t[t].nbytes)
                span = L->tensor_off[t] + L->view->t[t].nbytes;
        arena_off += qm__align_up(span, align);
    }
    int rc = copy_whole && qm__pager_disk_async(p) ? qm__pager_disk_read_whole(p, st) : 0;
    for (uint32_t l = 0; l < p->n_layers && rc == 0; l++) {
        qm__layer *L = &p->layers[l];
        if (!L->whole_base)
            continue;
        rc = qm__copy_whole(p, L, st);
        if (rc == 0 && p->opt.interleave)
            rc = qm__interleave_layer(p, L, st);
    }
    return rc;
}

/* At creation, the copy of every paged expert to load issued into a free
 * slot, claimed as `claim`: the pins (QM__CLAIM_PIN), or every expert not
 * resident yet (QM__CLAIM_PRELOAD). The copies are left in flight. */
static int qm__issue_at_create(qm_pager *p, qm__claim claim, qm_status *st)
{
    const int pins = claim == QM__CLAIM_PIN;
    int rc = 0;
    for (uint32_t l = 0; l < p->n_layers && rc == 0; l++) {
        qm__layer *L = &p->layers[l];
        if (!L->paged)
            continue;
        for (uint32_t e = 0; e < L->n_experts && rc == 0; e++) {
            if (pins ? !L->pinned[e] : L->slot_of[e] >= 0)
                continue;
            int32_t s = qm__pager_free_slot(p);
            if (s < 0)
                return qm_status_set(st, QM_EINTERNAL, "no slot left for %s expert %u/%u",
                                     pins ? "pinned" : "preloaded", l, e);
            if ((rc = qm__pager_claim(p, s, l, e, claim, QM__PF_NONE, st)))
                break;
            p->stats.n_pinned += pins;
            p->stats.bytes_loaded_at_create += L->unit_bytes;
            rc = qm__pager_copy_unit(p, s, st);
        }
    }
    return rc;
}

/* The pins: copies issued together, then waited. */
static int qm__load_pins(qm_pager *p, qm_status *st)
{
    int rc = qm__issue_at_create(p, QM__CLAIM_PIN, st);
    /* A pin whose copy failed holds a slot nobody frees: fail the pager. */
    for (uint32_t s = 0; s < p->n_slots; s++) {
        if (p->slots[s].state != QM__SLOT_LOADING)
            continue;
        int w = qm__pager_copy_wait(p, (int32_t)s, rc ? NULL : st);
        if (w && !rc)
            rc = w;
    }
    return rc;
}

/* When the budget holds every expert, paging can only add first-touch
 * misses: load everything now (copies issued together, then waited), so a
 * 100% session hits from its first call. The experts stay evictable. */
static int qm__preload_all(qm_pager *p, qm_status *st)
{
    int rc = qm__issue_at_create(p, QM__CLAIM_PRELOAD, st);
    int w = qm_pager_sync(p, rc ? NULL : st);
    return rc ? rc : w;
}

int qm_pager_warm(qm_pager *p, uint32_t layer, const uint32_t *experts, size_t n,
                  qm_status *st)
{
    int checked = qm__pager_check_call(p, "qm_pager_warm", layer, experts, n, st);
    if (checked)
        return checked;
    qm__pager_settle(p);
    qm__layer *L = &p->layers[layer];
    if (!L->paged || L->absent)
        return 0;
    int loaded = 0, rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        uint32_t e = experts[i];
        if (e >= L->n_experts || L->slot_of[e] >= 0)
            continue;
        int32_t s = qm__pager_free_slot(p);
        if (s < 0)
            break; /* full: one warm expert never evicts another */
        if ((rc = qm__pager_claim(p, s, layer, e, QM__CLAIM_PRELOAD, QM__PF_NONE, st)))
            break;
        if ((rc = qm__pager_copy_unit(p, s, st))) {
            qm__pager_drop(p, s);
            break;
        }
        p->stats.bytes_loaded_at_create += L->unit_bytes;
        loaded++;
    }
    return rc ? rc : loaded;
}

/* The one arena: whole banks first (when copied), then n_slots slots. */
static int qm__arena_carve(qm_pager *p, uint64_t *arena_bytes, qm_status *st)
{
    const qm__sizing *sz = &p->sz;
    unsigned long long slots_bytes = 0, bytes = 0;
    if (qm_mul_u64(p->n_slots, sz->slot_size, &slots_bytes) ||
        qm_add_u64(slots_bytes, sz->whole_arena, &bytes))
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED, "arena size overflows");
    /* Room to start the carve on the layout's alignment (the disk source's
     * blocks) whatever the backend gives. */
    const uint64_t align = qm__pager_align(p->backend, &p->opt);
    const uint64_t slack = bytes && align > qm_backend_alignment(p->backend) ? align : 0;
    if (slack && qm_add_u64(bytes, slack, &bytes))
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED, "arena size overflows");
    *arena_bytes = bytes;
    if (bytes > 0) {
        int rc = qm_arena_new(p->backend, bytes, &p->arena, st);
        if (rc)
            return rc;
        uintptr_t base = (uintptr_t)qm_arena_at(p->arena, 0);
        p->arena_skew = slack ? (align - base % align) % align : 0;
        qm__pager_disk_lock(p, p->arena);
        qm__pager_disk_arenas(p);
    }
    if (p->n_slots == 0)
        return 0;
    p->slots = qm_calloc(p->n_slots, sizeof *p->slots);
    if (!p->slots || qm__pager_scratch_regrow(p, 0, p->n_slots))
        return qm_status_set(st, QM_ENOMEM, "out of memory for %u slots", p->n_slots);
    for (uint32_t s = 0; s < p->n_slots; s++)
        p->slots[s].base = qm_arena_at(p->arena, p->arena_skew + sz->whole_arena +
                                                     (uint64_t)s * sz->slot_size);
    return qm__pager_disk_slots(p, p->n_slots, st);
}

/* The layout and the budget: the pager's layers, sizing and slot count. */
static int qm__size(qm_pager *p, const qm_residency_plan *plan, qm_status *st)
{
    uint8_t *pins = qm_malloc(p->cfg->experts ? p->cfg->experts : 1);
    if (!pins)
        return qm_status_set(st, QM_ENOMEM, "out of memory for the pager's layout");
    int rc = qm__layout(p->backend, p->bank, plan, &p->opt, p->layers, pins, &p->sz, st);
    qm_free(pins);
    if (rc)
        return rc;
    const qm__sizing *sz = &p->sz;
    qm__budget_in_force(plan, &p->opt, &p->has_budget, &p->budget);
    if (p->has_budget && p->budget < qm__min_budget(sz))
        return qm__budget_refused(p->budget, sz->whole_accounted, sz->pinned_bytes,
                                  sz->unpinned_count ? sz->max_unit : 0, st);
    p->n_slots = qm__slots_for(sz, p->budget, sz->pinned_count);
    p->slot_cap = p->n_slots;
    return qm__layers_alloc(p, plan, st);
}

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
    p->opt.interleave = qm__interleave_applies(p);
    if (p->opt.interleave)
        p->opt.copy_whole_banks = 1; /* r8 copies in the arena (qm_r8.h) */
    p->n_layers = p->cfg->layers;
    p->layers = qm_calloc(p->n_layers, sizeof *p->layers);
    if (!p->layers) {
        qm_status_set(st, QM_ENOMEM, "out of memory for the pager's layers");
        goto fail;
    }
    if ((rc = qm__moe_scratch_new(&p->scratch, st)) || (rc = qm__size(p, plan, st)) ||
        (rc = qm__r8_slots_start(p, st)))
        goto fail;
    const qm__sizing *sz = &p->sz;
    const uint32_t n_paging = p->n_slots - sz->pinned_count;
    uint64_t arena_bytes = 0;
    if ((rc = qm__arena_carve(p, &arena_bytes, st)) || (rc = qm__pager_prefetch_start(p, st)))
        goto fail;
    rc = qm__load_whole(p, p->arena_skew, qm__pager_align(backend, &p->opt), st);
    if (rc)
        goto fail;
    /* The disk source's I/O engine reads by itself: no copy thread. */
    int want_thread = !qm__pager_disk_async(p) &&
                      (p->opt.copy_thread == 1 ||
                       (p->opt.copy_thread != 2 && qm_backend_host_visible(backend)));
    if (want_thread && p->n_slots) {
        rc = qm__pager_copy_start(p, st);
        if (rc)
            goto fail;
    }
    rc = qm__load_pins(p, st);
    if (rc)
        goto fail;
    if (!p->opt.no_preload && n_paging > 0 && n_paging == sz->unpinned_count) {
        rc = qm__preload_all(p, st);
        if (rc)
            goto fail;
    }
    qm_pager_interleave_resident(p); /* the pins and the preload */
    qm__pager_source_init(p);
    rc = qm__hybrid_start(p, st);
    if (rc)
        goto fail;
    p->stats.budget_bytes = p->budget;
    p->stats.arena_bytes = arena_bytes;
    p->stats.slot_bytes = sz->slot_size;
    p->stats.n_slots = p->n_slots;
    uint64_t counted = (sz->whole_arena ? sz->whole_accounted : 0) + sz->pinned_bytes +
                       (uint64_t)n_paging * sz->max_unit;
    p->stats.overhead_bytes = arena_bytes > counted ? arena_bytes - counted : 0;
    p->stats.host_bytes += sizeof *p + p->n_layers * sizeof *p->layers +
                           p->n_slots * (sizeof *p->slots + sizeof *p->cand_refs + 8);
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
    qm__pager_disk_drain(p); /* prefetch reads may still be landing in the arenas */
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
    qm__pager_prefetch_free(p);
    qm_free(p->r8_tmp);
    qm__layers_free(p->layers, p->n_layers);
    qm_free(p->slots);
    qm_free(p->cand_refs); /* and cand_slots, wave_slots */
    qm_free(p->route_buf);
    qm__moe_scratch_free(p->scratch);
    qm_free(p);
}

/* ---- The forward call ----------------------------------------------------------------- */

int qm_pager_forward(qm_pager *p, const qm_moe_call *call, qm_moe_stats *mstats, qm_status *st)
{
    if (!p || !call)
        return qm_status_set(st, QM_EINVAL, "qm_pager_forward: NULL argument");
    if (call->layer < p->n_layers && p->layers[call->layer].absent)
        return qm_status_set_field(st, QM_EINVAL, "layer", "layer %u is placed on another device",
                                   call->layer);
    qm__pager_settle(p);
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
    const uint64_t missed = p->stats.misses + p->stats.host_runs;
    qm__pager_disk_call_begin(p);
    if (rc == 0)
        rc = qm__moe_forward_layer(p->backend, p->cfg, layer, &c, &p->source, p->scratch, mstats,
                                   st);
    if (rc == 0 && call->n_tokens && call->layer < p->n_layers) {
        rc = qm__hybrid_observe(p, mstats, st);
        p->calls_since_miss =
            p->stats.misses + p->stats.host_runs != missed ? 0 : p->calls_since_miss + 1;
        if (rc == 0) {
            qm__pager_history_record(p, call->layer, c.route_experts, need);
            qm__pager_trace_record(p, call->layer, c.route_experts, call->n_tokens, route_k);
            qm__after_call(p, call, route_k);
        }
    }
    qm__pager_disk_call_end(p);
    return rc;
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
