/* pf_fake_device.h - an emulated device backend that is not host visible,
 * for the paging suites and bench/hybrid: no Check, no test fixture. */
#ifndef PF_FAKE_DEVICE_H
#define PF_FAKE_DEVICE_H

#include <stdint.h>

#include "qm_backend.h"

/* A "device" backend that is not host visible: the engine's emulated
 * device (qm_backend_emu_new; 4 GiB reported). Arenas are host memory but
 * the pager must treat them as opaque, copy whole banks and use fences.
 * Wraps a real CPU backend for compute. Copies are deferred until the
 * fence is waited, so a missing wait shows up as wrong output. */
int pf_fake_device_new(qm_backend **out);

/* The same fake device with a cost model: its CPU backend has `threads`
 * workers (0 = 1), and each copy takes bytes / gbps + latency_us on an
 * in-order stream (a copy starts when issued or when the one before it
 * lands, whichever is later), enforced by sleeping in the fence wait until
 * the modelled landing time. gbps 0: copies cost nothing (as above). */
typedef struct pf_dev_model {
    uint32_t threads;
    double gbps, latency_us;
} pf_dev_model;
int pf_fake_device_new_model(const pf_dev_model *model, qm_backend **out);

/* A host-visible backend (the same emulated backend with host_visible and
 * compute_slowdown: arenas are host memory, copies land at their fence)
 * whose compute is the CPU kernels on `threads` workers, then a sleep of
 * (slowdown - 1) times what they took: a host modelled `slowdown` times
 * slower than a device that runs the same kernels (bench/hybrid). */
int pf_slow_host_new(double slowdown, uint32_t threads, qm_backend **out);

#endif
