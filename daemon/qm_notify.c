/* qm_notify.c - the systemd protocols, written by hand (they are stable and
 * tiny): sd_notify datagrams, socket activation, the watchdog interval. */
#include "qm_notify.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "qm_error.h"
#include "qm_log.h"

int qm_notify(const char *state)
{
    const char *path = getenv("NOTIFY_SOCKET");
    if (!path || !path[0])
        return 0;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t n = strlen(path);
    if ((path[0] != '/' && path[0] != '@') || n >= sizeof sa.sun_path)
        return QM_EINVAL;
    memcpy(sa.sun_path, path, n);
    if (path[0] == '@')
        sa.sun_path[0] = '\0'; /* abstract namespace */
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return QM_EIO;
    socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
    ssize_t w = sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&sa, len);
    close(fd);
    return w < 0 ? QM_EIO : 0;
}

int qm_listen_fd_from_env(void)
{
    const char *pid = getenv("LISTEN_PID"), *fds = getenv("LISTEN_FDS");
    if (!pid || !fds)
        return -1;
    char *end;
    long p = strtol(pid, &end, 10);
    if (*end || p != (long)getpid())
        return -1;
    long n = strtol(fds, &end, 10);
    /* Consumed: children must not adopt them too. */
    unsetenv("LISTEN_PID");
    unsetenv("LISTEN_FDS");
    unsetenv("LISTEN_FDNAMES");
    if (*end || n < 1)
        return -1;
    if (n > 1)
        qm_log(QM_LOG_WARNING, "systemd passed %ld sockets; using the first (fd 3)", n);
    int type = 0;
    socklen_t tl = sizeof type;
    struct sockaddr_un sa;
    socklen_t sl = sizeof sa;
    if (getsockopt(3, SOL_SOCKET, SO_TYPE, &type, &tl) < 0 || type != SOCK_STREAM ||
        getsockname(3, (struct sockaddr *)&sa, &sl) < 0 || sa.sun_family != AF_UNIX) {
        qm_log(QM_LOG_ERR, "fd 3 from systemd is not an AF_UNIX stream socket; ignoring it");
        return -1;
    }
    return 3;
}

uint64_t qm_watchdog_usec(void)
{
    const char *usec = getenv("WATCHDOG_USEC"), *pid = getenv("WATCHDOG_PID");
    if (!usec)
        return 0;
    if (pid && strtol(pid, NULL, 10) != (long)getpid())
        return 0;
    char *end;
    unsigned long long v = strtoull(usec, &end, 10);
    return *end ? 0 : (uint64_t)v;
}
