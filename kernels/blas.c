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

#define PB_T_BODY "blas_t.h"
#include "dtype_t.h"

typedef void gemm_fn(CBLAS_ORDER layout, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k,
                     pb_scalar_t alpha, const void *a, int lda, const void *b, int ldb, pb_scalar_t beta, void *c,
                     int ldc);
static gemm_fn *const gemms[PB_NDTYPES] = PB_T_FNS(gemm);

void pb_gemm(pb_dtype_t d, double alpha, pb_mview_t a, pb_mview_t b, double beta, pb_mview_t c)
{
    CBLAS_ORDER layout = c.order == 'C' ? CblasRowMajor : CblasColMajor;
    CBLAS_TRANSPOSE ta = a.order == c.order ? CblasNoTrans : CblasTrans;
    CBLAS_TRANSPOSE tb = b.order == c.order ? CblasNoTrans : CblasTrans;
    int m = (int)c.rows, n = (int)c.cols, k = (int)a.cols;
    if (m == 0 || n == 0 || (unsigned)d >= PB_NDTYPES)
        return;
    gemms[d](layout, ta, tb, m, n, k, (pb_scalar_t){alpha, 0}, a.p, ld(a), b.p, ld(b), (pb_scalar_t){beta, 0}, c.p,
             ld(c));
}

static CBLAS_TRANSPOSE tr(char t)
{
    return t == 'N' ? CblasNoTrans : t == 'T' ? CblasTrans : CblasConjTrans;
}

void pb_gemm_cm(pb_dtype_t d, char ta, char tb, int m, int n, int k, pb_scalar_t alpha, const void *a, int lda,
                const void *b, int ldb, pb_scalar_t beta, void *c, int ldc)
{
    if (m == 0 || n == 0 || (unsigned)d >= PB_NDTYPES)
        return;
    gemms[d](CblasColMajor, tr(ta), tr(tb), m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void pb_blas_init_threads(int n)
{
    openblas_set_num_threads(n);
}
