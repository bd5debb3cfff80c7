/* unit.act: every activation of fused_dense and its derivative
 * (kernels/act.h), in float and double.
 *
 * Tolerances: double derivatives against a central difference of the
 * double value, |d - fd| <= 1e-8·max(1, |d|) (the difference's own error is
 * about 1e-10 at h = 1e-5); values against independent textbook formulas
 * where those are accurate, 4 ulp-ish (1e-14 relative) in double and
 * 2e-6 relative in float; float derivatives against the double ones,
 * 1e-5 relative + 1e-6 absolute.
 *
 * The sweep runs values and derivatives through loops vectorised as the
 * kernels' are (libmvec), over ±1e-3..±1e4, and compares them with long
 * double references: 128 eps·(1 + |z|) relative (the exponents of gelu and
 * gelu_erf carry an error that grows with |z|), plus 64 of the least
 * subnormal for values (results in the subnormal band) and 4 eps for
 * derivatives (those from y cancel in 1 - y, 1 + y). */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "kernels/act.h"

static double src_of(int act, double z)
{
    return pb_act_src[act] == PB_ACT_FROM_Y ? pb_act_value(act, z) : z;
}

static float src_off(int act, float z)
{
    return pb_act_src[act] == PB_ACT_FROM_Y ? pb_act_valuef(act, z) : z;
}

/* Points away from the kinks of relu, leakyrelu and elu (at 0). */
static double point(int i)
{
    return -9.0 + 18.0 * (i + 0.37) / 400.0;
}

static void derivative_matches_difference(void **state)
{
    (void)state;
    for (int act = 0; act < PB_NACTS; act++) {
        for (int i = 0; i < 400; i++) {
            double z = point(i), h = 1e-5;
            double fd = (pb_act_value(act, z + h) - pb_act_value(act, z - h)) / (2 * h);
            double d = pb_act_deriv(act, src_of(act, z));
            if (fabs(d - fd) > 1e-8 * fmax(1.0, fabs(d)))
                fail_msg("%s at z=%g: derivative %.17g, difference %.17g", pb_act_names[act], z, d, fd);
        }
    }
}

static double ref_value(int act, double z)
{
    switch (act) {
    case PB_ACT_IDENTITY: return z;
    case PB_ACT_RELU: return z > 0 ? z : 0;
    case PB_ACT_LEAKYRELU: return z > 0 ? z : 0.01 * z;
    case PB_ACT_SIGMOID: return 1 / (1 + exp(-z));
    case PB_ACT_TANH: return tanh(z);
    case PB_ACT_GELU: return 0.5 * z * (1 + tanh(sqrt(2 / M_PI) * (z + 0.044715 * z * z * z)));
    case PB_ACT_GELU_ERF: return 0.5 * z * (1 + erf(z / sqrt(2.0)));
    case PB_ACT_SILU: return z / (1 + exp(-z));
    case PB_ACT_SOFTPLUS: return log(1 + exp(z));
    case PB_ACT_ELU: return z > 0 ? z : exp(z) - 1;
    }
    return NAN;
}

static void values_match_textbook(void **state)
{
    (void)state;
    /* On [0, 3] the textbook formulas have no cancellation. */
    for (int act = 0; act < PB_NACTS; act++) {
        for (int i = 0; i <= 300; i++) {
            double z = i / 100.0;
            double v = pb_act_value(act, z), r = ref_value(act, z);
            if (fabs(v - r) > 1e-14 * fmax(1e-300, fabs(r)) + 1e-300)
                fail_msg("%s(%g) = %.17g, expected %.17g", pb_act_names[act], z, v, r);
            float vf = pb_act_valuef(act, (float)z);
            if (fabs(vf - r) > 2e-6 * fabs(r) + 1e-7)
                fail_msg("%s(%gf) = %.9g, expected %.9g", pb_act_names[act], z, vf, r);
        }
    }
}

/* For z < 0 the careful forms keep their relative accuracy where the
 * textbook ones cancel: compare with long-double references. */
static void negative_tails_accurate(void **state)
{
    (void)state;
    /* The references need long double beyond double; valgrind runs x87
     * arithmetic in double, where this comparison means nothing. */
    volatile long double one = 1, tiny = 0x1p-60L;
    if (one + tiny == one) {
        print_message("long double has no more precision than double here (valgrind?): skipped\n");
        skip();
    }
    for (int i = 1; i <= 60; i++) {
        long double z = -0.5L * i;
        long double u = sqrtl(2 / (long double)M_PI) * (z + 0.044715L * z * z * z);
        long double gelu = z / (1 + expl(-2 * u));
        double g = pb_act_value(PB_ACT_GELU, (double)z);
        assert_true(fabsl(g - gelu) <= 1e-13L * fabsl(gelu) + 1e-300L);
        long double ge = 0.5L * z * erfcl(-z / sqrtl(2));
        double e = pb_act_value(PB_ACT_GELU_ERF, (double)z);
        /* erfc's condition number at z/√2 is about z², so rounding z/√2
         * alone costs z²·eps. */
        assert_true(fabsl(e - ge) <= 2e-16L * (4 + z * z) * fabsl(ge) + 1e-300L);
        long double sp = log1pl(expl(z));
        assert_true(fabsl(pb_act_value(PB_ACT_SOFTPLUS, (double)z) - sp) <= 1e-14L * sp);
        long double sg = 1 / (1 + expl(-z));
        assert_true(fabsl(pb_act_value(PB_ACT_SIGMOID, (double)z) - sg) <= 1e-14L * sg);
    }
}

static void float_matches_double(void **state)
{
    (void)state;
    for (int act = 0; act < PB_NACTS; act++) {
        for (int i = 0; i < 400; i++) {
            float z = (float)point(i);
            double d = pb_act_deriv(act, src_of(act, z));
            float f = pb_act_derivf(act, src_off(act, z));
            if (fabs(f - d) > 1e-5 * fabs(d) + 1e-6)
                fail_msg("%s'(%gf) = %.9g, double gives %.9g", pb_act_names[act], z, f, d);
        }
    }
}

/* No overflow, no NaN from finite inputs, and exact limits at ±inf. */
static void extremes(void **state)
{
    (void)state;
    const double big[] = {-1e300, -1e30, -1000, -100, -40, 40, 100, 1000, 1e30, 1e300};
    for (int act = 0; act < PB_NACTS; act++) {
        for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
            double z = big[i];
            double v = pb_act_value(act, z), d = pb_act_deriv(act, src_of(act, z));
            assert_false(isnan(v));
            assert_false(isnan(d));
            assert_true(isfinite(d));
            float zf = (float)fmax(fmin(z, 3e38), -3e38);
            assert_false(isnan(pb_act_valuef(act, zf)));
            assert_false(isnan(pb_act_derivf(act, src_off(act, zf))));
        }
        double pinf = pb_act_value(act, INFINITY), ninf = pb_act_value(act, -INFINITY);
        assert_false(isnan(pinf));
        assert_false(isnan(ninf));
        assert_false(isnan(pb_act_deriv(act, src_of(act, INFINITY))));
        assert_false(isnan(pb_act_deriv(act, src_of(act, -INFINITY))));
        /* NaN propagates through value and derivative. */
        assert_true(isnan(pb_act_value(act, NAN)));
        if (act != PB_ACT_IDENTITY)
            assert_true(isnan(pb_act_deriv(act, NAN)));
    }
    assert_true(pb_act_value(PB_ACT_GELU, -INFINITY) == 0);
    assert_true(pb_act_value(PB_ACT_GELU_ERF, -INFINITY) == 0);
    assert_true(pb_act_value(PB_ACT_SILU, -INFINITY) == 0);
    assert_true(pb_act_value(PB_ACT_SOFTPLUS, 1000) == 1000);
    assert_true(pb_act_value(PB_ACT_SOFTPLUS, -1000) == 0);
    assert_true(pb_act_value(PB_ACT_SIGMOID, -1000) == 0);
    assert_true(pb_act_value(PB_ACT_SIGMOID, 1000) == 1);
    assert_true(pb_act_value(PB_ACT_ELU, -INFINITY) == -1);
    assert_true(pb_act_deriv(PB_ACT_GELU, 50) == 1);
    assert_true(pb_act_deriv(PB_ACT_GELU, -50) == 0);
    assert_true(pb_act_deriv(PB_ACT_SOFTPLUS, pb_act_value(PB_ACT_SOFTPLUS, 1000)) == 1);
}

static void relu_kink(void **state)
{
    (void)state;
    assert_true(pb_act_deriv(PB_ACT_RELU, 0.0) == 0);
    assert_true(pb_act_derivf(PB_ACT_RELU, 0.0f) == 0);
    assert_true(pb_act_deriv(PB_ACT_RELU, pb_act_value(PB_ACT_RELU, -3)) == 0);
    assert_true(pb_act_deriv(PB_ACT_RELU, pb_act_value(PB_ACT_RELU, 3)) == 1);
    assert_true(pb_act_deriv(PB_ACT_LEAKYRELU, pb_act_value(PB_ACT_LEAKYRELU, -3)) == 0.01);
    assert_true(pb_act_value(PB_ACT_LEAKYRELU, -3) == -0.03);
    assert_true(pb_act_deriv(PB_ACT_ELU, pb_act_value(PB_ACT_ELU, 2)) == 1);
}

/* The activations over arrays, in loops vectorised as fused_dense's are. */
#define VEC_FNS(T, SFX)                                                                          \
    PB_KERNEL_CLONES static void vec_value##SFX(int act, const T *z, T *y, size_t n)            \
    {                                                                                            \
        PB_ACT_DISPATCH(act, VEC_VALUE_LOOP)                                                     \
    }                                                                                            \
    PB_KERNEL_CLONES static void vec_deriv##SFX(int act, const T *s, T *d, size_t n)            \
    {                                                                                            \
        PB_ACT_DISPATCH(act, VEC_DERIV_LOOP)                                                     \
    }
#define VEC_VALUE_LOOP(A) PB_OMP_SIMD for (size_t i = 0; i < n; i++) y[i] = ACT_VALUE(A, z[i]);
#define VEC_DERIV_LOOP(A) PB_OMP_SIMD for (size_t i = 0; i < n; i++) d[i] = ACT_DERIV(A, s[i]);
#define ACT_VALUE pb_act_valuef
#define ACT_DERIV pb_act_derivf
VEC_FNS(float, f)
#undef ACT_VALUE
#undef ACT_DERIV
#define ACT_VALUE pb_act_value
#define ACT_DERIV pb_act_deriv
VEC_FNS(double, d)

static long double ref_sig(long double z)
{
    return z >= 0 ? 1 / (1 + expl(-z)) : expl(z) / (1 + expl(z));
}

/* act(z) and act′(z) in long double, from the definitions. */
static void ref_long(int act, long double z, long double *v, long double *d)
{
    long double u = sqrtl(2 / (long double)M_PI) * (z + 0.044715L * z * z * z);
    long double du = sqrtl(2 / (long double)M_PI) * (1 + 3 * 0.044715L * z * z);
    long double p = ref_sig(2 * u), phi = expl(-z * z / 2) / sqrtl(2 * (long double)M_PI);
    switch (act) {
    case PB_ACT_IDENTITY: *v = z, *d = 1; break;
    case PB_ACT_RELU: *v = z > 0 ? z : 0, *d = z > 0; break;
    case PB_ACT_LEAKYRELU: *v = z > 0 ? z : 0.01L * z, *d = z > 0 ? 1 : 0.01L; break;
    case PB_ACT_SIGMOID: *v = ref_sig(z), *d = ref_sig(z) * ref_sig(-z); break;
    case PB_ACT_TANH: *v = tanhl(z), *d = 1 / (coshl(z) * coshl(z)); break;
    case PB_ACT_GELU: *v = z * p, *d = p + 2 * z * du * p * ref_sig(-2 * u); break;
    case PB_ACT_GELU_ERF: *v = 0.5L * z * erfcl(-z / sqrtl(2)), *d = 0.5L * erfcl(-z / sqrtl(2)) + z * phi; break;
    case PB_ACT_SILU: *v = z * ref_sig(z), *d = ref_sig(z) * (1 + z * ref_sig(-z)); break;
    case PB_ACT_SOFTPLUS: *v = (z > 0 ? z : 0) + log1pl(expl(-fabsl(z))), *d = ref_sig(z); break;
    case PB_ACT_ELU: *v = z > 0 ? z : expm1l(z), *d = z > 0 ? 1 : expl(z); break;
    default: *v = *d = NAN;
    }
}

/* ±1e-3..±1e4 in 20 steps a decade, 0, and a fine grid over ±120 where the
 * exps' arguments cross libmvec's bounds; n is at most 1200. */
static size_t sweep_points(double *z)
{
    size_t n = 0;
    z[n++] = 0;
    for (int k = -60; k <= 80; k++) {
        z[n++] = pow(10, k / 20.0);
        z[n++] = -pow(10, k / 20.0);
    }
    for (int k = -320; k <= 320; k++)
        z[n++] = k * 0.37 + 0.001;
    return n;
}

#define SWEEP_MAX 1200

static void check_sweep(int act, int dbl, const double *z, const double *v, const double *d, size_t n)
{
    long double eps = dbl ? DBL_EPSILON : FLT_EPSILON, tiny = dbl ? 0x1p-1074L : 0x1p-149L;
    for (size_t i = 0; i < n; i++) {
        long double rv, rd;
        ref_long(act, z[i], &rv, &rd);
        long double rtol = 128 * eps * (1 + fabsl((long double)z[i]));
        if (fabsl(v[i] - rv) > rtol * fabsl(rv) + 64 * tiny)
            fail_msg("%s(%.9g) = %.17g, %s; expected %.17Lg", pb_act_names[act], z[i], v[i], dbl ? "double" : "float",
                     rv);
        if (fabsl(d[i] - rd) > rtol * fabsl(rd) + 4 * eps)
            fail_msg("%s'(%.9g) = %.17g, %s; expected %.17Lg", pb_act_names[act], z[i], d[i], dbl ? "double" : "float",
                     rd);
    }
}

/* Vectorised values and derivatives against long double, over a sweep
 * that reaches far into the ranges where the exps underflow. */
static void sweep_matches_long_double(void **state)
{
    (void)state;
    volatile long double one = 1, tiny = 0x1p-60L;
    if (one + tiny == one) {
        print_message("long double has no more precision than double here (valgrind?): skipped\n");
        skip();
    }
    double z[SWEEP_MAX], v[SWEEP_MAX], d[SWEEP_MAX], s[SWEEP_MAX];
    float zf[SWEEP_MAX], vf[SWEEP_MAX], df[SWEEP_MAX], sf[SWEEP_MAX];
    size_t n = sweep_points(z);
    for (int act = 0; act < PB_NACTS; act++) {
        vec_valued(act, z, v, n);
        for (size_t i = 0; i < n; i++)
            s[i] = pb_act_src[act] == PB_ACT_FROM_Y ? v[i] : z[i];
        vec_derivd(act, s, d, n);
        check_sweep(act, 1, z, v, d, n);

        double zd[SWEEP_MAX], vd[SWEEP_MAX], dd[SWEEP_MAX];
        for (size_t i = 0; i < n; i++)
            zf[i] = (float)z[i];
        vec_valuef(act, zf, vf, n);
        for (size_t i = 0; i < n; i++)
            sf[i] = pb_act_src[act] == PB_ACT_FROM_Y ? vf[i] : zf[i];
        vec_derivf(act, sf, df, n);
        for (size_t i = 0; i < n; i++)
            zd[i] = zf[i], vd[i] = vf[i], dd[i] = df[i];
        check_sweep(act, 0, zd, vd, dd, n);

        /* The scalar calls (the loops' remainders) agree with libm's. */
        for (size_t i = 0; i < n; i++) {
            double sv = pb_act_value(act, z[i]);
            float svf = pb_act_valuef(act, zf[i]);
            assert_true(fabs(sv - v[i]) <= 8 * DBL_EPSILON * fabs(v[i]) + 0x1p-1070);
            assert_true(fabsf(svf - vf[i]) <= 8 * FLT_EPSILON * fabsf(vf[i]) + 0x1p-145f);
        }
    }
}

/* ±inf and NaN give, vectorised, what the scalar code gives. */
static void vector_extremes_as_scalar(void **state)
{
    (void)state;
    double z[8] = {INFINITY, -INFINITY, NAN, -NAN, INFINITY, -INFINITY, NAN, 0}, v[8], d[8], s[8];
    float zf[8], vf[8], df[8], sf[8];
    for (int act = 0; act < PB_NACTS; act++) {
        vec_valued(act, z, v, 8);
        for (size_t i = 0; i < 8; i++) {
            zf[i] = (float)z[i];
            s[i] = pb_act_src[act] == PB_ACT_FROM_Y ? v[i] : z[i];
        }
        vec_derivd(act, s, d, 8);
        vec_valuef(act, zf, vf, 8);
        for (size_t i = 0; i < 8; i++)
            sf[i] = pb_act_src[act] == PB_ACT_FROM_Y ? vf[i] : zf[i];
        vec_derivf(act, sf, df, 8);
        for (size_t i = 0; i < 8; i++) {
            double ev = pb_act_value(act, z[i]), ed = pb_act_deriv(act, s[i]);
            float evf = pb_act_valuef(act, zf[i]), edf = pb_act_derivf(act, sf[i]);
            if (!(isnan(ev) ? isnan(v[i]) : v[i] == ev) || !(isnan(ed) ? isnan(d[i]) : d[i] == ed) ||
                !(isnan(evf) ? isnan(vf[i]) : vf[i] == evf) || !(isnan(edf) ? isnan(df[i]) : df[i] == edf))
                fail_msg("%s at %g: vectorised %g %g %g %g, scalar %g %g %g %g", pb_act_names[act], z[i], v[i], d[i],
                         vf[i], df[i], ev, ed, evf, edf);
            if (isnan(z[i]))
                assert_true(isnan(v[i]) && isnan(vf[i]) && (act == PB_ACT_IDENTITY || (isnan(d[i]) && isnan(df[i]))));
        }
    }
}

/* Beyond the underflow bounds no lane leaves libmvec's vector path: that
 * path is the scalar function, which reports the underflow in errno. */
static void no_scalar_fallback(void **state)
{
    (void)state;
    double z[64], v[64], d[64];
    float zf[64], vf[64], df[64];
    for (int i = 0; i < 64; i++) {
        static const double mag[] = {30, 60, 100, 300, 1000, 3000, 1e4, 1e30};
        z[i] = (i & 1 ? -1 : 1) * mag[(i / 2) % 8];
        zf[i] = (float)z[i];
    }
    /* Built with -fno-math-errno, GCC takes the libm calls for ones that
     * leave errno alone: read and write it as volatile. */
    volatile int *err = &errno;
    for (int act = 0; act < PB_NACTS; act++) {
        *err = 0;
        vec_valued(act, z, v, 64);
        vec_derivd(act, pb_act_src[act] == PB_ACT_FROM_Y ? v : z, d, 64);
        vec_valuef(act, zf, vf, 64);
        vec_derivf(act, pb_act_src[act] == PB_ACT_FROM_Y ? vf : zf, df, 64);
        if (*err != 0)
            fail_msg("%s: errno %d, a lane took libm's scalar path", pb_act_names[act], *err);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(derivative_matches_difference), cmocka_unit_test(values_match_textbook),
        cmocka_unit_test(negative_tails_accurate),        cmocka_unit_test(float_matches_double),
        cmocka_unit_test(extremes),                       cmocka_unit_test(relu_kink),
        cmocka_unit_test(sweep_matches_long_double),      cmocka_unit_test(vector_extremes_as_scalar),
        cmocka_unit_test(no_scalar_fallback),
    };
    return cmocka_run_group_tests_name("unit.act", tests, NULL, NULL);
}
