/* qm_hotness.c - hotness profiles: decayed counts, atomic save, validated load.
 *
 * File (little-endian as written by the host; a profile is machine-local
 * state, not an interchange format):
 *   0  "QMHOTNES"          8 bytes magic
 *   8  u32 version = 1
 *  12  u32 layers, 16 u32 experts, 20 u32 reserved (0)
 *  24  u64 fingerprint (qm_hotness_key_of_bank)
 *  32  u64 records
 *  40  f64 decay the counts were kept with
 *  48  f64 counts[layers * experts], row-major by layer
 *  end u64 FNV-1a 64 of every byte before it
 * Anything else — other size, magic, version, key, checksum, a negative or
 * non-finite count — makes the file "ignored with a warning". */
#include "qm_hotness.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_io.h"
#include "qm_scratch.h"

#define QM__HOT_MAGIC "QMHOTNES"
#define QM__HOT_VERSION 1u
#define QM__HOT_HEADER 48u
/* A profile larger than this is not ours (1M experts' counts). */
#define QM__HOT_MAX_CELLS (1u << 20)

struct qm_hotness {
    qm_hotness_key key;
    double decay;
    uint64_t records;
    void *arrays;   /* owns the five arrays below, carved from one block */
    double *counts; /* [layers * experts] */
    uint8_t *seen;  /* [experts] scratch for record() */
    /* policy params view */
    uint32_t *lists;       /* [layers * experts] */
    const uint32_t **hot;  /* [layers] */
    size_t *hot_len;       /* [layers] */
    double *freq;          /* [layers * experts] policy prior view */
    const double **prior;  /* [layers] */
    size_t *prior_len;     /* [layers] */
};

static uint64_t qm__fnv1a(uint64_t h, const void *data, size_t n)
{
    const uint8_t *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h;
}
#define QM__FNV_OFFSET 14695981039346656037ull

void qm_hotness_key_of_bank(const qm_bank *bank, qm_hotness_key *out)
{
    const qm_bank_config *c = qm_bank_get_config(bank);
    uint32_t fields[10] = {c->layers, c->experts, c->hidden, c->inter,        c->k,
                           c->bits,   c->block_size, (uint32_t)c->activation, c->swiglu_fusion,
                           (uint32_t)c->normalize_routing};
    uint64_t h = qm__fnv1a(QM__FNV_OFFSET, fields, sizeof fields);
    uint64_t bytes = qm_bank_file_bytes(bank);
    h = qm__fnv1a(h, &bytes, sizeof bytes);
    out->layers = c->layers;
    out->experts = c->experts;
    out->fingerprint = h ? h : 1;
}

/* The profile's arrays, all of one lifetime, laid out in one block. */
static void qm__hot_layout(qm__carver *c, const qm_hotness_key *key, qm_hotness *h)
{
    size_t cells = (size_t)key->layers * key->experts;
    h->counts = qm__carve(c, cells, sizeof *h->counts);
    h->seen = qm__carve(c, key->experts, 1);
    h->lists = qm__carve(c, cells, sizeof *h->lists);
    h->hot = qm__carve(c, key->layers, sizeof *h->hot);
    h->hot_len = qm__carve(c, key->layers, sizeof *h->hot_len);
    h->freq = qm__carve(c, cells, sizeof *h->freq);
    h->prior = qm__carve(c, key->layers, sizeof *h->prior);
    h->prior_len = qm__carve(c, key->layers, sizeof *h->prior_len);
}

int qm_hotness_new(const qm_hotness_key *key, double decay, qm_hotness **out, qm_status *st)
{
    if (!key || !out)
        return qm_status_set(st, QM_EINVAL, "qm_hotness_new: NULL argument");
    *out = NULL;
    if (!(decay > 0.0 && decay <= 1.0))
        return qm_status_set(st, QM_EINVAL, "hotness decay %g outside (0, 1]", decay);
    if (key->layers == 0 || key->experts == 0 ||
        (uint64_t)key->layers * key->experts > QM__HOT_MAX_CELLS)
        return qm_status_set(st, QM_EINVAL, "hotness profile of %u x %u experts not supported",
                             key->layers, key->experts);
    qm_hotness *h = qm_calloc(1, sizeof *h);
    if (!h)
        goto oom;
    h->key = *key;
    h->decay = decay;
    qm__carver c = {0};
    qm__hot_layout(&c, key, h);
    h->arrays = qm_calloc(1, c.off);
    if (!h->arrays)
        goto oom;
    c = (qm__carver){.base = h->arrays};
    qm__hot_layout(&c, key, h);
    *out = h;
    return 0;
oom:
    qm_hotness_free(h);
    return qm_status_set(st, QM_ENOMEM, "out of memory for a hotness profile");
}

void qm_hotness_free(qm_hotness *h)
{
    if (!h)
        return;
    qm_free(h->arrays);
    qm_free(h);
}

void qm_hotness_record(qm_hotness *h, uint32_t layer, const uint32_t *route, size_t n)
{
    if (!h || layer >= h->key.layers || (n && !route))
        return;
    uint32_t E = h->key.experts;
    double *c = h->counts + (size_t)layer * E;
    for (uint32_t e = 0; e < E; e++)
        c[e] *= h->decay;
    memset(h->seen, 0, E);
    for (size_t i = 0; i < n; i++) {
        uint32_t e = route[i];
        if (e < E && !h->seen[e]) {
            h->seen[e] = 1;
            c[e] += 1.0;
        }
    }
    h->records++;
}

double qm_hotness_count(const qm_hotness *h, uint32_t layer, uint32_t expert)
{
    if (!h || layer >= h->key.layers || expert >= h->key.experts)
        return 0.0;
    return h->counts[(size_t)layer * h->key.experts + expert];
}

uint64_t qm_hotness_records(const qm_hotness *h)
{
    return h ? h->records : 0;
}

/* Insertion sort: E is at most a few hundred and this runs at session creation. */
static size_t qm__sorted_layer(const qm_hotness *h, uint32_t layer, uint32_t *out)
{
    const double *c = h->counts + (size_t)layer * h->key.experts;
    size_t n = 0;
    for (uint32_t e = 0; e < h->key.experts; e++) {
        if (!(c[e] > 0.0))
            continue;
        size_t j = n++;
        while (j > 0 && c[out[j - 1]] < c[e]) {
            out[j] = out[j - 1];
            j--;
        }
        out[j] = e;
    }
    return n;
}

int qm_hotness_hottest(const qm_hotness *h, uint32_t layer, uint32_t *out, size_t cap)
{
    if (!h || layer >= h->key.layers)
        return QM_EINVAL;
    uint32_t *tmp = h->lists + (size_t)layer * h->key.experts;
    size_t n = qm__sorted_layer(h, layer, tmp);
    for (size_t i = 0; out && i < n && i < cap; i++)
        out[i] = tmp[i];
    return (int)n;
}

typedef struct qm__hot_pick {
    double count;
    uint32_t layer, expert;
} qm__hot_pick;

static int qm__hotter(const void *a, const void *b)
{
    const qm__hot_pick *x = a, *y = b;
    if (x->count != y->count)
        return x->count > y->count ? -1 : 1;
    if (x->layer != y->layer)
        return x->layer < y->layer ? -1 : 1;
    return x->expert < y->expert ? -1 : x->expert > y->expert;
}

long qm_hotness_hottest_all(const qm_hotness *h, uint32_t *layers, uint32_t *experts,
                            size_t cap)
{
    if (!h || (cap && (!layers || !experts)))
        return QM_EINVAL;
    const size_t E = h->key.experts;
    qm__hot_pick *picks = qm_malloc(((size_t)h->key.layers * E + 1) * sizeof *picks);
    uint32_t *tmp = qm_malloc((E + 1) * sizeof *tmp);
    if (!picks || !tmp) {
        qm_free(picks);
        qm_free(tmp);
        return QM_ENOMEM;
    }
    size_t n = 0;
    for (uint32_t l = 0; l < h->key.layers; l++) {
        size_t got = qm__sorted_layer(h, l, tmp);
        for (size_t i = 0; i < got; i++)
            picks[n++] = (qm__hot_pick){qm_hotness_count(h, l, tmp[i]), l, tmp[i]};
    }
    qsort(picks, n, sizeof *picks, qm__hotter);
    for (size_t i = 0; i < n && i < cap; i++) {
        layers[i] = picks[i].layer;
        experts[i] = picks[i].expert;
    }
    qm_free(picks);
    qm_free(tmp);
    return (long)n;
}

int qm_hotness_policy_params(qm_hotness *h, qm_policy_params *params, qm_status *st)
{
    if (!h || !params)
        return qm_status_set(st, QM_EINVAL, "qm_hotness_policy_params: NULL argument");
    for (uint32_t l = 0; l < h->key.layers; l++) {
        uint32_t *list = h->lists + (size_t)l * h->key.experts;
        h->hot_len[l] = qm__sorted_layer(h, l, list);
        h->hot[l] = h->hot_len[l] ? list : NULL;
    }
    params->hot = (const uint32_t *const *)h->hot;
    params->hot_len = h->hot_len;
    params->n_hot_banks = h->key.layers;
    return 0;
}

int qm_hotness_policy_prior(qm_hotness *h, qm_policy_params *params, qm_status *st)
{
    if (!h || !params)
        return qm_status_set(st, QM_EINVAL, "qm_hotness_policy_prior: NULL argument");
    /* Every layer is recorded once a call, so a layer's records are about
     * the profile's over its layers; its counts, decayed once a record,
     * sum a use's weight over those n records: 1 + d + ... + d^(n-1). */
    double n = floor((double)h->records / h->key.layers);
    double weight = h->decay < 1.0 ? (1.0 - pow(h->decay, n)) / (1.0 - h->decay) : n;
    size_t E = h->key.experts;
    for (uint32_t l = 0; l < h->key.layers; l++) {
        double *f = h->freq + (size_t)l * E;
        const double *c = h->counts + (size_t)l * E;
        int any = 0;
        for (size_t e = 0; e < E; e++) {
            f[e] = weight >= 1.0 ? c[e] / weight : 0.0;
            if (!(f[e] >= 0.0)) f[e] = 0.0;
            if (f[e] > 1.0) f[e] = 1.0;
            any |= f[e] > 0.0;
        }
        h->prior[l] = any ? f : NULL;
        h->prior_len[l] = any ? E : 0;
    }
    params->prior = h->prior;
    params->prior_len = h->prior_len;
    params->n_prior_banks = h->key.layers;
    params->prior_visits = weight; /* what the counts weigh, in records of a layer */
    return 0;
}

int qm_hotness_save(const qm_hotness *h, const char *path, qm_status *st)
{
    if (!h || !path)
        return qm_status_set(st, QM_EINVAL, "qm_hotness_save: NULL argument");
    size_t cells = (size_t)h->key.layers * h->key.experts;
    size_t size = QM__HOT_HEADER + cells * 8 + 8;
    uint8_t *buf = qm_malloc(size);
    if (!buf)
        return qm_status_set(st, QM_ENOMEM, "out of memory saving the hotness profile");
    memset(buf, 0, QM__HOT_HEADER);
    memcpy(buf, QM__HOT_MAGIC, 8);
    uint32_t u32[4] = {QM__HOT_VERSION, h->key.layers, h->key.experts, 0};
    memcpy(buf + 8, u32, sizeof u32);
    memcpy(buf + 24, &h->key.fingerprint, 8);
    memcpy(buf + 32, &h->records, 8);
    memcpy(buf + 40, &h->decay, 8);
    memcpy(buf + QM__HOT_HEADER, h->counts, cells * 8);
    uint64_t sum = qm__fnv1a(QM__FNV_OFFSET, buf, size - 8);
    memcpy(buf + size - 8, &sum, 8);

    size_t tlen = strlen(path) + 32;
    char *tmp = qm_malloc(tlen);
    int rc = 0;
    if (!tmp) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory saving the hotness profile");
        goto free_buffers;
    }
    snprintf(tmp, tlen, "%s.tmp.%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        rc = qm_status_set(st, QM_EIO, "cannot create %s: %s", tmp, strerror(errno));
        goto free_buffers;
    }
    if (qm_pwrite_all(fd, buf, size, 0) || fsync(fd)) {
        rc = qm_status_set(st, QM_EIO, "cannot write %s: %s", tmp, strerror(errno));
        goto close_tmp;
    }
    if (close(fd)) {
        rc = qm_status_set(st, QM_EIO, "cannot close %s: %s", tmp, strerror(errno));
        goto unlink_tmp;
    }
    if (rename(tmp, path)) {
        rc = qm_status_set(st, QM_EIO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
        goto unlink_tmp;
    }
    /* Make the rename itself durable. */
    {
        char *dir = qm_strdup(path);
        if (dir) {
            char *slash = strrchr(dir, '/');
            const char *d = ".";
            if (slash) {
                *slash = '\0';
                d = slash == dir ? "/" : dir;
            }
            int dfd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (dfd >= 0) {
                (void)fsync(dfd);
                close(dfd);
            }
            qm_free(dir);
        }
    }
    goto free_buffers;
close_tmp:
    close(fd);
unlink_tmp:
    unlink(tmp);
free_buffers:
    qm_free(tmp);
    qm_free(buf);
    return rc;
}

static void qm__warn(char *warning, size_t cap, const char *path, const char *why)
{
    if (warning && cap)
        snprintf(warning, cap, "hotness profile %s ignored: %s", path, why);
}

/* The file's first n bytes in a new buffer, or NULL: out of memory (*rc and st
 * set) or a short read (warned; *rc left 0, the profile is ignored). */
static uint8_t *qm__read_head(int fd, size_t n, const char *path, char *warning, size_t warning_cap,
                              int *rc, qm_status *st)
{
    uint8_t *buf = qm_malloc(n);
    if (!buf) {
        *rc = qm_status_set(st, QM_ENOMEM, "out of memory loading the hotness profile");
        return NULL;
    }
    if (pread(fd, buf, n, 0) != (ssize_t)n) {
        qm__warn(warning, warning_cap, path, "short read");
        qm_free(buf);
        return NULL;
    }
    return buf;
}

int qm_hotness_load(const char *path, const qm_hotness_key *key, double decay, qm_hotness **out,
                    char *warning, size_t warning_cap, qm_status *st)
{
    if (warning && warning_cap)
        warning[0] = '\0';
    if (!path || !key || !out)
        return qm_status_set(st, QM_EINVAL, "qm_hotness_load: NULL argument");
    int rc = qm_hotness_new(key, decay, out, st);
    if (rc)
        return rc;
    qm_hotness *h = *out;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno != ENOENT)
            qm__warn(warning, warning_cap, path, strerror(errno));
        return 0;
    }
    size_t cells = (size_t)key->layers * key->experts;
    size_t want = QM__HOT_HEADER + cells * 8 + 8;
    struct stat sb;
    uint8_t *buf = NULL;
    char why[160];
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode)) {
        qm__warn(warning, warning_cap, path, "not a regular file");
        goto close_file;
    }
    if ((uint64_t)sb.st_size < QM__HOT_HEADER) {
        snprintf(why, sizeof why, "truncated (%lld bytes)", (long long)sb.st_size);
        qm__warn(warning, warning_cap, path, why);
        goto close_file;
    }
    buf = qm__read_head(fd, QM__HOT_HEADER, path, warning, warning_cap, &rc, st);
    if (!buf)
        goto close_file;
    uint32_t u32[4];
    uint64_t fp;
    memcpy(u32, buf + 8, sizeof u32);
    memcpy(&fp, buf + 24, 8);
    if (memcmp(buf, QM__HOT_MAGIC, 8)) {
        qm__warn(warning, warning_cap, path, "bad magic (not a hotness profile)");
        goto close_file;
    }
    if (u32[0] != QM__HOT_VERSION) {
        snprintf(why, sizeof why, "version %u, expected %u", u32[0], QM__HOT_VERSION);
        qm__warn(warning, warning_cap, path, why);
        goto close_file;
    }
    if (u32[1] != key->layers || u32[2] != key->experts ||
        (key->fingerprint && fp != key->fingerprint)) {
        snprintf(why, sizeof why,
                 "made for another model (%u layers x %u experts, fingerprint %016llx; this one "
                 "%u x %u, %016llx)",
                 u32[1], u32[2], (unsigned long long)fp, key->layers, key->experts,
                 (unsigned long long)key->fingerprint);
        qm__warn(warning, warning_cap, path, why);
        goto close_file;
    }
    if ((uint64_t)sb.st_size != want) {
        snprintf(why, sizeof why, "size %lld bytes, expected %zu", (long long)sb.st_size, want);
        qm__warn(warning, warning_cap, path, why);
        goto close_file;
    }
    qm_free(buf);
    buf = qm__read_head(fd, want, path, warning, warning_cap, &rc, st);
    if (!buf)
        goto close_file;
    uint64_t sum;
    memcpy(&sum, buf + want - 8, 8);
    if (qm__fnv1a(QM__FNV_OFFSET, buf, want - 8) != sum) {
        qm__warn(warning, warning_cap, path, "checksum mismatch (corrupt)");
        goto close_file;
    }
    for (size_t i = 0; i < cells; i++) {
        double c;
        memcpy(&c, buf + QM__HOT_HEADER + i * 8, 8);
        if (!isfinite(c) || c < 0.0) {
            snprintf(why, sizeof why, "count %zu is %g (corrupt)", i, c);
            qm__warn(warning, warning_cap, path, why);
            memset(h->counts, 0, cells * sizeof *h->counts);
            goto close_file;
        }
        h->counts[i] = c;
    }
    memcpy(&h->records, buf + 32, 8);
close_file:
    qm_free(buf);
    close(fd);
    if (rc) {
        qm_hotness_free(h);
        *out = NULL;
    }
    return rc;
}
