/* qm_devices.h - the devices a daemon serves (qm_devices.c), opened from
 * the configuration through the backend registry (engine/backend/qm_backend.h),
 * which names every backend: nothing here does. One device is the common
 * case of several, so everything loops over the array.
 *
 * Loop thread: the budgets and what is admitted are the registry's
 * bookkeeping (qm_sessions.h); backends are thread-safe as the backend
 * interface says. */
#ifndef QM_DEVICES_H
#define QM_DEVICES_H

#include <stdint.h>

#include "qm_backend.h"
#include "qm_config.h"

typedef struct qm_device {
    qm_backend *backend;  /* owned */
    qm_device_info info;
    char name[16];        /* the kind for the host ("cpu"), else KIND:N ("cuda:1") */
    uint64_t budget;      /* what sessions placed here may take (device_budget; its memory) */
    uint64_t admitted;    /* what sessions placed here were admitted for */
} qm_device;

typedef struct qm_devices {
    uint32_t n; /* >= 1 once open */
    qm_device dev[QM_CONFIG_MAX_DEVICES];
} qm_devices;

/* Opens the configured devices: the list (--device KIND:N,...), or the
 * backend's device (KIND:0, the host's one device), or for auto the first
 * device 0 of a kind that --backend auto tries that opens, else the host.
 * A list opens every device or none (auto then falls back to the host
 * alone; the notice names the device that failed). On failure st names the
 * device and nothing stays open. */
int qm_devices_open(qm_devices *ds, const qm_config *cfg, qm_status *st);
void qm_devices_close(qm_devices *ds); /* accepts a zeroed one */

/* Sums over the devices. */
uint64_t qm_devices_budget(const qm_devices *ds);
uint64_t qm_devices_admitted(const qm_devices *ds);
uint64_t qm_devices_total_bytes(const qm_devices *ds);
/* 1 when every device's kernels read host memory (the CPU): a paged
 * session can then read its units from disk (paging_source auto). */
int qm_devices_host_visible(const qm_devices *ds);
/* The backends, in device order, for the placement (qm_multipager_new). */
void qm_devices_backends(const qm_devices *ds, qm_backend **out);

#endif
