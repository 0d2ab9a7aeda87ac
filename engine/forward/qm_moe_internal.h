/* qm_moe_internal.h - the forward pass with a scratch kept by its caller, and
 * over an explicit config and layer view. Private to engine/ and its tests:
 * qm_moe_forward is qm__moe_forward_layer with a one-shot scratch; the pager
 * keeps one scratch per session; tests drive it with views built from
 * arrays. */
#ifndef QM_MOE_INTERNAL_H
#define QM_MOE_INTERNAL_H

#include "qm_moe.h"

/* The buffers of layer calls: grow to the largest call served, never shrink,
 * so a session in its steady state allocates nothing per call. One call at
 * a time (a session's calls are serial). */
typedef struct qm__moe_scratch qm__moe_scratch;

int qm__moe_scratch_new(qm__moe_scratch **out, qm_status *st);
void qm__moe_scratch_free(qm__moe_scratch *scratch); /* accepts NULL */
/* Host bytes the scratch holds now (0 for NULL). */
size_t qm__moe_scratch_bytes(const qm__moe_scratch *scratch);

/* The forward pass's one entry: every layer call (qm_moe_forward, the
 * pager's qm_pager_forward, the tests' views built from arrays) runs
 * route -> group -> waves -> combine here. `scratch` NULL: the call makes
 * its own and frees it (one allocation, more for the backend). */
int qm__moe_forward_layer(qm_backend *be, const qm_bank_config *cfg, const qm_layer_view *layer,
                          const qm_moe_call *call, qm_expert_source *source,
                          qm__moe_scratch *scratch, qm_moe_stats *stats, qm_status *st);
/* The view of call->layer in `bank` (borrowed from the bank), or QM_EINVAL
 * with field "layer" when the bank has no such layer. */
int qm__moe_layer_of(const qm_bank *bank, const qm_moe_call *call, const qm_layer_view **out,
                     qm_status *st);

/* Pointers of expert `expert` straight into the layer's mapped tensors. */
void qm__mapped_weights(const qm_layer_view *layer, uint32_t n_experts, uint32_t expert,
                        qm_expert_weights *out);

/* Tests: 1 makes qm_moe_router_logits take its scalar specification
 * instead of the AVX2 path (the same bits), 0 undoes it. */
void qm__routing_force_scalar(int on);

/* n hidden-state values of dtype dt (f32, f16, bf16) at src as f32 at dst. */
void qm__load_hidden(qm_dtype dt, const void *src, size_t n, float *dst);

/* Bytes of one expert's slice of a per-expert tensor (nbytes / experts). */
uint64_t qm__expert_slice(const qm_tensor_view *tv, uint32_t n_experts);

#endif
