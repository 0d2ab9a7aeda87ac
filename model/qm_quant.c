/* qm_quant.c - the round-to-nearest quantiser (see qm_quant.h). */
#include "qm_quant.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "qm_half.h"

float qm_quant_round_to(qm_dtype dt, float v)
{
    if (dt == QM_DTYPE_F16) return qm_f16_to_f32(qm_f32_to_f16(v));
    if (dt == QM_DTYPE_BF16) return qm_bf16_to_f32(qm_f32_to_bf16(v));
    return v;
}

void qm_quant_store(void *dst, qm_dtype dt, size_t i, float v)
{
    if (dt == QM_DTYPE_F32) {
        memcpy((uint8_t *)dst + 4 * i, &v, 4);
        return;
    }
    uint16_t h = dt == QM_DTYPE_F16 ? qm_f32_to_f16(v) : qm_f32_to_bf16(v);
    memcpy((uint8_t *)dst + 2 * i, &h, 2);
}

double qm_quant_error_rel(const qm_quant_error *e)
{
    if (e->exact || e->diff2 <= 0) return 0.0;
    return e->ref2 > 0 ? sqrt(e->diff2 / e->ref2) : INFINITY;
}

int qm_quant_finite(const float *w, uint64_t n)
{
    float acc = 0.0f; /* x * 0 is 0 for every finite x, NaN for inf and NaN */
    for (uint64_t i = 0; i < n; i++)
        acc += w[i] * 0.0f;
    return acc == 0.0f;
}

/* Round half to even without libm: adding 1.5 * 2^23 leaves no fraction
 * bits, so the FPU's default rounding does the work (|x| < 2^22). */
static inline float round_even(float x)
{
    const float magic = 12582912.0f;
    return (x + magic) - magic;
}

/* The round to nearest, ties to even, of the real quotient x / s (s > 0,
 * |x / s| <= 256), with inv = 1/s in f32. x * inv is within 2e-5 of x / s,
 * so a result further than 1e-3 from a half-integer is already exact; near
 * one, the residual x - q*s decides (exact in f64: q has at most 9 bits and
 * x is within a factor 2^9 of q*s). The import's inner loop: the slow branch
 * runs for about 1 value in 500. */
static inline float rtn_quotient(float x, float s, float inv)
{
    float t = x * inv, q = round_even(t);
    if (fabsf(t - q) < 0.4990234375f) return q;
    double r = (double)x - (double)q * (double)s, h = 0.5 * (double)s;
    int odd = ((long)q & 1) != 0;
    if (r > h || (r == h && odd)) return q + 1.0f;
    if (r < -h || (r == -h && odd)) return q - 1.0f;
    return q;
}

/* The smallest positive value of a scale dtype. */
static float smallest_positive(qm_dtype dt)
{
    if (dt == QM_DTYPE_F16) return 5.9604645e-8f;    /* 2^-24 */
    if (dt == QM_DTYPE_BF16) return 9.18354962e-41f; /* 2^-133 */
    return 1.40129846e-45f;
}

/* The scale as stored. Under QM_QUANT_STORED_SCALE the codes divide by it,
 * so it is never rounded to 0 (a tiny block of f16 gets 2^-24). */
static float stored_scale(const qm_quant_spec *q, float scale)
{
    float stored = qm_quant_round_to(q->scale_dtype, scale);
    if (q->rule == QM_QUANT_STORED_SCALE && stored < smallest_positive(q->scale_dtype))
        stored = smallest_positive(q->scale_dtype);
    return stored;
}

static void pack_codes(const uint8_t *codes, uint64_t n, unsigned bits, uint8_t *dst)
{
    if (bits == 8) {
        memcpy(dst, codes, (size_t)n);
        return;
    }
    for (uint64_t j = 0; j + 1 < n; j += 2)
        dst[j / 2] = (uint8_t)(codes[j] | codes[j + 1] << 4);
    if (n & 1) dst[n / 2] = codes[n - 1];
}

/* A block holding a NaN or infinity, which qm_quant_row refuses: codes 0
 * and scale 0, with no arithmetic on the values (a NaN converted to an
 * integer is undefined behaviour). */
static float refused_block(const qm_quant_spec *q, uint64_t lo, uint64_t hi, uint8_t *packed,
                           int *exact)
{
    uint8_t codes[32] = {0};
    for (uint64_t c0 = lo; c0 < hi; c0 += 32)
        pack_codes(codes, hi - c0 < 32 ? hi - c0 : 32, q->bits, packed + c0 * q->bits / 8);
    *exact = 0;
    return 0.0f;
}

/* One symmetric block [lo, hi) at column offset lo of packed. */
static float quant_block_sym(const qm_quant_spec *q, const float *w, uint64_t lo, uint64_t hi,
                             uint8_t *packed, double *diff2, double *ref2, int *exact, int *finite)
{
    const float qmax = (float)((1 << (q->bits - 1)) - 1), qmin = -(float)(1 << (q->bits - 1));
    const int zp = 1 << (q->bits - 1);
    float amax = 0;
    int bad = 0; /* NaN and infinity fail a <= FLT_MAX */
    for (uint64_t c = lo; c < hi; c++) {
        float a = fabsf(w[c]);
        amax = a > amax ? a : amax;
        bad |= !(a <= FLT_MAX);
    }
    *finite &= !bad;
    if (bad) return refused_block(q, lo, hi, packed, exact);
    float scale = amax / qmax;
    if (!(scale >= 1e-8f)) scale = 1e-8f;
    float stored = stored_scale(q, scale);
    float s = q->rule == QM_QUANT_STORED_SCALE ? stored : scale, inv = 1.0f / s;
    uint8_t codes[32];
    double d2 = *diff2, r2 = *ref2;
    int ex = 1;
    /* Chunks of 32 columns: codes, then packing; the error summed in f32 per
     * chunk (exact enough to report) and in f64 across chunks. */
    for (uint64_t c0 = lo; c0 < hi; c0 += 32) {
        int n = (int)(hi - c0 < 32 ? hi - c0 : 32);
        float cd2 = 0, cr2 = 0;
        uint32_t differ = 0; /* the bits of every nonzero error, ORed */
        for (int j = 0; j < n; j++) {
            float x = w[c0 + (uint64_t)j];
            float v = rtn_quotient(x, s, inv);
            v = v < qmin ? qmin : v;
            v = v > qmax ? qmax : v;
            codes[j] = (uint8_t)((int)v + zp);
            float e = stored * v - x;
            uint32_t eb;
            memcpy(&eb, &e, 4);
            differ |= eb & 0x7fffffffu;
            cd2 += e * e;
            cr2 += x * x;
        }
        pack_codes(codes, (uint64_t)n, q->bits, packed + c0 * q->bits / 8);
        d2 += cd2;
        r2 += cr2;
        ex &= differ == 0;
    }
    *diff2 = d2;
    *ref2 = r2;
    *exact &= ex;
    return stored;
}

/* One asymmetric block (onnxruntime's tests' recipe: the codes take the
 * unrounded zero point, the stored one is rounded). */
static float quant_block_asym(const qm_quant_spec *q, const float *w, uint64_t lo, uint64_t hi,
                              uint8_t *packed, uint8_t *zero_point, double *diff2, double *ref2,
                              int *exact, int *finite)
{
    if (!qm_quant_finite(w + lo, hi - lo)) {
        *finite = 0;
        *zero_point = 0;
        return refused_block(q, lo, hi, packed, exact);
    }
    const int smax = (1 << q->bits) - 1;
    float mn = w[lo], mx = w[lo];
    for (uint64_t c = lo; c < hi; c++) {
        mn = fminf(mn, w[c]);
        mx = fmaxf(mx, w[c]);
    }
    float scale = (mx - mn) / (float)smax;
    if (!(scale >= 1e-8f)) scale = 1e-8f;
    float stored = stored_scale(q, scale);
    float s = q->rule == QM_QUANT_STORED_SCALE ? stored : scale;
    double zpf = 0.0 - (double)mn / (double)s, zpi = rint(zpf);
    zpi = zpi < 0 ? 0 : zpi > smax ? smax : zpi;
    *zero_point = (uint8_t)zpi;
    uint8_t codes[32];
    double d2 = *diff2, r2 = *ref2;
    int ex = 1;
    for (uint64_t c0 = lo; c0 < hi; c0 += 32) {
        int n = (int)(hi - c0 < 32 ? hi - c0 : 32);
        for (int j = 0; j < n; j++) {
            float x = w[c0 + (uint64_t)j];
            double v = rint((double)x / (double)s + zpf);
            v = v < 0 ? 0 : v > smax ? smax : v;
            codes[j] = (uint8_t)v;
            double e = (double)(stored * (float)(v - zpi)) - (double)x;
            d2 += e * e;
            r2 += (double)x * (double)x;
            ex &= e == 0.0;
        }
        pack_codes(codes, (uint64_t)n, q->bits, packed + c0 * q->bits / 8);
    }
    *diff2 = d2;
    *ref2 = r2;
    *exact &= ex;
    return stored;
}

int qm_quant_row(const qm_quant_spec *q, const float *w, uint64_t k, uint8_t *packed, void *scales,
                 uint64_t scale_at, uint8_t *zero_points, qm_quant_error *err)
{
    uint64_t step = q->block_size ? q->block_size : k;
    qm_quant_error local = QM_QUANT_ERROR_INIT, *e = err ? err : &local;
    int finite = 1, fits = 1;
    for (uint64_t b = 0, lo = 0; lo < k; b++, lo += step) {
        uint64_t hi = lo + step < k ? lo + step : k;
        float stored = q->asymmetric ? quant_block_asym(q, w, lo, hi, packed, &zero_points[b],
                                                        &e->diff2, &e->ref2, &e->exact, &finite)
                                     : quant_block_sym(q, w, lo, hi, packed, &e->diff2, &e->ref2,
                                                       &e->exact, &finite);
        fits &= stored <= FLT_MAX; /* f16 ends at 65504 */
        qm_quant_store(scales, q->scale_dtype, scale_at + b, stored);
    }
    return !finite ? QM_EINVAL : !fits ? QM_EUNSUPPORTED : 0;
}
