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
    QM__GGUF_U8 = 0,
    QM__GGUF_I8,
    QM__GGUF_U16,
    QM__GGUF_I16,
    QM__GGUF_U32,
    QM__GGUF_I32,
    QM__GGUF_F32,
    QM__GGUF_BOOL,
    QM__GGUF_STRING,
    QM__GGUF_ARRAY,
    QM__GGUF_U64,
    QM__GGUF_I64,
    QM__GGUF_F64,
    QM__GGUF_VALUE_TYPES
};

/* ggml tensor types this importer names (ggml.h / gguf.GGMLQuantizationType). */
enum {
    QM__GGML_F32 = 0,
    QM__GGML_F16 = 1,
    QM__GGML_Q4_0 = 2,
    QM__GGML_Q4_1 = 3,
    QM__GGML_Q5_0 = 6,
    QM__GGML_Q5_1 = 7,
    QM__GGML_Q8_0 = 8,
    QM__GGML_Q8_1 = 9,
    QM__GGML_Q2_K = 10,
    QM__GGML_Q3_K = 11,
    QM__GGML_Q4_K = 12,
    QM__GGML_Q5_K = 13,
    QM__GGML_Q6_K = 14,
    QM__GGML_Q8_K = 15,
    QM__GGML_BF16 = 30,
    QM__GGML_MXFP4 = 39
};

typedef struct qm__gguf_kv {
    char *key;
    uint32_t type;
    union {
        uint64_t u;
        int64_t i;
        double f;
    } v;               /* scalars (bool as u) */
    char *str;         /* QM__GGUF_STRING, NUL-terminated copy */
    uint32_t arr_type; /* QM__GGUF_ARRAY: element type and count */
    uint64_t arr_count;
} qm__gguf_kv;

typedef struct qm__gguf_tensor {
    char *name;
    uint32_t n_dims;
    uint64_t ne[4];      /* ggml order: ne[0] varies fastest */
    uint32_t type;       /* ggml type id */
    uint64_t offset;     /* from the data section */
    uint64_t nbytes;     /* 0 when the type is unknown (size not computable) */
    const uint8_t *data; /* NULL when the type is unknown */
} qm__gguf_tensor;

typedef struct qm__gguf_file {
    uint32_t version;
    uint64_t alignment;
    qm__gguf_kv *kv;
    size_t n_kv;
    qm__gguf_tensor *tensors;
    size_t n_tensors;
    const qm__gguf_tensor **by_name; /* the tensors sorted by name */
    const uint8_t *base;             /* the mapping */
    int mapped;                      /* 1: base is ours to unmap */
    uint64_t size;
} qm__gguf_file;

/* Block size (elements) and bytes per block of a ggml type; 0 when unknown. */
int qm__ggml_type_size(uint32_t type, uint64_t *block, uint64_t *bytes);
/* "Q4_0", "F32", ...; "type N" for unknown ids (buf of at least 16 bytes). */
const char *qm__ggml_type_name(uint32_t type, char *buf, size_t size);

/* Maps and parses `path` (a regular file, tool_input.h). The caller owns *out
 * (qm__gguf_close accepts NULL). */
int qm__gguf_open(const char *path, qm__gguf_file **out, qm_status *st);
/* Parses size bytes at data (fuzzing, tests); data must outlive *out. */
int qm__gguf_open_memory(const void *data, size_t size, qm__gguf_file **out, qm_status *st);
void qm__gguf_close(qm__gguf_file *f);

const qm__gguf_kv *qm__gguf_find_kv(const qm__gguf_file *f, const char *key);
const qm__gguf_tensor *qm__gguf_find_tensor(const qm__gguf_file *f, const char *name);
/* The value of an integer-typed key (any int type or bool) as u64: 0 found,
 * 1 absent; QM_EINVALID_MODEL (naming the key) for another type or a
 * negative value. */
int qm__gguf_get_uint(const qm__gguf_file *f, const char *key, uint64_t *out, qm_status *st);
/* Same for a float (f32/f64) or an integer key. */
int qm__gguf_get_float(const qm__gguf_file *f, const char *key, double *out, qm_status *st);
/* A bool key (or an integer 0/1). */
int qm__gguf_get_bool(const qm__gguf_file *f, const char *key, int *out, qm_status *st);

/* import_gguf.c: `import gguf` with argv as the command's (argv[0] = "gguf"),
 * over f when it is not NULL (FILE is then only a name); f is closed
 * whatever the outcome. Returns the exit status. */
int qm__gguf_run(qm__gguf_file *f, int argc, char **argv);

#endif
