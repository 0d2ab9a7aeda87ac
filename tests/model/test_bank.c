/* test_bank.c - the bank loader: valid variants, catalogs, and the
 * corruption matrix (every failure is invalid_model with a sentence that
 * names the tensor or key and the rule; ASan proves no leak or stray read). */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bank_fixture.h"
#include "qm_alloc.h"
#include "qm_bank.h"
#include "qm_residency.h"

/* Opens an image; returns the code and copies the message. The image is
 * copied into an exactly-sized heap block so ASan sees any read past it. */
static int open_img(const uint8_t *img, size_t size, char *msg, size_t msg_size)
{
    uint8_t *copy = malloc(size ? size : 1);
    memcpy(copy, img, size);
    qm_bank *bank = NULL;
    qm_status st;
    qm_status_clear(&st);
    int rc = qm_bank_open_memory(copy, size, &bank, &st);
    if (msg)
        snprintf(msg, msg_size, "%s", st.msg);
    if (rc == 0) {
        ck_assert_ptr_nonnull(bank);
        /* Walk every view: any bad pointer shows up under ASan. */
        const qm_bank_config *c = qm_bank_get_config(bank);
        volatile uint8_t sink = 0;
        for (uint32_t l = 0; l < c->layers; l++) {
            const qm_layer_view *lv = qm_bank_layer(bank, l);
            for (int t = 0; t < QM_T_COUNT; t++)
                if (lv->t[t].present && lv->t[t].nbytes)
                    sink ^= ((const uint8_t *)lv->t[t].data)[lv->t[t].nbytes - 1];
        }
        (void)sink;
    } else {
        ck_assert_ptr_null(bank);
    }
    qm_bank_close(bank);
    free(copy);
    return rc;
}

static void expect_invalid(const fx_bank *fx, const char *needle)
{
    size_t size;
    uint8_t *img = fx_build(fx, &size, NULL);
    char msg[QM_STATUS_MSG_MAX];
    int rc = open_img(img, size, msg, sizeof msg);
    free(img);
    ck_assert_msg(rc == QM_EINVALID_MODEL, "expected invalid_model, got %d (%s)", rc, msg);
    ck_assert_msg(strstr(msg, needle) != NULL, "message \"%s\" lacks \"%s\"", msg, needle);
}

static void expect_raw_invalid(const char *header, size_t data_bytes, const char *needle)
{
    size_t size;
    uint8_t *img = fx_raw(header, strlen(header), data_bytes, &size);
    char msg[QM_STATUS_MSG_MAX];
    int rc = open_img(img, size, msg, sizeof msg);
    free(img);
    ck_assert_msg(rc == QM_EINVALID_MODEL, "expected invalid_model, got %d (%s)", rc, msg);
    ck_assert_msg(strstr(msg, needle) != NULL, "message \"%s\" lacks \"%s\"", msg, needle);
}

/* ---- valid banks ------------------------------------------------------------- */

START_TEST(test_bank_opens_default_fixture_with_expected_config)
{
    fx_bank fx;
    fx_opts o = fx_default();
    fx_init(&fx, &o);
    size_t size;
    uint8_t *img = fx_build(&fx, &size, NULL);
    qm_bank *bank = NULL;
    qm_status st;
    ck_assert_int_eq(qm_bank_open_memory(img, size, &bank, &st), 0);
    const qm_bank_config *c = qm_bank_get_config(bank);
    ck_assert_uint_eq(c->layers, 2);
    ck_assert_uint_eq(c->experts, 4);
    ck_assert_uint_eq(c->hidden, 64);
    ck_assert_uint_eq(c->inter, 32);
    ck_assert_uint_eq(c->bits, 4);
    ck_assert_uint_eq(c->block_size, 16);
    ck_assert_int_eq(c->activation, QM_ACT_SILU);
    ck_assert_int_eq(c->normalize_routing, 1);
    ck_assert(c->alpha == 1.0f && c->beta == 0.0f && c->limit > 1e30f);
    ck_assert_str_eq(qm_bank_path(bank), "");
    ck_assert_uint_eq(qm_bank_file_bytes(bank), size);
    const qm_layer_view *lv = qm_bank_layer(bank, 1);
    ck_assert_ptr_nonnull(lv);
    ck_assert_ptr_null(qm_bank_layer(bank, 2));
    ck_assert_uint_eq(lv->index, 1);
    /* fc1: [4,32,32] u8 = 4096; scales [4,32,4] f32 = 2048; bias [4,32] f32 = 512.
     * fc2: [4,64,16] = 4096; scales [4,64,2] f32 = 2048; bias [4,64] = 1024. */
    ck_assert_uint_eq(lv->t[QM_T_FC1_WEIGHT].nbytes, 4096);
    ck_assert_uint_eq(lv->t[QM_T_FC1_SCALES].ndim, 3);
    ck_assert_uint_eq(lv->t[QM_T_FC1_SCALES].shape[2], 4);
    ck_assert_uint_eq(lv->bytes_per_expert, (4096 + 2048 + 512 + 4096 + 2048 + 1024) / 4);
    ck_assert_uint_eq(qm_bank_expert_bytes_total(bank), 2 * (4096 + 2048 + 512 + 4096 + 2048 + 1024));
    ck_assert(!lv->t[QM_T_FC1_ZERO_POINTS].present && !lv->t[QM_T_ROUTER_WEIGHT].present);
    ck_assert_ptr_eq(lv->t[QM_T_FC2_WEIGHT].data,
                     qm_bank_data(bank) + lv->t[QM_T_FC2_WEIGHT].offset);
    size_t nw = 99;
    qm_bank_warnings(bank, &nw);
    ck_assert_uint_eq(nw, 0);
    qm_bank_close(bank);
    free(img);
}
END_TEST

START_TEST(test_bank_reports_unknown_tensors_as_warnings)
{
    fx_bank fx;
    fx_opts o = fx_default();
    fx_init(&fx, &o);
    uint64_t shape[1] = {3};
    fx_add_tensor(&fx, "model.embed", "F32", shape, 1);
    fx_add_tensor(&fx, "layers.7.fc1.weight", "U8", shape, 1);  /* layer out of range */
    fx_add_tensor(&fx, "layers.01.fc1.weight", "U8", shape, 1); /* leading zero */
    size_t size;
    uint8_t *img = fx_build(&fx, &size, NULL);
    qm_bank *bank = NULL;
    qm_status st;
    ck_assert_int_eq(qm_bank_open_memory(img, size, &bank, &st), 0);
    size_t nw = 0;
    const char *const *w = qm_bank_warnings(bank, &nw);
    ck_assert_uint_eq(nw, 3);
    ck_assert_str_eq(w[0], "model.embed");
    ck_assert_str_eq(w[1], "layers.7.fc1.weight");
    ck_assert_str_eq(w[2], "layers.01.fc1.weight");
    ck_assert_ptr_null(w[3]);
    qm_bank_close(bank);
    free(img);
}
END_TEST

/* Every combination of bits, block size, fusion, asymmetry and scale dtype
 * opens, and its catalog has one region per present expert tensor per
 * expert, in enum order, tiling each tensor exactly. */
static const struct variant {
    uint32_t bits, bs, fusion;
    qm_activation act;
    int asym, router, bias;
    qm_dtype sd;
} variants[] = {
    {4, 0, 0, QM_ACT_RELU, 0, 0, 1, QM_DTYPE_F32},
    {4, 16, 0, QM_ACT_GELU, 1, 0, 1, QM_DTYPE_F16},
    {8, 0, 0, QM_ACT_IDENTITY, 1, 1, 0, QM_DTYPE_BF16},
    {8, 32, 1, QM_ACT_SWIGLU, 0, 1, 1, QM_DTYPE_F32},
    {4, 16, 1, QM_ACT_SWIGLU, 1, 0, 1, QM_DTYPE_F32},
    {4, 64, 2, QM_ACT_SWIGLU, 1, 0, 0, QM_DTYPE_F16},
    {4, 16, 0, QM_ACT_SWIGLU, 1, 0, 1, QM_DTYPE_F32},
    {8, 0, 0, QM_ACT_SWIGLU, 0, 0, 0, QM_DTYPE_F32},
};

START_TEST(test_bank_catalog_tiles_every_expert_tensor_for_each_variant)
{
    const struct variant *v = &variants[_i];
    fx_opts o = fx_default();
    o.bits = v->bits;
    o.block_size = v->bs;
    o.fusion = v->fusion;
    o.act = v->act;
    o.asymmetric = v->asym;
    o.router = v->router;
    o.bias = v->bias;
    o.scale_dtype = v->sd;
    o.layers = 3;
    o.experts = 5;
    fx_bank fx;
    fx_init(&fx, &o);
    size_t size;
    uint8_t *img = fx_build(&fx, &size, NULL);
    qm_bank *bank = NULL;
    qm_status st;
    qm_status_clear(&st);
    ck_assert_msg(qm_bank_open_memory(img, size, &bank, &st) == 0, "variant %d: %s", _i, st.msg);
    for (uint32_t l = 0; l < 3; l++) {
        const qm_layer_view *lv = qm_bank_layer(bank, l);
        qm_region_catalog *cat = NULL;
        ck_assert_int_eq(qm_bank_build_catalog(bank, l, &cat, &st), 0);
        ck_assert_int_eq(qm_catalog_reason(cat), QM_NONPAGEABLE_NONE);
        ck_assert_uint_eq(qm_catalog_bank_id(cat), l);
        ck_assert_uint_eq(qm_catalog_expert_count(cat), 5);
        ck_assert_uint_eq(qm_catalog_bytes_per_expert(cat), lv->bytes_per_expert);
        uint64_t total = 0;
        for (uint32_t e = 0; e < 5; e++) {
            size_t n = 0;
            const qm_region *r = qm_catalog_regions(cat, e, &n);
            int nproj = v->act == QM_ACT_SWIGLU && v->fusion == 0 ? 3 : 2;
            ck_assert_int_eq((int)n, nproj * (2 + v->asym + v->bias));
            uint32_t prev_tensor = 0;
            for (size_t i = 0; i < n; i++) {
                const qm_tensor_view *tv = &lv->t[r[i].tensor];
                ck_assert(r[i].tensor < QM_T_EXPERT_COUNT && tv->present);
                ck_assert(i == 0 || r[i].tensor > prev_tensor);
                prev_tensor = r[i].tensor;
                ck_assert_uint_eq(r[i].length, tv->nbytes / 5);
                ck_assert_uint_eq(r[i].offset, tv->offset + e * (tv->nbytes / 5));
                total += r[i].length;
            }
        }
        uint64_t expect = 0;
        for (int t = 0; t < QM_T_EXPERT_COUNT; t++)
            expect += lv->t[t].present ? lv->t[t].nbytes : 0;
        ck_assert_uint_eq(total, expect);
        ck_assert_uint_eq(qm_catalog_total_bytes(cat), expect);
        ck_assert_int_eq(lv->t[QM_T_ROUTER_WEIGHT].present, v->router);
        qm_catalog_free(cat);
    }
    qm_bank_close(bank);
    free(img);
}
END_TEST

START_TEST(test_bank_catalog_single_expert_is_not_pageable)
{
    fx_opts o = fx_default();
    o.experts = 1;
    o.k = 1;
    fx_bank fx;
    fx_init(&fx, &o);
    size_t size;
    uint8_t *img = fx_build(&fx, &size, NULL);
    qm_bank *bank = NULL;
    qm_status st;
    ck_assert_int_eq(qm_bank_open_memory(img, size, &bank, &st), 0);
    qm_region_catalog *cat = NULL;
    ck_assert_int_eq(qm_bank_build_catalog(bank, 0, &cat, &st), 0);
    ck_assert_int_eq(qm_catalog_reason(cat), QM_NONPAGEABLE_SINGLE_EXPERT);
    qm_catalog_free(cat);
    ck_assert_int_eq(qm_bank_build_catalog(bank, 5, &cat, &st), QM_EINVAL);
    ck_assert_ptr_null(cat);
    qm_bank_close(bank);
    free(img);
}
END_TEST

START_TEST(test_bank_catalog_reports_misalignment_to_copy_granularity)
{
    fx_opts o = fx_default();
    fx_bank fx;
    fx_init(&fx, &o);
    size_t size;
    uint8_t *img = fx_build(&fx, &size, NULL);
    qm_bank *bank = NULL;
    qm_status st;
    ck_assert_int_eq(qm_bank_open_memory(img, size, &bank, &st), 0);
    qm_region_catalog *cat = NULL;
    ck_assert_int_eq(qm_bank_build_catalog_aligned(bank, 0, 4096, &cat, &st), 0);
    ck_assert_int_eq(qm_catalog_reason(cat), QM_NONPAGEABLE_MISALIGNED);
    ck_assert_ptr_nonnull(strstr(qm_catalog_reason_detail(cat), "copy granularity"));
    qm_catalog_free(cat);
    ck_assert_int_eq(qm_bank_build_catalog_aligned(bank, 0, 128, &cat, &st), 0);
    ck_assert_int_eq(qm_catalog_reason(cat), QM_NONPAGEABLE_NONE);
    qm_catalog_free(cat);
    qm_bank_close(bank);
    free(img);
}
END_TEST

/* ---- the corruption matrix ------------------------------------------------- */

START_TEST(test_bank_rejects_every_truncation)
{
    fx_opts o = fx_default();
    o.asymmetric = 1;
    o.router = 1;
    fx_bank fx;
    fx_init(&fx, &o);
    size_t size;
    uint64_t hlen;
    uint8_t *img = fx_build(&fx, &size, &hlen);
    char msg[QM_STATUS_MSG_MAX];
    ck_assert_int_eq(open_img(img, size, msg, sizeof msg), 0);
    /* Structural boundaries: inside the length, the header, each tensor. */
    size_t cuts[4 * FX_MAX_TENSORS + 64];
    size_t n = 0;
    for (size_t i = 0; i <= 8; i++)
        cuts[n++] = i;
    cuts[n++] = 9;
    cuts[n++] = 8 + (size_t)hlen / 2;
    cuts[n++] = 8 + (size_t)hlen - 1;
    cuts[n++] = 8 + (size_t)hlen;
    for (size_t i = 0; i < fx.n; i++) {
        cuts[n++] = 8 + (size_t)hlen + (size_t)fx.t[i].begin + 1;
        cuts[n++] = 8 + (size_t)hlen + (size_t)fx.t[i].end - 1;
    }
    uint64_t s = 12345;
    for (int i = 0; i < 40; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        cuts[n++] = (size_t)((s >> 33) % size);
    }
    for (size_t i = 0; i < n; i++) {
        if (cuts[i] >= size)
            continue;
        int rc = open_img(img, cuts[i], msg, sizeof msg);
        ck_assert_msg(rc == QM_EINVALID_MODEL, "cut at %zu of %zu: rc %d", cuts[i], size, rc);
        ck_assert_msg(msg[0] != '\0', "cut at %zu: empty message", cuts[i]);
        if (cuts[i] < 8)
            ck_assert_msg(strstr(msg, "shorter than the 8-byte"), "cut %zu: %s", cuts[i], msg);
        else if (cuts[i] < 8 + hlen)
            ck_assert_msg(strstr(msg, "only"), "cut %zu: %s", cuts[i], msg);
        else
            ck_assert_msg(strstr(msg, "run past the data section"), "cut %zu: %s", cuts[i], msg);
    }
    free(img);
}
END_TEST

START_TEST(test_bank_rejects_header_length_beyond_file_or_absurd)
{
    fx_opts o = fx_default();
    fx_bank fx;
    fx_init(&fx, &o);
    size_t size;
    uint8_t *img = fx_build(&fx, &size, NULL);
    char msg[QM_STATUS_MSG_MAX];
    uint64_t lens[] = {size, size - 7, 1ull << 40, UINT64_MAX};
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        for (int b = 0; b < 8; b++)
            img[b] = (uint8_t)(lens[i] >> (8 * b));
        ck_assert_int_eq(open_img(img, size, msg, sizeof msg), QM_EINVALID_MODEL);
        ck_assert_msg(strstr(msg, "header length"), "%s", msg);
    }
    free(img);
}
END_TEST

START_TEST(test_bank_rejects_invalid_json_and_deep_nesting)
{
    expect_raw_invalid("{\"a\":", 0, "not valid JSON");
    expect_raw_invalid("{\"a\": {\"dtype\": \"U8\"}} trailing", 0, "after the JSON object");
    expect_raw_invalid("[1,2,3]", 0, "does not start with a JSON object");
    expect_raw_invalid("", 0, "does not start with a JSON object");
    char deep[4096];
    size_t n = 0;
    deep[n++] = '{';
    deep[n++] = '"';
    deep[n++] = 'x';
    deep[n++] = '"';
    deep[n++] = ':';
    for (int i = 0; i < 1000; i++)
        deep[n++] = '[';
    deep[n] = '\0';
    expect_raw_invalid(deep, 0, "nested deeper");
    expect_raw_invalid("{\"layers.0.fc1.weight\\u0000x\":{\"dtype\":\"U8\",\"shape\":[2],"
                       "\"data_offsets\":[0,2]}}",
                       2, "escaped NUL");
    expect_raw_invalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2],\"x\":1}}", 2,
                       "unexpected field");
    expect_raw_invalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
                       "\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2,4]}}",
                       4, "appears twice");
    expect_raw_invalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[-2],\"data_offsets\":[0,2]}}", 2,
                       "shape[0] is not an integer");
    expect_raw_invalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[2.5],\"data_offsets\":[0,2]}}", 2,
                       "shape[0] is not an integer");
    expect_raw_invalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,2]}}", 4,
                       "end before they begin");
    expect_raw_invalid("{\"t\":{\"dtype\":\"Q7\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2,
                       "unknown dtype");
    expect_raw_invalid("{\"__metadata__\":{\"qmoe.format\":1}}", 0, "not a string");
    /* A valid container without metadata is not a bank. */
    expect_raw_invalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2,
                       "qmoe.format is missing");
}
END_TEST

START_TEST(test_bank_rejects_overlapping_and_out_of_range_offsets)
{
    fx_opts o = fx_default();
    fx_bank fx;
    fx_init(&fx, &o);
    qm_st_tensor *a = fx_find(&fx, "layers.0.fc2.weight");
    qm_st_tensor *b = fx_find(&fx, "layers.1.fc1.weight");
    uint64_t len = b->end - b->begin;
    b->begin = a->begin + 2;
    b->end = b->begin + len;
    expect_invalid(&fx, "overlap");

    fx_init(&fx, &o);
    for (size_t i = 0; i < fx.n; i++) /* keep the image small: only the header moves */
        fx.data_cap = fx.t[i].end > fx.data_cap ? fx.t[i].end : fx.data_cap;
    a = fx_find(&fx, "layers.1.fc2.weight");
    a->begin += 1ull << 40;
    a->end += 1ull << 40;
    expect_invalid(&fx, "layers.1.fc2.weight: data_offsets");
}
END_TEST

START_TEST(test_bank_rejects_dtype_shape_byte_mismatch)
{
    fx_opts o = fx_default();
    fx_bank fx;
    fx_init(&fx, &o);
    fx_find(&fx, "layers.0.fc1.scales")->shape[2] = 5; /* bytes no longer match */
    expect_invalid(&fx, "layers.0.fc1.scales: shape [4,32,5] of F32 needs 2560 bytes");

    fx_init(&fx, &o);
    snprintf(fx_find(&fx, "layers.0.fc1.bias")->dtype, 16, "%s", "U8");
    expect_invalid(&fx, "needs");

    /* Same byte count, wrong dtype for the role. */
    fx_init(&fx, &o);
    qm_st_tensor *w = fx_find(&fx, "layers.0.fc1.weight"); /* [4,32,32] U8 = 4096 bytes */
    snprintf(w->dtype, 16, "%s", "F32");
    w->shape[2] = 8;
    expect_invalid(&fx, "layers.0.fc1.weight: dtype F32 but it must be U8");

    fx_init(&fx, &o);
    w = fx_find(&fx, "layers.0.fc1.weight");
    snprintf(w->dtype, 16, "%s", "I8");
    expect_invalid(&fx, "layers.0.fc1.weight: dtype I8 but bank tensors are");
}
END_TEST

START_TEST(test_bank_rejects_shape_products_overflowing_64_bits)
{
    expect_raw_invalid("{\"t\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],"
                       "\"data_offsets\":[0,0]}}",
                       0, "overflows 64-bit");
    expect_raw_invalid("{\"t\":{\"dtype\":\"F32\",\"shape\":[9007199254740992,9007199254740992],"
                       "\"data_offsets\":[0,0]}}",
                       0, "overflows 64-bit");
    expect_raw_invalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[1e300],\"data_offsets\":[0,0]}}", 0,
                       "not an integer");
}
END_TEST

START_TEST(test_bank_rejects_missing_or_malformed_metadata)
{
    fx_opts o = fx_default();
    fx_bank fx;
    static const char *required[] = {"qmoe.layers", "qmoe.experts",  "qmoe.hidden_size",
                                     "qmoe.inter_size", "qmoe.k", "qmoe.bits",
                                     "qmoe.block_size", "qmoe.activation"};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
        fx_init(&fx, &o);
        fx_del_meta(&fx, required[i]);
        char needle[96];
        snprintf(needle, sizeof needle, "required key %s is missing", required[i]);
        expect_invalid(&fx, needle);
    }
    static const struct {
        const char *key, *value, *needle;
    } bad[] = {
        {"qmoe.experts", "8x", "qmoe.experts = \"8x\" but it must be an integer in [1, 65536]"},
        {"qmoe.experts", "0", "qmoe.experts = \"0\""},
        {"qmoe.experts", "-4", "must be an integer"},
        {"qmoe.experts", "99999999999", "must be an integer"},
        {"qmoe.k", "5", "qmoe.k = \"5\" but it must be an integer in [1, 4]"},
        {"qmoe.bits", "2", "only 4 and 8"},
        {"qmoe.bits", "16", "qmoe.bits"},
        {"qmoe.block_size", "24", "power of two >= 16"},
        {"qmoe.block_size", "8", "power of two >= 16"},
        {"qmoe.activation", "tanh", "qmoe.activation = \"tanh\""},
        {"qmoe.swiglu_fusion", "3", "qmoe.swiglu_fusion"},
        {"qmoe.normalize_routing_weights", "yes", "qmoe.normalize_routing_weights"},
        {"qmoe.activation_alpha", "nan", "qmoe.activation_alpha"},
        {"qmoe.activation_beta", "inf", "qmoe.activation_beta"},
        {"qmoe.swiglu_limit", "-1", "qmoe.swiglu_limit"},
        {"qmoe.swiglu_limit", "7x", "qmoe.swiglu_limit"},
        {"qmoe.hidden_size", "63", "qmoe.hidden_size"},
        {"qmoe.format", "2", "qmoe.format = \"2\" but this build reads format 1"},
        {"qmoe.format", "1.0", "reads format 1"},
        {"qmoe.codebook", "nf4", "qmoe.codebook = \"nf4\" but the only code book is e2m1"},
        {"qmoe.codebook", "", "qmoe.codebook = \"\""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fx_init(&fx, &o);
        fx_set_meta(&fx, bad[i].key, bad[i].value);
        expect_invalid(&fx, bad[i].needle);
    }
    fx_init(&fx, &o);
    fx_del_meta(&fx, "qmoe.format");
    expect_invalid(&fx, "qmoe.format is missing");
    /* A code book's codes are 4 bits, and its values signed: no zero points. */
    o.bits = 8;
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.codebook", "e2m1");
    expect_invalid(&fx, "qmoe.codebook = e2m1 needs qmoe.bits = 4, not 8");
    o = fx_default();
    o.asymmetric = 1;
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.codebook", "e2m1");
    expect_invalid(&fx, "layers.0.fc1.zero_points: zero points with qmoe.codebook = e2m1");
}
END_TEST

START_TEST(test_bank_opens_a_code_book_bank)
{
    fx_opts o = fx_default();
    fx_bank fx;
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.codebook", "e2m1");
    size_t size;
    uint8_t *img = fx_build(&fx, &size, NULL);
    qm_bank *bank = NULL;
    qm_status st;
    ck_assert_msg(qm_bank_open_memory(img, size, &bank, &st) == 0, "%s", st.msg);
    const qm_bank_config *c = qm_bank_get_config(bank);
    ck_assert_int_eq(c->codebook, QM_CODEBOOK_E2M1);
    ck_assert_uint_eq(c->bits, 4);
    ck_assert_str_eq(qm_codebook_name(c->codebook), "e2m1");
    static const int8_t want[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    ck_assert_mem_eq(qm_codebook_values(c->codebook), want, sizeof want);
    ck_assert_ptr_null(qm_codebook_values(QM_CODEBOOK_NONE));
    qm_bank_close(bank);
    free(img);

    fx_init(&fx, &o); /* without the key: none */
    img = fx_build(&fx, &size, NULL);
    ck_assert_int_eq(qm_bank_open_memory(img, size, &bank, &st), 0);
    ck_assert_int_eq(qm_bank_get_config(bank)->codebook, QM_CODEBOOK_NONE);
    qm_bank_close(bank);
    free(img);
}
END_TEST

START_TEST(test_bank_rejects_wrong_expert_count_in_one_tensor)
{
    fx_opts o = fx_default();
    o.block_size = 0;
    fx_bank fx;
    fx_init(&fx, &o);
    fx_del_tensor(&fx, "layers.1.fc2.scales");
    uint64_t shape[2] = {5, 64};
    fx_add_tensor(&fx, "layers.1.fc2.scales", "F32", shape, 2);
    expect_invalid(&fx, "layers.1.fc2.scales: shape [5,64] but qmoe.experts 4 needs [4,64]");
}
END_TEST

START_TEST(test_bank_names_tensor_and_rule_for_shape_mismatches)
{
    fx_opts o = fx_default();
    o.block_size = 64;
    o.hidden = 4096 / 16;
    o.inter = 4096 / 16;
    fx_bank fx;
    fx_init(&fx, &o);
    fx_del_tensor(&fx, "layers.0.fc2.scales");
    uint64_t s3[3] = {4, 256, 3};
    fx_add_tensor(&fx, "layers.0.fc2.scales", "F32", s3, 3);
    expect_invalid(&fx, "layers.0.fc2.scales: shape [4,256,3] but block_size 64 needs [4,256,4]");

    fx_init(&fx, &o);
    fx_del_tensor(&fx, "layers.0.fc2.scales");
    uint64_t s2[2] = {4, 256};
    fx_add_tensor(&fx, "layers.0.fc2.scales", "F32", s2, 2);
    expect_invalid(&fx, "layers.0.fc2.scales: shape [4,256] but block_size 64 needs [4,256,4]");

    fx_init(&fx, &o);
    fx_del_tensor(&fx, "layers.1.fc1.weight");
    uint64_t w[3] = {4, 256, 256};
    fx_add_tensor(&fx, "layers.1.fc1.weight", "U8", w, 3);
    expect_invalid(&fx, "layers.1.fc1.weight: shape [4,256,256] but hidden_size 256 at 4 bits "
                        "(2 per byte) needs [4,256,128]");

    o = fx_default();
    o.act = QM_ACT_SWIGLU;
    o.fusion = 1;
    fx_init(&fx, &o);
    fx_del_tensor(&fx, "layers.0.fc1.bias");
    uint64_t b[2] = {4, 32};
    fx_add_tensor(&fx, "layers.0.fc1.bias", "F32", b, 2);
    expect_invalid(&fx, "layers.0.fc1.bias: shape [4,32] but 2*inter_size 64 (fused swiglu) "
                        "needs [4,64]");

    o = fx_default();
    o.asymmetric = 1;
    o.block_size = 0;
    fx_init(&fx, &o);
    fx_del_tensor(&fx, "layers.0.fc2.zero_points");
    uint64_t z[2] = {4, 64};
    fx_add_tensor(&fx, "layers.0.fc2.zero_points", "U8", z, 2);
    expect_invalid(&fx, "layers.0.fc2.zero_points: shape [4,64] but hidden_size 64 packed 2 per "
                        "byte needs [4,32]");

    o.block_size = 16;
    fx_init(&fx, &o);
    fx_del_tensor(&fx, "layers.0.fc1.zero_points");
    uint64_t z3[3] = {4, 32, 4};
    fx_add_tensor(&fx, "layers.0.fc1.zero_points", "U8", z3, 3);
    expect_invalid(&fx, "layers.0.fc1.zero_points: shape [4,32,4] but block_size 16 at 4 bits "
                        "needs [4,32,2]");
}
END_TEST

START_TEST(test_bank_rejects_missing_required_and_misplaced_optional_tensors)
{
    fx_opts o = fx_default();
    fx_bank fx;
    fx_init(&fx, &o);
    fx_del_tensor(&fx, "layers.1.fc2.scales");
    expect_invalid(&fx, "layers.1.fc2.scales: missing");

    o.act = QM_ACT_SWIGLU;
    o.fusion = 0;
    fx_init(&fx, &o);
    fx_del_tensor(&fx, "layers.0.fc3.scales");
    expect_invalid(&fx, "layers.0.fc3.scales: missing but activation swiglu with swiglu_fusion 0");

    /* fc3 tensors in a fused bank are an error, not silently ignored. */
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.swiglu_fusion", "2");
    expect_invalid(&fx, "fc1.weight: shape");
    o.fusion = 2;
    fx_init(&fx, &o);
    uint64_t shape[3] = {4, 32, 32};
    fx_add_tensor(&fx, "layers.0.fc3.weight", "U8", shape, 3);
    expect_invalid(&fx, "layers.0.fc3.weight: present but fc3 is used only with");

    o = fx_default();
    o.router = 1;
    fx_init(&fx, &o);
    fx_del_tensor(&fx, "layers.1.router.weight");
    expect_invalid(&fx, "layers.1.router.bias: present without layers.1.router.weight");
}
END_TEST

START_TEST(test_bank_rejects_misaligned_float_tensor)
{
    fx_opts o = fx_default();
    fx_bank fx;
    fx_init(&fx, &o);
    uint64_t one[1] = {1};
    fx_add_tensor(&fx, "pad", "U8", one, 1);
    uint64_t s[1] = {4};
    fx_add_tensor(&fx, "extra.f32", "U8", s, 1);
    qm_st_tensor *t = fx_find(&fx, "extra.f32");
    snprintf(t->dtype, 16, "%s", "F32");
    t->shape[0] = 1; /* 4 bytes, at an odd offset */
    expect_invalid(&fx, "extra.f32: data at offset");
}
END_TEST

START_TEST(test_bank_open_reports_missing_file_and_non_bank_files)
{
    qm_bank *bank = (qm_bank *)1;
    qm_status st;
    ck_assert_int_eq(qm_bank_open("/nonexistent/x.qmoe", &bank, &st), QM_EINVALID_MODEL);
    ck_assert_ptr_null(bank);
    ck_assert_ptr_nonnull(strstr(st.msg, "cannot open bank file /nonexistent/x.qmoe"));
    ck_assert_int_eq(qm_bank_open("/", &bank, &st), QM_EINVALID_MODEL);
    ck_assert_ptr_nonnull(strstr(st.msg, "not a regular file"));
    char path[] = "/tmp/qm_bank_test_XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, "abc", 3), 3);
    close(fd);
    ck_assert_int_eq(qm_bank_open(path, &bank, &st), QM_EINVALID_MODEL);
    ck_assert_ptr_nonnull(strstr(st.msg, "shorter than the 8-byte"));
    /* A real file round trip through mmap. */
    fx_opts o = fx_default();
    fx_bank fx;
    fx_init(&fx, &o);
    size_t size;
    uint8_t *img = fx_build(&fx, &size, NULL);
    FILE *f = fopen(path, "wb");
    ck_assert_uint_eq(fwrite(img, 1, size, f), size);
    fclose(f);
    ck_assert_int_eq(qm_bank_open(path, &bank, &st), 0);
    ck_assert_str_eq(qm_bank_path(bank), path);
    ck_assert_uint_eq(qm_bank_file_bytes(bank), size);
    const qm_tensor_view *tv = &qm_bank_layer(bank, 1)->t[QM_T_FC2_BIAS];
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | img[i];
    ck_assert_int_eq(memcmp(tv->data, img + 8 + hlen + tv->offset, tv->nbytes), 0);
    qm_bank_close(bank);
    qm_bank_close(NULL);
    unlink(path);
    free(img);
}
END_TEST

/* ---- allocation failures ------------------------------------------------------ */

static long fail_at, alloc_n;
static void *fail_malloc(size_t n, void *ud)
{
    (void)ud;
    return ++alloc_n == fail_at ? NULL : malloc(n);
}
static void *fail_realloc(void *p, size_t n, void *ud)
{
    (void)ud;
    return ++alloc_n == fail_at ? NULL : realloc(p, n);
}
static void fail_free(void *p, void *ud)
{
    (void)ud;
    free(p);
}

START_TEST(test_bank_open_survives_every_allocation_failure)
{
    fx_opts o = fx_default();
    o.router = 1;
    o.asymmetric = 1;
    fx_bank fx;
    fx_init(&fx, &o);
    uint64_t s[1] = {3};
    fx_add_tensor(&fx, "unknown.a", "U8", s, 1);
    fx_add_tensor(&fx, "unknown.b", "U8", s, 1);
    size_t size;
    uint8_t *img = fx_build(&fx, &size, NULL);
    qm_alloc_hooks hooks = {fail_malloc, fail_realloc, fail_free, NULL};
    int ok = 0;
    for (fail_at = 1; fail_at < 400 && !ok; fail_at++) {
        alloc_n = 0;
        qm_alloc_set_hooks(&hooks);
        qm_bank *bank = NULL;
        qm_status st;
        int rc = qm_bank_open_memory(img, size, &bank, &st);
        qm_region_catalog *cat = NULL;
        int crc = rc == 0 ? qm_bank_build_catalog(bank, 1, &cat, &st) : -1;
        qm_alloc_set_hooks(NULL);
        if (rc == 0 && alloc_n < fail_at)
            ok = 1; /* no allocation failed: done */
        else if (rc != 0)
            ck_assert_msg(rc == QM_ENOMEM, "fail_at %ld: rc %d (%s)", fail_at, rc, st.msg);
        /* A catalog that ran out of memory says so in its sentence. */
        if (rc == 0 && crc != 0)
            ck_assert_msg(crc == QM_ENOMEM && strstr(st.msg, "out of memory"),
                          "fail_at %ld: catalog rc %d (%s)", fail_at, crc, st.msg);
        qm_catalog_free(cat);
        qm_bank_close(bank);
    }
    ck_assert_msg(ok, "open never succeeded");
    free(img);
}
END_TEST

START_TEST(test_bank_names_and_parsers)
{
    ck_assert_str_eq(qm_dtype_name(QM_DTYPE_BF16), "bf16");
    ck_assert_uint_eq(qm_dtype_size(QM_DTYPE_F16), 2);
    ck_assert_uint_eq(qm_dtype_size(QM_DTYPE_U8), 1);
    ck_assert_str_eq(qm_bank_tensor_suffix(QM_T_FC3_ZERO_POINTS), "fc3.zero_points");
    ck_assert_str_eq(qm_bank_tensor_suffix(QM_T_ROUTER_BIAS), "router.bias");
    ck_assert_ptr_null(qm_bank_tensor_suffix(QM_T_COUNT));
    char buf[32];
    ck_assert_int_eq(qm_bank_tensor_name(12, QM_T_FC2_SCALES, buf, sizeof buf), 0);
    ck_assert_str_eq(buf, "layers.12.fc2.scales");
    ck_assert_int_eq(qm_bank_tensor_name(12, QM_T_FC2_SCALES, buf, 8), QM_EINVAL);
    qm_activation a;
    ck_assert_int_eq(qm_activation_parse("swiglu", &a), 0);
    ck_assert_int_eq(a, QM_ACT_SWIGLU);
    ck_assert_str_eq(qm_activation_name(QM_ACT_IDENTITY), "identity");
    ck_assert_int_eq(qm_activation_parse("SwiGLU", &a), QM_EINVAL);
    qm_tensor_view tv = {.present = 1, .nbytes = 100};
    ck_assert_uint_eq(qm_expert_slice_bytes(&tv, 4), 25);
    tv.present = 0;
    ck_assert_uint_eq(qm_expert_slice_bytes(&tv, 4), 0);
}
END_TEST

static Suite *bank_suite(void)
{
    Suite *s = suite_create("bank");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_bank_opens_default_fixture_with_expected_config);
    tcase_add_test(tc, test_bank_reports_unknown_tensors_as_warnings);
    tcase_add_loop_test(tc, test_bank_catalog_tiles_every_expert_tensor_for_each_variant, 0,
                        (int)(sizeof variants / sizeof variants[0]));
    tcase_add_test(tc, test_bank_catalog_single_expert_is_not_pageable);
    tcase_add_test(tc, test_bank_catalog_reports_misalignment_to_copy_granularity);
    tcase_add_test(tc, test_bank_rejects_every_truncation);
    tcase_add_test(tc, test_bank_rejects_header_length_beyond_file_or_absurd);
    tcase_add_test(tc, test_bank_rejects_invalid_json_and_deep_nesting);
    tcase_add_test(tc, test_bank_rejects_overlapping_and_out_of_range_offsets);
    tcase_add_test(tc, test_bank_rejects_dtype_shape_byte_mismatch);
    tcase_add_test(tc, test_bank_rejects_shape_products_overflowing_64_bits);
    tcase_add_test(tc, test_bank_rejects_missing_or_malformed_metadata);
    tcase_add_test(tc, test_bank_opens_a_code_book_bank);
    tcase_add_test(tc, test_bank_rejects_wrong_expert_count_in_one_tensor);
    tcase_add_test(tc, test_bank_names_tensor_and_rule_for_shape_mismatches);
    tcase_add_test(tc, test_bank_rejects_missing_required_and_misplaced_optional_tensors);
    tcase_add_test(tc, test_bank_rejects_misaligned_float_tensor);
    tcase_add_test(tc, test_bank_open_reports_missing_file_and_non_bank_files);
    tcase_add_test(tc, test_bank_open_survives_every_allocation_failure);
    tcase_add_test(tc, test_bank_names_and_parsers);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(bank_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
