/* qm_pager.h - the paging authority: the single owner of a session's device memory.
 *
 * One pager per session. It carves ONE arena (qm_arena_new) into whole-bank
 * regions and fixed-size expert slots, keeps the map expert -> slot per layer,
 * accounts resident bytes exactly against the budget, copies units from the
 * mapped bank through the backend's copy path (with fences), pins the plan's
 * pinned experts, asks the session's policy for victims (validating every
 * answer, falling back to LRU for that choice), prefetches predicted experts
 * and serves qm_moe_forward through a qm_expert_source.
 * The contract is ../shared/RESIDENCY.md; docs/PAGING.md explains the design.
 *
 * Threading: a pager is used by one thread at a time (a session's requests
 * run in order); that includes qm_pager_stats_get and
 * qm_pager_resident_experts, so read them on the session's thread or under
 * the session's lock. It may own one internal copy thread (see copy_thread),
 * or, with the disk source, its I/O engine's threads (see io_engine). */
#ifndef QM_PAGER_H
#define QM_PAGER_H

#include <stddef.h>
#include <stdint.h>

#include "qm_backend.h"
#include "qm_bank.h"
#include "qm_moe.h"
#include "qm_residency.h"

typedef struct qm_pager qm_pager;

typedef struct qm_pager_options {
    /* 1: after each qm_pager_forward, prefetch the experts predicted for the
     * next layer call (routing history + next layer's router). Default on in
     * the daemon (policy_params.prefetch); a zeroed struct means off. */
    int prefetch;
    /* Requests of routing history per layer used for prediction (0 = 1). */
    uint32_t history;
    /* Upper bound of experts prefetched per forward call (0 = 2 * k * tokens,
     * capped by the evictable slots). */
    uint32_t max_prefetch;
    /* Prefetch gating: a prediction source (next layer's router, routing
     * history, the lookahead router) whose measured precision (experts
     * predicted that the call they were about used, over its last 128
     * predicted) is below this is switched off and re-probed on one call in
     * 8. 0 = default 0.5; negative = never gate the router and the
     * history (the lookahead, off until measured, then gates at 0.5). */
    double prefetch_min_precision;
    /* Whether prefetch pays on this session, timed (qm_pager_trial.h):
     * windows with prefetch fetched and held alternate, then the faster
     * mode is kept for a while and measured again. 0 = automatic: on with
     * the disk source (a wasted prefetch is a disk read), off otherwise; 1
     * = on; 2 = off. Explicit qm_pager_prefetch calls are never held. */
    int prefetch_trial;
    /* 1: never preload. By default, when the budget holds every expert
     * (or there is none), all of them are loaded at creation so the session
     * never misses; they stay evictable. */
    int no_preload;
    /* Copy thread: -1 or 0 = automatic (on for host-visible backends, whose
     * copies are synchronous memcpy: the thread makes them overlap compute),
     * 1 = force on, 2 = force off. The disk source's I/O engine (io_engine
     * other than serial) reads by itself and runs no copy thread. */
    int copy_thread;
    /* 1: copy whole banks into the arena even on host-visible backends
     * (default 0: host-visible backends read whole banks straight from the
     * mapping; their bytes still count against the budget). */
    int copy_whole_banks;
    /* 1: a fast session's whole banks on a host-visible backend (the CPU)
     * are copied into the arena with every 4-bit weight tensor the layout
     * takes in the r8 layout (engine/kernels/qm_r8.h), the fast decode GEMV's,
     * when this process's fast kernel reads it natively
     * (qm__i8kernel_r8_native) and the bank's expert bytes fit in half the
     * RAM; otherwise nothing changes. Outputs are the same bits either way
     * (exact kernels and prefill GEMMs get row-major tiles back). The
     * daemon sets it for fast sessions of their own (docs/PAGING.md). */
    int interleave;
    /* Where units come from (qm_pager_disk.c). QM_PAGER_SOURCE_MMAP (0):
     * copied from the bank's mapping (the page cache). QM_PAGER_SOURCE_DIRECT:
     * read from the bank file with O_DIRECT straight into the slots (whole
     * banks are read into the arena too, so compute never reads expert
     * weights from the mapping), the arena locked with mlock where
     * permitted. Direct needs a host-visible backend, a bank opened from a
     * file and a filesystem that takes O_DIRECT; otherwise the pager falls
     * back to MMAP and says why (qm_pager_source_info). */
    int source;
    /* What a demand miss does (policy_params.on_miss; docs/PAGING.md,
     * "Hybrid execution"): QM_ON_MISS_PAGE copies the expert in (the zero
     * value); QM_ON_MISS_HOST runs every non-resident expert on the host
     * CPU kernels straight from the bank mapping; QM_ON_MISS_AUTO chooses
     * per expert and call from its rows and the measured costs of copying,
     * host and device compute (qm_hybrid.c). */
    int on_miss;
    /* The backend host runs use (borrowed). NULL: the backend itself when
     * it is host visible, else a CPU backend of `host_threads` workers
     * (0 = every core) that the pager makes and owns. */
    qm_backend *host_backend;
    uint32_t host_threads;
    /* Several devices (qm_placement.h): [layers] 1 for the layers this
     * pager serves, NULL = all. The others are absent here: nothing of
     * theirs is loaded, accounted or paged, and a forward call for one is
     * QM_EINVAL. */
    const uint8_t *layer_mask;
    /* The budget this pager keeps, in place of the plan's (0 = the plan's):
     * a device's share of the session's budget. */
    uint64_t budget_bytes;
    /* How the disk source reads (qm_pager_io.c; the daemon's io_engine):
     * QM_PAGER_IO_AUTO (0) io_uring where the kernel allows it, else a pool
     * of preadv threads (why: qm_pager_io_info); QM_PAGER_IO_THREADS the
     * pool; QM_PAGER_IO_SERIAL the engine before it: one read at a time on
     * the copy thread, and a call waits for every miss before computing.
     * With io_uring or the pool every miss of a call is read at once and
     * the call computes its resident experts while they land. */
    int io_engine;
    /* Reads in flight at most (0 = QM_PAGER_IO_DEPTH_DEFAULT; at most
     * QM_PAGER_IO_DEPTH_MAX, 64 for the pool); prefetch reads go out only
     * while no demand read is queued or in flight, 2 at most. */
    uint32_t io_depth;
    /* 1: qm_pager_forward leaves its prefetch (the next layers' router
     * GEMVs and the reads they issue: 50-90 us of a paged T = 1 call on
     * the e2e shapes) for qm_pager_after_forward, which the caller runs
     * once the call's answer is out, off the engine's wait; the pager runs
     * it itself first when the next forward, prefetch, warm or resize
     * comes before. The call's hidden states are copied (the caller's may
     * change once answered). The daemon sets it; 0 prefetches inside
     * qm_pager_forward. Outputs never change either way. */
    int defer_prefetch;
    /* qm_pager_tidy's piece of a paged unit's r8 layout, bytes (0 = 2 MiB;
     * at least one tile of 16 rows). Tests make it small to walk every
     * partial layout. */
    uint32_t r8_piece_bytes;
    /* 1: a prefetch read of the disk source's I/O engine reads on when the
     * next call of its layer does not ask for its expert (the engine before
     * 2026-12-07). By default (0) it is parked there: nothing more of it is
     * read unless a call asks for the expert or a prediction names it
     * again, and an eviction gives its slot back without the rest, so the
     * disk goes to the call's misses (docs/PAGING.md, "The disk source"). */
    int keep_unasked_prefetch;
} qm_pager_options;

enum { QM_PAGER_IO_AUTO = 0, QM_PAGER_IO_URING, QM_PAGER_IO_THREADS, QM_PAGER_IO_SERIAL };
#define QM_PAGER_IO_DEPTH_DEFAULT 32u
#define QM_PAGER_IO_DEPTH_MAX 1024u

/* QM_PAGER_SOURCE_AUTO is the daemon's choice, never a pager's: direct for
 * a session with per-expert banks on a host-visible backend, else mmap. */
enum { QM_PAGER_SOURCE_MMAP = 0, QM_PAGER_SOURCE_DIRECT = 1, QM_PAGER_SOURCE_AUTO = 2 };

enum { QM_ON_MISS_PAGE = 0, QM_ON_MISS_HOST = 1, QM_ON_MISS_AUTO = 2 };

/* The registries of the options' names (qm_pager_options.c), the one list
 * of each, in the order they are shown: on_miss "page", "host", "auto";
 * paging sources "auto", "mmap", "direct"; I/O engines "auto", "io_uring"
 * (asked for, the same as auto: what auto runs where it can), "threads",
 * "serial". _name: a value's name (NULL for another value); _parse: a
 * name's value (-1 unknown); _at: the i-th name and its value (NULL past
 * the last). */
const char *qm_on_miss_name(int on_miss);
int qm_on_miss_parse(const char *name);
const char *qm_on_miss_at(size_t i, int *value);
const char *qm_pager_source_name(int source);
int qm_pager_source_parse(const char *name);
const char *qm_pager_source_at(size_t i, int *value);
const char *qm_pager_io_name(int engine);
int qm_pager_io_parse(const char *name);
const char *qm_pager_io_at(size_t i, int *value);

typedef struct qm_pager_stats {
    uint64_t hits;           /* accesses to a paged bank's expert that found it resident */
    uint64_t misses;         /* ... that had to copy it in (a demand copy) */
    uint64_t whole_bank_accesses; /* accesses served by a whole-bank bank (no hit/miss) */
    uint64_t bytes_paged_h2d;     /* every byte copied after creation (demand + prefetch) */
    uint64_t bytes_loaded_at_create; /* whole banks copied + pinned (+ preloaded) experts */
    uint64_t evictions;
    uint64_t prefetch_issued;    /* experts copied in by prefetch */
    uint64_t prefetch_useful;    /* ... of which accessed before being evicted */
    uint64_t resident_bytes;     /* whole banks + resident experts' units, now */
    uint64_t budget_bytes;       /* the budget in force (UINT64_MAX when none) */
    uint64_t waves;          /* acquire rounds that could not hold every requested expert */
    uint64_t policy_fallbacks;   /* victim answers refused/invalid -> LRU used */
    uint64_t budget_violations;  /* allocations refused by the accounting check (0 always) */
    /* Disk source (QM_PAGER_SOURCE_DIRECT) */
    uint64_t disk_bytes_read;    /* bytes read from the bank file (alignment padding included) */
    uint64_t disk_reads;         /* read calls */
    uint64_t disk_errors;        /* units whose read failed (the request failed, not the session) */
    uint64_t stall_us;           /* forward calls waiting for units to land (any source) */
    /* Paged units laid out in the r8 layout after they landed (opt.interleave) */
    uint64_t bytes_interleaved_paged; /* their weight bytes */
    uint64_t units_interleaved_paged;
    /* qm_pager_resize */
    uint64_t resizes;            /* budget changes applied */
    uint64_t pins_released;      /* pins released because a smaller budget could not hold them */
    uint64_t resize_moves;       /* units re-copied into a lower slot when slots were given back */
    /* Prefetch by prediction source (qm_pager_forward): issued / useful. */
    uint64_t prefetch_router_issued, prefetch_router_useful;
    uint64_t prefetch_history_issued, prefetch_history_useful;
    uint64_t prefetch_gated; /* forward calls where a source was skipped as imprecise */
    /* Prefetch reads stopped part way: the next call of their layer did not
     * ask for their expert (opt.keep_unasked_prefetch). */
    uint64_t prefetch_parked;
    /* Each source's prediction measured against the call it was about,
     * resident or not (docs/PAGING.md "Prediction, measured"): experts
     * predicted, of which that call used (`correct`), and the experts those
     * calls used (`actual`): precision = correct / predicted, recall =
     * correct / actual. `gated`: forward calls on which the source was off.
     * Sources: the next layer's router (router), its routing history
     * (history), the router of the layer after next (lookahead). */
    uint64_t predict_router_predicted, predict_router_correct, predict_router_actual;
    uint64_t predict_history_predicted, predict_history_correct, predict_history_actual;
    uint64_t predict_lookahead_predicted, predict_lookahead_correct, predict_lookahead_actual;
    uint64_t predict_router_gated, predict_history_gated, predict_lookahead_gated;
    uint64_t prefetch_lookahead_issued, prefetch_lookahead_useful;
    uint32_t prefetch_sources_off; /* now: bit 0 router, 1 history, 2 lookahead, 3 the trial */
    /* The prefetch trial (qm_pager_trial.h): forward calls whose
     * predictions it held (not fetched); its decisions, of them to hold;
     * what its last one measured, ns per token of a layer call with
     * prefetch fetched and held (0 until measured). */
    uint64_t prefetch_trial_held, prefetch_trial_decisions, prefetch_trial_decisions_held;
    uint64_t prefetch_trial_fetch_ns_per_token, prefetch_trial_held_ns_per_token;
    /* Routing trace (qm_pager_record_trace). */
    uint64_t trace_tokens, trace_dropped, trace_errors;
    uint64_t trace_full; /* 1 once the recording stopped at its max_bytes */
    /* Hybrid execution (on_miss host/auto): accesses to non-resident
     * experts that ran on the host instead of being paged (counted in
     * neither hits nor misses), their rows, and the experts `auto` copied
     * into a free slot after running them on the host (admissions, also in
     * bytes_paged_h2d). */
    uint64_t host_runs, host_rows, host_admits;
    /* auto's cost model now (0 when off): microseconds to copy one expert
     * unit, and to run one expert of one row / per further row on the host
     * and on the device. */
    double model_copy_us, model_host_us, model_host_row_us, model_dev_us, model_dev_row_us;
    /* Fixed at creation. */
    uint64_t arena_bytes;        /* the one device allocation */
    uint64_t slot_bytes;         /* slot size (max unit, aligned) */
    uint32_t n_slots;            /* slots (pins included) */
    uint32_t n_pinned;           /* slots held by pins */
    uint64_t overhead_bytes;     /* arena_bytes minus what the budget counts (alignment padding) */
    uint64_t host_bytes;         /* host-side bookkeeping of the pager */
    uint64_t bytes_prefaulted_at_create; /* whole banks read in place, mapped in at creation */
    uint64_t bytes_interleaved_at_create; /* whole-bank weight bytes laid out r8 (opt.interleave) */
    /* The disk source's I/O engine (qm_pager_io_info says which). The
     * disk's measured read rate is disk_bytes_read / disk_busy_us. */
    uint64_t disk_busy_us;        /* microseconds with at least one read in flight */
    uint64_t read_calls;          /* forward calls with reads in flight while they ran */
    uint64_t reads_in_flight_sum; /* over those calls, the sum of each one's most in flight */
    uint64_t reads_in_flight_peak; /* most reads in flight at once */
} qm_pager_stats;

/* Creates the pager of a session. `backend`, `bank`, `plan` and `policy` are
 * borrowed and must outlive the pager; the pager calls the policy's run-time
 * hooks. Loads whole banks (copying them when the backend is not host
 * visible) and the pinned experts before returning. Errors:
 * QM_ERESOURCE_EXHAUSTED when the budget is below the minimum (whole banks +
 * pins + one expert unit), with the minimum in st->msg and field
 * "budget_bytes"; QM_EINVAL for a plan that does not match the bank;
 * QM_ENOMEM / QM_EDEVICE from allocation. `options` may be NULL. */
int qm_pager_new(qm_backend *backend, const qm_bank *bank, const qm_residency_plan *plan,
                 const qm_policy *policy, const qm_pager_options *options, qm_pager **out,
                 qm_status *st);
void qm_pager_free(qm_pager *pager); /* accepts NULL; waits for copies in flight */

/* Minimum budget for `plan` over `bank` on `backend` (whole banks + pins + one
 * slot when anything is paged). Same rules as qm_pager_new. */
int qm_pager_min_budget(qm_backend *backend, const qm_bank *bank, const qm_residency_plan *plan,
                        const qm_pager_options *options, uint64_t *out, qm_status *st);

/* Changes the budget of a live pager (session.resize). Waits for copies in
 * flight first; call it between forward calls (nothing acquired).
 * Shrinking: when whole banks + pins + one expert unit no longer fit, pins
 * are released coldest first (least recently used; they stay resident as
 * ordinary, evictable experts and stay released); then the policy picks
 * victims until the resident experts fit both the new budget and the slots
 * it pays for; the budget in force changes only once resident bytes are
 * within it, so they are never above the budget in force. Slots given back
 * are the highest: a survivor in one is re-copied into a lower free slot,
 * memory added by an earlier growth is freed once none of its slots is in
 * use, and on a host-visible backend the pages of the other slots given
 * back return to the system (madvise; unlocked first when the disk source
 * locked them), so a smaller budget is less memory as a cgroup counts it.
 * Growing: the new slots come from memory given back earlier (locked again
 * where the arena was), else from one new arena; nothing is loaded (misses
 * fill them). Outputs never change. Errors:
 * QM_ERESOURCE_EXHAUSTED with field "budget_bytes" when the budget is below
 * the minimum (whole banks + one expert unit when anything is paged; pins
 * can be released), message shaped as qm_pager_new's; QM_ENOMEM /
 * QM_EDEVICE from growing (nothing changed). A failed re-copy drops that
 * expert (evicted; a later access misses). */
int qm_pager_resize(qm_pager *pager, uint64_t budget_bytes, qm_status *st);

/* Experts of `layer` whose pin qm_pager_resize released (ascending). Writes
 * up to `cap`, returns the total count, or a negative code for an unknown
 * layer. */
int qm_pager_pins_released(const qm_pager *pager, uint32_t layer, uint32_t *out, size_t cap);

/* The source qm_moe_forward reads experts from. Borrowed from the pager. */
qm_expert_source *qm_pager_source(qm_pager *pager);

/* qm_moe_forward through the pager's source, then: records the call's routing
 * in the history and, with prefetch on, prefetches the next layer's predicted
 * experts (history + that layer's router applied to call->hidden when the bank
 * has it), or leaves that for qm_pager_after_forward (opt.defer_prefetch).
 * The copies run on the copy path while the caller does other work.
 * call->route_experts may be NULL (the pager uses its own scratch). */
int qm_pager_forward(qm_pager *pager, const qm_moe_call *call, qm_moe_stats *mstats,
                     qm_status *st);
/* The prefetch the last qm_pager_forward left (opt.defer_prefetch), run
 * now; nothing when none is left. Best effort, as prefetch is: never
 * fails. Same thread rules as qm_pager_forward (one caller at a time). */
void qm_pager_after_forward(qm_pager *pager);
/* Work that only makes later calls faster, for when the caller's engine is
 * not waiting on it (the daemon: after a ring call's answer): with
 * opt.interleave where this process's fast kernel reads r8, a piece
 * (opt.r8_piece_bytes, 2 MiB: about 0.2 ms) of a landed unit a call has
 * used laid out in r8 (qm_pager.c). Runs the kept prefetch first. Same
 * thread rules as qm_pager_forward. */
void qm_pager_tidy(qm_pager *pager);

/* Copies experts[0..n) of `layer` into free or evictable slots (never
 * evicting a pinned, in-use or just-predicted expert) without waiting for the
 * copies. Experts already resident, out of range or of a whole bank are
 * skipped. Returns the number issued (>= 0) or a negative error. */
int qm_pager_prefetch(qm_pager *pager, uint32_t layer, const uint32_t *experts, size_t n,
                      qm_status *st);
/* Loads experts[0..n) of `layer` into free slots, in order, until none is
 * free (never evicting, so the first ones win when the list holds more than
 * the budget), without waiting for the copies (qm_pager_sync): a session
 * re-created after a restart starting from its old residency
 * (session.create `warm`). They stay evictable, as preloaded experts, and
 * count in bytes_loaded_at_create. Experts resident, out of range, of a
 * whole bank or of another device's layer are skipped. Returns the number
 * loaded (>= 0) or a negative error. */
int qm_pager_warm(qm_pager *pager, uint32_t layer, const uint32_t *experts, size_t n,
                  qm_status *st);
/* Waits for every copy in flight. */
int qm_pager_sync(qm_pager *pager, qm_status *st);
/* Every landed unit not yet in the r8 layout laid out now, where
 * opt.interleave asks for it and this process's fast kernel reads r8
 * (nothing otherwise): what a session loaded at its creation (its pins and
 * preload, done by qm_pager_new; qm_pager_warm's, after qm_pager_sync)
 * rather than one unit a call while it decodes. Returns the weight bytes
 * laid out. */
uint64_t qm_pager_interleave_resident(qm_pager *pager);

void qm_pager_stats_get(const qm_pager *pager, qm_pager_stats *out);

/* Experts of `layer` resident now (ascending; a whole bank lists all of its
 * experts; copies in flight count as resident). Writes up to `cap`, returns
 * the total count, or a negative code for an unknown layer. */
int qm_pager_resident_experts(const qm_pager *pager, uint32_t layer, uint32_t *out, size_t cap);

/* The backend this pager runs host experts on (on_miss host/auto), NULL
 * with on_miss page. The pagers of a session over several devices share
 * one (qm_multipager_new). */
const qm_backend *qm_pager_host_backend(const qm_pager *pager);
/* 1 when `layer` is paged per expert, 0 when whole-bank, negative when unknown. */
int qm_pager_layer_is_paged(const qm_pager *pager, uint32_t layer);

/* Records the routing of every later qm_pager_forward call into a routing
 * trace at `path` (docs/TRACES.md, .qmtr; created or truncated, mode 0600)
 * for policy_params.record_trace. Token rows are written as they complete:
 * a token is complete once every layer has routed it, so layer calls must
 * come in order per token, as a decoder makes them (a prefill call of T
 * tokens adds T rows to its layer). The header's token count is kept
 * current, so the file is a valid trace at any moment. Recording never
 * fails inference: an I/O error stops it (trace_errors), and so does the
 * file reaching `max_bytes` (0: no bound; trace_full set, the file a valid
 * trace of the tokens that fit); rows of a layer
 * that runs more than 65536 tokens ahead of another are dropped
 * (trace_dropped). A second call replaces the recording. With `resume`, a
 * trace already at `path` of this bank's shape (layers, k, experts; no
 * weights) is gone on with instead: its rows kept (anything after the
 * last whole row its header counts cut off), trace_tokens starting at its
 * count, and 1 returned; any other file is replaced as without it. 0 when
 * a new trace was started; QM_EIO when the file cannot be created. */
int qm_pager_record_trace(qm_pager *pager, const char *path, int resume, uint64_t max_bytes,
                          qm_status *st);

/* The source in force: QM_PAGER_SOURCE_DIRECT or _MMAP. *why (may be NULL)
 * gets a sentence on what was asked and not done ("" when nothing): the
 * fallback to the mapping (O_DIRECT refused by the filesystem, a memory
 * bank, a backend that is not host-visible) or an arena left unlocked
 * (mlock refused: RLIMIT_MEMLOCK). Borrowed from the pager. */
int qm_pager_source_info(const qm_pager *pager, const char **why);

/* The disk source's I/O engine in force: QM_PAGER_IO_URING,
 * QM_PAGER_IO_THREADS or QM_PAGER_IO_SERIAL, or -1 without the disk source;
 * *depth (may be NULL) the reads in flight at most; *why (may be NULL) ""
 * or why io_uring is not used or its buffers are not registered (borrowed
 * from the pager). */
int qm_pager_io_info(const qm_pager *pager, uint32_t *depth, const char **why);

/* Test hook on the disk source: called before each read of `len` bytes at
 * file offset `off` (on the thread that issues it: the copy thread, the
 * thread issuing io_uring reads, or one of the pool's threads, several at
 * once); a non-zero errno fails that read as if the disk had. NULL removes
 * it; set it between forward calls. */
typedef int (*qm_pager_read_cb)(void *ud, uint64_t off, uint64_t len);
void qm_pager_set_read_hook(qm_pager *pager, qm_pager_read_cb cb, void *ud);

/* Test hook: called after every slot allocation (demand, prefetch, pin) with
 * the resident bytes and the budget. NULL removes it. */
typedef void (*qm_pager_alloc_cb)(void *ud, uint64_t resident_bytes, uint64_t budget_bytes);
void qm_pager_set_alloc_hook(qm_pager *pager, qm_pager_alloc_cb cb, void *ud);

#endif
