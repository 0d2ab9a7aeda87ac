/* qm_hybrid.h - hybrid execution (qm_hybrid.c; qm_pager_options.on_miss):
 * the pager's answer to "run this non-resident expert on the host, or page
 * it in?". Above the copy path. Private to engine/. */
#ifndef QM_HYBRID_H
#define QM_HYBRID_H

#include "qm_pager_impl.h"

/* With on_miss host or auto: the host backend, auto's first measures, and
 * the source's split. Nothing with on_miss page; QM_EINVAL for another value. */
int qm__hybrid_start(qm_pager *p, qm_status *st);
void qm__hybrid_stop(qm_pager *p);
/* After a successful forward call: auto's admissions and model refresh. */
int qm__hybrid_observe(qm_pager *p, const qm_moe_stats *ms, qm_status *st);

#endif
