/* qm_cuda_stub.c - qmoe_cuda in a build without CUDA: the constructor says
 * so, and no backend is a CUDA backend for the extras. Lets callers (the
 * daemon, tests) create "the CUDA backend" with no #ifdef. */
#include "qm_cuda.h"

int qm_backend_cuda_new(int device, qm_backend **out, qm_status *st)
{
    (void)device;
    if (out)
        *out = NULL;
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
