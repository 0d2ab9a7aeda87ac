/* qm_pager_io.c - the disk source's I/O engine: requests of aligned regions
 * cut into chunks of at most QM__IO_CHUNK bytes, up to `depth` chunks in
 * flight, demand chunks issued before prefetch chunks, and prefetch chunks
 * only while no demand read is queued or in flight, QM__IO_PF_DEPTH at most
 * (so a demand read never finds more than that ahead of it). A prefetch the
 * pager no longer wants may be parked: nothing more of it is issued until
 * it is wanted again.
 *
 * Two ways to run a chunk, chosen when the engine starts:
 *   io_uring (liburing): the caller (or the completion thread) prepares an
 *     SQE per chunk and submits; one completion thread reaps CQEs, finishes
 *     chunks and issues what the freed depth allows. Destination memory is
 *     registered as fixed buffers (qm__io_set_buffers) and the file as a
 *     fixed file, so a read pins no pages and looks up no file.
 *   a pool of threads: `depth` workers, each taking one chunk at a time and
 *     calling preadv. Used where io_uring is refused (a kernel without it,
 *     kernel.io_uring_disabled, a seccomp filter, a ring that cannot be
 *     made or cannot read the file) and when asked for.
 * Request bookkeeping (queues, chunks, short reads, errors, statistics) is
 * the same for both. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
#ifdef QMOE_HAVE_LIBURING
#include <liburing.h>
#endif

#include "qm_alloc.h"
#include "qm_clock.h"
#include "qm_pager_io.h"
#include "qm_sync.h"

/* ---- The engine ----------------------------------------------------------------------- */

/* One chunk in flight. */
typedef struct qm__io_op {
    struct qm__io_op *next; /* the free list, or the pool's ready list */
    qm__io_req *req;
    uint8_t *dst;
    uint64_t off, len;
    uint64_t need_end; /* bytes up to this file offset must exist */
    uint8_t prio;
} qm__io_op;

struct qm__io {
    int kind, fd;
    uint32_t depth, pf_depth; /* chunks in flight at most; prefetch chunks at most */
    pthread_mutex_t mu;
    pthread_cond_t cv_done, cv_work;
    qm__io_req *head[QM__IO_PRIOS], *tail[QM__IO_PRIOS]; /* requests with chunks to issue */
    uint32_t in_flight, in_flight_prio[QM__IO_PRIOS];
    qm__io_op *ops, *free_ops;
    qm__io_op *ready, *ready_tail; /* the pool: chunks waiting for a worker */
    int stop;
    qm_pager_read_cb hook;
    void *hook_ud;
    uint64_t reads, bytes, busy_us, busy_since, peak, mark_peak;
    pthread_t *threads;
    uint32_t n_threads;
#ifdef QMOE_HAVE_LIBURING
    struct io_uring ring;
    int ring_up, file_fixed, reaper_up;
    pthread_t reaper;
    struct iovec *bufs;
    uint32_t n_bufs;
    uint32_t unsubmitted;
#endif
};

static void qm__io_start(qm__io *io, qm__io_op *op);
static void qm__io_flush(qm__io *io);

static void qm__io_unqueue(qm__io *io, qm__io_req *r)
{
    qm__io_req **pp = &io->head[r->prio], *prev = NULL;
    while (*pp && *pp != r) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    if (!*pp)
        return;
    *pp = r->next;
    if (io->tail[r->prio] == r)
        io->tail[r->prio] = prev;
    r->next = NULL;
    r->queued = 0;
}

static void qm__io_enqueue(qm__io *io, qm__io_req *r)
{
    r->next = NULL;
    if (io->tail[r->prio])
        io->tail[r->prio]->next = r;
    else
        io->head[r->prio] = r;
    io->tail[r->prio] = r;
    r->queued = 1;
}

/* Skips regions with nothing left to issue. */
static void qm__io_settle_cursor(qm__io_req *r)
{
    while (r->cur_reg < r->n_reg && r->cur_off >= r->reg[r->cur_reg].len) {
        r->cur_reg++;
        r->cur_off = 0;
    }
}

static void qm__io_finish_if_done(qm__io *io, qm__io_req *r)
{
    if (!r->queued && r->in_flight == 0 && !r->done && !r->parked) {
        r->done = 1;
        pthread_cond_broadcast(&io->cv_done);
    }
}

/* A chunk has ended with `res` (bytes read, or a negative errno). */
static void qm__io_complete(qm__io *io, qm__io_op *op, int64_t res)
{
    qm__io_req *r = op->req;
    if (res > 0) {
        io->reads++;
        io->bytes += (uint64_t)res;
    }
    if (res > 0 && (uint64_t)res < op->len && op->off + (uint64_t)res < op->need_end &&
        res % QM__IO_ALIGN == 0 && !r->err && !r->truncated) {
        /* Short, but not at the end of the file: read the rest. */
        op->dst += res;
        op->off += (uint64_t)res;
        op->len -= (uint64_t)res;
        qm__io_start(io, op);
        return;
    }
    if (res < 0 && !r->err && !r->truncated) {
        r->err = (int)-res;
        r->err_off = op->off;
        r->err_len = op->len;
    } else if (res >= 0 && (uint64_t)res < op->len && op->off + (uint64_t)res < op->need_end &&
               !r->err && !r->truncated) {
        r->truncated = 1;
        r->err_off = op->off;
        r->err_len = op->len;
    }
    if ((r->err || r->truncated) && r->queued)
        qm__io_unqueue(io, r); /* nothing more of a failed request */
    r->in_flight--;
    io->in_flight--;
    io->in_flight_prio[op->prio]--;
    if (io->in_flight == 0) {
        io->busy_us += qm__now_us() - io->busy_since;
        pthread_cond_broadcast(&io->cv_done);
    } else if (r->parked && r->in_flight == 0) {
        pthread_cond_broadcast(&io->cv_done); /* qm__io_settle */
    }
    op->next = io->free_ops;
    io->free_ops = op;
    qm__io_finish_if_done(io, r);
}

/* The request whose chunk goes next: demand first; prefetch only while the
 * disk has no demand read (queued or in flight) and fewer than pf_depth
 * prefetch chunks: on a disk that gives no more with depth, every chunk in
 * flight ahead of a demand read delays it. */
static qm__io_req *qm__io_next(qm__io *io)
{
    if (io->head[QM__IO_DEMAND])
        return io->head[QM__IO_DEMAND];
    if (io->head[QM__IO_PREFETCH] && io->in_flight_prio[QM__IO_DEMAND] == 0 &&
        io->in_flight_prio[QM__IO_PREFETCH] < io->pf_depth)
        return io->head[QM__IO_PREFETCH];
    return NULL;
}

/* Issues chunks while the depth allows. Lock held. */
static void qm__io_dispatch(qm__io *io)
{
    qm__io_req *r;
    while (io->in_flight < io->depth && io->free_ops && (r = qm__io_next(io))) {
        const qm__io_region *g = &r->reg[r->cur_reg];
        uint64_t n = g->len - r->cur_off;
        if (n > QM__IO_CHUNK)
            n = QM__IO_CHUNK;
        qm__io_op *op = io->free_ops;
        io->free_ops = op->next;
        *op = (qm__io_op){.req = r, .dst = g->dst + r->cur_off, .off = g->off + r->cur_off,
                          .len = n, .need_end = g->off + g->need, .prio = r->prio};
        r->cur_off += n;
        qm__io_settle_cursor(r);
        if (r->cur_reg >= r->n_reg)
            qm__io_unqueue(io, r);
        r->in_flight++;
        if (io->in_flight++ == 0)
            io->busy_since = qm__now_us();
        io->in_flight_prio[op->prio]++;
        if (io->in_flight > io->peak)
            io->peak = io->in_flight;
        if (io->in_flight > io->mark_peak)
            io->mark_peak = io->in_flight;
        /* io_uring's reads start here, so its hook runs here (the pool's
         * runs on the worker that reads). */
        int e = io->kind == QM_PAGER_IO_URING && io->hook ? io->hook(io->hook_ud, op->off, op->len)
                                                          : 0;
        if (e)
            qm__io_complete(io, op, -(int64_t)e);
        else
            qm__io_start(io, op);
    }
    qm__io_flush(io);
}

/* ---- The pool of preadv threads ---- */

static int64_t qm__io_preadv(int fd, uint8_t *dst, uint64_t len, uint64_t off)
{
    for (;;) {
        struct iovec v = {dst, (size_t)len};
        ssize_t r = preadv(fd, &v, 1, (off_t)off);
        if (r >= 0)
            return r;
        if (errno != EINTR)
            return -(int64_t)errno;
    }
}

static void *qm__io_worker(void *arg)
{
    qm__io *io = arg;
    pthread_mutex_lock(&io->mu);
    for (;;) {
        while (!io->ready && !io->stop)
            pthread_cond_wait(&io->cv_work, &io->mu);
        qm__io_op *op = io->ready;
        if (!op)
            break; /* stopping, nothing left */
        io->ready = op->next;
        if (!io->ready)
            io->ready_tail = NULL;
        qm_pager_read_cb hook = io->hook;
        void *ud = io->hook_ud;
        pthread_mutex_unlock(&io->mu);
        int e = hook ? hook(ud, op->off, op->len) : 0;
        int64_t res = e ? -(int64_t)e : qm__io_preadv(io->fd, op->dst, op->len, op->off);
        pthread_mutex_lock(&io->mu);
        qm__io_complete(io, op, res);
        qm__io_dispatch(io);
    }
    pthread_mutex_unlock(&io->mu);
    return NULL;
}

static int qm__io_pool_start(qm__io *io, qm_status *st)
{
    if (io->depth > QM__IO_MAX_THREADS)
        io->depth = QM__IO_MAX_THREADS;
    io->threads = qm_calloc(io->depth, sizeof *io->threads);
    if (!io->threads)
        return qm_status_set(st, QM_ENOMEM, "out of memory for the disk reader threads");
    pthread_attr_t attr;
    int have_attr = pthread_attr_init(&attr) == 0;
    if (have_attr)
        pthread_attr_setstacksize(&attr, 128u << 10); /* a preadv loop needs little stack */
    for (; io->n_threads < io->depth; io->n_threads++)
        if (pthread_create(&io->threads[io->n_threads], have_attr ? &attr : NULL, qm__io_worker,
                           io))
            break;
    if (have_attr)
        pthread_attr_destroy(&attr);
    if (io->n_threads == 0)
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED, "cannot start a disk reader thread");
    io->depth = io->n_threads; /* a chunk in flight is a worker busy */
    return 0;
}

static void qm__io_pool_stop(qm__io *io)
{
    qm_workers_stop(&io->mu, &io->cv_work, &io->stop, io->threads, io->n_threads);
    qm_free(io->threads);
    io->threads = NULL;
    io->n_threads = 0;
}

/* ---- io_uring ---- */

#ifdef QMOE_HAVE_LIBURING
/* The fixed buffer holding dst..dst+len, or -1. */
static int qm__io_buf_of(const qm__io *io, const uint8_t *dst, uint64_t len)
{
    for (uint32_t i = 0; i < io->n_bufs; i++) {
        const uint8_t *b = io->bufs[i].iov_base;
        if (dst >= b && dst + len <= b + io->bufs[i].iov_len)
            return (int)i;
    }
    return -1;
}

static void qm__io_uring_start(qm__io *io, qm__io_op *op)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
    if (!sqe) {
        qm__io_flush(io);
        sqe = io_uring_get_sqe(&io->ring);
    }
    if (!sqe) { /* cannot happen: the ring holds more entries than the depth */
        qm__io_complete(io, op, -EBUSY);
        return;
    }
    int fd = io->file_fixed ? 0 : io->fd, buf = qm__io_buf_of(io, op->dst, op->len);
    if (buf >= 0)
        io_uring_prep_read_fixed(sqe, fd, op->dst, (unsigned)op->len, op->off, buf);
    else
        io_uring_prep_read(sqe, fd, op->dst, (unsigned)op->len, op->off);
    if (io->file_fixed)
        sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, op);
    io->unsubmitted++;
}

static void qm__io_uring_flush(qm__io *io)
{
    for (int tries = 0; io->unsubmitted && tries < 1000; tries++) {
        int r = io_uring_submit(&io->ring);
        if (r >= 0) {
            io->unsubmitted = 0;
            break;
        }
        if (r != -EINTR && r != -EAGAIN && r != -EBUSY)
            break; /* the SQEs stay in the ring: the next submit takes them */
        sched_yield();
    }
}

static void *qm__io_reaper(void *arg)
{
    qm__io *io = arg;
    for (;;) {
        struct io_uring_cqe *cqe = NULL;
        int r = io_uring_wait_cqe(&io->ring, &cqe);
        if (r == -EINTR || r == -EAGAIN || r == -ETIME)
            continue;
        if (r < 0)
            break;
        int quit = 0;
        unsigned head, n = 0;
        pthread_mutex_lock(&io->mu);
        io_uring_for_each_cqe(&io->ring, head, cqe)
        {
            qm__io_op *op = io_uring_cqe_get_data(cqe);
            n++;
            if (!op)
                quit = 1; /* the stop marker */
            else if (cqe->res == -EINTR || cqe->res == -EAGAIN)
                qm__io_uring_start(io, op); /* try again */
            else
                qm__io_complete(io, op, cqe->res);
        }
        io_uring_cq_advance(&io->ring, n);
        qm__io_dispatch(io);
        pthread_mutex_unlock(&io->mu);
        if (quit)
            break;
    }
    return NULL;
}

static int qm__io_reaper_start(qm__io *io)
{
    if (pthread_create(&io->reaper, NULL, qm__io_reaper, io))
        return -1;
    io->reaper_up = 1;
    return 0;
}

/* Stops the completion thread (nothing in flight): a NOP whose data is the
 * stop marker. Lock not held. */
static void qm__io_reaper_stop(qm__io *io)
{
    if (!io->reaper_up)
        return;
    pthread_mutex_lock(&io->mu);
    struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
    if (sqe) {
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data(sqe, NULL);
        io->unsubmitted++;
        qm__io_uring_flush(io);
    }
    pthread_mutex_unlock(&io->mu);
    pthread_join(io->reaper, NULL);
    io->reaper_up = 0;
}

static void qm__io_sysctl_note(char *out, size_t cap)
{
    FILE *f = fopen("/proc/sys/kernel/io_uring_disabled", "r");
    int v = -1;
    if (f) {
        if (fscanf(f, "%d", &v) != 1)
            v = -1;
        fclose(f);
    }
    if (v > 0)
        snprintf(out, cap, " (kernel.io_uring_disabled = %d)", v);
    else
        out[0] = '\0';
}

/* Makes the ring, registers the file and reads the file's first block
 * through it; 0, or -1 with why. */
static int qm__io_uring_open(qm__io *io, char *why, size_t cap)
{
    unsigned entries = 1;
    while (entries < io->depth + 1)
        entries <<= 1;
    int r = io_uring_queue_init(entries, &io->ring, 0);
    if (r < 0) {
        char note[64];
        qm__io_sysctl_note(note, sizeof note);
        snprintf(why, cap, "io_uring refused: %s%s%s", strerror(-r), note,
                 r == -ENOSYS ? " (a kernel without io_uring, or a seccomp filter)" : "");
        return -1;
    }
    io->ring_up = 1;
    io->file_fixed = io_uring_register_files(&io->ring, &io->fd, 1) == 0;
    /* One read of the first block proves the ring can read this file. */
    uint8_t *raw = qm_malloc(2 * QM__IO_ALIGN), *buf;
    if (!raw) {
        snprintf(why, cap, "io_uring probe: out of memory");
        return -1;
    }
    buf = (uint8_t *)(((uintptr_t)raw + QM__IO_ALIGN - 1) & ~(uintptr_t)(QM__IO_ALIGN - 1));
    struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
    io_uring_prep_read(sqe, io->file_fixed ? 0 : io->fd, buf, QM__IO_ALIGN, 0);
    if (io->file_fixed)
        sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, raw);
    struct io_uring_cqe *cqe = NULL;
    r = io_uring_submit(&io->ring);
    if (r >= 0)
        while ((r = io_uring_wait_cqe(&io->ring, &cqe)) == -EINTR) {
        }
    int res = r < 0 ? r : cqe->res;
    if (r >= 0)
        io_uring_cqe_seen(&io->ring, cqe);
    qm_free(raw);
    if (res < 0) {
        snprintf(why, cap, "io_uring cannot read the bank file: %s", strerror(-res));
        return -1;
    }
    if (qm__io_reaper_start(io)) {
        snprintf(why, cap, "io_uring: cannot start its completion thread");
        return -1;
    }
    return 0;
}

static void qm__io_uring_close(qm__io *io)
{
    qm__io_reaper_stop(io);
    if (io->ring_up)
        io_uring_queue_exit(&io->ring);
    io->ring_up = 0;
    qm_free(io->bufs);
    io->bufs = NULL;
    io->n_bufs = 0;
}
#endif

static void qm__io_start(qm__io *io, qm__io_op *op)
{
#ifdef QMOE_HAVE_LIBURING
    if (io->kind == QM_PAGER_IO_URING) {
        qm__io_uring_start(io, op);
        return;
    }
#endif
    op->next = NULL;
    if (io->ready_tail)
        io->ready_tail->next = op;
    else
        io->ready = op;
    io->ready_tail = op;
    pthread_cond_signal(&io->cv_work);
}

static void qm__io_flush(qm__io *io)
{
#ifdef QMOE_HAVE_LIBURING
    if (io->kind == QM_PAGER_IO_URING)
        qm__io_uring_flush(io);
#else
    (void)io;
#endif
}

/* ---- Life cycle ---- */

int qm__io_new(int fd, int engine, uint32_t depth, qm__io **out, char *why, size_t why_cap,
               qm_status *st)
{
    *out = NULL;
    if (why_cap)
        why[0] = '\0';
    qm__io *io = qm_calloc(1, sizeof *io);
    if (!io)
        return qm_status_set(st, QM_ENOMEM, "out of memory for the disk I/O engine");
    io->fd = fd;
    io->depth = depth ? depth : QM__IO_DEFAULT_DEPTH;
    if (io->depth > QM__IO_MAX_DEPTH)
        io->depth = QM__IO_MAX_DEPTH;
    if (qm_lock2_init(&io->mu, &io->cv_done, &io->cv_work)) {
        qm_free(io);
        return qm_status_set(st, QM_ERESOURCE_EXHAUSTED,
                             "cannot set up the disk I/O engine's lock");
    }
    io->kind = QM_PAGER_IO_THREADS;
#ifdef QMOE_HAVE_LIBURING
    if (engine != QM_PAGER_IO_THREADS) {
        if (qm__io_uring_open(io, why, why_cap) == 0)
            io->kind = QM_PAGER_IO_URING;
        else
            qm__io_uring_close(io);
    }
#else
    if (engine != QM_PAGER_IO_THREADS)
        snprintf(why, why_cap, "built without liburing");
#endif
    int rc = io->kind == QM_PAGER_IO_THREADS ? qm__io_pool_start(io, st) : 0;
    if (rc == 0) {
        io->ops = qm_calloc(io->depth, sizeof *io->ops);
        if (!io->ops)
            rc = qm_status_set(st, QM_ENOMEM, "out of memory for the disk I/O engine");
    }
    if (rc) {
        qm__io_free(io);
        return rc;
    }
    for (uint32_t i = 0; i < io->depth; i++) {
        io->ops[i].next = io->free_ops;
        io->free_ops = &io->ops[i];
    }
    io->pf_depth = io->depth > 1 ? io->depth / 2 : 1;
    if (io->pf_depth > QM__IO_PF_DEPTH)
        io->pf_depth = QM__IO_PF_DEPTH;
    *out = io;
    return 0;
}

void qm__io_drain(qm__io *io)
{
    if (!io)
        return;
    pthread_mutex_lock(&io->mu);
    while (io->in_flight || io->head[QM__IO_DEMAND] || io->head[QM__IO_PREFETCH])
        pthread_cond_wait(&io->cv_done, &io->mu);
    pthread_mutex_unlock(&io->mu);
}

void qm__io_free(qm__io *io)
{
    if (!io)
        return;
    qm__io_drain(io);
#ifdef QMOE_HAVE_LIBURING
    qm__io_uring_close(io);
#endif
    if (io->threads)
        qm__io_pool_stop(io);
    qm_lock2_destroy(&io->mu, &io->cv_done, &io->cv_work);
    qm_free(io->ops);
    qm_free(io);
}

int qm__io_kind(const qm__io *io)
{
    return io ? io->kind : -1;
}

uint32_t qm__io_depth(const qm__io *io)
{
    return io ? io->depth : 0;
}

void qm__io_set_buffers(qm__io *io, uint8_t *const *base, const uint64_t *len, size_t n,
                        char *note, size_t note_cap)
{
    if (note_cap)
        note[0] = '\0';
#ifdef QMOE_HAVE_LIBURING
    if (io->kind != QM_PAGER_IO_URING)
        return;
    /* Registration quiesces the ring on older kernels, which a thread
     * waiting in it would block: the completion thread stops meanwhile. */
    qm__io_reaper_stop(io);
    if (io->n_bufs)
        io_uring_unregister_buffers(&io->ring);
    qm_free(io->bufs);
    io->bufs = NULL;
    io->n_bufs = 0;
    const uint64_t piece = 1ull << 30; /* the kernel's limit per buffer */
    size_t count = 0;
    for (size_t i = 0; i < n; i++)
        count += (size_t)((len[i] + piece - 1) / piece);
    struct iovec *v = count ? qm_calloc(count, sizeof *v) : NULL;
    if (count && !v) {
        snprintf(note, note_cap, "buffers not registered with io_uring: out of memory");
    } else if (count) {
        size_t k = 0;
        for (size_t i = 0; i < n; i++)
            for (uint64_t o = 0; o < len[i]; o += piece)
                v[k++] = (struct iovec){base[i] + o, (size_t)(len[i] - o < piece ? len[i] - o
                                                                                 : piece)};
        int r = count <= 65535 ? io_uring_register_buffers(&io->ring, v, (unsigned)count)
                               : -E2BIG;
        if (r == 0) {
            io->bufs = v;
            io->n_bufs = (uint32_t)count;
        } else {
            qm_free(v);
            snprintf(note, note_cap,
                     "buffers not registered with io_uring (%s%s); reads pin their pages each "
                     "time",
                     strerror(-r), r == -ENOMEM || r == -EPERM ? ": RLIMIT_MEMLOCK?" : "");
        }
    }
    if (qm__io_reaper_start(io) != 0) {
        /* No completion thread: nothing would land. Fall back to the pool. */
        qm_status tmp;
        qm__io_uring_close(io);
        io->kind = QM_PAGER_IO_THREADS;
        uint32_t depth = io->depth;
        if (qm__io_pool_start(io, &tmp) != 0)
            io->depth = depth; /* reads will wait forever; cannot happen without threads */
        snprintf(note, note_cap, "io_uring's completion thread could not restart: threads");
    }
#else
    (void)io;
    (void)base;
    (void)len;
    (void)n;
#endif
}

void qm__io_set_hook(qm__io *io, qm_pager_read_cb cb, void *ud)
{
    pthread_mutex_lock(&io->mu);
    io->hook = cb;
    io->hook_ud = ud;
    pthread_mutex_unlock(&io->mu);
}

/* ---- Requests ---- */

void qm__io_submit(qm__io *io, qm__io_req *req, int prio)
{
    req->next = NULL;
    req->cur_reg = 0;
    req->cur_off = 0;
    req->in_flight = 0;
    req->queued = 0;
    req->done = 0;
    req->parked = 0;
    req->err = req->truncated = 0;
    req->err_off = req->err_len = 0;
    req->prio = prio == QM__IO_PREFETCH ? QM__IO_PREFETCH : QM__IO_DEMAND;
    qm__io_settle_cursor(req);
    pthread_mutex_lock(&io->mu);
    if (req->cur_reg >= req->n_reg)
        req->done = 1; /* nothing to read */
    else
        qm__io_enqueue(io, req);
    qm__io_dispatch(io);
    pthread_mutex_unlock(&io->mu);
}

/* A parked request goes on at prio from its cursor (done at once when it
 * failed, or had nothing left to issue). Lock held. */
static int qm__io_unpark_locked(qm__io *io, qm__io_req *req, int prio)
{
    if (!req->parked)
        return 0;
    req->parked = 0;
    req->prio = prio == QM__IO_PREFETCH ? QM__IO_PREFETCH : QM__IO_DEMAND;
    if (!req->err && !req->truncated && req->cur_reg < req->n_reg)
        qm__io_enqueue(io, req);
    qm__io_finish_if_done(io, req);
    qm__io_dispatch(io);
    return 1;
}

static void qm__io_promote_locked(qm__io *io, qm__io_req *req)
{
    if (qm__io_unpark_locked(io, req, QM__IO_DEMAND) || req->prio == QM__IO_DEMAND)
        return;
    if (req->queued) {
        qm__io_unqueue(io, req);
        req->prio = QM__IO_DEMAND;
        qm__io_enqueue(io, req);
        qm__io_dispatch(io);
    } else {
        req->prio = QM__IO_DEMAND;
    }
}

void qm__io_promote(qm__io *io, qm__io_req *req)
{
    pthread_mutex_lock(&io->mu);
    qm__io_promote_locked(io, req);
    pthread_mutex_unlock(&io->mu);
}

int qm__io_park(qm__io *io, qm__io_req *req)
{
    pthread_mutex_lock(&io->mu);
    int park = req->queued && req->prio == QM__IO_PREFETCH && !req->done;
    if (park) {
        qm__io_unqueue(io, req);
        req->parked = 1;
    }
    pthread_mutex_unlock(&io->mu);
    return park;
}

int qm__io_unpark(qm__io *io, qm__io_req *req, int prio)
{
    pthread_mutex_lock(&io->mu);
    int was = qm__io_unpark_locked(io, req, prio);
    pthread_mutex_unlock(&io->mu);
    return was;
}

int qm__io_parked(qm__io *io, const qm__io_req *req)
{
    pthread_mutex_lock(&io->mu);
    int parked = req->parked;
    pthread_mutex_unlock(&io->mu);
    return parked;
}

void qm__io_settle(qm__io *io, qm__io_req *req)
{
    pthread_mutex_lock(&io->mu);
    while (req->in_flight)
        pthread_cond_wait(&io->cv_done, &io->mu);
    pthread_mutex_unlock(&io->mu);
}

int qm__io_done(qm__io *io, const qm__io_req *req)
{
    pthread_mutex_lock(&io->mu);
    int done = req->done;
    pthread_mutex_unlock(&io->mu);
    return done;
}

void qm__io_wait(qm__io *io, qm__io_req *req)
{
    pthread_mutex_lock(&io->mu);
    qm__io_promote_locked(io, req);
    while (!req->done)
        pthread_cond_wait(&io->cv_done, &io->mu);
    pthread_mutex_unlock(&io->mu);
}

size_t qm__io_wait_any(qm__io *io, qm__io_req *const *reqs, size_t n)
{
    if (n == 0)
        return 0;
    pthread_mutex_lock(&io->mu);
    for (size_t i = 0; i < n; i++)
        (void)qm__io_unpark_locked(io, reqs[i], QM__IO_DEMAND); /* waited for: wanted */
    for (;;) {
        for (size_t i = 0; i < n; i++) {
            if (reqs[i]->done) {
                pthread_mutex_unlock(&io->mu);
                return i;
            }
        }
        pthread_cond_wait(&io->cv_done, &io->mu);
    }
}

void qm__io_stats_get(qm__io *io, qm__io_stats *out, int mark)
{
    pthread_mutex_lock(&io->mu);
    out->reads = io->reads;
    out->bytes = io->bytes;
    out->busy_us = io->busy_us + (io->in_flight ? qm__now_us() - io->busy_since : 0);
    out->peak = io->peak;
    out->mark_peak = io->mark_peak;
    if (mark)
        io->mark_peak = io->in_flight;
    pthread_mutex_unlock(&io->mu);
}
