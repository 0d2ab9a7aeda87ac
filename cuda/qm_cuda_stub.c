/* qm_cuda_stub.c - qmoe_cuda in a build without CUDA: the constructor and
 * what the registry's row calls (qm_cuda_kind.c) say so, and no backend is
 * a CUDA backend for the extras. Lets callers (the registry, tests) reach
 * "the CUDA backend" with no #ifdef. */
#include "qm_cuda.h"

#include "qm_cuda_kind.h"

int qm_backend_cuda_new(int device, qm_backend **out, qm_status *st)
{
    (void)device;
    if (out)
        *out = NULL;
    return qm_status_set(st, QM_EUNSUPPORTED, "built without CUDA");
}

int qm__cuda_open(const qm_backend_open_options *o, qm_backend **out, qm_status *st)
{
    return qm_backend_cuda_new((int)o->index, out, st);
}

int qm__cuda_probe(uint32_t *n_devices, qm_status *st)
{
    *n_devices = 0;
    return qm_status_set(st, QM_EUNSUPPORTED, "built without CUDA");
}


int qm_backend_cuda_set_kernels(qm_backend *be, qm_cuda_kernels kernels, uint32_t gemm_min_rows)
{
    (void)be;
    (void)kernels;
    (void)gemm_min_rows;
    return QM_EINVAL;
}

int qm_backend_cuda_set_routing(qm_backend *be, int on_device)
{
    (void)be;
    (void)on_device;
    return QM_EINVAL;
}

int qm_backend_cuda_set_tensor_cores(qm_backend *be, int on)
{
    (void)be;
    (void)on;
    return QM_EINVAL;
}

int qm_backend_cuda_stats(qm_backend *be, qm_cuda_stats *out)
{
    (void)be;
    (void)out;
    return QM_EINVAL;
}
