/* ring_bench.c - where a layer call's time goes (issue 39): the machine's
 * floor beside qmoed's call ring and socket, calls 1 ms apart so that both
 * sides are asleep when a call comes, as in an engine's decode.
 *
 * usage: qmoe-ring-bench floor [--calls N] [--gap-us G] [--evict-mib M]
 *        qmoe-ring-bench calls --socket PATH --model NAME [--calls N] [--gap-us G]
 *                        [--tokens T] [--precision exact|fast] [--daemon-pid P]
 *                        [--block B] [--idle-s S] [--evict-mib M] [--anticipate 1]
 *
 * floor: two processes hand a token back and forth through a futex word in
 * shared memory, then through a Unix socket pair, each side blocked (no
 * spinning) between calls; blocks of B of each alternate. One JSON line:
 * per kind the round trip's p50/p90/mean in microseconds.
 *
 * calls: one session (policy whole_bank), one map, T tokens of fresh random
 * hidden states and the engine's own routing (k distinct experts per token,
 * fresh each call) per call, output_to the map (libqmoe-client's
 * qm_client_session_infer_mapped); blocks of B calls through the session's
 * ring, then B through the socket (qm_client_set_ring), alternating. Per
 * transport: the call end to end, the engine's compute_us from the answer,
 * and the rest (end to end minus compute_us, per call): p50/p90; the
 * daemon's CPU time per call (every thread's, /proc/PID/task/TID/schedstat)
 * when --daemon-pid is given; and with --idle-s, the daemon's CPU seconds
 * over that many seconds with the ring open and no call
 * (/proc/PID/stat utime + stime). With --evict-mib M, before each call
 * (after the gap) two threads, one a CPU on a 2-CPU machine, read M MiB
 * between them, as an engine's own layer work (attention's weights) reads
 * between two layer calls: the caches hold none of the daemon's or the
 * client's state when the call comes. With --anticipate 1 the ring is
 * opened asking the daemon to anticipate its calls
 * (qm_client_set_ring_anticipate). One JSON line. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <errno.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../bench_util.h"
#include "bench_client.h"

static double now_us(void) { return now_s() * 1e6; }

static void sleep_us(double us)
{
    struct timespec ts = {(time_t)(us / 1e6), (long)(fmod(us, 1e6) * 1000)};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

static double quantile(double *v, int n, double q)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int i = (int)(q * (n - 1) + 0.5);
    return v[i < 0 ? 0 : i >= n ? n - 1 : i];
}

static void print_stats(const char *name, double *v, int n, int last)
{
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += v[i];
    double p50 = quantile(v, n, 0.5), p90 = quantile(v, n, 0.9);
    printf("\"%s\":{\"p50\":%.2f,\"p90\":%.2f,\"mean\":%.2f}%s", name, p50, p90, sum / n,
           last ? "" : ",");
}

/* --evict-mib: two readers of one buffer, started together before a call. */
typedef struct evictor {
    const uint64_t *buf;
    size_t words;      /* per reader */
    pthread_barrier_t go, done;
    pthread_t helper;
    volatile uint64_t sink;
    int on, stop;
} evictor;

static uint64_t read_words(const uint64_t *p, size_t n)
{
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i + 4 <= n; i += 4) {
        a += p[i];
        b += p[i + 1];
        c += p[i + 2];
        d += p[i + 3];
    }
    return a ^ b ^ c ^ d;
}

static void *evict_helper(void *arg)
{
    evictor *ev = arg;
    for (;;) {
        pthread_barrier_wait(&ev->go);
        if (ev->stop)
            return NULL;
        ev->sink += read_words(ev->buf + ev->words, ev->words);
        pthread_barrier_wait(&ev->done);
    }
}

static int evict_start(evictor *ev, double mib)
{
    memset(ev, 0, sizeof *ev);
    if (mib <= 0)
        return 0;
    size_t bytes = (size_t)(mib * 1048576.0) / 64 * 64;
    uint64_t *b = malloc(bytes);
    if (!b)
        return -1;
    memset(b, 1, bytes);
    ev->buf = b;
    ev->words = bytes / 16; /* half the buffer's 8-byte words each */
    pthread_barrier_init(&ev->go, NULL, 2);
    pthread_barrier_init(&ev->done, NULL, 2);
    if (pthread_create(&ev->helper, NULL, evict_helper, ev) != 0)
        return -1;
    ev->on = 1;
    return 0;
}

static void evict_now(evictor *ev)
{
    if (!ev->on)
        return;
    pthread_barrier_wait(&ev->go);
    ev->sink += read_words(ev->buf, ev->words);
    pthread_barrier_wait(&ev->done);
}

static void evict_stop(evictor *ev)
{
    if (!ev->on)
        return;
    ev->stop = 1;
    pthread_barrier_wait(&ev->go);
    pthread_join(ev->helper, NULL);
    free((void *)ev->buf);
}

/* ---- the floor ---- */

static long futex(uint32_t *w, int op, uint32_t v)
{
    return syscall(SYS_futex, w, op, v, NULL, NULL, 0);
}

/* The parent rings word 0 and sleeps on word 16 until the child, asleep on
 * word 0, answers there. */
static void floor_futex(uint32_t *shared, int calls, double gap_us, double *rtt, evictor *ev)
{
    uint32_t *req = shared, *ans = shared + 16;
    pid_t child = fork();
    if (child == 0) {
        uint32_t seen = 0;
        for (;;) {
            uint32_t v;
            while ((v = __atomic_load_n(req, __ATOMIC_SEQ_CST)) == seen)
                futex(req, FUTEX_WAIT, seen);
            if (v == UINT32_MAX)
                _exit(0);
            seen = v;
            __atomic_store_n(ans, v, __ATOMIC_SEQ_CST);
            futex(ans, FUTEX_WAKE, 1);
        }
    }
    for (int i = 0; i < calls; i++) {
        sleep_us(gap_us);
        evict_now(ev);
        uint32_t seq = __atomic_load_n(req, __ATOMIC_SEQ_CST) + 1;
        double t0 = now_us();
        __atomic_store_n(req, seq, __ATOMIC_SEQ_CST);
        futex(req, FUTEX_WAKE, 1);
        uint32_t v;
        while ((v = __atomic_load_n(ans, __ATOMIC_SEQ_CST)) != seq)
            futex(ans, FUTEX_WAIT, v);
        rtt[i] = now_us() - t0;
    }
    __atomic_store_n(req, UINT32_MAX, __ATOMIC_SEQ_CST);
    futex(req, FUTEX_WAKE, 1);
    waitpid(child, NULL, 0);
}

static void floor_socket(int calls, double gap_us, double *rtt, evictor *ev)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) < 0) {
        perror("socketpair");
        exit(1);
    }
    pid_t child = fork();
    if (child == 0) {
        close(sv[0]);
        char b;
        while (read(sv[1], &b, 1) == 1 && b != 'q')
            if (write(sv[1], &b, 1) != 1)
                break;
        _exit(0);
    }
    close(sv[1]);
    for (int i = 0; i < calls; i++) {
        sleep_us(gap_us);
        evict_now(ev);
        char b = 'x';
        double t0 = now_us();
        if (write(sv[0], &b, 1) != 1 || read(sv[0], &b, 1) != 1) {
            perror("socket ping-pong");
            exit(1);
        }
        rtt[i] = now_us() - t0;
    }
    char q = 'q';
    (void)!write(sv[0], &q, 1);
    waitpid(child, NULL, 0);
    close(sv[0]);
}

static int run_floor(int calls, double gap_us, int block, double evict_mib)
{
    evictor ev;
    if (evict_start(&ev, evict_mib) < 0) {
        fprintf(stderr, "--evict-mib: no memory or no thread\n");
        return 1;
    }
    uint32_t *shared = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    double *fx = calloc((size_t)calls, sizeof *fx), *sk = calloc((size_t)calls, sizeof *sk);
    for (int done = 0; done < calls; done += block) {
        int n = calls - done < block ? calls - done : block;
        memset(shared, 0, 4096);
        floor_futex(shared, n, gap_us, fx + done, &ev);
        floor_socket(n, gap_us, sk + done, &ev);
    }
    evict_stop(&ev);
    printf("{\"calls\":%d,\"gap_us\":%.0f,\"evict_mib\":%.0f,", calls, gap_us, evict_mib);
    print_stats("futex_us", fx, calls, 0);
    print_stats("socket_us", sk, calls, 1);
    printf("}\n");
    return 0;
}

/* ---- qmoed's calls ---- */

/* Nanoseconds on a CPU of every thread of pid, or -1. */
static double daemon_cpu_ns(int pid)
{
    if (pid <= 0)
        return -1;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", pid);
    DIR *d = opendir(path);
    if (!d)
        return -1;
    double sum = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char p2[320];
        snprintf(p2, sizeof p2, "/proc/%d/task/%s/schedstat", pid, e->d_name);
        FILE *f = fopen(p2, "r");
        unsigned long long ns = 0;
        if (f && fscanf(f, "%llu", &ns) == 1)
            sum += (double)ns;
        if (f)
            fclose(f);
    }
    closedir(d);
    return sum;
}

/* utime + stime of pid in seconds (/proc/PID/stat), or -1. */
static double daemon_stat_s(int pid)
{
    char path[64], buf[2048];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    unsigned long long ut = 0, st = 0;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

typedef struct call_setup {
    qm_client *c;
    char *sid;
    qm_client_map map;
    uint64_t T, H, E, k, layers;
    uint64_t o_ids, o_w, o_out;
    uint64_t seed;
} call_setup;

/* Fresh hidden states and routing in the map, then one call. */
static int one_call(call_setup *s, uint64_t layer, double *e2e, double *compute)
{
    float *x = s->map.data;
    for (uint64_t i = 0; i < s->T * s->H; i++)
        x[i] = rng_uniform(&s->seed, -1.0f, 1.0f);
    int32_t *ids = (int32_t *)((char *)s->map.data + s->o_ids);
    float *w = (float *)((char *)s->map.data + s->o_w);
    for (uint64_t t = 0; t < s->T; t++) {
        for (uint64_t j = 0; j < s->k; j++) {
            int32_t e;
            int again;
            do {
                e = (int32_t)(rng_next(&s->seed) % s->E);
                again = 0;
                for (uint64_t q = 0; q < j; q++)
                    again |= ids[t * s->k + q] == e;
            } while (again);
            ids[t * s->k + j] = e;
            w[t * s->k + j] = 1.0f / (float)s->k;
        }
    }
    qm_client_region ri = {QM_CLIENT_I32, s->T, s->k, s->o_ids},
                     rw = {QM_CLIENT_F32, s->T, s->k, s->o_w};
    qm_client_mapped_infer q = {.session = s->sid, .layer = layer, .map = &s->map,
                                .hidden = {QM_CLIENT_F32, s->T, s->H, 0}, .topk_ids = &ri,
                                .topk_weights = &rw, .output_offset = s->o_out};
    qm_client_infer_stats st;
    qm_client_error err;
    double t0 = now_us();
    if (qm_client_session_infer_mapped(s->c, &q, &st, &err) < 0) {
        fprintf(stderr, "infer: %s\n", err.reason);
        return -1;
    }
    *e2e = now_us() - t0;
    *compute = (double)st.compute_us;
    return 0;
}

static uint64_t up64(uint64_t n) { return (n + 63) / 64 * 64; }

static int setup_calls(call_setup *s, const char *sock, const char *model, const char *precision,
                       uint64_t T, int anticipate)
{
    qm_client_model shape;
    s->c = bench_connect(sock, model, &shape);
    if (!s->c)
        return -1;
    s->T = T;
    s->H = shape.hidden_size;
    s->E = shape.experts;
    s->k = shape.k;
    s->layers = shape.layers;
    s->seed = 42;
    qm_client_error err;
    qm_client_session_params sp = {.model = model, .precision = precision};
    if (qm_client_session_create(s->c, &sp, &s->sid, NULL, &err) < 0) {
        fprintf(stderr, "session: %s\n", err.reason);
        return -1;
    }
    s->o_ids = up64(T * s->H * 4);
    s->o_w = s->o_ids + up64(T * s->k * 4);
    s->o_out = s->o_w + up64(T * s->k * 4);
    if (qm_client_map_create(s->c, s->sid, s->o_out + up64(T * s->H * 4), &s->map, &err) < 0) {
        fprintf(stderr, "map: %s\n", err.reason);
        return -1;
    }
    qm_client_set_ring_anticipate(s->c, anticipate);
    if (qm_client_session_ring(s->c, s->sid, &err) < 0) {
        fprintf(stderr, "ring: %s\n", err.reason);
        return -1;
    }
    return 0;
}

static int run_calls(const char *sock, const char *model, int calls, double gap_us, uint64_t T,
                     const char *precision, int pid, int block, double idle_s, double evict_mib,
                     int anticipate)
{
    evictor ev;
    if (evict_start(&ev, evict_mib) < 0) {
        fprintf(stderr, "--evict-mib: no memory or no thread\n");
        return 1;
    }
    call_setup s;
    memset(&s, 0, sizeof s);
    if (setup_calls(&s, sock, model, precision, T, anticipate) < 0)
        return 1;
    uint64_t layers = s.layers;
    double *e2e[2], *comp[2], *rest[2], cpu_ns[2] = {0, 0};
    for (int m = 0; m < 2; m++) {
        e2e[m] = calloc((size_t)calls, sizeof(double));
        comp[m] = calloc((size_t)calls, sizeof(double));
        rest[m] = calloc((size_t)calls, sizeof(double));
    }
    /* Warm-up: every layer once through each transport. */
    for (int m = 0; m < 2; m++) {
        qm_client_set_ring(s.c, m == 0 ? QM_CLIENT_RING_EXPLICIT : QM_CLIENT_RING_OFF);
        for (uint64_t l = 0; l < layers + 8; l++) {
            double a, b;
            if (one_call(&s, l % layers, &a, &b) < 0)
                return 1;
        }
    }
    int done[2] = {0, 0};
    uint64_t layer = 0;
    for (int round = 0; done[0] < calls || done[1] < calls; round++) {
        int m = round % 2; /* 0: ring, 1: socket */
        qm_client_set_ring(s.c, m == 0 ? QM_CLIENT_RING_EXPLICIT : QM_CLIENT_RING_OFF);
        int n = calls - done[m] < block ? calls - done[m] : block;
        double c0 = daemon_cpu_ns(pid);
        for (int i = 0; i < n; i++) {
            sleep_us(gap_us);
            evict_now(&ev);
            int at = done[m] + i;
            if (one_call(&s, layer++ % layers, &e2e[m][at], &comp[m][at]) < 0)
                return 1;
            rest[m][at] = e2e[m][at] - comp[m][at];
        }
        if (pid > 0)
            cpu_ns[m] += daemon_cpu_ns(pid) - c0;
        done[m] += n;
    }
    if (!qm_client_ring_active(s.c, s.sid))
        qm_client_set_ring(s.c, QM_CLIENT_RING_EXPLICIT);
    evict_stop(&ev);
    printf("{\"model\":\"%s\",\"tokens\":%llu,\"calls\":%d,\"gap_us\":%.0f,\"precision\":\"%s\","
           "\"evict_mib\":%.0f,\"anticipate\":%d,",
           model, (unsigned long long)T, calls, gap_us, precision, evict_mib, anticipate);
    const char *names[2] = {"ring", "socket"};
    for (int m = 0; m < 2; m++) {
        printf("\"%s\":{", names[m]);
        print_stats("e2e_us", e2e[m], calls, 0);
        print_stats("compute_us", comp[m], calls, 0);
        print_stats("rest_us", rest[m], calls, 0);
        printf("\"daemon_cpu_us_per_call\":%.2f},", pid > 0 ? cpu_ns[m] / 1e3 / calls : -1.0);
    }
    double idle = -1, idle_ns = -1;
    if (idle_s > 0 && pid > 0) {
        /* Any spin after the last call is over, and the loop has counted
         * the last calls (lazily: within the daemon's 1 s tick). */
        sleep_us(1500000);
        double s0 = daemon_stat_s(pid), n0 = daemon_cpu_ns(pid);
        sleep_us(idle_s * 1e6);
        idle = daemon_stat_s(pid) - s0;
        idle_ns = daemon_cpu_ns(pid) - n0;
    }
    printf("\"ring_open\":%d,\"idle_s\":%.1f,\"idle_cpu_s\":%.3f,\"idle_cpu_us_schedstat\":%.1f}\n",
           qm_client_ring_active(s.c, s.sid), idle_s, idle, idle_ns / 1e3);
    qm_client_error err;
    qm_client_map_release(s.c, &s.map, &err);
    qm_client_session_close(s.c, s.sid, &err);
    qm_client_string_free(s.sid);
    qm_client_close(s.c);
    return 0;
}

int main(int argc, char **argv)
{
    const char *sock = NULL, *model = NULL, *precision = "exact";
    int calls = 1000, pid = 0, block = 100;
    double gap_us = 1000, idle_s = 0, evict_mib = 0;
    int anticipate = 0;
    uint64_t tokens = 1;
    bench_arg args[] = {
        {"--socket", BENCH_ARG_STR, &sock},       {"--model", BENCH_ARG_STR, &model},
        {"--calls", BENCH_ARG_INT, &calls},       {"--gap-us", BENCH_ARG_DBL, &gap_us},
        {"--tokens", BENCH_ARG_U64, &tokens},     {"--precision", BENCH_ARG_STR, &precision},
        {"--daemon-pid", BENCH_ARG_INT, &pid},    {"--block", BENCH_ARG_INT, &block},
        {"--idle-s", BENCH_ARG_DBL, &idle_s},     {"--evict-mib", BENCH_ARG_DBL, &evict_mib},
        {"--anticipate", BENCH_ARG_INT, &anticipate},
    };
    const char *mode = argc > 1 ? argv[1] : "";
    for (int i = 2; i + 1 < argc; i += 2)
        if (!bench_arg_set(args, sizeof args / sizeof args[0], argv[i], argv[i + 1])) {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    if (calls < 1 || block < 1)
        return 2;
    if (!strcmp(mode, "floor"))
        return run_floor(calls, gap_us, block, evict_mib);
    if (!strcmp(mode, "calls") && sock && model)
        return run_calls(sock, model, calls, gap_us, tokens, precision, pid, block, idle_s, evict_mib,
                         anticipate);
    fprintf(stderr, "usage: qmoe-ring-bench floor [--calls N] [--gap-us G] [--block B] [--evict-mib M]\n"
                    "       qmoe-ring-bench calls --socket PATH --model NAME [--calls N] "
                    "[--gap-us G] [--tokens T] [--precision exact|fast] [--daemon-pid P] "
                    "[--block B] [--idle-s S] [--evict-mib M] [--anticipate 1]\n");
    return 2;
}
