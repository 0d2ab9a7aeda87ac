/* qm_host_route.c - see qm_host_route.h. */
#include "qm_host_route.h"

#include <string.h>

#include "qm_moe.h"

static void qm__layout_host(qm__carver *c, const qm__dims *d, void *out)
{
    qm__host_pass *hp = out;
    const uint64_t TK = (uint64_t)d->T * d->k;
    hp->offsets = qm__carve(c, (uint64_t)d->E + 1, sizeof(uint32_t));
    hp->rows = qm__carve(c, TK, sizeof(uint32_t));
    hp->out_index = qm__carve(c, TK, sizeof(uint32_t));
    hp->y = qm__carve(c, qm__mul_sat(TK, d->H), sizeof(float));
    hp->logits = d->need_logits ? qm__carve(c, (uint64_t)d->T * d->E, sizeof(float)) : NULL;
    hp->jobs = qm__carve(c, d->E, sizeof(qm_expert_job));
}

int qm__host_route(qm__host_pass *hp, const qm_routing_request *rq, qm_status *st)
{
    if (!hp)
        return qm_status_set(st, QM_EUNSUPPORTED, "no host routing state for this call");
    hp->experts = NULL;
    const qm_bank_config *cfg = rq->config;
    const uint32_t T = rq->n_tokens, E = cfg->experts, k = rq->k ? rq->k : cfg->k;
    qm__dims d = {.T = T, .E = E, .k = k, .H = cfg->hidden,
                  .need_logits = !rq->logits && !rq->topk_ids};
    int rc = qm__block_carve(&hp->block, qm__layout_host, &d, hp, st);
    if (rc < 0)
        return rc;
    if (rq->topk_ids) {
        /* The engine's own routing, used exactly as given. */
        rc = qm_moe_route_supplied(rq->topk_ids, rq->topk_weights, T, E, k, rq->experts,
                                   rq->weights, st);
        if (rc < 0)
            return rc;
    } else {
        const float *logits = rq->logits;
        if (!logits) {
            rc = qm_moe_router_logits(cfg, rq->layer, rq->x, T, hp->logits, st);
            if (rc < 0)
                return rc;
            logits = hp->logits;
        }
        if (cfg->routing.score == QM_ROUTE_SCORE_LEGACY)
            qm_moe_route(logits, T, E, k, rq->experts, rq->weights);
        else if ((rc = qm_moe_route_layer(cfg, rq->layer, logits, T, rq->experts, rq->weights,
                                          st)) < 0)
            return rc;
    }

    /* Group the routes by expert, tokens ascending within an expert. */
    const size_t TK = (size_t)T * k;
    memset(rq->counts, 0, (size_t)E * sizeof(uint32_t));
    for (size_t i = 0; i < TK; i++)
        if (rq->experts[i] != QM_ROUTE_DROPPED)
            rq->counts[rq->experts[i]]++;
    hp->offsets[0] = 0;
    for (uint32_t e = 0; e < E; e++)
        hp->offsets[e + 1] = hp->offsets[e] + rq->counts[e];
    for (size_t i = 0; i < TK; i++) {
        uint32_t e = rq->experts[i];
        if (e == QM_ROUTE_DROPPED)
            continue;
        hp->rows[hp->offsets[e]] = (uint32_t)(i / k);
        hp->out_index[hp->offsets[e]] = (uint32_t)i;
        hp->offsets[e]++;
    }
    for (uint32_t e = 0; e < E; e++)
        hp->offsets[e] -= rq->counts[e]; /* back to each expert's first route */

    hp->x = rq->x;
    hp->n_tokens = T;
    hp->n_experts = E;
    hp->k = k;
    hp->hidden = cfg->hidden;
    hp->weights = rq->weights;
    hp->counts = rq->counts;
    hp->experts = rq->experts;
    return 0;
}

int qm__host_batch(qm__host_pass *hp, const qm_expert_batch *batch, qm_expert_batch *out,
                   qm_status *st)
{
    if (!hp || !hp->experts)
        return qm_status_set(st, QM_EINVAL, "run_routed: the call was not routed on the host");
    if (batch->n_jobs > hp->n_experts)
        return qm_status_set(st, QM_EINVAL, "run_routed: %zu jobs for %u experts",
                             batch->n_jobs, hp->n_experts);
    for (size_t j = 0; j < batch->n_jobs; j++) {
        qm_expert_job job = batch->jobs[j];
        if (job.expert >= hp->n_experts || job.n_rows != hp->counts[job.expert])
            return qm_status_set(st, QM_EINVAL,
                                 "run_routed: job for expert %u has %u rows, the routing %u",
                                 job.expert, job.n_rows,
                                 job.expert < hp->n_experts ? hp->counts[job.expert] : 0);
        job.rows = hp->rows + hp->offsets[job.expert];
        job.out_index = hp->out_index + hp->offsets[job.expert];
        hp->jobs[j] = job;
    }
    *out = *batch;
    out->x = hp->x;
    out->n_tokens = hp->n_tokens;
    out->y = hp->y;
    out->jobs = hp->jobs;
    return 0;
}

void qm_combine_columns(const qm_combine *c, const float *y, uint32_t n_tokens, uint32_t hidden,
                        uint32_t c0, uint32_t c1)
{
    /* Route order j = 0..k-1: the same sums whatever order the experts ran
     * in. The fc2 bias is inside y, so inside the weighted sum. */
    const uint32_t k = c->k;
    for (uint32_t t = 0; t < n_tokens; t++) {
        float *o = c->out + (size_t)t * hidden;
        for (uint32_t n = c0; n < c1; n++)
            o[n] = 0.0f;
        for (uint32_t j = 0; j < k; j++) {
            size_t i = (size_t)t * k + j;
            if (c->experts[i] == UINT32_MAX)
                continue;
            const float *yr = y + i * hidden;
            float w = c->weights[i];
            for (uint32_t n = c0; n < c1; n++)
                o[n] += w * yr[n];
        }
    }
}

int qm__host_combine(const qm__host_pass *hp, float *out, qm_status *st)
{
    if (!hp || !hp->experts)
        return qm_status_set(st, QM_EINVAL, "combine: the call was not routed on the host");
    qm_combine c = {.out = out, .weights = hp->weights, .experts = hp->experts, .k = hp->k};
    qm_combine_columns(&c, hp->y, hp->n_tokens, hp->hidden, 0, hp->hidden);
    return 0;
}

void qm__host_pass_clear(qm__host_pass *hp)
{
    qm__block_free(&hp->block);
}
