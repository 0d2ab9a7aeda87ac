/* test_client_live.c - libqmoe-client against the real qmoed on a temp
 * socket: every typed helper, errors as the daemon sends them, outputs that
 * do not depend on the policy, and one handle shared by threads. */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "live_daemon.h"
#include "qmoe_client.h"

#define LAYERS 2
#define EXPERTS 8
#define HIDDEN 64
#define TOKENS 4

static char dir[256], sock[300], bank[300];
static pid_t daemon_pid = -1;
/* Settings (`--set K=V`) for the daemons spawned next, NULL-terminated. */
static const char *spawn_sets[4];

/* Starts qmoed on `at` (serving the demo bank as "demo" when `with_model`)
 * and waits until it listens; its pid. */
static pid_t spawn_qmoed(const char *at, int with_model)
{
    char qmoed[512], model[400], state[400];
    snprintf(qmoed, sizeof qmoed, "%s/daemon/qmoed", getenv("QMOE_BUILD_DIR"));
    snprintf(model, sizeof model, "demo=%s", bank);
    snprintf(state, sizeof state, "%s.state", at);
    pid_t pid = fork();
    if (pid == 0) {
        char log[420];
        snprintf(log, sizeof log, "%s.log", at);
        freopen(log, "a", stdout);
        dup2(fileno(stdout), 2);
        /* qmoed refuses to run as root unless told to (CI runs as root). */
        char *argv[24] = {qmoed, "--socket", (char *)at, "--backend", "cpu", "--state-dir",
                          state, "--device-budget", "1GiB"};
        int n = 9;
        for (int i = 0; i < 3 && spawn_sets[i]; i++) {
            argv[n++] = "--set";
            argv[n++] = (char *)spawn_sets[i];
        }
        if (with_model) {
            argv[n++] = "--model";
            argv[n++] = model;
        }
        if (geteuid() == 0)
            argv[n++] = "--allow-root";
        argv[n] = NULL;
        execv(qmoed, argv);
        _exit(127);
    }
    live_wait_listening(pid, at);
    return pid;
}

/* Unchecked fixture: once, in the runner, before the forked tests. */
static void start_daemon(void)
{
    const char *build = getenv("QMOE_BUILD_DIR");
    char tool[512];
    ck_assert_msg(build != NULL, "QMOE_BUILD_DIR is not set (run through ctest)");
    snprintf(dir, sizeof dir, "/tmp/qmoe-client-live-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(sock, sizeof sock, "%s/qmoed.sock", dir);
    snprintf(bank, sizeof bank, "%s/demo.qmoe", dir);
    snprintf(tool, sizeof tool, "%s/tools/qmoe-bank/qmoe-bank", build);
    char *create[] = {tool, "create", "--out", bank, "--quiet", "--layers", "2", "--experts", "8",
                      "--hidden", "64", "--inter", "32", "--k", "2", "--bits", "4",
                      "--block-size", "32", "--activation", "silu", "--router", "--seed", "3",
                      NULL};
    ck_assert_int_eq(live_run(create), 0);
    daemon_pid = spawn_qmoed(sock, 1);
}

static void stop_daemon(void)
{
    if (daemon_pid > 0) {
        kill(daemon_pid, SIGTERM);
        waitpid(daemon_pid, NULL, 0);
    }
    char cmd[800];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    (void)!system(cmd);
}

static qm_client *connect_or_fail(void)
{
    qm_client *c = NULL;
    qm_client_error err;
    ck_assert_msg(qm_client_open(&c, sock, 30000, &err) == 0, "open: %s", err.reason);
    return c;
}

static char *create_session(qm_client *c, const char *policy, uint64_t budget)
{
    char *id = NULL;
    qm_client_plan_summary sum;
    qm_client_error err;
    qm_client_session_params p = {.model = "demo", .policy = policy, .budget_bytes = budget,
                                  .has_budget = budget != 0};
    ck_assert_msg(qm_client_session_create(c, &p, &id, &sum, &err) == 0, "create: %s", err.reason);
    ck_assert_uint_eq(sum.total, LAYERS);
    qm_client_plan_summary_free(&sum);
    return id;
}

static void fill_hidden(float *x, int seed)
{
    for (int i = 0; i < TOKENS * HIDDEN; i++)
        x[i] = (float)sin(0.37 * i + seed);
}

START_TEST(test_status_and_models_describe_the_daemon)
{
    qm_client *c = connect_or_fail();
    qm_client_status s;
    qm_client_error err;
    ck_assert_int_eq(qm_client_daemon_status(c, &s, &err), 0);
    ck_assert_str_eq(s.backend, "cpu");
    ck_assert_uint_ge(s.models, 1);
    ck_assert_uint_eq(s.device_budget_bytes, 1ull << 30);
    qm_client_status_free(&s);
    qm_client_model *m = NULL;
    size_t n = 0;
    ck_assert_int_eq(qm_client_model_list(c, &m, &n, &err), 0);
    ck_assert_uint_ge(n, 1);
    ck_assert_str_eq(m[0].name, "demo");
    ck_assert_uint_eq(m[0].layers, LAYERS);
    ck_assert_uint_eq(m[0].experts, EXPERTS);
    ck_assert_uint_eq(m[0].hidden_size, HIDDEN);
    ck_assert_uint_gt(m[0].bytes_per_expert, 0);
    ck_assert_uint_ge(m[0].bytes_total, m[0].bytes_per_expert * EXPERTS * LAYERS);
    qm_client_models_free(m, n);
    qm_client_close(c);
}
END_TEST

START_TEST(test_model_load_conflict_and_unload)
{
    qm_client *c = connect_or_fail();
    qm_client_model m;
    qm_client_error err;
    ck_assert_int_eq(qm_client_model_load(c, "live2", bank, &m, &err), 0);
    ck_assert_str_eq(m.name, "live2");
    ck_assert_str_eq(m.path, bank);
    qm_client_model_free(&m);
    ck_assert_int_eq(qm_client_model_load(c, "live2", bank, NULL, &err), -32008);
    ck_assert_str_eq(err.name, "conflict");
    ck_assert_int_eq(qm_client_model_load(c, "ghost", "/nonexistent.qmoe", NULL, &err), -32005);
    ck_assert_int_eq(qm_client_model_unload(c, "live2", 0, &err), 0);
    ck_assert_int_eq(qm_client_model_unload(c, "live2", 0, &err), -32001);
    qm_client_close(c);
}
END_TEST

START_TEST(test_session_plan_list_and_close)
{
    qm_client *c = connect_or_fail();
    qm_client_error err;
    char *id = create_session(c, "lru", 64 * 1024);
    qm_client_plan p;
    ck_assert_int_eq(qm_client_session_plan(c, id, &p, &err), 0);
    ck_assert_str_eq(p.policy, "lru");
    ck_assert_uint_eq(p.budget_bytes, 64 * 1024);
    ck_assert_uint_eq(p.n_banks, LAYERS);
    ck_assert_uint_eq(p.resident + p.degraded + (p.total - p.resident - p.degraded), p.total);
    for (size_t i = 0; i < p.n_banks; i++) {
        ck_assert_uint_eq(p.banks[i].bank, i);
        ck_assert_str_eq(p.banks[i].decision, "per_expert_candidate");
        ck_assert_uint_eq(p.banks[i].n_experts, EXPERTS);
        ck_assert_uint_gt(p.banks[i].bytes_per_expert, 0);
    }
    qm_client_plan_free(&p);
    qm_client_session_info *s = NULL;
    size_t n = 0;
    ck_assert_int_eq(qm_client_session_list(c, &s, &n, &err), 0);
    int found = 0;
    for (size_t i = 0; i < n; i++)
        if (strcmp(s[i].session, id) == 0) {
            found = 1;
            ck_assert_str_eq(s[i].model, "demo");
            ck_assert_uint_eq(s[i].owner_uid, geteuid());
            ck_assert_uint_le(s[i].resident_bytes, s[i].budget_bytes);
            ck_assert(s[i].created_at > 0);
        }
    ck_assert(found);
    qm_client_sessions_free(s, n);
    ck_assert_int_eq(qm_client_session_close(c, id, &err), 0);
    ck_assert_int_eq(qm_client_session_plan(c, id, &p, &err), -32001);
    ck_assert_str_eq(err.name, "not_found");
    qm_client_string_free(id);
    qm_client_close(c);
}
END_TEST

START_TEST(test_infer_output_does_not_depend_on_policy_or_budget)
{
    qm_client *c = connect_or_fail();
    qm_client_error err;
    char *whole = create_session(c, NULL, 0), *paged = create_session(c, "lru", 16 * 1024);
    float x[TOKENS * HIDDEN];
    fill_hidden(x, 1);
    qm_client_tensor h = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {TOKENS, HIDDEN},
                          .data = x, .nbytes = sizeof x};
    for (uint64_t layer = 0; layer < LAYERS; layer++) {
        qm_client_infer_result a, b;
        ck_assert_msg(qm_client_session_infer(c, whole, layer, &h, NULL, 1, &a, &err) == 0, "%s",
                      err.reason);
        ck_assert_msg(qm_client_session_infer(c, paged, layer, &h, NULL, 0, &b, &err) == 0, "%s",
                      err.reason);
        ck_assert_int_eq(a.output.dtype, QM_CLIENT_F32);
        ck_assert_int_eq(a.output.ndim, 2);
        ck_assert_uint_eq(a.output.shape[0], TOKENS);
        ck_assert_uint_eq(a.output.nbytes, sizeof x);
        ck_assert_msg(memcmp(a.output.data, b.output.data, sizeof x) == 0,
                      "layer %llu: whole_bank and lru outputs differ", (unsigned long long)layer);
        ck_assert_uint_eq(a.routing_tokens, TOKENS);
        ck_assert_uint_eq(a.routing_offsets[TOKENS], TOKENS * 2);
        ck_assert_uint_eq(b.routing_tokens, 0);
        ck_assert_uint_gt(b.stats.misses + b.stats.hits, 0);
        qm_client_infer_result_free(&a);
        qm_client_infer_result_free(&b);
    }
    qm_client_telemetry t;
    ck_assert_int_eq(qm_client_telemetry_get(c, paged, &t, &err), 0);
    ck_assert_uint_eq(t.n_sessions, 1);
    ck_assert_uint_eq(t.sessions[0].counters.requests, LAYERS);
    ck_assert_uint_eq(t.sessions[0].counters.tokens, LAYERS * TOKENS);
    ck_assert_uint_gt(t.sessions[0].counters.bytes_paged_h2d, 0);
    qm_client_telemetry_free(&t);
    qm_client_session_close(c, whole, &err);
    qm_client_session_close(c, paged, &err);
    qm_client_string_free(whole);
    qm_client_string_free(paged);
    qm_client_close(c);
}
END_TEST

/* The zero-copy call: inputs and output in a shared map, bit for bit what
 * the base64 call answers; bad regions name their field; release unmaps. */
START_TEST(test_mapped_infer_equals_base64_without_a_copy)
{
    qm_client *c = connect_or_fail();
    qm_client_error err;
    char *sid = create_session(c, NULL, 0);
    qm_client_map m;
    ck_assert_msg(qm_client_map_create(c, sid, 1 << 16, &m, &err) == 0, "map: %s", err.reason);
    ck_assert_uint_gt(m.id, 0);
    float x[TOKENS * HIDDEN];
    fill_hidden(x, 3);
    memcpy(m.data, x, sizeof x);
    qm_client_tensor h = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {TOKENS, HIDDEN},
                          .data = x, .nbytes = sizeof x};
    qm_client_infer_result want;
    ck_assert_int_eq(qm_client_session_infer(c, sid, 1, &h, NULL, 0, &want, &err), 0);
    uint64_t out_off = (sizeof x + 63) / 64 * 64;
    qm_client_mapped_infer q = {.session = sid, .layer = 1, .map = &m,
                                .hidden = {QM_CLIENT_F32, TOKENS, HIDDEN, 0},
                                .output_offset = out_off};
    qm_client_infer_stats st;
    ck_assert_msg(qm_client_session_infer_mapped(c, &q, &st, &err) == 0, "%s", err.reason);
    ck_assert(memcmp((char *)m.data + out_off, want.output.data, sizeof x) == 0);
    ck_assert_uint_gt(st.hits + st.misses, 0);
    q.output_offset = 1 << 16; /* past the end */
    ck_assert_int_eq(qm_client_session_infer_mapped(c, &q, NULL, &err), -32602);
    ck_assert_str_eq(err.field, "output_to.offset");
    q.output_offset = 32; /* not a multiple of 64 */
    ck_assert_int_eq(qm_client_session_infer_mapped(c, &q, NULL, &err), -32602);
    ck_assert_str_eq(err.field, "output_to.offset");
    qm_client_infer_result_free(&want);
    ck_assert_int_eq(qm_client_map_release(c, &m, &err), 0);
    ck_assert_ptr_null(m.data);
    ck_assert_int_eq(qm_client_map_release(c, &m, &err), 0); /* twice is harmless */
    qm_client_session_close(c, sid, &err);
    qm_client_string_free(sid);
    qm_client_close(c);
}
END_TEST

START_TEST(test_infer_errors_carry_the_field)
{
    qm_client *c = connect_or_fail();
    qm_client_error err;
    char *id = create_session(c, NULL, 0);
    float x[HIDDEN + 1] = {0};
    qm_client_tensor h = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {1, HIDDEN + 1}, .data = x,
                          .nbytes = sizeof x};
    qm_client_infer_result r;
    ck_assert_int_eq(qm_client_session_infer(c, id, 0, &h, NULL, 0, &r, &err), -32602);
    ck_assert_str_eq(err.name, "invalid_params");
    ck_assert_msg(strncmp(err.field, "hidden", 6) == 0, "field '%s'", err.field);
    h.shape[1] = HIDDEN;
    h.nbytes = HIDDEN * sizeof(float);
    ck_assert_int_eq(qm_client_session_infer(c, id, LAYERS, &h, NULL, 0, &r, &err), -32602);
    ck_assert_str_eq(err.field, "layer");
    h.nbytes = 3; /* caught before anything is sent */
    ck_assert_int_eq(qm_client_session_infer(c, id, 0, &h, NULL, 0, &r, &err), QM_CLIENT_EINVAL);
    qm_client_session_close(c, id, &err);
    qm_client_string_free(id);
    qm_client_close(c);
}
END_TEST

/* Routing supplied by the engine: the daemon's own routes given back yield
 * the same bits; a repeated id is -32602 naming topk_ids. */
START_TEST(test_infer_routed_by_the_engine_uses_ids_and_weights_as_given)
{
    qm_client *c = connect_or_fail();
    qm_client_error err;
    char *id = create_session(c, NULL, 0);
    float x[TOKENS * HIDDEN];
    fill_hidden(x, 3);
    qm_client_tensor h = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {TOKENS, HIDDEN},
                          .data = x, .nbytes = sizeof x};
    qm_client_infer_result a, b;
    ck_assert_msg(qm_client_session_infer(c, id, 0, &h, NULL, 1, &a, &err) == 0, "%s",
                  err.reason);
    int32_t ids[TOKENS * 2];
    float w[TOKENS * 2];
    for (size_t t = 0; t < TOKENS; t++)
        for (size_t j = 0; j < 2; j++) {
            size_t at = a.routing_offsets[t] + j;
            int has = at < a.routing_offsets[t + 1];
            ids[t * 2 + j] = has ? (int32_t)a.routing_experts[at] : -1;
            w[t * 2 + j] = has ? (float)a.routing_weights[at] : 0.0f;
        }
    qm_client_tensor ti = {.dtype = QM_CLIENT_I32, .ndim = 2, .shape = {TOKENS, 2}, .data = ids,
                           .nbytes = sizeof ids};
    qm_client_tensor tw = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {TOKENS, 2}, .data = w,
                           .nbytes = sizeof w};
    ck_assert_msg(qm_client_session_infer_routed(c, id, 0, &h, &ti, &tw, 0, &b, &err) == 0, "%s",
                  err.reason);
    ck_assert(memcmp(a.output.data, b.output.data, sizeof x) == 0);
    qm_client_infer_result_free(&a);
    qm_client_infer_result_free(&b);
    ids[1] = ids[0] >= 0 ? ids[0] : 0;
    ids[0] = ids[1];
    ck_assert_int_eq(qm_client_session_infer_routed(c, id, 0, &h, &ti, &tw, 0, &b, &err), -32602);
    ck_assert_str_eq(err.field, "topk_ids");
    ck_assert_int_eq(qm_client_session_infer_routed(c, id, 0, &h, &ti, NULL, 0, &b, &err),
                     QM_CLIENT_EINVAL);
    qm_client_session_close(c, id, &err);
    qm_client_string_free(id);
    qm_client_close(c);
}
END_TEST

START_TEST(test_trace_metrics_and_daemon_telemetry)
{
    qm_client *c = connect_or_fail();
    qm_client_error err;
    char *id = create_session(c, "lfu", 0);
    qm_client_span *s = NULL;
    size_t n = 0;
    ck_assert_int_eq(qm_client_telemetry_trace(c, id, 0, &s, &n, &err), 0);
    int plan_span = 0;
    for (size_t i = 0; i < n; i++)
        if (strcmp(s[i].name, "session.residency_plan") == 0 && s[i].session &&
            strcmp(s[i].session, id) == 0 && strstr(s[i].args_json, "\"policy\":\"lfu\""))
            plan_span = 1;
    ck_assert_msg(plan_span, "no session.residency_plan span for the new session");
    qm_client_spans_free(s, n);
    ck_assert_int_eq(qm_client_telemetry_trace(c, NULL, 1, &s, &n, &err), 0);
    ck_assert_uint_eq(n, 1);
    qm_client_spans_free(s, n);
    char *text = NULL;
    ck_assert_int_eq(qm_client_telemetry_metrics(c, &text, &err), 0);
    ck_assert_ptr_nonnull(strstr(text, "# TYPE qmoed_"));
    qm_client_string_free(text);
    qm_client_telemetry t;
    ck_assert_int_eq(qm_client_telemetry_get(c, NULL, &t, &err), 0);
    ck_assert_int_eq(t.has_daemon, 1);
    ck_assert_uint_gt(t.daemon.requests, 0);
    qm_client_telemetry_free(&t);
    qm_client_session_close(c, id, &err);
    qm_client_string_free(id);
    qm_client_close(c);
}
END_TEST

typedef struct shared_arg {
    qm_client *c;
    const char *session;
    const float *want;
    int layer, failures;
} shared_arg;

static void *infer_worker(void *p)
{
    shared_arg *a = p;
    float x[TOKENS * HIDDEN];
    fill_hidden(x, 2);
    qm_client_tensor h = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {TOKENS, HIDDEN}, .data = x,
                          .nbytes = sizeof x};
    for (int i = 0; i < 20; i++) {
        qm_client_infer_result r;
        qm_client_error err;
        if (qm_client_session_infer(a->c, a->session, (uint64_t)a->layer, &h, NULL, 0, &r, &err) ||
            memcmp(r.output.data, a->want, sizeof x) != 0)
            a->failures++;
        qm_client_infer_result_free(&r);
    }
    return NULL;
}

START_TEST(test_one_handle_shared_by_threads_gets_every_answer_right)
{
    qm_client *c = connect_or_fail();
    qm_client_error err;
    char *id = create_session(c, "lru", 16 * 1024);
    float x[TOKENS * HIDDEN], want[LAYERS][TOKENS * HIDDEN];
    fill_hidden(x, 2);
    qm_client_tensor h = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {TOKENS, HIDDEN}, .data = x,
                          .nbytes = sizeof x};
    for (int l = 0; l < LAYERS; l++) {
        qm_client_infer_result r;
        ck_assert_int_eq(qm_client_session_infer(c, id, (uint64_t)l, &h, NULL, 0, &r, &err), 0);
        memcpy(want[l], r.output.data, sizeof x);
        qm_client_infer_result_free(&r);
    }
    pthread_t th[4];
    shared_arg a[4];
    for (int i = 0; i < 4; i++) {
        a[i] = (shared_arg){.c = c, .session = id, .want = want[i % LAYERS], .layer = i % LAYERS};
        ck_assert_int_eq(pthread_create(&th[i], NULL, infer_worker, &a[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        ck_assert_msg(a[i].failures == 0, "thread %d: %d wrong answers", i, a[i].failures);
    }
    qm_client_session_close(c, id, &err);
    qm_client_string_free(id);
    qm_client_close(c);
}
END_TEST

/* -1 when `id` is not in session.list, else whether the daemon marks it
 * orphaned. */
static int listed(const char *id)
{
    qm_client *c = connect_or_fail();
    qm_client_session_info *s = NULL;
    size_t n = 0;
    qm_client_error err;
    ck_assert_msg(qm_client_session_list(c, &s, &n, &err) == 0, "list: %s", err.reason);
    int state = -1;
    for (size_t i = 0; i < n; i++)
        if (strcmp(s[i].session, id) == 0)
            state = s[i].orphaned_since >= 0;
    qm_client_sessions_free(s, n);
    qm_client_close(c);
    return state;
}

/* Runs `child` in a forked process and returns its exit status. The id it
 * made comes back through a pipe. */
static int in_child(void (*child)(int out_fd), char *id, size_t cap)
{
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    pid_t p = fork();
    if (p == 0) {
        close(fds[0]);
        child(fds[1]);
        _exit(99); /* the child leaves by exit() itself */
    }
    close(fds[1]);
    ssize_t got = read(fds[0], id, cap - 1);
    close(fds[0]);
    id[got > 0 ? got : 0] = '\0';
    int st = 0;
    waitpid(p, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Creates a session, maps memory into it, and leaves by exit(0) without
 * closing the session or the handle. */
static void exits_without_closing(int out_fd)
{
    qm_client *c = connect_or_fail();
    char *id = create_session(c, "lru", 64 * 1024);
    qm_client_map m;
    qm_client_error err;
    if (qm_client_map_create(c, id, 1 << 16, &m, &err) != 0)
        exit(3);
    (void)!write(out_fd, id, strlen(id));
    exit(0);
}

START_TEST(test_a_program_that_exits_without_closing_leaves_no_session)
{
    char id[128];
    ck_assert_int_eq(in_child(exits_without_closing, id, sizeof id), 0);
    ck_assert_uint_gt(strlen(id), 0);
    ck_assert_int_eq(listed(id), -1); /* closed at exit, not left to the reclaim */
}
END_TEST

START_TEST(test_close_closes_what_the_handle_owns_and_nothing_else)
{
    qm_client *c = connect_or_fail(), *other = connect_or_fail();
    qm_client_error err;
    char *mine = create_session(c, "lru", 64 * 1024);
    char *closed = create_session(c, "lru", 64 * 1024);
    char *kept = create_session(c, "lru", 64 * 1024);
    char *theirs = create_session(other, "lru", 64 * 1024);
    ck_assert_int_eq(qm_client_session_close(c, closed, &err), 0);
    ck_assert_int_eq(qm_client_session_detach(c, kept, &err), 0);
    ck_assert_int_eq(qm_client_session_detach(c, kept, &err), QM_CLIENT_EINVAL);
    ck_assert_int_eq(qm_client_session_detach(c, theirs, &err), QM_CLIENT_EINVAL);
    qm_client_close(c);
    ck_assert_int_eq(listed(mine), -1);
    ck_assert_int_eq(listed(closed), -1);
    ck_assert_int_eq(listed(theirs), 0); /* another handle's, still in use */
    ck_assert_int_eq(listed(kept), 1);   /* detached: outlives the handle, orphaned */
    /* The next run of the engine takes it back; its handle closes it. */
    qm_client *next = connect_or_fail();
    ck_assert_int_eq(qm_client_session_adopt(next, kept, &err), 0);
    ck_assert_int_eq(listed(kept), 0); /* in use again */
    ck_assert_int_eq(qm_client_session_adopt(next, "0123456789abcdef0123456789abcdef", &err),
                     -32001);
    ck_assert_str_eq(err.name, "not_found");
    qm_client_close(next);
    ck_assert_int_eq(listed(kept), -1);
    qm_client_close(other);
    ck_assert_int_eq(listed(theirs), -1);
    qm_client_string_free(mine);
    qm_client_string_free(closed);
    qm_client_string_free(kept);
    qm_client_string_free(theirs);
}
END_TEST

static qm_client *forked_handle;

static void closes_a_copy_of_its_parents_handle(int out_fd)
{
    (void)out_fd;
    qm_client_close(forked_handle);
    exit(0);
}

START_TEST(test_a_forked_child_never_closes_its_parents_sessions)
{
    qm_client *c = connect_or_fail();
    qm_client_error err;
    char *id = create_session(c, "lru", 64 * 1024);
    forked_handle = c;
    char none[8];
    ck_assert_int_eq(in_child(closes_a_copy_of_its_parents_handle, none, sizeof none), 0);
    ck_assert_int_eq(listed(id), 0);
    qm_client_plan p;
    ck_assert_int_eq(qm_client_session_plan(c, id, &p, &err), 0); /* the parent's connection */
    qm_client_plan_free(&p);
    qm_client_close(c);
    ck_assert_int_eq(listed(id), -1);
    qm_client_string_free(id);
}
END_TEST

/* ---- across a daemon restart (qmoe_client.h) ---- */

static char said[8192]; /* the handle's log lines */

static void collect(void *ud, const char *line)
{
    (void)ud;
    size_t n = strlen(said);
    snprintf(said + n, sizeof said - n, "%s\n", line);
}

/* A daemon of the test's own on DIR/NAME.sock (path in `at`), and a handle on it. */
static qm_client *own_daemon(char *at, size_t cap, const char *name, pid_t *pid)
{
    snprintf(at, cap, "%s/%s.sock", dir, name);
    *pid = spawn_qmoed(at, 1);
    qm_client *c = NULL;
    qm_client_error err;
    ck_assert_msg(qm_client_open(&c, at, 30000, &err) == 0, "open: %s", err.reason);
    return c;
}

static void kill_qmoed(pid_t pid)
{
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* One token through `layer` with the engine's routing, all in the map: x at
 * 0, ids at 256, weights at 320, the output at 384. */
static int one_token(qm_client *c, const char *id, const qm_client_map *m, uint64_t layer,
                     qm_client_infer_stats *st, qm_client_error *err)
{
    const qm_client_region ids = {QM_CLIENT_I32, 1, 2, 256}, w = {QM_CLIENT_F32, 1, 2, 320};
    qm_client_mapped_infer q = {.session = id, .layer = layer, .map = m,
                                .hidden = {QM_CLIENT_F32, 1, HIDDEN, 0},
                                .topk_ids = &ids, .topk_weights = &w, .output_offset = 384};
    return qm_client_session_infer_mapped(c, &q, st, err);
}

/* One call of TOKENS rows through layer 0 with the hidden states of `seed`,
 * sent in base64 (no map): its return code. */
static int base64_call(qm_client *c, const char *id, int seed, qm_client_error *err)
{
    float x[TOKENS * HIDDEN];
    fill_hidden(x, seed);
    qm_client_tensor h = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {TOKENS, HIDDEN},
                          .data = x, .nbytes = sizeof x};
    qm_client_infer_result r;
    int rc = qm_client_session_infer(c, id, 0, &h, NULL, 0, &r, err);
    if (rc == 0)
        qm_client_infer_result_free(&r);
    return rc;
}

/* SIGKILL and restart under a paged session with a map: the next layer call
 * brings the session back under its id (restarted with the model; then
 * without it, the handle loading its bank), warm from its last plan, and
 * gives the same bits; a daemon that never comes back fails the call with
 * the error it met, once the window passes. */
START_TEST(test_a_session_outlives_a_daemon_restart)
{
    char at[400];
    pid_t d;
    qm_client *c = own_daemon(at, sizeof at, "restart", &d);
    qm_client_error err;
    qm_client_reconnect o;
    qm_client_get_reconnect(c, &o);
    ck_assert_int_eq(o.window_ms, QM_CLIENT_DEFAULT_RECONNECT_MS);
    o.warm_interval_ms = 0;
    o.log = collect;
    qm_client_set_reconnect(c, &o);
    qm_client_model *models = NULL;
    size_t n_models = 0;
    ck_assert_int_eq(qm_client_model_list(c, &models, &n_models, &err), 0);
    uint64_t bpe = models[0].bytes_per_expert;
    qm_client_models_free(models, n_models);
    qm_client_session_params p = {.model = "demo", .policy = "lru", .budget_bytes = 4 * bpe,
                                  .has_budget = 1, .policy_params_json = "{\"prefetch\":false}"};
    char *id = NULL;
    ck_assert_msg(qm_client_session_create(c, &p, &id, NULL, &err) == 0, "%s", err.reason);
    qm_client_map m;
    ck_assert_int_eq(qm_client_map_create(c, id, 4096, &m, &err), 0);
    float *x = m.data, want[2][HIDDEN];
    int32_t *ids = (int32_t *)((char *)m.data + 256);
    float *w = (float *)((char *)m.data + 320), *y = (float *)((char *)m.data + 384);
    fill_hidden(x, 9); /* TOKENS rows; the call reads the first */
    ids[0] = 1, ids[1] = 6, w[0] = 0.75f, w[1] = 0.25f;
    qm_client_infer_stats st;
    for (int l = 0; l < 2; l++) {
        ck_assert_int_eq(one_token(c, id, &m, (uint64_t)l, &st, &err), 0);
        ck_assert_uint_eq(st.misses, 2);
        memcpy(want[l], y, sizeof want[l]);
    }

    /* Restarted with its model: the session is back, warm, same bits. */
    kill_qmoed(d);
    d = spawn_qmoed(at, 1);
    memset(y, 0, HIDDEN * sizeof(float));
    ck_assert_msg(one_token(c, id, &m, 0, &st, &err) == 0, "%s", err.reason);
    ck_assert_uint_eq(qm_client_restores(c), 1);
    ck_assert_uint_eq(st.hits, 2);
    ck_assert_uint_eq(st.misses, 0);
    ck_assert(memcmp(y, want[0], sizeof want[0]) == 0);
    ck_assert_int_eq(one_token(c, id, &m, 1, &st, &err), 0);
    ck_assert_uint_eq(st.hits, 2);
    ck_assert(memcmp(y, want[1], sizeof want[1]) == 0);
    ck_assert_ptr_nonnull(strstr(said, "went away"));
    ck_assert_ptr_nonnull(strstr(said, "is back after"));
    ck_assert_ptr_nonnull(strstr(said, "4 experts warm"));
    ck_assert_int_eq(qm_client_ring_active(c, id), 1);

    /* Restarted, and the handle reconnected by another call first: the
     * layer call finds a daemon without the session when it opens the
     * ring; the session comes back and its calls take the ring again (they
     * used to stay on the socket for good). */
    kill_qmoed(d);
    d = spawn_qmoed(at, 1);
    qm_client_model *again = NULL;
    size_t n_again = 0;
    /* The first call meets the broken connection; the next reconnects. */
    ck_assert_int_eq(qm_client_model_list(c, &again, &n_again, &err), QM_CLIENT_EIO);
    ck_assert_int_eq(qm_client_model_list(c, &again, &n_again, &err), 0);
    qm_client_models_free(again, n_again);
    ck_assert_msg(one_token(c, id, &m, 0, &st, &err) == 0, "%s", err.reason);
    ck_assert_uint_eq(qm_client_restores(c), 2);
    ck_assert(memcmp(y, want[0], sizeof want[0]) == 0);
    ck_assert_int_eq(qm_client_ring_active(c, id), 1);

    /* Restarted without it: the handle loads the bank it was told of. */
    ck_assert_int_eq(qm_client_set_model_bank(c, "demo", bank, &err), 0);
    kill_qmoed(d);
    d = spawn_qmoed(at, 0);
    ck_assert_msg(one_token(c, id, &m, 1, &st, &err) == 0, "%s", err.reason);
    ck_assert_uint_eq(qm_client_restores(c), 3);
    ck_assert(memcmp(y, want[1], sizeof want[1]) == 0);
    ck_assert_ptr_nonnull(strstr(said, "its model loaded again from its bank"));

    /* Gone for good: the call fails with the error it met once the window
     * (1 s here) has passed. */
    o.window_ms = 1000;
    qm_client_set_reconnect(c, &o);
    kill_qmoed(d);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ck_assert_int_eq(one_token(c, id, &m, 0, &st, &err), QM_CLIENT_EIO);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double took = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
    ck_assert_msg(took >= 0.9 && took < 5.0, "the call failed after %.2f s", took);
    ck_assert_msg(strstr(err.reason, "qmoed closed the connection") != NULL, "%s", err.reason);
    ck_assert_ptr_nonnull(strstr(said, "giving up on session"));
    ck_assert_uint_eq(qm_client_restores(c), 3);
    qm_client_map_release(NULL, &m, &err);
    qm_client_string_free(id);
    qm_client_close(c);
}
END_TEST

/* The daemon reclaims a map once the connection that last used it has been
 * closed for session_orphan_timeout_s while its session lives on (another
 * connection keeps it): here the handle's connection, closed for being
 * idle (its calls on the socket: a connection with a call ring open is
 * never idle-closed). The handle's next mapped call passes the map again
 * from its kept memfd and gives the same bits (without that it would fail
 * with "hidden.map N is not a map of this session"). */
START_TEST(test_a_map_the_daemon_reclaimed_is_passed_again)
{
    char at[400];
    pid_t d;
    spawn_sets[0] = "idle_timeout_s=1";
    spawn_sets[1] = "session_orphan_timeout_s=1";
    qm_client *c = own_daemon(at, sizeof at, "map-again", &d);
    spawn_sets[0] = spawn_sets[1] = NULL;
    qm_client_set_ring(c, QM_CLIENT_RING_OFF);
    qm_client_error err;
    qm_client_reconnect o;
    qm_client_get_reconnect(c, &o);
    o.log = collect;
    qm_client_set_reconnect(c, &o);
    char *id = create_session(c, NULL, 0);
    qm_client_map m;
    ck_assert_int_eq(qm_client_map_create(c, id, 4096, &m, &err), 0);
    float *x = m.data, want[HIDDEN];
    int32_t *ids = (int32_t *)((char *)m.data + 256);
    float *w = (float *)((char *)m.data + 320), *y = (float *)((char *)m.data + 384);
    fill_hidden(x, 11);
    ids[0] = 2, ids[1] = 5, w[0] = 0.5f, w[1] = 0.5f;
    qm_client_infer_stats st;
    ck_assert_int_eq(one_token(c, id, &m, 0, &st, &err), 0);
    memcpy(want, y, sizeof want);
    uint64_t first_id = m.id;
    /* A second handle keeps the session, its connection never idle. */
    qm_client *keeper = NULL;
    ck_assert_int_eq(qm_client_open(&keeper, at, 30000, &err), 0);
    for (int i = 0; i < 12; i++) { /* 3.6 s: past the idle close and the map's reclaim */
        char params[200], *plan = NULL;
        snprintf(params, sizeof params, "{\"session\":\"%s\"}", id);
        ck_assert_msg(qm_client_call_json(keeper, "session.plan", params, 0, &plan, &err) == 0,
                      "%s", err.reason);
        qm_client_string_free(plan);
        usleep(300000);
    }
    memset(y, 0, HIDDEN * sizeof(float));
    ck_assert_msg(one_token(c, id, &m, 0, &st, &err) == 0, "%s", err.reason);
    ck_assert(memcmp(y, want, sizeof want) == 0);
    ck_assert_uint_ne(m.id, first_id);
    ck_assert_msg(strstr(said, "no longer held map") != NULL, "%s", said);
    /* The session never went: the reconnection found it ("the daemon
     * still had it"), its map alone was passed again. */
    ck_assert_ptr_nonnull(strstr(said, "the daemon still had it"));
    qm_client_close(keeper);
    qm_client_map_release(c, &m, &err);
    qm_client_session_close(c, id, &err);
    qm_client_string_free(id);
    qm_client_close(c);
    kill_qmoed(d);
}
END_TEST

/* One handle, four threads, a session each (two of them with mapped calls,
 * through the call ring), calling across three SIGKILLs
 * and three graceful restarts (SIGTERM: the drain answers new requests
 * shutting_down): every call answers with the first pass's bits. A thread
 * whose session another thread's restore did not bring back restores its
 * own (it used to take the other's restore for its own, and its retry met
 * "no such session"); a call a draining daemon refuses waits for the next
 * one (it used to fail). */
typedef struct restart_arg {
    qm_client *c;
    char *id;
    const float *want;
    qm_client_map *m; /* mapped calls (one_token: the call ring), or socket ones */
    int layer;
    volatile int *go, *stop;
    int calls, failures, oks; /* the worker's (atomic: the test's thread reads them) */
    char last[200];
} restart_arg;

/* Until every thread has had a call answered right since this was called
 * (at most 60 s): each has brought its session back to the daemon now
 * running. */
static void wait_each_answered(restart_arg *a, int n)
{
    int base[4];
    for (int i = 0; i < n; i++)
        base[i] = __atomic_load_n(&a[i].oks, __ATOMIC_ACQUIRE);
    for (int waited_ms = 0; waited_ms < 60000; waited_ms++) {
        int all = 1;
        for (int i = 0; i < n; i++)
            all &= __atomic_load_n(&a[i].oks, __ATOMIC_ACQUIRE) > base[i];
        if (all)
            return;
        usleep(1000);
    }
}

static void *restart_worker(void *p)
{
    restart_arg *a = p;
    float x[TOKENS * HIDDEN];
    fill_hidden(x, 5);
    qm_client_tensor h = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {TOKENS, HIDDEN}, .data = x,
                          .nbytes = sizeof x};
    while (!*a->go)
        usleep(100);
    while (!*a->stop) {
        qm_client_infer_result r;
        qm_client_error err;
        int rc, same;
        if (a->m) {
            qm_client_infer_stats st;
            float *y = (float *)((char *)a->m->data + 384);
            memset(y, 0, HIDDEN * sizeof(float));
            rc = one_token(a->c, a->id, a->m, (uint64_t)a->layer, &st, &err);
            same = rc == 0 && memcmp(y, a->want, HIDDEN * sizeof(float)) == 0;
        } else {
            rc = qm_client_session_infer(a->c, a->id, (uint64_t)a->layer, &h, NULL, 0, &r, &err);
            same = rc == 0 && memcmp(r.output.data, a->want, sizeof x) == 0;
            if (rc == 0)
                qm_client_infer_result_free(&r);
        }
        if (!same) {
            snprintf(a->last, sizeof a->last, "rc %d: %.150s", rc, rc ? err.reason : "wrong bits");
            __atomic_add_fetch(&a->failures, 1, __ATOMIC_RELEASE);
        } else {
            __atomic_add_fetch(&a->oks, 1, __ATOMIC_RELEASE);
        }
        __atomic_add_fetch(&a->calls, 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

START_TEST(test_threads_of_one_handle_each_bring_their_session_back)
{
    char at[400];
    pid_t d;
    qm_client *c = own_daemon(at, sizeof at, "threads", &d);
    qm_client_error err;
    qm_client_reconnect o;
    qm_client_get_reconnect(c, &o);
    o.warm_interval_ms = -1;
    o.log = collect;
    qm_client_set_reconnect(c, &o);
    float x[TOKENS * HIDDEN], want[4][TOKENS * HIDDEN];
    fill_hidden(x, 5);
    qm_client_tensor h = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {TOKENS, HIDDEN}, .data = x,
                          .nbytes = sizeof x};
    volatile int go = 0, stop = 0;
    restart_arg a[4];
    pthread_t th[4];
    qm_client_map maps[4];
    const char *policies[4] = {"lru", "whole_bank", "lfu", "next_use"};
    for (int i = 0; i < 4; i++) {
        a[i] = (restart_arg){.c = c, .layer = i % LAYERS, .go = &go, .stop = &stop};
        qm_client_session_params p = {.model = "demo", .policy = policies[i]};
        ck_assert_msg(qm_client_session_create(c, &p, &a[i].id, NULL, &err) == 0, "%s", err.reason);
        if (i >= 2) { /* threads 2 and 3: mapped calls, through the call ring */
            ck_assert_int_eq(qm_client_map_create(c, a[i].id, 4096, &maps[i], &err), 0);
            a[i].m = &maps[i];
            char *base = maps[i].data;
            fill_hidden((float *)base, 11 + i);
            int32_t *ids = (int32_t *)(base + 256);
            float *w = (float *)(base + 320);
            ids[0] = i, ids[1] = 7 - i, w[0] = 0.6f, w[1] = 0.4f;
            qm_client_infer_stats st;
            ck_assert_int_eq(one_token(c, a[i].id, a[i].m, (uint64_t)a[i].layer, &st, &err), 0);
            memcpy(want[i], base + 384, HIDDEN * sizeof(float));
            ck_assert_int_eq(qm_client_ring_active(c, a[i].id), 1);
        } else {
            qm_client_infer_result r;
            ck_assert_int_eq(qm_client_session_infer(c, a[i].id, (uint64_t)a[i].layer, &h, NULL,
                                                     0, &r, &err),
                             0);
            memcpy(want[i], r.output.data, sizeof x);
            qm_client_infer_result_free(&r);
        }
        a[i].want = want[i];
        ck_assert_int_eq(pthread_create(&th[i], NULL, restart_worker, &a[i]), 0);
    }
    go = 1;
    /* Each restart comes once every thread is back on the daemon before it
     * (a client retries a call once after bringing its session back: a
     * restart that lands inside that retry fails the call by design, and
     * under a sanitizer on a loaded machine a bring-back can outlast a
     * fixed interval). */
    for (int k = 0; k < 6; k++) {
        wait_each_answered(a, 4);
        usleep(20000);
        if (k < 3) {
            kill_qmoed(d);
        } else { /* systemctl restart: a drain, whose new requests get shutting_down */
            kill(d, SIGTERM);
            waitpid(d, NULL, 0);
        }
        d = spawn_qmoed(at, 1);
    }
    wait_each_answered(a, 4);
    stop = 1;
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        size_t n = strlen(said);
        ck_assert_msg(a[i].failures == 0, "thread %d: %d of %d calls failed, the last: %s; log: %s",
                      i, a[i].failures, a[i].calls, a[i].last, said + (n > 300 ? n - 300 : 0));
        ck_assert_int_gt(a[i].calls, 0);
    }
    ck_assert_uint_ge(qm_client_restores(c), 6);
    for (int i = 0; i < 4; i++) {
        if (a[i].m) { /* back on the ring after every restart */
            ck_assert_int_eq(qm_client_ring_active(c, a[i].id), 1);
            qm_client_map_release(c, a[i].m, &err);
        }
        qm_client_session_close(c, a[i].id, &err);
        qm_client_string_free(a[i].id);
    }
    qm_client_close(c);
    kill_qmoed(d);
}
END_TEST

/* client_pending_bytes is what the client takes after session.create: by a
 * restart it has taken them, so the session the handle brings back is
 * created without them (the daemon's reason for its auto budget names
 * them before the restart, not after). */
START_TEST(test_a_session_brought_back_is_not_given_its_pending_bytes_again)
{
    char at[400];
    pid_t d;
    qm_client *c = own_daemon(at, sizeof at, "pending", &d);
    qm_client_error err;
    qm_client_session_params p = {.model = "demo", .budget = "auto",
                                  .client_pending_bytes = 1 << 20};
    char *id = NULL;
    qm_client_plan_summary sum;
    ck_assert_msg(qm_client_session_create(c, &p, &id, &sum, &err) == 0, "%s", err.reason);
    ck_assert_ptr_nonnull(sum.budget_auto);
    ck_assert_msg(strstr(sum.budget_auto, "the client's pending ") != NULL, "%s", sum.budget_auto);
    qm_client_plan_summary_free(&sum);
    ck_assert_int_eq(base64_call(c, id, 3, &err), 0);
    kill_qmoed(d);
    d = spawn_qmoed(at, 1);
    ck_assert_msg(base64_call(c, id, 3, &err) == 0, "%s", err.reason);
    ck_assert_uint_eq(qm_client_restores(c), 1);
    qm_client_plan plan;
    ck_assert_msg(qm_client_session_plan(c, id, &plan, &err) == 0, "%s", err.reason);
    ck_assert_ptr_nonnull(plan.budget_auto);
    ck_assert_msg(strstr(plan.budget_auto, "the client's pending") == NULL, "%s", plan.budget_auto);
    qm_client_plan_free(&plan);
    qm_client_string_free(id);
    qm_client_close(c);
    kill_qmoed(d);
}
END_TEST

/* The plan of `id` after the daemon restarted and a call brought the
 * session back (restores: the handle's count then). */
static void restart_and_plan(qm_client *c, const char *at, pid_t *d, const char *id,
                             unsigned restores, qm_client_plan *plan)
{
    qm_client_error err;
    kill_qmoed(*d);
    *d = spawn_qmoed(at, 1);
    ck_assert_msg(base64_call(c, id, 3, &err) == 0, "%s", err.reason);
    ck_assert_uint_eq(qm_client_restores(c), restores);
    ck_assert_msg(qm_client_session_plan(c, id, plan, &err) == 0, "%s", err.reason);
}

/* A resize sets the budget a restart brings the session back with, as the
 * resize gave it, in place of the creation's "N%": bytes (they used to be
 * kept beside "budget", which the daemon refuses: the session never came
 * back), bytes as text (kept as budget_bytes 0), then "auto" with the
 * client's pending bytes (sized again, without them). */
START_TEST(test_a_resized_session_comes_back_with_the_budget_in_force)
{
    char at[400];
    pid_t d;
    qm_client *c = own_daemon(at, sizeof at, "resized", &d);
    qm_client_error err;
    qm_client_model *models = NULL;
    size_t n_models = 0;
    ck_assert_int_eq(qm_client_model_list(c, &models, &n_models, &err), 0);
    uint64_t bpe = models[0].bytes_per_expert;
    qm_client_models_free(models, n_models);
    qm_client_session_params p = {.model = "demo", .policy = "lru", .budget = "50%"};
    char *id = NULL;
    ck_assert_msg(qm_client_session_create(c, &p, &id, NULL, &err) == 0, "%s", err.reason);
    /* As bytes (it used to be kept beside the creation's "50%"), then as text. */
    ck_assert_msg(qm_client_session_resize(c, id, 4 * bpe, NULL, NULL, &err) == 0, "%s",
                  err.reason);
    qm_client_plan plan;
    restart_and_plan(c, at, &d, id, 1, &plan);
    ck_assert_uint_eq(plan.budget_bytes, 4 * bpe);
    qm_client_plan_free(&plan);
    char text[32];
    snprintf(text, sizeof text, "%llu", (unsigned long long)(5 * bpe));
    ck_assert_msg(qm_client_session_resize_to(c, id, text, NULL, NULL, &err) == 0, "%s",
                  err.reason);
    restart_and_plan(c, at, &d, id, 2, &plan);
    ck_assert_uint_eq(plan.budget_bytes, 5 * bpe);
    ck_assert_ptr_null(plan.budget_auto);
    qm_client_plan_free(&plan);

    /* "auto" leaving 1 MiB for the client: sized again on the new daemon,
     * without them (taken by then). */
    qm_client_plan_summary sum;
    ck_assert_msg(qm_client_session_resize_auto(c, id, 1 << 20, NULL, &sum, &err) == 0, "%s",
                  err.reason);
    ck_assert_ptr_nonnull(sum.budget_auto);
    ck_assert_msg(strstr(sum.budget_auto, "the client's pending ") != NULL, "%s",
                  sum.budget_auto);
    qm_client_plan_summary_free(&sum);
    restart_and_plan(c, at, &d, id, 3, &plan);
    ck_assert_ptr_nonnull(plan.budget_auto);
    ck_assert_msg(strstr(plan.budget_auto, "the client's pending") == NULL, "%s",
                  plan.budget_auto);
    qm_client_plan_free(&plan);
    qm_client_string_free(id);
    qm_client_close(c);
    kill_qmoed(d);
}
END_TEST

/* Reconnection off (window 0): the first call after a restart fails as it
 * always did, and the session is not re-created behind the caller. */
START_TEST(test_reconnection_off_fails_at_once)
{
    char at[400];
    pid_t d;
    qm_client *c = own_daemon(at, sizeof at, "off", &d);
    qm_client_error err;
    qm_client_reconnect o = {.window_ms = 0};
    qm_client_set_reconnect(c, &o);
    qm_client_session_params p = {.model = "demo"};
    char *id = NULL;
    ck_assert_int_eq(qm_client_session_create(c, &p, &id, NULL, &err), 0);
    ck_assert_int_eq(base64_call(c, id, 1, &err), 0);
    kill_qmoed(d);
    d = spawn_qmoed(at, 1);
    ck_assert_int_eq(base64_call(c, id, 1, &err), QM_CLIENT_EIO);
    /* The next call reaches the new daemon, which never heard of it. */
    int rc = base64_call(c, id, 1, &err);
    ck_assert_msg(rc == -32001, "%d %s", rc, err.reason);
    ck_assert_uint_eq(qm_client_restores(c), 0);
    qm_client_string_free(id);
    qm_client_close(c);
    kill_qmoed(d);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("client_live");
    TCase *tc = tcase_create("daemon");
    tcase_add_unchecked_fixture(tc, start_daemon, stop_daemon);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_status_and_models_describe_the_daemon);
    tcase_add_test(tc, test_model_load_conflict_and_unload);
    tcase_add_test(tc, test_session_plan_list_and_close);
    tcase_add_test(tc, test_infer_output_does_not_depend_on_policy_or_budget);
    tcase_add_test(tc, test_infer_errors_carry_the_field);
    tcase_add_test(tc, test_infer_routed_by_the_engine_uses_ids_and_weights_as_given);
    tcase_add_test(tc, test_trace_metrics_and_daemon_telemetry);
    tcase_add_test(tc, test_mapped_infer_equals_base64_without_a_copy);
    tcase_add_test(tc, test_one_handle_shared_by_threads_gets_every_answer_right);
    tcase_add_test(tc, test_a_program_that_exits_without_closing_leaves_no_session);
    tcase_add_test(tc, test_close_closes_what_the_handle_owns_and_nothing_else);
    tcase_add_test(tc, test_a_forked_child_never_closes_its_parents_sessions);
    suite_add_tcase(s, tc);
    TCase *restart = tcase_create("restart");
    tcase_add_unchecked_fixture(restart, start_daemon, stop_daemon);
    tcase_set_timeout(restart, 120);
    tcase_add_test(restart, test_a_session_outlives_a_daemon_restart);
    tcase_add_test(restart, test_reconnection_off_fails_at_once);
    tcase_add_test(restart, test_a_session_brought_back_is_not_given_its_pending_bytes_again);
    tcase_add_test(restart, test_a_resized_session_comes_back_with_the_budget_in_force);
    tcase_add_test(restart, test_threads_of_one_handle_each_bring_their_session_back);
    tcase_add_test(restart, test_a_map_the_daemon_reclaimed_is_passed_again);
    suite_add_tcase(s, restart);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
