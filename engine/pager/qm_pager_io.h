/* qm_pager_io.h - the disk source's I/O engine (qm_pager_io.c): reads of
 * aligned regions of one file, many in flight at once, demand reads before
 * prefetches. io_uring (liburing) with the destination memory registered as
 * fixed buffers and the file as a fixed file where the kernel allows it,
 * else a pool of threads calling preadv. It knows nothing of slots or
 * experts: the disk source (qm_pager_disk.c) above it turns units and whole
 * banks into requests. Private to engine/.
 *
 * Threading: every function may be called from any thread; one mutex
 * guards the engine. Completions are handled on the engine's own threads
 * (io_uring: one completion thread; the pool: its workers), so reads keep
 * landing, and queued ones keep being issued, while the caller computes. */
#ifndef QM_PAGER_IO_H
#define QM_PAGER_IO_H

#include <stddef.h>
#include <stdint.h>

#include "qm_error.h"
#include "qm_pager.h"

/* Buffers, file offsets and lengths of every read are multiples of this
 * (O_DIRECT: covers 512- and 4096-byte logical blocks). */
#define QM__IO_ALIGN 4096u
/* Regions of one request at most: one per expert tensor. */
#define QM__IO_MAX_REGIONS 12u
/* Reads in flight at once by default, and the bound of io_depth. */
#define QM__IO_DEFAULT_DEPTH QM_PAGER_IO_DEPTH_DEFAULT
#define QM__IO_MAX_DEPTH QM_PAGER_IO_DEPTH_MAX
/* The largest single read: a region longer than this is read in chunks
 * (several in flight), so that a demand read can pass a long prefetch. */
#define QM__IO_CHUNK (2u << 20)
/* Prefetch chunks in flight at most: what a demand read that arrives can
 * find ahead of it on the disk (prefetch chunks are issued only while no
 * demand read is queued or in flight). */
#define QM__IO_PF_DEPTH 2u
/* Worker threads of the preadv pool at most (the depth in force is capped to it). */
#define QM__IO_MAX_THREADS 64u

enum { QM__IO_DEMAND = 0, QM__IO_PREFETCH = 1, QM__IO_PRIOS };

/* len bytes of the file at `off` into dst, all three multiples of
 * QM__IO_ALIGN. Only the first `need` bytes must exist: the rest pads a
 * region to the block size and may lie past the end of the file. */
typedef struct qm__io_region {
    uint8_t *dst;
    uint64_t off, len, need;
} qm__io_region;

/* One request: its regions are read together. Owned by the caller, which
 * fills reg[0..n_reg) and keeps the request at the same address from
 * qm__io_submit until the engine says it is done (qm__io_done, _wait,
 * _wait_any). The fields after n_reg are the engine's. */
typedef struct qm__io_req {
    qm__io_region reg[QM__IO_MAX_REGIONS];
    uint32_t n_reg;
    struct qm__io_req *next; /* in its priority's queue while chunks remain to issue */
    uint32_t cur_reg;        /* the next chunk to issue: region and offset in it */
    uint64_t cur_off;
    uint32_t in_flight;      /* chunks issued and not completed */
    uint8_t prio, queued, done;
    /* A prefetch stopped where it was (qm__io_park): nothing more of it is
     * issued, and it is not done, until qm__io_unpark, qm__io_promote or a
     * wait takes it up again. */
    uint8_t parked;
    /* The first failure: a positive errno, or truncated (the file ended
     * before err_off + err_len); err_off/err_len name the failed read. */
    int err, truncated;
    uint64_t err_off, err_len;
} qm__io_req;

typedef struct qm__io qm__io;

/* Statistics since the engine started (reads, bytes, busy time: the time
 * with at least one read in flight; peak: most reads in flight at once),
 * and the peak since the last mark (qm__io_stats with mark = 1). */
typedef struct qm__io_stats {
    uint64_t reads, bytes, busy_us, peak, mark_peak;
} qm__io_stats;

/* Starts an engine reading `fd` (borrowed; opened O_DIRECT) with at most
 * `depth` reads in flight (0 = QM__IO_DEFAULT_DEPTH; capped to
 * QM__IO_MAX_DEPTH, and to QM__IO_MAX_THREADS for the pool). `engine`
 * QM_PAGER_IO_AUTO tries io_uring (a ring, the file registered, one read of
 * the file's first block) and falls back to the pool, writing why into
 * `why` ("" when io_uring runs); QM_PAGER_IO_THREADS starts the pool
 * ("" in why). Errors: QM_ENOMEM, QM_ERESOURCE_EXHAUSTED (no thread). */
int qm__io_new(int fd, int engine, uint32_t depth, qm__io **out, char *why, size_t why_cap,
               qm_status *st);
/* Waits for every read in flight, then stops. Accepts NULL. */
void qm__io_free(qm__io *io);
/* Waits until nothing is queued or in flight (before the memory reads
 * land in goes away). Accepts NULL. */
void qm__io_drain(qm__io *io);
/* QM_PAGER_IO_URING or QM_PAGER_IO_THREADS, and the reads in flight at most. */
int qm__io_kind(const qm__io *io);
uint32_t qm__io_depth(const qm__io *io);

/* Registers the ranges base[i]..base[i]+len[i] as io_uring fixed buffers
 * (replacing earlier ones; pieces of at most 1 GiB), so reads into them
 * skip pinning pages per read. Nothing may be in flight. A refusal
 * (RLIMIT_MEMLOCK, ENOMEM) keeps reads working through plain buffers and
 * writes why into `note` ("" otherwise). The pool ignores it. */
void qm__io_set_buffers(qm__io *io, uint8_t *const *base, const uint64_t *len, size_t n,
                        char *note, size_t note_cap);
/* Called before each read (off, len): a non-zero errno fails that read as
 * if the disk had (qm_pager_set_read_hook). io_uring calls it under the
 * engine's lock as it issues the read; the pool on the worker about to
 * read, outside the lock (so several at once, and a hook that sleeps
 * holds that read, and only it, in flight). */
void qm__io_set_hook(qm__io *io, qm_pager_read_cb cb, void *ud);

/* Queues req (QM__IO_DEMAND or QM__IO_PREFETCH) and issues what the depth
 * allows: demand chunks first; prefetch chunks only while no demand read is
 * queued or in flight, QM__IO_PF_DEPTH of them at most, so a demand read
 * finds at most that many prefetch chunks ahead of it on the disk. */
void qm__io_submit(qm__io *io, qm__io_req *req, int prio);
/* A queued or parked prefetch becomes a demand read (its chunks not yet
 * issued go before every prefetch). */
void qm__io_promote(qm__io *io, qm__io_req *req);
/* Stops a prefetch with chunks still to issue where it is: 1 when parked
 * (its chunks in flight still land), 0 when there was nothing to stop (a
 * demand read, done, or every chunk issued). */
int qm__io_park(qm__io *io, qm__io_req *req);
/* A parked request goes on at `prio` from where it stopped; 0 when it was
 * not parked. */
int qm__io_unpark(qm__io *io, qm__io_req *req, int prio);
/* 1 while req is parked. */
int qm__io_parked(qm__io *io, const qm__io_req *req);
/* Waits until none of req's chunks is in flight (a parked request: then
 * its memory may be reused, and the request submitted again). */
void qm__io_settle(qm__io *io, qm__io_req *req);
/* 1 when req is done (landed or failed), without waiting. */
int qm__io_done(qm__io *io, const qm__io_req *req);
/* Waits for req (promoted to demand first). */
void qm__io_wait(qm__io *io, qm__io_req *req);
/* Waits until one of reqs[0..n) is done; its index (n when n is 0). */
size_t qm__io_wait_any(qm__io *io, qm__io_req *const *reqs, size_t n);
/* The statistics; mark 1 also starts a new mark peak at the reads in
 * flight now. */
void qm__io_stats_get(qm__io *io, qm__io_stats *out, int mark);

#endif
