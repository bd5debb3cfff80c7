/* Daemon settings: defaults, command-line flags, and the socket path
 * chain of the contract (section 1). */
#ifndef PB_CONFIG_H
#define PB_CONFIG_H

#include <stddef.h>

#include "../kernels/tensor.h"

typedef struct pb_config {
    char socket_path[108];
    int socket_mode;
    pb_device_t device;
    int workers;
    size_t max_message_bytes;
    size_t max_tape_bytes;
    size_t max_tape_bytes_per_uid;
    size_t max_tapes_per_connection;
    size_t max_inflight_per_connection;
    double drain_timeout_s;
    int log_level;
} pb_config_t;

/* Parse argv over the defaults.  Returns 0 to run, 1 when --help or
 * --version was printed (exit 0), -1 on a bad flag (message printed). */
int pb_config_parse(pb_config_t *c, int argc, char **argv);
/* Parse "cpu", "cuda", "cuda:N" into d; 0, or PB_EINVALID_ARGUMENT. */
int pb_device_parse(const char *s, size_t len, pb_device_t *d);
/* Parse "123", "64K", "256M", "4G" (binary units). */
int pb_parse_size(const char *s, size_t *out);

#endif
