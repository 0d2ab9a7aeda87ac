/* qm_client_internal.h - what the client's source files share. Not installed. */
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

/* What the handle needs to bring its sessions back after a daemon restart
 * (qm_client_resume.c): the sessions it created (their session.create
 * params, maps and last known residency), the bank each model may be loaded
 * from again, and the options. Guarded by the handle's lock; `lock` is held
 * by the one restoration at a time, which takes the handle's lock per call
 * inside it (never the other way round). */
typedef struct qm__kept qm__kept;
typedef struct qm__bank_path {
    char *model, *path;
} qm__bank_path;
typedef struct qm__resume {
    qm_client_reconnect opt;
    qm__kept **kept;
    size_t n_kept, cap_kept;
    qm__bank_path *banks;
    size_t n_banks, cap_banks;
    uint64_t generation;  /* restorations done */
    pthread_mutex_t lock; /* one restoration at a time */
} qm__resume;

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
    qm__resume resume;
    uint64_t conn_gen; /* connections made so far: a ring lives with the one it was opened on */
    int ring_mode;     /* QM_CLIENT_RING_* (qm_client_set_ring) */
    int ring_anticipate; /* qm_client_set_ring_anticipate */
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

/* ---- qm_client_resume.c ---- */
/* Options from the environment, empty lists; 0 or QM_CLIENT_ENOMEM. */
int qm__client_resume_init(qm_client *c);
void qm__client_resume_free(qm_client *c);
/* After session.create answered `id`: keeps `params` (its params as
 * compact JSON, taken over) and `model` to re-create it; `paged`: some
 * bank is paged per expert (its residency is worth remembering). Nothing
 * is kept when memory runs out (the session is then not restored). */
void qm__client_keep(qm_client *c, const char *id, char *params, const char *model, int paged);
void qm__client_unkeep(qm_client *c, const char *id); /* closed or detached */
/* After session.resize: a re-creation takes the budget in force, as the
 * resize gave it: `budget` ("N%", "auto", bytes) when not NULL, else
 * budget_bytes ("auto" sizes it again on the restarted daemon). */
void qm__client_keep_budget(qm_client *c, const char *id, uint64_t budget_bytes,
                            const char *budget);
/* A map of a kept session, and its memfd (duplicated here), to pass again. */
void qm__client_keep_map(qm_client *c, qm_client_map *m, int fd);
void qm__client_unkeep_map(qm_client *c, const qm_client_map *m);
/* 1 when `rc` says the daemon is gone (EIO, ENOTRUNNING): worth a restoration. */
int qm__client_gone(int rc);
uint64_t qm__client_generation(qm_client *c);
/* The one place a layer call that found the daemon gone comes: with the
 * failure in *err (rc) and the generation read before the call, brings
 * `session` back (reconnect, model, session under its id with its
 * residency, maps) within the window. The daemon is gone when the call met
 * a broken or refused connection, or "no such session" on a connection
 * made since the session last answered (another call on the handle
 * reconnected to a restarted daemon first). 0: retry the call once; else
 * `rc` with *err as it was. */
int qm__client_resume(qm_client *c, const char *session, uint64_t gen, int rc,
                      qm_client_error *err);
/* A mapped call that failed because the daemon no longer holds its map
 * (`rc` -32001 naming `<tensor>.map` while the session lives on: the
 * daemon reclaimed it once the connection that last used it had been
 * closed for session_orphan_timeout_s) with the id `failed_id`: the map is
 * passed again from its kept memfd and its id rewritten (not when another
 * thread did so meanwhile). 0: retry the call once; else `rc`. */
int qm__client_map_again(qm_client *c, const char *session, const qm_client_map *m,
                         uint64_t failed_id, int rc, const qm_client_error *err);
/* After a successful layer call on `session`: notes the connection that
 * answered it (`answered_on`, 0: the handle's current one) and reads its
 * residency when the interval says so. */
void qm__client_note_call(qm_client *c, const char *session, uint64_t answered_on);
/* The connection (c->conn_gen) whose daemon gave this thread's last answer,
 * over the socket or a ring: the layer call's caller reads it for
 * qm__client_note_call. Per thread: another thread may reconnect between a
 * call's answer and its note. */
extern _Thread_local uint64_t qm__client_answered_on;

/* ---- qm_client_ring.c ---- */
/* qm_client_session_infer_mapped through the session's ring, the lock
 * held: 1 when the ring took the call (*rc its result), 0 when the call
 * goes through the socket (no ring, refused, or rings off). */
int qm__client_ring_infer(qm_client *c, const qm_client_mapped_infer *q,
                          qm_client_infer_stats *stats, int *rc, qm_client_error *err);
/* 1 when `session` has a ring the caller opened (QM_CLIENT_RING_EXPLICIT)
 * on an earlier connection: a restoration after a restart opens it again
 * (in QM_CLIENT_RING_AUTO the next call does). Lock held. */
int qm__client_ring_reopen_due(qm_client *c, const char *session);
/* Forgets the ring of `session` (NULL: every ring), unmapping it. */
void qm__client_rings_forget(qm_client *c, const char *session);

/* ---- qm_client_wire.c: the connection ---- */
/* The monotonic clock in ms, and a connection to c->path by `deadline`. */
int64_t qm__client_now_ms(void);
int qm__client_connect(qm_client *c, int64_t deadline, qm_client_error *err);

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
