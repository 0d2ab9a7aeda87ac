/* qm_st_header.h - the bounded safetensors header codec.
 *
 * A safetensors file is an 8-byte little-endian header length N, N bytes of
 * JSON, then the byte buffer. This module turns the JSON (untrusted) into
 * plain C structs and back; it is the only code that parses bank headers, so
 * the rest of model/ never sees cJSON. Parsing checks syntax, nesting depth,
 * sizes and value types only: offsets against the buffer and shapes against
 * the model are qm_bank.c's business. */
#ifndef QM_ST_HEADER_H
#define QM_ST_HEADER_H

#include <stddef.h>
#include <stdint.h>

#include "qm_error.h"

/* Default bounds. A header over max_header_bytes is refused before any
 * allocation; the nesting bound is enforced before cJSON sees the text. */
#define QM_ST_DEFAULT_MAX_HEADER_BYTES (100u * 1024u * 1024u)
#define QM_ST_DEFAULT_MAX_TENSORS 1000000u
#define QM_ST_DEFAULT_MAX_METADATA 4096u
#define QM_ST_MAX_DEPTH 3 /* {"t": {"shape": [..]}} */
#define QM_ST_MAX_NDIM 8
#define QM_ST_NAME_MAX 512 /* tensor names and metadata keys, bytes */
#define QM_ST_VALUE_MAX 4096 /* metadata values, bytes */
/* JSON numbers are doubles: integers above 2^53 cannot be read exactly. */
#define QM_ST_MAX_INTEGER 9007199254740992ull

typedef struct qm_st_limits {
    size_t max_header_bytes;
    size_t max_tensors;
    size_t max_metadata;
} qm_st_limits;

typedef struct qm_st_tensor {
    char *name;
    char dtype[16]; /* as written: "F32", "U8", ... (validated as a short ASCII word) */
    uint32_t ndim;
    uint64_t shape[QM_ST_MAX_NDIM];
    uint64_t begin, end; /* data_offsets, relative to the byte buffer; begin <= end */
} qm_st_tensor;

typedef struct qm_st_meta {
    char *key;
    char *value;
} qm_st_meta;

typedef struct qm_st_header {
    qm_st_tensor *tensors; /* in the order of the JSON text */
    size_t n_tensors;
    qm_st_meta *meta; /* __metadata__, in text order */
    size_t n_meta;
} qm_st_header;

/* Parses `len` bytes of header JSON (not NUL-terminated; trailing spaces
 * allowed, as the spec's padding). `limits` may be NULL for the defaults.
 * On failure returns QM_EINVALID_MODEL (or QM_ENOMEM) with a sentence in st.
 * The caller owns *out: free it with qm_st_header_free (accepts NULL). */
int qm_st_header_parse(const char *json, size_t len, const qm_st_limits *limits,
                       qm_st_header **out, qm_status *st);
void qm_st_header_free(qm_st_header *h);

/* Metadata value for `key`, or NULL. Borrowed from h. */
const char *qm_st_header_meta(const qm_st_header *h, const char *key);

/* Bytes per element of a safetensors dtype name, 0 when unknown. */
size_t qm_st_dtype_size(const char *dtype);

/* Serialises tensors and metadata into header JSON (tensors in the given
 * order, then __metadata__), padded with spaces so that 8 + length is a
 * multiple of `align` (0 or 1: no padding; the spec pads to 8). Returns the
 * text in *json (caller frees with qm_free) and its length (no NUL counted).
 * Names and values are escaped. */
int qm_st_header_format(const qm_st_tensor *tensors, size_t n_tensors, const qm_st_meta *meta,
                        size_t n_meta, size_t align, char **json, size_t *len, qm_status *st);

#endif
