/* <complex.h>, with C11's CMPLX and CMPLXF where the C library leaves
 * them out (glibc defines them only for GCC ≥ 4.7, not for clang, which
 * builds the fuzz target).  __builtin_complex keeps an infinite or NaN
 * imaginary part exact, which x + I·y would not. */
#ifndef PB_CMPLX_H
#define PB_CMPLX_H

#include <complex.h>

#ifndef CMPLX
#define CMPLX(x, y) __builtin_complex((double)(x), (double)(y))
#endif
#ifndef CMPLXF
#define CMPLXF(x, y) __builtin_complex((float)(x), (float)(y))
#endif

#endif
