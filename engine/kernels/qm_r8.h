/* qm_r8.h - weight codes with rows interleaved eight at a time (the "r8"
 * layout), the fast-mode decode GEMV's layout on the CPU.
 *
 * A matrix of n rows of row_bytes code bytes keeps its bytes and its size;
 * only their order changes, within each group of 8 rows (rows 8g..8g+7,
 * the same 8 x row_bytes bytes at the same offset): each 16 bytes of a row
 * (bytes 16j..16j+15: the 32 columns of 4-bit sub-block j, half of 8-bit
 * sub-block j / 2) take bytes 128j..128j+127 of the group, as 4 runs of 32
 * bytes; run q holds bytes 16j+4q..16j+4q+3 of row 0, then of row 1, ...
 * row 7. So one 32-byte load is 4 code bytes of each of 8 rows (lane r =
 * row r): a sub-block's integer sums come out one row per lane, with no
 * horizontal reduction, and a group is one linear stream (llama.cpp's
 * repacked Q4_0 is the same idea); an 8-bit sub-block is 8 such runs in a
 * row. The layout is one of bytes: it does not depend on the code width.
 * Scales, zero points and biases keep their layout. The integer sums,
 * hence the bits, are those of the row layout (tests/engine/test_kernels.c).
 *
 * Only matrices the fast GEMV's b32 path takes are laid out so (4-bit or
 * 8-bit, blocks of 32 columns with no zero points, K a multiple of 64, rows
 * of exactly K * bits / 8 bytes, N a multiple of 8): qm__r8_eligible. The
 * pager lays whole banks out so when a fast session's kernel reads r8 of
 * the bank's width natively (qm__i8kernel_r8_native; docs/PAGING.md); every
 * other reader gets row-major tiles back from qm__r8_rows. */
#ifndef QM_R8_H
#define QM_R8_H

#include <stddef.h>
#include <stdint.h>

#include "qm_bank.h"

/* Where byte o (< row_bytes) of row n of an r8 matrix lies, in bytes from
 * the matrix's start: in row n's group, run o / 4 % 4 of sub-block o / 16,
 * at the row's place in the run. */
static inline size_t qm__r8_offset(size_t row_bytes, uint32_t n, size_t o)
{
    return (size_t)(n & ~7u) * row_bytes + 128 * (o / 16) + 32 * (o % 16 / 4) + 4 * (n & 7u) +
           o % 4;
}

/* 1 when tensor wt (QM_T_FC1_WEIGHT, ..._FC2_, ..._FC3_) of layer view lv
 * of a bank with config cfg can take the r8 layout. */
int qm__r8_eligible(const qm_bank_config *cfg, const qm_layer_view *lv, int wt);
/* The rows of one matrix (n rows of row_bytes, n a multiple of 8) from row
 * order into r8, in place; tmp holds 8 * row_bytes bytes. */
void qm__r8_interleave(uint8_t *w, uint32_t n, size_t row_bytes, uint8_t *tmp);
/* The same layout out of place: rows [0, n) at src (row order, n a
 * multiple of 8) into r8 at dst (n * row_bytes bytes, not overlapping src).
 * Each source byte read once and each destination byte written once, two
 * sub-blocks a step with AVX2 (the kernels' tiles read in rows: one pass
 * over what a decode call streams from memory), the next 8 rows prefetched
 * while 8 are transposed, up to pf_rows rows past src's n (the matrix's
 * rows after them); `isa` 0: the best here, 1: SSE2 or portable C (the
 * tests run both). */
void qm__r8_interleave_from(const uint8_t *src, uint32_t n, size_t row_bytes, uint8_t *dst,
                            uint32_t pf_rows, int isa);
/* Rows [n0, n1) of an r8 matrix back in row order at out ((n1 - n0) *
 * row_bytes bytes); n0 a multiple of 8, n1 one or the matrix's end. */
void qm__r8_rows(const uint8_t *w, size_t row_bytes, uint32_t n0, uint32_t n1, uint8_t *out);

#endif
