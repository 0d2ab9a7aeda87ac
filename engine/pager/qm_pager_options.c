/* qm_pager_options.c - the names of the pager's options (qm_pager.h): what
 * a demand miss does (on_miss), where paged units come from (the paging
 * source) and how the disk source reads (the I/O engine). The one list of each: the daemon's configuration, the wire's
 * decoder (checked against it by tests/daemon) and the help texts read
 * them here. */
#include <string.h>

#include "qm_pager.h"

typedef struct qm__option_name {
    const char *name;
    int value;
} qm__option_name;

static const qm__option_name qm__on_miss[] = {
    {"page", QM_ON_MISS_PAGE}, {"host", QM_ON_MISS_HOST}, {"auto", QM_ON_MISS_AUTO}};
static const qm__option_name qm__sources[] = {{"auto", QM_PAGER_SOURCE_AUTO},
                                             {"mmap", QM_PAGER_SOURCE_MMAP},
                                             {"direct", QM_PAGER_SOURCE_DIRECT}};
static const qm__option_name qm__io_engines[] = {{"auto", QM_PAGER_IO_AUTO},
                                                {"io_uring", QM_PAGER_IO_URING},
                                                {"threads", QM_PAGER_IO_THREADS},
                                                {"serial", QM_PAGER_IO_SERIAL}};
#define QM__N(t) (sizeof(t) / sizeof((t)[0]))

static const char *name_of(const qm__option_name *t, size_t n, int value)
{
    for (size_t i = 0; i < n; i++)
        if (t[i].value == value)
            return t[i].name;
    return NULL;
}

static int value_of(const qm__option_name *t, size_t n, const char *name)
{
    for (size_t i = 0; name && i < n; i++)
        if (strcmp(name, t[i].name) == 0)
            return t[i].value;
    return -1;
}

static const char *at(const qm__option_name *t, size_t n, size_t i, int *value)
{
    if (i >= n)
        return NULL;
    if (value)
        *value = t[i].value;
    return t[i].name;
}

/* A registry's three calls (qm_pager.h): PREFIX_name, PREFIX_parse, PREFIX_at. */
#define QM__OPTION_CALLS(prefix, table)                                                            \
    const char *prefix##_name(int value) { return name_of(table, QM__N(table), value); }           \
    int prefix##_parse(const char *name) { return value_of(table, QM__N(table), name); }           \
    const char *prefix##_at(size_t i, int *value) { return at(table, QM__N(table), i, value); }

QM__OPTION_CALLS(qm_on_miss, qm__on_miss)
QM__OPTION_CALLS(qm_pager_source, qm__sources)
QM__OPTION_CALLS(qm_pager_io, qm__io_engines)
