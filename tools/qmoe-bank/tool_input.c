/* tool_input.c - input files, failure lines and interrupts (see tool_input.h),
 * and the small helpers every command shares (qmoe_bank_tool.h). */
#include "tool_input.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qm_json.h"
#include "qmoe_bank_tool.h"

int qm__open_input(const char *path, const char *what, int *fd, uint64_t *size, qm_status *st)
{
    *fd = -1;
    *size = 0;
    int f = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (f < 0) {
        int e = errno;
        int bad = e == ENOENT || e == ELOOP || e == ENOTDIR || e == EACCES || e == ENXIO ||
                  e == ENAMETOOLONG || e == EISDIR;
        return qm_status_set(st,
                             e == ENOENT ? QM_ENOT_FOUND
                             : bad       ? QM_EINVALID_MODEL
                                         : QM_EIO,
                             "cannot open %.200s: %s", what, strerror(e));
    }
    struct stat sb;
    if (fstat(f, &sb) != 0) {
        int e = errno;
        close(f);
        return qm_status_set(st, QM_EIO, "cannot stat %.200s: %s", what, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(f);
        return qm_status_set(st, QM_EINVALID_MODEL, "%.200s is %s, not a regular file", what,
                             S_ISDIR(sb.st_mode)                          ? "a directory"
                             : S_ISFIFO(sb.st_mode)                       ? "a FIFO"
                             : S_ISCHR(sb.st_mode) || S_ISBLK(sb.st_mode) ? "a device"
                                                                          : "a special file");
    }
    /* Reads of a regular file never block; clear the flag anyway, so the
     * descriptor behaves as an ordinary one. */
    int flags = fcntl(f, F_GETFL);
    if (flags >= 0) fcntl(f, F_SETFL, flags & ~O_NONBLOCK);
    *fd = f;
    *size = (uint64_t)sb.st_size;
    return 0;
}

static void put_escaped(FILE *f, const char *s)
{
    for (const unsigned char *c = (const unsigned char *)s; *c; c++)
        if (*c >= 0x20 && *c < 0x7f)
            fputc(*c, f);
        else
            fprintf(f, "\\x%02x", *c);
}

void qm__print_line(FILE *f, const char *who, ...)
{
    char line[2048];
    size_t at = (size_t)snprintf(line, sizeof line, "qmoe-bank %s: ", who);
    va_list ap;
    va_start(ap, who);
    for (const char *p = va_arg(ap, const char *); p && at < sizeof line;
         p = va_arg(ap, const char *))
        at += (size_t)snprintf(line + at, sizeof line - at, "%s", p);
    va_end(ap);
    /* "qmoe-bank WHO: " is ours; everything after it may quote the file. */
    size_t head = strlen("qmoe-bank ") + strlen(who) + 2;
    if (head > strlen(line)) head = strlen(line);
    fwrite(line, 1, head, f);
    put_escaped(f, line + head);
    fputc('\n', f);
}

static volatile sig_atomic_t interrupted;

static void on_interrupt(int sig)
{
    interrupted = sig;
}

void qm__catch_interrupts(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_interrupt;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

int qm__interrupted(void)
{
    return interrupted;
}

void qm__reraise(void)
{
    int sig = interrupted;
    if (!sig) return;
    signal(sig, SIG_DFL);
    raise(sig);
}

/* ---- helpers of every command (qmoe_bank_tool.h) ---- */

int qm__usage(const char *cmd, const char *what)
{
    fprintf(stderr, "qmoe-bank %s: %s (see qmoe-bank %s --help)\n", cmd, what, cmd);
    return QM__EXIT_USAGE;
}

int qm__parse_u32(const char *s, unsigned long long max, unsigned *out)
{
    if (!s || !*s) return -1;
    unsigned long long v = 0;
    for (const char *p = s; *p; p++) {
        if (*p < '0' || *p > '9') return -1;
        v = v * 10 + (unsigned long long)(*p - '0');
        if (v > max || v > 0xffffffffull) return -1;
    }
    *out = (unsigned)v;
    return 0;
}

int qm__parse_scale_dtype(const char *s, qm_dtype *out)
{
    if (strcmp(s, "f32") == 0)
        *out = QM_DTYPE_F32;
    else if (strcmp(s, "f16") == 0)
        *out = QM_DTYPE_F16;
    else if (strcmp(s, "bf16") == 0)
        *out = QM_DTYPE_BF16;
    else
        return -1;
    return 0;
}

static void file_put(void *ctx, const char *bytes, size_t n) { fwrite(bytes, 1, n, ctx); }

void qm__json_string(FILE *f, const char *s)
{
    fputc('"', f);
    qm_json_escape_to(s, strlen(s), file_put, f);
    fputc('"', f);
}
