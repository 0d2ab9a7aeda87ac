/* qm_client_codec.h - the client side of the wire: a cJSON-free JSON value
 * tree, request lines, response envelopes and the tensor codec.
 *
 * Clients (libqmoe-client, qmoectl) never see cJSON: responses are parsed
 * into a qm_cval tree owned by the caller, and requests are printed from one.
 * The tree is deliberately small: values in document order, objects as
 * ordered (key, value) lists, numbers as double (PROTOCOL.md keeps every
 * integer below 2^53). */
#ifndef QM_CLIENT_CODEC_H
#define QM_CLIENT_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "qm_buf.h"
#include "qm_error.h"

typedef enum qm_cval_type {
    QM_CVAL_NULL,
    QM_CVAL_BOOL,
    QM_CVAL_NUMBER,
    QM_CVAL_STRING,
    QM_CVAL_ARRAY,
    QM_CVAL_OBJECT,
} qm_cval_type;

typedef struct qm_cval qm_cval;
struct qm_cval {
    qm_cval_type type;
    char *key;         /* member name when this value sits in an object, else NULL */
    int boolean;       /* QM_CVAL_BOOL */
    double number;     /* QM_CVAL_NUMBER */
    char *string;      /* QM_CVAL_STRING, NUL-terminated (JSON may hold \u0000: see len) */
    size_t string_len; /* bytes in `string` without the terminator */
    qm_cval **items;   /* QM_CVAL_ARRAY elements / QM_CVAL_OBJECT members, in order */
    size_t count;
    size_t cap;
};

/* Constructors return NULL when out of memory. The string ones copy. */
qm_cval *qm_cval_new(qm_cval_type type);
qm_cval *qm_cval_new_number(double v);
qm_cval *qm_cval_new_bool(int v);
qm_cval *qm_cval_new_string(const char *s);
qm_cval *qm_cval_new_string_len(const char *s, size_t len);
/* Takes ownership of `buf` (from qm_malloc) as the string's storage. */
qm_cval *qm_cval_new_string_owned(char *buf, size_t len);
/* Frees the value and everything below it. Accepts NULL. */
void qm_cval_free(qm_cval *v);

/* Appends `item` to an array (key NULL) or object (key copied). Takes
 * ownership of `item` in every case: on failure it is freed. Returns 0 or
 * QM_ENOMEM / QM_EINVAL. */
int qm_cval_append(qm_cval *container, const char *key, qm_cval *item);

/* Lookups borrow: the result lives as long as its parent. NULL when absent
 * or when `v` is not of the right type. Keys are case-sensitive; with a
 * duplicate key the first wins. */
const qm_cval *qm_cval_get(const qm_cval *obj, const char *key);
const qm_cval *qm_cval_at(const qm_cval *arr, size_t index);
/* Typed lookups: 0 and the value, or QM_EINVAL when absent or mistyped. */
int qm_cval_get_u64(const qm_cval *obj, const char *key, uint64_t *out);
int qm_cval_get_i64(const qm_cval *obj, const char *key, int64_t *out);
int qm_cval_get_double(const qm_cval *obj, const char *key, double *out);
const char *qm_cval_get_string(const qm_cval *obj, const char *key); /* NULL if not a string */

/* Parses exactly `len` bytes of one JSON text (nesting at most 64, trailing
 * garbage rejected). On success *out is a new tree owned by the caller. */
int qm_cval_parse(const char *buf, size_t len, qm_cval **out, qm_status *st);

/* Prints `v` as JSON: compact (no whitespace, never a raw newline) or
 * indented by two spaces when `pretty`. Returns a qm_malloc'd NUL-terminated
 * string, its length in *len_out (may be NULL); NULL when out of memory.
 * Integral numbers below 2^53 print without exponent or fraction. */
char *qm_cval_print(const qm_cval *v, int pretty, size_t *len_out);

/* One request line: {"jsonrpc":"2.0","id":ID,"method":M,"params":P}\n.
 * `params` is borrowed (NULL for none). Returns a qm_malloc'd line ending in
 * '\n', its length in *len_out; NULL when out of memory. */
char *qm__client_codec_request(uint64_t id, const char *method, const qm_cval *params,
                              size_t *len_out);

/* The same line with `params` already printed (params_len bytes of compact
 * JSON, no newline), for a call that writes them straight into a qm_buf. */
char *qm__client_codec_request_text(uint64_t id, const char *method, const char *params,
                                   size_t params_len, size_t *len_out);

/* A number and a string exactly as qm_cval_print writes them. */
void qm__client_codec_number(qm_buf *b, double d);
void qm__client_codec_string(qm_buf *b, const char *s);

/* A JSON-RPC error as the client reports it. */
typedef struct qm__client_codec_error {
    int code;          /* JSON-RPC code, e.g. -32602 */
    char message[256]; /* error.message */
    char reason[512];  /* error.data.reason, else the message */
    char field[128];   /* error.data.field, "" if none */
} qm__client_codec_error;

/* Splits a response envelope. On 0, *id_out holds the id (a string id, which
 * this client never sends, gives QM_EPARSE), and exactly one of *result_out
 * (a tree the caller owns) or *is_error (1, with *error filled) is set.
 * QM_EPARSE when the text is not a JSON-RPC 2.0 response. */
int qm__client_codec_response(const char *buf, size_t len, uint64_t *id_out,
                             qm_cval **result_out, int *is_error,
                             qm__client_codec_error *error, qm_status *st);

/* The protocol's error name for a code ("invalid_params", "not_found", ...);
 * "error" for codes it does not name. Static string. */
const char *qm__client_codec_error_name(int code);

/* Tensors: dtype names and element sizes. */
typedef enum qm_cdtype {
    QM_CDTYPE_F32 = 0,
    QM_CDTYPE_F16 = 1,
    QM_CDTYPE_BF16 = 2,
    QM_CDTYPE_I32 = 3, /* topk_ids */
} qm_cdtype;
#define QM_CTENSOR_MAX_DIMS 8
const char *qm_cdtype_name(qm_cdtype dt);
size_t qm_cdtype_size(qm_cdtype dt);
int qm_cdtype_parse(const char *name, qm_cdtype *out);

/* Builds {"dtype","shape","data":base64} from raw little-endian bytes.
 * `nbytes` must equal the shape's product times the element size. */
int qm__client_codec_tensor_encode(qm_cdtype dt, const uint64_t *shape, int ndim,
                                  const void *data, size_t nbytes, qm_cval **out,
                                  qm_status *st);
/* Reads a tensor object. On 0 *data_out is a qm_malloc'd buffer of
 * *nbytes_out bytes the caller owns. Shape and byte length must agree. */
int qm__client_codec_tensor_decode(const qm_cval *tensor, qm_cdtype *dt_out,
                                  uint64_t shape_out[QM_CTENSOR_MAX_DIMS], int *ndim_out,
                                  void **data_out, size_t *nbytes_out, qm_status *st);

/* Standard base64 with padding. encode returns a qm_malloc'd string (NULL on
 * overflow or no memory); decode rejects bad characters and bad padding. */
char *qm__client_b64_encode(const void *data, size_t len, size_t *out_len);
int qm__client_b64_decode(const char *s, size_t len, void **out, size_t *out_len);

#endif
