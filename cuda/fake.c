/* The host fake of the GPU backend: fake.h says what it is and checks. */
#define _GNU_SOURCE
#include "fake.h"

#include <cblas.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../kernels/factor_common.h"
#include "../kernels/fused_dense.h"
#include "../kernels/mem.h"
#include "../kernels/strided.h"
#include "exec.h"
#include "gpu_ops.h"

/* One allocation: the address handed out (PROT_NONE) and the shadow the
 * fake reads and writes, two mappings of the same shared pages. */
typedef struct fake_block {
    int dev;
    char *addr, *shadow;
    size_t size, mapped;
    bool imported; /* a client's memory (import_fd), not counted in used */
} fake_block_t;

static struct {
    pthread_mutex_t lock;
    int ndev;
    size_t memory;
    long sticky_after; /* < 0: never */
    int unbindable;    /* a device thread_init refuses, or -1 */
    int solver_info;   /* what every solver call answers, or 0: the solver's own */
    bool solver_oom;   /* every solver call fails: no memory for its workspace */
    atomic_long calls;
    size_t used[PB_GPU_MAX_DEVICES];
    atomic_int failed[PB_GPU_MAX_DEVICES];
    fake_block_t *blocks; /* live allocations, unordered */
    size_t nblocks, cap;
} F = {.lock = PTHREAD_MUTEX_INITIALIZER};

static __thread int bound = -1; /* the calling worker's device */

__attribute__((format(printf, 1, 2), noreturn)) static void fake_abort(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("fake CUDA: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

/* The block holding [p, p + n) on the bound device's memory, its shadow
 * address of p; aborts otherwise.  NULL for n == 0. */
static char *dev_ptr(const void *p, size_t n, const char *what)
{
    if (n == 0)
        return NULL;
    const char *c = p;
    char *s = NULL;
    pthread_mutex_lock(&F.lock);
    for (size_t i = 0; i < F.nblocks; i++) {
        const fake_block_t *b = &F.blocks[i];
        if (c >= b->addr && c < b->addr + b->size) {
            if ((size_t)(c - b->addr) > b->size - n || n > b->size)
                fake_abort("%s: %zu bytes at %p run past the end of its allocation (%zu bytes at %p)", what, n, p,
                           b->size, (void *)b->addr);
            if (b->dev != bound)
                fake_abort("%s: %p is memory of device %d, used on device %d", what, p, b->dev, bound);
            s = b->shadow + (c - b->addr);
            break;
        }
    }
    pthread_mutex_unlock(&F.lock);
    if (s == NULL)
        fake_abort("%s: %p is not device memory", what, p);
    return s;
}

/* Aborts when [p, p + n) touches device memory. */
static void host_ptr(const void *p, size_t n, const char *what)
{
    const char *c = p;
    pthread_mutex_lock(&F.lock);
    for (size_t i = 0; i < F.nblocks; i++) {
        const fake_block_t *b = &F.blocks[i];
        if (n && c < b->addr + b->mapped && c + n > b->addr)
            fake_abort("%s: %p is device memory, given as host memory", what, p);
    }
    pthread_mutex_unlock(&F.lock);
}

static __thread char last[160];

static int fail(int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last, sizeof last, fmt, ap);
    va_end(ap);
    return rc;
}

/* Every stream call: a bound thread, a device that has not failed, and
 * the sticky error when its turn comes. */
static int stream_call(const char *what)
{
    if (bound < 0)
        fake_abort("%s: called from a thread that thread_init did not bind", what);
    if (atomic_load(&F.failed[bound]))
        return fail(PB_EDEVICE_UNAVAILABLE, "%s: device %d has failed", what, bound);
    long k = atomic_fetch_add(&F.calls, 1);
    if (F.sticky_after >= 0 && k >= F.sticky_after) {
        atomic_store(&F.failed[bound], 1);
        return fail(PB_EDEVICE_UNAVAILABLE, "%s: an illegal address (injected: sticky_after=%ld)", what,
                    F.sticky_after);
    }
    return 0;
}

static int fake_count(void)
{
    return F.ndev;
}

static int fake_info(int dev, pb_gpu_info_t *out)
{
    snprintf(out->name, sizeof out->name, "fake GPU %d", dev);
    out->total_bytes = F.memory;
    return 0;
}

static int fake_thread_init(int dev)
{
    if (dev < 0 || dev >= F.ndev)
        fake_abort("thread_init: no device %d", dev);
    if (dev == F.unbindable)
        return fail(PB_EINTERNAL, "thread_init: device %d refuses its workers (injected: unbindable=%d)", dev, dev);
    bound = dev;
    return 0;
}

static void fake_thread_fini(void)
{
    bound = -1;
}

/* Append b to the registry, growing it; false when out of memory.
 * Under F.lock. */
static bool add_block_locked(fake_block_t b)
{
    if (F.nblocks == F.cap) {
        size_t cap = F.cap ? 2 * F.cap : 64;
        fake_block_t *nb = realloc(F.blocks, cap * sizeof *nb);
        if (nb == NULL)
            return false;
        F.blocks = nb;
        F.cap = cap;
    }
    F.blocks[F.nblocks++] = b;
    return true;
}

/* Unmap what of a block's two mappings was made. */
static void unmap_pair(char *addr, char *shadow, size_t mapped)
{
    if (addr != MAP_FAILED)
        munmap(addr, mapped);
    if (shadow != MAP_FAILED)
        munmap(shadow, mapped);
}

static int fake_alloc(int dev, size_t bytes, void **p)
{
    if (dev < 0 || dev >= F.ndev)
        fake_abort("alloc: no device %d", dev);
    if (atomic_load(&F.failed[dev]))
        return fail(PB_EDEVICE_UNAVAILABLE, "alloc: device %d has failed", dev);
    if (bytes == 0) {
        *p = NULL;
        return 0;
    }
    /* with the host allocator's tail slack (kernels/mem.h): the fake runs
     * OpenBLAS and LAPACK on the shadow, and their kernels read past the
     * end (no call may touch it: the extent checks stop at bytes) */
    size_t page = (size_t)sysconf(_SC_PAGESIZE), want = bytes + PB_TAIL_SLACK(bytes);
    size_t mapped = (want + page - 1) / page * page;
    pthread_mutex_lock(&F.lock);
    bool room = F.used[dev] <= F.memory && bytes <= F.memory - F.used[dev];
    if (room)
        F.used[dev] += bytes;
    pthread_mutex_unlock(&F.lock);
    if (!room)
        return fail(PB_ENOMEM, "alloc: %zu bytes past device %d's %zu", bytes, dev, F.memory);
    /* Shared anonymous pages, mapped a second time by mremap (an old size
     * of 0 duplicates a shared mapping), that one without access: no file
     * descriptor, so a worker's allocation never takes an fd number the
     * loop thread is still closing. */
    char *shadow = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0), *addr = MAP_FAILED;
    if (shadow != MAP_FAILED) {
        addr = mremap(shadow, 0, mapped, MREMAP_MAYMOVE);
        if (addr != MAP_FAILED && mprotect(addr, mapped, PROT_NONE) != 0) {
            munmap(addr, mapped);
            addr = MAP_FAILED;
        }
    }
    pthread_mutex_lock(&F.lock);
    bool ok = addr != MAP_FAILED && shadow != MAP_FAILED &&
              add_block_locked((fake_block_t){dev, addr, shadow, bytes, mapped, false});
    if (!ok)
        F.used[dev] -= bytes;
    pthread_mutex_unlock(&F.lock);
    if (!ok) {
        unmap_pair(addr, shadow, mapped);
        return fail(PB_ENOMEM, "alloc: no host memory for the fake's %zu bytes", bytes);
    }
    *p = addr;
    return 0;
}

/* Remove the block at p (imported or not, as asked) from the registry
 * into *out; false when there is none. */
static bool take_block(const void *p, bool imported, fake_block_t *out)
{
    bool found = false;
    pthread_mutex_lock(&F.lock);
    for (size_t i = 0; i < F.nblocks; i++)
        if (F.blocks[i].addr == p && F.blocks[i].imported == imported) {
            *out = F.blocks[i];
            F.blocks[i] = F.blocks[--F.nblocks];
            if (!imported)
                F.used[out->dev] -= out->size;
            found = true;
            break;
        }
    pthread_mutex_unlock(&F.lock);
    return found;
}

static void fake_free(int dev, void *p)
{
    if (p == NULL)
        return;
    fake_block_t b;
    if (!take_block(p, false, &b))
        fake_abort("free: %p was not given by alloc, or was freed already", p);
    if (b.dev != dev)
        fake_abort("free: %p is memory of device %d, freed as device %d's", p, b.dev, dev);
    unmap_pair(b.addr, b.shadow, b.mapped);
}

/* A memfd named "pb-fake-gpu:N" plays device N's exported memory: mapped
 * twice like an allocation, its pages shared with the client's mapping. */
static int fake_import_fd(int dev, int fd, size_t size, void **p, char *why, size_t len)
{
    if (dev < 0 || dev >= F.ndev)
        fake_abort("import_fd: no device %d", dev);
    if (atomic_load(&F.failed[dev])) {
        snprintf(why, len, "cuda:%d has failed", dev);
        return PB_EDEVICE_UNAVAILABLE;
    }
    char link[64], target[256] = "";
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    int owner = -1, used = 0;
    if (n > 0)
        target[n] = 0;
    if (n <= 0 || sscanf(target, "/memfd:pb-fake-gpu:%d%n", &owner, &used) != 1) {
        snprintf(why, len, "the file descriptor is not a CUDA memory export (the host fake takes a memfd named "
                           "\"pb-fake-gpu:N\" for device N's memory; this one is %s)", n > 0 ? target : "unknown");
        return PB_EINVALID_ARGUMENT;
    }
    if (owner != dev) {
        snprintf(why, len, "the memory lives on cuda:%d, not cuda:%d", owner, dev);
        return PB_EINVALID_ARGUMENT;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size < 0 || (size_t)st.st_size < size) {
        snprintf(why, len, "size %zu is more than the exported allocation (%lld bytes)", size,
                 (long long)st.st_size);
        return PB_EINVALID_ARGUMENT;
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE), mapped = (size + page - 1) / page * page;
    char *addr = mmap(NULL, mapped, PROT_NONE, MAP_SHARED, fd, 0);
    char *shadow = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    pthread_mutex_lock(&F.lock);
    bool ok = addr != MAP_FAILED && shadow != MAP_FAILED &&
              add_block_locked((fake_block_t){dev, addr, shadow, size, mapped, true});
    pthread_mutex_unlock(&F.lock);
    if (!ok) {
        unmap_pair(addr, shadow, mapped);
        snprintf(why, len, "cannot map %zu bytes", size);
        return PB_ERESOURCE_EXHAUSTED;
    }
    *p = addr;
    return 0;
}

static void fake_unimport(int dev, void *p, size_t size)
{
    fake_block_t b;
    if (!take_block(p, true, &b))
        fake_abort("unimport: %p was not given by import_fd, or was unmapped already", p);
    if (b.dev != dev || b.size != size)
        fake_abort("unimport: %p is %zu bytes of device %d, unmapped as %zu of device %d", p, b.size, b.dev, size,
                   dev);
    unmap_pair(b.addr, b.shadow, b.mapped);
}

static size_t fake_used(int dev)
{
    pthread_mutex_lock(&F.lock);
    size_t n = F.used[dev];
    pthread_mutex_unlock(&F.lock);
    return n;
}

static int fake_failed(int dev)
{
    return atomic_load(&F.failed[dev]);
}

static void fake_set_failed(int dev)
{
    if (dev < 0 || dev >= F.ndev)
        fake_abort("set_failed: no device %d", dev);
    atomic_store(&F.failed[dev], 1);
}

static int fake_h2d(void *dst, const void *src, size_t n)
{
    int rc = stream_call("h2d");
    if (rc)
        return rc;
    host_ptr(src, n, "h2d source");
    if (n)
        memcpy(dev_ptr(dst, n, "h2d destination"), src, n);
    return 0;
}

static int fake_d2h(void *dst, const void *src, size_t n)
{
    int rc = stream_call("d2h");
    if (rc)
        return rc;
    host_ptr(dst, n, "d2h destination");
    if (n)
        memcpy(dst, dev_ptr(src, n, "d2h source"), n);
    return 0;
}

static int fake_zero(void *dst, size_t n)
{
    int rc = stream_call("zero");
    if (rc)
        return rc;
    if (n)
        memset(dev_ptr(dst, n, "zero"), 0, n);
    return 0;
}

static int fake_sync(void)
{
    if (bound < 0)
        fake_abort("sync: called from a thread that thread_init did not bind");
    return atomic_load(&F.failed[bound]) ? fail(PB_EDEVICE_UNAVAILABLE, "sync: device failed") : 0;
}

static const size_t esize[4] = {4, 8, 8, 16};
/* The size of the real dtype of each: eigen- and singular values. */
static const size_t rsize[4] = {4, 8, 4, 8};

/* The shadow of a column-major rows × cols operand with leading dimension
 * ld, after BLAS's checks. */
static char *operand(const void *p, int rows, int cols, int ld, int dtype, const char *what)
{
    if (rows < 0 || cols < 0 || ld < (rows > 1 ? rows : 1))
        fake_abort("gemm: %s is %d × %d with leading dimension %d", what, rows, cols, ld);
    if (rows == 0 || cols == 0)
        return NULL;
    size_t extent = ((size_t)ld * (size_t)(cols - 1) + (size_t)rows) * esize[dtype];
    return dev_ptr(p, extent, what);
}

static CBLAS_TRANSPOSE trans(char t)
{
    if (t != 'N' && t != 'T' && t != 'C')
        fake_abort("gemm: transpose '%c'", t);
    return t == 'N' ? CblasNoTrans : t == 'T' ? CblasTrans : CblasConjTrans;
}

static int fake_gemm(int dtype, char ta, char tb, int m, int n, int k, const double alpha[2], const void *a, int lda,
                     const void *b, int ldb, const double beta[2], void *c, int ldc)
{
    int rc = stream_call("gemm");
    if (rc)
        return rc;
    if (dtype < 0 || dtype > 3)
        fake_abort("gemm: dtype %d", dtype);
    CBLAS_TRANSPOSE tra = trans(ta), trb = trans(tb);
    char *sa = operand(a, ta == 'N' ? m : k, ta == 'N' ? k : m, lda, dtype, "gemm A");
    char *sb = operand(b, tb == 'N' ? k : n, tb == 'N' ? n : k, ldb, dtype, "gemm B");
    char *sc = operand(c, m, n, ldc, dtype, "gemm C");
    if (m == 0 || n == 0)
        return 0;
    float fa[2] = {(float)alpha[0], (float)alpha[1]}, fb[2] = {(float)beta[0], (float)beta[1]};
    switch (dtype) {
    case 0:
        cblas_sgemm(CblasColMajor, tra, trb, m, n, k, fa[0], (float *)sa, lda, (float *)sb, ldb, fb[0], (float *)sc,
                    ldc);
        break;
    case 1:
        cblas_dgemm(CblasColMajor, tra, trb, m, n, k, alpha[0], (double *)sa, lda, (double *)sb, ldb, beta[0],
                    (double *)sc, ldc);
        break;
    case 2:
        cblas_cgemm(CblasColMajor, tra, trb, m, n, k, fa, sa, lda, sb, ldb, fb, sc, ldc);
        break;
    default:
        cblas_zgemm(CblasColMajor, tra, trb, m, n, k, alpha, sa, lda, sb, ldb, beta, sc, ldc);
    }
    return 0;
}

static void real_dtype(int dtype, const char *what)
{
    if (dtype != 0 && dtype != 1)
        fake_abort("%s: dtype %d is not f32 or f64", what, dtype);
}

static int fake_bias_act(int dtype, int act, void *y, void *zbuf, const void *b, size_t out, size_t batch,
                         char order)
{
    int rc = stream_call("bias_act");
    if (rc)
        return rc;
    real_dtype(dtype, "bias_act");
    size_t n = out * batch * esize[dtype];
    if (n == 0)
        return 0;
    pb_fused_dense_bias_act(dtype, act, dev_ptr(y, n, "bias_act y"), zbuf ? dev_ptr(zbuf, n, "bias_act z") : NULL,
                            b ? dev_ptr(b, out * esize[dtype], "bias_act b") : NULL, out, batch, order);
    return 0;
}

static int fake_dz(int dtype, int act, void *dz, const void *yb, const void *s, size_t out, size_t batch, char order)
{
    int rc = stream_call("dz");
    if (rc)
        return rc;
    real_dtype(dtype, "dz");
    size_t n = out * batch * esize[dtype];
    if (n == 0)
        return 0;
    pb_fused_dense_dz(dtype, act, dev_ptr(dz, n, "dz"), dev_ptr(yb, n, "dz ȳ"), s ? dev_ptr(s, n, "dz s") : NULL,
                      NULL, out, batch, order);
    return 0;
}

static int fake_row_sum(int dtype, const void *dz, void *db, size_t out, size_t batch, char order)
{
    int rc = stream_call("row_sum");
    if (rc)
        return rc;
    real_dtype(dtype, "row_sum");
    if (out == 0)
        return 0;
    double *sum = calloc(out, sizeof *sum);
    void *copy = malloc(out * batch * esize[dtype] + 1);
    if (sum == NULL || copy == NULL) {
        free(sum);
        free(copy);
        return fail(PB_ENOMEM, "row_sum: no host memory");
    }
    size_t n = out * batch * esize[dtype];
    if (n)
        memcpy(copy, dev_ptr(dz, n, "row_sum dz"), n);
    /* The identity's dz pass over a copy: dz unchanged, its row sums. */
    pb_fused_dense_dz(dtype, 0, copy, copy, NULL, sum, out, batch, order);
    pb_fused_dense_store_bsum(dtype, dev_ptr(db, out * esize[dtype], "row_sum db"), sum, out);
    free(sum);
    free(copy);
    return 0;
}

/* The shadow of operand o's elements over L: the span its strides reach
 * from p, checked; and L's strides as kernels/strided.h's loop. */
static char *loop_operand(const pb_gpu_loop_t *L, int o, const void *p, int dtype, const char *what)
{
    long long lo = 0, hi = 0;
    for (int k = 0; k < L->rank; k++) {
        if (L->dim[k] == 0)
            return NULL; /* nothing is touched */
        long long reach = (long long)(L->dim[k] - 1) * L->s[o][k];
        if (reach < 0)
            lo += reach;
        else
            hi += reach;
    }
    size_t es = esize[dtype];
    char *s = dev_ptr((const char *)p + lo * (long long)es, (size_t)(hi - lo + 1) * es, what);
    return s - lo * (long long)es;
}

static pb_loop_t host_loop(const pb_gpu_loop_t *g)
{
    if (g->rank < 0 || g->rank > PB_MAX_RANK)
        fake_abort("strided: rank %d", g->rank);
    return pb_loop_of_gpu(g);
}

static int fake_strided(int dtype, const pb_gpu_loop_t *g, void *dst, const void *src, int conj, const double alpha[2],
                        const void *src2, const double beta[2], int accumulate)
{
    int rc = stream_call("strided");
    if (rc)
        return rc;
    if (dtype < 0 || dtype > 3)
        fake_abort("strided: dtype %d", dtype);
    pb_loop_t L = host_loop(g);
    bool reads_src = accumulate || alpha[0] != 0 || alpha[1] != 0;
    char *d = loop_operand(g, 0, dst, dtype, "strided dst");
    const char *s = reads_src ? loop_operand(g, 1, src, dtype, "strided src") : NULL;
    const char *s2 = src2 && !accumulate ? loop_operand(g, 2, src2, dtype, "strided src2") : NULL;
    if (d == NULL)
        return 0; /* an empty loop */
    pb__strided_host((pb_dtype_t)dtype, &L, d, s, conj, (pb_scalar_t){alpha[0], alpha[1]}, s2,
                     (pb_scalar_t){beta[0], beta[1]}, accumulate);
    return 0;
}

static int fake_dot(int dtype, const pb_gpu_loop_t *g, const void *a, int conj, const void *b, double out[2])
{
    int rc = stream_call("dot");
    if (rc)
        return rc;
    if (dtype < 0 || dtype > 3)
        fake_abort("dot: dtype %d", dtype);
    host_ptr(out, 2 * sizeof *out, "dot result");
    pb_loop_t L = host_loop(g);
    const char *sa = loop_operand(g, 0, a, dtype, "dot a"), *sb = loop_operand(g, 1, b, dtype, "dot b");
    pb_scalar_t r = sa ? pb__strided_dot_host((pb_dtype_t)dtype, &L, sa, conj, sb) : (pb_scalar_t){0, 0};
    out[0] = r.re;
    out[1] = r.im;
    return 0;
}

/* The extent an m×n column-major matrix of leading dimension ld spans, in
 * elements of es bytes (checked: ld at least the rows, int sizes). */
static size_t mat_bytes(int m, int n, int ld, size_t es, const char *what)
{
    if (m < 0 || n < 0 || ld < (m > 1 ? m : 1))
        fake_abort("%s: %d × %d with leading dimension %d", what, m, n, ld);
    return m && n ? ((size_t)(n - 1) * (size_t)ld + (size_t)m) * es : 0;
}

static int fake_fz(const pb_gpu_fz_t *k, double out[2])
{
    int rc = stream_call("fz");
    if (rc)
        return rc;
    if (k->dtype < 0 || k->dtype > 3 || k->kind < PB_GPU_FZ_AMAX || k->kind > PB_GPU_FZ_COLS_PINV)
        fake_abort("fz: dtype %d, kind %d", k->dtype, k->kind);
    const int kind = k->kind;
    bool square = kind == PB_GPU_FZ_HERM_GAP || kind == PB_GPU_FZ_HERMITIZE || kind == PB_GPU_FZ_ANTIHERM ||
                  kind == PB_GPU_FZ_EIGH_F || kind == PB_GPU_FZ_SVD_F || kind == PB_GPU_FZ_MIRROR_LOWER ||
                  kind == PB_GPU_FZ_POLAR_F;
    bool reduces = kind <= PB_GPU_FZ_HERM_GAP || kind == PB_GPU_FZ_EIGH_F || kind == PB_GPU_FZ_SVD_F;
    if (square && k->m != k->n)
        fake_abort("fz: kind %d needs a square matrix, given %d × %d", k->kind, k->m, k->n);
    size_t es = esize[k->dtype], res = rsize[k->dtype];
    pb_gpu_fz_t h = *k;
    double o[2] = {0, 1};
    if (reduces)
        host_ptr(out, 2 * sizeof *out, "fz result");
    size_t xb = mat_bytes(k->m, k->n, k->ld, es, "fz x");
    if (xb == 0) { /* nothing is touched */
        if (reduces)
            memcpy(out, o, sizeof o);
        return 0;
    }
    h.x = dev_ptr(k->x, xb, "fz x");
    /* the vectors each kind takes, of its length and element */
    size_t wlen = kind == PB_GPU_FZ_EIGH_F || kind == PB_GPU_FZ_SVD_F || kind == PB_GPU_FZ_COLS_DIV ||
                          kind == PB_GPU_FZ_COLS_MUL || kind == PB_GPU_FZ_POLAR_F || kind == PB_GPU_FZ_COLS_PINV
                      ? (size_t)k->n
                  : kind == PB_GPU_FZ_ROWS_DIV || kind == PB_GPU_FZ_ROWS_SQRT_MUL ? (size_t)k->m
                                                                                  : 0;
    size_t vlen = kind == PB_GPU_FZ_EIGH_F || kind == PB_GPU_FZ_SVD_F ? (size_t)k->n * res
                  : kind == PB_GPU_FZ_PHASES                          ? (size_t)k->n * es
                  : kind == PB_GPU_FZ_ROWS_MUL                        ? (size_t)k->m * es
                                                                      : 0;
    bool needs = kind == PB_GPU_FZ_ROWS_MUL || (wlen && kind != PB_GPU_FZ_EIGH_F);
    if ((k->w && !wlen) || (k->v && !vlen) || (k->y && kind != PB_GPU_FZ_SVD_F) ||
        (needs && !(kind == PB_GPU_FZ_ROWS_MUL ? k->v : k->w)) || (kind == PB_GPU_FZ_SVD_F && !k->y))
        fake_abort("fz: kind %d given w %p, v %p, y %p", kind, k->w, k->v, k->y);
    h.w = k->w ? dev_ptr(k->w, wlen * res, "fz w") : NULL;
    h.v = k->v ? dev_ptr(k->v, vlen, "fz v") : NULL;
    h.y = k->y ? dev_ptr(k->y, xb, "fz y") : NULL;
    pb__fz_kernel_host(&h, o);
    if (reduces)
        memcpy(out, o, sizeof o);
    return 0;
}

/* A solver call's start: a stream call, the solver_oom injection, the
 * dtype, info in host memory (the real backend copies it back). */
static int solver_begin(const char *what, int dtype, const int *info)
{
    int rc = stream_call(what);
    if (rc)
        return rc;
    if (F.solver_oom)
        return fail(PB_ENOMEM, "%s: no device memory for the workspace (injected: solver_oom=1)", what);
    if (dtype < 0 || dtype > 3)
        fake_abort("%s: dtype %d", what, dtype);
    host_ptr(info, sizeof *info, what);
    return 0;
}

/* Its end: LAPACK's answer r as the solver's info (or solver_info's). */
static int solver_end(const char *what, int r, int *info)
{
    if (r < 0) /* cuSOLVER checks its arguments too: a bad one is ours */
        fake_abort("%s: argument %d rejected", what, -r);
    *info = F.solver_info ? F.solver_info : r;
    return 0;
}

static int fake_syevd(int dtype, int vectors, int n, void *a, int lda, void *w, int *info)
{
    int rc = solver_begin("syevd", dtype, info);
    if (rc)
        return rc;
    size_t es = esize[dtype], res = rsize[dtype];
    size_t ab = mat_bytes(n, n, lda, es, "syevd a");
    if (n == 0) {
        *info = 0;
        return 0;
    }
    char *sa = dev_ptr(a, ab, "syevd a"), *sw = dev_ptr(w, (size_t)n * res, "syevd w");
    char job = vectors ? 'V' : 'N';
    int gpu = pb_exec_pause(); /* LAPACK's GEMMs on the host (exec.h) */
    int r = dtype == 0   ? LAPACKE_ssyevd(LAPACK_COL_MAJOR, job, 'L', n, (float *)sa, lda, (float *)sw)
            : dtype == 1 ? LAPACKE_dsyevd(LAPACK_COL_MAJOR, job, 'L', n, (double *)sa, lda, (double *)sw)
            : dtype == 2 ? LAPACKE_cheevd(LAPACK_COL_MAJOR, job, 'L', n, (lapack_complex_float *)sa, lda, (float *)sw)
                         : LAPACKE_zheevd(LAPACK_COL_MAJOR, job, 'L', n, (lapack_complex_double *)sa, lda,
                                          (double *)sw);
    pb_exec_resume(gpu);
    return solver_end("syevd", r, info);
}

static int fake_gesvd(int dtype, int vectors, int m, int n, void *a, int lda, void *s, void *u, int ldu, void *vt,
                      int ldvt, int *info)
{
    int rc = solver_begin("gesvd", dtype, info);
    if (rc)
        return rc;
    if (m < n) /* cuSOLVER's gesvd: m >= n only */
        fake_abort("gesvd: %d × %d is wide: cuSOLVER's gesvd takes m >= n", m, n);
    size_t es = esize[dtype], res = rsize[dtype];
    size_t ab = mat_bytes(m, n, lda, es, "gesvd a");
    if (!vectors && (u || vt))
        fake_abort("gesvd: vectors given without vectors asked");
    size_t ub = vectors ? mat_bytes(m, n, ldu, es, "gesvd u") : 0, vb = vectors ? mat_bytes(n, n, ldvt, es, "gesvd vt") : 0;
    if (n == 0) {
        *info = 0;
        return 0;
    }
    char *sa = dev_ptr(a, ab, "gesvd a"), *ss = dev_ptr(s, (size_t)n * res, "gesvd s");
    char *su = vectors ? dev_ptr(u, ub, "gesvd u") : NULL, *sv = vectors ? dev_ptr(vt, vb, "gesvd vt") : NULL;
    char job = vectors ? 'S' : 'N';
    int lu = vectors ? ldu : 1, lv = vectors ? ldvt : 1;
    void *superb = malloc((size_t)n * 8);
    if (superb == NULL)
        return fail(PB_EINTERNAL, "gesvd: no host memory");
    int gpu = pb_exec_pause(); /* LAPACK's GEMMs on the host (exec.h) */
    int r = dtype == 0   ? LAPACKE_sgesvd(LAPACK_COL_MAJOR, job, job, m, n, (float *)sa, lda, (float *)ss, (float *)su,
                                          lu, (float *)sv, lv, superb)
            : dtype == 1 ? LAPACKE_dgesvd(LAPACK_COL_MAJOR, job, job, m, n, (double *)sa, lda, (double *)ss,
                                          (double *)su, lu, (double *)sv, lv, superb)
            : dtype == 2 ? LAPACKE_cgesvd(LAPACK_COL_MAJOR, job, job, m, n, (lapack_complex_float *)sa, lda,
                                          (float *)ss, (lapack_complex_float *)su, lu, (lapack_complex_float *)sv, lv,
                                          superb)
                         : LAPACKE_zgesvd(LAPACK_COL_MAJOR, job, job, m, n, (lapack_complex_double *)sa, lda,
                                          (double *)ss, (lapack_complex_double *)su, lu, (lapack_complex_double *)sv,
                                          lv, superb);
    pb_exec_resume(gpu);
    free(superb);
    return solver_end("gesvd", r, info);
}

static const char *fake_last_error(void)
{
    return last;
}

static const pb_gpu_backend_t fake = {
    .name = "fake",
    .count = fake_count,
    .info = fake_info,
    .thread_init = fake_thread_init,
    .thread_fini = fake_thread_fini,
    .alloc = fake_alloc,
    .free = fake_free,
    .used = fake_used,
    .failed = fake_failed,
    .set_failed = fake_set_failed,
    .import_fd = fake_import_fd,
    .unimport = fake_unimport,
    .h2d = fake_h2d,
    .d2h = fake_d2h,
    .zero = fake_zero,
    .sync = fake_sync,
    .gemm = fake_gemm,
    .bias_act = fake_bias_act,
    .dz = fake_dz,
    .row_sum = fake_row_sum,
    .strided = fake_strided,
    .dot = fake_dot,
    .fz = fake_fz,
    .syevd = fake_syevd,
    .gesvd = fake_gesvd,
    .last_error = fake_last_error,
};

/* "123", "64M": bytes, false when it is not a number with an optional
 * K/M/G suffix. */
static bool parse_size(const char *s, size_t n, unsigned long long *out)
{
    char buf[32];
    if (n == 0 || n >= sizeof buf)
        return false;
    memcpy(buf, s, n);
    buf[n] = 0;
    char *end;
    unsigned long long v = strtoull(buf, &end, 10);
    int shift = *end == 'K' ? 10 : *end == 'M' ? 20 : *end == 'G' ? 30 : 0;
    if (end == buf || (shift && end[1]) || (!shift && *end) || v > (~0ULL >> shift))
        return false;
    *out = v << shift;
    return true;
}

const pb_gpu_backend_t *pb__gpu_fake(const char *spec, char *msg, size_t len)
{
    pthread_mutex_lock(&F.lock);
    bool busy = F.nblocks > 0;
    pthread_mutex_unlock(&F.lock);
    if (busy) {
        snprintf(msg, len, "the fake GPU still holds allocations");
        return NULL;
    }
    F.ndev = 1;
    F.memory = 1ull << 30;
    F.sticky_after = -1;
    F.unbindable = -1;
    F.solver_info = 0;
    F.solver_oom = false;
    atomic_store(&F.calls, 0);
    for (int d = 0; d < PB_GPU_MAX_DEVICES; d++) {
        F.used[d] = 0;
        atomic_store(&F.failed[d], 0);
    }
    for (const char *p = spec; *p;) {
        size_t n = strcspn(p, ","), klen = strcspn(p, "=");
        unsigned long long v;
        if (klen >= n || !parse_size(p + klen + 1, n - klen - 1, &v)) {
            snprintf(msg, len, "PULLBACKD_FAKE_CUDA: \"%.*s\" is not NAME=NUMBER", (int)n, p);
            return NULL;
        }
        if (klen == 7 && !strncmp(p, "devices", 7) && v >= 1 && v <= PB_GPU_MAX_DEVICES)
            F.ndev = (int)v;
        else if (klen == 6 && !strncmp(p, "memory", 6))
            F.memory = (size_t)v;
        else if (klen == 12 && !strncmp(p, "sticky_after", 12) && v < (1ull << 62))
            F.sticky_after = (long)v;
        else if (klen == 10 && !strncmp(p, "unbindable", 10) && v < PB_GPU_MAX_DEVICES)
            F.unbindable = (int)v;
        else if (klen == 11 && !strncmp(p, "solver_info", 11) && v >= 1 && v <= INT32_MAX)
            F.solver_info = (int)v;
        else if (klen == 10 && !strncmp(p, "solver_oom", 10) && v == 1)
            F.solver_oom = true;
        else {
            snprintf(msg, len,
                     "PULLBACKD_FAKE_CUDA: \"%.*s\": settings are devices=1..%d, memory=BYTES[K|M|G], "
                     "sticky_after=N, unbindable=DEVICE, solver_info=1..2^31-1, solver_oom=1",
                     (int)n, p, PB_GPU_MAX_DEVICES);
            return NULL;
        }
        p += n + (p[n] == ',');
    }
    return &fake;
}
