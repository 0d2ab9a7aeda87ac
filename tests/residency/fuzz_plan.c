/* fuzz_plan.c - libFuzzer: random catalogs and random decisions, read from
 * the input bytes, through qm_plan_residency; every plan must keep the
 * invariants, serialise to the same bytes twice, and shipped policies must
 * never be rejected. Any violation aborts (the fuzzer's signal). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_plan_json.h"
#include "qm_residency.h"
#include "qm_test_policies.h"
#include "rt_util.h"

#define MAX_BANKS 8
#define MAX_EXPERTS 16
#define BUF 64

typedef struct reader {
    const uint8_t *data;
    size_t size, pos;
} reader;

static uint8_t byte(reader *r)
{
    return r->pos < r->size ? r->data[r->pos++] : 0;
}

/* A policy whose every answer comes from the input. */
typedef struct scripted {
    reader *in;
    int said_nomem; /* decide returned QM_ENOMEM at least once */
    uint32_t experts[BUF];
    uint32_t pinned[BUF];
} scripted;

static uint32_t index_from(uint8_t b, uint32_t n)
{
    if (b == 0xff) return UINT32_MAX;
    if (b == 0xfe) return n;
    return b % (n + 2);
}

static int scripted_decide(void *ctx, const qm_policy_input *in, qm_residency_decision *out)
{
    scripted *s = ctx;
    uint32_t n = qm_catalog_expert_count(in->catalog);
    uint8_t op = byte(s->in);
    if (op % 16 == 15) {
        int rc = -(int)(byte(s->in) % 20) - 1;
        if (rc == QM_ENOMEM) s->said_nomem = 1;
        return rc;
    }
    if (op % 16 == 14) {
        out->kind = (qm_decision_kind)byte(s->in);
        return 0;
    }
    if (op % 4 == 0) {
        out->kind = QM_DECISION_WHOLE_BANK;
        out->reason = (qm_degradation_kind)(byte(s->in) % 6);
        return 0;
    }
    out->kind = QM_DECISION_PER_EXPERT;
    if (op & 0x10) { /* every expert, in order: likely valid */
        for (uint32_t e = 0; e < n && e < BUF; e++)
            s->experts[e] = e;
        out->n_experts = n < BUF ? n : BUF;
    } else {
        size_t len = byte(s->in) % (BUF + 1);
        for (size_t i = 0; i < len; i++)
            s->experts[i] = index_from(byte(s->in), n);
        out->n_experts = len;
    }
    if (op & 0x20) out->n_experts = SIZE_MAX; /* a lie the planner must refuse unread */
    out->experts = op & 0x40 ? NULL : s->experts;
    size_t n_pinned = byte(s->in) % 8;
    for (size_t i = 0; i < n_pinned; i++)
        s->pinned[i] = index_from(byte(s->in), n);
    out->pinned = op & 0x80 ? NULL : s->pinned;
    out->n_pinned = n_pinned;
    return 0;
}

static const qm_policy_iface scripted_iface = {
    .version = QM_POLICY_IFACE_VERSION, .name = "fuzz_scripted", .decide = scripted_decide};

static void check(const qm_residency_plan *plan, const qm_region_catalog *const *cats, size_t n,
                  const qm_plan_options *opt, int shipped)
{
    /* JSON only for the scripted plan: cJSON's number printing dominates. */
    char why[256];
    if (rt_plan_check(plan, cats, n, opt, why, sizeof why) != 0) {
        fprintf(stderr, "invariant broken: %s\n", why);
        abort();
    }
    for (size_t i = 0; shipped && i < n; i++) {
        if (qm_plan_bank_at(plan, i)->decision.reason == QM_DEGRADATION_REJECTED_BY_VALIDATION) {
            fprintf(stderr, "shipped policy rejected: %s\n",
                    qm_plan_bank_at(plan, i)->decision.detail);
            abort();
        }
    }
    char *a = NULL, *b = NULL;
    if (shipped) return;
    if (qm_plan_to_json(plan, &a, NULL, NULL) || qm_plan_to_json(plan, &b, NULL, NULL) ||
        strcmp(a, b) != 0) {
        fprintf(stderr, "JSON not reproducible\n");
        abort();
    }
    qm_free(a);
    qm_free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    reader r = {data, size, 0};
    qm_region_catalog *cats[MAX_BANKS] = {0};
    size_t n = byte(&r) % (MAX_BANKS + 1);
    uint8_t flags = byte(&r);
    qm_plan_options opt = {.has_budget = flags & 1,
                           .budget_bytes = (uint64_t)byte(&r) << (byte(&r) % 40),
                           .min_split_bytes = flags & 2 ? (uint64_t)byte(&r) * 8 : 0};
    uint32_t hot_store[MAX_BANKS][4];
    const uint32_t *hot[MAX_BANKS] = {0};
    size_t hot_len[MAX_BANKS] = {0};
    size_t made = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t id = (uint32_t)(i * 37 + byte(&r) % 37); /* unique and ascending-ish */
        if (flags & 4) id = UINT32_MAX - id;
        uint32_t experts = byte(&r) % (MAX_EXPERTS + 1);
        if (qm_catalog_new(id, experts, &cats[i]) != 0) goto done;
        made++;
        for (uint32_t e = 0; e < experts; e++) {
            uint8_t regions = byte(&r) % 4;
            for (uint8_t k = 0; k < regions; k++)
                if (qm_catalog_add_region(cats[i], e, (qm_region){k, 0, byte(&r)}) != 0) goto done;
        }
        uint8_t np = byte(&r);
        if (np < 48)
            qm_catalog_set_nonpageable(cats[i], (qm_nonpageable_reason)(np % 12),
                                       np & 1 ? "fuzz" : NULL);
        hot_len[i] = byte(&r) % 5;
        for (size_t k = 0; k < hot_len[i]; k++)
            hot_store[i][k] = byte(&r) % 20;
        hot[i] = hot_store[i];
    }
    const qm_region_catalog *const *cc = (const qm_region_catalog *const *)cats;

    scripted s = {.in = &r};
    qm_policy pol = {.iface = &scripted_iface, .ctx = &s};
    qm_residency_plan *plan = NULL;
    int rc = qm_plan_residency(cc, n, &pol, &opt, &plan, NULL);
    if (rc == QM_ENOMEM && s.said_nomem) {
        /* B11: a policy out of memory fails the whole plan, leaving nothing. */
        if (plan) abort();
    } else if (rc != 0) {
        abort(); /* valid input, no allocation failure: must succeed */
    } else {
        check(plan, cc, n, &opt, 0);
        qm_plan_free(plan);
    }

    const char *names[QM_TEST_MAX_POLICIES];
    const size_t n_names = qm_test_policies(names, 0, NULL);
    qm_policy_value pin = {"pin_fraction", (flags >> 4) / 15.0};
    for (size_t k = 0; k < n_names; k++) {
        qm_policy shipped;
        int hot_ok = qm_policy_accepts_hot(names[k]);
        qm_policy_params params = {.version = QM_POLICY_PARAMS_VERSION,
                                   .values = &pin,
                                   .n_values = (size_t)hot_ok,
                                   .hot = hot_ok ? hot : NULL,
                                   .hot_len = hot_len,
                                   .n_hot_banks = n};
        if (qm_policy_new(names[k], &params, &shipped, NULL) != 0) abort();
        plan = NULL;
        if (qm_plan_residency(cc, n, &shipped, &opt, &plan, NULL) != 0) abort();
        check(plan, cc, n, &opt, 1);
        qm_plan_free(plan);
        qm_policy_destroy(&shipped);
    }
done:
    for (size_t i = 0; i < made; i++)
        qm_catalog_free(cats[i]);
    return 0;
}
