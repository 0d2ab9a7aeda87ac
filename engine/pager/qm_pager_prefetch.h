/* qm_pager_prefetch.h - the routing history and prefetch of the next
 * layer's predicted experts (qm_pager_prefetch.c), above the copy path.
 * Private to engine/. */
#ifndef QM_PAGER_PREFETCH_H
#define QM_PAGER_PREFETCH_H

#include "qm_pager_impl.h"

/* A prefetched expert of `source` (a QM__PF_* source) was used before being
 * evicted: counted, and fed to that source's gating. */
void qm__pager_prefetch_useful(qm_pager *p, uint8_t source);
/* Records a forward call's routes route[0..n) of `layer` in its history. */
void qm__pager_history_record(qm_pager *p, uint32_t layer, const uint32_t *route, size_t n);
/* After a forward call of k routes a token: predicts the next layer's
 * experts and prefetches them (best effort, with prefetch on). */
void qm__pager_prefetch_next(qm_pager *p, const qm_moe_call *call, uint32_t k);
/* The same, kept for later (opt.defer_prefetch): what prediction reads of
 * the call, its hidden states copied; run by qm__pager_prefetch_kept.
 * 0 (nothing to keep with prefetch off), -1 without memory for the copy. */
/* qm_pager_prefetch (qm_pager.c settles the pager first). */
int qm__pager_prefetch_experts(qm_pager *p, uint32_t layer, const uint32_t *experts, size_t n,
                               qm_status *st);
int qm__pager_prefetch_keep(qm_pager *p, const qm_moe_call *call, uint32_t k);
void qm__pager_prefetch_kept(qm_pager *p);
/* The routing history of each paged layer (opt.history calls), counted in
 * stats.host_bytes. */
int qm__pager_prefetch_start(qm_pager *p, qm_status *st);
/* Frees the history and the prediction's scratch (teardown; accepts a
 * pager whose start failed or never ran). */
void qm__pager_prefetch_free(qm_pager *p);

#endif
