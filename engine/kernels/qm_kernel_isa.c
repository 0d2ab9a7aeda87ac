/* qm_kernel_isa.c - the tables of CPU kernels (qm_kernel_isa.h): each row
 * is defined in its kernel's own file; the order here is the preference
 * order, widest first. Also the test hook that breaks one kernel's lane. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_kernel_isa.h"

#if defined(QMOE_X86_KERNELS)
/* Fast mode: one row per instruction set. */
extern const qm__i8isa qm__i8isa_amx;        /* qm_kernel_i8_amx.c */
extern const qm__i8isa qm__i8isa_avx512vnni; /* qm_kernel_i8_avx512vnni.c */
extern const qm__i8isa qm__i8isa_avxvnni;    /* qm_kernel_i8_avxvnni.c */
extern const qm__i8isa qm__i8isa_avx2;       /* qm_kernel_i8_avx2.c */

static const qm__i8isa *const qm__i8isas[] = {
    &qm__i8isa_amx,
    &qm__i8isa_avx512vnni,
    &qm__i8isa_avxvnni,
    &qm__i8isa_avx2,
};

/* Exact mode (qm_kernel_avx512.c, qm_kernel_avx2.c). */
static const qm__kernel *const qm__exacts[] = {
    &qm__kernel_avx512,
    &qm__kernel_avx2,
    &qm__kernel_avx2_folded,
};
#define QM__N_I8ISAS (sizeof qm__i8isas / sizeof qm__i8isas[0])
#define QM__N_EXACTS (sizeof qm__exacts / sizeof qm__exacts[0])
#else
static const qm__i8isa *const *const qm__i8isas = NULL;
static const qm__kernel *const *const qm__exacts = NULL;
#define QM__N_I8ISAS 0u
#define QM__N_EXACTS 0u
#endif

/* ---- the broken lane (test hook) ---- */

static struct {
    int fast;              /* -1: nothing broken, 0: exact row `row`, 1: fast row `row` */
    size_t row;
    uint32_t lane;
    qm__i8isa i8;          /* the broken copy of a fast row */
    qm__kernel exact;      /* of an exact row */
} qm__broken = {.fast = -1};

/* Lane qm__broken.lane of each 16-row call [n0, n1) wrong, every input. */
static void qm__break_lane(uint32_t n0, uint32_t n1, uint32_t nx, float *y, size_t ldy)
{
    uint32_t n = n0 + qm__broken.lane;
    if (n >= n1)
        return;
    for (uint32_t r = 0; r < nx; r++) {
        uint32_t u;
        memcpy(&u, &y[(size_t)r * ldy + n], 4);
        u ^= 1u << 22;
        memcpy(&y[(size_t)r * ldy + n], &u, 4);
    }
}

#define QM__BROKEN_FN(NAME, CALL)                                                                  \
    static void NAME(const qm__qmat *m, uint32_t n0, uint32_t n1, const float *xp, size_t ldx,     \
                     uint32_t nx, float *y, size_t ldy, float *scratch)                            \
    {                                                                                              \
        CALL(m, n0, n1, xp, ldx, nx, y, ldy, scratch);                                             \
        qm__break_lane(n0, n1, nx, y, ldy);                                                        \
    }
QM__BROKEN_FN(qm__broken_mm, qm__i8isas[qm__broken.row]->kernel.mm)
QM__BROKEN_FN(qm__broken_i8gemv, qm__i8isas[qm__broken.row]->gemv)
QM__BROKEN_FN(qm__broken_i8gemm, qm__i8isas[qm__broken.row]->gemm)
QM__BROKEN_FN(qm__broken_gemv, qm__exacts[qm__broken.row]->gemv)
QM__BROKEN_FN(qm__broken_gemm, qm__exacts[qm__broken.row]->gemm)
#undef QM__BROKEN_FN

int qm__kernel_break(const char *spec, char *why, size_t cap)
{
    qm__broken.fast = -1;
    if (!spec)
        return 0;
    const char *colon = strchr(spec, ':');
    char name[32];
    unsigned long lane = 3;
    if (!colon || (size_t)(colon - spec) > 5) {
        snprintf(why, cap, "kernel to break: expected exact:NAME[:LANE] or fast:NAME[:LANE]");
        return -1;
    }
    int fast = strncmp(spec, "fast:", 5) == 0;
    if (!fast && strncmp(spec, "exact:", 6) != 0) {
        snprintf(why, cap, "kernel to break: the precision must be exact or fast");
        return -1;
    }
    size_t n = strcspn(colon + 1, ":");
    snprintf(name, sizeof name, "%.*s", (int)(n < sizeof name ? n : sizeof name - 1), colon + 1);
    if (colon[1 + n] == ':') {
        char *end;
        lane = strtoul(colon + 2 + n, &end, 10);
        if (*end || lane > 15) {
            snprintf(why, cap, "kernel to break: the lane must be 0-15");
            return -1;
        }
    }
    int row = fast ? qm__i8isa_find(name) : qm__exact_find(name);
    if (row < 0) {
        snprintf(why, cap, "kernel to break: no %s kernel '%s' in this build",
                 fast ? "fast" : "exact", name);
        return -1;
    }
    qm__broken.row = (size_t)row;
    qm__broken.lane = (uint32_t)lane;
    if (fast) {
        qm__broken.i8 = *qm__i8isas[row];
        qm__broken.i8.kernel.mm = qm__broken_mm;
        qm__broken.i8.gemv = qm__broken_i8gemv;
        qm__broken.i8.gemm = qm__broken_i8gemm;
    } else {
        qm__broken.exact = *qm__exacts[row];
        qm__broken.exact.gemv = qm__broken_gemv;
        qm__broken.exact.gemm = qm__broken_gemm;
    }
    qm__broken.fast = fast;
    return 0;
}

/* ---- the tables ---- */

/* COUNT() and AT(i) of TABLE (N rows of T): row i, or the broken copy that
 * stands in for it while the test hook breaks a row of table FAST. */
#define QM__TABLE_ACCESS(COUNT, AT, T, TABLE, N, FAST, BROKEN)                                     \
    size_t COUNT(void)                                                                             \
    {                                                                                              \
        return (N);                                                                                \
    }                                                                                              \
    const T *AT(size_t i)                                                                          \
    {                                                                                              \
        if (i >= (N)) return NULL;                                                                 \
        return qm__broken.fast == (FAST) && qm__broken.row == i ? &qm__broken.BROKEN : TABLE[i];   \
    }
QM__TABLE_ACCESS(qm__i8isa_count, qm__i8isa_at, qm__i8isa, qm__i8isas, QM__N_I8ISAS, 1, i8)
QM__TABLE_ACCESS(qm__exact_count, qm__exact_at, qm__kernel, qm__exacts, QM__N_EXACTS, 0, exact)

int qm__word_in(const char *list, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = list ? list : ""; *p;) {
        size_t w = strcspn(p, " ");
        if (w == n && memcmp(p, name, n) == 0)
            return 1;
        p += w + (p[w] == ' ');
    }
    return 0;
}

int qm__i8isa_find(const char *name)
{
    for (size_t i = 0; name && i < QM__N_I8ISAS; i++)
        if (strcmp(qm__i8isas[i]->kernel.name, name) == 0 ||
            qm__word_in(qm__i8isas[i]->aliases, name))
            return (int)i;
    return -1;
}

const qm__i8isa *qm__i8isa_of(const qm__i8kernel *k)
{
    for (size_t i = 0; k && i < QM__N_I8ISAS; i++)
        if (k == &qm__i8isa_at(i)->kernel)
            return qm__i8isa_at(i);
    return NULL;
}

int qm__exact_find(const char *name)
{
    for (size_t i = 0; name && i < QM__N_EXACTS; i++)
        if (strcmp(qm__exacts[i]->name, name) == 0 || qm__word_in(qm__exacts[i]->aliases, name))
            return (int)i;
    return -1;
}
