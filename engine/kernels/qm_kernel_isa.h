/* qm_kernel_isa.h - the CPU kernels as rows of tables, and the CPU
 * features they need. Private to engine/.
 *
 * Fast mode: one row per instruction set (qm__i8isa), defined in the
 * ISA's own file (qm_kernel_i8_<name>.c: its kernel, its two paths, what
 * it needs of the CPU, whether it reads the r8 layout, its software model)
 * and listed once, widest first, in qm_kernel_isa.c. Everything that picks,
 * forces, checks or describes a fast kernel walks that table: the measured
 * choice and QMOE_KERNEL (qm_kernel_select.c), the self-check at start
 * (qm_kernel_check.c), the tests and the micro benchmark. Adding an ISA is
 * its file with its row, one line in the table, and its build lines
 * (engine/CMakeLists.txt: the file and its compiler flags).
 *
 * Exact mode: its SIMD kernels (qm__kernel, qm_kernels.h) are listed the
 * same way, widest first, with what each needs of the CPU.
 *
 * Rows are data only: a row in a file compiled for AVX-512 holds no code
 * that runs before its CPU features are known (qm__cpu_needs, compiled for
 * the baseline, answers that). */
#ifndef QM_KERNEL_ISA_H
#define QM_KERNEL_ISA_H

#include <stddef.h>

#include "qm_kernels.h"

/* One fast-mode instruction set. Its kernel is the first member, so a
 * qm__i8kernel taken from a row is that row (qm__i8isa_of). */
typedef struct qm__i8isa {
    qm__i8kernel kernel; /* name (QMOE_KERNEL=name) and the entry every class calls */
    const char *aliases; /* other QMOE_KERNEL names for it, space separated, or NULL */
    const char *needs;   /* the CPU features it runs on, space separated (qm__cpu_needs) */
    const char *not_built; /* NULL, or why this build has no code for it */
    qm__mm_fn *gemv, *gemm; /* its decode and prefill paths, each at any input count */
    int reads_r8;           /* 1: gemv and gemm read 4-bit r8 matrices (qm_r8.h) themselves */
    int reads_r8_q8;        /* 1: and 8-bit ones */
    /* Its software model (qm_kernel_i8_model*.c, linked into the tests only:
     * a weak reference, NULL elsewhere): the same blocking with the
     * instructions this CPU may lack written in C. */
    const struct qm__i8isa *model;
} qm__i8isa;

/* Declares the software model of ISA `name` for its row: a weak reference,
 * so the row's model is NULL where the models are not linked. */
#define QM__I8ISA_MODEL(name) extern const qm__i8isa qm__i8model_##name __attribute__((weak))

/* The fast table: rows 0 .. count-1, widest first (the measured choice
 * prefers the earlier of two kernels within 10%). The scalar kernel, the
 * specification, is no row. A row broken by the test hook
 * (qm__kernel_break) is answered as its broken copy. */
size_t qm__i8isa_count(void);
const qm__i8isa *qm__i8isa_at(size_t i);
/* 1 when `name` is one of the space-separated words of list (NULL: none). */
int qm__word_in(const char *list, const char *name);
/* The row named `name` or one of its aliases; -1 when none. */
int qm__i8isa_find(const char *name);
/* The row whose kernel k is (k == &row->kernel), or NULL (scalar, auto). */
const qm__i8isa *qm__i8isa_of(const qm__i8kernel *k);

/* The exact table: the SIMD exact kernels, widest first, each with what it
 * needs (qm__kernel.needs). A row marked `variant` (avx2-folded) is never
 * measured: it is taken as another row's `alone`, or forced. */
size_t qm__exact_count(void);
const qm__kernel *qm__exact_at(size_t i);
int qm__exact_find(const char *name); /* by name or alias; -1 when none */

/* 1 when this process can run a row needing `needs` (its features, space
 * separated, all present and usable: the OS saves their state; AMX: the
 * tile permission granted); else 0 and why in why[cap] ("this CPU lacks
 * avx512vnni"). */
int qm__cpu_needs(const char *needs, char *why, size_t cap);
/* The CPU's brand string (CPUID 0x80000002..4), or "unknown". */
void qm__cpu_brand(char *out, size_t cap);
/* The features of qm_kernel_cpu.c's list this CPU has and the kernels may
 * use (hidden ones left out), space separated. */
void qm__cpu_flags(char *out, size_t cap);
/* What identifies this CPU for the kernel cache: the brand, the family,
 * model and stepping, the feature words the rows read and the OS's saved
 * state, and the features hidden by tests. */
void qm__cpu_signature(char *out, size_t cap);

/* Tests: 1 hides feature `name` (and so every row needing it) from
 * qm__cpu_needs and qm__cpu_flags, 0 shows it again. */
void qm__cpu_hide(const char *name, int hide);

/* The self-check's verdict of exact (fast 0) or fast row i: 1 verified
 * (the check runs first, once per process: qm_kernel_check.c). Tests:
 * qm__kcheck_assume sets one (a row made to look present by a hook, which
 * the check never ran). */
int qm__kcheck_ok(int fast, size_t i);
void qm__kcheck_assume(int fast, size_t i, int verified);
/* Tests: the check run again now (after qm__kernel_break, or with another
 * QMOE_KERNEL_CACHE); not thread-safe. Recalibrate the choices after it. */
void qm__kcheck_rerun(void);

/* Test hook (the daemon's QMOED_FAULT_KERNEL): "PRECISION:NAME[:LANE]"
 * (precision exact or fast, lane 0-15, default 3) makes that kernel's
 * output lane `lane` of every 16-row call wrong (its top mantissa bit
 * flipped) from now on: the self-check refuses it and nothing serves with
 * it. NULL undoes it. 0, or -1 with why in why[cap] (no such kernel, bad
 * lane). */
int qm__kernel_break(const char *spec, char *why, size_t cap);

#endif
