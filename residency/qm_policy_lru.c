/* qm_policy_lru.c - lru (evict the least recently used) and static_hot (pin
 * the hottest experts of a profile, page the rest under LRU). */
#include "qm_residency.h"
#include "qm_policy_impl.h"
#include "qm_residency_impl.h"

#include <math.h>
#include <string.h>

#include "qm_alloc.h"

typedef struct lru_ctx {
    qm__split_base base; /* history: last_tick = 1 + tick of the latest access; 0 = never */
} lru_ctx;

static void lru_touch(void *ctx, qm_expert_ref ref, uint64_t tick)
{
    lru_ctx *lru = ctx;
    qm__ref_entry *e = qm__ref_map_upsert(&lru->base.history, qm__ref_key(ref));
    if (e) /* no memory: this expert just looks older than it is */
        e->last_tick = qm__tick_stamp(tick);
}

static void lru_on_access(void *ctx, qm_expert_ref ref, uint64_t tick, int hit)
{
    (void)hit;
    lru_touch(ctx, ref, tick);
}

static void lru_on_insert(void *ctx, qm_expert_ref ref, uint64_t tick)
{
    lru_touch(ctx, ref, tick);
}

/* Every candidate ranks alike: the scan's tie rule, least recent first, is LRU. */
static double lru_rank(void *ctx, const qm__ref_entry *e, const qm__bank_phase *ph, int *list)
{
    (void)ctx;
    (void)e;
    (void)ph;
    (void)list;
    return 0.0;
}

static int lru_choose_victim(void *ctx, const qm_expert_ref *candidates, size_t n, size_t *victim)
{
    lru_ctx *lru = ctx;
    *victim = qm__victim_scan1(&lru->base.history, candidates, n, NULL, lru_rank, NULL);
    return 0;
}

/* The LRU hooks, which static_hot's iface shares. */
#define QM__LRU_HOOKS                                                                              \
    .on_access = lru_on_access, .on_insert = lru_on_insert, .choose_victim = lru_choose_victim
QM__SPLIT_IFACE(lru_iface, "lru", QM__LRU_HOOKS, .destroy = qm__split_destroy);

const qm__policy_desc qm__policy_lru_desc = {
    QM__POLICY_OFFERED(lru_iface, "pages every expert; evicts the least recently used"),
    .ctx_size = sizeof(lru_ctx),
};

/* ---- static_hot ---------------------------------------------------------- */

typedef struct static_hot_ctx {
    lru_ctx lru; /* first member: the LRU hooks take this ctx as their own */
    uint32_t **hot;   /* owns one block: hot[], hot_len[] and the lists' entries */
    size_t *hot_len;
    size_t n_hot_banks;
    size_t n_listed_banks; /* banks with a non-empty hot list share the pin budget */
    double pin_fraction;
    uint32_t *pinned; /* decide()'s answer; owns one block with seen */
    uint8_t *seen;    /* per expert of the bank being decided: already pinned */
    size_t scratch_cap;
} static_hot_ctx;

static int static_hot_decide(void *ctx, const qm_policy_input *in, qm_residency_decision *out)
{
    static_hot_ctx *sh = ctx;
    int rc = qm__split_decide(sh, in, out);
    if (rc != 0 || out->kind != QM_DECISION_PER_EXPERT) return rc;
    uint32_t b = in->bank_id;
    if (b >= sh->n_hot_banks || !sh->hot_len[b])
        return 0; /* no profile for this bank: nothing pinned, pure LRU */
    uint32_t n = qm_catalog_expert_count(in->catalog);
    uint64_t slot = qm_catalog_bytes_per_expert(in->catalog);
    size_t max_pins = SIZE_MAX;
    if (in->has_budget) {
        /* Even split of pin_fraction * budget among the listed banks: the
         * answer does not depend on the order decide() is called in. */
        long double share = (long double)sh->pin_fraction * (long double)in->budget_bytes /
                            (long double)sh->n_listed_banks;
        if (share > (long double)in->budget_bytes) share = (long double)in->budget_bytes;
        uint64_t share_bytes = (uint64_t)floorl(share);
        max_pins = slot ? (size_t)(share_bytes / slot) : 0;
    }
    if (max_pins == 0) return 0;
    if (sh->scratch_cap < n) { /* both are rewritten by every decide: nothing to keep */
        uint32_t *pinned = qm_malloc((size_t)n * (sizeof *pinned + 1));
        if (!pinned) return QM_ENOMEM;
        qm_free(sh->pinned);
        sh->pinned = pinned;
        sh->seen = (uint8_t *)(pinned + n);
        sh->scratch_cap = n;
    }
    memset(sh->seen, 0, n);
    size_t n_pinned = 0;
    for (size_t i = 0; i < sh->hot_len[b] && n_pinned < max_pins; i++) {
        uint32_t e = sh->hot[b][i];
        if (e >= n || sh->seen[e]) continue; /* a profile from another model shape, or a repeat */
        sh->seen[e] = 1;
        sh->pinned[n_pinned++] = e;
    }
    out->pinned = n_pinned ? sh->pinned : NULL;
    out->n_pinned = n_pinned;
    return 0;
}

static void static_hot_destroy(void *ctx)
{
    static_hot_ctx *sh = ctx;
    if (!sh) return;
    qm_free(sh->hot);    /* with hot_len and the lists */
    qm_free(sh->pinned); /* with seen */
    qm__split_destroy(sh); /* sh starts with its lru_ctx, which starts with the base */
}

static const qm_policy_iface static_hot_iface = {
    .version = QM_POLICY_IFACE_VERSION,
    .name = "static_hot",
    .decide = static_hot_decide,
    QM__LRU_HOOKS,
    .destroy = static_hot_destroy,
};

static const qm_policy_param_spec static_hot_params[] = {
    {.name = "pin_fraction", .min = 0.0, .max = 1.0, .def = QM_POLICY_DEFAULT_PIN_FRACTION,
     .doc = "share of the budget for pins, split evenly between banks with a hot list"},
};

static int static_hot_new(const qm_policy_params *params, qm_policy *out, qm_status *st)
{
    double fraction = QM__POLICY_PARAM(params, static_hot_params, "pin_fraction");
    size_t n_banks = params->hot && params->hot_len ? params->n_hot_banks : 0;
    static_hot_ctx *sh = qm__policy_alloc(&static_hot_iface, sizeof *sh, out, st);
    if (!sh) return QM_ENOMEM;
    sh->pin_fraction = fraction;
    if (n_banks) {
        /* The copied lists have one lifetime: one block of the list
         * pointers, the lengths, then every list's entries. */
        unsigned long long entries = 0, bytes, head;
        for (size_t b = 0; b < n_banks; b++)
            if (params->hot[b] && qm_add_u64(entries, params->hot_len[b], &entries))
                goto fail_copy;
        if (qm_mul_u64(n_banks, sizeof *sh->hot + sizeof *sh->hot_len, &head) ||
            qm_mul_u64(entries, sizeof **sh->hot, &bytes) || qm_add_u64(bytes, head, &bytes) ||
            bytes > SIZE_MAX)
            goto fail_copy;
        sh->hot = qm_calloc(1, (size_t)bytes);
        if (!sh->hot) goto fail_copy;
        sh->n_hot_banks = n_banks;
        sh->hot_len = (size_t *)(sh->hot + n_banks);
        uint32_t *at = (uint32_t *)(sh->hot_len + n_banks);
        for (size_t b = 0; b < n_banks; b++) {
            size_t len = params->hot[b] ? params->hot_len[b] : 0;
            if (!len) continue;
            sh->hot[b] = at;
            memcpy(at, params->hot[b], len * sizeof *at);
            at += len;
            sh->hot_len[b] = len;
            sh->n_listed_banks++;
        }
    }
    return 0;

fail_copy:
    qm_policy_destroy(out); /* static_hot_destroy frees what was copied; *out is reset */
    return qm_status_set(st, QM_ENOMEM, "out of memory creating policy 'static_hot'");
}

const qm__policy_desc qm__policy_static_hot_desc = {
    QM__POLICY_OFFERED(static_hot_iface,
                       "pins the hottest experts (policy_params.hot or the saved profile) up to "
                       "pin_fraction of the budget; pages the rest under LRU"),
    .accepts_hot = 1,
    QM__POLICY_PARAMS(static_hot_params),
    .create = static_hot_new,
};
