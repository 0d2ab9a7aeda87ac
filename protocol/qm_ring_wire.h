/* qm_ring_wire.h - the call ring (PROTOCOL.md "session.ring"): the binary
 * layout of a session's shared call region, its request and answer codecs,
 * and the doorbell both ends ring (a futex word in the region) with the
 * spin-then-park rule they wait by.
 *
 * Shared by the daemon (daemon/qm_ring.c) and libqmoe-client
 * (clients/qm_client_ring.c), which compiles this file itself. The region
 * is memory the other process can write at any moment: every reader copies
 * what it reads out of it once (the *_read functions take a private copy
 * of a slot) and checks the copy; nothing here trusts a value twice.
 *
 * Every multi-byte value is little-endian at a fixed offset; the layout
 * below is version 1 (QM_RING_VERSION). */
#ifndef QM_RING_WIRE_H
#define QM_RING_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define QM_RING_MAGIC 0x31474e52u /* the bytes "RNG1" */
#define QM_RING_VERSION 1u
#define QM_RING_BYTES 4096u /* the region: one page, the least session.ring takes */

/* The region. Header (written by the daemon when the ring opens, state and
 * the closing reason when it closes), then one cache line per doorbell
 * word, then the request slot (the client's) and the answer slot (the
 * daemon's). */
enum {
    QM_RING_OFF_MAGIC = 0,          /* u32 QM_RING_MAGIC */
    QM_RING_OFF_VERSION = 4,        /* u32 QM_RING_VERSION */
    QM_RING_OFF_BYTES = 8,          /* u32 the region's bytes */
    QM_RING_OFF_STATE = 12,         /* u32 QM_RING_OPEN / QM_RING_CLOSED (daemon) */
    QM_RING_OFF_CLOSED_CODE = 16,   /* i32: why it closed, a JSON-RPC code or QM_RING_CLOSED_CONN */
    QM_RING_OFF_CLOSED_REASON = 64, /* char[QM_RING_REASON_BYTES], NUL-terminated */
    QM_RING_OFF_REQ_SEQ = 256,      /* u32 doorbell: the client's call number */
    QM_RING_OFF_DAEMON_PARKED = 320, /* u32: 1 while the daemon sleeps on REQ_SEQ */
    QM_RING_OFF_ANS_SEQ = 384,       /* u32 doorbell: the call number answered */
    QM_RING_OFF_CLIENT_PARKED = 448, /* u32: 1 while the client sleeps on ANS_SEQ */
    QM_RING_OFF_REQUEST = 512,       /* QM_RING_REQUEST_BYTES */
    QM_RING_OFF_ANSWER = 768,        /* QM_RING_ANSWER_BYTES */
};

enum { QM_RING_OPEN = 0, QM_RING_CLOSED = 1 };
/* closed_code of a ring whose connection closed (or that the daemon ended
 * without an error code of the protocol): the client reports a broken
 * connection. */
#define QM_RING_CLOSED_CONN 1
#define QM_RING_REASON_BYTES 192

/* ---- the request slot (192 bytes used of 256) ----
 *   0 u32 layer
 *   4 u32 flags: QM_RING_F_ROUTER_LOGITS | QM_RING_F_TOPK; other bits 0
 *   8 u64 rung_ns: the client's CLOCK_MONOTONIC when it rang (0: none)
 *  16 hidden, 56 router_logits, 96 topk_ids, 136 topk_weights: 40 bytes each
 *       0 u32 dtype (0 f32, 1 f16, 2 bf16, 3 i32), 4 u32 reserved,
 *       8 u64 rows, 16 u64 cols, 24 u64 map, 32 u64 offset
 * 176 u64 output map, 184 u64 output offset                         */
#define QM_RING_REQUEST_BYTES 256u
#define QM_RING_F_ROUTER_LOGITS 1u
#define QM_RING_F_TOPK 2u

typedef struct qm_ring_tensor {
    uint32_t dtype; /* qm_wire_dtype's values */
    uint64_t rows, cols, map, offset;
} qm_ring_tensor;

typedef struct qm_ring_request {
    uint32_t layer, flags;
    uint64_t rung_ns;
    qm_ring_tensor hidden, router_logits, topk_ids, topk_weights;
    uint64_t output_map, output_offset;
} qm_ring_request;

/* Writes r into a slot of QM_RING_REQUEST_BYTES (the client). */
void qm_ring_request_write(uint8_t *slot, const qm_ring_request *r);
/* Reads a request out of a private copy of the slot (the daemon copies the
 * slot first: protocol/qm_ring_params.c). */
void qm_ring_request_read(const uint8_t *copy, qm_ring_request *r);

/* ---- the answer slot (688 bytes used of 768) ----
 *   0 i32 code: 0, or the JSON-RPC code session.infer would answer
 *   4 u32 reserved
 *   8 u64 answered_ns: the daemon's CLOCK_MONOTONIC when it answered
 *  16 u64 stats[QM_RING_STATS], session.infer's stats in qm_ring_stat_names' order
 * 104 u64 reserved
 * 112 char field[64], 176 char reason[512]: the error's, NUL-terminated */
#define QM_RING_ANSWER_BYTES 768u
#define QM_RING_STATS 11
#define QM_RING_FIELD_BYTES 64
#define QM_RING_ANSWER_REASON_BYTES 512

enum {
    QM_RING_STAT_HITS,
    QM_RING_STAT_MISSES,
    QM_RING_STAT_HOST_RUNS,
    QM_RING_STAT_BYTES_PAGED,
    QM_RING_STAT_BYTES_READ_DISK,
    QM_RING_STAT_STALL_US,
    QM_RING_STAT_QUEUE_US,
    QM_RING_STAT_COMPUTE_US,
    QM_RING_STAT_DECODE_US,
    QM_RING_STAT_ENCODE_US,
    QM_RING_STAT_WALL_US,
};
/* "hits", "misses", ...: the names session.infer's stats carry. */
extern const char *const qm_ring_stat_names[QM_RING_STATS];

typedef struct qm_ring_answer {
    int32_t code;
    uint64_t answered_ns;
    uint64_t stats[QM_RING_STATS];
    char field[QM_RING_FIELD_BYTES];
    char reason[QM_RING_ANSWER_REASON_BYTES];
} qm_ring_answer;

void qm_ring_answer_write(uint8_t *slot, const qm_ring_answer *a); /* the daemon */
/* Reads the answer out of the slot (the client): strings end within their
 * fields whatever the slot holds. */
void qm_ring_answer_read(const uint8_t *slot, qm_ring_answer *a);

/* ---- header ---- */
void qm_ring_header_init(uint8_t *region, uint32_t bytes); /* magic, version, bytes, open */
/* Marks the region closed with `code` and `reason` (the daemon). */
void qm_ring_header_close(uint8_t *region, int32_t code, const char *reason);
/* 0 when the region says QM_RING_OPEN; else 1 with its code and reason
 * (reason: cap bytes, NUL-terminated). */
int qm_ring_header_closed(const uint8_t *region, int32_t *code, char *reason, size_t cap);

/* ---- the doorbell ----
 * A call: the client writes the request slot, then REQ_SEQ = n (release)
 * and, when DAEMON_PARKED is 1, wakes it (FUTEX_WAKE on REQ_SEQ). The
 * daemon takes n, answers in the slot, sets ANS_SEQ = n and wakes the
 * client when CLIENT_PARKED is 1. A waiter spins for qm_ring_spin_budget,
 * then sets its PARKED word (sequentially consistent, so that either it
 * sees the new number or its peer sees it parked), looks once more, and
 * sleeps on the word (shared futex: the region is MAP_SHARED). */
uint32_t *qm_ring_word(uint8_t *region, size_t off); /* the u32 at off (4-aligned) */
/* The doorbell and state words are read and written sequentially
 * consistent (GCC/clang builtins: the words are plain memory). */
static inline uint32_t qm_ring_load(const uint32_t *w) { return __atomic_load_n(w, __ATOMIC_SEQ_CST); }
static inline void qm_ring_store(uint32_t *w, uint32_t v) { __atomic_store_n(w, v, __ATOMIC_SEQ_CST); }
/* Sleeps while *word == old, at most timeout_ns (0: no limit). 0 when
 * woken or the word differed; 1 when the time ran out. */
int qm_ring_futex_wait(uint32_t *word, uint32_t old, uint64_t timeout_ns);
void qm_ring_futex_wake(uint32_t *word); /* wakes every sleeper */
uint64_t qm_ring_now_ns(void);           /* CLOCK_MONOTONIC, the stamps' clock */
void qm_ring_cpu_relax(void);

/* How long a side spins before it parks: about what it expects to wait
 * (the daemon: the gap between calls; the client: the call's service
 * time), measured, and only when waiting that long costs less than a
 * park and a wake-up measured on this machine (a futex wake-up: the
 * time from the peer's stamp to this side running again). Bounded by
 * QM_RING_SPIN_MAX_NS whatever the measurements say. */
#define QM_RING_SPIN_MAX_NS 200000u
typedef struct qm_ring_spin {
    uint64_t expect_ns; /* a moving average of the waits */
    uint64_t wake_ns;   /* a moving average of the wake-ups' cost */
} qm_ring_spin;
void qm_ring_spin_init(qm_ring_spin *s);
uint64_t qm_ring_spin_budget(const qm_ring_spin *s);
void qm_ring_spin_note_wait(qm_ring_spin *s, uint64_t waited_ns);
void qm_ring_spin_note_wake(qm_ring_spin *s, uint64_t wake_ns);

#endif
