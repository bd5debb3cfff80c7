/* Error codes of pullbackd.
 *
 * One X-macro table gives every error its negative PB_E* code, its wire
 * name (PROTOCOL section 5) and a default message.  Functions return 0 on
 * success or a negative PB_E* code; the text for the client is built next
 * to the failure (pb_err_t) and travels with the code. */
#ifndef PB_ERRORS_H
#define PB_ERRORS_H

#include <stdarg.h>
#include <stddef.h>

#define PB_ERROR_TABLE(X)                                                   \
    X(PARSE, 1, "parse_error", "message could not be framed")              \
    X(INVALID_REQUEST, 2, "invalid_request", "not a msgpack-RPC request")  \
    X(UNKNOWN_METHOD, 3, "unknown_method", "unknown method")               \
    X(UNKNOWN_OP, 4, "unknown_op", "unknown op")                           \
    X(INVALID_ARGUMENT, 5, "invalid_argument", "invalid argument")         \
    X(SHAPE_MISMATCH, 6, "shape_mismatch", "shape mismatch")               \
    X(DTYPE_MISMATCH, 7, "dtype_mismatch", "dtype mismatch")               \
    X(UNKNOWN_TAPE, 8, "unknown_tape", "unknown tape")                     \
    X(PERMISSION_DENIED, 9, "permission_denied", "permission denied")      \
    X(RESOURCE_EXHAUSTED, 10, "resource_exhausted", "resource exhausted")  \
    X(DEVICE_UNAVAILABLE, 11, "device_unavailable", "device unavailable")  \
    X(NUMERICAL, 12, "numerical_error", "numerical error")                 \
    X(GAUGE_DEPENDENT, 13, "gauge_dependent", "gauge-dependent cotangent") \
    X(SHUTTING_DOWN, 14, "shutting_down", "server is shutting down")       \
    X(INTERNAL, 15, "internal", "internal error")                          \
    X(NOMEM, 16, "internal", "out of memory")

enum {
#define PB_X(sym, num, wire, msg) PB_E##sym = -(num),
    PB_ERROR_TABLE(PB_X)
#undef PB_X
};

/* Wire name of a code ("internal" for anything unknown). */
const char *pb_strerror_code(int code);
/* Default English text of a code. */
const char *pb_strerror(int code);

/* A code with the message and details that go to the client.  Lives in the
 * request; the strings are fixed-size buffers, so filling one never
 * allocates and cannot fail. */
typedef struct pb_err {
    int code;
    char message[256];
    char arg[64];     /* the argument at fault, "" if none */
    long long info;   /* LAPACK info and similar; has_info says if set */
    int has_info;
} pb_err_t;

/* The PB_E* code for a system error: a libuv code (UV_E*) or a negative
 * errno, which libuv's codes are on Unix.  For the boundary where pool.c
 * and server.c call libuv, pthreads or the kernel: the caller logs the
 * original text (uv_strerror) where the failure happens and returns only
 * this.  0 stays 0; anything without a closer meaning is PB_EINTERNAL. */
int pb_err_from_sys(int sys);

/* Fill err (if not NULL) and return code, so callers can write
 * `return pb_err_set(err, PB_EINVALID_ARGUMENT, "x", "...", ...);`. */
int pb_err_set(pb_err_t *err, int code, const char *arg, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* The length of the valid UTF-8 character at s (1 to 4 bytes; len bytes
 * are there), 0 when s starts none: a stray continuation byte, a cut or
 * overlong sequence, a surrogate, past U+10FFFF. */
size_t pb_utf8_char(const char *s, size_t len);

/* A client's string quoted for an error message (err->message goes out
 * as a msgpack str, which must be UTF-8): its first PB_QUOTE_MAX bytes,
 * cut before a character and then "...", with each byte that starts no
 * valid character, each control character (NUL too) and a backslash
 * written \xNN.  The text lives in *q. */
#define PB_QUOTE_MAX 40
typedef struct pb_quoted {
    char s[4 * PB_QUOTE_MAX + 4];
} pb_quoted_t;
const char *pb_quote(pb_quoted_t *q, const char *s, size_t len);
/* A pb_quoted_t that lives to the end of the enclosing block: for one
 * quote in an error call, pb_quote(PB_QUOTED, s, len). */
#define PB_QUOTED (&(pb_quoted_t){{0}})

#endif
