/* qmoectl_cmds.c - one function per qmoectl subcommand. Human output is
 * tables in humane units; --json prints the daemon's raw result. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cJSON.h>

#include "qm_name_groups.h"
#include "qm_protocol.h"
#include "qmoectl.h"
#include "qm_residency.h"

#define B(n, buf) qmoectl_bytes((n), (buf), sizeof(buf))

/* ---------- status, models, load, unload ---------- */

/* The kernels of one state as "exact avx512, avx2; fast avx2" (NULL: none). */
static const char *kernel_names(const qm_client_status *s, const char *state, char *out,
                                size_t cap)
{
    qm_name_groups g;
    qm_name_groups_init(&g, out, cap);
    for (size_t i = 0; i < s->n_kernels; i++) {
        const qm_client_kernel *k = &s->kernels[i];
        if (k->state && strcmp(k->state, state) == 0 && k->name && k->precision)
            qm_name_groups_add(&g, k->precision, k->name);
    }
    return out[0] ? out : NULL;
}

/* The self-check's lines: the kernels verified, each one refused with why. */
static void print_kernels(const qm_client_status *s)
{
    char names[512];
    if (!s->kernels_cpu)
        return;
    const char *v = kernel_names(s, "verified", names, sizeof names);
    printf("kernels  verified %s (self-check on %s, %.1f ms%s)\n", v ? v : "none", s->kernels_cpu,
           s->kernels_check_ms, s->kernels_cached ? ", from the kernel cache" : "");
    for (size_t i = 0; i < s->n_kernels; i++) {
        const qm_client_kernel *k = &s->kernels[i];
        if (k->state && strcmp(k->state, "refused") == 0)
            printf("kernels  refused %s %s, never used: %s\n", k->precision ? k->precision : "?",
                   k->name ? k->name : "?", k->reason ? k->reason : "no reason given");
    }
}

static int cmd_status(qm_client *c, const qmoectl_args *a)
{
    if (a->json)
        return qmoectl_print_json(c, "daemon.status", NULL);
    qm_client_status s;
    qm_client_error err;
    if (qm_client_daemon_status(c, &s, &err) < 0)
        return qmoectl_fail(&err);
    char up[32], tot[32], bud[32], used[32], pct[16];
    printf("qmoed %s, up %s, socket %s\n", s.version ? s.version : "?",
           qmoectl_duration(s.uptime_s, up, sizeof(up)), qm_client_path(c));
    printf("backend  %s (%s)\n", s.backend ? s.backend : "?",
           s.device_name ? s.device_name : "unnamed device");
    printf("memory   budget %s, used %s (%s of budget), device total %s\n",
           B(s.device_budget_bytes, bud), B(s.device_used_bytes, used),
           qmoectl_percent((double)s.device_used_bytes, (double)s.device_budget_bytes, pct,
                           sizeof(pct)),
           B(s.device_total_bytes, tot));
    /* Several devices: each one's budget and use (the line above sums them). */
    for (size_t i = 0; s.n_devices > 1 && i < s.n_devices; i++) {
        const qm_client_device *dv = &s.devices[i];
        printf("device   %s: budget %s, used %s (%s of budget), total %s%s%s\n",
               dv->name ? dv->name : "?", B(dv->budget_bytes, bud), B(dv->used_bytes, used),
               qmoectl_percent((double)dv->used_bytes, (double)dv->budget_bytes, pct,
                               sizeof(pct)),
               B(dv->total_bytes, tot), dv->kind ? ", " : "", dv->kind ? dv->kind : "");
    }
    printf("models   %llu   sessions %llu   connections %llu\n", (unsigned long long)s.models,
           (unsigned long long)s.sessions, (unsigned long long)s.connections);
    print_kernels(&s);
    qm_client_status_free(&s);
    return QMOECTL_OK;
}

/* The code book each model reads its 4-bit codes through (model.list's
 * quantisation.codebook, docs/BANK_FORMAT.md "Code books"), or "" for
 * plain codes: the library's model row has no member for it (adding one
 * would change the size of an installed struct), so the list's JSON is read
 * once more here. A failure leaves every entry "". */
static void models_codebooks(qm_client *c, const qm_client_model *m, size_t n, char (*cb)[16])
{
    for (size_t i = 0; i < n; i++)
        cb[i][0] = '\0';
    char *out = NULL;
    qm_client_error err;
    if (qm_client_call_json(c, "model.list", NULL, 0, &out, &err) < 0)
        return;
    cJSON *root = cJSON_Parse(out);
    qm_client_string_free(out);
    const cJSON *ms = cJSON_GetObjectItemCaseSensitive(root, "models"), *row;
    cJSON_ArrayForEach(row, ms)
    {
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(row, "name");
        const cJSON *q = cJSON_GetObjectItemCaseSensitive(row, "quantisation");
        const cJSON *book = cJSON_GetObjectItemCaseSensitive(q, "codebook");
        if (!cJSON_IsString(name) || !cJSON_IsString(book))
            continue;
        for (size_t i = 0; i < n; i++)
            if (m[i].name && strcmp(m[i].name, name->valuestring) == 0)
                snprintf(cb[i], sizeof cb[i], "%s", book->valuestring);
    }
    cJSON_Delete(root);
}

static int cmd_models(qm_client *c, const qmoectl_args *a)
{
    if (a->json)
        return qmoectl_print_json(c, "model.list", NULL);
    qm_client_model *m = NULL;
    size_t n = 0;
    qm_client_error err;
    if (qm_client_model_list(c, &m, &n, &err) < 0)
        return qmoectl_fail(&err);
    if (n == 0) {
        printf("no models loaded (load one with `qmoectl load NAME PATH`)\n");
        qm_client_models_free(m, n);
        return QMOECTL_OK;
    }
    static const char *const hdr[] = {"NAME",  "LAYERS", "EXPERTS", "K",         "HIDDEN",
                                      "INTER", "BITS",   "ACT",     "PER-EXPERT", "SIZE",
                                      "PATH"};
    char(*cb)[16] = calloc(n, sizeof *cb);
    if (cb)
        models_codebooks(c, m, n, cb);
    qmoectl_table *t = qmoectl_table_new(11, hdr);
    for (size_t i = 0; i < n; i++) {
        char pe[32], sz[32];
        qmoectl_table_cell(t, "%s", m[i].name ? m[i].name : "?");
        qmoectl_table_cell(t, "%llu", (unsigned long long)m[i].layers);
        qmoectl_table_cell(t, "%llu", (unsigned long long)m[i].experts);
        qmoectl_table_cell(t, "%llu", (unsigned long long)m[i].k);
        qmoectl_table_cell(t, "%llu", (unsigned long long)m[i].hidden_size);
        qmoectl_table_cell(t, "%llu", (unsigned long long)m[i].inter_size);
        /* BITS/BLOCK, and the code book after them ("4/32 e2m1"). */
        qmoectl_table_cell(t, "%llu/%llu%s%s", (unsigned long long)m[i].bits,
                           (unsigned long long)m[i].block_size, cb && cb[i][0] ? " " : "",
                           cb ? cb[i] : "");
        qmoectl_table_cell(t, "%s", m[i].activation ? m[i].activation : "?");
        qmoectl_table_cell(t, "%s", B(m[i].bytes_per_expert, pe));
        qmoectl_table_cell(t, "%s", B(m[i].bytes_total, sz));
        qmoectl_table_cell(t, "%s", m[i].path ? m[i].path : "?");
    }
    qmoectl_table_print(t, stdout);
    qmoectl_table_free(t);
    free(cb);
    qm_client_models_free(m, n);
    return QMOECTL_OK;
}

static int cmd_load(qm_client *c, const qmoectl_args *a)
{
    char path[4096];
    /* The daemon opens the file from its own working directory: send an absolute path. */
    const char *p = a->pos[1];
    if (p[0] != '/' && realpath(p, path))
        p = path;
    if (a->json) {
        char qn[1024], qp[8192], params[9300];
        if (qmoectl_json_quote(a->pos[0], qn, sizeof(qn)) < 0 ||
            qmoectl_json_quote(p, qp, sizeof(qp)) < 0)
            return qmoectl_usage_error("name or path too long");
        snprintf(params, sizeof(params), "{\"name\":%s,\"path\":%s}", qn, qp);
        return qmoectl_print_json(c, "model.load", params);
    }
    qm_client_model m;
    qm_client_error err;
    if (qm_client_model_load(c, a->pos[0], p, &m, &err) < 0)
        return qmoectl_fail(&err);
    char sz[32], pe[32];
    printf("loaded %s: %llu layers x %llu experts (k %llu), %s, %s per expert unit\n",
           m.name ? m.name : a->pos[0], (unsigned long long)m.layers,
           (unsigned long long)m.experts, (unsigned long long)m.k, B(m.bytes_total, sz),
           B(m.bytes_per_expert, pe));
    qm_client_model_free(&m);
    return QMOECTL_OK;
}

static int cmd_unload(qm_client *c, const qmoectl_args *a)
{
    int force = qmoectl_opt(a, "--force") != NULL;
    if (a->json) {
        char q[1024], params[1100];
        if (qmoectl_json_quote(a->pos[0], q, sizeof(q)) < 0)
            return qmoectl_usage_error("name too long");
        snprintf(params, sizeof(params), "{\"name\":%s%s}", q, force ? ",\"force\":true" : "");
        return qmoectl_print_json(c, "model.unload", params);
    }
    qm_client_error err;
    if (qm_client_model_unload(c, a->pos[0], force, &err) < 0) {
        qmoectl_fail(&err);
        if (err.code == -32009)
            fprintf(stderr, "qmoectl: close its sessions first, or unload with --force to close "
                            "them\n");
        return QMOECTL_FAILED;
    }
    printf("unloaded %s\n", a->pos[0]);
    return QMOECTL_OK;
}

/* ---------- sessions, create, close ---------- */

static int cmd_sessions(qm_client *c, const qmoectl_args *a)
{
    if (a->json)
        return qmoectl_print_json(c, "session.list", NULL);
    qm_client_session_info *s = NULL;
    size_t n = 0;
    qm_client_error err;
    if (qm_client_session_list(c, &s, &n, &err) < 0)
        return qmoectl_fail(&err);
    if (n == 0) {
        printf("no sessions (create one with `qmoectl create MODEL`)\n");
        qm_client_sessions_free(s, n);
        return QMOECTL_OK;
    }
    static const char *const hdr[] = {"SESSION", "MODEL", "POLICY", "OWNER", "BUDGET",
                                      "RESIDENT", "USE", "AGE", "STATE", "RECLAIM-IN"};
    qmoectl_table *t = qmoectl_table_new(10, hdr);
    time_t now = time(NULL);
    for (size_t i = 0; i < n; i++) {
        char bud[32], res[32], pct[16], age[32], left[32];
        qmoectl_table_cell(t, "%s", s[i].session ? s[i].session : "?");
        qmoectl_table_cell(t, "%s", s[i].model ? s[i].model : "?");
        qmoectl_table_cell(t, "%s", s[i].policy ? s[i].policy : "?");
        qmoectl_table_cell(t, "%llu", (unsigned long long)s[i].owner_uid);
        qmoectl_table_cell(t, "%s", B(s[i].budget_bytes, bud));
        qmoectl_table_cell(t, "%s", B(s[i].resident_bytes, res));
        qmoectl_table_cell(t, "%s", qmoectl_percent((double)s[i].resident_bytes,
                                                    (double)s[i].budget_bytes, pct, sizeof(pct)));
        qmoectl_table_cell(t, "%s", s[i].created_at > 0
                                        ? qmoectl_duration((double)now - s[i].created_at, age,
                                                           sizeof(age))
                                        : "-");
        /* Orphaned: no open connection holds it; reclaimed when the time is
         * up ("never" when the daemon's timeout is 0). */
        int orphaned = s[i].orphaned_since >= 0;
        qmoectl_table_cell(t, "%s", orphaned ? "orphaned" : "in use");
        qmoectl_table_cell(t, "%s", !orphaned ? "-"
                                    : s[i].reclaim_in_s < 0
                                        ? "never"
                                        : qmoectl_duration((double)s[i].reclaim_in_s, left,
                                                           sizeof(left)));
    }
    qmoectl_table_print(t, stdout);
    qmoectl_table_free(t);
    qm_client_sessions_free(s, n);
    return QMOECTL_OK;
}

/* A --param value goes in as JSON when it reads as JSON, else as a string. */
static int param_value_is_json(const char *v)
{
    if (!*v)
        return 0;
    if (strcmp(v, "true") == 0 || strcmp(v, "false") == 0 || strcmp(v, "null") == 0)
        return 1;
    if (*v == '[' || *v == '{' || *v == '"')
        return 1;
    char *end = NULL;
    strtod(v, &end);
    return end && *end == '\0';
}

static int build_policy_params(const qmoectl_args *a, char *out, size_t cap, int *any)
{
    size_t o = 0;
    *any = 0;
    out[o++] = '{';
    for (int i = 0; i < a->nopt; i++) {
        if (strcmp(a->opt_name[i], "--param") != 0)
            continue;
        const char *kv = a->opt_value[i];
        const char *eq = strchr(kv, '=');
        if (!eq || eq == kv)
            return qmoectl_usage_error("--param takes KEY=VALUE, not '%.64s'", kv);
        char key[128], qk[300], qv[8192];
        snprintf(key, sizeof(key), "%.*s", (int)(eq - kv), kv);
        if (qmoectl_json_quote(key, qk, sizeof(qk)) < 0)
            return qmoectl_usage_error("--param key too long");
        const char *val = eq + 1;
        if (!param_value_is_json(val)) {
            if (qmoectl_json_quote(val, qv, sizeof(qv)) < 0)
                return qmoectl_usage_error("--param value too long");
            val = qv;
        }
        int n = snprintf(out + o, cap - o, "%s%s:%s", *any ? "," : "", qk, val);
        if (n < 0 || (size_t)n >= cap - o)
            return qmoectl_usage_error("--param values too long");
        o += (size_t)n;
        *any = 1;
    }
    if (o + 2 > cap)
        return qmoectl_usage_error("--param values too long");
    out[o++] = '}';
    out[o] = '\0';
    return 0;
}

/* --budget BYTES|SIZE|N%|auto as the wire's text (into out[cap]): bytes,
 * "N%" of the model's expert bytes and "auto" as given (the daemon says
 * what they come to), a size (512MiB, 2G) as bytes. */
static int budget_text(const char *opt, const char *s, char *out, size_t cap)
{
    qm_budget_spec spec;
    qm_status st = {0};
    uint64_t v;
    if (qm_budget_parse(s, "budget", &spec, &st) == 0) {
        snprintf(out, cap, "%s", s);
        return 0;
    }
    if (qmoectl_parse_bytes(s, &v) == 0 && v > 0) {
        snprintf(out, cap, "%llu", (unsigned long long)v);
        return 0;
    }
    return qmoectl_usage_error("%s takes bytes (1073741824), a size (1GiB, 512M), a percentage "
                               "of the model's expert bytes (50%%, 0 < N <= 100) or auto, not "
                               "'%.32s'",
                               opt, s);
}

/* --pending SIZE (client_pending_bytes of session.create or session.resize)
 * into *out: a size or bytes, 0 allowed, and only beside the budget `b`
 * "auto" (create's --budget, resize's second argument), as the daemon has
 * it. */
static int pending_bytes(const qmoectl_args *a, const char *b, const char *what, uint64_t *out)
{
    const char *s = qmoectl_opt(a, "--pending");
    *out = 0;
    if (!s)
        return 0;
    if (qmoectl_parse_bytes(s, out) < 0 || *out > (1ull << 53))
        return qmoectl_usage_error("--pending takes bytes or a size (512M, 2GiB) up to 2^53, "
                                   "not '%.32s'",
                                   s);
    if (!b || strcmp(b, "auto") != 0)
        return qmoectl_usage_error("--pending needs %s auto: it is memory the auto budget leaves "
                                   "free for what the engine takes next",
                                   what);
    return 0;
}

/* "budget auto: 3.10 GB = cgroup limit ..." after a create or a resize to auto. */
static void print_budget_auto(const char *why)
{
    if (why)
        printf("%s\n", why);
}

static int cmd_create(qm_client *c, const qmoectl_args *a)
{
    char pp[16384];
    int any = 0, rc;
    char budget[32];
    const char *policy = qmoectl_opt(a, "--policy"), *bstr = qmoectl_opt(a, "--budget");
    const char *prec = qmoectl_opt(a, "--precision");
    if (prec && (rc = qmoectl_check_name("session.create", "precision", "--precision", prec)) != 0)
        return rc;
    if ((rc = build_policy_params(a, pp, sizeof(pp), &any)) != 0)
        return rc;
    if (bstr && (rc = budget_text("--budget", bstr, budget, sizeof budget)) != 0)
        return rc;
    uint64_t pending;
    if ((rc = pending_bytes(a, bstr, "--budget", &pending)) != 0)
        return rc;
    int has_pending = qmoectl_opt(a, "--pending") != NULL;
    if (a->json) {
        char qm[1024], qp[256], params[17000];
        if (qmoectl_json_quote(a->pos[0], qm, sizeof(qm)) < 0 ||
            (policy && qmoectl_json_quote(policy, qp, sizeof(qp)) < 0))
            return qmoectl_usage_error("model or policy name too long");
        int n = snprintf(params, sizeof(params), "{\"model\":%s", qm);
        if (policy)
            n += snprintf(params + n, sizeof(params) - (size_t)n, ",\"policy\":%s", qp);
        if (bstr)
            n += snprintf(params + n, sizeof(params) - (size_t)n, ",\"budget\":\"%s\"", budget);
        if (any)
            n += snprintf(params + n, sizeof(params) - (size_t)n, ",\"policy_params\":%s", pp);
        if (prec)
            n += snprintf(params + n, sizeof(params) - (size_t)n, ",\"precision\":\"%s\"", prec);
        if (has_pending)
            n += snprintf(params + n, sizeof(params) - (size_t)n, ",\"client_pending_bytes\":%llu",
                          (unsigned long long)pending);
        snprintf(params + n, sizeof(params) - (size_t)n, "}");
        return qmoectl_print_json(c, "session.create", params);
    }
    qm_client_session_params sp = {.model = a->pos[0],
                                   .policy = policy,
                                   .budget = bstr ? budget : NULL,
                                   .policy_params_json = any ? pp : NULL,
                                   .precision = prec,
                                   .client_pending_bytes = pending};
    char *id = NULL;
    qm_client_plan_summary sum;
    qm_client_error err;
    if (qm_client_session_create(c, &sp, &id, &sum, &err) < 0)
        return qmoectl_fail(&err);
    /* The session is the user's, not this process's: it stays when qmoectl
     * exits (then orphaned; docs/OPERATIONS.md "Orphaned sessions"). */
    qm_client_session_detach(c, id, NULL);
    char bud[32], ws[32];
    printf("%s\n", id);
    printf("policy %s, budget %s, workspace %s; %llu banks: %llu whole-bank resident, %llu "
           "per-expert, %llu degraded\n",
           sum.policy ? sum.policy : (policy ? policy : qm_policy_default_name()),
           B(sum.budget_bytes, bud),
           B(sum.workspace_bytes, ws), (unsigned long long)sum.total,
           (unsigned long long)sum.resident,
           (unsigned long long)(sum.total - sum.resident - sum.degraded),
           (unsigned long long)sum.degraded);
    print_budget_auto(sum.budget_auto);
    printf("inspect it with `qmoectl plan %s`\n", id);
    qm_client_string_free(id);
    qm_client_plan_summary_free(&sum);
    return QMOECTL_OK;
}

static int cmd_resize(qm_client *c, const qmoectl_args *a)
{
    qm_client_error err;
    char budget[32];
    int rc = budget_text("the budget", a->pos[1], budget, sizeof budget);
    if (rc != 0)
        return rc;
    uint64_t pending;
    if ((rc = pending_bytes(a, budget, "the budget", &pending)) != 0)
        return rc;
    int has_pending = qmoectl_opt(a, "--pending") != NULL;
    if (a->json) {
        char q[1024], params[1300];
        if (qmoectl_json_quote(a->pos[0], q, sizeof(q)) < 0)
            return qmoectl_usage_error("session id too long");
        int n = snprintf(params, sizeof(params), "{\"session\":%s,\"budget\":\"%s\"", q, budget);
        if (has_pending)
            n += snprintf(params + n, sizeof(params) - (size_t)n, ",\"client_pending_bytes\":%llu",
                          (unsigned long long)pending);
        snprintf(params + n, sizeof(params) - (size_t)n, "}");
        return qmoectl_print_json(c, "session.resize", params);
    }
    uint64_t resident = 0;
    qm_client_plan_summary sum;
    if ((has_pending ? qm_client_session_resize_auto(c, a->pos[0], pending, &resident, &sum, &err)
                     : qm_client_session_resize_to(c, a->pos[0], budget, &resident, &sum, &err)) <
        0)
        return qmoectl_fail(&err);
    char bud[32], res[32];
    printf("resized %s: budget %s, resident %s", a->pos[0], B(sum.budget_bytes, bud),
           B(resident, res));
    if (sum.pins_released)
        printf(", %llu pins released", (unsigned long long)sum.pins_released);
    printf("\n");
    print_budget_auto(sum.budget_auto);
    qm_client_plan_summary_free(&sum);
    return QMOECTL_OK;
}

static int cmd_close(qm_client *c, const qmoectl_args *a)
{
    if (a->json)
        return qmoectl_print_json_session(c, "session.close", a->pos[0]);
    qm_client_error err;
    if (qm_client_session_close(c, a->pos[0], &err) < 0)
        return qmoectl_fail(&err);
    printf("closed %s\n", a->pos[0]);
    return QMOECTL_OK;
}

/* ---------- trace, metrics, shutdown ---------- */

static int cmd_trace(qm_client *c, const qmoectl_args *a)
{
    const char *lim = qmoectl_opt(a, "--limit"), *session = qmoectl_opt(a, "--session");
    unsigned long long limit = 0;
    if (lim) {
        char *end = NULL;
        limit = strtoull(lim, &end, 10);
        if (end == lim || *end || limit == 0 || lim[0] == '-')
            return qmoectl_usage_error("--limit takes a positive number, not '%.32s'", lim);
    }
    if (a->json) {
        char params[1200] = "{", q[1024];
        size_t n = 1;
        if (session) {
            if (qmoectl_json_quote(session, q, sizeof(q)) < 0)
                return qmoectl_usage_error("session id too long");
            n += (size_t)snprintf(params + n, sizeof(params) - n, "\"session\":%s", q);
        }
        if (lim)
            n += (size_t)snprintf(params + n, sizeof(params) - n, "%s\"limit\":%llu",
                                  session ? "," : "", limit);
        snprintf(params + n, sizeof(params) - n, "}");
        return qmoectl_print_json(c, "telemetry.trace", params);
    }
    qm_client_span *s = NULL;
    size_t n = 0;
    qm_client_error err;
    if (qm_client_telemetry_trace(c, session, limit, &s, &n, &err) < 0)
        return qmoectl_fail(&err);
    if (n == 0) {
        printf("no spans recorded\n");
        qm_client_spans_free(s, n);
        return QMOECTL_OK;
    }
    static const char *const hdr[] = {"AT", "DURATION", "NAME", "SESSION", "ARGS"};
    qmoectl_table *t = qmoectl_table_new(5, hdr);
    double t0 = s[0].start_us;
    for (size_t i = 0; i < n; i++) {
        char at[32], dur[32];
        qmoectl_table_cell(t, "+%s", qmoectl_micros(s[i].start_us - t0, at, sizeof(at)));
        qmoectl_table_cell(t, "%s", qmoectl_micros(s[i].dur_us, dur, sizeof(dur)));
        qmoectl_table_cell(t, "%s", s[i].name ? s[i].name : "?");
        qmoectl_table_cell(t, "%s", s[i].session ? s[i].session : "-");
        qmoectl_table_cell(t, "%s", s[i].args_json ? s[i].args_json : "");
    }
    qmoectl_table_print(t, stdout);
    qmoectl_table_free(t);
    qm_client_spans_free(s, n);
    return QMOECTL_OK;
}

static int cmd_metrics(qm_client *c, const qmoectl_args *a)
{
    if (a->json)
        return qmoectl_print_json(c, "telemetry.metrics", NULL);
    char *text = NULL;
    qm_client_error err;
    if (qm_client_telemetry_metrics(c, &text, &err) < 0)
        return qmoectl_fail(&err);
    size_t n = strlen(text);
    fputs(text, stdout);
    if (n && text[n - 1] != '\n')
        fputs("\n", stdout);
    qm_client_string_free(text);
    return QMOECTL_OK;
}

static int cmd_shutdown(qm_client *c, const qmoectl_args *a)
{
    if (a->json)
        return qmoectl_print_json(c, "daemon.shutdown", NULL);
    qm_client_error err;
    if (qm_client_daemon_shutdown(c, &err) < 0)
        return qmoectl_fail(&err);
    printf("qmoed is draining: it answers what it accepted, then exits\n");
    return QMOECTL_OK;
}

/* ---------- infer ---------- */

static int cmd_infer(qm_client *c, const qmoectl_args *a)
{
    const char *layer_s = qmoectl_opt(a, "--layer"), *hid = qmoectl_opt(a, "--hidden"),
               *logits = qmoectl_opt(a, "--logits"), *outp = qmoectl_opt(a, "--out");
    const char *ids_p = qmoectl_opt(a, "--topk-ids"), *wts_p = qmoectl_opt(a, "--topk-weights");
    int routing = qmoectl_opt(a, "--routing") != NULL;
    if (!layer_s || !hid || !outp)
        return qmoectl_usage_error("infer needs --layer N, --hidden X.npy and --out Y.npy");
    char *end = NULL;
    unsigned long long layer = strtoull(layer_s, &end, 10);
    if (end == layer_s || *end || layer_s[0] == '-')
        return qmoectl_usage_error("--layer takes a layer index, not '%.32s'", layer_s);
    qm_client_tensor h = {0}, r = {0}, ids = {0}, wts = {0};
    char msg[512];
    int rc = QMOECTL_FAILED;
    qm_client_infer_result res;
    qm_client_error err;
    if (qmoectl_npy_read(hid, &h, msg, sizeof(msg)) < 0 ||
        (logits && qmoectl_npy_read(logits, &r, msg, sizeof(msg)) < 0) ||
        (ids_p && qmoectl_npy_read(ids_p, &ids, msg, sizeof(msg)) < 0) ||
        (wts_p && qmoectl_npy_read(wts_p, &wts, msg, sizeof(msg)) < 0)) {
        rc = qmoectl_error("%s", msg);
        goto out;
    }
    if (ids_p && ids.dtype != QM_CLIENT_I32) {
        rc = qmoectl_usage_error("--topk-ids takes an int32 array ('<i4'), not %s", ids_p);
        goto out;
    }
    int irc = ids_p ? qm_client_session_infer_routed(c, a->pos[0], layer, &h, &ids, &wts,
                                                     routing, &res, &err)
                    : qm_client_session_infer(c, a->pos[0], layer, &h, logits ? &r : NULL,
                                              routing, &res, &err);
    if (irc < 0) {
        rc = qmoectl_fail(&err);
        goto out;
    }
    if (qmoectl_npy_write(outp, &res.output, msg, sizeof(msg)) < 0) {
        rc = qmoectl_error("%s", msg);
        goto out_res;
    }
    char shape[128] = "";
    size_t o = 0;
    for (int i = 0; i < res.output.ndim && o < sizeof(shape); i++)
        o += (size_t)snprintf(shape + o, sizeof(shape) - o, "%s%llu", i ? "," : "",
                              (unsigned long long)res.output.shape[i]);
    static const char *dn[] = {"f32", "f16", "bf16", "i32"};
    if (a->json) {
        /* The raw result, with the output tensor's data replaced by the file it went to. */
        char qo[4200];
        qmoectl_json_quote(outp, qo, sizeof(qo));
        printf("{\n  \"output\": {\"dtype\": \"%s\", \"shape\": [%s], \"path\": %s},\n",
               dn[res.output.dtype], shape, qo);
        printf("  \"stats\": {\"hits\": %llu, \"misses\": %llu, \"bytes_paged\": %llu, "
               "\"queue_us\": %llu, \"compute_us\": %llu}",
               (unsigned long long)res.stats.hits, (unsigned long long)res.stats.misses,
               (unsigned long long)res.stats.bytes_paged, (unsigned long long)res.stats.queue_us,
               (unsigned long long)res.stats.compute_us);
        if (res.routing_offsets) {
            printf(",\n  \"routing\": [");
            for (size_t t = 0; t < res.routing_tokens; t++) {
                printf("%s[", t ? ", " : "");
                for (size_t j = res.routing_offsets[t]; j < res.routing_offsets[t + 1]; j++)
                    printf("%s[%u, %.9g]", j > res.routing_offsets[t] ? ", " : "",
                           res.routing_experts[j], res.routing_weights[j]);
                printf("]");
            }
            printf("]");
        }
        printf("\n}\n");
    } else {
        char paged[32], q[32], cu[32];
        printf("wrote %s: %s [%s]\n", outp, dn[res.output.dtype], shape);
        printf("experts %llu hits, %llu misses; paged %s; queue %s, compute %s\n",
               (unsigned long long)res.stats.hits, (unsigned long long)res.stats.misses,
               B(res.stats.bytes_paged, paged),
               qmoectl_micros((double)res.stats.queue_us, q, sizeof(q)),
               qmoectl_micros((double)res.stats.compute_us, cu, sizeof(cu)));
        for (size_t t = 0; res.routing_offsets && t < res.routing_tokens; t++) {
            printf("token %zu:", t);
            for (size_t j = res.routing_offsets[t]; j < res.routing_offsets[t + 1]; j++)
                printf(" %u (%.3f)", res.routing_experts[j], res.routing_weights[j]);
            printf("\n");
        }
    }
    rc = QMOECTL_OK;
out_res:
    qm_client_infer_result_free(&res);
out:
    qmoectl_npy_free(&h);
    qmoectl_npy_free(&r);
    qmoectl_npy_free(&ids);
    qmoectl_npy_free(&wts);
    return rc;
}

/* ---------- usage checks, before any connection ---------- */

/* create --help: the policies session.create offers, from the residency
 * registry this qmoectl was built with (the daemon's), each with its
 * summary wrapped under its name. */
static void help_policies(FILE *out)
{
    fprintf(out, "\nPolicies:\n");
    for (size_t i = 0; i < qm_policy_count(); i++) {
        if (!qm_policy_offered_at(i))
            continue;
        const char *text = qm_policy_summary_at(i);
        fprintf(out, "  %-13s", qm_policy_name_at(i));
        size_t col = 15, indent = 15, width = 79;
        while (*text) {
            size_t word = strcspn(text, " ");
            if (col > indent && col + 1 + word > width) {
                fprintf(out, "\n%*s", (int)indent, "");
                col = indent;
            } else if (col > indent) {
                fputc(' ', out);
                col++;
            }
            fprintf(out, "%.*s", (int)word, text);
            col += word;
            text += word;
            text += strspn(text, " ");
        }
        fputc('\n', out);
    }
}

static int check_create(const qmoectl_args *a)
{
    char pp[16384];
    int any = 0, rc;
    if ((rc = build_policy_params(a, pp, sizeof(pp), &any)) != 0)
        return rc;
    const char *b = qmoectl_opt(a, "--budget");
    char text[32];
    uint64_t pending;
    if (b && (rc = budget_text("--budget", b, text, sizeof text)) != 0)
        return rc;
    return pending_bytes(a, b, "--budget", &pending);
}

static int check_resize(const qmoectl_args *a)
{
    uint64_t pending;
    return pending_bytes(a, a->pos[1], "the budget", &pending);
}

static int check_trace(const qmoectl_args *a)
{
    const char *lim = qmoectl_opt(a, "--limit");
    char *end = NULL;
    if (lim && (strtoull(lim, &end, 10) == 0 || end == lim || *end || lim[0] == '-'))
        return qmoectl_usage_error("--limit takes a positive number, not '%.32s'", lim);
    return 0;
}

static int check_infer(const qmoectl_args *a)
{
    const char *layer_s = qmoectl_opt(a, "--layer");
    char *end = NULL;
    if (!layer_s || !qmoectl_opt(a, "--hidden") || !qmoectl_opt(a, "--out"))
        return qmoectl_usage_error("infer needs --layer N, --hidden X.npy and --out Y.npy");
    if (!qmoectl_opt(a, "--topk-ids") != !qmoectl_opt(a, "--topk-weights"))
        return qmoectl_usage_error("--topk-ids and --topk-weights go together");
    if (qmoectl_opt(a, "--topk-ids") && qmoectl_opt(a, "--logits"))
        return qmoectl_usage_error("--logits cannot be combined with --topk-ids/--topk-weights");
    strtoull(layer_s, &end, 10);
    if (end == layer_s || *end || layer_s[0] == '-')
        return qmoectl_usage_error("--layer takes a layer index, not '%.32s'", layer_s);
    return 0;
}

const qmoectl_cmd qmoectl_cmds[] = {
    {"status", "", "Show the daemon's version, uptime, backend, memory and counts.", "", 0, 0,
     cmd_status, NULL, NULL, NULL},
    {"models", "", "List loaded models: shape, quantisation, bytes per expert unit, size.", "",
     0, 0, cmd_models, NULL, NULL, NULL},
    {"load", "NAME PATH",
     "Load the bank file PATH as model NAME (admin). A relative PATH is made absolute.", "", 2, 2,
     cmd_load, NULL, NULL, NULL},
    {"unload", "NAME [--force]",
     "Unload model NAME (admin).\n"
     "Refused while sessions use it, unless --force closes them.",
     "--force", 1, 1, cmd_unload, NULL, NULL, NULL},
    {"sessions", "", "List sessions (a non-admin sees only their own).", "", 0, 0, cmd_sessions, NULL, NULL, NULL},
    {"create",
     "MODEL [--policy P] [--budget BYTES|SIZE|N%|auto [--pending SIZE]] [--param KEY=VALUE]... "
     "[--precision P]",
     "Create a session on MODEL and print its id on the first line.\n"
     "  --policy P        the session's residency policy, one of those below (for a\n"
     "                    paged session, the budget below the model, the one marked\n"
     "                    recommended; measured in docs/BENCHMARKS.md)\n"
     "  --budget B        expert bytes the session may keep resident: bytes, a size\n"
     "                    (512MiB, 2G), a percentage of the model's bytes (50%), or\n"
     "                    auto: what this machine and qmoed's memory cgroup can give,\n"
     "                    less auto_budget_reserve; it shrinks under memory pressure\n"
     "                    and grows back (docs/OPERATIONS.md)\n"
     "  --pending SIZE    with --budget auto: memory the engine takes after the\n"
     "                    session is made (buffers, mapped weights not yet read), left\n"
     "                    free beside the reserve (client_pending_bytes)\n"
     "  --param KEY=VALUE a policy parameter; VALUE is JSON when it reads as JSON\n"
     "                    (prefetch=false, pin_fraction=0.25, hot='[{\"layer\":0,\"experts\":[3,1]}]'),\n"
     "                    else a string; repeatable\n"
     "  --precision P     exact (default: f32, within 1e-5 of onnxruntime) or fast\n"
     "                    (int8 activations, integer dot products)",
     "--policy= --budget= --pending= --param= --precision=", 1, 1, cmd_create, check_create,
     help_policies, NULL},
    {"close", "SESSION", "Close a session and release its memory (owner or admin).", "", 1, 1,
     cmd_close, NULL, NULL, NULL},
    {"resize", "SESSION BYTES|SIZE|N%|auto [--pending SIZE]",
     "Change a live session's expert budget (owner or admin).\n"
     "The budget is bytes, a size (512MiB, 2G), a percentage of the model's bytes\n"
     "(40%) or auto (sized again from the memory free now; bytes or a percentage end\n"
     "auto). Shrinking evicts down to it before answering (pins that no longer fit\n"
     "are released, coldest first); growing is admitted against the daemon-wide\n"
     "budget. Requests queued before it finish under the old budget.\n"
     "  --pending SIZE    with auto: memory the engine takes after the resize (a\n"
     "                    longer context's KV cache), left free beside the reserve\n"
     "                    (client_pending_bytes)",
     "--pending=", 2, 2, cmd_resize, check_resize, NULL, NULL},
    {"plan", "SESSION",
     "Show a session's residency plan, one row per bank.\n"
     "Each row: the bank's decision, the reason a bank stays whole, and counts and\n"
     "sizes of candidate, pinned and currently resident experts; then totals\n"
     "against the budget.",
     "", 1, 1, qmoectl_cmd_plan, NULL, NULL, NULL},
    {"telemetry", "[SESSION] [--watch SECONDS [--count N]]",
     "Show counters: hit rate, bytes paged, p50/p99 latency, ...\n"
     "Requests, errors, tokens, expert hit rate and misses, bytes paged, evictions,\n"
     "prefetches (useful/issued), resident bytes, p50/p99 inference latency;\n"
     "daemon-wide and per session; then each session's prefetch predictors\n"
     "(router, history, lookahead): predicted, precision, recall, gated calls.\n"
     "  --watch S   refresh every S seconds until Ctrl-C\n"
     "  --count N   stop after N refreshes",
     "--watch= --count=", 0, 1, qmoectl_cmd_telemetry, qmoectl_check_telemetry, NULL, NULL},
    {"trace", "[--limit N] [--session SESSION]",
     "Show recent trace spans, oldest first (admin).\n"
     "  --limit N         at most N spans\n"
     "  --session SESSION only that session's spans",
     "--limit= --session=", 0, 0, cmd_trace, check_trace, NULL, NULL},
    {"metrics", "", "Print Prometheus metrics (text exposition format).", "", 0, 0, cmd_metrics, NULL, NULL, NULL},
    {"infer",
     "SESSION --layer N --hidden X.npy [--logits R.npy | --topk-ids I.npy --topk-weights W.npy] "
     "--out Y.npy [--routing]",
     "Run one MoE layer on a session.\n"
     "Hidden states come from X.npy ([T, H], f32 or f16), optional router logits\n"
     "from R.npy ([T, E]); the output goes to Y.npy.\n"
     "  --topk-ids I.npy, --topk-weights W.npy\n"
     "              routing chosen by the engine: int32 expert ids [T, k'] (-1 = no\n"
     "              route) and their weights (f32/f16), used exactly as given\n"
     "  --routing   also print the experts and weights chosen per token",
     "--layer= --hidden= --logits= --topk-ids= --topk-weights= --out= --routing", 1, 1, cmd_infer,
     check_infer, NULL, NULL},
    {"shutdown", "", "Drain and stop the daemon (admin), as SIGTERM does.", "", 0, 0,
     cmd_shutdown, NULL, NULL, NULL},
    {"methods", "[METHOD] [--markdown]",
     "List the wire's methods, or what METHOD takes (no daemon needed).\n"
     "Every member with its type, whether it is required and what it means, from\n"
     "the rows the daemon decodes with (protocol/qm_wire_schema.h).\n"
     "  --markdown  METHOD's table as docs/PROTOCOL.md carries it\n"
     "  --json      every method's rows as JSON",
     "--markdown", 0, 1, NULL, NULL, NULL, qmoectl_cmd_methods},
    {"call", "METHOD [MEMBER=VALUE]...",
     "Call any method and print its result as JSON.\n"
     "A member typed as a string in the method's rows (see qmoectl methods METHOD)\n"
     "is sent as that string; any other value is JSON as written\n"
     "(budget_bytes=1048576, force=true, policy_params='{\"prefetch\":false}').",
     "", 1, QMOECTL_MAX_ARGS, qmoectl_cmd_call, qmoectl_check_call, NULL, NULL},
    {NULL, NULL, NULL, NULL, 0, 0, NULL, NULL, NULL, NULL},
};
