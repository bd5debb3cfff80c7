/* unit.par: intra-request parallelism (kernels/par.c) with a stand-in for
 * the worker pool: every piece of [0, n) runs exactly once, idle threads
 * do help, nothing is split without a backend or an idle thread, nested
 * splits finish, and pb_par_for returns only after its helpers left. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kernels/par.h"

#define NHELPERS 3

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static bool stopping;
static atomic_int idle_threads;
static int lent = NHELPERS; /* what idle() reports */
static pthread_t helpers[NHELPERS];

static int fake_idle(void *arg)
{
    (void)arg;
    int n = atomic_load(&idle_threads);
    return n < lent ? n : lent;
}

static void fake_wake(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&lock);
    pthread_cond_broadcast(&cond);
    pthread_mutex_unlock(&lock);
}

static void *helper_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        if (stopping)
            break;
        if (pb_par_pending()) {
            atomic_fetch_sub(&idle_threads, 1);
            pthread_mutex_unlock(&lock);
            pb_par_help();
            pthread_mutex_lock(&lock);
            atomic_fetch_add(&idle_threads, 1);
            continue;
        }
        pthread_cond_wait(&cond, &lock);
    }
    pthread_mutex_unlock(&lock);
    return NULL;
}

static int setup(void **state)
{
    (void)state;
    stopping = false;
    atomic_store(&idle_threads, NHELPERS);
    for (int i = 0; i < NHELPERS; i++)
        pthread_create(&helpers[i], NULL, helper_main, NULL);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    pthread_mutex_lock(&lock);
    stopping = true;
    pthread_cond_broadcast(&cond);
    pthread_mutex_unlock(&lock);
    for (int i = 0; i < NHELPERS; i++)
        pthread_join(helpers[i], NULL);
    pb_par_set_backend(NULL);
    return 0;
}

static const pb_par_backend_t fake = {fake_idle, fake_wake, NULL};

typedef struct {
    atomic_int *hits;
    atomic_int calls;
    pthread_t caller;
    atomic_int other_threads;
    int sleep_us;
} cover_t;

static void cover(void *ctx, long lo, long hi)
{
    cover_t *c = ctx;
    atomic_fetch_add(&c->calls, 1);
    if (!pthread_equal(pthread_self(), c->caller))
        atomic_fetch_add(&c->other_threads, 1);
    for (long i = lo; i < hi; i++)
        atomic_fetch_add(&c->hits[i], 1);
    if (c->sleep_us)
        usleep((useconds_t)c->sleep_us);
}

static void run_cover(long n, long grain, int sleep_us, cover_t *c)
{
    c->hits = calloc((size_t)n, sizeof *c->hits);
    atomic_init(&c->calls, 0);
    atomic_init(&c->other_threads, 0);
    c->caller = pthread_self();
    c->sleep_us = sleep_us;
    pb_par_for(n, grain, cover, c);
    for (long i = 0; i < n; i++)
        assert_int_equal(atomic_load(&c->hits[i]), 1);
    free(c->hits);
}

static void inline_without_backend(void **state)
{
    (void)state;
    pb_par_set_backend(NULL);
    cover_t c;
    run_cover(1000, 10, 0, &c);
    assert_int_equal(atomic_load(&c.calls), 1);
    assert_int_equal(atomic_load(&c.other_threads), 0);
}

static void inline_when_nobody_idle(void **state)
{
    (void)state;
    pb_par_set_backend(&fake);
    lent = 0;
    cover_t c;
    run_cover(1000, 10, 0, &c);
    assert_int_equal(atomic_load(&c.calls), 1);
    lent = NHELPERS;
}

static void inline_below_two_grains(void **state)
{
    (void)state;
    pb_par_set_backend(&fake);
    cover_t c;
    run_cover(19, 10, 0, &c);
    assert_int_equal(atomic_load(&c.calls), 1);
}

static void idle_threads_help(void **state)
{
    (void)state;
    pb_par_set_backend(&fake);
    unsigned long long t0, h0, t1, h1;
    pb_par_counts(&t0, &h0);
    cover_t c;
    /* One chunk per thread; each sleeps so that the helpers arrive. */
    run_cover(4000, 10, 20000, &c);
    assert_int_equal(atomic_load(&c.calls), NHELPERS + 1);
    assert_true(atomic_load(&c.other_threads) >= 1);
    pb_par_counts(&t1, &h1);
    assert_int_equal(t1 - t0, 1);
    assert_true(h1 - h0 >= 1);
    /* Fewer idle threads: fewer chunks (once the woken ones are back). */
    while (atomic_load(&idle_threads) < NHELPERS)
        usleep(100);
    lent = 1;
    run_cover(4000, 10, 0, &c);
    assert_int_equal(atomic_load(&c.calls), 2);
    lent = NHELPERS;
}

static void odd_sizes(void **state)
{
    (void)state;
    pb_par_set_backend(&fake);
    for (long n = 20; n < 200; n += 7) {
        cover_t c;
        run_cover(n, 3, 0, &c);
    }
}

typedef struct {
    atomic_long sum;
} nest_t;

static void inner(void *ctx, long lo, long hi)
{
    nest_t *s = ctx;
    for (long i = lo; i < hi; i++)
        atomic_fetch_add(&s->sum, i);
}

static void outer(void *ctx, long lo, long hi)
{
    for (long k = lo; k < hi; k++)
        pb_par_for(1000, 10, inner, ctx);
}

static void nested(void **state)
{
    (void)state;
    pb_par_set_backend(&fake);
    nest_t s;
    atomic_init(&s.sum, 0);
    pb_par_for(8, 1, outer, &s);
    assert_int_equal(atomic_load(&s.sum), 8L * 999 * 1000 / 2);
}

/* Two callers at once (two requests on two workers) share the helpers. */
static void *concurrent_caller(void *arg)
{
    cover_t *c = arg;
    run_cover(100000, 100, 1000, c);
    return NULL;
}

static void concurrent(void **state)
{
    (void)state;
    pb_par_set_backend(&fake);
    pthread_t t[2];
    cover_t c[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&t[i], NULL, concurrent_caller, &c[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(inline_without_backend), cmocka_unit_test(inline_when_nobody_idle),
        cmocka_unit_test(inline_below_two_grains), cmocka_unit_test(idle_threads_help),
        cmocka_unit_test(odd_sizes), cmocka_unit_test(nested), cmocka_unit_test(concurrent),
    };
    return cmocka_run_group_tests_name("unit.par", tests, setup, teardown);
}
