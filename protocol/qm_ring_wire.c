/* qm_ring_wire.c - the call ring's layout, codecs and doorbell
 * (qm_ring_wire.h; PROTOCOL.md "session.ring"). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* syscall */
#endif
#include "qm_ring_wire.h"

#include <errno.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

const char *const qm_ring_stat_names[QM_RING_STATS] = {
    "hits",     "misses",     "host_runs", "bytes_paged", "bytes_read_disk", "stall_us",
    "queue_us", "compute_us", "decode_us", "encode_us",   "wall_us"};

/* ---- little-endian fields ---- */

static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* ---- the request ---- */

enum { REQ_TENSORS = 16, TENSOR_BYTES = 40, REQ_OUTPUT = 176 };

static void tensor_write(uint8_t *p, const qm_ring_tensor *t)
{
    put_u32(p, t->dtype);
    put_u32(p + 4, 0);
    put_u64(p + 8, t->rows);
    put_u64(p + 16, t->cols);
    put_u64(p + 24, t->map);
    put_u64(p + 32, t->offset);
}

static void tensor_read(const uint8_t *p, qm_ring_tensor *t)
{
    t->dtype = get_u32(p);
    t->rows = get_u64(p + 8);
    t->cols = get_u64(p + 16);
    t->map = get_u64(p + 24);
    t->offset = get_u64(p + 32);
}

void qm_ring_request_write(uint8_t *slot, const qm_ring_request *r)
{
    memset(slot, 0, QM_RING_REQUEST_BYTES);
    put_u32(slot, r->layer);
    put_u32(slot + 4, r->flags);
    put_u64(slot + 8, r->rung_ns);
    const qm_ring_tensor *t[4] = {&r->hidden, &r->router_logits, &r->topk_ids, &r->topk_weights};
    for (int i = 0; i < 4; i++)
        tensor_write(slot + REQ_TENSORS + i * TENSOR_BYTES, t[i]);
    put_u64(slot + REQ_OUTPUT, r->output_map);
    put_u64(slot + REQ_OUTPUT + 8, r->output_offset);
}

void qm_ring_request_read(const uint8_t *copy, qm_ring_request *r)
{
    memset(r, 0, sizeof *r);
    r->layer = get_u32(copy);
    r->flags = get_u32(copy + 4);
    r->rung_ns = get_u64(copy + 8);
    qm_ring_tensor *t[4] = {&r->hidden, &r->router_logits, &r->topk_ids, &r->topk_weights};
    for (int i = 0; i < 4; i++)
        tensor_read(copy + REQ_TENSORS + i * TENSOR_BYTES, t[i]);
    r->output_map = get_u64(copy + REQ_OUTPUT);
    r->output_offset = get_u64(copy + REQ_OUTPUT + 8);
}

/* ---- the answer ---- */

enum { ANS_STATS = 16, ANS_FIELD = 112, ANS_REASON = 176 };

/* A string into a fixed field, NUL-padded (the field always ends in NUL). */
static void put_str(uint8_t *p, size_t cap, const char *s)
{
    size_t n = s ? strnlen(s, cap - 1) : 0;
    memcpy(p, s ? s : "", n);
    memset(p + n, 0, cap - n);
}

static void get_str(const uint8_t *p, size_t cap, char *out)
{
    memcpy(out, p, cap);
    out[cap - 1] = '\0';
}

void qm_ring_answer_write(uint8_t *slot, const qm_ring_answer *a)
{
    put_u32(slot, (uint32_t)a->code);
    put_u32(slot + 4, 0);
    put_u64(slot + 8, a->answered_ns);
    for (int i = 0; i < QM_RING_STATS; i++)
        put_u64(slot + ANS_STATS + 8 * i, a->stats[i]);
    put_str(slot + ANS_FIELD, QM_RING_FIELD_BYTES, a->code ? a->field : NULL);
    put_str(slot + ANS_REASON, QM_RING_ANSWER_REASON_BYTES, a->code ? a->reason : NULL);
}

void qm_ring_answer_read(const uint8_t *slot, qm_ring_answer *a)
{
    a->code = (int32_t)get_u32(slot);
    a->answered_ns = get_u64(slot + 8);
    for (int i = 0; i < QM_RING_STATS; i++)
        a->stats[i] = get_u64(slot + ANS_STATS + 8 * i);
    get_str(slot + ANS_FIELD, QM_RING_FIELD_BYTES, a->field);
    get_str(slot + ANS_REASON, QM_RING_ANSWER_REASON_BYTES, a->reason);
}

/* ---- the header ---- */

void qm_ring_header_init(uint8_t *region, uint32_t bytes)
{
    memset(region, 0, QM_RING_OFF_REQ_SEQ);
    put_u32(region + QM_RING_OFF_MAGIC, QM_RING_MAGIC);
    put_u32(region + QM_RING_OFF_VERSION, QM_RING_VERSION);
    put_u32(region + QM_RING_OFF_BYTES, bytes);
    qm_ring_store(qm_ring_word(region, QM_RING_OFF_STATE), QM_RING_OPEN);
}

void qm_ring_header_close(uint8_t *region, int32_t code, const char *reason)
{
    put_u32(region + QM_RING_OFF_CLOSED_CODE, (uint32_t)code);
    put_str(region + QM_RING_OFF_CLOSED_REASON, QM_RING_REASON_BYTES, reason);
    /* Released after the reason: whoever sees CLOSED reads the reason whole. */
    qm_ring_store(qm_ring_word(region, QM_RING_OFF_STATE), QM_RING_CLOSED);
}

int qm_ring_header_closed(const uint8_t *region, int32_t *code, char *reason, size_t cap)
{
    uint32_t state = qm_ring_load(qm_ring_word((uint8_t *)region, QM_RING_OFF_STATE));
    if (state == QM_RING_OPEN)
        return 0;
    *code = (int32_t)get_u32(region + QM_RING_OFF_CLOSED_CODE);
    if (cap) {
        char r[QM_RING_REASON_BYTES];
        get_str(region + QM_RING_OFF_CLOSED_REASON, sizeof r, r);
        size_t n = strnlen(r, cap - 1);
        memcpy(reason, r, n);
        reason[n] = '\0';
    }
    return 1;
}

/* ---- the doorbell ---- */

uint32_t *qm_ring_word(uint8_t *region, size_t off) { return (uint32_t *)(void *)(region + off); }

int qm_ring_futex_wait(uint32_t *word, uint32_t old, uint64_t timeout_ns)
{
    struct timespec ts = {(time_t)(timeout_ns / 1000000000u), (long)(timeout_ns % 1000000000u)};
    /* Not FUTEX_PRIVATE_FLAG: the word lives in a mapping two processes share. */
    long rc = syscall(SYS_futex, word, FUTEX_WAIT, old, timeout_ns ? &ts : NULL, NULL, 0);
    return rc < 0 && errno == ETIMEDOUT ? 1 : 0;
}

void qm_ring_futex_wake(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0); }

uint64_t qm_ring_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void qm_ring_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* ---- how long to spin ---- */

#define QM__RING_WAKE_INIT_NS 20000u /* until this machine's wake-ups are measured */
#define QM__RING_SPIN_MIN_NS 2000u

void qm_ring_spin_init(qm_ring_spin *s)
{
    s->wake_ns = QM__RING_WAKE_INIT_NS;
    s->expect_ns = QM__RING_WAKE_INIT_NS;
}

uint64_t qm_ring_spin_budget(const qm_ring_spin *s)
{
    uint64_t wake = s->wake_ns;
    if (wake < 1000)
        wake = 1000;
    if (wake > QM_RING_SPIN_MAX_NS / 2)
        wake = QM_RING_SPIN_MAX_NS / 2;
    /* A wait well past a wake-up's cost: parking at once loses nothing. */
    if (s->expect_ns > 2 * wake)
        return 0;
    /* Otherwise cover the usual wait and its spread, never longer than two
     * wake-ups (past that a park would have been cheaper). */
    uint64_t b = 2 * s->expect_ns;
    if (b > 2 * wake)
        b = 2 * wake;
    return b < QM__RING_SPIN_MIN_NS ? QM__RING_SPIN_MIN_NS : b;
}

static void ewma(uint64_t *avg, uint64_t sample)
{
    if (sample > 1000000000u)
        sample = 1000000000u;
    *avg = *avg - *avg / 8 + sample / 8;
}

void qm_ring_spin_note_wait(qm_ring_spin *s, uint64_t waited_ns) { ewma(&s->expect_ns, waited_ns); }

void qm_ring_spin_note_wake(qm_ring_spin *s, uint64_t wake_ns)
{
    ewma(&s->wake_ns, wake_ns > 4 * QM_RING_SPIN_MAX_NS ? 4 * QM_RING_SPIN_MAX_NS : wake_ns);
}
