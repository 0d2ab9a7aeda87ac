/* qm_registry.h - the daemon's models and sessions (qm_registry.c), one
 * registry per daemon: its two lists (qm_models.h, qm_sessions.h) and what
 * crosses them (a model unloaded with its sessions, everything at exit).
 * It borrows what admission and bookkeeping read: the configuration
 * (reloaded in place), the devices, the limit counters and the trace ring,
 * all the daemon's for as long as the registry lives. Loop thread only. */
#ifndef QM_REGISTRY_H
#define QM_REGISTRY_H

#include "qm_config.h"
#include "qm_devices.h"
#include "qm_models.h"
#include "qm_sessions.h"
#include "qm_telemetry.h"

typedef struct qm_registry qm_registry;

/* An empty registry; *out is the caller's (qm_registry_free). */
int qm_registry_new(const qm_config *cfg, qm_devices *devices, qm_limits *limits,
                    qm_trace *trace, qm_registry **out);
/* Closes every session, unloads every model and frees r (at exit; accepts
 * NULL). Jobs still holding sessions must be gone. */
void qm_registry_free(qm_registry *r);

/* Its lists, borrowed for as long as r lives. */
qm_models *qm_registry_models(qm_registry *r);
qm_sessions *qm_registry_sessions(qm_registry *r);

/* model.unload: unregisters model `name`; with force closes its sessions
 * first, else QM_EIN_USE while it has any (field name). */
int qm_registry_unload_model(qm_registry *r, const char *name, int force, qm_status *st);

#endif
