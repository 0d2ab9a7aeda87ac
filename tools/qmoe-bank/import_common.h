/* import_common.h - the source element types the importers read
 * (safetensors dtypes, FP8) and their conversion to f32. Quantisation is
 * model/qm_quant.h's, writing the bank model/qm_bank_writer.h's. */
#ifndef QMOE_IMPORT_COMMON_H
#define QMOE_IMPORT_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "qm_bank.h"

/* ---- elements ------------------------------------------------------------ */

/* Source element types an importer meets (safetensors names in comments). */
typedef enum qmi_elem {
    QMI_ELEM_F32 = 0, /* F32 */
    QMI_ELEM_F16,     /* F16 */
    QMI_ELEM_BF16,    /* BF16 */
    QMI_ELEM_F8_E4M3, /* F8_E4M3 (e4m3fn: no infinities, 0x7f/0xff NaN) */
    QMI_ELEM_U8,      /* U8 */
    QMI_ELEM_OTHER,
} qmi_elem;

qmi_elem qmi_elem_from_st(const char *st_dtype);
size_t qmi_elem_size(qmi_elem e); /* 0 for QMI_ELEM_OTHER */
const char *qmi_elem_name(qmi_elem e);

float qmi_e4m3_to_f32(uint8_t v);

/* Element i of a float array of type e (F32/F16/BF16/F8_E4M3) as f32. */
float qmi_load(const void *src, qmi_elem e, size_t i);
/* Converts n elements to f32 (unaligned sources are fine). */
void qmi_load_row(const void *src, qmi_elem e, size_t n, float *dst);

#endif
