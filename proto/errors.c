#include "errors.h"

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
