/* qm_client_shm.c - shared-memory tensors (PROTOCOL.md "Shared-memory
 * tensors"): a sealed memfd created here, mapped here and handed to qmoed by
 * session.map; session.infer whose tensors and output live in it. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create, F_ADD_SEALS */
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_client_internal.h"

#define QM__NOMEM(err) qm__client_fail((err), QM_CLIENT_ENOMEM, "out of memory")

static qm_cval *qm__obj_add(qm_cval *o, const char *key, qm_cval *v)
{
    if (!o || qm_cval_append(o, key, v) < 0) {
        qm_cval_free(o);
        return NULL;
    }
    return o;
}

int qm_client_map_create(qm_client *c, const char *session, size_t bytes, qm_client_map *out,
                         qm_client_error *err)
{
    memset(out, 0, sizeof(*out));
    if (err)
        memset(err, 0, sizeof(*err));
    if (!session || bytes == 0 || strlen(session) >= sizeof(out->session))
        return qm__client_fail(err, QM_CLIENT_EINVAL, "a map needs a session and bytes > 0");
    long page = sysconf(_SC_PAGESIZE);
    size_t len = (bytes + (size_t)page - 1) / (size_t)page * (size_t)page;
    int fd = memfd_create("qmoe-map", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return qm__client_fail(err, QM_CLIENT_EIO, "memfd_create: %s", strerror(errno));
    void *base = MAP_FAILED;
    if (ftruncate(fd, (off_t)len) < 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0 ||
        (base = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        int e = errno;
        close(fd);
        return qm__client_fail(err, e == ENOMEM ? QM_CLIENT_ENOMEM : QM_CLIENT_EIO,
                               "cannot create a %zu-byte shared map: %s", bytes, strerror(e));
    }
    qm_cval *p = qm_cval_new(QM_CVAL_OBJECT);
    p = qm__obj_add(p, "session", qm_cval_new_string(session));
    p = qm__obj_add(p, "bytes", qm_cval_new_number((double)bytes));
    if (!p) {
        munmap(base, len);
        close(fd);
        return QM__NOMEM(err);
    }
    qm_cval *r = NULL;
    int rc = qm__client_call_fd(c, "session.map", p, fd, &r, err);
    uint64_t id = 0;
    if (rc == 0 && qm_cval_get_u64(r, "map", &id) < 0)
        rc = qm__client_fail(err, QM_CLIENT_EPROTO, "qmoed's answer to session.map lacks map");
    qm_cval_free(r);
    if (rc < 0) {
        close(fd);
        munmap(base, len);
        return rc;
    }
    out->id = id;
    out->data = base;
    out->bytes = bytes;
    out->mapped_len = len;
    snprintf(out->session, sizeof(out->session), "%s", session);
    /* The daemon holds its own mapping, this process `base`; the handle
     * keeps a copy of the memfd to pass again after a restart. */
    qm__client_keep_map(c, out, fd);
    close(fd);
    return 0;
}

int qm_client_map_release(qm_client *c, qm_client_map *m, qm_client_error *err)
{
    int rc = 0;
    if (err)
        memset(err, 0, sizeof(*err));
    if (!m || !m->data)
        return 0;
    if (c) {
        qm__client_unkeep_map(c, m);
        qm_cval *p = qm_cval_new(QM_CVAL_OBJECT);
        p = qm__obj_add(p, "session", qm_cval_new_string(m->session));
        p = qm__obj_add(p, "map", qm_cval_new_number((double)m->id));
        qm_cval *r = NULL;
        rc = p ? qm__client_call(c, "session.unmap", p, &r, err) : QM__NOMEM(err);
        qm_cval_free(r);
    }
    munmap(m->data, m->mapped_len);
    memset(m, 0, sizeof(*m));
    return rc;
}

/* Appends a string literal. */
#define QM__LIT(b, lit) qm_buf_append((b), (lit), sizeof(lit) - 1)

/* `"KEY":{"dtype":..,"shape":[rows,cols],"map":ID,"offset":OFF}`, as
 * qm_cval_print writes it; -1 for a dtype that does not exist. */
static int qm__region(qm_buf *b, const char *key, const qm_client_map *map,
                      const qm_client_region *t)
{
    static const char *const names[] = {"f32", "f16", "bf16", "i32"};
    if ((unsigned)t->dtype >= sizeof(names) / sizeof(names[0]))
        return -1;
    QM__LIT(b, ",");
    qm__client_codec_string(b, key);
    QM__LIT(b, ":{\"dtype\":");
    qm__client_codec_string(b, names[t->dtype]);
    QM__LIT(b, ",\"shape\":[");
    qm__client_codec_number(b, (double)t->rows);
    QM__LIT(b, ",");
    qm__client_codec_number(b, (double)t->cols);
    QM__LIT(b, "],\"map\":");
    qm__client_codec_number(b, (double)map->id);
    QM__LIT(b, ",\"offset\":");
    qm__client_codec_number(b, (double)t->offset);
    QM__LIT(b, "}");
    return 0;
}

static int qm__infer_mapped_once(qm_client *c, const qm_client_mapped_infer *q,
                                 qm_client_infer_stats *stats, qm_client_error *err)
{
    if (stats)
        memset(stats, 0, sizeof(*stats));
    if (err)
        memset(err, 0, sizeof(*err));
    if (!q || !q->session || !q->map || !q->map->data)
        return qm__client_fail(err, QM_CLIENT_EINVAL,
                               "session.infer needs a session and a map from qm_client_map_create");
    int ring_rc;
    pthread_mutex_lock(&c->lock);
    int took = qm__client_ring_infer(c, q, stats, &ring_rc, err);
    pthread_mutex_unlock(&c->lock);
    if (took)
        return ring_rc;
    const qm_client_region *parts[] = {&q->hidden, q->router_logits, q->topk_ids,
                                       q->topk_weights};
    const char *keys[] = {"hidden", "router_logits", "topk_ids", "topk_weights"};
    /* The params are written straight into one buffer (an engine makes
     * this call per layer per token): the same text a qm_cval tree of
     * them would print, without building the tree. */
    qm_buf p;
    qm_buf_init(&p);
    QM__LIT(&p, "{\"session\":");
    qm__client_codec_string(&p, q->session);
    QM__LIT(&p, ",\"layer\":");
    qm__client_codec_number(&p, (double)q->layer);
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) {
        if (parts[i] && qm__region(&p, keys[i], q->map, parts[i]) < 0) {
            qm_buf_free(&p);
            return qm__client_fail(err, QM_CLIENT_EINVAL, "%s: bad dtype or no memory", keys[i]);
        }
    }
    QM__LIT(&p, ",\"output_to\":{\"map\":");
    qm__client_codec_number(&p, (double)q->map->id);
    QM__LIT(&p, ",\"offset\":");
    qm__client_codec_number(&p, (double)q->output_offset);
    QM__LIT(&p, "}}");
    if (p.oom) {
        qm_buf_free(&p);
        return QM__NOMEM(err);
    }
    qm_cval *r = NULL;
    int rc = qm__client_call_text(c, "session.infer", p.data, p.len, &r, err);
    qm_buf_free(&p);
    if (rc < 0)
        return rc;
    const qm_cval *out = qm_cval_get(r, "output");
    uint64_t id = 0, off = 0;
    if (qm_cval_get_u64(out, "map", &id) < 0 || qm_cval_get_u64(out, "offset", &off) < 0 ||
        id != q->map->id || off != q->output_offset)
        rc = qm__client_fail(err, QM_CLIENT_EPROTO,
                             "qmoed's output is not the mapped tensor output_to asked for");
    const qm_cval *st = qm_cval_get(r, "stats");
    if (rc == 0 && stats) {
        qm_cval_get_u64(st, "hits", &stats->hits);
        qm_cval_get_u64(st, "misses", &stats->misses);
        qm_cval_get_u64(st, "bytes_paged", &stats->bytes_paged);
        qm_cval_get_u64(st, "queue_us", &stats->queue_us);
        qm_cval_get_u64(st, "compute_us", &stats->compute_us);
    }
    qm_cval_free(r);
    return rc;
}

/* 1 when [a, a + n) and [b, b + m) share a byte. */
static int qm__overlap(uint64_t a, uint64_t n, uint64_t b, uint64_t m)
{
    return n && m && a < b + m && b < a + n;
}

/* Whether the call may run again after the daemon died during it: not when
 * its output lands on one of its inputs (the output is computed aside and
 * copied there at the end, so a daemon that died copying it may have
 * changed the input). */
static int qm__retry_safe(const qm_client_mapped_infer *q)
{
    static const uint64_t size[] = {4, 2, 2, 4};
    const qm_client_region *in[] = {&q->hidden, q->router_logits, q->topk_ids, q->topk_weights};
    if ((unsigned)q->hidden.dtype >= 4)
        return 0;
    uint64_t out_n = q->hidden.rows * q->hidden.cols * size[q->hidden.dtype];
    for (size_t i = 0; i < sizeof(in) / sizeof(in[0]); i++) {
        if (!in[i] || (unsigned)in[i]->dtype >= 4)
            continue;
        uint64_t n = in[i]->rows * in[i]->cols * size[in[i]->dtype];
        if (qm__overlap(q->output_offset, out_n, in[i]->offset, n))
            return 0;
    }
    return 1;
}

int qm_client_session_infer_mapped(qm_client *c, const qm_client_mapped_infer *q,
                                   qm_client_infer_stats *stats, qm_client_error *err)
{
    uint64_t gen = c ? qm__client_generation(c) : 0;
    uint64_t map_id = q && q->map ? q->map->id : 0;
    qm__client_answered_on = 0;
    int rc = qm__infer_mapped_once(c, q, stats, err);
    /* The map's id may have changed: the retry's request is written again.
     * A map the daemon reclaimed (its connection long closed: found on the
     * first try or on the retry after a reconnection) failed the call
     * before it ran. */
    if (rc < 0 && c && q && qm__retry_safe(q) &&
        qm__client_resume(c, q->session, gen, rc, err) == 0)
        rc = qm__infer_mapped_once(c, q, stats, err);
    if (rc < 0 && c && q && q->map &&
        qm__client_map_again(c, q->session, q->map, map_id, rc, err) == 0)
        rc = qm__infer_mapped_once(c, q, stats, err);
    if (rc == 0)
        qm__client_note_call(c, q->session, qm__client_answered_on);
    return rc;
}
