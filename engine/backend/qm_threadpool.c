/* qm_threadpool.c - persistent pthread workers; tasks claimed by an atomic counter.
 *
 * Steering. A run wakes its workers while its caller computes; the
 * scheduler often queues a woken worker on the CPU of the thread that woke
 * it, where it waits for the caller's time slice to end (up to 1.5 ms on
 * these EEVDF kernels) while another CPU idles: seen with `perf sched` on
 * a 2-CPU VM, the worker's scheduling delay was 37 us at p50 and 0.9 ms at
 * p90, and in 11% of Qwen3-shaped T = 1 layer calls the worker started
 * after 300 us, leaving the caller alone. So before it wakes them, a run
 * keeps the workers off the caller's CPU: their affinity is the pool's
 * CPUs less the one the caller is on, set again only when the caller is on
 * another CPU than at the last run (about one run in nine there). Only
 * when every computing thread can have a CPU of its own (threads <= the
 * CPUs the pool may use); QMOE_CPU_STEER=0 turns it off; an affinity call
 * that fails (the CPUs allowed changed under the process) turns it off and
 * gives the workers back every CPU the pool may use.
 *
 * Joining late. A run is open from the moment its tasks are published until
 * its caller closes it; a worker enters it (one compare-and-swap on `gate`:
 * the count of workers inside, and a closed bit) only while it is open, and
 * the caller closes it once it has drained the tasks and no worker is
 * inside. So a worker that wakes after its caller ran every task (a small
 * run: the worker's wake-up on an idle vCPU of these VMs is 27-37 us) finds
 * the run closed and goes back to sleep, and the caller returns without
 * waiting for it. A worker that entered holds the caller until it leaves:
 * every task it claimed is done before the run returns. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getcpu, pthread_setaffinity_np */
#endif
#include "qm_threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_clock.h"
#include "qm_sync.h"
#include "qm_error.h"

/* How long the caller of a run spins for the workers' last tasks before it
 * sleeps: a task is a few tiles (microseconds), and a sleep costs a wake-up
 * (tens of microseconds when the core went idle, as between an engine's
 * layer calls), while the caller's core has nothing else to run. */
#define QM__END_SPIN_US 50u
#define QM__GATE_CLOSED 0x80000000u

struct qm__pool {
    unsigned threads; /* computing threads including the caller */
    pthread_t *workers;
    unsigned started;
    pthread_mutex_t run_lock; /* one run at a time */
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    unsigned long generation;
    /* The current run's gate: QM__GATE_CLOSED, or the workers inside it
     * (the file's head comment). */
    atomic_uint gate;
    atomic_int waiting; /* the caller sleeps on `done` (set under mu) */
    int stopping;
    /* Steering (the file's head comment); the run lock's. */
    int steer;        /* on */
    int steered_cpu;  /* the CPU the workers are kept off; -1: none */
    cpu_set_t cpus;   /* what the pool may use, from its creator's affinity */
    /* Current run. */
    qm__task_fn fn;
    void *arg;
    size_t n;
    atomic_size_t next;
};

typedef struct qm__worker_arg {
    qm__pool *pool;
    unsigned id;
} qm__worker_arg;

static void qm__pool_drain(qm__pool *p, unsigned worker)
{
    for (;;) {
        size_t i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (i >= p->n)
            return;
        p->fn(p->arg, i, worker);
    }
}

/* 1 when the worker entered the open run (counted in the gate); 0 when the
 * run is closed: its caller is done with it. */
static int qm__pool_enter(qm__pool *p)
{
    unsigned g = atomic_load(&p->gate);
    while (!(g & QM__GATE_CLOSED))
        if (atomic_compare_exchange_weak(&p->gate, &g, g + 1))
            return 1;
    return 0;
}

static void *qm__pool_main(void *varg)
{
    qm__worker_arg *wa = varg;
    qm__pool *p = wa->pool;
    unsigned id = wa->id;
    qm_free(wa);
    unsigned long seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stopping && p->generation == seen)
            pthread_cond_wait(&p->wake, &p->mu);
        if (p->stopping)
            break;
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);
        if (qm__pool_enter(p)) {
            qm__pool_drain(p, id);
            /* Left: the last one out wakes a caller that sleeps. */
            if (atomic_fetch_sub(&p->gate, 1) == 1 && atomic_load(&p->waiting)) {
                pthread_mutex_lock(&p->mu);
                pthread_cond_signal(&p->done);
                pthread_mutex_unlock(&p->mu);
            }
        }
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int qm__pool_new(unsigned threads, qm__pool **out)
{
    *out = NULL;
    if (threads == 0)
        threads = 1;
    qm__pool *p = qm_calloc(1, sizeof *p);
    if (!p)
        return QM_ENOMEM;
    p->threads = threads;
    pthread_mutex_init(&p->run_lock, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->next, 0);
    atomic_init(&p->gate, QM__GATE_CLOSED);
    atomic_init(&p->waiting, 0);
    if (threads > 1) {
        p->workers = qm_calloc(threads - 1, sizeof(pthread_t));
        if (!p->workers)
            goto fail;
        for (unsigned i = 0; i + 1 < threads; i++) {
            qm__worker_arg *wa = qm_malloc(sizeof *wa);
            if (!wa)
                goto fail;
            wa->pool = p;
            wa->id = i + 1;
            if (pthread_create(&p->workers[i], NULL, qm__pool_main, wa) != 0) {
                qm_free(wa);
                goto fail;
            }
            p->started++;
        }
    }
    p->steered_cpu = -1;
    const char *env = getenv("QMOE_CPU_STEER");
    p->steer = p->started > 0 && !(env && strcmp(env, "0") == 0) &&
               sched_getaffinity(0, sizeof p->cpus, &p->cpus) == 0 &&
               (unsigned)CPU_COUNT(&p->cpus) >= p->threads;
    *out = p;
    return 0;
fail:
    qm__pool_free(p);
    return QM_ENOMEM;
}

void qm__pool_free(qm__pool *p)
{
    if (!p)
        return;
    qm_workers_stop(&p->mu, &p->wake, &p->stopping, p->workers, p->started);
    qm_free(p->workers);
    qm_lock2_destroy(&p->mu, &p->done, &p->wake);
    pthread_mutex_destroy(&p->run_lock);
    qm_free(p);
}

unsigned qm__pool_threads(const qm__pool *p)
{
    return p->threads;
}

int qm__pool_steered_cpu(const qm__pool *p)
{
    return p->steer ? p->steered_cpu : -1;
}

static int qm__pool_set_workers(qm__pool *p, const cpu_set_t *m)
{
    for (unsigned w = 0; w < p->started; w++)
        if (pthread_setaffinity_np(p->workers[w], sizeof *m, m) != 0)
            return -1;
    return 0;
}

/* Keeps the workers off the caller's CPU (run lock held). */
static void qm__pool_steer(qm__pool *p)
{
    int c = sched_getcpu();
    if (c < 0 || c == p->steered_cpu || c >= CPU_SETSIZE || !CPU_ISSET(c, &p->cpus))
        return;
    cpu_set_t m = p->cpus;
    CPU_CLR(c, &m);
    if (qm__pool_set_workers(p, &m) == 0) {
        p->steered_cpu = c;
        return;
    }
    p->steer = 0;
    p->steered_cpu = -1;
    (void)qm__pool_set_workers(p, &p->cpus);
}

/* Until no worker is inside the run (new ones may still enter). */
static void qm__pool_wait_inside(qm__pool *p)
{
    uint64_t t0 = 0;
    for (unsigned i = 0; atomic_load(&p->gate) != 0; i++) {
        if ((i & 63) == 0) {
            uint64_t t = qm__now_us();
            if (!t0)
                t0 = t;
            else if (t - t0 >= QM__END_SPIN_US)
                break;
        }
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    if (atomic_load(&p->gate) == 0)
        return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->waiting, 1);
    while (atomic_load(&p->gate) != 0)
        pthread_cond_wait(&p->done, &p->mu);
    atomic_store(&p->waiting, 0);
    pthread_mutex_unlock(&p->mu);
}

void qm__pool_run_here(qm__pool *p, size_t n, qm__task_fn fn, void *arg)
{
    pthread_mutex_lock(&p->run_lock);
    for (size_t i = 0; i < n; i++)
        fn(arg, i, 0);
    pthread_mutex_unlock(&p->run_lock);
}

void qm__pool_run(qm__pool *p, size_t n, qm__task_fn fn, void *arg)
{
    if (n == 0)
        return;
    pthread_mutex_lock(&p->run_lock);
    if (p->started == 0 || n == 1) {
        for (size_t i = 0; i < n; i++)
            fn(arg, i, 0);
        pthread_mutex_unlock(&p->run_lock);
        return;
    }
    if (p->steer)
        qm__pool_steer(p);
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->n = n;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store(&p->gate, 0); /* open, nobody inside: after the task's fields */
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    qm__pool_drain(p, 0);
    /* Every task is claimed: close the run unless workers are inside, and
     * then wait for their last tasks (short: spin a while first). */
    for (;;) {
        unsigned open_empty = 0;
        if (atomic_compare_exchange_strong(&p->gate, &open_empty, QM__GATE_CLOSED))
            break;
        qm__pool_wait_inside(p);
    }
    pthread_mutex_unlock(&p->run_lock);
}
