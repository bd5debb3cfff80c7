#include "metrics.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const double PB_METRICS_BOUNDS[PB_METRICS_NBUCKETS] = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
};

void pb_metrics_init(pb_metrics_t *m, const char *const *methods, int n)
{
    memset(m, 0, sizeof *m);
    m->methods = methods;
    m->nmethods = n < PB_METRICS_MAX_METHODS ? n : PB_METRICS_MAX_METHODS;
}

void pb_metrics_observe(pb_metrics_t *m, int method, int code, uint64_t ns)
{
    if (method < 0 || method > m->nmethods)
        method = m->nmethods;
    int outcome = code < 0 && -code < PB_METRICS_NOUTCOMES ? -code : 0;
    if (code < 0 && outcome == 0)
        outcome = -PB_EINTERNAL;
    m->count[method][outcome]++;
    double s = (double)ns / 1e9;
    int b = 0;
    while (b < PB_METRICS_NBUCKETS && s > PB_METRICS_BOUNDS[b])
        b++;
    if (b < PB_METRICS_NBUCKETS)
        m->bucket[method][b]++;
    m->observed[method]++;
    m->seconds[method] += s;
}

/* ---- text writer ---------------------------------------------------------- */

void pb_prom_init(pb_prom_t *p)
{
    memset(p, 0, sizeof *p);
}

void pb_prom_free(pb_prom_t *p)
{
    free(p->buf);
    pb_prom_init(p);
}

static void put(pb_prom_t *p, const char *s, size_t n)
{
    if (p->failed)
        return;
    if (p->len + n + 1 > p->cap) {
        size_t cap = p->cap ? p->cap : 4096;
        while (cap < p->len + n + 1)
            cap *= 2;
        char *nb = realloc(p->buf, cap);
        if (nb == NULL) {
            p->failed = true;
            return;
        }
        p->buf = nb;
        p->cap = cap;
    }
    memcpy(p->buf + p->len, s, n);
    p->len += n;
    p->buf[p->len] = '\0';
}

static void puts_(pb_prom_t *p, const char *s)
{
    put(p, s, strlen(s));
}

void pb_prom_number(char *buf, double v)
{
    if (isnan(v)) {
        strcpy(buf, "NaN");
        return;
    }
    if (isinf(v)) {
        strcpy(buf, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    /* Counts print as integers (2000, not %g's 2e+03). */
    if (v == floor(v) && fabs(v) < 9007199254740992.0) {
        snprintf(buf, 32, "%.0f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, 32, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            return;
    }
}

/* Label values escape backslash, double quote and newline (the format's
 * three); HELP text escapes backslash and newline. */
static void put_escaped(pb_prom_t *p, const char *s, bool quote)
{
    for (; *s; s++) {
        if (*s == '\\')
            puts_(p, "\\\\");
        else if (*s == '\n')
            puts_(p, "\\n");
        else if (*s == '"' && quote)
            puts_(p, "\\\"");
        else
            put(p, s, 1);
    }
}

void pb_prom_family(pb_prom_t *p, const char *name, const char *type, const char *help)
{
    puts_(p, "# HELP ");
    puts_(p, name);
    puts_(p, " ");
    put_escaped(p, help, false);
    puts_(p, "\n# TYPE ");
    puts_(p, name);
    puts_(p, " ");
    puts_(p, type);
    puts_(p, "\n");
}

void pb_prom_sample(pb_prom_t *p, const char *name, const pb_label_t *labels, double value)
{
    puts_(p, name);
    if (labels && labels[0].key) {
        puts_(p, "{");
        for (const pb_label_t *l = labels; l->key; l++) {
            if (l != labels)
                puts_(p, ",");
            puts_(p, l->key);
            puts_(p, "=\"");
            put_escaped(p, l->value, true);
            puts_(p, "\"");
        }
        puts_(p, "}");
    }
    char num[32];
    pb_prom_number(num, value);
    puts_(p, " ");
    puts_(p, num);
    puts_(p, "\n");
}

static const char *method_name(const pb_metrics_t *m, int i)
{
    return i < m->nmethods ? m->methods[i] : "other";
}

void pb_metrics_write(const pb_metrics_t *m, pb_prom_t *p)
{
    pb_prom_family(p, "pullbackd_requests_total", "counter",
                   "Requests answered, by method and outcome (ok or the error code).");
    for (int i = 0; i <= m->nmethods; i++)
        for (int k = 0; k < PB_METRICS_NOUTCOMES; k++) {
            /* ok is always shown for a known method so that rates start
             * at zero; errors only once they happened. */
            if (m->count[i][k] == 0 && (k != 0 || i == m->nmethods))
                continue;
            pb_label_t l[] = {{"method", method_name(m, i)},
                              {"outcome", k == 0 ? "ok" : pb_strerror_code(-k)},
                              {NULL, NULL}};
            pb_prom_sample(p, "pullbackd_requests_total", l, (double)m->count[i][k]);
        }
    pb_prom_family(p, "pullbackd_request_duration_seconds", "histogram",
                   "Time from a request's arrival to its reply being queued.");
    char le[PB_METRICS_NBUCKETS + 1][32]; /* the bounds' text, once per scrape */
    for (int b = 0; b < PB_METRICS_NBUCKETS; b++)
        pb_prom_number(le[b], PB_METRICS_BOUNDS[b]);
    strcpy(le[PB_METRICS_NBUCKETS], "+Inf");
    for (int i = 0; i <= m->nmethods; i++) {
        if (i == m->nmethods && m->observed[i] == 0)
            continue;
        uint64_t cum = 0;
        for (int b = 0; b <= PB_METRICS_NBUCKETS; b++) {
            cum = b < PB_METRICS_NBUCKETS ? cum + m->bucket[i][b] : m->observed[i];
            pb_label_t l[] = {{"method", method_name(m, i)}, {"le", le[b]}, {NULL, NULL}};
            pb_prom_sample(p, "pullbackd_request_duration_seconds_bucket", l, (double)cum);
        }
        pb_label_t l[] = {{"method", method_name(m, i)}, {NULL, NULL}};
        pb_prom_sample(p, "pullbackd_request_duration_seconds_sum", l, m->seconds[i]);
        pb_prom_sample(p, "pullbackd_request_duration_seconds_count", l, (double)m->observed[i]);
    }
}
