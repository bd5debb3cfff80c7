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

int pb_err_set(pb_err_t *err, int code, const char *arg, const char *fmt, ...)
{
    if (err == NULL)
        return code;
    err->code = code;
    err->has_info = 0;
    err->info = 0;
    snprintf(err->arg, sizeof err->arg, "%s", arg ? arg : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
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
