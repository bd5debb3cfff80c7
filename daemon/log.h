/* Logging to stderr with sd-daemon priority prefixes (<3> error ... <7>
 * debug), which journald turns into levels.  Loop thread and workers may
 * both log; each line is written with one write().
 *
 * What each level carries: error, a failure of the daemon itself (startup,
 * a bad reload); warning, something abandoned or refused that an operator
 * should see; notice, start, stop, drain, reloads, protocol violations;
 * info (the default level), one line per connection opened and closed with
 * the peer's uid and pid; debug, one line per failed request.  Nothing is
 * logged per request at the default level, and what one client's messages
 * make the daemon log goes through pb_conn_log (conn.h), which bounds the
 * lines a connection may cause.  pb_log_level is written only by the loop
 * thread (start and SIGHUP). */
#ifndef PB_LOG_H
#define PB_LOG_H

#include <stdarg.h>

enum { PB_LOG_ERR = 3, PB_LOG_WARNING = 4, PB_LOG_NOTICE = 5, PB_LOG_INFO = 6, PB_LOG_DEBUG = 7 };

extern int pb_log_level;
/* "error", "warning", "notice", "info", "debug" -> level; -1 if unknown. */
int pb_log_parse_level(const char *s);
/* The name of a level 3..7 ("?" for anything else). */
const char *pb_log_level_name(int level);
void pb_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void pb_vlog(int level, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

#endif
