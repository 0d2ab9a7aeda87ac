/* qmoectl.c - the operator's CLI for qmoed: argument parsing, help, errors.
 * The subcommands themselves live in qmoectl_cmds.c.
 *
 * Exit status: 0 success, 1 the request failed (message on stderr as
 * "qmoectl: <reason>"), 2 usage error. */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "qmoectl.h"

static const char qmoectl_global_help[] =
    "Usage: qmoectl [--socket PATH] [--json] [--timeout SECONDS] COMMAND [ARGS]\n"
    "\n"
    "Inspect and control qmoed, the MoE expert-residency daemon.\n"
    "\n"
    "Commands:\n"
    "%s"
    "\n"
    "Global options (before or after the command):\n"
    "  --socket PATH      daemon socket (default: $QMOED_SOCKET, $RUNTIME_DIRECTORY/qmoed.sock,\n"
    "                     /run/qmoed/qmoed.sock as root, else $XDG_RUNTIME_DIR/qmoed.sock\n"
    "                     when present, else /run/qmoed/qmoed.sock)\n"
    "  --json             print the daemon's raw result as JSON\n"
    "  --timeout SECONDS  how long to wait for an answer (default 30)\n"
    "  -h, --help         this text; `qmoectl COMMAND --help` explains one command\n"
    "  --version          print the version\n"
    "\n"
    "Exit status: 0 success, 1 the request failed, 2 usage error.\n";

const char *qmoectl_opt(const qmoectl_args *a, const char *name)
{
    const char *v = NULL;
    for (int i = 0; i < a->nopt; i++)
        if (strcmp(a->opt_name[i], name) == 0)
            v = a->opt_value[i] ? a->opt_value[i] : "";
    return v;
}

int qmoectl_error(const char *fmt, ...)
{
    va_list ap;
    fputs("qmoectl: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputs("\n", stderr);
    return QMOECTL_FAILED;
}

int qmoectl_fail(const qm_client_error *err)
{
    const char *hint = "";
    if (err->code == -32002)
        hint = " (this needs an admin: root, qmoed's own user, or a member of its admin group)";
    else if (err->code == -32004)
        hint = " (the daemon is busy; retry shortly)";
    else if (err->code == QM_CLIENT_ETIMEDOUT)
        hint = " (raise --timeout for long requests)";
    if (err->field[0])
        fprintf(stderr, "qmoectl: %s [%s: %s]%s\n", err->reason, err->name, err->field, hint);
    else if (err->code <= -32000)
        fprintf(stderr, "qmoectl: %s [%s]%s\n", err->reason, err->name, hint);
    else
        fprintf(stderr, "qmoectl: %s%s\n", err->reason, hint);
    return QMOECTL_FAILED;
}

int qmoectl_print_json(qm_client *c, const char *method, const char *params_json)
{
    qm_client_error err;
    char *out = NULL;
    if (qm_client_call_json(c, method, params_json, 1, &out, &err) < 0)
        return qmoectl_fail(&err);
    printf("%s\n", out);
    qm_client_string_free(out);
    return QMOECTL_OK;
}

int qmoectl_print_json_session(qm_client *c, const char *method, const char *session)
{
    char params[1100];
    if (session && qmoectl_one_param(params, sizeof(params), "session", session) < 0)
        return qmoectl_usage_error("session id too long");
    return qmoectl_print_json(c, method, session ? params : NULL);
}

static const qmoectl_cmd *qmoectl_find(const char *name)
{
    for (const qmoectl_cmd *c = qmoectl_cmds; c->name; c++)
        if (strcmp(c->name, name) == 0)
            return c;
    return NULL;
}

static void qmoectl_print_help(FILE *out)
{
    char list[4096] = "";
    size_t o = 0;
    for (const qmoectl_cmd *c = qmoectl_cmds; c->name && o < sizeof(list); c++) {
        const char *nl = strchr(c->help, '\n');
        int first = nl ? (int)(nl - c->help) : (int)strlen(c->help);
        o += (size_t)snprintf(list + o, sizeof(list) - o, "  %-10s %.*s\n", c->name, first,
                              c->help);
    }
    fprintf(out, qmoectl_global_help, list);
}

static void qmoectl_print_cmd_help(const qmoectl_cmd *c)
{
    printf("Usage: qmoectl [global options] %s%s%s\n\n%s\n", c->name, c->synopsis[0] ? " " : "",
           c->synopsis, c->help);
    if (c->more_help)
        c->more_help(stdout);
    printf("\nGlobal options: --socket PATH, --json, --timeout SECONDS (see qmoectl --help).\n");
}

/* Does `cmd` take option `name`, and does it need a value? -1 if unknown. */
static int qmoectl_option_kind(const qmoectl_cmd *cmd, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = cmd->options; p && *p;) {
        const char *end = strchr(p, ' ');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        int takes = len > 0 && p[len - 1] == '=';
        if ((takes ? len - 1 : len) == n && strncmp(p, name, n) == 0)
            return takes;
        p += len;
        while (*p == ' ')
            p++;
    }
    return -1;
}

static int qmoectl_parse_timeout(const char *s, int *ms)
{
    char *end = NULL;
    double v = strtod(s, &end);
    if (end == s || *end || !(v > 0) || v > 86400)
        return -1;
    *ms = (int)(v * 1000 + 0.5);
    if (*ms < 1)
        *ms = 1;
    return 0;
}

int main(int argc, char **argv)
{
    qmoectl_args a = {0};
    const qmoectl_cmd *cmd = NULL;
    int want_help = 0, only_pos = 0;
    a.timeout_ms = 30000;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const char *eq = NULL;
        char name[64];
        if (!only_pos && strcmp(arg, "--") == 0) {
            only_pos = 1;
            continue;
        }
        if (only_pos || arg[0] != '-' || arg[1] == '\0') {
            if (!cmd) {
                if (strcmp(arg, "help") == 0 && i + 1 < argc && !cmd) {
                    cmd = qmoectl_find(argv[i + 1]);
                    if (!cmd)
                        return qmoectl_usage_error("unknown command '%.64s'; see qmoectl --help",
                                                   argv[i + 1]);
                    qmoectl_print_cmd_help(cmd);
                    return QMOECTL_OK;
                }
                cmd = qmoectl_find(arg);
                if (!cmd)
                    return qmoectl_usage_error("unknown command '%.64s'; see qmoectl --help", arg);
                continue;
            }
            if (a.npos >= QMOECTL_MAX_ARGS)
                return qmoectl_usage_error("too many arguments");
            a.pos[a.npos++] = arg;
            continue;
        }
        eq = strchr(arg, '=');
        snprintf(name, sizeof(name), "%.*s", eq ? (int)(eq - arg) : (int)strlen(arg), arg);
        const char *value = eq ? eq + 1 : NULL;
        if (strcmp(name, "-h") == 0 || strcmp(name, "--help") == 0) {
            want_help = 1;
        } else if (strcmp(name, "--version") == 0) {
            printf("qmoectl %s\n", QM_CLIENT_VERSION);
            return QMOECTL_OK;
        } else if (strcmp(name, "--json") == 0) {
            a.json = 1;
        } else if (strcmp(name, "--socket") == 0 || strcmp(name, "--timeout") == 0) {
            if (!value && i + 1 < argc)
                value = argv[++i];
            if (!value)
                return qmoectl_usage_error("%s needs a value", name);
            if (name[2] == 's')
                a.socket = value;
            else if (qmoectl_parse_timeout(value, &a.timeout_ms) < 0)
                return qmoectl_usage_error("--timeout takes seconds (> 0), not '%.32s'", value);
        } else if (cmd) {
            int kind = qmoectl_option_kind(cmd, name);
            if (kind < 0)
                return qmoectl_usage_error("%s does not take %s; see qmoectl %s --help",
                                           cmd->name, name, cmd->name);
            if (kind && !value && i + 1 < argc)
                value = argv[++i];
            if (kind && !value)
                return qmoectl_usage_error("%s needs a value", name);
            if (!kind && value)
                return qmoectl_usage_error("%s takes no value", name);
            if (a.nopt >= QMOECTL_MAX_ARGS)
                return qmoectl_usage_error("too many options");
            a.opt_name[a.nopt] = arg[1] == '-' && eq ? strndup(arg, (size_t)(eq - arg)) : arg;
            a.opt_value[a.nopt++] = value;
        } else {
            return qmoectl_usage_error("unknown option '%.64s'; see qmoectl --help", arg);
        }
    }
    if (want_help) {
        if (cmd)
            qmoectl_print_cmd_help(cmd);
        else
            qmoectl_print_help(stdout);
        return QMOECTL_OK;
    }
    if (!cmd) {
        qmoectl_print_help(stderr);
        return QMOECTL_USAGE;
    }
    if (a.npos < cmd->min_pos || a.npos > cmd->max_pos)
        return qmoectl_usage_error("usage: qmoectl %s %s", cmd->name, cmd->synopsis);

    if (cmd->check) {
        int crc = cmd->check(&a);
        if (crc != 0)
            return crc;
    }
    if (cmd->run_local)
        return cmd->run_local(&a);
    qm_client *c = NULL;
    qm_client_error err;
    if (qm_client_open(&c, a.socket, a.timeout_ms, &err) < 0)
        return qmoectl_fail(&err);
    int rc = cmd->run(c, &a);
    qm_client_close(c);
    if (fflush(stdout) != 0 && rc == QMOECTL_OK)
        rc = QMOECTL_FAILED;
    return rc;
}
