/* fault: clients that misbehave, and one that behaves and must not notice.
 *
 * One private daemon.  All along, a "healthy" connection runs forward and
 * augmented_forward + reverse on the load cases, checks every reply, and
 * records its slowest round trip.  Meanwhile:
 *   killed     child processes connect, make tapes, then keep pipelining
 *              requests (one also leaves half a large message in the
 *              socket) and are SIGKILLed mid-stream;
 *   closed     connections pipeline hundreds of requests (small ones, and
 *              larger ones that go to the workers) and close without
 *              reading a reply;
 *   no-reader  a connection keeps sending requests with large replies
 *              (fused_dense with a W of M×1 and an x of 1×N: a 16 KiB
 *              request, an 8 MiB M×N f64 reply) and never reads: the daemon
 *              must stop reading from it (back-pressure) so that its
 *              resident memory stays bounded, whatever its in-flight limit.
 *              The bound checked is the memory before plus 64 MiB (the
 *              daemon's cap on the reply bytes one connection may have
 *              queued or coming) plus four replies of slack.  Once it has
 *              left, the daemon's memory must come back to within 16 MiB of
 *              what it was before (glibc only: the daemon hands freed
 *              memory back with malloc_trim; not under AddressSanitizer).
 * After each, the daemon must be quiet again: the dead connections' tapes
 * freed (stats tapes 0, tape_bytes 0), nothing in flight, and the
 * connection count back to the healthy one and the monitor.  The healthy
 * connection must get every reply right, and none later than --max-stall
 * seconds.  The daemon must exit 0 on SIGTERM at the end.
 *
 * Usage: fault [--seconds S] [--inflight N] [--max-stall S] PULLBACKD
 *   --seconds    how long the no-reader keeps sending (default 2)
 *   --inflight   the daemon's --max-inflight-per-connection (default: the
 *                daemon's own, 1024); the bound does not depend on it
 *   --max-stall  the healthy connection's slowest round trip allowed
 *                (default 2 s) */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "load_common.h"

/* What the daemon may keep resident after the no-reader leaves (see there). */
#define KEEP_CAP ((uint64_t)64 << 20)

static struct {
    double seconds, max_stall;
    const char *inflight;
    const char *bin;
    daemon_t d;
} cfg = {.seconds = 2, .max_stall = 2};

/* The no-reader's request: W M×1, x 1×N, so y is M×N. */
#define NR_M 1024
#define NR_N 1024

/* ---- the healthy connection ------------------------------------------------ */

static atomic_int healthy_stop, healthy_pause, healthy_paused;
static _Atomic uint64_t healthy_max_ns, healthy_done;

static bool healthy_call(pb_client_t *c, const lc_case_t *k, bool taped, uint64_t *tape)
{
    pb_reply_t r;
    char why[256];
    lc_begin_call(c, k, taped);
    uint64_t t0 = now_ns();
    int rc = pb_client_call(c, &r);
    uint64_t dt = now_ns() - t0;
    if (dt > atomic_load(&healthy_max_ns))
        atomic_store(&healthy_max_ns, dt);
    if (rc < 0) {
        lc_fail("healthy: %s: %s", taped ? "augmented_forward" : "forward", strerror(-rc));
        return false;
    }
    bool ok = r.error == NULL && lc_outputs_ok(k, r.result, why, sizeof why);
    if (r.error != NULL)
        lc_fail("healthy: %s: %s", pb_reply_code(&r), pb_reply_message(&r));
    else if (!ok)
        lc_fail("healthy: %s of %s: %s", taped ? "augmented_forward" : "forward", k->op, why);
    if (ok && taped && pb_obj_uint(pb_obj_get(r.result, "tape"), tape) < 0) {
        lc_fail("healthy: no tape handle");
        ok = false;
    }
    pb_reply_free(&r);
    if (!ok || !taped)
        return ok;
    lc_begin_reverse(c, k, *tape);
    t0 = now_ns();
    rc = pb_client_call(c, &r);
    dt = now_ns() - t0;
    if (dt > atomic_load(&healthy_max_ns))
        atomic_store(&healthy_max_ns, dt);
    if (rc < 0) {
        lc_fail("healthy: reverse: %s", strerror(-rc));
        return false;
    }
    ok = r.error == NULL && lc_gradients_ok(k, r.result, why, sizeof why);
    if (!ok)
        lc_fail("healthy: reverse of %s: %s", k->op, r.error ? pb_reply_message(&r) : why);
    pb_reply_free(&r);
    return ok;
}

static void *healthy_main(void *arg)
{
    pb_client_t *c = arg;
    unsigned i = 0;
    while (!atomic_load(&healthy_stop)) {
        if (atomic_load(&healthy_pause)) {
            atomic_store(&healthy_paused, 1);
            usleep(1000);
            continue;
        }
        /* paused goes to 0 before pause is read again: a pauser that saw
         * paused = 1 after setting pause is sure no call runs */
        atomic_store(&healthy_paused, 0);
        if (atomic_load(&healthy_pause))
            continue;
        uint64_t tape;
        if (!healthy_call(c, &lc_cases[i % LC_NCASES], i % 2 == 1, &tape))
            break;
        atomic_fetch_add(&healthy_done, 1);
        i++;
        usleep(500);
    }
    atomic_store(&healthy_paused, 1);
    return NULL;
}

/* Quiet means: only the healthy connection and the monitor, nothing in
 * flight, no tape.  The healthy connection holds a tape between its
 * augmented_forward and reverse, so it is paused while stats are read. */
static void healthy_hold(void)
{
    atomic_store(&healthy_pause, 1);
    while (!atomic_load(&healthy_paused))
        usleep(500);
}

static void expect_quiet(pb_client_t *mon, const char *after)
{
    lc_stats_t st;
    healthy_hold();
    if (lc_wait_quiet(mon, 2, 10000, &st) < 0)
        lc_fail("after %s: %llu tapes (%llu bytes), %llu in flight, %llu connections; expected 0, 0, 2", after,
                (unsigned long long)st.tapes, (unsigned long long)st.tape_bytes,
                (unsigned long long)st.requests_in_flight, (unsigned long long)st.connections);
    else
        printf("%-10s quiet again: 0 tapes, 0 bytes, 0 in flight, 2 connections (healthy + monitor)\n", after);
    atomic_store(&healthy_pause, 0);
}

/* ---- killed children -------------------------------------------------------- */

/* A child that cannot go on says why (the parent then reports it missing). */
static _Noreturn void child_gives_up(const char *why, const char *detail)
{
    fprintf(stderr, "killed: child %d gives up: %s%s%s\n", (int)getpid(), why, detail ? ": " : "",
            detail ? detail : "");
    _exit(1);
}

/* In the child: make tapes, say so on ready, then pipeline until killed.
 * Child `half` also writes the first half of a 1 MiB message first. */
static _Noreturn void child_main(int ready, bool half)
{
    pb_client_t *c = NULL;
    if (pb_client_connect(cfg.d.sock, &c) < 0)
        child_gives_up("cannot connect", NULL);
    for (int i = 0; i < 20; i++) {
        pb_reply_t r;
        lc_begin_call(c, &lc_cases[i % LC_NCASES], true);
        if (pb_client_call(c, &r) < 0)
            child_gives_up("connection lost", NULL);
        if (r.error != NULL)
            child_gives_up(pb_reply_code(&r), pb_reply_message(&r));
        pb_reply_free(&r);
    }
    if (half) {
        /* [0, 1, "forward", [{"op": "fused_dense", "inputs": {"weight": {"data": bin32 of 1 MiB ...
         * cut after 512 KiB: the daemon holds a partial message. */
        static unsigned char msg[512 << 10];
        size_t n = 0;
        msg[n++] = 0x94, msg[n++] = 0, msg[n++] = 1;
        msg[n++] = 0xa7, memcpy(msg + n, "forward", 7), n += 7;
        msg[n++] = 0x91, msg[n++] = 0x81;
        msg[n++] = 0xa6, memcpy(msg + n, "inputs", 6), n += 6;
        msg[n++] = 0x81, msg[n++] = 0xa1, msg[n++] = 'x';
        msg[n++] = 0xc6, msg[n++] = 0x00, msg[n++] = 0x10, msg[n++] = 0x00, msg[n++] = 0x00; /* bin32 1 MiB */
        if (pb_client_send_raw(c, msg, sizeof msg) < 0)
            _exit(1);
    }
    if (write(ready, "r", 1) != 1)
        _exit(1);
    if (half)
        pause();
    for (unsigned i = 0;; i++) {
        uint32_t id;
        lc_begin_call(c, &lc_cases[i % LC_NCASES], i % 3 == 0);
        if (pb_client_send(c, &id) < 0)
            _exit(1);
        pb_reply_t r;
        /* Read some replies, not all: requests stay in flight. */
        while (pb_client_pending(c) && pb_client_recv(c, &r) == 0)
            pb_reply_free(&r);
    }
}

static void killed_children(pb_client_t *mon)
{
    enum { NCHILD = 8 };
    int p[2];
    if (pipe(p) != 0) {
        lc_fail("pipe");
        return;
    }
    /* Fork while the healthy thread is held between calls: a child of a
     * process with another thread inside malloc may inherit its lock taken
     * (AddressSanitizer's allocator, unlike glibc's, does not take its
     * locks around fork) and hang in its first malloc: "only 6 of 8
     * children got their tapes", now and then, under ASan. */
    pid_t pids[NCHILD];
    healthy_hold();
    for (int i = 0; i < NCHILD; i++) {
        pids[i] = fork();
        if (pids[i] == 0) {
            close(p[0]);
            child_main(p[1], i == 0);
        }
    }
    atomic_store(&healthy_pause, 0);
    close(p[1]);
    int ready = 0;
    char ch;
    struct pollfd pfd = {.fd = p[0], .events = POLLIN};
    while (ready < NCHILD && poll(&pfd, 1, 10000) == 1 && read(p[0], &ch, 1) == 1)
        ready++;
    close(p[0]);
    if (ready < NCHILD)
        lc_fail("killed: only %d of %d children got their tapes", ready, NCHILD);
    lc_stats_t st;
    if (lc_get_stats(mon, &st) == 0)
        printf("killed     %d children hold %llu tapes (%llu bytes) and are sending; SIGKILL\n", NCHILD,
               (unsigned long long)st.tapes, (unsigned long long)st.tape_bytes);
    usleep(100000);
    for (int i = 0; i < NCHILD; i++)
        kill(pids[i], SIGKILL);
    for (int i = 0; i < NCHILD; i++) {
        int s;
        waitpid(pids[i], &s, 0);
        if (!WIFSIGNALED(s) || WTERMSIG(s) != SIGKILL)
            lc_fail("killed: child %d ended otherwise than by SIGKILL (a request failed?)", i);
    }
    expect_quiet(mon, "killed");
}

/* ---- connections closed with requests in flight -------------------------- */

static void closed_in_flight(pb_client_t *mon)
{
    enum { NCONN = 16, NREQ = 200 };
    /* A forward large enough to go to a worker (W 128×128, x 128×64). */
    static double big[128 * 128];
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++)
        big[i] = (double)(i % 17) * 0.01;
    pb_ctensor_t w = {.dtype = "f64", .rank = 2, .shape = {128, 128}, .data = big, .nbytes = sizeof big};
    pb_ctensor_t x = {.dtype = "f64", .rank = 2, .shape = {128, 64}, .data = big, .nbytes = 128 * 64 * 8};
    uint64_t sent = 0;
    for (int k = 0; k < NCONN; k++) {
        pb_client_t *c = NULL;
        if (pb_client_connect(cfg.d.sock, &c) < 0) {
            lc_fail("closed: connect");
            continue;
        }
        for (int i = 0; i < NREQ; i++) {
            if (i % 10 == 0) {
                msgpack_packer *pk = pb_client_begin(c, "forward");
                msgpack_pack_map(pk, 2);
                pb_pack_kv_str(pk, "op", "fused_dense");
                pb_pack_str(pk, "inputs");
                msgpack_pack_map(pk, 2);
                pb_pack_str(pk, "weight");
                pb_pack_tensor(pk, &w);
                pb_pack_str(pk, "x");
                pb_pack_tensor(pk, &x);
            } else {
                lc_begin_call(c, &lc_cases[i % LC_NCASES], i % 2 == 0);
            }
            if (pb_client_send(c, NULL) < 0) {
                lc_fail("closed: send");
                break;
            }
            sent++;
        }
        pb_client_close(c);
    }
    printf("closed     %d connections sent %llu requests (1 in 10 to a worker, half of the rest taped) and closed "
           "without reading\n",
           NCONN, (unsigned long long)sent);
    expect_quiet(mon, "closed");
}

/* ---- a client that never reads ------------------------------------------------ */

/* What one connection may make the daemon hold in replies (conn.c). */
#define NR_CAP ((uint64_t)64 << 20)
/* Does the daemon's freed memory leave its resident set?  It calls
 * malloc_trim under glibc; ASan's quarantine keeps freed memory (and TSan
 * its shadow). */
#if defined(__GLIBC__) && !LC_ASAN
#define TRIMS 1
#else
#define TRIMS 0
#endif

static void no_reader(pb_client_t *mon)
{
    /* The request, packed once. */
    static double wv[NR_M], xv[NR_N];
    for (int i = 0; i < NR_M; i++)
        wv[i] = 0.001 * (i % 100);
    for (int i = 0; i < NR_N; i++)
        xv[i] = 0.002 * (i % 50);
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 4);
    msgpack_pack_int(&pk, 0);
    msgpack_pack_uint32(&pk, 7);
    pb_pack_str(&pk, "forward");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 2);
    pb_pack_kv_str(&pk, "op", "fused_dense");
    pb_pack_str(&pk, "inputs");
    msgpack_pack_map(&pk, 2);
    pb_ctensor_t w = {.dtype = "f64", .rank = 2, .shape = {NR_M, 1}, .data = wv, .nbytes = sizeof wv};
    pb_ctensor_t x = {.dtype = "f64", .rank = 2, .shape = {1, NR_N}, .data = xv, .nbytes = sizeof xv};
    pb_pack_str(&pk, "weight");
    pb_pack_tensor(&pk, &w);
    pb_pack_str(&pk, "x");
    pb_pack_tensor(&pk, &x);

    int fd = unix_connect(cfg.d.sock);
    if (fd < 0) {
        lc_fail("no-reader: connect: %s", strerror(-fd));
        msgpack_sbuffer_destroy(&sb);
        return;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    /* A small receive buffer, so the daemon's writes back up soon. */
    int small = 64 << 10;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);

    uint64_t rss0 = lc_rss(cfg.d.pid), rss_max = rss0, done0 = atomic_load(&healthy_done);
    /* The cap, four replies of slack (the request let in just under the
     * cap, allocator rounding); ASan's quarantine keeps up to 256 MiB of
     * freed blocks resident. */
    uint64_t bound = rss0 + NR_CAP + 4 * (uint64_t)NR_M * NR_N * 8 + ((uint64_t)(LC_ASAN ? 320 : 0) << 20);
    uint64_t end = now_ns() + (uint64_t)(cfg.seconds * 1e9), sent = 0, bytes = 0, last_progress = now_ns();
    size_t off = 0;
    while (now_ns() < end) {
        ssize_t n = write(fd, sb.data + off, sb.size - off);
        if (n > 0) {
            bytes += (uint64_t)n;
            off += (size_t)n;
            if (off == sb.size) {
                off = 0;
                sent++;
            }
            last_progress = now_ns();
            continue;
        }
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            lc_fail("no-reader: write: %s", strerror(errno));
            break;
        }
        /* The socket is full: the daemon is not reading.  Watch its memory. */
        uint64_t rss = lc_rss(cfg.d.pid);
        if (rss > rss_max)
            rss_max = rss;
        if (rss > bound) {
            lc_fail("no-reader: the daemon's resident memory reached %.0f MiB, over the bound %.0f MiB",
                    rss / 1048576.0, bound / 1048576.0);
            break;
        }
        struct pollfd pfd = {.fd = fd, .events = POLLOUT};
        poll(&pfd, 1, 20);
    }
    uint64_t stalled_ms = (now_ns() - last_progress) / 1000000;
    lc_stats_t st = {0};
    lc_get_stats(mon, &st);
    printf("no-reader  %.1f s: %llu requests (%.1f MiB) written, each asking for a %.0f MiB reply; the daemon "
           "stopped reading (writes blocked for the last %llu ms); %llu requests in flight\n",
           cfg.seconds, (unsigned long long)sent, bytes / 1048576.0, NR_M * NR_N * 8 / 1048576.0,
           (unsigned long long)stalled_ms, (unsigned long long)st.requests_in_flight);
    printf("no-reader  daemon rss %.1f MiB before, at most %.1f MiB while it sent (bound %.0f MiB%s); healthy "
           "connection: %llu round trips meanwhile\n",
           rss0 / 1048576.0, rss_max / 1048576.0, bound / 1048576.0,
           LC_ASAN ? ", with room for AddressSanitizer's quarantine" : "",
           (unsigned long long)(atomic_load(&healthy_done) - done0));
    if (stalled_ms < 200)
        lc_fail("no-reader: the daemon kept reading: writes never blocked for long");
    if (atomic_load(&healthy_done) == done0)
        lc_fail("no-reader: the healthy connection made no progress meanwhile");
    close(fd);
    msgpack_sbuffer_destroy(&sb);
    expect_quiet(mon, "no-reader");
    /* The connection is gone from stats before its last write is
     * cancelled and its memory freed: give that a moment.  The bound is
     * not the start: freed tensor blocks stay in the worker threads'
     * malloc arenas for the next request to reuse without page faults
     * (malloc_trim gives back the main arena only), a few of the 8 MiB
     * replies' worth; a leak of what the client had in flight would be
     * hundreds of MiB. */
    uint64_t after = lc_rss(cfg.d.pid), deadline = now_ns() + 2000000000u;
    while (TRIMS && after > rss0 + KEEP_CAP && now_ns() < deadline) {
        usleep(10000);
        after = lc_rss(cfg.d.pid);
    }
    printf("no-reader  daemon rss %.1f MiB after it left%s\n", after / 1048576.0,
           TRIMS ? "" : " (not checked: a sanitizer, or not glibc)");
    if (TRIMS && after > rss0 + KEEP_CAP)
        lc_fail("no-reader: the daemon's resident memory stayed at %.1f MiB after it left, %.1f MiB before",
                after / 1048576.0, rss0 / 1048576.0);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc)
            cfg.seconds = atof(argv[++i]);
        else if (strcmp(argv[i], "--max-stall") == 0 && i + 1 < argc)
            cfg.max_stall = atof(argv[++i]);
        else if (strcmp(argv[i], "--inflight") == 0 && i + 1 < argc)
            cfg.inflight = argv[++i];
        else if (argv[i][0] != '-' && cfg.bin == NULL)
            cfg.bin = argv[i];
        else
            cfg.bin = NULL, i = argc;
    }
    if (cfg.bin == NULL || cfg.seconds <= 0) {
        fprintf(stderr, "usage: fault [--seconds S] [--inflight N] [--max-stall S] PULLBACKD\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    lc_cases_init();
    const char *const extra[] = {"--max-inflight-per-connection", cfg.inflight, NULL};
    int rc = daemon_start(&cfg.d, cfg.bin, cfg.inflight ? extra : NULL);
    if (rc < 0) {
        fprintf(stderr, "fault: cannot start %s: %s\n", cfg.bin, strerror(-rc));
        return 1;
    }
    pb_client_t *mon = NULL, *healthy = NULL;
    if (pb_client_connect(cfg.d.sock, &mon) < 0 || pb_client_connect(cfg.d.sock, &healthy) < 0) {
        fprintf(stderr, "fault: cannot connect\n");
        daemon_stop(&cfg.d);
        return 1;
    }
    pthread_t th;
    pthread_create(&th, NULL, healthy_main, healthy);
    killed_children(mon);
    closed_in_flight(mon);
    no_reader(mon);
    atomic_store(&healthy_stop, 1);
    pthread_join(th, NULL);
    printf("healthy    %llu round trips, all checked; slowest %.1f ms\n",
           (unsigned long long)atomic_load(&healthy_done), atomic_load(&healthy_max_ns) / 1e6);
    if (atomic_load(&healthy_max_ns) > (uint64_t)(cfg.max_stall * 1e9))
        lc_fail("the healthy connection waited %.1f ms for a reply, more than %.1f s",
                atomic_load(&healthy_max_ns) / 1e6, cfg.max_stall);
    pb_client_close(healthy);
    pb_client_close(mon);

    pid_t pid = cfg.d.pid;
    kill(pid, SIGTERM);
    int st = 0;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
        lc_fail("the daemon did not exit 0 on SIGTERM (%s %d)", WIFEXITED(st) ? "status" : "signal",
                WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
    cfg.d.pid = 0;
    daemon_stop(&cfg.d);
    int n = atomic_load(&lc_failures);
    printf("%s: %d failure%s\n", n ? "FAILED" : "passed", n, n == 1 ? "" : "s");
    return n ? 1 : 0;
}
