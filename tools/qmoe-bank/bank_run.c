/* bank_run.c - `qmoe-bank run`: one MoE layer on the CPU engine, .npy in and out. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qmoe_bank_tool.h"

void qm__help_run(FILE *f)
{
    fputs("usage: qmoe-bank run FILE --layer N --hidden X.npy [--logits R.npy] --out Y.npy\n"
          "                     [--threads T] [--bf16] [--precision exact|fast] [--verbose]\n"
          "\n"
          "Runs MoE layer N of bank FILE on the CPU engine (the daemon's forward pass, with\n"
          "the experts read straight from the mapped file). X.npy holds the hidden states:\n"
          "shape [..., hidden_size] (leading dimensions are tokens), dtype float32 or\n"
          "float16; with --bf16, a uint16 array of bfloat16 bit patterns. R.npy holds the\n"
          "router logits [tokens, experts] (float32 or float16); it may be omitted when the\n"
          "bank has layers.N.router.weight (logits = x.W^T + b). Y.npy receives the output,\n"
          "same shape and dtype as X. T worker threads (default 0 = one per core); the\n"
          "result is bitwise the same for every T. .npy files must be C-ordered,\n"
          "little-endian; their headers are fully validated. --precision fast quantises\n"
          "activations to int8 per 32 columns and uses integer dot products (default\n"
          "exact: f32, within 1e-5 of onnxruntime). Before any kernel runs, every CPU\n"
          "kernel this CPU can run is checked against the scalar specification (the\n"
          "daemon's self-check); QMOE_KERNEL naming a refused kernel is an error.\n"
          "--verbose prints the self-check, the CPU backend and the kernels it chose\n"
          "(measured on this CPU) to stderr.\n",
          f);
}

#ifndef QMOE_HAVE_ENGINE

int qm__cmd_run(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0) {
            qm__help_run(stdout);
            return QM__EXIT_OK;
        }
    fprintf(stderr, "qmoe-bank run: engine not built\n");
    return QM__EXIT_FAIL;
}

#else

#include "qm_alloc.h"
#include "qm_backend.h"
#include "qm_bank.h"
#include "qm_kernel_check.h"
#include "qm_moe.h"
#include "qm_npy.h"

static int usage(const char *what)
{
    return qm__usage("run", what);
}

/* The kernels' self-check (engine/kernels/qm_kernel_check.h), one line per kernel. */
static void qm__print_kernel_check(FILE *f)
{
    static const char *const state[] = {"?", "verified", "refused, never used", "unavailable"};
    const qm_kernel_check *kc = qm_kernel_check_run();
    fprintf(f, "qmoe-bank run: kernel self-check on %s (%s): %u verified, %u refused, %.1f ms%s\n",
            kc->cpu, kc->flags, kc->verified, kc->refused, kc->ms,
            kc->cached ? " (from the kernel cache)" : "");
    for (unsigned i = 0; i < kc->n; i++) {
        const qm_kernel_verdict *v = &kc->v[i];
        fprintf(f, "qmoe-bank run:   %s %s: %s%s%s\n", v->precision, v->name,
                state[v->kind <= 3 ? v->kind : 0], v->reason[0] ? ": " : "", v->reason);
    }
}

int qm__cmd_run(int argc, char **argv)
{
    static const struct option longopts[] = {{"layer", required_argument, 0, 'l'},
                                             {"hidden", required_argument, 0, 'x'},
                                             {"logits", required_argument, 0, 'r'},
                                             {"out", required_argument, 0, 'o'},
                                             {"threads", required_argument, 0, 't'},
                                             {"bf16", no_argument, 0, 'b'},
                                             {"precision", required_argument, 0, 'p'},
                                             {"verbose", no_argument, 0, 'v'},
                                             {"help", no_argument, 0, 'h'},
                                             {0, 0, 0, 0}};
    int fast = 0, verbose = 0;
    const char *hidden_path = NULL, *logits_path = NULL, *out_path = NULL;
    unsigned layer = 0, threads = 0;
    int have_layer = 0, bf16 = 0, c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        switch (c) {
        case 'l':
            if (qm__parse_u32(optarg, 0xffffffffu, &layer) != 0)
                return usage("--layer wants a non-negative integer");
            have_layer = 1;
            break;
        case 'x':
            hidden_path = optarg;
            break;
        case 'r':
            logits_path = optarg;
            break;
        case 'o':
            out_path = optarg;
            break;
        case 't':
            if (qm__parse_u32(optarg, 4096, &threads) != 0)
                return usage("--threads wants an integer in [0, 4096]");
            break;
        case 'b':
            bf16 = 1;
            break;
        case 'p':
            if (strcmp(optarg, "exact") != 0 && strcmp(optarg, "fast") != 0)
                return usage("--precision wants exact or fast");
            fast = strcmp(optarg, "fast") == 0;
            break;
        case 'v':
            verbose = 1;
            break;
        case 'h':
            qm__help_run(stdout);
            return QM__EXIT_OK;
        default:
            return usage("unknown or incomplete option");
        }
    }
    if (optind != argc - 1) return usage("expected exactly one bank FILE");
    if (!have_layer || !hidden_path || !out_path)
        return usage("--layer, --hidden and --out are required");
    const char *path = argv[optind];

    qm_bank *bank = NULL;
    qm_backend *be = NULL;
    qm_npy x = {0}, r = {0};
    float *logits = NULL;
    void *out = NULL;
    qm_status st;
    int ret = QM__EXIT_FAIL, rc;
    qm_status_clear(&st);

    if ((rc = qm_bank_open(path, &bank, &st)) != 0) {
        fprintf(stderr, "qmoe-bank run: %s: %s\n", path, st.msg);
        return rc == QM_ENOMEM ? QM__EXIT_FAIL : QM__EXIT_USAGE;
    }
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    const qm_layer_view *lv = qm_bank_layer(bank, layer);
    if (!lv) {
        fprintf(stderr, "qmoe-bank run: --layer %u out of range (the bank has %u layers)\n", layer,
                cfg->layers);
        ret = QM__EXIT_USAGE;
        goto done;
    }
    if ((rc = qm_npy_read(hidden_path, 0, &x, &st)) != 0) {
        fprintf(stderr, "qmoe-bank run: %s\n", st.msg);
        ret = rc == QM_EINVAL ? QM__EXIT_USAGE : QM__EXIT_FAIL;
        goto done;
    }
    qm_dtype dtype;
    if (x.dtype == QM_NPY_F32 && !bf16)
        dtype = QM_DTYPE_F32;
    else if (x.dtype == QM_NPY_F16 && !bf16)
        dtype = QM_DTYPE_F16;
    else if (x.dtype == QM_NPY_U16 && bf16)
        dtype = QM_DTYPE_BF16;
    else {
        fprintf(stderr,
                "qmoe-bank run: %s: dtype must be float32 or float16 (or uint16 with "
                "--bf16)\n",
                hidden_path);
        ret = QM__EXIT_USAGE;
        goto done;
    }
    if (x.ndim < 1 || x.shape[x.ndim - 1] != cfg->hidden) {
        fprintf(stderr, "qmoe-bank run: %s: last dimension must be hidden_size %u\n", hidden_path,
                cfg->hidden);
        ret = QM__EXIT_USAGE;
        goto done;
    }
    uint64_t tokens = x.count / cfg->hidden;
    if (tokens > 0xffffffffu) {
        fprintf(stderr, "qmoe-bank run: too many tokens\n");
        ret = QM__EXIT_USAGE;
        goto done;
    }
    if (logits_path) {
        if ((rc = qm_npy_read(logits_path, 0, &r, &st)) != 0) {
            fprintf(stderr, "qmoe-bank run: %s\n", st.msg);
            ret = rc == QM_EINVAL ? QM__EXIT_USAGE : QM__EXIT_FAIL;
            goto done;
        }
        if (r.dtype == QM_NPY_U16 || r.dtype == QM_NPY_I32 || r.count != tokens * cfg->experts ||
            r.ndim < 1 || r.shape[r.ndim - 1] != cfg->experts) {
            fprintf(stderr, "qmoe-bank run: %s: want float32/float16 logits of shape [%llu, %u]\n",
                    logits_path, (unsigned long long)tokens, cfg->experts);
            ret = QM__EXIT_USAGE;
            goto done;
        }
        logits = qm_malloc((size_t)(r.count ? r.count : 1) * sizeof *logits);
        if (!logits) goto oom;
        for (uint64_t i = 0; i < r.count; i++)
            logits[i] = r.dtype == QM_NPY_F32 ? ((const float *)r.data)[i]
                                              : qm_f16_to_f32(((const uint16_t *)r.data)[i]);
    } else if (!lv->t[QM_T_ROUTER_WEIGHT].present) {
        fprintf(stderr, "qmoe-bank run: layer %u has no router weight; pass --logits R.npy\n",
                layer);
        ret = QM__EXIT_USAGE;
        goto done;
    }
    out = qm_malloc(x.nbytes ? (size_t)x.nbytes : 1);
    if (!out) goto oom;
    if ((rc = qm_kernel_check_forced(&st)) != 0) {
        fprintf(stderr, "qmoe-bank run: %s\n", st.msg);
        goto done;
    }
    if (verbose)
        qm__print_kernel_check(stderr);
    if ((rc = qm_backend_cpu_new(threads, &be, &st)) != 0) {
        fprintf(stderr, "qmoe-bank run: CPU backend: %s\n", st.msg);
        goto done;
    }
    if (verbose) {
        qm_device_info info;
        if (qm_backend_info(be, &info) == 0)
            fprintf(stderr, "qmoe-bank run: %s, precision %s\n", info.name,
                    fast ? "fast" : "exact");
    }
    qm_expert_source src;
    qm_expert_source_direct(bank, &src);
    qm_moe_call call = {.layer = layer,
                        .dtype = dtype,
                        .hidden = x.data,
                        .n_tokens = (uint32_t)tokens,
                        .logits = logits,
                        .output = out,
                        .precision = fast ? QM_PRECISION_FAST : QM_PRECISION_EXACT};
    qm_moe_stats stats = {0};
    if ((rc = qm_moe_forward(be, bank, &call, &src, &stats, &st)) != 0) {
        fprintf(stderr, "qmoe-bank run: forward: %s\n", st.msg[0] ? st.msg : qm_strerror(rc));
        goto done;
    }
    if (qm_npy_write(out_path, x.dtype, x.shape, x.ndim, out, &st) != 0) {
        fprintf(stderr, "qmoe-bank run: %s\n", st.msg);
        goto done;
    }
    ret = QM__EXIT_OK;
    goto done;
oom:
    fprintf(stderr, "qmoe-bank run: out of memory\n");
done:
    qm_backend_free(be);
    qm_free(out);
    qm_free(logits);
    qm_npy_free(&x);
    qm_npy_free(&r);
    qm_bank_close(bank);
    return ret;
}

#endif
