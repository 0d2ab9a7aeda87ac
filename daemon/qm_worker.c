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
 * machine costs the loop thread more than the whole T = 1 answer.
 *
 * A call ring's job run on the ring's own thread (qm_pool_run_or_queue)
 * has already answered its client: it joins the done list without waking
 * the loop, marked lazy (waking a thread costs the waker several
 * microseconds on a VM, and the loop's wake-up would compete with the
 * client's on a small machine). The loop takes lazy jobs when a frame is
 * about to be dispatched (qm_pool_collect: telemetry counts every answered
 * call), at the end of every loop iteration (a check handle; the daemon's
 * when a ring nudges it (qm_pool_nudge: lazy jobs older than the ring's
 * bound, told while the ring's thread has nothing else to do; a ring that
 * parks before they are that old nudges again when they are). */
#include "qm_pool.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <uv.h>

#include "qm_alloc.h"
#include "qm_fault.h"
#include "qm_io.h"
#include "qm_log.h"
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
    atomic_int lazy;      /* done jobs of rings wait, the loop not told */
    atomic_uint_fast64_t lazy_since_us; /* when the oldest of them was done */
    uv_poll_t done_poll;  /* the loop's watch on efd */
    uv_check_t lazy_check; /* takes lazy jobs at the end of each loop iteration */
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
    qm_eventfd_post(p->efd);
}

/* Runs `job` of q's FIFO (the caller holds the FIFO; p's lock released)
 * and hands it back: to the done list, the FIFO to the run queue when more
 * waits in it. Returns with the lock released. `lazy`: a ring's job run on
 * the ring's thread, whose client has its answer: the loop is not woken
 * for it (the file's head comment). */
static void run_job(qm_pool *p, qm_job_queue *q, qm_job *job, int lazy)
{
    job->start_us = qm_now_us();
    if (job->ops->run)
        job->ops->run(job);
    uint64_t end_us = job->end_us = qm_now_us();
    /* From here the loop may take the job and free it: not read again. */
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
    if (!lazy)
        done_notify(p);
    else if (!atomic_exchange(&p->lazy, 1))
        atomic_store(&p->lazy_since_us, end_us);
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

        run_job(p, q, job, 0);
        uv_mutex_lock(&p->mu);
    }
    uv_mutex_unlock(&p->mu);
}

/* The head of a list of jobs handed back, taken off it and counted gone
 * from the pool and from its session's queue. */
static qm_job *take_counted(qm_pool *p, qm_job **list)
{
    qm_job *job = *list;
    *list = job->next;
    job->next = NULL;
    atomic_fetch_sub(&p->queued, 1);
    if (job->ops->bounded)
        atomic_fetch_sub(&p->queued_bounded, 1);
    atomic_fetch_sub(&job->queue->pending, 1);
    return job;
}

/* Hands every done job to the loop's hook, in the order they were done. */
static void done_drain(qm_pool *p)
{
    atomic_store(&p->lazy, 0); /* a job done after this marks it again */
    uv_mutex_lock(&p->mu);
    qm_job *list = p->done_head;
    p->done_head = p->done_tail = NULL;
    uv_mutex_unlock(&p->mu);
    while (list) {
        qm_job *job = take_counted(p, &list);
        p->hooks.done(p->hooks.arg, job);
    }
    if (p->hooks.idle)
        p->hooks.idle(p->hooks.arg);
}

static void done_cb(uv_poll_t *h, int status, int events)
{
    qm_pool *p = h->data;
    (void)status;
    (void)events;
    qm_eventfd_take(p->efd);
    /* Cleared before the drain: a job finished after it writes again. */
    atomic_store(&p->told, 0);
    done_drain(p);
}

static void lazy_check_cb(uv_check_t *h) { qm_pool_collect(h->data); }

void qm_pool_collect(qm_pool *p)
{
    if (p && atomic_load(&p->lazy))
        done_drain(p);
}

uint64_t qm_pool_nudge(qm_pool *p, uint64_t older_than_us)
{
    if (!atomic_load(&p->lazy))
        return 0;
    uint64_t age = qm_now_us() - atomic_load(&p->lazy_since_us);
    if (age < older_than_us)
        return older_than_us - age;
    done_notify(p);
    return 0;
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
    uv_check_init(loop, &p->lazy_check);
    p->lazy_check.data = p;
    uv_check_start(&p->lazy_check, lazy_check_cb);
    uv_unref((uv_handle_t *)&p->lazy_check);
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

/* The jobs no loop will take now that the workers are joined: those done
 * after the loop's last drain (a ring's call taken as the daemon stopped)
 * and those never run (drain_timeout_s ran out with work queued), handed
 * to hooks.discard, which gives back what each holds. Every queue with
 * jobs is on the run queue here: whoever held one pushed it there. */
static void discard_left(qm_pool *p)
{
    qm_job *list = p->done_head, *tail = p->done_tail;
    size_t done = 0, never_ran = 0;
    for (qm_job *j = list; j; j = j->next)
        done++;
    p->done_head = p->done_tail = NULL;
    for (qm_job_queue *q = p->runq_head; q; q = q->runq_next) {
        for (qm_job *j = q->head; j; j = j->next)
            never_ran++;
        if (q->head) {
            if (tail)
                tail->next = q->head;
            else
                list = q->head;
            tail = q->tail;
        }
        q->head = q->tail = NULL;
        q->scheduled = 0;
    }
    p->runq_head = p->runq_tail = NULL;
    if (done + never_ran)
        qm_log(QM_LOG_INFO, "exiting with %zu jobs the loop did not take (%zu done, %zu never "
               "run): released", done + never_ran, done, never_ran);
    /* The list is whole before the first discard: that may free a session
     * and the queue embedded in it. */
    while (list) {
        qm_job *job = take_counted(p, &list);
        if (p->hooks.discard)
            p->hooks.discard(p->hooks.arg, job);
    }
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
    discard_left(p);
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
    run_job(p, q, job, 1);
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
