/* qm_backend.c - the only call sites of qm_backend_iface; optional methods defaulted here. */
#include <stdlib.h>

#include "qm_alloc.h"
#include "qm_backend_impl.h"
#include "qm_host_route.h"

int qm__backend_wrap(const qm_backend_iface *iface, void *ctx, qm_backend **out, qm_status *st)
{
    *out = NULL;
    if (!iface || iface->version != QM_BACKEND_IFACE_VERSION) {
        int got = iface ? iface->version : -1;
        if (iface && iface->destroy)
            iface->destroy(ctx);
        return qm_status_set(st, QM_EUNSUPPORTED,
                             "backend interface version %d, this build expects %d", got,
                             QM_BACKEND_IFACE_VERSION);
    }
    const char *name = iface->name ? iface->name : "?";
    const char *bad = NULL;
    int routing = !!iface->route + !!iface->run_routed + !!iface->combine + !!iface->pass_release;
    if (!iface->name || !iface->info || !iface->arena_alloc || !iface->arena_release ||
        !iface->copy_h2d || !iface->run_experts || !iface->destroy)
        bad = "lacks a required method";
    else if (routing != 0 && routing != 4)
        bad = "has some of route, run_routed, combine and pass_release: all four or none";
    else if ((routing == 4) != (iface->routes != 0))
        bad = routing ? "has a routing group but routes no rule (routes is 0)"
                      : "declares routes without a routing group";
    else if (!iface->register_host != !iface->unregister_host)
        bad = "has one of register_host and unregister_host: both or none";
    if (bad) {
        if (iface->destroy)
            iface->destroy(ctx);
        return qm_status_set(st, QM_EINVAL, "backend '%s' %s", name, bad);
    }
    qm_backend *be = qm_malloc(sizeof *be);
    if (!be) {
        iface->destroy(ctx);
        return qm_status_set(st, QM_ENOMEM, "out of memory creating the backend handle");
    }
    be->iface = iface;
    be->ctx = ctx;
    *out = be;
    return 0;
}

void qm_backend_free(qm_backend *be)
{
    if (!be)
        return;
    be->iface->destroy(be->ctx);
    qm_free(be);
}

const char *qm_backend_name(const qm_backend *be)
{
    return be->iface->name;
}

int qm_backend_info(qm_backend *be, qm_device_info *out)
{
    return be->iface->info(be->ctx, out);
}

int qm_backend_host_visible(const qm_backend *be)
{
    return be->iface->host_visible;
}

size_t qm_backend_alignment(const qm_backend *be)
{
    return be->iface->alignment ? be->iface->alignment : 1;
}

int qm_arena_new(qm_backend *be, uint64_t bytes, qm_arena **out, qm_status *st)
{
    *out = NULL;
    if (bytes == 0)
        return qm_status_set(st, QM_EINVAL, "arena size must be > 0 bytes");
    qm_arena *a = qm_calloc(1, sizeof *a);
    if (!a)
        return qm_status_set(st, QM_ENOMEM, "out of memory creating an arena handle");
    a->backend = be;
    int rc = be->iface->arena_alloc(be->ctx, a, bytes, st);
    if (rc < 0) {
        qm_free(a);
        return rc;
    }
    a->size = bytes;
    *out = a;
    return 0;
}

void qm_arena_free(qm_backend *be, qm_arena *arena)
{
    if (!arena)
        return;
    if (!be)
        be = arena->backend;
    be->iface->arena_release(be->ctx, arena);
    qm_free(arena);
}

void *qm_arena_at(qm_arena *arena, uint64_t offset)
{
    return (uint8_t *)arena->base + offset;
}

uint64_t qm_arena_size(const qm_arena *arena)
{
    return arena->size;
}

int qm_backend_copy_h2d(qm_backend *be, void *dst, const void *src, uint64_t bytes,
                        qm_fence *fence, qm_status *st)
{
    if (bytes > 0 && (!dst || !src))
        return qm_status_set(st, QM_EINVAL, "copy of %llu bytes with a NULL pointer",
                             (unsigned long long)bytes);
    return be->iface->copy_h2d(be->ctx, dst, src, bytes, fence, st);
}

int qm_backend_fence_wait(qm_backend *be, qm_fence *fence, qm_status *st)
{
    if (!fence || !be->iface->fence_wait)
        return 0; /* synchronous copies: nothing to wait for */
    return be->iface->fence_wait(be->ctx, fence, st);
}

int qm_backend_run_experts(qm_backend *be, const qm_expert_batch *batch, qm_status *st)
{
    if (!batch)
        return qm_status_set(st, QM_EINVAL, "run_experts without a batch");
    if (batch->n_jobs == 0)
        return 0;
    return be->iface->run_experts(be->ctx, batch, st);
}

int qm_backend_synchronize(qm_backend *be, qm_status *st)
{
    if (!be->iface->synchronize)
        return 0;
    return be->iface->synchronize(be->ctx, st);
}

int qm_backend_register_host(qm_backend *be, const void *ptr, size_t bytes, qm_status *st)
{
    if (!be->iface->register_host)
        return 0; /* nothing to register */
    int rc = be->iface->register_host(be->ctx, ptr, bytes, st);
    return rc < 0 ? rc : 1;
}

int qm_backend_unregister_host(qm_backend *be, const void *ptr, qm_status *st)
{
    if (!be->iface->unregister_host)
        return 0;
    return be->iface->unregister_host(be->ctx, ptr, st);
}

/* ---- The routed pass: the backend's routing, or the host's by default ---- */

/* The QM_BACKEND_ROUTES_* bit a call's routing needs. */
static unsigned qm__route_rule_of(const qm_routing_request *rq)
{
    if (rq->topk_ids)
        return QM_BACKEND_ROUTES_SUPPLIED;
    return rq->config->routing.score == QM_ROUTE_SCORE_LEGACY ? QM_BACKEND_ROUTES_LEGACY
                                                               : QM_BACKEND_ROUTES_KEYED;
}

int qm__backend_route(qm_backend *be, const qm_routing_request *rq, qm_routed_pass *pass,
                      qm_status *st)
{
    pass->backend_pass = NULL;
    /* What the backend declares it routes; any other call is routed on the host. */
    if (be->iface->routes & qm__route_rule_of(rq)) {
        qm_status declined = {0};
        int rc = be->iface->route(be->ctx, rq, &pass->backend_pass, &declined);
        if (rc == 0 && pass->backend_pass)
            return 0;
        pass->backend_pass = NULL;
        if (rc < 0 && rc != QM_EUNSUPPORTED) {
            if (st)
                *st = declined;
            return rc;
        }
        /* Declined (routing switched off): the host routes this call. */
    }
    return qm__host_route(pass->host, rq, st);
}

int qm__backend_run_routed(qm_backend *be, qm_routed_pass *pass, const qm_expert_batch *batch,
                           qm_status *st)
{
    if (!batch || batch->n_jobs == 0)
        return 0;
    if (pass->backend_pass)
        return be->iface->run_routed(be->ctx, pass->backend_pass, batch, st);
    qm_expert_batch routed;
    int rc = qm__host_batch(pass->host, batch, &routed, st);
    return rc < 0 ? rc : qm_backend_run_experts(be, &routed, st);
}

int qm__backend_combine(qm_backend *be, qm_routed_pass *pass, float *out, qm_status *st)
{
    if (pass->backend_pass)
        return be->iface->combine(be->ctx, pass->backend_pass, out, st);
    return qm__host_combine(pass->host, out, st);
}

void qm__backend_pass_release(qm_backend *be, qm_routed_pass *pass)
{
    if (pass && pass->backend_pass)
        be->iface->pass_release(be->ctx, pass->backend_pass);
    if (pass)
        pass->backend_pass = NULL;
}
