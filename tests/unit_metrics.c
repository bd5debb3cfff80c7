/* unit.metrics: request counters, latency histograms and the Prometheus
 * text writer (daemon/metrics.c).  The whole `metrics` reply is checked
 * with promtool end to end (e2e.cli). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/metrics.h"

static const char *const names[] = {"hello", "forward", "reverse"};

static void buckets(void **state)
{
    (void)state;
    pb_metrics_t m;
    pb_metrics_init(&m, names, 3);
    pb_metrics_observe(&m, 0, 0, 50000);       /* 50 µs: first bucket */
    pb_metrics_observe(&m, 0, 0, 1000000);     /* exactly 1 ms: le="0.001" */
    pb_metrics_observe(&m, 0, 0, 1000001);     /* just above: le="0.0025" */
    pb_metrics_observe(&m, 0, 0, 60000000000); /* 60 s: only +Inf */
    pb_metrics_observe(&m, 1, PB_EINVALID_ARGUMENT, 10);
    pb_metrics_observe(&m, 9, PB_ENOMEM, 10);  /* bad slot -> other */
    assert_int_equal(m.bucket[0][0], 1);
    assert_int_equal(m.bucket[0][3], 1);
    assert_int_equal(m.bucket[0][4], 1);
    assert_int_equal(m.observed[0], 4);
    assert_int_equal(m.count[0][0], 4);
    assert_int_equal(m.count[1][-PB_EINVALID_ARGUMENT], 1);
    assert_int_equal(m.count[3][-PB_ENOMEM], 1);
    assert_true(m.seconds[0] > 60.0 && m.seconds[0] < 60.01);
}

static void numbers(void **state)
{
    (void)state;
    char b[32];
    pb_prom_number(b, 0.1);
    assert_string_equal(b, "0.1");
    pb_prom_number(b, 0.0001);
    assert_string_equal(b, "0.0001");
    pb_prom_number(b, 3);
    assert_string_equal(b, "3");
    pb_prom_number(b, 2000); /* counts as integers, not 2e+03 */
    assert_string_equal(b, "2000");
    pb_prom_number(b, -1e6);
    assert_string_equal(b, "-1000000");
    pb_prom_number(b, 9007199254740992.0);
    assert_string_equal(b, "9007199254740992");
    pb_prom_number(b, 1.0 / 3.0);
    assert_true(strtod(b, NULL) == 1.0 / 3.0);
    pb_prom_number(b, 1.0 / 0.0);
    assert_string_equal(b, "+Inf");
}

static void text(void **state)
{
    (void)state;
    pb_metrics_t m;
    pb_metrics_init(&m, names, 3);
    pb_metrics_observe(&m, 1, 0, 2000000);
    pb_metrics_observe(&m, 1, 0, 20000000);
    pb_metrics_observe(&m, 2, PB_EUNKNOWN_TAPE, 1000);
    pb_prom_t p;
    pb_prom_init(&p);
    pb_metrics_write(&m, &p);
    pb_label_t l[] = {{"who", "a \"b\"\\c\nd"}, {NULL, NULL}};
    pb_prom_sample(&p, "x", l, 1);
    assert_false(p.failed);
    const char *t = p.buf;
    assert_non_null(strstr(t, "# TYPE pullbackd_requests_total counter\n"));
    assert_non_null(strstr(t, "pullbackd_requests_total{method=\"hello\",outcome=\"ok\"} 0\n"));
    assert_non_null(strstr(t, "pullbackd_requests_total{method=\"forward\",outcome=\"ok\"} 2\n"));
    assert_non_null(strstr(t, "pullbackd_requests_total{method=\"reverse\",outcome=\"unknown_tape\"} 1\n"));
    assert_null(strstr(t, "method=\"other\""));
    /* Cumulative buckets: 2 ms lands in le=0.0025, 20 ms in le=0.025. */
    assert_non_null(strstr(t, "pullbackd_request_duration_seconds_bucket{method=\"forward\",le=\"0.001\"} 0\n"));
    assert_non_null(strstr(t, "pullbackd_request_duration_seconds_bucket{method=\"forward\",le=\"0.0025\"} 1\n"));
    assert_non_null(strstr(t, "pullbackd_request_duration_seconds_bucket{method=\"forward\",le=\"0.01\"} 1\n"));
    assert_non_null(strstr(t, "pullbackd_request_duration_seconds_bucket{method=\"forward\",le=\"0.025\"} 2\n"));
    assert_non_null(strstr(t, "pullbackd_request_duration_seconds_bucket{method=\"forward\",le=\"+Inf\"} 2\n"));
    assert_non_null(strstr(t, "pullbackd_request_duration_seconds_sum{method=\"forward\"} 0.022\n"));
    assert_non_null(strstr(t, "pullbackd_request_duration_seconds_count{method=\"forward\"} 2\n"));
    assert_non_null(strstr(t, "x{who=\"a \\\"b\\\"\\\\c\\nd\"} 1\n"));
    pb_prom_free(&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(buckets),
        cmocka_unit_test(numbers), cmocka_unit_test(text),
    };
    return cmocka_run_group_tests_name("unit.metrics", tests, NULL, NULL);
}
