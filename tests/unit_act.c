/* unit.act: every activation of fused_dense and its derivative
 * (kernels/act.h), in float and double.
 *
 * Tolerances: double derivatives against a central difference of the
 * double value, |d - fd| <= 1e-8·max(1, |d|) (the difference's own error is
 * about 1e-10 at h = 1e-5); values against independent textbook formulas
 * where those are accurate, 4 ulp-ish (1e-14 relative) in double and
 * 2e-6 relative in float; float derivatives against the double ones,
 * 1e-5 relative + 1e-6 absolute. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(derivative_matches_difference), cmocka_unit_test(values_match_textbook),
        cmocka_unit_test(negative_tails_accurate),        cmocka_unit_test(float_matches_double),
        cmocka_unit_test(extremes),                       cmocka_unit_test(relu_kink),
    };
    return cmocka_run_group_tests_name("unit.act", tests, NULL, NULL);
}
