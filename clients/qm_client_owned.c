/* qm_client_owned.c - the sessions a handle closes for its caller: the ones
 * it created (or adopted), closed by qm_client_close and, for handles still
 * open when the process exits, by an atexit handler (qmoe_client.h,
 * "Sessions a handle owns"). */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_client_internal.h"

/* Longest wait for one session.close at exit or qm_client_close. */
#define QM__CLOSE_TIMEOUT_MS 2000

static pthread_mutex_t open_lock = PTHREAD_MUTEX_INITIALIZER;
static qm_client *open_head; /* this process's open handles */
static pthread_once_t atexit_once = PTHREAD_ONCE_INIT;

int qm__client_own_reserve(qm_client *c, qm_client_error *err)
{
    pthread_mutex_lock(&c->lock);
    int rc = 0;
    if (c->owned.n == c->owned.cap) {
        size_t cap = c->owned.cap ? 2 * c->owned.cap : 4;
        char **ids = qm_realloc(c->owned.ids, cap * sizeof(*ids));
        if (ids) {
            c->owned.ids = ids;
            c->owned.cap = cap;
        } else {
            rc = QM_CLIENT_ENOMEM;
        }
    }
    pthread_mutex_unlock(&c->lock);
    if (rc < 0)
        return qm__client_fail(err, rc, "out of memory recording the sessions this handle owns");
    return 0;
}

void qm__client_own(qm_client *c, const char *id)
{
    char *copy = qm_strdup(id);
    pthread_mutex_lock(&c->lock);
    /* A copy that failed, or no room (two threads raced past one
     * reservation): not closed by the handle; the daemon's orphan reclaim
     * covers it. */
    if (copy && c->owned.n < c->owned.cap) {
        c->owned.ids[c->owned.n++] = copy;
        copy = NULL;
    }
    pthread_mutex_unlock(&c->lock);
    qm_free(copy);
}

int qm__client_disown(qm_client *c, const char *id)
{
    int found = 0;
    pthread_mutex_lock(&c->lock);
    for (size_t i = 0; i < c->owned.n; i++) {
        if (strcmp(c->owned.ids[i], id) == 0) {
            qm_free(c->owned.ids[i]);
            c->owned.ids[i] = c->owned.ids[--c->owned.n];
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&c->lock);
    return found;
}

void qm__client_owned_free(qm_client *c)
{
    for (size_t i = 0; i < c->owned.n; i++)
        qm_free(c->owned.ids[i]);
    qm_free(c->owned.ids);
    memset(&c->owned, 0, sizeof(c->owned));
}

void qm__client_close_owned(qm_client *c)
{
    if (c->pid != getpid()) {
        /* A copy inherited over fork(): the sessions are the parent's. */
        qm__client_owned_free(c);
        return;
    }
    pthread_mutex_lock(&c->lock);
    qm__owned owned = c->owned;
    memset(&c->owned, 0, sizeof(c->owned));
    int timeout = c->timeout_ms;
    if (c->timeout_ms > QM__CLOSE_TIMEOUT_MS)
        c->timeout_ms = QM__CLOSE_TIMEOUT_MS;
    pthread_mutex_unlock(&c->lock);
    int broken = 0;
    for (size_t i = 0; i < owned.n; i++) {
        if (!broken) {
            qm_cval *p = qm_cval_new(QM_CVAL_OBJECT);
            if (p && qm_cval_append(p, "session", qm_cval_new_string(owned.ids[i])) < 0) {
                qm_cval_free(p);
                p = NULL;
            }
            qm_cval *r = NULL;
            int rc = p ? qm__client_call(c, "session.close", p, &r, NULL) : QM_CLIENT_ENOMEM;
            qm_cval_free(r);
            /* Not found (closed by someone else, its model unloaded) is
             * fine; a daemon gone or not answering fails the rest too. */
            broken = rc == QM_CLIENT_EIO || rc == QM_CLIENT_ENOTRUNNING ||
                     rc == QM_CLIENT_ETIMEDOUT || rc == QM_CLIENT_EACCES;
        }
        qm_free(owned.ids[i]);
    }
    qm_free(owned.ids);
    pthread_mutex_lock(&c->lock);
    c->timeout_ms = timeout;
    pthread_mutex_unlock(&c->lock);
}

/* At exit: the handles this process never closed close their sessions.
 * A handle whose call is in flight on another thread is skipped (the
 * daemon's reclaim covers it), and so is the whole list when another
 * thread holds it: exit must not wait on a lock. */
static void close_at_exit(void)
{
    if (pthread_mutex_trylock(&open_lock) != 0)
        return;
    for (qm_client *c = open_head; c; c = c->open_next) {
        if (c->pid != getpid() || pthread_mutex_trylock(&c->lock) != 0)
            continue;
        pthread_mutex_unlock(&c->lock);
        qm__client_close_owned(c);
    }
    pthread_mutex_unlock(&open_lock);
}

static void install_atexit(void) { (void)atexit(close_at_exit); }

void qm__client_add_open(qm_client *c)
{
    pthread_once(&atexit_once, install_atexit);
    pthread_mutex_lock(&open_lock);
    c->open_prev = NULL;
    c->open_next = open_head;
    if (open_head)
        open_head->open_prev = c;
    open_head = c;
    pthread_mutex_unlock(&open_lock);
}

void qm__client_forget_open(qm_client *c)
{
    pthread_mutex_lock(&open_lock);
    if (c->open_prev)
        c->open_prev->open_next = c->open_next;
    else if (open_head == c)
        open_head = c->open_next;
    if (c->open_next)
        c->open_next->open_prev = c->open_prev;
    c->open_prev = c->open_next = NULL;
    pthread_mutex_unlock(&open_lock);
}
