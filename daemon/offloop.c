#include "offloop.h"

#include <stdbool.h>
#include <stdlib.h>

#include "../kernels/mem.h"

static uv_loop_t *offloop; /* between start and stop; loop thread only */

typedef struct offloop_work {
    uv_work_t w;
    void *block; /* a deferred pb_mem block, or NULL */
    unsigned what;
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
    run_here(o->block, o->what);
}

static void work_done(uv_work_t *w, int status)
{
    (void)status; /* never cancelled */
    free(w);
}

/* Queued: true.  Not started, or out of memory: false, nothing done. */
static bool queue(void *block, unsigned what)
{
    offloop_work_t *o = offloop ? malloc(sizeof *o) : NULL;
    if (o == NULL)
        return false;
    o->block = block;
    o->what = what;
    if (uv_queue_work(offloop, &o->w, work_run, work_done) == 0)
        return true;
    free(o);
    return false;
}

static bool defer_unmap(void *block, void *arg)
{
    (void)arg;
    return queue(block, 0);
}

void pb_offloop_start(uv_loop_t *loop)
{
    offloop = loop;
    pb_mem_defer_unmaps(defer_unmap, NULL);
}

void pb_offloop_stop(void)
{
    pb_mem_defer_unmaps(NULL, NULL);
    offloop = NULL;
}

void pb_offloop_release_here(void *block)
{
    pb_mem_defer_unmaps(NULL, NULL);
    pb_mem_release(block);
    if (offloop)
        pb_mem_defer_unmaps(defer_unmap, NULL);
}

void pb_offloop_memory(unsigned what)
{
    if (what && !queue(NULL, what))
        run_here(NULL, what);
}
