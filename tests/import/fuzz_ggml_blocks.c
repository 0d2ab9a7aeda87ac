/* fuzz_ggml_blocks.c - libFuzzer: ggml's block formats on arbitrary bytes.
 * The first byte picks a supported type and a bank layout; the rest are
 * blocks (the low 5 bits pick the type; 0x20 block 16, 0x40 int4, 0x80 f16
 * scales; at int4, 0x10 also asks for the e2m1 code book). Every dequantiser
 * runs; where the layout repacks the type exactly (qm__ggml_exact_fits), the
 * repacked codes and scales must give back every finite dequantised value
 * bit for bit: the claim `import gguf` records as exact. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_quants.h"
#include "gguf_reader.h"
#include "qm_half.h"

static const uint32_t TYPES[] = {QM__GGML_F32,   QM__GGML_F16,  QM__GGML_BF16, QM__GGML_Q4_0,
                                 QM__GGML_Q4_1,  QM__GGML_Q5_0, QM__GGML_Q5_1, QM__GGML_Q8_0,
                                 QM__GGML_MXFP4, QM__GGML_Q2_K, QM__GGML_Q3_K, QM__GGML_Q4_K,
                                 QM__GGML_Q5_K,  QM__GGML_Q6_K};
#define N_TYPES (sizeof TYPES / sizeof TYPES[0])

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    uint32_t type = TYPES[(data[0] & 0x1f) % N_TYPES];
    unsigned bits = data[0] & 0x40 ? 4 : 8, bs = data[0] & 0x20 ? 16 : 32;
    qm_dtype sdt = data[0] & 0x80 ? QM_DTYPE_F16 : QM_DTYPE_F32;
    qm_codebook cb = bits == 4 && data[0] & 0x10 ? QM_CODEBOOK_E2M1 : QM_CODEBOOK_NONE;
    uint64_t block, bytes;
    if (!qm__ggml_type_size(type, &block, &bytes) || !qm__ggml_can_dequant(type)) abort();
    uint64_t nblocks = (size - 1) / bytes;
    if (nblocks == 0) return 0;
    if (nblocks > 64) nblocks = 64;
    uint64_t n = nblocks * block;
    const uint8_t *src = data + 1;
    float *values = malloc(n * sizeof *values);
    uint8_t *codes = calloc(n, 1);
    float *scales = malloc(n / 16 * sizeof(float) + 4);
    if (!values || !codes || !scales) abort();
    qm__ggml_dequant_row(type, src, n, values);
    int mxfp4_f16_ok = 1; /* the importer takes f16 for MXFP4 only when every exponent fits */
    for (uint64_t b = 0; type == QM__GGML_MXFP4 && b < nblocks; b++)
        mxfp4_f16_ok &= src[b * bytes] >= 104 && src[b * bytes] <= 143;
    if (qm__ggml_exact_fits(type, bits, cb, bs, sdt) && n % bs == 0 &&
        (type != QM__GGML_MXFP4 || sdt != QM_DTYPE_F16 || mxfp4_f16_ok)) {
        qm__ggml_repack_row(type, src, n, bits, cb, bs, sdt, codes, scales);
        const int8_t *book = qm_codebook_values(cb);
        const int zp = 1 << (bits - 1);
        for (uint64_t c = 0; c < n; c++) {
            if (!isfinite(values[c])) continue; /* refused by the importer */
            unsigned code = bits == 8 ? codes[c] : c % 2 ? codes[c / 2] >> 4 : codes[c / 2] & 15;
            float s = sdt == QM_DTYPE_F16 ? qm_f16_to_f32(((const uint16_t *)scales)[c / bs])
                                          : scales[c / bs];
            float got = s * (float)(book ? book[code] : (int)code - zp);
            uint32_t a, b;
            memcpy(&a, &got, 4);
            memcpy(&b, &values[c], 4);
            /* exact: the same value; a zero of either sign is the same zero */
            if (a != b && !(got == 0.0f && values[c] == 0.0f)) abort();
        }
    }
    free(values);
    free(codes);
    free(scales);
    return 0;
}
