/* qm_config.c - flags, the JSON config file, and SIGHUP reloads.
 *
 * Precedence: built-in defaults < config file < command-line flags. On
 * SIGHUP only the reloadable keys (limits, log level, admin group) are read
 * again; the socket, backend, budget and threads need a restart. */
#include "qm_config.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_backend.h"
#include "qm_log.h"
#include "qm_pager.h"
#include "qm_protocol.h"

/* "auto, mmap or direct" (sep, last) from one of the pager's registries of
 * option names (qm_pager_source_at, qm_pager_io_at), in its order. */
static const char *option_names(const char *(*at)(size_t, int *), char *out, size_t cap,
                                const char *sep, const char *last)
{
    size_t len = 0, n = 0;
    while (at(n, NULL))
        n++;
    out[0] = '\0';
    for (size_t i = 0; i < n && len < cap; i++)
        len += (size_t)snprintf(out + len, cap - len, "%s%s", i == 0 ? "" : i + 1 == n ? last : sep,
                                at(i, NULL));
    return out;
}

void qm_config_defaults(qm_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    /* The host's kind (the registry's first with QM_BACKEND_CAP_HOST). */
    for (size_t i = qm_backend_kind_count(); i-- > 0;)
        if (qm_backend_kind_caps(i) & QM_BACKEND_CAP_HOST)
            snprintf(cfg->backend, sizeof cfg->backend, "%s", qm_backend_kind_name(i));
    cfg->paging_source = QM_PAGER_SOURCE_AUTO;
    cfg->io_engine = QM_PAGER_IO_AUTO;
    cfg->io_depth = QM_PAGER_IO_DEPTH_DEFAULT;
    cfg->cpu_repack = 1;
    cfg->prefetch_trial = 1;
    cfg->prefetch_park = 1;
    cfg->warm_from_profile = 1;
    cfg->workers = 2;
    cfg->log_level = QM_LOG_INFO;
    cfg->max_request_bytes = QM_DEFAULT_MAX_REQUEST_BYTES;
    cfg->max_nesting = QM_DEFAULT_MAX_NESTING;
    cfg->max_batch = QM_DEFAULT_MAX_BATCH;
    cfg->max_connections = 256;
    cfg->max_sessions = 64;
    cfg->max_output_bytes = 64ull << 20;
    cfg->queue_depth = 1024;
    cfg->idle_timeout_s = 300;
    cfg->frames_per_wakeup = 32;
    cfg->drain_timeout_s = 10;
    cfg->trace_capacity = 4096;
    cfg->session_workspace_bytes = 16ull << 20;
    cfg->max_mapped_bytes = 1ull << 30;
    cfg->max_trace_bytes = 1ull << 30;
    cfg->max_rings = 64;
    cfg->session_orphan_timeout_s = 300;
    cfg->auto_budget_reserve = 256ull << 20;
    cfg->auto_budget_check_ms = 1000;
    cfg->auto_budget_pressure_ms = 200;
    snprintf(cfg->auto_budget_pressure_level, sizeof cfg->auto_budget_pressure_level, "medium");
    cfg->auto_budget_shrink_percent = 10;
    cfg->auto_budget_grow_after_s = 30;
    cfg->auto_budget_grace_ms = 3000;
}

void qm_config_free(qm_config *cfg)
{
    qm_free(cfg->socket_path);
    qm_free(cfg->config_path);
    for (size_t i = 0; i < cfg->n_models; i++) {
        qm_free(cfg->models[i].name);
        qm_free(cfg->models[i].path);
    }
    qm_free(cfg->models);
    qm_free(cfg->state_dir);
    qm_free(cfg->admin_group);
    qm_free(cfg->user);
    qm_free(cfg->model_dirs);
    memset(cfg, 0, sizeof *cfg);
}

int qm_config_add_model(qm_config *cfg, const char *name, const char *path, qm_status *st)
{
    for (size_t i = 0; i < cfg->n_models; i++) {
        if (strcmp(cfg->models[i].name, name) == 0) {
            /* A flag overrides the file's entry of the same name. */
            char *p = qm_strdup(path);
            if (!p)
                return qm_status_set(st, QM_ENOMEM, "out of memory");
            qm_free(cfg->models[i].path);
            cfg->models[i].path = p;
            return 0;
        }
    }
    qm_model_spec *m = qm_realloc(cfg->models, (cfg->n_models + 1) * sizeof *m);
    if (!m)
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    cfg->models = m;
    m[cfg->n_models].name = qm_strdup(name);
    m[cfg->n_models].path = qm_strdup(path);
    if (!m[cfg->n_models].name || !m[cfg->n_models].path) {
        qm_free(m[cfg->n_models].name);
        qm_free(m[cfg->n_models].path);
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    }
    cfg->n_models++;
    return 0;
}

/* "64MiB", "1G", "4096": bytes with an optional binary suffix. */
static int parse_bytes(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || s[0] == '-')
        return QM_EINVAL;
    unsigned shift = 0;
    if (*end == 'K' || *end == 'k')
        shift = 10;
    else if (*end == 'M' || *end == 'm')
        shift = 20;
    else if (*end == 'G' || *end == 'g')
        shift = 30;
    else if (*end == 'T' || *end == 't')
        shift = 40;
    if (shift) {
        end++;
        if (strcmp(end, "iB") == 0 || strcmp(end, "B") == 0 || strcmp(end, "") == 0)
            end += strlen(end);
        if (v > (UINT64_MAX >> shift))
            return QM_EINVAL;
        v <<= shift;
    }
    if (*end)
        return QM_EINVAL;
    *out = v;
    return 0;
}

static int set_string(char **slot, const char *v, qm_status *st)
{
    char *p = qm_strdup(v);
    if (!p)
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    qm_free(*slot);
    *slot = p;
    return 0;
}

/* "cuda:0,cuda:1": KIND:INDEX entries of one numbered kind of the backend
 * registry, distinct indexes. */
static int parse_devices(qm_config *cfg, const char *text, qm_status *st)
{
    char kinds[96], usage[192];
    const char *example = "KIND";
    for (size_t i = qm_backend_kind_count(); i-- > 0;)
        if (qm_backend_kind_caps(i) & QM_BACKEND_CAP_NUMBERED)
            example = qm_backend_kind_name(i); /* the first numbered kind */
    qm_backend_kind_names(QM_BACKEND_CAP_NUMBERED, ", ", " or ", kinds, sizeof kinds);
    snprintf(usage, sizeof usage,
             "expected KIND:INDEX[,KIND:INDEX...] with KIND %s (e.g. %.16s:0,%.16s:1)", kinds,
             example, example);
    if (!*text)
        return qm_status_set_field(st, QM_EINVAL, "device", "device list is empty; %s", usage);
    uint32_t n = 0;
    char kind[8] = "";
    for (const char *p = text;; p++) {
        size_t len = strcspn(p, ",");
        char entry[32];
        if (len == 0)
            return qm_status_set_field(st, QM_EINVAL, "device",
                                       "device list '%.64s': entry %u is empty; %s", text, n + 1,
                                       usage);
        snprintf(entry, sizeof entry, "%.*s", (int)(len < 31 ? len : 31), p);
        if (n == QM_CONFIG_MAX_DEVICES)
            return qm_status_set_field(st, QM_EINVAL, "device",
                                       "device list '%.64s' names more than %d devices", text,
                                       QM_CONFIG_MAX_DEVICES);
        const char *colon = memchr(p, ':', len);
        size_t klen = colon ? (size_t)(colon - p) : len;
        int k = qm_backend_kind_find(p, klen);
        if (k < 0 || !(qm_backend_kind_caps((size_t)k) & QM_BACKEND_CAP_NUMBERED))
            return qm_status_set_field(st, QM_EINVAL, "device",
                                       "device '%s': unknown kind '%.*s'; %s", entry,
                                       (int)(klen < 16 ? klen : 16), p, usage);
        const char *digits = colon ? colon + 1 : p + len;
        char *end = (char *)digits;
        unsigned long idx = 0;
        errno = 0;
        if (digits < p + len && *digits >= '0' && *digits <= '9')
            idx = strtoul(digits, &end, 10);
        if (digits == p + len || end != p + len || errno || idx > 255)
            return qm_status_set_field(st, QM_EINVAL, "device",
                                       "device '%s': the index must be a number 0..255; %s",
                                       entry, usage);
        if (n == 0)
            snprintf(kind, sizeof kind, "%.*s", (int)klen, p);
        else if (strncmp(kind, p, klen) != 0 || kind[klen] != '\0')
            return qm_status_set_field(st, QM_EINVAL, "device",
                                       "device '%s': the list mixes kinds (%s and %.*s); one "
                                       "kind per daemon",
                                       entry, kind, (int)klen, p);
        for (uint32_t i = 0; i < n; i++)
            if (cfg->device_index[i] == idx)
                return qm_status_set_field(st, QM_EINVAL, "device",
                                           "device '%s' is listed twice", entry);
        cfg->device_index[n++] = (uint32_t)idx;
        p += len;
        if (!*p)
            break;
    }
    cfg->n_devices = n;
    snprintf(cfg->device_kind, sizeof cfg->device_kind, "%s", kind);
    return 0;
}

/* "8G" (every device) or "8G,4G" (one per device, in device order). */
static int parse_budgets(qm_config *cfg, const char *text, qm_status *st)
{
    uint32_t n = 0;
    for (const char *p = text;; p++) {
        size_t len = strcspn(p, ",");
        char one[32];
        uint64_t v;
        if (n == QM_CONFIG_MAX_DEVICES)
            return qm_status_set_field(st, QM_EINVAL, "device_budget",
                                       "device_budget '%.64s': at most %d values of bytes",
                                       text, QM_CONFIG_MAX_DEVICES);
        int too_long = len >= sizeof one;
        memcpy(one, p, too_long ? 0 : len);
        one[too_long ? 0 : len] = '\0';
        if (too_long || parse_bytes(one, &v) < 0 || v == 0)
            return qm_status_set_field(st, QM_EINVAL, "device_budget",
                                       "device_budget '%.64s': value %u must be a positive "
                                       "number of bytes (K/M/G suffixes), one for every device "
                                       "or one per device separated by commas",
                                       text, n + 1);
        cfg->device_budgets[n++] = v;
        p += len;
        if (!*p)
            break;
    }
    cfg->n_device_budgets = n;
    cfg->has_device_budget = 1;
    cfg->device_budget = cfg->device_budgets[0];
    return 0;
}

int qm_config_check_devices(qm_config *cfg, qm_status *st)
{
    if (cfg->n_devices) {
        /* auto takes a list of a kind it tries (and falls back to the host). */
        int k = qm_backend_kind_find(cfg->device_kind, strlen(cfg->device_kind));
        int auto_ok = strcmp(cfg->backend, QM_CONFIG_BACKEND_AUTO) == 0 && k >= 0 &&
                      (qm_backend_kind_caps((size_t)k) & QM_BACKEND_CAP_AUTO);
        if (!cfg->backend_set)
            snprintf(cfg->backend, sizeof cfg->backend, "%s", cfg->device_kind);
        else if (strcmp(cfg->backend, cfg->device_kind) && !auto_ok)
            return qm_status_set_field(st, QM_EINVAL, "device",
                                       "device %s:%u needs backend %s (or no backend given); "
                                       "backend is %s",
                                       cfg->device_kind, cfg->device_index[0], cfg->device_kind,
                                       cfg->backend);
    }
    uint32_t n = cfg->n_devices ? cfg->n_devices : 1;
    if (cfg->n_device_budgets > 1 && cfg->n_device_budgets != n)
        return qm_status_set_field(st, QM_EINVAL, "device_budget",
                                   "device_budget has %u values for %u device%s; give one value "
                                   "for every device or one per device",
                                   cfg->n_device_budgets, n, n == 1 ? "" : "s");
    return 0;
}

typedef enum { K_U32, K_U64, K_STR, K_LEVEL, K_BACKEND, K_BOOL, K_SOURCE, K_DEVICES,
               K_BUDGETS, K_IO_ENGINE, K_PRESSURE } key_kind;

typedef struct key_def {
    const char *name;
    key_kind kind;
    size_t offset;
    int reloadable;
    uint64_t min, max;
} key_def;

#define OFF(f) offsetof(qm_config, f)
static const key_def keys[] = {
    {"socket", K_STR, OFF(socket_path), 0, 0, 0},
    {"backend", K_BACKEND, 0, 0, 0, 0},
    {"paging_source", K_SOURCE, 0, 0, 0, 0},
    {"io_engine", K_IO_ENGINE, 0, 0, 0, 0},
    {"io_depth", K_U32, OFF(io_depth), 0, 1, QM_PAGER_IO_DEPTH_MAX},
    {"cpu_repack", K_BOOL, OFF(cpu_repack), 0, 0, 0},
    {"prefetch_trial", K_BOOL, OFF(prefetch_trial), 0, 0, 0},
    {"prefetch_park", K_BOOL, OFF(prefetch_park), 0, 0, 0},
    {"record_routing", K_BOOL, OFF(record_routing), 0, 0, 0},
    {"warm_from_profile", K_BOOL, OFF(warm_from_profile), 0, 0, 0},
    {"device", K_DEVICES, 0, 0, 0, 0},
    {"device_budget", K_BUDGETS, 0, 0, 0, 0},
    {"emu_copy_mbps", K_U32, OFF(emu_copy_mbps), 0, 0, 1u << 30},
    {"state_dir", K_STR, OFF(state_dir), 0, 0, 0},
    {"threads", K_U32, OFF(threads), 0, 0, 1024},
    {"workers", K_U32, OFF(workers), 0, 1, 256},
    {"admin_group", K_STR, OFF(admin_group), 1, 0, 0},
    {"user", K_STR, OFF(user), 0, 0, 0},
    {"allow_root", K_BOOL, OFF(allow_root), 0, 0, 0},
    {"model_dirs", K_STR, OFF(model_dirs), 0, 0, 0},
    {"log_level", K_LEVEL, 0, 1, 0, 0},
    {"max_request_bytes", K_U64, OFF(max_request_bytes), 1, 64, 1ull << 32},
    {"max_nesting", K_U32, OFF(max_nesting), 1, 2, 1000},
    {"max_batch", K_U32, OFF(max_batch), 1, 1, 1u << 20},
    {"max_connections", K_U32, OFF(max_connections), 1, 1, 1u << 20},
    {"max_sessions", K_U32, OFF(max_sessions), 1, 1, 1u << 20},
    {"max_connections_per_uid", K_U32, OFF(max_connections_per_uid), 1, 0, 1u << 20},
    {"max_sessions_per_uid", K_U32, OFF(max_sessions_per_uid), 1, 0, 1u << 20},
    {"max_output_bytes", K_U64, OFF(max_output_bytes), 1, 4096, UINT64_MAX},
    {"queue_depth", K_U32, OFF(queue_depth), 1, 1, 1u << 24},
    {"idle_timeout_s", K_U32, OFF(idle_timeout_s), 1, 0, 1u << 30},
    {"frames_per_wakeup", K_U32, OFF(frames_per_wakeup), 1, 1, 1u << 20},
    {"frame_timeout_s", K_U32, OFF(frame_timeout_s), 1, 0, 1u << 30},
    {"drain_timeout_s", K_U32, OFF(drain_timeout_s), 1, 0, 86400},
    {"trace_capacity", K_U32, OFF(trace_capacity), 0, 16, 1u << 24},
    {"session_workspace_bytes", K_U64, OFF(session_workspace_bytes), 0, 0, UINT64_MAX},
    {"max_mapped_bytes", K_U64, OFF(max_mapped_bytes), 1, 0, UINT64_MAX},
    {"max_trace_bytes", K_U64, OFF(max_trace_bytes), 1, 0, UINT64_MAX},
    {"max_rings", K_U32, OFF(max_rings), 1, 0, 4096},
    {"session_orphan_timeout_s", K_U32, OFF(session_orphan_timeout_s), 1, 0, 1u << 30},
    {"auto_budget_reserve", K_U64, OFF(auto_budget_reserve), 1, 0, UINT64_MAX},
    {"auto_budget_check_ms", K_U32, OFF(auto_budget_check_ms), 1, 0, 3600000},
    {"auto_budget_pressure_ms", K_U32, OFF(auto_budget_pressure_ms), 0, 0, 2000},
    {"auto_budget_pressure_level", K_PRESSURE, 0, 0, 0, 0},
    {"auto_budget_shrink_percent", K_U32, OFF(auto_budget_shrink_percent), 1, 1, 90},
    {"auto_budget_grow_after_s", K_U32, OFF(auto_budget_grow_after_s), 1, 0, 86400},
    {"auto_budget_grace_ms", K_U32, OFF(auto_budget_grace_ms), 1, 0, 600000},
};

static const key_def *find_key(const char *name)
{
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (strcmp(keys[i].name, name) == 0)
            return &keys[i];
    return NULL;
}

/* A key naming one of a registry's values (paging_source, io_engine): the
 * value into *out, or the error listing the registry's names. */
static int option_value(const key_def *k, const char *text, int (*parse)(const char *),
                        const char *(*at)(size_t, int *), int *out, qm_status *st)
{
    int v = parse(text);
    if (v < 0) {
        char names[64];
        return qm_status_set_field(st, QM_EINVAL, k->name, "%s must be %s", k->name,
                                   option_names(at, names, sizeof names, ", ", " or "));
    }
    *out = v;
    return 0;
}

/* Applies one key given as text (flags) or as a number (the file). */
static int apply_key(qm_config *cfg, const key_def *k, const char *text, int has_num, double num,
                     qm_status *st)
{
    uint64_t v = 0;
    char *base = (char *)cfg;
    switch (k->kind) {
    case K_STR:
        if (!text)
            return qm_status_set_field(st, QM_EINVAL, k->name, "%s must be a string", k->name);
        return set_string((char **)(base + k->offset), text, st);
    case K_LEVEL:
        if (!text || qm_log_level_parse(text, &cfg->log_level) < 0)
            return qm_status_set_field(st, QM_EINVAL, k->name,
                                       "%s must be one of error, warning, notice, info, debug",
                                       k->name);
        return 0;
    case K_BOOL:
        if (text && (strcmp(text, "true") == 0 || strcmp(text, "1") == 0))
            *(int *)(base + k->offset) = 1;
        else if (text && (strcmp(text, "false") == 0 || strcmp(text, "0") == 0))
            *(int *)(base + k->offset) = 0;
        else if (!text && has_num == 2)
            *(int *)(base + k->offset) = num != 0;
        else
            return qm_status_set_field(st, QM_EINVAL, k->name, "%s must be true or false",
                                       k->name);
        return 0;
    case K_BACKEND:
        if (!text || (qm_backend_kind_find(text, strlen(text)) < 0 &&
                      strcmp(text, QM_CONFIG_BACKEND_AUTO))) {
            char kinds[96];
            qm_backend_kind_names(0, ", ", ", ", kinds, sizeof kinds);
            return qm_status_set_field(st, QM_EINVAL, k->name, "%s must be %s or %s", k->name,
                                       kinds, QM_CONFIG_BACKEND_AUTO);
        }
        snprintf(cfg->backend, sizeof cfg->backend, "%s", text);
        cfg->backend_set = 1;
        return 0;
    case K_DEVICES:
        if (!text)
            return qm_status_set_field(st, QM_EINVAL, k->name,
                                       "%s must be a string of KIND:INDEX entries separated "
                                       "by commas", k->name);
        return parse_devices(cfg, text, st);
    case K_BUDGETS:
        if (text)
            return parse_budgets(cfg, text, st);
        if (!has_num || !isfinite(num) || num < 1 || num != floor(num) || num >= 1.8e19)
            return qm_status_set_field(st, QM_EINVAL, k->name,
                                       "%s must be a positive integer or a string such as "
                                       "\"8G,4G\"", k->name);
        cfg->device_budgets[0] = cfg->device_budget = (uint64_t)num;
        cfg->n_device_budgets = 1;
        cfg->has_device_budget = 1;
        return 0;
    case K_SOURCE:
        return option_value(k, text, qm_pager_source_parse, qm_pager_source_at,
                            &cfg->paging_source, st);
    case K_IO_ENGINE:
        return option_value(k, text, qm_pager_io_parse, qm_pager_io_at, &cfg->io_engine, st);
    case K_PRESSURE:
        if (!text || (strcmp(text, "low") && strcmp(text, "medium") &&
                      strcmp(text, "critical") && strcmp(text, "off")))
            return qm_status_set_field(st, QM_EINVAL, k->name,
                                       "%s must be low, medium, critical (cgroup v1's "
                                       "memory.pressure_level) or off",
                                       k->name);
        snprintf(cfg->auto_budget_pressure_level, sizeof cfg->auto_budget_pressure_level, "%s",
                 text);
        return 0;
    case K_U32:
    case K_U64:
        if (text) {
            if (parse_bytes(text, &v) < 0)
                return qm_status_set_field(st, QM_EINVAL, k->name,
                                           "%s must be a non-negative integer", k->name);
        } else if (has_num && isfinite(num) && num >= 0 && num == floor(num) && num < 1.8e19) {
            v = (uint64_t)num;
        } else {
            return qm_status_set_field(st, QM_EINVAL, k->name,
                                       "%s must be a non-negative integer", k->name);
        }
        if (v < k->min || v > k->max)
            return qm_status_set_field(st, QM_EINVAL, k->name, "%s must be in %llu..%llu",
                                       k->name, (unsigned long long)k->min,
                                       (unsigned long long)k->max);
        if (k->kind == K_U32)
            *(uint32_t *)(base + k->offset) = (uint32_t)v;
        else
            *(uint64_t *)(base + k->offset) = v;
        return 0;
    }
    return QM_EINVAL;
}

int qm_config_load_file(qm_config *cfg, const char *path, int reload, qm_status *st)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return qm_status_set(st, QM_EIO, "cannot open config %s: %s", path, strerror(errno));
    char *text = NULL;
    size_t len = 0, cap = 0;
    int rc = 0;
    for (;;) {
        if (len + 4096 > cap) {
            if (cap >= (1u << 20)) {
                rc = qm_status_set(st, QM_EINVAL, "config %s is over 1 MiB", path);
                break;
            }
            char *p = qm_realloc(text, cap = cap ? cap * 2 : 8192);
            if (!p) {
                rc = qm_status_set(st, QM_ENOMEM, "out of memory");
                break;
            }
            text = p;
        }
        size_t n = fread(text + len, 1, cap - len, f);
        len += n;
        if (n == 0)
            break;
    }
    fclose(f);
    qm_conf_entry *e = NULL;
    size_t count = 0;
    if (rc == 0)
        rc = qm_conf_parse(text, len, &e, &count, st);
    qm_free(text);
    for (size_t i = 0; rc == 0 && i < count; i++) {
        if (strncmp(e[i].key, "models.", 7) == 0) {
            if (reload)
                continue;
            if (e[i].type != QM_CONF_STRING)
                rc = qm_status_set_field(st, QM_EINVAL, e[i].key, "%s must be a bank path",
                                         e[i].key);
            else
                rc = qm_config_add_model(cfg, e[i].key + 7, e[i].str, st);
            continue;
        }
        const key_def *k = find_key(e[i].key);
        if (!k) {
            rc = qm_status_set_field(st, QM_EINVAL, e[i].key, "unknown config key '%.64s'",
                                     e[i].key);
            break;
        }
        if (reload && !k->reloadable)
            continue;
        rc = apply_key(cfg, k, e[i].type == QM_CONF_STRING ? e[i].str : NULL,
                       e[i].type == QM_CONF_BOOL ? 2 : e[i].type == QM_CONF_NUMBER,
                       e[i].type == QM_CONF_BOOL ? e[i].boolean : e[i].num, st);
    }
    qm_conf_free(e, count);
    if (rc < 0 && st && !strstr(st->msg, path)) {
        char msg[QM_STATUS_MSG_MAX];
        snprintf(msg, sizeof msg, "%.40s: %.200s", path, st->msg);
        snprintf(st->msg, sizeof st->msg, "%s", msg);
    }
    return rc;
}

int qm_config_reload(qm_config *cfg, int argc, char **argv, qm_status *st)
{
    qm_config fresh;
    qm_config_defaults(&fresh);
    int rc = qm_config_from_args(&fresh, argc, argv, st);
    if (rc == 0) {
        char *base = (char *)cfg, *from = (char *)&fresh;
        for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
            const key_def *k = &keys[i];
            if (!k->reloadable)
                continue;
            switch (k->kind) {
            case K_STR: { /* swapped: fresh frees the old one */
                char **a = (char **)(base + k->offset), **b = (char **)(from + k->offset), *t = *a;
                *a = *b;
                *b = t;
                break;
            }
            case K_LEVEL: cfg->log_level = fresh.log_level; break;
            case K_U32: memcpy(base + k->offset, from + k->offset, sizeof(uint32_t)); break;
            case K_U64: memcpy(base + k->offset, from + k->offset, sizeof(uint64_t)); break;
            default: break; /* no other kind is reloadable */
            }
        }
    }
    qm_config_free(&fresh);
    return rc < 0 ? rc : 0;
}

/* The backend registry's kinds, for --help. */
static void usage_backends(FILE *out)
{
    char kinds[96], tried[96], numbered[96], host[32];
    qm_backend_kind_names(0, "|", "|", kinds, sizeof kinds);
    qm_backend_kind_names(QM_BACKEND_CAP_AUTO, ", ", " or ", tried, sizeof tried);
    qm_backend_kind_names(QM_BACKEND_CAP_NUMBERED, ", ", " or ", numbered, sizeof numbered);
    qm_backend_kind_names(QM_BACKEND_CAP_HOST, ", ", " or ", host, sizeof host);
    fprintf(out,
            "  --backend %s|%s\n"
            "                        %s: device 0 of %s when one opens, else %s\n"
            "  --device LIST         devices to serve, KIND:N[,KIND:N...] of one kind: %s\n"
            "  backend kinds:\n",
            kinds, QM_CONFIG_BACKEND_AUTO, QM_CONFIG_BACKEND_AUTO, tried[0] ? tried : "none",
            host, numbered);
    for (size_t i = 0; i < qm_backend_kind_count(); i++)
        fprintf(out, "    %-6s %s\n", qm_backend_kind_name(i), qm_backend_kind_summary(i));
}

static void usage(FILE *out)
{
    char sources[64], engines[64];
    fprintf(out,
            "usage: qmoed [options]\n"
            "  --socket PATH         listen here (default $RUNTIME_DIRECTORY/qmoed.sock,\n"
            "                        /run/qmoed/qmoed.sock as root, else $XDG_RUNTIME_DIR)\n"
            "  --config FILE         JSON config: the keys below plus every limit\n"
            "  --model NAME=PATH     load a bank at start (repeatable)\n");
    usage_backends(out);
    fprintf(out,
            "  --device-budget BYTES[,BYTES...]\n"
            "                        sessions' budget on each device (K/M/G suffixes): one value\n"
            "                        for every device or one per device (default: its memory)\n"
            "  --state-dir DIR       persisted state (hotness profiles, traces)\n"
            "  --threads N           compute threads of the backend (0 = cores)\n"
            "  --workers N           sessions computed in parallel (default 2)\n"
            "  --admin-group GROUP   members may use admin methods\n"
            "  --user USER           as root: drop to USER after binding and loading\n"
            "  --allow-root          keep running as root (otherwise a warning)\n"
            "  --log-level LEVEL     error, warning, notice, info, debug\n"
            "  --session-orphan-timeout SECONDS\n"
            "                        close a session no open connection has used for this\n"
            "                        long, nothing of it queued (default 300; 0 = never)\n"
            "  --set KEY=VALUE       any config key (e.g. --set max_batch=16)\n"
            "  --version, --help\n"
            "Config keys: socket backend device device_budget emu_copy_mbps\n"
            "  paging_source (%s) io_engine (%s) io_depth\n"
            "  cpu_repack (true|false) prefetch_trial (true|false) prefetch_park (true|false)\n"
            "  record_routing (true|false)\n"
            "  warm_from_profile (true|false) state_dir threads workers admin_group\n"
            "  user allow_root model_dirs (a list; --set model_dirs=DIR:DIR)\n"
            "  log_level max_request_bytes max_nesting max_batch max_connections max_sessions\n"
            "  max_connections_per_uid max_sessions_per_uid\n"
            "  max_output_bytes queue_depth idle_timeout_s frame_timeout_s frames_per_wakeup\n"
            "  drain_timeout_s"
            " trace_capacity session_workspace_bytes max_mapped_bytes max_rings\n"
            "  max_trace_bytes"
            " session_orphan_timeout_s auto_budget_reserve auto_budget_check_ms\n"
            "  auto_budget_pressure_ms auto_budget_pressure_level (low|medium|critical|off)\n"
            "  auto_budget_shrink_percent auto_budget_grow_after_s auto_budget_grace_ms,\n"
            "  and \"models\": {NAME: PATH}.\n"
            "SIGHUP re-reads the reloadable keys (limits, log_level, admin_group).\n",
            option_names(qm_pager_source_at, sources, sizeof sources, "|", "|"),
            option_names(qm_pager_io_at, engines, sizeof engines, "|", "|"));
}

int qm_config_from_args(qm_config *cfg, int argc, char **argv, qm_status *st)
{
    enum { O_SOCKET = 256, O_CONFIG, O_MODEL, O_BACKEND, O_BUDGET, O_STATE, O_THREADS,
           O_WORKERS, O_ADMIN, O_LEVEL, O_SET, O_VERSION, O_HELP, O_USER, O_ALLOW_ROOT,
           O_DEVICE, O_ORPHAN };
    static const struct option opts[] = {
        {"socket", required_argument, 0, O_SOCKET},   {"config", required_argument, 0, O_CONFIG},
        {"model", required_argument, 0, O_MODEL},     {"backend", required_argument, 0, O_BACKEND},
        {"device", required_argument, 0, O_DEVICE},
        {"device-budget", required_argument, 0, O_BUDGET},
        {"state-dir", required_argument, 0, O_STATE}, {"threads", required_argument, 0, O_THREADS},
        {"workers", required_argument, 0, O_WORKERS},
        {"admin-group", required_argument, 0, O_ADMIN},
        {"user", required_argument, 0, O_USER},
        {"allow-root", no_argument, 0, O_ALLOW_ROOT},
        {"log-level", required_argument, 0, O_LEVEL}, {"set", required_argument, 0, O_SET},
        {"session-orphan-timeout", required_argument, 0, O_ORPHAN},
        {"version", no_argument, 0, O_VERSION},       {"help", no_argument, 0, O_HELP},
        {0, 0, 0, 0}};
    /* First pass: the config file, so flags override it. */
    for (int i = 1; i < argc; i++) {
        const char *path = NULL;
        if (strcmp(argv[i], "--config") == 0 && i + 1 < argc)
            path = argv[i + 1];
        else if (strncmp(argv[i], "--config=", 9) == 0)
            path = argv[i] + 9;
        if (path) {
            int rc = set_string(&cfg->config_path, path, st);
            if (rc == 0)
                rc = qm_config_load_file(cfg, path, 0, st);
            if (rc < 0)
                return rc;
        }
    }
    optind = 1;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        const char *key = NULL;
        int rc = 0;
        switch (c) {
        case O_SOCKET: key = "socket"; break;
        case O_CONFIG: continue;
        case O_BACKEND: key = "backend"; break;
        case O_DEVICE: key = "device"; break;
        case O_BUDGET: key = "device_budget"; break;
        case O_STATE: key = "state_dir"; break;
        case O_THREADS: key = "threads"; break;
        case O_WORKERS: key = "workers"; break;
        case O_ADMIN: key = "admin_group"; break;
        case O_USER: key = "user"; break;
        case O_ALLOW_ROOT:
            cfg->allow_root = 1;
            continue;
        case O_LEVEL: key = "log_level"; break;
        case O_ORPHAN: key = "session_orphan_timeout_s"; break;
        case O_MODEL: {
            const char *eq = strchr(optarg, '=');
            if (!eq || eq == optarg || !eq[1])
                return qm_status_set(st, QM_EINVAL, "--model expects NAME=PATH, got '%.64s'",
                                     optarg);
            char name[QM_NAME_MAX + 1];
            if ((size_t)(eq - optarg) > QM_NAME_MAX)
                return qm_status_set(st, QM_EINVAL, "--model name is over %d bytes",
                                     QM_NAME_MAX);
            memcpy(name, optarg, (size_t)(eq - optarg));
            name[eq - optarg] = '\0';
            rc = qm_config_add_model(cfg, name, eq + 1, st);
            if (rc < 0)
                return rc;
            continue;
        }
        case O_SET: {
            const char *eq = strchr(optarg, '=');
            char name[64];
            if (!eq || (size_t)(eq - optarg) >= sizeof name)
                return qm_status_set(st, QM_EINVAL, "--set expects KEY=VALUE");
            memcpy(name, optarg, (size_t)(eq - optarg));
            name[eq - optarg] = '\0';
            const key_def *k = find_key(name);
            if (!k)
                return qm_status_set(st, QM_EINVAL, "unknown config key '%s'", name);
            rc = apply_key(cfg, k, eq + 1, 0, 0, st);
            if (rc < 0)
                return rc;
            continue;
        }
        case O_VERSION:
            printf("qmoed %s\n", QMOE_VERSION);
            return 1;
        case O_HELP:
            usage(stdout);
            return 1;
        default:
            usage(stderr);
            return qm_status_set(st, QM_EINVAL, "unknown or incomplete option '%.64s'",
                                 argv[optind - 1]);
        }
        rc = apply_key(cfg, find_key(key), optarg, 0, 0, st);
        if (rc < 0)
            return rc;
    }
    if (optind < argc)
        return qm_status_set(st, QM_EINVAL, "unexpected argument '%.64s'", argv[optind]);
    if (cfg->record_routing && !cfg->state_dir)
        return qm_status_set_field(st, QM_EINVAL, "record_routing",
                                   "record_routing needs state_dir (where the traces go)");
    return qm_config_check_devices(cfg, st);
}
