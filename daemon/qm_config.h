/* qm_config.h - the daemon's configuration: flags, the JSON file, SIGHUP
 * reloads (qm_config.c). A qm_config owns its strings (qm_config_free). */
#ifndef QM_CONFIG_H
#define QM_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "qm_error.h"

/* Devices one daemon serves at most (engine/pager/qm_placement.h's limit). */
#define QM_CONFIG_MAX_DEVICES 16
/* The backend value that picks a kind by what opens (qm_devices_open). */
#define QM_CONFIG_BACKEND_AUTO "auto"

typedef struct qm_model_spec {
    char *name, *path;
} qm_model_spec;

typedef struct qm_config {
    char *socket_path;  /* NULL: the PROTOCOL.md default */
    char *config_path;
    qm_model_spec *models;
    size_t n_models;
    /* A kind of the backend registry (engine/backend/qm_backend.h), or "auto": the
     * first device 0 of a kind auto tries that opens, else the host. */
    char backend[16];
    int backend_set;    /* given (flag or file): a device list must agree with it */
    /* The devices (--device cuda:0,cuda:1; config key device): one numbered
     * kind, distinct indexes. n_devices 0: the backend's one device (index 0). */
    uint32_t n_devices;
    uint32_t device_index[QM_CONFIG_MAX_DEVICES];
    char device_kind[16]; /* when n_devices > 0 */
    uint32_t emu_copy_mbps; /* modelled copy bandwidth of the kinds that model one (emu; 0: free) */
    /* Where a paged session's pager reads expert units, a value of the
     * pager's registry (QM_PAGER_SOURCE_*, engine/pager/qm_pager.h): auto
     * (direct on a host-visible backend, i.e. CPU, for sessions with
     * per-expert banks), mmap (the bank's mapping and the page cache),
     * direct (O_DIRECT reads from the bank file into a locked arena; falls
     * back with a logged reason where the file or backend cannot). */
    int paging_source;
    /* How the disk source reads, a value of the pager's registry
     * (QM_PAGER_IO_*): auto or io_uring (io_uring, else a pool of preadv
     * threads, the reason logged), threads, serial (one read at a time, the
     * engine before); io_depth: reads in flight at most per session. */
    int io_engine;
    uint32_t io_depth;
    /* --device-budget: one value for every device, or one per device in
     * device order (n_device_budgets = n_devices). device_budget is the
     * first. */
    int has_device_budget;
    uint64_t device_budget;
    uint64_t device_budgets[QM_CONFIG_MAX_DEVICES];
    uint32_t n_device_budgets;
    char *state_dir;
    uint32_t threads;   /* backend compute threads (0 = cores) */
    uint32_t workers;   /* sessions computed in parallel */
    char *admin_group;
    char *user;     /* drop to this user after binding (when started as root) */
    int allow_root; /* keep running as root without a warning */
    int cpu_repack; /* fast sessions' whole banks in the CPU decode GEMV's r8 layout (default 1) */
    int prefetch_trial; /* paged sessions time whether prefetch pays (default 1; qm_pager_trial.h) */
    int prefetch_park;  /* a wrong guess's read stops at the call it was about (default 1) */
    int record_routing; /* every session records its routing to state_dir/routing-ID.qmtr (default 0) */
    int warm_from_profile; /* a new paging session starts from its model's hottest experts (default 1) */
    char *model_dirs; /* model.load only below these (':'-separated); NULL: anywhere */
    int log_level;
    /* limits */
    uint64_t max_request_bytes;
    uint32_t max_nesting;
    uint32_t max_batch;
    uint32_t max_connections;
    uint32_t max_sessions;
    uint32_t max_connections_per_uid; /* 0 = no bound but max_connections */
    uint32_t max_sessions_per_uid;    /* 0 = no bound but max_sessions */
    uint64_t max_output_bytes; /* per connection: reads pause above it */
    uint32_t queue_depth;      /* jobs queued daemon-wide */
    uint32_t idle_timeout_s;   /* 0 = never */
    uint32_t frame_timeout_s;  /* partial frame / stalled output; 0 = 2 x idle (60 s if none) */
    uint32_t frames_per_wakeup;
    uint32_t drain_timeout_s;
    uint32_t trace_capacity;
    uint64_t session_workspace_bytes;
    uint64_t max_mapped_bytes; /* per session: bytes of its shared-memory maps */
    uint64_t max_trace_bytes;  /* per routing trace file (record_trace, record_routing); 0 = none */
    uint32_t max_rings;        /* call rings open daemon-wide (each a thread) */
    /* An orphaned session (no open connection used it, nothing of it
     * queued) is closed after this long (qm_reclaim.h); 0 = never. */
    uint32_t session_orphan_timeout_s;
    /* Budgets that size themselves (budget "auto"; qm_budget.h): the bytes
     * left to the daemon's own memory, the engine and the page cache; how
     * often the memory bounds are read again (ms, 0 = never); the stall
     * in a 2 s window that makes a PSI pressure trigger (ms, 0 = none) and
     * cgroup v1's pressure level; how far one pressure event shrinks an
     * auto budget (percent of it); how long without pressure before auto
     * budgets grow back (s); how long after an auto budget was made or
     * grown pressure events are not acted on (ms: its own allocation and
     * the engine's loading evict page cache, which the kernel reports as
     * pressure). */
    uint64_t auto_budget_reserve;
    uint32_t auto_budget_check_ms;
    uint32_t auto_budget_pressure_ms;
    char auto_budget_pressure_level[12]; /* low, medium, critical; off: no v1 events */
    uint32_t auto_budget_shrink_percent;
    uint32_t auto_budget_grow_after_s;
    uint32_t auto_budget_grace_ms;
} qm_config;

void qm_config_defaults(qm_config *cfg);
void qm_config_free(qm_config *cfg);
/* Parses argv into cfg (flags win over the file, which is read first).
 * Returns 0, 1 when --help/--version was printed, or negative with st set. */
int qm_config_from_args(qm_config *cfg, int argc, char **argv, qm_status *st);
/* Reads the JSON file; with reload = 1 only the reloadable keys are applied. */
int qm_config_load_file(qm_config *cfg, const char *path, int reload, qm_status *st);
/* SIGHUP: parses argv again as a fresh start would (defaults, today's
 * file, the flags over it) and puts that configuration's reloadable keys
 * into cfg, the rest left as they are: a key taken out of the file goes
 * back to its default, a flag still wins over the file, and a file that
 * does not load changes nothing (negative, st set). */
int qm_config_reload(qm_config *cfg, int argc, char **argv, qm_status *st);
/* The device list against the backend (a list of one kind sets the
 * backend when none was given; another backend is refused, except auto
 * with a list of a kind auto tries) and the number of device_budget values
 * (1 or one per device). Run by qm_config_from_args. */
int qm_config_check_devices(qm_config *cfg, qm_status *st);
int qm_config_add_model(qm_config *cfg, const char *name, const char *path, qm_status *st);

#endif
