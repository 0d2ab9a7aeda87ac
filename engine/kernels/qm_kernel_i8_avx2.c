/* qm_kernel_i8_avx2.c - fast-mode kernel on AVX2 (compiled with -mavx2
 * -mfma -mf16c): vpmaddubsw (u8 x s8 -> s16 pairs) then vpmaddwd (-> s32).
 *
 * Decode (fewer than QM__I8_AVX2_GEMM_MIN inputs, 8-bit: _MIN8): the GEMV of
 * qm_kernel_i8_x86.h, 8 rows at a time. 4-bit codes (<= 15) times |x| <=
 * 127 make a vpmaddubsw pair of at most 3810, no saturation; 8-bit codes
 * would saturate it (255 * 127 * 2), so in the row layout they are widened
 * to 16 bits and multiplied with vpmaddwd, and in the r8 layout taken as
 * |c - 128| against x with c - 128's sign (pairs of at most 32512:
 * qm__v_r8q8_group), the zero point's share added back before the same
 * epilogue.
 * Prefill: the GEMM of qm_kernel_i8_gemm.h on 8 rows per vector. 4-bit:
 * the u8 panel, a sub-block's 8 vpmaddubsw steps summed in s16 (at most
 * 8 * 3810 = 30480) and widened once by vpmaddwd. 8-bit: the s16 panel of
 * q - zp against the s16 codes, vpmaddwd into s32.
 * Both give qm_kernel_i8.h's exact sums, hence every fast kernel's bits. */
#include "qm_kernel_i8_x86.h"
#include "qm_kernel_isa.h"

/* Inputs from which a call runs the GEMM, 4-bit and 8-bit: where
 * bench/qmoe_cpu/qmoe_kernel_micro --inputs N (kernels avx2-gemv and
 * avx2-gemm, 256 x 2048, one thread) puts them level on a Zen 3 core since
 * the 4-bit GEMV takes its inputs two at a time (2026-12-02: 4-bit GEMV
 * 56/70/81/93 us at 4/5/6/7 inputs against the GEMM's 75/82/89/94; 8-bit
 * 139/170-203/222 at 4/6/8 against 172/133/222, the GEMM 1.7-2.0x faster
 * from 12). */
#define QM__I8_AVX2_GEMM_MIN 7u
#define QM__I8_AVX2_GEMM_MIN8 6u

static inline __m256i qm__avx2_dot4(__m256i lo, __m256i hi, __m256i xl, __m256i xh)
{
    __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

static inline __m256i qm__avx2_dot8(const uint8_t *w, const int8_t *x, const int16_t *x16)
{
    (void)x;
    __m256i wa = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)w));
    __m256i wb = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + 16)));
    return _mm256_add_epi32(_mm256_madd_epi16(wa, _mm256_loadu_si256((const __m256i *)x16)),
                            _mm256_madd_epi16(wb, _mm256_loadu_si256((const __m256i *)(x16 + 16))));
}

#define QM__V_FN qm__i8avx2_gemv
#define QM__V_R8 1    /* reads r8 matrices (qm_r8.h) */
#define QM__V_R8_Q8 1 /* 8-bit ones too */
#define QM__V_DOT4(lo, hi, xl, xh) qm__avx2_dot4(lo, hi, xl, xh)
#define QM__V_DOT8(w, x, x16) qm__avx2_dot8(w, x, x16)
#include "qm_kernel_i8_x86.h"

#include "qm_kernel_i8_g256.h"
#define QM__G_NR 4

/* A0 += maddubs(W0, b), then A1 += maddubs(W1, b), in s16 lanes, each
 * sum written back to its accumulator's own register. Written with
 * intrinsics, GCC 12 puts each sum in a new register and moves it back,
 * and keeps one or two of the eight accumulators in memory; the integer
 * sums, hence the bits, are the same either way. */
#define QM__SB_STEP(A0, A1, W0, W1, BV)                                                           \
    do {                                                                                           \
        __m256i b_ = (BV), t_;                                                                     \
        __asm__("vpmaddubsw %[b], %[w0], %[t]\n\t"                                               \
                "vpaddw %[t], %[a0], %[a0]\n\t"                                                   \
                "vpmaddubsw %[b], %[w1], %[t]\n\t"                                               \
                "vpaddw %[t], %[a1], %[a1]"                                                        \
                : [a0] "+x"(A0), [a1] "+x"(A1), [t] "=&x"(t_)                                      \
                : [w0] "x"(W0), [w1] "x"(W1), [b] "x"(b_));                                         \
    } while (0)

/* 4-bit, a full pass of 4 inputs (QM__G_NR) over one sub-block: the
 * template's loop (qm_kernel_i8_gemm.h, QM__G_SB) on 8 named accumulators
 * with the steps above: 5-8% off the fast prefill of the GPT-OSS-like and
 * Qwen3-like layers at T = 128 and 512 (docs/BENCHMARKS.md). */
static inline __attribute__((always_inline)) void qm__avx2_sb4(const uint8_t *w,
                                                                const uint8_t *const *xb,
                                                                size_t off, __m256i a[2][4])
{
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a02 = a00, a03 = a00;
    __m256i a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    const uint8_t *x0 = xb[0] + off, *x1 = xb[1] + off, *x2 = xb[2] + off, *x3 = xb[3] + off;
#pragma GCC unroll 1
    for (int g = 0; g < 8; g++, w += 64) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)w);
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
        QM__SB_STEP(a00, a10, w0, w1, qm__g256_bcast4(x0 + 4 * g));
        QM__SB_STEP(a01, a11, w0, w1, qm__g256_bcast4(x1 + 4 * g));
        QM__SB_STEP(a02, a12, w0, w1, qm__g256_bcast4(x2 + 4 * g));
        QM__SB_STEP(a03, a13, w0, w1, qm__g256_bcast4(x3 + 4 * g));
    }
    a[0][0] = a00, a[0][1] = a01, a[0][2] = a02, a[0][3] = a03;
    a[1][0] = a10, a[1][1] = a11, a[1][2] = a12, a[1][3] = a13;
}

/* 4-bit: u8 panel, s16 sums per sub-block. */
#define QM__G_SB(w, xb, off, a) qm__avx2_sb4(w, xb, off, a)
#define QM__G_FN qm__i8avx2_gemm_q4
#define QM__G_MICRO qm__i8avx2_micro_q4
#define QM__G_G 8
#define QM__G_S16 0
#define QM__G_STEP(a, w, x4) _mm256_add_epi16(a, _mm256_maddubs_epi16(w, qm__g256_bcast4(x4)))
#define QM__G_FIN(a) _mm256_madd_epi16(a, _mm256_set1_epi16(1))
#define QM__G_PACK(m, n0, nr, j0, j1, pan) qm__x_pack_u8(m, n0, nr, j0, j1, pan)
static qm__mm_fn qm__i8avx2_gemm_q4;
#include "qm_kernel_i8_gemm.h"
#undef QM__G_FN
#undef QM__G_MICRO
#undef QM__G_G
#undef QM__G_S16
#undef QM__G_STEP
#undef QM__G_FIN
#undef QM__G_PACK
#undef QM__G_SB

/* A 4-bit code book (qm__qmat.cb): the u8 panel of its codes looked up to
 * 12 + cb[q] (0..24), whose vpmaddubsw pairs (at most 2 x 24 x 127) would
 * wrap in 8 steps of s16 sums: each step's widened at once (vpmaddwd). */
#define QM__G_FN qm__i8avx2_gemm_q4cb
#define QM__G_MICRO qm__i8avx2_micro_q4cb
#define QM__G_G 8
#define QM__G_S16 0
#define QM__G_STEP(a, w, x4)                                                                       \
    _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(w, qm__g256_bcast4(x4)),             \
                                          _mm256_set1_epi16(1)))
#define QM__G_FIN(a) (a)
#define QM__G_PACK(m, n0, nr, j0, j1, pan) qm__x_pack_u8(m, n0, nr, j0, j1, pan)
static qm__mm_fn qm__i8avx2_gemm_q4cb;
#include "qm_kernel_i8_gemm.h"
#undef QM__G_FN
#undef QM__G_MICRO
#undef QM__G_G
#undef QM__G_S16
#undef QM__G_STEP
#undef QM__G_FIN
#undef QM__G_PACK

/* 8-bit: s16 panel of q - zp, vpmaddwd into s32. */
#define QM__G_FN qm__i8avx2_gemm_q8
#define QM__G_MICRO qm__i8avx2_micro_q8
#define QM__G_G 16
#define QM__G_S16 1
#define QM__G_STEP(a, w, x4) _mm256_add_epi32(a, _mm256_madd_epi16(w, qm__g256_bcast4(x4)))
#define QM__G_FIN(a) (a)
#define QM__G_PACK(m, n0, nr, j0, j1, pan) qm__x_pack_s16(m, n0, nr, j0, j1, pan)
static qm__mm_fn qm__i8avx2_gemm_q8;
#include "qm_kernel_i8_gemm.h"

/* The GEMM path at any input count: the 4-bit or the 8-bit one. */
static void qm__i8avx2_gemm(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                            size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    (m->bits == 8 ? qm__i8avx2_gemm_q8 : m->cb ? qm__i8avx2_gemm_q4cb : qm__i8avx2_gemm_q4)(
        m, n0, n1, xq, ldx, nx, y, ldy, scratch);
}

static void qm__i8mm_avx2(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xq,
                          size_t ldx, uint32_t nx, float *y, size_t ldy, float *scratch)
{
    qm__i8_split(m->bits == 4 ? QM__I8_AVX2_GEMM_MIN : QM__I8_AVX2_GEMM_MIN8, qm__i8avx2_gemv,
                 qm__i8avx2_gemm, m, n0, n1, xq, ldx, nx, y, ldy, scratch);
}

/* Its row of the fast table (qm_kernel_isa.c). AVX2 is the x86 baseline
 * the tests run the other rows' models on: it has no model of its own. */
const qm__i8isa qm__i8isa_avx2 = {
    .kernel = {.name = "avx2", .mm = qm__i8mm_avx2},
    .aliases = "avx2-canonical avx2-folded", /* the exact mode's AVX2 names */
    .needs = "avx2 fma f16c",
    .gemv = qm__i8avx2_gemv,
    .gemm = qm__i8avx2_gemm,
    .reads_r8 = 1,
    .reads_r8_q8 = 1,
};

/* The vector packers, for tests/engine (byte for byte those of qm_kernel_i8.h). */
void qm__i8_pack_avx2(const qm__qmat *m, uint32_t n0, uint32_t nr, size_t j0, size_t j1,
                      int s16, uint8_t *pan)
{
    if (s16)
        qm__x_pack_s16(m, n0, nr, j0, j1, pan);
    else
        qm__x_pack_u8(m, n0, nr, j0, j1, pan);
}

void qm__i8_params_avx2(const qm__qmat *m, uint32_t n0, uint32_t nr, float *sct, int32_t *zpt)
{
    qm__x_params(m, n0, nr, sct, zpt);
}

/* qm__i8_prep_c on vectors, byte for byte: the same max, the same 127 / amax
 * and product, vcvtps2dq rounding to nearest even as lrintf does, the same
 * clamp; 4-bit rows then put each sub-block's even columns before its odd. */
void qm__i8_prep_avx2(const qm__qmat *m, const float *x, float *xq)
{
    size_t nsb = qm__i8_nsb(m);
    const qm__i8_xout o = qm__i8_xout_at(m, xq);
    int8_t *q = o.q;
    int16_t *q16 = o.q16;
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    /* Within each 128-bit lane: even bytes, then odd bytes. */
    const __m256i eo = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2,
                                        4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (size_t j = 0; j < nsb; j++) {
        float tmp[32];
        const float *p = x + 32 * j;
        if (32 * j + 32 > m->k) {
            memset(tmp, 0, sizeof tmp);
            if (32 * j < m->k)
                memcpy(tmp, p, sizeof(float) * (m->k - 32 * j));
            p = tmp;
        }
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(p + 8 * i);
            /* max_ps answers its second operand when either is NaN: a NaN
             * input leaves the maximum alone, as the C comparison does. */
            mx = _mm256_max_ps(_mm256_and_ps(v[i], absm), mx);
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        float amax = _mm_cvtss_f32(h);
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256 idv = _mm256_set1_ps(id);
        __m256i c[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));
            c[i] = _mm256_max_epi32(_mm256_min_epi32(c[i], lim), nlim);
            sum = _mm256_add_epi32(sum, c[i]);
        }
        /* 32 int32 -> 32 int8 in column order (packs work per 128-bit lane). */
        __m256i w01 = _mm256_packs_epi32(c[0], c[1]), w23 = _mm256_packs_epi32(c[2], c[3]);
        __m256i b = _mm256_packs_epi16(w01, w23);
        b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        if (q16) {
            _mm256_storeu_si256((__m256i *)(q16 + 32 * j),
                                _mm256_cvtepi8_epi16(_mm256_castsi256_si128(b)));
            _mm256_storeu_si256((__m256i *)(q16 + 32 * j + 16),
                                _mm256_cvtepi8_epi16(_mm256_extracti128_si256(b, 1)));
        } else {
            b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, eo), 0xD8);
        }
        _mm256_storeu_si256((__m256i *)(q + 32 * j), b);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        qm__i8_xout_sums(&o, m, j, amax, _mm_cvtsi128_si32(s4));
    }
}
