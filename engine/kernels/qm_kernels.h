/* qm_kernels.h - quantised matrix kernels of the CPU backend. Private to engine/.
 *
 * One primitive: y[r, n] = sum_c W[n, c] * x[r, c] for a row range of one
 * expert's quantised matrix (../shared/BANK_FORMAT.md storage rules), bias
 * and activation excluded. Each ISA provides a kernel table; the scalar one
 * is the readable specification. Every output element is computed by one
 * call in a fixed order that depends only on the matrix geometry and on
 * whether the GEMV or GEMM path runs (a function of the job's row count;
 * on the folded AVX2 kernel also whether a 4-bit GEMV job has one row),
 * never on the thread count or on which rows share a call: that is what
 * makes outputs bitwise identical across threads, orders and waves. */
#ifndef QM_KERNELS_H
#define QM_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "qm_bank.h"
#include "qm_half.h"

/* One expert's quantised matrix [N, K] as stored in a bank. */
typedef struct qm__qmat {
    const uint8_t *w;     /* N rows of row_bytes */
    size_t row_bytes;     /* >= ceil(K * bits / 8) */
    const void *scales;   /* [N, nblk] in scale_dtype */
    qm_dtype scale_dtype;
    const uint8_t *zp;    /* NULL: implicit 2^(bits-1) */
    int zp_blockwise;     /* 1: [N, zp_row_bytes] packed along blocks; 0: packed along rows */
    size_t zp_row_bytes;
    uint32_t n, k, bits;
    uint32_t nblk;        /* 1 = row-wise */
    uint32_t block;       /* columns per block; k when nblk == 1 */
    int r8;               /* 1: codes in the r8 layout (qm_r8.h); only
                           * kernels qm__i8kernel_r8_native names read it */
    uint32_t r8_rows;     /* with r8 0: rows [0, r8_rows) are in r8 all the
                           * same (a multiple of 16, a paged unit laid out a
                           * piece at a time); qm_cpu_ffn.c hands the kernels
                           * each tile in one layout */
    const int8_t *cb;     /* NULL, or a 4-bit code book's 16 values
                           * (qm_bank.h; no zero points), seen one of two
                           * ways. bits 8: the matrix of 8-bit codes 128 +
                           * cb[q] that qm_cpu_ffn.c decodes a tile at a time
                           * into its scratch (qm__cb_rows) for any kernel,
                           * which is handed that tile (cb NULL). bits 4 (fast
                           * mode, r8 only): a SIMD row's GEMV and its GEMM's
                           * u8 packer look each code up themselves, as
                           * QM__CB_ZP + cb[q] against an implicit zero point
                           * of QM__CB_ZP (qm_kernel_i8_x86.h) */
} qm__qmat;

/* The implicit zero point of a 4-bit code-book view (qm__qmat.cb): codes
 * are looked up to QM__CB_ZP + cb[q], 0..24 for e2m1's values -12..12. */
#define QM__CB_ZP 12

/* Output rows of one kernel task (fixed: the split never depends on threads). */
#define QM__TILE_ROWS 16u
/* Columns of a dequantised W tile in the GEMM path (a multiple of every block size). */
#define QM__GEMM_KT 256u
/* Jobs with more rows than this use the GEMM path. */
#define QM__GEMV_MAX_ROWS 4u
/* Where the x86 kernels' software prefetches of weight codes and scales
 * put a line: L2 (prefetcht2, _MM_HINT_T2 of <xmmintrin.h>; the
 * __builtin_prefetch locality 1), not L1. A decode kernel asks for the
 * next group's codes while it reads this one's; asked into L1 those
 * requests compete with the demand loads for the core's L1 miss buffers,
 * and on a Zen 4 core one thread's 4-bit GEMV from memory read 5.3-6.3
 * GB/s with T0 against 10-11 GB/s with T2 (T1 8.5-11, NTA 6.8-7.9;
 * docs/BENCHMARKS.md, "Zen 4"). The line reaches L1 on its demand load,
 * from L2. */
#define QM__PF_HINT _MM_HINT_T2
#define QM__PF_LOCALITY 1

/* The one signature of every matrix entry, exact or fast: rows [n0, n1) of
 * W times nx prepared input rows (xp, ldx floats apart) into
 * y[r * ldy + n], with the kernel's scratch. Entries are declared with it
 * (`qm__mm_fn name;`) and defined with the parameters written out. */
typedef void qm__mm_fn(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp, size_t ldx,
                       uint32_t nx, float *y, size_t ldy, float *scratch);

typedef struct qm__kernel {
    const char *name; /* "scalar", "avx2", "avx2-folded", "avx512" */
    const char *needs;   /* the CPU features it runs on (qm_kernel_isa.h); NULL: none */
    const char *aliases; /* other QMOE_KERNEL names that force exactly it, or NULL */
    int variant;         /* 1: never measured; taken as another kernel's `alone`, or forced */
    /* The kernel whose 4-bit GEMV of one input row this one's choice takes
     * when it is the only candidate (avx2: avx2-folded), or NULL. */
    const struct qm__kernel *alone;
    /* Floats per prepared input row for matrix m (GEMV or GEMM path). */
    size_t (*x_stride)(const qm__qmat *m, int gemm);
    /* Prepares one natural-order input row x[0..k) into xp[0..x_stride). */
    void (*prep)(const qm__qmat *m, int gemm, const float *x, float *xp);
    /* Rows [n0, n1) of W times nx prepared rows; y[r * ldy + n]. */
    qm__mm_fn *gemv;
    /* Same for many rows; xp has room for nx rounded up to gemm_row_pad (zero rows). */
    qm__mm_fn *gemm;
    uint32_t gemm_row_pad;
} qm__kernel;

/* A fast-mode kernel (int8 activations, integer dot products). Input rows
 * are quantised by qm__i8_prep, shared by every kernel, so the int8
 * activations are the same bits whatever kernel runs; one entry serves
 * every row count: rows [n0, n1) of W times nx quantised rows. Every fast
 * kernel gives the same bits for every row count (qm_kernel_i8.h). */
typedef struct qm__i8kernel {
    const char *name; /* its QMOE_KERNEL name: "scalar", or a fast table row's (qm_kernel_isa.c) */
    qm__mm_fn *mm;
} qm__i8kernel;

extern const qm__i8kernel qm__i8kernel_scalar;
/* 1 when k's mm runs r8 matrices (qm_r8.h) of `bits` (4 or 8) on nx inputs
 * itself: a row of the fast table that reads them (qm_kernel_isa.h: 4- and
 * 8-bit, every SIMD row today), its decode GEMV and its GEMM's packer,
 * forced or the one auto runs for nx inputs of that width on this CPU.
 * The scalar kernel and the exact ones are handed row-major tiles
 * (qm_cpu_ffn.c). */
int qm__i8kernel_r8_native(const qm__i8kernel *k, uint32_t nx, uint32_t bits);
/* The fast-mode kernel for this CPU: among the rows of the fast table this
 * CPU runs and the self-check verified (qm_kernel_check.h), measured per
 * class (decode, prefill; 4/8-bit) once per process like the exact one;
 * QMOE_KERNEL=scalar or a row's name or alias forces one (one this CPU
 * cannot run, or the check refused, falls back to the choice). */
const qm__i8kernel *qm__i8kernel_select(void);
const char *qm__i8kernel_describe(const qm__i8kernel *k);
/* Calibration, for tests: the timer of one fast kernel on nx inputs (best
 * microseconds, <= 0: could not run; NULL restores thread CPU timing), and
 * the default choice measured again (not thread-safe) and described. */
typedef double (*qm__i8kernel_timer)(const qm__i8kernel *k, const qm__qmat *m, uint32_t nx,
                                     const float *x);
void qm__i8kernel_set_timer(qm__i8kernel_timer fn);
const char *qm__i8kernel_recalibrate(void);

/* ---- Fast mode: int8 activations (../docs/ARCHITECTURE.md "fast mode") ----
 * Each input row is cut into sub-blocks of 32 columns (zeros past k); a
 * sub-block with amax = max |x| stores dx = amax / 127 and the codes
 * q = rint(x * 127 / amax) in [-127, 127] (all zero when amax is 0); nsb,
 * the number of sub-blocks, is k rounded up to 64 columns (even). The
 * prepared row's layout is qm_kernel_i8.h's. Output:
 *   y[n] = sum_b scale[n,b] * sum_{j in b} dx_j * S_j,
 *   S_j  = sum_{c in j} (q_w[n,c] - zp[n,b]) * q_x[c]   (an exact integer),
 * in the one floating-point order qm_kernel_i8.h gives. Weight blocks must
 * be whole sub-blocks: row-wise, or block % 32 == 0 (qm__i8_ok). */
static inline int qm__i8_ok(const qm__qmat *m)
{
    return m->nblk == 1 || m->block % 32 == 0;
}
size_t qm__i8_x_stride(const qm__qmat *m);
/* Quantises one row x[0..k) into xq[0..qm__i8_x_stride); the C version is
 * the specification, the AVX2 one (used where the CPU has it) its bytes. */
void qm__i8_prep(const qm__qmat *m, const float *x, float *xq);
void qm__i8_prep_c(const qm__qmat *m, const float *x, float *xq);
/* Sub-blocks of 32 per weight block. */
static inline uint32_t qm__i8_spb(const qm__qmat *m)
{
    return m->nblk == 1 ? (uint32_t)((m->k + 31) / 32) : m->block / 32;
}
/* Sub-blocks in a prepared row (even). */
static inline size_t qm__i8_nsb(const qm__qmat *m)
{
    return ((size_t)m->k + 63) / 64 * 2;
}

/* The 4-bit GEMV's canonical order, followed bit for bit by the scalar,
 * AVX2 and AVX-512 kernels (qm_kernel_scalar.c specifies it) wherever
 * blocks are whole 32-column chunks: row-wise or block % 32 == 0. The SIMD
 * kernels' prepared input stores every 32 columns as [16 even, 16 odd]
 * (qm__avx2_prep). 4-bit blocks of 16 run the AVX2 GEMV's own order on
 * both ISAs (the scalar kernel: its column order). */
static inline int qm__q4_canon(const qm__qmat *m, int gemm)
{
    return !gemm && m->bits == 4 && (m->nblk == 1 || m->block % 32 == 0);
}

/* Per-worker scratch floats a kernel may use for matrix m. */
size_t qm__kernel_scratch_floats(const qm__qmat *m);
/* Floats of scratch that hold one tile of an r8 matrix's rows back in row
 * order (QM__TILE_ROWS rows), a multiple of 16; counted by
 * qm__kernel_scratch_floats when m->r8. */
size_t qm__r8_tile_floats(const qm__qmat *m);
/* Code books (qm__qmat.cb): floats of scratch that hold one tile
 * (QM__TILE_ROWS rows) of the 8-bit codes, a multiple of 16; counted by
 * qm__kernel_scratch_floats when m->cb. */
size_t qm__cb_tile_floats(const qm__qmat *m);
/* Rows [n0, n1) of code-book matrix m (rows or r8: n0 a multiple of 8
 * then) as 8-bit codes 128 + cb[q], k bytes a row, at out (SSSE3 where the
 * CPU has it: the same bytes). */
void qm__cb_rows(const qm__qmat *m, uint32_t n0, uint32_t n1, uint8_t *out);
void qm__cb_rows_c(const qm__qmat *m, uint32_t n0, uint32_t n1, uint8_t *out);

extern const qm__kernel qm__kernel_scalar;
#if defined(QMOE_X86_KERNELS)
extern const qm__kernel qm__kernel_avx2;
extern const qm__kernel qm__kernel_avx512;
/* The AVX2 kernel with the 4-bit GEMV of one input row in the AVX2
 * (folded) order wherever qm__q4_canon applies too (2-4 rows: canonical):
 * the 4-bit GEMV of CPUs without AVX-512. */
extern const qm__kernel qm__kernel_avx2_folded;
/* Entry points the AVX-512 table borrows from the AVX2 file. */
size_t qm__avx2_x_stride(const qm__qmat *m, int gemm);
void qm__avx2_prep(const qm__qmat *m, int gemm, const float *x, float *xp);
qm__mm_fn qm__avx2_gemv, qm__avx2_gemm;
/* The AVX-512 table's GEMM (qm_gemm_packed_avx512.c): the AVX2 GEMM's bits. */
qm__mm_fn qm__avx512_gemm_packed;
#endif

/* The kernel for this CPU, measured per shape class once per process (the
 * candidate SIMD kernels of a class give the same bits; qm_kernel_select.c);
 * QMOE_KERNEL=scalar|avx2|avx512 forces one (avx2: the AVX2 kernel this
 * CPU's choice uses; =avx2-canonical|avx2-folded picks its 4-bit GEMV's
 * order; an unavailable one falls back to the default), =table|measure
 * picks the mode. */
const qm__kernel *qm__kernel_select(void);
/* Calibration, for tests: the timer of one kernel on one class (best
 * microseconds, <= 0: could not run); NULL restores thread CPU timing. */
typedef double (*qm__kernel_timer)(const qm__kernel *k, const qm__qmat *m, int gemm,
                                   const float *x);
void qm__kernel_set_timer(qm__kernel_timer fn);
/* The best of `reps` sweeps of `fn` (a kernel's gemv, gemm or fast-mode
 * mm) over every row tile of m, in thread CPU microseconds; one more sweep
 * first warms the caches. The calibration's timer, and the kernel
 * microbenchmark's (bench/qmoe_cpu/qmoe_kernel_micro.c). */
double qm__kernel_best_sweep(qm__mm_fn *fn, const qm__qmat *m, const float *xp, size_t ld,
                             uint32_t nx, float *y, float *scratch, int reps);
/* Index of the kernel to take among nc timings, widest kernel first: a
 * later (narrower) one only when more than 10% faster. */
int qm__kernel_pick(const double *us, int nc);
/* Measures the default choice again (not thread-safe: tests) and describes it. */
const char *qm__kernel_recalibrate(void);
/* Tests: 1 makes this CPU look without AVX-512 (F/BW/VL, so VNNI too) to
 * the kernel choice from then on (recalibrate to apply it), 0 undoes it. */
void qm__kernel_hide_avx512(int hide);
/* The cached choice [gemv q4, gemv q8, gemm q4, gemm q8] for these
 * candidates (widest first): 0, or -1 (missing, or invalid: a stderr line). */
int qm__kernel_cache_load(const char *path, const qm__kernel *const *cands, int nc,
                          const qm__kernel *out[4]);
/* The cache file's line of one mode (tag "qmoe-kernels" or
 * "qmoe-fast-kernels", qm_kernel_cache.c): the chosen candidate of each of
 * its 4 classes as indices into cands (names, widest first); load answers
 * 0, or -1 (missing or invalid: a stderr line unless the file holds only
 * the other mode's line). Save keeps the other mode's line. */
int qm__cache_load(const char *path, const char *tag, const char *const *cands, int nc,
                   int out[4]);
void qm__cache_save(const char *path, const char *tag, const char *const *cands, int nc,
                    const int ch[4]);
/* Any line of the cache (tags "qmoe-kernel-check", "qmoe-kernels",
 * "qmoe-fast-kernels"): its payload for this binary and CPU into out[cap],
 * 0; or -1 (missing, or not whole, or another version, binary or CPU's: a
 * stderr line). Put writes it, keeping the other tags' whole lines. */
int qm__cache_get(const char *path, const char *tag, char *out, size_t cap);
void qm__cache_put(const char *path, const char *tag, const char *payload);
/* What runs: the kernel's name, or the measured choice of each class. */
const char *qm__kernel_describe(const qm__kernel *k);
#if defined(QMOE_X86_KERNELS)
/* The AVX-512 VNNI kernel's entry, which the AMX kernel runs below its
 * input count (qm_kernel_i8_amx.c). */
qm__mm_fn qm__i8mm_avx512vnni;
/* AMX-INT8 usable: the CPU flags, the OS's tile state, and this process's
 * permission for it, asked once (arch_prctl ARCH_REQ_XCOMP_PERM); where not,
 * why (qm__amx_why_not: "no AMX-INT8 on this CPU", "tile permission
 * refused: ..."; NULL when usable). */
int qm__cpu_has_amx(void);
const char *qm__amx_why_not(void);
/* Tests: fake_cpu 1 makes the CPU look like it has AMX-INT8 and ask the
 * permission through perm (0: granted, else refused) instead of the
 * kernel; the answer is asked again at the next qm__cpu_has_amx. (0, NULL)
 * undoes it. */
void qm__kernel_amx_hook(int fake_cpu, int (*perm)(void));
/* Tests: the AVX2 vector packers and row parameters (those of qm_kernel_i8.h). */
void qm__i8_pack_avx2(const qm__qmat *m, uint32_t n0, uint32_t nr, size_t j0, size_t j1, int s16,
                      uint8_t *pan);
void qm__i8_params_avx2(const qm__qmat *m, uint32_t n0, uint32_t nr, float *sct, int32_t *zpt);
void qm__i8_prep_avx2(const qm__qmat *m, const float *x, float *xq);
#endif

/* ---- Shared helpers ---- */

static inline float qm__load_float(const void *base, qm_dtype dt, size_t i)
{
    if (dt == QM_DTYPE_F32) {
        float f;
        memcpy(&f, (const uint8_t *)base + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, (const uint8_t *)base + 2 * i, 2);
    if (dt == QM_DTYPE_BF16) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return qm_f16_to_f32(h);
}

static inline float qm__qmat_scale(const qm__qmat *m, uint32_t n, uint32_t b)
{
    return qm__load_float(m->scales, m->scale_dtype, (size_t)n * m->nblk + b);
}

#if defined(__F16C__)
#include <immintrin.h>
/* qm__qmat_scale for files compiled with F16C: f32 a plain load, f16 one
 * vcvtph2ps. */
static inline __attribute__((always_inline)) float qm__qmat_scale_f16c(const qm__qmat *m,
                                                                        uint32_t n, uint32_t b)
{
    size_t i = (size_t)n * m->nblk + b;
    if (__builtin_expect(m->scale_dtype == QM_DTYPE_F32, 1)) {
        float f;
        memcpy(&f, (const uint8_t *)m->scales + 4 * i, 4);
        return f;
    }
    if (m->scale_dtype == QM_DTYPE_F16) {
        uint16_t h;
        memcpy(&h, (const uint8_t *)m->scales + 2 * i, 2);
        return _cvtsh_ss(h);
    }
    return qm__load_float(m->scales, m->scale_dtype, i);
}
#endif

/* Zero point of (row n, block b) as an integer code. */
static inline int qm__qmat_zp(const qm__qmat *m, uint32_t n, uint32_t b)
{
    if (!m->zp)
        return m->cb && m->bits == 4 ? QM__CB_ZP : 1 << (m->bits - 1);
    uint32_t pack = 8 / m->bits, mask = (1u << m->bits) - 1;
    uint8_t byte;
    uint32_t idx;
    if (m->zp_blockwise) {
        byte = m->zp[(size_t)n * m->zp_row_bytes + b / pack];
        idx = b % pack;
    } else {
        byte = m->zp[n / pack];
        idx = n % pack;
    }
    return (int)((byte >> (idx * m->bits)) & mask);
}

static inline int qm__qmat_code(const qm__qmat *m, const uint8_t *row, uint32_t c)
{
    uint32_t pack = 8 / m->bits, mask = (1u << m->bits) - 1;
    return (int)((row[c / pack] >> ((c % pack) * m->bits)) & mask);
}

#endif
