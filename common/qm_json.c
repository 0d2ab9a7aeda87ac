/* qm_json.c - the JSON string escaper (qm_json.h). */
#include "qm_json.h"

#include <string.h>

void qm_json_escape_to(const char *s, size_t n, qm_json_put_fn put, void *ctx)
{
    static const char hex[] = "0123456789abcdef";
    /* The letter after '\\' for the bytes with a two-character escape. */
    static const char short_escape[128] = {
        ['"'] = '"', ['\\'] = '\\', ['\n'] = 'n', ['\r'] = 'r', ['\t'] = 't'};
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\')
            continue;
        if (i > run)
            put(ctx, s + run, i - run);
        run = i + 1;
        const char esc[6] = {'\\', short_escape[c] ? short_escape[c] : 'u', '0', '0',
                             hex[c >> 4], hex[c & 15]};
        put(ctx, esc, short_escape[c] ? 2 : 6);
    }
    if (n > run)
        put(ctx, s + run, n - run);
}

/* A bounded string the escaper writes into: pieces that fit whole. */
typedef struct qm__json_sink {
    char *out;
    size_t cap, len, need;
    int cut; /* a piece did not fit: nothing after it is written */
} qm__json_sink;

static void sink_put(void *ctx, const char *bytes, size_t n)
{
    qm__json_sink *k = ctx;
    k->need += n;
    if (k->cut)
        return;
    /* A run of plain bytes may be cut anywhere; an escape stays whole. */
    size_t room = k->cap - 1 - k->len;
    size_t take = n <= room ? n : bytes[0] == '\\' ? 0 : room;
    memcpy(k->out + k->len, bytes, take);
    k->len += take;
    k->cut = take < n;
}

size_t qm_json_escape_str(const char *s, char *out, size_t cap)
{
    qm__json_sink k = {.out = out, .cap = cap};
    qm_json_escape_to(s, strlen(s), sink_put, &k);
    out[k.len] = '\0';
    return k.need;
}
