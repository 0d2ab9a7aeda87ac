/* qm_daemon.c - qmoed's life: start-up, signals, drain, exit.
 *
 * Start: config -> devices -> preloaded models -> socket -> worker pool ->
 * READY=1. SIGTERM/SIGINT/daemon.shutdown: stop accepting, answer
 * shutting_down to new requests, let accepted ones finish and flush, exit 0
 * (1 when drain_timeout_s ran out first). SIGHUP: reload reloadable keys. */
#include "qm_daemon.h"

#include <grp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <errno.h>
#include <time.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_log.h"
#include "qm_models.h"
#include "qm_notify.h"
#include "qm_pool.h"
#include "qm_server.h"
#include "qm_sessions.h"
#include "qm_sigbus.h"

const char *const qm_limit_names[QM_LIMIT_COUNT] = {
    "max_request_bytes", "max_nesting",  "max_batch",      "max_connections",  "max_sessions",
    "max_output_bytes",  "queue_depth",  "idle_timeout_s", "frames_per_wakeup",
    "frame_timeout_s",   "output_stall",
};

uint64_t qm_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Counted every time, logged the first time per limit (and per connection
 * for the output limit, logged by its caller). */
void qm_limit_hit(qm_daemon *d, int limit, const char *fmt, ...)
{
    d->limit_hits[limit]++;
    if (d->limit_logged[limit])
        return;
    d->limit_logged[limit] = 1;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    qm_log(QM_LOG_WARNING, "limit %s: %s (logged once; see qmoed_limit_hits_total)",
           qm_limit_names[limit], msg);
}

static void apply_limits(qm_daemon *d)
{
    d->lim.max_request_bytes = d->cfg.max_request_bytes;
    d->lim.max_nesting = (int)d->cfg.max_nesting;
    d->lim.max_batch = d->cfg.max_batch;
    qm_server_apply_limits(d);
    qm_log_set_level(d->cfg.log_level);
    d->has_admin_gid = 0;
    if (d->cfg.admin_group) {
        struct group *g = getgrnam(d->cfg.admin_group);
        if (g) {
            d->has_admin_gid = 1;
            d->admin_gid = g->gr_gid;
        } else {
            qm_log(QM_LOG_WARNING, "admin_group '%s' does not exist; only uid 0 and uid %u are "
                   "admins", d->cfg.admin_group, (unsigned)d->self_uid);
        }
    }
}

static void notify_status(qm_daemon *d, const char *prefix)
{
    char msg[256];
    snprintf(msg, sizeof msg, "%sSTATUS=%s: %zu models, %zu sessions, %zu connections", prefix,
             d->draining ? "draining" : "serving", d->n_models, d->n_sessions,
             qm_server_connections(d));
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
    qm_server_stop_listening(d);
    qm_server_close_all(d);
    uv_walk(d->loop, close_walk_cb, NULL);
}

void qm_daemon_maybe_finish(qm_daemon *d)
{
    if (!d->draining || d->stopping || qm_pool_queued(d->pool) || qm_server_owes_answers(d))
        return;
    qm_log(QM_LOG_INFO, "drained: every accepted request answered");
    finish(d);
}

static void drain_timeout_cb(uv_timer_t *t)
{
    qm_daemon *d = t->data;
    qm_log(QM_LOG_ERR, "drain_timeout_s %u passed with %zu requests unanswered; exiting",
           d->cfg.drain_timeout_s, qm_pool_queued(d->pool));
    d->exit_code = 1;
    finish(d);
}

void qm_daemon_begin_drain(qm_daemon *d, const char *why)
{
    if (d->draining)
        return;
    d->draining = 1;
    qm_log(QM_LOG_NOTICE, "draining (%s): %zu requests in flight", why, qm_pool_queued(d->pool));
    qm_notify("STOPPING=1");
    notify_status(d, "");
    qm_server_stop_listening(d);
    if (d->cfg.drain_timeout_s) {
        uv_timer_start(&d->drain_timer, drain_timeout_cb, (uint64_t)d->cfg.drain_timeout_s * 1000,
                       0);
        uv_unref((uv_handle_t *)&d->drain_timer);
    }
    /* The end comes from the check handle, at a safe point of the loop. */
}

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
        qm_config next = d->cfg;
        /* Strings are shared with d->cfg; only reloadable scalars and
         * admin_group change, and set_string frees the old one in place. */
        int rc = qm_config_load_file(&next, d->cfg.config_path, 1, &st);
        d->cfg.admin_group = next.admin_group; /* possibly replaced (and the old freed) */
        if (rc < 0) {
            qm_log(QM_LOG_ERR, "SIGHUP: keeping the old config: %s", st.msg);
        } else {
            d->cfg = next;
            apply_limits(d);
            qm_log(QM_LOG_NOTICE, "SIGHUP: reloaded %s", d->cfg.config_path);
        }
        qm_notify("READY=1");
        notify_status(d, "");
        return;
    }
    qm_log(QM_LOG_NOTICE, "%s received", signum == SIGTERM ? "SIGTERM" : "SIGINT");
    qm_daemon_begin_drain(d, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

static void tick_cb(uv_timer_t *t)
{
    qm_daemon *d = t->data;
    qm_server_sweep_idle(d);
    /* Hotness profiles reach the state dir every 5 minutes (and at unload
     * and exit), so a crash loses little. */
    if (++d->ticks % 300 == 0)
        qm_models_save_hotness(d);
}

static void watchdog_cb(uv_timer_t *t)
{
    (void)t;
    qm_notify("WATCHDOG=1");
}

int qm_daemon_main(int argc, char **argv)
{
    qm_daemon daemon_state, *d = &daemon_state;
    memset(d, 0, sizeof *d);
    qm_log_init();
    qm_config_defaults(&d->cfg);
    qm_status st;
    qm_status_clear(&st);
    int rc = qm_config_from_args(&d->cfg, argc, argv, &st);
    if (rc == 1) {
        qm_config_free(&d->cfg);
        return 0;
    }
    if (rc < 0) {
        fprintf(stderr, "qmoed: %s\n", st.msg);
        qm_config_free(&d->cfg);
        return 2;
    }
    if (geteuid() == 0 && !d->cfg.user && !d->cfg.allow_root) {
        /* Root only when asked for, before any bank is opened. */
        fprintf(stderr, "qmoed: refusing to run as root: pass --user USER to drop to it after "
                        "binding, or --allow-root (config keys user, allow_root)\n");
        qm_config_free(&d->cfg);
        return 2;
    }
    /* The state dir holds hotness profiles and recorded traces; systemd's
     * StateDirectory= creates it for the service, a hand-started daemon
     * creates it here (one level, like StateDirectory). */
    if (d->cfg.state_dir && mkdir(d->cfg.state_dir, 0750) < 0 && errno != EEXIST) {
        fprintf(stderr, "qmoed: cannot create state_dir %s: %s\n", d->cfg.state_dir,
                strerror(errno));
        qm_config_free(&d->cfg);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    if (qm_sigbus_install() < 0)
        qm_log(QM_LOG_WARNING, "cannot install the SIGBUS handler: a bank file truncated "
               "while a request reads it would end the daemon");
    d->self_uid = geteuid();
    d->start_us = qm_now_us();
    d->start_wall = (int64_t)time(NULL);
    d->exit_code = 0;
    apply_limits(d);
    d->loop = uv_default_loop();

    int status = 1;
    if (qm_trace_init(&d->trace, d->cfg.trace_capacity) < 0) {
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
    if ((rc = qm_devices_open(&d->devices, &d->cfg, &st)) < 0) {
        qm_log(QM_LOG_ERR, "cannot open backend %s: %s", d->cfg.backend, st.msg);
        goto out_trace;
    }
    for (size_t i = 0; i < d->cfg.n_models; i++) {
        qm_status_clear(&st);
        rc = qm_model_load(d, d->cfg.models[i].name, d->cfg.models[i].path, NULL, &st);
        if (rc < 0) {
            qm_log(QM_LOG_ERR, "cannot load model %s from %s: %s", d->cfg.models[i].name,
                   d->cfg.models[i].path, st.msg);
            goto out_models;
        }
        qm_log(QM_LOG_INFO, "model %s loaded from %s", d->cfg.models[i].name,
               d->cfg.models[i].path);
    }
    /* Signals first: a SIGTERM that arrives as soon as the socket answers
     * must drain, not kill. */
    uv_signal_init(d->loop, &d->sig_term);
    uv_signal_init(d->loop, &d->sig_int);
    uv_signal_init(d->loop, &d->sig_hup);
    d->sig_term.data = d->sig_int.data = d->sig_hup.data = d;
    uv_signal_start(&d->sig_term, signal_cb, SIGTERM);
    uv_signal_start(&d->sig_int, signal_cb, SIGINT);
    uv_signal_start(&d->sig_hup, signal_cb, SIGHUP);
    uv_timer_init(d->loop, &d->tick);
    uv_timer_init(d->loop, &d->watchdog);
    uv_timer_init(d->loop, &d->drain_timer);
    d->tick.data = d->watchdog.data = d->drain_timer.data = d;
    uv_timer_start(&d->tick, tick_cb, 1000, 1000);
    qm_status_clear(&st);
    if ((rc = qm_server_listen(d, &st)) < 0) {
        qm_log(QM_LOG_ERR, "%s", st.msg);
        goto out_listen;
    }
    if (qm_pool_start(d, d->cfg.workers) < 0) {
        qm_log(QM_LOG_ERR, "cannot start %u workers", d->cfg.workers);
        goto out_listen;
    }
    d->watchdog_usec = qm_watchdog_usec();
    if (d->watchdog_usec) {
        uint64_t ms = d->watchdog_usec / 2000;
        uv_timer_start(&d->watchdog, watchdog_cb, ms ? ms : 1, ms ? ms : 1);
    }
    notify_status(d, "READY=1\n");
    qm_log(QM_LOG_NOTICE, "qmoed %s ready (%zu models)", QMOE_VERSION, d->n_models);

    uv_run(d->loop, UV_RUN_DEFAULT);
    /* Handles left by a stop (close callbacks still pending) finish here. */
    uv_walk(d->loop, close_walk_cb, NULL);
    uv_run(d->loop, UV_RUN_DEFAULT);
    qm_pool_stop(d);
    status = d->exit_code;
    goto out_models;

out_listen:
    uv_walk(d->loop, close_walk_cb, NULL);
    uv_run(d->loop, UV_RUN_DEFAULT);
    qm_pool_stop(d);
out_models:
    qm_registry_free_all(d);
    qm_devices_close(&d->devices);
out_trace:
    qm_trace_free(&d->trace);
out_config:
    if (uv_loop_close(d->loop) != 0)
        qm_log(QM_LOG_WARNING, "event loop closed with handles still open");
    qm_log(QM_LOG_INFO, "exiting with status %d", status);
    qm_server_free(d);
    qm_config_free(&d->cfg);
    return status;
}
