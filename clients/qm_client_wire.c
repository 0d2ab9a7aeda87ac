/* qm_client_wire.c - the connection: socket path, connect, one request at a
 * time under the handle's mutex, a deadline on every byte moved. The bottom
 * of the library: the handle (qm_client.c), its calls, rings, maps and owned
 * sessions all go through it. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_client_internal.h"

/* Results larger than this are refused: a sane daemon never sends one, and a
 * broken stream must not eat the client's memory. */
#define QM__CLIENT_MAX_RESPONSE ((size_t)1 << 31)

int qm__client_fail(qm_client_error *err, int code, const char *fmt, ...)
{
    if (!err)
        return code;
    memset(err, 0, sizeof(*err));
    err->code = code;
    snprintf(err->name, sizeof(err->name), "%s", qm_client_error_name(code));
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->reason, sizeof(err->reason), fmt, ap);
    va_end(ap);
    return code;
}

const char *qm_client_error_name(int code)
{
    switch (code) {
    case 0: return "ok";
    case QM_CLIENT_EINVAL: return "invalid_argument";
    case QM_CLIENT_ENOMEM: return "out_of_memory";
    case QM_CLIENT_ENOTRUNNING: return "not_running";
    case QM_CLIENT_EACCES: return "access_denied";
    case QM_CLIENT_ETIMEDOUT: return "timeout";
    case QM_CLIENT_EIO: return "connection_lost";
    case QM_CLIENT_EPROTO: return "bad_response";
    default: return qm__client_codec_error_name(code);
    }
}

void qm_client_string_free(char *s) { qm_free(s); }

int qm__client_dup_member(const qm_cval *obj, const char *key, char **out)
{
    const char *s = qm_cval_get_string(obj, key);
    *out = NULL;
    if (!s)
        return 0;
    *out = qm_strdup(s);
    return *out ? 0 : QM_CLIENT_ENOMEM;
}

static int qm__put_path(char *buf, size_t cap, const char *a, const char *b)
{
    int n = snprintf(buf, cap, "%s%s", a, b);
    return n < 0 || (size_t)n >= cap ? QM_CLIENT_EINVAL : 0;
}

int qm_client_socket_path(const char *explicit_path, char *buf, size_t cap)
{
    const char *env;
    struct stat sb;
    if (explicit_path && *explicit_path)
        return qm__put_path(buf, cap, explicit_path, "");
    if ((env = getenv("QMOED_SOCKET")) && *env)
        return qm__put_path(buf, cap, env, "");
    if ((env = getenv("RUNTIME_DIRECTORY")) && *env)
        return qm__put_path(buf, cap, env, "/qmoed.sock");
    if (geteuid() == 0)
        return qm__put_path(buf, cap, "/run/qmoed/qmoed.sock", "");
    /* A user's own daemon wins when it is there; otherwise the system one,
     * which a member of the socket's group may reach. */
    if ((env = getenv("XDG_RUNTIME_DIR")) && *env) {
        int rc = qm__put_path(buf, cap, env, "/qmoed.sock");
        if (rc < 0 || stat(buf, &sb) == 0)
            return rc;
    }
    return qm__put_path(buf, cap, "/run/qmoed/qmoed.sock", "");
}

int64_t qm__client_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Waits for `events` until `deadline`; 0, or QM_CLIENT_ETIMEDOUT / EIO. */
static int qm__wait(int fd, short events, int64_t deadline, qm_client_error *err)
{
    for (;;) {
        int64_t left = deadline - qm__client_now_ms();
        if (left <= 0)
            return qm__client_fail(err, QM_CLIENT_ETIMEDOUT, "qmoed did not answer in time");
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, left > 60000 ? 60000 : (int)left);
        if (n > 0)
            return 0; /* errors and hangups surface in the read or write that follows */
        if (n < 0 && errno != EINTR)
            return qm__client_fail(err, QM_CLIENT_EIO, "poll failed: %s", strerror(errno));
    }
}

int qm__client_connect(qm_client *c, int64_t deadline, qm_client_error *err)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", c->path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return qm__client_fail(err, QM_CLIENT_EIO, "cannot create a socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0) {
        int e = errno;
        if (e == EINPROGRESS || e == EAGAIN) {
            /* Backlog full: wait for the daemon to accept, then read the outcome. */
            socklen_t sl = sizeof(e);
            int rc = qm__wait(fd, POLLOUT, deadline, err);
            if (rc < 0) {
                close(fd);
                return rc;
            }
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &sl) < 0)
                e = errno;
        }
        if (e != 0 && e != EINPROGRESS && e != EAGAIN) {
            close(fd);
            if (e == ENOENT || e == ENOTDIR)
                return qm__client_fail(err, QM_CLIENT_ENOTRUNNING,
                                       "qmoed is not running (no socket at %s); start it with "
                                       "`systemctl start qmoed` or `qmoed`",
                                       c->path);
            if (e == ECONNREFUSED)
                return qm__client_fail(err, QM_CLIENT_ENOTRUNNING,
                                       "qmoed is not running (nothing listens on %s); start it "
                                       "with `systemctl start qmoed` or `qmoed`",
                                       c->path);
            if (e == EACCES || e == EPERM)
                return qm__client_fail(err, QM_CLIENT_EACCES,
                                       "permission denied opening %s; ask an admin to add you to "
                                       "the socket's group (qmoe)",
                                       c->path);
            return qm__client_fail(err, QM_CLIENT_EIO, "cannot connect to %s: %s", c->path,
                                   strerror(e));
        }
    }
    c->fd = fd;
    c->len = 0;
    c->conn_gen++;
    return 0;
}

void qm__client_drop(qm_client *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    c->len = 0;
}

/* After a send or recv that moved nothing (`got` <= 0): 1 to try again (interrupted, or the
 * socket became ready before the deadline), qm__wait's error, or QM_CLIENT_EIO when the
 * connection is gone ("qmoed closed the connection<when>", then why when errno says). */
static int qm__io_again(qm_client *c, ssize_t got, short events, int64_t deadline,
                        const char *when, qm_client_error *err)
{
    if (got < 0 && errno == EINTR)
        return 1;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        int rc = qm__wait(c->fd, events, deadline, err);
        return rc < 0 ? rc : 1;
    }
    return qm__client_fail(err, QM_CLIENT_EIO, "qmoed closed the connection%s%s%s", when,
                           got < 0 ? ": " : "", got < 0 ? strerror(errno) : "");
}

/* Sends all n bytes. With fd >= 0 the first write carries it as SCM_RIGHTS
 * (PROTOCOL.md: the descriptor rides on the sendmsg holding the line's
 * first byte). */
static int qm__send_all(qm_client *c, const char *p, size_t n, int fd, int64_t deadline,
                        qm_client_error *err)
{
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    while (n > 0) {
        struct iovec iov = {.iov_base = (void *)p, .iov_len = n};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
        if (fd >= 0) {
            memset(&ctl, 0, sizeof(ctl));
            msg.msg_control = ctl.buf;
            msg.msg_controllen = sizeof(ctl.buf);
            struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(cm), &fd, sizeof(int));
        }
        ssize_t w = sendmsg(c->fd, &msg, MSG_NOSIGNAL);
        if (w > 0) {
            fd = -1;
            p += w;
            n -= (size_t)w;
            continue;
        }
        int again = qm__io_again(c, w, POLLOUT, deadline, "", err);
        if (again < 0)
            return again;
    }
    return 0;
}

/* Reads one line into *line (inside c->buf, without the newline); the caller
 * consumes it with qm__consume. */
static int qm__read_line(qm_client *c, size_t *line_len, int64_t deadline, qm_client_error *err)
{
    size_t scanned = 0;
    for (;;) {
        char *nl = c->len > scanned ? memchr(c->buf + scanned, '\n', c->len - scanned) : NULL;
        if (nl) {
            *line_len = (size_t)(nl - c->buf);
            return 0;
        }
        scanned = c->len;
        if (c->len >= QM__CLIENT_MAX_RESPONSE)
            return qm__client_fail(err, QM_CLIENT_EPROTO, "a response exceeds %zu bytes",
                                   QM__CLIENT_MAX_RESPONSE);
        if (c->cap - c->len < 65536) {
            size_t cap = c->cap ? c->cap * 2 : 65536;
            char *b = qm_realloc(c->buf, cap);
            if (!b)
                return qm__client_fail(err, QM_CLIENT_ENOMEM, "out of memory reading a response");
            c->buf = b;
            c->cap = cap;
        }
        ssize_t r = recv(c->fd, c->buf + c->len, c->cap - c->len, 0);
        if (r > 0) {
            c->len += (size_t)r;
            continue;
        }
        int again = qm__io_again(c, r, POLLIN, deadline, " before answering", err);
        if (again < 0)
            return again;
    }
}

static void qm__consume(qm_client *c, size_t n)
{
    memmove(c->buf, c->buf + n, c->len - n);
    c->len -= n;
}

_Thread_local uint64_t qm__client_answered_on;

int qm__client_exchange(qm_client *c, const char *method, const qm_cval *params,
                        const char *text, size_t text_len, int fd, qm_cval **result,
                        qm_client_error *err)
{
    int64_t deadline = qm__client_now_ms() + c->timeout_ms;
    int rc;
    if (c->fd < 0 && (rc = qm__client_connect(c, deadline, err)) < 0)
        return rc;
    uint64_t id = c->next_id++;
    size_t len = 0;
    char *line = text ? qm__client_codec_request_text(id, method, text, text_len, &len)
                      : qm__client_codec_request(id, method, params, &len);
    if (!line)
        return qm__client_fail(err, QM_CLIENT_ENOMEM, "out of memory encoding the request");
    rc = qm__send_all(c, line, len, fd, deadline, err);
    qm_free(line);
    if (rc < 0)
        goto fail_broken;
    for (;;) {
        size_t n = 0;
        if ((rc = qm__read_line(c, &n, deadline, err)) < 0)
            goto fail_broken;
        if (n == 0 || (n == 1 && c->buf[0] == '\r')) {
            qm__consume(c, n + 1);
            continue;
        }
        uint64_t got = 0;
        int is_error = 0;
        qm__client_codec_error e;
        qm_status st = {0};
        rc = qm__client_codec_response(c->buf, n, &got, result, &is_error, &e, &st);
        qm__consume(c, n + 1);
        if (rc < 0) {
            rc = qm__client_fail(err, rc == QM_ENOMEM ? QM_CLIENT_ENOMEM : QM_CLIENT_EPROTO,
                                 "unreadable response from qmoed: %s", st.msg);
            goto fail_broken;
        }
        if (got != id && got != 0) {
            /* An answer to a request that timed out earlier: not ours. */
            qm_cval_free(*result);
            *result = NULL;
            continue;
        }
        qm__client_answered_on = c->conn_gen;
        if (is_error) {
            qm__client_fail(err, e.code, "%s", e.reason);
            if (err)
                snprintf(err->field, sizeof(err->field), "%s", e.field);
            /* The daemon closes the stream after an oversized frame. */
            if (e.code == -32006 || got == 0)
                qm__client_drop(c);
            return e.code;
        }
        return 0;
    }
fail_broken:
    /* A half-sent request or half-read answer leaves the stream unusable. */
    qm__client_drop(c);
    return rc;
}

int qm__client_call(qm_client *c, const char *method, qm_cval *params, qm_cval **result,
                    qm_client_error *err)
{
    return qm__client_call_fd(c, method, params, -1, result, err);
}

int qm__client_call_fd(qm_client *c, const char *method, qm_cval *params, int fd,
                       qm_cval **result, qm_client_error *err)
{
    *result = NULL;
    if (err)
        memset(err, 0, sizeof(*err));
    if (!c || !method) {
        qm_cval_free(params);
        return qm__client_fail(err, QM_CLIENT_EINVAL, "no client handle or method given");
    }
    pthread_mutex_lock(&c->lock);
    int rc = qm__client_exchange(c, method, params, NULL, 0, fd, result, err);
    pthread_mutex_unlock(&c->lock);
    qm_cval_free(params);
    return rc;
}

int qm__client_call_text(qm_client *c, const char *method, const char *params, size_t n,
                         qm_cval **result, qm_client_error *err)
{
    *result = NULL;
    if (err)
        memset(err, 0, sizeof(*err));
    pthread_mutex_lock(&c->lock);
    int rc = qm__client_exchange(c, method, NULL, params, n, -1, result, err);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

int qm_client_call_json(qm_client *c, const char *method, const char *params_json, int pretty,
                        char **result_json, qm_client_error *err)
{
    qm_cval *params = NULL, *result = NULL;
    *result_json = NULL;
    if (params_json) {
        qm_status st = {0};
        if (qm_cval_parse(params_json, strlen(params_json), &params, &st) < 0)
            return qm__client_fail(err, QM_CLIENT_EINVAL, "params are not valid JSON: %s",
                                   st.msg);
        if (params->type != QM_CVAL_OBJECT) {
            qm_cval_free(params);
            return qm__client_fail(err, QM_CLIENT_EINVAL, "params must be a JSON object");
        }
    }
    int rc = qm__client_call(c, method, params, &result, err);
    if (rc < 0)
        return rc;
    *result_json = qm_cval_print(result, pretty, NULL);
    qm_cval_free(result);
    if (!*result_json)
        return qm__client_fail(err, QM_CLIENT_ENOMEM, "out of memory printing the result");
    return 0;
}
