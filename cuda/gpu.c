/* The backend choice (gpu.h) and what the GPU ops share (gpu_ops.h). */
#include <dlfcn.h>
#include <libgen.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fake.h"
#include "gpu_ops.h"

const pb_gpu_backend_t *pb_gpu;
static int ndevices;

#define MODULE "libpullbackd-cuda.so"

const pb_gpu_backend_t *pb__gpu_real(const char **why)
{
#define STR_(x) #x
#define STR(x) STR_(x)
#define ENTRY STR(PB_GPU_MODULE_FN)
    static bool tried;
    static const pb_gpu_backend_t *backend;
    static char whynot[300] = "the CUDA backend module " MODULE " was not found";
    if (!tried) {
        tried = true;
        /* The build tree: the daemon in daemon/, tests in tests/ and
         * tests/bench/, the module in cuda/. */
        char here[PATH_MAX] = "", up1[PATH_MAX + 32] = "", up2[PATH_MAX + 32] = "";
        ssize_t n = readlink("/proc/self/exe", here, sizeof here - 1);
        if (n > 0) {
            here[n] = 0;
            const char *dir = dirname(here);
            snprintf(up1, sizeof up1, "%s/../cuda/" MODULE, dir);
            snprintf(up2, sizeof up2, "%s/../../cuda/" MODULE, dir);
        }
        const char *paths[] = {getenv("PULLBACKD_CUDA_MODULE"), up1, up2, PB_CUDA_MODULE_DIR "/" MODULE};
        for (size_t i = 0; i < sizeof paths / sizeof *paths && backend == NULL; i++) {
            if (paths[i] == NULL || paths[i][0] == 0 || (i > 0 && access(paths[i], F_OK) != 0))
                continue;
            void *h = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL);
            pb_gpu_module_fn *fn = h ? (pb_gpu_module_fn *)dlsym(h, ENTRY) : NULL;
            if (fn)
                backend = fn();
            else if (h) {
                snprintf(whynot, sizeof whynot,
                         "the CUDA backend module %s has no %s: it was built from another version of cuda/gpu.h; "
                         "rebuild it",
                         paths[i], ENTRY);
                dlclose(h);
            } else
                snprintf(whynot, sizeof whynot, "the CUDA backend module did not load: %s", dlerror());
        }
    }
    if (why)
        *why = whynot;
    return backend;
}

int pb_gpu_init(char *msg, size_t len)
{
    const char *spec = getenv("PULLBACKD_FAKE_CUDA");
    const pb_gpu_backend_t *b = spec ? pb__gpu_fake(spec, msg, len) : pb__gpu_real(NULL);
    if (spec && b == NULL)
        return PB_EINVALID_ARGUMENT;
    int n = b ? b->count() : 0;
    pb_gpu = n > 0 ? b : NULL;
    ndevices = n > 0 ? n : 0;
    return ndevices;
}

int pb_gpu_count(void)
{
    return ndevices;
}

static void device_free(pb_storage_t *s)
{
    pb_gpu->free(s->device.index, s->ptr);
}

int pb_gpu_tensor_alloc(pb_tensor_t *t, int dev, pb_dtype_t d, int rank, const uint64_t *shape, char order)
{
    size_t bytes;
    if (!pb_shape_count(rank, shape, pb_dtype_size(d), NULL, &bytes))
        return PB_ENOMEM;
    void *p;
    /* never NULL, as on the host: a zero-size tensor is still one */
    int rc = pb_gpu->alloc(dev, bytes ? bytes : 1, &p);
    if (rc)
        return rc;
    pb_storage_t *s = pb_storage_wrap(PB_STORAGE_DEVICE, p, bytes, device_free, NULL);
    if (s == NULL) {
        pb_gpu->free(dev, p);
        return PB_ENOMEM;
    }
    s->device = (pb_device_t){PB_DEV_CUDA, dev};
    pb_tensor_over(t, s, d, rank, shape, order);
    return 0;
}

/* src lies in dev's memory already: a daemon tensor, or a client's GPU
 * buffer (daemon/buffer.h). */
static bool on_device(const pb_tensor_t *src, int dev)
{
    return src->storage && src->storage->device.kind == PB_DEV_CUDA && src->storage->device.index == dev;
}

int pb_gpu_upload(pb_tensor_t *dst, int dev, const pb_tensor_t *src)
{
    if (on_device(src, dev)) { /* used where it lies */
        pb_tensor_ref(dst, src);
        return 0;
    }
    pb_tensor_t t;
    int rc = pb_gpu_tensor_alloc(&t, dev, src->dtype, src->rank, src->shape, src->order);
    if (rc == 0 && (rc = pb_gpu->h2d(pb_tensor_data(&t), pb_tensor_data(src), pb_tensor_bytes(src)))) {
        pb_tensor_clear(&t);
        return rc;
    }
    if (rc == 0)
        *dst = t;
    return rc;
}

int pb_gpu_own(pb_tensor_t *t, int dev)
{
    return t->storage == NULL || t->storage->kind == PB_STORAGE_DEVICE ? 0 : pb_gpu_copy(t, dev);
}

int pb_gpu_copy(pb_tensor_t *t, int dev)
{
    pb_tensor_t n;
    int rc = pb_gpu_tensor_alloc(&n, dev, t->dtype, t->rank, t->shape, t->order);
    uint64_t count = pb_tensor_count(t);
    if (rc == 0 && count) {
        pb_gpu_loop_t L = {.rank = 1, .dim = {count}, .s = {{1}, {1}, {0}}};
        double one[2] = {1, 0}, zero[2] = {0, 0};
        rc = pb_gpu->strided((int)t->dtype, &L, pb_tensor_data(&n), pb_tensor_data(t), 0, one, NULL, zero, 0);
        if (rc)
            pb_tensor_clear(&n);
    }
    if (rc)
        return rc;
    pb_tensor_clear(t);
    *t = n;
    return 0;
}

int pb_gpu_download(pb_tensor_t *dst, const pb_tensor_t *src)
{
    pb_tensor_t t;
    int rc = pb_tensor_alloc(&t, src->dtype, src->rank, src->shape, src->order, false);
    if (rc == 0 && (rc = pb_gpu->d2h(pb_tensor_data(&t), pb_tensor_data(src), pb_tensor_bytes(src)))) {
        pb_tensor_clear(&t);
        return rc;
    }
    if (rc == 0)
        *dst = t;
    return rc;
}

pb_gpu_loop_t pb_gpu_loop_of(const pb_loop_t *L)
{
    pb_gpu_loop_t g;
    memset(&g, 0, sizeof g);
    g.rank = L->rank;
    for (int k = 0; k < L->rank; k++) {
        g.dim[k] = L->dim[k];
        for (int o = 0; o < 3; o++)
            g.s[o][k] = L->s[o][k];
    }
    return g;
}

pb_loop_t pb_loop_of_gpu(const pb_gpu_loop_t *g)
{
    pb_loop_t L;
    memset(&L, 0, sizeof L);
    L.rank = g->rank;
    for (int k = 0; k < g->rank; k++) {
        L.dim[k] = g->dim[k];
        for (int o = 0; o < 3; o++)
            L.s[o][k] = g->s[o][k];
    }
    return L;
}

int pb_gpu_gemm_cm(pb_dtype_t d, char ta, char tb, int m, int n, int k, pb_scalar_t alpha, const void *a, int lda,
                   const void *b, int ldb, pb_scalar_t beta, void *c, int ldc)
{
    bool cplx = pb_dtype_is_complex(d);
    double al[2] = {alpha.re, alpha.im}, be[2] = {beta.re, beta.im};
    if (alpha.re != 0 || (cplx && alpha.im != 0))
        return pb_gpu->gemm((int)d, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
    /* As the CPU's GEMM (kernels/blas_t.h): a and b are not read, so NaN
     * and Inf there reach nothing; C = beta·C, zeros for beta = 0 (C not
     * read either, the strided pass's alpha = 0 rule). */
    if (m == 0 || n == 0 || (beta.re == 1 && (!cplx || beta.im == 0)))
        return 0;
    pb_gpu_loop_t L = {.rank = 2, .dim = {(unsigned long long)m, (unsigned long long)n}, .s = {{1, ldc}, {1, ldc}}};
    double zero[2] = {0, 0};
    return pb_gpu->strided((int)d, &L, c, c, 0, be, NULL, zero, 0);
}

int pb_gpu_gemm(pb_dtype_t d, pb_scalar_t alpha, pb_mview_t a, pb_mview_t b, pb_scalar_t beta, pb_mview_t c)
{
    pb_gemm_plan_t g = pb_gemm_plan(a, b, c);
    return pb_gpu_gemm_cm(d, g.ta, g.tb, g.m, g.n, g.k, alpha, g.a, g.lda, g.b, g.ldb, beta, g.c, g.ldc);
}

int pb_gpu_fail(pb_err_t *err, int rc, int dev, const char *what)
{
    const char *why = pb_gpu->last_error();
    if (rc == PB_ENOMEM)
        return pb_err_set(err, PB_ERESOURCE_EXHAUSTED, "device_memory",
                          "%s: cuda:%d is out of memory (%zu bytes in use): %s", what, dev, pb_gpu->used(dev), why);
    if (rc == PB_EDEVICE_UNAVAILABLE)
        return pb_err_set(err, PB_EDEVICE_UNAVAILABLE, "device", "%s: cuda:%d has failed: %s", what, dev, why);
    return pb_err_set(err, rc, NULL, "%s on cuda:%d: %s", what, dev, why);
}

