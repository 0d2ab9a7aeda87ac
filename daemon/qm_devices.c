/* qm_devices.c - the daemon's devices: opened by kind through the backend
 * registry, named, budgeted. */
#include "qm_devices.h"

#include <stdio.h>
#include <string.h>

#include "qm_log.h"

/* Opens device `index` of kind k as ds->dev[ds->n] and counts it. */
static int open_device(qm_devices *ds, const qm_config *cfg, size_t k, uint32_t index,
                       qm_status *st)
{
    qm_device *dv = &ds->dev[ds->n];
    memset(dv, 0, sizeof *dv);
    const char *kind = qm_backend_kind_name(k);
    if (qm_backend_kind_caps(k) & QM_BACKEND_CAP_NUMBERED)
        snprintf(dv->name, sizeof dv->name, "%s:%u", kind, index);
    else
        snprintf(dv->name, sizeof dv->name, "%s", kind);
    qm_backend_open_options o = {.index = index,
                                 .threads = cfg->threads,
                                 .copy_gbps = cfg->emu_copy_mbps / 1000.0};
    int rc = qm_backend_kind_open(k, &o, &dv->backend, st);
    if (rc < 0)
        return rc;
    qm_backend_info(dv->backend, &dv->info);
    ds->n++;
    return 0;
}

/* Every listed device, or none (st then names the one that failed). */
static int open_list(qm_devices *ds, const qm_config *cfg, qm_status *st)
{
    int k = qm_backend_kind_find(cfg->device_kind, strlen(cfg->device_kind));
    if (k < 0)
        return qm_status_set_field(st, QM_EINVAL, "device", "no backend kind '%s'",
                                   cfg->device_kind);
    for (uint32_t i = 0; i < cfg->n_devices; i++) {
        int rc = open_device(ds, cfg, (size_t)k, cfg->device_index[i], st);
        if (rc < 0) {
            const char *name = ds->dev[ds->n].name;
            if (st && !strstr(st->msg, name)) {
                char msg[QM_STATUS_MSG_MAX];
                snprintf(msg, sizeof msg, "device %s: %.200s", name, st->msg);
                snprintf(st->msg, sizeof st->msg, "%s", msg);
            }
            qm_devices_close(ds);
            return rc;
        }
    }
    return 0;
}

/* --backend auto without a list: device 0 of the first kind auto tries
 * that answers. *tried names the kinds tried. */
static int open_auto(qm_devices *ds, const qm_config *cfg, char *tried, size_t cap,
                     qm_status *st)
{
    int rc = qm_status_set(st, QM_EUNSUPPORTED, "no backend kind is tried by auto");
    qm_backend_kind_names(QM_BACKEND_CAP_AUTO, ", ", " and ", tried, cap);
    for (size_t k = 0; k < qm_backend_kind_count(); k++) {
        if (!(qm_backend_kind_caps(k) & QM_BACKEND_CAP_AUTO))
            continue;
        uint32_t n;
        qm_status_clear(st);
        rc = qm_backend_kind_probe(k, &n, st);
        if (rc == 0)
            rc = open_device(ds, cfg, k, 0, st);
        if (rc == 0)
            return 0;
    }
    return rc;
}

static int host_kind(void)
{
    for (size_t k = 0; k < qm_backend_kind_count(); k++)
        if (qm_backend_kind_caps(k) & QM_BACKEND_CAP_HOST)
            return (int)k;
    return -1;
}

int qm_devices_open(qm_devices *ds, const qm_config *cfg, qm_status *st)
{
    memset(ds, 0, sizeof *ds);
    int is_auto = strcmp(cfg->backend, QM_CONFIG_BACKEND_AUTO) == 0;
    char tried[128] = "";
    int rc;
    if (cfg->n_devices) {
        rc = open_list(ds, cfg, st);
        snprintf(tried, sizeof tried, "%s", cfg->device_kind);
    } else if (is_auto) {
        rc = open_auto(ds, cfg, tried, sizeof tried, st);
    } else {
        int k = qm_backend_kind_find(cfg->backend, strlen(cfg->backend));
        rc = k < 0 ? qm_status_set_field(st, QM_EINVAL, "backend", "no backend kind '%s'",
                                         cfg->backend)
                   : open_device(ds, cfg, (size_t)k, 0, st);
    }
    int host = host_kind();
    if (is_auto && rc < 0)
        qm_log(QM_LOG_NOTICE, "backend auto: %s unavailable (%s); using %s", tried,
               st ? st->msg : "", host >= 0 ? qm_backend_kind_name((size_t)host) : "nothing");
    else if (is_auto)
        qm_log(QM_LOG_NOTICE, "backend auto: using %s", ds->dev[0].name);
    if (rc < 0 && !is_auto)
        return rc;
    if (rc < 0) {
        qm_status_clear(st);
        if (host < 0)
            return qm_status_set(st, QM_EUNSUPPORTED, "backend auto: no host backend to fall "
                                                      "back to");
        if ((rc = open_device(ds, cfg, (size_t)host, 0, st)) < 0)
            return rc;
    }
    for (uint32_t i = 0; i < ds->n; i++) {
        qm_device *dv = &ds->dev[i];
        dv->budget = cfg->n_device_budgets > 1    ? cfg->device_budgets[i]
                     : cfg->n_device_budgets == 1 ? cfg->device_budgets[0]
                                                  : dv->info.total_bytes;
        qm_log(QM_LOG_INFO, "backend %s, device %s: %s, %llu bytes, budget %llu",
               qm_backend_name(dv->backend), dv->name, dv->info.name,
               (unsigned long long)dv->info.total_bytes, (unsigned long long)dv->budget);
    }
    return 0;
}

void qm_devices_close(qm_devices *ds)
{
    for (uint32_t i = 0; i < ds->n; i++)
        qm_backend_free(ds->dev[i].backend);
    memset(ds, 0, sizeof *ds);
}

uint64_t qm_devices_budget(const qm_devices *ds)
{
    uint64_t sum = 0;
    for (uint32_t i = 0; i < ds->n; i++)
        sum += ds->dev[i].budget;
    return sum;
}

uint64_t qm_devices_admitted(const qm_devices *ds)
{
    uint64_t sum = 0;
    for (uint32_t i = 0; i < ds->n; i++)
        sum += ds->dev[i].admitted;
    return sum;
}

uint64_t qm_devices_total_bytes(const qm_devices *ds)
{
    uint64_t sum = 0;
    for (uint32_t i = 0; i < ds->n; i++)
        sum += ds->dev[i].info.total_bytes;
    return sum;
}

int qm_devices_host_visible(const qm_devices *ds)
{
    for (uint32_t i = 0; i < ds->n; i++)
        if (!qm_backend_host_visible(ds->dev[i].backend))
            return 0;
    return ds->n > 0;
}

void qm_devices_backends(const qm_devices *ds, qm_backend **out)
{
    for (uint32_t i = 0; i < ds->n; i++)
        out[i] = ds->dev[i].backend;
}
