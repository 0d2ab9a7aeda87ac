/* qm_scratch.h - grow-only scratch blocks carved per layer call: the
 * forward pass (qm_moe.c) and the host routing (qm_host_route.c) each lay
 * their arrays out in one block that grows to the largest call served and
 * never shrinks, so a session in its steady state allocates nothing per
 * call. Private to engine/. */
#ifndef QM_SCRATCH_H
#define QM_SCRATCH_H

#include <stddef.h>
#include <stdint.h>

#include "qm_error.h"

/* A block owns `base` (qm_malloc'ed, cap bytes; NULL and 0 when empty). */
typedef struct qm__block {
    void *base;
    size_t cap;
} qm__block;

/* Lays arrays out in a block: a first pass with base NULL sizes it, a second
 * hands out the pointers. */
typedef struct qm__carver {
    uint8_t *base;
    size_t off;
    int overflow;
} qm__carver;

/* The shape of one layer call. */
typedef struct qm__dims {
    uint32_t T, E, k, H;
    int need_logits; /* the call brought no router logits */
} qm__dims;

/* Fills the pointers of `out` from c (NULL while c->base is NULL). */
typedef void (*qm__layout_fn)(qm__carver *c, const qm__dims *d, void *out);

/* count * elem bytes, 64-byte aligned, from c; NULL (and c->overflow) when
 * the size overflows. */
void *qm__carve(qm__carver *c, uint64_t count, size_t elem);
/* a * b, or UINT64_MAX when it overflows (qm__carve then reports it). */
uint64_t qm__mul_sat(uint64_t a, uint64_t b);
/* Grows `blk` (never shrinks it) to what `layout` needs for `d` and carves
 * it into `out`. QM_ENOMEM with a sentence naming the call's tokens. */
int qm__block_carve(qm__block *blk, qm__layout_fn layout, const qm__dims *d, void *out,
                    qm_status *st);
void qm__block_free(qm__block *blk); /* leaves it empty */

#endif
