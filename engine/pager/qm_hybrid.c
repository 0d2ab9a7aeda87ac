/* qm_hybrid.c - hybrid execution (qm_pager_options.on_miss): the pager's
 * answer to "run this non-resident expert on the host, or page it in?".
 *
 * With on_miss host or auto the pager's expert source gets a split method
 * (qm_moe.h): the forward pass routes on the host, asks split which of the
 * call's experts run on the host CPU kernels straight from the bank
 * mapping, runs those in one batch, acquires the others through the pager
 * as before, and combines every route in route order on the host.
 *
 *   host: every expert not resident (nor in flight) now runs on the host;
 *         nothing is copied on demand (prefetch still is, when on).
 *   auto: per expert and call, a demand copy (victim chosen by the policy
 *         as always) when copy + device time for the expert's rows is below
 *         0.9x the host's modelled time (Fiddler's rule, arXiv 2402.07033,
 *         with a margin against noisy estimates), else the host. An expert run on the host is still an access
 *         the policy sees, and after the call is admitted into a free slot
 *         (an asynchronous copy, never an eviction) so that free room fills
 *         with what is used.
 *
 * auto's model: time(n rows) = fixed + n * row, for the host and for the
 * device, and one unit's copy. Measured at creation (one expert of the
 * first paged layer run with 1 and QM__CAL_ROWS rows on each side, its
 * unit copied into a free slot, where it stays as a preloaded expert) and
 * refreshed after every call from what that call measured (qm_moe_stats):
 * each of the three is scaled by measured / predicted, smoothed. */
#include <string.h>
#include <time.h>

#include "qm_alloc.h"
#include "qm_hybrid.h"
#include "qm_pager_copy.h"

#define QM__CAL_ROWS 16u
#define QM__SMOOTH 0.1 /* weight of one call's measure */
#define QM__RATIO_MIN 0.5 /* one call's measure counts as at most 2x off */
#define QM__RATIO_MAX 2.0
#define QM__MIN_PRED_US 1.0 /* below this a prediction is noise: not refreshed */
/* auto pages only when copy + device is below this share of the host's
 * time: the three estimates are noisy (a call's measure moves them), and
 * where host and device cost about the same a coin-flip page costs a copy
 * for nothing, while a host run declined wrongly costs at most the margin. */
#define QM__PAGE_MARGIN 0.9

static double qm__now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static double qm__cost(const qm__cost_line *c, uint32_t rows)
{
    return c->fixed_us + c->row_us * (double)rows;
}

/* ---- The split ---------------------------------------------------------------------- */

/* Copies expert e of `layer` into a free slot, without waiting (auto's
 * admission): 1 when issued, 0 when there is no free slot. */
static int qm__admit(qm_pager *p, uint32_t layer, uint32_t e, qm_status *st)
{
    int32_t s = qm__pager_free_slot(p);
    if (s < 0)
        return 0;
    int rc = qm__pager_claim(p, s, layer, e, QM__CLAIM_PRELOAD, QM__PF_NONE, st);
    if (rc == 0 && (rc = qm__pager_copy_unit(p, s, st)) != 0)
        qm__pager_drop(p, s);
    if (rc)
        return rc;
    p->stats.host_admits++;
    p->stats.bytes_paged_h2d += p->layers[layer].unit_bytes;
    return 1;
}

static int qm__split(void *ctx, uint32_t layer, uint32_t n_tokens, const uint32_t *experts,
                     const uint32_t *rows, size_t n, uint8_t *on_host, qm_status *st)
{
    (void)n_tokens;
    qm_pager *p = ctx;
    qm__hybrid *h = &p->hybrid;
    h->pred_host_us = h->pred_dev_us = 0;
    h->pred_misses = 0;
    h->n_admit = 0;
    h->admit_layer = layer;
    h->misses_before = p->stats.misses;
    if (layer >= p->n_layers)
        return qm_status_set(st, QM_EINVAL, "layer %u out of range (%u layers)", layer,
                             p->n_layers);
    qm__layer *L = &p->layers[layer];
    for (size_t i = 0; i < n; i++) {
        uint32_t e = experts[i];
        if (e >= L->n_experts)
            return qm_status_set(st, QM_EINVAL, "expert %u out of range (%u experts)", e,
                                 L->n_experts);
        uint32_t r = rows[e];
        double dev = qm__cost(&h->dev, r);
        if (!L->paged || L->slot_of[e] >= 0) {
            h->pred_dev_us += dev;
            continue; /* resident: the device runs it */
        }
        double host = qm__cost(&h->host, r);
        if (p->opt.on_miss == QM_ON_MISS_AUTO && h->copy_us + dev < QM__PAGE_MARGIN * host) {
            h->pred_dev_us += dev;
            h->pred_misses++;
            continue; /* paging wins: a demand miss */
        }
        on_host[i] = 1;
        h->admit[h->n_admit++] = e;
        h->pred_host_us += host;
        p->stats.host_runs++;
        p->stats.host_rows += r;
        qm_policy_on_access(p->policy, (qm_expert_ref){layer, e}, p->tick++, 0);
    }
    return 0;
}

/* ---- Refresh from what a call measured ---------------------------------------------- */

static void qm__rescale(qm__cost_line *c, double measured_us, double predicted_us)
{
    if (predicted_us < QM__MIN_PRED_US)
        return;
    double r = measured_us / predicted_us;
    r = r < QM__RATIO_MIN ? QM__RATIO_MIN : r > QM__RATIO_MAX ? QM__RATIO_MAX : r;
    double f = 1.0 - QM__SMOOTH + QM__SMOOTH * r;
    c->fixed_us *= f;
    c->row_us *= f;
}

static void qm__publish(qm_pager *p)
{
    const qm__hybrid *h = &p->hybrid;
    p->stats.model_copy_us = h->copy_us;
    p->stats.model_host_us = h->host.fixed_us + h->host.row_us;
    p->stats.model_host_row_us = h->host.row_us;
    p->stats.model_dev_us = h->dev.fixed_us + h->dev.row_us;
    p->stats.model_dev_row_us = h->dev.row_us;
}

int qm__hybrid_observe(qm_pager *p, const qm_moe_stats *ms, qm_status *st)
{
    qm__hybrid *h = &p->hybrid;
    if (p->opt.on_miss != QM_ON_MISS_AUTO || !ms)
        return 0;
    /* Admission, after the call so that its demand misses had the free
     * slots first. */
    for (size_t i = 0; i < h->n_admit; i++) {
        int rc = qm__admit(p, h->admit_layer, h->admit[i], st);
        if (rc < 0)
            return rc;
        if (rc == 0)
            break; /* no free slot left */
    }
    h->n_admit = 0;
    if (ms->host_experts)
        qm__rescale(&h->host, (double)ms->host_us, h->pred_host_us);
    if (ms->device_experts)
        qm__rescale(&h->dev, (double)ms->device_us, h->pred_dev_us);
    uint64_t missed = p->stats.misses - h->misses_before;
    if (missed) {
        qm__cost_line c = {.fixed_us = h->copy_us};
        qm__rescale(&c, (double)ms->acquire_us, h->copy_us * (double)missed);
        h->copy_us = c.fixed_us;
    }
    qm__publish(p);
    return 0;
}

/* ---- Creation: the host backend and auto's first measures -------------------------- */

/* Times `be` running expert e of layer L from `w` on 1 and QM__CAL_ROWS rows
 * (best of two each) into *line. */
static int qm__time_expert(qm_pager *p, qm_backend *be, const qm__layer *L, uint32_t e,
                           const qm_expert_weights *w, float *x, float *y, uint32_t *idx,
                           qm__cost_line *line, qm_status *st)
{
    qm_expert_job job = {.expert = e, .weights = *w, .rows = idx, .out_index = idx};
    qm_expert_batch batch = {.config = p->cfg, .layer = L->view, .x = x,
                             .n_tokens = QM__CAL_ROWS, .y = y, .jobs = &job, .n_jobs = 1};
    double best[2] = {0, 0};
    const uint32_t n_rows[2] = {1, QM__CAL_ROWS};
    for (int k = 0; k < 2; k++) {
        job.n_rows = n_rows[k];
        for (int rep = 0; rep < 2; rep++) {
            double t0 = qm__now_us();
            int rc = qm_backend_run_experts(be, &batch, st);
            double dt = qm__now_us() - t0;
            if (rc)
                return rc;
            if (rep == 0 || dt < best[k])
                best[k] = dt;
        }
    }
    double row = (best[1] - best[0]) / (double)(QM__CAL_ROWS - 1);
    line->row_us = row > 0 ? row : 0;
    line->fixed_us = best[0] - line->row_us > 0 ? best[0] - line->row_us : 0.01;
    return 0;
}

static int qm__calibrate(qm_pager *p, qm_status *st)
{
    qm__hybrid *h = &p->hybrid;
    uint32_t l = 0;
    while (l < p->n_layers && !p->layers[l].paged)
        l++;
    if (l == p->n_layers)
        return 0; /* nothing is paged: nothing to decide */
    qm__layer *L = &p->layers[l];
    const size_t H = p->cfg->hidden;
    float *x = qm_calloc(QM__CAL_ROWS * H, sizeof *x);
    float *y = qm_calloc(QM__CAL_ROWS * H, sizeof *y);
    uint32_t *idx = qm_malloc(QM__CAL_ROWS * sizeof *idx);
    int rc = 0;
    if (!x || !y || !idx) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory for the hybrid calibration");
        goto done;
    }
    for (uint32_t r = 0; r < QM__CAL_ROWS; r++)
        idx[r] = r;
    qm_expert_weights w;
    qm__mapped_weights(L->view, L->n_experts, 0, &w);
    rc = qm__time_expert(p, h->host_be, L, 0, &w, x, y, idx, &h->host, st);
    if (rc)
        goto done;
    /* The device side on the unit of an expert copied into a free slot; with
     * none (or the expert already resident) the host's figures stand in
     * until calls measure the device. */
    h->dev = h->host;
    h->copy_us = (double)L->unit_bytes / 16e3; /* 16 GB/s until measured */
    int32_t s = L->slot_of[0] < 0 ? qm__pager_free_slot(p) : -1;
    if (s < 0)
        goto done;
    double t0 = qm__now_us();
    rc = qm__pager_claim(p, s, l, 0, QM__CLAIM_PRELOAD, QM__PF_NONE, st);
    if (rc == 0 && (rc = qm__pager_copy_unit(p, s, st)) != 0)
        qm__pager_drop(p, s);
    if (rc == 0)
        rc = qm__pager_copy_wait(p, s, st);
    if (rc)
        goto done;
    h->copy_us = qm__now_us() - t0;
    p->stats.bytes_loaded_at_create += L->unit_bytes;
    qm__fill_weights(L, p->slots[s].base, 0, 1, &w); /* just copied: row layout */
    rc = qm__time_expert(p, p->backend, L, 0, &w, x, y, idx, &h->dev, st);
done:
    qm_free(x);
    qm_free(y);
    qm_free(idx);
    return rc;
}

int qm__hybrid_start(qm_pager *p, qm_status *st)
{
    qm__hybrid *h = &p->hybrid;
    if (p->opt.on_miss == QM_ON_MISS_PAGE)
        return 0;
    if (p->opt.on_miss != QM_ON_MISS_HOST && p->opt.on_miss != QM_ON_MISS_AUTO)
        return qm_status_set_field(st, QM_EINVAL, "on_miss", "on_miss %d is not page, host or auto",
                                   p->opt.on_miss);
    h->host_be = p->opt.host_backend;
    if (!h->host_be && qm_backend_host_visible(p->backend))
        h->host_be = p->backend;
    if (!h->host_be) {
        int rc = qm_backend_cpu_new(p->opt.host_threads, &h->owned, st);
        if (rc)
            return rc;
        h->host_be = h->owned;
    }
    h->admit = qm_malloc((p->cfg->experts ? p->cfg->experts : 1) * sizeof *h->admit);
    if (!h->admit)
        return qm_status_set(st, QM_ENOMEM, "out of memory for hybrid execution");
    if (p->opt.on_miss == QM_ON_MISS_AUTO) {
        int rc = qm__calibrate(p, st);
        if (rc)
            return rc;
        qm__publish(p);
    }
    p->source.split = qm__split;
    p->source.host = h->host_be;
    return 0;
}

void qm__hybrid_stop(qm_pager *p)
{
    qm_backend_free(p->hybrid.owned);
    qm_free(p->hybrid.admit);
    memset(&p->hybrid, 0, sizeof p->hybrid);
}
