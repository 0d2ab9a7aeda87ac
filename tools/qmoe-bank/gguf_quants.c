/* gguf_quants.c - ggml block formats: dequantisers, exact repacks into QMoE
 * storage, requantisation. Block layouts (ggml-common.h), per block:
 *   Q4_0  {f16 d; u8 qs[16]}                  x = d·(q − 8), q_j = qs[j] & 15, q_{j+16} = qs[j] >>
 * 4 Q4_1  {f16 d, m; u8 qs[16]}               x = d·q + m Q5_0  {f16 d; u8 qh[4]; u8 qs[16]} x =
 * d·(q − 16), bit 4 of q_j = bit j of qh Q5_1  {f16 d, m; u8 qh[4]; u8 qs[16]}     x = d·q + m Q8_0
 * {f16 d; i8 qs[32]}                  x = d·q MXFP4 {u8 e; u8 qs[16]}                   x =
 * kv[q]·2^(e−128), nibbles as Q4_0 Q2_K  {u8 scales[16]; u8 qs[64]; f16 d, dmin}                per
 * 16: d·(sc&15)·q − dmin·(sc>>4) Q3_K  {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}        per
 * 16: d·(sc−32)·(q − 4·!h) Q4_K  {f16 d, dmin; u8 scales[12]; u8 qs[128]}               per 32:
 * d·sc·q − dmin·m Q5_K  {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}    per 32: d·sc·q −
 * dmin·m Q6_K  {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}          per 16: d·sc·(q − 32) */
#include "gguf_quants.h"

#include <math.h>
#include <string.h>

#include "gguf_reader.h"
#include "import_elements.h"
#include "qm_half.h"
#include "qm_quant.h"

static uint16_t rd16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

/* Q4_K/Q5_K 6-bit scale and min of sub-block j (ggml's get_scale_min_k4). */
static void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m)
{
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
    }
}

/* Element j (0..31) of a 16-byte nibble array laid out as Q4_0's. */
static unsigned nib(const uint8_t *qs, unsigned j)
{
    return j < 16 ? qs[j] & 15u : qs[j - 16] >> 4;
}

/* The 6-bit code of element i (0..255) of a Q6_K block, and its scale index. */
static unsigned q6k_code(const uint8_t *blk, unsigned i, unsigned *scale_index)
{
    const uint8_t *ql = blk, *qh = blk + 128;
    unsigned half = i / 128, r = i % 128, l = r % 32, quarter = r / 32;
    ql += half * 64;
    qh += half * 32;
    *scale_index = half * 8 + r / 16;
    unsigned lo = quarter == 0   ? ql[l] & 15u
                  : quarter == 1 ? ql[l + 32] & 15u
                  : quarter == 2 ? ql[l] >> 4
                                 : ql[l + 32] >> 4;
    return lo | ((qh[l] >> (2 * quarter)) & 3u) << 4;
}

/* A Q6_K block's scales: the f16 super-scale d (returned) after its 16 int8
 * sub-scales (*sc), which follow the 128 + 64 bytes of codes. */
static float q6k_scales(const uint8_t *blk, const int8_t **sc)
{
    *sc = (const int8_t *)(blk + 192);
    return qm_f16_to_f32(rd16(blk + 208));
}

int qm__ggml_can_dequant(uint32_t type)
{
    switch (type) {
    case QM__GGML_F32:
    case QM__GGML_F16:
    case QM__GGML_BF16:
    case QM__GGML_Q4_0:
    case QM__GGML_Q4_1:
    case QM__GGML_Q5_0:
    case QM__GGML_Q5_1:
    case QM__GGML_Q8_0:
    case QM__GGML_MXFP4:
    case QM__GGML_Q2_K:
    case QM__GGML_Q3_K:
    case QM__GGML_Q4_K:
    case QM__GGML_Q5_K:
    case QM__GGML_Q6_K:
        return 1;
    }
    return 0;
}

static void dequant_q3k(const uint8_t *blk, float *y)
{
    const uint8_t *hm = blk, *q = blk + 32, *sc_raw = blk + 96;
    float d_all = qm_f16_to_f32(rd16(blk + 108));
    /* The 16 6-bit scales: low 4 bits from bytes 0..7, high 2 bits from 8..11. */
    int8_t scales[16];
    for (int i = 0; i < 16; i++) {
        unsigned low = i < 8 ? sc_raw[i] & 15u : sc_raw[i - 8] >> 4;
        unsigned high = (sc_raw[8 + i % 4] >> (2 * (i / 4))) & 3u;
        scales[i] = (int8_t)((int)(low | high << 4) - 32);
    }
    int is = 0;
    uint8_t m = 1;
    for (int n = 0; n < 256; n += 128) {
        int shift = 0;
        for (int j = 0; j < 4; j++) {
            float dl = d_all * (float)scales[is++];
            for (int l = 0; l < 16; l++)
                *y++ = dl * (float)((int)((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
            dl = d_all * (float)scales[is++];
            for (int l = 0; l < 16; l++)
                *y++ = dl * (float)((int)((q[l + 16] >> shift) & 3) - ((hm[l + 16] & m) ? 0 : 4));
            shift += 2;
            m = (uint8_t)(m << 1);
        }
        q += 32;
    }
}

static void dequant_k45(const uint8_t *blk, int five, float *y)
{
    float d = qm_f16_to_f32(rd16(blk)), dmin = qm_f16_to_f32(rd16(blk + 2));
    const uint8_t *scales = blk + 4, *qh = blk + 16, *ql = five ? blk + 48 : blk + 16;
    int is = 0;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0; j < 256; j += 64) {
        uint8_t sc, m;
        scale_min_k4(is, scales, &sc, &m);
        float d1 = d * (float)sc, m1 = dmin * (float)m;
        scale_min_k4(is + 1, scales, &sc, &m);
        float d2 = d * (float)sc, m2 = dmin * (float)m;
        for (int l = 0; l < 32; l++)
            *y++ = d1 * (float)((ql[l] & 15) + (five && (qh[l] & u1) ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++)
            *y++ = d2 * (float)((ql[l] >> 4) + (five && (qh[l] & u2) ? 16 : 0)) - m2;
        ql += 32;
        is += 2;
        u1 = (uint8_t)(u1 << 2);
        u2 = (uint8_t)(u2 << 2);
    }
}

void qm__ggml_dequant_row(uint32_t type, const uint8_t *src, uint64_t n, float *dst)
{
    switch (type) {
    case QM__GGML_F32:
        memcpy(dst, src, n * sizeof(float));
        return;
    case QM__GGML_F16:
        for (uint64_t i = 0; i < n; i++)
            dst[i] = qm_f16_to_f32(rd16(src + 2 * i));
        return;
    case QM__GGML_BF16:
        for (uint64_t i = 0; i < n; i++)
            dst[i] = qm_bf16_to_f32(rd16(src + 2 * i));
        return;
    default:
        break;
    }
    uint64_t block, bytes;
    qm__ggml_type_size(type, &block, &bytes);
    for (uint64_t b = 0; b < n / block; b++, src += bytes, dst += block) {
        const uint8_t *p = src;
        switch (type) {
        case QM__GGML_Q4_0: {
            float d = qm_f16_to_f32(rd16(p));
            for (unsigned j = 0; j < 32; j++)
                dst[j] = d * (float)((int)nib(p + 2, j) - 8);
            break;
        }
        case QM__GGML_Q4_1: {
            float d = qm_f16_to_f32(rd16(p)), m = qm_f16_to_f32(rd16(p + 2));
            for (unsigned j = 0; j < 32; j++)
                dst[j] = d * (float)nib(p + 4, j) + m;
            break;
        }
        case QM__GGML_Q5_0:
        case QM__GGML_Q5_1: {
            int one = type == QM__GGML_Q5_1;
            float d = qm_f16_to_f32(rd16(p)), m = one ? qm_f16_to_f32(rd16(p + 2)) : 0.0f;
            const uint8_t *qhp = p + (one ? 4 : 2), *qs = qhp + 4;
            uint32_t qh = (uint32_t)qhp[0] | (uint32_t)qhp[1] << 8 | (uint32_t)qhp[2] << 16 |
                          (uint32_t)qhp[3] << 24;
            for (unsigned j = 0; j < 32; j++) {
                int q = (int)(nib(qs, j) | ((qh >> j) & 1u) << 4);
                dst[j] = one ? d * (float)q + m : d * (float)(q - 16);
            }
            break;
        }
        case QM__GGML_Q8_0: {
            float d = qm_f16_to_f32(rd16(p));
            for (unsigned j = 0; j < 32; j++)
                dst[j] = d * (float)(int8_t)p[2 + j];
            break;
        }
        case QM__GGML_MXFP4: {
            float d = qm__e8m0_half_scale(p[0]);
            for (unsigned j = 0; j < 32; j++)
                dst[j] = d * (float)qm__fp4_half[nib(p + 1, j)];
            break;
        }
        case QM__GGML_Q2_K: {
            const uint8_t *scales = p, *q = p + 16;
            float d = qm_f16_to_f32(rd16(p + 80)), dmin = qm_f16_to_f32(rd16(p + 82));
            float *y = dst;
            int is = 0;
            for (int nn = 0; nn < 256; nn += 128) {
                int shift = 0;
                for (int j = 0; j < 4; j++) {
                    uint8_t sc = scales[is++];
                    float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
                    for (int l = 0; l < 16; l++)
                        *y++ = dl * (float)((q[l] >> shift) & 3) - ml;
                    sc = scales[is++];
                    dl = d * (float)(sc & 15);
                    ml = dmin * (float)(sc >> 4);
                    for (int l = 0; l < 16; l++)
                        *y++ = dl * (float)((q[l + 16] >> shift) & 3) - ml;
                    shift += 2;
                }
                q += 32;
            }
            break;
        }
        case QM__GGML_Q3_K:
            dequant_q3k(p, dst);
            break;
        case QM__GGML_Q4_K:
        case QM__GGML_Q5_K:
            dequant_k45(p, type == QM__GGML_Q5_K, dst);
            break;
        case QM__GGML_Q6_K: {
            const int8_t *sc;
            float d = q6k_scales(p, &sc);
            for (unsigned i = 0; i < 256; i++) {
                unsigned si, q = q6k_code(p, i, &si);
                dst[i] = d * (float)sc[si] * (float)((int)q - 32);
            }
            break;
        }
        }
    }
}

/* ---- exact repacks --------------------------------------------------------------- */

int qm__ggml_exact_fits(uint32_t type, unsigned bits, qm_codebook cb, unsigned bs, qm_dtype sdt)
{
    if (cb == QM_CODEBOOK_E2M1) /* MXFP4's nibble is the code book's code */
        return type == QM__GGML_MXFP4 && bits == 4 && (bs == 32 || bs == 16);
    if (cb != QM_CODEBOOK_NONE) return 0;
    switch (type) {
    case QM__GGML_Q4_0:
        return (bs == 32 || bs == 16) && (sdt == QM_DTYPE_F16 || sdt == QM_DTYPE_F32) &&
               (bits == 4 || bits == 8);
    case QM__GGML_Q8_0:
    case QM__GGML_Q5_0:
        return bits == 8 && (bs == 32 || bs == 16) && (sdt == QM_DTYPE_F16 || sdt == QM_DTYPE_F32);
    case QM__GGML_MXFP4: /* f16 only when every exponent fits (the caller checks) */
        return bits == 8 && (bs == 32 || bs == 16);
    case QM__GGML_Q6_K:
        return bits == 8 && bs == 16 && sdt == QM_DTYPE_F32;
    }
    return 0;
}

static void put_code(uint8_t *codes, unsigned bits, uint64_t c, unsigned code)
{
    if (bits == 8) {
        codes[c] = (uint8_t)code;
    } else if (c % 2 == 0) {
        codes[c / 2] = (uint8_t)((codes[c / 2] & 0xF0u) | (code & 15u));
    } else {
        codes[c / 2] = (uint8_t)((codes[c / 2] & 0x0Fu) | (code & 15u) << 4);
    }
}

/* Stores scale s as element i: an f16 source scale as its own bits,
 * anything else converted (exactly, as qm__ggml_exact_fits promised). */
static void put_scale(void *scales, qm_dtype sdt, uint64_t i, float s, int from_f16,
                      uint16_t f16_bits)
{
    if (sdt == QM_DTYPE_F16 && from_f16)
        ((uint16_t *)scales)[i] = f16_bits;
    else
        qm_quant_store(scales, sdt, i, s);
}

void qm__ggml_repack_row(uint32_t type, const uint8_t *src, uint64_t n, unsigned bits,
                         qm_codebook cb, unsigned bs, qm_dtype sdt, uint8_t *codes, void *scales)
{
    uint64_t block, bytes;
    qm__ggml_type_size(type, &block, &bytes);
    for (uint64_t b = 0; b < n / block; b++, src += bytes) {
        uint64_t c0 = b * block;
        switch (type) {
        case QM__GGML_Q4_0:
        case QM__GGML_Q8_0: {
            uint16_t dh = rd16(src);
            float d = qm_f16_to_f32(dh);
            for (unsigned j = 0; j < 32; j++) {
                unsigned code = type == QM__GGML_Q8_0 ? (unsigned)((int)(int8_t)src[2 + j] + 128)
                                : bits == 8           ? nib(src + 2, j) + 120u
                                                      : nib(src + 2, j);
                put_code(codes, bits, c0 + j, code);
            }
            for (unsigned k = 0; k < 32 / bs; k++)
                put_scale(scales, sdt, c0 / bs + k, d, 1, dh);
            break;
        }
        case QM__GGML_Q5_0: {
            uint16_t dh = rd16(src);
            uint32_t qh = (uint32_t)src[2] | (uint32_t)src[3] << 8 | (uint32_t)src[4] << 16 |
                          (uint32_t)src[5] << 24;
            for (unsigned j = 0; j < 32; j++) /* q5 - 16 + 128 */
                put_code(codes, bits, c0 + j, (nib(src + 6, j) | ((qh >> j) & 1u) << 4) + 112u);
            for (unsigned k = 0; k < 32 / bs; k++)
                put_scale(scales, sdt, c0 / bs + k, qm_f16_to_f32(dh), 1, dh);
            break;
        }
        case QM__GGML_MXFP4: {
            float d = qm__e8m0_half_scale(src[0]);
            for (unsigned j = 0; j < 32; j++) /* e2m1: the nibble; int8: its value + 128 */
                put_code(codes, bits, c0 + j,
                         cb == QM_CODEBOOK_E2M1 ? nib(src + 1, j)
                                                : (unsigned)(qm__fp4_half[nib(src + 1, j)] + 128));
            for (unsigned k = 0; k < 32 / bs; k++)
                put_scale(scales, sdt, c0 / bs + k, d, 0, 0);
            break;
        }
        case QM__GGML_Q6_K: {
            for (unsigned i = 0; i < 256; i++) {
                unsigned si, q = q6k_code(src, i, &si);
                put_code(codes, bits, c0 + i, q + 96u);
            }
            const int8_t *sc; /* a scale per 16 codes, times the block's d */
            float d = q6k_scales(src, &sc);
            for (unsigned k = 0; k < 16; k++)
                put_scale(scales, sdt, c0 / 16 + k, d * (float)sc[k], 0, 0);
            break;
        }
        }
    }
}
