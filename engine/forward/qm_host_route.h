/* qm_host_route.h - the host routing: what a layer call gets when its
 * backend has no routing methods (the CPU backend, and the defaults the
 * backend wrappers give, qm_backend.c), or when hybrid execution routes on
 * the host (qm_moe.c). Routes the call (qm_routing.c), permutes its routes
 * by expert (tokens ascending within an expert), hands out the routed
 * batch of a wave, and combines every route in route order j = 0..k-1.
 * It runs nothing itself: the caller runs the batch on a backend. Private
 * to engine/. */
#ifndef QM_HOST_ROUTE_H
#define QM_HOST_ROUTE_H

#include "qm_backend_impl.h"
#include "qm_scratch.h"

/* One pass's state, from qm__host_route to qm__host_combine. The caller
 * owns it (the forward pass's scratch: one per session, reused per call;
 * zero-initialised before its first use) and frees it with
 * qm__host_pass_clear. */
struct qm__host_pass {
    qm__block block;
    /* The call routed last (qm__host_route); experts NULL until then. Borrowed
     * from the routing request: valid while the caller's call is. */
    const float *x;
    uint32_t n_tokens, n_experts, k, hidden;
    const uint32_t *experts; /* [T, k] the routes */
    const float *weights;    /* [T, k] */
    const uint32_t *counts;  /* [E] */
    /* Carved from block. */
    uint32_t *offsets;   /* [E + 1] first grouped route of each expert */
    uint32_t *rows;      /* [T * k] token of each grouped route */
    uint32_t *out_index; /* [T * k] route index (t * k + j) of each grouped route */
    float *y;            /* [T * k, H] one result row per route */
    float *logits;       /* [T, E] when the call brought none */
    qm_expert_job *jobs; /* [E] a wave's jobs with their rows */
};

/* Routes rq (the bank's rule, the router when rq brings no logits, or the
 * engine's routing as given), filling rq->experts, rq->weights and
 * rq->counts, and groups the routes by expert. QM_EUNSUPPORTED when `hp`
 * is NULL (the caller gave no host state). */
int qm__host_route(qm__host_pass *hp, const qm_routing_request *rq, qm_status *st);
/* The wave `batch` (jobs with expert, weights and n_rows = the routing's
 * count) as a batch the backend's run_experts takes: x, the routes' rows
 * and their result rows in hp. *out borrows hp's arrays until the next
 * call on hp. QM_EINVAL when hp was not routed or a job's rows disagree. */
int qm__host_batch(qm__host_pass *hp, const qm_expert_batch *batch, qm_expert_batch *out,
                   qm_status *st);
/* out [T, H] f32 = each token's routes summed in route order j = 0..k-1,
 * w * y as a multiply then an add, the fc2 bias inside y. */
int qm__host_combine(const qm__host_pass *hp, float *out, qm_status *st);
void qm__host_pass_clear(qm__host_pass *hp); /* frees the block; hp may be reused */

#endif
