/* What the GPU ops share: device tensors, copies to and from the host, the
 * GEMM on matrix views, and the translation of a backend's failure into
 * the request's error.
 *
 * A device tensor is a pb_tensor_t whose storage is PB_STORAGE_DEVICE:
 * its bytes live in one device's memory, owned by the storage, and go back
 * to the device when the last reference goes (from any thread).  Only the
 * backend reads them; pb_tensor_data gives the device address.  A GPU op
 * runs on a worker bound to its device (daemon/pool.c), takes host
 * tensors in and gives host tensors out; its tape holds device tensors
 * only. */
#ifndef PB_GPU_OPS_H
#define PB_GPU_OPS_H

#include "../kernels/blas.h"
#include "../kernels/op.h"
#include "../kernels/strided.h"
#include "gpu.h"

/* A new uninitialised device tensor on dev.  0 or a PB_E* code. */
int pb_gpu_tensor_alloc(pb_tensor_t *t, int dev, pb_dtype_t d, int rank, const uint64_t *shape, char order);
/* src on dev as a device tensor dst: a new one with host tensor src's
 * bytes (its order), or src itself when it lies in dev's memory already
 * (a client's GPU buffer is read where it lies). */
int pb_gpu_upload(pb_tensor_t *dst, int dev, const pb_tensor_t *src);
/* t in daemon-owned device memory, for a tape: a device copy when it lies
 * in a client's GPU buffer. */
int pb_gpu_own(pb_tensor_t *t, int dev);
/* t replaced by a copy in new daemon-owned memory of dev (t lies on dev). */
int pb_gpu_copy(pb_tensor_t *t, int dev);
/* A new host tensor with device tensor src's bytes, in its order; it is
 * filled when the worker's stream is synchronised (pb_gpu->sync). */
int pb_gpu_download(pb_tensor_t *dst, const pb_tensor_t *src);
/* c = alpha·a·b + beta·c on the device (views of device tensors), and
 * the same on raw column-major operands; alpha = 0 reads neither a nor b,
 * as the CPU's GEMM. */
int pb_gpu_gemm(pb_dtype_t d, pb_scalar_t alpha, pb_mview_t a, pb_mview_t b, pb_scalar_t beta, pb_mview_t c);
int pb_gpu_gemm_cm(pb_dtype_t d, char ta, char tb, int m, int n, int k, pb_scalar_t alpha, const void *a, int lda,
                   const void *b, int ldb, pb_scalar_t beta, void *c, int ldc);
/* A strided pass's loop as the backend takes it, and back. */
pb_gpu_loop_t pb_gpu_loop_of(const pb_loop_t *L);
pb_loop_t pb_loop_of_gpu(const pb_gpu_loop_t *g);
/* Fill err for a backend failure rc in `what` on device dev: device
 * memory exhausted, the device failed, or the library's error. */
int pb_gpu_fail(pb_err_t *err, int rc, int dev, const char *what);

/* An op whose CPU functions are written for both devices (cuda/exec.h):
 * its GPU forward and reverse are these.  They move the inputs (the
 * cotangents) to the call's device, run the op's CPU function there with
 * the thread executing on that GPU, and bring the outputs (the gradients)
 * back; its tape holds device tensors. */
int pb_gpu_shared_forward(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err);
int pb_gpu_shared_reverse(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                          pb_warnings_t *warn, pb_err_t *err);

/* The ops' GPU functions, for the op table (kernels/op.h's forward and
 * reverse by device kind). */
int pb_gpu_fused_dense_forward(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err);
int pb_gpu_fused_dense_reverse(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                               pb_warnings_t *warn, pb_err_t *err);

#endif
