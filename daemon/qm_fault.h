/* qm_fault.h - allocation-failure injection for the hardening suite
 * (docs/RELIABILITY.md, "Faults"; qm_fault.c).
 *
 * QMOED_FAULT_ALLOC=[CLASS:]N makes the Nth qm_malloc/qm_realloc made by a
 * thread of CLASS return NULL, once; N=0 only counts. The classes:
 *   worker  a worker running a job: session build, inference, plan (the
 *           engine, the pager, the CPU backend's arena and scratch);
 *   loop    the event-loop thread once the daemon serves: reading and
 *           decoding requests, dispatch, replies, connections, model.load;
 *   engine  threads the engine starts itself: the pager's copy thread and
 *           the CPU backend's compute pool (every untagged thread).
 * A bare N means worker:N (the hook's first form). The counts of every
 * class are printed to stderr at exit; QMOED_FAULT_BT=1 also prints the
 * stack of the failed allocation. Unset, no hook is installed and
 * allocation is plain libc. Process-wide: the allocation hooks are. */
#ifndef QM_FAULT_H
#define QM_FAULT_H

#include <stdint.h>

typedef enum qm_fault_class {
    QM_FAULT_ENGINE, /* untagged threads */
    QM_FAULT_WORKER,
    QM_FAULT_LOOP,
    QM_FAULT_OFF /* not counted: the loop thread while the pool starts */
} qm_fault_class;

/* Reads QMOED_FAULT_ALLOC and QMOED_FAULT_BT and, when set, installs the
 * allocation hooks with the calling thread not counted (QM_FAULT_OFF) until
 * it tags itself. 0, or QM_EINVAL (logged) for a spec it cannot read. */
int qm_fault_start(void);
/* QMOED_FAULT_READ=N (test hook): the Nth read of direct disk paging,
 * daemon-wide, fails with EIO, once. qm_fault_read_at: N, or 0 when unset;
 * qm_fault_read_hook is the pager's read hook (ud = N as a pointer). */
unsigned long qm_fault_read_at(void);
int qm_fault_read_hook(void *ud, uint64_t off, uint64_t len);
/* Tags the calling thread: its allocations count for `cls` from now on. */
void qm_fault_tag_thread(qm_fault_class cls);
/* The counts of every class, on stderr, when the hook is installed. */
void qm_fault_report(void);

#endif
