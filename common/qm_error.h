/* qm_error.h - the one list of error codes, and the status that carries a sentence.
 *
 * Every function that can fail returns 0 or a negative QM_E* code. Functions whose
 * errors reach a user also take a `qm_status *` (may be NULL) and write a readable
 * sentence there: what was wrong and what was expected. */
#ifndef QM_ERROR_H
#define QM_ERROR_H

#include <stddef.h>

/* X(name, value, text, rpc). Values are stable. rpc is the JSON-RPC error a
 * client sees for the code: QM_RPC_<rpc> of protocol/qm_protocol.h. */
#define QM_ERRNO_MAP(X)                                                                            \
    X(INVAL, -1, "invalid argument", INVALID_PARAMS)                                               \
    X(NOMEM, -2, "out of memory", RESOURCE_EXHAUSTED)                                              \
    X(IO, -3, "input/output error", INTERNAL_ERROR)                                                \
    X(INVALID_MODEL, -4, "invalid model", INVALID_MODEL)                                           \
    X(NOT_FOUND, -5, "not found", NOT_FOUND)                                                       \
    X(PERMISSION, -6, "permission denied", PERMISSION_DENIED)                                      \
    X(RESOURCE_EXHAUSTED, -7, "resource exhausted", RESOURCE_EXHAUSTED)                            \
    X(OVERLOADED, -8, "overloaded", OVERLOADED)                                                    \
    X(PAYLOAD_TOO_LARGE, -9, "payload too large", PAYLOAD_TOO_LARGE)                               \
    X(SHUTTING_DOWN, -10, "shutting down", SHUTTING_DOWN)                                          \
    X(CONFLICT, -11, "conflict", CONFLICT)                                                         \
    X(IN_USE, -12, "in use", IN_USE)                                                               \
    X(UNSUPPORTED, -13, "unsupported", INVALID_PARAMS)                                             \
    X(DEVICE, -14, "device error", INTERNAL_ERROR)                                                 \
    X(INTERNAL, -15, "internal error", INTERNAL_ERROR)                                             \
    X(PARSE, -16, "parse error", PARSE_ERROR)

enum {
    QM_OK = 0,
#define QM__ERR_ENUM(name, value, text, rpc) QM_E##name = value,
    QM_ERRNO_MAP(QM__ERR_ENUM)
#undef QM__ERR_ENUM
};

/* Static strings; unknown codes give "unknown error" / "UNKNOWN". */
const char *qm_strerror(int code);
const char *qm_err_name(int code);

#define QM_STATUS_MSG_MAX 512 /* holds protocol/'s method list in one sentence */

typedef struct qm_status {
    int code;                     /* 0 or QM_E* */
    char msg[QM_STATUS_MSG_MAX];  /* one readable sentence, NUL-terminated */
    char field[64];               /* params path the error is about, "" if none */
} qm_status;

void qm_status_clear(qm_status *st);
/* Sets code and a printf-formatted message; returns `code` so callers can
 * `return qm_status_set(st, QM_EINVAL, "...")`. `st` may be NULL. */
int qm_status_set(qm_status *st, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Same, and names the field the error is about. */
int qm_status_set_field(qm_status *st, int code, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
