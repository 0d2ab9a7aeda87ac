/* qm_sync.c - see qm_sync.h. */
#include "qm_sync.h"

int qm_lock2_init(pthread_mutex_t *mu, pthread_cond_t *cv_a, pthread_cond_t *cv_b)
{
    if (pthread_mutex_init(mu, NULL)) return -1;
    if (pthread_cond_init(cv_a, NULL)) goto fail_a;
    if (pthread_cond_init(cv_b, NULL)) goto fail_b;
    return 0;
fail_b:
    pthread_cond_destroy(cv_a);
fail_a:
    pthread_mutex_destroy(mu);
    return -1;
}

void qm_lock2_destroy(pthread_mutex_t *mu, pthread_cond_t *cv_a, pthread_cond_t *cv_b)
{
    pthread_cond_destroy(cv_b);
    pthread_cond_destroy(cv_a);
    pthread_mutex_destroy(mu);
}

void qm_workers_stop(pthread_mutex_t *mu, pthread_cond_t *wake, int *stop, const pthread_t *threads,
                     size_t n)
{
    pthread_mutex_lock(mu);
    *stop = 1;
    pthread_cond_broadcast(wake);
    pthread_mutex_unlock(mu);
    for (size_t i = 0; i < n; i++)
        pthread_join(threads[i], NULL);
}
