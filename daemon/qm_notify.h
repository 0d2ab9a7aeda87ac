/* qm_notify.h - the systemd protocols the daemon speaks (qm_notify.c). */
#ifndef QM_NOTIFY_H
#define QM_NOTIFY_H

#include <stdint.h>

/* Sends `state` ("READY=1\nSTATUS=...") to $NOTIFY_SOCKET; no-op without it. */
int qm_notify(const char *state);
/* A listening socket passed by systemd (LISTEN_PID/LISTEN_FDS), or -1. */
int qm_listen_fd_from_env(void);
/* Watchdog interval in microseconds from WATCHDOG_USEC/WATCHDOG_PID, or 0. */
uint64_t qm_watchdog_usec(void);

#endif
