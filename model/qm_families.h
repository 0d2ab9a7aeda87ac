/* qm_families.h - the MoE families whose experts banks hold: one
 * descriptor each, read by qmoe-bank's importers (`import hf`: tensor
 * names, which layers have experts, routing from config.json, source
 * formats; `import gguf`: the architecture name and llama.cpp's defaults),
 * by the daemon (daemon.status lists the families it serves, which the
 * engines' adapters ask instead of keeping lists of their own), and by
 * every help text and "supported" list, generated from the table. The
 * tests walk it. A new family is a row here and its test fixture. */
#ifndef QM_FAMILIES_H
#define QM_FAMILIES_H

#include <stddef.h>
#include <stdint.h>

/* Flags of a family. */
enum {
    /* HF experts as one input-major tensor per layer (experts.gate_up_proj
     * [E, H, 2I], interleaved gate/up columns, experts.down_proj [E, I, H]),
     * or the Hub's MXFP4 *_blocks / *_scales of them, instead of one matrix
     * per expert and projection */
    QM_FAMILY_FUSED_EXPERTS = 1u << 0,
    QM_FAMILY_EXPERT_BIASES = 1u << 1,   /* experts.gate_up_proj_bias, down_proj_bias */
    QM_FAMILY_ROUTER_BIAS = 1u << 2,     /* the router's .bias */
    QM_FAMILY_CORRECTION_BIAS = 1u << 3, /* the router's e_score_correction_bias */
    QM_FAMILY_SPARSE_STEP = 1u << 4,     /* decoder_sparse_step, mlp_only_layers */
    QM_FAMILY_DENSE_PREFIX = 1u << 5,    /* first_k_dense_replace, num_nextn_predict_layers */
    QM_FAMILY_MXFP4 = 1u << 6,           /* quantization_config.quant_method "mxfp4" */
    QM_FAMILY_FP8 = 1u << 7,             /* quant_method "fp8" (weight_scale_inv blocks) */
    QM_FAMILY_OAI_SWIGLU = 1u << 8,      /* SwiGLU alpha/limit (swiglu_alpha, swiglu_limit), beta 1 */
};

/* How a family limits routing to groups of experts. */
typedef enum qm_family_groups {
    QM_FAMILY_GROUPS_NONE = 0,
    QM_FAMILY_GROUPS_BY_TOPK_METHOD, /* topk_method "group_limited_greedy" (n_group, topk_group
                                  required); "greedy", the default, has none */
    QM_FAMILY_GROUPS_ALWAYS,         /* n_group, topk_group, with the family's defaults */
} qm_family_groups;

typedef struct qm_family {
    const char *name; /* HF model_type, and the bank's qmoe.source family */
    /* ---- Hugging Face: names under model.layers.{l}. */
    const char *architecture;     /* architectures[0], when config.json has no model_type */
    const char *moe;              /* the MoE module: "mlp", "block_sparse_moe" */
    const char *gate, *up, *down; /* per-expert projections (not with FUSED_EXPERTS) */
    const char *router;           /* the router under moe: "gate", "router" */
    const char *inter_key;        /* the experts' intermediate size key */
    unsigned flags;
    /* ---- routing from config.json: the key, or NULL for the default as fixed */
    const char *score;         /* qmoe.routing.score: "softmax", "sigmoid" */
    const char *normalize_key; /* renormalise the k weights */
    int normalize_default;
    const char *scale_key; /* scale the final weights */
    double scale_default;
    qm_family_groups groups;
    uint32_t n_group_default, topk_group_default;
    const char *group_score; /* "max", "top2_sum" */
    /* ---- GGUF */
    const char *gguf_arch; /* general.architecture; NULL: no GGUF form */
    int gguf_sigmoid;      /* the family of gguf_arch when its gating is sigmoid (2) */
    int gguf_norm_default; /* llama.cpp's expert_weights_norm when the key is absent */
    /* ---- help */
    const char *formats; /* source formats, for the help and --families */
} qm_family;

/* The table, in the order names are listed. */
extern const qm_family qm_families[];
extern const size_t qm_n_families;

/* By model_type (or, when mt is NULL, by architectures[0]); NULL if none. */
const qm_family *qm_family_for_hf(const char *model_type, const char *architecture);
/* The family of a GGUF general.architecture (sigmoid: the file's gating is
 * sigmoid); NULL if none. */
const qm_family *qm_family_for_gguf(const char *arch, int sigmoid);
/* "mixtral, qwen2_moe, ..." (gguf = 0) or the distinct GGUF architectures
 * "llama, qwen2moe, ..." (gguf = 1), truncated to fit size. */
void qm_family_names(int gguf, char *buf, size_t size);
#endif
