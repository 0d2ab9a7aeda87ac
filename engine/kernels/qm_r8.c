/* qm_r8.c - see qm_r8.h. */
#include "qm_r8.h"

#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
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
    size_t nsb = row_bytes / 16, gb = 8 * row_bytes;
    for (uint32_t g = 0; g + 8 <= n; g += 8) {
        uint8_t *grp = w + (size_t)g * row_bytes;
        memcpy(tmp, grp, gb);
        for (size_t j = 0; j < nsb; j++)
            qm__r8_subblock(tmp + 16 * j, row_bytes, grp + 128 * j);
    }
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
