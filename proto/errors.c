#include "errors.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

const char *pb_strerror_code(int code)
{
    switch (code) {
#define PB_X(sym, num, wire, msg) case PB_E##sym: return wire;
    PB_ERROR_TABLE(PB_X)
#undef PB_X
    default: return "internal";
    }
}

const char *pb_strerror(int code)
{
    switch (code) {
#define PB_X(sym, num, wire, msg) case PB_E##sym: return msg;
    PB_ERROR_TABLE(PB_X)
#undef PB_X
    default: return "unknown error";
    }
}

size_t pb_utf8_char(const char *str, size_t len)
{
    const unsigned char *s = (const unsigned char *)str;
    if (len == 0)
        return 0;
    unsigned c = s[0], min;
    size_t n;
    if (c < 0x80)
        return 1;
    if ((c & 0xe0) == 0xc0)
        n = 1, min = 0x80, c &= 0x1f;
    else if ((c & 0xf0) == 0xe0)
        n = 2, min = 0x800, c &= 0x0f;
    else if ((c & 0xf8) == 0xf0)
        n = 3, min = 0x10000, c &= 0x07;
    else
        return 0;
    if (n >= len)
        return 0;
    for (size_t k = 1; k <= n; k++) {
        if ((s[k] & 0xc0) != 0x80)
            return 0;
        c = c << 6 | (s[k] & 0x3f);
    }
    if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff))
        return 0;
    return n + 1;
}

const char *pb_quote(pb_quoted_t *q, const char *s, size_t len)
{
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        size_t n = pb_utf8_char(s + i, len - i);
        if (i + (n ? n : 1) > PB_QUOTE_MAX) {
            memcpy(q->s + o, "...", 3);
            o += 3;
            break;
        }
        unsigned char c = (unsigned char)s[i];
        if (n == 0 || c < 0x20 || c == 0x7f || c == '\\') {
            o += (size_t)snprintf(q->s + o, sizeof q->s - o, "\\x%02x", c);
            i++;
        } else {
            memcpy(q->s + o, s + i, n);
            o += n;
            i += n;
        }
    }
    q->s[o] = 0;
    return q->s;
}

/* A string cut at size - 1 bytes may end inside a character: that
 * character goes. */
static void cut_whole(char *s, size_t size)
{
    size_t len = strlen(s), lead = len;
    if (len + 1 < size)
        return;
    while (lead > 0 && len - lead < 4)
        if (((unsigned char)s[--lead] & 0xc0) != 0x80)
            break;
    if (pb_utf8_char(s + lead, len - lead) != len - lead)
        s[lead] = 0;
}

int pb_err_set(pb_err_t *err, int code, const char *arg, const char *fmt, ...)
{
    if (err == NULL)
        return code;
    err->code = code;
    err->has_info = 0;
    err->info = 0;
    snprintf(err->arg, sizeof err->arg, "%s", arg ? arg : "");
    cut_whole(err->arg, sizeof err->arg);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof err->message)
        cut_whole(err->message, sizeof err->message);
    return code;
}

int pb_err_from_sys(int sys)
{
    switch (-sys) {
    case 0: return 0;
    case ENOMEM: return PB_ENOMEM;
    case EACCES:
    case EPERM: return PB_EPERMISSION_DENIED;
    case EAGAIN:
    case EMFILE:
    case ENFILE:
    case ENOSPC:
    case ENOBUFS: return PB_ERESOURCE_EXHAUSTED;
    case EINVAL:
    case EEXIST:
    case EADDRINUSE:
    case ENOENT:
    case ENOTDIR:
    case ENAMETOOLONG:
    case ENOTSOCK: return PB_EINVALID_ARGUMENT;
    default: return PB_EINTERNAL;
    }
}
