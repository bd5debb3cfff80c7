/* The server: the process's top layer.  It owns the listening socket, the
 * signals and timers, the connection set (conn.h) and the request layer
 * (rpc.h), and wires them together: it hands the connections their
 * message, close and idle callbacks (server.c's on_message, on_conn_close
 * and on_idle, which call the request layer or finish a stop), so the
 * layers below never name the ones above.  Includes run one way:
 * server -> conn, rpc; rpc -> conn, tape, pool, kernels.
 *
 * Glossary
 *   server      one per process: config, loop, listener, signals,
 *               the connection set and the request layer.
 *   connection  one accepted client socket (conn.h).
 *   request     one msgpack-RPC request or notification being served
 *               (request.h), from decoding to reply (rpc.h).
 *   drain       SIGTERM or shutdown: what was sent before is served,
 *               what came later is answered shutting_down (conn.h's
 *               late and last read), then the daemon exits; admin drain
 *               only refuses new forward calls.  Past --drain-timeout, or
 *               at a third SIGTERM/SIGINT, what is left is abandoned: the
 *               daemon exits without waiting for its workers.
 *   activated   the listening socket came from systemd (sd.h): the daemon
 *               did not bind it and leaves its file alone on exit.
 *   reload      SIGHUP: the config is loaded again and the reloadable
 *               settings (config.h's table) change in place; connections,
 *               tapes and requests in flight are untouched.
 *
 * Ownership: the server is the caller's (main's stack); it owns its
 * handles, its connection set and its request layer (pb_server_destroy
 * closes and frees them).  The config lives here; the connection set and
 * the request layer point at it, so a reload is seen by both.  Everything
 * here runs on the loop thread. */
#ifndef PB_SERVER_H
#define PB_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>
#include <uv.h>

#include "config.h"
#include "conn.h"
#include "rpc.h"

typedef struct pb_server {
    uv_loop_t *loop;
    pb_config_t cfg;
    uv_pipe_t listener;
    bool listening;
    dev_t sock_dev; /* the socket file it bound (not activated): close_listener removes only it */
    ino_t sock_ino;
    struct timespec sock_ctime;
    uv_signal_t sigterm, sigint, sighup;
    uv_timer_t sweep, drain_timer;
    uint64_t work_seen;            /* the workers' busy time at the last sweep */
    uint64_t busy_ms;              /* when work was last seen (loop time) */
    bool trimmed;                  /* the heap was trimmed since then */
    uint64_t cached_since_ms;      /* trimmed: when blocks were first seen
                                    * cached again (0: none) */
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
    pb_conns_t conns;
    pb_rpc_t rpc;
    bool stopping;                 /* SIGTERM or shutdown */
    bool stopped;
    bool drain_expired;            /* --drain-timeout passed, or a third signal: stop regardless */
    int stop_signals;              /* SIGTERM/SIGINT received while stopping */
    bool last_read_started, last_read_done;
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
/* After the loop: when the drain was cut short (timeout or a third
 * signal) with requests still running on the workers, their number
 * (logged); the caller then exits without pb_server_destroy, which would
 * wait for them (a LAPACK call cannot be interrupted).  Else 0. */
int pb_server_abandoned(pb_server_t *s);
void pb_server_destroy(pb_server_t *s);

#endif
