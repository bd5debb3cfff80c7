/* Connections (conn.h): reading and framing, passed fds, back-pressure,
 * batched replies. */
#define _GNU_SOURCE /* struct ucred */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "conn.h"
#include "log.h"
#include "offloop.h"

/* Messages at least this large take over the read buffer instead of being
 * copied out of it. */
#define BIG_MESSAGE (64u << 10)
#define READ_CHUNK (64u << 10)
/* Reading stops past max_queued_bytes_per_connection queued + reserved
 * bytes (server.h): what a client that does not read its replies may
 * cost.  A connection that held a quarter of that hands the memory back
 * when it goes. */
#define TRIM_AFTER(c) ((c)->set->cfg->max_queued_bytes_per_connection / 4)
/* Small replies batched for the loop's flush are written once they are
 * this many bytes, or past max_queued_bytes_per_connection when that is
 * smaller (pb_conn_send). */
#define OBUF_MAX (256u << 10)

static void on_close(uv_handle_t *h)
{
    pb_conn_t *c = h->data;
    pb_conn_unref(c);
}

void pb_conn_unref(pb_conn_t *c)
{
    if (--c->refs > 0)
        return;
    bool trim = c->held_max >= TRIM_AFTER(c);
    pb__conns_leave(c->set, c);
    pb_buffers_destroy(&c->buffers); /* emptied at close already; this frees the table */
    pb_mem_release(c->buf); /* to the system, not the cache (unmapped off the loop: offloop.h) */
    msgpack_sbuffer_destroy(&c->obuf);
    msgpack_zone_destroy(&c->zone);
    free(c);
    /* Its replies were freed by now (writes and requests hold references),
     * but glibc keeps freed blocks of its arenas resident: a client that
     * made the daemon hold tens of MiB and left would leave the daemon
     * that much bigger for good.  (Large blocks went to the cache, which
     * its cap bounds and idle-trim empties.) */
    if (trim)
        pb_offloop_memory(PB_OFFLOOP_TRIM_HEAP);
}

static void note_held(pb_conn_t *c)
{
    size_t held = c->pending_write + c->reserved;
    if (held > c->held_max)
        c->held_max = held;
    pb__conn_account(c);
}

void pb_conn_reserve(pb_conn_t *c, size_t bytes)
{
    c->reserved += bytes;
    pb__conn_account(c);
}

static void unlink_conn(pb_conn_t *c)
{
    pb_conns_t *s = c->set;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->prev = c->next = NULL;
    s->count--;
    if (c->dirty) {
        pb_conn_t **pp = &s->dirty;
        while (*pp && *pp != c)
            pp = &(*pp)->dnext;
        if (*pp)
            *pp = c->dnext;
        c->dirty = false;
    }
}

/* How many lines c did not log, at the most severe of their levels. */
static void log_dropped(pb_conn_t *c)
{
    if (c->log_dropped == 0)
        return;
    pb_log(c->log_dropped_level, "connection %llu (uid %u, pid %d): %llu more lines about its messages not logged "
           "(at most %d a minute per connection)", (unsigned long long)c->id, (unsigned)c->uid, (int)c->pid,
           (unsigned long long)c->log_dropped, PB_CONN_LOG_BURST);
    c->log_dropped = 0;
    c->log_dropped_level = 0;
}

void pb_conn_log(pb_conn_t *c, int level, const char *fmt, ...)
{
    if (level > pb_log_level)
        return;
    if (level < PB_LOG_DEBUG) {
        uint64_t now = uv_now(c->set->loop);
        if (c->log_lines > 0 && now - c->log_window >= PB_CONN_LOG_WINDOW_MS) {
            log_dropped(c);
            c->log_lines = 0;
        }
        if (c->log_lines == 0)
            c->log_window = now;
        if (c->log_lines == PB_CONN_LOG_BURST) {
            c->log_dropped++;
            if (c->log_dropped_level == 0 || level < c->log_dropped_level)
                c->log_dropped_level = level;
            return;
        }
        c->log_lines++;
    }
    va_list ap;
    va_start(ap, fmt);
    pb_vlog(level, fmt, ap);
    va_end(ap);
}

void pb_conn_close(pb_conn_t *c)
{
    if (c->closing)
        return;
    c->closing = true;
    log_dropped(c);
    pb_log(PB_LOG_INFO, "connection %llu closed (uid %u, pid %d)", (unsigned long long)c->id, (unsigned)c->uid,
           (int)c->pid);
    c->set->cb.on_close(c, c->set->cb.data);
    pb__conns_closed(c->set, c);
    /* Its buffers are unmapped now, or when the last request in flight
     * that uses one ends. */
    pb_buffers_destroy(&c->buffers);
    for (int i = 0; i < c->nfds; i++)
        close(c->fds[i].fd);
    c->nfds = 0;
    unlink_conn(c);
    uv_close((uv_handle_t *)&c->pipe, on_close);
    c->set->cb.on_idle(c->set->cb.data);
}

/* Room enough to read into: with a declared payload pending (need, from
 * the scan), all of it, else a read's worth.  A buffer that cannot hold the
 * payload grows before it reads more: what it moves then is what it holds
 * now, not that plus more reads. */
static bool room_enough(const pb_conn_t *c, size_t need)
{
    if (need)
        return c->start + need <= c->cap && c->cap > c->len;
    return c->cap - c->len >= READ_CHUNK;
}

/* The bytes not taken yet moved to the buffer's front. */
static void to_front(pb_conn_t *c)
{
    size_t keep = c->len - c->start;
    memmove(c->buf, c->buf + c->start, keep);
    c->set->moved += keep;
    c->len = keep;
    c->start = 0;
}

static void alloc_cb(uv_handle_t *h, size_t hint, uv_buf_t *b)
{
    (void)hint;
    pb_conn_t *c = h->data;
    if (c->start > 0 && c->start == c->len)
        c->start = c->len = 0;
    /* A declared payload not all read yet tells how long the message is at
     * least: the buffer grows to that once instead of doubling towards it. */
    size_t need = c->scan.need > c->len - c->start ? c->scan.need : 0;
    size_t keep = c->len - c->start; /* the bytes not taken yet */
    /* Moved to the front only where that makes room enough: else they are
     * copied once, into the grown buffer (not moved, then copied). */
    if (!room_enough(c, need) && c->start > 0 &&
        (need ? need <= c->cap && c->cap > keep : c->cap - keep >= READ_CHUNK))
        to_front(c);
    if (!room_enough(c, need)) {
        /* The scan refuses a message past the limit before more is read,
         * so the buffer never needs more than one message plus a read. */
        size_t most = c->set->cfg->max_message_bytes + 2 * READ_CHUNK;
        size_t ncap = c->cap ? c->cap * 2 : READ_CHUNK * 2;
        while (ncap - keep < READ_CHUNK)
            ncap *= 2;
        /* Exactly the payload and a read: room kept on a guess of what
         * follows would count against the buffering caps, and could make
         * another connection starve or be closed for it. */
        if (need)
            ncap = need + READ_CHUNK; /* need > len: a read's room too */
        /* most can lie below len when a reload lowered the limit under a
         * message being read: the scan refuses it then. */
        if (ncap > most && most >= keep + READ_CHUNK)
            ncap = most;
        /* Past the buffering caps (glossary: starved) the buffer keeps its
         * size; the first two chunks are every connection's due.  Read
         * into what room is left, or starve (on_read hears UV_ENOBUFS). */
        if (c->cap >= 2 * READ_CHUNK && ncap > c->cap && !pb__conn_may_grow(c, ncap - c->cap)) {
            if (c->cap > c->len)
                goto room;
            if (c->start > 0) {
                to_front(c);
                goto room;
            }
            c->want_memory = true;
            c->want_more = ncap - c->cap;
            b->base = NULL;
            b->len = 0;
            return;
        }
        /* The message starts where the payload being waited for lands
         * aligned to PB_ALIGN: a tensor inline is then used where it lies
         * (kernels want its elements aligned; else op.c copies it). */
        size_t shift = need >= BIG_MESSAGE ? (PB_ALIGN - c->scan.need_at % PB_ALIGN) % PB_ALIGN : 0;
        ncap += shift;
        /* A new block, not realloc: a big one comes from the cache of
         * freed blocks (kernels/mem.h), already paged in. */
        char *nb = pb_mem_block(ncap);
        if (nb == NULL) {
            b->base = NULL;
            b->len = 0;
            return;
        }
        if (keep)
            memcpy(nb + shift, c->buf + c->start, keep);
        c->set->moved += keep;
        pb_mem_free(c->buf);
        c->buf = nb;
        c->start = shift;
        c->len = shift + keep;
        c->cap = ncap;
        pb__conn_account(c);
    }
room:
    b->base = c->buf + c->len;
    b->len = c->cap - c->len;
}

/* The storage of the message at buf[start, start + n): the buffer itself
 * for a big message at its front (alloc_cb may have placed it a few bytes
 * in), else a copy. */
static pb_storage_t *take_message(pb_conn_t *c, size_t n)
{
    if (n >= BIG_MESSAGE && c->start < PB_ALIGN) {
        size_t rest = c->len - c->start - n;
        size_t ncap = rest + READ_CHUNK * 2;
        char *nb = pb_mem_block(ncap);
        if (nb == NULL)
            return NULL;
        memcpy(nb, c->buf + c->start + n, rest);
        c->set->moved += rest;
        pb_storage_t *s = pb_storage_view(c->buf + c->start, n, pb_mem_free, c->buf);
        if (s == NULL) {
            pb_mem_free(nb);
            return NULL;
        }
        c->buf = nb;
        c->cap = ncap;
        c->len = rest;
        c->start = 0;
        return s;
    }
    char *p = malloc(n ? n : 1);
    if (p == NULL)
        return NULL;
    pb_storage_t *s = pb_storage_view(p, n, free, p);
    if (s == NULL) {
        free(p);
        return NULL;
    }
    memcpy(p, c->buf + c->start, n);
    c->start += n;
    return s;
}

static void mark_dirty(pb_conn_t *c);
static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *b);

/* One error with msgid 0, then the connection closes after the flush. */
static void answer_and_close(pb_conn_t *c, const pb_err_t *err)
{
    pb_out_t o;
    pb_out_init(&o);
    pb_out_error_response(&o, 0, err);
    pb_conn_send(c, &o);
    c->close_after_flush = true;
    mark_dirty(c);
    uv_read_stop((uv_stream_t *)&c->pipe);
}

/* limit: max_message_bytes when that is what the message passed, else 0. */
static void parse_error(pb_conn_t *c, const char *why, size_t limit)
{
    pb_err_t err;
    if (limit)
        pb_err_set(&err, PB_EPARSE, "max_message_bytes", "%s (max_message_bytes is %zu); closing the connection",
                   why, limit);
    else
        pb_err_set(&err, PB_EPARSE, NULL, "%s; closing the connection", why);
    pb_conn_log(c, PB_LOG_NOTICE, "connection %llu: parse_error: %s", (unsigned long long)c->id, err.message);
    answer_and_close(c, &err);
}

void pb__conn_refuse(pb_conn_t *c, const char *limit, const char *fmt, ...)
{
    pb_err_t err;
    char why[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    pb_err_set(&err, PB_ERESOURCE_EXHAUSTED, limit, "%s; closing the connection", why);
    pb_conn_log(c, PB_LOG_NOTICE, "connection %llu (uid %u): resource_exhausted: %s", (unsigned long long)c->id,
           (unsigned)c->uid, why);
    /* Its incomplete message goes back to the system, unmapped off the
     * loop; until it is gone its bytes still count against
     * --max-buffered-bytes (pb_offloop_unmapping), which bounds what is
     * resident (python.flood), and the others wake when it is. */
    pb_mem_release(c->buf);
    if (c->cap >= TRIM_AFTER(c))
        pb_offloop_memory(PB_OFFLOOP_TRIM_HEAP);
    c->buf = NULL;
    c->cap = c->len = c->start = 0;
    pb_scan_reset(&c->scan);
    pb__conn_unstarve(c);
    answer_and_close(c, &err);
    pb__conn_account(c);
}

void pb__conn_resume(pb_conn_t *c)
{
    pb__conn_unstarve(c);
    if (!c->paused && !c->closing && !c->close_after_flush && !c->last_read && !c->eof)
        uv_read_start((uv_stream_t *)&c->pipe, alloc_cb, on_read);
}

/* Counting the replies still to come, not only those queued, is what
 * bounds a client that never reads: otherwise every request read while
 * the queue is under the cap adds its reply later.  With nothing in
 * flight nothing is reserved, so the next request is always read unless
 * the queue alone is over the cap.  The last read answers everything
 * with a short shutting_down and stops on its own. */
static bool blocked(const pb_conn_t *c)
{
    if (c->last_read)
        return false;
    const pb_config_t *cfg = c->set->cfg;
    /* Small replies batched in obuf are written once they reach OBUF_MAX
     * (pb_conn_send), so they come under pending_write soon enough. */
    size_t replies = c->pending_write + c->reserved;
    /* Held replies wait for a cap (glossary: starved): each ends in a
     * callback that looks again (on_write, pb_conn_request_done).  Not
     * those batched in obuf: the flush may write them whole, inline,
     * with no callback after it. */
    return replies > cfg->max_queued_bytes_per_connection || (replies > 0 && pb__conn_over_share(c, replies));
}

/* After the client's shutdown(SHUT_WR) (nc -N, a one-shot script): once
 * every complete message it sent is taken (none is left behind a
 * back-pressure pause) and answered, the replies are flushed and the
 * connection closes.  Bytes of a message it never finished are dropped. */
static void eof_check(pb_conn_t *c)
{
    if (!c->eof || c->closing || c->close_after_flush || c->last_read || c->processing)
        return;
    if (blocked(c)) {
        /* Complete messages may wait behind the caps: paused, the next
         * reply written or request answered takes them up (on_write,
         * pb_conn_request_done), and checks again. */
        c->paused = true;
        return;
    }
    if (c->drain_left > 0) { /* nothing more of it can come: it holds no drain */
        c->drain_left = 0;
        c->set->cb.on_idle(c->set->cb.data);
    }
    if (c->inflight > 0 || c->closing)
        return;
    c->close_after_flush = true;
    mark_dirty(c);
}

/* EOF on a socket whose peer still reads: it shut only its writing side
 * (a peer that closed shows POLLHUP).  Only POLLHUP is asked: POLLOUT
 * would be missing whenever replies fill the socket, as a client that
 * reads only after its shutdown lets them. */
static bool half_closed(pb_conn_t *c)
{
    uv_os_fd_t fd;
    if (uv_fileno((uv_handle_t *)&c->pipe, &fd) != 0)
        return false;
    struct pollfd p = {.fd = fd, .events = 0};
    int n = poll(&p, 1, 0);
    return n == 0 || (n == 1 && !(p.revents & (POLLHUP | POLLERR)));
}

static void process(pb_conn_t *c)
{
    pb_conns_t *s = c->set;
    if (c->processing)
        return; /* the loop below re-checks blocked() itself */
    c->processing = true;
    c->refs++; /* a reply may close c under us */
    while (!c->closing && !c->close_after_flush && c->start < c->len && !blocked(c)) {
        size_t n;
        int rc = pb_scan_feed(&c->scan, (const uint8_t *)c->buf + c->start, c->len - c->start,
                              s->cfg->max_message_bytes, &n);
        if (rc == 0)
            break;
        if (rc < 0) {
            parse_error(c, c->scan.why, c->scan.too_big ? s->cfg->max_message_bytes : 0);
            break;
        }
        pb_scan_reset(&c->scan);
        bool late = false;
        if (s->stopping) {
            late = c->drain_left < n;
            c->drain_left = late ? 0 : c->drain_left - n;
        }
        pb__conn_claim_fds(c, c->taken, c->taken + n);
        pb_storage_t *msg = take_message(c, n);
        if (msg == NULL) {
            pb__conn_release_msg_fds(c);
            parse_error(c, "out of memory for a message", 0);
            break;
        }
        c->taken += n;
        s->cb.on_message(c, msg, late, s->cb.data);
        pb__conn_release_msg_fds(c);
        pb_storage_unref(msg);
    }
    note_held(c);
    if (!c->closing && !c->close_after_flush && !c->last_read) {
        bool stop = blocked(c);
        if (stop && !c->paused) {
            uv_read_stop((uv_stream_t *)&c->pipe);
            c->paused = true;
        } else if (!stop && c->paused) {
            c->paused = false;
            if (!c->eof)
                uv_read_start((uv_stream_t *)&c->pipe, alloc_cb, on_read);
        }
    }
    c->processing = false;
    eof_check(c);
    /* Draining, look again whenever this connection no longer holds the
     * drain (pb_conns_drained): its last message from before the stop was
     * taken (which may start no request and write nothing: a dropped
     * notification, an early error sent inline), or a message is now known
     * to end past what came before the stop.  Not only when it held the
     * drain on entry: a shutdown request in this very batch starts the
     * stop half-way through it. */
    bool now_late = s->stopping && c->drain_left > 0 && c->scan.need > c->drain_left;
    bool released = s->stopping && (c->drain_left == 0 || now_late);
    pb_conn_unref(c);
    if (released)
        s->cb.on_idle(s->cb.data);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *b)
{
    (void)b;
    pb_conn_t *c = st->data;
    if (nread == UV_ENOBUFS && c->want_memory) {
        c->want_memory = false;
        pb__conn_starve(c);
        return;
    }
    if (nread == UV_EOF && !c->closing && half_closed(c)) {
        c->eof = true;
        process(c);
        return;
    }
    if (nread < 0) {
        if (nread != UV_EOF)
            pb_conn_log(c, PB_LOG_INFO, "connection %llu: read: %s", (unsigned long long)c->id,
                        uv_strerror((int)nread));
        pb_conn_close(c);
        return;
    }
    if (nread > 0 && uv_pipe_pending_count(&c->pipe) > 0 && !pb__conn_receive_fds(c, c->rx, c->rx + (uint64_t)nread)) {
        pb_log(PB_LOG_WARNING, "connection %llu: out of memory for passed file descriptors; closing it",
               (unsigned long long)c->id);
        pb_conn_close(c);
        return;
    }
    c->rx += (uint64_t)nread;
    c->len += (size_t)nread;
    process(c);
}

void pb_conn_request_begin(pb_conn_t *c)
{
    c->inflight++;
    pb__conns_request_begin(c->set, c);
}

void pb_conn_request_done(pb_conn_t *c, size_t reserved)
{
    c->inflight--;
    c->reserved -= reserved;
    pb__conn_account(c);
    pb__conns_request_done(c->set, c);
    if (c->paused && !c->closing)
        process(c);
    else
        eof_check(c);
}

static void last_read(pb_conn_t *c)
{
    if (c->closing || c->close_after_flush || c->last_read)
        return;
    uv_os_fd_t fd;
    if (uv_fileno((uv_handle_t *)&c->pipe, &fd) != 0)
        return;
    c->refs++; /* a failed write may close c under us */
    c->last_read = true;
    uv_read_stop((uv_stream_t *)&c->pipe);
    c->paused = true;
    /* After this the client's writes fail (EPIPE) instead of landing in a
     * socket nobody reads: a request either is in the socket now and is
     * answered below, or its sender learns it was not sent. */
    shutdown(fd, SHUT_RD);
    int pending = 0;
    if (ioctl(fd, FIONREAD, &pending) != 0 || pending < 0)
        pending = 0;
    size_t left = (size_t)pending;
    /* Everything is late now: pb_conn_process answers shutting_down. */
    process(c);
    while (left > 0 && !c->closing && !c->close_after_flush) {
        uv_buf_t b;
        alloc_cb((uv_handle_t *)&c->pipe, left, &b);
        if (b.base == NULL)
            break;
        ssize_t n = recv(fd, b.base, b.len < left ? b.len : left, MSG_DONTWAIT);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        /* recv without room for ancillary data: the kernel closes any fds
         * these bytes carried; what they ask is refused anyway. */
        c->rx += (uint64_t)n;
        c->len += (size_t)n;
        left -= (size_t)n;
        process(c);
    }
    pb_conn_unref(c);
}

/* A line about the file-descriptor limit, or about accept: at most one
 * every PB_CONNS_FD_WARN_MS, saying how many were not logged. */
static void fd_warn(pb_conns_t *s, const char *what)
{
    uint64_t now = uv_now(s->loop);
    if (s->fd_warned && now - s->fd_warned < PB_CONNS_FD_WARN_MS) {
        s->fd_unsaid++;
        return;
    }
    char more[64] = "";
    if (s->fd_unsaid)
        snprintf(more, sizeof more, " (and %llu more times since the last line)", (unsigned long long)s->fd_unsaid);
    pb_log(PB_LOG_WARNING, "%s%s", what, more);
    s->fd_warned = now ? now : 1;
    s->fd_unsaid = 0;
}

void pb_conns_accept_failed(pb_conns_t *s, int status)
{
    char what[300];
    if (status == UV_EMFILE || status == UV_ENFILE)
        snprintf(what, sizeof what, "accept: %s: a new connection was closed unanswered (file-descriptor limit %llu; "
                 "raise LimitNOFILE= or lower max-connections-per-uid)", uv_strerror(status),
                 (unsigned long long)s->fd_limit);
    else
        snprintf(what, sizeof what, "accept: %s", uv_strerror(status));
    fd_warn(s, what);
}

void pb_conns_accept(pb_conns_t *s, uv_stream_t *listener)
{
    pb_conn_t *c = calloc(1, sizeof *c);
    if (c == NULL)
        return;
    c->set = s;
    c->refs = 1;
    c->id = ++s->next_id;
    msgpack_sbuffer_init(&c->obuf);
    msgpack_zone_init(&c->zone, 4096);
    pb_buffers_init(&c->buffers);
    /* ipc: read with recvmsg, keeping the fds register_buffer passes. */
    uv_pipe_init(s->loop, &c->pipe, 1);
    c->pipe.data = c;
    if (uv_accept(listener, (uv_stream_t *)&c->pipe) != 0) {
        uv_close((uv_handle_t *)&c->pipe, on_close);
        return;
    }
    uv_os_fd_t fd;
    struct ucred cr = {0};
    socklen_t len = sizeof cr;
    /* Big replies move in fewer, larger writes (the kernel caps this at
     * net.core.wmem_max; measured here: 4.1 -> 5.2 GB/s). */
    int sndbuf = 4 << 20;
    bool have_fd = uv_fileno((uv_handle_t *)&c->pipe, &fd) == 0;
    if (have_fd)
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    /* The kernel gives the lowest free number: one this high means about
     * that many are open. */
    if (have_fd && (uint64_t)fd + PB_CONNS_FD_MARGIN >= s->fd_limit) {
        char what[300];
        snprintf(what, sizeof what, "connection %llu has file descriptor %d of the %llu this process may open "
                 "(RLIMIT_NOFILE): past the limit new connections are closed unanswered; raise LimitNOFILE= or "
                 "lower max-connections-per-uid", (unsigned long long)c->id, fd,
                 (unsigned long long)s->fd_limit);
        fd_warn(s, what);
    }
    if (have_fd && getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0) {
        c->uid = cr.uid;
        c->pid = cr.pid;
    } else {
        c->uid = (uid_t)-1;
    }
    c->buffers.uid = c->uid;
    c->next = s->head;
    if (s->head)
        s->head->prev = c;
    s->head = c;
    s->count++;
    pb_log(PB_LOG_INFO, "connection %llu opened (uid %u, pid %d)", (unsigned long long)c->id, (unsigned)c->uid,
           (int)c->pid);
    size_t open = 0;
    if (!pb__conns_admit(s, c, &open)) {
        if (open == 0)
            pb__conn_refuse(c, "max_connections_per_uid", "out of memory counting the connections of uid %u",
                            (unsigned)c->uid);
        else
            pb__conn_refuse(c, "max_connections_per_uid",
                            "uid %u has %zu connections open, past the max_connections_per_uid limit (%zu)",
                            (unsigned)c->uid, open, s->cfg->max_connections_per_uid);
        return;
    }
    uv_read_start((uv_stream_t *)&c->pipe, alloc_cb, on_read);
}

/* Writes.  What the socket takes at once goes inline (write_inline); for
 * the rest write_now allocates a wreq per uv_write, which on_write frees.
 * The wreq owns the reply bytes it writes (moved out of the caller's
 * pb_out_t or the connection's batch) and holds a reference on the
 * connection. */
typedef struct wreq {
    uv_write_t w;
    pb_conn_t *c;
    pb_out_t out;          /* big reply, or */
    msgpack_sbuffer flat;  /* batched small replies */
    size_t bytes;
    uv_buf_t bufs[2 * PB_OUT_MAXSEG + 1];
} wreq_t;

static void wreq_free(wreq_t *r)
{
    pb_out_free(&r->out);
    msgpack_sbuffer_destroy(&r->flat);
    free(r);
}

/* With nothing queued, so that order is kept, hands the socket what it
 * takes now: that saves a uv_write_t, its callback and the epoll_ctl that
 * libuv's uv__drain() issues after each completed queued write.  Advances
 * bufs and *n past what went; returns its bytes. */
static size_t write_inline(pb_conn_t *c, uv_buf_t *bufs, int *n)
{
    if (c->pending_write != 0)
        return 0;
    int w = uv_try_write((uv_stream_t *)&c->pipe, bufs, (unsigned)*n);
    if (w <= 0)
        return 0;
    c->tx += (uint64_t)w;
    size_t done = (size_t)w;
    int k = 0;
    while (k < *n && done >= bufs[k].len)
        done -= bufs[k++].len;
    if (k < *n) {
        bufs[k].base += done;
        bufs[k].len -= done;
    }
    memmove(bufs, bufs + k, (size_t)(*n - k) * sizeof *bufs);
    *n -= k;
    return (size_t)w;
}

static void on_write(uv_write_t *w, int status)
{
    wreq_t *r = w->data;
    pb_conn_t *c = r->c;
    c->pending_write -= r->bytes;
    wreq_free(r);
    pb__conn_account(c);
    if (status < 0 && !c->closing)
        pb_conn_close(c);
    else if (!c->closing && c->paused && !blocked(c))
        process(c);
    else
        eof_check(c);
    pb_conns_t *s = c->set;
    pb_conn_unref(c);
    s->cb.on_idle(s->cb.data);
}

static void write_now(pb_conn_t *c, pb_out_t *o, msgpack_sbuffer *flat)
{
    wreq_t *r = calloc(1, sizeof *r);
    if (r == NULL) {
        if (o)
            pb_out_free(o);
        if (flat)
            msgpack_sbuffer_destroy(flat);
        pb_conn_close(c);
        return;
    }
    int n;
    if (o) {
        r->out = *o;
        pb_out_init(o);
        const void *ptr[2 * PB_OUT_MAXSEG + 1];
        size_t len[2 * PB_OUT_MAXSEG + 1];
        n = pb_out_iov(&r->out, ptr, len, 2 * PB_OUT_MAXSEG + 1);
        for (int i = 0; i < n; i++) {
            r->bufs[i] = uv_buf_init((char *)ptr[i], (unsigned)len[i]);
            r->bytes += len[i];
        }
        msgpack_sbuffer_init(&r->flat);
    } else {
        pb_out_init(&r->out);
        r->flat = *flat;
        msgpack_sbuffer_init(flat);
        r->bufs[0] = uv_buf_init(r->flat.data, (unsigned)r->flat.size);
        r->bytes = r->flat.size;
        n = 1;
    }
    /* A batch (flat) was offered to the socket by flush already. */
    if (o) {
        r->bytes -= write_inline(c, r->bufs, &n);
        if (n == 0) {
            wreq_free(r);
            pb__conn_account(c);
            return;
        }
    }
    r->c = c;
    r->w.data = r;
    c->refs++;
    c->pending_write += r->bytes;
    note_held(c);
    int rc = uv_write(&r->w, (uv_stream_t *)&c->pipe, r->bufs, (unsigned)n, on_write);
    if (rc) {
        c->pending_write -= r->bytes;
        wreq_free(r);
        pb_conn_unref(c);
        pb_conn_close(c);
        return;
    }
    c->tx += r->bytes;
}

static void flush(pb_conn_t *c)
{
    if (!c->obuf.size || c->closing)
        return;
    uv_buf_t b = uv_buf_init(c->obuf.data, (unsigned)c->obuf.size);
    int n = 1;
    size_t done = write_inline(c, &b, &n);
    if (n == 0) {
        c->obuf.size = 0;
        pb__conn_account(c);
        return;
    }
    if (done > 0) {
        memmove(c->obuf.data, c->obuf.data + done, c->obuf.size - done);
        c->obuf.size -= done;
    }
    write_now(c, NULL, &c->obuf);
}

void pb_conn_send(pb_conn_t *c, pb_out_t *o)
{
    if (c->closing) {
        pb_out_free(o);
        pb_out_init(o);
        return;
    }
    if (o->nseg == 0 && o->sb.size < (256u << 10)) {
        /* Small: batch with the other replies of this loop iteration. */
        msgpack_sbuffer_write(&c->obuf, o->sb.data, o->sb.size);
        pb_out_free(o);
        pb_out_init(o);
        mark_dirty(c);
        pb__conn_account(c);
        /* A batch is written once it is this big, not only at the loop's
         * flush: then what it could not write counts in pending_write,
         * which bounds a connection (blocked), or one read of tiny requests
         * with big replies (ops, 25 bytes in and 4 KiB out) would queue
         * hundreds of times its size before the flush. */
        if (c->obuf.size >= OBUF_MAX || c->obuf.size > c->set->cfg->max_queued_bytes_per_connection)
            flush(c);
        return;
    }
    flush(c);
    write_now(c, o, NULL);
}

static void after_shutdown_write(uv_shutdown_t *req, int status)
{
    (void)status;
    pb_conn_t *c = req->data;
    free(req);
    pb_conn_close(c);
    pb_conn_unref(c);
}

static void mark_dirty(pb_conn_t *c)
{
    if (!c->dirty) {
        c->dirty = true;
        c->dnext = c->set->dirty;
        c->set->dirty = c;
    }
}

void pb_conns_flush(pb_conns_t *s)
{
    pb_conn_t *c = s->dirty;
    s->dirty = NULL;
    while (c) {
        pb_conn_t *n = c->dnext;
        c->dirty = false;
        c->dnext = NULL;
        flush(c);
        /* After a parse error: close once the error reply is out. */
        if (c->close_after_flush && !c->shut_sent && !c->closing) {
            uv_shutdown_t *req = malloc(sizeof *req);
            c->shut_sent = true;
            if (req) {
                req->data = c;
                c->refs++;
                if (uv_shutdown(req, (uv_stream_t *)&c->pipe, after_shutdown_write) != 0) {
                    free(req);
                    pb_conn_unref(c);
                    pb_conn_close(c);
                }
            } else {
                pb_conn_close(c);
            }
        }
        c = n;
    }
}

/* ---- the set ------------------------------------------------------------- */

void pb_conns_init(pb_conns_t *s, uv_loop_t *loop, const pb_config_t *cfg, pb_conn_cbs_t cb)
{
    *s = (pb_conns_t){.loop = loop, .cfg = cfg, .cb = cb};
    struct rlimit r;
    s->fd_limit = getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur != RLIM_INFINITY ? (uint64_t)r.rlim_cur : UINT64_MAX;
    pb__conns_budget_init(s);
}

void pb_conns_stop(pb_conns_t *s)
{
    s->stopping = true;
    for (pb_conn_t *c = s->head; c; c = c->next) {
        uv_os_fd_t fd;
        int pending = 0;
        if (uv_fileno((uv_handle_t *)&c->pipe, &fd) == 0)
            ioctl(fd, FIONREAD, &pending);
        c->drain_left = (c->len - c->start) + (size_t)(pending > 0 ? pending : 0);
    }
}

/* A message known to be longer than what c sent before the stop (its
 * header declares a payload past drain_left) can only complete with late
 * bytes: it will be answered shutting_down, so the drain does not wait
 * for a client paused in the middle of it. */
bool pb_conns_drained(const pb_conns_t *s)
{
    for (const pb_conn_t *c = s->head; c; c = c->next)
        if (c->drain_left > 0 && !c->closing && c->scan.need <= c->drain_left)
            return false;
    return true;
}

bool pb_conns_written(const pb_conns_t *s)
{
    for (const pb_conn_t *c = s->head; c; c = c->next)
        if (c->pending_write > 0 && !c->closing)
            return false;
    return true;
}

void pb_conns_last_read(pb_conns_t *s)
{
    pb_conn_t *next;
    for (pb_conn_t *c = s->head; c; c = next) {
        next = c->next;
        last_read(c);
    }
}

void pb_conns_close_all(pb_conns_t *s)
{
    while (s->head)
        pb_conn_close(s->head);
}

void pb_conns_destroy(pb_conns_t *s)
{
    if (!uv_is_closing((uv_handle_t *)&s->decide))
        uv_close((uv_handle_t *)&s->decide, NULL);
    if (!uv_is_closing((uv_handle_t *)&s->stall))
        uv_close((uv_handle_t *)&s->stall, NULL);
}
