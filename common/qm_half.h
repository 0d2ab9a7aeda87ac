/* qm_half.h - f16 and bf16 <-> f32, the one converter every module uses
 * (engine, bank writer, quantiser, importers).
 *
 * Widening is exact. Narrowing rounds to nearest, ties to even; f16
 * overflows to infinity. NaN stays NaN in both directions and is made quiet
 * (the quiet bit set, the payload's high bits kept), as F16C's
 * vcvtph2ps/vcvtps2ph do, so the scalar and the SIMD paths agree. */
#ifndef QM_HALF_H
#define QM_HALF_H

#include <stdint.h>
#include <string.h>

/* Inline: they sit in the quantiser's and the kernels' inner loops. */
static inline uint32_t qm__half_bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float qm__half_float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float qm_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) /* inf / NaN (payload kept, made quiet) */
        return qm__half_float_of(sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0));
    if (exp == 0) {
        if (man == 0) return qm__half_float_of(sign);
        /* Subnormal: value = man * 2^-24, exact in f32. */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return qm__half_float_of(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t qm_f32_to_f16(float f)
{
    uint32_t u = qm__half_bits_of(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t exp = (u >> 23) & 0xffu;
    uint32_t man = u & 0x7fffffu;
    if (exp == 0xff) /* inf stays inf; NaN stays a quiet NaN */
        return (uint16_t)(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0));
    int e = (int)exp - 127 + 15;
    if (e >= 0x1f) return (uint16_t)(sign | 0x7c00u); /* overflow to inf */
    if (e <= 0) {
        /* Subnormal or zero in f16: shift the full significand, round to even. */
        if (e < -10) return sign;
        uint32_t full = man | 0x800000u;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t half = full >> shift;
        uint32_t rem = full & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)e << 10) | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    /* A carry out of the mantissa correctly bumps the exponent (up to inf). */
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1))) half++;
    return (uint16_t)(sign | half);
}

static inline float qm_bf16_to_f32(uint16_t h)
{
    return qm__half_float_of((uint32_t)h << 16);
}

static inline uint16_t qm_f32_to_bf16(float f)
{
    uint32_t u = qm__half_bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it a NaN after truncation */
        return (uint16_t)((u >> 16) | 0x40u);
    uint32_t lsb = (u >> 16) & 1u;
    u += 0x7fffu + lsb;
    return (uint16_t)(u >> 16);
}

#endif
