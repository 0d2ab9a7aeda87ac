/* qm_pager_disk.c - the pager's disk source (QM_PAGER_SOURCE_DIRECT): expert
 * units (and whole banks) are read from the bank file with O_DIRECT straight
 * into the arena, so the page cache never holds the bank's expert weights and
 * the budget bounds the memory they take; the arena is mlock'ed where
 * permitted. Reads run where copies run (the pager's copy thread), so
 * prefetch overlaps them with compute.
 *
 * O_DIRECT wants the buffer, the file offset and the length aligned to the
 * logical block size. A region that is aligned on all three is read straight
 * into its slot; any other goes through an aligned bounce buffer (chunks of
 * QM__DISK_CHUNK) and is copied out. Nothing here falls back silently: when
 * the file cannot be read this way the pager keeps the mapping and says why
 * (qm_pager_source_info). */
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
#include "qm_pager_disk.h"

#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif
#ifndef RAMFS_MAGIC
#define RAMFS_MAGIC 0x858458f6
#endif

#define QM__DISK_ALIGN 4096u               /* covers 512- and 4096-byte logical blocks */
#define QM__DISK_CHUNK (4u << 20)          /* bounce buffer */

struct qm__disk {
    int fd;
    const uint8_t *map;   /* the bank's mapping: file offset = pointer - map */
    uint64_t map_bytes;
    uint8_t *bounce_raw, *bounce;
    atomic_uint_fast64_t bytes_read, reads, errors;
    qm_pager_read_cb hook;
    void *hook_ud;
    char path[256];
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
    uint64_t got = 0;
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

void qm__pager_disk_open(qm_pager *p)
{
    p->source_why[0] = '\0';
    if (p->opt.source != QM_PAGER_SOURCE_DIRECT)
        return;
    const char *path = qm_bank_path(p->bank);
    if (!qm_backend_host_visible(p->backend)) {
        qm__why(p, "direct disk paging needs a host-visible backend; serving from the mapping");
        return;
    }
    if (!path || !*path) {
        qm__why(p, "direct disk paging needs a bank file (this bank is in memory); serving from "
                   "the mapping");
        return;
    }
    struct qm__disk *d = qm_calloc(1, sizeof *d);
    if (!d) {
        qm__why(p, "direct disk paging: out of memory; serving from the mapping");
        return;
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
        qm_free(d);
        return;
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
        close(d->fd);
        qm_free(d);
        return;
    }
    d->bounce_raw = qm_malloc(QM__DISK_CHUNK + QM__DISK_ALIGN);
    if (!d->bounce_raw) {
        close(d->fd);
        qm_free(d);
        qm__why(p, "direct disk paging: out of memory for the bounce buffer; serving from the "
                   "mapping");
        return;
    }
    d->bounce = (uint8_t *)(((uintptr_t)d->bounce_raw + QM__DISK_ALIGN - 1) &
                            ~(uintptr_t)(QM__DISK_ALIGN - 1));
    /* Some filesystems take the flag at open and refuse the reads. */
    ssize_t r = pread(d->fd, d->bounce, QM__DISK_ALIGN, 0);
    if (r < 0) {
        const char *why = errno == EINVAL ? "its filesystem refuses O_DIRECT reads"
                                          : strerror(errno);
        qm__why(p, "direct disk paging unavailable for %s: %s; serving from the mapping (page "
                   "cache)",
                path, why);
        close(d->fd);
        qm_free(d->bounce_raw);
        qm_free(d);
        return;
    }
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
    close(d->fd);
    qm_free(d->bounce_raw);
    qm_free(d);
    p->disk = NULL;
}

void qm__pager_disk_stats(const qm_pager *p, qm_pager_stats *out)
{
    const struct qm__disk *d = p->disk;
    if (!d)
        return;
    out->disk_bytes_read = atomic_load(&d->bytes_read);
    out->disk_reads = atomic_load(&d->reads);
    out->disk_errors = atomic_load(&d->errors);
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
}
