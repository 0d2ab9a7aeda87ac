#include "qm_alloc.h"

#include <stdlib.h>
#include <string.h>

static qm_alloc_hooks alloc_hooks;
static int alloc_hooked;

void qm_alloc_set_hooks(const qm_alloc_hooks *hooks)
{
    if (hooks) {
        alloc_hooks = *hooks;
        alloc_hooked = 1;
    } else {
        memset(&alloc_hooks, 0, sizeof alloc_hooks);
        alloc_hooked = 0;
    }
}

void *qm_malloc(size_t size)
{
    if (alloc_hooked)
        return alloc_hooks.malloc_fn(size ? size : 1, alloc_hooks.ud);
    return malloc(size ? size : 1);
}

void *qm_calloc(size_t count, size_t size)
{
    size_t total;
    if (__builtin_mul_overflow(count, size, &total))
        return NULL;
    void *p = qm_malloc(total);
    if (p)
        memset(p, 0, total ? total : 1);
    return p;
}

void *qm_realloc(void *ptr, size_t size)
{
    if (alloc_hooked)
        return alloc_hooks.realloc_fn(ptr, size ? size : 1, alloc_hooks.ud);
    return realloc(ptr, size ? size : 1);
}

void qm_free(void *ptr)
{
    if (!ptr)
        return;
    if (alloc_hooked)
        alloc_hooks.free_fn(ptr, alloc_hooks.ud);
    else
        free(ptr);
}

void qm_free_each(void *const *ptrs, size_t n)
{
    for (size_t i = 0; i < n; i++)
        qm_free(ptrs[i]);
}

char *qm_strdup(const char *s)
{
    if (!s)
        return NULL;
    size_t n = strlen(s) + 1;
    char *p = qm_malloc(n);
    if (p)
        memcpy(p, s, n);
    return p;
}
