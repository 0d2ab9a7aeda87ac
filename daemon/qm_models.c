/* qm_models.c - the loaded models: each bank loaded once, shared by its
 * sessions, reference counted, registered with every device for fast
 * copies, guarded against truncation (qm_sigbus.c). Loop thread only,
 * except qm_model_check. */
#include "qm_models.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_log.h"
#include "qm_sigbus.h"

static void model_save_hotness(qm_model *m)
{
    if (!m->hotness || !m->hotness_path || qm_hotness_records(m->hotness) == m->hotness_saved)
        return;
    qm_status st;
    qm_status_clear(&st);
    if (qm_hotness_save(m->hotness, m->hotness_path, &st) < 0) {
        qm_log(QM_LOG_WARNING, "cannot save the hotness profile of %s: %s", m->name, st.msg);
        return;
    }
    m->hotness_saved = qm_hotness_records(m->hotness);
}

void qm_models_save_hotness(qm_models *ms)
{
    for (qm_model *m = ms->first; m; m = m->next)
        model_save_hotness(m);
}

/* Where the backend can (CUDA: cudaHostRegister), the whole mapping is
 * registered once with every device of the daemon (any of them may hold
 * layers of it: a session's placement), so paging copies are one DMA each
 * instead of going through bounce buffers. A refusal only costs speed (on
 * that device); backends with nothing to register (CPU) answer 0. */
static void model_register_host(const qm_models *ms, qm_model *m)
{
    uint64_t bytes;
    const void *base = qm_bank_mapping(m->bank, &bytes);
    for (uint32_t i = 0; i < ms->devices->n; i++) {
        qm_backend *be = ms->devices->dev[i].backend;
        const char *name = ms->devices->dev[i].name;
        qm_status st;
        qm_status_clear(&st);
        int rc = qm_backend_register_host(be, base, (size_t)bytes, &st);
        if (rc > 0) {
            m->host_registered[m->n_host_registered++] = be;
            qm_log(QM_LOG_INFO, "model %s: %llu mapped bytes registered with %s", m->name,
                   (unsigned long long)bytes, name);
        } else if (rc < 0) {
            qm_log(QM_LOG_WARNING, "model %s: cannot register the mapping with %s (%s); copies "
                   "go through bounce buffers", m->name, name, st.msg);
        }
    }
}

static void model_unregister_host(qm_model *m)
{
    while (m->n_host_registered > 0) {
        qm_backend *be = m->host_registered[--m->n_host_registered];
        qm_status st;
        qm_status_clear(&st);
        if (qm_backend_unregister_host(be, qm_bank_mapping(m->bank, NULL), &st) < 0)
            qm_log(QM_LOG_WARNING, "model %s: cannot unregister the mapping: %s", m->name,
                   st.msg);
        m->host_registered[m->n_host_registered] = NULL;
    }
}

/* ---- the size check and its watch ---- */

/* A watched file's size is checked again after this long whatever the
 * watch saw (inotify misses changes some file systems make remotely). */
#define QM__SIZE_RECHECK_NS 1000000000ull

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void model_watch(qm_models *ms, qm_model *m)
{
    if (!ms->watching)
        return;
    int wd = inotify_add_watch(ms->watch_fd, m->path, IN_MODIFY | IN_ATTRIB | IN_DELETE_SELF);
    if (wd < 0)
        qm_log(QM_LOG_NOTICE, "model %s: no watch on %s (%s): its size is checked on every call",
               m->name, m->path, strerror(errno));
    atomic_store(&m->watch, wd < 0 ? -1 : wd);
}

/* Models of one file share its watch (inotify watches the inode): it goes
 * with the last of them. */
static void model_unwatch(qm_models *ms, qm_model *m)
{
    int wd = atomic_exchange(&m->watch, -1);
    atomic_store(&m->size_fresh, 0);
    if (wd < 0 || !ms->watching)
        return;
    for (qm_model *o = ms->first; o; o = o->next)
        if (o != m && atomic_load(&o->watch) == wd)
            return;
    inotify_rm_watch(ms->watch_fd, wd);
}

static void watch_cb(uv_poll_t *h, int status, int events)
{
    (void)events;
    qm_models *ms = h->data;
    if (status < 0)
        return;
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    ssize_t n;
    while ((n = read(ms->watch_fd, buf, sizeof buf)) > 0) {
        for (char *p = buf; p < buf + n;) {
            const struct inotify_event *ev = (const struct inotify_event *)p;
            for (qm_model *m = ms->first; m; m = m->next) {
                if (atomic_load(&m->watch) != ev->wd)
                    continue;
                atomic_store(&m->size_fresh, 0);
                if (ev->mask & IN_IGNORED) /* the file is gone: its watch too */
                    atomic_store(&m->watch, -1);
            }
            p += sizeof *ev + ev->len;
        }
    }
}

void qm_models_watch(qm_models *ms, uv_loop_t *loop)
{
    if (ms->watching)
        return;
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0) {
        qm_log(QM_LOG_NOTICE, "no inotify (%s): bank files' sizes are checked on every call",
               strerror(errno));
        return;
    }
    if (uv_poll_init(loop, &ms->watch_poll, fd) < 0) {
        close(fd);
        return;
    }
    ms->watch_poll.data = ms;
    uv_poll_start(&ms->watch_poll, UV_READABLE, watch_cb);
    ms->watch_fd = fd;
    ms->watching = 1;
    for (qm_model *m = ms->first; m; m = m->next)
        model_watch(ms, m);
}

int qm_model_check_reads(const qm_model *m, qm_status *st)
{
    if (qm_sigbus_poisoned(m->guard_slot))
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "bank file %.200s was truncated on disk while in use; restore it, "
                             "then unload and load model '%s' again",
                             m->path, m->name);
    return 0;
}

int qm_model_check(qm_model *m, qm_status *st)
{
    int rc = qm_model_check_reads(m, st);
    if (rc < 0)
        return rc;
    uint64_t now = mono_ns();
    if (atomic_load(&m->size_fresh) && now - atomic_load(&m->size_checked_ns) < QM__SIZE_RECHECK_NS)
        return 0;
    /* Fresh before the fstat: a change the watch reports after it makes
     * the next call look again. */
    atomic_store(&m->size_fresh, atomic_load(&m->watch) >= 0);
    rc = qm_bank_check_file(m->bank, st);
    if (rc < 0) {
        atomic_store(&m->size_fresh, 0);
        if (st)
            st->code = QM_EINVALID_MODEL;
        return QM_EINVALID_MODEL;
    }
    atomic_store(&m->size_checked_ns, now);
    return 0;
}

static void model_free(qm_model *m)
{
    if (!m)
        return;
    model_unregister_host(m);
    qm_sigbus_unregister(m->guard_slot);
    model_save_hotness(m);
    qm_hotness_free(m->hotness);
    qm_free(m->hotness_path);
    for (uint32_t i = 0; m->catalogs && i < m->n_layers; i++)
        qm_catalog_free(m->catalogs[i]);
    qm_free(m->catalogs);
    qm_bank_close(m->bank);
    qm_free(m->path);
    qm_free(m);
}

void qm_model_unref(qm_model *m)
{
    if (m && --m->refs == 0)
        model_free(m);
}

qm_model *qm_model_find(const qm_models *ms, const char *name)
{
    for (qm_model *m = ms->first; m; m = m->next)
        if (strcmp(m->name, name) == 0)
            return m;
    return NULL;
}

int qm_model_load(qm_models *ms, const char *name, const char *path, qm_model **out,
                  qm_status *st)
{
    if (qm_model_find(ms, name))
        return qm_status_set_field(st, QM_ECONFLICT, "name",
                                   "a model named '%s' is already loaded; unload it first", name);
    qm_model *m = qm_calloc(1, sizeof *m);
    if (!m)
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    m->guard_slot = -1;
    atomic_init(&m->watch, -1);
    atomic_init(&m->size_fresh, 0);
    atomic_init(&m->size_checked_ns, 0);
    snprintf(m->name, sizeof m->name, "%s", name);
    m->path = qm_strdup(path);
    int rc = m->path ? 0 : qm_status_set(st, QM_ENOMEM, "out of memory");
    /* A FIFO or device would block open(2) on the loop thread: only regular
     * files get that far (the loader checks again on the open fd). */
    struct stat sb;
    if (rc == 0 && stat(path, &sb) < 0)
        rc = qm_status_set(st, QM_EINVALID_MODEL, "cannot open %.200s: %s", path,
                           strerror(errno));
    else if (rc == 0 && !S_ISREG(sb.st_mode))
        rc = qm_status_set(st, QM_EINVALID_MODEL, "%.200s is not a regular file", path);
    if (rc == 0)
        rc = qm_bank_open(path, &m->bank, st);
    if (rc < 0) {
        /* Every way a bank file can be unusable is the client's invalid_model. */
        if (rc != QM_ENOMEM)
            rc = QM_EINVALID_MODEL;
        if (st) {
            st->code = rc;
            snprintf(st->field, sizeof st->field, "path");
        }
        goto free_model;
    }
    uint64_t mapped_bytes;
    const void *mapped = qm_bank_mapping(m->bank, &mapped_bytes);
    m->guard_slot = qm_sigbus_register(mapped, mapped_bytes);
    const qm_bank_config *cfg = qm_bank_get_config(m->bank);
    m->n_layers = cfg->layers;
    m->catalogs = qm_calloc(m->n_layers ? m->n_layers : 1, sizeof *m->catalogs);
    if (!m->catalogs) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory");
        goto free_model;
    }
    for (uint32_t l = 0; l < m->n_layers; l++) {
        rc = qm_bank_build_catalog(m->bank, l, &m->catalogs[l], st);
        if (rc < 0)
            goto free_model;
    }
    /* The profile persists across restarts in the state dir; a missing or
     * mismatched file starts an empty one. */
    qm_hotness_key key;
    qm_hotness_key_of_bank(m->bank, &key);
    char warning[256] = "";
    const char *state_dir = ms->cfg->state_dir;
    if (state_dir) {
        size_t n = strlen(state_dir) + strlen(name) + 8;
        m->hotness_path = qm_malloc(n);
        if (!m->hotness_path) {
            rc = qm_status_set(st, QM_ENOMEM, "out of memory");
            goto free_model;
        }
        snprintf(m->hotness_path, n, "%s/%s.hot", state_dir, name);
        rc = qm_hotness_load(m->hotness_path, &key, QM_HOTNESS_DEFAULT_DECAY, &m->hotness,
                             warning, sizeof warning, st);
    } else {
        rc = qm_hotness_new(&key, QM_HOTNESS_DEFAULT_DECAY, &m->hotness, st);
    }
    if (rc < 0)
        goto free_model;
    if (warning[0])
        qm_log(QM_LOG_WARNING, "model %s: %s", name, warning);
    m->hotness_saved = qm_hotness_records(m->hotness);
    m->bytes_total = qm_bank_expert_bytes_total(m->bank);
    const qm_layer_view *lv = qm_bank_layer(m->bank, 0);
    m->bytes_per_expert = lv ? lv->bytes_per_expert : 0;
    model_register_host(ms, m);
    model_watch(ms, m);
    m->refs = 1;
    m->registered = 1;
    m->next = ms->first;
    ms->first = m;
    ms->n++;
    if (out)
        *out = m;
    return 0;
free_model:
    model_free(m);
    return rc;
}

/* Symlinks and ".." are resolved on both sides before comparing, so a path
 * cannot step out of a directory; the resolved path is what gets opened. */
int qm_model_path_allowed(const qm_models *ms, const char *path, char **resolved,
                          qm_status *st)
{
    *resolved = NULL;
    const char *model_dirs = ms->cfg->model_dirs;
    if (!model_dirs)
        return 0;
    char *real = realpath(path, NULL);
    if (!real)
        return qm_status_set_field(st, QM_EINVALID_MODEL, "path", "cannot open %.200s: %s",
                                   path, strerror(errno));
    const char *dirs = model_dirs;
    while (*dirs) {
        size_t n = strcspn(dirs, ":");
        char dir[4096];
        if (n > 0 && n < sizeof dir) {
            memcpy(dir, dirs, n);
            dir[n] = '\0';
            char *rdir = realpath(dir, NULL);
            if (rdir) {
                size_t rn = strlen(rdir);
                int inside = strncmp(real, rdir, rn) == 0 &&
                             (real[rn] == '/' || (rn == 1 && rdir[0] == '/'));
                free(rdir);
                if (inside) {
                    *resolved = qm_strdup(real);
                    free(real);
                    return *resolved ? 0 : qm_status_set(st, QM_ENOMEM, "out of memory");
                }
            }
        }
        dirs += n;
        if (*dirs == ':')
            dirs++;
    }
    free(real);
    return qm_status_set_field(st, QM_EPERMISSION, "path",
                               "%.200s is outside the directories of config key model_dirs "
                               "(%.200s)",
                               path, model_dirs[0] ? model_dirs : "empty: none");
}

void qm_model_unlink(qm_models *ms, qm_model *m)
{
    for (qm_model **pp = &ms->first; *pp; pp = &(*pp)->next) {
        if (*pp == m) {
            model_unwatch(ms, m);
            *pp = m->next;
            ms->n--;
            m->registered = 0;
            qm_model_unref(m);
            return;
        }
    }
}

void qm_models_free(qm_models *ms)
{
    while (ms->first)
        qm_model_unlink(ms, ms->first);
    if (ms->watching) { /* its poll handle closed with the loop's */
        close(ms->watch_fd);
        ms->watching = 0;
    }
}
