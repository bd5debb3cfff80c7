#include "strided.h"

#include "cmplx.h"
#include <stdlib.h>
#include <string.h>

#define T float
#define ACC double
#define SFX _s
#define CPLX 0
#include "strided_t.h"
#undef T
#undef ACC
#undef SFX
#undef CPLX
#define T double
#define ACC double
#define SFX _d
#define CPLX 0
#include "strided_t.h"
#undef T
#undef ACC
#undef SFX
#undef CPLX
#define T float complex
#define ACC double complex
#define SFX _c
#define SFXC f
#define CPLX 1
#include "strided_t.h"
#undef T
#undef ACC
#undef SFX
#undef SFXC
#undef CPLX
#define T double complex
#define ACC double complex
#define SFX _z
#define SFXC
#define CPLX 1
#include "strided_t.h"
#undef T
#undef ACC
#undef SFX
#undef SFXC
#undef CPLX

void pb_dense_strides(int rank, const uint64_t *shape, char order, int64_t *stride)
{
    int64_t s = 1;
    for (int k = 0; k < rank; k++) {
        int a = order == 'F' ? k : rank - 1 - k;
        stride[a] = s;
        s *= (int64_t)(shape[a] ? shape[a] : 1);
    }
}

static int64_t mag(int64_t x) { return x < 0 ? -x : x; }

/* Drop size-1 indices, sort by the first operand's stride (then the
 * second's), merge indices that are contiguous in all nops operands.
 * Returns false when the space is empty (a zero dimension).  *t is the
 * index fastest in operand 1, when it differs from index 0. */
static bool normalise(const pb_loop_t *in, pb_loop_t *L, int nops, int *t)
{
    L->rank = 0;
    for (int k = 0; k < in->rank; k++) {
        if (in->dim[k] == 0)
            return false;
        if (in->dim[k] == 1)
            continue;
        int r = L->rank++;
        L->dim[r] = in->dim[k];
        for (int o = 0; o < 3; o++)
            L->s[o][r] = o < nops ? in->s[o][k] : 0;
    }
    /* insertion sort: at most 16 indices */
    for (int i = 1; i < L->rank; i++)
        for (int j = i; j > 0; j--) {
            int64_t a0 = mag(L->s[0][j - 1]), b0 = mag(L->s[0][j]);
            int64_t a1 = mag(L->s[1][j - 1]), b1 = mag(L->s[1][j]);
            if (a0 < b0 || (a0 == b0 && a1 <= b1))
                break;
            uint64_t td = L->dim[j];
            L->dim[j] = L->dim[j - 1];
            L->dim[j - 1] = td;
            for (int o = 0; o < 3; o++) {
                int64_t ts = L->s[o][j];
                L->s[o][j] = L->s[o][j - 1];
                L->s[o][j - 1] = ts;
            }
        }
    int r = 0;
    for (int k = 1; k < L->rank; k++) {
        bool merge = true;
        for (int o = 0; o < nops; o++)
            merge = merge && L->s[o][k] == L->s[o][r] * (int64_t)L->dim[r];
        if (merge) {
            L->dim[r] *= L->dim[k];
            continue;
        }
        r++;
        L->dim[r] = L->dim[k];
        for (int o = 0; o < 3; o++)
            L->s[o][r] = L->s[o][k];
    }
    if (L->rank > 0)
        L->rank = r + 1;
    else {
        L->rank = 1; /* a scalar: one element */
        L->dim[0] = 1;
        for (int o = 0; o < 3; o++)
            L->s[o][0] = 0;
    }
    *t = 0;
    for (int k = 1; k < L->rank; k++)
        if (L->s[1][k] != 0 && (*t == 0 || mag(L->s[1][k]) < mag(L->s[1][*t])))
            *t = k;
    /* Tile only when that index is faster in the source than index 0. */
    if (*t && L->s[1][0] != 0 && mag(L->s[1][*t]) >= mag(L->s[1][0]))
        *t = 0;
    return true;
}

void pb_strided(pb_dtype_t d, const pb_loop_t *in, void *dst, const void *src, bool conj, pb_scalar_t alpha,
                const void *src2, pb_scalar_t beta, bool accumulate)
{
    pb_loop_t L;
    int t;
    static const double complex zero = 0; /* one zero element of any dtype */
    if (accumulate)
        src2 = NULL;
    pb_loop_t tmp;
    if (alpha.re == 0 && alpha.im == 0 && !accumulate) {
        /* As in BLAS, alpha = 0 means src is not read (NaNs in it do not
         * propagate): dst = beta·src2, or zeros. */
        tmp = *in;
        for (int k = 0; k < tmp.rank; k++)
            tmp.s[1][k] = src2 ? tmp.s[2][k] : 0;
        in = &tmp;
        src = src2 ? src2 : &zero;
        alpha = src2 ? beta : (pb_scalar_t){1, 0};
        src2 = NULL;
        conj = false;
    }
    if (!normalise(in, &L, src2 ? 3 : 2, &t))
        return;
    int one = alpha.re == 1 && alpha.im == 0, acc = accumulate;
    switch (d) {
    case PB_F32:
        run_s(&L, t, dst, src, src2, (float)alpha.re, (float)beta.re, 0, one, acc);
        break;
    case PB_F64:
        run_d(&L, t, dst, src, src2, alpha.re, beta.re, 0, one, acc);
        break;
    case PB_C64:
        run_c(&L, t, dst, src, src2, CMPLXF((float)alpha.re, (float)alpha.im), CMPLXF((float)beta.re, (float)beta.im),
              conj, one, acc);
        break;
    case PB_C128:
        run_z(&L, t, dst, src, src2, CMPLX(alpha.re, alpha.im), CMPLX(beta.re, beta.im), conj, one, acc);
        break;
    default:
        break;
    }
}

pb_scalar_t pb_strided_dot(pb_dtype_t d, const pb_loop_t *in, const void *a, bool conj, const void *b)
{
    pb_loop_t L;
    int t;
    pb_scalar_t r = {0, 0};
    if (!normalise(in, &L, 2, &t))
        return r;
    double complex z = 0;
    switch (d) {
    case PB_F32: r.re = dot_s(&L, a, b, 0); break;
    case PB_F64: r.re = dot_d(&L, a, b, 0); break;
    case PB_C64: z = dot_c(&L, a, b, conj); break;
    case PB_C128: z = dot_z(&L, a, b, conj); break;
    default: break;
    }
    if (pb_dtype_is_complex(d)) {
        r.re = creal(z);
        r.im = cimag(z);
    }
    return r;
}

void pb_tensor_zero(pb_tensor_t *t)
{
    size_t n = pb_tensor_bytes(t);
    if (n)
        memset(pb_tensor_data(t), 0, n);
}
