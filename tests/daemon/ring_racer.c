/* ring_racer.c - a writer thread racing the daemon's reads of a call ring's
 * request slot (PROTOCOL.md "session.ring"; driven by test_qmoed_ring.py).
 *
 * usage: ring_racer SOCKET MODEL CALLS
 *
 * Opens a session of MODEL (hidden size 64), one map and a ring over raw
 * JSON lines, takes a reference output over the socket, then rings CALLS
 * times while a second thread keeps rewriting the request slot: fields
 * flipping between the valid call's values, zeros, garbage and huge
 * numbers, so the daemon copies a slot that changes under it. Every call
 * must be answered, with 0 (some valid call), -32602 or -32001 and nothing
 * else; then, the writer stopped, the valid call through the ring must
 * give the reference's bits. Prints the codes seen; exit 0 when all held. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "qm_ring_wire.h"

#define H 64
#define T 2
#define MAP_BYTES (1 << 20)
#define OUT_OFF 65536
#define REF_OFF 131072

static int sock_fd;
static char line[65536];

static void die(const char *what)
{
    fprintf(stderr, "ring_racer: %s\n", what);
    exit(1);
}

/* Sends one request line (with fd as SCM_RIGHTS when >= 0), reads one
 * answer line into `line`. */
static void exchange(const char *req, int fd)
{
    struct iovec iov = {.iov_base = (void *)req, .iov_len = strlen(req)};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        memset(&ctl, 0, sizeof ctl);
        msg.msg_control = ctl.buf;
        msg.msg_controllen = sizeof ctl.buf;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    }
    if (sendmsg(sock_fd, &msg, 0) != (ssize_t)iov.iov_len)
        die("short send");
    size_t n = 0;
    while (n < sizeof line - 1) {
        ssize_t r = read(sock_fd, line + n, 1);
        if (r <= 0)
            die("connection closed");
        if (line[n] == '\n')
            break;
        n++;
    }
    line[n] = '\0';
    if (!strstr(line, "\"result\""))
        die(line);
}

static uint64_t member_u64(const char *key)
{
    const char *p = strstr(line, key);
    if (!p)
        die(line);
    return strtoull(p + strlen(key), NULL, 10);
}

static void *sealed_map(size_t bytes, int *fd)
{
    *fd = memfd_create("racer", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (*fd < 0 || ftruncate(*fd, (off_t)bytes) < 0 ||
        fcntl(*fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0)
        die("memfd");
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
    if (p == MAP_FAILED)
        die("mmap");
    return p;
}

static uint8_t *ring;
static uint8_t valid[QM_RING_REQUEST_BYTES];
static atomic_int stop;

/* Rewrites the slot until told to stop: 8 bytes at a time at random
 * places, from the valid call, zero, garbage or all ones. */
static void *writer(void *arg)
{
    (void)arg;
    unsigned seed = 12345;
    volatile uint8_t *slot = ring + QM_RING_OFF_REQUEST;
    while (!atomic_load(&stop)) {
        unsigned off = (unsigned)rand_r(&seed) % 24 * 8;
        uint64_t v;
        switch (rand_r(&seed) % 4) {
        case 0:
            memcpy(&v, valid + off, 8);
            break;
        case 1:
            v = 0;
            break;
        case 2:
            v = ((uint64_t)rand_r(&seed) << 32) ^ (uint64_t)rand_r(&seed);
            break;
        default:
            v = UINT64_MAX;
        }
        for (int i = 0; i < 8; i++)
            slot[off + i] = (uint8_t)(v >> (8 * i));
        if (rand_r(&seed) % 64 == 0)
            for (unsigned i = 0; i < QM_RING_REQUEST_BYTES; i++)
                slot[i] = valid[i];
    }
    return NULL;
}

/* Rings call `seq` and waits for its answer (5 s at most). */
static int32_t ring_call(uint32_t seq)
{
    uint32_t *req = qm_ring_word(ring, QM_RING_OFF_REQ_SEQ),
             *ans = qm_ring_word(ring, QM_RING_OFF_ANS_SEQ);
    qm_ring_store(req, seq);
    qm_ring_futex_wake(req);
    uint64_t deadline = qm_ring_now_ns() + 5000000000ull;
    uint32_t v;
    while ((v = qm_ring_load(ans)) != seq) {
        if (qm_ring_now_ns() > deadline)
            die("a call was never answered");
        qm_ring_store(qm_ring_word(ring, QM_RING_OFF_CLIENT_PARKED), 1);
        qm_ring_futex_wait(ans, v, 10000000);
        qm_ring_store(qm_ring_word(ring, QM_RING_OFF_CLIENT_PARKED), 0);
    }
    qm_ring_answer a;
    qm_ring_answer_read(ring + QM_RING_OFF_ANSWER, &a);
    return a.code;
}

int main(int argc, char **argv)
{
    if (argc != 4)
        die("usage: ring_racer SOCKET MODEL CALLS");
    int calls = atoi(argv[3]);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", argv[1]);
    sock_fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (connect(sock_fd, (struct sockaddr *)&addr, sizeof addr) < 0)
        die("connect");
    char req[1024], sid[64];
    snprintf(req, sizeof req,
             "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"session.create\",\"params\":"
             "{\"model\":\"%s\"}}\n",
             argv[2]);
    exchange(req, -1);
    const char *s = strstr(line, "\"session\":\"");
    if (!s || sscanf(s + 11, "%32[0-9a-f]", sid) != 1)
        die(line);
    int mfd, rfd;
    uint8_t *map = sealed_map(MAP_BYTES, &mfd);
    snprintf(req, sizeof req,
             "{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"session.map\",\"params\":"
             "{\"session\":\"%s\",\"bytes\":%d}}\n",
             sid, MAP_BYTES);
    exchange(req, mfd);
    uint64_t map_id = member_u64("\"map\":");
    ring = sealed_map(QM_RING_BYTES, &rfd);
    snprintf(req, sizeof req,
             "{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"session.ring\",\"params\":"
             "{\"session\":\"%s\"}}\n",
             sid);
    exchange(req, rfd);
    close(mfd);
    close(rfd);
    float x[T * H];
    for (int i = 0; i < T * H; i++)
        x[i] = (float)((i * 37) % 17) / 8.0f - 1.0f;
    memcpy(map, x, sizeof x);
    snprintf(req, sizeof req,
             "{\"jsonrpc\":\"2.0\",\"id\":4,\"method\":\"session.infer\",\"params\":"
             "{\"session\":\"%s\",\"layer\":1,\"hidden\":{\"dtype\":\"f32\",\"shape\":[%d,%d],"
             "\"map\":%llu,\"offset\":0},\"output_to\":{\"map\":%llu,\"offset\":%d}}}\n",
             sid, T, H, (unsigned long long)map_id, (unsigned long long)map_id, REF_OFF);
    exchange(req, -1);
    uint8_t reference[T * H * 4];
    memcpy(reference, map + REF_OFF, sizeof reference);

    qm_ring_request r = {.layer = 1,
                         .hidden = {0, T, H, map_id, 0},
                         .output_map = map_id,
                         .output_offset = OUT_OFF};
    qm_ring_request_write(valid, &r);
    memcpy(ring + QM_RING_OFF_REQUEST, valid, sizeof valid);
    uint32_t seq = qm_ring_load(qm_ring_word(ring, QM_RING_OFF_ANS_SEQ));
    pthread_t th;
    pthread_create(&th, NULL, writer, NULL);
    int seen[4] = {0}; /* 0, -32602, -32001, other */
    for (int i = 0; i < calls; i++) {
        int32_t code = ring_call(++seq);
        int k = code == 0 ? 0 : code == -32602 ? 1 : code == -32001 ? 2 : 3;
        seen[k]++;
        if (k == 3) {
            fprintf(stderr, "ring_racer: call %d answered %d\n", i, code);
            return 1;
        }
    }
    atomic_store(&stop, 1);
    pthread_join(th, NULL);
    /* Racing calls may have written their output over the input. */
    memcpy(map, x, sizeof x);
    memcpy(ring + QM_RING_OFF_REQUEST, valid, sizeof valid);
    if (ring_call(++seq) != 0)
        die("the valid call failed after the race");
    if (memcmp(map + OUT_OFF, reference, sizeof reference) != 0)
        die("the valid call's output differs from the socket's after the race");
    printf("{\"calls\":%d,\"ok\":%d,\"invalid_params\":%d,\"not_found\":%d}\n", calls, seen[0],
           seen[1], seen[2]);
    return 0;
}
