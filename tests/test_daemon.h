/* Starting and stopping a private pullbackd for a benchmark, a load test or
 * an end-to-end test: a fresh mkdtemp directory, the daemon on a socket
 * there, SIGTERM at the end; and the daemon's CPU time for the benchmarks.
 * Static functions, one copy per program. */
#ifndef PB_TEST_DAEMON_H
#define PB_TEST_DAEMON_H

#include <dirent.h>
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
 * program that dies (exit(1) on a failed check) leaves none behind. */
#define TEST_MAX_DAEMONS 4
static daemon_t *daemon_running[TEST_MAX_DAEMONS];
static int daemon_stop(daemon_t *d);

static void daemon_stop_all(void)
{
    for (int i = 0; i < TEST_MAX_DAEMONS; i++)
        if (daemon_running[i])
            daemon_stop(daemon_running[i]);
}

static void daemon_track(daemon_t *d, bool on)
{
    static bool registered;
    if (!registered && on) {
        atexit(daemon_stop_all);
        registered = true;
    }
    for (int i = 0; i < TEST_MAX_DAEMONS; i++)
        if (on ? daemon_running[i] == NULL : daemon_running[i] == d) {
            daemon_running[i] = on ? d : NULL;
            return;
        }
}

/* A fresh directory for d and its socket path there, without starting
 * anything: a test can put something at d->sock first (a stale socket). */
static int daemon_mkdir(daemon_t *d)
{
    snprintf(d->dir, sizeof d->dir, "/tmp/pbtest.XXXXXX");
    if (mkdtemp(d->dir) == NULL)
        return -errno;
    snprintf(d->sock, sizeof d->sock, "%s/pullbackd.sock", d->dir);
    return 0;
}

/* Start bin on d->sock (daemon_mkdir first) with the NULL-terminated extra
 * flags, and wait (10 s at most) until it accepts connections.  -ECHILD
 * when it exited instead. */
static int daemon_spawn(daemon_t *d, const char *bin, const char *const *extra)
{
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
        fprintf(stderr, "test_daemon: cannot run %s: %s\n", bin, strerror(errno));
        _exit(127);
    }
    daemon_track(d, true);
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

static int daemon_start(daemon_t *d, const char *bin, const char *const *extra)
{
    int rc = daemon_mkdir(d);
    return rc ? rc : daemon_spawn(d, bin, extra);
}

/* The caller reaped the daemon itself (it signalled it and checked how it
 * exited): forget it, and remove its socket and directory. */
static inline void daemon_reaped(daemon_t *d)
{
    d->pid = 0;
    daemon_stop(d);
}

/* CPU time of all threads of pid, in ns, from /proc/PID/task/TID/schedstat
 * (exact, unlike the clock ticks of /proc/PID/stat); 0 when pid is gone. */
static inline uint64_t pid_cpu_ns(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    if (d == NULL)
        return 0;
    uint64_t sum = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char p2[400];
        snprintf(p2, sizeof p2, "%s/%s/schedstat", path, e->d_name);
        FILE *f = fopen(p2, "r");
        if (f == NULL)
            continue;
        unsigned long long v;
        if (fscanf(f, "%llu", &v) == 1)
            sum += v;
        fclose(f);
    }
    closedir(d);
    return sum;
}

/* SIGTERM, wait (SIGKILL after 10 s), remove the socket and directory.
 * 0 when the daemon exited with status 0 (nothing crashed, and under ASan
 * nothing leaked) or had already been reaped (pid 0), else -1. */
static int daemon_stop(daemon_t *d)
{
    int rc = 0;
    daemon_track(d, false);
    if (d->pid > 0) {
        kill(d->pid, SIGTERM);
        uint64_t deadline = now_ns() + 10000000000ull;
        int st = 0;
        while (waitpid(d->pid, &st, WNOHANG) == 0) {
            if (now_ns() > deadline) {
                fprintf(stderr, "test_daemon: daemon ignored SIGTERM for 10 s; killing it\n");
                kill(d->pid, SIGKILL);
                waitpid(d->pid, &st, 0);
                break;
            }
            usleep(5000);
        }
        rc = WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
        d->pid = 0;
    }
    unlink(d->sock);
    rmdir(d->dir);
    return rc;
}

#endif
