/* qm_log.c - one line per message on stderr.
 *
 * Under systemd (JOURNAL_STREAM names our stderr) lines carry the "<N>"
 * priority prefix journald parses and no timestamp (journald keeps its own);
 * elsewhere they carry an ISO-8601 UTC timestamp and the level's name. */
#include "qm_log.h"

#include <stdarg.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "qm_error.h"

static int log_level = QM_LOG_INFO;
static int journal_stream;

void qm_log_init(void)
{
    const char *js = getenv("JOURNAL_STREAM");
    struct stat sb;
    unsigned long long dev, ino;
    journal_stream = 0;
    if (js && sscanf(js, "%llu:%llu", &dev, &ino) == 2 && fstat(STDERR_FILENO, &sb) == 0 &&
        (unsigned long long)sb.st_dev == dev && (unsigned long long)sb.st_ino == ino)
        journal_stream = 1;
    setvbuf(stderr, NULL, _IOLBF, 0);
}

void qm_log_set_level(int level) { log_level = level; }

static const char *const level_names[8] = {"emerg",   "alert",  "crit", "error",
                                           "warning", "notice", "info", "debug"};

int qm_log_level_parse(const char *name, int *out)
{
    for (int i = QM_LOG_ERR; i <= QM_LOG_DEBUG; i++) {
        if (strcmp(name, level_names[i]) == 0) {
            *out = i;
            return 0;
        }
    }
    if (strcmp(name, "err") == 0) {
        *out = QM_LOG_ERR;
        return 0;
    }
    return QM_EINVAL;
}

void qm_log(int level, const char *fmt, ...)
{
    if (level > log_level)
        return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* One write per line keeps lines whole when workers log too; no control
     * character a client put in a name it gave (a record_trace file name, a
     * model name) can start a line of its own or reach an operator's
     * terminal (\r, escape sequences). */
    for (char *p = msg; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
            *p = ' ';
    if (journal_stream) {
        fprintf(stderr, "<%d>%s\n", level, msg);
        return;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char when[32];
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
    fprintf(stderr, "%s.%03ldZ qmoed[%d] %s: %s\n", when, ts.tv_nsec / 1000000, (int)getpid(),
            level_names[level & 7], msg);
}
