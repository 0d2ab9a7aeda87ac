/* qm_pager_impl.h - the paging authority's state, and the bottom of the
 * pager: its slots and the choice of victims (qm_pager_slots.c). Private to
 * engine/.
 *
 * The pager's files form layers, top first; each calls only files below it
 * (tests/engine/check_layers.py checks it on the built library):
 *
 *   qm_pager.c            creation, teardown, the forward call, introspection
 *   qm_pager_source.c     the expert source: demand paging in waves (qm_pager_source.h)
 *   qm_pager_prefetch.c   history, prediction, prefetch              (qm_pager_prefetch.h)
 *   qm_pager_resize.c     session.resize                             (qm_pager.h)
 *   qm_hybrid.c           hybrid execution                           (qm_hybrid.h)
 *   qm_pager_trace.c      routing traces                             (qm_pager_trace.h)
 *   qm_pager_copy.c       the copy path, eviction, sync              (qm_pager_copy.h)
 *   qm_pager_slots.c      slots, accounting, victims                 (this header)
 *   qm_pager_disk.c       the disk source: O_DIRECT reads, mlock     (qm_pager_disk.h)
 *   qm_pager_io.c         the I/O engine: io_uring, preadv threads   (qm_pager_io.h)
 *   qm_pager_layout.c     layout and sizing, pure                    (qm_pager_layout.h)
 *   qm_pager_trial.c      whether prefetch pays, timed; pure         (qm_pager_trial.h)
 *
 * Each group of fields below names the file that owns it. */
#ifndef QM_PAGER_IMPL_H
#define QM_PAGER_IMPL_H

#include <pthread.h>

#include "qm_moe_internal.h"
#include "qm_pager_layout.h"
#include "qm_pager_trial.h"

typedef enum qm__slot_state {
    QM__SLOT_FREE = 0,
    QM__SLOT_LOADING,  /* copy issued, not yet waited for */
    QM__SLOT_RESIDENT, /* copy landed */
} qm__slot_state;

/* Who predicted a prefetched expert: each source's precision gates it.
 * ROUTER: the next layer's router on the call's hidden states; HISTORY: the
 * next layer's last calls; LOOKAHEAD: the router of the layer after next on
 * the same hidden states (two calls ahead). */
enum {
    QM__PF_NONE = 0,
    QM__PF_EXPLICIT,
    QM__PF_ROUTER,
    QM__PF_HISTORY,
    QM__PF_LOOKAHEAD,
    QM__PF_SOURCES
};
/* Predictions waiting for the call they are about (per source: the next
 * layer's, and the lookahead's two calls ahead). */
#define QM__PF_PENDING 2u

typedef struct qm__pf_pending {
    int valid;
    uint32_t layer;
    uint64_t *bits; /* [pred_words] the predicted experts */
} qm__pf_pending;

typedef struct qm__slot {
    uint8_t *base; /* device address of the slot in the arena */
    uint32_t layer, expert;
    uint8_t state;
    uint8_t pinned;
    uint8_t prefetched; /* prefetched by a QM__PF_* source and not accessed since; 0 = no */
    uint8_t by_prefetch; /* claimed by prefetch: a failed read is read again on demand */
    uint8_t waiting;    /* held by the current acquire round, not handed out yet */
    /* A prefetch parked part way (qm_pager_source.c): its unit is not
     * there, so it goes first when a slot must be given back. Cleared when
     * a call or a prediction takes it up, or the slot is claimed again. */
    uint8_t parked;
    uint32_t refs;      /* acquired and not yet released */
    uint16_t uses;      /* times handed out to a call since it was claimed (saturates) */
    /* Bit t set: weight tensor t of the unit is in the r8 layout (laid out
     * after it landed, qm_pager.c); and tensor r8_part in r8 for its first
     * r8_part_rows rows (0: none); 0 from every copy into the slot. */
    uint32_t r8, r8_part, r8_part_rows;
    uint64_t last_use;  /* pager tick of the last access/insert (LRU fallback) */
    uint64_t unit_bytes;
    /* Copy in flight (qm_pager_copy.c): a copy-thread job (copy_seq > 0) or device fences. */
    uint64_t copy_seq;
    int copy_rc; /* written by the copy thread under the copy lock */
    uint32_t n_fences;
    qm_fence fences[QM_T_EXPERT_COUNT];
} qm__slot;

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
    /* Creation (qm_pager.c) */
    qm_backend *backend;
    const qm_bank *bank;
    const qm_bank_config *cfg;
    const qm_policy *policy;
    qm_pager_options opt;
    qm_expert_source source;
    uint32_t n_layers;
    qm__layer *layers;
    qm__sizing sz; /* sz.pinned_bytes: the pins now (qm_pager_resize.c releases them) */
    uint64_t tick;
    qm_pager_stats stats;

    /* Slots (qm_pager_slots.c; qm_pager_resize.c grows and shrinks them) */
    qm_arena *arena;
    uint32_t n_slots;  /* slots in use: [0, n_slots) */
    uint32_t slot_cap; /* slots with memory behind them (>= n_slots; slots[] has this many) */
    qm__slot *slots;
    /* Scratch of the victim choice and of an acquire, [n_slots] at least,
     * one block owned through cand_refs (qm__pager_scratch_regrow). */
    qm_expert_ref *cand_refs;
    int32_t *cand_slots; /* victim candidates */
    int32_t *wave_slots; /* slots of the current acquire round not handed out yet */
    uint32_t wave_n;     /* ... their count (qm_pager_source.c) */
    uint32_t wave_layer;
    uint64_t arena_skew; /* the creation arena's slots and whole banks start here (alignment) */
    int has_budget;
    uint64_t budget;
    /* Arenas added by growing, each holding slots [grow_first[i], next one). */
    qm_arena **grow_arenas;
    uint32_t *grow_first;
    size_t n_grow;
    qm_pager_alloc_cb alloc_cb;
    void *alloc_ud;

    /* Disk source (qm_pager_disk.c): NULL when units come from the mapping. */
    struct qm__disk *disk;
    char source_why[384]; /* what was asked and not done ("" when nothing) */

    /* Copy thread (qm_pager_copy.c; host-visible backends). */
    int use_thread;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    struct qm__copy_job *queue; /* ring of q_cap = n_slots + 1 */
    size_t q_cap, q_head, q_len;
    uint64_t next_seq, done_seq;
    int stop;
    char copy_msg[256]; /* the copy thread's last failure (mu) */

    /* Forward call (qm_pager.c) */
    qm__moe_scratch *scratch; /* the layer calls' buffers, grow-only */
    uint32_t *route_buf;
    size_t route_cap;

    /* Slot units in the r8 layout (qm_pager.c, opt.interleave on a paged
     * session): the layout's scratch (NULL: never). */
    uint8_t *r8_tmp;

    /* Prediction and prefetch (qm_pager_prefetch.c) */
    uint16_t *pred_routers; /* the block of the layers' pred_router copies */
    float *pred_x, *pred_logits;
    uint32_t *pred_experts;
    float *pred_weights;
    size_t pred_cap_tokens;
    uint32_t *pred_list;
    uint8_t *pred_src;
    uint32_t *pred_list2; /* the lookahead's list */
    /* A forward call's prefetch left for qm_pager_after_forward
     * (opt.defer_prefetch): the call as prediction reads it, its hidden
     * states copied to f32 in pf_x (NULL past the router's token bound). */
    uint32_t calls_since_miss; /* forward calls since one missed (or ran an expert on the host) */
    int pf_deferred;
    qm_moe_call pf_call;
    uint32_t pf_k;
    float *pf_x;
    size_t pf_x_cap;
    /* Measured prediction (qm_pager_prefetch.c): what each source predicted
     * for a call, scored when that call comes (precision and recall, whether
     * or not the experts were resident), and the gate's window. */
    qm__pf_pending pf_pending[QM__PF_SOURCES][QM__PF_PENDING];
    uint64_t *pf_bits; /* one block: every pending set, then the scored call's */
    size_t pred_words;
    uint64_t pf_win_predicted[QM__PF_SOURCES], pf_win_correct[QM__PF_SOURCES];
    uint8_t pf_off[QM__PF_SOURCES];
    /* The usefulness gate: each source's issued and useful prefetch counts
     * at its last window's end, and windows it stays off for having wasted
     * its reads (qm_pager_prefetch.c). */
    uint64_t pf_win_issued0[QM__PF_SOURCES], pf_win_useful0[QM__PF_SOURCES];
    uint32_t pf_hold[QM__PF_SOURCES];
    uint64_t forward_calls;
    /* Whether prefetch pays on this session, timed (qm_pager_trial.h). */
    qm__pf_trial trial;

    /* Routing trace (qm_pager_trace.c) */
    struct qm__trace *trace;
    /* A session over several devices: the pager whose recording (and
     * trace_* counters) this one's routing goes to, NULL for itself
     * (qm_multipager_record_trace). */
    qm_pager *trace_to;

    /* Hybrid execution (qm_hybrid.c) */
    qm__hybrid hybrid;
};

/* ---- Slots and accounting (qm_pager_slots.c) ---- */

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

/* The arguments of a call about experts[0..n) of `layer` (warm, prefetch):
 * 0, or QM_EINVAL naming `fn` for a NULL pager or list, or the layer out
 * of range. */
int qm__pager_check_call(const qm_pager *p, const char *fn, uint32_t layer,
                         const uint32_t *experts, size_t n, qm_status *st);
/* Adds `bytes` to the resident bytes, or refuses with QM_EINTERNAL (counted
 * as a budget violation) when that would pass the budget. */
int qm__pager_account_alloc(qm_pager *p, uint64_t bytes, qm_status *st);
/* The lowest free slot, or -1. */
int32_t qm__pager_free_slot(qm_pager *p);
/* Claims free slot s for (layer, expert) as a unit whose copy is about to be
 * issued: accounts its bytes (QM_EINTERNAL past the budget, nothing
 * changed), marks it LOADING and maps the expert to it. `pf_source` (a
 * QM__PF_* source) only for QM__CLAIM_PREFETCH. */
int qm__pager_claim(qm_pager *p, int32_t s, uint32_t layer, uint32_t expert, qm__claim how,
                    uint8_t pf_source, qm_status *st);
/* Frees slot s at once and tells the policy, without counting an eviction
 * (qm__pager_evict, qm_pager_copy.h, is the eviction; this is also what a
 * failed copy costs). The caller knows no copy is writing into it. */
void qm__pager_drop(qm_pager *p, int32_t s);
/* 1 when slot s holds an unpinned unit nobody holds (a prefetch still in
 * flight included: its copy is waited for before the slot is reused, so
 * whether a prediction can be displaced never depends on copy timing). */
int qm__pager_evictable(const qm_pager *p, int32_t s);
/* Chooses a victim among cand_slots[0..n) (slot indices, evictable): the
 * policy's answer when valid, else LRU (counted as a fallback). */
int32_t qm__pager_pick_victim(qm_pager *p, size_t n);
/* Frees the arenas that growing added (teardown). */
void qm__pager_grow_free(qm_pager *p);
/* Resizes *buf to n elements of `elem` bytes; on failure keeps it and
 * answers QM_ENOMEM (the buffers of prefetch and resize). */
int qm__pager_regrow(void **buf, size_t n, size_t elem);
/* qm_pager_resize (qm_pager_resize.c; qm_pager.c checks the pager and
 * settles it first). */
int qm__pager_resize(qm_pager *p, uint64_t budget, qm_status *st);
/* Slot s's weights for a call (the unit's r8 layout in w->r8), counted as
 * a use. */
void qm__pager_slot_weights(qm_pager *p, int32_t s, qm_expert_weights *w);
/* cand_refs, cand_slots and wave_slots for n slots, in one new block that
 * keeps their first n_old entries; QM_ENOMEM leaves them as they were. */
int qm__pager_scratch_regrow(qm_pager *p, uint32_t n_old, uint32_t n);

#endif
