/* qm_pager_trace.h - recording a session's routing as a .qmtr trace
 * (qm_pager_trace.c; docs/TRACES.md). Private to engine/. */
#ifndef QM_PAGER_TRACE_H
#define QM_PAGER_TRACE_H

#include "qm_pager_impl.h"

/* Appends a forward call's routes ([tokens, route_k]) of `layer` to the
 * recording p's routing goes to (nothing without one); an I/O error stops
 * the recording. */
void qm__pager_trace_record(qm_pager *p, uint32_t layer, const uint32_t *route,
                            uint32_t tokens, uint32_t route_k);
void qm__pager_trace_close(qm_pager *p); /* ends p's recording, if any */
/* Sends p's routing to `owner`'s recording from now on (NULL or p: its
 * own): the pagers of a session over several devices share one trace. */
void qm__pager_trace_to(qm_pager *p, qm_pager *owner);

#endif
