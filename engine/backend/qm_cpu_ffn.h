/* qm_cpu_ffn.h - the CPU backend's expert FFNs (qm_cpu_ffn.c): a batch of
 * experts (fc1/fc3, activation, fc2 of each job's rows) as tasks on the
 * backend's thread pool. Private to engine/.
 *
 * Every output element is computed by one kernel call on one fixed 16-row
 * tile (QM__TILE_ROWS) in an order that depends only on the matrix geometry
 * and the job's row count, never on the thread count, the schedule or which
 * thread runs it: the two schedules below give the same bits.
 *
 *   fused (the default): one pool run per batch. Tasks, claimed in order:
 *     the input rows prepared (in fast mode each token quantised once, then
 *     copied to its routes), then every job's fc1/fc3 row blocks, then every
 *     job's fc2 row blocks. No barrier: a job's fc1 block waits for its rows
 *     to be prepared, the thread that finishes its last fc1 block runs its
 *     activation, and its fc2 blocks wait for that. Every wait is for a
 *     task claimed earlier, so some thread is running it.
 *   phased: four pool runs with a barrier after each (prepare, fc1/fc3,
 *     activation, fc2), each fc task one 16-row tile; the reference the
 *     fused schedule is tested against (QMOE_CPU_SCHEDULE=phased). */
#ifndef QM_CPU_FFN_H
#define QM_CPU_FFN_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>

#include "qm_backend.h"
#include "qm_kernels.h"
#include "qm_threadpool.h"

enum { QM__CPU_SCHEDULE_FUSED = 0, QM__CPU_SCHEDULE_PHASED = 1 };

/* What the expert FFNs run with; the backend owns it and runs one batch at
 * a time (its lock), so the scratch is shared by every batch. */
typedef struct qm__cpu_ffn {
    qm__pool *pool;    /* borrowed from the backend */
    unsigned threads;  /* the pool's threads */
    const qm__kernel *kernel;
    const qm__i8kernel *i8; /* fast mode */
    int schedule;           /* QM__CPU_SCHEDULE_* */
    /* Grow-only scratch (contents per batch). */
    float *scratch;
    size_t scratch_floats;
    void *scratch_raw;
    void *tasks;
    size_t tasks_cap;
    void *sync; /* per-job flags of the fused schedule */
    size_t sync_cap;
    void *left; /* per range of fc2 rows: jobs not done there (a combine) */
    size_t left_cap;
    /* Where the fused schedule's waiting tasks sleep (qm__cpu_ffn_init). */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint sleepers;
    int inited;
} qm__cpu_ffn;

/* Initialises f's wait state and zeroes the rest; the caller then sets
 * pool, threads, kernel, i8 and schedule. QM_ERESOURCE_EXHAUSTED when the
 * mutex or the condition variable cannot be made. */
int qm__cpu_ffn_init(qm__cpu_ffn *f);

/* The schedule QMOE_CPU_SCHEDULE asks for ("fused", "phased"; unset or
 * another value: fused). */
int qm__cpu_schedule_from_env(void);
/* Runs batch b (run_experts' contract, qm_backend.h). QM_EINVAL naming the
 * job for a malformed one, QM_ENOMEM for scratch. */
int qm__cpu_ffn_run(qm__cpu_ffn *f, const qm_expert_batch *b, qm_status *st);
/* Frees the scratch and the wait state (after a successful init). */
void qm__cpu_ffn_release(qm__cpu_ffn *f);

#endif
