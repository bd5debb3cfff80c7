/* unit.factor: the factorizations and their pullbacks.
 *
 * Reverse against finite differences (pb_check_run: a fourth-order central
 * difference of the forward taken in double precision, with the op's own
 * projections: Hermitian directions for eigh, cotangents without their
 * gauge-dependent part), for every op and dtype on m = 19 with n ∈ {17,
 * 19, 23} (square-only ops at 19), inputs in C and F order.  Tolerances,
 * relative to ‖Ā‖·‖v‖: m·n·√eps of the dtype (the bound), and
 * 1e-6 for f64 and c128.
 *
 * Forward: reconstruction, orthonormality, ordering and the gauge of the
 * contract (largest-magnitude entry of each vector real positive, diag(R)
 * real ≥ 0), to 100·eps·‖A‖ per entry.  Rank-deficient QR, LQ and SVD;
 * degenerate spectra with gauge-invariant losses (and the warning or
 * gauge_dependent for a gauge-dependent cotangent); truncations at rank
 * 0, in between and full, and that their pullback differs from the naive
 * one; every input error.  Matrices whose columns take 512 bytes or more
 * go to LAPACK as padded copies (kernels/factor_common.h): padded_work
 * checks the leading dimension each driver gets and runs the forward
 * properties, every op's finite-difference check and the SVD's fallback
 * on them.
 *
 * With the argument "cuda" (meson: cuda.factor) the ops that run on a GPU
 * (eigh's, so far) run on cuda:0 of the GPU backend's host fake
 * (cuda/fake.h) in the same tests, the others on the CPU; gpu_parity
 * holds each GPU result and gradient against the CPU's, checks that the
 * tape lies in device memory, and every test that no device byte is left
 * behind. */
#include "kernels/cmplx.h"
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/check.h"
#include "kernels/factor_common.h"
#include "kernels/op.h"
#include "fake_gpu.h"
#include "lapack_fault.h"
#include "on_valgrind.h"

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static double urand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}
static double nrand(void)
{
    double u = (urand() + 1.0) * 0.5 + 1e-300, v = (urand() + 1.0) * 0.5;
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static const pb_dtype_t dtypes[4] = {PB_F64, PB_C128, PB_F32, PB_C64};
static bool cplx(pb_dtype_t d) { return d == PB_C64 || d == PB_C128; }
static bool single(pb_dtype_t d) { return d == PB_F32 || d == PB_C64; }
/* The first letter of LAPACK's driver names for dtype d. */
static char lp_letter(pb_dtype_t d) { return d == PB_F32 ? 's' : d == PB_F64 ? 'd' : d == PB_C64 ? 'c' : 'z'; }
static double eps_of(pb_dtype_t d) { return single(d) ? FLT_EPSILON : DBL_EPSILON; }

/* Element (i, j) of a rank-2 tensor (or i of a vector), either order. */
static size_t off(const pb_tensor_t *t, size_t i, size_t j)
{
    if (t->rank == 1)
        return i;
    return t->order == 'F' ? j * t->shape[0] + i : i * t->shape[1] + j;
}
static double complex get(const pb_tensor_t *t, size_t i, size_t j)
{
    const void *p = pb_tensor_data(t);
    size_t o = off(t, i, j);
    switch (t->dtype) {
    case PB_F32: return ((const float *)p)[o];
    case PB_F64: return ((const double *)p)[o];
    case PB_C64: return ((const float complex *)p)[o];
    default: return ((const double complex *)p)[o];
    }
}
static void set(pb_tensor_t *t, size_t i, size_t j, double complex v)
{
    void *p = pb_tensor_data(t);
    size_t o = off(t, i, j);
    switch (t->dtype) {
    case PB_F32: ((float *)p)[o] = (float)creal(v); break;
    case PB_F64: ((double *)p)[o] = creal(v); break;
    case PB_C64: ((float complex *)p)[o] = (float complex)v; break;
    default: ((double complex *)p)[o] = v; break;
    }
}
static size_t rows(const pb_tensor_t *t) { return t->shape[0]; }
static size_t cols(const pb_tensor_t *t) { return t->rank == 2 ? t->shape[1] : 1; }

enum { RANDOM, HERMITIAN, LOWRANK };

/* A random m×n A of dtype d: normal entries, Hermitian (B + Bᴴ, when
 * square), or of rank min(m, n) − 5 (a product of normal m×r and r×n). */
static void make_A(pb_tensor_t *A, pb_dtype_t d, int m, int n, char order, int kind)
{
    uint64_t sh[2] = {(uint64_t)m, (uint64_t)n};
    assert_int_equal(pb_tensor_alloc(A, d, 2, sh, order, false), 0);
    double complex *B = malloc(sizeof *B * (size_t)(m * n + 1));
    for (int i = 0; i < m * n; i++)
        B[i] = CMPLX(nrand(), cplx(d) ? nrand() : 0);
    if (kind == LOWRANK) {
        int r = (m < n ? m : n) - 5;
        double complex *X = malloc(sizeof *X * (size_t)(m * r)), *Y = malloc(sizeof *Y * (size_t)(r * n));
        for (int i = 0; i < m * r; i++)
            X[i] = CMPLX(nrand(), cplx(d) ? nrand() : 0);
        for (int i = 0; i < r * n; i++)
            Y[i] = CMPLX(nrand(), cplx(d) ? nrand() : 0);
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++) {
                double complex s = 0;
                for (int l = 0; l < r; l++)
                    s += X[i * r + l] * Y[l * n + j];
                B[i * n + j] = s;
            }
        free(X);
        free(Y);
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++)
            set(A, (size_t)i, (size_t)j,
                kind == HERMITIAN && m == n ? (B[i * n + j] + conj(B[j * n + i])) * 0.5 : B[i * n + j]);
    free(B);
}

static const pb_op_t *op_named(const char *name)
{
    const pb_op_t *op = pb_op_find(name, strlen(name));
    if (op == NULL)
        fail_msg("no op %s", name);
    return op;
}

/* cuda mode: tests of the CPU's own drivers (gesdd and its gesvd
 * fallback) set this to keep their calls on the CPU. */
static bool cpu_drivers;

/* The op runs on the fake's cuda:0 (cuda mode, an op with a GPU rule). */
static bool on_gpu(const char *op)
{
    return !cpu_drivers && test_dev.kind == PB_DEV_CUDA && (op_named(op)->devices & (1u << PB_DEV_CUDA));
}

static void call_init(pb_call_t *c, const char *op, pb_dtype_t d, char order)
{
    memset(c, 0, sizeof *c);
    c->op = op_named(op);
    /* cuda mode: on the fake's cuda:0 where the op runs there */
    c->device = on_gpu(op) ? test_dev : (pb_device_t){PB_DEV_CPU, 0};
    c->dtype = d;
    c->order = order;
}

static void set_opt(pb_call_t *c, const char *name, double v)
{
    int i = pb_op_option_index(c->op, name, strlen(name));
    assert_true(i >= 0);
    c->opt[i].given = true;
    c->opt[i].re = v;
    c->opt[i].i = (long long)v;
    c->opt[i].b = v != 0;
}

static bool square_only(const char *op) { return strncmp(op, "eig", 3) == 0; }
static bool is_eigh(const char *op) { return strncmp(op, "eigh", 4) == 0; }

static const char *const all_ops[] = {"qr_compact", "qr_full",    "qr_null",     "lq_compact",  "lq_full",
                                      "lq_null",    "eigh_full",  "eigh_vals",   "eigh_trunc",  "eig_full",
                                      "eig_vals",   "svd_compact", "svd_full",   "svd_vals",    "svd_trunc",
                                      "left_polar", "right_polar"};

/* The finite-difference check of one call; fails the test past tol. */
static void fd_check(pb_call_t *c, const char *what)
{
    pb_err_t err = {0};
    c->wrt = 1;
    c->taped = true;
    pb_call_defaults(c);
    if (c->op->validate(c, &err))
        fail_msg("%s: validate: %s", what, err.message);
    double worst, per[PB_MAX_IO + 2];
    if (pb_check_run(c, 11, &worst, per, &err))
        fail_msg("%s: check: %s", what, err.message);
    int m = (int)c->in[0].shape[0], n = (int)c->in[0].shape[1];
    double tol = (double)m * n * sqrt(eps_of(c->dtype));
    if (!single(c->dtype))
        tol = fmin(tol, 1e-6);
    if (!(worst <= tol))
        fail_msg("%s: gradient error %.3g > %.3g", what, worst, tol);
    for (int k = 0; k < PB_MAX_IO; k++)
        pb_tensor_clear(&c->out[k]);
}

/* Every op, dtype and shape against finite differences. */
static void fd_all(void **state)
{
    (void)state;
    static const int ns[3] = {17, 19, 23};
    const char *only = getenv("PB_TEST_OP");
    for (size_t o = 0; o < sizeof all_ops / sizeof all_ops[0]; o++)
        for (int di = 0; di < 4; di++)
            for (int s = 0; s < 3; s++) {
                const char *name = all_ops[o];
                if (only && strcmp(only, name) != 0)
                    continue;
                int m = 19, n = ns[s];
                if (square_only(name) && n != 19)
                    continue;
                if (strcmp(name, "left_polar") == 0 && n > m)
                    continue;
                if (strcmp(name, "right_polar") == 0 && n < m)
                    continue;
                char order = (s + di) % 2 ? 'F' : 'C';
                pb_call_t c;
                call_init(&c, name, dtypes[di], order);
                make_A(&c.in[0], dtypes[di], m, n, order, is_eigh(name) ? HERMITIAN : RANDOM);
                if (strstr(name, "trunc"))
                    set_opt(&c, "maxrank", 7);
                char what[96];
                snprintf(what, sizeof what, "%s %s %dx%d %c", name, pb_dtype_name(dtypes[di]), m, n, order);
                fd_check(&c, what);
                pb_call_clear(&c);
            }
}

/* Matrices larger than the QR pullback's base block (96), tall, square
 * and wide (230 splits 115 → 57 + 58, 200 splits 100 → 50 + 50), so that
 * its recursive triangular products (gemm_upper, triu_mul_upper) are
 * checked at two levels of halving and with odd halves. */
static void qr_blocks(void **state)
{
    (void)state;
    static const int shapes[3][2] = {{230, 200}, {200, 200}, {200, 230}};
    static const char *const ops[] = {"qr_compact", "qr_full", "lq_compact"};
    for (int s = 0; s < 3; s++)
        for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++) {
            pb_dtype_t d = s == 1 ? PB_C128 : PB_F64;
            pb_call_t c;
            call_init(&c, ops[o], d, 'F');
            make_A(&c.in[0], d, shapes[s][0], shapes[s][1], 'F', RANDOM);
            char what[96];
            snprintf(what, sizeof what, "%s %s %dx%d", ops[o], pb_dtype_name(d), shapes[s][0], shapes[s][1]);
            fd_check(&c, what);
            pb_call_clear(&c);
        }
}

/* Scale: polar has no rank in the contract, so a well-conditioned A of
 * 1e-60 (1e-24 in single precision) keeps its whole pullback, though the
 * default rank_atol, eps(max|A_ij|)^¾, lies above all its singular values
 * there; and pb_check_run steps relative to the input, so svd_vals (exact
 * at any scale) checks at 1e-20 as at 1 (an absolute step of 1e-6 was 1e14
 * times A). */
static void tiny_scales(void **state)
{
    (void)state;
    for (int di = 0; di < 4; di++) {
        pb_dtype_t d = dtypes[di];
        static const char *const ops[] = {"left_polar", "right_polar", "svd_vals"};
        for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++) {
            bool right = o == 1, vals = o == 2;
            double scale = vals ? 1e-20 : single(d) ? 1e-24 : 1e-60;
            int m = right ? 5 : 7, n = right ? 7 : 5;
            char order = di % 2 ? 'F' : 'C';
            pb_call_t c;
            call_init(&c, ops[o], d, order);
            make_A(&c.in[0], d, m, n, order, RANDOM);
            for (size_t i = 0; i < (size_t)m; i++)
                for (size_t j = 0; j < (size_t)n; j++)
                    set(&c.in[0], i, j, get(&c.in[0], i, j) * scale);
            char what[96];
            snprintf(what, sizeof what, "%s %s %dx%d at %g", ops[o], pb_dtype_name(d), m, n, scale);
            fd_check(&c, what);
            pb_call_clear(&c);
        }
        /* A zero A (S₁ = 0): the bound has a floor, nothing is divided by
         * zero (0/0 made every entry NaN), the gradient is finite. */
        for (int right = 0; right < 2; right++) {
            int m = right ? 2 : 3, n = right ? 3 : 2;
            pb_call_t c;
            call_init(&c, right ? "right_polar" : "left_polar", d, 'F');
            make_A(&c.in[0], d, m, n, 'F', RANDOM);
            for (size_t i = 0; i < (size_t)m; i++)
                for (size_t j = 0; j < (size_t)n; j++)
                    set(&c.in[0], i, j, 0);
            pb_err_t err = {0};
            c.wrt = 1;
            c.taped = true;
            pb_call_defaults(&c);
            assert_int_equal(c.op->validate(&c, &err), 0);
            pb_tapedata_t tape;
            assert_int_equal(pb_op_run_forward(&c, &tape, &err), 0);
            pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
            for (int o = 0; o < 2; o++) {
                uint64_t sh[2] = {tape.out_meta[o].shape[0], tape.out_meta[o].shape[1]};
                assert_int_equal(pb_tensor_alloc(&cot[o], d, 2, sh, 'F', false), 0);
                for (size_t i = 0; i < sh[0]; i++)
                    for (size_t j = 0; j < sh[1]; j++)
                        set(&cot[o], i, j, 1);
            }
            pb_warnings_t warn = {0};
            assert_int_equal(pb_op_run_reverse(&tape, cot, grad, 'F', &warn, &err), 0);
            for (size_t i = 0; i < (size_t)m; i++)
                for (size_t j = 0; j < (size_t)n; j++)
                    if (!isfinite(creal(get(&grad[0], i, j))) || !isfinite(cimag(get(&grad[0], i, j))))
                        fail_msg("%s %s of zeros: gradient (%zu, %zu) is not finite", c.op->name, pb_dtype_name(d), i,
                                 j);
            for (int o = 0; o < PB_MAX_IO; o++)
                pb_tensor_clear(&cot[o]);
            for (int o = 0; o < PB_MAX_IO + 2; o++)
                pb_tensor_clear(&grad[o]);
            pb_tapedata_clear(&tape);
            pb_call_clear(&c);
        }
    }
}

/* ---- forward properties ---- */

/* max |X·Y − Z| over entries, X (a×b), Y (b×c) tensors; Y may be a vector
 * meaning diag(Y) when diag is set. */
static double complex dotrow(const pb_tensor_t *X, size_t i, const pb_tensor_t *Y, size_t j, bool adjX, bool adjY)
{
    size_t K = adjX ? rows(X) : cols(X);
    double complex s = 0;
    for (size_t l = 0; l < K; l++) {
        double complex x = adjX ? conj(get(X, l, i)) : get(X, i, l);
        double complex y = adjY ? conj(get(Y, j, l)) : get(Y, l, j);
        s += x * y;
    }
    return s;
}

/* ‖XᴴX − I‖ (columns orthonormal) or ‖XXᴴ − I‖ (rows). */
static double orth_err(const pb_tensor_t *X, bool by_rows)
{
    size_t n = by_rows ? rows(X) : cols(X);
    double e = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j < n; j++) {
            double complex s = by_rows ? dotrow(X, i, X, j, false, true) : dotrow(X, i, X, j, true, false);
            e = fmax(e, cabs(s - (i == j ? 1.0 : 0.0)));
        }
    return e;
}

/* Every rule is homogeneous in A's scale, so its pullback is right at every
 * scale from the small normal numbers up to where the reverse is refused
 * (an eighth of the largest number over √(m·n)), or none: max|A_ij| once overflowed at 1e154 (its square did)
 * and made every default tolerance NaN, and the contract's rank_atol,
 * eps(max|A_ij|)^¾, passes every singular value near 1e-47: both gave zero
 * gradients.  The check itself must see them at such scales (its dot
 * products overflowed to Inf, and every error read 0). */
static void extreme_scales(void **state)
{
    (void)state;
    static const char *const ops[] = {"qr_compact", "lq_full",   "svd_compact", "svd_trunc",
                                      "eigh_full",  "eig_full",  "left_polar",  "qr_null"};
    static const double wide[] = {1e-300, 1e-150, 1e-50, 1e50, 1e150, 1e300};
    static const double narrow[] = {1e-30, 1e-15, 1e15, 1e30};
    const char *only = getenv("PB_TEST_OP");
    for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++)
        for (int di = 0; di < 4; di++) {
            pb_dtype_t d = dtypes[di];
            const double *scales = single(d) ? narrow : wide;
            size_t ns = single(d) ? sizeof narrow / sizeof narrow[0] : sizeof wide / sizeof wide[0];
            if (only && strcmp(only, ops[o]) != 0)
                continue;
            /* Under valgrind long double is a double (the check's dot
             * products overflow again past 1e154) and its floating point
             * is not the CPU's: the release run checks the numbers; here
             * QR and LQ in f64 at 1e-150 cover the memory of the rescaled
             * path (pow2_normalise). */
            if (RUNNING_ON_VALGRIND && (d != PB_F64 || (strcmp(ops[o], "qr_compact") && strcmp(ops[o], "lq_full"))))
                continue;
            for (size_t k = 0; k < ns; k++) {
                if (RUNNING_ON_VALGRIND && scales[k] != 1e-150)
                    continue;
                bool sq = square_only(ops[o]);
                int m = 6, n = sq ? 6 : 4;
                char order = k % 2 ? 'F' : 'C';
                pb_call_t c;
                call_init(&c, ops[o], d, order);
                make_A(&c.in[0], d, m, n, order, is_eigh(ops[o]) ? HERMITIAN : RANDOM);
                for (size_t i = 0; i < (size_t)m; i++)
                    for (size_t j = 0; j < (size_t)n; j++)
                        set(&c.in[0], i, j, get(&c.in[0], i, j) * scales[k]);
                char what[96];
                snprintf(what, sizeof what, "%s %s %dx%d at %g", ops[o], pb_dtype_name(d), m, n, scales[k]);
                fd_check(&c, what);
                pb_call_clear(&c);
            }
        }
}

/* The contract's gauge: each column's largest-magnitude entry (first on a
 * tie) is real and positive. */
static void check_gauge(const pb_tensor_t *V, double tol, const char *what)
{
    for (size_t j = 0; j < cols(V); j++) {
        size_t best = 0;
        for (size_t i = 1; i < rows(V); i++)
            if (cabs(get(V, i, j)) > cabs(get(V, best, j)))
                best = i;
        double complex v = get(V, best, j);
        if (!(creal(v) > 0 && fabs(cimag(v)) <= tol))
            fail_msg("%s: column %zu's largest entry is %g%+gi", what, j, creal(v), cimag(v));
    }
}

/* A ≈ X·diag(s)·Y (s NULL: X·Y). */
static double recon_err(const pb_tensor_t *A, const pb_tensor_t *X, const pb_tensor_t *s, const pb_tensor_t *Y)
{
    double e = 0;
    for (size_t i = 0; i < rows(A); i++)
        for (size_t j = 0; j < cols(A); j++) {
            double complex z = 0;
            for (size_t l = 0; l < cols(X) && l < rows(Y); l++)
                z += get(X, i, l) * (s ? get(s, l, 0) : 1.0) * get(Y, l, j);
            e = fmax(e, cabs(z - get(A, i, j)));
        }
    return e;
}

/* A call's outputs and the call itself released. */
static void call_free(pb_call_t *c)
{
    for (int o = 0; o < PB_MAX_IO; o++)
        pb_tensor_clear(&c->out[o]);
    pb_call_clear(c);
}

static void run_forward(pb_call_t *c)
{
    pb_err_t err = {0};
    pb_call_defaults(c);
    if (c->op->validate(c, &err) || pb_op_run_forward(c, NULL, &err))
        fail_msg("%s: %s", c->op->name, err.message);
}

/* geqrf and gelqf do not scale their input, and an nrm2 that squares its
 * entries overflows past 1e154 (1e19 in single): OpenBLAS's x87 kernel
 * does under valgrind, whose long double is a double, and Q came out NaN
 * at 1e300.  A goes to [1, 2) by a power of two first (pow2_normalise):
 * at A·2^±k the factors are A's, R (L) times 2^±k, within rounding. */
static void qr_rescaled(void **state)
{
    (void)state;
    static const char *const ops[] = {"qr_compact", "lq_compact"};
    for (size_t o = 0; o < 2; o++)
        for (int di = 0; di < 4; di++) {
            pb_dtype_t d = dtypes[di];
            const int ks[2] = {single(d) ? 120 : 996, single(d) ? -120 : -996};
            bool lq = o == 1;
            int m = lq ? 4 : 6, n = lq ? 6 : 4;
            pb_call_t c1;
            call_init(&c1, ops[o], d, 'F');
            make_A(&c1.in[0], d, m, n, 'F', RANDOM);
            run_forward(&c1);
            const pb_tensor_t *Q1 = &c1.out[lq ? 1 : 0], *R1 = &c1.out[lq ? 0 : 1];
            for (int t = 0; t < 2; t++) {
                pb_call_t c;
                call_init(&c, ops[o], d, 'F');
                make_A(&c.in[0], d, m, n, 'F', RANDOM);
                for (size_t i = 0; i < (size_t)m; i++)
                    for (size_t j = 0; j < (size_t)n; j++)
                        set(&c.in[0], i, j, ldexp(1.0, ks[t]) * get(&c1.in[0], i, j));
                run_forward(&c);
                const pb_tensor_t *Q = &c.out[lq ? 1 : 0], *R = &c.out[lq ? 0 : 1];
                double eq = 0, er = 0, rmax = 0;
                for (size_t i = 0; i < rows(Q); i++)
                    for (size_t j = 0; j < cols(Q); j++)
                        eq = fmax(eq, cabs(get(Q, i, j) - get(Q1, i, j)));
                for (size_t i = 0; i < rows(R); i++)
                    for (size_t j = 0; j < cols(R); j++) {
                        er = fmax(er, cabs(ldexp(1.0, -ks[t]) * get(R, i, j) - get(R1, i, j)));
                        rmax = fmax(rmax, cabs(get(R1, i, j)));
                    }
                if (!(eq <= 16 * eps_of(d) && er <= 16 * eps_of(d) * rmax))
                    fail_msg("%s %s at 2^%d: Q off by %.3g, R by %.3g", ops[o], pb_dtype_name(d), ks[t], eq, er);
                call_free(&c);
            }
            call_free(&c1);
        }
}

/* The forward properties of every op for dtype d on m×n, n ∈ {m − 2,
 * m, m + 4} (the square-only ops on m×m). */
static void forward_props_at(pb_dtype_t d, int m)
{
    const int ns[3] = {m - 2, m, m + 4};
    for (int s = 0; s < 3; s++) {
        int n = ns[s], k = m < n ? m : n;
        char order = s == 1 ? 'F' : 'C';
        double tol = 200 * eps_of(d) * (m + n);
        pb_call_t c;
        char what[64];
        /* QR / LQ: A = QR, orthonormal Q, R upper with real diag ≥ 0 */
        const char *qrs[4] = {"qr_compact", "qr_full", "lq_compact", "lq_full"};
        for (int q = 0; q < 4; q++) {
            call_init(&c, qrs[q], d, order);
            make_A(&c.in[0], d, m, n, order, RANDOM);
            run_forward(&c);
            snprintf(what, sizeof what, "%s %s %dx%d", qrs[q], pb_dtype_name(d), m, n);
            bool lq = q >= 2;
            const pb_tensor_t *Q = &c.out[lq ? 1 : 0], *Rt = &c.out[lq ? 0 : 1];
            assert_true(recon_err(&c.in[0], &c.out[0], NULL, &c.out[1]) <= tol);
            assert_true(orth_err(Q, lq) <= tol);
            for (size_t i = 0; i < rows(Rt); i++)
                for (size_t j = 0; j < cols(Rt); j++) {
                    double complex v = get(Rt, i, j);
                    if ((lq ? j > i : i > j) && cabs(v) != 0)
                        fail_msg("%s: not triangular at (%zu, %zu)", what, i, j);
                    if (i == j && !(creal(v) >= 0 && cimag(v) == 0))
                        fail_msg("%s: diagonal %zu is %g%+gi", what, i, creal(v), cimag(v));
                }
            pb_call_clear(&c);
        }
        /* null spaces */
        for (int q = 0; q < 2; q++) {
            call_init(&c, q ? "lq_null" : "qr_null", d, order);
            make_A(&c.in[0], d, m, n, order, RANDOM);
            run_forward(&c);
            const pb_tensor_t *N = &c.out[0], *A = &c.in[0];
            assert_int_equal(q ? rows(N) : cols(N), (size_t)((q ? n : m) - k));
            assert_true(orth_err(N, q) <= tol);
            for (size_t i = 0; i < (q ? rows(A) : cols(A)); i++)
                for (size_t j = 0; j < (q ? rows(N) : cols(N)); j++)
                    assert_true(cabs(q ? dotrow(A, i, N, j, false, true) : dotrow(A, i, N, j, true, false)) <=
                                tol * 10);
            pb_call_clear(&c);
        }
        /* SVD: A = U·S·Vh, descending S, the gauge */
        const char *svds[2] = {"svd_compact", "svd_full"};
        for (int q = 0; q < 2; q++) {
            call_init(&c, svds[q], d, order);
            make_A(&c.in[0], d, m, n, order, RANDOM);
            run_forward(&c);
            snprintf(what, sizeof what, "%s %s %dx%d", svds[q], pb_dtype_name(d), m, n);
            assert_true(recon_err(&c.in[0], &c.out[0], &c.out[1], &c.out[2]) <= tol * 10);
            assert_true(orth_err(&c.out[0], false) <= tol);
            assert_true(orth_err(&c.out[2], true) <= tol);
            assert_int_equal(c.out[1].dtype, pb_dtype_real(d));
            for (int i = 1; i < k; i++)
                assert_true(creal(get(&c.out[1], (size_t)i - 1, 0)) >= creal(get(&c.out[1], (size_t)i, 0)));
            check_gauge(&c.out[0], tol, what);
            pb_call_clear(&c);
        }
        /* polar */
        if (n != m) {
            bool right = n > m;
            call_init(&c, right ? "right_polar" : "left_polar", d, order);
            make_A(&c.in[0], d, m, n, order, RANDOM);
            run_forward(&c);
            const pb_tensor_t *W = &c.out[right ? 1 : 0], *P = &c.out[right ? 0 : 1];
            assert_true(recon_err(&c.in[0], &c.out[0], NULL, &c.out[1]) <= tol * 10);
            assert_true(orth_err(W, right) <= tol);
            for (size_t i = 0; i < rows(P); i++)
                for (size_t j = 0; j < rows(P); j++)
                    assert_true(cabs(get(P, i, j) - conj(get(P, j, i))) <= tol);
            pb_call_clear(&c);
        }
        if (n != m)
            continue;
        /* eigh: A·V = V·D, D ascending and real, gauge */
        call_init(&c, "eigh_full", d, order);
        make_A(&c.in[0], d, m, m, order, HERMITIAN);
        run_forward(&c);
        snprintf(what, sizeof what, "eigh_full %s", pb_dtype_name(d));
        assert_int_equal(c.out[0].dtype, pb_dtype_real(d));
        for (int i = 1; i < m; i++)
            assert_true(creal(get(&c.out[0], (size_t)i - 1, 0)) <= creal(get(&c.out[0], (size_t)i, 0)));
        for (size_t i = 0; i < (size_t)m; i++)
            for (size_t j = 0; j < (size_t)m; j++)
                assert_true(cabs(dotrow(&c.in[0], i, &c.out[1], j, false, false) -
                                 get(&c.out[1], i, j) * get(&c.out[0], j, 0)) <= tol * 10);
        assert_true(orth_err(&c.out[1], false) <= tol);
        check_gauge(&c.out[1], tol, what);
        pb_call_clear(&c);
        /* eig: A·V = V·D, unit columns, gauge, complex outputs */
        call_init(&c, "eig_full", d, order);
        make_A(&c.in[0], d, m, m, order, RANDOM);
        run_forward(&c);
        snprintf(what, sizeof what, "eig_full %s", pb_dtype_name(d));
        assert_int_equal(c.out[0].dtype, pb_dtype_complex(d));
        for (size_t i = 0; i < (size_t)m; i++)
            for (size_t j = 0; j < (size_t)m; j++)
                assert_true(cabs(dotrow(&c.in[0], i, &c.out[1], j, false, false) -
                                 get(&c.out[1], i, j) * get(&c.out[0], j, 0)) <= tol * 20);
        for (size_t j = 0; j < (size_t)m; j++)
            assert_true(fabs(creal(dotrow(&c.out[1], j, &c.out[1], j, true, false)) - 1) <= tol);
        check_gauge(&c.out[1], tol, what);
        pb_call_clear(&c);
    }
}

static void forward_props(void **state)
{
    (void)state;
    for (int di = 0; di < 4; di++)
        forward_props_at(dtypes[di], 19);
}

/* Rank-deficient QR, LQ, SVD: A = randn(m, r)·randn(r, n), r = k − 5. */
static void rank_deficient(void **state)
{
    (void)state;
    static const char *const ops[] = {"qr_compact", "qr_full", "lq_compact", "lq_full", "svd_compact", "svd_full",
                                       "svd_vals"};
    static const int ns[3] = {17, 19, 23};
    for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++)
        for (int di = 0; di < 4; di++)
            for (int s = 0; s < 3; s++) {
                pb_call_t c;
                call_init(&c, ops[o], dtypes[di], 'C');
                make_A(&c.in[0], dtypes[di], 19, ns[s], 'C', LOWRANK);
                if (single(dtypes[di]) && pb_op_option_index(c.op, "rank_atol", 9) >= 0)
                    /* rank_atol at the f32 noise level of the product */
                    set_opt(&c, "rank_atol", 1e-3);
                char what[96];
                snprintf(what, sizeof what, "rank-deficient %s %s 19x%d", ops[o], pb_dtype_name(dtypes[di]), ns[s]);
                fd_check(&c, what);
                pb_call_clear(&c);
            }
}

/* ---- degenerate spectra ---- */

/* A reverse with the given cotangents; returns the gradient (rc, warnings). */
static int reverse_with(pb_call_t *c, pb_tensor_t *cot, pb_tensor_t *grad, pb_warnings_t *w, pb_err_t *err)
{
    pb_tapedata_t tape;
    c->wrt = 1;
    c->taped = true;
    pb_call_defaults(c);
    assert_int_equal(c->op->validate(c, err), 0);
    assert_int_equal(pb_op_run_forward(c, &tape, err), 0);
    int rc = pb_op_run_reverse(&tape, cot, grad, 'C', w, err);
    pb_tapedata_clear(&tape);
    return rc;
}

/* L(A) = Re tr(C·V·g(D)·Vᴴ) through eigh_full, for a Hermitian C and
 * g(λ) = λ(λ − 1)²: gauge invariant however D is degenerate, and flat in
 * the degenerate block at λ = 1 (g′(1) = 0), where the contract's rule is
 * exact; its cotangents are ΔV = 2·C·V·g(D), ΔD = g′(D)·Re diag(VᴴCV). */
static double g_eigh(double x) { return x * (x - 1) * (x - 1); }
static double dg_eigh(double x) { return (x - 1) * (3 * x - 1); }
static double eigh_loss(pb_dtype_t d, const pb_tensor_t *A, const double complex *C, pb_tensor_t *cot)
{
    int m = (int)A->shape[0];
    pb_call_t c;
    call_init(&c, "eigh_full", d, 'C');
    pb_tensor_ref(&c.in[0], A);
    run_forward(&c);
    const pb_tensor_t *D = &c.out[0], *V = &c.out[1];
    double L = 0;
    if (cot) {
        uint64_t sv[2] = {(uint64_t)m, (uint64_t)m}, sd[1] = {(uint64_t)m};
        assert_int_equal(pb_tensor_alloc(&cot[0], D->dtype, 1, sd, 'C', true), 0);
        assert_int_equal(pb_tensor_alloc(&cot[1], d, 2, sv, 'C', true), 0);
    }
    for (int j = 0; j < m; j++) {
        double lam = creal(get(D, (size_t)j, 0));
        double complex vcv = 0;
        for (int i = 0; i < m; i++) {
            double complex cv = 0;
            for (int l = 0; l < m; l++)
                cv += C[i * m + l] * get(V, (size_t)l, (size_t)j);
            vcv += conj(get(V, (size_t)i, (size_t)j)) * cv;
            if (cot)
                set(&cot[1], (size_t)i, (size_t)j, 2 * cv * g_eigh(lam));
        }
        L += creal(vcv) * g_eigh(lam);
        if (cot)
            set(&cot[0], (size_t)j, 0, dg_eigh(lam) * creal(vcv));
    }
    pb_call_clear(&c);
    return L;
}

typedef double (*loss_fn)(pb_dtype_t d, const pb_tensor_t *A, const double complex *C, pb_tensor_t *cot);

/* The reverse of op for the cotangents of a gauge-invariant loss (with
 * the degeneracy tolerance at the f32 noise level for single precision)
 * against central differences of the loss along E, the loss taken in
 * double precision.  No warning, finite gradients; tolerance m·n·√eps
 * (f32, c64) or 1e-7. */
static void check_flat_loss(const char *op, pb_dtype_t d, const pb_tensor_t *A, loss_fn loss,
                            const double complex *C, const double complex *E)
{
    int m = (int)A->shape[0], n = (int)A->shape[1];
    pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
    loss(d, A, C, cot);
    pb_call_t c;
    call_init(&c, op, d, 'C');
    pb_tensor_ref(&c.in[0], A);
    if (single(d))
        set_opt(&c, "degeneracy_atol", 1e-4);
    pb_warnings_t w = {0};
    pb_err_t err = {0};
    assert_int_equal(reverse_with(&c, cot, grad, &w, &err), 0);
    if (w.n)
        fail_msg("%s degenerate %s: unexpected warning %s", op, pb_dtype_name(d), w.text[0]);
    double an = 0;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double complex g = get(&grad[0], (size_t)i, (size_t)j);
            assert_true(isfinite(creal(g)) && isfinite(cimag(g)));
            an += creal(conj(g) * E[i * n + j]);
        }
    pb_dtype_t hd = single(d) ? (d == PB_F32 ? PB_F64 : PB_C128) : d;
    uint64_t sh[2] = {(uint64_t)m, (uint64_t)n};
    double h = 1e-4, l[4];
    const double ts[4] = {h, -h, 2 * h, -2 * h};
    for (int t = 0; t < 4; t++) {
        pb_tensor_t At;
        assert_int_equal(pb_tensor_alloc(&At, hd, 2, sh, 'C', false), 0);
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++)
                set(&At, (size_t)i, (size_t)j, get(A, (size_t)i, (size_t)j) + ts[t] * E[i * n + j]);
        l[t] = loss(hd, &At, C, NULL);
        pb_tensor_clear(&At);
    }
    double fd = (8 * (l[0] - l[1]) - (l[2] - l[3])) / (12 * h);
    double tol = single(d) ? m * n * sqrt(FLT_EPSILON) : 1e-7;
    if (!(fabs(an - fd) <= tol * fmax(1, fabs(fd))))
        fail_msg("%s degenerate %s: reverse %.10g, finite differences %.10g", op, pb_dtype_name(d), an, fd);
    for (int k = 0; k < PB_MAX_IO; k++)
        pb_tensor_clear(&cot[k]);
    pb_tensor_clear(&grad[0]);
    pb_call_clear(&c);
}

static void degenerate_eigh(void **state)
{
    (void)state;
    const int m = 12;
    for (int di = 0; di < 4; di++) {
        pb_dtype_t d = dtypes[di];
        /* A = Q·diag(1, 1, 1, 2, 3, ...)·Qᴴ with Q from a QR of a random matrix */
        pb_call_t q;
        call_init(&q, "qr_full", d, 'C');
        make_A(&q.in[0], d, m, m, 'C', RANDOM);
        run_forward(&q);
        pb_tensor_t A;
        uint64_t sh[2] = {(uint64_t)m, (uint64_t)m};
        assert_int_equal(pb_tensor_alloc(&A, d, 2, sh, 'C', false), 0);
        for (int i = 0; i < m; i++)
            for (int j = 0; j < m; j++) {
                double complex s = 0;
                for (int l = 0; l < m; l++)
                    s += get(&q.out[0], (size_t)i, (size_t)l) * (l < 3 ? 1.0 : l - 1.0) *
                         conj(get(&q.out[0], (size_t)j, (size_t)l));
                set(&A, (size_t)i, (size_t)j, s);
            }
        for (int i = 0; i < m; i++) /* exactly Hermitian */
            for (int j = 0; j < i; j++)
                set(&A, (size_t)i, (size_t)j, conj(get(&A, (size_t)j, (size_t)i)));
        double complex *C = malloc(sizeof *C * (size_t)(m * m)), *E = malloc(sizeof *E * (size_t)(m * m));
        for (int i = 0; i < m; i++)
            for (int j = 0; j <= i; j++) {
                C[i * m + j] = CMPLX(nrand(), i == j || !cplx(d) ? 0 : nrand());
                C[j * m + i] = conj(C[i * m + j]);
                E[i * m + j] = CMPLX(nrand(), i == j || !cplx(d) ? 0 : nrand());
                E[j * m + i] = conj(E[i * m + j]);
            }
        check_flat_loss("eigh_full", d, &A, eigh_loss, C, E);
        pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
        pb_warnings_t w = {0};
        pb_err_t err = {0};
        pb_call_t c;
        eigh_loss(d, &A, C, cot);
        /* a gauge-dependent cotangent: a random ΔV mixes the degenerate block */
        for (int i = 0; i < m; i++)
            for (int j = 0; j < m; j++)
                set(&cot[1], (size_t)i, (size_t)j, CMPLX(nrand(), cplx(d) ? nrand() : 0));
        call_init(&c, "eigh_full", d, 'C');
        pb_tensor_ref(&c.in[0], &A);
        memset(&w, 0, sizeof w);
        assert_int_equal(reverse_with(&c, cot, grad, &w, &err), 0);
        assert_int_equal(w.n, 1);
        assert_non_null(strstr(w.text[0], "gauge"));
        for (int k = 0; k < PB_MAX_IO + 2; k++)
            pb_tensor_clear(&grad[k]);
        pb_call_clear(&c);
        call_init(&c, "eigh_full", d, 'C');
        pb_tensor_ref(&c.in[0], &A);
        set_opt(&c, "strict_gauge", 1);
        assert_int_equal(reverse_with(&c, cot, grad, &w, &err), PB_EGAUGE_DEPENDENT);
        assert_non_null(strstr(err.message, "eigh_full"));
        pb_call_clear(&c);
        pb_call_clear(&q);
        pb_tensor_clear(&cot[0]);
        pb_tensor_clear(&cot[1]);
        pb_tensor_clear(&A);
        free(C);
        free(E);
    }
}

/* L(A) = Re tr(Cᴴ·U·g(S)·Vh) through svd_compact, g(s) = 1 + (s − 1)²:
 * invariant under the rotations of degenerate singular vectors and flat
 * in the block at s = 1 (at an isometry it is Re tr(Cᴴ·W), W the polar
 * factor); ΔU = C·Vhᴴ·g(S), ΔVh = g(S)·Uᴴ·C, ΔS = g′(S)·Re diag(UᴴC·Vhᴴ). */
static double g_svd(double x) { return 1 + (x - 1) * (x - 1); }
static double dg_svd(double x) { return 2 * (x - 1); }
static double svd_loss(pb_dtype_t d, const pb_tensor_t *A, const double complex *C, pb_tensor_t *cot)
{
    int m = (int)A->shape[0], n = (int)A->shape[1];
    pb_call_t c;
    call_init(&c, "svd_compact", d, 'C');
    pb_tensor_ref(&c.in[0], A);
    run_forward(&c);
    const pb_tensor_t *U = &c.out[0], *S = &c.out[1], *Vh = &c.out[2];
    int k = m < n ? m : n;
    if (cot) {
        uint64_t su[2] = {(uint64_t)m, (uint64_t)k}, ss[1] = {(uint64_t)k}, sv[2] = {(uint64_t)k, (uint64_t)n};
        assert_int_equal(pb_tensor_alloc(&cot[0], d, 2, su, 'C', true), 0);
        assert_int_equal(pb_tensor_alloc(&cot[1], S->dtype, 1, ss, 'C', true), 0);
        assert_int_equal(pb_tensor_alloc(&cot[2], d, 2, sv, 'C', true), 0);
    }
    double L = 0;
    for (int j = 0; j < k; j++) {
        double s = creal(get(S, (size_t)j, 0));
        double complex uCv = 0;
        for (int i = 0; i < m; i++)
            for (int l = 0; l < n; l++)
                uCv += conj(get(U, (size_t)i, (size_t)j)) * C[i * n + l] * conj(get(Vh, (size_t)j, (size_t)l));
        L += creal(uCv) * g_svd(s);
        if (cot) {
            set(&cot[1], (size_t)j, 0, dg_svd(s) * creal(uCv));
            for (int i = 0; i < m; i++) {
                double complex z = 0;
                for (int l = 0; l < n; l++)
                    z += C[i * n + l] * conj(get(Vh, (size_t)j, (size_t)l));
                set(&cot[0], (size_t)i, (size_t)j, z * g_svd(s));
            }
            for (int l = 0; l < n; l++) {
                double complex z = 0;
                for (int i = 0; i < m; i++)
                    z += conj(get(U, (size_t)i, (size_t)j)) * C[i * n + l];
                set(&cot[2], (size_t)j, (size_t)l, z * g_svd(s));
            }
        }
    }
    pb_call_clear(&c);
    return L;
}

/* SVD of an isometry (all σ = 1) with a gauge-invariant loss. */
static void degenerate_svd(void **state)
{
    (void)state;
    const int m = 11, n = 7;
    for (int di = 0; di < 4; di++) {
        pb_dtype_t d = dtypes[di];
        pb_call_t q;
        call_init(&q, "qr_compact", d, 'C');
        make_A(&q.in[0], d, m, n, 'C', RANDOM);
        run_forward(&q);
        const pb_tensor_t *A = &q.out[0];
        double complex *C = malloc(sizeof *C * (size_t)(m * n)), *E = malloc(sizeof *E * (size_t)(m * n));
        for (int i = 0; i < m * n; i++) {
            C[i] = CMPLX(nrand(), cplx(d) ? nrand() : 0);
            E[i] = CMPLX(nrand(), cplx(d) ? nrand() : 0);
        }
        check_flat_loss("svd_compact", d, A, svd_loss, C, E);
        pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
        pb_warnings_t w = {0};
        pb_err_t err = {0};
        pb_call_t c;
        svd_loss(d, A, C, cot);
        /* gauge-dependent: a random ΔU */
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++)
                set(&cot[0], (size_t)i, (size_t)j, CMPLX(nrand(), cplx(d) ? nrand() : 0));
        call_init(&c, "svd_compact", d, 'C');
        pb_tensor_ref(&c.in[0], A);
        set_opt(&c, "strict_gauge", 1);
        assert_int_equal(reverse_with(&c, cot, grad, &w, &err), PB_EGAUGE_DEPENDENT);
        pb_call_clear(&c);
        for (int k = 0; k < 3; k++)
            pb_tensor_clear(&cot[k]);
        pb_call_clear(&q);
        free(C);
        free(E);
    }
}

/* ---- truncations ---- */

static void truncations(void **state)
{
    (void)state;
    const int ranks[] = {0, 1, 5, 17, 19};
    for (int di = 0; di < 4; di++)
        for (size_t r = 0; r < sizeof ranks / sizeof ranks[0]; r++) {
            pb_dtype_t d = dtypes[di];
            for (int e = 0; e < 2; e++) {
                pb_call_t c;
                int m = 19, n = e ? 19 : 23;
                call_init(&c, e ? "eigh_trunc" : "svd_trunc", d, 'C');
                make_A(&c.in[0], d, m, n, 'C', e ? HERMITIAN : RANDOM);
                set_opt(&c, "maxrank", ranks[r]);
                run_forward(&c);
                int kept = ranks[r] > 19 ? 19 : ranks[r];
                assert_int_equal(c.out[0].shape[e ? 0 : 1], (uint64_t)kept);
                if (e) /* ascending λ, the largest |λ| kept */
                    for (int i = 1; i < kept; i++)
                        assert_true(creal(get(&c.out[0], (size_t)i - 1, 0)) <= creal(get(&c.out[0], (size_t)i, 0)));
                for (int k = 0; k < PB_MAX_IO; k++)
                    pb_tensor_clear(&c.out[k]);
                char what[96];
                snprintf(what, sizeof what, "%s %s rank %d", c.op->name, pb_dtype_name(d), ranks[r]);
                if (kept == 0) { /* empty outputs, a zero gradient */
                    pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
                    pb_warnings_t w = {0};
                    pb_err_t err = {0};
                    assert_int_equal(reverse_with(&c, cot, grad, &w, &err), 0);
                    for (size_t i = 0; i < pb_tensor_count(&grad[0]); i++)
                        assert_true(get(&grad[0], i / (size_t)n, i % (size_t)n) == 0);
                    pb_tensor_clear(&grad[0]);
                    for (int k = 0; k < PB_MAX_IO; k++)
                        pb_tensor_clear(&c.out[k]);
                } else
                    fd_check(&c, what);
                pb_call_clear(&c);
            }
        }
    /* with rtol: σ_i > rtol·σ₁ kept */
    pb_call_t c;
    call_init(&c, "svd_trunc", PB_F64, 'C');
    make_A(&c.in[0], PB_F64, 19, 23, 'C', RANDOM);
    set_opt(&c, "rtol", 0.5);
    run_forward(&c);
    size_t kept = c.out[1].shape[0];
    assert_true(kept >= 1 && kept < 19);
    for (size_t i = 0; i < kept; i++)
        assert_true(creal(get(&c.out[1], i, 0)) > 0.5 * creal(get(&c.out[1], 0, 0)));
    pb_call_clear(&c);
}

/* The truncated pullback is not the naive one (the SVD pullback of the
 * kept factors alone) when the discarded values are nonzero: the naive
 * rule misses the coupling to the discarded vectors. */
static void trunc_not_naive(void **state)
{
    (void)state;
    const int m = 19, n = 23, r = 6;
    pb_call_t c;
    call_init(&c, "svd_trunc", PB_F64, 'C');
    make_A(&c.in[0], PB_F64, m, n, 'C', RANDOM);
    set_opt(&c, "maxrank", r);
    run_forward(&c);
    /* Ar = U·S·Vh of the kept factors, a random ΔU (phase-free: real) */
    pb_tensor_t Ar, cot[PB_MAX_IO] = {{0}}, g1[PB_MAX_IO + 2] = {{0}}, g2[PB_MAX_IO + 2] = {{0}};
    uint64_t sh[2] = {(uint64_t)m, (uint64_t)n}, su[2] = {(uint64_t)m, (uint64_t)r};
    assert_int_equal(pb_tensor_alloc(&Ar, PB_F64, 2, sh, 'C', false), 0);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int l = 0; l < r; l++)
                s += creal(get(&c.out[0], (size_t)i, (size_t)l) * get(&c.out[1], (size_t)l, 0) *
                           get(&c.out[2], (size_t)l, (size_t)j));
            set(&Ar, (size_t)i, (size_t)j, s);
        }
    assert_int_equal(pb_tensor_alloc(&cot[0], PB_F64, 2, su, 'C', false), 0);
    for (int i = 0; i < m * r; i++)
        set(&cot[0], (size_t)(i / r), (size_t)(i % r), nrand());
    for (int k = 0; k < PB_MAX_IO; k++)
        pb_tensor_clear(&c.out[k]);
    pb_warnings_t w = {0};
    pb_err_t err = {0};
    assert_int_equal(reverse_with(&c, cot, g1, &w, &err), 0);
    for (int k = 0; k < PB_MAX_IO; k++)
        pb_tensor_clear(&c.out[k]);
    pb_call_t nv;
    call_init(&nv, "svd_trunc", PB_F64, 'C');
    pb_tensor_ref(&nv.in[0], &Ar);
    set_opt(&nv, "maxrank", r);
    assert_int_equal(reverse_with(&nv, cot, g2, &w, &err), 0);
    double diff = 0, size = 0;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            diff = fmax(diff, fabs(creal(get(&g1[0], (size_t)i, (size_t)j) - get(&g2[0], (size_t)i, (size_t)j))));
            size = fmax(size, fabs(creal(get(&g1[0], (size_t)i, (size_t)j))));
        }
    assert_true(diff > 1e-3 * size);
    pb_tensor_clear(&g1[0]);
    pb_tensor_clear(&g2[0]);
    pb_tensor_clear(&cot[0]);
    pb_tensor_clear(&Ar);
    for (int k = 0; k < PB_MAX_IO; k++)
        pb_tensor_clear(&nv.out[k]);
    pb_call_clear(&nv);
    pb_call_clear(&c);
}

/* ---- errors ---- */

static int forward_rc(const char *op, pb_dtype_t d, int m, int n, int kind, double nan_at, pb_err_t *err)
{
    pb_call_t c;
    call_init(&c, op, d, 'C');
    make_A(&c.in[0], d, m, n, 'C', kind);
    if (nan_at >= 0)
        set(&c.in[0], 0, 0, nan_at > 0 ? INFINITY : NAN);
    pb_call_defaults(&c);
    int rc = c.op->validate(&c, err);
    if (rc == 0)
        rc = pb_op_run_forward(&c, NULL, err);
    pb_call_clear(&c);
    return rc;
}

/* validate() of op on an A of shape (m, n) with no data: the size checks
 * read the shape alone. */
static int validate_shape(const char *op, uint64_t m, uint64_t n, pb_err_t *err)
{
    pb_call_t c;
    call_init(&c, op, PB_F64, 'C');
    c.in[0].dtype = PB_F64;
    c.in[0].rank = 2;
    c.in[0].shape[0] = m;
    c.in[0].shape[1] = n;
    c.in[0].order = 'C';
    pb_call_defaults(&c);
    int rc = c.op->validate(&c, err);
    pb_call_clear(&c);
    return rc;
}

/* LAPACK's 32-bit indices bound the sizes (pb__fz_check): a tall-skinny A
 * may be far longer than any square matrix, except for the ops that make a
 * square matrix of its long side. */
static void size_limits(void **state)
{
    (void)state;
    pb_err_t err = {0};
    static const char *const thin[] = {"qr_compact", "svd_compact", "svd_vals", "svd_trunc", "left_polar"};
    for (size_t i = 0; i < sizeof thin / sizeof thin[0]; i++) {
        assert_int_equal(validate_shape(thin[i], 50000, 2, &err), 0);
        assert_int_equal(validate_shape(thin[i], 30000000, 2, &err), 0);
        /* (m + 64)·(n + 64) reaches 2^31, and shapes whose product overflows */
        assert_int_equal(validate_shape(thin[i], 30000000, 8, &err), PB_EINVALID_ARGUMENT);
        assert_non_null(strstr(err.message, "32-bit indices"));
        assert_int_equal(validate_shape(thin[i], (uint64_t)1 << 40, (uint64_t)1 << 40, &err), PB_EINVALID_ARGUMENT);
        assert_int_equal(validate_shape(thin[i], (uint64_t)1 << 31, 1, &err), PB_EINVALID_ARGUMENT);
    }
    assert_int_equal(validate_shape("lq_compact", 2, 50000, &err), 0);
    assert_int_equal(validate_shape("svd_vals", 2, 50000, &err), 0);
    assert_int_equal(validate_shape("right_polar", 2, 50000, &err), 0);
    static const char *const long_square[] = {"qr_full", "qr_null", "lq_full", "lq_null", "svd_full",
                                              "eigh_full", "eigh_vals", "eig_full", "eig_vals"};
    for (size_t i = 0; i < sizeof long_square / sizeof long_square[0]; i++) {
        bool sq = strncmp(long_square[i], "eig", 3) == 0;
        uint64_t n = sq ? PB_FZ_MAX_SIDE + 1 : 2;
        uint64_t m = strncmp(long_square[i], "lq", 2) == 0 ? n : PB_FZ_MAX_SIDE + 1;
        if (strncmp(long_square[i], "lq", 2) == 0)
            n = PB_FZ_MAX_SIDE + 1;
        assert_int_equal(validate_shape(long_square[i], m, n, &err), PB_EINVALID_ARGUMENT);
        assert_string_equal(err.arg, "inputs.A");
        assert_non_null(strstr(err.message, "at most 46276 rows and columns"));
        if (!sq) /* one row or column fewer is taken */
            assert_int_equal(validate_shape(long_square[i], m == 2 ? 2 : m - 1, n == 2 ? 2 : n - 1, &err), 0);
    }
    /* the bound itself: (s + 64)² < 2^31 <= (s + 65)² */
    assert_true((uint64_t)(PB_FZ_MAX_SIDE + 64) * (PB_FZ_MAX_SIDE + 64) < (uint64_t)1 << 31);
    assert_true((uint64_t)(PB_FZ_MAX_SIDE + 65) * (PB_FZ_MAX_SIDE + 65) >= (uint64_t)1 << 31);
}

static void errors(void **state)
{
    (void)state;
    pb_err_t err = {0};
    for (int di = 0; di < 4; di++) {
        pb_dtype_t d = dtypes[di];
        assert_int_equal(forward_rc("eigh_full", d, 5, 6, HERMITIAN, -1, &err), PB_ESHAPE_MISMATCH);
        assert_string_equal(err.arg, "inputs.A");
        assert_int_equal(forward_rc("eig_vals", d, 6, 5, RANDOM, -1, &err), PB_ESHAPE_MISMATCH);
        assert_int_equal(forward_rc("eigh_vals", d, 6, 6, RANDOM, -1, &err), PB_EINVALID_ARGUMENT);
        assert_non_null(strstr(err.message, "Hermitian"));
        assert_int_equal(forward_rc("left_polar", d, 5, 6, RANDOM, -1, &err), PB_ESHAPE_MISMATCH);
        assert_int_equal(forward_rc("right_polar", d, 6, 5, RANDOM, -1, &err), PB_ESHAPE_MISMATCH);
        for (size_t o = 0; o < sizeof all_ops / sizeof all_ops[0]; o++) {
            int n = strcmp(all_ops[o], "left_polar") == 0 ? 5 : 6;
            for (int inf = 0; inf < 2; inf++) {
                assert_int_equal(forward_rc(all_ops[o], d, 6, n, is_eigh(all_ops[o]) ? HERMITIAN : RANDOM, inf, &err),
                                 PB_ENUMERICAL);
                assert_non_null(strstr(err.message, "NaN"));
            }
        }
    }
    /* a rank-3 tensor, a negative maxrank or tolerance */
    pb_call_t c;
    call_init(&c, "qr_compact", PB_F64, 'C');
    uint64_t s3[3] = {2, 2, 2};
    assert_int_equal(pb_tensor_alloc(&c.in[0], PB_F64, 3, s3, 'C', true), 0);
    pb_call_defaults(&c);
    assert_int_equal(c.op->validate(&c, &err), PB_ESHAPE_MISMATCH);
    pb_call_clear(&c);
    call_init(&c, "svd_trunc", PB_F64, 'C');
    make_A(&c.in[0], PB_F64, 4, 4, 'C', RANDOM);
    set_opt(&c, "maxrank", -1);
    pb_call_defaults(&c);
    assert_int_equal(c.op->validate(&c, &err), PB_EINVALID_ARGUMENT);
    assert_string_equal(err.arg, "options.maxrank");
    pb_call_clear(&c);
    call_init(&c, "svd_compact", PB_F64, 'C');
    make_A(&c.in[0], PB_F64, 4, 4, 'C', RANDOM);
    set_opt(&c, "rank_atol", -1);
    pb_call_defaults(&c);
    assert_int_equal(c.op->validate(&c, &err), PB_EINVALID_ARGUMENT);
    pb_call_clear(&c);
}

/* ---- LAPACK failures (drivers made to fail by lapack_fault.c) ---- */

/* A LAPACK failure as the contract reports it: numerical_error on
 * inputs.A (or the tape), naming the driver, with its info. */
static void assert_lapack_error(int rc, const pb_err_t *err, const char *driver, int info)
{
    if (rc != PB_ENUMERICAL)
        fail_msg("%s made to fail: rc %d (%s)", driver, rc, rc ? err->message : "no error");
    assert_true(err->has_info);
    assert_int_equal(err->info, info);
    if (strstr(err->message, driver) == NULL)
        fail_msg("the message does not name %s: %s", driver, err->message);
}

static void lapack_failures(void **state)
{
    (void)state;
    char spec[128], name[16];
    pb_err_t err = {0};
    for (int di = 0; di < 4; di++) {
        pb_dtype_t d = dtypes[di];
        char L = lp_letter(d);
        if (test_dev.kind == PB_DEV_CUDA) {
            /* on a GPU, cuSOLVER's gesvd alone: its failure is the op's */
            snprintf(spec, sizeof spec, "%cgesvd=2", L);
            lapack_fault_set(spec);
            static const char *const gpu_svd[] = {"svd_compact", "svd_vals", "svd_trunc", "left_polar", "right_polar"};
            for (int o = 0; o < 5; o++)
                for (int wide = 0; wide < 2; wide++) {
                    if ((o == 3 && wide) || (o == 4 && !wide)) /* W·P: m ≥ n; P·Wh: m ≤ n */
                        continue;
                    assert_lapack_error(forward_rc(gpu_svd[o], d, wide ? 5 : 7, wide ? 7 : 5, RANDOM, -1, &err), &err,
                                        "gesvd", 2);
                    assert_non_null(strstr(err.message, "cuSOLVER"));
                }
        }
        cpu_drivers = true; /* the rest: LAPACK's drivers, on the CPU */
        /* gesdd fails: the SVD comes from gesvd, the same as gesdd's */
        uint64_t saved = rng;
        pb_call_t ref, c;
        call_init(&ref, "svd_compact", d, 'F');
        make_A(&ref.in[0], d, 9, 7, 'F', RANDOM);
        lapack_fault_set("");
        run_forward(&ref);
        snprintf(name, sizeof name, "%cgesdd", L);
        assert_int_equal(lapack_fault_calls(name), 1);
        rng = saved;
        call_init(&c, "svd_compact", d, 'F');
        make_A(&c.in[0], d, 9, 7, 'F', RANDOM);
        snprintf(spec, sizeof spec, "%cgesdd=4", L);
        lapack_fault_set(spec);
        run_forward(&c);
        snprintf(name, sizeof name, "%cgesvd", L);
        assert_int_equal(lapack_fault_calls(name), 1);
        double tol = 100 * eps_of(d) * 9;
        for (int o = 0; o < 3; o++)
            for (size_t i = 0; i < rows(&ref.out[o]); i++)
                for (size_t j = 0; j < cols(&ref.out[o]); j++)
                    if (cabs(get(&c.out[o], i, j) - get(&ref.out[o], i, j)) > tol)
                        fail_msg("%s output %d (%zu, %zu): gesvd's differs from gesdd's", pb_dtype_name(d), o, i, j);
        call_free(&c);
        /* svd_vals with no tape computes the values alone (gesdd 'N'):
         * the same values as with vectors; when gesdd fails, gesvd's,
         * from A reloaded; both failing is gesvd's error. */
        for (int fail = 0; fail < 3; fail++) {
            rng = saved;
            call_init(&c, "svd_vals", d, 'F');
            c.taped = false;
            make_A(&c.in[0], d, 9, 7, 'F', RANDOM);
            snprintf(spec, sizeof spec, fail == 0 ? "" : fail == 1 ? "%cgesdd=4" : "%cgesdd=4,%cgesvd=2", L, L);
            lapack_fault_set(spec);
            pb_call_defaults(&c);
            int rc = c.op->validate(&c, &err);
            if (rc == 0)
                rc = pb_op_run_forward(&c, NULL, &err);
            if (fail == 2)
                assert_lapack_error(rc, &err, "gesvd", 2);
            else {
                assert_int_equal(rc, 0);
                snprintf(name, sizeof name, "%cgesvd", L);
                assert_int_equal(lapack_fault_calls(name), fail);
                for (size_t i = 0; i < 7; i++)
                    if (cabs(get(&c.out[0], i, 0) - get(&ref.out[1], i, 0)) > tol)
                        fail_msg("%s svd_vals %zu (gesdd %s): %g, with vectors %g", pb_dtype_name(d), i,
                                 fail ? "failed" : "ok", creal(get(&c.out[0], i, 0)), creal(get(&ref.out[1], i, 0)));
            }
            call_free(&c);
        }
        call_free(&ref);
        /* both fail: numerical_error with gesvd's info, for every op
         * through the SVD */
        snprintf(spec, sizeof spec, "%cgesdd=4,%cgesvd=2", L, L);
        lapack_fault_set(spec);
        static const char *const svd_ops[] = {"svd_compact", "svd_full", "svd_vals", "svd_trunc", "left_polar",
                                              "right_polar"};
        for (size_t o = 0; o < sizeof svd_ops / sizeof svd_ops[0]; o++) {
            bool right = strcmp(svd_ops[o], "right_polar") == 0;
            assert_lapack_error(forward_rc(svd_ops[o], d, right ? 5 : 7, right ? 7 : 5, RANDOM, -1, &err), &err,
                                "gesvd", 2);
            assert_string_equal(err.arg, "inputs.A");
        }
        /* gesvd rejecting an argument after gesdd failed: gesvd's error */
        snprintf(spec, sizeof spec, "%cgesdd=4,%cgesvd=-3", L, L);
        lapack_fault_set(spec);
        for (int vals = 0; vals < 2; vals++) {
            assert_int_equal(forward_rc(vals ? "svd_vals" : "svd_compact", d, 7, 5, RANDOM, -1, &err), PB_EINTERNAL);
            snprintf(name, sizeof name, "%cgesvd", L);
            if (strstr(err.message, name) == NULL || strstr(err.message, "rejected argument 3") == NULL)
                fail_msg("%s: %s", vals ? "svd_vals" : "svd_compact", err.message);
        }
        /* the eigensolvers */
        snprintf(spec, sizeof spec, "%c%s=3", L, cplx(d) ? "heevd" : "syevd");
        lapack_fault_set(spec);
        assert_lapack_error(forward_rc("eigh_full", d, 6, 6, HERMITIAN, -1, &err), &err, cplx(d) ? "heevd" : "syevd",
                            3);
        assert_lapack_error(forward_rc("eigh_vals", d, 6, 6, HERMITIAN, -1, &err), &err, cplx(d) ? "heevd" : "syevd",
                            3);
        snprintf(spec, sizeof spec, "%cgeev=5", L);
        lapack_fault_set(spec);
        assert_lapack_error(forward_rc("eig_full", d, 6, 6, RANDOM, -1, &err), &err, "geev", 5);
        assert_lapack_error(forward_rc("eig_vals", d, 6, 6, RANDOM, -1, &err), &err, "geev", 5);
        /* QR and LQ: the drivers report info > 0 the same way */
        snprintf(spec, sizeof spec, "%cgeqrf=1,%cgelqf=1", L, L);
        lapack_fault_set(spec);
        assert_lapack_error(forward_rc("qr_compact", d, 6, 4, RANDOM, -1, &err), &err, "geqrf", 1);
        assert_lapack_error(forward_rc("lq_full", d, 4, 6, RANDOM, -1, &err), &err, "gelqf", 1);
        /* in the reverse: eig's LU of V (a defective A), in complex
         * arithmetic for a real A too */
        snprintf(spec, sizeof spec, "%cgetrf=2", d == PB_F64 ? 'z' : d == PB_F32 ? 'c' : L);
        lapack_fault_set(spec);
        call_init(&c, "eig_full", d, 'C');
        make_A(&c.in[0], d, 5, 5, 'C', RANDOM);
        pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
        uint64_t vs[2] = {5, 5};
        assert_int_equal(pb_tensor_alloc(&cot[1], cplx(d) ? d : d == PB_F32 ? PB_C64 : PB_C128, 2, vs, 'C', true), 0);
        set(&cot[1], 1, 2, 1.0);
        pb_warnings_t w = {0};
        assert_lapack_error(reverse_with(&c, cot, grad, &w, &err), &err, "getrf", 2);
        assert_non_null(strstr(err.message, "defective"));
        pb_tensor_clear(&cot[1]);
        call_free(&c);
        /* and qr_null's Cholesky of R₁R₁ᴴ, for a rank-deficient A */
        snprintf(spec, sizeof spec, "%cpotrf=1", L);
        lapack_fault_set(spec);
        call_init(&c, "qr_null", d, 'C');
        make_A(&c.in[0], d, 11, 8, 'C', LOWRANK);
        uint64_t ns[2] = {11, 3};
        assert_int_equal(pb_tensor_alloc(&cot[0], d, 2, ns, 'C', true), 0);
        set(&cot[0], 4, 1, 1.0);
        assert_lapack_error(reverse_with(&c, cot, grad, &w, &err), &err, "potrf", 1);
        pb_tensor_clear(&cot[0]);
        call_free(&c);
        cpu_drivers = false;
    }
    lapack_fault_set("");
}

/* LAPACK's leading dimension for m rows of dtype d, as factor_common.h
 * states it: an odd number of 64-byte lines from 512 bytes a column. */
static int padded_ld(pb_dtype_t d, int m)
{
    size_t es = pb_dtype_size(d), bytes = (size_t)m * es, lines = (bytes + 63) / 64;
    return bytes < 512 ? m : (int)((lines | 1) * 64 / es);
}

static void expect_lda(const char *driver, pb_dtype_t d, int m, const char *what)
{
    char name[16];
    snprintf(name, sizeof name, "%c%s", lp_letter(d), driver);
    if (lapack_fault_calls(name) == 0 || lapack_fault_lda(name) != padded_ld(d, m))
        fail_msg("%s: %s called %d times, last with lda %d (%d rows: want %d)", what, name, lapack_fault_calls(name),
                 lapack_fault_lda(name), m, padded_ld(d, m));
}

/* Matrices whose columns take 512 bytes or more, which LAPACK's drivers
 * get as padded copies (FZ(pad)): the leading dimension each driver is
 * given, and every op through them: the forward properties, the pullback
 * against finite differences, svd_vals without a tape, and the SVD's
 * gesvd fallback. */
static void padded_work(void **state)
{
    (void)state;
    assert_int_equal(pb__fz_lapack_ld_d(1024), 1032);
    assert_int_equal(pb__fz_lapack_ld_d(1000), 1000); /* 125 lines already */
    assert_int_equal(pb__fz_lapack_ld_d(63), 63);
    assert_int_equal(pb__fz_lapack_ld_d(64), 72);
    assert_int_equal(pb__fz_lapack_ld_s(1024), 1040);
    assert_int_equal(pb__fz_lapack_ld_z(512), 516);
    assert_int_equal(pb__fz_lapack_ld_c(100), 104);
    assert_int_equal(pb__fz_lapack_ld_c(0), 1);
    for (int di = 0; di < 4; di++) {
        pb_dtype_t d = dtypes[di];
        int mp = 512 / (int)pb_dtype_size(d) + 1; /* the fewest rows padded */
        char what[96], spec[64];
        lapack_fault_set("");
        /* Under valgrind (run_all's memcheck stage, some fifty times
         * slower) f32 and c64 skip the forward properties and the
         * finite-difference checks: their instances are the same code as
         * f64's and c128's, whose runs cover the memory they touch, and
         * the release run checks their numbers. */
        bool all = !(RUNNING_ON_VALGRIND && single(d));
        if (all)
            forward_props_at(d, mp + 2);
        for (size_t o = 0; all && o < sizeof all_ops / sizeof all_ops[0]; o++) {
            const char *name = all_ops[o];
            bool wide = strcmp(name, "right_polar") == 0 || (strcmp(name, "left_polar") != 0 && o % 2);
            int m = wide ? mp : mp + 3, n = square_only(name) ? m : wide ? mp + 3 : mp;
            char order = (o + (size_t)di) % 2 ? 'F' : 'C';
            pb_call_t c;
            call_init(&c, name, d, order);
            make_A(&c.in[0], d, m, n, order, is_eigh(name) ? HERMITIAN : RANDOM);
            if (strstr(name, "trunc"))
                set_opt(&c, "maxrank", 7);
            snprintf(what, sizeof what, "%s %s %dx%d %c", name, pb_dtype_name(d), m, n, order);
            lapack_fault_set("");
            fd_check(&c, what);
            if (strncmp(name, "qr", 2) == 0 || strcmp(name, "lq_null") == 0) { /* lq_null: qr_null of Aᴴ */
                expect_lda("geqrf", d, name[0] == 'l' ? n : m, what);
                expect_lda(cplx(d) ? "ungqr" : "orgqr", d, name[0] == 'l' ? n : m, what);
            } else if (strncmp(name, "lq", 2) == 0)
                expect_lda("gelqf", d, m, what);
            else if (strncmp(name, "svd", 3) == 0 || strstr(name, "polar"))
                expect_lda("gesdd", d, m, what);
            else if (is_eigh(name)) /* syevd and heevd gain nothing: unpadded */
                assert_int_equal(lapack_fault_lda(cplx(d) ? (single(d) ? "cheevd" : "zheevd")
                                                          : (single(d) ? "ssyevd" : "dsyevd")),
                                 m);
            else
                expect_lda("geev", d, m, what);
            pb_call_clear(&c);
        }
        /* svd_vals without a tape (gesdd without vectors), and the gesvd
         * fallback of both, against svd_compact's values */
        int m = mp + 3, n = mp;
        uint64_t saved = rng;
        pb_call_t ref, c;
        call_init(&ref, "svd_compact", d, 'F');
        make_A(&ref.in[0], d, m, n, 'F', RANDOM);
        run_forward(&ref);
        double tol = 100 * eps_of(d) * m * creal(get(&ref.out[1], 0, 0));
        for (int fail = 0; fail < 2; fail++)
            for (int vals = 0; vals < 2; vals++) {
                rng = saved;
                call_init(&c, vals ? "svd_vals" : "svd_compact", d, 'F');
                c.taped = !vals;
                make_A(&c.in[0], d, m, n, 'F', RANDOM);
                snprintf(spec, sizeof spec, "%cgesdd=4", lp_letter(d));
                lapack_fault_set(fail ? spec : "");
                run_forward(&c);
                snprintf(what, sizeof what, "%s %s %dx%d%s", vals ? "svd_vals" : "svd_compact", pb_dtype_name(d), m,
                         n, fail ? ", gesdd failing" : "");
                expect_lda(fail ? "gesvd" : "gesdd", d, m, what);
                for (int i = 0; i < n; i++)
                    if (cabs(get(&c.out[vals ? 0 : 1], (size_t)i, 0) - get(&ref.out[1], (size_t)i, 0)) > tol)
                        fail_msg("%s: S_%d %g, gesdd with vectors %g", what, i,
                                 creal(get(&c.out[vals ? 0 : 1], (size_t)i, 0)), creal(get(&ref.out[1], (size_t)i, 0)));
                if (!vals)
                    assert_true(recon_err(&c.in[0], &c.out[0], &c.out[1], &c.out[2]) <= tol * 10);
                call_free(&c);
            }
        call_free(&ref);
    }
    lapack_fault_set("");
}

/* eigh_vals, eig_vals and svd_vals without a tape compute the values
 * alone (their drivers without vectors): the same values as with a tape,
 * to rounding, through the driver's job 'N'. */
static void values_alone(void **state)
{
    (void)state;
    static const char *const ops[3] = {"eigh_vals", "eig_vals", "svd_vals"};
    for (int di = 0; di < 4; di++)
        for (int o = 0; o < 3; o++) {
            pb_dtype_t d = dtypes[di];
            bool eig = o == 1;
            /* 40 rows and, from 512 bytes a column, more: padded too */
            int m = di % 2 ? 40 : 512 / (int)pb_dtype_size(d) + 3, n = o == 2 ? m - 3 : m;
            char drv[16], what[96];
            /* on a GPU, the SVD is gesvd's, unpadded */
            bool gpu = on_gpu(ops[o]);
            snprintf(drv, sizeof drv, "%c%s", lp_letter(d),
                     o == 0 ? (cplx(d) ? "heevd" : "syevd") : eig ? "geev" : gpu ? "gesvd" : "gesdd");
            pb_call_t c[2];
            uint64_t saved = rng;
            for (int taped = 0; taped < 2; taped++) {
                rng = saved;
                call_init(&c[taped], ops[o], d, 'F');
                c[taped].taped = taped;
                make_A(&c[taped].in[0], d, m, n, 'F', o == 0 ? HERMITIAN : RANDOM);
                lapack_fault_set("");
                run_forward(&c[taped]);
                snprintf(what, sizeof what, "%s %s %dx%d%s", ops[o], pb_dtype_name(d), m, n, taped ? "" : " untaped");
                char want = taped ? (o == 2 ? 'S' : 'V') : 'N';
                if (lapack_fault_calls(drv) != 1 || lapack_fault_job(drv) != want)
                    fail_msg("%s: %s called %d times, last with job %c (want once with %c)", what, drv,
                             lapack_fault_calls(drv), lapack_fault_job(drv) ? lapack_fault_job(drv) : '0', want);
                if (o != 0 && !gpu)
                    expect_lda(eig ? "geev" : "gesdd", d, m, what);
            }
            const pb_tensor_t *v0 = &c[0].out[0], *v1 = &c[1].out[0];
            assert_int_equal(rows(v0), rows(v1));
            assert_int_equal(v0->dtype, v1->dtype);
            double big = 0;
            for (size_t i = 0; i < rows(v1); i++)
                big = fmax(big, cabs(get(v1, i, 0)));
            /* eig's values of a random A move by cond·eps: a looser bound */
            double tol = (eig ? 1e4 : 100) * eps_of(d) * m * big;
            for (size_t i = 0; i < rows(v1); i++)
                if (cabs(get(v0, i, 0) - get(v1, i, 0)) > tol)
                    fail_msg("%s %s: value %zu %g%+gi untaped, %g%+gi taped", ops[o], pb_dtype_name(d), i,
                             creal(get(v0, i, 0)), cimag(get(v0, i, 0)), creal(get(v1, i, 0)), cimag(get(v1, i, 0)));
            if (eig && !cplx(d)) /* a real A's pairs exactly conjugate, negative imaginary part first */
                for (size_t i = 0; i + 1 < rows(v0); i++)
                    if (cimag(get(v0, i, 0)) < 0) {
                        assert_true(get(v0, i + 1, 0) == conj(get(v0, i, 0)));
                        i++;
                    }
            call_free(&c[0]);
            call_free(&c[1]);
        }
    lapack_fault_set("");
}

/* Zero-size matrices give zero-size outputs and gradients. */
static void zero_size(void **state)
{
    (void)state;
    /* 0×3 and 3×0, and 0×100 and 100×0, whose 100 rows LAPACK's outputs
     * get padded (a full Q of 100 rows, say) */
    static const int shapes[4][2] = {{0, 3}, {3, 0}, {0, 100}, {100, 0}};
    for (size_t o = 0; o < sizeof all_ops / sizeof all_ops[0]; o++)
        for (int s = 0; s < 4; s++) {
            int m = shapes[s][0], n = shapes[s][1];
            if (square_only(all_ops[o]) && s > 0)
                continue;
            if (square_only(all_ops[o]))
                n = 0;
            if ((strcmp(all_ops[o], "left_polar") == 0 && m < n) || (strcmp(all_ops[o], "right_polar") == 0 && m > n))
                continue;
            pb_call_t c;
            call_init(&c, all_ops[o], PB_F64, 'C');
            make_A(&c.in[0], PB_F64, m, n, 'C', RANDOM);
            pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}};
            pb_warnings_t w = {0};
            pb_err_t err = {0};
            if (reverse_with(&c, cot, grad, &w, &err))
                fail_msg("%s on %dx%d: %s", all_ops[o], m, n, err.message);
            assert_int_equal(pb_tensor_count(&grad[0]), (size_t)(m * n));
            /* the full Q of an empty A: the identity */
            bool full_q =
                (strcmp(all_ops[o], "qr_full") == 0 && n == 0) || (strcmp(all_ops[o], "lq_full") == 0 && m == 0);
            const pb_tensor_t *Q = &c.out[strncmp(all_ops[o], "qr", 2) == 0 ? 0 : 1];
            for (size_t i = 0; full_q && i < rows(Q); i++)
                for (size_t j = 0; j < cols(Q); j++)
                    if (get(Q, i, j) != (i == j ? 1.0 : 0.0))
                        fail_msg("%s on %dx%d: Q(%zu, %zu) = %g", all_ops[o], m, n, i, j, creal(get(Q, i, j)));
            pb_tensor_clear(&grad[0]);
            call_free(&c);
        }
}

/* The tape holds exactly what validate announced. */
static void tape_sizes(void **state)
{
    (void)state;
    for (size_t o = 0; o < sizeof all_ops / sizeof all_ops[0]; o++)
        for (int di = 0; di < 4; di++) {
            const char *name = all_ops[o];
            int m = 7, n = square_only(name) ? 7 : strcmp(name, "left_polar") == 0 ? 5 : 9;
            pb_call_t c;
            call_init(&c, name, dtypes[di], 'F');
            make_A(&c.in[0], dtypes[di], m, n, 'F', is_eigh(name) ? HERMITIAN : RANDOM);
            c.wrt = 1;
            c.taped = true;
            pb_call_defaults(&c);
            pb_err_t err = {0};
            assert_int_equal(c.op->validate(&c, &err), 0);
            pb_tapedata_t t;
            assert_int_equal(pb_op_run_forward(&c, &t, &err), 0);
            if (pb_tapedata_bytes(&t) != c.tape_bytes)
                fail_msg("%s %s: tape %zu bytes, announced %zu", name, pb_dtype_name(dtypes[di]),
                         pb_tapedata_bytes(&t), c.tape_bytes);
            pb_tapedata_clear(&t);
            pb_call_clear(&c);
        }
}

/* The table as op.c gathers it from the families: every factorization
 * once, in the order `ops` has always listed them, each row's variant the
 * form its name says, and only eigh's rows projecting directions. */
static void table_rows(void **state)
{
    (void)state;
    static const struct {
        const char *name;
        int variant;
    } want[] = {
        {"qr_compact", FZ_COMPACT}, {"qr_full", FZ_FULL},    {"qr_null", FZ_NULL},   {"lq_compact", FZ_COMPACT},
        {"lq_full", FZ_FULL},       {"lq_null", FZ_NULL},    {"eigh_full", FZ_FULL}, {"eigh_vals", FZ_VALS},
        {"eigh_trunc", FZ_TRUNC},   {"eig_full", FZ_FULL},   {"eig_vals", FZ_VALS},  {"svd_compact", FZ_COMPACT},
        {"svd_full", FZ_FULL},      {"svd_vals", FZ_VALS},   {"svd_trunc", FZ_TRUNC}, {"left_polar", FZ_COMPACT},
        {"right_polar", FZ_COMPACT},
    };
    const int first = 4, n = (int)(sizeof want / sizeof want[0]); /* after fused_dense and the three tensor ops */
    assert_int_equal(pb_nops, first + n);
    for (int i = 0; i < n; i++) {
        const pb_op_t *op = pb_ops[first + i];
        assert_string_equal(op->name, want[i].name);
        assert_ptr_equal(pb_op_find(op->name, strlen(op->name)), op);
        assert_int_equal(op->variant, want[i].variant);
        assert_true(op->forward[PB_DEV_CPU] && op->reverse[PB_DEV_CPU] && op->validate);
        assert_true((op->fd_direction != NULL) == (strncmp(op->name, "eigh_", 5) == 0));
    }
}

/* ---- on a GPU (cuda mode) ---------------------------------------------------- */

/* max |a − b| over max |b| of two tensors of one shape, either order. */
static double rel_diff(const pb_tensor_t *a, const pb_tensor_t *b)
{
    double diff = 0, big = 0;
    for (size_t i = 0; i < rows(b); i++)
        for (size_t j = 0; j < cols(b); j++) {
            diff = fmax(diff, cabs(get(a, i, j) - get(b, i, j)));
            big = fmax(big, cabs(get(b, i, j)));
        }
    return diff == 0 ? 0 : diff / fmax(big, 1e-300);
}

/* Each GPU op, dtype and order against the CPU: outputs, a tape held in
 * device memory, and the gradient of random cotangents (its gauge part
 * too: the warnings agree).  The fake runs the CPU's LAPACK and kernels
 * (the SVD through gesvd where the CPU runs gesdd), so the results agree
 * to rounding; the bound is the (1e-12 in double, 1e-4 in
 * single), which a real GPU's run (tests/gpu/run.sh) is held to as well.
 * Tall and wide matrices (cuSOLVER's gesvd takes a wide one transposed),
 * m = 0 and a truncation to nothing are in it. */
static void gpu_parity(void **state)
{
    (void)state;
    if (test_dev.kind != PB_DEV_CUDA)
        skip();
    int ran = 0;
    for (size_t o = 0; o < sizeof all_ops / sizeof all_ops[0]; o++)
        for (int di = 0; di < 4; di++)
            for (int s = 0; s < 4; s++) {
                const pb_op_t *op = op_named(all_ops[o]);
                if (!(op->devices & (1u << PB_DEV_CUDA)))
                    continue;
                pb_dtype_t d = dtypes[di];
                bool herm = is_eigh(op->name);
                int m = s == 3 ? 0 : 19, n = herm || s == 3 ? m : s == 1 ? 13 : 23;
                if (strcmp(op->name, "left_polar") == 0 && n > m) /* W·P takes m ≥ n, P·Wh m ≤ n */
                    n = s == 2 ? m : 17;
                if (strcmp(op->name, "right_polar") == 0 && n < m)
                    n = m;
                char order = s % 2 ? 'F' : 'C';
                double tol = single(d) ? 1e-4 : 1e-12;
                pb_call_t on[2];
                pb_tapedata_t tape[2];
                pb_tensor_t grad[2][PB_MAX_IO + 2], cot[PB_MAX_IO];
                pb_warnings_t warn[2];
                memset(grad, 0, sizeof grad);
                memset(cot, 0, sizeof cot);
                memset(warn, 0, sizeof warn);
                char what[96];
                snprintf(what, sizeof what, "%s %s %dx%d %c", op->name, pb_dtype_name(d), m, n, order);
                uint64_t seed = rng; /* the same A on both */
                for (int g = 0; g < 2; g++) {
                    pb_err_t err = {0};
                    rng = seed;
                    call_init(&on[g], op->name, d, order);
                    if (g == 0)
                        on[g].device = (pb_device_t){PB_DEV_CPU, 0};
                    make_A(&on[g].in[0], d, m, n, order, herm ? HERMITIAN : RANDOM);
                    if (op->variant == FZ_TRUNC)
                        set_opt(&on[g], "maxrank", s == 2 ? 0 : 7);
                    on[g].wrt = 1;
                    on[g].taped = true;
                    pb_call_defaults(&on[g]);
                    if (op->validate(&on[g], &err) || pb_op_run_forward(&on[g], &tape[g], &err))
                        fail_msg("%s on %s: %s", what, g ? "cuda:0" : "the CPU", err.message);
                }
                for (int k = 0; k < op->noutputs; k++) {
                    if (!pb_tensor_same_shape(&on[1].out[k], &on[0].out[k]))
                        fail_msg("%s: output %s has another shape than the CPU's", what, op->outputs[k]);
                    double r = rel_diff(&on[1].out[k], &on[0].out[k]);
                    if (!(r <= tol))
                        fail_msg("%s: output %s differs from the CPU's by %g", what, op->outputs[k], r);
                    /* random cotangents, with a gauge part: the phase of V */
                    pb_tensor_t *ct = &cot[k];
                    uint64_t sh[2] = {rows(&on[0].out[k]), cols(&on[0].out[k])};
                    assert_int_equal(pb_tensor_alloc(ct, on[0].out[k].dtype, on[0].out[k].rank, sh, 'C', true), 0);
                    for (size_t i = 0; i < sh[0]; i++)
                        for (size_t j = 0; j < (on[0].out[k].rank == 2 ? sh[1] : 1); j++)
                            set(ct, i, j, nrand() + (cplx(ct->dtype) ? I * nrand() : 0));
                }
                for (int i = 0; i < PB_MAX_SAVED; i++)
                    if (tape[1].saved[i].storage) {
                        assert_int_equal(tape[1].saved[i].storage->kind, PB_STORAGE_DEVICE);
                        assert_int_equal(tape[1].saved[i].storage->device.kind, PB_DEV_CUDA);
                    }
                for (int g = 0; g < 2; g++) {
                    pb_err_t err = {0};
                    if (pb_op_run_reverse(&tape[g], cot, grad[g], order, &warn[g], &err))
                        fail_msg("%s: reverse on %s: %s", what, g ? "cuda:0" : "the CPU", err.message);
                    if (grad[g][0].storage) /* host memory, downloaded */
                        assert_int_equal(grad[g][0].storage->kind, PB_STORAGE_HEAP);
                }
                double r = rel_diff(&grad[1][0], &grad[0][0]);
                if (!(r <= tol))
                    fail_msg("%s: the gradient differs from the CPU's by %g", what, r);
                assert_int_equal(warn[1].n, warn[0].n);
                for (int g = 0; g < 2; g++) {
                    for (int k = 0; k < PB_MAX_IO + 2; k++)
                        pb_tensor_clear(&grad[g][k]);
                    pb_tapedata_clear(&tape[g]);
                    call_free(&on[g]);
                }
                for (int k = 0; k < PB_MAX_IO; k++)
                    pb_tensor_clear(&cot[k]);
                ran++;
            }
    assert_int_equal(ran, 8 * 4 * 4);
}

int main(int argc, char **argv)
{
    if (fake_gpu_mode(argc, argv)) {
#define T(f) cmocka_unit_test_teardown(f, fake_gpu_after)
        const struct CMUnitTest gpu[] = {
            T(gpu_parity),      T(forward_props), T(fd_all),      T(degenerate_eigh), T(truncations),
            T(trunc_not_naive), T(errors),        T(zero_size),   T(tape_sizes),      T(lapack_failures),
            T(tiny_scales),     T(extreme_scales), T(values_alone),
        };
        return cmocka_run_group_tests_name("cuda.factor (the host fake's cuda:0)", gpu, NULL, NULL);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(forward_props),   cmocka_unit_test(fd_all),          cmocka_unit_test(rank_deficient),
        cmocka_unit_test(degenerate_eigh), cmocka_unit_test(degenerate_svd),  cmocka_unit_test(truncations),
        cmocka_unit_test(trunc_not_naive), cmocka_unit_test(errors),          cmocka_unit_test(zero_size),
        cmocka_unit_test(tape_sizes),      cmocka_unit_test(qr_blocks),       cmocka_unit_test(lapack_failures),
        cmocka_unit_test(padded_work),     cmocka_unit_test(tiny_scales),     cmocka_unit_test(extreme_scales),  cmocka_unit_test(qr_rescaled),
        cmocka_unit_test(values_alone),      cmocka_unit_test(size_limits),
        cmocka_unit_test(table_rows),      cmocka_unit_test(gpu_parity),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
