/* qm_sync.h - the lock shapes of a worker handoff, written once: a mutex
 * with the two conditions a worker and its caller wait on (set up whole or
 * not at all), and the stop of a set of workers. */
#ifndef QM_SYNC_H
#define QM_SYNC_H

#include <pthread.h>
#include <stddef.h>

/* Initialises mu, cv_a and cv_b. Returns 0, or -1 with none of them left
 * initialised. */
int qm_lock2_init(pthread_mutex_t *mu, pthread_cond_t *cv_a, pthread_cond_t *cv_b);
/* Destroys what qm_lock2_init initialised. */
void qm_lock2_destroy(pthread_mutex_t *mu, pthread_cond_t *cv_a, pthread_cond_t *cv_b);

/* Sets *stop to 1 under mu, wakes every waiter on wake, then joins the n
 * threads (their results are dropped). The threads must leave their loop
 * once they see *stop under mu. */
void qm_workers_stop(pthread_mutex_t *mu, pthread_cond_t *wake, int *stop, const pthread_t *threads,
                     size_t n);

#endif
