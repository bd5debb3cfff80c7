/* unit.pool: the worker pool (daemon/pool.c): workers start and stop, jobs
 * run on workers, their completions run on the loop thread, and nothing is
 * left open (every test ends with uv_loop_close() == 0, as libuv's own
 * tests do, so a leaked handle fails it). */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "daemon/pool.h"
#include "proto/errors.h"

#define NJOBS 64

typedef struct tjob {
    pb_job_t job; /* first: the pool hands it back */
    struct ctx *ctx;
    pthread_t ran_on;
    int done_count;
} tjob_t;

typedef struct ctx {
    pb_pool_t pool;
    pthread_t loop_thread;
    int done, on_loop;
    tjob_t jobs[NJOBS];
} ctx_t;

static void job_run(pb_job_t *j)
{
    tjob_t *t = (tjob_t *)j;
    t->ran_on = pthread_self();
}

static void job_done(pb_job_t *j)
{
    tjob_t *t = (tjob_t *)j;
    ctx_t *c = t->ctx;
    t->done_count++;
    c->done++;
    c->on_loop += pthread_equal(pthread_self(), c->loop_thread) != 0;
    /* The last completion stops the pool: its async is the only handle,
     * so uv_run returns once it is closed. */
    if (c->done == NJOBS)
        pb_pool_stop(&c->pool);
}

static void finish_loop(uv_loop_t *loop)
{
    uv_run(loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(loop), 0);
}

/* Start `asked` workers, see `started` of them running, stop. */
static void start_and_stop(int asked, int started)
{
    uv_loop_t loop;
    assert_int_equal(uv_loop_init(&loop), 0);
    pb_pool_t p;
    assert_int_equal(pb_pool_init(&p, &loop, asked, 0, 0), 0);
    assert_int_equal(p.nthreads, started);
    assert_int_equal(p.started, started);
    pb_pool_stop(&p);
    finish_loop(&loop);
}

static void start_stop(void **state)
{
    (void)state;
    start_and_stop(3, 3);
}

/* Fewer than one worker asked: one is started anyway. */
static void at_least_one(void **state)
{
    (void)state;
    start_and_stop(0, 1);
}

/* A pool of n workers on loop with NJOBS jobs submitted; done starts at
 * done0 (the last completion stops the pool when it reaches NJOBS). */
static ctx_t *submit_jobs(uv_loop_t *loop, int n, int done0)
{
    assert_int_equal(uv_loop_init(loop), 0);
    ctx_t *c = calloc(1, sizeof *c);
    assert_non_null(c);
    c->loop_thread = pthread_self();
    c->done = done0;
    assert_int_equal(pb_pool_init(&c->pool, loop, n, 0, 0), 0);
    pb_device_t cpu = {PB_DEV_CPU, 0};
    for (int i = 0; i < NJOBS; i++) {
        c->jobs[i] = (tjob_t){.job = {.run = job_run, .done = job_done}, .ctx = c};
        pb_pool_submit(&c->pool, cpu, 0, &c->jobs[i].job);
    }
    return c;
}

static void jobs_run_and_complete_on_loop(void **state)
{
    (void)state;
    uv_loop_t loop;
    ctx_t *c = submit_jobs(&loop, 4, 0);
    finish_loop(&loop);
    assert_int_equal(c->done, NJOBS);
    assert_int_equal(c->on_loop, NJOBS);
    for (int i = 0; i < NJOBS; i++) {
        assert_int_equal(c->jobs[i].done_count, 1);
        /* The math ran on a worker, never on the loop thread. */
        assert_false(pthread_equal(c->jobs[i].ran_on, c->loop_thread));
    }
    assert_int_equal(c->pool.busy, 0);
    free(c);
}

/* Jobs still finishing when the pool stops complete from pb_pool_stop
 * itself, on the loop thread: none is lost. */
static void stop_collects_late_completions(void **state)
{
    (void)state;
    uv_loop_t loop;
    ctx_t *c = submit_jobs(&loop, 2, -NJOBS); /* never reaches NJOBS: the test stops the pool */
    pb_pool_stop(&c->pool);
    finish_loop(&loop);
    assert_int_equal(c->done, 0);
    assert_int_equal(c->on_loop, NJOBS);
    free(c);
}

/* libuv's codes and -errno become PB_E* codes at the boundary; the
 * UV_ENOMEM that main once took for a PB_E* code is the case in point. */
static void sys_errors(void **state)
{
    (void)state;
    assert_int_equal(pb_err_from_sys(0), 0);
    assert_int_equal(pb_err_from_sys(UV_ENOMEM), PB_ENOMEM);
    assert_int_equal(pb_err_from_sys(UV_EAGAIN), PB_ERESOURCE_EXHAUSTED);
    assert_int_equal(pb_err_from_sys(UV_EACCES), PB_EPERMISSION_DENIED);
    assert_int_equal(pb_err_from_sys(UV_EADDRINUSE), PB_EINVALID_ARGUMENT);
    assert_int_equal(pb_err_from_sys(UV_EIO), PB_EINTERNAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(start_stop),
        cmocka_unit_test(at_least_one),
        cmocka_unit_test(jobs_run_and_complete_on_loop),
        cmocka_unit_test(stop_collects_late_completions),
        cmocka_unit_test(sys_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
