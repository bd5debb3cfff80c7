/* LAPACK's GEMMs and GEMVs, on the idle cores.
 *
 * The workers run OpenBLAS single-threaded (blas.h), and OpenBLAS's own
 * threads are no help to one request: they are sized once per process.
 * So the daemon defines the Fortran GEMM and GEMV symbols that LAPACK's
 * drivers call through the PLT (?gemm_ and ?gemv_; ?gemm_ checked in
 * Debian's liblapack.so.3 and libopenblas.so.0 for OpenBLAS 0.3.21), and
 * the dynamic linker binds LAPACK's calls to these before OpenBLAS's.
 * Each is pb_gemm_cm: a large GEMM splits across idle pool threads
 * (kernels/par.h), exactly as the kernels' own do, and its result does not
 * depend on how many are idle (blas.c); a small product is the one CBLAS
 * call OpenBLAS's own entry point would make.  Measured in process on
 * 1024² f64, one helper lending itself (time with ÷ without, two runs):
 * geqrf 0.73, gesdd with vectors 0.90-0.93, syevd 0.83-0.85, geev 0.99,
 * gesdd values only 0.99.
 *
 * Each ?gemv_ is pb_gemv_cm: a double or complex GEMV of 64 Ki elements
 * or more splits along y at boundaries where OpenBLAS's kernels give
 * bitwise the whole call's result (blas.c says which; sgemv stays whole).
 * That is half of gebrd's work (the SVD's bidiagonal reduction) and much
 * of gehrd's.  Through the socket, a
 * 1024² f64 svd_vals alone takes 203-210 ms instead of 238-265, 0.75-0.77
 * of two at once instead of 0.87-0.96 (bench_e2e, Zen kernels), or 127-130
 * ms instead of 165-167, 0.67-0.69 instead of 0.90-0.92 (Haswell kernels);
 * two at once as before.  Bound by memory: with the host's memory busy,
 * 0.85-0.89 with the split and without.
 * symv (sytrd, the eigh reduction) is left whole: a split of its one
 * stored triangle would not add up as the whole call does.
 *
 * Linked in by pb_blas_init_threads, which names pb__blas_lapack_linked. */
#include <ctype.h>

#include "blas.h"
#include "op.h"

static char fortran_op(char t)
{
    return (char)toupper((unsigned char)t);
}

#define PB_T_BODY "blas_lapack_t.h"
#include "dtype_t.h"

void pb__blas_lapack_linked(void)
{
}
