/* import_hf_layer.c - `import hf`: one layer's experts from the mapped source
 * (float, FP8 block-scaled, GPT-OSS input-major or MXFP4) into bank tensors. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "import_hf_impl.h"
#include "qm_alloc.h"
#include "qm_quant.h"
#include "tool_input.h"

/* ---- converting one layer ------------------------------------------------ */

static int not_finite(qm__hf_import *im, const qm__hf_tensor *t, qm_status *st);

/* The quantiser's refusal of a row of t, as a sentence. */
static int refused_row(qm__hf_import *im, const qm__hf_tensor *t, int rc, qm_status *st)
{
    if (rc == QM_EUNSUPPORTED)
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "%.80s: tensor %.120s has a block whose scale is beyond %s's range "
                             "(rerun with --scales f32)",
                             qm__hf_shard_name(im->ck, t->shard), t->name,
                             qm_dtype_name(im->o.scale_dtype));
    return not_finite(im, t, st);
}

static int not_finite(qm__hf_import *im, const qm__hf_tensor *t, qm_status *st)
{
    return qm_status_set(st, QM_EINVALID_MODEL, "%.80s: tensor %.120s holds a NaN or infinity",
                         qm__hf_shard_name(im->ck, t->shard), t->name);
}

/* Row r of a per-expert source matrix [N, K] as f32 (FP8 times its block scale). */
static void load_row(qm__hf_import *im, const qm__hf_tensor *w, const qm__hf_tensor *sinv,
                     uint64_t r, uint64_t K, float *dst)
{
    qm__elem_load_row(w->data + r * K * qm__elem_size(w->elem), w->elem, K, dst);
    if (sinv) {
        uint64_t nbk = sinv->shape[1];
        for (uint64_t c = 0; c < K; c++)
            dst[c] *=
                qm__elem_load(sinv->data, sinv->elem, (r / im->fp8_bn) * nbk + c / im->fp8_bk);
    }
}

static void mxfp4_row(const uint8_t *blocks, const uint8_t *scales, uint64_t K, float *dst)
{
    for (uint64_t c = 0; c < K; c++) {
        uint8_t byte = blocks[c / 2];
        int q = c % 2 ? byte >> 4 : byte & 15;
        dst[c] = ldexpf((float)qm__fp4_half[q], (int)scales[c / 32] - 128);
    }
}

/* The exact paths, scale 2^(e-128) in sdt: int8 code = 128 + 2·fp4, or
 * (e2m1 code book) the nibbles as they are, already low nibble = even
 * column. 0, or -1 when a value is infinite (a block exponent near 255). */
static int mxfp4_row_exact(const uint8_t *blocks, const uint8_t *scales, uint64_t K, qm_codebook cb,
                           uint8_t *packed, void *scale_out, uint64_t scale_at, qm_dtype sdt,
                           qm_quant_error *err)
{
    int finite = 1;
    if (cb == QM_CODEBOOK_E2M1) memcpy(packed, blocks, (size_t)(K / 2));
    for (uint64_t c = 0; c < K; c++) {
        uint8_t byte = blocks[c / 2];
        int q = c % 2 ? byte >> 4 : byte & 15;
        if (cb == QM_CODEBOOK_NONE) packed[c] = (uint8_t)(128 + qm__fp4_half[q]);
        float src = ldexpf((float)qm__fp4_half[q], (int)scales[c / 32] - 128);
        float scale = qm__e8m0_half_scale(scales[c / 32]);
        float deq = scale * (float)qm__fp4_half[q];
        double d = (double)deq - (double)src;
        err->diff2 += d * d;
        err->ref2 += (double)src * (double)src;
        err->exact &= deq == src;
        finite &= src <= FLT_MAX && src >= -FLT_MAX;
    }
    for (uint64_t b = 0; b < K / 32; b++) /* exact in sdt: choose_scales checked */
        qm_quant_store(scale_out, sdt, scale_at + b, qm__e8m0_half_scale(scales[b]));
    return finite ? 0 : -1;
}

int qm__hf_convert_layer(qm__hf_import *im, qm_bank_writer *w, uint32_t li, qm__hf_buffers *b,
                         double *max_err, qm_status *st)
{
    uint32_t E = im->E, H = im->H, I = im->I, bits = im->o.bits;
    uint64_t bs = im->o.block_size, pack = 8 / bits;
    uint64_t nblk_h = bs ? (H + bs - 1) / bs : 1, nblk_i = bs ? (I + bs - 1) / bs : 1;
    const qm_quant_spec q = {.bits = bits, .block_size = bs, .scale_dtype = im->o.scale_dtype};
    int qrc;
    uint64_t fc1_w = qm_bank_writer_slice_bytes(w, li, QM_T_FC1_WEIGHT);
    uint64_t fc1_s = qm_bank_writer_slice_bytes(w, li, QM_T_FC1_SCALES);
    uint64_t fc2_w = qm_bank_writer_slice_bytes(w, li, QM_T_FC2_WEIGHT);
    uint64_t fc2_s = qm_bank_writer_slice_bytes(w, li, QM_T_FC2_SCALES);
    int rc;
    /* Router (+ bias, correction bias) as f32. */
    const qm__hf_tensor *rt[3] = {im->router_w[li], im->router_b[li], im->corr[li]};
    const int rdst[3] = {QM_T_ROUTER_WEIGHT, QM_T_ROUTER_BIAS, QM_T_ROUTER_CORRECTION_BIAS};
    for (int i = 0; i < 3; i++) {
        if (!rt[i]) continue;
        uint64_t n = rt[i]->nbytes / qm__elem_size(rt[i]->elem);
        for (uint64_t off = 0; off < n; off += H) {
            uint64_t m = n - off < H ? n - off : H;
            qm__elem_load_row(rt[i]->data + off * qm__elem_size(rt[i]->elem), rt[i]->elem, m,
                              b->row);
            if (!qm_quant_finite(b->row, m)) return not_finite(im, rt[i], st);
            if ((rc = qm_bank_writer_put(w, li, rdst[i], off * 4, b->row, m * 4, st)) != 0)
                return rc;
        }
    }
    const qm__hf_tensor **lsrc =
        im->layer_src ? &im->layer_src[(size_t)li * QM__HF_FUSED_COUNT] : NULL;
    if (lsrc) {
        for (int g = 0; g < QM__HF_FUSED_COUNT; g++)
            if (lsrc[g]) qm__hf_prefetch(im->ck, lsrc[g]);
    }
    for (uint32_t e = 0; e < E; e++) {
        if (qm__interrupted())
            return qm_status_set(st, QM_ESHUTTING_DOWN, "interrupted by signal %d",
                                 qm__interrupted());
        qm_quant_error err_gate = QM_QUANT_ERROR_INIT, err_up = QM_QUANT_ERROR_INIT,
                       err_down = QM_QUANT_ERROR_INIT;
        if (!lsrc) {
            const qm__hf_tensor **src = &im->expert_src[((size_t)li * E + e) * QM__HF_PER_EXPERT];
            if (e + 1 < E)
                for (int p = 0; p < QM__HF_PER_EXPERT; p++)
                    if (src[QM__HF_PER_EXPERT + p])
                        qm__hf_prefetch(im->ck, src[QM__HF_PER_EXPERT + p]);
            /* fc1 rows interleave gate and up (swiglu_fusion 1). */
            for (uint64_t r = 0; r < 2ull * I; r++) {
                int up = (int)(r & 1);
                const qm__hf_tensor *t = src[up ? QM__HF_UP : QM__HF_GATE];
                load_row(im, t, src[up ? QM__HF_UP_SINV : QM__HF_GATE_SINV], r / 2, H, b->row);
                if ((qrc = qm_quant_row(&q, b->row, H, b->packed[0] + r * (H / pack), b->scales[0],
                                        r * nblk_h, NULL, up ? &err_up : &err_gate)) != 0)
                    return refused_row(im, t, qrc, st);
            }
            for (uint64_t r = 0; r < H; r++) {
                load_row(im, src[QM__HF_DOWN], src[QM__HF_DOWN_SINV], r, I, b->row);
                if ((qrc = qm_quant_row(&q, b->row, I, b->packed[1] + r * (I / pack), b->scales[1],
                                        r * nblk_i, NULL, &err_down)) != 0)
                    return refused_row(im, src[QM__HF_DOWN], qrc, st);
            }
        } else if (im->mxfp4) {
            const qm__hf_tensor *gb = lsrc[QM__HF_FUSED_GATE_UP],
                                *gs = lsrc[QM__HF_FUSED_GATE_UP_SCALES];
            const qm__hf_tensor *db = lsrc[QM__HF_FUSED_DOWN], *ds = lsrc[QM__HF_FUSED_DOWN_SCALES];
            for (int p = 0; p < 2; p++) {
                const qm__hf_tensor *bt = p ? db : gb, *stt = p ? ds : gs;
                uint64_t N = p ? H : 2ull * I, K = p ? I : H, nb = p ? nblk_i : nblk_h;
                for (uint64_t r = 0; r < N; r++) {
                    const uint8_t *blk = bt->data + ((uint64_t)e * N + r) * (K / 2);
                    const uint8_t *sc = stt->data + ((uint64_t)e * N + r) * (K / 32);
                    for (uint64_t s = 0; s < K / 32; s++)
                        if (sc[s] == 255) return not_finite(im, stt, st);
                    if (im->mxfp4_exact) {
                        if (mxfp4_row_exact(blk, sc, K, im->codebook, b->packed[p] + r * (K / pack),
                                            b->scales[p], r * nb, q.scale_dtype,
                                            p ? &err_down : &err_gate) != 0)
                            return not_finite(im, stt, st);
                    } else {
                        mxfp4_row(blk, sc, K, b->row);
                        if ((qrc = qm_quant_row(&q, b->row, K, b->packed[p] + r * (K / pack),
                                                b->scales[p], r * nb, NULL,
                                                p ? &err_down : &err_gate)))
                            return refused_row(im, bt, qrc, st);
                    }
                }
            }
        } else {
            /* GPT-OSS bf16: gate_up_proj [E, H, 2I] and down_proj [E, I, H] are
             * input-major; transpose each expert's matrix once. */
            for (int p = 0; p < 2; p++) {
                const qm__hf_tensor *t = lsrc[p ? QM__HF_FUSED_DOWN : QM__HF_FUSED_GATE_UP];
                uint64_t N = p ? H : 2ull * I, K = p ? I : H, nb = p ? nblk_i : nblk_h;
                size_t es = qm__elem_size(t->elem);
                const uint8_t *base = t->data + (uint64_t)e * N * K * es;
                for (uint64_t kk = 0; kk < K; kk++) {
                    qm__elem_load_row(base + kk * N * es, t->elem, N, b->row);
                    for (uint64_t n = 0; n < N; n++)
                        b->mat[n * K + kk] = b->row[n];
                }
                for (uint64_t r = 0; r < N; r++)
                    if ((qrc = qm_quant_row(&q, b->mat + r * K, K, b->packed[p] + r * (K / pack),
                                            b->scales[p], r * nb, NULL, p ? &err_down : &err_gate)))
                        return refused_row(im, t, qrc, st);
            }
        }
        if ((rc = qm_bank_writer_put(w, li, QM_T_FC1_WEIGHT, e * fc1_w, b->packed[0], fc1_w, st)) ||
            (rc = qm_bank_writer_put(w, li, QM_T_FC1_SCALES, e * fc1_s, b->scales[0], fc1_s, st)) ||
            (rc = qm_bank_writer_put(w, li, QM_T_FC2_WEIGHT, e * fc2_w, b->packed[1], fc2_w, st)) ||
            (rc = qm_bank_writer_put(w, li, QM_T_FC2_SCALES, e * fc2_s, b->scales[1], fc2_s, st)))
            return rc;
        if (lsrc && lsrc[QM__HF_FUSED_GATE_UP_BIAS]) {
            for (int p = 0; p < 2; p++) {
                const qm__hf_tensor *t =
                    lsrc[p ? QM__HF_FUSED_DOWN_BIAS : QM__HF_FUSED_GATE_UP_BIAS];
                uint64_t N = p ? H : 2ull * I;
                qm__elem_load_row(t->data + (uint64_t)e * N * qm__elem_size(t->elem), t->elem, N,
                                  b->bias);
                if (!qm_quant_finite(b->bias, N)) return not_finite(im, t, st);
                if ((rc = qm_bank_writer_put(w, li, p ? QM_T_FC2_BIAS : QM_T_FC1_BIAS, e * N * 4,
                                             b->bias, N * 4, st)))
                    return rc;
            }
        }
        const qm_quant_error *errs[3] = {&err_gate, &err_up, &err_down};
        for (int i = 0; i < 3; i++)
            if (errs[i]->ref2 > 0 || errs[i]->diff2 > 0) {
                double r = qm_quant_error_rel(errs[i]);
                if (r > *max_err) *max_err = r;
            }
    }
    return 0;
}
