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

float qm_f16_to_f32(uint16_t h);
uint16_t qm_f32_to_f16(float f);
float qm_bf16_to_f32(uint16_t h);
uint16_t qm_f32_to_bf16(float f);

#endif
