/* qm_server_socket.c - the listening socket: where it lives, a stale one
 * left by a dead daemon, binding it (or adopting systemd's), giving root up
 * once it is bound, and who is an admin. */
#include "qm_server_impl.h"

#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_log.h"
#include "qm_notify.h"

int qm__server_peer_is_admin(const qm_server *sv, uid_t uid, gid_t gid)
{
    if (uid == 0 || uid == sv->self_uid)
        return 1;
    if (!sv->has_admin_gid)
        return 0;
    if (gid == sv->admin_gid)
        return 1;
    struct passwd pw, *res = NULL;
    char buf[4096];
    if (getpwuid_r(uid, &pw, buf, sizeof buf, &res) != 0 || !res)
        return 0;
    gid_t groups[256];
    int n = 256;
    if (getgrouplist(pw.pw_name, pw.pw_gid, groups, &n) < 0)
        return 0;
    for (int i = 0; i < n; i++)
        if (groups[i] == sv->admin_gid)
            return 1;
    return 0;
}

/* PROTOCOL.md: $RUNTIME_DIRECTORY/qmoed.sock, else /run/qmoed/qmoed.sock as
 * root, else $XDG_RUNTIME_DIR/qmoed.sock. */
static int default_socket_path(char *out, size_t size, qm_status *st)
{
    const char *rd = getenv("RUNTIME_DIRECTORY");
    if (rd && rd[0]) {
        size_t n = strcspn(rd, ":"); /* several directories: the first */
        snprintf(out, size, "%.*s/qmoed.sock", (int)n, rd);
        return 0;
    }
    if (geteuid() == 0) {
        if (mkdir("/run/qmoed", 0750) < 0 && errno != EEXIST)
            return qm_status_set(st, QM_EIO, "cannot create /run/qmoed: %s", strerror(errno));
        snprintf(out, size, "/run/qmoed/qmoed.sock");
        return 0;
    }
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    if (xdg && xdg[0]) {
        snprintf(out, size, "%s/qmoed.sock", xdg);
        return 0;
    }
    return qm_status_set(st, QM_EINVAL,
                         "no socket path: pass --socket, or set RUNTIME_DIRECTORY or "
                         "XDG_RUNTIME_DIR");
}

/* 1 when a live daemon answers at path, 0 when nothing does (a stale file
 * is removed), negative when the path is something else. */
static int probe_existing(const char *path, qm_status *st)
{
    struct stat sb;
    if (lstat(path, &sb) < 0)
        return errno == ENOENT ? 0 : qm_status_set(st, QM_EIO, "cannot stat %s: %s", path,
                                                   strerror(errno));
    if (!S_ISSOCK(sb.st_mode))
        return qm_status_set(st, QM_EINVAL, "%s exists and is not a socket; not touching it",
                             path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return qm_status_set(st, QM_EIO, "socket: %s", strerror(errno));
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    int err = errno;
    close(fd);
    if (rc == 0)
        return qm_status_set(st, QM_ECONFLICT,
                             "a daemon is already answering on %s; refusing to start", path);
    if (err != ECONNREFUSED)
        return qm_status_set(st, QM_EIO, "cannot probe %s: %s", path, strerror(err));
    if (unlink(path) < 0 && errno != ENOENT)
        return qm_status_set(st, QM_EIO, "cannot remove stale socket %s: %s", path,
                             strerror(errno));
    qm_log(QM_LOG_NOTICE, "removed stale socket %s", path);
    return 0;
}

/* A daemon holding weights for many users should not keep root. With
 * --user it drops to that user once the socket is bound and the banks are
 * open (the socket file is handed to the user); with --allow-root it stays.
 * Without either it refuses to start (qm_daemon_main already checked before
 * loading anything; this is the last line). */
#define QM_REFUSE_ROOT 1

static int drop_privileges(qm_server *sv, qm_status *st)
{
    const qm_config *cfg = sv->host.cfg;
    if (geteuid() != 0)
        return 0;
    if (!cfg->user) {
        if (cfg->allow_root)
            return 0;
        if (QM_REFUSE_ROOT)
            return qm_status_set(st, QM_EPERMISSION,
                                 "refusing to run as root: pass --user USER to drop to it after "
                                 "binding, or --allow-root");
        qm_log(QM_LOG_WARNING, "running as root; pass --user USER (or --allow-root to say so)");
        return 0;
    }
    struct passwd *pw = getpwnam(cfg->user);
    if (!pw)
        return qm_status_set(st, QM_EINVAL, "no user named '%.64s'", cfg->user);
    if (sv->socket_path && chown(sv->socket_path, pw->pw_uid, pw->pw_gid) < 0)
        return qm_status_set(st, QM_EIO, "chown %s: %s", sv->socket_path, strerror(errno));
    if (initgroups(pw->pw_name, pw->pw_gid) < 0 || setgid(pw->pw_gid) < 0 ||
        setuid(pw->pw_uid) < 0)
        return qm_status_set(st, QM_EPERMISSION, "cannot become user %s: %s", pw->pw_name,
                             strerror(errno));
    if (setuid(0) == 0)
        return qm_status_set(st, QM_EPERMISSION, "could regain root after dropping to %s",
                             pw->pw_name);
    sv->self_uid = geteuid();
    qm_log(QM_LOG_NOTICE, "dropped to user %s (uid %u)", pw->pw_name, (unsigned)pw->pw_uid);
    return 0;
}

int qm_server_listen(qm_server *sv, qm_status *st)
{
    const qm_config *cfg = sv->host.cfg;
    uv_loop_t *loop = sv->host.loop;
    sv->read_buf = qm_malloc(READ_CHUNK);
    if (!sv->read_buf)
        return qm_status_set(st, QM_ENOMEM, "out of memory for the read buffer");
    uv_pipe_init(loop, &sv->listener, 0);
    sv->listener.data = sv;
    int fd = qm_listen_fd_from_env();
    int rc;
    if (fd >= 0) {
        rc = uv_pipe_open(&sv->listener, fd);
        if (rc < 0)
            return qm_status_set(st, QM_EIO, "cannot adopt systemd's socket: %s",
                                 uv_strerror(rc));
        qm_log(QM_LOG_INFO, "listening on the socket passed by systemd");
    } else {
        char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
        if (cfg->socket_path) {
            if (strlen(cfg->socket_path) >= sizeof path)
                return qm_status_set(st, QM_EINVAL, "socket path is over %zu bytes",
                                     sizeof path - 1);
            snprintf(path, sizeof path, "%s", cfg->socket_path);
        } else if ((rc = default_socket_path(path, sizeof path, st)) < 0) {
            return rc;
        }
        if ((rc = probe_existing(path, st)) < 0)
            return rc;
        /* Bind under a tight umask so the file never exists with looser bits,
         * then open it to the group: uv_pipe_chmod cannot express 0660. */
        mode_t old = umask(0177);
        rc = uv_pipe_bind(&sv->listener, path);
        umask(old);
        if (rc < 0)
            return qm_status_set(st, QM_EIO, "cannot bind %s: %s", path, uv_strerror(rc));
        sv->bound_path = 1;
        if (chmod(path, 0660) < 0)
            return qm_status_set(st, QM_EIO, "chmod %s: %s", path, strerror(errno));
        sv->socket_path = qm_strdup(path);
        qm_log(QM_LOG_INFO, "listening on %s", path);
    }
    /* Bound (as root if need be) but not yet answering: the right moment to
     * give root up, so no request is ever served with it. */
    if ((rc = drop_privileges(sv, st)) < 0)
        return rc;
    rc = uv_listen((uv_stream_t *)&sv->listener, 511, qm__server_on_connection);
    if (rc < 0)
        return qm_status_set(st, QM_EIO, "listen: %s", uv_strerror(rc));
    sv->listening = 1;
    uv_check_init(loop, &sv->check);
    sv->check.data = sv;
    uv_check_start(&sv->check, qm__server_check_cb);
    uv_idle_init(loop, &sv->idle);
    sv->idle.data = sv;
    uv_timer_init(loop, &sv->sweep);
    sv->sweep.data = sv;
    return 0;
}

void qm_server_stop_listening(qm_server *sv)
{
    if (!sv || !sv->listening)
        return;
    sv->listening = 0;
    /* Closing a bound pipe unlinks its path (libuv), so new clients get
     * ECONNREFUSED/ENOENT instead of hanging in the backlog. */
    uv_close((uv_handle_t *)&sv->listener, NULL);
}

void qm_server_free(qm_server *sv)
{
    if (!sv)
        return;
    qm_free(sv->socket_path);
    qm_free(sv->read_buf);
    qm_free(sv);
}
