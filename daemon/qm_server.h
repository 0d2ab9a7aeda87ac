/* qm_server.h - the listening socket and the connections (qm_server.c).
 *
 * A connection (qm_conn) is opaque: it lives on the loop thread, is held by
 * its handle and by each reply in flight (qm_conn_ref/unref), and is never
 * freed inside a callback chain: qm_conn_drop only marks it, and the
 * server closes it at the loop's next safe point. */
#ifndef QM_SERVER_H
#define QM_SERVER_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "qm_config.h"
#include "qm_error.h"
#include "qm_protocol.h"
#include "qm_telemetry.h"

typedef struct qm_conn qm_conn;
typedef struct qm_server qm_server;

/* Who is on the other end (SO_PEERCRED at accept), and what it may do. */
typedef struct qm_peer {
    uid_t uid;
    gid_t gid;
    pid_t pid;
    int is_admin; /* uid 0, the daemon's uid, or admin_group */
} qm_peer;

/* The descriptors (SCM_RIGHTS) that came with the first byte of a request
 * line (PROTOCOL.md "Shared-memory tensors"): count of them, and the one
 * descriptor when count is 1 (its owner closes it); with several, the
 * server has closed them all and fd is -1. */
typedef struct qm_fds {
    int fd;
    unsigned count;
} qm_fds;
#define QM_FDS_NONE ((qm_fds){-1, 0})
void qm_fds_close(qm_fds *f); /* closes and empties; accepts an empty one */

/* When a frame's line was read (qm_now_us, the line whole in the buffer)
 * and how long decoding it took (the whole batch). */
typedef struct qm_frame_times {
    uint64_t read_us, decode_us;
} qm_frame_times;

/* What the server is given: all borrowed for its life, on its loop's
 * thread. It answers some frames itself (oversized lines, max_connections)
 * and counts those in `counters`; the rest go to `frame`. */
typedef struct qm_server_host {
    uv_loop_t *loop;
    const qm_config *cfg;  /* limits, socket, user; reloaded in place (qm_server_apply_config) */
    qm_counters *counters; /* the daemon's */
    qm_limits *limits;
    /* A decoded frame of connection c; the server frees the frame after. */
    void (*frame)(void *arg, qm_conn *c, qm_rpc_frame *frame, qm_frame_times times);
    /* Called where the daemon may end a drain: the loop's check handle,
     * a connection closed, output written. */
    void (*safe_point)(void *arg);
    /* Connection conn_id has closed (its close callback; may be NULL). */
    void (*conn_closed)(void *arg, uint64_t conn_id);
    void *arg;
} qm_server_host;

/* A server not yet listening (configuration applied); *out is the
 * caller's (qm_server_free). QM_ENOMEM. */
int qm_server_new(const qm_server_host *host, qm_server **out);
/* Re-reads the configuration's decoder limits (for every open connection
 * too) and admin_group (logged when it does not exist): at start and on
 * SIGHUP. */
void qm_server_apply_config(qm_server *sv);
/* Binds (or adopts systemd's socket), drops privileges, starts accepting.
 * On failure st says why and qm_server_free cleans up. */
int qm_server_listen(qm_server *sv, qm_status *st);
void qm_server_stop_listening(qm_server *sv); /* accepts NULL */
/* Closes every connection (after drain); none reads again. */
void qm_server_close_all(qm_server *sv);
/* Frees the server once the loop has closed its handles; accepts NULL. */
void qm_server_free(qm_server *sv);
/* Drops connections past a limit (idle_timeout_s; a frame left incomplete
 * or output unread past frame_timeout_s) and retries a refused accept. It
 * runs from the server's own one-shot timer, armed only while a limit can
 * expire: within a second of any activity on a connection, then at the
 * earliest moment one could expire; nothing to watch (every connection
 * busy, holding a call ring, or none at all), no timer: an idle daemon
 * does not wake (docs/ARCHITECTURE.md, "The loop's timers"). Returns the
 * milliseconds until the next sweep is needed, 0 for none. */
uint64_t qm_server_sweep_idle(qm_server *sv);
size_t qm_server_connections(const qm_server *sv);
/* 1 while a connection is owed an answer or bytes: frames waiting for
 * their turn, replies in flight or output not yet written. */
int qm_server_owes_answers(const qm_server *sv);
/* What is owed now: answers written but not yet taken by their clients
 * (bytes, and the connections holding them). */
void qm_server_unread(const qm_server *sv, uint64_t *bytes, size_t *conns);

const qm_peer *qm_conn_peer(const qm_conn *c); /* lives as long as c */
uint64_t qm_conn_id(const qm_conn *c);
/* 1 once the connection is closing: nobody will read what it is sent.
 * Any thread (workers skip a vanished peer's queued inferences). */
int qm_conn_gone(const qm_conn *c);
void qm_conn_ref(qm_conn *c);
void qm_conn_unref(qm_conn *c);
/* The descriptors that came with the frame being dispatched (loop thread,
 * during the host's frame callback), moved to the caller; the first session.map of
 * the frame takes them, the rest of it gets none. */
qm_fds qm_conn_take_fds(qm_conn *c);
/* Marks the connection to be closed at the next safe point. */
void qm_conn_drop(qm_conn *c);
/* Queues bytes (takes ownership of `data`, from qm_malloc) for writing. */
void qm_conn_write(qm_conn *c, char *data, size_t len);
/* A call ring (qm_ring.h) opened on the connection (holds a reference to
 * it) and, later, closed: while one is open, idle_timeout_s does not close
 * the connection, whose peer talks through the ring. Loop thread. */
void qm_conn_hold(qm_conn *c);
void qm_conn_release(qm_conn *c);
/* A reply was opened for the connection (holds a reference to it) and,
 * later, written or dropped (releases it): a half-closed connection closes
 * once the last one is done. */
void qm_conn_reply_begin(qm_conn *c);
void qm_conn_reply_done(qm_conn *c);

#endif
