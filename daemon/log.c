#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int pb_log_level = PB_LOG_INFO;

static const char *const names[] = {"emerg", "alert", "crit", "error", "warning", "notice", "info", "debug"};

int pb_log_parse_level(const char *s)
{
    for (int i = 3; i < 8; i++)
        if (strcmp(s, names[i]) == 0)
            return i;
    if (strcmp(s, "warn") == 0)
        return PB_LOG_WARNING;
    return -1;
}

const char *pb_log_level_name(int level)
{
    return level >= 3 && level <= 7 ? names[level] : "?";
}

void pb_log(int level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    pb_vlog(level, fmt, ap);
    va_end(ap);
}

void pb_vlog(int level, const char *fmt, va_list ap)
{
    if (level > pb_log_level)
        return;
    /* The journal reads the level from a "<N>" prefix (sd-daemon.h); a
     * person at a terminal reads its name. */
    static _Atomic int tty = -1;
    if (tty < 0)
        tty = isatty(STDERR_FILENO);
    char line[1024];
    int n = tty ? snprintf(line, sizeof line, "pullbackd %s: ", pb_log_level_name(level))
                : snprintf(line, sizeof line, "<%d>", level);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2)
        len = sizeof line - 2;
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}
