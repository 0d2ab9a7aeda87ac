/* import_hf.c - `qmoe-bank import hf`: a Hugging Face MoE checkpoint's routed
 * experts into a bank.
 *
 * Every shape is known from config.json, so the whole checkpoint is checked
 * (names, dtypes, shapes, layer and expert counts) before a byte is written;
 * then the bank header goes out first and the layers are streamed one at a
 * time from the mapped shards (import_elements.h). Float sources are
 * requantised by round to nearest; GPT-OSS's MXFP4 keeps its 4-bit codes
 * through the e2m1 code book (or, --mxfp4 int8, maps onto int8 block 32), bit
 * for bit either way. Tensor names and layouts per family: docs/IMPORT.md. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "import_hf_impl.h"
#include "qm_alloc.h"
#include "qm_json.h"
#include "qmoe_bank_tool.h"
#include "tool_input.h"

void qm__help_import_hf(FILE *f)
{
    fputs("usage: qmoe-bank import hf DIR --out FILE [--bits 4|8] [--block-size N]\n"
          "                         [--scales f32|f16|bf16] [--mxfp4 e2m1|int8]\n"
          "                         [--resume] [--quiet]\n"
          "\n"
          "Imports the routed experts of a Hugging Face checkpoint (config.json plus one\n"
          "*.safetensors, or shards listed in model.safetensors.index.json) into a bank.\n"
          "Families (config.json model_type) and the source formats each takes:\n",
          f);
    qm__family_help(f, 0);
    fputs("bf16/f16/f32/FP8 weights are requantised by round to nearest, symmetric, to\n"
          "--bits (default 4) with one scale per --block-size columns (default 32; 0 = one\n"
          "per row) stored as --scales (default f16: 4.5 bits per weight at int4); the\n"
          "error is measured and recorded in qmoe.source. MXFP4 is held bit for bit\n"
          "(exact): with --mxfp4 e2m1 (the default) as its own 4-bit codes through the\n"
          "e2m1 code book (qmoe.codebook, docs/BANK_FORMAT.md), block 32; with --mxfp4\n"
          "int8 as int8 block 32 (twice the bytes: the bank onnxruntime's QMoE reads);\n"
          "either way with f16 scales when every block exponent fits one (else f32). An\n"
          "explicit --bits or --block-size asks for int8 block 32 (exact) when it names\n"
          "that layout, else requantises MXFP4 to it. Routers, router biases, correction\n"
          "biases and expert biases are copied as f32, and the family's routing rule is\n"
          "written as qmoe.routing.* keys. Shared experts, dense layers, attention and\n"
          "embeddings stay with the engine: the import says what it left out. Memory\n"
          "stays at about one layer: shards are mapped and each layer's pages are dropped\n"
          "after it is written. The bank is written as FILE.partial and renamed when\n"
          "complete; after a crash or Ctrl-C, --resume continues at the first layer not\n"
          "yet written (the partial file's header must match these arguments and this\n"
          "checkpoint). A progress line is shown on a terminal unless --quiet.\n"
          "exit status: 0 ok, 1 I/O failure, 2 bad usage or a checkpoint that cannot be\n"
          "imported (the message names the file, tensor or key).\n",
          f);
}

/* Bad input: exit 2. Anything else (I/O, memory): exit 1. */
static int exit_for(int rc)
{
    return rc == QM_EIO || rc == QM_ENOMEM || rc == QM_EINTERNAL ? QM__EXIT_FAIL : QM__EXIT_USAGE;
}

/* ---- metadata and the report --------------------------------------------- */

static int source_prefix(qm__hf_import *im, char *buf, size_t n)
{
    size_t at =
        (size_t)snprintf(buf, n, "{\"format\":\"hf\",\"family\":\"%s\",\"files\":[", im->fam->name);
    uint32_t ns = qm__hf_shard_count(im->ck);
    for (uint32_t i = 0; i < ns; i++) {
        const char *s = qm__hf_shard_name(im->ck, i);
        if (at + strlen(s) * 6 + 64 > n - 200) {
            at += (size_t)snprintf(buf + at, n - at, "%s\"... %u more\"", i ? "," : "", ns - i);
            break;
        }
        at += (size_t)snprintf(buf + at, n - at, "%s\"", i ? "," : "");
        at += qm_json_escape_str(s, buf + at, n - at);
        at += (size_t)snprintf(buf + at, n - at, "\"");
    }
    at += (size_t)snprintf(buf + at, n - at, "]");
    return at < n ? 0 : -1;
}

/* qmoe.source: the prefix, then exact and max_rel_err at a fixed width, so
 * that the final value (known at the end) has the placeholder's length. */
static void source_value(const char *prefix, int exact, double err, char *buf, size_t n)
{
    if (!(err >= 1e-99)) err = 0;
    if (err > 9.999999e99) err = 9.999999e99;
    snprintf(buf, n, "%s,\"exact\":%s,\"max_rel_err\":%.6e}", prefix, exact ? "true " : "false",
             err);
}

static void report_left_out(qm__hf_import *im)
{
    size_t n = 0;
    const qm__hf_tensor *all = qm__hf_tensors(im->ck, &n);
    size_t shared = 0, dense = 0, mtp = 0, other = 0;
    uint64_t shared_b = 0, dense_b = 0, mtp_b = 0;
    for (size_t i = 0; i < n; i++) {
        const char *nm = all[i].name;
        unsigned l = 0;
        int pos = 0;
        int in_layer = sscanf(nm, "model.layers.%u.%n", &l, &pos) == 1 && pos > 0;
        if (in_layer && l >= im->model_layers) {
            mtp++;
            mtp_b += all[i].nbytes;
        } else if (strstr(nm, ".shared_expert")) {
            shared++;
            shared_b += all[i].nbytes;
        } else if (in_layer && strncmp(nm + pos, "mlp.", 4) == 0 &&
                   strncmp(nm + pos + 4, "experts", 7) != 0 &&
                   strncmp(nm + pos + 4, "gate.", 5) != 0 &&
                   strncmp(nm + pos + 4, "router", 6) != 0) {
            dense++;
            dense_b += all[i].nbytes;
        } else {
            other++;
        }
    }
    other -= im->consumed <= other ? im->consumed : other;
    printf("left with the engine:");
    if (im->n_moe < im->model_layers)
        printf(" %u dense MLP layer(s) (%zu tensors, %.1f MB);", im->model_layers - im->n_moe,
               dense, (double)dense_b / 1e6);
    if (shared) printf(" shared experts (%zu tensors, %.1f MB);", shared, (double)shared_b / 1e6);
    if (mtp)
        printf(" multi-token-prediction layer(s) past num_hidden_layers (%zu tensors, %.1f MB);",
               mtp, (double)mtp_b / 1e6);
    printf(" %zu other tensors (attention, norms, embeddings, lm_head)\n", other);
}

/* ---- the command ----------------------------------------------------------- */

/* The scale dtype: f16 unless --scales says otherwise, so a 4-bit bank is
 * 4.5 bits per weight. MXFP4 at int8 block 32, or through the e2m1 code
 * book, maps onto the bank exactly when its scales 2^(e-128) keep their
 * value in the dtype: always in f32 and bf16, in f16 when every exponent is
 * in [104, 143]; the default takes f32 for a checkpoint outside that range
 * rather than requantise it. */
static void choose_scales(qm__hf_import *im)
{
    if (!im->o.scales_set) im->o.scale_dtype = QM_DTYPE_F16;
    if (!im->mxfp4 || (!im->codebook && (im->o.bits != 8 || im->o.block_size != 32))) return;
    int fits_f16 = 1;
    for (uint32_t l = 0; l < im->n_moe && fits_f16; l++)
        for (int g = 0; g < 2; g++) {
            const qm__hf_tensor *t =
                im->layer_src[(size_t)l * QM__HF_FUSED_COUNT +
                              (g ? QM__HF_FUSED_DOWN_SCALES : QM__HF_FUSED_GATE_UP_SCALES)];
            for (uint64_t i = 0; i < t->nbytes && fits_f16; i++)
                fits_f16 = t->data[i] >= 104 && t->data[i] <= 143;
        }
    im->mxfp4_exact = im->o.scale_dtype != QM_DTYPE_F16 || fits_f16 || !im->o.scales_set;
    if (im->o.scale_dtype == QM_DTYPE_F16 && !fits_f16 && !im->o.scales_set)
        im->o.scale_dtype = QM_DTYPE_F32;
}

static void import_free(qm__hf_import *im)
{
    qm_free(im->layer_map);
    qm_free(im->expert_src);
    qm_free(im->layer_src);
    qm_free(im->router_w);
    qm_free(im->router_b);
    qm_free(im->corr);
    qm_free(im->layer_bytes);
    qm__hf_close(im->ck);
}

static int run_import(qm__hf_import *im)
{
    qm_status st;
    qm_status_clear(&st);
    qm_bank_writer *w = NULL;
    qm_bank_plan_tensor *plan = NULL;
    qm__hf_buffers b = {0};
    int rc, keep_partial = 1;
    /* src: qmoe.source's prefix; source_prefix lists shard names while they
     * leave 200 bytes of this room, so the value stays under the loader's
     * QM_ST_VALUE_MAX. */
    char src[4288], groups[16], topk_groups[16], scale[32], norm[4];
    char *layer_map_s = NULL;

    if ((!im->ck && (rc = qm__hf_open(im->o.dir, &im->ck, &st)) != 0) ||
        (rc = qm__hf_read_config(im, &st)) != 0)
        goto fail_input;
    if (im->mxfp4 && !im->o.mxfp4_int8 && !im->o.bits_set && !im->o.block_set) {
        /* MXFP4's nibbles are the e2m1 code book's codes: the file's own bits */
        im->codebook = QM_CODEBOOK_E2M1;
        im->o.bits = 4;
        im->o.block_size = 32;
    } else if (!im->o.bits_set) {
        im->o.bits = im->mxfp4 ? 8 : 4;
    }
    if (im->H % (8 / im->o.bits) || im->I % (8 / im->o.bits)) {
        rc = qm_status_set(&st, QM_EINVALID_MODEL,
                           "config.json: hidden_size %u and %s %u must be even for 4-bit codes",
                           im->H, im->fam->inter_key, im->I);
        goto fail_input;
    }
    if ((rc = qm__hf_resolve(im, &st)) != 0) goto fail_input;
    choose_scales(im);
    if (im->codebook && !im->mxfp4_exact) { /* there is no requantising into a code book */
        rc = qm_status_set(&st, QM_EINVALID_MODEL,
                           "--scales f16 cannot hold this checkpoint's MXFP4 scales (a block "
                           "exponent outside [104, 143]): rerun with --scales f32 or bf16, or "
                           "--mxfp4 int8 to requantise");
        goto fail_input;
    }

    /* Metadata. */
    size_t lm_cap = (size_t)im->n_moe * 8 + 4;
    layer_map_s = qm_malloc(lm_cap);
    if (!layer_map_s) {
        rc = qm_status_set(&st, QM_ENOMEM, "out of memory");
        goto fail;
    }
    size_t at = (size_t)snprintf(layer_map_s, lm_cap, "[");
    for (uint32_t i = 0; i < im->n_moe; i++)
        at +=
            (size_t)snprintf(layer_map_s + at, lm_cap - at, "%s%u", i ? "," : "", im->layer_map[i]);
    snprintf(layer_map_s + at, lm_cap - at, "]");
    if (source_prefix(im, src, sizeof src) != 0) {
        rc = qm_status_set(&st, QM_EINTERNAL, "qmoe.source does not fit");
        goto fail;
    }
    snprintf(scale, sizeof scale, "%.9g", im->scale);
    snprintf(norm, sizeof norm, "%d", im->normalize);
    snprintf(groups, sizeof groups, "%u", im->groups);
    snprintf(topk_groups, sizeof topk_groups, "%u", im->topk_groups);
    const qm_bank_config cfg = {
        .layers = im->n_moe,
        .experts = im->E,
        .hidden = im->H,
        .inter = im->I,
        .k = im->k,
        .bits = im->o.bits,
        .codebook = im->codebook,
        .block_size = im->o.block_size,
        .activation = QM_ACT_SWIGLU,
        .swiglu_fusion = 1,
        .normalize_routing = im->normalize,
        .alpha = im->alpha,
        .beta = im->beta,
        .limit = im->limit,
    };
    const unsigned fl = im->fam->flags;
    const qm_bank_layer_opts lo = {
        .scale_dtype = im->o.scale_dtype,
        .bias_dtype = QM_DTYPE_F32,
        .router_dtype = QM_DTYPE_F32,
        .fc1_bias = (fl & QM_FAMILY_EXPERT_BIASES) != 0,
        .fc2_bias = (fl & QM_FAMILY_EXPERT_BIASES) != 0,
        .router_weight = 1,
        .router_bias = (fl & QM_FAMILY_ROUTER_BIAS) != 0,
        .correction_bias = (fl & QM_FAMILY_CORRECTION_BIAS) != 0,
    };
    plan = qm_calloc((size_t)im->n_moe * QM_T_COUNT, sizeof *plan);
    if (!plan) {
        rc = qm_status_set(&st, QM_ENOMEM, "out of memory");
        goto fail;
    }
    for (uint32_t l = 0; l < im->n_moe; l++)
        qm_bank_plan_layer(&cfg, &lo, &plan[(size_t)l * QM_T_COUNT]);
    char std_values[12][32], source[sizeof src + 64];
    qm_st_meta meta[QM_BANK_STD_META + 9];
    size_t n_meta = QM_BANK_STD_META;
    qm_bank_std_meta(&cfg, std_values, meta);
    if (im->codebook)
        meta[n_meta++] = (qm_st_meta){"qmoe.codebook", (char *)qm_codebook_name(im->codebook)};
    source_value(src, 0, 0, source, sizeof source);
    meta[n_meta++] = (qm_st_meta){"qmoe.source", source};
    const char *keys[] = {"qmoe.layer_map", "qmoe.routing.score", "qmoe.routing.normalize",
                          "qmoe.routing.scale"};
    const char *vals[] = {layer_map_s, im->score, norm, scale};
    for (size_t i = 0; i < 4; i++)
        meta[n_meta++] = (qm_st_meta){(char *)keys[i], (char *)vals[i]};
    if (im->groups) {
        meta[n_meta++] = (qm_st_meta){"qmoe.routing.groups", groups};
        meta[n_meta++] = (qm_st_meta){"qmoe.routing.topk_groups", topk_groups};
        meta[n_meta++] = (qm_st_meta){"qmoe.routing.group_score", (char *)im->group_score};
    }
    const qm_bank_writer_spec spec = {.layers = im->n_moe,
                                      .experts = im->E,
                                      .tensors = plan,
                                      .meta = meta,
                                      .n_meta = n_meta,
                                      .deferred_key = "qmoe.source",
                                      .tool = "import hf"};

    uint32_t first = 0;
    double max_err = 0;
    if ((rc = qm_bank_writer_open(&spec, im->o.out, im->o.resume, &w, &first, &max_err, &st)) !=
        0) {
        if (rc == QM_ECONFLICT || rc == QM_EINVALID_MODEL) goto fail_input;
        goto fail;
    }
    keep_partial = 0; /* until a layer is complete, nothing to resume */
    uint64_t total_src = 0, done_src = 0;
    for (uint32_t i = 0; i < im->n_moe; i++) {
        total_src += im->layer_bytes[i];
        if (i < first) done_src += im->layer_bytes[i];
    }
    if (!im->o.quiet) {
        char layout[32];
        if (im->codebook)
            snprintf(layout, sizeof layout, "%s code book", qm_codebook_name(im->codebook));
        else
            snprintf(layout, sizeof layout, "int%u", im->o.bits);
        printf("importing %s (%s): %u of %u layers have routed experts, %u experts, k %u, "
               "hidden %u, inter %u; %s -> %s block %u, %s scales%s\n",
               im->o.dir, im->fam->name, im->n_moe, im->model_layers, im->E, im->k, im->H, im->I,
               im->mxfp4 ? "MXFP4"
               : im->fp8 ? "FP8 e4m3"
                         : "float",
               layout, im->o.block_size, qm_dtype_name(im->o.scale_dtype),
               im->mxfp4_exact ? " (exact)" : " (requantised)");
        if (first) printf("resuming %s.partial at layer %u of %u\n", im->o.out, first, im->n_moe);
        report_left_out(im);
        fflush(stdout);
    }
    qm_bank_writer_progress(w, !im->o.quiet && isatty(2), done_src);
    keep_partial = first > 0;
    /* Per-expert buffers: the largest matrix of either projection. */
    uint64_t kmax = im->H > im->I ? im->H : im->I;
    uint64_t n1 = 2ull * im->I;
    b.row = qm_malloc((n1 > kmax ? n1 : kmax) * sizeof(float));
    b.bias = qm_malloc((n1 > im->H ? n1 : im->H) * sizeof(float));
    b.packed[0] = qm_malloc(qm_bank_writer_slice_bytes(w, 0, QM_T_FC1_WEIGHT));
    b.packed[1] = qm_malloc(qm_bank_writer_slice_bytes(w, 0, QM_T_FC2_WEIGHT));
    b.scales[0] = qm_malloc(qm_bank_writer_slice_bytes(w, 0, QM_T_FC1_SCALES));
    b.scales[1] = qm_malloc(qm_bank_writer_slice_bytes(w, 0, QM_T_FC2_SCALES));
    const int transpose = (im->fam->flags & QM_FAMILY_FUSED_EXPERTS) && !im->mxfp4;
    if (transpose) b.mat = qm_malloc(n1 * im->H * sizeof(float));
    if (!b.row || !b.bias || !b.packed[0] || !b.packed[1] || !b.scales[0] || !b.scales[1] ||
        (transpose && !b.mat)) {
        rc = qm_status_set(&st, QM_ENOMEM, "out of memory for one expert's buffers");
        goto fail;
    }
    for (uint32_t li = first; li < im->n_moe; li++) {
        if (qm__interrupted()) {
            rc = QM_ESHUTTING_DOWN;
            goto fail;
        }
        rc = qm__hf_convert_layer(im, w, li, &b, &max_err, &st);
        qm__hf_release(im->ck);
        if (rc) {
            if (rc == QM_EINVALID_MODEL)
                keep_partial = 0; /* a resume would stop at the same bytes */
            goto fail;
        }
        done_src += im->layer_bytes[li];
        if ((rc = qm_bank_writer_layer_done(w, li, max_err, done_src, total_src, &st)) != 0)
            goto fail;
        keep_partial = 1;
    }
    if (qm__interrupted()) {
        rc = QM_ESHUTTING_DOWN;
        goto fail;
    }
    int exact = max_err == 0;
    uint64_t bytes = 0;
    source_value(src, exact, exact ? 0 : max_err, source, sizeof source);
    if ((rc = qm_bank_writer_finish(w, source, &bytes, &st)) != 0) goto fail;
    if (!im->o.quiet)
        printf("wrote %s: %u layers (model layers %s), %u experts, %llu bytes; %s (max "
               "relative error %.3g)\n",
               im->o.out, im->n_moe, layer_map_s, im->E, (unsigned long long)bytes,
               exact ? "exact" : "requantised", max_err);
    rc = QM__EXIT_OK;
    goto done;
fail_input:
    qm__print_line(stderr, "import hf", im->o.dir, ": ", st.msg, NULL);
    rc = exit_for(rc);
    goto done;
fail:
    if (rc == QM_ESHUTTING_DOWN) {
        char what[160];
        keep_partial = w && qm_bank_writer_layers_done(w) > 0;
        snprintf(what, sizeof what, "interrupted after %u of %u layers; ",
                 w ? qm_bank_writer_layers_done(w) : 0, im->n_moe);
        qm__print_line(stderr, "import hf", what,
                       keep_partial ? "the partial file is kept: rerun with --resume"
                                    : "nothing was kept",
                       NULL);
    } else {
        qm__print_line(stderr, "import hf", st.msg,
                       w && keep_partial ? " (the partial file is kept: rerun with --resume)" : "",
                       NULL);
    }
    rc = exit_for(rc);
done:
    qm_bank_writer_free(w, keep_partial);
    qm_free(plan);
    qm_free(b.row);
    qm_free(b.bias);
    qm_free(b.mat);
    qm_free(b.packed[0]);
    qm_free(b.packed[1]);
    qm_free(b.scales[0]);
    qm_free(b.scales[1]);
    qm_free(layer_map_s);
    import_free(im);
    qm__reraise(); /* an interrupted import ends as the signal would have ended it */
    return rc;
}

static int usage(const char *what)
{
    return qm__usage("import", what);
}

/* The options into im; -1 to go on, else the exit status. */
static int hf_options(int argc, char **argv, qm__hf_import *im)
{
    enum { O_OUT = 256, O_BITS, O_BS, O_SCALES, O_MXFP4, O_RESUME, O_QUIET, O_HELP };
    static const struct option longopts[] = {{"out", required_argument, 0, O_OUT},
                                             {"bits", required_argument, 0, O_BITS},
                                             {"block-size", required_argument, 0, O_BS},
                                             {"scales", required_argument, 0, O_SCALES},
                                             {"mxfp4", required_argument, 0, O_MXFP4},
                                             {"resume", no_argument, 0, O_RESUME},
                                             {"quiet", no_argument, 0, O_QUIET},
                                             {"help", no_argument, 0, O_HELP},
                                             {0, 0, 0, 0}};
    optind = 1;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        char msg[160];
        switch (c) {
        case O_OUT:
            im->o.out = optarg;
            break;
        case O_BITS:
            if (qm__parse_u32(optarg, 8, &im->o.bits) != 0 || (im->o.bits != 4 && im->o.bits != 8))
                return usage("--bits must be 4 or 8");
            im->o.bits_set = 1;
            break;
        case O_BS:
            if (qm__parse_u32(optarg, 1u << 20, &im->o.block_size) != 0 ||
                (im->o.block_size &&
                 (im->o.block_size < 16 || (im->o.block_size & (im->o.block_size - 1)))))
                return usage("--block-size must be 0 or a power of two >= 16");
            im->o.block_set = 1;
            break;
        case O_SCALES:
            im->o.scales_set = 1;
            if (qm__parse_scale_dtype(optarg, &im->o.scale_dtype))
                return usage("--scales must be f32, f16 or bf16");
            break;
        case O_MXFP4:
            if (strcmp(optarg, "e2m1") != 0 && strcmp(optarg, "int8") != 0)
                return usage("--mxfp4 must be e2m1 or int8");
            im->o.mxfp4_int8 = strcmp(optarg, "int8") == 0;
            break;
        case O_RESUME:
            im->o.resume = 1;
            break;
        case O_QUIET:
            im->o.quiet = 1;
            break;
        case O_HELP:
            qm__help_import_hf(stdout);
            return QM__EXIT_OK;
        default:
            snprintf(msg, sizeof msg, "unknown or incomplete option \"%.64s\"", argv[optind - 1]);
            return usage(msg);
        }
    }
    if (optind + 1 != argc) return usage("expected: import hf DIR --out FILE");
    im->o.dir = argv[optind];
    if (!im->o.out) return usage("--out FILE is required");
    return -1;
}

int qm__cmd_import_hf(int argc, char **argv)
{
    return qm__hf_run(NULL, argc, argv);
}

int qm__hf_run(qm__hf_checkpoint *ck, int argc, char **argv)
{
    qm__hf_import im = {.o = {.bits = 4, .block_size = 32, .scale_dtype = QM_DTYPE_F16}, .ck = ck};
    int rc = hf_options(argc, argv, &im);
    if (rc >= 0) {
        qm__hf_close(ck);
        return rc;
    }
    qm__catch_interrupts();
    return run_import(&im);
}
