/* import_families.c - the family table (see import_families.h). */
#include "import_families.h"

#include <string.h>

#include "qmoe_bank_tool.h"

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

const qm__family qm__families[] = {
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
     .flags = QM__FAM_SPARSE_STEP,
     QM__SOFTMAX_NORM_TOPK_PROB,
     .gguf_arch = "qwen2moe",
     .gguf_norm_default = 0,
     .formats = FLOAT_FORMATS},
    {.name = "qwen3_moe",
     .architecture = "Qwen3MoeForCausalLM",
     QM__MLP_PROJ_NAMES,
     .inter_key = "moe_intermediate_size",
     .flags = QM__FAM_SPARSE_STEP,
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
     .flags = QM__FAM_DENSE_PREFIX | QM__FAM_FP8,
     QM__SOFTMAX_ROUTING(0),
     .scale_key = "routed_scaling_factor",
     .groups = QM__GROUPS_BY_TOPK_METHOD,
     .group_score = "max",
     .gguf_arch = "deepseek2",
     .gguf_norm_default = 0,
     .formats = FLOAT_FORMATS ", FP8 e4m3 with block scales"},
    {.name = "deepseek_v3",
     .architecture = "DeepseekV3ForCausalLM",
     QM__MLP_PROJ_NAMES,
     .inter_key = "moe_intermediate_size",
     .flags = QM__FAM_DENSE_PREFIX | QM__FAM_FP8 | QM__FAM_CORRECTION_BIAS,
     .score = "sigmoid",
     .normalize_key = "norm_topk_prob",
     .normalize_default = 1,
     .scale_key = "routed_scaling_factor",
     .scale_default = 2.5,
     .groups = QM__GROUPS_ALWAYS,
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
     .flags = QM__FAM_FUSED_EXPERTS | QM__FAM_EXPERT_BIASES | QM__FAM_ROUTER_BIAS | QM__FAM_MXFP4 |
              QM__FAM_OAI_SWIGLU,
     QM__SOFTMAX_ROUTING(1),
     .gguf_arch = "gpt-oss",
     .gguf_norm_default = 1,
     .formats = "bf16, f32, MXFP4 (the Hub's blocks/scales)"},
};
const size_t qm__n_families = sizeof qm__families / sizeof qm__families[0];

const qm__family *qm__family_for_hf(const char *model_type, const char *architecture)
{
    for (size_t i = 0; i < qm__n_families; i++)
        if (model_type ? strcmp(model_type, qm__families[i].name) == 0
                       : architecture && strcmp(architecture, qm__families[i].architecture) == 0)
            return &qm__families[i];
    return NULL;
}

const qm__family *qm__family_for_gguf(const char *arch, int sigmoid)
{
    const qm__family *any = NULL;
    for (size_t i = 0; i < qm__n_families; i++) {
        const qm__family *f = &qm__families[i];
        if (!f->gguf_arch || strcmp(f->gguf_arch, arch) != 0) continue;
        if (f->gguf_sigmoid == (sigmoid != 0)) return f;
        if (!any) any = f;
    }
    return any;
}

void qm__family_names(int gguf, char *buf, size_t size)
{
    size_t at = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < qm__n_families && at < size; i++) {
        const char *n = gguf ? qm__families[i].gguf_arch : qm__families[i].name;
        int seen = !n;
        for (size_t j = 0; j < i && !seen; j++)
            seen = gguf && qm__families[j].gguf_arch && strcmp(qm__families[j].gguf_arch, n) == 0;
        if (seen) continue;
        at += (size_t)snprintf(buf + at, size - at, "%s%s", at ? ", " : "", n);
    }
}

void qm__family_help(FILE *f, int gguf)
{
    for (size_t i = 0; i < qm__n_families; i++) {
        const qm__family *m = &qm__families[i];
        if (gguf && m->gguf_arch)
            fprintf(f, "  %-12s %s%s\n", m->gguf_arch, m->name,
                    m->gguf_sigmoid ? " (sigmoid gating)" : "");
        else if (!gguf)
            fprintf(f, "  %-12s %s\n", m->name, m->formats);
    }
}

/* The flags' names in --families, in the order of the enum. */
static const struct {
    const char *name;
    unsigned flag;
} flag_names[] = {
    {"fused_experts", QM__FAM_FUSED_EXPERTS},
    {"expert_biases", QM__FAM_EXPERT_BIASES},
    {"router_bias", QM__FAM_ROUTER_BIAS},
    {"correction_bias", QM__FAM_CORRECTION_BIAS},
    {"sparse_step", QM__FAM_SPARSE_STEP},
    {"dense_prefix", QM__FAM_DENSE_PREFIX},
    {"mxfp4", QM__FAM_MXFP4},
    {"fp8", QM__FAM_FP8},
    {"oai_swiglu", QM__FAM_OAI_SWIGLU},
};

static void json_flag(FILE *f, const char *name, unsigned on, int first)
{
    fprintf(f, "%s", first ? "" : ", ");
    qm__json_string(f, name);
    fprintf(f, ": %s", on ? "true" : "false");
}

static void json_str(FILE *f, const char *key, const char *v)
{
    fprintf(f, ", ");
    qm__json_string(f, key);
    fprintf(f, ": ");
    if (v)
        qm__json_string(f, v);
    else
        fprintf(f, "null");
}

void qm__families_json(FILE *f)
{
    static const char *const groups[] = {"none", "by_topk_method", "always"};
    fprintf(f, "[");
    for (size_t i = 0; i < qm__n_families; i++) {
        const qm__family *m = &qm__families[i];
        fprintf(f, "%s\n  {\"name\": ", i ? "," : "");
        qm__json_string(f, m->name);
        fprintf(f, ", \"hf\": {\"architecture\": ");
        qm__json_string(f, m->architecture);
        json_str(f, "moe", m->moe);
        json_str(f, "gate", m->gate);
        json_str(f, "up", m->up);
        json_str(f, "down", m->down);
        json_str(f, "router", m->router);
        json_str(f, "inter_key", m->inter_key);
        fprintf(f, ", \"flags\": {");
        for (size_t b = 0; b < sizeof flag_names / sizeof flag_names[0]; b++)
            json_flag(f, flag_names[b].name, m->flags & flag_names[b].flag, b == 0);
        fprintf(f, "}}, \"routing\": {\"score\": ");
        qm__json_string(f, m->score);
        json_str(f, "normalize_key", m->normalize_key);
        fprintf(f, ", \"normalize_default\": %d", m->normalize_default);
        json_str(f, "scale_key", m->scale_key);
        fprintf(f,
                ", \"scale_default\": %.9g, \"groups\": \"%s\", \"n_group_default\": %u, "
                "\"topk_group_default\": %u",
                m->scale_default, groups[m->groups], m->n_group_default, m->topk_group_default);
        json_str(f, "group_score", m->group_score);
        fprintf(f, "}, \"gguf\": ");
        if (m->gguf_arch) {
            fprintf(f, "{\"arch\": ");
            qm__json_string(f, m->gguf_arch);
            fprintf(f, ", \"sigmoid\": %s, \"norm_default\": %s}",
                    m->gguf_sigmoid ? "true" : "false", m->gguf_norm_default ? "true" : "false");
        } else {
            fprintf(f, "null");
        }
        json_str(f, "formats", m->formats);
        fprintf(f, "}");
    }
    fprintf(f, "\n]\n");
}
