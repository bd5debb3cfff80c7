/* C client library of pullbackd: connection, framing, reply queue and the
 * msgpack helpers declared in pullbackd.h.
 *
 * Sending: a request is packed into the client's send buffer (the packer
 * writes through client_pack_write, which turns an allocation failure into a
 * sticky error reported by the send) and written in one go.  While writing,
 * the client also reads whatever the daemon sends back, so that a client
 * pipelining many requests without reading cannot deadlock against a daemon
 * blocked on writing the replies.
 *
 * Receiving: bytes are read into a receive buffer and framed by the
 * daemon's own scan (proto/wire.h) before anything is unpacked; a complete
 * message goes to msgpack_unpack_next, which gives it its own zone, and its
 * str and bin payloads point into the buffer.  Buffers are reference
 * counted (client_rbuf_t): every reply holds its buffer through a finalizer
 * on its zone, so a reply stays valid however much is read after it, and
 * after the client is closed.  Small messages share one buffer that grows
 * up to CLIENT_BIG.  A bigger one is read into a buffer of its own, sized at
 * once from the lengths its header declares as soon as the scan has seen
 * them, so that it arrives with no copy of ours and no doubling; the client
 * keeps a few such buffers (client_pool_take) and lends one again once no
 * reply points into it, since fresh memory costs a page fault per 4 KiB.
 * Replies read while looking for another msgid wait in a FIFO queue. */
#define _GNU_SOURCE
#include "pullbackd.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "proto/wire.h"

/* The first size of the buffer small messages share. */
#define CLIENT_READ_CHUNK (64 * 1024)
/* The least room the small buffer offers a read. */
#define CLIENT_READ_MIN (16 * 1024)
/* A message at least this long gets a receive buffer of its own. */
#define CLIENT_BIG (1u << 20)
/* Read past a big message's known end, for the header of the next one;
 * reads stop there, so what follows a big message (moved back to the small
 * buffer) stays short. */
#define CLIENT_SLACK (64 * 1024)
/* Big receive buffers kept for reuse: at most this many, this many bytes
 * together; the least recently taken goes first. */
#define CLIENT_KEEP_BIG 2
#define CLIENT_KEEP_BYTES ((size_t)512 << 20)
/* The sizes big messages came to, by the need that first made them big:
 * entries remembered. */
#define CLIENT_GROWN 8
/* A send buffer larger than this after a request is freed rather than kept
 * for the next one, so one big tensor does not pin its memory forever. */
#define CLIENT_KEEP_SBUF (1024 * 1024)
/* Tensor data of at least this many bytes is sent from the caller's memory
 * (an iovec of its own) instead of being copied into the send buffer; at
 * most CLIENT_MAXSEG such tensors per message, the rest are copied. */
#define CLIENT_INPLACE (64u << 10)
#define CLIENT_MAXSEG 16

enum client_begun { BEGUN_NONE, BEGUN_REQUEST, BEGUN_NOTIFY };

/* A receive buffer.  Reference counted: the client holds one reference
 * while it reads into it and one for each buffer it keeps for reuse, and
 * every reply whose payloads point into it holds one (dropped by its zone's
 * finalizer).  The last holder frees it, in any order and on any thread. */
typedef struct client_rbuf {
    size_t refs; /* atomic */
    size_t cap;  /* bytes of data */
    char data[];
} client_rbuf_t;

/* Ownership: the client owns fd, the send buffer, its references to the
 * receive buffers (rb, small, keep) and the queued replies.  Replies handed
 * out belong to the caller, and each holds its own reference to the buffer
 * its payloads lie in. */
struct pb_client {
    int fd;
    uint32_t next_msgid; /* never 0 */

    msgpack_sbuffer out;
    msgpack_packer pk;   /* writes into out through client_pack_write */
    int pack_err;        /* first packing failure since the last begin */
    int begun;           /* enum client_begun */
    uint32_t begun_msgid;
    size_t params_off;   /* offset in out where the params map starts */
    /* Tensor payloads sent in place: each goes after out's first `at`
     * bytes.  The memory is the caller's, valid until the send returns. */
    struct client_seg {
        size_t at;
        const void *p;
        size_t len;
    } seg[CLIENT_MAXSEG];
    int nseg;

    /* Read, not yet framed: rb->data[rpos, rend), the start of the message
     * that scan walks.  rb is small (the reference is small's), or while a
     * big message arrives a buffer of its own (with a reference of rb's). */
    client_rbuf_t *rb;
    size_t rpos, rend;
    pb_scan_t scan;
    size_t framed;       /* the message at rpos is complete and this long; 0
                            while scan is still walking it */
    client_rbuf_t *small;
    client_rbuf_t *keep[CLIENT_KEEP_BIG]; /* least recently taken first */
    int nkeep;
    /* A big message's length is learnt one payload at a time (a bin's
     * header follows the bytes of the bin before it): the lengths messages
     * came to, by their first need, size the next one of the same header
     * at once. */
    struct client_grown {
        size_t first, size;
    } grown[CLIENT_GROWN];
    unsigned grown_next;
    size_t first_need;   /* of the big message being read */
    bool eof;            /* the daemon closed its end */
    int broken;          /* -EPROTO once the stream from the daemon is lost
                            for good, else 0.  Running out of memory is not
                            sticky: it consumes nothing, and the receive
                            after tries again. */
    bool torn;           /* a write failed after part of its message was
                            out: the daemon would read what follows as the
                            rest of it, so nothing more is written and every
                            send and receive returns -EIO */

    pb_reply_t *queue;   /* FIFO of replies read but not yet returned */
    size_t qlen, qcap;
};

/* ---- Small helpers ----------------------------------------------------- */

static int client_pack_write(void *data, const char *buf, size_t len)
{
    pb_client_t *c = data;

    if (c->pack_err != 0)
        return -1;
    if (len == 0)
        return 0;
    if (msgpack_sbuffer_write(&c->out, buf, len) != 0) {
        c->pack_err = -ENOMEM;
        return -1;
    }
    return 0;
}

static void client_discard(pb_client_t *c)
{
    if (c->out.alloc > CLIENT_KEEP_SBUF) {
        msgpack_sbuffer_destroy(&c->out);
        msgpack_sbuffer_init(&c->out);
    }
    c->out.size = 0;
    c->pack_err = 0;
    c->nseg = 0;
    c->begun = BEGUN_NONE;
}

/* Milliseconds left until deadline (CLOCK_MONOTONIC), for poll(): rounded
 * up, since a poll() cut short by the rounding would time out before the
 * deadline. */
static int ms_left(const struct timespec *deadline)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long ns = (long long)(deadline->tv_sec - now.tv_sec) * 1000000000LL +
                   (deadline->tv_nsec - now.tv_nsec);
    if (ns <= 0)
        return 0;
    long long ms = (ns + 999999) / 1000000;
    return ms > INT_MAX ? INT_MAX : (int)ms;
}

/* ---- Receive buffers --------------------------------------------------- */

static client_rbuf_t *rbuf_new(size_t cap)
{
    if (cap > SIZE_MAX - sizeof(client_rbuf_t))
        return NULL;
    client_rbuf_t *b = malloc(sizeof *b + cap);
    if (b == NULL)
        return NULL;
    b->refs = 1;
    b->cap = cap;
    return b;
}

static void rbuf_get(client_rbuf_t *b)
{
    __atomic_add_fetch(&b->refs, 1, __ATOMIC_RELAXED);
}

static void rbuf_put(client_rbuf_t *b)
{
    if (b != NULL && __atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL) == 0)
        free(b);
}

/* A zone finalizer: the reply that pointed into the buffer is gone. */
static void rbuf_release(void *b)
{
    rbuf_put(b);
}

/* True when nobody but one holder (the caller) refers to b: no reply points
 * into it.  Only the client makes new references, so this stays true until
 * it makes one. */
static bool rbuf_alone(client_rbuf_t *b)
{
    return __atomic_load_n(&b->refs, __ATOMIC_ACQUIRE) == 1;
}

/* A big buffer of at least size bytes that no reply points into, with a
 * reference for the caller: a kept one of size..2*size bytes when there is
 * one (its pages are already mapped), else a new one, kept in turn unless
 * it is larger than all that may be kept.  Contents undefined. */
static client_rbuf_t *client_pool_take(pb_client_t *c, size_t size)
{
    int best = -1;
    for (int i = 0; i < c->nkeep; i++) {
        client_rbuf_t *b = c->keep[i];
        if (b->cap >= size && b->cap / 2 <= size && rbuf_alone(b) &&
            (best < 0 || b->cap < c->keep[best]->cap))
            best = i;
    }
    client_rbuf_t *b;
    if (best >= 0) {
        b = c->keep[best];
        memmove(&c->keep[best], &c->keep[best + 1], (size_t)(c->nkeep - best - 1) * sizeof *c->keep);
        c->nkeep--;
    } else {
        b = rbuf_new(size);
        if (b == NULL || size > CLIENT_KEEP_BYTES)
            return b;
    }
    size_t held = b->cap;
    for (int i = 0; i < c->nkeep; i++)
        held += c->keep[i]->cap;
    while (c->nkeep == CLIENT_KEEP_BIG || (c->nkeep > 0 && held > CLIENT_KEEP_BYTES)) {
        /* A reply still pointing into it keeps it until freed. */
        held -= c->keep[0]->cap;
        rbuf_put(c->keep[0]);
        memmove(&c->keep[0], &c->keep[1], (size_t)(c->nkeep - 1) * sizeof *c->keep);
        c->nkeep--;
    }
    rbuf_get(b);
    c->keep[c->nkeep++] = b;
    return b;
}

/* The length the last big message that began with this need came to. */
static size_t client_grown(const pb_client_t *c, size_t first)
{
    for (int i = 0; i < CLIENT_GROWN; i++)
        if (c->grown[i].first == first)
            return c->grown[i].size;
    return 0;
}

static void client_grown_note(pb_client_t *c, size_t first, size_t size)
{
    for (int i = 0; i < CLIENT_GROWN; i++) {
        if (c->grown[i].first == first) {
            c->grown[i].size = size;
            return;
        }
    }
    c->grown[c->grown_next] = (struct client_grown){ first, size };
    c->grown_next = (c->grown_next + 1) % CLIENT_GROWN;
}

/* ---- Socket path and connection --------------------------------------- */

/* Write dir (dirlen bytes) followed by suffix into buf, all or nothing. */
static int path_put(char *buf, size_t len, const char *dir, size_t dirlen, const char *suffix)
{
    size_t slen = strlen(suffix);
    if (dirlen > SIZE_MAX - slen - 1 || dirlen + slen + 1 > len)
        return -ENAMETOOLONG;
    memcpy(buf, dir, dirlen);
    memcpy(buf + dirlen, suffix, slen + 1);
    return 0;
}

static const char *env_nonempty(const char *name)
{
    const char *v = getenv(name);
    return v != NULL && v[0] != '\0' ? v : NULL;
}

int pb_client_socket_path(char *buf, size_t len)
{
    const char *v;

    if (buf == NULL)
        return -EINVAL;
    if ((v = env_nonempty("PULLBACKD_SOCKET")) != NULL)
        return path_put(buf, len, v, strlen(v), "");
    if ((v = env_nonempty("RUNTIME_DIRECTORY")) != NULL) {
        /* systemd joins several RuntimeDirectory= entries with ':'. */
        const char *colon = strchr(v, ':');
        size_t n = colon != NULL ? (size_t)(colon - v) : strlen(v);
        if (n > 0)
            return path_put(buf, len, v, n, "/pullbackd.sock");
    }
    if ((v = env_nonempty("XDG_RUNTIME_DIR")) != NULL)
        return path_put(buf, len, v, strlen(v), "/pullbackd.sock");

    char tmp[64];
    int n = snprintf(tmp, sizeof tmp, "/tmp/pullbackd-%lu.sock", (unsigned long)getuid());
    if (n < 0 || (size_t)n >= sizeof tmp)
        return -ENAMETOOLONG;
    return path_put(buf, len, tmp, (size_t)n, "");
}

/* A blocking connect() interrupted by a signal goes on in the background;
 * wait for it and collect its result. */
static int connect_finish(int fd)
{
    for (;;) {
        struct pollfd pfd = { .fd = fd, .events = POLLOUT };
        if (poll(&pfd, 1, -1) < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        int err = 0;
        socklen_t elen = sizeof err;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) < 0)
            return -errno;
        return -err;
    }
}

int pb_client_connect(const char *path, pb_client_t **out)
{
    char def[sizeof(((struct sockaddr_un *)0)->sun_path)];
    struct sockaddr_un sa;
    int rc;

    if (out == NULL)
        return -EINVAL;
    if (path == NULL) {
        rc = pb_client_socket_path(def, sizeof def);
        if (rc < 0)
            return rc;
        path = def;
    }
    size_t plen = strlen(path);
    if (plen == 0)
        return -EINVAL;
    if (plen >= sizeof sa.sun_path)
        return -ENAMETOOLONG;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, path, plen + 1);

    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    if (connect(fd, (const struct sockaddr *)&sa, sizeof sa) < 0) {
        rc = errno == EINTR ? connect_finish(fd) : -errno;
        if (rc < 0) {
            close(fd);
            return rc;
        }
    }
    return pb_client_from_fd(fd, out);
}

int pb_client_from_fd(int fd, pb_client_t **out)
{
    if (fd < 0)
        return -EBADF;
    if (out == NULL) {
        close(fd);
        return -EINVAL;
    }
    pb_client_t *c = calloc(1, sizeof *c);
    if (c == NULL) {
        close(fd);
        return -ENOMEM;
    }
    c->small = c->rb = rbuf_new(CLIENT_READ_CHUNK);
    if (c->rb == NULL) {
        free(c);
        close(fd);
        return -ENOMEM;
    }
    c->fd = fd;
    c->next_msgid = 1;
    msgpack_sbuffer_init(&c->out);
    msgpack_packer_init(&c->pk, c, client_pack_write);
    *out = c;
    return 0;
}

void pb_client_close(pb_client_t *c)
{
    if (c == NULL)
        return;
    for (size_t i = 0; i < c->qlen; i++)
        pb_reply_free(&c->queue[i]);
    free(c->queue);
    if (c->rb != c->small)
        rbuf_put(c->rb);
    rbuf_put(c->small);
    for (int i = 0; i < c->nkeep; i++)
        rbuf_put(c->keep[i]);
    msgpack_sbuffer_destroy(&c->out);
    close(c->fd);
    free(c);
}

int pb_client_fd(const pb_client_t *c)
{
    return c != NULL ? c->fd : -EINVAL;
}

/* ---- Reading ----------------------------------------------------------- */

/* Scan the message at rpos as far as it has arrived: 1 with its length
 * when it is complete, 0 when more is needed (scan.need may say how much),
 * PB_EPARSE when it can never be a message. */
static int client_scan(pb_client_t *c, size_t *len)
{
    if (c->framed == 0) {
        int rc = pb_scan_feed(&c->scan, (const uint8_t *)c->rb->data + c->rpos, c->rend - c->rpos,
                              SIZE_MAX, &c->framed);
        if (rc <= 0)
            return rc;
    }
    *len = c->framed;
    return 1;
}

/* Make room for a read: rb holds the unframed bytes at rpos with room for
 * what the message there needs at least (so far as its scan knows), in a
 * buffer of its own when that is CLIENT_BIG or more.  Bytes that hold
 * complete messages already (read while sending) stay in the small buffer,
 * which then grows.  *stop: where the read must end. */
static int client_room(pb_client_t *c, size_t *stop)
{
    size_t have = c->rend - c->rpos;
    size_t len;
    bool partial = client_scan(c, &len) == 0;
    size_t need = partial && c->scan.need > have ? c->scan.need : have + 1;
    client_rbuf_t *rb = c->rb;

    if ((partial && need >= CLIENT_BIG) || rb != c->small) {
        if (rb == c->small || c->rpos + need > rb->cap) {
            size_t size = need + CLIENT_SLACK;
            if (rb == c->small) {
                c->first_need = need;
                size_t grown = client_grown(c, need);
                size = grown > size ? grown : size;
            }
            client_rbuf_t *nb = client_pool_take(c, size);
            if (nb == NULL)
                return -ENOMEM;
            memcpy(nb->data, rb->data + c->rpos, have);
            if (rb != c->small)
                rbuf_put(rb);
            c->rb = nb;
            c->rpos = 0;
            c->rend = have;
        }
        size_t end = c->rpos + need + CLIENT_SLACK;
        *stop = end < c->rb->cap ? end : c->rb->cap;
        return 0;
    }
    size_t want = have + CLIENT_READ_MIN > need ? have + CLIENT_READ_MIN : need;
    if (c->rpos + want > rb->cap) {
        /* Move the unframed bytes to the front: of this buffer when no
         * reply points into it and it is long enough, else of a new one. */
        size_t cap = rb->cap;
        while (cap < want)
            cap *= 2;
        if (cap == rb->cap && rbuf_alone(rb)) {
            memmove(rb->data, rb->data + c->rpos, have);
        } else {
            client_rbuf_t *nb = rbuf_new(cap);
            if (nb == NULL)
                return -ENOMEM;
            memcpy(nb->data, rb->data + c->rpos, have);
            rbuf_put(rb);
            c->small = c->rb = nb;
        }
        c->rpos = 0;
        c->rend = have;
    }
    *stop = c->rb->cap;
    return 0;
}

/* A big message has been framed in rb: what follows it goes back to the
 * small buffer (a new one when a reply still points into the old one).
 * Without memory for a new one, what follows stays in rb, which serves as
 * a big buffer does, and the move is tried again after the next message:
 * the message just framed is not lost for it. */
static void client_leave_big(pb_client_t *c, size_t len)
{
    size_t rest = c->rend - c->rpos;
    client_rbuf_t *s = c->small;

    if (c->first_need != 0) {
        client_grown_note(c, c->first_need, len + CLIENT_SLACK);
        c->first_need = 0;
    }
    if (!rbuf_alone(s) || rest > s->cap) {
        s = rbuf_new(rest > CLIENT_READ_CHUNK ? rest : CLIENT_READ_CHUNK);
        if (s == NULL)
            return;
        rbuf_put(c->small);
        c->small = s;
    }
    memcpy(s->data, c->rb->data + c->rpos, rest);
    rbuf_put(c->rb);
    c->rb = s;
    c->rpos = 0;
    c->rend = rest;
}

/* One recv() into the receive buffer.  1 when bytes came, 0 at end of
 * stream (eof is then set), -EAGAIN when nothing was there, or -errno. */
static int client_fill(pb_client_t *c)
{
    size_t stop;
    int rc = client_room(c, &stop);
    if (rc < 0)
        return rc;
    for (;;) {
        ssize_t r = recv(c->fd, c->rb->data + c->rend, stop - c->rend, MSG_DONTWAIT);
        if (r > 0) {
            c->rend += (size_t)r;
            return 1;
        }
        if (r == 0) {
            c->eof = true;
            return 0;
        }
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return -EAGAIN;
        if (errno == ECONNRESET) {
            c->eof = true;
            return 0;
        }
        return -errno;
    }
}

static const char *zone_strdup(msgpack_zone *z, const msgpack_object *o)
{
    const char *src = "";
    size_t n = 0;
    if (o != NULL && o->type == MSGPACK_OBJECT_STR) {
        src = o->via.str.ptr;
        n = o->via.str.size;
    }
    char *s = msgpack_zone_malloc(z, n + 1);
    if (s == NULL)
        return NULL;
    if (n > 0)
        memcpy(s, src, n);
    s[n] = '\0';
    return s;
}

/* Check that up holds a msgpack-RPC response and move it into out. */
static int reply_take(msgpack_unpacked *up, pb_reply_t *out)
{
    const msgpack_object *o = &up->data;

    if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size != 4)
        return -EPROTO;
    const msgpack_object *a = o->via.array.ptr;
    if (a[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER || a[0].via.u64 != 1)
        return -EPROTO;
    if (a[1].type != MSGPACK_OBJECT_POSITIVE_INTEGER || a[1].via.u64 > UINT32_MAX)
        return -EPROTO;
    bool has_err = a[2].type != MSGPACK_OBJECT_NIL;
    bool has_res = a[3].type != MSGPACK_OBJECT_NIL;
    if (has_err == has_res)
        return -EPROTO;

    pb_reply_t r = { 0 };
    r.msgid = (uint32_t)a[1].via.u64;
    if (has_err) {
        r.error = &a[2];
        r.code_ = zone_strdup(up->zone, pb_obj_get(r.error, "code"));
        r.message_ = zone_strdup(up->zone, pb_obj_get(r.error, "message"));
        if (r.code_ == NULL || r.message_ == NULL)
            return -ENOMEM;
    } else {
        r.result = &a[3];
    }
    r.up = *up;
    msgpack_unpacked_init(up);
    *out = r;
    return 0;
}

/* Frame one message from what has been read.  1 with *out filled, 0 when
 * more bytes are needed, or a negative code.  With leave_bad, a message
 * that is no reply is left unread (0) for a later receive to report.
 * -ENOMEM leaves the message unread too. */
static int client_parse(pb_client_t *c, pb_reply_t *out, bool leave_bad)
{
    msgpack_unpacked up;
    pb_reply_t r;
    size_t len, off = 0;

    if (c->broken < 0)
        return c->broken;
    int rc = client_scan(c, &len);
    if (rc == 0)
        return 0;
    if (rc < 0) {
        c->broken = -EPROTO;
        return -EPROTO;
    }
    msgpack_unpacked_init(&up);
    switch (msgpack_unpack_next(&up, c->rb->data + c->rpos, len, &off)) {
    case MSGPACK_UNPACK_SUCCESS:
        rc = reply_take(&up, &r);
        break;
    case MSGPACK_UNPACK_NOMEM_ERROR:
        rc = -ENOMEM;
        break;
    default:
        c->broken = rc = -EPROTO;
        break;
    }
    msgpack_unpacked_destroy(&up);
    if (rc == -ENOMEM || c->broken < 0)
        return rc;
    if (rc < 0 && leave_bad)
        return 0;
    /* The reply's payloads point into rb: its zone keeps rb alive. */
    if (rc == 0) {
        if (!msgpack_zone_push_finalizer(r.up.zone, rbuf_release, c->rb)) {
            pb_reply_free(&r);
            return -ENOMEM;
        }
        rbuf_get(c->rb);
    }
    /* The message is framed, so the stream stays in step even when it is
     * not a response. */
    c->rpos += len;
    c->framed = 0;
    pb_scan_reset(&c->scan);
    if (c->rb != c->small)
        client_leave_big(c, len);
    if (rc < 0)
        return rc;
    *out = r;
    return 1;
}

/* The next reply from the socket (not the queue).  timeout_ms < 0 waits
 * forever. */
static int client_read_reply(pb_client_t *c, pb_reply_t *out, int timeout_ms)
{
    struct timespec deadline;

    if (timeout_ms >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += timeout_ms / 1000;
        deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    for (;;) {
        int rc = client_parse(c, out, false);
        if (rc != 0)
            return rc < 0 ? rc : 0;
        if (c->eof)
            return -EPIPE;

        struct pollfd pfd = { .fd = c->fd, .events = POLLIN };
        int wait = timeout_ms < 0 ? -1 : ms_left(&deadline);
        int n = poll(&pfd, 1, wait);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (n == 0)
            return -ETIMEDOUT;
        if (pfd.revents & POLLNVAL)
            return -EBADF;
        rc = client_fill(c);
        if (rc < 0 && rc != -EAGAIN)
            return rc;
    }
}

/* Room for one more queued reply, made before a reply that may be queued
 * is read: one read and then dropped for want of a slot would leave its
 * caller waiting for it forever. */
static int queue_reserve(pb_client_t *c)
{
    if (c->qlen < c->qcap)
        return 0;
    size_t ncap = c->qcap ? c->qcap * 2 : 8;
    pb_reply_t *q = realloc(c->queue, ncap * sizeof *q);
    if (q == NULL)
        return -ENOMEM;
    c->queue = q;
    c->qcap = ncap;
    return 0;
}

/* After queue_reserve. */
static void queue_push(pb_client_t *c, const pb_reply_t *r)
{
    c->queue[c->qlen++] = *r;
}

static void queue_take(pb_client_t *c, size_t i, pb_reply_t *out)
{
    *out = c->queue[i];
    memmove(&c->queue[i], &c->queue[i + 1], (c->qlen - i - 1) * sizeof *c->queue);
    c->qlen--;
}

int pb_client_recv_timeout(pb_client_t *c, pb_reply_t *out, int timeout_ms)
{
    if (c == NULL || out == NULL)
        return -EINVAL;
    if (c->torn)
        return -EIO;
    if (c->qlen > 0) {
        queue_take(c, 0, out);
        return 0;
    }
    return client_read_reply(c, out, timeout_ms);
}

int pb_client_recv(pb_client_t *c, pb_reply_t *out)
{
    return pb_client_recv_timeout(c, out, -1);
}

/* Frame the replies that lie complete in what has been read and queue
 * them: 0, or -ENOMEM, or -EPROTO when the stream is lost.  A message that
 * is no reply stops it, left in place for the receive that reaches it to
 * report. */
static int client_queue_framed(pb_client_t *c)
{
    for (;;) {
        pb_reply_t r;
        int rc = queue_reserve(c);
        if (rc == 0)
            rc = client_parse(c, &r, true);
        if (rc <= 0)
            return rc;
        queue_push(c, &r);
    }
}

bool pb_client_pending(pb_client_t *c)
{
    if (c == NULL || c->torn)
        return false;
    if (c->qlen == 0)
        client_queue_framed(c);
    return c->qlen > 0;
}

/* The daemon closed the connection (EOF, or a write that met EPIPE): an
 * error it sent under msgid 0 before closing (a parse_error, the
 * resource_exhausted of a connection past max_connections_per_uid) is the
 * answer to what the caller waits for, not "Broken pipe".  Reads what is
 * left in the socket first. */
static int closed_reply(pb_client_t *c, pb_reply_t *out)
{
    pb_reply_t r;
    while (queue_reserve(c) == 0 && client_read_reply(c, &r, 0) == 0)
        queue_push(c, &r);
    for (size_t i = 0; i < c->qlen; i++)
        if (c->queue[i].msgid == 0 && c->queue[i].error != NULL) {
            queue_take(c, i, out);
            return 0;
        }
    return -EPIPE;
}

int pb_client_wait(pb_client_t *c, uint32_t msgid, pb_reply_t *out)
{
    if (c == NULL || out == NULL)
        return -EINVAL;
    if (c->torn)
        return -EIO;
    for (size_t i = 0; i < c->qlen; i++) {
        if (c->queue[i].msgid == msgid) {
            queue_take(c, i, out);
            return 0;
        }
    }
    for (;;) {
        pb_reply_t r;
        int rc = queue_reserve(c);
        if (rc == 0)
            rc = client_read_reply(c, &r, -1);
        if (rc == -EPIPE)
            return closed_reply(c, out);
        if (rc < 0)
            return rc;
        if (r.msgid == msgid) {
            *out = r;
            return 0;
        }
        queue_push(c, &r);
    }
}

void pb_reply_free(pb_reply_t *r)
{
    if (r == NULL)
        return;
    msgpack_unpacked_destroy(&r->up);
    memset(r, 0, sizeof *r);
}

const char *pb_reply_code(const pb_reply_t *r)
{
    return r != NULL && r->error != NULL ? r->code_ : NULL;
}

const char *pb_reply_message(const pb_reply_t *r)
{
    return r != NULL && r->error != NULL ? r->message_ : NULL;
}

/* ---- Writing ----------------------------------------------------------- */

/* One sendmsg of iov[0, n); fd >= 0 rides along as SCM_RIGHTS. */
static ssize_t send_iov(int sock, struct iovec *iov, int n, int fd)
{
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct msghdr msg = { 0 };

    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)n;
    if (fd >= 0) {
        memset(&ctl, 0, sizeof ctl);
        msg.msg_control = ctl.buf;
        msg.msg_controllen = sizeof ctl.buf;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    }
    return sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* Write all bytes of iov[0, niov), reading replies that arrive meanwhile:
 * 0, or a negative code with *wrote telling whether any byte went out.
 * pass_fd >= 0 rides on the first bytes written.  iov is consumed.
 *
 * The reading is what keeps a daemon that is blocked on writing its
 * replies reading our bytes, so when it fails (no memory for a reply, bytes
 * that are not msgpack) the write stops too rather than wait on a daemon
 * that may never read again.  An end of stream does not stop it: the
 * daemon is gone, and the write meets EPIPE. */
static int client_writev_some(pb_client_t *c, struct iovec *iov, int niov, int pass_fd, bool *wrote)
{
    while (niov > 0 && iov[0].iov_len == 0)
        iov++, niov--;
    while (niov > 0) {
        struct pollfd pfd = { .fd = c->fd, .events = POLLOUT };
        if (!c->eof)
            pfd.events |= POLLIN;
        if (poll(&pfd, 1, -1) < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (pfd.revents & POLLNVAL)
            return -EBADF;
        if (pfd.revents & POLLIN) {
            /* Framed as they come, so that the buffers stay sized per
             * message. */
            int rc = client_fill(c);
            if (rc == 1)
                rc = client_queue_framed(c);
            if (rc < 0 && rc != -EAGAIN)
                return rc;
        }
        if (pfd.revents & (POLLOUT | POLLERR | POLLHUP)) {
            ssize_t w = send_iov(c->fd, iov, niov, pass_fd);
            if (w < 0) {
                if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
                    continue;
                return errno == ECONNRESET ? -EPIPE : -errno;
            }
            *wrote = true;
            pass_fd = -1;
            size_t left = (size_t)w;
            while (niov > 0 && left >= iov[0].iov_len) {
                left -= iov[0].iov_len;
                iov++, niov--;
            }
            if (niov > 0) {
                iov[0].iov_base = (char *)iov[0].iov_base + left;
                iov[0].iov_len -= left;
            }
        }
    }
    return 0;
}

/* client_writev_some, for one whole message.  A failure before its first
 * byte leaves the stream as it was.  One after tears the connection, but
 * for -EPIPE: the daemon is gone, nothing can follow the part it got, and
 * what it sent before stays readable.  A stream the client can no longer
 * read is not written to either (nothing would read the replies). */
static int client_writev(pb_client_t *c, struct iovec *iov, int niov, int pass_fd)
{
    bool wrote = false;

    if (c->torn)
        return -EIO;
    if (c->broken < 0)
        return c->broken;
    int rc = client_writev_some(c, iov, niov, pass_fd, &wrote);
    if (rc < 0 && rc != -EPIPE && wrote) {
        c->torn = true;
        return -EIO;
    }
    return rc;
}

static int client_write(pb_client_t *c, const char *p, size_t n, int pass_fd)
{
    struct iovec iov = { .iov_base = (void *)p, .iov_len = n };
    return client_writev(c, &iov, 1, pass_fd);
}

/* The message: out's bytes with the in-place payloads between them. */
static int client_write_message(pb_client_t *c, int pass_fd)
{
    struct iovec iov[2 * CLIENT_MAXSEG + 1];
    int n = 0;
    size_t from = 0;
    for (int i = 0; i < c->nseg; i++) {
        iov[n++] = (struct iovec){ .iov_base = c->out.data + from, .iov_len = c->seg[i].at - from };
        iov[n++] = (struct iovec){ .iov_base = (void *)c->seg[i].p, .iov_len = c->seg[i].len };
        from = c->seg[i].at;
    }
    iov[n++] = (struct iovec){ .iov_base = c->out.data + from, .iov_len = c->out.size - from };
    return client_writev(c, iov, n, pass_fd);
}

static msgpack_packer *client_begin(pb_client_t *c, const char *method, int kind)
{
    if (c == NULL || method == NULL)
        return NULL;
    client_discard(c);
    if (kind == BEGUN_REQUEST) {
        c->begun_msgid = c->next_msgid++;
        if (c->next_msgid == 0)
            c->next_msgid = 1;
        msgpack_pack_array(&c->pk, 4);
        msgpack_pack_int(&c->pk, 0);
        msgpack_pack_uint32(&c->pk, c->begun_msgid);
    } else {
        msgpack_pack_array(&c->pk, 3);
        msgpack_pack_int(&c->pk, 2);
    }
    pb_pack_str(&c->pk, method);
    msgpack_pack_array(&c->pk, 1);
    c->params_off = c->out.size;
    c->begun = kind;
    return &c->pk;
}

msgpack_packer *pb_client_begin(pb_client_t *c, const char *method)
{
    return client_begin(c, method, BEGUN_REQUEST);
}

msgpack_packer *pb_client_begin_notify(pb_client_t *c, const char *method)
{
    return client_begin(c, method, BEGUN_NOTIFY);
}

/* The params as the check below reads them: out's bytes from params_off,
 * each in-place payload's bin32 header rewritten as an empty bin8 (the
 * payload is not there).  Returns the bytes to read (data or *copy). */
static const char *client_params_view(pb_client_t *c, size_t *len, char **copy)
{
    *copy = NULL;
    *len = c->out.size - c->params_off;
    if (c->nseg == 0)
        return c->out.data + c->params_off;
    char *v = malloc(*len);
    if (v == NULL)
        return NULL;
    size_t from = c->params_off, n = 0;
    for (int i = 0; i < c->nseg; i++) {
        size_t hdr = c->seg[i].at - 5; /* msgpack_pack_bin wrote 0xc6 + 4 bytes */
        memcpy(v + n, c->out.data + from, hdr - from);
        n += hdr - from;
        v[n++] = (char)0xc4;
        v[n++] = 0;
        from = c->seg[i].at;
    }
    memcpy(v + n, c->out.data + from, c->out.size - from);
    *len = n + (c->out.size - from);
    *copy = v;
    return v;
}

/* The caller must have packed exactly one complete map after the header. */
static int client_check_params(pb_client_t *c)
{
    msgpack_unpacked up;
    size_t off = 0;
    size_t len;
    char *copy;
    int rc;

    if (c->pack_err != 0)
        return c->pack_err;
    const char *params = client_params_view(c, &len, &copy);
    if (params == NULL)
        return -ENOMEM;
    if (len == 0) {
        free(copy);
        return -EINVAL;
    }
    msgpack_unpacked_init(&up);
    switch (msgpack_unpack_next(&up, params, len, &off)) {
    case MSGPACK_UNPACK_SUCCESS:
        rc = up.data.type == MSGPACK_OBJECT_MAP && off == len ? 0 : -EINVAL;
        break;
    case MSGPACK_UNPACK_NOMEM_ERROR:
        rc = -ENOMEM;
        break;
    default:
        rc = -EINVAL;
        break;
    }
    msgpack_unpacked_destroy(&up);
    free(copy);
    return rc;
}

static int client_send(pb_client_t *c, int kind, int pass_fd, uint32_t *msgid_out)
{
    if (c == NULL)
        return -EINVAL;
    if (c->begun != kind) {
        client_discard(c);
        return -EINVAL;
    }
    int rc = client_check_params(c);
    if (rc == 0)
        rc = client_write_message(c, pass_fd);
    uint32_t id = c->begun_msgid;
    client_discard(c);
    if (rc == 0 && msgid_out != NULL)
        *msgid_out = id;
    return rc;
}

int pb_client_send(pb_client_t *c, uint32_t *msgid_out)
{
    return client_send(c, BEGUN_REQUEST, -1, msgid_out);
}

int pb_client_send_with_fd(pb_client_t *c, int fd, uint32_t *msgid_out)
{
    if (fd < 0) {
        /* Refused like any failing send: the request goes too. */
        if (c != NULL)
            client_discard(c);
        return -EBADF;
    }
    return client_send(c, BEGUN_REQUEST, fd, msgid_out);
}

int pb_client_send_notify(pb_client_t *c)
{
    return client_send(c, BEGUN_NOTIFY, -1, NULL);
}

int pb_client_send_raw(pb_client_t *c, const void *buf, size_t len)
{
    if (c == NULL || (buf == NULL && len > 0))
        return -EINVAL;
    return client_write(c, buf, len, -1);
}

int pb_client_call(pb_client_t *c, pb_reply_t *out)
{
    uint32_t id;

    if (c == NULL || out == NULL)
        return -EINVAL;
    int rc = pb_client_send(c, &id);
    if (rc == -EPIPE)
        return closed_reply(c, out);
    if (rc < 0)
        return rc;
    return pb_client_wait(c, id, out);
}

/* ---- Objects ----------------------------------------------------------- */

static const msgpack_object *obj_get_n(const msgpack_object *map, const char *key, size_t klen)
{
    if (map == NULL || map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == klen &&
            (klen == 0 || memcmp(k->via.str.ptr, key, klen) == 0))
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

const msgpack_object *pb_obj_get(const msgpack_object *map, const char *key)
{
    if (key == NULL)
        return NULL;
    return obj_get_n(map, key, strlen(key));
}

/* A segment of decimal digits as an index; false if it is not one. */
static bool parse_index(const char *s, size_t n, uint32_t *out)
{
    uint64_t v = 0;
    if (n == 0)
        return false;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return false;
        v = v * 10 + (uint64_t)(s[i] - '0');
        if (v > UINT32_MAX)
            return false;
    }
    *out = (uint32_t)v;
    return true;
}

const msgpack_object *pb_obj_path(const msgpack_object *root, const char *dotted)
{
    const msgpack_object *cur = root;

    if (root == NULL || dotted == NULL)
        return NULL;
    if (dotted[0] == '\0')
        return root;
    const char *seg = dotted;
    for (;;) {
        const char *dot = strchr(seg, '.');
        size_t n = dot != NULL ? (size_t)(dot - seg) : strlen(seg);
        uint32_t idx;
        if (cur->type == MSGPACK_OBJECT_MAP)
            cur = obj_get_n(cur, seg, n);
        else if (cur->type == MSGPACK_OBJECT_ARRAY && parse_index(seg, n, &idx))
            cur = idx < cur->via.array.size ? &cur->via.array.ptr[idx] : NULL;
        else
            cur = NULL;
        if (cur == NULL || dot == NULL)
            return cur;
        seg = dot + 1;
    }
}

int pb_obj_int(const msgpack_object *o, int64_t *out)
{
    if (o == NULL || out == NULL)
        return -EINVAL;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > INT64_MAX)
            return -ERANGE;
        *out = (int64_t)o->via.u64;
        return 0;
    }
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *out = o->via.i64;
        return 0;
    }
    return -EINVAL;
}

int pb_obj_uint(const msgpack_object *o, uint64_t *out)
{
    if (o == NULL || out == NULL)
        return -EINVAL;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        *out = o->via.u64;
        return 0;
    }
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return -ERANGE;
    return -EINVAL;
}

int pb_obj_double(const msgpack_object *o, double *out)
{
    if (o == NULL || out == NULL)
        return -EINVAL;
    switch (o->type) {
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        *out = o->via.f64;
        return 0;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        *out = (double)o->via.u64;
        return 0;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        *out = (double)o->via.i64;
        return 0;
    default:
        return -EINVAL;
    }
}

int pb_obj_bool(const msgpack_object *o, bool *out)
{
    if (o == NULL || out == NULL || o->type != MSGPACK_OBJECT_BOOLEAN)
        return -EINVAL;
    *out = o->via.boolean;
    return 0;
}

int pb_obj_strcmp(const msgpack_object *o, const char *s)
{
    if (o == NULL || s == NULL || o->type != MSGPACK_OBJECT_STR)
        return -1;
    size_t n = strlen(s);
    size_t m = o->via.str.size;
    size_t k = m < n ? m : n;
    /* msgpack-c unpacks "" with a NULL ptr, which memcmp may not see. */
    int r = k > 0 ? memcmp(o->via.str.ptr, s, k) : 0;
    if (r != 0)
        return r;
    return m < n ? -1 : m > n ? 1 : 0;
}

/* ---- Tensors ----------------------------------------------------------- */

static const struct {
    const char *name;
    size_t itemsize;
    size_t width;      /* bytes of one real component */
} dtypes[] = {
    { "f32", 4, 4 },
    { "f64", 8, 8 },
    { "c64", 8, 4 },
    { "c128", 16, 8 },
};
#define NDTYPES (sizeof dtypes / sizeof dtypes[0])

static int dtype_find(const char *s, size_t n)
{
    for (size_t i = 0; i < NDTYPES; i++)
        if (strlen(dtypes[i].name) == n && memcmp(dtypes[i].name, s, n) == 0)
            return (int)i;
    return -1;
}

size_t pb_ctensor_itemsize(const char *dtype)
{
    int i = dtype != NULL ? dtype_find(dtype, strlen(dtype)) : -1;
    return i < 0 ? 0 : dtypes[i].itemsize;
}

size_t pb_ctensor_count(const pb_ctensor_t *t)
{
    if (t == NULL || t->rank < 0 || t->rank > PB_CTENSOR_MAX_RANK)
        return SIZE_MAX;
    size_t n = 1;
    for (int i = 0; i < t->rank; i++) {
        if (t->shape[i] > SIZE_MAX)
            return SIZE_MAX;
        size_t d = (size_t)t->shape[i];
        if (d != 0 && n > (SIZE_MAX - 1) / d)
            return SIZE_MAX;
        n *= d;
    }
    return n;
}

/* msgpack's str32 and bin32 hold lengths below 2^32, and msgpack-c would
 * cut a longer one to 32 bits and still write every byte after it.  Such a
 * payload makes a client's request fail at send (pack_err, which also stops
 * all that would follow); another packer gets nil in its place, so that the
 * object around it stays whole. */
static bool pack_len_ok(msgpack_packer *pk, size_t n)
{
    if ((uint64_t)n <= UINT32_MAX)
        return true;
    if (pk->callback == client_pack_write) {
        pb_client_t *c = pk->data;
        if (c->pack_err == 0)
            c->pack_err = -EMSGSIZE;
    }
    msgpack_pack_nil(pk);
    return false;
}

void pb_pack_str(msgpack_packer *pk, const char *s)
{
    if (pk == NULL) /* what pb_client_begin() gives for a NULL client */
        return;
    if (s == NULL) {
        msgpack_pack_nil(pk);
        return;
    }
    size_t n = strlen(s);
    if (!pack_len_ok(pk, n))
        return;
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

void pb_pack_kv_str(msgpack_packer *pk, const char *key, const char *val)
{
    pb_pack_str(pk, key);
    pb_pack_str(pk, val);
}

void pb_pack_into(msgpack_packer *pk, const pb_into_t *into, size_t n)
{
    if (pk == NULL)
        return;
    pb_pack_str(pk, "into");
    msgpack_pack_map(pk, into ? n : 0);
    for (size_t i = 0; into && i < n; i++) {
        pb_pack_str(pk, into[i].name);
        msgpack_pack_map(pk, 2);
        pb_pack_str(pk, "buffer");
        msgpack_pack_uint64(pk, into[i].buffer);
        pb_pack_str(pk, "offset");
        msgpack_pack_uint64(pk, into[i].offset);
    }
}

/* A big payload packed into a client's message is sent from the caller's
 * memory (client_write_message) rather than copied: note where it goes. */
static bool client_defer(msgpack_packer *pk, const void *p, size_t n)
{
    if (n < CLIENT_INPLACE || pk->callback != client_pack_write)
        return false;
    pb_client_t *c = pk->data;
    if (c->nseg == CLIENT_MAXSEG || c->pack_err != 0 || c->begun == BEGUN_NONE)
        return false;
    c->seg[c->nseg++] = (struct client_seg){ c->out.size, p, n };
    return true;
}

void pb_pack_tensor(msgpack_packer *pk, const pb_ctensor_t *t)
{
    if (pk == NULL)
        return;
    if (t == NULL) {
        msgpack_pack_nil(pk);
        return;
    }
    int rank = t->rank < 0 ? 0 : t->rank > PB_CTENSOR_MAX_RANK ? PB_CTENSOR_MAX_RANK : t->rank;
    bool has_order = t->order == 'C' || t->order == 'F';

    msgpack_pack_map(pk, (t->shm ? 4 : 3) + (has_order ? 1 : 0));
    pb_pack_kv_str(pk, "dtype", t->dtype);
    pb_pack_str(pk, "shape");
    msgpack_pack_array(pk, (size_t)rank);
    for (int i = 0; i < rank; i++)
        msgpack_pack_uint64(pk, t->shape[i]);
    if (has_order)
        pb_pack_kv_str(pk, "order", t->order == 'F' ? "F" : "C");
    if (t->shm) {
        pb_pack_str(pk, "buffer");
        msgpack_pack_uint64(pk, t->buffer);
        pb_pack_str(pk, "offset");
        msgpack_pack_uint64(pk, t->offset);
    } else {
        /* NULL data packs an empty bin whatever nbytes says. */
        size_t n = t->data != NULL ? t->nbytes : 0;
        pb_pack_str(pk, "data");
        if (!pack_len_ok(pk, n))
            return;
        msgpack_pack_bin(pk, n);
        if (n > 0 && !client_defer(pk, t->data, n))
            msgpack_pack_bin_body(pk, t->data, n);
    }
}

int pb_obj_tensor(const msgpack_object *o, pb_ctensor_t *out)
{
    pb_ctensor_t t;

    if (o == NULL || out == NULL || o->type != MSGPACK_OBJECT_MAP)
        return -EINVAL;
    memset(&t, 0, sizeof t);

    const msgpack_object *dt = pb_obj_get(o, "dtype");
    if (dt == NULL || dt->type != MSGPACK_OBJECT_STR)
        return -EINVAL;
    int di = dtype_find(dt->via.str.ptr, dt->via.str.size);
    if (di < 0)
        return -EINVAL;
    t.dtype = dtypes[di].name;

    const msgpack_object *sh = pb_obj_get(o, "shape");
    if (sh == NULL || sh->type != MSGPACK_OBJECT_ARRAY || sh->via.array.size > PB_CTENSOR_MAX_RANK)
        return -EINVAL;
    t.rank = (int)sh->via.array.size;
    for (int i = 0; i < t.rank; i++) {
        if (pb_obj_uint(&sh->via.array.ptr[i], &t.shape[i]) < 0)
            return -EINVAL;
    }

    const msgpack_object *ord = pb_obj_get(o, "order");
    if (ord == NULL)
        t.order = 'C';
    else if (pb_obj_strcmp(ord, "C") == 0)
        t.order = 'C';
    else if (pb_obj_strcmp(ord, "F") == 0)
        t.order = 'F';
    else
        return -EINVAL;

    size_t count = pb_ctensor_count(&t);
    if (count == SIZE_MAX || (count != 0 && count > SIZE_MAX / dtypes[di].itemsize))
        return -EINVAL;
    size_t nbytes = count * dtypes[di].itemsize;

    const msgpack_object *data = pb_obj_get(o, "data");
    if (data != NULL) {
        /* PROTOCOL section 2 takes a str as the same raw bytes: clients on
         * the old msgpack spec have no bin. */
        if (data->type == MSGPACK_OBJECT_BIN && data->via.bin.size == nbytes)
            t.data = data->via.bin.ptr;
        else if (data->type == MSGPACK_OBJECT_STR && data->via.str.size == nbytes)
            t.data = data->via.str.ptr;
        else
            return -EINVAL;
    } else {
        if (pb_obj_uint(pb_obj_get(o, "buffer"), &t.buffer) < 0 ||
            pb_obj_uint(pb_obj_get(o, "offset"), &t.offset) < 0)
            return -EINVAL;
        t.shm = true;
    }
    t.nbytes = nbytes;
    *out = t;
    return 0;
}

/* Decode one little-endian component of width 4 or 8 bytes. */
static double load_le(const unsigned char *p, size_t width)
{
    if (width == 4) {
        uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                     (uint32_t)p[3] << 24;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    uint64_t u = 0;
    for (int i = 7; i >= 0; i--)
        u = u << 8 | p[i];
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

/* Validate t for copying into an array of n components of out_width bytes:
 * the component width of t's dtype in *width and the count in *slots. */
static int copy_check(const pb_ctensor_t *t, size_t n, size_t *width, size_t *slots)
{
    if (t == NULL || t->shm || t->dtype == NULL)
        return -EINVAL;
    int di = dtype_find(t->dtype, strlen(t->dtype));
    if (di < 0)
        return -EINVAL;
    size_t count = pb_ctensor_count(t);
    size_t per = dtypes[di].itemsize / dtypes[di].width;
    if (count == SIZE_MAX || (count != 0 && count > SIZE_MAX / dtypes[di].itemsize))
        return -EINVAL;
    if (t->nbytes < count * dtypes[di].itemsize || (count > 0 && t->data == NULL))
        return -EINVAL;
    if (n < count * per)
        return -ENOBUFS;
    *width = dtypes[di].width;
    *slots = count * per;
    return 0;
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define HOST_LE 1
#else
#define HOST_LE 0
#endif

/* t's components into out, n slots of out_width bytes (4: float, 8:
 * double), converted where t's width differs.  out_width is the same for
 * the whole loop, so the compiler hoists the test out of it. */
static int copy_out(const pb_ctensor_t *t, void *out, size_t n, size_t out_width)
{
    size_t width, slots;
    int rc = copy_check(t, n, &width, &slots);
    if (rc < 0)
        return rc;
    if (out == NULL && slots > 0)
        return -EINVAL;
    if (HOST_LE && width == out_width) {
        if (slots > 0)
            memcpy(out, t->data, slots * out_width);
        return 0;
    }
    for (size_t i = 0; i < slots; i++) {
        double v = load_le((const unsigned char *)t->data + i * width, width);
        if (out_width == sizeof(float))
            ((float *)out)[i] = (float)v;
        else
            ((double *)out)[i] = v;
    }
    return 0;
}

int pb_ctensor_copy_f64(const pb_ctensor_t *t, double *out, size_t n)
{
    return copy_out(t, out, n, sizeof(double));
}

int pb_ctensor_copy_f32(const pb_ctensor_t *t, float *out, size_t n)
{
    return copy_out(t, out, n, sizeof(float));
}
