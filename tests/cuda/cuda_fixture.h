/* cuda_fixture.h - what the CUDA suites share: backends, a test layer copied
 * into a device arena and handed out as an expert source (with waves), and
 * the relative error. */
#ifndef CUDA_FIXTURE_H
#define CUDA_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include "engine_fixture.h"
#include "qm_backend.h"
#include "qm_cuda.h"
#include "qm_moe.h"

qm_backend *new_cuda(void); /* asserts */
qm_backend *new_cpu(void);  /* 2 threads; asserts */

/* ---- a layer in device memory, handed out as an expert source ---- */
typedef struct dev_layer {
    tl_layer *L;
    qm_arena *arena;
    /* Device address of tensor t of expert e: base + off[e][t]. */
    uint64_t (*off)[QM_T_EXPERT_COUNT];
    size_t step; /* experts per acquire (0: all): waves */
    int acquired, released;
} dev_layer;

int copy_and_wait(qm_backend *be, void *dst, const void *src, uint64_t n);
/* packed = 0: each tensor whole at a 256-aligned offset; 1: one unit per
 * expert, slices end to end (scales and biases at odd addresses). */
void dev_layer_init(dev_layer *D, qm_backend *be, tl_layer *L, int packed);
void dev_layer_free(qm_backend *be, dev_layer *D);
void dev_weights(const dev_layer *D, uint32_t e, qm_expert_weights *w);
void dev_source(dev_layer *D, qm_expert_source *src);

/* ||a - b|| / ||b||; INFINITY when either holds a NaN. */
double rel_err(const float *a, const float *b, size_t n);

/* The routing case of the CUDA suite (test_cuda_route.c). */
#include <check.h>
TCase *cuda_route_tcase(void);

#endif
