/* The GPU orchestration interface: everything the GPU ops ask of a device.
 *
 * The GPU op code (cuda/fused_dense.c and the ops to come) never names CUDA: it asks a backend, a table
 * of functions, for memory, copies, GEMMs and its own kernels.  Two
 * backends implement it:
 *   - the real one (cuda/real.cu: the CUDA runtime, cuBLAS, our kernels),
 *     built when nvcc is found (meson feature `cuda`);
 *   - a host fake (cuda/fake.c), on every build, that the test suite runs
 *     the GPU op code through on machines without a GPU.  It keeps device
 *     memory apart from host memory (a host dereference of a device pointer
 *     faults), checks the library preconditions, and injects out-of-memory
 *     and sticky errors on request.
 * pb_gpu_init picks one at start: the fake when PULLBACKD_FAKE_CUDA is set
 * (cuda/fake.h says what it takes), else the real one where it is built
 * and a device is present, else none (pb_gpu == NULL, no GPUs).
 *
 * Glossary
 *   device    a GPU ordinal, 0 ... count-1.
 *   worker    a thread bound to one device by thread_init: it owns that
 *             device's stream and library handles for the calling thread.
 *             The calls marked "stream" run on the calling worker's stream,
 *             in order; sync waits for them.
 *   failed    a device whose context hit a sticky error (illegal address,
 *             launch failure): every later call on it returns
 *             PB_EDEVICE_UNAVAILABLE, from every thread, and it stays so.
 *
 * Every function returns 0 or a negative PB_E* code (proto/errors.h):
 * PB_ENOMEM when device memory runs out, PB_EDEVICE_UNAVAILABLE when the
 * device has failed (or fails now), PB_EINTERNAL for a library error that
 * leaves the device usable; last_error() then has the library's words for
 * the log.
 *
 * Ownership: alloc's memory belongs to the caller until it gives it to
 * free (from any thread, the loop thread too).  The backend owns each
 * worker's stream, handles and staging buffers (thread_fini frees them).
 *
 * Dtypes are pb_dtype_t's values (0 f32, 1 f64, 2 c64, 3 c128); matrices
 * are column-major as in BLAS.  This header is C and C++ alike (real.cu
 * includes it). */
#ifndef PB_GPU_H
#define PB_GPU_H

#include <stddef.h>

#include "../proto/errors.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PB_GPU_MAX_DEVICES 16

typedef struct pb_gpu_info {
    char name[96];       /* "NVIDIA H200", "fake GPU 0" */
    size_t total_bytes;  /* the device's memory */
} pb_gpu_info_t;

/* A strided pass's index space (kernels/strided.h's pb_loop_t, field for
 * field): rank indices of sizes dim, and per operand the stride of each
 * index in elements (negative and 0 allowed). */
#define PB_GPU_MAX_RANK 16
typedef struct pb_gpu_loop {
    int rank;
    unsigned long long dim[PB_GPU_MAX_RANK];
    long long s[3][PB_GPU_MAX_RANK];
} pb_gpu_loop_t;

/* The factorizations' matrix kernels (kernels/factor_common.h says where
 * each serves): one pass over the m×n column-major x, leading dimension
 * ld.  Each kind does on the device what the CPU's helper of the same
 * name does on the host (kernels/factor_common_t.h, FZ(kernel_host)),
 * which the fake runs and the real backend's kernels follow.  The kinds
 * marked "waits" reduce into out (host memory): maxima are exact, so any
 * order gives the CPU's result; sums are in double in a fixed order. */
typedef enum pb_gpu_fz_kind {
    /* waits: out[0] = max|x_ij| (a complex modulus from re² + im², taken
     * again with every entry scaled by a power of two when the largest
     * square leaves double's normal range), out[1] = 1 when every entry
     * is finite, else 0 (then out[0] is unspecified) */
    PB_GPU_FZ_AMAX,
    /* waits: out[0] = the Frobenius norm, the sum of re² + im² in double
     * (taken again scaled by a power of two when it leaves the normal
     * range); NaN when an entry is */
    PB_GPU_FZ_NORM,
    /* waits: out[0] = max over i <= j of |x_ij - conj(x_ji)| (square x),
     * from the squares unless they leave the normal range (then hypot) */
    PB_GPU_FZ_HERM_GAP,
    /* x_jj = re(x_jj); x_ij = (x_ij + conj(x_ji))/2 for i > j: the lower
     * triangle a Hermitian solver reads (square x) */
    PB_GPU_FZ_HERMITIZE,
    /* x = (x - xᴴ)/2 over both triangles (square x) */
    PB_GPU_FZ_ANTIHERM,
    /* each column times conj(p)/|p|, p its entry of largest re² + im²
     * (the first on a tie), which is then set to |p| exactly; a zero
     * column stays.  v (when not NULL): n elements of the dtype, v_j =
     * p_j/|p_j| (1 for a zero column), the phase the matching row of the
     * SVD's Vh is multiplied by */
    PB_GPU_FZ_PHASES,
    /* waits: eigh's F-matrix (square x, w the n eigenvalues, ascending):
     * x_ij = x_ij/(w_j - w_i) where i != j and |w_j - w_i| >= param, else
     * x_ij = 0 and out[0] = the largest |x_ij| so zeroed; then x_ii += v_i
     * when v is not NULL.  w NULL: x is left as it is but for that
     * diagonal add (out[0] = 0).  w and v: device vectors of the real
     * dtype */
    PB_GPU_FZ_EIGH_F,
    /* x_ij = x_ij·v_i: v, m elements of the dtype */
    PB_GPU_FZ_ROWS_MUL,
    /* x_ij = x_ij/w_j: w, n values of the real dtype (a division, not a
     * product by the reciprocal) */
    PB_GPU_FZ_COLS_DIV,
    /* x_ij = x_ij/w_i: w, m values of the real dtype */
    PB_GPU_FZ_ROWS_DIV,
    /* waits: the SVD's K (square x and y, leading dimension ld both; w
     * the n singular values): with a = x_ij, b = y_ij, dm = w_j - w_i and
     * dp = w_j + w_i (in double), x_ij = (a + b)/dm unless |dm| < param,
     * where out[0] takes the largest |a + b| instead, plus (a - b)/dp
     * unless |dp| < param; then x_ii += v_i when v (n values of the real
     * dtype) is not NULL.  y is read only */
    PB_GPU_FZ_SVD_F,
    /* x_ij = sqrt(w_i)·x_ij, the square root and the product in double,
     * rounded once to the dtype: w, m values of the real dtype */
    PB_GPU_FZ_ROWS_SQRT_MUL,
    /* x_ij = x_ij·w_j in the dtype: w, n values of the real dtype */
    PB_GPU_FZ_COLS_MUL,
    /* square x: x_jj = re(x_jj), x_ji = conj(x_ij) for i > j (the upper
     * triangle from the lower: a Hermitian matrix from its lower half) */
    PB_GPU_FZ_MIRROR_LOWER,
    /* the polar pullback's Sylvester solve in P's eigenbasis (square x, w
     * the n values): s = w_i + w_j in double, x_ij = x_ij/s (in double,
     * rounded once) where |s| >= param, else 0 */
    PB_GPU_FZ_POLAR_F,
    /* x_ij = x_ij/w_j in the dtype where |w_j| >= param, else 0 (a
     * pseudo-inverse's columns): w, n values of the real dtype */
    PB_GPU_FZ_COLS_PINV,
} pb_gpu_fz_kind_t;

typedef struct pb_gpu_fz {
    int kind, dtype;
    int m, n, ld;
    void *x;
    const void *y, *w, *v;
    double param;
} pb_gpu_fz_t;

typedef struct pb_gpu_backend {
    const char *name; /* "cuda" or "fake" */
    /* Devices present (0 when none); called once at start. */
    int (*count)(void);
    int (*info)(int dev, pb_gpu_info_t *out);
    /* Bind the calling thread to dev and make its stream and handles. */
    int (*thread_init)(int dev);
    void (*thread_fini)(void);
    /* Device memory, from any thread.  alloc of 0 bytes gives NULL. */
    int (*alloc)(int dev, size_t bytes, void **p);
    void (*free)(int dev, void *p);
    /* Bytes allocated now on dev. */
    size_t (*used)(int dev);
    int (*failed)(int dev);
    /* Mark dev failed, as a sticky error would (a worker that cannot bind
     * to it at start: the daemon then serves the CPU and the other GPUs). */
    void (*set_failed)(int dev);
    /* A client's device memory passed as a file descriptor (contract
     * section 6, GPU buffers), from the loop thread: map its first size
     * bytes on dev, *p its device address.  The real backend takes a CUDA
     * virtual-memory allocation exported as a POSIX fd
     * (cuMemExportToShareableHandle) and checks it lives on dev; the fake
     * takes a memfd named "pb-fake-gpu:N" (N: its device).  0,
     * PB_EINVALID_ARGUMENT when fd is no such export or lives on another
     * device, PB_EDEVICE_UNAVAILABLE, or PB_ERESOURCE_EXHAUSTED; why says
     * what was wrong.  The fd stays the caller's. */
    int (*import_fd)(int dev, int fd, size_t size, void **p, char *why, size_t len);
    /* Unmap what import_fd mapped, from any thread, once nothing uses it. */
    void (*unimport)(int dev, void *p, size_t size);
    /* Stream: copies between host memory (any, pageable) and the device. */
    int (*h2d)(void *dst, const void *src, size_t n);
    int (*d2h)(void *dst, const void *src, size_t n);
    int (*zero)(void *dst, size_t n);
    /* Wait for the stream's work; a sticky error found now fails the device. */
    int (*sync)(void);
    /* Stream: C = alpha·op(A)·op(B) + beta·C, column-major, ta/tb 'N',
     * 'T' or 'C'; alpha and beta as {re, im} (im ignored for real dtypes). */
    int (*gemm)(int dtype, char ta, char tb, int m, int n, int k, const double alpha[2], const void *a, int lda,
                const void *b, int ldb, const double beta[2], void *c, int ldc);
    /* Stream: fused_dense's bias and activation over a dense (out × batch)
     * matrix in order 'C' or 'F': z = y + b (b NULL: none) saved into zbuf
     * when it is not NULL, y = act(z).  act is kernels/act.h's index. */
    int (*bias_act)(int dtype, int act, void *y, void *zbuf, const void *b, size_t out, size_t batch, char order);
    /* Stream: dz = ȳ ⊙ act′(s) over the same layout (s NULL: dz = ȳ);
     * dz may be ȳ itself. */
    int (*dz)(int dtype, int act, void *dz, const void *yb, const void *s, size_t out, size_t batch, char order);
    /* Stream: db[i] = Σ_j dz[i, j], each row summed in double over j in
     * order (deterministic), stored in dtype. */
    int (*row_sum)(int dtype, const void *dz, void *db, size_t out, size_t batch, char order);
    /* Stream: dst[i] = alpha·op(src[i]) + beta·src2[i] over L (strides
     * s[0] dst, s[1] src, s[2] src2), op(x) = conj(x) when conj (complex
     * dtypes); src2 NULL drops the beta term (src2 is not read).  dst may
     * be src with the same strides when src2 is NULL.  With accumulate, dst[i] +=
     * alpha·op(src[i]) (src2 unused) and dst strides may be 0: each dst
     * element then sums its share of the indices in a fixed order (no
     * atomics; the result does not depend on the launch).  alpha and beta
     * as {re, im}. */
    int (*strided)(int dtype, const pb_gpu_loop_t *L, void *dst, const void *src, int conj, const double alpha[2],
                   const void *src2, const double beta[2], int accumulate);
    /* Stream, then waits: out = Σ conj(op(a[i]))·b[i] over L (strides s[0]
     * a, s[1] b), summed in double in a fixed order (deterministic); out
     * is host memory, {re, im}. */
    int (*dot)(int dtype, const pb_gpu_loop_t *L, const void *a, int conj, const void *b, double out[2]);
    /* Stream: a factorization kernel (pb_gpu_fz_t); the kinds that reduce
     * wait for it.  out may be NULL for the others. */
    int (*fz)(const pb_gpu_fz_t *k, double out[2]);
    /* Stream, then waits: the eigendecomposition of the n×n Hermitian a
     * (column-major, lda >= n; the lower triangle is read): w (device, n
     * values of the real dtype) ascending; with vectors, a is overwritten
     * by orthonormal eigenvectors, else by the solver's work.  *info
     * (host) is the solver's: 0, or > 0 when it did not converge (LAPACK's
     * meaning).  cusolverDnXsyevd with the deterministic mode on. */
    int (*syevd)(int dtype, int vectors, int n, void *a, int lda, void *w, int *info);
    /* Stream, then waits: the SVD of the m×n a, m >= n (cuSOLVER's
     * gesvd takes no wide matrix: the caller transposes), a destroyed: s
     * (device, n values of the real dtype) descending; with vectors, the
     * thin U (m×n, ldu >= m) and Vᴴ (n×n, ldvt >= n), else u and vt are
     * not used (NULL).  *info (host) as syevd's.  cusolverDnXgesvd with
     * jobu = jobvt = 'S' or 'N'. */
    int (*gesvd)(int dtype, int vectors, int m, int n, void *a, int lda, void *s, void *u, int ldu, void *vt,
                 int ldvt, int *info);
    /* The library's words on the calling thread's last failure. */
    const char *(*last_error)(void);
} pb_gpu_backend_t;

/* The backend in use, or NULL: set by pb_gpu_init before any worker
 * starts, read-only after. */
extern const pb_gpu_backend_t *pb_gpu;

/* Pick the backend (see above) and count its devices: the count, 0 when
 * there are none, or a negative PB_E* code with why in msg (a bad
 * PULLBACKD_FAKE_CUDA). */
int pb_gpu_init(char *msg, size_t len);
/* Devices present: 0 before pb_gpu_init or without a backend. */
int pb_gpu_count(void);

/* The real backend, or NULL: cuda/real.cu is built as a module of its
 * own (libpullbackd-cuda.so, which alone links the CUDA libraries, so the
 * daemon starts where they or a driver are missing), loaded on the first
 * call from $PULLBACKD_CUDA_MODULE, else from the build tree the binary
 * lies in (../cuda/ or ../../cuda/), else the installed library folder.  why (if not NULL)
 * says why there is none. */
const pb_gpu_backend_t *pb__gpu_real(const char **why);
/* The module's entry point.  Its name carries the version of the table
 * above, so a module built against another layout of pb_gpu_backend_t
 * (a stale build: nvcc's objects do not track this header) is refused
 * instead of called through the wrong slots: bump it with every change
 * to the table. */
typedef const pb_gpu_backend_t *pb_gpu_module_fn(void);
#define PB_GPU_MODULE_FN pb__gpu_real_backend_v4

#ifdef __cplusplus
}
#endif

#endif
