/* qm_pager_copy.c - the pager's copy path.
 *
 * Device backends (CUDA) copy asynchronously by themselves: units are issued
 * with qm_backend_copy_h2d and one fence per region, waited before use.
 * Host-visible backends (CPU) copy synchronously inside copy_h2d, so a copy
 * would never overlap compute; the pager then owns one copy thread that is
 * the only caller of copy_h2d, fed a FIFO of unit jobs. Demand misses go
 * through the same FIFO (one copy path, like a copy stream), prefetches
 * overlap with the caller's compute. */
#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_clock.h"
#include "qm_pager_copy.h"
#include "qm_pager_disk.h"
#include "qm_sync.h"

/* One unit's copy: up to one region per expert tensor. */
typedef struct qm__copy_job {
    uint64_t seq;
    int32_t slot;
    uint32_t n;
    void *dst[QM_T_EXPERT_COUNT];
    const void *src[QM_T_EXPERT_COUNT];
    uint64_t len[QM_T_EXPERT_COUNT];
} qm__copy_job;

static int qm__copy_regions(qm_pager *p, const qm__copy_job *job, qm_status *st)
{
    for (uint32_t i = 0; i < job->n; i++) {
        if (p->disk) {
            int rc = qm__pager_disk_read(p, job->dst[i], job->src[i], job->len[i], st);
            if (rc)
                return rc;
            continue;
        }
        qm_fence f = {0};
        int rc = qm_backend_copy_h2d(p->backend, job->dst[i], job->src[i], job->len[i], &f, st);
        if (rc == 0)
            rc = qm_backend_fence_wait(p->backend, &f, st);
        if (rc)
            return rc;
    }
    return 0;
}

static void *qm__copy_thread_main(void *arg)
{
    qm_pager *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->q_len == 0 && !p->stop)
            pthread_cond_wait(&p->cv_work, &p->mu);
        if (p->q_len == 0 && p->stop)
            break;
        qm__copy_job job = p->queue[p->q_head];
        pthread_mutex_unlock(&p->mu);
        qm_status est;
        qm_status_clear(&est);
        int rc = qm__copy_regions(p, &job, &est);
        pthread_mutex_lock(&p->mu);
        if (rc)
            snprintf(p->copy_msg, sizeof p->copy_msg, "%.*s", (int)sizeof p->copy_msg - 1, est.msg);
        p->q_head = (p->q_head + 1) % p->q_cap;
        p->q_len--;
        p->slots[job.slot].copy_rc = rc;
        p->done_seq = job.seq;
        pthread_cond_broadcast(&p->cv_done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int qm__pager_copy_start(qm_pager *p, qm_status *st)
{
    p->q_cap = (size_t)p->n_slots + 1;
    p->queue = qm_calloc(p->q_cap, sizeof *p->queue);
    if (!p->queue)
        return qm_status_set(st, QM_ENOMEM, "out of memory for the copy queue");
    if (qm_lock2_init(&p->mu, &p->cv_work, &p->cv_done)) goto fail_lock;
    p->stop = 0;
    if (pthread_create(&p->thread, NULL, qm__copy_thread_main, p))
        goto fail_thread;
    p->use_thread = 1;
    p->stats.host_bytes += p->q_cap * sizeof *p->queue;
    return 0;
fail_thread:
    qm_lock2_destroy(&p->mu, &p->cv_work, &p->cv_done);
fail_lock:
    qm_free(p->queue);
    p->queue = NULL;
    return qm_status_set(st, QM_ERESOURCE_EXHAUSTED, "cannot start the pager's copy thread");
}

void qm__pager_copy_stop(qm_pager *p)
{
    if (!p->use_thread) {
        qm_free(p->queue);
        p->queue = NULL;
        return;
    }
    qm_workers_stop(&p->mu, &p->cv_work, &p->stop, &p->thread, 1);
    qm_lock2_destroy(&p->mu, &p->cv_work, &p->cv_done);
    qm_free(p->queue);
    p->queue = NULL;
    p->use_thread = 0;
}

static void qm__unit_job(const qm_pager *p, int32_t s, qm__copy_job *job)
{
    const qm__slot *sl = &p->slots[s];
    const qm__layer *L = &p->layers[sl->layer];
    job->slot = s;
    job->n = 0;
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        const qm_tensor_view *tv = &L->view->t[t];
        if (!tv->present || L->slice[t] == 0)
            continue;
        job->dst[job->n] = sl->base + L->unit_off[t] + qm__slice_phase(L, t, sl->expert);
        job->src[job->n] = (const uint8_t *)tv->data + (uint64_t)sl->expert * L->slice[t];
        job->len[job->n] = L->slice[t];
        job->n++;
    }
}

int qm__pager_copy_unit(qm_pager *p, int32_t s, qm_status *st)
{
    qm__slot *sl = &p->slots[s];
    sl->n_fences = 0;
    sl->copy_seq = 0;
    sl->r8 = sl->r8_part_rows = 0; /* the bank's row layout lands */
    if (qm__pager_disk_async(p)) {
        /* copy_seq 1: a read of the I/O engine to collect. */
        sl->copy_rc = 0;
        int rc = qm__pager_disk_submit(p, s, sl->prefetched != QM__PF_NONE, st);
        sl->copy_seq = rc == 0;
        return sl->copy_rc = rc;
    }
    qm__copy_job job;
    qm__unit_job(p, s, &job);
    if (p->use_thread) {
        pthread_mutex_lock(&p->mu);
        if (p->q_len == p->q_cap) {
            /* One job per loading slot at most, so this cannot fill. */
            pthread_mutex_unlock(&p->mu);
            return qm_status_set(st, QM_EINTERNAL, "copy queue full (%zu jobs)", p->q_cap);
        }
        job.seq = ++p->next_seq;
        sl->copy_seq = job.seq;
        sl->copy_rc = 0;
        p->queue[(p->q_head + p->q_len) % p->q_cap] = job;
        p->q_len++;
        pthread_cond_signal(&p->cv_work);
        pthread_mutex_unlock(&p->mu);
        return 0;
    }
    /* A failure stays in copy_rc, so a later wait reports it again rather
     * than taking the slot for landed. */
    sl->copy_rc = 0;
    if (p->disk) /* synchronous reads on the caller's thread */
        return sl->copy_rc = qm__copy_regions(p, &job, st);
    for (uint32_t i = 0; i < job.n; i++) {
        sl->fences[i] = (qm_fence){0};
        int rc = qm_backend_copy_h2d(p->backend, job.dst[i], job.src[i], job.len[i],
                                     &sl->fences[i], st);
        if (rc) {
            /* Wait what was issued so nothing lands in a slot we give back. */
            for (uint32_t j = 0; j < i; j++)
                qm_backend_fence_wait(p->backend, &sl->fences[j], NULL);
            sl->n_fences = 0;
            sl->copy_rc = rc;
            return rc;
        }
        sl->n_fences = i + 1;
    }
    return 0;
}

/* Collects slot s's read from the I/O engine (waiting for it). */
static int qm__copy_wait_disk(qm_pager *p, int32_t s, qm_status *st)
{
    qm__slot *sl = &p->slots[s];
    qm_status why;
    qm_status_clear(&why);
    int rc = qm__pager_disk_wait(p, s, &why);
    sl->copy_seq = 0;
    sl->copy_rc = rc;
    if (rc)
        qm_status_set(st, rc, "copying expert %u of layer %u failed: %s", sl->expert, sl->layer,
                      why.msg);
    return rc;
}

int qm__pager_copy_wait(qm_pager *p, int32_t s, qm_status *st)
{
    qm__slot *sl = &p->slots[s];
    int rc = 0;
    if (sl->copy_seq && qm__pager_disk_async(p)) {
        rc = qm__copy_wait_disk(p, s, st);
    } else if (sl->copy_seq) {
        pthread_mutex_lock(&p->mu);
        while (p->done_seq < sl->copy_seq)
            pthread_cond_wait(&p->cv_done, &p->mu);
        rc = sl->copy_rc;
        char msg[sizeof p->copy_msg];
        snprintf(msg, sizeof msg, "%s", rc ? p->copy_msg : "");
        pthread_mutex_unlock(&p->mu);
        sl->copy_seq = 0;
        if (rc)
            qm_status_set(st, rc, "copying expert %u of layer %u failed: %s", sl->expert,
                          sl->layer, msg);
    } else if (sl->copy_rc) {
        /* Its failure was seen before: the slot never landed. */
        rc = sl->copy_rc;
        qm_status_set(st, rc, "copying expert %u of layer %u failed", sl->expert, sl->layer);
    } else {
        for (uint32_t i = 0; i < sl->n_fences; i++) {
            int r = qm_backend_fence_wait(p->backend, &sl->fences[i], rc ? NULL : st);
            if (r && !rc)
                rc = r;
        }
        sl->n_fences = 0;
        sl->copy_rc = rc;
    }
    if (rc == 0 && sl->state == QM__SLOT_LOADING)
        sl->state = QM__SLOT_RESIDENT;
    return rc;
}

void qm__pager_copy_promote(qm_pager *p, int32_t s)
{
    if (p->slots[s].copy_seq && qm__pager_disk_async(p))
        qm__pager_disk_promote(p, s);
}

int qm__pager_copy_landed(qm_pager *p, int32_t s)
{
    const qm__slot *sl = &p->slots[s];
    if (sl->state != QM__SLOT_LOADING || !sl->copy_seq)
        return 1; /* landed, failed, or device fences (a wait is all that can tell) */
    if (qm__pager_disk_async(p))
        return qm__pager_disk_landed(p, s);
    pthread_mutex_lock(&p->mu);
    int done = p->done_seq >= sl->copy_seq;
    pthread_mutex_unlock(&p->mu);
    return done;
}

void qm__pager_copy_wait_any(qm_pager *p, const int32_t *slots, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (qm__pager_copy_landed(p, slots[i]))
            return;
    if (n == 0)
        return;
    if (qm__pager_disk_async(p)) {
        (void)qm__pager_disk_wait_any(p, slots, n);
        return;
    }
    /* The copy thread lands jobs in order: the earliest of them first. */
    uint64_t first = UINT64_MAX;
    for (size_t i = 0; i < n; i++)
        if (p->slots[slots[i]].copy_seq && p->slots[slots[i]].copy_seq < first)
            first = p->slots[slots[i]].copy_seq;
    pthread_mutex_lock(&p->mu);
    while (p->done_seq < first)
        pthread_cond_wait(&p->cv_done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

int qm__pager_copy_now(qm_pager *p, void *dst, const void *src, uint64_t n, qm_status *st)
{
    if (p->disk)
        return qm__pager_disk_read(p, dst, src, n, st);
    qm_fence f = {0};
    int rc = qm_backend_copy_h2d(p->backend, dst, src, n, &f, st);
    if (rc == 0)
        rc = qm_backend_fence_wait(p->backend, &f, st);
    return rc;
}

int qm__pager_copy_parked(qm_pager *p, int32_t s)
{
    const qm__slot *sl = &p->slots[s];
    return sl->state == QM__SLOT_LOADING && sl->copy_seq && qm__pager_disk_async(p) &&
           qm__pager_disk_parked(p, s);
}

int qm__pager_copy_park(qm_pager *p, int32_t s)
{
    const qm__slot *sl = &p->slots[s];
    return sl->state == QM__SLOT_LOADING && sl->copy_seq && qm__pager_disk_async(p) &&
           qm__pager_disk_park(p, s);
}

int qm__pager_copy_resume(qm_pager *p, int32_t s)
{
    if (!p->slots[s].parked)
        return 0;
    p->slots[s].parked = 0;
    return qm__pager_copy_parked(p, s) && qm__pager_disk_unpark(p, s);
}

/* Slot s's parked read: its chunks in flight landed, the rest never read. */
static void qm__copy_settle_parked(qm_pager *p, int32_t s)
{
    qm__pager_disk_settle(p, s);
    p->slots[s].copy_seq = 0;
}

void qm__pager_evict(qm_pager *p, int32_t s)
{
    /* Never hand out a slot a copy may still be writing into. The wait
     * (a prefetch's read of a unit nobody used yet) holds up the call or
     * the prefetch evicting it: a stall like any other. A parked read is
     * not finished, only its chunks in flight waited for. */
    if (p->slots[s].state == QM__SLOT_LOADING) {
        const uint64_t t0 = qm__now_us();
        if (qm__pager_copy_parked(p, s))
            qm__copy_settle_parked(p, s);
        else
            (void)qm__pager_copy_wait(p, s, NULL);
        p->stats.stall_us += qm__now_us() - t0;
    }
    qm__pager_drop(p, s);
    p->stats.evictions++;
}

int qm__pager_slots_regrow(qm_pager *p, uint32_t n, qm_status *st)
{
    qm__copy_job *queue = NULL;
    if (p->use_thread) {
        queue = qm_calloc((size_t)n + 1, sizeof *queue);
        if (!queue)
            return qm_status_set(st, QM_ENOMEM, "out of memory for the copy queue");
    }
    /* The copy thread reads slots[] under its lock: swap it there. */
    if (p->use_thread)
        pthread_mutex_lock(&p->mu);
    qm__slot *slots = qm_realloc(p->slots, (size_t)n * sizeof *slots);
    if (slots) {
        p->slots = slots;
        if (p->use_thread) {
            /* Nothing is queued (the caller synced): a fresh, larger ring. */
            qm_free(p->queue);
            p->queue = queue;
            p->q_cap = (size_t)n + 1;
            p->q_head = 0;
            queue = NULL;
        }
    }
    if (p->use_thread)
        pthread_mutex_unlock(&p->mu);
    qm_free(queue);
    return slots ? 0 : qm_status_set(st, QM_ENOMEM, "out of memory growing to %u slots", n);
}

int qm_pager_sync(qm_pager *p, qm_status *st)
{
    if (!p)
        return 0;
    int rc = 0;
    for (uint32_t s = 0; s < p->n_slots; s++) {
        if (p->slots[s].state != QM__SLOT_LOADING)
            continue;
        if (p->slots[s].refs == 0 && qm__pager_copy_parked(p, (int32_t)s)) {
            /* A guess no call took up: given back rather than read on. */
            qm__copy_settle_parked(p, (int32_t)s);
            qm__pager_drop(p, (int32_t)s);
            continue;
        }
        qm_status tmp;
        int r = qm__pager_copy_wait(p, (int32_t)s, &tmp);
        if (r == 0)
            continue;
        if (p->slots[s].refs == 0) {
            /* A failed prefetch costs its slot, never the caller's request. */
            qm__pager_drop(p, (int32_t)s);
        } else if (!rc) {
            rc = r;
            if (st)
                *st = tmp;
        }
    }
    return rc;
}
