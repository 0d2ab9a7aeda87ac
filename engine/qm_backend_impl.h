/* qm_backend_impl.h - what a backend implements. Private to engine/ and cuda/. */
#ifndef QM_BACKEND_IMPL_H
#define QM_BACKEND_IMPL_H

#include "qm_backend.h"

#define QM_BACKEND_IFACE_VERSION 1

struct qm_arena {
    qm_backend *backend;
    void *base;    /* device address */
    uint64_t size;
    void *handle;  /* backend's own */
};

/* A layer call whose routing, token permutation and combine run on the
 * backend (the optional methods route / run_routed / combine / pass_release
 * below). The engine (qm_moe.c) uses them when all four are present: the
 * backend computes the router logits (or takes rq->logits), top-k, softmax
 * and the 1e-8 drop with exactly qm_moe_route's semantics, groups the routes
 * by expert (tokens ascending within an expert, as the host grouping does),
 * and hands back only the routing result; the engine pages the experts in
 * and runs waves through run_routed; combine sums each token's routes in
 * route order j = 0..k-1 (fc2 bias inside the weighted sum, f32 multiply
 * then add, as the host combine). */
typedef struct qm_route_request {
    const qm_bank_config *config;
    const qm_layer_view *layer; /* its router weight/bias are used when logits is NULL */
    const float *x;             /* [T, H] f32, host */
    const float *logits;        /* [T, E] f32 host, or NULL */
    uint32_t n_tokens;          /* T >= 1 */
    uint32_t *experts;          /* out [T, k]: as qm_moe_route (QM_ROUTE_DROPPED = UINT32_MAX) */
    float *weights;             /* out [T, k] */
    uint32_t *counts;           /* out [E]: routes per expert (dropped ones not counted) */
    qm_dtype act_dtype;         /* the call's activation dtype (x is f32 here whatever it is):
                                 * a backend may compute in it (CUDA: tensor cores for f16/bf16) */
} qm_route_request;

typedef struct qm_backend_iface {
    int version;
    const char *name;
    int host_visible;
    size_t alignment;
    int (*info)(void *ctx, qm_device_info *out);
    /* Allocates `bytes` and fills arena->base/handle. */
    int (*arena_alloc)(void *ctx, qm_arena *arena, uint64_t bytes, qm_status *st);
    void (*arena_release)(void *ctx, qm_arena *arena);
    int (*copy_h2d)(void *ctx, void *dst, const void *src, uint64_t bytes, qm_fence *fence,
                    qm_status *st);
    /* (optional) default: nothing to wait for (synchronous copies). */
    int (*fence_wait)(void *ctx, qm_fence *fence, qm_status *st);
    int (*run_experts)(void *ctx, const qm_expert_batch *batch, qm_status *st);
    /* (optional) default: no-op. */
    int (*synchronize)(void *ctx, qm_status *st);
    void (*destroy)(void *ctx);

    /* ---- (optional) device-side routing; all four or none. A backend
     * leaving them NULL (CPU) is routed on the host, as before. ---- */
    /* Routes rq->n_tokens tokens and keeps x, the routes and their
     * permutation in a pass (*pass, released with pass_release). May answer
     * QM_EUNSUPPORTED (e.g. switched off): the engine then routes on the host. */
    int (*route)(void *ctx, const qm_route_request *rq, void **pass, qm_status *st);
    /* Runs a wave of the pass's experts: batch->jobs give expert, weights
     * and n_rows (= counts[expert]); batch->x, y and the jobs' rows and
     * out_index are not used (the rows are the pass's, the results stay in
     * the pass). Synchronous on return, like run_experts. */
    int (*run_routed)(void *ctx, void *pass, const qm_expert_batch *batch, qm_status *st);
    /* out [T, H] f32 host = the combine of every route run so far. */
    int (*combine)(void *ctx, void *pass, float *out, qm_status *st);
    void (*pass_release)(void *ctx, void *pass); /* accepts NULL */
} qm_backend_iface;

struct qm_backend {
    const qm_backend_iface *iface;
    void *ctx;
};

/* Wraps an implementation; checks the version. Takes ownership of ctx (destroy on failure). */
int qm__backend_wrap(const qm_backend_iface *iface, void *ctx, qm_backend **out, qm_status *st);

/* The call sites of the optional routing methods (qm_backend.c holds the others). */
static inline int qm__backend_can_route(const qm_backend *be)
{
    const qm_backend_iface *i = be->iface;
    return i->route && i->run_routed && i->combine && i->pass_release;
}
static inline int qm__backend_route(qm_backend *be, const qm_route_request *rq, void **pass,
                                    qm_status *st)
{
    *pass = NULL;
    if (!qm__backend_can_route(be))
        return qm_status_set(st, QM_EUNSUPPORTED, "backend '%s' does not route", be->iface->name);
    return be->iface->route(be->ctx, rq, pass, st);
}
static inline int qm__backend_run_routed(qm_backend *be, void *pass, const qm_expert_batch *batch,
                                         qm_status *st)
{
    if (!batch || batch->n_jobs == 0)
        return 0;
    return be->iface->run_routed(be->ctx, pass, batch, st);
}
static inline int qm__backend_combine(qm_backend *be, void *pass, float *out, qm_status *st)
{
    return be->iface->combine(be->ctx, pass, out, st);
}
static inline void qm__backend_pass_release(qm_backend *be, void *pass)
{
    if (pass)
        be->iface->pass_release(be->ctx, pass);
}

#endif
