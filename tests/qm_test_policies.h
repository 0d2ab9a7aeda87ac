/* qm_test_policies.h - the registered residency policies, walked from the
 * registry, so that a new policy joins every sweep without a test edit. */
#ifndef QM_TEST_POLICIES_H
#define QM_TEST_POLICIES_H

#include <stddef.h>
#include <string.h>

#include "qm_residency.h"

enum { QM_TEST_MAX_POLICIES = 32 };

/* Fills names (QM_TEST_MAX_POLICIES entries) with the offered policies, and
 * also the registered ones that are not offered (belady: it needs a future)
 * when with_unoffered; `except` (NULL: none) is left out. Returns the count.
 * The names are the registry's (static). */
static inline size_t qm_test_policies(const char **names, int with_unoffered, const char *except)
{
    size_t n = 0;
    for (size_t i = 0; i < qm_policy_count() && n < QM_TEST_MAX_POLICIES; i++) {
        const char *name = qm_policy_name_at(i);
        if (!with_unoffered && !qm_policy_offered_at(i))
            continue;
        if (except && strcmp(name, except) == 0)
            continue;
        names[n++] = name;
    }
    return n;
}

#endif
