/* qm_ring.c - call rings (qm_ring.h; PROTOCOL.md "session.ring").
 *
 * One thread per ring waits on the region's doorbell (spinning for about
 * the gap it expects between calls when that is shorter than a wake-up,
 * else parked on the futex word, using no CPU), copies the request slot
 * once, decodes the copy and runs the call in its session's order
 * (qm_pool_run_or_queue): on this thread when the session's FIFO is idle,
 * else on a worker behind the session's work, the thread waiting for that
 * answer before it takes the next call (one call in flight per ring).
 *
 * The loop opens rings, stops them (the connection, the session, the
 * drain) and reaps the threads that ended (an eventfd they write, as the
 * pool's workers do). A ring's memory, its session reference and its hold
 * on the connection go when it is reaped: its thread has ended and no call
 * of it is in flight. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* pthread_setname_np */
#endif
#include "qm_ring.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_fault.h"
#include "qm_io.h"
#include "qm_log.h"
#include "qm_methods.h"
#include "qm_ring_params.h"
#include "qm_sessions.h"
#include "qm_shm.h"
#include "qm_telemetry.h"

#define QM__RING_TEMPO 256u /* layers whose gaps a ring keeps apart (then modulo) */

struct qm_ring {
    qm_rings *rings;
    uint64_t id;
    qm_session *session; /* a reference, dropped when reaped */
    qm_conn *conn;       /* held (qm_conn_hold) until reaped */
    uint64_t conn_id;
    qm_shm_map *map; /* the region's mapping */
    uint8_t *base;
    uv_thread_t thread;
    /* Stopping: set once by the loop (code and reason written first); the
     * thread takes no new call after it. */
    atomic_int stop;
    int32_t stop_code;
    char stop_reason[QM_RING_REASON_BYTES];
    atomic_int conn_gone; /* its connection closed: calls in flight are skipped */
    atomic_int abandon;   /* the daemon exits: the thread leaves with a call queued */
    pthread_mutex_t mu;   /* outstanding */
    pthread_cond_t cv;
    int outstanding; /* 1 while its call's job has not posted its answer */
    atomic_int exited;
    int counted; /* loop: counted in the rings' `open` (until stopped) */
    /* The thread's own. */
    uint32_t last_seq;   /* the call number last taken */
    qm_ring_spin spin;   /* how long to spin for the next call */
    atomic_uint_fast64_t last_answer_ns; /* when the last answer was posted */
    /* Anticipation (session.ring's `anticipate`): per layer (modulo
     * QM__RING_TEMPO), a moving average of the gap from answering a call
     * of that layer to the next call; the layer answered last. */
    int anticipate;
    uint64_t gap_ns[QM__RING_TEMPO];
    uint32_t last_layer;
    qm_ring *next;
};

struct qm_rings {
    uv_loop_t *loop;
    const qm_method_ctx *mx;
    int efd;             /* written by ring threads that ended */
    uv_poll_t reap_poll; /* the loop's watch on efd */
    int polling;
    qm_ring *head;       /* every ring not yet reaped */
    uint32_t open;       /* rings open and not stopped (what max_rings bounds) */
    uint64_t next_id;
};

/* A ring's answered calls reach the loop's counters within about this
 * (qm_pool_nudge): one wake-up of the loop for every so many calls rather
 * than one a call; a frame to dispatch takes them sooner. A ring that
 * parks before they are that old sleeps at most until they are, nudges,
 * and then sleeps until its next call: the loop is never left with calls
 * it did not count, and an idle daemon has no timer. */
#define QM__RING_NUDGE_US 20000u

/* Anticipation: the thread wakes `margin` before the gap it expects after
 * the layer it answered last, and spins until `margin` after it: margin =
 * 50 us + gap / 8 (a decode's gaps between layer calls move by about an
 * eighth), at most QM__RING_MARGIN_MAX_NS; only for gaps under
 * QM__RING_TEMPO_MAX_NS (a longer one is not a decode's tempo). */
#define QM__RING_MARGIN_MAX_NS 200000u
#define QM__RING_TEMPO_MAX_NS 20000000u

static uint32_t *word(const qm_ring *r, size_t off) { return qm_ring_word(r->base, off); }

/* ---- the thread ---- */

/* Spins on the doorbell until `end` (qm_ring_now_ns) at least 64 looks, or
 * looks once when `end` is 0: 0 with *seq when a call came, -1 once the
 * ring stops, 1 at `end`. */
static int ring_spin(qm_ring *r, const uint32_t *req, uint32_t *seq, uint64_t end)
{
    for (unsigned i = 0;; i++) {
        if (atomic_load(&r->stop))
            return -1;
        uint32_t v = qm_ring_load(req);
        if (v != r->last_seq) {
            *seq = v;
            /* A stop moves the doorbell after it sets `stop`. */
            return atomic_load(&r->stop) ? -1 : 0;
        }
        if (!end || ((i & 63) == 63 && qm_ring_now_ns() >= end))
            return 1;
        qm_ring_cpu_relax();
    }
}

/* Anticipation (the ring's `anticipate`): when the gap expected after
 * the layer answered last is known, sleeps (DAEMON_PARKED set: a call that
 * comes early wakes it as usual) until `margin` before it, then spins until
 * `margin` after it. 0 with *seq when a call came, -1 when the ring stops,
 * 1 when none came in the window (the caller parks as usual). */
static int ring_anticipate(qm_ring *r, uint32_t *req, uint32_t *flag, uint32_t *seq)
{
    uint64_t last = atomic_load(&r->last_answer_ns);
    uint64_t gap = r->gap_ns[r->last_layer % QM__RING_TEMPO];
    if (!last || !gap || gap >= QM__RING_TEMPO_MAX_NS)
        return 1;
    uint64_t margin = 50000u + gap / 8;
    if (margin > QM__RING_MARGIN_MAX_NS)
        margin = QM__RING_MARGIN_MAX_NS;
    uint64_t now = qm_ring_now_ns();
    if (now < last || now - last >= gap + margin)
        return 1; /* past the window already */
    if (now - last + margin < gap) {
        qm_ring_store(flag, 1);
        if (!atomic_load(&r->stop) && qm_ring_load(req) == r->last_seq)
            qm_ring_futex_wait(req, r->last_seq, gap - margin - (now - last));
        qm_ring_store(flag, 0);
    }
    return ring_spin(r, req, seq, last + gap + margin);
}

/* The next call number, or -1 once the ring stops. Spins for the budget
 * its measurements give, then parks on REQ_SEQ (DAEMON_PARKED tells the
 * client to wake it). *parked: whether it slept. */
static int ring_wait_request(qm_ring *r, uint32_t *seq, int *parked)
{
    uint32_t *req = word(r, QM_RING_OFF_REQ_SEQ), *flag = word(r, QM_RING_OFF_DAEMON_PARKED);
    *parked = 0;
    /* No budget: one look, then park (the client may be waiting for this
     * CPU: see libqmoe-client's ring_wait). */
    uint64_t budget = qm_ring_spin_budget(&r->spin);
    int got = ring_spin(r, req, seq, budget ? qm_ring_now_ns() + budget : 0);
    if (got != 1)
        return got;
    if (r->anticipate && (got = ring_anticipate(r, req, flag, seq)) != 1)
        return got;
    /* Nothing to do until the next call: the loop may count the last ones
     * (now, or once they are old enough: then this thread wakes to say so). */
    uint64_t nudge_in_us = qm_pool_nudge(r->rings->mx->pool, QM__RING_NUDGE_US);
    for (;;) {
        /* Parked first, then a last look: either the client sees the flag
         * and wakes this thread, or this look sees its call. */
        qm_ring_store(flag, 1);
        if (!atomic_load(&r->stop) && qm_ring_load(req) == r->last_seq) {
            qm_ring_futex_wait(req, r->last_seq, nudge_in_us * 1000u);
            nudge_in_us = qm_pool_nudge(r->rings->mx->pool, QM__RING_NUDGE_US);
            *parked = 1;
        }
        qm_ring_store(flag, 0);
        if (atomic_load(&r->stop))
            return -1;
        uint32_t v = qm_ring_load(req);
        if (v != r->last_seq) {
            *seq = v;
            return 0;
        }
    }
}

/* What this call taught the spin rule: the gap since the last answer, and
 * (when the thread slept) what the wake-up cost, from the client's stamp. */
static void ring_learn(qm_ring *r, uint64_t rung_ns, uint64_t taken_ns, int parked)
{
    uint64_t last = atomic_load(&r->last_answer_ns);
    uint64_t at = rung_ns && rung_ns <= taken_ns && rung_ns >= last ? rung_ns : taken_ns;
    if (last && at >= last) {
        qm_ring_spin_note_wait(&r->spin, at - last);
        if (r->anticipate) { /* the gap after the layer answered last */
            uint64_t *g = &r->gap_ns[r->last_layer % QM__RING_TEMPO], gap = at - last;
            *g = *g ? *g - *g / 4 + gap / 4 : gap;
        }
    }
    if (parked && rung_ns && rung_ns <= taken_ns)
        qm_ring_spin_note_wake(&r->spin, taken_ns - rung_ns);
}

/* An answer without a job (no memory for one): the client is not left
 * waiting. */
static void ring_post_error(qm_ring *r, uint32_t seq, int code, const char *reason)
{
    qm_ring_answer a;
    memset(&a, 0, sizeof a);
    a.code = code;
    snprintf(a.reason, sizeof a.reason, "%s", reason);
    a.answered_ns = qm_ring_now_ns();
    qm_ring_answer_write(r->base + QM_RING_OFF_ANSWER, &a);
    qm_ring_store(word(r, QM_RING_OFF_ANS_SEQ), seq);
    qm_ring_futex_wake(word(r, QM_RING_OFF_ANS_SEQ));
}

/* Call `seq`: the slot copied once (the client may write it at any
 * moment; only the copy is read), decoded, and run in the session's order.
 * A request that does not decode still runs as a job, which answers the
 * error in order and is counted. */
static void ring_take(qm_ring *r, uint32_t seq, int parked)
{
    uint8_t copy[QM_RING_REQUEST_BYTES];
    memcpy(copy, r->base + QM_RING_OFF_REQUEST, sizeof copy);
    uint64_t taken_ns = qm_ring_now_ns();
    r->last_seq = seq;
    qm_ring_job *rj = qm_calloc(1, sizeof *rj);
    if (!rj) {
        ring_post_error(r, seq, QM_RPC_RESOURCE_EXHAUSTED, "out of memory for a ring call");
        return;
    }
    qm_job *job = &rj->job;
    job->ops = &qm__ring_infer_ops;
    job->mx = r->rings->mx;
    job->session = r->session;
    qm_session_ref(r->session); /* the ring holds one: never the last */
    job->queue = qm_session_queue(r->session);
    job->conn_id = r->conn_id; /* its maps are held by the ring's connection */
    job->req.method = QM_METHOD_SESSION_INFER;
    job->read_us = qm_now_us();
    qm_buf_init(&job->response);
    uint64_t rung_ns = 0;
    job->rc = qm_ring_params_decode(copy, &job->req.params, &rung_ns, &job->st);
    job->decode_us = qm_now_us() - job->read_us;
    ring_learn(r, rung_ns, taken_ns, parked);
    if (r->anticipate && job->rc == 0)
        r->last_layer = job->req.params.layer;
    rj->ring = r;
    rj->seq = seq;
    pthread_mutex_lock(&r->mu);
    r->outstanding = 1;
    pthread_mutex_unlock(&r->mu);
    /* Calls back to back never let the thread sleep: the loop hears of
     * them every QM__RING_NUDGE_US all the same. */
    qm_pool_nudge(job->mx->pool, QM__RING_NUDGE_US);
    qm_pool_run_or_queue(job->mx->pool, job);
}

/* Until the call taken last has posted its answer (at once when it ran on
 * this thread), or the daemon exits. */
static void ring_wait_answered(qm_ring *r)
{
    pthread_mutex_lock(&r->mu);
    while (r->outstanding && !atomic_load(&r->abandon)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
    pthread_mutex_unlock(&r->mu);
}

static void ring_main(void *arg)
{
    qm_ring *r = arg;
    qm_fault_tag_thread(QM_FAULT_WORKER);
    pthread_setname_np(pthread_self(), "qmoed-ring"); /* what top -H and the tests see */
    uint32_t seq;
    int parked;
    while (ring_wait_request(r, &seq, &parked) == 0) {
        ring_take(r, seq, parked);
        ring_wait_answered(r);
    }
    /* The region says closed, and why, only once nothing will write an
     * answer in it; a client waiting is woken to read it. */
    qm_ring_header_close(r->base, r->stop_code, r->stop_reason);
    qm_ring_futex_wake(word(r, QM_RING_OFF_ANS_SEQ));
    atomic_store(&r->exited, 1);
    qm_eventfd_post(r->rings->efd);
}

/* ---- what a ring call's job calls ---- */

int qm_ring_abandoned(const qm_ring *r) { return atomic_load(&((qm_ring *)r)->conn_gone); }

int qm_ring_anticipates(const qm_ring *r) { return r->anticipate; }

void qm_ring_post(qm_ring_job *rj, qm_ring_answer *a)
{
    qm_ring *r = rj->ring;
    rj->ring = NULL;
    rj->answered_us = qm_now_us();
    if (a) {
        a->answered_ns = qm_ring_now_ns();
        qm_ring_answer_write(r->base + QM_RING_OFF_ANSWER, a);
        qm_ring_store(word(r, QM_RING_OFF_ANS_SEQ), rj->seq);
        if (qm_ring_load(word(r, QM_RING_OFF_CLIENT_PARKED)))
            qm_ring_futex_wake(word(r, QM_RING_OFF_ANS_SEQ));
        atomic_store(&r->last_answer_ns, a->answered_ns);
    }
    /* Last: once the thread sees it, the ring may end and be reaped. */
    pthread_mutex_lock(&r->mu);
    r->outstanding = 0;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

/* ---- the loop's side ---- */

static void ring_free(qm_ring *r)
{
    qm_conn_release(r->conn);
    qm_session_unref(r->session);
    qm_shm_unref(r->map);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    qm_free(r);
}

/* Ends the rings whose thread has ended. */
static void rings_reap(qm_rings *rs)
{
    for (qm_ring **pp = &rs->head; *pp;) {
        qm_ring *r = *pp;
        if (!atomic_load(&r->exited)) {
            pp = &r->next;
            continue;
        }
        *pp = r->next;
        uv_thread_join(&r->thread);
        qm_log(QM_LOG_DEBUG, "call ring %llu of session %s closed: %s", (unsigned long long)r->id,
               qm_session_id(r->session), r->stop_reason);
        ring_free(r);
    }
}

static void reap_cb(uv_poll_t *h, int status, int events)
{
    qm_rings *rs = h->data;
    (void)status;
    (void)events;
    qm_eventfd_take(rs->efd);
    rings_reap(rs);
}

int qm_rings_new(uv_loop_t *loop, const qm_method_ctx *mx, qm_rings **out)
{
    qm_rings *rs = qm_calloc(1, sizeof *rs);
    *out = NULL;
    if (!rs)
        return QM_ENOMEM;
    rs->loop = loop;
    rs->mx = mx;
    rs->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (rs->efd < 0 || uv_poll_init(loop, &rs->reap_poll, rs->efd) != 0) {
        if (rs->efd >= 0)
            close(rs->efd);
        qm_free(rs);
        return QM_ENOMEM;
    }
    rs->polling = 1;
    rs->reap_poll.data = rs;
    uv_poll_start(&rs->reap_poll, UV_READABLE, reap_cb);
    /* Rings are the connections' business: they keep no loop alive. */
    uv_unref((uv_handle_t *)&rs->reap_poll);
    *out = rs;
    return 0;
}

/* Stops r (the first cause names the code and reason) and wakes its
 * thread wherever it waits. */
static void ring_stop(qm_ring *r, int32_t code, const char *reason)
{
    /* A stopping ring's thread ends as soon as its call in flight is done:
     * it no longer counts against max_rings (a client reconnecting at once
     * gets its new ring). */
    if (r->counted) {
        r->counted = 0;
        r->rings->open--;
    }
    if (!atomic_load(&r->stop)) {
        r->stop_code = code;
        snprintf(r->stop_reason, sizeof r->stop_reason, "%s", reason);
        atomic_store(&r->stop, 1);
    }
    /* The doorbell moves too: a thread between its last look at `stop` and
     * its sleep finds the word changed and does not sleep (the ring is
     * closing: the client reads its own call numbers, not this word). */
    __atomic_fetch_add(word(r, QM_RING_OFF_REQ_SEQ), 1, __ATOMIC_SEQ_CST);
    qm_ring_futex_wake(word(r, QM_RING_OFF_REQ_SEQ));
    pthread_mutex_lock(&r->mu);
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static int ring_start(qm_rings *rs, qm_ring *r, qm_status *st)
{
    if (pthread_mutex_init(&r->mu, NULL) != 0)
        return qm_status_set(st, QM_ENOMEM, "cannot make the ring's lock");
    if (pthread_cond_init(&r->cv, NULL) != 0) {
        pthread_mutex_destroy(&r->mu);
        return qm_status_set(st, QM_ENOMEM, "cannot make the ring's condition");
    }
    qm_ring_header_init(r->base, QM_RING_BYTES);
    /* The client's doorbell as it stands is no call: the first is the
     * first change. */
    r->last_seq = qm_ring_load(word(r, QM_RING_OFF_REQ_SEQ));
    qm_ring_store(word(r, QM_RING_OFF_ANS_SEQ), r->last_seq);
    qm_ring_store(word(r, QM_RING_OFF_DAEMON_PARKED), 0);
    qm_ring_spin_init(&r->spin);
    r->rings = rs;
    if (uv_thread_create(&r->thread, ring_main, r) != 0) {
        pthread_cond_destroy(&r->cv);
        pthread_mutex_destroy(&r->mu);
        return qm_status_set(st, QM_ENOMEM, "cannot start the ring's thread");
    }
    return 0;
}

int qm_ring_open(qm_rings *rs, qm_session *s, qm_conn *c, int fd, int anticipate, uint64_t *id,
                 qm_status *st)
{
    const qm_method_ctx *mx = rs->mx;
    uint32_t max = mx->cfg->max_rings;
    /* One ring per session and connection: a second session.ring on the
     * same connection replaces the first once the new one runs (a client
     * that lost track of it, or asks again, leaves no thread behind it, and
     * a connection cannot take every ring of the daemon for one session);
     * the one it replaces does not count against max_rings. */
    uint32_t replaced = 0;
    for (qm_ring *o = rs->head; o; o = o->next)
        replaced += o->counted && o->session == s && o->conn_id == qm_conn_id(c);
    if (rs->open - replaced >= max) {
        close(fd);
        qm_limit_hit(mx->limits, QM_LIMIT_MAX_RINGS, "max_rings %u reached: refusing a ring", max);
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED,
                             "max_rings %u reached: the daemon has %u call rings open; close one "
                             "(its connection, or its session) or use the socket",
                             max, rs->open);
    }
    qm_shm_map *m;
    int rc = qm_shm_map_fd(fd, QM_RING_BYTES, &m, st);
    if (rc < 0)
        return rc;
    qm_ring *r = qm_calloc(1, sizeof *r);
    if (!r) {
        qm_shm_unref(m);
        return qm_status_set(st, QM_ENOMEM, "out of memory for a ring");
    }
    r->map = m;
    r->base = m->base;
    r->session = s;
    r->conn = c;
    r->conn_id = qm_conn_id(c);
    r->anticipate = anticipate;
    rc = ring_start(rs, r, st);
    if (rc < 0) {
        qm_shm_unref(m);
        qm_free(r);
        return rc;
    }
    for (qm_ring *o = rs->head; replaced && o; o = o->next)
        if (o->counted && o->session == s && o->conn_id == r->conn_id) {
            qm_log(QM_LOG_INFO, "session %s: call ring %llu replaced: its connection %llu asked "
                   "for another", qm_session_id(s), (unsigned long long)o->id,
                   (unsigned long long)o->conn_id);
            ring_stop(o, QM_RPC_CONFLICT, "the connection opened another call ring for the "
                      "session (session.ring again): this one is closed");
        }
    qm_session_ref(s);
    qm_conn_hold(c);
    r->id = ++rs->next_id;
    r->next = rs->head;
    rs->head = r;
    rs->open++;
    r->counted = 1;
    *id = r->id;
    qm_log(QM_LOG_INFO, "session %s: call ring %llu opened on connection %llu%s", qm_session_id(s),
           (unsigned long long)r->id, (unsigned long long)r->conn_id,
           anticipate ? " (anticipating its calls)" : "");
    return 0;
}

void qm_rings_conn_closed(qm_rings *rs, uint64_t conn_id)
{
    for (qm_ring *r = rs ? rs->head : NULL; r; r = r->next) {
        if (r->conn_id != conn_id)
            continue;
        atomic_store(&r->conn_gone, 1);
        ring_stop(r, QM_RING_CLOSED_CONN, "the connection that opened the ring closed");
    }
}

void qm_rings_session_closed(qm_rings *rs, const qm_session *s)
{
    for (qm_ring *r = rs ? rs->head : NULL; r; r = r->next)
        if (r->session == s)
            ring_stop(r, QM_RPC_NOT_FOUND, "the session was closed");
}

void qm_rings_drain(qm_rings *rs)
{
    for (qm_ring *r = rs ? rs->head : NULL; r; r = r->next)
        ring_stop(r, QM_RPC_SHUTTING_DOWN, "the daemon is draining and takes no new requests");
}

uint32_t qm_rings_open_count(const qm_rings *rs) { return rs ? rs->open : 0; }

void qm_rings_stop(qm_rings *rs)
{
    if (!rs)
        return;
    for (qm_ring *r = rs->head; r; r = r->next) {
        atomic_store(&r->abandon, 1);
        ring_stop(r, QM_RPC_SHUTTING_DOWN, "the daemon is exiting");
    }
    for (qm_ring *r = rs->head; r; r = r->next)
        uv_thread_join(&r->thread);
}

void qm_rings_free(qm_rings *rs)
{
    if (!rs)
        return;
    while (rs->head) {
        qm_ring *r = rs->head;
        rs->head = r->next;
        ring_free(r);
    }
    /* The poll handle was closed with the loop's other handles. */
    close(rs->efd);
    qm_free(rs);
}
