/* qm_worker.c - the compute pool: per-session FIFOs, sessions in parallel.
 *
 * A session with work sits once on the run queue; a worker takes the
 * session, runs the head job of its FIFO, and puts the session back at the
 * tail if more jobs wait. So one session's jobs run in order, one at a time,
 * while different sessions run on different workers. Finished jobs go to a
 * done list the loop drains from a uv_async callback (sends coalesce). */
#include "qm_daemon.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"

/* Test hook for the hardening suite (docs/RELIABILITY.md, "Faults"):
 * QMOED_FAULT_ALLOC=N makes the Nth qm_malloc/qm_realloc made while a
 * worker runs a job (session build, inference, plan: the engine and pager
 * paths) return NULL, once; N=0 only counts. The count is printed at exit.
 * Unset, no hook is installed and allocation is plain libc. */
static _Thread_local int fault_in_job;
static atomic_ulong fault_count;
static unsigned long fault_at;

static int fault_hit(void)
{
    return fault_in_job && atomic_fetch_add(&fault_count, 1) + 1 == fault_at;
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
        fault_in_job = 1;
        if (job->kind == QM_JOB_INFER)
            qm_job_run(job);
        else if (job->kind == QM_JOB_CREATE)
            job->rc = qm_session_build(d, s, &job->st);
        else if (job->kind == QM_JOB_PLAN)
            qm_job_run_plan(job);
        fault_in_job = 0;
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
        fault_at = strtoul(fault, NULL, 10);
        qm_alloc_set_hooks(&hooks); /* no worker runs yet */
    }
    p->threads = qm_calloc(n_threads, sizeof *p->threads);
    if (!p->threads)
        return QM_ENOMEM;
    for (uint32_t i = 0; i < n_threads; i++) {
        if (uv_thread_create(&p->threads[i], worker_main, d) != 0)
            return QM_ENOMEM;
        p->n_threads++;
    }
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
        fprintf(stderr, "qmoed: QMOED_FAULT_ALLOC: %lu worker allocations, failed #%lu\n",
                (unsigned long)atomic_load(&fault_count), fault_at);
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
