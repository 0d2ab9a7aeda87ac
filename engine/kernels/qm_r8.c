/* qm_r8.c - see qm_r8.h. */
#include "qm_r8.h"

#include <string.h>

int qm__r8_eligible(const qm_bank_config *cfg, const qm_layer_view *lv, int wt)
{
    const qm_tensor_view *tw = &lv->t[wt], *ts = &lv->t[wt + 1], *tz = &lv->t[wt + 2];
    if (!cfg || cfg->bits != 4 || !tw->present || !ts->present || tz->present ||
        tw->ndim != 3 || ts->ndim != 3)
        return 0;
    uint64_t n = tw->shape[1], row_bytes = tw->shape[2], nblk = ts->shape[2];
    uint64_t k = row_bytes * 2;
    return n > 0 && n % 8 == 0 && k % 64 == 0 && cfg->block_size == 32 && nblk == k / 32 &&
           ts->shape[1] == n;
}

void qm__r8_interleave(uint8_t *w, uint32_t n, size_t row_bytes, uint8_t *tmp)
{
    size_t nsb = row_bytes / 16, gb = 8 * row_bytes;
    for (uint32_t g = 0; g + 8 <= n; g += 8) {
        uint8_t *grp = w + (size_t)g * row_bytes;
        memcpy(tmp, grp, gb);
        for (size_t r = 0; r < 8; r++)
            for (size_t j = 0; j < nsb; j++)
                for (size_t q = 0; q < 4; q++)
                    memcpy(grp + qm__r8_offset(row_bytes, (uint32_t)r, 16 * j + 4 * q),
                           tmp + r * row_bytes + 16 * j + 4 * q, 4);
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
