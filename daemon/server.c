#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "../kernels/blas.h"
#include "log.h"
#include "rpc.h"

static void on_connection(uv_stream_t *l, int status)
{
    pb_server_t *s = l->data;
    if (status < 0) {
        pb_log(PB_LOG_WARNING, "accept: %s", uv_strerror(status));
        return;
    }
    pb_conn_accept(s);
}

static void on_flush(uv_check_t *h)
{
    pb_conn_flush_all(h->data);
}

static void on_sweep(uv_timer_t *t)
{
    pb_rpc_sweep(t->data);
}

static void on_signal(uv_signal_t *h, int sig)
{
    pb_log(PB_LOG_NOTICE, "signal %d: draining and stopping", sig);
    pb_server_stop(h->data);
}

static void on_drain_timeout(uv_timer_t *t)
{
    pb_server_t *s = t->data;
    pb_log(PB_LOG_WARNING, "drain timeout: %llu requests still in flight are abandoned",
           (unsigned long long)s->requests_in_flight);
    s->requests_in_flight = 0;
    s->drain_expired = true;
    pb_server_maybe_finish(s);
}

int pb_server_init(pb_server_t *s, uv_loop_t *loop, const pb_config_t *cfg)
{
    memset(s, 0, sizeof *s);
    s->loop = loop;
    s->cfg = *cfg;
    s->self_uid = getuid();
    s->start_ms = uv_now(loop);
    pb_blas_init_threads(1);
    int rc = pb_tapes_init(&s->tapes, cfg->max_tape_bytes, cfg->max_tape_bytes_per_uid);
    if (rc)
        return rc;
    if ((rc = pb_pool_init(&s->pool, loop, cfg->workers)))
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
    uv_signal_init(loop, &s->sigterm);
    uv_signal_init(loop, &s->sigint);
    s->sigterm.data = s->sigint.data = s;
    uv_signal_start(&s->sigterm, on_signal, SIGTERM);
    uv_signal_start(&s->sigint, on_signal, SIGINT);
    return 0;
}

/* Is a daemon answering on path?  Refuse to take its socket if so. */
static bool socket_alive(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return false;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    bool alive = connect(fd, (struct sockaddr *)&a, sizeof a) == 0 || errno == EAGAIN;
    close(fd);
    return alive;
}

int pb_server_listen(pb_server_t *s)
{
    const char *path = s->cfg.socket_path;
    struct stat st;
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) {
            pb_log(PB_LOG_ERR, "%s exists and is not a socket; not replacing it", path);
            return UV_EEXIST;
        }
        if (socket_alive(path)) {
            pb_log(PB_LOG_ERR, "another daemon is answering on %s; not taking its socket", path);
            return UV_EADDRINUSE;
        }
        pb_log(PB_LOG_NOTICE, "replacing stale socket %s", path);
        unlink(path);
    }
    uv_pipe_init(s->loop, &s->listener, 0);
    s->listener.data = s;
    /* Bind with a umask that keeps the socket private until chmod. */
    mode_t old = umask(0177);
    int rc = uv_pipe_bind(&s->listener, path);
    umask(old);
    if (rc == 0 && chmod(path, (mode_t)s->cfg.socket_mode) != 0)
        rc = -errno;
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&s->listener, 1024, on_connection);
    if (rc) {
        pb_log(PB_LOG_ERR, "cannot listen on %s: %s", path, uv_strerror(rc));
        uv_close((uv_handle_t *)&s->listener, NULL);
        return rc;
    }
    s->listening = true;
    pb_log(PB_LOG_NOTICE, "listening on %s (%d workers, max message %zu bytes)", path, s->cfg.workers,
           s->cfg.max_message_bytes);
    return 0;
}

void pb_server_stop(pb_server_t *s)
{
    if (s->stopping)
        return;
    s->stopping = true;
    s->draining = true;
    if (s->listening) {
        uv_close((uv_handle_t *)&s->listener, NULL);
        s->listening = false;
        unlink(s->cfg.socket_path);
    }
    /* What each client sent before now is served: bytes buffered here plus
     * those still waiting in the socket. */
    for (pb_conn_t *c = s->conns; c; c = c->next) {
        uv_os_fd_t fd;
        int pending = 0;
        if (uv_fileno((uv_handle_t *)&c->pipe, &fd) == 0)
            ioctl(fd, FIONREAD, &pending);
        c->drain_left = (c->len - c->start) + (size_t)(pending > 0 ? pending : 0);
    }
    uv_timer_start(&s->drain_timer, on_drain_timeout, (uint64_t)(s->cfg.drain_timeout_s * 1000), 0);
    pb_server_maybe_finish(s);
}

void pb_server_maybe_finish(pb_server_t *s)
{
    if (!s->stopping || s->stopped || s->requests_in_flight > 0)
        return;
    for (pb_conn_t *c = s->conns; c; c = c->next)
        if (c->drain_left > 0 && !c->closing)
            return;
    /* Every answer must be out before the connections close: uv_close
     * would cancel writes still queued. */
    pb_conn_flush_all(s);
    for (pb_conn_t *c = s->conns; c; c = c->next)
        if (c->pending_write > 0 && !c->closing && !s->drain_expired)
            return; /* on_write calls back here */
    s->stopped = true;
    while (s->conns)
        pb_conn_close(s->conns);
    uv_timer_stop(&s->drain_timer);
    uv_stop(s->loop);
}

static void close_cb_noop(uv_handle_t *h)
{
    (void)h;
}

void pb_server_destroy(pb_server_t *s)
{
    pb_pool_stop(&s->pool);
    uv_check_stop(&s->flush);
    uv_close((uv_handle_t *)&s->flush, close_cb_noop);
    uv_close((uv_handle_t *)&s->sweep, close_cb_noop);
    uv_close((uv_handle_t *)&s->drain_timer, close_cb_noop);
    uv_close((uv_handle_t *)&s->sigterm, close_cb_noop);
    uv_close((uv_handle_t *)&s->sigint, close_cb_noop);
    if (s->listening) {
        uv_close((uv_handle_t *)&s->listener, NULL);
        unlink(s->cfg.socket_path);
        s->listening = false;
    }
    uv_run(s->loop, UV_RUN_DEFAULT);
    pb_tapes_destroy(&s->tapes);
}
