/* qm_kernel_i8_model_v.h - qm_kernel_i8_gemm.h's vector operations in
 * plain C on arrays of QM__G_VL lanes (defined by the includer), with
 * vpdpbusd modelled per lane: the models' half of that header's contract.
 * Tests only. */
#ifndef QM_KERNEL_I8_MODEL_V_H
#define QM_KERNEL_I8_MODEL_V_H

#include <math.h>
#include <string.h>

#include "qm_kernel_i8.h"
#include "qm_kernel_i8_model.h"

typedef struct qm__mvi {
    int32_t v[QM__G_VL];
} qm__mvi;
typedef struct qm__mvf {
    float v[QM__G_VL];
} qm__mvf;
typedef struct qm__mvw {
    uint8_t b[4 * QM__G_VL];
} qm__mvw;

static inline qm__mvi qm__mv_zeroi(void)
{
    qm__mvi r;
    memset(r.v, 0, sizeof r.v);
    return r;
}
static inline qm__mvi qm__mv_loadi(const int32_t *p)
{
    qm__mvi r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline qm__mvi qm__mv_subz(qm__mvi s, int32_t z)
{
    for (int l = 0; l < QM__G_VL; l++)
        s.v[l] -= z;
    return s;
}
static inline qm__mvi qm__mv_subzp(qm__mvi s, const int32_t *zp, int32_t q)
{
    for (int l = 0; l < QM__G_VL; l++)
        s.v[l] -= zp[l] * q;
    return s;
}
static inline qm__mvf qm__mv_cvt(qm__mvi s)
{
    qm__mvf r;
    for (int l = 0; l < QM__G_VL; l++)
        r.v[l] = (float)s.v[l];
    return r;
}
static inline qm__mvf qm__mv_loadf(const float *p)
{
    qm__mvf r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline void qm__mv_storef(float *p, qm__mvf v)
{
    memcpy(p, v.v, sizeof v.v);
}
static inline qm__mvf qm__mv_setf(float f)
{
    qm__mvf r;
    for (int l = 0; l < QM__G_VL; l++)
        r.v[l] = f;
    return r;
}
static inline qm__mvf qm__mv_fma(qm__mvf a, qm__mvf b, qm__mvf c)
{
    for (int l = 0; l < QM__G_VL; l++)
        c.v[l] = fmaf(a.v[l], b.v[l], c.v[l]);
    return c;
}
static inline qm__mvw qm__mv_loadw(const uint8_t *p)
{
    qm__mvw r;
    memcpy(r.b, p, sizeof r.b);
    return r;
}
static inline qm__mvi qm__mv_dpbusd(qm__mvi a, qm__mvw w, const uint8_t *x4)
{
    for (int l = 0; l < QM__G_VL; l++)
        a.v[l] = qm__model_dpbd(a.v[l], w.b + 4 * l, x4);
    return a;
}

#define QM__G_VI qm__mvi
#define QM__G_VF qm__mvf
#define QM__G_VLOADI(p) qm__mv_loadi(p)
#define QM__G_SUBZ(s, z) qm__mv_subz(s, z)
#define QM__G_SUBZP(s, zp, q) qm__mv_subzp(s, zp, q)
#define QM__G_CVT(s) qm__mv_cvt(s)
#define QM__G_LOADF(p) qm__mv_loadf(p)
#define QM__G_STOREF(p, v) qm__mv_storef(p, v)
#define QM__G_SETF(f) qm__mv_setf(f)
#define QM__G_ZEROF() qm__mv_setf(0.0f)
#define QM__G_FMA(a, b, c) qm__mv_fma(a, b, c)
#define QM__G_PARAMS(m, n0, nr, sct, zpt) qm__i8_params_c(m, n0, nr, sct, zpt)
#define QM__G_PACK(m, n0, nr, j0, j1, pan) qm__i8_pack_u8_c(m, n0, nr, j0, j1, pan)

#endif
