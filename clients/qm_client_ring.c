/* qm_client_ring.c - the client's side of a session's call ring
 * (PROTOCOL.md "session.ring", protocol/qm_ring_wire.h): opening it over
 * the socket, a call through it, and the ways it ends.
 *
 * Every function here runs with the handle's lock held (one call at a
 * time per handle, as on the socket). The region is memory the daemon
 * writes: the answer is copied out of it once, and nothing in it is
 * trusted to end a wait (the socket's hang-up and the handle's timeout
 * do). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create, F_ADD_SEALS, POLLRDHUP */
#endif
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_client_internal.h"
#include "qm_ring_wire.h"

/* While parked for an answer, the socket is looked at this often: a daemon
 * that died is noticed by its connection's hang-up. */
#define QM__RING_SLICE_NS 20000000u

struct qm__ring {
    char session[132];
    uint8_t *base;     /* this process's mapping of the region; NULL: refused */
    uint64_t conn_gen; /* the connection it was opened on */
    uint32_t seq;      /* the last call number rung */
    qm_ring_spin spin;
    qm__ring *next;
};

static uint32_t *word(const qm__ring *r, size_t off) { return qm_ring_word(r->base, off); }

static qm__ring *ring_find(qm_client *c, const char *session)
{
    for (qm__ring *r = c->rings; r; r = r->next)
        if (strcmp(r->session, session) == 0)
            return r;
    return NULL;
}

static void ring_unlink_free(qm_client *c, qm__ring *r)
{
    for (qm__ring **pp = &c->rings; *pp; pp = &(*pp)->next) {
        if (*pp == r) {
            *pp = r->next;
            break;
        }
    }
    if (r->base)
        munmap(r->base, QM_RING_BYTES);
    qm_free(r);
}

void qm__client_rings_forget(qm_client *c, const char *session)
{
    for (qm__ring *r = c->rings, *next; r; r = next) {
        next = r->next;
        if (!session || strcmp(r->session, session) == 0)
            ring_unlink_free(c, r);
    }
}

/* A sealed memfd of one page, mapped here: *fd to send, *base ours. */
static int ring_region(int *fd, uint8_t **base, qm_client_error *err)
{
    *fd = memfd_create("qmoe-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (*fd < 0)
        return qm__client_fail(err, QM_CLIENT_EIO, "memfd_create: %s", strerror(errno));
    void *p = MAP_FAILED;
    if (ftruncate(*fd, QM_RING_BYTES) < 0 ||
        fcntl(*fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0 ||
        (p = mmap(NULL, QM_RING_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0)) ==
            MAP_FAILED) {
        int e = errno;
        close(*fd);
        return qm__client_fail(err, e == ENOMEM ? QM_CLIENT_ENOMEM : QM_CLIENT_EIO,
                               "cannot create a call ring's region: %s", strerror(e));
    }
    *base = p;
    return 0;
}

/* The daemon has no such session: -32001 naming `session`. */
static int ring_session_missing(int rc, const qm_client_error *e)
{
    return rc == -32001 && e && strcmp(e->field, "session") == 0;
}

/* session.ring for `session` on the current connection: the record (kept
 * also when refused, so the socket is used without asking again until
 * the handle reconnects or qm_client_session_ring is called). */
static int ring_open(qm_client *c, const char *session, qm__ring **out, qm_client_error *err)
{
    *out = NULL;
    if (strlen(session) >= sizeof((qm__ring *)0)->session)
        return qm__client_fail(err, QM_CLIENT_EINVAL, "session id too long");
    qm__ring *r = ring_find(c, session);
    if (r && r->base) {
        munmap(r->base, QM_RING_BYTES);
        r->base = NULL;
    }
    if (!r) {
        r = qm_calloc(1, sizeof *r);
        if (!r)
            return qm__client_fail(err, QM_CLIENT_ENOMEM, "out of memory");
        snprintf(r->session, sizeof r->session, "%s", session);
        r->next = c->rings;
        c->rings = r;
    }
    int fd = -1;
    uint8_t *base = NULL;
    int rc = ring_region(&fd, &base, err);
    if (rc < 0)
        return rc;
    qm_cval *res = NULL;
    for (int anticipate = c->ring_anticipate;; anticipate = 0) {
        qm_cval *p = qm_cval_new(QM_CVAL_OBJECT);
        if (!p || qm_cval_append(p, "session", qm_cval_new_string(session)) < 0 ||
            (anticipate && qm_cval_append(p, "anticipate", qm_cval_new_bool(1)) < 0)) {
            qm_cval_free(p);
            close(fd);
            munmap(base, QM_RING_BYTES);
            return qm__client_fail(err, QM_CLIENT_ENOMEM, "out of memory");
        }
        qm_client_error why;
        memset(&why, 0, sizeof why);
        rc = qm__client_exchange(c, "session.ring", p, NULL, 0, fd, &res, &why);
        qm_cval_free(p);
        if (err)
            *err = why;
        /* A daemon older than `anticipate` names it unknown: a ring without. */
        if (!(anticipate && rc == -32602 && strcmp(why.field, "anticipate") == 0))
            break;
    }
    close(fd); /* the daemon holds its own mapping */
    uint64_t version = 0;
    if (rc == 0 && (qm_cval_get_u64(res, "version", &version) < 0 || version != QM_RING_VERSION))
        rc = qm__client_fail(err, QM_CLIENT_EPROTO,
                             "qmoed's call ring is version %llu; this client speaks %u",
                             (unsigned long long)version, QM_RING_VERSION);
    qm_cval_free(res);
    /* Refused (or the connection broke): this connection uses the socket.
     * Not when the daemon lacks the session (a restarted daemon, before the
     * session is re-created): asked again on the next call. */
    r->conn_gen = ring_session_missing(rc, err) ? UINT64_MAX : c->conn_gen;
    if (rc < 0) {
        munmap(base, QM_RING_BYTES);
        return rc;
    }
    r->base = base;
    r->seq = qm_ring_load(word(r, QM_RING_OFF_ANS_SEQ));
    qm_ring_spin_init(&r->spin);
    *out = r;
    return 0;
}

/* The call's request, every region in the one map. */
static void ring_request(const qm_client_mapped_infer *q, qm_ring_request *req)
{
    memset(req, 0, sizeof *req);
    const qm_client_region *src[4] = {&q->hidden, q->router_logits, q->topk_ids,
                                      q->topk_weights};
    qm_ring_tensor *dst[4] = {&req->hidden, &req->router_logits, &req->topk_ids,
                              &req->topk_weights};
    for (int i = 0; i < 4; i++) {
        if (!src[i])
            continue;
        *dst[i] = (qm_ring_tensor){(uint32_t)src[i]->dtype, src[i]->rows, src[i]->cols,
                                   q->map->id, src[i]->offset};
    }
    req->layer = (uint32_t)q->layer;
    req->flags = (q->router_logits ? QM_RING_F_ROUTER_LOGITS : 0) |
                 (q->topk_ids || q->topk_weights ? QM_RING_F_TOPK : 0);
    req->output_map = q->map->id;
    req->output_offset = q->output_offset;
}

/* The ring was closed by the daemon: as the socket would say it. */
static int ring_closed(qm_client *c, qm__ring *r, int32_t code, const char *reason,
                       qm_client_error *err)
{
    ring_unlink_free(c, r);
    if (code == QM_RING_CLOSED_CONN || code >= 0) {
        qm__client_drop(c);
        return qm__client_fail(err, QM_CLIENT_EIO, "qmoed closed the connection: %s", reason);
    }
    return qm__client_fail(err, code, "%s", reason);
}

/* 1 when the socket says the daemon's end is gone. */
static int socket_hung_up(const qm_client *c)
{
    struct pollfd p = {.fd = c->fd, .events = POLLIN | POLLRDHUP};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL));
}

/* Waits for answer `seq`: spins for the budget the spin rule gives, then
 * parks on ANS_SEQ in slices, looking at the socket between them. 0 when
 * answered (*parked: whether it slept), 1 when the ring closed, or the
 * connection's error (QM_CLIENT_EIO, QM_CLIENT_ETIMEDOUT). */
static int ring_wait(qm_client *c, qm__ring *r, uint32_t seq, uint64_t t0, int *parked,
                     qm_client_error *err)
{
    uint32_t *ans = word(r, QM_RING_OFF_ANS_SEQ), *flag = word(r, QM_RING_OFF_CLIENT_PARKED);
    const uint32_t *state = word(r, QM_RING_OFF_STATE);
    uint64_t budget = qm_ring_spin_budget(&r->spin);
    uint64_t deadline = t0 + (uint64_t)c->timeout_ms * 1000000u;
    *parked = 0;
    /* No budget: one look, then park at once. Where the daemon's thread was
     * woken onto this CPU (a VM whose idle vCPUs look preempted to the
     * guest's scheduler puts it there), it runs only once this thread
     * sleeps: 64 spins first cost each call 2.7 us of its doorbell's
     * wake-up (tiny bank, bench/ipc, 8.1 -> 5.4 us). */
    for (unsigned i = 0;; i++) {
        if (qm_ring_load(ans) == seq)
            return 0;
        if (qm_ring_load(state) != QM_RING_OPEN)
            return 1;
        if (budget == 0 || ((i & 63) == 63 && qm_ring_now_ns() - t0 >= budget))
            break;
        qm_ring_cpu_relax();
    }
    for (;;) {
        qm_ring_store(flag, 1);
        uint32_t v = qm_ring_load(ans);
        int timed_out = 0;
        if (v != seq && qm_ring_load(state) == QM_RING_OPEN) {
            uint64_t now = qm_ring_now_ns();
            uint64_t slice = deadline > now ? deadline - now : 1;
            timed_out = qm_ring_futex_wait(ans, v, slice < QM__RING_SLICE_NS ? slice
                                                                               : QM__RING_SLICE_NS);
            *parked = 1;
        }
        qm_ring_store(flag, 0);
        if (qm_ring_load(ans) == seq)
            return 0;
        if (qm_ring_load(state) != QM_RING_OPEN)
            return 1;
        if (timed_out && socket_hung_up(c)) {
            qm__client_drop(c);
            return qm__client_fail(err, QM_CLIENT_EIO,
                                   "qmoed closed the connection before answering");
        }
        if (qm_ring_now_ns() >= deadline) {
            /* A late answer would land in a region nobody reads: the
             * connection goes, and the ring with it. */
            qm__client_drop(c);
            return qm__client_fail(err, QM_CLIENT_ETIMEDOUT, "qmoed did not answer in time");
        }
    }
}

/* One call through r; the daemon's answer as the socket gives it. */
static int ring_call(qm_client *c, qm__ring *r, const qm_client_mapped_infer *q,
                     qm_client_infer_stats *stats, qm_client_error *err)
{
    int32_t code;
    char reason[QM_RING_REASON_BYTES];
    if (qm_ring_header_closed(r->base, &code, reason, sizeof reason))
        return ring_closed(c, r, code, reason, err);
    qm_ring_request req;
    ring_request(q, &req);
    uint64_t t0 = qm_ring_now_ns();
    req.rung_ns = t0;
    qm_ring_request_write(r->base + QM_RING_OFF_REQUEST, &req);
    uint32_t seq = r->seq + 1;
    r->seq = seq;
    qm_ring_store(word(r, QM_RING_OFF_REQ_SEQ), seq);
    if (qm_ring_load(word(r, QM_RING_OFF_DAEMON_PARKED)))
        qm_ring_futex_wake(word(r, QM_RING_OFF_REQ_SEQ));
    int parked;
    int rc = ring_wait(c, r, seq, t0, &parked, err);
    if (rc < 0) {
        ring_unlink_free(c, r);
        return rc;
    }
    if (rc == 1) {
        qm_ring_header_closed(r->base, &code, reason, sizeof reason);
        return ring_closed(c, r, code, reason, err);
    }
    qm_ring_answer a;
    qm_ring_answer_read(r->base + QM_RING_OFF_ANSWER, &a);
    qm__client_answered_on = r->conn_gen;
    uint64_t now = qm_ring_now_ns();
    qm_ring_spin_note_wait(&r->spin, now - t0);
    if (parked && a.answered_ns && a.answered_ns <= now)
        qm_ring_spin_note_wake(&r->spin, now - a.answered_ns);
    if (a.code) {
        qm__client_fail(err, a.code, "%s", a.reason);
        if (err)
            snprintf(err->field, sizeof(err->field), "%s", a.field);
        return a.code;
    }
    if (stats) {
        stats->hits = a.stats[QM_RING_STAT_HITS];
        stats->misses = a.stats[QM_RING_STAT_MISSES];
        stats->bytes_paged = a.stats[QM_RING_STAT_BYTES_PAGED];
        stats->queue_us = a.stats[QM_RING_STAT_QUEUE_US];
        stats->compute_us = a.stats[QM_RING_STAT_COMPUTE_US];
    }
    return 0;
}

int qm__client_ring_infer(qm_client *c, const qm_client_mapped_infer *q,
                          qm_client_infer_stats *stats, int *rc, qm_client_error *err)
{
    if (c->ring_mode == QM_CLIENT_RING_OFF)
        return 0;
    qm__ring *r = ring_find(c, q->session);
    int current = r && c->fd >= 0 && r->conn_gen == c->conn_gen;
    if (r && !current && c->ring_mode == QM_CLIENT_RING_EXPLICIT) {
        ring_unlink_free(c, r); /* a ring of a connection that is gone */
        return 0;
    }
    if (!current) {
        if (c->ring_mode != QM_CLIENT_RING_AUTO)
            return 0;
        qm_client_error why;
        int orc = ring_open(c, q->session, &r, &why);
        if (orc < 0) {
            /* The connection broke opening it, or the daemon lacks the
             * session (restarted: the caller's resume re-creates it and
             * calls again, which opens the ring then): that error. */
            if (c->fd < 0 || ring_session_missing(orc, &why)) {
                if (err)
                    *err = why;
                *rc = orc;
                return 1;
            }
            fprintf(stderr,
                    "libqmoe-client: no call ring for session %.64s (%s: %s); its calls go "
                    "through the socket\n",
                    q->session, why.name, why.reason);
            return 0;
        }
    }
    if (!r->base)
        return 0; /* refused on this connection */
    *rc = ring_call(c, r, q, stats, err);
    return 1;
}

int qm__client_ring_reopen_due(qm_client *c, const char *session)
{
    const qm__ring *r = ring_find(c, session);
    return c->ring_mode == QM_CLIENT_RING_EXPLICIT && r && r->base && r->conn_gen != c->conn_gen;
}

int qm_client_session_ring(qm_client *c, const char *session, qm_client_error *err)
{
    if (err)
        memset(err, 0, sizeof(*err));
    if (!c || !session)
        return qm__client_fail(err, QM_CLIENT_EINVAL, "no client handle or session id given");
    pthread_mutex_lock(&c->lock);
    qm__ring *r;
    int rc = ring_open(c, session, &r, err); /* connects first when the handle must */
    pthread_mutex_unlock(&c->lock);
    return rc;
}

void qm_client_set_ring(qm_client *c, int mode)
{
    if (!c)
        return;
    pthread_mutex_lock(&c->lock);
    c->ring_mode = mode == QM_CLIENT_RING_OFF || mode == QM_CLIENT_RING_EXPLICIT
                       ? mode
                       : QM_CLIENT_RING_AUTO;
    pthread_mutex_unlock(&c->lock);
}

int qm_client_ring_active(qm_client *c, const char *session)
{
    if (!c || !session)
        return 0;
    pthread_mutex_lock(&c->lock);
    const qm__ring *r = ring_find(c, session);
    int on = c->ring_mode != QM_CLIENT_RING_OFF && c->fd >= 0 && r && r->base &&
             r->conn_gen == c->conn_gen;
    pthread_mutex_unlock(&c->lock);
    return on;
}

void qm_client_set_ring_anticipate(qm_client *c, int on)
{
    if (!c)
        return;
    pthread_mutex_lock(&c->lock);
    c->ring_anticipate = on != 0;
    pthread_mutex_unlock(&c->lock);
}
