#include "blas.h"

#include <cblas.h>
#include "cmplx.h"

#include "op.h"

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

void pb_gemm(pb_dtype_t d, double alpha, pb_mview_t a, pb_mview_t b, double beta, pb_mview_t c)
{
    CBLAS_ORDER layout = c.order == 'C' ? CblasRowMajor : CblasColMajor;
    CBLAS_TRANSPOSE ta = a.order == c.order ? CblasNoTrans : CblasTrans;
    CBLAS_TRANSPOSE tb = b.order == c.order ? CblasNoTrans : CblasTrans;
    int m = (int)c.rows, n = (int)c.cols, k = (int)a.cols;
    if (m == 0 || n == 0)
        return;
    switch (d) {
    case PB_F32:
        cblas_sgemm(layout, ta, tb, m, n, k, (float)alpha, a.p, ld(a), b.p, ld(b), (float)beta, c.p, ld(c));
        break;
    case PB_F64:
        cblas_dgemm(layout, ta, tb, m, n, k, alpha, a.p, ld(a), b.p, ld(b), beta, c.p, ld(c));
        break;
    case PB_C64: {
        float _Complex al = (float)alpha, be = (float)beta;
        cblas_cgemm(layout, ta, tb, m, n, k, &al, a.p, ld(a), b.p, ld(b), &be, c.p, ld(c));
        break;
    }
    case PB_C128: {
        double _Complex al = alpha, be = beta;
        cblas_zgemm(layout, ta, tb, m, n, k, &al, a.p, ld(a), b.p, ld(b), &be, c.p, ld(c));
        break;
    }
    default:
        break;
    }
}

static CBLAS_TRANSPOSE tr(char t)
{
    return t == 'N' ? CblasNoTrans : t == 'T' ? CblasTrans : CblasConjTrans;
}

void pb_gemm_cm(pb_dtype_t d, char ta, char tb, int m, int n, int k, pb_scalar_t alpha, const void *a, int lda,
                const void *b, int ldb, pb_scalar_t beta, void *c, int ldc)
{
    if (m == 0 || n == 0)
        return;
    CBLAS_TRANSPOSE A = tr(ta), B = tr(tb);
    switch (d) {
    case PB_F32:
        cblas_sgemm(CblasColMajor, A, B, m, n, k, (float)alpha.re, a, lda, b, ldb, (float)beta.re, c, ldc);
        break;
    case PB_F64:
        cblas_dgemm(CblasColMajor, A, B, m, n, k, alpha.re, a, lda, b, ldb, beta.re, c, ldc);
        break;
    case PB_C64: {
        float _Complex al = CMPLXF((float)alpha.re, (float)alpha.im), be = CMPLXF((float)beta.re, (float)beta.im);
        cblas_cgemm(CblasColMajor, A, B, m, n, k, &al, a, lda, b, ldb, &be, c, ldc);
        break;
    }
    case PB_C128: {
        double _Complex al = CMPLX(alpha.re, alpha.im), be = CMPLX(beta.re, beta.im);
        cblas_zgemm(CblasColMajor, A, B, m, n, k, &al, a, lda, b, ldb, &be, c, ldc);
        break;
    }
    default:
        break;
    }
}

void pb_blas_init_threads(int n)
{
    openblas_set_num_threads(n);
}
