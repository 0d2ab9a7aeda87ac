/* live_daemon.h - what the suites that start a real qmoed share
 * (test_client_live.c, test_client_ring.c): running a program to its end,
 * and waiting for a daemon to answer on its socket (static inline). */
#ifndef QM_TEST_LIVE_DAEMON_H
#define QM_TEST_LIVE_DAEMON_H

#include <check.h>
#include <sys/wait.h>
#include <unistd.h>

#include "qmoe_client.h"

/* Runs argv[0] with argv; its exit status, or -1. */
static inline int live_run(char *const argv[])
{
    pid_t p = fork();
    if (p == 0) {
        execv(argv[0], argv);
        _exit(127);
    }
    int st = 0;
    waitpid(p, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Up to 20 s for the daemon `pid` to answer on `sock`; the test fails if
 * it exits or never does. */
static inline void live_wait_listening(pid_t pid, const char *sock)
{
    for (int i = 0; i < 400; i++) {
        qm_client *c = NULL;
        if (qm_client_open(&c, sock, 1000, NULL) == 0) {
            qm_client_close(c);
            return;
        }
        ck_assert_int_eq(waitpid(pid, NULL, WNOHANG), 0);
        usleep(50000);
    }
    ck_abort_msg("qmoed did not listen on %s", sock);
}

#endif
