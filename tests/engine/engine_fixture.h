/* engine_fixture.h - random quantised layers built in memory, with a float64
 * reference of the computation in ../shared/BANK_FORMAT.md written out plainly
 * (dequantise in double, matmul in double, route in double). */
#ifndef ENGINE_FIXTURE_H
#define ENGINE_FIXTURE_H

#include <stdint.h>

#include "qm_bank.h"
#include "qm_moe.h"

typedef struct tl_spec {
    uint32_t E, H, I, k;
    uint32_t bits, block_size;
    qm_activation act;
    uint32_t fusion;
    int asym, bias, router;
    qm_dtype scale_dtype, bias_dtype;
    float alpha, beta, limit;
    uint64_t seed;
    /* A 4-bit code book (bits 4, no zero points): W = scale * values[q].
     * With bits 8 instead, the int8 layer of the same weights (codes 128 +
     * values[q], cfg without the code book): the same seed draws the same
     * codes, scales and biases for both. */
    qm_codebook codebook;
} tl_spec;

typedef struct tl_layer {
    tl_spec spec;
    qm_bank_config cfg;
    qm_layer_view lv;
    void *buf[QM_T_COUNT];
    /* Dequantised weights [E][N][K] and biases [E][N] in double, per matrix 0..2 (fc1, fc2, fc3). */
    double *deq[3], *bias[3];
    uint32_t n[3], kk[3];
    double *router_w, *router_b;
    uint32_t r8_mask; /* the weights' r8 bits (qm_expert_weights.r8): tl_layer_r8 */
} tl_layer;

/* A spec with the common defaults filled in (seeded). */
tl_spec tl_default_spec(uint64_t seed);
int tl_layer_build(const tl_spec *spec, tl_layer *out);
void tl_layer_free(tl_layer *L);
/* Lays every expert's weight matrices out in r8 (qm_r8.h), in place; each
 * must be one the layout takes (qm__r8_eligible). */
void tl_layer_r8(tl_layer *L);

/* Direct source over the layer's own arrays. */
void tl_source(tl_layer *L, qm_expert_source *out);
/* Pointers of expert e. */
void tl_expert_weights(const tl_layer *L, uint32_t e, qm_expert_weights *w);

/* Float64 reference of one layer call on f32 inputs x [T,H] and logits [T,E]. */
void tl_reference(const tl_layer *L, const float *x, const float *logits, uint32_t T, double *out);
/* ||a - b|| / ||b||. */
double tl_rel_err_f(const float *a, const double *b, size_t n);

/* Deterministic PRNG (splitmix64). */
uint64_t tl_rand(uint64_t *s);
float tl_uniform(uint64_t *s, float lo, float hi);
/* x [T,H] and logits [T,E] drawn fresh from the seed; never zero. */
void tl_random_inputs(uint64_t seed, uint32_t T, uint32_t H, uint32_t E, float *x, float *logits);

#endif
