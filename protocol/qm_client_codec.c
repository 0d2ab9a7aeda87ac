/* qm_client_codec.c - JSON value tree, request printing, response parsing and
 * the tensor codec for clients. The only client file that includes cJSON. */
#include "qm_client_codec.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_protocol.h"

#define QM__CVAL_MAX_DEPTH 64

/* ---------- value tree ---------- */

qm_cval *qm_cval_new(qm_cval_type type)
{
    qm_cval *v = qm_calloc(1, sizeof(*v));
    if (v)
        v->type = type;
    return v;
}

qm_cval *qm_cval_new_number(double x)
{
    qm_cval *v = qm_cval_new(QM_CVAL_NUMBER);
    if (v)
        v->number = x;
    return v;
}

qm_cval *qm_cval_new_bool(int b)
{
    qm_cval *v = qm_cval_new(QM_CVAL_BOOL);
    if (v)
        v->boolean = b ? 1 : 0;
    return v;
}

qm_cval *qm_cval_new_string_owned(char *buf, size_t len)
{
    qm_cval *v = qm_cval_new(QM_CVAL_STRING);
    if (!v) {
        qm_free(buf);
        return NULL;
    }
    v->string = buf;
    v->string_len = len;
    return v;
}

qm_cval *qm_cval_new_string_len(const char *s, size_t len)
{
    if (len == SIZE_MAX)
        return NULL;
    char *copy = qm_malloc(len + 1);
    if (!copy)
        return NULL;
    memcpy(copy, s, len);
    copy[len] = '\0';
    return qm_cval_new_string_owned(copy, len);
}

qm_cval *qm_cval_new_string(const char *s)
{
    return qm_cval_new_string_len(s ? s : "", s ? strlen(s) : 0);
}

void qm_cval_free(qm_cval *v)
{
    if (!v)
        return;
    for (size_t i = 0; i < v->count; i++)
        qm_cval_free(v->items[i]);
    qm_free(v->items);
    qm_free(v->key);
    qm_free(v->string);
    qm_free(v);
}

int qm_cval_append(qm_cval *c, const char *key, qm_cval *item)
{
    if (!c || !item || (c->type != QM_CVAL_ARRAY && c->type != QM_CVAL_OBJECT) ||
        (c->type == QM_CVAL_OBJECT && !key)) {
        qm_cval_free(item);
        return QM_EINVAL;
    }
    if (c->type == QM_CVAL_OBJECT) {
        qm_free(item->key);
        item->key = qm_strdup(key);
        if (!item->key) {
            qm_cval_free(item);
            return QM_ENOMEM;
        }
    }
    if (c->count == c->cap) {
        size_t cap = c->cap ? c->cap * 2 : 4;
        qm_cval **items = qm_realloc(c->items, cap * sizeof(*items));
        if (!items) {
            qm_cval_free(item);
            return QM_ENOMEM;
        }
        c->items = items;
        c->cap = cap;
    }
    c->items[c->count++] = item;
    return 0;
}

const qm_cval *qm_cval_get(const qm_cval *obj, const char *key)
{
    if (!obj || obj->type != QM_CVAL_OBJECT || !key)
        return NULL;
    for (size_t i = 0; i < obj->count; i++)
        if (obj->items[i]->key && strcmp(obj->items[i]->key, key) == 0)
            return obj->items[i];
    return NULL;
}

const qm_cval *qm_cval_at(const qm_cval *arr, size_t index)
{
    if (!arr || (arr->type != QM_CVAL_ARRAY && arr->type != QM_CVAL_OBJECT) ||
        index >= arr->count)
        return NULL;
    return arr->items[index];
}

int qm_cval_get_double(const qm_cval *obj, const char *key, double *out)
{
    const qm_cval *v = qm_cval_get(obj, key);
    if (!v || v->type != QM_CVAL_NUMBER)
        return QM_EINVAL;
    *out = v->number;
    return 0;
}

/* The number at `key` when it is whole and in [lo, hi); QM_EINVAL otherwise. */
static int get_whole(const qm_cval *obj, const char *key, double lo, double hi, double *out)
{
    double d;
    if (qm_cval_get_double(obj, key, &d) < 0 || !(d >= lo) || d >= hi || d != floor(d))
        return QM_EINVAL;
    *out = d;
    return 0;
}

int qm_cval_get_u64(const qm_cval *obj, const char *key, uint64_t *out)
{
    double d;
    /* 2^64 as a double; anything at or above it does not fit. */
    if (get_whole(obj, key, 0.0, 18446744073709551616.0, &d) < 0)
        return QM_EINVAL;
    *out = (uint64_t)d;
    return 0;
}

int qm_cval_get_i64(const qm_cval *obj, const char *key, int64_t *out)
{
    double d;
    if (get_whole(obj, key, -9223372036854775808.0, 9223372036854775808.0, &d) < 0)
        return QM_EINVAL;
    *out = (int64_t)d;
    return 0;
}

const char *qm_cval_get_string(const qm_cval *obj, const char *key)
{
    const qm_cval *v = qm_cval_get(obj, key);
    return v && v->type == QM_CVAL_STRING ? v->string : NULL;
}

/* ---------- parse (through cJSON) ---------- */

static int qm__cval_from_cjson(const cJSON *j, int depth, qm_cval **out, qm_status *st)
{
    qm_cval *v = NULL;
    if (depth > QM__CVAL_MAX_DEPTH)
        return qm_status_set(st, QM_EPARSE, "JSON nests deeper than %d levels",
                             QM__CVAL_MAX_DEPTH);
    if (cJSON_IsNull(j)) {
        v = qm_cval_new(QM_CVAL_NULL);
    } else if (cJSON_IsBool(j)) {
        v = qm_cval_new_bool(cJSON_IsTrue(j));
    } else if (cJSON_IsNumber(j)) {
        v = qm_cval_new_number(j->valuedouble);
    } else if (cJSON_IsString(j)) {
        v = qm_cval_new_string(j->valuestring);
    } else if (cJSON_IsArray(j) || cJSON_IsObject(j)) {
        v = qm_cval_new(cJSON_IsArray(j) ? QM_CVAL_ARRAY : QM_CVAL_OBJECT);
        if (!v)
            goto fail_nomem;
        for (const cJSON *c = j->child; c; c = c->next) {
            qm_cval *item = NULL;
            int rc = qm__cval_from_cjson(c, depth + 1, &item, st);
            if (rc < 0) {
                qm_cval_free(v);
                return rc;
            }
            rc = qm_cval_append(v, v->type == QM_CVAL_OBJECT ? (c->string ? c->string : "")
                                                             : NULL,
                                item);
            if (rc < 0) {
                qm_cval_free(v);
                return qm_status_set(st, rc, "out of memory building the JSON tree");
            }
        }
    } else {
        return qm_status_set(st, QM_EPARSE, "JSON value of unknown type");
    }
    if (!v)
        goto fail_nomem;
    *out = v;
    return 0;
fail_nomem:
    return qm_status_set(st, QM_ENOMEM, "out of memory building the JSON tree");
}

int qm_cval_parse(const char *buf, size_t len, qm_cval **out, qm_status *st)
{
    const char *end = NULL;
    *out = NULL;
    if (!buf)
        return qm_status_set(st, QM_EINVAL, "no JSON text given");
    cJSON *j = cJSON_ParseWithLengthOpts(buf, len, &end, 0);
    if (!j) {
        size_t at = end && end >= buf && end <= buf + len ? (size_t)(end - buf) : 0;
        return qm_status_set(st, QM_EPARSE, "invalid JSON near byte %zu of %zu", at, len);
    }
    /* Only whitespace may follow the value. */
    for (const char *p = end; p && p < buf + len; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\r' && *p != '\n') {
            cJSON_Delete(j);
            return qm_status_set(st, QM_EPARSE, "trailing bytes after the JSON value at byte %zu",
                                 (size_t)(p - buf));
        }
    }
    int rc = qm__cval_from_cjson(j, 0, out, st);
    cJSON_Delete(j);
    return rc;
}

/* ---------- print (our own, to stream large base64 strings without copies) ---------- */

static void qm__sb_str(qm_buf *b, const char *s) { qm_buf_append(b, s, strlen(s)); }

static void qm__sb_json_string(qm_buf *b, const char *s, size_t n)
{
    qm_buf_append(b, "\"", 1);
    qm_json_escape(b, s, n);
    qm_buf_append(b, "\"", 1);
}

/* The printed text, NUL-terminated, to the caller; NULL when out of memory. */
static char *qm__sb_finish(qm_buf *b, size_t *len_out)
{
    qm_buf_append(b, "", 1);
    if (b->oom) {
        qm_buf_free(b);
        return NULL;
    }
    size_t len;
    char *p = qm_buf_take(b, &len);
    if (len_out)
        *len_out = len - 1;
    return p;
}

void qm__client_codec_number(qm_buf *b, double d)
{
    char tmp[40];
    if (!isfinite(d))
        qm__sb_str(b, "null"); /* JSON has no NaN/Inf */
    else if (d == floor(d) && fabs(d) < 9007199254740992.0)
        /* What "%.0f" prints ("-0" for -0.0), without printf. */
        qm_buf_append(b, tmp, qm_fmt_u64(tmp, (unsigned long long)fabs(d), signbit(d) != 0));
    else
        snprintf(tmp, sizeof(tmp), "%.17g", d), qm__sb_str(b, tmp);
}

static void qm__sb_indent(qm_buf *b, int pretty, int depth)
{
    if (!pretty)
        return;
    qm_buf_append(b, "\n", 1);
    for (int i = 0; i < depth; i++)
        qm_buf_append(b, "  ", 2);
}

static void qm__print_value(qm_buf *b, const qm_cval *v, int pretty, int depth)
{
    if (!v) {
        qm__sb_str(b, "null");
        return;
    }
    switch (v->type) {
    case QM_CVAL_NULL: qm__sb_str(b, "null"); break;
    case QM_CVAL_BOOL: qm__sb_str(b, v->boolean ? "true" : "false"); break;
    case QM_CVAL_NUMBER: qm__client_codec_number(b, v->number); break;
    case QM_CVAL_STRING: qm__sb_json_string(b, v->string ? v->string : "", v->string_len); break;
    case QM_CVAL_ARRAY:
    case QM_CVAL_OBJECT: {
        int obj = v->type == QM_CVAL_OBJECT;
        /* Pretty output keeps arrays of scalars (expert lists, shapes) on one line. */
        int inline_items = pretty && !obj;
        for (size_t i = 0; inline_items && i < v->count; i++)
            if (v->items[i]->type == QM_CVAL_ARRAY || v->items[i]->type == QM_CVAL_OBJECT)
                inline_items = 0;
        if (inline_items)
            pretty = 0;
        qm_buf_append(b, obj ? "{" : "[", 1);
        for (size_t i = 0; i < v->count; i++) {
            if (i)
                qm_buf_append(b, inline_items ? ", " : ",", inline_items ? 2 : 1);
            qm__sb_indent(b, pretty, depth + 1);
            if (obj) {
                const char *k = v->items[i]->key ? v->items[i]->key : "";
                qm__sb_json_string(b, k, strlen(k));
                qm_buf_append(b, pretty ? ": " : ":", pretty ? 2 : 1);
            }
            qm__print_value(b, v->items[i], pretty, depth + 1);
        }
        if (v->count)
            qm__sb_indent(b, pretty, depth);
        qm_buf_append(b, obj ? "}" : "]", 1);
        break;
    }
    }
}

char *qm_cval_print(const qm_cval *v, int pretty, size_t *len_out)
{
    qm_buf b;
    qm_buf_init(&b);
    qm__print_value(&b, v, pretty, 0);
    return qm__sb_finish(&b, len_out);
}

void qm__client_codec_string(qm_buf *b, const char *s) { qm__sb_json_string(b, s, strlen(s)); }

/* {"jsonrpc":"2.0","id":ID,"method":M */
static void qm__request_head(qm_buf *b, uint64_t id, const char *method)
{
    char tmp[QM_U64_DEC_MAX];
    qm__sb_str(b, "{\"jsonrpc\":\"2.0\",\"id\":");
    qm_buf_append(b, tmp, qm_fmt_u64(tmp, (unsigned long long)id, 0));
    qm__sb_str(b, ",\"method\":");
    qm__sb_json_string(b, method ? method : "", method ? strlen(method) : 0);
}

char *qm__client_codec_request(uint64_t id, const char *method, const qm_cval *params,
                              size_t *len_out)
{
    qm_buf b;
    qm_buf_init(&b);
    qm__request_head(&b, id, method);
    if (params) {
        qm__sb_str(&b, ",\"params\":");
        qm__print_value(&b, params, 0, 0);
    }
    qm__sb_str(&b, "}\n");
    return qm__sb_finish(&b, len_out);
}

char *qm__client_codec_request_text(uint64_t id, const char *method, const char *params,
                                   size_t params_len, size_t *len_out)
{
    qm_buf b;
    qm_buf_init(&b);
    qm__request_head(&b, id, method);
    qm__sb_str(&b, ",\"params\":");
    qm_buf_append(&b, params, params_len);
    qm__sb_str(&b, "}\n");
    return qm__sb_finish(&b, len_out);
}

/* ---------- response envelopes ---------- */

const char *qm__client_codec_error_name(int code)
{
    switch (code) {
    case -32700: return "parse_error";
    case -32600: return "invalid_request";
    case -32601: return "method_not_found";
    case -32602: return "invalid_params";
    case -32603: return "internal_error";
    case -32001: return "not_found";
    case -32002: return "permission_denied";
    case -32003: return "resource_exhausted";
    case -32004: return "overloaded";
    case -32005: return "invalid_model";
    case -32006: return "payload_too_large";
    case -32007: return "shutting_down";
    case -32008: return "conflict";
    case -32009: return "in_use";
    default: return "error";
    }
}

static void qm__copy(char *dst, size_t cap, const char *src)
{
    snprintf(dst, cap, "%s", src ? src : "");
}

int qm__client_codec_response(const char *buf, size_t len, uint64_t *id_out,
                             qm_cval **result_out, int *is_error,
                             qm__client_codec_error *error, qm_status *st)
{
    qm_cval *root = NULL;
    *result_out = NULL;
    *is_error = 0;
    int rc = qm_cval_parse(buf, len, &root, st);
    if (rc < 0)
        return rc;
    if (root->type != QM_CVAL_OBJECT) {
        rc = qm_status_set(st, QM_EPARSE, "response is not a JSON object");
        goto out;
    }
    const char *ver = qm_cval_get_string(root, "jsonrpc");
    if (!ver || strcmp(ver, "2.0") != 0) {
        rc = qm_status_set(st, QM_EPARSE, "response lacks \"jsonrpc\":\"2.0\"");
        goto out;
    }
    const qm_cval *id = qm_cval_get(root, "id");
    if (id && id->type == QM_CVAL_NULL) {
        *id_out = 0; /* an error about a request the daemon could not read */
    } else if (qm_cval_get_u64(root, "id", id_out) < 0) {
        rc = qm_status_set(st, QM_EPARSE, "response id is missing or not a number");
        goto out;
    }
    const qm_cval *err = qm_cval_get(root, "error");
    if (err) {
        double code = 0;
        if (err->type != QM_CVAL_OBJECT || qm_cval_get_double(err, "code", &code) < 0) {
            rc = qm_status_set(st, QM_EPARSE, "response error lacks a numeric code");
            goto out;
        }
        memset(error, 0, sizeof(*error));
        error->code = (int)code;
        qm__copy(error->message, sizeof(error->message), qm_cval_get_string(err, "message"));
        const qm_cval *data = qm_cval_get(err, "data");
        const char *reason = qm_cval_get_string(data, "reason");
        qm__copy(error->reason, sizeof(error->reason), reason ? reason : error->message);
        qm__copy(error->field, sizeof(error->field), qm_cval_get_string(data, "field"));
        *is_error = 1;
        goto out;
    }
    for (size_t i = 0; i < root->count; i++) {
        if (strcmp(root->items[i]->key, "result") == 0) {
            /* Detach the result so the caller owns it without a copy. */
            *result_out = root->items[i];
            root->items[i] = NULL;
            qm_free((*result_out)->key);
            (*result_out)->key = NULL;
            memmove(root->items + i, root->items + i + 1,
                    (root->count - i - 1) * sizeof(*root->items));
            root->count--;
            goto out;
        }
    }
    rc = qm_status_set(st, QM_EPARSE, "response has neither result nor error");
out:
    qm_cval_free(root);
    return rc;
}

/* ---------- base64 (the shared codec in qm_base64.c) ---------- */

char *qm__client_b64_encode(const void *data, size_t len, size_t *out_len)
{
    if (len / 3 + 1 > (SIZE_MAX - 1) / 4)
        return NULL;
    size_t enc = qm_base64_encoded_len(len);
    char *out = qm_malloc(enc + 1);
    if (!out)
        return NULL;
    qm_base64_encode(data, len, out);
    out[enc] = '\0';
    if (out_len)
        *out_len = enc;
    return out;
}

int qm__client_b64_decode(const char *s, size_t len, void **out, size_t *out_len)
{
    *out = NULL;
    if (len % 4 != 0)
        return QM_EINVAL;
    size_t cap = len / 4 * 3;
    uint8_t *buf = qm_malloc(cap ? cap : 1);
    if (!buf)
        return QM_ENOMEM;
    size_t n = 0;
    int rc = qm_base64_decode(s, len, buf, cap, &n);
    if (rc < 0) {
        qm_free(buf);
        return rc;
    }
    *out = buf;
    *out_len = n;
    return 0;
}

/* ---------- tensors ---------- */

const char *qm_cdtype_name(qm_cdtype dt)
{
    switch (dt) {
    case QM_CDTYPE_F32: return "f32";
    case QM_CDTYPE_F16: return "f16";
    case QM_CDTYPE_BF16: return "bf16";
    case QM_CDTYPE_I32: return "i32";
    }
    return "?";
}

size_t qm_cdtype_size(qm_cdtype dt) { return dt == QM_CDTYPE_F32 || dt == QM_CDTYPE_I32 ? 4 : 2; }

int qm_cdtype_parse(const char *name, qm_cdtype *out)
{
    if (!name)
        return QM_EINVAL;
    if (strcmp(name, "f32") == 0)
        *out = QM_CDTYPE_F32;
    else if (strcmp(name, "f16") == 0)
        *out = QM_CDTYPE_F16;
    else if (strcmp(name, "bf16") == 0)
        *out = QM_CDTYPE_BF16;
    else if (strcmp(name, "i32") == 0)
        *out = QM_CDTYPE_I32;
    else
        return QM_EINVAL;
    return 0;
}

static int qm__tensor_bytes(qm_cdtype dt, const uint64_t *shape, int ndim, uint64_t *out)
{
    unsigned long long n = qm_cdtype_size(dt);
    for (int i = 0; i < ndim; i++)
        if (qm_mul_u64(n, shape[i], &n) < 0)
            return QM_EINVAL;
    *out = n;
    return 0;
}

int qm__client_codec_tensor_encode(qm_cdtype dt, const uint64_t *shape, int ndim,
                                  const void *data, size_t nbytes, qm_cval **out,
                                  qm_status *st)
{
    uint64_t want = 0;
    *out = NULL;
    if (ndim < 1 || ndim > QM_CTENSOR_MAX_DIMS || (size_t)dt > QM_CDTYPE_I32)
        return qm_status_set(st, QM_EINVAL, "a tensor needs 1 to %d dimensions and a known dtype",
                             QM_CTENSOR_MAX_DIMS);
    if (qm__tensor_bytes(dt, shape, ndim, &want) < 0 || want != nbytes)
        return qm_status_set(st, QM_EINVAL,
                             "tensor shape and byte length disagree (%zu bytes given)", nbytes);
    qm_cval *t = qm_cval_new(QM_CVAL_OBJECT), *sh = qm_cval_new(QM_CVAL_ARRAY);
    size_t b64_len = 0;
    char *b64 = qm__client_b64_encode(data, nbytes, &b64_len);
    int rc = QM_ENOMEM;
    if (!t || !sh || !b64) {
        qm_cval_free(sh);
        qm_free(b64);
        goto fail;
    }
    for (int i = 0; i < ndim; i++)
        if ((rc = qm_cval_append(sh, NULL, qm_cval_new_number((double)shape[i]))) < 0) {
            qm_cval_free(sh);
            qm_free(b64);
            goto fail;
        }
    if ((rc = qm_cval_append(t, "dtype", qm_cval_new_string(qm_cdtype_name(dt)))) < 0 ||
        (rc = qm_cval_append(t, "shape", sh)) < 0) {
        qm_free(b64);
        goto fail;
    }
    if ((rc = qm_cval_append(t, "data", qm_cval_new_string_owned(b64, b64_len))) < 0)
        goto fail;
    *out = t;
    return 0;
fail:
    qm_cval_free(t);
    return qm_status_set(st, rc, "out of memory encoding a tensor");
}

int qm__client_codec_tensor_decode(const qm_cval *t, qm_cdtype *dt_out,
                                  uint64_t shape_out[QM_CTENSOR_MAX_DIMS], int *ndim_out,
                                  void **data_out, size_t *nbytes_out, qm_status *st)
{
    *data_out = NULL;
    if (!t || t->type != QM_CVAL_OBJECT)
        return qm_status_set(st, QM_EPARSE, "tensor is not an object");
    if (qm_cdtype_parse(qm_cval_get_string(t, "dtype"), dt_out) < 0)
        return qm_status_set_field(st, QM_EPARSE, "dtype", "tensor dtype is not f32, f16 or bf16");
    const qm_cval *shape = qm_cval_get(t, "shape");
    if (!shape || shape->type != QM_CVAL_ARRAY || shape->count < 1 ||
        shape->count > QM_CTENSOR_MAX_DIMS)
        return qm_status_set_field(st, QM_EPARSE, "shape", "tensor shape is not an array of 1 to %d sizes",
                                   QM_CTENSOR_MAX_DIMS);
    for (size_t i = 0; i < shape->count; i++) {
        const qm_cval *d = shape->items[i];
        if (d->type != QM_CVAL_NUMBER || d->number < 0 || d->number != floor(d->number) ||
            d->number > 9007199254740992.0)
            return qm_status_set_field(st, QM_EPARSE, "shape", "tensor shape holds a non-integer size");
        shape_out[i] = (uint64_t)d->number;
    }
    *ndim_out = (int)shape->count;
    const qm_cval *data = qm_cval_get(t, "data");
    if (!data || data->type != QM_CVAL_STRING)
        return qm_status_set_field(st, QM_EPARSE, "data", "tensor data is not a base64 string");
    uint64_t want = 0;
    if (qm__tensor_bytes(*dt_out, shape_out, *ndim_out, &want) < 0)
        return qm_status_set_field(st, QM_EPARSE, "shape", "tensor shape overflows 64 bits");
    void *buf = NULL;
    size_t n = 0;
    int rc = qm__client_b64_decode(data->string, data->string_len, &buf, &n);
    if (rc == QM_ENOMEM)
        return qm_status_set(st, rc, "out of memory decoding a tensor");
    if (rc < 0)
        return qm_status_set_field(st, QM_EPARSE, "data", "tensor data is not valid base64");
    if (n != want) {
        qm_free(buf);
        return qm_status_set_field(st, QM_EPARSE, "data",
                                   "tensor data holds %zu bytes, its shape needs %llu", n,
                                   (unsigned long long)want);
    }
    *data_out = buf;
    *nbytes_out = n;
    return 0;
}
