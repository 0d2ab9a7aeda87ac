/* import_common.c - element conversions and the streaming bank
 * writer shared by the `qmoe-bank import` paths (see import_common.h). */
#include "import_common.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_half.h"
#include "qm_io.h"
#include "qm_st_header.h"

/* ---- elements ------------------------------------------------------------ */

qmi_elem qmi_elem_from_st(const char *s)
{
    static const struct {
        const char *name;
        qmi_elem e;
    } map[] = {{"F32", QMI_ELEM_F32},
               {"F16", QMI_ELEM_F16},
               {"BF16", QMI_ELEM_BF16},
               {"F8_E4M3", QMI_ELEM_F8_E4M3},
               {"U8", QMI_ELEM_U8}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (strcmp(s, map[i].name) == 0) return map[i].e;
    return QMI_ELEM_OTHER;
}

size_t qmi_elem_size(qmi_elem e)
{
    switch (e) {
    case QMI_ELEM_F32:
        return 4;
    case QMI_ELEM_F16:
    case QMI_ELEM_BF16:
        return 2;
    case QMI_ELEM_F8_E4M3:
    case QMI_ELEM_U8:
        return 1;
    default:
        return 0;
    }
}

const char *qmi_elem_name(qmi_elem e)
{
    static const char *names[] = {"F32", "F16", "BF16", "F8_E4M3", "U8", "other"};
    return names[e <= QMI_ELEM_OTHER ? e : QMI_ELEM_OTHER];
}

float qmi_e4m3_to_f32(uint8_t v)
{
    int sign = v & 0x80, exp = (v >> 3) & 0xf, mant = v & 7;
    float f;
    if (exp == 0xf && mant == 7)
        f = NAN;
    else if (exp == 0)
        f = ldexpf((float)mant, -9); /* subnormal: mant/8 * 2^-6 */
    else
        f = ldexpf((float)(8 + mant), exp - 7 - 3);
    return sign ? -f : f;
}

float qmi_load(const void *src, qmi_elem e, size_t i)
{
    const uint8_t *p = src;
    switch (e) {
    case QMI_ELEM_F32: {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    case QMI_ELEM_F16:
    case QMI_ELEM_BF16: {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        return e == QMI_ELEM_F16 ? qm_f16_to_f32(h) : qm_bf16_to_f32(h);
    }
    case QMI_ELEM_F8_E4M3:
        return qmi_e4m3_to_f32(p[i]);
    default:
        return NAN;
    }
}

void qmi_load_row(const void *src, qmi_elem e, size_t n, float *dst)
{
    if (e == QMI_ELEM_F32) {
        memcpy(dst, src, n * 4);
        return;
    }
    if (e == QMI_ELEM_BF16) { /* the hot path of a bf16 import */
        const uint8_t *p = src;
        for (size_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)p[2 * i] << 16 | (uint32_t)p[2 * i + 1] << 24;
            memcpy(&dst[i], &u, 4);
        }
        return;
    }
    for (size_t i = 0; i < n; i++)
        dst[i] = qmi_load(src, e, i);
}

/* ---- the bank writer ----------------------------------------------------- */

#define QMI_TRAILER_MAGIC "QMIMPRT1"

typedef struct trailer {
    char magic[8];
    uint32_t layers_done;
    uint32_t reserved;
    double max_rel_err;
    uint64_t bank_bytes;
} trailer;

typedef qmi_planned planned;

struct qmi_writer {
    qmi_bank_spec spec;
    char *out, *partial, tool[32];
    int fd;
    planned *plan; /* [layers][QMI_T_COUNT] */
    qm_st_tensor *tensors;
    size_t n_tensors;
    uint64_t data_start, total, header_len;
    int progress;
    struct timespec started;
    uint64_t source_at_start;
    int started_set;
    long kill_after;
    uint32_t layers_this_run;
};

static uint64_t ceil_div(uint64_t a, uint64_t b)
{
    return (a + b - 1) / b;
}

static const char *st_name(qm_dtype d)
{
    return d == QM_DTYPE_F32    ? "F32"
           : d == QM_DTYPE_F16  ? "F16"
           : d == QM_DTYPE_BF16 ? "BF16"
                                : "U8";
}

static void plan_layer(const qmi_bank_spec *s, planned *t)
{
    uint64_t e = s->experts, pack = 8 / s->bits;
    memset(t, 0, QMI_T_COUNT * sizeof *t);
    int gated = s->activation == QM_ACT_SWIGLU;
    int nproj = gated && s->swiglu_fusion == 0 ? 3 : 2;
    for (int p = 1; p <= nproj; p++) {
        uint64_t n = p == 1   ? (gated && s->swiglu_fusion ? 2ull * s->inter : s->inter)
                     : p == 2 ? s->hidden
                              : s->inter;
        uint64_t k = p == 2 ? s->inter : s->hidden;
        uint64_t nblk = s->block_size ? ceil_div(k, s->block_size) : 1;
        planned *w = &t[(p - 1) * 4];
        w[0] = (planned){1, QM_DTYPE_U8, 3, {e, n, k / pack}, 0, 0};
        w[1] = s->block_size ? (planned){1, s->scale_dtype, 3, {e, n, nblk}, 0, 0}
                             : (planned){1, s->scale_dtype, 2, {e, n, 0}, 0, 0};
        if ((p == 1 && s->fc1_bias) || (p == 2 && s->fc2_bias))
            w[3] = (planned){1, QM_DTYPE_F32, 2, {e, n, 0}, 0, 0};
    }
    if (s->router_weight)
        t[QM_T_ROUTER_WEIGHT] = (planned){1, QM_DTYPE_F32, 2, {e, s->hidden, 0}, 0, 0};
    if (s->router_bias) t[QM_T_ROUTER_BIAS] = (planned){1, QM_DTYPE_F32, 1, {e, 0, 0}, 0, 0};
    if (s->correction_bias)
        t[QMI_T_CORRECTION_BIAS] = (planned){1, QM_DTYPE_F32, 1, {e, 0, 0}, 0, 0};
    qmi_plan_sizes(t, QMI_T_COUNT);
}

void qmi_plan_sizes(qmi_planned *t, int n)
{
    for (int i = 0; i < n; i++)
        if (t[i].present) {
            t[i].nbytes = qm_dtype_size(t[i].dtype);
            for (uint32_t d = 0; d < t[i].ndim; d++)
                t[i].nbytes *= t[i].shape[d];
        }
}

uint64_t qmi_plan_place(qmi_planned *plan, uint32_t layers, int per_layer)
{
    uint64_t off = 0;
    static const size_t widths[] = {4, 2, 1};
    for (size_t wi = 0; wi < 3; wi++)
        for (uint32_t l = 0; l < layers; l++)
            for (int t = 0; t < per_layer; t++) {
                qmi_planned *p = &plan[(size_t)l * (size_t)per_layer + (size_t)t];
                if (p->present && qm_dtype_size(p->dtype) == widths[wi]) {
                    p->begin = off;
                    off += p->nbytes;
                }
            }
    return off;
}

int qmi_plan_header_tensors(const qmi_planned *plan, uint32_t layers, int per_layer,
                            qm_st_tensor *tensors, size_t *n, qm_status *st)
{
    *n = 0;
    for (uint32_t l = 0; l < layers; l++)
        for (int t = 0; t < per_layer; t++) {
            const qmi_planned *p = &plan[(size_t)l * (size_t)per_layer + (size_t)t];
            if (!p->present) continue;
            qm_st_tensor *tt = &tensors[(*n)++];
            tt->name = qm_malloc(64);
            if (!tt->name) return qm_status_set(st, QM_ENOMEM, "out of memory planning the header");
            if (t == QMI_T_CORRECTION_BIAS)
                snprintf(tt->name, 64, "layers.%u.router.correction_bias", l);
            else
                qm_bank_tensor_name(l, (qm_bank_tensor)t, tt->name, 64);
            snprintf(tt->dtype, sizeof tt->dtype, "%s", st_name(p->dtype));
            tt->ndim = p->ndim;
            memcpy(tt->shape, p->shape, sizeof p->shape);
            tt->begin = p->begin;
            tt->end = p->begin + p->nbytes;
        }
    return 0;
}

static void fmt_float(char *buf, size_t n, float v)
{
    if (isinf(v))
        snprintf(buf, n, "%s", v > 0 ? "inf" : "-inf");
    else
        snprintf(buf, n, "%.9g", (double)v);
}

/* Fixed width, so the final header has the placeholder's length. */
static void source_value(const qmi_bank_spec *s, int exact, double err, char *buf, size_t n)
{
    if (!(err >= 1e-99)) err = 0;
    if (err > 9.999999e99) err = 9.999999e99;
    snprintf(buf, n, "%s,\"exact\":%s,\"max_rel_err\":%.6e}", s->source_prefix,
             exact ? "true " : "false", err);
}

void qmi_std_meta(const qmi_bank_spec *s, char v[12][32], qm_st_meta *meta)
{
    snprintf(v[0], 32, "%u", s->layers);
    snprintf(v[1], 32, "%u", s->experts);
    snprintf(v[2], 32, "%u", s->hidden);
    snprintf(v[3], 32, "%u", s->inter);
    snprintf(v[4], 32, "%u", s->k);
    snprintf(v[5], 32, "%u", s->bits);
    snprintf(v[6], 32, "%u", s->block_size);
    snprintf(v[7], 32, "%u", s->swiglu_fusion);
    fmt_float(v[8], 32, s->alpha);
    fmt_float(v[9], 32, s->beta);
    fmt_float(v[10], 32, s->limit);
    snprintf(v[11], 32, "%d", s->normalize_routing ? 1 : 0);
    const qm_st_meta rows[QMI_STD_META] = {
        {"qmoe.format", "1"},
        {"qmoe.layers", v[0]},
        {"qmoe.experts", v[1]},
        {"qmoe.hidden_size", v[2]},
        {"qmoe.inter_size", v[3]},
        {"qmoe.k", v[4]},
        {"qmoe.activation", (char *)qm_activation_name(s->activation)},
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

static int format_header(qmi_writer *w, int exact, double err, char **json, size_t *len,
                         qm_status *st)
{
    const qmi_bank_spec *s = &w->spec;
    char v[12][32], source[QM_ST_VALUE_MAX];
    qm_st_meta meta[QMI_STD_META + 1 + QMI_META_MAX];
    qmi_std_meta(s, v, meta);
    size_t n_meta = QMI_STD_META;
    source_value(s, exact, err, source, sizeof source);
    meta[n_meta++] = (qm_st_meta){"qmoe.source", source};
    for (size_t i = 0; i < s->n_meta && i < QMI_META_MAX; i++)
        meta[n_meta++] = (qm_st_meta){(char *)s->meta_keys[i], (char *)s->meta_values[i]};
    return qm_st_header_format(w->tensors, w->n_tensors, meta, n_meta, 8, json, len, st);
}

static int plan_file(qmi_writer *w, qm_status *st)
{
    const qmi_bank_spec *s = &w->spec;
    w->plan = qm_calloc((size_t)s->layers * QMI_T_COUNT, sizeof *w->plan);
    w->tensors = qm_calloc((size_t)s->layers * QMI_T_COUNT, sizeof *w->tensors);
    if (!w->plan || !w->tensors)
        return qm_status_set(st, QM_ENOMEM, "out of memory planning %u layers", s->layers);
    for (uint32_t l = 0; l < s->layers; l++)
        plan_layer(s, &w->plan[(size_t)l * QMI_T_COUNT]);
    w->total = qmi_plan_place(w->plan, s->layers, QMI_T_COUNT);
    return qmi_plan_header_tensors(w->plan, s->layers, QMI_T_COUNT, w->tensors, &w->n_tensors, st);
}

static int pwrite_all(int fd, const void *buf, uint64_t n, uint64_t at, const char *path,
                      qm_status *st)
{
    if (qm_pwrite_all(fd, buf, n, at))
        return qm_status_set(st, QM_EIO, "writing %.200s: %s", path, strerror(errno));
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

/* 0 with *layers_done and *err set when the partial file at fd continues this plan;
 * QM_ECONFLICT with the reason otherwise. */
static int check_partial(qmi_writer *w, const char *json, size_t len, uint32_t *layers_done,
                         double *err, qm_status *st)
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
    uint8_t len_le[8];
    for (int i = 0; i < 8; i++)
        len_le[i] = (uint8_t)((uint64_t)len >> (8 * i));
    if (pread_all(w->fd, have, len + 8, 0) != 0 || memcmp(have, len_le, 8) != 0 ||
        memcmp(have + 8, json, len) != 0) {
        size_t at = 0;
        while (at < len && have[8 + at] == json[at])
            at++;
        rc = qm_status_set(st, QM_ECONFLICT,
                           "%.200s has another header (it differs at byte %zu): it was written "
                           "for other arguments or another checkpoint (remove it, or run "
                           "without --resume)",
                           w->partial, at + 8);
    }
    qm_free(have);
    if (rc) return rc;
    trailer tr;
    if (pread_all(w->fd, &tr, sizeof tr, w->data_start + w->total) != 0 ||
        memcmp(tr.magic, QMI_TRAILER_MAGIC, 8) != 0 || tr.layers_done > w->spec.layers ||
        tr.bank_bytes != w->data_start + w->total || !(tr.max_rel_err >= 0))
        return qm_status_set(st, QM_ECONFLICT,
                             "%.200s: its progress record is damaged (remove it, or run without "
                             "--resume)",
                             w->partial);
    *layers_done = tr.layers_done;
    *err = tr.max_rel_err;
    return 0;
}

static int write_trailer(qmi_writer *w, uint32_t layers_done, double err, qm_status *st)
{
    trailer tr = {
        .layers_done = layers_done, .max_rel_err = err, .bank_bytes = w->data_start + w->total};
    memcpy(tr.magic, QMI_TRAILER_MAGIC, 8);
    return pwrite_all(w->fd, &tr, sizeof tr, w->data_start + w->total, w->partial, st);
}

int qmi_writer_open(const qmi_bank_spec *spec, const char *out, int resume, const char *tool,
                    qmi_writer **out_writer, uint32_t *first_layer, double *max_rel_err,
                    qm_status *st)
{
    *out_writer = NULL;
    *first_layer = 0;
    *max_rel_err = 0;
    qmi_writer *w = qm_calloc(1, sizeof *w);
    char *json = NULL;
    size_t len = 0;
    int rc;
    if (!w) return qm_status_set(st, QM_ENOMEM, "out of memory");
    w->fd = -1;
    w->spec = *spec;
    snprintf(w->tool, sizeof w->tool, "%s", tool);
    size_t plen = strlen(out) + sizeof ".partial";
    w->out = qm_strdup(out);
    w->partial = qm_malloc(plen);
    if (!w->out || !w->partial) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory");
        goto fail;
    }
    snprintf(w->partial, plen, "%s.partial", out);
    if ((rc = plan_file(w, st)) != 0) goto fail;
    if ((rc = format_header(w, 0, 0, &json, &len, st)) != 0) goto fail;
    w->header_len = len;
    w->data_start = 8 + len;
    const char *env = getenv("QMOE_IMPORT_KILL_AFTER_LAYERS");
    w->kill_after = env && *env ? strtol(env, NULL, 10) : 0;

    if (resume) {
        w->fd = open(w->partial, O_RDWR | O_CLOEXEC);
        if (w->fd < 0 && errno != ENOENT) {
            rc = qm_status_set(st, QM_EIO, "cannot open %.200s: %s", w->partial, strerror(errno));
            goto fail;
        }
        if (w->fd >= 0) {
            uint32_t done = 0;
            double err = 0;
            if ((rc = check_partial(w, json, len, &done, &err, st)) != 0) {
                close(w->fd);
                w->fd = -1;
                goto fail;
            }
            *first_layer = done;
            *max_rel_err = err;
            qm_free(json);
            *out_writer = w;
            return 0;
        }
    }
    w->fd = open(w->partial, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        rc = qm_status_set(st, QM_EIO, "cannot create %.200s: %s", w->partial, strerror(errno));
        goto fail;
    }
    if (ftruncate(w->fd, (off_t)(w->data_start + w->total + sizeof(trailer))) != 0) {
        rc = qm_status_set(st, QM_EIO, "cannot size %.200s to %llu bytes: %s", w->partial,
                           (unsigned long long)(w->data_start + w->total), strerror(errno));
        goto fail_unlink;
    }
    uint8_t len_le[8];
    for (int i = 0; i < 8; i++)
        len_le[i] = (uint8_t)((uint64_t)len >> (8 * i));
    if ((rc = pwrite_all(w->fd, len_le, 8, 0, w->partial, st)) != 0 ||
        (rc = pwrite_all(w->fd, json, len, 8, w->partial, st)) != 0 ||
        (rc = write_trailer(w, 0, 0, st)) != 0)
        goto fail_unlink;
    qm_free(json);
    *out_writer = w;
    return 0;
fail_unlink:
    unlink(w->partial);
fail:
    qm_free(json);
    qmi_writer_free(w, 1);
    return rc;
}

uint64_t qmi_writer_slice_bytes(const qmi_writer *w, int t)
{
    const planned *p = &w->plan[t];
    return p->present ? p->nbytes / (t < QM_T_EXPERT_COUNT ? w->spec.experts : 1) : 0;
}

int qmi_writer_put(qmi_writer *w, uint32_t layer, int t, uint64_t at, const void *buf, uint64_t n,
                   qm_status *st)
{
    const planned *p = &w->plan[(size_t)layer * QMI_T_COUNT + t];
    if (layer >= w->spec.layers || !p->present || at + n > p->nbytes)
        return qm_status_set(st, QM_EINTERNAL, "import wrote past tensor %d of layer %u", t, layer);
    return pwrite_all(w->fd, buf, n, w->data_start + p->begin + at, w->partial, st);
}

static double seconds_since(const struct timespec *t0)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - t0->tv_sec) + 1e-9 * (double)(now.tv_nsec - t0->tv_nsec);
}

int qmi_writer_layer_done(qmi_writer *w, uint32_t layer, double max_rel_err,
                          uint64_t source_bytes_done, uint64_t source_bytes_total, qm_status *st)
{
    /* Data first, then the record that says it is there. */
    if (fdatasync(w->fd) != 0)
        return qm_status_set(st, QM_EIO, "flushing %.200s: %s", w->partial, strerror(errno));
    int rc = write_trailer(w, layer + 1, max_rel_err, st);
    if (rc) return rc;
    w->layers_this_run++;
    if (w->kill_after > 0 && (long)w->layers_this_run >= w->kill_after) raise(SIGKILL);
    if (w->progress) {
        if (!w->started_set) {
            clock_gettime(CLOCK_MONOTONIC, &w->started);
            w->started_set = 1;
        }
        double secs = seconds_since(&w->started);
        double rate = secs > 0 ? (double)(source_bytes_done - w->source_at_start) / secs : 0;
        double eta = rate > 0 ? (double)(source_bytes_total - source_bytes_done) / rate : 0;
        fprintf(stderr, "\r%s: layer %u/%u  %.2f/%.2f GB  %.0f MB/s  ETA %um%02us   ", w->tool,
                layer + 1, w->spec.layers, (double)source_bytes_done / 1e9,
                (double)source_bytes_total / 1e9, rate / 1e6, (unsigned)(eta / 60),
                (unsigned)eta % 60);
        if (layer + 1 == w->spec.layers) fputc('\n', stderr);
    }
    return 0;
}

void qmi_writer_progress(qmi_writer *w, int on, uint64_t bytes_done)
{
    w->progress = on;
    w->source_at_start = bytes_done;
    clock_gettime(CLOCK_MONOTONIC, &w->started);
    w->started_set = 1;
}

int qmi_writer_finish(qmi_writer *w, int exact, double max_rel_err, uint64_t *file_bytes,
                      qm_status *st)
{
    char *json = NULL;
    size_t len = 0;
    int rc = format_header(w, exact, exact ? 0 : max_rel_err, &json, &len, st);
    if (rc) return rc;
    if (len != w->header_len) {
        qm_free(json);
        return qm_status_set(st, QM_EINTERNAL, "final header is %zu bytes, planned %llu", len,
                             (unsigned long long)w->header_len);
    }
    rc = pwrite_all(w->fd, json, len, 8, w->partial, st);
    qm_free(json);
    if (rc) return rc;
    if (ftruncate(w->fd, (off_t)(w->data_start + w->total)) != 0 || fsync(w->fd) != 0)
        return qm_status_set(st, QM_EIO, "finishing %.200s: %s", w->partial, strerror(errno));
    if (close(w->fd) != 0) {
        w->fd = -1;
        return qm_status_set(st, QM_EIO, "closing %.200s: %s", w->partial, strerror(errno));
    }
    w->fd = -1;
    if (rename(w->partial, w->out) != 0)
        return qm_status_set(st, QM_EIO, "cannot rename %.200s to %.200s: %s", w->partial, w->out,
                             strerror(errno));
    if (file_bytes) *file_bytes = w->data_start + w->total;
    return 0;
}

void qmi_writer_free(qmi_writer *w, int keep_partial)
{
    if (!w) return;
    if (w->fd >= 0) {
        close(w->fd);
        if (!keep_partial) unlink(w->partial);
    }
    for (size_t i = 0; i < w->n_tensors; i++)
        qm_free(w->tensors[i].name);
    qm_free(w->tensors);
    qm_free(w->plan);
    qm_free(w->out);
    qm_free(w->partial);
    qm_free(w);
}
