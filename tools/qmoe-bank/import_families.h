/* import_families.h - the MoE families qmoe-bank imports: one descriptor
 * each, read by `import hf` (tensor names, which layers have experts,
 * routing from config.json, source formats) and `import gguf` (the
 * architecture name and llama.cpp's defaults). Help texts, the "supported"
 * lists of error messages and `qmoe-bank import --families` are generated
 * from the table; the tests walk it. A new family is a row here and its
 * test fixture. */
#ifndef QMOE_IMPORT_FAMILIES_H
#define QMOE_IMPORT_FAMILIES_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Flags of a family. */
enum {
    /* HF experts as one input-major tensor per layer (experts.gate_up_proj
     * [E, H, 2I], interleaved gate/up columns, experts.down_proj [E, I, H]),
     * or the Hub's MXFP4 *_blocks / *_scales of them, instead of one matrix
     * per expert and projection */
    QM__FAM_FUSED_EXPERTS = 1u << 0,
    QM__FAM_EXPERT_BIASES = 1u << 1,   /* experts.gate_up_proj_bias, down_proj_bias */
    QM__FAM_ROUTER_BIAS = 1u << 2,     /* the router's .bias */
    QM__FAM_CORRECTION_BIAS = 1u << 3, /* the router's e_score_correction_bias */
    QM__FAM_SPARSE_STEP = 1u << 4,     /* decoder_sparse_step, mlp_only_layers */
    QM__FAM_DENSE_PREFIX = 1u << 5,    /* first_k_dense_replace, num_nextn_predict_layers */
    QM__FAM_MXFP4 = 1u << 6,           /* quantization_config.quant_method "mxfp4" */
    QM__FAM_FP8 = 1u << 7,             /* quant_method "fp8" (weight_scale_inv blocks) */
    QM__FAM_OAI_SWIGLU = 1u << 8,      /* SwiGLU alpha/limit (swiglu_alpha, swiglu_limit), beta 1 */
};

/* How a family limits routing to groups of experts. */
typedef enum qm__family_groups {
    QM__GROUPS_NONE = 0,
    QM__GROUPS_BY_TOPK_METHOD, /* topk_method "group_limited_greedy" (n_group, topk_group
                                  required); "greedy", the default, has none */
    QM__GROUPS_ALWAYS,         /* n_group, topk_group, with the family's defaults */
} qm__family_groups;

typedef struct qm__family {
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
    qm__family_groups groups;
    uint32_t n_group_default, topk_group_default;
    const char *group_score; /* "max", "top2_sum" */
    /* ---- GGUF */
    const char *gguf_arch; /* general.architecture; NULL: no GGUF form */
    int gguf_sigmoid;      /* the family of gguf_arch when its gating is sigmoid (2) */
    int gguf_norm_default; /* llama.cpp's expert_weights_norm when the key is absent */
    /* ---- help */
    const char *formats; /* source formats, for the help and --families */
} qm__family;

/* The table, in the order names are listed. */
extern const qm__family qm__families[];
extern const size_t qm__n_families;

/* By model_type (or, when mt is NULL, by architectures[0]); NULL if none. */
const qm__family *qm__family_for_hf(const char *model_type, const char *architecture);
/* The family of a GGUF general.architecture (sigmoid: the file's gating is
 * sigmoid); NULL if none. */
const qm__family *qm__family_for_gguf(const char *arch, int sigmoid);
/* "mixtral, qwen2_moe, ..." (gguf = 0) or the distinct GGUF architectures
 * "llama, qwen2moe, ..." (gguf = 1), truncated to fit size. */
void qm__family_names(int gguf, char *buf, size_t size);
/* The help's list of families: one line per family, indented. */
void qm__family_help(FILE *f, int gguf);
/* The table as JSON (`qmoe-bank import --families`), one object per family. */
void qm__families_json(FILE *f);

#endif
