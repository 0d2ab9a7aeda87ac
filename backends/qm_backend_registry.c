/* qm_backend_registry.c - the one list of backend kinds (qm_backend.h). It
 * feeds the daemon's configuration (--backend, --device KIND:N, their help
 * and errors) and its opening of devices; each backend declares its own
 * row (qm__backend_kind, qm_backend_impl.h) in its own file. Built as its
 * own library, qmoe_backends, the one target that links every backend:
 * the engine's CPU and emulated ones and CUDA's (a stub without CUDA). */
#include "qm_backend_impl.h"

#include <stdio.h>
#include <string.h>

/* Each backend's row, defined in its own file. */
extern const qm__backend_kind qm__backend_cpu_kind;  /* qm_backend_cpu.c */
extern const qm__backend_kind qm__backend_cuda_kind; /* cuda/: the backend, or its stub */
extern const qm__backend_kind qm__backend_emu_kind;  /* qm_backend_emu.c */

/* Order is the order kinds are listed in (help, errors). */
static const qm__backend_kind *const registry[] = {
    &qm__backend_cpu_kind,
    &qm__backend_cuda_kind,
    &qm__backend_emu_kind,
};
#define N_KINDS (sizeof registry / sizeof registry[0])

int qm__backend_kind_check(const qm__backend_kind *k, qm_status *st)
{
    if (!k)
        return qm_status_set(st, QM_EINVAL, "backend kind: no row");
    const char *name = k->name ? k->name : "?";
    if (k->version != QM_BACKEND_KIND_VERSION)
        return qm_status_set(st, QM_EUNSUPPORTED,
                             "backend kind '%s' is version %d, this build expects %d", name,
                             k->version, QM_BACKEND_KIND_VERSION);
    if (!k->name || !k->name[0] || !k->open)
        return qm_status_set(st, QM_EINVAL, "backend kind '%s' lacks a name or an open method",
                             name);
    return 0;
}

size_t qm_backend_kind_count(void) { return N_KINDS; }

const char *qm_backend_kind_name(size_t i) { return i < N_KINDS ? registry[i]->name : NULL; }

const char *qm_backend_kind_summary(size_t i)
{
    return i < N_KINDS ? registry[i]->summary : NULL;
}

unsigned qm_backend_kind_caps(size_t i) { return i < N_KINDS ? registry[i]->caps : 0; }

int qm_backend_kind_find(const char *name, size_t n)
{
    for (size_t i = 0; name && i < N_KINDS; i++)
        if (strlen(registry[i]->name) == n && memcmp(registry[i]->name, name, n) == 0)
            return (int)i;
    return -1;
}

/* Row i exists and passes the registry's check. */
static int qm__kind_usable(size_t i, qm_status *st)
{
    if (i >= N_KINDS)
        return qm_status_set(st, QM_EINVAL, "backend kind %zu: the registry has %zu", i,
                             (size_t)N_KINDS);
    return qm__backend_kind_check(registry[i], st);
}

int qm_backend_kind_open(size_t i, const qm_backend_open_options *o, qm_backend **out,
                         qm_status *st)
{
    *out = NULL;
    int rc = qm__kind_usable(i, st);
    if (rc < 0)
        return rc;
    static const qm_backend_open_options defaults = {0};
    return registry[i]->open(o ? o : &defaults, out, st);
}

int qm_backend_kind_probe(size_t i, uint32_t *n_devices, qm_status *st)
{
    *n_devices = 0;
    int rc = qm__kind_usable(i, st);
    if (rc < 0)
        return rc;
    if (!registry[i]->probe) {
        *n_devices = 1;
        return 0;
    }
    rc = registry[i]->probe(n_devices, st);
    if (rc == 0 && *n_devices == 0)
        rc = qm_status_set(st, QM_EDEVICE, "backend %s: no device", registry[i]->name);
    if (rc < 0)
        *n_devices = 0;
    return rc;
}

size_t qm_backend_kind_names(unsigned caps, const char *sep, const char *last_sep, char *buf,
                             size_t cap)
{
    size_t n = 0, len = 0, total = 0;
    if (cap)
        buf[0] = '\0';
    for (size_t i = 0; i < N_KINDS; i++)
        total += (registry[i]->caps & caps) == caps;
    for (size_t i = 0; i < N_KINDS; i++) {
        if ((registry[i]->caps & caps) != caps)
            continue;
        const char *before = n == 0 ? "" : n + 1 == total ? last_sep : sep;
        int w = snprintf(len < cap ? buf + len : NULL, len < cap ? cap - len : 0, "%s%s", before,
                         registry[i]->name);
        len += w > 0 ? (size_t)w : 0;
        n++;
    }
    return len;
}
