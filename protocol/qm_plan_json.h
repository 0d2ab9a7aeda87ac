/* qm_plan_json.h - a residency plan as the JSON of PROTOCOL.md "The plan".
 *
 * One compact line, keys in the documented order, banks in ascending bank
 * id: the same plan (and state) always gives the same bytes. No cJSON type
 * appears here, so callers outside protocol/ never see cJSON. */
#ifndef QM_PLAN_JSON_H
#define QM_PLAN_JSON_H

#include <stddef.h>
#include <stdint.h>

#include "qm_error.h"
#include "qm_residency.h"

/* Run-time facts about one bank that session.plan adds to the plan. */
typedef struct qm_plan_json_bank_state {
    uint32_t bank_id; /* which plan bank this describes; unknown ids are ignored */
    int has_layer;    /* 0: "layer" = bank id */
    uint32_t layer;
    int has_device; /* 1: adds "device": index into the state's devices (before resident_now) */
    uint32_t device;
    int has_resident_now;         /* 1: adds "resident_now": [experts resident at this moment] */
    const uint32_t *resident_now; /* written in the order given */
    size_t n_resident_now;
    /* session.resize: pinned experts whose pin a smaller budget released
     * (they page like any other now); "pins_released" is written when
     * n_pins_released > 0. */
    const uint32_t *pins_released;
    size_t n_pins_released;
} qm_plan_json_bank_state;

typedef struct qm_plan_json_state {
    const qm_plan_json_bank_state *banks; /* any order; at most one per bank id */
    size_t n_banks;
    int has_resident_bytes; /* 1: adds "resident_bytes" after "degraded" */
    uint64_t resident_bytes;
    /* Non-NULL: adds "execution": {"on_miss", "expert_hits", "expert_misses",
     * "expert_host_runs"} after "resident_bytes" (hybrid execution). */
    const char *on_miss;
    uint64_t expert_hits, expert_misses, expert_host_runs;
    /* Several devices (engine/pager/qm_placement.h): non-NULL adds "placement":
     * {"rule", "devices": [{"name", "budget_bytes"}, ...]} after
     * "execution"; banks then carry "device" (their index in it). */
    const char *placement_rule;
    const char *const *device_names; /* [n_devices] */
    const uint64_t *device_budgets;  /* [n_devices] the session's budget on each */
    size_t n_devices;
    /* Budget "auto" (daemon/qm_budget.h): non-NULL adds "budget_auto", this
     * object's JSON text as given, after "placement". */
    const char *budget_auto_json;
} qm_plan_json_state;

/* Writes the plan as JSON. *out is a NUL-terminated string the caller owns
 * and frees with qm_free; *len (may be NULL) its length without the NUL.
 * A plan without a budget writes "budget_bytes":null. */
int qm_plan_to_json(const qm_residency_plan *plan, char **out, size_t *len, qm_status *st);
/* Same, with run-time state (`state` may be NULL: identical to the above). */
int qm_plan_to_json_ex(const qm_residency_plan *plan, const qm_plan_json_state *state, char **out,
                       size_t *len, qm_status *st);

#endif
