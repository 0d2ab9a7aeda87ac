/* qm_methods.h - what a method is to the daemon: one row of the method
 * table (who may call it, whether it names a session, whether it waits in
 * the session's queue) with either its loop-thread handler or the
 * operations of the job it becomes, and what handlers and operations reach
 * of the daemon.
 *
 * Each method's row is defined beside its handler or job operations, in
 * the file of its family (QM__METHOD_ROW: qm_method_daemon.c,
 * qm_method_model.c, qm_method_session.c, qm_infer.c,
 * qm_method_telemetry.c); qm_dispatch.c assembles the table from
 * protocol/'s QM_METHOD_MAP, so a method without a row does not link. */
#ifndef QM_METHODS_H
#define QM_METHODS_H

#include <stdint.h>

#include "qm_config.h"
#include "qm_devices.h"
#include "qm_pool.h"
#include "qm_protocol.h"
#include "qm_reclaim.h"
#include "qm_registry.h"
#include "qm_reply.h"
#include "qm_ring.h"
#include "qm_server.h"
#include "qm_telemetry.h"

/* What every handler and job operation reaches of the daemon: its parts,
 * each behind its own header, and two calls into its life. Filled once by
 * qm_daemon.c; borrowed, loop thread (a worker reads only what its job's
 * operations say). */
struct qm_method_ctx {
    const qm_config *cfg; /* reloaded in place on SIGHUP */
    qm_registry *registry; /* its two lists, also given apart: */
    qm_models *models;
    qm_sessions *sessions;
    const qm_devices *devices;
    qm_server *server;
    qm_pool *pool;
    qm_counters *counters; /* daemon-wide */
    qm_limits *limits;
    qm_trace *trace;
    qm_reclaim *reclaim; /* orphan reclaim (qm_reclaim.h) */
    qm_rings *rings;     /* call rings (qm_ring.h) */
    struct qm_pressure *pressure; /* the auto budgets' watcher (qm_pressure.h) */
    uint64_t start_us; /* qm_now_us at start */
    int (*draining)(void *life);
    void (*begin_drain)(void *life, const char *why);
    void *life;
};

typedef enum qm_role {
    QM_ROLE_USER, /* any peer */
    QM_ROLE_ADMIN /* uid 0, the daemon's uid, admin_group */
} qm_role;

typedef enum qm_session_use {
    QM_SESSION_UNUSED,   /* the method names no session */
    QM_SESSION_REQUIRED, /* params.session: it must exist and be the peer's */
    QM_SESSION_OPTIONAL  /* the same, when given (telemetry.get) */
} qm_session_use;

typedef enum qm_queueing {
    QM_QUEUE_NEVER,  /* answered on the loop thread at once */
    QM_QUEUE_BEHIND, /* at once, unless its session has queued work: then after it */
    QM_QUEUE_ALWAYS  /* its job runs on a worker, in its session's order */
} qm_queueing;

/* A method answered on the loop thread writes its result value to w, or
 * returns an error in st. */
typedef struct qm_call {
    const qm_method_ctx *mx;
    const qm_peer *peer;
    qm_conn *conn; /* the connection it came on (session.ring holds it) */
    const qm_request *req;
    qm_jw *w;
    qm_fds *fds; /* session.map: the descriptor that came with it (the handler takes it) */
    int drain;   /* set by daemon.shutdown: drain once answered */
} qm_call;
typedef int (*qm_method_handler)(qm_call *call, qm_status *st);

typedef struct qm_method_entry {
    qm_method method;
    /* Loop thread: answers the method, at once or when its turn in the
     * session's order comes (NEVER, BEHIND). NULL for ALWAYS. */
    qm_method_handler handler;
    qm_role role;
    qm_session_use session;
    qm_queueing queued;
    /* ALWAYS: the operations of the job it becomes (admit, run, finish,
     * undo; qm_pool.h). NULL otherwise. */
    const qm_job_ops *job;
    /* The descriptors that came with the request line (SCM_RIGHTS) are
     * its (qm_call.fds, qm_job.fds); any other method's are closed. */
    int takes_fds;
} qm_method_entry;

/* A job whose session was closed while it queued: fails it with
 * QM_ENOT_FOUND (field session) and returns 1. Worker. */
int qm__job_session_closed(qm_job *job);
/* The answer of a job whose worker encoded it (job->response) or failed
 * (job->rc, job->st). Loop thread. */
void qm__job_answer(qm_job *job);

/* Defines method m's row (the members after .method, designated). */
#define QM__METHOD_ROW(m, ...)                                                                     \
    const qm_method_entry qm__method_row_##m = {.method = QM_METHOD_##m, __VA_ARGS__}

/* Every row, by QM_METHOD_MAP's names. */
#define QM__METHOD_ROW_DECLARE(m, ...) extern const qm_method_entry qm__method_row_##m;
QM_METHOD_MAP(QM__METHOD_ROW_DECLARE)
#undef QM__METHOD_ROW_DECLARE

#endif
