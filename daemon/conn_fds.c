/* Passed fds (conn.h's glossary): taking the SCM_RIGHTS fds libuv queued
 * for a connection, and giving each message the ones that came with it. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "conn.h"
#include "log.h"

static void free_handle(uv_handle_t *h)
{
    free(h);
}

/* The oldest fd libuv holds for c, or -1 when it was lost (closed).
 *
 * The connection's pipe is opened with ipc=1, so libuv reads it with
 * recvmsg and queues the SCM_RIGHTS fds that come with the bytes (on Unix
 * ipc adds nothing to the byte stream); it hands them out only through
 * uv_accept into a pipe, tcp or udp handle.  A memfd is none of those, but
 * uv_accept into a pipe handle only adopts the number without looking at
 * it: adopt it in a throwaway handle, dup it out, and close the handle,
 * which closes the original.  libuv leaves 0..2 open when it closes a
 * handle, so an fd that got one of those numbers is closed here. */
static int adopt_fd(pb_conn_t *c, bool *oom)
{
    uv_pipe_t *tmp = malloc(sizeof *tmp);
    if (tmp == NULL || uv_pipe_init(c->set->loop, tmp, 0) != 0) {
        free(tmp);
        *oom = true;
        return -1;
    }
    int mine = -1;
    uv_os_fd_t fd;
    if (uv_accept((uv_stream_t *)&c->pipe, (uv_stream_t *)tmp) == 0 && uv_fileno((uv_handle_t *)tmp, &fd) == 0) {
        mine = fcntl(fd, F_DUPFD_CLOEXEC, 3);
        if (mine < 0)
            pb_conn_log(c, PB_LOG_WARNING, "connection %llu: a passed file descriptor was dropped: %s",
                        (unsigned long long)c->id, strerror(errno));
        if (fd <= STDERR_FILENO)
            close(fd);
    }
    uv_close((uv_handle_t *)tmp, free_handle);
    return mine;
}

/* Take the fds that came with the bytes [from, to) of the stream.  Called
 * from the read callback, while c is reading: uv_accept restarts reading
 * when its queue empties, which is then a no-op.  False when out of memory
 * (the fds left in libuv's queue could no longer be told apart). */
bool pb__conn_receive_fds(pb_conn_t *c, uint64_t from, uint64_t to)
{
    int dropped = 0;
    while (uv_pipe_pending_count(&c->pipe) > 0) {
        bool oom = false;
        int fd = adopt_fd(c, &oom);
        if (oom)
            return false;
        if (fd < 0)
            continue;
        if (c->nfds == PB_CONN_MAX_FDS) {
            close(fd);
            dropped++;
            continue;
        }
        c->fds[c->nfds++] = (struct pb_conn_fd){fd, from, to};
    }
    /* One line a read, not one a descriptor: a client decides how many. */
    if (dropped)
        pb_conn_log(c, PB_LOG_NOTICE, "connection %llu: more than %d passed file descriptors wait for their "
                    "messages; closed the %d newest", (unsigned long long)c->id, PB_CONN_MAX_FDS, dropped);
    return true;
}

/* The fds of the message at stream offsets [s, e).  The kernel glues the
 * bytes of several sendmsg calls into one read but ends the read after
 * bytes that carried fds, so the fds of a read [from, to) came with its
 * last sendmsg, and that sendmsg began the last message that begins in
 * [from, to) (when a client sends one request per sendmsg, as it should):
 * the message that begins there and ends at or past to.  So a held fd
 * whose read ends by e is this message's when s lies in its read;
 * otherwise no message began in that read (it fell inside a message) or
 * the last one that did was served before: stray, and closed.  An fd
 * whose read ends past e waits for a later message. */
void pb__conn_claim_fds(pb_conn_t *c, uint64_t s, uint64_t e)
{
    int keep = 0;
    c->msg_nfds = 0;
    c->msg_start = s;
    for (int i = 0; i < c->nfds; i++) {
        struct pb_conn_fd f = c->fds[i];
        if (f.to > e)
            c->fds[keep++] = f;
        else if (f.from <= s && s < f.to)
            c->msg_fds[c->msg_nfds++] = f.fd;
        else
            close(f.fd);
    }
    c->nfds = keep;
}

int pb_conn_claim_read_fds(pb_conn_t *c)
{
    if (c->msg_nfds > 0)
        return c->msg_nfds;
    int keep = 0;
    for (int i = 0; i < c->nfds; i++) {
        struct pb_conn_fd f = c->fds[i];
        if (f.from <= c->msg_start && c->msg_start < f.to)
            c->msg_fds[c->msg_nfds++] = f.fd;
        else
            c->fds[keep++] = f;
    }
    c->nfds = keep;
    return c->msg_nfds;
}

/* Close the fds the message was given and no method kept. */
void pb__conn_release_msg_fds(pb_conn_t *c)
{
    for (int i = 0; i < c->msg_nfds; i++)
        if (c->msg_fds[i] >= 0)
            close(c->msg_fds[i]);
    c->msg_nfds = 0;
}

