/* e2e.service.*: pullbackd as a service, from outside, against daemons this
 * program starts: socket activation, sd_notify and the watchdog, the config
 * file and SIGHUP reloads, identity across uids, restarts.
 *
 * Run as `e2e_service PATH_TO_PULLBACKD GROUP`, GROUP one of activation,
 * notify, reload, identity, restart.  A group exits 77 (meson's skip) when
 * what it needs is missing: systemd-socket-activate (package systemd) for
 * activation, root for identity (it connects as other uids with setuid).
 * No systemd needs to be running: the test plays the service manager,
 * with its own $NOTIFY_SOCKET and $WATCHDOG_USEC.
 *
 * Every daemon's stderr goes to a log file in the test's directory, which
 * the tests read for the lines an operator would see. */
#define _GNU_SOURCE /* struct ucred, setgroups */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "pullbackd.h"

#define NOBODY 65534
#define OTHER 65533

static const char *daemon_bin;
static char dir[48];
static char activate_bin[256];

typedef struct {
    pid_t pid;
    char path[108];
    char log[108];
} daemon_t;

/* ---- processes ------------------------------------------------------------ */

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int try_connect(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    int rc = connect(fd, (struct sockaddr *)&a, sizeof a);
    close(fd);
    return rc;
}

/* Every child not yet reaped: a failed test leaves its daemons running,
 * and teardown kills them. */
static pid_t children[64];

static void child_add(pid_t p)
{
    for (size_t i = 0; i < sizeof children / sizeof children[0]; i++)
        if (children[i] == 0) {
            children[i] = p;
            return;
        }
}

static void child_gone(pid_t p)
{
    for (size_t i = 0; i < sizeof children / sizeof children[0]; i++)
        if (children[i] == p)
            children[i] = 0;
}

static void kill_children(void)
{
    for (size_t i = 0; i < sizeof children / sizeof children[0]; i++)
        if (children[i] > 0) {
            kill(children[i], SIGKILL);
            waitpid(children[i], NULL, 0);
            children[i] = 0;
        }
}

/* Fork and exec argv (NULL-terminated) with stderr and stdout appended to
 * log, the "K=V" strings of env added to a clean environment ("K=self"
 * puts the child's own pid), running as uid when uid != -1. */
static pid_t spawn(const char *log, const char *const *env, int uid, const char *const *argv)
{
    pid_t p = fork();
    if (p != 0) {
        if (p > 0)
            child_add(p);
        return p;
    }
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0)
        _exit(126);
    dup2(fd, 1);
    dup2(fd, 2);
    close(fd);
    const char *drop[] = {"NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC",
                          "WATCHDOG_PID", "PULLBACKD_SOCKET", "RUNTIME_DIRECTORY"};
    for (size_t i = 0; i < sizeof drop / sizeof drop[0]; i++)
        unsetenv(drop[i]);
    for (int i = 0; env && env[i]; i++) {
        char k[64];
        const char *eq = strchr(env[i], '=');
        snprintf(k, sizeof k, "%.*s", (int)(eq - env[i]), env[i]);
        if (strcmp(eq + 1, "self") == 0) {
            char v[32];
            snprintf(v, sizeof v, "%d", (int)getpid());
            setenv(k, v, 1);
        } else {
            setenv(k, eq + 1, 1);
        }
    }
    if (uid != -1 && (setgroups(0, NULL) || setgid((gid_t)uid) || setuid((uid_t)uid)))
        _exit(125);
    execv(argv[0], (char *const *)argv);
    _exit(127);
}

/* Start pullbackd on dir/name with the extra flags (NULL-terminated) and
 * wait until it answers.  --config /dev/null unless a --config is among
 * the flags, so that no /etc/pullbackd/pullbackd.conf of the machine
 * changes the test.  0, or the daemon's exit status. */
static int start_env(daemon_t *d, const char *name, const char *const *env, int uid, ...)
{
    snprintf(d->path, sizeof d->path, "%s/%s", dir, name);
    snprintf(d->log, sizeof d->log, "%s/%s.log", dir, name);
    unlink(d->log);
    const char *argv[40] = {daemon_bin, "--socket", d->path, "--workers", "2"};
    int n = 5;
    bool config = false;
    va_list ap;
    va_start(ap, uid);
    const char *a;
    while ((a = va_arg(ap, const char *)) && n < 36) {
        config |= strncmp(a, "--config", 8) == 0;
        argv[n++] = a;
    }
    va_end(ap);
    if (!config) {
        argv[n++] = "--config";
        argv[n++] = "/dev/null";
    }
    argv[n] = NULL;
    d->pid = spawn(d->log, env, uid, argv);
    for (int i = 0; i < 1000; i++) {
        if (try_connect(d->path) == 0)
            return 0;
        int st;
        if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
            child_gone(d->pid);
            d->pid = 0;
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
        }
        usleep(10000);
    }
    return -1;
}

#define start(d, name, ...) start_env(d, name, NULL, -1, __VA_ARGS__)

/* Wait for pid's exit; its status as a shell would say it. */
static int wait_exit(pid_t pid)
{
    int st = 0;
    if (waitpid(pid, &st, 0) != pid)
        return -1;
    child_gone(pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static int stop(daemon_t *d)
{
    kill(d->pid, SIGTERM);
    int rc = wait_exit(d->pid);
    d->pid = 0;
    return rc;
}

/* The daemon's log so far (free it). */
static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return strdup("");
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    char chunk[4096];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0)
        fwrite(chunk, 1, n, m);
    fclose(f);
    fclose(m);
    return buf;
}

static bool log_has(const daemon_t *d, const char *needle)
{
    char *s = slurp(d->log);
    bool yes = strstr(s, needle) != NULL;
    free(s);
    return yes;
}

/* Wait up to ms for needle in d's log. */
static bool wait_log(const daemon_t *d, const char *needle, int ms)
{
    for (int i = 0; i < ms / 10; i++) {
        if (log_has(d, needle))
            return true;
        usleep(10000);
    }
    return log_has(d, needle);
}

#define assert_log(d, needle)                                                             \
    do {                                                                                  \
        if (!wait_log(d, needle, 5000)) {                                                 \
            char *s_ = slurp((d)->log);                                                   \
            fail_msg("no '%s' in the daemon's log:\n%s", needle, s_);                     \
        }                                                                                 \
    } while (0)

static void write_file(const char *path, const char *text)
{
    char tmp[160];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    assert_non_null(f);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
    assert_int_equal(rename(tmp, path), 0);
}

/* ---- requests ------------------------------------------------------------- */

/* A client of d.  A socket file appears at bind(), a moment before the
 * listen() that lets connect() in (systemd-socket-activate does both for
 * several sockets in turn): ECONNREFUSED in that moment is retried. */
static pb_client_t *conn(const daemon_t *d)
{
    pb_client_t *c = NULL;
    int rc = pb_client_connect(d->path, &c);
    for (int i = 0; i < 500 && rc == -ECONNREFUSED; i++) {
        usleep(10000);
        rc = pb_client_connect(d->path, &c);
    }
    assert_int_equal(rc, 0);
    return c;
}

static void simple(pb_client_t *c, const char *method, pb_reply_t *r)
{
    msgpack_packer *pk = pb_client_begin(c, method);
    msgpack_pack_map(pk, 0);
    assert_int_equal(pb_client_call(c, r), 0);
}

/* A reply's error code, or "ok". */
static const char *code_of(const pb_reply_t *r)
{
    return r->error ? pb_reply_code(r) : "ok";
}

static void expect_simple(pb_client_t *c, const char *method, const char *code)
{
    pb_reply_t r;
    simple(c, method, &r);
    if (strcmp(code_of(&r), code) != 0)
        fail_msg("%s: expected %s, got %s (%s)", method, code, code_of(&r), r.error ? pb_reply_message(&r) : "");
    if (r.error)
        assert_true(strlen(pb_reply_message(&r)) > 0);
    pb_reply_free(&r);
}

static uint64_t hello_limit(pb_client_t *c, const char *name)
{
    pb_reply_t r;
    simple(c, "hello", &r);
    assert_null(r.error);
    uint64_t v = 0;
    assert_int_equal(pb_obj_uint(pb_obj_get(pb_obj_get(r.result, "limits"), name), &v), 0);
    pb_reply_free(&r);
    return v;
}

static uint64_t stat_of(pb_client_t *c, const char *key)
{
    pb_reply_t r;
    simple(c, "stats", &r);
    assert_null(r.error);
    uint64_t v = 0;
    assert_int_equal(pb_obj_uint(pb_obj_get(r.result, key), &v), 0);
    pb_reply_free(&r);
    return v;
}

static const double W[12] = {0.1, -0.2, 0.3, 0.4, -0.5, 0.6, 0.7, 0.8, -0.9, 1.0, 0.1, 0.2};
static const double X[8] = {1, 2, 3, 4, 5, 6, 7, 8};
static const double B[3] = {0.5, -0.5, 0.25};

static void pack_t(msgpack_packer *pk, const char *name, const double *v, int rank, uint64_t r, uint64_t c)
{
    pb_ctensor_t t = {.dtype = "f64", .rank = rank, .shape = {r, c}, .data = v,
                      .nbytes = (size_t)(r * (rank == 2 ? c : 1)) * 8};
    pb_pack_str(pk, name);
    pb_pack_tensor(pk, &t);
}

/* augmented_forward of a 3x4 fused_dense with wrt [x] (scope NULL: the
 * default).  Returns the error code or "ok"; *tape and *bytes on success. */
static const char *aug(pb_client_t *c, const char *scope, uint64_t *tape, uint64_t *bytes)
{
    msgpack_packer *pk = pb_client_begin(c, "augmented_forward");
    msgpack_pack_map(pk, scope ? 5 : 4);
    pb_pack_kv_str(pk, "op", "fused_dense");
    pb_pack_str(pk, "inputs");
    msgpack_pack_map(pk, 3);
    pack_t(pk, "weight", W, 2, 3, 4);
    pack_t(pk, "x", X, 2, 4, 2);
    pack_t(pk, "bias", B, 1, 3, 0);
    pb_pack_str(pk, "options");
    msgpack_pack_map(pk, 1);
    pb_pack_kv_str(pk, "act", "tanh");
    pb_pack_str(pk, "wrt");
    msgpack_pack_array(pk, 1);
    pb_pack_str(pk, "x");
    if (scope)
        pb_pack_kv_str(pk, "scope", scope);
    pb_reply_t r;
    assert_int_equal(pb_client_call(c, &r), 0);
    static char code[64];
    snprintf(code, sizeof code, "%s", code_of(&r));
    if (r.error && strcmp(code, "resource_exhausted") == 0) {
        /* The limit is named: remember it for the caller. */
        const msgpack_object *l = pb_obj_get(r.error, "limit");
        assert_non_null(l);
        assert_int_equal(l->type, MSGPACK_OBJECT_STR);
        snprintf(code, sizeof code, "resource_exhausted:%.*s", (int)l->via.str.size, l->via.str.ptr);
    }
    if (r.error == NULL) {
        assert_int_equal(pb_obj_uint(pb_obj_get(r.result, "tape"), tape), 0);
        if (bytes)
            assert_int_equal(pb_obj_uint(pb_obj_get(r.result, "tape_bytes"), bytes), 0);
    }
    pb_reply_free(&r);
    return code;
}

/* reverse of such a tape; the error code or "ok". */
static const char *rev(pb_client_t *c, uint64_t tape, bool keep)
{
    static const double yb[6] = {1, -1, 0.5, 2, 0, 1};
    msgpack_packer *pk = pb_client_begin(c, "reverse");
    msgpack_pack_map(pk, keep ? 3 : 2);
    pb_pack_str(pk, "tape");
    msgpack_pack_uint64(pk, tape);
    pb_pack_str(pk, "cotangents");
    msgpack_pack_map(pk, 1);
    pack_t(pk, "y", yb, 2, 3, 2);
    if (keep) {
        pb_pack_str(pk, "keep");
        msgpack_pack_true(pk);
    }
    pb_reply_t r;
    assert_int_equal(pb_client_call(c, &r), 0);
    static char code[64];
    snprintf(code, sizeof code, "%s", code_of(&r));
    if (r.error == NULL)
        assert_non_null(pb_obj_path(r.result, "gradients.x"));
    pb_reply_free(&r);
    return code;
}

/* release; whether it released. */
static bool release(pb_client_t *c, uint64_t tape)
{
    msgpack_packer *pk = pb_client_begin(c, "release");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "tape");
    msgpack_pack_uint64(pk, tape);
    pb_reply_t r;
    assert_int_equal(pb_client_call(c, &r), 0);
    assert_null(r.error);
    bool rel = false;
    assert_int_equal(pb_obj_bool(pb_obj_get(r.result, "released"), &rel), 0);
    pb_reply_free(&r);
    return rel;
}

/* ---- activation ----------------------------------------------------------- */

/* systemd-socket-activate binds the socket, and on the first connection
 * execs the daemon (same pid) with LISTEN_FDS. */
static pid_t activate(const char *log, const char *const *extra)
{
    const char *argv[24];
    int n = 0;
    argv[n++] = activate_bin;
    for (int i = 0; extra[i]; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    return spawn(log, NULL, -1, argv);
}

static void wait_file(const char *path)
{
    struct stat st;
    for (int i = 0; i < 500 && stat(path, &st) != 0; i++)
        usleep(10000);
    assert_int_equal(stat(path, &st), 0);
}

static void activation_hello(void **state)
{
    (void)state;
    daemon_t d = {0};
    char unused[108], listen_arg[128];
    snprintf(d.path, sizeof d.path, "%s/act.sock", dir);
    snprintf(d.log, sizeof d.log, "%s/act.log", dir);
    snprintf(unused, sizeof unused, "%s/unused.sock", dir);
    snprintf(listen_arg, sizeof listen_arg, "--listen=%s", d.path);
    const char *extra[] = {listen_arg, "--fdname=pullbackd", daemon_bin, "--socket", unused, "--config",
                           "/dev/null", NULL};
    d.pid = activate(d.log, extra);
    wait_file(d.path);
    pb_client_t *c = conn(&d);
    pb_reply_t r;
    simple(c, "hello", &r);
    assert_null(r.error);
    pb_reply_free(&r);
    assert_int_equal(stat_of(c, "connections"), 1);
    /* The daemon served the passed socket: it bound nothing of its own. */
    struct stat st;
    assert_int_not_equal(stat(unused, &st), 0);
    assert_log(&d, "(socket from systemd)");
    /* SIGTERM drains and exits 0; the socket file is systemd's and stays. */
    pb_client_close(c);
    assert_int_equal(stop(&d), 0);
    assert_int_equal(stat(d.path, &st), 0);
    assert_true(S_ISSOCK(st.st_mode));
    unlink(d.path);
}

/* Several sockets: the daemon takes the one named pullbackd. */
static void activation_named(void **state)
{
    (void)state;
    daemon_t d = {0};
    char other[108], l1[128], l2[128];
    snprintf(other, sizeof other, "%s/other.sock", dir);
    snprintf(d.path, sizeof d.path, "%s/named.sock", dir);
    snprintf(d.log, sizeof d.log, "%s/named.log", dir);
    snprintf(l1, sizeof l1, "--listen=%s", other);
    snprintf(l2, sizeof l2, "--listen=%s", d.path);
    const char *extra[] = {l1, l2, "--fdname=metrics:pullbackd", daemon_bin, "--config", "/dev/null", NULL};
    d.pid = activate(d.log, extra);
    wait_file(d.path);
    pb_client_t *c = conn(&d);
    pb_reply_t r;
    simple(c, "hello", &r);
    assert_null(r.error);
    pb_reply_free(&r);
    pb_client_close(c);
    assert_log(&d, "named.sock (socket from systemd)");
    assert_int_equal(stop(&d), 0);
    unlink(d.path);
    unlink(other);
}

/* Several sockets and none named for us: a clear startup error. */
static void activation_unnamed(void **state)
{
    (void)state;
    daemon_t d = {0};
    char a[108], b[108], l1[128], l2[128];
    snprintf(a, sizeof a, "%s/u1.sock", dir);
    snprintf(b, sizeof b, "%s/u2.sock", dir);
    snprintf(d.log, sizeof d.log, "%s/unnamed.log", dir);
    snprintf(l1, sizeof l1, "--listen=%s", a);
    snprintf(l2, sizeof l2, "--listen=%s", b);
    const char *extra[] = {l1, l2, daemon_bin, "--config", "/dev/null", NULL};
    d.pid = activate(d.log, extra);
    wait_file(b);
    try_connect(a); /* wakes systemd-socket-activate, which execs */
    int rc = wait_exit(d.pid);
    assert_int_not_equal(rc, 0);
    assert_true(log_has(&d, "none is named pullbackd"));
    assert_true(log_has(&d, "<3>"));
    unlink(a);
    unlink(b);
}

/* ---- notify --------------------------------------------------------------- */

static int notify_socket(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    unlink(path);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    return fd;
}

/* The next datagram within ms (its text in buf), or false. */
static bool notify_recv(int fd, char *buf, size_t len, int ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, ms) <= 0)
        return false;
    ssize_t n = recv(fd, buf, len - 1, 0);
    if (n < 0)
        return false;
    buf[n] = 0;
    return true;
}

/* The next datagram that is not a watchdog ping; counts the pings. */
static bool notify_next(int fd, char *buf, size_t len, int ms, int *pings)
{
    double end = now_s() + ms / 1000.0;
    while (now_s() < end) {
        if (!notify_recv(fd, buf, len, (int)((end - now_s()) * 1000) + 1))
            return false;
        if (strcmp(buf, "WATCHDOG=1") == 0)
            ++*pings;
        else
            return true;
    }
    return false;
}

static void notify_sequence(void **state)
{
    (void)state;
    char npath[108], env_sock[140], buf[2048];
    snprintf(npath, sizeof npath, "%s/notify.sock", dir);
    snprintf(env_sock, sizeof env_sock, "NOTIFY_SOCKET=%s", npath);
    int nfd = notify_socket(npath);
    /* 200 ms: a ping every 100 ms. */
    const char *env[] = {env_sock, "WATCHDOG_USEC=200000", "WATCHDOG_PID=self", NULL};
    daemon_t d;
    snprintf(d.path, sizeof d.path, "%s/n.sock", dir);
    snprintf(d.log, sizeof d.log, "%s/n.log", dir);
    const char *argv[] = {daemon_bin, "--socket", d.path, "--config", "/dev/null", "--workers", "3", NULL};
    d.pid = spawn(d.log, env, -1, argv);
    int pings = 0;
    /* READY=1 is the first thing said, with a STATUS=, and by then the
     * socket takes connections. */
    assert_true(notify_next(nfd, buf, sizeof buf, 10000, &pings));
    assert_int_equal(pings, 0);
    if (strncmp(buf, "READY=1\n", 8) != 0 || strstr(buf, "STATUS=") == NULL)
        fail_msg("first notification: '%s'", buf);
    assert_int_equal(try_connect(d.path), 0);
    /* The watchdog pings every half period, from the loop. */
    double t0 = now_s();
    while (now_s() - t0 < 1.0) {
        if (notify_next(nfd, buf, sizeof buf, 50, &pings) && strncmp(buf, "STATUS=", 7) != 0)
            fail_msg("unexpected notification: '%s'", buf);
    }
    if (pings < 5)
        fail_msg("%d WATCHDOG=1 in 1 s with WATCHDOG_USEC=200000", pings);
    /* STATUS= follows what the daemon holds. */
    pb_client_t *c = conn(&d);
    uint64_t tape;
    assert_string_equal(aug(c, NULL, &tape, NULL), "ok");
    bool seen = false;
    t0 = now_s();
    while (!seen && now_s() - t0 < 6) {
        if (notify_next(nfd, buf, sizeof buf, 500, &pings))
            seen = strstr(buf, "STATUS=") && strstr(buf, "1 connections, 1 tapes held") &&
                   strstr(buf, "requests served");
    }
    if (!seen)
        fail_msg("no STATUS= with 1 connection and 1 tape; last: '%s'", buf);
    /* SIGHUP: RELOADING=1, then READY=1 again. */
    kill(d.pid, SIGHUP);
    do
        assert_true(notify_next(nfd, buf, sizeof buf, 5000, &pings));
    while (strncmp(buf, "STATUS=", 7) == 0);
    assert_string_equal(buf, "RELOADING=1");
    assert_true(notify_next(nfd, buf, sizeof buf, 5000, &pings));
    assert_true(strncmp(buf, "READY=1\n", 8) == 0);
    /* SIGTERM: STOPPING=1 (with the draining status), then exit 0, with
     * nothing but pings in between. */
    kill(d.pid, SIGTERM);
    do
        assert_true(notify_next(nfd, buf, sizeof buf, 5000, &pings));
    while (strncmp(buf, "STATUS=", 7) == 0);
    if (strncmp(buf, "STOPPING=1\n", 11) != 0 || strstr(buf, "STATUS=draining") == NULL)
        fail_msg("expected STOPPING=1, got '%s'", buf);
    pb_client_close(c);
    assert_int_equal(wait_exit(d.pid), 0);
    while (notify_recv(nfd, buf, sizeof buf, 0))
        assert_true(strcmp(buf, "WATCHDOG=1") == 0 || strncmp(buf, "STATUS=", 7) == 0);
    close(nfd);
}

/* WATCHDOG_PID naming another process: the variables were meant for it,
 * and the daemon sends no pings. */
static void watchdog_other_pid(void **state)
{
    (void)state;
    char npath[108], env_sock[140], buf[2048];
    snprintf(npath, sizeof npath, "%s/notify2.sock", dir);
    snprintf(env_sock, sizeof env_sock, "NOTIFY_SOCKET=%s", npath);
    int nfd = notify_socket(npath);
    const char *env[] = {env_sock, "WATCHDOG_USEC=100000", "WATCHDOG_PID=1", NULL};
    daemon_t d;
    assert_int_equal(start_env(&d, "wd.sock", env, -1, NULL), 0);
    int pings = 0;
    assert_true(notify_next(nfd, buf, sizeof buf, 10000, &pings));
    assert_true(strncmp(buf, "READY=1\n", 8) == 0);
    notify_next(nfd, buf, sizeof buf, 500, &pings);
    assert_int_equal(pings, 0);
    assert_int_equal(stop(&d), 0);
    close(nfd);
}

/* ---- config file and reload ----------------------------------------------- */

static void config_at_start(void **state)
{
    (void)state;
    char conf[108], missing[108];
    snprintf(conf, sizeof conf, "%s/bad.conf", dir);
    snprintf(missing, sizeof missing, "%s/missing.conf", dir);
    write_file(conf, "# limits\nmax-tape-bytes = 1M\nmax-tapes-per-conection = 5\n");
    daemon_t d;
    /* A bad file is a clear error at start: exit 2, file and line named. */
    assert_int_equal(start(&d, "bad.sock", "--config", conf, NULL), 2);
    assert_true(log_has(&d, "<3>bad configuration: "));
    assert_true(log_has(&d, "bad.conf:3: unknown key 'max-tapes-per-conection'"));
    /* So is a missing --config file. */
    assert_int_equal(start(&d, "missing.sock", "--config", missing, NULL), 2);
    assert_true(log_has(&d, "missing.conf: No such file or directory"));
    /* A good one is read, and the flags win over it. */
    write_file(conf, "max-tape-bytes = 1M   # one mebibyte\nmax_tapes_per_connection = 5\n"
                     "max-inflight-per-connection = 3\n");
    assert_int_equal(start(&d, "good.sock", "--config", conf, "--max-inflight-per-connection", "9", NULL), 0);
    pb_client_t *c = conn(&d);
    assert_int_equal(hello_limit(c, "max_tape_bytes"), 1 << 20);
    assert_int_equal(hello_limit(c, "max_tapes_per_connection"), 5);
    assert_int_equal(hello_limit(c, "max_inflight_per_connection"), 9);
    pb_client_close(c);
    assert_int_equal(stop(&d), 0);
}

static void reload(void **state)
{
    (void)state;
    char conf[108], line[256];
    snprintf(conf, sizeof conf, "%s/reload.conf", dir);
    write_file(conf, "max-tape-bytes = 1M\nmax-tapes-per-connection = 5\nlog-level = info\n");
    daemon_t d;
    assert_int_equal(start(&d, "reload.sock", "--config", conf, "--max-inflight-per-connection", "9", NULL), 0);
    pb_client_t *c = conn(&d);
    /* The default level (info) shows connections with uid and pid, and
     * nothing per request. */
    snprintf(line, sizeof line, " opened (uid %u, pid %d)", (unsigned)getuid(), (int)getpid());
    assert_log(&d, line);
    assert_true(log_has(&d, "<6>connection "));
    assert_log(&d, " closed (uid "); /* start()'s probe */
    uint64_t t1, t2, bytes;
    assert_string_equal(aug(c, NULL, &t1, &bytes), "ok");
    assert_string_equal(aug(c, "peer", &t2, NULL), "ok");
    expect_simple(c, "no_such_method", "unknown_method");
    assert_int_equal(hello_limit(c, "max_tape_bytes"), 1 << 20);
    assert_false(log_has(&d, "msgid"));

    /* Reload: limits and log level change; socket-mode needs a restart;
     * the flags (--max-inflight-per-connection, and start()'s --workers)
     * still win over the file. */
    write_file(conf, "max-tape-bytes = 2M\nmax-tapes-per-connection = 6\nmax-inflight-per-connection = 3\n"
                     "workers = 3\nsocket-mode = 0600\nlog-level = debug\n");
    kill(d.pid, SIGHUP);
    assert_log(&d, "reloaded ");
    assert_int_equal(hello_limit(c, "max_tape_bytes"), 2 << 20);
    assert_int_equal(hello_limit(c, "max_tapes_per_connection"), 6);
    assert_int_equal(hello_limit(c, "max_inflight_per_connection"), 9);
    assert_log(&d, "<5>reload: max-tape-bytes 1048576 -> 2097152");
    assert_log(&d, "<4>reload: socket-mode changed from 0660 to 0600, which needs a restart; still 0660");
    assert_false(log_has(&d, "reload: workers"));
    assert_true(log_has(&d, "reloaded ") && log_has(&d, ": 3 settings changed, 1 need a restart"));
    /* The connection and its tapes survived. */
    assert_string_equal(rev(c, t1, true), "ok");
    assert_string_equal(rev(c, t2, true), "ok");
    assert_int_equal(stat_of(c, "tapes"), 2);
    /* At debug, a failed request is logged with its code. */
    expect_simple(c, "no_such_method", "unknown_method");
    assert_log(&d, ": msgid ");
    assert_log(&d, "<7>connection ");
    assert_log(&d, ": unknown_method: unknown method 'no_such_method'");

    /* A lowered limit is enforced at once, and names itself. */
    snprintf(line, sizeof line, "max-tape-bytes = %llu\n", (unsigned long long)(2 * bytes + 1));
    write_file(conf, line);
    kill(d.pid, SIGHUP);
    for (int i = 0; i < 500 && hello_limit(c, "max_tape_bytes") != 2 * bytes + 1; i++)
        usleep(10000);
    assert_int_equal(hello_limit(c, "max_tape_bytes"), 2 * bytes + 1);
    uint64_t t3;
    assert_string_equal(aug(c, NULL, &t3, NULL), "resource_exhausted:max_tape_bytes");
    assert_true(release(c, t2));
    assert_string_equal(aug(c, NULL, &t3, NULL), "ok");

    /* A bad file: logged with its line, ignored, nothing changes. */
    write_file(conf, "max-tape-bytes = lots\n");
    kill(d.pid, SIGHUP);
    assert_log(&d, "<3>reload failed, keeping the running configuration: ");
    assert_log(&d, "reload.conf:1: max-tape-bytes: expected a size");
    assert_int_equal(hello_limit(c, "max_tape_bytes"), 2 * bytes + 1);
    assert_string_equal(rev(c, t1, false), "ok");
    /* The file gone: it was named by --config, so that is an error too. */
    unlink(conf);
    kill(d.pid, SIGHUP);
    assert_log(&d, "reload.conf: No such file or directory");
    assert_int_equal(hello_limit(c, "max_tape_bytes"), 2 * bytes + 1);
    assert_int_equal(stat_of(c, "connections"), 1);
    pb_client_close(c);
    assert_int_equal(stop(&d), 0);
}

/* 48x48 by 48x48 fused_dense (about 221k flops, past what runs on the
 * loop), sent without waiting; its msgid. */
static uint32_t send_small_forward(pb_client_t *c)
{
    static double m[48 * 48];
    for (int i = 0; i < 48 * 48; i++)
        m[i] = (i % 5) * 0.1;
    msgpack_packer *pk = pb_client_begin(c, "forward");
    msgpack_pack_map(pk, 2);
    pb_pack_kv_str(pk, "op", "fused_dense");
    pb_pack_str(pk, "inputs");
    msgpack_pack_map(pk, 2);
    pack_t(pk, "weight", m, 2, 48, 48);
    pack_t(pk, "x", m, 2, 48, 48);
    uint32_t id;
    assert_int_equal(pb_client_send(c, &id), 0);
    return id;
}

/* Wait for each of ids: answered, or refused naming the in-flight limit;
 * the number refused. */
static int answered(pb_client_t *c, const uint32_t *ids, int n)
{
    int refused = 0;
    for (int i = 0; i < n; i++) {
        pb_reply_t r;
        assert_int_equal(pb_client_wait(c, ids[i], &r), 0);
        if (r.error) {
            assert_string_equal(pb_reply_code(&r), "resource_exhausted");
            assert_int_equal(pb_obj_strcmp(pb_obj_get(r.error, "limit"), "max_inflight_per_connection"), 0);
            refused++;
        } else {
            assert_non_null(pb_obj_path(r.result, "outputs.y"));
        }
        pb_reply_free(&r);
    }
    return refused;
}

/* A reload of the in-flight limit while requests are on the workers:
 * every request is answered, taken or refused naming the limit, and past
 * the reload the new limit holds. */
static void reload_inflight(void **state)
{
    (void)state;
    char conf[108];
    snprintf(conf, sizeof conf, "%s/inflight.conf", dir);
    write_file(conf, "max-inflight-per-connection = 1\n");
    daemon_t d;
    assert_int_equal(start(&d, "inflight.sock", "--config", conf, NULL), 0);
    pb_client_t *c = conn(&d);
    enum { N = 100 };
    uint32_t ids[N];
    for (int i = 0; i < N; i++) {
        ids[i] = send_small_forward(c);
        if (i == N / 2) {
            write_file(conf, "max-inflight-per-connection = 64\n");
            kill(d.pid, SIGHUP);
        }
    }
    answered(c, ids, N);
    assert_log(&d, "reload: max-inflight-per-connection 1 -> 64");
    assert_int_equal(hello_limit(c, "max_inflight_per_connection"), 64);
    /* 64 at once fit the new limit. */
    for (int i = 0; i < 64; i++)
        ids[i] = send_small_forward(c);
    assert_int_equal(answered(c, ids, 64), 0);
    pb_client_close(c);
    assert_int_equal(stop(&d), 0);
}

/* ---- identity ------------------------------------------------------------- */

/* A connection whose peer credentials are uid's: a child takes the uid,
 * connects (SO_PEERCRED records the connecting process), and hands the
 * socket back over SCM_RIGHTS. */
static pb_client_t *conn_as(const daemon_t *d, int uid)
{
    int sp[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sp), 0);
    pid_t p = fork();
    if (p == 0) {
        close(sp[0]);
        if (setgroups(0, NULL) || setgid((gid_t)uid) || setuid((uid_t)uid))
            _exit(2);
        int fd = socket(AF_UNIX, SOCK_STREAM, 0);
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        snprintf(a.sun_path, sizeof a.sun_path, "%s", d->path);
        if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0)
            _exit(3);
        char byte = 0;
        struct iovec iov = {.iov_base = &byte, .iov_len = 1};
        union {
            struct cmsghdr h;
            char buf[CMSG_SPACE(sizeof(int))];
        } u;
        memset(&u, 0, sizeof u);
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
        struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof fd);
        _exit(sendmsg(sp[1], &m, 0) == 1 ? 0 : 4);
    }
    close(sp[1]);
    char byte;
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } u;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    ssize_t n = recvmsg(sp[0], &m, 0);
    close(sp[0]);
    int st = wait_exit(p);
    if (n != 1 || st != 0)
        fail_msg("connecting as uid %d failed (child status %d)", uid, st);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    assert_non_null(cm);
    int fd;
    memcpy(&fd, CMSG_DATA(cm), sizeof fd);
    pb_client_t *c = NULL;
    assert_int_equal(pb_client_from_fd(fd, &c), 0);
    return c;
}

static void admin_only(void **state)
{
    (void)state;
    daemon_t d;
    assert_int_equal(start(&d, "admin.sock", "--socket-mode", "0666", NULL), 0);
    pb_client_t *nobody = conn_as(&d, NOBODY), *root = conn(&d);
    expect_simple(nobody, "drain", "permission_denied");
    expect_simple(nobody, "shutdown", "permission_denied");
    assert_log(&d, "drain refused for uid 65534");
    /* Refused means nothing happened: forward calls still run. */
    uint64_t t;
    assert_string_equal(aug(nobody, NULL, &t, NULL), "ok");
    assert_string_equal(aug(root, NULL, &t, NULL), "ok");
    /* uid 0 may. */
    expect_simple(root, "drain", "ok");
    assert_string_equal(aug(nobody, NULL, &t, NULL), "shutting_down");
    expect_simple(root, "shutdown", "ok");
    assert_int_equal(wait_exit(d.pid), 0);
    pb_client_close(nobody);
    pb_client_close(root);
}

/* The daemon's own uid may too, when it is not root; another uid may not. */
static void admin_own_uid(void **state)
{
    (void)state;
    char sub[80];
    snprintf(sub, sizeof sub, "%s/own", dir);
    assert_int_equal(mkdir(sub, 0755), 0);
    assert_int_equal(chown(sub, NOBODY, NOBODY), 0);
    daemon_t d;
    int rc = start_env(&d, "own/own.sock", NULL, NOBODY, "--socket-mode", "0666", NULL);
    if (rc == 127) {
        /* The build tree is not reachable by uid 65534 (a checkout under
         * /root, say): this case cannot run here. */
        printf("pullbackd cannot be run as uid %d from here: skipped\n", NOBODY);
        skip();
    }
    assert_int_equal(rc, 0);
    pb_client_t *other = conn_as(&d, OTHER), *self = conn_as(&d, NOBODY), *root = conn(&d);
    expect_simple(other, "drain", "permission_denied");
    expect_simple(other, "shutdown", "permission_denied");
    expect_simple(root, "drain", "ok");
    expect_simple(self, "shutdown", "ok");
    assert_int_equal(wait_exit(d.pid), 0);
    pb_client_close(other);
    pb_client_close(self);
    pb_client_close(root);
}

/* A peer-scoped tape is visible to its uid's connections only; uid 0 is
 * no exception. */
static void peer_scope_uids(void **state)
{
    (void)state;
    daemon_t d;
    assert_int_equal(start(&d, "peer.sock", "--socket-mode", "0666", NULL), 0);
    pb_client_t *root1 = conn(&d), *root2 = conn(&d), *nobody1 = conn_as(&d, NOBODY), *nobody2 = conn_as(&d, NOBODY);
    uint64_t rt, nt;
    assert_string_equal(aug(root1, "peer", &rt, NULL), "ok");
    assert_string_equal(aug(nobody1, "peer", &nt, NULL), "ok");
    /* Across uids: unknown_tape, release says false, the tape stays. */
    assert_string_equal(rev(nobody2, rt, true), "unknown_tape");
    assert_false(release(nobody2, rt));
    assert_string_equal(rev(root2, nt, true), "unknown_tape");
    assert_false(release(root2, nt));
    /* stats: peer_* counts the caller's uid only. */
    assert_int_equal(stat_of(nobody2, "peer_tapes"), 1);
    assert_int_equal(stat_of(root2, "peer_tapes"), 1);
    assert_int_equal(stat_of(root2, "tapes"), 2);
    /* Within a uid: usable from another connection. */
    assert_string_equal(rev(root2, rt, false), "ok");
    assert_string_equal(rev(nobody2, nt, false), "ok");
    pb_client_close(root1);
    pb_client_close(root2);
    pb_client_close(nobody1);
    pb_client_close(nobody2);
    assert_int_equal(stop(&d), 0);
}

/* max-tape-bytes-per-uid holds each uid to its own share. */
static void per_uid_limit(void **state)
{
    (void)state;
    daemon_t d;
    /* How big one tape is. */
    assert_int_equal(start(&d, "size.sock", NULL), 0);
    pb_client_t *c = conn(&d);
    uint64_t t, bytes;
    assert_string_equal(aug(c, NULL, &t, &bytes), "ok");
    assert_true(bytes > 0);
    pb_client_close(c);
    assert_int_equal(stop(&d), 0);

    char per_uid[32], total[32];
    snprintf(per_uid, sizeof per_uid, "%llu", (unsigned long long)(2 * bytes));
    snprintf(total, sizeof total, "%llu", (unsigned long long)(100 * bytes));
    assert_int_equal(start(&d, "uidlimit.sock", "--socket-mode", "0666", "--max-tape-bytes-per-uid", per_uid,
                           "--max-tape-bytes", total, NULL), 0);
    pb_client_t *n1 = conn_as(&d, NOBODY), *n2 = conn_as(&d, NOBODY), *root = conn(&d), *other = conn_as(&d, OTHER);
    assert_int_equal(hello_limit(root, "max_tape_bytes_per_uid"), 2 * bytes);
    uint64_t a, b, x;
    assert_string_equal(aug(n1, NULL, &a, NULL), "ok");
    assert_string_equal(aug(n2, "peer", &b, NULL), "ok");
    /* The uid's share is full, whichever of its connections asks. */
    assert_string_equal(aug(n1, NULL, &x, NULL), "resource_exhausted:max_tape_bytes_per_uid");
    assert_string_equal(aug(n2, "peer", &x, NULL), "resource_exhausted:max_tape_bytes_per_uid");
    /* Other uids are not touched by it. */
    assert_string_equal(aug(root, NULL, &x, NULL), "ok");
    assert_string_equal(aug(other, NULL, &x, NULL), "ok");
    /* Nothing else is disturbed: the full uid still runs reverse and
     * forward, and gets its share back by releasing. */
    assert_string_equal(rev(n1, a, true), "ok");
    assert_true(release(n2, b));
    assert_string_equal(aug(n1, NULL, &x, NULL), "ok");
    pb_client_close(n1);
    pb_client_close(n2);
    pb_client_close(root);
    pb_client_close(other);
    assert_int_equal(stop(&d), 0);
}

/* ---- restart -------------------------------------------------------------- */

/* SIGTERM with tapes held frees them and exits 0 (under ASan a leak would
 * make the exit status nonzero); the next run answers the old handles with
 * unknown_tape. */
static void restart_epoch(void **state)
{
    (void)state;
    daemon_t d;
    assert_int_equal(start(&d, "epoch.sock", "--log-level", "notice", NULL), 0);
    pb_client_t *c = conn(&d);
    uint64_t ct, pt;
    assert_string_equal(aug(c, NULL, &ct, NULL), "ok");
    assert_string_equal(aug(c, "peer", &pt, NULL), "ok");
    assert_int_equal(stat_of(c, "tapes"), 2);
    assert_int_equal(stop(&d), 0);
    /* The connection-scoped tape went with its connection at the stop; the
     * peer-scoped one was freed on the way out. */
    assert_true(log_has(&d, "<5>freeing 1 tapes still held ("));
    assert_true(log_has(&d, "<5>stopped\n"));
    pb_client_close(c);

    assert_int_equal(start(&d, "epoch.sock", NULL), 0);
    c = conn(&d);
    assert_string_equal(rev(c, pt, false), "unknown_tape");
    assert_string_equal(rev(c, ct, false), "unknown_tape");
    assert_false(release(c, pt));
    assert_false(release(c, ct));
    uint64_t nt;
    assert_string_equal(aug(c, "peer", &nt, NULL), "ok");
    assert_true(nt != pt && nt != ct);
    assert_int_equal(stat_of(c, "tapes"), 1);
    /* shutdown, with a tape held, also exits 0. */
    expect_simple(c, "shutdown", "ok");
    assert_int_equal(wait_exit(d.pid), 0);
    pb_client_close(c);
}

/* ---- main ----------------------------------------------------------------- */

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/pbsvc.XXXXXX");
    if (mkdtemp(dir) == NULL)
        return -1;
    /* Other uids must reach sockets in here (identity). */
    return chmod(dir, 0711);
}

static int teardown(void **state)
{
    (void)state;
    kill_children();
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : -1;
}

static bool find_program(const char *name, char *out, size_t len)
{
    const char *path = getenv("PATH");
    char buf[4096];
    snprintf(buf, sizeof buf, "%s:/usr/bin:/bin:/usr/sbin:/sbin", path ? path : "");
    for (char *save = NULL, *p = strtok_r(buf, ":", &save); p; p = strtok_r(NULL, ":", &save)) {
        snprintf(out, len, "%s/%s", p, name);
        if (access(out, X_OK) == 0)
            return true;
    }
    return false;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: e2e_service PATH_TO_PULLBACKD activation|notify|reload|identity|restart\n");
        return 2;
    }
    daemon_bin = argv[1];
    const char *group = argv[2];
    signal(SIGPIPE, SIG_IGN);
    if (strcmp(group, "activation") == 0) {
        if (!find_program("systemd-socket-activate", activate_bin, sizeof activate_bin)) {
            printf("systemd-socket-activate not found (package systemd): skipped\n");
            return 77;
        }
        const struct CMUnitTest tests[] = {
            cmocka_unit_test(activation_hello),
            cmocka_unit_test(activation_named),
            cmocka_unit_test(activation_unnamed),
        };
        return cmocka_run_group_tests_name("e2e.service.activation", tests, setup, teardown);
    }
    if (strcmp(group, "notify") == 0) {
        const struct CMUnitTest tests[] = {
            cmocka_unit_test(notify_sequence),
            cmocka_unit_test(watchdog_other_pid),
        };
        return cmocka_run_group_tests_name("e2e.service.notify", tests, setup, teardown);
    }
    if (strcmp(group, "reload") == 0) {
        const struct CMUnitTest tests[] = {
            cmocka_unit_test(config_at_start),
            cmocka_unit_test(reload),
            cmocka_unit_test(reload_inflight),
        };
        return cmocka_run_group_tests_name("e2e.service.reload", tests, setup, teardown);
    }
    if (strcmp(group, "identity") == 0) {
        if (geteuid() != 0) {
            printf("not root: cannot connect as other uids: skipped\n");
            return 77;
        }
        const struct CMUnitTest tests[] = {
            cmocka_unit_test(admin_only),
            cmocka_unit_test(admin_own_uid),
            cmocka_unit_test(peer_scope_uids),
            cmocka_unit_test(per_uid_limit),
        };
        return cmocka_run_group_tests_name("e2e.service.identity", tests, setup, teardown);
    }
    if (strcmp(group, "restart") == 0) {
        const struct CMUnitTest tests[] = {
            cmocka_unit_test(restart_epoch),
        };
        return cmocka_run_group_tests_name("e2e.service.restart", tests, setup, teardown);
    }
    fprintf(stderr, "e2e_service: unknown group '%s'\n", group);
    return 2;
}
