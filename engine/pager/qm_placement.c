/* qm_placement.c - see qm_placement.h. */
#include "qm_placement.h"

#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_pager_trace.h"

void qm_placement_free(qm_placement *pl)
{
    if (!pl)
        return;
    qm_free(pl->budget);
    memset(pl, 0, sizeof *pl);
}

int qm_placement_make(const qm_bank *bank, uint32_t n_devices, const uint64_t *weights,
                      uint64_t budget, qm_placement *out, qm_status *st)
{
    memset(out, 0, sizeof *out);
    if (!bank)
        return qm_status_set(st, QM_EINVAL, "placement: no bank");
    if (n_devices == 0 || n_devices > QM_PLACEMENT_MAX_DEVICES)
        return qm_status_set_field(st, QM_EINVAL, "device",
                                   "%u devices; expected 1..%d", n_devices,
                                   QM_PLACEMENT_MAX_DEVICES);
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    const uint32_t L = cfg->layers;
    out->n_devices = n_devices;
    out->n_layers = L;
    /* The three arrays share one lifetime: one block, the u64 ones first. */
    out->budget = qm_calloc(2 * (size_t)n_devices + (size_t)L / 2 + 1, sizeof *out->budget);
    if (!out->budget)
        return qm_status_set(st, QM_ENOMEM, "out of memory for the placement");
    out->bytes = out->budget + n_devices;
    out->device_of = (uint32_t *)(out->bytes + n_devices);
    /* Cumulative weights as fractions (doubles: exact enough for a cut). */
    double w[QM_PLACEMENT_MAX_DEVICES], wsum = 0;
    for (uint32_t d = 0; d < n_devices; d++)
        wsum += (w[d] = weights ? (double)weights[d] : 1.0);
    if (wsum <= 0)
        for (uint32_t d = 0; d < n_devices; d++)
            wsum += (w[d] = 1.0);
    uint64_t total = 0;
    for (uint32_t l = 0; l < L; l++)
        total += qm_bank_layer(bank, l)->bytes_per_expert * cfg->experts;
    uint64_t before = 0;
    for (uint32_t l = 0; l < L; l++) {
        uint64_t b = qm_bank_layer(bank, l)->bytes_per_expert * cfg->experts;
        double mid = total ? ((double)before + (double)b / 2) / (double)total
                           : ((double)l + 0.5) / (double)L;
        double edge = 0;
        uint32_t d = 0;
        for (; d + 1 < n_devices; d++) {
            edge += w[d] / wsum;
            if (mid < edge && w[d] > 0)
                break;
        }
        out->device_of[l] = d;
        out->bytes[d] += b;
        before += b;
    }
    qm_placement_split(out, budget, out->budget);
    return 0;
}

void qm_placement_split(const qm_placement *pl, uint64_t budget, uint64_t *out)
{
    uint64_t total = 0, given = 0;
    for (uint32_t d = 0; d < pl->n_devices; d++)
        total += pl->bytes[d];
    int32_t last = -1;
    for (uint32_t d = 0; d < pl->n_devices; d++) {
        out[d] = 0;
        if (!pl->bytes[d])
            continue;
        /* A device holding every byte (one device) takes the budget exactly. */
        out[d] = !budget || !total    ? pl->bytes[d]
                 : pl->bytes[d] == total ? budget
                                         : (uint64_t)((double)budget * (double)pl->bytes[d] /
                                                      (double)total);
        given += out[d];
        last = (int32_t)d;
    }
    if (budget && last >= 0 && given < budget)
        out[last] += budget - given;
}

struct qm_multipager {
    const qm_placement *pl;
    qm_pager *pagers[QM_PLACEMENT_MAX_DEVICES];
    uint8_t *masks; /* [n_devices][n_layers] */
    /* The CPU backend every device's pager runs host experts on (on_miss
     * host/auto with a device that is not host visible and no host backend
     * given): one for the session, not one per device, so a session over N
     * devices does not start N pools of one worker per core. */
    qm_backend *host_owned;
};

void qm_multipager_free(qm_multipager *mp)
{
    if (!mp)
        return;
    for (uint32_t d = 0; d < QM_PLACEMENT_MAX_DEVICES; d++)
        qm_pager_free(mp->pagers[d]);
    qm_backend_free(mp->host_owned); /* after the pagers that borrowed it */
    qm_free(mp->masks);
    qm_free(mp);
}

int qm_multipager_new(qm_backend *const *devices, const qm_bank *bank,
                      const qm_residency_plan *plan, const qm_policy *policy,
                      const qm_pager_options *options, const qm_placement *pl,
                      qm_multipager **out, qm_status *st)
{
    *out = NULL;
    if (!devices || !pl || !pl->n_devices || !bank)
        return qm_status_set(st, QM_EINVAL, "qm_multipager_new: NULL argument");
    qm_multipager *mp = qm_calloc(1, sizeof *mp);
    if (!mp)
        return qm_status_set(st, QM_ENOMEM, "out of memory for the session's devices");
    mp->pl = pl;
    size_t L = pl->n_layers ? pl->n_layers : 1;
    mp->masks = qm_calloc((size_t)pl->n_devices * L, 1);
    if (!mp->masks) {
        qm_multipager_free(mp);
        return qm_status_set(st, QM_ENOMEM, "out of memory for the session's devices");
    }
    for (uint32_t l = 0; l < pl->n_layers; l++)
        mp->masks[(size_t)pl->device_of[l] * L + l] = 1;
    qm_pager_options base = options ? *options : (qm_pager_options){0};
    int wants_host = 0;
    for (uint32_t d = 0; d < pl->n_devices; d++)
        wants_host |= pl->bytes[d] && !qm_backend_host_visible(devices[d]);
    if (base.on_miss != QM_ON_MISS_PAGE && !base.host_backend && wants_host) {
        int rc = qm_backend_cpu_new(base.host_threads, &mp->host_owned, st);
        if (rc) {
            qm_multipager_free(mp);
            return rc;
        }
        base.host_backend = mp->host_owned;
    }
    for (uint32_t d = 0; d < pl->n_devices; d++) {
        if (!pl->bytes[d])
            continue;
        qm_pager_options o = base;
        o.layer_mask = mp->masks + (size_t)d * L;
        o.budget_bytes = pl->budget[d];
        int rc = qm_pager_new(devices[d], bank, plan, policy, &o, &mp->pagers[d], st);
        if (rc) {
            qm_multipager_free(mp);
            return rc;
        }
    }
    *out = mp;
    return 0;
}

qm_pager *qm_multipager_pager(const qm_multipager *mp, uint32_t d)
{
    return mp && d < mp->pl->n_devices ? mp->pagers[d] : NULL;
}

int qm_multipager_forward(qm_multipager *mp, const qm_moe_call *call, qm_moe_stats *mstats,
                          qm_status *st)
{
    if (!mp || !call)
        return qm_status_set(st, QM_EINVAL, "qm_multipager_forward: NULL argument");
    if (call->layer >= mp->pl->n_layers)
        return qm_status_set_field(st, QM_EINVAL, "layer", "layer %u out of range (bank has %u)",
                                   call->layer, mp->pl->n_layers);
    return qm_pager_forward(mp->pagers[mp->pl->device_of[call->layer]], call, mstats, st);
}

void qm_multipager_after_forward(qm_multipager *mp, int tidy)
{
    for (uint32_t d = 0; mp && d < mp->pl->n_devices; d++) {
        if (tidy)
            qm_pager_tidy(mp->pagers[d]);
        else
            qm_pager_after_forward(mp->pagers[d]);
    }
}

void qm_multipager_stats(const qm_multipager *mp, qm_pager_stats *out)
{
    int first = 1;
    for (uint32_t d = 0; mp && d < mp->pl->n_devices; d++) {
        if (!mp->pagers[d])
            continue;
        if (first) {
            /* Fixed figures and the model from the first device, read in
             * place (every call of a one-device session comes here twice). */
            qm_pager_stats_get(mp->pagers[d], out);
            first = 0;
            continue;
        }
        qm_pager_stats s;
        qm_pager_stats_get(mp->pagers[d], &s);
        out->hits += s.hits;
        out->misses += s.misses;
        out->whole_bank_accesses += s.whole_bank_accesses;
        out->bytes_paged_h2d += s.bytes_paged_h2d;
        out->bytes_loaded_at_create += s.bytes_loaded_at_create;
        out->evictions += s.evictions;
        out->prefetch_issued += s.prefetch_issued;
        out->prefetch_useful += s.prefetch_useful;
        out->resident_bytes += s.resident_bytes;
        out->budget_bytes += s.budget_bytes;
        out->waves += s.waves;
        out->policy_fallbacks += s.policy_fallbacks;
        out->pins_released += s.pins_released;
        out->resize_moves += s.resize_moves;
        out->budget_violations += s.budget_violations;
        out->host_runs += s.host_runs;
        out->host_rows += s.host_rows;
        out->host_admits += s.host_admits;
        out->predict_router_predicted += s.predict_router_predicted;
        out->predict_router_correct += s.predict_router_correct;
        out->predict_router_actual += s.predict_router_actual;
        out->predict_history_predicted += s.predict_history_predicted;
        out->predict_history_correct += s.predict_history_correct;
        out->predict_history_actual += s.predict_history_actual;
        out->predict_lookahead_predicted += s.predict_lookahead_predicted;
        out->predict_lookahead_correct += s.predict_lookahead_correct;
        out->predict_lookahead_actual += s.predict_lookahead_actual;
        out->predict_router_gated += s.predict_router_gated;
        out->predict_history_gated += s.predict_history_gated;
        out->predict_lookahead_gated += s.predict_lookahead_gated;
        out->prefetch_router_issued += s.prefetch_router_issued;
        out->prefetch_router_useful += s.prefetch_router_useful;
        out->prefetch_history_issued += s.prefetch_history_issued;
        out->prefetch_history_useful += s.prefetch_history_useful;
        out->prefetch_lookahead_issued += s.prefetch_lookahead_issued;
        out->prefetch_lookahead_useful += s.prefetch_lookahead_useful;
        out->prefetch_gated += s.prefetch_gated;
        out->prefetch_parked += s.prefetch_parked;
        out->prefetch_trial_held += s.prefetch_trial_held;
        out->prefetch_trial_decisions += s.prefetch_trial_decisions;
        out->prefetch_trial_decisions_held += s.prefetch_trial_decisions_held;
        out->arena_bytes += s.arena_bytes;
        out->n_slots += s.n_slots;
        out->n_pinned += s.n_pinned;
        out->overhead_bytes += s.overhead_bytes;
        out->host_bytes += s.host_bytes;
        out->bytes_prefaulted_at_create += s.bytes_prefaulted_at_create;
        out->bytes_interleaved_at_create += s.bytes_interleaved_at_create;
        /* Disk reads and waits (each device's pager reads its own layers). */
        out->disk_bytes_read += s.disk_bytes_read;
        out->disk_reads += s.disk_reads;
        out->disk_errors += s.disk_errors;
        out->stall_us += s.stall_us;
        out->bytes_interleaved_paged += s.bytes_interleaved_paged;
        out->units_interleaved_paged += s.units_interleaved_paged;
        out->disk_busy_us += s.disk_busy_us;
        out->read_calls += s.read_calls;
        out->reads_in_flight_sum += s.reads_in_flight_sum;
        if (s.reads_in_flight_peak > out->reads_in_flight_peak)
            out->reads_in_flight_peak = s.reads_in_flight_peak;
    }
    if (first)
        memset(out, 0, sizeof *out);
}

int qm_multipager_resize(qm_multipager *mp, uint64_t budget, qm_status *st)
{
    if (!mp)
        return qm_status_set(st, QM_EINVAL, "qm_multipager_resize: NULL argument");
    const uint32_t n = mp->pl->n_devices;
    uint64_t share[QM_PLACEMENT_MAX_DEVICES], was[QM_PLACEMENT_MAX_DEVICES];
    qm_placement_split(mp->pl, budget, share);
    for (uint32_t d = 0; d < n; d++) {
        if (!mp->pagers[d])
            continue;
        qm_pager_stats s;
        qm_pager_stats_get(mp->pagers[d], &s);
        was[d] = s.budget_bytes;
        int rc = qm_pager_resize(mp->pagers[d], share[d], st);
        if (rc == 0)
            continue;
        if (st && n > 1) {
            char why[sizeof st->msg];
            snprintf(why, sizeof why, "%s", st->msg);
            snprintf(st->msg, sizeof st->msg, "device %u (its share %llu of the budget %llu): %.150s",
                     d, (unsigned long long)share[d], (unsigned long long)budget, why);
        }
        /* The devices already resized go back to their budgets (outputs
         * never change; what a shrink evicted stays evicted). */
        for (uint32_t b = 0; b < d; b++)
            if (mp->pagers[b])
                (void)qm_pager_resize(mp->pagers[b], was[b], NULL);
        return rc;
    }
    return 0;
}

int qm_multipager_record_trace(qm_multipager *mp, const char *path, int resume,
                               uint64_t max_bytes, qm_status *st)
{
    if (!mp)
        return qm_status_set(st, QM_EINVAL, "qm_multipager_record_trace: NULL argument");
    qm_pager *owner = NULL;
    int resumed = 0;
    for (uint32_t d = 0; d < mp->pl->n_devices; d++) {
        qm_pager *p = mp->pagers[d];
        if (!p)
            continue;
        if (!owner) {
            int rc = qm_pager_record_trace(p, path, resume, max_bytes, st);
            if (rc < 0)
                return rc;
            resumed = rc;
            owner = p;
        }
        qm__pager_trace_to(p, owner);
    }
    return resumed;
}
