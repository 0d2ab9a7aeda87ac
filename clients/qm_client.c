/* qm_client.c - the handle: opened (connected, joined to the process's open
 * handles), closed (its owned sessions closed, its rings and maps let go).
 * The top of the library: everything else it uses lies below it. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_client_internal.h"

int qm_client_open(qm_client **out, const char *socket_path, int timeout_ms,
                   qm_client_error *err)
{
    *out = NULL;
    if (err)
        memset(err, 0, sizeof(*err));
    qm_client *c = qm_calloc(1, sizeof(*c));
    if (!c)
        return qm__client_fail(err, QM_CLIENT_ENOMEM, "out of memory");
    c->fd = -1;
    c->next_id = 1;
    c->timeout_ms = timeout_ms > 0 ? timeout_ms : QM_CLIENT_DEFAULT_TIMEOUT_MS;
    if (qm_client_socket_path(socket_path, c->path, sizeof(c->path)) < 0) {
        qm_free(c);
        return qm__client_fail(err, QM_CLIENT_EINVAL, "socket path is longer than %zu bytes",
                               sizeof(c->path) - 1);
    }
    if (pthread_mutex_init(&c->lock, NULL) != 0) {
        qm_free(c);
        return qm__client_fail(err, QM_CLIENT_ENOMEM, "cannot create the handle's mutex");
    }
    if (qm__client_resume_init(c) < 0) {
        pthread_mutex_destroy(&c->lock);
        qm_free(c);
        return qm__client_fail(err, QM_CLIENT_ENOMEM, "cannot create the handle's mutex");
    }
    c->pid = getpid();
    const char *ring = getenv("QMOE_RING");
    c->ring_mode = ring && (!strcmp(ring, "0") || !strcmp(ring, "off")) ? QM_CLIENT_RING_OFF
                                                                         : QM_CLIENT_RING_AUTO;
    int rc = qm__client_connect(c, qm__client_now_ms() + c->timeout_ms, err);
    if (rc < 0) {
        qm_client_close(c);
        return rc;
    }
    qm__client_add_open(c);
    *out = c;
    return 0;
}

void qm_client_close(qm_client *c)
{
    if (!c)
        return;
    qm__client_forget_open(c);
    qm__client_close_owned(c);
    qm__client_owned_free(c);
    qm__client_resume_free(c);
    qm__client_rings_forget(c, NULL);
    if (c->fd >= 0)
        close(c->fd);
    pthread_mutex_destroy(&c->lock);
    qm_free(c->buf);
    qm_free(c);
}

const char *qm_client_path(const qm_client *c) { return c ? c->path : NULL; }

void qm_client_set_timeout(qm_client *c, int timeout_ms)
{
    if (!c)
        return;
    pthread_mutex_lock(&c->lock);
    c->timeout_ms = timeout_ms > 0 ? timeout_ms : QM_CLIENT_DEFAULT_TIMEOUT_MS;
    pthread_mutex_unlock(&c->lock);
}

