/* rt_util.c - see rt_util.h. Test policies use libc malloc, so the counting
 * allocator sees only the code under test. */
#include "rt_util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"

uint64_t rt_rand(uint64_t *s)
{
    uint64_t x = *s ? *s : 0x9e3779b97f4a7c15ULL;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

qm_region_catalog *rt_catalog(uint32_t bank, uint32_t n_experts, uint32_t regions,
                              uint64_t region_bytes)
{
    qm_region_catalog *cat = NULL;
    if (qm_catalog_new(bank, n_experts, &cat) != 0) return NULL;
    for (uint32_t r = 0; r < regions; r++) {
        for (uint32_t e = 0; e < n_experts; e++) {
            qm_region reg = {.tensor = r,
                             .offset = ((uint64_t)r * n_experts + e) * region_bytes,
                             .length = region_bytes};
            if (qm_catalog_add_region(cat, e, reg) != 0) {
                qm_catalog_free(cat);
                return NULL;
            }
        }
    }
    return cat;
}

/* ---- Counting allocator ----------------------------------------------------- */

static long alloc_count, alloc_live, alloc_fail_at;
static int alloc_failed;

static int should_fail(void)
{
    alloc_count++;
    if (alloc_fail_at && alloc_count == alloc_fail_at) {
        alloc_failed = 1;
        return 1;
    }
    return 0;
}

static void *count_malloc(size_t size, void *ud)
{
    (void)ud;
    if (should_fail()) return NULL;
    void *p = malloc(size);
    if (p) alloc_live++;
    return p;
}

static void *count_realloc(void *ptr, size_t size, void *ud)
{
    (void)ud;
    if (should_fail()) return NULL;
    void *p = realloc(ptr, size);
    if (p && !ptr) alloc_live++;
    return p;
}

static void count_free(void *ptr, void *ud)
{
    (void)ud;
    if (ptr) alloc_live--;
    free(ptr);
}

void rt_alloc_install(long fail_at)
{
    static const qm_alloc_hooks hooks = {
        .malloc_fn = count_malloc, .realloc_fn = count_realloc, .free_fn = count_free};
    alloc_count = alloc_live = 0;
    alloc_failed = 0;
    alloc_fail_at = fail_at;
    qm_alloc_set_hooks(&hooks);
}

void rt_alloc_uninstall(void)
{
    qm_alloc_set_hooks(NULL);
}
long rt_alloc_count(void)
{
    return alloc_count;
}
long rt_alloc_live(void)
{
    return alloc_live;
}
int rt_alloc_failed(void)
{
    return alloc_failed;
}

/* ---- Invariants ------------------------------------------------------------- */

static int fail(char *why, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *why, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (why && cap) vsnprintf(why, cap, fmt, ap);
    va_end(ap);
    return -1;
}

static const qm_region_catalog *find_cat(const qm_region_catalog *const *cats, size_t n,
                                         uint32_t id)
{
    for (size_t i = 0; i < n; i++)
        if (qm_catalog_bank_id(cats[i]) == id) return cats[i];
    return NULL;
}

int rt_plan_check(const qm_residency_plan *plan, const qm_region_catalog *const *cats, size_t n,
                  const qm_plan_options *opt, char *why, size_t cap)
{
    static const qm_plan_options none = {0};
    if (!opt) opt = &none;
    if (!plan) return fail(why, cap, "no plan");
    if (qm_plan_total(plan) != n)
        return fail(why, cap, "total %zu != %zu catalogs", qm_plan_total(plan), n);
    size_t resident = 0, degraded = 0, per_expert = 0;
    for (size_t i = 0; i < n; i++) {
        const qm_plan_bank *b = qm_plan_bank_at(plan, i);
        if (!b) return fail(why, cap, "bank_at(%zu) is NULL", i);
        if (i && qm_plan_bank_at(plan, i - 1)->bank_id >= b->bank_id)
            return fail(why, cap, "banks not strictly ascending at %zu", i);
        if (qm_plan_find_bank(plan, b->bank_id) != b)
            return fail(why, cap, "find_bank(%u) does not find entry %zu", b->bank_id, i);
        const qm_region_catalog *cat = find_cat(cats, n, b->bank_id);
        if (!cat) return fail(why, cap, "bank %u is in no catalog", b->bank_id);
        if (b->n_experts_in_bank != qm_catalog_expert_count(cat) ||
            b->bytes_per_expert != qm_catalog_bytes_per_expert(cat))
            return fail(why, cap, "bank %u: shape differs from its catalog", b->bank_id);
        const qm_residency_decision *d = &b->decision;
        qm_nonpageable_reason cr = qm_catalog_reason(cat);
        int below = cr == QM_NONPAGEABLE_NONE && b->bytes_per_expert < opt->min_split_bytes;
        if (d->kind == QM_DECISION_PER_EXPERT) {
            per_expert++;
            if (cr != QM_NONPAGEABLE_NONE || below)
                return fail(why, cap, "bank %u split although not pageable", b->bank_id);
            if (d->reason != QM_DEGRADATION_NONE)
                return fail(why, cap, "bank %u: per-expert with a reason", b->bank_id);
            if (!d->n_experts || !d->experts)
                return fail(why, cap, "bank %u: per-expert without experts", b->bank_id);
            for (size_t k = 0; k < d->n_experts; k++) {
                if (d->experts[k] >= b->n_experts_in_bank)
                    return fail(why, cap, "bank %u: expert %u out of range", b->bank_id,
                                d->experts[k]);
                if (k && d->experts[k] <= d->experts[k - 1])
                    return fail(why, cap, "bank %u: experts not ascending/unique", b->bank_id);
                if (!qm_catalog_expert_bytes(cat, d->experts[k]))
                    return fail(why, cap, "bank %u: expert %u has no bytes", b->bank_id,
                                d->experts[k]);
            }
            for (size_t k = 0; k < d->n_pinned; k++) {
                if (k && d->pinned[k] <= d->pinned[k - 1])
                    return fail(why, cap, "bank %u: pinned not ascending/unique", b->bank_id);
                int found = 0;
                for (size_t j = 0; j < d->n_experts; j++)
                    found |= d->experts[j] == d->pinned[k];
                if (!found)
                    return fail(why, cap, "bank %u: pinned %u not a candidate", b->bank_id,
                                d->pinned[k]);
            }
            if (opt->has_budget &&
                (unsigned long long)d->n_pinned * b->bytes_per_expert > opt->budget_bytes)
                return fail(why, cap, "bank %u: pins exceed the budget", b->bank_id);
        } else if (d->kind == QM_DECISION_WHOLE_BANK) {
            if (d->experts || d->n_experts || d->pinned || d->n_pinned)
                return fail(why, cap, "bank %u: whole-bank with experts", b->bank_id);
            if (d->reason == QM_DEGRADATION_NONE) {
                resident++;
                if (cr != QM_NONPAGEABLE_NONE || below)
                    return fail(why, cap, "bank %u: non-pageable bank without its reason",
                                b->bank_id);
            } else {
                degraded++;
                const char *kind = qm_degradation_kind_name(d->reason);
                if (!kind)
                    return fail(why, cap, "bank %u: unknown reason %d", b->bank_id, d->reason);
                if (cr != QM_NONPAGEABLE_NONE || below) {
                    const char *name = qm_nonpageable_reason_name(
                        below ? QM_NONPAGEABLE_BELOW_SPLIT_THRESHOLD : cr);
                    /* Whole-bank over a non-pageable catalog carries its reason;
                     * only an invalid per-expert decision may say otherwise. */
                    if (d->reason == QM_DEGRADATION_NON_PAGEABLE_CATALOG &&
                        strncmp(d->detail, name, strlen(name)) != 0)
                        return fail(why, cap, "bank %u: detail '%s' lacks reason %s", b->bank_id,
                                    d->detail, name);
                    if (d->reason == QM_DEGRADATION_POLICY_DECLINED_SPLIT)
                        return fail(why, cap, "bank %u: declined hides the catalog's reason",
                                    b->bank_id);
                } else if (d->reason == QM_DEGRADATION_NON_PAGEABLE_CATALOG) {
                    return fail(why, cap, "bank %u: pageable bank called non-pageable", b->bank_id);
                }
                if (d->reason == QM_DEGRADATION_REJECTED_BY_VALIDATION &&
                    strncmp(d->detail, "rule ", 5) != 0)
                    return fail(why, cap, "bank %u: rejection '%s' names no rule", b->bank_id,
                                d->detail);
                if (d->reason != QM_DEGRADATION_POLICY_DECLINED_SPLIT && !d->detail[0])
                    return fail(why, cap, "bank %u: %s without detail", b->bank_id, kind);
            }
        } else {
            return fail(why, cap, "bank %u: kind %d", b->bank_id, (int)d->kind);
        }
        if (!memchr(d->detail, '\0', sizeof d->detail))
            return fail(why, cap, "bank %u: detail not terminated", b->bank_id);
    }
    if (resident != qm_plan_resident_count(plan) || degraded != qm_plan_degraded_count(plan) ||
        per_expert != qm_plan_per_expert_count(plan))
        return fail(why, cap, "counts %zu/%zu/%zu, plan says %zu/%zu/%zu", resident, degraded,
                    per_expert, qm_plan_resident_count(plan), qm_plan_degraded_count(plan),
                    qm_plan_per_expert_count(plan));
    if (resident + degraded + per_expert != n)
        return fail(why, cap, "counts do not sum to the total");
    return 0;
}

/* ---- split_all --------------------------------------------------------------- */

typedef struct split_ctx {
    uint32_t *experts;
    size_t cap;
} split_ctx;

static int split_fill(split_ctx *s, const qm_policy_input *in, qm_residency_decision *out,
                      int even_if_non_pageable)
{
    if (!even_if_non_pageable && qm_catalog_reason(in->catalog) != QM_NONPAGEABLE_NONE) {
        out->kind = QM_DECISION_WHOLE_BANK;
        return 0;
    }
    uint32_t n = qm_catalog_expert_count(in->catalog);
    if (s->cap < (size_t)n + 2) {
        uint32_t *p = realloc(s->experts, ((size_t)n + 2) * sizeof *p);
        if (!p) return QM_ENOMEM;
        s->experts = p;
        s->cap = (size_t)n + 2;
    }
    for (uint32_t e = 0; e < n; e++)
        s->experts[e] = e;
    out->kind = QM_DECISION_PER_EXPERT;
    out->experts = s->experts;
    out->n_experts = n;
    return 0;
}

static int split_all_decide(void *ctx, const qm_policy_input *in, qm_residency_decision *out)
{
    return split_fill(ctx, in, out, 0);
}

static void split_destroy(void *ctx)
{
    split_ctx *s = ctx;
    if (s) free(s->experts);
    free(s);
}

static const qm_policy_iface split_all_iface = {
    .version = QM_POLICY_IFACE_VERSION,
    .name = "test_split_all",
    .decide = split_all_decide,
    .destroy = split_destroy,
};

void rt_policy_split_all(qm_policy *out)
{
    out->iface = &split_all_iface;
    out->ctx = calloc(1, sizeof(split_ctx));
}

/* ---- Each kind of invalid ------------------------------------------------------ */

typedef struct invalid_ctx {
    split_ctx split; /* first: split_destroy frees it */
    rt_invalid_kind kind;
    uint32_t bad_bank;
    uint32_t pinned[4];
} invalid_ctx;

const char *rt_invalid_rule(rt_invalid_kind kind)
{
    static const char *const rules[RT_INVALID_COUNT] = {
        [RT_INVALID_OUT_OF_RANGE] = "rule expert_out_of_range",
        [RT_INVALID_DUPLICATE] = "rule duplicate_expert",
        [RT_INVALID_PER_EXPERT_ON_NON_PAGEABLE] = "rule per_expert_over_non_pageable_catalog",
        [RT_INVALID_NO_REAL_REGION] = "rule expert_without_region",
        [RT_INVALID_PINNED_NOT_CANDIDATE] = "rule pinned_not_candidate",
        [RT_INVALID_PINNED_OVER_BUDGET] = "rule pinned_over_budget",
        [RT_INVALID_DECIDE_ERROR] = "rule decide_failed",
        [RT_INVALID_EMPTY] = "rule empty_experts",
        [RT_INVALID_NULL_EXPERTS] = "rule null_experts",
        [RT_INVALID_UNKNOWN_KIND] = "rule unknown_decision_kind",
        [RT_INVALID_RESERVED_REASON] = "rule reserved_reason",
        [RT_INVALID_DUPLICATE_PINNED] = "rule duplicate_pinned",
    };
    return (unsigned)kind < RT_INVALID_COUNT ? rules[kind] : "?";
}

static int invalid_decide(void *ctx, const qm_policy_input *in, qm_residency_decision *out)
{
    invalid_ctx *iv = ctx;
    if (in->bank_id != iv->bad_bank) return split_fill(&iv->split, in, out, 0);
    int rc = split_fill(&iv->split, in, out, 1);
    if (rc) return rc;
    uint32_t n = qm_catalog_expert_count(in->catalog);
    switch (iv->kind) {
    case RT_INVALID_OUT_OF_RANGE:
        iv->split.experts[n > 1 ? 1 : 0] = n; /* one past the last */
        break;
    case RT_INVALID_DUPLICATE:
        iv->split.experts[n - 1] = 0;
        break;
    case RT_INVALID_PER_EXPERT_ON_NON_PAGEABLE: /* split_fill(…, 1) ignored the reason */
    case RT_INVALID_NO_REAL_REGION:             /* lists the catalog's empty expert */
        break;
    case RT_INVALID_PINNED_NOT_CANDIDATE:
        out->n_experts = n - 1; /* expert n-1 is not a candidate ... */
        iv->pinned[0] = n - 1;  /* ... but is pinned */
        out->pinned = iv->pinned;
        out->n_pinned = 1;
        break;
    case RT_INVALID_PINNED_OVER_BUDGET:
        out->pinned = iv->split.experts; /* pins everything */
        out->n_pinned = n;
        break;
    case RT_INVALID_DECIDE_ERROR:
        memset(out, 0, sizeof *out);
        return QM_EINTERNAL;
    case RT_INVALID_EMPTY:
        out->n_experts = 0;
        break;
    case RT_INVALID_NULL_EXPERTS:
        out->experts = NULL;
        break;
    case RT_INVALID_UNKNOWN_KIND:
        out->kind = (qm_decision_kind)7;
        break;
    case RT_INVALID_RESERVED_REASON:
        out->kind = QM_DECISION_WHOLE_BANK;
        out->experts = NULL;
        out->n_experts = 0;
        out->reason = QM_DEGRADATION_REJECTED_BY_VALIDATION;
        break;
    case RT_INVALID_DUPLICATE_PINNED:
        iv->pinned[0] = 0;
        iv->pinned[1] = 0;
        out->pinned = iv->pinned;
        out->n_pinned = 2;
        break;
    case RT_INVALID_COUNT:
        break;
    }
    return 0;
}

static const qm_policy_iface invalid_iface = {
    .version = QM_POLICY_IFACE_VERSION,
    .name = "test_invalid",
    .decide = invalid_decide,
    .destroy = split_destroy,
};

int rt_policy_invalid(rt_invalid_kind kind, uint32_t bad_bank, qm_policy *out)
{
    invalid_ctx *iv = calloc(1, sizeof *iv);
    if (!iv) return QM_ENOMEM;
    iv->kind = kind;
    iv->bad_bank = bad_bank;
    out->iface = &invalid_iface;
    out->ctx = iv;
    return 0;
}

/* ---- Hostile ------------------------------------------------------------------- */

typedef struct hostile_ctx {
    uint64_t rng;
    uint32_t *buf; /* experts and pinned, from the same buffer on purpose */
    size_t cap;
} hostile_ctx;

static uint32_t hostile_index(hostile_ctx *h, uint32_t n)
{
    uint64_t r = rt_rand(&h->rng);
    switch (r % 8) {
    case 0:
        return UINT32_MAX;
    case 1:
        return n;
    case 2:
        return (uint32_t)(r >> 32);
    default:
        return n ? (uint32_t)((r >> 16) % n) : 0;
    }
}

static int hostile_decide(void *ctx, const qm_policy_input *in, qm_residency_decision *out)
{
    hostile_ctx *h = ctx;
    uint32_t n = qm_catalog_expert_count(in->catalog);
    size_t need = (size_t)n * 2 + 8;
    if (h->cap < need) {
        uint32_t *p = realloc(h->buf, need * sizeof *p);
        if (!p) return QM_ENOMEM;
        h->buf = p;
        h->cap = need;
    }
    uint64_t r = rt_rand(&h->rng);
    switch (r % 12) {
    case 0: {
        /* Any negative code, known or not, except out of memory: that one
         * fails the plan (RELIABILITY.md B11; test_validation.c pins it). */
        int code = -(int)(1 + (r >> 8) % 40);
        return code == QM_ENOMEM ? QM_EINTERNAL : code;
    }
    case 1:
        out->kind = (qm_decision_kind)(int)(r >> 8);
        return 0;
    case 2:
        out->kind = QM_DECISION_WHOLE_BANK;
        out->reason = (qm_degradation_kind)((r >> 8) % 6);
        snprintf(out->detail, sizeof out->detail, "hostile detail %llu", (unsigned long long)r);
        return 0;
    case 3: /* a length that lies: more than the bank has */
        out->kind = QM_DECISION_PER_EXPERT;
        out->experts = h->buf;
        out->n_experts = (r >> 8) & 1 ? SIZE_MAX : (size_t)n + 1 + (r >> 9) % 5;
        return 0;
    case 4:
        out->kind = QM_DECISION_PER_EXPERT;
        out->experts = NULL;
        out->n_experts = (r >> 8) % 4;
        return 0;
    case 5:
        return 1; /* positive: not an error, whatever was written stands */
    default:
        break;
    }
    /* Per-expert: sometimes perfectly valid, sometimes subtly not. */
    int valid = (r >> 8) % 3 == 0;
    size_t len = valid ? n : (size_t)((r >> 12) % ((size_t)n + 3));
    for (size_t i = 0; i < len; i++)
        h->buf[i] = valid ? (uint32_t)i : hostile_index(h, n);
    size_t n_pinned = (size_t)((r >> 20) % (len + 2));
    if (n_pinned > len) n_pinned = len;
    uint32_t *pinned = h->buf + len;
    for (size_t i = 0; i < n_pinned; i++)
        pinned[i] = (r >> 30) & 1 ? h->buf[i] : hostile_index(h, n);
    out->kind = QM_DECISION_PER_EXPERT;
    out->experts = h->buf;
    out->n_experts = len;
    out->pinned = (r >> 31) & 1 ? pinned : NULL;
    out->n_pinned = n_pinned;
    if ((r >> 32) % 7 == 0)
        out->reason = (qm_degradation_kind)((r >> 40) % 5); /* nonsense on a split */
    return 0;
}

static void hostile_on_access(void *ctx, qm_expert_ref ref, uint64_t tick, int hit)
{
    (void)ref, (void)tick, (void)hit;
    rt_rand(&((hostile_ctx *)ctx)->rng);
}

static int hostile_choose_victim(void *ctx, const qm_expert_ref *c, size_t n, size_t *victim)
{
    (void)c;
    hostile_ctx *h = ctx;
    uint64_t r = rt_rand(&h->rng);
    switch (r % 5) {
    case 0:
        return -1;
    case 1:
        *victim = SIZE_MAX;
        return 0;
    case 2:
        *victim = n + (r >> 8) % 3;
        return 0;
    case 3:
        return 0; /* leaves *victim as it was */
    default:
        *victim = (size_t)((r >> 8) % n);
        return (r >> 40) & 1;
    }
}

static void hostile_destroy(void *ctx)
{
    hostile_ctx *h = ctx;
    if (h) free(h->buf);
    free(h);
}

static const qm_policy_iface hostile_iface = {
    .version = QM_POLICY_IFACE_VERSION,
    .name = "test_hostile",
    .decide = hostile_decide,
    .on_access = hostile_on_access,
    .choose_victim = hostile_choose_victim,
    .destroy = hostile_destroy,
};

int rt_policy_hostile(uint64_t seed, qm_policy *out)
{
    hostile_ctx *h = calloc(1, sizeof *h);
    if (!h) return QM_ENOMEM;
    h->rng = seed | 1;
    out->iface = &hostile_iface;
    out->ctx = h;
    return 0;
}
