/* qm_daemon.h - qmoed's life (qm_daemon.c): start-up, signals, drain,
 * exit. The daemon's state is private to it: it owns every part (the
 * configuration, devices, registry, pool, server, telemetry) and hands
 * each the others it needs when it makes it, so no part reaches back.
 *
 * Threading: one libuv loop thread owns everything; workers get what they
 * need through their job (qm_pool.h) and never touch sockets or
 * registries, and the loop never runs a kernel. */
#ifndef QM_DAEMON_H
#define QM_DAEMON_H

/* The whole daemon: parses argv, serves until drained; the exit status
 * (0, 1 when the drain timed out or start-up failed, 2 for bad flags). */
int qm_daemon_main(int argc, char **argv);

#endif
