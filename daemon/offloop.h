/* Memory work the event loop must not wait for, run on libuv's thread pool
 * (uv_queue_work): unmapping costs about 85 ms a GiB here and malloc_trim
 * walks every arena.  The users: a closed or evicted connection's buffer
 * (conn.c), the idle trim and a reload that lowers --memory-cache
 * (server.c).
 *
 * Ownership: pb_offloop_memory owns `block` from the call on (a pb_mem
 * block, or NULL) and releases it; its work request is malloc'd here and
 * freed in its after-callback.  Work still queued when the loop stops runs
 * in the server's final uv_run; after that, callers pass now = true. */
#ifndef PB_OFFLOOP_H
#define PB_OFFLOOP_H

#include <stdbool.h>
#include <uv.h>

enum {
    PB_OFFLOOP_TRIM_HEAP = 1, /* glibc's free pages (pb_alloc_trim_heap) */
    PB_OFFLOOP_FIT_CAP = 2,   /* the cache down to its cap (pb_mem_fit_cap) */
    PB_OFFLOOP_TRIM_ALL = 4,  /* the cache and the heap (pb_alloc_trim) */
};

/* Release block (pb_mem_release) and do what the flags say, on the pool;
 * at once on this thread when now is true or the work cannot be queued. */
void pb_offloop_memory(uv_loop_t *loop, bool now, void *block, unsigned what);

#endif
