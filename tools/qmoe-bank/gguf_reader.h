/* gguf_reader.h - a bounded reader of GGUF files (llama.cpp's format,
 * versions 2 and 3) for `qmoe-bank import gguf`.
 *
 * The file is mapped read-only and nothing in it is trusted: every length,
 * count, type and offset is checked against the mapping before use, and a
 * violation is QM_EINVALID_MODEL with a sentence naming the key or tensor.
 * Metadata values are decoded (scalars, strings); arrays are skipped except
 * for their element type and count. Tensor data stays in the mapping. */
#ifndef QMOE_GGUF_READER_H
#define QMOE_GGUF_READER_H

#include <stddef.h>
#include <stdint.h>

#include "qm_error.h"

/* GGUF metadata value types (gguf.GGUFValueType). */
enum {
    QMG_U8 = 0, QMG_I8, QMG_U16, QMG_I16, QMG_U32, QMG_I32, QMG_F32, QMG_BOOL,
    QMG_STRING, QMG_ARRAY, QMG_U64, QMG_I64, QMG_F64, QMG_VALUE_TYPES
};

/* ggml tensor types this importer names (ggml.h / gguf.GGMLQuantizationType). */
enum {
    QMG_F32_T = 0, QMG_F16_T = 1, QMG_Q4_0 = 2, QMG_Q4_1 = 3, QMG_Q5_0 = 6, QMG_Q5_1 = 7,
    QMG_Q8_0 = 8, QMG_Q8_1 = 9, QMG_Q2_K = 10, QMG_Q3_K = 11, QMG_Q4_K = 12, QMG_Q5_K = 13,
    QMG_Q6_K = 14, QMG_Q8_K = 15, QMG_BF16_T = 30, QMG_MXFP4 = 39
};

typedef struct qmg_kv {
    char *key;
    uint32_t type;
    union {
        uint64_t u;
        int64_t i;
        double f;
    } v;                 /* scalars (bool as u) */
    char *str;           /* QMG_STRING, NUL-terminated copy */
    uint32_t arr_type;   /* QMG_ARRAY: element type and count */
    uint64_t arr_count;
} qmg_kv;

typedef struct qmg_tensor {
    char *name;
    uint32_t n_dims;
    uint64_t ne[4];       /* ggml order: ne[0] varies fastest */
    uint32_t type;        /* ggml type id */
    uint64_t offset;      /* from the data section */
    uint64_t nbytes;      /* 0 when the type is unknown (size not computable) */
    const uint8_t *data;  /* NULL when the type is unknown */
} qmg_tensor;

typedef struct qmg_file {
    uint32_t version;
    uint64_t alignment;
    qmg_kv *kv;
    size_t n_kv;
    qmg_tensor *tensors;
    size_t n_tensors;
    const uint8_t *base; /* the mapping */
    uint64_t size;
} qmg_file;

/* Block size (elements) and bytes per block of a ggml type; 0 when unknown. */
int qmg_type_size(uint32_t type, uint64_t *block, uint64_t *bytes);
/* "Q4_0", "F32", ...; "type N" for unknown ids (buf of at least 16 bytes). */
const char *qmg_type_name(uint32_t type, char *buf, size_t size);

/* Maps and parses `path`. The caller owns *out (qmg_close accepts NULL). */
int qmg_open(const char *path, qmg_file **out, qm_status *st);
void qmg_close(qmg_file *f);

const qmg_kv *qmg_find_kv(const qmg_file *f, const char *key);
const qmg_tensor *qmg_find_tensor(const qmg_file *f, const char *name);
/* The value of an integer-typed key (any int type or bool) as u64: 0 found,
 * 1 absent; QM_EINVALID_MODEL (naming the key) for another type or a
 * negative value. */
int qmg_get_uint(const qmg_file *f, const char *key, uint64_t *out, qm_status *st);
/* Same for a float (f32/f64) or an integer key. */
int qmg_get_float(const qmg_file *f, const char *key, double *out, qm_status *st);
/* A bool key (or an integer 0/1). */
int qmg_get_bool(const qmg_file *f, const char *key, int *out, qm_status *st);

#endif
