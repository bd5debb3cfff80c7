/* Connections: accepting clients, reading and framing their messages,
 * passed fds, back-pressure, batched replies.
 *
 * This layer knows nothing of methods or of the server above it.  The
 * server hands the connection set its callbacks (libuv's way: the lower
 * layer never names its caller): each framed message goes to on_message,
 * a closing connection to on_close, and on_idle hears whenever something
 * finished (a connection closed, a write completed) so that a stopping
 * server can check whether it is done.
 *
 * Glossary
 *   connection  one accepted client socket (pb_conn_t): its read buffer
 *               and framing state, its identity (SO_PEERCRED), the tapes
 *               it created, its requests in flight.
 *   in flight   a message handed to on_message whose request has not
 *               called pb_conn_request_done; a request past
 *               max_inflight_per_connection is refused (rpc.c).
 *   queued      reply bytes handed to the socket and not yet written
 *               (pending_write): the client has not read them.
 *   reserved    bytes the requests in flight hold or will queue: each
 *               request's message, and the size of its reply as soon as
 *               it is known (pb_conn_reserve).  Past
 *               max_queued_bytes_per_connection of queued + reserved
 *               bytes the connection stops reading, so a client that
 *               never reads costs about that much, whatever its in-flight
 *               limit; one request is always let in, however large.
 *   held        what a connection costs in memory now: its read buffer
 *               (allocated size), its reserved bytes, its queued replies
 *               (written or batched).  The set keeps the sum over all
 *               connections and per uid (conn_budget.c).
 *   starved     a connection whose read buffer may not grow because the
 *               set's held bytes are at max_buffered_bytes (or its uid's
 *               at max_buffered_bytes_per_uid): reading stops until
 *               memory is given back.  Smaller messages, on connections
 *               whose buffer has room, are still read; a connection whose
 *               replies (queued, or of requests in flight) make its share
 *               of a cap that is reached (the cap over the connections it
 *               counts among) takes no new message, so replies nobody
 *               reads cannot take the held bytes far past it.  Memory
 *               comes back when a request in flight ends, an unmapping
 *               ends, or a connection still moving (reading a big message
 *               into the room it has, having its replies read) finishes.
 *               When none of those is left (nothing in flight, no
 *               connection moving PB_CONN_STALL_BYTES a PB_CONN_STALL_MS),
 *               the connection holding the most (an incomplete message, or
 *               replies its client does not read) is answered
 *               resource_exhausted, naming the limit, and closed (at once,
 *               without the answer, when it holds replies: the answer
 *               would wait behind them).
 *   late        a message read after SIGTERM's drain budget (drain_left,
 *               set by pb_conns_stop) ran out: on_message answers it
 *               shutting_down.
 *   last read   the end of a SIGTERM drain: the socket is shut for
 *               reading (the client's later writes fail with EPIPE), the
 *               bytes already in it are read and each request there is
 *               answered shutting_down, then the connection closes.
 *   passed fd   a file descriptor the client sent as SCM_RIGHTS ancillary
 *               data (register_buffer's memfd).  It belongs to the last
 *               message that begins in the bytes read together with it:
 *               the request whose sendmsg carried it, when a client sends
 *               one request per sendmsg as ours do.  Until that message
 *               is complete it waits in fds[] (at most PB_CONN_MAX_FDS;
 *               more are closed); the fds a message's handler did not
 *               take (pb_conn_take_fd) are closed after it.
 *   buffers     the shared-memory buffers this connection registered
 *               (buffer.h): its own, unusable from any other connection,
 *               dropped when it closes.
 *   log lines   what a client's messages make the daemon log (a bad
 *               notification, a refused drain, a dropped fd) goes through
 *               pb_conn_log: PB_CONN_LOG_BURST lines a minute per
 *               connection; past that lines are counted, and the count is
 *               logged with the next minute's first line and at close.
 *               Debug lines (one per failed request, asked for) are not
 *               limited.
 *
 * Ownership: the connection set (pb_conns_t, embedded in the server) owns
 * its connections; conn.c allocates each one at accept and frees it when
 * its handle's close callback has run and no reference is left (refs
 * counts the handle, each write and each holder of pb_conn_ref: a request
 * in flight).  Replies sent to a closed connection are dropped.  A
 * connection owns the passed fds it holds (closed when it closes), its
 * buffer table (whose references it drops when it closes; requests in
 * flight keep their mappings until they end), and its read buffer and
 * reply batch.  Its tape list belongs to the tape lifecycle (tape.h): the
 * connection only carries it, and on_close must empty it.  Only conn.c
 * writes the other fields; the layers above use the functions below.
 * Everything here runs on the loop thread. */
#ifndef PB_CONN_H
#define PB_CONN_H

#include <msgpack.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "../proto/codec.h"
#include "../proto/wire.h"
#include "buffer.h"
#include "config.h"
#include "tape.h"

/* A connection given a file descriptor this close to the limit makes the
 * set warn that the next ones will be reset (glossary of pb_conns_t). */
#define PB_CONNS_FD_MARGIN 32
#define PB_CONNS_FD_WARN_MS 10000
/* Passed fds a connection holds for messages not yet complete. */
#define PB_CONN_MAX_FDS 16
/* Lines one connection may have logged a minute (glossary: log lines). */
#define PB_CONN_LOG_BURST 3
#define PB_CONN_LOG_WINDOW_MS 60000
/* A connection that read and had read of its replies less than
 * PB_CONN_STALL_BYTES in PB_CONN_STALL_MS is not going to give the
 * buffering caps anything back soon by itself (glossary: starved): a
 * client trickling its message cannot hold the others off. */
#define PB_CONN_STALL_MS 1000
#define PB_CONN_STALL_BYTES ((uint64_t)1 << 20)

typedef struct pb_conn pb_conn_t;

/* What the layer above hears.  data is the set's cb_data. */
typedef struct pb_conn_cbs {
    /* One framed message, held in msg (take a reference to keep it). */
    void (*on_message)(pb_conn_t *c, pb_storage_t *msg, bool late, void *data);
    /* c is closing: drop what refers to it (its tapes). */
    void (*on_close)(pb_conn_t *c, void *data);
    /* A connection closed or a write completed. */
    void (*on_idle)(void *data);
    void *data;
} pb_conn_cbs_t;

/* What one uid's connections hold (conn_budget.c). */
typedef struct pb_uid_use {
    uid_t uid;
    size_t open;    /* connections not closed: against max_connections_per_uid */
    size_t members; /* connections not freed: the entry lives while any is */
    size_t held;
    size_t inflight; /* its requests in flight, closed connections' too */
    size_t gone;     /* within one reclaim pass: held bytes of the connections it closed */
} pb_uid_use_t;

/* The server's connections. */
typedef struct pb_conns {
    uv_loop_t *loop;
    const pb_config_t *cfg;        /* the server's, changed in place by a reload */
    pb_conn_cbs_t cb;
    pb_conn_t *head;               /* open connections */
    pb_conn_t *dirty;              /* those with replies to flush */
    size_t count;
    size_t held;                   /* the connections' held bytes summed */
    size_t nstarved;               /* connections starved now */
    uint64_t moved;                /* bytes moved between or within read
                                    * buffers: a buffer grown under a message
                                    * being read (alloc_cb), what a read took
                                    * past a big message (take_message) */
    size_t inflight;               /* requests in flight, closed connections' too */
    uv_idle_t decide;              /* started when the starved must decide again
                                    * (conn_budget.c); closed by pb_conns_destroy */
    uint64_t over_ms;              /* loop time a cap was passed (0: under them) */
    uv_timer_t stall;              /* decide again once connections still moving
                                    * had PB_CONN_STALL_MS to move on (same) */
    pb_uid_use_t *uids;            /* per uid with a connection (malloc, the set's;
                                    * freed when the last connection goes) */
    size_t nuids, capuids;
    uint64_t next_id;
    bool stopping;                 /* SIGTERM: messages past drain_left are late */
    /* The file-descriptor limit (RLIMIT_NOFILE's soft limit, read at
     * init): past it libuv resets the connections it cannot accept and
     * says nothing (its EMFILE trick), so the set says it, at most once
     * every PB_CONNS_FD_WARN_MS (fd_warned, loop ms), counting the rest
     * (fd_unsaid). */
    uint64_t fd_limit;
    uint64_t fd_warned;
    uint64_t fd_unsaid;
} pb_conns_t;

struct pb_conn {
    uv_pipe_t pipe;
    pb_conns_t *set;
    struct pb_conn *prev, *next;   /* set's list */
    struct pb_conn *dnext;         /* set's list of conns with output */
    int refs;
    bool closing;
    bool paused;                   /* reading stopped for back-pressure */
    bool close_after_flush;        /* a parse error was answered */
    bool shut_sent;                /* uv_shutdown issued for that */
    bool dirty;
    bool processing;               /* inside pb_conn_process */
    bool last_read;                /* socket shut for reading; refusing the rest */
    bool eof;                      /* the client shut its writing side only: what it
                                    * sent is answered, then the connection closes */
    bool starved;                  /* reading stopped for the set's buffering cap */
    bool want_memory;              /* alloc_cb was refused growth: starve on ENOBUFS */
    bool counted;                  /* in its uid's entry (pb__conns_admit); false
                                    * when that entry could not be made */
    size_t want_more;              /* the growth it was last refused (which cap binds) */
    uint64_t tx;                   /* reply bytes handed to the socket or to
                                    * libuv's write queue so far */
    /* The buffering caps' last look at it (conn_budget.c): when (0: none
     * lately), its bytes read and written then, and whether it moved
     * PB_CONN_STALL_BYTES in the window before. */
    uint64_t seen_ms, seen_done;
    bool moving;
    uint64_t starved_ms;           /* loop time it last became starved */
    size_t held;                   /* held bytes as last counted in the set */
    uint64_t id;
    uid_t uid;
    pid_t pid;
    char *buf;                     /* unprocessed bytes at buf[start, len) */
    size_t cap, start, len;
    pb_scan_t scan;
    size_t inflight;
    size_t reserved;               /* see the glossary; pb_conn_request_done releases */
    size_t held_max;               /* most queued + reserved bytes seen */
    pb_tape_list_t tapes;          /* tape.c's: the tapes created here and still held */
    msgpack_sbuffer obuf;          /* small replies waiting for the flush */
    msgpack_zone zone;             /* objects of the message being served */
    size_t pending_write;          /* bytes handed to uv_write, not done */
    size_t drain_left;             /* on SIGTERM: bytes still served normally */
    /* Passed fds (see the glossary).  Stream offsets count every byte
     * read from the socket since it was accepted. */
    uint64_t rx;                   /* bytes read so far */
    uint64_t taken;                /* stream offset of buf[start] */
    struct pb_conn_fd {
        int fd;
        uint64_t from, to;         /* the bytes read with it: [from, to) */
    } fds[PB_CONN_MAX_FDS];
    int nfds;
    int msg_fds[PB_CONN_MAX_FDS];  /* the fds of the message being served; */
    int msg_nfds;                  /* one taken is -1 */
    uint64_t msg_start;            /* stream offset of the message being served */
    pb_buffers_t buffers;
    /* pb_conn_log's budget: lines logged in the window that began at
     * log_window (loop ms); lines not logged since the last count said so,
     * and the most severe level among them. */
    uint64_t log_window;
    unsigned log_lines;
    uint64_t log_dropped;
    int log_dropped_level;
};

/* ---- the set (the server's side) ----------------------------------------- */

void pb_conns_init(pb_conns_t *s, uv_loop_t *loop, const pb_config_t *cfg, pb_conn_cbs_t cb);
/* Accept one client from listener. */
void pb_conns_accept(pb_conns_t *s, uv_stream_t *listener);
/* The listener's accept failed with status (a libuv error): log it, at
 * most once every PB_CONNS_FD_WARN_MS. */
void pb_conns_accept_failed(pb_conns_t *s, int status);
/* SIGTERM: what each client sent before now (buffered here or waiting in
 * its socket) is served normally; what comes later is late. */
void pb_conns_stop(pb_conns_t *s);
/* Every message sent before the stop has been read. */
bool pb_conns_drained(const pb_conns_t *s);
/* Every reply is written (a closing connection's do not count). */
bool pb_conns_written(const pb_conns_t *s);
/* The last read (glossary) on every connection. */
void pb_conns_last_read(pb_conns_t *s);
void pb_conns_close_all(pb_conns_t *s);
/* Close the set's own handle (the loop runs its close callback). */
void pb_conns_destroy(pb_conns_t *s);
/* Write the replies batched in this loop iteration. */
void pb_conns_flush(pb_conns_t *s);

/* ---- one connection (the message layer's side) --------------------------- */

/* Queue a reply; takes what o owns (o is emptied). */
void pb_conn_send(pb_conn_t *c, pb_out_t *o);
void pb_conn_close(pb_conn_t *c);
void pb_conn_unref(pb_conn_t *c);
/* Log a line caused by c's messages, within c's budget (glossary: log
 * lines); fmt says which connection, as pb_log's lines do. */
void pb_conn_log(pb_conn_t *c, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* A request of c finished and gave back the reserved bytes it held:
 * resume reading if it was paused. */
void pb_conn_request_done(pb_conn_t *c, size_t reserved);

/* Memory came back to the system (offloop.h's unmapping done): starved
 * connections read again if the caps allow. */
void pb_conns_memory_back(pb_conns_t *s);
/* The buffering caps changed (a reload): over a lower one, decide now
 * whom to wait for and whom to close, not at the next request's end. */
void pb_conns_caps_changed(pb_conns_t *s);

/* The accessors the layers above use instead of the fields. */
static inline size_t pb_conns_count(const pb_conns_t *s) { return s->count; }
/* The connections' held bytes (glossary), summed. */
static inline size_t pb_conns_held(const pb_conns_t *s) { return s->held; }
static inline uint64_t pb_conns_moved(const pb_conns_t *s) { return s->moved; }
static inline void pb_conn_ref(pb_conn_t *c) { c->refs++; }
/* A request of c begins: it counts as in flight until
 * pb_conn_request_done. */
void pb_conn_request_begin(pb_conn_t *c);
/* Count bytes a request holds or will queue against c's cap. */
void pb_conn_reserve(pb_conn_t *c, size_t bytes);
static inline bool pb_conn_closing(const pb_conn_t *c) { return c->closing; }
static inline uint64_t pb_conn_id(const pb_conn_t *c) { return c->id; }
static inline uid_t pb_conn_uid(const pb_conn_t *c) { return c->uid; }
static inline pid_t pb_conn_pid(const pb_conn_t *c) { return c->pid; }
/* Its requests in flight (notifications too). */
static inline size_t pb_conn_inflight(const pb_conn_t *c) { return c->inflight; }
/* The zone the message being served is unpacked into (cleared after). */
static inline msgpack_zone *pb_conn_zone(pb_conn_t *c) { return &c->zone; }
static inline pb_buffers_t *pb_conn_buffers(pb_conn_t *c) { return &c->buffers; }
static inline pb_tape_list_t *pb_conn_tapes(pb_conn_t *c) { return &c->tapes; }
/* How many fds came with the message being served. */
static inline int pb_conn_msg_nfds(const pb_conn_t *c) { return c->msg_nfds; }
/* For a method that needs fds (register_buffer) and was given none: take
 * the held fds whose read the message begins in, though a later message
 * begins there too (a register_buffer pipelined with what follows it in
 * one sendmsg).  How many it now has. */
int pb_conn_claim_read_fds(pb_conn_t *c);
/* Take fd i of the message being served: the caller closes it. */
static inline int pb_conn_take_fd(pb_conn_t *c, int i)
{
    int fd = c->msg_fds[i];
    c->msg_fds[i] = -1;
    return fd;
}

/* ---- conn_budget.c: buffering across connections (glossary: held) -------- */

/* A new connection, counted in its uid's entry until pb__conns_leave
 * (c->counted): false when it is past max_connections_per_uid, or out of
 * memory for the entry (then c is not counted, and nothing of it is ever
 * taken from another connection's entry of the same uid).  *open (when
 * not NULL): the uid's open connections, c included; 0 out of memory. */
bool pb__conns_admit(pb_conns_t *s, pb_conn_t *c, size_t *open);
/* c is closing: it no longer counts against max_connections_per_uid. */
void pb__conns_closed(pb_conns_t *s, pb_conn_t *c);
/* c is freed: give back its held bytes. */
void pb__conns_leave(pb_conns_t *s, pb_conn_t *c);
/* The set's decide handle (pb_conns_init). */
void pb__conns_budget_init(pb_conns_t *s);
/* A request ended: connections starved waiting for it decide again. */
void pb__conns_request_begin(pb_conns_t *s, const pb_conn_t *c);
void pb__conns_request_done(pb_conns_t *s, const pb_conn_t *c);
/* c is no longer starved (resumed, refused or closing). */
void pb__conn_unstarve(pb_conn_t *c);
/* Count c's held bytes again; when they shrank, resume starved ones. */
void pb__conn_account(pb_conn_t *c);
/* May c's read buffer grow by more bytes under both caps? */
bool pb__conn_may_grow(const pb_conn_t *c, size_t more);
/* Is a cap c counts against (the total, its uid's) reached, and do c's
 * replies (queued and of requests in flight) make at least its share of
 * it (half the cap over the connections, or over its uid's)?  Those stop
 * taking messages: the connections that hold the most. */
bool pb__conn_over_share(const pb_conn_t *c, size_t replies);
/* c's buffer may not grow: stop reading it, and when nothing can give
 * memory back, close the connection holding the most (glossary: starved). */
void pb__conn_starve(pb_conn_t *c);
/* ---- conn_fds.c: passed fds (glossary) ------------------------------------ */

/* Take the fds that came with the bytes [from, to) of the stream, from the
 * read callback.  False when out of memory. */
bool pb__conn_receive_fds(pb_conn_t *c, uint64_t from, uint64_t to);
/* Give the message at stream offsets [s, e) its fds (msg_fds). */
void pb__conn_claim_fds(pb_conn_t *c, uint64_t s, uint64_t e);
/* Close the fds the message was given and no method kept. */
void pb__conn_release_msg_fds(pb_conn_t *c);

/* conn.c's: read again after starving. */
void pb__conn_resume(pb_conn_t *c);
/* conn.c's: answer resource_exhausted (limit: the setting's name, sent as
 * the error's limit) and close after the flush. */
void pb__conn_refuse(pb_conn_t *c, const char *limit, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
