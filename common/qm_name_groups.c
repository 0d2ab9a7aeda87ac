/* qm_name_groups.c - see qm_name_groups.h. */
#include "qm_name_groups.h"

#include <stdio.h>
#include <string.h>

void qm_name_groups_init(qm_name_groups *g, char *out, size_t cap)
{
    g->out = out;
    g->cap = cap;
    g->len = 0;
    g->label = NULL;
    out[0] = 0;
}

void qm_name_groups_add(qm_name_groups *g, const char *label, const char *name)
{
    if (g->len >= g->cap) return;
    char *o = g->out + g->len;
    size_t left = g->cap - g->len;
    int n = g->label && strcmp(g->label, label) == 0
                ? snprintf(o, left, ", %s", name)
                : snprintf(o, left, "%s%s %s", g->len ? "; " : "", label, name);
    g->len += n > 0 ? (size_t)n : 0;
    g->label = label;
}
