/* qm_worker.c - the compute pool: per-session FIFOs, sessions in parallel.
 *
 * A session with work sits once on the run queue; a worker takes the
 * session, runs the head job of its FIFO, and puts the session back at the
 * tail if more jobs wait. So one session's jobs run in order, one at a time,
 * while different sessions run on different workers. Finished jobs go to a
 * done list the loop drains when an eventfd it polls becomes readable; the
 * worker writes it only when the loop has not been told yet (sends
 * coalesce). Not uv_async: libuv 1.44's loop spins, then sched_yield()s,
 * until the sending thread is back from its write, which on a loaded
 * machine costs the loop thread more than the whole T = 1 answer. */
#include "qm_pool.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <uv.h>

#include "qm_alloc.h"
#include "qm_fault.h"
#include "qm_telemetry.h"

struct qm_pool {
    uv_thread_t *threads;
    uint32_t n_threads;
    uv_mutex_t mu;
    uv_cond_t cv;
    qm_pool_hooks hooks;
    qm_job_queue *runq_head, *runq_tail;
    qm_job *done_head, *done_tail;
    int stop;
    int efd;              /* eventfd: done jobs wait */
    atomic_int told;      /* 1 while efd is written and not yet drained */
    uv_poll_t done_poll;  /* the loop's watch on efd */
    /* jobs enqueued and not completed, and of them the bounded ones (what
     * queue_depth bounds): counted up by whoever submits (the loop, a
     * ring's thread), down by the loop */
    atomic_size_t queued;
    atomic_size_t queued_bounded;
};

void qm_job_free(qm_job *job)
{
    if (!job)
        return;
    qm_request_free(&job->req);
    qm_fds_close(&job->fds);
    qm_map_refs_release(&job->maps);
    qm_buf_free(&job->response);
    qm_free(job->route_experts);
    qm_free(job->budget_auto);
    qm_free(job);
}

static void job_list_append(qm_job **head, qm_job **tail, qm_job *job)
{
    if (*tail)
        (*tail)->next = job;
    else
        *head = job;
    *tail = job;
}

/* Puts a session's queue with jobs at the tail of the run queue (pool
 * lock). The caller signals the condition after unlocking: a worker woken
 * while the lock is still held would only block on it again (two more
 * switches on every hand-off of a T = 1 inference). */
static void runq_push(qm_pool *p, qm_job_queue *q)
{
    if (p->runq_tail)
        p->runq_tail->runq_next = q;
    else
        p->runq_head = q;
    p->runq_tail = q;
}

/* Wakes the loop for the done list, once until it drains it. */
static void done_notify(qm_pool *p)
{
    if (atomic_exchange(&p->told, 1))
        return;
    uint64_t one = 1;
    while (write(p->efd, &one, sizeof one) < 0 && errno == EINTR)
        ;
}

/* Runs `job` of q's FIFO (the caller holds the FIFO; p's lock released)
 * and hands it back: to the done list, the FIFO to the run queue when more
 * waits in it. Returns with the lock released. */
static void run_job(qm_pool *p, qm_job_queue *q, qm_job *job)
{
    job->start_us = qm_now_us();
    if (job->ops->run)
        job->ops->run(job);
    job->end_us = qm_now_us();
    uv_mutex_lock(&p->mu);
    job_list_append(&p->done_head, &p->done_tail, job);
    int more = q->head != NULL;
    if (more)
        runq_push(p, q);
    else
        q->scheduled = 0;
    /* Wake the loop with the lock released, so that its done_cb does not
     * find it held and sleep on it. */
    uv_mutex_unlock(&p->mu);
    if (more)
        uv_cond_signal(&p->cv);
    done_notify(p);
}

static void worker_main(void *arg)
{
    qm_pool *p = arg;
    qm_fault_tag_thread(QM_FAULT_WORKER);
    uv_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && !p->runq_head)
            uv_cond_wait(&p->cv, &p->mu);
        if (p->stop)
            break;
        qm_job_queue *q = p->runq_head;
        p->runq_head = q->runq_next;
        if (!p->runq_head)
            p->runq_tail = NULL;
        q->runq_next = NULL;
        qm_job *job = q->head;
        q->head = job->next;
        if (!q->head)
            q->tail = NULL;
        job->next = NULL;
        uv_mutex_unlock(&p->mu);

        run_job(p, q, job);
        uv_mutex_lock(&p->mu);
    }
    uv_mutex_unlock(&p->mu);
}

static void done_cb(uv_poll_t *h, int status, int events)
{
    qm_pool *p = h->data;
    (void)status;
    (void)events;
    uint64_t n;
    while (read(p->efd, &n, sizeof n) < 0 && errno == EINTR)
        ;
    /* Cleared before the drain: a job finished after it writes again. */
    atomic_store(&p->told, 0);
    uv_mutex_lock(&p->mu);
    qm_job *list = p->done_head;
    p->done_head = p->done_tail = NULL;
    uv_mutex_unlock(&p->mu);
    while (list) {
        qm_job *job = list;
        list = job->next;
        job->next = NULL;
        atomic_fetch_sub(&p->queued, 1);
        if (job->ops->bounded)
            atomic_fetch_sub(&p->queued_bounded, 1);
        atomic_fetch_sub(&job->queue->pending, 1);
        p->hooks.done(p->hooks.arg, job);
    }
    if (p->hooks.idle)
        p->hooks.idle(p->hooks.arg);
}

int qm_pool_start(uv_loop_t *loop, uint32_t n_threads, const qm_pool_hooks *hooks,
                  qm_pool **out)
{
    *out = NULL;
    int rc = qm_fault_start();
    if (rc < 0)
        return rc;
    qm_pool *p = qm_calloc(1, sizeof *p);
    if (!p)
        return QM_ENOMEM;
    p->hooks = *hooks;
    if (uv_mutex_init(&p->mu) != 0)
        goto fail_mutex;
    if (uv_cond_init(&p->cv) != 0)
        goto fail_cond;
    p->threads = qm_calloc(n_threads ? n_threads : 1, sizeof *p->threads);
    if (!p->threads)
        goto fail_threads;
    p->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (p->efd < 0)
        goto fail_efd;
    if (uv_poll_init(loop, &p->done_poll, p->efd) != 0)
        goto fail_poll;
    p->done_poll.data = p;
    uv_poll_start(&p->done_poll, UV_READABLE, done_cb);
    *out = p;
    for (uint32_t i = 0; i < n_threads; i++) {
        /* The workers started so far are joined by qm_pool_stop. */
        if (uv_thread_create(&p->threads[i], worker_main, p) != 0)
            return QM_ENOMEM;
        p->n_threads++;
    }
    qm_fault_tag_thread(QM_FAULT_LOOP);
    return 0;

fail_poll:
    close(p->efd);
fail_efd:
    qm_free(p->threads);
fail_threads:
    uv_cond_destroy(&p->cv);
fail_cond:
    uv_mutex_destroy(&p->mu);
fail_mutex:
    qm_free(p);
    return QM_ENOMEM;
}

void qm_pool_stop(qm_pool *p)
{
    if (!p)
        return;
    uv_mutex_lock(&p->mu);
    p->stop = 1;
    uv_cond_broadcast(&p->cv);
    uv_mutex_unlock(&p->mu);
    for (uint32_t i = 0; i < p->n_threads; i++)
        uv_thread_join(&p->threads[i]);
    qm_free(p->threads);
    qm_fault_report();
    uv_cond_destroy(&p->cv);
    uv_mutex_destroy(&p->mu);
    /* The poll handle was closed with the loop's other handles. */
    close(p->efd);
    qm_free(p);
}

size_t qm_pool_queued(const qm_pool *p) { return p ? atomic_load(&((qm_pool *)p)->queued) : 0; }

/* Counts a job submitted: the loop's bookkeeping sees it until done_cb. */
static void count_submitted(qm_pool *p, qm_job *job)
{
    job->enqueue_us = qm_now_us();
    job->next = NULL;
    atomic_fetch_add(&p->queued, 1);
    if (job->ops->bounded)
        atomic_fetch_add(&p->queued_bounded, 1);
    atomic_fetch_add(&job->queue->pending, 1);
}

int qm_pool_run_or_queue(qm_pool *p, qm_job *job)
{
    qm_job_queue *q = job->queue;
    count_submitted(p, job);
    uv_mutex_lock(&p->mu);
    if (q->scheduled) {
        /* The session's FIFO is busy (its jobs queued or running): this
         * one waits its turn there; whoever holds the FIFO now puts it on
         * the run queue when done. */
        job_list_append(&q->head, &q->tail, job);
        uv_mutex_unlock(&p->mu);
        return 0;
    }
    q->scheduled = 1; /* held by this thread: no worker takes the session now */
    uv_mutex_unlock(&p->mu);
    run_job(p, q, job);
    return 1;
}

int qm_pool_submit(qm_pool *p, qm_job *job, uint32_t queue_depth)
{
    /* Only bounded jobs hold compute worth refusing: barriers and session
     * creation are bounded by the sessions that exist. */
    if (job->ops->bounded && atomic_load(&p->queued_bounded) >= queue_depth)
        return QM_EOVERLOADED;
    count_submitted(p, job);
    qm_job_queue *q = job->queue;
    uv_mutex_lock(&p->mu);
    job_list_append(&q->head, &q->tail, job);
    int wake = !q->scheduled;
    if (wake) {
        q->scheduled = 1;
        runq_push(p, q);
    }
    uv_mutex_unlock(&p->mu);
    if (wake)
        uv_cond_signal(&p->cv);
    return 0;
}
