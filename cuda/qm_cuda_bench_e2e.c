/* qm_cuda_bench_e2e.c - end-to-end layer throughput through the pager (see
 * qm_cuda_bench_e2e.h). Only the backend interface, the pager and the CUDA
 * extras are used, so the same code runs on a GPU and in the emulation. */
#include "qm_cuda_bench_e2e.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "qm_alloc.h"
#include "qm_cuda.h"
#include "qm_moe.h"
#include "qm_pager.h"
#include "qm_residency.h"

static double qm__e2e_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t qm__e2e_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

enum { QM__E2E_TENSORS = 8 };

typedef struct qm__e2e_tensor {
    const char *suffix, *dtype;
    uint64_t shape[3];
    uint32_t ndim;
    int kind; /* 0 codes, 1 scales (f16), 2 biases (f16), 3 router weight (bf16), 4 router bias */
    uint64_t offset, bytes;
} qm__e2e_tensor;

/* A safetensors image of the bank in host memory (page aligned, so it can
 * be registered for direct DMA). */
static int qm__e2e_build_bank(const qm_e2e_spec *sp, uint8_t **image, size_t *size, qm_status *st)
{
    const uint64_t E = sp->experts, H = sp->hidden, I = sp->inter, N1 = 2 * I, BS = 32;
    const uint32_t L = sp->layers;
    qm__e2e_tensor proto[QM__E2E_TENSORS] = {
        {"fc1.weight", "U8", {E, N1, H / 2}, 3, 0, 0, 0},
        {"fc1.scales", "F16", {E, N1, (H + BS - 1) / BS}, 3, 1, 0, 0},
        {"fc1.bias", "F16", {E, N1, 0}, 2, 2, 0, 0},
        {"fc2.weight", "U8", {E, H, I / 2}, 3, 0, 0, 0},
        {"fc2.scales", "F16", {E, H, (I + BS - 1) / BS}, 3, 1, 0, 0},
        {"fc2.bias", "F16", {E, H, 0}, 2, 2, 0, 0},
        {"router.weight", "BF16", {E, H, 0}, 2, 3, 0, 0},
        {"router.bias", "BF16", {E, 0, 0}, 1, 4, 0, 0},
    };
    if (H % 32 || I % 32)
        return qm_status_set(st, QM_EINVAL, "e2e: hidden and inter must be multiples of 32");
    qm__e2e_tensor *t = qm_calloc((size_t)L * QM__E2E_TENSORS, sizeof *t);
    size_t hcap = 512 + (size_t)L * QM__E2E_TENSORS * 160;
    char *hdr = qm_malloc(hcap);
    if (!t || !hdr) {
        qm_free(t);
        qm_free(hdr);
        return qm_status_set(st, QM_ENOMEM, "e2e: out of memory for the bank header");
    }
    uint64_t off = 0;
    int w = snprintf(hdr, hcap,
                     "{\"__metadata__\":{\"qmoe.format\":\"1\",\"qmoe.layers\":\"%u\","
                     "\"qmoe.experts\":\"%u\",\"qmoe.hidden_size\":\"%u\",\"qmoe.inter_size\":"
                     "\"%u\",\"qmoe.k\":\"%u\",\"qmoe.activation\":\"swiglu\",\"qmoe.bits\":\"4\","
                     "\"qmoe.block_size\":\"32\",\"qmoe.swiglu_fusion\":\"1\","
                     "\"qmoe.normalize_routing_weights\":\"1\",\"qmoe.activation_alpha\":"
                     "\"1.702\",\"qmoe.activation_beta\":\"1\",\"qmoe.swiglu_limit\":\"7\"}",
                     L, sp->experts, sp->hidden, sp->inter, sp->k);
    for (uint32_t l = 0; l < L; l++) {
        for (int i = 0; i < QM__E2E_TENSORS; i++) {
            qm__e2e_tensor *x = &t[l * QM__E2E_TENSORS + i];
            *x = proto[i];
            uint64_t elems = x->shape[0] * (x->ndim > 1 ? x->shape[1] : 1) *
                             (x->ndim > 2 ? x->shape[2] : 1);
            x->bytes = elems * (x->kind == 0 ? 1 : 2);
            off = (off + 255) & ~255ull; /* 256-aligned tensors: 16-byte aligned slices */
            x->offset = off;
            off += x->bytes;
            w += snprintf(hdr + w, hcap - (size_t)w,
                          ",\"layers.%u.%s\":{\"dtype\":\"%s\",\"shape\":[%llu", l, x->suffix,
                          x->dtype, (unsigned long long)x->shape[0]);
            for (uint32_t d = 1; d < x->ndim; d++)
                w += snprintf(hdr + w, hcap - (size_t)w, ",%llu",
                              (unsigned long long)x->shape[d]);
            w += snprintf(hdr + w, hcap - (size_t)w, "],\"data_offsets\":[%llu,%llu]}",
                          (unsigned long long)x->offset, (unsigned long long)(x->offset + x->bytes));
        }
    }
    w += snprintf(hdr + w, hcap - (size_t)w, "}");
    size_t hlen = ((size_t)w + 7) / 8 * 8;
    *size = 8 + hlen + off;
    *image = NULL;
    if (posix_memalign((void **)image, 4096, (*size + 4095) & ~(size_t)4095) != 0) {
        qm_free(t);
        qm_free(hdr);
        return qm_status_set(st, QM_ENOMEM, "e2e: cannot allocate a %zu-byte bank", *size);
    }
    uint8_t *img = *image;
    uint64_t hl = hlen;
    memcpy(img, &hl, 8);
    memcpy(img + 8, hdr, (size_t)w);
    memset(img + 8 + w, ' ', hlen - (size_t)w);
    uint8_t *data = img + 8 + hlen;
    memset(data, 0, off);
    /* Value tables: scales near 1 / (53.7 * 8) keep activations O(1). */
    uint16_t scale_tab[256], bias_tab[256], router_tab[256];
    uint64_t s = 0x2545f4914f6cdd1dull;
    for (int i = 0; i < 256; i++) {
        scale_tab[i] = qm_f32_to_f16((0.5f + (float)i / 256.0f) / (53.7f * 8.0f));
        bias_tab[i] = qm_f32_to_f16(((float)i / 255.0f - 0.5f) * 0.5f);
        router_tab[i] = qm_f32_to_bf16(((float)i / 255.0f - 0.5f) * 0.1f);
    }
    for (size_t i = 0; i < (size_t)L * QM__E2E_TENSORS; i++) {
        uint8_t *p = data + t[i].offset;
        if (t[i].kind == 0) {
            uint64_t n8 = t[i].bytes / 8;
            for (uint64_t b = 0; b < n8; b++) {
                uint64_t v = qm__e2e_next(&s);
                memcpy(p + 8 * b, &v, 8);
            }
            for (uint64_t b = n8 * 8; b < t[i].bytes; b++)
                p[b] = (uint8_t)qm__e2e_next(&s);
            continue;
        }
        const uint16_t *tab = t[i].kind == 1 ? scale_tab : t[i].kind == 2 ? bias_tab : router_tab;
        uint16_t *h = (uint16_t *)p;
        for (uint64_t b = 0; b < t[i].bytes / 2; b += 4) {
            uint64_t v = qm__e2e_next(&s);
            for (uint64_t j = 0; j < 4 && b + j < t[i].bytes / 2; j++)
                h[b + j] = tab[(v >> (16 * j)) & 255];
        }
    }
    qm_free(t);
    qm_free(hdr);
    return 0;
}

static qm_residency_plan *qm__e2e_plan(const qm_bank *bank, const qm_policy *pol, uint64_t budget,
                                       qm_status *st)
{
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    qm_region_catalog **cats = qm_calloc(cfg->layers, sizeof *cats);
    qm_residency_plan *plan = NULL;
    if (!cats) {
        qm_status_set(st, QM_ENOMEM, "e2e: out of memory for catalogs");
        return NULL;
    }
    int rc = 0;
    for (uint32_t l = 0; l < cfg->layers && rc == 0; l++)
        rc = qm_bank_build_catalog(bank, l, &cats[l], st);
    if (rc == 0) {
        qm_plan_options po = {.has_budget = 1, .budget_bytes = budget};
        if (qm_plan_residency((const qm_region_catalog *const *)cats, cfg->layers, pol, &po, &plan,
                              st) != 0)
            plan = NULL;
    }
    for (uint32_t l = 0; l < cfg->layers; l++)
        qm_catalog_free(cats[l]);
    qm_free(cats);
    return plan;
}

int qm_e2e_run(qm_backend *be, const qm_e2e_spec *sp, qm_e2e_row *rows,
               void (*report)(const char *fmt, ...), qm_status *st)
{
    uint8_t *image = NULL;
    size_t size = 0;
    qm_bank *bank = NULL;
    float *pool = NULL, *out = NULL, *check_full = NULL, *check = NULL;
    int registered = 0, rc;
    if ((rc = qm__e2e_build_bank(sp, &image, &size, st)) < 0) return rc;
    if ((rc = qm_bank_open_memory(image, size, &bank, st)) < 0) goto done;
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    const uint32_t H = cfg->hidden, L = cfg->layers;
    uint32_t tmax = 1;
    for (uint32_t i = 0; i < sp->n_tokens; i++)
        if (sp->tokens[i] > tmax) tmax = sp->tokens[i];
    /* Hidden states are windows at random offsets into one random pool:
     * every call routes afresh without generating T * H numbers per call. */
    const size_t pool_n = (size_t)tmax * H + ((size_t)1 << 20);
    pool = qm_malloc(pool_n * sizeof *pool);
    out = qm_malloc((size_t)tmax * H * sizeof *out);
    check_full = qm_malloc((size_t)H * sizeof *out);
    check = qm_malloc((size_t)H * sizeof *out);
    if (!pool || !out || !check_full || !check) {
        rc = qm_status_set(st, QM_ENOMEM, "e2e: out of memory for activations");
        goto done;
    }
    uint64_t rs = 0x853c49e6748fea9bull;
    for (size_t i = 0; i < pool_n; i++)
        pool[i] = (float)((int)(qm__e2e_next(&rs) % 2001) - 1000) * 1e-3f;
    qm_status rst = {0};
    registered = qm_backend_register_host(be, image, size, &rst) > 0;
    const uint64_t model = qm_bank_expert_bytes_total(bank);
    if (report)
        report("# e2e: %u layers x %u experts (k %u, H %u, I %u), %.2f GB of experts, copies %s; "
               "lru, prefetch %s; fresh hidden states every layer call\n",
               L, cfg->experts, cfg->k, H, cfg->inter, model / 1e9,
               registered ? "from registered memory (direct DMA)" : "through the bounce ring",
               sp->prefetch ? "on" : "off");

    size_t r = 0;
    for (uint32_t bi = 0; bi < sp->n_budgets; bi++) {
        qm_policy pol = {0};
        qm_residency_plan *plan = NULL;
        qm_pager *pg = NULL;
        if ((rc = qm_policy_new("lru", NULL, &pol, st)) < 0) goto done;
        uint64_t budget = model * sp->budget_pct[bi] / 100; /* exact at 100 % */
        qm_pager_options o = {.prefetch = sp->prefetch};
        plan = qm__e2e_plan(bank, &pol, budget, st);
        uint64_t min = 0;
        if (!plan || (rc = qm_pager_min_budget(be, bank, plan, &o, &min, st)) < 0) {
            if (!plan) rc = st && st->code < 0 ? st->code : QM_EINTERNAL;
            goto point_fail;
        }
        if (budget < min) { /* alignment: round up to what the pager needs */
            budget = min;
            qm_plan_free(plan);
            if (!(plan = qm__e2e_plan(bank, &pol, budget, st))) {
                rc = st && st->code < 0 ? st->code : QM_EINTERNAL;
                goto point_fail;
            }
        }
        if ((rc = qm_pager_new(be, bank, plan, &pol, &o, &pg, st)) < 0) goto point_fail;
        /* One fixed token through layer 0: bitwise the same at every budget. */
        qm_moe_call cc = {.layer = 0, .dtype = QM_DTYPE_F32, .hidden = pool, .n_tokens = 1,
                          .output = bi == 0 ? check_full : check};
        if ((rc = qm_pager_forward(pg, &cc, NULL, st)) < 0) goto point_fail;
        int bitwise = bi == 0 || memcmp(check, check_full, (size_t)H * sizeof *check) == 0;
        for (uint32_t ti = 0; ti < sp->n_tokens; ti++) {
            const uint32_t T = sp->tokens[ti];
            qm_pager_stats s0, s1;
            uint32_t steps = 0;
            double t0 = 0, el = 0;
            for (int warm = 1; warm >= 0; warm--) {
                if (!warm) {
                    qm_pager_stats_get(pg, &s0);
                    t0 = qm__e2e_now();
                }
                do {
                    for (uint32_t l = 0; l < L; l++) {
                        size_t at = (size_t)(qm__e2e_next(&rs) % (pool_n - (size_t)T * H + 1)) & ~3u;
                        qm_moe_call mc = {.layer = l, .dtype = QM_DTYPE_F32, .hidden = pool + at,
                                          .n_tokens = T, .output = out};
                        if ((rc = qm_pager_forward(pg, &mc, NULL, st)) < 0) goto point_fail;
                    }
                    if (!warm) steps++;
                    el = qm__e2e_now() - t0;
                } while (!warm && steps < sp->max_steps &&
                         (steps < sp->min_steps || el < sp->seconds));
            }
            qm_pager_stats_get(pg, &s1);
            qm_e2e_row *row = &rows[r++];
            memset(row, 0, sizeof *row);
            row->budget_pct = sp->budget_pct[bi];
            row->tokens = T;
            row->budget_bytes = budget;
            row->model_bytes = model;
            row->steps = steps;
            row->seconds = el;
            row->tokens_per_s = el > 0 ? (double)T * steps / el : 0;
            row->ms_per_layer_call = steps ? 1e3 * el / ((double)steps * L) : 0;
            row->bytes_paged = s1.bytes_paged_h2d - s0.bytes_paged_h2d;
            row->paged_gb_per_s = el > 0 ? row->bytes_paged / el / 1e9 : 0;
            row->hits = s1.hits - s0.hits;
            row->misses = s1.misses - s0.misses;
            row->prefetch_issued = s1.prefetch_issued - s0.prefetch_issued;
            row->prefetch_useful = s1.prefetch_useful - s0.prefetch_useful;
            row->bitwise_equal_to_full = bitwise;
            if (report) {
                char name[64];
                snprintf(name, sizeof name, "e2e T=%u budget %u%%", T, row->budget_pct);
                uint64_t acc = row->hits + row->misses;
                report("%-44s %12.1f %8s  %.3f ms/layer call, %.1f MB paged/token (%.2f GB/s), "
                       "hits %.0f%%, prefetch %llu/%llu useful, %u steps, %s\n",
                       name, row->tokens_per_s, "tok/s", row->ms_per_layer_call,
                       steps ? row->bytes_paged / 1e6 / ((double)T * steps) : 0.0,
                       row->paged_gb_per_s, acc ? 100.0 * row->hits / acc : 100.0,
                       (unsigned long long)row->prefetch_issued,
                       (unsigned long long)row->prefetch_useful, steps,
                       bitwise ? "output bitwise = 100%" : "OUTPUT DIFFERS FROM 100%");
            }
        }
        rc = 0;
    point_fail:
        qm_pager_free(pg);
        qm_plan_free(plan);
        qm_policy_destroy(&pol);
        if (rc < 0) goto done;
    }

done:
    if (registered) (void)qm_backend_unregister_host(be, image, NULL);
    qm_bank_close(bank);
    free(image);
    qm_free(pool);
    qm_free(out);
    qm_free(check_full);
    qm_free(check);
    return rc;
}
