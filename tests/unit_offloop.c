/* unit.offloop: memory work leaves the event loop (daemon/offloop.c).
 * Between start and stop, a large block the loop thread releases is still
 * mapped when the release returns and is unmapped by a job on libuv's
 * pool; trims asked for while one is queued share its
 * job; a deferred block counts as unmapping until it is gone, then the
 * loop hears of it; after stop everything runs on the calling thread. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <uv.h>

#include "daemon/offloop.h"
#include "kernels/mem.h"

#define MiB ((size_t)1 << 20)

static size_t mapped(void)
{
    pb_mem_stats_t s;
    pb_mem_stats(&s);
    return s.mapped_bytes;
}

static uv_loop_t loop;

/* The pool's one thread (main sets UV_THREADPOOL_SIZE) waits in a job of
 * the test's until run_pool: what is queued behind it stays queued, and the
 * test sees the state before the pool's work. */
static uv_sem_t gate;
static uv_work_t blocker;

static void wait_gate(uv_work_t *w)
{
    (void)w;
    uv_sem_wait(&gate);
}

static void hold_pool(void)
{
    assert_int_equal(uv_queue_work(&loop, &blocker, wait_gate, NULL), 0);
}

static void run_pool(void)
{
    uv_sem_post(&gate);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
}

/* Let what is queued run to its completion callbacks, and hold the pool
 * again. */
static void drain_pool(void)
{
    run_pool();
    hold_pool();
}

static int setup(void **state)
{
    (void)state;
    pb_mem_set_cap(0); /* nothing is cached: every release unmaps */
    pb_alloc_trim();
    assert_int_equal(uv_loop_init(&loop), 0);
    pb_offloop_start(&loop);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0); /* the warm-up job */
    assert_int_equal(uv_sem_init(&gate, 0), 0);
    hold_pool();
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    run_pool();
    uv_sem_destroy(&gate);
    pb_offloop_stop();
    assert_int_equal(uv_loop_close(&loop), 0);
    pb_mem_set_cap(PB_MEM_DEFAULT_CAP);
    return 0;
}

static void unmaps_leave_the_loop(void **state)
{
    (void)state;
    size_t before = mapped();
    unsigned long jobs = pb_offloop_jobs();
    void *p = pb_mem_alloc(64 * MiB);
    assert_non_null(p);
    memset(p, 1, 64 * MiB);
    assert_true(mapped() >= before + 64 * MiB);
    pb_mem_release(p);
    /* Handed to the pool: still mapped, one job queued. */
    assert_true(mapped() >= before + 64 * MiB);
    assert_int_equal(pb_offloop_jobs(), jobs + 1);
    drain_pool();
    assert_int_equal(mapped(), before);
    /* pb_mem_free past the cap (0 here) goes the same way. */
    p = pb_mem_alloc(8 * MiB);
    pb_mem_free(p);
    assert_true(mapped() >= before + 8 * MiB);
    assert_int_equal(pb_offloop_jobs(), jobs + 2);
    drain_pool();
    assert_int_equal(mapped(), before);
}

static void trims_share_a_job(void **state)
{
    (void)state;
    unsigned long jobs = pb_offloop_jobs();
    for (int i = 0; i < 100; i++)
        pb_offloop_memory(PB_OFFLOOP_TRIM_HEAP);
    pb_offloop_memory(PB_OFFLOOP_FIT_CAP);
    pb_offloop_memory(PB_OFFLOOP_TRIM_ALL);
    pb_offloop_memory(0);
    assert_int_equal(pb_offloop_jobs(), jobs + 1);
    drain_pool();
    /* Taken: the next call queues a job of its own. */
    pb_offloop_memory(PB_OFFLOOP_TRIM_HEAP);
    assert_int_equal(pb_offloop_jobs(), jobs + 2);
    drain_pool();
}

/* The cap lowered while a block is cached: the job asked for empties it. */
static void fit_cap_runs_on_the_pool(void **state)
{
    (void)state;
    pb_mem_set_cap(PB_MEM_DEFAULT_CAP);
    size_t before = mapped();
    void *p = pb_mem_alloc(16 * MiB);
    pb_mem_free(p); /* cached */
    assert_true(mapped() >= before + 16 * MiB);
    pb_mem_set_cap_only(0);
    pb_offloop_memory(PB_OFFLOOP_FIT_CAP);
    assert_true(mapped() >= before + 16 * MiB);
    drain_pool();
    assert_int_equal(mapped(), before);
}

static int unmapped_calls;
static void count_unmapped(void *arg)
{
    *(int *)arg += 1;
}

/* A deferred block's bytes count as unmapping until the pool has unmapped
 * it; then the hook runs on the loop, once per block; trims do not call it. */
static void unmapping_is_counted(void **state)
{
    (void)state;
    unmapped_calls = 0;
    pb_offloop_on_unmapped(count_unmapped, &unmapped_calls);
    size_t before = mapped();
    assert_int_equal(pb_offloop_unmapping(), 0);
    void *p = pb_mem_alloc(32 * MiB), *q = pb_mem_alloc(4 * MiB);
    size_t plen = pb_mem_mapped_size(p), qlen = pb_mem_mapped_size(q);
    assert_true(plen >= 32 * MiB && qlen >= 4 * MiB);
    assert_int_equal(pb_mem_mapped_size(NULL), 0);
    pb_mem_release(p);
    assert_int_equal(pb_offloop_unmapping(), plen);
    pb_mem_free(q); /* past the cap (0) */
    assert_int_equal(pb_offloop_unmapping(), plen + qlen);
    pb_offloop_memory(PB_OFFLOOP_TRIM_HEAP);
    assert_int_equal(unmapped_calls, 0);
    drain_pool();
    assert_int_equal(pb_offloop_unmapping(), 0);
    assert_int_equal(mapped(), before);
    assert_int_equal(unmapped_calls, 2);
    pb_offloop_on_unmapped(NULL, NULL);
}

/* A tape's blocks (freed between pb_offloop_uncounted(true) and (false))
 * leave the loop too, but the connection budget never held them: they are
 * not counted and do not call the hook.  The scopes nest. */
static void uncounted_blocks(void **state)
{
    (void)state;
    unmapped_calls = 0;
    pb_offloop_on_unmapped(count_unmapped, &unmapped_calls);
    size_t before = mapped();
    unsigned long jobs = pb_offloop_jobs();
    void *p = pb_mem_alloc(16 * MiB), *q = pb_mem_alloc(16 * MiB), *r = pb_mem_alloc(16 * MiB);
    pb_offloop_uncounted(true);
    pb_offloop_uncounted(true);
    pb_mem_release(p);
    pb_offloop_uncounted(false);
    pb_mem_free(q);
    pb_offloop_uncounted(false);
    assert_int_equal(pb_offloop_unmapping(), 0);
    assert_int_equal(pb_offloop_jobs(), jobs + 2);
    assert_true(mapped() >= before + 48 * MiB);
    size_t rlen = pb_mem_mapped_size(r);
    pb_mem_release(r); /* counted again */
    assert_int_equal(pb_offloop_unmapping(), rlen);
    drain_pool();
    assert_int_equal(pb_offloop_unmapping(), 0);
    assert_int_equal(mapped(), before);
    assert_int_equal(unmapped_calls, 1);
    pb_offloop_on_unmapped(NULL, NULL);
}

static void stopped_runs_here(void **state)
{
    (void)state;
    pb_offloop_stop();
    size_t before = mapped();
    unsigned long jobs = pb_offloop_jobs();
    void *p = pb_mem_alloc(32 * MiB);
    pb_mem_release(p);
    assert_int_equal(mapped(), before);
    pb_mem_set_cap(PB_MEM_DEFAULT_CAP);
    p = pb_mem_alloc(32 * MiB);
    pb_mem_free(p);
    pb_mem_set_cap_only(0);
    pb_offloop_memory(PB_OFFLOOP_FIT_CAP);
    assert_int_equal(mapped(), before);
    assert_int_equal(pb_offloop_jobs(), jobs);
    pb_offloop_start(&loop); /* for teardown, which runs the pool */
}

int main(void)
{
    setenv("UV_THREADPOOL_SIZE", "1", 1); /* before the pool starts */
    pb_alloc_init();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(unmaps_leave_the_loop, setup, teardown),
        cmocka_unit_test_setup_teardown(trims_share_a_job, setup, teardown),
        cmocka_unit_test_setup_teardown(fit_cap_runs_on_the_pool, setup, teardown),
        cmocka_unit_test_setup_teardown(unmapping_is_counted, setup, teardown),
        cmocka_unit_test_setup_teardown(uncounted_blocks, setup, teardown),
        cmocka_unit_test_setup_teardown(stopped_runs_here, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
