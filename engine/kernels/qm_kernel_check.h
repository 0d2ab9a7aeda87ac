/* qm_kernel_check.h - the CPU kernels prove themselves before they serve
 * (qm_kernel_check.c). Public: the daemon and qmoe-bank run report it.
 *
 * Once per process, before any kernel can be chosen (the first kernel
 * choice runs it), every kernel of the tables (qm_kernel_isa.h) this CPU
 * can run runs on a few fixed shapes of both precisions and is compared
 * with the scalar specification: a fast kernel bit for bit (every fast
 * kernel promises the specification's bits), r8 matrices too where it
 * reads them; an exact kernel within the exact mode's documented bound
 * (each output within 2e-5 * sum_c |W[n,c] x[c]| of the specification's:
 * both are within 1e-5 of the exact sum, docs/ARCHITECTURE.md). A kernel
 * that disagrees is refused: never measured, never chosen, never run on
 * a request; QMOE_KERNEL naming it falls back to the choice (the daemon
 * and qmoe-bank run refuse to start instead: qm_kernel_check_forced).
 *
 * The verdicts are kept in the kernel cache (QMOE_KERNEL_CACHE, the
 * daemon's state_dir/kernels.cache) keyed by this binary and this CPU, so
 * a restart of the same binary on the same CPU reads them instead of
 * checking again; a cache line that is not whole, or of another version,
 * binary or CPU, is never trusted (the check runs again and rewrites it). */
#ifndef QM_KERNEL_CHECK_H
#define QM_KERNEL_CHECK_H

#include "qm_error.h"

#define QM_KERNEL_CHECK_MAX 16

typedef enum qm_kernel_verdict_kind {
    QM_KERNEL_VERIFIED = 1,   /* the specification's bits (fast), or within the bound (exact) */
    QM_KERNEL_REFUSED = 2,  /* disagreed: never used */
    QM_KERNEL_UNAVAILABLE = 3 /* this CPU or this build cannot run it: not checked */
} qm_kernel_verdict_kind;

typedef struct qm_kernel_verdict {
    const char *precision; /* "exact" or "fast" */
    const char *name;      /* its QMOE_KERNEL name */
    qm_kernel_verdict_kind kind;
    char reason[256];      /* refused: the first disagreement; unavailable: why */
} qm_kernel_verdict;

typedef struct qm_kernel_check {
    char cpu[64];    /* the CPU's brand string */
    char flags[192]; /* the CPU features the kernels may use that it has */
    int cached;      /* 1: the verdicts came from the kernel cache */
    double ms;       /* the check's wall time in this process (the cache's read when cached) */
    unsigned n;      /* verdicts: exact rows, then fast rows, widest first */
    qm_kernel_verdict v[QM_KERNEL_CHECK_MAX];
    unsigned verified, refused; /* counts */
} qm_kernel_check;

/* The check's result, run on the first call (thread-safe; later calls,
 * and the kernel choices, share it). Never NULL. */
const qm_kernel_check *qm_kernel_check_run(void);
/* 0, or QM_EINVAL with a sentence when QMOE_KERNEL forces a kernel the
 * check refused ("QMOE_KERNEL=avx512vnni: the fast kernel avx512vnni was
 * refused by the self-check on <cpu>: <reason>"). Runs the check. */
int qm_kernel_check_forced(qm_status *st);
/* Test hook, before the first check (the daemon's QMOED_FAULT_KERNEL):
 * "exact:NAME[:LANE]" or "fast:NAME[:LANE]" makes that kernel's output
 * lane LANE (0-15, default 3) of every 16-row call wrong. 0, or QM_EINVAL
 * with why. */
int qm_kernel_check_break(const char *spec, qm_status *st);

#endif
