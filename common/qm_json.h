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
 * as \u00XX, well-formed UTF-8 as it is, in runs, and each byte that is not
 * part of a well-formed UTF-8 sequence (RFC 3629: no overlong forms, no
 * surrogates, nothing past U+10FFFF; a sequence cut short) as \ufffd: the
 * text is JSON every reader takes, whatever bytes came in (a status message
 * cut inside a character, a bank file's metadata, a peer's string). */
void qm_json_escape_to(const char *s, size_t n, qm_json_put_fn put, void *ctx);

/* The length of the well-formed UTF-8 sequence at s[0..n) (n > 0): 1 to
 * 4, or 0 when s[0] starts none. */
size_t qm_utf8_valid_len(const unsigned char *s, size_t n);

/* The NUL-terminated s escaped into out[cap] (NUL-terminated, cap > 0),
 * never cutting an escape or a UTF-8 character in two. Returns the length the whole escaped
 * text needs (>= cap: it was cut), as snprintf does. */
size_t qm_json_escape_str(const char *s, char *out, size_t cap);

#endif
