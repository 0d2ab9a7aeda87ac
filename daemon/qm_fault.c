/* qm_fault.c - allocation-failure injection for the hardening suite: the
 * contract is in qm_fault.h. */
#include "qm_fault.h"

#include <errno.h>
#include <execinfo.h>
#include <stdint.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_error.h"
#include "qm_log.h"

enum { FAULT_N_CLASSES = QM_FAULT_OFF + 1 };
static const char *const fault_names[FAULT_N_CLASSES] = {"engine", "worker", "loop", "off"};
static _Thread_local int fault_class; /* threads the daemon does not tag: QM_FAULT_ENGINE */
static atomic_ulong fault_count[FAULT_N_CLASSES];
static int fault_target = QM_FAULT_WORKER;
static unsigned long fault_at;
static int fault_backtrace; /* QMOED_FAULT_BT set: print the failed call's stack */
static int fault_installed;

static int fault_hit(void)
{
    int cls = fault_class;
    if (cls == QM_FAULT_OFF)
        return 0;
    int hit = atomic_fetch_add(&fault_count[cls], 1) + 1 == fault_at && cls == fault_target;
    if (hit && fault_backtrace) {
        /* Where the failure was injected, for addr2line. */
        void *bt[32];
        backtrace_symbols_fd(bt, backtrace(bt, 32), 2);
    }
    return hit;
}
static void *fault_malloc(size_t n, void *ud)
{
    (void)ud;
    return fault_hit() ? NULL : malloc(n);
}
static void *fault_realloc(void *ptr, size_t n, void *ud)
{
    (void)ud;
    return fault_hit() ? NULL : realloc(ptr, n);
}
static void fault_free(void *ptr, void *ud)
{
    (void)ud;
    free(ptr);
}

/* Parses QMOED_FAULT_ALLOC; 0 when valid. */
static int fault_parse(const char *spec)
{
    const char *colon = strchr(spec, ':');
    if (colon) {
        size_t len = (size_t)(colon - spec);
        fault_target = -1;
        for (int i = 0; i < QM_FAULT_OFF; i++)
            if (strlen(fault_names[i]) == len && memcmp(spec, fault_names[i], len) == 0)
                fault_target = i;
        if (fault_target < 0)
            return -1;
        spec = colon + 1;
    }
    char *end;
    fault_at = strtoul(spec, &end, 10);
    return *spec && !*end ? 0 : -1;
}

int qm_fault_start(void)
{
    const char *spec = getenv("QMOED_FAULT_ALLOC");
    if (!spec || !*spec)
        return 0;
    static const qm_alloc_hooks hooks = {fault_malloc, fault_realloc, fault_free, NULL};
    if (fault_parse(spec) < 0) {
        qm_log(QM_LOG_ERR, "QMOED_FAULT_ALLOC=%s: expected [worker:|loop:|engine:]N", spec);
        return QM_EINVAL;
    }
    /* The engine's compute pool already runs but does not allocate until a
     * job does; no worker runs yet. The calling (loop) thread counts once it
     * tags itself: only request paths. */
    fault_class = QM_FAULT_OFF;
    fault_backtrace = getenv("QMOED_FAULT_BT") != NULL;
    fault_installed = 1;
    qm_alloc_set_hooks(&hooks);
    return 0;
}

void qm_fault_tag_thread(qm_fault_class cls) { fault_class = (int)cls; }

void qm_fault_report(void)
{
    if (!fault_installed)
        return;
    fprintf(stderr, "qmoed: QMOED_FAULT_ALLOC: %lu worker allocations, %lu loop, "
                    "%lu engine; failed %s #%lu\n",
            (unsigned long)atomic_load(&fault_count[QM_FAULT_WORKER]),
            (unsigned long)atomic_load(&fault_count[QM_FAULT_LOOP]),
            (unsigned long)atomic_load(&fault_count[QM_FAULT_ENGINE]), fault_names[fault_target],
            fault_at);
}

/* ---- disk reads (QMOED_FAULT_READ) ---- */

static atomic_ulong read_count;

unsigned long qm_fault_read_at(void)
{
    const char *spec = getenv("QMOED_FAULT_READ");
    if (!spec || !*spec)
        return 0;
    char *end = NULL;
    unsigned long n = strtoul(spec, &end, 10);
    return end && *end == '\0' ? n : 0;
}

int qm_fault_read_hook(void *ud, uint64_t off, uint64_t len)
{
    (void)off;
    (void)len;
    unsigned long at = (unsigned long)(uintptr_t)ud;
    return atomic_fetch_add(&read_count, 1) + 1 == at ? EIO : 0;
}
