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

/* A residency policy: its interface (qm_policy_impl.h, private to
 * residency/: what a policy implements) and its own state. Made by
 * qm_policy_new, used through the wrappers below, freed by
 * qm_policy_destroy. One per session; not thread-safe. */
typedef struct qm_policy_iface qm_policy_iface;

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

/* ---- The policy registry ------------------------------------------------ */

/* Parameters of qm_policy_new. Numeric knobs are given by name, so a knob
 * that is listed is given (0 included) and one that is not takes the
 * policy's default; which knobs a policy accepts, their ranges and defaults
 * are declared by the policy itself (qm_policy_param_count/_at). */
#define QM_POLICY_PARAMS_VERSION 2

typedef struct qm_policy_value {
    const char *name; /* "decay", "pin_fraction", ... */
    double value;
} qm_policy_value;

typedef struct qm_policy_params {
    int version; /* QM_POLICY_PARAMS_VERSION; anything else -> QM_EINVAL */
    const qm_policy_value *values;
    size_t n_values;
    /* static_hot: hottest-first expert lists per bank; hot[b] may be NULL.
     * Only policies that accept "hot" take them (qm_policy_accepts_hot). */
    const uint32_t *const *hot;
    const size_t *hot_len;
    size_t n_hot_banks;
    /* next_use: what earlier sessions of the model saw (its persisted
     * profile, qm_hotness_policy_prior): prior[b][e] = the share of bank
     * b's visits that used expert e, in [0, 1], for e < prior_len[b]
     * (prior[b] may be NULL). The policy starts as if that had been its
     * history, which then fades at its own decay as the session's routing
     * comes in. Only policies that accept it take it
     * (qm_policy_accepts_prior). */
    const double *const *prior;
    const size_t *prior_len;
    size_t n_prior_banks;
    /* How many visits of a bank the prior was measured over (0: unknown):
     * it never counts for more than that. */
    double prior_visits;
} qm_policy_params;

#define QM_POLICY_LFU_DEFAULT_DECAY 0.999
#define QM_POLICY_DEFAULT_PIN_FRACTION 0.5
#define QM_POLICY_NEXT_USE_DEFAULT_DECAY 0.99
#define QM_POLICY_NEXT_USE_DEFAULT_PRIOR_WEIGHT 5.0

/* name: one of the registered policies (qm_policy_names); NULL means
 * "whole_bank". Unknown name, a policy that cannot be made from parameters
 * (belady), a wrong params version, a knob the policy does not accept or out
 * of its range -> QM_EINVAL with st->field naming it ("policy",
 * "policy_params.decay", ...). `params` may be NULL (every default). The
 * policy owns copies of everything it keeps. */
int qm_policy_new(const char *name, const qm_policy_params *params, qm_policy *out, qm_status *st);

/* The checks qm_policy_new makes, without making the policy, for policies
 * offered over the socket only: with params NULL only the name is checked
 * ("policy 'x' is not supported; supported: ..."). The daemon's checks. */
int qm_policy_params_check(const char *name, const qm_policy_params *params, qm_status *st);

/* Writes the names of the policies offered over the socket, in registry
 * order, comma-separated ("whole_bank, static_hot, lru, lfu, ..."); returns
 * the length it needed (like snprintf). */
size_t qm_policy_names(char *buf, size_t cap);

/* The policy of a session that names none ("whole_bank"): what a NULL
 * name means to the calls above. */
const char *qm_policy_default_name(void);

/* Introspection, for help texts and the wire decoder. */
typedef struct qm_policy_param_spec qm_policy_param_spec; /* name, min, max, def, integer, doc */
size_t qm_policy_count(void); /* registered policies, offered or not */
const char *qm_policy_name_at(size_t i);
const char *qm_policy_summary_at(size_t i);
int qm_policy_offered_at(size_t i);
/* The numeric knobs policy i accepts. */
size_t qm_policy_param_count(size_t i);
const qm_policy_param_spec *qm_policy_param_at(size_t i, size_t j);
const char *qm_policy_param_name(const qm_policy_param_spec *spec);
void qm_policy_param_range(const qm_policy_param_spec *spec, double *min, double *max, double *def,
                           int *integer);
/* The spec of knob `name` as any offered policy declares it; NULL when none
 * does. `n` bytes of `name` are compared (no terminator needed). */
const qm_policy_param_spec *qm_policy_param_find(const char *name, size_t n);
/* 1 when policy `name` takes policy_params.hot. */
int qm_policy_accepts_hot(const char *name);
/* 1 when policy `name` takes policy_params.prior. */
int qm_policy_accepts_prior(const char *name);

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
/* session.resize: the budget now in force. The decisions stay those made
 * under the creation budget (the pager, not the plan, releases pins that a
 * smaller budget cannot hold). */
void qm_plan_set_budget(qm_residency_plan *plan, uint64_t budget_bytes);
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
