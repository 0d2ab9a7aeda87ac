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

const char *qm__json_type_name(const cJSON *v)
{
    static const struct {
        cJSON_bool (*is)(const cJSON *const item);
        const char *name;
    } kinds[] = {{cJSON_IsString, "a string"}, {cJSON_IsNumber, "a number"},
                 {cJSON_IsBool, "a boolean"},  {cJSON_IsNull, "null"},
                 {cJSON_IsArray, "an array"},  {cJSON_IsObject, "an object"}};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (kinds[i].is(v)) return kinds[i].name;
    return "invalid";
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

/* Unknown or duplicate members of an object with a fixed list of members
 * (a tensor). `allowed` ends with NULL. */
static int check_allowed(const cJSON *obj, const char *const *allowed, const char *prefix,
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

/* {map, offset} of a mapped tensor or of output_to: the map id (an integer
 * below 2^53) and an offset that is a multiple of QM_MAP_ALIGN. Whether the
 * region lies inside the map is the daemon's check (it knows the map). */
int qm__map_offset_check(const char *path, uint64_t offset, qm_status *st)
{
    char sub[112];
    suffixed(sub, sizeof sub, path, ".offset");
    if (offset % QM_MAP_ALIGN != 0)
        return bad(st, sub, "%s is %llu; it must be a multiple of %d", sub,
                   (unsigned long long)offset, QM_MAP_ALIGN);
    return 0;
}

static int parse_region(const cJSON *obj, const char *path, qm_tensor *out, qm_status *st)
{
    int rc = get_uint(obj, "map", path, 1, UINT64_MAX, NULL, &out->map, st);
    if (rc == 0)
        rc = get_uint(obj, "offset", path, 1, UINT64_MAX, NULL, &out->offset, st);
    if (rc == 0)
        rc = qm__map_offset_check(path, out->offset, st);
    if (rc < 0)
        return rc;
    out->mapped = 1;
    return 0;
}


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
    int rc = check_allowed(t, mapped ? allowed_mapped : allowed, path, st);
    if (rc < 0)
        return rc;
    const cJSON *dtype = member(t, "dtype"), *shape = member(t, "shape"),
                *data = member(t, "data");
    suffixed(sub, sizeof sub, path, ".dtype");
    const char *allowed_s = dtypes == QM_WIRE_DT_I32     ? "i32"
                            : dtypes == QM_WIRE_DT_FLOAT ? "f32, f16, bf16"
                                                     : "f32, f16, bf16, i32";
    if (!dtype || !cJSON_IsString(dtype)) {
        if (dtypes == QM_WIRE_DT_I32)
            return bad(st, sub, "%s must be \"i32\"", sub);
        return bad(st, sub, "%s must be \"f32\", \"f16\" or \"bf16\"", sub);
    }
    if ((dtypes & QM_WIRE_DT_FLOAT) && strcmp(dtype->valuestring, "f32") == 0)
        out->dtype = QM_WIRE_F32;
    else if ((dtypes & QM_WIRE_DT_FLOAT) && strcmp(dtype->valuestring, "f16") == 0)
        out->dtype = QM_WIRE_F16;
    else if ((dtypes & QM_WIRE_DT_FLOAT) && strcmp(dtype->valuestring, "bf16") == 0)
        out->dtype = QM_WIRE_BF16;
    else if ((dtypes & QM_WIRE_DT_I32) && strcmp(dtype->valuestring, "i32") == 0)
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

int qm_tensor_decode_json(const char *json, size_t n, qm_tensor *out, qm_status *st)
{
    memset(out, 0, sizeof *out);
    cJSON *root = cJSON_ParseWithLength(json, n);
    if (!root)
        return qm_status_set(st, QM_EPARSE, "tensor is not a JSON text");
    qm_status local;
    qm_status_clear(&local);
    int rc = parse_tensor(root, "tensor", 0, QM_WIRE_DT_FLOAT | QM_WIRE_DT_I32, out, &local);
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

/* A list of {layer, experts} at `name` (policy_params.hot, session.create's
 * warm): layers distinct, experts distinct in each; ranges are the daemon's
 * check (it knows the model). */
static int decode_expert_lists(const cJSON *hot, const char *name, qm_hot_layer **list,
                               size_t *count, qm_status *st)
{
    static const char *const allowed[] = {"layer", "experts", NULL};
    if (!cJSON_IsArray(hot))
        return wrong_type(st, name, "an array", hot);
    size_t n = (size_t)cJSON_GetArraySize(hot);
    if (n == 0)
        return 0;
    if (n > QM_HOT_MAX)
        return bad(st, name, "%s has %zu entries; at most %d", name, n, QM_HOT_MAX);
    qm_hot_layer *hl = *list = qm_calloc(n, sizeof *hl);
    if (!hl)
        return qm_status_set(st, QM_ENOMEM, "out of memory for %s", name);
    size_t i = 0;
    for (const cJSON *e = hot->child; e; e = e->next, i++) {
        char path[96];
        snprintf(path, sizeof path, "%s[%zu]", name, i);
        if (!cJSON_IsObject(e))
            return bad(st, path, "%s must be an object {layer, experts}", path);
        int rc = check_allowed(e, allowed, path, st);
        if (rc < 0)
            return rc;
        uint64_t layer = 0;
        rc = get_uint(e, "layer", path, 1, UINT32_MAX, NULL, &layer, st);
        if (rc < 0)
            return rc;
        hl[i].layer = (uint32_t)layer;
        *count = i + 1;
        char epath[112];
        snprintf(epath, sizeof epath, "%s.experts", path);
        const cJSON *ex = member(e, "experts");
        if (!ex || !cJSON_IsArray(ex))
            return bad(st, epath, "%s must be an array of expert indices", epath);
        size_t m = (size_t)cJSON_GetArraySize(ex);
        if (m > QM_HOT_MAX)
            return bad(st, epath, "%s has %zu experts; at most %d", epath, m, QM_HOT_MAX);
        hl[i].experts = qm_calloc(m ? m : 1, sizeof(uint32_t));
        if (!hl[i].experts)
            return qm_status_set(st, QM_ENOMEM, "out of memory for %s", epath);
        size_t j = 0;
        for (const cJSON *x = ex->child; x; x = x->next, j++) {
            char xpath[144];
            snprintf(xpath, sizeof xpath, "%s[%zu]", epath, j);
            uint64_t v;
            rc = integer_value(x, xpath, UINT32_MAX, &v, st);
            if (rc < 0)
                return rc;
            hl[i].experts[j] = (uint32_t)v;
            hl[i].n_experts = j + 1;
        }
        int rc2 = first_repeat(hl[i].experts, hl[i].n_experts, sizeof(uint32_t), 0,
                               &j, st);
        if (rc2 < 0)
            return rc2;
        if (j < hl[i].n_experts) {
            char xpath[144];
            snprintf(xpath, sizeof xpath, "%s[%zu]", epath, j);
            return bad(st, xpath, "%s repeats expert %u", xpath, hl[i].experts[j]);
        }
    }
    /* Layers: the same check over the entries. */
    size_t j;
    int rc2 = first_repeat(hl, *count, sizeof *hl, offsetof(qm_hot_layer, layer), &j,
                           st);
    if (rc2 < 0)
        return rc2;
    if (j < *count) {
        char path[96];
        snprintf(path, sizeof path, "%s[%zu]", name, j);
        return bad(st, path, "%s repeats layer %u", path, hl[j].layer);
    }
    return 0;
}

/* ---- what the rows name: policy knobs, the hot list, rules ---- */

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

static int qm__decode_hot(const cJSON *v, qm_params *out, qm_status *st)
{
    return decode_expert_lists(v, "policy_params.hot", &out->policy_params.hot,
                               &out->policy_params.n_hot, st);
}

/* session.create's members for a session re-created after a restart
 * (docs/ENGINES.md "Across a daemon restart"): `warm`, the experts to load
 * before answering, and `session`, the id to take again, as session.create
 * made it. */
static int qm__decode_warm(const cJSON *v, qm_params *out, qm_status *st)
{
    return decode_expert_lists(v, "warm", &out->warm, &out->n_warm, st);
}

static int qm__check_session_id(const cJSON *v, qm_params *out, qm_status *st)
{
    const char *id = out->session;
    if (!id)
        return 0;
    size_t n = strlen(id);
    int ok = n == QM_SESSION_ID_LEN;
    for (size_t i = 0; ok && i < n; i++)
        ok = (id[i] >= '0' && id[i] <= '9') || (id[i] >= 'a' && id[i] <= 'f');
    if (ok)
        return 0;
    char clip[80];
    qm_clip(id, n, clip, sizeof clip);
    return bad(st, "session",
               "session must be a session id as session.create gives one (%d lowercase hex "
               "digits), got '%s'",
               QM_SESSION_ID_LEN, clip);
}

/* client_pending_bytes sizes an auto budget: with any other budget it would
 * say nothing, so it is refused rather than ignored. */
static int qm__check_client_pending(const cJSON *v, qm_params *out, qm_status *st)
{
    (void)v;
    if (!out->has_client_pending_bytes || out->budget.form == QM_BUDGET_AUTO)
        return 0;
    return bad(st, "client_pending_bytes",
               "client_pending_bytes is what an auto budget leaves free for the client; it "
               "needs budget \"auto\"");
}

/* session.infer's routing supplied by the engine (PROTOCOL.md): topk_ids and
 * topk_weights, both or neither. The ids against the model's E are the
 * daemon's check. */
static int qm__check_topk(const cJSON *v, qm_params *out, qm_status *st)
{
    if (!out->has_topk_ids && !out->has_topk_weights)
        return 0;
    if (!out->has_topk_weights)
        return bad(st, "topk_weights", "topk_weights is required with topk_ids (both or neither)");
    if (!out->has_topk_ids)
        return bad(st, "topk_ids", "topk_ids is required with topk_weights (both or neither)");
    out->has_topk = 1;
    return 0;
}

int qm__infer_shapes_check(const qm_params *p, qm_status *st)
{
    if (p->has_topk) {
        if (p->has_router_logits)
            return bad(st, "router_logits",
                       "router_logits must be absent when topk_ids and topk_weights are given");
        const uint64_t *is = p->topk_ids.shape, *ws = p->topk_weights.shape;
        if (is[0] != p->hidden.shape[0])
            return bad(st, "topk_ids.shape",
                       "topk_ids.shape[0] is %llu but hidden has %llu tokens",
                       (unsigned long long)is[0], (unsigned long long)p->hidden.shape[0]);
        if (is[1] == 0)
            return bad(st, "topk_ids.shape", "topk_ids.shape[1] is 0; expected 1 to the model's "
                                             "expert count");
        if (ws[0] != is[0] || ws[1] != is[1])
            return bad(st, "topk_weights.shape",
                       "topk_weights.shape is [%llu, %llu] but topk_ids.shape is [%llu, %llu]",
                       (unsigned long long)ws[0], (unsigned long long)ws[1],
                       (unsigned long long)is[0], (unsigned long long)is[1]);
    }
    if (p->has_router_logits && p->router_logits.shape[0] != p->hidden.shape[0])
        return bad(st, "router_logits.shape",
                   "router_logits.shape[0] is %llu but hidden has %llu tokens",
                   (unsigned long long)p->router_logits.shape[0],
                   (unsigned long long)p->hidden.shape[0]);
    return 0;
}

static int qm__check_shapes(const cJSON *v, qm_params *out, qm_status *st)
{
    return qm__infer_shapes_check(out, st);
}

static int qm__check_output_offset(const cJSON *v, qm_params *out, qm_status *st)
{
    return qm__map_offset_check("output_to", out->output_offset, st);
}

/* ---- the rows (qm_wire_schema.h) ---- */

#define AT(field) offsetof(qm_params, field)
#define NOWHERE SIZE_MAX
#define NONE .fn = NULL
#define FN(f) .fn = f
#define NAMES(e) .names = qm__names_##e
#define ROWS(o) .object = &qm__rows_##o
#define QM__ROW(m, t, r, l, h, at, flag, more, d)                                                  \
    {.member = m, .type = QM_WT_##t, .required = r, .lo = l, .hi = h, .lands = at, .has = flag,    \
     more, .doc = d},
#define QM__END {.member = NULL}
#define QM__N(rows) (sizeof(rows) / sizeof(rows)[0] - 1)
#define QM__KNOBS 1
#define QM__NO_MORE 0

#define QM__ENUM(e, ...) static const char *const qm__names_##e[] = {__VA_ARGS__, NULL};
QM_WIRE_ENUMS(QM__ENUM)

#define QM__OBJECT(o, more)                                                                        \
    static const qm_wire_param qm__rows_##o##_[] = {QM_PARAMS_##o(QM__ROW) QM__END};               \
    static const qm_wire_rows qm__rows_##o = {qm__rows_##o##_, QM__N(qm__rows_##o##_),             \
                                              QM__##more};
QM_WIRE_OBJECTS(QM__OBJECT)

#define QM__METHOD_ROWS(e, name, params, summary)                                                  \
    static const qm_wire_param qm__method_rows_##e[] = {QM_PARAMS_##params(QM__ROW) QM__END};
QM_METHOD_MAP(QM__METHOD_ROWS)

static const qm_wire_rows qm__method_params[QM_METHOD_COUNT] = {
#define QM__METHOD_PARAMS(e, ...) {qm__method_rows_##e, QM__N(qm__method_rows_##e), 0},
    QM_METHOD_MAP(QM__METHOD_PARAMS)};

static const char *const qm__method_summaries[QM_METHOD_COUNT] = {
#define QM__METHOD_SUMMARY(e, name, params, summary) summary,
    QM_METHOD_MAP(QM__METHOD_SUMMARY)};

const qm_wire_rows *qm_wire_params(qm_method m)
{
    return (unsigned)m < QM_METHOD_COUNT ? &qm__method_params[m] : NULL;
}

const char *qm_method_summary(qm_method m)
{
    return (unsigned)m < QM_METHOD_COUNT ? qm__method_summaries[m] : "";
}

/* ---- the walker ---- */

/* "a, b or c" (each quoted when `quote`) into out[cap]. */
static void names_list(const char *const *names, int quote, char *out, size_t cap)
{
    size_t len = 0, n = 0;
    while (names[n])
        n++;
    out[0] = '\0';
    for (size_t i = 0; i < n && len < cap; i++)
        len += (size_t)snprintf(out + len, cap - len, "%s%s%s%s", i == 0 ? "" : i + 1 == n ? " or " : ", ",
                                quote ? "\"" : "", names[i], quote ? "\"" : "");
}

/* "prefetch, min_split_bytes, ...": the members `rows` takes, then the
 * knobs some offered policy declares when it takes them. */
static void members_list(const qm_wire_rows *rows, char *list, size_t cap)
{
    size_t len = 0;
    list[0] = '\0';
    for (size_t i = 0; i < rows->n && len < cap; i++)
        if (rows->rows[i].type != QM_WT_CHECK)
            len += (size_t)snprintf(list + len, cap - len, "%s%s", len ? ", " : "",
                                    rows->rows[i].member);
    for (size_t i = 0; rows->knobs && i < qm_policy_count(); i++)
        for (size_t j = 0; j < qm_policy_param_count(i) && len < cap; j++) {
            const qm_policy_param_spec *spec = qm_policy_param_at(i, j);
            const char *n = qm_policy_param_name(spec);
            if (qm_policy_param_find(n, strlen(n)) == spec) /* its first declaration */
                len += (size_t)snprintf(list + len, cap - len, ", %s", n);
        }
}

static const qm_wire_param *row_named(const qm_wire_rows *rows, const char *member)
{
    for (size_t i = 0; i < rows->n; i++)
        if (rows->rows[i].type != QM_WT_CHECK && strcmp(rows->rows[i].member, member) == 0)
            return &rows->rows[i];
    return NULL;
}

/* Each member of `obj` once, and a row's or (rows->knobs) a policy knob,
 * which is decoded here, in the order given. */
static int check_members(const cJSON *obj, const qm_wire_rows *rows, const char *prefix,
                         qm_params *out, qm_status *st)
{
    for (const cJSON *m = obj ? obj->child : NULL; m; m = m->next) {
        char clip[80], path[96];
        for (const cJSON *o = obj->child; o != m; o = o->next)
            if (strcmp(o->string, m->string) == 0) {
                qm_clip(m->string, strlen(m->string), clip, sizeof clip);
                join(path, sizeof path, prefix, clip);
                return bad(st, path, "duplicate member '%s'", clip);
            }
        if (row_named(rows, m->string))
            continue;
        const qm_policy_param_spec *knob =
            rows->knobs ? qm_policy_param_find(m->string, strlen(m->string)) : NULL;
        if (knob) {
            int rc = get_policy_value(m, knob, &out->policy_params, st);
            if (rc < 0)
                return rc;
            continue;
        }
        char list[512];
        qm_clip(m->string, strlen(m->string), clip, sizeof clip);
        join(path, sizeof path, prefix, clip);
        members_list(rows, list, sizeof list);
        return bad(st, path, "unknown member '%s'; expected %s", clip,
                   list[0] ? list : "no members");
    }
    return 0;
}

const char *qm_wire_type_text(const qm_wire_param *p, char *out, size_t cap)
{
    char list[256];
    switch (p->type) {
    case QM_WT_POLICY: {
        char names[256];
        qm_policy_names(names, sizeof names);
        snprintf(out, cap, "one of %s", names);
        break;
    }
    case QM_WT_STRING:
    case QM_WT_NAME:
    case QM_WT_FILENAME:
        snprintf(out, cap, "%s of %llu to %llu bytes",
                 p->type == QM_WT_NAME ? "a name ([A-Za-z0-9._-])"
                 : p->type == QM_WT_FILENAME ? "a file name (no '/')" : "a string",
                 (unsigned long long)p->lo, (unsigned long long)p->hi);
        break;
    case QM_WT_UINT:
    case QM_WT_UINT32:
        if (p->hi == UINT64_MAX || p->hi == UINT32_MAX)
            snprintf(out, cap, p->lo ? "an integer >= %llu" : "a non-negative integer",
                     (unsigned long long)p->lo);
        else
            snprintf(out, cap, "an integer %llu..%llu", (unsigned long long)p->lo,
                     (unsigned long long)p->hi);
        break;
    case QM_WT_BOOL:
        snprintf(out, cap, "true or false");
        break;
    case QM_WT_ENUM:
        names_list(p->names, 1, list, sizeof list);
        snprintf(out, cap, "%s", list);
        break;
    case QM_WT_TENSOR:
        snprintf(out, cap, "a tensor of rank %llu, %s", (unsigned long long)p->lo,
                 p->hi == QM_WIRE_DT_I32 ? "i32" : "f32, f16 or bf16");
        break;
    case QM_WT_OBJECT:
        members_list(p->object, list, sizeof list);
        snprintf(out, cap, "an object {%s}", list);
        break;
    case QM_WT_HOT:
        snprintf(out, cap, "an array of {layer, experts}");
        break;
    case QM_WT_BUDGET:
        snprintf(out, cap, "bytes (an integer >= 1), \"N%%\" or \"auto\"");
        break;
    case QM_WT_CHECK:
        snprintf(out, cap, "a rule");
        break;
    }
    return out;
}

/* A string row's value: non-empty, at most hi bytes, UTF-8; a NAME of
 * [A-Za-z0-9._-], a FILENAME without '/' and not "." or "..". */
static int string_value(const cJSON *v, const char *path, const qm_wire_param *p, char **out,
                        qm_status *st)
{
    if (!cJSON_IsString(v))
        return wrong_type(st, path, "a string", v);
    size_t n = strlen(v->valuestring);
    if (n < p->lo)
        return bad(st, path, "%s must not be empty", path);
    if (n > p->hi)
        return bad(st, path, "%s is %zu bytes; at most %llu allowed", path, n,
                   (unsigned long long)p->hi);
    if (!qm__utf8_valid(v->valuestring, n))
        return bad(st, path, "%s is not valid UTF-8", path);
    if (p->type == QM_WT_NAME && !model_name_ok(v->valuestring))
        return bad(st, path, "%s may hold only letters, digits, '.', '_' and '-'", path);
    if (p->type == QM_WT_FILENAME &&
        (strchr(v->valuestring, '/') || strcmp(v->valuestring, ".") == 0 ||
         strcmp(v->valuestring, "..") == 0))
        return bad(st, path, "%s must be a file name inside the state dir, without '/'", path);
    *out = qm_strdup(v->valuestring);
    if (!*out)
        return qm_status_set(st, QM_ENOMEM, "out of memory copying %s", path);
    return 0;
}

/* An ENUM row's value: the index of its name. */
static int enum_value(const cJSON *v, const char *path, const qm_wire_param *p, int *out,
                      qm_status *st)
{
    for (int i = 0; cJSON_IsString(v) && p->names[i]; i++)
        if (strcmp(v->valuestring, p->names[i]) == 0) {
            *out = i;
            return 0;
        }
    char list[256], clip[80] = "";
    names_list(p->names, 1, list, sizeof list);
    if (cJSON_IsString(v))
        qm_clip(v->valuestring, strlen(v->valuestring), clip, sizeof clip);
    return bad(st, path, "%s must be %s, got %s%s%s", path, list, cJSON_IsString(v) ? "'" : "",
               cJSON_IsString(v) ? clip : qm__json_type_name(v), cJSON_IsString(v) ? "'" : "");
}

static int decode_rows(const cJSON *obj, const qm_wire_rows *rows, const char *prefix,
                       qm_params *out, qm_status *st);

/* What a missing required member was to be, for its sentence. */
static const char *required_what(const qm_wire_param *p)
{
    switch (p->type) {
    case QM_WT_UINT:
    case QM_WT_UINT32:
        return "a non-negative integer";
    case QM_WT_TENSOR:
        return "a tensor {dtype, shape, data|map, offset}";
    case QM_WT_OBJECT:
        return "an object";
    case QM_WT_BOOL:
        return "true or false";
    default:
        return "a string";
    }
}

/* One row: its member decoded and landed, or its rule applied. */
static int decode_row(const cJSON *obj, const qm_wire_param *p, const char *prefix,
                      qm_params *out, qm_status *st)
{
    if (p->type == QM_WT_CHECK)
        return p->fn(NULL, out, st);
    char path[96], what[320];
    join(path, sizeof path, prefix, p->member);
    const cJSON *v = member(obj, p->member);
    if (!v)
        return p->required ? bad(st, path, "%s is required (%s)", path, required_what(p)) : 0;
    char *at = (char *)out + (p->lands == NOWHERE ? 0 : p->lands);
    uint64_t u = 0;
    int rc = 0;
    switch (p->type) {
    case QM_WT_STRING:
    case QM_WT_NAME:
    case QM_WT_POLICY:
    case QM_WT_FILENAME:
        rc = string_value(v, path, p, (char **)at, st);
        break;
    case QM_WT_UINT:
    case QM_WT_UINT32:
        rc = integer_value(v, path, p->hi, &u, st);
        if (rc == 0 && u < p->lo)
            rc = p->lo == 1 ? bad(st, path, "%s must be greater than 0", path)
                            : bad(st, path, "%s must be at least %llu", path,
                                  (unsigned long long)p->lo);
        if (rc == 0 && p->type == QM_WT_UINT)
            memcpy(at, &u, sizeof u);
        if (rc == 0 && p->type == QM_WT_UINT32)
            *(uint32_t *)at = (uint32_t)u;
        break;
    case QM_WT_BOOL:
        rc = cJSON_IsBool(v) ? 0 : wrong_type(st, path, "true or false", v);
        if (rc == 0)
            *(int *)at = cJSON_IsTrue(v);
        break;
    case QM_WT_ENUM:
        rc = enum_value(v, path, p, (int *)at, st);
        break;
    case QM_WT_TENSOR:
        rc = parse_tensor(v, path, (uint32_t)p->lo, (unsigned)p->hi, (qm_tensor *)at, st);
        break;
    case QM_WT_OBJECT:
        rc = cJSON_IsObject(v) ? decode_rows(v, p->object, path, out, st)
                               : wrong_type(st, path, qm_wire_type_text(p, what, sizeof what), v);
        break;
    case QM_WT_HOT:
    case QM_WT_BUDGET:
    case QM_WT_CHECK:
        rc = p->fn(v, out, st);
        break;
    }
    if (rc == 0 && p->has != NOWHERE)
        *(int *)((char *)out + p->has) = 1;
    return rc;
}

static int decode_rows(const cJSON *obj, const qm_wire_rows *rows, const char *prefix,
                       qm_params *out, qm_status *st)
{
    int rc = check_members(obj, rows, prefix, out, st);
    for (size_t i = 0; rc == 0 && i < rows->n; i++)
        rc = decode_row(obj, &rows->rows[i], prefix, out, st);
    return rc;
}

static void free_rows(const qm_wire_rows *rows, qm_params *p)
{
    for (size_t i = 0; i < rows->n; i++) {
        const qm_wire_param *r = &rows->rows[i];
        char *at = (char *)p + (r->lands == NOWHERE ? 0 : r->lands);
        switch (r->type) {
        case QM_WT_STRING:
        case QM_WT_NAME:
        case QM_WT_POLICY:
        case QM_WT_FILENAME:
            qm_free(*(char **)at);
            *(char **)at = NULL;
            break;
        case QM_WT_TENSOR:
            qm_tensor_free((qm_tensor *)at);
            break;
        case QM_WT_OBJECT:
            free_rows(r->object, p);
            break;
        case QM_WT_HOT: {
            /* The list where the row lands, its count right after it. */
            qm_hot_layer **list = (qm_hot_layer **)at;
            size_t *n = (size_t *)(at + sizeof(qm_hot_layer *));
            for (size_t j = 0; j < *n; j++)
                qm_free((*list)[j].experts);
            qm_free(*list);
            *list = NULL;
            *n = 0;
            break;
        }
        default:
            break;
        }
    }
}

/* A HOT row lands its list; the count follows it (free_rows). */
_Static_assert(offsetof(qm_params, policy_params.n_hot) ==
                   offsetof(qm_params, policy_params.hot) + sizeof(qm_hot_layer *),
               "policy_params.n_hot follows policy_params.hot");
_Static_assert(offsetof(qm_params, n_warm) == offsetof(qm_params, warm) + sizeof(qm_hot_layer *),
               "n_warm follows warm");

void qm__params_free(qm_method m, qm_params *p)
{
    const qm_wire_rows *rows = qm_wire_params(m);
    if (rows)
        free_rows(rows, p);
}

int qm__params_decode(qm_method m, const cJSON *params, qm_params *out, qm_status *st)
{
    const qm_wire_rows *rows = qm_wire_params(m);
    if (!rows)
        return bad(st, "", "unknown method");
    return decode_rows(params, rows, "", out, st);
}
