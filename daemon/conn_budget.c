/* Buffering across connections (conn.h: held, starved): the bytes all
 * connections hold, and each uid's, against max_buffered_bytes and
 * max_buffered_bytes_per_uid, and each uid's open connections against
 * max_connections_per_uid.  Blocks freed on the loop thread but not yet
 * unmapped by the pool (offloop.h) count against max_buffered_bytes too:
 * they are still resident.  Loop thread only. */
#include <stdlib.h>

#include "conn.h"
#include "grow.h"
#include "log.h"
#include "offloop.h"

static pb_uid_use_t *uid_use(pb_conns_t *s, uid_t uid)
{
    for (size_t i = 0; i < s->nuids; i++)
        if (s->uids[i].uid == uid)
            return &s->uids[i];
    return NULL;
}

/* c's entry, NULL for a connection never counted in one. */
static pb_uid_use_t *use_of(pb_conns_t *s, const pb_conn_t *c)
{
    return c->counted ? uid_use(s, c->uid) : NULL;
}

bool pb__conns_admit(pb_conns_t *s, pb_conn_t *c, size_t *open)
{
    pb_uid_use_t *u = uid_use(s, c->uid);
    if (open)
        *open = 0;
    if (u == NULL) {
        if (!pb__grow((void **)&s->uids, s->nuids, &s->capuids, sizeof *s->uids))
            return false;
        u = &s->uids[s->nuids++];
        *u = (pb_uid_use_t){.uid = c->uid};
    }
    c->counted = true;
    u->open++;
    u->members++;
    if (open)
        *open = u->open;
    return u->open <= s->cfg->max_connections_per_uid;
}

void pb__conns_closed(pb_conns_t *s, pb_conn_t *c)
{
    pb__conn_unstarve(c);
    pb_uid_use_t *u = use_of(s, c);
    if (u)
        u->open--;
}

void pb__conns_leave(pb_conns_t *s, pb_conn_t *c)
{
    s->held -= c->held;
    pb_uid_use_t *u = use_of(s, c);
    size_t held = c->held;
    c->held = 0;
    if (u == NULL)
        return; /* never counted: out of memory at accept */
    u->held -= held;
    if (--u->members == 0) {
        *u = s->uids[--s->nuids];
        if (s->nuids == 0) {
            free(s->uids);
            s->uids = NULL;
            s->capuids = 0;
        }
    }
}

static bool under_cap(const pb_conns_t *s)
{
    return s->held + pb_offloop_unmapping() < s->cfg->max_buffered_bytes;
}

static void reclaim(pb_conns_t *s);
static bool over_a_cap(const pb_conns_t *s);

/* On the loop's next turn, from the top (a refusal closes a connection,
 * which account's callers do not expect under them): past a cap, replies
 * nobody reads go (reclaim); under the cap the starved read again; still
 * over it, one of them decides again whether anything is left to wait
 * for, and else a victim goes. */
static void on_decide(uv_idle_t *h)
{
    pb_conns_t *s = h->data;
    uv_idle_stop(h);
    if (over_a_cap(s))
        reclaim(s);
    if (s->nstarved == 0)
        return;
    bool under = under_cap(s);
    for (pb_conn_t *c = s->head; c; c = c->next)
        if (c->starved) {
            if (!under) {
                pb__conn_starve(c);
                return;
            }
            pb__conn_resume(c);
        }
}

static void on_stall(uv_timer_t *h)
{
    pb_conns_t *s = h->data;
    if (s->nstarved > 0 || over_a_cap(s))
        uv_idle_start(&s->decide, on_decide);
}

void pb__conns_budget_init(pb_conns_t *s)
{
    uv_idle_init(s->loop, &s->decide);
    s->decide.data = s;
    uv_timer_init(s->loop, &s->stall);
    s->stall.data = s;
    uv_unref((uv_handle_t *)&s->stall); /* a pending look again keeps no loop alive */
}

/* Memory came back, or a request the starved were waiting for was
 * answered.  Under the cap, the starved read again (each starves anew if
 * its buffer still may not grow).  Still over it (replies nobody reads
 * can take the total past the cap), they decide again: otherwise the
 * last request or unmap to end over the cap would leave them waiting for
 * good. */
static void wake(pb_conns_t *s)
{
    if (s->nstarved == 0)
        return; /* the usual case, on every answered request: no walk */
    if (!under_cap(s)) {
        uv_idle_start(&s->decide, on_decide);
        return;
    }
    for (pb_conn_t *c = s->head; c; c = c->next)
        if (c->starved)
            pb__conn_resume(c);
}

void pb__conn_unstarve(pb_conn_t *c)
{
    if (c->starved) {
        c->starved = false;
        c->set->nstarved--;
    }
}

void pb__conn_account(pb_conn_t *c)
{
    pb_conns_t *s = c->set;
    size_t now = c->cap + c->reserved + c->pending_write + c->obuf.size;
    if (now == c->held)
        return;
    pb_uid_use_t *u = use_of(s, c);
    bool shrank = now < c->held;
    s->held = s->held - c->held + now;
    if (u)
        u->held = u->held - c->held + now;
    c->held = now;
    if (shrank)
        wake(s);
    else if (over_a_cap(s))
        /* Past a cap, whether or not anyone waits for room: a reply far
         * bigger than its request (qr_full of a thin matrix) gets in on
         * the one request every connection may have, and would pile up
         * on connections whose clients read nothing. */
        uv_idle_start(&s->decide, on_decide);
}

void pb_conns_memory_back(pb_conns_t *s)
{
    wake(s);
}

void pb_conns_caps_changed(pb_conns_t *s)
{
    if (s->nstarved > 0 || over_a_cap(s))
        uv_idle_start(&s->decide, on_decide);
}

/* A connection's uid entry lives while the connection does (members), and
 * a request in flight holds a reference to its connection. */
void pb__conns_request_begin(pb_conns_t *s, const pb_conn_t *c)
{
    s->inflight++;
    pb_uid_use_t *u = use_of(s, c);
    if (u)
        u->inflight++;
}

void pb__conns_request_done(pb_conns_t *s, const pb_conn_t *c)
{
    s->inflight--;
    pb_uid_use_t *u = use_of(s, c);
    if (u)
        u->inflight--;
    wake(s);
}

bool pb__conn_over_share(const pb_conn_t *c, size_t replies)
{
    const pb_conns_t *s = c->set;
    const pb_config_t *cfg = s->cfg;
    /* Half of an even share: past the cap, what those below it still take
     * adds at most half the cap (and a reply each). */
    if (!under_cap(s) && replies >= cfg->max_buffered_bytes / (2 * (s->count ? s->count : 1)))
        return true;
    const pb_uid_use_t *u = use_of((pb_conns_t *)s, c);
    return u != NULL && u->held >= cfg->max_buffered_bytes_per_uid &&
           replies >= cfg->max_buffered_bytes_per_uid / (2 * (u->members ? u->members : 1));
}

bool pb__conn_may_grow(const pb_conn_t *c, size_t more)
{
    const pb_conns_t *s = c->set;
    if (s->held + pb_offloop_unmapping() + more > s->cfg->max_buffered_bytes)
        return false;
    const pb_uid_use_t *u = use_of((pb_conns_t *)s, c);
    return u == NULL || u->held + more <= s->cfg->max_buffered_bytes_per_uid;
}

/* Is x moving: will it give back held bytes soon by itself?  Only a
 * connection holding PB_CONN_STALL_BYTES or more can (a big message read
 * into the buffer it has, replies queued): a new connection that sent a
 * byte holds nothing worth waiting for.  It moves if it read, and had read
 * of its replies, PB_CONN_STALL_BYTES in the last PB_CONN_STALL_MS: judged
 * over windows of that length from the first look, so each look within a
 * window keeps the verdict.  The first look (or one long after the last)
 * gives the benefit of the doubt, but only while the wait began (since:
 * the starved connection deciding, or the cap passed) less than two
 * windows ago: connections that keep coming cannot hold the decision off. */
static bool still_moving(pb_conn_t *x, uint64_t since, uint64_t now)
{
    /* Replies still being computed count: a burst of requests whose
     * first reply went almost whole into the socket leaves little queued
     * and much reserved, and its client, reading, was closed at once. */
    bool big = (x->len > x->start && x->cap - x->start >= PB_CONN_STALL_BYTES) ||
               x->pending_write + x->reserved >= PB_CONN_STALL_BYTES;
    if (!big)
        return false;
    uint64_t done = x->rx + x->tx - uv_stream_get_write_queue_size((uv_stream_t *)&x->pipe);
    if (x->seen_ms == 0) {
        x->seen_ms = now ? now : 1;
        x->seen_done = done;
        x->moving = now - since < 2 * PB_CONN_STALL_MS;
    } else if (now - x->seen_ms > 2 * PB_CONN_STALL_MS) {
        /* The loop itself was away (a loaded machine: it looks each
         * window while a cap binds), so the daemon wrote nothing for the
         * client to read either: measure again from now.  Judging this
         * gap closed a client that read every reply while another of its
         * threads wrote a burst (python.flood under TSan, about every
         * other run beside the other suites). */
        x->seen_ms = now;
        x->seen_done = done;
        x->moving = true;
    } else if (now - x->seen_ms >= PB_CONN_STALL_MS) {
        x->moving = done - x->seen_done >= PB_CONN_STALL_BYTES;
        x->seen_ms = now;
        x->seen_done = done;
    }
    return x->moving;
}

/* Close v, which holds replies its client does not read, at once: an
 * error would wait behind them, and so would their memory.  The log says
 * which cap and why (how: the case, held: the bytes). */
static void close_unread(pb_conn_t *v, bool per_uid, const char *how, size_t held, const char *what)
{
    const pb_config_t *cfg = v->set->cfg;
    pb_conn_log(v, PB_LOG_NOTICE, "connection %llu (uid %u): %s (%zu) %s (%zu bytes: %s); closing it",
                (unsigned long long)v->id, (unsigned)v->uid,
                per_uid ? "max_buffered_bytes_per_uid" : "max_buffered_bytes",
                per_uid ? cfg->max_buffered_bytes_per_uid : cfg->max_buffered_bytes, how, held, what);
    pb_conn_close(v);
}

void pb__conn_starve(pb_conn_t *c)
{
    pb_conns_t *s = c->set;
    const pb_config_t *cfg = s->cfg;
    if (!c->starved) {
        pb_conn_log(c, PB_LOG_INFO, "connection %llu (uid %u): buffering cap reached (%zu bytes held); reading "
                    "paused", (unsigned long long)c->id, (unsigned)c->uid, s->held);
        c->starved = true;
        c->starved_ms = uv_now(s->loop);
        s->nstarved++;
    }
    uv_read_stop((uv_stream_t *)&c->pipe);
    /* A request in flight (a closed connection's too) gives its bytes
     * back when it is answered, and wakes the starved then: any request
     * when the total binds, one of c's uid when the uid's cap does
     * (another uid's request gives none of its bytes back). */
    pb_uid_use_t *u = use_of(s, c);
    bool total_binds = !under_cap(s) || s->held + pb_offloop_unmapping() + c->want_more > cfg->max_buffered_bytes;
    bool per_uid = u && !total_binds;
    if (per_uid ? u->inflight > 0 : s->inflight > 0)
        return;
    /* Nor does memory on its way back to the system when the total binds
     * (it counts there only): its unmapping wakes them
     * (pb_conns_memory_back). */
    if (!per_uid && pb_offloop_unmapping() > 0)
        return;
    /* Nor do connections still moving: a message read into the room its
     * buffer has (it is a request soon), replies being read.  Wait for
     * them, and look again once they had PB_CONN_STALL_MS to move on (a
     * client that stopped half-way through its message has not). */
    uint64_t now = uv_now(s->loop);
    pb_conn_t *victim = NULL;
    size_t most = 0;
    bool moving = false;
    for (pb_conn_t *x = s->head; x; x = x->next) {
        /* One closing after a flush still holds the replies queued before
         * it: a candidate to close at once if its client reads none. */
        if (x->closing || (x->close_after_flush && x->pending_write == 0) || (per_uid && x->uid != c->uid))
            continue;
        bool partial = x->len > x->start, replies = x->pending_write + x->obuf.size > 0;
        if (!partial && !replies)
            continue;
        if (!x->starved && still_moving(x, c->starved_ms, now))
            moving = true;
        if (x->held > most) {
            most = x->held;
            victim = x;
        }
    }
    if (moving) {
        uv_timer_start(&s->stall, on_stall, PB_CONN_STALL_MS, 0);
        return;
    }
    if (victim == NULL)
        return;
    /* Nothing will: the connection holding the most goes (of c's uid when
     * it is the uid's cap that binds). */
    bool partial = victim->len > victim->start, replies = victim->pending_write + victim->obuf.size > 0;
    const char *what = partial && replies ? "an incomplete message and replies its client has not read"
                       : partial          ? "an incomplete message"
                                          : "replies its client has not read";
    if (victim->pending_write > 0) {
        close_unread(victim, per_uid, "is reached, nothing else can give memory back, and this connection holds "
                     "the most of it", most, what);
        return;
    }
    if (per_uid)
        pb__conn_refuse(victim, "max_buffered_bytes_per_uid",
                        "max_buffered_bytes_per_uid (%zu) is reached for uid %u, nothing else can give memory back, "
                        "and this connection holds the most of it (%zu bytes: %s)",
                        cfg->max_buffered_bytes_per_uid, (unsigned)c->uid, most, what);
    else
        pb__conn_refuse(victim, "max_buffered_bytes",
                        "max_buffered_bytes (%zu) is reached, nothing else can give memory back, and this "
                        "connection holds the most of it (%zu bytes: %s)",
                        cfg->max_buffered_bytes, most, what);
}

/* Is the total, or some uid's, past its cap? */
static bool over_a_cap(const pb_conns_t *s)
{
    if (s->held + pb_offloop_unmapping() > s->cfg->max_buffered_bytes)
        return true;
    for (size_t i = 0; i < s->nuids; i++)
        if (s->uids[i].held > s->cfg->max_buffered_bytes_per_uid)
            return true;
    return false;
}

/* Past a cap: the connections holding replies their clients do not read
 * (none moving PB_CONN_STALL_BYTES a PB_CONN_STALL_MS) close, those
 * holding the most first, until what stays is under the caps.  Replies
 * still being read are waited for (a look again each window); so is
 * nothing else: requests in flight only add their replies.  Closing frees
 * the replies as libuv cancels their writes, on later turns: the count
 * here is what will stay. */
static void reclaim(pb_conns_t *s)
{
    const pb_config_t *cfg = s->cfg;
    uint64_t now = uv_now(s->loop);
    if (s->over_ms == 0)
        s->over_ms = now;
    size_t total = s->held + pb_offloop_unmapping();
    bool moving = false;
    for (;;) {
        pb_conn_t *victim = NULL;
        for (pb_conn_t *x = s->head; x; x = x->next) {
            if (x->closing || x->pending_write == 0)
                continue;
            const pb_uid_use_t *u = use_of(s, x);
            bool over = total > cfg->max_buffered_bytes || (u && u->held - u->gone > cfg->max_buffered_bytes_per_uid);
            if (!over)
                continue;
            if (still_moving(x, s->over_ms, now)) {
                moving = true;
                continue;
            }
            if (victim == NULL || x->held > victim->held)
                victim = x;
        }
        if (victim == NULL)
            break;
        pb_uid_use_t *u = use_of(s, victim);
        size_t held = victim->held;
        total -= held < total ? held : total;
        if (u) /* the close gives the bytes back when its writes end */
            u->gone += held < u->held - u->gone ? held : u->held - u->gone;
        close_unread(victim, total + held <= cfg->max_buffered_bytes, "is passed, and this connection holds", held,
                     "replies its client has not read");
    }
    for (size_t i = 0; i < s->nuids; i++)
        s->uids[i].gone = 0;
    if (moving)
        uv_timer_start(&s->stall, on_stall, PB_CONN_STALL_MS, 0);
    if (!over_a_cap(s))
        s->over_ms = 0;
}
