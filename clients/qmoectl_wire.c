/* qmoectl_wire.c - the wire's rows (protocol/qm_wire_schema.h) as qmoectl
 * commands: `methods` lists every method and what it takes (as a table,
 * JSON, or docs/PROTOCOL.md's params tables), `call` calls any method with
 * its members given as MEMBER=VALUE, typed by its rows, so a new method is
 * callable here without a line of qmoectl. */
#include <stdlib.h>
#include <string.h>

#include "qm_protocol.h"
#include "qm_residency.h"
#include "qmoectl.h"

static int method_named(const char *name, qm_method *out)
{
    if (qm_method_parse(name, strlen(name), out) == 0)
        return 0;
    return qmoectl_usage_error("unknown method '%.64s'; `qmoectl methods` lists them", name);
}

int qmoectl_check_name(const char *method, const char *member, const char *option,
                       const char *value)
{
    qm_method m;
    const qm_wire_rows *rows =
        qm_method_parse(method, strlen(method), &m) == 0 ? qm_wire_params(m) : NULL;
    for (size_t i = 0; rows && i < rows->n; i++) {
        const qm_wire_param *p = &rows->rows[i];
        if (strcmp(p->member, member) != 0 || !p->names)
            continue;
        for (size_t j = 0; p->names[j]; j++)
            if (strcmp(p->names[j], value) == 0)
                return 0;
        char type[256];
        return qmoectl_usage_error("%s must be %s, not '%.64s'", option,
                                   qm_wire_type_text(p, type, sizeof type), value);
    }
    return 0; /* no such row: the daemon judges */
}

/* ---- one method's params as rows of text ---- */

/* "lfu, next_use": the offered policies that take knob `name`. */
static void knob_policies(const char *name, char *out, size_t cap)
{
    size_t len = 0;
    out[0] = '\0';
    for (size_t i = 0; i < qm_policy_count(); i++) {
        if (!qm_policy_offered_at(i))
            continue;
        for (size_t j = 0; j < qm_policy_param_count(i) && len < cap; j++)
            if (strcmp(qm_policy_param_name(qm_policy_param_at(i, j)), name) == 0)
                len += (size_t)snprintf(out + len, cap - len, "%s%s", len ? ", " : "",
                                        qm_policy_name_at(i));
    }
}

typedef void (*row_fn)(void *ctx, const char *member, const char *type, int required,
                       const char *meaning);

/* Calls `fn` for each row of `rows` (nested objects' rows as prefix.member,
 * rules as member ""), then for each knob an object takes. */
static void walk_rows(const qm_wire_rows *rows, const char *prefix, row_fn fn, void *ctx)
{
    char member[160], type[512];
    for (size_t i = 0; i < rows->n; i++) {
        const qm_wire_param *p = &rows->rows[i];
        snprintf(member, sizeof member, "%s%s%s", prefix, prefix[0] && p->member[0] ? "." : "",
                 p->member);
        if (p->type == QM_WT_CHECK) {
            fn(ctx, "", "", 0, p->doc);
            continue;
        }
        fn(ctx, member, qm_wire_type_text(p, type, sizeof type), p->required, p->doc);
        if (p->type == QM_WT_OBJECT)
            walk_rows(p->object, member, fn, ctx);
    }
    for (size_t i = 0; rows->knobs && i < qm_policy_count(); i++)
        for (size_t j = 0; j < qm_policy_param_count(i); j++) {
            const qm_policy_param_spec *spec = qm_policy_param_at(i, j);
            const char *name = qm_policy_param_name(spec);
            if (qm_policy_param_find(name, strlen(name)) != spec) /* listed once */
                continue;
            double lo, hi;
            int integer;
            char who[256], meaning[320];
            qm_policy_param_range(spec, &lo, &hi, NULL, &integer);
            knob_policies(name, who, sizeof who);
            snprintf(member, sizeof member, "%s.%s", prefix, name);
            snprintf(type, sizeof type, "a %s %g..%g", integer ? "whole number" : "number", lo,
                     hi);
            snprintf(meaning, sizeof meaning, "a knob of %s (the residency registry's)", who);
            fn(ctx, member, type, 0, meaning);
        }
}

static void markdown_row(void *ctx, const char *member, const char *type, int required,
                         const char *meaning)
{
    (void)ctx;
    if (!member[0])
        printf("| (rule) | | | %s |\n", meaning);
    else
        printf("| `%s` | %s | %s | %s |\n", member, type, required ? "yes" : "no", meaning);
}

static void table_row(void *ctx, const char *member, const char *type, int required,
                      const char *meaning)
{
    qmoectl_table *t = ctx;
    qmoectl_table_cell(t, "%s", member[0] ? member : "(rule)");
    qmoectl_table_cell(t, "%s", type);
    qmoectl_table_cell(t, "%s", member[0] ? (required ? "yes" : "no") : "");
    qmoectl_table_cell(t, "%s", meaning);
}

/* ---- methods ---- */

/* What a client sends for a row: a JSON string, an integer, ... */
static const char *json_kind(const qm_wire_param *p)
{
    switch (p->type) {
    case QM_WT_STRING:
    case QM_WT_NAME:
    case QM_WT_POLICY:
    case QM_WT_FILENAME:
    case QM_WT_ENUM:
        return "string";
    case QM_WT_UINT:
    case QM_WT_UINT32:
        return "integer";
    case QM_WT_BOOL:
        return "boolean";
    case QM_WT_TENSOR:
        return "tensor";
    case QM_WT_OBJECT:
        return "object";
    case QM_WT_HOT:
        return "array";
    case QM_WT_BUDGET:
        return "integer or string";
    case QM_WT_CHECK:
        break;
    }
    return "none";
}

static void jw_rows(qm_jw *w, const qm_wire_rows *rows)
{
    char type[512];
    qm_jw_arr_begin(w);
    for (size_t i = 0; i < rows->n; i++) {
        const qm_wire_param *p = &rows->rows[i];
        qm_jw_obj_begin(w);
        qm_jw_member_str(w, "member", p->member);
        qm_jw_member_str(w, "type", qm_wire_type_text(p, type, sizeof type));
        qm_jw_key(w, "required");
        qm_jw_bool(w, p->required);
        qm_jw_key(w, "rule");
        qm_jw_bool(w, p->type == QM_WT_CHECK);
        qm_jw_member_str(w, "json", json_kind(p));
        if (p->names) {
            qm_jw_key(w, "names");
            qm_jw_arr_begin(w);
            for (size_t j = 0; p->names[j]; j++)
                qm_jw_str(w, p->names[j]);
            qm_jw_arr_end(w);
        } else if (p->type == QM_WT_POLICY) { /* the residency registry's offered policies */
            qm_jw_key(w, "names");
            qm_jw_arr_begin(w);
            for (size_t j = 0; j < qm_policy_count(); j++)
                if (qm_policy_offered_at(j))
                    qm_jw_str(w, qm_policy_name_at(j));
            qm_jw_arr_end(w);
        }
        if (p->object) {
            qm_jw_key(w, "members");
            jw_rows(w, p->object);
            qm_jw_key(w, "knobs");
            qm_jw_bool(w, p->object->knobs);
        }
        qm_jw_member_str(w, "doc", p->doc);
        qm_jw_obj_end(w);
    }
    qm_jw_arr_end(w);
}

static int methods_json(int only, qm_method one)
{
    qm_buf b;
    qm_buf_init(&b);
    qm_jw w;
    qm_jw_init(&w, &b);
    qm_jw_arr_begin(&w);
    for (int m = 0; m < QM_METHOD_COUNT; m++) {
        if (only && (qm_method)m != one)
            continue;
        qm_jw_obj_begin(&w);
        qm_jw_member_str(&w, "method", qm_method_name((qm_method)m));
        qm_jw_member_str(&w, "summary", qm_method_summary((qm_method)m));
        qm_jw_key(&w, "params");
        jw_rows(&w, qm_wire_params((qm_method)m));
        qm_jw_obj_end(&w);
    }
    qm_jw_arr_end(&w);
    int rc = b.oom ? qmoectl_error("out of memory") : QMOECTL_OK;
    if (rc == QMOECTL_OK)
        printf("%.*s\n", (int)b.len, b.data);
    qm_buf_free(&b);
    return rc;
}

int qmoectl_cmd_methods(const qmoectl_args *a)
{
    qm_method m = QM_METHOD_COUNT;
    if (a->npos && method_named(a->pos[0], &m) != 0)
        return QMOECTL_USAGE;
    if (a->json)
        return methods_json(a->npos, m);
    if (qmoectl_opt(a, "--markdown")) {
        if (!a->npos)
            return qmoectl_usage_error("--markdown needs a METHOD");
        printf("| member | type | required | meaning |\n|---|---|---|---|\n");
        if (qm_wire_params(m)->n == 0)
            printf("| (none) | | | %s takes no params |\n", qm_method_name(m));
        walk_rows(qm_wire_params(m), "", markdown_row, NULL);
        return QMOECTL_OK;
    }
    if (!a->npos) {
        static const char *const hdr[] = {"METHOD", "WHAT"};
        qmoectl_table *t = qmoectl_table_new(2, hdr);
        for (int i = 0; i < QM_METHOD_COUNT; i++) {
            qmoectl_table_cell(t, "%s", qm_method_name((qm_method)i));
            qmoectl_table_cell(t, "%s", qm_method_summary((qm_method)i));
        }
        qmoectl_table_print(t, stdout);
        qmoectl_table_free(t);
        return QMOECTL_OK;
    }
    printf("%s: %s\n", qm_method_name(m), qm_method_summary(m));
    if (qm_wire_params(m)->n == 0) {
        printf("no params\n");
        return QMOECTL_OK;
    }
    static const char *const hdr[] = {"MEMBER", "TYPE", "REQUIRED", "MEANING"};
    qmoectl_table *t = qmoectl_table_new(4, hdr);
    walk_rows(qm_wire_params(m), "", table_row, t);
    qmoectl_table_print(t, stdout);
    qmoectl_table_free(t);
    return QMOECTL_OK;
}

/* ---- call ---- */

/* Params {MEMBER: VALUE, ...} from the positionals after METHOD: a member
 * its rows type as a string is quoted, any other value is JSON as given. */
static int call_params(const qmoectl_args *a, qm_method m, qm_buf *out)
{
    const qm_wire_rows *rows = qm_wire_params(m);
    qm_buf_append(out, "{", 1);
    for (int i = 1; i < a->npos; i++) {
        const char *eq = strchr(a->pos[i], '=');
        if (!eq || eq == a->pos[i])
            return qmoectl_usage_error("call takes MEMBER=VALUE, not '%.64s'", a->pos[i]);
        const qm_wire_param *p = NULL;
        for (size_t r = 0; r < rows->n && !p; r++)
            if (strlen(rows->rows[r].member) == (size_t)(eq - a->pos[i]) &&
                strncmp(rows->rows[r].member, a->pos[i], (size_t)(eq - a->pos[i])) == 0 &&
                rows->rows[r].type != QM_WT_CHECK)
                p = &rows->rows[r];
        if (!p)
            return qmoectl_usage_error("%s takes no member '%.*s'; `qmoectl methods %s` lists "
                                       "what it takes",
                                       qm_method_name(m), (int)(eq - a->pos[i]), a->pos[i],
                                       qm_method_name(m));
        qm_buf_printf(out, "%s\"%s\":", i > 1 ? "," : "", p->member);
        if (strcmp(json_kind(p), "string") == 0) {
            qm_buf_append(out, "\"", 1);
            qm_json_escape(out, eq + 1, strlen(eq + 1));
            qm_buf_append(out, "\"", 1);
        } else {
            qm_buf_append(out, eq + 1, strlen(eq + 1));
        }
    }
    qm_buf_append(out, "}", 1);
    return out->oom ? qmoectl_error("out of memory") : 0;
}

/* The method and its params from `call`'s arguments; params is the
 * caller's to free either way. */
static int call_of(const qmoectl_args *a, qm_method *m, qm_buf *params)
{
    qm_buf_init(params);
    if (method_named(a->pos[0], m) != 0)
        return QMOECTL_USAGE;
    int rc = call_params(a, *m, params);
    if (rc == 0)
        qm_buf_append(params, "", 1);
    return rc == 0 && params->oom ? qmoectl_error("out of memory") : rc;
}

int qmoectl_cmd_call(qm_client *c, const qmoectl_args *a)
{
    qm_method m;
    qm_buf params;
    int rc = call_of(a, &m, &params);
    if (rc == 0)
        rc = qmoectl_print_json(c, qm_method_name(m), a->npos > 1 ? params.data : NULL);
    qm_buf_free(&params);
    return rc;
}

int qmoectl_check_call(const qmoectl_args *a)
{
    qm_method m;
    qm_buf params;
    int rc = call_of(a, &m, &params);
    qm_buf_free(&params);
    return rc;
}
