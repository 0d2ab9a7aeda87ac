/* qm_quant.h - round-to-nearest quantisation of f32 rows into QMoE storage:
 * the one quantiser of `qmoe-bank create`, `import hf` and `import gguf`.
 *
 * A row of k values is cut into blocks of block_size columns (0: the whole
 * row is one block). Each block gets a scale and, asymmetric, a zero point:
 *   symmetric   scale = absmax / (2^(bits-1) - 1), zero point 2^(bits-1) (implicit)
 *   asymmetric  scale = (max - min) / (2^bits - 1), zero point round(-min / scale)
 * both floored at 1e-8. Codes are the exact round to nearest of w / scale
 * (ties to even; symmetric codes clamped to [-2^(bits-1), 2^(bits-1) - 1]
 * before the zero point is added, asymmetric ones to [0, 2^bits - 1]),
 * packed along the row, low nibble = even column at 4 bits.
 *
 * Which scale the codes are rounded against is the rule's one choice:
 *   QM_QUANT_STORED_SCALE  the scale as stored (rounded to scale_dtype, and
 *                          never below that dtype's smallest positive value),
 *                          so dequantised = stored scale x (code - zp) is the
 *                          RTN of the source: the importers' rule;
 *   QM_QUANT_F32_SCALE     the f32 scale, rounded to scale_dtype only when
 *                          stored: onnxruntime's QMoE tests' recipe, which
 *                          `qmoe-bank create` follows (and tests/model checks
 *                          against qmoebank.quantize_rows).
 * The two give the same bytes for f32 scales. */
#ifndef QM_QUANT_H
#define QM_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "qm_bank.h"

typedef enum qm_quant_scale_rule {
    QM_QUANT_STORED_SCALE = 0,
    QM_QUANT_F32_SCALE,
} qm_quant_scale_rule;

typedef struct qm_quant_spec {
    unsigned bits;        /* 4 or 8 */
    uint64_t block_size;  /* columns per scale; 0 = one scale per row */
    qm_dtype scale_dtype; /* F32, F16 or BF16 */
    int asymmetric;
    qm_quant_scale_rule rule;
} qm_quant_spec;

/* The quantisation error of one matrix, accumulated over its rows:
 * sum (dequantised - source)^2 and sum source^2 (summed in f32 over each
 * 32-column chunk, in f64 across chunks), and whether every dequantised
 * value equals its source bit for bit. Start from QM_QUANT_ERROR_INIT. */
typedef struct qm_quant_error {
    double diff2, ref2;
    int exact;
} qm_quant_error;
#define QM_QUANT_ERROR_INIT ((qm_quant_error){0.0, 0.0, 1})

/* sqrt(diff2 / ref2): 0 when exact (or nothing differs), infinity when the
 * source is all zeros but the result is not. */
double qm_quant_error_rel(const qm_quant_error *e);

/* Quantises the k values at w: codes into packed[k * bits / 8] (k a multiple
 * of 8 / bits), the blocks' scales as elements [scale_at, scale_at + nblk)
 * of the scale_dtype array `scales`, and, asymmetric, each block's zero
 * point as one byte in zero_points[nblk] (unpacked: how zero points pack
 * depends on the tensor, BANK_FORMAT.md). err (may be NULL) accumulates the
 * error against the stored scale. Returns 0; QM_EINVAL when w holds a NaN or
 * an infinity; QM_EUNSUPPORTED when a block's scale is beyond scale_dtype's
 * range (f16 ends at 65504: an int4 block whose largest value passes
 * 458,528). The outputs are then unspecified. */
int qm_quant_row(const qm_quant_spec *q, const float *w, uint64_t k, uint8_t *packed, void *scales,
                 uint64_t scale_at, uint8_t *zero_points, qm_quant_error *err);

/* 1 when every one of the n values is finite. */
int qm_quant_finite(const float *w, uint64_t n);

/* v as it reads back once stored as dtype dt (F32: v itself). */
float qm_quant_round_to(qm_dtype dt, float v);
/* Stores v, rounded, as element i of a dt array (F32, F16 or BF16). */
void qm_quant_store(void *dst, qm_dtype dt, size_t i, float v);

#endif
