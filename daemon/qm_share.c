/* qm_share.c - one pool of resident experts for the sessions of a model
 * that share residency (qm_share.h). */
#include "qm_share.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_log.h"

qm_share *qm_share_new(qm_share **head, const qm_bank *bank, const char *key, qm_policy *policy,
                       qm_residency_plan **plan, qm_placement *placement,
                       const qm_pager_options *options)
{
    qm_share *p = qm_calloc(1, sizeof *p);
    if (!p)
        return NULL;
    if (pthread_mutex_init(&p->lock, NULL) != 0) {
        qm_free(p);
        return NULL;
    }
    p->bank = bank;
    snprintf(p->key, sizeof p->key, "%s", key);
    p->policy = *policy;
    memset(policy, 0, sizeof *policy);
    p->plan = *plan;
    *plan = NULL;
    p->placement = *placement;
    memset(placement, 0, sizeof *placement);
    p->options = *options;
    p->refs = 1;
    p->head = head;
    p->next = *head;
    *head = p;
    return p;
}

qm_share *qm_share_find(qm_share *head, const qm_bank *bank, const char *key)
{
    for (qm_share *p = head; p; p = p->next)
        if (p->bank == bank && strcmp(p->key, key) == 0)
            return p;
    return NULL;
}

void qm_share_ref(qm_share *p) { p->refs++; }

void qm_share_unref(qm_share *p)
{
    if (!p || --p->refs > 0)
        return;
    for (qm_share **pp = p->head; *pp; pp = &(*pp)->next) {
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    }
    qm_multipager_free(p->pagers);
    qm_placement_free(&p->placement);
    qm_plan_free(p->plan);
    qm_policy_destroy(&p->policy);
    pthread_mutex_destroy(&p->lock);
    qm_free(p);
}

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
static void own_gauges(const qm_share *p, const qm_pager_stats *now, uint64_t budget,
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
static int check_min(qm_share *p, uint64_t budget, qm_status *st)
{
    uint64_t min = 0;
    int rc = qm_pager_min_budget(p->backend, p->bank, p->plan, &p->options, &min, st);
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

int qm_share_join(qm_share *p, qm_backend *const *devices, uint64_t budget, qm_pager_stats *own,
                  qm_status *st)
{
    int rc = 0;
    memset(own, 0, sizeof *own);
    pthread_mutex_lock(&p->lock);
    p->backend = devices[0];
    if (!p->pagers) {
        qm_plan_set_budget(p->plan, budget);
        rc = qm_multipager_new(devices, p->bank, p->plan, &p->policy, &p->options, &p->placement,
                               &p->pagers, st);
        if (rc == 0) {
            p->budget = budget;
            qm_multipager_stats(p->pagers, own);
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
            qm_plan_set_budget(p->plan, total);
        }
    }
    if (rc == 0) {
        p->members++;
        qm_pager_stats now;
        qm_multipager_stats(p->pagers, &now);
        own_gauges(p, &now, budget, own);
    }
    pthread_mutex_unlock(&p->lock);
    return rc;
}

void qm_share_leave(qm_share *p, uint64_t budget)
{
    pthread_mutex_lock(&p->lock);
    p->members--;
    p->budget -= budget < p->budget ? budget : p->budget;
    if (p->members == 0) {
        /* The last member: its memory goes now, even while a session about
         * to join still holds the pool (that one builds it again). */
        qm_multipager_free(p->pagers);
        p->pagers = NULL;
        p->budget = 0;
    } else {
        /* Each member's budget was at least the minimum, so the rest's sum
         * is too; a failure keeps the larger pool (logged). */
        qm_status st = {0};
        if (qm_multipager_resize(p->pagers, p->budget, &st) < 0)
            qm_log(QM_LOG_WARNING, "shared residency pool: giving back a member's %llu bytes "
                   "failed (%s); the pool keeps them until its next member leaves",
                   (unsigned long long)budget, st.msg);
        else
            qm_plan_set_budget(p->plan, p->budget);
    }
    pthread_mutex_unlock(&p->lock);
}

int qm_share_forward(qm_share *p, const qm_moe_call *call, qm_moe_stats *mstats,
                     uint64_t own_budget, qm_pager_stats *own, qm_status *st)
{
    qm_pager_stats was, now;
    pthread_mutex_lock(&p->lock);
    qm_multipager_stats(p->pagers, &was);
    int rc = qm_multipager_forward(p->pagers, call, mstats, st);
    qm_multipager_stats(p->pagers, &now);
    add_change(own, &was, &now);
    own_gauges(p, &now, own_budget, own);
    pthread_mutex_unlock(&p->lock);
    return rc;
}

int qm_share_resize(qm_share *p, uint64_t old_budget, uint64_t new_budget, qm_pager_stats *own,
                    qm_status *st)
{
    qm_pager_stats was, now;
    pthread_mutex_lock(&p->lock);
    uint64_t total = p->budget - (old_budget < p->budget ? old_budget : p->budget);
    int rc = check_min(p, new_budget, st);
    if (rc == 0 && total + new_budget < total)
        rc = qm_status_set_field(st, QM_ERESOURCE_EXHAUSTED, "budget_bytes",
                                 "the shared pool's budget would overflow");
    total += new_budget;
    qm_multipager_stats(p->pagers, &was);
    if (rc == 0)
        rc = qm_multipager_resize(p->pagers, total, st);
    if (rc == 0) {
        p->budget = total;
        qm_plan_set_budget(p->plan, total);
    }
    qm_multipager_stats(p->pagers, &now);
    add_change(own, &was, &now);
    own_gauges(p, &now, rc == 0 ? new_budget : old_budget, own);
    pthread_mutex_unlock(&p->lock);
    return rc;
}

void qm_share_key(char *out, size_t cap, const char *model, const char *policy, int prefetch,
                  int on_miss, const char *const *names, const double *values, size_t n)
{
    int len = snprintf(out, cap, "%s/%s/%d/%d", model, policy, prefetch, on_miss);
    for (size_t i = 0; i < n && len >= 0 && (size_t)len < cap; i++)
        len += snprintf(out + len, cap - (size_t)len, "/%s=%.17g", names[i], values[i]);
}
