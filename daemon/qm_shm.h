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
 * job was given.
 *
 * A map is held by the connection that last made or named it (session.map,
 * a socket call, a call through a ring that connection opened). When that
 * connection closes the map is orphaned, and the orphan reclaim
 * (qm_reclaim.h) unmaps it once it stayed so for session_orphan_timeout_s
 * while its session lived on: a client that died leaves nothing mapped in
 * a session other clients keep. A call naming it first holds it again;
 * while its session is itself orphaned the session's clock rules (its
 * maps' clocks start again when a client comes back to the session). */
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
    uint64_t holder;      /* the connection that last made or named it (set lock) */
    uint64_t orphaned_us; /* qm_now_us when its holder closed; 0: held (set lock) */
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
/* conn_id: the connection that made it (its holder). */
int qm_shm_set_add(qm_shm_set *s, qm_shm_map *m, uint64_t max_bytes, uint64_t conn_id,
                   qm_status *st);
int qm_shm_set_remove(qm_shm_set *s, uint64_t id, qm_status *st);
void qm_shm_set_release_all(qm_shm_set *s);

/* The orphan reclaim's side (loop thread). conn_closed: the maps conn_id
 * held are orphaned at now_us (the number newly orphaned). restart_clocks:
 * every orphaned map's clock starts again at now_us (its session came
 * back from being orphaned itself). next_due: the earliest moment an
 * orphaned map is due after limit_us, 0 for none. reclaim: unmaps (off the
 * list, as session.unmap) every map orphaned at least limit_us at now_us;
 * their number, their bytes added to *bytes. */
size_t qm_shm_set_conn_closed(qm_shm_set *s, uint64_t conn_id, uint64_t now_us);
void qm_shm_set_restart_clocks(qm_shm_set *s, uint64_t now_us);
uint64_t qm_shm_set_next_due(qm_shm_set *s, uint64_t limit_us);
size_t qm_shm_set_reclaim(qm_shm_set *s, uint64_t now_us, uint64_t limit_us, uint64_t *bytes);

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
 * out_bytes; every map named is held by conn_id from then on (the call's
 * connection: a ring's, for a ring call); i32 tensors are copied
 * (they are checked before the job runs, and the client can write the map).
 * QM_ENOT_FOUND naming "<tensor>.map" for a map the session does not hold,
 * QM_EINVAL naming "<tensor>.offset" for a region outside its map. On
 * failure every reference taken is released. Any thread (the set's lock). */
int qm_shm_resolve(qm_shm_set *s, qm_params *p, uint64_t out_bytes, uint64_t conn_id,
                   qm_map_refs *refs, qm_status *st);
void qm_map_refs_release(qm_map_refs *refs);

#endif
