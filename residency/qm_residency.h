/* qm_residency.h - residency planning: catalogs, decisions, plans, policies.
 *
 * Pure data and pure logic: nothing here allocates device memory, copies
 * weights, or performs I/O. Depends on libc and common/ only.
 * The contract is ../shared/RESIDENCY.md; docs/ARCHITECTURE.md explains it. */
#ifndef QM_RESIDENCY_H
#define QM_RESIDENCY_H

#include <stddef.h>
#include <stdint.h>

#include "qm_error.h"

/* ---- Region catalog ------------------------------------------------------ */

/* Why a bank cannot be split per expert. QM_NONPAGEABLE_NONE = pageable. */
#define QM_NONPAGEABLE_MAP(X)                                                                      \
    X(NONE, "pageable")                                                                            \
    X(NOT_EXPERT_MAJOR, "not_expert_major")                                                        \
    X(MISALIGNED, "misaligned")                                                                    \
    X(BLOCK_STRADDLES_EXPERTS, "block_straddles_experts")                                          \
    X(MISSING_REGION, "missing_region")                                                            \
    X(BELOW_SPLIT_THRESHOLD, "below_split_threshold")                                              \
    X(SINGLE_EXPERT, "single_expert")                                                              \
    X(EMPTY_UNIT, "empty_unit")

typedef enum qm_nonpageable_reason {
#define QM__NP_ENUM(name, text) QM_NONPAGEABLE_##name,
    QM_NONPAGEABLE_MAP(QM__NP_ENUM)
#undef QM__NP_ENUM
        QM_NONPAGEABLE_COUNT
} qm_nonpageable_reason;

/* Readable, stable snake_case name ("not_expert_major"); never NULL. */
const char *qm_nonpageable_reason_name(qm_nonpageable_reason reason);

/* One expert's bytes inside one tensor of a bank. `tensor` is the bank's own
 * tensor index (model/ uses enum qm_bank_tensor); `offset` is relative to
 * whatever base the catalog's builder documents (model/: the file's data
 * section). */
typedef struct qm_region {
    uint32_t tensor;
    uint64_t offset;
    uint64_t length;
} qm_region;

typedef struct qm_region_catalog qm_region_catalog;

/* Creates an empty catalog for bank `bank_id` (the MoE layer index in its
 * model) with `n_experts` experts. The caller owns the catalog: free it with
 * qm_catalog_free. */
int qm_catalog_new(uint32_t bank_id, uint32_t n_experts, qm_region_catalog **out);
void qm_catalog_free(qm_region_catalog *cat);
/* Appends a region to expert `expert`'s unit. Regions keep insertion order. */
int qm_catalog_add_region(qm_region_catalog *cat, uint32_t expert, qm_region region);
/* Marks the bank non-pageable. `detail` (may be NULL) is copied, truncated
 * to 191 bytes, e.g. "layers.0.fc1.weight: leading dim 4 != experts 8". */
void qm_catalog_set_nonpageable(qm_region_catalog *cat, qm_nonpageable_reason reason,
                                const char *detail);

uint32_t qm_catalog_bank_id(const qm_region_catalog *cat);
uint32_t qm_catalog_expert_count(const qm_region_catalog *cat);
/* QM_NONPAGEABLE_NONE for a pageable catalog. A catalog with fewer than two
 * experts reports SINGLE_EXPERT; one with an expert lacking regions reports
 * MISSING_REGION (computed, not only set). */
qm_nonpageable_reason qm_catalog_reason(const qm_region_catalog *cat);
const char *qm_catalog_reason_detail(const qm_region_catalog *cat); /* "" if none */
/* Borrowed; valid until the catalog is changed or freed. */
const qm_region *qm_catalog_regions(const qm_region_catalog *cat, uint32_t expert, size_t *count);
uint64_t qm_catalog_expert_bytes(const qm_region_catalog *cat, uint32_t expert);
/* Largest expert unit in the bank: the slot size the paging authority uses. */
uint64_t qm_catalog_bytes_per_expert(const qm_region_catalog *cat);
/* All regions of all experts. */
uint64_t qm_catalog_total_bytes(const qm_region_catalog *cat);

/* ---- Decisions ----------------------------------------------------------- */

typedef enum qm_decision_kind {
    QM_DECISION_WHOLE_BANK = 0,
    QM_DECISION_PER_EXPERT = 1,
} qm_decision_kind;

typedef enum qm_degradation_kind {
    QM_DEGRADATION_NONE = 0,
    QM_DEGRADATION_NON_PAGEABLE_CATALOG,   /* detail: the catalog's reason name (+ its detail) */
    QM_DEGRADATION_POLICY_DECLINED_SPLIT,  /* no detail */
    QM_DEGRADATION_REJECTED_BY_VALIDATION, /* detail: which rule failed, for which index */
} qm_degradation_kind;

/* "non_pageable_catalog", "policy_declined_split", "rejected_by_validation"; NULL for NONE. */
const char *qm_degradation_kind_name(qm_degradation_kind kind);

#define QM_DECISION_DETAIL_MAX 192

/* What a policy returns for one bank. The arrays are owned by whoever filled
 * them (a policy: its own state) and must stay valid until that policy's next
 * call; the planner copies them. */
typedef struct qm_residency_decision {
    qm_decision_kind kind;
    qm_degradation_kind reason; /* WHOLE_BANK only; the planner fills it for degradations */
    char detail[QM_DECISION_DETAIL_MAX];
    const uint32_t *experts; /* PER_EXPERT: experts that may be paged */
    size_t n_experts;
    const uint32_t *pinned; /* PER_EXPERT, optional: stay resident for the session's life */
    size_t n_pinned;
} qm_residency_decision;

/* ---- Policies ------------------------------------------------------------ */

#define QM_POLICY_IFACE_VERSION 1

typedef struct qm_policy_input {
    uint32_t bank_id;
    const qm_region_catalog *catalog;
    int has_budget;        /* 0: no budget ("whole model") */
    uint64_t budget_bytes; /* session budget, when has_budget */
} qm_policy_input;

/* One (bank, expert) pair: the unit the run-time hooks talk about. */
typedef struct qm_expert_ref {
    uint32_t bank;
    uint32_t expert;
} qm_expert_ref;

/* A residency policy: decisions at plan time, eviction choices at run time.
 * Bookkeeping (pins, accounting, slots, copies) stays with the caller; the
 * policy only ranks and picks. Every answer is validated by the caller.
 * A policy instance keeps per-session history and is not thread-safe: make
 * one per session and serialise its calls (plans, once made, are immutable
 * and may be read from any thread). */
typedef struct qm_policy_iface {
    int version; /* QM_POLICY_IFACE_VERSION; checked by qm_policy_init */
    const char *name;
    /* Plan time. Fills *out (zeroed by the caller). Returns 0, or a negative
     * code: the planner then degrades the bank (rejected_by_validation). */
    int (*decide)(void *ctx, const qm_policy_input *in, qm_residency_decision *out);
    /* Run time (optional; default: LRU kept by the caller). `tick` increases
     * by one per access of a session. The caller calls, for every access,
     * on_access first (hit or miss); then, on a miss with no free slot,
     * choose_victim followed by on_evict of the victim; then on_insert of the
     * new expert. These hooks are called per miss: the shipped ones are O(1)
     * (on_*) and O(n candidates) (choose_victim), and never fail; under
     * memory pressure they may forget history, never misbehave. */
    void (*on_access)(void *ctx, qm_expert_ref ref, uint64_t tick, int hit);
    void (*on_insert)(void *ctx, qm_expert_ref ref, uint64_t tick);
    void (*on_evict)(void *ctx, qm_expert_ref ref);
    /* Picks the victim among `candidates` (all evictable: resident, unpinned,
     * not in use). Writes its index to *victim; returns 0, or negative to
     * refuse. The caller checks the index and falls back to LRU if invalid. */
    int (*choose_victim)(void *ctx, const qm_expert_ref *candidates, size_t n, size_t *victim);
    /* Optional: releases ctx. */
    void (*destroy)(void *ctx);
} qm_policy_iface;

typedef struct qm_policy {
    const qm_policy_iface *iface;
    void *ctx;
} qm_policy;

/* Checks the version and required methods. */
int qm_policy_check(const qm_policy *policy, qm_status *st);
/* The only call sites of the iface: they default optional methods. */
int qm_policy_decide(const qm_policy *policy, const qm_policy_input *in,
                     qm_residency_decision *out);
void qm_policy_on_access(const qm_policy *policy, qm_expert_ref ref, uint64_t tick, int hit);
void qm_policy_on_insert(const qm_policy *policy, qm_expert_ref ref, uint64_t tick);
void qm_policy_on_evict(const qm_policy *policy, qm_expert_ref ref);
/* Returns 0 and *victim, or negative when the policy has no opinion/refuses. */
int qm_policy_choose_victim(const qm_policy *policy, const qm_expert_ref *candidates, size_t n,
                            size_t *victim);
void qm_policy_destroy(qm_policy *policy); /* accepts NULL / NULL iface */

/* Shipped policies. Parameters come from policy_params of session.create. */
#define QM_POLICY_LFU_DEFAULT_DECAY 0.999
#define QM_POLICY_DEFAULT_PIN_FRACTION 0.5

typedef struct qm_policy_params {
    int has_decay;
    /* lfu: multiplicative decay of an expert's count per access to its bank
     * (the policy keeps one clock per bank, so aging does not depend on the
     * number of layers). 1 = no aging, 0 = only the latest access counts.
     * Default QM_POLICY_LFU_DEFAULT_DECAY. Outside [0, 1] -> QM_EINVAL. */
    double decay;
    /* static_hot: share of the budget for pins, [0, 1]. Used when
     * has_pin_fraction is set, or when it is > 0 (so a zeroed struct means
     * the default, QM_POLICY_DEFAULT_PIN_FRACTION). The share is split evenly
     * between the banks that have a non-empty hot list. */
    double pin_fraction;
    /* static_hot: hottest-first expert lists per bank; hot[b] may be NULL. */
    const uint32_t *const *hot;
    const size_t *hot_len;
    size_t n_hot_banks;
    int has_pin_fraction; /* added after v1 of this header; see pin_fraction */
} qm_policy_params;

/* name: "whole_bank", "lru", "lfu", "static_hot" (and "belady" via
 * qm_policy_belady_new). Unknown name -> QM_EINVAL naming the supported ones.
 * `params` may be NULL. The policy owns copies of everything it keeps. */
int qm_policy_new(const char *name, const qm_policy_params *params, qm_policy *out, qm_status *st);
/* "whole_bank, static_hot, lru, lfu" - the names offered over the socket. */
const char *qm_policy_supported_names(void);

/* Belady's MIN, for tests and benchmarks only (not offered over the socket):
 * knows the whole future access sequence `future[0..n)` (copied). Splits
 * every pageable bank, pins nothing; choose_victim picks the candidate whose
 * next use is furthest away (never used again beats everything; ties go to
 * the lowest candidate index). Each on_access consumes one position of the
 * sequence, so the caller must replay exactly `future`, in order. */
int qm_policy_belady_new(const qm_expert_ref *future, size_t n, qm_policy *out, qm_status *st);

/* ---- The plan ------------------------------------------------------------ */

typedef struct qm_plan_options {
    int has_budget;
    uint64_t budget_bytes;
    uint64_t min_split_bytes; /* expert units smaller than this stay whole */
} qm_plan_options;

typedef struct qm_residency_plan qm_residency_plan;

/* The one place plans are made. Calls decide() per catalog, in ascending bank
 * id, and validates each decision; an invalid one degrades that bank only,
 * to whole-bank with rejected_by_validation and a detail "rule <name>: ..."
 * naming the rule and the offending index. A bank whose expert unit
 * (bytes_per_expert) is below options->min_split_bytes stays whole with
 * non_pageable_catalog("below_split_threshold: ...") whatever the policy
 * says: the policy cannot see that option. Per-expert arrays are stored
 * sorted ascending. `options` may be NULL (no budget, no threshold). Fails only for bad
 * arguments or allocation failure (reported in st, nothing leaked).
 * `catalogs` need not be sorted; bank ids must be unique (QM_EINVAL if not).
 * The plan copies what it needs; it does not keep `catalogs`. */
int qm_plan_residency(const qm_region_catalog *const *catalogs, size_t n_catalogs,
                      const qm_policy *policy, const qm_plan_options *options,
                      qm_residency_plan **out, qm_status *st);
void qm_plan_free(qm_residency_plan *plan);

const char *qm_plan_policy_name(const qm_residency_plan *plan);
int qm_plan_has_budget(const qm_residency_plan *plan);
uint64_t qm_plan_budget(const qm_residency_plan *plan);
size_t qm_plan_total(const qm_residency_plan *plan);
size_t qm_plan_resident_count(const qm_residency_plan *plan);   /* whole-bank, no reason */
size_t qm_plan_degraded_count(const qm_residency_plan *plan);   /* whole-bank with a reason */
size_t qm_plan_per_expert_count(const qm_residency_plan *plan); /* total - resident - degraded */

/* One bank's entry, in ascending bank id for i = 0..total-1. Borrowed from the plan. */
typedef struct qm_plan_bank {
    uint32_t bank_id;
    qm_residency_decision decision; /* arrays owned by the plan */
    uint64_t bytes_per_expert;      /* the catalog's */
    uint64_t bank_bytes;            /* total bytes of the bank */
    uint32_t n_experts_in_bank;
} qm_plan_bank;

const qm_plan_bank *qm_plan_bank_at(const qm_residency_plan *plan, size_t i);
/* NULL when the plan has no such bank. */
const qm_plan_bank *qm_plan_find_bank(const qm_residency_plan *plan, uint32_t bank_id);

#endif
