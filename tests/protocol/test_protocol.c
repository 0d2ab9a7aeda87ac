/* test_protocol.c - the wire protocol as a specification: framing, nesting,
 * JSON-RPC envelopes and batches, params validation, tensors, responses. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "qm_alloc.h"
#include "qm_json.h"
#include "qm_json_pick.h"
#include "qm_name_groups.h"
#include "qm_protocol.h"

static qm_proto_limits lim(void)
{
    qm_proto_limits l;
    qm_proto_limits_default(&l);
    return l;
}

static qm_rpc_frame decode(const char *s)
{
    qm_proto_limits l = lim();
    qm_rpc_frame f;
    ck_assert_int_eq(qm_rpc_decode(s, strlen(s), &l, &f), 0);
    ck_assert_uint_ge(f.n, 1);
    return f;
}

/* Decodes one request and returns its error code (0 when it decoded). */
static int decode_code(const char *s, char *field, size_t field_size)
{
    qm_rpc_frame f = decode(s);
    int code = f.items[0].ok ? 0 : f.items[0].rpc_code;
    if (field)
        snprintf(field, field_size, "%s", f.items[0].ok ? "" : f.items[0].status.field);
    qm_rpc_frame_free(&f);
    return code;
}

/* ---- framing ---- */

START_TEST(test_framer_splits_lines_and_skips_blank_ones)
{
    qm_framer f;
    qm_framer_init(&f, 100);
    const char *in = "{\"a\":1}\n\n  \r\n{\"b\"";
    ck_assert_int_eq(qm_framer_push(&f, in, strlen(in)), 0);
    const char *line;
    size_t len;
    ck_assert_int_eq(qm_framer_next(&f, &line, &len), 1);
    ck_assert_uint_eq(len, 7);
    ck_assert(memcmp(line, "{\"a\":1}", 7) == 0);
    ck_assert_int_eq(qm_framer_next(&f, &line, &len), 0);
    ck_assert_int_eq(qm_framer_push(&f, ":2}\n", 4), 0);
    ck_assert_int_eq(qm_framer_next(&f, &line, &len), 1);
    ck_assert_uint_eq(len, 7);
    ck_assert(memcmp(line, "{\"b\":2}", 7) == 0);
    ck_assert_uint_eq(qm_framer_buffered(&f), 0);
    qm_framer_free(&f);
}
END_TEST

START_TEST(test_framer_reassembles_byte_by_byte)
{
    qm_framer f;
    qm_framer_init(&f, 64);
    const char *in = "[1,2,3]\n[4]\n";
    int lines = 0;
    for (size_t i = 0; i < strlen(in); i++) {
        ck_assert_int_eq(qm_framer_push(&f, in + i, 1), 0);
        const char *line;
        size_t len;
        while (qm_framer_next(&f, &line, &len) == 1)
            lines++;
    }
    ck_assert_int_eq(lines, 2);
    qm_framer_free(&f);
}
END_TEST

START_TEST(test_framer_rejects_partial_line_over_cap_before_newline)
{
    qm_framer f;
    qm_framer_init(&f, 10);
    ck_assert_int_eq(qm_framer_push(&f, "0123456789", 10), 0); /* exactly the cap */
    ck_assert_int_eq(qm_framer_push(&f, "x", 1), QM_EPAYLOAD_TOO_LARGE);
    ck_assert_uint_eq(qm_framer_buffered(&f), 0); /* nothing kept */
    const char *line;
    size_t len;
    ck_assert_int_eq(qm_framer_next(&f, &line, &len), QM_EPAYLOAD_TOO_LARGE); /* sticky */
    ck_assert_int_eq(qm_framer_push(&f, "\n", 1), QM_EPAYLOAD_TOO_LARGE);
    qm_framer_free(&f);
}
END_TEST

START_TEST(test_framer_accepts_line_of_exactly_cap_and_rejects_complete_line_over)
{
    qm_framer f;
    qm_framer_init(&f, 4);
    const char *line;
    size_t len;
    ck_assert_int_eq(qm_framer_push(&f, "abcd\nabcde\n", 11), 0);
    ck_assert_int_eq(qm_framer_next(&f, &line, &len), 1);
    ck_assert_uint_eq(len, 4);
    ck_assert_int_eq(qm_framer_next(&f, &line, &len), QM_EPAYLOAD_TOO_LARGE);
    qm_framer_free(&f);
}
END_TEST

START_TEST(test_depth_ignores_brackets_inside_strings)
{
    const char *s = "{\"a\":\"[[[[{{{{\\\"]]\",\"b\":[[1]]}";
    ck_assert_int_eq(qm_json_depth(s, strlen(s), 3), 3);
    ck_assert_int_eq(qm_json_depth(s, strlen(s), 2), -1);
}
END_TEST

START_TEST(test_nesting_at_limit_passes_and_one_beyond_is_invalid_request)
{
    char buf[512];
    qm_proto_limits l = lim();
    l.max_nesting = 5;
    /* params at depth 2, so 3 more levels inside a member reach 5. */
    snprintf(buf, sizeof buf,
             "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"daemon.status\",\"params\":{\"x\":[[[1]]]}}");
    qm_rpc_frame f;
    ck_assert_int_eq(qm_rpc_decode(buf, strlen(buf), &l, &f), 0);
    ck_assert_int_eq(f.items[0].rpc_code, QM_RPC_INVALID_PARAMS); /* parsed: x is unknown */
    ck_assert_int_eq(f.limit, QM_PROTO_LIMIT_NONE);
    qm_rpc_frame_free(&f);
    snprintf(buf, sizeof buf,
             "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"daemon.status\",\"params\":{\"x\":[[[[1]]]]}}");
    ck_assert_int_eq(qm_rpc_decode(buf, strlen(buf), &l, &f), 0);
    ck_assert_int_eq(f.items[0].rpc_code, QM_RPC_INVALID_REQUEST);
    ck_assert_ptr_null(f.items[0].req.id);
    ck_assert_int_eq(f.limit, QM_PROTO_LIMIT_NESTING);
    qm_rpc_frame_free(&f);
}
END_TEST

/* The daemon counts limit hits from the frame's code: an error whose text
 * merely names a limit (an unknown member called max_nesting) is none. */
START_TEST(test_limit_code_names_the_broken_limit_not_the_text)
{
    qm_proto_limits l = lim();
    qm_rpc_frame f;
    const char *named = "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"daemon.status\","
                        "\"max_nesting\":1,\"max_batch\":2}";
    ck_assert_int_eq(qm_rpc_decode(named, strlen(named), &l, &f), 0);
    ck_assert_int_eq(f.items[0].rpc_code, QM_RPC_INVALID_REQUEST);
    ck_assert_ptr_nonnull(strstr(f.items[0].status.msg, "max_nesting"));
    ck_assert_int_eq(f.limit, QM_PROTO_LIMIT_NONE);
    qm_rpc_frame_free(&f);
    l.max_request_bytes = 8;
    const char *big = "{\"jsonrpc\":\"2.0\"}";
    ck_assert_int_eq(qm_rpc_decode(big, strlen(big), &l, &f), 0);
    ck_assert_int_eq(f.items[0].rpc_code, QM_RPC_PAYLOAD_TOO_LARGE);
    ck_assert_int_eq(f.limit, QM_PROTO_LIMIT_REQUEST_BYTES);
    qm_rpc_frame_free(&f);
}
END_TEST

#define REQ(method, params)                                                                        \
    "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"" method "\",\"params\":" params "}"

START_TEST(test_prescan_refuses_what_cjson_would_forgive)
{
    /* Control bytes outside strings, raw control bytes inside them, numbers
     * strtod takes but JSON does not: parse errors. */
    ck_assert_int_eq(decode_code("\x01{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"daemon.status\"}",
                                 NULL, 0),
                     QM_RPC_PARSE_ERROR);
    ck_assert_int_eq(decode_code("{\"jsonrpc\":\"2.0\",\"id\":\"a\x02\",\"method\":\"daemon.status\"}",
                                 NULL, 0),
                     QM_RPC_PARSE_ERROR);
    const char *bad_numbers[] = {"01", "-01", "1.", "0x10", "1e", "-", "1.5e+"};
    for (size_t i = 0; i < sizeof bad_numbers / sizeof bad_numbers[0]; i++) {
        char buf[128];
        snprintf(buf, sizeof buf, "{\"jsonrpc\":\"2.0\",\"id\":%s,\"method\":\"daemon.status\"}",
                 bad_numbers[i]);
        ck_assert_msg(decode_code(buf, NULL, 0) == QM_RPC_PARSE_ERROR, "%s", bad_numbers[i]);
    }
    const char *good_numbers[] = {"0", "-0", "10", "1.5", "1e3", "-2.5E-3", "9007199254740991"};
    for (size_t i = 0; i < sizeof good_numbers / sizeof good_numbers[0]; i++) {
        char buf[128];
        snprintf(buf, sizeof buf, "{\"jsonrpc\":\"2.0\",\"id\":%s,\"method\":\"daemon.status\"}",
                 good_numbers[i]);
        ck_assert_msg(decode_code(buf, NULL, 0) == 0, "%s", good_numbers[i]);
    }
    /* Brackets and digits inside strings are text. */
    ck_assert_int_eq(decode_code("{\"jsonrpc\":\"2.0\",\"id\":\"01[\",\"method\":\"daemon.status\"}",
                                 NULL, 0),
                     0);
}
END_TEST

START_TEST(test_escaped_nul_is_refused_not_truncated)
{
    ck_assert_int_eq(decode_code("{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"daemon.status\\u0000x\"}",
                                 NULL, 0),
                     QM_RPC_INVALID_REQUEST);
    ck_assert_int_eq(decode_code(REQ("session.plan", "{\"session\":\"ab\\u0000c\"}"), NULL, 0),
                     QM_RPC_INVALID_REQUEST);
    /* Other escapes are fine. */
    ck_assert_int_eq(decode_code(REQ("session.plan", "{\"session\":\"ab\\u0041\\n\"}"), NULL, 0),
                     0);
}
END_TEST

START_TEST(test_ids_that_cannot_come_back_exactly_are_refused)
{
    ck_assert_int_eq(decode_code("{\"jsonrpc\":\"2.0\",\"id\":9007199254740993,"
                                 "\"method\":\"daemon.status\"}",
                                 NULL, 0),
                     QM_RPC_INVALID_REQUEST);
    ck_assert_int_eq(decode_code("{\"jsonrpc\":\"2.0\",\"id\":-9223372036854775808,"
                                 "\"method\":\"daemon.status\"}",
                                 NULL, 0),
                     QM_RPC_INVALID_REQUEST);
    qm_rpc_frame f = decode("{\"jsonrpc\":\"2.0\",\"id\":-9007199254740991,\"method\":\"daemon.status\"}");
    ck_assert(f.items[0].ok);
    ck_assert_str_eq(f.items[0].req.id, "-9007199254740991");
    qm_rpc_frame_free(&f);
}
END_TEST

/* A session.create whose one hot list holds n experts, the last one
 * repeating expert 17. */
static char *hot_list_request(size_t n)
{
    char *buf = malloc(n * 8 + 256);
    ck_assert_ptr_nonnull(buf);
    size_t o = (size_t)sprintf(buf, "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"session.create\","
                                    "\"params\":{\"model\":\"m\",\"policy\":\"static_hot\","
                                    "\"policy_params\":{\"hot\":[{\"layer\":0,\"experts\":[");
    for (size_t i = 0; i < n; i++)
        o += (size_t)sprintf(buf + o, "%s%zu", i ? "," : "", i == n - 1 ? (size_t)17 : i);
    strcpy(buf + o, "]}]}}}");
    return buf;
}

/* CPU seconds to decode `buf` (the best of three), checking the answer. */
static double hot_list_decode_seconds(const char *buf, size_t n)
{
    double best = 1e9;
    for (int rep = 0; rep < 3; rep++) {
        char field[64];
        clock_t start = clock();
        ck_assert_int_eq(decode_code(buf, field, sizeof field), QM_RPC_INVALID_PARAMS);
        double s = (double)(clock() - start) / CLOCKS_PER_SEC;
        best = s < best ? s : best;
        char want[64];
        snprintf(want, sizeof want, "policy_params.hot[0].experts[%zu]", n - 1);
        ck_assert_str_eq(field, want);
    }
    return best;
}

/* The repeat check is not quadratic: 8 times the experts may cost about 8
 * times as much (the parse is linear, the check n log n), not 64 times.
 * Timed as a ratio, so a slow or busy machine does not decide it. */
START_TEST(test_long_hot_lists_decode_in_near_linear_time_and_name_the_repeat)
{
    size_t small_n = QM_HOT_MAX / 8, big_n = QM_HOT_MAX;
    char *small = hot_list_request(small_n), *big = hot_list_request(big_n);
    double t_small = hot_list_decode_seconds(small, small_n);
    double t_big = hot_list_decode_seconds(big, big_n);
    ck_assert_msg(t_big <= 24.0 * t_small + 0.02,
                  "%zu experts decoded in %.4f s, %zu in %.4f s: worse than n log n", small_n,
                  t_small, big_n, t_big);
    free(small);
    free(big);
}
END_TEST

/* ---- envelopes ---- */

START_TEST(test_decode_request_keeps_id_text)
{
    qm_rpc_frame f = decode("{\"jsonrpc\":\"2.0\",\"id\":7,\"method\":\"daemon.status\"}");
    ck_assert(f.items[0].ok);
    ck_assert_int_eq(f.items[0].req.method, QM_METHOD_DAEMON_STATUS);
    ck_assert_str_eq(f.items[0].req.id, "7");
    ck_assert(!f.is_batch);
    qm_rpc_frame_free(&f);
    f = decode("{\"method\":\"model.list\",\"id\":\"a\\\"b\",\"jsonrpc\":\"2.0\",\"params\":{}}");
    ck_assert(f.items[0].ok);
    ck_assert_str_eq(f.items[0].req.id, "\"a\\\"b\"");
    qm_rpc_frame_free(&f);
}
END_TEST

START_TEST(test_decode_notification_has_no_id)
{
    qm_rpc_frame f = decode("{\"jsonrpc\":\"2.0\",\"method\":\"daemon.status\"}");
    ck_assert(f.items[0].ok);
    ck_assert_ptr_null(f.items[0].req.id);
    ck_assert(f.items[0].notification);
    qm_rpc_frame_free(&f);
}
END_TEST

START_TEST(test_decode_rejects_bad_json_as_parse_error)
{
    ck_assert_int_eq(decode_code("{\"jsonrpc\":", NULL, 0), QM_RPC_PARSE_ERROR);
    ck_assert_int_eq(decode_code("{} x", NULL, 0), QM_RPC_PARSE_ERROR);
    ck_assert_int_eq(decode_code("\xff\xfe", NULL, 0), QM_RPC_PARSE_ERROR);
}
END_TEST

START_TEST(test_decode_rejects_non_request_envelopes)
{
    ck_assert_int_eq(decode_code("42", NULL, 0), QM_RPC_INVALID_REQUEST);
    ck_assert_int_eq(decode_code("{\"jsonrpc\":\"1.0\",\"id\":1,\"method\":\"daemon.status\"}",
                                 NULL, 0),
                     QM_RPC_INVALID_REQUEST);
    ck_assert_int_eq(decode_code("{\"jsonrpc\":\"2.0\",\"id\":1}", NULL, 0),
                     QM_RPC_INVALID_REQUEST);
    ck_assert_int_eq(decode_code("{\"jsonrpc\":\"2.0\",\"id\":[1],\"method\":\"daemon.status\"}",
                                 NULL, 0),
                     QM_RPC_INVALID_REQUEST);
    ck_assert_int_eq(decode_code("{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"daemon.status\","
                                 "\"extra\":1}",
                                 NULL, 0),
                     QM_RPC_INVALID_REQUEST);
}
END_TEST

START_TEST(test_decode_unknown_method_is_method_not_found_and_clipped)
{
    char buf[512];
    char name[201];
    memset(name, 'm', 200);
    name[200] = '\0';
    snprintf(buf, sizeof buf, "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"%s\"}", name);
    qm_rpc_frame f = decode(buf);
    ck_assert_int_eq(f.items[0].rpc_code, QM_RPC_METHOD_NOT_FOUND);
    ck_assert_str_eq(f.items[0].req.id, "1");
    /* At most 64 bytes of the input echoed. */
    char run[66];
    memset(run, 'm', 65);
    run[65] = '\0';
    ck_assert_ptr_null(strstr(f.items[0].status.msg, run));
    ck_assert_ptr_nonnull(strstr(f.items[0].status.msg, "..."));
    qm_rpc_frame_free(&f);
}
END_TEST

/* The answer lists every method of QM_METHOD_MAP, in order and whole, even
 * after the longest echo of the name. */
START_TEST(test_decode_unknown_method_names_every_method)
{
    char long_name[201];
    memset(long_name, 'm', 200);
    long_name[200] = '\0';
    const char *names[] = {"nope", long_name};
    for (size_t n = 0; n < 2; n++) {
        char buf[512];
        snprintf(buf, sizeof buf, "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"%s\"}", names[n]);
        qm_rpc_frame f = decode(buf);
        const char *msg = f.items[0].status.msg;
        ck_assert_int_eq(f.items[0].rpc_code, QM_RPC_METHOD_NOT_FOUND);
        const char *at = strstr(msg, "expected one of ");
        ck_assert_msg(at != NULL, "%s", msg);
        for (int m = 0; m < QM_METHOD_COUNT; m++) {
            const char *name = qm_method_name((qm_method)m);
            const char *hit = strstr(at, name);
            ck_assert_msg(hit != NULL, "%s missing from: %s", name, msg);
            at = hit + strlen(name); /* in QM_METHOD_MAP's order */
        }
        ck_assert_str_eq(at, ""); /* nothing clipped after the last */
        ck_assert_ptr_nonnull(strstr(msg, "session.resize, "));
        ck_assert_ptr_nonnull(strstr(msg, ", telemetry.metrics"));
        qm_rpc_frame_free(&f);
    }
}
END_TEST

START_TEST(test_batch_mixes_requests_notifications_and_errors)
{
    qm_rpc_frame f = decode("[{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"daemon.status\"},"
                            "{\"jsonrpc\":\"2.0\",\"method\":\"daemon.status\"},"
                            "5,"
                            "{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"nope\"}]");
    ck_assert(f.is_batch);
    ck_assert_uint_eq(f.n, 4);
    ck_assert(f.items[0].ok);
    ck_assert(f.items[1].ok && f.items[1].notification);
    ck_assert(!f.items[2].ok && f.items[2].rpc_code == QM_RPC_INVALID_REQUEST);
    ck_assert_int_eq(f.items[3].rpc_code, QM_RPC_METHOD_NOT_FOUND);
    qm_rpc_frame_free(&f);
}
END_TEST

START_TEST(test_batch_empty_and_oversized_are_single_invalid_request)
{
    qm_rpc_frame f = decode("[]");
    ck_assert(!f.is_batch);
    ck_assert_int_eq(f.items[0].rpc_code, QM_RPC_INVALID_REQUEST);
    qm_rpc_frame_free(&f);
    qm_proto_limits l = lim();
    l.max_batch = 2;
    const char *three = "[1,2,3]";
    ck_assert_int_eq(qm_rpc_decode(three, strlen(three), &l, &f), 0);
    ck_assert(!f.is_batch);
    ck_assert_int_eq(f.items[0].rpc_code, QM_RPC_INVALID_REQUEST);
    ck_assert_ptr_nonnull(strstr(f.items[0].status.msg, "max_batch 2"));
    ck_assert_int_eq(f.limit, QM_PROTO_LIMIT_BATCH);
    qm_rpc_frame_free(&f);
}
END_TEST

/* ---- params ---- */


START_TEST(test_params_unknown_member_names_field)
{
    char field[64];
    ck_assert_int_eq(decode_code(REQ("model.load", "{\"name\":\"m\",\"path\":\"/x\",\"pth\":1}"),
                                 field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "pth");
    ck_assert_int_eq(decode_code(REQ("session.create",
                                     "{\"model\":\"m\",\"policy_params\":{\"decay\":2}}"),
                                 field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "policy_params.decay");
    ck_assert_int_eq(decode_code(REQ("daemon.status", "{\"x\":1}"), field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "x");
}
END_TEST

START_TEST(test_params_wrong_type_and_missing_name_field)
{
    char field[64];
    ck_assert_int_eq(decode_code(REQ("model.load", "{\"name\":1,\"path\":\"/x\"}"), field,
                                 sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "name");
    ck_assert_int_eq(decode_code(REQ("model.load", "{\"name\":\"m\"}"), field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "path");
    ck_assert_int_eq(decode_code(REQ("session.create", "{\"model\":\"m\",\"budget_bytes\":-1}"),
                                 field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "budget_bytes");
    ck_assert_int_eq(decode_code(REQ("session.create", "{\"model\":\"m\",\"budget_bytes\":1.5}"),
                                 field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_int_eq(decode_code(REQ("model.unload", "{\"name\":\"m\",\"force\":1}"), field,
                                 sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "force");
    ck_assert_int_eq(decode_code(REQ("session.plan", "[]"), field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "params");
    /* session.resize: budget_bytes is required and > 0; nothing else. */
    static const char *const bad_resize[][2] = {
        {REQ("session.resize", "{\"session\":\"s\"}"), "budget_bytes"},
        {REQ("session.resize", "{\"session\":\"s\",\"budget_bytes\":0}"), "budget_bytes"},
        {REQ("session.resize", "{\"session\":\"s\",\"budget_bytes\":-1}"), "budget_bytes"},
        {REQ("session.resize", "{\"session\":\"s\",\"budget_bytes\":\"1\"}"), "budget_bytes"},
        {REQ("session.resize", "{\"budget_bytes\":1}"), "session"},
        {REQ("session.resize", "{\"session\":\"s\",\"budget_bytes\":1,\"policy\":\"lru\"}"),
         "policy"}};
    for (size_t i = 0; i < sizeof bad_resize / sizeof *bad_resize; i++) {
        ck_assert_int_eq(decode_code(bad_resize[i][0], field, sizeof field),
                         QM_RPC_INVALID_PARAMS);
        ck_assert_msg(strcmp(field, bad_resize[i][1]) == 0, "%s: field %s", bad_resize[i][0],
                      field);
    }
    ck_assert_int_eq(decode_code(REQ("session.resize", "{\"session\":\"s\",\"budget_bytes\":4096}"),
                                 field, sizeof field),
                     0);
}
END_TEST

/* The budget's forms (PROTOCOL.md): `budget` as bytes, "N%" or "auto", or
 * `budget_bytes` as bytes; one of the two; every other value refused
 * naming the member and the rule. */
START_TEST(test_params_budget_forms_and_refusals)
{
    static const struct {
        const char *params;
        qm_budget_form form;
        uint64_t bytes;
        double percent;
    } good[] = {
        {"{\"model\":\"m\"}", QM_BUDGET_NONE, 0, 0},
        {"{\"model\":\"m\",\"budget\":4096}", QM_BUDGET_BYTES, 4096, 0},
        {"{\"model\":\"m\",\"budget\":\"4096\"}", QM_BUDGET_BYTES, 4096, 0},
        {"{\"model\":\"m\",\"budget_bytes\":4096}", QM_BUDGET_BYTES, 4096, 0},
        {"{\"model\":\"m\",\"budget\":\"25%\"}", QM_BUDGET_PERCENT, 0, 25},
        {"{\"model\":\"m\",\"budget\":\"12.5%\"}", QM_BUDGET_PERCENT, 0, 12.5},
        {"{\"model\":\"m\",\"budget\":\"100%\"}", QM_BUDGET_PERCENT, 0, 100},
        {"{\"model\":\"m\",\"budget\":\"auto\"}", QM_BUDGET_AUTO, 0, 0},
    };
    char req[256];
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        snprintf(req, sizeof req,
                 "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"session.create\",\"params\":%s}",
                 good[i].params);
        qm_rpc_frame f = decode(req);
        ck_assert_msg(f.items[0].ok, "%s: %s", good[i].params, f.items[0].status.msg);
        const qm_params *p = &f.items[0].req.params;
        ck_assert_int_eq(p->budget.form, good[i].form);
        ck_assert_int_eq(p->has_budget, good[i].form != QM_BUDGET_NONE);
        ck_assert_uint_eq(p->budget.bytes, good[i].bytes);
        ck_assert_uint_eq(p->budget_bytes, good[i].bytes);
        ck_assert_double_eq(p->budget.percent, good[i].percent);
        qm_rpc_frame_free(&f);
    }
    static const char *const bad[][2] = {
        {"{\"model\":\"m\",\"budget\":\"0%\"}", "budget"},
        {"{\"model\":\"m\",\"budget\":\"100.5%\"}", "budget"},
        {"{\"model\":\"m\",\"budget\":\"-5%\"}", "budget"},
        {"{\"model\":\"m\",\"budget\":\" 5%\"}", "budget"},
        {"{\"model\":\"m\",\"budget\":\"%\"}", "budget"},
        {"{\"model\":\"m\",\"budget\":\"inf%\"}", "budget"},
        {"{\"model\":\"m\",\"budget\":\"Auto\"}", "budget"},
        {"{\"model\":\"m\",\"budget\":\"2G\"}", "budget"},
        {"{\"model\":\"m\",\"budget\":\"0\"}", "budget"},
        {"{\"model\":\"m\",\"budget\":\"\"}", "budget"},
        {"{\"model\":\"m\",\"budget\":0}", "budget"},
        {"{\"model\":\"m\",\"budget\":1.5}", "budget"},
        {"{\"model\":\"m\",\"budget\":true}", "budget"},
        {"{\"model\":\"m\",\"budget\":null}", "budget"},
        {"{\"model\":\"m\",\"budget\":\"auto\",\"budget_bytes\":1}", "budget"},
        {"{\"model\":\"m\",\"budget_bytes\":\"auto\"}", "budget_bytes"},
        {"{\"model\":\"m\",\"budget_bytes\":0}", "budget_bytes"},
    };
    char field[64];
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(req, sizeof req,
                 "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"session.create\",\"params\":%s}",
                 bad[i][0]);
        qm_rpc_frame f = decode(req);
        ck_assert_msg(!f.items[0].ok, "%s decoded", bad[i][0]);
        ck_assert_int_eq(f.items[0].rpc_code, QM_RPC_INVALID_PARAMS);
        ck_assert_str_eq(f.items[0].status.field, bad[i][1]);
        if (strcmp(bad[i][1], "budget") == 0 && !strstr(bad[i][0], "budget_bytes"))
            ck_assert_msg(strstr(f.items[0].status.msg, QM_BUDGET_RULE), "%s: %s", bad[i][0],
                          f.items[0].status.msg);
        qm_rpc_frame_free(&f);
    }
    /* session.resize takes the same forms, and needs one. */
    ck_assert_int_eq(decode_code(REQ("session.resize", "{\"session\":\"s\",\"budget\":\"auto\"}"),
                                 field, sizeof field),
                     0);
    ck_assert_int_eq(decode_code(REQ("session.resize", "{\"session\":\"s\",\"budget\":\"40%\"}"),
                                 field, sizeof field),
                     0);
    ck_assert_int_eq(decode_code(REQ("session.resize", "{\"session\":\"s\",\"budget\":\"x\"}"),
                                 field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "budget");
    /* What "N%" comes to: rounded down, at least one byte, never more than all. */
    ck_assert_uint_eq(qm_budget_percent_of(25, 1000), 250);
    ck_assert_uint_eq(qm_budget_percent_of(0.001, 1000), 1);
    ck_assert_uint_eq(qm_budget_percent_of(100, UINT64_MAX), UINT64_MAX);
    ck_assert_uint_eq(qm_budget_percent_of(33.3, 10), 3);
}
END_TEST

START_TEST(test_params_session_create_decodes_policy_params)
{
    qm_rpc_frame f = decode(REQ("session.create",
                                "{\"model\":\"m\",\"policy\":\"static_hot\",\"budget_bytes\":1024,"
                                "\"policy_params\":{\"prefetch\":false,\"pin_fraction\":0.25,"
                                "\"hot\":[{\"layer\":1,\"experts\":[5,1,7]}],"
                                "\"record_trace\":\"t.json\"}}"));
    ck_assert(f.items[0].ok);
    const qm_params *p = &f.items[0].req.params;
    ck_assert_str_eq(p->model, "m");
    ck_assert_str_eq(p->policy, "static_hot");
    ck_assert(p->has_budget && p->budget_bytes == 1024);
    ck_assert(p->policy_params.has_prefetch && !p->policy_params.prefetch);
    ck_assert_uint_eq(p->policy_params.n_hot, 1);
    ck_assert_uint_eq(p->policy_params.hot[0].n_experts, 3);
    ck_assert_uint_eq(p->policy_params.hot[0].experts[2], 7);
    ck_assert_str_eq(p->policy_params.record_trace, "t.json");
    qm_rpc_frame_free(&f);
    char field[64];
    ck_assert_int_eq(decode_code(REQ("session.create",
                                     "{\"model\":\"m\",\"policy_params\":{\"hot\":[{\"layer\":0,"
                                     "\"experts\":[1,1]}]}}"),
                                 field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "policy_params.hot[0].experts[1]");
    ck_assert_int_eq(decode_code(REQ("session.create",
                                     "{\"model\":\"m\",\"policy_params\":{\"record_trace\":\"../x\"}}"),
                                 field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
}
END_TEST

START_TEST(test_params_session_create_decodes_precision)
{
    qm_rpc_frame f = decode(REQ("session.create", "{\"model\":\"m\",\"precision\":\"fast\"}"));
    ck_assert(f.items[0].ok);
    ck_assert_int_eq(f.items[0].req.params.precision, 1);
    qm_rpc_frame_free(&f);
    f = decode(REQ("session.create", "{\"model\":\"m\",\"precision\":\"exact\"}"));
    ck_assert(f.items[0].ok);
    ck_assert_int_eq(f.items[0].req.params.precision, 0);
    qm_rpc_frame_free(&f);
    f = decode(REQ("session.create", "{\"model\":\"m\"}"));
    ck_assert(f.items[0].ok);
    ck_assert_int_eq(f.items[0].req.params.precision, 0);
    qm_rpc_frame_free(&f);
    static const char *const bad[] = {"\"Fast\"", "\"int8\"", "1", "null", "\"\""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char req[256], field[64];
        snprintf(req, sizeof req, REQ("session.create", "{\"model\":\"m\",\"precision\":%s}"),
                 bad[i]);
        ck_assert_int_eq(decode_code(req, field, sizeof field),
                         QM_RPC_INVALID_PARAMS);
        ck_assert_str_eq(field, "precision");
    }
}
END_TEST

/* f32 [1,2] = {1.0, -2.0}: 0000803f 000000c0 -> "AACAPwAAAMA=" */
START_TEST(test_params_infer_decodes_tensor)
{
    qm_rpc_frame f = decode(REQ("session.infer",
                                "{\"session\":\"s\",\"layer\":3,\"return_routing\":true,"
                                "\"hidden\":{\"dtype\":\"f32\",\"shape\":[1,2],"
                                "\"data\":\"AACAPwAAAMA=\"}}"));
    ck_assert(f.items[0].ok);
    const qm_params *p = &f.items[0].req.params;
    ck_assert_uint_eq(p->layer, 3);
    ck_assert(p->return_routing);
    ck_assert_uint_eq(p->hidden.nbytes, 8);
    float v[2];
    memcpy(v, p->hidden.data, 8);
    ck_assert(v[0] == 1.0f && v[1] == -2.0f);
    qm_rpc_frame_free(&f);
}
END_TEST

START_TEST(test_params_infer_rejects_shape_data_disagreement)
{
    char field[64];
    ck_assert_int_eq(decode_code(REQ("session.infer",
                                     "{\"session\":\"s\",\"layer\":0,\"hidden\":{\"dtype\":\"f32\","
                                     "\"shape\":[1,3],\"data\":\"AACAPwAAAMA=\"}}"),
                                 field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "hidden.data");
    ck_assert_int_eq(decode_code(REQ("session.infer",
                                     "{\"session\":\"s\",\"layer\":0,\"hidden\":{\"dtype\":\"f64\","
                                     "\"shape\":[1,1],\"data\":\"\"}}"),
                                 field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "hidden.dtype");
    ck_assert_int_eq(decode_code(REQ("session.infer",
                                     "{\"session\":\"s\",\"layer\":0,\"hidden\":{\"dtype\":\"f32\","
                                     "\"shape\":[4294967296,4294967296,4294967296],\"data\":\"\"}}"),
                                 field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "hidden.shape");
    ck_assert_int_eq(decode_code(REQ("session.infer",
                                     "{\"session\":\"s\",\"layer\":0,\"hidden\":{\"dtype\":\"f16\","
                                     "\"shape\":[2],\"data\":\"AAAA\"}}"),
                                 field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "hidden.shape");
    ck_assert_int_eq(decode_code(REQ("session.infer",
                                     "{\"session\":\"s\",\"layer\":0,\"hidden\":{\"dtype\":\"f16\","
                                     "\"shape\":[1,2],\"data\":\"AA*A\"}}"),
                                 field, sizeof field),
                     QM_RPC_INVALID_PARAMS);
    ck_assert_str_eq(field, "hidden.data");
}
END_TEST

START_TEST(test_params_mapped_tensors_output_to_map_and_unmap)
{
    qm_rpc_frame f = decode(REQ("session.infer",
                                "{\"session\":\"s\",\"layer\":0,\"hidden\":{\"dtype\":\"f16\","
                                "\"shape\":[3,2],\"map\":9,\"offset\":640},"
                                "\"output_to\":{\"map\":9,\"offset\":0}}"));
    ck_assert(f.items[0].ok);
    const qm_params *p = &f.items[0].req.params;
    ck_assert(p->hidden.mapped);
    ck_assert_ptr_null(p->hidden.data);
    ck_assert_uint_eq(p->hidden.map, 9);
    ck_assert_uint_eq(p->hidden.offset, 640);
    ck_assert_uint_eq(p->hidden.nbytes, 12);
    ck_assert(p->has_output_to);
    ck_assert_uint_eq(p->output_map, 9);
    qm_rpc_frame_free(&f);
    f = decode(REQ("session.map", "{\"session\":\"s\",\"bytes\":4096}"));
    ck_assert(f.items[0].ok);
    ck_assert_uint_eq(f.items[0].req.params.bytes, 4096);
    qm_rpc_frame_free(&f);
    f = decode(REQ("session.unmap", "{\"session\":\"s\",\"map\":3}"));
    ck_assert(f.items[0].ok);
    ck_assert_uint_eq(f.items[0].req.params.map, 3);
    qm_rpc_frame_free(&f);
    static const struct {
        const char *method, *params, *field;
    } bad[] = {
        {"session.infer", "{\"session\":\"s\",\"layer\":0,\"hidden\":{\"dtype\":\"f32\","
                          "\"shape\":[1,1],\"map\":1,\"offset\":65}}", "hidden.offset"},
        {"session.infer", "{\"session\":\"s\",\"layer\":0,\"hidden\":{\"dtype\":\"f32\","
                          "\"shape\":[1,1],\"map\":1}}", "hidden.offset"},
        {"session.infer", "{\"session\":\"s\",\"layer\":0,\"hidden\":{\"dtype\":\"f32\","
                          "\"shape\":[1,1],\"offset\":0}}", "hidden.map"},
        {"session.infer", "{\"session\":\"s\",\"layer\":0,\"hidden\":{\"dtype\":\"f32\","
                          "\"shape\":[1,1],\"map\":\"1\",\"offset\":0}}", "hidden.map"},
        {"session.infer", "{\"session\":\"s\",\"layer\":0,\"hidden\":{\"dtype\":\"f32\","
                          "\"shape\":[1,1],\"map\":1,\"offset\":0,\"data\":\"AAAAAA==\"}}",
         "hidden.data"},
        {"session.infer", "{\"session\":\"s\",\"layer\":0,\"hidden\":{\"dtype\":\"f32\","
                          "\"shape\":[1,1],\"data\":\"AAAAAA==\"},\"output_to\":7}", "output_to"},
        {"session.infer", "{\"session\":\"s\",\"layer\":0,\"hidden\":{\"dtype\":\"f32\","
                          "\"shape\":[1,1],\"data\":\"AAAAAA==\"},\"output_to\":{\"map\":1,"
                          "\"offset\":8}}", "output_to.offset"},
        {"session.map", "{\"session\":\"s\"}", "bytes"},
        {"session.map", "{\"session\":\"s\",\"bytes\":0}", "bytes"},
        {"session.map", "{\"session\":\"s\",\"bytes\":1,\"fd\":3}", "fd"},
        {"session.unmap", "{\"session\":\"s\"}", "map"},
        {"session.unmap", "{\"session\":\"s\",\"map\":-1}", "map"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char line[512], field[64];
        snprintf(line, sizeof line,
                 "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"%s\",\"params\":%s}",
                 bad[i].method, bad[i].params);
        ck_assert_int_eq(decode_code(line, field, sizeof field), QM_RPC_INVALID_PARAMS);
        ck_assert_msg(strcmp(field, bad[i].field) == 0, "case %zu: field %s, expected %s", i,
                      field, bad[i].field);
    }
}
END_TEST

/* ---- codec and responses ---- */

START_TEST(test_base64_round_trips_every_length)
{
    uint8_t in[40], out[40];
    char enc[64];
    for (size_t i = 0; i < sizeof in; i++)
        in[i] = (uint8_t)(i * 37 + 11);
    for (size_t n = 0; n <= sizeof in; n++) {
        size_t e = qm_base64_encoded_len(n);
        qm_base64_encode(in, n, enc);
        size_t got;
        ck_assert_int_eq(qm_base64_decode(enc, e, out, sizeof out, &got), 0);
        ck_assert_uint_eq(got, n);
        ck_assert(memcmp(in, out, n) == 0);
    }
    size_t got;
    ck_assert_int_eq(qm_base64_decode("AAA", 3, out, sizeof out, &got), QM_EINVAL);
    ck_assert_int_eq(qm_base64_decode("A=AA", 4, out, sizeof out, &got), QM_EINVAL);
    ck_assert_int_eq(qm_base64_decode("AA=A", 4, out, sizeof out, &got), QM_EINVAL);
    /* One spelling per byte string: bits hidden by the padding must be zero. */
    ck_assert_int_eq(qm_base64_decode("Zh==", 4, out, sizeof out, &got), QM_EINVAL);
    ck_assert_int_eq(qm_base64_decode("Zm9=", 4, out, sizeof out, &got), QM_EINVAL);
    ck_assert_int_eq(qm_base64_decode("Zg==", 4, out, sizeof out, &got), 0);
    ck_assert_int_eq(qm_base64_decode("Zm8=", 4, out, sizeof out, &got), 0);
}
END_TEST

START_TEST(test_writer_places_commas_and_escapes)
{
    qm_buf b;
    qm_buf_init(&b);
    qm_jw w;
    qm_jw_init(&w, &b);
    qm_jw_obj_begin(&w);
    qm_jw_key(&w, "s");
    qm_jw_str(&w, "a\"\\\n\x01");
    qm_jw_key(&w, "a");
    qm_jw_arr_begin(&w);
    qm_jw_u64(&w, 18446744073709551615ull);
    qm_jw_f32(&w, 0.1f);
    qm_jw_null(&w);
    qm_jw_arr_begin(&w);
    qm_jw_arr_end(&w);
    qm_jw_arr_end(&w);
    qm_jw_obj_end(&w);
    qm_buf_append(&b, "", 1);
    ck_assert_str_eq(b.data, "{\"s\":\"a\\\"\\\\\\n\\u0001\",\"a\":[18446744073709551615,"
                             "0.100000001,null,[]]}");
    qm_buf_free(&b);
}
END_TEST

START_TEST(test_escape_into_a_bounded_string_never_cuts_an_escape)
{
    /* The one escaper (common/qm_json.h) as qmoe-bank's reports use it. */
    char out[16];
    ck_assert_uint_eq(qm_json_escape_str("a\"b\n\x01", out, sizeof out), 12);
    ck_assert_str_eq(out, "a\\\"b\\n\\u0001");
    /* Cut: plain bytes up to the edge, an escape that does not fit is left out. */
    ck_assert_uint_eq(qm_json_escape_str("abcd\x01", out, 8), 10);
    ck_assert_str_eq(out, "abcd");
    ck_assert_uint_eq(qm_json_escape_str("abcdefghij", out, 8), 10);
    ck_assert_str_eq(out, "abcdefg");
}
END_TEST

/* Whatever bytes a string holds (a status message vsnprintf cut inside a
 * character, a bank's metadata, a peer's string), the writer's output is
 * well-formed UTF-8: a reader that decodes it first (Python's json) takes
 * it. Well-formed sequences pass as they are; every byte of an ill-formed
 * one becomes \ufffd. */
START_TEST(test_escape_writes_well_formed_utf8_whatever_came_in)
{
    static const struct {
        const char *in, *out;
    } cases[] = {
        {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"},
        {"a\xff" "b", "a\\ufffdb"},                       /* never a byte of UTF-8 */
        {"\xc0\xaf", "\\ufffd\\ufffd"},                   /* overlong '/' */
        {"\xe0\x80\xaf", "\\ufffd\\ufffd\\ufffd"},        /* overlong, 3 bytes */
        {"\xed\xa0\x80", "\\ufffd\\ufffd\\ufffd"},        /* a UTF-16 surrogate */
        {"\xf4\x90\x80\x80", "\\ufffd\\ufffd\\ufffd\\ufffd"}, /* past U+10FFFF */
        {"\xf5\x80", "\\ufffd\\ufffd"},
        {"\x80x", "\\ufffdx"},                            /* a lone continuation */
        {"ab\xe2\x82", "ab\\ufffd\\ufffd"},               /* cut short at the end */
        {"\xe2\x82" "a", "\\ufffd\\ufffda"},              /* cut short before ASCII */
        {"\xf0\x9f\x98\x80\xf0\x9f", "\xf0\x9f\x98\x80\\ufffd\\ufffd"},
    };
    char out[64];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        qm_json_escape_str(cases[i].in, out, sizeof out);
        ck_assert_msg(strcmp(out, cases[i].out) == 0, "case %zu: got \"%s\"", i, out);
    }
    /* A bounded copy cuts between characters, never inside one. */
    ck_assert_uint_eq(qm_json_escape_str("abc\xe2\x82\xac", out, 6), 6);
    ck_assert_str_eq(out, "abc");
    ck_assert_uint_eq(qm_json_escape_str("ab\xe2\x82\xac", out, 6), 5);
    ck_assert_str_eq(out, "ab\xe2\x82\xac");
    /* Through the writer, as every answer is made. */
    qm_buf b;
    qm_buf_init(&b);
    qm_jw w;
    qm_jw_init(&w, &b);
    qm_jw_obj_begin(&w);
    qm_jw_member_str(&w, "reason", "cannot open /m/\xce\xb1\xce");
    qm_jw_obj_end(&w);
    qm_buf_append(&b, "", 1);
    ck_assert_str_eq(b.data, "{\"reason\":\"cannot open /m/\xce\xb1\\ufffd\"}");
    qm_buf_free(&b);
}
END_TEST

START_TEST(test_writer_members_are_a_key_and_its_value)
{
    qm_buf b;
    qm_buf_init(&b);
    qm_jw w;
    qm_jw_init(&w, &b);
    qm_jw_obj_begin(&w);
    qm_jw_member_u64(&w, "n", 18446744073709551615ull);
    qm_jw_member_str(&w, "s", "a\"b");
    qm_jw_member_str(&w, "none", NULL);
    qm_jw_obj_end(&w);
    qm_buf_append(&b, "", 1);
    ck_assert_str_eq(b.data, "{\"n\":18446744073709551615,\"s\":\"a\\\"b\",\"none\":null}");
    qm_buf_free(&b);
}
END_TEST

START_TEST(test_error_response_has_code_message_reason_and_field)
{
    qm_buf b;
    qm_buf_init(&b);
    qm_jw w;
    qm_jw_init(&w, &b);
    qm_rpc_error(&w, "\"x\"", QM_RPC_INVALID_PARAMS, "name must be a string", "name");
    qm_buf_append(&b, "", 1);
    ck_assert_str_eq(b.data, "{\"jsonrpc\":\"2.0\",\"id\":\"x\",\"error\":{\"code\":-32602,"
                             "\"message\":\"invalid_params\",\"data\":{\"reason\":\"name must be "
                             "a string\",\"field\":\"name\"}}}");
    qm_buf_reset(&b);
    qm_jw_init(&w, &b);
    qm_rpc_error(&w, NULL, QM_RPC_PARSE_ERROR, "bad", NULL);
    qm_buf_append(&b, "", 1);
    ck_assert_str_eq(b.data, "{\"jsonrpc\":\"2.0\",\"id\":null,\"error\":{\"code\":-32700,"
                             "\"message\":\"parse_error\",\"data\":{\"reason\":\"bad\"}}}");
    qm_buf_free(&b);
}
END_TEST

START_TEST(test_status_codes_map_to_protocol_codes)
{
    ck_assert_int_eq(qm_rpc_code_from_status(QM_EINVAL), -32602);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_ENOT_FOUND), -32001);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_EPERMISSION), -32002);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_ERESOURCE_EXHAUSTED), -32003);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_EOVERLOADED), -32004);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_EINVALID_MODEL), -32005);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_EPAYLOAD_TOO_LARGE), -32006);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_ESHUTTING_DOWN), -32007);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_ECONFLICT), -32008);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_EIN_USE), -32009);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_EINTERNAL), -32603);
    /* The rest of the column, and codes outside the list. */
    ck_assert_int_eq(qm_rpc_code_from_status(QM_ENOMEM), -32003);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_EUNSUPPORTED), -32602);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_EIO), -32603);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_EDEVICE), -32603);
    ck_assert_int_eq(qm_rpc_code_from_status(QM_EPARSE), -32700);
    ck_assert_int_eq(qm_rpc_code_from_status(0), -32603);
    ck_assert_int_eq(qm_rpc_code_from_status(-999), -32603);
    ck_assert_str_eq(qm_rpc_code_name(-32009), "in_use");
}
END_TEST

START_TEST(test_config_flattens_models_and_rejects_arrays)
{
    const char *text = "{\"max_batch\": 16, \"log_level\": \"debug\", \"prefetch\": true,"
                       " \"models\": {\"a\": \"/x.bank\", \"b\": \"/y.bank\"}, \"empty\": {}}";
    qm_conf_entry *e;
    size_t n;
    qm_status st;
    ck_assert_int_eq(qm_conf_parse(text, strlen(text), &e, &n, &st), 0);
    ck_assert_uint_eq(n, 5);
    ck_assert_str_eq(e[0].key, "max_batch");
    ck_assert(e[0].type == QM_CONF_NUMBER && e[0].num == 16);
    ck_assert(e[1].type == QM_CONF_STRING);
    ck_assert_str_eq(e[1].str, "debug");
    ck_assert(e[2].type == QM_CONF_BOOL && e[2].boolean);
    ck_assert_str_eq(e[3].key, "models.a");
    ck_assert_str_eq(e[4].str, "/y.bank");
    qm_conf_free(e, n);
    const char *arr = "{\"x\": [1]}";
    ck_assert_int_eq(qm_conf_parse(arr, strlen(arr), &e, &n, &st), QM_EINVAL);
    ck_assert_str_eq(st.field, "x");
    const char *deep = "{\"a\": {\"b\": {}}}";
    ck_assert_int_eq(qm_conf_parse(deep, strlen(deep), &e, &n, &st), QM_EINVAL);
    ck_assert_int_eq(qm_conf_parse("[1]", 3, &e, &n, &st), QM_EINVAL);
}
END_TEST

/* Fails the Nth allocation, counting from 1. */
static int fail_at, alloc_count;
static void *failing_malloc(size_t n, void *ud)
{
    (void)ud;
    return ++alloc_count == fail_at ? NULL : malloc(n);
}
static void *failing_realloc(void *p, size_t n, void *ud)
{
    (void)ud;
    return ++alloc_count == fail_at ? NULL : realloc(p, n);
}
static void plain_free(void *p, void *ud)
{
    (void)ud;
    free(p);
}

START_TEST(test_decode_survives_allocation_failure_at_every_site)
{
    const char *req = REQ("session.create", "{\"model\":\"m\",\"policy\":\"lru\","
                                            "\"policy_params\":{\"hot\":[{\"layer\":0,"
                                            "\"experts\":[1,2]}],\"record_trace\":\"t\"}}");
    qm_alloc_hooks hooks = {failing_malloc, failing_realloc, plain_free, NULL};
    qm_proto_limits l = lim();
    for (fail_at = 1; fail_at < 40; fail_at++) {
        alloc_count = 0;
        qm_alloc_set_hooks(&hooks);
        qm_rpc_frame f;
        int rc = qm_rpc_decode(req, strlen(req), &l, &f);
        qm_alloc_set_hooks(NULL);
        ck_assert(rc == 0 || rc == QM_ENOMEM);
        if (rc == 0)
            ck_assert(f.items[0].ok || f.items[0].rpc_code != 0);
        qm_rpc_frame_free(&f);
    }
}
END_TEST

START_TEST(test_json_pick_fills_slots_and_names_unknown_and_repeated_members)
{
    static const char *const names[] = {"a", "b"};
    cJSON *o = cJSON_Parse("{\"b\":1,\"a\":2}");
    const cJSON *slot[2] = {NULL, NULL}, *bad = o;
    ck_assert_int_eq(qm_json_pick(o, names, slot, 2, &bad), QM_JSON_PICK_OK);
    ck_assert_ptr_null(bad);
    ck_assert_int_eq(slot[0]->valueint, 2);
    ck_assert_int_eq(slot[1]->valueint, 1);
    cJSON_Delete(o);
    o = cJSON_Parse("{\"a\":1,\"c\":2,\"b\":3}");
    slot[0] = slot[1] = NULL;
    ck_assert_int_eq(qm_json_pick(o, names, slot, 2, &bad), QM_JSON_PICK_UNKNOWN);
    ck_assert_str_eq(bad->string, "c");
    ck_assert_ptr_nonnull(slot[0]); /* taken before the unknown one */
    ck_assert_ptr_null(slot[1]);
    cJSON_Delete(o);
    o = cJSON_Parse("{\"b\":1,\"b\":2}");
    slot[0] = slot[1] = NULL;
    ck_assert_int_eq(qm_json_pick(o, names, slot, 2, &bad), QM_JSON_PICK_TWICE);
    ck_assert_ptr_eq(bad, o->child->next);
    cJSON_Delete(o);
}
END_TEST

START_TEST(test_name_groups_group_by_label_and_cut_at_the_buffer)
{
    char out[64];
    qm_name_groups g;
    qm_name_groups_init(&g, out, sizeof out);
    ck_assert_str_eq(out, "");
    qm_name_groups_add(&g, "exact", "avx512");
    qm_name_groups_add(&g, "exact", "avx2");
    qm_name_groups_add(&g, "fast", "avx512vnni");
    qm_name_groups_add(&g, "exact", "scalar");
    ck_assert_str_eq(out, "exact avx512, avx2; fast avx512vnni; exact scalar");
    char small[12];
    qm_name_groups_init(&g, small, sizeof small);
    qm_name_groups_add(&g, "exact", "avx512");
    qm_name_groups_add(&g, "exact", "avx2");
    qm_name_groups_add(&g, "fast", "avx2");
    ck_assert_str_eq(small, "exact avx51");
}
END_TEST

static Suite *protocol_suite(void)
{
    Suite *s = suite_create("protocol");
    TCase *tc = tcase_create("framing");
    tcase_add_test(tc, test_framer_splits_lines_and_skips_blank_ones);
    tcase_add_test(tc, test_framer_reassembles_byte_by_byte);
    tcase_add_test(tc, test_framer_rejects_partial_line_over_cap_before_newline);
    tcase_add_test(tc, test_framer_accepts_line_of_exactly_cap_and_rejects_complete_line_over);
    tcase_add_test(tc, test_depth_ignores_brackets_inside_strings);
    tcase_add_test(tc, test_nesting_at_limit_passes_and_one_beyond_is_invalid_request);
    tcase_add_test(tc, test_limit_code_names_the_broken_limit_not_the_text);
    tcase_add_test(tc, test_prescan_refuses_what_cjson_would_forgive);
    tcase_add_test(tc, test_escaped_nul_is_refused_not_truncated);
    tcase_add_test(tc, test_ids_that_cannot_come_back_exactly_are_refused);
    tcase_add_test(tc, test_long_hot_lists_decode_in_near_linear_time_and_name_the_repeat);
    suite_add_tcase(s, tc);
    tc = tcase_create("jsonrpc");
    tcase_add_test(tc, test_decode_request_keeps_id_text);
    tcase_add_test(tc, test_decode_notification_has_no_id);
    tcase_add_test(tc, test_decode_rejects_bad_json_as_parse_error);
    tcase_add_test(tc, test_decode_rejects_non_request_envelopes);
    tcase_add_test(tc, test_decode_unknown_method_is_method_not_found_and_clipped);
    tcase_add_test(tc, test_decode_unknown_method_names_every_method);
    tcase_add_test(tc, test_batch_mixes_requests_notifications_and_errors);
    tcase_add_test(tc, test_batch_empty_and_oversized_are_single_invalid_request);
    suite_add_tcase(s, tc);
    tc = tcase_create("params");
    tcase_add_test(tc, test_params_unknown_member_names_field);
    tcase_add_test(tc, test_params_wrong_type_and_missing_name_field);
    tcase_add_test(tc, test_params_session_create_decodes_policy_params);
    tcase_add_test(tc, test_params_budget_forms_and_refusals);
    tcase_add_test(tc, test_params_session_create_decodes_precision);
    tcase_add_test(tc, test_params_infer_decodes_tensor);
    tcase_add_test(tc, test_params_infer_rejects_shape_data_disagreement);
    tcase_add_test(tc, test_params_mapped_tensors_output_to_map_and_unmap);
    suite_add_tcase(s, tc);
    tc = tcase_create("encoding");
    tcase_add_test(tc, test_base64_round_trips_every_length);
    tcase_add_test(tc, test_writer_places_commas_and_escapes);
    tcase_add_test(tc, test_escape_into_a_bounded_string_never_cuts_an_escape);
    tcase_add_test(tc, test_escape_writes_well_formed_utf8_whatever_came_in);
    tcase_add_test(tc, test_writer_members_are_a_key_and_its_value);
    tcase_add_test(tc, test_error_response_has_code_message_reason_and_field);
    tcase_add_test(tc, test_status_codes_map_to_protocol_codes);
    tcase_add_test(tc, test_decode_survives_allocation_failure_at_every_site);
    tcase_add_test(tc, test_config_flattens_models_and_rejects_arrays);
    tcase_add_test(tc, test_json_pick_fills_slots_and_names_unknown_and_repeated_members);
    tcase_add_test(tc, test_name_groups_group_by_label_and_cut_at_the_buffer);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(protocol_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
