/* qm_cuda_kind.h - what the CUDA backend's registry row (qm_cuda_kind.c,
 * the same row in every build) calls: qm_cuda_backend.c defines them with
 * CUDA, qm_cuda_stub.c without it. Private to cuda/. */
#ifndef QM_CUDA_KIND_H
#define QM_CUDA_KIND_H

#include <stdint.h>

#include "qm_backend_impl.h"

/* The row's open: device o->index. */
int qm__cuda_open(const qm_backend_open_options *o, qm_backend **out, qm_status *st);
/* The row's probe: the CUDA devices this process sees. */
int qm__cuda_probe(uint32_t *n_devices, qm_status *st);

#endif
