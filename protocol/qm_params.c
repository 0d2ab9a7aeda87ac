/* qm_params.c - strict per-method params validation, and the tensor decoder.
 *
 * Every member is checked for type and range; unknown and duplicate members
 * are errors, so typos surface. The field named in an error is the path
 * inside params ("policy_params.hot[0].experts[2]", "hidden.shape"). */
#include "qm_rpc_impl.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_residency.h" /* the policies' knobs: names, ranges */

#define MAX_SAFE_INT 9007199254740992.0 /* 2^53: beyond it doubles skip integers */

static int bad(qm_status *st, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int bad(qm_status *st, const char *field, const char *fmt, ...)
{
    va_list ap;
    st->code = QM_EINVAL;
    va_start(ap, fmt);
    vsnprintf(st->msg, sizeof st->msg, fmt, ap);
    va_end(ap);
    snprintf(st->field, sizeof st->field, "%s", field);
    return QM_EINVAL;
}

/* "PATH must be WHAT, got TYPE" for a member of the wrong JSON type. */
static int wrong_type(qm_status *st, const char *path, const char *what, const cJSON *v)
{
    return bad(st, path, "%s must be %s, got %s", path, what, qm__json_type_name(v));
}

/* Appends at most `max` bytes of `s` at out[*o], leaving room for the NUL
 * in `size`: snprintf's "%.Ns" by hand, since these paths are built for
 * every member of every request and printed only when one is wrong. */
static void put_clipped(char *out, size_t size, size_t *o, const char *s, size_t max)
{
    size_t n = strnlen(s, max);
    if (n > size - 1 - *o)
        n = size - 1 - *o;
    memcpy(out + *o, s, n);
    *o += n;
    out[*o] = '\0';
}

/* "PREFIX.KEY" (each clipped to 47 bytes) or "KEY" (94), as "%.47s.%.47s" / "%.94s". */
static void join(char *out, size_t size, const char *prefix, const char *key)
{
    /* Paths are bounded: a member name is clipped before it gets here. */
    size_t o = 0;
    out[0] = '\0';
    if (prefix && prefix[0]) {
        put_clipped(out, size, &o, prefix, 47);
        put_clipped(out, size, &o, ".", 1);
        put_clipped(out, size, &o, key, 47);
    } else {
        put_clipped(out, size, &o, key, 94);
    }
}

/* "PATH" followed by `suffix` (".dtype", ...), truncated to `size` as "%s%s" would be. */
static void suffixed(char *out, size_t size, const char *path, const char *suffix)
{
    size_t o = 0;
    out[0] = '\0';
    put_clipped(out, size, &o, path, size);
    put_clipped(out, size, &o, suffix, size);
}

/* Unknown or duplicate members of `obj`. `allowed` ends with NULL. */
static int check_members(const cJSON *obj, const char *const *allowed, const char *prefix,
                         qm_status *st)
{
    char path[96];
    for (const cJSON *m = obj ? obj->child : NULL; m; m = m->next) {
        int known = 0;
        for (const char *const *a = allowed; *a; a++)
            if (strcmp(*a, m->string) == 0)
                known = 1;
        char clip[80];
        if (!known) {
            qm_clip(m->string, strlen(m->string), clip, sizeof clip);
            join(path, sizeof path, prefix, clip);
            char list[256] = "";
            for (const char *const *a = allowed; *a; a++) {
                size_t l = strlen(list);
                snprintf(list + l, sizeof list - l, "%s%s", l ? ", " : "", *a);
            }
            return bad(st, path, "unknown member '%s'; expected %s", clip,
                       list[0] ? list : "no members");
        }
        for (const cJSON *o = obj->child; o != m; o = o->next)
            if (strcmp(o->string, m->string) == 0) {
                qm_clip(m->string, strlen(m->string), clip, sizeof clip);
                join(path, sizeof path, prefix, clip);
                return bad(st, path, "duplicate member '%s'", clip);
            }
    }
    return 0;
}

static const cJSON *member(const cJSON *obj, const char *key)
{
    return obj ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
}

/* Finds member `key` of `obj`, its dotted name in `path`; *v is NULL when it is absent, which
 * is an error ("PATH is required (WHAT)") when it is required. */
static int find_member(const cJSON *obj, const char *key, const char *prefix, int required,
                       const char *what, char path[96], const cJSON **v, qm_status *st)
{
    join(path, 96, prefix, key);
    *v = member(obj, key);
    if (!*v && required)
        return bad(st, path, "%s is required (%s)", path, what);
    return 0;
}

/* String member: required or optional (*out stays NULL when absent). */
static int get_string(const cJSON *obj, const char *key, const char *prefix, int required,
                      size_t max_len, char **out, qm_status *st)
{
    char path[96];
    const cJSON *v;
    int rc = find_member(obj, key, prefix, required, "a string", path, &v, st);
    if (rc < 0 || !v)
        return rc;
    if (!cJSON_IsString(v))
        return wrong_type(st, path, "a string", v);
    size_t n = strlen(v->valuestring);
    if (n == 0)
        return bad(st, path, "%s must not be empty", path);
    if (n > max_len)
        return bad(st, path, "%s is %zu bytes; at most %zu allowed", path, n, max_len);
    if (!qm__utf8_valid(v->valuestring, n))
        return bad(st, path, "%s is not valid UTF-8", path);
    *out = qm_strdup(v->valuestring);
    if (!*out)
        return qm_status_set(st, QM_ENOMEM, "out of memory copying %s", path);
    return 0;
}

static int integer_value(const cJSON *v, const char *path, uint64_t max, uint64_t *out,
                         qm_status *st)
{
    if (!cJSON_IsNumber(v))
        return wrong_type(st, path, "a non-negative integer", v);
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d) || d < 0)
        return bad(st, path, "%s must be a non-negative integer, got %.17g", path, d);
    if (d > MAX_SAFE_INT || d > (double)max)
        return bad(st, path, "%s is %.17g; at most %llu allowed", path, d,
                   (unsigned long long)(max < (uint64_t)MAX_SAFE_INT ? max : (uint64_t)MAX_SAFE_INT));
    *out = (uint64_t)d;
    return 0;
}

static int get_uint(const cJSON *obj, const char *key, const char *prefix, int required,
                    uint64_t max, int *has, uint64_t *out, qm_status *st)
{
    char path[96];
    const cJSON *v;
    int rc = find_member(obj, key, prefix, required, "a non-negative integer", path, &v, st);
    if (rc < 0 || !v)
        return rc;
    if (has)
        *has = 1;
    return integer_value(v, path, max, out, st);
}

static int get_bool(const cJSON *obj, const char *key, const char *prefix, int *has, int *out,
                    qm_status *st)
{
    char path[96];
    const cJSON *v;
    int rc = find_member(obj, key, prefix, 0, "true or false", path, &v, st);
    if (rc < 0 || !v)
        return rc;
    if (!cJSON_IsBool(v))
        return wrong_type(st, path, "true or false", v);
    if (has)
        *has = 1;
    *out = cJSON_IsTrue(v);
    return 0;
}

/* {map, offset} of a mapped tensor or of output_to: the map id (an integer
 * below 2^53) and an offset that is a multiple of QM_MAP_ALIGN. Whether the
 * region lies inside the map is the daemon's check (it knows the map). */
static int parse_region(const cJSON *obj, const char *path, qm_tensor *out, qm_status *st)
{
    char sub[112];
    int rc = get_uint(obj, "map", path, 1, UINT64_MAX, NULL, &out->map, st);
    if (rc == 0)
        rc = get_uint(obj, "offset", path, 1, UINT64_MAX, NULL, &out->offset, st);
    if (rc < 0)
        return rc;
    suffixed(sub, sizeof sub, path, ".offset");
    if (out->offset % QM_MAP_ALIGN != 0)
        return bad(st, sub, "%s is %llu; it must be a multiple of %d", sub,
                   (unsigned long long)out->offset, QM_MAP_ALIGN);
    out->mapped = 1;
    return 0;
}

/* Which wire dtypes a tensor field takes. */
#define QM__DT_FLOAT 1u /* f32, f16, bf16 */
#define QM__DT_I32 2u

static int parse_tensor(const cJSON *t, const char *path, uint32_t expect_ndim, unsigned dtypes,
                        qm_tensor *out, qm_status *st)
{
    static const char *const allowed[] = {"dtype", "shape", "data", NULL};
    static const char *const allowed_mapped[] = {"dtype", "shape", "map", "offset", NULL};
    char sub[112];
    memset(out, 0, sizeof *out);
    if (!cJSON_IsObject(t))
        return bad(st, path,
                   "%s must be a tensor object {dtype, shape, data} or {dtype, shape, map, "
                   "offset}, got %s",
                   path, qm__json_type_name(t));
    /* A mapped tensor names a region of a session.map instead of data. */
    int mapped = member(t, "map") != NULL || (member(t, "offset") != NULL && !member(t, "data"));
    int rc = check_members(t, mapped ? allowed_mapped : allowed, path, st);
    if (rc < 0)
        return rc;
    const cJSON *dtype = member(t, "dtype"), *shape = member(t, "shape"),
                *data = member(t, "data");
    suffixed(sub, sizeof sub, path, ".dtype");
    const char *allowed_s = dtypes == QM__DT_I32     ? "i32"
                            : dtypes == QM__DT_FLOAT ? "f32, f16, bf16"
                                                     : "f32, f16, bf16, i32";
    if (!dtype || !cJSON_IsString(dtype)) {
        if (dtypes == QM__DT_I32)
            return bad(st, sub, "%s must be \"i32\"", sub);
        return bad(st, sub, "%s must be \"f32\", \"f16\" or \"bf16\"", sub);
    }
    if ((dtypes & QM__DT_FLOAT) && strcmp(dtype->valuestring, "f32") == 0)
        out->dtype = QM_WIRE_F32;
    else if ((dtypes & QM__DT_FLOAT) && strcmp(dtype->valuestring, "f16") == 0)
        out->dtype = QM_WIRE_F16;
    else if ((dtypes & QM__DT_FLOAT) && strcmp(dtype->valuestring, "bf16") == 0)
        out->dtype = QM_WIRE_BF16;
    else if ((dtypes & QM__DT_I32) && strcmp(dtype->valuestring, "i32") == 0)
        out->dtype = QM_WIRE_I32;
    else {
        char clip[80];
        qm_clip(dtype->valuestring, strlen(dtype->valuestring), clip, sizeof clip);
        return bad(st, sub, "%s '%s' is not one of %s", sub, clip, allowed_s);
    }
    suffixed(sub, sizeof sub, path, ".shape");
    if (!shape || !cJSON_IsArray(shape))
        return bad(st, sub, "%s must be an array of 1 to %d dimensions", sub, QM_TENSOR_MAX_DIMS);
    int ndim = cJSON_GetArraySize(shape);
    if (ndim < 1 || ndim > QM_TENSOR_MAX_DIMS)
        return bad(st, sub, "%s has %d dimensions; expected 1 to %d", sub, ndim,
                   QM_TENSOR_MAX_DIMS);
    unsigned long long count = 1;
    int i = 0;
    for (const cJSON *d = shape->child; d; d = d->next, i++) {
        /* A valid dimension takes the short way; a bad one is named. */
        double dv = cJSON_IsNumber(d) ? d->valuedouble : -1;
        if (isfinite(dv) && dv >= 0 && dv == floor(dv) && dv <= MAX_SAFE_INT) {
            out->shape[i] = (uint64_t)dv;
        } else {
            char dim[136];
            snprintf(dim, sizeof dim, "%s[%d]", sub, i);
            rc = integer_value(d, dim, UINT64_MAX, &out->shape[i], st);
            if (rc < 0)
                return rc;
        }
        if (qm_mul_u64(count, out->shape[i], &count) < 0)
            return bad(st, sub, "%s: element count overflows 64 bits", sub);
    }
    out->ndim = (uint32_t)ndim;
    if (expect_ndim && out->ndim != expect_ndim)
        return bad(st, sub, "%s has %u dimensions; expected %u", sub, out->ndim, expect_ndim);
    unsigned long long nbytes;
    if (qm_mul_u64(count, qm_wire_dtype_size(out->dtype), &nbytes) < 0)
        return bad(st, sub, "%s: byte size overflows 64 bits", sub);
    if (mapped) {
        out->nbytes = nbytes;
        return parse_region(t, path, out, st);
    }
    suffixed(sub, sizeof sub, path, ".data");
    if (!data || !cJSON_IsString(data))
        return bad(st, sub, "%s must be a base64 string", sub);
    size_t enc_len = strlen(data->valuestring);
    /* Compare lengths before decoding: a shape that disagrees costs nothing. */
    size_t decoded_len = 0;
    if (enc_len % 4 == 0 && enc_len > 0) {
        decoded_len = enc_len / 4 * 3;
        if (data->valuestring[enc_len - 1] == '=')
            decoded_len--;
        if (data->valuestring[enc_len - 2] == '=')
            decoded_len--;
    }
    if (enc_len % 4 != 0)
        return bad(st, sub, "%s is not padded base64 (length %zu is not a multiple of 4)", sub,
                   enc_len);
    if (decoded_len != nbytes)
        return bad(st, sub, "%s holds %zu bytes but shape x %s needs %llu", sub, decoded_len,
                   qm_wire_dtype_name(out->dtype), nbytes);
    out->data = qm_malloc(nbytes ? (size_t)nbytes : 1);
    if (!out->data)
        return qm_status_set(st, QM_ENOMEM, "out of memory for %llu bytes of %s", nbytes, path);
    size_t got;
    if (qm_base64_decode(data->valuestring, enc_len, out->data, (size_t)nbytes, &got) < 0 ||
        got != nbytes) {
        qm_tensor_free(out);
        return bad(st, sub, "%s is not valid base64", sub);
    }
    out->nbytes = nbytes;
    return 0;
}

static int get_tensor(const cJSON *obj, const char *key, int required, uint32_t ndim,
                      unsigned dtypes, int *has, qm_tensor *out, qm_status *st)
{
    const cJSON *v = member(obj, key);
    if (!v) {
        if (required)
            return bad(st, key, "%s is required (a tensor {dtype, shape, data|map, offset})", key);
        return 0;
    }
    int rc = parse_tensor(v, key, ndim, dtypes, out, st);
    if (rc < 0)
        return rc;
    if (has)
        *has = 1;
    return 0;
}

int qm_tensor_decode_json(const char *json, size_t n, qm_tensor *out, qm_status *st)
{
    memset(out, 0, sizeof *out);
    cJSON *root = cJSON_ParseWithLength(json, n);
    if (!root)
        return qm_status_set(st, QM_EPARSE, "tensor is not a JSON text");
    qm_status local;
    qm_status_clear(&local);
    int rc = parse_tensor(root, "tensor", 0, QM__DT_FLOAT | QM__DT_I32, out, &local);
    cJSON_Delete(root);
    if (st)
        *st = local;
    return rc;
}

static int model_name_ok(const char *s)
{
    for (const char *p = s; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '.' || *p == '_' || *p == '-'))
            return 0;
    return 1;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Index of the first element that repeats an earlier one (n when none), in
 * O(n log n): hot lists can be long, and this runs on the loop thread.
 * Elements are uint32_t at `offset` within records of `stride` bytes. */
static int first_repeat(const void *base, size_t n, size_t stride, size_t offset, size_t *out,
                        qm_status *st)
{
    *out = n;
    if (n < 2)
        return 0;
    uint32_t *sorted = qm_malloc(n * sizeof *sorted);
    if (!sorted)
        return qm_status_set(st, QM_ENOMEM, "out of memory checking policy_params.hot");
    for (size_t i = 0; i < n; i++)
        memcpy(&sorted[i], (const char *)base + i * stride + offset, sizeof(uint32_t));
    qsort(sorted, n, sizeof *sorted, cmp_u32);
    int found = 0;
    uint32_t dup = 0;
    for (size_t i = 1; i < n && !found; i++)
        if (sorted[i] == sorted[i - 1]) {
            found = 1;
            dup = sorted[i];
        }
    qm_free(sorted);
    if (!found)
        return 0;
    /* The second occurrence is the one to name. */
    int seen = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, (const char *)base + i * stride + offset, sizeof v);
        if (v == dup && seen++) {
            *out = i;
            break;
        }
    }
    return 0;
}

static int decode_hot(const cJSON *hot, qm_policy_params_wire *pp, qm_status *st)
{
    static const char *const allowed[] = {"layer", "experts", NULL};
    if (!cJSON_IsArray(hot))
        return wrong_type(st, "policy_params.hot", "an array", hot);
    size_t n = (size_t)cJSON_GetArraySize(hot);
    if (n == 0)
        return 0;
    if (n > QM_HOT_MAX)
        return bad(st, "policy_params.hot", "policy_params.hot has %zu entries; at most %d",
                   n, QM_HOT_MAX);
    pp->hot = qm_calloc(n, sizeof *pp->hot);
    if (!pp->hot)
        return qm_status_set(st, QM_ENOMEM, "out of memory for policy_params.hot");
    size_t i = 0;
    for (const cJSON *e = hot->child; e; e = e->next, i++) {
        char path[96];
        snprintf(path, sizeof path, "policy_params.hot[%zu]", i);
        if (!cJSON_IsObject(e))
            return bad(st, path, "%s must be an object {layer, experts}", path);
        int rc = check_members(e, allowed, path, st);
        if (rc < 0)
            return rc;
        uint64_t layer = 0;
        rc = get_uint(e, "layer", path, 1, UINT32_MAX, NULL, &layer, st);
        if (rc < 0)
            return rc;
        pp->hot[i].layer = (uint32_t)layer;
        pp->n_hot = i + 1;
        char epath[112];
        snprintf(epath, sizeof epath, "%s.experts", path);
        const cJSON *ex = member(e, "experts");
        if (!ex || !cJSON_IsArray(ex))
            return bad(st, epath, "%s must be an array of expert indices", epath);
        size_t m = (size_t)cJSON_GetArraySize(ex);
        if (m > QM_HOT_MAX)
            return bad(st, epath, "%s has %zu experts; at most %d", epath, m, QM_HOT_MAX);
        pp->hot[i].experts = qm_calloc(m ? m : 1, sizeof(uint32_t));
        if (!pp->hot[i].experts)
            return qm_status_set(st, QM_ENOMEM, "out of memory for %s", epath);
        size_t j = 0;
        for (const cJSON *x = ex->child; x; x = x->next, j++) {
            char xpath[144];
            snprintf(xpath, sizeof xpath, "%s[%zu]", epath, j);
            uint64_t v;
            rc = integer_value(x, xpath, UINT32_MAX, &v, st);
            if (rc < 0)
                return rc;
            pp->hot[i].experts[j] = (uint32_t)v;
            pp->hot[i].n_experts = j + 1;
        }
        int rc2 = first_repeat(pp->hot[i].experts, pp->hot[i].n_experts, sizeof(uint32_t), 0,
                               &j, st);
        if (rc2 < 0)
            return rc2;
        if (j < pp->hot[i].n_experts) {
            char xpath[144];
            snprintf(xpath, sizeof xpath, "%s[%zu]", epath, j);
            return bad(st, xpath, "%s repeats expert %u", xpath, pp->hot[i].experts[j]);
        }
    }
    /* Layers: the same check over the entries. */
    size_t j;
    int rc2 = first_repeat(pp->hot, pp->n_hot, sizeof *pp->hot, offsetof(qm_hot_layer, layer), &j,
                           st);
    if (rc2 < 0)
        return rc2;
    if (j < pp->n_hot) {
        char path[96];
        snprintf(path, sizeof path, "policy_params.hot[%zu]", j);
        return bad(st, path, "%s repeats layer %u", path, pp->hot[j].layer);
    }
    return 0;
}

/* A policy knob (decay, pin_fraction, ...): the residency registry says
 * which names exist and their ranges. */
static int get_policy_value(const cJSON *v, const qm_policy_param_spec *spec,
                            qm_policy_params_wire *pp, qm_status *st)
{
    char path[96];
    double min, max;
    int integer;
    const char *name = qm_policy_param_name(spec);
    qm_policy_param_range(spec, &min, &max, NULL, &integer);
    join(path, sizeof path, "policy_params", name);
    if (!cJSON_IsNumber(v))
        return bad(st, path, "%s must be a number in %g..%g, got %s", path, min, max,
                   qm__json_type_name(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d < min || d > max || (integer && d != floor(d)))
        return bad(st, path, "%s must be a %s in %g..%g, got %.17g", path,
                   integer ? "whole number" : "number", min, max, d);
    if (pp->n_values == QM_POLICY_VALUES_MAX)
        return bad(st, path, "policy_params has more than %d policy knobs", QM_POLICY_VALUES_MAX);
    pp->values[pp->n_values].name = name;
    pp->values[pp->n_values].value = d;
    pp->n_values++;
    return 0;
}

/* "prefetch, min_split_bytes, ..., decay, pin_fraction, ...": what
 * policy_params may hold, the session's own members then the knobs. */
static void policy_params_members(const char *const *allowed, char *list, size_t cap)
{
    size_t len = 0;
    list[0] = '\0';
    for (const char *const *a = allowed; *a && len < cap; a++)
        len += (size_t)snprintf(list + len, cap - len, "%s%s", len ? ", " : "", *a);
    for (size_t i = 0; i < qm_policy_count(); i++)
        for (size_t j = 0; j < qm_policy_param_count(i) && len < cap; j++) {
            const qm_policy_param_spec *spec = qm_policy_param_at(i, j);
            const char *n = qm_policy_param_name(spec);
            if (qm_policy_param_find(n, strlen(n)) == spec) /* its first declaration */
                len += (size_t)snprintf(list + len, cap - len, ", %s", n);
        }
}

/* policy_params.on_miss: one of the hybrid execution's answers to a miss. */
static int get_on_miss(const cJSON *obj, qm_policy_params_wire *pp, qm_status *st)
{
    static const char *const names[] = {"page", "host", "auto"};
    const cJSON *v = member(obj, "on_miss");
    if (!v)
        return 0;
    for (size_t i = 0; cJSON_IsString(v) && i < sizeof names / sizeof names[0]; i++)
        if (strcmp(v->valuestring, names[i]) == 0) {
            pp->on_miss = names[i];
            return 0;
        }
    char clip[40] = "";
    if (cJSON_IsString(v))
        qm_clip(v->valuestring, strlen(v->valuestring), clip, sizeof clip);
    return bad(st, "policy_params.on_miss",
               "policy_params.on_miss must be \"page\", \"host\" or \"auto\", got %s%s%s",
               cJSON_IsString(v) ? "'" : "", cJSON_IsString(v) ? clip : qm__json_type_name(v),
               cJSON_IsString(v) ? "'" : "");
}

static int decode_policy_params(const cJSON *obj, qm_policy_params_wire *pp, qm_status *st)
{
    static const char *const allowed[] = {"prefetch", "min_split_bytes", "hot", "record_trace",
                                          "on_miss", "share_residency", NULL};
    const char *prefix = "policy_params";
    if (!cJSON_IsObject(obj))
        return wrong_type(st, prefix, "an object", obj);
    /* Members: the session's own (allowed) and the policies' knobs. */
    int rc = 0;
    for (const cJSON *m = obj->child; m && rc == 0; m = m->next) {
        char clip[80], path[96];
        qm_clip(m->string, strlen(m->string), clip, sizeof clip);
        join(path, sizeof path, prefix, clip);
        for (const cJSON *o = obj->child; o != m; o = o->next)
            if (strcmp(o->string, m->string) == 0)
                return bad(st, path, "duplicate member '%s'", clip);
        const qm_policy_param_spec *spec = qm_policy_param_find(m->string, strlen(m->string));
        if (spec) {
            rc = get_policy_value(m, spec, pp, st);
            continue;
        }
        int known = 0;
        for (const char *const *a = allowed; *a; a++)
            known |= strcmp(*a, m->string) == 0;
        if (!known) {
            char list[512];
            policy_params_members(allowed, list, sizeof list);
            return bad(st, path, "unknown member '%s'; expected %s", clip, list);
        }
    }
    if (rc == 0)
        rc = get_bool(obj, "prefetch", prefix, &pp->has_prefetch, &pp->prefetch, st);
    if (rc == 0)
        rc = get_bool(obj, "share_residency", prefix, &pp->has_share_residency,
                      &pp->share_residency, st);
    if (rc == 0)
        rc = get_uint(obj, "min_split_bytes", prefix, 0, UINT64_MAX, &pp->has_min_split_bytes,
                      &pp->min_split_bytes, st);
    if (rc == 0 && member(obj, "hot"))
        rc = decode_hot(member(obj, "hot"), pp, st);
    if (rc == 0)
        rc = get_on_miss(obj, pp, st);
    if (rc == 0)
        rc = get_string(obj, "record_trace", prefix, 0, 255, &pp->record_trace, st);
    if (rc == 0 && pp->record_trace &&
        (strchr(pp->record_trace, '/') || strcmp(pp->record_trace, ".") == 0 ||
         strcmp(pp->record_trace, "..") == 0))
        return bad(st, "policy_params.record_trace",
                   "policy_params.record_trace must be a file name inside the state dir, "
                   "without '/'");
    return rc;
}

/* session.infer's routing supplied by the engine (PROTOCOL.md): topk_ids and
 * topk_weights, both or neither, never with router_logits. The ids against
 * the model's E are the daemon's check. */
static int decode_topk(const cJSON *params, qm_params *out, qm_status *st)
{
    int has_ids = 0, has_w = 0, rc;
    if ((rc = get_tensor(params, "topk_ids", 0, 2, QM__DT_I32, &has_ids, &out->topk_ids, st)) ||
        (rc = get_tensor(params, "topk_weights", 0, 2, QM__DT_FLOAT, &has_w, &out->topk_weights,
                         st)))
        return rc;
    if (!has_ids && !has_w)
        return 0;
    if (!has_w)
        return bad(st, "topk_weights", "topk_weights is required with topk_ids (both or neither)");
    if (!has_ids)
        return bad(st, "topk_ids", "topk_ids is required with topk_weights (both or neither)");
    if (out->has_router_logits)
        return bad(st, "router_logits",
                   "router_logits must be absent when topk_ids and topk_weights are given");
    out->has_topk = 1;
    const uint64_t *is = out->topk_ids.shape, *ws = out->topk_weights.shape;
    if (is[0] != out->hidden.shape[0])
        return bad(st, "topk_ids.shape", "topk_ids.shape[0] is %llu but hidden has %llu tokens",
                   (unsigned long long)is[0], (unsigned long long)out->hidden.shape[0]);
    if (is[1] == 0)
        return bad(st, "topk_ids.shape", "topk_ids.shape[1] is 0; expected 1 to the model's "
                                         "expert count");
    if (ws[0] != is[0] || ws[1] != is[1])
        return bad(st, "topk_weights.shape",
                   "topk_weights.shape is [%llu, %llu] but topk_ids.shape is [%llu, %llu]",
                   (unsigned long long)ws[0], (unsigned long long)ws[1],
                   (unsigned long long)is[0], (unsigned long long)is[1]);
    return 0;
}

/* session.infer's output_to: {map, offset} (PROTOCOL.md "Shared-memory
 * tensors"). */
static int decode_output_to(const cJSON *v, qm_params *out, qm_status *st)
{
    static const char *const allowed[] = {"map", "offset", NULL};
    if (!cJSON_IsObject(v))
        return wrong_type(st, "output_to", "an object {map, offset}", v);
    int rc = check_members(v, allowed, "output_to", st);
    qm_tensor region;
    memset(&region, 0, sizeof region);
    if (rc == 0)
        rc = parse_region(v, "output_to", &region, st);
    if (rc < 0)
        return rc;
    out->has_output_to = 1;
    out->output_map = region.map;
    out->output_offset = region.offset;
    return 0;
}

/* A method naming a model: only the members `allowed`, then the name in
 * member `key` (required). */
static int named_members(const cJSON *params, const char *const *allowed, const char *key,
                         char **out, qm_status *st)
{
    int rc = check_members(params, allowed, "", st);
    return rc == 0 ? get_string(params, key, "", 1, QM_NAME_MAX, out, st) : rc;
}

/* A session-addressed method: only the members `allowed`, then the session id. */
static int session_members(const cJSON *params, const char *const *allowed, int required,
                           qm_params *out, qm_status *st)
{
    int rc = check_members(params, allowed, "", st);
    return rc == 0 ? get_string(params, "session", "", required, 128, &out->session, st) : rc;
}

/* A byte count that, when given, must be greater than 0. */
static int get_positive(const cJSON *params, const char *key, int required, int *has,
                        uint64_t *out, qm_status *st)
{
    int rc = get_uint(params, key, "", required, UINT64_MAX, has, out, st);
    if (rc == 0 && (!has || *has) && *out == 0)
        return bad(st, key, "%s must be greater than 0", key);
    return rc;
}

int qm__params_decode(qm_method m, const cJSON *params, qm_params *out, qm_status *st)
{
    static const char *const none[] = {NULL};
    static const char *const load[] = {"name", "path", NULL};
    static const char *const unload[] = {"name", "force", NULL};
    static const char *const create[] = {"model",         "policy",    "budget", "budget_bytes",
                                         "policy_params", "precision", NULL};
    static const char *const by_session[] = {"session", NULL};
    static const char *const resize[] = {"session", "budget", "budget_bytes", NULL};
    static const char *const infer[] = {"session",       "layer",    "hidden",
                                        "router_logits", "topk_ids", "topk_weights",
                                        "return_routing", "output_to", NULL};
    static const char *const map[] = {"session", "bytes", NULL};
    static const char *const unmap[] = {"session", "map", NULL};
    static const char *const trace[] = {"session", "limit", NULL};
    int rc = 0;
    uint64_t v = 0;
    switch (m) {
    case QM_METHOD_DAEMON_STATUS:
    case QM_METHOD_DAEMON_SHUTDOWN:
    case QM_METHOD_MODEL_LIST:
    case QM_METHOD_SESSION_LIST:
    case QM_METHOD_TELEMETRY_METRICS:
        return check_members(params, none, "", st);
    case QM_METHOD_MODEL_LOAD:
        rc = named_members(params, load, "name", &out->name, st);
        if (rc == 0 && !model_name_ok(out->name))
            return bad(st, "name", "name may hold only letters, digits, '.', '_' and '-'");
        if (rc == 0)
            rc = get_string(params, "path", "", 1, 4095, &out->path, st);
        return rc;
    case QM_METHOD_MODEL_UNLOAD:
        rc = named_members(params, unload, "name", &out->name, st);
        if (rc == 0)
            rc = get_bool(params, "force", "", NULL, &out->force, st);
        return rc;
    case QM_METHOD_SESSION_CREATE:
        rc = named_members(params, create, "model", &out->model, st);
        if (rc == 0)
            rc = get_string(params, "policy", "", 0, 32, &out->policy, st);
        if (rc == 0)
            rc = qm__params_budget(params, 0, out, st);
        if (rc == 0 && member(params, "policy_params")) {
            out->has_policy_params = 1;
            rc = decode_policy_params(member(params, "policy_params"), &out->policy_params, st);
        }
        if (rc == 0 && member(params, "precision")) {
            const cJSON *pr = member(params, "precision");
            if (!cJSON_IsString(pr) || (strcmp(pr->valuestring, "exact") != 0 &&
                                        strcmp(pr->valuestring, "fast") != 0))
                return bad(st, "precision", "precision must be \"exact\" or \"fast\"");
            out->precision_fast = strcmp(pr->valuestring, "fast") == 0;
        }
        return rc;
    case QM_METHOD_SESSION_CLOSE:
    case QM_METHOD_SESSION_PLAN:
        return session_members(params, by_session, 1, out, st);
    case QM_METHOD_SESSION_RESIZE:
        rc = session_members(params, resize, 1, out, st);
        if (rc == 0)
            rc = qm__params_budget(params, 1, out, st);
        return rc;
    case QM_METHOD_SESSION_INFER:
        rc = session_members(params, infer, 1, out, st);
        if (rc == 0)
            rc = get_uint(params, "layer", "", 1, UINT32_MAX, NULL, &v, st);
        out->layer = (uint32_t)v;
        if (rc == 0)
            rc = get_tensor(params, "hidden", 1, 2, QM__DT_FLOAT, NULL, &out->hidden, st);
        if (rc == 0)
            rc = get_tensor(params, "router_logits", 0, 2, QM__DT_FLOAT, &out->has_router_logits,
                            &out->router_logits, st);
        if (rc == 0)
            rc = decode_topk(params, out, st);
        if (rc == 0 && out->has_router_logits &&
            out->router_logits.shape[0] != out->hidden.shape[0])
            return bad(st, "router_logits.shape",
                       "router_logits.shape[0] is %llu but hidden has %llu tokens",
                       (unsigned long long)out->router_logits.shape[0],
                       (unsigned long long)out->hidden.shape[0]);
        if (rc == 0)
            rc = get_bool(params, "return_routing", "", NULL, &out->return_routing, st);
        if (rc == 0 && member(params, "output_to"))
            rc = decode_output_to(member(params, "output_to"), out, st);
        return rc;
    case QM_METHOD_SESSION_MAP:
        rc = session_members(params, map, 1, out, st);
        if (rc == 0)
            rc = get_positive(params, "bytes", 1, NULL, &out->bytes, st);
        return rc;
    case QM_METHOD_SESSION_UNMAP:
        rc = session_members(params, unmap, 1, out, st);
        if (rc == 0)
            rc = get_uint(params, "map", "", 1, UINT64_MAX, NULL, &out->map, st);
        return rc;
    case QM_METHOD_TELEMETRY_GET:
        return session_members(params, by_session, 0, out, st);
    case QM_METHOD_TELEMETRY_TRACE:
        rc = session_members(params, trace, 0, out, st);
        if (rc == 0)
            rc = get_uint(params, "limit", "", 0, UINT32_MAX, &out->has_limit, &v, st);
        out->limit = (uint32_t)v;
        return rc;
    case QM_METHOD_COUNT:
        break;
    }
    return bad(st, "", "unknown method");
}
