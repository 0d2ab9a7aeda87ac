/* qm_io.c - see qm_io.h. */
#include "qm_io.h"

#include <errno.h>
#include <unistd.h>

/* Bytes asked for per call: Linux moves at most about 2 GiB in one. */
#define QM__IO_CHUNK ((uint64_t)1 << 30)

int qm_pwrite_all(int fd, const void *buf, uint64_t n, uint64_t at)
{
    const uint8_t *p = buf;
    while (n) {
        ssize_t k = pwrite(fd, p, (size_t)(n < QM__IO_CHUNK ? n : QM__IO_CHUNK), (off_t)at);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            if (k == 0)
                errno = EIO;
            return -1;
        }
        p += k;
        at += (uint64_t)k;
        n -= (uint64_t)k;
    }
    return 0;
}

void qm_eventfd_post(int fd)
{
    uint64_t one = 1;
    while (write(fd, &one, sizeof one) < 0 && errno == EINTR)
        ;
}

void qm_eventfd_take(int fd)
{
    uint64_t n;
    while (read(fd, &n, sizeof n) < 0 && errno == EINTR)
        ;
}
