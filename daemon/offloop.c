#include "offloop.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#include "../kernels/mem.h"

static uv_loop_t *offloop; /* between start and stop; loop thread only */
/* PB_OFFLOOP_* flags asked for and not yet taken by a job: a job is queued
 * only by the call that finds this 0, so a burst of closes costs one trim. */
static atomic_uint pending;
static atomic_ulong njobs;       /* queued since the process started */
static atomic_size_t unmapping;  /* bytes of deferred blocks whose job has not completed */
static void (*unmapped_cb)(void *arg); /* loop thread only */
static int uncounted;                  /* loop thread only: pb_offloop_uncounted depth */
static void *unmapped_arg;

typedef struct offloop_work {
    uv_work_t w;
    void *block;  /* a deferred pb_mem block, or NULL: a pending-flags job */
    size_t bytes; /* the block's mapping, counted in `unmapping` */
} offloop_work_t;

static void run_here(void *block, unsigned what)
{
    pb_mem_release(block);
    if (what & PB_OFFLOOP_FIT_CAP)
        pb_mem_fit_cap();
    if (what & PB_OFFLOOP_TRIM_ALL)
        pb_alloc_trim();
    else if (what & PB_OFFLOOP_TRIM_HEAP)
        pb_alloc_trim_heap();
}

static void work_run(uv_work_t *w)
{
    offloop_work_t *o = (offloop_work_t *)w;
    run_here(o->block, o->block ? 0 : atomic_exchange(&pending, 0));
}

static void work_done(uv_work_t *w, int status)
{
    (void)status; /* never cancelled */
    offloop_work_t *o = (offloop_work_t *)w;
    bool gave_back = o->bytes > 0;
    /* Counted down here, on the loop, not when the pool unmapped it: so
     * the loop never sees the count drop without the callback to follow
     * (the budget waits for the callback when the count is non-zero). */
    atomic_fetch_sub(&unmapping, o->bytes);
    free(o);
    if (gave_back && unmapped_cb)
        unmapped_cb(unmapped_arg);
}

static void work_none(uv_work_t *w)
{
    (void)w;
}

/* Queued: true.  Not started, or out of memory: false, nothing done. */
static bool queue(void *block)
{
    offloop_work_t *o = offloop ? malloc(sizeof *o) : NULL;
    if (o == NULL)
        return false;
    o->block = block;
    o->bytes = uncounted ? 0 : pb_mem_mapped_size(block);
    atomic_fetch_add(&unmapping, o->bytes);
    if (uv_queue_work(offloop, &o->w, work_run, work_done) == 0) {
        atomic_fetch_add(&njobs, 1);
        return true;
    }
    atomic_fetch_sub(&unmapping, o->bytes);
    free(o);
    return false;
}

static bool defer_unmap(void *block, void *arg)
{
    (void)arg;
    return queue(block);
}

void pb_offloop_start(uv_loop_t *loop)
{
    offloop = loop;
    /* libuv starts its pool on the first job and aborts if it cannot
     * create the threads: better now, at startup, than mid-service. */
    offloop_work_t *o = malloc(sizeof *o);
    if (o) {
        o->bytes = 0;
        if (uv_queue_work(loop, &o->w, work_none, work_done) != 0)
            free(o);
    }
    pb_mem_defer_unmaps(defer_unmap, NULL);
}

void pb_offloop_stop(void)
{
    pb_mem_defer_unmaps(NULL, NULL);
    offloop = NULL;
}

void pb_offloop_on_unmapped(void (*cb)(void *arg), void *arg)
{
    unmapped_cb = cb;
    unmapped_arg = arg;
}

void pb_offloop_uncounted(bool begin)
{
    uncounted += begin ? 1 : -1;
}

size_t pb_offloop_unmapping(void)
{
    return atomic_load(&unmapping);
}

void pb_offloop_memory(unsigned what)
{
    if (what == 0 || atomic_fetch_or(&pending, what) != 0)
        return; /* a queued job takes these flags with the others */
    if (!queue(NULL))
        run_here(NULL, atomic_exchange(&pending, 0));
}

unsigned long pb_offloop_jobs(void)
{
    return atomic_load(&njobs);
}
