#include "sd.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "../proto/errors.h"

static bool our_name(const char *n)
{
    return n && (strcmp(n, "pullbackd") == 0 || strcmp(n, "pullbackd.socket") == 0);
}

int pb_sd_listen_fd(int *fd, char *path, size_t pathlen, char *err, size_t errlen)
{
    char **names = NULL;
    int n = sd_listen_fds_with_names(1, &names);
    if (n <= 0) {
        if (n < 0)
            snprintf(err, errlen, "$LISTEN_FDS: %s", strerror(-n));
        return n < 0 ? PB_EINVALID_ARGUMENT : 0;
    }
    /* One fd is ours whatever its name (systemd-socket-activate names it
     * "unknown" unless told); among several, the one with our name. */
    int pick = -1;
    for (int i = 0; i < n; i++)
        if (n == 1 || (pick < 0 && names && our_name(names[i])))
            pick = i;
    int rc = 0;
    if (pick < 0) {
        snprintf(err, errlen, "systemd passed %d sockets and none is named pullbackd or pullbackd.socket "
                 "(FileDescriptorName=)", n);
        rc = PB_EINVALID_ARGUMENT;
    } else if (sd_is_socket_unix(SD_LISTEN_FDS_START + pick, SOCK_STREAM, 1, NULL, 0) <= 0) {
        snprintf(err, errlen, "the socket systemd passed (fd %d) is not a listening Unix stream socket",
                 SD_LISTEN_FDS_START + pick);
        rc = PB_EINVALID_ARGUMENT;
    }
    for (int i = 0; i < n; i++) {
        if (i != pick || rc)
            close(SD_LISTEN_FDS_START + i);
        if (names)
            free(names[i]);
    }
    free(names);
    if (rc)
        return rc;
    *fd = SD_LISTEN_FDS_START + pick;
    struct sockaddr_un a;
    socklen_t alen = sizeof a;
    memset(&a, 0, sizeof a);
    if (getsockname(*fd, (struct sockaddr *)&a, &alen) == 0 && alen > offsetof(struct sockaddr_un, sun_path) &&
        a.sun_path[0])
        snprintf(path, pathlen, "%.*s", (int)sizeof a.sun_path, a.sun_path);
    else
        snprintf(path, pathlen, "(socket from systemd, fd %d)", *fd);
    return 1;
}

bool pb_sd_notify_enabled(void)
{
    const char *e = getenv("NOTIFY_SOCKET");
    return e && *e;
}

void pb_sd_notify(const char *fmt, ...)
{
    if (!pb_sd_notify_enabled())
        return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    (void)sd_notify(0, msg);
}

uint64_t pb_sd_watchdog_usec(void)
{
    uint64_t usec = 0;
    return sd_watchdog_enabled(0, &usec) > 0 ? usec : 0;
}
