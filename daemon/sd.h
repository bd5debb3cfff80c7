/* The daemon's side of systemd (sd-daemon, libsystemd): socket activation,
 * readiness and status notifications, the watchdog.
 *
 * Glossary
 *   activation  systemd (or systemd-socket-activate) binds the socket and
 *               passes it as fd 3 with $LISTEN_FDS, $LISTEN_PID and
 *               $LISTEN_FDNAMES; the daemon then neither binds, chmods nor
 *               unlinks it.
 *   notify      datagrams to $NOTIFY_SOCKET: READY=1 once the workers run
 *               and the socket listens, STATUS= lines, RELOADING=1 around a
 *               SIGHUP reload, STOPPING=1 when the drain begins.
 *   watchdog    with $WATCHDOG_USEC set (and $WATCHDOG_PID unset or ours),
 *               WATCHDOG=1 every half period, sent from the loop thread so
 *               that a stuck loop stops the pings and systemd restarts us.
 *
 * Without those variables every function here is a cheap no-op, so the
 * daemon runs the same under systemd, under another supervisor or from a
 * shell.  Functions return 0 / negative PB_E* codes, or counts as said. */
#ifndef PB_SD_H
#define PB_SD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The listening socket passed by the service manager.  Returns 1 and sets
 * *fd (ours to close) and path (the socket's path, for logs) when there is
 * one; 0 when the daemon was not socket-activated; PB_EINVALID_ARGUMENT
 * with the reason in err when what was passed cannot be used (not a
 * listening Unix stream socket, or several fds none named "pullbackd" or
 * "pullbackd.socket").  Fds passed but not used are closed, and the
 * $LISTEN_* variables are unset either way. */
int pb_sd_listen_fd(int *fd, char *path, size_t pathlen, char *err, size_t errlen);
/* Is there a $NOTIFY_SOCKET to tell things to? */
bool pb_sd_notify_enabled(void);
/* Send one or more "KEY=value" lines (newline-separated).  Errors are
 * ignored: a notification is advice to the manager, never a reason to
 * fail a request. */
void pb_sd_notify(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The watchdog period in µs when the manager expects WATCHDOG=1 from this
 * process, else 0. */
uint64_t pb_sd_watchdog_usec(void);

#endif
