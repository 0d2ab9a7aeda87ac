/* qm_backend_impl.h - what a backend implements. Private to engine/ and cuda/. */
#ifndef QM_BACKEND_IMPL_H
#define QM_BACKEND_IMPL_H

#include "qm_backend.h"

/* 3: `routes`, what the routing group can route. The optional groups
 * (routing, host registration) are all-or-none, checked once by
 * qm__backend_wrap. */
#define QM_BACKEND_IFACE_VERSION 3

/* What a backend's route method routes (qm_backend_iface.routes); a call
 * it cannot route is routed on the host. */
enum {
    /* Banks without routing keys: top-k of the logits, softmax over the k. */
    QM_BACKEND_ROUTES_LEGACY = 1u << 0,
    /* Banks with routing keys (qmoe.routing.*: scores, groups, bias, scaling). */
    QM_BACKEND_ROUTES_KEYED = 1u << 1,
    /* Routing supplied by the engine (topk_ids, topk_weights). */
    QM_BACKEND_ROUTES_SUPPLIED = 1u << 2,
};

struct qm_arena {
    qm_backend *backend;
    void *base;    /* device address */
    uint64_t size;
    void *handle;  /* backend's own */
};

/* A layer call's routing (route / run_routed / combine / pass_release
 * below). The backend computes the router logits (or takes rq->logits),
 * top-k, softmax and the 1e-8 drop with exactly qm_moe_route's semantics,
 * groups the routes by expert (tokens ascending within an expert, as the
 * host grouping does), and hands back only the routing result; the engine
 * pages the experts in and runs waves through run_routed; combine sums each
 * token's routes in route order j = 0..k-1 (fc2 bias inside the weighted
 * sum, f32 multiply then add, as the host combine). A backend without these
 * methods (CPU) gets the host's: the defaults in qm_backend.c. */
typedef struct qm_routing_request {
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
    /* Routing supplied by the engine, or NULL: ids [T, k] (-1 = no route)
     * and f32 weights [T, k], used exactly as given. */
    const int32_t *topk_ids;
    const float *topk_weights;
    uint32_t k; /* routes per token: the supplied k'; 0 = config->k */
} qm_routing_request;

/* The state of the host's routing (the default route/run_routed/combine):
 * the token permutation and one result row per route, in the engine's
 * per-session scratch (qm_host_route.h). */
typedef struct qm__host_pass qm__host_pass;

/* One layer call's pass, from qm__backend_route to qm__backend_pass_release. */
typedef struct qm_routed_pass {
    void *backend_pass;  /* the backend's, NULL when the call is routed on the host */
    qm__host_pass *host; /* set by the caller before route: the host routing's state */
} qm_routed_pass;

typedef struct qm_backend_iface {
    int version;
    const char *name;
    int host_visible;
    size_t alignment;
    /* QM_BACKEND_ROUTES_* the routing group below routes: nonzero exactly
     * when the group is present. */
    unsigned routes;
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

    /* ---- (optional, all four or none) routing on the backend, for the
     * calls `routes` names. Default (and for every other call): the host
     * routes, groups and combines, and runs the waves through run_experts
     * (qm_backend.c). ---- */
    /* Routes rq->n_tokens tokens and keeps x, the routes and their
     * permutation in a pass (*pass, released with pass_release). May answer
     * QM_EUNSUPPORTED (e.g. switched off): the call is then routed on the host. */
    int (*route)(void *ctx, const qm_routing_request *rq, void **pass, qm_status *st);
    /* Runs a wave of the pass's experts: batch->jobs give expert, weights
     * and n_rows (= counts[expert]); batch->x, y and the jobs' rows and
     * out_index are not used (the rows are the pass's, the results stay in
     * the pass). Synchronous on return, like run_experts. */
    int (*run_routed)(void *ctx, void *pass, const qm_expert_batch *batch, qm_status *st);
    /* out [T, H] f32 host = the combine of every route run so far. */
    int (*combine)(void *ctx, void *pass, float *out, qm_status *st);
    void (*pass_release)(void *ctx, void *pass); /* accepts NULL */

    /* ---- (optional, both or none) host memory the backend copies from
     * often (a mapped bank), made faster to copy (CUDA: cudaHostRegister).
     * Default: nothing to do. ---- */
    /* 0 when registered; QM_EUNSUPPORTED when the driver refuses (copies
     * still work, slower); QM_ECONFLICT on overlap with an earlier range. */
    int (*register_host)(void *ctx, const void *ptr, size_t bytes, qm_status *st);
    /* Undoes the registration made with the same ptr; QM_ENOT_FOUND if none. */
    int (*unregister_host)(void *ctx, const void *ptr, qm_status *st);
} qm_backend_iface;

struct qm_backend {
    const qm_backend_iface *iface;
    void *ctx;
};

/* Wraps an implementation; checks the version, the required methods, that
 * each optional group is complete and that `routes` matches the routing
 * group. Takes ownership of ctx (destroy on failure). */
int qm__backend_wrap(const qm_backend_iface *iface, void *ctx, qm_backend **out, qm_status *st);

/* ---- The routed pass: the only call sites of the routing methods, host
 * routing (qm_host_route.h) when the backend has none (qm_backend.c) ---- */

/* Routes on the backend when its `routes` name the call's rule, else on the
 * host (pass->host); also on the host when the backend declines with
 * QM_EUNSUPPORTED. */
int qm__backend_route(qm_backend *be, const qm_routing_request *rq, qm_routed_pass *pass,
                      qm_status *st);
int qm__backend_run_routed(qm_backend *be, qm_routed_pass *pass, const qm_expert_batch *batch,
                           qm_status *st);
int qm__backend_combine(qm_backend *be, qm_routed_pass *pass, float *out, qm_status *st);
void qm__backend_pass_release(qm_backend *be, qm_routed_pass *pass); /* accepts an unrouted pass */

/* ---- A backend kind: one row of the registry (qm_backend_registry.c) ---- */

#define QM_BACKEND_KIND_VERSION 1

/* How a backend declares itself to the registry: checked (version, name,
 * open) before each use. The row is static and lives as long as the
 * program. */
typedef struct qm__backend_kind {
    int version;         /* QM_BACKEND_KIND_VERSION */
    const char *name;    /* the kind: --backend, --device KIND:N, qm_device_info.kind */
    const char *summary; /* one line for help texts */
    unsigned caps;       /* QM_BACKEND_CAP_* (qm_backend.h) */
    /* Opens device o->index (0 for a kind without QM_BACKEND_CAP_NUMBERED). */
    int (*open)(const qm_backend_open_options *o, qm_backend **out, qm_status *st);
    /* (optional) How many devices this process can open, or why none
     * (QM_EUNSUPPORTED: not built in; QM_EDEVICE: none present). Default:
     * one. */
    int (*probe)(uint32_t *n_devices, qm_status *st);
} qm__backend_kind;

/* The registry's check of a row before it is used: QM_EUNSUPPORTED for
 * another version, QM_EINVAL without a name or open method, with a
 * sentence naming the row. */
int qm__backend_kind_check(const qm__backend_kind *kind, qm_status *st);

#endif
