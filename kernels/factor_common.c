/* What the factorization families share (factor_common.h): options and
 * tolerances, validation, the ends of forward and reverse, and the
 * per-dtype helpers of factor_common_t.h. */
#include "factor_common.h"

#include <float.h>
#include <pthread.h>
#include <stdio.h>

#include "strided.h"

const pb_io_spec_t pb__fz_in_A[1] = {{"A", true}};
const char *const pb__fz_wrt_A[1] = {"A"};

int pb__fz_opt(const pb_op_t *op, const char *name)
{
    return pb_op_option_index(op, name, strlen(name));
}

static bool single(pb_dtype_t d) { return d == PB_F32 || d == PB_C64; }

/* The spacing of floating-point numbers at x ≥ 0 in d's precision (Julia's
 * eps(x)): 2^(exponent(x) − 52) in double, 2^(exponent(x) − 23) in single,
 * and the smallest subnormal below the normal range.  Finite at the largest
 * values too, where the next number up is Inf. */
static double ulp(double x, pb_dtype_t d)
{
    int bits = single(d) ? FLT_MANT_DIG : DBL_MANT_DIG, emin = single(d) ? FLT_MIN_EXP - 1 : DBL_MIN_EXP - 1;
    int e = x > 0 ? ilogb(x) : emin - 1;
    return ldexp(1.0, (e < emin ? emin : e) - (bits - 1));
}

/* The defaults of rank_atol and degeneracy_atol.  The contract's
 * eps(max|A_ij|)^¾ is absolute: below max|A_ij| = eps (f64 2.2e-16, f32
 * 1.2e-7) it passes √eps·max|A_ij|, and from there down it reaches every
 * singular value of a well-conditioned matrix (f64 near 1e-47, f32 near
 * 1e-21): every pullback would be zero.  So it is capped at √eps·max|A_ij|,
 * which it never exceeds above max|A_ij| = eps, and kept a normal number. */
static double default_tol(double amax, pb_dtype_t d)
{
    double eps = single(d) ? FLT_EPSILON : DBL_EPSILON, tiny = single(d) ? FLT_MIN : DBL_MIN;
    return fmin(pow(ulp(amax, d), 0.75), fmax(sqrt(eps) * amax, tiny));
}

void pb__fz_resolve(const pb_op_t *op, const pb_optval_t *opt, double amax, pb_dtype_t d, int k, fz_opts_t *o)
{
    double eps = single(d) ? FLT_EPSILON : DBL_EPSILON, tol = default_tol(amax, d);
    *o = (fz_opts_t){.rank_atol = tol, .deg_atol = tol, .gauge_atol = INFINITY, .herm_atol = sqrt(eps) * amax,
                     .maxrank = k};
    int i;
#define GIVEN(name) ((i = pb__fz_opt(op, name)) >= 0 && opt[i].given)
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

/* ---- validation ----------------------------------------------------------- */

int pb__fz_check(pb_call_t *c, bool square, pb_err_t *err)
{
    const pb_tensor_t *A = &c->in[0];
    char s1[96];
    if (A->rank != 2)
        return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.A", "A must be a matrix (m, n), got shape %s",
                          pb_shape_str(A, s1, sizeof s1));
    /* LAPACK indexes an array with 32-bit integers: its leading dimension
     * times its columns stays below 2^31.  A leading dimension here is at
     * most 64 elements past the rows (FZ(lapack_ld)), and a workspace holds
     * at most 64 columns of the long side besides the k×k ones (block
     * sizes), so (m + 64)·(n + 64) < 2^31 covers A, the thin factors and
     * the workspaces: a tall-skinny A may be long.  The ops that make a
     * square matrix of the long side (eig, eigh, the full and null forms)
     * also keep (s + 64)² < 2^31. */
    const uint64_t m = A->shape[0], n = A->shape[1], lim = (uint64_t)1 << 31, side = m > n ? m : n;
    const bool long_square = square || c->op->variant == FZ_FULL || c->op->variant == FZ_NULL;
    if (long_square && side > PB_FZ_MAX_SIDE)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "inputs.A",
                          "A %s is too large for %s: it makes a %llu×%llu matrix, and LAPACK's 32-bit indices take "
                          "at most %d rows and columns there",
                          pb_shape_str(A, s1, sizeof s1), c->op->name, (unsigned long long)side,
                          (unsigned long long)side, PB_FZ_MAX_SIDE);
    if (m >= lim || n >= lim || (m + 64) * (n + 64) >= lim)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "inputs.A",
                          "A %s is too large for LAPACK's 32-bit indices: (m + 64)·(n + 64) must stay below 2^31",
                          pb_shape_str(A, s1, sizeof s1));
    if (square && A->shape[0] != A->shape[1])
        return pb_err_set(err, PB_ESHAPE_MISMATCH, "inputs.A", "%s needs a square A, got shape %s", c->op->name,
                          pb_shape_str(A, s1, sizeof s1));
    int i;
    if ((i = pb__fz_opt(c->op, "maxrank")) >= 0 && c->opt[i].given && c->opt[i].i < 0)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "options.maxrank", "maxrank must be >= 0, got %lld",
                          c->opt[i].i);
    static const char *const tols[] = {"rank_atol", "degeneracy_atol", "gauge_atol", "herm_atol", "atol", "rtol"};
    for (size_t t = 0; t < sizeof tols / sizeof tols[0]; t++)
        if ((i = pb__fz_opt(c->op, tols[t])) >= 0 && c->opt[i].given && !(c->opt[i].re >= 0))
            return pb_err_set(err, PB_EINVALID_ARGUMENT, c->op->options[i].name,
                              "%s must be a number >= 0, got %g", tols[t], c->opt[i].re);
    return 0;
}

void pb__fz_meta(pb_call_t *c, int i, pb_dtype_t d, uint64_t r, int64_t cols)
{
    pb_tensor_t *t = &c->out_meta[i];
    memset(t, 0, sizeof *t);
    t->dtype = d;
    t->order = c->order;
    t->rank = cols < 0 ? 1 : 2;
    t->shape[0] = r;
    t->shape[1] = cols < 0 ? 0 : (uint64_t)cols;
}

size_t pb__fz_bytes(pb_dtype_t d, uint64_t r, uint64_t cols) { return (size_t)(r * cols) * pb_dtype_size(d); }

void pb__fz_sized(pb_call_t *c, size_t tape, bool square)
{
    const uint64_t m = c->in[0].shape[0], n = c->in[0].shape[1], k = m < n ? m : n;
    c->tape_bytes = c->taped && (c->wrt & 1u) ? tape : 0;
    /* LAPACK's drivers: a few m·n·k, more for the eigensolvers */
    double flops = (square ? 25.0 : 8.0) * (double)m * (double)n * (double)(k ? k : 1);
    c->cost = flops * (pb_dtype_is_complex(c->dtype) ? 4.0 : 1.0);
    /* A's work copy and the solver's workspace, or the reverse's K, Y and
     * cotangent copies: a few matrices of A's size, or of the long side's
     * square for the ops that make one (counted on a GPU, whose requests
     * reserve device memory up front; polar's reverse holds the most, 13
     * of them with its cotangents and gradient, which this and the
     * daemon's twice inputs and outputs cover) */
    const uint64_t s = m > n ? m : n;
    const bool long_square = square || c->op->variant == FZ_FULL || c->op->variant == FZ_NULL;
    c->work_bytes = 7 * (long_square ? pb__fz_bytes(c->dtype, s, s) : pb__fz_bytes(c->dtype, m, n));
}

/* ---- the ends of forward and reverse ----------------------------------------- */

bool pb__fz_finite(const void *x, size_t n, pb_dtype_t d)
{
    double o[2];
    pb__fz_kernel(&(pb_gpu_fz_t){.kind = PB_GPU_FZ_AMAX, .dtype = d, .m = (int)n, .n = 1, .ld = (int)n, .x = (void *)x},
                  o);
    return o[1] != 0;
}

bool pb__fz_all_finite(const pb_tensor_t *t)
{
    return t->storage == NULL || pb__fz_finite(pb_tensor_data(t), pb_tensor_count(t), t->dtype);
}

/* ---- on the execution device --------------------------------------------------- */

void *pb__fz_zalloc(size_t n, size_t size)
{
    if (n == 0)
        n = 1;
    if (pb_exec_gpu() < 0)
        return pb_mem_calloc(n, size);
    if (n > SIZE_MAX / size)
        return NULL;
    void *p = pb_exec_alloc(n * size);
    if (p)
        pb__exec_zero(p, n * size);
    return p;
}

void pb__fz_free(void *p)
{
    if (p && pb_exec_gpu() >= 0)
        pb_exec_free(p);
    else
        pb_mem_free(p);
}

void pb__fz_move(pb_dtype_t d, void *dst, const void *src, size_t count)
{
    if (count == 0 || dst == src)
        return;
    if (pb_exec_gpu() < 0) {
        memcpy(dst, src, count * pb_dtype_size(d));
        return;
    }
    pb_loop_t L = {.rank = 1, .dim = {count}, .s = {{1}, {1}}};
    pb_strided(d, &L, dst, src, false, (pb_scalar_t){1, 0}, NULL, (pb_scalar_t){0, 0}, false);
}

void pb__fz_kernel_host(const pb_gpu_fz_t *k, double out[2])
{
    static void (*const host[PB_NDTYPES])(const pb_gpu_fz_t *, double[2]) = PB_T_FNS(pb__fz_kernel_host);
    host[k->dtype](k, out);
}

double pb__fz_kernel(const pb_gpu_fz_t *k, double out[2])
{
    double o[2] = {0, 1};
    if (k->m > 0 && k->n > 0) {
        if (pb_exec_gpu() >= 0)
            pb__exec_fz(k, o);
        else
            pb__fz_kernel_host(k, o);
    }
    if (out)
        memcpy(out, o, sizeof o);
    return o[0];
}

/* LAPACKE checks every array it is given for NaN and refuses it as an
 * illegal argument (a negative info).  A factorization's input is checked
 * here before LAPACK sees it; what LAPACKE would catch past that is an
 * overflow of our own (caught on the outputs, pb__fz_finish) or a NaN in a
 * cotangent, which propagates, as the contract has it: the check is off. */
static pthread_once_t nancheck_once = PTHREAD_ONCE_INIT;
static void nancheck_off(void) { LAPACKE_set_nancheck(0); }
void pb__fz_lapack_setup(void) { pthread_once(&nancheck_once, nancheck_off); }

int pb__fz_finish(pb_call_t *c, pb_tapedata_t *tape, pb_tensor_t *o, pb_tensor_t *sv, int rc, pb_err_t *err)
{
    const bool keep = c->taped && (c->wrt & 1u);
    /* A finite A whose factors are not: they overflowed the dtype. */
    for (int i = 0; rc == 0 && i < c->op->noutputs; i++)
        if (!pb__fz_all_finite(&o[i]))
            rc = pb_err_set(err, PB_ENUMERICAL, "inputs.A",
                            "%s: output %s is not finite: A's entries are too near the dtype's largest number "
                            "for it; scale A down",
                            c->op->name, c->op->outputs[i]);
    /* outputs in the order asked for; truncated shapes are known now */
    for (int i = 0; rc == 0 && i < c->op->noutputs; i++) {
        if (c->order == 'C' && o[i].rank == 2) {
            pb_tensor_t t = {0};
            if (pb_tensor_to_order(&t, &o[i], 'C')) {
                rc = PB_ENOMEM;
                break;
            }
            pb_tensor_clear(&o[i]);
            o[i] = t;
        }
        memcpy(c->out_meta[i].shape, o[i].shape, sizeof o[i].shape);
        if (tape)
            memcpy(tape->out_meta[i].shape, o[i].shape, sizeof o[i].shape);
    }
    for (int i = 0; i < 3; i++) {
        if (rc)
            pb_tensor_clear(&o[i]);
        else
            c->out[i] = o[i];
        if (rc == 0 && keep && tape)
            tape->saved[i] = sv[i];
        else
            pb_tensor_clear(&sv[i]);
    }
    if (rc == PB_ENOMEM)
        return pb_err_set(err, PB_ENOMEM, NULL, "out of memory in %s", c->op->name);
    return rc;
}

int pb__fz_rev_finish(const pb_tapedata_t *t, int rc, void *dA, double gauge, const fz_opts_t *op, pb_tensor_t *grad,
                      char order, pb_warnings_t *warn, pb_err_t *err)
{
    if (rc == 0 && gauge > op->gauge_atol) {
        if (op->strict)
            rc = pb_err_set(err, PB_EGAUGE_DEPENDENT, "cotangents",
                            "%s: the cotangents depend on the gauge (size %.3g, gauge_atol %.3g) and strict_gauge "
                            "is set",
                            t->op->name, gauge, op->gauge_atol);
        else if (warn->n < PB_MAX_WARNINGS)
            snprintf(warn->text[warn->n++], sizeof warn->text[0],
                     "%s: the cotangents depend on the gauge (size %.3g > gauge_atol %.3g); that part was ignored",
                     t->op->name, gauge, op->gauge_atol);
    }
    if (rc == 0) {
        pb_tensor_t g = {0};
        uint64_t sh[2] = {t->in_meta[0].shape[0], t->in_meta[0].shape[1]};
        rc = PB_ENOMEM;
        if (pb_tensor_alloc(&g, t->dtype, 2, sh, 'F', false) == 0) {
            pb__fz_move(t->dtype, pb_tensor_data(&g), dA, pb_tensor_count(&g));
            if (order == 'C') {
                rc = pb_tensor_to_order(&grad[0], &g, 'C');
                pb_tensor_clear(&g);
            } else {
                grad[0] = g;
                rc = 0;
            }
        }
    }
    pb__fz_free(dA);
    if (rc == PB_ENOMEM)
        return pb_err_set(err, PB_ENOMEM, NULL, "out of memory in the reverse of %s", t->op->name);
    return rc;
}

int pb__fz_take(pb_tensor_t *dst, const pb_tensor_t *X, const int *sel, int r, bool rows)
{
    size_t isz = pb_dtype_size(X->dtype);
    int m = (int)X->shape[0], n = X->rank == 2 ? (int)X->shape[1] : 1;
    uint64_t sh[2] = {(uint64_t)(rows ? r : m), (uint64_t)(rows ? n : r)};
    if (X->rank == 1)
        sh[0] = (uint64_t)r;
    if (pb_tensor_alloc(dst, X->dtype, X->rank, sh, 'F', false))
        return PB_ENOMEM;
    const char *src = pb_tensor_data(X);
    char *d = pb_tensor_data(dst);
    const pb_dtype_t dt = X->dtype;
    /* a run of consecutive indices in sel is one move */
    for (int i = 0, e; i < r; i = e) {
        for (e = i + 1; e < r && sel[e] == sel[e - 1] + 1;)
            e++;
        if (X->rank == 1)
            pb__fz_move(dt, d + (size_t)i * isz, src + (size_t)sel[i] * isz, (size_t)(e - i));
        else if (!rows)
            pb__fz_move(dt, d + (size_t)i * m * isz, src + (size_t)sel[i] * m * isz, (size_t)(e - i) * m);
        else { /* rows i..e of every column: one strided pass */
            pb_loop_t L = {.rank = 2, .dim = {(uint64_t)(e - i), (uint64_t)n}, .s = {{1, r}, {1, m}}};
            pb_strided(dt, &L, d + (size_t)i * isz, src + (size_t)sel[i] * isz, false, (pb_scalar_t){1, 0}, NULL,
                       (pb_scalar_t){0, 0}, false);
        }
    }
    return 0;
}

#define PB_T_BODY "factor_common_t.h"
#include "dtype_t.h"
