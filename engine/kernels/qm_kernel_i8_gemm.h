/* qm_kernel_i8_gemm.h - the fast-mode GEMMs' blocking, written once over
 * a small set of vector and tile operations that each includer defines:
 * the AVX2, AVX-VNNI and AVX-512 VNNI kernels with intrinsics, the AMX
 * kernel with tile instructions, and the software models of
 * qm_kernel_i8_model*.c with plain C on arrays (so the blocking, packing
 * and epilogue of a kernel this CPU cannot run are tested through its
 * model; only the instructions themselves are not). Private to engine/.
 *
 * Lanes hold weight rows: a call's 16 rows are 16 / QM__G_VL vectors. Per
 * sub-block j the integer sums S_j of (16 rows x NR inputs) are built from
 * the panel (qm_kernel_i8.h) in QM__G_G steps of 4 bytes per row, then the
 * epilogue (qm__g_epi) applies the canonical order's two fmas per output,
 * keeping t and acc per (input, row) in scratch, so any block size, row-wise
 * included, runs the same loops. Inputs go in groups of QM__I8_TG (the
 * accumulators' room), sub-blocks in chunks of QM__G_CH (a chunk's panel,
 * 4-8 KiB, stays in L1 while every input of the group passes over it).
 *
 * Every includer defines the vector operations:
 *   QM__G_VL                 lanes (8 or 16)
 *   QM__G_VI, QM__G_VF       int32 and f32 vectors
 *   QM__G_VLOADI(p)          VL int32 from p
 *   QM__G_SUBZ(s, z)         s - z (z an int32 for every lane)
 *   QM__G_SUBZP(s, zp, q)    s - zp * q (zp: VL int32 at a pointer; q an int32)
 *   QM__G_CVT(s)             int32 -> f32 (round to nearest)
 *   QM__G_LOADF(p), QM__G_STOREF(p, v), QM__G_SETF(f), QM__G_ZEROF()
 *   QM__G_FMA(a, b, c)       a * b + c, one rounding
 * and for the dot-product GEMM (qm__g_mm, named QM__G_FN):
 *   QM__G_G                  steps per sub-block (8: u8 panel, 16: s16 panel)
 *   QM__G_S16                1: the s16 panel and the s16 codes (zero points folded in)
 *   QM__G_NR                 inputs per micro-kernel pass (<= 8)
 *   QM__G_VA, QM__G_VW       accumulator and weight-vector types
 *   QM__G_ACC0()             a zero accumulator
 *   QM__G_LOADW(p)           the weights of VL rows of one step (VL * 4 bytes)
 *   QM__G_STEP(a, w, x4)     a plus, per lane, the dot of its 4 weight bytes
 *                            with the 4 bytes at x4 (u8 x s8, or 2 s16 x 2 s16)
 *   QM__G_FIN(a)             the accumulator as int32 sums (QM__G_VI)
 * and optionally
 *   QM__G_SB(w, xb, off, a)  its own loop for a full pass of QM__G_NR
 *                            inputs over one sub-block: a[v][t] as the
 *                            QM__G_G steps above leave them (the AVX2
 *                            4-bit GEMM's register-bound version)
 * (a vpdpbusd ISA, u8 x s8 summed by 4 with no widening, names only
 *   QM__G_DPBUSD(a, w, x4)   QM__G_STEP on the u8 panel
 * instead of QM__G_G, QM__G_S16, QM__G_STEP and QM__G_FIN, which follow)
 *   QM__G_PACK(m, n0, nr, j0, j1, pan)   the panel of sub-blocks [j0, j1)
 *   QM__G_PARAMS(m, n0, nr, sct, zpt)    the call's scales / zero points
 * or, for the AMX GEMM (qm__t_mm, named QM__T_FN), the tile operations
 *   QM__T_CFG(cfg), QM__T_ZERO_C(), QM__T_LOAD_A(p, stride), QM__T_LOAD_B(p),
 *   QM__T_DP(), QM__T_STORE_C(p), QM__T_RELEASE()
 * with QM__G_PACK / QM__G_PARAMS as above (u8 panel). */
#ifndef QM_KERNEL_I8_GEMM_H
#define QM_KERNEL_I8_GEMM_H

#include "qm_kernel_i8.h"

#define QM__G_VPR (16 / QM__G_VL) /* vectors per 16 rows */
#define QM__G_CAT2(a, b) a##b
#define QM__G_CAT(a, b) QM__G_CAT2(a, b)
#define QM__G_CH 8u               /* sub-blocks per chunk */

/* What a GEMM call shares with its micro-kernels. */
typedef struct qm__g_call {
    const qm__qmat *m;
    const float *xq;
    size_t ldx, nse;
    uint32_t spb, nblk;
    qm__i8_scratch s;
    int has_zp;
} qm__g_call;

/* Where sub-block j stands in the order: its block b, its place w in it,
 * whether it starts and ends the block; stepped from one sub-block to the
 * next without a division. */
typedef struct qm__g_pos {
    uint32_t b, w;
    int first, last;
} qm__g_pos;

static inline qm__g_pos qm__g_pos_of(const qm__g_call *c, size_t j)
{
    qm__g_pos p = {.b = (uint32_t)(j / c->spb), .w = (uint32_t)(j % c->spb)};
    p.first = p.w == 0;
    p.last = p.w + 1 == c->spb || j + 1 == c->nse;
    return p;
}

/* The position of j + 1 after p (j's). */
static inline qm__g_pos qm__g_pos_next(const qm__g_call *c, qm__g_pos p, size_t j)
{
    if (++p.w == c->spb) {
        p.w = 0;
        p.b++;
    }
    p.first = p.w == 0;
    p.last = p.w + 1 == c->spb || j + 2 == c->nse;
    return p;
}

/* The canonical order's epilogue for one vector of rows v (of QM__G_VPR)
 * and one input, sub-block j at p: s holds S_j before the zero point unless
 * the panel folded it in. tacc / acc point at this input's 16 rows. ZP and
 * SPB1 (blocks of one sub-block: every j starts and ends its block) are
 * constants at each call site, so the branches fold away. */
QM__I8_AI void qm__g_epi(const qm__g_call *c, const qm__i8_xrow *x, size_t j, qm__g_pos p, int v,
                         QM__G_VI s, int folded, const int ZP, const int SPB1, float *tacc,
                         float *acc)
{
    if (!folded)
        s = ZP ? QM__G_SUBZP(s, c->s.zpt + 16 * (size_t)p.b + v * QM__G_VL, x->sumq[j])
               : QM__G_SUBZ(s, x->zsum[j]);
    QM__G_VF t0 = SPB1 || p.first ? QM__G_ZEROF() : QM__G_LOADF(tacc + v * QM__G_VL);
    QM__G_VF t = QM__G_FMA(QM__G_CVT(s), QM__G_SETF(x->dx[j]), t0);
    if (SPB1 || p.last)
        QM__G_STOREF(acc + v * QM__G_VL,
                     QM__G_FMA(t, QM__G_LOADF(c->s.sct + 16 * (size_t)p.b + v * QM__G_VL),
                               QM__G_LOADF(acc + v * QM__G_VL)));
    else
        QM__G_STOREF(tacc + v * QM__G_VL, t);
}

/* The accumulators of inputs [0, tn) of a group, as the order starts them;
 * and the group's outputs, rows [n0, n0 + nr), into y. */
static inline void qm__g_group_begin(const qm__g_call *c, uint32_t tn)
{
    memset(c->s.acc, 0, sizeof(float) * 16 * tn);
}

static inline void qm__g_group_end(const qm__g_call *c, uint32_t tn, uint32_t n0, uint32_t nr,
                                   float *y, size_t ldy)
{
    for (uint32_t t = 0; t < tn; t++)
        memcpy(y + (size_t)t * ldy + n0, c->s.acc + 16 * (size_t)t, sizeof(float) * nr);
}

/* While a chunk [j0, j1) of this call runs, the same codes of the next
 * tile's rows (n1 on): a call's weights are read once, by its packer, as
 * 16 short streams the hardware prefetcher would reach only late. */
static inline void qm__g_prefetch_next(const qm__qmat *m, uint32_t n1, size_t j0, size_t j1)
{
    size_t per = m->bits == 4 ? 16 : 32, o0 = per * j0, o1 = per * j1;
    if (o1 > m->row_bytes)
        o1 = m->row_bytes;
    for (uint32_t n = n1; n < n1 + 16 && n < m->n; n++)
        for (size_t o = o0 & ~(size_t)63; o < o1; o += 64)
            __builtin_prefetch(m->w + (size_t)n * m->row_bytes + o, 0, QM__PF_LOCALITY);
}

static inline qm__g_call qm__g_call_make(const qm__qmat *m, const float *xq, size_t ldx,
                                         float *scratch)
{
    qm__g_call c = {.m = m, .xq = xq, .ldx = ldx, .nse = qm__i8_nse(m), .spb = qm__i8_spb(m),
                    .nblk = m->nblk, .s = qm__i8_scratch_at(m, scratch), .has_zp = m->zp != NULL};
    return c;
}

#endif /* QM_KERNEL_I8_GEMM_H */

#if defined(QM__G_DPBUSD) && !defined(QM__G_STEP)
#define QM__G_G 8
#define QM__G_S16 0
#define QM__G_STEP(a, w, x4) QM__G_DPBUSD(a, w, x4)
#define QM__G_FIN(a) (a)
#endif

/* The dot-product GEMM, once per inclusion with QM__G_STEP defined (the
 * includer names it QM__G_FN and its micro-kernel QM__G_MICRO). */
#ifdef QM__G_STEP
/* NR inputs from tok (of the group starting at tok0), sub-blocks [j0, j1). */
QM__I8_AI void QM__G_MICRO(const qm__g_call *c, size_t j0, size_t j1, uint32_t tok0, uint32_t tok,
                           const int NR, const int ZP, const int SPB1)
{
    qm__i8_xrow x[QM__G_NR];
    const uint8_t *xb[QM__G_NR];
#pragma GCC unroll 8
    for (int t = 0; t < NR; t++) {
        x[t] = qm__i8_xrow_at(c->m, c->xq + (size_t)(tok0 + tok + t) * c->ldx);
        xb[t] = QM__G_S16 ? (const uint8_t *)x[t].q16 : (const uint8_t *)x[t].q;
    }
    const size_t seg = QM__G_S16 ? 64 : 32, pstride = (size_t)QM__G_G * 64;
    qm__g_pos pos = qm__g_pos_of(c, j0);
    for (size_t j = j0; j < j1; j++) {
        const uint8_t *w = c->s.pan + j * pstride;
        QM__G_VA a[QM__G_VPR][QM__G_NR];
#pragma GCC unroll 8
        for (int v = 0; v < QM__G_VPR; v++)
#pragma GCC unroll 8
            for (int t = 0; t < NR; t++)
                a[v][t] = QM__G_ACC0();
#ifdef QM__G_SB
        /* The includer's own loop for a full pass of inputs. */
        if (NR == QM__G_NR) {
            QM__G_SB(w, xb, seg * j, a);
        } else
#endif
        /* Not unrolled: GCC would reassociate the unrolled chain of
         * vector adds into a tree and spill every product. */
#pragma GCC unroll 1
        for (int g = 0; g < QM__G_G; g++) {
            QM__G_VW wv[QM__G_VPR];
#pragma GCC unroll 8
            for (int v = 0; v < QM__G_VPR; v++)
                wv[v] = QM__G_LOADW(w + 64 * g + 4 * QM__G_VL * v);
#pragma GCC unroll 8
            for (int t = 0; t < NR; t++) {
                const uint8_t *x4 = xb[t] + seg * j + 4 * g;
#pragma GCC unroll 8
                for (int v = 0; v < QM__G_VPR; v++)
                    a[v][t] = QM__G_STEP(a[v][t], wv[v], x4);
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < NR; t++) {
            float *ta = c->s.tacc + 16 * (size_t)(tok + t), *ac = c->s.acc + 16 * (size_t)(tok + t);
#pragma GCC unroll 8
            for (int v = 0; v < QM__G_VPR; v++)
                qm__g_epi(c, &x[t], j, pos, v, QM__G_FIN(a[v][t]), QM__G_S16, ZP, SPB1, ta, ac);
        }
        if (!SPB1)
            pos = qm__g_pos_next(c, pos, j);
        else
            pos.b++;
    }
}

/* Inputs [0, tn) of the group at tok0 over sub-blocks [j0, j1), NR at a time. */
QM__I8_AI void QM__G_CAT(QM__G_MICRO, _all)(const qm__g_call *c, size_t j0, size_t j1,
                                            uint32_t tok0, uint32_t tn, const int ZP,
                                            const int SPB1)
{
    uint32_t t = 0;
    for (; t + QM__G_NR <= tn; t += QM__G_NR)
        QM__G_MICRO(c, j0, j1, tok0, t, QM__G_NR, ZP, SPB1);
    switch (tn - t) {
#if QM__G_NR > 7
    case 7: QM__G_MICRO(c, j0, j1, tok0, t, 7, ZP, SPB1); break;
#endif
#if QM__G_NR > 6
    case 6: QM__G_MICRO(c, j0, j1, tok0, t, 6, ZP, SPB1); break;
#endif
#if QM__G_NR > 5
    case 5: QM__G_MICRO(c, j0, j1, tok0, t, 5, ZP, SPB1); break;
#endif
#if QM__G_NR > 4
    case 4: QM__G_MICRO(c, j0, j1, tok0, t, 4, ZP, SPB1); break;
#endif
    case 3: QM__G_MICRO(c, j0, j1, tok0, t, 3, ZP, SPB1); break;
    case 2: QM__G_MICRO(c, j0, j1, tok0, t, 2, ZP, SPB1); break;
    case 1: QM__G_MICRO(c, j0, j1, tok0, t, 1, ZP, SPB1); break;
    default: break;
    }
}

void QM__G_FN(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq, size_t ldx,
              uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__g_call c = qm__g_call_make(m, xq, ldx, scratch);
    uint32_t nr = n1 - n0;
    const int zp = c.has_zp && !QM__G_S16, spb1 = c.spb == 1;
    QM__G_PARAMS(m, n0, nr, c.s.sct, zp ? c.s.zpt : NULL);
    QM__G_PACK(m, n0, nr, 0, c.nse, c.s.pan);
    for (uint32_t tok0 = 0; tok0 < nx; tok0 += QM__I8_TG) {
        uint32_t tn = nx - tok0 < QM__I8_TG ? nx - tok0 : QM__I8_TG;
        qm__g_group_begin(&c, tn);
        for (size_t j0 = 0; j0 < c.nse; j0 += QM__G_CH) {
            size_t j1 = j0 + QM__G_CH < c.nse ? j0 + QM__G_CH : c.nse;
            if (tok0 == 0)
                qm__g_prefetch_next(m, n1, j0, j1);
            if (spb1 && !zp)
                QM__G_CAT(QM__G_MICRO, _all)(&c, j0, j1, tok0, tn, 0, 1);
            else if (spb1)
                QM__G_CAT(QM__G_MICRO, _all)(&c, j0, j1, tok0, tn, 1, 1);
            else if (!zp)
                QM__G_CAT(QM__G_MICRO, _all)(&c, j0, j1, tok0, tn, 0, 0);
            else
                QM__G_CAT(QM__G_MICRO, _all)(&c, j0, j1, tok0, tn, 1, 0);
        }
        qm__g_group_end(&c, tn, n0, nr, y + (size_t)tok0 * ldy, ldy);
    }
}
#endif /* QM__G_STEP */

#if defined(QM__T_DP) && !defined(QM__T_DONE)
#define QM__T_DONE
/* AMX: per group of M <= 16 inputs and sub-block j, C = A (the inputs'
 * codes of j, M x 32 s8) times B (the panel of j, u8) in one tdpbsud, C
 * stored and each of its M rows (16 int32: the call's rows) run through
 * the epilogue. The configuration is loaded once per group size and the
 * tiles released before returning. */
void QM__T_FN(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq, size_t ldx,
              uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__g_call c = qm__g_call_make(m, xq, ldx, scratch);
    uint32_t nr = n1 - n0, cur = 0;
    QM__G_PARAMS(m, n0, nr, c.s.sct, c.has_zp ? c.s.zpt : NULL);
    QM__G_PACK(m, n0, nr, 0, c.nse, c.s.pan);
    qm__amx_cfg cfg;
    for (uint32_t tok0 = 0; tok0 < nx; tok0 += 16) {
        uint32_t M = nx - tok0 < 16 ? nx - tok0 : 16;
        if (M != cur) {
            qm__amx_cfg_make(&cfg, M);
            QM__T_CFG(&cfg);
            cur = M;
        }
        qm__g_group_begin(&c, M);
        qm__i8_xrow x[16];
        for (uint32_t t = 0; t < M; t++)
            x[t] = qm__i8_xrow_at(m, xq + (size_t)(tok0 + t) * ldx);
        for (size_t j = 0; j < c.nse; j++) {
            QM__T_ZERO_C();
            QM__T_LOAD_A((const uint8_t *)x[0].q + 32 * j, ldx * sizeof(float));
            QM__T_LOAD_B(c.s.pan + 512 * j);
            QM__T_DP();
            QM__T_STORE_C(c.s.cbuf);
            qm__g_pos pos = qm__g_pos_of(&c, j);
            for (uint32_t t = 0; t < M; t++)
#pragma GCC unroll 2
                for (int v = 0; v < QM__G_VPR; v++)
                    qm__g_epi(&c, &x[t], j, pos, v,
                              QM__G_VLOADI(c.s.cbuf + 16 * t + v * QM__G_VL), 0, c.has_zp, 0,
                              c.s.tacc + 16 * (size_t)t, c.s.acc + 16 * (size_t)t);
        }
        qm__g_group_end(&c, M, n0, nr, y + (size_t)tok0 * ldy, ldy);
    }
    QM__T_RELEASE();
}
#endif /* QM__T_DP */
