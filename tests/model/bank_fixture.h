/* bank_fixture.h - builds small bank images in memory, tensor list first, so
 * tests can corrupt any field before serialising. */
#ifndef BANK_FIXTURE_H
#define BANK_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include "qm_bank.h"
#include "qm_st_header.h"

#define FX_MAX_TENSORS 128
#define FX_MAX_META 32

typedef struct fx_opts {
    uint32_t layers, experts, hidden, inter, k, bits, block_size, fusion;
    qm_activation act;
    int asymmetric, router, bias;
    qm_dtype scale_dtype;
} fx_opts;

typedef struct fx_bank {
    fx_opts o;
    qm_st_tensor t[FX_MAX_TENSORS];
    char names[FX_MAX_TENSORS][64];
    size_t n;
    qm_st_meta m[FX_MAX_META];
    char keys[FX_MAX_META][64], vals[FX_MAX_META][64];
    size_t nm;
    uint64_t data_cap; /* 0: data = up to the last tensor's end; else at most the original end */
} fx_bank;

/* A default: 2 layers, 4 experts, H 64, I 32, k 2, 4 bits, block 16, silu, biases. */
fx_opts fx_default(void);
/* Lays out every tensor of `o` (floats first, then bytes) and the metadata. */
void fx_init(fx_bank *fx, const fx_opts *o);
qm_st_tensor *fx_find(fx_bank *fx, const char *name);
void fx_set_meta(fx_bank *fx, const char *key, const char *value);
void fx_del_meta(fx_bank *fx, const char *key);
void fx_del_tensor(fx_bank *fx, const char *name);
/* Appends a tensor at the end of the data section. */
void fx_add_tensor(fx_bank *fx, const char *name, const char *dtype, const uint64_t *shape,
                   uint32_t ndim);
/* Serialises: 8-byte length, header (padded to 8), data (a byte pattern).
 * Returns a malloc'd image; *hlen receives the header length. */
uint8_t *fx_build(const fx_bank *fx, size_t *size, uint64_t *hlen);
/* An image with an arbitrary header text and `data_bytes` of data. */
uint8_t *fx_raw(const char *header, size_t header_len, size_t data_bytes, size_t *size);

#endif
