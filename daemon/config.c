#include "config.h"

#include <errno.h>
#include <stdbool.h>
#include <getopt.h>
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

static const char usage[] =
    "Usage: pullbackd [OPTION]...\n"
    "Serve automatic-differentiation rules over msgpack-RPC on a Unix socket.\n\n"
    "  --socket PATH                   socket path (default: $PULLBACKD_SOCKET,\n"
    "                                  $RUNTIME_DIRECTORY/pullbackd.sock, $XDG_RUNTIME_DIR/pullbackd.sock,\n"
    "                                  /tmp/pullbackd-$UID.sock)\n"
    "  --socket-mode MODE              octal mode of the socket file (default 0660)\n"
    "  --device DEV                    default device: cpu, cuda, cuda:N (default cpu)\n"
    "  --workers N                     worker threads (default: number of CPUs)\n"
    "  --max-message-bytes N           largest message accepted (default 256M)\n"
    "  --max-tape-bytes N              tape bytes held in total (default 4G)\n"
    "  --max-tape-bytes-per-uid N      tape bytes held per uid (default 4G)\n"
    "  --max-tapes-per-connection N    tapes created by one connection (default 65536)\n"
    "  --max-inflight-per-connection N requests in flight per connection before the\n"
    "                                  daemon stops reading from it (default 1024)\n"
    "  --drain-timeout S               seconds to finish in-flight work on SIGTERM (default 30)\n"
    "  --log-level LEVEL               error, warning, notice, info, debug (default info)\n"
    "  --version                       print the version and exit\n"
    "  --help                          print this help and exit\n"
    "Sizes take K, M, G suffixes (binary).\n";

int pb_config_parse(pb_config_t *c, int argc, char **argv)
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
        .drain_timeout_s = 30,
        .log_level = PB_LOG_INFO,
    };
    bool default_ok = default_socket(c->socket_path, sizeof c->socket_path) == 0;
    enum { O_SOCKET = 256, O_MODE, O_DEVICE, O_WORKERS, O_MSG, O_TAPE, O_TAPE_UID, O_TAPES_CONN, O_INFLIGHT,
           O_DRAIN, O_LOG, O_VERSION, O_HELP };
    static const struct option opts[] = {
        {"socket", required_argument, 0, O_SOCKET},
        {"socket-mode", required_argument, 0, O_MODE},
        {"device", required_argument, 0, O_DEVICE},
        {"workers", required_argument, 0, O_WORKERS},
        {"max-message-bytes", required_argument, 0, O_MSG},
        {"max-tape-bytes", required_argument, 0, O_TAPE},
        {"max-tape-bytes-per-uid", required_argument, 0, O_TAPE_UID},
        {"max-tapes-per-connection", required_argument, 0, O_TAPES_CONN},
        {"max-inflight-per-connection", required_argument, 0, O_INFLIGHT},
        {"drain-timeout", required_argument, 0, O_DRAIN},
        {"log-level", required_argument, 0, O_LOG},
        {"version", no_argument, 0, O_VERSION},
        {"help", no_argument, 0, O_HELP},
        {0, 0, 0, 0},
    };
    optind = 1;
    bool socket_given = false;
    int ch;
    while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        size_t sz = 0;
        char *end;
        switch (ch) {
        case O_SOCKET:
            if (strlen(optarg) >= sizeof c->socket_path) {
                fprintf(stderr, "pullbackd: --socket: path longer than %zu bytes\n", sizeof c->socket_path - 1);
                return -1;
            }
            snprintf(c->socket_path, sizeof c->socket_path, "%s", optarg);
            socket_given = true;
            break;
        case O_MODE: {
            long m = strtol(optarg, &end, 8);
            if (*end || m < 0 || m > 0777) {
                fprintf(stderr, "pullbackd: --socket-mode: expected an octal mode such as 0660\n");
                return -1;
            }
            c->socket_mode = (int)m;
            break;
        }
        case O_DEVICE:
            if (pb_device_parse(optarg, strlen(optarg), &c->device)) {
                fprintf(stderr, "pullbackd: --device: expected cpu, cuda or cuda:N, got '%s'\n", optarg);
                return -1;
            }
            break;
        case O_WORKERS: {
            long n = strtol(optarg, &end, 10);
            if (*end || n < 1 || n > 1024) {
                fprintf(stderr, "pullbackd: --workers: expected 1..1024\n");
                return -1;
            }
            c->workers = (int)n;
            break;
        }
        case O_MSG: case O_TAPE: case O_TAPE_UID: case O_TAPES_CONN: case O_INFLIGHT:
            if (pb_parse_size(optarg, &sz) || (sz == 0 && ch != O_TAPE && ch != O_TAPE_UID)) {
                fprintf(stderr, "pullbackd: %s: expected a positive size, got '%s'\n", argv[optind - 1], optarg);
                return -1;
            }
            if (ch == O_MSG && sz < 1024) {
                fprintf(stderr, "pullbackd: --max-message-bytes: at least 1024\n");
                return -1;
            }
            *(ch == O_MSG ? &c->max_message_bytes : ch == O_TAPE ? &c->max_tape_bytes
              : ch == O_TAPE_UID ? &c->max_tape_bytes_per_uid : ch == O_TAPES_CONN ? &c->max_tapes_per_connection
              : &c->max_inflight_per_connection) = sz;
            break;
        case O_DRAIN:
            c->drain_timeout_s = strtod(optarg, &end);
            if (*end || c->drain_timeout_s < 0) {
                fprintf(stderr, "pullbackd: --drain-timeout: expected seconds >= 0\n");
                return -1;
            }
            break;
        case O_LOG:
            if ((c->log_level = pb_log_parse_level(optarg)) < 0) {
                fprintf(stderr, "pullbackd: --log-level: expected error, warning, notice, info or debug\n");
                return -1;
            }
            break;
        case O_VERSION:
            printf("pullbackd %s\n", PB_VERSION);
            return 1;
        case O_HELP:
            fputs(usage, stdout);
            return 1;
        default:
            fputs(usage, stderr);
            return -1;
        }
    }
    if (!default_ok && !socket_given) {
        fprintf(stderr, "pullbackd: the socket path from the environment is longer than %zu bytes; use --socket\n",
                sizeof c->socket_path - 1);
        return -1;
    }
    if (optind < argc) {
        fprintf(stderr, "pullbackd: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    return 0;
}
