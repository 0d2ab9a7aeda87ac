/* qm_wire_schema.h - the wire as data: every method, its params as rows
 * (member, type, required, bounds, where it lands in qm_params, what it
 * means), and qm_params itself. The one place a method's params are
 * written: the decoder walks these rows (qm_params.c), `qmoectl methods`
 * prints them, docs/PROTOCOL.md's params tables are generated from them
 * and tests/protocol checks the two agree; the clients' calls are checked
 * against them by decoding what the clients send (tests/clients).
 *
 * A new method: its X line in QM_METHOD_MAP, its rows (QM_PARAMS_*), the
 * fields they land in; then its row in daemon/ and its doc table.
 *
 * Included by qm_protocol.h, which defines the types the rows name. */
#ifndef QM_WIRE_SCHEMA_H
#define QM_WIRE_SCHEMA_H

/* ---- the methods ----------------------------------------------------------------
 * X(ENUM, "wire.name", PARAMS, "summary"): QM_PARAMS_<PARAMS> lists its rows. */
#define QM_METHOD_MAP(X)                                                                           \
    X(DAEMON_STATUS, "daemon.status", NONE, "the daemon's version, uptime, devices and counts")   \
    X(DAEMON_SHUTDOWN, "daemon.shutdown", NONE, "drain and exit, as SIGTERM does")                \
    X(MODEL_LOAD, "model.load", MODEL_LOAD, "map a bank file as a model")                          \
    X(MODEL_UNLOAD, "model.unload", MODEL_UNLOAD, "unload a model")                                \
    X(MODEL_LIST, "model.list", NONE, "the loaded models")                                         \
    X(SESSION_CREATE, "session.create", SESSION_CREATE, "a session on a model")                    \
    X(SESSION_CLOSE, "session.close", BY_SESSION, "close a session")                               \
    X(SESSION_LIST, "session.list", NONE, "the caller's sessions (every session for an admin)")   \
    X(SESSION_PLAN, "session.plan", BY_SESSION, "a session's residency plan and residency now")   \
    X(SESSION_RESIZE, "session.resize", SESSION_RESIZE, "change a live session's budget")          \
    X(SESSION_INFER, "session.infer", SESSION_INFER, "one MoE layer's feed-forward")               \
    X(SESSION_MAP, "session.map", SESSION_MAP, "hand the daemon a shared-memory file")             \
    X(SESSION_UNMAP, "session.unmap", SESSION_UNMAP, "take a shared-memory file back")             \
    X(SESSION_RING, "session.ring", SESSION_RING, "open the session's call ring")                  \
    X(TELEMETRY_GET, "telemetry.get", TELEMETRY_GET, "counters, daemon-wide and per session")     \
    X(TELEMETRY_TRACE, "telemetry.trace", TELEMETRY_TRACE, "recent trace spans")                   \
    X(TELEMETRY_METRICS, "telemetry.metrics", NONE, "the counters as Prometheus text")

/* ---- the rows -------------------------------------------------------------------
 * P(member, TYPE, required, lo, hi, lands, has, more, "what it means")
 *   TYPE   STRING (lo..hi bytes of UTF-8), NAME (a STRING of [A-Za-z0-9._-]),
 *          POLICY (a STRING naming a policy: the residency registry's offered
 *          ones are listed from it; the daemon checks the name),
 *          FILENAME (a STRING naming a file: no '/', not "." or ".."),
 *          UINT / UINT32 (an integer lo..hi, landing in a uint64_t / uint32_t),
 *          BOOL, ENUM (one of the names `more` gives; lands its index),
 *          TENSOR (rank lo, dtypes hi: QM_WIRE_DT_*), OBJECT (the rows
 *          `more` gives), HOT (a [{layer, experts}] list, landing where its count
 *          follows it: policy_params.hot, warm), CHECK (no member:
 *          a rule across the members decoded so far, `more`'s function)
 *   lands  AT(field of qm_params) or NOWHERE;  has: AT(flag set when given) or NOWHERE
 *   more   NAMES(enum), ROWS(object), FN(function) or NONE
 * Members are decoded in row order; unknown and duplicate members are
 * errors naming the member (an OBJECT may take more, as policy_params
 * takes the policies' knobs: QM_WIRE_OBJECTS). */

/* Wire dtypes a TENSOR row takes. */
#define QM_WIRE_DT_FLOAT 1u /* f32, f16, bf16 */
#define QM_WIRE_DT_I32 2u

#define QM_PARAMS_NONE(P)

#define QM_PARAMS_BY_SESSION(P)                                                                    \
    P("session", STRING, 1, 1, 128, AT(session), NOWHERE, NONE, "the session's id")

#define QM_PARAMS_MODEL_LOAD(P)                                                                    \
    P("name", NAME, 1, 1, QM_NAME_MAX, AT(name), NOWHERE, NONE,                                    \
      "the model's name (a Prometheus label)")                                                     \
    P("path", STRING, 1, 1, 4095, AT(path), NOWHERE, NONE,                                         \
      "the bank file, opened by the daemon with its own permissions")

#define QM_PARAMS_MODEL_UNLOAD(P)                                                                  \
    P("name", STRING, 1, 1, QM_NAME_MAX, AT(name), NOWHERE, NONE, "the model's name")              \
    P("force", BOOL, 0, 0, 0, AT(force), NOWHERE, NONE, "close its sessions first")

#define QM_PARAMS_SESSION_CREATE(P)                                                                \
    P("model", STRING, 1, 1, QM_NAME_MAX, AT(model), NOWHERE, NONE, "a loaded model's name")       \
    P("policy", POLICY, 0, 1, 32, AT(policy), NOWHERE, NONE,                                       \
      "the residency policy (the first, when absent); the daemon refuses one not offered")         \
    QM_PARAMS_BUDGET(P, 0)                                                                         \
    P("policy_params", OBJECT, 0, 0, 0, AT(policy_params), AT(has_policy_params),                  \
      ROWS(POLICY_PARAMS), "the session's paging and its policy's knobs")                          \
    P("precision", ENUM, 0, 0, 0, AT(precision), NOWHERE, NAMES(PRECISION),                        \
      "exact (f32) or fast (int8 activations, integer dot products)")                              \
    P("session", STRING, 0, 1, 128, AT(session), NOWHERE, NONE,                                    \
      "re-create a session under this id, one session.create gave (after a restart)")              \
    P("", CHECK, 0, 0, 0, NOWHERE, NOWHERE, FN(qm__check_session_id),                              \
      "session: 32 lowercase hex digits")                                                          \
    P("warm", HOT, 0, 0, QM_HOT_MAX, AT(warm), NOWHERE, FN(qm__decode_warm),                       \
      "[{layer, experts}]: loaded before the answer (a re-created session's old residency)")       \
    QM_PARAMS_CLIENT_PENDING(P)

#define QM_PARAMS_POLICY_PARAMS(P)                                                                 \
    P("prefetch", BOOL, 0, 0, 0, AT(policy_params.prefetch), AT(policy_params.has_prefetch), NONE, \
      "prefetch the next layer's predicted experts (default true)")                                \
    P("min_split_bytes", UINT, 0, 0, UINT64_MAX, AT(policy_params.min_split_bytes),                \
      AT(policy_params.has_min_split_bytes), NONE,                                                 \
      "a bank whose expert unit is smaller stays whole")                                           \
    P("hot", HOT, 0, 0, QM_HOT_MAX, AT(policy_params.hot), NOWHERE, FN(qm__decode_hot),                          \
      "[{layer, experts: hottest first}]: the pins of a policy that takes them")                   \
    P("record_trace", FILENAME, 0, 1, 255, AT(policy_params.record_trace), NOWHERE, NONE,          \
      "a file in the state dir the session's routing is recorded to")                              \
    P("on_miss", ENUM, 0, 0, 0, AT(policy_params.on_miss), AT(policy_params.has_on_miss),          \
      NAMES(ON_MISS), "what a non-resident expert does: paged in, run on the host, or either")     \
    P("share_residency", BOOL, 0, 0, 0, AT(policy_params.share_residency),                         \
      AT(policy_params.has_share_residency), NONE,                                                 \
      "draw experts from one pool with the model's sessions that share")                           \
    P("warm_from_profile", BOOL, 0, 0, 0, AT(policy_params.warm_from_profile),                     \
      AT(policy_params.has_warm_from_profile), NONE,                                               \
      "start from the model's hottest experts (default: the daemon's warm_from_profile)")

#define QM_PARAMS_SESSION_RESIZE(P)                                                                \
    QM_PARAMS_BY_SESSION(P)                                                                        \
    QM_PARAMS_BUDGET(P, 1)                                                                         \
    QM_PARAMS_CLIENT_PENDING(P)

/* What an auto budget leaves free for the client (session.create, and
 * session.resize to "auto"); after the budget's rows, whose form it checks. */
#define QM_PARAMS_CLIENT_PENDING(P)                                                                \
    P("client_pending_bytes", UINT, 0, 0, UINT64_MAX, AT(client_pending_bytes),                    \
      AT(has_client_pending_bytes), NONE,                                                          \
      "with budget \"auto\": memory the client takes after this call (its KV cache, buffers, "     \
      "weights it maps and has not read), left free beside the reserve")                           \
    P("", CHECK, 0, 0, 0, NOWHERE, NOWHERE, FN(qm__check_client_pending),                          \
      "client_pending_bytes only with budget \"auto\"")

/* A session's budget (session.create: optional, default the model's
 * bytes_total; session.resize: one of the two required). */
#define QM_PARAMS_BUDGET(P, req)                                                                   \
    P("budget", BUDGET, 0, 1, UINT64_MAX, AT(budget), AT(has_budget), FN(qm__decode_budget),       \
      "expert bytes the session may keep resident: bytes, \"N%\" of the model's expert bytes, "    \
      "or \"auto\" (sized from the memory this machine and its cgroup give)")                      \
    P("budget_bytes", UINT, 0, 1, UINT64_MAX, AT(budget_bytes), AT(has_budget_bytes), NONE,        \
      "the budget as bytes (the older member; not with budget)")                                   \
    P("", CHECK, 0, 0, 0, NOWHERE, NOWHERE, FN(qm__check_budget##req), QM__BUDGET_RULE_##req)
#define QM__BUDGET_RULE_0 "budget or budget_bytes, not both"
#define QM__BUDGET_RULE_1 "budget or budget_bytes, one of them"

#define QM_PARAMS_SESSION_INFER(P)                                                                 \
    QM_PARAMS_BY_SESSION(P)                                                                        \
    P("layer", UINT32, 1, 0, UINT32_MAX, AT(layer), NOWHERE, NONE, "the bank layer")               \
    P("hidden", TENSOR, 1, 2, QM_WIRE_DT_FLOAT, AT(hidden), NOWHERE, NONE,                         \
      "the hidden states [T, hidden_size]")                                                        \
    P("router_logits", TENSOR, 0, 2, QM_WIRE_DT_FLOAT, AT(router_logits),                          \
      AT(has_router_logits), NONE, "[T, experts]; omitted: the bank's router computes them")       \
    P("topk_ids", TENSOR, 0, 2, QM_WIRE_DT_I32, AT(topk_ids), AT(has_topk_ids), NONE,              \
      "the engine's routing: i32 expert ids [T, k'], -1 = no route")                               \
    P("topk_weights", TENSOR, 0, 2, QM_WIRE_DT_FLOAT, AT(topk_weights), AT(has_topk_weights),      \
      NONE, "the engine's routing: weights [T, k'], used as given")                                \
    P("", CHECK, 0, 0, 0, NOWHERE, NOWHERE, FN(qm__check_topk),                                    \
      "topk_ids and topk_weights both or neither")                                                 \
    P("", CHECK, 0, 0, 0, NOWHERE, NOWHERE, FN(qm__check_shapes),                            \
      "shapes agree with hidden; router_logits never with topk")                                   \
    P("return_routing", BOOL, 0, 0, 0, AT(return_routing), NOWHERE, NONE,                          \
      "answer each token's [expert, weight] routes too")                                           \
    P("output_to", OBJECT, 0, 0, 0, NOWHERE, AT(has_output_to), ROWS(OUTPUT_TO),                   \
      "write the output into a map's region instead of answering it in base64")

#define QM_PARAMS_OUTPUT_TO(P)                                                                     \
    P("map", UINT, 1, 0, UINT64_MAX, AT(output_map), NOWHERE, NONE, "a map of the session")        \
    P("offset", UINT, 1, 0, UINT64_MAX, AT(output_offset), NOWHERE, NONE,                          \
      "where in the map, a multiple of 64")                                                        \
    P("", CHECK, 0, 0, 0, NOWHERE, NOWHERE, FN(qm__check_output_offset),                           \
      "offset a multiple of 64")

#define QM_PARAMS_SESSION_MAP(P)                                                                   \
    QM_PARAMS_BY_SESSION(P)                                                                        \
    P("bytes", UINT, 1, 1, UINT64_MAX, AT(bytes), NOWHERE, NONE,                                   \
      "the map's size; one sealed memfd comes with the request's first byte")

#define QM_PARAMS_SESSION_UNMAP(P)                                                                 \
    QM_PARAMS_BY_SESSION(P)                                                                        \
    P("map", UINT, 1, 0, UINT64_MAX, AT(map), NOWHERE, NONE, "the map's id")

#define QM_PARAMS_SESSION_RING(P)                                                                  \
    QM_PARAMS_BY_SESSION(P)                                                                        \
    P("anticipate", BOOL, 0, 0, 0, AT(anticipate), NOWHERE, NONE,                                  \
      "wake ahead of each call expected from the ring's tempo and spin for it: for an engine "    \
      "that leaves a CPU idle")

#define QM_PARAMS_TELEMETRY_GET(P)                                                                 \
    P("session", STRING, 0, 1, 128, AT(session), NOWHERE, NONE,                                    \
      "one session's counters (default: the daemon's and every visible session's)")

#define QM_PARAMS_TELEMETRY_TRACE(P)                                                               \
    P("session", STRING, 0, 1, 128, AT(session), NOWHERE, NONE,                                    \
      "only this session's spans")                                                                 \
    P("limit", UINT32, 0, 0, UINT32_MAX, AT(limit), AT(has_limit), NONE,                           \
      "at most the newest this many")

/* Objects inside params, and what else each takes beyond its rows:
 * O(ROWS, "what else") with QM_PARAMS_<ROWS>; KNOBS: every knob some
 * offered policy declares (residency registry), range-checked by it. */
#define QM_WIRE_OBJECTS(O)                                                                         \
    O(POLICY_PARAMS, KNOBS)                                                                        \
    O(OUTPUT_TO, NO_MORE)

/* The names ENUM rows take; a row lands the index. Each list must equal its
 * registry where one exists: PRECISION is engine's qm_precision (exact 0,
 * fast 1), ON_MISS the pager's qm_on_miss_at (tests/daemon walks both). */
#define QM_WIRE_ENUMS(E)                                                                           \
    E(PRECISION, "exact", "fast")                                                                  \
    E(ON_MISS, "page", "host", "auto")

/* ---- where params land ------------------------------------------------------------ */

#define QM_SESSION_ID_LEN 32 /* 128 bits as lowercase hex */
#define QM_NAME_MAX 64       /* model names: [A-Za-z0-9._-]{1,64} */

#define QM_POLICY_VALUES_MAX 16 /* numeric knobs in one policy_params */
#define QM_HOT_MAX 65536 /* entries of policy_params.hot, and experts in each */

typedef struct qm_hot_layer {
    uint32_t layer;
    uint32_t *experts; /* hottest first, distinct */
    size_t n_experts;
} qm_hot_layer;

/* One policy knob of policy_params; `name` is the residency registry's own
 * string (static), so the daemon passes it on as a qm_policy_value. */
typedef struct qm_policy_value_wire {
    const char *name;
    double value;
} qm_policy_value_wire;

typedef struct qm_policy_params_wire {
    int has_prefetch, prefetch;
    int has_warm_from_profile, warm_from_profile;
    int has_min_split_bytes;
    uint64_t min_split_bytes;
    /* The policy's numeric knobs (decay, pin_fraction, ...): every member
     * that some offered policy declares (qm_policy_param_find), checked
     * against that declaration's range; names are the registry's. Whether
     * the chosen policy takes them is the daemon's check. */
    qm_policy_value_wire values[QM_POLICY_VALUES_MAX];
    size_t n_values;
    qm_hot_layer *hot; /* NULL when absent */
    size_t n_hot;
    char *record_trace; /* NULL when absent */
    /* What a non-resident expert does (hybrid execution, docs/PAGING.md):
     * the index of its name in QM_WIRE_ENUMS' ON_MISS, the pager's value. */
    int has_on_miss, on_miss;
    /* share_residency: draw experts from the pool of the model's sessions
     * that share (docs/PAGING.md "Shared residency"). */
    int has_share_residency, share_residency;
} qm_policy_params_wire;

/* Strings are owned by the request (qm_request_free). */
typedef struct qm_params {
    char *name, *path;       /* model.load; name also model.unload */
    int force;               /* model.unload */
    char *model;             /* session.create */
    char *policy;            /* session.create; NULL = whole_bank */
    int has_budget;          /* a budget given, in either member */
    int has_budget_bytes;    /* budget_bytes given */
    uint64_t budget_bytes;   /* session.create (optional), session.resize (required); the
                              * bytes when budget.form is QM_BUDGET_BYTES, else the daemon's
                              * to fill (daemon/qm_budget.h) */
    qm_budget_spec budget;   /* the form given, by `budget` or `budget_bytes` */
    int has_policy_params;
    qm_policy_params_wire policy_params;
    int precision;           /* session.create: QM_WIRE_ENUMS' PRECISION index, 0 exact */
    char *session;           /* close, plan, infer, resize, ring; optional for telemetry.* and
                              * session.create (an id to re-create a session under) */
    qm_hot_layer *warm;      /* session.create: experts to load first (NULL: none) */
    size_t n_warm;
    int has_client_pending_bytes;
    uint64_t client_pending_bytes; /* session.create, session.resize with budget "auto": what
                                    * the client takes after the call, left free
                                    * (daemon/qm_budget.h) */
    uint32_t layer;          /* infer */
    qm_tensor hidden;        /* infer: shape [T, H] */
    int has_router_logits;
    qm_tensor router_logits; /* infer: shape [T, E] */
    int has_topk_ids, has_topk_weights;
    int has_topk;            /* infer: routing supplied by the engine (both tensors) */
    qm_tensor topk_ids;      /* infer: i32 [T, k'], k' >= 1 */
    qm_tensor topk_weights;  /* infer: f32/f16/bf16, the shape of topk_ids */
    int return_routing;
    int has_output_to;       /* infer: output_to {map, offset} */
    uint64_t output_map, output_offset;
    uint64_t bytes;          /* session.map */
    uint64_t map;            /* session.unmap */
    int anticipate;          /* session.ring */
    int has_limit;
    uint32_t limit;          /* telemetry.trace */
} qm_params;

#endif
