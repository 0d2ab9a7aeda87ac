/* qm_kernel_cpu.c - what the CPU offers the kernels: features by name, as
 * the rows of qm_kernel_isa.h name what they need; the brand string; a
 * signature for the kernel cache; AMX's tile permission. Compiled for the
 * baseline (no ISA flags): it runs before anything is known of the CPU.
 *
 * A feature is present when its CPUID bit is set and the OS saves the
 * register state it uses (XCR0, read with xgetbv once OSXSAVE says it may
 * be); AMX also needs this process's permission for the tile state, asked
 * of Linux once (arch_prctl ARCH_REQ_XCOMP_PERM). Tests may hide a feature
 * (qm__cpu_hide) or fake AMX (qm__kernel_amx_hook). */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "qm_kernel_isa.h"

#if defined(QMOE_X86_KERNELS)
enum { QM__EAX, QM__EBX, QM__ECX, QM__EDX };

#define QM__XCR0_AVX 0x6u        /* SSE and AVX state */
#define QM__XCR0_AVX512 0xe6u    /* and opmask, ZMM_Hi256, Hi16_ZMM */
#define QM__XCR0_AMX 0x60000u    /* XTILECFG and XTILEDATA */

/* The features a kernel may name in its row's `needs`. */
typedef struct qm__cpu_feat {
    const char *name;
    unsigned leaf, sub, reg, bit;
    unsigned xcr0; /* the state the OS must save */
} qm__cpu_feat;

static const qm__cpu_feat qm__feats[] = {
    {"avx2", 7, 0, QM__EBX, 5, QM__XCR0_AVX},
    {"fma", 1, 0, QM__ECX, 12, QM__XCR0_AVX},
    {"f16c", 1, 0, QM__ECX, 29, QM__XCR0_AVX},
    {"avxvnni", 7, 1, QM__EAX, 4, QM__XCR0_AVX},
    {"avx512f", 7, 0, QM__EBX, 16, QM__XCR0_AVX512},
    {"avx512bw", 7, 0, QM__EBX, 30, QM__XCR0_AVX512},
    {"avx512vl", 7, 0, QM__EBX, 31, QM__XCR0_AVX512},
    {"avx512vnni", 7, 0, QM__ECX, 11, QM__XCR0_AVX512},
    {"amx-tile", 7, 0, QM__EDX, 24, QM__XCR0_AMX},
    {"amx-int8", 7, 0, QM__EDX, 25, QM__XCR0_AMX},
};
#define QM__N_FEATS (sizeof qm__feats / sizeof qm__feats[0])

static void qm__cpuid(unsigned leaf, unsigned sub, unsigned r[4])
{
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(leaf), "c"(sub));
    r[0] = a, r[1] = b, r[2] = c, r[3] = d;
}

/* The CPUID words the features live in, and XCR0 (0 when the OS does not
 * let xgetbv run). */
typedef struct qm__cpu_words {
    unsigned l1[4], l7[4], l7s1[4], xcr0;
} qm__cpu_words;

static qm__cpu_words qm__words;
static pthread_once_t qm__words_once = PTHREAD_ONCE_INIT;

static void qm__cpu_read_once(void)
{
    qm__cpu_words *w = &qm__words;
    unsigned r[4];
    memset(w, 0, sizeof *w);
    qm__cpuid(0, 0, r);
    unsigned max = r[0];
    qm__cpuid(1, 0, w->l1);
    w->l1[QM__EBX] = 0; /* the APIC id and counts: differ per core */
    if (max >= 7) {
        qm__cpuid(7, 0, w->l7);
        if (w->l7[QM__EAX] >= 1)
            qm__cpuid(7, 1, w->l7s1);
    }
    if ((w->l1[QM__ECX] >> 27) & 1) { /* OSXSAVE: xgetbv may run */
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        (void)hi;
        w->xcr0 = lo;
    }
}

/* The words, read once (CPUID traps to the hypervisor in a VM). */
static void qm__cpu_read(qm__cpu_words *w)
{
    pthread_once(&qm__words_once, qm__cpu_read_once);
    *w = qm__words;
}

static unsigned qm__hidden; /* tests: bit i hides qm__feats[i] */

/* Feature i's CPUID bit and OS state, hidden ones absent. */
static int qm__feat_flag(size_t i)
{
    const qm__cpu_feat *f = &qm__feats[i];
    qm__cpu_words w;
    if ((qm__hidden >> i) & 1)
        return 0;
    qm__cpu_read(&w);
    const unsigned *words = f->leaf == 1 ? w.l1 : f->sub ? w.l7s1 : w.l7;
    return ((words[f->reg] >> f->bit) & 1) && (w.xcr0 & f->xcr0) == f->xcr0;
}

static int qm__feat_index(const char *name, size_t n)
{
    for (size_t i = 0; i < QM__N_FEATS; i++)
        if (strlen(qm__feats[i].name) == n && memcmp(qm__feats[i].name, name, n) == 0)
            return (int)i;
    return -1;
}

/* Feature `name`'s CPUID bit and OS state (qm__feat_flag). */
static int qm__feat_named(const char *name)
{
    int i = qm__feat_index(name, strlen(name));
    return i >= 0 && qm__feat_flag((size_t)i);
}

/* ---- AMX: the CPU's flags, the OS's tile state, this process's permission ---- */

#define QM__ARCH_GET_XCOMP_PERM 0x1022
#define QM__ARCH_REQ_XCOMP_PERM 0x1023
#define QM__XFEATURE_XTILEDATA 18

static pthread_mutex_t qm__amx_lock = PTHREAD_MUTEX_INITIALIZER;
static int qm__amx_state;          /* 0: not asked yet, 1: usable, -1: not */
static const char *qm__amx_reason; /* why not */
static char qm__amx_reason_buf[128];
static int qm__amx_fake_cpu;
static int (*qm__amx_perm_hook)(void);

/* Linux asks each process to request the tile state before its first tile
 * instruction (a larger signal frame); a kernel without the call, or one
 * that refuses, leaves AMX off. */
static int qm__amx_request(void)
{
    if (qm__amx_perm_hook)
        return qm__amx_perm_hook();
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, QM__ARCH_GET_XCOMP_PERM, &features) == 0 &&
        ((features >> QM__XFEATURE_XTILEDATA) & 1))
        return 0;
    if (syscall(SYS_arch_prctl, QM__ARCH_REQ_XCOMP_PERM, QM__XFEATURE_XTILEDATA) != 0)
        return errno ? errno : -1;
    return 0;
}

int qm__cpu_has_amx(void)
{
    pthread_mutex_lock(&qm__amx_lock);
    if (qm__amx_state == 0) {
        int flags = qm__amx_fake_cpu || (qm__feat_named("amx-tile") && qm__feat_named("amx-int8"));
        int refused = flags ? qm__amx_request() : 0;
        if (!flags) {
            qm__amx_reason = "no AMX-INT8 on this CPU (or the OS does not save the tile state)";
        } else if (refused) {
            snprintf(qm__amx_reason_buf, sizeof qm__amx_reason_buf,
                     "tile permission refused (arch_prctl ARCH_REQ_XCOMP_PERM: %s)",
                     refused > 0 ? strerror(refused) : "refused");
            qm__amx_reason = qm__amx_reason_buf;
        } else {
            qm__amx_reason = NULL;
        }
        qm__amx_state = qm__amx_reason ? -1 : 1;
    }
    int ok = qm__amx_state == 1;
    pthread_mutex_unlock(&qm__amx_lock);
    return ok;
}

const char *qm__amx_why_not(void)
{
    return qm__cpu_has_amx() ? NULL : qm__amx_reason;
}

void qm__kernel_amx_hook(int fake_cpu, int (*perm)(void))
{
    pthread_mutex_lock(&qm__amx_lock);
    qm__amx_fake_cpu = fake_cpu;
    qm__amx_perm_hook = perm;
    qm__amx_state = 0;
    pthread_mutex_unlock(&qm__amx_lock);
}

/* Feature i present and usable (AMX: with the tile permission). */
static int qm__feat_usable(size_t i)
{
    if (strncmp(qm__feats[i].name, "amx-", 4) == 0)
        return !((qm__hidden >> i) & 1) && qm__cpu_has_amx();
    return qm__feat_flag(i);
}

int qm__cpu_needs(const char *needs, char *why, size_t cap)
{
    for (const char *p = needs ? needs : ""; *p;) {
        size_t n = strcspn(p, " ");
        if (n) {
            int i = qm__feat_index(p, n);
            if (i < 0 || !qm__feat_usable((size_t)i)) {
                if (i >= 0 && strncmp(p, "amx-", 4) == 0 && qm__amx_why_not())
                    snprintf(why, cap, "%s", qm__amx_why_not());
                else
                    snprintf(why, cap, "this CPU lacks %.*s", (int)n, p);
                return 0;
            }
        }
        p += n + (p[n] == ' ');
    }
    return 1;
}

void qm__cpu_flags(char *out, size_t cap)
{
    size_t o = 0;
    out[0] = 0;
    for (size_t i = 0; i < QM__N_FEATS && o < cap; i++)
        if (strncmp(qm__feats[i].name, "amx-", 4) == 0 ? qm__feat_usable(i) : qm__feat_flag(i)) {
            int n = snprintf(out + o, cap - o, "%s%s", o ? " " : "", qm__feats[i].name);
            o += n > 0 ? (size_t)n : 0;
        }
}

void qm__cpu_signature(char *out, size_t cap)
{
    char brand[64];
    qm__cpu_words w;
    qm__cpu_brand(brand, sizeof brand);
    qm__cpu_read(&w);
    snprintf(out, cap, "%s;%08x.%08x.%08x;%08x.%08x.%08x;%08x;%08x;h%x;a%d", brand,
             w.l1[QM__EAX], w.l1[QM__ECX], w.l1[QM__EDX], w.l7[QM__EBX], w.l7[QM__ECX],
             w.l7[QM__EDX], w.l7s1[QM__EAX], w.xcr0, qm__hidden, qm__amx_fake_cpu);
}

void qm__cpu_hide(const char *name, int hide)
{
    int i = qm__feat_index(name, strlen(name));
    if (i < 0)
        return;
    if (hide)
        qm__hidden |= 1u << i;
    else
        qm__hidden &= ~(1u << i);
}

void qm__cpu_brand(char *out, size_t cap)
{
    unsigned r[12], s[4];
    snprintf(out, cap, "unknown");
    qm__cpuid(0x80000000u, 0, s);
    if (s[0] < 0x80000004u)
        return;
    for (unsigned i = 0; i < 3; i++)
        qm__cpuid(0x80000002u + i, 0, r + 4 * i);
    char brand[49];
    memcpy(brand, r, 48);
    brand[48] = 0;
    const char *p = brand;
    while (*p == ' ')
        p++;
    snprintf(out, cap, "%s", p);
    for (char *q = out; *q; q++)
        if (*q == '|' || *q == '\n' || *q == ';')
            *q = ' ';
    for (size_t n = strlen(out); n && out[n - 1] == ' ';)
        out[--n] = 0;
}

#else /* no x86 kernels: nothing to need, nothing to offer */

int qm__cpu_needs(const char *needs, char *why, size_t cap)
{
    if (needs && *needs) {
        snprintf(why, cap, "this build has no x86 kernels");
        return 0;
    }
    return 1;
}

void qm__cpu_flags(char *out, size_t cap)
{
    snprintf(out, cap, "%s", "");
}

void qm__cpu_brand(char *out, size_t cap)
{
    snprintf(out, cap, "unknown");
}

void qm__cpu_signature(char *out, size_t cap)
{
    snprintf(out, cap, "unknown");
}

void qm__cpu_hide(const char *name, int hide)
{
    (void)name, (void)hide;
}
#endif

/* Tests: AVX-512 (F, and so every row needing it) hidden or shown. */
void qm__kernel_hide_avx512(int hide)
{
    qm__cpu_hide("avx512f", hide);
}
