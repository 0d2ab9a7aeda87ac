/* qmoe_client.h - libqmoe-client: talk to qmoed over its Unix socket.
 *
 * One qm_client is one connection. Every call is synchronous and bounded by
 * the handle's timeout; calls on one handle from several threads are
 * serialised by the handle's mutex (open one handle per thread for
 * parallelism). Every function returns 0 or a negative code; the same code,
 * its protocol name and a readable sentence land in the qm_client_error the
 * caller passes (may be NULL).
 *
 * Ownership: results come back in caller-provided structs or freshly
 * allocated arrays; release each with the matching qm_client_*_free, which
 * accepts NULL. Borrowed `const char *` arguments are only read during the
 * call. Link with `pkg-config --libs qmoe-client`. */
#ifndef QMOE_CLIENT_H
#define QMOE_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define QM_CLIENT_VERSION "0.1.0"
#define QM_CLIENT_DEFAULT_TIMEOUT_MS 30000

/* Client-side failures; daemon errors carry their JSON-RPC code (-32700,
 * -32600..-32603, -32001..-32009) as named in PROTOCOL.md. */
enum {
    QM_CLIENT_EINVAL = -1,       /* bad argument to a client function */
    QM_CLIENT_ENOMEM = -2,       /* out of memory */
    QM_CLIENT_ENOTRUNNING = -3,  /* no daemon listens on the socket path */
    QM_CLIENT_EACCES = -4,       /* no permission to open the socket */
    QM_CLIENT_ETIMEDOUT = -5,    /* no answer within the timeout */
    QM_CLIENT_EIO = -6,          /* connection broke */
    QM_CLIENT_EPROTO = -7,       /* the answer is not what PROTOCOL.md says */
};

typedef struct qm_client_error {
    int code;          /* 0, a QM_CLIENT_E* code, or a JSON-RPC error code */
    char name[32];     /* "not_running", "invalid_params", "not_found", ... */
    char reason[512];  /* one readable sentence */
    char field[128];   /* params path the daemon blamed, "" if none */
} qm_client_error;

typedef struct qm_client qm_client;

/* Resolves the socket path the way qmoed does: `explicit_path` if given,
 * then $QMOED_SOCKET, $RUNTIME_DIRECTORY/qmoed.sock, /run/qmoed/qmoed.sock
 * for root, $XDG_RUNTIME_DIR/qmoed.sock when that socket exists, else the
 * system daemon's /run/qmoed/qmoed.sock. Returns 0, or QM_CLIENT_EINVAL when
 * the path does not fit in `cap` bytes. */
int qm_client_socket_path(const char *explicit_path, char *buf, size_t cap);

/* Connects. `socket_path` NULL resolves as above; `timeout_ms` <= 0 means
 * QM_CLIENT_DEFAULT_TIMEOUT_MS. On 0, *out is a handle to qm_client_close,
 * which also closes the sessions the handle owns (below, "Sessions a
 * handle owns"). */
int qm_client_open(qm_client **out, const char *socket_path, int timeout_ms,
                   qm_client_error *err);
void qm_client_close(qm_client *c); /* accepts NULL */
const char *qm_client_path(const qm_client *c); /* borrowed, lives with the handle */
void qm_client_set_timeout(qm_client *c, int timeout_ms);

/* Any method, JSON in and out: `params_json` is an object's text or NULL;
 * on 0 *result_json is a malloc'd JSON text (two-space indented when
 * `pretty`) to release with qm_client_string_free. */
int qm_client_call_json(qm_client *c, const char *method, const char *params_json,
                        int pretty, char **result_json, qm_client_error *err);
void qm_client_string_free(char *s);

/* ---- daemon.status ---- */
/* One of the daemon's devices: daemon.status "devices" (every member), or
 * session.plan "placement" (name and budget_bytes, the session's share). */
typedef struct qm_client_device {
    char *name;        /* "cuda:1", "emu:0", "cpu" */
    char *kind;        /* NULL when not reported */
    char *description; /* NULL when not reported */
    uint64_t total_bytes, budget_bytes, used_bytes;
} qm_client_device;

/* One CPU kernel's verdict in the daemon's self-check at start:
 * daemon.status "kernels" (docs/PROTOCOL.md). */
typedef struct qm_client_kernel {
    char *precision; /* "exact" or "fast" */
    char *name;      /* its QMOE_KERNEL name */
    char *state;     /* "verified", "refused" (never used) or "unavailable" (not on this CPU) */
    char *reason;    /* refused or unavailable: why; NULL when verified */
} qm_client_kernel;

typedef struct qm_client_status {
    char *version;
    double uptime_s;
    char *backend; /* "cpu", "cuda" or "emu" */
    char *device_name;
    uint64_t device_total_bytes, device_budget_bytes, device_used_bytes; /* all devices */
    uint64_t models, sessions, connections;
    qm_client_device *devices; /* each device; none from a daemon that does not list them */
    size_t n_devices;
    /* The CPU kernels' self-check: the CPU, its flags the kernels use, the
     * check's cost and whether the kernel cache answered; each kernel's
     * verdict. NULL / 0 from a daemon that does not report it. */
    char *kernels_cpu, *kernels_flags;
    double kernels_check_ms;
    int kernels_cached;
    qm_client_kernel *kernels;
    size_t n_kernels;
} qm_client_status;
int qm_client_daemon_status(qm_client *c, qm_client_status *out, qm_client_error *err);
void qm_client_status_free(qm_client_status *s); /* frees the members, not `s` */

/* ---- models ---- */
typedef struct qm_client_model {
    char *name, *path, *activation;
    uint64_t layers, experts, hidden_size, inter_size, k, bits, block_size;
    uint64_t bytes_total, bytes_per_expert;
} qm_client_model;
int qm_client_model_load(qm_client *c, const char *name, const char *path,
                         qm_client_model *out /* may be NULL */, qm_client_error *err);
int qm_client_model_unload(qm_client *c, const char *name, int force, qm_client_error *err);
int qm_client_model_list(qm_client *c, qm_client_model **models, size_t *count,
                         qm_client_error *err);
void qm_client_model_free(qm_client_model *m);               /* members only */
void qm_client_models_free(qm_client_model *models, size_t count); /* array too */

/* ---- sessions ---- */
typedef struct qm_client_session_params {
    const char *model;
    const char *policy;             /* NULL: the daemon's default (whole_bank) */
    uint64_t budget_bytes;          /* used when has_budget */
    int has_budget;
    const char *policy_params_json; /* an object's JSON text, or NULL */
    const char *precision;          /* "exact" or "fast"; NULL: the daemon's default (exact) */
    /* The budget as text, sent as given (session.create's `budget`): bytes
     * ("1073741824"), "N%" of the model's expert bytes, or "auto" (the
     * daemon sizes it from the memory it may take). Wins over budget_bytes;
     * NULL: budget_bytes when has_budget, else the whole model. */
    const char *budget;
    /* With budget "auto": memory this client takes after the call (its KV
     * cache, buffers, weights it maps and has not read yet), which the auto
     * budget leaves free beside the daemon's reserve (session.create's
     * client_pending_bytes); 0: none. Not sent again when the session is
     * re-created after a restart. */
    uint64_t client_pending_bytes;
} qm_client_session_params;

typedef struct qm_client_plan_summary {
    char *policy;
    uint64_t budget_bytes, total, resident, degraded;
    uint64_t workspace_bytes; /* 0 when the daemon does not report it */
    uint64_t pins_released;   /* pins a session.resize released (0 when none) */
    /* Budget "auto": what it came to and why ("budget auto: 3.10 GB = cgroup
     * limit ..."); NULL when the budget is not auto. */
    char *budget_auto;
} qm_client_plan_summary;

/* On 0, *session_id is a malloc'd id (qm_client_string_free) and `summary`
 * (may be NULL) is filled (qm_client_plan_summary_free). */
int qm_client_session_create(qm_client *c, const qm_client_session_params *p,
                             char **session_id, qm_client_plan_summary *summary,
                             qm_client_error *err);
void qm_client_plan_summary_free(qm_client_plan_summary *s);
int qm_client_session_close(qm_client *c, const char *session, qm_client_error *err);

/* Sessions a handle owns. A session made by qm_client_session_create is
 * owned by the handle that made it: qm_client_close sends session.close for
 * each session the handle still owns, and so does an atexit handler for
 * every handle still open when the process calls exit() (or returns from
 * main), so that a program that forgets, or leaves by an error path, leaves
 * nothing in the daemon. qm_client_session_close (closed, or not_found)
 * ends the ownership. Each of these closes waits at most 2 s, and the first
 * that finds the daemon gone or silent ends them all. What they cannot
 * cover (SIGKILL, _exit, a crash, a handle busy on another thread at exit)
 * the daemon reclaims once session_orphan_timeout_s has passed
 * (docs/OPERATIONS.md "Orphaned sessions"). A handle copied into a child by
 * fork() never closes the parent's sessions, in the child's qm_client_close
 * or at its exit. qm_client_call_json's "session.create" is raw: nothing it
 * creates is owned.
 *
 * qm_client_session_detach: the handle stops owning `session`, which then
 * outlives qm_client_close and the process (a tool such as `qmoectl create`,
 * or an engine that restarts and carries on with it). QM_CLIENT_EINVAL when
 * the handle does not own it. Nothing is sent.
 *
 * qm_client_session_adopt: the handle owns `session` (one made by another
 * handle or process, e.g. the engine's previous run, within the daemon's
 * session_orphan_timeout_s): it sends a request naming it, so the session
 * must exist and be the caller's (the daemon's error otherwise), and the
 * daemon counts this connection as using it; from then on it is closed
 * with this handle, as if created here.
 *
 * To keep a session across a reconnect: within one process nothing is
 * needed (the handle reconnects after a broken exchange and still owns it;
 * its next call tells the daemon it is in use again). Across processes:
 * detach it before exiting and adopt it in the next. */
int qm_client_session_detach(qm_client *c, const char *session, qm_client_error *err);
int qm_client_session_adopt(qm_client *c, const char *session, qm_client_error *err);
/* session.resize: the session's new expert budget. On 0, *resident_bytes
 * (may be NULL) holds the resident bytes after the resize and `summary` (may
 * be NULL) the plan summary (qm_client_plan_summary_free); budget_bytes is in
 * summary->budget_bytes. */
int qm_client_session_resize(qm_client *c, const char *session, uint64_t budget_bytes,
                             uint64_t *resident_bytes, qm_client_plan_summary *summary,
                             qm_client_error *err);
/* The same with the budget as text, sent as given (session.resize's
 * `budget`): bytes, "N%" of the model's expert bytes, or "auto". */
int qm_client_session_resize_to(qm_client *c, const char *session, const char *budget,
                                uint64_t *resident_bytes, qm_client_plan_summary *summary,
                                qm_client_error *err);
/* The same to "auto", leaving `client_pending_bytes` free beside the
 * daemon's reserve (session.resize's client_pending_bytes): memory this
 * client takes after the call, a longer context's KV cache say. Not kept
 * for a re-creation after a restart, as session.create's is not. */
int qm_client_session_resize_auto(qm_client *c, const char *session,
                                  uint64_t client_pending_bytes, uint64_t *resident_bytes,
                                  qm_client_plan_summary *summary, qm_client_error *err);

typedef struct qm_client_session_info {
    char *session, *model, *policy;
    uint64_t owner_uid, budget_bytes, resident_bytes;
    double created_at; /* seconds since the epoch */
    /* Orphaned (no open connection has touched it, nothing of it queued;
     * docs/OPERATIONS.md "Orphaned sessions"): since when, in seconds since
     * the epoch, and the seconds until the daemon reclaims it; -1 when it is
     * not orphaned, when it is never reclaimed (reclaim_in_s, timeout 0), or
     * from a daemon that does not report them. */
    int64_t orphaned_since, reclaim_in_s;
} qm_client_session_info;
int qm_client_session_list(qm_client *c, qm_client_session_info **sessions, size_t *count,
                           qm_client_error *err);
void qm_client_sessions_free(qm_client_session_info *sessions, size_t count);

/* ---- session.plan ---- */
typedef struct qm_client_plan_bank {
    uint64_t bank, layer;
    char *decision;      /* "whole_bank_resident" or "per_expert_candidate" */
    char *reason_kind;   /* NULL when the decision carries no reason */
    char *reason_detail; /* NULL when none */
    int has_experts;     /* 0 for a whole-bank decision (experts: null) */
    uint32_t *experts;   /* candidate expert indices */
    size_t n_experts;
    uint32_t *pinned;
    size_t n_pinned;
    uint64_t bytes_per_expert; /* 0 when absent */
    int64_t resident_now;      /* how many experts are resident now; -1 when not reported */
    int64_t bank_bytes;        /* the whole bank's bytes; -1 when not reported */
    int64_t device;            /* index into the plan's devices; -1 when not reported */
} qm_client_plan_bank;

typedef struct qm_client_plan {
    char *policy;
    uint64_t budget_bytes, total, resident, degraded;
    int64_t resident_bytes; /* expert bytes resident now; -1 when not reported */
    /* "execution" (hybrid execution): on_miss NULL when not reported. */
    char *on_miss;
    uint64_t expert_hits, expert_misses, expert_host_runs;
    qm_client_plan_bank *banks;
    size_t n_banks;
    /* "placement" (a daemon with several devices): the rule and each
     * device's name and the session's budget there; NULL/0 when not reported. */
    char *placement_rule;
    qm_client_device *devices;
    size_t n_devices;
    /* Budget "auto" (session.plan "budget_auto"): why it is what it is, the
     * size it grows back to and the reserve; NULL/0 when not auto. The
     * ceiling: where growth stops for now after a relapse (memory pressure
     * soon after the daemon grew it), 0 when none. */
    char *budget_auto;
    uint64_t budget_auto_target, budget_auto_reserve;
    uint64_t budget_auto_ceiling;
} qm_client_plan;
int qm_client_session_plan(qm_client *c, const char *session, qm_client_plan *out,
                           qm_client_error *err);
void qm_client_plan_free(qm_client_plan *p); /* members only */

/* ---- session.infer ---- */
typedef enum qm_client_dtype {
    QM_CLIENT_F32 = 0,
    QM_CLIENT_F16 = 1,
    QM_CLIENT_BF16 = 2,
    QM_CLIENT_I32 = 3, /* topk_ids only */
} qm_client_dtype;

#define QM_CLIENT_MAX_DIMS 8
typedef struct qm_client_tensor {
    qm_client_dtype dtype;
    int ndim;
    uint64_t shape[QM_CLIENT_MAX_DIMS];
    void *data;    /* little-endian, row-major */
    size_t nbytes; /* product(shape) * element size */
} qm_client_tensor;

typedef struct qm_client_infer_stats {
    uint64_t hits, misses, bytes_paged, queue_us, compute_us;
} qm_client_infer_stats;

typedef struct qm_client_infer_result {
    qm_client_tensor output; /* output.data is malloc'd and owned by the result */
    size_t routing_tokens;   /* 0 unless routing was asked for */
    size_t *routing_offsets; /* token t's pairs are [offsets[t], offsets[t+1]) */
    uint32_t *routing_experts; /* these two share routing_offsets' allocation */
    double *routing_weights;
    qm_client_infer_stats stats;
} qm_client_infer_result;

/* `router_logits` may be NULL when the bank holds a router weight. */
int qm_client_session_infer(qm_client *c, const char *session, uint64_t layer,
                            const qm_client_tensor *hidden,
                            const qm_client_tensor *router_logits, int return_routing,
                            qm_client_infer_result *out, qm_client_error *err);
void qm_client_infer_result_free(qm_client_infer_result *r); /* members only */

/* Routing supplied by the engine (PROTOCOL.md): topk_ids (QM_CLIENT_I32
 * [T, k'], -1 = no route) and topk_weights (f32/f16/bf16 [T, k']) are used
 * exactly as given, with no router_logits. Both or neither; NULL for both is
 * qm_client_session_infer. */
int qm_client_session_infer_routed(qm_client *c, const char *session, uint64_t layer,
                                   const qm_client_tensor *hidden,
                                   const qm_client_tensor *topk_ids,
                                   const qm_client_tensor *topk_weights, int return_routing,
                                   qm_client_infer_result *out, qm_client_error *err);

/* ---- shared-memory tensors (zero copy) ----
 * A map is a sealed memfd this process creates and maps, handed to qmoed by
 * session.map (PROTOCOL.md "Shared-memory tensors"). Tensors written into
 * `data` travel without a copy or base64, and qmoed writes the output of
 * qm_client_session_infer_mapped straight into it. Regions start at
 * multiples of 64 bytes; the client must not change an input region until
 * the call returns. A map lives until qm_client_map_release or until its
 * session closes (then release with c = NULL to drop this process's side). */
typedef struct qm_client_map {
    uint64_t id;       /* the daemon's map id */
    void *data;        /* this process's mapping of the map, page aligned */
    size_t bytes;      /* usable bytes */
    size_t mapped_len; /* bytes rounded up to pages */
    char session[132]; /* the session it belongs to */
} qm_client_map;
/* Creates, seals (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), maps and
 * passes a memfd of `bytes` to `session`. */
int qm_client_map_create(qm_client *c, const char *session, size_t bytes, qm_client_map *out,
                         qm_client_error *err);
/* session.unmap (skipped when c is NULL), then unmaps here; accepts an
 * empty or NULL map. */
int qm_client_map_release(qm_client *c, qm_client_map *m, qm_client_error *err);

/* A [rows, cols] tensor at `offset` (a multiple of 64) of a map. */
typedef struct qm_client_region {
    qm_client_dtype dtype;
    uint64_t rows, cols;
    uint64_t offset;
} qm_client_region;

typedef struct qm_client_mapped_infer {
    const char *session;
    uint64_t layer;
    const qm_client_map *map;              /* every region below lies in it */
    qm_client_region hidden;               /* [T, H] */
    const qm_client_region *router_logits; /* [T, E], or NULL */
    /* Routing supplied by the engine: i32 ids [T, k'] (dtype 3, QM_CLIENT_I32)
     * and weights [T, k'], both or neither (PROTOCOL.md). */
    const qm_client_region *topk_ids;
    const qm_client_region *topk_weights;
    uint64_t output_offset; /* the output ([T, H], hidden's dtype) is written here */
} qm_client_mapped_infer;
/* session.infer with every tensor in the map and output_to it: on 0 the
 * output is in the map at output_offset; `stats` may be NULL. Through the
 * session's call ring when the handle has one (below), else the socket:
 * the same checks, errors, output bits and stats either way. A map the
 * daemon no longer holds while the session lives on (it reclaims one whose
 * connection has been closed for session_orphan_timeout_s while another
 * connection keeps the session) is passed again from the memfd the handle
 * keeps (with a reconnect window, below), its id rewritten in *req->map,
 * and the call retried once. */
int qm_client_session_infer_mapped(qm_client *c, const qm_client_mapped_infer *req,
                                   qm_client_infer_stats *stats, qm_client_error *err);

/* ---- across a daemon restart ----
 * When a layer call (qm_client_session_infer, _infer_routed,
 * _infer_mapped) finds the daemon gone (QM_CLIENT_EIO: the connection was
 * reset or closed mid-call; QM_CLIENT_ENOTRUNNING: nothing listens), the
 * handle reconnects with a bounded backoff (20 ms doubling to 500 ms) for up
 * to `window_ms`, makes the model available again (model.load of the bank
 * qm_client_set_model_bank or qm_client_model_load named for it, else it
 * waits for an operator's load within the same window), re-creates the
 * session under its id with the options it was created with and the
 * residency its last session.plan showed (PROTOCOL.md session.create
 * `session` and `warm`), passes every map of the session again (the same
 * memfd, so `data` does not move; the map's `id` is rewritten in the
 * caller's qm_client_map, which must therefore stay where
 * qm_client_map_create wrote it), and retries the failed call once. Only
 * when the window passes does the call fail, with the error it met first.
 * A daemon that still has the session (only the connection broke) keeps
 * it: the call is retried on a new connection. Sessions this handle
 * created are re-created; adopted ones are not (their options are not
 * known here), nor a mapped call whose output_to overlaps an input region
 * (a daemon that died while writing it may have changed the input).
 *
 * Residency: after a successful layer call on a session with experts paged,
 * the handle asks session.plan at most every `warm_interval_ms` and
 * remembers which experts were resident (0: after every call; < 0: never).
 * Defaults: window_ms from $QMOED_RECONNECT_S (seconds; 0 turns reconnection
 * off) else QM_CLIENT_DEFAULT_RECONNECT_MS; warm_interval_ms from
 * $QMOED_WARM_INTERVAL_S (seconds; negative: never) else
 * QM_CLIENT_DEFAULT_WARM_INTERVAL_MS. `log`, when set, receives one line per
 * step (the daemon gone, the session back and what that took, giving up),
 * without a newline; it runs on the calling thread. */
#define QM_CLIENT_DEFAULT_RECONNECT_MS 30000
#define QM_CLIENT_DEFAULT_WARM_INTERVAL_MS 1000
typedef struct qm_client_reconnect {
    int window_ms;        /* how long a call keeps trying; 0: reconnection off */
    int warm_interval_ms; /* how often residency is read (0: every call, < 0: never) */
    void (*log)(void *ud, const char *line);
    void *log_ud;
} qm_client_reconnect;
void qm_client_get_reconnect(qm_client *c, qm_client_reconnect *out);
void qm_client_set_reconnect(qm_client *c, const qm_client_reconnect *r); /* NULL: defaults */
/* The bank file the handle may model.load (admin) as `model` when a
 * restarted daemon lacks it; qm_client_model_load on the handle records the
 * same. `bank_path` NULL forgets it. QM_CLIENT_ENOMEM or 0. */
int qm_client_set_model_bank(qm_client *c, const char *model, const char *bank_path,
                             qm_client_error *err);
/* How many times the handle brought a session back (a generation count). */
uint64_t qm_client_restores(qm_client *c);

/* ---- the call ring ----
 * A session's call ring (PROTOCOL.md "session.ring"): one page of shared
 * memory, opened over the socket, through which
 * qm_client_session_infer_mapped hands the daemon its call and takes the
 * answer, with no JSON and no hop through the daemon's loop thread: this
 * thread writes the call and rings a futex word, one thread of the daemon
 * computes and rings back. Each side spins about as long as it expects to
 * wait, when that is shorter than a wake-up, and otherwise sleeps.
 *
 * A ring lives with the connection it was opened on and its session. A
 * daemon that died, or a connection that broke, is reported as on the
 * socket (QM_CLIENT_EIO, the handle reconnects at its next call); a
 * session closed or a daemon draining as the socket would answer
 * (not_found, shutting_down).
 *
 * qm_client_session_ring: opens the session's ring on this handle (again
 * after a reconnect: one call). The daemon's error when it refuses, among
 * them -32601 from a daemon without rings; the handle then keeps to the
 * socket for the session.
 *
 * qm_client_set_ring: QM_CLIENT_RING_AUTO (the default, unless QMOE_RING=0
 * is in the environment when the handle is opened): infer_mapped opens the
 * ring itself the first time it is called for a session (and again after
 * a reconnect), and a refusal sends that session's calls through the
 * socket with one line on stderr; QM_CLIENT_RING_EXPLICIT: only rings
 * opened by qm_client_session_ring; QM_CLIENT_RING_OFF: the socket always.
 *
 * qm_client_ring_active: 1 when infer_mapped for `session` takes a ring
 * now, 0 when it takes the socket.
 *
 * qm_client_set_ring_anticipate: on (1), the rings this handle opens from
 * then on ask the daemon to anticipate their calls (session.ring's
 * `anticipate`: its thread wakes ahead of each call the ring's per-layer
 * tempo says is due and spins for it, so that a steady decode's call wakes
 * no one; it costs the daemon CPU while it spins: for an engine that
 * leaves a CPU idle between its calls). A daemon older than the member
 * refuses it naming the field: the ring is then opened without it. Off (0)
 * by default. */
enum { QM_CLIENT_RING_OFF = 0, QM_CLIENT_RING_AUTO = 1, QM_CLIENT_RING_EXPLICIT = 2 };
int qm_client_session_ring(qm_client *c, const char *session, qm_client_error *err);
void qm_client_set_ring(qm_client *c, int mode);
int qm_client_ring_active(qm_client *c, const char *session);
void qm_client_set_ring_anticipate(qm_client *c, int on);

/* ---- telemetry ---- */
typedef struct qm_client_counters {
    uint64_t requests, errors, tokens, expert_hits, expert_misses, bytes_paged_h2d;
    uint64_t evictions, prefetch_issued, prefetch_useful, resident_bytes;
    uint64_t expert_host_runs; /* 0 from a daemon without hybrid execution */
    double p50_us, p99_us;
    /* Prefetch prediction per source (router, history, lookahead): experts
     * predicted, of them used by the call they were about, the experts those
     * calls used, and calls the source was off (docs/PROTOCOL.md; 0 from a
     * daemon without them). Precision = correct / predicted, recall =
     * correct / actual. */
    uint64_t predict_router_predicted, predict_router_correct, predict_router_actual;
    uint64_t predict_router_gated;
    uint64_t predict_history_predicted, predict_history_correct, predict_history_actual;
    uint64_t predict_history_gated;
    uint64_t predict_lookahead_predicted, predict_lookahead_correct, predict_lookahead_actual;
    uint64_t predict_lookahead_gated;
    /* Direct disk paging (0 from a daemon without them): bytes read, time
     * waited for units to land, time the disk had reads in flight,
     * inferences with reads in flight and the sum of each one's most in
     * flight at once, the most at once; prefetch reads parked part way
     * because the call they guessed for did not ask for their expert. */
    uint64_t bytes_read_disk, stall_us, disk_busy_us, read_calls, reads_in_flight_sum,
        reads_in_flight_peak, prefetch_parked;
} qm_client_counters;

typedef struct qm_client_session_counters {
    char *session, *model;
    qm_client_counters counters;
} qm_client_session_counters;

typedef struct qm_client_telemetry {
    int has_daemon; /* 1 when asked without a session */
    qm_client_counters daemon;
    qm_client_session_counters *sessions;
    size_t n_sessions;
} qm_client_telemetry;
/* `session` NULL: daemon-wide counters and every visible session. */
int qm_client_telemetry_get(qm_client *c, const char *session, qm_client_telemetry *out,
                            qm_client_error *err);
void qm_client_telemetry_free(qm_client_telemetry *t); /* members only */

typedef struct qm_client_span {
    char *name;
    double start_us, dur_us;
    char *session;   /* NULL when the span belongs to no session */
    char *args_json; /* the span's args object as compact JSON text */
} qm_client_span;
/* `session` may be NULL, `limit` 0 means the daemon's default. */
int qm_client_telemetry_trace(qm_client *c, const char *session, uint64_t limit,
                              qm_client_span **spans, size_t *count, qm_client_error *err);
void qm_client_spans_free(qm_client_span *spans, size_t count);

/* Prometheus text; *text is malloc'd (qm_client_string_free). */
int qm_client_telemetry_metrics(qm_client *c, char **text, qm_client_error *err);

int qm_client_daemon_shutdown(qm_client *c, qm_client_error *err);

/* Static names for codes ("not_running", "invalid_params", ...). */
const char *qm_client_error_name(int code);

#ifdef __cplusplus
}
#endif
#endif
