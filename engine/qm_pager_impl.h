/* qm_pager_impl.h - the paging authority's private state, shared by
 * qm_pager.c (slots, accounting, victims, acquire/release, forward),
 * qm_pager_copy.c (the copy path and its thread) and
 * qm_pager_prefetch.c (history, prediction, prefetch). Private to engine/. */
#ifndef QM_PAGER_IMPL_H
#define QM_PAGER_IMPL_H

#include <pthread.h>

#include "qm_moe_internal.h"
#include "qm_pager.h"

/* Slices inside a slot start on this boundary so that every tensor's slice is
 * aligned for vector loads (and for CUDA kernels reading f32 scales). */
#define QM__UNIT_SLICE_ALIGN 64u

typedef enum qm__slot_state {
    QM__SLOT_FREE = 0,
    QM__SLOT_LOADING,  /* copy issued, not yet waited for */
    QM__SLOT_RESIDENT, /* copy landed */
} qm__slot_state;

/* Who predicted a prefetched expert: each source's precision gates it. */
enum { QM__PF_NONE = 0, QM__PF_EXPLICIT, QM__PF_ROUTER, QM__PF_HISTORY, QM__PF_SOURCES };

/* A source whose useful/issued ratio over its last window falls below the
 * threshold is switched off, and probed on one forward call in
 * QM__PF_PROBE_EVERY to see whether it has become useful again. */
#define QM__PF_WINDOW 128u
#define QM__PF_PROBE_EVERY 8u
#define QM__PF_DEFAULT_MIN_PRECISION 0.25

typedef struct qm__slot {
    uint8_t *base; /* device address of the slot in the arena */
    uint32_t layer, expert;
    uint8_t state;
    uint8_t pinned;
    uint8_t prefetched; /* inserted by prefetch (a QM__PF_* source) and not accessed since; 0 = no */
    uint32_t refs;      /* acquired and not yet released */
    uint64_t last_use;  /* pager tick of the last access/insert (LRU fallback) */
    uint64_t unit_bytes;
    /* Copy in flight: a copy-thread job (copy_seq > 0) or device fences. */
    uint64_t copy_seq;
    int copy_rc; /* written by the copy thread under the queue lock */
    uint32_t n_fences;
    qm_fence fences[QM_T_EXPERT_COUNT];
} qm__slot;

typedef struct qm__layer {
    const qm_layer_view *view;
    int paged;
    int absent; /* served by another device's pager (opt.layer_mask) */
    uint32_t n_experts;
    uint64_t slice[QM_T_EXPERT_COUNT];    /* one expert's bytes per tensor (0 if absent) */
    uint64_t unit_off[QM_T_EXPERT_COUNT]; /* offset of each slice inside a slot */
    uint64_t unit_bytes;                  /* the catalog's bytes_per_expert (accounted) */
    uint64_t unit_span;                   /* bytes a unit spans in a slot (padding included) */
    /* Whole bank */
    uint64_t whole_bytes;                  /* accounted: every expert tensor's bytes */
    uint8_t *whole_base;                   /* device copy, or NULL: served from the mapping */
    uint64_t tensor_off[QM_T_EXPERT_COUNT]; /* offsets inside whole_base */
    /* Paged */
    int32_t *slot_of; /* [n_experts], -1 when not resident */
    uint8_t *pinned;  /* [n_experts] */
    uint8_t *mark;    /* [n_experts] scratch for prefetch */
    /* Routing history: `history` bitsets of words64 words, a ring. */
    uint64_t *hist;
    uint32_t words64;
    uint32_t hist_pos, hist_count;
} qm__layer;

typedef struct qm__copy_job {
    uint64_t seq;
    int32_t slot;
    uint32_t n;
    void *dst[QM_T_EXPERT_COUNT];
    const void *src[QM_T_EXPERT_COUNT];
    uint64_t len[QM_T_EXPERT_COUNT];
} qm__copy_job;

/* A routing-trace recording (qm_pager_trace.c). */
typedef struct qm__trace {
    int fd;
    uint64_t payload_off;
    int16_t **rows;    /* per layer: ring of pending rows, k ids each */
    uint32_t *head, *len; /* per layer */
    uint32_t cap;      /* rows per layer ring */
    int16_t *token;    /* one token's row: [layers][k] */
} qm__trace;

/* Hybrid execution (qm_hybrid.c): a cost line is time(n rows) = fixed + n * row. */
typedef struct qm__cost_line {
    double fixed_us, row_us;
} qm__cost_line;

typedef struct qm__hybrid {
    qm_backend *host_be; /* runs host experts; NULL with on_miss page */
    qm_backend *owned;   /* host_be when the pager made it */
    qm__cost_line host, dev;
    double copy_us;      /* one unit's demand copy */
    /* The last split's predictions, checked against what the call measured. */
    double pred_host_us, pred_dev_us;
    uint64_t pred_misses, misses_before;
    /* Experts the last split ran on the host: admitted after the call. */
    uint32_t *admit;
    size_t n_admit;
    uint32_t admit_layer;
} qm__hybrid;

struct qm_pager {
    qm_backend *backend;
    const qm_bank *bank;
    const qm_bank_config *cfg;
    const qm_policy *policy;
    qm_pager_options opt;
    qm_expert_source source;

    uint32_t n_layers;
    qm__layer *layers;

    qm_arena *arena;
    uint32_t n_slots;  /* slots in use: [0, n_slots) */
    uint32_t slot_cap; /* slots with memory behind them (>= n_slots; slots[] has this many) */
    qm__slot *slots;
    int32_t *cand_slots;     /* [n_slots] scratch */
    qm_expert_ref *cand_refs; /* [n_slots] scratch */
    int32_t *wave_slots;     /* [n_slots] slots assigned in the current acquire */

    int has_budget;
    uint64_t budget;
    /* Sizing kept for qm_pager_resize (qm_pager_resize.c). */
    uint64_t whole_accounted, pinned_bytes, max_unit, slot_size, whole_arena;
    uint32_t n_paged_experts; /* experts of paged layers, pinned ones included */
    /* Disk source (qm_pager_disk.c): NULL when units come from the mapping. */
    struct qm__disk *disk;
    char source_why[384]; /* what was asked and not done ("" when nothing) */
    char copy_msg[256];   /* the copy thread's last failure (p->mu) */
    /* Arenas added by growing, each holding slots [grow_first[i], next one). */
    qm_arena **grow_arenas;
    uint32_t *grow_first;
    size_t n_grow;
    uint64_t tick;
    qm_pager_stats stats;
    qm_pager_alloc_cb alloc_cb;
    void *alloc_ud;

    /* Forward scratch */
    qm__moe_scratch *scratch; /* the layer calls' buffers, grow-only */
    uint32_t *route_buf;
    size_t route_cap;
    float *pred_x, *pred_logits;
    uint32_t *pred_experts;
    float *pred_weights;
    size_t pred_cap_tokens;
    uint32_t *pred_list;
    uint8_t *pred_src;
    /* Prefetch gating per source. */
    uint32_t pf_win_issued[QM__PF_SOURCES], pf_win_useful[QM__PF_SOURCES];
    uint8_t pf_off[QM__PF_SOURCES];
    uint64_t forward_calls;
    qm__trace *trace;
    /* A session over several devices: the pager whose recording (and
     * trace_* counters) this one's routing goes to, NULL for itself
     * (qm_multipager_record_trace). */
    qm_pager *trace_to;
    qm__hybrid hybrid;

    /* Copy thread (host-visible backends). */
    int use_thread;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    qm__copy_job *queue; /* ring of n_slots + 1 */
    size_t q_cap, q_head, q_len;
    uint64_t next_seq, done_seq;
    int stop;
};

/* qm_pager_trace.c */
void qm__pager_trace_record(qm_pager *p, uint32_t layer, const uint32_t *route, uint32_t tokens,
                            uint32_t route_k); /* route: [tokens, route_k] */
void qm__pager_trace_close(qm_pager *p);

/* qm_pager_copy.c */
int qm__pager_copy_start(qm_pager *p, qm_status *st);
void qm__pager_copy_stop(qm_pager *p);
/* Issues the copy of slot s's unit (layer/expert already set). */
int qm__pager_copy_unit(qm_pager *p, int32_t s, qm_status *st);
/* Waits for slot s's copy; marks it RESIDENT on success, leaves it LOADING
 * (with nothing in flight) on failure. */
int qm__pager_copy_wait(qm_pager *p, int32_t s, qm_status *st);

/* qm_hybrid.c */
/* With on_miss host or auto: the host backend, auto's first measures, and
 * the source's split. */
int qm__hybrid_start(qm_pager *p, qm_status *st);
void qm__hybrid_stop(qm_pager *p);
/* After a successful forward call: auto's admissions and model refresh. */
int qm__hybrid_observe(qm_pager *p, const qm_moe_stats *ms, qm_status *st);

/* qm_pager.c */
int32_t qm__pager_free_slot(qm_pager *p);
/* Weights of expert e of L: in the unit at `unit_base` (from_slot), else
 * the layer's whole-bank copy or mapping. */
void qm__fill_weights(const qm__layer *L, const uint8_t *unit_base, uint32_t e, int from_slot,
                      qm_expert_weights *w);

/* Who claims a slot. A demand miss holds it (refs = 1) until the wave that
 * acquired it is released; a prefetched, preloaded or pinned unit is held by
 * nobody (a prefetched or preloaded one stays evictable, a pinned one never
 * is). Every claim stamps the current tick (accesses, not claims, advance
 * it); pins never reach the policy (they are never its victims). */
typedef enum qm__claim {
    QM__CLAIM_DEMAND = 0,
    QM__CLAIM_PREFETCH,
    QM__CLAIM_PRELOAD,
    QM__CLAIM_PIN,
} qm__claim;

/* Claims free slot s for (layer, expert) as a unit whose copy is about to be
 * issued: accounts its bytes (QM_EINTERNAL past the budget, nothing
 * changed), marks it LOADING and maps the expert to it. `pf_source` (a
 * QM__PF_* source) only for QM__CLAIM_PREFETCH. */
int qm__pager_claim(qm_pager *p, int32_t s, uint32_t layer, uint32_t expert, qm__claim how,
                    uint8_t pf_source, qm_status *st);
int qm__pager_account_alloc(qm_pager *p, uint64_t bytes, qm_status *st);
void qm__pager_evict(qm_pager *p, int32_t s);
/* Frees slot s without counting an eviction (a copy that failed). */
void qm__pager_drop(qm_pager *p, int32_t s);
/* Chooses a victim among candidates[0..n) (slot indices): the policy's answer
 * when valid, else LRU (counted as a fallback). */
int32_t qm__pager_pick_victim(qm_pager *p, size_t n);

/* qm_pager_resize.c */
void qm__pager_grow_free(qm_pager *p); /* the arenas added by growing */

/* qm_pager_disk.c */
/* With opt.source DIRECT: opens the bank file for O_DIRECT reads (p->disk)
 * and forces whole banks into the arena, or records why not (source_why). */
void qm__pager_disk_open(qm_pager *p);
void qm__pager_disk_close(qm_pager *p);
/* Reads the bytes the mapping holds at src..src+len into dst (QM_EIO). */
int qm__pager_disk_read(qm_pager *p, void *dst, const void *src, uint64_t len, qm_status *st);
void qm__pager_disk_lock(qm_pager *p, qm_arena *arena);   /* mlock, or why not */
void qm__pager_disk_unlock(qm_pager *p, qm_arena *arena);
void qm__pager_disk_stats(const qm_pager *p, qm_pager_stats *out);

/* qm_pager_prefetch.c */
/* A prefetched expert of `source` was used before being evicted. */
void qm__pager_prefetch_useful(qm_pager *p, uint8_t source);
void qm__pager_history_record(qm_pager *p, uint32_t layer, const uint32_t *route, size_t n);
/* After a forward call: predicts the next layer's experts and prefetches
 * them (best effort, with prefetch on). */
void qm__pager_prefetch_next(qm_pager *p, const qm_moe_call *call);

#endif
