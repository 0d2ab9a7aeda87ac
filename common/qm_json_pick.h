/* qm_json_pick.h - an object's members taken by name into slots, each at
 * most once, for the readers that allow a fixed set of members (a request
 * envelope, a safetensors header entry). */
#ifndef QM_JSON_PICK_H
#define QM_JSON_PICK_H

#include <cJSON.h>
#include <stddef.h>

typedef enum qm_json_pick_rc {
    QM_JSON_PICK_OK = 0,
    QM_JSON_PICK_UNKNOWN, /* a member not among the names */
    QM_JSON_PICK_TWICE,   /* a member given twice */
} qm_json_pick_rc;

/* Walks obj's members in order: the one called names[i] goes into
 * slots[i] (which the caller sets to NULL first). Stops at the first
 * member that is unknown or repeated, which *bad names; the slots filled
 * until then stay filled. obj must be an object. */
qm_json_pick_rc qm_json_pick(const cJSON *obj, const char *const *names, const cJSON **slots,
                             size_t n, const cJSON **bad);

#endif
