/* The MatrixAlgebraKit factorizations with exact pullbacks, on the CPU:
 * qr_{compact,full,null}, lq_{compact,full,null}, eigh_{full,vals,trunc},
 * eig_{full,vals}, svd_{compact,full,vals,trunc}, {left,right}_polar.
 *
 * One op-table entry per op, all sharing one forward and one reverse per
 * dtype (factor_t.h, instantiated for c, z, s, d in that order so that the
 * real eig can finish in complex arithmetic).  The forward copies A into a
 * column-major work array (LAPACK overwrites it), refuses NaN and Inf, and
 * returns outputs in the order asked for; the tape keeps column-major
 * copies of what the pullback reads:
 *   qr, lq        Q and R (L and Q)       qr_null, lq_null   A and N
 *   eigh, eig     D and V (vals: V)       svd                U, S, Vh (vals: U, Vh)
 *   polar         W, and P's eigenvectors V and values S (P = V·S·Vᴴ)
 * The truncated forms keep the full decomposition; their reverse chooses
 * the kept vectors again from it and the options, and pads the
 * cotangents, so their pullback is exact for the kept factors.
 *
 * Tolerances with a default of their own (rank_atol, degeneracy_atol,
 * herm_atol, gauge_atol) are resolved per call from max|A_ij| (kept in
 * the tape's scalars[0]) and the cotangents' norm: see fz_resolve. */
#include <cblas.h>
#include "cmplx.h"
#include <float.h>
#include <lapacke.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "op.h"
#include "strided.h"

enum fz_kind {
    FZ_QR_COMPACT, FZ_QR_FULL, FZ_QR_NULL, FZ_LQ_COMPACT, FZ_LQ_FULL, FZ_LQ_NULL,
    FZ_EIGH_FULL, FZ_EIGH_VALS, FZ_EIGH_TRUNC, FZ_EIG_FULL, FZ_EIG_VALS,
    FZ_SVD_COMPACT, FZ_SVD_FULL, FZ_SVD_VALS, FZ_SVD_TRUNC, FZ_LEFT_POLAR, FZ_RIGHT_POLAR,
    FZ_NKINDS
};

extern const pb_op_t pb_factor_ops[FZ_NKINDS];
static int fz_kind(const pb_op_t *op) { return (int)(op - pb_factor_ops); }

/* Options resolved for one call. */
typedef struct fz_opts {
    double rank_atol, deg_atol, gauge_atol, herm_atol, atol, rtol;
    long long maxrank;
    bool strict;
} fz_opts_t;

static int fz_opt(const pb_op_t *op, const char *name)
{
    return pb_op_option_index(op, name, strlen(name));
}

static bool single(pb_dtype_t d) { return d == PB_F32 || d == PB_C64; }

/* The spacing of floating-point numbers at x in d's precision (Julia's
 * eps(x)). */
static double ulp(double x, pb_dtype_t d)
{
    if (single(d)) {
        float f = (float)x;
        return (double)(nextafterf(f, INFINITY) - f);
    }
    return nextafter(x, INFINITY) - x;
}

/* Given options, else the contract's defaults: rank_atol = degeneracy_atol
 * = eps(max|A_ij|)^(3/4), herm_atol = √eps·max|A_ij|, maxrank = k.  The
 * default gauge_atol needs the cotangents and is set by the reverse. */
static void fz_resolve(const pb_op_t *op, const pb_optval_t *opt, double amax, pb_dtype_t d, int k, fz_opts_t *o)
{
    double eps = single(d) ? FLT_EPSILON : DBL_EPSILON, tol = pow(ulp(amax, d), 0.75);
    *o = (fz_opts_t){.rank_atol = tol, .deg_atol = tol, .gauge_atol = INFINITY, .herm_atol = sqrt(eps) * amax,
                     .maxrank = k};
    int i;
#define GIVEN(name) ((i = fz_opt(op, name)) >= 0 && opt[i].given)
    if (GIVEN("rank_atol"))
        o->rank_atol = opt[i].re;
    if (GIVEN("degeneracy_atol"))
        o->deg_atol = opt[i].re;
    if (GIVEN("gauge_atol"))
        o->gauge_atol = opt[i].re;
    if (GIVEN("herm_atol"))
        o->herm_atol = opt[i].re;
    if (GIVEN("atol"))
        o->atol = opt[i].re;
    if (GIVEN("rtol"))
        o->rtol = opt[i].re;
    if (GIVEN("maxrank"))
        o->maxrank = opt[i].i;
    if (GIVEN("strict_gauge"))
        o->strict = opt[i].b;
#undef GIVEN
}

#define E(M, ld, i, j) (M)[(size_t)(j) * (size_t)(ld) + (size_t)(i)]
#define QR_BLOCK 96 /* below this order the QR pullback's triangular products stop halving */
#define LD(x) ((x) > 1 ? (x) : 1)

static CBLAS_TRANSPOSE fz_tr(char t)
{
    return t == 'N' ? CblasNoTrans : t == 'T' ? CblasTrans : CblasConjTrans;
}

#define T float complex
#define RT float
#define CT float complex
#define SFX _c
#define CSFX _c
#define LP c
#define LP_CHAR 'c'
#define DT PB_C64
#define RDT PB_F32
#define CDT PB_C64
#define CPLX 1
#include "factor_t.h"
#define T double complex
#define RT double
#define CT double complex
#define SFX _z
#define CSFX _z
#define LP z
#define LP_CHAR 'z'
#define DT PB_C128
#define RDT PB_F64
#define CDT PB_C128
#define CPLX 1
#include "factor_t.h"
#define T float
#define RT float
#define CT float complex
#define SFX _s
#define CSFX _c
#define LP s
#define LP_CHAR 's'
#define DT PB_F32
#define RDT PB_F32
#define CDT PB_C64
#define CPLX 0
#include "factor_t.h"
#define T double
#define RT double
#define CT double complex
#define SFX _d
#define CSFX _z
#define LP d
#define LP_CHAR 'd'
#define DT PB_F64
#define RDT PB_F64
#define CDT PB_C128
#define CPLX 0
#include "factor_t.h"

#define FZ_DISPATCH(d, fn, ...)                                                                                       \
    ((d) == PB_F32 ? fn##_s(__VA_ARGS__) : (d) == PB_F64 ? fn##_d(__VA_ARGS__) : (d) == PB_C64 ? fn##_c(__VA_ARGS__) \
                                                                                                : fn##_z(__VA_ARGS__))

/* ---- validation ----------------------------------------------------------- */

static void set_meta(pb_call_t *c, int i, pb_dtype_t d, uint64_t r, int64_t cols)
{
    pb_tensor_t *t = &c->out_meta[i];
    memset(t, 0, sizeof *t);
    t->dtype = d;
    t->order = c->order;
    t->rank = cols < 0 ? 1 : 2;
    t->shape[0] = r;
    t->shape[1] = cols < 0 ? 0 : (uint64_t)cols;
}

static size_t bytes_of(pb_dtype_t d, uint64_t r, uint64_t cols) { return (size_t)(r * cols) * pb_dtype_size(d); }

static int fz_validate(pb_call_t *c, pb_err_t *err)
{
    const int kind = fz_kind(c->op);
    const pb_tensor_t *A = &c->in[0];
    char s1[96];
    if (A->rank != 2)
        return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.A", "A must be a matrix (m, n), got shape %s",
                          pb_shape_str(A, s1, sizeof s1));
    if (A->shape[0] > 46340 || A->shape[1] > 46340) /* m·n, m² stay below LAPACK's 2^31 */
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "inputs.A",
                          "A %s is larger than the 46340 rows or columns these factorizations take",
                          pb_shape_str(A, s1, sizeof s1));
    const uint64_t m = A->shape[0], n = A->shape[1], k = m < n ? m : n;
    const pb_dtype_t d = c->dtype, rd = pb_dtype_real(d), cd = pb_dtype_complex(d);
    bool square = kind >= FZ_EIGH_FULL && kind <= FZ_EIG_VALS;
    if (square && m != n)
        return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.A", "%s needs a square A, got shape %s", c->op->name,
                          pb_shape_str(A, s1, sizeof s1));
    if (kind == FZ_LEFT_POLAR && m < n)
        return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.A",
                          "left_polar needs m >= n (A = W·P with W m×n), got shape %s; use right_polar",
                          pb_shape_str(A, s1, sizeof s1));
    if (kind == FZ_RIGHT_POLAR && m > n)
        return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.A",
                          "right_polar needs m <= n (A = P·Wh with Wh m×n), got shape %s; use left_polar",
                          pb_shape_str(A, s1, sizeof s1));
    int i;
    if ((i = fz_opt(c->op, "maxrank")) >= 0 && c->opt[i].given && c->opt[i].i < 0)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.maxrank", "maxrank must be >= 0, got %lld",
                          c->opt[i].i);
    static const char *const tols[] = {"rank_atol", "degeneracy_atol", "gauge_atol", "herm_atol", "atol", "rtol"};
    for (size_t t = 0; t < sizeof tols / sizeof tols[0]; t++)
        if ((i = fz_opt(c->op, tols[t])) >= 0 && c->opt[i].given && !(c->opt[i].re >= 0))
            return pb_err_set(err, PB_EINVALID_ARGUMENT, c->op->options[i].name,
                              "%s must be a number >= 0, got %g", tols[t], c->opt[i].re);
    size_t tape = 0;
    switch (kind) {
    case FZ_QR_COMPACT:
    case FZ_QR_FULL: {
        uint64_t nq = kind == FZ_QR_FULL ? m : k;
        set_meta(c, 0, d, m, (int64_t)nq);
        set_meta(c, 1, d, nq, (int64_t)n);
        tape = bytes_of(d, m, nq) + bytes_of(d, nq, n);
        break;
    }
    case FZ_LQ_COMPACT:
    case FZ_LQ_FULL: {
        uint64_t nl = kind == FZ_LQ_FULL ? n : k;
        set_meta(c, 0, d, m, (int64_t)nl);
        set_meta(c, 1, d, nl, (int64_t)n);
        tape = bytes_of(d, m, nl) + bytes_of(d, nl, n);
        break;
    }
    case FZ_QR_NULL:
        set_meta(c, 0, d, m, (int64_t)(m - k));
        tape = bytes_of(d, m, n) + bytes_of(d, m, m - k);
        break;
    case FZ_LQ_NULL:
        set_meta(c, 0, d, n - k, (int64_t)n);
        tape = bytes_of(d, m, n) + bytes_of(d, n - k, n);
        break;
    case FZ_EIGH_FULL:
    case FZ_EIGH_TRUNC: /* truncated: at most m kept; the forward sets the shapes */
        set_meta(c, 0, rd, m, -1);
        set_meta(c, 1, d, m, (int64_t)m);
        tape = bytes_of(rd, m, 1) + bytes_of(d, m, m);
        break;
    case FZ_EIGH_VALS:
        set_meta(c, 0, rd, m, -1);
        tape = bytes_of(d, m, m);
        break;
    case FZ_EIG_FULL:
        set_meta(c, 0, cd, m, -1);
        set_meta(c, 1, cd, m, (int64_t)m);
        tape = bytes_of(cd, m, 1) + bytes_of(cd, m, m);
        break;
    case FZ_EIG_VALS:
        set_meta(c, 0, cd, m, -1);
        tape = bytes_of(cd, m, m);
        break;
    case FZ_SVD_COMPACT:
    case FZ_SVD_TRUNC:
        set_meta(c, 0, d, m, (int64_t)k);
        set_meta(c, 1, rd, k, -1);
        set_meta(c, 2, d, k, (int64_t)n);
        tape = bytes_of(d, m, k) + bytes_of(rd, k, 1) + bytes_of(d, k, n);
        break;
    case FZ_SVD_FULL:
        set_meta(c, 0, d, m, (int64_t)m);
        set_meta(c, 1, rd, k, -1);
        set_meta(c, 2, d, n, (int64_t)n);
        tape = bytes_of(d, m, m) + bytes_of(rd, k, 1) + bytes_of(d, n, n);
        break;
    case FZ_SVD_VALS:
        set_meta(c, 0, rd, k, -1);
        tape = bytes_of(d, m, k) + bytes_of(d, k, n);
        break;
    case FZ_LEFT_POLAR:
        set_meta(c, 0, d, m, (int64_t)n);
        set_meta(c, 1, d, n, (int64_t)n);
        tape = bytes_of(d, m, n) + bytes_of(d, n, n) + bytes_of(rd, n, 1);
        break;
    case FZ_RIGHT_POLAR:
        set_meta(c, 0, d, m, (int64_t)m);
        set_meta(c, 1, d, m, (int64_t)n);
        tape = bytes_of(d, m, n) + bytes_of(d, m, m) + bytes_of(rd, m, 1);
        break;
    default:
        return pb_err_set(err, PB_EINTERNAL, NULL, "unknown factorization");
    }
    c->tape_bytes = c->taped && (c->wrt & 1u) ? tape : 0;
    /* LAPACK's drivers: a few m·n·k, more for the eigensolvers */
    double flops = (square ? 25.0 : 8.0) * (double)m * (double)n * (double)(k ? k : 1);
    c->cost = flops * (pb_dtype_is_complex(d) ? 4.0 : 1.0);
    return 0;
}

/* ---- entry points ---------------------------------------------------------- */

static int fz_forward(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    return FZ_DISPATCH(c->dtype, forward, c, tape, err);
}

static int fz_reverse(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                      pb_warnings_t *warn, pb_err_t *err)
{
    return FZ_DISPATCH(t->dtype, reverse, t, cot, grad, order, warn, err);
}

static int fz_fd_cotangents(const pb_call_t *c, pb_tensor_t *cot)
{
    return FZ_DISPATCH(c->dtype, fd_cotangents, c, cot);
}

static void fz_fd_direction(const pb_call_t *c, int k, pb_tensor_t *dir)
{
    (void)k;
    int kind = fz_kind(c->op);
    if (kind == FZ_EIGH_FULL || kind == FZ_EIGH_VALS || kind == FZ_EIGH_TRUNC)
        FZ_DISPATCH(dir->dtype, fd_hermitian, dir);
}

/* ---- the table -------------------------------------------------------------- */

#define AUTO(nm) {.name = nm, .type = PB_OPT_FLOAT, .def_auto = true}
#define STRICT {.name = "strict_gauge", .type = PB_OPT_BOOL}
#define TRUNC                                                                                    \
    {.name = "maxrank", .type = PB_OPT_INT, .def_auto = true}, {.name = "atol", .type = PB_OPT_FLOAT}, \
        {.name = "rtol", .type = PB_OPT_FLOAT}

static const pb_opt_spec_t o_qr[] = {AUTO("rank_atol"), AUTO("gauge_atol"), STRICT};
static const pb_opt_spec_t o_eigh[] = {AUTO("herm_atol"), AUTO("degeneracy_atol"), AUTO("gauge_atol"), STRICT};
static const pb_opt_spec_t o_eigh_vals[] = {AUTO("herm_atol")};
static const pb_opt_spec_t o_eigh_trunc[] = {AUTO("herm_atol"), AUTO("degeneracy_atol"), AUTO("gauge_atol"), STRICT,
                                             TRUNC};
static const pb_opt_spec_t o_eig[] = {AUTO("degeneracy_atol"), AUTO("gauge_atol"), STRICT};
static const pb_opt_spec_t o_svd[] = {AUTO("rank_atol"), AUTO("degeneracy_atol"), AUTO("gauge_atol"), STRICT};
static const pb_opt_spec_t o_svd_trunc[] = {AUTO("rank_atol"), AUTO("degeneracy_atol"), AUTO("gauge_atol"), STRICT,
                                            TRUNC};

static const pb_io_spec_t in_A[] = {{"A", true}};
static const char *const wrt_A[] = {"A"};
static const char *const out_QR[] = {"Q", "R"}, *const out_LQ[] = {"L", "Q"}, *const out_N[] = {"N"};
static const char *const out_DV[] = {"D", "V"}, *const out_D[] = {"D"};
static const char *const out_USV[] = {"U", "S", "Vh"}, *const out_S[] = {"S"};
static const char *const out_WP[] = {"W", "P"}, *const out_PWh[] = {"P", "Wh"};

#define NELEM(a) ((int)(sizeof(a) / sizeof((a)[0])))
#define FZ_OP(nm, outs, opts, step) FZ_OPN(nm, outs, opts, NELEM(opts), step)
#define FZ_OP0(nm, outs, step) FZ_OPN(nm, outs, NULL, 0, step)
#define FZ_OPN(nm, outs, opts, nopts, step)                                                                  \
    {                                                                                                        \
        .name = nm, .inputs = in_A, .ninputs = 1, .outputs = outs, .noutputs = NELEM(outs), .options = opts, \
        .noptions = nopts, .wrt_names = wrt_A, .nwrt = 1, .dtypes = PB_DTYPES_ALL,                          \
        .devices = 1u << PB_DEV_CPU, .validate = fz_validate, .forward = {[PB_DEV_CPU] = fz_forward},        \
        .reverse = {[PB_DEV_CPU] = fz_reverse}, .fd_step = step, .fd_direction = fz_fd_direction,           \
        .fd_cotangents = fz_fd_cotangents,                                                                   \
    }

/* A small finite-difference step: eigen- and singular vectors vary like
 * 1/gap, and the Householder completions (qr_full's Q₂, the null spaces,
 * svd_full's completions) jump where LAPACK's reflector changes sign, so
 * the check's four evaluations stay within 2e-6·max|A| of A.  Rounding
 * stays near 1e-10 of the derivative. */
const pb_op_t pb_factor_ops[FZ_NKINDS] = {
    [FZ_QR_COMPACT] = FZ_OP("qr_compact", out_QR, o_qr, 1e-6),
    [FZ_QR_FULL] = FZ_OP("qr_full", out_QR, o_qr, 1e-6),
    [FZ_QR_NULL] = FZ_OP("qr_null", out_N, o_qr, 1e-6),
    [FZ_LQ_COMPACT] = FZ_OP("lq_compact", out_LQ, o_qr, 1e-6),
    [FZ_LQ_FULL] = FZ_OP("lq_full", out_LQ, o_qr, 1e-6),
    [FZ_LQ_NULL] = FZ_OP("lq_null", out_N, o_qr, 1e-6),
    [FZ_EIGH_FULL] = FZ_OP("eigh_full", out_DV, o_eigh, 1e-6),
    [FZ_EIGH_VALS] = FZ_OP("eigh_vals", out_D, o_eigh_vals, 1e-6),
    [FZ_EIGH_TRUNC] = FZ_OP("eigh_trunc", out_DV, o_eigh_trunc, 1e-6),
    [FZ_EIG_FULL] = FZ_OP("eig_full", out_DV, o_eig, 1e-6),
    [FZ_EIG_VALS] = FZ_OP0("eig_vals", out_D, 1e-6),
    [FZ_SVD_COMPACT] = FZ_OP("svd_compact", out_USV, o_svd, 1e-6),
    [FZ_SVD_FULL] = FZ_OP("svd_full", out_USV, o_svd, 1e-6),
    [FZ_SVD_VALS] = FZ_OP0("svd_vals", out_S, 1e-6),
    [FZ_SVD_TRUNC] = FZ_OP("svd_trunc", out_USV, o_svd_trunc, 1e-6),
    [FZ_LEFT_POLAR] = FZ_OP0("left_polar", out_WP, 1e-6),
    [FZ_RIGHT_POLAR] = FZ_OP0("right_polar", out_PWh, 1e-6),
};
