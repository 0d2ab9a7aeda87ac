/* qm_server.c - the connections (the listening socket: qm_server_socket.c).
 *
 * Per-connection limits follow Redis's networking: the input buffer is
 * bounded by max_request_bytes (qm_framer), reads pause while the output
 * queue is over max_output_bytes and resume once it halves, at most
 * frames_per_wakeup frames are handled per wake-up (the rest wait for the
 * next loop iteration), and a connection to be dropped is only marked: the
 * check handle closes it at a safe point, never inside a callback chain. */
#include "qm_server_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <uv.h>

#include "qm_alloc.h"
#include "qm_log.h"

/* Descriptor batches a connection may hold before a frame claims them;
 * more are closed on arrival (a peer cannot fill the daemon's fd table). */
#define MAX_FD_BATCHES 4

/* The descriptors one read brought, and the stream bytes [start, end) it
 * read: they belong to the first session.map line that begins there. The
 * kernel returns descriptors with the read holding their sendmsg's first
 * byte and ends that read after it (unix(7)), so a session.map line sent
 * with its descriptor begins inside that read. */
typedef struct fd_batch {
    uint64_t start, end;
    qm_fds fds;
} fd_batch;

struct qm_conn {
    uv_pipe_t pipe;
    qm_server *sv;
    uint64_t id;
    qm_peer peer;
    qm_framer framer;
    int refs;          /* handle + replies in flight */
    int closing;       /* uv_close called */
    atomic_int gone;   /* set with closing: workers skip this peer's queued inferences */
    int drop;          /* to be closed at the next safe point */
    int close_after_write;
    int eof;             /* the peer half-closed: answer what it sent, then close */
    size_t replies_pending;
    uint32_t holds; /* call rings open on it (qm_conn_hold): idle_timeout_s spares it */
    int reading;
    int paused_output; /* reads stopped: output over max_output_bytes */
    int paused_frames; /* reads stopped: frames left for the next wake-up */
    int logged_output_limit;
    uint64_t out_bytes;
    uint64_t last_active_ms; /* uv_now() of the last read or write */
    uint64_t frame_started_ms;  /* when the buffered partial frame began (0: none) */
    uint64_t last_progress_ms;  /* when queued output last shrank */
    qm_conn *next, *prev;
    qm_conn *pending_next; /* on s->pending (frames left to process) */
    int on_pending;
    uint64_t bytes_in;       /* stream bytes pushed into the framer */
    uint64_t frame_off;      /* stream offset of the frame being dispatched */
    fd_batch batches[MAX_FD_BATCHES]; /* oldest first */
    int n_batches;
};

typedef struct write_req {
    uv_write_t req;
    qm_conn *conn;
    char *data;
    size_t len;
} write_req;

static void conn_update_reading(qm_conn *c);
static size_t conn_process(qm_conn *c, size_t cap);

void qm_conn_ref(qm_conn *c) { c->refs++; }

void qm_fds_close(qm_fds *f)
{
    if (f->count == 1 && f->fd >= 0)
        close(f->fd);
    *f = QM_FDS_NONE;
}

/* Closes the batches no frame can claim any more: those read wholly before
 * `offset`, where the next frame begins (all of them with -1). */
static void conn_drop_batches(qm_conn *c, uint64_t offset, int all)
{
    int keep = 0;
    for (int i = 0; i < c->n_batches; i++) {
        if (all || c->batches[i].end <= offset)
            qm_fds_close(&c->batches[i].fds);
        else
            c->batches[keep++] = c->batches[i];
    }
    c->n_batches = keep;
}

qm_fds qm_conn_take_fds(qm_conn *c)
{
    for (int i = 0; i < c->n_batches; i++) {
        fd_batch *b = &c->batches[i];
        if (b->start <= c->frame_off && c->frame_off < b->end) {
            qm_fds f = b->fds;
            memmove(b, b + 1, (size_t)(c->n_batches - i - 1) * sizeof *b);
            c->n_batches--;
            return f;
        }
    }
    return QM_FDS_NONE;
}

static void tmp_pipe_closed(uv_handle_t *h) { qm_free(h); }

/* One descriptor libuv received on the connection (uv_pipe ipc mode): libuv
 * hands descriptors out only through uv_accept into a handle, so it goes
 * into a throwaway pipe handle, is duplicated out and the handle closed.
 * -1 when that fails (the descriptor is closed). */
static int conn_accept_fd(qm_conn *c)
{
    uv_pipe_t *tmp = qm_malloc(sizeof *tmp);
    if (!tmp)
        return -2;
    uv_pipe_init(c->sv->host.loop, tmp, 0);
    int fd = -1;
    uv_os_fd_t raw;
    if (uv_accept((uv_stream_t *)&c->pipe, (uv_stream_t *)tmp) == 0 &&
        uv_fileno((uv_handle_t *)tmp, &raw) == 0)
        fd = fcntl(raw, F_DUPFD_CLOEXEC, 3);
    uv_close((uv_handle_t *)tmp, tmp_pipe_closed);
    return fd;
}

/* Takes the descriptors of the read about to be pushed (nread bytes). */
static void conn_receive_fds(qm_conn *c, size_t nread)
{
    int n = uv_pipe_pending_count(&c->pipe);
    if (n <= 0)
        return;
    fd_batch b = {c->bytes_in, c->bytes_in + nread, {-1, (unsigned)n}};
    for (int i = 0; i < n; i++) {
        int fd = conn_accept_fd(c);
        if (fd == -2) {
            /* Out of memory: libuv still holds the descriptors, and closes
             * them with the connection. */
            qm_log(QM_LOG_ERR, "out of memory receiving a descriptor; dropping connection %llu",
                   (unsigned long long)c->id);
            qm_conn_drop(c);
            qm_fds_close(&b.fds);
            return;
        }
        if (n == 1)
            b.fds.fd = fd;
        else if (fd >= 0)
            close(fd); /* several: session.map refuses them, none is kept */
    }
    if (n == 1 && b.fds.fd < 0)
        b.fds.count = 0; /* lost on the way: answered as no descriptor */
    if (c->n_batches == MAX_FD_BATCHES) {
        qm_log(QM_LOG_WARNING, "connection %llu sent descriptors no request claimed; closing them",
               (unsigned long long)c->id);
        qm_fds_close(&c->batches[0].fds);
        memmove(&c->batches[0], &c->batches[1], (MAX_FD_BATCHES - 1) * sizeof c->batches[0]);
        c->n_batches--;
    }
    c->batches[c->n_batches++] = b;
}

void qm_conn_drop(qm_conn *c)
{
    if (c->drop)
        return;
    c->drop = 1;
    c->sv->drops_marked++;
}

void qm_conn_unref(qm_conn *c)
{
    if (--c->refs > 0)
        return;
    qm_framer_free(&c->framer);
    qm_free(c);
}

static void safe_point(qm_server *sv)
{
    if (sv->host.safe_point)
        sv->host.safe_point(sv->host.arg);
}

static void conn_close_cb(uv_handle_t *h)
{
    qm_conn *c = h->data;
    qm_server *sv = c->sv;
    if (c->prev)
        c->prev->next = c->next;
    else
        sv->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    sv->n_conns--;
    if (sv->host.conn_closed)
        sv->host.conn_closed(sv->host.arg, c->id);
    qm_conn_unref(c);
    safe_point(sv);
}

static void conn_close_now(qm_conn *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    atomic_store(&c->gone, 1);
    c->reading = 0;
    qm_framer_free(&c->framer);
    conn_drop_batches(c, 0, 1);
    uv_close((uv_handle_t *)&c->pipe, conn_close_cb);
}

/* Closes once nothing more is owed to the peer. */
static void conn_maybe_close(qm_conn *c)
{
    if ((c->eof || c->close_after_write) && c->replies_pending == 0 && c->out_bytes == 0)
        qm_conn_drop(c);
}

static void write_cb(uv_write_t *req, int status)
{
    write_req *w = (write_req *)req;
    qm_conn *c = w->conn;
    c->out_bytes -= w->len;
    c->last_progress_ms = uv_now(c->sv->host.loop);
    qm__server_watch(c->sv);
    qm_free(w->data);
    qm_free(w);
    if (status < 0 && !c->closing)
        qm_conn_drop(c);
    if (c->paused_output && c->out_bytes <= c->sv->host.cfg->max_output_bytes / 2) {
        c->paused_output = 0;
        conn_update_reading(c);
    }
    conn_maybe_close(c);
    safe_point(c->sv);
    qm_conn_unref(c);
}

void qm_conn_write(qm_conn *c, char *data, size_t len)
{
    if (c->closing || c->drop) {
        qm_free(data);
        return;
    }
    c->last_active_ms = uv_now(c->sv->host.loop);
    qm__server_watch(c->sv);
    size_t off = 0;
    if (c->out_bytes == 0) {
        uv_buf_t b = uv_buf_init(data, (unsigned)len);
        int n = uv_try_write((uv_stream_t *)&c->pipe, &b, 1);
        if (n == (int)len) {
            qm_free(data);
            return;
        }
        if (n > 0)
            off = (size_t)n;
        else if (n != UV_EAGAIN) {
            qm_free(data);
            qm_conn_drop(c);
            return;
        }
    }
    write_req *w = qm_malloc(sizeof *w);
    if (!w) {
        qm_free(data);
        qm_conn_drop(c);
        return;
    }
    w->conn = c;
    w->data = data;
    w->len = len - off;
    uv_buf_t b = uv_buf_init(data + off, (unsigned)(len - off));
    if (uv_write(&w->req, (uv_stream_t *)&c->pipe, &b, 1, write_cb) < 0) {
        qm_free(data);
        qm_free(w);
        qm_conn_drop(c);
        return;
    }
    qm_conn_ref(c);
    c->out_bytes += w->len;
    if (c->out_bytes > c->sv->host.cfg->max_output_bytes && !c->paused_output) {
        c->paused_output = 1;
        c->last_progress_ms = uv_now(c->sv->host.loop);
        if (!c->logged_output_limit) {
            c->logged_output_limit = 1;
            qm_limit_hit(c->sv->host.limits, QM_LIMIT_MAX_OUTPUT_BYTES,
                         "connection %llu (uid %u) has %llu bytes unread, over max_output_bytes "
                         "%llu: pausing its reads",
                         (unsigned long long)c->id, (unsigned)c->peer.uid,
                         (unsigned long long)c->out_bytes,
                         (unsigned long long)c->sv->host.cfg->max_output_bytes);
        } else {
            qm_limit_count(c->sv->host.limits, QM_LIMIT_MAX_OUTPUT_BYTES);
        }
        conn_update_reading(c);
    }
}

/* One read buffer for all connections: libuv calls read_cb right after the
 * read that filled it, on this thread, and the framer copies the bytes out. */
static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    qm_conn *c = h->data;
    (void)suggested;
    buf->base = c->sv->read_buf;
    buf->len = READ_CHUNK;
}

/* An error line with id null, then the connection closes: the stream cannot
 * be resynchronised after an oversized frame. */
static void conn_fatal(qm_conn *c, int rpc_code, const char *reason)
{
    qm_buf b;
    qm_buf_init(&b);
    qm_jw w;
    qm_jw_init(&w, &b);
    qm_rpc_error(&w, NULL, rpc_code, reason, NULL);
    qm_buf_append(&b, "\n", 1);
    c->sv->host.counters->requests++;
    c->sv->host.counters->errors++;
    if (!b.oom) {
        size_t len;
        char *data = qm_buf_take(&b, &len);
        qm_conn_write(c, data, len);
    }
    qm_buf_free(&b);
    c->close_after_write = 1;
    conn_update_reading(c);
    conn_maybe_close(c);
}

static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    qm_conn *c = s->data;
    qm__server_watch(c->sv);
    if (nread > 0)
        conn_receive_fds(c, (size_t)nread);
    if (nread > 0 && !c->close_after_write) {
        c->last_active_ms = uv_now(c->sv->host.loop);
        int rc = qm_framer_push(&c->framer, buf->base, (size_t)nread);
        c->bytes_in += (uint64_t)nread;
        if (rc == QM_EPAYLOAD_TOO_LARGE) {
            /* The frames before the oversized one are answered, then the error. */
            conn_process(c, SIZE_MAX);
            return;
        }
        if (rc < 0) {
            qm_conn_drop(c);
            return;
        }
        size_t handled = conn_process(c, c->sv->host.cfg->frames_per_wakeup);
        /* The deadline runs from the first byte of a frame, not the last. */
        if (qm_framer_buffered(&c->framer) == 0)
            c->frame_started_ms = 0;
        else if (!c->frame_started_ms || handled)
            c->frame_started_ms = uv_now(c->sv->host.loop);
        return;
    }
    if (nread == UV_EOF) {
        /* Half-close: answer what was sent, then close. */
        c->eof = 1;
        conn_update_reading(c);
        conn_process(c, SIZE_MAX);
        conn_maybe_close(c);
    } else if (nread < 0) {
        qm_conn_drop(c);
    }
}

static void conn_update_reading(qm_conn *c)
{
    int want = !c->closing && !c->drop && !c->eof && !c->close_after_write && !c->paused_output &&
               !c->paused_frames && !c->sv->stopping;
    if (want && !c->reading) {
        if (uv_read_start((uv_stream_t *)&c->pipe, alloc_cb, read_cb) == 0)
            c->reading = 1;
        else
            qm_conn_drop(c);
    } else if (!want && c->reading) {
        uv_read_stop((uv_stream_t *)&c->pipe);
        c->reading = 0;
    }
}

/* Handles up to `cap` buffered frames; leaves the rest for the idle handle.
 * Returns how many were handled. */
static size_t conn_process(qm_conn *c, size_t cap)
{
    qm_server *sv = c->sv;
    const qm_config *cfg = sv->host.cfg;
    size_t done = 0;
    for (;;) {
        if (c->closing || c->drop || c->close_after_write)
            return done;
        if (done == cap) {
            if (!c->paused_frames) {
                c->paused_frames = 1;
                qm_limit_count(sv->host.limits, QM_LIMIT_FRAMES_PER_WAKEUP);
                if (!c->on_pending) {
                    c->on_pending = 1;
                    qm_conn_ref(c);
                    c->pending_next = sv->pending;
                    sv->pending = c;
                    uv_idle_start(&sv->idle, qm__server_idle_cb);
                }
                conn_update_reading(c);
            }
            return done;
        }
        const char *line;
        size_t len;
        int rc = qm_framer_next(&c->framer, &line, &len);
        if (rc == QM_EPAYLOAD_TOO_LARGE) {
            qm_limit_hit(sv->host.limits, QM_LIMIT_MAX_REQUEST_BYTES,
                         "connection %llu (uid %u) sent a line over max_request_bytes %llu; "
                         "closing it",
                         (unsigned long long)c->id, (unsigned)c->peer.uid,
                         (unsigned long long)cfg->max_request_bytes);
            char reason[128];
            snprintf(reason, sizeof reason, "request line exceeds max_request_bytes %llu",
                     (unsigned long long)cfg->max_request_bytes);
            conn_fatal(c, QM_RPC_PAYLOAD_TOO_LARGE, reason);
            return done;
        }
        if (rc == 0)
            break;
        /* Where this line began in the stream: its descriptors, if any. */
        c->frame_off =
            c->bytes_in - (uint64_t)(c->framer.in.len - (size_t)(line - c->framer.in.data));
        conn_drop_batches(c, c->frame_off, 0);
        qm_rpc_frame frame;
        uint64_t t0 = qm_now_us();
        int drc = qm_rpc_decode(line, len, &sv->lim, &frame);
        qm_frame_times times = {t0, qm_now_us() - t0};
        if (drc < 0) {
            conn_fatal(c, QM_RPC_INTERNAL_ERROR, "out of memory decoding a request");
            return done;
        }
        if (frame.limit == QM_PROTO_LIMIT_NESTING)
            qm_limit_hit(sv->host.limits, QM_LIMIT_MAX_NESTING,
                         "connection %llu sent JSON deeper than max_nesting %d",
                         (unsigned long long)c->id, sv->lim.max_nesting);
        else if (frame.limit == QM_PROTO_LIMIT_BATCH)
            qm_limit_hit(sv->host.limits, QM_LIMIT_MAX_BATCH,
                         "connection %llu sent a batch over max_batch %zu",
                         (unsigned long long)c->id, sv->lim.max_batch);
        sv->host.frame(sv->host.arg, c, &frame, times);
        qm_rpc_frame_free(&frame);
        done++;
    }
    /* Descriptors read wholly before the unframed rest are nobody's. */
    conn_drop_batches(c, c->bytes_in - qm_framer_buffered(&c->framer), 0);
    if (c->paused_frames) {
        c->paused_frames = 0;
        conn_update_reading(c);
    }
    return done;
}

void qm__server_idle_cb(uv_idle_t *h)
{
    qm_server *sv = h->data;
    qm_conn *list = sv->pending;
    sv->pending = NULL;
    uv_idle_stop(h);
    qm__server_watch(sv);
    while (list) {
        qm_conn *c = list;
        list = c->pending_next;
        c->on_pending = 0;
        if (c->paused_frames) {
            c->paused_frames = 0;
            conn_process(c, sv->host.cfg->frames_per_wakeup);
            conn_update_reading(c);
            if (c->eof)
                conn_maybe_close(c);
        }
        qm_conn_unref(c);
    }
}

/* The safe point: connections marked for dropping are closed here, and a
 * drain that has nothing left to answer ends here. */
static void close_marked(qm_server *sv)
{
    if (sv->drops_marked) {
        sv->drops_marked = 0;
        for (qm_conn *c = sv->conns; c; c = c->next)
            if (c->drop && !c->closing)
                conn_close_now(c);
    }
    safe_point(sv);
}

void qm__server_check_cb(uv_check_t *h) { close_marked(h->data); }

void qm__server_on_connection(uv_stream_t *server, int status)
{
    qm_server *sv = server->data;
    const qm_config *cfg = sv->host.cfg;
    if (status < 0) {
        qm_log(QM_LOG_WARNING, "accept failed: %s", uv_strerror(status));
        return;
    }
    qm__server_watch(sv);
    qm_conn *c = qm_calloc(1, sizeof *c);
    if (!c) {
        /* libuv stops listening until this connection is accepted; left
         * so, the daemon would never accept again (RELIABILITY.md B12).
         * The next sweep (a second) tries again; new clients wait in the
         * backlog. */
        qm_log(QM_LOG_ERR, "out of memory accepting a connection; retrying in a second");
        sv->accept_retry = 1;
        return;
    }
    c->sv = sv;
    c->id = ++sv->next_conn_id;
    c->refs = 1;
    /* ipc mode: libuv reads with recvmsg and keeps the descriptors sent
     * with the bytes (session.map), handed out by uv_accept. */
    uv_pipe_init(sv->host.loop, &c->pipe, 1);
    c->pipe.data = c;
    qm_framer_init(&c->framer, sv->lim.max_request_bytes);
    c->next = sv->conns;
    if (sv->conns)
        sv->conns->prev = c;
    sv->conns = c;
    sv->n_conns++;
    if (uv_accept(server, (uv_stream_t *)&c->pipe) < 0) {
        qm_conn_drop(c);
        return;
    }
    uv_os_fd_t fd;
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (uv_fileno((uv_handle_t *)&c->pipe, &fd) < 0 ||
        getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
        qm_log(QM_LOG_WARNING, "no peer credentials for a connection: dropping it");
        qm_conn_drop(c);
        return;
    }
    c->peer.uid = cred.uid;
    c->peer.gid = cred.gid;
    c->peer.pid = cred.pid;
    c->peer.is_admin = qm__server_peer_is_admin(sv, cred.uid, cred.gid);
    c->last_active_ms = uv_now(c->sv->host.loop);
    qm_log(QM_LOG_DEBUG, "connection %llu from pid %d uid %u (%s)", (unsigned long long)c->id,
           (int)c->peer.pid, (unsigned)c->peer.uid, c->peer.is_admin ? "admin" : "user");
    if (sv->n_conns > cfg->max_connections) {
        qm_limit_hit(sv->host.limits, QM_LIMIT_MAX_CONNECTIONS,
                     "max_connections %u reached: refusing uid %u", cfg->max_connections,
                     (unsigned)c->peer.uid);
        char reason[96];
        snprintf(reason, sizeof reason, "max_connections %u reached; try again later",
                 cfg->max_connections);
        conn_fatal(c, QM_RPC_RESOURCE_EXHAUSTED, reason);
        return;
    }
    /* One uid may not take every slot from the others. */
    if (cfg->max_connections_per_uid) {
        uint32_t mine = 0;
        for (qm_conn *o = sv->conns; o; o = o->next)
            mine += !o->closing && !o->drop && !o->close_after_write &&
                    o->peer.uid == c->peer.uid;
        if (mine > cfg->max_connections_per_uid) {
            qm_limit_hit(sv->host.limits, QM_LIMIT_MAX_CONNECTIONS_PER_UID,
                         "max_connections_per_uid %u reached: refusing another of uid %u",
                         cfg->max_connections_per_uid, (unsigned)c->peer.uid);
            char reason[112];
            snprintf(reason, sizeof reason,
                     "max_connections_per_uid %u reached for uid %u; close one first",
                     cfg->max_connections_per_uid, (unsigned)c->peer.uid);
            conn_fatal(c, QM_RPC_RESOURCE_EXHAUSTED, reason);
            return;
        }
    }
    conn_update_reading(c);
}

int qm_server_new(const qm_server_host *host, qm_server **out)
{
    qm_server *sv = qm_calloc(1, sizeof *sv);
    *out = sv;
    if (!sv)
        return QM_ENOMEM;
    sv->host = *host;
    sv->self_uid = geteuid();
    qm_server_apply_config(sv);
    return 0;
}

void qm_server_apply_config(qm_server *sv)
{
    const qm_config *cfg = sv->host.cfg;
    sv->lim.max_request_bytes = cfg->max_request_bytes;
    sv->lim.max_nesting = (int)cfg->max_nesting;
    sv->lim.max_batch = cfg->max_batch;
    for (qm_conn *c = sv->conns; c; c = c->next)
        c->framer.max_frame = sv->lim.max_request_bytes;
    sv->has_admin_gid = 0;
    if (cfg->admin_group) {
        struct group *g = getgrnam(cfg->admin_group);
        if (g) {
            sv->has_admin_gid = 1;
            sv->admin_gid = g->gr_gid;
        } else {
            qm_log(QM_LOG_WARNING, "admin_group '%s' does not exist; only uid 0 and uid %u are "
                   "admins", cfg->admin_group, (unsigned)sv->self_uid);
        }
    }
}

void qm_server_close_all(qm_server *sv)
{
    if (!sv)
        return;
    sv->stopping = 1;
    for (qm_conn *c = sv->conns; c; c = c->next)
        conn_close_now(c);
}

/* The earliest of *next and `due` (a time that is not before now). */
static void sweep_due(uint64_t *next, uint64_t now, uint64_t due)
{
    uint64_t in = due > now ? due - now : 1;
    if (!*next || in < *next)
        *next = in;
}

uint64_t qm_server_sweep_idle(qm_server *sv)
{
    if (!sv)
        return 0;
    const qm_config *cfg = sv->host.cfg;
    uint64_t next = 0;
    if (sv->accept_retry && sv->listening) {
        sv->accept_retry = 0;
        qm__server_on_connection((uv_stream_t *)&sv->listener, 0);
    }
    if (sv->accept_retry)
        next = 1000;
    uint64_t now = uv_now(sv->host.loop), idle = (uint64_t)cfg->idle_timeout_s * 1000;
    /* A frame must complete, and paused output must move, within this. */
    uint64_t deadline = cfg->frame_timeout_s ? (uint64_t)cfg->frame_timeout_s * 1000
                        : idle                 ? 2 * idle
                                               : 60000;
    for (qm_conn *c = sv->conns; c; c = c->next) {
        if (c->closing || c->drop)
            continue;
        if (c->frame_started_ms && !c->paused_frames) {
            if (now - c->frame_started_ms > deadline) {
                qm_limit_hit(sv->host.limits, QM_LIMIT_FRAME_TIMEOUT,
                             "connection %llu (uid %u) left a frame incomplete for over %llu ms: "
                             "closing it",
                             (unsigned long long)c->id, (unsigned)c->peer.uid,
                             (unsigned long long)deadline);
                qm_conn_drop(c);
                continue;
            }
            sweep_due(&next, now, c->frame_started_ms + deadline + 1);
        }
        if (c->paused_output) {
            if (now - c->last_progress_ms > deadline) {
                qm_limit_hit(sv->host.limits, QM_LIMIT_OUTPUT_STALL,
                             "connection %llu (uid %u) read none of its %llu queued bytes for "
                             "over %llu ms: closing it",
                             (unsigned long long)c->id, (unsigned)c->peer.uid,
                             (unsigned long long)c->out_bytes, (unsigned long long)deadline);
                qm_conn_drop(c);
                continue;
            }
            sweep_due(&next, now, c->last_progress_ms + deadline + 1);
        }
        if (!idle || c->replies_pending || c->out_bytes || c->holds)
            continue;
        if (now - c->last_active_ms > idle) {
            qm_limit_hit(sv->host.limits, QM_LIMIT_IDLE_TIMEOUT,
                         "connection %llu (uid %u) idle for over idle_timeout_s %u: closing",
                         (unsigned long long)c->id, (unsigned)c->peer.uid, cfg->idle_timeout_s);
            qm_conn_drop(c);
            continue;
        }
        sweep_due(&next, now, c->last_active_ms + idle + 1);
    }
    return next;
}

static void sweep_cb(uv_timer_t *t)
{
    qm_server *sv = t->data;
    uint64_t next = qm_server_sweep_idle(sv);
    if (next && !sv->stopping)
        uv_timer_start(&sv->sweep, sweep_cb, next, 0);
    /* Connections it dropped close now: the check handle's safe point
     * comes only after the poll, which with no timer left and nothing to
     * read would wait for the next event. A timer's callback is itself a
     * safe point (no connection's callback is under way). */
    close_marked(sv);
}

void qm__server_watch(qm_server *sv)
{
    if (sv->stopping || !uv_is_active((uv_handle_t *)&sv->check))
        return; /* not listening yet, or closing */
    if (!uv_is_active((uv_handle_t *)&sv->sweep) || uv_timer_get_due_in(&sv->sweep) > 1000)
        uv_timer_start(&sv->sweep, sweep_cb, 1000, 0);
}

void qm_conn_hold(qm_conn *c)
{
    qm_conn_ref(c);
    c->holds++;
}

void qm_conn_release(qm_conn *c)
{
    c->holds--;
    c->last_active_ms = uv_now(c->sv->host.loop);
    qm__server_watch(c->sv);
    qm_conn_unref(c);
}

void qm_conn_reply_begin(qm_conn *c)
{
    qm_conn_ref(c);
    c->replies_pending++;
}

void qm_conn_reply_done(qm_conn *c)
{
    c->replies_pending--;
    qm__server_watch(c->sv);
    conn_maybe_close(c);
    qm_conn_unref(c);
}

size_t qm_server_connections(const qm_server *sv) { return sv ? sv->n_conns : 0; }

int qm_server_owes_answers(const qm_server *sv)
{
    if (!sv)
        return 0;
    /* Frames already read but waiting for their turn are owed answers too. */
    if (sv->pending)
        return 1;
    for (qm_conn *c = sv->conns; c; c = c->next)
        if (!c->closing && (c->out_bytes || c->replies_pending))
            return 1;
    return 0;
}

void qm_server_unread(const qm_server *sv, uint64_t *bytes, size_t *conns)
{
    *bytes = 0;
    *conns = 0;
    for (qm_conn *c = sv ? sv->conns : NULL; c; c = c->next) {
        if (c->closing || !c->out_bytes)
            continue;
        *bytes += c->out_bytes;
        (*conns)++;
    }
}

const qm_peer *qm_conn_peer(const qm_conn *c) { return &c->peer; }
uint64_t qm_conn_id(const qm_conn *c) { return c->id; }
int qm_conn_gone(const qm_conn *c) { return atomic_load(&((qm_conn *)c)->gone); }
