/* qm_json.c - the JSON string escaper (qm_json.h). */
#include "qm_json.h"

#include <string.h>

size_t qm_utf8_valid_len(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    size_t len;
    unsigned char lo = 0x80, hi = 0xbf; /* the second byte's range */
    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf) {
        len = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        if (c == 0xe0)
            lo = 0xa0; /* not overlong */
        else if (c == 0xed)
            hi = 0x9f; /* not a UTF-16 surrogate */
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        if (c == 0xf0)
            lo = 0x90; /* not overlong */
        else if (c == 0xf4)
            hi = 0x8f; /* not past U+10FFFF */
    } else {
        return 0; /* a continuation byte, an overlong lead (C0, C1) or F5-FF */
    }
    if (n < len || s[1] < lo || s[1] > hi)
        return 0;
    for (size_t i = 2; i < len; i++)
        if ((s[i] & 0xc0) != 0x80)
            return 0;
    return len;
}

void qm_json_escape_to(const char *s, size_t n, qm_json_put_fn put, void *ctx)
{
    static const char hex[] = "0123456789abcdef";
    /* The letter after '\\' for the bytes with a two-character escape. */
    static const char short_escape[128] = {
        ['"'] = '"', ['\\'] = '\\', ['\n'] = 'n', ['\r'] = 'r', ['\t'] = 't'};
    size_t run = 0;
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x80 && c != '"' && c != '\\') {
            i++;
            continue;
        }
        size_t ok = c >= 0x80 ? qm_utf8_valid_len((const unsigned char *)s + i, n - i) : 0;
        if (ok) {
            i += ok;
            continue;
        }
        if (i > run)
            put(ctx, s + run, i - run);
        if (c >= 0x80) {
            /* Not UTF-8 (a cut message, a file's or a peer's bytes): the
             * replacement character, so the text stays JSON every reader
             * takes. */
            put(ctx, "\\ufffd", 6);
        } else {
            const char esc[6] = {'\\', short_escape[c] ? short_escape[c] : 'u', '0', '0',
                                 hex[c >> 4], hex[c & 15]};
            put(ctx, esc, short_escape[c] ? 2 : 6);
        }
        run = ++i;
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
    /* A run of plain bytes may be cut between characters (never inside a
     * UTF-8 sequence); an escape stays whole. */
    size_t room = k->cap - 1 - k->len;
    size_t take = n <= room ? n : bytes[0] == '\\' ? 0 : room;
    while (take < n && take > 0 && ((unsigned char)bytes[take] & 0xc0) == 0x80)
        take--;
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
