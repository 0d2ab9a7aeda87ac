/* paging_fixture.c - see paging_fixture.h. */
#include "paging_fixture.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"

uint64_t pf_rand(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

float pf_uniform(uint64_t *s, float lo, float hi)
{
    return lo + (hi - lo) * (float)((pf_rand(s) >> 40) * (1.0 / 16777216.0));
}

pf_spec pf_default_spec(void)
{
    return (pf_spec){.layers = 3, .experts = 8, .hidden = 32, .inter = 16, .k = 2, .bits = 4,
                     .router = 1, .seed = 7};
}

typedef struct pf_tensor {
    char name[64];
    const char *dtype;
    uint64_t shape[3];
    uint32_t ndim;
    uint64_t offset, bytes;
    int is_f32;
} pf_tensor;

static void add(pf_tensor *t, size_t *n, uint64_t *off, uint32_t l, const char *suffix,
                int is_f32, uint64_t a, uint64_t b, uint64_t c, uint32_t ndim)
{
    pf_tensor *x = &t[(*n)++];
    snprintf(x->name, sizeof x->name, "layers.%u.%s", l, suffix);
    x->dtype = is_f32 ? "F32" : "U8";
    x->shape[0] = a;
    x->shape[1] = b;
    x->shape[2] = c;
    x->ndim = ndim;
    x->is_f32 = is_f32;
    x->bytes = (is_f32 ? 4 : 1) * a * (ndim > 1 ? b : 1) * (ndim > 2 ? c : 1);
    /* Gaps between tensors are legal; keep every tensor 64-byte aligned. */
    *off = (*off + 63) / 64 * 64;
    x->offset = *off;
    *off += x->bytes;
}

void pf_bank_open(const pf_spec *sp, pf_bank *out)
{
    pf_tensor t[64];
    size_t n = 0;
    uint64_t off = 0;
    uint32_t E = sp->experts, H = sp->hidden, I = sp->inter, pack = 8 / sp->bits;
    ck_assert_uint_le(sp->layers * 7, 64);
    for (uint32_t l = 0; l < sp->layers; l++) {
        add(t, &n, &off, l, "fc1.weight", 0, E, I, H / pack, 3);
        if (sp->block)
            add(t, &n, &off, l, "fc1.scales", 1, E, I, H / sp->block, 3);
        else
            add(t, &n, &off, l, "fc1.scales", 1, E, I, 0, 2);
        add(t, &n, &off, l, "fc1.bias", 1, E, I, 0, 2);
        add(t, &n, &off, l, "fc2.weight", 0, E, H, I / pack, 3);
        if (sp->block)
            add(t, &n, &off, l, "fc2.scales", 1, E, H, I / sp->block, 3);
        else
            add(t, &n, &off, l, "fc2.scales", 1, E, H, 0, 2);
        add(t, &n, &off, l, "fc2.bias", 1, E, H, 0, 2);
        if (sp->router) {
            add(t, &n, &off, l, "router.weight", 1, E, H, 0, 2);
            add(t, &n, &off, l, "router.bias", 1, E, 0, 0, 1);
        }
    }
    char *hdr = malloc(16384);
    ck_assert_ptr_nonnull(hdr);
    int w = snprintf(hdr, 16384,
                     "{\"__metadata__\":{\"qmoe.format\":\"1\",\"qmoe.layers\":\"%u\","
                     "\"qmoe.experts\":\"%u\",\"qmoe.hidden_size\":\"%u\",\"qmoe.inter_size\":"
                     "\"%u\",\"qmoe.k\":\"%u\",\"qmoe.activation\":\"silu\",\"qmoe.bits\":\"%u\","
                     "\"qmoe.block_size\":\"%u\"}",
                     sp->layers, E, H, I, sp->k, sp->bits, sp->block);
    for (size_t i = 0; i < n; i++) {
        w += snprintf(hdr + w, 16384 - (size_t)w, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%llu",
                      t[i].name, t[i].dtype, (unsigned long long)t[i].shape[0]);
        for (uint32_t d = 1; d < t[i].ndim; d++)
            w += snprintf(hdr + w, 16384 - (size_t)w, ",%llu", (unsigned long long)t[i].shape[d]);
        w += snprintf(hdr + w, 16384 - (size_t)w, "],\"data_offsets\":[%llu,%llu]}",
                      (unsigned long long)t[i].offset,
                      (unsigned long long)(t[i].offset + t[i].bytes));
    }
    w += snprintf(hdr + w, 16384 - (size_t)w, "}");
    ck_assert_int_lt(w, 16000);
    size_t hlen = ((size_t)w + 7) / 8 * 8;
    while ((size_t)w < hlen)
        hdr[w++] = ' ';
    out->size = 8 + hlen + off;
    out->image = calloc(1, out->size);
    ck_assert_ptr_nonnull(out->image);
    uint64_t hl = hlen;
    memcpy(out->image, &hl, 8);
    memcpy(out->image + 8, hdr, hlen);
    free(hdr);
    uint8_t *data = out->image + 8 + hlen;
    uint64_t s = sp->seed * 1000003 + 1;
    for (size_t i = 0; i < n; i++) {
        uint8_t *p = data + t[i].offset;
        if (!t[i].is_f32) {
            for (uint64_t b = 0; b < t[i].bytes; b++)
                p[b] = (uint8_t)pf_rand(&s);
            continue;
        }
        int scales = strstr(t[i].name, "scales") != NULL;
        for (uint64_t b = 0; b < t[i].bytes / 4; b++) {
            float v = scales ? pf_uniform(&s, 0.01f, 0.05f) : pf_uniform(&s, -0.5f, 0.5f);
            memcpy(p + 4 * b, &v, 4);
        }
    }
    qm_status st = {0};
    int rc = qm_bank_open_memory(out->image, out->size, &out->bank, &st);
    ck_assert_msg(rc == 0, "bank image rejected: %s", st.msg);
}

void pf_bank_close(pf_bank *b)
{
    qm_bank_close(b->bank);
    free(b->image);
    memset(b, 0, sizeof *b);
}

void pf_route_logits(uint32_t E, const uint32_t *experts, uint32_t n, float *logits)
{
    for (uint32_t e = 0; e < E; e++)
        logits[e] = -30.0f - (float)e * 0.01f; /* softmax weight ~1e-15: dropped if chosen */
    for (uint32_t j = 0; j < n; j++)
        logits[experts[j]] = 4.0f - 0.5f * (float)j;
}
