/* qm_moe_bank.c - the forward pass and the direct expert source over an open bank.
 * Kept apart from qm_moe.c so code that only routes or runs kernels does not
 * need the bank loader linked in. */
#include "qm_moe_internal.h"

int qm_moe_forward(qm_backend *be, const qm_bank *bank, const qm_moe_call *call,
                   qm_expert_source *source, qm_moe_stats *stats, qm_status *st)
{
    if (!bank || !call)
        return qm_status_set(st, QM_EINVAL, "forward: bank or call missing");
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    const qm_layer_view *layer = qm_bank_layer(bank, call->layer);
    if (!layer)
        return qm_status_set_field(st, QM_EINVAL, "layer", "layer %u out of range (bank has %u)",
                                   call->layer, cfg->layers);
    return qm__moe_forward_layer(be, cfg, layer, call, source, stats, st);
}

static int qm__direct_acquire(void *ctx, uint32_t layer, const uint32_t *experts, size_t n,
                              qm_expert_weights *weights, size_t *n_ready, qm_status *st)
{
    const qm_bank *bank = ctx;
    const qm_layer_view *lv = qm_bank_layer(bank, layer);
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    *n_ready = 0;
    if (!lv)
        return qm_status_set(st, QM_EINVAL, "layer %u out of range", layer);
    for (size_t i = 0; i < n; i++) {
        if (experts[i] >= cfg->experts)
            return qm_status_set(st, QM_EINVAL, "expert %u out of range", experts[i]);
        for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
            const qm_tensor_view *tv = &lv->t[t];
            weights[i].ptr[t] =
                tv->present ? (const uint8_t *)tv->data +
                                  experts[i] * qm__expert_slice(tv, cfg->experts)
                            : NULL;
        }
    }
    *n_ready = n; /* everything is mapped: one wave */
    return 0;
}

static void qm__direct_release(void *ctx, uint32_t layer, const uint32_t *experts, size_t n)
{
    (void)ctx;
    (void)layer;
    (void)experts;
    (void)n;
}

void qm_expert_source_direct(const qm_bank *bank, qm_expert_source *out)
{
    out->ctx = (void *)bank;
    out->acquire = qm__direct_acquire;
    out->release = qm__direct_release;
}
