/* qm_r8.c - see qm_r8.h. */
#include "qm_r8.h"

#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QM__R8_X86 1
#endif

int qm__r8_eligible(const qm_bank_config *cfg, const qm_layer_view *lv, int wt)
{
    const qm_tensor_view *tw = &lv->t[wt], *ts = &lv->t[wt + 1], *tz = &lv->t[wt + 2];
    if (!cfg || (cfg->bits != 4 && cfg->bits != 8) || !tw->present || !ts->present || tz->present ||
        tw->ndim != 3 || ts->ndim != 3)
        return 0;
    uint64_t n = tw->shape[1], row_bytes = tw->shape[2], nblk = ts->shape[2];
    uint64_t k = row_bytes * 8 / cfg->bits;
    return n > 0 && n % 8 == 0 && k % 64 == 0 && cfg->block_size == 32 && nblk == k / 32 &&
           ts->shape[1] == n;
}

/* One sub-block of a group: 16 bytes of each of 8 rows (row r at
 * src + r * row_bytes) to its 128 bytes of r8 at dst, run q holding dword q
 * of rows 0..7. With SSE2 (every x86-64) a 8 x 4 dword transpose in
 * registers; the pager lays out paged units off the call's path with it,
 * so its rate is what a unit's layout costs. */
static void qm__r8_subblock(const uint8_t *src, size_t row_bytes, uint8_t *dst)
{
#if defined(__SSE2__)
    __m128i r[8];
    for (int i = 0; i < 8; i++)
        r[i] = _mm_loadu_si128((const __m128i *)(src + (size_t)i * row_bytes));
    /* pairs of rows: dwords 0-1 (lo) and 2-3 (hi) of rows 2i, 2i+1 */
    __m128i lo[4], hi[4];
    for (int i = 0; i < 4; i++) {
        lo[i] = _mm_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        hi[i] = _mm_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    __m128i *o = (__m128i *)dst;
    _mm_storeu_si128(o + 0, _mm_unpacklo_epi64(lo[0], lo[1])); /* run 0: rows 0-3 */
    _mm_storeu_si128(o + 1, _mm_unpacklo_epi64(lo[2], lo[3])); /*        rows 4-7 */
    _mm_storeu_si128(o + 2, _mm_unpackhi_epi64(lo[0], lo[1])); /* run 1 */
    _mm_storeu_si128(o + 3, _mm_unpackhi_epi64(lo[2], lo[3]));
    _mm_storeu_si128(o + 4, _mm_unpacklo_epi64(hi[0], hi[1])); /* run 2 */
    _mm_storeu_si128(o + 5, _mm_unpacklo_epi64(hi[2], hi[3]));
    _mm_storeu_si128(o + 6, _mm_unpackhi_epi64(hi[0], hi[1])); /* run 3 */
    _mm_storeu_si128(o + 7, _mm_unpackhi_epi64(hi[2], hi[3]));
#else
    for (size_t q = 0; q < 4; q++)
        for (size_t r = 0; r < 8; r++)
            memcpy(dst + 32 * q + 4 * r, src + r * row_bytes + 4 * q, 4);
#endif
}

void qm__r8_interleave(uint8_t *w, uint32_t n, size_t row_bytes, uint8_t *tmp)
{
    /* A group at a time through tmp: 10.5 GB/s in place with SSE2 alone,
     * 12.5 with AVX2's two sub-blocks a step (Zen 3, a 16 MB matrix). */
    size_t gb = 8 * row_bytes;
    for (uint32_t g = 0; g + 8 <= n; g += 8) {
        uint8_t *grp = w + (size_t)g * row_bytes;
        memcpy(tmp, grp, gb);
        qm__r8_interleave_from(tmp, 8, row_bytes, grp, 0, 0);
    }
}

#if QM__R8_X86
/* Two sub-blocks of a group (32 bytes of each of 8 rows) a step: the SSE2
 * transpose in each 128-bit lane, then each run's two halves (rows 0-3 and
 * 4-7, one lane a sub-block) joined into one 32-byte store. */
__attribute__((target("avx2"))) static void
qm__r8_from_avx2(const uint8_t *src, uint32_t n, size_t row_bytes, uint8_t *dst, uint32_t pf_rows)
{
    const size_t npair = row_bytes / 32;
    for (uint32_t g = 0; g + 8 <= n; g += 8) {
        const uint8_t *s = src + (size_t)g * row_bytes;
        uint8_t *d = dst + (size_t)g * row_bytes;
        /* The next 8 rows, one contiguous run in row order, a line per 64
         * bytes read, while these are transposed. */
        const char *pf = g + 16 <= n + pf_rows ? (const char *)s + 8 * row_bytes : NULL;
        for (size_t j = 0; j < npair; j++, s += 32, d += 256) {
            if (pf)
                for (int l = 0; l < 4; l++)
                    _mm_prefetch(pf + 256 * j + 64 * l, _MM_HINT_T0);
            __m256i r[8];
            for (int i = 0; i < 8; i++)
                r[i] = _mm256_loadu_si256((const __m256i *)(s + (size_t)i * row_bytes));
            __m256i lo[4], hi[4];
            for (int i = 0; i < 4; i++) {
                lo[i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
                hi[i] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
            }
            /* run q, rows 0-3 (a) and 4-7 (b), sub-block 2j in lane 0, 2j + 1 in lane 1 */
            __m256i a[4] = {
                _mm256_unpacklo_epi64(lo[0], lo[1]), _mm256_unpackhi_epi64(lo[0], lo[1]),
                _mm256_unpacklo_epi64(hi[0], hi[1]), _mm256_unpackhi_epi64(hi[0], hi[1])};
            __m256i b[4] = {
                _mm256_unpacklo_epi64(lo[2], lo[3]), _mm256_unpackhi_epi64(lo[2], lo[3]),
                _mm256_unpacklo_epi64(hi[2], hi[3]), _mm256_unpackhi_epi64(hi[2], hi[3])};
            for (int q = 0; q < 4; q++) {
                _mm256_storeu_si256((__m256i *)(d + 32 * q),
                                    _mm256_permute2x128_si256(a[q], b[q], 0x20));
                _mm256_storeu_si256((__m256i *)(d + 128 + 32 * q),
                                    _mm256_permute2x128_si256(a[q], b[q], 0x31));
            }
        }
        if (row_bytes / 16 % 2) /* an odd sub-block last */
            qm__r8_subblock(s, row_bytes, d);
    }
}
#endif

void qm__r8_interleave_from(const uint8_t *src, uint32_t n, size_t row_bytes, uint8_t *dst,
                            uint32_t pf_rows, int isa)
{
#if QM__R8_X86
    if (isa == 0 && __builtin_cpu_supports("avx2")) {
        qm__r8_from_avx2(src, n, row_bytes, dst, pf_rows);
        return;
    }
#endif
    (void)isa;
    (void)pf_rows;
    size_t nsb = row_bytes / 16;
    for (uint32_t g = 0; g + 8 <= n; g += 8)
        for (size_t j = 0; j < nsb; j++)
            qm__r8_subblock(src + (size_t)g * row_bytes + 16 * j, row_bytes,
                            dst + (size_t)g * row_bytes + 128 * j);
}

void qm__r8_rows(const uint8_t *w, size_t row_bytes, uint32_t n0, uint32_t n1, uint8_t *out)
{
    size_t nsb = row_bytes / 16;
    for (uint32_t row = n0; row < n1; row++) {
        uint8_t *dst = out + (size_t)(row - n0) * row_bytes;
        for (size_t o = 0; o < 16 * nsb; o += 4)
            memcpy(dst + o, w + qm__r8_offset(row_bytes, row, o), 4);
    }
}
