/* Activation functions of fused_dense and their derivatives.
 *
 * Each activation is written once, for float and double alike, through
 * <tgmath.h>.  The derivative takes the value the tape keeps: y for the
 * activations whose derivative follows from y (PB_ACT_FROM_Y), z for the
 * others, nothing for identity.  Care taken:
 *   - sigmoid, silu and gelu use the two-sided logistic, so no exp
 *     overflows and nothing cancels for large |z|;
 *   - gelu (tanh form) is evaluated as z·σ(2u), which equals
 *     z·(1 + tanh u)/2 without the cancellation of 1 + tanh u for z < 0;
 *   - gelu_erf uses erfc, softplus log1p, elu expm1;
 *   - the infinite limits are exact (gelu(-inf) = 0, not inf·0 = NaN);
 *   - relu′(0) = 0, and NaN propagates through values and derivatives.
 *
 * The bodies are branch-free selects, and the libm functions they call are
 * declared with their SIMD variants (glibc's libmvec, at most 4 ulp), so
 * the loops over them in kernels/ vectorise: GCC then calls the 4- or
 * 8-wide versions.
 *
 * libmvec's exp, expm1 and erfc hand every lane whose result under- or
 * overflows to the scalar function (with errno), some 10 ns a lane; with
 * |z| ~ 30, as W·x gives for unit-variance data, that is most lanes of
 * gelu's exp(-2|u|).  So exp, expm1 and erfc are called through guards
 * (pb_act_exp, pb_act_expm1n, pb_act_erfc) that give the limit the
 * scalar function returns (0, -1) for arguments beyond a bound, and feed
 * the vector function 0 there instead.  Every result is bitwise what it
 * was: the bounds lie inside libmvec's scalar range, where the scalar
 * result is exactly the limit (checked for every float and around the
 * double bounds).  exp's bound is where the result is 0 even as a
 * subnormal, so the lanes whose exp is subnormal (-104 < a < -87.3 in
 * float, -746 < a < -708.4 in double) still take libmvec's scalar path and
 * keep their exact values: a band of the argument that holds few lanes. */
#ifndef PB_ACT_H
#define PB_ACT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
#define PB_SIMD __attribute__((simd("notinbranch")))
#else
#define PB_SIMD /* clang: no libmvec declarations; the loops stay scalar */
#endif
/* Loops over activations: vectorise them, and build an AVX2 clone picked
 * at run time where the CPU has it. */
#define PB_OMP_SIMD _Pragma("omp simd")
#define PB_PRAGMA(x) _Pragma(#x)
#define PB_OMP_SIMD_SUM(var) PB_PRAGMA(omp simd reduction(+ : var))
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PB_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__) || defined(PB_TSAN)
/* ThreadSanitizer instruments the clones' ifunc resolver, which the dynamic
 * loader runs before TSan's runtime is up: a TSan build gets one version. */
#define PB_KERNEL_CLONES
#else
#define PB_KERNEL_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#ifdef __CUDACC__
/* CUDA (cuda/real.cu): the same functions for host and device, through
 * C++'s float and double overloads of exp, expm1, log1p, tanh, erfc, fabs
 * and isinf, which CUDA gives device versions of (no libmvec, no tgmath). */
#define PB_ACT_HD __host__ __device__
#else
PB_SIMD extern float expf(float);
PB_SIMD extern double exp(double);
PB_SIMD extern float expm1f(float);
PB_SIMD extern double expm1(double);
PB_SIMD extern float log1pf(float);
PB_SIMD extern double log1p(double);
PB_SIMD extern float tanhf(float);
PB_SIMD extern double tanh(double);
PB_SIMD extern float erfcf(float);
PB_SIMD extern double erfc(double);

#include <tgmath.h>
#endif

#define PB_ACT_TABLE(X)            \
    X(IDENTITY, "identity", NONE)  \
    X(RELU, "relu", Y)             \
    X(LEAKYRELU, "leakyrelu", Y)   \
    X(SIGMOID, "sigmoid", Y)       \
    X(TANH, "tanh", Y)             \
    X(GELU, "gelu", Z)             \
    X(GELU_ERF, "gelu_erf", Z)     \
    X(SILU, "silu", Z)             \
    X(SOFTPLUS, "softplus", Y)     \
    X(ELU, "elu", Y)

enum pb_act {
#define PB_X(sym, name, src) PB_ACT_##sym,
    PB_ACT_TABLE(PB_X)
#undef PB_X
    PB_NACTS
};

/* What the derivative needs. */
enum pb_act_src { PB_ACT_FROM_NONE, PB_ACT_FROM_Y, PB_ACT_FROM_Z };

extern const char *const pb_act_names[PB_NACTS + 1];
extern const enum pb_act_src pb_act_src[PB_NACTS];

#define PB_LEAKY_SLOPE 0.01
#define PB_SQRT_2_OVER_PI 0.797884560802865355879892119868763737
#define PB_GELU_C 0.044715
#define PB_INV_SQRT2 0.707106781186547524400844362104849039
#define PB_INV_SQRT_2PI 0.398942280401432677939946059934381868

/* The guards.  Beyond its bound each function's scalar result is exactly
 * the limit: float exp(a) < 2^-150 and double exp(a) < 2^-1075 (half the
 * least subnormal) round to 0; expm1 rounds to -1 long before its bound;
 * erfc(10.1) < 2^-150 and erfc(27.3) < 2^-1075.  libmvec leaves its vector
 * path at -87.34 and -708.4 for exp, -86.64 and -700 for expm1, 10.054 and
 * 27.226 for erfc (glibc 2.36), so each bound lies in the scalar range.
 *
 * The masks are integer arithmetic on the bits, not selects: GCC folds a
 * select on the argument into the select on the result and then calls the
 * vector function on the raw argument for every lane, as before. */
#ifndef __CUDACC__
#define PB_ACT_GUARDS(T, I, IMAX, SFX, EXP_B, EXPM1_B, ERFC_B)                            \
    static inline I pb_act_bits##SFX(T x)                                             \
    {                                                                                 \
        I i;                                                                          \
        memcpy(&i, &x, sizeof i);                                                     \
        return i;                                                                     \
    }                                                                                 \
    static inline T pb_act_from_bits##SFX(I i)                                        \
    {                                                                                 \
        T x;                                                                          \
        memcpy(&x, &i, sizeof x);                                                     \
        return x;                                                                     \
    }                                                                                 \
    /* All ones where x is a number (not NaN) with |x| > |bound| and the sign         \
     * of bound; all ones where `pos` and x is +0 or more. */                         \
    static inline I pb_act_beyond##SFX(T x, T bound, int pos)                         \
    {                                                                                 \
        const int w = (int)sizeof(I) * 8 - 1;                                         \
        I i = pb_act_bits##SFX(x), b = pb_act_bits##SFX(bound);                       \
        I mag = i & (IMAX), big = ((b & (IMAX)) - mag) >> w;                          \
        I nan = (pb_act_bits##SFX((T)INFINITY) - mag) >> w;                           \
        I side = ~((i ^ b) >> w), positive = pos ? ~(i >> w) : 0;                     \
        return ((big & side) | positive) & ~nan;                                      \
    }                                                                                 \
    /* y where m is 0, limit where m is all ones. */                                  \
    static inline T pb_act_pick##SFX(T y, I m, T limit)                               \
    {                                                                                 \
        return pb_act_from_bits##SFX((pb_act_bits##SFX(y) & ~m) |                     \
                                     (pb_act_bits##SFX(limit) & m));                  \
    }                                                                                 \
    static inline T pb_act_masked##SFX(T x, I m)                                      \
    {                                                                                 \
        return pb_act_from_bits##SFX(pb_act_bits##SFX(x) & ~m);                       \
    }                                                                                 \
    /* exp(a), for a <= 0. */                                                         \
    static inline T pb_act_exp##SFX(T a)                                              \
    {                                                                                 \
        I m = pb_act_beyond##SFX(a, (T)(EXP_B), 0);                                   \
        return pb_act_pick##SFX(exp(pb_act_masked##SFX(a, m)), m, (T)0);              \
    }                                                                                 \
    /* expm1(a) for a <= 0; +0 for a > 0 (elu discards it there; expm1 of a           \
     * large a would overflow). */                                                    \
    static inline T pb_act_expm1n##SFX(T a)                                           \
    {                                                                                 \
        I low = pb_act_beyond##SFX(a, (T)(EXPM1_B), 0);                               \
        I m = pb_act_beyond##SFX(a, (T)(EXPM1_B), 1);                                 \
        return pb_act_pick##SFX(expm1(pb_act_masked##SFX(a, m)), low, (T)-1);         \
    }                                                                                 \
    static inline T pb_act_erfc##SFX(T a)                                             \
    {                                                                                 \
        I m = pb_act_beyond##SFX(a, (T)(ERFC_B), 0);                                  \
        return pb_act_pick##SFX(erfc(pb_act_masked##SFX(a, m)), m, (T)0);             \
    }
PB_ACT_GUARDS(float, int32_t, INT32_MAX, f, -104.0, -88.0, 10.1)
PB_ACT_GUARDS(double, int64_t, INT64_MAX, , -746.0, -710.0, 27.3)
#undef PB_ACT_GUARDS
#define PB_ACT_EXP(x) _Generic((x), float: pb_act_expf, double: pb_act_exp)(x)
#define PB_ACT_EXPM1N(x) _Generic((x), float: pb_act_expm1nf, double: pb_act_expm1n)(x)
#define PB_ACT_ERFC(x) _Generic((x), float: pb_act_erfcf, double: pb_act_erfc)(x)
#else
/* The guards for CUDA: the same results as the C guards above, written as
 * selects (the bit masks only serve libmvec).  For a number a (not NaN):
 * exp gives 0 below its bound; expm1n gives -1 below its bound and +0 for
 * a >= +0 (-0 keeps expm1(-0) = -0); erfc gives 0 above its bound.  NaN
 * goes to the function.  The bounds are the C guards' (PB_ACT_GUARDS's
 * arguments). */
#define PB_ACT_DEVICE_GUARDS(T, EXP_B, EXPM1_B, ERFC_B)                        \
    PB_ACT_HD static inline T pb_act_exp(T a) { return a < (T)(EXP_B) ? (T)0 : exp(a); } \
    PB_ACT_HD static inline T pb_act_expm1n(T a)                               \
    {                                                                          \
        return a < (T)(EXPM1_B) ? (T)-1 : (a == a && !signbit(a)) ? (T)0 : expm1(a); \
    }                                                                          \
    PB_ACT_HD static inline T pb_act_erfc(T a) { return a > (T)(ERFC_B) ? (T)0 : erfc(a); }
PB_ACT_DEVICE_GUARDS(float, -104.0, -88.0, 10.1)
PB_ACT_DEVICE_GUARDS(double, -746.0, -710.0, 27.3)
#undef PB_ACT_DEVICE_GUARDS
#define PB_ACT_EXP(x) pb_act_exp(x)
#define PB_ACT_EXPM1N(x) pb_act_expm1n(x)
#define PB_ACT_ERFC(x) pb_act_erfc(x)
#endif

/* σ(z) and σ(-z) = 1 - σ(z) from one exp(-|z|), without overflow or
 * cancellation for either sign; e is exp(-|z|). */
#define PB_SIG_POS(T, z, e) ((z) >= 0 ? (T)1 / ((T)1 + (e)) : (e) / ((T)1 + (e)))
#define PB_SIG_NEG(T, z, e) ((z) >= 0 ? (e) / ((T)1 + (e)) : (T)1 / ((T)1 + (e)))
#define PB_SIGMOID(T, z) PB_SIG_POS(T, z, PB_ACT_EXP(-fabs(z)))

/* Activation value, for T = float or double. */
#define PB_ACT_VALUE_BODY(T)                                                   \
    switch (act) {                                                             \
    case PB_ACT_IDENTITY: return z;                                            \
    case PB_ACT_RELU: return z > 0 ? z : (z != z ? z : (T)0);                  \
    case PB_ACT_LEAKYRELU: return z > 0 ? z : (T)PB_LEAKY_SLOPE * z;           \
    case PB_ACT_SIGMOID: return PB_SIGMOID(T, z);                              \
    case PB_ACT_TANH: return tanh(z);                                          \
    case PB_ACT_GELU: {                                                        \
        T u = (T)PB_SQRT_2_OVER_PI * (z + (T)PB_GELU_C * z * z * z);           \
        T g = z * PB_SIGMOID(T, (T)2 * u);                                     \
        return isinf(z) ? (z > 0 ? z : (T)0) : g;                              \
    }                                                                          \
    case PB_ACT_GELU_ERF: {                                                    \
        T g = (T)0.5 * z * PB_ACT_ERFC(-z * (T)PB_INV_SQRT2);                  \
        return isinf(z) ? (z > 0 ? z : (T)0) : g;                              \
    }                                                                          \
    case PB_ACT_SILU: {                                                        \
        T g = z * PB_SIGMOID(T, z);                                            \
        return isinf(z) ? (z > 0 ? z : (T)0) : g;                              \
    }                                                                          \
    case PB_ACT_SOFTPLUS:                                                      \
        return (z > 0 ? z : (T)0) + log1p(PB_ACT_EXP(-fabs(z)));               \
    case PB_ACT_ELU: return z > 0 ? z : PB_ACT_EXPM1N(z);                      \
    default: return z;                                                         \
    }

/* Derivative act′(z), from s = y or z as pb_act_src says. */
#define PB_ACT_DERIV_BODY(T)                                                   \
    switch (act) {                                                             \
    case PB_ACT_IDENTITY: return (T)1;                                         \
    case PB_ACT_RELU: return s > 0 ? (T)1 : (s != s ? s : (T)0);               \
    case PB_ACT_LEAKYRELU: return s > 0 ? (T)1 : (s != s ? s : (T)PB_LEAKY_SLOPE); \
    case PB_ACT_SIGMOID: return s * ((T)1 - s);                                \
    case PB_ACT_TANH: return ((T)1 - s) * ((T)1 + s);                          \
    case PB_ACT_GELU: {                                                        \
        T u = (T)PB_SQRT_2_OVER_PI * (s + (T)PB_GELU_C * s * s * s);           \
        T du = (T)PB_SQRT_2_OVER_PI * ((T)1 + (T)(3 * PB_GELU_C) * s * s);     \
        T e = PB_ACT_EXP((T)-2 * fabs(u));                                     \
        T p = PB_SIG_POS(T, u, e), q = PB_SIG_NEG(T, u, e);                    \
        T pq = p * q;                                                          \
        /* pq underflows to 0 long before s·du overflows; skip the product */ \
        T d = pq == 0 ? p : p + (T)2 * s * du * pq;                            \
        return isinf(s) ? (s > 0 ? (T)1 : (T)0) : d;                           \
    }                                                                          \
    case PB_ACT_GELU_ERF: {                                                    \
        T d = (T)0.5 * PB_ACT_ERFC(-s * (T)PB_INV_SQRT2) +                     \
              s * (T)PB_INV_SQRT_2PI * PB_ACT_EXP((T)-0.5 * s * s);            \
        return isinf(s) ? (s > 0 ? (T)1 : (T)0) : d;                           \
    }                                                                          \
    case PB_ACT_SILU: {                                                        \
        T e = PB_ACT_EXP(-fabs(s));                                            \
        T p = PB_SIG_POS(T, s, e), q = PB_SIG_NEG(T, s, e);                    \
        T d = p * ((T)1 + s * q);                                              \
        return isinf(s) ? (s > 0 ? (T)1 : (T)0) : d;                           \
    }                                                                          \
    case PB_ACT_SOFTPLUS: return -PB_ACT_EXPM1N(-s);                           \
    case PB_ACT_ELU: return s > 0 ? (T)1 : s + (T)1;                           \
    default: return (T)1;                                                      \
    }

#ifdef __CUDACC__
PB_ACT_HD static inline float pb_act_valuef(int act, float z) { PB_ACT_VALUE_BODY(float) }
PB_ACT_HD static inline double pb_act_value(int act, double z) { PB_ACT_VALUE_BODY(double) }
PB_ACT_HD static inline float pb_act_derivf(int act, float s) { PB_ACT_DERIV_BODY(float) }
PB_ACT_HD static inline double pb_act_deriv(int act, double s) { PB_ACT_DERIV_BODY(double) }
#else
static inline float pb_act_valuef(int act, float z) { PB_ACT_VALUE_BODY(float) }
static inline double pb_act_value(int act, double z) { PB_ACT_VALUE_BODY(double) }
static inline float pb_act_derivf(int act, float s) { PB_ACT_DERIV_BODY(float) }
static inline double pb_act_deriv(int act, double s) { PB_ACT_DERIV_BODY(double) }
#endif

/* Run LOOP(A) with A the activation as a constant, so the activation's
 * switch folds away inside the loop. */
#define PB_ACT_DISPATCH(act, LOOP)                          \
    switch (act) {                                          \
    case PB_ACT_IDENTITY: { LOOP(PB_ACT_IDENTITY) } break;   \
    case PB_ACT_RELU: { LOOP(PB_ACT_RELU) } break;           \
    case PB_ACT_LEAKYRELU: { LOOP(PB_ACT_LEAKYRELU) } break; \
    case PB_ACT_SIGMOID: { LOOP(PB_ACT_SIGMOID) } break;     \
    case PB_ACT_TANH: { LOOP(PB_ACT_TANH) } break;           \
    case PB_ACT_GELU: { LOOP(PB_ACT_GELU) } break;           \
    case PB_ACT_GELU_ERF: { LOOP(PB_ACT_GELU_ERF) } break;   \
    case PB_ACT_SILU: { LOOP(PB_ACT_SILU) } break;           \
    case PB_ACT_SOFTPLUS: { LOOP(PB_ACT_SOFTPLUS) } break;   \
    case PB_ACT_ELU: { LOOP(PB_ACT_ELU) } break;             \
    default: break;                                         \
    }

#endif
