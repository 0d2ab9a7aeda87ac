/* qm_placement.h - a session over its devices (one device is the common
 * case of several): which device serves each bank (layer), each device's
 * share of the session's budget, and one pager per device behind a single
 * forward call.
 *
 * The rule ("layers_contiguous"): the layers are cut into contiguous runs,
 * one per device in device order, so that each device's share of the
 * model's expert bytes follows its weight (its free budget; equal weights
 * when none are given): layer l goes to the device whose cumulative weight
 * range holds the middle of layer l's cumulative byte range. The session's
 * budget is split in proportion to the bytes placed (floor, the remainder
 * to the last device that has layers). Deterministic: the same bank, device
 * count, weights and budget give the same placement. Host memory is the
 * last tier on every device: what a device does not hold is paged from the
 * bank mapping or, with on_miss host/auto, run on the host from it.
 * docs/PAGING.md "Several devices". */
#ifndef QM_PLACEMENT_H
#define QM_PLACEMENT_H

#include <stdint.h>

#include "qm_pager.h"

#define QM_PLACEMENT_RULE "layers_contiguous"
#define QM_PLACEMENT_MAX_DEVICES 16

typedef struct qm_placement {
    uint32_t n_devices, n_layers;
    /* One block, owned through `budget` (qm_placement_free releases it). */
    uint64_t *budget;    /* [n_devices] the session's budget on each device (0: no layers) */
    uint64_t *bytes;     /* [n_devices] expert bytes of the layers placed there */
    uint32_t *device_of; /* [n_layers] */
} qm_placement;

/* Places `bank`'s layers on n_devices (1..QM_PLACEMENT_MAX_DEVICES).
 * `weights` [n_devices] or NULL (equal); a zero weight gets no layers
 * unless every weight is zero. `budget` is the session's (0 = none: each
 * device's share is its bytes). */
int qm_placement_make(const qm_bank *bank, uint32_t n_devices, const uint64_t *weights,
                      uint64_t budget, qm_placement *out, qm_status *st);
void qm_placement_free(qm_placement *pl); /* members; accepts a zeroed one */
/* The split of qm_placement_make: `budget` over the devices in proportion to
 * pl->bytes (floor, the remainder to the last device with layers; 0 = each
 * device's bytes) into out[n_devices] (0 for a device without layers). */
void qm_placement_split(const qm_placement *pl, uint64_t budget, uint64_t *out);

typedef struct qm_multipager qm_multipager;

/* One pager per device that has layers, each with the plan, the layer mask
 * of its device and its share of the budget (options as given otherwise;
 * layer_mask and budget_bytes are the placement's). `devices`, `bank`,
 * `plan`, `policy` and `pl` are borrowed. The shared policy sees each
 * layer's accesses from the one pager that serves it. */
int qm_multipager_new(qm_backend *const *devices, const qm_bank *bank,
                      const qm_residency_plan *plan, const qm_policy *policy,
                      const qm_pager_options *options, const qm_placement *pl,
                      qm_multipager **out, qm_status *st);
void qm_multipager_free(qm_multipager *mp); /* accepts NULL */

/* qm_pager_forward on the pager of call->layer's device. */
int qm_multipager_forward(qm_multipager *mp, const qm_moe_call *call, qm_moe_stats *mstats,
                          qm_status *st);
/* qm_pager_after_forward (tidy 0) or qm_pager_tidy (1) on every device's
 * pager. */
void qm_multipager_after_forward(qm_multipager *mp, int tidy);
/* session.resize over the devices: `budget` split by qm_placement_split
 * (the placement stays) and each device's pager resized to its share
 * (qm_pager_resize: shrinking evicts by the policy on that device; outputs
 * never change). On an error over several devices the message names the
 * device and its share (with one, it is the pager's own), and devices
 * already resized go back to their budgets. */
int qm_multipager_resize(qm_multipager *mp, uint64_t budget, qm_status *st);
/* policy_params.record_trace over several devices: one trace for the
 * session (qm_pager_record_trace on the first device with layers; every
 * other device's routing goes to that recording), rows in token order
 * across the devices: the same file a one-device session of the same calls
 * writes. Its trace_* counters are the first device's (qm_multipager_stats).
 * `resume`, `max_bytes` and the result as qm_pager_record_trace's (1: a trace gone on with). */
int qm_multipager_record_trace(qm_multipager *mp, const char *path, int resume,
                               uint64_t max_bytes, qm_status *st);
/* The pager of device d (NULL when it has no layers or d is out of range). */
qm_pager *qm_multipager_pager(const qm_multipager *mp, uint32_t d);
/* Counters summed over the devices (the model_* estimates: the first
 * device's with hybrid auto). */
void qm_multipager_stats(const qm_multipager *mp, qm_pager_stats *out);

#endif
