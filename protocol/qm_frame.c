/* qm_frame.c - newline framing with a hard cap, the nesting pre-scan, and
 * the UTF-8 check of decoded strings.
 *
 * The cap is enforced while bytes accumulate, not when the newline finally
 * arrives: a peer streaming an endless line costs at most max_frame bytes. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memrchr */
#endif
#include "qm_rpc_impl.h"

#include <string.h>

void qm_framer_init(qm_framer *f, size_t max_frame)
{
    memset(f, 0, sizeof *f);
    f->max_frame = max_frame;
}

void qm_framer_free(qm_framer *f)
{
    if (!f)
        return;
    qm_buf_free(&f->in);
    f->start = f->scanned = f->partial = 0;
}

size_t qm_framer_buffered(const qm_framer *f) { return f->in.len - f->start; }

/* Scans the unscanned tail for '\n'; returns its offset or SIZE_MAX. */
static size_t find_newline(qm_framer *f)
{
    size_t from = f->start + f->scanned;
    if (from < f->in.len) {
        const char *nl = memchr(f->in.data + from, '\n', f->in.len - from);
        if (nl)
            return (size_t)(nl - f->in.data);
    }
    f->scanned = f->in.len - f->start;
    return SIZE_MAX;
}

int qm_framer_push(qm_framer *f, const char *data, size_t n)
{
    if (f->overflow)
        return QM_EPAYLOAD_TOO_LARGE;
    if (n == 0)
        return 0;
    /* Drop consumed bytes before growing. */
    if (f->start > 0 && n > f->in.cap - f->in.len) {
        memmove(f->in.data, f->in.data + f->start, f->in.len - f->start);
        f->in.len -= f->start;
        f->start = 0;
    }
    if (qm_buf_append(&f->in, data, n) < 0)
        return QM_ENOMEM;
    /* A partial line already over the cap can never become valid: give up
     * now rather than buffer the rest of it. */
    const char *nl = memrchr(data, '\n', n);
    f->partial = nl ? n - (size_t)(nl - data) - 1 : f->partial + n;
    if (f->partial > f->max_frame) {
        /* Keep the complete lines before it: they are still answered. */
        f->in.len -= f->partial;
        f->partial = 0;
        f->scanned = 0;
        f->overflow = 1;
        return QM_EPAYLOAD_TOO_LARGE;
    }
    return 0;
}

static int is_blank(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r')
            return 0;
    return 1;
}

int qm_framer_next(qm_framer *f, const char **line, size_t *len)
{
    for (;;) {
        size_t nl = find_newline(f);
        if (nl == SIZE_MAX) {
            if (f->overflow)
                return QM_EPAYLOAD_TOO_LARGE;
            return 0;
        }
        const char *s = f->in.data + f->start;
        size_t n = nl - f->start;
        f->start = nl + 1;
        f->scanned = 0;
        if (n > f->max_frame) {
            f->overflow = 1;
            f->start = f->in.len;
            return QM_EPAYLOAD_TOO_LARGE;
        }
        if (is_blank(s, n))
            continue;
        *line = s;
        *len = n;
        return 1;
    }
}

int qm_json_depth(const char *s, size_t n, int max)
{
    int depth = 0, deepest = 0, in_string = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (in_string) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_string = 0;
            continue;
        }
        if (c == '"') {
            in_string = 1;
        } else if (c == '[' || c == '{') {
            if (++depth > max)
                return -1;
            if (depth > deepest)
                deepest = depth;
        } else if (c == ']' || c == '}') {
            if (depth > 0)
                depth--;
        }
    }
    return deepest;
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* One JSON number token at s[i]; returns the index after it, or 0 when the
 * spelling is not JSON (strtod would take "01", "1.", "0x10", ...). */
static size_t number_end(const char *s, size_t n, size_t i)
{
    if (s[i] == '-')
        i++;
    if (i >= n || !is_digit(s[i]))
        return 0;
    if (s[i] == '0')
        i++;
    else
        while (i < n && is_digit(s[i]))
            i++;
    if (i < n && s[i] == '.') {
        i++;
        if (i >= n || !is_digit(s[i]))
            return 0;
        while (i < n && is_digit(s[i]))
            i++;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-'))
            i++;
        if (i >= n || !is_digit(s[i]))
            return 0;
        while (i < n && is_digit(s[i]))
            i++;
    }
    if (i < n) {
        char c = s[i];
        if (is_digit(c) || c == '.' || c == '+' || c == '-' || (c >= 'a' && c <= 'z') ||
            (c >= 'A' && c <= 'Z'))
            return 0;
    }
    return i;
}

int qm_json_check(const char *s, size_t n, int max_depth, const char **why)
{
    int depth = 0;
    *why = NULL;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"') {
            for (i++; i < n && s[i] != '"'; i++) {
                unsigned char d = (unsigned char)s[i];
                if (d < 0x20) {
                    *why = "a raw control character inside a string";
                    return QM_EPARSE;
                }
                if (d == '\\') {
                    if (i + 5 < n && s[i + 1] == 'u' && memcmp(s + i + 2, "0000", 4) == 0) {
                        *why = "a string holds \\u0000, which this daemon does not accept";
                        return QM_EINVAL;
                    }
                    i++;
                }
            }
            continue;
        }
        if (c == '[' || c == '{') {
            if (++depth > max_depth) {
                *why = "JSON nested deeper than max_nesting";
                return QM_ERESOURCE_EXHAUSTED;
            }
        } else if (c == ']' || c == '}') {
            if (depth > 0)
                depth--;
        } else if (c == '-' || is_digit((char)c)) {
            size_t end = number_end(s, n, i);
            if (!end) {
                *why = "a number that is not spelled as JSON";
                return QM_EPARSE;
            }
            i = end - 1;
        } else if (c < 0x20 && c != ' ' && c != '\t' && c != '\r' && c != '\n') {
            *why = "a control character outside a string";
            return QM_EPARSE;
        }
    }
    return 0;
}

int qm__utf8_valid(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        unsigned char c = p[i];
        size_t len;
        uint32_t cp;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xe0) == 0xc0) {
            len = 2;
            cp = c & 0x1f;
        } else if ((c & 0xf0) == 0xe0) {
            len = 3;
            cp = c & 0x0f;
        } else if ((c & 0xf8) == 0xf0) {
            len = 4;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (n - i < len)
            return 0;
        for (size_t j = 1; j < len; j++) {
            if ((p[i + j] & 0xc0) != 0x80)
                return 0;
            cp = cp << 6 | (p[i + j] & 0x3f);
        }
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
            cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return 0;
        i += len;
    }
    return 1;
}
