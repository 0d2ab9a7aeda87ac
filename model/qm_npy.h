/* qm_npy.h - NumPy .npy files (format 1.0/2.0/3.0), the tensors of `qmoe-bank run`
 * and `qmoectl infer`.
 *
 * Reads and writes little-endian f32 ('<f4'), f16 ('<f2') and, as a project
 * extension, bf16 (stored as '<u2' raw bits: NumPy has no bfloat16; the
 * caller says which it expects), C order only. The header is untrusted:
 * magic, version, length, dict syntax, keys, dtype, order and shape are all
 * checked, and the element count x size is overflow-checked against the
 * bytes that follow. */
#ifndef QM_NPY_H
#define QM_NPY_H

#include <stddef.h>
#include <stdint.h>

#include "qm_error.h"

#define QM_NPY_MAX_NDIM 8
#define QM_NPY_MAX_HEADER 65536 /* bytes of header dict; NumPy writes < 1 KiB */

typedef enum qm_npy_dtype {
    QM_NPY_F32 = 0, /* '<f4' */
    QM_NPY_F16,     /* '<f2' */
    QM_NPY_U16,     /* '<u2' (bf16 bits when the caller says so) */
    QM_NPY_I32,     /* '<i4' (routing ids) */
} qm_npy_dtype;

typedef struct qm_npy {
    qm_npy_dtype dtype;
    uint32_t ndim;
    uint64_t shape[QM_NPY_MAX_NDIM];
    uint64_t count;  /* product of shape (1 for a 0-d array) */
    uint64_t nbytes; /* count * element size */
    void *data;      /* owned by the struct; qm_npy_free releases it */
} qm_npy;

/* Parses an in-memory .npy image. The data is copied (aligned). On failure
 * returns QM_EINVAL with a sentence naming the rule that failed. */
int qm_npy_parse(const void *buf, size_t size, qm_npy *out, qm_status *st);
/* Reads `path` (at most max_bytes; 0 = 16 GiB) and parses it. QM_EIO when
 * the file cannot be read. */
int qm_npy_read(const char *path, uint64_t max_bytes, qm_npy *out, qm_status *st);
/* Writes data (count elements of dtype, C order) with the given shape. */
int qm_npy_write(const char *path, qm_npy_dtype dtype, const uint64_t *shape, uint32_t ndim,
                 const void *data, qm_status *st);
void qm_npy_free(qm_npy *npy); /* releases data; accepts NULL */

size_t qm_npy_dtype_size(qm_npy_dtype dtype);

#endif
