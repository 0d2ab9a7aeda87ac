/* qm_pager_copy.h - the pager's copy path: how a claimed slot's unit gets
 * its bytes (the backend's copy_h2d with fences, or the pager's copy thread
 * for host-visible backends, reading the mapping or the disk source) and
 * when it may be used or given back. Above the slots; below prefetch,
 * resize, hybrid execution and the expert source. Private to engine/. */
#ifndef QM_PAGER_COPY_H
#define QM_PAGER_COPY_H

#include "qm_pager_impl.h"

/* Starts the copy thread (host-visible backends): a FIFO of n_slots + 1
 * unit jobs, its bytes counted in stats.host_bytes. */
int qm__pager_copy_start(qm_pager *p, qm_status *st);
void qm__pager_copy_stop(qm_pager *p); /* joins the thread; nothing may be in flight after */
/* Issues the copy of slot s's unit (layer/expert already set). */
int qm__pager_copy_unit(qm_pager *p, int32_t s, qm_status *st);
/* Waits for slot s's copy; marks it RESIDENT on success, leaves it LOADING
 * (with nothing in flight) on failure. */
int qm__pager_copy_wait(qm_pager *p, int32_t s, qm_status *st);
/* Copies n bytes at src (the mapping) to dst now, on the caller's thread
 * (creation's whole banks). */
int qm__pager_copy_now(qm_pager *p, void *dst, const void *src, uint64_t n, qm_status *st);
/* Evicts slot s: waits for a copy that may still be writing into it, frees
 * it (qm__pager_drop) and counts the eviction. */
void qm__pager_evict(qm_pager *p, int32_t s);
/* Grows slots[] to n entries (the new ones uninitialised) and, with the
 * copy thread, its queue to n + 1 jobs, holding the thread off while the
 * array moves (it reads slots[] under its lock). Nothing may be queued
 * (after qm_pager_sync). QM_ENOMEM leaves both as they were. */
int qm__pager_slots_regrow(qm_pager *p, uint32_t n, qm_status *st);

#endif
