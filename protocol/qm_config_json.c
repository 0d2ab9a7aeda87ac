/* qm_config_json.c - the daemon's JSON config file as flat key/value entries.
 *
 * The daemon may not see cJSON, so the file is flattened here: top-level
 * members become entries, members of a nested object become "outer.inner"
 * (the "models" map). Arrays and deeper nesting are errors naming the key. */
#include "qm_rpc_impl.h"

#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"

void qm_conf_free(qm_conf_entry *entries, size_t count)
{
    if (!entries)
        return;
    for (size_t i = 0; i < count; i++) {
        qm_free(entries[i].key);
        qm_free(entries[i].str);
    }
    qm_free(entries);
}

/* An array of strings (model_dirs) becomes one string entry, its items
 * joined with ':' as on the command line; so an item may not hold ':'. */
static int add_list_entry(const cJSON *v, qm_conf_entry *e, qm_status *st)
{
    char key[160];
    snprintf(key, sizeof key, "%s", v->string);
    memset(e, 0, sizeof *e);
    size_t n = 1, i = 0;
    for (const cJSON *c = v->child; c; c = c->next, i++) {
        if (!cJSON_IsString(c) || !c->valuestring[0] || strchr(c->valuestring, ':'))
            return qm_status_set_field(st, QM_EINVAL, key,
                                       "config key %s item %zu must be a non-empty string "
                                       "without ':'",
                                       key, i);
        n += strlen(c->valuestring) + 1;
    }
    e->type = QM_CONF_STRING;
    e->str = qm_malloc(n);
    e->key = qm_strdup(key);
    if (!e->str || !e->key)
        return qm_status_set(st, QM_ENOMEM, "out of memory reading the config");
    e->str[0] = '\0';
    for (const cJSON *c = v->child; c; c = c->next) {
        if (e->str[0])
            strcat(e->str, ":");
        strcat(e->str, c->valuestring);
    }
    return 0;
}

static int add_entry(const cJSON *v, const char *prefix, qm_conf_entry *e, qm_status *st)
{
    char key[160];
    if (prefix)
        snprintf(key, sizeof key, "%s.%s", prefix, v->string);
    else
        snprintf(key, sizeof key, "%s", v->string);
    memset(e, 0, sizeof *e);
    if (cJSON_IsString(v)) {
        e->type = QM_CONF_STRING;
        e->str = qm_strdup(v->valuestring);
        if (!e->str)
            return qm_status_set(st, QM_ENOMEM, "out of memory reading the config");
    } else if (cJSON_IsNumber(v)) {
        e->type = QM_CONF_NUMBER;
        e->num = v->valuedouble;
    } else if (cJSON_IsBool(v)) {
        e->type = QM_CONF_BOOL;
        e->boolean = cJSON_IsTrue(v);
    } else {
        return qm_status_set_field(st, QM_EINVAL, key,
                                   "config key %s must be a string, number or boolean", key);
    }
    e->key = qm_strdup(key);
    if (!e->key)
        return qm_status_set(st, QM_ENOMEM, "out of memory reading the config");
    return 0;
}

int qm_conf_parse(const char *text, size_t n, qm_conf_entry **out, size_t *count, qm_status *st)
{
    *out = NULL;
    *count = 0;
    if (qm_json_depth(text, n, 2) < 0)
        return qm_status_set(st, QM_EINVAL, "config nests deeper than one object level");
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, n, &end, 0);
    if (!root || !cJSON_IsObject(root)) {
        size_t at = root || !end ? 0 : (size_t)(end - text);
        cJSON_Delete(root);
        return qm_status_set(st, QM_EINVAL, "config is not a JSON object (error near byte %zu)",
                             at);
    }
    size_t total = 0;
    for (const cJSON *m = root->child; m; m = m->next)
        total += cJSON_IsObject(m) ? (size_t)cJSON_GetArraySize(m) : 1;
    qm_conf_entry *entries = qm_calloc(total ? total : 1, sizeof *entries);
    int rc = 0;
    size_t k = 0;
    if (!entries) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory reading the config");
        goto done;
    }
    for (const cJSON *m = root->child; m && rc == 0; m = m->next) {
        if (cJSON_IsObject(m)) {
            for (const cJSON *c = m->child; c && rc == 0; c = c->next) {
                rc = add_entry(c, m->string, &entries[k], st);
                k++;
            }
        } else if (cJSON_IsArray(m)) {
            rc = add_list_entry(m, &entries[k], st);
            k++;
        } else {
            rc = add_entry(m, NULL, &entries[k], st);
            k++;
        }
    }
done:
    cJSON_Delete(root);
    if (rc < 0) {
        qm_conf_free(entries, k);
        return rc;
    }
    *out = entries;
    *count = k;
    return 0;
}
