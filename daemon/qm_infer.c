/* qm_infer.c - session.infer: admitted on the loop thread (mapped tensors
 * resolved, shapes against the model), run on a worker (the layer through
 * the session's pagers, and the response encoded there too, so the loop
 * thread only queues bytes), finished on the loop (counters, hotness,
 * trace span, the answer). The job owns everything it touches except the
 * session, which its FIFO gives it alone while it runs. */
#include "qm_methods.h"

#include <string.h>

#include "qm_alloc.h"
#include "qm_models.h"
#include "qm_sessions.h"

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

/* The checks that need the model, before queueing. */
static int check_infer(const qm_session *s, const qm_params *p, qm_status *st)
{
    const qm_model *m = qm_session_model(s);
    const qm_bank_config *cfg = qm_bank_get_config(m->bank);
    if (p->layer >= cfg->layers)
        return qm_status_set_field(st, QM_EINVAL, "layer",
                                   "layer %u is out of range; the model has %u layers", p->layer,
                                   cfg->layers);
    if (p->hidden.shape[1] != cfg->hidden)
        return qm_status_set_field(st, QM_EINVAL, "hidden.shape",
                                   "hidden.shape is [%llu, %llu]; expected [T, %u]",
                                   (unsigned long long)p->hidden.shape[0],
                                   (unsigned long long)p->hidden.shape[1], cfg->hidden);
    if (p->hidden.shape[0] > UINT32_MAX)
        return qm_status_set_field(st, QM_EINVAL, "hidden.shape", "too many tokens");
    if (p->has_topk) {
        /* Routing supplied by the engine: checked here so a bad id is the
         * request's -32602, not a worker's failure. */
        if (p->topk_ids.shape[1] > cfg->experts)
            return qm_status_set_field(st, QM_EINVAL, "topk_ids",
                                       "topk_ids has %llu columns but the model has %u experts",
                                       (unsigned long long)p->topk_ids.shape[1], cfg->experts);
        return qm_moe_topk_check(p->topk_ids.data, (uint32_t)p->hidden.shape[0], cfg->experts,
                                 (uint32_t)p->topk_ids.shape[1], st);
    }
    if (p->has_router_logits) {
        if (p->router_logits.shape[1] != cfg->experts)
            return qm_status_set_field(st, QM_EINVAL, "router_logits.shape",
                                       "router_logits.shape is [%llu, %llu]; expected [%llu, %u]",
                                       (unsigned long long)p->router_logits.shape[0],
                                       (unsigned long long)p->router_logits.shape[1],
                                       (unsigned long long)p->hidden.shape[0], cfg->experts);
    } else {
        const qm_layer_view *lv = qm_bank_layer(m->bank, p->layer);
        if (!lv || !lv->t[QM_T_ROUTER_WEIGHT].present)
            return qm_status_set_field(st, QM_EINVAL, "router_logits",
                                       "router_logits is required: layer %u of the bank holds "
                                       "no router weight",
                                       p->layer);
    }
    return 0;
}

/* Mapped tensors point into the session's maps, which the job holds until
 * it is done (PROTOCOL.md "Shared-memory tensors"). */
static int infer_admit(qm_job *job, qm_status *st)
{
    qm_params *p = &job->req.params;
    int rc = qm_shm_resolve(qm_session_maps(job->session), p, p->hidden.nbytes, &job->maps, st);
    return rc < 0 ? rc : check_infer(job->session, p, st);
}

static void infer_run(qm_job *job)
{
    qm_session *s = job->session;
    qm_params *p = &job->req.params;
    if (qm__job_session_closed(job))
        return;
    /* Nobody will read the answer: a client that pipelined many inferences
     * and went away must not keep the session's worker busy for them. */
    if (job->reply && qm_reply_abandoned(job->reply)) {
        job->cancelled = 1;
        job->rc = qm_status_set(&job->st, QM_EIO,
                                "the client disconnected before this request ran");
        return;
    }
    const qm_model *model = qm_session_model(s);
    const qm_bank_config *cfg = qm_bank_get_config(model->bank);
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
                        .precision = qm_session_precision(s)};
    /* A bank file truncated on disk fails the request before it reads the
     * mapping, and after it when the truncation raced it (qm_sigbus.c). */
    job->rc = qm_model_check(model, &job->st);
    if (job->rc == 0)
        job->rc = qm_session_forward(s, &call, &job->mstats, &job->st);
    if (job->rc == 0)
        job->rc = qm_model_check(model, &job->st);
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
    /* Direct disk paging: the most reads in flight at once during this
     * request, and the time the disk had any. */
    qm_jw_member_u64(&w, "reads_in_flight",
                     job->pstats.reads_in_flight_sum - before.reads_in_flight_sum);
    qm_jw_member_u64(&w, "disk_busy_us", job->pstats.disk_busy_us - before.disk_busy_us);
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

/* The counters, the model's hotness profile and a trace span; answered_us:
 * when the answer was handed to the connection. */
static void account_infer(qm_job *job, uint64_t answered_us)
{
    const qm_method_ctx *mx = job->mx;
    qm_session *s = job->session;
    qm_counters *sc = qm_session_counters(s), *dc = mx->counters;
    /* From its line read whole (its decoding, admission and queueing
     * included) to the answer handed over: the daemon's whole part. */
    uint64_t latency = answered_us - job->read_us;
    sc->requests++;
    if (job->rc < 0) {
        sc->errors++;
        return;
    }
    qm_pager_stats was;
    qm_session_note_stats(s, &job->pstats, &was);
    sc->tokens += job->tokens;
    dc->tokens += job->tokens;
    qm_counters_add_paging(sc, dc, &was, &job->pstats);
    qm_model *m = qm_session_model(s);
    if (m->hotness && job->route_experts)
        qm_hotness_record(m->hotness, job->req.params.layer, job->route_experts, job->n_routes);
    qm_hist_add(&sc->latency, latency);
    qm_hist_add(&dc->latency, latency);
    /* The span's args, {"layer":..,"compute_us":..}, by hand: every inference
     * writes one (six names + six 20-digit numbers fit the 192 bytes). */
    const qm_pager_stats *now = &job->pstats;
    uint64_t hits = (now->hits - was.hits) + (now->whole_bank_accesses - was.whole_bank_accesses);
    static const char *const keys[] = {"{\"layer\":",   ",\"tokens\":",   ",\"hits\":",
                                       ",\"misses\":", ",\"queue_us\":", ",\"compute_us\":"};
    const uint64_t vals[] = {job->req.params.layer, job->tokens, hits, now->misses - was.misses,
                             job->start_us - job->enqueue_us, job->mstats.compute_us};
    char args[192];
    size_t n = 0;
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        size_t kl = strlen(keys[i]);
        memcpy(args + n, keys[i], kl);
        n += kl;
        n += qm_fmt_u64(args + n, vals[i], 0);
    }
    memcpy(args + n, "}", 2);
    qm_trace_add(mx->trace, "session.infer", job->read_us, latency, qm_session_id(s), args,
                 NULL);
}

static void infer_finish(qm_job *job)
{
    /* The answer leaves first: the bookkeeping after it is not the
     * engine's wait (the loop thread reads nothing in between, so a
     * telemetry request sent after the answer still sees it counted). A
     * skipped inference was neither served nor failed: not counted. */
    qm__job_answer(job);
    if (!job->cancelled)
        account_infer(job, qm_now_us());
}

/* Inferences are what queue_depth bounds: they hold the compute. */
static const qm_job_ops infer_ops = {
    .bounded = 1, .admit = infer_admit, .run = infer_run, .finish = infer_finish};

QM__METHOD_ROW(SESSION_INFER, .role = QM_ROLE_USER, .session = QM_SESSION_REQUIRED,
               .queued = QM_QUEUE_ALWAYS, .job = &infer_ops);
