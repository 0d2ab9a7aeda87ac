/* test_params_topk.c - session.infer's routing supplied by the engine on the
 * wire (PROTOCOL.md): the i32 tensor dtype, topk_ids + topk_weights both or
 * neither, never with router_logits, shapes agreeing; each error -32602
 * naming the field. The ids against the model's E are the daemon's check. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_protocol.h"

#define HIDDEN "\"hidden\":{\"dtype\":\"f32\",\"shape\":[1,2],\"data\":\"AACAPwAAAMA=\"}"
#define IDS "\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[1,2],\"data\":\"AAAAAAEAAAA=\"}"
#define WTS "\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[1,2],\"data\":\"AACAPwAAAMA=\"}"
#define LOGITS "\"router_logits\":{\"dtype\":\"f32\",\"shape\":[1,2],\"data\":\"AACAPwAAAMA=\"}"

static int decode_infer(const char *params, qm_request *out, char *field, char *msg)
{
    char line[2048];
    snprintf(line, sizeof line,
             "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"session.infer\",\"params\":{"
             "\"session\":\"s\",\"layer\":0,%s}}",
             params);
    qm_proto_limits lim;
    qm_proto_limits_default(&lim);
    qm_rpc_frame f;
    ck_assert_int_eq(qm_rpc_decode(line, strlen(line), &lim, &f), 0);
    int code = f.items[0].ok ? 0 : f.items[0].rpc_code;
    if (field)
        snprintf(field, 64, "%s", f.items[0].ok ? "" : f.items[0].status.field);
    if (msg)
        snprintf(msg, QM_STATUS_MSG_MAX, "%s", f.items[0].ok ? "" : f.items[0].status.msg);
    if (out && f.items[0].ok) {
        *out = f.items[0].req;
        memset(&f.items[0].req, 0, sizeof f.items[0].req);
    }
    qm_rpc_frame_free(&f);
    return code;
}

static void expect_bad(const char *params, const char *want_field, const char *needle)
{
    char field[64], msg[QM_STATUS_MSG_MAX];
    int code = decode_infer(params, NULL, field, msg);
    ck_assert_msg(code == -32602, "%s: code %d (%s)", params, code, msg);
    ck_assert_str_eq(field, want_field);
    ck_assert_msg(strstr(msg, needle), "message \"%s\" lacks \"%s\"", msg, needle);
}

START_TEST(test_infer_decodes_topk_ids_and_weights)
{
    qm_request req;
    char msg[QM_STATUS_MSG_MAX];
    ck_assert_msg(decode_infer(HIDDEN "," IDS "," WTS, &req, NULL, msg) == 0, "%s", msg);
    ck_assert_int_eq(req.params.has_topk, 1);
    ck_assert_int_eq(req.params.has_router_logits, 0);
    ck_assert_int_eq(req.params.topk_ids.dtype, QM_WIRE_I32);
    ck_assert_uint_eq(req.params.topk_ids.nbytes, 8);
    const int32_t *ids = req.params.topk_ids.data;
    ck_assert_int_eq(ids[0], 0);
    ck_assert_int_eq(ids[1], 1);
    ck_assert_int_eq(req.params.topk_weights.dtype, QM_WIRE_F32);
    qm_request_free(&req);
    /* Neither: no supplied routing. */
    ck_assert_int_eq(decode_infer(HIDDEN, &req, NULL, msg), 0);
    ck_assert_int_eq(req.params.has_topk, 0);
    qm_request_free(&req);
    /* bf16 weights. */
    ck_assert_int_eq(
        decode_infer(HIDDEN "," IDS ",\"topk_weights\":{\"dtype\":\"bf16\",\"shape\":[1,2],"
                            "\"data\":\"gD8AwA==\"}",
                     &req, NULL, msg),
        0);
    ck_assert_int_eq(req.params.topk_weights.dtype, QM_WIRE_BF16);
    qm_request_free(&req);
}
END_TEST

START_TEST(test_infer_topk_rules_name_the_field)
{
    expect_bad(HIDDEN "," IDS, "topk_weights", "topk_weights is required with topk_ids");
    expect_bad(HIDDEN "," WTS, "topk_ids", "topk_ids is required with topk_weights");
    expect_bad(HIDDEN "," IDS "," WTS "," LOGITS, "router_logits",
               "router_logits must be absent when topk_ids and topk_weights are given");
    expect_bad(HIDDEN ",\"topk_ids\":{\"dtype\":\"f32\",\"shape\":[1,2],\"data\":\"AAAAAAEAAAA=\"},"
                      WTS,
               "topk_ids.dtype", "topk_ids.dtype 'f32' is not one of i32");
    expect_bad(HIDDEN "," IDS ",\"topk_weights\":{\"dtype\":\"i32\",\"shape\":[1,2],"
                      "\"data\":\"AAAAAAEAAAA=\"}",
               "topk_weights.dtype", "topk_weights.dtype 'i32' is not one of f32, f16, bf16");
    expect_bad("\"hidden\":{\"dtype\":\"i32\",\"shape\":[1,2],\"data\":\"AAAAAAEAAAA=\"}",
               "hidden.dtype", "hidden.dtype 'i32' is not one of f32, f16, bf16");
}
END_TEST

START_TEST(test_infer_topk_shapes_must_agree)
{
    expect_bad(HIDDEN ",\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[2,1],\"data\":\"AAAAAAEAAAA=\"},"
                      WTS,
               "topk_ids.shape", "topk_ids.shape[0] is 2 but hidden has 1 tokens");
    expect_bad(HIDDEN ",\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[1,0],\"data\":\"\"},"
                      "\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[1,0],\"data\":\"\"}",
               "topk_ids.shape", "topk_ids.shape[1] is 0");
    expect_bad(HIDDEN "," IDS ",\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[2,1],"
                      "\"data\":\"AACAPwAAAMA=\"}",
               "topk_weights.shape", "topk_weights.shape is [2, 1] but topk_ids.shape is [1, 2]");
    expect_bad(HIDDEN ",\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[2],\"data\":\"AAAAAAEAAAA=\"},"
                      WTS,
               "topk_ids.shape", "topk_ids.shape has 1 dimensions; expected 2");
    expect_bad(HIDDEN ",\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[1,2],\"data\":\"AAAAAA==\"},"
                      WTS,
               "topk_ids.data", "topk_ids.data holds 4 bytes but shape x i32 needs 8");
}
END_TEST

START_TEST(test_tensor_codec_reads_and_writes_i32)
{
    qm_tensor t;
    qm_status st = {0};
    const char *json = "{\"dtype\":\"i32\",\"shape\":[1,2],\"data\":\"AAAAAAEAAAA=\"}";
    ck_assert_msg(qm_tensor_decode_json(json, strlen(json), &t, &st) == 0, "%s", st.msg);
    ck_assert_int_eq(t.dtype, QM_WIRE_I32);
    ck_assert_str_eq(qm_wire_dtype_name(t.dtype), "i32");
    ck_assert_uint_eq(qm_wire_dtype_size(t.dtype), 4);
    qm_buf b = {0};
    qm_jw w;
    qm_jw_init(&w, &b);
    qm_jw_tensor(&w, QM_WIRE_I32, t.ndim, t.shape, t.data);
    ck_assert_int_eq(b.len, strlen(json));
    ck_assert(memcmp(b.data, json, b.len) == 0);
    qm_buf_free(&b);
    qm_tensor_free(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("params_topk");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_infer_decodes_topk_ids_and_weights);
    tcase_add_test(tc, test_infer_topk_rules_name_the_field);
    tcase_add_test(tc, test_infer_topk_shapes_must_agree);
    tcase_add_test(tc, test_tensor_codec_reads_and_writes_i32);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
