/* The CPU backend's thread pool (engine/backend/qm_threadpool.c): every
 * task runs once and before its run returns (small runs too, which a late
 * worker no longer holds up), and steering keeps the workers off the caller's CPU
 * (on when every thread can have a CPU, off when asked or when the CPUs
 * are too few). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getcpu, CPU_* and pthread affinity */
#endif
#include <check.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "qm_threadpool.h"

enum { TASKS = 64, MAX_THREADS = 8 };

typedef struct run_log {
    atomic_int runs[TASKS];
    atomic_int by_worker[MAX_THREADS]; /* tasks each thread ran */
    cpu_set_t worker_mask;             /* a worker's affinity, seen inside a task */
    atomic_int worker_mask_seen;
    unsigned sleep_us;
} run_log;

static void record(void *arg, size_t i, unsigned worker)
{
    run_log *log = arg;
    atomic_fetch_add(&log->runs[i], 1);
    ck_assert_uint_lt(worker, MAX_THREADS);
    atomic_fetch_add(&log->by_worker[worker], 1);
    if (worker > 0 && !atomic_load(&log->worker_mask_seen)) {
        cpu_set_t m;
        ck_assert_int_eq(pthread_getaffinity_np(pthread_self(), sizeof m, &m), 0);
        log->worker_mask = m;
        atomic_store(&log->worker_mask_seen, 1);
    }
    if (log->sleep_us)
        usleep(log->sleep_us);
}

static void check_each_ran_once(const run_log *log)
{
    for (size_t i = 0; i < TASKS; i++)
        ck_assert_int_eq(atomic_load(&log->runs[i]), 1);
}

static int allowed_cpus(cpu_set_t *m)
{
    ck_assert_int_eq(sched_getaffinity(0, sizeof *m, m), 0);
    return CPU_COUNT(m);
}

START_TEST(test_every_task_runs_once_on_a_thread_of_the_pool)
{
    qm__pool *p;
    ck_assert_int_eq(qm__pool_new(3, &p), 0);
    ck_assert_uint_eq(qm__pool_threads(p), 3);
    for (int round = 0; round < 50; round++) {
        run_log log = {0};
        qm__pool_run(p, TASKS, record, &log);
        check_each_ran_once(&log);
        for (int w = 3; w < MAX_THREADS; w++)
            ck_assert_int_eq(atomic_load(&log.by_worker[w]), 0);
    }
    qm__pool_free(p);
}
END_TEST

START_TEST(test_run_here_runs_every_task_on_the_caller)
{
    qm__pool *p;
    ck_assert_int_eq(qm__pool_new(2, &p), 0);
    run_log log = {0};
    qm__pool_run_here(p, TASKS, record, &log);
    check_each_ran_once(&log);
    ck_assert_int_eq(atomic_load(&log.by_worker[0]), TASKS);
    ck_assert_int_eq(atomic_load(&log.worker_mask_seen), 0);
    qm__pool_free(p);
}
END_TEST

/* A run of a few tiny tasks: most end before the worker wakes, which then
 * finds the run closed (qm_threadpool.c, "Joining late"). Whoever runs a
 * task, it runs once and before its run returns. */
typedef struct small_run {
    atomic_int ran[4];
    atomic_int returned;
} small_run;

static void small_task(void *arg, size_t i, unsigned worker)
{
    small_run *r = arg;
    (void)worker;
    ck_assert_msg(!atomic_load(&r->returned), "a task ran after its run returned");
    atomic_fetch_add(&r->ran[i], 1);
}

START_TEST(test_small_runs_run_each_task_once_before_they_return)
{
    qm__pool *p;
    ck_assert_int_eq(qm__pool_new(2, &p), 0);
    small_run *runs = calloc(20000, sizeof *runs);
    ck_assert_ptr_nonnull(runs);
    for (int r = 0; r < 20000; r++) {
        size_t n = 2 + (size_t)(r % 3);
        qm__pool_run(p, n, small_task, &runs[r]);
        atomic_store(&runs[r].returned, 1);
        for (size_t i = 0; i < n; i++) {
            int v = atomic_load(&runs[r].ran[i]);
            ck_assert_msg(v == 1, "run %d: task %zu ran %d times by the time the run returned", r, i, v);
        }
        if (r % 1000 == 999)
            usleep(2000); /* the worker asleep again: it wakes late */
    }
    qm__pool_free(p); /* joins the worker: a late task would have asserted */
    for (int r = 0; r < 20000; r++)
        for (size_t i = 0; i < 2 + (size_t)(r % 3); i++) {
            int v = atomic_load(&runs[r].ran[i]);
            ck_assert_msg(v == 1, "run %d: task %zu ran %d times in all", r, i, v);
        }
    free(runs);
}
END_TEST

START_TEST(test_workers_are_kept_off_the_callers_cpu)
{
    cpu_set_t all;
    if (allowed_cpus(&all) < 2) {
        printf("SKIP test_workers_are_kept_off_the_callers_cpu: this process may use one CPU\n");
        return;
    }
    unsetenv("QMOE_CPU_STEER");
    qm__pool *p;
    ck_assert_int_eq(qm__pool_new(2, &p), 0);
    ck_assert_int_eq(qm__pool_steered_cpu(p), -1); /* no run yet */
    /* Tasks long enough that the worker joins the run: its affinity is
     * read inside one of them. */
    int seen = 0;
    for (int round = 0; round < 20 && !seen; round++) {
        run_log log = {.sleep_us = 200};
        qm__pool_run(p, TASKS, record, &log);
        check_each_ran_once(&log);
        int steered = qm__pool_steered_cpu(p);
        ck_assert_int_ge(steered, 0);
        ck_assert(CPU_ISSET(steered, &all));
        if (!atomic_load(&log.worker_mask_seen))
            continue;
        seen = 1;
        ck_assert_msg(!CPU_ISSET(steered, &log.worker_mask),
                      "the worker may still run on the caller's CPU %d", steered);
        /* Every other CPU of the pool's, nothing outside them. */
        cpu_set_t want = all;
        CPU_CLR(steered, &want);
        ck_assert(CPU_EQUAL(&want, &log.worker_mask));
    }
    ck_assert_msg(seen, "the worker ran no task in 20 runs of 64 x 200 us");
    qm__pool_free(p);
}
END_TEST

START_TEST(test_no_steering_when_asked)
{
    cpu_set_t all;
    allowed_cpus(&all);
    setenv("QMOE_CPU_STEER", "0", 1);
    qm__pool *p;
    ck_assert_int_eq(qm__pool_new(2, &p), 0);
    unsetenv("QMOE_CPU_STEER");
    int seen = 0;
    for (int round = 0; round < 20 && !seen; round++) {
        run_log log = {.sleep_us = 200};
        qm__pool_run(p, TASKS, record, &log);
        check_each_ran_once(&log);
        ck_assert_int_eq(qm__pool_steered_cpu(p), -1);
        if ((seen = atomic_load(&log.worker_mask_seen)))
            ck_assert(CPU_EQUAL(&all, &log.worker_mask));
    }
    ck_assert_msg(seen, "the worker ran no task in 20 runs of 64 x 200 us");
    qm__pool_free(p);
}
END_TEST

START_TEST(test_no_steering_with_more_threads_than_cpus)
{
    cpu_set_t all, one;
    allowed_cpus(&all);
    int here = sched_getcpu();
    ck_assert_int_ge(here, 0);
    CPU_ZERO(&one);
    CPU_SET(here, &one);
    /* The pool's CPUs are its creator's: one CPU for two threads. */
    ck_assert_int_eq(sched_setaffinity(0, sizeof one, &one), 0);
    unsetenv("QMOE_CPU_STEER");
    qm__pool *p;
    ck_assert_int_eq(qm__pool_new(2, &p), 0);
    for (int round = 0; round < 5; round++) {
        run_log log = {0};
        qm__pool_run(p, TASKS, record, &log);
        check_each_ran_once(&log);
        ck_assert_int_eq(qm__pool_steered_cpu(p), -1);
    }
    qm__pool_free(p);
    ck_assert_int_eq(sched_setaffinity(0, sizeof all, &all), 0);
}
END_TEST

static Suite *threadpool_suite(void)
{
    Suite *s = suite_create("threadpool");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_every_task_runs_once_on_a_thread_of_the_pool);
    tcase_add_test(tc, test_small_runs_run_each_task_once_before_they_return);
    tcase_add_test(tc, test_run_here_runs_every_task_on_the_caller);
    tcase_add_test(tc, test_workers_are_kept_off_the_callers_cpu);
    tcase_add_test(tc, test_no_steering_when_asked);
    tcase_add_test(tc, test_no_steering_with_more_threads_than_cpus);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(threadpool_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
