/* tool_input.h - what every qmoe-bank command that reads a downloaded model
 * shares: opening its files (regular files only), the one line that reports
 * a failure (names from the file escaped), and SIGINT/SIGTERM during an
 * import (noticed, not fatal, so the bank writer can leave its partial file
 * resumable or remove it). */
#ifndef QMOE_TOOL_INPUT_H
#define QMOE_TOOL_INPUT_H

#include <stdint.h>
#include <stdio.h>

#include "qm_error.h"

/* Opens path read-only without blocking (a FIFO or a device, even behind a
 * symbolic link, never stalls the open) and keeps it only if it is a
 * regular file: *fd and *size on success. Errors name `what` (the file as
 * the user knows it): QM_ENOT_FOUND for a missing file, QM_EINVALID_MODEL
 * for a link loop, a directory, a FIFO, a device, no permission; QM_EIO
 * otherwise. The caller
 * closes *fd. */
int qm__open_input(const char *path, const char *what, int *fd, uint64_t *size, qm_status *st);

/* Prints "qmoe-bank WHO: " + the parts + "\n" to f as one line: every byte
 * outside printable ASCII (control characters, escape sequences, newlines
 * a tensor name may hold, and any non-ASCII byte) as \xNN. parts ends with
 * NULL. */
void qm__print_line(FILE *f, const char *who, ...);

/* Installs SIGINT and SIGTERM handlers that only record the signal (for the
 * import commands; returns when installed). qm__interrupted() is the signal
 * seen, 0 for none; qm__reraise() restores the default action and raises
 * it again, so the shell sees how the process ended. */
void qm__catch_interrupts(void);
int qm__interrupted(void);
void qm__reraise(void);

#endif
