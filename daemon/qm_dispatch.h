/* qm_dispatch.h - from decoded requests to answers (qm_dispatch.c): the
 * method table (its rows: qm_methods.h), the routing decision, and the
 * life of a job from admission to its answer.
 *
 * Every accepted request is answered exactly once (never a notification),
 * also when the connection has gone: the reply is then dropped. */
#ifndef QM_DISPATCH_H
#define QM_DISPATCH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "qm_methods.h"
#include "qm_pool.h"
#include "qm_protocol.h"
#include "qm_server.h"

/* The table's row for m; NULL out of range. Static. */
const qm_method_entry *qm_method_entry_get(qm_method m);

typedef enum qm_route_kind {
    QM_ROUTE_REFUSE, /* answered with an error: see qm_refusal */
    QM_ROUTE_ANSWER, /* the handler answers now */
    QM_ROUTE_QUEUE   /* becomes a job: the row's, or a barrier for a handler's turn */
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
} qm_route;

/* What routing reads of the session a request names. */
typedef struct qm_route_session {
    uid_t owner;
    size_t queued; /* its jobs not yet handed back */
} qm_route_session;

/* What happens to a request of method e: decided from the table, the peer,
 * whether the daemon drains, whether params name a session and the session
 * they name (NULL when none or not found). No I/O, no state: the unit tests
 * drive it directly. */
qm_route qm_dispatch_route(const qm_method_entry *e, const qm_peer *peer, int draining,
                           int names_session, const qm_route_session *s);

/* A decoded frame of connection c (the server's frame callback): answers
 * or queues every item of it, with what the methods reach (mx). */
void qm_dispatch_frame(const qm_method_ctx *mx, qm_conn *c, qm_rpc_frame *frame,
                       qm_frame_times times);
/* A job a worker handed back (the pool's done hook): finished by its
 * operations, its session reference dropped, freed. */
void qm_dispatch_job_done(const qm_method_ctx *mx, qm_job *job);
/* A job the loop will never take (the pool's discard hook, at exit): its
 * reply slot settled empty, its session reference dropped, freed; nothing
 * answered. */
void qm_dispatch_job_discard(qm_job *job);

#endif
