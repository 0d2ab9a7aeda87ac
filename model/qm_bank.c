/* qm_bank.c - opening a bank: mmap, container checks, views, catalogs.
 *
 * Nothing from the file is trusted. The order of checks is: the 8-byte
 * length against the file, the header through the bounded parser (qm_st_header.c),
 * every tensor's dtype x shape == byte length (overflow-checked), offsets
 * inside the data section, alignment, no overlaps; then the metadata, then
 * each layer tensor against the metadata (qm_bank_layout.c). Views are
 * handed out only after all of that passed. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_bank.h"
#include "qm_bank_internal.h"

struct qm_bank {
    char *path;
    const uint8_t *base; /* whole file / buffer */
    uint64_t size;
    int mapped; /* 1: munmap(base, size) at close */
    int fd;     /* the mapped file, kept open for qm_bank_check_file; -1 for memory */
    const uint8_t *data; /* byte buffer after the header */
    uint64_t data_bytes;
    qm_bank_config cfg;
    qm_layer_view *layers;
    uint32_t *layer_map; /* qmoe.layer_map, NULL when absent */
    char *source_json;   /* qmoe.source as one line of compact JSON, NULL when absent */
    char **warnings;
    size_t n_warnings;
    uint64_t expert_bytes_total;
};

#define FAIL(st, ...) qm_status_set((st), QM_EINVALID_MODEL, __VA_ARGS__)

/* ---- container ------------------------------------------------------------- */

typedef struct span {
    const qm_st_tensor *t;
} span;

static int cmp_span(const void *a, const void *b)
{
    const span *x = a, *y = b;
    if (x->t->begin != y->t->begin)
        return x->t->begin < y->t->begin ? -1 : 1;
    return x->t->end < y->t->end ? -1 : x->t->end > y->t->end;
}

static int check_container(qm_bank *b, const qm_st_header *h, qm_status *st)
{
    char shape_s[160];
    for (size_t i = 0; i < h->n_tensors; i++) {
        const qm_st_tensor *t = &h->tensors[i];
        size_t esize = qm_st_dtype_size(t->dtype);
        if (esize == 0)
            return FAIL(st, "%.80s: unknown dtype \"%.15s\"", t->name, t->dtype);
        unsigned long long n = esize;
        for (uint32_t d = 0; d < t->ndim; d++)
            if (qm_mul_u64(n, t->shape[d], &n) != 0) {
                qm__format_shape(shape_s, sizeof shape_s, t->shape, t->ndim);
                return FAIL(st, "%.80s: shape %s of %s overflows 64-bit byte counts", t->name,
                            shape_s, t->dtype);
            }
        if (n != t->end - t->begin) {
            qm__format_shape(shape_s, sizeof shape_s, t->shape, t->ndim);
            return FAIL(st, "%.80s: shape %s of %s needs %llu bytes but data_offsets [%llu, %llu] "
                            "hold %llu",
                        t->name, shape_s, t->dtype, n, (unsigned long long)t->begin,
                        (unsigned long long)t->end, (unsigned long long)(t->end - t->begin));
        }
        if (t->end > b->data_bytes)
            return FAIL(st, "%.80s: data_offsets [%llu, %llu] run past the data section (%llu "
                            "bytes; file truncated?)",
                        t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                        (unsigned long long)b->data_bytes);
        if (((uintptr_t)(b->data + t->begin)) % esize != 0)
            return FAIL(st, "%.80s: data at offset %llu is not aligned to its %zu-byte elements",
                        t->name, (unsigned long long)t->begin, esize);
    }
    if (h->n_tensors < 2)
        return 0;
    span *order = qm_calloc(h->n_tensors, sizeof *order);
    if (!order)
        return qm_status_set(st, QM_ENOMEM, "out of memory checking tensor offsets");
    for (size_t i = 0; i < h->n_tensors; i++)
        order[i].t = &h->tensors[i];
    qsort(order, h->n_tensors, sizeof *order, cmp_span);
    int rc = 0;
    const qm_st_tensor *prev = NULL;
    for (size_t i = 0; i < h->n_tensors; i++) {
        const qm_st_tensor *t = order[i].t;
        if (t->begin == t->end)
            continue; /* empty tensors occupy nothing */
        if (prev && t->begin < prev->end) {
            rc = FAIL(st, "%.80s: data_offsets [%llu, %llu] overlap %.80s [%llu, %llu]", t->name,
                      (unsigned long long)t->begin, (unsigned long long)t->end, prev->name,
                      (unsigned long long)prev->begin, (unsigned long long)prev->end);
            break;
        }
        prev = t;
    }
    qm_free(order);
    return rc;
}

/* ---- layers ---------------------------------------------------------------- */

static int add_warning(qm_bank *b, const char *name, qm_status *st)
{
    char **w = qm_realloc(b->warnings, (b->n_warnings + 2) * sizeof *w);
    if (!w)
        return qm_status_set(st, QM_ENOMEM, "out of memory listing unknown tensors");
    b->warnings = w;
    w[b->n_warnings] = qm_strdup(name);
    if (!w[b->n_warnings])
        return qm_status_set(st, QM_ENOMEM, "out of memory listing unknown tensors");
    w[++b->n_warnings] = NULL;
    return 0;
}

static int fill_view(qm_bank *b, const qm_st_tensor *t, qm_tensor_view *tv, qm_status *st)
{
    if (qm__dtype_from_st(t->dtype, &tv->dtype) != 0)
        return FAIL(st, "%.80s: dtype %s but bank tensors are F32, F16, BF16 or U8", t->name,
                    t->dtype);
    if (t->ndim > 4)
        return FAIL(st, "%.80s: %u dimensions but bank tensors have at most 3", t->name, t->ndim);
    tv->present = 1;
    tv->ndim = t->ndim;
    memcpy(tv->shape, t->shape, t->ndim * sizeof t->shape[0]);
    tv->nbytes = t->end - t->begin;
    tv->offset = t->begin;
    tv->data = b->data + t->begin;
    return 0;
}

static int check_presence(const qm_bank *b, const qm_layer_view *lv, qm_status *st)
{
    const qm_bank_config *cfg = &b->cfg;
    static const qm_bank_tensor required[] = {QM_T_FC1_WEIGHT, QM_T_FC1_SCALES, QM_T_FC2_WEIGHT,
                                              QM_T_FC2_SCALES};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
        if (!lv->t[required[i]].present)
            return FAIL(st, "layers.%u.%s: missing (every layer needs it)", lv->index,
                        qm_bank_tensor_suffix(required[i]));
    if (qm__needs_fc3(cfg)) {
        if (!lv->t[QM_T_FC3_WEIGHT].present || !lv->t[QM_T_FC3_SCALES].present)
            return FAIL(st, "layers.%u.%s: missing but activation swiglu with swiglu_fusion 0 "
                            "needs fc3.weight and fc3.scales",
                        lv->index,
                        qm_bank_tensor_suffix(lv->t[QM_T_FC3_WEIGHT].present ? QM_T_FC3_SCALES
                                                                              : QM_T_FC3_WEIGHT));
    } else {
        for (int t = QM_T_FC3_WEIGHT; t <= QM_T_FC3_BIAS; t++)
            if (lv->t[t].present)
                return FAIL(st, "layers.%u.%s: present but fc3 is used only with activation "
                                "swiglu and swiglu_fusion 0 (bank: %s, fusion %u)",
                            lv->index, qm_bank_tensor_suffix((qm_bank_tensor)t),
                            qm_activation_name(cfg->activation), cfg->swiglu_fusion);
    }
    if (lv->t[QM_T_ROUTER_BIAS].present && !lv->t[QM_T_ROUTER_WEIGHT].present)
        return FAIL(st, "layers.%u.router.bias: present without layers.%u.router.weight",
                    lv->index, lv->index);
    if (lv->t[QM_T_ROUTER_CORRECTION_BIAS].present && cfg->routing.score == QM_ROUTE_SCORE_LEGACY)
        return FAIL(st, "layers.%u.router.correction_bias: present but the bank has no "
                        "qmoe.routing.score (the bias applies to routing scores only)",
                    lv->index);
    return 0;
}

static int build_layers(qm_bank *b, const qm_st_header *h, qm_status *st)
{
    int rc;
    b->layers = qm_calloc(b->cfg.layers, sizeof *b->layers);
    if (!b->layers)
        return qm_status_set(st, QM_ENOMEM, "out of memory for %u layer views", b->cfg.layers);
    for (uint32_t l = 0; l < b->cfg.layers; l++)
        b->layers[l].index = l;
    for (size_t i = 0; i < h->n_tensors; i++) {
        const qm_st_tensor *t = &h->tensors[i];
        uint32_t layer;
        qm_bank_tensor which;
        if (qm__parse_tensor_name(t->name, b->cfg.layers, &layer, &which) != 0) {
            if ((rc = add_warning(b, t->name, st)) != 0)
                return rc;
            continue;
        }
        qm_tensor_view *tv = &b->layers[layer].t[which];
        if ((rc = fill_view(b, t, tv, st)) != 0 ||
            (rc = qm__check_layer_tensor(&b->cfg, t->name, which, tv, st)) != 0)
            return rc;
    }
    for (uint32_t l = 0; l < b->cfg.layers; l++) {
        qm_layer_view *lv = &b->layers[l];
        if ((rc = check_presence(b, lv, st)) != 0)
            return rc;
        lv->bytes_per_expert = 0;
        for (int t = 0; t < QM_T_EXPERT_COUNT; t++)
            lv->bytes_per_expert += qm_expert_slice_bytes(&lv->t[t], b->cfg.experts);
        for (int t = 0; t < QM_T_EXPERT_COUNT; t++)
            b->expert_bytes_total += lv->t[t].present ? lv->t[t].nbytes : 0;
    }
    return 0;
}

static int parse_bank(qm_bank *b, qm_status *st)
{
    qm_st_header *h = NULL;
    int rc;
    if (b->size < 8)
        return FAIL(st, "file is %llu bytes, shorter than the 8-byte safetensors header length",
                    (unsigned long long)b->size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | b->base[i];
    if (hlen > QM_ST_DEFAULT_MAX_HEADER_BYTES)
        return FAIL(st, "safetensors header length %llu exceeds the %u-byte limit",
                    (unsigned long long)hlen, QM_ST_DEFAULT_MAX_HEADER_BYTES);
    if (hlen > b->size - 8)
        return FAIL(st, "safetensors header length %llu but only %llu bytes follow it (file "
                        "truncated?)",
                    (unsigned long long)hlen, (unsigned long long)(b->size - 8));
    b->data = b->base + 8 + hlen;
    b->data_bytes = b->size - 8 - hlen;
    if ((rc = qm_st_header_parse((const char *)b->base + 8, (size_t)hlen, NULL, &h, st)) != 0)
        return rc;
    /* The header is only needed while the views are built from it. */
    if ((rc = check_container(b, h, st)) != 0 ||
        (rc = qm__config_from_metadata(h, &b->cfg, st)) != 0 ||
        (rc = qm__routing_from_metadata(h, &b->cfg, st)) != 0 ||
        (rc = qm__layer_map_from_metadata(h, b->cfg.layers, &b->layer_map, st)) != 0 ||
        (rc = qm__source_check(h, &b->source_json, st)) != 0)
        goto done;
    rc = build_layers(b, h, st);
done:
    qm_st_header_free(h);
    return rc;
}

/* ---- open / close ------------------------------------------------------------ */

static int finish_open(qm_bank *b, qm_bank **out, qm_status *st)
{
    int rc = parse_bank(b, st);
    if (rc != 0) {
        qm_bank_close(b);
        return rc;
    }
    qm_status_clear(st);
    *out = b;
    return 0;
}

int qm_bank_open(const char *path, qm_bank **out, qm_status *st)
{
    qm_bank *b = NULL;
    int fd = -1, rc;
    if (!out || !path)
        return qm_status_set(st, QM_EINVAL, "qm_bank_open: path and out are required");
    *out = NULL;
    b = qm_calloc(1, sizeof *b);
    if (b)
        b->fd = -1;
    if (!b || !(b->path = qm_strdup(path))) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory opening %.128s", path);
        goto fail_alloc;
    }
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = qm_status_set(st, errno == EIO ? QM_EIO : QM_EINVALID_MODEL,
                           "cannot open bank file %.128s: %s", path, strerror(errno));
        goto fail_alloc;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        rc = qm_status_set(st, QM_EIO, "cannot stat %.128s: %s", path, strerror(errno));
        goto fail_fd;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = FAIL(st, "%.128s is not a regular file", path);
        goto fail_fd;
    }
    b->size = (uint64_t)sb.st_size;
    if (b->size < 8) {
        rc = FAIL(st, "file is %llu bytes, shorter than the 8-byte safetensors header length",
                  (unsigned long long)b->size);
        goto fail_fd;
    }
    void *m = mmap(NULL, (size_t)b->size, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        rc = qm_status_set(st, errno == ENOMEM ? QM_ENOMEM : QM_EIO, "cannot map %.128s: %s", path,
                           strerror(errno));
        goto fail_fd;
    }
    /* The fd stays open: qm_bank_check_file fstats it to notice a file
     * truncated under the mapping (reading past the new end is SIGBUS). */
    b->fd = fd;
    b->base = m;
    b->mapped = 1;
    return finish_open(b, out, st);

fail_fd:
    close(fd);
fail_alloc:
    qm_bank_close(b);
    return rc;
}

int qm_bank_open_memory(const void *data, size_t size, qm_bank **out, qm_status *st)
{
    if (!out || (!data && size))
        return qm_status_set(st, QM_EINVAL, "qm_bank_open_memory: data and out are required");
    *out = NULL;
    qm_bank *b = qm_calloc(1, sizeof *b);
    if (!b || !(b->path = qm_strdup(""))) {
        qm_free(b);
        return qm_status_set(st, QM_ENOMEM, "out of memory opening a bank");
    }
    b->fd = -1;
    b->base = data;
    b->size = size;
    return finish_open(b, out, st);
}

void qm_bank_close(qm_bank *bank)
{
    if (!bank)
        return;
    if (bank->mapped)
        munmap((void *)bank->base, (size_t)bank->size);
    if (bank->mapped && bank->fd >= 0)
        close(bank->fd);
    for (size_t i = 0; i < bank->n_warnings; i++)
        qm_free(bank->warnings[i]);
    QM_FREE_ALL(bank->warnings, bank->layer_map, bank->source_json, bank->layers, bank->path, bank);
}

/* ---- accessors --------------------------------------------------------------- */

const qm_bank_config *qm_bank_get_config(const qm_bank *bank) { return &bank->cfg; }
const char *qm_bank_path(const qm_bank *bank) { return bank->path; }
uint64_t qm_bank_file_bytes(const qm_bank *bank) { return bank->size; }
const uint8_t *qm_bank_data(const qm_bank *bank) { return bank->data; }
uint64_t qm_bank_expert_bytes_total(const qm_bank *bank) { return bank->expert_bytes_total; }

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14 */
#endif

uint64_t qm_bank_prefault(const qm_bank *bank, const void *p, uint64_t n)
{
    if (!bank || !bank->mapped || !p || n == 0)
        return 0;
    uintptr_t lo = (uintptr_t)p, base = (uintptr_t)bank->base;
    if (lo < base || lo - base > bank->size || n > bank->size - (lo - base))
        return 0;
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t mask = (uintptr_t)(page > 0 ? page : 4096) - 1;
    uintptr_t from = lo & ~mask, to = lo + (uintptr_t)n;
    if (madvise((void *)from, to - from, MADV_POPULATE_READ) == 0)
        return n;
    (void)madvise((void *)from, to - from, MADV_WILLNEED);
    return 0;
}

void qm_bank_release_pages(const qm_bank *bank, const void *p, uint64_t n)
{
    if (!bank || !bank->mapped || !p || n == 0)
        return;
    uintptr_t lo = (uintptr_t)p, base = (uintptr_t)bank->base;
    if (lo < base || lo - base > bank->size || n > bank->size - (lo - base))
        return;
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t mask = (uintptr_t)(page > 0 ? page : 4096) - 1;
    /* Whole pages inside the range only: a neighbour's bytes stay mapped. */
    uintptr_t from = (lo + mask) & ~mask, to = (lo + (uintptr_t)n) & ~mask;
    if (to > from)
        (void)madvise((void *)from, to - from, MADV_DONTNEED);
}

const void *qm_bank_mapping(const qm_bank *bank, uint64_t *bytes)
{
    if (bytes)
        *bytes = bank->size;
    return bank->base;
}

int qm_bank_check_file(const qm_bank *bank, qm_status *st)
{
    if (!bank || !bank->mapped || bank->fd < 0)
        return 0;
    struct stat sb;
    if (fstat(bank->fd, &sb) != 0)
        return qm_status_set(st, QM_EIO, "cannot stat bank file %.128s: %s", bank->path,
                             strerror(errno));
    if ((uint64_t)sb.st_size < bank->size)
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "bank file %.128s was truncated on disk (%llu < %llu bytes)",
                             bank->path, (unsigned long long)sb.st_size,
                             (unsigned long long)bank->size);
    return 0;
}

const qm_layer_view *qm_bank_layer(const qm_bank *bank, uint32_t layer)
{
    if (!bank || layer >= bank->cfg.layers)
        return NULL;
    return &bank->layers[layer];
}

const uint32_t *qm_bank_layer_map(const qm_bank *bank) { return bank ? bank->layer_map : NULL; }
const char *qm_bank_source_json(const qm_bank *bank) { return bank ? bank->source_json : NULL; }

const char *const *qm_bank_warnings(const qm_bank *bank, size_t *count)
{
    static const char *const none[] = {NULL};
    if (count)
        *count = bank->n_warnings;
    return bank->warnings ? (const char *const *)bank->warnings : none;
}

uint64_t qm_expert_slice_bytes(const qm_tensor_view *tv, uint32_t n_experts)
{
    if (!tv || !tv->present || n_experts == 0)
        return 0;
    return tv->nbytes / n_experts;
}

/* ---- catalog ----------------------------------------------------------------- */

int qm_bank_build_catalog_aligned(const qm_bank *bank, uint32_t layer, uint64_t alignment,
                                  qm_region_catalog **out, qm_status *st)
{
    qm_region_catalog *cat = NULL;
    const qm_layer_view *lv = qm_bank_layer(bank, layer);
    if (!out)
        return qm_status_set(st, QM_EINVAL, "qm_bank_build_catalog: out is required");
    *out = NULL;
    if (!lv)
        return qm_status_set(st, QM_EINVAL, "layer %u out of range (bank has %u layers)", layer,
                             bank ? bank->cfg.layers : 0);
    uint32_t e_count = bank->cfg.experts;
    int rc = qm_catalog_new(layer, e_count, &cat);
    if (rc != 0)
        return qm_status_set(st, rc, "cannot create the catalog of layer %u: %s", layer,
                             qm_strerror(rc));

    /* Only tensors whose leading dimension is the expert and whose bytes split
     * evenly can be sliced; validation guarantees both, but the catalog says
     * why instead of trusting that. */
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        const qm_tensor_view *tv = &lv->t[t];
        char name[64];
        if (!tv->present)
            continue;
        qm_bank_tensor_name(layer, (qm_bank_tensor)t, name, sizeof name);
        if (tv->ndim == 0 || tv->shape[0] != e_count || tv->nbytes % e_count != 0) {
            char detail[160];
            snprintf(detail, sizeof detail, "%s: leading dim %llu != experts %u", name,
                     tv->ndim ? (unsigned long long)tv->shape[0] : 0ull, e_count);
            qm_catalog_set_nonpageable(cat, QM_NONPAGEABLE_NOT_EXPERT_MAJOR, detail);
            goto done;
        }
        uint64_t slice = tv->nbytes / e_count;
        if (alignment > 1 && (tv->offset % alignment != 0 || slice % alignment != 0)) {
            char detail[160];
            snprintf(detail, sizeof detail,
                     "%s: offset %llu / slice %llu not multiples of the %llu-byte copy granularity",
                     name, (unsigned long long)tv->offset, (unsigned long long)slice,
                     (unsigned long long)alignment);
            qm_catalog_set_nonpageable(cat, QM_NONPAGEABLE_MISALIGNED, detail);
            goto done;
        }
    }
    for (uint32_t e = 0; e < e_count; e++) {
        for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
            const qm_tensor_view *tv = &lv->t[t];
            if (!tv->present)
                continue;
            uint64_t slice = tv->nbytes / e_count;
            qm_region r = {.tensor = (uint32_t)t, .offset = tv->offset + (uint64_t)e * slice,
                           .length = slice};
            if ((rc = qm_catalog_add_region(cat, e, r)) != 0) {
                qm_catalog_free(cat);
                return qm_status_set(st, rc, "cannot add expert %u's regions to the catalog of "
                                             "layer %u: %s", e, layer, qm_strerror(rc));
            }
        }
    }
done:
    *out = cat;
    return 0;
}

int qm_bank_build_catalog(const qm_bank *bank, uint32_t layer, qm_region_catalog **out,
                          qm_status *st)
{
    return qm_bank_build_catalog_aligned(bank, layer, 0, out, st);
}
