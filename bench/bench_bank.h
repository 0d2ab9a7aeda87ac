/* bench_bank.h - the bank + CPU backend opening that the CPU bench programs
 * share (header of static inline functions, like bench_util.h). */
#ifndef QMOE_BENCH_BANK_H
#define QMOE_BENCH_BANK_H

#include <stdint.h>
#include <stdio.h>

#include "qm_backend.h"
#include "qm_bank.h"

/* Opens the bank at path and a CPU backend of `threads` threads; on failure
 * prints "prog: message" to stderr and returns 1 (what is opened by then
 * stays in *bank / *be, as the programs left it), else 0. */
static inline int bench_open_bank_cpu(const char *prog, const char *path, uint32_t threads,
                                      qm_bank **bank, qm_backend **be, qm_status *st)
{
    if (qm_bank_open(path, bank, st) || qm_backend_cpu_new(threads, be, st)) {
        fprintf(stderr, "%s: %s\n", prog, st->msg);
        return 1;
    }
    return 0;
}

#endif
