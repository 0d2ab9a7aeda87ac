/* bench_pager.h - what the paging benchmarks (hybrid, paging_e2e,
 * paging_disk) set up: the bank and a CPU backend, and the paging authority
 * they run under (a policy, a residency plan for a share of the bank's
 * expert bytes, a pager over them). Static inline like bench_util.h; each
 * program includes it by a path relative to its folder. */
#ifndef QMOE_BENCH_PAGER_H
#define QMOE_BENCH_PAGER_H

#include <stdint.h>
#include <stdio.h>

#include "qm_backend.h"
#include "qm_bank.h"
#include "qm_error.h"
#include "qm_pager.h"
#include "qm_residency.h"

#define BENCH_PAGER_MAX_LAYERS 256u

/* Opens the bank at `path` and a CPU backend of `threads` threads: the
 * bank's config, or NULL with "<prog>: <why>" on stderr. */
static inline const qm_bank_config *bench_open_cpu(const char *prog, const char *path,
                                                   uint32_t threads, qm_bank **bank,
                                                   qm_backend **be)
{
    qm_status st = {0};
    if (qm_bank_open(path, bank, &st) || qm_backend_cpu_new(threads, be, &st)) {
        fprintf(stderr, "%s: %s\n", prog, st.msg);
        return NULL;
    }
    return qm_bank_get_config(*bank);
}

/* Makes policy `policy` (default parameters) in *pol, its plan for a budget
 * of `frac` of the bank's expert bytes (frac <= 0: no budget) in *plan and a
 * pager on `be` with options `o` in *pg. Returns 0, or the failing call's
 * code with st set; what was made stays in *pol / *plan / *pg for the caller
 * to free (qm_pager_free, qm_plan_free, qm_policy_destroy) either way. */
static inline int bench_pager_new(qm_backend *be, const qm_bank *bank, const char *policy,
                                  double frac, const qm_pager_options *o, qm_policy *pol,
                                  qm_residency_plan **plan, qm_pager **pg, qm_status *st)
{
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    if (cfg->layers > BENCH_PAGER_MAX_LAYERS)
        return qm_status_set(st, QM_EINVAL, "%u layers; the benchmarks take at most %u",
                             cfg->layers, BENCH_PAGER_MAX_LAYERS);
    qm_region_catalog *cats[BENCH_PAGER_MAX_LAYERS];
    uint32_t n_cats = 0;
    int rc = qm_policy_new(policy, NULL, pol, st);
    for (; rc == 0 && n_cats < cfg->layers; n_cats++)
        if ((rc = qm_bank_build_catalog(bank, n_cats, &cats[n_cats], st)))
            break;
    if (rc == 0) {
        uint64_t total = qm_bank_expert_bytes_total(bank);
        qm_plan_options po = {.has_budget = frac > 0,
                              .budget_bytes = (uint64_t)(frac * (double)total)};
        rc = qm_plan_residency((const qm_region_catalog *const *)cats, cfg->layers, pol, &po, plan,
                               st);
    }
    for (uint32_t l = 0; l < n_cats; l++)
        qm_catalog_free(cats[l]);
    return rc ? rc : qm_pager_new(be, bank, *plan, pol, o, pg, st);
}

#endif
