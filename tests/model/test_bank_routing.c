/* test_bank_routing.c - the metadata of banks imported from real models
 * (BANK_FORMAT.md "Banks imported from real models"): qmoe.routing.*,
 * layers.l.router.correction_bias, qmoe.layer_map, qmoe.source. A bank
 * without them keeps the legacy rule; every bad value is invalid_model with
 * a sentence naming the key. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bank_fixture.h"
#include "qm_bank.h"

static int open_fx(const fx_bank *fx, qm_bank **bank, char *msg, size_t msg_size,
                   uint8_t **img_out)
{
    size_t size;
    uint8_t *img = fx_build(fx, &size, NULL);
    qm_status st;
    qm_status_clear(&st);
    *bank = NULL;
    int rc = qm_bank_open_memory(img, size, bank, &st);
    snprintf(msg, msg_size, "%s", st.msg);
    *img_out = img;
    return rc;
}

static void expect_invalid(const fx_bank *fx, const char *needle)
{
    char msg[QM_STATUS_MSG_MAX];
    qm_bank *bank;
    uint8_t *img;
    int rc = open_fx(fx, &bank, msg, sizeof msg, &img);
    qm_bank_close(bank);
    free(img);
    ck_assert_msg(rc == QM_EINVALID_MODEL, "expected invalid_model, got %d (%s)", rc, msg);
    ck_assert_msg(strstr(msg, needle) != NULL, "message \"%s\" lacks \"%s\"", msg, needle);
}

static void with_meta(const char *key, const char *value, const char *needle)
{
    fx_bank fx;
    fx_opts o = fx_default();
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.routing.score", "sigmoid");
    fx_set_meta(&fx, key, value);
    expect_invalid(&fx, needle);
}

START_TEST(test_bank_without_routing_keys_keeps_the_legacy_rule)
{
    fx_bank fx;
    fx_opts o = fx_default();
    fx_init(&fx, &o);
    char msg[QM_STATUS_MSG_MAX];
    qm_bank *bank;
    uint8_t *img;
    ck_assert_msg(open_fx(&fx, &bank, msg, sizeof msg, &img) == 0, "%s", msg);
    const qm_bank_config *c = qm_bank_get_config(bank);
    ck_assert_int_eq(c->routing.score, QM_ROUTE_SCORE_LEGACY);
    ck_assert_ptr_null(qm_bank_layer_map(bank));
    ck_assert_ptr_null(qm_bank_source_json(bank));
    ck_assert(!qm_bank_layer(bank, 0)->t[QM_T_ROUTER_CORRECTION_BIAS].present);
    qm_bank_close(bank);
    free(img);
}
END_TEST

START_TEST(test_bank_reads_routing_layer_map_source_and_correction_bias)
{
    fx_bank fx;
    fx_opts o = fx_default();
    o.experts = 8;
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.routing.score", "sigmoid");
    fx_set_meta(&fx, "qmoe.routing.normalize", "0");
    fx_set_meta(&fx, "qmoe.routing.scale", "2.5");
    fx_set_meta(&fx, "qmoe.routing.groups", "4");
    fx_set_meta(&fx, "qmoe.routing.topk_groups", "2");
    fx_set_meta(&fx, "qmoe.routing.group_score", "top2_sum");
    fx_set_meta(&fx, "qmoe.layer_map", "[3, 7]");
    fx_set_meta(&fx, "qmoe.source", "{\"format\":\"gguf\",\"exact\":false,\"max_rel_err\":0.01}");
    uint64_t shape[1] = {8};
    fx_add_tensor(&fx, "layers.1.router.correction_bias", "F32", shape, 1);
    char msg[QM_STATUS_MSG_MAX];
    qm_bank *bank;
    uint8_t *img;
    ck_assert_msg(open_fx(&fx, &bank, msg, sizeof msg, &img) == 0, "%s", msg);
    const qm_routing_rule *r = &qm_bank_get_config(bank)->routing;
    ck_assert_int_eq(r->score, QM_ROUTE_SCORE_SIGMOID);
    ck_assert_int_eq(r->normalize, 0);
    ck_assert(r->scale == 2.5f);
    ck_assert_uint_eq(r->groups, 4);
    ck_assert_uint_eq(r->topk_groups, 2);
    ck_assert_int_eq(r->group_score, QM_GROUP_SCORE_TOP2_SUM);
    const uint32_t *map = qm_bank_layer_map(bank);
    ck_assert_ptr_nonnull(map);
    ck_assert_uint_eq(map[0], 3);
    ck_assert_uint_eq(map[1], 7);
    ck_assert_str_eq(qm_bank_source_json(bank),
                     "{\"format\":\"gguf\",\"exact\":false,\"max_rel_err\":0.01}");
    const qm_tensor_view *cb = &qm_bank_layer(bank, 1)->t[QM_T_ROUTER_CORRECTION_BIAS];
    ck_assert(cb->present && cb->dtype == QM_DTYPE_F32 && cb->shape[0] == 8);
    ck_assert(!qm_bank_layer(bank, 0)->t[QM_T_ROUTER_CORRECTION_BIAS].present);
    ck_assert_str_eq(qm_route_score_name(r->score), "sigmoid");
    ck_assert_str_eq(qm_group_score_name(r->group_score), "top2_sum");
    qm_bank_close(bank);
    free(img);
}
END_TEST

START_TEST(test_bank_routing_defaults_with_score_only)
{
    fx_bank fx;
    fx_opts o = fx_default();
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.routing.score", "softmax");
    char msg[QM_STATUS_MSG_MAX];
    qm_bank *bank;
    uint8_t *img;
    ck_assert_msg(open_fx(&fx, &bank, msg, sizeof msg, &img) == 0, "%s", msg);
    const qm_routing_rule *r = &qm_bank_get_config(bank)->routing;
    ck_assert_int_eq(r->score, QM_ROUTE_SCORE_SOFTMAX);
    ck_assert_int_eq(r->normalize, 1);
    ck_assert(r->scale == 1.0f);
    ck_assert_uint_eq(r->groups, 1);
    ck_assert_uint_eq(r->topk_groups, 1);
    ck_assert_int_eq(r->group_score, QM_GROUP_SCORE_MAX);
    qm_bank_close(bank);
    free(img);
}
END_TEST

START_TEST(test_bank_rejects_bad_routing_keys_naming_them)
{
    with_meta("qmoe.routing.score", "tanh", "qmoe.routing.score = \"tanh\"");
    with_meta("qmoe.routing.normalize", "2", "qmoe.routing.normalize = \"2\"");
    with_meta("qmoe.routing.normalize", "yes", "qmoe.routing.normalize");
    with_meta("qmoe.routing.scale", "0", "qmoe.routing.scale = \"0\" but it must be a finite");
    with_meta("qmoe.routing.scale", "nan", "qmoe.routing.scale");
    with_meta("qmoe.routing.scale", "inf", "qmoe.routing.scale");
    with_meta("qmoe.routing.scale", "2.5x", "qmoe.routing.scale");
    with_meta("qmoe.routing.groups", "3", "qmoe.routing.groups = 3 does not divide");
    with_meta("qmoe.routing.groups", "0", "qmoe.routing.groups = \"0\"");
    with_meta("qmoe.routing.groups", "5", "qmoe.routing.groups = \"5\"");
    with_meta("qmoe.routing.group_score", "median", "qmoe.routing.group_score = \"median\"");
    with_meta("qmoe.routing.bias", "1", "unknown routing key qmoe.routing.bias");
    /* 4 groups of 1 expert: top2 has no second; 1 group kept holds 1 < k = 2. */
    fx_bank fx;
    fx_opts o = fx_default();
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.routing.score", "sigmoid");
    fx_set_meta(&fx, "qmoe.routing.groups", "4");
    fx_set_meta(&fx, "qmoe.routing.group_score", "top2_sum");
    expect_invalid(&fx, "qmoe.routing.group_score = top2_sum needs at least 2");
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.routing.score", "sigmoid");
    fx_set_meta(&fx, "qmoe.routing.groups", "4");
    fx_set_meta(&fx, "qmoe.routing.topk_groups", "1");
    expect_invalid(&fx, "qmoe.routing.topk_groups = 1 keeps 1 experts");
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.routing.score", "sigmoid");
    fx_set_meta(&fx, "qmoe.routing.groups", "2");
    fx_set_meta(&fx, "qmoe.routing.topk_groups", "3");
    expect_invalid(&fx, "qmoe.routing.topk_groups = \"3\"");
    /* A routing key without the score would route the old way silently. */
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.routing.normalize", "0");
    expect_invalid(&fx, "qmoe.routing.normalize is set but qmoe.routing.score is missing");
}
END_TEST

START_TEST(test_bank_rejects_bad_layer_map_and_source_naming_them)
{
    with_meta("qmoe.layer_map", "[1]", "qmoe.layer_map has 1 entries but qmoe.layers is 2");
    with_meta("qmoe.layer_map", "[1, 2, 3]", "qmoe.layer_map has 3 entries");
    with_meta("qmoe.layer_map", "[2, 2]", "qmoe.layer_map[1] = 2 but the map must be strictly");
    with_meta("qmoe.layer_map", "[-1, 2]", "qmoe.layer_map[0] must be an integer");
    with_meta("qmoe.layer_map", "[0, 1.5]", "qmoe.layer_map[1] must be an integer");
    with_meta("qmoe.layer_map", "[0, \"1\"]", "qmoe.layer_map[1] must be an integer");
    with_meta("qmoe.layer_map", "3,4", "qmoe.layer_map = \"3,4\" but it must be a JSON list");
    with_meta("qmoe.layer_map", "[0, 1] x", "qmoe.layer_map");
    with_meta("qmoe.source", "[]", "qmoe.source = \"[]\" but it must be a JSON object");
    with_meta("qmoe.source", "{\"format\":\"pt\"}", "qmoe.source.format must be");
    with_meta("qmoe.source", "{\"family\":3}", "qmoe.source.family must be a string");
    with_meta("qmoe.source", "{\"files\":[\"a\",1]}", "qmoe.source.files must be a list");
    with_meta("qmoe.source", "{\"exact\":1}", "qmoe.source.exact must be true or false");
    with_meta("qmoe.source", "{\"max_rel_err\":-1}", "qmoe.source.max_rel_err must be");
    with_meta("qmoe.source", "{\"exact\":true", "qmoe.source = ");
}
END_TEST

START_TEST(test_bank_rejects_bad_correction_bias)
{
    fx_bank fx;
    fx_opts o = fx_default();
    uint64_t shape[2] = {4, 1};
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.routing.score", "sigmoid");
    fx_add_tensor(&fx, "layers.0.router.correction_bias", "F16", shape, 1);
    expect_invalid(&fx, "layers.0.router.correction_bias: dtype F16 but it must be F32");
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.routing.score", "sigmoid");
    shape[0] = 5;
    fx_add_tensor(&fx, "layers.0.router.correction_bias", "F32", shape, 1);
    expect_invalid(&fx, "layers.0.router.correction_bias: shape [5]");
    fx_init(&fx, &o);
    fx_set_meta(&fx, "qmoe.routing.score", "sigmoid");
    shape[0] = 4;
    fx_add_tensor(&fx, "layers.0.router.correction_bias", "F32", shape, 2);
    expect_invalid(&fx, "layers.0.router.correction_bias: shape [4,1]");
    fx_init(&fx, &o);
    fx_add_tensor(&fx, "layers.1.router.correction_bias", "F32", shape, 1);
    expect_invalid(&fx, "layers.1.router.correction_bias: present but the bank has no "
                        "qmoe.routing.score");
}
END_TEST

static Suite *routing_suite(void)
{
    Suite *s = suite_create("bank_routing");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_bank_without_routing_keys_keeps_the_legacy_rule);
    tcase_add_test(tc, test_bank_reads_routing_layer_map_source_and_correction_bias);
    tcase_add_test(tc, test_bank_routing_defaults_with_score_only);
    tcase_add_test(tc, test_bank_rejects_bad_routing_keys_naming_them);
    tcase_add_test(tc, test_bank_rejects_bad_layer_map_and_source_naming_them);
    tcase_add_test(tc, test_bank_rejects_bad_correction_bias);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(routing_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
