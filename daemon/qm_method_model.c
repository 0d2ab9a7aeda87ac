/* qm_method_model.c - model.load, model.unload and model.list (PROTOCOL.md). */
#include "qm_methods.h"

#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_log.h"
#include "qm_models.h"

/* What an engine checks against its own model instead of reading the bank
 * file: where the bank came from (its qmoe.source, checked JSON at open;
 * absent for a bank without one), how its experts are quantised, whether
 * they carry biases, and the SwiGLU's constants (docs/PROTOCOL.md). */
static void write_bank_makeup(qm_jw *w, const qm_bank *bank)
{
    const qm_bank_config *c = qm_bank_get_config(bank);
    const qm_layer_view *lv = qm_bank_layer(bank, 0);
    const char *source = qm_bank_source_json(bank);
    if (source) {
        qm_jw_key(w, "source");
        qm_jw_raw(w, source, strlen(source));
    }
    qm_jw_key(w, "quantisation");
    qm_jw_obj_begin(w);
    qm_jw_member_u64(w, "bits", c->bits);
    qm_jw_member_u64(w, "block_size", c->block_size);
    qm_jw_member_str(w, "scale_dtype",
                     lv ? qm_dtype_name(lv->t[QM_T_FC1_SCALES].dtype) : NULL);
    qm_jw_key(w, "zero_points");
    qm_jw_bool(w, lv && lv->t[QM_T_FC1_ZERO_POINTS].present);
    if (c->codebook)
        qm_jw_member_str(w, "codebook", qm_codebook_name(c->codebook));
    qm_jw_obj_end(w);
    qm_jw_key(w, "biases");
    qm_jw_bool(w, lv && lv->t[QM_T_FC1_BIAS].present);
    if (c->activation != QM_ACT_SWIGLU)
        return;
    qm_jw_key(w, "swiglu");
    qm_jw_obj_begin(w);
    qm_jw_key(w, "alpha");
    qm_jw_f32(w, c->alpha);
    qm_jw_key(w, "beta");
    qm_jw_f32(w, c->beta);
    qm_jw_key(w, "limit"); /* null: no clamp */
    qm_jw_f32(w, c->limit);
    qm_jw_member_u64(w, "fusion", c->swiglu_fusion);
    qm_jw_obj_end(w);
}

/* The model summary (PROTOCOL.md): model.load's result and each of
 * model.list's. */
static void write_model_summary(qm_jw *w, const qm_model *m)
{
    const qm_bank_config *c = qm_bank_get_config(m->bank);
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "name", m->name);
    qm_jw_member_str(w, "path", m->path);
    qm_jw_member_u64(w, "layers", c->layers);
    qm_jw_member_u64(w, "experts", c->experts);
    qm_jw_member_u64(w, "hidden_size", c->hidden);
    qm_jw_member_u64(w, "inter_size", c->inter);
    qm_jw_member_u64(w, "k", c->k);
    qm_jw_member_str(w, "activation", qm_activation_name(c->activation));
    qm_jw_member_u64(w, "bits", c->bits);
    qm_jw_member_u64(w, "block_size", c->block_size);
    qm_jw_member_u64(w, "bytes_total", m->bytes_total);
    qm_jw_member_u64(w, "bytes_per_expert", m->bytes_per_expert);
    write_bank_makeup(w, m->bank);
    /* An imported bank's qmoe.layer_map: engines tag their MoE layers with
     * it (docs/ENGINES.md). Absent when the bank has none (identity). */
    const uint32_t *map = qm_bank_layer_map(m->bank);
    if (map) {
        qm_jw_key(w, "layer_map");
        qm_jw_arr_begin(w);
        for (uint32_t l = 0; l < c->layers; l++)
            qm_jw_u64(w, map[l]);
        qm_jw_arr_end(w);
    }
    qm_jw_obj_end(w);
}

static int model_load(qm_call *k, qm_status *st)
{
    const qm_method_ctx *mx = k->mx;
    const qm_params *p = &k->req->params;
    qm_model *m;
    uint64_t t0 = qm_now_us();
    char *resolved = NULL;
    int rc = qm_model_path_allowed(mx->models, p->path, &resolved, st);
    if (rc == 0)
        rc = qm_model_load(mx->models, p->name, resolved ? resolved : p->path, &m, st);
    qm_free(resolved);
    if (rc < 0)
        return rc;
    char args[160];
    snprintf(args, sizeof args, "{\"model\":\"%s\",\"layers\":%u}", m->name, m->n_layers);
    qm_trace_add(mx->trace, "model.load", t0, qm_now_us() - t0, NULL, args, NULL);
    qm_log(QM_LOG_INFO, "model %s loaded from %s (%u layers, %llu expert bytes)", m->name,
           m->path, m->n_layers, (unsigned long long)m->bytes_total);
    write_model_summary(k->w, m);
    return 0;
}

static int model_unload(qm_call *k, qm_status *st)
{
    int rc = qm_registry_unload_model(k->mx->registry, k->req->params.name,
                                      k->req->params.force, st);
    if (rc < 0)
        return rc;
    qm_jw_obj_begin(k->w);
    qm_jw_obj_end(k->w);
    return 0;
}

static int model_list(qm_call *k, qm_status *st)
{
    (void)st;
    qm_jw *w = k->w;
    qm_jw_obj_begin(w);
    qm_jw_key(w, "models");
    qm_jw_arr_begin(w);
    for (qm_model *m = k->mx->models->first; m; m = m->next)
        write_model_summary(w, m);
    qm_jw_arr_end(w);
    qm_jw_obj_end(w);
    return 0;
}

QM__METHOD_ROW(MODEL_LOAD, .handler = model_load, .role = QM_ROLE_ADMIN,
               .session = QM_SESSION_UNUSED, .queued = QM_QUEUE_NEVER);
QM__METHOD_ROW(MODEL_UNLOAD, .handler = model_unload, .role = QM_ROLE_ADMIN,
               .session = QM_SESSION_UNUSED, .queued = QM_QUEUE_NEVER);
QM__METHOD_ROW(MODEL_LIST, .handler = model_list, .role = QM_ROLE_USER,
               .session = QM_SESSION_UNUSED, .queued = QM_QUEUE_NEVER);
