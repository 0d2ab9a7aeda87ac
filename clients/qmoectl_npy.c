/* qmoectl_npy.c - NumPy .npy files for `qmoectl infer`: read f32/f16 arrays
 * in C order with full header validation, write version 1.0 files. */
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "qmoectl.h"

#define QMOECTL_NPY_MAX_HEADER 65536

static int npy_err(char *msg, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int npy_err(char *msg, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, cap, fmt, ap);
    va_end(ap);
    return -1;
}

/* Finds the value text after 'key': in the header dict. */
static const char *npy_value(const char *hdr, const char *key)
{
    char pat[32];
    snprintf(pat, sizeof(pat), "'%s'", key);
    const char *p = strstr(hdr, pat);
    if (!p)
        return NULL;
    p += strlen(pat);
    while (*p == ' ')
        p++;
    if (*p != ':')
        return NULL;
    p++;
    while (*p == ' ')
        p++;
    return p;
}

int qmoectl_npy_read(const char *path, qm_client_tensor *t, char *msg, size_t cap)
{
    unsigned char pre[12];
    char *hdr = NULL;
    memset(t, 0, sizeof(*t));
    FILE *f = fopen(path, "rb");
    if (!f)
        return npy_err(msg, cap, "cannot open %s: %s", path, strerror(errno));
    if (fread(pre, 1, 10, f) != 10 || memcmp(pre, "\x93NUMPY", 6) != 0) {
        npy_err(msg, cap, "%s is not a .npy file (bad magic)", path);
        goto fail;
    }
    size_t hlen;
    int major = pre[6];
    if (major == 1) {
        hlen = pre[8] | (size_t)pre[9] << 8;
    } else if (major == 2 || major == 3) {
        if (fread(pre + 10, 1, 2, f) != 2) {
            npy_err(msg, cap, "%s: truncated header", path);
            goto fail;
        }
        hlen = pre[8] | (size_t)pre[9] << 8 | (size_t)pre[10] << 16 | (size_t)pre[11] << 24;
    } else {
        npy_err(msg, cap, "%s: unsupported .npy version %d", path, major);
        goto fail;
    }
    if (hlen == 0 || hlen > QMOECTL_NPY_MAX_HEADER) {
        npy_err(msg, cap, "%s: header length %zu out of range", path, hlen);
        goto fail;
    }
    hdr = malloc(hlen + 1);
    if (!hdr || fread(hdr, 1, hlen, f) != hlen) {
        npy_err(msg, cap, "%s: truncated header", path);
        goto fail;
    }
    hdr[hlen] = '\0';
    const char *descr = npy_value(hdr, "descr"), *order = npy_value(hdr, "fortran_order"),
               *shape = npy_value(hdr, "shape");
    if (!descr || !order || !shape) {
        npy_err(msg, cap, "%s: header lacks descr, fortran_order or shape", path);
        goto fail;
    }
    if (strncmp(descr, "'<f4'", 5) == 0) {
        t->dtype = QM_CLIENT_F32;
    } else if (strncmp(descr, "'<f2'", 5) == 0) {
        t->dtype = QM_CLIENT_F16;
    } else {
        npy_err(msg, cap, "%s: dtype must be little-endian float32 or float16 ('<f4', '<f2')",
                path);
        goto fail;
    }
    if (strncmp(order, "False", 5) != 0) {
        npy_err(msg, cap, "%s: array is in Fortran order; save it C-contiguous", path);
        goto fail;
    }
    if (*shape != '(') {
        npy_err(msg, cap, "%s: malformed shape", path);
        goto fail;
    }
    const char *p = shape + 1;
    uint64_t elems = 1;
    for (;;) {
        while (*p == ' ' || *p == ',')
            p++;
        if (*p == ')')
            break;
        char *end = NULL;
        errno = 0;
        unsigned long long d = strtoull(p, &end, 10);
        if (end == p || errno || t->ndim >= QM_CLIENT_MAX_DIMS ||
            (d && elems > UINT64_MAX / d)) {
            npy_err(msg, cap, "%s: malformed or oversized shape", path);
            goto fail;
        }
        t->shape[t->ndim++] = d;
        elems *= d;
        p = end;
    }
    if (t->ndim == 0) {
        npy_err(msg, cap, "%s: a scalar is not a tensor; give at least one dimension", path);
        goto fail;
    }
    size_t esz = t->dtype == QM_CLIENT_F32 ? 4 : 2;
    if (elems > SIZE_MAX / esz) {
        npy_err(msg, cap, "%s: shape too large", path);
        goto fail;
    }
    t->nbytes = (size_t)elems * esz;
    t->data = malloc(t->nbytes ? t->nbytes : 1);
    if (!t->data || fread(t->data, 1, t->nbytes, f) != t->nbytes) {
        npy_err(msg, cap, "%s: data shorter than its shape says (%zu bytes)", path, t->nbytes);
        goto fail;
    }
    if (fgetc(f) != EOF) {
        npy_err(msg, cap, "%s: trailing bytes after the array data", path);
        goto fail;
    }
    free(hdr);
    fclose(f);
    return 0;
fail:
    free(hdr);
    free(t->data);
    memset(t, 0, sizeof(*t));
    fclose(f);
    return -1;
}

int qmoectl_npy_write(const char *path, const qm_client_tensor *t, char *msg, size_t cap)
{
    char dict[512], shape[256] = "";
    size_t o = 0;
    if (t->dtype == QM_CLIENT_BF16)
        return npy_err(msg, cap, "bf16 has no .npy dtype; ask for f32 or f16 output");
    for (int i = 0; i < t->ndim; i++)
        o += (size_t)snprintf(shape + o, sizeof(shape) - o, "%llu,%s",
                              (unsigned long long)t->shape[i], i + 1 < t->ndim ? " " : "");
    if (t->ndim > 1 && o > 0)
        shape[o - 1] = '\0'; /* (2, 3) not (2, 3,); one dimension keeps its comma */
    int n = snprintf(dict, sizeof(dict), "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }",
                     t->dtype == QM_CLIENT_F32 ? "<f4" : "<f2", shape);
    /* Pad so magic + version + length + dict + '\n' is a multiple of 64. */
    size_t total = 10 + (size_t)n + 1;
    size_t pad = (64 - total % 64) % 64;
    size_t hlen = (size_t)n + pad + 1;
    FILE *f = fopen(path, "wb");
    if (!f)
        return npy_err(msg, cap, "cannot write %s: %s", path, strerror(errno));
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(hlen & 0xff),
                             (unsigned char)(hlen >> 8)};
    int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(dict, 1, (size_t)n, f) == (size_t)n;
    for (size_t i = 0; ok && i < pad; i++)
        ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF && fwrite(t->data, 1, t->nbytes, f) == t->nbytes;
    if (fclose(f) != 0)
        ok = 0;
    if (!ok)
        return npy_err(msg, cap, "cannot write %s: %s", path, strerror(errno));
    return 0;
}
