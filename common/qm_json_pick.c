/* qm_json_pick.c - see qm_json_pick.h. */
#include "qm_json_pick.h"

#include <string.h>

qm_json_pick_rc qm_json_pick(const cJSON *obj, const char *const *names, const cJSON **slots,
                             size_t n, const cJSON **bad)
{
    for (const cJSON *m = obj->child; m; m = m->next) {
        size_t i = 0;
        while (i < n && strcmp(m->string, names[i]) != 0)
            i++;
        *bad = m;
        if (i == n) return QM_JSON_PICK_UNKNOWN;
        if (slots[i]) return QM_JSON_PICK_TWICE;
        slots[i] = m;
    }
    *bad = NULL;
    return QM_JSON_PICK_OK;
}
