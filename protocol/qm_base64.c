/* qm_base64.c - the one base64 codec (RFC 4648, standard alphabet, padded),
 * shared by the daemon's tensor codec and the client library.
 *
 * Decoding is strict so that every tensor has exactly one spelling on the
 * wire: the length is a multiple of 4, '=' appears only as trailing padding,
 * no whitespace, and the bits the padding hides are zero (RFC 4648 3.5), so
 * encode(decode(s)) == s for every accepted s. */
#include <stdint.h>
#include <string.h>

#include "qm_error.h"
#include "qm_protocol.h"

static const char b64_alphabet[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

size_t qm_base64_encoded_len(size_t n) { return (n / 3 + (n % 3 != 0)) * 4; }

void qm_base64_encode(const uint8_t *in, size_t n, char *out)
{
    size_t i = 0;
    for (; i + 3 <= n; i += 3) {
        uint32_t v = (uint32_t)in[i] << 16 | (uint32_t)in[i + 1] << 8 | in[i + 2];
        *out++ = b64_alphabet[v >> 18];
        *out++ = b64_alphabet[(v >> 12) & 63];
        *out++ = b64_alphabet[(v >> 6) & 63];
        *out++ = b64_alphabet[v & 63];
    }
    if (i < n) {
        uint32_t v = (uint32_t)in[i] << 16 | (i + 1 < n ? (uint32_t)in[i + 1] << 8 : 0);
        *out++ = b64_alphabet[v >> 18];
        *out++ = b64_alphabet[(v >> 12) & 63];
        *out++ = i + 1 < n ? b64_alphabet[(v >> 6) & 63] : '=';
        *out++ = '=';
    }
}

static int b64_value(unsigned char c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    if (c == '+')
        return 62;
    if (c == '/')
        return 63;
    return -1;
}

int qm_base64_decode(const char *in, size_t in_len, uint8_t *out, size_t cap, size_t *n)
{
    *n = 0;
    if (in_len % 4 != 0)
        return QM_EINVAL;
    size_t pad = 0;
    if (in_len >= 4) {
        if (in[in_len - 1] == '=')
            pad++;
        if (in[in_len - 2] == '=')
            pad++;
        if (pad == 1 && in[in_len - 2] == '=') /* "xx=y" */
            return QM_EINVAL;
    }
    size_t out_len = in_len / 4 * 3 - pad;
    if (out_len > cap)
        return QM_EINVAL;
    size_t o = 0;
    for (size_t i = 0; i < in_len; i += 4) {
        int last = i + 4 == in_len;
        int v[4];
        for (int j = 0; j < 4; j++) {
            unsigned char c = (unsigned char)in[i + j];
            if (c == '=' && last && j >= 4 - (int)pad) {
                v[j] = 0;
                continue;
            }
            v[j] = b64_value(c);
            if (v[j] < 0)
                return QM_EINVAL;
        }
        uint32_t word = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 |
                        (uint32_t)v[3];
        /* The bits under the padding must be zero: "Zh==" is not "Zg==". */
        if (last && ((pad == 1 && (word & 0xff)) || (pad == 2 && (word & 0xffff))))
            return QM_EINVAL;
        uint8_t bytes[3] = {(uint8_t)(word >> 16), (uint8_t)(word >> 8), (uint8_t)word};
        size_t take = last ? 3 - pad : 3;
        memcpy(out + o, bytes, take);
        o += take;
    }
    *n = o;
    return 0;
}
