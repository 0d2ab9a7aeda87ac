/* qm_kernel_cache.c - the measured kernel choice kept across restarts
 * (QMOE_KERNEL_CACHE=<file>, the daemon's state_dir/kernels.cache).
 *
 * One line per mode, each keyed by its tag, the cache version, the CPU's
 * brand string and the candidate kernels (widest first), then the chosen
 * kernel of each of the mode's four classes:
 *   qmoe-kernels 5|<brand>|avx512,avx2|<gemv q4> <gemv q8> <gemm q4> <gemm q8>
 *   qmoe-fast-kernels 5|<brand>|amx,avx512vnni,avxvnni,avx2|<decode q4> <decode q8> <prefill q4> <prefill q8>
 * A line for another CPU, kernel set or version, or a corrupt file, is
 * ignored with a line on stderr and rewritten after measuring; a file
 * holding only the other mode's line says nothing. Writing one mode's line
 * keeps the other's (read, replace, rename: a concurrent writer's line may
 * be lost, which costs a measurement, never a wrong choice: every kernel of
 * a class gives the same bits). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "qm_kernels.h"

/* 2: the 4-bit GEMV's entry is measured (1 held the fixed table's).
 * 3: the AVX-512 GEMM is the packed one (qm_gemm_packed_avx512.c), so the
 *    GEMM entries measured against the old one are taken again.
 * 4: the fast-mode choice is kept too, and its kernels changed (one order
 *    on block sums, int8 GEMMs, AMX).
 * 5: the AVX2 GEMM builds its panel from the codes (1.8-2x faster per
 *    core), so an AVX-512 CPU's GEMM entries are measured again. */
#define QM__CACHE_VERSION 5

/* The CPU's brand string (CPUID 0x80000002..4), or "unknown". */
static void qm__cpu_brand(char *out, size_t cap)
{
    snprintf(out, cap, "unknown");
#if defined(QMOE_X86_KERNELS)
    unsigned r[12], a = 0x80000000u, b, c, d;
    __asm__ volatile("cpuid" : "+a"(a), "=b"(b), "=c"(c), "=d"(d) : "c"(0));
    if (a < 0x80000004u)
        return;
    for (unsigned i = 0; i < 3; i++) {
        a = 0x80000002u + i;
        __asm__ volatile("cpuid" : "+a"(a), "=b"(b), "=c"(c), "=d"(d) : "c"(0));
        r[4 * i] = a, r[4 * i + 1] = b, r[4 * i + 2] = c, r[4 * i + 3] = d;
    }
    char brand[49];
    memcpy(brand, r, 48);
    brand[48] = 0;
    const char *p = brand;
    while (*p == ' ')
        p++;
    snprintf(out, cap, "%s", p);
    for (char *q = out; *q; q++)
        if (*q == '|' || *q == '\n')
            *q = ' ';
#endif
}

/* "<tag> <version>|<brand>|<candidates>". */
static void qm__cache_key(const char *tag, const char *const *cands, int nc, char *key, size_t cap)
{
    char brand[64];
    qm__cpu_brand(brand, sizeof brand);
    int o = snprintf(key, cap, "%s %d|%s|", tag, QM__CACHE_VERSION, brand);
    for (int c = 0; c < nc && o > 0 && (size_t)o < cap; c++)
        o += snprintf(key + o, cap - (size_t)o, "%s%s", c ? "," : "", cands[c]);
}

/* The file's lines (at most 4 of 511 bytes); the count, or -1 without a file. */
static int qm__cache_lines(const char *path, char lines[4][512])
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    int n = 0;
    while (n < 4 && fgets(lines[n], sizeof lines[n], f))
        n++;
    fclose(f);
    return n;
}

int qm__cache_load(const char *path, const char *tag, const char *const *cands, int nc, int out[4])
{
    char lines[4][512], key[256], names[4][32], pre[40];
    int n = qm__cache_lines(path, lines);
    if (n < 0)
        return -1;
    qm__cache_key(tag, cands, nc, key, sizeof key);
    snprintf(pre, sizeof pre, "%s ", tag);
    size_t kl = strlen(key);
    const char *why = "corrupt";
    int other = 0;
    for (int i = 0; i < n; i++) {
        const char *line = lines[i];
        if (strncmp(line, pre, strlen(pre)) != 0) {
            other |= strncmp(line, "qmoe-", 5) == 0;
            continue;
        }
        if (strncmp(line, key, kl) != 0 || line[kl] != '|') {
            why = "for another CPU, kernel set or version";
            other = 0;
            break;
        }
        int ok = sscanf(line + kl + 1, "%31s %31s %31s %31s", names[0], names[1], names[2],
                        names[3]) == 4;
        for (int k = 0; ok && k < 4; k++) {
            out[k] = -1;
            for (int c = 0; c < nc; c++)
                if (strcmp(cands[c], names[k]) == 0)
                    out[k] = c;
            ok = out[k] >= 0;
        }
        if (ok)
            return 0;
        other = 0;
        break;
    }
    if (!other)
        fprintf(stderr, "qmoe: kernel cache %s ignored (%s); measuring again\n", path, why);
    return -1;
}

void qm__cache_save(const char *path, const char *tag, const char *const *cands, int nc,
                    const int ch[4])
{
    char lines[4][512], key[256], tmp[4096], pre[40];
    int n = qm__cache_lines(path, lines);
    qm__cache_key(tag, cands, nc, key, sizeof key);
    snprintf(pre, sizeof pre, "%s ", tag);
    if (snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid()) >= (int)sizeof tmp)
        return;
    FILE *f = fopen(tmp, "w");
    if (!f)
        return;
    /* The exact mode's line first, then the fast mode's. */
    int fast = strcmp(tag, "qmoe-kernels") != 0, bad = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == fast) {
            bad |= fprintf(f, "%s|%s %s %s %s\n", key, cands[ch[0]], cands[ch[1]], cands[ch[2]],
                           cands[ch[3]]) < 0;
            continue;
        }
        for (int i = 0; i < n; i++)
            if (strncmp(lines[i], "qmoe-", 5) == 0 && strncmp(lines[i], pre, strlen(pre)) != 0 &&
                strchr(lines[i], '\n'))
                bad |= fputs(lines[i], f) < 0;
    }
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, path) != 0)
        remove(tmp);
}

int qm__kernel_cache_load(const char *path, const qm__kernel *const *cands, int nc,
                          const qm__kernel *out[4])
{
    const char *names[8];
    int idx[4];
    for (int c = 0; c < nc && c < 8; c++)
        names[c] = cands[c]->name;
    if (qm__cache_load(path, "qmoe-kernels", names, nc < 8 ? nc : 8, idx) != 0)
        return -1;
    for (int i = 0; i < 4; i++)
        out[i] = cands[idx[i]];
    return 0;
}
