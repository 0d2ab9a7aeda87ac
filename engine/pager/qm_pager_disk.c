/* qm_pager_disk.c - the pager's disk source (QM_PAGER_SOURCE_DIRECT): expert
 * units (and whole banks) are read from the bank file with O_DIRECT straight
 * into the arena, so the page cache never holds the bank's expert weights and
 * the budget bounds the memory they take; the arena is mlock'ed where
 * permitted.
 *
 * Reads go through the I/O engine (qm_pager_io.c: io_uring, else a pool of
 * preadv threads): a unit is one request of one region per tensor, every
 * miss of a call in flight at once, prefetches behind demand reads; whole
 * banks at creation are one request per layer, all in flight together. The
 * layout of the disk source (qm_pager_layout.h, QM__DISK_BLOCK) puts each
 * slice where the block-aligned read of it lands, so nothing is copied
 * after a read.
 *
 * The serial engine (io_engine serial, the one before) reads on the pager's
 * copy thread one region at a time with pread; a region whose slot address,
 * file offset and length are not all block multiples goes through an
 * aligned bounce buffer (chunks of QM__DISK_CHUNK) and is copied out.
 * Nothing here falls back silently: when the file cannot be read this way
 * the pager keeps the mapping and says why (qm_pager_source_info). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_clock.h"
#include "qm_pager_disk.h"
#include "qm_pager_io.h"

#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif
#ifndef RAMFS_MAGIC
#define RAMFS_MAGIC 0x858458f6
#endif

#define QM__DISK_ALIGN QM__DISK_BLOCK     /* covers 512- and 4096-byte logical blocks */
#define QM__DISK_CHUNK (4u << 20)          /* the serial engine's bounce buffer */
_Static_assert(QM__DISK_BLOCK == QM__IO_ALIGN, "the layout's block is the I/O engine's");
_Static_assert(QM__IO_MAX_REGIONS >= QM_T_EXPERT_COUNT, "a request holds every expert tensor");

struct qm__disk {
    int fd;
    const uint8_t *map;   /* the bank's mapping: file offset = pointer - map */
    uint64_t map_bytes;
    uint8_t *bounce_raw, *bounce; /* serial engine */
    /* The serial engine's counters (the copy thread writes them). */
    atomic_uint_fast64_t bytes_read, reads, busy_us;
    atomic_uint_fast64_t errors;
    qm_pager_read_cb hook;
    void *hook_ud;
    char path[256];
    /* The I/O engine (NULL: serial) and one request per slot. */
    qm__io *io;
    qm__io_req *reqs;
    uint32_t n_reqs;
    uint64_t call_reads; /* reads when the forward call began (serial) */
    char io_why[256];    /* why io_uring is not used / buffers not registered */
};

static void qm__why(qm_pager *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void qm__why(qm_pager *p, const char *fmt, ...)
{
    size_t n = strlen(p->source_why);
    if (n + 3 >= sizeof p->source_why)
        return;
    if (n)
        n += (size_t)snprintf(p->source_why + n, sizeof p->source_why - n, "; ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->source_why + n, sizeof p->source_why - n, fmt, ap);
    va_end(ap);
}

/* One aligned pread; the bytes it got, or a negative errno. */
static int64_t qm__pread(struct qm__disk *d, void *buf, uint64_t len, uint64_t off)
{
    if (d->hook) {
        int e = d->hook(d->hook_ud, off, len);
        if (e)
            return -(int64_t)e;
    }
    uint64_t got = 0, t0 = qm__now_us();
    while (got < len) {
        ssize_t r = pread(d->fd, (uint8_t *)buf + got, (size_t)(len - got), (off_t)(off + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -(int64_t)errno;
        if (r == 0)
            break; /* end of file */
        got += (uint64_t)r;
        atomic_fetch_add(&d->reads, 1);
        atomic_fetch_add(&d->bytes_read, (uint64_t)r);
        if (got % QM__DISK_ALIGN)
            break; /* a short read ends at end of file */
    }
    atomic_fetch_add(&d->busy_us, qm__now_us() - t0);
    return (int64_t)got;
}

int qm__pager_disk_read(qm_pager *p, void *dst, const void *src, uint64_t len, qm_status *st)
{
    struct qm__disk *d = p->disk;
    uint64_t off = (uint64_t)((const uint8_t *)src - d->map);
    uint8_t *out = dst;
    int64_t r = 0;
    const char *what = NULL;
    if (((uintptr_t)out | off | len) % QM__DISK_ALIGN == 0) {
        r = qm__pread(d, out, len, off);
        if (r >= 0 && (uint64_t)r < len)
            what = "truncated";
    } else {
        uint64_t pos = off, end = off + len;
        while (pos < end && r >= 0 && !what) {
            uint64_t a0 = pos / QM__DISK_ALIGN * QM__DISK_ALIGN;
            uint64_t a1 = (end + QM__DISK_ALIGN - 1) / QM__DISK_ALIGN * QM__DISK_ALIGN;
            if (a1 - a0 > QM__DISK_CHUNK)
                a1 = a0 + QM__DISK_CHUNK;
            r = qm__pread(d, d->bounce, a1 - a0, a0);
            if (r < 0)
                break;
            uint64_t stop = a1 < end ? a1 : end;
            if ((uint64_t)r < stop - a0) {
                what = "truncated";
                break;
            }
            memcpy(out, d->bounce + (pos - a0), (size_t)(stop - pos));
            out += stop - pos;
            pos = stop;
        }
    }
    if (r >= 0 && !what)
        return 0;
    atomic_fetch_add(&d->errors, 1);
    if (what)
        return qm_status_set(st, QM_EIO,
                             "bank file %s is truncated: %llu bytes at offset %llu are past its "
                             "end",
                             d->path, (unsigned long long)len, (unsigned long long)off);
    return qm_status_set(st, QM_EIO, "reading %llu bytes at offset %llu of bank file %s: %s",
                         (unsigned long long)len, (unsigned long long)off, d->path,
                         strerror((int)-r));
}

/* The disk source refused: what was opened is closed, the pager serves
 * from the mapping (its layout too). */
static void qm__disk_refused(qm_pager *p, struct qm__disk *d)
{
    if (d) {
        if (d->fd >= 0)
            close(d->fd);
        qm_free(d->bounce_raw);
        qm_free(d);
    }
    p->opt.source = QM_PAGER_SOURCE_MMAP;
}

/* The file's first block read through the descriptor: 0, or errno. */
static int qm__disk_probe(int fd)
{
    uint8_t *raw = qm_malloc(2 * QM__DISK_ALIGN);
    if (!raw)
        return ENOMEM;
    uint8_t *buf = (uint8_t *)(((uintptr_t)raw + QM__DISK_ALIGN - 1) &
                               ~(uintptr_t)(QM__DISK_ALIGN - 1));
    ssize_t r = pread(fd, buf, QM__DISK_ALIGN, 0);
    int e = r < 0 ? errno : 0;
    qm_free(raw);
    return e;
}

/* The I/O engine, or (serial, or no engine) the bounce buffer of the
 * serial reads: 0, or -1 with why. */
static int qm__disk_start_reads(qm_pager *p, struct qm__disk *d)
{
    if (p->opt.io_engine != QM_PAGER_IO_SERIAL) {
        qm_status tmp;
        qm_status_clear(&tmp);
        if (qm__io_new(d->fd, p->opt.io_engine, p->opt.io_depth, &d->io, d->io_why,
                       sizeof d->io_why, &tmp)) {
            snprintf(d->io_why, sizeof d->io_why,
                     "no I/O engine (%.160s): reads one at a time on the copy thread", tmp.msg);
            d->io = NULL;
        }
    }
    if (d->io)
        return 0;
    d->bounce_raw = qm_malloc(QM__DISK_CHUNK + QM__DISK_ALIGN);
    if (!d->bounce_raw) {
        qm__why(p, "direct disk paging: out of memory for the bounce buffer; serving from the "
                   "mapping");
        return -1;
    }
    d->bounce = (uint8_t *)(((uintptr_t)d->bounce_raw + QM__DISK_ALIGN - 1) &
                            ~(uintptr_t)(QM__DISK_ALIGN - 1));
    return 0;
}

void qm__pager_disk_open(qm_pager *p)
{
    p->source_why[0] = '\0';
    if (p->opt.source != QM_PAGER_SOURCE_DIRECT)
        return;
    const char *path = qm_bank_path(p->bank);
    if (!qm_backend_host_visible(p->backend)) {
        qm__why(p, "direct disk paging needs a host-visible backend; serving from the mapping");
        return qm__disk_refused(p, NULL);
    }
    if (!path || !*path) {
        qm__why(p, "direct disk paging needs a bank file (this bank is in memory); serving from "
                   "the mapping");
        return qm__disk_refused(p, NULL);
    }
    struct qm__disk *d = qm_calloc(1, sizeof *d);
    if (!d) {
        qm__why(p, "direct disk paging: out of memory; serving from the mapping");
        return qm__disk_refused(p, NULL);
    }
    snprintf(d->path, sizeof d->path, "%s", path);
    d->map = qm_bank_mapping(p->bank, &d->map_bytes);
    d->fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (d->fd < 0) {
        const char *why = errno == EINVAL ? "its filesystem does not support O_DIRECT"
                                          : strerror(errno);
        qm__why(p, "direct disk paging unavailable for %s: %s; serving from the mapping (page "
                   "cache)",
                path, why);
        return qm__disk_refused(p, d);
    }
    /* tmpfs keeps the file in memory (some kernels take O_DIRECT there):
     * reading it into a locked arena would only hold it twice. */
    struct statfs fs;
    if (fstatfs(d->fd, &fs) == 0 &&
        (fs.f_type == (__typeof__(fs.f_type))TMPFS_MAGIC ||
         fs.f_type == (__typeof__(fs.f_type))RAMFS_MAGIC)) {
        qm__why(p, "direct disk paging unavailable for %s: its filesystem (tmpfs) keeps the file "
                   "in memory and does not support O_DIRECT reads from disk; serving from the "
                   "mapping",
                path);
        return qm__disk_refused(p, d);
    }
    /* Some filesystems take the flag at open and refuse the reads. */
    int e = qm__disk_probe(d->fd);
    if (e) {
        const char *why = e == EINVAL ? "its filesystem refuses O_DIRECT reads" : strerror(e);
        qm__why(p, "direct disk paging unavailable for %s: %s; serving from the mapping (page "
                   "cache)",
                path, why);
        return qm__disk_refused(p, d);
    }
    if (qm__disk_start_reads(p, d))
        return qm__disk_refused(p, d);
    p->disk = d;
    /* Compute must never read expert weights from the mapping. */
    p->opt.copy_whole_banks = 1;
}

void qm__pager_disk_lock(qm_pager *p, qm_arena *arena)
{
    if (!p->disk || !arena || qm_arena_size(arena) == 0)
        return;
    if (mlock(qm_arena_at(arena, 0), (size_t)qm_arena_size(arena)) == 0)
        return;
    int e = errno;
    char detail[128];
    struct rlimit rl;
    if ((e == ENOMEM || e == EPERM) && getrlimit(RLIMIT_MEMLOCK, &rl) == 0 &&
        rl.rlim_cur != RLIM_INFINITY)
        snprintf(detail, sizeof detail, "%s (RLIMIT_MEMLOCK is %llu bytes)", strerror(e),
                 (unsigned long long)rl.rlim_cur);
    else
        snprintf(detail, sizeof detail, "%s", strerror(e));
    if (!strstr(p->source_why, "not locked"))
        qm__why(p, "arena not locked in memory: mlock: %s; the kernel may swap it", detail);
}

void qm__pager_disk_unlock(qm_pager *p, qm_arena *arena)
{
    if (p->disk && arena && qm_arena_size(arena))
        munlock(qm_arena_at(arena, 0), (size_t)qm_arena_size(arena));
}

void qm__pager_disk_lock_range(qm_pager *p, void *base, uint64_t len)
{
    if (p->disk && len && mlock(base, (size_t)len) != 0 && !strstr(p->source_why, "not locked"))
        qm__why(p, "arena not locked in memory after a growth: mlock: %s; the kernel may swap "
                   "it",
                strerror(errno));
}

void qm__pager_disk_unlock_range(qm_pager *p, void *base, uint64_t len)
{
    if (p->disk && len)
        munlock(base, (size_t)len);
}

void qm__pager_disk_close(qm_pager *p)
{
    struct qm__disk *d = p->disk;
    if (!d)
        return;
    qm__io_free(d->io); /* waits for reads in flight */
    close(d->fd);
    qm_free(d->bounce_raw);
    qm_free(d->reqs);
    qm_free(d);
    p->disk = NULL;
}

void qm__pager_disk_drain(qm_pager *p)
{
    if (p->disk)
        qm__io_drain(p->disk->io);
}

void qm__pager_disk_stats(const qm_pager *p, qm_pager_stats *out)
{
    struct qm__disk *d = p->disk;
    if (!d)
        return;
    out->disk_bytes_read = atomic_load(&d->bytes_read);
    out->disk_reads = atomic_load(&d->reads);
    out->disk_errors = atomic_load(&d->errors);
    out->disk_busy_us = atomic_load(&d->busy_us);
    if (d->io) {
        qm__io_stats io;
        qm__io_stats_get(d->io, &io, 0);
        out->disk_bytes_read += io.bytes;
        out->disk_reads += io.reads;
        out->disk_busy_us += io.busy_us;
        out->reads_in_flight_peak = io.peak;
    }
}

/* ---- The I/O engine's requests ------------------------------------------------------- */

int qm__pager_disk_async(const qm_pager *p)
{
    return p->disk && p->disk->io;
}

int qm__pager_disk_slots(qm_pager *p, uint32_t n, qm_status *st)
{
    struct qm__disk *d = p->disk;
    if (!d || !d->io || n <= d->n_reqs)
        return 0;
    qm__io_req *r = qm_realloc(d->reqs, (size_t)n * sizeof *r);
    if (!r)
        return qm_status_set(st, QM_ENOMEM, "out of memory for %u disk read requests", n);
    memset(r + d->n_reqs, 0, (size_t)(n - d->n_reqs) * sizeof *r);
    p->stats.host_bytes += (uint64_t)(n - d->n_reqs) * sizeof *r;
    d->reqs = r;
    d->n_reqs = n;
    return 0;
}

/* How far into arena `a` its slots in use (and, in the creation arena, its
 * whole banks) reach: what is registered, so that a slot a shrink gave
 * back holds no pin and its pages really go (qm_pager_resize.c). */
static uint64_t qm__arena_live(const qm_pager *p, qm_arena *a, int creation)
{
    const uint64_t size = qm_arena_size(a);
    const uint8_t *b = qm_arena_at(a, 0);
    if (!p->slots) /* being created: all of it */
        return size;
    uint64_t live = creation ? p->arena_skew + p->sz.whole_arena : 0;
    for (uint32_t s = 0; s < p->n_slots; s++) {
        const uint8_t *sb = p->slots[s].base;
        if (sb >= b && sb < b + size && (uint64_t)(sb - b) + p->sz.slot_size > live)
            live = (uint64_t)(sb - b) + p->sz.slot_size;
    }
    return live < size ? live : size;
}

void qm__pager_disk_arenas(qm_pager *p)
{
    struct qm__disk *d = p->disk;
    if (!d || !d->io)
        return;
    size_t n = (p->arena ? 1 : 0) + p->n_grow;
    uint8_t **base = qm_calloc(n ? n : 1, sizeof *base);
    uint64_t *len = qm_calloc(n ? n : 1, sizeof *len);
    char note[200] = "";
    if (!base || !len) {
        snprintf(note, sizeof note, "buffers not registered with io_uring: out of memory");
    } else {
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            qm_arena *a = i == 0 && p->arena ? p->arena : p->grow_arenas[i - (p->arena ? 1 : 0)];
            uint64_t live = qm_arena_size(a) ? qm__arena_live(p, a, a == p->arena) : 0;
            if (!live)
                continue;
            base[k] = qm_arena_at(a, 0);
            len[k++] = live;
        }
        qm__io_set_buffers(d->io, base, len, k, note, sizeof note);
    }
    qm_free(base);
    qm_free(len);
    /* The engine's reason to fall back stays; a registration note replaces the last. */
    char *old = strstr(d->io_why, "buffers not registered");
    if (old)
        *(old > d->io_why ? old - 2 : old) = '\0';
    if (*note) {
        size_t used = strlen(d->io_why);
        snprintf(d->io_why + used, sizeof d->io_why - used, "%s%s", used ? "; " : "", note);
    }
}

/* The request reading a region of `len` bytes at file offset `off` (its
 * block-aligned cover) into the window at `win`, the bytes landing
 * `off % block` into it. */
static void qm__disk_region(qm__io_region *g, uint8_t *win, uint64_t off, uint64_t len)
{
    uint64_t phase = off % QM__DISK_ALIGN;
    g->dst = win;
    g->off = off - phase;
    g->need = phase + len;
    g->len = (g->need + QM__DISK_ALIGN - 1) / QM__DISK_ALIGN * QM__DISK_ALIGN;
}

int qm__pager_disk_submit(qm_pager *p, int32_t s, int prefetch, qm_status *st)
{
    struct qm__disk *d = p->disk;
    if ((uint32_t)s >= d->n_reqs)
        return qm_status_set(st, QM_EINTERNAL, "slot %d has no disk read request (%u)", s,
                             d->n_reqs);
    const qm__slot *sl = &p->slots[s];
    const qm__layer *L = &p->layers[sl->layer];
    qm__io_req *r = &d->reqs[s];
    r->n_reg = 0;
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        if (!L->view->t[t].present || L->slice[t] == 0)
            continue;
        qm__disk_region(&r->reg[r->n_reg++], sl->base + L->unit_off[t],
                        L->file_off[t] + (uint64_t)sl->expert * L->slice[t], L->slice[t]);
    }
    qm__io_submit(d->io, r, prefetch ? QM__IO_PREFETCH : QM__IO_DEMAND);
    return 0;
}

void qm__pager_disk_promote(qm_pager *p, int32_t s)
{
    qm__io_promote(p->disk->io, &p->disk->reqs[s]);
}

int qm__pager_disk_park(qm_pager *p, int32_t s)
{
    return qm__io_park(p->disk->io, &p->disk->reqs[s]);
}

int qm__pager_disk_unpark(qm_pager *p, int32_t s)
{
    return qm__io_unpark(p->disk->io, &p->disk->reqs[s], QM__IO_PREFETCH);
}

int qm__pager_disk_parked(qm_pager *p, int32_t s)
{
    return qm__io_parked(p->disk->io, &p->disk->reqs[s]);
}

void qm__pager_disk_settle(qm_pager *p, int32_t s)
{
    qm__io_settle(p->disk->io, &p->disk->reqs[s]);
}

int qm__pager_disk_landed(qm_pager *p, int32_t s)
{
    return qm__io_done(p->disk->io, &p->disk->reqs[s]);
}

/* The result of a finished request: 0, or QM_EIO naming the file and the
 * offset of the read that failed. */
static int qm__disk_result(struct qm__disk *d, const qm__io_req *r, qm_status *st)
{
    if (!r->err && !r->truncated)
        return 0;
    atomic_fetch_add(&d->errors, 1);
    if (r->truncated)
        return qm_status_set(st, QM_EIO,
                             "bank file %s is truncated: %llu bytes at offset %llu are past its "
                             "end",
                             d->path, (unsigned long long)r->err_len,
                             (unsigned long long)r->err_off);
    return qm_status_set(st, QM_EIO, "reading %llu bytes at offset %llu of bank file %s: %s",
                         (unsigned long long)r->err_len, (unsigned long long)r->err_off, d->path,
                         strerror(r->err));
}

int qm__pager_disk_wait(qm_pager *p, int32_t s, qm_status *st)
{
    qm__io_req *r = &p->disk->reqs[s];
    qm__io_wait(p->disk->io, r);
    return qm__disk_result(p->disk, r, st);
}

size_t qm__pager_disk_wait_any(qm_pager *p, const int32_t *slots, size_t n)
{
    struct qm__disk *d = p->disk;
    qm__io_req *some[64];
    size_t m = n < 64 ? n : 64; /* the first 64 of them: enough to make progress */
    for (size_t i = 0; i < m; i++)
        some[i] = &d->reqs[slots[i]];
    return qm__io_wait_any(d->io, some, m);
}

int qm__pager_disk_read_whole(qm_pager *p, qm_status *st)
{
    struct qm__disk *d = p->disk;
    uint32_t n = 0;
    qm__io_req *r = qm_calloc(p->n_layers ? p->n_layers : 1, sizeof *r);
    if (!r)
        return qm_status_set(st, QM_ENOMEM, "out of memory reading whole banks");
    /* One request per layer, all in flight together; landed in layer order. */
    for (uint32_t l = 0; l < p->n_layers; l++) {
        const qm__layer *L = &p->layers[l];
        if (!L->whole_base)
            continue;
        for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
            const qm_tensor_view *tv = &L->view->t[t];
            if (!tv->present || tv->nbytes == 0)
                continue;
            uint64_t phase = L->file_off[t] % QM__DISK_ALIGN;
            qm__disk_region(&r[l].reg[r[l].n_reg++], L->whole_base + L->tensor_off[t] - phase,
                            L->file_off[t], tv->nbytes);
        }
        qm__io_submit(d->io, &r[l], QM__IO_DEMAND);
        n++;
    }
    int rc = 0;
    for (uint32_t l = 0; l < p->n_layers; l++) {
        if (!p->layers[l].whole_base)
            continue;
        qm__io_wait(d->io, &r[l]);
        if (rc == 0)
            rc = qm__disk_result(d, &r[l], st);
    }
    qm_free(r);
    return rc;
}

void qm__pager_disk_call_begin(qm_pager *p)
{
    struct qm__disk *d = p->disk;
    if (!d)
        return;
    if (d->io) {
        qm__io_stats io;
        qm__io_stats_get(d->io, &io, 1);
    } else {
        d->call_reads = atomic_load(&d->reads);
    }
}

void qm__pager_disk_call_end(qm_pager *p)
{
    struct qm__disk *d = p->disk;
    if (!d)
        return;
    uint64_t most = 0;
    if (d->io) {
        qm__io_stats io;
        qm__io_stats_get(d->io, &io, 0);
        most = io.mark_peak;
    } else if (atomic_load(&d->reads) != d->call_reads) {
        most = 1; /* the serial engine: one read at a time */
        if (p->stats.reads_in_flight_peak < 1)
            p->stats.reads_in_flight_peak = 1;
    }
    if (most) {
        p->stats.read_calls++;
        p->stats.reads_in_flight_sum += most;
    }
}

int qm_pager_source_info(const qm_pager *p, const char **why)
{
    if (why)
        *why = p ? p->source_why : "";
    return p && p->disk ? QM_PAGER_SOURCE_DIRECT : QM_PAGER_SOURCE_MMAP;
}

void qm_pager_set_read_hook(qm_pager *p, qm_pager_read_cb cb, void *ud)
{
    if (!p || !p->disk)
        return;
    p->disk->hook = cb;
    p->disk->hook_ud = ud;
    if (p->disk->io)
        qm__io_set_hook(p->disk->io, cb, ud);
}

int qm_pager_io_info(const qm_pager *p, uint32_t *depth, const char **why)
{
    const struct qm__disk *d = p ? p->disk : NULL;
    if (depth)
        *depth = d ? (d->io ? qm__io_depth(d->io) : 1) : 0;
    if (why)
        *why = d ? d->io_why : "";
    return d ? (d->io ? qm__io_kind(d->io) : QM_PAGER_IO_SERIAL) : -1;
}
