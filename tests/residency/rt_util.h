/* rt_util.h - helpers shared by the residency suites and the fuzz target:
 * catalog builders, a counting allocator that fails on demand, the plan
 * invariants, and the test-only policies (split-everything, each kind of
 * invalid decision, hostile). */
#ifndef RT_UTIL_H
#define RT_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "qm_policy_impl.h" /* the hostile and scripted policies implement the iface */
#include "qm_residency.h"

/* A pageable catalog: `n_experts` experts, each `regions` regions (tensors
 * 0..regions-1) of `region_bytes` bytes, laid out expert-major. NULL on
 * allocation failure. */
qm_region_catalog *rt_catalog(uint32_t bank, uint32_t n_experts, uint32_t regions,
                              uint64_t region_bytes);

/* ---- Counting allocator ---------------------------------------------------- */

/* Installs hooks that count allocations and fail the `fail_at`-th one
 * (1-based; 0 = never). */
void rt_alloc_install(long fail_at);
void rt_alloc_uninstall(void);
long rt_alloc_count(void); /* allocations attempted since install */
long rt_alloc_live(void);  /* blocks allocated through the hooks and not freed */
int rt_alloc_failed(void); /* the planned failure happened */

/* ---- Invariants ---------------------------------------------------------------- */

/* Checks everything RESIDENCY.md promises of a plan made from `cats` with
 * `opt` (may be NULL). Returns 0, or -1 with a sentence in `why`. */
int rt_plan_check(const qm_residency_plan *plan, const qm_region_catalog *const *cats, size_t n,
                  const qm_plan_options *opt, char *why, size_t why_cap);

/* ---- Test-only policies --------------------------------------------------------- */

/* Splits every pageable bank, pins nothing. */
void rt_policy_split_all(qm_policy *out);

typedef enum rt_invalid_kind {
    RT_INVALID_OUT_OF_RANGE,
    RT_INVALID_DUPLICATE,
    RT_INVALID_PER_EXPERT_ON_NON_PAGEABLE,
    RT_INVALID_NO_REAL_REGION,
    RT_INVALID_PINNED_NOT_CANDIDATE,
    RT_INVALID_PINNED_OVER_BUDGET,
    RT_INVALID_DECIDE_ERROR,
    RT_INVALID_EMPTY,
    RT_INVALID_NULL_EXPERTS,
    RT_INVALID_UNKNOWN_KIND,
    RT_INVALID_RESERVED_REASON,
    RT_INVALID_DUPLICATE_PINNED,
    RT_INVALID_COUNT
} rt_invalid_kind;

/* Behaves like split_all except for bank `bad_bank`, for which it emits
 * `kind`. The rule name the planner must report is rt_invalid_rule(kind). */
int rt_policy_invalid(rt_invalid_kind kind, uint32_t bad_bank, qm_policy *out);
const char *rt_invalid_rule(rt_invalid_kind kind);

/* Random decisions (garbage kinds, huge and repeated indices, lying
 * lengths, errors) and random run-time answers, from `seed`. */
int rt_policy_hostile(uint64_t seed, qm_policy *out);

/* Deterministic xorshift for tests. */
uint64_t rt_rand(uint64_t *state);

#endif
