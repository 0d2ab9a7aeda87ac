/* test_client_ring.c - libqmoe-client's call ring against the real qmoed
 * (PROTOCOL.md "session.ring", qmoe_client.h "the call ring"):
 * qm_client_session_infer_mapped takes the ring by default and answers
 * what the socket answers, bit for bit and error for error; a refused ring
 * falls back to the socket; a daemon that stops answering is a timeout, one
 * that dies a broken connection, and the next call opens a new ring. Each
 * test starts its own daemon (some stop or kill it). */
#include <check.h>
#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "live_daemon.h"
#include "qmoe_client.h"

#define HIDDEN 64
#define EXPERTS 8
#define MAP_BYTES (1 << 20)

static char dir[256], sock[300], bank[300];

/* The bank, once per test process (each test forks from the runner). */
static void make_bank(void)
{
    const char *build = getenv("QMOE_BUILD_DIR");
    char tool[512];
    ck_assert_msg(build != NULL, "QMOE_BUILD_DIR is not set (run through ctest)");
    snprintf(dir, sizeof dir, "/tmp/qmoe-client-ring-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(sock, sizeof sock, "%s/qmoed.sock", dir);
    snprintf(bank, sizeof bank, "%s/demo.qmoe", dir);
    snprintf(tool, sizeof tool, "%s/tools/qmoe-bank/qmoe-bank", build);
    char *create[] = {tool, "create", "--out", bank, "--quiet", "--layers", "2", "--experts", "8",
                      "--hidden", "64", "--inter", "32", "--k", "2", "--bits", "4",
                      "--block-size", "32", "--activation", "swiglu", "--router", "--seed", "4",
                      NULL};
    ck_assert_int_eq(live_run(create), 0);
}

static void remove_dir(void)
{
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    (void)!system(cmd);
}

/* A qmoed on `sock` with `set` (a --set KEY=VALUE, or NULL); its pid. */
static pid_t start_daemon(const char *set)
{
    char qmoed[512], model[400];
    snprintf(qmoed, sizeof qmoed, "%s/daemon/qmoed", getenv("QMOE_BUILD_DIR"));
    snprintf(model, sizeof model, "demo=%s", bank);
    unlink(sock);
    pid_t pid = fork();
    if (pid == 0) {
        freopen("/dev/null", "w", stdout);
        freopen(getenv("QM_DAEMON_LOG") ? getenv("QM_DAEMON_LOG") : "/dev/null", "a", stderr);
        char *argv[12] = {qmoed, "--socket", sock, "--model", model};
        int n = 5;
        if (set) {
            argv[n++] = "--set";
            argv[n++] = (char *)set;
        }
        if (geteuid() == 0)
            argv[n++] = "--allow-root";
        argv[n] = NULL;
        execv(qmoed, argv);
        _exit(127);
    }
    live_wait_listening(pid, sock);
    return pid;
}

/* 1 when every thread of pid is stopped (state T). */
static int all_stopped(pid_t pid)
{
    char path[300], buf[512];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    if (!d)
        return 0;
    int all = 1;
    struct dirent *e;
    while (all && (e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        snprintf(path, sizeof path, "/proc/%d/task/%.32s/stat", (int)pid, e->d_name);
        FILE *f = fopen(path, "r");
        size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
        if (f)
            fclose(f);
        buf[n] = '\0';
        const char *p = strrchr(buf, ')');
        all = !p || (p[1] == ' ' && p[2] == 'T');
    }
    closedir(d);
    return all;
}

/* SIGSTOP, and back once every thread of pid has stopped (a call rung
 * before then could still be answered). */
static void stop_threads(pid_t pid)
{
    kill(pid, SIGSTOP);
    for (int i = 0; i < 5000 && !all_stopped(pid); i++)
        usleep(1000);
    ck_assert_msg(all_stopped(pid), "qmoed %d did not stop", (int)pid);
}

static void stop_daemon(pid_t pid)
{
    kill(pid, SIGCONT);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
}

static qm_client *open_client(int timeout_ms)
{
    qm_client *c = NULL;
    qm_client_error err;
    ck_assert_msg(qm_client_open(&c, sock, timeout_ms, &err) == 0, "open: %s", err.reason);
    return c;
}

static char *create_session(qm_client *c, const char *precision)
{
    char *id = NULL;
    qm_client_error err;
    qm_client_session_params p = {.model = "demo", .precision = precision};
    ck_assert_msg(qm_client_session_create(c, &p, &id, NULL, &err) == 0, "create: %s",
                  err.reason);
    return id;
}

/* x as f32, f16 or bf16 bytes at dst. */
static void put_values(void *dst, qm_client_dtype dt, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, &x[i], 4);
        if (dt == QM_CLIENT_F32) {
            memcpy((char *)dst + 4 * i, &x[i], 4);
        } else if (dt == QM_CLIENT_BF16) {
            uint16_t h = (uint16_t)(b >> 16);
            memcpy((char *)dst + 2 * i, &h, 2);
        } else { /* f16, for values of modest range: round toward zero */
            uint32_t sign = (b >> 16) & 0x8000u, e = (b >> 23) & 0xffu, m = b & 0x7fffffu;
            uint16_t h = (uint16_t)sign;
            if (e >= 113 && e < 143)
                h = (uint16_t)(sign | ((e - 112) << 10) | (m >> 13));
            memcpy((char *)dst + 2 * i, &h, 2);
        }
    }
}

static size_t up(size_t n) { return (n + 63) / 64 * 64; }

enum { ROUTE_BANK, ROUTE_LOGITS, ROUTE_ENGINE };

/* One call of T tokens (layer T % 2) with its output at out_off; the
 * regions before it are written by the caller's first call. */
static int mapped_call(qm_client *c, const char *sid, qm_client_map *m, qm_client_dtype dt,
                       int routing, uint64_t T, uint64_t out_off, qm_client_error *err)
{
    size_t es = dt == QM_CLIENT_F32 ? 4 : 2;
    uint64_t o_l = up(T * HIDDEN * es), o_ids = o_l + up(T * EXPERTS * 4),
             o_w = o_ids + up(T * 3 * 4);
    qm_client_region logits = {QM_CLIENT_F32, T, EXPERTS, o_l},
                     ids = {QM_CLIENT_I32, T, 3, o_ids}, w = {dt, T, 3, o_w};
    qm_client_mapped_infer q = {.session = sid, .layer = T % 2, .map = m,
                                .hidden = {dt, T, HIDDEN, 0}, .output_offset = out_off};
    if (routing == ROUTE_LOGITS)
        q.router_logits = &logits;
    if (routing == ROUTE_ENGINE) {
        q.topk_ids = &ids;
        q.topk_weights = &w;
    }
    return qm_client_session_infer_mapped(c, &q, NULL, err);
}

static void fill_inputs(qm_client_map *m, qm_client_dtype dt, uint64_t T)
{
    size_t es = dt == QM_CLIENT_F32 ? 4 : 2;
    float *x = malloc(T * HIDDEN * sizeof *x);
    for (size_t i = 0; i < T * HIDDEN; i++)
        x[i] = (float)sin(0.37 * (double)i + (double)T);
    put_values(m->data, dt, x, T * HIDDEN);
    uint64_t o_l = up(T * HIDDEN * es), o_ids = o_l + up(T * EXPERTS * 4),
             o_w = o_ids + up(T * 3 * 4);
    float lg[64 * EXPERTS], wv[64 * 3];
    int32_t idv[64 * 3];
    for (size_t t = 0; t < T; t++) {
        for (int e = 0; e < EXPERTS; e++)
            lg[t * EXPERTS + e] = (float)cos(0.7 * (double)(t * EXPERTS + e));
        for (int j = 0; j < 3; j++) {
            idv[t * 3 + j] = (int32_t)((t * 5 + (size_t)j * 3) % EXPERTS);
            wv[t * 3 + j] = 0.25f + 0.125f * (float)j;
        }
    }
    idv[1] = -1; /* a dropped route */
    memcpy((char *)m->data + o_l, lg, T * EXPERTS * 4);
    memcpy((char *)m->data + o_ids, idv, T * 3 * 4);
    put_values((char *)m->data + o_w, dt, wv, T * 3);
    free(x);
}

START_TEST(test_mapped_calls_take_the_ring_and_equal_the_socket_bit_for_bit)
{
    make_bank();
    pid_t pid = start_daemon(NULL);
    static const char *const precisions[] = {"exact", "fast"};
    static const qm_client_dtype dts[] = {QM_CLIENT_F32, QM_CLIENT_F16, QM_CLIENT_BF16};
    static const uint64_t Ts[] = {1, 5, 64};
    qm_client *c = open_client(30000);
    qm_client_error err;
    for (int pi = 0; pi < 2; pi++) {
        char *sid = create_session(c, precisions[pi]);
        qm_client_map m;
        ck_assert_int_eq(qm_client_map_create(c, sid, MAP_BYTES, &m, &err), 0);
        ck_assert_int_eq(qm_client_ring_active(c, sid), 0);
        for (int di = 0; di < 3; di++) {
            for (int ti = 0; ti < 3; ti++) {
                for (int route = 0; route < 3; route++) {
                    uint64_t T = Ts[ti];
                    size_t n = T * HIDDEN * (dts[di] == QM_CLIENT_F32 ? 4 : 2);
                    fill_inputs(&m, dts[di], T);
                    qm_client_set_ring(c, QM_CLIENT_RING_AUTO);
                    ck_assert_msg(mapped_call(c, sid, &m, dts[di], route, T, 524288, &err) == 0,
                                  "ring: %s", err.reason);
                    ck_assert_int_eq(qm_client_ring_active(c, sid), 1);
                    qm_client_set_ring(c, QM_CLIENT_RING_OFF);
                    ck_assert_int_eq(qm_client_ring_active(c, sid), 0);
                    ck_assert_msg(mapped_call(c, sid, &m, dts[di], route, T, 786432, &err) == 0,
                                  "socket: %s", err.reason);
                    ck_assert_msg(memcmp((char *)m.data + 524288, (char *)m.data + 786432, n) ==
                                      0,
                                  "%s dtype %d T %llu routing %d differ", precisions[pi],
                                  (int)dts[di], (unsigned long long)T, route);
                }
            }
        }
        qm_client_set_ring(c, QM_CLIENT_RING_AUTO);
        qm_client_map_release(c, &m, &err);
        ck_assert_int_eq(qm_client_session_close(c, sid, &err), 0);
        ck_assert_int_eq(qm_client_ring_active(c, sid), 0);
        qm_client_string_free(sid);
    }
    qm_client_close(c);
    stop_daemon(pid);
    remove_dir();
}
END_TEST

START_TEST(test_ring_errors_equal_the_sockets)
{
    make_bank();
    pid_t pid = start_daemon(NULL);
    qm_client *c = open_client(30000);
    qm_client_error err, want;
    char *sid = create_session(c, NULL);
    qm_client_map m;
    ck_assert_int_eq(qm_client_map_create(c, sid, MAP_BYTES, &m, &err), 0);
    int32_t bad_ids[] = {0, EXPERTS, 3, 3};
    memcpy((char *)m.data + 8192, bad_ids, sizeof bad_ids);
    qm_client_region ids = {QM_CLIENT_I32, 2, 2, 8192}, w = {QM_CLIENT_F32, 2, 2, 12288},
                     wide = {QM_CLIENT_F32, 2, 3, 12288};
    struct {
        const char *name;
        qm_client_mapped_infer q;
    } cases[] = {
        {"layer", {.layer = 7, .hidden = {QM_CLIENT_F32, 2, HIDDEN, 0}, .output_offset = 4096}},
        {"cols", {.hidden = {QM_CLIENT_F32, 2, HIDDEN - 1, 0}, .output_offset = 4096}},
        {"outside", {.hidden = {QM_CLIENT_F32, 2, HIDDEN, MAP_BYTES - 64}, .output_offset = 4096}},
        {"align", {.hidden = {QM_CLIENT_F32, 2, HIDDEN, 96}, .output_offset = 4096}},
        {"out align", {.hidden = {QM_CLIENT_F32, 2, HIDDEN, 0}, .output_offset = 4097}},
        {"ids", {.hidden = {QM_CLIENT_F32, 2, HIDDEN, 0}, .topk_ids = &ids, .topk_weights = &w,
                 .output_offset = 4096}},
        {"weights", {.hidden = {QM_CLIENT_F32, 2, HIDDEN, 0}, .topk_ids = &ids,
                     .topk_weights = &wide, .output_offset = 4096}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cases[i].q.session = sid;
        cases[i].q.map = &m;
        qm_client_set_ring(c, QM_CLIENT_RING_OFF);
        int sock_rc = qm_client_session_infer_mapped(c, &cases[i].q, NULL, &want);
        qm_client_set_ring(c, QM_CLIENT_RING_AUTO);
        int ring_rc = qm_client_session_infer_mapped(c, &cases[i].q, NULL, &err);
        ck_assert_int_eq(qm_client_ring_active(c, sid), 1);
        ck_assert_msg(sock_rc < 0 && ring_rc == sock_rc, "%s: socket %d ring %d", cases[i].name,
                      sock_rc, ring_rc);
        ck_assert_str_eq(err.name, want.name);
        ck_assert_str_eq(err.field, want.field);
        ck_assert_str_eq(err.reason, want.reason);
    }
    qm_client_string_free(sid);
    qm_client_close(c);
    stop_daemon(pid);
    remove_dir();
}
END_TEST

/* qm_client_set_ring_anticipate: the ring the handle opens asks for
 * anticipation (the daemon says so in its log), and its calls answer what
 * the socket answers. */
START_TEST(test_a_handle_asks_for_an_anticipating_ring)
{
    make_bank();
    char log[400];
    snprintf(log, sizeof log, "%s/qmoed.log", dir);
    setenv("QM_DAEMON_LOG", log, 1);
    pid_t pid = start_daemon("log_level=info");
    unsetenv("QM_DAEMON_LOG");
    qm_client *c = open_client(30000);
    qm_client_set_ring_anticipate(c, 1);
    qm_client_error err;
    char *sid = create_session(c, NULL);
    qm_client_map m;
    ck_assert_int_eq(qm_client_map_create(c, sid, MAP_BYTES, &m, &err), 0);
    fill_inputs(&m, QM_CLIENT_F32, 1);
    for (int i = 0; i < 20; i++) {
        ck_assert_msg(mapped_call(c, sid, &m, QM_CLIENT_F32, ROUTE_BANK, 1, 524288, &err) == 0,
                      "ring: %s", err.reason);
        usleep(2000);
    }
    ck_assert_int_eq(qm_client_ring_active(c, sid), 1);
    qm_client_set_ring(c, QM_CLIENT_RING_OFF);
    ck_assert_int_eq(mapped_call(c, sid, &m, QM_CLIENT_F32, ROUTE_BANK, 1, 786432, &err), 0);
    ck_assert(memcmp((char *)m.data + 524288, (char *)m.data + 786432, HIDDEN * 4) == 0);
    FILE *f = fopen(log, "r");
    ck_assert_ptr_nonnull(f);
    static char text[1 << 16];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    ck_assert_msg(strstr(text, "(anticipating its calls)") != NULL, "the daemon's log: %s", text);
    qm_client_map_release(c, &m, &err);
    ck_assert_int_eq(qm_client_session_close(c, sid, &err), 0);
    qm_client_string_free(sid);
    qm_client_close(c);
    stop_daemon(pid);
    remove_dir();
}
END_TEST

START_TEST(test_a_refused_ring_falls_back_to_the_socket)
{
    make_bank();
    pid_t pid = start_daemon("max_rings=1");
    qm_client *a = open_client(30000), *b = open_client(30000);
    qm_client_error err;
    char *sa = create_session(a, NULL), *sb = create_session(b, NULL);
    qm_client_map ma, mb;
    ck_assert_int_eq(qm_client_map_create(a, sa, MAP_BYTES, &ma, &err), 0);
    ck_assert_int_eq(qm_client_map_create(b, sb, MAP_BYTES, &mb, &err), 0);
    fill_inputs(&ma, QM_CLIENT_F32, 5);
    fill_inputs(&mb, QM_CLIENT_F32, 5);
    ck_assert_int_eq(qm_client_session_ring(a, sa, &err), 0);
    ck_assert_int_eq(qm_client_session_ring(b, sb, &err), -32003);
    ck_assert_str_eq(err.name, "resource_exhausted");
    /* The refused session's calls go through the socket, with the same bits. */
    ck_assert_int_eq(mapped_call(a, sa, &ma, QM_CLIENT_F32, ROUTE_BANK, 5, 524288, &err), 0);
    ck_assert_int_eq(mapped_call(b, sb, &mb, QM_CLIENT_F32, ROUTE_BANK, 5, 524288, &err), 0);
    ck_assert_int_eq(qm_client_ring_active(a, sa), 1);
    ck_assert_int_eq(qm_client_ring_active(b, sb), 0);
    ck_assert(memcmp((char *)ma.data + 524288, (char *)mb.data + 524288, 5 * HIDDEN * 4) == 0);
    /* The first handle goes: its ring with it, and the other may open one. */
    qm_client_close(a);
    ck_assert_int_eq(qm_client_session_ring(b, sb, &err), 0);
    ck_assert_int_eq(qm_client_ring_active(b, sb), 1);
    qm_client_close(b);
    qm_client_string_free(sa);
    qm_client_string_free(sb);
    stop_daemon(pid);
    remove_dir();
}
END_TEST

typedef struct call_arg {
    qm_client *c;
    const char *sid;
    qm_client_map *m;
    int rc;
    qm_client_error err;
    double seconds;
} call_arg;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *call_thread(void *p)
{
    call_arg *a = p;
    double t0 = now_s();
    a->rc = mapped_call(a->c, a->sid, a->m, QM_CLIENT_F32, ROUTE_BANK, 5, 524288, &a->err);
    a->seconds = now_s() - t0;
    return NULL;
}

/* A daemon of its own, a handle with timeout_ms, a session, a map and one
 * call of 5 tokens through the ring (which opened it); the daemon's pid. */
static pid_t daemon_with_a_ring(int timeout_ms, qm_client **c, char **sid, qm_client_map *m)
{
    qm_client_error err;
    make_bank();
    pid_t pid = start_daemon(NULL);
    *c = open_client(timeout_ms);
    *sid = create_session(*c, NULL);
    ck_assert_int_eq(qm_client_map_create(*c, *sid, MAP_BYTES, m, &err), 0);
    fill_inputs(m, QM_CLIENT_F32, 5);
    ck_assert_int_eq(mapped_call(*c, *sid, m, QM_CLIENT_F32, ROUTE_BANK, 5, 524288, &err), 0);
    ck_assert_int_eq(qm_client_ring_active(*c, *sid), 1);
    return pid;
}

START_TEST(test_a_daemon_that_dies_mid_call_is_a_broken_connection)
{
    qm_client *c;
    char *sid;
    qm_client_map m;
    qm_client_error err;
    pid_t pid = daemon_with_a_ring(30000, &c, &sid, &m);
    /* What the ring reports, not what the handle makes of it: without
     * reconnection (test_client_live's restart case has that). */
    qm_client_reconnect off = {.window_ms = 0};
    qm_client_set_reconnect(c, &off);
    /* Stopped, the daemon cannot answer; killed, its socket hangs up. */
    stop_threads(pid);
    call_arg a = {.c = c, .sid = sid, .m = &m};
    pthread_t th;
    pthread_create(&th, NULL, call_thread, &a);
    usleep(200000);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    pthread_join(th, NULL);
    ck_assert_int_eq(a.rc, QM_CLIENT_EIO);
    ck_assert_str_eq(a.err.name, "connection_lost");
    ck_assert_msg(a.seconds < 5, "noticed after %.2f s", a.seconds);
    ck_assert_int_eq(qm_client_ring_active(c, sid), 0);
    qm_client_map_release(NULL, &m, &err);
    qm_client_session_detach(c, sid, &err);
    qm_client_string_free(sid);
    qm_client_close(c);
    remove_dir();
}
END_TEST

START_TEST(test_a_silent_daemon_times_out_and_the_next_call_opens_a_new_ring)
{
    qm_client *c;
    char *sid;
    qm_client_map m;
    qm_client_error err;
    pid_t pid = daemon_with_a_ring(400, &c, &sid, &m);
    stop_threads(pid);
    double t0 = now_s();
    ck_assert_int_eq(mapped_call(c, sid, &m, QM_CLIENT_F32, ROUTE_BANK, 5, 524288, &err),
                     QM_CLIENT_ETIMEDOUT);
    ck_assert_msg(now_s() - t0 < 3, "timed out after %.2f s", now_s() - t0);
    ck_assert_int_eq(qm_client_ring_active(c, sid), 0);
    kill(pid, SIGCONT);
    /* The handle reconnects, opens a new ring (one call) and goes on. */
    qm_client_set_timeout(c, 30000);
    ck_assert_msg(mapped_call(c, sid, &m, QM_CLIENT_F32, ROUTE_BANK, 5, 786432, &err) == 0, "%s",
                  err.reason);
    ck_assert_int_eq(qm_client_ring_active(c, sid), 1);
    ck_assert(memcmp((char *)m.data + 524288, (char *)m.data + 786432, 5 * HIDDEN * 4) == 0);
    qm_client_string_free(sid);
    qm_client_close(c);
    stop_daemon(pid);
    remove_dir();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("client_ring");
    TCase *tc = tcase_create("daemon");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_mapped_calls_take_the_ring_and_equal_the_socket_bit_for_bit);
    tcase_add_test(tc, test_ring_errors_equal_the_sockets);
    tcase_add_test(tc, test_a_refused_ring_falls_back_to_the_socket);
    tcase_add_test(tc, test_a_handle_asks_for_an_anticipating_ring);
    tcase_add_test(tc, test_a_daemon_that_dies_mid_call_is_a_broken_connection);
    tcase_add_test(tc, test_a_silent_daemon_times_out_and_the_next_call_opens_a_new_ring);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
