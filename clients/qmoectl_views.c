/* qmoectl_views.c - the two views operators read most: `plan` (a table per
 * bank against the budget) and `telemetry` (counters, optionally refreshed). */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "qmoectl.h"

#define B(n, buf) qmoectl_bytes((n), (buf), sizeof(buf))

/* ---------- plan ---------- */

/* The session's model, for the size of whole-bank-resident banks, and the
 * session's resident bytes (-1 when the session is not listed). */
static void plan_model_shape(qm_client *c, const char *session, uint64_t *experts, uint64_t *bpe,
                             int64_t *resident_bytes)
{
    qm_client_session_info *s = NULL;
    qm_client_model *m = NULL;
    size_t ns = 0, nm = 0;
    qm_client_error err;
    *experts = *bpe = 0;
    *resident_bytes = -1;
    if (qm_client_session_list(c, &s, &ns, &err) < 0)
        return;
    if (qm_client_model_list(c, &m, &nm, &err) == 0) {
        for (size_t i = 0; i < ns; i++) {
            if (!s[i].session || strcmp(s[i].session, session) != 0 || !s[i].model)
                continue;
            *resident_bytes = (int64_t)s[i].resident_bytes;
            for (size_t j = 0; j < nm; j++)
                if (m[j].name && strcmp(m[j].name, s[i].model) == 0) {
                    *experts = m[j].experts;
                    *bpe = m[j].bytes_per_expert;
                }
        }
    }
    qm_client_sessions_free(s, ns);
    qm_client_models_free(m, nm);
}

int qmoectl_cmd_plan(qm_client *c, const qmoectl_args *a)
{
    if (a->json)
        return qmoectl_print_json_session(c, "session.plan", a->pos[0]);
    qm_client_plan p;
    qm_client_error err;
    if (qm_client_session_plan(c, a->pos[0], &p, &err) < 0)
        return qmoectl_fail(&err);
    uint64_t model_experts = 0, model_bpe = 0;
    int64_t session_resident = -1;
    plan_model_shape(c, a->pos[0], &model_experts, &model_bpe, &session_resident);

    /* A DEVICE column after LAYER when the session is placed over several
     * devices (the plan's placement). */
    static const char *const hdr[] = {"BANK",   "LAYER",     "DECISION", "REASON",
                                      "CAND",   "CAND-SIZE", "PINNED",   "PIN-SIZE",
                                      "RES-NOW", "RES-SIZE"};
    static const char *const hdr_dev[] = {"BANK",      "LAYER",  "DEVICE",   "DECISION",
                                          "REASON",    "CAND",   "CAND-SIZE", "PINNED",
                                          "PIN-SIZE",  "RES-NOW", "RES-SIZE"};
    int placed = p.n_devices > 0;
    qmoectl_table *t = placed ? qmoectl_table_new(11, hdr_dev) : qmoectl_table_new(10, hdr);
    uint64_t tc = 0, tcb = 0, tp = 0, tpb = 0, tr = 0, trb = 0, whole_bytes = 0;
    int res_known = 1;
    char b1[32], b2[32], b3[32];
    for (size_t i = 0; i < p.n_banks; i++) {
        const qm_client_plan_bank *k = &p.banks[i];
        int whole = !k->has_experts;
        uint64_t bpe = k->bytes_per_expert ? k->bytes_per_expert : model_bpe;
        char reason[96] = "-";
        if (k->reason_kind)
            snprintf(reason, sizeof(reason), "%s%s%.48s%s", k->reason_kind,
                     k->reason_detail ? " (" : "", k->reason_detail ? k->reason_detail : "",
                     k->reason_detail ? (strlen(k->reason_detail) > 48 ? "...)" : ")") : "");
        qmoectl_table_cell(t, "%llu", (unsigned long long)k->bank);
        qmoectl_table_cell(t, "%llu", (unsigned long long)k->layer);
        if (placed)
            qmoectl_table_cell(t, "%s", k->device >= 0 && (size_t)k->device < p.n_devices &&
                                                p.devices[k->device].name
                                            ? p.devices[k->device].name
                                            : "?");
        qmoectl_table_cell(t, "%s", whole ? "whole-bank" : "per-expert");
        qmoectl_table_cell(t, "%s", reason);
        if (whole) {
            uint64_t bytes = k->bank_bytes >= 0 ? (uint64_t)k->bank_bytes : model_experts * bpe;
            qmoectl_table_cell(t, "-");
            qmoectl_table_cell(t, "-");
            qmoectl_table_cell(t, "-");
            qmoectl_table_cell(t, "-");
            qmoectl_table_cell(t, model_experts ? "all %llu" : "all",
                               (unsigned long long)model_experts);
            qmoectl_table_cell(t, "%s", bytes ? B(bytes, b1) : "?");
            tr += model_experts;
            trb += bytes;
            whole_bytes += bytes;
        } else {
            qmoectl_table_cell(t, "%zu", k->n_experts);
            qmoectl_table_cell(t, "%s", B(k->n_experts * bpe, b1));
            qmoectl_table_cell(t, "%zu", k->n_pinned);
            qmoectl_table_cell(t, "%s", B(k->n_pinned * bpe, b2));
            tc += k->n_experts;
            tcb += k->n_experts * bpe;
            tp += k->n_pinned;
            tpb += k->n_pinned * bpe;
            if (k->resident_now >= 0) {
                qmoectl_table_cell(t, "%lld", (long long)k->resident_now);
                qmoectl_table_cell(t, "%s", B((uint64_t)k->resident_now * bpe, b3));
                tr += (uint64_t)k->resident_now;
                trb += (uint64_t)k->resident_now * bpe;
            } else {
                res_known = 0;
                qmoectl_table_cell(t, "?");
                qmoectl_table_cell(t, "?");
            }
        }
    }
    qmoectl_table_cell(t, "total");
    qmoectl_table_cell(t, "%zu", p.n_banks);
    if (placed)
        qmoectl_table_cell(t, "%s", "");
    qmoectl_table_cell(t, "%s", "");
    qmoectl_table_cell(t, "%s", "");
    qmoectl_table_cell(t, "%llu", (unsigned long long)tc);
    qmoectl_table_cell(t, "%s", B(tcb, b1));
    qmoectl_table_cell(t, "%llu", (unsigned long long)tp);
    qmoectl_table_cell(t, "%s", B(tpb, b2));
    if (res_known || tr == 0) {
        qmoectl_table_cell(t, res_known ? "%llu" : "?", (unsigned long long)tr);
        qmoectl_table_cell(t, "%s", res_known ? B(trb, b3) : "?");
    } else {
        qmoectl_table_cell(t, "%llu+?", (unsigned long long)tr);
        qmoectl_table_cell(t, "%s+?", B(trb, b3));
    }

    char bud[32], pct[16], pct2[16];
    printf("session %s  policy %s  budget %s\n", a->pos[0], p.policy ? p.policy : "?",
           B(p.budget_bytes, bud));
    printf("banks %llu: %llu whole-bank resident, %llu per-expert, %llu degraded to whole-bank\n\n",
           (unsigned long long)p.total, (unsigned long long)p.resident,
           (unsigned long long)(p.total - p.resident - p.degraded),
           (unsigned long long)p.degraded);
    if (p.budget_auto) {
        printf("%s\n", p.budget_auto);
        if (p.budget_auto_target && p.budget_bytes < p.budget_auto_target)
            printf("now %s after memory pressure; grows back toward %s when it eases\n",
                   B(p.budget_bytes, b1), B(p.budget_auto_target, b2));
        if (p.budget_auto_ceiling)
            printf("pressure came back after it grew: growth stops at %s until the budget has "
                   "held there a whole wait\n",
                   B(p.budget_auto_ceiling, b1));
        printf("\n");
    }
    if (placed) {
        printf("placement %s:", p.placement_rule ? p.placement_rule : "?");
        for (size_t i = 0; i < p.n_devices; i++)
            printf("%s %s budget %s", i ? "," : "", p.devices[i].name ? p.devices[i].name : "?",
                   B(p.devices[i].budget_bytes, b1));
        printf("\n\n");
    }
    qmoectl_table_print(t, stdout);
    qmoectl_table_free(t);
    /* The daemon's own count of resident bytes wins over the per-bank sum. */
    int64_t resident = p.resident_bytes >= 0 ? p.resident_bytes : session_resident;
    if (resident < 0 && res_known)
        resident = (int64_t)trb;
    printf("\nwhole-bank %s, pinned %s (%s of budget), resident now %s (%s of budget)\n",
           B(whole_bytes, b1), B(tpb, b2),
           qmoectl_percent((double)tpb, (double)p.budget_bytes, pct2, sizeof(pct2)),
           resident >= 0 ? B((uint64_t)resident, b3) : "unknown",
           resident >= 0 ? qmoectl_percent((double)resident, (double)p.budget_bytes, pct, sizeof(pct))
                         : "-");
    if (!res_known)
        printf("(RES-NOW ?: this daemon does not report which experts are resident per bank)\n");
    if (p.on_miss)
        printf("on a miss: %s; experts %llu hit, %llu paged in, %llu run on the host\n",
               p.on_miss, (unsigned long long)p.expert_hits, (unsigned long long)p.expert_misses,
               (unsigned long long)p.expert_host_runs);
    qm_client_plan_free(&p);
    return QMOECTL_OK;
}

/* ---------- telemetry ---------- */

static void counters_row(qmoectl_table *t, const char *who, const char *model,
                         const qm_client_counters *k)
{
    char hr[16], paged[32], res[32], p50[32], p99[32];
    qmoectl_table_cell(t, "%s", who);
    qmoectl_table_cell(t, "%s", model ? model : "-");
    qmoectl_table_cell(t, "%llu", (unsigned long long)k->requests);
    qmoectl_table_cell(t, "%llu", (unsigned long long)k->errors);
    qmoectl_table_cell(t, "%llu", (unsigned long long)k->tokens);
    qmoectl_table_cell(t, "%s", qmoectl_percent((double)k->expert_hits,
                                                (double)(k->expert_hits + k->expert_misses +
                                                         k->expert_host_runs),
                                                hr, sizeof(hr)));
    qmoectl_table_cell(t, "%llu", (unsigned long long)k->expert_misses);
    qmoectl_table_cell(t, "%llu", (unsigned long long)k->expert_host_runs);
    qmoectl_table_cell(t, "%s", B(k->bytes_paged_h2d, paged));
    qmoectl_table_cell(t, "%llu", (unsigned long long)k->evictions);
    qmoectl_table_cell(t, "%llu/%llu", (unsigned long long)k->prefetch_useful,
                       (unsigned long long)k->prefetch_issued);
    qmoectl_table_cell(t, "%s", B(k->resident_bytes, res));
    qmoectl_table_cell(t, "%s", qmoectl_micros(k->p50_us, p50, sizeof(p50)));
    qmoectl_table_cell(t, "%s", qmoectl_micros(k->p99_us, p99, sizeof(p99)));
}

/* One row per prediction source that predicted anything: precision and
 * recall of the prefetch predictors, and how often the gate held one off. */
static void prediction_rows(qmoectl_table *t, const char *who, const qm_client_counters *k)
{
    const struct {
        const char *name;
        uint64_t predicted, correct, actual, gated;
    } src[] = {
        {"router", k->predict_router_predicted, k->predict_router_correct,
         k->predict_router_actual, k->predict_router_gated},
        {"history", k->predict_history_predicted, k->predict_history_correct,
         k->predict_history_actual, k->predict_history_gated},
        {"lookahead", k->predict_lookahead_predicted, k->predict_lookahead_correct,
         k->predict_lookahead_actual, k->predict_lookahead_gated},
    };
    for (size_t i = 0; i < sizeof src / sizeof src[0]; i++) {
        char prec[16], rec[16];
        if (!src[i].predicted && !src[i].gated)
            continue;
        qmoectl_table_cell(t, "%s", who);
        qmoectl_table_cell(t, "%s", src[i].name);
        qmoectl_table_cell(t, "%llu", (unsigned long long)src[i].predicted);
        qmoectl_table_cell(t, "%llu", (unsigned long long)src[i].correct);
        qmoectl_table_cell(t, "%s", qmoectl_percent((double)src[i].correct,
                                                    (double)src[i].predicted, prec, sizeof prec));
        qmoectl_table_cell(t, "%s", qmoectl_percent((double)src[i].correct,
                                                    (double)src[i].actual, rec, sizeof rec));
        qmoectl_table_cell(t, "%llu", (unsigned long long)src[i].gated);
    }
}

static int predicted_any(const qm_client_counters *k)
{
    return k->predict_router_predicted || k->predict_router_gated ||
           k->predict_history_predicted || k->predict_history_gated ||
           k->predict_lookahead_predicted || k->predict_lookahead_gated;
}

static void prediction_table(const qm_client_telemetry *tm)
{
    int any = 0;
    for (size_t i = 0; i < tm->n_sessions; i++)
        any |= predicted_any(&tm->sessions[i].counters);
    if (!any)
        return;
    static const char *const hdr[] = {"SESSION", "PREDICTOR", "PREDICTED", "CORRECT",
                                      "PRECISION", "RECALL",   "GATED-CALLS"};
    qmoectl_table *t = qmoectl_table_new(7, hdr);
    for (size_t i = 0; i < tm->n_sessions; i++)
        prediction_rows(t, tm->sessions[i].session ? tm->sessions[i].session : "?",
                        &tm->sessions[i].counters);
    printf("\n");
    qmoectl_table_print(t, stdout);
    qmoectl_table_free(t);
}

/* Direct disk paging, added to the rows when any row read from disk: stall
 * per call and per token, bytes read per token, reads in flight (mean of
 * each call's most / the most), the disk's measured rate (bytes read / time
 * with reads in flight), prefetch reads parked part way. */
static const char *const disk_headers[] = {"STALL/CALL", "STALL/TOKEN", "DISK/TOKEN",
                                           "IN-FLIGHT",  "DISK-RATE",   "PARKED"};
#define N_DISK_HEADERS (sizeof disk_headers / sizeof *disk_headers)

static void disk_cells(qmoectl_table *t, const qm_client_counters *k)
{
    char sc[32], stok[32], rtok[32], rate[32];
    double calls = (double)(k->requests ? k->requests : 1),
           tok = (double)(k->tokens ? k->tokens : 1);
    qmoectl_table_cell(t, "%s", qmoectl_micros((double)k->stall_us / calls, sc, sizeof(sc)));
    qmoectl_table_cell(t, "%s", qmoectl_micros((double)k->stall_us / tok, stok, sizeof(stok)));
    qmoectl_table_cell(t, "%s", B((uint64_t)((double)k->bytes_read_disk / tok), rtok));
    qmoectl_table_cell(t, "%.1f/%llu",
                       k->read_calls ? (double)k->reads_in_flight_sum / (double)k->read_calls : 0.0,
                       (unsigned long long)k->reads_in_flight_peak);
    if (k->disk_busy_us)
        qmoectl_table_cell(
            t, "%s/s",
            B((uint64_t)((double)k->bytes_read_disk * 1e6 / (double)k->disk_busy_us), rate));
    else
        qmoectl_table_cell(t, "-");
    qmoectl_table_cell(t, "%llu", (unsigned long long)k->prefetch_parked);
}

static int any_disk(const qm_client_telemetry *tm)
{
    int any = tm->has_daemon && tm->daemon.bytes_read_disk;
    for (size_t i = 0; i < tm->n_sessions; i++)
        any |= tm->sessions[i].counters.bytes_read_disk != 0;
    return any;
}

static int telemetry_once(qm_client *c, const char *session, int json)
{
    if (json)
        return qmoectl_print_json_session(c, "telemetry.get", session);
    qm_client_telemetry tm;
    qm_client_error err;
    if (qm_client_telemetry_get(c, session, &tm, &err) < 0)
        return qmoectl_fail(&err);
    const char *hdr[14 + N_DISK_HEADERS] = {"SESSION",  "MODEL",    "REQUESTS", "ERRORS",
                                             "TOKENS",   "HIT-RATE", "MISSES",   "ON-HOST",
                                             "PAGED",    "EVICTED",  "PREFETCH", "RESIDENT",
                                             "P50",      "P99"};
    const int disk = any_disk(&tm);
    for (size_t i = 0; disk && i < N_DISK_HEADERS; i++)
        hdr[14 + i] = disk_headers[i];
    qmoectl_table *t = qmoectl_table_new(disk ? 14 + (int)N_DISK_HEADERS : 14, hdr);
    if (tm.has_daemon) {
        counters_row(t, "(daemon)", NULL, &tm.daemon);
        if (disk)
            disk_cells(t, &tm.daemon);
    }
    for (size_t i = 0; i < tm.n_sessions; i++) {
        counters_row(t, tm.sessions[i].session ? tm.sessions[i].session : "?",
                     tm.sessions[i].model, &tm.sessions[i].counters);
        if (disk)
            disk_cells(t, &tm.sessions[i].counters);
    }
    qmoectl_table_print(t, stdout);
    qmoectl_table_free(t);
    prediction_table(&tm);
    qm_client_telemetry_free(&tm);
    return QMOECTL_OK;
}

static volatile sig_atomic_t qmoectl_stop;
static void on_sigint(int sig)
{
    (void)sig;
    qmoectl_stop = 1;
}

int qmoectl_cmd_telemetry(qm_client *c, const qmoectl_args *a)
{
    const char *session = a->npos ? a->pos[0] : NULL;
    const char *w = qmoectl_opt(a, "--watch"), *cnt = qmoectl_opt(a, "--count");
    if (!w) {
        if (cnt)
            return qmoectl_usage_error("--count only makes sense with --watch");
        return telemetry_once(c, session, a->json);
    }
    char *end = NULL;
    double every = strtod(w, &end);
    if (end == w || *end || !(every > 0) || every > 86400)
        return qmoectl_usage_error("--watch takes seconds (> 0), not '%.32s'", w);
    long count = 0;
    if (cnt) {
        count = strtol(cnt, &end, 10);
        if (end == cnt || *end || count < 1)
            return qmoectl_usage_error("--count takes a positive number, not '%.32s'", cnt);
    }
    struct sigaction sa = {.sa_handler = on_sigint};
    sigaction(SIGINT, &sa, NULL);
    int tty = isatty(STDOUT_FILENO) && !a->json;
    for (long i = 0; !qmoectl_stop && (!count || i < count); i++) {
        if (i > 0) {
            struct timespec ts = {(time_t)every, (long)((every - (double)(time_t)every) * 1e9)};
            while (nanosleep(&ts, &ts) < 0 && !qmoectl_stop) {
            }
            if (qmoectl_stop)
                break;
        }
        if (!a->json) {
            char when[32];
            time_t now = time(NULL);
            strftime(when, sizeof(when), "%H:%M:%S", localtime(&now));
            if (tty)
                fputs("\033[H\033[J", stdout);
            else if (i > 0)
                fputs("\n", stdout);
            printf("qmoed telemetry at %s, every %gs%s\n", when, every,
                   tty ? " (Ctrl-C to stop)" : "");
        }
        int rc = telemetry_once(c, session, a->json);
        fflush(stdout);
        if (rc != QMOECTL_OK)
            return rc;
    }
    return QMOECTL_OK;
}

int qmoectl_check_telemetry(const qmoectl_args *a)
{
    const char *w = qmoectl_opt(a, "--watch"), *cnt = qmoectl_opt(a, "--count");
    char *end = NULL;
    if (!w && cnt)
        return qmoectl_usage_error("--count only makes sense with --watch");
    if (w) {
        double every = strtod(w, &end);
        if (end == w || *end || !(every > 0) || every > 86400)
            return qmoectl_usage_error("--watch takes seconds (> 0), not '%.32s'", w);
    }
    if (cnt) {
        long count = strtol(cnt, &end, 10);
        if (end == cnt || *end || count < 1)
            return qmoectl_usage_error("--count takes a positive number, not '%.32s'", cnt);
    }
    return 0;
}

