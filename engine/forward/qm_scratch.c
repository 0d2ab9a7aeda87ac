/* qm_scratch.c - see qm_scratch.h. */
#include "qm_scratch.h"

#include "qm_alloc.h"

#define QM__CARVE_ALIGN 64u

void *qm__carve(qm__carver *c, uint64_t count, size_t elem)
{
    unsigned long long bytes, end;
    if (c->overflow || qm_mul_u64(count, elem, &bytes) || qm_add_u64(c->off, bytes, &end) ||
        qm_add_u64(end, QM__CARVE_ALIGN - 1, &end) || end > SIZE_MAX) {
        c->overflow = 1;
        return NULL;
    }
    void *p = c->base ? c->base + c->off : NULL;
    c->off = (size_t)(end & ~(unsigned long long)(QM__CARVE_ALIGN - 1));
    return p;
}

uint64_t qm__mul_sat(uint64_t a, uint64_t b)
{
    unsigned long long r;
    return qm_mul_u64(a, b, &r) ? UINT64_MAX : (uint64_t)r;
}

int qm__block_carve(qm__block *blk, qm__layout_fn layout, const qm__dims *d, void *out,
                    qm_status *st)
{
    qm__carver c = {0};
    layout(&c, d, out);
    if (c.overflow)
        return qm_status_set(st, QM_ENOMEM, "a %u-token forward pass needs more scratch than "
                                            "this machine can address", d->T);
    if (c.off > blk->cap) {
        /* Freed first: the contents are per call, and the peak stays lower. */
        qm_free(blk->base);
        blk->base = qm_malloc(c.off);
        blk->cap = blk->base ? c.off : 0;
        if (!blk->base)
            return qm_status_set(st, QM_ENOMEM, "out of memory for a %u-token forward pass",
                                 d->T);
    }
    c = (qm__carver){.base = blk->base};
    layout(&c, d, out);
    return 0;
}

void qm__block_free(qm__block *blk)
{
    qm_free(blk->base);
    blk->base = NULL;
    blk->cap = 0;
}
