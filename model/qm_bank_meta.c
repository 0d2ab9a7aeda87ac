/* qm_bank_meta.c - the metadata of banks imported from real models
 * (BANK_FORMAT.md "Banks imported from real models"): qmoe.routing.*,
 * qmoe.layer_map and qmoe.source. Every key is optional; a bank without
 * them keeps the legacy routing rule and means exactly what it meant before.
 *
 * The two JSON-valued keys are parsed with cJSON here rather than by
 * protocol/'s header codec: they are values inside __metadata__ (strings to
 * safetensors), so the header parser rightly never looks inside them. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_bank_internal.h"
#include "qm_json.h"

#define META_FAIL(st, ...) qm_status_set((st), QM_EINVALID_MODEL, __VA_ARGS__)

static const char *const route_score_names[] = {
    [QM_ROUTE_SCORE_LEGACY] = "legacy",
    [QM_ROUTE_SCORE_SOFTMAX] = "softmax",
    [QM_ROUTE_SCORE_SIGMOID] = "sigmoid",
};
static const char *const group_score_names[] = {
    [QM_GROUP_SCORE_MAX] = "max",
    [QM_GROUP_SCORE_TOP2_SUM] = "top2_sum",
};
#define N_NAMES(names) (sizeof names / sizeof names[0])

const char *qm_route_score_name(qm_route_score s)
{
    return (unsigned)s < N_NAMES(route_score_names) ? route_score_names[s] : "unknown";
}

const char *qm_group_score_name(qm_group_score s)
{
    return (unsigned)s < N_NAMES(group_score_names) ? group_score_names[s] : "unknown";
}

/* The index in names[first, n) of `value`, or -1. */
static int name_index(const char *const *names, size_t first, size_t n, const char *value)
{
    for (size_t i = first; i < n; i++)
        if (strcmp(value, names[i]) == 0) return (int)i;
    return -1;
}

/* ---- qmoe.routing.* ---------------------------------------------------------- */

static const char *const routing_keys[] = {"qmoe.routing.score",  "qmoe.routing.normalize",
                                           "qmoe.routing.scale",  "qmoe.routing.groups",
                                           "qmoe.routing.topk_groups",
                                           "qmoe.routing.group_score"};

static int routing_u32(const qm_st_header *h, const char *key, uint32_t dflt, uint32_t lo,
                       uint32_t hi, uint32_t *out, qm_status *st)
{
    const char *v = qm_st_header_meta(h, key);
    if (!v) {
        *out = dflt;
        return 0;
    }
    size_t n = strlen(v);
    int ok = n > 0 && n <= 10;
    for (size_t i = 0; ok && i < n; i++)
        ok = v[i] >= '0' && v[i] <= '9';
    unsigned long long x = ok ? strtoull(v, NULL, 10) : 0;
    if (!ok || x < lo || x > hi)
        return META_FAIL(st, "__metadata__: %s = \"%.32s\" but it must be an integer in [%u, %u]",
                         key, v, lo, hi);
    *out = (uint32_t)x;
    return 0;
}

int qm__routing_from_metadata(const qm_st_header *h, qm_bank_config *cfg, qm_status *st)
{
    qm_routing_rule *r = &cfg->routing;
    memset(r, 0, sizeof *r);
    r->normalize = 1;
    r->scale = 1.0f;
    r->groups = 1;
    r->topk_groups = 1;
    /* A routing key the reader does not know would silently route the old
     * way: refuse it, the same as a misspelt value. */
    for (size_t i = 0; i < h->n_meta; i++) {
        const char *key = h->meta[i].key;
        if (strncmp(key, "qmoe.routing.", 13) != 0)
            continue;
        int known = 0;
        for (size_t j = 0; j < sizeof routing_keys / sizeof routing_keys[0]; j++)
            known |= strcmp(key, routing_keys[j]) == 0;
        if (!known)
            return META_FAIL(st, "__metadata__: unknown routing key %.64s (known: score, "
                                 "normalize, scale, groups, topk_groups, group_score)", key);
    }
    const char *score = qm_st_header_meta(h, "qmoe.routing.score");
    if (!score) {
        for (size_t j = 1; j < sizeof routing_keys / sizeof routing_keys[0]; j++)
            if (qm_st_header_meta(h, routing_keys[j]))
                return META_FAIL(st, "__metadata__: %s is set but qmoe.routing.score is missing "
                                     "(routing keys take effect only with a score)",
                                 routing_keys[j]);
        return 0; /* the legacy rule */
    }
    /* legacy is what no keys mean, not a value to write */
    int score_i = name_index(route_score_names, QM_ROUTE_SCORE_SOFTMAX,
                             N_NAMES(route_score_names), score);
    if (score_i < 0)
        return META_FAIL(st, "__metadata__: qmoe.routing.score = \"%.32s\" but it must be "
                             "softmax or sigmoid", score);
    r->score = (qm_route_score)score_i;
    uint32_t normalize = 1;
    int rc;
    if ((rc = routing_u32(h, "qmoe.routing.normalize", 1, 0, 1, &normalize, st)) ||
        (rc = routing_u32(h, "qmoe.routing.groups", 1, 1, cfg->experts, &r->groups, st)))
        return rc;
    r->normalize = (int)normalize;
    const char *scale = qm_st_header_meta(h, "qmoe.routing.scale");
    if (scale) {
        char *end = NULL;
        float f = strtof(scale, &end);
        if (scale[0] == '\0' || *end != '\0' || !isfinite(f) || !(f > 0.0f))
            return META_FAIL(st, "__metadata__: qmoe.routing.scale = \"%.32s\" but it must be "
                                 "a finite number > 0", scale);
        r->scale = f;
    }
    if (cfg->experts % r->groups != 0)
        return META_FAIL(st, "__metadata__: qmoe.routing.groups = %u does not divide "
                             "qmoe.experts %u", r->groups, cfg->experts);
    if ((rc = routing_u32(h, "qmoe.routing.topk_groups", r->groups, 1, r->groups,
                          &r->topk_groups, st)))
        return rc;
    uint32_t per_group = cfg->experts / r->groups;
    if ((uint64_t)r->topk_groups * per_group < cfg->k)
        return META_FAIL(st, "__metadata__: qmoe.routing.topk_groups = %u keeps %u experts "
                             "(%u per group) but qmoe.k is %u",
                         r->topk_groups, r->topk_groups * per_group, per_group, cfg->k);
    const char *gs = qm_st_header_meta(h, "qmoe.routing.group_score");
    if (gs) {
        int gs_i = name_index(group_score_names, 0, N_NAMES(group_score_names), gs);
        if (gs_i < 0)
            return META_FAIL(st, "__metadata__: qmoe.routing.group_score = \"%.32s\" but it "
                                 "must be max or top2_sum", gs);
        r->group_score = (qm_group_score)gs_i;
        if (r->group_score == QM_GROUP_SCORE_TOP2_SUM && per_group < 2)
            return META_FAIL(st, "__metadata__: qmoe.routing.group_score = top2_sum needs at "
                                 "least 2 experts per group (qmoe.routing.groups = %u of %u "
                                 "experts)", r->groups, cfg->experts);
    }
    return 0;
}

/* ---- metadata values that are JSON ------------------------------------------ */

/* Parses metadata `key` as one JSON value (nothing after it) that `is`
 * accepts: *out is that value (cJSON_Delete it), or NULL when the key is
 * absent. Otherwise fails with "... but it must be <want>". */
static int meta_json(const qm_st_header *h, const char *key, cJSON_bool (*is)(const cJSON *const),
                     const char *want, cJSON **out, qm_status *st)
{
    *out = NULL;
    const char *v = qm_st_header_meta(h, key);
    if (!v)
        return 0;
    cJSON *j = cJSON_ParseWithOpts(v, NULL, 1);
    if (!j || !is(j)) {
        cJSON_Delete(j);
        return META_FAIL(st, "__metadata__: %s = \"%.48s\" but it must be %s", key, v, want);
    }
    *out = j;
    return 0;
}

/* ---- qmoe.layer_map ---------------------------------------------------------- */

int qm__layer_map_from_metadata(const qm_st_header *h, uint32_t layers, uint32_t **map,
                                qm_status *st)
{
    *map = NULL;
    char want[48];
    snprintf(want, sizeof want, "a JSON list of %u integers", layers);
    cJSON *j;
    int rc = meta_json(h, "qmoe.layer_map", cJSON_IsArray, want, &j, st);
    if (rc || !j)
        return rc;
    int n = cJSON_GetArraySize(j);
    if (n < 0 || (uint32_t)n != layers) {
        rc = META_FAIL(st, "__metadata__: qmoe.layer_map has %d entries but qmoe.layers is %u",
                       n, layers);
        goto done;
    }
    uint32_t *m = qm_malloc((size_t)layers * sizeof *m);
    if (!m) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory for qmoe.layer_map");
        goto done;
    }
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, j)
    {
        double d = cJSON_IsNumber(it) ? it->valuedouble : -1.0;
        if (!(d >= 0.0 && d <= 2147483647.0) || d != floor(d)) {
            rc = META_FAIL(st, "__metadata__: qmoe.layer_map[%d] must be an integer in [0, "
                               "2147483647]", i);
            break;
        }
        m[i] = (uint32_t)d;
        if (i > 0 && m[i] <= m[i - 1]) {
            rc = META_FAIL(st, "__metadata__: qmoe.layer_map[%d] = %u but the map must be "
                               "strictly ascending (previous %u)", i, m[i], m[i - 1]);
            break;
        }
        i++;
    }
    if (rc)
        qm_free(m);
    else
        *map = m;
done:
    cJSON_Delete(j);
    return rc;
}

/* ---- qmoe.source ------------------------------------------------------------- */

/* cJSON's compact text with every byte that is not well-formed UTF-8 (in
 * its strings: the structure is ASCII) as U+FFFD; NULL without memory. */
static char *source_compact(const cJSON *j)
{
    char *text = cJSON_PrintUnformatted(j);
    if (!text)
        return NULL;
    size_t n = strlen(text), o = 0;
    char *out = qm_malloc(3 * n + 1);
    for (size_t i = 0; out && i < n;) {
        size_t ok = qm_utf8_valid_len((const unsigned char *)text + i, n - i);
        if (ok) {
            memcpy(out + o, text + i, ok);
            o += ok;
            i += ok;
        } else {
            memcpy(out + o, "\xef\xbf\xbd", 3);
            o += 3;
            i++;
        }
    }
    if (out)
        out[o] = '\0';
    cJSON_free(text);
    return out;
}

int qm__source_check(const qm_st_header *h, char **compact, qm_status *st)
{
    *compact = NULL;
    cJSON *j;
    int rc = meta_json(h, "qmoe.source", cJSON_IsObject, "a JSON object", &j, st);
    if (rc || !j)
        return rc;
    const cJSON *f;
    if ((f = cJSON_GetObjectItemCaseSensitive(j, "format"))) {
        static const char *const formats[] = {"hf", "gguf", "onnx", "synthetic"};
        int ok = 0;
        for (size_t i = 0; cJSON_IsString(f) && i < sizeof formats / sizeof formats[0]; i++)
            ok |= strcmp(f->valuestring, formats[i]) == 0;
        if (!ok) {
            rc = META_FAIL(st, "__metadata__: qmoe.source.format must be \"hf\", \"gguf\", "
                               "\"onnx\" or \"synthetic\"");
            goto done;
        }
    }
    if ((f = cJSON_GetObjectItemCaseSensitive(j, "family")) && !cJSON_IsString(f)) {
        rc = META_FAIL(st, "__metadata__: qmoe.source.family must be a string");
        goto done;
    }
    if ((f = cJSON_GetObjectItemCaseSensitive(j, "files"))) {
        int ok = cJSON_IsArray(f);
        const cJSON *it;
        cJSON_ArrayForEach(it, f) ok = ok && cJSON_IsString(it);
        if (!ok) {
            rc = META_FAIL(st, "__metadata__: qmoe.source.files must be a list of strings");
            goto done;
        }
    }
    if ((f = cJSON_GetObjectItemCaseSensitive(j, "exact")) && !cJSON_IsBool(f)) {
        rc = META_FAIL(st, "__metadata__: qmoe.source.exact must be true or false");
        goto done;
    }
    if ((f = cJSON_GetObjectItemCaseSensitive(j, "max_rel_err")) &&
        !(cJSON_IsNumber(f) && f->valuedouble >= 0.0 && isfinite(f->valuedouble))) {
        rc = META_FAIL(st, "__metadata__: qmoe.source.max_rel_err must be a finite number >= 0");
        goto done;
    }
    /* Kept as the daemon splices it into answers: one line of JSON (the
     * file's text may be pretty-printed, and a newline would end the
     * answer's line) of well-formed UTF-8. */
    if (!(*compact = source_compact(j)))
        rc = qm_status_set(st, QM_ENOMEM, "out of memory keeping qmoe.source");
done:
    cJSON_Delete(j);
    return rc;
}
