/* client_calls SOCKET - every typed call of libqmoe-client once, with every
 * member it can send, against whatever listens on SOCKET (the fake daemon
 * of tests/clients/test_client_calls.py, which records the lines and
 * decodes them with the daemon's decoder: a stub that drifts from the
 * wire's rows fails there). Results and errors are ignored: only what goes
 * out matters. */
#include <stdio.h>
#include <string.h>

#include "qmoe_client.h"

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: client_calls SOCKET\n");
        return 2;
    }
    qm_client *c = NULL;
    qm_client_error err;
    if (qm_client_open(&c, argv[1], 5000, &err) < 0) {
        fprintf(stderr, "client_calls: %s\n", err.reason);
        return 1;
    }
    qm_client_set_ring(c, QM_CLIENT_RING_OFF);
    const char *sid = "0123456789abcdef0123456789abcdef";
    qm_client_status status;
    if (qm_client_daemon_status(c, &status, &err) == 0)
        qm_client_status_free(&status);
    qm_client_model model;
    if (qm_client_model_load(c, "demo", "/tmp/demo.bank", &model, &err) == 0)
        qm_client_model_free(&model);
    qm_client_model *models = NULL;
    size_t n = 0;
    if (qm_client_model_list(c, &models, &n, &err) == 0)
        qm_client_models_free(models, n);
    qm_client_model_unload(c, "demo", 1, &err);

    char *id = NULL;
    qm_client_plan_summary sum;
    qm_client_session_params sp = {.model = "demo",
                                   .policy = "next_use",
                                   .budget_bytes = 1 << 20,
                                   .has_budget = 1,
                                   .policy_params_json = "{\"prefetch\":false,\"decay\":0.5}",
                                   .precision = "fast"};
    if (qm_client_session_create(c, &sp, &id, &sum, &err) == 0) {
        qm_client_plan_summary_free(&sum);
        qm_client_string_free(id);
    }
    /* The budget as text: "N%" and "auto" are the daemon's to size. */
    static const char *const texts[] = {"25%", "auto", "4096"};
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
        sp.budget = texts[i];
        if (qm_client_session_create(c, &sp, &id, &sum, &err) == 0) {
            qm_client_plan_summary_free(&sum);
            qm_client_string_free(id);
        }
    }
    uint64_t resident = 0;
    if (qm_client_session_resize(c, sid, 1 << 19, &resident, &sum, &err) == 0)
        qm_client_plan_summary_free(&sum);
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++)
        if (qm_client_session_resize_to(c, sid, texts[i], &resident, &sum, &err) == 0)
            qm_client_plan_summary_free(&sum);
    qm_client_session_adopt(c, sid, &err);
    qm_client_session_info *infos = NULL;
    if (qm_client_session_list(c, &infos, &n, &err) == 0)
        qm_client_sessions_free(infos, n);
    qm_client_plan plan;
    if (qm_client_session_plan(c, sid, &plan, &err) == 0)
        qm_client_plan_free(&plan);

    float hidden[2 * 4] = {0}, logits[2 * 2] = {0}, weights[2 * 2] = {0};
    int32_t ids[2 * 2] = {0, 1, 1, 0};
    qm_client_tensor h = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {2, 4}, .data = hidden,
                          .nbytes = sizeof hidden};
    qm_client_tensor r = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {2, 2}, .data = logits,
                          .nbytes = sizeof logits};
    qm_client_tensor ti = {.dtype = QM_CLIENT_I32, .ndim = 2, .shape = {2, 2}, .data = ids,
                           .nbytes = sizeof ids};
    qm_client_tensor tw = {.dtype = QM_CLIENT_F32, .ndim = 2, .shape = {2, 2}, .data = weights,
                           .nbytes = sizeof weights};
    qm_client_infer_result res;
    if (qm_client_session_infer(c, sid, 1, &h, &r, 1, &res, &err) == 0)
        qm_client_infer_result_free(&res);
    if (qm_client_session_infer_routed(c, sid, 1, &h, &ti, &tw, 1, &res, &err) == 0)
        qm_client_infer_result_free(&res);

    qm_client_map map;
    memset(&map, 0, sizeof map);
    if (qm_client_map_create(c, sid, 4096, &map, &err) == 0) {
        qm_client_region hr = {.dtype = QM_CLIENT_F32, .rows = 2, .cols = 4, .offset = 0};
        qm_client_region ir = {.dtype = QM_CLIENT_I32, .rows = 2, .cols = 2, .offset = 64};
        qm_client_region wr = {.dtype = QM_CLIENT_F32, .rows = 2, .cols = 2, .offset = 128};
        qm_client_mapped_infer mi = {.session = sid, .layer = 1, .map = &map, .hidden = hr,
                                     .topk_ids = &ir, .topk_weights = &wr,
                                     .output_offset = 192};
        qm_client_infer_stats stats;
        qm_client_session_infer_mapped(c, &mi, &stats, &err);
        qm_client_map_release(c, &map, &err);
    }
    qm_client_session_ring(c, sid, &err);

    qm_client_telemetry t;
    if (qm_client_telemetry_get(c, sid, &t, &err) == 0)
        qm_client_telemetry_free(&t);
    if (qm_client_telemetry_get(c, NULL, &t, &err) == 0)
        qm_client_telemetry_free(&t);
    qm_client_span *spans = NULL;
    if (qm_client_telemetry_trace(c, sid, 10, &spans, &n, &err) == 0)
        qm_client_spans_free(spans, n);
    char *text = NULL;
    if (qm_client_telemetry_metrics(c, &text, &err) == 0)
        qm_client_string_free(text);
    qm_client_session_close(c, sid, &err);
    qm_client_daemon_shutdown(c, &err);
    qm_client_close(c);
    return 0;
}
