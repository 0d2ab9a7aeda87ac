#include "qm_error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* One row per code: its name and its text. */
static const struct {
    int code;
    const char *name, *text;
} errors[] = {
    {QM_OK, "OK", "ok"},
#define QM__ERR_ROW(name, value, text, rpc) {QM_E##name, #name, text},
    QM_ERRNO_MAP(QM__ERR_ROW)
#undef QM__ERR_ROW
};

/* The index of `code`'s row, or -1. */
static int error_row(int code)
{
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == code) return (int)i;
    return -1;
}

const char *qm_strerror(int code)
{
    int i = error_row(code);
    return i < 0 ? "unknown error" : errors[i].text;
}

const char *qm_err_name(int code)
{
    int i = error_row(code);
    return i < 0 ? "UNKNOWN" : errors[i].name;
}

void qm_status_clear(qm_status *st)
{
    if (!st)
        return;
    st->code = 0;
    st->msg[0] = '\0';
    st->field[0] = '\0';
}

static int status_vset(qm_status *st, int code, const char *field, const char *fmt, va_list ap)
{
    if (!st)
        return code;
    st->code = code;
    vsnprintf(st->msg, sizeof st->msg, fmt, ap);
    snprintf(st->field, sizeof st->field, "%s", field ? field : "");
    return code;
}

int qm_status_set(qm_status *st, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    status_vset(st, code, NULL, fmt, ap);
    va_end(ap);
    return code;
}

int qm_status_set_field(qm_status *st, int code, const char *field, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    status_vset(st, code, field, fmt, ap);
    va_end(ap);
    return code;
}
