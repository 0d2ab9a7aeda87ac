/* qm_buf.c - the growable byte buffer, and the JSON string escaper into it
 * (qm_buf.h; the escaping itself is common/qm_json.c). */
#include "qm_buf.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_error.h"
#include "qm_json.h"

void qm_buf_init(qm_buf *b)
{
    b->data = NULL;
    b->len = b->cap = 0;
    b->oom = 0;
}

void qm_buf_free(qm_buf *b)
{
    if (!b)
        return;
    qm_free(b->data);
    qm_buf_init(b);
}

void qm_buf_reset(qm_buf *b)
{
    b->len = 0;
    b->oom = 0;
}

int qm_buf_reserve(qm_buf *b, size_t extra)
{
    if (b->oom)
        return QM_ENOMEM;
    if (extra <= b->cap - b->len)
        return 0;
    size_t need;
    if (__builtin_add_overflow(b->len, extra, &need))
        goto fail;
    size_t cap = b->cap ? b->cap : 1024;
    while (cap < need) {
        if (cap > SIZE_MAX / 2) {
            cap = need;
            break;
        }
        cap *= 2;
    }
    char *p = qm_realloc(b->data, cap);
    if (!p)
        goto fail;
    b->data = p;
    b->cap = cap;
    return 0;
fail:
    b->oom = 1;
    return QM_ENOMEM;
}

int qm_buf_append(qm_buf *b, const void *data, size_t n)
{
    if (n == 0)
        return b->oom ? QM_ENOMEM : 0;
    if (qm_buf_reserve(b, n) < 0)
        return QM_ENOMEM;
    memcpy(b->data + b->len, data, n);
    b->len += n;
    return 0;
}

int qm_buf_printf(qm_buf *b, const char *fmt, ...)
{
    char small[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0)
        return QM_EINVAL;
    if ((size_t)n < sizeof small)
        return qm_buf_append(b, small, (size_t)n);
    if (qm_buf_reserve(b, (size_t)n + 1) < 0)
        return QM_ENOMEM;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return 0;
}

char *qm_buf_take(qm_buf *b, size_t *len)
{
    char *p = b->data;
    if (len)
        *len = b->len;
    qm_buf_init(b);
    return p;
}

size_t qm_fmt_u64(char *out, unsigned long long v, int negative)
{
    char tmp[QM_U64_DEC_MAX];
    size_t i = sizeof tmp;
    do {
        tmp[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    if (negative)
        tmp[--i] = '-';
    size_t n = sizeof tmp - i;
    memcpy(out, tmp + i, n);
    out[n] = '\0';
    return n;
}

static void buf_put(void *ctx, const char *bytes, size_t n) { qm_buf_append(ctx, bytes, n); }

void qm_json_escape(qm_buf *b, const char *s, size_t n) { qm_json_escape_to(s, n, buf_put, b); }
