/* The GEMM and GEMV of one dtype: a body for dtype_t.h, instantiated by blas.c.
 * alpha and beta come as pb_scalar_t (their imaginary parts dropped for a
 * real dtype) and reach CBLAS by value or, complex, by address (SCAL). */

static void FN(gemm)(CBLAS_ORDER layout, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k,
                     pb_scalar_t alpha, const void *a, int lda, const void *b, int ldb, pb_scalar_t beta, void *c,
                     int ldc)
{
    T al = TSCALAR(alpha), be = TSCALAR(beta);
    CBLAS(gemm)(layout, ta, tb, m, n, k, SCAL(al), a, lda, b, ldb, SCAL(be), c, ldc);
}

static void FN(gemv)(CBLAS_TRANSPOSE t, int m, int n, pb_scalar_t alpha, const void *a, int lda, const void *x, int incx,
                     pb_scalar_t beta, void *y, int incy)
{
    T al = TSCALAR(alpha), be = TSCALAR(beta);
    CBLAS(gemv)(CblasColMajor, t, m, n, SCAL(al), a, lda, x, incx, SCAL(be), y, incy);
}
