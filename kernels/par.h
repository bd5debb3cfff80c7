/* Intra-request parallelism: split one kernel's independent pieces (the
 * column blocks of a GEMM, the slabs of a permutation) across threads that
 * have nothing else to do.
 *
 * The kernels never name the daemon: they call pb_par_for, and whoever
 * owns threads (the daemon's worker pool) lends its idle ones by
 * installing a backend and calling pb_par_help from an idle thread.
 * Without a backend, or with no thread idle, pb_par_for runs every piece
 * on the calling thread: work is never queued behind a request, so under
 * load each request keeps exactly its own core and the total of busy
 * threads never exceeds the pool's (which is sized to the cores).
 *
 * Glossary
 *   task     one pb_par_for call: [0, n) split into chunks, published on a
 *            board until the caller has claimed the last chunk.
 *   helper   an idle pool thread inside pb_par_help, running chunks of a
 *            published task.
 *
 * Ownership: a task lives on its caller's stack; pb_par_for returns only
 * after every helper has left it. */
#ifndef PB_PAR_H
#define PB_PAR_H

/* Run fn(ctx, lo, hi) over [0, n) in chunks of at least `grain`: chunk i
 * of c is [i*n/c, (i+1)*n/c), c being one more than the threads idle, at
 * most n/grain.  With no thread idle (or c < 2) it is fn(ctx, 0, n) on
 * the calling thread. */
typedef void (*pb_par_fn)(void *ctx, long lo, long hi);
void pb_par_for(long n, long grain, pb_par_fn fn, void *ctx);

/* What a thread owner lends: idle() counts the threads free to help now;
 * wake(arg) rouses them so that they call pb_par_help; threads is how many
 * it has in all, a caller of pb_par_for included. */
typedef struct pb_par_backend {
    int (*idle)(void *arg);
    void (*wake)(void *arg);
    void *arg;
    int threads;
} pb_par_backend_t;

/* Install (or with NULL remove) the backend; not while tasks run. */
void pb_par_set_backend(const pb_par_backend_t *b);
/* The backend's thread count (1 without one): for work that splits into
 * pieces fixed by it, not by the load. */
int pb_par_threads(void);
/* True when a published task has chunks left (cheap, lock-free). */
int pb_par_pending(void);
/* Run chunks of published tasks until none is left; from an idle thread. */
void pb_par_help(void);
/* Tasks split so far and chunks run by helpers (for metrics and tests). */
void pb_par_counts(unsigned long long *tasks, unsigned long long *helped);

/* One step of a busy wait (the CPU's pause hint): for the waits here and
 * the pool's, which stay awake briefly because a futex wake-up costs tens
 * of µs on virtual machines. */
static inline void pb_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

#endif
