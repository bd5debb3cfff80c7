/* bench_socket: pullbackd over its Unix socket, against floors measured in
 * the same run on the same machine.
 *
 * The program starts its own daemon (argv[1], else $PULLBACKD_BIN, else the
 * daemon of the meson build that built it) on a socket in a fresh mkdtemp
 * directory, waits until a connect succeeds, measures, and stops it with
 * SIGTERM.  Every figure is relative to
 * something measured in this run:
 *
 *   floor (1 connection)  a socketpair ping-pong between two threads of this
 *                         process, with the request and reply sizes of
 *                         `hello`: what one round trip through the kernel
 *                         costs here.  Printed: our hello p50 ÷ that p50.
 *   floor (pipelined)     a canned-reply server thread in this process: it
 *                         frames each request and answers with the bytes of
 *                         a real hello reply, doing no other work, driven by
 *                         the same client code as the daemon.
 *   targets               the project's: >= 150,000 hello/s and >= 50,000
 *                         seed forwards/s with 32 pipelining connections.
 *
 * Cases: hello; the seed case (fused_dense, W and x 2x2 f32, b length 2,
 * act "gelu") as forward, and as augmented_forward + reverse pairs, where
 * each reverse carries the tape handle its forward returned (so the pairs
 * are pipelined as many independent chains, each one slot of a window).
 *
 * Clients: the one-at-a-time rows marked "client library" go through
 * pb_client_call(), the way an application would.  The pipelined rows (and
 * the "raw" sync rows, for comparison) build requests by hand: each request
 * is a template packed once with msgpack-c, copied and given its msgid (and
 * tape) in place, and replies are framed by a small msgpack skipper instead
 * of being unpacked.  The library costs several microseconds of client CPU
 * per request (it re-unpacks the params to check them, polls before each
 * write and allocates a zone per reply); with clients and daemon sharing the
 * machine's cores, that would be measured as daemon slowness.
 *
 * The client threads (--threads, default 1) each drive their share of the
 * connections with epoll.  They run on the same cores as the daemon: the
 * "daemon CPU" and "client CPU" columns (CPU time over the measured window,
 * per request) show how the cores were shared.
 *
 * Usage: bench_socket [--quick] [--seconds S] [--threads N] [--conns N]
 *                     [--window N] [--only SUBSTRING] [PULLBACKD_BIN]
 * --quick: phases of 0.25 s (whole run about 4 s), for CI.  Default phases
 * are 3 s plus a 0.3 s warm-up, about 40 s in all.  --only runs the rows
 * whose name contains SUBSTRING (for profiling one case: the daemon's pid
 * is printed in the first line). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../test_daemon.h"
#include "pullbackd.h"

#define TARGET_HELLO 150000.0
#define TARGET_FORWARD 50000.0
/* Slot index bits of a msgid; the rest counts requests of the slot. */
#define SLOT_BITS 10
#define MAX_WINDOW (1 << SLOT_BITS)

static double opt_phase_s = 3.0, opt_warm_s = 0.3;
static int opt_threads = 1, opt_conns = 32, opt_window = 64;
static const char *opt_only; /* run only the rows whose name contains this */

static bool want(const char *name)
{
    return opt_only == NULL || strstr(name, opt_only) != NULL;
}

/* a / b, or NaN when b was not measured (a row left out by --only). */
static double ratio(double a, double b)
{
    return b > 0 ? a / b : NAN;
}


static void sleep_until(uint64_t t)
{
    struct timespec ts = {.tv_sec = (time_t)(t / 1000000000u), .tv_nsec = (long)(t % 1000000000u)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

static uint64_t process_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static _Noreturn void die(const char *what)
{
    fprintf(stderr, "bench_socket: %s\n", what);
    exit(1);
}

/* ---- the daemon --------------------------------------------------------- */



/* Start bin on a socket in a new temp directory; 0 once a connect works. */


/* ---- msgpack by hand (the hot loop) ------------------------------------- */

static uint64_t be_get(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

static void be_put(uint8_t *p, uint64_t v, int n)
{
    for (int i = n - 1; i >= 0; i--, v >>= 8)
        p[i] = (uint8_t)v;
}

/* Size of the one complete msgpack object at p; 0 when [p, end) holds only
 * part of it; -1 for a byte that starts no object. */
static ptrdiff_t mp_skip(const uint8_t *p, const uint8_t *end)
{
    const uint8_t *q = p;
    uint64_t todo = 1;
    while (todo) {
        if (q >= end)
            return 0;
        uint8_t b = *q++;
        uint64_t len = 0, kids = 0;
        int hdr = 0;      /* bytes of a big-endian length or count that follow */
        int what = 0;     /* 0: len is the payload; 1: hdr gives payload; 2: hdr gives
                             a payload + ext type byte; 3: hdr gives array count;
                             4: hdr gives map count */
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
            ;
        else if (b <= 0x8f)
            kids = 2u * (b & 0x0f);
        else if (b <= 0x9f)
            kids = b & 0x0f;
        else if (b <= 0xbf)
            len = b & 0x1f;
        else
            switch (b) {
            case 0xc4: case 0xd9: hdr = 1; what = 1; break;
            case 0xc5: case 0xda: hdr = 2; what = 1; break;
            case 0xc6: case 0xdb: hdr = 4; what = 1; break;
            case 0xc7: hdr = 1; what = 2; break;
            case 0xc8: hdr = 2; what = 2; break;
            case 0xc9: hdr = 4; what = 2; break;
            case 0xcc: case 0xd0: len = 1; break;
            case 0xcd: case 0xd1: len = 2; break;
            case 0xca: case 0xce: case 0xd2: len = 4; break;
            case 0xcb: case 0xcf: case 0xd3: len = 8; break;
            case 0xd4: len = 2; break;
            case 0xd5: len = 3; break;
            case 0xd6: len = 5; break;
            case 0xd7: len = 9; break;
            case 0xd8: len = 17; break;
            case 0xdc: hdr = 2; what = 3; break;
            case 0xdd: hdr = 4; what = 3; break;
            case 0xde: hdr = 2; what = 4; break;
            case 0xdf: hdr = 4; what = 4; break;
            default: return -1; /* 0xc1 */
            }
        if (hdr) {
            if (end - q < hdr)
                return 0;
            uint64_t v = be_get(q, hdr);
            q += hdr;
            if (what == 1)
                len = v;
            else if (what == 2)
                len = v + 1;
            else if (what == 3)
                kids = v;
            else
                kids = 2 * v;
        }
        if ((uint64_t)(end - q) < len)
            return 0;
        q += len;
        todo = todo - 1 + kids;
    }
    return q - p;
}

/* A positive integer at p (fixint, uint8..64); its size, or 0. */
static int mp_uint(const uint8_t *p, const uint8_t *end, uint64_t *v)
{
    if (p >= end)
        return 0;
    int n = p[0] <= 0x7f ? 0 : p[0] == 0xcc ? 1 : p[0] == 0xcd ? 2 : p[0] == 0xce ? 4 : p[0] == 0xcf ? 8 : -1;
    if (n < 0 || end - p < 1 + n)
        return 0;
    *v = n ? be_get(p + 1, n) : p[0];
    return 1 + n;
}

/* The value of key in the map at p (whose extent is [p, end)), or NULL. */
static const uint8_t *mp_map_find(const uint8_t *p, const uint8_t *end, const char *key)
{
    uint64_t n;
    if (p >= end)
        return NULL;
    if ((p[0] & 0xf0) == 0x80)
        n = p[0] & 0x0f, p += 1;
    else if (p[0] == 0xde && end - p >= 3)
        n = be_get(p + 1, 2), p += 3;
    else if (p[0] == 0xdf && end - p >= 5)
        n = be_get(p + 1, 4), p += 5;
    else
        return NULL;
    size_t kl = strlen(key);
    for (uint64_t i = 0; i < n; i++) {
        ptrdiff_t k = mp_skip(p, end);
        if (k <= 0)
            return NULL;
        bool hit = false;
        if ((p[0] & 0xe0) == 0xa0)
            hit = (size_t)(p[0] & 0x1f) == kl && memcmp(p + 1, key, kl) == 0;
        else if (p[0] == 0xd9)
            hit = p[1] == kl && memcmp(p + 2, key, kl) == 0;
        p += k;
        if (hit)
            return p;
        ptrdiff_t v = mp_skip(p, end);
        if (v <= 0)
            return NULL;
        p += v;
    }
    return NULL;
}

/* A reply [1, msgid, error, result]: its msgid, whether error is non-nil,
 * and where error and result start.  -1 when it is not a reply. */
static int reply_head(const uint8_t *p, const uint8_t *end, uint32_t *msgid, bool *is_err, const uint8_t **errp,
                      const uint8_t **res)
{
    if (end - p < 4 || p[0] != 0x94 || p[1] != 0x01)
        return -1;
    uint64_t id;
    int k = mp_uint(p + 2, end, &id);
    if (k == 0 || id > UINT32_MAX)
        return -1;
    const uint8_t *e = p + 2 + k;
    if (e >= end)
        return -1;
    *msgid = (uint32_t)id;
    *errp = e;
    *is_err = *e != 0xc0;
    ptrdiff_t n = mp_skip(e, end);
    if (n <= 0)
        return -1;
    *res = e + n;
    return 0;
}

/* A request packed once; copies get their msgid (and tape) patched in. */
typedef struct tmpl {
    uint8_t *p;
    size_t n;
    size_t id_off;   /* 4 bytes, big-endian msgid */
    size_t tape_off; /* 8 bytes, big-endian tape handle; 0: none */
} tmpl_t;

static tmpl_t t_hello, t_forward, t_aug, t_rev;

static msgpack_sbuffer tsb;
static msgpack_packer tpk;

static msgpack_packer *tmpl_begin(const char *method, tmpl_t *t)
{
    msgpack_sbuffer_init(&tsb);
    msgpack_packer_init(&tpk, &tsb, msgpack_sbuffer_write);
    msgpack_pack_array(&tpk, 4);
    msgpack_pack_int(&tpk, 0);
    t->id_off = tsb.size + 1;
    msgpack_pack_fix_uint32(&tpk, 0);
    pb_pack_str(&tpk, method);
    msgpack_pack_array(&tpk, 1);
    t->tape_off = 0;
    return &tpk;
}

static void tmpl_end(tmpl_t *t)
{
    t->n = tsb.size;
    t->p = (uint8_t *)msgpack_sbuffer_release(&tsb);
}

/* ---- the seed case ------------------------------------------------------ */

static const float seed_w[4] = {0.5f, -0.25f, 0.125f, 1.0f};
static const float seed_x[4] = {1.0f, 2.0f, -1.0f, 0.5f};
static const float seed_b[2] = {0.1f, -0.2f};
static const float seed_ybar[4] = {1.0f, 1.0f, 1.0f, 1.0f};

static pb_ctensor_t f32(const float *v, int rank, uint64_t d0, uint64_t d1)
{
    pb_ctensor_t t = {0};
    t.dtype = "f32";
    t.rank = rank;
    t.shape[0] = d0;
    t.shape[1] = d1;
    t.data = v;
    t.nbytes = (rank == 2 ? d0 * d1 : d0) * sizeof(float);
    return t;
}

static void pack_seed_call(msgpack_packer *pk, bool augmented)
{
    pb_ctensor_t w = f32(seed_w, 2, 2, 2), x = f32(seed_x, 2, 2, 2), b = f32(seed_b, 1, 2, 0);
    msgpack_pack_map(pk, augmented ? 4 : 3);
    pb_pack_kv_str(pk, "op", "fused_dense");
    pb_pack_str(pk, "inputs");
    msgpack_pack_map(pk, 3);
    pb_pack_str(pk, "weight");
    pb_pack_tensor(pk, &w);
    pb_pack_str(pk, "x");
    pb_pack_tensor(pk, &x);
    pb_pack_str(pk, "bias");
    pb_pack_tensor(pk, &b);
    pb_pack_str(pk, "options");
    msgpack_pack_map(pk, 1);
    pb_pack_kv_str(pk, "act", "gelu");
    if (augmented) {
        pb_pack_str(pk, "wrt");
        msgpack_pack_array(pk, 3);
        pb_pack_str(pk, "weight");
        pb_pack_str(pk, "x");
        pb_pack_str(pk, "bias");
    }
}

static void pack_reverse(msgpack_packer *pk, uint64_t tape, size_t *tape_off)
{
    pb_ctensor_t yb = f32(seed_ybar, 2, 2, 2);
    msgpack_pack_map(pk, 2);
    pb_pack_str(pk, "tape");
    if (tape_off)
        *tape_off = tsb.size + 1;
    msgpack_pack_fix_uint64(pk, tape);
    pb_pack_str(pk, "cotangents");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "y");
    pb_pack_tensor(pk, &yb);
}

static void make_templates(void)
{
    msgpack_pack_map(tmpl_begin("hello", &t_hello), 0);
    tmpl_end(&t_hello);
    pack_seed_call(tmpl_begin("forward", &t_forward), false);
    tmpl_end(&t_forward);
    pack_seed_call(tmpl_begin("augmented_forward", &t_aug), true);
    tmpl_end(&t_aug);
    pack_reverse(tmpl_begin("reverse", &t_rev), 0, &t_rev.tape_off);
    tmpl_end(&t_rev);
}

/* ---- results ------------------------------------------------------------ */

typedef struct result {
    uint64_t n;          /* requests (or pairs) completed in the window */
    double secs;         /* the measured window */
    double rps;
    double p50_us, p99_us;
    double daemon_cpu_us, client_cpu_us; /* per request; < 0: not measured */
    uint64_t errors;
} result_t;

typedef struct lat {
    uint32_t *v; /* ns, saturated at ~4.29 s */
    size_t n, cap;
} lat_t;

static void lat_add(lat_t *l, uint64_t ns)
{
    if (l->n == l->cap) {
        size_t nc = l->cap ? l->cap * 2 : 65536;
        uint32_t *nv = realloc(l->v, nc * sizeof *nv);
        if (nv == NULL)
            die("out of memory for latency samples");
        l->v = nv;
        l->cap = nc;
    }
    l->v[l->n++] = ns > UINT32_MAX ? UINT32_MAX : (uint32_t)ns;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static void lat_finish(lat_t *l, result_t *r)
{
    if (l->n == 0) {
        r->p50_us = r->p99_us = 0;
        return;
    }
    qsort(l->v, l->n, sizeof *l->v, cmp_u32);
    r->p50_us = l->v[l->n / 2] / 1e3;
    r->p99_us = l->v[(size_t)((double)(l->n - 1) * 0.99)] / 1e3;
}

/* ---- the load driver ---------------------------------------------------- */

enum workload { WL_HELLO, WL_FORWARD, WL_PAIR };

typedef struct slot {
    uint64_t t0;   /* when the request (for a pair: its forward) was written */
    uint32_t seq;
    uint8_t phase; /* pairs: 0 forward in flight, 1 reverse in flight */
    bool busy;
} slot_t;

typedef struct lconn {
    int fd;
    uint8_t *rb;
    size_t rlen, rcap;
    uint8_t *wb;
    size_t wlen, woff, wcap;
    bool want_out;
    int outstanding;
    slot_t *slot;
} lconn_t;

typedef struct load {
    enum workload kind;
    const char *sock;
    int nconn, window, nthreads;
    uint64_t t_meas0, t_meas1, t_stop;
    pthread_barrier_t bar;
    atomic_ullong errors;
    atomic_int failed;
    pthread_mutex_t lock;
    char why[256];
} load_t;

typedef struct lthread {
    load_t *L;
    pthread_t th;
    int first, count;
    uint64_t done;
    lat_t lat;
} lthread_t;

static void load_fail(load_t *L, const char *fmt, const char *detail)
{
    pthread_mutex_lock(&L->lock);
    if (!L->failed)
        snprintf(L->why, sizeof L->why, fmt, detail);
    L->failed = 1;
    pthread_mutex_unlock(&L->lock);
}

static void issue(lconn_t *c, int s, const tmpl_t *t, uint64_t tape)
{
    if (c->wcap - c->wlen < t->n) {
        size_t nc = c->wcap ? c->wcap * 2 : 65536;
        while (nc - c->wlen < t->n)
            nc *= 2;
        uint8_t *nb = realloc(c->wb, nc);
        if (nb == NULL)
            die("out of memory for requests");
        c->wb = nb;
        c->wcap = nc;
    }
    uint8_t *p = c->wb + c->wlen;
    memcpy(p, t->p, t->n);
    slot_t *sl = &c->slot[s];
    sl->seq = (sl->seq + 1) & ((1u << (32 - SLOT_BITS)) - 1);
    if (sl->seq == 0)
        sl->seq = 1;
    be_put(p + t->id_off, (uint64_t)sl->seq << SLOT_BITS | (uint64_t)s, 4);
    if (t->tape_off)
        be_put(p + t->tape_off, tape, 8);
    c->wlen += t->n;
    sl->busy = true;
}

static void conn_events(int ep, lconn_t *c, bool out)
{
    if (c->want_out == out)
        return;
    struct epoll_event ev = {.events = EPOLLIN | (out ? EPOLLOUT : 0), .data.ptr = c};
    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
    c->want_out = out;
}

static int conn_flush(int ep, lconn_t *c)
{
    while (c->woff < c->wlen) {
        ssize_t w = send(c->fd, c->wb + c->woff, c->wlen - c->woff, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN) {
                conn_events(ep, c, true);
                return 0;
            }
            return -errno;
        }
        c->woff += (size_t)w;
    }
    c->woff = c->wlen = 0;
    conn_events(ep, c, false);
    return 0;
}

static const tmpl_t *first_tmpl(enum workload k)
{
    return k == WL_HELLO ? &t_hello : k == WL_FORWARD ? &t_forward : &t_aug;
}

/* Describe an error reply (slow path: unpacked with msgpack-c). */
static void describe_error(load_t *L, const uint8_t *e, const uint8_t *end)
{
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    char text[200] = "(undecodable error)";
    if (msgpack_unpack_next(&up, (const char *)e, (size_t)(end - e), &off) == MSGPACK_UNPACK_SUCCESS) {
        const msgpack_object *code = pb_obj_get(&up.data, "code"), *msg = pb_obj_get(&up.data, "message");
        snprintf(text, sizeof text, "%.*s: %.*s", code && code->type == MSGPACK_OBJECT_STR ? (int)code->via.str.size : 0,
                 code && code->type == MSGPACK_OBJECT_STR ? code->via.str.ptr : "",
                 msg && msg->type == MSGPACK_OBJECT_STR ? (int)msg->via.str.size : 0,
                 msg && msg->type == MSGPACK_OBJECT_STR ? msg->via.str.ptr : "");
    }
    msgpack_unpacked_destroy(&up);
    load_fail(L, "error reply: %s", text);
}

static void on_reply(lthread_t *T, lconn_t *c, const uint8_t *p, const uint8_t *end, uint64_t now)
{
    load_t *L = T->L;
    uint32_t id;
    bool is_err;
    const uint8_t *e, *res;
    if (reply_head(p, end, &id, &is_err, &e, &res) != 0) {
        load_fail(L, "%s", "a message from the daemon is not a msgpack-RPC response");
        return;
    }
    int s = (int)(id & (MAX_WINDOW - 1));
    slot_t *sl = &c->slot[s];
    if (s >= L->window || !sl->busy || sl->seq != id >> SLOT_BITS) {
        load_fail(L, "%s", "a reply's msgid matches no request in flight");
        return;
    }
    sl->busy = false;
    if (is_err) {
        atomic_fetch_add(&L->errors, 1);
        describe_error(L, e, end);
        c->outstanding--;
        return;
    }
    bool running = now < L->t_stop;
    if (L->kind == WL_PAIR && sl->phase == 0) {
        uint64_t tape;
        const uint8_t *v = mp_map_find(res, end, "tape");
        if (v == NULL || mp_uint(v, end, &tape) == 0) {
            load_fail(L, "%s", "augmented_forward reply without a tape");
            c->outstanding--;
            return;
        }
        if (running) {
            issue(c, s, &t_rev, tape);
            sl->phase = 1;
        } else {
            c->outstanding--; /* the tape goes when the connection closes */
        }
        return;
    }
    if (now >= L->t_meas0 && now < L->t_meas1) {
        T->done++;
        lat_add(&T->lat, now - sl->t0);
    }
    if (running) {
        issue(c, s, first_tmpl(L->kind), 0);
        sl->t0 = now;
        sl->phase = 0;
    } else {
        c->outstanding--;
    }
}

/* Read what is there and answer each complete reply.  -1 on a dead or
 * broken connection. */
static int conn_read(lthread_t *T, lconn_t *c)
{
    if (c->rcap - c->rlen < 65536) {
        size_t nc = c->rcap ? c->rcap * 2 : 262144;
        uint8_t *nb = realloc(c->rb, nc);
        if (nb == NULL)
            die("out of memory for replies");
        c->rb = nb;
        c->rcap = nc;
    }
    ssize_t r = recv(c->fd, c->rb + c->rlen, c->rcap - c->rlen, MSG_DONTWAIT);
    if (r < 0)
        return errno == EAGAIN || errno == EINTR ? 0 : -1;
    if (r == 0)
        return -1;
    c->rlen += (size_t)r;
    uint64_t now = now_ns();
    size_t off = 0;
    for (;;) {
        ptrdiff_t k = mp_skip(c->rb + off, c->rb + c->rlen);
        if (k < 0)
            return -1;
        if (k == 0)
            break;
        on_reply(T, c, c->rb + off, c->rb + off + k, now);
        off += (size_t)k;
    }
    memmove(c->rb, c->rb + off, c->rlen - off);
    c->rlen -= off;
    return 0;
}

static void *load_thread(void *arg)
{
    lthread_t *T = arg;
    load_t *L = T->L;
    lconn_t *conns = calloc((size_t)T->count, sizeof *conns);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (conns == NULL || ep < 0)
        die("out of memory or epoll");
    for (int i = 0; i < T->count; i++) {
        lconn_t *c = &conns[i];
        c->fd = unix_connect(L->sock);
        if (c->fd < 0)
            die("cannot connect to the daemon");
        fcntl(c->fd, F_SETFL, fcntl(c->fd, F_GETFL) | O_NONBLOCK);
        c->slot = calloc((size_t)L->window, sizeof *c->slot);
        if (c->slot == NULL)
            die("out of memory");
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &ev);
    }
    pthread_barrier_wait(&L->bar); /* all connected */
    pthread_barrier_wait(&L->bar); /* times set */
    uint64_t t = now_ns();
    for (int i = 0; i < T->count; i++) {
        lconn_t *c = &conns[i];
        for (int s = 0; s < L->window; s++) {
            issue(c, s, first_tmpl(L->kind), 0);
            c->slot[s].t0 = t;
        }
        c->outstanding = L->window;
        if (conn_flush(ep, c) < 0)
            load_fail(L, "%s", "write to the daemon failed");
    }
    int left = T->count;
    struct epoll_event evs[64];
    while (left > 0 && !L->failed) {
        int n = epoll_wait(ep, evs, 64, 100);
        if (n < 0 && errno != EINTR)
            break;
        for (int i = 0; i < n; i++) {
            lconn_t *c = evs[i].data.ptr;
            if (c->outstanding == 0)
                continue;
            if (evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) {
                if (conn_read(T, c) < 0) {
                    load_fail(L, "%s", "the daemon closed a connection or sent bytes that are not msgpack");
                    break;
                }
            }
            if (conn_flush(ep, c) < 0) {
                load_fail(L, "%s", "write to the daemon failed");
                break;
            }
            if (c->outstanding == 0)
                left--;
        }
        if (now_ns() > L->t_stop + 20000000000ull)
            load_fail(L, "%s", "replies still missing 20 s after the end of the phase");
    }
    for (int i = 0; i < T->count; i++) {
        close(conns[i].fd);
        free(conns[i].rb);
        free(conns[i].wb);
        free(conns[i].slot);
    }
    free(conns);
    close(ep);
    return NULL;
}

/* Drive kind on sock with nconn connections of window requests each. */
static result_t run_load(enum workload kind, const char *sock, int nconn, int window, pid_t server)
{
    load_t L = {.kind = kind, .sock = sock, .nconn = nconn, .window = window};
    L.nthreads = opt_threads < nconn ? opt_threads : nconn;
    pthread_mutex_init(&L.lock, NULL);
    pthread_barrier_init(&L.bar, NULL, (unsigned)L.nthreads + 1);
    lthread_t *T = calloc((size_t)L.nthreads, sizeof *T);
    if (T == NULL)
        die("out of memory");
    for (int i = 0, first = 0; i < L.nthreads; i++) {
        T[i].L = &L;
        T[i].first = first;
        T[i].count = nconn / L.nthreads + (i < nconn % L.nthreads);
        first += T[i].count;
        if (pthread_create(&T[i].th, NULL, load_thread, &T[i]) != 0)
            die("pthread_create");
    }
    pthread_barrier_wait(&L.bar);
    uint64_t t0 = now_ns();
    L.t_meas0 = t0 + (uint64_t)(opt_warm_s * 1e9);
    L.t_meas1 = L.t_meas0 + (uint64_t)(opt_phase_s * 1e9);
    L.t_stop = L.t_meas1;
    pthread_barrier_wait(&L.bar);
    sleep_until(L.t_meas0);
    uint64_t d0 = pid_cpu_ns(server), c0 = process_cpu_ns();
    sleep_until(L.t_meas1);
    uint64_t d1 = pid_cpu_ns(server), c1 = process_cpu_ns();
    result_t r = {0};
    lat_t all = {0};
    for (int i = 0; i < L.nthreads; i++) {
        pthread_join(T[i].th, NULL);
        r.n += T[i].done;
        for (size_t k = 0; k < T[i].lat.n; k++)
            lat_add(&all, T[i].lat.v[k]);
        free(T[i].lat.v);
    }
    free(T);
    if (L.failed) {
        fprintf(stderr, "bench_socket: %s\n", L.why);
        exit(1);
    }
    r.secs = (double)(L.t_meas1 - L.t_meas0) / 1e9;
    r.rps = (double)r.n / r.secs;
    r.daemon_cpu_us = r.n ? (double)(d1 - d0) / 1e3 / (double)r.n : -1;
    r.client_cpu_us = r.n ? (double)(c1 - c0) / 1e3 / (double)r.n : -1;
    r.errors = L.errors;
    lat_finish(&all, &r);
    free(all.v);
    pthread_barrier_destroy(&L.bar);
    pthread_mutex_destroy(&L.lock);
    return r;
}

/* ---- one at a time through the client library --------------------------- */

static void lib_check(int rc, pb_reply_t *r, const char *what)
{
    if (rc < 0) {
        fprintf(stderr, "bench_socket: %s: %s\n", what, strerror(-rc));
        exit(1);
    }
    if (r->error) {
        fprintf(stderr, "bench_socket: %s: %s: %s\n", what, pb_reply_code(r), pb_reply_message(r));
        exit(1);
    }
}

/* kind WL_HELLO, WL_FORWARD or WL_PAIR, one request (or pair) at a time. */
static result_t run_lib_sync(enum workload kind, const char *sock, pid_t server)
{
    pb_client_t *c;
    int rc = pb_client_connect(sock, &c);
    if (rc < 0)
        die("pb_client_connect failed");
    uint64_t t0 = now_ns();
    uint64_t m0 = t0 + (uint64_t)(opt_warm_s * 1e9), m1 = m0 + (uint64_t)(opt_phase_s * 1e9);
    uint64_t d0 = 0, c0 = 0, d1 = 0, c1 = 0;
    bool in = false;
    lat_t lat = {0};
    result_t res = {0};
    for (;;) {
        uint64_t a = now_ns();
        if (!in && a >= m0) {
            in = true;
            d0 = pid_cpu_ns(server);
            c0 = process_cpu_ns();
            a = now_ns();
        }
        if (a >= m1)
            break;
        pb_reply_t r;
        msgpack_packer *pk = pb_client_begin(c, kind == WL_HELLO ? "hello" : kind == WL_FORWARD ? "forward"
                                                                                          : "augmented_forward");
        if (kind == WL_HELLO)
            msgpack_pack_map(pk, 0);
        else
            pack_seed_call(pk, kind == WL_PAIR);
        rc = pb_client_call(c, &r);
        lib_check(rc, &r, "request");
        if (kind == WL_PAIR) {
            uint64_t tape;
            if (pb_obj_uint(pb_obj_get(r.result, "tape"), &tape) < 0)
                die("augmented_forward reply without a tape");
            pb_reply_free(&r);
            pk = pb_client_begin(c, "reverse");
            pack_reverse(pk, tape, NULL);
            rc = pb_client_call(c, &r);
            lib_check(rc, &r, "reverse");
        }
        pb_reply_free(&r);
        uint64_t b = now_ns();
        if (in) {
            res.n++;
            lat_add(&lat, b - a);
        }
    }
    d1 = pid_cpu_ns(server);
    c1 = process_cpu_ns();
    pb_client_close(c);
    res.secs = (double)(m1 - m0) / 1e9;
    res.rps = (double)res.n / res.secs;
    res.daemon_cpu_us = res.n ? (double)(d1 - d0) / 1e3 / (double)res.n : -1;
    res.client_cpu_us = res.n ? (double)(c1 - c0) / 1e3 / (double)res.n : -1;
    lat_finish(&lat, &res);
    free(lat.v);
    return res;
}

/* ---- floors --------------------------------------------------------------- */

/* The bytes of a hello reply from the daemon, as a template whose msgid
 * (uint32 at id_off) the canned-reply server patches. */
static tmpl_t canned;

static void capture_hello_reply(const char *sock)
{
    int fd = unix_connect(sock);
    if (fd < 0)
        die("cannot connect to the daemon");
    uint8_t req[64];
    memcpy(req, t_hello.p, t_hello.n);
    be_put(req + t_hello.id_off, 1, 4);
    if (write(fd, req, t_hello.n) != (ssize_t)t_hello.n)
        die("write");
    uint8_t buf[4096];
    size_t len = 0;
    ptrdiff_t k = 0;
    while (k == 0) {
        ssize_t r = read(fd, buf + len, sizeof buf - len);
        if (r <= 0)
            die("no hello reply");
        len += (size_t)r;
        k = mp_skip(buf, buf + len);
        if (k < 0)
            die("hello reply is not msgpack");
    }
    close(fd);
    uint32_t id;
    bool is_err;
    const uint8_t *e, *res;
    if (reply_head(buf, buf + k, &id, &is_err, &e, &res) != 0 || is_err)
        die("hello failed");
    size_t rl = (size_t)(buf + k - res);
    canned.n = 8 + rl;
    canned.p = malloc(canned.n);
    if (canned.p == NULL)
        die("out of memory");
    canned.p[0] = 0x94;
    canned.p[1] = 0x01;
    canned.p[2] = 0xce;
    canned.id_off = 3;
    canned.p[7] = 0xc0;
    memcpy(canned.p + 8, res, rl);
}

typedef struct echo_arg {
    int fd;
} echo_arg_t;

/* The other end of the ping-pong: read one request, write one reply. */
static void *pingpong_echo(void *arg)
{
    int fd = ((echo_arg_t *)arg)->fd;
    uint8_t buf[4096];
    for (;;) {
        ssize_t r = read(fd, buf, sizeof buf);
        if (r <= 0)
            break;
        if (write(fd, canned.p, canned.n) != (ssize_t)canned.n)
            break;
    }
    return NULL;
}

static result_t run_pingpong(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        die("socketpair");
    echo_arg_t ea = {sv[1]};
    pthread_t th;
    if (pthread_create(&th, NULL, pingpong_echo, &ea) != 0)
        die("pthread_create");
    uint64_t m0 = now_ns() + (uint64_t)(opt_warm_s * 1e9), m1 = m0 + (uint64_t)(opt_phase_s * 1e9);
    lat_t lat = {0};
    result_t res = {0};
    uint8_t buf[4096];
    for (;;) {
        uint64_t a = now_ns();
        if (a >= m1)
            break;
        if (write(sv[0], t_hello.p, t_hello.n) != (ssize_t)t_hello.n)
            die("ping-pong write");
        size_t got = 0;
        while (got < canned.n) {
            ssize_t r = read(sv[0], buf, sizeof buf);
            if (r <= 0)
                die("ping-pong read");
            got += (size_t)r;
        }
        uint64_t b = now_ns();
        if (a >= m0) {
            res.n++;
            lat_add(&lat, b - a);
        }
    }
    shutdown(sv[0], SHUT_WR);
    pthread_join(th, NULL);
    close(sv[0]);
    close(sv[1]);
    res.secs = (double)(m1 - m0) / 1e9;
    res.rps = (double)res.n / res.secs;
    res.daemon_cpu_us = res.client_cpu_us = -1;
    lat_finish(&lat, &res);
    free(lat.v);
    return res;
}

/* A server that does nothing but frame requests and answer each with the
 * canned hello reply: the pipelined floor of this machine, kernel and client
 * harness.  One thread, epoll, as the daemon's loop. */
typedef struct canned_srv {
    int lfd;
    char path[128];
    atomic_int stop;
    pthread_t th;
} canned_srv_t;

typedef struct cconn {
    int fd;
    uint8_t *rb, *wb;
    size_t rlen, rcap, wlen, wcap;
} cconn_t;

static void *canned_main(void *arg)
{
    canned_srv_t *S = arg;
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, S->lfd, &ev);
    struct epoll_event evs[64];
    while (!S->stop) {
        int n = epoll_wait(ep, evs, 64, 50);
        for (int i = 0; i < n; i++) {
            cconn_t *c = evs[i].data.ptr;
            if (c == NULL) {
                int fd = accept4(S->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (fd < 0)
                    continue;
                c = calloc(1, sizeof *c);
                if (c == NULL)
                    die("out of memory");
                c->fd = fd;
                c->rcap = 262144;
                c->rb = malloc(c->rcap);
                c->wcap = 262144;
                c->wb = malloc(c->wcap);
                if (c->rb == NULL || c->wb == NULL)
                    die("out of memory");
                struct epoll_event e2 = {.events = EPOLLIN, .data.ptr = c};
                epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e2);
                continue;
            }
            ssize_t r = recv(c->fd, c->rb + c->rlen, c->rcap - c->rlen, MSG_DONTWAIT);
            if (r <= 0) {
                if (r < 0 && errno == EAGAIN)
                    continue;
                epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
                close(c->fd);
                free(c->rb);
                free(c->wb);
                free(c);
                continue;
            }
            c->rlen += (size_t)r;
            size_t off = 0;
            for (;;) {
                ptrdiff_t k = mp_skip(c->rb + off, c->rb + c->rlen);
                if (k <= 0)
                    break;
                uint64_t id = 0;
                if (k > 3 && c->rb[off] == 0x94 && c->rb[off + 1] == 0x00)
                    mp_uint(c->rb + off + 2, c->rb + off + k, &id);
                if (c->wcap - c->wlen < canned.n) {
                    c->wcap *= 2;
                    c->wb = realloc(c->wb, c->wcap);
                    if (c->wb == NULL)
                        die("out of memory");
                }
                memcpy(c->wb + c->wlen, canned.p, canned.n);
                be_put(c->wb + c->wlen + canned.id_off, id, 4);
                c->wlen += canned.n;
                off += (size_t)k;
            }
            memmove(c->rb, c->rb + off, c->rlen - off);
            c->rlen -= off;
            /* The replies are small and the client reads them: a blocking
             * write would only stall on a full socket buffer. */
            size_t w = 0;
            while (w < c->wlen) {
                ssize_t k = send(c->fd, c->wb + w, c->wlen - w, MSG_NOSIGNAL);
                if (k < 0 && errno == EAGAIN) {
                    struct pollfd pfd = {.fd = c->fd, .events = POLLOUT};
                    poll(&pfd, 1, 100);
                    continue;
                }
                if (k <= 0)
                    break;
                w += (size_t)k;
            }
            c->wlen = 0;
        }
    }
    close(ep);
    return NULL;
}

static void canned_start(canned_srv_t *S, const char *dir)
{
    snprintf(S->path, sizeof S->path, "%s/canned.sock", dir);
    S->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(S->path) >= sizeof a.sun_path)
        die("socket path too long");
    memcpy(a.sun_path, S->path, strlen(S->path) + 1);
    if (S->lfd < 0 || bind(S->lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(S->lfd, 1024) != 0)
        die("cannot listen for the canned-reply server");
    S->stop = 0;
    if (pthread_create(&S->th, NULL, canned_main, S) != 0)
        die("pthread_create");
}

static void canned_stop(canned_srv_t *S)
{
    S->stop = 1;
    pthread_join(S->th, NULL);
    close(S->lfd);
    unlink(S->path);
}

/* ---- report --------------------------------------------------------------- */

static void row(const char *name, int nconn, int window, const result_t *r, const char *unit, const char *figure)
{
    char cw[16], dc[16], cc[16];
    snprintf(cw, sizeof cw, "%dx%d", nconn, window);
    if (r->daemon_cpu_us >= 0)
        snprintf(dc, sizeof dc, "%.2f", r->daemon_cpu_us);
    else
        snprintf(dc, sizeof dc, "-");
    if (r->client_cpu_us >= 0)
        snprintf(cc, sizeof cc, "%.2f", r->client_cpu_us);
    else
        snprintf(cc, sizeof cc, "-");
    printf("%-40s %7s %10.0f %-6s %9.1f %9.1f %8s %8s  %s\n", name, cw, r->rps, unit, r->p50_us, r->p99_us, dc, cc,
           figure);
    fflush(stdout);
}

static void usage(void)
{
    fprintf(stderr, "usage: bench_socket [--quick] [--seconds S] [--threads N] [--conns N] [--window N] "
                    "[--only SUBSTRING] [PULLBACKD_BIN]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    const char *bin = getenv("PULLBACKD_BIN");
#ifdef PB_BENCH_DAEMON
    if (bin == NULL || *bin == 0)
        bin = PB_BENCH_DAEMON; /* the daemon of the meson build */
#endif
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--quick") == 0) {
            opt_phase_s = 0.25;
            opt_warm_s = 0.05;
        } else if (strcmp(a, "--seconds") == 0 && i + 1 < argc) {
            opt_phase_s = atof(argv[++i]);
        } else if (strcmp(a, "--threads") == 0 && i + 1 < argc) {
            opt_threads = atoi(argv[++i]);
        } else if (strcmp(a, "--conns") == 0 && i + 1 < argc) {
            opt_conns = atoi(argv[++i]);
        } else if (strcmp(a, "--only") == 0 && i + 1 < argc) {
            opt_only = argv[++i];
        } else if (strcmp(a, "--window") == 0 && i + 1 < argc) {
            opt_window = atoi(argv[++i]);
        } else if (a[0] == '-') {
            usage();
        } else {
            bin = a;
        }
    }
    if (bin == NULL || opt_phase_s <= 0 || opt_threads < 1 || opt_conns < 1 || opt_window < 1 ||
        opt_window > MAX_WINDOW)
        usage();
    signal(SIGPIPE, SIG_IGN);
    make_templates();

    daemon_t d = {0};
    int rc = daemon_start(&d, bin, NULL);
    if (rc < 0) {
        fprintf(stderr, "bench_socket: cannot start %s: %s\n", bin, strerror(-rc));
        daemon_stop(&d);
        return 1;
    }
    capture_hello_reply(d.sock);

    printf("bench_socket: %s (pid %d), %ld CPUs, phases of %.2f s after %.2f s of warm-up\n", bin, (int)d.pid,
           sysconf(_SC_NPROCESSORS_ONLN), opt_phase_s, opt_warm_s);
    printf("clients: %d epoll thread(s) of this process, on the same CPUs as the daemon; pipelined rows "
           "build requests by hand (see the header comment)\n",
           opt_threads);
    printf("request/reply bytes: hello %zu/%zu, seed forward %zu, augmented_forward %zu, reverse %zu\n\n",
           t_hello.n, canned.n, t_forward.n, t_aug.n, t_rev.n);
    printf("%-40s %7s %10s %-6s %9s %9s %8s %8s  %s\n", "case", "conns", "rate", "", "p50 us", "p99 us",
           "dCPU/us", "cCPU/us", "figure");

    char fig[160];
    int C = opt_conns, W = opt_window;
    result_t floor1 = {0}, h_lib = {0}, h_raw = {0}, h_floor = {0}, h_p1 = {0}, h_pipe = {0};
    result_t f_lib = {0}, f_raw = {0}, f_pipe = {0}, p_lib = {0}, p_pipe = {0};
    const char *name;

    if (want(name = "floor: socketpair ping-pong (2 threads)")) {
        floor1 = run_pingpong();
        row(name, 1, 1, &floor1, "rt/s", "(baseline)");
    }
    if (want(name = "hello, client library, sync")) {
        h_lib = run_lib_sync(WL_HELLO, d.sock, d.pid);
        snprintf(fig, sizeof fig, "p50 / floor p50 = %.2f", ratio(h_lib.p50_us, floor1.p50_us));
        row(name, 1, 1, &h_lib, "req/s", fig);
    }
    if (want(name = "hello, raw bytes, sync")) {
        h_raw = run_load(WL_HELLO, d.sock, 1, 1, d.pid);
        snprintf(fig, sizeof fig, "p50 / floor p50 = %.2f", ratio(h_raw.p50_us, floor1.p50_us));
        row(name, 1, 1, &h_raw, "req/s", fig);
    }
    if (want(name = "floor: canned-reply server, pipelined")) {
        canned_srv_t cs;
        canned_start(&cs, d.dir);
        h_floor = run_load(WL_HELLO, cs.path, C, W, getpid());
        canned_stop(&cs);
        h_floor.daemon_cpu_us = -1; /* the server is a thread of this process */
        row(name, C, W, &h_floor, "req/s", "(baseline)");
    }
    if (want(name = "hello, pipelined, 1 connection")) {
        h_p1 = run_load(WL_HELLO, d.sock, 1, W, d.pid);
        row(name, 1, W, &h_p1, "req/s", "");
    }
    if (want(name = "hello, pipelined, all connections")) {
        h_pipe = run_load(WL_HELLO, d.sock, C, W, d.pid);
        snprintf(fig, sizeof fig, "%.2fx target %.0f/s; %.2fx floor", h_pipe.rps / TARGET_HELLO, TARGET_HELLO,
                 ratio(h_pipe.rps, h_floor.rps));
        row(name, C, W, &h_pipe, "req/s", fig);
    }
    if (want(name = "seed forward, client library, sync")) {
        f_lib = run_lib_sync(WL_FORWARD, d.sock, d.pid);
        snprintf(fig, sizeof fig, "p50 / hello p50 = %.2f", ratio(f_lib.p50_us, h_lib.p50_us));
        row(name, 1, 1, &f_lib, "req/s", fig);
    }
    if (want(name = "seed forward, raw bytes, sync")) {
        f_raw = run_load(WL_FORWARD, d.sock, 1, 1, d.pid);
        snprintf(fig, sizeof fig, "p50 / hello p50 = %.2f", ratio(f_raw.p50_us, h_raw.p50_us));
        row(name, 1, 1, &f_raw, "req/s", fig);
    }
    if (want(name = "seed forward, pipelined")) {
        f_pipe = run_load(WL_FORWARD, d.sock, C, W, d.pid);
        snprintf(fig, sizeof fig, "%.2fx target %.0f/s; %.2fx pipelined hello", f_pipe.rps / TARGET_FORWARD,
                 TARGET_FORWARD, ratio(f_pipe.rps, h_pipe.rps));
        row(name, C, W, &f_pipe, "req/s", fig);
    }
    if (want(name = "seed aug+reverse pair, client lib, sync")) {
        p_lib = run_lib_sync(WL_PAIR, d.sock, d.pid);
        snprintf(fig, sizeof fig, "pair p50 / forward p50 = %.2f", ratio(p_lib.p50_us, f_lib.p50_us));
        row(name, 1, 1, &p_lib, "pair/s", fig);
    }
    if (want(name = "seed aug+reverse pairs, pipelined chains")) {
        p_pipe = run_load(WL_PAIR, d.sock, C, W, d.pid);
        snprintf(fig, sizeof fig, "%.0f requests/s; %.2fx pipelined forward requests", 2 * p_pipe.rps,
                 ratio(2 * p_pipe.rps, f_pipe.rps));
        row(name, C, W, &p_pipe, "pair/s", fig);
    }

    printf("\nrate: completed in the measured window; p50/p99: request written -> reply read (a pair: forward "
           "written -> reverse reply read);\ndCPU/cCPU: CPU time of the daemon / of this process over the window, "
           "per request (pair); the two share %ld CPUs.\n",
           sysconf(_SC_NPROCESSORS_ONLN));
    if (want("hello, pipelined, all connections") && want("seed forward, pipelined"))
        printf("targets: hello %s (%.0f/s vs %.0f/s), seed forward %s (%.0f/s vs %.0f/s)\n",
               h_pipe.rps >= TARGET_HELLO ? "met" : "MISSED", h_pipe.rps, TARGET_HELLO,
               f_pipe.rps >= TARGET_FORWARD ? "met" : "MISSED", f_pipe.rps, TARGET_FORWARD);
    daemon_stop(&d);
    return 0;
}
