/* qm_cuda_errors.c - a CUDA backend's errors as QM_E* codes with a
 * sentence (a sticky one marks the device lost), the check every call makes
 * on entry, and the release of its run lock: the bottom of cuda/, below the
 * backend, the routing and the kernel runs that all use it. */
#include <stdio.h>

#include "qm_cuda_internal.h"

int qm__cuda_is_sticky(cudaError_t err)
{
    switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorDevicesUnavailable:
    case cudaErrorContextIsDestroyed:
    case cudaErrorCudartUnloading:
    case cudaErrorUnknown:
        return 1;
    default:
        return 0;
    }
}

int qm__cuda_fail(qm__cuda_ctx *c, cudaError_t err, qm_status *st, const char *what)
{
    int code;
    (void)cudaGetLastError(); /* clears non-sticky errors so later calls start clean */
    if (err == cudaErrorMemoryAllocation) {
        code = QM_ERESOURCE_EXHAUSTED;
    } else if (qm__cuda_is_sticky(err)) {
        code = QM_EDEVICE;
        if (c && !c->lost) {
            c->lost = 1;
            snprintf(c->lost_reason, sizeof c->lost_reason, "%s in %s", cudaGetErrorName(err),
                     what);
        }
    } else if (err == cudaErrorInvalidValue || err == cudaErrorInvalidDevicePointer) {
        code = QM_EINVAL;
    } else {
        code = QM_EDEVICE;
    }
    return qm_status_set(st, code, "CUDA %s failed: %s (%s)", what, cudaGetErrorString(err),
                         cudaGetErrorName(err));
}

int qm__cuda_enter(qm__cuda_ctx *c, qm_status *st)
{
    if (c->lost)
        return qm_status_set(st, QM_EDEVICE, "CUDA device %d is lost (%s); create a new backend",
                             c->device, c->lost_reason);
    cudaError_t err = cudaSetDevice(c->device);
    if (err != cudaSuccess) return qm__cuda_fail(c, err, st, "cudaSetDevice");
    return 0;
}

void qm__cuda_settle(qm__cuda_ctx *c)
{
    if (!c->lost) (void)cudaStreamSynchronize(c->compute_stream);
    (void)cudaGetLastError();
}

int qm__cuda_unlock_run(qm__cuda_ctx *c, int rc)
{
    if (rc < 0) qm__cuda_settle(c);
    pthread_mutex_unlock(&c->run_lock);
    return rc;
}
