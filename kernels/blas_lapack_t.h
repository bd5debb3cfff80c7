/* The Fortran GEMM and GEMV LAPACK calls, for one dtype: a body for
 * dtype_t.h, instantiated by blas_lapack.c (which says why they exist):
 * pb_gemm_cm and pb_gemv_cm.
 * Arguments as the reference BLAS takes them (by address; gfortran's
 * hidden lengths of the character arguments follow and are not needed). */

void PB_CAT(LP, gemm_)(const char *ta, const char *tb, const int *m, const int *n, const int *k, const T *alpha,
                       const T *a, const int *lda, const T *b, const int *ldb, const T *beta, T *c, const int *ldc);
void PB_CAT(LP, gemm_)(const char *ta, const char *tb, const int *m, const int *n, const int *k, const T *alpha,
                       const T *a, const int *lda, const T *b, const int *ldb, const T *beta, T *c, const int *ldc)
{
    pb_scalar_t al = {RE(*alpha), IM(*alpha)}, be = {RE(*beta), IM(*beta)};
    pb_gemm_cm(DT, fortran_op(*ta), fortran_op(*tb), *m, *n, *k, al, a, *lda, b, *ldb, be, c, *ldc);
}

void PB_CAT(LP, gemv_)(const char *t, const int *m, const int *n, const T *alpha, const T *a, const int *lda,
                       const T *x, const int *incx, const T *beta, T *y, const int *incy);
void PB_CAT(LP, gemv_)(const char *t, const int *m, const int *n, const T *alpha, const T *a, const int *lda,
                       const T *x, const int *incx, const T *beta, T *y, const int *incy)
{
    pb_scalar_t al = {RE(*alpha), IM(*alpha)}, be = {RE(*beta), IM(*beta)};
    pb_gemv_cm(DT, fortran_op(*t), *m, *n, al, a, *lda, x, *incx, be, y, *incy);
}
