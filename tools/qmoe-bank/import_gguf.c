/* import_gguf.c - `qmoe-bank import gguf FILE --out BANK [--requant-bits 4|8]`:
 * llama.cpp's stacked MoE tensors of a GGUF file into a bank.
 *
 * One bank layout (bits, block size, code book) for the whole file, chosen
 * from the ggml types of its expert tensors so that as many as possible
 * repack bit exactly (gguf_quants.h); the others are dequantised and requantised to
 * --requant-bits with their error measured. The bank is fc1 = gate, fc3 =
 * up, fc2 = down (swiglu, fusion 0), the router (ffn_gate_inp) in f32, and
 * the routing keys from the GGUF metadata, written through the bank writer
 * (model/qm_bank_writer.h: BANK.partial, resumable, checked by the loader,
 * renamed). */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf_quants.h"
#include "gguf_reader.h"
#include "import_families.h"
#include "qm_alloc.h"
#include "qm_bank.h"
#include "qm_bank_writer.h"
#include "qm_quant.h"
#include "qm_json.h"
#include "qmoe_bank_tool.h"
#include "tool_input.h"

#define BAD(st, ...) qm_status_set((st), QM_EINVALID_MODEL, __VA_ARGS__)
#define MAX_REL_PLACEHOLDER "9.999999999e+99" /* max_rel_err, rewritten at the end */

void qm__help_import_gguf(FILE *f)
{
    fputs("usage: qmoe-bank import gguf FILE --out BANK [--requant-bits 4|8]\n"
          "                               [--scales f16|f32|bf16] [--mxfp4 e2m1|int8]\n"
          "                               [--resume] [--quiet]\n"
          "\n"
          "Imports the routed experts of a llama.cpp GGUF file: blk.N.ffn_{gate,up,down}_exps,\n"
          "the router ffn_gate_inp (+ bias), exp_probs_b (a correction bias), expert biases,\n"
          "and the routing keys (expert_gating_func, expert_weights_norm,\n"
          "expert_weights_scale, expert_group_count, ...). Dense blocks and shared experts\n"
          "stay with the engine; qmoe.layer_map records the block of each bank layer.\n"
          "Architectures (general.architecture) and the family each imports as:\n",
          f);
    qm__family_help(f, 1);
    fputs("\n"
          "Q4_0, Q8_0, Q5_0, MXFP4 and Q6_K repack bit-exactly. Q4_0 alone: int4 block 32.\n"
          "MXFP4 alone: with --mxfp4 e2m1 (the default) its own 4-bit codes through the\n"
          "e2m1 code book (qmoe.codebook, docs/BANK_FORMAT.md), block 32, about the file's\n"
          "size; with --mxfp4 int8, int8 block 32 (twice the bytes: the bank onnxruntime's\n"
          "QMoE reads). With Q8_0/Q5_0/MXFP4 mixed: int8 block 32; with Q6_K: int8 block\n"
          "16. Every other type (F32, F16, BF16, Q4_1, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K) is\n"
          "requantised to --requant-bits (default 8) with scales stored as --scales\n"
          "(default f16) and the error recorded in qmoe.source; exact repacks keep scales\n"
          "that hold the source's values (Q4_0/Q8_0/Q5_0: their f16 d; MXFP4: f16 when\n"
          "every exponent fits, else f32; Q6_K: f32). The output lists which path each\n"
          "tensor type took. A bad file (unknown quant type, truncated data, missing\n"
          "tensor, metadata that contradicts the tensors) prints one line naming the\n"
          "tensor or key and exits 2, leaving no output file. BANK is written as\n"
          "BANK.partial and renamed when complete; after a crash or Ctrl-C, --resume\n"
          "continues at the first layer not yet written. A progress line is shown on a\n"
          "terminal unless --quiet.\n",
          f);
}

/* ---- what the file holds ---------------------------------------------------------- */

enum { P_GATE = 0, P_UP, P_DOWN, P_COUNT };
static const char *const PROJ_NAME[P_COUNT] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
/* Bank tensors of each projection: fc1 = gate, fc3 = up, fc2 = down. */
static const qm_bank_tensor PROJ_W[P_COUNT] = {QM_T_FC1_WEIGHT, QM_T_FC3_WEIGHT, QM_T_FC2_WEIGHT};

typedef struct moe_layer {
    uint32_t block;
    const qm__gguf_tensor *w[P_COUNT], *b[P_COUNT]; /* weights, biases (NULL when absent) */
    qm_dtype sdt[P_COUNT];                          /* each projection's scale dtype */
    int exact[P_COUNT];                             /* repacked bit for bit */
    const qm__gguf_tensor *router, *router_bias, *corr_bias;
} moe_layer;

typedef struct plan {
    const qm_family *fam;
    const char *arch;
    uint32_t E, k, H, I, n_layers;
    moe_layer *layers;
    unsigned bits, bs;
    qm_codebook cb; /* e2m1: an MXFP4 file's own codes (--mxfp4 e2m1) */
    /* routing */
    int legacy, score_sigmoid, normalize, groups, topk_groups;
    double scale;
} plan;

static int tensor_name(char *buf, size_t size, uint32_t block, const char *what)
{
    return snprintf(buf, size, "blk.%u.%s", block, what) < (int)size ? 0 : -1;
}

static const qm__gguf_tensor *find_blk(const qm__gguf_file *f, uint32_t block, const char *what)
{
    char name[96];
    tensor_name(name, sizeof name, block, what);
    return qm__gguf_find_tensor(f, name);
}

static int need_type(const qm__gguf_tensor *t, qm_status *st)
{
    char tb[16];
    uint64_t bl, by;
    if (!qm__ggml_type_size(t->type, &bl, &by))
        return BAD(st, "%s: unknown quant type %u (not a ggml type this importer knows)", t->name,
                   t->type);
    if (!qm__ggml_can_dequant(t->type))
        return BAD(st,
                   "%s: quant type %s is not supported (supported: F32, F16, BF16, Q4_0, "
                   "Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)",
                   t->name, qm__ggml_type_name(t->type, tb, sizeof tb));
    return 0;
}

static int need_shape(const qm__gguf_tensor *t, uint32_t nd, uint64_t d0, uint64_t d1, uint64_t d2,
                      const char *why, qm_status *st)
{
    uint64_t want[3] = {d0, d1, d2};
    int ok = t->n_dims == nd;
    for (uint32_t i = 0; ok && i < nd; i++)
        ok = t->ne[i] == want[i];
    if (ok) return 0;
    char have[96] = "", need[96] = "";
    size_t o = 0, p = 0;
    for (uint32_t i = 0; i < t->n_dims && o < sizeof have; i++)
        o += (size_t)snprintf(have + o, sizeof have - o, "%s%llu", i ? "," : "",
                              (unsigned long long)t->ne[i]);
    for (uint32_t i = 0; i < nd && p < sizeof need; i++)
        p += (size_t)snprintf(need + p, sizeof need - p, "%s%llu", i ? "," : "",
                              (unsigned long long)want[i]);
    return BAD(st, "%s: shape (ggml ne) [%s] but %s needs [%s]", t->name, have, why, need);
}

/* A required key in [1, max]: 0, or fails with "GGUF key KEY is missing"
 * (or "out of range") followed by `why`. */
static int required_uint(const qm__gguf_file *f, const char *key, uint64_t max, const char *why,
                         uint64_t *out, qm_status *st)
{
    int rc = qm__gguf_get_uint(f, key, out, st);
    if (rc < 0) return rc;
    if (rc == 1 || *out == 0 || *out > max)
        return BAD(st, "GGUF key %s is %s%s", key, rc == 1 ? "missing" : "out of range", why);
    return 0;
}

static int read_plan(const qm__gguf_file *f, plan *pl, unsigned requant_bits, int mxfp4_int8,
                     qm_status *st)
{
    char key[128];
    int rc;
    const qm__gguf_kv *ak = qm__gguf_find_kv(f, "general.architecture");
    if (!ak || ak->type != QM__GGUF_STRING)
        return BAD(st, "GGUF key general.architecture is missing (or not a string)");
    pl->arch = ak->str;
    pl->fam = qm_family_for_gguf(ak->str, 0);
    if (!pl->fam) {
        char archs[160];
        qm_family_names(1, archs, sizeof archs);
        return BAD(st,
                   "GGUF key general.architecture = \"%.32s\" is not a supported MoE "
                   "architecture (%s)",
                   ak->str, archs);
    }
    uint64_t E = 0, k = 0, blocks = 0, dense = 0, v;
#define KEY(name) (snprintf(key, sizeof key, "%s." name, pl->arch), key)
    char k_range[96];
    if ((rc = required_uint(f, KEY("expert_count"), 65536, " (an MoE file needs 1..65536 experts)",
                            &E, st)))
        return rc;
    snprintf(k_range, sizeof k_range, " but it must be in [1, %s.expert_count = %llu]", pl->arch,
             (unsigned long long)E);
    if ((rc = required_uint(f, KEY("expert_used_count"), E, k_range, &k, st)) ||
        (rc = required_uint(f, KEY("block_count"), 65536, " (1..65536 blocks)", &blocks, st)))
        return rc;
    if ((rc = qm__gguf_get_uint(f, KEY("leading_dense_block_count"), &dense, st)) < 0) return rc;
    if (dense > blocks)
        return BAD(st, "GGUF key %s = %llu exceeds %s.block_count = %llu", key,
                   (unsigned long long)dense, pl->arch, (unsigned long long)blocks);
    pl->E = (uint32_t)E;
    pl->k = (uint32_t)k;
    for (size_t i = 0; i < f->n_tensors; i++) {
        unsigned b;
        char rest[64];
        if (sscanf(f->tensors[i].name, "blk.%u.%63s", &b, rest) == 2 && b >= blocks &&
            strstr(rest, "_exps"))
            return BAD(st, "%s: block %u but %s.block_count is %llu", f->tensors[i].name, b,
                       pl->arch, (unsigned long long)blocks);
    }
    pl->layers = qm_calloc((size_t)blocks, sizeof *pl->layers);
    if (!pl->layers) return qm_status_set(st, QM_ENOMEM, "out of memory");
    for (uint32_t b = 0; b < blocks; b++) {
        const qm__gguf_tensor *gate = find_blk(f, b, "ffn_gate_exps.weight");
        if (find_blk(f, b, "ffn_gate_up_exps.weight"))
            return BAD(st,
                       "blk.%u.ffn_gate_up_exps.weight: fused gate+up experts are not "
                       "supported (expected ffn_gate_exps and ffn_up_exps)",
                       b);
        if (!gate) {
            if (b >= dense)
                return BAD(st,
                           "missing tensor blk.%u.ffn_gate_exps.weight (block %u is past "
                           "%s.leading_dense_block_count = %llu, so it must be MoE)",
                           b, b, pl->arch, (unsigned long long)dense);
            continue;
        }
        moe_layer *L = &pl->layers[pl->n_layers++];
        L->block = b;
        static const char *const bias_names[P_COUNT] = {"ffn_gate_exps.bias", "ffn_up_exps.bias",
                                                        "ffn_down_exps.bias"};
        for (int p = 0; p < P_COUNT; p++) {
            char nm[64];
            snprintf(nm, sizeof nm, "%s.weight", PROJ_NAME[p]);
            L->w[p] = find_blk(f, b, nm);
            if (!L->w[p]) return BAD(st, "missing tensor blk.%u.%s", b, nm);
            if ((rc = need_type(L->w[p], st))) return rc;
            L->b[p] = find_blk(f, b, bias_names[p]);
        }
        L->router = find_blk(f, b, "ffn_gate_inp.weight");
        if (!L->router) return BAD(st, "missing tensor blk.%u.ffn_gate_inp.weight (the router)", b);
        L->router_bias = find_blk(f, b, "ffn_gate_inp.bias");
        L->corr_bias = find_blk(f, b, "exp_probs_b.bias");
        if (!L->corr_bias) L->corr_bias = find_blk(f, b, "exp_probs_b");
    }
    if (pl->n_layers == 0)
        return BAD(st, "no MoE expert tensors (blk.N.ffn_gate_exps.weight) in the file");

    /* Shapes: every layer as the first, and the metadata agreeing. */
    const moe_layer *L0 = &pl->layers[0];
    pl->H = (uint32_t)L0->w[P_GATE]->ne[0];
    pl->I = (uint32_t)L0->w[P_GATE]->ne[1];
    if (L0->w[P_GATE]->n_dims == 3 && L0->w[P_GATE]->ne[2] != E)
        return BAD(st,
                   "GGUF key %s.expert_count = %llu contradicts %s, which holds %llu experts "
                   "(ne[2])",
                   pl->arch, (unsigned long long)E, L0->w[P_GATE]->name,
                   (unsigned long long)L0->w[P_GATE]->ne[2]);
    if ((rc = qm__gguf_get_uint(f, KEY("embedding_length"), &v, st)) < 0) return rc;
    if (rc == 0 && v != pl->H)
        return BAD(st, "GGUF key %s = %llu contradicts %s (ne[0] = %u)", key, (unsigned long long)v,
                   L0->w[P_GATE]->name, pl->H);
    if ((rc = qm__gguf_get_uint(f, KEY("expert_feed_forward_length"), &v, st)) < 0) return rc;
    if (rc == 0 && v != pl->I)
        return BAD(st, "GGUF key %s = %llu contradicts %s (ne[1] = %u)", key, (unsigned long long)v,
                   L0->w[P_GATE]->name, pl->I);
    if (pl->H == 0 || pl->I == 0 || pl->H > (1u << 20) || pl->I > (1u << 20) || pl->H % 2 ||
        pl->I % 2)
        return BAD(st, "%s: hidden %u and expert width %u must be even and in [2, 2^20]",
                   L0->w[P_GATE]->name, pl->H, pl->I);
    for (uint32_t l = 0; l < pl->n_layers; l++) {
        const moe_layer *L = &pl->layers[l];
        if ((rc = need_shape(L->w[P_GATE], 3, pl->H, pl->I, E, "[hidden, expert width, experts]",
                             st)) ||
            (rc = need_shape(L->w[P_UP], 3, pl->H, pl->I, E, "the gate's shape", st)) ||
            (rc = need_shape(L->w[P_DOWN], 3, pl->I, pl->H, E, "[expert width, hidden, experts]",
                             st)) ||
            (rc = need_shape(L->router, 2, pl->H, E, 0, "[hidden, experts]", st)) ||
            (rc = need_type(L->router, st)))
            return rc;
        const qm__gguf_tensor *vec[2] = {L->router_bias, L->corr_bias};
        for (int i = 0; i < 2; i++)
            if (vec[i] && ((rc = need_shape(vec[i], 1, E, 0, 0, "[experts]", st)) ||
                           (rc = need_type(vec[i], st))))
                return rc;
        for (int p = 0; p < P_COUNT; p++)
            if (L->b[p] && ((rc = need_shape(L->b[p], 2, p == P_DOWN ? pl->H : pl->I, E, 0,
                                             "[rows, experts]", st)) ||
                            (rc = need_type(L->b[p], st))))
                return rc;
        if (!L->b[P_GATE] != !L0->b[P_GATE] || !L->b[P_UP] != !L0->b[P_UP] ||
            !L->b[P_DOWN] != !L0->b[P_DOWN] || !L->corr_bias != !L0->corr_bias ||
            !L->router_bias != !L0->router_bias)
            return BAD(st,
                       "blk.%u: its biases differ from blk.%u's (every MoE block must have "
                       "the same optional tensors)",
                       L->block, L0->block);
    }

    /* Routing: the file's keys, else llama.cpp's default for the architecture. */
    uint64_t gating = 1, gcount = 1, gused = 0;
    int norm = pl->fam->gguf_norm_default;
    double scale = 1.0;
    if ((rc = qm__gguf_get_uint(f, KEY("expert_gating_func"), &gating, st)) < 0 ||
        (rc = qm__gguf_get_bool(f, KEY("expert_weights_norm"), &norm, st)) < 0 ||
        (rc = qm__gguf_get_float(f, KEY("expert_weights_scale"), &scale, st)) < 0 ||
        (rc = qm__gguf_get_uint(f, KEY("expert_group_count"), &gcount, st)) < 0 ||
        (rc = qm__gguf_get_uint(f, KEY("expert_group_used_count"), &gused, st)) < 0)
        return rc;
    if (gating == 0) gating = 1;
    if (gating > 3)
        return BAD(st,
                   "GGUF key %s.expert_gating_func = %llu is unknown (1 softmax, 2 sigmoid, "
                   "3 softmax over the selected)",
                   pl->arch, (unsigned long long)gating);
    if (scale == 0.0) scale = 1.0; /* llama.cpp: 0 = not set */
    /* The bank loader's rule for qmoe.routing.scale: a finite f32 > 0. */
    if (!(scale > 0.0) || !isfinite((float)scale) || !((float)scale > 0.0f))
        return BAD(st,
                   "GGUF key %s.expert_weights_scale = %g must be 0 (unset) or a finite "
                   "number > 0 that an f32 holds",
                   pl->arch, scale);
    if (gcount == 0) gcount = 1;
    if (gused == 0) gused = gcount;
    if (E % gcount != 0 || gused > gcount)
        return BAD(st,
                   "GGUF keys %s.expert_group_count = %llu / expert_group_used_count = %llu "
                   "do not fit %llu experts",
                   pl->arch, (unsigned long long)gcount, (unsigned long long)gused,
                   (unsigned long long)E);
    if (gused * (E / gcount) < k)
        return BAD(st,
                   "GGUF key %s.expert_group_used_count = %llu keeps %llu experts, fewer than "
                   "expert_used_count %llu",
                   pl->arch, (unsigned long long)gused, (unsigned long long)(gused * (E / gcount)),
                   (unsigned long long)k);
    if (gating == 2 && gcount > 1 && E / gcount < 2)
        return BAD(st,
                   "GGUF key %s.expert_group_count = %llu leaves %llu expert per group, but "
                   "sigmoid gating scores a group by its two best (top2_sum)",
                   pl->arch, (unsigned long long)gcount, (unsigned long long)(E / gcount));
    pl->score_sigmoid = gating == 2;
    pl->normalize = gating == 3 ? 1 : norm;
    pl->scale = scale;
    pl->groups = (int)gcount;
    pl->topk_groups = (int)gused;
    pl->legacy =
        !pl->score_sigmoid && pl->normalize && scale == 1.0 && gcount == 1 && !L0->corr_bias;
    if (L0->corr_bias && !pl->score_sigmoid && gating != 1)
        return BAD(st, "%s: a correction bias needs softmax or sigmoid gating",
                   L0->corr_bias->name);
    pl->fam = qm_family_for_gguf(pl->arch, pl->score_sigmoid); /* deepseek2: V2 or V3 */
#undef KEY

    /* The layout: exact for as many expert tensors as one (bits, block) allows. */
    int only_q40 = 1, only_mxfp4 = 1, any_q6k = 0, any_requant = 0;
    for (uint32_t l = 0; l < pl->n_layers; l++)
        for (int p = 0; p < P_COUNT; p++) {
            uint32_t t = pl->layers[l].w[p]->type;
            only_q40 &= t == QM__GGML_Q4_0;
            only_mxfp4 &= t == QM__GGML_MXFP4;
            any_q6k |= t == QM__GGML_Q6_K;
            any_requant |= !qm__ggml_exact_fits(t, 8, QM_CODEBOOK_NONE, 16, QM_DTYPE_F32);
        }
    if (only_q40) {
        pl->bits = 4;
        pl->bs = 32;
    } else if (only_mxfp4 && !mxfp4_int8) {
        pl->bits = 4;
        pl->bs = 32;
        pl->cb = QM_CODEBOOK_E2M1;
    } else if (!any_requant) {
        pl->bits = 8;
        pl->bs = any_q6k ? 16 : 32;
    } else {
        pl->bits = requant_bits;
        pl->bs = requant_bits == 8 && any_q6k ? 16 : 32;
    }
    if (pl->H % pl->bs || pl->I % pl->bs)
        return BAD(st,
                   "%s: hidden %u and expert width %u must be multiples of the bank's "
                   "block size %u",
                   L0->w[P_GATE]->name, pl->H, pl->I, pl->bs);
    return 0;
}

/* ---- the bank --------------------------------------------------------------------- */

/* Every E8M0 exponent e of an MXFP4 tensor has 2^(e-128) exact in f16:
 * e in [104, 143]. */
static int mxfp4_fits_f16(const qm__gguf_tensor *t)
{
    for (uint64_t at = 0; at + 17 <= t->nbytes; at += 17)
        if (t->data[at] < 104 || t->data[at] > 143) return 0;
    return 1;
}

/* Each projection's scale dtype and path. Exact repacks keep a scale dtype
 * that holds the source's scales unchanged: Q4_0/Q8_0/Q5_0's own f16 d;
 * MXFP4's 2^(e-128) in f16 when every exponent fits (or bf16, as asked),
 * else f32; Q6_K's d*sc products in f32. Requantised tensors take --scales
 * (sdt, default f16). */
static void choose_scales(plan *pl, qm_dtype sdt)
{
    for (uint32_t l = 0; l < pl->n_layers; l++)
        for (int p = 0; p < P_COUNT; p++) {
            moe_layer *L = &pl->layers[l];
            uint32_t type = L->w[p]->type;
            qm_dtype d = QM_DTYPE_F32;
            if (type == QM__GGML_Q4_0 || type == QM__GGML_Q8_0 || type == QM__GGML_Q5_0)
                d = QM_DTYPE_F16;
            else if (type == QM__GGML_MXFP4)
                d = sdt == QM_DTYPE_BF16                             ? QM_DTYPE_BF16
                    : sdt == QM_DTYPE_F16 && mxfp4_fits_f16(L->w[p]) ? QM_DTYPE_F16
                                                                     : QM_DTYPE_F32;
            L->exact[p] = qm__ggml_exact_fits(type, pl->bits, pl->cb, pl->bs, d);
            L->sdt[p] = L->exact[p] ? d : sdt;
        }
}

typedef struct type_stats {
    uint32_t type;
    unsigned count;
    int exact;
    qm_dtype sdt;
    double max_rel;
} type_stats;

typedef struct job {
    const char *in_path, *out_path;
    qm_bank_writer *w;
    type_stats ts[32];
    size_t n_ts;
    double max_rel;
} job;

static type_stats *stats_for(job *j, uint32_t type, int exact, qm_dtype sdt)
{
    for (size_t i = 0; i < j->n_ts; i++)
        if (j->ts[i].type == type) return &j->ts[i];
    type_stats *s = &j->ts[j->n_ts++];
    *s = (type_stats){.type = type, .exact = exact, .sdt = sdt};
    return s;
}

static int not_finite(const qm__gguf_tensor *src, uint64_t expert, uint64_t row, qm_status *st)
{
    return BAD(st, "%s: holds a NaN or infinity (expert %llu, row %llu)", src->name,
               (unsigned long long)expert, (unsigned long long)row);
}

/* One stacked expert tensor [E, N, K] of bank layer l into codes [E, N, K/pack]
 * (tensor tw) and scales (tw + 1). */
static int write_experts(job *j, const plan *pl, uint32_t l, int p, qm_status *st)
{
    const qm__gguf_tensor *src = pl->layers[l].w[p];
    const int tw = PROJ_W[p];
    uint32_t E = pl->E, N = (uint32_t)src->ne[1], K = (uint32_t)src->ne[0];
    uint64_t row_bytes = src->nbytes / ((uint64_t)E * N), nblk = K / pl->bs;
    qm_dtype sdt = pl->layers[l].sdt[p];
    int exact = pl->layers[l].exact[p];
    size_t ssz = qm_dtype_size(sdt);
    uint64_t code_bytes = qm_bank_writer_tensor_bytes(j->w, l, tw);
    uint64_t scale_bytes = qm_bank_writer_tensor_bytes(j->w, l, tw + 1);
    uint8_t *codes = qm_calloc((size_t)code_bytes, 1);
    uint8_t *scales = qm_malloc((size_t)scale_bytes);
    float *row = qm_malloc((size_t)K * sizeof(float));
    int rc = 0;
    if (!codes || !scales || !row) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory converting %s", src->name);
        goto done;
    }
    const qm_quant_spec q = {.bits = pl->bits, .block_size = pl->bs, .scale_dtype = sdt};
    type_stats *ts = stats_for(j, src->type, exact, sdt);
    uint64_t code_row = (uint64_t)K * pl->bits / 8;
    for (uint32_t e = 0; e < E; e++) {
        qm_quant_error err = QM_QUANT_ERROR_INIT;
        for (uint32_t n = 0; n < N; n++) {
            uint64_t r = (uint64_t)e * N + n;
            const uint8_t *in = src->data + r * row_bytes;
            uint8_t *out = codes + r * code_row;
            void *sc = scales + r * nblk * ssz;
            /* The values the file means, checked on every path: a NaN or
             * infinite scale would repack "exactly" into a bank of garbage. */
            qm__ggml_dequant_row(src->type, in, K, row);
            if (exact) {
                if (!qm_quant_finite(row, K)) {
                    rc = not_finite(src, r / N, r % N, st);
                    goto done;
                }
                qm__ggml_repack_row(src->type, in, K, pl->bits, pl->cb, pl->bs, sdt, out, sc);
                continue;
            }
            int qrc = qm_quant_row(&q, row, K, out, sc, 0, NULL, &err);
            if (qrc == QM_EUNSUPPORTED) {
                rc = BAD(st,
                         "%s: a block scale is beyond %s's range (expert %llu, row %llu; "
                         "rerun with --scales f32)",
                         src->name, qm_dtype_name(sdt), (unsigned long long)(r / N),
                         (unsigned long long)(r % N));
                goto done;
            }
            if (qrc != 0) {
                rc = not_finite(src, r / N, r % N, st);
                goto done;
            }
        }
        if (!exact) {
            double rel = qm_quant_error_rel(&err);
            ts->max_rel = rel > ts->max_rel ? rel : ts->max_rel;
            j->max_rel = rel > j->max_rel ? rel : j->max_rel;
        }
    }
    if ((rc = qm_bank_writer_put(j->w, l, tw, 0, codes, code_bytes, st)) == 0)
        rc = qm_bank_writer_put(j->w, l, tw + 1, 0, scales, scale_bytes, st);
done:
    qm_free(codes);
    qm_free(scales);
    qm_free(row);
    return rc;
}

/* A float tensor (router, biases) widened to f32 as is: exact for F32, F16
 * and BF16, the ggml value for a quantised router. */
static int write_f32(job *j, uint32_t l, const qm__gguf_tensor *src, int t, qm_status *st)
{
    uint64_t bytes = qm_bank_writer_tensor_bytes(j->w, l, t), n = bytes / 4, K = src->ne[0];
    float *buf = qm_malloc((size_t)bytes);
    if (!buf) return qm_status_set(st, QM_ENOMEM, "out of memory converting %s", src->name);
    uint64_t row_bytes = src->nbytes / (n / K);
    for (uint64_t r = 0; r < n / K; r++)
        qm__ggml_dequant_row(src->type, src->data + r * row_bytes, K, buf + r * K);
    int rc = qm_quant_finite(buf, n) ? qm_bank_writer_put(j->w, l, t, 0, buf, bytes, st)
                                     : BAD(st, "%s: holds a NaN or infinity", src->name);
    qm_free(buf);
    return rc;
}

/* The bank's tensors per layer, in the order they are listed and placed:
 * fc1 = gate, fc3 = up, fc2 = down, each weight, scales, bias; the router. */
static const qm_bank_tensor GGUF_ORDER[] = {
    QM_T_FC1_WEIGHT, QM_T_FC1_SCALES,    QM_T_FC1_BIAS,    QM_T_FC3_WEIGHT,
    QM_T_FC3_SCALES, QM_T_FC3_BIAS,      QM_T_FC2_WEIGHT,  QM_T_FC2_SCALES,
    QM_T_FC2_BIAS,   QM_T_ROUTER_WEIGHT, QM_T_ROUTER_BIAS, QM_T_ROUTER_CORRECTION_BIAS};

static int source_json(const job *j, const plan *pl, int exact_all, const char *err, char *buf,
                       size_t size)
{
    char base[512];
    const char *slash = strrchr(j->in_path, '/');
    qm_json_escape_str(slash ? slash + 1 : j->in_path, base, sizeof base);
    int n = snprintf(buf, size,
                     "{\"format\":\"gguf\",\"family\":\"%s\",\"arch\":\"%s\",\"files\":[\"%s\"],"
                     "\"exact\":%s%s%s}",
                     pl->fam->name, pl->arch, base, exact_all ? "true" : "false",
                     exact_all ? "" : ",\"max_rel_err\":", exact_all ? "" : err);
    return n > 0 && (size_t)n < size ? 0 : -1;
}

static int build_and_write(job *j, const plan *pl, int resume, int quiet, uint32_t *first,
                           qm_status *st)
{
    int rc = 0;
    const uint32_t E = pl->E, H = pl->H, I = pl->I;
    const qm_bank_config cfg = {.layers = pl->n_layers,
                                .experts = E,
                                .hidden = H,
                                .inter = I,
                                .k = pl->k,
                                .bits = pl->bits,
                                .codebook = pl->cb,
                                .block_size = pl->bs,
                                .activation = QM_ACT_SWIGLU,
                                .swiglu_fusion = 0};
    qm_bank_plan_tensor *tensors = qm_calloc((size_t)pl->n_layers * QM_T_COUNT, sizeof *tensors);
    if (!tensors) return qm_status_set(st, QM_ENOMEM, "out of memory planning the bank");
    /* 1. Plan every tensor. */
    for (uint32_t l = 0; l < pl->n_layers; l++) {
        const moe_layer *L = &pl->layers[l];
        const qm_bank_layer_opts lo = {.scale_dtype = QM_DTYPE_F32,
                                       .bias_dtype = QM_DTYPE_F32,
                                       .router_dtype = QM_DTYPE_F32,
                                       .fc1_bias = L->b[P_GATE] != NULL,
                                       .fc2_bias = L->b[P_DOWN] != NULL,
                                       .fc3_bias = L->b[P_UP] != NULL,
                                       .router_weight = 1,
                                       .router_bias = L->router_bias != NULL,
                                       .correction_bias = L->corr_bias != NULL};
        qm_bank_plan_tensor *t = &tensors[(size_t)l * QM_T_COUNT];
        qm_bank_plan_layer(&cfg, &lo, t);
        for (int p = 0; p < P_COUNT; p++)
            t[PROJ_W[p] + 1].dtype = L->sdt[p];
    }

    /* 2. Metadata. */
    char v_layers[16], v_E[16], v_H[16], v_I[16], v_k[16], v_bits[8], v_bs[16];
    char v_scale[32], v_groups[16], v_topk[16], layer_map[4096], source[1024];
    snprintf(v_layers, sizeof v_layers, "%u", pl->n_layers);
    snprintf(v_E, sizeof v_E, "%u", E);
    snprintf(v_H, sizeof v_H, "%u", H);
    snprintf(v_I, sizeof v_I, "%u", I);
    snprintf(v_k, sizeof v_k, "%u", pl->k);
    snprintf(v_bits, sizeof v_bits, "%u", pl->bits);
    snprintf(v_bs, sizeof v_bs, "%u", pl->bs);
    snprintf(v_scale, sizeof v_scale, "%.9g", pl->scale);
    snprintf(v_groups, sizeof v_groups, "%d", pl->groups);
    snprintf(v_topk, sizeof v_topk, "%d", pl->topk_groups);
    size_t o = (size_t)snprintf(layer_map, sizeof layer_map, "[");
    int identity = 1;
    for (uint32_t l = 0; l < pl->n_layers && o < sizeof layer_map; l++) {
        identity &= pl->layers[l].block == l;
        o += (size_t)snprintf(layer_map + o, sizeof layer_map - o, "%s%u", l ? "," : "",
                              pl->layers[l].block);
    }
    if (o + 2 > sizeof layer_map) {
        rc = BAD(st, "too many MoE layers for qmoe.layer_map");
        goto done;
    }
    snprintf(layer_map + o, sizeof layer_map - o, "]");
    int exact_all = 1;
    for (uint32_t l = 0; l < pl->n_layers; l++)
        for (int p = 0; p < P_COUNT; p++)
            exact_all &= pl->layers[l].exact[p];
    if (source_json(j, pl, exact_all, MAX_REL_PLACEHOLDER, source, sizeof source) != 0) {
        rc = BAD(st, "the file name is too long for qmoe.source");
        goto done;
    }
    qm_st_meta meta[24];
    size_t nm = 0;
#define META(k, v) (meta[nm].key = (char *)(k), meta[nm].value = (char *)(v), nm++)
    META("qmoe.format", "1");
    META("qmoe.layers", v_layers);
    META("qmoe.experts", v_E);
    META("qmoe.hidden_size", v_H);
    META("qmoe.inter_size", v_I);
    META("qmoe.k", v_k);
    META("qmoe.activation", "swiglu");
    META("qmoe.bits", v_bits);
    META("qmoe.block_size", v_bs);
    if (pl->cb) META("qmoe.codebook", qm_codebook_name(pl->cb));
    META("qmoe.swiglu_fusion", "0");
    META("qmoe.normalize_routing_weights", "1");
    if (pl->fam->flags & QM_FAMILY_OAI_SWIGLU) {
        /* llama.cpp's swiglu_oai: not in the GGUF, fixed by the architecture. */
        META("qmoe.activation_alpha", "1.702");
        META("qmoe.activation_beta", "1");
        META("qmoe.swiglu_limit", "7");
    }
    if (!pl->legacy) {
        META("qmoe.routing.score", pl->score_sigmoid ? "sigmoid" : "softmax");
        META("qmoe.routing.normalize", pl->normalize ? "1" : "0");
        META("qmoe.routing.scale", v_scale);
        if (pl->groups > 1) {
            META("qmoe.routing.groups", v_groups);
            META("qmoe.routing.topk_groups", v_topk);
            META("qmoe.routing.group_score", pl->score_sigmoid ? "top2_sum" : "max");
        }
    }
    if (!identity) META("qmoe.layer_map", layer_map);
    META("qmoe.source", source);
#undef META
    const qm_bank_writer_spec spec = {.layers = pl->n_layers,
                                      .experts = E,
                                      .tensors = tensors,
                                      .order = GGUF_ORDER,
                                      .n_order = sizeof GGUF_ORDER / sizeof GGUF_ORDER[0],
                                      .meta = meta,
                                      .n_meta = nm,
                                      .deferred_key = exact_all ? NULL : "qmoe.source",
                                      .tool = "import gguf"};

    /* 3. Header, then layer by layer, then the measured error into the header. */
    if ((rc = qm_bank_writer_open(&spec, j->out_path, resume, &j->w, first, &j->max_rel, st)) != 0)
        goto done;
    uint64_t layer_src = 0, total_src = 0;
    for (uint32_t l = 0; l < pl->n_layers; l++)
        for (int p = 0; p < P_COUNT; p++)
            total_src += pl->layers[l].w[p]->nbytes;
    layer_src = total_src / pl->n_layers;
    qm_bank_writer_progress(j->w, !quiet && isatty(2), *first * layer_src);
    for (uint32_t l = 0; l < pl->n_layers; l++) {
        const moe_layer *L = &pl->layers[l];
        for (int p = 0; p < P_COUNT; p++)
            stats_for(j, L->w[p]->type, L->exact[p], L->sdt[p])->count++;
        if (l < *first) continue;
        for (int p = 0; p < P_COUNT && rc == 0; p++) {
            if (qm__interrupted()) {
                rc = qm_status_set(st, QM_ESHUTTING_DOWN, "interrupted");
                goto done;
            }
            rc = write_experts(j, pl, l, p, st);
            if (rc == 0 && L->b[p]) rc = write_f32(j, l, L->b[p], PROJ_W[p] + 3, st);
        }
        if (rc == 0) rc = write_f32(j, l, L->router, QM_T_ROUTER_WEIGHT, st);
        if (rc == 0 && L->router_bias) rc = write_f32(j, l, L->router_bias, QM_T_ROUTER_BIAS, st);
        if (rc == 0 && L->corr_bias)
            rc = write_f32(j, l, L->corr_bias, QM_T_ROUTER_CORRECTION_BIAS, st);
        if (rc == 0)
            rc = qm_bank_writer_layer_done(j->w, l, j->max_rel, (l + 1) * layer_src, total_src, st);
        if (rc) goto done;
    }
    if (qm__interrupted()) {
        rc = qm_status_set(st, QM_ESHUTTING_DOWN, "interrupted");
        goto done;
    }
    char val[32];
    snprintf(val, sizeof val, "%.9e", j->max_rel);
    if (!exact_all && (strlen(val) != strlen(MAX_REL_PLACEHOLDER) ||
                       source_json(j, pl, exact_all, val, source, sizeof source) != 0)) {
        rc = qm_status_set(st, QM_EINTERNAL, "cannot record max_rel_err %s", val);
        goto done;
    }
    rc = qm_bank_writer_finish(j->w, exact_all ? NULL : source, NULL, st);
done:
    qm_free(tensors);
    return rc;
}

/* ---- the command -------------------------------------------------------------------- */

int qm__cmd_import_gguf(int argc, char **argv)
{
    return qm__gguf_run(NULL, argc, argv);
}

/* A usage error of `import gguf`: the line on stderr, then the file a
 * caller handed over is closed; QM__EXIT_USAGE. */
static int gguf_usage(qm__gguf_file *given, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static int gguf_usage(qm__gguf_file *given, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "qmoe-bank import gguf: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    qm__gguf_close(given);
    return QM__EXIT_USAGE;
}

int qm__gguf_run(qm__gguf_file *given, int argc, char **argv)
{
    static const struct option longopts[] = {{"out", required_argument, 0, 'o'},
                                             {"requant-bits", required_argument, 0, 'b'},
                                             {"scales", required_argument, 0, 's'},
                                             {"mxfp4", required_argument, 0, 'm'},
                                             {"resume", no_argument, 0, 'r'},
                                             {"quiet", no_argument, 0, 'q'},
                                             {"help", no_argument, 0, 'h'},
                                             {0, 0, 0, 0}};
    const char *out = NULL;
    unsigned requant_bits = 8;
    qm_dtype sdt = QM_DTYPE_F16;
    int quiet = 0, resume = 0, mxfp4_int8 = 0, c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        if (c == 'o') {
            out = optarg;
        } else if (c == 'b') {
            if (qm__parse_u32(optarg, 8, &requant_bits) != 0 ||
                (requant_bits != 4 && requant_bits != 8))
                return gguf_usage(given, "--requant-bits takes 4 or 8, not \"%.32s\"", optarg);
        } else if (c == 's') {
            if (qm__parse_scale_dtype(optarg, &sdt))
                return gguf_usage(given, "--scales takes f16, f32 or bf16, not \"%.32s\"",
                                  optarg);
        } else if (c == 'm') {
            if (strcmp(optarg, "e2m1") != 0 && strcmp(optarg, "int8") != 0)
                return gguf_usage(given, "--mxfp4 takes e2m1 or int8, not \"%.32s\"", optarg);
            mxfp4_int8 = strcmp(optarg, "int8") == 0;
        } else if (c == 'r') {
            resume = 1;
        } else if (c == 'q') {
            quiet = 1;
        } else if (c == 'h') {
            qm__help_import_gguf(stdout);
            qm__gguf_close(given);
            return QM__EXIT_OK;
        } else {
            return gguf_usage(given, "unknown option \"%.64s\" (see --help)", argv[optind - 1]);
        }
    }
    if (optind != argc - 1 || !out)
        return gguf_usage(given, "expected FILE and --out BANK (see --help)");
    qm__catch_interrupts();
    job j = {.in_path = argv[optind], .out_path = out};
    plan pl = {0};
    qm__gguf_file *f = given;
    qm_status st;
    qm_status_clear(&st);
    int rc = 0, ret = QM__EXIT_OK, keep = 0;
    uint32_t first = 0;
    if ((!f && (rc = qm__gguf_open(j.in_path, &f, &st)) != 0) ||
        (rc = read_plan(f, &pl, requant_bits, mxfp4_int8, &st)) != 0 ||
        (choose_scales(&pl, sdt), rc = build_and_write(&j, &pl, resume, quiet, &first, &st)) != 0)
        goto fail;
    if (!quiet) {
        struct stat sb;
        printf("imported %s (%s, family %s): %u MoE layers of %u blocks, %u experts, k %u, "
               "hidden %u, expert width %u\n",
               j.in_path, pl.arch, pl.fam->name, pl.n_layers, pl.layers[pl.n_layers - 1].block + 1,
               pl.E, pl.k, pl.H, pl.I);
        if (first)
            printf("resumed %s.partial at layer %u of %u (the errors below are of the layers "
                   "this run converted)\n",
                   out, first, pl.n_layers);
        for (size_t i = 0; i < j.n_ts; i++) {
            const type_stats *s = &j.ts[i];
            char tb[16];
            char layout[32];
            if (pl.cb)
                snprintf(layout, sizeof layout, "%s code book", qm_codebook_name(pl.cb));
            else
                snprintf(layout, sizeof layout, "int%u", pl.bits);
            printf("  %-6s %3u tensors: %s -> %s block %u, %s scales",
                   qm__ggml_type_name(s->type, tb, sizeof tb), s->count,
                   s->exact ? "exact repack" : "requantised", layout, pl.bs, qm_dtype_name(s->sdt));
            if (!s->exact) printf(", max rel err %.3e", s->max_rel);
            printf("\n");
        }
        printf("routing: %s\n", pl.legacy ? "legacy (top-k of the logits, softmax over the k)"
                                : pl.score_sigmoid ? "sigmoid scores (qmoe.routing.*)"
                                                   : "softmax scores (qmoe.routing.*)");
        int exact = 1;
        for (size_t i = 0; i < j.n_ts; i++)
            exact &= j.ts[i].exact;
        printf("wrote %s: exact %s", out, exact ? "yes" : "no");
        if (!exact) printf(", max_rel_err %.3e", j.max_rel);
        if (stat(out, &sb) == 0) printf(", %lld bytes", (long long)sb.st_size);
        printf("\n");
    }
    if (pl.bs % 32 != 0) {
        /* On stderr, --quiet or not: an engine that imports for its user
         * (llama.cpp's --qmoed-bank) shows it. */
        struct stat ob, gb;
        char ratio[64] = "";
        if (stat(out, &ob) == 0 && stat(j.in_path, &gb) == 0 && gb.st_size > 0)
            snprintf(ratio, sizeof ratio, ", %.2fx the GGUF file",
                     (double)ob.st_size / (double)gb.st_size);
        fprintf(stderr,
                "note: %s: blocks of %u columns (Q6_K's exact repack) have no fast kernel: "
                "sessions of this bank compute in exact precision whatever they ask; it holds "
                "%d-bit codes%s; --requant-bits 4 requantises every tensor to int4 blocks of 32: "
                "fast decode at about a Q4_0's size and error (docs/IMPORT.md, K-quant files)\n",
                out, pl.bs, pl.bits, ratio);
    }
    goto done;
fail:
    ret = rc == QM_EIO || rc == QM_ENOMEM || rc == QM_EINTERNAL ? QM__EXIT_FAIL : QM__EXIT_USAGE;
    if (rc == QM_ESHUTTING_DOWN) {
        char what[160];
        keep = j.w && qm_bank_writer_layers_done(j.w) > 0;
        snprintf(what, sizeof what, "interrupted after %u of %u layers; ",
                 j.w ? qm_bank_writer_layers_done(j.w) : 0, pl.n_layers);
        qm__print_line(stderr, "import gguf", j.in_path, ": ", what,
                       keep ? "the partial file is kept: rerun with --resume" : "nothing was kept",
                       NULL);
    } else {
        /* A layer recorded done is worth a --resume (bad input would stop a
         * resume at the same bytes); before that nothing is kept. */
        keep = j.w && qm_bank_writer_layers_done(j.w) > 0 && ret == QM__EXIT_FAIL;
        qm__print_line(stderr, "import gguf", j.in_path, ": ", st.msg[0] ? st.msg : qm_strerror(rc),
                       keep ? " (the partial file is kept: rerun with --resume)" : "", NULL);
    }
done:
    qm_bank_writer_free(j.w, keep);
    qm_free(pl.layers);
    qm__gguf_close(f);
    qm__reraise(); /* an interrupted import ends as the signal would have ended it */
    return ret;
}
