/* qm_cuda_kind.c - the CUDA backend's registry row, one row whether or not
 * the build has CUDA (see qm_cuda_kind.h). */
#include "qm_cuda_kind.h"

#ifdef QMOE_HAVE_CUDA
#define QM__CUDA_SUMMARY                                                                           \
    "NVIDIA GPUs: device arenas, copy and compute streams, routing on the device"
#else
#define QM__CUDA_SUMMARY "NVIDIA GPUs (not in this build: built without CUDA)"
#endif

const qm__backend_kind qm__backend_cuda_kind = {
    .version = QM_BACKEND_KIND_VERSION,
    .name = "cuda",
    .summary = QM__CUDA_SUMMARY,
    .caps = QM_BACKEND_CAP_NUMBERED | QM_BACKEND_CAP_AUTO | QM_BACKEND_CAP_CODEBOOK,
    .open = qm__cuda_open,
    .probe = qm__cuda_probe,
};
