/* qm_idle_hint.h - one line at start when this machine makes a layer
 * call's wake-ups expensive: a KVM guest whose cpuidle-haltpoll driver
 * halts an idle vCPU at once (guest_halt_poll_ns 0). Each of the four
 * wake-ups of a decode layer call then waits for the host to run the
 * halted vCPU again: 19-33 us at p50 on a 2-vCPU guest against 5 us with
 * 200 us of polling (docs/ARCHITECTURE.md, "Where the wake-ups go on a
 * VM"; docs/OPERATIONS.md, "On a virtual machine", says how to set it). */
#ifndef QM_IDLE_HINT_H
#define QM_IDLE_HINT_H

#include <stddef.h>

#define QM_IDLE_DRIVER_PATH "/sys/devices/system/cpu/cpuidle/current_driver"
#define QM_HALTPOLL_NS_PATH "/sys/module/haltpoll/parameters/guest_halt_poll_ns"

/* 1, with the line in msg, when the cpuidle driver named in driver_path is
 * haltpoll and the number in poll_path is 0; 0 otherwise (another driver,
 * polling on, a file that cannot be read or does not hold a number). */
int qm_idle_hint(const char *driver_path, const char *poll_path, char *msg, size_t cap);

#endif
