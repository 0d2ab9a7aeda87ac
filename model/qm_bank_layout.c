/* qm_bank_layout.c - what a bank must contain: metadata keys and ranges, and
 * the shape and dtype every layer tensor needs under that metadata. Pure
 * functions over parsed header data; qm_bank.c does the I/O and bookkeeping. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_bank.h"
#include "qm_bank_internal.h"

/* ---- names ---------------------------------------------------------------- */

/* One row per qm_dtype, in enum order: element size, our name, safetensors'. */
static const struct {
    size_t size;
    const char *name, *st_name;
} dtype_info[] = {
    [QM_DTYPE_F32] = {4, "f32", "F32"},
    [QM_DTYPE_F16] = {2, "f16", "F16"},
    [QM_DTYPE_BF16] = {2, "bf16", "BF16"},
    [QM_DTYPE_U8] = {1, "u8", "U8"},
};
#define N_DTYPES (sizeof dtype_info / sizeof dtype_info[0])

size_t qm_dtype_size(qm_dtype dtype)
{
    return (unsigned)dtype < N_DTYPES ? dtype_info[dtype].size : 0;
}

const char *qm_dtype_name(qm_dtype dtype)
{
    return (unsigned)dtype < N_DTYPES ? dtype_info[dtype].name : "unknown";
}

int qm__dtype_from_st(const char *st_name, qm_dtype *out)
{
    for (size_t i = 0; i < N_DTYPES; i++)
        if (strcmp(st_name, dtype_info[i].st_name) == 0) {
            *out = (qm_dtype)i;
            return 0;
        }
    return -1;
}

const char *qm__dtype_st_name(qm_dtype dtype)
{
    return (unsigned)dtype < N_DTYPES ? dtype_info[dtype].st_name : "?";
}

static const char *const activation_names[] = {"relu", "gelu", "silu", "swiglu", "identity"};

const char *qm_activation_name(qm_activation act)
{
    if ((unsigned)act < sizeof activation_names / sizeof activation_names[0])
        return activation_names[act];
    return "unknown";
}

int qm_activation_parse(const char *name, qm_activation *out)
{
    if (!name)
        return QM_EINVAL;
    for (size_t i = 0; i < sizeof activation_names / sizeof activation_names[0]; i++)
        if (strcmp(name, activation_names[i]) == 0) {
            *out = (qm_activation)i;
            return 0;
        }
    return QM_EINVAL;
}

static const char *const tensor_suffixes[QM_T_COUNT] = {
    [QM_T_FC1_WEIGHT] = "fc1.weight",     [QM_T_FC1_SCALES] = "fc1.scales",
    [QM_T_FC1_ZERO_POINTS] = "fc1.zero_points", [QM_T_FC1_BIAS] = "fc1.bias",
    [QM_T_FC2_WEIGHT] = "fc2.weight",     [QM_T_FC2_SCALES] = "fc2.scales",
    [QM_T_FC2_ZERO_POINTS] = "fc2.zero_points", [QM_T_FC2_BIAS] = "fc2.bias",
    [QM_T_FC3_WEIGHT] = "fc3.weight",     [QM_T_FC3_SCALES] = "fc3.scales",
    [QM_T_FC3_ZERO_POINTS] = "fc3.zero_points", [QM_T_FC3_BIAS] = "fc3.bias",
    [QM_T_ROUTER_WEIGHT] = "router.weight", [QM_T_ROUTER_BIAS] = "router.bias",
    [QM_T_ROUTER_CORRECTION_BIAS] = "router.correction_bias",
};

const char *qm_bank_tensor_suffix(qm_bank_tensor t)
{
    if ((unsigned)t < QM_T_COUNT)
        return tensor_suffixes[t];
    return NULL;
}

int qm_bank_tensor_name(uint32_t layer, qm_bank_tensor t, char *buf, size_t size)
{
    const char *suffix = qm_bank_tensor_suffix(t);
    if (!suffix || !buf || size == 0)
        return QM_EINVAL;
    int n = snprintf(buf, size, "layers.%u.%s", layer, suffix);
    return n < 0 || (size_t)n >= size ? QM_EINVAL : 0;
}

int qm__parse_tensor_name(const char *name, uint32_t n_layers, uint32_t *layer,
                          qm_bank_tensor *t)
{
    if (strncmp(name, "layers.", 7) != 0)
        return -1;
    const char *p = name + 7;
    if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] >= '0' && p[1] <= '9'))
        return -1; /* no sign, no leading zeros: one spelling per tensor */
    uint64_t v = 0;
    while (*p >= '0' && *p <= '9') {
        v = v * 10 + (uint64_t)(*p - '0');
        if (v >= n_layers)
            return -1;
        p++;
    }
    if (*p != '.')
        return -1;
    p++;
    for (int i = 0; i < QM_T_COUNT; i++)
        if (strcmp(p, tensor_suffixes[i]) == 0) {
            *layer = (uint32_t)v;
            *t = (qm_bank_tensor)i;
            return 0;
        }
    return -1;
}

/* ---- metadata -------------------------------------------------------------- */

#define META_FAIL(st, ...) qm_status_set((st), QM_EINVALID_MODEL, __VA_ARGS__)

static int meta_u32(const qm_st_header *h, const char *key, int required, uint32_t dflt,
                    uint32_t lo, uint32_t hi, uint32_t *out, qm_status *st)
{
    const char *v = qm_st_header_meta(h, key);
    if (!v) {
        if (required)
            return META_FAIL(st, "__metadata__: required key %s is missing", key);
        *out = dflt;
        return 0;
    }
    uint64_t x = 0;
    size_t n = strlen(v);
    int ok = n > 0 && n <= 10;
    for (size_t i = 0; ok && i < n; i++)
        ok = v[i] >= '0' && v[i] <= '9';
    if (ok)
        x = strtoull(v, NULL, 10);
    if (!ok || x < lo || x > hi)
        return META_FAIL(st, "__metadata__: %s = \"%.32s\" but it must be an integer in [%u, %u]",
                         key, v, lo, hi);
    *out = (uint32_t)x;
    return 0;
}

static int meta_float(const qm_st_header *h, const char *key, float dflt, int allow_inf,
                      float *out, qm_status *st)
{
    const char *v = qm_st_header_meta(h, key);
    if (!v) {
        *out = dflt;
        return 0;
    }
    char *end = NULL;
    float f = strtof(v, &end);
    if (v[0] == '\0' || *end != '\0' || isnan(f) || (isinf(f) && !allow_inf))
        return META_FAIL(st, "__metadata__: %s = \"%.32s\" but it must be a %s number", key, v,
                         allow_inf ? "non-NaN" : "finite");
    *out = f;
    return 0;
}

const int8_t *qm_codebook_values(qm_codebook cb)
{
    static const int8_t e2m1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    return cb == QM_CODEBOOK_E2M1 ? e2m1 : NULL;
}

const char *qm_codebook_name(qm_codebook cb)
{
    return cb == QM_CODEBOOK_E2M1 ? "e2m1" : "none";
}

int qm__config_from_metadata(const qm_st_header *h, qm_bank_config *cfg, qm_status *st)
{
    int rc;
    const char *fmt = qm_st_header_meta(h, "qmoe.format");
    if (!fmt)
        return META_FAIL(st, "__metadata__: qmoe.format is missing (not a qmoe bank file?)");
    if (strcmp(fmt, "1") != 0)
        return META_FAIL(st, "__metadata__: qmoe.format = \"%.32s\" but this build reads format 1",
                         fmt);
    memset(cfg, 0, sizeof *cfg);
    if ((rc = meta_u32(h, "qmoe.layers", 1, 0, 1, QM_BANK_MAX_LAYERS, &cfg->layers, st)) ||
        (rc = meta_u32(h, "qmoe.experts", 1, 0, 1, QM_BANK_MAX_EXPERTS, &cfg->experts, st)) ||
        (rc = meta_u32(h, "qmoe.hidden_size", 1, 0, 1, QM_BANK_MAX_DIM, &cfg->hidden, st)) ||
        (rc = meta_u32(h, "qmoe.inter_size", 1, 0, 1, QM_BANK_MAX_DIM, &cfg->inter, st)) ||
        (rc = meta_u32(h, "qmoe.k", 1, 0, 1, cfg->experts, &cfg->k, st)) ||
        (rc = meta_u32(h, "qmoe.bits", 1, 0, 1, 8, &cfg->bits, st)) ||
        (rc = meta_u32(h, "qmoe.block_size", 1, 0, 0, QM_BANK_MAX_DIM, &cfg->block_size, st)))
        return rc;
    if (cfg->bits != 4 && cfg->bits != 8)
        return META_FAIL(st, "__metadata__: qmoe.bits = %u but only 4 and 8 are supported",
                         cfg->bits);
    const char *cb = qm_st_header_meta(h, "qmoe.codebook");
    if (cb) {
        if (strcmp(cb, "e2m1") != 0)
            return META_FAIL(st, "__metadata__: qmoe.codebook = \"%.32s\" but the only code "
                                 "book is e2m1", cb);
        if (cfg->bits != 4)
            return META_FAIL(st, "__metadata__: qmoe.codebook = e2m1 needs qmoe.bits = 4, not %u",
                             cfg->bits);
        cfg->codebook = QM_CODEBOOK_E2M1;
    }
    uint32_t bs = cfg->block_size;
    if (bs != 0 && (bs < 16 || (bs & (bs - 1)) != 0))
        return META_FAIL(st, "__metadata__: qmoe.block_size = %u but it must be 0 or a power of "
                             "two >= 16", bs);
    const char *act = qm_st_header_meta(h, "qmoe.activation");
    if (!act)
        return META_FAIL(st, "__metadata__: required key qmoe.activation is missing");
    if (qm_activation_parse(act, &cfg->activation) != 0)
        return META_FAIL(st, "__metadata__: qmoe.activation = \"%.32s\" but it must be relu, "
                             "gelu, silu, swiglu or identity", act);
    uint32_t fusion_default = cfg->activation == QM_ACT_SWIGLU ? 1 : 0;
    uint32_t normalize = 1;
    if ((rc = meta_u32(h, "qmoe.swiglu_fusion", 0, fusion_default, 0, 2, &cfg->swiglu_fusion,
                       st)) ||
        (rc = meta_u32(h, "qmoe.normalize_routing_weights", 0, 1, 0, 1, &normalize, st)) ||
        (rc = meta_float(h, "qmoe.activation_alpha", 1.0f, 0, &cfg->alpha, st)) ||
        (rc = meta_float(h, "qmoe.activation_beta", 0.0f, 0, &cfg->beta, st)) ||
        (rc = meta_float(h, "qmoe.swiglu_limit", INFINITY, 1, &cfg->limit, st)))
        return rc;
    cfg->normalize_routing = (int)normalize;
    if (!(cfg->limit > 0))
        return META_FAIL(st, "__metadata__: qmoe.swiglu_limit = %g but it must be > 0 (or inf)",
                         (double)cfg->limit);
    uint32_t pack = 8 / cfg->bits;
    if (cfg->hidden % pack != 0)
        return META_FAIL(st, "__metadata__: qmoe.hidden_size %u is not a multiple of %u "
                             "(%u-bit codes packed %u per byte)", cfg->hidden, pack, cfg->bits,
                         pack);
    if (cfg->inter % pack != 0)
        return META_FAIL(st, "__metadata__: qmoe.inter_size %u is not a multiple of %u "
                             "(%u-bit codes packed %u per byte)", cfg->inter, pack, cfg->bits,
                         pack);
    return 0;
}

/* ---- per-tensor rules ------------------------------------------------------ */

int qm__gated_fused(const qm_bank_config *cfg)
{
    return cfg->activation == QM_ACT_SWIGLU && cfg->swiglu_fusion != 0;
}

int qm__needs_fc3(const qm_bank_config *cfg)
{
    return cfg->activation == QM_ACT_SWIGLU && cfg->swiglu_fusion == 0;
}

static uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

/* Rows (N) and reduction length (K) of a projection, with their names for messages. */
static void proj_dims(const qm_bank_config *cfg, int proj, uint64_t *n, uint64_t *k,
                      char *n_why, size_t n_why_size, const char **k_name)
{
    if (proj == 1) {
        *n = qm__gated_fused(cfg) ? 2ull * cfg->inter : cfg->inter;
        *k = cfg->hidden;
        *k_name = "hidden_size";
        if (qm__gated_fused(cfg))
            snprintf(n_why, n_why_size, "2*inter_size %llu (fused swiglu)",
                     (unsigned long long)*n);
        else
            snprintf(n_why, n_why_size, "inter_size %llu", (unsigned long long)*n);
    } else if (proj == 2) {
        *n = cfg->hidden;
        *k = cfg->inter;
        *k_name = "inter_size";
        snprintf(n_why, n_why_size, "hidden_size %llu", (unsigned long long)*n);
    } else {
        *n = cfg->inter;
        *k = cfg->hidden;
        *k_name = "hidden_size";
        snprintf(n_why, n_why_size, "inter_size %llu", (unsigned long long)*n);
    }
}

static void format_shape(char *buf, size_t size, const uint64_t *shape, uint32_t ndim)
{
    size_t off = 0;
    off += (size_t)snprintf(buf + off, size - off, "[");
    for (uint32_t i = 0; i < ndim && off < size; i++)
        off += (size_t)snprintf(buf + off, size - off, "%s%llu", i ? "," : "",
                                (unsigned long long)shape[i]);
    if (off < size)
        snprintf(buf + off, size - off, "]");
}

void qm__format_shape(char *buf, size_t size, const uint64_t *shape, uint32_t ndim)
{
    format_shape(buf, size, shape, ndim);
}

int qm__check_layer_tensor(const qm_bank_config *cfg, const char *name, qm_bank_tensor t,
                           const qm_tensor_view *tv, qm_status *st)
{
    uint64_t want[3];
    uint32_t want_nd = 0;
    char why[3][96]; /* reason per dimension, used for the first mismatch */
    char nd_why[96];
    int is_float = 0;
    uint64_t e = cfg->experts;
    uint32_t pack = 8 / cfg->bits;
    uint64_t bs = cfg->block_size;

    snprintf(why[0], sizeof why[0], "qmoe.experts %u", cfg->experts);
    snprintf(nd_why, sizeof nd_why, "the format");
    if (t == QM_T_ROUTER_CORRECTION_BIAS) {
        /* Added to f32 scores before a comparison: kept in f32 so selection
         * is the family's own. */
        if (tv->dtype != QM_DTYPE_F32)
            return qm_status_set(st, QM_EINVALID_MODEL, "%s: dtype %s but it must be F32", name,
                                 qm__dtype_st_name(tv->dtype));
        is_float = 1;
        want[0] = e;
        want_nd = 1;
    } else if (t == QM_T_ROUTER_WEIGHT || t == QM_T_ROUTER_BIAS) {
        is_float = 1;
        want[0] = e;
        want[1] = cfg->hidden;
        want_nd = t == QM_T_ROUTER_WEIGHT ? 2 : 1;
        snprintf(why[1], sizeof why[1], "hidden_size %u", cfg->hidden);
    } else {
        int proj = t <= QM_T_FC1_BIAS ? 1 : t <= QM_T_FC2_BIAS ? 2 : 3;
        int kind = (int)t % 4; /* weight, scales, zero_points, bias */
        uint64_t n, k;
        const char *k_name;
        proj_dims(cfg, proj, &n, &k, why[1], sizeof why[1], &k_name);
        uint64_t nblk = bs ? ceil_div(k, bs) : 1;
        want[0] = e;
        want[1] = n;
        switch (kind) {
        case 0: /* weight */
            want[2] = k / pack;
            want_nd = 3;
            snprintf(why[2], sizeof why[2], "%s %llu at %u bits (%u per byte)", k_name,
                     (unsigned long long)k, cfg->bits, pack);
            break;
        case 1: /* scales */
            is_float = 1;
            want_nd = bs ? 3 : 2;
            want[2] = nblk;
            snprintf(nd_why, sizeof nd_why, "block_size %llu", (unsigned long long)bs);
            snprintf(why[2], sizeof why[2], "block_size %llu", (unsigned long long)bs);
            break;
        case 2: /* zero points: ORT's packed layouts */
            if (cfg->codebook)
                return qm_status_set(st, QM_EINVALID_MODEL,
                                     "%s: zero points with qmoe.codebook = %s (a code book's "
                                     "values are signed: it takes none)",
                                     name, qm_codebook_name(cfg->codebook));
            snprintf(nd_why, sizeof nd_why, "block_size %llu", (unsigned long long)bs);
            if (bs) {
                want_nd = 3;
                want[2] = ceil_div(nblk, pack);
                snprintf(why[2], sizeof why[2], "block_size %llu at %u bits", (unsigned long long)bs,
                         cfg->bits);
            } else {
                want_nd = 2;
                want[1] = ceil_div(n, pack);
                char rows[96];
                memcpy(rows, why[1], sizeof rows);
                snprintf(why[1], sizeof why[1], "%.70s packed %u per byte", rows, pack);
            }
            break;
        default: /* bias */
            is_float = 1;
            want_nd = 2;
            break;
        }
    }

    if (is_float && tv->dtype == QM_DTYPE_U8)
        return qm_status_set(st, QM_EINVALID_MODEL, "%s: dtype U8 but it must be F32, F16 or BF16",
                             name);
    if (!is_float && tv->dtype != QM_DTYPE_U8)
        return qm_status_set(st, QM_EINVALID_MODEL, "%s: dtype %s but it must be U8 (packed codes)",
                             name, qm__dtype_st_name(tv->dtype));

    int bad_dim = -1;
    if (tv->ndim != want_nd) {
        bad_dim = 3;
    } else {
        for (uint32_t i = 0; i < want_nd; i++)
            if (tv->shape[i] != want[i]) {
                bad_dim = (int)i;
                break;
            }
    }
    if (bad_dim < 0)
        return 0;
    char have_s[96], want_s[96];
    format_shape(have_s, sizeof have_s, tv->shape, tv->ndim);
    format_shape(want_s, sizeof want_s, want, want_nd);
    return qm_status_set(st, QM_EINVALID_MODEL, "%s: shape %s but %s needs %s", name, have_s,
                         bad_dim == 3 ? nd_why : why[bad_dim], want_s);
}
