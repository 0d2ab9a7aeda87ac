/* qm_infer.c - session.infer on a worker thread: the layer through the
 * session's pager, and the response encoded there too, so the loop thread
 * only queues bytes. The job owns everything it touches except the session,
 * which its FIFO gives it alone while it runs. */
#include "qm_pool.h"

#include <string.h>

#include "qm_alloc.h"
#include "qm_daemon.h"
#include "qm_dispatch.h"
#include "qm_models.h"
#include "qm_sessions.h"
#include "qm_plan_json.h"

static qm_dtype dtype_of(qm_wire_dtype t)
{
    return t == QM_WIRE_F16 ? QM_DTYPE_F16 : t == QM_WIRE_BF16 ? QM_DTYPE_BF16 : QM_DTYPE_F32;
}

/* Router logits and topk weights arrive in any float wire dtype; the engine
 * wants f32 (every f16/bf16 value is exact in f32). */
static float *logits_f32(const qm_tensor *t)
{
    size_t n = (size_t)(t->shape[0] * t->shape[1]);
    float *out = qm_malloc(n ? n * sizeof(float) : 1);
    if (!out)
        return NULL;
    const uint16_t *h = t->data;
    for (size_t i = 0; i < n; i++) {
        if (t->dtype == QM_WIRE_F32)
            memcpy(&out[i], (const char *)t->data + 4 * i, 4);
        else if (t->dtype == QM_WIRE_F16)
            out[i] = qm_f16_to_f32(h[i]);
        else
            out[i] = qm_bf16_to_f32(h[i]);
    }
    return out;
}

/* A job whose session was closed while it queued fails with QM_ENOT_FOUND; returns 1 then. */
static int job_session_closed(qm_job *job)
{
    if (!atomic_load(&job->session->closed))
        return 0;
    job->rc = qm_status_set_field(&job->st, QM_ENOT_FOUND, "session",
                                  "the session was closed before this request ran");
    return 1;
}

void qm_job_run(qm_job *job)
{
    qm_session *s = job->session;
    qm_params *p = &job->req.params;
    if (job_session_closed(job))
        return;
    /* Nobody will read the answer: a client that pipelined many inferences
     * and went away must not keep the session's worker busy for them. */
    if (job->reply && qm_reply_abandoned(job->reply)) {
        job->cancelled = 1;
        job->rc = qm_status_set(&job->st, QM_EIO,
                                "the client disconnected before this request ran");
        return;
    }
    const qm_bank_config *cfg = qm_bank_get_config(s->model->bank);
    uint32_t T = (uint32_t)p->hidden.shape[0], H = cfg->hidden;
    uint32_t k = p->has_topk ? (uint32_t)p->topk_ids.shape[1] : cfg->k;
    size_t out_bytes = (size_t)T * H * qm_wire_dtype_size(p->hidden.dtype);
    /* output_to: straight into the client's map, unless the region overlaps
     * an input the layer is still reading (then aside, and copied). */
    int direct = job->maps.output && !job->maps.output_overlaps;
    void *output = direct ? job->maps.output : qm_malloc(out_bytes ? out_bytes : 1);
    float *logits = p->has_router_logits ? logits_f32(&p->router_logits) : NULL;
    float *topk_w = p->has_topk ? logits_f32(&p->topk_weights) : NULL;
    /* Routes are always kept: the loop feeds them to the model's hotness
     * profile when the job is done. */
    uint32_t *rexp = qm_malloc((size_t)T * k * sizeof *rexp + 4);
    float *rw = qm_malloc((size_t)T * k * sizeof *rw + 4);
    job->route_experts = rexp;
    job->n_routes = (size_t)T * k;
    if (!output || (p->has_router_logits && !logits) || (p->has_topk && !topk_w) || !rexp ||
        !rw) {
        job->rc = qm_status_set(&job->st, QM_ENOMEM, "out of memory for %u tokens", T);
        goto free_buffers;
    }
    qm_pager_stats before;
    qm_session_stats(s, &before);
    qm_moe_call call = {.layer = p->layer,
                        .dtype = dtype_of(p->hidden.dtype),
                        .hidden = p->hidden.data,
                        .n_tokens = T,
                        .logits = logits,
                        .output = output,
                        .route_experts = rexp,
                        .route_weights = rw,
                        .topk_ids = p->has_topk ? p->topk_ids.data : NULL,
                        .topk_weights = topk_w,
                        .topk_k = k,
                        .precision = s->precision_fast ? QM_PRECISION_FAST : QM_PRECISION_EXACT};
    /* A bank file truncated on disk fails the request before it reads the
     * mapping, and after it when the truncation raced it (qm_sigbus.c). */
    job->rc = qm_model_check(s->model, &job->st);
    if (job->rc == 0)
        job->rc = qm_session_forward(s, &call, &job->mstats, &job->st);
    if (job->rc == 0)
        job->rc = qm_model_check(s->model, &job->st);
    qm_session_stats(s, &job->pstats);
    job->tokens = T;
    if (job->rc == 0 && job->maps.output && !direct)
        memcpy(job->maps.output, output, out_bytes);
    if (job->rc < 0 || !job->req.id)
        goto free_buffers;
    uint64_t now = qm_now_us();
    qm_jw w;
    qm_jw_init(&w, &job->response);
    qm_rpc_result_begin(&w, job->req.id);
    qm_jw_obj_begin(&w);
    uint64_t enc0 = qm_now_us();
    qm_jw_key(&w, "output");
    if (job->maps.output)
        qm_jw_mapped_tensor(&w, p->hidden.dtype, 2, p->hidden.shape, p->output_map,
                            p->output_offset);
    else
        qm_jw_tensor(&w, p->hidden.dtype, 2, p->hidden.shape, output);
    if (p->return_routing) {
        qm_jw_key(&w, "routing");
        qm_jw_arr_begin(&w);
        for (uint32_t t = 0; t < T; t++) {
            qm_jw_arr_begin(&w);
            for (uint32_t j = 0; j < k; j++) {
                if (rexp[(size_t)t * k + j] == QM_ROUTE_DROPPED)
                    continue;
                qm_jw_arr_begin(&w);
                qm_jw_u64(&w, rexp[(size_t)t * k + j]);
                qm_jw_f32(&w, rw[(size_t)t * k + j]);
                qm_jw_arr_end(&w);
            }
            qm_jw_arr_end(&w);
        }
        qm_jw_arr_end(&w);
    }
    uint64_t encode_us = qm_now_us() - enc0;
    qm_jw_key(&w, "stats");
    qm_jw_obj_begin(&w);
    qm_jw_key(&w, "hits");
    qm_jw_u64(&w, job->pstats.hits - before.hits + (job->pstats.whole_bank_accesses -
                                                    before.whole_bank_accesses));
    qm_jw_member_u64(&w, "misses", job->pstats.misses - before.misses);
    qm_jw_member_u64(&w, "host_runs", job->pstats.host_runs - before.host_runs);
    qm_jw_member_u64(&w, "bytes_paged", job->pstats.bytes_paged_h2d - before.bytes_paged_h2d);
    qm_jw_member_u64(&w, "bytes_read_disk",
                     job->pstats.disk_bytes_read - before.disk_bytes_read);
    qm_jw_member_u64(&w, "stall_us", job->pstats.stall_us - before.stall_us);
    qm_jw_member_u64(&w, "queue_us", job->start_us - job->enqueue_us);
    qm_jw_member_u64(&w, "compute_us", job->mstats.compute_us);
    qm_jw_member_u64(&w, "decode_us", job->decode_us);
    qm_jw_member_u64(&w, "encode_us", encode_us);
    qm_jw_member_u64(&w, "wall_us", now - job->start_us);
    qm_jw_obj_end(&w);
    qm_jw_obj_end(&w);
    qm_rpc_result_end(&w);
    if (job->response.oom)
        job->rc = qm_status_set(&job->st, QM_ENOMEM, "out of memory encoding the output");
free_buffers:
    if (!direct)
        qm_free(output);
    qm_free(logits);
    qm_free(topk_w);
    qm_free(rw);
}


/* Whole-bank banks get no resident_now: they are resident for the session's
 * life, which the plan's decision already says (docs/PROTOCOL.md). */
int qm_session_plan_json(qm_session *s, char **json, size_t *len, qm_status *st)
{
    size_t n = qm_plan_total(s->plan);
    qm_plan_json_bank_state *banks = qm_calloc(n ? n : 1, sizeof *banks);
    uint32_t **lists = qm_calloc(n ? n : 1, sizeof *lists);
    int rc = 0;
    if (!banks || !lists) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory reading the residency");
        goto free_lists;
    }
    qm_plan_json_state state = {.banks = banks, .n_banks = 0};
    /* The placement is shown when the session spans several devices. */
    const qm_placement *pl = &s->placement;
    const int placed = pl->n_devices > 1;
    for (size_t i = 0; i < n && s->pagers; i++) {
        uint32_t layer = qm_plan_bank_at(s->plan, i)->bank_id; /* bank id = layer */
        qm_pager *pager = qm_session_pager_of(s, layer);
        qm_plan_json_bank_state *b = &banks[state.n_banks];
        *b = (qm_plan_json_bank_state){.bank_id = layer};
        if (placed && layer < pl->n_layers) {
            b->has_device = 1; /* every bank names its device, whole or paged */
            b->device = pl->device_of[layer];
        }
        int count = pager && qm_pager_layer_is_paged(pager, layer) == 1
                        ? qm_pager_resident_experts(pager, layer, NULL, 0)
                        : -1;
        if (b->has_device || count >= 0)
            state.n_banks++;
        if (count < 0)
            continue;
        lists[i] = qm_malloc(((size_t)count + 1) * sizeof **lists);
        if (!lists[i]) {
            rc = qm_status_set(st, QM_ENOMEM, "out of memory reading the residency");
            goto free_lists;
        }
        size_t cap = (size_t)count;
        count = qm_pager_resident_experts(pager, layer, lists[i], cap);
        b->has_resident_now = 1;
        b->resident_now = lists[i];
        b->n_resident_now = count < 0 ? 0 : (size_t)count < cap ? (size_t)count : cap;
        /* Pins a resize released: after the resident list, in the same buffer. */
        int nrel = qm_pager_pins_released(pager, layer, NULL, 0);
        if (nrel > 0) {
            uint32_t *grown = qm_realloc(lists[i], (b->n_resident_now + (size_t)nrel) *
                                                        sizeof **lists);
            if (!grown) {
                rc = qm_status_set(st, QM_ENOMEM, "out of memory reading the residency");
                goto free_lists;
            }
            lists[i] = grown;
            b->resident_now = grown;
            b->pins_released = grown + b->n_resident_now;
            nrel = qm_pager_pins_released(pager, layer, grown + b->n_resident_now,
                                          (size_t)nrel);
            b->n_pins_released = nrel < 0 ? 0 : (size_t)nrel;
        }
    }
    const char *names[QM_CONFIG_MAX_DEVICES];
    if (placed) {
        for (uint32_t i = 0; i < pl->n_devices && i < QM_CONFIG_MAX_DEVICES; i++)
            names[i] = s->device_names[i];
        state.placement_rule = QM_PLACEMENT_RULE;
        state.device_names = names;
        state.device_budgets = pl->budget;
        state.n_devices = pl->n_devices;
    }
    if (s->pagers) {
        qm_pager_stats ps;
        qm_session_stats(s, &ps);
        state.has_resident_bytes = 1;
        state.resident_bytes = ps.resident_bytes;
        state.on_miss = qm_on_miss_name(s->pager_options.on_miss);
        state.expert_hits = ps.hits + ps.whole_bank_accesses;
        state.expert_misses = ps.misses;
        state.expert_host_runs = ps.host_runs;
    }
    rc = qm_plan_to_json_ex(s->plan, &state, json, len, st);
free_lists:
    for (size_t i = 0; lists && i < n; i++)
        qm_free(lists[i]);
    qm_free(lists);
    qm_free(banks);
    return rc;
}

void qm_job_run_plan(qm_job *job)
{
    qm_session *s = job->session;
    if (job_session_closed(job))
        return;
    if (!job->req.id)
        return; /* a notification: nothing to answer */
    char *json;
    size_t len;
    job->rc = qm_session_plan_json(s, &json, &len, &job->st);
    if (job->rc < 0)
        return;
    qm_jw w;
    qm_jw_init(&w, &job->response);
    qm_rpc_result_begin(&w, job->req.id);
    qm_jw_raw(&w, json, len);
    qm_rpc_result_end(&w);
    qm_free(json);
    if (job->response.oom)
        job->rc = qm_status_set(&job->st, QM_ENOMEM, "out of memory encoding the plan");
}

void qm_job_run_resize(qm_job *job)
{
    qm_session *s = job->session;
    if (job_session_closed(job))
        return;
    /* Every earlier job of the session has finished (its FIFO): they ran
     * under the old budget, every later one runs under the new. */
    uint64_t budget = job->req.params.budget_bytes;
    job->rc = qm_session_resize(s, budget, &job->st);
    if (job->rc == 0)
        qm_plan_set_budget(s->plan, budget);
    qm_session_stats(s, &job->pstats);
}
