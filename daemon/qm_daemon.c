/* qm_daemon.c - qmoed's life: start-up, signals, drain, exit.
 *
 * Start: config -> devices -> preloaded models -> socket -> worker pool ->
 * READY=1. SIGTERM/SIGINT/daemon.shutdown: stop accepting, answer
 * shutting_down to new requests, let accepted ones finish and flush, exit 0
 * (1 when drain_timeout_s ran out first). SIGHUP: reload reloadable keys. */
#include "qm_daemon.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <errno.h>
#include <time.h>
#include <unistd.h>

#include <uv.h>

#include "qm_alloc.h"
#include "qm_config.h"
#include "qm_devices.h"
#include "qm_dispatch.h"
#include "qm_idle_hint.h"
#include "qm_kernel_report.h"
#include "qm_log.h"
#include "qm_methods.h"
#include "qm_models.h"
#include "qm_notify.h"
#include "qm_pool.h"
#include "qm_pressure.h"
#include "qm_reclaim.h"
#include "qm_registry.h"
#include "qm_ring.h"
#include "qm_server.h"
#include "qm_sigbus.h"
#include "qm_telemetry.h"

typedef struct qm_daemon qm_daemon;

struct qm_daemon {
    uv_loop_t *loop;
    qm_config cfg;
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t tick, watchdog, drain_timer;
    uint64_t watchdog_usec;
    qm_devices devices;
    qm_registry *registry;
    qm_server *server;
    qm_pool *pool;
    qm_counters counters;
    qm_limits limits;
    qm_trace trace;
    qm_reclaim reclaim;    /* orphaned sessions closed after session_orphan_timeout_s */
    qm_rings *rings;       /* call rings (qm_ring.h) */
    int reclaim_started;
    qm_pressure pressure;  /* auto budgets under memory pressure (qm_pressure.h) */
    qm_method_ctx methods; /* what the methods reach of all this */
    int draining;
    int stopping; /* handles are being closed */
    uint64_t start_us;
    int exit_code;
    int argc; /* the command line, parsed again on SIGHUP */
    char **argv;
};

static void notify_status(qm_daemon *d, const char *prefix)
{
    char msg[256];
    snprintf(msg, sizeof msg, "%sSTATUS=%s: %zu models, %zu sessions, %zu connections", prefix,
             d->draining ? "draining" : "serving", qm_registry_models(d->registry)->n,
             qm_registry_sessions(d->registry)->n, qm_server_connections(d->server));
    qm_notify(msg);
}

static void close_walk_cb(uv_handle_t *h, void *arg)
{
    (void)arg;
    if (!uv_is_closing(h))
        uv_close(h, NULL);
}

static void finish(qm_daemon *d)
{
    if (d->stopping)
        return;
    d->stopping = 1;
    qm_pressure_stop(&d->pressure);
    qm_server_stop_listening(d->server);
    qm_server_close_all(d->server);
    uv_walk(d->loop, close_walk_cb, NULL);
}

/* Where a drain may end (the server's safe points, the pool's idle): once
 * every accepted request is answered and written, the loop stops. */
static void maybe_finish(void *arg)
{
    qm_daemon *d = arg;
    if (!d->draining || d->stopping || qm_pool_queued(d->pool) ||
        qm_server_owes_answers(d->server))
        return;
    qm_log(QM_LOG_INFO, "drained: every accepted request answered");
    finish(d);
}

static void drain_timeout_cb(uv_timer_t *t)
{
    qm_daemon *d = t->data;
    uint64_t bytes;
    size_t conns;
    qm_server_unread(d->server, &bytes, &conns);
    /* Computed answers a client does not read are owed too: say which. */
    qm_log(QM_LOG_ERR,
           "drain_timeout_s %u passed with %zu requests unanswered and %llu bytes of answers "
           "unread by %zu connections (clients that stopped reading); exiting",
           d->cfg.drain_timeout_s, qm_pool_queued(d->pool), (unsigned long long)bytes, conns);
    d->exit_code = 1;
    finish(d);
}

static void begin_drain(void *arg, const char *why)
{
    qm_daemon *d = arg;
    if (d->draining)
        return;
    d->draining = 1;
    qm_log(QM_LOG_NOTICE, "draining (%s): %zu requests in flight", why, qm_pool_queued(d->pool));
    qm_notify("STOPPING=1");
    notify_status(d, "");
    qm_server_stop_listening(d->server);
    /* Calls in flight on rings finish; the rings take no more. */
    qm_rings_drain(d->rings);
    if (d->cfg.drain_timeout_s) {
        uv_timer_start(&d->drain_timer, drain_timeout_cb, (uint64_t)d->cfg.drain_timeout_s * 1000,
                       0);
        uv_unref((uv_handle_t *)&d->drain_timer);
    }
    /* The end comes from the check handle, at a safe point of the loop. */
}

static int draining(void *arg) { return ((qm_daemon *)arg)->draining; }

static void signal_cb(uv_signal_t *h, int signum)
{
    qm_daemon *d = h->data;
    if (signum == SIGHUP) {
        if (!d->cfg.config_path) {
            qm_log(QM_LOG_NOTICE, "SIGHUP: no --config file to reload");
            return;
        }
        char msg[128];
        snprintf(msg, sizeof msg, "RELOADING=1\nMONOTONIC_USEC=%llu",
                 (unsigned long long)qm_now_us());
        qm_notify(msg);
        qm_status st;
        qm_status_clear(&st);
        /* The reloadable keys as a fresh start would set them (flags over
         * the file, defaults where neither says), all or none. */
        if (qm_config_reload(&d->cfg, d->argc, d->argv, &st) < 0) {
            qm_log(QM_LOG_ERR, "SIGHUP: keeping the old config: %s", st.msg);
        } else {
            qm_log_set_level(d->cfg.log_level);
            qm_server_apply_config(d->server);
            qm_reclaim_arm(&d->reclaim); /* session_orphan_timeout_s may have changed */
            qm_log(QM_LOG_NOTICE, "SIGHUP: reloaded %s", d->cfg.config_path);
        }
        qm_notify("READY=1");
        notify_status(d, "");
        return;
    }
    qm_log(QM_LOG_NOTICE, "%s received", signum == SIGTERM ? "SIGTERM" : "SIGINT");
    begin_drain(d, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* Hotness profiles reach the state dir every 5 minutes (and at unload and
 * exit), so a crash loses little. The connections' limits have their own
 * timer, armed only while one can expire (qm_server_sweep_idle). */
static void tick_cb(uv_timer_t *t)
{
    qm_daemon *d = t->data;
    qm_models_save_hotness(qm_registry_models(d->registry));
}

static void watchdog_cb(uv_timer_t *t)
{
    (void)t;
    qm_notify("WATCHDOG=1");
}

/* The server's frames and the pool's finished jobs go to dispatch, with
 * what the methods reach. */
static void server_frame(void *arg, qm_conn *c, qm_rpc_frame *frame, qm_frame_times times)
{
    qm_dispatch_frame(&((qm_daemon *)arg)->methods, c, frame, times);
}

static void server_conn_closed(void *arg, uint64_t conn_id)
{
    qm_daemon *d = arg;
    /* Its rings first: a session the connection leaves orphaned has no
     * ring of its then. */
    qm_rings_conn_closed(d->rings, conn_id);
    if (d->reclaim_started && !d->stopping)
        qm_reclaim_conn_closed(&d->reclaim, conn_id);
}

static void session_closed(void *arg, qm_session *s)
{
    qm_rings_session_closed(((qm_daemon *)arg)->rings, s);
}

static void pool_done(void *arg, qm_job *job)
{
    qm_dispatch_job_done(&((qm_daemon *)arg)->methods, job);
}

static void pool_discard(void *arg, qm_job *job)
{
    (void)arg;
    qm_dispatch_job_discard(job);
}

/* The configuration from the flags and the file, and what must hold before
 * anything opens: -1 to go on, else the exit status (the config freed). */
static int configure(qm_daemon *d, int argc, char **argv)
{
    qm_status st;
    qm_status_clear(&st);
    qm_config_defaults(&d->cfg);
    int rc = qm_config_from_args(&d->cfg, argc, argv, &st), status = -1;
    if (rc == 1) {
        status = 0;
    } else if (rc < 0) {
        fprintf(stderr, "qmoed: %s\n", st.msg);
        status = 2;
    } else if (geteuid() == 0 && !d->cfg.user && !d->cfg.allow_root) {
        /* Root only when asked for, before any bank is opened. */
        fprintf(stderr, "qmoed: refusing to run as root: pass --user USER to drop to it after "
                        "binding, or --allow-root (config keys user, allow_root)\n");
        status = 2;
    } else if (d->cfg.state_dir && mkdir(d->cfg.state_dir, 0750) < 0 && errno != EEXIST) {
        /* The state dir holds hotness profiles and recorded traces;
         * systemd's StateDirectory= creates it for the service, a
         * hand-started daemon creates it here (one level, like
         * StateDirectory). */
        fprintf(stderr, "qmoed: cannot create state_dir %s: %s\n", d->cfg.state_dir,
                strerror(errno));
        status = 2;
    } else if (d->cfg.state_dir) {
        struct stat sb;
        if (stat(d->cfg.state_dir, &sb) < 0 || !S_ISDIR(sb.st_mode)) {
            fprintf(stderr, "qmoed: state_dir %s is not a directory\n", d->cfg.state_dir);
            status = 2;
        }
    }
    if (status >= 0)
        qm_config_free(&d->cfg);
    return status;
}

/* What every method reaches of the daemon (qm_methods.h); the pool and
 * the rings join it as they start. */
static void set_method_ctx(qm_daemon *d)
{
    d->methods = (qm_method_ctx){.cfg = &d->cfg,
                                 .registry = d->registry,
                                 .models = qm_registry_models(d->registry),
                                 .sessions = qm_registry_sessions(d->registry),
                                 .devices = &d->devices,
                                 .server = d->server,
                                 .counters = &d->counters,
                                 .limits = &d->limits,
                                 .trace = &d->trace,
                                 .reclaim = &d->reclaim,
                                 .start_us = d->start_us,
                                 .draining = draining,
                                 .begin_drain = begin_drain,
                                 .life = d};
}

/* The models given at start (--model, the file's "models"). */
static int load_models(qm_daemon *d)
{
    for (size_t i = 0; i < d->cfg.n_models; i++) {
        qm_status st;
        qm_status_clear(&st);
        if (qm_model_load(qm_registry_models(d->registry), d->cfg.models[i].name,
                          d->cfg.models[i].path, NULL, &st) < 0) {
            qm_log(QM_LOG_ERR, "cannot load model %s from %s: %s", d->cfg.models[i].name,
                   d->cfg.models[i].path, st.msg);
            return -1;
        }
        qm_log(QM_LOG_INFO, "model %s loaded from %s", d->cfg.models[i].name,
               d->cfg.models[i].path);
    }
    return 0;
}

/* Signals first (a SIGTERM that arrives as soon as the socket answers
 * must drain, not kill), then the loop's timers and the reclaim. */
static void start_handles(qm_daemon *d)
{
    uv_signal_init(d->loop, &d->sig_term);
    uv_signal_init(d->loop, &d->sig_int);
    uv_signal_init(d->loop, &d->sig_hup);
    d->sig_term.data = d->sig_int.data = d->sig_hup.data = d;
    uv_signal_start(&d->sig_term, signal_cb, SIGTERM);
    uv_signal_start(&d->sig_int, signal_cb, SIGINT);
    uv_signal_start(&d->sig_hup, signal_cb, SIGHUP);
    uv_timer_init(d->loop, &d->tick);
    qm_models_watch(qm_registry_models(d->registry), d->loop);
    qm_reclaim_init(&d->reclaim, d->loop, qm_registry_sessions(d->registry), &d->cfg,
                    &d->counters);
    d->reclaim_started = 1;
    uv_timer_init(d->loop, &d->watchdog);
    uv_timer_init(d->loop, &d->drain_timer);
    d->tick.data = d->watchdog.data = d->drain_timer.data = d;
    uv_timer_start(&d->tick, tick_cb, 300000, 300000);
}

/* The socket, the call rings and the workers, then READY=1. */
static int start_serving(qm_daemon *d)
{
    qm_status st;
    qm_status_clear(&st);
    if (qm_server_listen(d->server, &st) < 0) {
        qm_log(QM_LOG_ERR, "%s", st.msg);
        return -1;
    }
    /* As the user it serves as (after --user's drop): what it keeps there
     * would otherwise fail at each save. */
    if (d->cfg.state_dir && access(d->cfg.state_dir, W_OK | X_OK) < 0)
        qm_log(QM_LOG_WARNING,
               "state_dir %s is not writable by uid %u (%s): hotness profiles, traces and the "
               "kernel cache will not be saved",
               d->cfg.state_dir, (unsigned)geteuid(), strerror(errno));
    if (qm_rings_new(d->loop, &d->methods, &d->rings) < 0) {
        qm_log(QM_LOG_ERR, "out of memory for the call rings");
        return -1;
    }
    d->methods.rings = d->rings;
    qm_registry_sessions(d->registry)->on_close = session_closed;
    qm_registry_sessions(d->registry)->on_close_arg = d;
    qm_pool_hooks hooks = {
        .done = pool_done, .idle = maybe_finish, .discard = pool_discard, .arg = d};
    if (qm_pool_start(d->loop, d->cfg.workers, &hooks, &d->pool) < 0) {
        qm_log(QM_LOG_ERR, "cannot start %u workers", d->cfg.workers);
        return -1;
    }
    d->methods.pool = d->pool;
    d->methods.pressure = &d->pressure;
    qm_pressure_start(&d->pressure, d->loop, &d->methods);
    d->watchdog_usec = qm_watchdog_usec();
    if (d->watchdog_usec) {
        uint64_t ms = d->watchdog_usec / 2000;
        uv_timer_start(&d->watchdog, watchdog_cb, ms ? ms : 1, ms ? ms : 1);
    }
    notify_status(d, "READY=1\n");
    qm_log(QM_LOG_NOTICE, "qmoed %s ready (%zu models)", QMOE_VERSION,
           qm_registry_models(d->registry)->n);
    return 0;
}

int qm_daemon_main(int argc, char **argv)
{
    qm_daemon daemon_state, *d = &daemon_state;
    memset(d, 0, sizeof *d);
    qm_log_init();
    d->argc = argc;
    d->argv = argv;
    int rc = configure(d, argc, argv);
    if (rc >= 0)
        return rc;
    qm_status st;
    qm_status_clear(&st);
    signal(SIGPIPE, SIG_IGN);
    if (qm_sigbus_install() < 0)
        qm_log(QM_LOG_WARNING, "cannot install the SIGBUS handler: a bank file truncated "
               "while a request reads it would end the daemon");
    d->start_us = qm_now_us();
    d->exit_code = 0;
    qm_log_set_level(d->cfg.log_level);
    d->loop = uv_default_loop();

    int status = 1;
    qm_server_host host = {.loop = d->loop,
                           .cfg = &d->cfg,
                           .counters = &d->counters,
                           .limits = &d->limits,
                           .frame = server_frame,
                           .safe_point = maybe_finish,
                           .conn_closed = server_conn_closed,
                           .arg = d};
    if (qm_server_new(&host, &d->server) < 0) {
        qm_log(QM_LOG_ERR, "out of memory for the server");
        goto out_config;
    }
    if (qm_trace_init(&d->trace, d->cfg.trace_capacity, d->start_us) < 0) {
        qm_log(QM_LOG_ERR, "out of memory for the trace ring");
        goto out_config;
    }
    /* The CPU backend's measured kernel choice is kept in the state dir, so
     * a restart reads it instead of measuring again (an explicit
     * QMOE_KERNEL_CACHE wins). Set before any thread starts. */
    if (d->cfg.state_dir && !getenv("QMOE_KERNEL_CACHE")) {
        char cache[4096];
        int n = snprintf(cache, sizeof cache, "%s/kernels.cache", d->cfg.state_dir);
        if (n > 0 && (size_t)n < sizeof cache)
            setenv("QMOE_KERNEL_CACHE", cache, 0);
    }
    /* Every CPU kernel proves itself before any can be chosen (logged). */
    if ((rc = qm_kernel_report_start(&st)) < 0) {
        qm_log(QM_LOG_ERR, "%s; not starting", st.msg);
        goto out_trace;
    }
    char idle[512];
    if (qm_idle_hint(QM_IDLE_DRIVER_PATH, QM_HALTPOLL_NS_PATH, idle, sizeof idle))
        qm_log(QM_LOG_INFO, "%s", idle);
    if ((rc = qm_devices_open(&d->devices, &d->cfg, &st)) < 0) {
        qm_log(QM_LOG_ERR, "cannot open backend %s: %s", d->cfg.backend, st.msg);
        goto out_trace;
    }
    if (qm_registry_new(&d->cfg, &d->devices, &d->limits, &d->trace, &d->registry) < 0) {
        qm_log(QM_LOG_ERR, "out of memory for the registry");
        goto out_models;
    }
    set_method_ctx(d);
    if (load_models(d) < 0)
        goto out_models;
    start_handles(d);
    if (start_serving(d) < 0)
        goto out_listen;

    uv_run(d->loop, UV_RUN_DEFAULT);
    /* Handles left by a stop (close callbacks still pending) finish here. */
    uv_walk(d->loop, close_walk_cb, NULL);
    uv_run(d->loop, UV_RUN_DEFAULT);
    status = d->exit_code;
    goto out_workers;

out_listen:
    uv_walk(d->loop, close_walk_cb, NULL);
    uv_run(d->loop, UV_RUN_DEFAULT);
out_workers:
    /* Ring threads end before the pool they queue on; their memory after
     * the workers that may still answer in it. */
    qm_rings_stop(d->rings);
    qm_pool_stop(d->pool);
    qm_pressure_free(&d->pressure);
out_models:
    if (d->registry)
        qm_registry_sessions(d->registry)->on_close = NULL;
    qm_rings_free(d->rings);
    qm_registry_free(d->registry);
    qm_devices_close(&d->devices);
out_trace:
    qm_trace_free(&d->trace);
out_config:
    if (uv_loop_close(d->loop) != 0)
        qm_log(QM_LOG_WARNING, "event loop closed with handles still open");
    qm_log(QM_LOG_INFO, "exiting with status %d", status);
    qm_server_free(d->server);
    qm_config_free(&d->cfg);
    return status;
}
