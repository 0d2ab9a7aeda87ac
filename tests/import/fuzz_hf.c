/* fuzz_hf.c - libFuzzer: `qmoe-bank import hf` on in-memory checkpoints,
 * three ways (one target per FUZZ_HF_MODE):
 *   FUZZ_HF_CONFIG  the input is config.json, beside a fixed small shard:
 *                   the config reader (model/qm_hf_config) and the family
 *                   table's rules for layers, routing and source formats;
 *   FUZZ_HF_INDEX   the input is model.safetensors.index.json, beside a
 *                   valid config and two shards: the index's shard rules;
 *   FUZZ_HF_IMPORT  the input is a whole checkpoint, config.json and one
 *                   shard (a 4-byte length, the config, then the shard):
 *                   the safetensors header checks, the plan, every layer's
 *                   conversion and the bank writer.
 * Whenever the import reports success, its bank must open through the loader. */
#include <stdint.h>
#include <string.h>

#include "fuzz_common.h"
#include "import_hf_impl.h"
#include "qm_bank.h"
#include "qmoe_bank_tool.h"

/* A two-layer Mixtral-shaped checkpoint of 2 experts, hidden 8, inter 8,
 * with its tensors split across two shards: built once, reused by the
 * config and index modes. */
#if FUZZ_HF_MODE == 1
static const char CONFIG[] =
    "{\"model_type\": \"mixtral\", \"num_hidden_layers\": 1, \"hidden_size\": 8, "
    "\"intermediate_size\": 8, \"num_local_experts\": 2, \"num_experts_per_tok\": 1}";
#endif

static size_t put_shard(uint8_t *buf, size_t cap, int which)
{
    /* which 0: router + expert 0; 1: expert 1 (both as one shard when 2) */
    char header[4096];
    size_t at = 0, off = 0;
    at += (size_t)snprintf(header + at, sizeof header - at, "{");
    const char *names[7];
    int n = 0;
    if (which != 1) names[n++] = "model.layers.0.block_sparse_moe.gate.weight";
    for (int e = 0; e < 2; e++) {
        if ((which == 0 && e == 1) || (which == 1 && e == 0)) continue;
        static char nm[2][3][96];
        const char *p[3] = {"w1", "w3", "w2"};
        for (int k = 0; k < 3; k++) {
            snprintf(nm[e][k], sizeof nm[e][k],
                     "model.layers.0.block_sparse_moe.experts.%d.%s.weight", e, p[k]);
            names[n++] = nm[e][k];
        }
    }
    for (int i = 0; i < n; i++) {
        int router = strstr(names[i], "gate.weight") != NULL;
        size_t bytes = (router ? 2 : 8) * 8 * 4;
        at += (size_t)snprintf(
            header + at, sizeof header - at,
            "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[%d,8],\"data_offsets\":[%zu,%zu]}",
            i ? "," : "", names[i], router ? 2 : 8, off, off + bytes);
        off += bytes;
    }
    at += (size_t)snprintf(header + at, sizeof header - at, "}");
    while ((8 + at) % 8)
        header[at++] = ' ';
    if (8 + at + off > cap) abort();
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)((uint64_t)at >> (8 * i));
    memcpy(buf + 8, header, at);
    for (size_t i = 0; i < off / 4; i++) {
        float v = (float)((int)(i * 37 % 17) - 8) * 0.0625f;
        memcpy(buf + 8 + at + 4 * i, &v, 4);
    }
    return 8 + at + off;
}

/* mxfp4_int8: the bank an MXFP4 checkpoint takes (1: int8, 0: the e2m1 code book). */
static int run(const qm__hf_file *files, size_t n, int mxfp4_int8)
{
    const char *out = fuzz_out_path();
    qm__hf_checkpoint *ck = NULL;
    qm_status st;
    qm_status_clear(&st);
    if (qm__hf_open_memory(files, n, &ck, &st) != 0) return 0;
    char *argv[] = {
        "hf", "(memory)", "--out", (char *)out, "--quiet", "--mxfp4", mxfp4_int8 ? "int8" : "e2m1",
        NULL};
    int rc = qm__hf_run(ck, 7, argv);
    if (rc == QM__EXIT_OK) {
        qm_bank *bank = NULL;
        if (qm_bank_open(out, &bank, &st) != 0) abort(); /* the writer checked it: never */
        qm_bank_close(bank);
    }
    fuzz_clean();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static uint8_t shard[3][8192];
    static size_t shard_len[3];
    if (!shard_len[0])
        for (int i = 0; i < 3; i++)
            shard_len[i] = put_shard(shard[i], sizeof shard[i], i);
#if FUZZ_HF_MODE == 0 /* config */
    qm__hf_file files[] = {{"config.json", data, size},
                           {"model.safetensors", shard[2], shard_len[2]}};
    return run(files, 2, (int)(size & 1));
#elif FUZZ_HF_MODE == 1 /* index */
    qm__hf_file files[] = {{"config.json", (const uint8_t *)CONFIG, sizeof CONFIG - 1},
                           {"model.safetensors.index.json", data, size},
                           {"model-00001-of-00002.safetensors", shard[0], shard_len[0]},
                           {"model-00002-of-00002.safetensors", shard[1], shard_len[1]}};
    return run(files, 4, (int)(size & 1));
#else                   /* a whole checkpoint */
    if (size < 4) return 0;
    uint32_t clen = (uint32_t)data[0] | (uint32_t)data[1] << 8 | (uint32_t)data[2] << 16 |
                    (uint32_t)data[3] << 24;
    if (clen > size - 4) return 0;
    qm__hf_file files[] = {{"config.json", data + 4, clen},
                           {"model.safetensors", data + 4 + clen, size - 4 - clen}};
    return run(files, 2, (int)(size & 1));
#endif
}
