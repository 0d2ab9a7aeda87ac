/* qm_client_internal.h - what the client's two source files share. Not installed. */
#ifndef QM_CLIENT_INTERNAL_H
#define QM_CLIENT_INTERNAL_H

#include "qm_client_codec.h"
#include "qmoe_client.h"

/* Sets *err (may be NULL) and returns `code`. */
int qm__client_fail(qm_client_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* One round trip. Takes ownership of `params` (may be NULL). On 0 *result is
 * a tree the caller frees with qm_cval_free. */
int qm__client_call(qm_client *c, const char *method, qm_cval *params, qm_cval **result,
                    qm_client_error *err);

/* The same, with `fd` (>= 0) passed as SCM_RIGHTS on the line's first byte. */
int qm__client_call_fd(qm_client *c, const char *method, qm_cval *params, int fd,
                       qm_cval **result, qm_client_error *err);

/* The same, with params already printed as compact JSON (n bytes). */
int qm__client_call_text(qm_client *c, const char *method, const char *params, size_t n,
                         qm_cval **result, qm_client_error *err);

/* Copies a string member; NULL when absent. Returns QM_CLIENT_ENOMEM on failure. */
int qm__client_dup_member(const qm_cval *obj, const char *key, char **out);

#endif
