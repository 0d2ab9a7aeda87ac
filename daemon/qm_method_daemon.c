/* qm_method_daemon.c - daemon.status and daemon.shutdown (PROTOCOL.md). */
#include "qm_methods.h"

#include "qm_families.h"
#include "qm_kernel_report.h"
#include "qm_sessions.h"

static int empty_result(qm_jw *w)
{
    qm_jw_obj_begin(w);
    qm_jw_obj_end(w);
    return 0;
}

/* The families whose banks the daemon serves (model/qm_families.h), and
 * each one's GGUF architecture (null: none): what an engine's adapter asks
 * instead of keeping a list of its own. */
static void write_families(qm_jw *w)
{
    qm_jw_key(w, "families");
    qm_jw_arr_begin(w);
    for (size_t i = 0; i < qm_n_families; i++) {
        const qm_family *f = &qm_families[i];
        qm_jw_obj_begin(w);
        qm_jw_member_str(w, "name", f->name);
        qm_jw_member_str(w, "gguf_arch", f->gguf_arch);
        qm_jw_key(w, "gguf_sigmoid");
        qm_jw_bool(w, f->gguf_sigmoid);
        qm_jw_obj_end(w);
    }
    qm_jw_arr_end(w);
}

static int daemon_status(qm_call *k, qm_status *st)
{
    (void)st;
    const qm_method_ctx *mx = k->mx;
    const qm_devices *ds = mx->devices;
    qm_jw *w = k->w;
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "version", QMOE_VERSION);
    qm_jw_member_u64(w, "uptime_s", (qm_now_us() - mx->start_us) / 1000000);
    /* "backend" and "device" are device 0's, the bytes summed over the devices. */
    qm_jw_member_str(w, "backend", qm_backend_name(ds->dev[0].backend));
    qm_jw_key(w, "device");
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "name", ds->dev[0].info.name);
    qm_jw_member_u64(w, "total_bytes", qm_devices_total_bytes(ds));
    qm_jw_member_u64(w, "budget_bytes", qm_devices_budget(ds));
    qm_jw_member_u64(w, "used_bytes", qm_devices_admitted(ds));
    qm_jw_obj_end(w);
    qm_jw_key(w, "devices");
    qm_jw_arr_begin(w);
    for (uint32_t i = 0; i < ds->n; i++) {
        const qm_device *dv = &ds->dev[i];
        qm_jw_obj_begin(w);
        qm_jw_member_str(w, "name", dv->name);
        qm_jw_member_str(w, "kind", dv->info.kind);
        qm_jw_member_str(w, "description", dv->info.name);
        qm_jw_member_u64(w, "total_bytes", dv->info.total_bytes);
        qm_jw_member_u64(w, "budget_bytes", dv->budget);
        qm_jw_member_u64(w, "used_bytes", dv->admitted);
        qm_jw_obj_end(w);
    }
    qm_jw_arr_end(w);
    qm_jw_key(w, "kernels");
    qm_kernel_report_json(w);
    write_families(w);
    qm_jw_member_u64(w, "models", mx->models->n);
    qm_jw_member_u64(w, "sessions", mx->sessions->n);
    qm_jw_member_u64(w, "connections", qm_server_connections(mx->server));
    qm_jw_key(w, "draining");
    qm_jw_bool(w, mx->draining(mx->life));
    qm_jw_obj_end(w);
    return 0;
}

static int daemon_shutdown(qm_call *k, qm_status *st)
{
    (void)st;
    k->drain = 1;
    return empty_result(k->w);
}

QM__METHOD_ROW(DAEMON_STATUS, .handler = daemon_status, .role = QM_ROLE_USER,
               .session = QM_SESSION_UNUSED, .queued = QM_QUEUE_NEVER);
QM__METHOD_ROW(DAEMON_SHUTDOWN, .handler = daemon_shutdown, .role = QM_ROLE_ADMIN,
               .session = QM_SESSION_UNUSED, .queued = QM_QUEUE_NEVER);
