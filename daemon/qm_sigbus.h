/* qm_sigbus.h - a bank file truncated while mapped must not kill the daemon
 * (qm_sigbus.c). Slots are process-wide: the SIGBUS handler has no context. */
#ifndef QM_SIGBUS_H
#define QM_SIGBUS_H

#include <stdint.h>

/* Installs the SIGBUS handler (once). */
int qm_sigbus_install(void);
/* Registers a bank mapping (loop thread); returns its slot or -1. */
int qm_sigbus_register(const void *base, uint64_t size);
void qm_sigbus_unregister(int slot); /* before the mapping goes */
int qm_sigbus_poisoned(int slot);

#endif
