/* qm_shm.c - session.map's memfds: checked, mapped, counted, resolved into
 * session.infer's tensors (PROTOCOL.md "Shared-memory tensors").
 *
 * The seals are what make a client's memory safe to read: without
 * F_SEAL_SHRINK the client could truncate the file under a reading worker
 * (SIGBUS). The daemon keeps the mapping, not the descriptor: the fd is
 * closed as soon as it is mapped, so maps cost no file table slots. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* F_GET_SEALS */
#endif
#include "qm_shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qm_alloc.h"

static int fd_bad(qm_status *st, const char *fmt, const char *detail)
{
    qm_status_set_field(st, QM_EINVAL, "fd", fmt, detail);
    return QM_EINVAL;
}

static const char *file_kind(mode_t m)
{
    return S_ISSOCK(m)   ? "a socket"
           : S_ISFIFO(m) ? "a pipe"
           : S_ISDIR(m)  ? "a directory"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
                         : "not a file";
}

int qm_shm_map_fd(int fd, uint64_t bytes, qm_shm_map **out, qm_status *st)
{
    *out = NULL;
    struct stat sb;
    int rc = 0;
    if (fstat(fd, &sb) < 0) {
        rc = fd_bad(st, "the descriptor cannot be inspected (%s)", strerror(errno));
        goto close_fd;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = fd_bad(st, "the descriptor is %s; expected a memfd (memfd_create)",
                    file_kind(sb.st_mode));
        goto close_fd;
    }
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0) {
        rc = fd_bad(st,
                    "the descriptor is not a memfd (it cannot carry seals: %s); create it "
                    "with memfd_create(MFD_ALLOW_SEALING)",
                    strerror(errno));
        goto close_fd;
    }
    if ((seals & (F_SEAL_SHRINK | F_SEAL_SEAL)) != (F_SEAL_SHRINK | F_SEAL_SEAL)) {
        char detail[96];
        snprintf(detail, sizeof detail, "%s%s", (seals & F_SEAL_SHRINK) ? "" : " F_SEAL_SHRINK",
                 (seals & F_SEAL_SEAL) ? "" : " F_SEAL_SEAL");
        rc = fd_bad(st,
                    "the memfd is not sealed: it lacks%s (add F_SEAL_SHRINK and F_SEAL_SEAL "
                    "with F_ADD_SEALS)",
                    detail);
        goto close_fd;
    }
    if ((uint64_t)sb.st_size < bytes) {
        char detail[96];
        snprintf(detail, sizeof detail, "%llu bytes, but bytes is %llu",
                 (unsigned long long)sb.st_size, (unsigned long long)bytes);
        rc = fd_bad(st, "the memfd is too small: %s", detail);
        goto close_fd;
    }
    if (bytes > SIZE_MAX) {
        rc = fd_bad(st, "%s", "bytes does not fit in the daemon's address space");
        goto close_fd;
    }
    qm_shm_map *m = qm_calloc(1, sizeof *m);
    if (!m) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory for a map");
        goto close_fd;
    }
    void *base = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        int e = errno;
        qm_free(m);
        if (e == EPERM || e == EACCES)
            rc = fd_bad(st,
                        "the memfd cannot be mapped read-write (%s): it is sealed against "
                        "writing or opened read-only; the daemon writes output_to there",
                        strerror(e));
        else
            rc = fd_bad(st, "the memfd cannot be mapped (%s)", strerror(e));
        goto close_fd;
    }
    m->base = base;
    m->bytes = bytes;
    atomic_init(&m->refs, 1);
    *out = m;
close_fd:
    close(fd);
    return rc;
}

void qm_shm_ref(qm_shm_map *m)
{
    atomic_fetch_add(&m->refs, 1);
}

void qm_shm_unref(qm_shm_map *m)
{
    if (!m || atomic_fetch_sub(&m->refs, 1) > 1)
        return;
    munmap(m->base, (size_t)m->bytes);
    qm_free(m);
}

void qm_shm_set_init(qm_shm_set *s)
{
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->lock, NULL);
}

void qm_shm_set_destroy(qm_shm_set *s) { pthread_mutex_destroy(&s->lock); }

static int set_add(qm_shm_set *s, qm_shm_map *m, uint64_t max_bytes, qm_status *st)
{
    if (s->count >= QM_SHM_MAX_MAPS)
        return qm_status_set_field(st, QM_ERESOURCE_EXHAUSTED, "bytes",
                                   "the session already holds %d maps, the most it may; "
                                   "session.unmap one first",
                                   QM_SHM_MAX_MAPS);
    if (m->bytes > max_bytes || s->bytes > max_bytes - m->bytes)
        return qm_status_set_field(st, QM_ERESOURCE_EXHAUSTED, "bytes",
                                   "mapping %llu more bytes would exceed max_mapped_bytes %llu "
                                   "(the session has %llu mapped)",
                                   (unsigned long long)m->bytes, (unsigned long long)max_bytes,
                                   (unsigned long long)s->bytes);
    m->next = s->head;
    s->head = m;
    s->count++;
    s->bytes += m->bytes;
    return 0;
}

int qm_shm_set_add(qm_shm_set *s, qm_shm_map *m, uint64_t max_bytes, uint64_t conn_id,
                   qm_status *st)
{
    m->holder = conn_id;
    m->orphaned_us = 0;
    pthread_mutex_lock(&s->lock);
    int rc = set_add(s, m, max_bytes, st);
    pthread_mutex_unlock(&s->lock);
    return rc;
}

/* The map `id` of s (borrowed; the set's lock held). */
static qm_shm_map *set_find(const qm_shm_set *s, uint64_t id)
{
    for (qm_shm_map *m = s->head; m; m = m->next)
        if (m->id == id)
            return m;
    return NULL;
}

/* Takes *pp off the list (the set's lock held): the list's reference is
 * the caller's. */
static qm_shm_map *set_unlink(qm_shm_set *s, qm_shm_map **pp)
{
    qm_shm_map *m = *pp;
    *pp = m->next;
    s->count--;
    s->bytes -= m->bytes;
    m->next = NULL;
    return m;
}

int qm_shm_set_remove(qm_shm_set *s, uint64_t id, qm_status *st)
{
    qm_shm_map *found = NULL;
    pthread_mutex_lock(&s->lock);
    for (qm_shm_map **pp = &s->head; *pp; pp = &(*pp)->next)
        if ((*pp)->id == id) {
            found = set_unlink(s, pp);
            break;
        }
    pthread_mutex_unlock(&s->lock);
    if (found) {
        qm_shm_unref(found);
        return 0;
    }
    return qm_status_set_field(st, QM_ENOT_FOUND, "map", "the session holds no map %llu",
                               (unsigned long long)id);
}

void qm_shm_set_release_all(qm_shm_set *s)
{
    pthread_mutex_lock(&s->lock);
    qm_shm_map *list = s->head;
    s->head = NULL;
    s->count = 0;
    s->bytes = 0;
    pthread_mutex_unlock(&s->lock);
    while (list) {
        qm_shm_map *m = list;
        list = m->next;
        m->next = NULL;
        qm_shm_unref(m);
    }
}

size_t qm_shm_set_conn_closed(qm_shm_set *s, uint64_t conn_id, uint64_t now_us)
{
    size_t n = 0;
    pthread_mutex_lock(&s->lock);
    for (qm_shm_map *m = s->head; m; m = m->next)
        if (m->holder == conn_id && !m->orphaned_us) {
            m->orphaned_us = now_us ? now_us : 1;
            n++;
        }
    pthread_mutex_unlock(&s->lock);
    return n;
}

void qm_shm_set_restart_clocks(qm_shm_set *s, uint64_t now_us)
{
    pthread_mutex_lock(&s->lock);
    for (qm_shm_map *m = s->head; m; m = m->next)
        if (m->orphaned_us)
            m->orphaned_us = now_us ? now_us : 1;
    pthread_mutex_unlock(&s->lock);
}

uint64_t qm_shm_set_next_due(qm_shm_set *s, uint64_t limit_us)
{
    uint64_t first = 0;
    pthread_mutex_lock(&s->lock);
    for (qm_shm_map *m = s->head; m; m = m->next)
        if (m->orphaned_us && (!first || m->orphaned_us + limit_us < first))
            first = m->orphaned_us + limit_us;
    pthread_mutex_unlock(&s->lock);
    return first;
}

size_t qm_shm_set_reclaim(qm_shm_set *s, uint64_t now_us, uint64_t limit_us, uint64_t *bytes)
{
    qm_shm_map *due = NULL;
    size_t n = 0;
    pthread_mutex_lock(&s->lock);
    for (qm_shm_map **pp = &s->head; *pp;) {
        qm_shm_map *m = *pp;
        if (!m->orphaned_us || now_us - m->orphaned_us < limit_us) {
            pp = &m->next;
            continue;
        }
        set_unlink(s, pp);
        *bytes += m->bytes;
        m->next = due;
        due = m;
        n++;
    }
    pthread_mutex_unlock(&s->lock);
    while (due) { /* a job still using one keeps its memory until it is done */
        qm_shm_map *m = due;
        due = m->next;
        m->next = NULL;
        qm_shm_unref(m);
    }
    return n;
}

void qm_map_refs_release(qm_map_refs *refs)
{
    for (int i = 0; i < refs->n; i++)
        qm_shm_unref(refs->maps[i]);
    memset(refs, 0, sizeof *refs);
}

/* The map `id` of s with [offset, offset + n) inside it, referenced. */
static int region(const qm_shm_set *s, uint64_t id, uint64_t offset, uint64_t n, const char *name,
                  uint64_t conn_id, qm_map_refs *refs, uint8_t **out, qm_status *st)
{
    char field[64];
    qm_shm_map *m = set_find(s, id);
    if (!m) {
        snprintf(field, sizeof field, "%s.map", name);
        return qm_status_set_field(st, QM_ENOT_FOUND, field,
                                   "%s.map %llu is not a map of this session (session.map "
                                   "returns the ids it may use)",
                                   name, (unsigned long long)id);
    }
    if (offset > m->bytes || n > m->bytes - offset) {
        snprintf(field, sizeof field, "%s.offset", name);
        return qm_status_set_field(
            st, QM_EINVAL, field, "%s needs bytes [%llu, %llu) of map %llu, which has %llu", name,
            (unsigned long long)offset, (unsigned long long)offset + (unsigned long long)n,
            (unsigned long long)id, (unsigned long long)m->bytes);
    }
    if (refs->n == QM_SHM_JOB_MAPS)
        return qm_status_set(st, QM_EINTERNAL, "too many mapped tensors in one request");
    m->holder = conn_id;
    m->orphaned_us = 0;
    qm_shm_ref(m);
    refs->maps[refs->n++] = m;
    *out = m->base + offset;
    return 0;
}

static int resolve_tensor(const qm_shm_set *s, qm_tensor *t, const char *name, uint64_t conn_id,
                          qm_map_refs *refs, qm_status *st)
{
    if (!t->mapped)
        return 0;
    uint8_t *p;
    int rc = region(s, t->map, t->offset, t->nbytes, name, conn_id, refs, &p, st);
    if (rc < 0)
        return rc;
    if (t->dtype == QM_WIRE_I32) {
        /* Integer inputs are validated before the job runs: a snapshot, so
         * the client cannot change them between the check and the use. */
        void *copy = qm_malloc(t->nbytes ? (size_t)t->nbytes : 1);
        if (!copy)
            return qm_status_set(st, QM_ENOMEM, "out of memory copying %s", name);
        memcpy(copy, p, (size_t)t->nbytes);
        t->data = copy;
        t->mapped = 0;
        return 0;
    }
    t->data = p;
    return 0;
}

static int overlaps(const uint8_t *a, uint64_t an, const qm_tensor *t)
{
    if (!t->mapped || !t->data)
        return 0;
    const uint8_t *b = t->data;
    return a < b + t->nbytes && b < a + an;
}

static int resolve_locked(const qm_shm_set *s, qm_params *p, uint64_t out_bytes,
                          uint64_t conn_id, qm_map_refs *refs, qm_status *st)
{
    struct {
        qm_tensor *t;
        const char *name;
    } inputs[] = {{&p->hidden, "hidden"},
                  {p->has_router_logits ? &p->router_logits : NULL, "router_logits"},
                  {p->has_topk ? &p->topk_ids : NULL, "topk_ids"},
                  {p->has_topk ? &p->topk_weights : NULL, "topk_weights"}};
    size_t n_inputs = sizeof inputs / sizeof inputs[0];
    int rc = 0;
    for (size_t i = 0; i < n_inputs && rc == 0; i++)
        if (inputs[i].t)
            rc = resolve_tensor(s, inputs[i].t, inputs[i].name, conn_id, refs, st);
    if (rc == 0 && p->has_output_to) {
        rc = region(s, p->output_map, p->output_offset, out_bytes, "output_to", conn_id, refs,
                    &refs->output, st);
        for (size_t i = 0; i < n_inputs && rc == 0; i++)
            if (inputs[i].t && overlaps(refs->output, out_bytes, inputs[i].t))
                refs->output_overlaps = 1;
    }
    if (rc < 0) {
        /* The tensors pointing into maps let go of them with the refs. */
        for (size_t i = 0; i < n_inputs; i++)
            if (inputs[i].t && inputs[i].t->mapped)
                inputs[i].t->data = NULL;
        qm_map_refs_release(refs);
    }
    return rc;
}

int qm_shm_resolve(qm_shm_set *s, qm_params *p, uint64_t out_bytes, uint64_t conn_id,
                   qm_map_refs *refs, qm_status *st)
{
    memset(refs, 0, sizeof *refs);
    pthread_mutex_lock(&s->lock);
    int rc = resolve_locked(s, p, out_bytes, conn_id, refs, st);
    pthread_mutex_unlock(&s->lock);
    return rc;
}
