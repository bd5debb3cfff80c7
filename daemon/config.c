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
    /* A digit first: strtoull would skip blanks and take a sign, and
     * " -1" would wrap to 2^64 - 1. */
    if (*s < '0' || *s > '9')
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno)
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
    /* 4Gi, 4GiB and 4GB are 4G too (binary, as --help says); a bare
     * number takes no letters. */
    if (shift && *end == 'i')
        end++;
    if (shift && *end == 'B')
        end++;
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
    else if ((e = getenv("RUNTIME_DIRECTORY")) && strcspn(e, ":") > 0) /* an empty first entry: the next link */
        n = snprintf(buf, len, "%.*s/pullbackd.sock", (int)strcspn(e, ":"), e);
    else if ((e = getenv("XDG_RUNTIME_DIR")) && *e)
        n = snprintf(buf, len, "%s/pullbackd.sock", e);
    else
        n = snprintf(buf, len, "/tmp/pullbackd-%u.sock", (unsigned)getuid());
    return n < 0 || (size_t)n >= len ? -1 : 0;
}

/* ---- the settings ------------------------------------------------------- */

#define MAX_FILE_BYTES (1 << 20)
#define FIELD(f) offsetof(pb_config_t, f), sizeof(((pb_config_t *)0)->f)

/* The one list of settings (config.h).  Sizes have no upper bound; the
 * limits hello reports keep the order clients have always seen. */
static const pb_setting_t keys[] = {
    {"socket", PB_SET_PATH, FIELD(socket_path), NULL, 0, 0, false, NULL, "PATH",
     "socket path (default: $PULLBACKD_SOCKET,\n$RUNTIME_DIRECTORY/pullbackd.sock, $XDG_RUNTIME_DIR/pullbackd.sock,\n"
     "/tmp/pullbackd-$UID.sock); a socket passed by systemd wins"},
    {"socket-mode", PB_SET_MODE, FIELD(socket_mode), "0660", 0, 0777, false, NULL, "MODE",
     "octal mode of the socket file"},
    {"device", PB_SET_DEVICE, FIELD(device), "cpu", 0, 0, false, NULL, "DEV", "default device: cpu, cuda, cuda:N"},
    {"workers", PB_SET_INT, FIELD(workers), NULL, 1, 1024, false, NULL, "N",
     "worker threads (default: number of CPUs)"},
    {"gpu-workers", PB_SET_INT, FIELD(gpu_workers), "2", 1, 64, false, NULL, "N",
     "worker threads for each GPU, each with its own stream"},
    {"gpu-lane-flops", PB_SET_SIZE, FIELD(gpu_lane_flops), "100G", 1, 0, false, NULL, "N",
     "estimated flops from which a GPU request is large: it\nruns in its GPU's lane, one at a time, and the other\n"
     "workers keep serving the small ones"},
    {"max-message-bytes", PB_SET_SIZE, FIELD(max_message_bytes), "256M", 1024, 0, true, "max_message_bytes", "N",
     "largest message accepted"},
    {"max-tape-bytes", PB_SET_SIZE, FIELD(max_tape_bytes), "4G", 0, 0, true, "max_tape_bytes", "N",
     "tape bytes held in total"},
    {"max-tape-bytes-per-uid", PB_SET_SIZE, FIELD(max_tape_bytes_per_uid), "4G", 0, 0, true,
     "max_tape_bytes_per_uid", "N", "tape bytes held per uid"},
    {"max-tapes-per-connection", PB_SET_SIZE, FIELD(max_tapes_per_connection), "65536", 1, 0, true,
     "max_tapes_per_connection", "N", "tapes created by one connection"},
    {"max-inflight-per-connection", PB_SET_SIZE, FIELD(max_inflight_per_connection), "1024", 1, 0, true,
     "max_inflight_per_connection", "N", "requests in flight per connection; one more is\nrefused (resource_exhausted)"},
    {"max-buffers-per-connection", PB_SET_SIZE, FIELD(max_buffers_per_connection), "64", 0, 0, true,
     "max_buffers_per_connection", "N", "shared-memory buffers registered by one connection;\n0 turns register_buffer off"},
    {"max-buffer-bytes-per-connection", PB_SET_SIZE, FIELD(max_buffer_bytes_per_connection), "64G", 0, 0, true,
     "max_buffer_bytes_per_connection", "N", "their sizes summed: address space the daemon maps"},
    {"max-queued-bytes-per-connection", PB_SET_SIZE, FIELD(max_queued_bytes_per_connection), "64M", 0, 0, true,
     "max_queued_bytes_per_connection", "N",
     "reply bytes one connection may have queued or coming\nbefore the daemon stops reading from it"},
    {"max-buffered-bytes", PB_SET_SIZE, FIELD(max_buffered_bytes), NULL, 1 << 20, 0, true, "max_buffered_bytes",
     "N", "bytes held for all connections (incoming messages,\nrequests' messages and replies) before reading\n"
     "stops (default: a quarter of the memory, at least 512M)"},
    {"max-buffered-bytes-per-uid", PB_SET_SIZE, FIELD(max_buffered_bytes_per_uid), NULL, 1 << 20, 0, true,
     "max_buffered_bytes_per_uid", "N", "the same for one uid's connections (default: half\nof max-buffered-bytes)"},
    {"max-connections-per-uid", PB_SET_SIZE, FIELD(max_connections_per_uid), "1024", 1, 0, true,
     "max_connections_per_uid", "N", "open connections of one uid"},
    {"max-device-tape-bytes", PB_SET_SIZE, FIELD(max_device_tape_bytes), "4G", 0, 0, true,
     "max_device_tape_bytes", "N", "tape bytes held in each GPU's memory"},
    {"max-device-bytes", PB_SET_SIZE, FIELD(max_device_bytes), "0", 0, 0, true, NULL, "N",
     "each GPU's memory for tapes and running requests\n(0, the default: 7/8 of the device's memory)"},
    {"drain-timeout", PB_SET_SECONDS, FIELD(drain_timeout_s), "30", 0, 1000000000, true, NULL, "S",
     "seconds to finish in-flight work on SIGTERM; then the\ndaemon exits without waiting for its workers"},
    {"memory-cache", PB_SET_SIZE, FIELD(memory_cache_bytes), NULL, 0, 0, true, NULL, "N",
     "freed tensor and message memory kept mapped for reuse\n(default: an eighth of the memory, 0: none)"},
    {"idle-trim", PB_SET_SECONDS, FIELD(idle_trim_s), "10", 0, 1000000000, true, NULL, "S",
     "seconds without work for the workers before memory\nkept for reuse goes back to the system (0: never)"},
    {"log-level", PB_SET_LOG, FIELD(log_level), "info", 0, 0, true, NULL, "LEVEL",
     "error, warning, notice, info, debug"},
};
enum { NKEYS = sizeof keys / sizeof keys[0] };
/* Flags given on the command line are a bit mask over the rows. */
_Static_assert(NKEYS <= 32, "skip_mask has a bit per setting");

const pb_setting_t *pb_config_settings(size_t *n)
{
    *n = NKEYS;
    return keys;
}

static int set_index(pb_config_t *c, int k, const char *v, char *err, size_t errlen);

/* The blanks of a line are those strtoull and strtod skip (isspace in the
 * C locale): a value cannot begin with one the trim left, such as \f. */
static bool blank(char ch)
{
    return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\n' || ch == '\f' || ch == '\v';
}

size_t pb_config_phys_memory(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    return pages > 0 && psz > 0 ? (size_t)pages * (size_t)psz : 0;
}

/* The rows' defaults; workers is the number of CPUs, and the socket is
 * left empty for the chain (default_socket) once flags and file are in. */
static void defaults(pb_config_t *c)
{
    *c = (pb_config_t){0};
    for (int k = 0; k < NKEYS; k++) {
        char why[300];
        /* The table's own defaults parse (unit.config checks). */
        if (keys[k].def && set_index(c, k, keys[k].def, why, sizeof why))
            pb_log(PB_LOG_ERR, "bad default for %s: %s", keys[k].name, why);
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    c->workers = ncpu > 0 ? (int)ncpu : 1;
    /* Buffering caps from the machine's memory: a quarter of it for all
     * connections (never under 512M, so that the default 256M message and
     * its reply fit), half of the total per uid. */
    size_t mem = pb_config_phys_memory();
    c->max_buffered_bytes = mem / 4 > ((size_t)512 << 20) ? mem / 4 : (size_t)512 << 20;
    /* Unset (no value parses to 0): half of the total the file and the
     * flags leave, once they are in (pb_config_load). */
    c->max_buffered_bytes_per_uid = 0;
    /* Big blocks kept for reuse (kernels/mem.h): an eighth of the memory. */
    c->memory_cache_bytes = mem / 8;
}

int pb_config_limits(const pb_config_t *c, pb_config_limit_t *out)
{
    int n = 0;
    for (int k = 0; k < NKEYS && n < PB_CONFIG_MAX_LIMITS; k++)
        if (keys[k].limit && keys[k].type == PB_SET_SIZE)
            out[n++] = (pb_config_limit_t){keys[k].limit, *(const size_t *)((const char *)c + keys[k].off)};
    return n;
}

void pb_config_warn(const pb_config_t *c)
{
    if (c->max_buffered_bytes_per_uid > c->max_buffered_bytes)
        pb_log(PB_LOG_WARNING, "max-buffered-bytes-per-uid (%zu) is above max-buffered-bytes (%zu): the total binds "
               "first, so one uid may take all of it", c->max_buffered_bytes_per_uid, c->max_buffered_bytes);
}

void pb_config_apply_reloadable(pb_config_t *to, const pb_config_t *from)
{
    for (int k = 0; k < NKEYS; k++)
        if (keys[k].reloadable)
            memcpy((char *)to + keys[k].off, (const char *)from + keys[k].off, keys[k].size);
    memcpy(to->config_file, from->config_file, sizeof to->config_file);
}

static int find_key(const char *name)
{
    for (int i = 0; i < NKEYS; i++)
        if (strcmp(keys[i].name, name) == 0)
            return i;
    return -1;
}

/* What was got is quoted as a client's names are (pb_quote): a config
 * file's bytes may be any, and the line goes to the journal and to
 * systemd's STATUS=. */
static const char *quoted(pb_quoted_t *q, const char *got)
{
    return pb_quote(q, got, strlen(got));
}

static int bad(char *err, size_t errlen, const char *fmt, const char *got)
{
    snprintf(err, errlen, fmt, quoted(PB_QUOTED, got));
    return PB_EINVALID_ARGUMENT;
}

static int set_index(pb_config_t *c, int k, const char *v, char *err, size_t errlen)
{
    const pb_setting_t *key = &keys[k];
    void *field = (char *)c + key->off;
    char *end;
    /* strtol and strtod skip leading blanks (a flag may carry one, a
     * file's line is trimmed): a number begins with what it is made of. */
    bool lead = blank(*v);
    switch (key->type) {
    case PB_SET_PATH:
        if (*v == 0 || strlen(v) >= sizeof c->socket_path)
            return bad(err, errlen, "expected a path of 1 to 107 bytes, got '%s'", v);
        snprintf(c->socket_path, sizeof c->socket_path, "%s", v);
        return 0;
    case PB_SET_MODE: {
        errno = 0;
        long m = strtol(v, &end, 8);
        if (lead || errno || end == v || *end || m < (long)key->min || m > (long)key->max)
            return bad(err, errlen, "expected an octal mode such as 0660, got '%s'", v);
        *(int *)field = (int)m;
        return 0;
    }
    case PB_SET_DEVICE:
        if (pb_device_parse(v, strlen(v), field))
            return bad(err, errlen, "expected cpu, cuda or cuda:N, got '%s'", v);
        return 0;
    case PB_SET_INT: {
        errno = 0;
        long n = strtol(v, &end, 10);
        if (lead || errno || end == v || *end || n < (long)key->min || n > (long)key->max) {
            snprintf(err, errlen, "expected %llu..%llu, got '%s'", key->min, key->max, quoted(PB_QUOTED, v));
            return PB_EINVALID_ARGUMENT;
        }
        *(int *)field = (int)n;
        return 0;
    }
    case PB_SET_SIZE: {
        size_t sz;
        if (pb_parse_size(v, &sz))
            return bad(err, errlen, "expected a size such as 4096, 64K, 256M, 4G or 1T, got '%s'", v);
        if (sz < key->min) {
            snprintf(err, errlen, "expected at least %llu, got '%s'", key->min, quoted(PB_QUOTED, v));
            return PB_EINVALID_ARGUMENT;
        }
        *(size_t *)field = sz;
        return 0;
    }
    case PB_SET_SECONDS: {
        errno = 0;
        double s = strtod(v, &end);
        if (lead || errno || end == v || *end || !(s >= (double)key->min) || s > (double)key->max)
        {
            snprintf(err, errlen, "expected seconds from %llu to %llu (about 31 years), got '%s'", key->min,
                     key->max, quoted(PB_QUOTED, v));
            return PB_EINVALID_ARGUMENT;
        }
        *(double *)field = s;
        return 0;
    }
    case PB_SET_LOG: {
        int l = pb_log_parse_level(v);
        if (l < 0)
            return bad(err, errlen, "expected error, warning, notice, info or debug, got '%s'", v);
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
        return bad(err, errlen, "unknown setting '%s'", key);
    return set_index(c, k, value, err, errlen);
}

static void format_value(const pb_config_t *c, int k, char *buf, size_t len)
{
    const void *field = (const char *)c + keys[k].off;
    switch (keys[k].type) {
    case PB_SET_PATH: snprintf(buf, len, "%s", c->socket_path); break;
    case PB_SET_MODE: snprintf(buf, len, "%04o", (unsigned)*(const int *)field); break;
    case PB_SET_DEVICE:
        if (c->device.kind == PB_DEV_CPU)
            snprintf(buf, len, "cpu");
        else
            snprintf(buf, len, "cuda:%d", c->device.index);
        break;
    case PB_SET_INT: snprintf(buf, len, "%d", *(const int *)field); break;
    case PB_SET_SIZE: snprintf(buf, len, "%zu", *(const size_t *)field); break;
    case PB_SET_SECONDS: snprintf(buf, len, "%g", *(const double *)field); break;
    case PB_SET_LOG: snprintf(buf, len, "%s", pb_log_level_name(*(const int *)field)); break;
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
    while (blank(*s))
        s++;
    size_t n = strlen(s);
    while (n > 0 && blank(s[n - 1]))
        s[--n] = 0;
    return s;
}

/* One line, already trimmed and not a comment. */
static int file_line(pb_config_t *c, char *s, unsigned skip_mask, int lineno, int *seen, char *err, size_t errlen)
{
    for (char *h = s + 1; *h; h++)
        if (*h == '#' && blank(h[-1])) {
            *h = 0;
            break;
        }
    char *eq = strchr(s, '=');
    if (eq == NULL)
        return bad(err, errlen, "expected 'key = value', got '%s'", s);
    *eq = 0;
    char *name = trim(s), *value = trim(eq + 1);
    for (char *p = name; *p; p++)
        if (*p == '_')
            *p = '-';
    int k = find_key(name);
    if (k < 0)
        return bad(err, errlen,
                   "unknown key '%s' (keys are the long flags without --, such as max-tape-bytes)", name);
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
    /* A settings file is a few lines: read at most MAX_FILE_BYTES of it
     * (a line-by-line read of /dev/zero would never end). */
    char *text = malloc(MAX_FILE_BYTES + 1);
    size_t len = text ? fread(text, 1, MAX_FILE_BYTES + 1, f) : 0;
    const char *bad = text == NULL       ? "out of memory"
                      : ferror(f)        ? strerror(errno)
                      : len > MAX_FILE_BYTES ? "larger than the 1 MiB a settings file may be"
                                         : NULL;
    fclose(f);
    int seen[NKEYS] = {0};
    int rc = bad ? PB_EINVALID_ARGUMENT : 0, lineno = 0;
    if (bad)
        snprintf(err, errlen, "%.200s: %s", path, bad);
    /* A byte-order mark, as some Windows editors write one: not part of
     * the first key. */
    size_t at = rc == 0 && len >= 3 && memcmp(text, "\xef\xbb\xbf", 3) == 0 ? 3 : 0;
    while (rc == 0 && at < len) {
        char *line = text + at, *nl = memchr(line, '\n', len - at);
        size_t n = nl ? (size_t)(nl - line) : len - at;
        at += n + 1;
        line[n] = 0;
        lineno++;
        if (strlen(line) != n) {
            snprintf(err, errlen, "%.200s:%d: the line holds a NUL byte", path, lineno);
            rc = PB_EINVALID_ARGUMENT;
            break;
        }
        char *s = trim(line);
        if (*s == 0 || *s == '#')
            continue;
        char why[400];
        if ((rc = file_line(c, s, skip_mask, lineno, seen, why, sizeof why)))
            snprintf(err, errlen, "%.200s:%d: %s", path, lineno, why);
    }
    free(text);
    if (rc == 0)
        snprintf(c->config_file, sizeof c->config_file, "%s", path);
    return rc;
}

/* ---- flags -------------------------------------------------------------- */

enum { O_CONFIG = 100, O_VERSION, O_HELP };

/* Where --help starts a setting's text. */
#define HELP_COL 34

static void help_text(const char *text)
{
    for (const char *p = text; *p; p++) {
        putchar(*p);
        if (*p == '\n')
            printf("%*s", HELP_COL, "");
    }
}

static void print_flag(const char *flag, const char *text)
{
    int n = printf("  --%s", flag);
    if (n >= HELP_COL)
        printf("\n%*s", HELP_COL, "");
    else
        printf("%*s", HELP_COL - n, "");
    help_text(text);
    putchar('\n');
}

/* --help from the table. */
static void usage(void)
{
    fputs("Usage: pullbackd [OPTION]...\n"
          "Serve automatic-differentiation rules over msgpack-RPC on a Unix socket.\n\n",
          stdout);
    print_flag("config PATH", "settings file, one 'key = value' a line, keys as the\n"
               "flags below without -- (default " PB_CONFIG_FILE ",\nwhich may be missing); flags win over the file");
    for (int k = 0; k < NKEYS; k++) {
        char flag[80], text[400];
        snprintf(flag, sizeof flag, "%s %s", keys[k].name, keys[k].arg);
        if (keys[k].def)
            snprintf(text, sizeof text, "%s (default %s)", keys[k].help, keys[k].def);
        else
            snprintf(text, sizeof text, "%s", keys[k].help);
        print_flag(flag, text);
    }
    print_flag("version", "print the version and exit");
    print_flag("help", "print this help and exit");
    fputs("Sizes are bytes or take a K, M, G or T suffix (binary: 1K is 1024; KiB, Ki and KB\n"
          "mean the same).  SIGHUP reloads the file: the other settings change in place;\n"
          "these need a restart:", stdout);
    const char *sep = " ";
    for (int k = 0; k < NKEYS; k++)
        if (!keys[k].reloadable) {
            printf("%s%s", sep, keys[k].name);
            sep = ", ";
        }
    fputs(".\n", stdout);
}

/* getopt's table: a setting's val is its row in keys. */
static void make_options(struct option *o)
{
    for (int k = 0; k < NKEYS; k++)
        o[k] = (struct option){keys[k].name, required_argument, 0, k};
    o[NKEYS] = (struct option){"config", required_argument, 0, O_CONFIG};
    o[NKEYS + 1] = (struct option){"version", no_argument, 0, O_VERSION};
    o[NKEYS + 2] = (struct option){"help", no_argument, 0, O_HELP};
    o[NKEYS + 3] = (struct option){0, 0, 0, 0};
}

/* getopt_long returns '?' both for an unknown option and for an
 * abbreviation of several (glibc tells them apart only in the message
 * opterr would print): say which. */
static int bad_option(const struct option *opts, const char *arg, char *err, size_t errlen)
{
    if (strncmp(arg, "--", 2) == 0) {
        const char *name = arg + 2;
        size_t len = strcspn(name, "=");
        char could[300] = "";
        size_t at = 0;
        int n = 0;
        for (const struct option *o = opts; o->name && len > 0; o++)
            if (strncmp(o->name, name, len) == 0 && at < sizeof could) {
                at += (size_t)snprintf(could + at, sizeof could - at, "%s--%s", n ? ", " : "", o->name);
                n++;
            }
        if (n > 1) {
            snprintf(err, errlen, "ambiguous option '--%s': could be %s", pb_quote(PB_QUOTED, name, len), could);
            return PB_EINVALID_ARGUMENT;
        }
    }
    return bad(err, errlen, "unknown option '%s' (see --help)", arg);
}

/* pb_config_load, and pb_config_reload with default_required when the
 * default file was read before. */
static int load(pb_config_t *out, int argc, char **argv, const char *default_file, bool default_required,
                char *err, size_t errlen)
{
    pb_config_t c;
    defaults(&c);
    struct option opts[NKEYS + 4];
    make_options(opts);
    const char *file = default_file;
    bool required = default_required;
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
            return bad_option(opts, argv[optind - 1], err, errlen);
        if (ch == O_HELP) {
            usage();
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
        return bad(err, errlen, "unexpected argument '%s'", argv[optind]);
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
    if (c.max_buffered_bytes_per_uid == 0)
        c.max_buffered_bytes_per_uid = c.max_buffered_bytes / 2;
    if (c.socket_path[0] == 0 && default_socket(c.socket_path, sizeof c.socket_path)) {
        snprintf(err, errlen, "the socket path from the environment is longer than %zu bytes; use --socket",
                 sizeof c.socket_path - 1);
        return PB_EINVALID_ARGUMENT;
    }
    *out = c;
    return 0;
}

int pb_config_load(pb_config_t *out, int argc, char **argv, const char *default_file, char *err, size_t errlen)
{
    return load(out, argc, argv, default_file, false, err, errlen);
}

int pb_config_reload(pb_config_t *out, const pb_config_t *cur, int argc, char **argv, const char *default_file,
                     char *err, size_t errlen)
{
    bool was_read = default_file && cur->config_file[0] && strcmp(cur->config_file, default_file) == 0;
    return load(out, argc, argv, default_file, was_read, err, errlen);
}
