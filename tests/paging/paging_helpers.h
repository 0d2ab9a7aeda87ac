/* paging_helpers.h - helpers shared by the paging suites. */
#ifndef PAGING_HELPERS_H
#define PAGING_HELPERS_H

#include <stddef.h>
#include <stdint.h>

#include "paging_fixture.h"
#include "qm_moe.h"
#include "qm_pager.h"
#include "qm_placement.h"
#include "qm_residency.h"

/* Budget the alloc hook checks against (and the count of allocations). */
extern uint64_t g_budget;
extern uint64_t g_allocs;
void budget_hook(void *ud, uint64_t resident, uint64_t budget);

typedef struct pg_call {
    uint32_t layer, T;
    float *x, *logits; /* logits NULL: the bank's router */
    float *ref;        /* whole-bank output */
    uint32_t uniq[64];
    size_t n_uniq;
} pg_call;

typedef struct pg_set {
    pg_call *calls;
    size_t n;
    qm_expert_ref *future; /* every access, in the order the pager sees them */
    size_t n_future;
} pg_set;

/* Distinct non-dropped experts of route[0..n), ascending. */
void uniq_sorted(const uint32_t *route, size_t n, uint32_t *out, size_t *n_out);
/* `n` random calls over every layer (some routed by the bank's router),
 * with whole-bank reference outputs and the access sequence. */
void make_calls(const pf_bank *b, qm_backend *cpu, size_t n, uint64_t seed, pg_set *set);
void free_calls(pg_set *set);
uint64_t unit_bytes(const pf_bank *b);
/* static_hot hot lists used by new_policy: layer l lists (l + 3 i) mod E, E/2 long. */
extern uint32_t g_hot[8][64];
extern size_t g_hot_len[8];
extern const uint32_t *g_hot_ptr[8];
/* "belady" uses set->future. */
void new_policy(const char *name, const pf_bank *b, const pg_set *set, qm_policy *pol);
qm_residency_plan *make_plan(const pf_bank *b, const qm_policy *pol, int has_budget,
                             uint64_t budget);
/* A pager with `budget`, history 1, no gating, no preload (the model's rules). */
qm_pager *lru_pager(const pf_bank *b, qm_backend *be, qm_policy *pol, uint64_t budget,
                    int prefetch, qm_residency_plan **plan);
/* A session over several devices as the suites build it: frees the
 * multipager, the placement, the plan and the policy, then the two devices. */
void free_two_devices(qm_multipager *mp, qm_placement *pl, qm_residency_plan *plan,
                      qm_policy *pol, qm_backend *dev[2]);
/* The process's anonymous resident bytes (RssAnon of /proc/self/status):
 * what a shrink gives back shows here. */
uint64_t pg_rss_anon(void);
/* The reopened fixture bank of units of many pages (2 layers x 16 experts,
 * H 256, I 512, int8): a slot a shrink gives back holds whole pages. */
void pg_fixture_big_units(void);

/* One single-token call of `layer` routed to ex[0..n). */
void call_experts(qm_pager *pg, const pf_bank *b, uint32_t layer, const uint32_t *ex, uint32_t n,
                  uint64_t *seed);

/* ---- The fixture the paging suites share ---------------------------------------------- */

/* Before each test of a TCase given tcase_add_checked_fixture(tc,
 * pg_fixture_setup, pg_fixture_teardown): the default bank
 * (pf_default_spec), a one-thread CPU backend and a clear status. After it:
 * those, and the policy, plan and pager a test made with
 * pg_fixture_lru_pager, are freed. */
typedef struct pg_fixture {
    pf_spec spec;
    pf_bank bank;
    qm_backend *cpu;
    qm_status st;
    qm_policy pol;
    qm_residency_plan *plan;
    qm_pager *pager;
} pg_fixture;

extern pg_fixture fixture;
void pg_fixture_setup(void);
void pg_fixture_teardown(void);
/* Reopens the bank with `spec` (a test that needs another shape). */
void pg_fixture_reopen(const pf_spec *spec);
/* An "lru" policy, its plan at `budget` and a pager as lru_pager makes it,
 * kept in the fixture (freed by the teardown). */
qm_pager *pg_fixture_lru_pager(uint64_t budget, int prefetch);

#endif
