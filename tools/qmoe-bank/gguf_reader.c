/* gguf_reader.c - parse a GGUF file from a read-only mapping, trusting
 * nothing: a cursor that never reads past the end, counts bounded by the
 * bytes that could hold them, sizes computed with overflow checks. */
#include "gguf_reader.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "tool_input.h"

#define FAIL(st, ...) qm_status_set((st), QM_EINVALID_MODEL, __VA_ARGS__)
#define MAX_KEY_BYTES 65536u /* bytes of a key or tensor name */

static const struct {
    uint32_t id;
    const char *name;
    uint32_t block, bytes;
} ggml_types[] = {
    {0, "F32", 1, 4},         {1, "F16", 1, 2},         {2, "Q4_0", 32, 18},
    {3, "Q4_1", 32, 20},      {6, "Q5_0", 32, 22},      {7, "Q5_1", 32, 24},
    {8, "Q8_0", 32, 34},      {9, "Q8_1", 32, 40},      {10, "Q2_K", 256, 84},
    {11, "Q3_K", 256, 110},   {12, "Q4_K", 256, 144},   {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},   {15, "Q8_K", 256, 292},   {16, "IQ2_XXS", 256, 66},
    {17, "IQ2_XS", 256, 74},  {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50},
    {20, "IQ4_NL", 32, 18},   {21, "IQ3_S", 256, 110},  {22, "IQ2_S", 256, 82},
    {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},         {25, "I16", 1, 2},
    {26, "I32", 1, 4},        {27, "I64", 1, 8},        {28, "F64", 1, 8},
    {29, "IQ1_M", 256, 56},   {30, "BF16", 1, 2},       {34, "TQ1_0", 256, 54},
    {35, "TQ2_0", 256, 66},   {39, "MXFP4", 32, 17},
};

int qm__ggml_type_size(uint32_t type, uint64_t *block, uint64_t *bytes)
{
    for (size_t i = 0; i < sizeof ggml_types / sizeof ggml_types[0]; i++)
        if (ggml_types[i].id == type) {
            *block = ggml_types[i].block;
            *bytes = ggml_types[i].bytes;
            return 1;
        }
    *block = *bytes = 0;
    return 0;
}

const char *qm__ggml_type_name(uint32_t type, char *buf, size_t size)
{
    for (size_t i = 0; i < sizeof ggml_types / sizeof ggml_types[0]; i++)
        if (ggml_types[i].id == type) return ggml_types[i].name;
    snprintf(buf, size, "type %u", type);
    return buf;
}

/* ---- cursor -------------------------------------------------------------------- */

typedef struct cursor {
    const uint8_t *p;
    uint64_t pos, size;
} cursor;

static int take(cursor *c, uint64_t n, const uint8_t **out)
{
    if (n > c->size - c->pos) return -1;
    *out = c->p + c->pos;
    c->pos += n;
    return 0;
}

static int rd_u32(cursor *c, uint32_t *v)
{
    const uint8_t *b;
    if (take(c, 4, &b)) return -1;
    *v = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    return 0;
}

static int rd_u64(cursor *c, uint64_t *v)
{
    const uint8_t *b;
    if (take(c, 8, &b)) return -1;
    *v = 0;
    for (int i = 7; i >= 0; i--)
        *v = *v << 8 | b[i];
    return 0;
}

/* A GGUF string (u64 length + bytes) as a NUL-terminated copy. */
static int rd_string(cursor *c, char **out, uint64_t max, const char *what, qm_status *st)
{
    uint64_t n;
    const uint8_t *b;
    if (rd_u64(c, &n)) return FAIL(st, "GGUF truncated while reading the length of %s", what);
    if (n > max)
        return FAIL(st, "GGUF %s is %llu bytes long (limit %llu)", what, (unsigned long long)n,
                    (unsigned long long)max);
    if (take(c, n, &b))
        return FAIL(st, "GGUF truncated inside %s (%llu bytes announced)", what,
                    (unsigned long long)n);
    char *s = qm_malloc((size_t)n + 1);
    if (!s) return qm_status_set(st, QM_ENOMEM, "out of memory reading %s", what);
    memcpy(s, b, (size_t)n);
    s[n] = '\0';
    if (strlen(s) != n) {
        qm_free(s);
        return FAIL(st, "GGUF %s contains a NUL byte", what);
    }
    *out = s;
    return 0;
}

static uint64_t scalar_size(uint32_t type)
{
    static const uint8_t sizes[QM__GGUF_VALUE_TYPES] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return type < QM__GGUF_VALUE_TYPES ? sizes[type] : 0;
}

static int rd_scalar(cursor *c, uint32_t type, qm__gguf_kv *kv)
{
    const uint8_t *b;
    uint64_t n = scalar_size(type), u = 0;
    if (take(c, n, &b)) return -1;
    for (int i = (int)n - 1; i >= 0; i--)
        u = u << 8 | b[i];
    switch (type) {
    case QM__GGUF_I8:
    case QM__GGUF_I16:
    case QM__GGUF_I32:
    case QM__GGUF_I64: /* two's complement in its n bytes, sign-extended */
        if (n < 8 && (u >> (8 * n - 1)) & 1)
            u |= ~0ull << (8 * n);
        kv->v.i = (int64_t)u;
        break;
    case QM__GGUF_F32: {
        uint32_t w = (uint32_t)u;
        float f;
        memcpy(&f, &w, 4);
        kv->v.f = f;
        break;
    }
    case QM__GGUF_F64: {
        double d;
        memcpy(&d, &u, 8);
        kv->v.f = d;
        break;
    }
    default:
        kv->v.u = u;
    }
    return 0;
}

static int rd_value(cursor *c, qm__gguf_kv *kv, qm_status *st)
{
    char what[96];
    snprintf(what, sizeof what, "the value of %.64s", kv->key);
    if (kv->type == QM__GGUF_STRING) return rd_string(c, &kv->str, c->size, what, st);
    if (kv->type == QM__GGUF_ARRAY) {
        if (rd_u32(c, &kv->arr_type) || rd_u64(c, &kv->arr_count))
            return FAIL(st, "GGUF truncated in the array header of %.64s", kv->key);
        if (kv->arr_type == QM__GGUF_ARRAY)
            return FAIL(st, "GGUF key %.64s: nested arrays are not supported", kv->key);
        if (kv->arr_type == QM__GGUF_STRING) {
            for (uint64_t i = 0; i < kv->arr_count; i++) {
                uint64_t n;
                const uint8_t *b;
                if (rd_u64(c, &n) || take(c, n, &b))
                    return FAIL(st, "GGUF truncated in element %llu of the array %.64s",
                                (unsigned long long)i, kv->key);
            }
            return 0;
        }
        unsigned long long es = scalar_size(kv->arr_type), total;
        const uint8_t *b;
        if (es == 0)
            return FAIL(st, "GGUF key %.64s: array of unknown value type %u", kv->key,
                        kv->arr_type);
        if (qm_mul_u64(es, kv->arr_count, &total) || take(c, total, &b))
            return FAIL(st, "GGUF truncated in the array %.64s (%llu elements)", kv->key,
                        (unsigned long long)kv->arr_count);
        return 0;
    }
    if (scalar_size(kv->type) == 0)
        return FAIL(st, "GGUF key %.64s has unknown value type %u", kv->key, kv->type);
    if (rd_scalar(c, kv->type, kv))
        return FAIL(st, "GGUF truncated in the value of %.64s", kv->key);
    return 0;
}

/* ---- open ------------------------------------------------------------------------ */

static int by_name(const void *a, const void *b)
{
    return strcmp((*(const qm__gguf_tensor *const *)a)->name,
                  (*(const qm__gguf_tensor *const *)b)->name);
}

/* The name index the importer's lookups use (a file may name 65536 blocks:
 * each lookup must not scan every tensor), and no name twice. */
static int index_names(qm__gguf_file *f, qm_status *st)
{
    f->by_name = qm_calloc(f->n_tensors ? f->n_tensors : 1, sizeof *f->by_name);
    if (!f->by_name) return qm_status_set(st, QM_ENOMEM, "out of memory indexing tensor names");
    for (size_t i = 0; i < f->n_tensors; i++)
        f->by_name[i] = &f->tensors[i];
    qsort(f->by_name, f->n_tensors, sizeof *f->by_name, by_name);
    for (size_t i = 1; i < f->n_tensors; i++)
        if (strcmp(f->by_name[i]->name, f->by_name[i - 1]->name) == 0)
            return FAIL(st, "tensor %.64s appears twice in the tensor infos", f->by_name[i]->name);
    return 0;
}

static int by_offset(const void *a, const void *b)
{
    const qm__gguf_tensor *x = *(const qm__gguf_tensor *const *)a;
    const qm__gguf_tensor *y = *(const qm__gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Two tensors sharing bytes would let a small file claim a large model (the
 * importer converts each one): every tensor's data is its own. */
static int check_overlaps(const qm__gguf_file *f, qm_status *st)
{
    const qm__gguf_tensor **order = qm_calloc(f->n_tensors ? f->n_tensors : 1, sizeof *order);
    if (!order) return qm_status_set(st, QM_ENOMEM, "out of memory checking tensor offsets");
    size_t n = 0;
    for (size_t i = 0; i < f->n_tensors; i++)
        if (f->tensors[i].data && f->tensors[i].nbytes) order[n++] = &f->tensors[i];
    qsort(order, n, sizeof *order, by_offset);
    int rc = 0;
    for (size_t i = 1; i < n && rc == 0; i++)
        if (order[i]->offset < order[i - 1]->offset + order[i - 1]->nbytes)
            rc = FAIL(st,
                      "tensor %.64s: data [%llu, %llu) overlaps tensor %.64s's [%llu, %llu) "
                      "(every tensor needs bytes of its own)",
                      order[i]->name, (unsigned long long)order[i]->offset,
                      (unsigned long long)(order[i]->offset + order[i]->nbytes), order[i - 1]->name,
                      (unsigned long long)order[i - 1]->offset,
                      (unsigned long long)(order[i - 1]->offset + order[i - 1]->nbytes));
    qm_free(order);
    return rc;
}

/* The name of the i-th entry of a list (a key, a tensor); `what` and i
 * name it in errors. */
static int rd_nth_name(cursor *c, char **out, const char *what, uint64_t i, qm_status *st)
{
    char label[48];
    snprintf(label, sizeof label, "%s %llu", what, (unsigned long long)i);
    return rd_string(c, out, MAX_KEY_BYTES, label, st);
}

static int parse(qm__gguf_file *f, qm_status *st)
{
    cursor c = {.p = f->base, .pos = 0, .size = f->size};
    uint32_t magic;
    uint64_t n_tensors, n_kv;
    int rc;
    if (rd_u32(&c, &magic) || magic != 0x46554747u)
        return FAIL(st, "not a GGUF file (the first 4 bytes are not \"GGUF\")");
    if (rd_u32(&c, &f->version) || (f->version != 2 && f->version != 3))
        return FAIL(st, "GGUF version %u is not supported (2 or 3)", f->version);
    if (rd_u64(&c, &n_tensors) || rd_u64(&c, &n_kv))
        return FAIL(st, "GGUF truncated in its header");
    /* Each entry takes at least 8 (key length) + 4 (type) bytes, each tensor
     * info at least 8 + 4 + 4 + 8: counts beyond the file are lies. */
    if (n_kv > f->size / 12 || n_tensors > f->size / 24)
        return FAIL(st,
                    "GGUF header announces %llu keys and %llu tensors, more than a "
                    "%llu-byte file can hold",
                    (unsigned long long)n_kv, (unsigned long long)n_tensors,
                    (unsigned long long)f->size);
    f->kv = qm_calloc(n_kv ? n_kv : 1, sizeof *f->kv);
    f->tensors = qm_calloc(n_tensors ? n_tensors : 1, sizeof *f->tensors);
    if (!f->kv || !f->tensors)
        return qm_status_set(st, QM_ENOMEM, "out of memory for %llu keys and %llu tensors",
                             (unsigned long long)n_kv, (unsigned long long)n_tensors);
    for (uint64_t i = 0; i < n_kv; i++) {
        qm__gguf_kv *kv = &f->kv[i];
        if ((rc = rd_nth_name(&c, &kv->key, "metadata key", i, st))) return rc;
        f->n_kv = i + 1;
        if (rd_u32(&c, &kv->type)) return FAIL(st, "GGUF truncated in the type of %.64s", kv->key);
        if ((rc = rd_value(&c, kv, st))) return rc;
    }
    f->alignment = 32;
    const qm__gguf_kv *al = qm__gguf_find_kv(f, "general.alignment");
    if (al) {
        if (al->type != QM__GGUF_U32 || al->v.u == 0 || (al->v.u & (al->v.u - 1)) != 0)
            return FAIL(st, "GGUF key general.alignment must be a u32 power of two");
        f->alignment = al->v.u;
    }
    for (uint64_t i = 0; i < n_tensors; i++) {
        qm__gguf_tensor *t = &f->tensors[i];
        if ((rc = rd_nth_name(&c, &t->name, "the name of tensor", i, st))) return rc;
        f->n_tensors = i + 1;
        if (rd_u32(&c, &t->n_dims))
            return FAIL(st, "GGUF truncated in the info of tensor %.64s", t->name);
        if (t->n_dims < 1 || t->n_dims > 4)
            return FAIL(st, "tensor %.64s: %u dimensions (GGUF allows 1 to 4)", t->name, t->n_dims);
        for (uint32_t d = 0; d < 4; d++)
            t->ne[d] = 1;
        for (uint32_t d = 0; d < t->n_dims; d++)
            if (rd_u64(&c, &t->ne[d]))
                return FAIL(st, "GGUF truncated in the shape of tensor %.64s", t->name);
        if (rd_u32(&c, &t->type) || rd_u64(&c, &t->offset))
            return FAIL(st, "GGUF truncated in the info of tensor %.64s", t->name);
    }
    uint64_t data_start = (c.pos + f->alignment - 1) / f->alignment * f->alignment;
    if (data_start > f->size) data_start = f->size;
    for (size_t i = 0; i < f->n_tensors; i++) {
        qm__gguf_tensor *t = &f->tensors[i];
        uint64_t block, bytes;
        if (!qm__ggml_type_size(t->type, &block, &bytes))
            continue; /* an unknown type is an error only where the importer needs it */
        unsigned long long n = 1, rows;
        for (uint32_t d = 1; d < 4; d++)
            if (qm_mul_u64(n, t->ne[d], &n))
                return FAIL(st, "tensor %.64s: shape overflows 64 bits", t->name);
        if (t->ne[0] % block != 0)
            return FAIL(st,
                        "tensor %.64s: row length %llu is not a multiple of its %llu-element "
                        "blocks",
                        t->name, (unsigned long long)t->ne[0], (unsigned long long)block);
        rows = n;
        if (qm_mul_u64(t->ne[0] / block * bytes, rows, &n))
            return FAIL(st, "tensor %.64s: byte size overflows 64 bits", t->name);
        if (t->offset % f->alignment != 0)
            return FAIL(st,
                        "tensor %.64s: data offset %llu is not a multiple of the alignment "
                        "%llu",
                        t->name, (unsigned long long)t->offset, (unsigned long long)f->alignment);
        if (t->offset > f->size - data_start || n > f->size - data_start - t->offset)
            return FAIL(st,
                        "tensor %.64s: data [%llu, %llu) runs past the end of the file "
                        "(%llu bytes of data; truncated?)",
                        t->name, (unsigned long long)t->offset, (unsigned long long)(t->offset + n),
                        (unsigned long long)(f->size - data_start));
        t->nbytes = n;
        t->data = f->base + data_start + t->offset;
    }
    int rc2 = check_overlaps(f, st);
    return rc2 ? rc2 : index_names(f, st);
}

int qm__gguf_open(const char *path, qm__gguf_file **out, qm_status *st)
{
    *out = NULL;
    qm__gguf_file *f = qm_calloc(1, sizeof *f);
    if (!f) return qm_status_set(st, QM_ENOMEM, "out of memory opening %.128s", path);
    int fd = -1;
    uint64_t size = 0;
    int rc = qm__open_input(path, path, &fd, &size, st);
    if (rc) {
        qm_free(f);
        return rc;
    }
    if (size < 24) {
        rc = FAIL(st, "%.128s: %llu bytes is too short for a GGUF header (truncated?)", path,
                  (unsigned long long)size);
    } else {
        void *m = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            rc = qm_status_set(st, QM_EIO, "cannot map %.128s: %s", path, strerror(errno));
        } else {
            f->base = m;
            f->size = size;
            f->mapped = 1;
        }
    }
    close(fd);
    if (rc == 0) rc = parse(f, st);
    if (rc != 0) {
        qm__gguf_close(f);
        return rc;
    }
    *out = f;
    return 0;
}

int qm__gguf_open_memory(const void *data, size_t size, qm__gguf_file **out, qm_status *st)
{
    *out = NULL;
    qm__gguf_file *f = qm_calloc(1, sizeof *f);
    if (!f) return qm_status_set(st, QM_ENOMEM, "out of memory");
    f->base = data;
    f->size = size;
    int rc = size < 24 ? FAIL(st, "%zu bytes is too short for a GGUF header", size) : parse(f, st);
    if (rc != 0) {
        qm__gguf_close(f);
        return rc;
    }
    *out = f;
    return 0;
}

void qm__gguf_close(qm__gguf_file *f)
{
    if (!f) return;
    for (size_t i = 0; i < f->n_kv; i++) {
        qm_free(f->kv[i].key);
        qm_free(f->kv[i].str);
    }
    for (size_t i = 0; i < f->n_tensors; i++)
        qm_free(f->tensors[i].name);
    qm_free(f->kv);
    qm_free(f->tensors);
    qm_free(f->by_name);
    if (f->mapped) munmap((void *)f->base, (size_t)f->size);
    qm_free(f);
}

const qm__gguf_kv *qm__gguf_find_kv(const qm__gguf_file *f, const char *key)
{
    for (size_t i = 0; i < f->n_kv; i++)
        if (strcmp(f->kv[i].key, key) == 0) return &f->kv[i];
    return NULL;
}

const qm__gguf_tensor *qm__gguf_find_tensor(const qm__gguf_file *f, const char *name)
{
    qm__gguf_tensor key = {.name = (char *)name};
    const qm__gguf_tensor *k = &key;
    const qm__gguf_tensor **hit =
        f->by_name ? bsearch(&k, f->by_name, f->n_tensors, sizeof *f->by_name, by_name) : NULL;
    return hit ? *hit : NULL;
}

int qm__gguf_get_uint(const qm__gguf_file *f, const char *key, uint64_t *out, qm_status *st)
{
    const qm__gguf_kv *kv = qm__gguf_find_kv(f, key);
    if (!kv) return 1;
    switch (kv->type) {
    case QM__GGUF_U8:
    case QM__GGUF_U16:
    case QM__GGUF_U32:
    case QM__GGUF_U64:
    case QM__GGUF_BOOL:
        *out = kv->v.u;
        return 0;
    case QM__GGUF_I8:
    case QM__GGUF_I16:
    case QM__GGUF_I32:
    case QM__GGUF_I64:
        if (kv->v.i < 0)
            return FAIL(st, "GGUF key %s = %lld but it must not be negative", key,
                        (long long)kv->v.i);
        *out = (uint64_t)kv->v.i;
        return 0;
    default:
        return FAIL(st, "GGUF key %s must be an integer", key);
    }
}

int qm__gguf_get_float(const qm__gguf_file *f, const char *key, double *out, qm_status *st)
{
    const qm__gguf_kv *kv = qm__gguf_find_kv(f, key);
    if (!kv) return 1;
    if (kv->type == QM__GGUF_F32 || kv->type == QM__GGUF_F64) {
        *out = kv->v.f;
        return 0;
    }
    uint64_t u;
    int rc = qm__gguf_get_uint(f, key, &u, st);
    if (rc == 0) *out = (double)u;
    return rc < 0 ? FAIL(st, "GGUF key %s must be a number", key) : rc;
}

int qm__gguf_get_bool(const qm__gguf_file *f, const char *key, int *out, qm_status *st)
{
    uint64_t u;
    int rc = qm__gguf_get_uint(f, key, &u, st);
    if (rc != 0) return rc < 0 ? FAIL(st, "GGUF key %s must be a bool", key) : rc;
    if (u > 1)
        return FAIL(st, "GGUF key %s = %llu but it must be a bool (0 or 1)", key,
                    (unsigned long long)u);
    *out = (int)u;
    return 0;
}
