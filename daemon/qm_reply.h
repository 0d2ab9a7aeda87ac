/* qm_reply.h - a frame's answers (qm_reply.c): one slot per item of the
 * frame, sent as one line (a JSON array for a batch) once every slot is
 * filled and the frame has let go of it. Every accepted request fills its
 * slot exactly once (a notification with nothing), also when the
 * connection has gone: the reply is then dropped. Loop thread only, except
 * qm_reply_abandoned. */
#ifndef QM_REPLY_H
#define QM_REPLY_H

#include <stddef.h>

#include "qm_protocol.h"
#include "qm_server.h"
#include "qm_telemetry.h"

typedef struct qm_reply qm_reply;

/* A reply of n slots on c, held open by its frame until qm_reply_release;
 * every error answer is counted in counters->errors (borrowed). NULL when
 * out of memory. */
qm_reply *qm_reply_new(qm_conn *c, size_t n, int is_batch, qm_counters *counters);
void qm_reply_release(qm_reply *r); /* the frame's hold: sends when every slot is filled */
qm_conn *qm_reply_conn(const qm_reply *r);
/* 1 when nobody will read the reply (its connection has gone). Any thread. */
int qm_reply_abandoned(const qm_reply *r);

/* Slot's answer: `data` (qm_malloc'd, taken; NULL for a notification). */
void qm_reply_fill(qm_reply *r, size_t slot, char *data, size_t len);
/* The writer's bytes as slot's answer. When they ran out of memory, a
 * short error for the same id takes their place: with id null the client
 * could not tell which request failed (RELIABILITY.md B13). */
void qm_reply_take_buf(qm_reply *r, size_t slot, qm_buf *b, const char *id);
/* An error answer (nothing for a notification; counted either way). */
void qm_reply_error(qm_reply *r, size_t slot, const char *id, int notification, int rpc_code,
                    const char *reason, const char *field);
/* The error st says, for request req. */
void qm_reply_status(qm_reply *r, size_t slot, const qm_request *req, const qm_status *st);
/* The result write(w, arg) writes, for request req (nothing for a
 * notification). */
void qm_reply_result(qm_reply *r, size_t slot, const qm_request *req,
                     void (*write)(qm_jw *w, const void *arg), const void *arg);

#endif
