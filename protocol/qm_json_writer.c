/* qm_json_writer.c - the JSON writer and the error codes.
 *
 * Responses are written straight into a buffer rather than built as a cJSON
 * tree: it is deterministic (member order = call order), allocation-light,
 * and keeps the daemon free of cJSON. */
#include "qm_protocol.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"

void qm_proto_limits_default(qm_proto_limits *lim)
{
    lim->max_request_bytes = QM_DEFAULT_MAX_REQUEST_BYTES;
    lim->max_nesting = QM_DEFAULT_MAX_NESTING;
    lim->max_batch = QM_DEFAULT_MAX_BATCH;
}

int qm_rpc_code_from_status(int qm_code)
{
    switch (qm_code) {
#define QM__ERR_RPC(name, value, text, rpc)                                                        \
    case QM_E##name:                                                                               \
        return QM_RPC_##rpc;
        QM_ERRNO_MAP(QM__ERR_RPC)
#undef QM__ERR_RPC
    }
    return QM_RPC_INTERNAL_ERROR;
}

const char *qm_rpc_code_name(int rpc_code)
{
    switch (rpc_code) {
#define QM__RPC_NAME(name, value, text)                                                            \
    case value:                                                                                    \
        return text;
        QM_RPC_CODE_MAP(QM__RPC_NAME)
#undef QM__RPC_NAME
    }
    return "internal_error";
}

/* ---- writer ---- */

/* The writer's appends are a few bytes each: skip the call when they fit. */
static inline void put(qm_buf *b, const char *data, size_t n)
{
    if (n == 0)
        return;
    if (n <= b->cap - b->len && !b->oom) {
        memcpy(b->data + b->len, data, n);
        b->len += n;
    } else {
        qm_buf_append(b, data, n);
    }
}

static inline void putc1(qm_buf *b, char c)
{
    if (b->len < b->cap && !b->oom)
        b->data[b->len++] = c;
    else
        qm_buf_append(b, &c, 1);
}

void qm_jw_init(qm_jw *w, qm_buf *out)
{
    memset(w, 0, sizeof *w);
    w->out = out;
}

/* Separator before a value: a comma unless it is the first in its container
 * or follows a key. */
static void jw_value_prefix(qm_jw *w)
{
    if (w->after_key) {
        w->after_key = 0;
        return;
    }
    if (w->depth > 0) {
        if (w->has_item[w->depth - 1])
            putc1(w->out, ',');
        w->has_item[w->depth - 1] = 1;
    }
}

static void jw_open(qm_jw *w, char c)
{
    jw_value_prefix(w);
    put(w->out, &c, 1);
    if (w->depth < QM_JW_MAX_DEPTH)
        w->has_item[w->depth] = 0;
    w->depth++;
}

static void jw_close(qm_jw *w, char c)
{
    if (w->depth > 0)
        w->depth--;
    put(w->out, &c, 1);
}

void qm_jw_obj_begin(qm_jw *w) { jw_open(w, '{'); }
void qm_jw_obj_end(qm_jw *w) { jw_close(w, '}'); }
void qm_jw_arr_begin(qm_jw *w) { jw_open(w, '['); }
void qm_jw_arr_end(qm_jw *w) { jw_close(w, ']'); }

void qm_jw_key(qm_jw *w, const char *key)
{
    jw_value_prefix(w);
    put(w->out, "\"", 1);
    qm_json_escape(w->out, key, strlen(key));
    put(w->out, "\":", 2);
    w->after_key = 1;
}

void qm_jw_str_n(qm_jw *w, const char *s, size_t n)
{
    jw_value_prefix(w);
    put(w->out, "\"", 1);
    qm_json_escape(w->out, s, n);
    put(w->out, "\"", 1);
}

void qm_jw_str(qm_jw *w, const char *s)
{
    if (!s) {
        qm_jw_null(w);
        return;
    }
    qm_jw_str_n(w, s, strlen(s));
}

void qm_jw_member_str(qm_jw *w, const char *key, const char *s)
{
    qm_jw_key(w, key);
    qm_jw_str(w, s);
}

/* Integers by hand: printf is the writer's hottest path otherwise. */
static void put_u64(qm_buf *b, uint64_t v, int negative)
{
    char tmp[QM_U64_DEC_MAX];
    put(b, tmp, qm_fmt_u64(tmp, v, negative));
}

void qm_jw_u64(qm_jw *w, uint64_t v)
{
    jw_value_prefix(w);
    put_u64(w->out, v, 0);
}

void qm_jw_member_u64(qm_jw *w, const char *key, uint64_t v)
{
    qm_jw_key(w, key);
    qm_jw_u64(w, v);
}

void qm_jw_i64(qm_jw *w, int64_t v)
{
    jw_value_prefix(w);
    put_u64(w->out, v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v, v < 0);
}

void qm_jw_f64(qm_jw *w, double v)
{
    jw_value_prefix(w);
    if (!isfinite(v))
        put(w->out, "null", 4);
    else
        qm_buf_printf(w->out, "%.17g", v);
}

void qm_jw_f32(qm_jw *w, float v)
{
    jw_value_prefix(w);
    if (!isfinite(v))
        put(w->out, "null", 4);
    else
        qm_buf_printf(w->out, "%.9g", (double)v);
}

void qm_jw_bool(qm_jw *w, int v)
{
    jw_value_prefix(w);
    put(w->out, v ? "true" : "false", v ? 4 : 5);
}

void qm_jw_null(qm_jw *w)
{
    jw_value_prefix(w);
    put(w->out, "null", 4);
}

void qm_jw_raw(qm_jw *w, const char *json, size_t n)
{
    jw_value_prefix(w);
    put(w->out, json, n);
}

/* ---- base64 (codec in qm_base64.c) ---- */

void qm_jw_base64(qm_jw *w, const void *data, size_t n)
{
    jw_value_prefix(w);
    size_t enc = qm_base64_encoded_len(n);
    if (qm_buf_reserve(w->out, enc + 2) < 0)
        return;
    char *p = w->out->data + w->out->len;
    p[0] = '"';
    qm_base64_encode(data, n, p + 1);
    p[enc + 1] = '"';
    w->out->len += enc + 2;
}

size_t qm_wire_dtype_size(qm_wire_dtype dtype)
{
    return dtype == QM_WIRE_F32 || dtype == QM_WIRE_I32 ? 4 : 2;
}

const char *qm_wire_dtype_name(qm_wire_dtype dtype)
{
    switch (dtype) {
    case QM_WIRE_F32:
        return "f32";
    case QM_WIRE_F16:
        return "f16";
    case QM_WIRE_BF16:
        return "bf16";
    case QM_WIRE_I32:
        return "i32";
    }
    return "?";
}

void qm_tensor_free(qm_tensor *t)
{
    if (!t)
        return;
    if (!t->mapped)
        qm_free(t->data);
    t->data = NULL;
    t->nbytes = 0;
}

void qm_jw_tensor(qm_jw *w, qm_wire_dtype dtype, uint32_t ndim, const uint64_t *shape,
                  const void *data)
{
    uint64_t count = 1;
    for (uint32_t i = 0; i < ndim; i++)
        count *= shape[i];
    qm_jw_obj_begin(w);
    qm_jw_key(w, "dtype");
    qm_jw_str(w, qm_wire_dtype_name(dtype));
    qm_jw_key(w, "shape");
    qm_jw_arr_begin(w);
    for (uint32_t i = 0; i < ndim; i++)
        qm_jw_u64(w, shape[i]);
    qm_jw_arr_end(w);
    qm_jw_key(w, "data");
    qm_jw_base64(w, data, (size_t)(count * qm_wire_dtype_size(dtype)));
    qm_jw_obj_end(w);
}

void qm_jw_mapped_tensor(qm_jw *w, qm_wire_dtype dtype, uint32_t ndim, const uint64_t *shape,
                         uint64_t map, uint64_t offset)
{
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "dtype", qm_wire_dtype_name(dtype));
    qm_jw_key(w, "shape");
    qm_jw_arr_begin(w);
    for (uint32_t i = 0; i < ndim; i++)
        qm_jw_u64(w, shape[i]);
    qm_jw_arr_end(w);
    qm_jw_member_u64(w, "map", map);
    qm_jw_member_u64(w, "offset", offset);
    qm_jw_obj_end(w);
}

/* ---- responses ---- */

/* {"jsonrpc":"2.0","id":<id>, - the envelope both answers begin with. */
static void rpc_envelope_begin(qm_jw *w, const char *id)
{
    qm_jw_obj_begin(w);
    qm_jw_key(w, "jsonrpc");
    qm_jw_str(w, "2.0");
    qm_jw_key(w, "id");
    if (id)
        qm_jw_raw(w, id, strlen(id));
    else
        qm_jw_null(w);
}

void qm_rpc_result_begin(qm_jw *w, const char *id)
{
    rpc_envelope_begin(w, id);
    qm_jw_key(w, "result");
}

void qm_rpc_result_end(qm_jw *w) { qm_jw_obj_end(w); }

void qm_rpc_error(qm_jw *w, const char *id, int rpc_code, const char *reason, const char *field)
{
    rpc_envelope_begin(w, id);
    qm_jw_key(w, "error");
    qm_jw_obj_begin(w);
    qm_jw_key(w, "code");
    qm_jw_i64(w, rpc_code);
    qm_jw_key(w, "message");
    qm_jw_str(w, qm_rpc_code_name(rpc_code));
    qm_jw_key(w, "data");
    qm_jw_obj_begin(w);
    qm_jw_key(w, "reason");
    qm_jw_str(w, reason && reason[0] ? reason : qm_rpc_code_name(rpc_code));
    if (field && field[0]) {
        qm_jw_key(w, "field");
        qm_jw_str(w, field);
    }
    qm_jw_obj_end(w);
    qm_jw_obj_end(w);
    qm_jw_obj_end(w);
}

void qm_clip(const char *s, size_t n, char *out, size_t out_size)
{
    size_t o = 0, i = 0;
    if (out_size == 0)
        return;
    for (; i < n && i < QM_MAX_ECHO_BYTES && o + 1 < out_size; i++) {
        unsigned char c = (unsigned char)s[i];
        out[o++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    if (i < n && o + 4 < out_size) {
        memcpy(out + o, "...", 3);
        o += 3;
    }
    out[o] = '\0';
}
