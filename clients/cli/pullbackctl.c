/* pullbackctl: look at and steer a running pullbackd.
 *
 * One subcommand per run, each a few requests over the C client library:
 *   status    hello + stats, as a table (or JSON)
 *   tapes     stats' tape counts and bytes, all uids and this one
 *   metrics   the daemon's `metrics` text (Prometheus exposition format)
 *   ping      connect, then `hello` N times, with round-trip times
 *   drain     the admin `drain` method
 *   shutdown  the admin `shutdown` method, optionally waiting for the exit
 * The exit status tells a script what happened (see usage_text below); every
 * wait for the daemon is bounded by --timeout, so a wedged daemon cannot
 * hang a script.
 *
 * The daemon's pid comes from SO_PEERCRED on the connection and its
 * resident memory from /proc/PID/status; both are left out when this
 * process cannot see them (another pid namespace, a hidepid /proc). */
#define _GNU_SOURCE /* struct ucred */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "json.h"
#include "pullbackd.h"

#ifndef PB_VERSION
#define PB_VERSION "0"
#endif

/* Exit statuses; usage_text documents them. */
enum {
    CTL_OK = 0,
    CTL_ERROR = 1,     /* the daemon answered with an error */
    CTL_USAGE = 2,
    CTL_CONNECT = 3,   /* nothing to connect to */
    CTL_DENIED = 4,    /* the socket's mode or the daemon said no */
    CTL_TRANSPORT = 5, /* connection lost, timed out, or a reply not understood */
};

static const char usage_text[] =
    "Usage: pullbackctl [OPTION]... COMMAND\n"
    "Look at and steer a running pullbackd.\n"
    "\n"
    "Commands:\n"
    "  status            uptime, connections, requests, tapes per uid, devices\n"
    "  tapes             tapes held and their bytes: all uids, and this uid\n"
    "  metrics           the daemon's counters, histograms and gauges in the\n"
    "                    Prometheus text format (per-uid figures for admins only)\n"
    "  ping              round-trip time of `hello` (see -c, -i)\n"
    "  drain             refuse new forward calls; reverse and release still served\n"
    "                    (uid 0 or the daemon's uid only)\n"
    "  shutdown          drain, then exit (uid 0 or the daemon's uid only; see -w)\n"
    "\n"
    "Options:\n"
    "  -s, --socket PATH    the daemon's socket (default: $PULLBACKD_SOCKET,\n"
    "                       $RUNTIME_DIRECTORY/pullbackd.sock (first entry of a ':' list),\n"
    "                       $XDG_RUNTIME_DIR/pullbackd.sock, /tmp/pullbackd-$UID.sock)\n"
    "  -j, --json           print one JSON object on stdout instead of text; on a\n"
    "                       failure: {\"error\": {\"code\", \"message\", ...}}, code being the\n"
    "                       daemon's, or cannot_connect, permission_denied, timed_out,\n"
    "                       connection_lost, bad_answer (ping: its figures, and \"error\")\n"
    "  -t, --timeout S      give up on connecting or on any answer after S seconds\n"
    "                       (default 10, at most 31536000: a year)\n"
    "  -c, --count N        ping: send N hellos (default 4)\n"
    "  -i, --interval S     ping: wait S seconds between hellos (default 0, at most a year)\n"
    "  -w, --wait           shutdown: wait (up to --timeout) until the daemon has exited\n"
    "  -h, --help           print this help and exit\n"
    "  -V, --version        print pullbackctl's version and exit\n"
    "\n"
    "Exit status:\n"
    "  0  success\n"
    "  1  the daemon answered with an error (its code and message are printed)\n"
    "  2  usage error: unknown command or option, bad value\n"
    "  3  cannot connect: no daemon listening on the socket (ENOENT, ECONNREFUSED)\n"
    "  4  permission denied: by the socket's file mode or a directory on its path,\n"
    "     or by the daemon (drain and shutdown need uid 0 or the daemon's own uid)\n"
    "  5  the connection was lost, connecting or an answer timed out, an answer made\n"
    "     no sense, or the output could not be written\n"
    "\n"
    "Examples:\n"
    "  pullbackctl status\n"
    "  pullbackctl --socket /run/pullbackd/pullbackd.sock tapes\n"
    "  pullbackctl ping -c 10\n"
    "  pullbackctl metrics > /var/lib/prometheus/node-exporter/pullbackd.prom.$$ &&\n"
    "    mv /var/lib/prometheus/node-exporter/pullbackd.prom.$$ /var/lib/prometheus/node-exporter/pullbackd.prom\n"
    "  pullbackctl status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)[\"tapes\"])'\n"
    "  pullbackctl ping -c 1 -t 2 >/dev/null 2>&1 || echo 'pullbackd is down'\n"
    "  sudo pullbackctl shutdown --wait --timeout 60\n";

typedef struct ctl {
    const char *path;      /* resolved socket path */
    char path_buf[256];
    bool json;
    int64_t timeout_ms;
    long count;
    double interval_s;
    bool wait;
    pb_client_t *c;
    pid_t daemon_pid;      /* 0 when unknown */
    bool keep_error;       /* ping: a failure goes into its JSON, not one of its own */
    char err_code[32];     /* the failure kept, for ping's JSON */
    char err_msg[512];
} ctl_t;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void sleep_s(double s)
{
    if (s <= 0)
        return;
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - floor(s)) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* "12.3 MiB"; bytes below 1 KiB as "512 B". */
static const char *human_bytes(uint64_t v, char *buf, size_t len)
{
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double x = (double)v;
    int u = 0;
    while (x >= 1024 && u < 6) {
        x /= 1024;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%" PRIu64 " B", v);
    else
        snprintf(buf, len, "%.*f %s", x < 10 ? 2 : x < 100 ? 1 : 0, x, unit[u]);
    return buf;
}

/* "2d 03h 04m 05s", leading zero fields left out. */
static const char *human_duration(double s, char *buf, size_t len)
{
    uint64_t t = s > 0 ? (uint64_t)s : 0;
    unsigned d = (unsigned)(t / 86400), h = (unsigned)(t / 3600 % 24), m = (unsigned)(t / 60 % 60),
             sec = (unsigned)(t % 60);
    if (d)
        snprintf(buf, len, "%ud %02uh %02um %02us", d, h, m, sec);
    else if (h)
        snprintf(buf, len, "%uh %02um %02us", h, m, sec);
    else if (m)
        snprintf(buf, len, "%um %02us", m, sec);
    else
        snprintf(buf, len, "%.1fs", s);
    return buf;
}

/* The uint under key of map; false when absent or not a uint. */
static bool get_u64(const msgpack_object *map, const char *key, uint64_t *v)
{
    return pb_obj_uint(pb_obj_get(map, key), v) == 0;
}

/* Resident memory of pid in bytes, from /proc; false when unreadable. */
static bool proc_rss(pid_t pid, uint64_t *bytes)
{
    char path[64], line[256];
    if (pid <= 0)
        return false;
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return false;
    bool ok = false;
    while (fgets(line, sizeof line, f) != NULL) {
        unsigned long long kb;
        if (sscanf(line, "VmRSS: %llu kB", &kb) == 1) {
            *bytes = (uint64_t)kb * 1024;
            ok = true;
            break;
        }
    }
    fclose(f);
    return ok;
}

/* Has pid exited?  A zombie counts as exited: its parent may simply not
 * have reaped it yet. */
static bool proc_gone(pid_t pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return errno == ENOENT || errno == ESRCH;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')');
    return p != NULL && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

/* ---- talking to the daemon ------------------------------------------------- */

/* Milliseconds left until deadline (ns), for a timeout in int. */
static int ms_left(uint64_t deadline)
{
    uint64_t now = now_ns();
    if (now >= deadline)
        return 0;
    uint64_t ms = (deadline - now + 999999) / 1000000;
    return ms > INT_MAX ? INT_MAX : (int)ms;
}

static uint64_t deadline_in(const ctl_t *x)
{
    return now_ns() + (uint64_t)x->timeout_ms * 1000000u;
}

/* "error": {"code", "message"} of the failure kept in x, into j. */
static void json_error(pb_json_obj_t *j, const ctl_t *x)
{
    pb_json_obj_t e;
    pb__json_key(j, "error");
    pb__json_open(&e, stdout);
    pb__json_key(&e, "code");
    pb__json_string(stdout, x->err_code, strlen(x->err_code));
    pb__json_key(&e, "message");
    pb__json_string(stdout, x->err_msg, strlen(x->err_msg));
    pb__json_close(&e);
}

/* A failure on this side: "pullbackctl: <message>" on stderr and, with
 * --json, {"error": {"code", "message"}} on stdout (kept for ping's own
 * object instead while x->keep_error); returns status. */
__attribute__((format(printf, 4, 5))) static int ctl_fail(ctl_t *x, int status, const char *code, const char *fmt,
                                                          ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(x->err_msg, sizeof x->err_msg, fmt, ap);
    va_end(ap);
    snprintf(x->err_code, sizeof x->err_code, "%s", code);
    fprintf(stderr, "pullbackctl: %s\n", x->err_msg);
    if (x->json && !x->keep_error) {
        pb_json_obj_t j;
        pb__json_open(&j, stdout);
        json_error(&j, x);
        pb__json_close(&j);
        fputc('\n', stdout);
    }
    return status;
}

/* Connect to path within timeout_ms: a daemon that does not accept (stopped,
 * its backlog full) must not hang a health check, so the socket is
 * non-blocking until connected.  A full backlog is EAGAIN for a Unix
 * socket, tried again every few ms.  The fd (blocking again), or -errno;
 * -ETIMEDOUT past the time. */
static int connect_within(const char *path, int64_t timeout_ms)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t n = strlen(path);
    if (n >= sizeof sa.sun_path)
        return -ENAMETOOLONG;
    memcpy(sa.sun_path, path, n + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -errno;
    uint64_t deadline = now_ns() + (uint64_t)timeout_ms * 1000000u;
    int e = 0;
    while (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        e = errno;
        if (e == EINTR)
            continue;
        if (e == EAGAIN && now_ns() < deadline) {
            sleep_s(0.005);
            continue;
        }
        if (e == EINPROGRESS) {
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            int r;
            while ((r = poll(&p, 1, ms_left(deadline))) < 0 && errno == EINTR)
                ;
            socklen_t len = sizeof e;
            if (r == 0)
                e = ETIMEDOUT;
            else if (r < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) != 0)
                e = errno;
        }
        break;
    }
    if (e == EAGAIN)
        e = ETIMEDOUT;
    if (e != 0 && e != EISCONN) {
        close(fd);
        return -e;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        e = errno;
        close(fd);
        return -e;
    }
    return fd;
}

static int ctl_connect(ctl_t *x)
{
    int fd = connect_within(x->path, x->timeout_ms);
    if (fd == -EACCES || fd == -EPERM)
        return ctl_fail(x, CTL_DENIED, "permission_denied",
                        "%s: permission denied (the socket's mode or group, or a directory on its path, does not "
                        "admit uid %u)",
                        x->path, (unsigned)getuid());
    if (fd == -ETIMEDOUT)
        return ctl_fail(x, CTL_TRANSPORT, "timed_out",
                        "cannot connect to pullbackd at %s: not accepted within %.3g s (is the daemon stopped or "
                        "overloaded?)",
                        x->path, (double)x->timeout_ms / 1000.0);
    int rc = fd < 0 ? fd : pb_client_from_fd(fd, &x->c);
    if (rc < 0)
        return ctl_fail(x, CTL_CONNECT, "cannot_connect", "cannot connect to pullbackd at %s: %s%s", x->path,
                        strerror(-rc), rc == -ENOENT || rc == -ECONNREFUSED ? " (is the daemon running?)" : "");
    struct ucred cr;
    socklen_t len = sizeof cr;
    if (getsockopt(pb_client_fd(x->c), SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0 && cr.pid > 0)
        x->daemon_pid = cr.pid;
    return CTL_OK;
}

/* Report an error reply (stderr; and stdout as {"error": ...} with --json)
 * and turn it into an exit status. */
static int ctl_error_reply(ctl_t *x, const char *method, const pb_reply_t *r)
{
    const char *code = pb_reply_code(r);
    fprintf(stderr, "pullbackctl: %s: %s: %s\n", method, code, pb_reply_message(r));
    snprintf(x->err_code, sizeof x->err_code, "%s", code);
    snprintf(x->err_msg, sizeof x->err_msg, "%s: %s", method, pb_reply_message(r));
    if (x->json && !x->keep_error) {
        pb_json_obj_t j;
        pb__json_open(&j, stdout);
        pb__json_key(&j, "error");
        pb__json_object(stdout, r->error);
        pb__json_close(&j);
        fputc('\n', stdout);
    }
    return strcmp(code, "permission_denied") == 0 ? CTL_DENIED : CTL_ERROR;
}

/* Call method with params {} and wait at most --timeout for its reply.
 * CTL_OK with *r holding a successful reply (free it); else the failure has
 * been reported and r is empty. */
static int ctl_call(ctl_t *x, const char *method, pb_reply_t *r)
{
    msgpack_packer *pk = pb_client_begin(x->c, method);
    msgpack_pack_map(pk, 0);
    uint32_t id;
    int rc = pb_client_send(x->c, &id);
    bool sent = rc == 0;
    /* A daemon that closed the connection (max_connections_per_uid) may
     * have said why under msgid 0 first: that is the answer to report. */
    if (rc == -EPIPE)
        rc = 0;
    uint64_t deadline = deadline_in(x);
    while (rc == 0) {
        rc = pb_client_recv_timeout(x->c, r, ms_left(deadline));
        if (rc < 0)
            break;
        if ((sent && r->msgid == id) || (r->msgid == 0 && r->error != NULL))
            break;
        pb_reply_free(r); /* not ours: nothing else was sent on this connection */
    }
    if (rc == -ETIMEDOUT)
        return ctl_fail(x, CTL_TRANSPORT, "timed_out", "%s: no answer within %.3g s", method,
                        (double)x->timeout_ms / 1000.0);
    if (rc < 0)
        return ctl_fail(x, CTL_TRANSPORT, "connection_lost", "%s: %s%s", method, strerror(-rc),
                        rc == -EPIPE ? " (the daemon closed the connection)" : "");
    if (r->error != NULL) {
        int st = ctl_error_reply(x, method, r);
        pb_reply_free(r);
        return st;
    }
    if (r->result == NULL || r->result->type != MSGPACK_OBJECT_MAP) {
        pb_reply_free(r);
        return ctl_fail(x, CTL_TRANSPORT, "bad_answer", "%s: the result is not a map", method);
    }
    return CTL_OK;
}

/* ---- status ------------------------------------------------------------------ */

static void print_count_line(const char *label, const msgpack_object *st, const char *key, const char *what)
{
    uint64_t v;
    if (get_u64(st, key, &v))
        printf("%-18s%" PRIu64 " %s\n", label, v, what);
    else
        printf("%-18s(not reported by this daemon)\n", label);
}

static void print_tapes_line(const char *label, const msgpack_object *st, const char *nkey, const char *bkey,
                             const msgpack_object *limits, const char *lkey)
{
    uint64_t n, b, lim;
    char h1[32], h2[32];
    if (!get_u64(st, nkey, &n) || !get_u64(st, bkey, &b)) {
        printf("%-18s(not reported by this daemon)\n", label);
        return;
    }
    printf("%-18s%" PRIu64 " held, %s", label, n, human_bytes(b, h1, sizeof h1));
    if (b >= 1024)
        printf(" (%" PRIu64 " bytes)", b);
    if (get_u64(limits, lkey, &lim))
        printf(" of %s (%s)", human_bytes(lim, h2, sizeof h2), lkey);
    printf("\n");
}

static void status_text(const ctl_t *x, const msgpack_object *hello, const msgpack_object *st)
{
    const msgpack_object *ver = pb_obj_get(hello, "version"), *limits = pb_obj_get(hello, "limits");
    uint64_t v, w, rss;
    double up;
    char h[40], label[40];

    printf("pullbackd %.*s, protocol %" PRIu64 ", socket %s\n",
           ver && ver->type == MSGPACK_OBJECT_STR ? (int)ver->via.str.size : 1,
           ver && ver->type == MSGPACK_OBJECT_STR ? ver->via.str.ptr : "?",
           get_u64(hello, "protocol", &v) ? v : 0, x->path);
    if (x->daemon_pid > 0) {
        printf("%-18s%d", "pid", (int)x->daemon_pid);
        if (proc_rss(x->daemon_pid, &rss))
            printf(", resident memory %s", human_bytes(rss, h, sizeof h));
        printf("\n");
    }
    const msgpack_object *state = pb_obj_get(st, "state");
    if (state && state->type == MSGPACK_OBJECT_STR)
        printf("%-18s%.*s%s\n", "state", (int)state->via.str.size, state->via.str.ptr,
               pb_obj_strcmp(state, "draining") == 0 ? " (no new forward calls; reverse and release served)" : "");
    if (pb_obj_double(pb_obj_get(st, "uptime_s"), &up) == 0)
        printf("%-18s%s\n", "uptime", human_duration(up, h, sizeof h));
    else
        printf("%-18s(not reported by this daemon)\n", "uptime");
    print_count_line("connections", st, "connections", "open (this one included)");
    if (get_u64(st, "requests_served", &v) && get_u64(st, "requests_in_flight", &w))
        printf("%-18s%" PRIu64 " served, %" PRIu64 " in flight\n", "requests", v, w);
    else
        printf("%-18s(not reported by this daemon)\n", "requests");
    print_tapes_line("tapes", st, "tapes", "tape_bytes", limits, "max_tape_bytes");
    snprintf(label, sizeof label, "this uid (%u)", (unsigned)getuid());
    print_tapes_line(label, st, "peer_tapes", "peer_tape_bytes", limits, "max_tape_bytes_per_uid");

    const msgpack_object *peers = pb_obj_get(st, "peers");
    printf("\ntapes by uid\n");
    if (peers == NULL || peers->type != MSGPACK_OBJECT_ARRAY) {
        printf("  (not reported by this daemon)\n");
    } else if (peers->via.array.size == 0) {
        printf("  (no tapes held)\n");
    } else {
        printf("  %-10s %10s %16s\n", "uid", "tapes", "bytes");
        for (uint32_t i = 0; i < peers->via.array.size; i++) {
            const msgpack_object *p = &peers->via.array.ptr[i];
            uint64_t uid = 0, n = 0, b = 0;
            get_u64(p, "uid", &uid);
            get_u64(p, "tapes", &n);
            get_u64(p, "tape_bytes", &b);
            printf("  %-10" PRIu64 " %10" PRIu64 " %16" PRIu64 "  %s\n", uid, n, b, human_bytes(b, h, sizeof h));
        }
    }

    const msgpack_object *devs = pb_obj_get(st, "devices");
    printf("\ndevices\n");
    if (devs == NULL || devs->type != MSGPACK_OBJECT_ARRAY) {
        printf("  (not reported by this daemon)\n");
        return;
    }
    /* A GPU reports its model, the bytes the daemon holds there, its tapes
     * and whether it has failed; the CPU only its memory. */
    printf("  %-10s %-24s %12s %12s %7s  %s\n", "name", "model", "memory", "used", "tapes", "state");
    for (uint32_t i = 0; i < devs->via.array.size; i++) {
        const msgpack_object *d = &devs->via.array.ptr[i], *name = pb_obj_get(d, "name"),
                             *model = pb_obj_get(d, "model"), *failed = pb_obj_get(d, "failed");
        uint64_t mem, used, tapes;
        bool has_mem = get_u64(d, "memory_bytes", &mem), has_used = get_u64(d, "used_bytes", &used),
             has_tapes = get_u64(d, "tapes", &tapes);
        char h2[32], n[24];
        snprintf(n, sizeof n, "%" PRIu64, has_tapes ? tapes : 0);
        bool is_failed = failed && failed->type == MSGPACK_OBJECT_BOOLEAN && failed->via.boolean;
        printf("  %-10.*s %-24.*s %12s %12s %7s  %s\n",
               name && name->type == MSGPACK_OBJECT_STR ? (int)name->via.str.size : 1,
               name && name->type == MSGPACK_OBJECT_STR ? name->via.str.ptr : "?",
               model && model->type == MSGPACK_OBJECT_STR ? (int)model->via.str.size : 1,
               model && model->type == MSGPACK_OBJECT_STR ? model->via.str.ptr : "-",
               has_mem ? human_bytes(mem, h, sizeof h) : "?", has_used ? human_bytes(used, h2, sizeof h2) : "-",
               has_tapes ? n : "-", is_failed ? "FAILED (device_unavailable until a restart)" : "serving");
    }
}

/* The fields every JSON output opens with. */
static void json_head(pb_json_obj_t *j, const ctl_t *x)
{
    pb__json_open(j, stdout);
    pb__json_key(j, "socket");
    pb__json_string(stdout, x->path, strlen(x->path));
    if (x->daemon_pid > 0) {
        pb__json_key(j, "daemon_pid");
        printf("%d", (int)x->daemon_pid);
    }
}

static int cmd_status(ctl_t *x)
{
    pb_reply_t hello, st;
    int rc = ctl_call(x, "hello", &hello);
    if (rc)
        return rc;
    if ((rc = ctl_call(x, "stats", &st))) {
        pb_reply_free(&hello);
        return rc;
    }
    if (x->json) {
        pb_json_obj_t j;
        uint64_t rss;
        json_head(&j, x);
        if (proc_rss(x->daemon_pid, &rss)) {
            pb__json_key(&j, "daemon_rss_bytes");
            printf("%" PRIu64, rss);
        }
        pb__json_key(&j, "uid");
        printf("%u", (unsigned)getuid());
        static const char *const from_hello[] = {"version", "protocol", "limits"};
        for (size_t i = 0; i < 3; i++) {
            const msgpack_object *o = pb_obj_get(hello.result, from_hello[i]);
            if (o != NULL) {
                pb__json_key(&j, from_hello[i]);
                pb__json_object(stdout, o);
            }
        }
        static const char *const skip[] = {"socket", "daemon_pid", "daemon_rss_bytes", "uid", "version",
                                           "protocol", "limits", NULL};
        pb__json_members(&j, st.result, skip);
        pb__json_close(&j);
        fputc('\n', stdout);
    } else {
        status_text(x, hello.result, st.result);
    }
    pb_reply_free(&hello);
    pb_reply_free(&st);
    return CTL_OK;
}

/* ---- tapes ------------------------------------------------------------------- */

static int cmd_tapes(ctl_t *x)
{
    pb_reply_t hello, st;
    int rc = ctl_call(x, "hello", &hello);
    if (rc)
        return rc;
    if ((rc = ctl_call(x, "stats", &st))) {
        pb_reply_free(&hello);
        return rc;
    }
    const msgpack_object *limits = pb_obj_get(hello.result, "limits");
    static const char *const keys[] = {"tapes", "tape_bytes", "peer_tapes", "peer_tape_bytes"};
    uint64_t v[4];
    for (int i = 0; i < 4; i++) {
        if (!get_u64(st.result, keys[i], &v[i])) {
            pb_reply_free(&hello);
            pb_reply_free(&st);
            return ctl_fail(x, CTL_TRANSPORT, "bad_answer", "stats: no uint '%s' in the daemon's answer", keys[i]);
        }
    }
    uint64_t lim_all = 0, lim_uid = 0;
    bool has_all = get_u64(limits, "max_tape_bytes", &lim_all),
         has_uid = get_u64(limits, "max_tape_bytes_per_uid", &lim_uid);
    if (x->json) {
        pb_json_obj_t j;
        json_head(&j, x);
        pb__json_key(&j, "uid");
        printf("%u", (unsigned)getuid());
        for (int i = 0; i < 4; i++) {
            pb__json_key(&j, keys[i]);
            printf("%" PRIu64, v[i]);
        }
        if (has_all) {
            pb__json_key(&j, "max_tape_bytes");
            printf("%" PRIu64, lim_all);
        }
        if (has_uid) {
            pb__json_key(&j, "max_tape_bytes_per_uid");
            printf("%" PRIu64, lim_uid);
        }
        pb__json_close(&j);
        fputc('\n', stdout);
    } else {
        char h1[32], h2[32], label[40];
        printf("%-16s %10s %16s %12s %12s\n", "", "tapes", "bytes", "size", "limit");
        printf("%-16s %10" PRIu64 " %16" PRIu64 " %12s %12s\n", "all uids", v[0], v[1],
               human_bytes(v[1], h1, sizeof h1), has_all ? human_bytes(lim_all, h2, sizeof h2) : "?");
        snprintf(label, sizeof label, "uid %u (you)", (unsigned)getuid());
        printf("%-16s %10" PRIu64 " %16" PRIu64 " %12s %12s\n", label, v[2], v[3],
               human_bytes(v[3], h1, sizeof h1), has_uid ? human_bytes(lim_uid, h2, sizeof h2) : "?");
    }
    pb_reply_free(&hello);
    pb_reply_free(&st);
    return CTL_OK;
}

/* ---- metrics ----------------------------------------------------------------- */

static int cmd_metrics(ctl_t *x)
{
    pb_reply_t m;
    int rc = ctl_call(x, "metrics", &m);
    if (rc)
        return rc;
    const msgpack_object *text = pb_obj_get(m.result, "text");
    if (text == NULL || text->type != MSGPACK_OBJECT_STR) {
        pb_reply_free(&m);
        return ctl_fail(x, CTL_TRANSPORT, "bad_answer", "metrics: no str 'text' in the daemon's answer");
    }
    if (x->json) {
        pb_json_obj_t j;
        json_head(&j, x);
        pb__json_members(&j, m.result, NULL);
        pb__json_close(&j);
        fputc('\n', stdout);
    } else {
        fwrite(text->via.str.ptr, 1, text->via.str.size, stdout);
    }
    pb_reply_free(&m);
    return CTL_OK;
}

/* ---- ping -------------------------------------------------------------------- */

static int cmd_ping(ctl_t *x, double connect_ms)
{
    double *rtt = calloc((size_t)x->count, sizeof *rtt);
    if (rtt == NULL) {
        fprintf(stderr, "pullbackctl: out of memory\n");
        return CTL_TRANSPORT;
    }
    int rc = CTL_OK;
    char version[64] = "?";
    uint64_t proto = 0;
    long done = 0, sent = 0;
    x->keep_error = true; /* one JSON object: the figures, and the failure in it */
    for (long i = 0; i < x->count; i++) {
        if (i > 0)
            sleep_s(x->interval_s);
        pb_reply_t r;
        uint64_t t0 = now_ns();
        sent++;
        if ((rc = ctl_call(x, "hello", &r)))
            break;
        rtt[i] = (double)(now_ns() - t0) / 1e6;
        done++;
        const msgpack_object *v = pb_obj_get(r.result, "version");
        if (i == 0) {
            if (v && v->type == MSGPACK_OBJECT_STR)
                snprintf(version, sizeof version, "%.*s", (int)v->via.str.size, v->via.str.ptr);
            get_u64(r.result, "protocol", &proto);
            if (!x->json)
                printf("PING pullbackd %s (protocol %" PRIu64 ") at %s: connected in %.3f ms\n", version, proto,
                       x->path, connect_ms);
        }
        if (!x->json) {
            printf("hello seq=%ld time=%.3f ms\n", i + 1, rtt[i]);
            fflush(stdout);
        }
        pb_reply_free(&r);
    }
    double mn = INFINITY, mx = 0, sum = 0;
    for (long i = 0; i < done; i++) {
        mn = fmin(mn, rtt[i]);
        mx = fmax(mx, rtt[i]);
        sum += rtt[i];
    }
    double avg = done ? sum / (double)done : 0;
    if (x->json) {
        pb_json_obj_t j;
        json_head(&j, x);
        pb__json_key(&j, "sent");
        printf("%ld", sent);
        pb__json_key(&j, "version");
        pb__json_string(stdout, version, strlen(version));
        pb__json_key(&j, "protocol");
        printf("%" PRIu64, proto);
        pb__json_key(&j, "count");
        printf("%ld", done);
        pb__json_key(&j, "connect_ms");
        pb__json_double(stdout, connect_ms);
        pb__json_key(&j, "rtt_ms");
        fputc('[', stdout);
        for (long i = 0; i < done; i++) {
            if (i)
                fputs(", ", stdout);
            pb__json_double(stdout, rtt[i]);
        }
        fputc(']', stdout);
        if (done > 0) { /* no figures for none */
            pb__json_key(&j, "min_ms");
            pb__json_double(stdout, mn);
            pb__json_key(&j, "avg_ms");
            pb__json_double(stdout, avg);
            pb__json_key(&j, "max_ms");
            pb__json_double(stdout, mx);
        }
        if (rc != CTL_OK)
            json_error(&j, x);
        pb__json_close(&j);
        fputc('\n', stdout);
    } else if (done > 0) {
        printf("--- %ld of %ld hellos answered, rtt min/avg/max = %.3f/%.3f/%.3f ms\n", done, sent, mn, avg, mx);
    } else {
        printf("--- 0 of %ld hellos answered\n", sent);
    }
    free(rtt);
    return rc;
}

/* ---- drain, shutdown ------------------------------------------------------- */

static int cmd_admin(ctl_t *x, const char *method)
{
    bool shutdown = strcmp(method, "shutdown") == 0;
    pb_reply_t r;
    int rc = ctl_call(x, method, &r);
    if (rc)
        return rc;
    uint64_t t0 = now_ns();
    bool stopped = false;
    if (shutdown && x->wait) {
        /* The daemon closes every connection once the last answer is out,
         * then exits: wait for the close, then for the process. */
        uint64_t deadline = t0 + (uint64_t)x->timeout_ms * 1000000u;
        for (;;) {
            pb_reply_t extra;
            int e = pb_client_recv_timeout(x->c, &extra, ms_left(deadline));
            if (e == 0) {
                pb_reply_free(&extra);
                continue;
            }
            stopped = e == -EPIPE;
            break;
        }
        while (stopped && x->daemon_pid > 0 && !proc_gone(x->daemon_pid)) {
            if (now_ns() >= deadline) {
                stopped = false;
                break;
            }
            sleep_s(0.005);
        }
    }
    double waited = (double)(now_ns() - t0) / 1e9;
    if (x->json) {
        pb_json_obj_t j;
        json_head(&j, x);
        static const char *const skip[] = {"socket", "daemon_pid", "stopped", "stop_s", NULL};
        pb__json_members(&j, r.result, skip);
        if (shutdown && x->wait) {
            pb__json_key(&j, "stopped");
            fputs(stopped ? "true" : "false", stdout);
            pb__json_key(&j, "stop_s");
            pb__json_double(stdout, waited);
        }
        pb__json_close(&j);
        fputc('\n', stdout);
    } else if (!shutdown) {
        printf("pullbackd at %s is draining: new forward calls are refused, reverse and release are still served\n",
               x->path);
    } else if (!x->wait) {
        printf("pullbackd at %s is shutting down: requests already sent are served, then it exits\n", x->path);
    } else if (stopped) {
        printf("pullbackd at %s has stopped (%.3f s after the shutdown answer)\n", x->path, waited);
    }
    pb_reply_free(&r);
    if (shutdown && x->wait && !stopped) {
        fprintf(stderr, "pullbackctl: shutdown: the daemon did not exit within %.3g s\n",
                (double)x->timeout_ms / 1000.0);
        return CTL_TRANSPORT;
    }
    return CTL_OK;
}

/* ---- main ------------------------------------------------------------------ */

static int usage_error(const char *fmt, const char *arg)
{
    fputs("pullbackctl: ", stderr);
    fprintf(stderr, fmt, arg);
    fputs("\nTry 'pullbackctl --help'.\n", stderr);
    return CTL_USAGE;
}

static bool parse_seconds(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v < 0 || v > 86400.0 * 365)
        return false;
    *out = v;
    return true;
}

/* rc, or CTL_TRANSPORT when stdout could not be written (said on stderr). */
static int flushed(int rc)
{
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "pullbackctl: writing the output: %s\n", strerror(errno));
        if (rc == CTL_OK)
            rc = CTL_TRANSPORT;
    }
    return rc;
}

int main(int argc, char **argv)
{
    ctl_t x = {.timeout_ms = 10000, .count = 4};
    if (argc > 0)
        argv[0] = (char *)"pullbackctl"; /* getopt's messages name the tool as ours do */
    bool count_given = false, interval_given = false;
    static const struct option opts[] = {
        {"socket", required_argument, NULL, 's'},  {"json", no_argument, NULL, 'j'},
        {"timeout", required_argument, NULL, 't'}, {"count", required_argument, NULL, 'c'},
        {"interval", required_argument, NULL, 'i'}, {"wait", no_argument, NULL, 'w'},
        {"help", no_argument, NULL, 'h'},          {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    int ch;
    double secs;
    char *end;
    while ((ch = getopt_long(argc, argv, "s:jt:c:i:whV", opts, NULL)) != -1) {
        switch (ch) {
        case 's':
            if (*optarg == 0)
                return usage_error("--socket: empty path%s", "");
            x.path = optarg;
            break;
        case 'j':
            x.json = true;
            break;
        case 't':
            if (!parse_seconds(optarg, &secs) || secs <= 0)
                return usage_error("--timeout: expected seconds above 0 and at most 31536000 (a year), got '%s'",
                                   optarg);
            x.timeout_ms = (int64_t)ceil(secs * 1000);
            break;
        case 'c':
            errno = 0;
            x.count = strtol(optarg, &end, 10);
            if (errno || end == optarg || *end || x.count < 1 || x.count > 1000000)
                return usage_error("--count: expected 1..1000000, got '%s'", optarg);
            count_given = true;
            break;
        case 'i':
            if (!parse_seconds(optarg, &x.interval_s))
                return usage_error("--interval: expected seconds from 0 to 31536000 (a year), got '%s'", optarg);
            interval_given = true;
            break;
        case 'w':
            x.wait = true;
            break;
        case 'h':
            fputs(usage_text, stdout);
            return flushed(CTL_OK);
        case 'V':
            printf("pullbackctl %s\n", PB_VERSION);
            return flushed(CTL_OK);
        default:
            /* getopt_long has said what was wrong. */
            fputs("Try 'pullbackctl --help'.\n", stderr);
            return CTL_USAGE;
        }
    }
    if (optind >= argc)
        return usage_error("no command given (status, tapes, metrics, ping, drain, shutdown)%s", "");
    if (optind + 1 < argc)
        return usage_error("unexpected argument '%s' after the command", argv[optind + 1]);
    const char *cmd = argv[optind];
    static const char *const cmds[] = {"status", "tapes", "metrics", "ping", "drain", "shutdown", "help"};
    size_t k = 0;
    while (k < sizeof cmds / sizeof cmds[0] && strcmp(cmd, cmds[k]) != 0)
        k++;
    if (k == sizeof cmds / sizeof cmds[0])
        return usage_error("unknown command '%s' (status, tapes, metrics, ping, drain, shutdown)", cmd);
    if (strcmp(cmd, "help") == 0) {
        fputs(usage_text, stdout);
        return flushed(CTL_OK);
    }
    if ((count_given || interval_given) && strcmp(cmd, "ping") != 0)
        return usage_error("--count and --interval are for ping, not %s", cmd);
    if (x.wait && strcmp(cmd, "shutdown") != 0)
        return usage_error("--wait is for shutdown, not %s", cmd);

    if (x.path == NULL) {
        int rc = pb_client_socket_path(x.path_buf, sizeof x.path_buf);
        if (rc < 0) {
            fprintf(stderr, "pullbackctl: the socket path from the environment is too long: %s; use --socket\n",
                    strerror(-rc));
            return CTL_USAGE;
        }
        x.path = x.path_buf;
    }
    uint64_t t0 = now_ns();
    int rc = ctl_connect(&x);
    if (rc)
        return rc;
    double connect_ms = (double)(now_ns() - t0) / 1e6;
    if (strcmp(cmd, "status") == 0)
        rc = cmd_status(&x);
    else if (strcmp(cmd, "tapes") == 0)
        rc = cmd_tapes(&x);
    else if (strcmp(cmd, "metrics") == 0)
        rc = cmd_metrics(&x);
    else if (strcmp(cmd, "ping") == 0)
        rc = cmd_ping(&x, connect_ms);
    else
        rc = cmd_admin(&x, cmd);
    pb_client_close(x.c);
    return flushed(rc);
}
