/* qm_bank_writer.c - the bank writer (see qm_bank_writer.h): planning and
 * the header; the partial file, its lock and its trailer; finishing. */
#include "qm_bank_writer.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_bank_internal.h"
#include "qm_io.h"

#define PARTIAL_MAGIC "QMOEPART" /* bytes 0..7 of an unfinished file */
#define TRAILER_MAGIC "QMIMPRT1"

typedef struct trailer {
    char magic[8];
    uint32_t layers_done;
    uint32_t reserved;
    double value;
    uint64_t bank_bytes;
} trailer;

struct qm_bank_writer {
    uint32_t layers, experts;
    char *out, *partial, tool[32];
    int fd;
    qm_bank_plan_tensor *plan; /* [layers][QM_T_COUNT] */
    uint64_t *begin;           /* [layers][QM_T_COUNT], from the start of the data */
    qm_st_tensor *tensors;     /* the header's, in listing order */
    size_t n_tensors;
    qm_st_meta *meta;        /* copies */
    size_t n_meta, deferred; /* deferred: index into meta, or n_meta for none */
    uint64_t data_start, total, header_len;
    uint32_t layers_done, layers_this_run;
    int progress;
    struct timespec started;
    uint64_t source_at_start;
    long kill_after;
    int kill_signal;
};

/* ---- the plan -------------------------------------------------------------- */

static uint64_t ceil_div(uint64_t a, uint64_t b)
{
    return (a + b - 1) / b;
}

void qm_bank_plan_layer(const qm_bank_config *cfg, const qm_bank_layer_opts *o,
                        qm_bank_plan_tensor t[QM_T_COUNT])
{
    const uint64_t e = cfg->experts, pack = 8 / cfg->bits;
    const int gated = cfg->activation == QM_ACT_SWIGLU;
    const int fused = gated && cfg->swiglu_fusion != 0, nproj = gated && !fused ? 3 : 2;
    const int bias[3] = {o->fc1_bias, o->fc2_bias, o->fc3_bias};
    memset(t, 0, QM_T_COUNT * sizeof *t);
    for (int p = 0; p < nproj; p++) {
        uint64_t n = p == 0   ? (fused ? 2ull * cfg->inter : cfg->inter)
                     : p == 1 ? cfg->hidden
                              : cfg->inter;
        uint64_t k = p == 1 ? cfg->inter : cfg->hidden;
        uint64_t nblk = cfg->block_size ? ceil_div(k, cfg->block_size) : 1;
        qm_bank_plan_tensor *w = &t[QM_T_FC1_WEIGHT + 4 * p];
        w[0] = (qm_bank_plan_tensor){1, QM_DTYPE_U8, 3, {e, n, k / pack}};
        w[1] = cfg->block_size ? (qm_bank_plan_tensor){1, o->scale_dtype, 3, {e, n, nblk}}
                               : (qm_bank_plan_tensor){1, o->scale_dtype, 2, {e, n, 0}};
        if (o->zero_points)
            w[2] = cfg->block_size
                       ? (qm_bank_plan_tensor){1, QM_DTYPE_U8, 3, {e, n, ceil_div(nblk, pack)}}
                       : (qm_bank_plan_tensor){1, QM_DTYPE_U8, 2, {e, ceil_div(n, pack), 0}};
        if (bias[p]) w[3] = (qm_bank_plan_tensor){1, o->bias_dtype, 2, {e, n, 0}};
    }
    if (o->router_weight)
        t[QM_T_ROUTER_WEIGHT] = (qm_bank_plan_tensor){1, o->router_dtype, 2, {e, cfg->hidden, 0}};
    if (o->router_bias)
        t[QM_T_ROUTER_BIAS] = (qm_bank_plan_tensor){1, o->router_dtype, 1, {e, 0, 0}};
    if (o->correction_bias)
        t[QM_T_ROUTER_CORRECTION_BIAS] = (qm_bank_plan_tensor){1, QM_DTYPE_F32, 1, {e, 0, 0}};
}

static void fmt_float(char *buf, size_t n, float v)
{
    if (isinf(v))
        snprintf(buf, n, "%s", v > 0 ? "inf" : "-inf");
    else
        snprintf(buf, n, "%.9g", (double)v);
}

void qm_bank_std_meta(const qm_bank_config *c, char v[12][32], qm_st_meta *meta)
{
    snprintf(v[0], 32, "%u", c->layers);
    snprintf(v[1], 32, "%u", c->experts);
    snprintf(v[2], 32, "%u", c->hidden);
    snprintf(v[3], 32, "%u", c->inter);
    snprintf(v[4], 32, "%u", c->k);
    snprintf(v[5], 32, "%u", c->bits);
    snprintf(v[6], 32, "%u", c->block_size);
    snprintf(v[7], 32, "%u", c->swiglu_fusion);
    fmt_float(v[8], 32, c->alpha);
    fmt_float(v[9], 32, c->beta);
    fmt_float(v[10], 32, c->limit);
    snprintf(v[11], 32, "%d", c->normalize_routing ? 1 : 0);
    const qm_st_meta rows[QM_BANK_STD_META] = {
        {"qmoe.format", "1"},
        {"qmoe.layers", v[0]},
        {"qmoe.experts", v[1]},
        {"qmoe.hidden_size", v[2]},
        {"qmoe.inter_size", v[3]},
        {"qmoe.k", v[4]},
        {"qmoe.activation", (char *)qm_activation_name(c->activation)},
        {"qmoe.bits", v[5]},
        {"qmoe.block_size", v[6]},
        {"qmoe.swiglu_fusion", v[7]},
        {"qmoe.normalize_routing_weights", v[11]},
        {"qmoe.activation_alpha", v[8]},
        {"qmoe.activation_beta", v[9]},
        {"qmoe.swiglu_limit", v[10]},
    };
    memcpy(meta, rows, sizeof rows);
}

static const char *st_dtype_name(qm_dtype d)
{
    return d == QM_DTYPE_F32    ? "F32"
           : d == QM_DTYPE_F16  ? "F16"
           : d == QM_DTYPE_BF16 ? "BF16"
                                : "U8";
}

static uint64_t plan_bytes(const qm_bank_plan_tensor *p)
{
    if (!p->present) return 0;
    uint64_t n = qm_dtype_size(p->dtype);
    for (uint32_t d = 0; d < p->ndim; d++)
        n *= p->shape[d];
    return n;
}

/* Places and lists the tensors: per element width (4, 2, 1), layer by
 * layer, in the spec's order. */
static int plan_file(qm_bank_writer *w, const qm_bank_writer_spec *s, qm_status *st)
{
    static const qm_bank_tensor natural[QM_T_COUNT] = {0, 1, 2,  3,  4,  5,  6, 7,
                                                       8, 9, 10, 11, 12, 13, 14};
    const qm_bank_tensor *order = s->order ? s->order : natural;
    size_t n_order = s->order ? s->n_order : QM_T_COUNT;
    size_t cells = (size_t)w->layers * QM_T_COUNT;
    w->plan = qm_calloc(cells, sizeof *w->plan);
    w->begin = qm_calloc(cells, sizeof *w->begin);
    w->tensors = qm_calloc(cells, sizeof *w->tensors);
    if (!w->plan || !w->begin || !w->tensors)
        return qm_status_set(st, QM_ENOMEM, "out of memory planning %u layers", w->layers);
    memcpy(w->plan, s->tensors, cells * sizeof *w->plan);
    uint64_t off = 0;
    static const size_t widths[] = {4, 2, 1};
    for (size_t wi = 0; wi < 3; wi++)
        for (uint32_t l = 0; l < w->layers; l++)
            for (size_t i = 0; i < n_order; i++) {
                size_t c = (size_t)l * QM_T_COUNT + order[i];
                if (w->plan[c].present && qm_dtype_size(w->plan[c].dtype) == widths[wi]) {
                    w->begin[c] = off;
                    off += plan_bytes(&w->plan[c]);
                }
            }
    w->total = off;
    for (uint32_t l = 0; l < w->layers; l++)
        for (size_t i = 0; i < n_order; i++) {
            size_t c = (size_t)l * QM_T_COUNT + order[i];
            const qm_bank_plan_tensor *p = &w->plan[c];
            if (!p->present) continue;
            qm_st_tensor *tt = &w->tensors[w->n_tensors++];
            if (!(tt->name = qm_malloc(64)))
                return qm_status_set(st, QM_ENOMEM, "out of memory planning the header");
            qm_bank_tensor_name(l, order[i], tt->name, 64);
            snprintf(tt->dtype, sizeof tt->dtype, "%s", st_dtype_name(p->dtype));
            tt->ndim = p->ndim;
            memcpy(tt->shape, p->shape, sizeof p->shape);
            tt->begin = w->begin[c];
            tt->end = w->begin[c] + plan_bytes(p);
        }
    return 0;
}

static int copy_meta(qm_bank_writer *w, const qm_bank_writer_spec *s, qm_status *st)
{
    w->meta = qm_calloc(s->n_meta ? s->n_meta : 1, sizeof *w->meta);
    if (!w->meta) return qm_status_set(st, QM_ENOMEM, "out of memory");
    w->deferred = s->n_meta;
    for (size_t i = 0; i < s->n_meta; i++) {
        w->meta[i].key = qm_strdup(s->meta[i].key);
        w->meta[i].value = qm_strdup(s->meta[i].value);
        w->n_meta = i + 1;
        if (!w->meta[i].key || !w->meta[i].value)
            return qm_status_set(st, QM_ENOMEM, "out of memory");
        if (s->deferred_key && strcmp(s->meta[i].key, s->deferred_key) == 0) w->deferred = i;
    }
    if (s->deferred_key && w->deferred == s->n_meta)
        return qm_status_set(st, QM_EINTERNAL, "deferred key %s is not in the metadata",
                             s->deferred_key);
    return 0;
}

static int format_header(const qm_bank_writer *w, char **json, size_t *len, qm_status *st)
{
    return qm_st_header_format(w->tensors, w->n_tensors, w->meta, w->n_meta, 8, json, len, st);
}

/* The bank loader's verdict on the mapping [m, m + size), which it unmaps:
 * 0 or its code, with its sentence in *bst. */
static int open_unmap(void *m, size_t size, qm_status *bst)
{
    qm_bank *bank = NULL;
    qm_status_clear(bst);
    int rc = qm_bank_open_memory(m, size, &bank, bst);
    qm_bank_close(bank);
    munmap(m, size);
    return rc;
}

/* The bank loader's verdict on this header over a data section of zeros:
 * an anonymous mapping of the file's size (untouched pages cost nothing). */
static int check_header(const qm_bank_writer *w, const char *json, size_t len, qm_status *st)
{
    size_t size = (size_t)(w->data_start + w->total);
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (m == MAP_FAILED)
        return qm_status_set(st, QM_ENOMEM, "cannot reserve %zu bytes to check the header: %s",
                             size, strerror(errno));
    for (int i = 0; i < 8; i++)
        ((uint8_t *)m)[i] = (uint8_t)((uint64_t)len >> (8 * i));
    memcpy((uint8_t *)m + 8, json, len);
    qm_status bst;
    int rc = open_unmap(m, size, &bst);
    if (rc == QM_ENOMEM) return qm_status_set(st, rc, "%s", bst.msg);
    if (rc) return qm_status_set(st, QM_EINVALID_MODEL, "%s", bst.msg);
    return 0;
}

/* ---- the partial file ------------------------------------------------------- */

static int pwrite_all(qm_bank_writer *w, const void *buf, uint64_t n, uint64_t at, qm_status *st)
{
    if (qm_pwrite_all(w->fd, buf, n, at))
        return qm_status_set(st, QM_EIO, "writing %.200s: %s", w->partial, strerror(errno));
    return 0;
}

static int pread_all(int fd, void *buf, uint64_t n, uint64_t at)
{
    uint8_t *p = buf;
    while (n) {
        ssize_t k = pread(fd, p, (size_t)n, (off_t)at);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k;
        at += (uint64_t)k;
        n -= (uint64_t)k;
    }
    return 0;
}

static int same_file(const struct stat *a, const struct stat *b)
{
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

/* OUT may be absent or a regular file (or a link, which the rename
 * replaces); a directory or a device there is a mistake of the caller's. */
static int check_out(const char *out, qm_status *st)
{
    struct stat sb;
    if (lstat(out, &sb) != 0) return 0;
    if (S_ISREG(sb.st_mode) || S_ISLNK(sb.st_mode)) return 0;
    return qm_status_set(st, QM_EINVAL, "%.200s is %s, not a bank file to write", out,
                         S_ISDIR(sb.st_mode) ? "a directory" : "not a regular file");
}

/* Takes OUT.partial: created exclusively, or an existing regular file no
 * one holds; locked either way, and still the file at that path once
 * locked. *existed says which. */
static int take_partial(qm_bank_writer *w, int *existed, qm_status *st)
{
    for (int attempt = 0; attempt < 4; attempt++) {
        *existed = 0;
        int fd = open(w->partial, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (fd < 0 && errno != EEXIST)
            return qm_status_set(
                st, errno == ENOENT || errno == ENOTDIR || errno == EACCES ? QM_EINVAL : QM_EIO,
                "cannot create %.200s: %s", w->partial, strerror(errno));
        if (fd < 0) {
            struct stat lsb;
            if (lstat(w->partial, &lsb) != 0) continue; /* gone again: retry */
            if (S_ISLNK(lsb.st_mode))
                return qm_status_set(st, QM_EINVAL,
                                     "%.200s is a symbolic link: refusing to write through it "
                                     "(remove it)",
                                     w->partial);
            if (!S_ISREG(lsb.st_mode) || lsb.st_nlink != 1)
                return qm_status_set(st, QM_EINVAL,
                                     "%.200s exists and is not a regular file of its own "
                                     "(remove it)",
                                     w->partial);
            fd = open(w->partial, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
            if (fd < 0) {
                if (errno == ENOENT) continue;
                return qm_status_set(st, QM_EINVAL, "cannot open %.200s: %s", w->partial,
                                     strerror(errno));
            }
            *existed = 1;
        }
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            int e = errno;
            close(fd);
            if (e == EWOULDBLOCK)
                return qm_status_set(st, QM_EIN_USE,
                                     "%.200s is being written by another process (it holds the "
                                     "file's lock); wait for it or stop it",
                                     w->partial);
            return qm_status_set(st, QM_EIO, "cannot lock %.200s: %s", w->partial, strerror(e));
        }
        struct stat fsb, lsb;
        if (fstat(fd, &fsb) != 0 || lstat(w->partial, &lsb) != 0 || !same_file(&fsb, &lsb) ||
            !S_ISREG(fsb.st_mode)) {
            close(fd); /* replaced while we locked it: look again */
            continue;
        }
        w->fd = fd;
        return 0;
    }
    return qm_status_set(st, QM_EIN_USE, "%.200s keeps changing under this process", w->partial);
}

static int write_trailer(qm_bank_writer *w, uint32_t layers_done, double value, qm_status *st)
{
    trailer tr = {
        .layers_done = layers_done, .value = value, .bank_bytes = w->data_start + w->total};
    memcpy(tr.magic, TRAILER_MAGIC, 8);
    return pwrite_all(w, &tr, sizeof tr, w->data_start + w->total, st);
}

/* 0 with the record read when the partial file continues this header;
 * QM_ECONFLICT with the reason otherwise. */
static int check_partial(qm_bank_writer *w, const char *json, size_t len, double *value,
                         qm_status *st)
{
    struct stat sb;
    if (fstat(w->fd, &sb) != 0)
        return qm_status_set(st, QM_EIO, "cannot stat %.200s: %s", w->partial, strerror(errno));
    uint64_t want = w->data_start + w->total + sizeof(trailer);
    if ((uint64_t)sb.st_size != want)
        return qm_status_set(st, QM_ECONFLICT,
                             "%.200s is %llu bytes, but this import's partial file has %llu: it "
                             "was written for other arguments or another checkpoint (remove it, "
                             "or run without --resume)",
                             w->partial, (unsigned long long)sb.st_size, (unsigned long long)want);
    char *have = qm_malloc(len + 8);
    if (!have) return qm_status_set(st, QM_ENOMEM, "out of memory reading %.200s", w->partial);
    int rc = 0;
    if (pread_all(w->fd, have, len + 8, 0) != 0 || memcmp(have, PARTIAL_MAGIC, 8) != 0 ||
        memcmp(have + 8, json, len) != 0) {
        size_t at = 0;
        while (at < len && have[8 + at] == json[at])
            at++;
        rc = qm_status_set(st, QM_ECONFLICT,
                           "%.200s has another header (it differs at byte %zu): it was written "
                           "for other arguments or another checkpoint (remove it, or run "
                           "without --resume)",
                           w->partial, memcmp(have, PARTIAL_MAGIC, 8) ? (size_t)0 : at + 8);
    }
    qm_free(have);
    if (rc) return rc;
    trailer tr;
    if (pread_all(w->fd, &tr, sizeof tr, w->data_start + w->total) != 0 ||
        memcmp(tr.magic, TRAILER_MAGIC, 8) != 0 || tr.layers_done > w->layers ||
        tr.bank_bytes != w->data_start + w->total || !(tr.value >= 0))
        return qm_status_set(st, QM_ECONFLICT,
                             "%.200s: its progress record is damaged (remove it, or run without "
                             "--resume)",
                             w->partial);
    w->layers_done = tr.layers_done;
    *value = tr.value;
    return 0;
}

static int start_fresh(qm_bank_writer *w, const char *json, size_t len, qm_status *st)
{
    int rc;
    if (ftruncate(w->fd, 0) != 0 ||
        ftruncate(w->fd, (off_t)(w->data_start + w->total + sizeof(trailer))) != 0)
        return qm_status_set(st, QM_EIO, "cannot size %.200s to %llu bytes: %s", w->partial,
                             (unsigned long long)(w->data_start + w->total), strerror(errno));
    if ((rc = pwrite_all(w, PARTIAL_MAGIC, 8, 0, st)) != 0 ||
        (rc = pwrite_all(w, json, len, 8, st)) != 0 || (rc = write_trailer(w, 0, 0, st)) != 0)
        return rc;
    w->layers_done = 0;
    return 0;
}

static void kill_hook(qm_bank_writer *w)
{
    const char *n = getenv("QMOE_IMPORT_KILL_AFTER_LAYERS");
    const char *sig = getenv("QMOE_IMPORT_KILL_SIGNAL");
    w->kill_after = n && *n ? strtol(n, NULL, 10) : -1;
    w->kill_signal = !sig || !*sig              ? SIGKILL
                     : strcmp(sig, "TERM") == 0 ? SIGTERM
                     : strcmp(sig, "INT") == 0  ? SIGINT
                     : strcmp(sig, "STOP") == 0 ? SIGSTOP
                                                : SIGKILL;
}

int qm_bank_writer_open(const qm_bank_writer_spec *spec, const char *out, int resume,
                        qm_bank_writer **out_writer, uint32_t *first_layer, double *value,
                        qm_status *st)
{
    *out_writer = NULL;
    *first_layer = 0;
    *value = 0;
    char *json = NULL;
    size_t len = 0;
    int rc, existed = 0;
    qm_bank_writer *w = qm_calloc(1, sizeof *w);
    if (!w) return qm_status_set(st, QM_ENOMEM, "out of memory");
    w->fd = -1;
    w->layers = spec->layers;
    w->experts = spec->experts;
    snprintf(w->tool, sizeof w->tool, "%s", spec->tool ? spec->tool : "qmoe-bank");
    size_t plen = strlen(out) + sizeof ".partial";
    w->out = qm_strdup(out);
    w->partial = qm_malloc(plen);
    if (!w->out || !w->partial) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory");
        goto fail;
    }
    snprintf(w->partial, plen, "%s.partial", out);
    if ((rc = plan_file(w, spec, st)) != 0 || (rc = copy_meta(w, spec, st)) != 0 ||
        (rc = format_header(w, &json, &len, st)) != 0)
        goto fail;
    w->header_len = len;
    w->data_start = 8 + len;
    if ((rc = check_header(w, json, len, st)) != 0 || (rc = check_out(out, st)) != 0 ||
        (rc = take_partial(w, &existed, st)) != 0)
        goto fail;
    kill_hook(w);
    if (existed && resume) {
        if ((rc = check_partial(w, json, len, value, st)) != 0) goto fail_keep;
        *first_layer = w->layers_done;
    } else if ((rc = start_fresh(w, json, len, st)) != 0) {
        goto fail_remove;
    }
    qm_free(json);
    *out_writer = w;
    if (w->kill_after == 0) raise(w->kill_signal);
    return 0;
fail_remove:
    qm_free(json);
    qm_bank_writer_free(w, 0);
    return rc;
fail_keep:
fail:
    qm_free(json);
    qm_bank_writer_free(w, 1);
    return rc;
}

uint64_t qm_bank_writer_tensor_bytes(const qm_bank_writer *w, uint32_t layer, int t)
{
    if (layer >= w->layers || t < 0 || t >= QM_T_COUNT) return 0;
    return plan_bytes(&w->plan[(size_t)layer * QM_T_COUNT + (size_t)t]);
}

uint64_t qm_bank_writer_slice_bytes(const qm_bank_writer *w, uint32_t layer, int t)
{
    uint64_t n = qm_bank_writer_tensor_bytes(w, layer, t);
    return t < QM_T_EXPERT_COUNT ? n / w->experts : n;
}

int qm_bank_writer_put(qm_bank_writer *w, uint32_t layer, int t, uint64_t at, const void *buf,
                       uint64_t n, qm_status *st)
{
    uint64_t size = qm_bank_writer_tensor_bytes(w, layer, t);
    if (at > size || n > size - at)
        return qm_status_set(st, QM_EINTERNAL, "write past tensor %d of layer %u", t, layer);
    return pwrite_all(w, buf, n,
                      w->data_start + w->begin[(size_t)layer * QM_T_COUNT + (size_t)t] + at, st);
}

static double seconds_since(const struct timespec *t0)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - t0->tv_sec) + 1e-9 * (double)(now.tv_nsec - t0->tv_nsec);
}

int qm_bank_writer_layer_done(qm_bank_writer *w, uint32_t layer, double value, uint64_t source_done,
                              uint64_t source_total, qm_status *st)
{
    /* Data first, then the record that says it is there. */
    if (fdatasync(w->fd) != 0)
        return qm_status_set(st, QM_EIO, "flushing %.200s: %s", w->partial, strerror(errno));
    int rc = write_trailer(w, layer + 1, value, st);
    if (rc) return rc;
    w->layers_done = layer + 1;
    w->layers_this_run++;
    if (w->kill_after > 0 && (long)w->layers_this_run == w->kill_after) raise(w->kill_signal);
    if (w->progress) {
        double secs = seconds_since(&w->started);
        double rate = secs > 0 ? (double)(source_done - w->source_at_start) / secs : 0;
        double eta = rate > 0 ? (double)(source_total - source_done) / rate : 0;
        fprintf(stderr, "\r%s: layer %u/%u  %.2f/%.2f GB  %.0f MB/s  ETA %um%02us   ", w->tool,
                layer + 1, w->layers, (double)source_done / 1e9, (double)source_total / 1e9,
                rate / 1e6, (unsigned)(eta / 60), (unsigned)eta % 60);
        if (layer + 1 == w->layers) fputc('\n', stderr);
    }
    return 0;
}

uint32_t qm_bank_writer_layers_done(const qm_bank_writer *w)
{
    return w->layers_done;
}

void qm_bank_writer_progress(qm_bank_writer *w, int on, uint64_t source_done)
{
    w->progress = on;
    w->source_at_start = source_done;
    clock_gettime(CLOCK_MONOTONIC, &w->started);
}

/* ---- finishing ---------------------------------------------------------------- */

/* The finished file through the loader, from its own mapping. */
static int reopen_check(qm_bank_writer *w, qm_status *st)
{
    size_t size = (size_t)(w->data_start + w->total);
    void *m = mmap(NULL, size, PROT_READ, MAP_SHARED, w->fd, 0);
    if (m == MAP_FAILED)
        return qm_status_set(st, QM_EIO, "cannot map %.200s: %s", w->partial, strerror(errno));
    qm_status bst;
    int rc = open_unmap(m, size, &bst);
    if (rc) return qm_status_set(st, QM_EINTERNAL, "the written bank does not open: %s", bst.msg);
    return 0;
}

static void sync_dir(const char *path)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash == dir)
        dir[1] = '\0';
    else if (slash)
        *slash = '\0';
    else
        snprintf(dir, sizeof dir, ".");
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

int qm_bank_writer_finish(qm_bank_writer *w, const char *deferred_value, uint64_t *file_bytes,
                          qm_status *st)
{
    if (w->deferred < w->n_meta && deferred_value) {
        char *v = qm_strdup(deferred_value);
        if (!v) return qm_status_set(st, QM_ENOMEM, "out of memory");
        qm_free(w->meta[w->deferred].value);
        w->meta[w->deferred].value = v;
    }
    char *json = NULL;
    size_t len = 0;
    int rc = format_header(w, &json, &len, st);
    if (rc) return rc;
    if (len != w->header_len) {
        qm_free(json);
        return qm_status_set(st, QM_EINTERNAL, "final header is %zu bytes, planned %llu", len,
                             (unsigned long long)w->header_len);
    }
    uint8_t len_le[8];
    for (int i = 0; i < 8; i++)
        len_le[i] = (uint8_t)((uint64_t)len >> (8 * i));
    rc = pwrite_all(w, json, len, 8, st);
    qm_free(json);
    if (rc || (rc = pwrite_all(w, len_le, 8, 0, st)) != 0) return rc;
    if (ftruncate(w->fd, (off_t)(w->data_start + w->total)) != 0 || fsync(w->fd) != 0)
        return qm_status_set(st, QM_EIO, "finishing %.200s: %s", w->partial, strerror(errno));
    if ((rc = reopen_check(w, st)) != 0) return rc;
    struct stat fsb, lsb;
    if (fstat(w->fd, &fsb) != 0 || lstat(w->partial, &lsb) != 0 || !same_file(&fsb, &lsb))
        return qm_status_set(st, QM_EIO, "%.200s was replaced while it was written", w->partial);
    if (rename(w->partial, w->out) != 0)
        return qm_status_set(st, QM_EIO, "cannot rename %.200s to %.200s: %s", w->partial, w->out,
                             strerror(errno));
    sync_dir(w->out);
    close(w->fd); /* the lock goes with it */
    w->fd = -1;
    if (file_bytes) *file_bytes = w->data_start + w->total;
    return 0;
}

void qm_bank_writer_free(qm_bank_writer *w, int keep_partial)
{
    if (!w) return;
    if (w->fd >= 0) {
        struct stat fsb, lsb;
        /* Only the file this writer holds, never one that replaced it. */
        if (!keep_partial && fstat(w->fd, &fsb) == 0 && lstat(w->partial, &lsb) == 0 &&
            same_file(&fsb, &lsb))
            unlink(w->partial);
        close(w->fd);
    }
    qm__st_lists_free(w->tensors, w->n_tensors, w->meta, w->n_meta);
    qm_free(w->plan);
    qm_free(w->begin);
    qm_free(w->out);
    qm_free(w->partial);
    qm_free(w);
}
