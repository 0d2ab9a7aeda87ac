/* qm_gemm_tiles.h - the tile loop of the packed exact GEMMs, written once
 * for the AVX-512 one (qm_gemm_packed_avx512.c) and the AVX2 one
 * (qm_kernel_avx2.c), which differ only in their vector width: how a
 * panel is built, prefetched and multiplied. Private to engine/kernels. */
#ifndef QM_GEMM_TILES_H
#define QM_GEMM_TILES_H

#include <stdint.h>

#include "qm_kernels.h"

/* Defines NAME, a qm__mm_fn: W rows [n0, n1) (one panel, at most 16) times
 * nx input rows. K runs in tiles of QM__GEMM_KT prepared columns, in
 * order: PANEL(m, n0, nr, kt0, len, wt, sv, zv) dequantises the tile's
 * panel wt[len][16] once (sv, zv: its scales and zero points, MAXB blocks
 * of 16), PREFETCH(m, n0, nr, kt0) asks for the next tile's codes while
 * this one's FMAs run, and the input rows run in balanced groups of at
 * most MAXR (`big` groups one row longer than the rest), each one
 * register block ROWS(rows, wt, len, x, ldx, y, ldy, EDGE, add) that
 * stores the first tile's sums and adds the others'. EDGE tells ROWS which
 * of the 16 outputs exist (the AVX-512 lane mask, the AVX2 count nr).
 * Which rows share a group changes no bits. scratch has room for the panel
 * aligned to a line and the scales (qm__kernel_scratch_floats). */
#define QM__PACKED_GEMM(NAME, PANEL, PREFETCH, ROWS, MAXR, MAXB, EDGE)                            \
    void NAME(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp, size_t ldx,         \
              uint32_t nx, float *y, size_t ldy, float *scratch)                                   \
    {                                                                                              \
        const uint32_t kp = (m->k + 15) & ~15u, nr = n1 - n0;                                      \
        if (nx == 0 || nr == 0)                                                                    \
            return;                                                                                \
        /* The panel on a cache-line boundary: every panel load is one line. */                   \
        float *wt = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);                         \
        float *sv = wt + (size_t)16 * QM__GEMM_KT, *zv = sv + 16 * (MAXB);                         \
        const uint32_t ng = (nx + (MAXR)-1) / (MAXR);                                              \
        const uint32_t base = nx / ng, big = nx % ng;                                              \
        PREFETCH(m, n0, nr, 0);                                                                    \
        for (uint32_t kt0 = 0; kt0 < kp; kt0 += QM__GEMM_KT) {                                     \
            uint32_t len = kp - kt0 < QM__GEMM_KT ? kp - kt0 : QM__GEMM_KT;                        \
            PANEL(m, n0, nr, kt0, len, wt, sv, zv);                                                \
            if (kt0 + QM__GEMM_KT < kp)                                                            \
                PREFETCH(m, n0, nr, kt0 + QM__GEMM_KT);                                            \
            for (uint32_t g = 0, r0 = 0; g < ng; g++) {                                            \
                uint32_t rows = base + (g < big);                                                  \
                ROWS(rows, wt, len, xp + (size_t)r0 * ldx + kt0, ldx, y + (size_t)r0 * ldy + n0,   \
                     ldy, EDGE, kt0 != 0);                                                         \
                r0 += rows;                                                                        \
            }                                                                                      \
        }                                                                                          \
    }

#endif
