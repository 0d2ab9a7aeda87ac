/* qm_infer.c - session.infer: admitted on the loop thread (mapped tensors
 * resolved, shapes against the model), run on a worker (the layer through
 * the session's pagers, and the response encoded there too, so the loop
 * thread only queues bytes), finished on the loop (counters, hotness,
 * trace span, the answer). The job owns everything it touches except the
 * session, which its FIFO gives it alone while it runs. */
#include "qm_methods.h"

#include <pthread.h>
#include <string.h>

#include <stdio.h>

#include "qm_alloc.h"
#include "qm_models.h"
#include "qm_ring.h"
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
    int rc = qm_shm_resolve(qm_session_maps(job->session), p, p->hidden.nbytes, job->conn_id,
                            &job->maps, st);
    return rc < 0 ? rc : check_infer(job->session, p, st);
}

/* One layer call's buffers: the output (the client's map when output_to
 * names a region no input overlaps, else aside and copied there), the
 * route weights, and the session's statistics before the call. */
typedef struct infer_call {
    void *output;
    int direct;
    size_t out_bytes;
    uint32_t tokens, k;
    float *route_weights;
    qm_pager_stats before;
} infer_call;

static void infer_call_free(infer_call *c)
{
    if (!c->direct)
        qm_free(c->output);
    qm_free(c->route_weights);
}

/* The layer through the session's pagers, for a socket inference and a
 * ring call alike (the job holds the session's FIFO): job->rc, st,
 * mstats, pstats, tokens and routes, and *c for the answer. */
static int infer_compute(qm_job *job, infer_call *c)
{
    qm_session *s = job->session;
    qm_params *p = &job->req.params;
    qm_model *model = qm_session_model(s);
    const qm_bank_config *cfg = qm_bank_get_config(model->bank);
    uint32_t T = (uint32_t)p->hidden.shape[0], H = cfg->hidden;
    uint32_t k = p->has_topk ? (uint32_t)p->topk_ids.shape[1] : cfg->k;
    c->tokens = T;
    c->k = k;
    c->out_bytes = (size_t)T * H * qm_wire_dtype_size(p->hidden.dtype);
    c->direct = job->maps.output && !job->maps.output_overlaps;
    c->output = c->direct ? job->maps.output : qm_malloc(c->out_bytes ? c->out_bytes : 1);
    float *logits = p->has_router_logits ? logits_f32(&p->router_logits) : NULL;
    float *topk_w = p->has_topk ? logits_f32(&p->topk_weights) : NULL;
    /* Routes are always kept: the loop feeds them to the model's hotness
     * profile when the job is done. */
    uint32_t *rexp = qm_malloc((size_t)T * k * sizeof *rexp + 4);
    c->route_weights = qm_malloc((size_t)T * k * sizeof *c->route_weights + 4);
    job->route_experts = rexp;
    job->n_routes = (size_t)T * k;
    if (!c->output || (p->has_router_logits && !logits) || (p->has_topk && !topk_w) || !rexp ||
        !c->route_weights) {
        job->rc = qm_status_set(&job->st, QM_ENOMEM, "out of memory for %u tokens", T);
        goto free_inputs;
    }
    qm_session_stats(s, &c->before);
    qm_moe_call call = {.layer = p->layer,
                        .dtype = dtype_of(p->hidden.dtype),
                        .hidden = p->hidden.data,
                        .n_tokens = T,
                        .logits = logits,
                        .output = c->output,
                        .route_experts = rexp,
                        .route_weights = c->route_weights,
                        .topk_ids = p->has_topk ? p->topk_ids.data : NULL,
                        .topk_weights = topk_w,
                        .topk_k = k,
                        .precision = qm_session_precision(s)};
    /* A bank file truncated on disk fails the request before it reads the
     * mapping, and after it when the truncation raced it and a read hit a
     * missing page (qm_sigbus.c): what was read before was the file's. */
    job->rc = qm_model_check(model, &job->st);
    if (job->rc == 0)
        job->rc = qm_session_forward(s, &call, &job->mstats, &job->st);
    if (job->rc == 0)
        job->rc = qm_model_check_reads(model, &job->st);
    qm_session_stats(s, &job->pstats);
    job->tokens = T;
    if (job->rc == 0 && job->maps.output && !c->direct)
        memcpy(job->maps.output, c->output, c->out_bytes);
free_inputs:
    qm_free(logits);
    qm_free(topk_w);
    return job->rc;
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

/* session.infer's stats, by the wire's index (protocol/qm_ring_wire.h: the
 * JSON answer's members in qm_ring_stat_names' order and the ring's answer
 * slot); `traced`: also an arg of the call's trace span, after its layer
 * and tokens. */
static const struct infer_stat {
    stat_source from;
    const char *counter; /* FROM_COUNTER: the telemetry counter it grows with */
    int traced;
} infer_stat[QM_RING_STATS] = {
    [QM_RING_STAT_HITS] = {FROM_COUNTER, "expert_hits", 1},
    [QM_RING_STAT_MISSES] = {FROM_COUNTER, "expert_misses", 1},
    [QM_RING_STAT_HOST_RUNS] = {FROM_COUNTER, "expert_host_runs", 0},
    [QM_RING_STAT_BYTES_PAGED] = {FROM_COUNTER, "bytes_paged_h2d", 0},
    [QM_RING_STAT_BYTES_READ_DISK] = {FROM_COUNTER, "bytes_read_disk", 0},
    [QM_RING_STAT_STALL_US] = {FROM_COUNTER, "stall_us", 0},
    [QM_RING_STAT_QUEUE_US] = {FROM_QUEUE, NULL, 1},
    [QM_RING_STAT_COMPUTE_US] = {FROM_COMPUTE, NULL, 1},
    [QM_RING_STAT_DECODE_US] = {FROM_DECODE, NULL, 0},
    [QM_RING_STAT_ENCODE_US] = {FROM_ENCODE, NULL, 0},
    [QM_RING_STAT_WALL_US] = {FROM_WALL, NULL, 0},
};

/* Each stat's counter in the telemetry table, found once. */
static size_t stat_counter[QM_RING_STATS];
static pthread_once_t stat_counters_once = PTHREAD_ONCE_INIT;

static void find_stat_counters(void)
{
    for (size_t i = 0; i < QM_RING_STATS; i++)
        stat_counter[i] = infer_stat[i].counter ? qm_counter_index(infer_stat[i].counter) : 0;
}

/* Stat i of a call: the session's pager statistics before (was) and after
 * (now) it, its job, and the times only the worker knows. */
static uint64_t stat_value(size_t i, const qm_pager_stats *was, const qm_pager_stats *now,
                           const qm_job *job, uint64_t encode_us, uint64_t end_us)
{
    switch (infer_stat[i].from) {
    case FROM_COUNTER:
        return qm_counter_paging(stat_counter[i], now) - qm_counter_paging(stat_counter[i], was);
    case FROM_QUEUE:
        return job->start_us - job->enqueue_us;
    case FROM_COMPUTE:
        return job->mstats.compute_us;
    case FROM_DECODE:
        return job->decode_us;
    case FROM_ENCODE:
        return encode_us;
    case FROM_WALL:
        return end_us - job->start_us;
    }
    return 0;
}

/* session.infer's stats, by the wire's index. */
static void infer_stats(const qm_job *job, const infer_call *c, uint64_t encode_us,
                        uint64_t now_us, uint64_t out[QM_RING_STATS])
{
    pthread_once(&stat_counters_once, find_stat_counters);
    for (size_t i = 0; i < QM_RING_STATS; i++)
        out[i] = stat_value(i, &c->before, &job->pstats, job, encode_us, now_us);
}

/* The JSON answer: the output (mapped, or base64), the routing when asked
 * for, the stats. */
static void infer_encode(qm_job *job, const infer_call *c)
{
    qm_params *p = &job->req.params;
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
        qm_jw_tensor(&w, p->hidden.dtype, 2, p->hidden.shape, c->output);
    if (p->return_routing) {
        const uint32_t *rexp = job->route_experts;
        qm_jw_key(&w, "routing");
        qm_jw_arr_begin(&w);
        for (uint32_t t = 0; t < c->tokens; t++) {
            qm_jw_arr_begin(&w);
            for (uint32_t j = 0; j < c->k; j++) {
                size_t i = (size_t)t * c->k + j;
                if (rexp[i] == QM_ROUTE_DROPPED)
                    continue;
                qm_jw_arr_begin(&w);
                qm_jw_u64(&w, rexp[i]);
                qm_jw_f32(&w, c->route_weights[i]);
                qm_jw_arr_end(&w);
            }
            qm_jw_arr_end(&w);
        }
        qm_jw_arr_end(&w);
    }
    uint64_t stats[QM_RING_STATS];
    infer_stats(job, c, qm_now_us() - enc0, now, stats);
    qm_jw_key(&w, "stats");
    qm_jw_obj_begin(&w);
    for (int i = 0; i < QM_RING_STATS; i++)
        qm_jw_member_u64(&w, qm_ring_stat_names[i], stats[i]);
    qm_jw_obj_end(&w);
    qm_jw_obj_end(&w);
    qm_rpc_result_end(&w);
    if (job->response.oom)
        job->rc = qm_status_set(&job->st, QM_ENOMEM, "out of memory encoding the output");
}

static void infer_run(qm_job *job)
{
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
    infer_call c;
    memset(&c, 0, sizeof c);
    if (infer_compute(job, &c) == 0 && job->req.id)
        infer_encode(job, &c);
    infer_call_free(&c);
    /* The loop writes the answer once this returns: what the call left
     * (the next layers' prefetch) runs first, as inside the forward call
     * (a ring's may run after its answer: ring_run). */
    qm_session_after_forward(job->session);
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
    char args[192];
    size_t n = 0;
    memcpy(args + n, "{\"layer\":", 9);
    n += 9;
    n += qm_fmt_u64(args + n, job->req.params.layer, 0);
    memcpy(args + n, ",\"tokens\":", 10);
    n += 10;
    n += qm_fmt_u64(args + n, job->tokens, 0);
    pthread_once(&stat_counters_once, find_stat_counters);
    for (size_t i = 0; i < QM_RING_STATS; i++) {
        size_t kl = strlen(qm_ring_stat_names[i]);
        if (!infer_stat[i].traced || n + kl + 4 + QM_U64_DEC_MAX + 2 > sizeof args)
            continue;
        memcpy(args + n, ",\"", 2);
        memcpy(args + n + 2, qm_ring_stat_names[i], kl);
        memcpy(args + n + 2 + kl, "\":", 2);
        n += kl + 4;
        n += qm_fmt_u64(args + n, stat_value(i, &was, &job->pstats, job, 0, 0), 0);
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

/* ---- a call ring's job (qm_ring.h) ----
 * The socket inference's checks, layer and counting, with the answer in
 * the ring's slot instead of JSON. The request was decoded on the ring's
 * thread (job->rc says whether it decoded); the rest happens in the
 * session's order, here. */

static void ring_run(qm_job *job)
{
    qm_ring_job *rj = (qm_ring_job *)job;
    qm_ring_answer a;
    memset(&a, 0, sizeof a);
    infer_call c;
    memset(&c, 0, sizeof c);
    if (job->rc == 0 && qm_ring_abandoned(rj->ring)) {
        job->cancelled = 1;
        job->rc = qm_status_set(&job->st, QM_EIO,
                                "the client disconnected before this request ran");
    }
    if (job->rc == 0 && !qm__job_session_closed(job)) {
        job->rc = infer_admit(job, &job->st);
        rj->admitted = job->rc == 0;
        if (job->rc == 0 && infer_compute(job, &c) == 0)
            infer_stats(job, &c, 0, qm_now_us(), a.stats);
    }
    if (job->rc < 0) {
        a.code = qm_rpc_code_from_status(job->st.code);
        snprintf(a.field, sizeof a.field, "%s", job->st.field);
        snprintf(a.reason, sizeof a.reason, "%s",
                 job->st.msg[0] ? job->st.msg : qm_rpc_code_name(a.code));
    }
    infer_call_free(&c);
    /* What the call left for after its answer (the next layers' prefetch,
     * qm_pager_options.defer_prefetch): after it when the engine leaves a
     * CPU idle between its calls (it asked the ring to anticipate them),
     * where the routers' GEMVs and the reads' issue overlap the engine's
     * own work; before it otherwise, as inside the forward call: where
     * the engine keeps every CPU busy, running it after the answer only
     * takes the engine's CPU (llama.cpp on 2 cores, decode_ab 6 rounds:
     * 0.73x against 0.76x of whole_bank at a 25% budget, 0.84x against
     * 0.90x at 50%). The job holds the session and its FIFO either way:
     * nothing else runs on its pagers. */
    int after = rj->admitted && qm_ring_anticipates(rj->ring);
    if (rj->admitted && !after)
        qm_session_after_forward(job->session);
    qm_ring_post(rj, job->cancelled ? NULL : &a);
    /* And once the client has its answer, the work that only speeds
     * later calls (a piece of a paged unit's r8 layout, qm_pager_tidy:
     * about 0.2 ms, which on the answer's path the engine would wait for). */
    if (rj->admitted)
        qm_session_tidy(job->session);
}

/* Counted as the socket counts an inference: every call a request of the
 * daemon's (an error when it failed), and the session's once it was
 * admitted and not skipped. */
static void ring_finish(qm_job *job)
{
    qm_ring_job *rj = (qm_ring_job *)job;
    qm_counters *dc = job->mx->counters;
    dc->requests++;
    if (job->rc < 0)
        dc->errors++;
    if (rj->admitted && !job->cancelled)
        account_infer(job, rj->answered_us);
}

const qm_job_ops qm__ring_infer_ops = {.run = ring_run, .finish = ring_finish};

/* Inferences are what queue_depth bounds: they hold the compute. */
static const qm_job_ops infer_ops = {
    .bounded = 1, .admit = infer_admit, .run = infer_run, .finish = infer_finish};

QM__METHOD_ROW(SESSION_INFER, .role = QM_ROLE_USER, .session = QM_SESSION_REQUIRED,
               .queued = QM_QUEUE_ALWAYS, .job = &infer_ops);
