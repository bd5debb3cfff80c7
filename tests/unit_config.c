/* unit.config: daemon settings (daemon/config.c): the config file's syntax,
 * its errors, flags over the file over the defaults, and what a reload may
 * change.  Reloading a running daemon is tested end to end (e2e.reload). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "daemon/config.h"
#include "daemon/log.h"
#include "proto/errors.h"

static char dir[64];
static int nfiles;

/* A file holding text; its path is in a static buffer per call. */
static const char *file_with(const char *text)
{
    static char paths[32][96];
    char *p = paths[nfiles++ % 32];
    snprintf(p, 96, "%s/f%d.conf", dir, nfiles);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    return p;
}

/* Load with argv "pullbackd" + args (NULL-terminated). */
static int load(pb_config_t *c, const char *default_file, char *err, size_t len, ...)
{
    char *argv[32] = {"pullbackd"};
    int argc = 1;
    va_list ap;
    va_start(ap, len);
    char *a;
    while ((a = va_arg(ap, char *)) && argc < 31)
        argv[argc++] = a;
    va_end(ap);
    argv[argc] = NULL;
    err[0] = 0;
    return pb_config_load(c, argc, argv, default_file, err, len);
}

static void defaults_without_file(void **state)
{
    (void)state;
    pb_config_t c;
    char err[512];
    char missing[128];
    snprintf(missing, sizeof missing, "%s/nonexistent.conf", dir);
    /* A missing default file is fine. */
    assert_int_equal(load(&c, missing, err, sizeof err, NULL), 0);
    assert_int_equal(c.max_tape_bytes, (size_t)4 << 30);
    assert_int_equal(c.max_message_bytes, 256u << 20);
    assert_int_equal(c.socket_mode, 0660);
    assert_int_equal(c.log_level, PB_LOG_INFO);
    assert_string_equal(c.config_file, "");
    assert_true(c.socket_path[0] != 0);
    /* No default file at all. */
    assert_int_equal(load(&c, NULL, err, sizeof err, NULL), 0);
    assert_int_equal(c.max_tapes_per_connection, 65536);
    assert_int_equal(c.max_buffers_per_connection, 64);
    assert_int_equal(c.max_buffer_bytes_per_connection, (size_t)64 << 30);
}

static void good_file(void **state)
{
    (void)state;
    const char *p = file_with("# pullbackd settings\n"
                              "\n"
                              "   # an indented comment\n"
                              "max-tape-bytes = 4G\n"
                              "max_tape_bytes_per_uid=512M\n"
                              "max-tapes-per-connection = 10   # a trailing comment\n"
                              "\tmax-inflight-per-connection\t=\t7\t\r\n"
                              "max-buffers-per-connection = 0\n"
                              "max_buffer_bytes_per_connection = 1G\n"
                              "max-message-bytes = 64KiB\n"
                              "socket = /tmp/x#y.sock\n"
                              "socket-mode = 0600\n"
                              "device = cpu\n"
                              "workers = 3\n"
                              "drain-timeout = 2.5\n"
                              "log-level = debug");
    pb_config_t c;
    char err[512];
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", p, NULL), 0);
    assert_int_equal(c.max_tape_bytes, (size_t)4 << 30);
    assert_int_equal(c.max_tape_bytes_per_uid, (size_t)512 << 20);
    assert_int_equal(c.max_tapes_per_connection, 10);
    assert_int_equal(c.max_inflight_per_connection, 7);
    assert_int_equal(c.max_buffers_per_connection, 0); /* 0: register_buffer always refused */
    assert_int_equal(c.max_buffer_bytes_per_connection, (size_t)1 << 30);
    assert_int_equal(c.max_message_bytes, 64 << 10);
    assert_string_equal(c.socket_path, "/tmp/x#y.sock"); /* '#' not after a blank: part of the value */
    assert_int_equal(c.socket_mode, 0600);
    assert_int_equal(c.workers, 3);
    assert_true(c.drain_timeout_s == 2.5);
    assert_int_equal(c.log_level, PB_LOG_DEBUG);
    assert_string_equal(c.config_file, p);
    /* The same file as the default. */
    assert_int_equal(load(&c, p, err, sizeof err, NULL), 0);
    assert_int_equal(c.workers, 3);
    assert_string_equal(c.config_file, p);
}

/* Each bad file is an error naming the file, the line and the key. */
static void bad_files(void **state)
{
    (void)state;
    static const struct {
        const char *text, *expect;
    } cases[] = {
        {"max-tape-bytes = lots\n", ":1: max-tape-bytes: expected a size"},
        {"# fine\nmax-tape-byts = 1G\n", ":2: unknown key 'max-tape-byts'"},
        {"workers 4\n", ":1: expected 'key = value'"},
        {"workers = 0\n", ":1: workers: expected 1..1024"},
        {"workers = 4x\n", ":1: workers: expected 1..1024"},
        {"workers =\n", ":1: workers: missing value"},
        {"workers = 2\nworkers = 3\n", ":2: workers: given twice (first on line 1)"},
        {"max-message-bytes = 100\n", ":1: max-message-bytes: expected at least 1024"},
        {"max-tapes-per-connection = 0\n", ":1: max-tapes-per-connection: expected at least 1"},
        {"socket-mode = 999\n", ":1: socket-mode: expected an octal mode"},
        {"socket-mode =  \n", ":1: socket-mode: missing value"},
        {"device = gpu\n", ":1: device: expected cpu, cuda or cuda:N"},
        {"drain-timeout = -1\n", ":1: drain-timeout: expected seconds"},
        {"drain-timeout = inf\n", ":1: drain-timeout: expected seconds"},
        {"idle-trim = 2e9\n", ":1: idle-trim: expected seconds from 0 to 1000000000 (about 31 years), got '2e9'"},
        {"log-level = loud\n", ":1: log-level: expected error"},
        {"config = /etc/other.conf\n", ":1: unknown key 'config'"},
        {"= 4\n", ":1: unknown key ''"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *p = file_with(cases[i].text);
        pb_config_t c;
        memset(&c, 0x5a, sizeof c);
        pb_config_t before = c;
        char err[512];
        int rc = load(&c, NULL, err, sizeof err, "--config", p, NULL);
        if (rc != PB_EINVALID_ARGUMENT || strncmp(err, p, strlen(p)) != 0 || strstr(err, cases[i].expect) == NULL)
            fail_msg("case %zu (%s): rc %d, err '%s', expected '%s'", i, cases[i].text, rc, err, cases[i].expect);
        /* Nothing is written on failure. */
        assert_memory_equal(&c, &before, sizeof c);
        /* The same file as the default is just as bad: only a missing one
         * is forgiven. */
        assert_int_equal(load(&c, p, err, sizeof err, NULL), PB_EINVALID_ARGUMENT);
    }
}

static void missing_explicit_file(void **state)
{
    (void)state;
    char missing[128], err[512];
    snprintf(missing, sizeof missing, "%s/nonexistent.conf", dir);
    pb_config_t c;
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", missing, NULL), PB_EINVALID_ARGUMENT);
    assert_non_null(strstr(err, missing));
    assert_non_null(strstr(err, "No such file"));
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config=", NULL), PB_EINVALID_ARGUMENT);
    /* A directory is not a config file. */
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", dir, NULL), PB_EINVALID_ARGUMENT);
}

/* What is no settings file: /dev/zero (read line by line, it held the
 * start up for good), more than 1 MiB, a NUL inside a line.  /dev/null
 * is an empty one. */
static void odd_files(void **state)
{
    (void)state;
    pb_config_t c;
    char err[512];
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", "/dev/zero", NULL), PB_EINVALID_ARGUMENT);
    assert_non_null(strstr(err, "/dev/zero: larger than the 1 MiB"));
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", "/dev/null", NULL), 0);
    assert_int_equal(c.workers, (int)sysconf(_SC_NPROCESSORS_ONLN)); /* the default */
    const char *p = file_with("");
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    static const char text[] = "workers = 2\n# fine\nworkers = 3\0\n";
    fwrite(text, 1, sizeof text - 1, f);
    fclose(f);
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", p, NULL), PB_EINVALID_ARGUMENT);
    assert_non_null(strstr(err, ":3: the line holds a NUL byte"));
    /* A last line without its newline still counts. */
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", file_with("# a\nworkers = 5"), NULL), 0);
    assert_int_equal(c.workers, 5);
}

/* Sizes: digits, then K, M, G or T (binary; Ki, KiB and KB alike).  A
 * blank or a sign first was taken by strtoull: " -1" wrapped to 2^64 - 1. */
static void sizes(void **state)
{
    (void)state;
    static const struct {
        const char *text;
        size_t want;
    } good[] = {
        {"0", 0}, {"4096", 4096}, {"64K", 64 << 10}, {"64k", 64 << 10}, {"64KiB", 64 << 10}, {"64Ki", 64 << 10},
        {"64KB", 64 << 10}, {"256M", 256u << 20}, {"4G", (size_t)4 << 30}, {"4GiB", (size_t)4 << 30},
        {"1T", (size_t)1 << 40}, {"2t", (size_t)2 << 40}, {"18446744073709551615", SIZE_MAX},
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        size_t v = 1;
        if (pb_parse_size(good[i].text, &v) != 0 || v != good[i].want)
            fail_msg("'%s': got %zu, expected %zu", good[i].text, v, good[i].want);
    }
    static const char *const bad[] = {
        "", " -1", "-1", "\t-1", "\f-1", "\v-1", " 1", "+1", "\f5", "1 ", "K", "1X", "1i", "1B", "1iB", "1KiBB",
        "1KBi", "1.5G", "18446744073709551616", "16777216T", "0x10",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        size_t v = 7;
        if (pb_parse_size(bad[i], &v) == 0)
            fail_msg("'%s' was taken as %zu", bad[i], v);
        assert_int_equal(v, 7);
    }
    /* The same through a flag and through a file, whose line is trimmed of
     * every blank strtoull skips (\f and \v too). */
    pb_config_t c;
    char err[512];
    assert_int_equal(load(&c, NULL, err, sizeof err, "--max-tape-bytes", " -1", NULL), PB_EINVALID_ARGUMENT);
    assert_string_equal(err, "--max-tape-bytes: expected a size such as 4096, 64K, 256M, 4G or 1T, got ' -1'");
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", file_with("max-tape-bytes = \v-1\n"), NULL),
                     PB_EINVALID_ARGUMENT);
    assert_non_null(strstr(err, ":1: max-tape-bytes: expected a size"));
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", file_with("max-tape-bytes =\f2T\v\n"), NULL), 0);
    assert_int_equal(c.max_tape_bytes, (size_t)2 << 40);
    /* Other numbers do not take a blank first either. */
    assert_int_equal(load(&c, NULL, err, sizeof err, "--workers", " 3", NULL), PB_EINVALID_ARGUMENT);
    assert_int_equal(load(&c, NULL, err, sizeof err, "--drain-timeout", "\f5", NULL), PB_EINVALID_ARGUMENT);
    assert_int_equal(load(&c, NULL, err, sizeof err, "--socket-mode", " 0600", NULL), PB_EINVALID_ARGUMENT);
}

/* What a file holds is quoted in errors as protocol messages are: the
 * line goes to the journal and to STATUS=.  A byte-order mark first is
 * skipped. */
static void file_bytes(void **state)
{
    (void)state;
    pb_config_t c;
    char err[512];
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", file_with("\xef\xbb\xbfworkers = 3\n"), NULL), 0);
    assert_int_equal(c.workers, 3);
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", file_with("workers = 3\xff\x01\n"), NULL),
                     PB_EINVALID_ARGUMENT);
    assert_non_null(strstr(err, "workers: expected 1..1024, got '3\\xff\\x01'"));
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", file_with("wor\xc3kers = 3\n"), NULL),
                     PB_EINVALID_ARGUMENT);
    assert_non_null(strstr(err, "unknown key 'wor\\xc3kers'"));
    /* A mark anywhere else is no blank. */
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", file_with("# x\n\xef\xbb\xbfworkers = 3\n"),
                          NULL), PB_EINVALID_ARGUMENT);
}

/* max-buffered-bytes-per-uid is half of the max-buffered-bytes in force
 * unless it is given: it was half of the memory-based default whatever
 * the total. */
static void per_uid_buffering(void **state)
{
    (void)state;
    pb_config_t c;
    char err[512];
    assert_int_equal(load(&c, NULL, err, sizeof err, "--max-buffered-bytes", "1G", NULL), 0);
    assert_int_equal(c.max_buffered_bytes_per_uid, (size_t)512 << 20);
    const char *p = file_with("max-buffered-bytes = 2G\n");
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", p, NULL), 0);
    assert_int_equal(c.max_buffered_bytes_per_uid, (size_t)1 << 30);
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", p, "--max-buffered-bytes", "64M", NULL), 0);
    assert_int_equal(c.max_buffered_bytes_per_uid, (size_t)32 << 20);
    /* Given, it stays, above the total too (pb_config_warn says so). */
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", p, "--max-buffered-bytes-per-uid", "3G", NULL), 0);
    assert_int_equal(c.max_buffered_bytes_per_uid, (size_t)3 << 30);
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config",
                          file_with("max-buffered-bytes-per-uid = 100M\nmax-buffered-bytes = 4G\n"), NULL), 0);
    assert_int_equal(c.max_buffered_bytes_per_uid, (size_t)100 << 20);
}

/* A reload with the default file gone keeps the settings when they came
 * from it (every setting went back to its default); a default file that
 * was missing at start may still be missing, or appear. */
static void reload_default_file(void **state)
{
    (void)state;
    char path[128], err[512];
    snprintf(path, sizeof path, "%s/default.conf", dir);
    char *argv[] = {"pullbackd", "--workers", "2", NULL};
    pb_config_t cur, n;
    unlink(path);
    assert_int_equal(pb_config_load(&cur, 3, argv, path, err, sizeof err), 0);
    assert_string_equal(cur.config_file, "");
    assert_int_equal(pb_config_reload(&n, &cur, 3, argv, path, err, sizeof err), 0);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("max-tape-bytes = 1G\n", f);
    fclose(f);
    assert_int_equal(pb_config_reload(&n, &cur, 3, argv, path, err, sizeof err), 0);
    assert_int_equal(n.max_tape_bytes, (size_t)1 << 30);
    assert_string_equal(n.config_file, path);
    cur = n;
    assert_int_equal(unlink(path), 0);
    memset(&n, 0x5a, sizeof n);
    pb_config_t before = n;
    assert_int_equal(pb_config_reload(&n, &cur, 3, argv, path, err, sizeof err), PB_EINVALID_ARGUMENT);
    assert_non_null(strstr(err, path));
    assert_non_null(strstr(err, "No such file"));
    assert_memory_equal(&n, &before, sizeof n);
    /* At start a missing default file is still fine. */
    assert_int_equal(pb_config_load(&n, 3, argv, path, err, sizeof err), 0);
    assert_int_equal(n.max_tape_bytes, (size_t)4 << 30);
    /* An explicit --config was required at every load already. */
    char *argv2[] = {"pullbackd", "--config", path, NULL};
    assert_int_equal(pb_config_reload(&n, &cur, 3, argv2, "/nonexistent/pullbackd.conf", err, sizeof err),
                     PB_EINVALID_ARGUMENT);
}

static void flags_win(void **state)
{
    (void)state;
    const char *p = file_with("max-tape-bytes = 1M\nmax-tapes-per-connection = 5\nlog-level = debug\n"
                              "socket = /tmp/from-file.sock\n");
    pb_config_t c;
    char err[512];
    assert_int_equal(load(&c, NULL, err, sizeof err, "--max-tapes-per-connection", "7", "--config", p,
                          "--log-level=warning", NULL), 0);
    assert_int_equal(c.max_tape_bytes, 1 << 20);      /* the file's */
    assert_int_equal(c.max_tapes_per_connection, 7);  /* the flag's, given before --config */
    assert_int_equal(c.log_level, PB_LOG_WARNING);
    assert_string_equal(c.socket_path, "/tmp/from-file.sock");
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", p, "--socket", "/tmp/flag.sock", NULL), 0);
    assert_string_equal(c.socket_path, "/tmp/flag.sock");
    /* A flag over a bad line does not hide the bad line. */
    const char *q = file_with("max-tape-bytes = lots\n");
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", q, "--max-tape-bytes", "1G", NULL),
                     PB_EINVALID_ARGUMENT);
    assert_non_null(strstr(err, "max-tape-bytes"));
    /* Loading again (a reload) gives the same answer: getopt starts
     * afresh each time. */
    for (int i = 0; i < 3; i++) {
        assert_int_equal(load(&c, NULL, err, sizeof err, "--config", p, "--max-tapes-per-connection", "9", NULL), 0);
        assert_int_equal(c.max_tapes_per_connection, 9);
        assert_int_equal(c.max_tape_bytes, 1 << 20);
    }
}

static void bad_flags(void **state)
{
    (void)state;
    pb_config_t c;
    char err[512];
    assert_int_equal(load(&c, NULL, err, sizeof err, "--max-tape-byts", "1", NULL), PB_EINVALID_ARGUMENT);
    assert_non_null(strstr(err, "unknown option '--max-tape-byts'"));
    assert_int_equal(load(&c, NULL, err, sizeof err, "--workers", NULL), PB_EINVALID_ARGUMENT);
    assert_non_null(strstr(err, "--workers: missing value"));
    assert_int_equal(load(&c, NULL, err, sizeof err, "--workers", "0", NULL), PB_EINVALID_ARGUMENT);
    assert_string_equal(err, "--workers: expected 1..1024, got '0'");
    assert_int_equal(load(&c, NULL, err, sizeof err, "--socket-mode", "", NULL), PB_EINVALID_ARGUMENT);
    assert_int_equal(load(&c, NULL, err, sizeof err, "stray", NULL), PB_EINVALID_ARGUMENT);
    assert_non_null(strstr(err, "unexpected argument 'stray'"));
    assert_int_equal(load(&c, NULL, err, sizeof err, "--version", NULL), 1);
    /* An abbreviation several options begin with is ambiguous, not
     * unknown; one that only one begins with is that option. */
    assert_int_equal(load(&c, NULL, err, sizeof err, "--max-tape", "9", NULL), PB_EINVALID_ARGUMENT);
    assert_string_equal(err, "ambiguous option '--max-tape': could be --max-tape-bytes, --max-tape-bytes-per-uid, "
                             "--max-tapes-per-connection");
    assert_int_equal(load(&c, NULL, err, sizeof err, "--max-tape-bytes-p=5K", NULL), 0);
    assert_int_equal(c.max_tape_bytes_per_uid, 5 << 10);
    assert_int_equal(load(&c, NULL, err, sizeof err, "--max-b=1", NULL), PB_EINVALID_ARGUMENT);
    assert_non_null(strstr(err, "ambiguous option '--max-b': could be --max-buffers-per-connection, "));
}

static void socket_chain(void **state)
{
    (void)state;
    pb_config_t c;
    char err[512];
    setenv("PULLBACKD_SOCKET", "/tmp/env.sock", 1);
    assert_int_equal(load(&c, NULL, err, sizeof err, NULL), 0);
    assert_string_equal(c.socket_path, "/tmp/env.sock");
    /* The file's socket counts as --socket, above the environment. */
    const char *p = file_with("socket = /tmp/file.sock\n");
    assert_int_equal(load(&c, NULL, err, sizeof err, "--config", p, NULL), 0);
    assert_string_equal(c.socket_path, "/tmp/file.sock");
    unsetenv("PULLBACKD_SOCKET");
    setenv("RUNTIME_DIRECTORY", "/run/pullbackd:/run/other", 1);
    assert_int_equal(load(&c, NULL, err, sizeof err, NULL), 0);
    assert_string_equal(c.socket_path, "/run/pullbackd/pullbackd.sock");
    /* An empty first entry goes on down the chain, as the clients do (it
     * gave /pullbackd.sock, in the root directory). */
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    char *xdg_was = xdg ? strdup(xdg) : NULL;
    setenv("RUNTIME_DIRECTORY", ":/run/other", 1);
    setenv("XDG_RUNTIME_DIR", "/run/user/7", 1);
    assert_int_equal(load(&c, NULL, err, sizeof err, NULL), 0);
    assert_string_equal(c.socket_path, "/run/user/7/pullbackd.sock");
    if (xdg_was)
        setenv("XDG_RUNTIME_DIR", xdg_was, 1);
    else
        unsetenv("XDG_RUNTIME_DIR");
    free(xdg_was);
    unsetenv("RUNTIME_DIRECTORY");
    char longp[200];
    memset(longp, 'a', sizeof longp - 1);
    longp[sizeof longp - 1] = 0;
    setenv("PULLBACKD_SOCKET", longp, 1);
    assert_int_equal(load(&c, NULL, err, sizeof err, NULL), PB_EINVALID_ARGUMENT);
    assert_int_equal(load(&c, NULL, err, sizeof err, "--socket", "/tmp/ok.sock", NULL), 0);
    unsetenv("PULLBACKD_SOCKET");
}

typedef struct {
    int n, reloadable;
    char keys[256];
} diff_t;

static void on_diff(const char *key, const char *from, const char *to, bool reloadable, void *ctx)
{
    diff_t *d = ctx;
    d->n++;
    d->reloadable += reloadable;
    size_t o = strlen(d->keys);
    snprintf(d->keys + o, sizeof d->keys - o, "%s%s:%s>%s", o ? " " : "", key, from, to);
}

static void diff_and_set(void **state)
{
    (void)state;
    pb_config_t a, b;
    char err[512];
    assert_int_equal(load(&a, NULL, err, sizeof err, "--socket", "/tmp/a.sock", NULL), 0);
    b = a;
    diff_t d = {0};
    pb_config_diff(&a, &b, on_diff, &d);
    assert_int_equal(d.n, 0);
    assert_int_equal(pb_config_set(&b, "max-tape-bytes", "2K", err, sizeof err), 0);
    assert_int_equal(pb_config_set(&b, "log-level", "debug", err, sizeof err), 0);
    assert_int_equal(pb_config_set(&b, "workers", "5", err, sizeof err), 0);
    assert_int_equal(pb_config_set(&b, "socket-mode", "0600", err, sizeof err), 0);
    assert_int_equal(pb_config_set(&b, "device", "cuda:1", err, sizeof err), 0);
    assert_int_equal(pb_config_set(&b, "nope", "1", err, sizeof err), PB_EINVALID_ARGUMENT);
    pb_config_diff(&a, &b, on_diff, &d);
    assert_int_equal(d.n, 5);
    assert_int_equal(d.reloadable, 2); /* max-tape-bytes, log-level */
    assert_non_null(strstr(d.keys, "max-tape-bytes:4294967296>2048"));
    assert_non_null(strstr(d.keys, "log-level:info>debug"));
    assert_non_null(strstr(d.keys, "socket-mode:0660>0600"));
    assert_non_null(strstr(d.keys, "device:cpu>cuda:1"));
}

/* Every row's default parses and is what a load without file or flags
 * gives; every size row can be set by name. */
static void table_defaults(void **state)
{
    (void)state;
    size_t n;
    const pb_setting_t *t = pb_config_settings(&n);
    assert_true(n >= 14);
    pb_config_t c, d;
    char err[512];
    assert_int_equal(load(&c, NULL, err, sizeof err, "--socket", "/tmp/t.sock", NULL), 0);
    for (size_t k = 0; k < n; k++) {
        assert_non_null(t[k].help);
        assert_non_null(t[k].arg);
        if (t[k].def == NULL)
            continue;
        d = c;
        memset((char *)&d + t[k].off, 0x5a, t[k].size);
        assert_int_equal(pb_config_set(&d, t[k].name, t[k].def, err, sizeof err), 0);
        assert_memory_equal((char *)&d + t[k].off, (char *)&c + t[k].off, t[k].size);
    }
    assert_int_equal(c.max_queued_bytes_per_connection, (size_t)64 << 20);
    assert_int_equal(c.max_message_bytes, (size_t)256 << 20);
    /* Buffering caps from the memory: a quarter, at least 512M; half per uid. */
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    size_t quarter = (size_t)pages * (size_t)psz / 4;
    assert_int_equal(c.max_buffered_bytes, quarter > ((size_t)512 << 20) ? quarter : (size_t)512 << 20);
    assert_int_equal(c.max_buffered_bytes_per_uid, c.max_buffered_bytes / 2);
    assert_int_equal(c.max_connections_per_uid, 1024);
    assert_int_equal(c.socket_mode, 0660);
    assert_int_equal(c.log_level, PB_LOG_INFO);
    assert_true(c.workers >= 1);
}

/* hello's limits are the rows that name one, in table order, with the
 * configured values; the seven clients have always seen come first. */
static void limits_from_table(void **state)
{
    (void)state;
    pb_config_t c;
    char err[512];
    assert_int_equal(load(&c, NULL, err, sizeof err, "--socket", "/tmp/t.sock", "--max-tape-bytes", "3M",
                          "--max-queued-bytes-per-connection", "1M", NULL), 0);
    pb_config_limit_t lim[PB_CONFIG_MAX_LIMITS];
    int n = pb_config_limits(&c, lim);
    static const char *const want[] = {"max_message_bytes", "max_tape_bytes", "max_tape_bytes_per_uid",
                                       "max_tapes_per_connection", "max_inflight_per_connection",
                                       "max_buffers_per_connection", "max_buffer_bytes_per_connection",
                                       "max_queued_bytes_per_connection", "max_buffered_bytes",
                                       "max_buffered_bytes_per_uid", "max_connections_per_uid",
                                       "max_device_tape_bytes"};
    assert_int_equal(n, 12);
    for (int i = 0; i < n; i++)
        assert_string_equal(lim[i].name, want[i]);
    assert_int_equal(lim[1].value, 3u << 20);
    assert_int_equal(lim[7].value, 1u << 20);
    /* Each limit is a setting whose key is its name with dashes. */
    size_t nrows;
    const pb_setting_t *t = pb_config_settings(&nrows);
    for (int i = 0; i < n; i++) {
        int found = 0;
        for (size_t k = 0; k < nrows; k++) {
            char key[64];
            snprintf(key, sizeof key, "%s", t[k].name);
            for (char *p = key; *p; p++)
                if (*p == '-')
                    *p = '_';
            found += strcmp(key, lim[i].name) == 0 && t[k].limit != NULL;
        }
        assert_int_equal(found, 1);
    }
}

/* A reload copies exactly the reloadable rows (and the file's name). */
static void apply_reloadable(void **state)
{
    (void)state;
    pb_config_t a, b;
    char err[512];
    assert_int_equal(load(&a, NULL, err, sizeof err, "--socket", "/tmp/a.sock", NULL), 0);
    assert_int_equal(load(&b, NULL, err, sizeof err, "--socket", "/tmp/b.sock", "--workers", "7", "--socket-mode",
                          "0600", "--max-tape-bytes", "1M", "--max-queued-bytes-per-connection", "2M",
                          "--log-level", "debug", "--drain-timeout", "5", NULL), 0);
    snprintf(b.config_file, sizeof b.config_file, "/etc/new.conf");
    pb_config_t r = a;
    pb_config_apply_reloadable(&r, &b);
    assert_string_equal(r.socket_path, "/tmp/a.sock");
    assert_int_equal(r.socket_mode, a.socket_mode);
    assert_int_equal(r.workers, a.workers);
    assert_int_equal(r.max_tape_bytes, 1u << 20);
    assert_int_equal(r.max_queued_bytes_per_connection, 2u << 20);
    assert_int_equal(r.log_level, PB_LOG_DEBUG);
    assert_true(r.drain_timeout_s == 5.0);
    assert_string_equal(r.config_file, "/etc/new.conf");
    /* What it leaves is what diff calls a restart. */
    diff_t d = {0};
    pb_config_diff(&r, &b, on_diff, &d);
    assert_int_equal(d.reloadable, 0);
    assert_int_equal(d.n, 3); /* socket, socket-mode, workers */
}

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/pbconf.XXXXXX");
    unsetenv("PULLBACKD_SOCKET");
    return mkdtemp(dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(defaults_without_file), cmocka_unit_test(good_file),
        cmocka_unit_test(bad_files),             cmocka_unit_test(missing_explicit_file),
        cmocka_unit_test(odd_files),
        cmocka_unit_test(flags_win),             cmocka_unit_test(bad_flags),
        cmocka_unit_test(socket_chain),          cmocka_unit_test(diff_and_set),
        cmocka_unit_test(table_defaults),        cmocka_unit_test(limits_from_table),
        cmocka_unit_test(apply_reloadable),      cmocka_unit_test(sizes),
        cmocka_unit_test(file_bytes),            cmocka_unit_test(per_uid_buffering),
        cmocka_unit_test(reload_default_file),
    };
    return cmocka_run_group_tests_name("unit.config", tests, setup, teardown);
}
