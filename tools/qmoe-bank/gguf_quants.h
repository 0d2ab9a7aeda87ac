/* gguf_quants.h - ggml block formats for `qmoe-bank import gguf`: our own
 * dequantisers (written from the block layouts of ggml-common.h, checked
 * against gguf-py's dequantize in the tests), the exact repacks into QMoE
 * storage (requantisation is model/qm_quant.h's).
 *
 * Exact repacks (the QMoE value scale·(code − zp) is the ggml value bit for
 * bit, since ggml evaluates (d·sc)·q in f32 and every product is exact):
 *   Q4_0  -> int4 (code q) or int8 (code q + 120), block 32 or 16, f16/f32 scales d
 *   Q8_0  -> int8, code q + 128, block 32 or 16, f16/f32 scales d
 *   Q5_0  -> int8, code q5 + 112 (value q5 - 16), block 32 or 16, f16/f32 scales d
 *   MXFP4 -> int8, code kv[q] + 128 (kv = 2 x E2M1), block 32 or 16, scales 2^(e-128):
 *            f32, bf16, or f16 when every exponent e is in [104, 143] (the caller checks);
 *            or 4-bit codes of the e2m1 code book (qmoe.codebook): code q itself, the
 *            value kv[q], same blocks and scales
 *   Q6_K  -> int8, code q6 + 96, block 16, f32 scales d·sc
 * Every other supported type (F32, F16, BF16, Q4_1, Q5_1, Q2_K, Q3_K, Q4_K,
 * Q5_K) is dequantised and requantised. */
#ifndef QMOE_GGUF_QUANTS_H
#define QMOE_GGUF_QUANTS_H

#include <stddef.h>
#include <stdint.h>

#include "qm_bank.h"

/* 1 when qm__ggml_dequant_row knows the type. */
int qm__ggml_can_dequant(uint32_t type);
/* Dequantises one row of n elements (a multiple of the type's block) at src
 * into dst. The caller checked the type with qm__ggml_can_dequant. */
void qm__ggml_dequant_row(uint32_t type, const uint8_t *src, uint64_t n, float *dst);

/* 1 when `type` repacks exactly into codes of `bits` (through code book cb,
 * or none) with blocks of `bs` and scales of dtype `sdt`. */
int qm__ggml_exact_fits(uint32_t type, unsigned bits, qm_codebook cb, unsigned bs, qm_dtype sdt);
/* The repack of one row of n elements: codes packed QMoE-style (column c in
 * byte c/(8/bits), low nibble = even column), n/bs scales of dtype sdt at
 * scales. Only for a (type, bits, cb, bs, sdt) that qm__ggml_exact_fits
 * accepts. */
void qm__ggml_repack_row(uint32_t type, const uint8_t *src, uint64_t n, unsigned bits,
                         qm_codebook cb, unsigned bs, qm_dtype sdt, uint8_t *codes, void *scales);

#endif
