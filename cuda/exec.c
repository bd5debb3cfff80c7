/* The execution device (exec.h): the thread's state, and the device side
 * of the shared code's touch points. */
#include "exec.h"

#include <string.h>

#include "gpu_ops.h"

static __thread int exec_gpu = -1, exec_rc;

int pb_exec_gpu(void)
{
    return exec_gpu;
}

void pb_exec_enter(int gpu)
{
    exec_gpu = gpu;
    exec_rc = 0;
}

int pb_exec_leave(void)
{
    int rc = exec_rc;
    exec_gpu = -1;
    exec_rc = 0;
    return rc;
}

int pb_exec_pause(void)
{
    int gpu = exec_gpu;
    exec_gpu = -1;
    return gpu;
}

void pb_exec_resume(int gpu)
{
    exec_gpu = gpu;
}

int pb_exec_fail(int rc)
{
    if (rc && exec_rc == 0)
        exec_rc = rc;
    return rc;
}

int pb_exec_failed(void)
{
    return exec_rc != 0;
}

void *pb_exec_alloc(size_t bytes)
{
    void *p = NULL;
    if (pb_exec_failed() || pb_exec_fail(pb_gpu->alloc(exec_gpu, bytes ? bytes : 1, &p)))
        return NULL;
    return p;
}

void pb_exec_free(void *p)
{
    pb_gpu->free(exec_gpu, p);
}

/* ---- the touch points -------------------------------------------------- */

/* Run one backend call unless a failure is kept; keep its failure. */
#define EXEC(call) (pb_exec_failed() ? 0 : pb_exec_fail(call))

int pb__exec_tensor_alloc(pb_tensor_t *t, pb_dtype_t d, int rank, const uint64_t *shape, char order, bool zero)
{
    pb_tensor_t n;
    if (pb_exec_failed() || pb_exec_fail(pb_gpu_tensor_alloc(&n, exec_gpu, d, rank, shape, order)))
        return PB_ENOMEM;
    if (zero && EXEC(pb_gpu->zero(pb_tensor_data(&n), pb_tensor_bytes(&n)))) {
        pb_tensor_clear(&n);
        return PB_ENOMEM;
    }
    *t = n;
    return 0;
}

void pb__exec_zero(void *p, size_t n)
{
    EXEC(pb_gpu->zero(p, n));
}

void pb__exec_h2d(void *dst, const void *src, size_t n)
{
    EXEC(pb_gpu->h2d(dst, src, n));
}

void pb__exec_strided(pb_dtype_t d, const pb_loop_t *L, void *dst, const void *src, bool conj, pb_scalar_t alpha,
                      const void *src2, pb_scalar_t beta, bool accumulate)
{
    pb_gpu_loop_t g = pb_gpu_loop_of(L);
    double al[2] = {alpha.re, alpha.im}, be[2] = {beta.re, beta.im};
    EXEC(pb_gpu->strided((int)d, &g, dst, src, conj, al, src2, be, accumulate));
}

pb_scalar_t pb__exec_dot(pb_dtype_t d, const pb_loop_t *L, const void *a, bool conj, const void *b)
{
    pb_gpu_loop_t g = pb_gpu_loop_of(L);
    double out[2] = {0, 0};
    EXEC(pb_gpu->dot((int)d, &g, a, conj, b, out));
    return (pb_scalar_t){out[0], out[1]};
}

void pb__exec_gemm(pb_dtype_t d, char ta, char tb, int m, int n, int k, pb_scalar_t alpha, const void *a, int lda,
                   const void *b, int ldb, pb_scalar_t beta, void *c, int ldc)
{
    EXEC(pb_gpu_gemm_cm(d, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc));
}

void pb__exec_fz(const pb_gpu_fz_t *k, double out[2])
{
    EXEC(pb_gpu->fz(k, out));
}

int pb__exec_syevd(pb_dtype_t d, bool vectors, int n, void *a, int lda, void *w)
{
    int info = 0;
    EXEC(pb_gpu->syevd((int)d, vectors, n, a, lda, w, &info));
    return pb_exec_failed() ? 0 : info;
}

int pb__exec_gesvd(pb_dtype_t d, bool vectors, int m, int n, void *a, int lda, void *s, void *u, int ldu, void *vt,
                   int ldvt)
{
    int info = 0;
    EXEC(pb_gpu->gesvd((int)d, vectors, m, n, a, lda, s, u, ldu, vt, ldvt, &info));
    return pb_exec_failed() ? 0 : info;
}

void pb__exec_d2h(void *dst, const void *src, size_t n)
{
    if (EXEC(pb_gpu->d2h(dst, src, n)) == 0)
        EXEC(pb_gpu->sync());
}

int pb__exec_make_owned(pb_tensor_t *t)
{
    if (pb_exec_failed() || pb_exec_fail(pb_gpu_copy(t, exec_gpu)))
        return PB_ENOMEM;
    return 0;
}

/* ---- the shared rules on a GPU (gpu_ops.h) ------------------------------ */

/* Host tensors back from the device: each of n slots with storage. */
static int download_all(pb_tensor_t *t, int n)
{
    for (int i = 0; i < n; i++) {
        if (t[i].storage == NULL)
            continue;
        pb_tensor_t host;
        int rc = pb_gpu_download(&host, &t[i]);
        if (rc)
            return rc;
        pb_tensor_clear(&t[i]);
        t[i] = host;
    }
    return 0;
}

int pb_gpu_shared_forward(pb_call_t *c, pb_tapedata_t *tape, pb_err_t *err)
{
    int dev = c->device.index, rc = 0, failed = 0;
    pb_tensor_t host[PB_MAX_IO] = {{0}};
    for (int i = 0; i < c->op->ninputs && rc == 0; i++)
        if (c->in[i].storage) {
            host[i] = c->in[i];
            c->in[i] = (pb_tensor_t){0};
            rc = pb_gpu_upload(&c->in[i], dev, &host[i]);
        }
    if (rc)
        failed = rc;
    else {
        pb_exec_enter(dev);
        rc = c->op->forward[PB_DEV_CPU](c, tape, err);
        failed = pb_exec_leave();
    }
    /* a failure kept inside the body is the answer, not its outputs */
    if (rc == 0 && failed == 0 && (failed = download_all(c->out, c->op->noutputs)) == 0)
        failed = pb_gpu->sync();
    for (int i = 0; i < c->op->ninputs; i++)
        if (host[i].storage) {
            pb_tensor_clear(&c->in[i]);
            c->in[i] = host[i];
        }
    if (failed || rc) {
        for (int k = 0; k < c->op->noutputs; k++)
            pb_tensor_clear(&c->out[k]);
        return failed ? pb_gpu_fail(err, failed, dev, c->op->name) : rc;
    }
    return 0;
}

int pb_gpu_shared_reverse(const pb_tapedata_t *t, const pb_tensor_t *cot, pb_tensor_t *grad, char order,
                          pb_warnings_t *warn, pb_err_t *err)
{
    int dev = t->device.index, rc = 0, failed = 0;
    pb_tensor_t dcot[PB_MAX_IO] = {{0}};
    for (int i = 0; i < t->op->noutputs && failed == 0; i++)
        if (cot[i].storage)
            failed = pb_gpu_upload(&dcot[i], dev, &cot[i]);
    if (failed == 0) {
        pb_exec_enter(dev);
        rc = t->op->reverse[PB_DEV_CPU](t, dcot, grad, order, warn, err);
        failed = pb_exec_leave();
    }
    if (rc == 0 && failed == 0 && (failed = download_all(grad, PB_MAX_IO + 2)) == 0)
        failed = pb_gpu->sync();
    for (int i = 0; i < PB_MAX_IO; i++)
        pb_tensor_clear(&dcot[i]);
    if (failed || rc) {
        for (int k = 0; k < PB_MAX_IO + 2; k++)
            pb_tensor_clear(&grad[k]);
        return failed ? pb_gpu_fail(err, failed, dev, t->op->name) : rc;
    }
    return 0;
}
