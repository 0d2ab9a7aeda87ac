/* qm_families.c - the family table (qm_families.h). */
#include "qm_families.h"

#include <stdio.h>
#include <string.h>

#define FLOAT_FORMATS "bf16, f16, f32"
/* The experts' tensor names of the families built on transformers'
 * Qwen2-MoE-style MLP (mlp.experts.N.{gate,up,down}_proj, router mlp.gate). */
#define QM__MLP_PROJ_NAMES                                                                         \
    .moe = "mlp", .gate = "gate_proj", .up = "up_proj", .down = "down_proj", .router = "gate"

/* Softmax routing whose k weights are not scaled; norm: whether they are
 * renormalised when the family reads no key for it. */
#define QM__SOFTMAX_ROUTING(norm)                                                                  \
    .score = "softmax", .normalize_default = (norm), .scale_default = 1.0
/* ... renormalised as config.json's norm_topk_prob says (default: not). */
#define QM__SOFTMAX_NORM_TOPK_PROB QM__SOFTMAX_ROUTING(0), .normalize_key = "norm_topk_prob"

const qm_family qm_families[] = {
    {.name = "mixtral",
     .architecture = "MixtralForCausalLM",
     .moe = "block_sparse_moe",
     .gate = "w1",
     .up = "w3",
     .down = "w2",
     .router = "gate",
     .inter_key = "intermediate_size",
     QM__SOFTMAX_ROUTING(1),
     .gguf_arch = "llama",
     .gguf_norm_default = 1,
     .formats = FLOAT_FORMATS},
    {.name = "qwen2_moe",
     .architecture = "Qwen2MoeForCausalLM",
     QM__MLP_PROJ_NAMES,
     .inter_key = "moe_intermediate_size",
     .flags = QM_FAMILY_SPARSE_STEP,
     QM__SOFTMAX_NORM_TOPK_PROB,
     .gguf_arch = "qwen2moe",
     .gguf_norm_default = 0,
     .formats = FLOAT_FORMATS},
    {.name = "qwen3_moe",
     .architecture = "Qwen3MoeForCausalLM",
     QM__MLP_PROJ_NAMES,
     .inter_key = "moe_intermediate_size",
     .flags = QM_FAMILY_SPARSE_STEP,
     QM__SOFTMAX_NORM_TOPK_PROB,
     .gguf_arch = "qwen3moe",
     .gguf_norm_default = 1,
     .formats = FLOAT_FORMATS},
    {.name = "olmoe",
     .architecture = "OlmoeForCausalLM",
     QM__MLP_PROJ_NAMES,
     .inter_key = "intermediate_size",
     QM__SOFTMAX_NORM_TOPK_PROB,
     .gguf_arch = "olmoe",
     .gguf_norm_default = 0,
     .formats = FLOAT_FORMATS},
    /* transformers' DeepseekV2 router never renormalises the k weights */
    {.name = "deepseek_v2",
     .architecture = "DeepseekV2ForCausalLM",
     QM__MLP_PROJ_NAMES,
     .inter_key = "moe_intermediate_size",
     .flags = QM_FAMILY_DENSE_PREFIX | QM_FAMILY_FP8,
     QM__SOFTMAX_ROUTING(0),
     .scale_key = "routed_scaling_factor",
     .groups = QM_FAMILY_GROUPS_BY_TOPK_METHOD,
     .group_score = "max",
     .gguf_arch = "deepseek2",
     .gguf_norm_default = 0,
     .formats = FLOAT_FORMATS ", FP8 e4m3 with block scales"},
    {.name = "deepseek_v3",
     .architecture = "DeepseekV3ForCausalLM",
     QM__MLP_PROJ_NAMES,
     .inter_key = "moe_intermediate_size",
     .flags = QM_FAMILY_DENSE_PREFIX | QM_FAMILY_FP8 | QM_FAMILY_CORRECTION_BIAS,
     .score = "sigmoid",
     .normalize_key = "norm_topk_prob",
     .normalize_default = 1,
     .scale_key = "routed_scaling_factor",
     .scale_default = 2.5,
     .groups = QM_FAMILY_GROUPS_ALWAYS,
     .n_group_default = 8,
     .topk_group_default = 4,
     .group_score = "top2_sum",
     .gguf_arch = "deepseek2",
     .gguf_sigmoid = 1,
     .gguf_norm_default = 0,
     .formats = FLOAT_FORMATS ", FP8 e4m3 with block scales"},
    {.name = "gpt_oss",
     .architecture = "GptOssForCausalLM",
     .moe = "mlp",
     .router = "router",
     .inter_key = "intermediate_size",
     .flags = QM_FAMILY_FUSED_EXPERTS | QM_FAMILY_EXPERT_BIASES | QM_FAMILY_ROUTER_BIAS | QM_FAMILY_MXFP4 |
              QM_FAMILY_OAI_SWIGLU,
     QM__SOFTMAX_ROUTING(1),
     .gguf_arch = "gpt-oss",
     .gguf_norm_default = 1,
     .formats = "bf16, f32, MXFP4 (the Hub's blocks/scales)"},
};
const size_t qm_n_families = sizeof qm_families / sizeof qm_families[0];

const qm_family *qm_family_for_hf(const char *model_type, const char *architecture)
{
    for (size_t i = 0; i < qm_n_families; i++)
        if (model_type ? strcmp(model_type, qm_families[i].name) == 0
                       : architecture && strcmp(architecture, qm_families[i].architecture) == 0)
            return &qm_families[i];
    return NULL;
}

const qm_family *qm_family_for_gguf(const char *arch, int sigmoid)
{
    const qm_family *any = NULL;
    for (size_t i = 0; i < qm_n_families; i++) {
        const qm_family *f = &qm_families[i];
        if (!f->gguf_arch || strcmp(f->gguf_arch, arch) != 0) continue;
        if (f->gguf_sigmoid == (sigmoid != 0)) return f;
        if (!any) any = f;
    }
    return any;
}

void qm_family_names(int gguf, char *buf, size_t size)
{
    size_t at = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < qm_n_families && at < size; i++) {
        const char *n = gguf ? qm_families[i].gguf_arch : qm_families[i].name;
        int seen = !n;
        for (size_t j = 0; j < i && !seen; j++)
            seen = gguf && qm_families[j].gguf_arch && strcmp(qm_families[j].gguf_arch, n) == 0;
        if (seen) continue;
        at += (size_t)snprintf(buf + at, size - at, "%s%s", at ? ", " : "", n);
    }
}
