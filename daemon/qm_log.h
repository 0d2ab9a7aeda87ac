/* qm_log.h - the daemon's log: one line per message on stderr (journald
 * priorities under systemd). Process-wide; any thread may call qm_log. */
#ifndef QM_LOG_H
#define QM_LOG_H

enum { QM_LOG_ERR = 3, QM_LOG_WARNING = 4, QM_LOG_NOTICE = 5, QM_LOG_INFO = 6, QM_LOG_DEBUG = 7 };

void qm_log_init(void); /* reads JOURNAL_STREAM: journal prefixes or timestamps */
void qm_log_set_level(int level);
int qm_log_level_parse(const char *name, int *out); /* "error".."debug" */
void qm_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
