/* qm_rpc.c - JSON-RPC 2.0 envelopes and batches -> qm_rpc_frame.
 *
 * Everything a peer sends passes through here before the daemon sees it: the
 * nesting pre-scan runs before cJSON, envelopes are checked member by member,
 * and errors carry a sentence and at most QM_MAX_ECHO_BYTES of the input. */
#include "qm_rpc_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_json_pick.h"

static const char *const method_names[] = {
#define QM__METHOD_NAME(name, text, ...) text,
    QM_METHOD_MAP(QM__METHOD_NAME)
#undef QM__METHOD_NAME
};

/* ", daemon.status, daemon.shutdown, ...": every method, for the error an
 * unknown one gets (read from its third byte). */
static const char method_list[] = {
#define QM__METHOD_LIST_ITEM(name, text, ...) ", " text
    QM_METHOD_MAP(QM__METHOD_LIST_ITEM)
#undef QM__METHOD_LIST_ITEM
};
#define QM__UNKNOWN_METHOD_FMT "unknown method '%s'; expected one of %s"
/* The sentence holds the clipped name (qm_clip: < 80 bytes) and the whole list. */
_Static_assert(sizeof QM__UNKNOWN_METHOD_FMT + 80 + sizeof method_list <= QM_STATUS_MSG_MAX,
               "the method list no longer fits an error sentence: raise QM_STATUS_MSG_MAX");

const char *qm_method_name(qm_method m)
{
    return (unsigned)m < QM_METHOD_COUNT ? method_names[m] : "?";
}

int qm_method_parse(const char *name, size_t n, qm_method *out)
{
    for (int i = 0; i < QM_METHOD_COUNT; i++) {
        if (strlen(method_names[i]) == n && memcmp(method_names[i], name, n) == 0) {
            *out = (qm_method)i;
            return 0;
        }
    }
    return QM_ENOT_FOUND;
}

void qm_request_free(qm_request *req)
{
    if (!req)
        return;
    qm_free(req->id);
    qm__params_free(req->method, &req->params);
    memset(req, 0, sizeof *req);
}

void qm_rpc_frame_free(qm_rpc_frame *frame)
{
    if (!frame)
        return;
    for (size_t i = 0; i < frame->n; i++)
        qm_request_free(&frame->items[i].req);
    qm_free(frame->items);
    frame->items = NULL;
    frame->n = 0;
}

/* Writes the id as JSON text; QM_EINVAL for a type JSON-RPC does not allow. */
static int id_to_text(const cJSON *id, char **out)
{
    qm_buf b;
    qm_buf_init(&b);
    qm_jw w;
    qm_jw_init(&w, &b);
    if (cJSON_IsString(id)) {
        size_t n = strlen(id->valuestring);
        if (n > 256 || !qm__utf8_valid(id->valuestring, n))
            return QM_EINVAL;
        qm_jw_str_n(&w, id->valuestring, n);
    } else if (cJSON_IsNumber(id)) {
        double v = id->valuedouble;
        if (!isfinite(v))
            return QM_EINVAL;
        /* Integers at or past 2^53 may have been rounded by the parse: an
         * id that cannot come back exactly is refused. */
        if (v == floor(v) && fabs(v) >= 9007199254740992.0)
            return QM_EINVAL;
        if (v == floor(v))
            qm_jw_i64(&w, (int64_t)v);
        else
            qm_jw_f64(&w, v);
    } else {
        return QM_EINVAL;
    }
    qm_buf_append(&b, "", 1);
    if (b.oom) {
        qm_buf_free(&b);
        return QM_ENOMEM;
    }
    *out = qm_buf_take(&b, NULL);
    return 0;
}

static void item_error(qm_rpc_item *it, int rpc_code, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void item_error(qm_rpc_item *it, int rpc_code, const char *field, const char *fmt, ...)
{
    va_list ap;
    it->ok = 0;
    it->rpc_code = rpc_code;
    it->status.code = QM_EINVAL;
    va_start(ap, fmt);
    vsnprintf(it->status.msg, sizeof it->status.msg, fmt, ap);
    va_end(ap);
    snprintf(it->status.field, sizeof it->status.field, "%s", field ? field : "");
}

static void decode_item(const cJSON *obj, qm_rpc_item *it)
{
    memset(it, 0, sizeof *it);
    if (!cJSON_IsObject(obj)) {
        item_error(it, QM_RPC_INVALID_REQUEST, NULL,
                   "a request must be a JSON object, got %s", qm__json_type_name(obj));
        return;
    }
    static const char *const members[] = {"id", "jsonrpc", "method", "params"};
    const cJSON *slot[4] = {NULL, NULL, NULL, NULL}, *m = NULL;
    qm_json_pick_rc pick = qm_json_pick(obj, members, slot, 4, &m);
    const cJSON *id = slot[0], *version = slot[1], *method = slot[2], *params = slot[3];
    if (pick == QM_JSON_PICK_UNKNOWN) {
        char clip[80];
        qm_clip(m->string, strlen(m->string), clip, sizeof clip);
        item_error(it, QM_RPC_INVALID_REQUEST, NULL,
                   "unknown member '%s' in request; expected jsonrpc, id, method, params", clip);
        goto answer_with_id;
    }
    if (pick == QM_JSON_PICK_TWICE) {
        item_error(it, QM_RPC_INVALID_REQUEST, NULL, "duplicate member '%s' in request", m->string);
        goto answer_with_id;
    }
    if (id) {
        int rc = id_to_text(id, &it->req.id);
        if (rc == QM_ENOMEM) {
            item_error(it, QM_RPC_INTERNAL_ERROR, NULL, "out of memory decoding the id");
            return;
        }
        if (rc < 0) {
            item_error(it, QM_RPC_INVALID_REQUEST, NULL,
                       "id must be a string of at most 256 bytes or an integer below 2^53 "
                       "in magnitude, got %s",
                       qm__json_type_name(id));
            return;
        }
    }
    if (!version || !cJSON_IsString(version) || strcmp(version->valuestring, "2.0") != 0) {
        item_error(it, QM_RPC_INVALID_REQUEST, NULL, "jsonrpc must be the string \"2.0\"");
        return;
    }
    if (!method || !cJSON_IsString(method)) {
        item_error(it, QM_RPC_INVALID_REQUEST, NULL, "method must be a string, got %s",
                   method ? qm__json_type_name(method) : "nothing");
        return;
    }
    /* A well-formed envelope without id is a notification: from here on its
     * errors are not answered. */
    it->notification = id == NULL;
    const char *name = method->valuestring;
    if (qm_method_parse(name, strlen(name), &it->req.method) < 0) {
        char clip[80];
        qm_clip(name, strlen(name), clip, sizeof clip);
        item_error(it, QM_RPC_METHOD_NOT_FOUND, NULL, QM__UNKNOWN_METHOD_FMT, clip,
                   method_list + 2);
        return;
    }
    if (params && !cJSON_IsObject(params)) {
        item_error(it, QM_RPC_INVALID_PARAMS, "params", "params must be an object, got %s",
                   qm__json_type_name(params));
        return;
    }
    qm_status st;
    qm_status_clear(&st);
    int rc = qm__params_decode(it->req.method, params, &it->req.params, &st);
    if (rc < 0) {
        it->ok = 0;
        it->rpc_code = rc == QM_ENOMEM ? QM_RPC_RESOURCE_EXHAUSTED : QM_RPC_INVALID_PARAMS;
        it->status = st;
        return;
    }
    it->ok = 1;
    return;
answer_with_id:
    /* The envelope is broken, but a usable id still lets the client match. */
    if (id && !it->req.id && id_to_text(id, &it->req.id) < 0)
        it->req.id = NULL;
}

static int single_error(qm_rpc_frame *out, int rpc_code, const char *msg)
{
    out->items = qm_calloc(1, sizeof *out->items);
    if (!out->items)
        return QM_ENOMEM;
    out->n = 1;
    item_error(&out->items[0], rpc_code, NULL, "%s", msg);
    return 0;
}

int qm_rpc_decode(const char *line, size_t len, const qm_proto_limits *lim, qm_rpc_frame *out)
{
    memset(out, 0, sizeof *out);
    char msg[160];
    if (len > lim->max_request_bytes) {
        snprintf(msg, sizeof msg, "request of %zu bytes exceeds max_request_bytes %zu", len,
                 lim->max_request_bytes);
        out->limit = QM_PROTO_LIMIT_REQUEST_BYTES;
        return single_error(out, QM_RPC_PAYLOAD_TOO_LARGE, msg);
    }
    const char *why;
    int pre = qm_json_check(line, len, lim->max_nesting, &why);
    if (pre == QM_ERESOURCE_EXHAUSTED) {
        snprintf(msg, sizeof msg, "JSON nested deeper than max_nesting %d", lim->max_nesting);
        out->limit = QM_PROTO_LIMIT_NESTING;
        return single_error(out, QM_RPC_INVALID_REQUEST, msg);
    }
    if (pre < 0) {
        snprintf(msg, sizeof msg, "%s %s", pre == QM_EPARSE ? "not a JSON text:" : "refused:",
                 why);
        return single_error(out, pre == QM_EPARSE ? QM_RPC_PARSE_ERROR : QM_RPC_INVALID_REQUEST,
                            msg);
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(line, len, &end, 0);
    if (root && end) {
        for (const char *p = end; p < line + len; p++) {
            if (*p != ' ' && *p != '\t' && *p != '\r' && *p != '\n') {
                cJSON_Delete(root);
                root = NULL;
                break;
            }
        }
    }
    if (!root) {
        size_t at = end && end >= line && end <= line + len ? (size_t)(end - line) : 0;
        snprintf(msg, sizeof msg, "not a JSON text (error near byte %zu)", at);
        return single_error(out, QM_RPC_PARSE_ERROR, msg);
    }
    int rc = 0;
    if (cJSON_IsArray(root)) {
        size_t n = (size_t)cJSON_GetArraySize(root);
        if (n == 0) {
            rc = single_error(out, QM_RPC_INVALID_REQUEST, "empty batch");
            goto done;
        }
        if (n > lim->max_batch) {
            snprintf(msg, sizeof msg, "batch of %zu requests exceeds max_batch %zu", n,
                     lim->max_batch);
            out->limit = QM_PROTO_LIMIT_BATCH;
            rc = single_error(out, QM_RPC_INVALID_REQUEST, msg);
            goto done;
        }
        out->items = qm_calloc(n, sizeof *out->items);
        if (!out->items) {
            rc = QM_ENOMEM;
            goto done;
        }
        out->is_batch = 1;
        out->n = n;
        size_t i = 0;
        for (const cJSON *e = root->child; e && i < n; e = e->next, i++)
            decode_item(e, &out->items[i]);
    } else {
        out->items = qm_calloc(1, sizeof *out->items);
        if (!out->items) {
            rc = QM_ENOMEM;
            goto done;
        }
        out->n = 1;
        decode_item(root, &out->items[0]);
    }
done:
    cJSON_Delete(root);
    return rc;
}
