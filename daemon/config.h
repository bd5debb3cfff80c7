/* Daemon settings: defaults, a config file, command-line flags, and the
 * socket path chain of the contract (section 1).
 *
 * Every setting has one name, used both as a flag (`--max-tape-bytes 4G`)
 * and as a config-file key (`max-tape-bytes = 4G`; `max_tape_bytes` is
 * accepted too).  The file is /etc/pullbackd/pullbackd.conf unless
 * `--config PATH` names another: one `key = value` per line, blank lines and
 * lines starting with `#` ignored, and a `#` after a blank starts a trailing
 * comment.  A missing default file is no error at start; a missing --config
 * file, an unknown key, a key given twice or a bad value is, and so is, at a
 * reload, a default file that was read before and is gone.  Precedence:
 * flags over the file over the built-in defaults; a `socket` key in the
 * file counts as --socket (above $PULLBACKD_SOCKET and the rest of the
 * chain).
 *
 * Reloading (SIGHUP) runs the same load again, flags still winning, and
 * applies only the reloadable settings: the limits, --drain-timeout and
 * --log-level.  The socket, its mode, the device and the worker counts
 * need a restart (pb_config_diff says which is which).
 *
 * One table (pb_config_settings, in config.c) is the only list of
 * settings: each row names a setting, its type, default, bounds, whether a
 * reload applies it, whether hello reports it among its limits (and under
 * which name), and its --help text.  The getopt options, --help, the
 * config file's keys, the defaults, pb_config_diff,
 * pb_config_apply_reloadable and pb_config_limits are all loops over it:
 * a new setting is a field here and a row there. */
#ifndef PB_CONFIG_H
#define PB_CONFIG_H

#include <stdbool.h>
#include <stddef.h>

#include "../kernels/tensor.h"

#define PB_CONFIG_FILE "/etc/pullbackd/pullbackd.conf"

typedef struct pb_config {
    char socket_path[108];
    int socket_mode;
    pb_device_t device;
    int workers;
    int gpu_workers;                         /* per GPU */
    size_t gpu_lane_flops;                   /* cost from which a GPU job takes the large lane */
    size_t max_message_bytes;
    size_t max_tape_bytes;
    size_t max_tape_bytes_per_uid;
    size_t max_device_tape_bytes;        /* tapes on each GPU */
    size_t max_device_bytes;             /* each GPU's memory for tapes and requests; 0: 7/8 of it */
    size_t max_tapes_per_connection;
    size_t max_inflight_per_connection;
    size_t max_buffers_per_connection;       /* shared-memory buffers registered at once */
    size_t max_buffer_bytes_per_connection;  /* their registered sizes summed (address space mapped) */
    size_t max_queued_bytes_per_connection;  /* queued + reserved reply bytes before reading stops (server.h) */
    size_t max_buffered_bytes;               /* all connections' held bytes (conn.h) before reading stops */
    size_t max_buffered_bytes_per_uid;       /* the same, per uid */
    size_t max_connections_per_uid;          /* open connections of one uid */
    double drain_timeout_s;
    size_t memory_cache_bytes;               /* freed large blocks kept mapped (kernels/mem.h) */
    double idle_trim_s;                      /* idle seconds before the heap is trimmed; 0: never */
    int log_level;
    /* Where the settings came from: the file that was read ("" when the
     * default file does not exist), for logs and reloads. */
    char config_file[256];
} pb_config_t;

/* Defaults, then the config file (--config, else default_file; NULL: no
 * default file), then argv's flags.  Returns 0 to run; 1 when --help or
 * --version was printed to stdout (exit 0); PB_EINVALID_ARGUMENT with a
 * one-line reason in err (never printed) for a bad flag, a missing
 * --config file or a bad file.  c is written only on success. */
int pb_config_load(pb_config_t *c, int argc, char **argv, const char *default_file, char *err, size_t errlen);
/* A SIGHUP's load: as pb_config_load, but when cur's settings came from
 * the default file, that file is required: one gone since is an error
 * (the running settings stay), not every setting back to its default.
 * A default file missing at start may still be missing, or appear. */
int pb_config_reload(pb_config_t *c, const pb_config_t *cur, int argc, char **argv, const char *default_file,
                     char *err, size_t errlen);
/* Apply the settings of the file at path over c.  A missing file is
 * PB_EINVALID_ARGUMENT when required, else 0 with c untouched.  Errors say
 * "PATH:LINE: key: why" in err; c is then partly updated, so parse into a
 * copy.  Keys in skip_mask (bit i: the i-th key of pb_config_keys) are
 * checked but not applied: the flags that override them. */
int pb_config_read_file(pb_config_t *c, const char *path, bool required, unsigned skip_mask, char *err,
                        size_t errlen);
/* Set one setting by its flag or key name from its text, as a flag or a
 * file line would.  0, or PB_EINVALID_ARGUMENT with the reason in err. */
int pb_config_set(pb_config_t *c, const char *key, const char *value, char *err, size_t errlen);
/* Call fn for every setting whose value differs between a and b, with
 * both values as text and whether a reload may apply it. */
void pb_config_diff(const pb_config_t *a, const pb_config_t *b,
                    void (*fn)(const char *key, const char *from, const char *to, bool reloadable, void *ctx),
                    void *ctx);
typedef enum pb_setting_type {
    PB_SET_PATH,    /* a socket path (char[108]) */
    PB_SET_MODE,    /* an octal file mode (int) */
    PB_SET_DEVICE,  /* cpu, cuda, cuda:N (pb_device_t) */
    PB_SET_INT,     /* an int within [min, max] */
    PB_SET_SIZE,    /* a size_t with K, M, G, T suffixes, at least min */
    PB_SET_SECONDS, /* a double within [min, max] */
    PB_SET_LOG,     /* a log level (int) */
} pb_setting_type_t;

/* One row of the settings table.  Static data: nothing to free. */
typedef struct pb_setting {
    const char *name;        /* the flag without --, and the file's key */
    pb_setting_type_t type;
    size_t off, size;        /* the field in pb_config_t */
    const char *def;         /* the default as a flag would give it; NULL: computed (socket chain, CPUs) */
    unsigned long long min, max; /* bounds of INT, SIZE (min only) and SECONDS */
    bool reloadable;         /* SIGHUP applies it in place */
    const char *limit;       /* its name in hello's limits; NULL: not reported */
    const char *arg;         /* the value's name in --help */
    const char *help;        /* --help text; '\n' continues on an indented line */
} pb_setting_t;

/* The settings table and its length. */
const pb_setting_t *pb_config_settings(size_t *n);

/* What hello reports as limits: names and values, in table order. */
#define PB_CONFIG_MAX_LIMITS 16
typedef struct pb_config_limit {
    const char *name;
    unsigned long long value;
} pb_config_limit_t;
/* The machine's memory in bytes (0 when unknown): defaults and stats. */
size_t pb_config_phys_memory(void);
/* Fill out (PB_CONFIG_MAX_LIMITS entries) with c's limits; their count. */
int pb_config_limits(const pb_config_t *c, pb_config_limit_t *out);

/* Log (warning) what a load accepts but an operator hardly means: a
 * per-uid buffering cap above the total. */
void pb_config_warn(const pb_config_t *c);

/* A reload: copy the reloadable settings of from into to, and the name of
 * the file they came from; the others stay as they are. */
void pb_config_apply_reloadable(pb_config_t *to, const pb_config_t *from);

/* Parse "cpu", "cuda", "cuda:N" into d; 0, or PB_EINVALID_ARGUMENT. */
int pb_device_parse(const char *s, size_t len, pb_device_t *d);
/* Parse "123", "64K", "256M", "4G", "1T" (binary units; "4Gi", "4GiB"
 * and "4GB" are 4G too): digits first, no blank or sign.  0, or -1. */
int pb_parse_size(const char *s, size_t *out);

#endif
