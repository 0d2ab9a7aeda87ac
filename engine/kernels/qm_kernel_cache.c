/* qm_kernel_cache.c - the kernel self-check's verdicts and the measured
 * kernel choice, kept across restarts (QMOE_KERNEL_CACHE=<file>, the
 * daemon's state_dir/kernels.cache).
 *
 * One line per tag, each keyed by the cache version, the binary (its GNU
 * build id, else its file's identity) and the CPU (qm__cpu_signature: the
 * brand, family/model/stepping, the feature words, the OS's saved state),
 * and closed by a checksum of everything before it:
 *   qmoe-kernel-check 6|<binary>|<cpu>|<verdicts>|<fnv1a32>
 *   qmoe-kernels 6|<binary>|<cpu>|avx512,avx2|<gemv q4> <gemv q8> <gemm q4> <gemm q8>|<fnv1a32>
 *   qmoe-fast-kernels 6|<binary>|<cpu>|amx,...,avx2|<decode q4> <decode q8>
 *                       <prefill q4> <prefill q8>|<fnv1a32>       (one line)
 * A line that is truncated, altered, garbage, or written by another
 * version, binary or CPU is never used: it is ignored with a line on
 * stderr, the check or measurement runs again, and the line is rewritten.
 * Writing one line keeps the others that are whole (read, replace, rename:
 * a concurrent writer's line may be lost, which costs a check or a
 * measurement, never a wrong choice). */
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qm_kernel_isa.h"

/* 2: the 4-bit GEMV's entry is measured (1 held the fixed table's).
 * 3: the AVX-512 GEMM is the packed one (qm_gemm_packed_avx512.c).
 * 4: the fast-mode choice is kept too, and its kernels changed.
 * 5: the AVX2 GEMM builds its panel from the codes.
 * 6: keyed by the binary and the CPU's feature words, closed by a
 *    checksum; the self-check's verdicts kept beside the choice. */
#define QM__CACHE_VERSION 6
#define QM__CACHE_LINES 8
#define QM__CACHE_LINE 1024

/* The tags, in the order lines are written. */
static const char *const qm__cache_tags[] = {"qmoe-kernel-check", "qmoe-kernels",
                                             "qmoe-fast-kernels"};

static uint32_t qm__fnv1a(const char *s, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)s[i]) * 16777619u;
    return h;
}

/* dl_iterate_phdr's search for the module holding `addr`: its build id. */
typedef struct qm__bid_find {
    uintptr_t addr;
    char *out;
    size_t cap;
    int found;
} qm__bid_find;

static int qm__bid_note(const ElfW(Nhdr) *n, const char *end, qm__bid_find *f)
{
    const char *name = (const char *)(n + 1);
    const unsigned char *desc = (const unsigned char *)name + ((n->n_namesz + 3) & ~3u);
    if (n->n_type != NT_GNU_BUILD_ID || n->n_namesz != 4 || memcmp(name, "GNU", 4) != 0 ||
        (const char *)desc + n->n_descsz > end)
        return 0;
    size_t o = 0;
    for (size_t i = 0; i < n->n_descsz && o + 3 <= f->cap; i++)
        o += (size_t)snprintf(f->out + o, f->cap - o, "%02x", desc[i]);
    return o > 0;
}

static int qm__bid_module(struct dl_phdr_info *info, size_t size, void *arg)
{
    qm__bid_find *f = arg;
    (void)size;
    int mine = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t lo = info->dlpi_addr + ph->p_vaddr;
        if (ph->p_type == PT_LOAD && f->addr >= lo && f->addr < lo + ph->p_memsz)
            mine = 1;
    }
    if (!mine)
        return 0;
    for (int i = 0; i < info->dlpi_phnum && !f->found; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_NOTE)
            continue;
        const char *p = (const char *)(info->dlpi_addr + ph->p_vaddr), *end = p + ph->p_memsz;
        while (!f->found && p + sizeof(ElfW(Nhdr)) <= end) {
            const ElfW(Nhdr) *n = (const ElfW(Nhdr) *)p;
            f->found = qm__bid_note(n, end, f);
            p += sizeof *n + ((n->n_namesz + 3) & ~3u) + ((n->n_descsz + 3) & ~3u);
        }
    }
    if (!f->found && !info->dlpi_name[0]) { /* the program, without a build id */
        struct stat st;
        if (stat("/proc/self/exe", &st) == 0) {
            snprintf(f->out, f->cap, "f%llx.%llx.%llx.%llx", (unsigned long long)st.st_dev,
                     (unsigned long long)st.st_ino, (unsigned long long)st.st_size,
                     (unsigned long long)st.st_mtime);
            f->found = 1;
        }
    }
    return 1;
}

/* What identifies the binary holding this code: its GNU build id, or the
 * program file's device, inode, size and time; "unknown" else. */
static void qm__binary_id(char *out, size_t cap)
{
    qm__bid_find f = {.addr = (uintptr_t)&qm__binary_id, .out = out, .cap = cap};
    snprintf(out, cap, "unknown");
    dl_iterate_phdr(qm__bid_module, &f);
    if (!f.found)
        snprintf(out, cap, "unknown");
}

/* "<tag> <version>|<binary>|<cpu>|". */
static void qm__cache_key(const char *tag, char *key, size_t cap)
{
    char bin[96], cpu[256];
    qm__binary_id(bin, sizeof bin);
    qm__cpu_signature(cpu, sizeof cpu);
    snprintf(key, cap, "%s %d|%s|%s|", tag, QM__CACHE_VERSION, bin, cpu);
}

/* The file's lines (each with its newline, or cut short); their count, or
 * -1 without a file. */
static int qm__cache_lines(const char *path, char lines[QM__CACHE_LINES][QM__CACHE_LINE])
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    int n = 0;
    while (n < QM__CACHE_LINES && fgets(lines[n], QM__CACHE_LINE, f))
        n++;
    fclose(f);
    return n;
}

/* 1 when line is whole: a newline, and the checksum of what precedes its
 * last '|' is the hex after it. */
static int qm__line_whole(const char *line)
{
    const char *nl = strchr(line, '\n'), *bar = strrchr(line, '|');
    if (!nl || nl[1] || !bar || bar > nl)
        return 0;
    char want[16];
    snprintf(want, sizeof want, "%08x", qm__fnv1a(line, (size_t)(bar - line)));
    return (size_t)(nl - bar - 1) == strlen(want) && memcmp(bar + 1, want, strlen(want)) == 0;
}

int qm__cache_get(const char *path, const char *tag, char *out, size_t cap)
{
    char lines[QM__CACHE_LINES][QM__CACHE_LINE], key[512], pre[40];
    int n = qm__cache_lines(path, lines);
    if (n < 0)
        return -1;
    qm__cache_key(tag, key, sizeof key);
    snprintf(pre, sizeof pre, "%s ", tag);
    size_t kl = strlen(key);
    const char *why = "not whole: truncated, altered or garbage";
    int ours = 0; /* 1: a line of this tag, 0: none, -1: something unreadable */
    for (int i = 0; i < n && ours <= 0; i++) {
        if (strncmp(lines[i], pre, strlen(pre)) == 0)
            ours = 1;
        else if (strncmp(lines[i], "qmoe-", 5) != 0 || !qm__line_whole(lines[i]))
            ours = -1;
        if (ours != 1)
            continue;
        if (!qm__line_whole(lines[i])) {
            why = "not whole: truncated, altered or garbage";
        } else if (strncmp(lines[i], key, kl) != 0) {
            why = "written by another version, binary or CPU";
        } else {
            size_t len = (size_t)(strrchr(lines[i], '|') - lines[i]) - kl;
            if (len < cap) {
                memcpy(out, lines[i] + kl, len);
                out[len] = 0;
                return 0;
            }
            why = "a line too long";
        }
    }
    if (ours)
        fprintf(stderr, "qmoe: kernel cache %s: its %s line is ignored (%s); checked or measured "
                        "again and rewritten\n", path, tag, ours > 0 ? why : "no such line, and "
                        "others not whole");
    return -1;
}

void qm__cache_put(const char *path, const char *tag, const char *payload)
{
    char lines[QM__CACHE_LINES][QM__CACHE_LINE], key[512], tmp[4096], mine[QM__CACHE_LINE];
    int n = qm__cache_lines(path, lines);
    qm__cache_key(tag, key, sizeof key);
    int len = snprintf(mine, sizeof mine - 12, "%s%s", key, payload);
    if (len < 0 || (size_t)len >= sizeof mine - 12 || strchr(payload, '\n'))
        return;
    snprintf(mine + len, sizeof mine - (size_t)len, "|%08x\n", qm__fnv1a(mine, (size_t)len));
    if (snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid()) >= (int)sizeof tmp)
        return;
    FILE *f = fopen(tmp, "w");
    if (!f)
        return;
    int bad = 0;
    for (size_t t = 0; t < sizeof qm__cache_tags / sizeof qm__cache_tags[0]; t++) {
        char pre[40];
        snprintf(pre, sizeof pre, "%s ", qm__cache_tags[t]);
        if (strcmp(qm__cache_tags[t], tag) == 0) {
            bad |= fputs(mine, f) < 0;
            continue;
        }
        for (int i = 0; i < n; i++) /* the others' whole lines, as they are */
            if (strncmp(lines[i], pre, strlen(pre)) == 0 && qm__line_whole(lines[i])) {
                bad |= fputs(lines[i], f) < 0;
                break;
            }
    }
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, path) != 0)
        remove(tmp);
}

int qm__cache_load(const char *path, const char *tag, const char *const *cands, int nc, int out[4])
{
    char payload[QM__CACHE_LINE], want[512], names[4][32];
    if (qm__cache_get(path, tag, payload, sizeof payload) != 0)
        return -1;
    int o = 0;
    for (int c = 0; c < nc && o >= 0 && (size_t)o < sizeof want; c++)
        o += snprintf(want + o, sizeof want - (size_t)o, "%s%s", c ? "," : "", cands[c]);
    size_t wl = strlen(want);
    int ok = strncmp(payload, want, wl) == 0 && payload[wl] == '|' &&
             sscanf(payload + wl + 1, "%31s %31s %31s %31s", names[0], names[1], names[2],
                    names[3]) == 4;
    for (int k = 0; ok && k < 4; k++) {
        out[k] = -1;
        for (int c = 0; c < nc; c++)
            if (strcmp(cands[c], names[k]) == 0)
                out[k] = c;
        ok = out[k] >= 0;
    }
    if (!ok)
        fprintf(stderr, "qmoe: kernel cache %s: its %s line is for another kernel set; measured "
                        "again\n", path, tag);
    return ok ? 0 : -1;
}

void qm__cache_save(const char *path, const char *tag, const char *const *cands, int nc,
                    const int ch[4])
{
    char payload[QM__CACHE_LINE];
    int o = 0;
    for (int c = 0; c < nc && o >= 0 && (size_t)o < sizeof payload; c++)
        o += snprintf(payload + o, sizeof payload - (size_t)o, "%s%s", c ? "," : "", cands[c]);
    if (o < 0 || (size_t)o >= sizeof payload)
        return;
    if (snprintf(payload + o, sizeof payload - (size_t)o, "|%s %s %s %s", cands[ch[0]],
                 cands[ch[1]], cands[ch[2]], cands[ch[3]]) >= (int)(sizeof payload - (size_t)o))
        return;
    qm__cache_put(path, tag, payload);
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
