/* Memory work the event loop must not wait for, run on libuv's thread pool
 * (uv_queue_work): unmapping costs about 85 ms a GiB here and malloc_trim
 * walks every arena.
 *
 * Between pb_offloop_start and pb_offloop_stop, a large block that the loop
 * thread frees or releases past the cache's cap is unmapped on the pool
 * (kernels/mem.h's pb_mem_defer_unmaps): a closed connection's buffer, a
 * message or a reply answered on the loop.  The server also sends the idle
 * trim, a reload's lower cap and the heap trim after a big connection
 * through pb_offloop_memory.  Outside start..stop everything runs on the
 * calling thread.
 *
 * Calls to pb_offloop_memory while a job for them is still queued add
 * their flags to that job: a burst of closes queues one trim.
 *
 * Ownership: each work request is malloc'd here and freed in its
 * after-callback; a deferred block is the work's until it is released.
 * Work still queued when the loop stops runs in the server's final uv_run,
 * which comes before pb_offloop_stop. */
#ifndef PB_OFFLOOP_H
#define PB_OFFLOOP_H

#include <stdbool.h>
#include <uv.h>

enum {
    PB_OFFLOOP_TRIM_HEAP = 1, /* glibc's free pages (pb_alloc_trim_heap) */
    PB_OFFLOOP_FIT_CAP = 2,   /* the cache down to its cap (pb_mem_fit_cap) */
    PB_OFFLOOP_TRIM_ALL = 4,  /* the cache and the heap (pb_alloc_trim) */
};

/* From the loop thread, which is the one whose unmaps are deferred. */
void pb_offloop_start(uv_loop_t *loop);
void pb_offloop_stop(void);
/* Bytes of deferred blocks whose job has not completed on the loop (the
 * count drops just before cb runs): still resident, so the
 * connection budget counts them against max_buffered_bytes until they are
 * gone; cb(arg) runs on the loop after each such block is unmapped. */
size_t pb_offloop_unmapping(void);
void pb_offloop_on_unmapped(void (*cb)(void *arg), void *arg);
/* Between pb_offloop_uncounted(true) and (false), on the loop thread
 * (they nest), deferred blocks are not counted in pb_offloop_unmapping
 * and do not call cb: a tape's, which the connection budget never held. */
void pb_offloop_uncounted(bool begin);
/* Do what the flags say on the pool (here when stopped or out of memory). */
void pb_offloop_memory(unsigned what);
/* Jobs queued on the pool since the process started (for tests). */
unsigned long pb_offloop_jobs(void);

#endif
