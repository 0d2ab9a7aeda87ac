/* qm_registry.c - the registry (qm_registry.h): the models and the
 * sessions, and what crosses the two lists. It stands above both: neither
 * list knows the registry. */
#include "qm_registry.h"

#include "qm_alloc.h"
#include "qm_log.h"

struct qm_registry {
    qm_models models;
    qm_sessions sessions;
};

int qm_registry_new(const qm_config *cfg, qm_devices *devices, qm_limits *limits,
                    qm_trace *trace, qm_registry **out)
{
    qm_registry *r = qm_calloc(1, sizeof *r);
    *out = r;
    if (!r)
        return QM_ENOMEM;
    r->models = (qm_models){.cfg = cfg, .devices = devices};
    r->sessions = (qm_sessions){.cfg = cfg, .devices = devices, .limits = limits, .trace = trace};
    return 0;
}

void qm_registry_free(qm_registry *r)
{
    if (!r)
        return;
    qm_sessions_close_model(&r->sessions, NULL);
    qm_sessions_free_owners(&r->sessions);
    qm_models_free(&r->models);
    qm_free(r);
}

qm_models *qm_registry_models(qm_registry *r) { return &r->models; }
qm_sessions *qm_registry_sessions(qm_registry *r) { return &r->sessions; }

int qm_registry_unload_model(qm_registry *r, const char *name, int force, qm_status *st)
{
    qm_model *m = qm_model_find(&r->models, name);
    if (!m)
        return qm_status_set_field(st, QM_ENOT_FOUND, "name", "no model named '%s' is loaded",
                                   name);
    size_t users = qm_sessions_of_model(&r->sessions, m);
    if (users && !force)
        return qm_status_set_field(st, QM_EIN_USE, "name",
                                   "model '%s' has %zu open sessions; close them or pass force",
                                   name, users);
    qm_sessions_close_model(&r->sessions, m);
    qm_log(QM_LOG_INFO, "model %s unloaded%s", name, users ? " (sessions closed)" : "");
    qm_model_unlink(&r->models, m);
    return 0;
}
