/* paging_fixture.h - small random banks built in memory (safetensors images
 * in BANK_FORMAT.md's layout), a fake device backend, and routing helpers. */
#ifndef PAGING_FIXTURE_H
#define PAGING_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include "qm_backend.h"
#include "qm_bank.h"

typedef struct pf_spec {
    uint32_t layers, experts, hidden, inter, k, bits;
    int router; /* layers carry router.weight/bias */
    uint64_t seed;
} pf_spec;

typedef struct pf_bank {
    uint8_t *image;
    size_t size;
    qm_bank *bank;
} pf_bank;

pf_spec pf_default_spec(void);
/* Builds and opens the bank; aborts the test (ck_assert) on failure. */
void pf_bank_open(const pf_spec *spec, pf_bank *out);
void pf_bank_close(pf_bank *b);

uint64_t pf_rand(uint64_t *s);
float pf_uniform(uint64_t *s, float lo, float hi);

/* Logits [E] for one token that route it to experts[0..n) (n <= k; the
 * first gets the largest weight) and nowhere else above the drop threshold. */
void pf_route_logits(uint32_t E, const uint32_t *experts, uint32_t n, float *logits);

/* A "device" backend that is not host visible: arenas are host memory but
 * the pager must treat them as opaque, copy whole banks and use fences.
 * Wraps a real CPU backend for compute. Copies are deferred until the
 * fence is waited, so a missing wait shows up as wrong output. */
int pf_fake_device_new(qm_backend **out);

/* The same fake device with a cost model: its CPU backend has `threads`
 * workers (0 = 1), and each copy takes bytes / gbps + latency_us on an
 * in-order stream (a copy starts when issued or when the one before it
 * lands, whichever is later), enforced by sleeping in the fence wait until
 * the modelled landing time. gbps 0: copies cost nothing (as above). */
typedef struct pf_dev_model {
    uint32_t threads;
    double gbps, latency_us;
} pf_dev_model;
int pf_fake_device_new_model(const pf_dev_model *model, qm_backend **out);

#endif
