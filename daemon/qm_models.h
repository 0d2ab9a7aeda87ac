/* qm_models.h - the loaded models (qm_models.c), the registry's first list
 * (qm_registry.h): each bank is mapped once, shared by the sessions that
 * use it, reference counted, and freed when unloaded and its last session
 * has let go. Loop thread only, except qm_model_check, which a worker calls
 * around each use of the bank. */
#ifndef QM_MODELS_H
#define QM_MODELS_H

#include <stdatomic.h>
#include <stdint.h>
#include <uv.h>

#include "qm_backend.h"
#include "qm_bank.h"
#include "qm_config.h"
#include "qm_devices.h"
#include "qm_hotness.h"
#include "qm_protocol.h"
#include "qm_residency.h"

typedef struct qm_model {
    char name[QM_NAME_MAX + 1];
    char *path;
    qm_bank *bank;
    qm_region_catalog **catalogs; /* one per layer, bank id = layer */
    uint32_t n_layers;
    uint64_t bytes_total, bytes_per_expert;
    qm_hotness *hotness;    /* decayed use counts; the default hot lists of a policy taking them */
    char *hotness_path;     /* state_dir/<name>.hot, NULL without a state dir */
    uint64_t hotness_saved; /* qm_hotness_records at the last save */
    /* Devices the mapping is registered with (fast copies), in registration
     * order; unregistered in reverse order on unload. */
    qm_backend *host_registered[QM_CONFIG_MAX_DEVICES];
    uint32_t n_host_registered;
    int guard_slot;              /* qm_sigbus_register's slot, or -1 */
    /* The file's size check (qm_model_check): its inotify watch
     * (qm_models_watch), -1 without one; whether the size was found whole
     * since the watch last saw the file change; and when. */
    atomic_int watch;
    atomic_int size_fresh;
    _Atomic uint64_t size_checked_ns;
    int refs;        /* registry + sessions */
    int registered;  /* 0 once unloaded: freed when the last session lets go */
    struct qm_model *next;
} qm_model;

/* The loaded models, newest first. It borrows the configuration
 * (state_dir, model_dirs; reloaded in place) and the devices a mapping is
 * registered with, the daemon's for as long as it lives. */
typedef struct qm_models {
    const qm_config *cfg;
    const qm_devices *devices;
    qm_model *first; /* the next of each is m->next */
    size_t n;
    /* The loop's inotify watch on the models' files (qm_models_watch). */
    int watching;
    int watch_fd;
    uv_poll_t watch_poll;
} qm_models;

/* Watches every model's file (inotify, on `loop`), now and as models load,
 * so that qm_model_check need not fstat the file on every call: only after
 * the watch saw the file change, once a second whatever it saw (a file
 * system whose changes inotify misses), and always for a model without a
 * watch. Without inotify (logged): every call, as before. */
void qm_models_watch(qm_models *ms, uv_loop_t *loop);

/* Maps the bank at path under `name`; *out (may be NULL) is borrowed from
 * the list. */
int qm_model_load(qm_models *ms, const char *name, const char *path, qm_model **out,
                  qm_status *st);
/* model.load's path check against model_dirs: the resolved path (qm_malloc'd)
 * in *resolved, or QM_EPERMISSION naming the key when it lies outside. */
int qm_model_path_allowed(const qm_models *ms, const char *path, char **resolved,
                          qm_status *st);
qm_model *qm_model_find(const qm_models *ms, const char *name); /* borrowed; NULL when none */
void qm_model_unref(qm_model *m);
/* Takes m off the list (unregistered: sessions still holding it keep it
 * until they let go) and drops the list's reference. model.unload is the
 * registry's (qm_registry_unload_model): it closes the sessions first. */
void qm_model_unlink(qm_models *ms, qm_model *m);
/* Unlinks every model (at exit, after every session closed). */
void qm_models_free(qm_models *ms);
/* Saves every model's hotness profile that changed (state_dir set). */
void qm_models_save_hotness(qm_models *ms);
/* Before each use of a model's bank: QM_EINVALID_MODEL when its file was
 * truncated on disk (fstat, when the watch says it may have changed) or a
 * read hit a missing page (qm_sigbus.c). Any thread. */
int qm_model_check(qm_model *m, qm_status *st);
/* After a use: QM_EINVALID_MODEL when one of its reads hit a missing page
 * (a truncation that raced it; what it read before was the file's). */
int qm_model_check_reads(const qm_model *m, qm_status *st);

#endif
