/* qm_st_header.c - bounded safetensors header parsing and formatting. */
#include "qm_st_header.h"

#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_bank_internal.h"
#include "qm_json_pick.h"
#include "qm_json.h"

#define ST_FAIL(st, ...) qm_status_set((st), QM_EINVALID_MODEL, __VA_ARGS__)

size_t qm_st_dtype_size(const char *dtype)
{
    static const struct {
        const char *name;
        size_t size;
    } table[] = {
        {"F64", 8},  {"F32", 4},     {"F16", 2},     {"BF16", 2}, {"I64", 8},
        {"I32", 4},  {"I16", 2},     {"I8", 1},      {"U64", 8},  {"U32", 4},
        {"U16", 2},  {"U8", 1},      {"BOOL", 1},    {"F8_E4M3", 1}, {"F8_E5M2", 1},
    };
    if (!dtype)
        return 0;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strcmp(dtype, table[i].name) == 0)
            return table[i].size;
    return 0;
}

int qm__json_prescan(const char *s, size_t len, int max_depth, size_t *at)
{
    int depth = 0, in_string = 0;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (in_string) {
            if (c == '\\') {
                if (len - i >= 6 && s[i + 1] == 'u' && memcmp(s + i + 2, "0000", 4) == 0) {
                    *at = i;
                    return QM__JSON_ESCAPED_NUL;
                }
                i++;
            } else if (c == '"') {
                in_string = 0;
            }
            continue;
        }
        if (c == '"') {
            in_string = 1;
        } else if (c == '{' || c == '[') {
            if (++depth > max_depth) {
                *at = i;
                return QM__JSON_TOO_DEEP;
            }
        } else if (c == '}' || c == ']') {
            depth--;
        }
    }
    return 0;
}

static int check_depth(const char *s, size_t len, qm_status *st)
{
    size_t at = 0;
    int rc = qm__json_prescan(s, len, QM_ST_MAX_DEPTH, &at);
    if (rc == QM__JSON_ESCAPED_NUL)
        return ST_FAIL(st, "safetensors header: escaped NUL in a string at byte %zu", at);
    if (rc == QM__JSON_TOO_DEEP)
        return ST_FAIL(st, "safetensors header: JSON nested deeper than %d levels at byte %zu",
                       QM_ST_MAX_DEPTH, at);
    return 0;
}

static int read_u64(const cJSON *num, uint64_t *out)
{
    if (!cJSON_IsNumber(num))
        return -1;
    double v = num->valuedouble;
    if (!isfinite(v) || v < 0 || v != floor(v) || v > (double)QM_ST_MAX_INTEGER)
        return -1;
    *out = (uint64_t)v;
    return 0;
}

/* Copies a JSON string of at most `max` bytes; -1 when too long. */
static int dup_bounded(const char *s, size_t max, char **out)
{
    size_t n = strnlen(s, max + 1);
    if (n > max)
        return -1;
    char *d = qm_malloc(n + 1);
    if (!d)
        return -2;
    memcpy(d, s, n);
    d[n] = '\0';
    *out = d;
    return 0;
}

static int parse_tensor(const cJSON *item, qm_st_tensor *t, qm_status *st)
{
    const char *name = t->name;
    if (!cJSON_IsObject(item))
        return ST_FAIL(st, "%.80s: header entry is not an object", name);
    static const char *const fields[] = {"dtype", "shape", "data_offsets"};
    const cJSON *slot[3] = {NULL, NULL, NULL}, *f = NULL;
    qm_json_pick_rc pick = qm_json_pick(item, fields, slot, 3, &f);
    if (pick == QM_JSON_PICK_UNKNOWN)
        return ST_FAIL(st,
                       "%.80s: unexpected field \"%.32s\" (allowed: dtype, shape, data_offsets)",
                       name, f->string);
    if (pick == QM_JSON_PICK_TWICE)
        return ST_FAIL(st, "%.80s: field \"%s\" appears twice", name, f->string);
    const cJSON *dtype = slot[0], *shape = slot[1], *offs = slot[2];
    if (!dtype || !cJSON_IsString(dtype))
        return ST_FAIL(st, "%.80s: missing or non-string \"dtype\"", name);
    size_t dl = strnlen(dtype->valuestring, sizeof t->dtype);
    if (dl == 0 || dl >= sizeof t->dtype)
        return ST_FAIL(st, "%.80s: dtype must be a short name like \"F32\"", name);
    memcpy(t->dtype, dtype->valuestring, dl + 1);
    if (!shape || !cJSON_IsArray(shape))
        return ST_FAIL(st, "%.80s: missing or non-array \"shape\"", name);
    int nd = cJSON_GetArraySize(shape);
    if (nd > QM_ST_MAX_NDIM)
        return ST_FAIL(st, "%.80s: shape has %d dimensions, at most %d allowed", name, nd,
                       QM_ST_MAX_NDIM);
    t->ndim = (uint32_t)nd;
    int i = 0;
    for (const cJSON *d = shape->child; d; d = d->next, i++)
        if (read_u64(d, &t->shape[i]) != 0)
            return ST_FAIL(st, "%.80s: shape[%d] is not an integer in [0, 2^53]", name, i);
    if (!offs || !cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2)
        return ST_FAIL(st, "%.80s: \"data_offsets\" must be an array [begin, end]", name);
    if (read_u64(offs->child, &t->begin) != 0 || read_u64(offs->child->next, &t->end) != 0)
        return ST_FAIL(st, "%.80s: data_offsets are not integers in [0, 2^53]", name);
    if (t->begin > t->end)
        return ST_FAIL(st, "%.80s: data_offsets [%llu, %llu] end before they begin", name,
                       (unsigned long long)t->begin, (unsigned long long)t->end);
    return 0;
}

static int parse_metadata(const cJSON *obj, qm_st_header *h, const qm_st_limits *lim,
                          qm_status *st)
{
    if (!cJSON_IsObject(obj))
        return ST_FAIL(st, "__metadata__ is not an object of strings");
    size_t n = (size_t)cJSON_GetArraySize(obj);
    if (n > lim->max_metadata)
        return ST_FAIL(st, "__metadata__ has %zu entries, at most %zu allowed", n,
                       lim->max_metadata);
    h->meta = qm_calloc(n ? n : 1, sizeof *h->meta);
    if (!h->meta)
        return qm_status_set(st, QM_ENOMEM, "out of memory reading __metadata__");
    for (const cJSON *m = obj->child; m; m = m->next) {
        if (!cJSON_IsString(m))
            return ST_FAIL(st, "__metadata__.%.80s: value is not a string", m->string);
        qm_st_meta *e = &h->meta[h->n_meta];
        int rc = dup_bounded(m->string, QM_ST_NAME_MAX, &e->key);
        if (rc == 0) {
            rc = dup_bounded(m->valuestring, QM_ST_VALUE_MAX, &e->value);
            if (rc != 0) {
                qm_free(e->key);
                e->key = NULL;
            }
        }
        if (rc == -2)
            return qm_status_set(st, QM_ENOMEM, "out of memory reading __metadata__");
        if (rc != 0)
            return ST_FAIL(st, "__metadata__.%.80s: key or value too long", m->string);
        h->n_meta++;
    }
    return 0;
}

static int cmp_name(const void *a, const void *b)
{
    const qm_st_tensor *const *x = a, *const *y = b;
    return strcmp((*x)->name, (*y)->name);
}

/* safetensors forbids duplicate names; cJSON keeps both, so check here. */
static int check_duplicates(qm_st_header *h, qm_status *st)
{
    if (h->n_tensors < 2)
        return 0;
    const qm_st_tensor **idx = qm_calloc(h->n_tensors, sizeof *idx);
    if (!idx)
        return qm_status_set(st, QM_ENOMEM, "out of memory checking tensor names");
    for (size_t i = 0; i < h->n_tensors; i++)
        idx[i] = &h->tensors[i];
    qsort(idx, h->n_tensors, sizeof *idx, cmp_name);
    int rc = 0;
    for (size_t i = 1; i < h->n_tensors; i++)
        if (strcmp(idx[i - 1]->name, idx[i]->name) == 0) {
            rc = ST_FAIL(st, "%.80s: tensor name appears twice in the header", idx[i]->name);
            break;
        }
    qm_free(idx);
    return rc;
}

int qm_st_header_parse(const char *json, size_t len, const qm_st_limits *limits,
                       qm_st_header **out, qm_status *st)
{
    static const qm_st_limits defaults = {QM_ST_DEFAULT_MAX_HEADER_BYTES,
                                          QM_ST_DEFAULT_MAX_TENSORS, QM_ST_DEFAULT_MAX_METADATA};
    const qm_st_limits *lim = limits ? limits : &defaults;
    cJSON *root = NULL;
    qm_st_header *h = NULL;
    int rc;

    *out = NULL;
    if (len > lim->max_header_bytes)
        return ST_FAIL(st, "safetensors header is %zu bytes, limit %zu", len, lim->max_header_bytes);
    if (len < 2 || json[0] != '{')
        return ST_FAIL(st, "safetensors header does not start with a JSON object");
    if ((rc = check_depth(json, len, st)) != 0)
        return rc;

    const char *end = NULL;
    root = cJSON_ParseWithLengthOpts(json, len, &end, 0);
    if (!root) {
        size_t at = end && end >= json && end <= json + len ? (size_t)(end - json) : 0;
        return ST_FAIL(st, "safetensors header is not valid JSON (near byte %zu)", at);
    }
    for (const char *p = end; p < json + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            rc = ST_FAIL(st, "safetensors header has bytes after the JSON object (byte %zu)",
                         (size_t)(p - json));
            goto fail_root;
        }
    if (!cJSON_IsObject(root)) {
        rc = ST_FAIL(st, "safetensors header is not a JSON object");
        goto fail_root;
    }

    h = qm_calloc(1, sizeof *h);
    if (!h) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory reading the safetensors header");
        goto fail_root;
    }
    size_t n = (size_t)cJSON_GetArraySize(root);
    if (n > lim->max_tensors + 1) {
        rc = ST_FAIL(st, "safetensors header lists %zu tensors, limit %zu", n, lim->max_tensors);
        goto fail_header;
    }
    h->tensors = qm_calloc(n ? n : 1, sizeof *h->tensors);
    if (!h->tensors) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory reading the safetensors header");
        goto fail_header;
    }
    int seen_meta = 0;
    for (const cJSON *item = root->child; item; item = item->next) {
        if (strcmp(item->string, "__metadata__") == 0) {
            if (seen_meta++) {
                rc = ST_FAIL(st, "__metadata__ appears twice");
                goto fail_header;
            }
            if ((rc = parse_metadata(item, h, lim, st)) != 0)
                goto fail_header;
            continue;
        }
        qm_st_tensor *t = &h->tensors[h->n_tensors];
        int drc = dup_bounded(item->string, QM_ST_NAME_MAX, &t->name);
        if (drc == -2) {
            rc = qm_status_set(st, QM_ENOMEM, "out of memory reading the safetensors header");
            goto fail_header;
        }
        if (drc != 0 || t->name[0] == '\0') {
            if (drc == 0) {
                qm_free(t->name);
                t->name = NULL;
            }
            rc = ST_FAIL(st, "tensor name is empty or longer than %d bytes", QM_ST_NAME_MAX);
            goto fail_header;
        }
        h->n_tensors++;
        if (h->n_tensors > lim->max_tensors) {
            rc = ST_FAIL(st, "safetensors header lists more than %zu tensors", lim->max_tensors);
            goto fail_header;
        }
        if ((rc = parse_tensor(item, t, st)) != 0)
            goto fail_header;
    }
    if ((rc = check_duplicates(h, st)) != 0)
        goto fail_header;
    cJSON_Delete(root);
    *out = h;
    return 0;

fail_header:
    qm_st_header_free(h);
fail_root:
    cJSON_Delete(root);
    return rc;
}

void qm__st_lists_free(qm_st_tensor *tensors, size_t n_tensors, qm_st_meta *meta, size_t n_meta)
{
    for (size_t i = 0; tensors && i < n_tensors; i++)
        qm_free(tensors[i].name);
    for (size_t i = 0; meta && i < n_meta; i++) {
        qm_free(meta[i].key);
        qm_free(meta[i].value);
    }
    qm_free(tensors);
    qm_free(meta);
}

void qm_st_header_free(qm_st_header *h)
{
    if (!h)
        return;
    qm__st_lists_free(h->tensors, h->n_tensors, h->meta, h->n_meta);
    qm_free(h);
}

const char *qm_st_header_meta(const qm_st_header *h, const char *key)
{
    if (!h || !key)
        return NULL;
    for (size_t i = 0; i < h->n_meta; i++)
        if (strcmp(h->meta[i].key, key) == 0)
            return h->meta[i].value;
    return NULL;
}

/* ---- formatting ---------------------------------------------------------- */

typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *q = qm_realloc(b->p, cap);
        if (!q) {
            b->oom = 1;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_put_cb(void *ctx, const char *bytes, size_t n) { sb_put(ctx, bytes, n); }

static void sb_json_string(sbuf *b, const char *s)
{
    sb_put(b, "\"", 1);
    qm_json_escape_to(s, strlen(s), sb_put_cb, b);
    sb_put(b, "\"", 1);
}

int qm_st_header_format(const qm_st_tensor *tensors, size_t n_tensors, const qm_st_meta *meta,
                        size_t n_meta, size_t align, char **json, size_t *len, qm_status *st)
{
    sbuf b = {0};
    char num[64];
    *json = NULL;
    *len = 0;
    sb_str(&b, "{");
    for (size_t i = 0; i < n_tensors; i++) {
        const qm_st_tensor *t = &tensors[i];
        if (i)
            sb_str(&b, ",");
        sb_json_string(&b, t->name);
        sb_str(&b, ":{\"dtype\":");
        sb_json_string(&b, t->dtype);
        sb_str(&b, ",\"shape\":[");
        for (uint32_t d = 0; d < t->ndim && d < QM_ST_MAX_NDIM; d++) {
            snprintf(num, sizeof num, "%s%llu", d ? "," : "", (unsigned long long)t->shape[d]);
            sb_str(&b, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)t->begin,
                 (unsigned long long)t->end);
        sb_str(&b, num);
    }
    if (n_meta) {
        sb_str(&b, n_tensors ? ",\"__metadata__\":{" : "\"__metadata__\":{");
        for (size_t i = 0; i < n_meta; i++) {
            if (i)
                sb_str(&b, ",");
            sb_json_string(&b, meta[i].key);
            sb_str(&b, ":");
            sb_json_string(&b, meta[i].value);
        }
        sb_str(&b, "}");
    }
    sb_str(&b, "}");
    if (align > 1)
        while (!b.oom && (8 + b.len) % align != 0)
            sb_str(&b, " ");
    if (b.oom) {
        qm_free(b.p);
        return qm_status_set(st, QM_ENOMEM, "out of memory formatting a safetensors header");
    }
    *json = b.p;
    *len = b.len;
    return 0;
}
