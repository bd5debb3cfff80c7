/* Matrix views over tensors and the BLAS calls on them.
 *
 * A view is a pointer, a shape and a memory order; its transpose is free
 * (swap the sizes and flip the order), so one GEMM wrapper takes C- and
 * F-ordered operands as they are and lets BLAS transpose on the fly.  The
 * s/d/c/z calls come from one body (blas_t.h), chosen by dtype here,
 * once. */
#ifndef PB_BLAS_H
#define PB_BLAS_H

#include <stddef.h>

#include "tensor.h"

typedef struct pb_mview {
    void *p;
    size_t rows, cols;
    char order; /* 'C' or 'F' */
} pb_mview_t;

static inline pb_mview_t pb_mview_t_(pb_mview_t v)
{
    return (pb_mview_t){v.p, v.cols, v.rows, v.order == 'C' ? 'F' : 'C'};
}
#define pb_mview_transpose pb_mview_t_

/* The view of a rank-2 tensor, or of a rank-1 tensor as one column. */
pb_mview_t pb_mview_of(const pb_tensor_t *t);

/* c = a·b as one column-major GEMM: an F-ordered c as it is, a C-ordered
 * one as cᵀ = bᵀ·aᵀ over the same memory. */
typedef struct pb_gemm_plan {
    char ta, tb;
    int m, n, k, lda, ldb, ldc;
    const void *a, *b;
    void *c;
} pb_gemm_plan_t;
pb_gemm_plan_t pb_gemm_plan(pb_mview_t a, pb_mview_t b, pb_mview_t c);

/* c = alpha·a·b + beta·c for views of dtype d (alpha, beta real). */
void pb_gemm(pb_dtype_t d, double alpha, pb_mview_t a, pb_mview_t b, double beta, pb_mview_t c);

/* Column-major GEMM on raw operands: c = alpha·op(a)·op(b) + beta·c, op
 * 'N', 'T' or 'C' (conjugate transpose), complex alpha and beta.  A large
 * one splits across idle threads (kernels/par.h) so that its result never
 * depends on how many were idle: by columns bitwise as one call, by rows
 * in pieces fixed by the shape and pb_par_threads() (blas.c). */
struct pb_scalar;
void pb_gemm_cm(pb_dtype_t d, char ta, char tb, int m, int n, int k, struct pb_scalar alpha, const void *a, int lda,
                const void *b, int ldb, struct pb_scalar beta, void *c, int ldc);

/* Column-major GEMV: y = alpha·op(a)·x + beta·y, op 'N', 'T' or 'C'.  A
 * large one splits along y across idle threads (LAPACK's, through
 * kernels/blas_lapack.c), at boundaries where OpenBLAS's kernels give
 * bitwise what the whole call gives. */
void pb_gemv_cm(pb_dtype_t d, char t, int m, int n, struct pb_scalar alpha, const void *a, int lda, const void *x,
                int incx, struct pb_scalar beta, void *y, int incy);

/* CBLAS's transpose (a CBLAS_TRANSPOSE value) for 'N', 'T' or 'C'; an int
 * so that this header need not pull in cblas.h and its complex.h. */
int pb_blas_trans(char t);

/* Keep BLAS single-threaded: the worker pool supplies the parallelism. */
void pb_blas_init_threads(int n);
/* What BLAS runs the arithmetic, for the startup log: OpenBLAS's build and
 * the kernels it picked for this CPU, and OPENBLAS_CORETYPE when that chose
 * them (GEMM speed depends on it: 1.75x for f32 between two kernels here). */
void pb_blas_describe(char *buf, size_t size);

#endif
