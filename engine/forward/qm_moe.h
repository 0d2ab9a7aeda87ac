/* qm_moe.h - one MoE layer (../shared/BANK_FORMAT.md semantics): its routing
 * math and its forward pass.
 *
 * Routing and combine run on the host in a fixed order (or on a backend with
 * its own routing, with the same semantics); expert FFNs run on the backend.
 * The combine of token t sums its k routes in route order (j = 0..k-1)
 * whatever order experts were computed in, so outputs are bitwise identical
 * across thread counts, policies, budgets and waves. */
#ifndef QM_MOE_H
#define QM_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "qm_backend.h"
#include "qm_bank.h"
#include "qm_half.h" /* f16/bf16 <-> f32, for callers that convert tensors */

#define QM_ROUTE_DROPPED UINT32_MAX

/* ---- Routing math (qm_routing.c): host code, no state, no backend. ---- */

/* Top-k of each token's logits (ties: larger expert index wins), softmax over
 * the k, routes with weight <= 1e-8 dropped (expert QM_ROUTE_DROPPED,
 * weight 0). logits: [T, E]; experts, weights: [T, k]. */
void qm_moe_route(const float *logits, uint32_t n_tokens, uint32_t n_experts, uint32_t k,
                  uint32_t *experts, float *weights);

/* Routing by `rule` (the bank's qmoe.routing.* keys): the legacy rule above
 * when rule->score is LEGACY (bitwise the same), else the family rule of
 * BANK_FORMAT.md (score, correction bias for selection, groups, normalise,
 * scale; no drop threshold). correction_bias: [E] f32 or NULL. QM_ENOMEM
 * (scratch of O(E) per call) or QM_EINVAL for k outside 1..E. */
int qm_moe_route_rule(const qm_routing_rule *rule, const float *correction_bias,
                      const float *logits, uint32_t n_tokens, uint32_t n_experts, uint32_t k,
                      uint32_t *experts, float *weights, qm_status *st);
/* The same with a layer's rule, k and correction bias. */
int qm_moe_route_layer(const qm_bank_config *cfg, const qm_layer_view *layer,
                       const float *logits, uint32_t n_tokens, uint32_t *experts, float *weights,
                       qm_status *st);
/* Routing supplied by the engine (PROTOCOL.md): ids [T, k] (-1 = no route)
 * and weights [T, k] used as given; -1 becomes QM_ROUTE_DROPPED with weight
 * 0. QM_EINVAL with field "topk_ids" for k outside 1..E, an id outside
 * [-1, E) or an id repeated in a row. */
int qm_moe_route_supplied(const int32_t *ids, const float *w, uint32_t n_tokens,
                          uint32_t n_experts, uint32_t k, uint32_t *experts, float *weights,
                          qm_status *st);

/* The checks of qm_moe_route_supplied alone (the daemon runs them before
 * queueing a request). */
int qm_moe_topk_check(const int32_t *ids, uint32_t n_tokens, uint32_t n_experts, uint32_t k,
                      qm_status *st);

/* logits = x . router_w^T + router_b for a layer that has a router weight.
 * QM_EINVAL with a message when the layer has none. x: [T, H] f32. */
int qm_moe_router_logits(const qm_bank_config *cfg, const qm_layer_view *layer, const float *x,
                         uint32_t n_tokens, float *logits, qm_status *st);
/* The same logits to within f32 rounding, fast (f32 FMA in any order; not
 * the bits qm_moe_router_logits gives, so never for routing): the pager's
 * prediction of the next layers' experts. */
int qm_moe_router_predict(const qm_bank_config *cfg, const qm_layer_view *layer, const float *x,
                          uint32_t n_tokens, float *logits, qm_status *st);

/* ---- The forward pass (qm_moe.c) ---- */

/* Where expert weights come from. The pager implements this; the direct
 * source hands out pointers into the mapped bank (host-visible backends).
 * `version` comes first and must be QM_EXPERT_SOURCE_VERSION: the forward
 * pass refuses (QM_EINVAL) a source made for another layout of this struct.
 * Required: acquire. Optional, defaulted by the forward pass: release
 * (nothing to release), split (every expert is acquired), acquire_some
 * (acquire). Version 2 added acquire_some. */
#define QM_EXPERT_SOURCE_VERSION 2

typedef struct qm_expert_source {
    int version; /* QM_EXPERT_SOURCE_VERSION */
    void *ctx;
    /* Makes experts[0..n) usable, as many at once as fit (at least one, in
     * order), filling weights[i] for i < *n_ready. The pointers stay valid
     * until release() of the same experts. `experts` ascending, distinct. */
    int (*acquire)(void *ctx, uint32_t layer, const uint32_t *experts, size_t n,
                   qm_expert_weights *weights, size_t *n_ready, qm_status *st);
    void (*release)(void *ctx, uint32_t layer, const uint32_t *experts, size_t n);
    /* (optional) Hybrid execution (docs/PAGING.md): called once per layer
     * call, after the grouping and before any acquire, with the call's
     * experts[0..n) (ascending) and rows[e], the routes of expert e
     * ([E], indexed by expert id); sets on_host[i] = 1 for
     * the experts that run on `host` straight from the bank mapping instead
     * of being acquired. With it the call is routed and combined on the
     * host whatever the backend (route order, as always). NULL: every
     * expert is acquired. */
    int (*split)(void *ctx, uint32_t layer, uint32_t n_tokens, const uint32_t *experts,
                 const uint32_t *rows, size_t n, uint8_t *on_host, qm_status *st);
    qm_backend *host; /* runs split's experts; required with split */
    /* (optional) Overlapped acquire, used instead of acquire when set:
     * makes experts[0..n) (ascending, distinct) usable as they become so.
     * It starts everything it can hold at once (every copy in flight
     * together) and returns the experts usable now, at least one (waiting
     * for the first to land when none is): ready_idx[j] is the index in
     * experts[] of the j-th, weights[j] its pointers, j < *n_ready, valid
     * until release() of that expert. The next call passes the experts not
     * yet returned (still ascending). Returns 1 when the experts returned
     * start a new round of acquisition (a wave: the source could not hold
     * every expert at once), 0 when they continue the last one, negative on
     * error; on error the source has let go of every expert not returned,
     * and release() of an expert not returned abandons it. The forward pass
     * combines in route order, so the order experts land in never changes
     * an output bit. */
    int (*acquire_some)(void *ctx, uint32_t layer, const uint32_t *experts, size_t n,
                        size_t *ready_idx, qm_expert_weights *weights, size_t *n_ready,
                        qm_status *st);
} qm_expert_source;

/* Fills a source that reads the mapped bank directly (no copies). */
void qm_expert_source_direct(const qm_bank *bank, qm_expert_source *out);
/* Pointers of expert `e` of `layer` when its unit lies at `base` in the order
 * of its catalog's regions (tensor order, each slice contiguous). Used by the
 * pager for slots; `base` = qm_bank_data() + offsets gives the direct source. */
void qm_expert_weights_from_unit(const qm_layer_view *layer, uint32_t n_experts, uint32_t expert,
                                 const uint8_t *unit_base, qm_expert_weights *out);

typedef struct qm_moe_stats {
    uint64_t compute_us;
    uint32_t waves; /* acquire rounds needed (1 when every expert fit at once) */
    uint32_t batches; /* backend runs of the waves (acquire_some: more, as experts land) */
    /* Hybrid execution (a source with split): experts and rows run on the
     * host, and the time of that run; the time spent in acquire (copies)
     * and in the backend's waves, and the experts and rows they ran. */
    uint32_t host_experts, host_rows;
    uint64_t host_us;
    uint32_t device_experts, device_rows;
    uint64_t acquire_us, device_us;
} qm_moe_stats;

typedef struct qm_moe_call {
    uint32_t layer;
    qm_dtype dtype;       /* of hidden and output: F32, F16 or BF16 */
    const void *hidden;   /* [T, H] */
    uint32_t n_tokens;    /* T; 0 gives an empty result */
    const float *logits;  /* [T, E] f32, or NULL to use the bank's router */
    void *output;         /* [T, H] in dtype */
    uint32_t *route_experts; /* optional [T, k] out (k = topk_k with supplied routing) */
    float *route_weights;    /* optional [T, k] out */
    /* Routing supplied by the engine, or NULL: ids [T, topk_k] (-1 = no
     * route) and f32 weights [T, topk_k], used exactly as given; logits is
     * then ignored. Routed on the host whatever the backend. */
    const int32_t *topk_ids;
    const float *topk_weights;
    uint32_t topk_k;
    qm_precision precision;  /* zero-initialised: exact */
} qm_moe_call;

/* Routes per token of `call`: topk_k with supplied routing, else qmoe.k. */
uint32_t qm_moe_call_k(const qm_bank_config *cfg, const qm_moe_call *call);

/* Runs one layer: route -> group -> waves -> combine. Its scratch (bounded
 * by about T*k*H floats) is allocated and freed per call; a session's pager
 * keeps one instead (qm_pager_forward). */
int qm_moe_forward(qm_backend *be, const qm_bank *bank, const qm_moe_call *call,
                   qm_expert_source *source, qm_moe_stats *stats, qm_status *st);

#endif
