/* qm_threadpool.h - persistent worker pool of the CPU backend. Private to engine/.
 *
 * qm__pool_run hands task indices 0..n-1 to the calling thread plus the
 * pool's workers; which thread runs which task varies, so callers make
 * every task's result independent of that. One run at a time per pool
 * (concurrent callers are serialised). */
#ifndef QM_THREADPOOL_H
#define QM_THREADPOOL_H

#include <stddef.h>

typedef void (*qm__task_fn)(void *arg, size_t task, unsigned worker);
typedef struct qm__pool qm__pool;

/* `threads` >= 1 computing threads in total (the caller counts as one). */
int qm__pool_new(unsigned threads, qm__pool **out);
void qm__pool_free(qm__pool *pool); /* accepts NULL; joins the workers */
unsigned qm__pool_threads(const qm__pool *pool);
/* Runs fn(arg, i, worker) for i in [0, n); worker < qm__pool_threads. Returns when all are done. */
void qm__pool_run(qm__pool *pool, size_t n, qm__task_fn fn, void *arg);
/* The same on the calling thread alone (worker 0), waking nobody: for a
 * run too small to be worth a worker's wake-up. */
void qm__pool_run_here(qm__pool *pool, size_t n, qm__task_fn fn, void *arg);
/* The CPU the workers were kept off at the last run that woke them
 * (qm_threadpool.c's head comment), or -1: none yet, or steering is off
 * (QMOE_CPU_STEER=0, more threads than CPUs, or an affinity call failed). */
int qm__pool_steered_cpu(const qm__pool *pool);

#endif
