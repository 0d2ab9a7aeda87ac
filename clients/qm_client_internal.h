/* qm_client_internal.h - what the client's two source files share. Not installed. */
#ifndef QM_CLIENT_INTERNAL_H
#define QM_CLIENT_INTERNAL_H

#include <pthread.h>
#include <sys/types.h>
#include <sys/un.h>

#include "qm_client_codec.h"
#include "qmoe_client.h"

/* A session's call ring on this handle (qm_client_ring.c). */
typedef struct qm__ring qm__ring;

/* The sessions a handle closes for its caller (qm_client_owned.c): ids it
 * owns, malloc'd. */
typedef struct qm__owned {
    char **ids;
    size_t n, cap;
} qm__owned;

struct qm_client {
    pthread_mutex_t lock; /* one exchange at a time; also guards `owned` */
    int fd;               /* -1 after a broken exchange; the next call reconnects */
    int timeout_ms;
    uint64_t next_id;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    char *buf; /* bytes read past the last newline */
    size_t len, cap;
    qm__owned owned;
    pid_t pid; /* the process that opened it: only it closes `owned` */
    uint64_t conn_gen; /* connections made so far: a ring lives with the one it was opened on */
    int ring_mode;     /* QM_CLIENT_RING_* (qm_client_set_ring) */
    qm__ring *rings;   /* its sessions' rings (and refusals), under `lock` */
    struct qm_client *open_prev, *open_next; /* the process's open handles */
};

/* ---- qm_client_owned.c ---- */
/* Room for one more owned id, taken before session.create is sent so that
 * recording its answer cannot fail: 0 or QM_CLIENT_ENOMEM. */
int qm__client_own_reserve(qm_client *c, qm_client_error *err);
/* Records `id` (copied) as owned; call after a qm__client_own_reserve. */
void qm__client_own(qm_client *c, const char *id);
/* Forgets `id`: 1 when it was owned. */
int qm__client_disown(qm_client *c, const char *id);
/* A new handle joins the process's open handles (the atexit handler is
 * installed with the first); qm__client_forget_open takes it out. */
void qm__client_add_open(qm_client *c);
void qm__client_forget_open(qm_client *c);
/* Sends session.close for every owned id (2 s each at most, stopping at
 * the first broken connection) when c was opened by this process, and
 * empties the list. Takes c->lock per call. */
void qm__client_close_owned(qm_client *c);
void qm__client_owned_free(qm_client *c);

/* ---- qm_client_ring.c ---- */
/* qm_client_session_infer_mapped through the session's ring, the lock
 * held: 1 when the ring took the call (*rc its result), 0 when the call
 * goes through the socket (no ring, refused, or rings off). */
int qm__client_ring_infer(qm_client *c, const qm_client_mapped_infer *q,
                          qm_client_infer_stats *stats, int *rc, qm_client_error *err);
/* Forgets the ring of `session` (NULL: every ring), unmapping it. */
void qm__client_rings_forget(qm_client *c, const char *session);

/* Sets *err (may be NULL) and returns `code`. */
int qm__client_fail(qm_client_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* One round trip. Takes ownership of `params` (may be NULL). On 0 *result is
 * a tree the caller frees with qm_cval_free. */
int qm__client_call(qm_client *c, const char *method, qm_cval *params, qm_cval **result,
                    qm_client_error *err);

/* The same, with `fd` (>= 0) passed as SCM_RIGHTS on the line's first byte. */
int qm__client_call_fd(qm_client *c, const char *method, qm_cval *params, int fd,
                       qm_cval **result, qm_client_error *err);

/* One exchange with the handle's lock held (the calls above take it):
 * `text` (text_len bytes), when not NULL, is `params` already printed;
 * fd >= 0 rides as SCM_RIGHTS. */
int qm__client_exchange(qm_client *c, const char *method, const qm_cval *params,
                        const char *text, size_t text_len, int fd, qm_cval **result,
                        qm_client_error *err);
/* Drops the connection (the next exchange reconnects); lock held. */
void qm__client_drop(qm_client *c);

/* The same, with params already printed as compact JSON (n bytes). */
int qm__client_call_text(qm_client *c, const char *method, const char *params, size_t n,
                         qm_cval **result, qm_client_error *err);

/* Copies a string member; NULL when absent. Returns QM_CLIENT_ENOMEM on failure. */
int qm__client_dup_member(const qm_cval *obj, const char *key, char **out);

#endif
