/* The execution device of the calling thread: where the CPU ops' shared
 * code allocates and computes while a GPU runs it.
 *
 * An op whose rule is written once for both devices (the tensor ops)
 * runs its CPU functions on a GPU worker inside pb_gpu_shared_forward /
 * pb_gpu_shared_reverse (gpu_ops.h): the inputs go to the device, the
 * thread's execution device becomes that GPU, and the code's few device
 * touch points follow it: pb_tensor_alloc, pb_tensor_zero and
 * pb_tensor_make_owned allocate and fill device memory, pb_strided,
 * pb_strided_dot and pb_gemm_cm run on the device, contract.c's scratch
 * is device memory, a scalar gradient is copied in; the factorizations'
 * work arrays, copies, matrix kernels and eigensolver follow it too
 * (factor_common.h).  Nothing else of that
 * code reads or writes tensor data (the host fake faults if it does).
 *
 * A backend failure inside (device memory exhausted, a failed device)
 * cannot travel through the CPU code's void passes: the first one is kept
 * here, later device work is skipped, and the wrapper reports it. */
#ifndef PB_GPU_EXEC_H
#define PB_GPU_EXEC_H

#include <stddef.h>

/* The GPU ordinal the calling thread executes on, or -1 (the CPU). */
int pb_exec_gpu(void);
/* Enter and leave a GPU's execution; leave returns the first failure
 * kept (0 if none) and makes the thread the CPU's again. */
void pb_exec_enter(int gpu);
int pb_exec_leave(void);
/* Host code inside a GPU's execution that must run as the CPU's (the
 * fake's LAPACK, whose GEMMs come back through pb_gemm_cm): pause returns
 * the device, resume makes it the thread's again; the failure kept stays. */
int pb_exec_pause(void);
void pb_exec_resume(int gpu);
/* Keep rc (a backend's PB_E* code) as the failure unless one is kept;
 * returns rc.  pb_exec_failed: one is kept (skip further device work). */
int pb_exec_fail(int rc);
int pb_exec_failed(void);

/* Device memory for the execution device, or NULL (the failure kept). */
void *pb_exec_alloc(size_t bytes);
void pb_exec_free(void *p);

/* The device side of the touch points (cuda/exec.c), called by them when
 * pb_exec_gpu() >= 0; each does nothing once a failure is kept. */
#include "../kernels/strided.h"
int pb__exec_tensor_alloc(pb_tensor_t *t, pb_dtype_t d, int rank, const uint64_t *shape, char order, bool zero);
int pb__exec_make_owned(pb_tensor_t *t);
void pb__exec_zero(void *p, size_t n);
void pb__exec_h2d(void *dst, const void *src, size_t n);
void pb__exec_strided(pb_dtype_t d, const pb_loop_t *L, void *dst, const void *src, bool conj, pb_scalar_t alpha,
                      const void *src2, pb_scalar_t beta, bool accumulate);
pb_scalar_t pb__exec_dot(pb_dtype_t d, const pb_loop_t *L, const void *a, bool conj, const void *b);
struct pb_gpu_fz;
void pb__exec_fz(const struct pb_gpu_fz *k, double out[2]);
/* The Hermitian eigensolver (gpu.h's syevd); returns its info (0 once a
 * failure is kept: the wrapper reports that). */
int pb__exec_syevd(pb_dtype_t d, bool vectors, int n, void *a, int lda, void *w);
/* The SVD of the m×n a, m >= n (gpu.h's gesvd); its info, as syevd's. */
int pb__exec_gesvd(pb_dtype_t d, bool vectors, int m, int n, void *a, int lda, void *s, void *u, int ldu, void *vt,
                   int ldvt);
/* n bytes of device memory into host memory, waited for. */
void pb__exec_d2h(void *dst, const void *src, size_t n);
void pb__exec_gemm(pb_dtype_t d, char ta, char tb, int m, int n, int k, pb_scalar_t alpha, const void *a, int lda,
                   const void *b, int ldb, pb_scalar_t beta, void *c, int ldc);

#endif
