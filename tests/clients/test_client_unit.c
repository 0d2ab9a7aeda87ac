/* test_client_unit.c - libqmoe-client and its codec without a daemon: the
 * JSON tree, base64 and tensors, request and response envelopes, socket path
 * resolution, and the connection's behaviour against a scripted fake daemon
 * (timeouts, stray ids, errors, reconnects, threads). */
#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_client_codec.h"
#include "qmoe_client.h"

/* ---------- codec ---------- */

START_TEST(test_b64_matches_rfc4648_vectors)
{
    static const char *in[] = {"", "f", "fo", "foo", "foob", "fooba", "foobar"};
    static const char *out[] = {"", "Zg==", "Zm8=", "Zm9v", "Zm9vYg==", "Zm9vYmE=", "Zm9vYmFy"};
    for (int i = 0; i < 7; i++) {
        size_t n = 0;
        char *e = qm__client_b64_encode(in[i], strlen(in[i]), &n);
        ck_assert_str_eq(e, out[i]);
        void *d = NULL;
        size_t dn = 0;
        ck_assert_int_eq(qm__client_b64_decode(e, n, &d, &dn), 0);
        ck_assert_uint_eq(dn, strlen(in[i]));
        ck_assert(memcmp(d, in[i], dn) == 0);
        qm_free(d);
        qm_free(e);
    }
}
END_TEST

START_TEST(test_b64_decode_rejects_malformed_input)
{
    static const char *bad[] = {"Zg=", "Z===", "Zm9v!A==", "Zh==", "Zm9=", "=Zm9", "Zm 9v"};
    for (int i = 0; i < 7; i++) {
        void *d = (void *)1;
        size_t n = 0;
        ck_assert_msg(qm__client_b64_decode(bad[i], strlen(bad[i]), &d, &n) == QM_EINVAL,
                      "accepted '%s'", bad[i]);
        ck_assert_ptr_null(d);
    }
}
END_TEST

START_TEST(test_tensor_encode_rejects_shape_and_length_mismatch)
{
    float x[6] = {0};
    uint64_t shape[2] = {2, 3};
    qm_cval *t = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm__client_codec_tensor_encode(QM_CDTYPE_F32, shape, 2, x, 20, &t, &st),
                     QM_EINVAL);
    ck_assert_ptr_null(t);
    ck_assert_ptr_nonnull(strstr(st.msg, "disagree"));
}
END_TEST

START_TEST(test_tensor_round_trips_through_json_text)
{
    uint16_t x[6] = {1, 2, 3, 0x7c00, 0xffff, 0};
    uint64_t shape[2] = {3, 2}, got_shape[QM_CTENSOR_MAX_DIMS];
    qm_cval *t = NULL, *back = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm__client_codec_tensor_encode(QM_CDTYPE_BF16, shape, 2, x, sizeof x, &t, &st), 0);
    size_t len = 0;
    char *text = qm_cval_print(t, 0, &len);
    ck_assert_str_eq(text, "{\"dtype\":\"bf16\",\"shape\":[3,2],\"data\":\"AQACAAMAAHz//wAA\"}");
    ck_assert_int_eq(qm_cval_parse(text, len, &back, &st), 0);
    qm_cdtype dt;
    int nd = 0;
    void *data = NULL;
    size_t nb = 0;
    ck_assert_int_eq(qm__client_codec_tensor_decode(back, &dt, got_shape, &nd, &data, &nb, &st), 0);
    ck_assert_int_eq(dt, QM_CDTYPE_BF16);
    ck_assert_int_eq(nd, 2);
    ck_assert_uint_eq(got_shape[0], 3);
    ck_assert_uint_eq(got_shape[1], 2);
    ck_assert_uint_eq(nb, sizeof x);
    ck_assert(memcmp(data, x, nb) == 0);
    qm_free(data);
    qm_free(text);
    qm_cval_free(t);
    qm_cval_free(back);
}
END_TEST

START_TEST(test_tensor_decode_names_the_field_that_is_wrong)
{
    static const char *cases[][2] = {
        {"{\"dtype\":\"f64\",\"shape\":[1],\"data\":\"AAAAAA==\"}", "dtype"},
        {"{\"dtype\":\"f32\",\"shape\":[1.5],\"data\":\"AAAAAA==\"}", "shape"},
        {"{\"dtype\":\"f32\",\"shape\":[2],\"data\":\"AAAAAA==\"}", "data"},
        {"{\"dtype\":\"f32\",\"shape\":[1],\"data\":\"AAAA*A==\"}", "data"},
        {"{\"dtype\":\"f32\",\"shape\":[4294967296,4294967296],\"data\":\"\"}", "shape"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        qm_cval *v = NULL;
        qm_status st = {0};
        ck_assert_int_eq(qm_cval_parse(cases[i][0], strlen(cases[i][0]), &v, &st), 0);
        qm_cdtype dt;
        uint64_t shape[QM_CTENSOR_MAX_DIMS];
        int nd;
        void *data = NULL;
        size_t nb;
        ck_assert_int_lt(qm__client_codec_tensor_decode(v, &dt, shape, &nd, &data, &nb, &st), 0);
        ck_assert_msg(strcmp(st.field, cases[i][1]) == 0, "case %zu: field '%s', want '%s'", i,
                      st.field, cases[i][1]);
        ck_assert_ptr_null(data);
        qm_cval_free(v);
    }
}
END_TEST

START_TEST(test_print_escapes_controls_and_never_emits_a_newline)
{
    qm_cval *o = qm_cval_new(QM_CVAL_OBJECT);
    ck_assert_int_eq(qm_cval_append(o, "k\n", qm_cval_new_string("a\"b\\c\n\t\x01 é")), 0);
    ck_assert_int_eq(qm_cval_append(o, "n", qm_cval_new_number(9007199254740991.0)), 0);
    ck_assert_int_eq(qm_cval_append(o, "f", qm_cval_new_number(0.5)), 0);
    ck_assert_int_eq(qm_cval_append(o, "z", qm_cval_new(QM_CVAL_NULL)), 0);
    char *s = qm_cval_print(o, 0, NULL);
    ck_assert_str_eq(s, "{\"k\\n\":\"a\\\"b\\\\c\\n\\t\\u0001 é\",\"n\":9007199254740991,"
                        "\"f\":0.5,\"z\":null}");
    qm_free(s);
    qm_cval_free(o);
}
END_TEST

START_TEST(test_parse_rejects_trailing_bytes_and_deep_nesting)
{
    qm_cval *v = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_cval_parse("{} x", 4, &v, &st), QM_EPARSE);
    ck_assert_int_eq(qm_cval_parse("{}  \r\n", 6, &v, &st), 0);
    qm_cval_free(v);
    char deep[200];
    memset(deep, '[', 100);
    memset(deep + 100, ']', 100);
    ck_assert_int_eq(qm_cval_parse(deep, 200, &v, &st), QM_EPARSE);
    ck_assert_ptr_nonnull(strstr(st.msg, "deeper"));
    ck_assert_int_eq(qm_cval_parse(deep + 36, 128, &v, &st), 0); /* 64 levels pass */
    qm_cval_free(v);
}
END_TEST

START_TEST(test_request_line_is_one_json_text_and_a_newline)
{
    qm_cval *p = qm_cval_new(QM_CVAL_OBJECT);
    qm_cval_append(p, "session", qm_cval_new_string("ab"));
    size_t n = 0;
    char *line = qm__client_codec_request(7, "session.plan", p, &n);
    ck_assert_str_eq(line, "{\"jsonrpc\":\"2.0\",\"id\":7,\"method\":\"session.plan\","
                           "\"params\":{\"session\":\"ab\"}}\n");
    ck_assert_uint_eq(n, strlen(line));
    qm_free(line);
    line = qm__client_codec_request(8, "daemon.status", NULL, &n);
    ck_assert_str_eq(line, "{\"jsonrpc\":\"2.0\",\"id\":8,\"method\":\"daemon.status\"}\n");
    qm_free(line);
    qm_cval_free(p);
}
END_TEST

START_TEST(test_response_splits_result_and_error_with_data)
{
    const char *ok = "{\"jsonrpc\":\"2.0\",\"id\":3,\"result\":{\"a\":[1,2]}}";
    const char *bad = "{\"jsonrpc\":\"2.0\",\"id\":4,\"error\":{\"code\":-32602,\"message\":"
                      "\"Invalid params\",\"data\":{\"reason\":\"layer must be < 2\","
                      "\"field\":\"layer\"}}}";
    uint64_t id = 0;
    qm_cval *r = NULL;
    int is_err = 0;
    qm__client_codec_error e;
    qm_status st = {0};
    ck_assert_int_eq(qm__client_codec_response(ok, strlen(ok), &id, &r, &is_err, &e, &st), 0);
    ck_assert_uint_eq(id, 3);
    ck_assert_int_eq(is_err, 0);
    ck_assert_uint_eq(qm_cval_get(r, "a")->count, 2);
    ck_assert_ptr_null(r->key);
    qm_cval_free(r);
    ck_assert_int_eq(qm__client_codec_response(bad, strlen(bad), &id, &r, &is_err, &e, &st), 0);
    ck_assert_int_eq(is_err, 1);
    ck_assert_ptr_null(r);
    ck_assert_int_eq(e.code, -32602);
    ck_assert_str_eq(e.reason, "layer must be < 2");
    ck_assert_str_eq(e.field, "layer");
    ck_assert_str_eq(qm__client_codec_error_name(e.code), "invalid_params");
    const char *notrpc = "{\"id\":1,\"result\":{}}";
    ck_assert_int_eq(qm__client_codec_response(notrpc, strlen(notrpc), &id, &r, &is_err, &e, &st),
                     QM_EPARSE);
}
END_TEST

/* ---------- socket path ---------- */

START_TEST(test_socket_path_follows_flag_then_environment)
{
    char buf[256];
    unsetenv("QMOED_SOCKET");
    setenv("RUNTIME_DIRECTORY", "/tmp/rt", 1);
    ck_assert_int_eq(qm_client_socket_path("/x/y.sock", buf, sizeof buf), 0);
    ck_assert_str_eq(buf, "/x/y.sock");
    ck_assert_int_eq(qm_client_socket_path(NULL, buf, sizeof buf), 0);
    ck_assert_str_eq(buf, "/tmp/rt/qmoed.sock");
    setenv("QMOED_SOCKET", "/env.sock", 1);
    ck_assert_int_eq(qm_client_socket_path(NULL, buf, sizeof buf), 0);
    ck_assert_str_eq(buf, "/env.sock");
    unsetenv("QMOED_SOCKET");
    unsetenv("RUNTIME_DIRECTORY");
    ck_assert_int_eq(qm_client_socket_path(NULL, buf, sizeof buf), 0);
    if (geteuid() == 0)
        ck_assert_str_eq(buf, "/run/qmoed/qmoed.sock");
    ck_assert_int_eq(qm_client_socket_path("/a/very/long/path", buf, 8), QM_CLIENT_EINVAL);
}
END_TEST

/* ---------- a scripted fake daemon ---------- */

typedef enum {
    FAKE_ECHO,
    FAKE_SILENT,
    FAKE_STRAY_ID,
    FAKE_ERROR,
    FAKE_HANGUP_FIRST,
    FAKE_DRAINING /* a daemon whose first layer call meets its drain, then its successor */
} fake_mode;

typedef struct fake {
    char path[108];
    int listen_fd;
    fake_mode mode;
    pthread_t thread;
    int connections;
    int drained, creates; /* FAKE_DRAINING */
} fake;

static void fake_send(int fd, const char *s) { (void)!write(fd, s, strlen(s)); }

/* Answers each line: the params echoed as the result (or the mode's twist). */
static void fake_serve(fake *f, int fd)
{
    char buf[1 << 16];
    size_t len = 0;
    for (;;) {
        ssize_t r = read(fd, buf + len, sizeof buf - 1 - len);
        if (r <= 0)
            return;
        len += (size_t)r;
        char *nl;
        while ((nl = memchr(buf, '\n', len))) {
            qm_cval *req = NULL;
            qm_status st = {0};
            if (qm_cval_parse(buf, (size_t)(nl - buf), &req, &st) == 0) {
                double id = 0;
                qm_cval_get_double(req, "id", &id);
                const qm_cval *params = qm_cval_get(req, "params");
                char *pj = params ? qm_cval_print(params, 0, NULL) : NULL;
                char out[1 << 16];
                const char *method = qm_cval_get_string(req, "method");
                switch (f->mode) {
                case FAKE_DRAINING: {
                    /* session.create (under the id asked for, or a new
                     * one); the first session.infer shutting_down, every
                     * later one the hidden state back; anything else echoed. */
                    const char *sid = qm_cval_get_string(params, "session");
                    const qm_cval *hid = qm_cval_get(params, "hidden");
                    char *hj = hid ? qm_cval_print(hid, 0, NULL) : NULL;
                    if (method && strcmp(method, "session.create") == 0) {
                        f->creates++;
                        snprintf(out, sizeof out,
                                 "{\"jsonrpc\":\"2.0\",\"id\":%.0f,\"result\":{\"session\":\"%s\"}}\n",
                                 id, sid ? sid : "00112233445566778899aabbccddeeff");
                    } else if (method && strcmp(method, "session.infer") == 0 && !f->drained++) {
                        snprintf(out, sizeof out,
                                 "{\"jsonrpc\":\"2.0\",\"id\":%.0f,\"error\":{\"code\":-32007,"
                                 "\"message\":\"shutting_down\",\"data\":{\"reason\":\"the "
                                 "daemon is draining and takes no new requests\"}}}\n",
                                 id);
                    } else if (method && strcmp(method, "session.infer") == 0) {
                        snprintf(out, sizeof out,
                                 "{\"jsonrpc\":\"2.0\",\"id\":%.0f,\"result\":{\"output\":%s,"
                                 "\"stats\":{\"hits\":1}}}\n",
                                 id, hj ? hj : "{}");
                    } else {
                        snprintf(out, sizeof out, "{\"jsonrpc\":\"2.0\",\"id\":%.0f,\"result\":%s}\n",
                                 id, pj ? pj : "{}");
                    }
                    qm_free(hj);
                    fake_send(fd, out);
                    break;
                }
                case FAKE_SILENT: break;
                case FAKE_HANGUP_FIRST:
                    if (f->connections == 1) {
                        qm_free(pj);
                        qm_cval_free(req);
                        return;
                    }
                    /* fall through */
                case FAKE_ECHO:
                    snprintf(out, sizeof out, "{\"jsonrpc\":\"2.0\",\"id\":%.0f,\"result\":%s}\n", id,
                             pj ? pj : "{}");
                    fake_send(fd, out);
                    break;
                case FAKE_STRAY_ID:
                    snprintf(out, sizeof out,
                             "\n{\"jsonrpc\":\"2.0\",\"id\":%.0f,\"result\":{\"stray\":true}}\n"
                             "{\"jsonrpc\":\"2.0\",\"id\":%.0f,\"result\":{\"mine\":true}}\n",
                             id + 1000, id);
                    fake_send(fd, out);
                    break;
                case FAKE_ERROR:
                    snprintf(out, sizeof out,
                             "{\"jsonrpc\":\"2.0\",\"id\":%.0f,\"error\":{\"code\":-32001,"
                             "\"message\":\"Not found\",\"data\":{\"reason\":\"no session "
                             "'abc'\",\"field\":\"session\"}}}\n",
                             id);
                    fake_send(fd, out);
                    break;
                }
                qm_free(pj);
                qm_cval_free(req);
            }
            len -= (size_t)(nl + 1 - buf);
            memmove(buf, nl + 1, len);
        }
    }
}

static void *fake_main(void *arg)
{
    fake *f = arg;
    for (;;) {
        int fd = accept(f->listen_fd, NULL, NULL);
        if (fd < 0)
            return NULL;
        f->connections++;
        fake_serve(f, fd);
        close(fd);
    }
}

static void fake_start(fake *f, fake_mode mode)
{
    memset(f, 0, sizeof *f);
    f->mode = mode;
    snprintf(f->path, sizeof f->path, "/tmp/qmoe-client-test-%d.sock", (int)getpid());
    unlink(f->path);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", f->path);
    f->listen_fd = socket(AF_UNIX, SOCK_STREAM, 0);
    ck_assert_int_ge(f->listen_fd, 0);
    ck_assert_int_eq(bind(f->listen_fd, (struct sockaddr *)&a, sizeof a), 0);
    ck_assert_int_eq(listen(f->listen_fd, 16), 0);
    ck_assert_int_eq(pthread_create(&f->thread, NULL, fake_main, f), 0);
}

static void fake_stop(fake *f)
{
    shutdown(f->listen_fd, SHUT_RDWR);
    close(f->listen_fd);
    unlink(f->path);
    pthread_detach(f->thread); /* the child process exits right after */
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

START_TEST(test_open_says_daemon_not_running_without_a_socket)
{
    qm_client *c = NULL;
    qm_client_error err;
    ck_assert_int_eq(qm_client_open(&c, "/nonexistent/qmoed.sock", 1000, &err),
                     QM_CLIENT_ENOTRUNNING);
    ck_assert_ptr_null(c);
    ck_assert_str_eq(err.name, "not_running");
    ck_assert_ptr_nonnull(strstr(err.reason, "systemctl start qmoed"));
}
END_TEST

START_TEST(test_open_says_daemon_not_running_on_a_stale_socket)
{
    char path[108];
    snprintf(path, sizeof path, "/tmp/qmoe-client-stale-%d.sock", (int)getpid());
    unlink(path);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    close(fd); /* the file stays, nothing listens */
    qm_client *c = NULL;
    qm_client_error err;
    ck_assert_int_eq(qm_client_open(&c, path, 1000, &err), QM_CLIENT_ENOTRUNNING);
    ck_assert_ptr_nonnull(strstr(err.reason, "nothing listens"));
    unlink(path);
}
END_TEST

START_TEST(test_call_times_out_when_the_daemon_is_silent)
{
    fake f;
    fake_start(&f, FAKE_SILENT);
    qm_client *c = NULL;
    qm_client_error err;
    ck_assert_int_eq(qm_client_open(&c, f.path, 200, &err), 0);
    double t0 = now_s();
    qm_client_status s;
    ck_assert_int_eq(qm_client_daemon_status(c, &s, &err), QM_CLIENT_ETIMEDOUT);
    double dt = now_s() - t0;
    ck_assert_msg(dt >= 0.15 && dt < 2.0, "timed out after %.3f s, want about 0.2 s", dt);
    ck_assert_str_eq(err.name, "timeout");
    qm_client_close(c);
    fake_stop(&f);
}
END_TEST

START_TEST(test_call_skips_answers_to_other_ids_and_blank_lines)
{
    fake f;
    fake_start(&f, FAKE_STRAY_ID);
    qm_client *c = NULL;
    qm_client_error err;
    ck_assert_int_eq(qm_client_open(&c, f.path, 2000, &err), 0);
    char *out = NULL;
    ck_assert_int_eq(qm_client_call_json(c, "daemon.status", NULL, 0, &out, &err), 0);
    ck_assert_str_eq(out, "{\"mine\":true}");
    qm_client_string_free(out);
    qm_client_close(c);
    fake_stop(&f);
}
END_TEST

/* A layer call that meets a draining daemon (systemctl restart: new
 * requests get shutting_down) brings its session back on the next one and
 * is retried, as when the daemon was gone (it used to fail the call). */
START_TEST(test_a_layer_call_that_meets_a_drain_waits_for_the_next_daemon)
{
    fake f;
    fake_start(&f, FAKE_DRAINING);
    qm_client *c = NULL;
    qm_client_error err;
    ck_assert_int_eq(qm_client_open(&c, f.path, 2000, &err), 0);
    qm_client_session_params p = {.model = "demo", .policy = "lru"};
    char *id = NULL;
    ck_assert_msg(qm_client_session_create(c, &p, &id, NULL, &err) == 0, "%s", err.reason);
    float x[2] = {1.5f, -2.0f};
    qm_client_tensor h = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {1, 2}, .data = x,
                          .nbytes = sizeof x};
    qm_client_infer_result r;
    ck_assert_msg(qm_client_session_infer(c, id, 0, &h, NULL, 0, &r, &err) == 0, "%d %s", err.code,
                  err.reason);
    ck_assert_int_eq(f.drained, 2);
    ck_assert_int_eq(f.creates, 2); /* made, then re-created under its id */
    ck_assert_uint_eq(qm_client_restores(c), 1);
    ck_assert(memcmp(r.output.data, x, sizeof x) == 0);
    qm_client_infer_result_free(&r);
    qm_client_string_free(id);
    qm_client_close(c);
    fake_stop(&f);
}
END_TEST

START_TEST(test_call_reports_code_name_reason_and_field)
{
    fake f;
    fake_start(&f, FAKE_ERROR);
    qm_client *c = NULL;
    qm_client_error err;
    ck_assert_int_eq(qm_client_open(&c, f.path, 2000, &err), 0);
    qm_client_plan p;
    ck_assert_int_eq(qm_client_session_plan(c, "abc", &p, &err), -32001);
    ck_assert_int_eq(err.code, -32001);
    ck_assert_str_eq(err.name, "not_found");
    ck_assert_str_eq(err.reason, "no session 'abc'");
    ck_assert_str_eq(err.field, "session");
    qm_client_close(c);
    fake_stop(&f);
}
END_TEST

START_TEST(test_call_reconnects_after_the_daemon_hung_up)
{
    fake f;
    fake_start(&f, FAKE_HANGUP_FIRST);
    qm_client *c = NULL;
    qm_client_error err;
    char *out = NULL;
    ck_assert_int_eq(qm_client_open(&c, f.path, 2000, &err), 0);
    ck_assert_int_eq(qm_client_call_json(c, "x", "{\"a\":1}", 0, &out, &err), QM_CLIENT_EIO);
    ck_assert_str_eq(err.name, "connection_lost");
    ck_assert_int_eq(qm_client_call_json(c, "x", "{\"a\":2}", 0, &out, &err), 0);
    ck_assert_str_eq(out, "{\"a\":2}");
    qm_client_string_free(out);
    qm_client_close(c);
    fake_stop(&f);
}
END_TEST

START_TEST(test_typed_helpers_send_the_documented_params)
{
    fake f;
    fake_start(&f, FAKE_ECHO);
    qm_client *c = NULL;
    qm_client_error err;
    ck_assert_int_eq(qm_client_open(&c, f.path, 2000, &err), 0);
    /* The fake echoes params as the result, so the parsed result shows what went out. */
    char *sid = NULL;
    qm_client_plan_summary sum;
    qm_client_session_params sp = {.model = "demo", .policy = "lru", .budget_bytes = 1 << 20,
                                   .has_budget = 1, .policy_params_json = "{\"prefetch\":false}"};
    ck_assert_int_eq(qm_client_session_create(c, &sp, &sid, &sum, &err), QM_CLIENT_EPROTO);
    ck_assert_ptr_nonnull(strstr(err.reason, "session id"));
    char *out = NULL;
    ck_assert_int_eq(qm_client_call_json(c, "session.create",
                                         "{\"model\":\"demo\",\"budget_bytes\":1048576}", 0, &out,
                                         &err),
                     0);
    ck_assert_str_eq(out, "{\"model\":\"demo\",\"budget_bytes\":1048576}");
    qm_client_string_free(out);
    ck_assert_int_eq(qm_client_call_json(c, "x", "[1]", 0, &out, &err), QM_CLIENT_EINVAL);
    qm_client_close(c);
    fake_stop(&f);
}
END_TEST

typedef struct worker_arg {
    qm_client *c;
    int failures;
    int index;
} worker_arg;

static void *worker(void *p)
{
    worker_arg *w = p;
    for (int i = 0; i < 200; i++) {
        char params[64], want[64], *out = NULL;
        qm_client_error err;
        snprintf(params, sizeof params, "{\"t\":%d,\"i\":%d}", w->index, i);
        snprintf(want, sizeof want, "{\"t\":%d,\"i\":%d}", w->index, i);
        if (qm_client_call_json(w->c, "echo", params, 0, &out, &err) != 0 || strcmp(out, want))
            w->failures++;
        qm_client_string_free(out);
    }
    return NULL;
}

START_TEST(test_one_handle_serves_many_threads)
{
    fake f;
    fake_start(&f, FAKE_ECHO);
    qm_client *c = NULL;
    qm_client_error err;
    ck_assert_int_eq(qm_client_open(&c, f.path, 5000, &err), 0);
    pthread_t th[4];
    worker_arg w[4];
    for (int i = 0; i < 4; i++) {
        w[i] = (worker_arg){.c = c, .index = i};
        ck_assert_int_eq(pthread_create(&th[i], NULL, worker, &w[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        ck_assert_msg(w[i].failures == 0, "thread %d saw %d wrong answers", i, w[i].failures);
    }
    qm_client_close(c);
    fake_stop(&f);
}
END_TEST

START_TEST(test_close_and_frees_accept_null)
{
    qm_client_close(NULL);
    qm_client_status_free(NULL);
    qm_client_models_free(NULL, 0);
    qm_client_plan_free(NULL);
    qm_client_infer_result_free(NULL);
    qm_client_telemetry_free(NULL);
    qm_client_spans_free(NULL, 0);
    qm_client_sessions_free(NULL, 0);
    qm_client_string_free(NULL);
    qm_cval_free(NULL);
}
END_TEST

static Suite *client_suite(void)
{
    Suite *s = suite_create("client");
    TCase *codec = tcase_create("codec");
    tcase_add_test(codec, test_b64_matches_rfc4648_vectors);
    tcase_add_test(codec, test_b64_decode_rejects_malformed_input);
    tcase_add_test(codec, test_tensor_encode_rejects_shape_and_length_mismatch);
    tcase_add_test(codec, test_tensor_round_trips_through_json_text);
    tcase_add_test(codec, test_tensor_decode_names_the_field_that_is_wrong);
    tcase_add_test(codec, test_print_escapes_controls_and_never_emits_a_newline);
    tcase_add_test(codec, test_parse_rejects_trailing_bytes_and_deep_nesting);
    tcase_add_test(codec, test_request_line_is_one_json_text_and_a_newline);
    tcase_add_test(codec, test_response_splits_result_and_error_with_data);
    suite_add_tcase(s, codec);
    TCase *conn = tcase_create("connection");
    tcase_set_timeout(conn, 20);
    tcase_add_test(conn, test_socket_path_follows_flag_then_environment);
    tcase_add_test(conn, test_open_says_daemon_not_running_without_a_socket);
    tcase_add_test(conn, test_open_says_daemon_not_running_on_a_stale_socket);
    tcase_add_test(conn, test_call_times_out_when_the_daemon_is_silent);
    tcase_add_test(conn, test_call_skips_answers_to_other_ids_and_blank_lines);
    tcase_add_test(conn, test_call_reports_code_name_reason_and_field);
    tcase_add_test(conn, test_a_layer_call_that_meets_a_drain_waits_for_the_next_daemon);
    tcase_add_test(conn, test_call_reconnects_after_the_daemon_hung_up);
    tcase_add_test(conn, test_typed_helpers_send_the_documented_params);
    tcase_add_test(conn, test_one_handle_serves_many_threads);
    tcase_add_test(conn, test_close_and_frees_accept_null);
    suite_add_tcase(s, conn);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(client_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
