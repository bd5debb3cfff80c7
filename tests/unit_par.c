/* unit.par: intra-request parallelism (kernels/par.c) with a stand-in for
 * the worker pool: every piece of [0, n) runs exactly once, idle threads
 * do help, nothing is split without a backend or an idle thread, nested
 * splits finish, and pb_par_for returns only after its helpers left;
 * split GEMMs, GEMVs, fused_dense passes and strided passes give what
 * unsplit ones give. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <math.h>
#include <unistd.h>
#include <sys/wait.h>

#include <cblas.h>
#include <cmocka.h>
#include <lapacke.h>

#include "kernels/act.h"
#include "kernels/blas.h"
#include "kernels/cmplx.h"
#include "kernels/op.h"
#include "kernels/par.h"
#include "kernels/strided.h"
#include "on_valgrind.h"

#define NHELPERS 3

/* Run by bitwise_on_each_core_type under another core type: its tests
 * take fewer cases. */
static bool in_child;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static bool stopping;
static atomic_int idle_threads;
static int lent = NHELPERS; /* what idle() reports */
static pthread_t helpers[NHELPERS];

static int fake_idle(void *arg)
{
    (void)arg;
    int n = atomic_load(&idle_threads);
    return n < lent ? n : lent;
}

static void fake_wake(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&lock);
    pthread_cond_broadcast(&cond);
    pthread_mutex_unlock(&lock);
}

static void *helper_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        if (stopping)
            break;
        if (pb_par_pending()) {
            atomic_fetch_sub(&idle_threads, 1);
            pthread_mutex_unlock(&lock);
            pb_par_help();
            pthread_mutex_lock(&lock);
            atomic_fetch_add(&idle_threads, 1);
            continue;
        }
        pthread_cond_wait(&cond, &lock);
    }
    pthread_mutex_unlock(&lock);
    return NULL;
}

static int setup(void **state)
{
    (void)state;
    stopping = false;
    atomic_store(&idle_threads, NHELPERS);
    for (int i = 0; i < NHELPERS; i++)
        pthread_create(&helpers[i], NULL, helper_main, NULL);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    pthread_mutex_lock(&lock);
    stopping = true;
    pthread_cond_broadcast(&cond);
    pthread_mutex_unlock(&lock);
    for (int i = 0; i < NHELPERS; i++)
        pthread_join(helpers[i], NULL);
    pb_par_set_backend(NULL);
    return 0;
}

static const pb_par_backend_t fake = {fake_idle, fake_wake, NULL, NHELPERS + 1};

/* Lends `idle` helpers (-1: no backend, so nothing splits) to what runs
 * next, once every helper is back waiting; returns the tasks split so far,
 * for split_since. */
static unsigned long long lend(int idle)
{
    pb_par_set_backend(idle < 0 ? NULL : &fake);
    while (atomic_load(&idle_threads) < NHELPERS)
        usleep(100);
    lent = idle < 0 ? 0 : idle;
    unsigned long long t, h;
    pb_par_counts(&t, &h);
    return t;
}

/* The tasks split since lend returned t0; all helpers lent again. */
static unsigned long long split_since(unsigned long long t0)
{
    unsigned long long t, h;
    pb_par_counts(&t, &h);
    lent = NHELPERS;
    return t - t0;
}

typedef struct {
    atomic_int *hits;
    atomic_int calls;
    pthread_t caller;
    atomic_int other_threads;
    int sleep_us;
} cover_t;

static void cover(void *ctx, long lo, long hi)
{
    cover_t *c = ctx;
    atomic_fetch_add(&c->calls, 1);
    if (!pthread_equal(pthread_self(), c->caller))
        atomic_fetch_add(&c->other_threads, 1);
    for (long i = lo; i < hi; i++)
        atomic_fetch_add(&c->hits[i], 1);
    if (c->sleep_us)
        usleep((useconds_t)c->sleep_us);
}

static void run_cover(long n, long grain, int sleep_us, cover_t *c)
{
    c->hits = calloc((size_t)n, sizeof *c->hits);
    atomic_init(&c->calls, 0);
    atomic_init(&c->other_threads, 0);
    c->caller = pthread_self();
    c->sleep_us = sleep_us;
    pb_par_for(n, grain, cover, c);
    for (long i = 0; i < n; i++)
        assert_int_equal(atomic_load(&c->hits[i]), 1);
    free(c->hits);
}

static void inline_without_backend(void **state)
{
    (void)state;
    pb_par_set_backend(NULL);
    cover_t c;
    run_cover(1000, 10, 0, &c);
    assert_int_equal(atomic_load(&c.calls), 1);
    assert_int_equal(atomic_load(&c.other_threads), 0);
}

static void inline_when_nobody_idle(void **state)
{
    (void)state;
    pb_par_set_backend(&fake);
    lent = 0;
    cover_t c;
    run_cover(1000, 10, 0, &c);
    assert_int_equal(atomic_load(&c.calls), 1);
    lent = NHELPERS;
}

static void inline_below_two_grains(void **state)
{
    (void)state;
    pb_par_set_backend(&fake);
    cover_t c;
    run_cover(19, 10, 0, &c);
    assert_int_equal(atomic_load(&c.calls), 1);
}

static void idle_threads_help(void **state)
{
    (void)state;
    pb_par_set_backend(&fake);
    unsigned long long t0, h0, t1, h1;
    pb_par_counts(&t0, &h0);
    cover_t c;
    /* One chunk per thread; each sleeps so that the helpers arrive. */
    run_cover(4000, 10, 20000, &c);
    assert_int_equal(atomic_load(&c.calls), NHELPERS + 1);
    assert_true(atomic_load(&c.other_threads) >= 1);
    pb_par_counts(&t1, &h1);
    assert_int_equal(t1 - t0, 1);
    assert_true(h1 - h0 >= 1);
    /* Fewer idle threads: fewer chunks (once the woken ones are back). */
    while (atomic_load(&idle_threads) < NHELPERS)
        usleep(100);
    lent = 1;
    run_cover(4000, 10, 0, &c);
    assert_int_equal(atomic_load(&c.calls), 2);
    lent = NHELPERS;
}

static void odd_sizes(void **state)
{
    (void)state;
    pb_par_set_backend(&fake);
    for (long n = 20; n < 200; n += 7) {
        cover_t c;
        run_cover(n, 3, 0, &c);
    }
}

typedef struct {
    atomic_long sum;
} nest_t;

static void inner(void *ctx, long lo, long hi)
{
    nest_t *s = ctx;
    for (long i = lo; i < hi; i++)
        atomic_fetch_add(&s->sum, i);
}

static void outer(void *ctx, long lo, long hi)
{
    for (long k = lo; k < hi; k++)
        pb_par_for(1000, 10, inner, ctx);
}

static void nested(void **state)
{
    (void)state;
    pb_par_set_backend(&fake);
    nest_t s;
    atomic_init(&s.sum, 0);
    pb_par_for(8, 1, outer, &s);
    assert_int_equal(atomic_load(&s.sum), 8L * 999 * 1000 / 2);
}

/* Two callers at once (two requests on two workers) share the helpers. */
static void *concurrent_caller(void *arg)
{
    cover_t *c = arg;
    run_cover(100000, 100, 1000, c);
    return NULL;
}

static void concurrent(void **state)
{
    (void)state;
    pb_par_set_backend(&fake);
    pthread_t t[2];
    cover_t c[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&t[i], NULL, concurrent_caller, &c[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
}

/* GEMMs big enough to split give what the unsplit call gives, for every
 * dtype and transpose, split by columns and by rows, through both entry
 * points. */
static void fill(void *p, size_t nscalars, size_t ss, unsigned seed)
{
    srand(seed);
    for (size_t i = 0; i < nscalars; i++) {
        double v = (double)rand() / RAND_MAX - 0.5;
        if (ss == 4)
            ((float *)p)[i] = (float)v;
        else
            ((double *)p)[i] = v;
    }
}

/* Largest |x - y| over largest |y|, for n scalars of ss bytes (4: float,
 * 8: double; complex values are pairs of them). */
static double max_rel_diff(const void *x, const void *y, size_t n, size_t ss)
{
    double m = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        double u = ss == 4 ? ((const float *)x)[i] : ((const double *)x)[i];
        double v = ss == 4 ? ((const float *)y)[i] : ((const double *)y)[i];
        m = fabs(u - v) > m ? fabs(u - v) : m;
        s = fabs(v) > s ? fabs(v) : s;
    }
    return s > 0 ? m / s : m;
}

/* The references in the bitwise tests are OpenBLAS's unsplit calls run as
 * the daemon runs them, on one thread (its threaded GEMMs and GEMVs split
 * and sum in other orders).  Only those tests: with one OpenBLAS thread
 * the other tests' helpers get no turn under valgrind's one-at-a-time
 * scheduling. */
static int blas_one_thread(void)
{
    int n = openblas_get_num_threads();
    openblas_set_num_threads(1);
    return n;
}

/* One GEMM into c, through pb_gemm_cm, with `idle` helpers lent (-1: no
 * backend, so unsplit); the number of tasks it split into. */
static unsigned long long gemm_with(int idle, pb_dtype_t d, char ta, char tb, int m, int n, int k, const void *a,
                                    const void *b, void *c)
{
    bool cplx = d == PB_C64 || d == PB_C128;
    pb_scalar_t al = {0.75, cplx ? 0.25 : 0}, be = {0.5, 0};
    unsigned long long t0 = lend(idle);
    pb_gemm_cm(d, ta, tb, m, n, k, al, a, ta == 'N' ? m : k, b, tb == 'N' ? k : n, be, c, m);
    return split_since(t0);
}

/* A split GEMM's result never depends on how many threads were idle: by
 * columns it is bitwise the unsplit call's, by rows (C taller than wide
 * and too narrow to split, in pieces fixed by the thread count) bitwise
 * the same with 0, 1 or 3 helpers, and within rounding of the unsplit. */
static void gemm_split_matches(void **state)
{
    (void)state;
    static const struct { int m, n, k; bool cols; } shapes[] = {
        {300, 200, 100, true}, {9, 3000, 400, true}, {100, 1001, 90, true},
        {2000, 20, 200, false}, {600, 300, 100, false}, {3000, 47, 100, false}};
    static const char ops[] = "NTC";
    /* Under valgrind (run_all's memcheck stage) BLAS runs some fifty times
     * slower: one pair of ops per dtype and shape is enough there (and
     * under each other core type), and there, where only memory is
     * checked, a shape a way, the smallest and largest element and no
     * run with one helper. */
    bool slow = RUNNING_ON_VALGRIND || in_child;
    int threads = blas_one_thread();
    for (int d = PB_F32; d <= PB_C128; d++) {
        size_t es = pb_dtype_size((pb_dtype_t)d);
        bool cplx = d == PB_C64 || d == PB_C128;
        if (RUNNING_ON_VALGRIND && d != PB_F32 && d != PB_C128)
            continue;
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            if (RUNNING_ON_VALGRIND && s != 0 && s != 3)
                continue;
            int m = shapes[s].m, n = shapes[s].n, k = shapes[s].k;
            int nops = cplx ? 3 : 2;
            /* Slow: one pair of ops per shape, a different one each. */
            int ia0 = slow ? (int)s % nops : 0, ia1 = slow ? ia0 + 1 : nops;
            int ib0 = slow ? (int)(s / nops + d) % nops : 0, ib1 = slow ? ib0 + 1 : nops;
            for (int ia = ia0; ia < ia1; ia++)
                for (int ib = ib0; ib < ib1; ib++) {
                    char ta = ops[ia], tb = ops[ib];
                    void *a = malloc((size_t)m * k * es), *b = malloc((size_t)k * n * es);
                    size_t bytes = (size_t)m * n * es;
                    void *c0 = malloc(bytes), *c[3];
                    size_t ss = d == PB_F32 || d == PB_C64 ? 4 : 8, per = cplx ? 2 : 1;
                    fill(a, (size_t)m * k * per, ss, 1);
                    fill(b, (size_t)k * n * per, ss, 2);
                    fill(c0, (size_t)m * n * per, ss, 3);
                    void *whole = malloc(bytes);
                    memcpy(whole, c0, bytes);
                    assert_int_equal(gemm_with(-1, (pb_dtype_t)d, ta, tb, m, n, k, a, b, whole), 0);
                    static const int idles[3] = {NHELPERS, 1, 0};
                    for (int i = 0; i < 3; i++) {
                        c[i] = malloc(bytes);
                        memcpy(c[i], c0, bytes);
                        if (RUNNING_ON_VALGRIND && i == 1)
                            continue;
                        unsigned long long tasks = gemm_with(idles[i], (pb_dtype_t)d, ta, tb, m, n, k, a, b, c[i]);
                        assert_int_equal(tasks, idles[i] > 0);
                    }
                    for (int i = 1; i < 3; i++)
                        if (!(RUNNING_ON_VALGRIND && i == 1) && memcmp(c[i], c[0], bytes) != 0)
                            fail_msg("dtype %d %c%c %dx%dx%d: %d helpers give other bits than %d", d, ta, tb, m,
                                     n, k, idles[i], NHELPERS);
                    double err = max_rel_diff(c[0], whole, (size_t)m * n * per, ss);
                    if (shapes[s].cols ? memcmp(c[0], whole, bytes) != 0
                                       : err > (ss == 4 ? 1e-5 : 1e-13))
                        fail_msg("dtype %d %c%c %dx%dx%d: split by %s differs from unsplit by %g", d, ta, tb, m, n,
                                 k, shapes[s].cols ? "columns" : "rows", err);
                    for (int i = 0; i < 3; i++)
                        free(c[i]);
                    free(a);
                    free(b);
                    free(c0);
                    free(whole);
                }
        }
    }
    openblas_set_num_threads(threads);
}

/* alpha = 0 as BLAS defines it: a and b are not read (NaN and Inf there
 * reach nothing), C = beta·C, and with beta = 0 C is not read either.
 * OpenBLAS 0.3.21's small-matrix GEMM kernels (SkylakeX, Cooperlake) do
 * multiply by alpha: a NaN in a reached C through them. */
static void gemm_alpha_zero(void **state)
{
    (void)state;
    static const int shapes[][3] = {{2, 3, 4}, {40, 50, 30}, {96, 100, 90}, {200, 300, 100}};
    for (int d = 0; d < PB_NDTYPES; d++) {
        size_t ss = d == PB_F32 || d == PB_C64 ? 4 : 8, per = d == PB_C64 || d == PB_C128 ? 2 : 1;
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            int m = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
            size_t na = (size_t)m * k * per, nb = (size_t)k * n * per, nc = (size_t)m * n * per;
            void *a = malloc(na * ss), *b = malloc(nb * ss), *c = malloc(nc * ss), *want = malloc(nc * ss);
            fill(a, na, ss, 1);
            fill(b, nb, ss, 2);
            for (int beta0 = 0; beta0 < 2; beta0++)
                for (int t = 0; t < 2; t++) {
                    /* NaN and Inf in a and b, everywhere in a's first column */
                    for (size_t i = 0; i < (size_t)m * per; i++) {
                        if (ss == 4)
                            ((float *)a)[i] = i % 2 ? NAN : INFINITY;
                        else
                            ((double *)a)[i] = i % 2 ? NAN : INFINITY;
                    }
                    if (ss == 4)
                        ((float *)b)[nb - 1] = NAN;
                    else
                        ((double *)b)[nb - 1] = NAN;
                    fill(c, nc, ss, 3);
                    for (size_t i = 0; i < nc; i++) {
                        double v = ss == 4 ? ((float *)c)[i] : ((double *)c)[i];
                        double w = beta0 ? 0 : 0.5 * v;
                        if (beta0)
                            v = NAN; /* beta = 0: C is not read */
                        if (ss == 4)
                            ((float *)c)[i] = (float)v, ((float *)want)[i] = (float)w;
                        else
                            ((double *)c)[i] = v, ((double *)want)[i] = w;
                    }
                    char ta = t ? (per == 2 ? 'C' : 'T') : 'N';
                    pb_scalar_t alpha = {t ? -0.0 : 0.0, 0}, beta = {beta0 ? 0 : 0.5, 0};
                    (void)lend(NHELPERS); /* the largest shape splits */
                    pb_gemm_cm(d, ta, 'N', m, n, k, alpha, a, t ? k : m, b, k, beta, c, m);
                    if (memcmp(c, want, nc * ss) != 0)
                        fail_msg("dtype %d, %dx%dx%d, op %c, beta %g: C is not beta·C", d, m, n, k, ta, beta.re);
                }
            free(a);
            free(b);
            free(c);
            free(want);
        }
    }
}

/* pb_gemm on views: C and F orders of every operand, split or not, against
 * a plain triple loop. */
static void gemm_views(void **state)
{
    (void)state;
    int m = 200, n = 300, k = 100; /* C or Cᵀ: 24-column blocks enough to split */
    double *a = malloc(sizeof(double) * m * k), *b = malloc(sizeof(double) * k * n);
    double *c = malloc(sizeof(double) * m * n), *ref = malloc(sizeof(double) * m * n);
    fill(a, (size_t)m * k, 8, 4);
    fill(b, (size_t)k * n, 8, 5);
    for (int split = 0; split < 2; split++) {
        if (RUNNING_ON_VALGRIND && !split)
            continue; /* the triple loop is slow there; the split path is what counts */
        for (int oa = 0; oa < 2; oa++)
            for (int ob = 0; ob < 2; ob++)
                for (int oc = 0; oc < 2; oc++) {
                    char fa = oa ? 'F' : 'C', fb = ob ? 'F' : 'C', fc = oc ? 'F' : 'C';
                    if (RUNNING_ON_VALGRIND && (oa == ob || ob == oc))
                        continue; /* two mixed orders are enough there */
#define AT(p, o, r, cc, R, Cn) ((o) == 'C' ? (p)[(size_t)(r) * (Cn) + (cc)] : (p)[(size_t)(cc) * (R) + (r)])
                    for (int i = 0; i < m; i++)
                        for (int j = 0; j < n; j++) {
                            double s = 0;
                            for (int l = 0; l < k; l++)
                                s += AT(a, fa, i, l, m, k) * AT(b, fb, l, j, k, n);
                            ref[fc == 'C' ? (size_t)i * n + j : (size_t)j * m + i] = 2 * s;
                        }
                    unsigned long long t0 = lend(split ? NHELPERS : -1);
                    pb_gemm(PB_F64, 2.0, (pb_mview_t){a, m, k, fa}, (pb_mview_t){b, k, n, fb}, 0.0,
                            (pb_mview_t){c, m, n, fc});
                    assert_int_equal(split_since(t0), split);
                    assert_true(max_rel_diff(c, ref, (size_t)m * n, 8) < 1e-13);
                }
    }
    free(a);
    free(b);
    free(c);
    free(ref);
}

/* fused_dense's bias+activation and dz passes, split across the helpers,
 * give bitwise what they give unsplit (b̄'s row sums included), in C and
 * F order, f32 and f64; the shape keeps the GEMMs below their own split. */
extern const pb_op_t pb_op_fused_dense;

typedef struct {
    pb_tensor_t y, grad[3];
} fd_result_t;

static void fd_tensor(pb_tensor_t *t, pb_dtype_t d, int rank, uint64_t r, uint64_t c, char o, unsigned seed)
{
    uint64_t shape[2] = {r, c};
    assert_int_equal(pb_tensor_alloc(t, d, rank, shape, o, false), 0);
    /* Unit variance, so that |z| ~ 2 and the exps' arguments spread wide. */
    fill(pb_tensor_data(t), pb_tensor_count(t), pb_dtype_size(d), seed);
    size_t n = pb_tensor_count(t);
    for (size_t i = 0; i < n; i++) {
        if (d == PB_F32)
            ((float *)pb_tensor_data(t))[i] *= 3.4641016f;
        else
            ((double *)pb_tensor_data(t))[i] *= 3.4641016151377546;
    }
}

static void fd_run(pb_dtype_t d, char o, fd_result_t *r)
{
    enum { OUT = 1024, IN = 4, BATCH = 384 }; /* 393216 elements; GEMMs 1.6e6 multiply-adds */
    pb_call_t c;
    memset(&c, 0, sizeof c);
    c.op = &pb_op_fused_dense;
    c.device = (pb_device_t){PB_DEV_CPU, 0};
    c.dtype = d;
    c.order = o;
    c.taped = true;
    c.wrt = 7;
    c.opt[0].given = true;
    c.opt[0].index = PB_ACT_GELU;
    fd_tensor(&c.in[0], d, 2, OUT, IN, o, 11);
    fd_tensor(&c.in[1], d, 2, IN, BATCH, o, 12);
    fd_tensor(&c.in[2], d, 1, OUT, 0, 'C', 13);
    pb_err_t err;
    assert_int_equal(pb_op_fused_dense.validate(&c, &err), 0);
    pb_tapedata_t tape;
    assert_int_equal(pb_op_run_forward(&c, &tape, &err), 0);
    r->y = c.out[0];
    c.out[0] = (pb_tensor_t){0};
    pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
    fd_tensor(&cot[0], d, 2, OUT, BATCH, o, 14);
    pb_warnings_t warn = {0};
    assert_int_equal(pb_op_run_reverse(&tape, cot, grad, o, &warn, &err), 0);
    for (int k = 0; k < 3; k++)
        r->grad[k] = grad[k];
    pb_tensor_clear(&cot[0]);
    pb_tapedata_clear(&tape);
    pb_call_clear(&c);
}

static void fd_result_clear(fd_result_t *r)
{
    pb_tensor_clear(&r->y);
    for (int k = 0; k < 3; k++)
        pb_tensor_clear(&r->grad[k]);
}

static void fused_dense_split_matches(void **state)
{
    (void)state;
    for (int d = PB_F32; d <= PB_F64; d++)
        for (int oc = 0; oc < 2; oc++) {
            char o = oc ? 'F' : 'C';
            fd_result_t one, split;
            pb_par_set_backend(NULL);
            fd_run((pb_dtype_t)d, o, &one);
            pb_par_set_backend(&fake);
            /* Helpers may wake too late to take a piece of one pass: run
             * until one of them has, each run bitwise as unsplit. */
            unsigned long long helped = 0;
            for (int rep = 0; rep < 50 && helped == 0; rep++) {
                while (atomic_load(&idle_threads) < NHELPERS)
                    usleep(100);
                unsigned long long t0, h0, t1, h1;
                pb_par_counts(&t0, &h0);
                fd_run((pb_dtype_t)d, o, &split);
                pb_par_counts(&t1, &h1);
                assert_int_equal(t1 - t0, 2); /* the bias+act pass and the dz pass */
                helped = h1 - h0;
                const pb_tensor_t *a[4] = {&one.y, &one.grad[0], &one.grad[1], &one.grad[2]};
                const pb_tensor_t *b[4] = {&split.y, &split.grad[0], &split.grad[1], &split.grad[2]};
                for (int k = 0; k < 4; k++) {
                    assert_int_equal(pb_tensor_bytes(a[k]), pb_tensor_bytes(b[k]));
                    if (memcmp(pb_tensor_data(a[k]), pb_tensor_data(b[k]), pb_tensor_bytes(a[k])) != 0)
                        fail_msg("dtype %d order %c: output %d differs split", d, o, k);
                }
                fd_result_clear(&split);
            }
            assert_true(helped > 0);
            fd_result_clear(&one);
        }
}


/* Permutations, axpby and accumulations big enough to split give
 * bitwise what the unsplit pass gives: each element is computed by one
 * piece in the same way.  Shapes leave partial tiles at every edge. */
static void strided_split_matches(void **state)
{
    (void)state;
    static const struct {
        int rank;
        uint64_t dim[3];
        int perm[3];
    } cases[] = {
        {2, {1030, 1100, 1}, {1, 0, 2}}, /* a transpose */
        {2, {1500, 900, 1}, {0, 1, 2}},  /* a copy */
        {3, {70, 130, 150}, {2, 0, 1}},
        {3, {131, 67, 149}, {1, 2, 0}},
        {3, {300, 5, 900}, {0, 2, 1}},
    };
    for (int d = PB_F32; d <= PB_C128; d++) {
        if (RUNNING_ON_VALGRIND && d != PB_C128)
            continue;
        size_t es = pb_dtype_size((pb_dtype_t)d), ss = d == PB_F32 || d == PB_C64 ? 4 : 8;
        bool cplx = d == PB_C64 || d == PB_C128;
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            int rank = cases[ci].rank;
            size_t n = 1;
            for (int k = 0; k < rank; k++)
                n *= cases[ci].dim[k];
            if (n * es * 2 < ((size_t)8 << 20))
                continue; /* too small to split at this dtype (strided.c's PAR_BYTES) */
            char *src = malloc(n * es), *src2 = malloc(n * es), *d1 = malloc(n * es), *d2 = malloc(n * es);
            fill(src, n * es / ss, ss, 7);
            fill(src2, n * es / ss, ss, 8);
            /* dst is dense C order over the permuted shape; src and src2
             * are dense C order over dim, read through the permutation. */
            pb_loop_t L = {.rank = rank};
            uint64_t pdim[3];
            int64_t sst[3], dst_[3];
            for (int k = 0; k < rank; k++)
                pdim[k] = cases[ci].dim[cases[ci].perm[k]];
            pb_dense_strides(rank, cases[ci].dim, 'C', sst);
            pb_dense_strides(rank, pdim, 'C', dst_);
            for (int k = 0; k < rank; k++) {
                L.dim[k] = pdim[k];
                L.s[0][k] = dst_[k];
                L.s[1][k] = sst[cases[ci].perm[k]];
                L.s[2][k] = sst[cases[ci].perm[k]];
            }
            for (int mode = 0; mode < 3; mode++) { /* copy, axpby, accumulate */
                pb_scalar_t al = {mode ? 0.75 : 1, cplx && mode ? 0.25 : 0}, be = {0.5, cplx ? -0.5 : 0};
                bool conj = cplx && mode == 1, acc = mode == 2;
                const void *s2 = mode == 1 ? src2 : NULL;
                fill(d1, n * es / ss, ss, 9);
                memcpy(d2, d1, n * es);
                pb_par_set_backend(NULL);
                pb_strided((pb_dtype_t)d, &L, d1, src, conj, al, s2, be, acc);
                unsigned long long t0 = lend(NHELPERS);
                pb_strided((pb_dtype_t)d, &L, d2, src, conj, al, s2, be, acc);
                unsigned long long tasks = split_since(t0);
                pb_par_set_backend(NULL);
                if (tasks != 1)
                    fail_msg("dtype %d case %zu mode %d: not split", d, ci, mode);
                if (memcmp(d1, d2, n * es) != 0)
                    fail_msg("dtype %d case %zu mode %d: the split pass differs", d, ci, mode);
            }
            free(src);
            free(src2);
            free(d1);
            free(d2);
        }
    }
}

/* An accumulation into a destination of stride 0 (a reduction) is not
 * split along that index: pieces would add into the same elements. */
static void strided_reduction_not_split(void **state)
{
    (void)state;
    size_t n = 2000, m = 1000;
    double *src = malloc(sizeof(double) * n * m), d1[1000] = {0}, d2[1000] = {0};
    fill(src, n * m, 8, 3);
    /* dst[j] += src[i, j]: index 1 (i) has dst stride 0 and is outermost. */
    pb_loop_t L = {.rank = 2, .dim = {m, n}, .s = {{1, 0}, {1, (int64_t)m}}};
    pb_par_set_backend(NULL);
    pb_strided(PB_F64, &L, d1, src, false, (pb_scalar_t){1, 0}, NULL, (pb_scalar_t){0, 0}, true);
    pb_par_set_backend(&fake);
    pb_strided(PB_F64, &L, d2, src, false, (pb_scalar_t){1, 0}, NULL, (pb_scalar_t){0, 0}, true);
    pb_par_set_backend(NULL);
    assert_memory_equal(d1, d2, sizeof d1);
    free(src);
}

/* LAPACK's GEMMs (kernels/blas_lapack.c): the Fortran entry, lower-case
 * transposes and complex scalars included, splits as pb_gemm_cm does and
 * gives what it gives unsplit; and LAPACK's own calls reach it (a QR of
 * 600², whose block reflectors are GEMMs, splits and gives the same R). */
void zgemm_(const char *, const char *, const int *, const int *, const int *, const double complex *,
            const double complex *, const int *, const double complex *, const int *, const double complex *,
            double complex *, const int *);

static void lapack_gemm_entry(void **state)
{
    (void)state;
    int m = 300, n = 500, k = 200, lda = k, ldb = n, ldc = m;
    size_t es = sizeof(double complex);
    void *a = malloc((size_t)k * m * es), *b = malloc((size_t)n * k * es);
    void *c1 = malloc((size_t)m * n * es), *c2 = malloc((size_t)m * n * es);
    fill(a, (size_t)k * m * 2, 8, 7);
    fill(b, (size_t)n * k * 2, 8, 8);
    fill(c1, (size_t)m * n * 2, 8, 9);
    memcpy(c2, c1, (size_t)m * n * es);
    double complex al = CMPLX(0.5, 0.25), be = CMPLX(-1, 0);
    pb_par_set_backend(NULL);
    pb_gemm_cm(PB_C128, 'C', 'T', m, n, k, (pb_scalar_t){0.5, 0.25}, a, lda, b, ldb, (pb_scalar_t){-1, 0}, c1, ldc);
    unsigned long long t0 = lend(NHELPERS);
    zgemm_("c", "t", &m, &n, &k, &al, a, &lda, b, &ldb, &be, c2, &ldc);
    unsigned long long tasks = split_since(t0);
    pb_par_set_backend(NULL);
    assert_int_equal(tasks, 1);
    assert_true(max_rel_diff(c2, c1, (size_t)m * n * 2, 8) < 1e-13);
    free(a);
    free(b);
    free(c1);
    free(c2);
}

static void lapack_calls_split(void **state)
{
    (void)state;
    int n = 600;
    size_t bytes = (size_t)n * n * sizeof(double);
    double *r1 = malloc(bytes), *r2 = malloc(bytes), *tau = malloc((size_t)n * sizeof *tau);
    fill(r1, (size_t)n * n, 8, 10);
    memcpy(r2, r1, bytes);
    assert_int_equal(LAPACKE_dgeqrf(LAPACK_COL_MAJOR, n, n, r1, n, tau), 0);
    unsigned long long t0 = lend(NHELPERS);
    assert_int_equal(LAPACKE_dgeqrf(LAPACK_COL_MAJOR, n, n, r2, n, tau), 0);
    unsigned long long tasks = split_since(t0);
    pb_par_set_backend(NULL);
    print_message("geqrf %d²: %llu GEMMs split\n", n, tasks);
    assert_true(tasks > 0);
    assert_true(max_rel_diff(r2, r1, (size_t)n * n, 8) < 1e-12);
    free(r1);
    free(r2);
    free(tau);
}

/* LAPACK's GEMVs (kernels/blas_lapack.c): split along y, each element
 * comes out bitwise as the whole call gives it, for every dtype and
 * transpose, odd shapes, strides (x's negative) and scalars (beta 0
 * included); f32 GEMVs never split.  Then the Fortran entry, and LAPACK's
 * own calls: an SVD's values (gebrd's GEMVs split) as without helpers. */
void dgemv_(const char *, const int *, const int *, const double *, const double *, const int *, const double *,
            const int *, const double *, double *, const int *);

/* One GEMV split (or, for f32, not) against the whole call, bitwise. */
static int gemv_one(pb_dtype_t d, char t, int m, int n, int lda, int incx, int incy, unsigned seed)
{
    bool cplx = d == PB_C64 || d == PB_C128;
    int lx = t == 'N' ? n : m, ly = t == 'N' ? m : n;
    size_t es = pb_dtype_size(d), ss = d == PB_F32 || d == PB_C64 ? 4 : 8, per = cplx ? 2 : 1;
    size_t na = (size_t)lda * n, nx = (size_t)lx * abs(incx), ny = (size_t)ly * incy;
    void *a = malloc(na * es), *x = malloc(nx * es), *y1 = malloc(ny * es), *y2 = malloc(ny * es);
    fill(a, na * per, ss, seed);
    fill(x, nx * per, ss, seed + 1000);
    fill(y1, ny * per, ss, seed + 2000);
    memcpy(y2, y1, ny * es);
    pb_scalar_t al = {0.75, cplx ? -0.5 : 0}, be = {seed % 2 ? 0 : -1.25, cplx ? 0.25 : 0};
    pb_par_set_backend(NULL);
    pb_gemv_cm(d, t, m, n, al, a, lda, x, incx, be, y1, incy);
    unsigned long long t0 = lend(NHELPERS);
    pb_gemv_cm(d, t, m, n, al, a, lda, x, incx, be, y2, incy);
    unsigned long long tasks = split_since(t0);
    pb_par_set_backend(NULL);
    if (tasks > (d == PB_F32 ? 0u : 1u))
        fail_msg("dtype %d %c %dx%d: %llu splits", d, t, m, n, tasks);
    if (memcmp(y1, y2, ny * es) != 0)
        fail_msg("dtype %d %c %dx%d lda %d incx %d incy %d: split differs", d, t, m, n, lda, incx, incy);
    free(a);
    free(x);
    free(y1);
    free(y2);
    return (int)(tasks);
}

static void gemv_split_matches(void **state)
{
    (void)state;
    int threads = blas_one_thread();
    static const char ops[] = "NTC";
    int rounds = RUNNING_ON_VALGRIND ? 12 : in_child ? 100 : 400, nsplit = 0;
    srand(11);
    for (int r = 0; r < rounds; r++) {
        pb_dtype_t d = (pb_dtype_t)(PB_F32 + r % 4);
        bool cplx = d == PB_C64 || d == PB_C128;
        char t = ops[(r / 4) % (cplx ? 3 : 2)];
        int m = 64 + rand() % 700, n = 1 + (1 << 16) / m + rand() % 600;
        int lda = m + rand() % 5, incx = (int[]){1, 2, -1}[rand() % 3], incy = 1 + 2 * (rand() % 2);
        nsplit += gemv_one(d, t, m, n, lda, incx, incy, (unsigned)r);
    }
    openblas_set_num_threads(threads);
    print_message("%d of %d GEMVs split\n", nsplit, rounds);
    assert_true(nsplit >= rounds / 2);
}

/* The shapes random sizes rarely reach: the dimension a piece keeps whole
 * tiny (1-17, where kernels switch to their narrow paths) with lda == m,
 * and y's length at and around the kernels' block sizes.  Under
 * OPENBLAS_CORETYPE=SkylakeX these found sgemv's dependence on the whole
 * call's shape; run them under each core type when OpenBLAS changes. */
static void gemv_edges(void **state)
{
    (void)state;
    int threads = blas_one_thread();
    static const int narrow[] = {1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17};
    static const int lens[] = {16, 17, 31, 33, 64, 65, 127, 257, 1000, 4100, 8208};
    int nsplit = 0, ncases = 0;
    for (int d = PB_F32; d <= PB_C128; d++)
        for (const char *t = d == PB_C64 || d == PB_C128 ? "NTC" : "NT"; *t; t++) {
            int step = RUNNING_ON_VALGRIND ? 4 : in_child ? 2 : 1;
            for (int i = 0; i < (int)(sizeof narrow / sizeof *narrow); i += step) {
                int k = narrow[i], long_side = (3 << 16) / k + 16 * (k % 3) + 5;
                int m = *t == 'N' ? long_side : k, n = *t == 'N' ? k : long_side;
                nsplit += gemv_one((pb_dtype_t)d, *t, m, n, m, 1, 1, (unsigned)i);
                nsplit += gemv_one((pb_dtype_t)d, *t, m, n, m + 1, -1, 2, (unsigned)i + 50);
                ncases += 2;
            }
            for (int i = 0; i < (int)(sizeof lens / sizeof *lens); i += step) {
                int len = lens[i], other = (3 << 16) / len + 3;
                int m = *t == 'N' ? len : other, n = *t == 'N' ? other : len;
                nsplit += gemv_one((pb_dtype_t)d, *t, m, n, m, 1, 1, (unsigned)i + 100);
                nsplit += gemv_one((pb_dtype_t)d, *t, m, n, m + 7, 2, 3, (unsigned)i + 150);
                ncases += 2;
            }
        }
    openblas_set_num_threads(threads);
    print_message("%d of %d edge GEMVs split\n", nsplit, ncases);
    assert_true(nsplit >= ncases / 2);
}

static void lapack_gemv_entry(void **state)
{
    (void)state;
    int threads = blas_one_thread();
    int m = 500, n = 400, lda = 503, one = 1;
    double *a = malloc((size_t)lda * n * sizeof *a), *x = malloc((size_t)m * sizeof *x);
    double y1[400], y2[400], al = 0.5, be = 2;
    fill(a, (size_t)lda * n, 8, 12);
    fill(x, (size_t)m, 8, 13);
    fill(y1, 400, 8, 14);
    memcpy(y2, y1, sizeof y1);
    pb_par_set_backend(NULL);
    pb_gemv_cm(PB_F64, 'T', m, n, (pb_scalar_t){al, 0}, a, lda, x, one, (pb_scalar_t){be, 0}, y1, one);
    unsigned long long t0 = lend(NHELPERS);
    dgemv_("t", &m, &n, &al, a, &lda, x, &one, &be, y2, &one);
    unsigned long long tasks = split_since(t0);
    pb_par_set_backend(NULL);
    openblas_set_num_threads(threads);
    assert_int_equal(tasks, 1);
    assert_memory_equal(y1, y2, sizeof y1);
    free(a);
    free(x);
}

/* An SVD's values with helpers lent: its GEMVs and GEMMs split, and the
 * values come out bitwise the same whether 3 helpers, 1 or none are idle
 * (the daemon's results do not depend on the load); against the run
 * without a backend (nothing split) they differ only in rounding, since
 * gebrd's row-split GEMMs round otherwise (kernels/blas.c). */
static void lapack_svd_gemvs_split(void **state)
{
    (void)state;
    int n = RUNNING_ON_VALGRIND ? 300 : 600, threads = blas_one_thread();
    size_t bytes = (size_t)n * n * sizeof(double);
    double *a = malloc(bytes), *work = malloc(bytes), *s[4];
    fill(a, (size_t)n * n, 8, 15);
    static const int idles[4] = {-1, NHELPERS, 1, 0};
    unsigned long long split[4];
    for (int i = 0; i < 4; i++) {
        s[i] = malloc((size_t)n * sizeof *s[i]);
        memcpy(work, a, bytes);
        unsigned long long t0 = lend(idles[i]);
        assert_int_equal(LAPACKE_dgesdd(LAPACK_COL_MAJOR, 'N', n, n, work, n, s[i], NULL, 1, NULL, 1), 0);
        split[i] = split_since(t0);
    }
    pb_par_set_backend(NULL);
    openblas_set_num_threads(threads);
    print_message("gesdd values %d²: %llu GEMMs and GEMVs split\n", n, split[1]);
    /* Two GEMVs a column split while the trailing matrix holds 64 Ki elements. */
    assert_true(split[1] > (unsigned long long)(n - 256));
    assert_int_equal(split[0], 0);
    assert_int_equal(split[3], 0);
    assert_memory_equal(s[2], s[1], (size_t)n * sizeof *s[1]);
    assert_memory_equal(s[3], s[1], (size_t)n * sizeof *s[1]);
    assert_true(max_rel_diff(s[1], s[0], (size_t)n, 8) < 1e-13);
    for (int i = 0; i < 4; i++)
        free(s[i]);
    free(a);
    free(work);
}

/* The bitwise claims (kernels/blas.c), and alpha = 0 not reading a and b,
 * hold on each x86-64 core type
 * OpenBLAS has kernels for, not only this machine's: run those tests again
 * in a child per core type this CPU can execute (OPENBLAS_CORETYPE is read
 * when OpenBLAS loads; the child checks that it took).  Not under
 * valgrind, where one child would take minutes, nor under ASan: it checks
 * numbers, which the release build's run covers. */
static const struct CMUnitTest bitwise_tests[] = {
    cmocka_unit_test(gemm_split_matches), cmocka_unit_test(gemv_split_matches), cmocka_unit_test(gemv_edges),
    cmocka_unit_test(gemm_alpha_zero)};

extern char **environ;

static void bitwise_on_each_core_type(void **state)
{
    (void)state;
#if defined(__SANITIZE_ADDRESS__) || !(defined(__x86_64__) || defined(__i386__))
    skip();
#else
    if (RUNNING_ON_VALGRIND)
        skip();
    static const struct { const char *core, *needs; } cores[] = {
        {"Prescott", "sse3"},        {"Core2", "ssse3"},     {"Nehalem", "sse4.2"},
        {"Barcelona", "sse4a"},      {"Sandybridge", "avx"}, {"Haswell", "avx2"},
        {"Zen", "avx2"},             {"SkylakeX", "avx512f"}, {"Cooperlake", "avx512bf16"}};
    __builtin_cpu_init();
    /* The child's environment: ours, less the two variables it gets. */
    size_t nenv = 0;
    while (environ[nenv])
        nenv++;
    char **env = calloc(nenv + 3, sizeof *env), core_var[64];
    size_t e = 0;
    for (size_t i = 0; i < nenv; i++)
        if (strncmp(environ[i], "OPENBLAS_CORETYPE=", 18) && strncmp(environ[i], "PB_UNIT_PAR_BITWISE_ONLY=", 25))
            env[e++] = environ[i];
    env[e++] = "PB_UNIT_PAR_BITWISE_ONLY=1";
    env[e + 1] = NULL;
    int ran = 0;
    for (size_t i = 0; i < sizeof cores / sizeof cores[0]; i++) {
        const char *n = cores[i].needs;
        bool ok = !strcmp(n, "sse3")     ? __builtin_cpu_supports("sse3")
                  : !strcmp(n, "ssse3")  ? __builtin_cpu_supports("ssse3")
                  : !strcmp(n, "sse4.2") ? __builtin_cpu_supports("sse4.2")
                  : !strcmp(n, "sse4a")  ? __builtin_cpu_supports("sse4a")
                  : !strcmp(n, "avx")    ? __builtin_cpu_supports("avx")
                  : !strcmp(n, "avx2")   ? __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                  : !strcmp(n, "avx512f") ? __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
                                          : __builtin_cpu_supports("avx512bf16");
        if (!ok)
            continue;
        snprintf(core_var, sizeof core_var, "OPENBLAS_CORETYPE=%s", cores[i].core);
        env[e] = core_var;
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            execve("/proc/self/exe", (char *[]){"unit_par", NULL}, env);
            _exit(127);
        }
        int st;
        assert_int_equal(waitpid(pid, &st, 0), pid);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            fail_msg("bitwise tests fail with OPENBLAS_CORETYPE=%s (status %#x)", cores[i].core, st);
        ran++;
    }
    free(env);
    print_message("bitwise tests passed on %d core types\n", ran);
    assert_true(ran >= 1);
#endif
}

int main(void)
{
    if (getenv("PB_UNIT_PAR_BITWISE_ONLY")) {
        /* An OpenBLAS built for one core ignores OPENBLAS_CORETYPE. */
        const char *want = getenv("OPENBLAS_CORETYPE");
        if (want == NULL || strcasecmp(want, openblas_get_corename()) != 0) {
            fprintf(stderr, "OPENBLAS_CORETYPE=%s, but OpenBLAS runs %s kernels\n", want ? want : "",
                    openblas_get_corename());
            return 1;
        }
        in_child = true;
        return cmocka_run_group_tests_name(getenv("OPENBLAS_CORETYPE"), bitwise_tests, setup, teardown);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(inline_without_backend), cmocka_unit_test(inline_when_nobody_idle),
        cmocka_unit_test(inline_below_two_grains), cmocka_unit_test(idle_threads_help),
        cmocka_unit_test(odd_sizes), cmocka_unit_test(nested), cmocka_unit_test(concurrent),
        cmocka_unit_test(gemm_split_matches), cmocka_unit_test(gemm_views),
        cmocka_unit_test(fused_dense_split_matches), cmocka_unit_test(strided_split_matches),
        cmocka_unit_test(strided_reduction_not_split), cmocka_unit_test(lapack_gemm_entry),
        cmocka_unit_test(lapack_calls_split), cmocka_unit_test(gemv_split_matches),
        cmocka_unit_test(lapack_gemv_entry), cmocka_unit_test(lapack_svd_gemvs_split),
        cmocka_unit_test(gemv_edges), cmocka_unit_test(gemm_alpha_zero), cmocka_unit_test(bitwise_on_each_core_type),
    };
    return cmocka_run_group_tests_name("unit.par", tests, setup, teardown);
}
