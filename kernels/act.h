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
 * 8-wide versions. */
#ifndef PB_ACT_H
#define PB_ACT_H

#include <math.h>

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
#define PB_KERNEL_CLONES __attribute__((target_clones("avx2", "default")))
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

/* σ(z) and σ(-z) = 1 - σ(z) from one exp(-|z|), without overflow or
 * cancellation for either sign; e is exp(-|z|). */
#define PB_SIG_POS(T, z, e) ((z) >= 0 ? (T)1 / ((T)1 + (e)) : (e) / ((T)1 + (e)))
#define PB_SIG_NEG(T, z, e) ((z) >= 0 ? (e) / ((T)1 + (e)) : (T)1 / ((T)1 + (e)))
#define PB_SIGMOID(T, z) PB_SIG_POS(T, z, exp(-fabs(z)))

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
        T g = (T)0.5 * z * erfc(-z * (T)PB_INV_SQRT2);                         \
        return isinf(z) ? (z > 0 ? z : (T)0) : g;                              \
    }                                                                          \
    case PB_ACT_SILU: {                                                        \
        T g = z * PB_SIGMOID(T, z);                                            \
        return isinf(z) ? (z > 0 ? z : (T)0) : g;                              \
    }                                                                          \
    case PB_ACT_SOFTPLUS:                                                      \
        return (z > 0 ? z : (T)0) + log1p(exp(-fabs(z)));                      \
    case PB_ACT_ELU: return z > 0 ? z : expm1(z);                              \
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
        T e = exp((T)-2 * fabs(u));                                            \
        T p = PB_SIG_POS(T, u, e), q = PB_SIG_NEG(T, u, e);                    \
        T pq = p * q;                                                          \
        /* pq underflows to 0 long before s·du overflows; skip the product */ \
        T d = pq == 0 ? p : p + (T)2 * s * du * pq;                            \
        return isinf(s) ? (s > 0 ? (T)1 : (T)0) : d;                           \
    }                                                                          \
    case PB_ACT_GELU_ERF: {                                                    \
        T d = (T)0.5 * erfc(-s * (T)PB_INV_SQRT2) +                            \
              s * (T)PB_INV_SQRT_2PI * exp((T)-0.5 * s * s);                   \
        return isinf(s) ? (s > 0 ? (T)1 : (T)0) : d;                           \
    }                                                                          \
    case PB_ACT_SILU: {                                                        \
        T e = exp(-fabs(s));                                                   \
        T p = PB_SIG_POS(T, s, e), q = PB_SIG_NEG(T, s, e);                    \
        T d = p * ((T)1 + s * q);                                              \
        return isinf(s) ? (s > 0 ? (T)1 : (T)0) : d;                           \
    }                                                                          \
    case PB_ACT_SOFTPLUS: return -expm1(-s);                                   \
    case PB_ACT_ELU: return s > 0 ? (T)1 : s + (T)1;                           \
    default: return (T)1;                                                      \
    }

static inline float pb_act_valuef(int act, float z) { PB_ACT_VALUE_BODY(float) }
static inline double pb_act_value(int act, double z) { PB_ACT_VALUE_BODY(double) }
static inline float pb_act_derivf(int act, float s) { PB_ACT_DERIV_BODY(float) }
static inline double pb_act_deriv(int act, double s) { PB_ACT_DERIV_BODY(double) }

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
