/* One body per dtype: the convention every kernel in kernels/ follows.
 *
 * A kernel written once for an element type T lives in a body header
 * (`*_t.h`, no include guard).  A .c file instantiates it for the four
 * dtypes by naming it and including this file:
 *
 *     #define PB_T_BODY "factor_qr_t.h"
 *     #include "dtype_t.h"
 *
 * which includes the body once per dtype with the parameters below set,
 * and clears them after each.  Define PB_T_REAL_ONLY as well for a body
 * that exists for f32 and f64 only.  The complex dtypes come first, so a
 * real body may call the complex instance of its own functions (real eig
 * finishes in complex arithmetic): c, z, s, d.
 *
 * The caller reaches the instances through arrays indexed by pb_dtype_t,
 * never through a switch or a chain of tests:
 *
 *     static const fwd_fn fwd[PB_NDTYPES] = PB_T_FNS(qr_forward);
 *     return fwd[c->dtype](c, tape, err);
 *
 * (PB_T_FNS_REAL for real-only bodies: the complex slots are NULL.)  The
 * lookup happens once per call; inner loops stay inside one instance.
 *
 * Parameters a body sees
 *   T          the element type           RT, CT  its real type, the complex of RT
 *   DT         T's pb_dtype_t             RDT, CDT  those of RT and CT
 *   CPLX       1 for complex T, else 0    ACC     accumulator (double or double complex)
 *   SFX        name suffix _s _d _c _z    CSFX    the suffix of CT (_c or _z)
 *   MSFX       libm's suffix for RT (f, or nothing: expf, exp)
 *   LP, LP_CHAR  the BLAS/LAPACK letter (s d c z), as a token and a char
 *   WORD, LANES  an unsigned integer as wide as T and how many T fill 16
 *              bytes (LANES 1: no vector path; WORD then unused)
 * and helpers built on them
 *   FN(name)   name##SFX: the body's own (usually static) functions
 *   LAPACK(x)  LAPACKE_<LP>x      CBLAS(x)  cblas_<LP>x
 *   RE, IM     real and imaginary part as double   ABS  |x| as double
 *   CONJ(x)    conjugate (x itself for real T)     SCAL(x)  a CBLAS scalar
 *   TSCALAR(s) a pb_scalar_t as T (the imaginary part dropped for real T)
 * A body undefines only the macros of its own. */
#ifndef PB_DTYPE_T_H
#define PB_DTYPE_T_H

#include "cmplx.h"
#include <stdint.h>

#include "tensor.h"

#define PB_CAT_(a, b) a##b
#define PB_CAT(a, b) PB_CAT_(a, b)
/* The instances of `name`, by dtype. */
#define PB_T_FNS(name) {[PB_F32] = name##_s, [PB_F64] = name##_d, [PB_C64] = name##_c, [PB_C128] = name##_z}
#define PB_T_FNS_REAL(name) {[PB_F32] = name##_s, [PB_F64] = name##_d}

#endif

#ifdef PB_T_BODY

#define FN(name) PB_CAT(name, SFX)
#define LAPACK(name) PB_CAT(LAPACKE_, PB_CAT(LP, name))
#define CBLAS(name) PB_CAT(cblas_, PB_CAT(LP, name))

#ifndef PB_T_REAL_ONLY
/* ---- c: float complex ---- */
#define T float complex
#define RT float
#define CT float complex
#define DT PB_C64
#define RDT PB_F32
#define CDT PB_C64
#define CPLX 1
#define ACC double complex
#define SFX _c
#define CSFX _c
#define MSFX f
#define LP c
#define LP_CHAR 'c'
#define WORD uint64_t
#define LANES 2
#define RE(x) creal(x)
#define IM(x) cimag(x)
#define ABS(x) cabs(x)
#define CONJ(x) conjf(x)
#define SCAL(x) (&(x))
#define TSCALAR(s) CMPLXF((float)(s).re, (float)(s).im)
#include "dtype_inst.h"

/* ---- z: double complex ---- */
#define T double complex
#define RT double
#define CT double complex
#define DT PB_C128
#define RDT PB_F64
#define CDT PB_C128
#define CPLX 1
#define ACC double complex
#define SFX _z
#define CSFX _z
#define MSFX
#define LP z
#define LP_CHAR 'z'
#define WORD uint64_t
#define LANES 1
#define RE(x) creal(x)
#define IM(x) cimag(x)
#define ABS(x) cabs(x)
#define CONJ(x) conj(x)
#define SCAL(x) (&(x))
#define TSCALAR(s) CMPLX((s).re, (s).im)
#include "dtype_inst.h"
#endif /* !PB_T_REAL_ONLY */

/* ---- s: float ---- */
#define T float
#define RT float
#define CT float complex
#define DT PB_F32
#define RDT PB_F32
#define CDT PB_C64
#define CPLX 0
#define ACC double
#define SFX _s
#define CSFX _c
#define MSFX f
#define LP s
#define LP_CHAR 's'
#define WORD uint32_t
#define LANES 4
#define RE(x) ((double)(x))
#define IM(x) 0.0
#define ABS(x) fabs((double)(x))
#define CONJ(x) (x)
#define SCAL(x) (x)
#define TSCALAR(s) ((float)(s).re)
#include "dtype_inst.h"

/* ---- d: double ---- */
#define T double
#define RT double
#define CT double complex
#define DT PB_F64
#define RDT PB_F64
#define CDT PB_C128
#define CPLX 0
#define ACC double
#define SFX _d
#define CSFX _z
#define MSFX
#define LP d
#define LP_CHAR 'd'
#define WORD uint64_t
#define LANES 2
#define RE(x) ((double)(x))
#define IM(x) 0.0
#define ABS(x) fabs((double)(x))
#define CONJ(x) (x)
#define SCAL(x) (x)
#define TSCALAR(s) ((s).re)
#include "dtype_inst.h"

#undef FN
#undef LAPACK
#undef CBLAS
#undef PB_T_BODY
#undef PB_T_REAL_ONLY
#endif /* PB_T_BODY */
