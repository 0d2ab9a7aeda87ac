/* qm_infer.c - session.infer: admitted on the loop thread (mapped tensors
 * resolved, shapes against the model), run on a worker (the layer through
 * the session's pagers, and the response encoded there too, so the loop
 * thread only queues bytes), finished on the loop (counters, hotness,
 * trace span, the answer). The job owns everything it touches except the
 * session, which its FIFO gives it alone while it runs. */
#include "qm_methods.h"

#include <pthread.h>
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

/* ---- the answer's stats: one table, as the metrics are ---- */

/* Where a stat comes from: the growth of a telemetry counter over the call
 * (qm_counter_paging: the one definition of a hit, a miss, ...), or one of
 * the job's times. */
typedef enum stat_source {
    FROM_COUNTER,
    FROM_QUEUE,   /* queued until a worker took it */
    FROM_COMPUTE, /* the forward pass */
    FROM_DECODE,  /* its frame's decoding */
    FROM_ENCODE,  /* its answer's encoding (output and routing) */
    FROM_WALL     /* taken by a worker until its answer was encoded */
} stat_source;

/* session.infer's stats in the order the answer writes them (the wire's
 * order, docs/PROTOCOL.md; clients read them by position); `traced`: also
 * an arg of the call's trace span, after its layer and tokens. */
static const struct infer_stat {
    const char *name;
    stat_source from;
    const char *counter; /* FROM_COUNTER: the telemetry counter it grows with */
    int traced;
} infer_stats[] = {
    {"hits", FROM_COUNTER, "expert_hits", 1},
    {"misses", FROM_COUNTER, "expert_misses", 1},
    {"host_runs", FROM_COUNTER, "expert_host_runs", 0},
    {"bytes_paged", FROM_COUNTER, "bytes_paged_h2d", 0},
    {"bytes_read_disk", FROM_COUNTER, "bytes_read_disk", 0},
    {"stall_us", FROM_COUNTER, "stall_us", 0},
    {"queue_us", FROM_QUEUE, NULL, 1},
    {"compute_us", FROM_COMPUTE, NULL, 1},
    {"decode_us", FROM_DECODE, NULL, 0},
    {"encode_us", FROM_ENCODE, NULL, 0},
    {"wall_us", FROM_WALL, NULL, 0},
};
#define N_INFER_STATS (sizeof infer_stats / sizeof infer_stats[0])

/* Each stat's counter in the telemetry table, found once. */
static size_t stat_counter[N_INFER_STATS];
static pthread_once_t stat_counters_once = PTHREAD_ONCE_INIT;

static void find_stat_counters(void)
{
    for (size_t i = 0; i < N_INFER_STATS; i++)
        stat_counter[i] = infer_stats[i].counter ? qm_counter_index(infer_stats[i].counter) : 0;
}

/* One inference as its stats read it: the session's pager statistics
 * before and after, its job, and the times only the worker knows. */
typedef struct infer_reading {
    const qm_pager_stats *was, *now;
    const qm_job *job;
    uint64_t encode_us, end_us;
} infer_reading;

static uint64_t stat_value(size_t i, const infer_reading *r)
{
    const qm_job *job = r->job;
    switch (infer_stats[i].from) {
    case FROM_COUNTER:
        return qm_counter_paging(stat_counter[i], r->now) -
               qm_counter_paging(stat_counter[i], r->was);
    case FROM_QUEUE:
        return job->start_us - job->enqueue_us;
    case FROM_COMPUTE:
        return job->mstats.compute_us;
    case FROM_DECODE:
        return job->decode_us;
    case FROM_ENCODE:
        return r->encode_us;
    case FROM_WALL:
        return r->end_us - job->start_us;
    }
    return 0;
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

/* The answer, encoded on the worker: the output (base64, or the mapped
 * tensor it was written to), the routing when asked, and the stats. */
static void write_answer(qm_job *job, const void *output, const uint32_t *rexp, const float *rw,
                         uint32_t k, const qm_pager_stats *before)
{
    const qm_params *p = &job->req.params;
    uint32_t T = (uint32_t)p->hidden.shape[0];
    infer_reading r = {.was = before, .now = &job->pstats, .job = job, .end_us = qm_now_us()};
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
    r.encode_us = qm_now_us() - enc0;
    pthread_once(&stat_counters_once, find_stat_counters);
    qm_jw_key(&w, "stats");
    qm_jw_obj_begin(&w);
    for (size_t i = 0; i < N_INFER_STATS; i++)
        qm_jw_member_u64(&w, infer_stats[i].name, stat_value(i, &r));
    qm_jw_obj_end(&w);
    qm_jw_obj_end(&w);
    qm_rpc_result_end(&w);
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
    write_answer(job, output, rexp, rw, k, &before);
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
    /* The span's args, {"layer":..,"tokens":..} and the traced stats, by
     * hand: every inference writes one (the six today take 185 bytes at
     * most; a stat that would not fit is left out). */
    infer_reading r = {.was = &was, .now = &job->pstats, .job = job};
    char args[192];
    size_t n = 0;
    memcpy(args + n, "{\"layer\":", 9);
    n += 9;
    n += qm_fmt_u64(args + n, job->req.params.layer, 0);
    memcpy(args + n, ",\"tokens\":", 10);
    n += 10;
    n += qm_fmt_u64(args + n, job->tokens, 0);
    pthread_once(&stat_counters_once, find_stat_counters);
    for (size_t i = 0; i < N_INFER_STATS; i++) {
        size_t kl = strlen(infer_stats[i].name);
        if (!infer_stats[i].traced || n + kl + 4 + QM_U64_DEC_MAX + 2 > sizeof args)
            continue;
        memcpy(args + n, ",\"", 2);
        memcpy(args + n + 2, infer_stats[i].name, kl);
        memcpy(args + n + 2 + kl, "\":", 2);
        n += kl + 4;
        n += qm_fmt_u64(args + n, stat_value(i, &r), 0);
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
