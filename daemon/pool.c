#include "pool.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

#include "../kernels/par.h"

#include "../proto/errors.h"
#include "log.h"

static void q_push(pb_queue_t *q, pb_job_t *j)
{
    j->next = NULL;
    if (q->tail)
        q->tail->next = j;
    else
        q->head = j;
    q->tail = j;
}

static pb_job_t *q_pop(pb_queue_t *q)
{
    pb_job_t *j = q->head;
    if (j) {
        q->head = j->next;
        if (q->head == NULL)
            q->tail = NULL;
    }
    return j;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* kernels/par.c's backend: the workers with no job lend themselves. */
static int par_idle(void *arg)
{
    pb_pool_t *p = arg;
    pthread_mutex_lock(&p->lock);
    int idle = p->nthreads - p->busy - p->helping;
    pthread_mutex_unlock(&p->lock);
    return idle > 0 ? idle : 0;
}

static void par_wake(void *arg)
{
    pb_pool_t *p = arg;
    pthread_mutex_lock(&p->lock);
    pthread_cond_broadcast(&p->cond);
    pthread_mutex_unlock(&p->lock);
}

/* A worker that has just helped stays awake this long for the next piece
 * before it sleeps: a request that splits its work (a factorization's
 * panel-sized GEMMs, kernels/blas_lapack.c) publishes pieces every few
 * hundred µs, and a sleeping helper takes tens of µs to wake on these
 * VMs, by which time the caller has run much of the piece itself.  It spins only
 * on a core no job wants, and only right after a split. */
#define HELP_SPIN_NS 200000

/* Outside the lock: until a task is published, a job is submitted, or
 * HELP_SPIN_NS pass. */
static void spin_for_work(pb_pool_t *p)
{
    unsigned gen = atomic_load_explicit(&p->submitted, memory_order_relaxed);
    uint64_t t0 = now_ns();
    for (unsigned i = 1;; i++) {
        if (pb_par_pending() || atomic_load_explicit(&p->submitted, memory_order_relaxed) != gen)
            return;
        pb_cpu_relax();
        if (i % 64 == 0 && now_ns() - t0 > HELP_SPIN_NS)
            return;
    }
}

/* Under the lock: run j outside it, counted in *busy, then hand it to
 * the loop; returns with the lock held. */
static void run_job(pb_pool_t *p, pb_job_t *j, int *busy)
{
    (*busy)++;
    pthread_mutex_unlock(&p->lock);
    uint64_t t0 = now_ns();
    j->run(j);
    atomic_fetch_add(&p->busy_ns, now_ns() - t0);
    pthread_mutex_lock(&p->lock);
    (*busy)--;
    q_push(&p->finished, j);
    pthread_mutex_unlock(&p->lock);
    /* uv_async_send coalesces, so a burst of completions wakes the loop
     * once.  Outside the lock: its write to the eventfd is a syscall (and
     * a hypervisor exit on these VMs) that the loop's next submit should
     * not wait behind. */
    uv_async_send(&p->async);
    pthread_mutex_lock(&p->lock);
}

static void *worker_main(void *arg)
{
    pb_pool_t *p = arg;
    pthread_mutex_lock(&p->lock);
    /* A worker is ready once it waits for jobs (a GPU worker: once its
     * device handles exist); pb_pool_init returns after all are. */
    p->started++;
    pthread_cond_broadcast(&p->cond);
    for (;;) {
        pb_job_t *j = q_pop(&p->todo[PB_DEV_CPU]);
        if (j == NULL) {
            if (p->stopping)
                break;
            if (pb_par_pending()) {
                /* Idle: help another worker's request (kernels/par.h). */
                p->helping++;
                pthread_mutex_unlock(&p->lock);
                uint64_t t0 = now_ns();
                pb_par_help();
                atomic_fetch_add(&p->busy_ns, now_ns() - t0);
                pthread_mutex_lock(&p->lock);
                p->helping--;
                if (!p->stopping && p->todo[PB_DEV_CPU].head == NULL) {
                    pthread_mutex_unlock(&p->lock);
                    spin_for_work(p);
                    pthread_mutex_lock(&p->lock);
                }
                continue;
            }
            pthread_cond_wait(&p->cond, &p->lock);
            continue;
        }
        run_job(p, j, &p->busy);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

/* One GPU's worker: bound to its device, it runs that device's queue. */
static void *gpu_worker_main(void *arg)
{
    pb_gpu_worker_t *w = arg;
    pb_pool_t *p = w->pool;
    int bound = pb_gpu->thread_init(w->dev);
    if (bound) {
        /* The device serves nothing then (requests for it are refused),
         * and the CPU and the other GPUs go on. */
        pb_log(PB_LOG_ERR, "cuda:%d: a worker cannot bind to the device (%s): marked failed", w->dev,
               pb_gpu->last_error());
        pb_gpu->set_failed(w->dev);
    }
    pthread_mutex_lock(&p->lock);
    p->started++;
    pthread_cond_broadcast(&p->cond);
    pb_queue_t *small = &p->todo[1 + 2 * w->dev], *large = &p->todo[2 + 2 * w->dev];
    while (bound == 0) {
        pb_job_t *j = w->lane ? q_pop(large) : NULL;
        if (j == NULL)
            j = q_pop(small);
        if (j == NULL) {
            if (p->stopping)
                break;
            pthread_cond_wait(&p->gcond[w->dev], &p->lock);
            continue;
        }
        run_job(p, j, &p->gbusy);
    }
    pthread_mutex_unlock(&p->lock);
    if (bound == 0)
        pb_gpu->thread_fini();
    return NULL;
}

static void on_async(uv_async_t *a)
{
    pb_pool_t *p = a->data;
    pthread_mutex_lock(&p->lock);
    pb_job_t *j = p->finished.head;
    p->finished.head = p->finished.tail = NULL;
    pthread_mutex_unlock(&p->lock);
    while (j) {
        pb_job_t *next = j->next;
        j->done(j);
        j = next;
    }
}

static void join_gpu_workers(pb_pool_t *p)
{
    for (int i = 0; i < p->ngworkers; i++)
        pthread_join(p->gworkers[i].thread, NULL);
    free(p->gworkers);
    p->gworkers = NULL;
    p->ngworkers = 0;
}

/* gpu_workers for each GPU; 0, or a PB_E* code with nothing of them left
 * running. */
static int start_gpu_workers(pb_pool_t *p, int gpu_workers)
{
    int ngpu = pb_gpu_count(), want = ngpu * gpu_workers;
    if (want == 0)
        return 0;
    p->gworkers = calloc((size_t)want, sizeof *p->gworkers);
    if (p->gworkers == NULL) {
        pb_log(PB_LOG_ERR, "worker pool: out of memory for %d GPU workers", want);
        pthread_mutex_lock(&p->lock);
        p->stopping = true; /* the CPU workers leave: nothing is left running */
        pthread_cond_broadcast(&p->cond);
        pthread_mutex_unlock(&p->lock);
        return PB_ENOMEM;
    }
    int why = 0;
    for (int i = 0; i < want; i++) {
        pb_gpu_worker_t *w = &p->gworkers[i];
        *w = (pb_gpu_worker_t){p, i / gpu_workers, i % gpu_workers == 0, 0};
        if ((why = pthread_create(&w->thread, NULL, gpu_worker_main, w)) != 0)
            break;
        p->ngworkers++;
    }
    pthread_mutex_lock(&p->lock);
    while (p->started < p->nthreads + p->ngworkers)
        pthread_cond_wait(&p->cond, &p->lock);
    bool failed = p->ngworkers < want;
    if (failed)
        p->stopping = true;
    pthread_cond_broadcast(&p->cond);
    for (int d = 0; d < ngpu; d++)
        pthread_cond_broadcast(&p->gcond[d]);
    pthread_mutex_unlock(&p->lock);
    if (!failed)
        return 0;
    pb_log(PB_LOG_ERR, "worker pool: cannot start a GPU worker: %s", uv_strerror(-why));
    join_gpu_workers(p);
    return pb_err_from_sys(-why);
}

int pb_pool_init(pb_pool_t *p, uv_loop_t *loop, int n, int gpu_workers, double gpu_lane_flops)
{
    *p = (pb_pool_t){0};
    p->loop = loop;
    p->gpu_lane_flops = gpu_lane_flops;
    if (n < 1)
        n = 1;
    int rc = uv_async_init(loop, &p->async, on_async);
    if (rc) {
        pb_log(PB_LOG_ERR, "worker pool: uv_async_init: %s", uv_strerror(rc));
        return pb_err_from_sys(rc);
    }
    p->async.data = p;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->cond, NULL);
    for (int d = 0; d < PB_GPU_MAX_DEVICES; d++)
        pthread_cond_init(&p->gcond[d], NULL);
    p->threads = calloc((size_t)n, sizeof *p->threads);
    if (p->threads == NULL) {
        pb_log(PB_LOG_ERR, "worker pool: out of memory for %d workers", n);
        rc = PB_ENOMEM;
        goto fail;
    }
    int why = 0;
    for (int i = 0; i < n; i++) {
        if ((why = pthread_create(&p->threads[i], NULL, worker_main, p)) != 0)
            break;
        p->nthreads++;
    }
    if (p->nthreads == 0) {
        pb_log(PB_LOG_ERR, "worker pool: cannot start a worker: %s", uv_strerror(-why));
        rc = pb_err_from_sys(-why);
        goto fail;
    }
    if (p->nthreads < n)
        pb_log(PB_LOG_WARNING, "worker pool: started %d of %d workers: %s", p->nthreads, n, uv_strerror(-why));
    /* systemd hears READY=1 only after this: every worker is running. */
    pthread_mutex_lock(&p->lock);
    while (p->started < p->nthreads)
        pthread_cond_wait(&p->cond, &p->lock);
    pthread_mutex_unlock(&p->lock);
    if ((rc = start_gpu_workers(p, gpu_workers))) {
        /* The CPU workers saw stopping: they leave. */
        for (int i = 0; i < p->nthreads; i++)
            pthread_join(p->threads[i], NULL);
        goto fail;
    }
    pb_par_set_backend(&(pb_par_backend_t){par_idle, par_wake, p, p->nthreads});
    return 0;

fail:
    /* No worker runs: undo in reverse.  The async's close completes on the
     * loop's next run. */
    free(p->threads);
    p->threads = NULL;
    for (int d = 0; d < PB_GPU_MAX_DEVICES; d++)
        pthread_cond_destroy(&p->gcond[d]);
    pthread_cond_destroy(&p->cond);
    pthread_mutex_destroy(&p->lock);
    uv_close((uv_handle_t *)&p->async, NULL);
    return rc;
}

void pb_pool_submit(pb_pool_t *p, pb_device_t dev, double cost, pb_job_t *job)
{
    bool gpu = dev.kind == PB_DEV_CUDA;
    int q = gpu ? 1 + 2 * dev.index + (cost >= p->gpu_lane_flops) : 0;
    pthread_mutex_lock(&p->lock);
    q_push(&p->todo[q], job);
    atomic_fetch_add_explicit(&p->submitted, 1, memory_order_relaxed);
    pthread_mutex_unlock(&p->lock);
    /* After the unlock, so the worker it wakes does not block on the lock
     * at once; no wake-up is lost, since a worker checks the queue under
     * the lock before it waits.  A GPU's workers all wake: only its lane
     * worker takes a large job. */
    if (gpu)
        pthread_cond_broadcast(&p->gcond[dev.index]);
    else
        pthread_cond_signal(&p->cond);
}

int pb_pool_running(pb_pool_t *p)
{
    pthread_mutex_lock(&p->lock);
    int n = p->busy + p->gbusy;
    for (int d = 0; d < PB_POOL_QUEUES; d++)
        for (pb_job_t *j = p->todo[d].head; j; j = j->next)
            n++;
    pthread_mutex_unlock(&p->lock);
    return n;
}

uint64_t pb_pool_busy_ns(pb_pool_t *p)
{
    return atomic_load(&p->busy_ns);
}

void pb_pool_stop(pb_pool_t *p)
{
    pthread_mutex_lock(&p->lock);
    p->stopping = true;
    pthread_cond_broadcast(&p->cond);
    for (int d = 0; d < PB_GPU_MAX_DEVICES; d++)
        pthread_cond_broadcast(&p->gcond[d]);
    pthread_mutex_unlock(&p->lock);
    for (int i = 0; i < p->nthreads; i++)
        pthread_join(p->threads[i], NULL);
    join_gpu_workers(p);
    /* Only now: jobs still running (past a drain's timeout) read the
     * backend in each pb_par_for, and kernels/par.h allows no change while
     * tasks run.  A worker that has left lends nothing: its job's caller
     * runs the pieces it published itself. */
    pb_par_set_backend(NULL);
    free(p->threads);
    p->threads = NULL;
    on_async(&p->async); /* completions that raced the stop */
    uv_close((uv_handle_t *)&p->async, NULL);
}
