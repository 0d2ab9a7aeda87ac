/* bank_create.c - `qmoe-bank create`: a deterministic synthetic bank.
 *
 * Weights come from a counter-based generator keyed by (seed, layer,
 * projection, expert), so any slice can be produced alone: the file is
 * written expert slice by expert slice with pwrite, and memory stays at one
 * slice whatever the bank's size. Quantisation is model/qm_quant.h's with
 * onnxruntime's QMoE tests' recipe (codes against the f32 scale); a code
 * book bank's codes are the nearest of its values (e2m1_row). */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_bank.h"
#include "qm_bank_writer.h"
#include "qm_quant.h"
#include "qmoe_bank_tool.h"

void qm__help_create(FILE *f)
{
    fputs("usage: qmoe-bank create --out FILE --layers L --experts E --hidden H --inter I\n"
          "                        --k K --bits 4|8 --block-size BS --activation ACT\n"
          "                        [--swiglu-fusion 0|1|2] [--asymmetric] [--router]\n"
          "                        [--seed S] [--scale-dtype f32|f16|bf16] [--no-bias]\n"
          "                        [--alpha A] [--beta B] [--limit X] [--codebook e2m1]\n"
          "                        [--quiet]\n"
          "\n"
          "Writes a deterministic synthetic bank: float weights from a generator seeded by\n"
          "S (default 1), quantised per row (BS 0) or per block of BS columns (a power of\n"
          "two >= 16) the way onnxruntime's QMoE tests do: symmetric (implicit zero point\n"
          "2^(bits-1)) or, with --asymmetric, min/max with packed zero points; scales floored\n"
          "at 1e-8, rounding half to even. Biases (unless --no-bias) and, with --router, a\n"
          "router weight [E,H] and bias [E] are included. Scales are f16 and biases and\n"
          "the router f32 by default; --scale-dtype gives all three one dtype. ACT is\n"
          "relu, gelu, silu, swiglu or identity; swiglu uses --swiglu-fusion (default 1:\n"
          "fc1 rows interleaved gate/linear; 2: gate rows then linear rows; 0: separate\n"
          "fc3) and --alpha/--beta/--limit (defaults 1, 0, inf). The same arguments always\n"
          "give the same bytes. --codebook e2m1 (with --bits 4, not --asymmetric) writes\n"
          "a code book bank (qmoe.codebook, docs/BANK_FORMAT.md): per block the scale\n"
          "absmax / 12 and each code the nearest of the values 0 1 2 3 4 6 8 12 and their\n"
          "negatives (ties to the smaller code). The file is written layer by layer through\n"
          "FILE.partial and renamed when complete; progress is shown on a terminal for banks\n"
          "over 64 MiB.\n",
          f);
}

typedef struct create_opts {
    const char *out;
    unsigned layers, experts, hidden, inter, k, bits, block_size, fusion;
    int fusion_set, asymmetric, router, bias, quiet;
    qm_codebook codebook;
    unsigned long long seed;
    qm_dtype scale_dtype, bias_dtype; /* bias_dtype: biases and the router */
    float alpha, beta, limit;
    qm_activation act;
} create_opts;

/* ---- generator: splitmix64 over a counter ---------------------------------- */

static uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct rng {
    uint64_t state;
} rng;

static rng rng_for(unsigned long long seed, uint32_t layer, uint32_t stream, uint32_t expert)
{
    rng r = {mix64(mix64(mix64(seed) ^ layer) ^ ((uint64_t)stream << 32 | expert))};
    return r;
}

/* Uniform in [-1, 1). */
static float rng_uniform(rng *r)
{
    r->state += 0x9e3779b97f4a7c15ull;
    uint64_t z = mix64(r->state);
    return (float)((double)(z >> 40) / (double)(1ull << 23) - 1.0);
}

/* ---- writing ------------------------------------------------------------------ */

static uint64_t ceil_div(uint64_t a, uint64_t b)
{
    return (a + b - 1) / b;
}

/* Rows and reduction length of projection p (1, 2, 3). */
static void proj_nk(const create_opts *o, int p, uint64_t *n, uint64_t *k)
{
    int fused = o->act == QM_ACT_SWIGLU && o->fusion != 0;
    if (p == 1) {
        *n = fused ? 2ull * o->inter : o->inter;
        *k = o->hidden;
    } else if (p == 2) {
        *n = o->hidden;
        *k = o->inter;
    } else {
        *n = o->inter;
        *k = o->hidden;
    }
}

static qm_bank_config config_of(const create_opts *o)
{
    return (qm_bank_config){.layers = o->layers,
                            .experts = o->experts,
                            .hidden = o->hidden,
                            .inter = o->inter,
                            .k = o->k,
                            .bits = o->bits,
                            .codebook = o->codebook,
                            .block_size = o->block_size,
                            .activation = o->act,
                            .swiglu_fusion = o->fusion,
                            .normalize_routing = 1,
                            .alpha = o->alpha,
                            .beta = o->beta,
                            .limit = o->limit};
}

/* A row of k values (k even) into codes of code book cb, packed two to a
 * byte (low nibble = even column), and its blocks' scales (absmax / the
 * book's largest value, floored at 1e-8, as stored in sdt) as elements
 * [scale_at, scale_at + nblk) of `scales`. Each code is the nearest value
 * to w / stored scale; ties take the smaller code. */
static void codebook_row(qm_codebook cb, const float *w, uint64_t k, uint64_t bs, qm_dtype sdt,
                         uint8_t *packed, void *scales, uint64_t scale_at)
{
    const int8_t *v = qm_codebook_values(cb);
    int vmax = 0;
    for (int q = 0; q < 16; q++)
        vmax = abs(v[q]) > vmax ? abs(v[q]) : vmax;
    if (!bs) bs = k;
    memset(packed, 0, (size_t)(k / 2));
    for (uint64_t b0 = 0, blk = 0; b0 < k; b0 += bs, blk++) {
        uint64_t end = b0 + bs < k ? b0 + bs : k;
        float amax = 0.0f;
        for (uint64_t c = b0; c < end; c++)
            amax = fabsf(w[c]) > amax ? fabsf(w[c]) : amax;
        float s = qm_quant_round_to(sdt, fmaxf(amax / (float)vmax, 1e-8f));
        qm_quant_store(scales, sdt, scale_at + blk, s);
        for (uint64_t c = b0; c < end; c++) {
            unsigned best = 0;
            float best_d = INFINITY;
            for (unsigned q = 0; q < 16; q++) {
                float d = fabsf(w[c] / s - (float)v[q]);
                if (d < best_d) best = q, best_d = d;
            }
            packed[c / 2] |= (uint8_t)(best << (c % 2 ? 4 : 0));
        }
    }
}

/* Writes projection p of one layer, expert by expert. */
static int write_projection(const create_opts *o, qm_bank_writer *w, uint32_t layer, int p,
                            qm_status *st)
{
    uint64_t n, k;
    proj_nk(o, p, &n, &k);
    uint64_t pack = 8 / o->bits, bs = o->block_size;
    uint64_t nblk = bs ? ceil_div(k, bs) : 1;
    const int tw = QM_T_FC1_WEIGHT + 4 * (p == 1 ? 0 : p == 2 ? 1 : 2);
    uint64_t w_slice = qm_bank_writer_slice_bytes(w, layer, tw);
    uint64_t s_slice = qm_bank_writer_slice_bytes(w, layer, tw + 1);
    uint64_t z_slice = qm_bank_writer_slice_bytes(w, layer, tw + 2);
    uint64_t b_slice = qm_bank_writer_slice_bytes(w, layer, tw + 3);
    float *row = qm_malloc(k * sizeof *row);
    uint8_t *row_zps = qm_calloc(nblk, 1);
    uint8_t *wbuf = qm_malloc(w_slice);
    uint8_t *sbuf = qm_malloc(s_slice);
    uint8_t *zbuf = qm_calloc(z_slice ? z_slice : 1, 1);
    uint8_t *bbuf = qm_malloc(b_slice ? b_slice : 1);
    int rc = 0;
    if (!row || !row_zps || !wbuf || !sbuf || !zbuf || !bbuf) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory for one expert slice");
        goto done;
    }
    const qm_quant_spec q = {.bits = o->bits,
                             .block_size = bs,
                             .scale_dtype = o->scale_dtype,
                             .asymmetric = o->asymmetric,
                             .rule = QM_QUANT_F32_SCALE};
    float wscale = 1.0f / sqrtf((float)k);
    for (uint32_t e = 0; e < o->experts && rc == 0; e++) {
        rng r = rng_for(o->seed, layer, (uint32_t)p, e);
        memset(zbuf, 0, z_slice);
        for (uint64_t row_i = 0; row_i < n; row_i++) {
            for (uint64_t c = 0; c < k; c++)
                row[c] = rng_uniform(&r) * wscale;
            if (o->codebook)
                codebook_row(o->codebook, row, k, bs, o->scale_dtype, wbuf + row_i * (k / pack),
                             sbuf, row_i * nblk);
            else
                qm_quant_row(&q, row, k, wbuf + row_i * (k / pack), sbuf, row_i * nblk, row_zps,
                             NULL);
            if (o->asymmetric) {
                if (bs) { /* [N, ceil(nblk/pack)], packed along blocks */
                    uint64_t per_row = ceil_div(nblk, pack);
                    for (uint64_t b = 0; b < nblk; b++)
                        zbuf[row_i * per_row + b / pack] |=
                            (uint8_t)(row_zps[b] << ((b % pack) * o->bits));
                } else { /* [ceil(N/pack)], packed along rows */
                    zbuf[row_i / pack] |= (uint8_t)(row_zps[0] << ((row_i % pack) * o->bits));
                }
            }
        }
        if (o->bias) {
            rng rb = rng_for(o->seed, layer, (uint32_t)p + 16, e);
            for (uint64_t i = 0; i < n; i++)
                qm_quant_store(bbuf, o->bias_dtype, i, 0.1f * rng_uniform(&rb));
        }
        if ((rc = qm_bank_writer_put(w, layer, tw, e * w_slice, wbuf, w_slice, st)) == 0 &&
            (rc = qm_bank_writer_put(w, layer, tw + 1, e * s_slice, sbuf, s_slice, st)) == 0 &&
            (!z_slice ||
             (rc = qm_bank_writer_put(w, layer, tw + 2, e * z_slice, zbuf, z_slice, st)) == 0) &&
            b_slice)
            rc = qm_bank_writer_put(w, layer, tw + 3, e * b_slice, bbuf, b_slice, st);
    }
done:
    qm_free(row);
    qm_free(row_zps);
    qm_free(wbuf);
    qm_free(sbuf);
    qm_free(zbuf);
    qm_free(bbuf);
    return rc;
}

static int write_router(const create_opts *o, qm_bank_writer *w, uint32_t layer, qm_status *st)
{
    uint64_t wbytes = qm_bank_writer_tensor_bytes(w, layer, QM_T_ROUTER_WEIGHT);
    uint64_t bbytes = qm_bank_writer_tensor_bytes(w, layer, QM_T_ROUTER_BIAS);
    uint8_t *buf = qm_malloc(wbytes);
    uint8_t *bbuf = qm_malloc(bbytes);
    int rc;
    if (!buf || !bbuf) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory for the router");
        goto done;
    }
    rng r = rng_for(o->seed, layer, 32, 0);
    float s = 1.0f / sqrtf((float)o->hidden);
    for (uint64_t i = 0; i < (uint64_t)o->experts * o->hidden; i++)
        qm_quant_store(buf, o->bias_dtype, i, s * rng_uniform(&r));
    for (uint64_t i = 0; i < o->experts; i++)
        qm_quant_store(bbuf, o->bias_dtype, i, 0.1f * rng_uniform(&r));
    if ((rc = qm_bank_writer_put(w, layer, QM_T_ROUTER_WEIGHT, 0, buf, wbytes, st)) == 0)
        rc = qm_bank_writer_put(w, layer, QM_T_ROUTER_BIAS, 0, bbuf, bbytes, st);
done:
    qm_free(buf);
    qm_free(bbuf);
    return rc;
}

static int write_bank(const create_opts *o)
{
    qm_status st;
    qm_status_clear(&st);
    qm_bank_writer *w = NULL;
    const qm_bank_config cfg = config_of(o);
    const qm_bank_layer_opts lo = {.scale_dtype = o->scale_dtype,
                                   .bias_dtype = o->bias_dtype,
                                   .router_dtype = o->bias_dtype,
                                   .zero_points = o->asymmetric,
                                   .fc1_bias = o->bias,
                                   .fc2_bias = o->bias,
                                   .fc3_bias = o->bias,
                                   .router_weight = o->router,
                                   .router_bias = o->router};
    qm_bank_plan_tensor *plan = qm_calloc((size_t)o->layers * QM_T_COUNT, sizeof *plan);
    int rc;
    if (!plan) {
        rc = qm_status_set(&st, QM_ENOMEM, "out of memory planning %u layers", o->layers);
        goto fail;
    }
    for (uint32_t l = 0; l < o->layers; l++)
        qm_bank_plan_layer(&cfg, &lo, &plan[(size_t)l * QM_T_COUNT]);
    char v[12][32];
    qm_st_meta meta[QM_BANK_STD_META + 1];
    size_t n_meta = QM_BANK_STD_META;
    qm_bank_std_meta(&cfg, v, meta);
    if (o->codebook)
        meta[n_meta++] = (qm_st_meta){"qmoe.codebook", (char *)qm_codebook_name(o->codebook)};
    const qm_bank_writer_spec spec = {.layers = o->layers,
                                      .experts = o->experts,
                                      .tensors = plan,
                                      .meta = meta,
                                      .n_meta = n_meta,
                                      .tool = "create"};
    uint32_t first;
    double unused;
    if ((rc = qm_bank_writer_open(&spec, o->out, 0, &w, &first, &unused, &st)) != 0) goto fail;
    uint64_t layer_bytes = 0;
    for (int t = 0; t < QM_T_COUNT; t++)
        layer_bytes += qm_bank_writer_tensor_bytes(w, 0, t);
    qm_bank_writer_progress(w, !o->quiet && isatty(2) && layer_bytes * o->layers > (64ull << 20),
                            0);
    int nproj = o->act == QM_ACT_SWIGLU && o->fusion == 0 ? 3 : 2;
    for (uint32_t l = 0; l < o->layers; l++) {
        for (int p = 1; p <= nproj; p++)
            if ((rc = write_projection(o, w, l, p, &st)) != 0) goto fail;
        if (o->router && (rc = write_router(o, w, l, &st)) != 0) goto fail;
        if ((rc = qm_bank_writer_layer_done(w, l, 0, (l + 1) * layer_bytes, o->layers * layer_bytes,
                                            &st)) != 0)
            goto fail;
    }
    uint64_t total = 0;
    if ((rc = qm_bank_writer_finish(w, NULL, &total, &st)) != 0) goto fail;
    if (!o->quiet)
        printf("wrote %s: %u layers, %u experts, %llu bytes\n", o->out, o->layers, o->experts,
               (unsigned long long)total);
    qm_bank_writer_free(w, 0);
    qm_free(plan);
    return QM__EXIT_OK;
fail:
    fprintf(stderr, "qmoe-bank create: %s\n", st.msg);
    qm_bank_writer_free(w, 0);
    qm_free(plan);
    return rc == QM_EIO || rc == QM_ENOMEM || rc == QM_EINTERNAL ? QM__EXIT_FAIL : QM__EXIT_USAGE;
}

static int bad(const char *what)
{
    return qm__usage("create", what);
}

static int parse_float_opt(const char *s, float *out)
{
    char *end = NULL;
    float f = strtof(s, &end);
    if (!*s || *end || isnan(f)) return -1;
    *out = f;
    return 0;
}

int qm__cmd_create(int argc, char **argv)
{
    enum {
        O_OUT = 256,
        O_LAYERS,
        O_EXPERTS,
        O_HIDDEN,
        O_INTER,
        O_K,
        O_BITS,
        O_BS,
        O_ACT,
        O_FUSION,
        O_ASYM,
        O_ROUTER,
        O_SEED,
        O_SDT,
        O_NOBIAS,
        O_ALPHA,
        O_BETA,
        O_LIMIT,
        O_CODEBOOK,
        O_QUIET,
        O_HELP
    };
    static const struct option longopts[] = {{"out", required_argument, 0, O_OUT},
                                             {"layers", required_argument, 0, O_LAYERS},
                                             {"experts", required_argument, 0, O_EXPERTS},
                                             {"hidden", required_argument, 0, O_HIDDEN},
                                             {"inter", required_argument, 0, O_INTER},
                                             {"k", required_argument, 0, O_K},
                                             {"bits", required_argument, 0, O_BITS},
                                             {"block-size", required_argument, 0, O_BS},
                                             {"activation", required_argument, 0, O_ACT},
                                             {"swiglu-fusion", required_argument, 0, O_FUSION},
                                             {"asymmetric", no_argument, 0, O_ASYM},
                                             {"router", no_argument, 0, O_ROUTER},
                                             {"seed", required_argument, 0, O_SEED},
                                             {"scale-dtype", required_argument, 0, O_SDT},
                                             {"no-bias", no_argument, 0, O_NOBIAS},
                                             {"alpha", required_argument, 0, O_ALPHA},
                                             {"beta", required_argument, 0, O_BETA},
                                             {"limit", required_argument, 0, O_LIMIT},
                                             {"codebook", required_argument, 0, O_CODEBOOK},
                                             {"quiet", no_argument, 0, O_QUIET},
                                             {"help", no_argument, 0, O_HELP},
                                             {0, 0, 0, 0}};
    create_opts o = {.bias = 1,
                     .seed = 1,
                     .scale_dtype = QM_DTYPE_F16,
                     .bias_dtype = QM_DTYPE_F32,
                     .alpha = 1.0f,
                     .beta = 0.0f,
                     .limit = INFINITY,
                     .block_size = 0};
    int have_act = 0, have_bits = 0, have_bs = 0;
    unsigned *u32_target[O_HELP + 1] = {0};
    u32_target[O_LAYERS] = &o.layers;
    u32_target[O_EXPERTS] = &o.experts;
    u32_target[O_HIDDEN] = &o.hidden;
    u32_target[O_INTER] = &o.inter;
    u32_target[O_K] = &o.k;
    u32_target[O_BITS] = &o.bits;
    u32_target[O_BS] = &o.block_size;
    u32_target[O_FUSION] = &o.fusion;
    optind = 1;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        char msg[160];
        if (c == '?') {
            snprintf(msg, sizeof msg, "unknown or incomplete option \"%.64s\"", argv[optind - 1]);
            return bad(msg);
        }
        if (c >= O_LAYERS && c <= O_FUSION && u32_target[c]) {
            if (qm__parse_u32(optarg, 1u << 24, u32_target[c]) != 0) {
                snprintf(msg, sizeof msg, "--%s wants a non-negative integer, got \"%.32s\"",
                         longopts[c - O_OUT].name, optarg);
                return bad(msg);
            }
            have_bits |= c == O_BITS;
            have_bs |= c == O_BS;
            o.fusion_set |= c == O_FUSION;
            continue;
        }
        switch (c) {
        case O_OUT:
            o.out = optarg;
            break;
        case O_ACT:
            if (qm_activation_parse(optarg, &o.act) != 0)
                return bad("--activation must be relu, gelu, silu, swiglu or identity");
            have_act = 1;
            break;
        case O_ASYM:
            o.asymmetric = 1;
            break;
        case O_ROUTER:
            o.router = 1;
            break;
        case O_NOBIAS:
            o.bias = 0;
            break;
        case O_QUIET:
            o.quiet = 1;
            break;
        case O_SEED: {
            char *end = NULL;
            errno = 0;
            o.seed = strtoull(optarg, &end, 10);
            if (!*optarg || *end || errno) return bad("--seed wants a non-negative integer");
            break;
        }
        case O_SDT:
            if (qm__parse_scale_dtype(optarg, &o.scale_dtype))
                return bad("--scale-dtype must be f32, f16 or bf16");
            o.bias_dtype = o.scale_dtype; /* as given: scales, biases and the router */
            break;
        case O_ALPHA:
            if (parse_float_opt(optarg, &o.alpha) || isinf(o.alpha))
                return bad("--alpha wants a finite number");
            break;
        case O_BETA:
            if (parse_float_opt(optarg, &o.beta) || isinf(o.beta))
                return bad("--beta wants a finite number");
            break;
        case O_LIMIT:
            if (parse_float_opt(optarg, &o.limit) || !(o.limit > 0))
                return bad("--limit wants a number > 0 (or inf)");
            break;
        case O_CODEBOOK:
            if (strcmp(optarg, "e2m1") != 0) return bad("--codebook must be e2m1");
            o.codebook = QM_CODEBOOK_E2M1;
            break;
        case O_HELP:
            qm__help_create(stdout);
            return QM__EXIT_OK;
        }
    }
    if (optind < argc) return bad("unexpected positional argument");
    if (!o.out) return bad("--out FILE is required");
    if (!o.layers || !o.experts || !o.hidden || !o.inter || !o.k)
        return bad("--layers, --experts, --hidden, --inter and --k are required and must be >= 1");
    if (!have_bits || !have_bs || !have_act)
        return bad("--bits, --block-size and --activation are required");
    if (o.layers > 65536 || o.experts > 65536 || o.hidden > (1u << 20) || o.inter > (1u << 20))
        return bad("--layers/--experts at most 65536, --hidden/--inter at most 1048576");
    if (o.k > o.experts) return bad("--k must not exceed --experts");
    if (o.bits != 4 && o.bits != 8) return bad("--bits must be 4 or 8");
    if (o.codebook && (o.bits != 4 || o.asymmetric))
        return bad("--codebook e2m1 needs --bits 4 and takes no --asymmetric (its values are "
                   "signed: no zero points)");
    if (o.block_size && (o.block_size < 16 || (o.block_size & (o.block_size - 1))))
        return bad("--block-size must be 0 or a power of two >= 16");
    unsigned pack = 8 / o.bits;
    if (o.hidden % pack || o.inter % pack)
        return bad("--hidden and --inter must be multiples of 8/bits (codes are packed)");
    if (o.fusion > 2) return bad("--swiglu-fusion must be 0, 1 or 2");
    if (o.act != QM_ACT_SWIGLU) {
        if (o.fusion_set && o.fusion != 0)
            return bad("--swiglu-fusion applies to --activation swiglu only");
        o.fusion = 0;
    } else if (!o.fusion_set) {
        o.fusion = 1;
    }
    return write_bank(&o);
}
