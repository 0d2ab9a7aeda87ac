/* import_elements.c - source elements to f32 (see import_elements.h). */
#include "import_elements.h"

#include <math.h>
#include <string.h>

#include "qm_half.h"

/* ---- elements ------------------------------------------------------------ */

qm__elem qm__elem_from_st(const char *s)
{
    static const struct {
        const char *name;
        qm__elem e;
    } map[] = {{"F32", QM__ELEM_F32},
               {"F16", QM__ELEM_F16},
               {"BF16", QM__ELEM_BF16},
               {"F8_E4M3", QM__ELEM_F8_E4M3},
               {"U8", QM__ELEM_U8}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (strcmp(s, map[i].name) == 0) return map[i].e;
    return QM__ELEM_OTHER;
}

size_t qm__elem_size(qm__elem e)
{
    switch (e) {
    case QM__ELEM_F32:
        return 4;
    case QM__ELEM_F16:
    case QM__ELEM_BF16:
        return 2;
    case QM__ELEM_F8_E4M3:
    case QM__ELEM_U8:
        return 1;
    default:
        return 0;
    }
}

const char *qm__elem_name(qm__elem e)
{
    static const char *names[] = {"F32", "F16", "BF16", "F8_E4M3", "U8", "other"};
    return names[e <= QM__ELEM_OTHER ? e : QM__ELEM_OTHER];
}

float qm__e4m3_to_f32(uint8_t v)
{
    int sign = v & 0x80, exp = (v >> 3) & 0xf, mant = v & 7;
    float f;
    if (exp == 0xf && mant == 7)
        f = NAN;
    else if (exp == 0)
        f = ldexpf((float)mant, -9); /* subnormal: mant/8 * 2^-6 */
    else
        f = ldexpf((float)(8 + mant), exp - 7 - 3);
    return sign ? -f : f;
}

float qm__elem_load(const void *src, qm__elem e, size_t i)
{
    const uint8_t *p = src;
    switch (e) {
    case QM__ELEM_F32: {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    case QM__ELEM_F16:
    case QM__ELEM_BF16: {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        return e == QM__ELEM_F16 ? qm_f16_to_f32(h) : qm_bf16_to_f32(h);
    }
    case QM__ELEM_F8_E4M3:
        return qm__e4m3_to_f32(p[i]);
    default:
        return NAN;
    }
}

void qm__elem_load_row(const void *src, qm__elem e, size_t n, float *dst)
{
    if (e == QM__ELEM_F32) {
        memcpy(dst, src, n * 4);
        return;
    }
    if (e == QM__ELEM_BF16) { /* the hot path of a bf16 import */
        const uint8_t *p = src;
        for (size_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)p[2 * i] << 16 | (uint32_t)p[2 * i + 1] << 24;
            memcpy(&dst[i], &u, 4);
        }
        return;
    }
    for (size_t i = 0; i < n; i++)
        dst[i] = qm__elem_load(src, e, i);
}

const int8_t qm__fp4_half[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

float qm__e8m0_half_scale(uint8_t e)
{
    return ldexpf(1.0f, (int)e - 128);
}
