/* qm_kernel_i8_model16.c - the AVX-512 VNNI kernel's GEMM and the AMX
 * kernel (qm_kernel_i8_gemm.h, a call's 16 rows per vector) with vpdpbusd
 * and the tile instructions modelled in C: the tiles as arrays under the
 * loaded configuration, every configuration and shape checked as the
 * hardware checks it (a fault is counted, qm__amx_model_faults). Tests only. */
#define QM__G_VL 16
#include "qm_kernel_i8_model_v.h"

#define QM__G_VA qm__mvi
#define QM__G_VW qm__mvw
#define QM__G_ACC0() qm__mv_zeroi()
#define QM__G_LOADW(p) qm__mv_loadw(p)
#define QM__G_NR QM__I8_AVX512VNNI_NR
#define QM__G_FN qm__model16_gemm
#define QM__G_MICRO qm__model16_micro
#define QM__G_DPBUSD(a, w, x4) qm__mv_dpbusd(a, w, x4)
static qm__mm_fn qm__model16_gemm;
#include "qm_kernel_i8_gemm.h"

/* ---- the AMX model: tiles tmm0..tmm7 of 16 rows x 64 bytes ---- */
typedef struct qm__amx_model {
    qm__amx_cfg cfg;
    int configured;
    uint8_t tile[8][16][64];
    int faults;
    const char *why;
} qm__amx_model;

static _Thread_local qm__amx_model qm__amx_st;

static void qm__amx_fault(const char *why)
{
    if (!qm__amx_st.faults++)
        qm__amx_st.why = why;
}

int qm__amx_model_faults(const char **why)
{
    int n = qm__amx_st.faults;
    if (why)
        *why = qm__amx_st.why;
    qm__amx_st.faults = 0;
    qm__amx_st.why = NULL;
    return n;
}

/* ldtilecfg: palette 1, reserved bytes zero, every tile within 16 rows
 * and 64 bytes, a tile's rows and bytes both zero or both not; all tiles
 * zeroed. */
static void qm__amx_m_cfg(const qm__amx_cfg *c)
{
    const uint8_t *raw = (const uint8_t *)c;
    qm__amx_st.configured = 0;
    if (c->palette != 1 || c->start_row != 0)
        {
            qm__amx_fault("ldtilecfg: palette not 1 or start_row not 0");
            return;
        }
    for (int i = 2; i < 16; i++)
        if (raw[i])
            {
            qm__amx_fault("ldtilecfg: reserved bytes 2..15 not zero");
            return;
        }
    for (int t = 0; t < 16; t++) {
        if (c->rows[t] > 16 || c->colsb[t] > 64 || (c->colsb[t] % 4) ||
            (!c->rows[t]) != (!c->colsb[t]))
            {
            qm__amx_fault("ldtilecfg: a tile's rows or bytes out of range");
            return;
        }
        if (t >= 8 && (c->rows[t] || c->colsb[t]))
            {
            qm__amx_fault("ldtilecfg: palette 1 has 8 tiles");
            return;
        }
    }
    qm__amx_st.cfg = *c;
    qm__amx_st.configured = 1;
    memset(qm__amx_st.tile, 0, sizeof qm__amx_st.tile);
}

static int qm__amx_m_ok(int t)
{
    if (!qm__amx_st.configured || !qm__amx_st.cfg.rows[t]) {
        qm__amx_fault("a tile used before ldtilecfg configured it");
        return 0;
    }
    return 1;
}

static void qm__amx_m_zero(int t)
{
    if (qm__amx_m_ok(t))
        memset(qm__amx_st.tile[t], 0, sizeof qm__amx_st.tile[t]);
}

/* tileloadd: rows x colsb bytes at stride; the rest of the tile zeroed. */
static void qm__amx_m_load(int t, const uint8_t *p, size_t stride)
{
    if (!qm__amx_m_ok(t))
        return;
    memset(qm__amx_st.tile[t], 0, sizeof qm__amx_st.tile[t]);
    for (int r = 0; r < qm__amx_st.cfg.rows[t]; r++)
        memcpy(qm__amx_st.tile[t][r], p + r * stride, qm__amx_st.cfg.colsb[t]);
}

static void qm__amx_m_store(int t, uint8_t *p, size_t stride)
{
    if (!qm__amx_m_ok(t))
        return;
    for (int r = 0; r < qm__amx_st.cfg.rows[t]; r++)
        memcpy(p + r * stride, qm__amx_st.tile[t][r], qm__amx_st.cfg.colsb[t]);
}

/* tdpbsud c, a, b: C[m][n] += sum_k sum_e s8 A[m][4k+e] * u8 B[k][4n+e],
 * after the shape checks that would raise #UD. */
static void qm__amx_m_dpbsud(int c, int a, int b)
{
    if (!qm__amx_m_ok(c) || !qm__amx_m_ok(a) || !qm__amx_m_ok(b))
        return;
    const qm__amx_cfg *g = &qm__amx_st.cfg;
    if (g->rows[c] != g->rows[a] || g->colsb[a] / 4 != g->rows[b] || g->colsb[c] != g->colsb[b])
        {
            qm__amx_fault("tdpbsud: tile shapes do not match");
            return;
        }
    for (int mm = 0; mm < g->rows[c]; mm++)
        for (int n = 0; n < g->colsb[c] / 4; n++) {
            int32_t acc;
            memcpy(&acc, &qm__amx_st.tile[c][mm][4 * n], 4);
            for (int k = 0; k < g->colsb[a] / 4; k++)
                for (int e = 0; e < 4; e++)
                    acc += (int32_t)(int8_t)qm__amx_st.tile[a][mm][4 * k + e] *
                           (int32_t)qm__amx_st.tile[b][k][4 * n + e];
            memcpy(&qm__amx_st.tile[c][mm][4 * n], &acc, 4);
        }
}

#undef QM__G_DPBUSD
#undef QM__G_STEP
#define QM__T_FN qm__model_amx_gemm
#define QM__T_CFG(cfg) qm__amx_m_cfg(cfg)
#define QM__T_ZERO_C() qm__amx_m_zero(0)
#define QM__T_LOAD_A(p, stride) qm__amx_m_load(1, (const uint8_t *)(p), stride)
#define QM__T_LOAD_B(p) qm__amx_m_load(2, p, 64)
#define QM__T_DP() qm__amx_m_dpbsud(0, 1, 2)
#define QM__T_STORE_C(p) qm__amx_m_store(0, (uint8_t *)(p), 64)
#define QM__T_RELEASE() (void)(qm__amx_st.configured = 0)
static qm__mm_fn qm__model_amx_gemm;
#include "qm_kernel_i8_gemm.h"

static void qm__model16_mm(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                           size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__i8_split(QM__I8_AVX512VNNI_GEMM_MIN(m), qm__model_vnni_gemv, qm__model16_gemm, m, n0, n1,
                 xq, ldx, nx, y, ldy, scratch);
}

static void qm__model_amx_mm(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                             size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__i8_split(QM__I8_AMX_MIN, qm__model16_mm, qm__model_amx_gemm, m, n0, n1, xq, ldx, nx, y,
                 ldy, scratch);
}

/* The avx512vnni and amx rows' models (their .model). */
const qm__i8isa qm__i8model_avx512vnni = {
    .kernel = {.name = "model-avx512vnni", .mm = qm__model16_mm},
    .gemv = qm__model_vnni_gemv,
    .gemm = qm__model16_gemm,
    .reads_r8 = 1,
    .reads_r8_q8 = 1};
const qm__i8isa qm__i8model_amx = {.kernel = {.name = "model-amx", .mm = qm__model_amx_mm},
                                   .gemv = qm__model16_mm,
                                   .gemm = qm__model_amx_gemm,
                                   .reads_r8 = 1,
                                   .reads_r8_q8 = 1};
