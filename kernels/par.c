#include "par.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>

typedef struct task {
    pb_par_fn fn;
    void *ctx;
    long n, nchunks;     /* chunk i: [i*n/nchunks, (i+1)*n/nchunks) */
    atomic_long next;    /* next chunk to claim */
    atomic_int helpers;  /* helpers inside; changed under board_lock */
    struct task *next_task;
} task_t;

/* How long a caller waits awake for its helpers: this many pause
 * instructions, a few hundred µs. */
#define WAIT_SPINS 20000

static pthread_mutex_t board_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t board_left = PTHREAD_COND_INITIALIZER; /* a helper left a task */
static task_t *board;            /* published tasks, newest first */
static atomic_int published;     /* tasks on the board with a chunk unclaimed */
static pb_par_backend_t backend; /* .idle == NULL: none */
static atomic_ullong ntasks, nhelped;

void pb_par_set_backend(const pb_par_backend_t *b)
{
    pthread_mutex_lock(&board_lock);
    if (b)
        backend = *b;
    else
        backend = (pb_par_backend_t){0};
    pthread_mutex_unlock(&board_lock);
}

int pb_par_threads(void)
{
    pb_par_backend_t b = backend;
    return b.idle && b.threads > 1 ? b.threads : 1;
}

int pb_par_pending(void)
{
    return atomic_load_explicit(&published, memory_order_acquire) > 0;
}

void pb_par_counts(unsigned long long *tasks, unsigned long long *helped)
{
    *tasks = atomic_load(&ntasks);
    *helped = atomic_load(&nhelped);
}

/* Claim and run chunks of t until none is left; the number run. */
static long run_chunks(task_t *t)
{
    long done = 0;
    for (;;) {
        long i = atomic_fetch_add(&t->next, 1);
        if (i >= t->nchunks)
            return done;
        /* The last chunk is claimed: nothing is left for helpers, so idle
         * workers stop looking (pb_par_pending) while it runs. */
        if (i == t->nchunks - 1)
            atomic_fetch_sub_explicit(&published, 1, memory_order_release);
        t->fn(t->ctx, i * t->n / t->nchunks, (i + 1) * t->n / t->nchunks);
        done++;
    }
}

void pb_par_help(void)
{
    for (;;) {
        pthread_mutex_lock(&board_lock);
        task_t *t = board;
        while (t && atomic_load(&t->next) >= t->nchunks)
            t = t->next_task;
        if (t)
            atomic_fetch_add(&t->helpers, 1);
        pthread_mutex_unlock(&board_lock);
        if (t == NULL)
            return;
        long done = run_chunks(t);
        atomic_fetch_add(&nhelped, (unsigned long long)done);
        /* After the decrement t may be gone (its caller saw no helper). */
        pthread_mutex_lock(&board_lock);
        if (atomic_fetch_sub(&t->helpers, 1) == 1)
            pthread_cond_broadcast(&board_left);
        pthread_mutex_unlock(&board_lock);
    }
}

void pb_par_for(long n, long grain, pb_par_fn fn, void *ctx)
{
    if (n <= 0)
        return;
    if (grain < 1)
        grain = 1;
    pb_par_backend_t b = backend;
    int idle = n > grain && b.idle ? b.idle(b.arg) : 0;
    long most = n / grain; /* chunks of at least grain */
    if (idle <= 0 || most < 2) {
        fn(ctx, 0, n);
        return;
    }
    /* One chunk for this thread and one per idle thread: a chunk per
     * thread keeps each GEMM piece as large as possible. */
    long nchunks = idle + 1L < most ? idle + 1L : most;
    task_t t = {.fn = fn, .ctx = ctx, .n = n, .nchunks = nchunks};
    atomic_init(&t.next, 0);
    atomic_init(&t.helpers, 0);
    pthread_mutex_lock(&board_lock);
    t.next_task = board;
    board = &t;
    atomic_fetch_add_explicit(&published, 1, memory_order_release);
    pthread_mutex_unlock(&board_lock);
    atomic_fetch_add(&ntasks, 1);
    b.wake(b.arg);
    run_chunks(&t);
    /* Unpublish, then wait for the helpers still running a chunk: first
     * awake (their last chunk is usually µs from done, and a futex
     * wake-up costs tens of µs on these VMs), then asleep. */
    pthread_mutex_lock(&board_lock);
    task_t **pp = &board;
    while (*pp != &t)
        pp = &(*pp)->next_task;
    *pp = t.next_task;
    pthread_mutex_unlock(&board_lock);
    for (int i = 0; i < WAIT_SPINS && atomic_load(&t.helpers) > 0; i++)
        pb_cpu_relax();
    if (atomic_load(&t.helpers) > 0) {
        pthread_mutex_lock(&board_lock);
        while (atomic_load(&t.helpers) > 0)
            pthread_cond_wait(&board_left, &board_lock);
        pthread_mutex_unlock(&board_lock);
    }
}
