/* qm_registry_impl.h - the registry's own state, shared by its two files
 * (qm_models.c, qm_sessions.c). Private to them. */
#ifndef QM_REGISTRY_IMPL_H
#define QM_REGISTRY_IMPL_H

#include "qm_models.h"
#include "qm_registry.h"
#include "qm_sessions.h"

struct qm_registry {
    const qm_config *cfg; /* borrowed: the daemon's, reloaded in place */
    qm_devices *devices;  /* borrowed */
    qm_limits *limits;    /* borrowed */
    qm_trace *trace;      /* borrowed */
    qm_model *models;     /* newest first */
    size_t n_models;
    qm_session *sessions; /* newest first */
    size_t n_sessions;
    uint64_t next_map_id;
    struct qm_share *shares; /* shared-residency pools (qm_share.h) */
    void (*on_close)(void *arg, qm_session *s); /* qm_registry_on_session_close */
    void *on_close_arg;
};

/* Closes every session of model m (qm_model_unload with force). */
void qm__sessions_close_model(qm_registry *r, const qm_model *m);
/* Sessions of model m. */
size_t qm__sessions_of_model(const qm_registry *r, const qm_model *m);

#endif
