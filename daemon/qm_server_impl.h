/* qm_server_impl.h - the server's state, shared by its two files:
 * qm_server.c (the connections) and qm_server_socket.c (the listening
 * socket, the privilege drop, who is an admin). Private to them. */
#ifndef QM_SERVER_IMPL_H
#define QM_SERVER_IMPL_H

#include <uv.h>

#include "qm_server.h"

#define READ_CHUNK 65536

struct qm_server {
    qm_server_host host;
    qm_proto_limits lim;  /* the decoder's, from the configuration */
    uid_t self_uid;       /* the daemon's (after a drop of root) */
    int has_admin_gid;
    gid_t admin_gid;
    int stopping;         /* qm_server_close_all: no connection reads again */
    char *socket_path;
    int bound_path; /* we created the socket file (libuv unlinks it on close) */
    uv_pipe_t listener;
    int listening;
    int accept_retry; /* a connection waits for memory to accept it */
    uv_check_t check;
    uv_idle_t idle;
    uv_timer_t sweep; /* one-shot: when a connection's next limit may expire */
    qm_conn *conns;
    size_t n_conns;
    uint64_t next_conn_id;
    qm_conn *pending; /* connections with unprocessed frames */
    char *read_buf;   /* shared by every connection's reads (loop thread) */
    size_t drops_marked; /* connections marked since the last safe point */
};

/* qm_server.c: a new connection on the listener, the loop's safe point
 * (check handle), frames left for the next wake-up (idle handle). */
void qm__server_on_connection(uv_stream_t *server, int status);
void qm__server_check_cb(uv_check_t *h);
void qm__server_idle_cb(uv_idle_t *h);
/* Something on a connection changed (a read, a write, a reply or a ring
 * let go of, a new connection): the sweep runs within a second. */
void qm__server_watch(qm_server *sv);
/* qm_server_socket.c: uid 0, the daemon's uid, or a member of admin_group. */
int qm__server_peer_is_admin(const qm_server *sv, uid_t uid, gid_t gid);

#endif
