/* qm_pager_source.h - the pager as the forward pass's expert source
 * (qm_pager_source.c): acquire makes a wave of experts usable, paging
 * misses in through the copy path, release lets them be evicted again.
 * Private to engine/. */
#ifndef QM_PAGER_SOURCE_H
#define QM_PAGER_SOURCE_H

#include "qm_pager_impl.h"

/* Fills p->source (version, ctx, acquire, release; hybrid execution adds
 * its split later). */
void qm__pager_source_init(qm_pager *p);

#endif
