#include "qm_error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

const char *qm_strerror(int code)
{
    switch (code) {
    case QM_OK:
        return "ok";
#define QM__ERR_STR(name, value, text, rpc)                                                        \
    case QM_E##name:                                                                               \
        return text;
        QM_ERRNO_MAP(QM__ERR_STR)
#undef QM__ERR_STR
    }
    return "unknown error";
}

const char *qm_err_name(int code)
{
    switch (code) {
    case QM_OK:
        return "OK";
#define QM__ERR_NAME(name, value, text, rpc)                                                       \
    case QM_E##name:                                                                               \
        return #name;
        QM_ERRNO_MAP(QM__ERR_NAME)
#undef QM__ERR_NAME
    }
    return "UNKNOWN";
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
