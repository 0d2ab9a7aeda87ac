/* qm_io.h - whole writes of a file range: retried after EINTR and continued
 * after short counts, so a caller makes one call, not a loop. */
#ifndef QM_IO_H
#define QM_IO_H

#include <stdint.h>

/* Writes the `n` bytes at `buf` to `fd` at offset `at`. Returns 0, or -1
 * with errno set (EIO for a write that wrote nothing). */
int qm_pwrite_all(int fd, const void *buf, uint64_t n, uint64_t at);

#endif
