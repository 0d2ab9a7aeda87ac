/* qm_pager_disk.h - the pager's disk source (QM_PAGER_SOURCE_DIRECT): units
 * and whole banks read from the bank file with O_DIRECT, the arenas locked
 * with mlock where permitted. Below the slots: it reads the pager's state
 * and touches no slot. Private to engine/. */
#ifndef QM_PAGER_DISK_H
#define QM_PAGER_DISK_H

#include "qm_pager_impl.h"

/* With opt.source DIRECT: opens the bank file for O_DIRECT reads (p->disk)
 * and forces whole banks into the arena, or records why not (source_why).
 * Call before the layout. */
void qm__pager_disk_open(qm_pager *p);
void qm__pager_disk_close(qm_pager *p);
/* Reads the bytes the mapping holds at src..src+len into dst (QM_EIO). */
int qm__pager_disk_read(qm_pager *p, void *dst, const void *src, uint64_t len, qm_status *st);
void qm__pager_disk_lock(qm_pager *p, qm_arena *arena); /* mlock, or why not */
void qm__pager_disk_unlock(qm_pager *p, qm_arena *arena);
/* The same for [base, base + len) of a locked arena: slots a resize gives
 * back are unlocked (their pages then go back to the system) and locked
 * again when a growth takes them. Nothing without the disk source. */
void qm__pager_disk_lock_range(qm_pager *p, void *base, uint64_t len);
void qm__pager_disk_unlock_range(qm_pager *p, void *base, uint64_t len);
void qm__pager_disk_stats(const qm_pager *p, qm_pager_stats *out);

#endif
