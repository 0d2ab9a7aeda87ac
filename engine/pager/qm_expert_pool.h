/* qm_expert_pool.h - the pool of resident experts a session draws from:
 * its own (a pool of one) or one shared by the sessions of a model that
 * ask for it (docs/PAGING.md "Shared residency"). A pool is one set of
 * pagers over its devices (qm_multipager, qm_placement.h) built from a
 * recipe: the policy, the plan, the placement and the pager options.
 *
 * A pool of one borrows its member's recipe and is the member's pagers, as
 * they are: its counters are the pagers' own. A shared pool owns its
 * recipe; its budget is the sum of its members' budgets, and each member
 * keeps its own counters: what a call or a resize did to the pool (hits,
 * misses, evictions, bytes paged) is the counters of the member that made
 * it. Callers take one path for both.
 *
 * Threads: a pool's pagers, plan and budget are guarded by its lock
 * (members' jobs run on several workers at once); the list of shared
 * pools and the reference counts are the caller's one thread's (the
 * daemon's loop). */
#ifndef QM_EXPERT_POOL_H
#define QM_EXPERT_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "qm_backend.h"
#include "qm_bank.h"
#include "qm_pager.h"
#include "qm_placement.h"
#include "qm_residency.h"

/* What a pool is built from. Owned by whoever holds it: a session (its
 * own, which a pool of one borrows) or a shared pool. */
typedef struct qm_pool_recipe {
    qm_policy policy;
    qm_residency_plan *plan;
    qm_placement placement;
    qm_pager_options options;
} qm_pool_recipe;

/* Releases the recipe's members (accepts a zeroed one). */
void qm_pool_recipe_free(qm_pool_recipe *r);

/* One member of a pool: its budget in the pool, whether it joined, and
 * (shared pools) its own counters. Embedded in the member; zeroed is a
 * member that has not joined. */
typedef struct qm_pool_member {
    uint64_t budget;
    int joined;
    qm_pager_stats own;
} qm_pool_member;

typedef struct qm_expert_pool qm_expert_pool;

/* A pool of one over `recipe` (borrowed: it must outlive the pool), with
 * no pagers until its member joins; NULL when out of memory. */
qm_expert_pool *qm_expert_pool_own(const qm_bank *bank, qm_pool_recipe *recipe);
/* A shared pool that owns `recipe` (moved in: the caller's is zeroed),
 * linked first into *head under `key`; NULL when out of memory (nothing
 * moved). */
qm_expert_pool *qm_expert_pool_shared(qm_expert_pool **head, const qm_bank *bank,
                                      const char *key, qm_pool_recipe *recipe);
/* The shared pool of `bank` and `key` in the list, or NULL (a model
 * loaded again under the same name is another bank: another pool). */
qm_expert_pool *qm_expert_pool_find(qm_expert_pool *head, const qm_bank *bank, const char *key);
void qm_expert_pool_ref(qm_expert_pool *p);
/* The last reference unlinks (shared) and frees the pool (accepts NULL). */
void qm_expert_pool_unref(qm_expert_pool *p);
/* 1 for a shared pool. */
int qm_expert_pool_is_shared(const qm_expert_pool *p);

/* Member m joins with `budget`: a pool of one builds its pagers at the
 * budget (whole banks and pins copied: a worker's call); the first member
 * of a shared pool builds them, the next ones grow the pool by theirs (a
 * member's budget is at least what pagers of its own would need). */
int qm_expert_pool_join(qm_expert_pool *p, qm_backend *const *devices, qm_pool_member *m,
                        uint64_t budget, qm_status *st);
/* Member m leaves (its session freed; nothing when it had not joined): a
 * pool of one frees its pagers; a shared pool shrinks by its budget (the
 * last member frees them). An error: the shared pool could not shrink and
 * keeps the member's bytes until its next member leaves (m has left). */
int qm_expert_pool_leave(qm_expert_pool *p, qm_pool_member *m, qm_status *st);
/* One layer call of member m on the pool's pagers. */
int qm_expert_pool_forward(qm_expert_pool *p, qm_pool_member *m, const qm_moe_call *call,
                           qm_moe_stats *mstats, qm_status *st);
/* The prefetch member m's last call left (qm_pager_after_forward), or
 * that and the pagers' tidying (tidy 1: qm_pager_tidy); in a shared pool
 * counted as m's. */
void qm_expert_pool_after_forward(qm_expert_pool *p, qm_pool_member *m, int tidy);
/* Member m's budget becomes `budget` (session.resize): the pool's budget
 * changes by the difference, split over its devices by the placement. */
int qm_expert_pool_resize(qm_expert_pool *p, qm_pool_member *m, uint64_t budget,
                          qm_status *st);
/* Member m's counters: the pagers' own in a pool of one; in a shared pool
 * its share (events it caused, resident_bytes its budget's part). */
void qm_expert_pool_stats(qm_expert_pool *p, const qm_pool_member *m, qm_pager_stats *out);

/* Reading the residency (session.plan): hold the pool still between
 * lock and unlock; pager_of is the pager that serves `layer` (NULL when
 * none: not built, or out of range). */
void qm_expert_pool_lock(qm_expert_pool *p);
void qm_expert_pool_unlock(qm_expert_pool *p);
qm_pager *qm_expert_pool_pager_of(const qm_expert_pool *p, uint32_t layer);
/* The pool's pagers (NULL before a member joined). */
qm_multipager *qm_expert_pool_pagers(const qm_expert_pool *p);

/* The key of a session that may share: "model/policy/prefetch/on_miss/
 * knob=value..." in the order given. */
void qm_expert_pool_key(char *out, size_t cap, const char *model, const char *policy,
                        int prefetch, int on_miss, const qm_policy_value *values, size_t n);

#endif
