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
     * be src with the same strides.  With accumulate, dst[i] +=
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
/* The module's entry point. */
typedef const pb_gpu_backend_t *pb_gpu_module_fn(void);

#ifdef __cplusplus
}
#endif

#endif
