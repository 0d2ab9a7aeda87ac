/* qm_buf.h - the one growable byte buffer and the JSON string escaper into it,
 * shared by the daemon's response writer (qm_jw) and the client codec
 * (qm_cval_print, request lines). Free of cJSON, so the client library
 * compiles it on its own (clients/CMakeLists.txt). */
#ifndef QM_BUF_H
#define QM_BUF_H

#include <stddef.h>

/* Output is built here. Allocation failure is sticky (`oom`), so a writer can
 * emit a whole response and check once at the end. */
typedef struct qm_buf {
    char *data;
    size_t len, cap;
    int oom;
} qm_buf;

void qm_buf_init(qm_buf *b);
void qm_buf_free(qm_buf *b); /* accepts NULL; leaves an empty buffer */
void qm_buf_reset(qm_buf *b); /* len = 0, oom = 0, memory kept */
int qm_buf_reserve(qm_buf *b, size_t extra);
int qm_buf_append(qm_buf *b, const void *data, size_t n);
int qm_buf_printf(qm_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Hands the bytes to the caller (free with qm_free) and leaves b empty. */
char *qm_buf_take(qm_buf *b, size_t *len);

/* The decimal digits of v, '-' first when `negative`, NUL-terminated in
 * out[QM_U64_DEC_MAX]; returns their length. By hand: the request, answer
 * and trace writers format integers on every call, and printf costs more
 * than the rest of such a line. */
#define QM_U64_DEC_MAX 22
size_t qm_fmt_u64(char *out, unsigned long long v, int negative);

/* Appends s[0..n) as the body of a JSON string (no quotes), escaped by
 * common/qm_json.h's qm_json_escape_to. */
void qm_json_escape(qm_buf *b, const char *s, size_t n);

#endif
