/* qm_policy_impl.h - the policy plug-in interface: what a residency policy
 * implements and how it declares itself to the registry. Private to
 * residency/ and to the tests that build hostile policies; everything else
 * goes through qm_policy_new and the qm_policy_* wrappers of qm_residency.h.
 *
 * A new policy: one file in residency/ with its iface, its parameter table
 * and a qm__policy_desc, plus one line in the registry (qm_policy_registry.c).
 * The registry validates every parameter against the policy's table before
 * the constructor runs, so a constructor only reads values
 * (qm__policy_param), already known to be in range. */
#ifndef QM_POLICY_IMPL_H
#define QM_POLICY_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "qm_residency.h"

#define QM_POLICY_IFACE_VERSION 1

/* A residency policy: decisions at plan time, eviction choices at run time.
 * Bookkeeping (pins, accounting, slots, copies) stays with the caller; the
 * policy only ranks and picks. Every answer is validated by the caller.
 * A policy instance keeps per-session history and is not thread-safe: make
 * one per session and serialise its calls (plans, once made, are immutable
 * and may be read from any thread). Optional methods are defaulted in one
 * place, the qm_policy_* wrappers of qm_policy.c. */
struct qm_policy_iface {
    int version; /* QM_POLICY_IFACE_VERSION; checked by qm_policy_check */
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
};

/* ---- Declaring a policy to the registry ---------------------------------- */

/* One numeric parameter a policy accepts (policy_params.<name>). Values are
 * checked against [min, max] (and to be whole when `integer`) by the
 * registry; a parameter that is not given takes `def`. Two policies that
 * accept the same name declare the same range (a test checks it), so the
 * wire decoder can check a value before it knows the policy. */
struct qm_policy_param_spec {
    const char *name;
    double min, max, def;
    int integer;
    const char *doc; /* one line, for help texts */
};

#define QM_POLICY_DESC_VERSION 1

typedef struct qm__policy_desc {
    int version; /* QM_POLICY_DESC_VERSION */
    /* The policy's interface; its name is the policy's name. */
    const qm_policy_iface *iface;
    const char *summary;   /* one line, for help texts */
    int offered;           /* 1: offered over the socket (session.create) */
    int accepts_hot;       /* 1: takes policy_params.hot (hottest-first expert lists) */
    int accepts_prior;     /* 1: takes policy_params.prior (per-visit frequencies) */
    const qm_policy_param_spec *params;
    size_t n_params;
    /* A policy that reads parameters: its constructor. `params` is never
     * NULL here and has passed the registry's checks. */
    int (*create)(const qm_policy_params *params, qm_policy *out, qm_status *st);
    /* A policy that reads none (create NULL): the size of its ctx, which the
     * registry allocates zeroed (no ctx when 0). */
    size_t ctx_size;
    /* Set for a policy that cannot be made from parameters alone (belady):
     * why. */
    const char *refusal;
} qm__policy_desc;

/* The members an offered policy's descriptor opens with: the descriptor
 * version, its interface (whose name is the policy's) and its help line. */
#define QM__POLICY_OFFERED(iface_, summary_)                                                       \
    .version = QM_POLICY_DESC_VERSION, .iface = &(iface_), .summary = (summary_), .offered = 1
/* A policy's parameter table as its descriptor's params and n_params. */
#define QM__POLICY_PARAMS(table) .params = (table), .n_params = sizeof(table) / sizeof((table)[0])

/* The value of parameter `name` of the policy being built: the given one,
 * else the default that the policy's table specs[n] declares. `name` must
 * be in the table. */
double qm__policy_param_in(const qm_policy_params *params, const qm_policy_param_spec *specs,
                           size_t n, const char *name);
/* The same with the policy's parameter table by name. */
#define QM__POLICY_PARAM(params, table, name)                                                      \
    qm__policy_param_in((params), (table), sizeof(table) / sizeof((table)[0]), (name))

#endif
