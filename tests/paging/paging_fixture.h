/* paging_fixture.h - small random banks built in memory (safetensors images
 * in BANK_FORMAT.md's layout), a fake device backend, and routing helpers. */
#ifndef PAGING_FIXTURE_H
#define PAGING_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include "qm_backend.h"
#include "qm_bank.h"
#include "pf_fake_device.h"

typedef struct pf_spec {
    uint32_t layers, experts, hidden, inter, k, bits;
    int router; /* layers carry router.weight/bias */
    uint32_t block; /* 0: row-wise scales ([E, N]); else scales per `block` columns ([E, N, K / block]) */
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

#endif
