#include "config.h"

#include <errno.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../proto/errors.h"
#include "log.h"

#ifndef PB_VERSION
#define PB_VERSION "0"
#endif

int pb_parse_size(const char *s, size_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *s == '-')
        return -1;
    unsigned shift = 0;
    switch (*end) {
    case 0: break;
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    case 't': case 'T': shift = 40; end++; break;
    default: return -1;
    }
    if (*end == 'i' || *end == 'B')
        end += (*end == 'i') + (end[*end == 'i'] == 'B');
    if (*end || (shift && v > (SIZE_MAX >> shift)))
        return -1;
    *out = (size_t)(v << shift);
    return 0;
}

int pb_device_parse(const char *s, size_t len, pb_device_t *d)
{
    if (len == 3 && memcmp(s, "cpu", 3) == 0) {
        *d = (pb_device_t){PB_DEV_CPU, 0};
        return 0;
    }
    if (len == 4 && memcmp(s, "cuda", 4) == 0) {
        *d = (pb_device_t){PB_DEV_CUDA, 0};
        return 0;
    }
    if (len > 5 && len < 9 && memcmp(s, "cuda:", 5) == 0) {
        int n = 0;
        for (size_t i = 5; i < len; i++) {
            if (s[i] < '0' || s[i] > '9')
                return PB_EINVALID_ARGUMENT;
            n = n * 10 + (s[i] - '0');
        }
        *d = (pb_device_t){PB_DEV_CUDA, n};
        return 0;
    }
    return PB_EINVALID_ARGUMENT;
}

/* The contract's chain.  systemd joins several RuntimeDirectory= entries
 * with ':'; the first is ours.  -1 when the path does not fit. */
static int default_socket(char *buf, size_t len)
{
    const char *e;
    int n;
    if ((e = getenv("PULLBACKD_SOCKET")) && *e)
        n = snprintf(buf, len, "%s", e);
    else if ((e = getenv("RUNTIME_DIRECTORY")) && *e)
        n = snprintf(buf, len, "%.*s/pullbackd.sock", (int)strcspn(e, ":"), e);
    else if ((e = getenv("XDG_RUNTIME_DIR")) && *e)
        n = snprintf(buf, len, "%s/pullbackd.sock", e);
    else
        n = snprintf(buf, len, "/tmp/pullbackd-%u.sock", (unsigned)getuid());
    return n < 0 || (size_t)n >= len ? -1 : 0;
}

/* ---- the settings ------------------------------------------------------- */

enum kind { K_SOCKET, K_MODE, K_DEVICE, K_WORKERS, K_SIZE, K_SECONDS, K_LOG };

/* One row per setting: flags, file keys, pb_config_diff and the reload all
 * read this table.  min: the smallest value a K_SIZE takes. */
static const struct key {
    const char *name;
    enum kind kind;
    size_t off;
    size_t min;
    bool reloadable;
} keys[] = {
    {"socket", K_SOCKET, offsetof(pb_config_t, socket_path), 0, false},
    {"socket-mode", K_MODE, offsetof(pb_config_t, socket_mode), 0, false},
    {"device", K_DEVICE, offsetof(pb_config_t, device), 0, false},
    {"workers", K_WORKERS, offsetof(pb_config_t, workers), 0, false},
    {"max-message-bytes", K_SIZE, offsetof(pb_config_t, max_message_bytes), 1024, true},
    {"max-tape-bytes", K_SIZE, offsetof(pb_config_t, max_tape_bytes), 0, true},
    {"max-tape-bytes-per-uid", K_SIZE, offsetof(pb_config_t, max_tape_bytes_per_uid), 0, true},
    {"max-tapes-per-connection", K_SIZE, offsetof(pb_config_t, max_tapes_per_connection), 1, true},
    {"max-inflight-per-connection", K_SIZE, offsetof(pb_config_t, max_inflight_per_connection), 1, true},
    {"max-buffers-per-connection", K_SIZE, offsetof(pb_config_t, max_buffers_per_connection), 0, true},
    {"max-buffer-bytes-per-connection", K_SIZE, offsetof(pb_config_t, max_buffer_bytes_per_connection), 0, true},
    {"drain-timeout", K_SECONDS, offsetof(pb_config_t, drain_timeout_s), 0, true},
    {"log-level", K_LOG, offsetof(pb_config_t, log_level), 0, true},
};
enum { NKEYS = sizeof keys / sizeof keys[0] };

static void defaults(pb_config_t *c)
{
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    *c = (pb_config_t){
        .socket_mode = 0660,
        .device = {PB_DEV_CPU, 0},
        .workers = ncpu > 0 ? (int)ncpu : 1,
        .max_message_bytes = 256u << 20,
        .max_tape_bytes = (size_t)4 << 30,
        .max_tape_bytes_per_uid = (size_t)4 << 30,
        .max_tapes_per_connection = 65536,
        .max_inflight_per_connection = 1024,
        .max_buffers_per_connection = 64,
        .max_buffer_bytes_per_connection = (size_t)64 << 30,
        .drain_timeout_s = 30,
        .log_level = PB_LOG_INFO,
    };
}

static int find_key(const char *name)
{
    for (int i = 0; i < NKEYS; i++)
        if (strcmp(keys[i].name, name) == 0)
            return i;
    return -1;
}

static int bad(char *err, size_t errlen, const char *fmt, const char *got)
{
    snprintf(err, errlen, fmt, got);
    return PB_EINVALID_ARGUMENT;
}

static int set_index(pb_config_t *c, int k, const char *v, char *err, size_t errlen)
{
    const struct key *key = &keys[k];
    void *field = (char *)c + key->off;
    char *end;
    switch (key->kind) {
    case K_SOCKET:
        if (*v == 0 || strlen(v) >= sizeof c->socket_path)
            return bad(err, errlen, "expected a path of 1 to 107 bytes, got '%.200s'", v);
        snprintf(c->socket_path, sizeof c->socket_path, "%s", v);
        return 0;
    case K_MODE: {
        errno = 0;
        long m = strtol(v, &end, 8);
        if (errno || end == v || *end || m < 0 || m > 0777)
            return bad(err, errlen, "expected an octal mode such as 0660, got '%.200s'", v);
        *(int *)field = (int)m;
        return 0;
    }
    case K_DEVICE:
        if (pb_device_parse(v, strlen(v), field))
            return bad(err, errlen, "expected cpu, cuda or cuda:N, got '%.200s'", v);
        return 0;
    case K_WORKERS: {
        errno = 0;
        long n = strtol(v, &end, 10);
        if (errno || end == v || *end || n < 1 || n > 1024)
            return bad(err, errlen, "expected 1..1024, got '%.200s'", v);
        *(int *)field = (int)n;
        return 0;
    }
    case K_SIZE: {
        size_t sz;
        if (pb_parse_size(v, &sz))
            return bad(err, errlen, "expected a size such as 4096, 64K, 256M or 4G, got '%.200s'", v);
        if (sz < key->min) {
            snprintf(err, errlen, "expected at least %zu, got '%.200s'", key->min, v);
            return PB_EINVALID_ARGUMENT;
        }
        *(size_t *)field = sz;
        return 0;
    }
    case K_SECONDS: {
        errno = 0;
        double s = strtod(v, &end);
        if (errno || end == v || *end || !(s >= 0) || s > 1e9)
            return bad(err, errlen, "expected seconds >= 0, got '%.200s'", v);
        *(double *)field = s;
        return 0;
    }
    case K_LOG: {
        int l = pb_log_parse_level(v);
        if (l < 0)
            return bad(err, errlen, "expected error, warning, notice, info or debug, got '%.200s'", v);
        *(int *)field = l;
        return 0;
    }
    }
    return PB_EINVALID_ARGUMENT;
}

int pb_config_set(pb_config_t *c, const char *key, const char *value, char *err, size_t errlen)
{
    int k = find_key(key);
    if (k < 0)
        return bad(err, errlen, "unknown setting '%.100s'", key);
    return set_index(c, k, value, err, errlen);
}

static void format_value(const pb_config_t *c, int k, char *buf, size_t len)
{
    const void *field = (const char *)c + keys[k].off;
    switch (keys[k].kind) {
    case K_SOCKET: snprintf(buf, len, "%s", c->socket_path); break;
    case K_MODE: snprintf(buf, len, "%04o", (unsigned)*(const int *)field); break;
    case K_DEVICE:
        if (c->device.kind == PB_DEV_CPU)
            snprintf(buf, len, "cpu");
        else
            snprintf(buf, len, "cuda:%d", c->device.index);
        break;
    case K_WORKERS: snprintf(buf, len, "%d", *(const int *)field); break;
    case K_SIZE: snprintf(buf, len, "%zu", *(const size_t *)field); break;
    case K_SECONDS: snprintf(buf, len, "%g", *(const double *)field); break;
    case K_LOG: snprintf(buf, len, "%s", pb_log_level_name(*(const int *)field)); break;
    }
}

void pb_config_diff(const pb_config_t *a, const pb_config_t *b,
                    void (*fn)(const char *key, const char *from, const char *to, bool reloadable, void *ctx),
                    void *ctx)
{
    for (int k = 0; k < NKEYS; k++) {
        char x[128], y[128];
        format_value(a, k, x, sizeof x);
        format_value(b, k, y, sizeof y);
        if (strcmp(x, y) != 0)
            fn(keys[k].name, x, y, keys[k].reloadable, ctx);
    }
}

/* ---- the config file ---------------------------------------------------- */

static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r' || s[n - 1] == '\n'))
        s[--n] = 0;
    return s;
}

/* One line, already trimmed and not a comment. */
static int file_line(pb_config_t *c, char *s, unsigned skip_mask, int lineno, int *seen, char *err, size_t errlen)
{
    for (char *h = s + 1; *h; h++)
        if (*h == '#' && (h[-1] == ' ' || h[-1] == '\t')) {
            *h = 0;
            break;
        }
    char *eq = strchr(s, '=');
    if (eq == NULL)
        return bad(err, errlen, "expected 'key = value', got '%.100s'", s);
    *eq = 0;
    char *name = trim(s), *value = trim(eq + 1);
    for (char *p = name; *p; p++)
        if (*p == '_')
            *p = '-';
    int k = find_key(name);
    if (k < 0)
        return bad(err, errlen,
                   "unknown key '%.100s' (keys are the long flags without --, such as max-tape-bytes)", name);
    if (seen[k]) {
        snprintf(err, errlen, "%s: given twice (first on line %d)", keys[k].name, seen[k]);
        return PB_EINVALID_ARGUMENT;
    }
    seen[k] = lineno;
    if (*value == 0) {
        snprintf(err, errlen, "%s: missing value", keys[k].name);
        return PB_EINVALID_ARGUMENT;
    }
    /* A key the flags override is still checked: a bad file is an error
     * whatever the flags say, or it would surface only once they change. */
    pb_config_t scratch = *c;
    char why[300];
    int rc = set_index(skip_mask & (1u << k) ? &scratch : c, k, value, why, sizeof why);
    if (rc)
        snprintf(err, errlen, "%s: %s", keys[k].name, why);
    return rc;
}

int pb_config_read_file(pb_config_t *c, const char *path, bool required, unsigned skip_mask, char *err,
                        size_t errlen)
{
    FILE *f = fopen(path, "re");
    if (f == NULL) {
        if (errno == ENOENT && !required)
            return 0;
        snprintf(err, errlen, "%.200s: %s", path, strerror(errno));
        return PB_EINVALID_ARGUMENT;
    }
    int seen[NKEYS] = {0};
    char *line = NULL;
    size_t cap = 0;
    int rc = 0, lineno = 0;
    while (rc == 0 && getline(&line, &cap, f) >= 0) {
        char *s = trim(line);
        lineno++;
        if (*s == 0 || *s == '#')
            continue;
        char why[400];
        if ((rc = file_line(c, s, skip_mask, lineno, seen, why, sizeof why)))
            snprintf(err, errlen, "%.200s:%d: %s", path, lineno, why);
    }
    if (rc == 0 && ferror(f)) {
        snprintf(err, errlen, "%.200s: %s", path, strerror(errno));
        rc = PB_EINVALID_ARGUMENT;
    }
    free(line);
    fclose(f);
    if (rc == 0)
        snprintf(c->config_file, sizeof c->config_file, "%s", path);
    return rc;
}

/* ---- flags -------------------------------------------------------------- */

static const char usage[] =
    "Usage: pullbackd [OPTION]...\n"
    "Serve automatic-differentiation rules over msgpack-RPC on a Unix socket.\n\n"
    "  --config PATH                   settings file, one 'key = value' a line, keys as the\n"
    "                                  flags below without -- (default " PB_CONFIG_FILE ",\n"
    "                                  which may be missing); flags win over the file\n"
    "  --socket PATH                   socket path (default: $PULLBACKD_SOCKET,\n"
    "                                  $RUNTIME_DIRECTORY/pullbackd.sock, $XDG_RUNTIME_DIR/pullbackd.sock,\n"
    "                                  /tmp/pullbackd-$UID.sock); a socket passed by systemd wins\n"
    "  --socket-mode MODE              octal mode of the socket file (default 0660)\n"
    "  --device DEV                    default device: cpu, cuda, cuda:N (default cpu)\n"
    "  --workers N                     worker threads (default: number of CPUs)\n"
    "  --max-message-bytes N           largest message accepted (default 256M)\n"
    "  --max-tape-bytes N              tape bytes held in total (default 4G)\n"
    "  --max-tape-bytes-per-uid N      tape bytes held per uid (default 4G)\n"
    "  --max-tapes-per-connection N    tapes created by one connection (default 65536)\n"
    "  --max-inflight-per-connection N requests in flight per connection before the\n"
    "                                  daemon stops reading from it (default 1024)\n"
    "  --max-buffers-per-connection N  shared-memory buffers registered by one connection\n"
    "                                  (default 64; 0 turns register_buffer off)\n"
    "  --max-buffer-bytes-per-connection N\n"
    "                                  their sizes summed: address space the daemon maps (default 64G)\n"
    "  --drain-timeout S               seconds to finish in-flight work on SIGTERM (default 30)\n"
    "  --log-level LEVEL               error, warning, notice, info, debug (default info)\n"
    "  --version                       print the version and exit\n"
    "  --help                          print this help and exit\n"
    "Sizes take K, M, G suffixes (binary).  SIGHUP reloads the file: limits, drain-timeout\n"
    "and log-level change in place; socket, socket-mode, device and workers need a restart.\n";

enum { O_CONFIG = 100, O_VERSION, O_HELP };

/* getopt's table: a setting's val is its row in keys. */
static const struct option opts[] = {
    {"socket", required_argument, 0, 0},
    {"socket-mode", required_argument, 0, 1},
    {"device", required_argument, 0, 2},
    {"workers", required_argument, 0, 3},
    {"max-message-bytes", required_argument, 0, 4},
    {"max-tape-bytes", required_argument, 0, 5},
    {"max-tape-bytes-per-uid", required_argument, 0, 6},
    {"max-tapes-per-connection", required_argument, 0, 7},
    {"max-inflight-per-connection", required_argument, 0, 8},
    {"max-buffers-per-connection", required_argument, 0, 9},
    {"max-buffer-bytes-per-connection", required_argument, 0, 10},
    {"drain-timeout", required_argument, 0, 11},
    {"log-level", required_argument, 0, 12},
    {"config", required_argument, 0, O_CONFIG},
    {"version", no_argument, 0, O_VERSION},
    {"help", no_argument, 0, O_HELP},
    {0, 0, 0, 0},
};
_Static_assert(sizeof opts / sizeof opts[0] == NKEYS + 4, "one flag per setting");

int pb_config_load(pb_config_t *out, int argc, char **argv, const char *default_file, char *err, size_t errlen)
{
    pb_config_t c;
    defaults(&c);
    const char *file = default_file;
    bool required = false;
    unsigned flags = 0;
    int ch;
    /* First pass: where the file is, and which settings the flags take
     * over.  optind = 0 makes glibc start afresh (a reload parses again). */
    opterr = 0;
    optind = 0;
    while ((ch = getopt_long(argc, argv, ":", opts, NULL)) != -1) {
        if (ch == ':')
            return bad(err, errlen, "%s: missing value", argv[optind - 1]);
        if (ch == '?')
            return bad(err, errlen, "unknown option '%.100s' (see --help)", argv[optind - 1]);
        if (ch == O_HELP) {
            fputs(usage, stdout);
            return 1;
        }
        if (ch == O_VERSION) {
            printf("pullbackd %s\n", PB_VERSION);
            return 1;
        }
        if (ch == O_CONFIG) {
            file = optarg;
            required = true;
        } else {
            flags |= 1u << ch;
        }
    }
    if (optind < argc)
        return bad(err, errlen, "unexpected argument '%.100s'", argv[optind]);
    if (file && *file) {
        int rc = pb_config_read_file(&c, file, required, flags, err, errlen);
        if (rc)
            return rc;
    } else if (file && required) {
        return bad(err, errlen, "--config: missing path%s", "");
    }
    /* Second pass: the flags, over the file. */
    optind = 0;
    while ((ch = getopt_long(argc, argv, ":", opts, NULL)) != -1) {
        if (ch >= NKEYS)
            continue;
        char why[300];
        if (set_index(&c, ch, optarg, why, sizeof why)) {
            snprintf(err, errlen, "--%s: %s", keys[ch].name, why);
            return PB_EINVALID_ARGUMENT;
        }
    }
    optind = 1;
    if (c.socket_path[0] == 0 && default_socket(c.socket_path, sizeof c.socket_path)) {
        snprintf(err, errlen, "the socket path from the environment is longer than %zu bytes; use --socket",
                 sizeof c.socket_path - 1);
        return PB_EINVALID_ARGUMENT;
    }
    *out = c;
    return 0;
}
