/* unit.tensorops: tensorcontract, tensoradd, tensortrace.
 *
 * Forward against a naive multi-index reference (in double complex) for
 * every dtype and C/F orders of inputs and outputs; reverse against
 * finite differences (pb_check_run: a fourth-order central difference of
 * the forward taken in double precision, error relative to ‖x̄‖·‖v‖) for
 * every wrt subset, every (conjA, conjB), alpha and beta real and complex,
 * zero and nonzero; TensorOperations' own cases; random permutations of
 * random ranks up to 6; the einsum form against the explicit one; tape
 * sizes; every rejection.
 *
 * Tolerances (relative): f64 and c128 gradients 1e-6 (they come out near
 * 1e-12), f32 and c64 gradients 1e-3 (single rounding of sums of up to a
 * few hundred terms, measured against the exact derivative: tensor
 * gradients come out near 1e-6, but ᾱ and β̄ are single inner products
 * whose terms may cancel, and reach 2e-4 relative to their own size on
 * some random draws); forward f64
 * 1e-12, f32 1e-5, relative to the largest |reference| + 1.
 *
 * With the argument "cuda" (meson: cuda.tensorops) the op tests run the
 * ops on cuda:0 of the GPU backend's host fake (cuda/fake.h) instead, the
 * finite differences too, and check that no device byte is left behind. */
#include "kernels/cmplx.h"
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "fake_gpu.h"

#include "kernels/check.h"
#include "kernels/contract.h"
#include "kernels/op.h"
#include "kernels/strided.h"

extern const pb_op_t pb_op_tensorcontract, pb_op_tensoradd, pb_op_tensortrace;
enum { TC_PA, TC_PB, TC_PAB, TC_CONJA, TC_CONJB, TC_ALPHA, TC_BETA, TC_SPEC };
enum { TA_PA, TA_CONJA, TA_ALPHA, TA_BETA };
enum { TT_P, TT_Q, TT_CONJA, TT_ALPHA, TT_BETA };

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double urand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}
static int irand(int n) { return (int)((urand() + 1.0) * 0.5 * n) % n; }

static const pb_dtype_t dtypes[4] = {PB_F32, PB_F64, PB_C64, PB_C128};

static double complex get(const pb_tensor_t *t, size_t i)
{
    const void *p = pb_tensor_data(t);
    switch (t->dtype) {
    case PB_F32: return ((const float *)p)[i];
    case PB_F64: return ((const double *)p)[i];
    case PB_C64: return ((const float complex *)p)[i];
    default: return ((const double complex *)p)[i];
    }
}

static void set(pb_tensor_t *t, size_t i, double complex v)
{
    void *p = pb_tensor_data(t);
    switch (t->dtype) {
    case PB_F32: ((float *)p)[i] = (float)creal(v); break;
    case PB_F64: ((double *)p)[i] = creal(v); break;
    case PB_C64: ((float complex *)p)[i] = (float complex)v; break;
    default: ((double complex *)p)[i] = v; break;
    }
}

static void make(pb_tensor_t *t, pb_dtype_t d, int rank, const uint64_t *shape, char order)
{
    assert_int_equal(pb_tensor_alloc(t, d, rank, shape, order, false), 0);
    size_t n = pb_tensor_count(t);
    for (size_t i = 0; i < n; i++)
        set(t, i, CMPLX(urand(), urand()));
}

/* Element at a multi-index. */
static double complex at(const pb_tensor_t *t, const uint64_t *idx)
{
    int64_t st[PB_MAX_RANK];
    pb_dense_strides(t->rank, t->shape, t->order, st);
    int64_t off = 0;
    for (int k = 0; k < t->rank; k++)
        off += (int64_t)idx[k] * st[k];
    return get(t, (size_t)off);
}

static bool next(uint64_t *idx, const uint64_t *shape, int rank)
{
    for (int k = 0; k < rank; k++) {
        if (++idx[k] < shape[k])
            return true;
        idx[k] = 0;
    }
    return false;
}

static bool empty(const uint64_t *shape, int rank)
{
    for (int k = 0; k < rank; k++)
        if (shape[k] == 0)
            return true;
    return false;
}

static double tol_fwd(pb_dtype_t d) { return d == PB_F32 || d == PB_C64 ? 1e-5 : 1e-12; }
static double tol_grad(pb_dtype_t d) { return d == PB_F32 || d == PB_C64 ? 1e-3 : 1e-6; }

/* A call of op on inputs in[] (NULL: absent), options set by the caller. */
static void call_init(pb_call_t *c, const pb_op_t *op, pb_dtype_t d, char order)
{
    memset(c, 0, sizeof *c);
    c->op = op;
    c->device = test_dev;
    c->dtype = d;
    c->order = order;
}

static void opt_axes(pb_optval_t *o, const int *a, int na)
{
    o->given = true;
    o->nax[0] = na;
    for (int i = 0; i < na; i++)
        o->ax[0][i] = (signed char)a[i];
}

static void opt_axes2(pb_optval_t *o, const int *a, int na, const int *b, int nb)
{
    opt_axes(o, a, na);
    o->nax[1] = nb;
    for (int i = 0; i < nb; i++)
        o->ax[1][i] = (signed char)b[i];
}

static void opt_scalar(pb_optval_t *o, double re, double im, bool cplx)
{
    o->given = true;
    o->re = re;
    o->im = im;
    o->cplx = cplx;
}

static void opt_bool(pb_optval_t *o, bool b)
{
    o->given = true;
    o->b = b;
}

/* ---- naive references ---- */

static double complex opx(double complex x, bool conj_, pb_dtype_t d)
{
    return conj_ && (d == PB_C64 || d == PB_C128) ? conj(x) : x;
}

/* The reference of tensorcontract for the call's options. */
static double ref_contract_err(const pb_call_t *c, const pb_cspec_t *s)
{
    const pb_tensor_t *A = &c->in[0], *B = &c->in[1], *C = &c->in[2], *Y = &c->out[0];
    double complex alpha = CMPLX(c->opt[TC_ALPHA].re, c->opt[TC_ALPHA].im);
    double complex beta = CMPLX(c->opt[TC_BETA].re, c->opt[TC_BETA].im);
    uint64_t oi[PB_MAX_RANK] = {0}, kshape[PB_MAX_RANK], ki[PB_MAX_RANK];
    for (int v = 0; v < s->nc; v++)
        kshape[v] = A->shape[(int)s->cA[v]];
    double worst = 0, scale = 1;
    if (empty(Y->shape, Y->rank))
        return 0;
    do {
        uint64_t m[2 * PB_MAX_RANK], ai[PB_MAX_RANK], bi[PB_MAX_RANK];
        for (int d = 0; d < Y->rank; d++)
            m[(int)s->pAB[d]] = oi[d];
        for (int t = 0; t < s->noA; t++)
            ai[(int)s->oA[t]] = m[t];
        for (int u = 0; u < s->noB; u++)
            bi[(int)s->oB[u]] = m[s->noA + u];
        double complex sum = 0;
        memset(ki, 0, sizeof ki);
        if (!empty(kshape, s->nc))
            do {
                for (int v = 0; v < s->nc; v++) {
                    ai[(int)s->cA[v]] = ki[v];
                    bi[(int)s->cB[v]] = ki[v];
                }
                sum += opx(at(A, ai), c->opt[TC_CONJA].b, A->dtype) * opx(at(B, bi), c->opt[TC_CONJB].b, B->dtype);
            } while (next(ki, kshape, s->nc));
        double complex want = alpha * sum + (beta != 0 ? beta * at(C, oi) : 0);
        scale = fmax(scale, cabs(want));
        worst = fmax(worst, cabs(want - at(Y, oi)));
    } while (next(oi, Y->shape, Y->rank));
    return worst / scale;
}

/* Run forward (taped with wrt) and compare with the reference; then the
 * finite-difference check.  Returns nothing: asserts. */
static void run_contract(pb_call_t *c, unsigned wrt, const char *what)
{
    pb_err_t err = {0};
    c->wrt = wrt;
    c->taped = wrt != 0;
    pb_call_defaults(c);
    int rc = pb_op_tensorcontract.validate(c, &err);
    if (rc)
        fail_msg("%s: validate: %s", what, err.message);
    pb_tapedata_t tape;
    assert_int_equal(pb_op_run_forward(c, c->taped ? &tape : NULL, &err), 0);
    pb_cspec_t s = {0};
    /* the explicit options, or the spec turned into them, by the op */
    assert_int_equal(pb_tensorcontract_spec(c->opt, &c->in[0], &c->in[1], &s, &err), 0);
    double e = ref_contract_err(c, &s);
    if (e > tol_fwd(c->dtype))
        fail_msg("%s: forward error %g", what, e);
    if (c->taped) {
        assert_int_equal(pb_tapedata_bytes(&tape), c->tape_bytes);
        pb_tapedata_clear(&tape);
    }
    for (int k = 0; k < PB_MAX_IO; k++)
        pb_tensor_clear(&c->out[k]);
    if (wrt) {
        double worst, per[PB_MAX_IO + 2];
        assert_int_equal(pb_check_run(c, 7, &worst, per, &err), 0);
        if (worst > tol_grad(c->dtype))
            fail_msg("%s: gradient error %g (A %g B %g C %g alpha %g beta %g)", what, worst, per[0], per[1], per[2],
                     per[3], per[4]);
    }
}

/* A (2,3,4,2,5), pA = [[1,3,4],[0,2]], B (4,2,3), pB = [[1,0],[2]],
 * pAB = [2,1,3,0], C (5,2,3,3): TensorOperations' own case. */
static void contract_case(pb_call_t *c, pb_dtype_t d, char oa, char ob, char oc, char oy)
{
    static const uint64_t sa[] = {2, 3, 4, 2, 5}, sb[] = {4, 2, 3}, scc[] = {5, 2, 3, 3};
    call_init(c, &pb_op_tensorcontract, d, oy);
    make(&c->in[0], d, 5, sa, oa);
    make(&c->in[1], d, 3, sb, ob);
    make(&c->in[2], d, 4, scc, oc);
    static const int a0[] = {1, 3, 4}, a1[] = {0, 2}, b0[] = {1, 0}, b1[] = {2}, pab[] = {2, 1, 3, 0};
    opt_axes2(&c->opt[TC_PA], a0, 3, a1, 2);
    opt_axes2(&c->opt[TC_PB], b0, 2, b1, 1);
    opt_axes(&c->opt[TC_PAB], pab, 4);
}

static void contract_to_case(void **state)
{
    (void)state;
    for (int di = 0; di < 4; di++)
        for (int o = 0; o < 16; o++) {
            pb_call_t c;
            char ord[4];
            for (int k = 0; k < 4; k++)
                ord[k] = (o >> k) & 1 ? 'F' : 'C';
            contract_case(&c, dtypes[di], ord[0], ord[1], ord[2], ord[3]);
            bool cx = di >= 2;
            opt_scalar(&c.opt[TC_ALPHA], 0.7, cx ? -0.4 : 0, cx);
            opt_scalar(&c.opt[TC_BETA], -1.3, cx ? 0.2 : 0, cx);
            char what[96];
            snprintf(what, sizeof what, "to-case %s orders %.4s", pb_dtype_name(dtypes[di]), ord);
            run_contract(&c, 0x1f, what);
            pb_call_clear(&c);
        }
}

/* Every wrt subset, every conj pair, alpha/beta real and complex, zero
 * and nonzero, on the TensorOperations case. */
static void contract_wrt_conj_scalars(void **state)
{
    (void)state;
    static const double complex scal[4] = {0, 1, -0.6, CMPLX(0.3, 0.9)};
    for (int di = 0; di < 4; di++) {
        bool cx = di >= 2;
        for (unsigned wrt = 1; wrt < 32; wrt++)
            for (int cj = 0; cj < (cx ? 4 : 1); cj++)
                for (int ia = 0; ia < (cx ? 4 : 3); ia++) {
                    int ib = (ia + (int)wrt) % (cx ? 4 : 3);
                    pb_call_t c;
                    contract_case(&c, dtypes[di], 'C', wrt & 1 ? 'F' : 'C', 'C', wrt & 2 ? 'F' : 'C');
                    opt_bool(&c.opt[TC_CONJA], cj & 1);
                    opt_bool(&c.opt[TC_CONJB], cj & 2);
                    opt_scalar(&c.opt[TC_ALPHA], creal(scal[ia]), cimag(scal[ia]), cimag(scal[ia]) != 0);
                    opt_scalar(&c.opt[TC_BETA], creal(scal[ib]), cimag(scal[ib]), cimag(scal[ib]) != 0);
                    char what[128];
                    snprintf(what, sizeof what, "%s wrt %#x conj %d alpha %g%+gi beta %g%+gi",
                             pb_dtype_name(dtypes[di]), wrt, cj, creal(scal[ia]), cimag(scal[ia]), creal(scal[ib]),
                             cimag(scal[ib]));
                    run_contract(&c, wrt, what);
                    pb_call_clear(&c);
                }
    }
}

/* The matrix case, including rank-0 and vector shapes and zero sizes. */
static void contract_matrix(void **state)
{
    (void)state;
    static const uint64_t sizes[][3] = {{3, 4, 5}, {1, 4, 1}, {5, 1, 3}, {0, 3, 2}, {3, 0, 2}, {2, 3, 0}, {7, 6, 9}};
    for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++)
        for (int di = 0; di < 4; di++)
            for (int o = 0; o < 8; o++) {
                uint64_t m = sizes[z][0], k = sizes[z][1], n = sizes[z][2];
                pb_dtype_t d = dtypes[di];
                pb_call_t c;
                call_init(&c, &pb_op_tensorcontract, d, o & 4 ? 'F' : 'C');
                uint64_t sa[2] = {m, k}, sb[2] = {k, n}, scc[2] = {m, n};
                make(&c.in[0], d, 2, sa, o & 1 ? 'F' : 'C');
                make(&c.in[1], d, 2, sb, o & 2 ? 'F' : 'C');
                make(&c.in[2], d, 2, scc, 'C');
                static const int z0[] = {0}, z1[] = {1};
                opt_axes2(&c.opt[TC_PA], z0, 1, z1, 1);
                opt_axes2(&c.opt[TC_PB], z0, 1, z1, 1);
                opt_scalar(&c.opt[TC_BETA], 0.5, 0, false);
                opt_bool(&c.opt[TC_CONJA], o & 1);
                char what[96];
                snprintf(what, sizeof what, "matrix %llux%llux%llu %s o%d", (unsigned long long)m,
                         (unsigned long long)k, (unsigned long long)n, pb_dtype_name(d), o);
                run_contract(&c, 0x1f, what);
                pb_call_clear(&c);
            }
}

static void shuffle(int *v, int n)
{
    for (int i = n - 1; i > 0; i--) {
        int j = irand(i + 1), t = v[i];
        v[i] = v[j];
        v[j] = t;
    }
}

/* Random ranks up to 6, random permutations, random orders. */
static void contract_random(void **state)
{
    (void)state;
    for (int trial = 0; trial < 160; trial++) {
        pb_dtype_t d = dtypes[trial % 4];
        int noA = irand(4), noB = irand(4), nc = irand(4);
        while (noA + nc > 6)
            nc--;
        while (noB + nc > 6)
            noB--;
        int ra = noA + nc, rb = noB + nc;
        uint64_t sa[PB_MAX_RANK], sb[PB_MAX_RANK], scc[PB_MAX_RANK];
        int pa[PB_MAX_RANK], pb[PB_MAX_RANK], pab[PB_MAX_RANK];
        for (int i = 0; i < ra; i++)
            pa[i] = i;
        for (int i = 0; i < rb; i++)
            pb[i] = i;
        for (int i = 0; i < noA + noB; i++)
            pab[i] = i;
        shuffle(pa, ra);
        shuffle(pb, rb);
        shuffle(pab, noA + noB);
        for (int t = 0; t < noA; t++)
            sa[pa[t]] = 1 + (uint64_t)irand(3);
        for (int v = 0; v < nc; v++)
            sa[pa[noA + v]] = sb[pb[v]] = 1 + (uint64_t)irand(3);
        for (int u = 0; u < noB; u++)
            sb[pb[nc + u]] = 1 + (uint64_t)irand(3);
        for (int dd = 0; dd < noA + noB; dd++) {
            int m = pab[dd];
            scc[dd] = m < noA ? sa[pa[m]] : sb[pb[nc + m - noA]];
        }
        pb_call_t c;
        call_init(&c, &pb_op_tensorcontract, d, irand(2) ? 'F' : 'C');
        make(&c.in[0], d, ra, sa, irand(2) ? 'F' : 'C');
        make(&c.in[1], d, rb, sb, irand(2) ? 'F' : 'C');
        make(&c.in[2], d, noA + noB, scc, irand(2) ? 'F' : 'C');
        opt_axes2(&c.opt[TC_PA], pa, noA, pa + noA, nc);
        opt_axes2(&c.opt[TC_PB], pb, nc, pb + nc, noB);
        opt_axes(&c.opt[TC_PAB], pab, noA + noB);
        bool cx = d == PB_C64 || d == PB_C128;
        opt_bool(&c.opt[TC_CONJA], cx && irand(2));
        opt_bool(&c.opt[TC_CONJB], cx && irand(2));
        opt_scalar(&c.opt[TC_ALPHA], urand(), cx ? urand() : 0, cx);
        opt_scalar(&c.opt[TC_BETA], urand(), 0, false);
        char what[64];
        snprintf(what, sizeof what, "random trial %d (%d,%d,%d) %s", trial, noA, nc, noB, pb_dtype_name(d));
        run_contract(&c, 1 + (unsigned)irand(31), what);
        pb_call_clear(&c);
    }
}

/* The einsum form gives the same outputs and gradients as pA/pB/pAB. */
static void contract_spec(void **state)
{
    (void)state;
    for (int di = 0; di < 4; di++) {
        pb_dtype_t d = dtypes[di];
        /* "abcde,cdb->?" for the TensorOperations case: A axes a b c d e
         * (sizes 2 3 4 2 5); B (4,2,3) with axes c, d, b: contracted
         * A axes 1(b)... use pA = [[1,3,4],[0,2]] written as letters. */
        pb_call_t e, s;
        contract_case(&e, d, 'C', 'F', 'C', 'C');
        /* A = "abcde": open b d e, contracted a c; B (4,2,3) = "cag"?
         * pB = [[1,0],[2]]: B axis 1 pairs with A axis 0 (a), B axis 0
         * with A axis 2 (c), B axis 2 is open (f).  So B = "caf".  M axes
         * are b d e f; pAB = [2,1,3,0]: output = e d f b. */
        call_init(&s, &pb_op_tensorcontract, d, 'C');
        for (int k = 0; k < 3; k++)
            pb_tensor_ref(&s.in[k], &e.in[k]);
        s.opt[TC_SPEC].given = true;
        strcpy(s.opt[TC_SPEC].text, "abcde,caf->edfb");
        opt_scalar(&e.opt[TC_BETA], 0.25, 0, false);
        opt_scalar(&s.opt[TC_BETA], 0.25, 0, false);
        pb_err_t err = {0};
        pb_call_defaults(&e);
        pb_call_defaults(&s);
        assert_int_equal(pb_op_tensorcontract.validate(&e, &err), 0);
        if (pb_op_tensorcontract.validate(&s, &err))
            fail_msg("spec: %s", err.message);
        assert_int_equal(pb_op_run_forward(&e, NULL, &err), 0);
        assert_int_equal(pb_op_run_forward(&s, NULL, &err), 0);
        assert_true(pb_tensor_same_shape(&e.out[0], &s.out[0]));
        size_t n = pb_tensor_count(&e.out[0]);
        for (size_t i = 0; i < n; i++)
            assert_true(get(&e.out[0], i) == get(&s.out[0], i));
        /* gradients: the same reverse on both tapes, with one cotangent */
        pb_tensor_clear(&e.out[0]);
        pb_tensor_clear(&s.out[0]);
        pb_tapedata_t te, ts;
        e.taped = s.taped = true;
        e.wrt = s.wrt = 0x1f;
        assert_int_equal(pb_op_run_forward(&e, &te, &err), 0);
        assert_int_equal(pb_op_run_forward(&s, &ts, &err), 0);
        pb_tensor_t cot[PB_MAX_IO] = {{0}}, ge[PB_MAX_IO + 2] = {{0}}, gs[PB_MAX_IO + 2] = {{0}};
        make(&cot[0], d, e.out[0].rank, e.out[0].shape, 'C');
        pb_warnings_t w = {0};
        assert_int_equal(pb_op_run_reverse(&te, cot, ge, 'C', &w, &err), 0);
        assert_int_equal(pb_op_run_reverse(&ts, cot, gs, 'C', &w, &err), 0);
        for (int k = 0; k < 5; k++) {
            size_t m = pb_tensor_count(&ge[k]);
            assert_int_equal(m, pb_tensor_count(&gs[k]));
            for (size_t i = 0; i < m; i++)
                assert_true(get(&ge[k], i) == get(&gs[k], i));
            pb_tensor_clear(&ge[k]);
            pb_tensor_clear(&gs[k]);
        }
        pb_tensor_clear(&cot[0]);
        pb_tapedata_clear(&te);
        pb_tapedata_clear(&ts);
        pb_tensor_clear(&s.out[0]); /* run_contract makes its own */
        run_contract(&s, 0x1f, "spec fd");
        pb_call_clear(&e);
        pb_call_clear(&s);
    }
}

/* The tape keeps only what wrt needs (the minimal tape, tensorops.h). */
static void contract_tape(void **state)
{
    (void)state;
    for (unsigned wrt = 0; wrt < 32; wrt++) {
        pb_call_t c;
        contract_case(&c, PB_F64, 'C', 'C', 'C', 'C');
        opt_scalar(&c.opt[TC_BETA], 2, 0, false);
        c.wrt = wrt;
        c.taped = true;
        pb_call_defaults(&c);
        pb_err_t err = {0};
        assert_int_equal(pb_op_tensorcontract.validate(&c, &err), 0);
        /* A for B̄, B for Ā, C for β̄; for ᾱ the output-sized M (90
         * elements) when A (240) and B (24) would add more, else A and B:
         * ᾱ alone or with Ā keeps M, ᾱ with B̄ (A kept anyway) keeps B. */
        size_t a = pb_tensor_bytes(&c.in[0]), b = pb_tensor_bytes(&c.in[1]), m = 90 * 8, want = 0;
        bool ka = wrt & 2, kb = wrt & 1, km = false;
        if (wrt & 8) {
            km = m < (ka ? 0 : a) + (kb ? 0 : b);
            ka = ka || !km;
            kb = kb || !km;
        }
        want = (ka ? a : 0) + (kb ? b : 0) + (km ? m : 0) + (wrt & 16 ? pb_tensor_bytes(&c.in[2]) : 0);
        assert_int_equal(c.tape_bytes, want);
        if (wrt == 8)
            assert_int_equal(want, m);
        if (wrt == (8 | 1))
            assert_int_equal(want, b + m);
        if (wrt == (8 | 2))
            assert_int_equal(want, a + b);
        pb_call_clear(&c);
    }
}

static void expect_error(pb_call_t *c, int code, const char *arg)
{
    pb_err_t err = {0};
    pb_call_defaults(c);
    int rc = c->op->validate(c, &err);
    if (rc != code)
        fail_msg("expected %s, got %d (%s)", pb_strerror_code(code), rc, err.message);
    assert_string_equal(err.arg, arg);
    pb_call_clear(c);
}

static void contract_errors(void **state)
{
    (void)state;
    pb_call_t c;
    static const int a0[] = {1, 3, 4}, a1[] = {0, 2}, bad[] = {1, 1, 4}, b0[] = {1, 0}, b1[] = {2};
    /* pA not a permutation */
    contract_case(&c, PB_F64, 'C', 'C', 'C', 'C');
    opt_axes2(&c.opt[TC_PA], bad, 3, a1, 2);
    expect_error(&c, PB_EINVALID_ARGUMENT, "options.pA");
    /* pA of the wrong length */
    contract_case(&c, PB_F64, 'C', 'C', 'C', 'C');
    opt_axes2(&c.opt[TC_PA], a0, 3, a1, 1);
    expect_error(&c, PB_EINVALID_ARGUMENT, "options.pA");
    /* pB not a permutation */
    contract_case(&c, PB_F64, 'C', 'C', 'C', 'C');
    opt_axes2(&c.opt[TC_PB], b0, 2, b0, 1);
    expect_error(&c, PB_EINVALID_ARGUMENT, "options.pB");
    /* contracted counts differ */
    contract_case(&c, PB_F64, 'C', 'C', 'C', 'C');
    {
        static const int pb0[] = {1}, pb1[] = {0, 2};
        opt_axes2(&c.opt[TC_PB], pb0, 1, pb1, 2);
    }
    expect_error(&c, PB_EINVALID_ARGUMENT, "options.pB");
    /* contracted sizes differ: pB = [[0,1],[2]] pairs A's 2 (size 2) with B's 0 (size 4) */
    contract_case(&c, PB_F64, 'C', 'C', 'C', 'C');
    {
        static const int pb0[] = {0, 1};
        opt_axes2(&c.opt[TC_PB], pb0, 2, b1, 1);
    }
    expect_error(&c, PB_ESHAPE_MISMATCH, "inputs.B");
    /* pAB not a permutation, wrong length */
    contract_case(&c, PB_F64, 'C', 'C', 'C', 'C');
    {
        static const int p[] = {0, 1, 2, 2};
        opt_axes(&c.opt[TC_PAB], p, 4);
    }
    expect_error(&c, PB_EINVALID_ARGUMENT, "options.pAB");
    contract_case(&c, PB_F64, 'C', 'C', 'C', 'C');
    {
        static const int p[] = {0, 1, 2};
        opt_axes(&c.opt[TC_PAB], p, 3);
    }
    expect_error(&c, PB_EINVALID_ARGUMENT, "options.pAB");
    /* C of the wrong shape */
    contract_case(&c, PB_F64, 'C', 'C', 'C', 'C');
    pb_tensor_clear(&c.in[2]);
    {
        static const uint64_t s[] = {5, 2, 3, 4};
        make(&c.in[2], PB_F64, 4, s, 'C');
    }
    expect_error(&c, PB_ESHAPE_MISMATCH, "inputs.C");
    /* C missing with beta ≠ 0 */
    contract_case(&c, PB_F64, 'C', 'C', 'C', 'C');
    pb_tensor_clear(&c.in[2]);
    opt_scalar(&c.opt[TC_BETA], 1, 0, false);
    expect_error(&c, PB_EINVALID_ARGUMENT, "inputs.C");
    /* neither pA/pB nor spec */
    contract_case(&c, PB_F64, 'C', 'C', 'C', 'C');
    memset(&c.opt[TC_PA], 0, sizeof c.opt[TC_PA]);
    expect_error(&c, PB_EINVALID_ARGUMENT, "options.pA");
    /* both */
    contract_case(&c, PB_F64, 'C', 'C', 'C', 'C');
    c.opt[TC_SPEC].given = true;
    strcpy(c.opt[TC_SPEC].text, "abcde,caf->edfb");
    expect_error(&c, PB_EINVALID_ARGUMENT, "options.spec");
    /* spec errors */
    static const struct {
        const char *spec;
        int code;
        const char *arg;
    } specs[] = {
        {"abcde,caf->edfb", 0, NULL},
        {"abcda,caf->edfb", PB_EINVALID_ARGUMENT, "options.spec"}, /* repeated letter */
        {"abcde,caf->edf", PB_EINVALID_ARGUMENT, "options.spec"},  /* b only in A, not in output */
        {"abcde,caf->edfba", PB_EINVALID_ARGUMENT, "options.spec"}, /* contracted letter in output */
        {"abcde,caf->edfbz", PB_EINVALID_ARGUMENT, "options.spec"}, /* letter in neither */
        {"abcd,caf->dfb", PB_ESHAPE_MISMATCH, "inputs.A"},          /* rank of A */
        {"abcde,cbf->edfa", PB_ESHAPE_MISMATCH, "inputs.B"},        /* b: 3 in A, 2 in B */
        {"abcde,caf-edfb", PB_EINVALID_ARGUMENT, "options.spec"},   /* no arrow */
        {"abcde,ca1->edfb", PB_EINVALID_ARGUMENT, "options.spec"},  /* not a letter */
        {"abcde,caf->edfbb", PB_EINVALID_ARGUMENT, "options.spec"}, /* repeat in output */
    };
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        contract_case(&c, PB_F64, 'C', 'C', 'C', 'C');
        memset(&c.opt[TC_PA], 0, sizeof c.opt[TC_PA] * 3);
        c.opt[TC_SPEC].given = true;
        strcpy(c.opt[TC_SPEC].text, specs[i].spec);
        pb_tensor_clear(&c.in[2]);
        if (specs[i].code == 0) {
            pb_err_t err = {0};
            pb_call_defaults(&c);
            assert_int_equal(c.op->validate(&c, &err), 0);
            pb_call_clear(&c);
        } else
            expect_error(&c, specs[i].code, specs[i].arg);
    }
}

/* ---- tensoradd ---- */

static void add_case(pb_call_t *c, pb_dtype_t d, const uint64_t *sa, int rank, const int *p, char oa, char oc,
                     char oy)
{
    call_init(c, &pb_op_tensoradd, d, oy);
    make(&c->in[0], d, rank, sa, oa);
    uint64_t sc_[PB_MAX_RANK];
    for (int k = 0; k < rank; k++)
        sc_[k] = sa[p[k]];
    make(&c->in[1], d, rank, sc_, oc);
    opt_axes(&c->opt[TA_PA], p, rank);
}

static double ref_add_err(const pb_call_t *c, const int *p)
{
    const pb_tensor_t *A = &c->in[0], *C = &c->in[1], *Y = &c->out[0];
    double complex alpha = CMPLX(c->opt[TA_ALPHA].re, c->opt[TA_ALPHA].im);
    double complex beta = CMPLX(c->opt[TA_BETA].re, c->opt[TA_BETA].im);
    uint64_t oi[PB_MAX_RANK] = {0}, ai[PB_MAX_RANK];
    double worst = 0, scale = 1;
    if (empty(Y->shape, Y->rank))
        return 0;
    do {
        for (int k = 0; k < Y->rank; k++)
            ai[p[k]] = oi[k];
        double complex want = alpha * opx(at(A, ai), c->opt[TA_CONJA].b, A->dtype) + (beta != 0 ? beta * at(C, oi) : 0);
        scale = fmax(scale, cabs(want));
        worst = fmax(worst, cabs(want - at(Y, oi)));
    } while (next(oi, Y->shape, Y->rank));
    return worst / scale;
}

static void run_simple(pb_call_t *c, unsigned wrt, const char *what, double (*ref)(const pb_call_t *, const int *),
                       const int *p)
{
    pb_err_t err = {0};
    c->wrt = wrt;
    c->taped = wrt != 0;
    pb_call_defaults(c);
    if (c->op->validate(c, &err))
        fail_msg("%s: validate: %s", what, err.message);
    pb_tapedata_t tape;
    assert_int_equal(pb_op_run_forward(c, c->taped ? &tape : NULL, &err), 0);
    double e = ref(c, p);
    if (e > tol_fwd(c->dtype))
        fail_msg("%s: forward error %g", what, e);
    if (c->taped) {
        assert_int_equal(pb_tapedata_bytes(&tape), c->tape_bytes);
        pb_tapedata_clear(&tape);
    }
    pb_tensor_clear(&c->out[0]);
    if (wrt) {
        double worst, per[PB_MAX_IO + 2];
        assert_int_equal(pb_check_run(c, 11, &worst, per, &err), 0);
        if (worst > tol_grad(c->dtype))
            fail_msg("%s: gradient error %g (A %g C %g alpha %g beta %g)", what, worst, per[0], per[1], per[2],
                     per[3]);
    }
}

static void add_all(void **state)
{
    (void)state;
    static const uint64_t sa[] = {2, 3, 4, 2, 1};
    static const int p[] = {1, 0, 3, 2, 4};
    static const double complex scal[4] = {0, 1, -0.6, CMPLX(0.3, 0.9)};
    for (int di = 0; di < 4; di++) {
        bool cx = di >= 2;
        for (unsigned wrt = 0; wrt < 16; wrt++)
            for (int ia = 0; ia < 4; ia++) {
                if (!cx && cimag(scal[ia]) != 0)
                    continue;
                int ib = (ia + (int)wrt) % 4;
                if (!cx && cimag(scal[ib]) != 0)
                    ib = 2;
                pb_call_t c;
                add_case(&c, dtypes[di], sa, 5, p, wrt & 1 ? 'F' : 'C', 'C', ia & 1 ? 'F' : 'C');
                opt_bool(&c.opt[TA_CONJA], cx && (wrt & 2));
                opt_scalar(&c.opt[TA_ALPHA], creal(scal[ia]), cimag(scal[ia]), cimag(scal[ia]) != 0);
                opt_scalar(&c.opt[TA_BETA], creal(scal[ib]), cimag(scal[ib]), cimag(scal[ib]) != 0);
                char what[96];
                snprintf(what, sizeof what, "add %s wrt %#x a%d b%d", pb_dtype_name(dtypes[di]), wrt, ia, ib);
                run_simple(&c, wrt, what, ref_add_err, p);
                pb_call_clear(&c);
            }
    }
    /* random permutations of random ranks up to 6, and zero sizes */
    for (int trial = 0; trial < 80; trial++) {
        int rank = irand(7);
        uint64_t s[PB_MAX_RANK];
        int q[PB_MAX_RANK];
        for (int k = 0; k < rank; k++) {
            s[k] = (uint64_t)irand(4) + (trial % 9 == 0 ? 0 : 1);
            q[k] = k;
        }
        shuffle(q, rank);
        pb_call_t c;
        pb_dtype_t d = dtypes[trial % 4];
        add_case(&c, d, s, rank, q, irand(2) ? 'F' : 'C', irand(2) ? 'F' : 'C', irand(2) ? 'F' : 'C');
        opt_scalar(&c.opt[TA_ALPHA], urand(), 0, false);
        opt_scalar(&c.opt[TA_BETA], urand(), 0, false);
        opt_bool(&c.opt[TA_CONJA], irand(2));
        run_simple(&c, 1 + (unsigned)irand(15), "add random", ref_add_err, q);
        pb_call_clear(&c);
    }
    /* errors */
    pb_call_t c;
    static const int bad[] = {1, 0, 3, 3, 4};
    add_case(&c, PB_F64, sa, 5, p, 'C', 'C', 'C');
    opt_axes(&c.opt[TA_PA], bad, 5);
    expect_error(&c, PB_EINVALID_ARGUMENT, "options.pA");
    add_case(&c, PB_F64, sa, 5, p, 'C', 'C', 'C');
    opt_axes(&c.opt[TA_PA], p, 4);
    expect_error(&c, PB_EINVALID_ARGUMENT, "options.pA");
    add_case(&c, PB_F64, sa, 5, bad + 0, 'C', 'C', 'C'); /* C shaped for another permutation */
    opt_axes(&c.opt[TA_PA], p, 5);
    expect_error(&c, PB_ESHAPE_MISMATCH, "inputs.C");
}

/* ---- tensortrace ---- */

typedef struct {
    int np, nq;
    int p[PB_MAX_RANK], q1[PB_MAX_RANK], q2[PB_MAX_RANK];
} tr_t;

static double ref_trace_err(const pb_call_t *c, const int *pp)
{
    const tr_t *t = (const tr_t *)(const void *)pp;
    const pb_tensor_t *A = &c->in[0], *C = &c->in[1], *Y = &c->out[0];
    double complex alpha = CMPLX(c->opt[TT_ALPHA].re, c->opt[TT_ALPHA].im);
    double complex beta = CMPLX(c->opt[TT_BETA].re, c->opt[TT_BETA].im);
    uint64_t oi[PB_MAX_RANK] = {0}, ai[PB_MAX_RANK], kshape[PB_MAX_RANK], ki[PB_MAX_RANK];
    for (int i = 0; i < t->nq; i++)
        kshape[i] = A->shape[t->q1[i]];
    double worst = 0, scale = 1;
    if (empty(Y->shape, Y->rank))
        return 0;
    do {
        for (int d = 0; d < t->np; d++)
            ai[t->p[d]] = oi[d];
        double complex sum = 0;
        memset(ki, 0, sizeof ki);
        if (!empty(kshape, t->nq))
            do {
                for (int i = 0; i < t->nq; i++)
                    ai[t->q1[i]] = ai[t->q2[i]] = ki[i];
                sum += opx(at(A, ai), c->opt[TT_CONJA].b, A->dtype);
            } while (next(ki, kshape, t->nq));
        double complex want = alpha * sum + (beta != 0 ? beta * at(C, oi) : 0);
        scale = fmax(scale, cabs(want));
        worst = fmax(worst, cabs(want - at(Y, oi)));
    } while (next(oi, Y->shape, Y->rank));
    return worst / scale;
}

static void trace_case(pb_call_t *c, pb_dtype_t d, const uint64_t *sa, int rank, const tr_t *t, char oa, char oy,
                       bool give_p)
{
    call_init(c, &pb_op_tensortrace, d, oy);
    make(&c->in[0], d, rank, sa, oa);
    uint64_t sc_[PB_MAX_RANK];
    for (int k = 0; k < t->np; k++)
        sc_[k] = sa[t->p[k]];
    make(&c->in[1], d, t->np, sc_, 'F');
    if (give_p)
        opt_axes(&c->opt[TT_P], t->p, t->np);
    opt_axes2(&c->opt[TT_Q], t->q1, t->nq, t->q2, t->nq);
}

static void trace_all(void **state)
{
    (void)state;
    static const uint64_t s1[] = {2, 3, 4, 2, 5}, s2[] = {2, 3, 4, 2, 4};
    static const tr_t single = {3, 1, {2, 4, 1}, {0}, {3}}, dbl = {1, 2, {1}, {0, 2}, {3, 4}};
    static const double complex scal[4] = {0, 1, -0.6, CMPLX(0.3, 0.9)};
    for (int which = 0; which < 2; which++)
        for (int di = 0; di < 4; di++) {
            bool cx = di >= 2;
            for (unsigned wrt = 0; wrt < 16; wrt++) {
                int ia = (int)(wrt % 4), ib = (int)((wrt / 4 + 1) % 4);
                if (!cx && cimag(scal[ia]) != 0)
                    ia = 2;
                if (!cx && cimag(scal[ib]) != 0)
                    ib = 1;
                pb_call_t c;
                const tr_t *t = which ? &dbl : &single;
                trace_case(&c, dtypes[di], which ? s2 : s1, 5, t, wrt & 1 ? 'F' : 'C', wrt & 2 ? 'F' : 'C',
                           true);
                opt_bool(&c.opt[TT_CONJA], cx && (wrt & 4));
                opt_scalar(&c.opt[TT_ALPHA], creal(scal[ia]), cimag(scal[ia]), cimag(scal[ia]) != 0);
                opt_scalar(&c.opt[TT_BETA], creal(scal[ib]), cimag(scal[ib]), cimag(scal[ib]) != 0);
                char what[96];
                snprintf(what, sizeof what, "%s trace %s wrt %#x", which ? "double" : "single",
                         pb_dtype_name(dtypes[di]), wrt);
                run_simple(&c, wrt, what, ref_trace_err, (const int *)(const void *)t);
                pb_call_clear(&c);
            }
        }
    /* default p: the untraced axes in order */
    {
        pb_call_t c;
        tr_t t = {3, 1, {1, 2, 4}, {0}, {3}};
        trace_case(&c, PB_C128, s1, 5, &t, 'C', 'C', false);
        run_simple(&c, 0xf, "default p", ref_trace_err, (const int *)(const void *)&t);
        pb_call_clear(&c);
    }
    /* errors */
    pb_call_t c;
    tr_t bad = {3, 1, {2, 4, 1}, {0}, {2}}; /* axis 2 twice */
    trace_case(&c, PB_F64, s1, 5, &single, 'C', 'C', true);
    opt_axes2(&c.opt[TT_Q], bad.q1, 1, bad.q2, 1);
    expect_error(&c, PB_EINVALID_ARGUMENT, "options.p");
    trace_case(&c, PB_F64, s1, 5, &single, 'C', 'C', true);
    opt_axes2(&c.opt[TT_Q], single.q1, 1, single.q2, 0);
    expect_error(&c, PB_EINVALID_ARGUMENT, "options.q");
    tr_t sizes = {3, 1, {0, 3, 1}, {2}, {4}}; /* sizes 4 and 5 */
    trace_case(&c, PB_F64, s1, 5, &sizes, 'C', 'C', true);
    expect_error(&c, PB_ESHAPE_MISMATCH, "inputs.A");
    trace_case(&c, PB_F64, s1, 5, &single, 'C', 'C', true);
    static const int p2[] = {4, 2, 1}; /* C shaped for p = [2, 4, 1] */
    opt_axes(&c.opt[TT_P], p2, 3);
    expect_error(&c, PB_ESHAPE_MISMATCH, "inputs.C");
}

/* The strided kernel on its own: a rank-4 permutation and a conjugating
 * scaled add against a loop. */
static void strided_kernel(void **state)
{
    (void)state;
    /* sizes that are not multiples of the kernel's tiles; perms that keep
     * the fastest axis, swap the two fastest, and reverse all */
    static const uint64_t shapes[2][4] = {{37, 5, 19, 70}, {9, 17, 3, 41}};
    static const int perms[3][4] = {{2, 0, 3, 1}, {0, 1, 3, 2}, {3, 2, 1, 0}};
    for (int di = 0; di < 4; di++)
        for (int si = 0; si < 2; si++)
            for (int pi = 0; pi < 3; pi++)
                for (int plain = 0; plain < 2; plain++) {
                    pb_dtype_t d = dtypes[di];
                    const uint64_t *sh = shapes[si];
                    const int *perm = perms[pi];
                    pb_tensor_t a, b, y;
                    uint64_t shy[4];
                    for (int k = 0; k < 4; k++)
                        shy[k] = sh[perm[k]];
                    make(&a, d, 4, sh, 'C');
                    make(&b, d, 4, shy, 'F');
                    assert_int_equal(pb_tensor_alloc(&y, d, 4, shy, 'C', false), 0);
                    pb_loop_t L = {.rank = 4};
                    int64_t sa[4], sb[4], sy[4];
                    pb_dense_strides(4, sh, 'C', sa);
                    pb_dense_strides(4, shy, 'F', sb);
                    pb_dense_strides(4, shy, 'C', sy);
                    for (int k = 0; k < 4; k++) {
                        L.dim[k] = shy[k];
                        L.s[0][k] = sy[k];
                        L.s[1][k] = sa[perm[k]];
                        L.s[2][k] = sb[k];
                    }
                    bool cx = di >= 2 && !plain;
                    pb_scalar_t al = {plain ? 1 : 0.5, cx ? 2 : 0}, be = {plain ? 0 : -1, cx ? 0.25 : 0};
                    pb_strided(d, &L, pb_tensor_data(&y), pb_tensor_data(&a), cx, al,
                               plain ? NULL : pb_tensor_data(&b), be, false);
                    uint64_t oi[4] = {0}, ai[4];
                    do {
                        for (int k = 0; k < 4; k++)
                            ai[perm[k]] = oi[k];
                        double complex want = CMPLX(al.re, al.im) * opx(at(&a, ai), cx, d) +
                                              (plain ? 0 : CMPLX(be.re, be.im) * at(&b, oi));
                        assert_true(cabs(want - at(&y, oi)) <= tol_fwd(d) * (1 + cabs(want)));
                    } while (next(oi, shy, 4));
                    pb_tensor_clear(&a);
                    pb_tensor_clear(&b);
                    pb_tensor_clear(&y);
                }
}

/* One pass of pb_strided over flat buffers against a naive walk of the
 * same loop.  Strides are in elements and non-negative; span is the
 * buffer length each operand needs.  With acc, dst strides may be 0. */
typedef struct sloop {
    int rank;
    uint64_t dim[4];
    int64_t s[3][4]; /* dst, src, src2 */
} sloop_t;

static size_t span(const sloop_t *l, int o)
{
    int64_t last = 0;
    for (int k = 0; k < l->rank; k++)
        last += (int64_t)(l->dim[k] - 1) * l->s[o][k];
    return (size_t)last + 1;
}

static void check_pass(pb_dtype_t d, const sloop_t *l, bool cj, pb_scalar_t al, bool two, pb_scalar_t be, bool acc,
                       const char *what)
{
    pb_tensor_t y, y0, a, b;
    uint64_t ny = span(l, 0), na = span(l, 1), nb = span(l, 2);
    make(&y, d, 1, &ny, 'C');
    make(&y0, d, 1, &ny, 'C');
    make(&a, d, 1, &na, 'C');
    make(&b, d, 1, &nb, 'C');
    for (size_t i = 0; i < ny; i++)
        set(&y0, i, get(&y, i));
    pb_loop_t L = {.rank = l->rank};
    for (int k = 0; k < l->rank; k++) {
        L.dim[k] = l->dim[k];
        for (int o = 0; o < 3; o++)
            L.s[o][k] = l->s[o][k];
    }
    pb_strided(d, &L, pb_tensor_data(&y), pb_tensor_data(&a), cj, al, two ? pb_tensor_data(&b) : NULL, be, acc);
    /* the reference, in y0: the same element order is not needed, as no
     * element is written twice except through acc, which only adds */
    double complex alpha = CMPLX(al.re, al.im), beta = CMPLX(be.re, be.im);
    uint64_t idx[4] = {0};
    double scale = 1;
    do {
        int64_t oy = 0, oa = 0, ob = 0;
        for (int k = 0; k < l->rank; k++) {
            oy += (int64_t)idx[k] * l->s[0][k];
            oa += (int64_t)idx[k] * l->s[1][k];
            ob += (int64_t)idx[k] * l->s[2][k];
        }
        double complex v = alpha * opx(get(&a, (size_t)oa), cj, d) + (two ? beta * get(&b, (size_t)ob) : 0);
        set(&y0, (size_t)oy, (acc ? get(&y0, (size_t)oy) : 0) + v);
        scale = fmax(scale, cabs(v));
    } while (next(idx, l->dim, l->rank));
    double worst = 0;
    for (size_t i = 0; i < ny; i++)
        worst = fmax(worst, cabs(get(&y0, i) - get(&y, i)));
    if (worst > 4 * tol_fwd(d) * scale)
        fail_msg("%s: %s error %g", what, pb_dtype_name(d), worst / scale);
    pb_tensor_clear(&y);
    pb_tensor_clear(&y0);
    pb_tensor_clear(&a);
    pb_tensor_clear(&b);
}

/* The paths of the walk (strided.c): transposing tiles with unit
 * strides (through the buffer, with prefetch) and without (a strided
 * source, an F-order destination, a reduction), ragged tiles along both
 * sides, rows that do not transpose, and every flag: conj, alpha, beta,
 * accumulate, for all four dtypes. */
/* Strides of an empty tensor whose other dimensions multiply past 2^63
 * saturate at INT64_MAX (they once overflowed: undefined, and 0 here). */
static void huge_empty_strides(void **state)
{
    (void)state;
    static const uint64_t sh[3] = {0, 1ull << 40, 1ull << 40}, big[2] = {UINT64_MAX, 0};
    int64_t st[3];
    pb_dense_strides(3, sh, 'C', st);
    assert_true(st[0] == INT64_MAX && st[1] == (int64_t)1 << 40 && st[2] == 1);
    pb_dense_strides(3, sh, 'F', st);
    assert_true(st[0] == 1 && st[1] == 1 && st[2] == (int64_t)1 << 40);
    pb_dense_strides(2, big, 'F', st);
    assert_true(st[0] == 1 && st[1] == INT64_MAX);
}

static void strided_paths(void **state)
{
    (void)state;
    /* dense C-order operands of shape (67, 3, 130, 5) read through a
     * permutation: dst strides for the permuted shape, src strides of
     * the original */
    static const uint64_t sh[4] = {67, 3, 130, 5};
    static const int perms[5][4] = {{3, 2, 1, 0}, {2, 1, 0, 3}, {1, 0, 2, 3}, {0, 2, 1, 3}, {3, 0, 1, 2}};
    int64_t ss[4];
    pb_dense_strides(4, sh, 'C', ss);
    for (int di = 0; di < 4; di++) {
        pb_dtype_t d = dtypes[di];
        bool cx = di >= 2;
        for (int pi = 0; pi < 5; pi++)
            for (int v = 0; v < 7; v++) {
                sloop_t l = {.rank = 4};
                uint64_t shy[4];
                int64_t sy[4], sf[4];
                for (int k = 0; k < 4; k++)
                    shy[k] = sh[perms[pi][k]];
                pb_dense_strides(4, shy, 'C', sy);
                pb_dense_strides(4, shy, 'F', sf);
                for (int k = 0; k < 4; k++) {
                    l.dim[k] = shy[k];
                    l.s[0][k] = v == 5 ? sf[k] : sy[k]; /* 5: an F-order dst */
                    l.s[1][k] = ss[perms[pi][k]] * (v == 6 ? 2 : 1); /* 6: every other element of src */
                    l.s[2][k] = v & 1 ? sf[k] : sy[k];
                }
                bool cj = cx && (v == 1 || v == 3), two = v == 2 || v == 3, acc = v == 4;
                pb_scalar_t al = {v == 0 ? 1 : 0.75, cx && v != 0 ? -0.5 : 0}, be = {-1.5, cx ? 0.25 : 0};
                char what[96];
                snprintf(what, sizeof what, "perm [%d,%d,%d,%d] variant %d", perms[pi][0], perms[pi][1],
                         perms[pi][2], perms[pi][3], v);
                check_pass(d, &l, cj, al, two, be, acc, what);
            }
        /* a reduction: dst += Σ_k src over a transposed plane, the summed
         * index first and last in the walk */
        sloop_t r = {.rank = 3, .dim = {70, 3, 41}};
        r.s[0][0] = 1, r.s[0][1] = 0, r.s[0][2] = 70;
        r.s[1][0] = 41 * 3, r.s[1][1] = 41, r.s[1][2] = 1;
        check_pass(d, &r, cx, (pb_scalar_t){0.5, cx ? 1 : 0}, false, (pb_scalar_t){0, 0}, true, "reduction");
        sloop_t r2 = {.rank = 3, .dim = {3, 70, 41}};
        r2.s[0][0] = 0, r2.s[0][1] = 1, r2.s[0][2] = 70;
        r2.s[1][0] = 1, r2.s[1][1] = 3 * 41, r2.s[1][2] = 3;
        check_pass(d, &r2, false, (pb_scalar_t){1, 0}, false, (pb_scalar_t){0, 0}, true, "reduction, summed first");
        sloop_t r3 = {.rank = 3, .dim = {9, 20, 17}}; /* whole 8 × 8 blocks with dst stride 0 */
        r3.s[0][0] = 0, r3.s[0][1] = 1, r3.s[0][2] = 20;
        r3.s[1][0] = 340, r3.s[1][1] = 17, r3.s[1][2] = 1;
        check_pass(d, &r3, cx, (pb_scalar_t){1, 0}, false, (pb_scalar_t){0, 0}, true, "reduction, 8 × 8 blocks");
        /* a big 2D transpose: many tiles, the next one prefetched */
        sloop_t t2 = {.rank = 2, .dim = {300, 97}};
        t2.s[0][0] = 1, t2.s[0][1] = 300, t2.s[1][0] = 97, t2.s[1][1] = 1, t2.s[2][0] = 1, t2.s[2][1] = 300;
        check_pass(d, &t2, false, (pb_scalar_t){1, 0}, false, (pb_scalar_t){0, 0}, false, "2D transpose");
        check_pass(d, &t2, cx, (pb_scalar_t){2, 0}, true, (pb_scalar_t){0.5, 0}, false, "2D transpose, beta");
    }
}

/* Rank 16, the contract's most: a permutation and a contraction whose
 * output has rank 16. */
static void rank16(void **state)
{
    (void)state;
    uint64_t s16[16];
    int rev[16];
    for (int k = 0; k < 16; k++) {
        s16[k] = k % 5 == 0 ? 2 : 1 + (uint64_t)(k % 2);
        rev[k] = 15 - k;
    }
    pb_call_t c;
    add_case(&c, PB_C128, s16, 16, rev, 'C', 'F', 'F');
    opt_scalar(&c.opt[TA_BETA], 0.5, 0, false);
    run_simple(&c, 0xf, "add rank 16", ref_add_err, rev);
    pb_call_clear(&c);
    /* A rank 9 (8 open + 1 contracted), B rank 9: output rank 16 */
    call_init(&c, &pb_op_tensorcontract, PB_F64, 'C');
    uint64_t sa[9], sb[9], scc[16];
    int oa[8], ca[1] = {8}, cb[1] = {0}, ob[8], pab[16];
    for (int k = 0; k < 8; k++) {
        sa[k] = 1 + (uint64_t)(k % 2);
        sb[k + 1] = 2 - (uint64_t)(k % 2);
        oa[k] = k;
        ob[k] = k + 1;
    }
    sa[8] = sb[0] = 3;
    for (int d = 0; d < 16; d++) {
        pab[d] = 15 - d;
        scc[d] = pab[d] < 8 ? sa[pab[d]] : sb[pab[d] - 7];
    }
    make(&c.in[0], PB_F64, 9, sa, 'F');
    make(&c.in[1], PB_F64, 9, sb, 'C');
    make(&c.in[2], PB_F64, 16, scc, 'C');
    opt_axes2(&c.opt[TC_PA], oa, 8, ca, 1);
    opt_axes2(&c.opt[TC_PB], cb, 1, ob, 8);
    opt_axes(&c.opt[TC_PAB], pab, 16);
    opt_scalar(&c.opt[TC_BETA], -1, 0, false);
    run_contract(&c, 0x1f, "contract to rank 16");
    pb_call_clear(&c);
    /* open axes that would make rank 17 */
    call_init(&c, &pb_op_tensorcontract, PB_F64, 'C');
    uint64_t s9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    make(&c.in[0], PB_F64, 9, s9, 'C');
    make(&c.in[1], PB_F64, 9, s9, 'C');
    int all9[9] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    opt_axes2(&c.opt[TC_PA], all9, 9, all9, 0);
    opt_axes2(&c.opt[TC_PB], all9, 0, all9, 9);
    expect_error(&c, PB_EINVALID_ARGUMENT, "options.pA");
}

int main(int argc, char **argv)
{
    if (fake_gpu_mode(argc, argv)) {
#define T(f) cmocka_unit_test_teardown(f, fake_gpu_after)
        const struct CMUnitTest gpu[] = {
            T(contract_to_case), T(contract_matrix), T(contract_random), T(contract_spec), T(contract_tape),
            T(contract_errors), T(contract_wrt_conj_scalars), T(add_all), T(trace_all), T(rank16),
        };
        return cmocka_run_group_tests_name("cuda.tensorops (the host fake's cuda:0)", gpu, NULL, NULL);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(strided_kernel),   cmocka_unit_test(strided_paths),    cmocka_unit_test(huge_empty_strides),
           cmocka_unit_test(contract_to_case),
        cmocka_unit_test(contract_matrix),  cmocka_unit_test(contract_random),  cmocka_unit_test(contract_spec),
        cmocka_unit_test(contract_tape),
        cmocka_unit_test(contract_errors),  cmocka_unit_test(contract_wrt_conj_scalars),
        cmocka_unit_test(add_all),          cmocka_unit_test(trace_all),        cmocka_unit_test(rank16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
