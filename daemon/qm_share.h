/* qm_share.h - shared residency (qm_share.c): sessions of one model that
 * ask for policy_params.share_residency, with the same policy and knobs,
 * draw their experts from one pool: one pager whose budget is the sum of
 * the budgets of the sessions that joined it (docs/PAGING.md "Shared
 * residency"). Each session keeps its own counters: what a call or a resize
 * did to the pool (hits, misses, evictions, bytes paged) is the counters of
 * the session that made it.
 *
 * Threads: the pool's pager, plan and budget are guarded by its lock
 * (members' jobs run on several workers at once); the registry's list of
 * pools and the reference counts are the loop's. */
#ifndef QM_SHARE_H
#define QM_SHARE_H

#include <pthread.h>
#include <stdint.h>

#include "qm_backend.h"
#include "qm_bank.h"
#include "qm_pager.h"
#include "qm_placement.h"
#include "qm_residency.h"

typedef struct qm_share {
    const qm_bank *bank; /* the model's, borrowed (members hold the model) */
    char key[256];       /* model, policy and knobs: who may join (qm_share_key) */
    /* Owned; the pager is built by the first member that joins. */
    qm_policy policy;
    qm_residency_plan *plan;
    qm_placement placement;
    qm_pager_options options;
    qm_multipager *pagers;
    qm_backend *backend; /* the one device's, borrowed, set by the first join */
    uint64_t budget; /* the sum of the members' shares, under `lock` */
    uint32_t members; /* sessions joined, under `lock` */
    pthread_mutex_t lock;
    int refs; /* sessions that hold it (loop) */
    struct qm_share **head, *next; /* the registry's list of pools, and the next */
} qm_share;

/* A new pool, linked first into *head, that owns `policy`, `plan` and
 * `placement` (moved in: the caller's are zeroed), or NULL when out of
 * memory (nothing moved). */
qm_share *qm_share_new(qm_share **head, const qm_bank *bank, const char *key, qm_policy *policy,
                       qm_residency_plan **plan, qm_placement *placement,
                       const qm_pager_options *options);
/* The pool of `bank` and `key` in the list, or NULL (a model loaded again
 * under the same name is another bank: another pool). */
qm_share *qm_share_find(qm_share *head, const qm_bank *bank, const char *key);
void qm_share_ref(qm_share *p);
/* The last reference unlinks and frees the pool (accepts NULL). */
void qm_share_unref(qm_share *p);

/* A member of `budget` joins (worker): the first builds the pager at its
 * budget, the next ones grow it by theirs. On 0 *own holds the member's
 * counters to start from (its share of the pool). */
int qm_share_join(qm_share *p, qm_backend *const *devices, uint64_t budget, qm_pager_stats *own,
                  qm_status *st);
/* A member of `budget` leaves (its session freed): the pool shrinks by it. */
void qm_share_leave(qm_share *p, uint64_t budget);
/* One call on the pool, its counters' change added to *own (the member's
 * counters; resident_bytes its budget's share of the pool's). */
int qm_share_forward(qm_share *p, const qm_moe_call *call, qm_moe_stats *mstats,
                     uint64_t own_budget, qm_pager_stats *own, qm_status *st);
/* A member's share goes from `old_budget` to `new_budget`: the pool's
 * budget changes by the difference (evictions counted to *own). */
int qm_share_resize(qm_share *p, uint64_t old_budget, uint64_t new_budget, qm_pager_stats *own,
                    qm_status *st);

/* The key of a session that may share: "model/policy/prefetch/on_miss/
 * knob=value..." in the order given. */
void qm_share_key(char *out, size_t cap, const char *model, const char *policy, int prefetch,
                  int on_miss, const char *const *names, const double *values, size_t n);

#endif
