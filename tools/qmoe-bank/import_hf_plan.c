/* import_hf_plan.c - `import hf`: config.json read through the family's
 * descriptor (import_families.h), and the check of every tensor the import
 * will read against the config, before any output. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "import_hf_impl.h"
#include "qm_alloc.h"

/* ---- config.json --------------------------------------------------------- */

static int cfg_u32(qm__hf_import *im, const char *key, int required, uint32_t dflt, uint32_t *out,
                   qm_status *st)
{
    double v;
    int rc = qm_hf_json_number(qm__hf_config(im->ck), key, &v, st);
    if (rc == QM_ENOT_FOUND) {
        if (required)
            return qm_status_set(st, QM_EINVALID_MODEL,
                                 "config.json: key \"%s\" is missing (a %s config needs it)", key,
                                 im->fam->name);
        *out = dflt;
        return 0;
    }
    if (rc) return QM_EINVALID_MODEL;
    if (!(v >= 0 && v <= 16777216.0) || v != floor(v))
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "config.json: key \"%s\" is %g, expected an integer in [0, 2^24]", key,
                             v);
    *out = (uint32_t)v;
    return 0;
}

static int cfg_num(qm__hf_import *im, const char *key, double dflt, double *out, qm_status *st)
{
    int rc = qm_hf_json_number(qm__hf_config(im->ck), key, out, st);
    if (rc == QM_ENOT_FOUND) {
        *out = dflt;
        return 0;
    }
    return rc ? QM_EINVALID_MODEL : 0;
}

static int cfg_bool(qm__hf_import *im, const char *key, int dflt, int *out, qm_status *st)
{
    int rc = qm_hf_json_bool(qm__hf_config(im->ck), key, out, st);
    if (rc == QM_ENOT_FOUND) {
        *out = dflt;
        return 0;
    }
    return rc ? QM_EINVALID_MODEL : 0;
}

static int find_family(qm__hf_import *im, qm_status *st)
{
    const qm_hf_json *c = qm__hf_config(im->ck);
    const char *mt = NULL, *arch = NULL;
    int rc = qm_hf_json_string(c, "model_type", &mt, st);
    if (rc && rc != QM_ENOT_FOUND) return QM_EINVALID_MODEL;
    rc = qm_hf_json_array_string(c, "architectures", 0, &arch, st);
    if (rc && rc != QM_ENOT_FOUND) return QM_EINVALID_MODEL;
    if ((im->fam = qm_family_for_hf(mt, arch)) != NULL) return 0;
    char names[256];
    qm_family_names(0, names, sizeof names);
    return qm_status_set(st, QM_EUNSUPPORTED,
                         "config.json: model_type \"%.60s\" (architectures[0] \"%.60s\") is not a "
                         "supported MoE family; supported: %s",
                         mt ? mt : "(none)", arch ? arch : "(none)", names);
}

/* Which model layers have routed experts, per the family's rule. */
static int moe_layers(qm__hf_import *im, qm_status *st)
{
    const qm_hf_json *c = qm__hf_config(im->ck);
    uint32_t step = 1, first_dense = 0;
    int rc;
    const int sparse_step = (im->fam->flags & QM_FAMILY_SPARSE_STEP) != 0;
    if (sparse_step) {
        if ((rc = cfg_u32(im, "decoder_sparse_step", 0, 1, &step, st)) != 0) return rc;
        if (step == 0)
            return qm_status_set(st, QM_EINVALID_MODEL,
                                 "config.json: decoder_sparse_step is 0, expected >= 1");
    }
    if (im->fam->flags & QM_FAMILY_DENSE_PREFIX)
        if ((rc = cfg_u32(im, "first_k_dense_replace", 0, 0, &first_dense, st)) != 0 ||
            (rc = cfg_u32(im, "num_nextn_predict_layers", 0, 0, &im->mtp_layers, st)) != 0)
            return rc;
    double *only = NULL;
    size_t n_only = 0;
    if (sparse_step) {
        rc = qm_hf_json_numbers(c, "mlp_only_layers", &only, &n_only, st);
        if (rc && rc != QM_ENOT_FOUND) return QM_EINVALID_MODEL;
    }
    im->layer_map = qm_calloc(im->model_layers ? im->model_layers : 1, sizeof *im->layer_map);
    uint8_t *dense = qm_calloc(im->model_layers ? im->model_layers : 1, 1);
    if (!im->layer_map || !dense) {
        qm_free(only);
        qm_free(dense);
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    }
    /* One pass over the list: layers past num_hidden_layers mean nothing
     * (transformers ignores them too); anything but a whole index is wrong. */
    for (size_t i = 0; i < n_only; i++) {
        if (!(only[i] >= 0) || only[i] != floor(only[i])) {
            rc = qm_status_set(st, QM_EINVALID_MODEL,
                               "config.json: mlp_only_layers[%zu] is %g, expected a layer index", i,
                               only[i]);
            qm_free(only);
            qm_free(dense);
            return rc;
        }
        if (only[i] < (double)im->model_layers) dense[(size_t)only[i]] = 1;
    }
    qm_free(only);
    for (uint32_t l = 0; l < im->model_layers; l++)
        if (l >= first_dense && (l + 1) % step == 0 && !dense[l]) im->layer_map[im->n_moe++] = l;
    qm_free(dense);
    if (!im->n_moe)
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "config.json: no layer of the %u has routed experts "
                             "(first_k_dense_replace / decoder_sparse_step / mlp_only_layers)",
                             im->model_layers);
    return 0;
}

/* The family's routing rule, from the config keys its descriptor names. */
static int read_routing(qm__hf_import *im, qm_status *st)
{
    const qm_family *f = im->fam;
    const qm_hf_json *c = qm__hf_config(im->ck);
    int rc;
    im->alpha = 1.0f;
    im->beta = 0.0f;
    im->limit = INFINITY;
    im->score = f->score;
    im->normalize = f->normalize_default;
    im->scale = f->scale_default;
    if (f->normalize_key &&
        (rc = cfg_bool(im, f->normalize_key, f->normalize_default, &im->normalize, st)) != 0)
        return rc;
    if (f->scale_key && (rc = cfg_num(im, f->scale_key, f->scale_default, &im->scale, st)) != 0)
        return rc;
    int grouped = f->groups == QM_FAMILY_GROUPS_ALWAYS;
    if (f->groups == QM_FAMILY_GROUPS_BY_TOPK_METHOD) {
        const char *method = "greedy";
        rc = qm_hf_json_string(c, "topk_method", &method, st);
        if (rc && rc != QM_ENOT_FOUND) return QM_EINVALID_MODEL;
        grouped = strcmp(method, "group_limited_greedy") == 0;
        if (!grouped && strcmp(method, "greedy") != 0)
            return qm_status_set(st, QM_EUNSUPPORTED,
                                 "config.json: topk_method \"%.40s\" is not supported for %s "
                                 "(greedy, group_limited_greedy)",
                                 method, f->name);
    }
    if (grouped) {
        int required = f->n_group_default == 0;
        if ((rc = cfg_u32(im, "n_group", required, f->n_group_default, &im->groups, st)) != 0 ||
            (rc = cfg_u32(im, "topk_group", required, f->topk_group_default, &im->topk_groups,
                          st)) != 0)
            return rc;
        im->group_score = f->group_score;
    }
    if (f->flags & QM_FAMILY_OAI_SWIGLU) {
        double a, lim;
        if ((rc = cfg_num(im, "swiglu_alpha", 1.702, &a, st)) != 0 ||
            (rc = cfg_num(im, "swiglu_limit", 7.0, &lim, st)) != 0)
            return rc;
        im->alpha = (float)a;
        im->beta = 1.0f;
        im->limit = (float)lim;
    }
    return 0;
}

int qm__hf_read_config(qm__hf_import *im, qm_status *st)
{
    int rc;
    if ((rc = find_family(im, st)) != 0) return rc;
    if ((rc = cfg_u32(im, "num_hidden_layers", 1, 0, &im->model_layers, st)) != 0 ||
        (rc = cfg_u32(im, "hidden_size", 1, 0, &im->H, st)) != 0 ||
        (rc = cfg_u32(im, im->fam->inter_key, 1, 0, &im->I, st)) != 0 ||
        (rc = cfg_u32(im, "num_experts_per_tok", 1, 0, &im->k, st)) != 0)
        return rc;
    static const char *expert_keys[] = {"num_local_experts", "num_experts", "n_routed_experts"};
    im->E = 0;
    for (size_t i = 0; i < 3 && !im->E; i++)
        if ((rc = cfg_u32(im, expert_keys[i], 0, 0, &im->E, st)) != 0) return rc;
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
    if ((rc = moe_layers(im, st)) != 0) return rc;

    if ((rc = read_routing(im, st)) != 0) return rc;
    if (im->groups) {
        if (im->groups > im->E || im->E % im->groups || !im->topk_groups ||
            im->topk_groups > im->groups)
            return qm_status_set(st, QM_EINVALID_MODEL,
                                 "config.json: n_group %u / topk_group %u do not divide %u experts",
                                 im->groups, im->topk_groups, im->E);
        if (im->groups == 1) im->groups = im->topk_groups = 0, im->group_score = NULL;
    }
    /* The bank loader's rule for qmoe.routing.scale: a finite f32 > 0. */
    if (!(im->scale > 0) || !isfinite((float)im->scale) || !((float)im->scale > 0.0f))
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "config.json: routed_scaling_factor %g, expected a finite number > 0 "
                             "that an f32 holds",
                             im->scale);
    /* Quantised sources. */
    const qm_hf_json *c = qm__hf_config(im->ck);
    const char *qm = NULL;
    rc = qm_hf_json_string(c, "quantization_config/quant_method", &qm, st);
    if (rc && rc != QM_ENOT_FOUND) return QM_EINVALID_MODEL;
    if (qm && strcmp(qm, "mxfp4") == 0 && (im->fam->flags & QM_FAMILY_MXFP4)) {
        im->mxfp4 = 1;
    } else if (qm && strcmp(qm, "fp8") == 0 && (im->fam->flags & QM_FAMILY_FP8)) {
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
        char which[256] = "";
        size_t at = 0;
        for (size_t i = 0; i < qm_n_families && at < sizeof which; i++) {
            unsigned fl = qm_families[i].flags;
            if (fl & (QM_FAMILY_MXFP4 | QM_FAMILY_FP8))
                at += (size_t)snprintf(which + at, sizeof which - at, "%s%s for %s", at ? ", " : "",
                                       fl & QM_FAMILY_MXFP4 ? "mxfp4" : "fp8", qm_families[i].name);
        }
        return qm_status_set(st, QM_EUNSUPPORTED,
                             "config.json: quantization_config.quant_method \"%.40s\" is not "
                             "supported for %s (supported: %s)",
                             qm, im->fam->name, which);
    }
    return 0;
}

/* ---- checking the tensors against the config ----------------------------- */

#define ELEM_FLOAT ((1u << QM__ELEM_F32) | (1u << QM__ELEM_F16) | (1u << QM__ELEM_BF16))

static void fmt_shape(char *buf, size_t n, const uint64_t *shape, uint32_t nd)
{
    size_t at = (size_t)snprintf(buf, n, "[");
    for (uint32_t i = 0; i < nd && at < n; i++)
        at += (size_t)snprintf(buf + at, n - at, "%s%llu", i ? ", " : "",
                               (unsigned long long)shape[i]);
    if (at < n) snprintf(buf + at, n - at, "]");
}

/* The tensor `name`, of one of the element types in `elems` and shape `want`
 * (why says where the shape comes from), or an error naming it. */
static int expect(qm__hf_import *im, const char *name, unsigned elems, uint32_t nd,
                  const uint64_t *want, const char *why, const qm__hf_tensor **out, qm_status *st)
{
    const qm__hf_tensor *t = qm__hf_find(im->ck, name);
    if (!t) {
        const char *f = qm__hf_index_file(im->ck, name);
        if (f)
            return qm_status_set(st, QM_EINVALID_MODEL,
                                 "%.80s: has no tensor %.120s, though model.safetensors.index.json "
                                 "puts it there",
                                 f, name);
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "checkpoint has no tensor %.120s (a %s checkpoint needs it)", name,
                             im->fam->name);
    }
    const char *file = qm__hf_shard_name(im->ck, t->shard);
    if (!(elems & (1u << t->elem))) {
        char allowed[64] = "";
        for (int e = 0; e < QM__ELEM_OTHER; e++)
            if (elems & (1u << e))
                snprintf(allowed + strlen(allowed), sizeof allowed - strlen(allowed), "%s%s",
                         allowed[0] ? "/" : "", qm__elem_name((qm__elem)e));
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "%.80s: tensor %.120s has dtype %s, expected %s", file, name, t->dtype,
                             allowed);
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

/* One tensor of a layer's fused experts: model.layers.{l}.{moe}.experts.{what}. */
typedef struct fused_tensor {
    const char *what;
    unsigned elems;
    uint32_t nd;
    const uint64_t *want;
    int slot; /* QM__HF_FUSED_* */
} fused_tensor;

static int expect_fused(qm__hf_import *im, uint32_t l, const char *moe, const fused_tensor *t,
                        size_t n, const char *why, const qm__hf_tensor **src, qm_status *st)
{
    char name[256];
    for (size_t i = 0; i < n; i++) {
        snprintf(name, sizeof name, "model.layers.%u.%s.experts.%s", l, moe, t[i].what);
        int rc = expect(im, name, t[i].elems, t[i].nd, t[i].want, why, &src[t[i].slot], st);
        if (rc) return rc;
    }
    return 0;
}

static int check_absent(qm__hf_import *im, const char *name, const char *why, qm_status *st)
{
    const qm__hf_tensor *t = qm__hf_find(im->ck, name);
    if (!t) return 0;
    return qm_status_set(st, QM_EINVALID_MODEL, "%.80s: tensor %.120s contradicts config.json (%s)",
                         qm__hf_shard_name(im->ck, t->shard), name, why);
}

int qm__hf_resolve(qm__hf_import *im, qm_status *st)
{
    const qm_family *f = im->fam;
    uint32_t E = im->E, H = im->H, I = im->I;
    size_t nl = im->n_moe;
    im->router_w = qm_calloc(nl, sizeof *im->router_w);
    im->router_b = qm_calloc(nl, sizeof *im->router_b);
    im->corr = qm_calloc(nl, sizeof *im->corr);
    im->layer_bytes = qm_calloc(nl, sizeof *im->layer_bytes);
    const int fused = (f->flags & QM_FAMILY_FUSED_EXPERTS) != 0;
    /* config.json's counts are claims: every expert tensor they imply must
     * exist before a table of them is allocated (65536 layers x 65536
     * experts would be 200 GB of pointers for a 1 KB file). */
    size_t have = 0;
    qm__hf_tensors(im->ck, &have);
    uint64_t need = fused ? (uint64_t)nl * 2 : (uint64_t)nl * E * 3;
    if (need > have) {
        char name[256];
        for (size_t li = 0; li < nl; li++)
            for (uint32_t e = 0; e < (fused ? 1 : E); e++)
                for (int p = 0; p < (fused ? 1 : 3); p++) {
                    const char *proj[3] = {f->gate, f->up, f->down};
                    if (fused)
                        snprintf(name, sizeof name, "model.layers.%u.%s.experts.%s",
                                 im->layer_map[li], f->moe,
                                 im->mxfp4 ? "gate_up_proj_blocks" : "gate_up_proj");
                    else
                        snprintf(name, sizeof name, "model.layers.%u.%s.experts.%u.%s.weight",
                                 im->layer_map[li], f->moe, e, proj[p]);
                    if (!qm__hf_find(im->ck, name))
                        return qm_status_set(st, QM_EINVALID_MODEL,
                                             "checkpoint has no tensor %.120s (config.json's "
                                             "%u layers x %u experts need %llu expert tensors; "
                                             "the checkpoint has %zu tensors)",
                                             name, im->model_layers, E, (unsigned long long)need,
                                             have);
                }
    }
    if (!fused)
        im->expert_src = qm_calloc(nl * E * QM__HF_PER_EXPERT, sizeof *im->expert_src);
    else
        im->layer_src = qm_calloc(nl * QM__HF_FUSED_COUNT, sizeof *im->layer_src);
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
        if (f->flags & QM_FAMILY_ROUTER_BIAS) {
            snprintf(name, sizeof name, "model.layers.%u.%s.%s.bias", l, f->moe, f->router);
            if ((rc = expect(im, name, ELEM_FLOAT, 1, rshape, why, &im->router_b[li], st)) != 0)
                return rc;
        }
        if (f->flags & QM_FAMILY_CORRECTION_BIAS) {
            snprintf(name, sizeof name, "model.layers.%u.%s.%s.e_score_correction_bias", l, f->moe,
                     f->router);
            if ((rc = expect(im, name, ELEM_FLOAT, 1, rshape, why, &im->corr[li], st)) != 0)
                return rc;
        }
        if (!fused) {
            const char *proj[3] = {f->gate, f->up, f->down};
            for (uint32_t e = 0; e < E; e++) {
                const qm__hf_tensor **src = &im->expert_src[(li * E + e) * QM__HF_PER_EXPERT];
                for (int p = 0; p < 3; p++) {
                    uint64_t shape[2] = {p == 2 ? H : I, p == 2 ? I : H};
                    snprintf(name, sizeof name, "model.layers.%u.%s.experts.%u.%s.weight", l,
                             f->moe, e, proj[p]);
                    unsigned elems = im->fp8 ? 1u << QM__ELEM_F8_E4M3 : ELEM_FLOAT;
                    if ((rc = expect(im, name, elems, 2, shape, why, &src[p], st)) != 0) return rc;
                    bytes += src[p]->nbytes;
                    if (im->fp8) {
                        uint64_t sshape[2] = {(shape[0] + im->fp8_bn - 1) / im->fp8_bn,
                                              (shape[1] + im->fp8_bk - 1) / im->fp8_bk};
                        snprintf(name, sizeof name,
                                 "model.layers.%u.%s.experts.%u.%s.weight_scale_inv", l, f->moe, e,
                                 proj[p]);
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
            if ((rc = check_absent(im, name, ewhy, st)) != 0) return rc;
        } else {
            const qm__hf_tensor **src = &im->layer_src[li * QM__HF_FUSED_COUNT];
            uint64_t b1[2] = {E, 2ull * I}, b2[2] = {E, H};
            if (im->mxfp4) {
                if (H % 32 || I % 32)
                    return qm_status_set(st, QM_EINVALID_MODEL,
                                         "config.json: MXFP4 needs hidden_size (%u) and "
                                         "intermediate_size (%u) to be multiples of 32",
                                         H, I);
                uint64_t gb[4] = {E, 2ull * I, H / 32, 16}, gs[3] = {E, 2ull * I, H / 32};
                uint64_t db[4] = {E, H, I / 32, 16}, ds[3] = {E, H, I / 32};
                const unsigned u8 = 1u << QM__ELEM_U8;
                const fused_tensor mx[] = {
                    {"gate_up_proj_blocks", u8, 4, gb, QM__HF_FUSED_GATE_UP},
                    {"gate_up_proj_scales", u8, 3, gs, QM__HF_FUSED_GATE_UP_SCALES},
                    {"down_proj_blocks", u8, 4, db, QM__HF_FUSED_DOWN},
                    {"down_proj_scales", u8, 3, ds, QM__HF_FUSED_DOWN_SCALES},
                };
                if ((rc = expect_fused(im, l, f->moe, mx, 4, why, src, st))) return rc;
                bytes += src[QM__HF_FUSED_GATE_UP_SCALES]->nbytes +
                         src[QM__HF_FUSED_DOWN_SCALES]->nbytes;
            } else {
                uint64_t gu[3] = {E, H, 2ull * I}, dn[3] = {E, I, H};
                const fused_tensor fl[] = {
                    {"gate_up_proj", ELEM_FLOAT, 3, gu, QM__HF_FUSED_GATE_UP},
                    {"down_proj", ELEM_FLOAT, 3, dn, QM__HF_FUSED_DOWN},
                };
                if ((rc = expect_fused(im, l, f->moe, fl, 2, why, src, st))) return rc;
            }
            bytes += src[QM__HF_FUSED_GATE_UP]->nbytes + src[QM__HF_FUSED_DOWN]->nbytes;
            const fused_tensor bias[] = {
                {"gate_up_proj_bias", ELEM_FLOAT, 2, b1, QM__HF_FUSED_GATE_UP_BIAS},
                {"down_proj_bias", ELEM_FLOAT, 2, b2, QM__HF_FUSED_DOWN_BIAS},
            };
            if ((f->flags & QM_FAMILY_EXPERT_BIASES) &&
                (rc = expect_fused(im, l, f->moe, bias, 2, why, src, st)))
                return rc;
        }
        im->layer_bytes[li] = bytes;
    }
    /* Layers the config calls dense, or past num_hidden_layers, must not hold
     * experts. DeepSeek checkpoints carry their multi-token-prediction layers
     * (num_nextn_predict_layers) after the model's: those stay out. */
    for (uint32_t l = 0, li = 0; l <= im->model_layers + im->mtp_layers; l++) {
        if (l == im->model_layers) l += im->mtp_layers;
        if (li < nl && im->layer_map[li] == l) {
            li++;
            continue;
        }
        if (!fused)
            snprintf(name, sizeof name, "model.layers.%u.%s.experts.0.%s.weight", l, f->moe,
                     f->gate);
        else
            snprintf(name, sizeof name, "model.layers.%u.%s.experts.%s", l, f->moe,
                     im->mxfp4 ? "gate_up_proj_blocks" : "gate_up_proj");
        char lwhy[128];
        if (l >= im->model_layers)
            snprintf(lwhy, sizeof lwhy, "num_hidden_layers %u, num_nextn_predict_layers %u",
                     im->model_layers, im->mtp_layers);
        else
            snprintf(lwhy, sizeof lwhy,
                     "layer %u is dense by its first_k_dense_replace / "
                     "decoder_sparse_step / mlp_only_layers",
                     l);
        if ((rc = check_absent(im, name, lwhy, st)) != 0) return rc;
    }
    return 0;
}
