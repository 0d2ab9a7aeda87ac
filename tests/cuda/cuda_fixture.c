/* cuda_fixture.c - see cuda_fixture.h. */
#include "cuda_fixture.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

qm_backend *new_cuda(void)
{
    qm_backend *be = NULL;
    qm_status st = {0};
    int rc = qm_backend_cuda_new(0, &be, &st);
    ck_assert_msg(rc == 0, "cuda backend: %s", st.msg);
    return be;
}

qm_backend *new_cpu(void)
{
    qm_backend *be = NULL;
    qm_status st = {0};
    int rc = qm_backend_cpu_new(2, &be, &st);
    ck_assert_msg(rc == 0, "cpu backend: %s", st.msg);
    return be;
}

/* ---- a layer in device memory, handed out as an expert source ---- */

int copy_and_wait(qm_backend *be, void *dst, const void *src, uint64_t n)
{
    qm_fence f = {0};
    qm_status st = {0};
    int rc = qm_backend_copy_h2d(be, dst, src, n, &f, &st);
    if (rc == 0) rc = qm_backend_fence_wait(be, &f, &st);
    if (rc != 0) fprintf(stderr, "copy: %s\n", st.msg);
    return rc;
}

/* packed = 0: each tensor whole at a 256-aligned offset (slices at their
 * natural offsets). packed = 1: one unit per expert, its slices end to end
 * with no padding, as a pager might: scales and biases then sit at odd
 * addresses whenever an earlier slice has an odd size. */
void dev_layer_init(dev_layer *D, qm_backend *be, tl_layer *L, int packed)
{
    memset(D, 0, sizeof *D);
    D->L = L;
    uint32_t E = L->spec.E;
    D->off = calloc(E, sizeof *D->off);
    ck_assert_ptr_nonnull(D->off);
    uint64_t total = 0;
    if (!packed) {
        for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
            const qm_tensor_view *tv = &L->lv.t[t];
            if (!tv->present) continue;
            for (uint32_t e = 0; e < E; e++)
                D->off[e][t] = total + e * (tv->nbytes / E);
            total += (tv->nbytes + 255) & ~255ull;
        }
    } else {
        for (uint32_t e = 0; e < E; e++) {
            uint64_t o = total;
            for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
                const qm_tensor_view *tv = &L->lv.t[t];
                if (!tv->present) continue;
                D->off[e][t] = o;
                o += tv->nbytes / E;
            }
            total = (o + 255) & ~255ull;
        }
    }
    qm_status st = {0};
    ck_assert_msg(qm_arena_new(be, total + 256, &D->arena, &st) == 0, "arena: %s", st.msg);
    uint8_t *base = qm_arena_at(D->arena, 0);
    for (uint32_t e = 0; e < E; e++) {
        for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
            const qm_tensor_view *tv = &L->lv.t[t];
            if (!tv->present) continue;
            uint64_t slice = tv->nbytes / E;
            ck_assert_int_eq(copy_and_wait(be, base + D->off[e][t],
                                           (const uint8_t *)tv->data + e * slice, slice),
                             0);
        }
    }
}

void dev_layer_free(qm_backend *be, dev_layer *D)
{
    qm_arena_free(be, D->arena);
    free(D->off);
}

void dev_weights(const dev_layer *D, uint32_t e, qm_expert_weights *w)
{
    uint8_t *base = qm_arena_at(D->arena, 0);
    w->r8 = 0;
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++)
        w->ptr[t] = D->L->lv.t[t].present ? base + D->off[e][t] : NULL;
}

static int dev_acquire(void *ctx, uint32_t layer, const uint32_t *experts, size_t n,
                       qm_expert_weights *weights, size_t *n_ready, qm_status *st)
{
    (void)layer;
    (void)st;
    dev_layer *D = ctx;
    size_t k = D->step && D->step < n ? D->step : n;
    for (size_t i = 0; i < k; i++)
        dev_weights(D, experts[i], &weights[i]);
    *n_ready = k;
    D->acquired += (int)k;
    return 0;
}

static void dev_release(void *ctx, uint32_t layer, const uint32_t *experts, size_t n)
{
    (void)layer;
    (void)experts;
    ((dev_layer *)ctx)->released += (int)n;
}

void dev_source(dev_layer *D, qm_expert_source *src)
{
    *src = (qm_expert_source){
        .version = QM_EXPERT_SOURCE_VERSION, .ctx = D, .acquire = dev_acquire, .release = dev_release};
}

double rel_err(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        if (isnan(a[i]) || isnan(b[i])) return INFINITY;
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}
