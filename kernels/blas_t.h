/* The GEMM and GEMV of one dtype: a body for dtype_t.h, instantiated by blas.c.
 * alpha and beta come as pb_scalar_t (their imaginary parts dropped for a
 * real dtype) and reach CBLAS by value or, complex, by address (SCAL). */

static void FN(gemm)(CBLAS_ORDER layout, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k,
                     pb_scalar_t alpha, const void *a, int lda, const void *b, int ldb, pb_scalar_t beta, void *c,
                     int ldc)
{
    T al = TSCALAR(alpha), be = TSCALAR(beta);
    if (al == 0) {
        /* BLAS reads neither a nor b then (NaN and Inf there reach
         * nothing) and C only for beta ≠ 0; OpenBLAS 0.3.21's small-matrix
         * kernels (SkylakeX, Cooperlake: M·N·K ≤ 10⁶) multiply by alpha. */
        int rows = layout == CblasColMajor ? m : n, cols = layout == CblasColMajor ? n : m;
        if (be == 1)
            return;
        for (int j = 0; j < cols; j++) {
            T *col = (T *)c + (size_t)j * (size_t)ldc;
            for (int i = 0; i < rows; i++)
                col[i] = be == 0 ? 0 : be * col[i];
        }
        return;
    }
    CBLAS(gemm)(layout, ta, tb, m, n, k, SCAL(al), a, lda, b, ldb, SCAL(be), c, ldc);
}

static void FN(gemv)(CBLAS_TRANSPOSE t, int m, int n, pb_scalar_t alpha, const void *a, int lda, const void *x, int incx,
                     pb_scalar_t beta, void *y, int incy)
{
    T al = TSCALAR(alpha), be = TSCALAR(beta);
    CBLAS(gemv)(CblasColMajor, t, m, n, SCAL(al), a, lda, x, incx, SCAL(be), y, incy);
}
