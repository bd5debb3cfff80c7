/* Logging to stderr with sd-daemon priority prefixes (<3> error ... <7>
 * debug), which journald turns into levels.  Loop thread and workers may
 * both log; each line is written with one write(). */
#ifndef PB_LOG_H
#define PB_LOG_H

enum { PB_LOG_ERR = 3, PB_LOG_WARNING = 4, PB_LOG_NOTICE = 5, PB_LOG_INFO = 6, PB_LOG_DEBUG = 7 };

extern int pb_log_level;
/* "error", "warning", "notice", "info", "debug" -> level; -1 if unknown. */
int pb_log_parse_level(const char *s);
void pb_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
