/* bank_fixture.c - see bank_fixture.h. Uses libc malloc so allocation-failure
 * tests count only the code under test. */
#include "bank_fixture.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"

fx_opts fx_default(void)
{
    fx_opts o = {.layers = 2, .experts = 4, .hidden = 64, .inter = 32, .k = 2, .bits = 4,
                 .block_size = 16, .fusion = 0, .act = QM_ACT_SILU, .asymmetric = 0,
                 .router = 0, .bias = 1, .scale_dtype = QM_DTYPE_F32};
    return o;
}

static const char *st_name(qm_dtype d)
{
    return d == QM_DTYPE_F32 ? "F32" : d == QM_DTYPE_F16 ? "F16" : d == QM_DTYPE_BF16 ? "BF16" : "U8";
}

static uint64_t cdiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

static uint64_t tensor_bytes(const qm_st_tensor *t)
{
    uint64_t n = qm_st_dtype_size(t->dtype);
    for (uint32_t d = 0; d < t->ndim; d++)
        n *= t->shape[d];
    return n;
}

static void push(fx_bank *fx, const char *name, const char *dtype, uint32_t ndim, uint64_t a,
                 uint64_t b, uint64_t c)
{
    size_t i = fx->n++;
    snprintf(fx->names[i], sizeof fx->names[i], "%s", name);
    qm_st_tensor *t = &fx->t[i];
    memset(t, 0, sizeof *t);
    t->name = fx->names[i];
    snprintf(t->dtype, sizeof t->dtype, "%s", dtype);
    t->ndim = ndim;
    t->shape[0] = a;
    t->shape[1] = b;
    t->shape[2] = c;
}

void fx_set_meta(fx_bank *fx, const char *key, const char *value)
{
    for (size_t i = 0; i < fx->nm; i++)
        if (strcmp(fx->keys[i], key) == 0) {
            snprintf(fx->vals[i], sizeof fx->vals[i], "%s", value);
            return;
        }
    size_t i = fx->nm++;
    snprintf(fx->keys[i], sizeof fx->keys[i], "%s", key);
    snprintf(fx->vals[i], sizeof fx->vals[i], "%s", value);
    fx->m[i].key = fx->keys[i];
    fx->m[i].value = fx->vals[i];
}

void fx_del_meta(fx_bank *fx, const char *key)
{
    for (size_t i = 0; i < fx->nm; i++)
        if (strcmp(fx->keys[i], key) == 0) {
            for (size_t j = i + 1; j < fx->nm; j++) {
                memcpy(fx->keys[j - 1], fx->keys[j], sizeof fx->keys[j]);
                memcpy(fx->vals[j - 1], fx->vals[j], sizeof fx->vals[j]);
            }
            fx->nm--;
            return;
        }
}

qm_st_tensor *fx_find(fx_bank *fx, const char *name)
{
    for (size_t i = 0; i < fx->n; i++)
        if (strcmp(fx->names[i], name) == 0)
            return &fx->t[i];
    return NULL;
}

void fx_del_tensor(fx_bank *fx, const char *name)
{
    qm_st_tensor *t = fx_find(fx, name);
    if (!t)
        return;
    size_t i = (size_t)(t - fx->t);
    for (size_t j = i + 1; j < fx->n; j++) {
        fx->t[j - 1] = fx->t[j];
        memcpy(fx->names[j - 1], fx->names[j], sizeof fx->names[j]);
        fx->t[j - 1].name = fx->names[j - 1];
    }
    fx->n--;
}

static uint64_t data_end(const fx_bank *fx)
{
    uint64_t end = 0;
    for (size_t i = 0; i < fx->n; i++)
        if (fx->t[i].end > end)
            end = fx->t[i].end;
    return end;
}

void fx_add_tensor(fx_bank *fx, const char *name, const char *dtype, const uint64_t *shape,
                   uint32_t ndim)
{
    uint64_t at = data_end(fx);
    push(fx, name, dtype, ndim, 0, 0, 0);
    qm_st_tensor *t = &fx->t[fx->n - 1];
    for (uint32_t d = 0; d < ndim; d++)
        t->shape[d] = shape[d];
    size_t es = qm_st_dtype_size(dtype);
    at = (at + es - 1) / es * es;
    t->begin = at;
    t->end = at + tensor_bytes(t);
}

void fx_init(fx_bank *fx, const fx_opts *o)
{
    memset(fx, 0, sizeof *fx);
    fx->o = *o;
    uint64_t e = o->experts, pack = 8 / o->bits, bs = o->block_size;
    const char *sd = st_name(o->scale_dtype);
    int fused = o->act == QM_ACT_SWIGLU && o->fusion != 0;
    int nproj = o->act == QM_ACT_SWIGLU && o->fusion == 0 ? 3 : 2;
    char name[64];
    for (uint32_t l = 0; l < o->layers; l++) {
        for (int p = 1; p <= nproj; p++) {
            uint64_t n = p == 1 ? (fused ? 2ull * o->inter : o->inter) : p == 2 ? o->hidden : o->inter;
            uint64_t k = p == 2 ? o->inter : o->hidden;
            uint64_t nblk = bs ? cdiv(k, bs) : 1;
            snprintf(name, sizeof name, "layers.%u.fc%d.weight", l, p);
            push(fx, name, "U8", 3, e, n, k / pack);
            snprintf(name, sizeof name, "layers.%u.fc%d.scales", l, p);
            push(fx, name, sd, bs ? 3 : 2, e, n, nblk);
            if (o->asymmetric) {
                snprintf(name, sizeof name, "layers.%u.fc%d.zero_points", l, p);
                if (bs)
                    push(fx, name, "U8", 3, e, n, cdiv(nblk, pack));
                else
                    push(fx, name, "U8", 2, e, cdiv(n, pack), 0);
            }
            if (o->bias) {
                snprintf(name, sizeof name, "layers.%u.fc%d.bias", l, p);
                push(fx, name, sd, 2, e, n, 0);
            }
        }
        if (o->router) {
            snprintf(name, sizeof name, "layers.%u.router.weight", l);
            push(fx, name, sd, 2, e, o->hidden, 0);
            snprintf(name, sizeof name, "layers.%u.router.bias", l);
            push(fx, name, sd, 1, e, 0, 0);
        }
    }
    uint64_t off = 0;
    for (size_t w = 4; w >= 1; w /= 2)
        for (size_t i = 0; i < fx->n; i++) {
            qm_st_tensor *t = &fx->t[i];
            if (qm_st_dtype_size(t->dtype) != w)
                continue;
            t->begin = off;
            t->end = off + tensor_bytes(t);
            off = t->end;
        }
    char v[32];
    fx_set_meta(fx, "qmoe.format", "1");
#define META_U(key, val)                                                                           \
    snprintf(v, sizeof v, "%u", (unsigned)(val));                                                  \
    fx_set_meta(fx, key, v)
    META_U("qmoe.layers", o->layers);
    META_U("qmoe.experts", o->experts);
    META_U("qmoe.hidden_size", o->hidden);
    META_U("qmoe.inter_size", o->inter);
    META_U("qmoe.k", o->k);
    META_U("qmoe.bits", o->bits);
    META_U("qmoe.block_size", o->block_size);
    META_U("qmoe.swiglu_fusion", o->fusion);
#undef META_U
    fx_set_meta(fx, "qmoe.activation", qm_activation_name(o->act));
    fx_set_meta(fx, "qmoe.normalize_routing_weights", "1");
}

uint8_t *fx_raw(const char *header, size_t header_len, size_t data_bytes, size_t *size)
{
    size_t total = 8 + header_len + data_bytes;
    uint8_t *img = malloc(total ? total : 1);
    for (int i = 0; i < 8; i++)
        img[i] = (uint8_t)((uint64_t)header_len >> (8 * i));
    memcpy(img + 8, header, header_len);
    for (size_t i = 0; i < data_bytes; i++)
        img[8 + header_len + i] = (uint8_t)(i * 31 + 7);
    *size = total;
    return img;
}

uint8_t *fx_build(const fx_bank *fx, size_t *size, uint64_t *hlen)
{
    char *json = NULL;
    size_t len = 0;
    qm_status st;
    /* qm_st_header_format allocates with qm_malloc; copy out and free. */
    if (qm_st_header_format(fx->t, fx->n, fx->m, fx->nm, 8, &json, &len, &st) != 0)
        return NULL;
    uint64_t dend = data_end(fx);
    if (fx->data_cap && dend > fx->data_cap)
        dend = fx->data_cap;
    uint8_t *img = fx_raw(json, len, (size_t)dend, size);
    qm_free(json);
    if (hlen)
        *hlen = len;
    return img;
}
