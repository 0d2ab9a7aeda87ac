/* qm_policy_belady.c - Belady's MIN: evict the expert whose next use is
 * furthest away. Needs the future, so it is the offline yardstick for tests
 * and benchmarks, never offered over the socket. */
#include "qm_residency.h"
#include "qm_policy_impl.h"
#include "qm_residency_impl.h"

#include <string.h>

#include "qm_alloc.h"

#define NEVER UINT64_MAX

typedef struct belady_ctx {
    /* history: key -> last_tick = its first position >= cursor, or NEVER */
    qm__split_base base;
    uint64_t *future;   /* keys, in access order */
    uint64_t *next_use; /* next_use[i]: next position of future[i]'s key after i, or NEVER */
    size_t n;
    size_t cursor;        /* positions < cursor have been accessed */
} belady_ctx;

static void belady_on_access(void *ctx, qm_expert_ref ref, uint64_t tick, int hit)
{
    (void)ref; /* the sequence is the truth: position `cursor` is consumed whatever was passed */
    (void)tick;
    (void)hit;
    belady_ctx *bl = ctx;
    if (bl->cursor >= bl->n) return;
    qm__ref_entry *e = qm__ref_map_find(&bl->base.history, bl->future[bl->cursor]);
    if (e) /* always present: built from the same sequence */
        e->last_tick = bl->next_use[bl->cursor];
    bl->cursor++;
}

static int belady_choose_victim(void *ctx, const qm_expert_ref *candidates, size_t n,
                                size_t *victim)
{
    belady_ctx *bl = ctx;
    size_t best = 0;
    uint64_t best_next = 0;
    for (size_t i = 0; i < n; i++) {
        const qm__ref_entry *e = qm__ref_map_find(&bl->base.history, qm__ref_key(candidates[i]));
        uint64_t next = e ? e->last_tick : NEVER;
        if (next == NEVER) {
            best = i;
            break; /* nothing is further than never */
        }
        if (next > best_next) {
            best_next = next;
            best = i;
        }
    }
    *victim = best;
    return 0;
}

static void belady_destroy(void *ctx)
{
    belady_ctx *bl = ctx;
    if (!bl) return;
    qm_free(bl->future);
    qm_free(bl->next_use);
    qm__split_destroy(bl);
}

QM__SPLIT_IFACE(belady_iface, "belady", .on_access = belady_on_access,
                .choose_victim = belady_choose_victim, .destroy = belady_destroy);

int qm_policy_belady_new(const qm_expert_ref *future, size_t n, qm_policy *out, qm_status *st)
{
    if (!out) return qm_status_set(st, QM_EINVAL, "no policy to fill");
    out->iface = NULL;
    out->ctx = NULL;
    if (n && !future)
        return qm_status_set(st, QM_EINVAL, "belady: %zu future accesses but no array", n);
    belady_ctx *bl = qm_calloc(1, sizeof *bl);
    if (!bl) goto fail;
    bl->future = qm_calloc(n ? n : 1, sizeof *bl->future);
    bl->next_use = qm_calloc(n ? n : 1, sizeof *bl->next_use);
    if (!bl->future || !bl->next_use) goto fail_arrays;
    bl->n = n;
    /* Walking backwards, the map holds each key's nearest later position. */
    for (size_t i = n; i-- > 0;) {
        uint64_t key = qm__ref_key(future[i]);
        bl->future[i] = key;
        int seen = qm__ref_map_find(&bl->base.history, key) != NULL;
        qm__ref_entry *e = qm__ref_map_upsert(&bl->base.history, key);
        if (!e) goto fail_arrays;
        bl->next_use[i] = seen ? e->last_tick : NEVER;
        e->last_tick = i;
    }
    out->iface = &belady_iface;
    out->ctx = bl;
    return 0;

fail_arrays:
    belady_destroy(bl);
fail:
    return qm_status_set(st, QM_ENOMEM, "out of memory creating policy 'belady' (%zu accesses)", n);
}

const qm__policy_desc qm__policy_belady_desc = {
    .version = QM_POLICY_DESC_VERSION,
    .iface = &belady_iface,
    .summary = "offline optimum: evicts the expert used furthest in the future (tests, benchmarks)",
    .offered = 0,
    .refusal = "needs the future trace and is for tests and benchmarks only",
};
