/* qm_worker.c - the compute pool: per-session FIFOs, sessions in parallel.
 *
 * A session with work sits once on the run queue; a worker takes the
 * session, runs the head job of its FIFO, and puts the session back at the
 * tail if more jobs wait. So one session's jobs run in order, one at a time,
 * while different sessions run on different workers. Finished jobs go to a
 * done list the loop drains from a uv_async callback (sends coalesce). */
#include "qm_daemon.h"

#include <execinfo.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"

/* Test hook for the hardening suite (docs/RELIABILITY.md, "Faults"):
 * QMOED_FAULT_ALLOC=[CLASS:]N makes the Nth qm_malloc/qm_realloc made by a
 * thread of CLASS return NULL, once; N=0 only counts. The classes:
 *   worker  a worker running a job: session build, inference, plan (the
 *           engine, the pager, the CPU backend's arena and scratch);
 *   loop    the event-loop thread once the daemon serves: reading and
 *           decoding requests, dispatch, replies, connections, model.load;
 *   engine  threads the engine starts itself: the pager's copy thread and
 *           the CPU backend's compute pool (every untagged thread).
 * A bare N means worker:N (the hook's first form). The counts of every
 * class are printed to stderr at exit; QMOED_FAULT_BT=1 also prints the
 * stack of the failed allocation. Unset, no hook is installed and
 * allocation is plain libc. */
enum { FAULT_ENGINE, FAULT_WORKER, FAULT_LOOP, FAULT_OFF, FAULT_N_CLASSES };
static const char *const fault_names[FAULT_N_CLASSES] = {"engine", "worker", "loop", "off"};
static _Thread_local int fault_class; /* threads the daemon does not tag: FAULT_ENGINE */
static atomic_ulong fault_count[FAULT_N_CLASSES];
static int fault_target = FAULT_WORKER;
static unsigned long fault_at;
static int fault_backtrace; /* QMOED_FAULT_BT set: print the failed call's stack */

static int fault_hit(void)
{
    int cls = fault_class;
    if (cls == FAULT_OFF)
        return 0;
    int hit = atomic_fetch_add(&fault_count[cls], 1) + 1 == fault_at && cls == fault_target;
    if (hit && fault_backtrace) {
        /* Where the failure was injected, for addr2line. */
        void *bt[32];
        backtrace_symbols_fd(bt, backtrace(bt, 32), 2);
    }
    return hit;
}
static void *fault_malloc(size_t n, void *ud)
{
    (void)ud;
    return fault_hit() ? NULL : malloc(n);
}
static void *fault_realloc(void *ptr, size_t n, void *ud)
{
    (void)ud;
    return fault_hit() ? NULL : realloc(ptr, n);
}
static void fault_free(void *ptr, void *ud)
{
    (void)ud;
    free(ptr);
}

/* Parses QMOED_FAULT_ALLOC; 0 when set and valid. */
static int fault_parse(const char *spec)
{
    const char *colon = strchr(spec, ':');
    if (colon) {
        size_t len = (size_t)(colon - spec);
        fault_target = -1;
        for (int i = 0; i < FAULT_OFF; i++)
            if (strlen(fault_names[i]) == len && memcmp(spec, fault_names[i], len) == 0)
                fault_target = i;
        if (fault_target < 0)
            return -1;
        spec = colon + 1;
    }
    char *end;
    fault_at = strtoul(spec, &end, 10);
    return *spec && !*end ? 0 : -1;
}

void qm_job_free(qm_job *job)
{
    if (!job)
        return;
    qm_request_free(&job->req);
    qm_buf_free(&job->response);
    qm_free(job->route_experts);
    qm_free(job);
}

static void worker_main(void *arg)
{
    qm_daemon *d = arg;
    qm_pool *p = &d->pool;
    fault_class = FAULT_WORKER;
    uv_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && !p->runq_head)
            uv_cond_wait(&p->cv, &p->mu);
        if (p->stop)
            break;
        qm_session *s = p->runq_head;
        p->runq_head = s->runq_next;
        if (!p->runq_head)
            p->runq_tail = NULL;
        s->runq_next = NULL;
        qm_job *job = s->q_head;
        s->q_head = job->next;
        if (!s->q_head)
            s->q_tail = NULL;
        job->next = NULL;
        uv_mutex_unlock(&p->mu);

        job->start_us = qm_now_us();
        if (job->kind == QM_JOB_INFER)
            qm_job_run(job);
        else if (job->kind == QM_JOB_CREATE)
            job->rc = qm_session_build(d, s, &job->st);
        else if (job->kind == QM_JOB_PLAN)
            qm_job_run_plan(job);
        job->end_us = qm_now_us();

        uv_mutex_lock(&p->mu);
        if (p->done_tail)
            p->done_tail->next = job;
        else
            p->done_head = job;
        p->done_tail = job;
        if (s->q_head) {
            if (p->runq_tail)
                p->runq_tail->runq_next = s;
            else
                p->runq_head = s;
            p->runq_tail = s;
            uv_cond_signal(&p->cv);
        } else {
            s->scheduled = 0;
        }
        uv_async_send(&p->async);
    }
    uv_mutex_unlock(&p->mu);
}

static void done_cb(uv_async_t *h)
{
    qm_daemon *d = h->data;
    qm_pool *p = &d->pool;
    uv_mutex_lock(&p->mu);
    qm_job *list = p->done_head;
    p->done_head = p->done_tail = NULL;
    uv_mutex_unlock(&p->mu);
    while (list) {
        qm_job *job = list;
        list = job->next;
        job->next = NULL;
        p->queued--;
        if (job->kind == QM_JOB_INFER)
            p->queued_infer--;
        qm_dispatch_job_done(d, job);
    }
    qm_daemon_maybe_finish(d);
}

int qm_pool_start(qm_daemon *d, uint32_t n_threads)
{
    qm_pool *p = &d->pool;
    memset(p, 0, sizeof *p);
    if (uv_mutex_init(&p->mu) != 0)
        return QM_ENOMEM;
    if (uv_cond_init(&p->cv) != 0) {
        uv_mutex_destroy(&p->mu);
        return QM_ENOMEM;
    }
    uv_async_init(d->loop, &p->async, done_cb);
    p->async.data = d;
    const char *fault = getenv("QMOED_FAULT_ALLOC");
    if (fault && *fault) {
        static const qm_alloc_hooks hooks = {fault_malloc, fault_realloc, fault_free, NULL};
        if (fault_parse(fault) < 0) {
            qm_log(QM_LOG_ERR, "QMOED_FAULT_ALLOC=%s: expected [worker:|loop:|engine:]N", fault);
            return QM_EINVAL;
        }
        /* The engine's compute pool already runs but does not allocate
         * until a job does; no worker runs yet. The loop thread counts
         * from the end of this function: only request paths. */
        fault_class = FAULT_OFF;
        fault_backtrace = getenv("QMOED_FAULT_BT") != NULL;
        qm_alloc_set_hooks(&hooks);
    }
    p->threads = qm_calloc(n_threads, sizeof *p->threads);
    if (!p->threads)
        return QM_ENOMEM;
    for (uint32_t i = 0; i < n_threads; i++) {
        if (uv_thread_create(&p->threads[i], worker_main, d) != 0)
            return QM_ENOMEM;
        p->n_threads++;
    }
    fault_class = FAULT_LOOP;
    return 0;
}

void qm_pool_stop(qm_daemon *d)
{
    qm_pool *p = &d->pool;
    if (!p->threads)
        return;
    uv_mutex_lock(&p->mu);
    p->stop = 1;
    uv_cond_broadcast(&p->cv);
    uv_mutex_unlock(&p->mu);
    for (uint32_t i = 0; i < p->n_threads; i++)
        uv_thread_join(&p->threads[i]);
    qm_free(p->threads);
    p->threads = NULL;
    if (getenv("QMOED_FAULT_ALLOC"))
        fprintf(stderr, "qmoed: QMOED_FAULT_ALLOC: %lu worker allocations, %lu loop, "
                        "%lu engine; failed %s #%lu\n",
                (unsigned long)atomic_load(&fault_count[FAULT_WORKER]),
                (unsigned long)atomic_load(&fault_count[FAULT_LOOP]),
                (unsigned long)atomic_load(&fault_count[FAULT_ENGINE]),
                fault_names[fault_target], fault_at);
    uv_cond_destroy(&p->cv);
    uv_mutex_destroy(&p->mu);
}

int qm_pool_submit(qm_daemon *d, qm_job *job)
{
    qm_pool *p = &d->pool;
    /* Only inferences hold compute worth refusing: barriers and session
     * creation are bounded by the sessions that exist. */
    if (job->kind == QM_JOB_INFER && p->queued_infer >= d->cfg.queue_depth) {
        qm_limit_hit(d, QM_LIMIT_QUEUE_DEPTH, "queue_depth %u reached: answering overloaded",
                     d->cfg.queue_depth);
        return QM_EOVERLOADED;
    }
    qm_session *s = job->session;
    job->enqueue_us = qm_now_us();
    job->next = NULL;
    p->queued++;
    if (job->kind == QM_JOB_INFER)
        p->queued_infer++;
    s->pending++;
    uv_mutex_lock(&p->mu);
    if (s->q_tail)
        s->q_tail->next = job;
    else
        s->q_head = job;
    s->q_tail = job;
    if (!s->scheduled) {
        s->scheduled = 1;
        if (p->runq_tail)
            p->runq_tail->runq_next = s;
        else
            p->runq_head = s;
        p->runq_tail = s;
        uv_cond_signal(&p->cv);
    }
    uv_mutex_unlock(&p->mu);
    return 0;
}
