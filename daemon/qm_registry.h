/* qm_registry.h - the daemon's models and sessions (qm_models.h,
 * qm_sessions.h), one registry per daemon. It borrows what admission and
 * bookkeeping read: the configuration (reloaded in place), the devices,
 * the limit counters and the trace ring, all the daemon's for as long as
 * the registry lives. Loop thread only, except where qm_sessions.h says a
 * worker may call. */
#ifndef QM_REGISTRY_H
#define QM_REGISTRY_H

#include <stddef.h>
#include <stdint.h>

#include "qm_config.h"
#include "qm_devices.h"
#include "qm_telemetry.h"

typedef struct qm_registry qm_registry;
typedef struct qm_model qm_model;     /* qm_models.h */
typedef struct qm_session qm_session; /* qm_sessions.h */

/* An empty registry; *out is the caller's (qm_registry_free). */
int qm_registry_new(const qm_config *cfg, qm_devices *devices, qm_limits *limits,
                    qm_trace *trace, qm_registry **out);
/* Closes every session, unloads every model and frees r (at exit; accepts
 * NULL). Jobs still holding sessions must be gone. */
void qm_registry_free(qm_registry *r);

size_t qm_registry_model_count(const qm_registry *r);
size_t qm_registry_session_count(const qm_registry *r);
/* The first model and session (borrowed; NULL when none); the next of
 * each is m->next and qm_session_next(s). Newest first. */
qm_model *qm_registry_first_model(const qm_registry *r);
qm_session *qm_registry_first_session(const qm_registry *r);
/* A daemon-wide unique id for a session's shared-memory map (qm_shm.h). */
uint64_t qm_registry_new_map_id(qm_registry *r);
/* The devices sessions are admitted to, borrowed from the daemon. */
const qm_devices *qm_registry_devices(const qm_registry *r);
/* cb(arg, s) on the loop thread as each session closes, however it closes
 * (session.close, model.unload with force, the orphan reclaim, the
 * registry's end), after it left the registry and while it still lives:
 * the daemon ends the session's call rings there (qm_ring.h). */
void qm_registry_on_session_close(qm_registry *r, void (*cb)(void *arg, qm_session *s),
                                  void *arg);

#endif
