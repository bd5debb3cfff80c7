/* Starting and stopping a private pullbackd for a benchmark: a fresh
 * mkdtemp directory, the daemon on a socket there, SIGTERM at the end.
 * Shared by the benchmark programs; static functions, one copy each. */
#ifndef PB_BENCH_DAEMON_H
#define PB_BENCH_DAEMON_H

#include <errno.h>
#include <stdbool.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int unix_connect(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof a.sun_path) {
        close(fd);
        return -ENAMETOOLONG;
    }
    memcpy(a.sun_path, path, strlen(path) + 1);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int e = errno;
        close(fd);
        return -e;
    }
    return fd;
}

typedef struct daemon {
    pid_t pid;
    char dir[64];
    char sock[128];
} daemon_t;

/* Daemons started and not yet stopped: stopped by exit() too, so that a
 * benchmark that dies (exit(1) on a failed check) leaves none behind. */
#define BENCH_MAX_DAEMONS 4
static daemon_t *bench_running[BENCH_MAX_DAEMONS];
static void daemon_stop(daemon_t *d);

static void bench_stop_all(void)
{
    for (int i = 0; i < BENCH_MAX_DAEMONS; i++)
        if (bench_running[i])
            daemon_stop(bench_running[i]);
}

static void bench_track(daemon_t *d, bool on)
{
    static bool registered;
    if (!registered && on) {
        atexit(bench_stop_all);
        registered = true;
    }
    for (int i = 0; i < BENCH_MAX_DAEMONS; i++)
        if (on ? bench_running[i] == NULL : bench_running[i] == d) {
            bench_running[i] = on ? d : NULL;
            return;
        }
}

static int daemon_start(daemon_t *d, const char *bin, const char *const *extra)
{
    snprintf(d->dir, sizeof d->dir, "/tmp/pbbench.XXXXXX");
    if (mkdtemp(d->dir) == NULL)
        return -errno;
    snprintf(d->sock, sizeof d->sock, "%s/pullbackd.sock", d->dir);
    const char *argv[24];
    int n = 0;
    argv[n++] = bin;
    argv[n++] = "--socket";
    argv[n++] = d->sock;
    argv[n++] = "--log-level";
    argv[n++] = "warning";
    for (int i = 0; extra && extra[i] && n < 23; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    d->pid = fork();
    if (d->pid < 0)
        return -errno;
    if (d->pid == 0) {
        execv(bin, (char *const *)argv);
        fprintf(stderr, "bench: cannot run %s: %s\n", bin, strerror(errno));
        _exit(127);
    }
    bench_track(d, true);
    uint64_t deadline = now_ns() + 10000000000ull;
    while (now_ns() < deadline) {
        int st;
        if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
            d->pid = 0;
            return -ECHILD;
        }
        int fd = unix_connect(d->sock);
        if (fd >= 0) {
            close(fd);
            return 0;
        }
        usleep(5000);
    }
    return -ETIMEDOUT;
}

static void daemon_stop(daemon_t *d)
{
    bench_track(d, false);
    if (d->pid > 0) {
        kill(d->pid, SIGTERM);
        uint64_t deadline = now_ns() + 10000000000ull;
        int st;
        while (waitpid(d->pid, &st, WNOHANG) == 0) {
            if (now_ns() > deadline) {
                fprintf(stderr, "bench: daemon ignored SIGTERM for 10 s; killing it\n");
                kill(d->pid, SIGKILL);
                waitpid(d->pid, &st, 0);
                break;
            }
            usleep(5000);
        }
        d->pid = 0;
    }
    unlink(d->sock);
    rmdir(d->dir);
}

#endif
