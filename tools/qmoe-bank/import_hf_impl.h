/* import_hf_impl.h - the pieces of `qmoe-bank import hf` shared by its files:
 * import_hf.c (the command), import_hf_plan.c (config.json and the checks
 * of every tensor against it), import_hf_layer.c (converting one layer). */
#ifndef QMOE_IMPORT_HF_IMPL_H
#define QMOE_IMPORT_HF_IMPL_H

#include <stdint.h>

#include "import_elements.h"
#include "import_families.h"
#include "qm_bank_writer.h"
#include "import_hf_source.h"

/* Source tensors of one expert (per-expert families) or one layer (GPT-OSS). */
enum {
    QM__HF_GATE,
    QM__HF_UP,
    QM__HF_DOWN,
    QM__HF_GATE_SINV,
    QM__HF_UP_SINV,
    QM__HF_DOWN_SINV,
    QM__HF_PER_EXPERT
};
enum {
    QM__HF_FUSED_GATE_UP,
    QM__HF_FUSED_GATE_UP_SCALES,
    QM__HF_FUSED_GATE_UP_BIAS,
    QM__HF_FUSED_DOWN,
    QM__HF_FUSED_DOWN_SCALES,
    QM__HF_FUSED_DOWN_BIAS,
    QM__HF_FUSED_COUNT
};

typedef struct qm__hf_opts {
    const char *dir, *out;
    unsigned bits, block_size;
    int bits_set, block_set, scales_set, resume, quiet;
    int mxfp4_int8; /* --mxfp4 int8: MXFP4 onto int8 block 32, not the e2m1 code book */
    qm_dtype scale_dtype;
} qm__hf_opts;

typedef struct qm__hf_import {
    qm__hf_opts o;
    const qm_family *fam;
    qm__hf_checkpoint *ck;
    uint32_t model_layers, n_moe, E, H, I, k;
    uint32_t mtp_layers; /* DeepSeek's num_nextn_predict_layers, after the model's layers */
    uint32_t *layer_map; /* [n_moe] */
    int mxfp4, fp8, mxfp4_exact;
    qm_codebook codebook; /* e2m1: MXFP4's own codes (--mxfp4 e2m1, no --bits/--block-size) */
    uint32_t fp8_bn, fp8_bk;
    float alpha, beta, limit;
    /* routing */
    const char *score;
    int normalize;
    double scale;
    uint32_t groups, topk_groups;
    const char *group_score;
    /* resolved sources */
    const qm__hf_tensor **expert_src;                   /* [n_moe][E][QM__HF_PER_EXPERT] */
    const qm__hf_tensor **layer_src;                    /* [n_moe][QM__HF_FUSED_COUNT] (GPT-OSS) */
    const qm__hf_tensor **router_w, **router_b, **corr; /* [n_moe] */
    uint64_t *layer_bytes;                              /* source bytes per bank layer */
    size_t consumed;
} qm__hf_import;

typedef struct qm__hf_buffers {
    float *row, *mat; /* one row; one transposed matrix (GPT-OSS bf16) */
    uint8_t *packed[2];
    void *scales[2];
    float *bias;
} qm__hf_buffers;

/* Reads config.json: family, sizes, which layers have experts, routing,
 * quantised source formats. Errors name the key (QM_EINVALID_MODEL,
 * QM_EUNSUPPORTED). */
int qm__hf_read_config(qm__hf_import *im, qm_status *st);
/* Finds and checks every tensor the import reads (names, dtypes, shapes)
 * and that the config's dense layers, expert and layer counts agree with
 * the tensors present; fills the source tables and layer_bytes. */
int qm__hf_resolve(qm__hf_import *im, qm_status *st);
/* Converts bank layer li and hands its tensors to the writer; *max_err
 * grows to the largest matrix error seen. */
int qm__hf_convert_layer(qm__hf_import *im, qm_bank_writer *w, uint32_t li, qm__hf_buffers *b,
                         double *max_err, qm_status *st);

/* `import hf` with argv as the command's (argv[0] = "hf"), over ck when it is
 * not NULL (an in-memory checkpoint: DIR is then only a name for messages);
 * ck is closed whatever the outcome. Returns the exit status. */
int qm__hf_run(qm__hf_checkpoint *ck, int argc, char **argv);

#endif
