/* qm_shm.h - shared-memory maps of a session (qm_shm.c): session.map hands
 * the daemon a sealed memfd, session.infer's tensors and output_to name
 * regions of it (PROTOCOL.md "Shared-memory tensors").
 *
 * A map belongs to its session's set (qm_shm_set) and to every queued job
 * that reads or writes it (refs, atomic): session.unmap and session.close
 * take it off the list and stop counting its bytes at once, and the memory
 * is unmapped when the last job using it is done. The set is changed on
 * the loop thread and read there and by the session's call rings'
 * threads (qm_ring.h), under its lock. Workers only use the pointers a
 * job was given. */
#ifndef QM_SHM_H
#define QM_SHM_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "qm_error.h"
#include "qm_protocol.h"

/* At most this many maps per session (each is one mmap of the daemon's). */
#define QM_SHM_MAX_MAPS 256

typedef struct qm_shm_map {
    uint64_t id;    /* daemon-wide unique, so another session's id is never found */
    uint8_t *base;  /* MAP_SHARED, read-write */
    uint64_t bytes; /* what session.map asked for: regions lie inside [0, bytes) */
    atomic_int refs; /* the session's list + jobs (any thread) */
    struct qm_shm_map *next;
} qm_shm_map;

/* Checks that fd is a memfd sealed with F_SEAL_SHRINK and F_SEAL_SEAL, at
 * least `bytes` long and mappable read-write, and maps it. Closes fd in
 * every case. QM_EINVAL with field "fd" and a reason when it is not; *out
 * has one reference. */
int qm_shm_map_fd(int fd, uint64_t bytes, qm_shm_map **out, qm_status *st);
void qm_shm_ref(qm_shm_map *m);
void qm_shm_unref(qm_shm_map *m); /* accepts NULL; unmaps at the last reference */

/* A session's maps (embedded in the session; empty after init): add (counts
 * bytes against max_mapped_bytes and QM_SHM_MAX_MAPS,
 * QM_ERESOURCE_EXHAUSTED beyond; takes the caller's reference), find,
 * remove, release all (each map's memory goes with its last reference);
 * destroy after the last release. */
typedef struct qm_shm_set {
    pthread_mutex_t lock; /* the list and counts: loop thread and ring threads */
    qm_shm_map *head;
    uint32_t count;
    uint64_t bytes; /* counted against max_mapped_bytes */
} qm_shm_set;

void qm_shm_set_init(qm_shm_set *s);
void qm_shm_set_destroy(qm_shm_set *s);
int qm_shm_set_add(qm_shm_set *s, qm_shm_map *m, uint64_t max_bytes, qm_status *st);
int qm_shm_set_remove(qm_shm_set *s, uint64_t id, qm_status *st);
void qm_shm_set_release_all(qm_shm_set *s);

/* What one session.infer holds of its session's maps while it is queued. */
#define QM_SHM_JOB_MAPS 8
typedef struct qm_map_refs {
    qm_shm_map *maps[QM_SHM_JOB_MAPS];
    int n;
    uint8_t *output;     /* output_to's region, or NULL */
    int output_overlaps; /* it overlaps an input: compute aside, then copy */
} qm_map_refs;

/* Points every mapped tensor of p (hidden, router_logits, ...) into its map
 * in the session's set s and resolves output_to for an output of
 * out_bytes; i32 tensors are copied
 * (they are checked before the job runs, and the client can write the map).
 * QM_ENOT_FOUND naming "<tensor>.map" for a map the session does not hold,
 * QM_EINVAL naming "<tensor>.offset" for a region outside its map. On
 * failure every reference taken is released. Any thread (the set's lock). */
int qm_shm_resolve(qm_shm_set *s, qm_params *p, uint64_t out_bytes, qm_map_refs *refs,
                   qm_status *st);
void qm_map_refs_release(qm_map_refs *refs);

#endif
