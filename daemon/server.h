/* The server: listening socket, connections, and the state they share.
 *
 * Glossary
 *   server      one per process: config, loop, worker pool, tape table,
 *               counters, the list of open connections.
 *   connection  one accepted client socket (pb_conn_t): its read buffer
 *               and framing state, its identity (SO_PEERCRED), the tapes
 *               it created, its requests in flight.
 *   request     one msgpack-RPC request or notification being served
 *               (pb_req_t, rpc.h).
 *   in flight   dispatched and not yet answered; past
 *               max_inflight_per_connection the daemon stops reading.
 *   queued      reply bytes handed to the socket and not yet written
 *               (pending_write): the client has not read them.
 *   reserved    bytes the requests in flight hold or will queue: each
 *               request's message, and the size of its reply as soon as
 *               it is known (outputs of a forward, gradients of a
 *               reverse).  Past max_queued_bytes_per_connection
 *               (64 MiB by default) of queued + reserved bytes the
 *               daemon stops reading from the connection, so a client
 *               that never reads costs about that much, whatever its
 *               in-flight limit; one request is always let in, however
 *               large.
 *   last read   the end of a SIGTERM drain: the socket is shut for
 *               reading (the client's later writes fail with EPIPE), the
 *               bytes already in it are read and each request there is
 *               answered shutting_down, then the connection closes.
 *   activated   the listening socket came from systemd (sd.h): the daemon
 *               did not bind it and leaves its file alone on exit.
 *   reload      SIGHUP: the config is loaded again and the limits, drain
 *               timeout and log level change in place; connections, tapes
 *               and requests in flight are untouched.
 *   passed fd   a file descriptor the client sent as SCM_RIGHTS ancillary
 *               data (register_buffer's memfd).  It belongs to the last
 *               message that begins in the bytes read together with it:
 *               the request whose sendmsg carried it, when a client sends
 *               one request per sendmsg as ours do.  Until that message
 *               is complete it waits in fds[] (at most PB_CONN_MAX_FDS;
 *               more are closed); a message other than register_buffer
 *               closes the fds it owns.
 *   buffers     the shared-memory buffers this connection registered
 *               (buffer.h): its own, unusable from any other connection,
 *               dropped when it closes.
 *
 * Ownership: the server owns its connections.  A connection is freed when
 * its handle's close callback has run and no request refers to it (refs
 * counts the handle and each request).  Replies to a closed connection are
 * dropped.  A connection owns the passed fds it holds (closed when it
 * closes) and its buffer table (whose references it drops when it
 * closes; requests in flight keep their mappings until they end).
 * Everything here runs on the loop thread. */
#ifndef PB_SERVER_H
#define PB_SERVER_H

#include <msgpack.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "../proto/codec.h"
#include "../proto/wire.h"
#include "buffer.h"
#include "config.h"
#include "pool.h"
#include "tape.h"

/* Passed fds a connection holds for messages not yet complete. */
#define PB_CONN_MAX_FDS 16

typedef struct pb_conn {
    uv_pipe_t pipe;
    struct pb_server *srv;
    struct pb_conn *prev, *next;   /* server's list */
    struct pb_conn *dnext;         /* server's list of conns with output */
    int refs;
    bool closing;
    bool paused;                   /* reading stopped for back-pressure */
    bool close_after_flush;        /* a parse error was answered */
    bool shut_sent;                /* uv_shutdown issued for that */
    bool dirty;
    bool processing;               /* inside pb_conn_process */
    bool last_read;                /* socket shut for reading; refusing the rest */
    uint64_t id;
    uid_t uid;
    pid_t pid;
    char *buf;                     /* unprocessed bytes at buf[start, len) */
    size_t cap, start, len;
    pb_scan_t scan;
    size_t inflight;
    size_t reserved;               /* see the glossary; pb_conn_request_done releases */
    size_t held_max;               /* most queued + reserved bytes seen */
    size_t ntapes;                 /* tapes created here and still held */
    pb_tape_t *tapes;              /* their list */
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
    int msg_nfds;                  /* a method that keeps one sets it to -1 */
    pb_buffers_t buffers;
} pb_conn_t;

typedef struct pb_server {
    uv_loop_t *loop;
    pb_config_t cfg;
    uv_pipe_t listener;
    bool listening;
    uv_signal_t sigterm, sigint, sighup;
    uv_timer_t sweep, drain_timer;
    uv_timer_t last_read_timer;    /* runs the last reads outside any request */
    uv_timer_t status_timer;       /* STATUS= to systemd, when notifying */
    uv_timer_t watchdog_timer;     /* WATCHDOG=1, when systemd asks for it */
    bool activated;                /* listener fd passed by systemd */
    char status[160];              /* last STATUS= sent */
    /* What a reload parses again (main's argv; flags still win). */
    int argc;
    char **argv;
    const char *default_config;
    uv_check_t flush;
    pb_pool_t pool;
    pb_tapes_t tapes;
    pb_conn_t *conns, *dirty;
    size_t nconns;
    uint64_t next_conn_id;
    uint64_t requests_served, requests_in_flight;
    uint64_t start_ms;
    bool draining;                 /* admin drain: no new forward calls */
    bool stopping;                 /* SIGTERM or shutdown */
    bool stopped;
    bool drain_expired;            /* --drain-timeout passed: stop regardless */
    bool last_read_started, last_read_done;
    uid_t self_uid;
} pb_server_t;

/* Start the workers and the loop's handles: 0, or a negative PB_E* code
 * (the cause logged) with nothing left to destroy.  argc/argv and default_config
 * are kept (not copied) for SIGHUP reloads; they must outlive the server. */
int pb_server_init(pb_server_t *s, uv_loop_t *loop, const pb_config_t *cfg, int argc, char **argv,
                   const char *default_config);
/* Take the socket systemd passed, or bind cfg.socket_path; then tell
 * systemd READY=1.  0, or a negative PB_E* code (the cause logged). */
int pb_server_listen(pb_server_t *s);
/* SIGHUP: load the config again and apply what may change in place; a bad
 * file is logged and changes nothing. */
void pb_server_reload(pb_server_t *s);
/* Begin the graceful stop of SIGTERM / shutdown. */
void pb_server_stop(pb_server_t *s);
/* Exit when stopping and nothing is left in flight. */
void pb_server_maybe_finish(pb_server_t *s);
void pb_server_destroy(pb_server_t *s);

/* Connections (conn.c). */
void pb_conn_accept(pb_server_t *s);
/* Queue a reply; takes what o owns (o is emptied). */
void pb_conn_send(pb_conn_t *c, pb_out_t *o);
void pb_conn_close(pb_conn_t *c);
void pb_conn_unref(pb_conn_t *c);
/* A request of c finished and gave back the reserved bytes it held:
 * resume reading if it was paused. */
void pb_conn_request_done(pb_conn_t *c, size_t reserved);
/* The end of a SIGTERM drain: shut c for reading and answer what is left
 * in its socket with shutting_down (see last read). */
void pb_conn_last_read(pb_conn_t *c);
void pb_conn_flush_all(pb_server_t *s);
/* Serve buffered messages (after a resume). */
void pb_conn_process(pb_conn_t *c);

#endif
