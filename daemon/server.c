#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "../kernels/blas.h"
#include "log.h"
#include "offloop.h"
#include "sd.h"

/* How often STATUS= is refreshed (only sent when its text changed). */
#define STATUS_INTERVAL_MS 2000

static void on_connection(uv_stream_t *l, int status)
{
    pb_server_t *s = l->data;
    if (status < 0) {
        pb_conns_accept_failed(&s->conns, status);
        return;
    }
    pb_conns_accept(&s->conns, l);
}

static void on_flush(uv_check_t *h)
{
    pb_server_t *s = h->data;
    pb_conns_flush(&s->conns);
}

/* A lower --memory-cache on reload applies to the frees to come at once;
 * a cache holding more is emptied off the loop. */
static void set_memory_cap(pb_server_t *s)
{
    pb_mem_set_cap_only(s->cfg.memory_cache_bytes);
    pb_offloop_memory(PB_OFFLOOP_FIT_CAP);
}

/* Every second: expired tapes go, and after idle-trim seconds without
 * work for the workers the memory kept for reuse goes back to the system,
 * off the loop (requests answered on the loop, such as a metrics scrape,
 * use none of it and do not keep it).  Blocks freed on the loop after that
 * trim (a closed connection's tapes, an expired tape, a slow reader's
 * replies) go idle-trim seconds after they were first seen cached. */
static void on_sweep(uv_timer_t *t)
{
    pb_server_t *s = t->data;
    pb_rpc_sweep(&s->rpc);
    uint64_t now = uv_now(s->loop);
    uint64_t work = pb_pool_busy_ns(&s->rpc.pool);
    uint64_t idle_ms = (uint64_t)(s->cfg.idle_trim_s * 1000);
    if (work != s->work_seen || s->rpc.requests_in_flight > 0) {
        s->work_seen = work;
        s->busy_ms = now;
        s->trimmed = false;
    } else if (!s->trimmed && s->cfg.idle_trim_s > 0 && now - s->busy_ms >= idle_ms) {
        s->trimmed = true;
        s->cached_since_ms = 0;
        pb_offloop_memory(PB_OFFLOOP_TRIM_ALL);
    } else if (s->trimmed && s->cfg.idle_trim_s > 0) {
        pb_mem_stats_t ms;
        pb_mem_stats(&ms);
        if (ms.cached_bytes == 0)
            s->cached_since_ms = 0;
        else if (s->cached_since_ms == 0)
            s->cached_since_ms = now;
        else if (now - s->cached_since_ms >= idle_ms) {
            s->cached_since_ms = 0;
            pb_offloop_memory(PB_OFFLOOP_TRIM_ALL);
        }
    }
}

/* The callbacks the layers below call, all with the server as data: the
 * server wires the connections to the request layer. */
static void on_message(pb_conn_t *c, pb_storage_t *msg, bool late, void *data)
{
    pb_server_t *s = data;
    pb_rpc_message(&s->rpc, c, msg, late);
}

static void on_conn_close(pb_conn_t *c, void *data)
{
    pb_server_t *s = data;
    pb_rpc_conn_closed(&s->rpc, c);
}

static void on_idle(void *data)
{
    pb_server_maybe_finish(data);
}

static void on_shutdown(void *data)
{
    pb_server_stop(data);
}

/* Seconds of --drain-timeout left (the drain timer's). */
static double drain_left_s(pb_server_t *s)
{
    return (double)uv_timer_get_due_in(&s->drain_timer) / 1000.0;
}

/* Stop waiting for what is in flight: the drain timeout passed, or a
 * third signal came.  The connections close now; requests still running
 * on the workers are not waited for (pb_server_abandoned). */
static void abandon(pb_server_t *s, const char *why)
{
    if (s->rpc.requests_in_flight > 0)
        pb_log(PB_LOG_WARNING, "%s: %llu requests still in flight are abandoned", why,
               (unsigned long long)s->rpc.requests_in_flight);
    else /* --drain-timeout 0, or the timer raced the last reply: nothing lost */
        pb_log(PB_LOG_INFO, "%s: no request in flight; closing the connections", why);
    s->rpc.requests_in_flight = 0;
    s->drain_expired = true;
    uv_timer_stop(&s->drain_timer);
    pb_server_maybe_finish(s);
}

/* SIGTERM or SIGINT drains; a second one during the drain (the first
 * after the shutdown method) says that one more stops it, and the next
 * stops at once (as the drain timeout would). */
static void on_signal(uv_signal_t *h, int sig)
{
    pb_server_t *s = h->data;
    if (!s->stopping) {
        pb_log(PB_LOG_NOTICE, "signal %d: draining and stopping", sig);
        pb_server_stop(s);
        return;
    }
    if (s->stopped || s->drain_expired)
        return;
    if (++s->stop_signals == 1) {
        pb_log(PB_LOG_NOTICE, "signal %d: already draining (%llu requests in flight, at most %g s more); "
               "one more signal stops at once", sig, (unsigned long long)s->rpc.requests_in_flight,
               drain_left_s(s));
        return;
    }
    char why[64];
    snprintf(why, sizeof why, "signal %d again", sig);
    abandon(s, why);
}

static void on_sighup(uv_signal_t *h, int sig)
{
    (void)sig;
    pb_server_reload(h->data);
}

/* The STATUS= text for systemctl status: what the daemon holds and has
 * done.  True when it changed since the last one sent. */
static bool update_status(pb_server_t *s)
{
    char st[sizeof s->status];
    snprintf(st, sizeof st, "%s%zu connections, %zu tapes held (%zu bytes), %llu requests served",
             s->stopping ? "draining: " : s->rpc.draining ? "drained (no new forward calls): " : "",
             pb_conns_count(&s->conns), s->rpc.tapes.count, s->rpc.tapes.bytes,
             (unsigned long long)s->rpc.requests_served);
    if (strcmp(st, s->status) == 0)
        return false;
    memcpy(s->status, st, sizeof st);
    return true;
}

static void on_status(uv_timer_t *t)
{
    pb_server_t *s = t->data;
    if (update_status(s))
        pb_sd_notify("STATUS=%s", s->status);
}

/* From the loop thread: if the loop is stuck, the pings stop. */
static void on_watchdog(uv_timer_t *t)
{
    (void)t;
    pb_sd_notify("WATCHDOG=1");
}

static void on_drain_timeout(uv_timer_t *t)
{
    abandon(t->data, "drain timeout");
}

/* Each connection takes a file descriptor, and so does each memfd a
 * client passes: the soft limit (1024 on most systems) goes up to the
 * hard one, which systemd's LimitNOFILE= sets.  Called before the
 * connection set reads the limit. */
static void raise_fd_limit(const pb_config_t *cfg)
{
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) != 0)
        return;
    rlim_t was = r.rlim_cur;
    if (r.rlim_cur != r.rlim_max) {
        r.rlim_cur = r.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &r) != 0) {
            pb_log(PB_LOG_WARNING, "file descriptors: cannot raise the soft limit %llu to the hard limit %llu: %s",
                   (unsigned long long)was, (unsigned long long)r.rlim_max, strerror(errno));
            r.rlim_cur = was;
        }
    }
    if (r.rlim_cur != was)
        pb_log(PB_LOG_INFO, "file descriptors: at most %llu open (soft limit raised from %llu)",
               (unsigned long long)r.rlim_cur, (unsigned long long)was);
    else
        pb_log(PB_LOG_INFO, "file descriptors: at most %llu open", (unsigned long long)r.rlim_cur);
    if (r.rlim_cur != RLIM_INFINITY && r.rlim_cur < cfg->max_connections_per_uid + PB_CONNS_FD_MARGIN)
        pb_log(PB_LOG_NOTICE, "file descriptors: the limit (%llu) is below max-connections-per-uid (%zu) and what "
               "the daemon needs besides: connections past it are closed unanswered (raise LimitNOFILE=)",
               (unsigned long long)r.rlim_cur, cfg->max_connections_per_uid);
}

static void on_unmapped(void *conns)
{
    pb_conns_memory_back(conns);
}

int pb_server_init(pb_server_t *s, uv_loop_t *loop, const pb_config_t *cfg, int argc, char **argv,
                   const char *default_config)
{
    memset(s, 0, sizeof *s);
    s->loop = loop;
    s->cfg = *cfg;
    s->argc = argc;
    s->argv = argv;
    s->default_config = default_config;
    pb_blas_init_threads(1);
    pb_mem_set_cap(s->cfg.memory_cache_bytes);
    pb_offloop_start(loop);
    raise_fd_limit(&s->cfg);
    pb_conns_init(&s->conns, loop, &s->cfg,
                  (pb_conn_cbs_t){.on_message = on_message, .on_close = on_conn_close, .on_idle = on_idle,
                                  .data = s});
    pb_offloop_on_unmapped(on_unmapped, &s->conns);
    int rc = pb_rpc_init(&s->rpc, loop, &s->cfg, &s->conns,
                         (pb_rpc_hooks_t){.stop = on_shutdown, .request_done = on_idle, .data = s});
    if (rc)
        return rc;
    uv_check_init(loop, &s->flush);
    s->flush.data = s;
    uv_check_start(&s->flush, on_flush);
    uv_timer_init(loop, &s->sweep);
    s->sweep.data = s;
    uv_timer_start(&s->sweep, on_sweep, 1000, 1000);
    uv_unref((uv_handle_t *)&s->sweep);
    uv_timer_init(loop, &s->drain_timer);
    s->drain_timer.data = s;
    uv_timer_init(loop, &s->last_read_timer);
    s->last_read_timer.data = s;
    uv_signal_init(loop, &s->sigterm);
    uv_signal_init(loop, &s->sigint);
    uv_signal_init(loop, &s->sighup);
    s->sigterm.data = s->sigint.data = s->sighup.data = s;
    uv_signal_start(&s->sigterm, on_signal, SIGTERM);
    uv_signal_start(&s->sigint, on_signal, SIGINT);
    uv_signal_start(&s->sighup, on_sighup, SIGHUP);
    uv_timer_init(loop, &s->status_timer);
    uv_timer_init(loop, &s->watchdog_timer);
    s->status_timer.data = s->watchdog_timer.data = s;
    uv_unref((uv_handle_t *)&s->status_timer);
    uv_unref((uv_handle_t *)&s->watchdog_timer);
    return 0;
}

/* Is a daemon answering on path?  Refuse to take its socket if so. */
static bool socket_alive(const char *path)
{
    /* Non-blocking: a live daemon that is stopped with its backlog full
     * makes a blocking connect wait for good (and the start with it);
     * EAGAIN says someone listens. */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return false;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    bool alive = connect(fd, (struct sockaddr *)&a, sizeof a) == 0 || errno == EAGAIN || errno == EINPROGRESS;
    close(fd);
    return alive;
}

/* The socket systemd passed: 1 when taken, 0 when there is none, or an
 * error (logged). */
static int listen_activated(pb_server_t *s)
{
    char err[256], path[sizeof s->cfg.socket_path];
    int fd;
    int rc = pb_sd_listen_fd(&fd, path, sizeof path, err, sizeof err);
    if (rc <= 0) {
        if (rc < 0)
            pb_log(PB_LOG_ERR, "socket activation: %s (%s)", err, pb_strerror_code(rc));
        return rc;
    }
    uv_pipe_init(s->loop, &s->listener, 0);
    s->listener.data = s;
    if ((rc = uv_pipe_open(&s->listener, fd)) == 0)
        rc = uv_listen((uv_stream_t *)&s->listener, 1024, on_connection);
    if (rc) {
        pb_log(PB_LOG_ERR, "cannot listen on the socket from systemd (%s): %s (%s)", path, uv_strerror(rc),
               uv_err_name(rc));
        uv_close((uv_handle_t *)&s->listener, NULL);
        return pb_err_from_sys(rc);
    }
    /* The path is for logs only: the socket file is systemd's. */
    snprintf(s->cfg.socket_path, sizeof s->cfg.socket_path, "%s", path);
    s->activated = true;
    return 1;
}

static void ready(pb_server_t *s)
{
    pb_log(PB_LOG_NOTICE, "listening on %s%s (%d worker%s, max message %zu bytes%s%s)", s->cfg.socket_path,
           s->activated ? " (socket from systemd)" : "", s->cfg.workers, s->cfg.workers == 1 ? "" : "s",
           s->cfg.max_message_bytes,
           s->cfg.config_file[0] ? ", config " : "", s->cfg.config_file);
    char blas[256];
    pb_blas_describe(blas, sizeof blas);
    pb_log(PB_LOG_INFO, "BLAS: %s", blas);
    if (!pb_sd_notify_enabled())
        return;
    update_status(s);
    pb_sd_notify("READY=1\nSTATUS=%s", s->status);
    uv_timer_start(&s->status_timer, on_status, STATUS_INTERVAL_MS, STATUS_INTERVAL_MS);
    uint64_t wd = pb_sd_watchdog_usec();
    if (wd) {
        uint64_t ms = wd / 2000;
        uv_timer_start(&s->watchdog_timer, on_watchdog, 0, ms ? ms : 1);
        pb_log(PB_LOG_INFO, "watchdog: WATCHDOG=1 every %llu ms", (unsigned long long)(ms ? ms : 1));
    }
}

/* uv_pipe_bind reports a missing directory as EACCES (libuv turns bind's
 * ENOENT into it, as Windows says): look first, and say what is wrong.
 * 0, or a negative PB_E* code (logged). */
static int check_socket_dir(const char *path)
{
    const char *slash = strrchr(path, '/');
    if (slash == NULL)
        return 0; /* the working directory */
    char dir[sizeof ((pb_config_t *)0)->socket_path];
    snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
    struct stat st;
    int rc = stat(dir, &st) == 0 ? (S_ISDIR(st.st_mode) ? 0 : UV_ENOTDIR) : -errno;
    if (rc == UV_ENOENT || rc == UV_ENOTDIR) {
        pb_log(PB_LOG_ERR, "cannot listen on %s: %s %s (%s)", path,
               rc == UV_ENOENT ? "no such directory" : "not a directory:", dir, uv_err_name(rc));
        return pb_err_from_sys(rc);
    }
    return 0; /* anything else, bind says */
}

int pb_server_listen(pb_server_t *s)
{
    int rc = listen_activated(s);
    if (rc < 0)
        return rc;
    if (rc > 0) {
        s->listening = true;
        ready(s);
        return 0;
    }
    const char *path = s->cfg.socket_path;
    if ((rc = check_socket_dir(path)))
        return rc;
    struct stat st;
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) {
            pb_log(PB_LOG_ERR, "%s exists and is not a socket; not replacing it", path);
            return PB_EINVALID_ARGUMENT;
        }
        if (socket_alive(path)) {
            pb_log(PB_LOG_ERR, "another daemon is answering on %s; not taking its socket", path);
            return pb_err_from_sys(UV_EADDRINUSE);
        }
        pb_log(PB_LOG_NOTICE, "replacing stale socket %s", path);
        unlink(path);
    }
    uv_pipe_init(s->loop, &s->listener, 0);
    s->listener.data = s;
    /* Bind with a umask that keeps the socket private until chmod. */
    mode_t old = umask(0177);
    rc = uv_pipe_bind(&s->listener, path);
    umask(old);
    if (rc == 0 && chmod(path, (mode_t)s->cfg.socket_mode) != 0)
        rc = -errno;
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&s->listener, 1024, on_connection);
    if (rc) {
        pb_log(PB_LOG_ERR, "cannot listen on %s: %s (%s)", path, uv_strerror(rc), uv_err_name(rc));
        uv_close((uv_handle_t *)&s->listener, NULL);
        return pb_err_from_sys(rc);
    }
    if (stat(path, &st) == 0) { /* the file close_listener may remove */
        s->sock_dev = st.st_dev;
        s->sock_ino = st.st_ino;
        s->sock_ctime = st.st_ctim;
    }
    s->listening = true;
    ready(s);
    return 0;
}

/* Close the listener; its file goes too unless it is systemd's. */
static void close_listener(pb_server_t *s)
{
    if (!s->listening)
        return;
    /* Only the file this daemon made: once removed (an operator, a tmp
     * cleaner), the path may be another live daemon's.  libuv removes a
     * bound pipe's path itself when it closes it (uv__pipe_close, for the
     * pipe_fname it keeps): the name is taken from it first, and freed
     * here (libuv allocates it with malloc; no allocator is replaced). */
    char *fname = (char *)s->listener.pipe_fname;
    s->listener.pipe_fname = NULL;
    uv_close((uv_handle_t *)&s->listener, NULL);
    s->listening = false;
    struct stat st;
    if (!s->activated && stat(s->cfg.socket_path, &st) == 0 && st.st_dev == s->sock_dev &&
        st.st_ino == s->sock_ino && st.st_ctim.tv_sec == s->sock_ctime.tv_sec &&
        st.st_ctim.tv_nsec == s->sock_ctime.tv_nsec) /* a freed inode number comes back soon on some filesystems */
        unlink(s->cfg.socket_path);
    free(fname);
}

typedef struct reload_ctx {
    pb_server_t *s;
    int applied, refused;
} reload_ctx_t;

static void reload_change(const char *key, const char *from, const char *to, bool reloadable, void *ctx)
{
    reload_ctx_t *r = ctx;
    if (!reloadable) {
        /* The activated socket's path comes from systemd, not the config. */
        if (strcmp(key, "socket") == 0 && r->s->activated)
            return;
        pb_log(PB_LOG_WARNING, "reload: %s changed from %s to %s, which needs a restart; still %s", key, from, to,
               from);
        r->refused++;
        return;
    }
    pb_log(PB_LOG_NOTICE, "reload: %s %s -> %s", key, from, to);
    r->applied++;
}

void pb_server_reload(pb_server_t *s)
{
    if (s->stopping) {
        pb_log(PB_LOG_NOTICE, "reload asked while stopping: not reloading");
        return;
    }
    pb_sd_notify("RELOADING=1");
    pb_config_t n;
    char err[512];
    int rc = pb_config_reload(&n, &s->cfg, s->argc, s->argv, s->default_config, err, sizeof err);
    if (rc != 0) {
        pb_log(PB_LOG_ERR, "reload failed, keeping the running configuration: %s (%s)",
               rc < 0 ? err : "help or version requested", pb_strerror_code(rc < 0 ? rc : PB_EINVALID_ARGUMENT));
        pb_sd_notify("READY=1\nSTATUS=reload failed: %.200s", rc < 0 ? err : "bad flags");
        return;
    }
    reload_ctx_t ctx = {.s = s};
    /* The changes are logged at the more verbose of the two levels: a
     * reload that raises the level says so too. */
    if (n.log_level > pb_log_level)
        pb_log_level = n.log_level;
    pb_config_diff(&s->cfg, &n, reload_change, &ctx);
    pb_config_apply_reloadable(&s->cfg, &n);
    s->rpc.tapes.max_bytes = n.max_tape_bytes;
    s->rpc.tapes.max_bytes_per_uid = n.max_tape_bytes_per_uid;
    s->rpc.tapes.max_bytes_per_device = n.max_device_tape_bytes;
    pb_rpc_set_gpu_caps(&s->rpc, n.max_device_bytes);
    pb_log_level = n.log_level;
    pb_config_warn(&s->cfg);
    set_memory_cap(s);
    pb_log(PB_LOG_NOTICE, "reloaded %s: %d settings changed, %d need a restart",
           n.config_file[0] ? n.config_file : "(no config file)", ctx.applied, ctx.refused);
    /* A changed in-flight or queued-bytes limit needs no wake-up: a
     * connection paused by the old one has a request in flight or a write
     * queued, whose end re-checks the limit.  A lower buffering cap may
     * already be passed by what connections hold: decided now. */
    pb_conns_caps_changed(&s->conns);
    update_status(s);
    pb_sd_notify("READY=1\nSTATUS=%s", s->status);
}

void pb_server_stop(pb_server_t *s)
{
    if (s->stopping)
        return;
    s->stopping = true;
    s->rpc.stopping = true;
    close_listener(s);
    update_status(s);
    pb_sd_notify("STOPPING=1\nSTATUS=%s", s->status);
    /* What each client sent before now is served: bytes buffered here plus
     * those still waiting in the socket. */
    pb_conns_stop(&s->conns);
    uv_timer_start(&s->drain_timer, on_drain_timeout, (uint64_t)(s->cfg.drain_timeout_s * 1000), 0);
    pb_server_maybe_finish(s);
}

/* Everything sent before the signal is answered.  What came later and
 * is still in the sockets is answered shutting_down now, from a timer
 * callback: maybe_finish runs inside requests, whose connection may be
 * in the middle of pb_conn_process. */
static void on_last_read(uv_timer_t *t)
{
    pb_server_t *s = t->data;
    if (s->stopped)
        return;
    if (!s->drain_expired)
        pb_conns_last_read(&s->conns);
    s->last_read_done = true;
    pb_server_maybe_finish(s);
}

void pb_server_maybe_finish(pb_server_t *s)
{
    if (!s->stopping || s->stopped)
        return;
    /* Past the drain timeout nothing more is waited for. */
    if (!s->drain_expired) {
        if (s->rpc.requests_in_flight > 0 || !pb_conns_drained(&s->conns))
            return;
        if (!s->last_read_done) {
            if (!s->last_read_started) {
                s->last_read_started = true;
                uv_timer_start(&s->last_read_timer, on_last_read, 0, 0);
            }
            return;
        }
    }
    /* Every answer must be out before the connections close: uv_close
     * would cancel writes still queued. */
    pb_conns_flush(&s->conns);
    if (!s->drain_expired && !pb_conns_written(&s->conns))
        return; /* on_write calls back here */
    s->stopped = true;
    pb_conns_close_all(&s->conns);
    uv_timer_stop(&s->drain_timer);
    uv_timer_stop(&s->last_read_timer);
    uv_stop(s->loop);
}

static void close_cb_noop(uv_handle_t *h)
{
    (void)h;
}

int pb_server_abandoned(pb_server_t *s)
{
    if (!s->drain_expired)
        return 0;
    int n = pb_pool_running(&s->rpc.pool);
    if (n > 0)
        pb_log(PB_LOG_WARNING, "exiting without waiting for the %d requests still running on the workers", n);
    return n;
}

void pb_server_destroy(pb_server_t *s)
{
    pb_rpc_stop_workers(&s->rpc);
    uv_check_stop(&s->flush);
    uv_close((uv_handle_t *)&s->flush, close_cb_noop);
    uv_close((uv_handle_t *)&s->sweep, close_cb_noop);
    uv_close((uv_handle_t *)&s->drain_timer, close_cb_noop);
    uv_close((uv_handle_t *)&s->last_read_timer, close_cb_noop);
    uv_close((uv_handle_t *)&s->sigterm, close_cb_noop);
    uv_close((uv_handle_t *)&s->sigint, close_cb_noop);
    uv_close((uv_handle_t *)&s->sighup, close_cb_noop);
    uv_close((uv_handle_t *)&s->status_timer, close_cb_noop);
    uv_close((uv_handle_t *)&s->watchdog_timer, close_cb_noop);
    close_listener(s);
    pb_conns_destroy(&s->conns);
    uv_run(s->loop, UV_RUN_DEFAULT); /* also the memory work queued off the loop */
    pb_offloop_on_unmapped(NULL, NULL);
    pb_offloop_stop();
    pb_rpc_destroy(&s->rpc);
}
