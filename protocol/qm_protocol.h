/* qm_protocol.h - the qmoed wire protocol: framing, JSON-RPC 2.0 decoding into
 * typed requests, the tensor codec, and the writer responses are encoded with.
 *
 * The contract is ../shared/PROTOCOL.md (docs/PROTOCOL.md adds the decisions
 * it leaves open). Nothing outside protocol/ sees cJSON: requests come out as
 * the C structs below, responses go in through qm_jw (a streaming writer). */
#ifndef QM_PROTOCOL_H
#define QM_PROTOCOL_H

#include <stddef.h>
#include <stdint.h>

#include "qm_buf.h"
#include "qm_error.h"

/* ---- Limits (each one a config key of the daemon) ------------------------ */

#define QM_DEFAULT_MAX_REQUEST_BYTES (64u << 20) /* max_request_bytes */
#define QM_DEFAULT_MAX_NESTING 64                /* max_nesting */
#define QM_DEFAULT_MAX_BATCH 128                 /* max_batch */
#define QM_MAX_ECHO_BYTES 64 /* never echo more of the offending input */

typedef struct qm_proto_limits {
    size_t max_request_bytes;
    int max_nesting;
    size_t max_batch;
} qm_proto_limits;

/* Fills the defaults above. */
void qm_proto_limits_default(qm_proto_limits *lim);

/* ---- JSON-RPC error codes ------------------------------------------------ */

#define QM_RPC_CODE_MAP(X)                                                                         \
    X(PARSE_ERROR, -32700, "parse_error")                                                          \
    X(INVALID_REQUEST, -32600, "invalid_request")                                                  \
    X(METHOD_NOT_FOUND, -32601, "method_not_found")                                                \
    X(INVALID_PARAMS, -32602, "invalid_params")                                                    \
    X(INTERNAL_ERROR, -32603, "internal_error")                                                    \
    X(NOT_FOUND, -32001, "not_found")                                                              \
    X(PERMISSION_DENIED, -32002, "permission_denied")                                              \
    X(RESOURCE_EXHAUSTED, -32003, "resource_exhausted")                                            \
    X(OVERLOADED, -32004, "overloaded")                                                            \
    X(INVALID_MODEL, -32005, "invalid_model")                                                      \
    X(PAYLOAD_TOO_LARGE, -32006, "payload_too_large")                                              \
    X(SHUTTING_DOWN, -32007, "shutting_down")                                                      \
    X(CONFLICT, -32008, "conflict")                                                                \
    X(IN_USE, -32009, "in_use")

enum {
#define QM__RPC_ENUM(name, value, text) QM_RPC_##name = value,
    QM_RPC_CODE_MAP(QM__RPC_ENUM)
#undef QM__RPC_ENUM
};

/* QM_E* -> the JSON-RPC code a client sees (QM_EINVAL -> -32602, QM_ENOMEM ->
 * -32003, ...; unknown codes -> -32603). */
int qm_rpc_code_from_status(int qm_code);
/* "invalid_params", ...; "internal_error" for unknown codes. Static string. */
const char *qm_rpc_code_name(int rpc_code);

/* ---- JSON writer --------------------------------------------------------- */

#define QM_JW_MAX_DEPTH 64

/* A streaming JSON writer that places commas itself. Output is deterministic:
 * members appear in call order, integers print exactly, f32 values with %.9g
 * (round-trips), f64 with %.17g, non-finite numbers as null. */
typedef struct qm_jw {
    qm_buf *out;
    int depth;
    int after_key;
    uint8_t has_item[QM_JW_MAX_DEPTH];
} qm_jw;

void qm_jw_init(qm_jw *w, qm_buf *out);
void qm_jw_obj_begin(qm_jw *w);
void qm_jw_obj_end(qm_jw *w);
void qm_jw_arr_begin(qm_jw *w);
void qm_jw_arr_end(qm_jw *w);
void qm_jw_key(qm_jw *w, const char *key);
void qm_jw_str(qm_jw *w, const char *s);           /* NULL writes null */
void qm_jw_str_n(qm_jw *w, const char *s, size_t n); /* escapes as JSON requires */
void qm_jw_u64(qm_jw *w, uint64_t v);
void qm_jw_i64(qm_jw *w, int64_t v);
void qm_jw_f64(qm_jw *w, double v);
void qm_jw_f32(qm_jw *w, float v);
void qm_jw_bool(qm_jw *w, int v);
void qm_jw_null(qm_jw *w);
/* An object member: the key, then the value. */
void qm_jw_member_u64(qm_jw *w, const char *key, uint64_t v);
void qm_jw_member_str(qm_jw *w, const char *key, const char *s); /* NULL writes null */
/* Splices a complete JSON value the caller vouches for (a serialised plan). */
void qm_jw_raw(qm_jw *w, const char *json, size_t n);
/* Writes a value as the base64 string of `n` bytes. */
void qm_jw_base64(qm_jw *w, const void *data, size_t n);

/* ---- Tensors --------------------------------------------------------------- */

/* Same numeric values as model/'s qm_dtype F32, F16, BF16. I32 is for
 * integer inputs only (session.infer's topk_ids). */
typedef enum qm_wire_dtype {
    QM_WIRE_F32 = 0,
    QM_WIRE_F16 = 1,
    QM_WIRE_BF16 = 2,
    QM_WIRE_I32 = 3,
} qm_wire_dtype;

#define QM_TENSOR_MAX_DIMS 4

typedef struct qm_tensor {
    qm_wire_dtype dtype;
    uint32_t ndim;
    uint64_t shape[QM_TENSOR_MAX_DIMS];
    uint64_t nbytes;
    void *data; /* owned (qm_malloc), little-endian, row-major; see `mapped` */
    /* A mapped tensor (PROTOCOL.md "Mapped tensors"): {dtype, shape, map,
     * offset} instead of data. The decoder leaves data NULL; the daemon
     * points it into the session's map, borrowed (qm_tensor_free leaves it),
     * or copies it and clears `mapped`. */
    int mapped;
    uint64_t map, offset;
} qm_tensor;

/* Mapped regions start at multiples of this (PROTOCOL.md). */
#define QM_MAP_ALIGN 64

size_t qm_wire_dtype_size(qm_wire_dtype dtype);
const char *qm_wire_dtype_name(qm_wire_dtype dtype); /* "f32", "f16", "bf16", "i32" */
void qm_tensor_free(qm_tensor *t); /* frees data unless mapped, accepts NULL */

/* Standard base64 with padding. decode: strict (length a multiple of 4, no
 * whitespace, '=' only as padding); QM_EINVAL otherwise. Decodes into `out`
 * of capacity `cap`; *n is the decoded length. */
size_t qm_base64_encoded_len(size_t n);
int qm_base64_decode(const char *in, size_t in_len, uint8_t *out, size_t cap, size_t *n);
void qm_base64_encode(const uint8_t *in, size_t n, char *out); /* writes encoded_len bytes */

/* Decodes a tensor object given as JSON text (clients, tests, fuzzing), with
 * the same checks as request params; field paths start at "tensor". */
int qm_tensor_decode_json(const char *json, size_t n, qm_tensor *out, qm_status *st);

/* Writes {"dtype":..,"shape":[..],"data":".."} for `data` of the given shape. */
void qm_jw_tensor(qm_jw *w, qm_wire_dtype dtype, uint32_t ndim, const uint64_t *shape,
                  const void *data);

/* Writes the mapped tensor {"dtype":..,"shape":[..],"map":M,"offset":O}. */
void qm_jw_mapped_tensor(qm_jw *w, qm_wire_dtype dtype, uint32_t ndim, const uint64_t *shape,
                         uint64_t map, uint64_t offset);

/* ---- Framing --------------------------------------------------------------- */

/* Cuts a byte stream at '\n'. Memory is bounded by max_request_bytes plus
 * what one push adds: a line that grows past the limit puts the framer in a
 * sticky overflow state and its bytes are not kept (complete lines before it
 * are still returned by next, then the error). */
typedef struct qm_framer {
    qm_buf in;              /* unconsumed bytes are in.data[start, in.len) */
    size_t start;
    size_t scanned;         /* bytes after start known to hold no '\n' */
    size_t partial;         /* length of the unterminated last line */
    size_t max_frame;
    int overflow;
} qm_framer;

void qm_framer_init(qm_framer *f, size_t max_frame);
void qm_framer_free(qm_framer *f);
/* QM_EPAYLOAD_TOO_LARGE once the framer overflowed; QM_ENOMEM. */
int qm_framer_push(qm_framer *f, const char *data, size_t n);
/* 1 and the next non-blank line (without its '\n'), borrowed until the next
 * push or next; 0 when no complete line is buffered; QM_EPAYLOAD_TOO_LARGE
 * when the next line is over the limit (sticky: the stream is lost). */
int qm_framer_next(qm_framer *f, const char **line, size_t *len);
size_t qm_framer_buffered(const qm_framer *f);

/* Nesting depth of a JSON text, counted over brackets outside strings
 * (before cJSON sees it). Returns the depth, or -1 as soon as it exceeds max. */
int qm_json_depth(const char *s, size_t n, int max);
/* The pre-scan of every request, before cJSON (which is lenient): nesting
 * over max_depth (QM_ERESOURCE_EXHAUSTED), control bytes outside strings
 * other than JSON whitespace, raw control bytes inside strings, numbers not
 * spelled as JSON such as 01, 1., 0x10 (QM_EPARSE), and the escape \u0000,
 * which C strings cannot carry (QM_EINVAL). *why: a static phrase. */
int qm_json_check(const char *s, size_t n, int max_depth, const char **why);

/* ---- Requests ---------------------------------------------------------------- */

/* How a session's budget was given (session.create, session.resize;
 * PROTOCOL.md): bytes, a share of the model's expert bytes, or "auto" (the
 * daemon sizes it from what this machine and its memory cgroup can give;
 * daemon/qm_budget.h). */
typedef enum qm_budget_form {
    QM_BUDGET_NONE,    /* absent: session.create's default, the whole model */
    QM_BUDGET_BYTES,   /* budget_bytes, or budget as a number of bytes */
    QM_BUDGET_PERCENT, /* budget "N%": 0 < N <= 100 */
    QM_BUDGET_AUTO     /* budget "auto" */
} qm_budget_form;

typedef struct qm_budget_spec {
    qm_budget_form form;
    uint64_t bytes; /* QM_BUDGET_BYTES: > 0 */
    double percent; /* QM_BUDGET_PERCENT: in (0, 100] */
} qm_budget_spec;

/* A budget's text form: "auto", "N%" (a decimal number, 0 < N <= 100) or a
 * whole number of bytes > 0. 0, or QM_EINVAL with st naming `field` and
 * the rule (QM_BUDGET_RULE). The wire decoder's and qmoectl's one parser
 * (qm_budget_param.c). */
#define QM_BUDGET_RULE "expected bytes, \"N%\" with 0 < N <= 100, or \"auto\""
int qm_budget_parse(const char *text, const char *field, qm_budget_spec *out, qm_status *st);
/* "N%" of `total` bytes: rounded down, at least 1. */
uint64_t qm_budget_percent_of(double percent, uint64_t total);

/* The methods, their params as rows and qm_params: the wire as data. */
#include "qm_wire_schema.h"

typedef enum qm_method {
#define QM__METHOD_ENUM(name, ...) QM_METHOD_##name,
    QM_METHOD_MAP(QM__METHOD_ENUM)
#undef QM__METHOD_ENUM
        QM_METHOD_COUNT
} qm_method;

const char *qm_method_name(qm_method m); /* "session.infer"; "?" out of range */
int qm_method_parse(const char *name, size_t n, qm_method *out); /* 0 or QM_ENOT_FOUND */
const char *qm_method_summary(qm_method m); /* a phrase; "" out of range */

/* One row of a method's params (qm_wire_schema.h says what each type
 * means). Rows are static; walk them to list, document or check what a
 * method takes. */
typedef enum qm_wire_type {
    QM_WT_STRING,
    QM_WT_NAME,
    QM_WT_POLICY,
    QM_WT_FILENAME,
    QM_WT_UINT,
    QM_WT_UINT32,
    QM_WT_BOOL,
    QM_WT_ENUM,
    QM_WT_TENSOR,
    QM_WT_OBJECT,
    QM_WT_HOT,
    QM_WT_BUDGET, /* bytes, "N%" or "auto" (qm_budget_parse) */
    QM_WT_CHECK
} qm_wire_type;

struct cJSON;
typedef struct qm_wire_rows qm_wire_rows;
typedef struct qm_wire_param {
    const char *member; /* "" for a CHECK */
    qm_wire_type type;
    int required;
    uint64_t lo, hi;           /* bytes of a string, an integer's range, a tensor's rank and dtypes */
    size_t lands, has;         /* offsets in qm_params; SIZE_MAX: nowhere */
    const char *const *names;  /* ENUM: its names, NULL-terminated */
    const qm_wire_rows *object; /* OBJECT: its rows */
    /* HOT, BUDGET: decodes the member; CHECK: the rule (v NULL). Private to protocol/. */
    int (*fn)(const struct cJSON *v, qm_params *out, qm_status *st);
    const char *doc;
} qm_wire_param;

struct qm_wire_rows {
    const qm_wire_param *rows;
    size_t n;
    int knobs; /* it also takes every knob some offered policy declares */
};

/* Method m's params (NULL out of range). */
const qm_wire_rows *qm_wire_params(qm_method m);
/* "string of 1 to 64 bytes", "integer 1..18446744073709551615",
 * "\"exact\" or \"fast\"", ...: a row's type in words, into out[cap]. */
const char *qm_wire_type_text(const qm_wire_param *p, char *out, size_t cap);

typedef struct qm_request {
    qm_method method;
    /* The id as JSON text ("7", "\"a\""), owned; NULL for a notification. */
    char *id;
    qm_params params;
} qm_request;

void qm_request_free(qm_request *req); /* releases members, accepts NULL */

/* One element of a decoded frame: a request, or the error to answer with.
 * An error item with id NULL and notification = 0 is answered with id null. */
typedef struct qm_rpc_item {
    int ok;
    qm_request req;      /* when ok */
    int notification;    /* errors of a notification are not answered */
    int rpc_code;        /* when !ok */
    qm_status status;    /* when !ok: reason and field */
} qm_rpc_item;

/* The configured limit a frame broke, so the daemon can count it without
 * reading the error's text. */
typedef enum qm_proto_limit {
    QM_PROTO_LIMIT_NONE,
    QM_PROTO_LIMIT_REQUEST_BYTES, /* max_request_bytes */
    QM_PROTO_LIMIT_NESTING,       /* max_nesting */
    QM_PROTO_LIMIT_BATCH          /* max_batch */
} qm_proto_limit;

typedef struct qm_rpc_frame {
    int is_batch; /* the response is an array (when it has any elements) */
    qm_proto_limit limit; /* set with the one error item that answers it */
    size_t n;
    qm_rpc_item *items; /* owned */
} qm_rpc_frame;

/* Decodes one frame (a line without its '\n'). Always fills `out` with at
 * least one item (a frame that is not JSON is one -32700 item); returns 0,
 * or QM_ENOMEM when nothing could be decoded. Free with qm_rpc_frame_free. */
int qm_rpc_decode(const char *line, size_t len, const qm_proto_limits *lim, qm_rpc_frame *out);
void qm_rpc_frame_free(qm_rpc_frame *frame);

/* ---- Responses ----------------------------------------------------------------- */

/* `{"jsonrpc":"2.0","id":<id>,"result":` - the caller writes one value, then
 * calls qm_rpc_result_end. `id` NULL writes null. */
void qm_rpc_result_begin(qm_jw *w, const char *id);
void qm_rpc_result_end(qm_jw *w);
/* A complete error response: error.code, error.message (the code's name),
 * error.data {reason, field?}. */
void qm_rpc_error(qm_jw *w, const char *id, int rpc_code, const char *reason, const char *field);

/* Copies at most QM_MAX_ECHO_BYTES of s (up to n bytes) into out (>= 80
 * bytes) as printable text, appending "..." when cut: for error messages. */
void qm_clip(const char *s, size_t n, char *out, size_t out_size);

/* ---- Config files ---------------------------------------------------------------- */

typedef enum qm_conf_type { QM_CONF_STRING, QM_CONF_NUMBER, QM_CONF_BOOL } qm_conf_type;

typedef struct qm_conf_entry {
    char *key; /* "max_batch", or "models.NAME" for a member of a nested object */
    qm_conf_type type;
    char *str;
    double num;
    int boolean;
} qm_conf_entry;

/* Parses a JSON object of scalars (one level of nested objects allowed) into
 * entries in file order. A top-level array of strings (model_dirs) is one
 * string entry, its items joined with ':'. The caller frees them with qm_conf_free. */
int qm_conf_parse(const char *text, size_t n, qm_conf_entry **out, size_t *count, qm_status *st);
void qm_conf_free(qm_conf_entry *entries, size_t count);

#endif
