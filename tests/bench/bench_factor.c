/* bench_factor: the factorizations in process against the bare LAPACKE
 * drivers they call, measured in the same run on one thread (OpenBLAS
 * single threaded, as in the daemon's workers).
 *
 *   forward ratio  = op forward ÷ the bare calls it needs, on a copy of
 *                    the same column-major matrix (qr_compact: geqrf +
 *                    orgqr, eigh_full: syevd/heevd, svd_compact: gesdd,
 *                    eig_full: geev; left_polar: gesdd, and the GEMM
 *                    W = U·Vh and the SYRK/HERK P = (S^½Vh)ᴴ(S^½Vh) that
 *                    turn the SVD into the polar factors).  The bare
 *                    calls get the matrix as it lies (leading dimension
 *                    m); the op pads it from 512 bytes a column
 *                    (kernels/factor_common.h), so a ratio below 1 at
 *                    1024 rows is that padding's gain
 *   reverse ratio  = reverse (random cotangents for every output) ÷ the
 *                    op's own forward
 * Targets: forward ≤ 1.15; reverse ≤ 1.0 for eigh, svd and qr.  Shapes:
 * 256² and 1024² (eig_full too: about 3 s a repetition at 1024² c128), and
 * 2048×256 for the ops that take a tall matrix; f64 and c128.  Medians of
 * a few repetitions; --quick runs 64² and 128×32 once. */
#include <cblas.h>
#include <complex.h>
#include <lapacke.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kernels/blas.h"
#include "kernels/op.h"

/* Uniform in [-1, 1) from splitmix64: a generic matrix.  (A hashed
 * pattern modulo 1000 once stood here; its matrices had rank 1000 at
 * 1024², so the QR figures measured the rank-deficient path.) */
static double uniform(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1p-52 - 1.0;
}

static void fill(pb_tensor_t *t, pb_dtype_t d, int m, int n, bool herm)
{
    uint64_t sh[2] = {(uint64_t)m, (uint64_t)n}, state = 42;
    if (pb_tensor_alloc(t, d, 2, sh, 'F', false))
        abort();
    bool cx = pb_dtype_is_complex(d);
    double *p = pb_tensor_data(t);
    size_t stride = cx ? 2 : 1;
    for (size_t i = 0; i < (size_t)m * n * stride; i++)
        p[i] = uniform(&state);
    if (herm) /* A = (A + Aᴴ)/2 */
        for (int j = 0; j < n; j++)
            for (int i = 0; i <= j; i++) {
                double *a = p + ((size_t)j * m + i) * stride, *b = p + ((size_t)i * m + j) * stride;
                double re = (a[0] + b[0]) / 2, im = cx ? (a[1] - b[1]) / 2 : 0;
                a[0] = b[0] = re;
                if (cx) {
                    a[1] = im;
                    b[1] = -im;
                }
                if (i == j && cx)
                    a[1] = 0;
            }
}

/* The bare driver on a copy of A (the copy is not timed). */
static double bare(const char *op, pb_dtype_t d, const pb_tensor_t *A)
{
    int m = (int)A->shape[0], n = (int)A->shape[1], k = m < n ? m : n;
    size_t isz = pb_dtype_size(d), bytes = (size_t)m * n * isz;
    void *a = malloc(bytes), *u = malloc((size_t)m * k * isz), *vt = malloc((size_t)k * n * isz);
    void *tau = malloc((size_t)k * isz + 1), *w = malloc((size_t)m * 2 * sizeof(double) + 16);
    double *s = malloc(sizeof(double) * (size_t)k + 8);
    memcpy(a, pb_tensor_data(A), bytes);
    bool z = d == PB_C128;
    double t0 = now();
    lapack_int info = 0;
    if (strcmp(op, "qr_compact") == 0) {
        info = z ? LAPACKE_zgeqrf(LAPACK_COL_MAJOR, m, n, a, m, tau) : LAPACKE_dgeqrf(LAPACK_COL_MAJOR, m, n, a, m, tau);
        info |= z ? LAPACKE_zungqr(LAPACK_COL_MAJOR, m, k, k, a, m, tau)
                  : LAPACKE_dorgqr(LAPACK_COL_MAJOR, m, k, k, a, m, tau);
    } else if (strcmp(op, "eigh_full") == 0)
        info = z ? LAPACKE_zheevd(LAPACK_COL_MAJOR, 'V', 'L', m, a, m, s)
                 : LAPACKE_dsyevd(LAPACK_COL_MAJOR, 'V', 'L', m, a, m, s);
    else if (strcmp(op, "svd_compact") == 0 || strcmp(op, "left_polar") == 0) {
        info = z ? LAPACKE_zgesdd(LAPACK_COL_MAJOR, 'S', m, n, a, m, s, u, m, vt, k)
                 : LAPACKE_dgesdd(LAPACK_COL_MAJOR, 'S', m, n, a, m, s, u, m, vt, k);
        if (strcmp(op, "left_polar") == 0) { /* W = U·Vh into a, P = VhᴴVh (scaled) into u */
            pb_scalar_t one = {1, 0}, zero = {0, 0};
            pb_gemm_cm(d, 'N', 'N', m, n, n, one, u, m, vt, n, zero, a, m);
            if (z)
                cblas_zherk(CblasColMajor, CblasLower, CblasConjTrans, n, n, 1.0, vt, n, 0.0, u, n);
            else
                cblas_dsyrk(CblasColMajor, CblasLower, CblasTrans, n, n, 1.0, vt, n, 0.0, u, n);
        }
    }
    else if (strcmp(op, "eig_full") == 0) {
        void *vr = malloc((size_t)m * m * isz);
        info = z ? LAPACKE_zgeev(LAPACK_COL_MAJOR, 'N', 'V', m, a, m, w, NULL, 1, vr, m)
                 : LAPACKE_dgeev(LAPACK_COL_MAJOR, 'N', 'V', m, a, m, w, (double *)w + m, NULL, 1, vr, m);
        free(vr);
    }
    double t = now() - t0;
    if (info)
        fprintf(stderr, "%s: LAPACK info %d\n", op, (int)info);
    free(a);
    free(u);
    free(vt);
    free(tau);
    free(w);
    free(s);
    return t;
}

static void random_like(pb_tensor_t *t, const pb_tensor_t *meta)
{
    if (pb_tensor_alloc(t, meta->dtype, meta->rank, meta->shape, 'F', false))
        abort();
    size_t n = pb_tensor_count(t) * (pb_dtype_is_complex(t->dtype) ? 2 : 1);
    double *p = pb_tensor_data(t);
    uint64_t state = 7;
    for (size_t i = 0; i < n; i++)
        p[i] = uniform(&state) / 2;
}

static void bench(const char *name, pb_dtype_t d, int m, int n, int reps)
{
    const pb_op_t *op = pb_op_find(name, strlen(name));
    pb_call_t c;
    memset(&c, 0, sizeof c);
    c.op = op;
    c.dtype = d;
    c.order = 'F';
    fill(&c.in[0], d, m, n, strncmp(name, "eigh", 4) == 0);
    pb_call_defaults(&c);
    pb_err_t err = {0};
    double tb[8], tf[8], tr[8];
    for (int r = 0; r < reps; r++) {
        tb[r] = bare(name, d, &c.in[0]);
        c.wrt = 1;
        c.taped = true;
        if (op->validate(&c, &err))
            abort();
        pb_tapedata_t tape;
        double t0 = now();
        if (pb_op_run_forward(&c, &tape, &err)) {
            fprintf(stderr, "%s: %s\n", name, err.message);
            exit(1);
        }
        tf[r] = now() - t0;
        pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
        for (int o = 0; o < op->noutputs; o++) {
            random_like(&cot[o], &tape.out_meta[o]);
            pb_tensor_clear(&c.out[o]);
        }
        pb_warnings_t w = {0};
        t0 = now();
        if (pb_op_run_reverse(&tape, cot, grad, 'F', &w, &err)) {
            fprintf(stderr, "%s reverse: %s\n", name, err.message);
            exit(1);
        }
        tr[r] = now() - t0;
        for (int o = 0; o < PB_MAX_IO; o++)
            pb_tensor_clear(&cot[o]);
        pb_tensor_clear(&grad[0]);
        pb_tapedata_clear(&tape);
    }
    double b = median(tb, reps), f = median(tf, reps), rv = median(tr, reps);
    printf("%-12s %-4s %5d x %-5d  driver %9.2f ms  forward %9.2f ms  ratio %.3f   reverse %9.2f ms  reverse/forward "
           "%.3f\n",
           name, pb_dtype_name(d), m, n, b * 1e3, f * 1e3, f / b, rv * 1e3, rv / f);
    fflush(stdout);
    pb_call_clear(&c);
}

int main(int argc, char **argv)
{
    bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    pb_alloc_init();
    pb_blas_init_threads(1);
    static const pb_dtype_t ds[2] = {PB_F64, PB_C128};
    static const char *const all[] = {"qr_compact", "eigh_full", "svd_compact", "left_polar", "eig_full"};
    const char *only = getenv("PB_BENCH_OP"), *shape = getenv("PB_BENCH_SHAPE"), *dtype = getenv("PB_BENCH_DTYPE");
    const char *const *ops = all;
    size_t nops = sizeof all / sizeof all[0];
    if (only) {
        ops = &only;
        nops = 1;
    }
    const int shapes[3][2] = {{256, 256}, {1024, 1024}, {2048, 256}};
    for (size_t o = 0; o < nops; o++)
        for (int di = 0; di < 2; di++)
            for (int s = 0; s < 3; s++) {
                int m = quick ? (s == 2 ? 128 : 64) : shapes[s][0], n = quick ? (s == 2 ? 32 : 64) : shapes[s][1];
                bool square = strncmp(ops[o], "eig", 3) == 0;
                if (square && m != n)
                    continue;
                char sh[32];
                snprintf(sh, sizeof sh, "%dx%d", m, n);
                if ((shape && strcmp(shape, sh) != 0) || (dtype && strcmp(dtype, pb_dtype_name(ds[di])) != 0))
                    continue;
                bench(ops[o], ds[di], m, n, quick ? 1 : m >= 1024 ? 3 : 5);
            }
    return 0;
}
