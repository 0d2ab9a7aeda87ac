/* qm_backend_impl.h - what a backend implements. Private to engine/ and cuda/. */
#ifndef QM_BACKEND_IMPL_H
#define QM_BACKEND_IMPL_H

#include "qm_backend.h"

#define QM_BACKEND_IFACE_VERSION 1

struct qm_arena {
    qm_backend *backend;
    void *base;    /* device address */
    uint64_t size;
    void *handle;  /* backend's own */
};

typedef struct qm_backend_iface {
    int version;
    const char *name;
    int host_visible;
    size_t alignment;
    int (*info)(void *ctx, qm_device_info *out);
    /* Allocates `bytes` and fills arena->base/handle. */
    int (*arena_alloc)(void *ctx, qm_arena *arena, uint64_t bytes, qm_status *st);
    void (*arena_release)(void *ctx, qm_arena *arena);
    int (*copy_h2d)(void *ctx, void *dst, const void *src, uint64_t bytes, qm_fence *fence,
                    qm_status *st);
    /* (optional) default: nothing to wait for (synchronous copies). */
    int (*fence_wait)(void *ctx, qm_fence *fence, qm_status *st);
    int (*run_experts)(void *ctx, const qm_expert_batch *batch, qm_status *st);
    /* (optional) default: no-op. */
    int (*synchronize)(void *ctx, qm_status *st);
    void (*destroy)(void *ctx);
} qm_backend_iface;

struct qm_backend {
    const qm_backend_iface *iface;
    void *ctx;
};

/* Wraps an implementation; checks the version. Takes ownership of ctx (destroy on failure). */
int qm__backend_wrap(const qm_backend_iface *iface, void *ctx, qm_backend **out, qm_status *st);

#endif
