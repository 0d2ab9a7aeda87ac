/* import_elements.h - the source element types the importers read
 * (safetensors dtypes, FP8) and their conversion to f32. Quantisation is
 * model/qm_quant.h's, writing the bank model/qm_bank_writer.h's. */
#ifndef QMOE_IMPORT_ELEMENTS_H
#define QMOE_IMPORT_ELEMENTS_H

#include <stddef.h>
#include <stdint.h>

#include "qm_bank.h"

/* ---- elements ------------------------------------------------------------ */

/* Source element types an importer meets (safetensors names in comments). */
typedef enum qm__elem {
    QM__ELEM_F32 = 0, /* F32 */
    QM__ELEM_F16,     /* F16 */
    QM__ELEM_BF16,    /* BF16 */
    QM__ELEM_F8_E4M3, /* F8_E4M3 (e4m3fn: no infinities, 0x7f/0xff NaN) */
    QM__ELEM_U8,      /* U8 */
    QM__ELEM_OTHER,
} qm__elem;

qm__elem qm__elem_from_st(const char *st_dtype);
size_t qm__elem_size(qm__elem e); /* 0 for QM__ELEM_OTHER */
const char *qm__elem_name(qm__elem e);

float qm__e4m3_to_f32(uint8_t v);

/* Element i of a float array of type e (F32/F16/BF16/F8_E4M3) as f32. */
float qm__elem_load(const void *src, qm__elem e, size_t i);
/* Converts n elements to f32 (unaligned sources are fine). */
void qm__elem_load_row(const void *src, qm__elem e, size_t n, float *dst);

/* MXFP4: the 16 E2M1 values in half units (value = half[code] / 2), and an
 * E8M0 block exponent e as the scale of half units, 2^(e - 128). The OCP
 * layout of codes differs between the Hub (low nibble = even column) and
 * ggml (nibbles as Q4_0), so each reader unpacks its own. */
extern const int8_t qm__fp4_half[16];
float qm__e8m0_half_scale(uint8_t e);

#endif
