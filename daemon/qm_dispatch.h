/* qm_dispatch.h - from decoded requests to responses (qm_dispatch.c): the
 * method table (who may call a method, whether it names a session, whether
 * it waits in the session's queue and as which job) and the answers.
 *
 * Every accepted request is answered exactly once (never a notification),
 * also when the connection has gone: the reply is then dropped. */
#ifndef QM_DISPATCH_H
#define QM_DISPATCH_H

#include <stdint.h>

#include "qm_pool.h"
#include "qm_protocol.h"
#include "qm_server.h"

typedef struct qm_reply qm_reply; /* a frame's responses, one slot per item */

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
    QM_QUEUE_ALWAYS  /* a worker runs it (or the session's order demands it) */
} qm_queueing;

/* A method answered on the loop thread writes its result value to w, or
 * returns an error in st. */
typedef struct qm_call {
    qm_daemon *d;
    const qm_peer *peer;
    const qm_request *req;
    qm_jw *w;
    qm_fds *fds; /* session.map: the descriptor that came with it (the handler takes it) */
    int drain;   /* set by daemon.shutdown: drain once answered */
} qm_call;
typedef int (*qm_method_handler)(qm_call *call, qm_status *st);

typedef struct qm_method_entry {
    qm_method method;
    /* Loop thread: answers the method (at once, or when its barrier job
     * comes back). NULL when a worker's job writes the answer. */
    qm_method_handler handler;
    qm_role role;
    qm_session_use session;
    qm_queueing queued;
    qm_job_kind job_kind; /* the job it becomes when queued */
} qm_method_entry;

/* The table's row for m; NULL out of range. Static. */
const qm_method_entry *qm_method_entry_get(qm_method m);

typedef enum qm_route_kind {
    QM_ROUTE_REFUSE, /* answered with an error: see qm_refusal */
    QM_ROUTE_ANSWER, /* the handler answers now */
    QM_ROUTE_QUEUE   /* becomes a job of kind job_kind */
} qm_route_kind;

typedef enum qm_refusal {
    QM_REFUSE_NONE,
    QM_REFUSE_DRAINING,   /* shutting_down */
    QM_REFUSE_NOT_ADMIN,  /* permission_denied */
    QM_REFUSE_NO_SESSION, /* not_found, field session */
    QM_REFUSE_NOT_OWNER   /* permission_denied, field session */
} qm_refusal;

typedef struct qm_route {
    qm_route_kind kind;
    qm_refusal refusal;
    qm_job_kind job_kind;
} qm_route;

/* What happens to a request of method e: decided from the table, the peer,
 * whether the daemon drains, whether params name a session and the session
 * they name (NULL when none or not found). No I/O, no state: the unit tests
 * drive it directly. */
qm_route qm_dispatch_route(const qm_method_entry *e, const qm_peer *peer, int draining,
                           int names_session, const qm_session *s);

/* Handles one decoded frame of a connection (loop thread); decode_us is the
 * time its decoding took, reported in session.infer's stats. */
void qm_dispatch_frame(qm_conn *c, qm_rpc_frame *frame, uint64_t decode_us);
/* A finished job, on the loop thread: answers it and frees it. */
void qm_dispatch_job_done(qm_daemon *d, qm_job *job);
/* 1 when nobody will read the reply (its connection has gone). Any thread. */
int qm_reply_abandoned(const qm_reply *r);

#endif
