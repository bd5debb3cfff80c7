/* The worker pool: threads that run the math of requests.
 *
 * A job is submitted from the loop thread to the queue of its device; a
 * worker of that device runs job->run, then the job goes to a completion
 * list and the loop thread runs job->done from a uv_async callback.  Only
 * the loop thread submits and runs done; only workers run run.  The pool
 * owns its threads array (pb_pool_init allocates it, pb_pool_stop frees
 * it) and nothing of a job: the job (embedded in its request) must live until
 * done has run.
 *
 * Idle workers lend themselves to kernels/par.c: while a worker has no
 * job, it runs pieces of a running job that split itself (a large GEMM),
 * so a lone request uses the idle cores and a loaded pool runs every
 * request on its own worker alone.
 *
 * Devices: the CPU's workers serve queue 0; each GPU (cuda/gpu.h) gets
 * queues and workers of its own, bound to it (its stream and library
 * handles), so a request for a GPU never waits behind CPU work or another
 * GPU's, and its large jobs run in a lane of their own (pb_gpu_worker_t).
 * GPU workers lend nothing to kernels/par.c. */
#ifndef PB_POOL_H
#define PB_POOL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "../cuda/gpu.h"
#include "../kernels/tensor.h"

typedef struct pb_job {
    void (*run)(struct pb_job *);  /* on a worker */
    void (*done)(struct pb_job *); /* on the loop thread */
    struct pb_job *next;
} pb_job_t;

typedef struct pb_queue {
    pb_job_t *head, *tail;
} pb_queue_t;

/* Queue 0 is the CPU's; GPU i has two, its small jobs' and its large
 * jobs' (a cost of gpu_lane_flops or more). */
#define PB_POOL_QUEUES (1 + 2 * PB_GPU_MAX_DEVICES)

/* A GPU worker's thread and the device it serves.  The lane worker (the
 * first of each GPU's) runs that GPU's large jobs, the oldest first, and
 * small ones when no large one waits; the others run small jobs only.  So
 * one large job at a time runs on a GPU and, with two workers or more,
 * small requests never wait behind large ones. */
typedef struct pb_gpu_worker {
    struct pb_pool *pool;
    int dev;
    bool lane;
    pthread_t thread;
} pb_gpu_worker_t;

typedef struct pb_pool {
    uv_loop_t *loop;
    uv_async_t async;
    pthread_mutex_t lock;
    pthread_cond_t cond;  /* CPU workers wait here */
    pthread_cond_t gcond[PB_GPU_MAX_DEVICES]; /* each GPU's workers */
    pb_queue_t todo[PB_POOL_QUEUES]; /* 0: the CPU, 1 + 2i and 2 + 2i: GPU i's small and large */
    double gpu_lane_flops;
    pb_queue_t finished;
    pthread_t *threads;
    int nthreads;
    bool stopping;
    pb_gpu_worker_t *gworkers; /* owned like threads */
    int ngworkers;
    int busy;             /* jobs taken by CPU workers and not finished */
    int gbusy;            /* and by GPU workers */
    int helping;          /* idle workers running another job's pieces */
    _Atomic uint64_t busy_ns; /* time workers spent on jobs and pieces */
    int started;          /* workers that reached their loop */
    _Atomic unsigned submitted; /* jobs submitted so far: a spinning helper's signal */
} pb_pool_t;

/* Start n CPU workers (at least one) and gpu_workers for each GPU of
 * pb_gpu_count(), and wait until each is running (a GPU worker: bound to
 * its device, or, when it cannot bind, the device marked failed).  0, or a negative PB_E* code with the cause logged; on
 * failure nothing is left running, and the async handle's close completes
 * on the loop's next run. */
int pb_pool_init(pb_pool_t *p, uv_loop_t *loop, int n, int gpu_workers, double gpu_lane_flops);
/* Queue job on dev; cost (estimated flops) picks a GPU's lane. */
void pb_pool_submit(pb_pool_t *p, pb_device_t dev, double cost, pb_job_t *job);
/* Jobs submitted and not finished: running on a worker or queued. */
int pb_pool_running(pb_pool_t *p);
/* Nanoseconds workers have spent running jobs (and helping, kernels/par.h). */
uint64_t pb_pool_busy_ns(pb_pool_t *p);
/* Stop the workers (after the jobs they run) and close the async handle;
 * the loop must run once more for the close callback. */
void pb_pool_stop(pb_pool_t *p);

#endif
