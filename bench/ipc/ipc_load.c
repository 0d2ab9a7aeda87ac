/* ipc_load.c - closed-loop request/response load over a Unix socket.
 *
 * N connections driven by one epoll thread (the shape of redis-benchmark):
 * each sends one request line, waits for one response line ('\n'-terminated),
 * records the round trip, sends the next. Works for qmoed (JSON lines) and
 * for redis (RESP "PING" -> "+PONG\r\n" also ends in '\n'), so both servers
 * are measured by the same client. Prints one JSON object of results.
 *
 * usage: qmoe-ipc-load --socket PATH [--clients N] [--requests M] [--warmup W]
 *                      (--line TEXT | --line-file FILE | --redis-ping)
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

typedef struct conn {
    int fd;
    int want_out; /* EPOLLOUT armed: a request did not fit the socket buffer */
    uint64_t sent_ns;
    size_t out_off;
    char *in;
    size_t in_len, in_cap;
} conn;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 2);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(buf);
        return NULL;
    }
    fclose(f);
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
        n--;
    buf[n++] = '\n';
    *len = (size_t)n;
    return buf;
}

static int epfd;

/* Sends what is left of the request; 1 when complete. EPOLLOUT is armed only
 * while a request is stuck: level-triggered writability on every idle
 * connection would turn the loop into a busy poll (and measure the client). */
static int send_some(conn *c, const char *req, size_t req_len, uint32_t index)
{
    while (c->out_off < req_len) {
        ssize_t n = send(c->fd, req + c->out_off, req_len - c->out_off, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN) {
                if (!c->want_out) {
                    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.u32 = index};
                    epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
                    c->want_out = 1;
                }
                return 0;
            }
            perror("send");
            exit(1);
        }
        c->out_off += (size_t)n;
    }
    if (c->want_out) {
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = index};
        epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
        c->want_out = 0;
    }
    return 1;
}

int main(int argc, char **argv)
{
    const char *path = NULL, *line = NULL, *line_file = NULL;
    int clients = 1, redis = 0;
    long requests = 10000, warmup = 1000;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--socket") && i + 1 < argc)
            path = argv[++i];
        else if (!strcmp(argv[i], "--clients") && i + 1 < argc)
            clients = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--requests") && i + 1 < argc)
            requests = atol(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc)
            warmup = atol(argv[++i]);
        else if (!strcmp(argv[i], "--line") && i + 1 < argc)
            line = argv[++i];
        else if (!strcmp(argv[i], "--line-file") && i + 1 < argc)
            line_file = argv[++i];
        else if (!strcmp(argv[i], "--redis-ping"))
            redis = 1;
        else {
            fprintf(stderr, "usage: %s --socket PATH [--clients N] [--requests M] [--warmup W] "
                            "(--line TEXT | --line-file FILE | --redis-ping)\n", argv[0]);
            return 2;
        }
    }
    if (!path || (!line && !line_file && !redis) || clients < 1 || requests < 1) {
        fprintf(stderr, "missing --socket or request\n");
        return 2;
    }
    char *req;
    size_t req_len;
    if (redis) {
        req = strdup("*1\r\n$4\r\nPING\r\n");
        req_len = strlen(req);
    } else if (line_file) {
        req = read_file(line_file, &req_len);
        if (!req) {
            perror(line_file);
            return 1;
        }
    } else {
        req_len = strlen(line) + 1;
        req = malloc(req_len + 1);
        memcpy(req, line, req_len - 1);
        req[req_len - 1] = '\n';
    }
    int ep = epoll_create1(0);
    epfd = ep;
    conn *cs = calloc((size_t)clients, sizeof *cs);
    for (int i = 0; i < clients; i++) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
        cs[i].fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (connect(cs[i].fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
            perror("connect");
            return 1;
        }
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        epoll_ctl(ep, EPOLL_CTL_ADD, cs[i].fd, &ev);
    }
    long total = warmup + requests, started = 0, finished = 0;
    uint64_t *lat = malloc(sizeof(uint64_t) * (size_t)requests);
    long n_lat = 0;
    double compute_sum = 0, codec_sum = 0, queue_sum = 0;
    long compute_n = 0;
    uint64_t t_start = 0;
    if (warmup == 0)
        t_start = now_ns();
    for (int i = 0; i < clients && started < total; i++, started++) {
        cs[i].sent_ns = now_ns();
        send_some(&cs[i], req, req_len, (uint32_t)i);
    }
    struct epoll_event evs[256];
    while (finished < total) {
        int n = epoll_wait(ep, evs, 256, 10000);
        if (n <= 0) {
            fprintf(stderr, "timed out waiting for responses (%ld of %ld)\n", finished, total);
            return 1;
        }
        for (int e = 0; e < n; e++) {
            uint32_t ci = evs[e].data.u32;
            conn *c = &cs[ci];
            if (c->out_off < req_len && (evs[e].events & EPOLLOUT))
                send_some(c, req, req_len, ci);
            if (!(evs[e].events & EPOLLIN))
                continue;
            for (;;) {
                if (c->in_cap - c->in_len < 65536) {
                    c->in_cap = c->in_cap ? c->in_cap * 2 : 1 << 17;
                    c->in = realloc(c->in, c->in_cap);
                }
                size_t room = c->in_cap - c->in_len;
                ssize_t r = recv(c->fd, c->in + c->in_len, room, 0);
                if (r < 0 && errno == EAGAIN)
                    break;
                if (r <= 0) {
                    fprintf(stderr, "server closed the connection\n");
                    return 1;
                }
                c->in_len += (size_t)r;
                if ((size_t)r < room)
                    break; /* drained: no second recv just to hear EAGAIN */
            }
            char *nl;
            while ((nl = memchr(c->in, '\n', c->in_len)) != NULL) {
                uint64_t t = now_ns();
                size_t used = (size_t)(nl - c->in) + 1;
                if (finished >= warmup) {
                    lat[n_lat++] = t - c->sent_ns;
                    char *cu = memmem(c->in, used, "\"compute_us\":", 13);
                    if (cu) {
                        compute_sum += strtod(cu + 13, NULL);
                        compute_n++;
                        char *de = memmem(c->in, used, "\"decode_us\":", 12);
                        char *en = memmem(c->in, used, "\"encode_us\":", 12);
                        if (de && en)
                            codec_sum += strtod(de + 12, NULL) + strtod(en + 12, NULL);
                        char *qu = memmem(c->in, used, "\"queue_us\":", 11);
                        if (qu)
                            queue_sum += strtod(qu + 11, NULL);
                    }
                }
                if (finished == warmup - 1)
                    t_start = t; /* the last warm-up answer starts the clock */
                finished++;
                memmove(c->in, c->in + used, c->in_len - used);
                c->in_len -= used;
                if (started < total) {
                    started++;
                    c->out_off = 0;
                    c->sent_ns = now_ns();
                    send_some(c, req, req_len, ci);
                }
            }
        }
    }
    uint64_t t_end = now_ns();
    qsort(lat, (size_t)n_lat, sizeof *lat, cmp_u64);
    double secs = (double)(t_end - t_start) / 1e9;
    double mean = 0;
    for (long i = 0; i < n_lat; i++)
        mean += (double)lat[i];
    mean /= (double)n_lat;
    printf("{\"clients\":%d,\"requests\":%ld,\"seconds\":%.4f,\"rps\":%.1f,\"mean_us\":%.2f,"
           "\"p50_us\":%.2f,\"p99_us\":%.2f,\"compute_us_mean\":%.2f,\"codec_us_mean\":%.2f,"
           "\"queue_us_mean\":%.2f}\n",
           clients, n_lat, secs, (double)n_lat / secs, mean / 1e3,
           (double)lat[(size_t)((double)n_lat * 0.50)] / 1e3,
           (double)lat[(size_t)((double)(n_lat - 1) * 0.99)] / 1e3,
           compute_n ? compute_sum / (double)compute_n : 0.0,
           compute_n ? codec_sum / (double)compute_n : 0.0,
           compute_n ? queue_sum / (double)compute_n : 0.0);
    return 0;
}
