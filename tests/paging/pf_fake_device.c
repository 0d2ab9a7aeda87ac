/* pf_fake_device.c - see pf_fake_device.h. */
#include "pf_fake_device.h"

/* The emulated device of the engine (qm_backend_emu.c), with the model's
 * threads (0 = 1) and copy costs. */
int pf_fake_device_new(qm_backend **out)
{
    return pf_fake_device_new_model(&(pf_dev_model){.threads = 1}, out);
}

int pf_fake_device_new_model(const pf_dev_model *model, qm_backend **out)
{
    qm_emu_options o = {.threads = model->threads ? model->threads : 1,
                        .gbps = model->gbps,
                        .latency_us = model->latency_us,
                        .total_bytes = 1ull << 32};
    qm_status st;
    return qm_backend_emu_new(&o, out, &st);
}

/* ---- A slowed host: the same backend, host visible, compute slowed ---- */

int pf_slow_host_new(double slowdown, uint32_t threads, qm_backend **out)
{
    qm_emu_options o = {.threads = threads ? threads : 1,
                        .total_bytes = 1ull << 32,
                        .host_visible = 1,
                        .compute_slowdown = slowdown < 1 ? 1 : slowdown};
    qm_status st;
    return qm_backend_emu_new(&o, out, &st);
}
