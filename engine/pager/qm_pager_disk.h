/* qm_pager_disk.h - the pager's disk source (QM_PAGER_SOURCE_DIRECT): units
 * and whole banks read from the bank file with O_DIRECT through the I/O
 * engine (qm_pager_io.h) or serially, the arenas locked with mlock where
 * permitted. Below the slots: it reads the pager's state and touches no
 * slot. Private to engine/. */
#ifndef QM_PAGER_DISK_H
#define QM_PAGER_DISK_H

#include "qm_pager_impl.h"

/* With opt.source DIRECT: opens the bank file for O_DIRECT reads (p->disk),
 * starts its I/O engine (opt.io_engine, opt.io_depth) and forces whole banks
 * into the arena, or records why not (source_why) and sets opt.source to
 * MMAP, so the layout is the mapping's. Call before the layout. */
void qm__pager_disk_open(qm_pager *p);
void qm__pager_disk_close(qm_pager *p);
/* Waits for every read in flight (prefetches no one waited for included):
 * before the arenas are freed. */
void qm__pager_disk_drain(qm_pager *p);
/* The serial engine: reads the bytes the mapping holds at src..src+len
 * into dst now, on the caller's thread (QM_EIO). */
int qm__pager_disk_read(qm_pager *p, void *dst, const void *src, uint64_t len, qm_status *st);

/* ---- The I/O engine (qm_pager_io.h): every function below needs
 * qm__pager_disk_async(p). ---- */

/* 1 when reads go through the I/O engine (io_uring or the pool), 0 for the
 * serial engine or without the disk source. */
int qm__pager_disk_async(const qm_pager *p);
/* One read request per slot for slots [0, n): call with nothing in flight
 * (creation, growing). QM_ENOMEM keeps what there was. No-op when serial. */
int qm__pager_disk_slots(qm_pager *p, uint32_t n, qm_status *st);
/* Registers the pager's arenas (creation and growth) with the engine as
 * fixed buffers, after any change to them or to the slots in use (each as
 * far as its slots in use reach, so a shrink's pages are not pinned), with
 * nothing in flight. */
void qm__pager_disk_arenas(qm_pager *p);
/* Starts reading slot s's unit (layer/expert set, base in an arena) at
 * demand or prefetch priority. */
int qm__pager_disk_submit(qm_pager *p, int32_t s, int prefetch, qm_status *st);
/* Slot s's read becomes a demand read (a prefetch that a call hit). */
void qm__pager_disk_promote(qm_pager *p, int32_t s);
/* Slot s's prefetch read stops where it is (1), or had nothing left to
 * stop (0): qm__io_park. Its chunks in flight still land. */
int qm__pager_disk_park(qm_pager *p, int32_t s);
/* Slot s's parked prefetch goes on as a prefetch (1), or was not parked. */
int qm__pager_disk_unpark(qm_pager *p, int32_t s);
/* 1 while slot s's read is parked. */
int qm__pager_disk_parked(qm_pager *p, int32_t s);
/* Waits until none of slot s's chunks is in flight (a parked read: then
 * the slot may be given back without reading the rest). */
void qm__pager_disk_settle(qm_pager *p, int32_t s);
/* 1 when slot s's read has finished (landed or failed), without waiting. */
int qm__pager_disk_landed(qm_pager *p, int32_t s);
/* Waits for slot s's read (a prefetch becomes a demand read first): 0, or
 * QM_EIO naming the file and the offset of the read that failed. */
int qm__pager_disk_wait(qm_pager *p, int32_t s, qm_status *st);
/* Waits until the read of one of slots[0..n) has finished; its index. */
size_t qm__pager_disk_wait_any(qm_pager *p, const int32_t *slots, size_t n);
/* Reads every layer's whole bank into its place in the arena (whole_base
 * set), all layers in flight together; waits for them (QM_EIO). */
int qm__pager_disk_read_whole(qm_pager *p, qm_status *st);
/* Around a forward call: the most reads in flight while it ran feed
 * stats.read_calls and stats.reads_in_flight_sum. */
void qm__pager_disk_call_begin(qm_pager *p);
void qm__pager_disk_call_end(qm_pager *p);
void qm__pager_disk_lock(qm_pager *p, qm_arena *arena); /* mlock, or why not */
void qm__pager_disk_unlock(qm_pager *p, qm_arena *arena);
/* The same for [base, base + len) of a locked arena: slots a resize gives
 * back are unlocked (their pages then go back to the system) and locked
 * again when a growth takes them. Nothing without the disk source. */
void qm__pager_disk_lock_range(qm_pager *p, void *base, uint64_t len);
void qm__pager_disk_unlock_range(qm_pager *p, void *base, uint64_t len);
void qm__pager_disk_stats(const qm_pager *p, qm_pager_stats *out);

#endif
