/* qm_memory.h - what this machine and the memory cgroups that bound qmoed
 * can give now (qm_memory.c), for budgets that size themselves
 * (qm_budget.h): MemAvailable from /proc/meminfo, and every memory cgroup
 * with a limit from qmoed's own (found through /proc/self/cgroup and
 * /proc/self/mountinfo) up to its hierarchy's root, cgroup v1
 * (memory.limit_in_bytes, memory.usage_in_bytes) or v2 (memory.max,
 * memory.current). A cgroup's memory in use is its usage less the page
 * cache no process maps (memory.stat: its inactive file pages, and its
 * active ones beyond the mapped), which the kernel reclaims before it
 * fails an allocation: container runtimes' working set (usage less the
 * inactive file pages) less what an earlier reader left active.
 *
 * Plain file reads and no state: each call reads what is true now, so a
 * daemon moved into another cgroup, or whose limit an operator changed, is
 * seen at the next read. Any thread.
 *
 * Tests point it elsewhere through the environment: QMOED_TEST_MEMINFO
 * names a file read instead of /proc/meminfo; QMOED_TEST_CGROUP a
 * directory that stands for qmoed's cgroup (v1 or v2 by the files it
 * holds), whose parents count while they hold the same files. */
#ifndef QM_MEMORY_H
#define QM_MEMORY_H

#include <stddef.h>
#include <stdint.h>

#include "qm_error.h"

typedef enum qm_mem_kind {
    QM_MEM_HOST,      /* /proc/meminfo: MemTotal, MemAvailable */
    QM_MEM_CGROUP_V1, /* memory.limit_in_bytes, memory.usage_in_bytes */
    QM_MEM_CGROUP_V2  /* memory.max, memory.current */
} qm_mem_kind;

#define QM_MEM_PATH_MAX 512

/* One bound on the memory qmoed may take. */
typedef struct qm_mem_bound {
    qm_mem_kind kind;
    char path[QM_MEM_PATH_MAX]; /* the cgroup's directory; the meminfo file for the host */
    uint64_t limit;             /* MemTotal; the cgroup's limit */
    uint64_t usage;             /* in use: MemTotal - MemAvailable; the cgroup's working set */
    uint64_t cache;             /* cgroups: page cache no process maps, left out of usage */
    uint64_t available;         /* MemAvailable; limit - usage (0 when over) */
} qm_mem_bound;

#define QM_MEM_MAX_BOUNDS 16

typedef struct qm_mem_state {
    qm_mem_bound bounds[QM_MEM_MAX_BOUNDS]; /* the host first (when readable), then the
                                             * cgroups with a limit, qmoed's own first */
    uint32_t n;
    uint32_t tightest; /* the bound with the least available (when n > 0) */
    /* qmoed's own memory cgroup (whether or not it has a limit), for the
     * pressure watcher; "" when none was found. */
    char cgroup[QM_MEM_PATH_MAX];
    qm_mem_kind cgroup_kind;
} qm_mem_state;

/* Reads the bounds now. QM_EIO with a sentence when no bound at all could
 * be read (neither meminfo nor a cgroup). */
int qm_mem_read(qm_mem_state *out, qm_status *st);

/* The least available over the bounds; UINT64_MAX when there is none. */
uint64_t qm_mem_available(const qm_mem_state *m);

/* "cgroup limit 4.00 GB - in use 412.3 MB" or "MemAvailable 20.10 GB":
 * how a bound's available bytes came about, for the plan and the log. */
void qm_mem_describe(const qm_mem_bound *b, char *out, size_t cap);

/* Bytes for people: "3.10 GB", "412.3 MB", "96.0 kB", "512 bytes"
 * (decimal units, as the docs' tables). */
void qm_mem_bytes_text(uint64_t bytes, char *out, size_t cap);

#endif
