/* qm_daemon.h - private to daemon/: the structures the daemon's files share.
 *
 * Threading: one libuv loop thread owns everything here except what the
 * worker pool touches, which is marked "(pool lock)" or "(worker)". Workers
 * never touch sockets or registries; the loop never runs a kernel. */
#ifndef QM_DAEMON_H
#define QM_DAEMON_H

#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "qm_backend.h"
#include "qm_bank.h"
#include "qm_hotness.h"
#include "qm_moe.h"
#include "qm_pager.h"
#include "qm_protocol.h"
#include "qm_residency.h"

/* ---- logging (qm_log.c) ---- */

enum { QM_LOG_ERR = 3, QM_LOG_WARNING = 4, QM_LOG_NOTICE = 5, QM_LOG_INFO = 6, QM_LOG_DEBUG = 7 };

void qm_log_init(void); /* reads JOURNAL_STREAM: journal prefixes or timestamps */
void qm_log_set_level(int level);
int qm_log_level_parse(const char *name, int *out); /* "error".."debug" */
void qm_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- systemd (qm_notify.c) ---- */

/* Sends `state` ("READY=1\nSTATUS=...") to $NOTIFY_SOCKET; no-op without it. */
int qm_notify(const char *state);
/* A listening socket passed by systemd (LISTEN_PID/LISTEN_FDS), or -1. */
int qm_listen_fd_from_env(void);
/* Watchdog interval in microseconds from WATCHDOG_USEC/WATCHDOG_PID, or 0. */
uint64_t qm_watchdog_usec(void);

/* ---- configuration (qm_config.c) ---- */

typedef struct qm_model_spec {
    char *name, *path;
} qm_model_spec;

typedef struct qm_config {
    char *socket_path;  /* NULL: the PROTOCOL.md default */
    char *config_path;
    qm_model_spec *models;
    size_t n_models;
    char backend[8];    /* cpu, cuda, auto */
    int has_device_budget;
    uint64_t device_budget;
    char *state_dir;
    uint32_t threads;   /* backend compute threads (0 = cores) */
    uint32_t workers;   /* sessions computed in parallel */
    char *admin_group;
    char *user;     /* drop to this user after binding (when started as root) */
    int allow_root; /* keep running as root without a warning */
    char *model_dirs; /* model.load only below these (':'-separated); NULL: anywhere */
    int log_level;
    /* limits */
    uint64_t max_request_bytes;
    uint32_t max_nesting;
    uint32_t max_batch;
    uint32_t max_connections;
    uint32_t max_sessions;
    uint64_t max_output_bytes; /* per connection: reads pause above it */
    uint32_t queue_depth;      /* jobs queued daemon-wide */
    uint32_t idle_timeout_s;   /* 0 = never */
    uint32_t frame_timeout_s;  /* partial frame / stalled output; 0 = 2 x idle (60 s if none) */
    uint32_t frames_per_wakeup;
    uint32_t drain_timeout_s;
    uint32_t trace_capacity;
    uint64_t session_workspace_bytes;
} qm_config;

void qm_config_defaults(qm_config *cfg);
void qm_config_free(qm_config *cfg);
/* Parses argv into cfg (flags win over the file, which is read first).
 * Returns 0, 1 when --help/--version was printed, or negative with st set. */
int qm_config_from_args(qm_config *cfg, int argc, char **argv, qm_status *st);
/* Reads the JSON file; with reload = 1 only the reloadable keys are applied. */
int qm_config_load_file(qm_config *cfg, const char *path, int reload, qm_status *st);
int qm_config_add_model(qm_config *cfg, const char *name, const char *path, qm_status *st);

/* ---- telemetry (qm_telemetry.c) ---- */

#define QM_HIST_BUCKETS 256

typedef struct qm_hist {
    uint64_t count;
    uint64_t buckets[QM_HIST_BUCKETS];
} qm_hist;

void qm_hist_add(qm_hist *h, uint64_t value_us);
uint64_t qm_hist_quantile(const qm_hist *h, double q); /* bucket upper bound; 0 when empty */

typedef struct qm_counters {
    uint64_t requests, errors, tokens, expert_hits, expert_misses, bytes_paged_h2d, evictions,
        prefetch_issued, prefetch_useful, resident_bytes;
    qm_hist latency; /* session.infer end to end, microseconds */
} qm_counters;

typedef struct qm_span {
    uint64_t seq;
    char name[32];
    uint64_t start_us, dur_us;
    char session[QM_SESSION_ID_LEN + 1]; /* "" when none */
    char args[192];                      /* a JSON object */
} qm_span;

typedef struct qm_trace {
    qm_span *ring;
    size_t cap, head, count; /* head = next slot to write */
    uint64_t next_seq;
} qm_trace;

int qm_trace_init(qm_trace *t, size_t cap);
void qm_trace_free(qm_trace *t);
/* Records a span; returns a copy through *out (may be NULL). */
void qm_trace_add(qm_trace *t, const char *name, uint64_t start_us, uint64_t dur_us,
                  const char *session, const char *args, qm_span *out);

void qm_jw_counters(qm_jw *w, const qm_counters *c); /* the counter members, no braces */

typedef struct qm_daemon qm_daemon;
typedef struct qm_conn qm_conn;
/* The telemetry.* methods: write the result value, or return an error in st. */
int qm_telemetry_get(qm_daemon *d, qm_conn *c, const qm_params *p, qm_jw *w, qm_status *st);
int qm_telemetry_trace(qm_daemon *d, const qm_params *p, qm_jw *w, qm_status *st);
/* Prometheus text (sessions the peer may see only). */
int qm_telemetry_metrics(qm_daemon *d, qm_conn *c, qm_buf *b);

/* ---- daemon state ---- */

typedef struct qm_session qm_session;
typedef struct qm_job qm_job;

typedef struct qm_model {
    char name[QM_NAME_MAX + 1];
    char *path;
    qm_bank *bank;
    qm_region_catalog **catalogs; /* one per layer, bank id = layer */
    uint32_t n_layers;
    uint64_t bytes_total, bytes_per_expert;
    qm_hotness *hotness;    /* decayed use counts; static_hot's default hot lists */
    char *hotness_path;     /* state_dir/<name>.hot, NULL without a state dir */
    uint64_t hotness_saved; /* qm_hotness_records at the last save */
    qm_backend *host_registered; /* CUDA backend the mapping is registered with, or NULL */
    int guard_slot;              /* qm_sigbus_register's slot, or -1 */
    int refs;        /* registry + sessions */
    int registered;  /* 0 once unloaded: freed when the last session lets go */
    struct qm_model *next;
} qm_model;

struct qm_session {
    char id[QM_SESSION_ID_LEN + 1];
    uid_t owner_uid;
    qm_model *model;
    char policy_name[16];
    int precision_fast;       /* session.create precision "fast" (fixed for the session) */
    qm_policy policy;
    qm_residency_plan *plan;
    qm_pager *pager;          /* (worker) while a job of this session runs */
    qm_pager_options pager_options;
    char *trace_path;         /* policy_params.record_trace in the state dir, or NULL */
    uint64_t plan_start_us, plan_us;
    uint64_t budget_bytes;    /* expert-weight budget */
    uint64_t workspace_bytes; /* fixed at creation */
    uint64_t admitted_bytes;  /* budget + workspace, counted against the device budget */
    int64_t created_at;       /* unix seconds */
    int refs;                 /* registry + queued jobs (loop thread) */
    atomic_int closed;        /* set by the loop; workers answer not_found after it */
    qm_counters counters;
    qm_pager_stats last_stats; /* the pager's cumulative stats after the last job */
    qm_span plan_span;
    /* Per-session FIFO (pool lock). */
    qm_job *q_head, *q_tail;
    int scheduled; /* on the run queue or running */
    qm_session *runq_next;
    size_t pending; /* jobs enqueued and not yet completed (loop thread) */
    qm_session *next;
};

/* A frame's responses: one slot per item, written when all are filled. */
typedef struct qm_reply {
    qm_conn *conn;
    int is_batch;
    size_t n, pending;
    char **parts; /* NULL: no response (notification) */
    size_t *lens;
} qm_reply;

typedef enum qm_job_kind {
    QM_JOB_INFER,  /* the worker runs the layer and encodes the response */
    QM_JOB_CREATE, /* the worker builds a new session's pager */
    QM_JOB_BARRIER, /* the worker passes it through; the loop answers it in order */
    QM_JOB_PLAN     /* session.plan: the worker reads the pager's residency now */
} qm_job_kind;

struct qm_job {
    qm_job *next;
    qm_job_kind kind;
    qm_daemon *d;
    qm_session *session;
    qm_reply *reply;
    size_t slot;
    qm_request req; /* owned */
    uint64_t enqueue_us, start_us, end_us;
    uint64_t decode_us; /* the frame's decoding on the loop thread (whole batch) */
    /* results (worker) */
    int rc;
    int cancelled; /* skipped: its client went away before it ran */
    qm_status st;
    qm_buf response;
    qm_moe_stats mstats;
    qm_pager_stats pstats;
    uint32_t tokens;
    uint32_t *route_experts; /* [tokens * k], for the hotness profile */
    size_t n_routes;
};

typedef struct qm_pool {
    uv_thread_t *threads;
    uint32_t n_threads;
    uv_mutex_t mu;
    uv_cond_t cv;
    qm_session *runq_head, *runq_tail;
    qm_job *done_head, *done_tail;
    int stop;
    uv_async_t async;
    size_t queued;       /* jobs enqueued and not completed (loop thread) */
    size_t queued_infer; /* ... of which inferences (what queue_depth bounds) */
} qm_pool;

struct qm_conn {
    uv_pipe_t pipe;
    qm_daemon *d;
    uint64_t id;
    uid_t uid;
    gid_t gid;
    pid_t pid;
    int is_admin;
    qm_framer framer;
    int refs;          /* handle + replies in flight */
    int closing;       /* uv_close called */
    atomic_int gone;   /* set with closing: workers skip this peer's queued inferences */
    int drop;          /* to be closed at the next safe point */
    int close_after_write;
    int eof;             /* the peer half-closed: answer what it sent, then close */
    size_t replies_pending;
    int reading;
    int paused_output; /* reads stopped: output over max_output_bytes */
    int paused_frames; /* reads stopped: frames left for the next wake-up */
    int logged_output_limit;
    uint64_t out_bytes;
    uint64_t last_active_ms; /* uv_now() of the last read or write */
    uint64_t frame_started_ms;  /* when the buffered partial frame began (0: none) */
    uint64_t last_progress_ms;  /* when queued output last shrank */
    qm_conn *next, *prev;
    qm_conn *pending_next; /* on d->pending (frames left to process) */
    int on_pending;
};

enum {
    QM_LIMIT_MAX_REQUEST_BYTES,
    QM_LIMIT_MAX_NESTING,
    QM_LIMIT_MAX_BATCH,
    QM_LIMIT_MAX_CONNECTIONS,
    QM_LIMIT_MAX_SESSIONS,
    QM_LIMIT_MAX_OUTPUT_BYTES,
    QM_LIMIT_QUEUE_DEPTH,
    QM_LIMIT_IDLE_TIMEOUT,
    QM_LIMIT_FRAMES_PER_WAKEUP,
    QM_LIMIT_FRAME_TIMEOUT,
    QM_LIMIT_OUTPUT_STALL,
    QM_LIMIT_COUNT
};
extern const char *const qm_limit_names[QM_LIMIT_COUNT];

struct qm_daemon {
    uv_loop_t *loop;
    qm_config cfg;
    qm_proto_limits lim;
    char *socket_path;
    int bound_path; /* we created the socket file: unlink it at exit */
    uv_pipe_t listener;
    int listening;
    int accept_retry; /* a connection waits for memory to accept it (qm_server.c) */
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t tick, watchdog, drain_timer;
    uv_check_t check;
    uv_idle_t idle;
    uint64_t watchdog_usec;
    uint64_t ticks;
    qm_backend *backend;
    qm_device_info device;
    uint64_t device_budget;
    uint64_t admitted_bytes;
    qm_model *models;
    size_t n_models;
    qm_session *sessions;
    size_t n_sessions;
    qm_conn *conns;
    size_t n_conns;
    uint64_t next_conn_id;
    qm_conn *pending; /* connections with unprocessed frames */
    char *read_buf;   /* shared by every connection's reads (loop thread) */
    uint64_t frame_decode_us; /* of the frame being dispatched */
    size_t drops_marked;      /* connections marked since the last safe point */
    qm_pool pool;
    qm_counters counters;
    uint64_t limit_hits[QM_LIMIT_COUNT];
    int limit_logged[QM_LIMIT_COUNT];
    qm_trace trace;
    int draining;
    int stopping; /* handles are being closed */
    uint64_t start_us;
    int64_t start_wall;
    uid_t self_uid;
    int has_admin_gid;
    gid_t admin_gid;
    int exit_code;
};

uint64_t qm_now_us(void); /* monotonic */
/* The whole daemon: parses argv, serves until drained; the exit status. */
int qm_daemon_main(int argc, char **argv);
void qm_limit_hit(qm_daemon *d, int limit, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- truncated bank files (qm_sigbus.c) ---- */

/* Installs the SIGBUS handler (once). */
int qm_sigbus_install(void);
/* Registers a bank mapping (loop thread); returns its slot or -1. */
int qm_sigbus_register(const void *base, uint64_t size);
void qm_sigbus_unregister(int slot); /* before the mapping goes */
int qm_sigbus_poisoned(int slot);
/* Before and after each use of a model's bank: QM_EINVALID_MODEL when its
 * file was truncated on disk (fstat) or a read hit a missing page. */
int qm_model_check(const qm_model *m, qm_status *st);

/* ---- registries (qm_registry.c) ---- */

int qm_model_load(qm_daemon *d, const char *name, const char *path, qm_model **out,
                  qm_status *st);
/* model.load's path check against model_dirs: the resolved path (qm_malloc'd)
 * in *resolved, or QM_EPERMISSION naming the key when it lies outside. */
int qm_model_path_allowed(qm_daemon *d, const char *path, char **resolved, qm_status *st);
qm_model *qm_model_find(qm_daemon *d, const char *name);
void qm_model_unref(qm_model *m);
/* Unregisters; with force closes its sessions, else QM_EIN_USE while used. */
int qm_model_unload(qm_daemon *d, const char *name, int force, qm_status *st);
void qm_jw_model_summary(qm_jw *w, const qm_model *m);
/* Saves every model's hotness profile that changed (state_dir set). */
void qm_models_save_hotness(qm_daemon *d);

/* session.create in three steps: prepare (loop: checks, policy, plan,
 * admission reserved), build (worker: the pager, which may copy whole banks
 * and pins), then commit (loop: registered) or abort (loop: reservation
 * released, session freed). */
int qm_session_prepare(qm_daemon *d, const qm_params *p, uid_t owner, qm_session **out,
                       qm_status *st);
int qm_session_build(qm_daemon *d, qm_session *s, qm_status *st);
void qm_session_commit(qm_daemon *d, qm_session *s);
void qm_session_abort(qm_daemon *d, qm_session *s);
qm_session *qm_session_find(qm_daemon *d, const char *id);
/* Unregisters and releases the registry's reference (jobs may hold more). */
void qm_session_close(qm_daemon *d, qm_session *s);
void qm_session_unref(qm_daemon *d, qm_session *s);
void qm_registry_free_all(qm_daemon *d);

/* ---- worker pool (qm_worker.c) ---- */

int qm_pool_start(qm_daemon *d, uint32_t n_threads);
void qm_pool_stop(qm_daemon *d); /* joins the workers */
/* Queues a job on its session's FIFO (takes ownership). QM_EOVERLOADED when
 * queue_depth jobs are already waiting. */
int qm_pool_submit(qm_daemon *d, qm_job *job);
void qm_job_free(qm_job *job);

/* ---- connections (qm_server.c) ---- */

int qm_server_listen(qm_daemon *d, qm_status *st);
void qm_server_stop_listening(qm_daemon *d);
void qm_conn_ref(qm_conn *c);
/* Marks the connection to be closed at the next safe point. */
void qm_conn_drop(qm_conn *c);
void qm_conn_unref(qm_conn *c);
/* Queues bytes (takes ownership of `data`, from qm_malloc) for writing. */
void qm_conn_write(qm_conn *c, char *data, size_t len);
/* Closes every connection (after drain). */
void qm_server_close_all(qm_daemon *d);
/* Marks connections idle past idle_timeout_s for dropping. */
void qm_server_sweep_idle(qm_daemon *d);
/* A reply of the connection was written (or dropped). */
void qm_conn_reply_done(qm_conn *c);
/* Checks whether the drain is complete, and if so stops the loop. */
void qm_daemon_maybe_finish(qm_daemon *d);
void qm_daemon_begin_drain(qm_daemon *d, const char *why);

/* ---- dispatch (qm_dispatch.c) ---- */

/* Handles one decoded frame of a connection. */
void qm_dispatch_frame(qm_conn *c, qm_rpc_frame *frame);
/* A finished job, on the loop thread. */
void qm_dispatch_job_done(qm_daemon *d, qm_job *job);
/* Fills a reply slot; writes the reply when it is complete. */
void qm_reply_fill(qm_reply *r, size_t slot, char *data, size_t len);

/* The job's work on a worker thread (qm_infer.c: encodes the response). */
void qm_job_run(qm_job *job);
/* session.plan on a worker thread (qm_infer.c): the plan with resident_now
 * per paged bank and resident_bytes, as the result of job->req. */
void qm_job_run_plan(qm_job *job);
/* The session's plan JSON with its pager's residency now (worker thread, or
 * any thread while no job of the session runs). */
int qm_session_plan_json(qm_session *s, char **json, size_t *len, qm_status *st);

#endif
