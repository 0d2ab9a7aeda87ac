/* qm_npy.c - bounded .npy reader and writer. */
#include "qm_npy.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"

#define NPY_FAIL(st, ...) qm_status_set((st), QM_EINVAL, __VA_ARGS__)

/* One row per qm_npy_dtype, in enum order: element size and NumPy descr. */
static const struct {
    size_t size;
    const char *descr;
} npy_dtypes[] = {
    [QM_NPY_F32] = {4, "<f4"},
    [QM_NPY_F16] = {2, "<f2"},
    [QM_NPY_U16] = {2, "<u2"},
    [QM_NPY_I32] = {4, "<i4"},
};
#define N_NPY_DTYPES (sizeof npy_dtypes / sizeof npy_dtypes[0])

size_t qm_npy_dtype_size(qm_npy_dtype dtype)
{
    return (unsigned)dtype < N_NPY_DTYPES ? npy_dtypes[dtype].size : 0;
}

static const char *dtype_descr(qm_npy_dtype d)
{
    return (unsigned)d < N_NPY_DTYPES ? npy_dtypes[d].descr : "<u2";
}

/* 0 with *out set when descr names one of ours, else -1. */
static int dtype_from_descr(const char *descr, qm_npy_dtype *out)
{
    for (size_t i = 0; i < N_NPY_DTYPES; i++)
        if (strcmp(descr, npy_dtypes[i].descr) == 0) {
            *out = (qm_npy_dtype)i;
            return 0;
        }
    return -1;
}

/* A cursor over the header dict text. */
typedef struct cur {
    const char *p, *end;
} cur;

static void skip_ws(cur *c)
{
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r'))
        c->p++;
}

static int eat(cur *c, char ch)
{
    skip_ws(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return 1;
    }
    return 0;
}

/* A quoted Python string of at most size-1 bytes, no escapes. */
static int read_str(cur *c, char *buf, size_t size)
{
    skip_ws(c);
    if (c->p >= c->end || (*c->p != '\'' && *c->p != '"'))
        return -1;
    char q = *c->p++;
    size_t n = 0;
    while (c->p < c->end && *c->p != q) {
        if (*c->p == '\\' || n + 1 >= size)
            return -1;
        buf[n++] = *c->p++;
    }
    if (c->p >= c->end)
        return -1;
    c->p++;
    buf[n] = '\0';
    return 0;
}

static int read_word(cur *c, const char *w)
{
    skip_ws(c);
    size_t n = strlen(w);
    if ((size_t)(c->end - c->p) >= n && memcmp(c->p, w, n) == 0) {
        c->p += n;
        return 1;
    }
    return 0;
}

static int read_shape(cur *c, qm_npy *out)
{
    if (!eat(c, '('))
        return -1;
    out->ndim = 0;
    for (;;) {
        if (eat(c, ')'))
            return 0;
        skip_ws(c);
        if (c->p >= c->end || *c->p < '0' || *c->p > '9')
            return -1;
        uint64_t v = 0;
        while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
            if (v > (UINT64_MAX - 9) / 10)
                return -1;
            v = v * 10 + (uint64_t)(*c->p++ - '0');
        }
        if (out->ndim >= QM_NPY_MAX_NDIM)
            return -1;
        out->shape[out->ndim++] = v;
        if (!eat(c, ',')) {
            /* "(3)" is not a tuple: a 1-d shape needs the comma. */
            if (out->ndim == 1 || !eat(c, ')'))
                return -1;
            return 0;
        }
    }
}

static int parse_dict(const char *text, size_t len, qm_npy *out, qm_status *st)
{
    cur c = {text, text + len};
    int have_descr = 0, have_order = 0, have_shape = 0;
    char key[32], descr[16];
    if (!eat(&c, '{'))
        return NPY_FAIL(st, ".npy header is not a Python dict");
    while (!eat(&c, '}')) {
        if (read_str(&c, key, sizeof key) != 0 || !eat(&c, ':'))
            return NPY_FAIL(st, ".npy header: expected 'key': value");
        if (strcmp(key, "descr") == 0 && !have_descr) {
            if (read_str(&c, descr, sizeof descr) != 0)
                return NPY_FAIL(st, ".npy header: descr is not a string");
            if (dtype_from_descr(descr, &out->dtype) != 0)
                return NPY_FAIL(st, ".npy dtype '%.15s' unsupported (want '<f4', '<f2', "
                                    "'<u2' for bf16 bits, or '<i4')", descr);
            have_descr = 1;
        } else if (strcmp(key, "fortran_order") == 0 && !have_order) {
            if (read_word(&c, "False")) {
                have_order = 1;
            } else if (read_word(&c, "True")) {
                return NPY_FAIL(st, ".npy array is Fortran-ordered; C order is required");
            } else {
                return NPY_FAIL(st, ".npy header: fortran_order must be True or False");
            }
        } else if (strcmp(key, "shape") == 0 && !have_shape) {
            if (read_shape(&c, out) != 0)
                return NPY_FAIL(st, ".npy header: shape must be a tuple of at most %d "
                                    "non-negative integers", QM_NPY_MAX_NDIM);
            have_shape = 1;
        } else {
            return NPY_FAIL(st, ".npy header: unexpected or repeated key '%.31s'", key);
        }
        if (!eat(&c, ',')) {
            if (!eat(&c, '}'))
                return NPY_FAIL(st, ".npy header: expected ',' or '}'");
            break;
        }
    }
    skip_ws(&c);
    if (c.p != c.end)
        return NPY_FAIL(st, ".npy header: bytes after the dict");
    if (!have_descr || !have_order || !have_shape)
        return NPY_FAIL(st, ".npy header lacks %s", !have_descr   ? "descr"
                                                    : !have_order ? "fortran_order"
                                                                  : "shape");
    return 0;
}

int qm_npy_parse(const void *buf, size_t size, qm_npy *out, qm_status *st)
{
    const uint8_t *b = buf;
    memset(out, 0, sizeof *out);
    if (size < 10 || memcmp(b, "\x93NUMPY", 6) != 0)
        return NPY_FAIL(st, "not a .npy file (magic \\x93NUMPY missing)");
    uint8_t major = b[6];
    size_t hlen, pre;
    if (major == 1) {
        hlen = (size_t)b[8] | (size_t)b[9] << 8;
        pre = 10;
    } else if (major == 2 || major == 3) {
        if (size < 12)
            return NPY_FAIL(st, ".npy file truncated in its header length");
        hlen = (size_t)b[8] | (size_t)b[9] << 8 | (size_t)b[10] << 16 | (size_t)b[11] << 24;
        pre = 12;
    } else {
        return NPY_FAIL(st, ".npy format version %u.%u unsupported (1, 2 or 3)", major, b[7]);
    }
    if (hlen > QM_NPY_MAX_HEADER)
        return NPY_FAIL(st, ".npy header of %zu bytes exceeds the %d-byte limit", hlen,
                        QM_NPY_MAX_HEADER);
    if (hlen > size - pre)
        return NPY_FAIL(st, ".npy header length %zu but only %zu bytes follow", hlen, size - pre);
    int rc = parse_dict((const char *)b + pre, hlen, out, st);
    if (rc != 0)
        return rc;
    unsigned long long count = 1, nbytes;
    for (uint32_t i = 0; i < out->ndim; i++)
        if (qm_mul_u64(count, out->shape[i], &count) != 0)
            return NPY_FAIL(st, ".npy shape overflows 64-bit element counts");
    if (qm_mul_u64(count, qm_npy_dtype_size(out->dtype), &nbytes) != 0)
        return NPY_FAIL(st, ".npy shape overflows 64-bit byte counts");
    size_t body = size - pre - hlen;
    if (nbytes != body)
        return NPY_FAIL(st, ".npy shape needs %llu data bytes but the file holds %zu", nbytes,
                        body);
    out->count = count;
    out->nbytes = nbytes;
    out->data = qm_malloc(nbytes ? (size_t)nbytes : 1);
    if (!out->data)
        return qm_status_set(st, QM_ENOMEM, "out of memory for a %llu-byte array", nbytes);
    memcpy(out->data, b + pre + hlen, (size_t)nbytes);
    return 0;
}

int qm_npy_read(const char *path, uint64_t max_bytes, qm_npy *out, qm_status *st)
{
    memset(out, 0, sizeof *out);
    if (max_bytes == 0)
        max_bytes = 16ull << 30;
    FILE *f = fopen(path, "rb");
    if (!f)
        return qm_status_set(st, QM_EIO, "cannot open %.128s: %s", path, strerror(errno));
    int rc;
    uint8_t *buf = NULL;
    if (fseeko(f, 0, SEEK_END) != 0) {
        rc = qm_status_set(st, QM_EIO, "cannot seek %.128s: %s", path, strerror(errno));
        goto done;
    }
    off_t sz = ftello(f);
    if (sz < 0 || (uint64_t)sz > max_bytes) {
        rc = NPY_FAIL(st, "%.128s is larger than the %llu-byte limit", path,
                      (unsigned long long)max_bytes);
        goto done;
    }
    rewind(f);
    buf = qm_malloc(sz ? (size_t)sz : 1);
    if (!buf) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory reading %.128s", path);
        goto done;
    }
    if (sz && fread(buf, 1, (size_t)sz, f) != (size_t)sz) {
        rc = qm_status_set(st, QM_EIO, "cannot read %.128s", path);
        goto done;
    }
    rc = qm_npy_parse(buf, (size_t)sz, out, st);
    if (rc != 0 && st && rc == QM_EINVAL) {
        char msg[QM_STATUS_MSG_MAX];
        snprintf(msg, sizeof msg, "%s", st->msg);
        qm_status_set(st, rc, "%.100s: %s", path, msg);
    }
done:
    qm_free(buf);
    fclose(f);
    return rc;
}

int qm_npy_write(const char *path, qm_npy_dtype dtype, const uint64_t *shape, uint32_t ndim,
                 const void *data, qm_status *st)
{
    char dict[512];
    if (ndim > QM_NPY_MAX_NDIM)
        return NPY_FAIL(st, "at most %d dimensions", QM_NPY_MAX_NDIM);
    unsigned long long count = 1, nbytes;
    size_t off = (size_t)snprintf(dict, sizeof dict,
                                  "{'descr': '%s', 'fortran_order': False, 'shape': (",
                                  dtype_descr(dtype));
    for (uint32_t i = 0; i < ndim; i++) {
        if (qm_mul_u64(count, shape[i], &count) != 0)
            return NPY_FAIL(st, "shape overflows 64-bit element counts");
        off += (size_t)snprintf(dict + off, sizeof dict - off, "%s%llu%s", i ? " " : "",
                                (unsigned long long)shape[i], ndim == 1 || i + 1 < ndim ? "," : "");
    }
    off += (size_t)snprintf(dict + off, sizeof dict - off, "), }");
    if (qm_mul_u64(count, qm_npy_dtype_size(dtype), &nbytes) != 0)
        return NPY_FAIL(st, "shape overflows 64-bit byte counts");
    /* Pad with spaces and a newline so that 10 + header is a multiple of 64. */
    size_t total = 10 + off + 1;
    size_t pad = (64 - total % 64) % 64;
    if (off + pad + 1 >= sizeof dict)
        return NPY_FAIL(st, "header too long");
    memset(dict + off, ' ', pad);
    dict[off + pad] = '\n';
    size_t hlen = off + pad + 1;
    uint8_t pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (uint8_t)(hlen & 0xff),
                       (uint8_t)(hlen >> 8)};
    FILE *f = fopen(path, "wb");
    if (!f)
        return qm_status_set(st, QM_EIO, "cannot create %.128s: %s", path, strerror(errno));
    int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(dict, 1, hlen, f) == hlen &&
             (nbytes == 0 || fwrite(data, 1, (size_t)nbytes, f) == nbytes);
    if (fclose(f) != 0)
        ok = 0;
    if (!ok)
        return qm_status_set(st, QM_EIO, "cannot write %.128s: %s", path, strerror(errno));
    return 0;
}

void qm_npy_free(qm_npy *npy)
{
    if (!npy)
        return;
    qm_free(npy->data);
    npy->data = NULL;
}
