/* qm_moe_internal.h - the forward pass over an explicit config and layer view.
 * Private to engine/ and its tests: qm_moe_forward is this with the bank's
 * config and layer; tests drive it with views built from arrays. */
#ifndef QM_MOE_INTERNAL_H
#define QM_MOE_INTERNAL_H

#include "qm_moe.h"

int qm__moe_forward_layer(qm_backend *be, const qm_bank_config *cfg, const qm_layer_view *layer,
                          const qm_moe_call *call, qm_expert_source *source, qm_moe_stats *stats,
                          qm_status *st);

/* Bytes of one expert's slice of a per-expert tensor (nbytes / experts). */
uint64_t qm__expert_slice(const qm_tensor_view *tv, uint32_t n_experts);

#endif
