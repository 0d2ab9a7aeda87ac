/* qm_daemon.h - the daemon's context and its life (qm_daemon.c): start-up,
 * limits, drain, exit.
 *
 * Threading: one libuv loop thread owns everything here; workers get what
 * they need through their job (qm_pool.h) and never touch sockets or
 * registries, and the loop never runs a kernel. Each concern has its own
 * header: qm_config.h, qm_log.h, qm_notify.h, qm_telemetry.h, qm_models.h,
 * qm_sessions.h, qm_pool.h, qm_server.h, qm_dispatch.h, qm_sigbus.h,
 * qm_fault.h. */
#ifndef QM_DAEMON_H
#define QM_DAEMON_H

#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "qm_config.h"
#include "qm_devices.h"
#include "qm_protocol.h"
#include "qm_telemetry.h"

typedef struct qm_model qm_model;
typedef struct qm_session qm_session;
typedef struct qm_pool qm_pool;
typedef struct qm_server qm_server;

/* Every configured bound: counted each time it triggers, logged once. */
enum {
    QM_LIMIT_MAX_REQUEST_BYTES,
    QM_LIMIT_MAX_NESTING,
    QM_LIMIT_MAX_BATCH,
    QM_LIMIT_MAX_CONNECTIONS,
    QM_LIMIT_MAX_SESSIONS,
    QM_LIMIT_MAX_OUTPUT_BYTES,
    QM_LIMIT_QUEUE_DEPTH,
    QM_LIMIT_IDLE_TIMEOUT,
    QM_LIMIT_FRAMES_PER_WAKEUP,
    QM_LIMIT_FRAME_TIMEOUT,
    QM_LIMIT_OUTPUT_STALL,
    QM_LIMIT_COUNT
};
extern const char *const qm_limit_names[QM_LIMIT_COUNT];

typedef struct qm_daemon {
    uv_loop_t *loop;
    qm_config cfg;
    qm_proto_limits lim;
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t tick, watchdog, drain_timer;
    uint64_t watchdog_usec;
    uint64_t ticks;
    qm_devices devices;      /* qm_devices.h: one, or the --device list */
    uint64_t next_map_id;    /* session.map's ids, daemon-wide (qm_shm.h) */
    qm_model *models;        /* qm_models.h */
    size_t n_models;
    qm_session *sessions;    /* qm_sessions.h */
    size_t n_sessions;
    qm_server *server;       /* qm_server.h: the socket and the connections */
    qm_pool *pool;           /* qm_pool.h */
    qm_counters counters;
    uint64_t limit_hits[QM_LIMIT_COUNT];
    int limit_logged[QM_LIMIT_COUNT];
    qm_trace trace;
    int draining;
    int stopping; /* handles are being closed */
    uint64_t start_us;
    int64_t start_wall;
    uid_t self_uid;
    int has_admin_gid;
    gid_t admin_gid;
    int exit_code;
} qm_daemon;

uint64_t qm_now_us(void); /* monotonic */
/* The whole daemon: parses argv, serves until drained; the exit status. */
int qm_daemon_main(int argc, char **argv);
void qm_limit_hit(qm_daemon *d, int limit, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Checks whether the drain is complete, and if so stops the loop. */
void qm_daemon_maybe_finish(qm_daemon *d);
void qm_daemon_begin_drain(qm_daemon *d, const char *why);

#endif
