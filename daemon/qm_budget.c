/* qm_budget.c - a session's budget from the wire's forms, the auto size
 * and why, and the watcher's step (qm_budget.h). */
#include "qm_budget.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }
static uint64_t sat_sub(uint64_t a, uint64_t b) { return a > b ? a - b : 0; }
static uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }

static const char *source_name(qm_mem_kind k)
{
    return k == QM_MEM_HOST ? "MemAvailable" : k == QM_MEM_CGROUP_V1 ? "cgroup v1" : "cgroup v2";
}

/* "MemAvailable 20.10 GB - reserve 256.0 MB - workspace 16.8 MB", with the
 * session's own bytes when a resize counts them ("+ its own 1.20 GB"); in a
 * cgroup, the experts qmoed holds in its use and the reserve's part in use
 * ("cgroup limit 1.45 GB - in use 1.10 GB (qmoed's experts 900.0 MB) -
 * reserve 400.0 MB + its 200.0 MB in use - workspace 16.8 MB"); the
 * client's pending bytes before the workspace ("- the client's pending
 * 430.0 MB"). */
static void memory_terms(const qm_mem_bound *b, const qm_budget_ask *ask, uint64_t reserve,
                         uint64_t reserve_free, char *out, size_t cap)
{
    char have[160], res[32], ws[32], own[32], held[32], used[32], pend[32], experts[64] = "";
    qm_mem_describe(b, have, sizeof have);
    qm_mem_bytes_text(reserve, res, sizeof res);
    qm_mem_bytes_text(ask->workspace, ws, sizeof ws);
    qm_mem_bytes_text(ask->pending, pend, sizeof pend);
    qm_mem_bytes_text(ask->credit, own, sizeof own);
    qm_mem_bytes_text(reserve - reserve_free, used, sizeof used);
    if (b->kind != QM_MEM_HOST && ask->held) {
        qm_mem_bytes_text(ask->held < b->usage ? ask->held : b->usage, held, sizeof held);
        snprintf(experts, sizeof experts, " (qmoed's experts %s)", held);
    }
    snprintf(out, cap, "%s%s%s%s - reserve %s%s%s%s%s%s%s%s", have, experts,
             ask->credit ? " + its own " : "", ask->credit ? own : "", res,
             reserve_free < reserve ? " + its " : "", reserve_free < reserve ? used : "",
             reserve_free < reserve ? " in use" : "",
             ask->pending ? " - the client's pending " : "", ask->pending ? pend : "",
             ask->workspace ? " - workspace " : "", ask->workspace ? ws : "");
}

/* " (cgroup /sys/fs/cgroup/memory/x)" for a cgroup bound, else "". */
static void where(const qm_mem_bound *b, char *out, size_t cap)
{
    if (b->kind == QM_MEM_HOST)
        out[0] = '\0';
    else
        snprintf(out, cap, " (%s %.300s)", source_name(b->kind), b->path);
}

uint64_t qm_budget_reserve_free(const qm_mem_bound *b, uint64_t reserve, uint64_t held)
{
    if (b->kind == QM_MEM_HOST)
        return reserve;
    uint64_t rest = sat_sub(b->usage, held);
    return sat_sub(reserve, rest);
}

/* a - b, clamped to int64_t. */
static int64_t signed_diff(uint64_t a, uint64_t b)
{
    uint64_t d = a >= b ? a - b : b - a;
    int64_t m = d > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)d;
    return a >= b ? m : -m;
}

int64_t qm_budget_headroom(const qm_mem_state *mem, uint64_t reserve, uint64_t held,
                           uint32_t *which)
{
    int64_t least = INT64_MAX;
    for (uint32_t i = 0; mem && i < mem->n; i++) {
        const qm_mem_bound *b = &mem->bounds[i];
        int64_t room = signed_diff(b->available, qm_budget_reserve_free(b, reserve, held));
        if (room < least) {
            least = room;
            *which = i;
        }
    }
    return least;
}

int qm_budget_auto_size(const qm_mem_state *mem, uint64_t reserve, const qm_budget_ask *ask,
                        uint64_t *bytes, qm_budget_auto *out, qm_status *st)
{
    memset(out, 0, sizeof *out);
    out->on = 1;
    out->reserve = reserve;
    out->reserve_free = reserve;
    out->experts = ask->held;
    out->workspace = ask->workspace;
    out->client_pending = ask->pending;
    char terms[480] = "", at[340] = "", text[32], other[32];
    uint64_t by_memory = UINT64_MAX;
    uint32_t which = 0;
    if (mem && mem->n) {
        qm_budget_headroom(mem, reserve, ask->held, &which);
        out->has_bound = 1;
        out->bound = mem->bounds[which];
        out->reserve_free = qm_budget_reserve_free(&out->bound, reserve, ask->held);
        /* The client's pending bytes are kept free beside the reserve's free
         * part, not within it: counted within, weights an engine maps had
         * no room left for the page cache to turn over (docs/OPERATIONS.md). */
        by_memory = sat_sub(sat_add(out->bound.available, ask->credit),
                            sat_add(sat_add(out->reserve_free, ask->pending), ask->workspace));
        memory_terms(&out->bound, ask, reserve, out->reserve_free, terms, sizeof terms);
        where(&out->bound, at, sizeof at);
    }
    uint64_t by_device = sat_sub(ask->device_free, ask->workspace);
    uint64_t b = min_u64(by_memory, min_u64(ask->model_bytes, by_device));
    out->by = b == by_memory ? QM_AUTO_BY_MEMORY
              : b == ask->model_bytes ? QM_AUTO_BY_MODEL : QM_AUTO_BY_DEVICE;
    if (b == 0)
        return qm_status_set_field(
            st, QM_ERESOURCE_EXHAUSTED, "budget",
            "budget auto: nothing left for expert weights: %.480s%.100s = 0 bytes (free memory, "
            "or lower auto_budget_reserve)",
            out->by == QM_AUTO_BY_MEMORY ? terms : "the devices' free budget less a workspace", at);
    qm_mem_bytes_text(b, text, sizeof text);
    qm_mem_bytes_text(by_memory, other, sizeof other);
    if (out->by == QM_AUTO_BY_MEMORY)
        snprintf(out->why, sizeof out->why, "budget auto: %.31s = %.480s%.100s", text, terms, at);
    else if (out->by == QM_AUTO_BY_MODEL && out->has_bound)
        snprintf(out->why, sizeof out->why,
                 "budget auto: %.31s = the model's expert bytes (memory allows %.31s = %.480s)",
                 text, other, terms);
    else if (out->by == QM_AUTO_BY_MODEL)
        snprintf(out->why, sizeof out->why, "budget auto: %s = the model's expert bytes", text);
    else
        snprintf(out->why, sizeof out->why,
                 "budget auto: %s = what the devices' budgets have free less a workspace "
                 "(device_budget)%s%s",
                 text, out->has_bound ? "; memory allows " : "", out->has_bound ? other : "");
    out->target = b;
    *bytes = b;
    return 0;
}

int qm_budget_resolve(const qm_config *cfg, const qm_budget_ask *ask, uint64_t *bytes,
                      qm_budget_auto *autob, qm_status *st)
{
    memset(autob, 0, sizeof *autob);
    switch (ask->spec->form) {
    case QM_BUDGET_NONE:
        *bytes = ask->model_bytes;
        return 0;
    case QM_BUDGET_BYTES:
        *bytes = ask->spec->bytes;
        return 0;
    case QM_BUDGET_PERCENT:
        *bytes = qm_budget_percent_of(ask->spec->percent, ask->model_bytes);
        return 0;
    case QM_BUDGET_AUTO:
        break;
    }
    qm_mem_state mem;
    if (ask->host_memory) {
        int rc = qm_mem_read(&mem, st);
        if (rc < 0) {
            snprintf(st->field, sizeof st->field, "budget");
            return rc;
        }
    }
    return qm_budget_auto_size(ask->host_memory ? &mem : NULL, cfg->auto_budget_reserve, ask,
                               bytes, autob, st);
}

void qm_budget_auto_json(qm_jw *w, const qm_budget_auto *a)
{
    static const char *const by[] = {"memory", "model", "device"};
    const qm_mem_bound *b = &a->bound;
    qm_jw_obj_begin(w);
    qm_jw_member_u64(w, "target_bytes", a->target);
    qm_jw_key(w, "ceiling_bytes"); /* a relapse's, while it holds (qm_budget.h) */
    if (a->ceiling && a->ceiling < a->target)
        qm_jw_u64(w, a->ceiling);
    else
        qm_jw_null(w);
    qm_jw_member_u64(w, "reserve_bytes", a->reserve);
    qm_jw_member_u64(w, "reserve_free_bytes", a->reserve_free);
    qm_jw_member_u64(w, "client_pending_bytes", a->client_pending);
    qm_jw_member_str(w, "bound", by[a->by]);
    qm_jw_key(w, "memory");
    if (a->has_bound) {
        qm_jw_obj_begin(w);
        qm_jw_member_str(w, "source", source_name(b->kind));
        qm_jw_member_str(w, "path", b->path);
        qm_jw_member_u64(w, "limit_bytes", b->limit);
        qm_jw_member_u64(w, "in_use_bytes", b->usage);
        qm_jw_member_u64(w, "experts_bytes", a->experts);
        qm_jw_member_u64(w, "page_cache_bytes", b->cache);
        qm_jw_member_u64(w, "available_bytes", b->available);
        qm_jw_obj_end(w);
    } else {
        qm_jw_null(w);
    }
    qm_jw_member_str(w, "reason", a->why);
    qm_jw_obj_end(w);
}

/* ---- the watcher's step ---- */

static uint64_t above_floor(const qm_budget_view *v) { return sat_sub(v->budget, v->floor); }

/* The deficit shared in proportion to what each holds above its floor. */
static void give_back(uint64_t deficit, const qm_budget_view *v, size_t n, uint64_t *next)
{
    double total = 0;
    for (size_t i = 0; i < n; i++)
        if (!v[i].pending)
            total += (double)above_floor(&v[i]);
    if (total <= 0)
        return;
    for (size_t i = 0; i < n; i++) {
        if (v[i].pending)
            continue;
        uint64_t room = above_floor(&v[i]);
        double share = ceil((double)deficit * (double)room / total);
        uint64_t give = share >= (double)room ? room : (uint64_t)share;
        next[i] = v[i].budget - give;
    }
}

/* The headroom shared in proportion to what each lacks of its target; a
 * grant below 1/64 of the target waits (no churn for crumbs) unless it is
 * all that was missing. */
static void grow_back(uint64_t headroom, const qm_budget_view *v, size_t n, uint64_t *next)
{
    double total = 0;
    for (size_t i = 0; i < n; i++)
        if (!v[i].pending && v[i].budget < v[i].target)
            total += (double)(v[i].target - v[i].budget);
    if (total <= 0)
        return;
    double give_all = (double)headroom >= total ? 1.0 : (double)headroom / total;
    for (size_t i = 0; i < n; i++) {
        if (v[i].pending || v[i].budget >= v[i].target)
            continue;
        uint64_t lack = v[i].target - v[i].budget;
        uint64_t grant = (uint64_t)floor((double)lack * give_all);
        if (grant > lack)
            grant = lack;
        if (grant == 0 || (grant < lack && grant < v[i].target / 64))
            continue;
        next[i] = v[i].budget + grant;
    }
}

size_t qm_budget_step(int64_t headroom, uint64_t slack, int pressure, int quiet,
                      uint32_t shrink_percent, const qm_budget_view *v, size_t n, uint64_t *next)
{
    for (size_t i = 0; i < n; i++)
        next[i] = v[i].budget;
    int64_t band = slack > INT64_MAX ? INT64_MAX : (int64_t)slack;
    if (headroom < -band) {
        give_back((uint64_t)(-(headroom + 1)) + 1, v, n, next);
    } else if (pressure) {
        for (size_t i = 0; i < n; i++) {
            if (v[i].pending)
                continue;
            uint64_t give = v[i].budget / 100 * shrink_percent +
                            v[i].budget % 100 * shrink_percent / 100;
            if (give == 0)
                give = 1;
            next[i] = v[i].budget - min_u64(give, above_floor(&v[i]));
        }
    } else if (quiet && headroom > band) {
        grow_back((uint64_t)headroom, v, n, next);
    }
    size_t changed = 0;
    for (size_t i = 0; i < n; i++)
        changed += next[i] != v[i].budget;
    return changed;
}

/* ---- relapses ---- */

uint64_t qm_budget_grow_wait_us(uint32_t grow_after_s, uint32_t relapses)
{
    uint32_t k = relapses < QM_BUDGET_RELAPSES_MAX ? relapses : QM_BUDGET_RELAPSES_MAX;
    return ((uint64_t)grow_after_s * 1000000u) << k;
}

int qm_budget_is_relapse(uint64_t now, uint64_t grew_us, uint32_t grow_after_s)
{
    return grew_us && now >= grew_us && now - grew_us < 2 * (uint64_t)grow_after_s * 1000000u;
}

uint64_t qm_budget_grow_target(qm_budget_auto *a, uint64_t budget, uint64_t now, uint64_t wait_us)
{
    if (!a->ceiling || a->ceiling >= a->target)
        return a->target;
    if (budget >= a->ceiling && now >= a->ceiling_us && now - a->ceiling_us >= wait_us) {
        a->ceiling = 0; /* it held there: growth may try the auto size again */
        return a->target;
    }
    return a->ceiling;
}
