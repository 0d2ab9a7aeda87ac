/* qm_hf_config.c - typed lookups into a checkpoint's config.json and index.json. */
#include "qm_hf_config.h"

#include <cJSON.h>
#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_bank_internal.h"

/* config.json nests a few levels (rope_scaling, quantization_config,
 * text_config/...); deeper is not a checkpoint we understand. */
#define QM_HF_MAX_DEPTH 8
#define QM_HF_MAX_BYTES (64u * 1024u * 1024u)

struct qm_hf_json {
    cJSON *root;
    char what[64];
};

int qm_hf_json_parse(const char *text, size_t n, const char *what, qm_hf_json **out, qm_status *st)
{
    *out = NULL;
    if (n > QM_HF_MAX_BYTES)
        return qm_status_set(st, QM_EPARSE, "%.60s: %zu bytes, more than the %u allowed", what, n,
                             QM_HF_MAX_BYTES);
    size_t at = 0;
    int scan = qm__json_prescan(text, n, QM_HF_MAX_DEPTH, &at);
    if (scan == QM__JSON_TOO_DEEP)
        return qm_status_set(st, QM_EPARSE, "%.60s: JSON nests deeper than %d levels (byte %zu)",
                             what, QM_HF_MAX_DEPTH, at);
    if (scan == QM__JSON_ESCAPED_NUL)
        return qm_status_set(st, QM_EPARSE, "%.60s: escaped NUL in a string at byte %zu", what, at);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, n, &end, 0);
    if (!root || !cJSON_IsObject(root)) {
        size_t at = root || !end ? 0 : (size_t)(end - text);
        cJSON_Delete(root);
        return qm_status_set(st, QM_EPARSE, "%.60s: not a JSON object (error near byte %zu)", what,
                             at);
    }
    qm_hf_json *j = qm_calloc(1, sizeof *j);
    if (!j) {
        cJSON_Delete(root);
        return qm_status_set(st, QM_ENOMEM, "out of memory reading %.60s", what);
    }
    j->root = root;
    snprintf(j->what, sizeof j->what, "%s", what);
    *out = j;
    return 0;
}

void qm_hf_json_free(qm_hf_json *j)
{
    if (!j) return;
    cJSON_Delete(j->root);
    qm_free(j);
}

/* Walks "a/b/c"; NULL when a step is missing or not an object. */
static const cJSON *lookup(const qm_hf_json *j, const char *key)
{
    const cJSON *node = j->root;
    const char *p = key;
    char part[256];
    while (node && *p) {
        const char *slash = strchr(p, '/');
        size_t len = slash ? (size_t)(slash - p) : strlen(p);
        if (len >= sizeof part || !cJSON_IsObject(node)) return NULL;
        memcpy(part, p, len);
        part[len] = '\0';
        node = cJSON_GetObjectItemCaseSensitive(node, part);
        p += len + (slash ? 1 : 0);
    }
    return node && !cJSON_IsNull(node) ? node : NULL;
}

static int wrong_type(const qm_hf_json *j, const char *key, const char *want, qm_status *st)
{
    return qm_status_set_field(st, QM_EINVAL, "", "%.60s: key \"%.100s\" must be %s", j->what, key,
                               want);
}

typedef cJSON_bool (*json_is_fn)(const cJSON *const item);

/* The value at `key` when `is` accepts it; otherwise NULL with *rc set:
 * QM_ENOT_FOUND when absent, the wrong-type error (naming `want`) else. */
static const cJSON *typed(const qm_hf_json *j, const char *key, json_is_fn is, const char *want,
                          int *rc, qm_status *st)
{
    const cJSON *v = lookup(j, key);
    *rc = !v ? QM_ENOT_FOUND : !is(v) ? wrong_type(j, key, want, st) : 0;
    return *rc ? NULL : v;
}

/* NAME(j, key, out, st): the value at key when IS accepts it, as VALUE(v)
 * of type T in *out; the getters differ only in those. */
#define QM__HF_GETTER(NAME, T, IS, WANT, VALUE)                                                    \
    int NAME(const qm_hf_json *j, const char *key, T *out, qm_status *st)                          \
    {                                                                                              \
        int rc;                                                                                    \
        const cJSON *v = typed(j, key, IS, WANT, &rc, st);                                         \
        if (v) *out = VALUE(v);                                                                    \
        return rc;                                                                                 \
    }
#define QM__HF_NUMBER(v) ((v)->valuedouble)
#define QM__HF_STRING(v) ((v)->valuestring)
#define QM__HF_ARRAY_LEN(v) ((size_t)cJSON_GetArraySize(v))
QM__HF_GETTER(qm_hf_json_number, double, cJSON_IsNumber, "a number", QM__HF_NUMBER)
QM__HF_GETTER(qm_hf_json_bool, int, cJSON_IsBool, "true or false", cJSON_IsTrue)
QM__HF_GETTER(qm_hf_json_string, const char *, cJSON_IsString, "a string", QM__HF_STRING)
QM__HF_GETTER(qm_hf_json_array_len, size_t, cJSON_IsArray, "an array", QM__HF_ARRAY_LEN)

static const cJSON *array_item(const qm_hf_json *j, const char *key, size_t i, qm_status *st,
                               int *rc)
{
    size_t len = 0;
    *rc = qm_hf_json_array_len(j, key, &len, st);
    if (*rc != 0) return NULL;
    if (i >= len) {
        *rc = QM_ENOT_FOUND;
        return NULL;
    }
    return cJSON_GetArrayItem(lookup(j, key), (int)i);
}

/* NAME(j, key, i, out, st): item i of the array at key when IS accepts
 * it, as VALUE(v) of type T in *out. */
#define QM__HF_ITEM_GETTER(NAME, T, IS, WANT, VALUE)                                               \
    int NAME(const qm_hf_json *j, const char *key, size_t i, T *out, qm_status *st)                \
    {                                                                                              \
        int rc;                                                                                    \
        const cJSON *v = array_item(j, key, i, st, &rc);                                           \
        if (!v) return rc;                                                                         \
        if (!IS(v)) return wrong_type(j, key, WANT, st);                                           \
        *out = VALUE(v);                                                                           \
        return 0;                                                                                  \
    }
QM__HF_ITEM_GETTER(qm_hf_json_array_number, double, cJSON_IsNumber, "an array of numbers",
                   QM__HF_NUMBER)
QM__HF_ITEM_GETTER(qm_hf_json_array_string, const char *, cJSON_IsString, "an array of strings",
                   QM__HF_STRING)

int qm_hf_json_numbers(const qm_hf_json *j, const char *key, double **out, size_t *n, qm_status *st)
{
    *out = NULL;
    *n = 0;
    int rc;
    const cJSON *arr = typed(j, key, cJSON_IsArray, "an array", &rc, st);
    if (!arr) return rc;
    size_t count = 0;
    for (const cJSON *m = arr->child; m; m = m->next)
        count++;
    if (!count) return 0;
    double *v = qm_calloc(count, sizeof *v);
    if (!v) return qm_status_set(st, QM_ENOMEM, "out of memory reading %.60s", j->what);
    size_t i = 0;
    for (const cJSON *m = arr->child; m; m = m->next, i++) {
        if (!cJSON_IsNumber(m)) {
            qm_free(v);
            return wrong_type(j, key, "an array of numbers", st);
        }
        v[i] = m->valuedouble;
    }
    *out = v;
    *n = count;
    return 0;
}

int qm_hf_json_string_map(const qm_hf_json *j, const char *key, const char ***names,
                          const char ***values, size_t *n, qm_status *st)
{
    *names = NULL;
    *values = NULL;
    *n = 0;
    const cJSON *obj = lookup(j, key);
    if (!obj) return QM_ENOT_FOUND;
    if (!cJSON_IsObject(obj)) return wrong_type(j, key, "an object", st);
    size_t count = (size_t)cJSON_GetArraySize(obj);
    const char **nm = qm_calloc(count ? count : 1, sizeof *nm);
    const char **vs = qm_calloc(count ? count : 1, sizeof *vs);
    if (!nm || !vs) {
        qm_free(nm);
        qm_free(vs);
        return qm_status_set(st, QM_ENOMEM, "out of memory reading %.60s", j->what);
    }
    size_t i = 0;
    for (const cJSON *m = obj->child; m; m = m->next, i++) {
        if (!cJSON_IsString(m)) {
            qm_free(nm);
            qm_free(vs);
            return qm_status_set(st, QM_EINVAL, "%.60s: %.40s member \"%.120s\" must be a string",
                                 j->what, key, m->string);
        }
        nm[i] = m->string;
        vs[i] = m->valuestring;
    }
    *names = nm;
    *values = vs;
    *n = i;
    return 0;
}
