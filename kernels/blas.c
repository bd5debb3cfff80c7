#include "blas.h"

#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include "../cuda/exec.h"
#include "cmplx.h"

#include "op.h"
#include "par.h"

pb_mview_t pb_mview_of(const pb_tensor_t *t)
{
    if (t->rank == 1)
        return (pb_mview_t){pb_tensor_data(t), t->shape[0], 1, 'F'};
    return (pb_mview_t){pb_tensor_data(t), t->shape[0], t->shape[1], t->order};
}

static int ld(pb_mview_t v)
{
    size_t l = v.order == 'C' ? v.cols : v.rows;
    return l ? (int)l : 1;
}

#define PB_T_BODY "blas_t.h"
#include "dtype_t.h"

typedef void gemm_fn(CBLAS_ORDER layout, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k,
                     pb_scalar_t alpha, const void *a, int lda, const void *b, int ldb, pb_scalar_t beta, void *c,
                     int ldc);
static gemm_fn *const gemms[PB_NDTYPES] = PB_T_FNS(gemm);

int pb_blas_trans(char t)
{
    return t == 'N' ? CblasNoTrans : t == 'T' ? CblasTrans : CblasConjTrans;
}

static void gemm_serial(pb_dtype_t d, char ta, char tb, int m, int n, int k, pb_scalar_t alpha, const void *a,
                        int lda, const void *b, int ldb, pb_scalar_t beta, void *c, int ldc)
{
    gemms[d](CblasColMajor, pb_blas_trans(ta), pb_blas_trans(tb), m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* A GEMM of at least this many multiply-adds is split across threads
 * (about half a millisecond on one core: well above the cost of waking a
 * helper), in pieces of at least half of it. */
#define PAR_MADDS 4e6
/* Column pieces begin at multiples of this many columns of C.  OpenBLAS
 * 0.3.21 then gives each column bitwise what the whole call gives, for
 * every dtype and transpose, on each core type checked (OPENBLAS_CORETYPE
 * Haswell, Zen, SkylakeX, Cooperlake, Sandybridge, Nehalem, Prescott,
 * Core2, Atom, Barcelona; hundreds of random shapes, n up to 32000; 12
 * fails on Nehalem, 24 holds on all): a piece of PAR_MADDS / 2 is also
 * past SkylakeX's small-matrix kernels (M·N·K ≤ 10⁶).  So a column split
 * may follow the idle threads and the result is still that of one call,
 * whatever the load.  Row splits are not bitwise (f32 and complex on
 * Haswell, f64 on SkylakeX: the kernels' row tiles and blocks follow m),
 * so rows split into a number of pieces fixed by the shape and
 * pb_par_threads(), whoever runs them: the result depends on the daemon's
 * thread count, never on the load.  unit.par's gemm_split_matches (under
 * each core type the CPU runs) and lapack_svd_gemvs_split keep checking. */
#define GEMM_COL_ALIGN 24
/* A row piece has at least this many rows: run one after another (nobody
 * idle), pieces of 256 rows cost at most a few % over the whole call (each
 * packs op(b) again), pieces of 64 up to a quarter. */
#define GEMM_MIN_ROWS 256

typedef struct gemm_split {
    pb_dtype_t d;
    char ta, tb;
    int m, n, k, lda, ldb, ldc;
    pb_scalar_t alpha, beta;
    const char *a, *b;
    char *c;
    size_t es;
    long pieces; /* row pieces */
} gemm_split_t;

/* Blocks [lo, hi) of GEMM_COL_ALIGN columns of C, the last block taking
 * the columns past the last multiple too (so that no piece is smaller
 * than its grain): the same GEMM on the matching columns of op(b). */
static void gemm_cols(void *ctx, long lo, long hi)
{
    const gemm_split_t *g = ctx;
    long j0 = lo * GEMM_COL_ALIGN, j1 = hi == g->n / GEMM_COL_ALIGN ? g->n : hi * GEMM_COL_ALIGN;
    const char *b = g->b + (size_t)j0 * g->es * (g->tb == 'N' ? (size_t)g->ldb : 1);
    gemm_serial(g->d, g->ta, g->tb, g->m, (int)(j1 - j0), g->k, g->alpha, g->a, g->lda, b, g->ldb, g->beta,
                g->c + (size_t)j0 * g->es * (size_t)g->ldc, g->ldc);
}

/* Row pieces [lo, hi) of g->pieces, one GEMM each, on the matching rows
 * of op(a). */
static void gemm_rows(void *ctx, long lo, long hi)
{
    const gemm_split_t *g = ctx;
    for (long p = lo; p < hi; p++) {
        long i0 = p * g->m / g->pieces, i1 = (p + 1) * g->m / g->pieces;
        const char *a = g->a + (size_t)i0 * g->es * (g->ta == 'N' ? 1 : (size_t)g->lda);
        gemm_serial(g->d, g->ta, g->tb, (int)(i1 - i0), g->n, g->k, g->alpha, a, g->lda, g->b, g->ldb, g->beta,
                    g->c + (size_t)i0 * g->es, g->ldc);
    }
}

void pb_gemm_cm(pb_dtype_t d, char ta, char tb, int m, int n, int k, pb_scalar_t alpha, const void *a, int lda,
                const void *b, int ldb, pb_scalar_t beta, void *c, int ldc)
{
    if (m == 0 || n == 0 || (unsigned)d >= PB_NDTYPES)
        return;
    if (pb_exec_gpu() >= 0) {
        pb__exec_gemm(d, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    double madds = (double)m * n * (k ? k : 1);
    int threads = pb_par_threads();
    if (madds >= PAR_MADDS && threads >= 2) {
        gemm_split_t g = {d, ta, tb, m, n, k, lda, ldb, ldc, alpha, beta, a, b, c, pb_dtype_size(d), 0};
        long blocks = n / GEMM_COL_ALIGN;
        long col_grain = (long)(PAR_MADDS / 2 / (madds / n * GEMM_COL_ALIGN)) + 1;
        bool cols_ok = blocks >= 2 * col_grain && blocks >= 4;
        long row_min = (long)(PAR_MADDS / 2 / (madds / m)) + 1;
        if (row_min < GEMM_MIN_ROWS)
            row_min = GEMM_MIN_ROWS;
        long rows = m / row_min < threads ? m / row_min : threads;
        /* The longer side of C splits, a piece keeping the other whole; the
         * other side when the longer cannot. */
        if (cols_ok && (n >= m || rows < 2)) {
            pb_par_for(blocks, col_grain, gemm_cols, &g);
            return;
        }
        if (rows >= 2) {
            g.pieces = rows;
            pb_par_for(rows, 1, gemm_rows, &g);
            return;
        }
    }
    gemm_serial(d, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

typedef void gemv_fn(CBLAS_TRANSPOSE t, int m, int n, pb_scalar_t alpha, const void *a, int lda, const void *x,
                     int incx, pb_scalar_t beta, void *y, int incy);
static gemv_fn *const gemvs[PB_NDTYPES] = PB_T_FNS(gemv);

/* A GEMV of at least this many elements of a is split: it reads a once, so
 * it is bound by memory (about 40 µs for 2^16 f64 here), and a helper that
 * has just helped spins for the next piece (daemon/pool.c), so each piece
 * costs a few µs more, not a wake-up. */
#define PAR_GEMV_ELEMS (1L << 16)
/* Pieces begin at multiples of this many elements of y.  OpenBLAS 0.3.21's
 * double and complex kernels then give each element bitwise what the whole
 * call gives, on each core type checked (OPENBLAS_CORETYPE Haswell,
 * SkylakeX, Cooperlake, Zen, Sandybridge, Nehalem, Prescott; thousands of
 * random shapes, strides and scalars, and the edge shapes of unit.par's
 * gemv_edges, which with gemv_split_matches keeps checking).  sgemv does
 * not: its SkylakeX kernels group rows by the whole call's n for 'N' and
 * columns by m for 'T', so f32 GEMVs never split. */
#define GEMV_ALIGN 16

typedef struct gemv_split {
    gemv_fn *fn;
    CBLAS_TRANSPOSE t;
    int m, n, lda, incx, incy, len;
    pb_scalar_t alpha, beta;
    const char *a, *x;
    char *y;
    size_t es;
} gemv_split_t;

/* Blocks [lo, hi) of GEMV_ALIGN elements of y: rows of a for 'N', its
 * columns otherwise. */
static void gemv_piece(void *ctx, long lo, long hi)
{
    const gemv_split_t *g = ctx;
    long i0 = lo * GEMV_ALIGN, i1 = hi * GEMV_ALIGN < g->len ? hi * GEMV_ALIGN : g->len;
    char *y = g->y + (size_t)i0 * g->es * (size_t)g->incy;
    int rows = (int)(i1 - i0);
    if (g->t == CblasNoTrans)
        g->fn(g->t, rows, g->n, g->alpha, g->a + (size_t)i0 * g->es, g->lda, g->x, g->incx, g->beta, y, g->incy);
    else
        g->fn(g->t, g->m, rows, g->alpha, g->a + (size_t)i0 * g->es * (size_t)g->lda, g->lda, g->x, g->incx,
              g->beta, y, g->incy);
}

void pb_gemv_cm(pb_dtype_t d, char t, int m, int n, pb_scalar_t alpha, const void *a, int lda, const void *x,
                int incx, pb_scalar_t beta, void *y, int incy)
{
    if ((unsigned)d >= PB_NDTYPES)
        return;
    CBLAS_TRANSPOSE ct = (CBLAS_TRANSPOSE)pb_blas_trans(t);
    int len = ct == CblasNoTrans ? m : n;
    /* Invalid sizes go to OpenBLAS whole, for its own error. */
    if (d == PB_F32 || m <= 0 || n <= 0 || lda < m || incx == 0 || incy <= 0 || (long)m * n < PAR_GEMV_ELEMS) {
        gemvs[d](ct, m, n, alpha, a, lda, x, incx, beta, y, incy);
        return;
    }
    gemv_split_t g = {gemvs[d], ct, m, n, lda, incx, incy, len, alpha, beta, a, x, y, pb_dtype_size(d)};
    long blocks = (len + GEMV_ALIGN - 1) / GEMV_ALIGN;
    long grain = PAR_GEMV_ELEMS / 2 / ((long)(ct == CblasNoTrans ? n : m) * GEMV_ALIGN) + 1;
    pb_par_for(blocks, grain, gemv_piece, &g);
}

pb_gemm_plan_t pb_gemm_plan(pb_mview_t a, pb_mview_t b, pb_mview_t c)
{
    int k = (int)a.cols;
    if (c.order == 'F')
        return (pb_gemm_plan_t){a.order == 'F' ? 'N' : 'T', b.order == 'F' ? 'N' : 'T', (int)c.rows, (int)c.cols, k,
                                ld(a), ld(b), ld(c), a.p, b.p, c.p};
    return (pb_gemm_plan_t){b.order == 'C' ? 'N' : 'T', a.order == 'C' ? 'N' : 'T', (int)c.cols, (int)c.rows, k,
                            ld(b), ld(a), ld(c), b.p, a.p, c.p};
}

void pb_gemm(pb_dtype_t d, double alpha, pb_mview_t a, pb_mview_t b, double beta, pb_mview_t c)
{
    pb_scalar_t al = {alpha, 0}, be = {beta, 0};
    pb_gemm_plan_t g = pb_gemm_plan(a, b, c);
    pb_gemm_cm(d, g.ta, g.tb, g.m, g.n, g.k, al, g.a, g.lda, g.b, g.ldb, be, g.c, g.ldc);
}

void pb__blas_lapack_linked(void);

void pb_blas_init_threads(int n)
{
    pb__blas_lapack_linked(); /* LAPACK's GEMMs on the idle cores */
    openblas_set_num_threads(n);
}

void pb_blas_describe(char *buf, size_t size)
{
    const char *forced = getenv("OPENBLAS_CORETYPE");
    snprintf(buf, size, "%s, kernels for %s%s%s%s", openblas_get_config(), openblas_get_corename(),
             forced ? " (OPENBLAS_CORETYPE=" : "", forced ? forced : "", forced ? ")" : "");
}
