/* qm_client_resume.c - sessions a handle brings back when the daemon it
 * used went away (qmoe_client.h, "across a daemon restart"): what
 * re-creating one needs (its session.create params, its maps' memfds, the
 * residency its last session.plan showed), the bank each model may be loaded
 * from again, and qm__client_resume, the one place that reconnects,
 * re-creates and re-maps. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_client_internal.h"

#define QM__BACKOFF_FIRST_MS 20
#define QM__BACKOFF_MAX_MS 500
#define QM__CONFLICT (-32008) /* PROTOCOL.md: the daemon still has the session */
#define QM__NOT_FOUND (-32001)
#define QM__EXHAUSTED (-32003) /* budget: other sessions not reclaimed yet */
#define QM__SHUTTING_DOWN (-32007)

typedef struct qm__kept_map {
    qm_client_map *m; /* the caller's: its id is rewritten when passed again */
    void *data;       /* m->data when kept: a released map is not passed again */
    int fd;           /* the memfd, duplicated */
} qm__kept_map;

struct qm__kept {
    char *id;
    char *params; /* session.create's params as sent (compact JSON) */
    char *model;
    int paged;
    char *warm;         /* the last plan's resident lists as `warm` JSON, or NULL */
    int64_t warm_at_ms; /* when they were read; 0: never */
    uint64_t alive_on;  /* the connection (c->conn_gen) of its last answered layer call */
    uint64_t made_on;   /* the connection it was last made (or found still there) on */
    qm__kept_map *maps;
    size_t n_maps, cap_maps;
};

static int64_t qm__ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Seconds in $name scaled to ms; `dflt` when unset or not a number. */
static int qm__env_ms(const char *name, int dflt)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return dflt;
    char *end;
    double s = strtod(v, &end);
    if (*end || s != s || s > 86400.0 * 24)
        return dflt;
    return s < 0 ? -1 : (int)(s * 1000.0 + 0.5);
}

static void qm__defaults(qm_client_reconnect *o)
{
    memset(o, 0, sizeof(*o));
    o->window_ms = qm__env_ms("QMOED_RECONNECT_S", QM_CLIENT_DEFAULT_RECONNECT_MS);
    if (o->window_ms < 0)
        o->window_ms = 0;
    o->warm_interval_ms = qm__env_ms("QMOED_WARM_INTERVAL_S", QM_CLIENT_DEFAULT_WARM_INTERVAL_MS);
}

int qm__client_resume_init(qm_client *c)
{
    memset(&c->resume, 0, sizeof(c->resume));
    qm__defaults(&c->resume.opt);
    return pthread_mutex_init(&c->resume.lock, NULL) == 0 ? 0 : QM_CLIENT_ENOMEM;
}

static void qm__kept_free(qm__kept *k)
{
    if (!k)
        return;
    for (size_t i = 0; i < k->n_maps; i++)
        close(k->maps[i].fd);
    QM_FREE_ALL(k->maps, k->id, k->params, k->model, k->warm, k);
}

void qm__client_resume_free(qm_client *c)
{
    qm__resume *r = &c->resume;
    for (size_t i = 0; i < r->n_kept; i++)
        qm__kept_free(r->kept[i]);
    qm_free(r->kept);
    for (size_t i = 0; i < r->n_banks; i++) {
        qm_free(r->banks[i].model);
        qm_free(r->banks[i].path);
    }
    qm_free(r->banks);
    pthread_mutex_destroy(&r->lock);
    memset(r, 0, sizeof(*r));
}

void qm_client_get_reconnect(qm_client *c, qm_client_reconnect *out)
{
    if (!c || !out)
        return;
    pthread_mutex_lock(&c->lock);
    *out = c->resume.opt;
    pthread_mutex_unlock(&c->lock);
}

void qm_client_set_reconnect(qm_client *c, const qm_client_reconnect *o)
{
    if (!c)
        return;
    qm_client_reconnect v;
    if (o)
        v = *o;
    else
        qm__defaults(&v);
    if (v.window_ms < 0)
        v.window_ms = 0;
    pthread_mutex_lock(&c->lock);
    c->resume.opt = v;
    pthread_mutex_unlock(&c->lock);
}

uint64_t qm__client_generation(qm_client *c)
{
    pthread_mutex_lock(&c->lock);
    uint64_t g = c->resume.generation;
    pthread_mutex_unlock(&c->lock);
    return g;
}

uint64_t qm_client_restores(qm_client *c) { return c ? qm__client_generation(c) : 0; }

int qm__client_gone(int rc) { return rc == QM_CLIENT_EIO || rc == QM_CLIENT_ENOTRUNNING; }

/* ---- the lists (handle's lock held) ---- */

static qm__kept *qm__find(qm_client *c, const char *id)
{
    for (size_t i = 0; i < c->resume.n_kept; i++)
        if (strcmp(c->resume.kept[i]->id, id) == 0)
            return c->resume.kept[i];
    return NULL;
}

/* Grows *arr (of `size`-byte items) to hold one more; 0 or -1. */
static int qm__room(void **arr, size_t n, size_t *cap, size_t size)
{
    if (n < *cap)
        return 0;
    size_t nc = *cap ? 2 * *cap : 4;
    void *a = qm_realloc(*arr, nc * size);
    if (!a)
        return -1;
    *arr = a;
    *cap = nc;
    return 0;
}

void qm__client_keep(qm_client *c, const char *id, char *params, const char *model, int paged)
{
    qm__kept *k = qm_calloc(1, sizeof(*k));
    if (k) {
        k->params = params;
        params = NULL;
        k->id = qm_strdup(id);
        k->model = qm_strdup(model);
        k->paged = paged;
    }
    pthread_mutex_lock(&c->lock);
    qm__resume *r = &c->resume;
    if (k && k->id && k->model && !qm__find(c, id) &&
        qm__room((void **)&r->kept, r->n_kept, &r->cap_kept, sizeof(*r->kept)) == 0) {
        k->alive_on = k->made_on = c->conn_gen;
        r->kept[r->n_kept++] = k;
        k = NULL;
    }
    pthread_mutex_unlock(&c->lock);
    qm__kept_free(k);
    qm_free(params);
}

void qm__client_unkeep(qm_client *c, const char *id)
{
    qm__kept *gone = NULL;
    pthread_mutex_lock(&c->lock);
    qm__resume *r = &c->resume;
    for (size_t i = 0; i < r->n_kept; i++) {
        if (strcmp(r->kept[i]->id, id) == 0) {
            gone = r->kept[i];
            r->kept[i] = r->kept[--r->n_kept];
            break;
        }
    }
    pthread_mutex_unlock(&c->lock);
    qm__kept_free(gone);
}

/* Drops every member named `key` of the object `o`. */
static void drop_member(qm_cval *o, const char *key)
{
    size_t n = 0;
    for (size_t i = 0; i < o->count; i++) {
        if (o->items[i]->key && strcmp(o->items[i]->key, key) == 0)
            qm_cval_free(o->items[i]);
        else
            o->items[n++] = o->items[i];
    }
    o->count = n;
}

void qm__client_keep_budget(qm_client *c, const char *id, uint64_t budget_bytes,
                            const char *budget)
{
    pthread_mutex_lock(&c->lock);
    qm__kept *k = qm__find(c, id);
    char *text = k ? qm_strdup(k->params) : NULL;
    pthread_mutex_unlock(&c->lock);
    qm_status st = {0};
    qm_cval *p = NULL;
    char *out = NULL;
    if (text && qm_cval_parse(text, strlen(text), &p, &st) == 0 && p->type == QM_CVAL_OBJECT) {
        /* The creation's budget goes, in whichever member it came: the
         * daemon takes one of the two, not both. */
        drop_member(p, "budget");
        drop_member(p, "budget_bytes");
        qm_cval *v = budget ? qm_cval_new_string(budget) : qm_cval_new_number((double)budget_bytes);
        if (v && qm_cval_append(p, budget ? "budget" : "budget_bytes", v) == 0)
            out = qm_cval_print(p, 0, NULL);
    }
    qm_cval_free(p);
    qm_free(text);
    if (!out)
        return; /* no memory: the session comes back with its earlier budget */
    pthread_mutex_lock(&c->lock);
    if ((k = qm__find(c, id)) != NULL) {
        qm_free(k->params);
        k->params = out;
        out = NULL;
    }
    pthread_mutex_unlock(&c->lock);
    qm_free(out);
}

void qm__client_keep_map(qm_client *c, qm_client_map *m, int fd)
{
    int dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (dup_fd < 0)
        return; /* not passed again: the restoration fails on its first mapped call */
    pthread_mutex_lock(&c->lock);
    qm__kept *k = qm__find(c, m->session);
    if (k && qm__room((void **)&k->maps, k->n_maps, &k->cap_maps, sizeof(*k->maps)) == 0) {
        k->maps[k->n_maps++] = (qm__kept_map){m, m->data, dup_fd};
        dup_fd = -1;
    }
    pthread_mutex_unlock(&c->lock);
    if (dup_fd >= 0)
        close(dup_fd);
}

void qm__client_unkeep_map(qm_client *c, const qm_client_map *m)
{
    int fd = -1;
    pthread_mutex_lock(&c->lock);
    qm__kept *k = qm__find(c, m->session);
    for (size_t i = 0; k && i < k->n_maps; i++) {
        if (k->maps[i].m == m) {
            fd = k->maps[i].fd;
            k->maps[i] = k->maps[--k->n_maps];
            break;
        }
    }
    pthread_mutex_unlock(&c->lock);
    if (fd >= 0)
        close(fd);
}

int qm_client_set_model_bank(qm_client *c, const char *model, const char *bank_path,
                             qm_client_error *err)
{
    if (err)
        memset(err, 0, sizeof(*err));
    if (!c || !model)
        return qm__client_fail(err, QM_CLIENT_EINVAL, "no client handle or model name given");
    char *m = qm_strdup(model), *p = bank_path ? qm_strdup(bank_path) : NULL;
    if (!m || (bank_path && !p)) {
        qm_free(m);
        qm_free(p);
        return qm__client_fail(err, QM_CLIENT_ENOMEM, "out of memory");
    }
    int rc = 0;
    pthread_mutex_lock(&c->lock);
    qm__resume *r = &c->resume;
    size_t i = 0;
    while (i < r->n_banks && strcmp(r->banks[i].model, model) != 0)
        i++;
    if (i < r->n_banks) {
        qm_free(r->banks[i].path);
        qm_free(m);
        r->banks[i].path = p;
        m = p = NULL;
        if (!r->banks[i].path) { /* forgotten */
            qm_free(r->banks[i].model);
            r->banks[i] = r->banks[--r->n_banks];
        }
    } else if (p && qm__room((void **)&r->banks, r->n_banks, &r->cap_banks,
                             sizeof(*r->banks)) == 0) {
        r->banks[r->n_banks++] = (qm__bank_path){m, p};
        m = p = NULL;
    } else if (p) {
        rc = QM_CLIENT_ENOMEM;
    }
    pthread_mutex_unlock(&c->lock);
    qm_free(m);
    qm_free(p);
    return rc < 0 ? qm__client_fail(err, rc, "out of memory") : 0;
}

/* ---- residency: the last plan's resident experts ---- */

/* `[{"layer":L,"experts":[...]}, ...]` of every bank with resident_now, or
 * NULL (none, or no memory). */
static char *qm__warm_of(const qm_cval *plan)
{
    const qm_cval *banks = qm_cval_get(plan, "banks");
    qm_cval *list = qm_cval_new(QM_CVAL_ARRAY);
    for (size_t i = 0; list && banks && i < banks->count; i++) {
        const qm_cval *b = qm_cval_at(banks, i), *now = qm_cval_get(b, "resident_now");
        uint64_t layer;
        if (!now || now->type != QM_CVAL_ARRAY || now->count == 0 ||
            qm_cval_get_u64(b, "layer", &layer) < 0)
            continue;
        qm_cval *e = qm_cval_new(QM_CVAL_OBJECT), *ex = qm_cval_new(QM_CVAL_ARRAY);
        int bad = !e || !ex || qm_cval_append(e, "layer", qm_cval_new_number((double)layer)) < 0;
        for (size_t j = 0; !bad && j < now->count; j++) {
            const qm_cval *x = qm_cval_at(now, j);
            bad = !x || x->type != QM_CVAL_NUMBER ||
                  qm_cval_append(ex, NULL, qm_cval_new_number(x->number)) < 0;
        }
        if (!bad) {
            bad = qm_cval_append(e, "experts", ex) < 0;
            ex = NULL;
        }
        if (bad || qm_cval_append(list, NULL, e) < 0) {
            qm_cval_free(ex);
            qm_cval_free(e);
            qm_cval_free(list);
            return NULL;
        }
    }
    char *text = list && list->count ? qm_cval_print(list, 0, NULL) : NULL;
    qm_cval_free(list);
    return text;
}

void qm__client_note_call(qm_client *c, const char *session, uint64_t answered_on)
{
    int64_t now = qm__ms();
    pthread_mutex_lock(&c->lock);
    const qm_client_reconnect *o = &c->resume.opt;
    qm__kept *k = qm__find(c, session);
    /* The connection that answered, not the one there is now: another
     * thread may have reconnected to a new daemon since, which lacks the
     * session until it is restored (taking that one for this session's
     * made its "no such session" look final, and its calls failed until
     * the next restart). */
    if (k)
        k->alive_on = answered_on ? answered_on : c->conn_gen;
    if (o->window_ms <= 0 || o->warm_interval_ms < 0)
        k = NULL;
    int due = k && k->paged && (k->warm_at_ms == 0 || now - k->warm_at_ms >= o->warm_interval_ms);
    if (due)
        k->warm_at_ms = now; /* a failed read waits its interval too */
    pthread_mutex_unlock(&c->lock);
    if (!due)
        return;
    qm_cval *p = qm_cval_new(QM_CVAL_OBJECT), *r = NULL;
    if (!p || qm_cval_append(p, "session", qm_cval_new_string(session)) < 0) {
        qm_cval_free(p);
        return;
    }
    if (qm__client_call(c, "session.plan", p, &r, NULL) < 0)
        return; /* the next layer call meets whatever this met */
    char *warm = qm__warm_of(r);
    qm_cval_free(r);
    pthread_mutex_lock(&c->lock);
    if ((k = qm__find(c, session)) != NULL && warm) {
        qm_free(k->warm);
        k->warm = warm;
        warm = NULL;
    }
    pthread_mutex_unlock(&c->lock);
    qm_free(warm);
}

/* ---- the restoration ---- */

/* What one restoration works from: a copy taken under the handle's lock. */
typedef struct qm__snap {
    const char *id;
    char *params, *model, *warm, *bank;
    qm__kept_map *maps; /* the fds are the kept ones (not duplicated): the
                         * session cannot close while its call waits here */
    size_t n_maps;
    int created;   /* this restoration made the session: its maps must follow */
    size_t mapped; /* maps passed since the session was last made */
    uint64_t warmed;
    int loaded; /* the bank was loaded again */
} qm__snap;

static void qm__snap_free(qm__snap *s)
{
    QM_FREE_ALL(s->params, s->model, s->warm, s->bank, s->maps);
}

/* 0, -1 when the session is not kept, QM_CLIENT_ENOMEM. */
static int qm__snap_take(qm_client *c, const char *id, qm__snap *s)
{
    memset(s, 0, sizeof(*s));
    s->id = id;
    int rc = 0;
    pthread_mutex_lock(&c->lock);
    qm__kept *k = qm__find(c, id);
    if (!k) {
        rc = -1;
    } else {
        s->params = qm_strdup(k->params);
        s->model = qm_strdup(k->model);
        s->warm = k->warm ? qm_strdup(k->warm) : NULL;
        for (size_t i = 0; i < c->resume.n_banks; i++)
            if (strcmp(c->resume.banks[i].model, k->model) == 0)
                s->bank = qm_strdup(c->resume.banks[i].path);
        s->maps = qm_calloc(k->n_maps ? k->n_maps : 1, sizeof(*s->maps));
        if (s->maps && k->n_maps) /* a session without maps has none (NULL) to copy */
            memcpy(s->maps, k->maps, k->n_maps * sizeof(*s->maps));
        s->n_maps = k->n_maps;
        if (!s->params || !s->model || (k->warm && !s->warm) || !s->maps)
            rc = QM_CLIENT_ENOMEM;
    }
    pthread_mutex_unlock(&c->lock);
    return rc;
}

static void qm__say(qm_client *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void qm__say(qm_client *c, const char *fmt, ...)
{
    void (*log)(void *, const char *) = c->resume.opt.log;
    if (!log)
        return;
    char line[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    log(c->resume.opt.log_ud, line);
}

/* session.create under the kept id with its params and residency. */
static int qm__recreate(qm_client *c, qm__snap *s, qm_client_error *e)
{
    qm_status st = {0};
    qm_cval *p = NULL, *warm = NULL, *r = NULL;
    int bad = qm_cval_parse(s->params, strlen(s->params), &p, &st) < 0;
    if (!bad && s->warm)
        bad = qm_cval_parse(s->warm, strlen(s->warm), &warm, &st) < 0;
    if (!bad)
        bad = qm_cval_append(p, "session", qm_cval_new_string(s->id)) < 0;
    if (!bad && warm) {
        bad = qm_cval_append(p, "warm", warm) < 0; /* taken either way */
        warm = NULL;
    }
    if (bad) {
        qm_cval_free(warm);
        qm_cval_free(p);
        return qm__client_fail(e, QM_CLIENT_ENOMEM, "out of memory re-creating a session");
    }
    int rc = qm__client_call(c, "session.create", p, &r, e);
    if (rc == 0) {
        s->created = 1;
        s->mapped = 0;
        qm_cval_get_u64(r, "warmed", &s->warmed);
    }
    qm_cval_free(r);
    return rc;
}

/* The session's maps passed again; each caller's map gets its new id. */
static int qm__remap(qm_client *c, qm__snap *s, qm_client_error *e)
{
    for (; s->mapped < s->n_maps; s->mapped++) {
        size_t i = s->mapped;
        qm_client_map *m = s->maps[i].m;
        if (m->data != s->maps[i].data)
            continue; /* released by the caller meanwhile */
        qm_cval *p = qm_cval_new(QM_CVAL_OBJECT), *r = NULL;
        if (!p || qm_cval_append(p, "session", qm_cval_new_string(s->id)) < 0 ||
            qm_cval_append(p, "bytes", qm_cval_new_number((double)m->bytes)) < 0) {
            qm_cval_free(p);
            return qm__client_fail(e, QM_CLIENT_ENOMEM, "out of memory passing a map again");
        }
        uint64_t id = 0;
        int rc = qm__client_call_fd(c, "session.map", p, s->maps[i].fd, &r, e);
        if (rc == 0 && qm_cval_get_u64(r, "map", &id) < 0)
            rc = qm__client_fail(e, QM_CLIENT_EPROTO, "qmoed's answer to session.map lacks map");
        qm_cval_free(r);
        if (rc < 0)
            return rc;
        m->id = id;
    }
    return 0;
}

/* model.load of the bank known for the session's model (admin). */
static int qm__load_bank(qm_client *c, const qm__snap *s, qm_client_error *e)
{
    qm_cval *p = qm_cval_new(QM_CVAL_OBJECT), *r = NULL;
    if (!p || qm_cval_append(p, "name", qm_cval_new_string(s->model)) < 0 ||
        qm_cval_append(p, "path", qm_cval_new_string(s->bank)) < 0) {
        qm_cval_free(p);
        return qm__client_fail(e, QM_CLIENT_ENOMEM, "out of memory loading a model again");
    }
    int rc = qm__client_call(c, "model.load", p, &r, e);
    qm_cval_free(r);
    return rc;
}

/* 1 when a failure of one attempt may pass: the daemon not back yet (or
 * gone again), its model not loaded yet, its budget still held by sessions
 * it has not reclaimed, a drain. */
static int qm__transient(int rc, const qm_client_error *e)
{
    return qm__client_gone(rc) || rc == QM_CLIENT_ETIMEDOUT || rc == QM__EXHAUSTED ||
           rc == QM__SHUTTING_DOWN || (rc == QM__NOT_FOUND && strcmp(e->field, "model") == 0);
}

/* One attempt: the session (re-created, or still there), its model loaded
 * again when it is missing and a bank is known, its maps (those not passed
 * yet since it was made: an attempt cut short by the daemon going again
 * re-creates it, one cut short by the connection alone carries on). */
static int qm__attempt(qm_client *c, qm__snap *s, qm_client_error *e)
{
    int rc = qm__recreate(c, s, e);
    if (rc == QM__NOT_FOUND && strcmp(e->field, "model") == 0 && s->bank) {
        int lrc = qm__load_bank(c, s, e);
        if (lrc < 0 && lrc != QM__CONFLICT) /* conflict: another engine loaded it */
            return lrc;
        s->loaded = 1;
        rc = qm__recreate(c, s, e);
    }
    if (rc == QM__CONFLICT && !s->created)
        return 0; /* the daemon never went: the session and its maps are there */
    if (rc < 0 && rc != QM__CONFLICT)
        return rc;
    if ((rc = qm__remap(c, s, e)) < 0)
        return rc;
    /* And whatever else the session had in the daemon, after its maps: a
     * call ring opened by the caller (one the handle opens itself comes
     * back with the retried call). A refusal leaves the socket. */
    pthread_mutex_lock(&c->lock);
    int ring = qm__client_ring_reopen_due(c, s->id);
    pthread_mutex_unlock(&c->lock);
    rc = ring ? qm_client_session_ring(c, s->id, e) : 0;
    return qm__client_gone(rc) || rc == QM_CLIENT_ETIMEDOUT ? rc : 0;
}

/* Waits `ms`, or less when the window ends sooner; 0 when time is left. */
static int qm__backoff(int64_t deadline, int *delay)
{
    int64_t left = deadline - qm__ms();
    if (left <= 0)
        return -1;
    int64_t ms = *delay < left ? *delay : left;
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
    *delay = *delay * 2 > QM__BACKOFF_MAX_MS ? QM__BACKOFF_MAX_MS : *delay * 2;
    return 0;
}

/* Tries until the window passes; each call's timeout is bounded by what is
 * left of it. 0, or the last attempt's code. */
static int qm__restore(qm_client *c, qm__snap *s, int window_ms, qm_client_error *e)
{
    int64_t deadline = qm__ms() + window_ms;
    int delay = QM__BACKOFF_FIRST_MS, rc;
    pthread_mutex_lock(&c->lock);
    int timeout = c->timeout_ms;
    pthread_mutex_unlock(&c->lock);
    do {
        int64_t left = deadline - qm__ms();
        pthread_mutex_lock(&c->lock);
        c->timeout_ms = left < timeout ? (int)(left > 100 ? left : 100) : timeout;
        pthread_mutex_unlock(&c->lock);
        rc = qm__attempt(c, s, e);
    } while (rc < 0 && qm__transient(rc, e) && qm__backoff(deadline, &delay) == 0);
    pthread_mutex_lock(&c->lock);
    c->timeout_ms = timeout;
    pthread_mutex_unlock(&c->lock);
    return rc;
}

/* Whether `rc` (with `e`) says the daemon that had `session` is gone:
 * a broken or refused connection, a daemon draining, or no such session on
 * a connection made since the session last answered a layer call (handle's
 * lock held). */
static int qm__went_away(qm_client *c, const char *session, int rc, const qm_client_error *e)
{
    /* Gone, or going: a draining daemon (systemctl restart, an upgrade)
     * answers shutting_down, and the next one takes the session. */
    if (qm__client_gone(rc) || rc == QM__SHUTTING_DOWN)
        return 1;
    if (rc != QM__NOT_FOUND || !e || strcmp(e->field, "session") != 0)
        return 0;
    qm__kept *k = qm__find(c, session);
    return k && k->alive_on != c->conn_gen;
}

int qm__client_resume(qm_client *c, const char *session, uint64_t gen, int rc,
                      qm_client_error *err)
{
    if (!session)
        return rc;
    pthread_mutex_lock(&c->lock);
    int away = qm__went_away(c, session, rc, err);
    pthread_mutex_unlock(&c->lock);
    if (!away)
        return rc;
    pthread_mutex_lock(&c->resume.lock);
    pthread_mutex_lock(&c->lock);
    int window = c->resume.opt.window_ms;
    uint64_t now_gen = c->resume.generation;
    const qm__kept *kept = qm__find(c, session);
    int made_here = kept && kept->made_on == c->conn_gen;
    pthread_mutex_unlock(&c->lock);
    /* Another thread brought this session back meanwhile (on the connection
     * there is now). One that brought back another session of the handle
     * did not: this one is restored too (it used to be taken as back, and
     * its retry met "no such session"). */
    if (now_gen != gen && made_here) {
        pthread_mutex_unlock(&c->resume.lock);
        return 0;
    }
    qm__snap s;
    int taken = window > 0 ? qm__snap_take(c, session, &s) : -1;
    if (taken < 0) {
        if (taken != -1)
            qm__snap_free(&s);
        pthread_mutex_unlock(&c->resume.lock);
        return rc;
    }
    qm_client_error why = {0}, e = {0};
    if (err)
        why = *err;
    qm__say(c, "qmoed at %s went away (%s): bringing session %s back, for up to %.1f s",
            c->path, why.reason, session, window / 1000.0);
    int64_t t0 = qm__ms();
    int got = qm__restore(c, &s, window, &e);
    double took = (double)(qm__ms() - t0) / 1000.0;
    if (got == 0) {
        pthread_mutex_lock(&c->lock);
        c->resume.generation++;
        qm__kept *k = qm__find(c, session);
        if (k)
            k->made_on = c->conn_gen;
        pthread_mutex_unlock(&c->lock);
        qm__say(c,
                "qmoed at %s: session %s is back after %.2f s (%s; %zu map%s passed again; "
                "%llu experts warm); retrying the call",
                c->path, session, took,
                !s.created ? "the daemon still had it"
                           : s.loaded ? "re-created, its model loaded again from its bank"
                                      : "re-created",
                s.created ? s.n_maps : 0, s.created && s.n_maps == 1 ? "" : "s",
                (unsigned long long)s.warmed);
    } else {
        qm__say(c, "qmoed at %s: giving up on session %s after %.1f s: %s", c->path, session,
                took, e.reason);
        if (err)
            *err = why;
    }
    qm__snap_free(&s);
    pthread_mutex_unlock(&c->resume.lock);
    return got == 0 ? 0 : rc;
}

int qm__client_map_again(qm_client *c, const char *session, const qm_client_map *m,
                         uint64_t failed_id, int rc, const qm_client_error *err)
{
    size_t n = err ? strlen(err->field) : 0;
    if (rc != QM__NOT_FOUND || !session || !m || n < 4 || strcmp(err->field + n - 4, ".map") != 0)
        return rc;
    pthread_mutex_lock(&c->resume.lock);
    pthread_mutex_lock(&c->lock);
    qm_client_map *kept_m = NULL;
    int fd = -1;
    const qm__kept *k = qm__find(c, session);
    for (size_t i = 0; k && i < k->n_maps; i++)
        if (k->maps[i].m == m && m->data == k->maps[i].data) {
            kept_m = k->maps[i].m;
            fd = fcntl(k->maps[i].fd, F_DUPFD_CLOEXEC, 3);
            break;
        }
    pthread_mutex_unlock(&c->lock);
    int got = rc;
    if (kept_m && m->id != failed_id) {
        got = 0; /* another thread passed it again meanwhile */
    } else if (kept_m && fd >= 0) {
        qm_cval *p = qm_cval_new(QM_CVAL_OBJECT), *r = NULL;
        qm_client_error e = {0};
        uint64_t id = 0;
        if (!p || qm_cval_append(p, "session", qm_cval_new_string(session)) < 0 ||
            qm_cval_append(p, "bytes", qm_cval_new_number((double)m->bytes)) < 0) {
            qm_cval_free(p); /* out of memory: the call fails as it did */
        } else if (qm__client_call_fd(c, "session.map", p, fd, &r, &e) == 0 &&
                   qm_cval_get_u64(r, "map", &id) == 0) {
            kept_m->id = id;
            got = 0;
            qm__say(c, "qmoed at %s no longer held map %llu of session %s (reclaimed: this "
                    "handle's connection had been closed for a while); passed it again as map "
                    "%llu, retrying the call",
                    c->path, (unsigned long long)failed_id, session, (unsigned long long)id);
        }
        qm_cval_free(r);
    }
    if (fd >= 0)
        close(fd);
    pthread_mutex_unlock(&c->resume.lock);
    return got;
}
