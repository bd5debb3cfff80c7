/* LAPACK's GEMMs, on the idle cores.
 *
 * The workers run OpenBLAS single-threaded (blas.h), and OpenBLAS's own
 * threads are no help to one request: they are sized once per process.
 * So the daemon defines the Fortran GEMM symbols that LAPACK's drivers
 * call through the PLT (sgemm_, dgemm_, cgemm_, zgemm_; checked in
 * Debian's liblapack.so.3 and libopenblas.so.0 for OpenBLAS 0.3.21), and
 * the dynamic linker binds LAPACK's calls to these before OpenBLAS's.
 * Each is pb_gemm_cm: a large GEMM splits across idle pool threads
 * (kernels/par.h), exactly as the kernels' own do; with no thread idle,
 * or a small product, it is the one CBLAS call OpenBLAS's own entry point
 * would make.  Measured in process on 1024² f64, one helper lending
 * itself (time with ÷ without, two runs): geqrf 0.73, gesdd with vectors
 * 0.90-0.93, syevd 0.83-0.85, geev 0.99, gesdd values only 0.99.
 *
 * GEMV is left to OpenBLAS: split by rows or columns it comes out a few
 * ulps different from the whole call (OpenBLAS's kernels group rows by
 * the whole length), and a split gebrd measured no faster here.
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
