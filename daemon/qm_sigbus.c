/* qm_sigbus.c - a bank file truncated on disk while mapped must not kill
 * the daemon.
 *
 * Reading a page of a MAP_SHARED mapping that lies past the file's new end
 * raises SIGBUS. Two defences:
 * 1. qm_model_check (qm_models.c; before every use of a bank: session.create,
 *    session.infer) fstat()s the bank's file when its inotify watch saw it
 *    change (every call without a watch, and once a second anyway) and
 *    fails the request with invalid_model when it shrank, so the usual case
 *    never touches a missing page.
 * 2. For a truncation racing a request: a SIGBUS handler that, when the
 *    faulting address lies inside a registered bank mapping, maps anonymous
 *    zero pages over the rest of that mapping (so the faulting read resumes
 *    and reads zeros), and marks the bank poisoned. The request then fails in
 *    its after-use check (qm_model_check_reads), and so does every later one
 *    on that model until it is reloaded. This works on any thread (the
 *    worker, the backend's compute threads, the pager's copy thread), which
 *    a sigsetjmp on the worker alone would not, and it never unwinds through
 *    the pager's locks.
 *    A SIGBUS anywhere else gets the default action (the process dies with
 *    the signal, as it would have without the handler). */
#include "qm_sigbus.h"

#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "qm_error.h"

#define QM_SIGBUS_SLOTS 256

typedef struct qm_guard_slot {
    _Atomic(uintptr_t) base; /* 0: free */
    _Atomic(uintptr_t) size;
    atomic_int poisoned;
} qm_guard_slot;

static qm_guard_slot slots[QM_SIGBUS_SLOTS];
static atomic_int installed;

static void sigbus_handler(int sig, siginfo_t *si, void *ctx)
{
    (void)ctx;
    uintptr_t a = (uintptr_t)si->si_addr;
    for (int i = 0; i < QM_SIGBUS_SLOTS; i++) {
        uintptr_t base = atomic_load(&slots[i].base), size = atomic_load(&slots[i].size);
        if (!base || a < base || a - base >= size)
            continue;
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t from = a & ~(page - 1);
        if (from < base)
            from = base;
        uintptr_t end = (base + size + page - 1) & ~(page - 1);
        void *p = mmap((void *)from, end - from, PROT_READ,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        if (p != MAP_FAILED) {
            atomic_store(&slots[i].poisoned, 1);
            return; /* the read resumes, on zeros */
        }
        break;
    }
    /* Not a bank page (or it could not be patched): what SIGBUS does anyway. */
    signal(sig, SIG_DFL);
    raise(sig);
}

int qm_sigbus_install(void)
{
    if (atomic_exchange(&installed, 1))
        return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = sigbus_handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    return sigaction(SIGBUS, &sa, NULL) == 0 ? 0 : QM_EINTERNAL;
}

int qm_sigbus_register(const void *base, uint64_t size)
{
    if (!base || !size)
        return -1;
    for (int i = 0; i < QM_SIGBUS_SLOTS; i++) {
        uintptr_t expected = 0;
        if (atomic_load(&slots[i].base) == 0) {
            atomic_store(&slots[i].size, (uintptr_t)size);
            atomic_store(&slots[i].poisoned, 0);
            if (atomic_compare_exchange_strong(&slots[i].base, &expected, (uintptr_t)base))
                return i;
        }
    }
    return -1; /* no slot: the fstat checks still hold */
}

void qm_sigbus_unregister(int slot)
{
    if (slot < 0 || slot >= QM_SIGBUS_SLOTS)
        return;
    atomic_store(&slots[slot].base, 0);
    atomic_store(&slots[slot].size, 0);
}

int qm_sigbus_poisoned(int slot)
{
    if (slot < 0 || slot >= QM_SIGBUS_SLOTS)
        return 0;
    return atomic_load(&slots[slot].poisoned);
}
