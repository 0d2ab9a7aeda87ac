/* qm_plan_json.c - serialises a residency plan (PROTOCOL.md "The plan"). */
#include "qm_plan_json.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include <cJSON.h>

#include "qm_alloc.h"

/* Every number in a plan is a non-negative integer; byte counts are uint64,
 * which a double would round above 2^53. So all are written as exact decimal
 * text (also cheaper than cJSON's print-and-reparse of doubles). */
static cJSON *u64_item(uint64_t v)
{
    char text[24];
    snprintf(text, sizeof text, "%" PRIu64, v);
    return cJSON_CreateRaw(text);
}

static int add(cJSON *obj, const char *key, cJSON *item)
{
    if (!item) return -1;
    if (!cJSON_AddItemToObject(obj, key, item)) {
        cJSON_Delete(item);
        return -1;
    }
    return 0;
}

static cJSON *u32_array(const uint32_t *v, size_t n)
{
    cJSON *arr = cJSON_CreateArray();
    for (size_t i = 0; arr && i < n; i++) {
        cJSON *num = u64_item(v[i]);
        if (!num || !cJSON_AddItemToArray(arr, num)) {
            cJSON_Delete(num);
            cJSON_Delete(arr);
            return NULL;
        }
    }
    return arr;
}

static cJSON *reason_item(const qm_residency_decision *d)
{
    if (d->kind != QM_DECISION_WHOLE_BANK || d->reason == QM_DEGRADATION_NONE)
        return cJSON_CreateNull();
    cJSON *r = cJSON_CreateObject();
    if (!r) return NULL;
    const char *kind = qm_degradation_kind_name(d->reason);
    if (add(r, "kind", cJSON_CreateString(kind ? kind : "unknown"))) goto fail;
    /* policy_declined_split carries no detail; the other two always do. */
    if (d->reason != QM_DEGRADATION_POLICY_DECLINED_SPLIT &&
        add(r, "detail", cJSON_CreateString(d->detail)))
        goto fail;
    return r;
fail:
    cJSON_Delete(r);
    return NULL;
}

/* "placement": {"rule", "devices": [{"name", "budget_bytes"}]}: nonzero on failure. */
static int placement_item(cJSON *root, const qm_plan_json_state *state)
{
    cJSON *pl = cJSON_CreateObject();
    if (add(root, "placement", pl) || add(pl, "rule", cJSON_CreateString(state->placement_rule)))
        return -1;
    cJSON *devs = cJSON_CreateArray();
    if (add(pl, "devices", devs))
        return -1;
    for (size_t i = 0; i < state->n_devices; i++) {
        cJSON *d = cJSON_CreateObject();
        if (!d || !cJSON_AddItemToArray(devs, d)) {
            cJSON_Delete(d);
            return -1;
        }
        const char *name = state->device_names ? state->device_names[i] : NULL;
        if (add(d, "name", cJSON_CreateString(name ? name : "")) ||
            add(d, "budget_bytes", u64_item(state->device_budgets ? state->device_budgets[i] : 0)))
            return -1;
    }
    return 0;
}

static const qm_plan_json_bank_state *find_state(const qm_plan_json_state *state, uint32_t id)
{
    for (size_t i = 0; state && state->banks && i < state->n_banks; i++)
        if (state->banks[i].bank_id == id) return &state->banks[i];
    return NULL;
}

static cJSON *bank_item(const qm_plan_bank *b, const qm_plan_json_bank_state *bs)
{
    const qm_residency_decision *d = &b->decision;
    int per_expert = d->kind == QM_DECISION_PER_EXPERT;
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    if (add(o, "bank", u64_item(b->bank_id)) ||
        add(o, "layer", u64_item(bs && bs->has_layer ? bs->layer : b->bank_id)) ||
        add(o, "decision",
            cJSON_CreateString(per_expert ? "per_expert_candidate" : "whole_bank_resident")) ||
        add(o, "reason", reason_item(d)))
        goto fail;
    if (per_expert) {
        if (add(o, "experts", u32_array(d->experts, d->n_experts)) ||
            add(o, "pinned", u32_array(d->pinned, d->n_pinned)) ||
            add(o, "bytes_per_expert", u64_item(b->bytes_per_expert)))
            goto fail;
    } else if (add(o, "experts", cJSON_CreateNull())) {
        goto fail;
    }
    if (bs && bs->has_device && add(o, "device", u64_item(bs->device)))
        goto fail;
    if (bs && bs->has_resident_now &&
        add(o, "resident_now",
            u32_array(bs->resident_now, bs->resident_now ? bs->n_resident_now : 0)))
        goto fail;
    if (bs && bs->n_pins_released &&
        add(o, "pins_released", u32_array(bs->pins_released, bs->n_pins_released)))
        goto fail;
    return o;
fail:
    cJSON_Delete(o);
    return NULL;
}

int qm_plan_to_json_ex(const qm_residency_plan *plan, const qm_plan_json_state *state, char **out,
                       size_t *len, qm_status *st)
{
    if (!out) return qm_status_set(st, QM_EINVAL, "no string to fill");
    *out = NULL;
    if (len) *len = 0;
    if (!plan) return qm_status_set(st, QM_EINVAL, "no plan to serialise");

    char *text = NULL;
    cJSON *root = cJSON_CreateObject();
    if (!root) goto fail_build;
    if (add(root, "policy", cJSON_CreateString(qm_plan_policy_name(plan))) ||
        add(root, "budget_bytes",
            qm_plan_has_budget(plan) ? u64_item(qm_plan_budget(plan)) : cJSON_CreateNull()) ||
        add(root, "total", u64_item(qm_plan_total(plan))) ||
        add(root, "resident", u64_item(qm_plan_resident_count(plan))) ||
        add(root, "degraded", u64_item(qm_plan_degraded_count(plan))))
        goto fail_build;
    if (state && state->has_resident_bytes &&
        add(root, "resident_bytes", u64_item(state->resident_bytes)))
        goto fail_build;
    if (state && state->on_miss) {
        cJSON *ex = cJSON_CreateObject();
        if (add(root, "execution", ex) ||
            add(ex, "on_miss", cJSON_CreateString(state->on_miss)) ||
            add(ex, "expert_hits", u64_item(state->expert_hits)) ||
            add(ex, "expert_misses", u64_item(state->expert_misses)) ||
            add(ex, "expert_host_runs", u64_item(state->expert_host_runs)))
            goto fail_build;
    }
    if (state && state->placement_rule && placement_item(root, state))
        goto fail_build;
    if (state && state->budget_auto_json &&
        add(root, "budget_auto", cJSON_CreateRaw(state->budget_auto_json)))
        goto fail_build;
    cJSON *banks = cJSON_CreateArray();
    if (add(root, "banks", banks)) goto fail_build;
    for (size_t i = 0; i < qm_plan_total(plan); i++) {
        const qm_plan_bank *b = qm_plan_bank_at(plan, i);
        cJSON *item = bank_item(b, find_state(state, b->bank_id));
        if (!item || !cJSON_AddItemToArray(banks, item)) {
            cJSON_Delete(item);
            goto fail_build;
        }
    }
    text = cJSON_PrintUnformatted(root);
    if (!text) goto fail_build;
    /* Hand back memory from our allocator, so the caller frees it like
     * everything else (cJSON's allocator may be another). */
    size_t n = strlen(text);
    char *copy = qm_malloc(n + 1);
    if (!copy) goto fail_copy;
    memcpy(copy, text, n + 1);
    cJSON_free(text);
    cJSON_Delete(root);
    *out = copy;
    if (len) *len = n;
    return 0;

fail_copy:
    cJSON_free(text);
fail_build:
    cJSON_Delete(root);
    return qm_status_set(st, QM_ENOMEM, "out of memory serialising a plan of %zu banks",
                         qm_plan_total(plan));
}

int qm_plan_to_json(const qm_residency_plan *plan, char **out, size_t *len, qm_status *st)
{
    return qm_plan_to_json_ex(plan, NULL, out, len, st);
}
