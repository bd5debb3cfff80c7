/* load: many connections pipelining a mix of requests against a private
 * daemon, every reply checked.
 *
 * Each of --conns threads opens its own connection and keeps --window
 * requests in flight: forward; augmented_forward then reverse (consuming
 * the tape); augmented_forward then release; on the cases of
 * load_common.h (fused_dense and tensoradd, f32 and f64, small shapes).
 * Every reply must carry the msgid of a request still waiting on that
 * connection and the content the reference computed for that request
 * (outputs, the three or two gradients, released: true).  Latency is from
 * the send of a request to the arrival of its reply, pipelining included.
 *
 * Modes (--mode):
 *   mix    a warm-up of --warmup seconds (two rounds of clients), then
 *          --seconds of load; after each round the clients leave and the
 *          daemon must be quiet (no tape, nothing in flight, only the
 *          monitor's connection).  Resident memory (VmRSS) is measured
 *          after the warm-up ("before": the heap has reached its working
 *          shape, which is what a long-running daemon sees) and after the
 *          load ("after"), both with the clients gone; after must not
 *          exceed before by more than 10 %.  Not enforced under
 *          AddressSanitizer, whose quarantine holds freed memory.
 *   limit  the daemon runs with --max-tape-bytes LIMIT (default 32K): some
 *          augmented_forward calls must get resource_exhausted naming
 *          max_tape_bytes, every other request must still succeed, a
 *          monitor connection polling stats must never see tape_bytes over
 *          the limit, and the daemon must be up and quiet afterwards.
 *   drain  after --seconds of load, SIGTERM while the clients keep sending:
 *          every request whose send completed before the signal must be
 *          answered normally; later ones answered normally or refused with
 *          shutting_down, none cut off when the daemon closes (once it has
 *          shut a socket for reading a send fails, and a request whose send
 *          failed was not sent); the daemon must exit 0.  Prints the time
 *          from the signal to its exit.
 * Every mode ends with SIGTERM and requires exit status 0 (under ASan that
 * includes the leak check).  Exit 0 when every check passed, 1 otherwise.
 *
 * Usage: load [--mode mix|limit|drain] [--conns N] [--window W]
 *             [--seconds S] [--warmup S] [--limit BYTES] PULLBACKD */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "load_common.h"

enum { MODE_MIX, MODE_LIMIT, MODE_DRAIN };
enum { JOB_FORWARD, JOB_AUG_REVERSE, JOB_AUG_RELEASE };
enum { SLOT_FREE, SLOT_FORWARD, SLOT_AUG, SLOT_REVERSE, SLOT_RELEASE };

#define MAX_WINDOW 64

static struct {
    int mode;
    int conns, window;
    double seconds, warmup;
    size_t limit;
    const char *bin;
    daemon_t d;
} cfg = {.mode = MODE_MIX, .conns = 64, .window = 8, .seconds = 2, .warmup = 1, .limit = 32 << 10};

/* Run phase: clients send new jobs while it is RUN; at STOP they finish
 * what they started (a tape they hold is still reversed or released) and
 * leave. */
static atomic_int phase;
enum { PHASE_RUN, PHASE_STOP };
/* drain mode: CLOCK_MONOTONIC ns taken just before kill(SIGTERM), 0 before. */
static _Atomic uint64_t sig_ns;

typedef struct slot {
    int state;
    uint32_t msgid;
    int kase;
    int job;
    uint64_t tape;
    uint64_t t_send;      /* before the send */
    bool before_signal;   /* drain: its send completed before SIGTERM */
} slot_t;

typedef struct client {
    pthread_t th;
    int id;
    unsigned seed;
    pb_client_t *c;
    slot_t slot[MAX_WINDOW];
    int busy;
    /* results */
    uint32_t *lat_us;
    size_t nlat, caplat;
    uint64_t sent, answered, exhausted, refused_late, cut_off_late, answered_in_drain;
} client_t;

static void lat_add(client_t *cl, uint64_t ns)
{
    if (cl->nlat == cl->caplat) {
        size_t ncap = cl->caplat ? cl->caplat * 2 : 4096;
        uint32_t *p = realloc(cl->lat_us, ncap * sizeof *p);
        if (p == NULL)
            return;
        cl->lat_us = p;
        cl->caplat = ncap;
    }
    uint64_t us = ns / 1000;
    cl->lat_us[cl->nlat++] = us > UINT32_MAX ? UINT32_MAX : (uint32_t)us;
}

static unsigned next_rand(client_t *cl)
{
    cl->seed = cl->seed * 1103515245u + 12345u;
    return (cl->seed >> 8) & 0xffffff;
}

/* Send what was begun for slot s; false when the connection is gone. */
static bool send_slot(client_t *cl, slot_t *s, int state)
{
    s->t_send = now_ns();
    int rc = pb_client_send(cl->c, &s->msgid);
    if (rc < 0) {
        if (cfg.mode != MODE_DRAIN || atomic_load(&sig_ns) == 0)
            lc_fail("client %d: send: %s", cl->id, strerror(-rc));
        s->state = SLOT_FREE;
        return false;
    }
    uint64_t done = now_ns(), sig = atomic_load(&sig_ns);
    s->before_signal = sig == 0 || done < sig;
    s->state = state;
    cl->busy++;
    cl->sent++;
    return true;
}

static bool start_job(client_t *cl, slot_t *s)
{
    unsigned r = next_rand(cl);
    s->kase = (int)(r % LC_NCASES);
    /* 30 % forward, 50 % augmented_forward + reverse, 20 % + release. */
    unsigned p = (r >> 4) % 10;
    s->job = p < 3 ? JOB_FORWARD : p < 8 ? JOB_AUG_REVERSE : JOB_AUG_RELEASE;
    lc_begin_call(cl->c, &lc_cases[s->kase], s->job != JOB_FORWARD);
    return send_slot(cl, s, s->job == JOB_FORWARD ? SLOT_FORWARD : SLOT_AUG);
}

static const char *const state_name[] = {"free", "forward", "augmented_forward", "reverse", "release"};

/* A reply for slot s has come: check it, then free the slot or send the
 * job's next step.  False when the connection is gone. */
static bool on_reply(client_t *cl, slot_t *s, pb_reply_t *r)
{
    const lc_case_t *k = &lc_cases[s->kase];
    char why[256] = "";
    bool ok = true, next = false;
    uint64_t now = now_ns(), sig = atomic_load(&sig_ns);
    lat_add(cl, now - s->t_send);
    cl->busy--;
    cl->answered++;
    if (s->before_signal && sig != 0)
        cl->answered_in_drain++;
    int state = s->state;
    s->state = SLOT_FREE;

    if (r->error != NULL) {
        const char *code = pb_reply_code(r);
        if (cfg.mode == MODE_LIMIT && state == SLOT_AUG && strcmp(code, "resource_exhausted") == 0) {
            if (pb_obj_strcmp(pb_obj_get(r->error, "limit"), "max_tape_bytes") != 0)
                lc_fail("client %d: resource_exhausted without limit max_tape_bytes: %s", cl->id,
                        pb_reply_message(r));
            cl->exhausted++;
            return true;
        }
        if (cfg.mode == MODE_DRAIN && !s->before_signal && strcmp(code, "shutting_down") == 0) {
            cl->refused_late++;
            return true;
        }
        lc_fail("client %d: %s of case %d (msgid %u%s): %s: %s", cl->id, state_name[state], s->kase, s->msgid,
                s->before_signal && sig ? ", sent before SIGTERM" : "", code, pb_reply_message(r));
        return true;
    }
    switch (state) {
    case SLOT_FORWARD:
        ok = lc_outputs_ok(k, r->result, why, sizeof why);
        break;
    case SLOT_AUG: {
        uint64_t tb;
        ok = lc_outputs_ok(k, r->result, why, sizeof why);
        if (ok && (pb_obj_uint(pb_obj_get(r->result, "tape"), &s->tape) < 0 ||
                   pb_obj_uint(pb_obj_get(r->result, "tape_bytes"), &tb) < 0)) {
            ok = false;
            snprintf(why, sizeof why, "no uint tape and tape_bytes");
        }
        next = ok;
        break;
    }
    case SLOT_REVERSE:
        ok = lc_gradients_ok(k, r->result, why, sizeof why);
        break;
    case SLOT_RELEASE: {
        bool rel = false;
        ok = pb_obj_bool(pb_obj_get(r->result, "released"), &rel) == 0 && rel;
        if (!ok)
            snprintf(why, sizeof why, "released is not true");
        break;
    }
    }
    if (!ok) {
        lc_fail("client %d: %s of case %d (%s %s, msgid %u): %s", cl->id, state_name[state], s->kase, k->op, k->dtype,
                s->msgid, why);
        return true;
    }
    if (!next)
        return true;
    if (s->job == JOB_AUG_REVERSE)
        lc_begin_reverse(cl->c, k, s->tape);
    else
        lc_begin_release(cl->c, s->tape);
    return send_slot(cl, s, s->job == JOB_AUG_REVERSE ? SLOT_REVERSE : SLOT_RELEASE);
}

static slot_t *find_slot(client_t *cl, uint32_t msgid)
{
    for (int i = 0; i < cfg.window; i++)
        if (cl->slot[i].state != SLOT_FREE && cl->slot[i].msgid == msgid)
            return &cl->slot[i];
    return NULL;
}

/* The connection is gone (drain mode: the daemon finished and closed it). */
static void cut_off(client_t *cl, int rc)
{
    uint64_t sig = atomic_load(&sig_ns);
    for (int i = 0; i < cfg.window; i++) {
        slot_t *s = &cl->slot[i];
        if (s->state == SLOT_FREE)
            continue;
        if (cfg.mode == MODE_DRAIN && sig != 0 && !s->before_signal)
            cl->cut_off_late++;
        lc_fail("client %d: %s of case %d (msgid %u, sent %s) never answered: %s", cl->id, state_name[s->state],
                s->kase, s->msgid, !sig ? "with no signal" : s->before_signal ? "before SIGTERM" : "after SIGTERM",
                strerror(-rc));
        s->state = SLOT_FREE;
    }
    cl->busy = 0;
}

static void *client_main(void *arg)
{
    client_t *cl = arg;
    uint64_t last_reply = now_ns();
    /* After a failed send the replies the daemon wrote before closing are
     * still to be read: stop sending, keep receiving until the close. */
    bool dead = false;
    for (;;) {
        bool run = !dead && atomic_load(&phase) == PHASE_RUN;
        for (int i = 0; run && i < cfg.window; i++)
            if (cl->slot[i].state == SLOT_FREE && !start_job(cl, &cl->slot[i])) {
                dead = true;
                break;
            }
        if (cl->busy == 0) {
            if (dead || atomic_load(&phase) != PHASE_RUN)
                return NULL;
            continue;
        }
        pb_reply_t r;
        int rc = pb_client_recv_timeout(cl->c, &r, 100);
        if (rc == -ETIMEDOUT) {
            if (now_ns() - last_reply > 20000000000ull) {
                lc_fail("client %d: no reply for 20 s with %d requests in flight", cl->id, cl->busy);
                cut_off(cl, rc);
                return NULL;
            }
            continue;
        }
        if (rc < 0) {
            cut_off(cl, rc);
            return NULL;
        }
        last_reply = now_ns();
        slot_t *s = find_slot(cl, r.msgid);
        if (s == NULL) {
            lc_fail("client %d: a reply with msgid %u, which no request in flight has", cl->id, r.msgid);
            pb_reply_free(&r);
            continue;
        }
        if (!on_reply(cl, s, &r))
            dead = true;
        pb_reply_free(&r);
    }
}

/* ---- runs -------------------------------------------------------------------- */

typedef struct totals {
    uint64_t sent, answered, exhausted, refused_late, cut_off_late, answered_in_drain;
    uint32_t *lat;
    size_t nlat;
} totals_t;

static client_t *clients_start(unsigned seed)
{
    client_t *cls = calloc((size_t)cfg.conns, sizeof *cls);
    if (cls == NULL)
        return NULL;
    atomic_store(&phase, PHASE_RUN);
    for (int i = 0; i < cfg.conns; i++) {
        cls[i].id = i;
        cls[i].seed = seed * 7919u + (unsigned)i * 104729u + 1;
        int rc = pb_client_connect(cfg.d.sock, &cls[i].c);
        if (rc < 0) {
            lc_fail("connect %d: %s", i, strerror(-rc));
            cls[i].c = NULL;
        }
    }
    for (int i = 0; i < cfg.conns; i++)
        if (cls[i].c != NULL && pthread_create(&cls[i].th, NULL, client_main, &cls[i]) != 0) {
            lc_fail("pthread_create %d", i);
            pb_client_close(cls[i].c);
            cls[i].c = NULL;
        }
    return cls;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Stop the clients (phase STOP), join them, close their connections, sum
 * their results into t (latencies sorted). */
static void clients_finish(client_t *cls, totals_t *t)
{
    atomic_store(&phase, PHASE_STOP);
    memset(t, 0, sizeof *t);
    for (int i = 0; i < cfg.conns; i++) {
        client_t *cl = &cls[i];
        if (cl->c == NULL)
            continue;
        pthread_join(cl->th, NULL);
        pb_client_close(cl->c);
        t->sent += cl->sent;
        t->answered += cl->answered;
        t->exhausted += cl->exhausted;
        t->refused_late += cl->refused_late;
        t->cut_off_late += cl->cut_off_late;
        t->answered_in_drain += cl->answered_in_drain;
        t->nlat += cl->nlat;
    }
    t->lat = malloc((t->nlat ? t->nlat : 1) * sizeof *t->lat);
    size_t at = 0;
    for (int i = 0; i < cfg.conns; i++) {
        if (t->lat != NULL && cls[i].nlat)
            memcpy(t->lat + at, cls[i].lat_us, cls[i].nlat * sizeof *t->lat);
        at += cls[i].nlat;
        free(cls[i].lat_us);
    }
    if (t->lat != NULL)
        qsort(t->lat, t->nlat, sizeof *t->lat, cmp_u32);
    else
        t->nlat = 0;
    free(cls);
}

static double pct_ms(const totals_t *t, double p)
{
    if (t->nlat == 0)
        return 0;
    size_t i = (size_t)(p * (double)(t->nlat - 1) + 0.5);
    return t->lat[i] / 1000.0;
}

static void print_totals(const char *name, const totals_t *t, double secs)
{
    printf("%-8s %d connections x window %d, %.1f s: %llu requests answered (%.0f/s), latency p50 %.3f ms, "
           "p99 %.3f ms, max %.3f ms\n",
           name, cfg.conns, cfg.window, secs, (unsigned long long)t->answered, (double)t->answered / secs,
           pct_ms(t, 0.5), pct_ms(t, 0.99), pct_ms(t, 1.0));
}

static void sleep_s(double s)
{
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* Load for secs with a monitor on mon (may be NULL) polling stats: in
 * limit mode every poll checks tape_bytes against the limit. */
static void run_load(pb_client_t *mon, double secs, unsigned seed, totals_t *t, uint64_t *max_tape_bytes)
{
    client_t *cls = clients_start(seed);
    if (cls == NULL) {
        lc_fail("out of memory");
        return;
    }
    uint64_t end = now_ns() + (uint64_t)(secs * 1e9);
    while (now_ns() < end) {
        if (mon != NULL) {
            lc_stats_t st;
            if (lc_get_stats(mon, &st) < 0) {
                lc_fail("stats failed during the load");
                break;
            }
            if (st.tape_bytes > *max_tape_bytes)
                *max_tape_bytes = st.tape_bytes;
            if (cfg.mode == MODE_LIMIT && st.tape_bytes > cfg.limit)
                lc_fail("stats: tape_bytes %llu over the limit %zu", (unsigned long long)st.tape_bytes, cfg.limit);
        }
        usleep(2000);
    }
    clients_finish(cls, t);
}

static int run_mix(void)
{
    pb_client_t *mon = NULL;
    if (pb_client_connect(cfg.d.sock, &mon) < 0) {
        lc_fail("monitor connect");
        return 1;
    }
    totals_t warm, main_run;
    lc_stats_t st, st0;
    uint64_t max_tb = 0;
    /* Two rounds of clients: glibc raises its mmap threshold when the first
     * round's 128 KiB read buffers are freed, so the second round's come
     * from the heap, which keeps them (a one-time step of about 1.5 MiB
     * with 64 connections, not growth).  Only after that has the heap its
     * working shape. */
    totals_t warm2;
    run_load(mon, cfg.warmup / 2, 1, &warm, &max_tb);
    if (lc_wait_quiet(mon, 1, 10000, &st) < 0)
        lc_fail("after the first warm-up round: %llu tapes, %llu in flight, %llu connections; expected 0, 0, 1",
                (unsigned long long)st.tapes, (unsigned long long)st.requests_in_flight,
                (unsigned long long)st.connections);
    run_load(mon, cfg.warmup / 2, 5, &warm2, &max_tb);
    warm.answered += warm2.answered;
    free(warm2.lat);
    if (lc_wait_quiet(mon, 1, 10000, &st) < 0)
        lc_fail("after the warm-up: %llu tapes, %llu in flight, %llu connections; expected 0, 0, 1",
                (unsigned long long)st.tapes, (unsigned long long)st.requests_in_flight,
                (unsigned long long)st.connections);
    usleep(200000);
    uint64_t rss_before = lc_rss(cfg.d.pid);
    lc_get_stats(mon, &st0);
    run_load(mon, cfg.seconds, 2, &main_run, &max_tb);
    if (lc_wait_quiet(mon, 1, 10000, &st) < 0)
        lc_fail("after the load: %llu tapes, %llu in flight, %llu connections; expected 0, 0, 1",
                (unsigned long long)st.tapes, (unsigned long long)st.requests_in_flight,
                (unsigned long long)st.connections);
    usleep(200000);
    uint64_t rss_after = lc_rss(cfg.d.pid);
    printf("warm-up  two rounds of %d connections, %.1f s in all: %llu requests answered\n", cfg.conns, cfg.warmup,
           (unsigned long long)warm.answered);
    print_totals("load", &main_run, cfg.seconds);
    /* The daemon counts one stats call of the monitor per poll as well. */
    printf("daemon   requests_served went from %llu to %llu during the load; tape_bytes peaked at %llu (polled); "
           "at the end: %llu tapes, %llu connections (the monitor)\n",
           (unsigned long long)st0.requests_served, (unsigned long long)st.requests_served,
           (unsigned long long)max_tb, (unsigned long long)st.tapes, (unsigned long long)st.connections);
    double growth = rss_before ? (double)rss_after / (double)rss_before - 1 : 0;
    printf("rss      before %.1f MiB (after the warm-up, clients gone), after %.1f MiB (clients gone): %+.1f %%%s\n",
           rss_before / 1048576.0, rss_after / 1048576.0, 100 * growth,
           LC_ASAN ? " (not checked under a sanitizer)" : "");
    if (main_run.answered != main_run.sent)
        lc_fail("%llu requests sent, %llu answered", (unsigned long long)main_run.sent,
                (unsigned long long)main_run.answered);
    if (main_run.answered == 0)
        lc_fail("no request was answered");
    if (rss_before == 0 || rss_after == 0)
        lc_fail("cannot read the daemon's VmRSS");
    else if (!LC_ASAN && growth > 0.10)
        lc_fail("the daemon's resident memory grew by %.1f %% (more than 10 %%)", 100 * growth);
    free(warm.lat);
    free(main_run.lat);
    pb_client_close(mon);
    return 0;
}

static int run_limit(void)
{
    pb_client_t *mon = NULL;
    if (pb_client_connect(cfg.d.sock, &mon) < 0) {
        lc_fail("monitor connect");
        return 1;
    }
    totals_t t;
    lc_stats_t st;
    uint64_t max_tb = 0;
    run_load(mon, cfg.seconds, 3, &t, &max_tb);
    if (lc_wait_quiet(mon, 1, 10000, &st) < 0)
        lc_fail("after the load: %llu tapes, %llu in flight, %llu connections; expected 0, 0, 1",
                (unsigned long long)st.tapes, (unsigned long long)st.requests_in_flight,
                (unsigned long long)st.connections);
    print_totals("limit", &t, cfg.seconds);
    printf("limit    --max-tape-bytes %zu: %llu augmented_forward calls got resource_exhausted; tape_bytes peaked "
           "at %llu (polled every ~2 ms)\n",
           cfg.limit, (unsigned long long)t.exhausted, (unsigned long long)max_tb);
    if (t.exhausted == 0)
        lc_fail("no request hit the tape limit: the test did not test it");
    if (t.answered != t.sent)
        lc_fail("%llu requests sent, %llu answered", (unsigned long long)t.sent, (unsigned long long)t.answered);
    /* Still up and serving. */
    pb_reply_t r;
    msgpack_pack_map(pb_client_begin(mon, "hello"), 0);
    if (kill(cfg.d.pid, 0) != 0 || pb_client_call(mon, &r) < 0 || r.error != NULL)
        lc_fail("the daemon does not answer hello after the load");
    else
        pb_reply_free(&r);
    free(t.lat);
    pb_client_close(mon);
    return 0;
}

static int run_drain(void)
{
    client_t *cls = clients_start(4);
    if (cls == NULL) {
        lc_fail("out of memory");
        return 1;
    }
    sleep_s(cfg.seconds);
    uint64_t t_sig = now_ns();
    atomic_store(&sig_ns, t_sig);
    kill(cfg.d.pid, SIGTERM);
    int st = 0;
    pid_t w;
    uint64_t deadline = t_sig + 30000000000ull;
    while ((w = waitpid(cfg.d.pid, &st, WNOHANG)) == 0 && now_ns() < deadline)
        usleep(200);
    uint64_t t_exit = now_ns();
    if (w != cfg.d.pid) {
        lc_fail("the daemon did not exit within 30 s of SIGTERM");
        kill(cfg.d.pid, SIGKILL);
        waitpid(cfg.d.pid, &st, 0);
    } else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        lc_fail("the daemon exited with %s %d after SIGTERM", WIFEXITED(st) ? "status" : "signal",
                WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
    }
    cfg.d.pid = 0;
    totals_t t;
    clients_finish(cls, &t);
    print_totals("drain", &t, cfg.seconds);
    printf("drain    SIGTERM under load: exit after %.1f ms; %llu requests sent before the signal were answered "
           "after it (all of them, or a FAIL above); of those sent later %llu were refused with shutting_down "
           "and %llu cut off by the close (must be 0)\n",
           (t_exit - t_sig) / 1e6, (unsigned long long)t.answered_in_drain, (unsigned long long)t.refused_late,
           (unsigned long long)t.cut_off_late);
    free(t.lat);
    return 0;
}

static void usage(void)
{
    fprintf(stderr, "usage: load [--mode mix|limit|drain] [--conns N] [--window W] [--seconds S] [--warmup S]\n"
                    "            [--limit BYTES] PULLBACKD\n");
    exit(2);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--mode") == 0 && v) {
            cfg.mode = !strcmp(v, "mix") ? MODE_MIX : !strcmp(v, "limit") ? MODE_LIMIT
                     : !strcmp(v, "drain") ? MODE_DRAIN : -1;
            if (cfg.mode < 0)
                usage();
            i++;
        } else if (strcmp(a, "--conns") == 0 && v) {
            cfg.conns = atoi(v), i++;
        } else if (strcmp(a, "--window") == 0 && v) {
            cfg.window = atoi(v), i++;
        } else if (strcmp(a, "--seconds") == 0 && v) {
            cfg.seconds = atof(v), i++;
        } else if (strcmp(a, "--warmup") == 0 && v) {
            cfg.warmup = atof(v), i++;
        } else if (strcmp(a, "--limit") == 0 && v) {
            cfg.limit = (size_t)strtoull(v, NULL, 10), i++;
        } else if (a[0] == '-' || cfg.bin != NULL) {
            usage();
        } else {
            cfg.bin = a;
        }
    }
    if (cfg.bin == NULL || cfg.conns < 1 || cfg.conns > 1024 || cfg.window < 1 || cfg.window > MAX_WINDOW ||
        cfg.seconds <= 0 || cfg.warmup < 0 || cfg.limit == 0)
        usage();
    signal(SIGPIPE, SIG_IGN);
    lc_cases_init();

    char limit[32];
    snprintf(limit, sizeof limit, "%zu", cfg.limit);
    const char *const limit_args[] = {"--max-tape-bytes", limit, NULL};
    int rc = daemon_start(&cfg.d, cfg.bin, cfg.mode == MODE_LIMIT ? limit_args : NULL);
    if (rc < 0) {
        fprintf(stderr, "load: cannot start %s: %s\n", cfg.bin, strerror(-rc));
        return 1;
    }
    if (cfg.mode == MODE_MIX)
        run_mix();
    else if (cfg.mode == MODE_LIMIT)
        run_limit();
    else
        run_drain();

    if (cfg.d.pid > 0) {
        pid_t pid = cfg.d.pid;
        kill(pid, SIGTERM);
        int st = 0;
        if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
            lc_fail("the daemon did not exit 0 on SIGTERM (%s %d)", WIFEXITED(st) ? "status" : "signal",
                    WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
        cfg.d.pid = 0;
    }
    daemon_stop(&cfg.d);
    int n = atomic_load(&lc_failures);
    printf("%s: %d failure%s\n", n ? "FAILED" : "passed", n, n == 1 ? "" : "s");
    return n ? 1 : 0;
}
