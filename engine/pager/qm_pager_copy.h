/* qm_pager_copy.h - the pager's copy path: how a claimed slot's unit gets
 * its bytes (the backend's copy_h2d with fences, the pager's copy thread
 * for host-visible backends reading the mapping or the serial disk source,
 * or the disk source's I/O engine) and when it may be used or given back.
 * Above the slots; below prefetch, resize, hybrid execution and the expert
 * source. Private to engine/. */
#ifndef QM_PAGER_COPY_H
#define QM_PAGER_COPY_H

#include "qm_pager_impl.h"

/* Starts the copy thread (host-visible backends): a FIFO of n_slots + 1
 * unit jobs, its bytes counted in stats.host_bytes. */
int qm__pager_copy_start(qm_pager *p, qm_status *st);
void qm__pager_copy_stop(qm_pager *p); /* joins the thread; nothing may be in flight after */
/* Issues the copy of slot s's unit (layer/expert already set). With the
 * disk source's I/O engine a unit claimed by prefetch (slot.prefetched) is
 * read at prefetch priority, behind every demand read; any other at demand
 * priority. */
int qm__pager_copy_unit(qm_pager *p, int32_t s, qm_status *st);
/* Waits for slot s's copy; marks it RESIDENT on success, leaves it LOADING
 * (with nothing in flight) on failure. */
int qm__pager_copy_wait(qm_pager *p, int32_t s, qm_status *st);
/* A prefetch's copy in flight in slot s is needed now: ahead of prefetches
 * (the disk source's I/O engine; the other copy paths keep their order). */
void qm__pager_copy_promote(qm_pager *p, int32_t s);
/* 1 while slot s's read (the disk source's I/O engine) is parked: a
 * prefetch stopped part way (qm__pager_park_unasked). A wait, a promotion
 * or qm__pager_copy_resume takes it up again; an eviction or a sync gives
 * the slot back without reading the rest. */
int qm__pager_copy_parked(qm_pager *p, int32_t s);
/* Parks slot s's prefetch read (1), or there was nothing to stop (0: not
 * the I/O engine, not a prefetch, or every chunk issued). */
int qm__pager_copy_park(qm_pager *p, int32_t s);
/* Slot s's parked read goes on at prefetch priority (1), or was not parked. */
int qm__pager_copy_resume(qm_pager *p, int32_t s);
/* 1 when waiting for slot s's copy would not block (it has landed or
 * failed, or nothing is in flight), 0 while it is in flight. Copies a
 * device fences can only be waited for count as landed. */
int qm__pager_copy_landed(qm_pager *p, int32_t s);
/* Waits until the copy of one of slots[0..n) (LOADING ones) has landed or
 * failed; qm__pager_copy_wait then collects it without blocking. */
void qm__pager_copy_wait_any(qm_pager *p, const int32_t *slots, size_t n);
/* Copies n bytes at src (the mapping) to dst now, on the caller's thread
 * (creation's whole banks, without the disk source's I/O engine). */
int qm__pager_copy_now(qm_pager *p, void *dst, const void *src, uint64_t n, qm_status *st);
/* Evicts slot s: waits for a copy that may still be writing into it (of a
 * parked read, only its chunks in flight), frees
 * it (qm__pager_drop) and counts the eviction. */
void qm__pager_evict(qm_pager *p, int32_t s);
/* Grows slots[] to n entries (the new ones uninitialised) and, with the
 * copy thread, its queue to n + 1 jobs, holding the thread off while the
 * array moves (it reads slots[] under its lock). Nothing may be queued
 * (after qm_pager_sync). QM_ENOMEM leaves both as they were. */
int qm__pager_slots_regrow(qm_pager *p, uint32_t n, qm_status *st);

#endif
