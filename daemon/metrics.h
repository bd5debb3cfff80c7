/* Operators' figures: request counters and latency histograms kept by the
 * daemon, and a writer of the Prometheus text exposition format (0.0.4)
 * that the `metrics` method fills from them and from the live gauges.
 *
 * Glossary
 *   method   index into the method names given to pb_metrics_init; one
 *            more slot, "other", counts the names nobody knows (a client
 *            cannot grow the table by inventing methods).
 *   outcome  "ok" or the wire name of the error code (PROTOCOL section 5).
 *   latency  from the message being framed to its reply being queued, in
 *            the histogram buckets PB_METRICS_BOUNDS (seconds).
 *
 * Ownership: pb_metrics_t is a plain value inside the server, touched only
 * on the loop thread.  pb_prom_t owns its text buffer (malloc); the caller
 * takes it with pb_prom_take or frees it with pb_prom_free. */
#ifndef PB_METRICS_H
#define PB_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../proto/errors.h"

#define PB_METRICS_MAX_METHODS 24
#define PB_METRICS_NBUCKETS 16
/* Outcome slots: 0 is "ok", slot k is the error code -k. */
#define PB_METRICS_NOUTCOMES 17

typedef struct pb_metrics {
    const char *const *methods;    /* borrowed, static table */
    int nmethods;                  /* slot nmethods is "other" */
    uint64_t count[PB_METRICS_MAX_METHODS + 1][PB_METRICS_NOUTCOMES];
    uint64_t bucket[PB_METRICS_MAX_METHODS + 1][PB_METRICS_NBUCKETS]; /* not cumulative */
    uint64_t observed[PB_METRICS_MAX_METHODS + 1];
    double seconds[PB_METRICS_MAX_METHODS + 1];
} pb_metrics_t;

/* Upper bounds of the latency buckets in seconds, 100 µs to 10 s. */
extern const double PB_METRICS_BOUNDS[PB_METRICS_NBUCKETS];

/* methods: n static names (n <= PB_METRICS_MAX_METHODS). */
void pb_metrics_init(pb_metrics_t *m, const char *const *methods, int n);
/* One request of method slot `method` ended with code (0 or PB_E*) after
 * ns nanoseconds. */
void pb_metrics_observe(pb_metrics_t *m, int method, int code, uint64_t ns);

/* ---- Prometheus text writer --------------------------------------------- */

typedef struct pb_prom {
    char *buf;
    size_t len, cap;
    bool failed;  /* an allocation failed; the text is incomplete */
} pb_prom_t;

/* A label of a sample; a NULL key ends the list.  Values are escaped. */
typedef struct pb_label {
    const char *key, *value;
} pb_label_t;

void pb_prom_init(pb_prom_t *p);
void pb_prom_free(pb_prom_t *p);
/* `# HELP` and `# TYPE` lines of a family; type is "counter", "gauge" or
 * "histogram". */
void pb_prom_family(pb_prom_t *p, const char *name, const char *type, const char *help);
/* One sample `name{labels} value`; labels may be NULL. */
void pb_prom_sample(pb_prom_t *p, const char *name, const pb_label_t *labels, double value);
/* Every family of m: pullbackd_requests_total and
 * pullbackd_request_duration_seconds. */
void pb_metrics_write(const pb_metrics_t *m, pb_prom_t *p);
/* The shortest decimal text that reads back as v ("+Inf", "NaN" too);
 * buf holds at least 32 bytes. */
void pb_prom_number(char *buf, double v);

#endif
