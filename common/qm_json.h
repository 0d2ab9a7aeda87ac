/* qm_json.h - the one JSON string escaper, for every module that writes
 * JSON text: the daemon's answers and the client's requests (protocol/'s
 * qm_buf), bank headers (model/), and qmoe-bank's reports (tools/). */
#ifndef QM_JSON_H
#define QM_JSON_H

#include <stddef.h>

/* Where escaped text goes: `n` bytes at `bytes`, in order. */
typedef void (*qm_json_put_fn)(void *ctx, const char *bytes, size_t n);

/* Writes s[0..n) as the body of a JSON string (no quotes) through put:
 * '"', '\\', \n, \r and \t as two-character escapes, other bytes below 0x20
 * as \u00XX, everything else (UTF-8 included) as it is, in runs. */
void qm_json_escape_to(const char *s, size_t n, qm_json_put_fn put, void *ctx);

/* The NUL-terminated s escaped into out[cap] (NUL-terminated, cap > 0),
 * never cutting an escape in two. Returns the length the whole escaped
 * text needs (>= cap: it was cut), as snprintf does. */
size_t qm_json_escape_str(const char *s, char *out, size_t cap);

#endif
