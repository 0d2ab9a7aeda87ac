/* qm_name_groups.h - a line of names grouped under labels, as the kernels'
 * self-check is told ("exact avx512, avx2; fast avx512vnni, avx2"): the
 * daemon's log line and qmoectl's status line. */
#ifndef QM_NAME_GROUPS_H
#define QM_NAME_GROUPS_H

#include <stddef.h>

/* Writes into the caller's buffer out[cap] (cap >= 1), cutting a line that
 * does not fit; holds pointers to the last label, which must outlive it. */
typedef struct qm_name_groups {
    char *out;
    size_t cap, len;
    const char *label; /* the open group's; NULL before the first name */
} qm_name_groups;

/* Starts an empty line in out. */
void qm_name_groups_init(qm_name_groups *g, char *out, size_t cap);
/* Appends name: after ", " in the open group when label is the same,
 * else as "label name" opening a group ("; " before it but the first). */
void qm_name_groups_add(qm_name_groups *g, const char *label, const char *name);

#endif
