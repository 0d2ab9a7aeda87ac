/* qm_alloc.h - the allocator every module uses, with a hook for tests.
 *
 * Tests install hooks that fail the Nth allocation, to prove that every
 * allocation site reports failure and leaks nothing. Production code never
 * installs hooks; the default is libc. */
#ifndef QM_ALLOC_H
#define QM_ALLOC_H

#include <stddef.h>

typedef struct qm_alloc_hooks {
    void *(*malloc_fn)(size_t size, void *ud);
    void *(*realloc_fn)(void *ptr, size_t size, void *ud);
    void (*free_fn)(void *ptr, void *ud);
    void *ud;
} qm_alloc_hooks;

/* NULL restores libc. Not thread-safe: set before threads start (tests only). */
void qm_alloc_set_hooks(const qm_alloc_hooks *hooks);

void *qm_malloc(size_t size);
void *qm_calloc(size_t count, size_t size); /* overflow-checked */
void *qm_realloc(void *ptr, size_t size);
void qm_free(void *ptr);
char *qm_strdup(const char *s);
/* qm_free on each of the n pointers at ptrs, in order (NULL ones too). */
void qm_free_each(void *const *ptrs, size_t n);
/* qm_free on each argument, in order, for a destructor's run of frees:
 *   QM_FREE_ALL(k->id, k->params, k->model, k); */
#define QM_FREE_ALL(...)                                                                           \
    qm_free_each((void *const[]){__VA_ARGS__}, sizeof((void *[]){__VA_ARGS__}) / sizeof(void *))

/* Overflow-checked arithmetic on sizes: return 0 on success, -1 on overflow. */
static inline int qm_mul_u64(unsigned long long a, unsigned long long b, unsigned long long *out)
{
    return __builtin_mul_overflow(a, b, out) ? -1 : 0;
}
static inline int qm_add_u64(unsigned long long a, unsigned long long b, unsigned long long *out)
{
    return __builtin_add_overflow(a, b, out) ? -1 : 0;
}

#endif
