/* qm_expert_pool.c - the pool of resident experts a session draws from: a
 * pool of one, or one shared by the sessions of a model (qm_expert_pool.h). */
#include "qm_expert_pool.h"

#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"

struct qm_expert_pool {
    const qm_bank *bank; /* borrowed (members hold the model) */
    int shared;
    /* A pool of one borrows its member's recipe; a shared pool points at
     * `owned`. */
    qm_pool_recipe *recipe;
    qm_pool_recipe owned;
    qm_multipager *pagers; /* built by the first member that joins */
    pthread_mutex_t lock;
    /* Shared pools: who may join (qm_expert_pool_key), the one device's
     * backend (set by the first join), the sum of the members' budgets and
     * how many joined (under `lock`), references (the caller's thread), the
     * list of pools and the next. */
    char key[256];
    qm_backend *backend;
    uint64_t budget;
    uint32_t members;
    int refs;
    struct qm_expert_pool **head, *next;
};

void qm_pool_recipe_free(qm_pool_recipe *r)
{
    if (!r)
        return;
    qm_placement_free(&r->placement);
    qm_plan_free(r->plan);
    qm_policy_destroy(&r->policy);
    memset(r, 0, sizeof *r);
}

static qm_expert_pool *pool_new(const qm_bank *bank)
{
    qm_expert_pool *p = qm_calloc(1, sizeof *p);
    if (!p)
        return NULL;
    if (pthread_mutex_init(&p->lock, NULL) != 0) {
        qm_free(p);
        return NULL;
    }
    p->bank = bank;
    p->refs = 1;
    return p;
}

qm_expert_pool *qm_expert_pool_own(const qm_bank *bank, qm_pool_recipe *recipe)
{
    qm_expert_pool *p = pool_new(bank);
    if (p)
        p->recipe = recipe;
    return p;
}

qm_expert_pool *qm_expert_pool_shared(qm_expert_pool **head, const qm_bank *bank,
                                      const char *key, qm_pool_recipe *recipe)
{
    qm_expert_pool *p = pool_new(bank);
    if (!p)
        return NULL;
    p->shared = 1;
    snprintf(p->key, sizeof p->key, "%s", key);
    p->owned = *recipe;
    memset(recipe, 0, sizeof *recipe);
    p->recipe = &p->owned;
    p->head = head;
    p->next = *head;
    *head = p;
    return p;
}

qm_expert_pool *qm_expert_pool_find(qm_expert_pool *head, const qm_bank *bank, const char *key)
{
    for (qm_expert_pool *p = head; p; p = p->next)
        if (p->bank == bank && strcmp(p->key, key) == 0)
            return p;
    return NULL;
}

void qm_expert_pool_ref(qm_expert_pool *p) { p->refs++; }

void qm_expert_pool_unref(qm_expert_pool *p)
{
    if (!p || --p->refs > 0)
        return;
    for (qm_expert_pool **pp = p->head; pp && *pp; pp = &(*pp)->next) {
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    }
    qm_multipager_free(p->pagers);
    qm_pool_recipe_free(&p->owned);
    pthread_mutex_destroy(&p->lock);
    qm_free(p);
}

int qm_expert_pool_is_shared(const qm_expert_pool *p) { return p->shared; }

/* ---- a shared pool's members' counters ---- */

/* The counters that count events (everything but the gauges and what is
 * fixed at creation): uint64_t members from `hits` to `host_admits`, and
 * from `disk_busy_us` to `reads_in_flight_sum`. */
static int is_event(size_t off)
{
    return off != offsetof(qm_pager_stats, resident_bytes) &&
           off != offsetof(qm_pager_stats, budget_bytes) &&
           off != offsetof(qm_pager_stats, bytes_loaded_at_create);
}

static void add_change(qm_pager_stats *own, const qm_pager_stats *was, const qm_pager_stats *now)
{
    for (size_t off = offsetof(qm_pager_stats, hits);
         off <= offsetof(qm_pager_stats, reads_in_flight_sum); off += sizeof(uint64_t)) {
        /* ... and the disk source's I/O counters, after the fixed ones */
        if (off > offsetof(qm_pager_stats, host_admits) &&
            off < offsetof(qm_pager_stats, disk_busy_us))
            off = offsetof(qm_pager_stats, disk_busy_us);
        if (!is_event(off))
            continue;
        uint64_t a, b, o;
        memcpy(&a, (const char *)was + off, sizeof a);
        memcpy(&b, (const char *)now + off, sizeof b);
        memcpy(&o, (char *)own + off, sizeof o);
        o += b - a;
        memcpy((char *)own + off, &o, sizeof o);
    }
    if (now->reads_in_flight_peak > own->reads_in_flight_peak)
        own->reads_in_flight_peak = now->reads_in_flight_peak;
}

/* Under the lock: the gauges of a member of `budget`. */
static void own_gauges(const qm_expert_pool *p, const qm_pager_stats *now, uint64_t budget,
                       qm_pager_stats *own)
{
    own->budget_bytes = budget;
    own->resident_bytes =
        p->budget ? (uint64_t)((double)now->resident_bytes * ((double)budget / (double)p->budget))
                  : 0;
    own->arena_bytes = now->arena_bytes;
}

/* Under the lock: every member's budget is at least what a pager of its
 * own would need (whole banks + pins + one unit), so that the pool still
 * fits its budget whoever leaves. */
static int check_min(qm_expert_pool *p, uint64_t budget, qm_status *st)
{
    uint64_t min = 0;
    int rc = qm_pager_min_budget(p->backend, p->bank, p->recipe->plan, &p->recipe->options, &min,
                                 st);
    if (rc < 0)
        return rc;
    if (budget < min)
        return qm_status_set_field(st, QM_ERESOURCE_EXHAUSTED, "budget_bytes",
                                   "budget_bytes %llu is below the minimum %llu of a session "
                                   "sharing residency (whole banks, pins and one expert unit, "
                                   "as a session of its own needs)",
                                   (unsigned long long)budget, (unsigned long long)min);
    return 0;
}

static int build(qm_expert_pool *p, qm_backend *const *devices, qm_status *st)
{
    qm_pool_recipe *r = p->recipe;
    return qm_multipager_new(devices, p->bank, r->plan, &r->policy, &r->options, &r->placement,
                             &p->pagers, st);
}

/* Under the lock: a member joins a shared pool. */
static int join_shared(qm_expert_pool *p, qm_backend *const *devices, qm_pool_member *m,
                       uint64_t budget, qm_status *st)
{
    int rc = 0;
    memset(&m->own, 0, sizeof m->own);
    p->backend = devices[0];
    if (!p->pagers) {
        qm_plan_set_budget(p->recipe->plan, budget);
        rc = build(p, devices, st);
        if (rc == 0) {
            p->budget = budget;
            qm_multipager_stats(p->pagers, &m->own);
        }
    } else if ((rc = check_min(p, budget, st)) == 0) {
        unsigned long long total = 0;
        if (qm_add_u64(p->budget, budget, &total) < 0)
            rc = qm_status_set_field(st, QM_ERESOURCE_EXHAUSTED, "budget_bytes",
                                     "the shared pool's budget would overflow");
        if (rc == 0)
            rc = qm_multipager_resize(p->pagers, total, st);
        if (rc == 0) {
            p->budget = total;
            qm_plan_set_budget(p->recipe->plan, total);
        }
    }
    if (rc == 0) {
        p->members++;
        qm_pager_stats now;
        qm_multipager_stats(p->pagers, &now);
        own_gauges(p, &now, budget, &m->own);
    }
    return rc;
}

int qm_expert_pool_join(qm_expert_pool *p, qm_backend *const *devices, qm_pool_member *m,
                        uint64_t budget, qm_status *st)
{
    pthread_mutex_lock(&p->lock);
    int rc = p->shared ? join_shared(p, devices, m, budget, st) : build(p, devices, st);
    pthread_mutex_unlock(&p->lock);
    if (rc == 0) {
        m->joined = 1;
        m->budget = budget;
    }
    return rc;
}

int qm_expert_pool_leave(qm_expert_pool *p, qm_pool_member *m, qm_status *st)
{
    int rc = 0;
    if (!m->joined)
        return 0;
    m->joined = 0;
    pthread_mutex_lock(&p->lock);
    if (p->shared) {
        p->members--;
        p->budget -= m->budget < p->budget ? m->budget : p->budget;
    }
    if (!p->shared || p->members == 0) {
        /* The last member: its memory goes now, even while a session about
         * to join still holds the pool (that one builds it again). */
        qm_multipager_free(p->pagers);
        p->pagers = NULL;
        p->budget = 0;
    } else {
        /* Each member's budget was at least the minimum, so the rest's sum
         * is too; a failure keeps the larger pool. */
        rc = qm_multipager_resize(p->pagers, p->budget, st);
        if (rc == 0)
            qm_plan_set_budget(p->recipe->plan, p->budget);
    }
    pthread_mutex_unlock(&p->lock);
    return rc;
}

int qm_expert_pool_forward(qm_expert_pool *p, qm_pool_member *m, const qm_moe_call *call,
                           qm_moe_stats *mstats, qm_status *st)
{
    if (!p->shared) /* its member's FIFO runs one call at a time */
        return qm_multipager_forward(p->pagers, call, mstats, st);
    qm_pager_stats was, now;
    pthread_mutex_lock(&p->lock);
    qm_multipager_stats(p->pagers, &was);
    int rc = qm_multipager_forward(p->pagers, call, mstats, st);
    qm_multipager_stats(p->pagers, &now);
    add_change(&m->own, &was, &now);
    own_gauges(p, &now, m->budget, &m->own);
    pthread_mutex_unlock(&p->lock);
    return rc;
}

void qm_expert_pool_after_forward(qm_expert_pool *p, qm_pool_member *m, int tidy)
{
    if (!p->shared) {
        qm_multipager_after_forward(p->pagers, tidy);
        return;
    }
    qm_pager_stats was, now;
    pthread_mutex_lock(&p->lock);
    qm_multipager_stats(p->pagers, &was);
    qm_multipager_after_forward(p->pagers, tidy);
    qm_multipager_stats(p->pagers, &now);
    add_change(&m->own, &was, &now);
    own_gauges(p, &now, m->budget, &m->own);
    pthread_mutex_unlock(&p->lock);
}

static int resize_shared(qm_expert_pool *p, qm_pool_member *m, uint64_t budget, qm_status *st)
{
    qm_pager_stats was, now;
    uint64_t total = p->budget - (m->budget < p->budget ? m->budget : p->budget);
    int rc = check_min(p, budget, st);
    if (rc == 0 && total + budget < total)
        rc = qm_status_set_field(st, QM_ERESOURCE_EXHAUSTED, "budget_bytes",
                                 "the shared pool's budget would overflow");
    total += budget;
    qm_multipager_stats(p->pagers, &was);
    if (rc == 0)
        rc = qm_multipager_resize(p->pagers, total, st);
    if (rc == 0) {
        p->budget = total;
        qm_plan_set_budget(p->recipe->plan, total);
    }
    qm_multipager_stats(p->pagers, &now);
    add_change(&m->own, &was, &now);
    own_gauges(p, &now, rc == 0 ? budget : m->budget, &m->own);
    return rc;
}

int qm_expert_pool_resize(qm_expert_pool *p, qm_pool_member *m, uint64_t budget,
                          qm_status *st)
{
    pthread_mutex_lock(&p->lock);
    int rc = p->shared ? resize_shared(p, m, budget, st)
                       : qm_multipager_resize(p->pagers, budget, st);
    pthread_mutex_unlock(&p->lock);
    if (rc == 0)
        m->budget = budget;
    return rc;
}

void qm_expert_pool_stats(qm_expert_pool *p, const qm_pool_member *m, qm_pager_stats *out)
{
    if (p->shared)
        *out = m->own;
    else
        qm_multipager_stats(p->pagers, out);
}

void qm_expert_pool_lock(qm_expert_pool *p) { pthread_mutex_lock(&p->lock); }
void qm_expert_pool_unlock(qm_expert_pool *p) { pthread_mutex_unlock(&p->lock); }

qm_pager *qm_expert_pool_pager_of(const qm_expert_pool *p, uint32_t layer)
{
    const qm_placement *pl = &p->recipe->placement;
    if (p->shared) /* one device */
        return qm_multipager_pager(p->pagers, 0);
    return layer < pl->n_layers ? qm_multipager_pager(p->pagers, pl->device_of[layer]) : NULL;
}

qm_multipager *qm_expert_pool_pagers(const qm_expert_pool *p) { return p->pagers; }

void qm_expert_pool_key(char *out, size_t cap, const char *model, const char *policy,
                        int prefetch, int on_miss, const qm_policy_value *values, size_t n)
{
    int len = snprintf(out, cap, "%s/%s/%d/%d", model, policy, prefetch, on_miss);
    for (size_t i = 0; i < n && len >= 0 && (size_t)len < cap; i++)
        len += snprintf(out + len, cap - len, "/%s=%.17g", values[i].name, values[i].value);
}
