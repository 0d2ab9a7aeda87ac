/* qm_pressure.c - the memory watcher of auto budgets (qm_pressure.h): its
 * event sources, its timer, and the resize jobs it queues. */
#include "qm_pressure.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_budget.h"
#include "qm_log.h"
#include "qm_methods.h"
#include "qm_sessions.h"

#define QM__PSI_WINDOW_US 2000000u /* the unprivileged minimum, and a multiple of it */
#define QM__EVENT_STEP_US 100000u  /* events closer than this share one step */

struct qm__psource {
    uv_poll_t poll;
    qm_pressure *owner;
    int kind;   /* QM__PSOURCE_* */
    int fd;     /* polled: a PSI trigger, cgroup v1's eventfd, the test FIFO */
    int aux_fd; /* cgroup v1: memory.pressure_level, held while registered; else -1 */
    int prio;   /* a PSI trigger: POLLPRI, nothing to read; else readable, drained */
    char what[QM_MEM_PATH_MAX + 32]; /* for the log */
};

/* ---- event sources ---- */

static void source_closed_cb(uv_handle_t *h)
{
    qm__psource *src = h->data;
    close(src->fd);
    if (src->aux_fd >= 0)
        close(src->aux_fd);
    qm_free(src);
}

static void source_close(qm_pressure *p, int kind)
{
    qm__psource *src = p->src[kind];
    if (!src)
        return;
    p->src[kind] = NULL;
    uv_close((uv_handle_t *)&src->poll, source_closed_cb);
}

static uint64_t check_us(const qm_pressure *p)
{
    uint32_t ms = p->mx->cfg->auto_budget_check_ms;
    return (uint64_t)(ms ? ms : 1000) * 1000u;
}

static void source_cb(uv_poll_t *h, int status, int events)
{
    qm__psource *src = h->data;
    qm_pressure *p = src->owner;
    if (status < 0 || (events & UV_DISCONNECT)) {
        qm_log(QM_LOG_WARNING, "memory pressure source %s stopped: %s", src->what,
               status < 0 ? uv_strerror(status) : "its cgroup went away");
        source_close(p, src->kind);
        return;
    }
    if (!src->prio) {
        char sink[256]; /* the eventfd's count, the FIFO's lines: events, whatever they say */
        while (read(src->fd, sink, sizeof sink) > 0)
            ;
    }
    uint64_t now = qm_now_us();
    p->mx->counters->memory_pressure_events++;
    if (now < p->grace_until_us) {
        qm_log(QM_LOG_DEBUG, "memory pressure event from %s: within %u ms of an auto budget's "
               "allocation, not acted on", src->what, p->mx->cfg->auto_budget_grace_ms);
        return;
    }
    qm_log(QM_LOG_DEBUG, "memory pressure event from %s", src->what);
    p->pressure_pending = 1;
    uint64_t last = p->last_pressure_us;
    p->last_pressure_us = now;
    if (!last || now - last >= QM__EVENT_STEP_US)
        qm_pressure_step(p, now);
}

/* Polls fd (and aux_fd, kept open) as source `kind`; -1 with *why. */
static int source_add(qm_pressure *p, int kind, int fd, int aux_fd, int prio, const char *what,
                      char *why, size_t cap)
{
    qm__psource *src = qm_calloc(1, sizeof *src);
    int rc = src ? uv_poll_init(p->loop, &src->poll, fd) : UV_ENOMEM;
    if (rc < 0) {
        snprintf(why, cap, "%s cannot be polled: %s", what, uv_strerror(rc));
        qm_free(src);
        close(fd);
        if (aux_fd >= 0)
            close(aux_fd);
        return -1;
    }
    src->owner = p;
    src->kind = kind;
    src->fd = fd;
    src->aux_fd = aux_fd;
    src->prio = prio;
    snprintf(src->what, sizeof src->what, "%s", what);
    src->poll.data = src;
    uv_poll_start(&src->poll, prio ? UV_PRIORITIZED : UV_READABLE, source_cb);
    p->src[kind] = src;
    /* Said once a source: sources close with the last auto session and
     * arm again with the next. */
    qm_log(p->announced[kind] ? QM_LOG_DEBUG : QM_LOG_INFO,
           "auto budgets: listening for memory pressure on %s", what);
    p->announced[kind] = 1;
    return 0;
}

/* A PSI trigger on `path` (/proc/pressure/memory, a v2 cgroup's
 * memory.pressure): "some" stall of auto_budget_pressure_ms in 2 s. */
static int arm_psi(qm_pressure *p, int kind, const char *path, char *why, size_t cap)
{
    int fd = open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        snprintf(why, cap, "%s: %s", path, strerror(errno));
        return -1;
    }
    char trig[64];
    int n = snprintf(trig, sizeof trig, "some %u %u",
                     p->mx->cfg->auto_budget_pressure_ms * 1000u, QM__PSI_WINDOW_US);
    /* With its NUL: the kernel reads the last byte written as the end. */
    if (write(fd, trig, (size_t)n + 1) != n + 1) {
        snprintf(why, cap, "%s: writing the trigger \"%s\": %s", path, trig, strerror(errno));
        close(fd);
        return -1;
    }
    char what[QM_MEM_PATH_MAX + 32];
    snprintf(what, sizeof what, "PSI %.500s", path);
    return source_add(p, kind, fd, -1, 1, what, why, cap);
}

/* cgroup v1: memory.pressure_level events at auto_budget_pressure_level,
 * registered through cgroup.event_control with an eventfd. */
static int arm_v1(qm_pressure *p, const char *dir, char *why, size_t cap)
{
    const char *level = p->mx->cfg->auto_budget_pressure_level;
    char path[QM_MEM_PATH_MAX + 32], line[96];
    int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), lfd = -1, cfd = -1;
    snprintf(path, sizeof path, "%s/memory.pressure_level", dir);
    if (efd >= 0)
        lfd = open(path, O_RDONLY | O_CLOEXEC);
    snprintf(path, sizeof path, "%s/cgroup.event_control", dir);
    if (lfd >= 0)
        cfd = open(path, O_WRONLY | O_CLOEXEC);
    int n = snprintf(line, sizeof line, "%d %d %s", efd, lfd, level);
    if (efd < 0 || lfd < 0 || cfd < 0 || write(cfd, line, (size_t)n) != n) {
        snprintf(why, cap, "%.500s: %s", efd < 0 ? "eventfd" : path, strerror(errno));
        if (cfd >= 0)
            close(cfd);
        if (lfd >= 0)
            close(lfd);
        if (efd >= 0)
            close(efd);
        return -1;
    }
    close(cfd);
    char what[QM_MEM_PATH_MAX + 32];
    snprintf(what, sizeof what, "cgroup v1 %.480s (%s)", dir, level);
    return source_add(p, QM__PSOURCE_CGROUP, efd, lfd, 0, what, why, cap);
}

static void say_off(qm_pressure *p, int kind, const char *why)
{
    if (p->logged[kind])
        return;
    p->logged[kind] = 1;
    qm_log(QM_LOG_INFO, "auto budgets: no memory pressure events from %s", why);
}

/* The sources, armed when an auto session is open: PSI system-wide and
 * the cgroup qmoed is in now (re-armed when it was moved). */
static void arm_sources(qm_pressure *p, const qm_mem_state *mem)
{
    const qm_config *cfg = p->mx->cfg;
    char why[QM_MEM_PATH_MAX + 128];
    if (!p->src[QM__PSOURCE_SYSTEM] && !p->logged[QM__PSOURCE_SYSTEM]) {
        if (!cfg->auto_budget_pressure_ms)
            say_off(p, QM__PSOURCE_SYSTEM, "PSI (auto_budget_pressure_ms is 0)");
        else if (arm_psi(p, QM__PSOURCE_SYSTEM, "/proc/pressure/memory", why, sizeof why) < 0)
            say_off(p, QM__PSOURCE_SYSTEM, why);
    }
    int moved = mem && strcmp(mem->cgroup, p->cgroup) != 0;
    if (mem && (moved || p->rearm_cgroup)) {
        p->rearm_cgroup = 0;
        source_close(p, QM__PSOURCE_CGROUP);
        if (moved)
            p->logged[QM__PSOURCE_CGROUP] = 0;
        snprintf(p->cgroup, sizeof p->cgroup, "%s", mem->cgroup);
        int rc = 0;
        char path[QM_MEM_PATH_MAX + 32];
        snprintf(path, sizeof path, "%s/memory.pressure", p->cgroup);
        if (!p->cgroup[0])
            snprintf(why, sizeof why, "a memory cgroup (none found)"), rc = -1;
        else if (mem->cgroup_kind == QM_MEM_CGROUP_V2 && !cfg->auto_budget_pressure_ms)
            snprintf(why, sizeof why, "%s (auto_budget_pressure_ms is 0)", path), rc = -1;
        else if (mem->cgroup_kind == QM_MEM_CGROUP_V2)
            rc = arm_psi(p, QM__PSOURCE_CGROUP, path, why, sizeof why);
        else if (strcmp(cfg->auto_budget_pressure_level, "off") == 0)
            snprintf(why, sizeof why, "%s (auto_budget_pressure_level is off)", p->cgroup), rc = -1;
        else
            rc = arm_v1(p, p->cgroup, why, sizeof why);
        if (rc < 0)
            say_off(p, QM__PSOURCE_CGROUP, why);
    }
}

/* No auto session is open: the sources close (a PSI trigger keeps the
 * kernel's monitor polling; the cgroup's registration, two descriptors)
 * until the next auto session arms them again. The test FIFO stays. */
static void disarm_sources(qm_pressure *p)
{
    if (!p->src[QM__PSOURCE_SYSTEM] && !p->src[QM__PSOURCE_CGROUP])
        return;
    p->rearm_cgroup = p->src[QM__PSOURCE_CGROUP] != NULL; /* on the cgroup qmoed is in then */
    source_close(p, QM__PSOURCE_SYSTEM);
    source_close(p, QM__PSOURCE_CGROUP);
    p->pressure_pending = 0;
    qm_log(QM_LOG_DEBUG, "auto budgets: no auto session open, memory pressure sources closed");
}

/* QMOED_TEST_PRESSURE: a FIFO held open from the start, so a test's write
 * never waits for a reader; each write is one event. */
static void arm_test_source(qm_pressure *p)
{
    const char *fifo = getenv("QMOED_TEST_PRESSURE");
    if (!fifo || !*fifo)
        return;
    char why[QM_MEM_PATH_MAX + 128];
    /* Read and write, so the FIFO always has a writer: no endless hang-ups. */
    int fd = open(fifo, O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        snprintf(why, sizeof why, "QMOED_TEST_PRESSURE %.500s: %s", fifo, strerror(errno));
    if (fd < 0 || source_add(p, QM__PSOURCE_TEST, fd, -1, 0, fifo, why, sizeof why) < 0)
        say_off(p, QM__PSOURCE_TEST, why);
}

/* ---- the watcher's resize jobs: session.resize's path, no client ---- */

static int auto_resize_admit(qm_job *job, qm_status *st)
{
    return qm_session_resize_reserve(job->mx->sessions, job->session,
                                     job->req.params.budget_bytes, st);
}

static void auto_resize_run(qm_job *job)
{
    if (qm__job_session_closed(job))
        return;
    job->rc = qm_session_resize(job->session, job->req.params.budget_bytes, &job->st);
    qm_session_stats(job->session, &job->pstats);
}

/* Counts one change of the watcher's in the session's and the daemon's counters. */
static void count_change(qm_counters *c, uint64_t was, uint64_t now)
{
    if (now < was) {
        c->auto_shrinks++;
        c->auto_shrunk_bytes += was - now;
    } else {
        c->auto_grows++;
        c->auto_grown_bytes += now - was;
    }
}

/* Pressure events wait auto_budget_grace_ms from now (qm_pressure.h). */
static void start_grace(qm_pressure *p)
{
    if (p)
        p->grace_until_us = qm_now_us() + (uint64_t)p->mx->cfg->auto_budget_grace_ms * 1000u;
}

static void auto_resize_finish(qm_job *job)
{
    const qm_method_ctx *mx = job->mx;
    qm_session *s = job->session;
    qm_budget_auto *a = qm_session_auto_budget(s);
    uint64_t was = qm_session_budget(s), want = job->req.params.budget_bytes;
    qm_session_resize_finish(mx->sessions, s, job->rc == 0, want);
    a->pending = 0;
    if (qm_session_closed(s))
        return;
    qm_pager_stats before;
    qm_session_note_stats(s, &job->pstats, &before);
    qm_counters_add_paging(qm_session_counters(s), mx->counters, &before, &job->pstats);
    char from[32], to[32];
    qm_mem_bytes_text(was, from, sizeof from);
    qm_mem_bytes_text(want, to, sizeof to);
    if (job->rc < 0) {
        /* Below what its pagers take: it stays, and is not asked again. */
        if (job->rc == QM_ERESOURCE_EXHAUSTED && want < was)
            a->floor = was;
        qm_log(QM_LOG_WARNING, "session %s: auto budget stays %s (asked %s: %s): %s",
               qm_session_id(s), from, to, a->change_why, job->st.msg);
        return;
    }
    count_change(qm_session_counters(s), was, want);
    count_change(mx->counters, was, want);
    if (want > was) { /* the growth's own allocation */
        start_grace(mx->pressure);
        uint64_t now = qm_now_us();
        if (mx->pressure)
            mx->pressure->last_grow_us = now;
        if (a->ceiling && want >= a->ceiling)
            a->ceiling_us = now; /* it holds here a whole wait before it goes higher */
    }
    qm_log(QM_LOG_NOTICE, "session %s: auto budget %s %s -> %s (%s); resident %llu",
           qm_session_id(s), want < was ? "shrank" : "grew", from, to, a->change_why,
           (unsigned long long)qm_session_resident_bytes(s));
}

static void auto_resize_undo(qm_job *job)
{
    qm_session_resize_finish(job->mx->sessions, job->session, 0, 0);
    qm_session_auto_budget(job->session)->pending = 0;
}

static const qm_job_ops auto_resize_ops = {.admit = auto_resize_admit,
                                           .run = auto_resize_run,
                                           .finish = auto_resize_finish,
                                           .undo = auto_resize_undo};

/* Queues the resize of s to `budget` on its FIFO, as session.resize would. */
static void submit_resize(qm_pressure *p, qm_session *s, uint64_t budget)
{
    const qm_method_ctx *mx = p->mx;
    qm_budget_auto *a = qm_session_auto_budget(s);
    qm_job *job = qm_calloc(1, sizeof *job);
    if (!job) {
        qm_log(QM_LOG_WARNING, "session %s: out of memory queueing an auto budget change",
               qm_session_id(s));
        return;
    }
    job->ops = &auto_resize_ops;
    job->mx = mx;
    job->session = s;
    job->req.method = QM_METHOD_SESSION_RESIZE;
    job->req.params.has_budget = 1;
    job->req.params.budget_bytes = budget;
    qm_buf_init(&job->response);
    qm_status st;
    qm_status_clear(&st);
    if (auto_resize_admit(job, &st) < 0) { /* a growth the devices' budgets refuse: retried */
        qm_log(QM_LOG_DEBUG, "session %s: auto budget cannot grow to %llu: %s",
               qm_session_id(s), (unsigned long long)budget, st.msg);
        qm_job_free(job);
        return;
    }
    job->queue = qm_session_queue(s);
    qm_session_ref(s);
    a->pending = 1;
    if (qm_pool_submit(mx->pool, job, mx->cfg->queue_depth) < 0) { /* never: not bounded */
        auto_resize_undo(job);
        qm_session_unref(s);
        qm_job_free(job);
    }
}

/* ---- the step ---- */

/* Why this step changes budgets, for the log lines of its jobs: `b` the
 * bound that set the headroom (NULL: none read), `reserve_free` the part of
 * the reserve it keeps free. */
static void step_reason(const qm_pressure *p, const qm_mem_bound *b, uint64_t reserve_free,
                        int64_t headroom, uint64_t slack, uint64_t wait_us, char *out, size_t cap)
{
    char have[200] = "", res[32], left[32], free_text[32];
    if (b)
        qm_mem_describe(b, have, sizeof have);
    uint64_t reserve = p->mx->cfg->auto_budget_reserve;
    qm_mem_bytes_text(reserve, res, sizeof res);
    qm_mem_bytes_text(reserve_free, left, sizeof left);
    qm_mem_bytes_text(headroom < 0 ? 0 : (uint64_t)headroom, free_text, sizeof free_text);
    if (b && headroom < -(int64_t)slack && reserve_free < reserve)
        snprintf(out, cap, "%s leaves less than the reserve's %s not in use (reserve %s)", have,
                 left, res);
    else if (b && headroom < -(int64_t)slack)
        snprintf(out, cap, "%s leaves less than the reserve %s", have, res);
    else if (p->pressure_pending)
        snprintf(out, cap, "memory pressure");
    else
        snprintf(out, cap, "no memory pressure for %llu s and %s free beyond the reserve",
                 (unsigned long long)(wait_us / 1000000u), free_text);
}

/* The open auto sessions: up to `cap` into s[] and their views into v[]
 * (the target: where quiet growth goes now, qm_budget_grow_target with the
 * wait `wait_us`); *pending when one has a resize of the watcher's queued,
 * *full when every one is at its auto size. */
static size_t auto_sessions(const qm_method_ctx *mx, uint64_t now, uint64_t wait_us, qm_session **s,
                            qm_budget_view *v, size_t cap, int *pending, int *full)
{
    size_t n = 0;
    *pending = 0;
    *full = 1;
    for (qm_session *it = mx->sessions->first; it; it = qm_session_next(it)) {
        qm_budget_auto *a = qm_session_auto_budget(it);
        if (!a->on || qm_session_closed(it))
            continue;
        *pending |= a->pending;
        if (n == cap)
            continue;
        if (!a->floor)
            a->floor = qm_session_min_budget(mx->sessions, it);
        uint64_t budget = qm_session_budget(it);
        *full &= budget >= a->target;
        s[n] = it;
        v[n] = (qm_budget_view){.budget = budget,
                                .target = qm_budget_grow_target(a, budget, now, wait_us),
                                .floor = a->floor,
                                .pending = a->pending};
        n++;
    }
    return n;
}

#define QM__STEP_MAX_SESSIONS 64

/* A relapse's shrinks were queued (their ceilings set): the next growth
 * waits longer (qm_budget.h, "Relapses"). */
static void note_relapse(qm_pressure *p, uint64_t now)
{
    uint32_t after_s = p->mx->cfg->auto_budget_grow_after_s;
    double since = (double)(now - p->last_grow_us) / 1e6;
    if (p->relapses < QM_BUDGET_RELAPSES_MAX)
        p->relapses++;
    p->last_grow_us = 0; /* one relapse a growth */
    qm_log(QM_LOG_NOTICE,
           "auto budgets: memory pressure %.1f s after they grew (relapse %u): "
           "the next growth waits %llu s of quiet and stops at the budget this shrink leaves "
           "until it held there that long",
           since, p->relapses,
           (unsigned long long)(qm_budget_grow_wait_us(after_s, p->relapses) / 1000000u));
}

size_t qm_pressure_step(qm_pressure *p, uint64_t now)
{
    const qm_method_ctx *mx = p->mx;
    const qm_config *cfg = mx->cfg;
    if (p->stopped || !mx->pool || mx->draining(mx->life))
        return 0;
    qm_session *s[QM__STEP_MAX_SESSIONS];
    qm_budget_view v[QM__STEP_MAX_SESSIONS];
    uint64_t next[QM__STEP_MAX_SESSIONS];
    int pending, full;
    uint64_t wait = qm_budget_grow_wait_us(cfg->auto_budget_grow_after_s, p->relapses);
    size_t n = auto_sessions(mx, now, wait, s, v, QM__STEP_MAX_SESSIONS, &pending, &full);
    if (n == 0) {
        p->pressure_pending = 0;
        p->relapses = 0;
        p->last_grow_us = 0;
        disarm_sources(p);
        return 0;
    }
    qm_mem_state mem;
    qm_status st;
    qm_status_clear(&st);
    int have_mem = qm_devices_host_visible(mx->devices) && qm_mem_read(&mem, &st) == 0;
    arm_sources(p, have_mem ? &mem : NULL);
    if (pending) /* the last changes land before the next: no double count */
        return n;
    uint64_t reserve = cfg->auto_budget_reserve;
    uint64_t held = qm_sessions_resident_bytes(mx->sessions);
    uint32_t which = 0;
    int64_t headroom = have_mem ? qm_budget_headroom(&mem, reserve, held, &which) : 0;
    const qm_mem_bound *bound = have_mem && mem.n ? &mem.bounds[which] : NULL;
    /* Half the reserve's free part: a limit lowered by more than that, or
     * the rest grown into it, is given back; less is absorbed. The kernel
     * lets a limit down only as far as what is free (and what it can
     * reclaim), so the band must sit inside that part. */
    uint64_t reserve_free = bound ? qm_budget_reserve_free(bound, reserve, held) : reserve;
    int pressure = p->pressure_pending && now - p->last_step_us >= check_us(p);
    uint64_t calm_since = p->last_pressure_us > p->last_step_us ? p->last_pressure_us
                                                                 : p->last_step_us;
    int quiet = !p->pressure_pending && now - calm_since >= wait;
    uint64_t held_us = qm_budget_grow_wait_us(cfg->auto_budget_grow_after_s, 1);
    if (p->relapses && full && !p->pressure_pending && now - calm_since >= held_us &&
        (!p->last_grow_us || now - p->last_grow_us >= held_us)) {
        p->relapses = 0;
        qm_log(QM_LOG_INFO,
               "auto budgets: at their auto size without memory pressure for %u s: "
               "growth waits %u s again",
               2 * cfg->auto_budget_grow_after_s, cfg->auto_budget_grow_after_s);
    }
    uint64_t slack = reserve_free / 2;
    if (qm_budget_step(headroom, slack, pressure, quiet, cfg->auto_budget_shrink_percent, v, n,
                       next) == 0) {
        if (pressure)
            p->pressure_pending = 0; /* nothing left to give */
        return n;
    }
    char why[200];
    step_reason(p, bound, reserve_free, headroom, slack, wait, why, sizeof why);
    /* A pressure shrink (not a deficit's) soon after a growth: a relapse. */
    int relapse = pressure && headroom >= -(int64_t)slack &&
                  qm_budget_is_relapse(now, p->last_grow_us, cfg->auto_budget_grow_after_s);
    int shrank = 0;
    for (size_t i = 0; i < n; i++) {
        if (next[i] == v[i].budget)
            continue;
        shrank |= next[i] < v[i].budget;
        qm_budget_auto *a = qm_session_auto_budget(s[i]);
        snprintf(a->change_why, sizeof a->change_why, "%s", why);
        if (relapse && next[i] < v[i].budget) {
            a->ceiling = next[i];
            a->ceiling_us = now;
            qm_session_counters(s[i])->auto_relapses++;
            mx->counters->auto_relapses++;
        }
        submit_resize(p, s[i], next[i]);
    }
    if (shrank && relapse)
        note_relapse(p, now);
    if (shrank) {
        p->last_step_us = now;
        p->pressure_pending = 0;
    }
    return n;
}

/* Whether any open session has an auto budget. */
static int any_auto(const qm_method_ctx *mx)
{
    for (qm_session *it = mx->sessions->first; it; it = qm_session_next(it))
        if (qm_session_auto_budget(it)->on && !qm_session_closed(it))
            return 1;
    return 0;
}

/* ---- life ---- */

/* Steps every auto_budget_check_ms while auto budgets exist; with none,
 * the timer stops until qm_pressure_watch. */
static void timer_cb(uv_timer_t *t)
{
    qm_pressure *p = t->data;
    size_t n = p->mx->cfg->auto_budget_check_ms /* 0: only events step (reloadable) */
                   ? qm_pressure_step(p, qm_now_us())
                   : (size_t)any_auto(p->mx);
    if (n == 0 && !p->stopped)
        disarm_sources(p);
    if (n && !p->stopped)
        uv_timer_start(&p->timer, timer_cb, check_us(p) / 1000u, 0);
}

void qm_pressure_watch(qm_pressure *p)
{
    if (!p || !p->started || p->stopped)
        return;
    start_grace(p);
    p->pressure_pending = 0; /* what came while it was built */
    if (!uv_is_active((uv_handle_t *)&p->timer))
        uv_timer_start(&p->timer, timer_cb, check_us(p) / 1000u, 0);
}

void qm_pressure_start(qm_pressure *p, uv_loop_t *loop, const qm_method_ctx *mx)
{
    memset(p, 0, sizeof *p);
    p->mx = mx;
    p->loop = loop;
    uv_timer_init(loop, &p->timer);
    p->timer.data = p;
    uv_timer_start(&p->timer, timer_cb, check_us(p) / 1000u, 0);
    p->started = 1;
    arm_test_source(p);
}

void qm_pressure_stop(qm_pressure *p)
{
    if (!p->started || p->stopped)
        return;
    p->stopped = 1;
    for (int k = 0; k < QM__PSOURCE_COUNT; k++)
        source_close(p, k);
    if (!uv_is_closing((uv_handle_t *)&p->timer))
        uv_close((uv_handle_t *)&p->timer, NULL);
}

void qm_pressure_free(qm_pressure *p)
{
    /* A source whose handle the loop closed without its callback (a stop
     * that never came) still holds its descriptors. */
    for (int k = 0; k < QM__PSOURCE_COUNT; k++) {
        qm__psource *src = p->src[k];
        if (!src)
            continue;
        p->src[k] = NULL;
        close(src->fd);
        if (src->aux_fd >= 0)
            close(src->aux_fd);
        qm_free(src);
    }
}
