#include "offloop.h"

#include <stdlib.h>

#include "../kernels/mem.h"

typedef struct offloop_work {
    uv_work_t w;
    void *block;
    unsigned what;
} offloop_work_t;

static void run_now(void *block, unsigned what)
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
    run_now(o->block, o->what);
}

static void work_done(uv_work_t *w, int status)
{
    (void)status; /* never cancelled */
    free(w);
}

void pb_offloop_memory(uv_loop_t *loop, bool now, void *block, unsigned what)
{
    if (block == NULL && what == 0)
        return;
    offloop_work_t *o = now ? NULL : malloc(sizeof *o);
    if (o) {
        o->block = block;
        o->what = what;
        if (uv_queue_work(loop, &o->w, work_run, work_done) == 0)
            return;
        free(o);
    }
    run_now(block, what);
}
