/* qm_pager_trace.c - records a session's real routing as a .qmtr trace
 * (docs/TRACES.md), the same format tools/qmoe_trace.py writes and
 * bench/policy_sim replays. Token rows are written once every layer has
 * routed the token; the header's token count is rewritten after each, so
 * the file is a valid trace whenever it is read. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_io.h"
#include "qm_pager_trace.h"

/* A recording: per layer a ring of the token rows not yet complete. */
typedef struct qm__trace {
    int fd;
    uint64_t payload_off;
    int16_t **rows;       /* per layer: ring of pending rows, k ids each */
    uint32_t *head, *len; /* per layer */
    uint32_t cap;         /* rows per layer ring */
    int16_t *token;       /* one token's row: [layers][k] */
    uint64_t max_bytes;   /* the file's bound (0: none) */
} qm__trace;

#define QM__TRACE_MAX_BEHIND 65536u
#define QM__TRACE_HEADER 40u

static void qm__trace_free(qm__trace *t, uint32_t layers)
{
    if (!t)
        return;
    if (t->fd >= 0)
        close(t->fd);
    if (t->rows)
        for (uint32_t l = 0; l < layers; l++)
            qm_free(t->rows[l]);
    qm_free(t->rows);
    qm_free(t->head);
    qm_free(t->len);
    qm_free(t->token);
    qm_free(t);
}

void qm__pager_trace_close(qm_pager *p)
{
    qm__trace_free(p->trace, p->n_layers);
    p->trace = NULL;
}

/* Stops recording after an I/O error; inference goes on. */
static void qm__trace_fail(qm_pager *p)
{
    p->stats.trace_errors++;
    qm__pager_trace_close(p);
}

/* A trace at `path` this recording may go on with: a .qmtr of the same
 * layers, k and experts (the header qm_pager_record_trace writes), without
 * weights, its rows (`layers` x k ids, as recorded) whole up to the token
 * count its header gives. Opened for writing, anything past those rows (a
 * row written before its count was) cut off: the descriptor, with its
 * payload offset and token count; -1 when there is no such file. */
static int qm__trace_reopen(const char *path, const qm_bank_config *cfg, uint32_t layers,
                            uint64_t *payload_off, uint64_t *tokens)
{
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return -1;
    uint8_t head[QM__TRACE_HEADER];
    uint32_t f[8];
    struct stat sb;
    if (pread(fd, head, sizeof head, 0) != (ssize_t)sizeof head || memcmp(head, "QMTRACE\0", 8) ||
        fstat(fd, &sb) || !S_ISREG(sb.st_mode))
        goto no;
    memcpy(f, head + 8, sizeof f);
    /* version, tokens, layers, k, experts, flags, meta_len */
    if (f[0] != 1 || f[2] != cfg->layers || f[3] != cfg->k || f[4] != cfg->experts ||
        f[5] != 0 || f[6] > 4096)
        goto no;
    uint64_t off = QM__TRACE_HEADER + (uint64_t)f[6];
    off += (8 - off % 8) % 8;
    uint64_t end = off + (uint64_t)f[1] * layers * cfg->k * sizeof(int16_t);
    if ((uint64_t)sb.st_size < end || ((uint64_t)sb.st_size > end && ftruncate(fd, (off_t)end)))
        goto no;
    *payload_off = off;
    *tokens = f[1];
    return fd;
no:
    close(fd);
    return -1;
}

/* Stops recording at the file's bound; the file stays a valid trace. */
static void qm__trace_full(qm_pager *p)
{
    p->stats.trace_full = 1;
    qm__pager_trace_close(p);
}

int qm_pager_record_trace(qm_pager *p, const char *path, int resume, uint64_t max_bytes,
                          qm_status *st)
{
    if (!p || !path)
        return qm_status_set(st, QM_EINVAL, "qm_pager_record_trace: NULL argument");
    qm__pager_trace_close(p);
    const qm_bank_config *cfg = p->cfg;
    if (cfg->experts > 32767)
        return qm_status_set(st, QM_EUNSUPPORTED, "traces hold at most 32767 experts, not %u",
                             cfg->experts);
    qm__trace *t = qm_calloc(1, sizeof *t);
    if (!t)
        return qm_status_set(st, QM_ENOMEM, "out of memory for the trace recorder");
    t->fd = -1;
    t->max_bytes = max_bytes;
    p->stats.trace_full = 0;
    /* Rings start small and grow up to QM__TRACE_MAX_BEHIND rows per layer. */
    t->cap = 64;
    t->rows = qm_calloc(p->n_layers, sizeof *t->rows);
    t->head = qm_calloc(p->n_layers, sizeof *t->head);
    t->len = qm_calloc(p->n_layers, sizeof *t->len);
    t->token = qm_calloc((size_t)p->n_layers * cfg->k, sizeof *t->token);
    int ok = t->rows && t->head && t->len && t->token;
    for (uint32_t l = 0; ok && l < p->n_layers; l++)
        ok = (t->rows[l] = qm_calloc((size_t)t->cap * cfg->k, sizeof(int16_t))) != NULL;
    if (!ok) {
        qm__trace_free(t, p->n_layers);
        return qm_status_set(st, QM_ENOMEM, "out of memory for the trace recorder");
    }
    uint64_t tokens = 0;
    if (resume && (t->fd = qm__trace_reopen(path, cfg, p->n_layers, &t->payload_off, &tokens)) >= 0) {
        p->trace = t;
        p->stats.trace_tokens = tokens;
        /* Already at its bound: nothing more goes in. */
        if (max_bytes && t->payload_off + (tokens + 1) * p->n_layers * cfg->k * sizeof(int16_t) >
                             max_bytes)
            qm__trace_full(p);
        return 1;
    }
    t->fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (t->fd < 0) {
        int e = errno;
        qm__trace_free(t, p->n_layers);
        return qm_status_set(st, QM_EIO, "cannot create trace %s: %s", path, strerror(e));
    }
    /* The bank's file name, made JSON-safe (the metadata must stay JSON). */
    char bank[64];
    const char *bp = qm_bank_path(p->bank);
    const char *slash = strrchr(bp, '/');
    snprintf(bank, sizeof bank, "%s", slash ? slash + 1 : bp);
    for (char *c = bank; *c; c++)
        if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20 || (unsigned char)*c >= 0x7f)
            *c = '_';
    char meta[160];
    int meta_len = snprintf(meta, sizeof meta,
                            "{\"generator\":\"qmoed\",\"source\":\"session routing\","
                            "\"bank\":\"%s\"}",
                            bank);
    if (meta_len < 0 || (size_t)meta_len >= sizeof meta)
        meta_len = snprintf(meta, sizeof meta, "{\"generator\":\"qmoed\"}");
    uint8_t head[QM__TRACE_HEADER + sizeof meta + 8];
    memset(head, 0, sizeof head);
    memcpy(head, "QMTRACE\0", 8);
    uint32_t f[8] = {1, 0, cfg->layers, cfg->k, cfg->experts, 0, (uint32_t)meta_len, 0};
    memcpy(head + 8, f, sizeof f);
    memcpy(head + QM__TRACE_HEADER, meta, (size_t)meta_len);
    t->payload_off = QM__TRACE_HEADER + (uint64_t)meta_len;
    t->payload_off += (8 - t->payload_off % 8) % 8;
    if (qm_pwrite_all(t->fd, head, (size_t)t->payload_off, 0)) {
        /* No header (a full disk): no file either, since one without a
         * header is no trace and a replay of the directory would stumble
         * on it (what it held before was truncated already). */
        int e = errno;
        qm__trace_free(t, p->n_layers);
        unlink(path);
        return qm_status_set(st, QM_EIO, "cannot write trace %s: %s", path, strerror(e));
    }
    p->trace = t;
    p->stats.trace_tokens = 0;
    return 0;
}

static int qm__trace_grow(qm__trace *t, uint32_t layers, uint32_t k)
{
    uint32_t cap = t->cap * 2;
    for (uint32_t l = 0; l < layers; l++) {
        int16_t *r = qm_malloc((size_t)cap * k * sizeof *r);
        if (!r)
            return QM_ENOMEM;
        for (uint32_t i = 0; i < t->len[l]; i++)
            memcpy(r + (size_t)i * k, t->rows[l] + (size_t)((t->head[l] + i) % t->cap) * k,
                   k * sizeof *r);
        qm_free(t->rows[l]);
        t->rows[l] = r;
        t->head[l] = 0;
    }
    t->cap = cap;
    return 0;
}

void qm__pager_trace_record(qm_pager *from, uint32_t layer, const uint32_t *route,
                            uint32_t tokens, uint32_t route_k)
{
    qm_pager *p = from->trace_to ? from->trace_to : from;
    qm__trace *t = p->trace;
    if (!t)
        return;
    uint32_t k = p->cfg->k, L = p->n_layers;
    for (uint32_t r = 0; r < tokens; r++) {
        if (t->len[layer] == t->cap) {
            if (t->cap >= QM__TRACE_MAX_BEHIND || qm__trace_grow(t, L, k)) {
                /* This layer runs far ahead of another: drop its oldest row. */
                t->head[layer] = (t->head[layer] + 1) % t->cap;
                t->len[layer]--;
                p->stats.trace_dropped++;
            }
        }
        int16_t *row = t->rows[layer] + (size_t)((t->head[layer] + t->len[layer]) % t->cap) * k;
        /* A row holds the file's k ids: routing supplied with another width
         * keeps its first k routed ids, padded with -1. */
        uint32_t n = 0;
        for (uint32_t j = 0; j < route_k && n < k; j++) {
            uint32_t e = route[(size_t)r * route_k + j];
            if (e < p->cfg->experts || route_k == k)
                row[n++] = e < p->cfg->experts ? (int16_t)e : (int16_t)-1;
        }
        while (n < k)
            row[n++] = -1;
        t->len[layer]++;
    }
    for (;;) {
        for (uint32_t l = 0; l < L; l++)
            if (t->len[l] == 0)
                return;
        for (uint32_t l = 0; l < L; l++) {
            memcpy(t->token + (size_t)l * k, t->rows[l] + (size_t)t->head[l] * k,
                   k * sizeof *t->token);
            t->head[l] = (t->head[l] + 1) % t->cap;
            t->len[l]--;
        }
        uint64_t off = t->payload_off + p->stats.trace_tokens * L * k * sizeof(int16_t);
        if (t->max_bytes && off + (uint64_t)L * k * sizeof(int16_t) > t->max_bytes) {
            qm__trace_full(p);
            return;
        }
        uint32_t n_tokens = (uint32_t)(p->stats.trace_tokens + 1);
        if (p->stats.trace_tokens + 1 > UINT32_MAX ||
            qm_pwrite_all(t->fd, t->token, (size_t)L * k * sizeof *t->token, off) ||
            qm_pwrite_all(t->fd, &n_tokens, sizeof n_tokens, 12)) {
            qm__trace_fail(p);
            return;
        }
        p->stats.trace_tokens++;
    }
}

void qm__pager_trace_to(qm_pager *p, qm_pager *owner)
{
    p->trace_to = owner == p ? NULL : owner;
}
