/* qm_pager_layout.h - how a pager lays a bank out under a plan, and the
 * sizing that follows from it. Per layer: whether it is paged, whole or
 * another device's, each tensor's slice of one expert and where it lies in
 * a slot, where each tensor lies in the layer's whole-bank copy, which
 * experts are pinned; then the bytes the budget counts, the slot size, the
 * minimum budget and the slots a budget pays for.
 *
 * Pure: these functions read the bank, the plan, the options and the
 * backend's alignment, write only their out-parameters, allocate nothing
 * and keep no state, so qm_pager_min_budget and qm_pager_new size a plan
 * the same way. Private to engine/ (the pager's files). */
#ifndef QM_PAGER_LAYOUT_H
#define QM_PAGER_LAYOUT_H

#include <stdint.h>

#include "qm_pager.h"

/* Slices inside a slot start on this boundary so that every tensor's slice is
 * aligned for vector loads (and for CUDA kernels reading f32 scales). */
#define QM__UNIT_SLICE_ALIGN 64u
/* The disk source reads whole blocks of this size (O_DIRECT). Its layout
 * (opt->source QM_PAGER_SOURCE_DIRECT) puts every slice at the offset, modulo
 * the block, that it has in the file, inside a window of whole blocks: the
 * block-aligned read of the slice then lands straight where the kernels
 * read it, with no bounce copy. */
#define QM__DISK_BLOCK 4096u

/* One layer of the bank as a pager holds it. The layout fields are
 * qm__layout's and fixed for the pager's life; the state fields below them
 * belong to the pager (allocated by qm_pager_new for paged layers). */
typedef struct qm__layer {
    /* Layout */
    const qm_layer_view *view;
    int paged;
    int absent; /* served by another device's pager (opt.layer_mask) */
    uint32_t n_experts;
    uint64_t slice[QM_T_EXPERT_COUNT];    /* one expert's bytes per tensor (0 if absent) */
    uint64_t unit_off[QM_T_EXPERT_COUNT]; /* offset of each slice inside a slot */
    uint64_t unit_bytes;                  /* the catalog's bytes_per_expert (accounted) */
    uint64_t unit_span;                   /* bytes a unit spans in a slot (padding included) */
    /* The disk source's layout: unit_off[t] is the start of slice t's
     * window of whole blocks, the slice lies qm__slice_phase() into it;
     * tensor_off[t] already has its phase. file_off: each tensor's offset
     * in the bank file. */
    int direct;
    uint64_t file_off[QM_T_EXPERT_COUNT];
    uint64_t whole_bytes;                  /* whole bank, accounted: every expert tensor's bytes */
    uint64_t tensor_off[QM_T_EXPERT_COUNT]; /* whole bank: offsets inside whole_base */
    /* State */
    uint8_t *whole_base; /* whole bank: device copy, or NULL: served from the mapping */
    uint32_t r8;         /* whole copy: bit t set, weight tensor t in the r8 layout (qm_r8.h) */
    uint32_t r8_slot;    /* paged: the weight tensors a slot's unit may be laid out in r8 */
    int32_t *slot_of;    /* paged: [n_experts], -1 when not resident */
    uint8_t *pinned;     /* paged: [n_experts] 1 pinned, 2 pin released by a resize */
    uint8_t *mark;       /* paged: [n_experts] scratch for prefetch */
    /* The prediction's copy of the layer's router weight, bf16 [E][H] in
     * one block of the pager's (qm_pager_prefetch.c); NULL: the bank's. */
    const uint16_t *pred_router;
    /* Routing history (qm_pager_prefetch.c): `history` bitsets of words64 words, a ring. */
    uint64_t *hist;
    uint32_t words64;
    uint32_t hist_pos, hist_count;
} qm__layer;

/* What a plan costs on a backend. */
typedef struct qm__sizing {
    uint64_t whole_accounted; /* whole banks' bytes (budget) */
    uint64_t whole_arena;     /* whole banks' bytes copied into the arena (aligned) */
    uint64_t pinned_bytes;
    uint32_t pinned_count;
    uint32_t unpinned_count;
    uint64_t max_unit;  /* largest accounted unit over paged layers */
    uint64_t slot_size; /* largest unit span, aligned */
} qm__sizing;

uint64_t qm__align_up(uint64_t v, uint64_t a);
/* The alignment of the arena's regions: the backend's, at least
 * QM__UNIT_SLICE_ALIGN, and QM__DISK_BLOCK for the disk source's layout
 * (`opt` may be NULL). */
uint64_t qm__pager_align(const qm_backend *be, const qm_pager_options *opt);
/* Where slice t of expert e starts inside its window (0 unless L->direct). */
uint64_t qm__slice_phase(const qm__layer *L, int t, uint32_t e);
/* 1 when whole banks are copied into the arena (a backend that cannot read
 * the mapping, or opt->copy_whole_banks). `opt` may be NULL. */
int qm__copies_whole(const qm_pager_options *opt, const qm_backend *be);

/* Fills the layout fields of layers[0..cfg->layers) (zeroed by the caller)
 * and *sz. `pins` is the caller's scratch of cfg->experts bytes. QM_EINVAL
 * with a sentence for a plan that does not match the bank. */
int qm__layout(const qm_backend *be, const qm_bank *bank, const qm_residency_plan *plan,
               const qm_pager_options *opt, qm__layer *layers, uint8_t *pins, qm__sizing *sz,
               qm_status *st);
/* pin[0..n_experts) of a per-expert bank: 1 for the experts the decision
 * pins or does not let the pager page, 0 for the others. */
void qm__layer_pins(const qm_plan_bank *pb, uint32_t n_experts, uint8_t *pin);

/* Whole banks + pins + one expert unit when anything is paged. */
uint64_t qm__min_budget(const qm__sizing *sz);
/* The budget a pager keeps: opt->budget_bytes, else the plan's; *has 0
 * (and UINT64_MAX) when neither gives one. */
void qm__budget_in_force(const qm_residency_plan *plan, const qm_pager_options *opt, int *has,
                         uint64_t *budget);
/* Slots `budget` pays for with n_pinned pins and sz->pinned_bytes of them:
 * the pins, then as many expert units as fit, at most one per unpinned
 * expert. 0 when nothing is paged. */
uint32_t qm__slots_for(const qm__sizing *sz, uint64_t budget, uint32_t n_pinned);
/* QM_ERESOURCE_EXHAUSTED, field "budget_bytes", saying that `budget` is below
 * whole + pinned + unit and of what that minimum is made. */
int qm__budget_refused(uint64_t budget, uint64_t whole, uint64_t pinned, uint64_t unit,
                       qm_status *st);

/* Weights of expert e of L: in the unit at `unit_base` (from_slot), else
 * the layer's whole-bank copy or the mapping. */
void qm__fill_weights(const qm__layer *L, const uint8_t *unit_base, uint32_t e, int from_slot,
                      qm_expert_weights *w);

#endif
