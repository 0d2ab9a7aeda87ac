/* qm_memory.c - MemAvailable and the memory cgroups that bound qmoed, read
 * now (qm_memory.h). */
#include "qm_memory.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A v1 limit at or above this is "no limit" (the kernel's is 2^63 less a page). */
#define QM__V1_UNLIMITED (1ull << 62)

/* The first token of a one-value file: a number, or "max" (v2's no limit)
 * as UINT64_MAX. -1 when unreadable. */
static int read_value(const char *dir, const char *name, uint64_t *out)
{
    char path[QM_MEM_PATH_MAX + 64], buf[64];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    char *got = fgets(buf, sizeof buf, f);
    fclose(f);
    if (!got)
        return -1;
    if (strncmp(buf, "max", 3) == 0) {
        *out = UINT64_MAX;
        return 0;
    }
    char *end;
    errno = 0;
    unsigned long long v = strtoull(buf, &end, 10);
    if (errno || end == buf)
        return -1;
    *out = v;
    return 0;
}

/* The value of `key` in a "key value" file (memory.stat) or a "Key: value
 * kB" one (meminfo, scaled to bytes). -1 when absent. */
static int read_keyed(const char *path, const char *key, uint64_t *out)
{
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    char line[256];
    size_t klen = strlen(key);
    int rc = -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, klen) != 0 || (line[klen] != ' ' && line[klen] != ':'))
            continue;
        char *end;
        unsigned long long v = strtoull(line + klen + 1, &end, 10);
        if (end == line + klen + 1)
            break;
        *out = strstr(end, "kB") ? v * 1024u : v;
        rc = 0;
        break;
    }
    fclose(f);
    return rc;
}

/* A memory.stat value, 0 when absent: v1's total_ form first, which
 * counts the subtree as its usage does (v2's are hierarchical). */
static uint64_t stat_value(const char *stat, int v1, const char *key)
{
    char total[64];
    uint64_t v = 0;
    snprintf(total, sizeof total, "total_%s", key);
    if (!(v1 && read_keyed(stat, total, &v) == 0) && read_keyed(stat, key, &v) < 0)
        v = 0;
    return v;
}

static void set_available(qm_mem_bound *b)
{
    b->available = b->limit > b->usage ? b->limit - b->usage : 0;
}

static int read_host(qm_mem_bound *b)
{
    const char *path = getenv("QMOED_TEST_MEMINFO");
    if (!path || !*path)
        path = "/proc/meminfo";
    memset(b, 0, sizeof *b);
    b->kind = QM_MEM_HOST;
    snprintf(b->path, sizeof b->path, "%s", path);
    if (read_keyed(path, "MemTotal", &b->limit) < 0 ||
        read_keyed(path, "MemAvailable", &b->available) < 0)
        return -1;
    b->usage = b->limit > b->available ? b->limit - b->available : 0;
    return 0;
}

/* One cgroup directory: 1 with a limit, 0 without one, -1 when it is not a
 * memory cgroup of that kind. */
static int read_cgroup(const char *dir, qm_mem_kind kind, qm_mem_bound *b)
{
    int v1 = kind == QM_MEM_CGROUP_V1;
    memset(b, 0, sizeof *b);
    b->kind = kind;
    snprintf(b->path, sizeof b->path, "%s", dir);
    if (read_value(dir, v1 ? "memory.limit_in_bytes" : "memory.max", &b->limit) < 0)
        return -1;
    if (b->limit == UINT64_MAX || (v1 && b->limit >= QM__V1_UNLIMITED))
        return 0;
    if (read_value(dir, v1 ? "memory.usage_in_bytes" : "memory.current", &b->usage) < 0)
        return -1;
    char stat[QM_MEM_PATH_MAX + 16];
    snprintf(stat, sizeof stat, "%s/memory.stat", dir);
    /* The page cache no process maps: every inactive file page, and the
     * active ones beyond the mapped (a mapped page may sit on either list,
     * so this never counts one as free). An engine that read its weights
     * in left their pages behind, and the next process that read them
     * again (llama-bench's decode run after its prefill run) made them
     * active: counted as in use, they took 90-260 MB of the bench models'
     * budgets in a cgroup for nothing that was needed. */
    uint64_t inactive = stat_value(stat, v1, "inactive_file");
    uint64_t active = stat_value(stat, v1, "active_file");
    uint64_t mapped = stat_value(stat, v1, v1 ? "mapped_file" : "file_mapped");
    b->cache = inactive + (active > mapped ? active - mapped : 0);
    if (b->cache > b->usage)
        b->cache = b->usage;
    b->usage -= b->cache;
    set_available(b);
    return 1;
}

/* The memory controller's hierarchy from /proc/self/mountinfo: where it is
 * mounted and which cgroup path is its root there (a container's
 * namespace). v1: a "cgroup" mount with the memory option; v2: "cgroup2". */
static int find_mount(int v2, char *mnt, size_t mcap, char *root, size_t rcap)
{
    FILE *f = fopen("/proc/self/mountinfo", "re");
    if (!f)
        return -1;
    char line[1024];
    int rc = -1;
    while (rc < 0 && fgets(line, sizeof line, f)) {
        char r[512], m[512], type[64], opts[512];
        const char *dash = strstr(line, " - ");
        if (!dash || sscanf(line, "%*s %*s %*s %511s %511s", r, m) != 2 ||
            sscanf(dash + 3, "%63s %*s %511s", type, opts) != 2)
            continue;
        if (v2 ? strcmp(type, "cgroup2") != 0
               : strcmp(type, "cgroup") != 0 || !strstr(opts, "memory"))
            continue;
        if (!v2) { /* "memory" as one whole option, not "nomemory" or a prefix */
            int whole = 0;
            for (char *t = strtok(opts, ","); t; t = strtok(NULL, ","))
                whole |= strcmp(t, "memory") == 0;
            if (!whole)
                continue;
        }
        snprintf(mnt, mcap, "%s", m);
        snprintf(root, rcap, "%s", r);
        rc = 0;
    }
    fclose(f);
    return rc;
}

/* qmoed's memory cgroup directory from /proc/self/cgroup: v1's memory
 * hierarchy when mounted, else v2's. *top is the mount point (the walk up
 * stops there). -1 when none. */
static int find_own_cgroup(char *dir, size_t cap, char *top, size_t tcap, qm_mem_kind *kind)
{
    FILE *f = fopen("/proc/self/cgroup", "re");
    if (!f)
        return -1;
    char line[1024], v1path[512] = "", v2path[512] = "";
    int has_v1 = 0, has_v2 = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2)
            continue;
        *c2 = '\0';
        const char *ctrls = c1 + 1, *path = c2 + 1;
        if (strcmp(line, "0") == 0 && !*ctrls) { /* "0::/path" */
            snprintf(v2path, sizeof v2path, "%s", path);
            has_v2 = 1;
            continue;
        }
        char list[256];
        snprintf(list, sizeof list, "%s", ctrls);
        for (char *t = strtok(list, ","); t; t = strtok(NULL, ","))
            if (strcmp(t, "memory") == 0) {
                snprintf(v1path, sizeof v1path, "%s", path);
                has_v1 = 1;
            }
    }
    fclose(f);
    char mnt[512], root[512];
    const char *path;
    if (has_v1 && find_mount(0, mnt, sizeof mnt, root, sizeof root) == 0) {
        *kind = QM_MEM_CGROUP_V1;
        path = v1path;
    } else if (has_v2 && find_mount(1, mnt, sizeof mnt, root, sizeof root) == 0) {
        *kind = QM_MEM_CGROUP_V2;
        path = v2path;
    } else {
        return -1;
    }
    size_t rl = strlen(root);
    if (strcmp(root, "/") != 0 && strncmp(path, root, rl) == 0)
        path += rl; /* the cgroup namespace's root is the mount's */
    snprintf(dir, cap, "%s%s", mnt, strcmp(path, "/") == 0 ? "" : path);
    snprintf(top, tcap, "%s", mnt);
    return 0;
}

/* Whether `dir` is a memory cgroup directory of some kind (the test's own
 * cgroup); its kind in *kind. */
static int cgroup_kind(const char *dir, qm_mem_kind *kind)
{
    uint64_t v;
    if (read_value(dir, "memory.limit_in_bytes", &v) == 0)
        *kind = QM_MEM_CGROUP_V1;
    else if (read_value(dir, "memory.max", &v) == 0)
        *kind = QM_MEM_CGROUP_V2;
    else
        return -1;
    return 0;
}

/* Every cgroup from `dir` up: to `top` (a mount point), or with top ""
 * while the parents are cgroups of the same kind (the test's). */
static void read_chain(qm_mem_state *m, const char *start, const char *top, qm_mem_kind kind)
{
    char dir[QM_MEM_PATH_MAX];
    snprintf(dir, sizeof dir, "%s", start);
    for (;;) {
        qm_mem_bound b;
        int r = read_cgroup(dir, kind, &b);
        if (r < 0 && !*top)
            break;
        if (r > 0 && m->n < QM_MEM_MAX_BOUNDS)
            m->bounds[m->n++] = b;
        if (*top && strcmp(dir, top) == 0)
            break;
        char *slash = strrchr(dir, '/');
        if (!slash || slash == dir || (*top && strlen(dir) <= strlen(top)))
            break;
        *slash = '\0';
    }
}

int qm_mem_read(qm_mem_state *m, qm_status *st)
{
    memset(m, 0, sizeof *m);
    if (read_host(&m->bounds[0]) == 0)
        m->n = 1;
    char dir[QM_MEM_PATH_MAX] = "", top[QM_MEM_PATH_MAX] = "";
    const char *test = getenv("QMOED_TEST_CGROUP");
    qm_mem_kind kind = QM_MEM_CGROUP_V1;
    int found = test && *test ? cgroup_kind(test, &kind) : -1;
    if (found == 0)
        snprintf(dir, sizeof dir, "%s", test);
    else if (!(test && *test))
        found = find_own_cgroup(dir, sizeof dir, top, sizeof top, &kind);
    if (found == 0) {
        snprintf(m->cgroup, sizeof m->cgroup, "%s", dir);
        m->cgroup_kind = kind;
        read_chain(m, dir, top, kind);
    }
    if (m->n == 0)
        return qm_status_set(st, QM_EIO,
                             "cannot read the memory available: neither %s nor a memory "
                             "cgroup of this process could be read",
                             m->bounds[0].path[0] ? m->bounds[0].path : "/proc/meminfo");
    for (uint32_t i = 1; i < m->n; i++)
        if (m->bounds[i].available < m->bounds[m->tightest].available)
            m->tightest = i;
    return 0;
}

uint64_t qm_mem_available(const qm_mem_state *m)
{
    return m->n ? m->bounds[m->tightest].available : UINT64_MAX;
}

void qm_mem_bytes_text(uint64_t bytes, char *out, size_t cap)
{
    double b = (double)bytes;
    if (b >= 1e9)
        snprintf(out, cap, "%.2f GB", b / 1e9);
    else if (b >= 1e6)
        snprintf(out, cap, "%.1f MB", b / 1e6);
    else if (b >= 1e3)
        snprintf(out, cap, "%.1f kB", b / 1e3);
    else
        snprintf(out, cap, "%llu bytes", (unsigned long long)bytes);
}

void qm_mem_describe(const qm_mem_bound *b, char *out, size_t cap)
{
    char lim[32], use[32], avail[32];
    qm_mem_bytes_text(b->limit, lim, sizeof lim);
    qm_mem_bytes_text(b->usage, use, sizeof use);
    qm_mem_bytes_text(b->available, avail, sizeof avail);
    if (b->kind == QM_MEM_HOST)
        snprintf(out, cap, "MemAvailable %s", avail);
    else
        snprintf(out, cap, "cgroup limit %s - in use %s", lim, use);
}
