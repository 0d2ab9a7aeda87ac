/* qm_io.h - whole writes of a file range: retried after EINTR and continued
 * after short counts, so a caller makes one call, not a loop; and an
 * eventfd's two ends (one call each, EINTR retried). */
#ifndef QM_IO_H
#define QM_IO_H

#include <stdint.h>

/* Writes the `n` bytes at `buf` to `fd` at offset `at`. Returns 0, or -1
 * with errno set (EIO for a write that wrote nothing). */
int qm_pwrite_all(int fd, const void *buf, uint64_t n, uint64_t at);

/* Adds 1 to the eventfd `fd` (its reader wakes), and takes its count (the
 * reader's side; a non-blocking fd with nothing posted leaves it as is). */
void qm_eventfd_post(int fd);
void qm_eventfd_take(int fd);

#endif
