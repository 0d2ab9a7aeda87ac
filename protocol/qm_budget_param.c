/* qm_budget_param.c - a session's budget on the wire (session.create,
 * session.resize; PROTOCOL.md): `budget` as bytes, "N%" of the model's
 * expert bytes or "auto", or `budget_bytes` as bytes (the older member),
 * one of the two (the rows of QM_PARAMS_BUDGET, qm_wire_schema.h). What
 * "N%" and "auto" come to is the daemon's to say (daemon/qm_budget.h): it
 * knows the model and the machine. */
#include "qm_rpc_impl.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SAFE_INT 9007199254740992.0 /* 2^53, as the other integer members */

static int refuse(qm_status *st, const char *field, const char *got)
{
    char clip[48];
    qm_clip(got, strlen(got), clip, sizeof clip);
    return qm_status_set_field(st, QM_EINVAL, field, "%s: %s; got \"%s\"", field,
                               QM_BUDGET_RULE, clip);
}

int qm_budget_parse(const char *text, const char *field, qm_budget_spec *out, qm_status *st)
{
    memset(out, 0, sizeof *out);
    size_t n = strlen(text);
    if (strcmp(text, "auto") == 0) {
        out->form = QM_BUDGET_AUTO;
        return 0;
    }
    if (n > 1 && text[n - 1] == '%') {
        /* Digits and one point only: strtod alone would take " 5", "0x10", "inf". */
        size_t digits = strspn(text, "0123456789.");
        char *end = NULL;
        errno = 0;
        double pct = digits == n - 1 && text[0] != '.' ? strtod(text, &end) : NAN;
        if (errno || end != text + n - 1 || !(pct > 0) || pct > 100)
            return refuse(st, field, text);
        out->form = QM_BUDGET_PERCENT;
        out->percent = pct;
        return 0;
    }
    if (n == 0 || n > 19 || strspn(text, "0123456789") != n)
        return refuse(st, field, text);
    unsigned long long v = strtoull(text, NULL, 10);
    if (v == 0)
        return refuse(st, field, text);
    out->form = QM_BUDGET_BYTES;
    out->bytes = v;
    return 0;
}

uint64_t qm_budget_percent_of(double percent, uint64_t total)
{
    double b = floor((double)total * percent / 100.0);
    if (!(b >= 1))
        return 1;
    return b >= (double)total ? total : (uint64_t)b;
}

int qm__decode_budget(const cJSON *v, qm_params *out, qm_status *st)
{
    if (cJSON_IsString(v))
        return qm_budget_parse(v->valuestring, "budget", &out->budget, st);
    if (!cJSON_IsNumber(v))
        return qm_status_set_field(st, QM_EINVAL, "budget", "budget: %s; got %s",
                                   QM_BUDGET_RULE, qm__json_type_name(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d) || d < 1 || d > MAX_SAFE_INT)
        return qm_status_set_field(st, QM_EINVAL, "budget",
                                   "budget: %s; got %.17g (bytes are a whole number from 1 "
                                   "to 2^53)",
                                   QM_BUDGET_RULE, d);
    out->budget.form = QM_BUDGET_BYTES;
    out->budget.bytes = (uint64_t)d;
    return 0;
}

/* After both members: the one given lands in budget and budget_bytes. */
static int check_budget(qm_params *out, int required, qm_status *st)
{
    if (out->has_budget && out->has_budget_bytes)
        return qm_status_set_field(st, QM_EINVAL, "budget",
                                   "budget and budget_bytes are two ways of giving one budget; "
                                   "give one of them");
    if (out->has_budget_bytes) {
        out->budget = (qm_budget_spec){.form = QM_BUDGET_BYTES, .bytes = out->budget_bytes};
        out->has_budget = 1;
    } else if (out->has_budget) {
        out->budget_bytes = out->budget.form == QM_BUDGET_BYTES ? out->budget.bytes : 0;
    } else if (required) { /* the field older clients know */
        return qm_status_set_field(st, QM_EINVAL, "budget_bytes",
                                   "budget_bytes is required (or budget: bytes, \"N%%\" of the "
                                   "model's expert bytes, or \"auto\")");
    }
    return 0;
}

int qm__check_budget0(const cJSON *v, qm_params *out, qm_status *st)
{
    (void)v;
    return check_budget(out, 0, st);
}

int qm__check_budget1(const cJSON *v, qm_params *out, qm_status *st)
{
    (void)v;
    return check_budget(out, 1, st);
}
