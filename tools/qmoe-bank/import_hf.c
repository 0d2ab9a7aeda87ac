/* import_hf.c - `qmoe-bank import hf`: a Hugging Face MoE checkpoint's routed
 * experts into a bank.
 *
 * Every shape is known from config.json, so the whole checkpoint is checked
 * (names, dtypes, shapes, layer and expert counts) before a byte is written;
 * then the bank header goes out first and the layers are streamed one at a
 * time from the mapped shards (import_common.h). Float sources are
 * requantised by round to nearest; GPT-OSS's MXFP4 maps onto int8 block 32
 * bit for bit. Tensor names and layouts per family: docs/IMPORT.md. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "import_common.h"
#include "import_hf_source.h"
#include "qm_alloc.h"
#include "qmoe_bank_tool.h"

void qmb_help_import_hf(FILE *f)
{
    fputs("usage: qmoe-bank import hf DIR --out FILE [--bits 4|8] [--block-size N]\n"
          "                         [--scales f32|f16|bf16] [--resume] [--quiet]\n"
          "\n"
          "Imports the routed experts of a Hugging Face checkpoint (config.json plus one\n"
          "*.safetensors, or shards listed in model.safetensors.index.json) into a bank.\n"
          "Families: mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3 (FP8\n"
          "block-scaled weights too), gpt_oss (bf16, or the Hub's MXFP4 blocks/scales).\n"
          "bf16/f16/f32/FP8 weights are requantised by round to nearest, symmetric, to\n"
          "--bits (default 4) with one scale per --block-size columns (default 32; 0 = one\n"
          "per row) stored as --scales (default f32); the error is measured and recorded\n"
          "in qmoe.source. GPT-OSS MXFP4 defaults to int8 block 32 with f32 scales, which\n"
          "holds it bit for bit (exact). Routers, router biases, DeepSeek-V3's\n"
          "e_score_correction_bias and GPT-OSS's expert biases are copied as f32, and\n"
          "the family's routing rule is written as qmoe.routing.* keys. Shared experts,\n"
          "dense layers, attention and embeddings stay with the engine: the import says\n"
          "what it left out. Memory stays at about one layer: shards are mapped and each\n"
          "layer's pages are dropped after it is written. The bank is written as\n"
          "FILE.partial and renamed when complete; after a crash or Ctrl-C, --resume\n"
          "continues at the first layer not yet written (the partial file's header must\n"
          "match these arguments and this checkpoint). A progress line is shown on a\n"
          "terminal unless --quiet.\n"
          "exit status: 0 ok, 1 I/O failure, 2 bad usage or a checkpoint that cannot be\n"
          "imported (the message names the file, tensor or key).\n",
          f);
}

/* ---- families ------------------------------------------------------------ */

typedef enum family_id {
    FAM_MIXTRAL,
    FAM_QWEN2_MOE,
    FAM_QWEN3_MOE,
    FAM_OLMOE,
    FAM_DEEPSEEK_V2,
    FAM_DEEPSEEK_V3,
    FAM_GPT_OSS,
} family_id;

typedef struct family {
    const char *model_type, *architecture;
    family_id id;
    const char *moe;              /* module under model.layers.N */
    const char *gate, *up, *down; /* per-expert projections (NULL: GPT-OSS's fused tensors) */
    const char *router;
    const char *inter_key;
} family;

static const family families[] = {
    {"mixtral", "MixtralForCausalLM", FAM_MIXTRAL, "block_sparse_moe", "w1", "w3", "w2", "gate",
     "intermediate_size"},
    {"qwen2_moe", "Qwen2MoeForCausalLM", FAM_QWEN2_MOE, "mlp", "gate_proj", "up_proj", "down_proj",
     "gate", "moe_intermediate_size"},
    {"qwen3_moe", "Qwen3MoeForCausalLM", FAM_QWEN3_MOE, "mlp", "gate_proj", "up_proj", "down_proj",
     "gate", "moe_intermediate_size"},
    {"olmoe", "OlmoeForCausalLM", FAM_OLMOE, "mlp", "gate_proj", "up_proj", "down_proj", "gate",
     "intermediate_size"},
    {"deepseek_v2", "DeepseekV2ForCausalLM", FAM_DEEPSEEK_V2, "mlp", "gate_proj", "up_proj",
     "down_proj", "gate", "moe_intermediate_size"},
    {"deepseek_v3", "DeepseekV3ForCausalLM", FAM_DEEPSEEK_V3, "mlp", "gate_proj", "up_proj",
     "down_proj", "gate", "moe_intermediate_size"},
    {"gpt_oss", "GptOssForCausalLM", FAM_GPT_OSS, "mlp", NULL, NULL, NULL, "router",
     "intermediate_size"},
};
#define N_FAMILIES (sizeof families / sizeof families[0])

/* Source tensors of one expert (per-expert families) or one layer (GPT-OSS). */
enum { S_GATE, S_UP, S_DOWN, S_GATE_SINV, S_UP_SINV, S_DOWN_SINV, S_PER_EXPERT };
enum { G_GATE_UP, G_GATE_UP_SCALES, G_GATE_UP_BIAS, G_DOWN, G_DOWN_SCALES, G_DOWN_BIAS, G_COUNT };

typedef struct hf_opts {
    const char *dir, *out;
    unsigned bits, block_size;
    int bits_set, block_set, scales_set, resume, quiet;
    qm_dtype scale_dtype;
} hf_opts;

typedef struct hf_import {
    hf_opts o;
    const family *fam;
    qmi_hf_checkpoint *ck;
    uint32_t model_layers, n_moe, E, H, I, k;
    uint32_t *layer_map; /* [n_moe] */
    int mxfp4, fp8, mxfp4_exact;
    uint32_t fp8_bn, fp8_bk;
    float alpha, beta, limit;
    /* routing */
    const char *score;
    int normalize;
    double scale;
    uint32_t groups, topk_groups;
    const char *group_score;
    /* resolved sources */
    const qmi_hf_tensor **expert_src; /* [n_moe][E][S_PER_EXPERT] */
    const qmi_hf_tensor **layer_src;  /* [n_moe][G_COUNT] (GPT-OSS) */
    const qmi_hf_tensor **router_w, **router_b, **corr; /* [n_moe] */
    uint64_t *layer_bytes;                             /* source bytes per bank layer */
    size_t consumed;
} hf_import;

/* Bad input: exit 2. Anything else (I/O, memory): exit 1. */
static int exit_for(int rc)
{
    return rc == QM_EIO || rc == QM_ENOMEM || rc == QM_EINTERNAL ? QMB_FAIL : QMB_USAGE;
}

/* ---- config.json --------------------------------------------------------- */

static int cfg_u32(hf_import *im, const char *key, int required, uint32_t dflt, uint32_t *out,
                   qm_status *st)
{
    double v;
    int rc = qm_hf_json_number(qmi_hf_config(im->ck), key, &v, st);
    if (rc == QM_ENOT_FOUND) {
        if (required)
            return qm_status_set(st, QM_EINVALID_MODEL,
                                 "config.json: key \"%s\" is missing (a %s config needs it)", key,
                                 im->fam->model_type);
        *out = dflt;
        return 0;
    }
    if (rc)
        return QM_EINVALID_MODEL;
    if (!(v >= 0 && v <= 16777216.0) || v != floor(v))
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "config.json: key \"%s\" is %g, expected an integer in [0, 2^24]", key,
                             v);
    *out = (uint32_t)v;
    return 0;
}

static int cfg_num(hf_import *im, const char *key, double dflt, double *out, qm_status *st)
{
    int rc = qm_hf_json_number(qmi_hf_config(im->ck), key, out, st);
    if (rc == QM_ENOT_FOUND) {
        *out = dflt;
        return 0;
    }
    return rc ? QM_EINVALID_MODEL : 0;
}

static int cfg_bool(hf_import *im, const char *key, int dflt, int *out, qm_status *st)
{
    int rc = qm_hf_json_bool(qmi_hf_config(im->ck), key, out, st);
    if (rc == QM_ENOT_FOUND) {
        *out = dflt;
        return 0;
    }
    return rc ? QM_EINVALID_MODEL : 0;
}

static int find_family(hf_import *im, qm_status *st)
{
    const qm_hf_json *c = qmi_hf_config(im->ck);
    const char *mt = NULL, *arch = NULL;
    int rc = qm_hf_json_string(c, "model_type", &mt, st);
    if (rc && rc != QM_ENOT_FOUND)
        return QM_EINVALID_MODEL;
    rc = qm_hf_json_array_string(c, "architectures", 0, &arch, st);
    if (rc && rc != QM_ENOT_FOUND)
        return QM_EINVALID_MODEL;
    for (size_t i = 0; i < N_FAMILIES; i++)
        if ((mt && strcmp(mt, families[i].model_type) == 0) ||
            (!mt && arch && strcmp(arch, families[i].architecture) == 0)) {
            im->fam = &families[i];
            return 0;
        }
    return qm_status_set(st, QM_EUNSUPPORTED,
                         "config.json: model_type \"%.60s\" (architectures[0] \"%.60s\") is not a "
                         "supported MoE family; supported: mixtral, qwen2_moe, qwen3_moe, olmoe, "
                         "deepseek_v2, deepseek_v3, gpt_oss",
                         mt ? mt : "(none)", arch ? arch : "(none)");
}

/* Which model layers have routed experts, per the family's rule. */
static int moe_layers(hf_import *im, qm_status *st)
{
    const qm_hf_json *c = qmi_hf_config(im->ck);
    uint32_t step = 1, first_dense = 0;
    int rc;
    if (im->fam->id == FAM_QWEN2_MOE || im->fam->id == FAM_QWEN3_MOE) {
        if ((rc = cfg_u32(im, "decoder_sparse_step", 0, 1, &step, st)) != 0)
            return rc;
        if (step == 0)
            return qm_status_set(st, QM_EINVALID_MODEL,
                                 "config.json: decoder_sparse_step is 0, expected >= 1");
    }
    if (im->fam->id == FAM_DEEPSEEK_V2 || im->fam->id == FAM_DEEPSEEK_V3)
        if ((rc = cfg_u32(im, "first_k_dense_replace", 0, 0, &first_dense, st)) != 0)
            return rc;
    size_t n_only = 0;
    rc = qm_hf_json_array_len(c, "mlp_only_layers", &n_only, st);
    if (rc && rc != QM_ENOT_FOUND)
        return QM_EINVALID_MODEL;
    if (rc == QM_ENOT_FOUND || (im->fam->id != FAM_QWEN2_MOE && im->fam->id != FAM_QWEN3_MOE))
        n_only = 0;
    im->layer_map = qm_calloc(im->model_layers ? im->model_layers : 1, sizeof *im->layer_map);
    if (!im->layer_map)
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    for (uint32_t l = 0; l < im->model_layers; l++) {
        int moe = l >= first_dense && (l + 1) % step == 0;
        for (size_t i = 0; i < n_only && moe; i++) {
            double v;
            if (qm_hf_json_array_number(c, "mlp_only_layers", i, &v, st) != 0)
                return qm_status_set(st, QM_EINVALID_MODEL,
                                     "config.json: mlp_only_layers must be a list of integers");
            if (v == (double)l)
                moe = 0;
        }
        if (moe)
            im->layer_map[im->n_moe++] = l;
    }
    if (!im->n_moe)
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "config.json: no layer of the %u has routed experts "
                             "(first_k_dense_replace / decoder_sparse_step / mlp_only_layers)",
                             im->model_layers);
    return 0;
}

static int read_config(hf_import *im, qm_status *st)
{
    int rc;
    if ((rc = find_family(im, st)) != 0)
        return rc;
    if ((rc = cfg_u32(im, "num_hidden_layers", 1, 0, &im->model_layers, st)) != 0 ||
        (rc = cfg_u32(im, "hidden_size", 1, 0, &im->H, st)) != 0 ||
        (rc = cfg_u32(im, im->fam->inter_key, 1, 0, &im->I, st)) != 0 ||
        (rc = cfg_u32(im, "num_experts_per_tok", 1, 0, &im->k, st)) != 0)
        return rc;
    static const char *expert_keys[] = {"num_local_experts", "num_experts", "n_routed_experts"};
    im->E = 0;
    for (size_t i = 0; i < 3 && !im->E; i++)
        if ((rc = cfg_u32(im, expert_keys[i], 0, 0, &im->E, st)) != 0)
            return rc;
    if (!im->E)
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "config.json: no expert count (num_local_experts, num_experts or "
                             "n_routed_experts)");
    if (!im->H || !im->I || !im->model_layers)
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "config.json: hidden_size, %s and num_hidden_layers must be >= 1",
                             im->fam->inter_key);
    if (!im->k || im->k > im->E)
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "config.json: num_experts_per_tok is %u, expected 1..%u (the expert "
                             "count)",
                             im->k, im->E);
    if (im->E > 65536 || im->model_layers > 65536 || im->H > (1u << 20) || im->I > (1u << 20))
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "config.json: sizes beyond this importer (experts/layers <= 65536, "
                             "hidden/intermediate <= 2^20)");
    if ((rc = moe_layers(im, st)) != 0)
        return rc;

    im->alpha = 1.0f;
    im->beta = 0.0f;
    im->limit = INFINITY;
    im->score = "softmax";
    im->normalize = 1;
    im->scale = 1.0;
    const qm_hf_json *c = qmi_hf_config(im->ck);
    switch (im->fam->id) {
    case FAM_MIXTRAL:
        break;
    case FAM_QWEN2_MOE:
    case FAM_QWEN3_MOE:
    case FAM_OLMOE:
        if ((rc = cfg_bool(im, "norm_topk_prob", 0, &im->normalize, st)) != 0)
            return rc;
        break;
    case FAM_DEEPSEEK_V2: {
        const char *method = "greedy";
        rc = qm_hf_json_string(c, "topk_method", &method, st);
        if (rc && rc != QM_ENOT_FOUND)
            return QM_EINVALID_MODEL;
        im->normalize = 0; /* transformers' DeepseekV2TopkRouter never renormalises */
        if ((rc = cfg_num(im, "routed_scaling_factor", 1.0, &im->scale, st)) != 0)
            return rc;
        if (strcmp(method, "group_limited_greedy") == 0) {
            if ((rc = cfg_u32(im, "n_group", 1, 0, &im->groups, st)) != 0 ||
                (rc = cfg_u32(im, "topk_group", 1, 0, &im->topk_groups, st)) != 0)
                return rc;
            im->group_score = "max";
        } else if (strcmp(method, "greedy") != 0) {
            return qm_status_set(st, QM_EUNSUPPORTED,
                                 "config.json: topk_method \"%.40s\" is not supported for "
                                 "deepseek_v2 (greedy, group_limited_greedy)",
                                 method);
        }
        break;
    }
    case FAM_DEEPSEEK_V3:
        im->score = "sigmoid";
        if ((rc = cfg_bool(im, "norm_topk_prob", 1, &im->normalize, st)) != 0 ||
            (rc = cfg_num(im, "routed_scaling_factor", 2.5, &im->scale, st)) != 0 ||
            (rc = cfg_u32(im, "n_group", 0, 8, &im->groups, st)) != 0 ||
            (rc = cfg_u32(im, "topk_group", 0, 4, &im->topk_groups, st)) != 0)
            return rc;
        im->group_score = "top2_sum";
        break;
    case FAM_GPT_OSS: {
        double a, lim;
        if ((rc = cfg_num(im, "swiglu_alpha", 1.702, &a, st)) != 0 ||
            (rc = cfg_num(im, "swiglu_limit", 7.0, &lim, st)) != 0)
            return rc;
        im->alpha = (float)a;
        im->beta = 1.0f;
        im->limit = (float)lim;
        break;
    }
    }
    if (im->groups) {
        if (im->groups > im->E || im->E % im->groups || !im->topk_groups ||
            im->topk_groups > im->groups)
            return qm_status_set(st, QM_EINVALID_MODEL,
                                 "config.json: n_group %u / topk_group %u do not divide %u experts",
                                 im->groups, im->topk_groups, im->E);
        if (im->groups == 1)
            im->groups = im->topk_groups = 0, im->group_score = NULL;
    }
    if (!(im->scale > 0) || !isfinite(im->scale))
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "config.json: routed_scaling_factor %g, expected > 0", im->scale);
    /* Quantised sources. */
    const char *qm = NULL;
    rc = qm_hf_json_string(c, "quantization_config/quant_method", &qm, st);
    if (rc && rc != QM_ENOT_FOUND)
        return QM_EINVALID_MODEL;
    if (qm && strcmp(qm, "mxfp4") == 0 && im->fam->id == FAM_GPT_OSS) {
        im->mxfp4 = 1;
    } else if (qm && strcmp(qm, "fp8") == 0 &&
               (im->fam->id == FAM_DEEPSEEK_V3 || im->fam->id == FAM_DEEPSEEK_V2)) {
        im->fp8 = 1;
        double bn = 128, bk = 128;
        size_t n = 0;
        if (qm_hf_json_array_len(c, "quantization_config/weight_block_size", &n, st) == 0) {
            if (n != 2 ||
                qm_hf_json_array_number(c, "quantization_config/weight_block_size", 0, &bn, st) ||
                qm_hf_json_array_number(c, "quantization_config/weight_block_size", 1, &bk, st) ||
                !(bn >= 1 && bn <= 65536 && bk >= 1 && bk <= 65536))
                return qm_status_set(st, QM_EINVALID_MODEL,
                                     "config.json: quantization_config.weight_block_size must be "
                                     "two positive integers");
        }
        im->fp8_bn = (uint32_t)bn;
        im->fp8_bk = (uint32_t)bk;
    } else if (qm) {
        return qm_status_set(st, QM_EUNSUPPORTED,
                             "config.json: quantization_config.quant_method \"%.40s\" is not "
                             "supported for %s (supported: mxfp4 for gpt_oss, fp8 for deepseek)",
                             qm, im->fam->model_type);
    }
    return 0;
}

/* ---- checking the tensors against the config ----------------------------- */

#define ELEM_FLOAT ((1u << QMI_ELEM_F32) | (1u << QMI_ELEM_F16) | (1u << QMI_ELEM_BF16))

static void fmt_shape(char *buf, size_t n, const uint64_t *shape, uint32_t nd)
{
    size_t at = (size_t)snprintf(buf, n, "[");
    for (uint32_t i = 0; i < nd && at < n; i++)
        at += (size_t)snprintf(buf + at, n - at, "%s%llu", i ? ", " : "",
                               (unsigned long long)shape[i]);
    if (at < n)
        snprintf(buf + at, n - at, "]");
}

/* The tensor `name`, of one of the element types in `elems` and shape `want`
 * (why says where the shape comes from), or an error naming it. */
static int expect(hf_import *im, const char *name, unsigned elems, uint32_t nd,
                  const uint64_t *want, const char *why, const qmi_hf_tensor **out, qm_status *st)
{
    const qmi_hf_tensor *t = qmi_hf_find(im->ck, name);
    if (!t) {
        const char *f = qmi_hf_index_file(im->ck, name);
        if (f)
            return qm_status_set(st, QM_EINVALID_MODEL,
                                 "%.80s: has no tensor %.120s, though model.safetensors.index.json "
                                 "puts it there",
                                 f, name);
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "checkpoint has no tensor %.120s (a %s checkpoint needs it)", name,
                             im->fam->model_type);
    }
    const char *file = qmi_hf_shard_name(im->ck, t->shard);
    if (!(elems & (1u << t->elem))) {
        char allowed[64] = "";
        for (int e = 0; e < QMI_ELEM_OTHER; e++)
            if (elems & (1u << e))
                snprintf(allowed + strlen(allowed), sizeof allowed - strlen(allowed), "%s%s",
                         allowed[0] ? "/" : "", qmi_elem_name((qmi_elem)e));
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "%.80s: tensor %.120s has dtype %s, expected %s", file, name,
                             t->dtype, allowed);
    }
    int same = t->ndim == nd;
    for (uint32_t d = 0; same && d < nd; d++)
        same = t->shape[d] == want[d];
    if (!same) {
        char have_s[96], want_s[96];
        fmt_shape(have_s, sizeof have_s, t->shape, t->ndim);
        fmt_shape(want_s, sizeof want_s, want, nd);
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "%.80s: tensor %.120s has shape %s, but config.json (%s) implies %s",
                             file, name, have_s, why, want_s);
    }
    *out = t;
    im->consumed++;
    return 0;
}

static int check_absent(hf_import *im, const char *name, const char *why, qm_status *st)
{
    const qmi_hf_tensor *t = qmi_hf_find(im->ck, name);
    if (!t)
        return 0;
    return qm_status_set(st, QM_EINVALID_MODEL, "%.80s: tensor %.120s contradicts config.json (%s)",
                         qmi_hf_shard_name(im->ck, t->shard), name, why);
}

static int resolve(hf_import *im, qm_status *st)
{
    const family *f = im->fam;
    uint32_t E = im->E, H = im->H, I = im->I;
    size_t nl = im->n_moe;
    im->router_w = qm_calloc(nl, sizeof *im->router_w);
    im->router_b = qm_calloc(nl, sizeof *im->router_b);
    im->corr = qm_calloc(nl, sizeof *im->corr);
    im->layer_bytes = qm_calloc(nl, sizeof *im->layer_bytes);
    if (f->gate)
        im->expert_src = qm_calloc(nl * E * S_PER_EXPERT, sizeof *im->expert_src);
    else
        im->layer_src = qm_calloc(nl * G_COUNT, sizeof *im->layer_src);
    if (!im->router_w || !im->router_b || !im->corr || !im->layer_bytes ||
        (!im->expert_src && !im->layer_src))
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    char name[256], why[160];
    int rc;
    snprintf(why, sizeof why, "hidden_size %u, %s %u, %u experts", H, f->inter_key, I, E);
    for (size_t li = 0; li < nl; li++) {
        uint32_t l = im->layer_map[li];
        uint64_t bytes = 0;
        uint64_t rshape[2] = {E, H};
        snprintf(name, sizeof name, "model.layers.%u.%s.%s.weight", l, f->moe, f->router);
        if ((rc = expect(im, name, ELEM_FLOAT, 2, rshape, why, &im->router_w[li], st)) != 0)
            return rc;
        if (f->id == FAM_GPT_OSS) {
            snprintf(name, sizeof name, "model.layers.%u.mlp.router.bias", l);
            if ((rc = expect(im, name, ELEM_FLOAT, 1, rshape, why, &im->router_b[li], st)) != 0)
                return rc;
        }
        if (f->id == FAM_DEEPSEEK_V3) {
            snprintf(name, sizeof name, "model.layers.%u.mlp.gate.e_score_correction_bias", l);
            if ((rc = expect(im, name, ELEM_FLOAT, 1, rshape, why, &im->corr[li], st)) != 0)
                return rc;
        }
        if (f->gate) {
            const char *proj[3] = {f->gate, f->up, f->down};
            for (uint32_t e = 0; e < E; e++) {
                const qmi_hf_tensor **src = &im->expert_src[(li * E + e) * S_PER_EXPERT];
                for (int p = 0; p < 3; p++) {
                    uint64_t shape[2] = {p == 2 ? H : I, p == 2 ? I : H};
                    snprintf(name, sizeof name, "model.layers.%u.%s.experts.%u.%s.weight", l,
                             f->moe, e, proj[p]);
                    unsigned elems = im->fp8 ? 1u << QMI_ELEM_F8_E4M3 : ELEM_FLOAT;
                    if ((rc = expect(im, name, elems, 2, shape, why, &src[p], st)) != 0)
                        return rc;
                    bytes += src[p]->nbytes;
                    if (im->fp8) {
                        uint64_t sshape[2] = {(shape[0] + im->fp8_bn - 1) / im->fp8_bn,
                                              (shape[1] + im->fp8_bk - 1) / im->fp8_bk};
                        snprintf(name, sizeof name,
                                 "model.layers.%u.%s.experts.%u.%s.weight_scale_inv", l, f->moe,
                                 e, proj[p]);
                        if ((rc = expect(im, name, ELEM_FLOAT, 2, sshape,
                                         "quantization_config.weight_block_size", &src[3 + p],
                                         st)) != 0)
                            return rc;
                        bytes += src[3 + p]->nbytes;
                    }
                }
            }
            snprintf(name, sizeof name, "model.layers.%u.%s.experts.%u.%s.weight", l, f->moe, E,
                     f->gate);
            char ewhy[96];
            snprintf(ewhy, sizeof ewhy, "it says %u experts", E);
            if ((rc = check_absent(im, name, ewhy, st)) != 0)
                return rc;
        } else {
            const qmi_hf_tensor **src = &im->layer_src[li * G_COUNT];
            uint64_t b1[2] = {E, 2ull * I}, b2[2] = {E, H};
            if (im->mxfp4) {
                if (H % 32 || I % 32)
                    return qm_status_set(st, QM_EINVALID_MODEL,
                                         "config.json: MXFP4 needs hidden_size (%u) and "
                                         "intermediate_size (%u) to be multiples of 32",
                                         H, I);
                uint64_t gb[4] = {E, 2ull * I, H / 32, 16}, gs[3] = {E, 2ull * I, H / 32};
                uint64_t db[4] = {E, H, I / 32, 16}, ds[3] = {E, H, I / 32};
                snprintf(name, sizeof name, "model.layers.%u.mlp.experts.gate_up_proj_blocks", l);
                if ((rc = expect(im, name, 1u << QMI_ELEM_U8, 4, gb, why, &src[G_GATE_UP], st)))
                    return rc;
                snprintf(name, sizeof name, "model.layers.%u.mlp.experts.gate_up_proj_scales", l);
                if ((rc = expect(im, name, 1u << QMI_ELEM_U8, 3, gs, why, &src[G_GATE_UP_SCALES],
                                 st)))
                    return rc;
                snprintf(name, sizeof name, "model.layers.%u.mlp.experts.down_proj_blocks", l);
                if ((rc = expect(im, name, 1u << QMI_ELEM_U8, 4, db, why, &src[G_DOWN], st)))
                    return rc;
                snprintf(name, sizeof name, "model.layers.%u.mlp.experts.down_proj_scales", l);
                if ((rc = expect(im, name, 1u << QMI_ELEM_U8, 3, ds, why, &src[G_DOWN_SCALES],
                                 st)))
                    return rc;
                bytes += src[G_GATE_UP_SCALES]->nbytes + src[G_DOWN_SCALES]->nbytes;
            } else {
                uint64_t gu[3] = {E, H, 2ull * I}, dn[3] = {E, I, H};
                snprintf(name, sizeof name, "model.layers.%u.mlp.experts.gate_up_proj", l);
                if ((rc = expect(im, name, ELEM_FLOAT, 3, gu, why, &src[G_GATE_UP], st)))
                    return rc;
                snprintf(name, sizeof name, "model.layers.%u.mlp.experts.down_proj", l);
                if ((rc = expect(im, name, ELEM_FLOAT, 3, dn, why, &src[G_DOWN], st)))
                    return rc;
            }
            bytes += src[G_GATE_UP]->nbytes + src[G_DOWN]->nbytes;
            snprintf(name, sizeof name, "model.layers.%u.mlp.experts.gate_up_proj_bias", l);
            if ((rc = expect(im, name, ELEM_FLOAT, 2, b1, why, &src[G_GATE_UP_BIAS], st)))
                return rc;
            snprintf(name, sizeof name, "model.layers.%u.mlp.experts.down_proj_bias", l);
            if ((rc = expect(im, name, ELEM_FLOAT, 2, b2, why, &src[G_DOWN_BIAS], st)))
                return rc;
        }
        im->layer_bytes[li] = bytes;
    }
    /* Layers the config calls dense, or past num_hidden_layers, must not hold experts. */
    for (uint32_t l = 0, li = 0; l <= im->model_layers; l++) {
        if (li < nl && im->layer_map[li] == l) {
            li++;
            continue;
        }
        if (f->gate)
            snprintf(name, sizeof name, "model.layers.%u.%s.experts.0.%s.weight", l, f->moe,
                     f->gate);
        else
            snprintf(name, sizeof name, "model.layers.%u.mlp.experts.%s", l,
                     im->mxfp4 ? "gate_up_proj_blocks" : "gate_up_proj");
        char lwhy[128];
        if (l == im->model_layers)
            snprintf(lwhy, sizeof lwhy, "num_hidden_layers %u", im->model_layers);
        else
            snprintf(lwhy, sizeof lwhy, "layer %u is dense by its first_k_dense_replace / "
                     "decoder_sparse_step / mlp_only_layers", l);
        if ((rc = check_absent(im, name, lwhy, st)) != 0)
            return rc;
    }
    return 0;
}

/* ---- converting one layer ------------------------------------------------ */

static int row_finite(const float *r, uint64_t n)
{
    float acc = 0;
    for (uint64_t i = 0; i < n; i++)
        acc += r[i] * 0.0f;
    return acc == 0.0f;
}

static int not_finite(hf_import *im, const qmi_hf_tensor *t, qm_status *st)
{
    return qm_status_set(st, QM_EINVALID_MODEL, "%.80s: tensor %.120s holds a NaN or infinity",
                         qmi_hf_shard_name(im->ck, t->shard), t->name);
}

typedef struct buffers {
    float *row, *mat; /* one row; one transposed matrix (GPT-OSS bf16) */
    uint8_t *packed[2];
    void *scales[2];
    float *bias;
} buffers;

/* Row r of a per-expert source matrix [N, K] as f32 (FP8 times its block scale). */
static void load_row(hf_import *im, const qmi_hf_tensor *w, const qmi_hf_tensor *sinv, uint64_t r,
                     uint64_t K, float *dst)
{
    qmi_load_row(w->data + r * K * qmi_elem_size(w->elem), w->elem, K, dst);
    if (sinv) {
        uint64_t nbk = sinv->shape[1];
        for (uint64_t c = 0; c < K; c++)
            dst[c] *= qmi_load(sinv->data, sinv->elem, (r / im->fp8_bn) * nbk + c / im->fp8_bk);
    }
}

/* MXFP4 E2M1 values in half units. */
static const int8_t fp4_half[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static void mxfp4_row(const uint8_t *blocks, const uint8_t *scales, uint64_t K, float *dst)
{
    for (uint64_t c = 0; c < K; c++) {
        uint8_t byte = blocks[c / 2];
        int q = c % 2 ? byte >> 4 : byte & 15;
        dst[c] = ldexpf((float)fp4_half[q], (int)scales[c / 32] - 128);
    }
}

/* The exact path: int8 code = 128 + 2·fp4, scale 2^(e-128) as f32. */
static void mxfp4_row_exact(const uint8_t *blocks, const uint8_t *scales, uint64_t K,
                            uint8_t *packed, float *scale_out, qmi_error *err)
{
    for (uint64_t c = 0; c < K; c++) {
        uint8_t byte = blocks[c / 2];
        int q = c % 2 ? byte >> 4 : byte & 15;
        packed[c] = (uint8_t)(128 + fp4_half[q]);
        float src = ldexpf((float)fp4_half[q], (int)scales[c / 32] - 128);
        float scale = ldexpf(1.0f, (int)scales[c / 32] - 128);
        float deq = scale * (float)fp4_half[q];
        double d = (double)deq - (double)src;
        err->diff2 += d * d;
        err->ref2 += (double)src * (double)src;
        err->exact &= deq == src;
    }
    for (uint64_t b = 0; b < K / 32; b++)
        scale_out[b] = ldexpf(1.0f, (int)scales[b] - 128);
}

static int convert_layer(hf_import *im, qmi_writer *w, uint32_t li, buffers *b, double *max_err,
                         qm_status *st)
{
    uint32_t E = im->E, H = im->H, I = im->I, bits = im->o.bits;
    uint64_t bs = im->o.block_size, pack = 8 / bits;
    uint64_t nblk_h = bs ? (H + bs - 1) / bs : 1, nblk_i = bs ? (I + bs - 1) / bs : 1;
    qm_dtype sdt = im->o.scale_dtype;
    uint64_t fc1_w = qmi_writer_slice_bytes(w, QM_T_FC1_WEIGHT);
    uint64_t fc1_s = qmi_writer_slice_bytes(w, QM_T_FC1_SCALES);
    uint64_t fc2_w = qmi_writer_slice_bytes(w, QM_T_FC2_WEIGHT);
    uint64_t fc2_s = qmi_writer_slice_bytes(w, QM_T_FC2_SCALES);
    int rc;
    /* Router (+ bias, correction bias) as f32. */
    const qmi_hf_tensor *rt[3] = {im->router_w[li], im->router_b[li], im->corr[li]};
    const int rdst[3] = {QM_T_ROUTER_WEIGHT, QM_T_ROUTER_BIAS, QMI_T_CORRECTION_BIAS};
    for (int i = 0; i < 3; i++) {
        if (!rt[i])
            continue;
        uint64_t n = rt[i]->nbytes / qmi_elem_size(rt[i]->elem);
        for (uint64_t off = 0; off < n; off += H) {
            uint64_t m = n - off < H ? n - off : H;
            qmi_load_row(rt[i]->data + off * qmi_elem_size(rt[i]->elem), rt[i]->elem, m, b->row);
            if (!row_finite(b->row, m))
                return not_finite(im, rt[i], st);
            if ((rc = qmi_writer_put(w, li, rdst[i], off * 4, b->row, m * 4, st)) != 0)
                return rc;
        }
    }
    const qmi_hf_tensor **lsrc = im->layer_src ? &im->layer_src[(size_t)li * G_COUNT] : NULL;
    if (lsrc) {
        for (int g = 0; g < G_COUNT; g++)
            if (lsrc[g])
                qmi_hf_prefetch(im->ck, lsrc[g]);
    }
    for (uint32_t e = 0; e < E; e++) {
        qmi_error err_gate = {0, 0, 1}, err_up = {0, 0, 1}, err_down = {0, 0, 1};
        if (!lsrc) {
            const qmi_hf_tensor **src = &im->expert_src[((size_t)li * E + e) * S_PER_EXPERT];
            if (e + 1 < E)
                for (int p = 0; p < S_PER_EXPERT; p++)
                    if (src[S_PER_EXPERT + p])
                        qmi_hf_prefetch(im->ck, src[S_PER_EXPERT + p]);
            /* fc1 rows interleave gate and up (swiglu_fusion 1). */
            for (uint64_t r = 0; r < 2ull * I; r++) {
                int up = (int)(r & 1);
                const qmi_hf_tensor *t = src[up ? S_UP : S_GATE];
                load_row(im, t, src[up ? S_UP_SINV : S_GATE_SINV], r / 2, H, b->row);
                if (!row_finite(b->row, H))
                    return not_finite(im, t, st);
                qmi_quantise_row(b->row, H, bits, bs, sdt, b->packed[0] + r * (H / pack),
                                 b->scales[0], r * nblk_h, up ? &err_up : &err_gate);
            }
            for (uint64_t r = 0; r < H; r++) {
                load_row(im, src[S_DOWN], src[S_DOWN_SINV], r, I, b->row);
                if (!row_finite(b->row, I))
                    return not_finite(im, src[S_DOWN], st);
                qmi_quantise_row(b->row, I, bits, bs, sdt, b->packed[1] + r * (I / pack),
                                 b->scales[1], r * nblk_i, &err_down);
            }
        } else if (im->mxfp4) {
            const qmi_hf_tensor *gb = lsrc[G_GATE_UP], *gs = lsrc[G_GATE_UP_SCALES];
            const qmi_hf_tensor *db = lsrc[G_DOWN], *ds = lsrc[G_DOWN_SCALES];
            for (int p = 0; p < 2; p++) {
                const qmi_hf_tensor *bt = p ? db : gb, *stt = p ? ds : gs;
                uint64_t N = p ? H : 2ull * I, K = p ? I : H, nb = p ? nblk_i : nblk_h;
                for (uint64_t r = 0; r < N; r++) {
                    const uint8_t *blk = bt->data + ((uint64_t)e * N + r) * (K / 2);
                    const uint8_t *sc = stt->data + ((uint64_t)e * N + r) * (K / 32);
                    for (uint64_t s = 0; s < K / 32; s++)
                        if (sc[s] == 255)
                            return not_finite(im, stt, st);
                    if (im->mxfp4_exact) {
                        mxfp4_row_exact(blk, sc, K, b->packed[p] + r * K,
                                        (float *)b->scales[p] + r * nb, p ? &err_down : &err_gate);
                    } else {
                        mxfp4_row(blk, sc, K, b->row);
                        qmi_quantise_row(b->row, K, bits, bs, sdt, b->packed[p] + r * (K / pack),
                                         b->scales[p], r * nb, p ? &err_down : &err_gate);
                    }
                }
            }
        } else {
            /* GPT-OSS bf16: gate_up_proj [E, H, 2I] and down_proj [E, I, H] are
             * input-major; transpose each expert's matrix once. */
            for (int p = 0; p < 2; p++) {
                const qmi_hf_tensor *t = lsrc[p ? G_DOWN : G_GATE_UP];
                uint64_t N = p ? H : 2ull * I, K = p ? I : H, nb = p ? nblk_i : nblk_h;
                size_t es = qmi_elem_size(t->elem);
                const uint8_t *base = t->data + (uint64_t)e * N * K * es;
                for (uint64_t kk = 0; kk < K; kk++) {
                    qmi_load_row(base + kk * N * es, t->elem, N, b->row);
                    for (uint64_t n = 0; n < N; n++)
                        b->mat[n * K + kk] = b->row[n];
                }
                if (!row_finite(b->mat, N * K))
                    return not_finite(im, t, st);
                for (uint64_t r = 0; r < N; r++)
                    qmi_quantise_row(b->mat + r * K, K, bits, bs, sdt,
                                     b->packed[p] + r * (K / pack), b->scales[p], r * nb,
                                     p ? &err_down : &err_gate);
            }
        }
        if ((rc = qmi_writer_put(w, li, QM_T_FC1_WEIGHT, e * fc1_w, b->packed[0], fc1_w, st)) ||
            (rc = qmi_writer_put(w, li, QM_T_FC1_SCALES, e * fc1_s, b->scales[0], fc1_s, st)) ||
            (rc = qmi_writer_put(w, li, QM_T_FC2_WEIGHT, e * fc2_w, b->packed[1], fc2_w, st)) ||
            (rc = qmi_writer_put(w, li, QM_T_FC2_SCALES, e * fc2_s, b->scales[1], fc2_s, st)))
            return rc;
        if (lsrc) {
            for (int p = 0; p < 2; p++) {
                const qmi_hf_tensor *t = lsrc[p ? G_DOWN_BIAS : G_GATE_UP_BIAS];
                uint64_t N = p ? H : 2ull * I;
                qmi_load_row(t->data + (uint64_t)e * N * qmi_elem_size(t->elem), t->elem, N,
                             b->bias);
                if (!row_finite(b->bias, N))
                    return not_finite(im, t, st);
                if ((rc = qmi_writer_put(w, li, p ? QM_T_FC2_BIAS : QM_T_FC1_BIAS, e * N * 4,
                                         b->bias, N * 4, st)))
                    return rc;
            }
        }
        const qmi_error *errs[3] = {&err_gate, &err_up, &err_down};
        for (int i = 0; i < 3; i++)
            if (errs[i]->ref2 > 0 || errs[i]->diff2 > 0) {
                double r = qmi_error_rel(errs[i]);
                if (r > *max_err)
                    *max_err = r;
            }
    }
    return 0;
}

/* ---- metadata and the report --------------------------------------------- */

static int source_prefix(hf_import *im, char *buf, size_t n)
{
    size_t at = (size_t)snprintf(buf, n, "{\"format\":\"hf\",\"family\":\"%s\",\"files\":[",
                                 im->fam->model_type);
    uint32_t ns = qmi_hf_shard_count(im->ck);
    for (uint32_t i = 0; i < ns; i++) {
        const char *s = qmi_hf_shard_name(im->ck, i);
        if (at + strlen(s) * 6 + 64 > n - 200) {
            at += (size_t)snprintf(buf + at, n - at, "%s\"... %u more\"", i ? "," : "", ns - i);
            break;
        }
        at += (size_t)snprintf(buf + at, n - at, "%s\"", i ? "," : "");
        for (const unsigned char *c = (const unsigned char *)s; *c; c++)
            at += (size_t)snprintf(buf + at, n - at, *c == '"' || *c == '\\' ? "\\%c"
                                                     : *c < 0x20           ? "\\u%04x"
                                                                           : "%c",
                                   *c);
        at += (size_t)snprintf(buf + at, n - at, "\"");
    }
    at += (size_t)snprintf(buf + at, n - at, "]");
    return at < n ? 0 : -1;
}

static void report_left_out(hf_import *im)
{
    size_t n = 0;
    const qmi_hf_tensor *all = qmi_hf_tensors(im->ck, &n);
    size_t shared = 0, dense = 0, other = 0;
    uint64_t shared_b = 0, dense_b = 0, other_b = 0;
    for (size_t i = 0; i < n; i++) {
        const char *nm = all[i].name;
        if (strstr(nm, ".shared_expert")) {
            shared++;
            shared_b += all[i].nbytes;
            continue;
        }
        unsigned l;
        int pos = 0;
        if (sscanf(nm, "model.layers.%u.mlp.%n", &l, &pos) == 1 && pos > 0 &&
            strncmp(nm + pos, "experts", 7) != 0 && strncmp(nm + pos, "gate.", 5) != 0 &&
            strncmp(nm + pos, "router", 6) != 0) {
            dense++;
            dense_b += all[i].nbytes;
            continue;
        }
        other++;
        other_b += all[i].nbytes;
    }
    other -= im->consumed <= other ? im->consumed : other;
    printf("left with the engine:");
    if (im->n_moe < im->model_layers)
        printf(" %u dense MLP layer(s) (%zu tensors, %.1f MB);", im->model_layers - im->n_moe,
               dense, (double)dense_b / 1e6);
    if (shared)
        printf(" shared experts (%zu tensors, %.1f MB);", shared, (double)shared_b / 1e6);
    printf(" %zu other tensors (attention, norms, embeddings, lm_head)\n", other);
    (void)other_b;
}

/* ---- the command ----------------------------------------------------------- */

static void import_free(hf_import *im)
{
    qm_free(im->layer_map);
    qm_free(im->expert_src);
    qm_free(im->layer_src);
    qm_free(im->router_w);
    qm_free(im->router_b);
    qm_free(im->corr);
    qm_free(im->layer_bytes);
    qmi_hf_close(im->ck);
}

static int run_import(hf_import *im)
{
    qm_status st;
    qm_status_clear(&st);
    qmi_writer *w = NULL;
    buffers b = {0};
    int rc, keep_partial = 1;
    char layer_map[8 * 65536 / 8], src[QMI_META_MAX * 8 + 4096], groups[16], topk_groups[16],
        scale[32], norm[4];
    char *layer_map_s = NULL;

    if ((rc = qmi_hf_open(im->o.dir, &im->ck, &st)) != 0 || (rc = read_config(im, &st)) != 0)
        goto fail_input;
    if (!im->o.bits_set)
        im->o.bits = im->mxfp4 ? 8 : 4;
    im->mxfp4_exact = im->mxfp4 && im->o.bits == 8 && im->o.block_size == 32 &&
                      im->o.scale_dtype == QM_DTYPE_F32;
    if (im->H % (8 / im->o.bits) || im->I % (8 / im->o.bits)) {
        rc = qm_status_set(&st, QM_EINVALID_MODEL,
                           "config.json: hidden_size %u and %s %u must be even for 4-bit codes",
                           im->H, im->fam->inter_key, im->I);
        goto fail_input;
    }
    if ((rc = resolve(im, &st)) != 0)
        goto fail_input;

    /* Metadata. */
    size_t lm_cap = (size_t)im->n_moe * 8 + 4;
    layer_map_s = qm_malloc(lm_cap);
    if (!layer_map_s) {
        rc = qm_status_set(&st, QM_ENOMEM, "out of memory");
        goto fail;
    }
    size_t at = (size_t)snprintf(layer_map_s, lm_cap, "[");
    for (uint32_t i = 0; i < im->n_moe; i++)
        at += (size_t)snprintf(layer_map_s + at, lm_cap - at, "%s%u", i ? "," : "",
                               im->layer_map[i]);
    snprintf(layer_map_s + at, lm_cap - at, "]");
    (void)layer_map;
    if (source_prefix(im, src, sizeof src) != 0) {
        rc = qm_status_set(&st, QM_EINTERNAL, "qmoe.source does not fit");
        goto fail;
    }
    snprintf(scale, sizeof scale, "%.9g", im->scale);
    snprintf(norm, sizeof norm, "%d", im->normalize);
    snprintf(groups, sizeof groups, "%u", im->groups);
    snprintf(topk_groups, sizeof topk_groups, "%u", im->topk_groups);
    qmi_bank_spec spec = {
        .layers = im->n_moe, .experts = im->E, .hidden = im->H, .inter = im->I, .k = im->k,
        .bits = im->o.bits, .block_size = im->o.block_size,
        .scale_dtype = im->mxfp4_exact ? QM_DTYPE_F32 : im->o.scale_dtype,
        .swiglu_fusion = 1, .activation = QM_ACT_SWIGLU,
        .alpha = im->alpha, .beta = im->beta, .limit = im->limit,
        .normalize_routing = im->normalize,
        .fc1_bias = im->fam->id == FAM_GPT_OSS, .fc2_bias = im->fam->id == FAM_GPT_OSS,
        .router_weight = 1, .router_bias = im->fam->id == FAM_GPT_OSS,
        .correction_bias = im->fam->id == FAM_DEEPSEEK_V3,
        .source_prefix = src,
    };
    const char *keys[] = {"qmoe.layer_map", "qmoe.routing.score", "qmoe.routing.normalize",
                          "qmoe.routing.scale"};
    const char *vals[] = {layer_map_s, im->score, norm, scale};
    for (size_t i = 0; i < 4; i++) {
        spec.meta_keys[spec.n_meta] = keys[i];
        spec.meta_values[spec.n_meta++] = vals[i];
    }
    if (im->groups) {
        spec.meta_keys[spec.n_meta] = "qmoe.routing.groups";
        spec.meta_values[spec.n_meta++] = groups;
        spec.meta_keys[spec.n_meta] = "qmoe.routing.topk_groups";
        spec.meta_values[spec.n_meta++] = topk_groups;
        spec.meta_keys[spec.n_meta] = "qmoe.routing.group_score";
        spec.meta_values[spec.n_meta++] = im->group_score;
    }

    uint32_t first = 0;
    double max_err = 0;
    if ((rc = qmi_writer_open(&spec, im->o.out, im->o.resume, "import hf", &w, &first, &max_err,
                              &st)) != 0) {
        if (rc == QM_ECONFLICT)
            goto fail_input;
        goto fail;
    }
    keep_partial = 0; /* until a layer is complete, nothing to resume */
    uint64_t total_src = 0, done_src = 0;
    for (uint32_t i = 0; i < im->n_moe; i++) {
        total_src += im->layer_bytes[i];
        if (i < first)
            done_src += im->layer_bytes[i];
    }
    if (!im->o.quiet) {
        printf("importing %s (%s): %u of %u layers have routed experts, %u experts, k %u, "
               "hidden %u, inter %u; %s -> int%u block %u%s\n",
               im->o.dir, im->fam->model_type, im->n_moe, im->model_layers, im->E, im->k, im->H,
               im->I, im->mxfp4 ? "MXFP4" : im->fp8 ? "FP8 e4m3" : "float",
               im->o.bits, im->o.block_size, im->mxfp4_exact ? " (exact)" : " (requantised)");
        if (first)
            printf("resuming %s.partial at layer %u of %u\n", im->o.out, first, im->n_moe);
        report_left_out(im);
        fflush(stdout);
    }
    qmi_writer_progress(w, !im->o.quiet && isatty(2), done_src);
    keep_partial = first > 0;
    /* Per-expert buffers: the largest matrix of either projection. */
    uint64_t kmax = im->H > im->I ? im->H : im->I;
    uint64_t n1 = 2ull * im->I;
    b.row = qm_malloc((n1 > kmax ? n1 : kmax) * sizeof(float));
    b.bias = qm_malloc((n1 > im->H ? n1 : im->H) * sizeof(float));
    b.packed[0] = qm_malloc(qmi_writer_slice_bytes(w, QM_T_FC1_WEIGHT));
    b.packed[1] = qm_malloc(qmi_writer_slice_bytes(w, QM_T_FC2_WEIGHT));
    b.scales[0] = qm_malloc(qmi_writer_slice_bytes(w, QM_T_FC1_SCALES));
    b.scales[1] = qm_malloc(qmi_writer_slice_bytes(w, QM_T_FC2_SCALES));
    if (im->fam->id == FAM_GPT_OSS && !im->mxfp4)
        b.mat = qm_malloc(n1 * im->H * sizeof(float));
    if (!b.row || !b.bias || !b.packed[0] || !b.packed[1] || !b.scales[0] || !b.scales[1] ||
        (im->fam->id == FAM_GPT_OSS && !im->mxfp4 && !b.mat)) {
        rc = qm_status_set(&st, QM_ENOMEM, "out of memory for one expert's buffers");
        goto fail;
    }
    for (uint32_t li = first; li < im->n_moe; li++) {
        rc = convert_layer(im, w, li, &b, &max_err, &st);
        qmi_hf_release(im->ck);
        if (rc) {
            if (rc == QM_EINVALID_MODEL)
                keep_partial = 0; /* a resume would stop at the same bytes */
            goto fail;
        }
        done_src += im->layer_bytes[li];
        if ((rc = qmi_writer_layer_done(w, li, max_err, done_src, total_src, &st)) != 0)
            goto fail;
        keep_partial = 1;
    }
    int exact = max_err == 0;
    uint64_t bytes = 0;
    if ((rc = qmi_writer_finish(w, exact, max_err, &bytes, &st)) != 0)
        goto fail;
    if (!im->o.quiet)
        printf("wrote %s: %u layers (model layers %s), %u experts, %llu bytes; %s (max "
               "relative error %.3g)\n",
               im->o.out, im->n_moe, layer_map_s, im->E, (unsigned long long)bytes,
               exact ? "exact" : "requantised", max_err);
    rc = QMB_OK;
    goto done;
fail_input:
    fprintf(stderr, "qmoe-bank import hf: %s: %s\n", im->o.dir, st.msg);
    rc = exit_for(rc);
    goto done;
fail:
    fprintf(stderr, "qmoe-bank import hf: %s%s\n", st.msg,
            w && keep_partial ? " (the partial file is kept: rerun with --resume)" : "");
    rc = exit_for(rc);
done:
    qmi_writer_free(w, keep_partial);
    qm_free(b.row);
    qm_free(b.bias);
    qm_free(b.mat);
    qm_free(b.packed[0]);
    qm_free(b.packed[1]);
    qm_free(b.scales[0]);
    qm_free(b.scales[1]);
    qm_free(layer_map_s);
    import_free(im);
    return rc;
}

static int usage(const char *what)
{
    fprintf(stderr, "qmoe-bank import: %s (see qmoe-bank import --help)\n", what);
    return QMB_USAGE;
}

int qmb_import_hf(int argc, char **argv)
{
    enum { O_OUT = 256, O_BITS, O_BS, O_SCALES, O_RESUME, O_QUIET, O_HELP };
    static const struct option longopts[] = {
        {"out", required_argument, 0, O_OUT},       {"bits", required_argument, 0, O_BITS},
        {"block-size", required_argument, 0, O_BS}, {"scales", required_argument, 0, O_SCALES},
        {"resume", no_argument, 0, O_RESUME},       {"quiet", no_argument, 0, O_QUIET},
        {"help", no_argument, 0, O_HELP},           {0, 0, 0, 0}};
    hf_import im = {.o = {.bits = 4, .block_size = 32, .scale_dtype = QM_DTYPE_F32}};
    optind = 1;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        char msg[160];
        switch (c) {
        case O_OUT:
            im.o.out = optarg;
            break;
        case O_BITS:
            if (qmb_parse_u32(optarg, 8, &im.o.bits) != 0 || (im.o.bits != 4 && im.o.bits != 8))
                return usage("--bits must be 4 or 8");
            im.o.bits_set = 1;
            break;
        case O_BS:
            if (qmb_parse_u32(optarg, 1u << 20, &im.o.block_size) != 0 ||
                (im.o.block_size &&
                 (im.o.block_size < 16 || (im.o.block_size & (im.o.block_size - 1)))))
                return usage("--block-size must be 0 or a power of two >= 16");
            break;
        case O_SCALES:
            if (strcmp(optarg, "f32") == 0)
                im.o.scale_dtype = QM_DTYPE_F32;
            else if (strcmp(optarg, "f16") == 0)
                im.o.scale_dtype = QM_DTYPE_F16;
            else if (strcmp(optarg, "bf16") == 0)
                im.o.scale_dtype = QM_DTYPE_BF16;
            else
                return usage("--scales must be f32, f16 or bf16");
            break;
        case O_RESUME:
            im.o.resume = 1;
            break;
        case O_QUIET:
            im.o.quiet = 1;
            break;
        case O_HELP:
            qmb_help_import_hf(stdout);
            return QMB_OK;
        default:
            snprintf(msg, sizeof msg, "unknown or incomplete option \"%.64s\"", argv[optind - 1]);
            return usage(msg);
        }
    }
    if (optind + 1 != argc)
        return usage("expected: import hf DIR --out FILE");
    im.o.dir = argv[optind];
    if (!im.o.out)
        return usage("--out FILE is required");
    return run_import(&im);
}
