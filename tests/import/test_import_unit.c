/* test_import_unit.c - the pieces under `qmoe-bank import`: config.json /
 * index.json lookups (protocol/qm_hf_config) and import_common's element
 * conversions and round-to-nearest quantisation. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "import_elements.h"
#include "qm_alloc.h"
#include "qm_half.h"
#include "qm_hf_config.h"

static qm_hf_json *parse(const char *text)
{
    qm_hf_json *j = NULL;
    qm_status st;
    qm_status_clear(&st);
    ck_assert_int_eq(qm_hf_json_parse(text, strlen(text), "config.json", &j, &st), 0);
    return j;
}

START_TEST(test_hf_json_typed_lookups_walk_nested_objects)
{
    qm_hf_json *j = parse("{\"hidden_size\": 64, \"norm_topk_prob\": true, \"model_type\": "
                          "\"qwen3_moe\", \"architectures\": [\"Qwen3MoeForCausalLM\"], "
                          "\"quantization_config\": {\"quant_method\": \"fp8\", "
                          "\"weight_block_size\": [128, 64]}, \"n_group\": null}");
    qm_status st;
    qm_status_clear(&st);
    double v = 0;
    int b = 0;
    const char *s = NULL;
    size_t n = 0;
    ck_assert_int_eq(qm_hf_json_number(j, "hidden_size", &v, &st), 0);
    ck_assert(v == 64);
    ck_assert_int_eq(qm_hf_json_bool(j, "norm_topk_prob", &b, &st), 0);
    ck_assert_int_eq(b, 1);
    ck_assert_int_eq(qm_hf_json_string(j, "quantization_config/quant_method", &s, &st), 0);
    ck_assert_str_eq(s, "fp8");
    ck_assert_int_eq(qm_hf_json_array_len(j, "quantization_config/weight_block_size", &n, &st), 0);
    ck_assert_uint_eq(n, 2);
    ck_assert_int_eq(
        qm_hf_json_array_number(j, "quantization_config/weight_block_size", 1, &v, &st), 0);
    ck_assert(v == 64);
    ck_assert_int_eq(qm_hf_json_array_string(j, "architectures", 0, &s, &st), 0);
    ck_assert_str_eq(s, "Qwen3MoeForCausalLM");
    /* absent, null and past the end are "not found"; never an error */
    ck_assert_int_eq(qm_hf_json_number(j, "num_experts", &v, &st), QM_ENOT_FOUND);
    ck_assert_int_eq(qm_hf_json_number(j, "n_group", &v, &st), QM_ENOT_FOUND);
    ck_assert_int_eq(qm_hf_json_array_string(j, "architectures", 1, &s, &st), QM_ENOT_FOUND);
    ck_assert_int_eq(qm_hf_json_string(j, "hidden_size/x", &s, &st), QM_ENOT_FOUND);
    qm_hf_json_free(j);
}
END_TEST

START_TEST(test_hf_json_wrong_types_name_the_file_and_key)
{
    qm_hf_json *j = parse("{\"hidden_size\": \"64\", \"norm_topk_prob\": 1, \"architectures\": "
                          "[3], \"weight_map\": {\"a\": \"x.safetensors\", \"b\": 7}}");
    qm_status st;
    qm_status_clear(&st);
    double v;
    int b;
    const char *s;
    const char **names, **values;
    size_t n;
    ck_assert_int_eq(qm_hf_json_number(j, "hidden_size", &v, &st), QM_EINVAL);
    ck_assert_str_eq(st.msg, "config.json: key \"hidden_size\" must be a number");
    ck_assert_int_eq(qm_hf_json_bool(j, "norm_topk_prob", &b, &st), QM_EINVAL);
    ck_assert_str_eq(st.msg, "config.json: key \"norm_topk_prob\" must be true or false");
    ck_assert_int_eq(qm_hf_json_array_string(j, "architectures", 0, &s, &st), QM_EINVAL);
    ck_assert_int_eq(qm_hf_json_string_map(j, "weight_map", &names, &values, &n, &st), QM_EINVAL);
    ck_assert_msg(strstr(st.msg, "\"b\" must be a string"), "%s", st.msg);
    qm_hf_json_free(j);
}
END_TEST

START_TEST(test_hf_json_string_map_lists_an_index)
{
    qm_hf_json *j = parse("{\"metadata\": {}, \"weight_map\": {\"t.a\": \"m-1.safetensors\", "
                          "\"t.b\": \"m-2.safetensors\"}}");
    qm_status st;
    const char **names, **values;
    size_t n;
    ck_assert_int_eq(qm_hf_json_string_map(j, "weight_map", &names, &values, &n, &st), 0);
    ck_assert_uint_eq(n, 2);
    ck_assert_str_eq(names[1], "t.b");
    ck_assert_str_eq(values[1], "m-2.safetensors");
    qm_free(names);
    qm_free(values);
    qm_hf_json_free(j);
}
END_TEST

START_TEST(test_hf_json_rejects_bad_text_with_the_file_name)
{
    static const char *bad[] = {"", "[1, 2]", "{\"a\": ", "{\"a\": [[[[[[[[[[1]]]]]]]]]]}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        qm_hf_json *j = (qm_hf_json *)1;
        qm_status st;
        qm_status_clear(&st);
        ck_assert_int_eq(qm_hf_json_parse(bad[i], strlen(bad[i]), "index.json", &j, &st),
                         QM_EPARSE);
        ck_assert_ptr_null(j);
        ck_assert_msg(strncmp(st.msg, "index.json: ", 12) == 0, "%s", st.msg);
    }
}
END_TEST

START_TEST(test_element_conversions_match_their_formats)
{
    ck_assert(qm_bf16_to_f32(0x3f80) == 1.0f);
    ck_assert(qm_f16_to_f32(0x3c00) == 1.0f);
    ck_assert(qm_f16_to_f32(0x0001) == ldexpf(1, -24)); /* smallest subnormal */
    ck_assert(qm_f16_to_f32(0xc000) == -2.0f);
    /* e4m3fn: bias 7, 3 mantissa bits, no infinities, 0x7f NaN, max 448 */
    ck_assert(qm__e4m3_to_f32(0x38) == 1.0f);
    ck_assert(qm__e4m3_to_f32(0x7e) == 448.0f);
    ck_assert(qm__e4m3_to_f32(0xfe) == -448.0f);
    ck_assert(qm__e4m3_to_f32(0x01) == ldexpf(1, -9));
    ck_assert(isnan(qm__e4m3_to_f32(0x7f)));
    ck_assert(qm__e4m3_to_f32(0x78) == 256.0f);
    /* round trips and ties to even */
    for (uint32_t h = 0; h < 0x7c00; h++)
        ck_assert_uint_eq(qm_f32_to_f16(qm_f16_to_f32((uint16_t)h)), h);
    ck_assert_uint_eq(qm_f32_to_bf16(1.0f + ldexpf(1, -8)), 0x3f80); /* tie -> even */
    ck_assert_uint_eq(qm_f32_to_bf16(1.0f + 3 * ldexpf(1, -8)), 0x3f82);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("import_unit");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_hf_json_typed_lookups_walk_nested_objects);
    tcase_add_test(tc, test_hf_json_wrong_types_name_the_file_and_key);
    tcase_add_test(tc, test_hf_json_string_map_lists_an_index);
    tcase_add_test(tc, test_hf_json_rejects_bad_text_with_the_file_name);
    tcase_add_test(tc, test_element_conversions_match_their_formats);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
