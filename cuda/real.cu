/* The real GPU backend (cuda/gpu.h): the CUDA runtime, cuBLAS, cuSOLVER
 * (syevd, gesvd) and our own kernels for fused_dense, the strided passes and dot
 * (see "strided passes" below) and the factorizations' matrix passes (see
 * "the factorizations' matrix kernels").
 *
 * Devices.  count() asks cudaGetDeviceCount and nothing else, so a machine
 * without a driver or GPU makes no other CUDA call (cuBLAS handles leak
 * there).  Each device gets, lazily under its mutex from whichever thread
 * first needs it: its primary context, initialised with
 * cudaDeviceScheduleBlockingSync (waiting workers sleep); a memory pool;
 * a non-blocking "free stream" for allocations and frees from threads that
 * are not its workers (the loop thread frees tape memory); a failed flag;
 * and a record of each live allocation's size.
 *
 * Memory.  One explicit pool per device (cudaMemPoolCreate).  Its release
 * threshold is 256 MiB: the default 0 hands every unused byte back to the
 * driver at each stream synchronisation, and every request synchronises,
 * so each request would map its memory afresh; 256 MiB keeps a working set
 * cached across requests while holding at most that much idle memory from
 * the other users of the GPU.  On an allocation failure the pool is
 * trimmed to 0 and the allocation tried once more, then PB_ENOMEM.
 *   A worker allocates and frees in its stream's order.  Memory one worker
 * allocated may be used or freed by another worker or by the loop thread:
 * this relies on the rule that a worker synchronises its stream before it
 * answers (CUDA.md), so the allocation and every use of the memory have
 * completed by the time another thread can see the pointer.  A thread that
 * is not a worker of the device allocates on the device's free stream and
 * synchronises it, so the memory is ready for any stream; it frees on the
 * free stream (under the device mutex, after cudaSetDevice: the current
 * device is per thread), which needs no wait.
 *   used() is exact: the device's table of live allocations (pointer →
 * size, under the device mutex) keeps the byte count, not the pool's
 * cudaMemPoolAttrUsedMemCurrent, which rounds sizes up and counts the
 * backend's own cuBLAS workspaces.  free of a pointer the table does not
 * know is ignored, never handed to CUDA.
 *
 * Workers.  thread_init binds the calling thread: a non-blocking stream,
 * a cuBLAS handle on it (pedantic math: no TF32 or emulation; host pointer
 * mode; a 32 MiB workspace from the pool, so cuBLAS does not cudaMalloc
 * its own), a cuSOLVER handle on it (deterministic results, default math)
 * with one cusolverDnParams_t, dot's 4 KiB scratch from the pool (also
 * fz's partials and the solvers' info; neither it nor the cuBLAS workspace
 * counts in used()), two events and an 8 MiB pinned staging buffer, all in
 * thread-local state; thread_fini frees them.
 *
 * Copies.  Client memory is pageable: h2d and d2h go through the staging
 * buffer in two 4 MiB halves, each with an event recorded after the copy
 * that uses it.  h2d waits for a half's event before it writes the half
 * (so it never overwrites what a copy still reads), copies the chunk in
 * and queues the DMA; it returns without waiting (the data is already in
 * staging) and the next use of each half waits for its event.  d2h queues
 * up to two chunks ahead, waits for each chunk's event, copies it out and
 * queues the chunk after next into the half just emptied.
 *
 * Errors.  After every CUDA call: cudaErrorMemoryAllocation is PB_ENOMEM
 * (cleared); errors that poison the context (illegal address, launch
 * failure, illegal instruction, misaligned address, hardware stack error,
 * device assert, uncorrectable ECC or NVLink, launch timeout, contained
 * error, destroyed context; also no usable device or driver), or any error
 * that cudaGetLastError cannot clear (cudaPeekAtLastError still returns an
 * error afterwards), mark the device failed: PB_EDEVICE_UNAVAILABLE, now
 * and from every later call for that device, which then touches CUDA no
 * more.  Anything else is cleared and PB_EINTERNAL.  cuBLAS's and
 * cuSOLVER's ALLOC_FAILED are PB_ENOMEM; their other failures look at the
 * CUDA error underneath the same way.  On a failed device, free and thread_fini only
 * forget their memory (its bytes leave used()) and leak it: a poisoned
 * context can be torn down only by the process's end.
 *
 * Imports (import_fd, unimport: CUDA.md, "Zero-copy device tensors between
 * processes").  A client's CUDA virtual-memory allocation, exported as a
 * POSIX fd (cuMemCreate requesting CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
 * cuMemExportToShareableHandle), is imported and mapped with the driver
 * API.  The module does not link libcuda: the driver functions come from
 * cudaGetDriverEntryPointByVersion, each at the CUDA version of the ABI we
 * call (see drv_resolve), resolved once; a failure is remembered and every
 * import then fails with PB_EINTERNAL.  import_fd runs on the loop thread:
 * it makes dev current (per thread), checks the device takes POSIX fd
 * handles, imports the handle, checks the allocation lives on dev by UUID
 * (not ordinal: CUDA_VISIBLE_DEVICES renumbers per process), rounds size up
 * to the allocation granularity, reserves that much address space, maps
 * the handle there (cuMemMap fails when the allocation is smaller), gives
 * dev read-write access and releases the handle: the mapping holds the
 * memory, so it stays alive as long as the daemon's mapping does, even if
 * the client exits or frees its side.  The fd stays the caller's (the
 * driver does not close it).  Kernels and cuBLAS use the address like any
 * device pointer.  Each device keeps a table of its imports (address ->
 * rounded size, under the device mutex; not counted in used()).
 *   unimport unmaps and frees the address range, from any thread.  It does
 * not synchronise anything: it relies on the daemon calling it only after
 * every request that used the memory has finished, and each of those
 * synchronised its stream before answering (CUDA.md), so no stream can
 * still touch the range.  On a failed device unimport only drops the
 * record (the mapping leaks, as above). */
#include <cublas_v2.h>
#include <cuda.h> /* types only: no -lcuda, see "Imports" */
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>

#include "cuda/gpu.h"
#include "kernels/act.h"

namespace {

constexpr size_t STAGING_BYTES = (size_t)8 << 20; /* two halves */
constexpr size_t STAGING_HALF = STAGING_BYTES / 2;
constexpr size_t WORKSPACE_BYTES = (size_t)32 << 20; /* cuBLAS's advice for Hopper */
constexpr uint64_t POOL_RELEASE_THRESHOLD = (uint64_t)256 << 20;
constexpr int THREADS = 256;

struct dev_state {
    std::mutex mu;
    std::atomic<bool> ready{false};
    std::atomic<bool> failed{false};
    std::atomic<size_t> used{0};
    /* Set once under mu before ready, read-only after. */
    cudaMemPool_t pool = nullptr;
    cudaStream_t free_stream = nullptr;
    unsigned max_blocks = 0;
    /* Live allocations, under mu; made with the device, never destroyed
     * (no static destructor races a late free at exit). */
    std::unordered_map<void *, size_t> *sizes = nullptr;
    /* Live imports (address -> rounded size), under mu; likewise. */
    std::unordered_map<void *, size_t> *imports = nullptr;
};

dev_state g_dev[PB_GPU_MAX_DEVICES];
std::atomic<int> g_count{0};

/* The calling thread's worker state; zero (unbound) in a new thread. */
struct worker_state {
    bool bound;
    int dev;
    cudaStream_t stream;
    cublasHandle_t blas;
    cusolverDnHandle_t solver;
    cusolverDnParams_t solver_params;
    void *workspace;
    /* DOT_SCRATCH bytes, in stream order: dot's and fz's partials and
     * result, syevd's and gesvd's info */
    void *dot_scratch;
    unsigned char *staging;
    cudaEvent_t ev[2];
};
thread_local worker_state t_w;
thread_local char t_err[256];

void set_err(const char *what, const char *name, const char *text)
{
    snprintf(t_err, sizeof t_err, "%s: %s (%s)", what, name, text);
}

bool valid_dev(int dev)
{
    return dev >= 0 && dev < g_count.load(std::memory_order_relaxed);
}

/* Errors after which the context (or the device) cannot be used again. */
bool poisons(cudaError_t e)
{
    switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchTimeout:
    case cudaErrorContained:
    case cudaErrorContextIsDestroyed:
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
        return true;
    default:
        return false;
    }
}

/* Classify a failed CUDA call on dev (-1: none), see the top. */
int cuda_fail(int dev, cudaError_t e, const char *what)
{
    set_err(what, cudaGetErrorName(e), cudaGetErrorString(e));
    bool sticky = poisons(e);
    (void)cudaGetLastError(); /* clears a non-sticky error */
    if (!sticky && e != cudaErrorMemoryAllocation)
        sticky = cudaPeekAtLastError() != cudaSuccess;
    if (sticky) {
        if (dev >= 0 && dev < PB_GPU_MAX_DEVICES)
            g_dev[dev].failed.store(true);
        return PB_EDEVICE_UNAVAILABLE;
    }
    return e == cudaErrorMemoryAllocation ? PB_ENOMEM : PB_EINTERNAL;
}

#define CK(dev, call)                               \
    do {                                            \
        cudaError_t ck_e_ = (call);                 \
        if (ck_e_ != cudaSuccess)                   \
            return cuda_fail((dev), ck_e_, #call);  \
    } while (0)

/* A library's failure (cuBLAS's, cuSOLVER's: its status name and words)
 * as a PB_E* code: its own out of memory, a sticky CUDA error beneath it
 * (the device fails), else internal. */
int lib_fail(int dev, bool alloc_failed, const char *name, const char *words, const char *what)
{
    if (alloc_failed) {
        set_err(what, name, words);
        return PB_ENOMEM;
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        int rc = cuda_fail(dev, e, what);
        size_t len = strlen(t_err);
        snprintf(t_err + len, sizeof t_err - len, " [%s]", name);
        return rc;
    }
    set_err(what, name, words);
    return PB_EINTERNAL;
}

int blas_fail(int dev, cublasStatus_t s, const char *what)
{
    return lib_fail(dev, s == CUBLAS_STATUS_ALLOC_FAILED, cublasGetStatusName(s), cublasGetStatusString(s), what);
}

#define BK(dev, call)                               \
    do {                                            \
        cublasStatus_t bk_s_ = (call);              \
        if (bk_s_ != CUBLAS_STATUS_SUCCESS)         \
            return blas_fail((dev), bk_s_, #call);  \
    } while (0)

/* cuSOLVER has no status names or strings of its own. */
const char *solver_status_text(cusolverStatus_t s, const char **text)
{
    switch (s) {
#define SOLVER_STATUS(name, words) \
    case name:                     \
        *text = words;             \
        return #name;
        SOLVER_STATUS(CUSOLVER_STATUS_NOT_INITIALIZED, "the handle is not initialised")
        SOLVER_STATUS(CUSOLVER_STATUS_ALLOC_FAILED, "cuSOLVER could not allocate memory")
        SOLVER_STATUS(CUSOLVER_STATUS_INVALID_VALUE, "an argument was rejected")
        SOLVER_STATUS(CUSOLVER_STATUS_ARCH_MISMATCH, "the device lacks a feature cuSOLVER needs")
        SOLVER_STATUS(CUSOLVER_STATUS_MAPPING_ERROR, "a texture mapping failed")
        SOLVER_STATUS(CUSOLVER_STATUS_EXECUTION_FAILED, "a kernel failed to launch or run")
        SOLVER_STATUS(CUSOLVER_STATUS_INTERNAL_ERROR, "an internal cuSOLVER operation failed")
        SOLVER_STATUS(CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED, "matrix type not supported")
        SOLVER_STATUS(CUSOLVER_STATUS_NOT_SUPPORTED, "not supported")
        SOLVER_STATUS(CUSOLVER_STATUS_INVALID_WORKSPACE, "invalid workspace")
#undef SOLVER_STATUS
    default:
        *text = "a cuSOLVER failure";
        return "CUSOLVER_STATUS_UNKNOWN";
    }
}

int solver_fail(int dev, cusolverStatus_t s, const char *what)
{
    const char *words, *name = solver_status_text(s, &words);
    return lib_fail(dev, s == CUSOLVER_STATUS_ALLOC_FAILED, name, words, what);
}

#define SK(dev, call)                                 \
    do {                                              \
        cusolverStatus_t sk_s_ = (call);              \
        if (sk_s_ != CUSOLVER_STATUS_SUCCESS)         \
            return solver_fail((dev), sk_s_, #call);  \
    } while (0)

int unavailable(int dev)
{
    char what[32];
    snprintf(what, sizeof what, "device %d", dev);
    set_err(what, "failed", "an earlier sticky error; no more calls on it");
    return PB_EDEVICE_UNAVAILABLE;
}

int internal(const char *what, const char *why)
{
    set_err(what, "misuse", why);
    return PB_EINTERNAL;
}

/* Make dev the calling thread's current device; *restore is the device to
 * return to afterwards (the worker's own), -1 for none. */
int enter_dev(int dev, int *restore)
{
    int cur = -1;
    *restore = -1;
    if (cudaGetDevice(&cur) != cudaSuccess) {
        (void)cudaGetLastError();
        cur = -1;
    }
    if (cur == dev)
        return 0;
    CK(dev, cudaSetDevice(dev));
    if (t_w.bound && t_w.dev != dev)
        *restore = t_w.dev;
    return 0;
}

void leave_dev(int restore)
{
    if (restore >= 0 && cudaSetDevice(restore) != cudaSuccess)
        (void)cudaGetLastError();
}

/* Under d.mu, current device dev. */
int dev_create(int dev, dev_state &d)
{
    cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = dev;
    int sms = 0;
    CK(dev, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CK(dev, cudaMemPoolCreate(&d.pool, &props));
    uint64_t threshold = POOL_RELEASE_THRESHOLD;
    cudaError_t e = cudaMemPoolSetAttribute(d.pool, cudaMemPoolAttrReleaseThreshold, &threshold);
    if (e == cudaSuccess)
        e = cudaStreamCreateWithFlags(&d.free_stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        int rc = cuda_fail(dev, e, "pool attribute or free stream");
        (void)cudaMemPoolDestroy(d.pool);
        d.pool = nullptr;
        return rc;
    }
    d.sizes = new (std::nothrow) std::unordered_map<void *, size_t>();
    d.imports = new (std::nothrow) std::unordered_map<void *, size_t>();
    if (!d.sizes || !d.imports) {
        delete d.sizes;
        delete d.imports;
        d.sizes = nullptr;
        d.imports = nullptr;
        (void)cudaStreamDestroy(d.free_stream);
        (void)cudaMemPoolDestroy(d.pool);
        d.free_stream = nullptr;
        d.pool = nullptr;
        return internal("device state", "out of host memory");
    }
    d.max_blocks = (unsigned)(sms > 0 ? sms : 1) * 8;
    return 0;
}

/* The device's context, pool and free stream, made once. */
int dev_ensure(int dev)
{
    dev_state &d = g_dev[dev];
    if (d.ready.load(std::memory_order_acquire))
        return 0;
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.ready.load(std::memory_order_relaxed))
        return 0;
    if (d.failed.load())
        return unavailable(dev);
    /* Before anything makes the primary context: blocking waits. */
    cudaError_t e = cudaInitDevice(dev, cudaDeviceScheduleBlockingSync, cudaInitDeviceFlagsAreValid);
    if (e == cudaErrorSetOnActiveProcess)
        (void)cudaGetLastError(); /* already made: keep its flags */
    else if (e != cudaSuccess)
        return cuda_fail(dev, e, "cudaInitDevice");
    int restore;
    int rc = enter_dev(dev, &restore);
    if (rc)
        return rc;
    rc = dev_create(dev, d);
    leave_dev(restore);
    if (rc)
        return rc;
    d.ready.store(true, std::memory_order_release);
    return 0;
}

/* For the stream calls: the calling thread must be a worker of a device
 * that has not failed. */
int worker_check(const char *what)
{
    if (!t_w.bound)
        return internal(what, "the calling thread is not a GPU worker");
    if (g_dev[t_w.dev].failed.load())
        return unavailable(t_w.dev);
    return 0;
}

unsigned blocks_for(size_t n)
{
    size_t b = (n + THREADS - 1) / THREADS, cap = g_dev[t_w.dev].max_blocks;
    return (unsigned)(b < cap ? b : cap);
}

int launched(const char *what)
{
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : cuda_fail(t_w.dev, e, what);
}

/* ---- kernels ---- */

__device__ __forceinline__ float act_value(int a, float z) { return pb_act_valuef(a, z); }
__device__ __forceinline__ double act_value(int a, double z) { return pb_act_value(a, z); }
__device__ __forceinline__ float act_deriv(int a, float s) { return pb_act_derivf(a, s); }
__device__ __forceinline__ double act_deriv(int a, double s) { return pb_act_deriv(a, s); }

#define GRID_STRIDE(idx, n)                                                              \
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < (n);          \
         idx += (size_t)gridDim.x * blockDim.x)

/* Element (i, j) at i·batch + j ('C') or j·out + i ('F'); A is the
 * activation, a constant so its switch folds away. */
template <typename T, int A>
__global__ void k_bias_act(T *y, T *zbuf, const T *b, size_t out, size_t batch, bool corder)
{
    size_t total = out * batch;
    GRID_STRIDE(idx, total)
    {
        size_t i = corder ? idx / batch : idx % out;
        T v = y[idx];
        /* As the CPU loop: it adds the bias (0 without b) except in 'F'
         * order with neither b nor zbuf, and -0 + 0 is +0. */
        T z = (b || zbuf || corder) ? v + (b ? b[i] : (T)0) : v;
        if (zbuf)
            zbuf[idx] = z;
        y[idx] = act_value(A, z);
    }
}

/* Elementwise, so the order does not matter; dz may be yb. */
template <typename T, int A>
__global__ void k_dz(T *dz, const T *yb, const T *s, size_t total)
{
    GRID_STRIDE(idx, total)
    {
        T g = yb[idx];
        dz[idx] = s ? g * act_deriv(A, s[idx]) : g;
    }
}

/* One thread a row, summed over j in order in double. */
template <typename T>
__global__ void k_row_sum(const T *dz, T *db, size_t out, size_t batch, bool corder)
{
    GRID_STRIDE(i, out)
    {
        double acc = 0;
        if (corder) {
            const T *r = dz + i * batch;
            for (size_t j = 0; j < batch; j++)
                acc += r[j];
        } else {
            for (size_t j = 0; j < batch; j++)
                acc += dz[j * out + i];
        }
        db[i] = (T)acc;
    }
}

/* C = beta·C over m × n with leading dimension ldc (gemm with k = 0);
 * beta = 0 writes zeros (C is not read, as in BLAS). */
__device__ __forceinline__ float scale(float v, float b) { return v * b; }
__device__ __forceinline__ double scale(double v, double b) { return v * b; }
__device__ __forceinline__ float2 scale(float2 v, float2 b)
{
    return make_float2(v.x * b.x - v.y * b.y, v.x * b.y + v.y * b.x);
}
__device__ __forceinline__ double2 scale(double2 v, double2 b)
{
    return make_double2(v.x * b.x - v.y * b.y, v.x * b.y + v.y * b.x);
}

template <typename T>
__global__ void k_scale(T *c, size_t ldc, size_t m, size_t n, T beta, bool zero)
{
    GRID_STRIDE(idx, m * n)
    {
        T *p = c + (idx / m) * ldc + idx % m;
        *p = zero ? T() : scale(*p, beta);
    }
}

template <typename T>
int launch_bias_act(int act, void *y, void *zbuf, const void *b, size_t out, size_t batch, bool corder)
{
    unsigned g = blocks_for(out * batch);
#define BA_LAUNCH(A)                                                                             \
    k_bias_act<T, A><<<g, THREADS, 0, t_w.stream>>>((T *)y, (T *)zbuf, (const T *)b, out, batch, \
                                                     corder);
    PB_ACT_DISPATCH(act, BA_LAUNCH)
#undef BA_LAUNCH
    return launched("bias_act kernel launch");
}

template <typename T>
int launch_dz(int act, void *dz, const void *yb, const void *s, size_t total)
{
    unsigned g = blocks_for(total);
#define DZ_LAUNCH(A) k_dz<T, A><<<g, THREADS, 0, t_w.stream>>>((T *)dz, (const T *)yb, (const T *)s, total);
    PB_ACT_DISPATCH(act, DZ_LAUNCH)
#undef DZ_LAUNCH
    return launched("dz kernel launch");
}

template <typename T>
int launch_scale(void *c, int ldc, int m, int n, T beta, bool zero)
{
    k_scale<T><<<blocks_for((size_t)m * (size_t)n), THREADS, 0, t_w.stream>>>((T *)c, (size_t)ldc, (size_t)m,
                                                                              (size_t)n, beta, zero);
    return launched("gemm k=0 scale kernel launch");
}

/* ---- strided passes and dot (kernels/strided.c's pb_strided and
 * pb_strided_dot) ----
 *
 * Elements.  Complex values are read and written as two scalars (cf, cd:
 * the alignment of float/double complex in C), never as float2/double2,
 * whose 8- or 16-byte accesses would fault on an operand that is only
 * aligned to its real type.  The elementwise arithmetic rounds every
 * product and sum by itself (__fmul_rn and friends: no FMA contraction),
 * as the CPU build does (x86-64 without FMA), and multiplies complex
 * numbers the textbook way, (ac - bd) + (ad + bc)i, as C's fast path does:
 * finite results match the CPU bit for bit (C's recovery of infinities
 * from NaN products is not reproduced).  alpha = 1 skips the product.
 *
 * The index space.  Size-1 indices are dropped.  An index with dst stride
 * != 0 is "owned": one thread per dst element over the owned indices,
 * innermost the smallest |dst stride| (coalesced writes), indices
 * contiguous in every operand merged.  A dst stride 0 index is "reduced"
 * under accumulate: the owning thread loads dst once, adds its terms in
 * row-major order of the reduced indices (the last fastest), each sum
 * rounded in the element type as the CPU's dst[i] += does (the CPU's walk
 * may order those terms differently: f32 sums can differ in the last
 * bits), and stores once.  Without accumulate a dst stride 0 index keeps
 * the CPU's last write, the value at its last position.  Index math is
 * 64-bit (32-bit division where the values fit). */

struct cf {
    float re, im;
};
struct cd {
    double re, im;
};

__device__ __forceinline__ float e_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double e_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float e_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double e_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float e_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double e_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ cf e_mul(cf a, cf b)
{
    return {e_sub(e_mul(a.re, b.re), e_mul(a.im, b.im)), e_add(e_mul(a.re, b.im), e_mul(a.im, b.re))};
}
__device__ __forceinline__ cd e_mul(cd a, cd b)
{
    return {e_sub(e_mul(a.re, b.re), e_mul(a.im, b.im)), e_add(e_mul(a.re, b.im), e_mul(a.im, b.re))};
}
__device__ __forceinline__ cf e_add(cf a, cf b) { return {e_add(a.re, b.re), e_add(a.im, b.im)}; }
__device__ __forceinline__ cd e_add(cd a, cd b) { return {e_add(a.re, b.re), e_add(a.im, b.im)}; }
__device__ __forceinline__ float e_conj(float a) { return a; }
__device__ __forceinline__ double e_conj(double a) { return a; }
__device__ __forceinline__ cf e_conj(cf a) { return {a.re, -a.im}; }
__device__ __forceinline__ cd e_conj(cd a) { return {a.re, -a.im}; }

/* A scalar {re, im} as T (the imaginary part dropped for real T). */
template <typename T> T to_elem(const double s[2]);
template <> float to_elem<float>(const double s[2]) { return (float)s[0]; }
template <> double to_elem<double>(const double s[2]) { return s[0]; }
template <> cf to_elem<cf>(const double s[2]) { return {(float)s[0], (float)s[1]}; }
template <> cd to_elem<cd>(const double s[2]) { return {s[0], s[1]}; }

/* The launch's index space: no owned indices (innermost first), then nr
 * reduced ones (outermost first), n owned elements. */
struct sloop {
    int no, nr;
    unsigned long long n;
    unsigned long long dim[PB_GPU_MAX_RANK];
    long long s[3][PB_GPU_MAX_RANK];
};

/* q = r / d, returns r % d. */
__device__ __forceinline__ unsigned long long divmod(unsigned long long r, unsigned long long d,
                                                     unsigned long long *q)
{
    if ((r | d) >> 32 == 0) {
        unsigned r32 = (unsigned)r, d32 = (unsigned)d, q32 = r32 / d32;
        *q = q32;
        return r32 - q32 * d32;
    }
    *q = r / d;
    return r - *q * d;
}

/* The offsets (nops operands) of owned element idx. */
template <int NOPS>
__device__ __forceinline__ void owned_offsets(const sloop &L, unsigned long long idx, long long off[3])
{
    for (int o = 0; o < NOPS; o++)
        off[o] = 0;
    for (int k = 0; k < L.no; k++) {
        unsigned long long q, i = divmod(idx, L.dim[k], &q);
        idx = q;
        for (int o = 0; o < NOPS; o++)
            off[o] += (long long)i * L.s[o][k];
    }
}

/* dst = alpha·op(src) (+ beta·src2 with two); ZERO: dst = 0 (src and
 * src2 not read).  Not __restrict__: dst may be src or src2. */
template <typename T, bool ZERO>
__global__ void k_strided_set(sloop L, T *dst, const T *src, const T *src2, T alpha, T beta, bool cj, bool one,
                              bool two)
{
    GRID_STRIDE(idx, L.n)
    {
        long long off[3];
        if constexpr (ZERO) {
            owned_offsets<1>(L, idx, off);
            dst[off[0]] = T();
            continue;
        }
        owned_offsets<3>(L, idx, off);
        T v = src[off[1]];
        if (cj)
            v = e_conj(v);
        if (!one)
            v = e_mul(alpha, v);
        if (two)
            v = e_add(v, e_mul(beta, src2[off[2]]));
        dst[off[0]] = v;
    }
}

/* dst += alpha·op(src), each owned element summing its reduced indices. */
template <typename T>
__global__ void k_strided_acc(sloop L, T *dst, const T *src, T alpha, bool cj, bool one)
{
    GRID_STRIDE(idx, L.n)
    {
        long long off[3];
        owned_offsets<2>(L, idx, off);
        T acc = dst[off[0]];
        const T *sp = src + off[1];
        unsigned long long cnt[PB_GPU_MAX_RANK];
        for (int r = 0; r < L.nr; r++)
            cnt[r] = 0;
        for (;;) {
            T v = *sp;
            if (cj)
                v = e_conj(v);
            if (!one)
                v = e_mul(alpha, v);
            acc = e_add(acc, v);
            int r = L.nr - 1;
            for (; r >= 0; r--) { /* row-major: the last reduced index fastest */
                int k = L.no + r;
                if (++cnt[r] < L.dim[k]) {
                    sp += L.s[1][k];
                    break;
                }
                cnt[r] = 0;
                sp -= (long long)(L.dim[k] - 1) * L.s[1][k];
            }
            if (r < 0)
                break;
        }
        dst[off[0]] = acc;
    }
}

/* dot: a fixed grid, whatever the device, so the order of the sums (and
 * so the result) is the same everywhere.  Each thread sums its share
 * (indices tid, tid + DOT_BLOCKS·THREADS, ...) in double, each block
 * reduces its threads in shared memory in a fixed tree and writes its
 * partial; one block then sums the partials the same way. */
constexpr unsigned DOT_BLOCKS = 256;
constexpr size_t DOT_SCRATCH = (DOT_BLOCKS + 1) * sizeof(cd); /* the partials, then the result */

__device__ __forceinline__ cd dot_term(float a, float b, bool) { return {(double)a * (double)b, 0}; }
__device__ __forceinline__ cd dot_term(double a, double b, bool) { return {a * b, 0}; }
/* conj(op(a))·b: op(a) = conj(a) when cj, and conj(conj(a)) is a. */
__device__ __forceinline__ cd dot_term(cd a, cd b, bool cj)
{
    double ai = cj ? a.im : -a.im;
    return {a.re * b.re - ai * b.im, a.re * b.im + ai * b.re};
}
__device__ __forceinline__ cd dot_term(cf a, cf b, bool cj)
{
    return dot_term(cd{a.re, a.im}, cd{b.re, b.im}, cj);
}

/* Sum sh[0 .. THREADS) into sh[0] in a fixed tree; all threads call it. */
__device__ __forceinline__ void block_sum(cd *sh)
{
    for (unsigned w = THREADS / 2; w > 0; w /= 2) {
        __syncthreads();
        if (threadIdx.x < w) {
            sh[threadIdx.x].re += sh[threadIdx.x + w].re;
            sh[threadIdx.x].im += sh[threadIdx.x + w].im;
        }
    }
    __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(THREADS) k_dot(sloop L, const T *a, const T *b, bool cj, cd *part)
{
    __shared__ cd sh[THREADS];
    cd sum = {0, 0};
    GRID_STRIDE(idx, L.n)
    {
        long long off[3];
        owned_offsets<2>(L, idx, off);
        cd t = dot_term(a[off[0]], b[off[1]], cj);
        sum.re += t.re;
        sum.im += t.im;
    }
    sh[threadIdx.x] = sum;
    block_sum(sh);
    if (threadIdx.x == 0)
        part[blockIdx.x] = sh[0];
}

__global__ void __launch_bounds__(THREADS) k_dot_final(cd *part)
{
    __shared__ cd sh[THREADS];
    cd sum = {0, 0};
    for (unsigned i = threadIdx.x; i < DOT_BLOCKS; i += THREADS) {
        sum.re += part[i].re;
        sum.im += part[i].im;
    }
    sh[threadIdx.x] = sum;
    block_sum(sh);
    if (threadIdx.x == 0)
        part[DOT_BLOCKS] = sh[0];
}

long long mag(long long x) { return x < 0 ? -x : x; }

/* Plan L's index space for a launch (see above): nops operands in use;
 * with reduce, indices of operand 0 stride 0 become reduced ones, else
 * every index is owned (without it, a stride-0 index of operand 0 is
 * fixed at its last position when fix is not NULL: fix[o] gets the
 * offsets).  Returns 1 when the space is empty, 0, or PB_EINTERNAL. */
int plan(const pb_gpu_loop_t *L, int nops, bool reduce, long long *fix, sloop *P, const char *what)
{
    if (!L || L->rank < 0 || L->rank > PB_GPU_MAX_RANK)
        return internal(what, "bad loop rank");
    memset(P, 0, sizeof *P);
    for (int k = 0; k < L->rank; k++)
        if (L->dim[k] == 0)
            return 1;
    int red[PB_GPU_MAX_RANK], nr = 0;
    for (int k = 0; k < L->rank; k++) {
        if (L->dim[k] == 1)
            continue;
        if (L->s[0][k] == 0 && reduce) {
            red[nr++] = k;
            continue;
        }
        if (L->s[0][k] == 0 && fix) {
            for (int o = 1; o < 3; o++)
                fix[o] += (long long)(L->dim[k] - 1) * L->s[o][k];
            continue;
        }
        /* insert by |stride| of operand 0, then 1 (stable) */
        int j = P->no++;
        for (; j > 0; j--) {
            long long a0 = mag(P->s[0][j - 1]), b0 = mag(L->s[0][k]);
            long long a1 = mag(P->s[1][j - 1]), b1 = mag(L->s[1][k]);
            if (a0 < b0 || (a0 == b0 && a1 <= b1))
                break;
            P->dim[j] = P->dim[j - 1];
            for (int o = 0; o < 3; o++)
                P->s[o][j] = P->s[o][j - 1];
        }
        P->dim[j] = L->dim[k];
        for (int o = 0; o < 3; o++)
            P->s[o][j] = o < nops ? L->s[o][k] : 0;
    }
    /* merge owned indices contiguous in every operand */
    int r = 0;
    for (int k = 1; k < P->no; k++) {
        bool merge = true;
        for (int o = 0; o < nops; o++)
            merge = merge && P->s[o][k] == P->s[o][r] * (long long)P->dim[r];
        unsigned long long m;
        if (merge && !__builtin_mul_overflow(P->dim[r], P->dim[k], &m)) {
            P->dim[r] = m;
            continue;
        }
        r++;
        P->dim[r] = P->dim[k];
        for (int o = 0; o < 3; o++)
            P->s[o][r] = P->s[o][k];
    }
    if (P->no > 0)
        P->no = r + 1;
    P->n = 1;
    for (int k = 0; k < P->no; k++)
        if (__builtin_mul_overflow(P->n, P->dim[k], &P->n))
            return internal(what, "too many elements");
    P->nr = nr;
    for (int q = 0; q < nr; q++) {
        P->dim[P->no + q] = L->dim[red[q]];
        for (int o = 0; o < 3; o++)
            P->s[o][P->no + q] = o < nops ? L->s[o][red[q]] : 0;
    }
    return 0;
}

template <typename T>
int launch_strided(const sloop &P, void *dst, const void *src, const void *src2, const double alpha[2],
                   const double beta[2], bool cj, bool one, bool acc, bool zero)
{
    unsigned g = blocks_for(P.n);
    T al = to_elem<T>(alpha), be = src2 ? to_elem<T>(beta) : T();
    if (acc)
        k_strided_acc<T><<<g, THREADS, 0, t_w.stream>>>(P, (T *)dst, (const T *)src, al, cj, one);
    else if (zero)
        k_strided_set<T, true><<<g, THREADS, 0, t_w.stream>>>(P, (T *)dst, nullptr, nullptr, al, be, false, true,
                                                              false);
    else
        k_strided_set<T, false><<<g, THREADS, 0, t_w.stream>>>(P, (T *)dst, (const T *)src, (const T *)src2, al, be,
                                                               cj, one, src2 != nullptr);
    return launched("strided kernel launch");
}

template <typename T>
int launch_dot(const sloop &P, const void *a, const void *b, bool cj, cd *part)
{
    k_dot<T><<<DOT_BLOCKS, THREADS, 0, t_w.stream>>>(P, (const T *)a, (const T *)b, cj, part);
    int rc = launched("dot kernel launch");
    if (rc)
        return rc;
    k_dot_final<<<1, THREADS, 0, t_w.stream>>>(part);
    return launched("dot final kernel launch");
}

/* ---- the factorizations' matrix kernels (gpu.h's pb_gpu_fz_t) ----
 *
 * Each kind follows the CPU's helper (kernels/factor_common_t.h,
 * FZ(kernel_host), which the fake runs) operation for operation: the same
 * promotions to double and roundings back to the element type, each
 * product, sum and quotient rounded by itself (__dmul_rn and friends: no
 * FMA contraction, as the CPU build has none), complex products the
 * textbook way as the strided passes do.  Finite results then match the
 * CPU's bit for bit, but for moduli taken with hypot (cabs on the CPU),
 * where CUDA's libm may differ from glibc's by an ulp or two (CUDA.md),
 * and NORM's sum, which adds in another (fixed) order than the CPU's loop.
 *
 * Reductions run on dot's fixed grid (FZ_BLOCKS blocks of THREADS, each
 * thread over indices tid, tid + FZ_BLOCKS·THREADS, ...; a fixed tree in
 * each block, then one block over the partials) into dot's scratch, so
 * the one sum (NORM, in double) has the same order on every device, and
 * maxima are exact in any order.  A reduction yields two doubles (a cd,
 * re and im by name only).  Where the CPU takes a second pass (scaled
 * squares, hypot), the host reads the first result, decides as the CPU
 * does, and launches the second. */
constexpr unsigned FZ_BLOCKS = DOT_BLOCKS;

template <typename T> struct fz_real_of {
    using type = T;
};
template <> struct fz_real_of<cf> {
    using type = float;
};
template <> struct fz_real_of<cd> {
    using type = double;
};
template <typename T> using real_t = typename fz_real_of<T>::type;
template <typename T> constexpr bool is_cplx = false;
template <> constexpr bool is_cplx<cf> = true;
template <> constexpr bool is_cplx<cd> = true;

/* C's RE and IM: the parts as double. */
__device__ __forceinline__ double re_of(float a) { return a; }
__device__ __forceinline__ double re_of(double a) { return a; }
__device__ __forceinline__ double re_of(cf a) { return a.re; }
__device__ __forceinline__ double re_of(cd a) { return a.re; }
__device__ __forceinline__ double im_of(float) { return 0; }
__device__ __forceinline__ double im_of(double) { return 0; }
__device__ __forceinline__ double im_of(cf a) { return a.im; }
__device__ __forceinline__ double im_of(cd a) { return a.im; }

/* (T) of a value computed in double: each part rounded to T's real type
 * (the imaginary part dropped for real T). */
template <typename T> __device__ __forceinline__ T from_parts(double re, double im);
template <> __device__ __forceinline__ float from_parts<float>(double re, double) { return (float)re; }
template <> __device__ __forceinline__ double from_parts<double>(double re, double) { return re; }
template <> __device__ __forceinline__ cf from_parts<cf>(double re, double im) { return {(float)re, (float)im}; }
template <> __device__ __forceinline__ cd from_parts<cd>(double re, double im) { return {re, im}; }

__device__ __forceinline__ cf e_sub(cf a, cf b) { return {e_sub(a.re, b.re), e_sub(a.im, b.im)}; }
__device__ __forceinline__ cd e_sub(cd a, cd b) { return {e_sub(a.re, b.re), e_sub(a.im, b.im)}; }

/* re² + im² in double, as the CPU's squared moduli. */
__device__ __forceinline__ double sq(double re, double im) { return __dadd_rn(__dmul_rn(re, re), __dmul_rn(im, im)); }
template <typename T> __device__ __forceinline__ double sq(T a) { return sq(re_of(a), im_of(a)); }

/* The CPU's ABS: fabs, or cabs of the value promoted to double complex. */
__device__ __forceinline__ double abs_of(float a) { return fabs((double)a); }
__device__ __forceinline__ double abs_of(double a) { return fabs(a); }
__device__ __forceinline__ double abs_of(cf a) { return hypot((double)a.re, (double)a.im); }
__device__ __forceinline__ double abs_of(cd a) { return hypot(a.re, a.im); }

/* (T)(x * 0.5) and (T)(x / d): T times or over a double, in double. */
template <typename T> __device__ __forceinline__ T half_of(T x)
{
    return from_parts<T>(__dmul_rn(re_of(x), 0.5), __dmul_rn(im_of(x), 0.5));
}
template <typename T> __device__ __forceinline__ T div_by(T x, double d)
{
    return from_parts<T>(__ddiv_rn(re_of(x), d), __ddiv_rn(im_of(x), d));
}

/* (T)(d * x) for a double d: each part times d in double, rounded once
 * (C's double × T, a real times a complex part by part in GCC). */
template <typename T> __device__ __forceinline__ T mul_by(T x, double d)
{
    return from_parts<T>(__dmul_rn(d, re_of(x)), __dmul_rn(d, im_of(x)));
}

/* x·r for a real r of T's real type, each part by itself in that type:
 * C's T × RT. */
__device__ __forceinline__ float mul_re(float x, float r) { return e_mul(x, r); }
__device__ __forceinline__ double mul_re(double x, double r) { return e_mul(x, r); }
__device__ __forceinline__ cf mul_re(cf x, float r) { return {e_mul(x.re, r), e_mul(x.im, r)}; }
__device__ __forceinline__ cd mul_re(cd x, double r) { return {e_mul(x.re, r), e_mul(x.im, r)}; }

/* x += r for a real r: the real part alone, in T's real type. */
__device__ __forceinline__ float add_re(float x, float r) { return e_add(x, r); }
__device__ __forceinline__ double add_re(double x, double r) { return e_add(x, r); }
__device__ __forceinline__ cf add_re(cf x, float r) { return {e_add(x.re, r), x.im}; }
__device__ __forceinline__ cd add_re(cd x, double r) { return {e_add(x.re, r), x.im}; }

/* x / r for a real r of T's real type, each part by itself: C's T /= RT
 * (GCC divides a complex by a real part by part), a true quotient in T's
 * real type (never a product by 1/r). */
__device__ __forceinline__ float div_re(float x, float r) { return __fdiv_rn(x, r); }
__device__ __forceinline__ double div_re(double x, double r) { return __ddiv_rn(x, r); }
__device__ __forceinline__ cf div_re(cf x, float r) { return {__fdiv_rn(x.re, r), __fdiv_rn(x.im, r)}; }
__device__ __forceinline__ cd div_re(cd x, double r) { return {__ddiv_rn(x.re, r), __ddiv_rn(x.im, r)}; }

/* How two partial results join.  The maxima start at 0 and take a value
 * only when it is larger, so a NaN never enters (the CPU's comparisons
 * and fmax drop NaNs the same way). */
struct j_max { /* both halves the larger */
    __device__ static cd join(cd a, cd b) { return {b.re > a.re ? b.re : a.re, b.im > a.im ? b.im : a.im}; }
};
struct j_flag_max { /* re: NaN (a non-finite entry was seen) wins, else the larger; im the larger */
    __device__ static cd join(cd a, cd b)
    {
        return {isnan(a.re) ? a.re : isnan(b.re) ? b.re : b.re > a.re ? b.re : a.re, b.im > a.im ? b.im : a.im};
    }
};
struct j_sum_max { /* re summed, im the larger */
    __device__ static cd join(cd a, cd b) { return {__dadd_rn(a.re, b.re), b.im > a.im ? b.im : a.im}; }
};

/* The block's threads' v joined in a fixed tree into *dst; all threads
 * call it, once a kernel. */
template <typename J> __device__ __forceinline__ void fz_block_join(cd v, cd *dst)
{
    __shared__ cd sh[THREADS];
    sh[threadIdx.x] = v;
    for (unsigned w = THREADS / 2; w > 0; w /= 2) {
        __syncthreads();
        if (threadIdx.x < w)
            sh[threadIdx.x] = J::join(sh[threadIdx.x], sh[threadIdx.x + w]);
    }
    if (threadIdx.x == 0)
        *dst = sh[0];
}

/* One block: the FZ_BLOCKS partials into part[FZ_BLOCKS]. */
template <typename J> __global__ void __launch_bounds__(THREADS) k_fz_final(cd *part)
{
    cd v = {0, 0};
    for (unsigned i = threadIdx.x; i < FZ_BLOCKS; i += THREADS)
        v = J::join(v, part[i]);
    fz_block_join<J>(v, part + FZ_BLOCKS);
}

/* Element idx of the m×n x (leading dimension ld), column-major order. */
template <typename T> __device__ __forceinline__ T *fz_at(T *x, size_t idx, size_t m, size_t ld, size_t *i, size_t *j)
{
    unsigned long long q, r = divmod(idx, m, &q);
    *i = (size_t)r;
    *j = (size_t)q;
    return x + *j * ld + *i;
}

/* AMAX: {max re² + im² (NaN once an entry is not finite), max of the
 * largest |part| of each entry}; scaled: the squares of the entries times
 * 2^-e (all finite then). */
template <typename T>
__global__ void __launch_bounds__(THREADS) k_fz_amax(const T *x, size_t m, size_t n, size_t ld, int e, bool scaled,
                                                     cd *part)
{
    double big = 0, top = 0;
    bool bad = false;
    GRID_STRIDE(idx, m * n)
    {
        size_t i, j;
        T v = *fz_at(x, idx, m, ld, &i, &j);
        double re = re_of(v), im = im_of(v);
        if (scaled) {
            re = ldexp(re, -e);
            im = ldexp(im, -e);
        } else {
            double t = fmax(fabs(re), fabs(im));
            top = t > top ? t : top;
            bad = bad || !isfinite(re) || !isfinite(im); /* the CPU's (re - re) + (im - im) != 0 */
        }
        double a = sq(re, im);
        big = a > big ? a : big;
    }
    fz_block_join<j_flag_max>({bad ? (double)NAN : big, top}, part + blockIdx.x);
}

/* NORM: {Σ re² + im² (times 2^-e each part when scaled), max |part|}. */
template <typename T>
__global__ void __launch_bounds__(THREADS) k_fz_norm(const T *x, size_t m, size_t n, size_t ld, int e, bool scaled,
                                                     cd *part)
{
    double s = 0, top = 0;
    GRID_STRIDE(idx, m * n)
    {
        size_t i, j;
        T v = *fz_at(x, idx, m, ld, &i, &j);
        double re = re_of(v), im = im_of(v);
        if (scaled) {
            re = ldexp(re, -e);
            im = ldexp(im, -e);
        } else
            top = fmax(top, fmax(fabs(re), fabs(im)));
        s = __dadd_rn(s, sq(re, im));
    }
    fz_block_join<j_sum_max>({s, top}, part + blockIdx.x);
}

/* HERM_GAP over i <= j of d = x_ij - conj(x_ji) (in T): {max |d|²,
 * max of the largest |part| of d}, or with hyp {max hypot(d), 0}. */
template <typename T>
__global__ void __launch_bounds__(THREADS) k_fz_herm_gap(const T *x, size_t n, size_t ld, bool hyp, cd *part)
{
    double worst = 0, top = 0;
    GRID_STRIDE(idx, n * n)
    {
        size_t i, j;
        const T *p = fz_at(x, idx, n, ld, &i, &j);
        if (i > j)
            continue;
        T d = e_sub(*p, e_conj(x[i * ld + j]));
        double re = re_of(d), im = im_of(d);
        if (hyp)
            worst = fmax(worst, hypot(re, im));
        else {
            double a = sq(re, im), t = fmax(fabs(re), fabs(im));
            worst = a > worst ? a : worst;
            top = t > top ? t : top;
        }
    }
    fz_block_join<j_max>({worst, top}, part + blockIdx.x);
}

/* HERMITIZE: the diagonal to its real part, x_ij = (x_ij + conj(x_ji))/2
 * for i > j; the upper triangle, only read, stays. */
template <typename T> __global__ void k_fz_hermitize(T *x, size_t n, size_t ld)
{
    GRID_STRIDE(idx, n * n)
    {
        size_t i, j;
        T *p = fz_at(x, idx, n, ld, &i, &j);
        if (i < j)
            continue;
        *p = i == j ? from_parts<T>(re_of(*p), 0) : half_of(e_add(*p, e_conj(x[i * ld + j])));
    }
}

/* ANTIHERM: one thread a pair i <= j, both read before either is written
 * (the diagonal: the second write, as on the CPU). */
template <typename T> __global__ void k_fz_antiherm(T *x, size_t n, size_t ld)
{
    GRID_STRIDE(idx, n * n)
    {
        size_t i, j;
        T *pij = fz_at(x, idx, n, ld, &i, &j);
        if (i > j)
            continue;
        T *pji = x + i * ld + j;
        T a = *pij, b = *pji;
        *pij = half_of(e_sub(a, e_conj(b)));
        *pji = half_of(e_sub(b, e_conj(a)));
    }
}

/* PHASES: one block a column.  Each thread keeps the first index of its
 * largest re² + im² (strictly larger replaces, so a NaN never does), the
 * tree keeps the larger, the smaller index on a tie: the CPU's first
 * index of the largest.  A thread with no entry offers -1 at its own
 * index, which thread 0 (index 0, at least -1) beats.  ph (the fz's v,
 * when not NULL): ph_j = conj(p) of the rounded p, as the CPU's ph[j]
 * (1 - 0i for a zero column in the complex dtypes, bit for bit). */
template <typename T>
__global__ void __launch_bounds__(THREADS) k_fz_phases(T *x, size_t m, size_t n, size_t ld, T *ph)
{
    __shared__ double sb[THREADS];
    __shared__ size_t si[THREADS];
    for (size_t j = blockIdx.x; j < n; j += gridDim.x) { /* the same trip count in the whole block */
        T *col = x + j * ld;
        double big = -1;
        size_t best = threadIdx.x;
        for (size_t i = threadIdx.x; i < m; i += THREADS) {
            double a = sq(col[i]);
            if (a > big) {
                big = a;
                best = i;
            }
        }
        sb[threadIdx.x] = big;
        si[threadIdx.x] = best;
        for (unsigned w = THREADS / 2; w > 0; w /= 2) {
            __syncthreads();
            if (threadIdx.x < w) {
                double ob = sb[threadIdx.x + w];
                size_t oi = si[threadIdx.x + w];
                if (ob > sb[threadIdx.x] || (ob == sb[threadIdx.x] && oi < si[threadIdx.x])) {
                    sb[threadIdx.x] = ob;
                    si[threadIdx.x] = oi;
                }
            }
        }
        __syncthreads();
        best = si[0];
        double r = sqrt(sb[0]); /* correctly rounded, as the host's; NaN for -1 */
        T p = from_parts<T>(1, 0);
        if (r > 0)
            p = div_by(e_conj(col[best]), r);
        if (ph && threadIdx.x == 0)
            ph[j] = e_conj(p);
        __syncthreads(); /* col[best], sb and si read by all before anything is written */
        for (size_t i = threadIdx.x; i < m; i += THREADS) {
            T v = e_mul(col[i], p);
            col[i] = i == best ? from_parts<T>(abs_of(v), 0) : v; /* exactly real */
        }
    }
}

/* EIGH_F: with w, x_ij = x_ij/(w_j - w_i), or 0 (its modulus into the
 * maximum) where i = j or |w_j - w_i| < deg; then x_ii += v_i.  Without
 * w only the diagonal's v_i. */
template <typename T>
__global__ void __launch_bounds__(THREADS) k_fz_eigh_f(T *x, size_t n, size_t ld, const real_t<T> *w,
                                                       const real_t<T> *v, double deg, cd *part)
{
    double g = 0;
    if (w) {
        GRID_STRIDE(idx, n * n)
        {
            size_t i, j;
            T *p = fz_at(x, idx, n, ld, &i, &j);
            double gap = __dsub_rn((double)w[j], (double)w[i]);
            T val = *p;
            if (fabs(gap) < deg || i == j) {
                g = fmax(g, abs_of(val));
                val = T();
            } else
                val = div_by(val, gap);
            if (v && i == j)
                val = add_re(val, v[i]);
            *p = val;
        }
    } else if (v) {
        GRID_STRIDE(i, n)
        {
            x[i * ld + i] = add_re(x[i * ld + i], v[i]);
        }
    }
    fz_block_join<j_max>({g, 0}, part + blockIdx.x);
}

/* ROWS_MUL: x_ij = x_ij·v_i, the CPU's x *= v (textbook product). */
template <typename T> __global__ void k_fz_rows_mul(T *x, size_t m, size_t n, size_t ld, const T *v)
{
    GRID_STRIDE(idx, m * n)
    {
        size_t i, j;
        T *p = fz_at(x, idx, m, ld, &i, &j);
        *p = e_mul(*p, v[i]);
    }
}

/* COLS_DIV (cols) and ROWS_DIV: x_ij = x_ij/w_j or x_ij/w_i. */
template <typename T>
__global__ void k_fz_div(T *x, size_t m, size_t n, size_t ld, const real_t<T> *w, bool cols)
{
    GRID_STRIDE(idx, m * n)
    {
        size_t i, j;
        T *p = fz_at(x, idx, m, ld, &i, &j);
        *p = div_re(*p, w[cols ? j : i]);
    }
}

/* ROWS_SQRT_MUL: x_ij = (T)(sqrt(w_i)·x_ij), the root (correctly rounded,
 * as glibc's) and the product in double, rounded once to T. */
template <typename T> __global__ void k_fz_rows_sqrt_mul(T *x, size_t m, size_t n, size_t ld, const real_t<T> *w)
{
    GRID_STRIDE(idx, m * n)
    {
        size_t i, j;
        T *p = fz_at(x, idx, m, ld, &i, &j);
        *p = mul_by(*p, __dsqrt_rn((double)w[i]));
    }
}

/* COLS_MUL: x_ij = x_ij·w_j in T's precision. */
template <typename T> __global__ void k_fz_cols_mul(T *x, size_t m, size_t n, size_t ld, const real_t<T> *w)
{
    GRID_STRIDE(idx, m * n)
    {
        size_t i, j;
        T *p = fz_at(x, idx, m, ld, &i, &j);
        *p = mul_re(*p, w[j]);
    }
}

/* MIRROR_LOWER: one thread a lower entry i > j, which it reads and
 * conjugates into x_ji; the diagonal to its real part.  The lower
 * triangle is only read, so no entry is both read and written. */
template <typename T> __global__ void k_fz_mirror_lower(T *x, size_t n, size_t ld)
{
    GRID_STRIDE(idx, n * n)
    {
        size_t i, j;
        T *p = fz_at(x, idx, n, ld, &i, &j);
        if (i < j)
            continue;
        if (i == j)
            *p = from_parts<T>(re_of(*p), 0);
        else
            x[i * ld + j] = e_conj(*p);
    }
}

/* POLAR_F: s = w_i + w_j in double; x_ij = (T)(x_ij/s) (the quotient in
 * double) where |s| >= tol, else +0. */
template <typename T> __global__ void k_fz_polar_f(T *x, size_t n, size_t ld, const real_t<T> *w, double tol)
{
    GRID_STRIDE(idx, n * n)
    {
        size_t i, j;
        T *p = fz_at(x, idx, n, ld, &i, &j);
        double s = __dadd_rn((double)w[i], (double)w[j]);
        *p = fabs(s) >= tol ? div_by(*p, s) : T();
    }
}

/* COLS_PINV: x_ij = x_ij/w_j in T's precision where |w_j| >= tol, else
 * +0. */
template <typename T>
__global__ void k_fz_cols_pinv(T *x, size_t m, size_t n, size_t ld, const real_t<T> *w, double tol)
{
    GRID_STRIDE(idx, m * n)
    {
        size_t i, j;
        T *p = fz_at(x, idx, m, ld, &i, &j);
        real_t<T> r = w[j];
        *p = fabs((double)r) >= tol ? div_re(*p, r) : T();
    }
}

/* SVD_F, the CPU's svd_f_host element by element (each element reads its
 * own x_ij and y_ij only, so x is written in place): with a = x_ij,
 * b = y_ij, v = 0 + (T)((a + b)/dm) unless |dm| < deg (|a + b| into the
 * maximum instead), + (T)((a - b)/dp) when |dp| >= deg, quotients in
 * double; v starts at +0 as the CPU's, so a -0 term gives +0.  Then
 * x_ii += dS_i when dS is not NULL. */
template <typename T>
__global__ void __launch_bounds__(THREADS) k_fz_svd_f(T *x, const T *y, size_t n, size_t ld, const real_t<T> *s,
                                                      const real_t<T> *ds, double deg, cd *part)
{
    double g = 0;
    GRID_STRIDE(idx, n * n)
    {
        size_t i, j;
        T *p = fz_at(x, idx, n, ld, &i, &j);
        T a = *p, b = y[j * ld + i], val = T();
        double dm = __dsub_rn((double)s[j], (double)s[i]), dp = __dadd_rn((double)s[j], (double)s[i]);
        if (fabs(dm) < deg)
            g = fmax(g, abs_of(e_add(a, b)));
        else
            val = e_add(val, div_by(e_add(a, b), dm));
        if (fabs(dp) >= deg)
            val = e_add(val, div_by(e_sub(a, b), dp));
        if (ds && i == j)
            val = add_re(val, ds[i]);
        *p = val;
    }
    fz_block_join<j_max>({g, 0}, part + blockIdx.x);
}

/* ---- the backend ---- */

int real_count(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        set_err("cudaGetDeviceCount", cudaGetErrorName(e), cudaGetErrorString(e));
        (void)cudaGetLastError();
        n = 0;
    }
    if (n > PB_GPU_MAX_DEVICES)
        n = PB_GPU_MAX_DEVICES;
    if (n < 0)
        n = 0;
    g_count.store(n);
    return n;
}

int real_info(int dev, pb_gpu_info_t *out)
{
    if (!valid_dev(dev))
        return internal("info", "no such device");
    if (g_dev[dev].failed.load())
        return unavailable(dev);
    cudaDeviceProp prop;
    CK(dev, cudaGetDeviceProperties(&prop, dev));
    size_t len = strnlen(prop.name, sizeof prop.name);
    if (len >= sizeof out->name)
        len = sizeof out->name - 1;
    memcpy(out->name, prop.name, len);
    out->name[len] = 0;
    out->total_bytes = prop.totalGlobalMem;
    return 0;
}

/* Destroy what the worker state holds (a partial one too). */
void worker_release(worker_state &w)
{
    if (w.blas)
        (void)cublasDestroy(w.blas);
    if (w.solver_params)
        (void)cusolverDnDestroyParams(w.solver_params);
    if (w.solver)
        (void)cusolverDnDestroy(w.solver);
    if (w.workspace)
        (void)cudaFreeAsync(w.workspace, w.stream);
    if (w.dot_scratch)
        (void)cudaFreeAsync(w.dot_scratch, w.stream);
    if (w.stream) {
        (void)cudaStreamSynchronize(w.stream);
        (void)cudaStreamDestroy(w.stream);
    }
    for (cudaEvent_t ev : w.ev)
        if (ev)
            (void)cudaEventDestroy(ev);
    if (w.staging)
        (void)cudaFreeHost(w.staging);
    (void)cudaGetLastError();
    memset(&w, 0, sizeof w);
}

int worker_make(int dev, worker_state &w)
{
    int least = 0, greatest = 0;
    CK(dev, cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CK(dev, cudaStreamCreateWithPriority(&w.stream, cudaStreamNonBlocking, least));
    for (cudaEvent_t &ev : w.ev)
        CK(dev, cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync));
    CK(dev, cudaMallocHost((void **)&w.staging, STAGING_BYTES));
    CK(dev, cudaMallocFromPoolAsync(&w.workspace, WORKSPACE_BYTES, g_dev[dev].pool, w.stream));
    CK(dev, cudaMallocFromPoolAsync(&w.dot_scratch, DOT_SCRATCH, g_dev[dev].pool, w.stream));
    CK(dev, cudaStreamSynchronize(w.stream));
    BK(dev, cublasCreate(&w.blas));
    /* cublasSetStream resets the workspace: stream first. */
    BK(dev, cublasSetStream(w.blas, w.stream));
    BK(dev, cublasSetWorkspace(w.blas, w.workspace, WORKSPACE_BYTES));
    BK(dev, cublasSetMathMode(w.blas, CUBLAS_PEDANTIC_MATH));
    BK(dev, cublasSetPointerMode(w.blas, CUBLAS_POINTER_MODE_HOST));
    /* cuSOLVER: the same stream; deterministic results (CUDA.md); its
     * default math stated, so no FP32 emulation through BF16x9 */
    SK(dev, cusolverDnCreate(&w.solver));
    SK(dev, cusolverDnSetStream(w.solver, w.stream));
    SK(dev, cusolverDnSetDeterministicMode(w.solver, CUSOLVER_DETERMINISTIC_RESULTS));
    SK(dev, cusolverDnSetMathMode(w.solver, CUSOLVER_DEFAULT_MATH));
    SK(dev, cusolverDnCreateParams(&w.solver_params));
    return 0;
}

int real_thread_init(int dev)
{
    if (!valid_dev(dev))
        return internal("thread_init", "no such device");
    if (t_w.bound)
        return t_w.dev == dev ? 0 : internal("thread_init", "thread already bound to another device");
    if (g_dev[dev].failed.load())
        return unavailable(dev);
    int rc = dev_ensure(dev);
    if (rc)
        return rc;
    CK(dev, cudaSetDevice(dev));
    worker_state w;
    memset(&w, 0, sizeof w);
    rc = worker_make(dev, w);
    if (rc) {
        if (!g_dev[dev].failed.load())
            worker_release(w);
        return rc;
    }
    w.bound = true;
    w.dev = dev;
    t_w = w;
    return 0;
}

void real_thread_fini(void)
{
    if (!t_w.bound)
        return;
    if (g_dev[t_w.dev].failed.load())
        memset(&t_w, 0, sizeof t_w); /* leak: see the top */
    else
        worker_release(t_w);
}

/* Record p's size; false when the table cannot grow. */
bool record(dev_state &d, void *p, size_t bytes)
{
    try {
        d.sizes->emplace(p, bytes);
    } catch (...) {
        return false;
    }
    d.used.fetch_add(bytes);
    return true;
}

int pool_alloc(int dev, dev_state &d, size_t bytes, void **q, cudaStream_t s)
{
    cudaError_t e = cudaMallocFromPoolAsync(q, bytes, d.pool, s);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        CK(dev, cudaMemPoolTrimTo(d.pool, 0));
        e = cudaMallocFromPoolAsync(q, bytes, d.pool, s);
    }
    return e == cudaSuccess ? 0 : cuda_fail(dev, e, "cudaMallocFromPoolAsync");
}

int real_alloc(int dev, size_t bytes, void **p)
{
    if (!valid_dev(dev))
        return internal("alloc", "no such device");
    dev_state &d = g_dev[dev];
    if (d.failed.load())
        return unavailable(dev);
    if (bytes == 0) {
        *p = nullptr;
        return 0;
    }
    int rc = dev_ensure(dev);
    if (rc)
        return rc;
    void *q = nullptr;
    if (t_w.bound && t_w.dev == dev) {
        rc = pool_alloc(dev, d, bytes, &q, t_w.stream);
        if (rc)
            return rc;
        std::lock_guard<std::mutex> lock(d.mu);
        if (!record(d, q, bytes)) {
            (void)cudaFreeAsync(q, t_w.stream);
            return internal("alloc", "out of host memory for the allocation table");
        }
    } else {
        std::lock_guard<std::mutex> lock(d.mu);
        int restore;
        rc = enter_dev(dev, &restore);
        if (rc)
            return rc;
        rc = pool_alloc(dev, d, bytes, &q, d.free_stream);
        if (rc == 0) {
            /* ready for any stream */
            cudaError_t e = cudaStreamSynchronize(d.free_stream);
            if (e != cudaSuccess)
                rc = cuda_fail(dev, e, "cudaStreamSynchronize(free stream)");
            else if (!record(d, q, bytes)) {
                (void)cudaFreeAsync(q, d.free_stream);
                rc = internal("alloc", "out of host memory for the allocation table");
            }
        }
        leave_dev(restore);
        if (rc)
            return rc;
    }
    *p = q;
    return 0;
}

void real_free(int dev, void *p)
{
    if (p == nullptr || !valid_dev(dev))
        return;
    dev_state &d = g_dev[dev];
    if (!d.ready.load(std::memory_order_acquire))
        return; /* nothing was ever allocated there */
    std::unique_lock<std::mutex> lock(d.mu);
    auto it = d.sizes->find(p);
    if (it == d.sizes->end()) {
        internal("free", "not a live allocation of this device: ignored");
        return;
    }
    d.used.fetch_sub(it->second);
    d.sizes->erase(it);
    if (d.failed.load())
        return; /* leak: see the top */
    if (t_w.bound && t_w.dev == dev) {
        lock.unlock();
        cudaError_t e = cudaFreeAsync(p, t_w.stream);
        if (e != cudaSuccess)
            (void)cuda_fail(dev, e, "cudaFreeAsync");
        return;
    }
    int restore;
    if (enter_dev(dev, &restore))
        return;
    cudaError_t e = cudaFreeAsync(p, d.free_stream);
    if (e != cudaSuccess)
        (void)cuda_fail(dev, e, "cudaFreeAsync(free stream)");
    leave_dev(restore);
}

size_t real_used(int dev)
{
    return valid_dev(dev) ? g_dev[dev].used.load() : 0;
}

void real_set_failed(int dev)
{
    if (valid_dev(dev))
        g_dev[dev].failed.store(true);
}

int real_failed(int dev)
{
    return valid_dev(dev) ? (int)g_dev[dev].failed.load() : 1;
}

/* ---- imports: a client's exported device memory (see the top) ---- */

/* The driver functions, each typed as the ABI of the version asked for. */
struct drv_api {
    PFN_cuGetErrorName_v6000 get_error_name;
    PFN_cuGetErrorString_v6000 get_error_string;
    PFN_cuDeviceGet_v2000 device_get;
    PFN_cuDeviceGetAttribute_v2000 device_get_attribute;
    PFN_cuDeviceGetUuid_v11040 device_get_uuid; /* cuDeviceGetUuid_v2 */
    PFN_cuMemImportFromShareableHandle_v10020 mem_import;
    PFN_cuMemGetAllocationPropertiesFromHandle_v10020 mem_get_properties;
    PFN_cuMemGetAllocationGranularity_v10020 mem_get_granularity;
    PFN_cuMemAddressReserve_v10020 mem_address_reserve;
    PFN_cuMemAddressFree_v10020 mem_address_free;
    PFN_cuMemMap_v10020 mem_map;
    PFN_cuMemUnmap_v10020 mem_unmap;
    PFN_cuMemSetAccess_v10020 mem_set_access;
    PFN_cuMemRelease_v10020 mem_release;
};

drv_api g_drv;
bool g_drv_ok = false;
char g_drv_err[160];
std::once_flag g_drv_once;

template <typename F>
bool drv_get(const char *sym, unsigned version, F *fn)
{
    void *q = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e = cudaGetDriverEntryPointByVersion(sym, &q, version, cudaEnableDefault, &found);
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || !q) {
        snprintf(g_drv_err, sizeof g_drv_err, "the CUDA driver has no %s (ABI of CUDA %u.%u): %s", sym,
                 version / 1000, version % 1000 / 10,
                 e != cudaSuccess ? cudaGetErrorString(e)
                 : found == cudaDriverEntryPointVersionNotSufficent ? "driver too old"
                                                                    : "symbol not found");
        (void)cudaGetLastError();
        return false;
    }
    *fn = reinterpret_cast<F>(q);
    return true;
}

void drv_resolve(void)
{
    drv_api a;
    memset(&a, 0, sizeof a);
    g_drv_ok = drv_get("cuGetErrorName", 6000, &a.get_error_name) &&
               drv_get("cuGetErrorString", 6000, &a.get_error_string) &&
               drv_get("cuDeviceGet", 2000, &a.device_get) &&
               drv_get("cuDeviceGetAttribute", 2000, &a.device_get_attribute) &&
               drv_get("cuDeviceGetUuid", 11040, &a.device_get_uuid) &&
               drv_get("cuMemImportFromShareableHandle", 10020, &a.mem_import) &&
               drv_get("cuMemGetAllocationPropertiesFromHandle", 10020, &a.mem_get_properties) &&
               drv_get("cuMemGetAllocationGranularity", 10020, &a.mem_get_granularity) &&
               drv_get("cuMemAddressReserve", 10020, &a.mem_address_reserve) &&
               drv_get("cuMemAddressFree", 10020, &a.mem_address_free) &&
               drv_get("cuMemMap", 10020, &a.mem_map) && drv_get("cuMemUnmap", 10020, &a.mem_unmap) &&
               drv_get("cuMemSetAccess", 10020, &a.mem_set_access) &&
               drv_get("cuMemRelease", 10020, &a.mem_release);
    if (g_drv_ok)
        g_drv = a;
}

/* The driver functions, or NULL (g_drv_err says why), resolved once. */
const drv_api *drv(void)
{
    std::call_once(g_drv_once, drv_resolve);
    return g_drv_ok ? &g_drv : nullptr;
}

/* Driver errors after which the context (or the device) cannot be used
 * again: poisons()'s list in the driver's words. */
bool drv_poisons(CUresult r)
{
    switch (r) {
    case CUDA_ERROR_ILLEGAL_ADDRESS:
    case CUDA_ERROR_LAUNCH_FAILED:
    case CUDA_ERROR_ILLEGAL_INSTRUCTION:
    case CUDA_ERROR_MISALIGNED_ADDRESS:
    case CUDA_ERROR_HARDWARE_STACK_ERROR:
    case CUDA_ERROR_ASSERT:
    case CUDA_ERROR_ECC_UNCORRECTABLE:
    case CUDA_ERROR_NVLINK_UNCORRECTABLE:
    case CUDA_ERROR_INVALID_ADDRESS_SPACE:
    case CUDA_ERROR_INVALID_PC:
    case CUDA_ERROR_LAUNCH_TIMEOUT:
    case CUDA_ERROR_CONTAINED:
    case CUDA_ERROR_CONTEXT_IS_DESTROYED:
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_DEVICE_UNAVAILABLE:
    case CUDA_ERROR_DEINITIALIZED:
        return true;
    default:
        return false;
    }
}

/* A failed driver call on dev: its words into t_err and "NAME (text)"
 * into buf; PB_EDEVICE_UNAVAILABLE (dev marked failed) for a sticky
 * error, PB_ERESOURCE_EXHAUSTED for out of memory, else `other`. */
int drv_fail(const drv_api &a, int dev, CUresult r, const char *what, int other, char *buf, size_t len)
{
    const char *name = nullptr, *text = nullptr;
    if (a.get_error_name(r, &name) != CUDA_SUCCESS || !name)
        name = "CUDA_ERROR_UNKNOWN";
    if (a.get_error_string(r, &text) != CUDA_SUCCESS || !text)
        text = "unknown driver error";
    set_err(what, name, text);
    if (buf && len)
        snprintf(buf, len, "%s (%s)", name, text);
    if (drv_poisons(r)) {
        g_dev[dev].failed.store(true);
        return PB_EDEVICE_UNAVAILABLE;
    }
    return r == CUDA_ERROR_OUT_OF_MEMORY ? PB_ERESOURCE_EXHAUSTED : other;
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi writes it. */
void uuid_text(const CUuuid &u, char out[48])
{
    const unsigned char *b = (const unsigned char *)u.bytes;
    snprintf(out, 48, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* The steps of one import, after dev is current; fills *ptr and *mapped.
 * On failure it undoes its own steps and says why. */
int import_steps(const drv_api &a, int dev, int fd, size_t size, CUdeviceptr *ptr, size_t *mapped, char *why,
                 size_t len)
{
    char drv_why[160];
    CUdevice cudev = 0;
    CUresult r = a.device_get(&cudev, dev);
    if (r != CUDA_SUCCESS) {
        int rc = drv_fail(a, dev, r, "cuDeviceGet", PB_EINTERNAL, drv_why, sizeof drv_why);
        snprintf(why, len, "cuDeviceGet: %s", drv_why);
        return rc;
    }
    int fd_ok = 0;
    r = a.device_get_attribute(&fd_ok, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, cudev);
    if (r != CUDA_SUCCESS) {
        int rc = drv_fail(a, dev, r, "cuDeviceGetAttribute", PB_EINTERNAL, drv_why, sizeof drv_why);
        snprintf(why, len, "cuDeviceGetAttribute: %s", drv_why);
        return rc;
    }
    if (!fd_ok) {
        snprintf(why, len, "the device does not support POSIX file descriptor memory handles "
                           "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)");
        return PB_EINVALID_ARGUMENT;
    }
    CUmemGenericAllocationHandle h = 0;
    r = a.mem_import(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) {
        int rc = drv_fail(a, dev, r, "cuMemImportFromShareableHandle", PB_EINVALID_ARGUMENT, drv_why,
                          sizeof drv_why);
        if (rc == PB_EINVALID_ARGUMENT)
            snprintf(why, len,
                     "the file descriptor is not a CUDA memory export (cuMemExportToShareableHandle, POSIX file "
                     "descriptor handle): %s",
                     drv_why);
        else
            snprintf(why, len, "cuMemImportFromShareableHandle: %s", drv_why);
        return rc;
    }
    /* From here on the handle is ours: released on every path. */
    int rc = 0;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    size_t gran = 0, rounded = 0;
    CUdeviceptr base = 0;
    bool reserved = false, mapped_ok = false;
    if ((r = a.mem_get_properties(&prop, h)) != CUDA_SUCCESS) {
        rc = drv_fail(a, dev, r, "cuMemGetAllocationPropertiesFromHandle", PB_EINTERNAL, drv_why, sizeof drv_why);
        snprintf(why, len, "cuMemGetAllocationPropertiesFromHandle: %s", drv_why);
        goto out;
    }
    if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
        snprintf(why, len, "the memory is not device memory (location type %d), not on cuda:%d",
                 (int)prop.location.type, dev);
        rc = PB_EINVALID_ARGUMENT;
        goto out;
    }
    {
        /* Same device by UUID: ordinals differ between processes. */
        CUuuid mine, theirs;
        CUdevice owner = 0;
        char mine_s[48], theirs_s[48];
        if ((r = a.device_get_uuid(&mine, cudev)) != CUDA_SUCCESS) {
            rc = drv_fail(a, dev, r, "cuDeviceGetUuid", PB_EINTERNAL, drv_why, sizeof drv_why);
            snprintf(why, len, "cuDeviceGetUuid: %s", drv_why);
            goto out;
        }
        uuid_text(mine, mine_s);
        if (a.device_get(&owner, prop.location.id) != CUDA_SUCCESS ||
            a.device_get_uuid(&theirs, owner) != CUDA_SUCCESS) {
            snprintf(why, len, "the memory lives on a device the daemon does not see (its device %d here), not "
                               "on cuda:%d (%s)",
                     prop.location.id, dev, mine_s);
            rc = PB_EINVALID_ARGUMENT;
            goto out;
        }
        if (memcmp(mine.bytes, theirs.bytes, sizeof mine.bytes) != 0) {
            uuid_text(theirs, theirs_s);
            snprintf(why, len, "the memory lives on %s (cuda:%d in the daemon), not on cuda:%d (%s)", theirs_s,
                     prop.location.id, dev, mine_s);
            rc = PB_EINVALID_ARGUMENT;
            goto out;
        }
    }
    if ((r = a.mem_get_granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) != CUDA_SUCCESS || gran == 0) {
        if (r == CUDA_SUCCESS)
            r = CUDA_ERROR_UNKNOWN;
        rc = drv_fail(a, dev, r, "cuMemGetAllocationGranularity", PB_EINTERNAL, drv_why, sizeof drv_why);
        snprintf(why, len, "cuMemGetAllocationGranularity: %s", drv_why);
        goto out;
    }
    if (size > SIZE_MAX - (gran - 1)) {
        snprintf(why, len, "size %zu is more than the exported allocation", size);
        rc = PB_EINVALID_ARGUMENT;
        goto out;
    }
    rounded = (size + gran - 1) / gran * gran;
    if ((r = a.mem_address_reserve(&base, rounded, gran, 0, 0)) != CUDA_SUCCESS) {
        rc = drv_fail(a, dev, r, "cuMemAddressReserve", PB_ERESOURCE_EXHAUSTED, drv_why, sizeof drv_why);
        snprintf(why, len, "cannot reserve %zu bytes of device address space: %s", rounded, drv_why);
        goto out;
    }
    reserved = true;
    if ((r = a.mem_map(base, rounded, 0, h, 0)) != CUDA_SUCCESS) {
        rc = drv_fail(a, dev, r, "cuMemMap", PB_EINVALID_ARGUMENT, drv_why, sizeof drv_why);
        if (rc == PB_EINVALID_ARGUMENT)
            snprintf(why, len, "size %zu is more than the exported allocation (cuMemMap of %zu bytes: %s)", size,
                     rounded, drv_why);
        else
            snprintf(why, len, "cuMemMap of %zu bytes: %s", rounded, drv_why);
        goto out;
    }
    mapped_ok = true;
    {
        CUmemAccessDesc acc;
        memset(&acc, 0, sizeof acc);
        acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        acc.location.id = cudev;
        acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        if ((r = a.mem_set_access(base, rounded, &acc, 1)) != CUDA_SUCCESS) {
            rc = drv_fail(a, dev, r, "cuMemSetAccess", PB_EINTERNAL, drv_why, sizeof drv_why);
            snprintf(why, len, "cuMemSetAccess (read-write for cuda:%d): %s", dev, drv_why);
            goto out;
        }
    }
out:
    /* The mapping, if any, now holds the memory; failures undo it.  On a
     * device that failed just now, cleanup calls fail too: ignored. */
    if (rc && mapped_ok)
        (void)a.mem_unmap(base, rounded);
    if (rc && reserved)
        (void)a.mem_address_free(base, rounded);
    if ((r = a.mem_release(h)) != CUDA_SUCCESS && rc == 0) {
        rc = drv_fail(a, dev, r, "cuMemRelease", PB_EINTERNAL, drv_why, sizeof drv_why);
        snprintf(why, len, "cuMemRelease: %s", drv_why);
        if (rc != PB_EDEVICE_UNAVAILABLE) {
            (void)a.mem_unmap(base, rounded);
            (void)a.mem_address_free(base, rounded);
        }
    }
    if (rc == 0) {
        *ptr = base;
        *mapped = rounded;
    }
    return rc;
}

int real_import_fd(int dev, int fd, size_t size, void **p, char *why, size_t len)
{
    char dummy[8];
    if (!why || len == 0) {
        why = dummy;
        len = sizeof dummy;
    }
    why[0] = 0;
    if (!valid_dev(dev)) {
        snprintf(why, len, "no device %d", dev);
        return internal("import_fd", "no such device");
    }
    dev_state &d = g_dev[dev];
    if (d.failed.load()) {
        snprintf(why, len, "cuda:%d has failed", dev);
        return unavailable(dev);
    }
    if (size == 0) {
        snprintf(why, len, "size 0: nothing to map");
        return PB_EINVALID_ARGUMENT;
    }
    /* The device's context (with its flags) and its import table, before
     * anything else may touch CUDA. */
    int rc = dev_ensure(dev);
    if (rc) {
        snprintf(why, len, "%s", t_err);
        return rc == PB_ENOMEM ? PB_ERESOURCE_EXHAUSTED : rc;
    }
    const drv_api *a = drv();
    if (!a) {
        snprintf(why, len, "cannot import device memory: %s", g_drv_err);
        return internal("import_fd", g_drv_err);
    }
    int restore;
    if ((rc = enter_dev(dev, &restore))) { /* current device is per thread */
        snprintf(why, len, "%s", t_err);
        return rc == PB_ENOMEM ? PB_ERESOURCE_EXHAUSTED : rc;
    }
    CUdeviceptr base = 0;
    size_t mapped = 0;
    rc = import_steps(*a, dev, fd, size, &base, &mapped, why, len);
    if (rc == 0) {
        std::lock_guard<std::mutex> lock(d.mu);
        bool ok = true;
        try {
            d.imports->emplace((void *)(uintptr_t)base, mapped);
        } catch (...) {
            ok = false;
        }
        if (!ok) {
            (void)a->mem_unmap(base, mapped);
            (void)a->mem_address_free(base, mapped);
            snprintf(why, len, "out of host memory for the import table");
            (void)internal("import_fd", "out of host memory for the import table");
            rc = PB_ERESOURCE_EXHAUSTED;
        }
    }
    leave_dev(restore);
    if (rc == 0)
        *p = (void *)(uintptr_t)base;
    return rc;
}

/* Nothing may use the range any more: see the top for why none does. */
void real_unimport(int dev, void *p, size_t size)
{
    if (p == nullptr || !valid_dev(dev))
        return;
    dev_state &d = g_dev[dev];
    if (!d.ready.load(std::memory_order_acquire))
        return; /* nothing was ever imported there */
    std::lock_guard<std::mutex> lock(d.mu);
    auto it = d.imports->find(p);
    if (it == d.imports->end()) {
        internal("unimport", "not a live import of this device: ignored");
        return;
    }
    size_t mapped = it->second;
    d.imports->erase(it);
    if (size > mapped)
        internal("unimport", "size is more than was imported: unmapping what was mapped");
    if (d.failed.load())
        return; /* leak: see the top */
    const drv_api *a = drv(); /* resolved: the import needed it */
    if (!a)
        return;
    int restore;
    if (enter_dev(dev, &restore))
        return;
    CUdeviceptr base = (CUdeviceptr)(uintptr_t)p;
    CUresult r = a->mem_unmap(base, mapped);
    if (r != CUDA_SUCCESS)
        (void)drv_fail(*a, dev, r, "cuMemUnmap", PB_EINTERNAL, nullptr, 0);
    else if ((r = a->mem_address_free(base, mapped)) != CUDA_SUCCESS)
        (void)drv_fail(*a, dev, r, "cuMemAddressFree", PB_EINTERNAL, nullptr, 0);
    leave_dev(restore);
}

int real_h2d(void *dst, const void *src, size_t n)
{
    int rc = worker_check("h2d");
    if (rc || n == 0)
        return rc;
    int dev = t_w.dev;
    for (size_t off = 0, k = 0; off < n; off += STAGING_HALF, k ^= 1) {
        size_t len = n - off < STAGING_HALF ? n - off : STAGING_HALF;
        unsigned char *half = t_w.staging + k * STAGING_HALF;
        CK(dev, cudaEventSynchronize(t_w.ev[k])); /* its last copy has read it */
        memcpy(half, (const unsigned char *)src + off, len);
        CK(dev, cudaMemcpyAsync((unsigned char *)dst + off, half, len, cudaMemcpyHostToDevice, t_w.stream));
        CK(dev, cudaEventRecord(t_w.ev[k], t_w.stream));
    }
    return 0;
}

/* Queue chunk `chunk` of a d2h into its staging half. */
int d2h_issue(const void *src, size_t n, size_t chunk)
{
    size_t off = chunk * STAGING_HALF, len = n - off < STAGING_HALF ? n - off : STAGING_HALF, k = chunk & 1;
    CK(t_w.dev, cudaMemcpyAsync(t_w.staging + k * STAGING_HALF, (const unsigned char *)src + off, len,
                                cudaMemcpyDeviceToHost, t_w.stream));
    CK(t_w.dev, cudaEventRecord(t_w.ev[k], t_w.stream));
    return 0;
}

int real_d2h(void *dst, const void *src, size_t n)
{
    int rc = worker_check("d2h");
    if (rc || n == 0)
        return rc;
    size_t chunks = (n + STAGING_HALF - 1) / STAGING_HALF;
    for (size_t c = 0; c < chunks && c < 2; c++)
        if ((rc = d2h_issue(src, n, c)))
            return rc;
    for (size_t c = 0; c < chunks; c++) {
        size_t off = c * STAGING_HALF, len = n - off < STAGING_HALF ? n - off : STAGING_HALF, k = c & 1;
        CK(t_w.dev, cudaEventSynchronize(t_w.ev[k]));
        memcpy((unsigned char *)dst + off, t_w.staging + k * STAGING_HALF, len);
        if (c + 2 < chunks && (rc = d2h_issue(src, n, c + 2)))
            return rc;
    }
    return 0;
}

int real_zero(void *dst, size_t n)
{
    int rc = worker_check("zero");
    if (rc || n == 0)
        return rc;
    CK(t_w.dev, cudaMemsetAsync(dst, 0, n, t_w.stream));
    return 0;
}

int real_sync(void)
{
    int rc = worker_check("sync");
    if (rc)
        return rc;
    CK(t_w.dev, cudaStreamSynchronize(t_w.stream));
    return 0;
}

bool blas_op(char t, cublasOperation_t *op)
{
    switch (t) {
    case 'N': case 'n': *op = CUBLAS_OP_N; return true;
    case 'T': case 't': *op = CUBLAS_OP_T; return true;
    case 'C': case 'c': *op = CUBLAS_OP_C; return true;
    default: return false;
    }
}

int real_gemm(int dtype, char ta, char tb, int m, int n, int k, const double alpha[2], const void *a, int lda,
              const void *b, int ldb, const double beta[2], void *c, int ldc)
{
    int rc = worker_check("gemm");
    if (rc)
        return rc;
    cublasOperation_t opa, opb;
    if (dtype < 0 || dtype > 3 || !blas_op(ta, &opa) || !blas_op(tb, &opb))
        return internal("gemm", "bad dtype or transpose");
    if (m == 0 || n == 0)
        return 0;
    int dev = t_w.dev;
    bool complex = dtype >= 2;
    if (k == 0) {
        /* C = beta·C, which cuBLAS need not do for k = 0. */
        bool one = beta[0] == 1 && (!complex || beta[1] == 0);
        bool zero = beta[0] == 0 && (!complex || beta[1] == 0);
        if (one)
            return 0;
        if (m < 0 || n < 0 || ldc < m)
            return internal("gemm", "bad sizes");
        switch (dtype) {
        case 0: return launch_scale<float>(c, ldc, m, n, (float)beta[0], zero);
        case 1: return launch_scale<double>(c, ldc, m, n, beta[0], zero);
        case 2: return launch_scale<float2>(c, ldc, m, n, make_float2((float)beta[0], (float)beta[1]), zero);
        default: return launch_scale<double2>(c, ldc, m, n, make_double2(beta[0], beta[1]), zero);
        }
    }
    cublasHandle_t h = t_w.blas;
    switch (dtype) {
    case 0: {
        float al = (float)alpha[0], be = (float)beta[0];
        BK(dev, cublasSgemm_64(h, opa, opb, m, n, k, &al, (const float *)a, lda, (const float *)b, ldb, &be,
                               (float *)c, ldc));
        break;
    }
    case 1:
        BK(dev, cublasDgemm_64(h, opa, opb, m, n, k, &alpha[0], (const double *)a, lda, (const double *)b, ldb,
                               &beta[0], (double *)c, ldc));
        break;
    case 2: {
        cuComplex al = make_cuComplex((float)alpha[0], (float)alpha[1]);
        cuComplex be = make_cuComplex((float)beta[0], (float)beta[1]);
        BK(dev, cublasCgemm_64(h, opa, opb, m, n, k, &al, (const cuComplex *)a, lda, (const cuComplex *)b, ldb,
                               &be, (cuComplex *)c, ldc));
        break;
    }
    default: {
        cuDoubleComplex al = make_cuDoubleComplex(alpha[0], alpha[1]);
        cuDoubleComplex be = make_cuDoubleComplex(beta[0], beta[1]);
        BK(dev, cublasZgemm_64(h, opa, opb, m, n, k, &al, (const cuDoubleComplex *)a, lda,
                               (const cuDoubleComplex *)b, ldb, &be, (cuDoubleComplex *)c, ldc));
        break;
    }
    }
    return 0;
}

int real_bias_act(int dtype, int act, void *y, void *zbuf, const void *b, size_t out, size_t batch, char order)
{
    int rc = worker_check("bias_act");
    if (rc)
        return rc;
    if ((dtype != 0 && dtype != 1) || act < 0 || act >= PB_NACTS || (order != 'C' && order != 'F'))
        return internal("bias_act", "bad dtype, activation or order");
    if (out == 0 || batch == 0)
        return 0;
    return dtype == 0 ? launch_bias_act<float>(act, y, zbuf, b, out, batch, order == 'C')
                      : launch_bias_act<double>(act, y, zbuf, b, out, batch, order == 'C');
}

int real_dz(int dtype, int act, void *dz, const void *yb, const void *s, size_t out, size_t batch, char order)
{
    int rc = worker_check("dz");
    if (rc)
        return rc;
    if ((dtype != 0 && dtype != 1) || act < 0 || act >= PB_NACTS || (order != 'C' && order != 'F'))
        return internal("dz", "bad dtype, activation or order");
    size_t total = out * batch;
    if (total == 0)
        return 0;
    return dtype == 0 ? launch_dz<float>(act, dz, yb, s, total) : launch_dz<double>(act, dz, yb, s, total);
}

int real_row_sum(int dtype, const void *dz, void *db, size_t out, size_t batch, char order)
{
    int rc = worker_check("row_sum");
    if (rc)
        return rc;
    if ((dtype != 0 && dtype != 1) || (order != 'C' && order != 'F'))
        return internal("row_sum", "bad dtype or order");
    if (out == 0)
        return 0;
    unsigned g = blocks_for(out);
    if (dtype == 0)
        k_row_sum<float><<<g, THREADS, 0, t_w.stream>>>((const float *)dz, (float *)db, out, batch, order == 'C');
    else
        k_row_sum<double><<<g, THREADS, 0, t_w.stream>>>((const double *)dz, (double *)db, out, batch, order == 'C');
    return launched("row_sum kernel launch");
}

int real_strided(int dtype, const pb_gpu_loop_t *L, void *dst, const void *src, int conj, const double alpha[2],
                 const void *src2, const double beta[2], int accumulate)
{
    int rc = worker_check("strided");
    if (rc)
        return rc;
    if (dtype < 0 || dtype > 3 || !L || !alpha)
        return internal("strided", "bad dtype, loop or alpha");
    bool complex = dtype >= 2, acc = accumulate != 0, cj = complex && conj;
    if (acc)
        src2 = nullptr;
    if (src2 && !beta)
        return internal("strided", "src2 without beta");
    pb_gpu_loop_t tmp;
    const double *al = alpha;
    bool zero = false;
    if (alpha[0] == 0 && (!complex || alpha[1] == 0) && !acc) {
        /* As the CPU (and BLAS): alpha = 0 does not read src, so its NaNs
         * do not propagate: dst = beta·src2 (as alpha·src2), or zeros. */
        if (src2) {
            tmp = *L;
            for (int k = 0; k < tmp.rank && k < PB_GPU_MAX_RANK; k++)
                tmp.s[1][k] = tmp.s[2][k];
            L = &tmp;
            src = src2;
            al = beta;
            src2 = nullptr;
            cj = false;
        } else {
            zero = true;
        }
    }
    sloop P;
    long long fix[3] = {0, 0, 0};
    rc = plan(L, zero ? 1 : src2 ? 3 : 2, acc, acc ? nullptr : fix, &P, "strided");
    if (rc)
        return rc < 0 ? rc : 0;
    bool one = al[0] == 1 && (!complex || al[1] == 0);
    size_t item = (size_t)4 << (dtype == 0 ? 0 : dtype == 3 ? 2 : 1);
    if (src && !zero)
        src = (const char *)src + fix[1] * (long long)item;
    if (src2)
        src2 = (const char *)src2 + fix[2] * (long long)item;
    switch (dtype) {
    case 0: return launch_strided<float>(P, dst, src, src2, al, beta, cj, one, acc, zero);
    case 1: return launch_strided<double>(P, dst, src, src2, al, beta, cj, one, acc, zero);
    case 2: return launch_strided<cf>(P, dst, src, src2, al, beta, cj, one, acc, zero);
    default: return launch_strided<cd>(P, dst, src, src2, al, beta, cj, one, acc, zero);
    }
}

int real_dot(int dtype, const pb_gpu_loop_t *L, const void *a, int conj, const void *b, double out[2])
{
    int rc = worker_check("dot");
    if (rc)
        return rc;
    if (dtype < 0 || dtype > 3 || !L || !out)
        return internal("dot", "bad dtype, loop or out");
    sloop P;
    rc = plan(L, 2, false, nullptr, &P, "dot");
    if (rc < 0)
        return rc;
    if (rc == 1) { /* empty: 0, once the stream's work is done */
        out[0] = out[1] = 0;
        return real_sync();
    }
    cd *part = (cd *)t_w.dot_scratch;
    bool cj = dtype >= 2 && conj;
    switch (dtype) {
    case 0: rc = launch_dot<float>(P, a, b, cj, part); break;
    case 1: rc = launch_dot<double>(P, a, b, cj, part); break;
    case 2: rc = launch_dot<cf>(P, a, b, cj, part); break;
    default: rc = launch_dot<cd>(P, a, b, cj, part); break;
    }
    if (rc)
        return rc;
    cd r;
    rc = real_d2h(&r, part + DOT_BLOCKS, sizeof r); /* waits for the stream */
    if (rc)
        return rc;
    out[0] = r.re;
    out[1] = r.im;
    return 0;
}

/* The reduction kernel just queued (what: its name), then the final one,
 * and its result into *r: waits for the stream. */
template <typename J> int fz_result(const char *what, cd *r)
{
    int rc = launched(what);
    if (rc)
        return rc;
    cd *part = (cd *)t_w.dot_scratch;
    k_fz_final<J><<<1, THREADS, 0, t_w.stream>>>(part);
    if ((rc = launched("fz final kernel launch")))
        return rc;
    return real_d2h(r, part + FZ_BLOCKS, sizeof *r);
}

/* The kinds, each deciding on its second pass as the CPU's helper does. */
template <typename T> int fz_amax(const pb_gpu_fz_t &k, double out[2])
{
    cd *part = (cd *)t_w.dot_scratch, r;
    k_fz_amax<T><<<FZ_BLOCKS, THREADS, 0, t_w.stream>>>((const T *)k.x, k.m, k.n, k.ld, 0, false, part);
    int rc = fz_result<j_flag_max>("fz amax kernel launch", &r);
    if (rc)
        return rc;
    bool finite = !std::isnan(r.re);
    double big = r.re, top = r.im, a = top;
    if (is_cplx<T> && finite && top != 0) {
        if (big >= DBL_MIN && big <= DBL_MAX)
            a = sqrt(big);
        else {
            int e;
            frexp(top, &e);
            k_fz_amax<T><<<FZ_BLOCKS, THREADS, 0, t_w.stream>>>((const T *)k.x, k.m, k.n, k.ld, e, true, part);
            if ((rc = fz_result<j_flag_max>("fz amax (scaled) kernel launch", &r)))
                return rc;
            a = fmin(ldexp(sqrt(r.re), e), DBL_MAX);
        }
    }
    out[0] = a;
    out[1] = finite ? 1 : 0;
    return 0;
}

template <typename T> int fz_norm(const pb_gpu_fz_t &k, double out[2])
{
    cd *part = (cd *)t_w.dot_scratch, r;
    k_fz_norm<T><<<FZ_BLOCKS, THREADS, 0, t_w.stream>>>((const T *)k.x, k.m, k.n, k.ld, 0, false, part);
    int rc = fz_result<j_sum_max>("fz norm kernel launch", &r);
    if (rc)
        return rc;
    double s = r.re, top = r.im, norm;
    if ((s >= DBL_MIN && s <= DBL_MAX) || top == 0 || !std::isfinite(top) || s != s)
        norm = sqrt(s);
    else {
        int e;
        frexp(top, &e);
        k_fz_norm<T><<<FZ_BLOCKS, THREADS, 0, t_w.stream>>>((const T *)k.x, k.m, k.n, k.ld, e, true, part);
        if ((rc = fz_result<j_sum_max>("fz norm (scaled) kernel launch", &r)))
            return rc;
        norm = ldexp(sqrt(r.re), e);
    }
    out[0] = norm;
    out[1] = 1;
    return 0;
}

template <typename T> int fz_herm_gap(const pb_gpu_fz_t &k, double out[2])
{
    cd *part = (cd *)t_w.dot_scratch, r;
    k_fz_herm_gap<T><<<FZ_BLOCKS, THREADS, 0, t_w.stream>>>((const T *)k.x, k.n, k.ld, false, part);
    int rc = fz_result<j_max>("fz herm_gap kernel launch", &r);
    if (rc)
        return rc;
    double gap;
    if ((r.re >= DBL_MIN && r.re <= DBL_MAX) || r.im == 0)
        gap = sqrt(r.re);
    else {
        k_fz_herm_gap<T><<<FZ_BLOCKS, THREADS, 0, t_w.stream>>>((const T *)k.x, k.n, k.ld, true, part);
        if ((rc = fz_result<j_max>("fz herm_gap (hypot) kernel launch", &r)))
            return rc;
        gap = r.re;
    }
    out[0] = gap;
    out[1] = 1;
    return 0;
}

template <typename T> int fz_eigh_f(const pb_gpu_fz_t &k, double out[2])
{
    cd *part = (cd *)t_w.dot_scratch, r;
    k_fz_eigh_f<T><<<FZ_BLOCKS, THREADS, 0, t_w.stream>>>((T *)k.x, k.n, k.ld, (const real_t<T> *)k.w,
                                                          (const real_t<T> *)k.v, k.param, part);
    int rc = fz_result<j_max>("fz eigh_f kernel launch", &r);
    if (rc)
        return rc;
    out[0] = r.re;
    out[1] = 1;
    return 0;
}

template <typename T> int fz_svd_f(const pb_gpu_fz_t &k, double out[2])
{
    cd *part = (cd *)t_w.dot_scratch, r;
    k_fz_svd_f<T><<<FZ_BLOCKS, THREADS, 0, t_w.stream>>>((T *)k.x, (const T *)k.y, k.n, k.ld,
                                                         (const real_t<T> *)k.w, (const real_t<T> *)k.v, k.param,
                                                         part);
    int rc = fz_result<j_max>("fz svd_f kernel launch", &r);
    if (rc)
        return rc;
    out[0] = r.re;
    out[1] = 1;
    return 0;
}

template <typename T> int fz_run(const pb_gpu_fz_t &k, double out[2])
{
    size_t m = (size_t)k.m, n = (size_t)k.n, ld = (size_t)k.ld;
    switch ((pb_gpu_fz_kind_t)k.kind) {
    case PB_GPU_FZ_AMAX:
        return fz_amax<T>(k, out);
    case PB_GPU_FZ_NORM:
        return fz_norm<T>(k, out);
    case PB_GPU_FZ_HERM_GAP:
        return fz_herm_gap<T>(k, out);
    case PB_GPU_FZ_HERMITIZE:
        k_fz_hermitize<T><<<blocks_for(n * n), THREADS, 0, t_w.stream>>>((T *)k.x, n, ld);
        return launched("fz hermitize kernel launch");
    case PB_GPU_FZ_ANTIHERM:
        k_fz_antiherm<T><<<blocks_for(n * n), THREADS, 0, t_w.stream>>>((T *)k.x, n, ld);
        return launched("fz antiherm kernel launch");
    case PB_GPU_FZ_PHASES: {
        unsigned cap = g_dev[t_w.dev].max_blocks, g = n < cap ? (unsigned)n : cap;
        k_fz_phases<T><<<g, THREADS, 0, t_w.stream>>>((T *)k.x, m, n, ld, (T *)const_cast<void *>(k.v));
        return launched("fz phases kernel launch");
    }
    case PB_GPU_FZ_EIGH_F:
        return fz_eigh_f<T>(k, out);
    case PB_GPU_FZ_ROWS_MUL:
        k_fz_rows_mul<T><<<blocks_for(m * n), THREADS, 0, t_w.stream>>>((T *)k.x, m, n, ld, (const T *)k.v);
        return launched("fz rows_mul kernel launch");
    case PB_GPU_FZ_COLS_DIV:
    case PB_GPU_FZ_ROWS_DIV:
        k_fz_div<T><<<blocks_for(m * n), THREADS, 0, t_w.stream>>>((T *)k.x, m, n, ld, (const real_t<T> *)k.w,
                                                                   k.kind == PB_GPU_FZ_COLS_DIV);
        return launched("fz cols_div/rows_div kernel launch");
    case PB_GPU_FZ_SVD_F:
        return fz_svd_f<T>(k, out);
    case PB_GPU_FZ_ROWS_SQRT_MUL:
        k_fz_rows_sqrt_mul<T><<<blocks_for(m * n), THREADS, 0, t_w.stream>>>((T *)k.x, m, n, ld,
                                                                             (const real_t<T> *)k.w);
        return launched("fz rows_sqrt_mul kernel launch");
    case PB_GPU_FZ_COLS_MUL:
        k_fz_cols_mul<T><<<blocks_for(m * n), THREADS, 0, t_w.stream>>>((T *)k.x, m, n, ld, (const real_t<T> *)k.w);
        return launched("fz cols_mul kernel launch");
    case PB_GPU_FZ_MIRROR_LOWER:
        k_fz_mirror_lower<T><<<blocks_for(n * n), THREADS, 0, t_w.stream>>>((T *)k.x, n, ld);
        return launched("fz mirror_lower kernel launch");
    case PB_GPU_FZ_POLAR_F:
        k_fz_polar_f<T><<<blocks_for(n * n), THREADS, 0, t_w.stream>>>((T *)k.x, n, ld, (const real_t<T> *)k.w,
                                                                      k.param);
        return launched("fz polar_f kernel launch");
    case PB_GPU_FZ_COLS_PINV:
        k_fz_cols_pinv<T><<<blocks_for(m * n), THREADS, 0, t_w.stream>>>((T *)k.x, m, n, ld,
                                                                         (const real_t<T> *)k.w, k.param);
        return launched("fz cols_pinv kernel launch");
    }
    return internal("fz", "bad kind");
}

int real_fz(const pb_gpu_fz_t *k, double out[2])
{
    int rc = worker_check("fz");
    if (rc)
        return rc;
    if (!k || k->dtype < 0 || k->dtype > 3 || k->kind < PB_GPU_FZ_AMAX || k->kind > PB_GPU_FZ_COLS_PINV)
        return internal("fz", "bad kernel, dtype or kind");
    const int kind = k->kind;
    bool reduces = kind <= PB_GPU_FZ_HERM_GAP || kind == PB_GPU_FZ_EIGH_F || kind == PB_GPU_FZ_SVD_F;
    bool square = (kind >= PB_GPU_FZ_HERM_GAP && kind <= PB_GPU_FZ_ANTIHERM) || kind == PB_GPU_FZ_EIGH_F ||
                  kind == PB_GPU_FZ_SVD_F || kind == PB_GPU_FZ_MIRROR_LOWER || kind == PB_GPU_FZ_POLAR_F;
    /* the vectors each kind reads (or, PHASES's v, writes) */
    bool takes_y = kind == PB_GPU_FZ_SVD_F;
    bool takes_w = kind == PB_GPU_FZ_EIGH_F || kind == PB_GPU_FZ_COLS_DIV || kind == PB_GPU_FZ_ROWS_DIV ||
                   kind == PB_GPU_FZ_SVD_F || kind == PB_GPU_FZ_ROWS_SQRT_MUL || kind == PB_GPU_FZ_COLS_MUL ||
                   kind == PB_GPU_FZ_POLAR_F || kind == PB_GPU_FZ_COLS_PINV;
    bool takes_v = kind == PB_GPU_FZ_EIGH_F || kind == PB_GPU_FZ_PHASES || kind == PB_GPU_FZ_ROWS_MUL ||
                   kind == PB_GPU_FZ_SVD_F;
    bool needs_w = takes_w && kind != PB_GPU_FZ_EIGH_F, needs_v = kind == PB_GPU_FZ_ROWS_MUL;
    if (k->m < 0 || k->n < 0 || k->ld < (k->m > 1 ? k->m : 1) || (square && k->m != k->n))
        return internal("fz", "bad sizes (ld < max(1, m), or a square kind given m != n)");
    if (reduces && !out)
        return internal("fz", "a reducing kind without out");
    if ((k->y && !takes_y) || (k->w && !takes_w) || (k->v && !takes_v))
        return internal("fz", "y, w or v given to a kind that does not take it");
    if (k->m == 0 || k->n == 0) { /* nothing to touch or wait for, as the fake */
        if (reduces) {
            out[0] = 0;
            out[1] = 1;
        }
        return 0;
    }
    if (!k->x || (takes_y && !k->y) || (needs_w && !k->w) || (needs_v && !k->v))
        return internal("fz", "no matrix, or a kind's y, w or v missing");
    switch (k->dtype) {
    case 0: return fz_run<float>(*k, out);
    case 1: return fz_run<double>(*k, out);
    case 2: return fz_run<cf>(*k, out);
    default: return fz_run<cd>(*k, out);
    }
}

/* ---- the solvers: cusolverDnXsyevd, cusolverDnXgesvd ----
 *
 * The device workspace comes from the device's pool on the worker's
 * stream, as the worker's own scratch does (not counted in used()), and is
 * freed in stream order after the solve; the host workspace, when the
 * query asks for one, from malloc.  info lives in the worker's scratch
 * (dot's, in stream order) and is copied back through staging, which
 * waits for the stream. */
const cudaDataType SOLVER_T[4] = {CUDA_R_32F, CUDA_R_64F, CUDA_C_32F, CUDA_C_64F};
const cudaDataType SOLVER_RT[4] = {CUDA_R_32F, CUDA_R_64F, CUDA_R_32F, CUDA_R_64F};

/* The later of two failures wins when it is the device's. */
int worse(int rc, int rc2)
{
    return rc == 0 || rc2 == PB_EDEVICE_UNAVAILABLE ? rc2 : rc;
}

/* One solve (name: the cuSOLVER call, for the log), its workspace sizes
 * queried: solve(dwork, hwork, dinfo) queues it (0 or a PB_E* code), then
 * *hinfo is its info, >= 0 (a rejected argument is PB_EINTERNAL). */
template <typename F> int solver_run(const char *name, size_t dbytes, size_t hbytes, F solve, int *hinfo)
{
    int dev = t_w.dev, rc = 0;
    void *dwork = nullptr, *hwork = nullptr;
    if (dbytes && (rc = pool_alloc(dev, g_dev[dev], dbytes, &dwork, t_w.stream)))
        return rc;
    int *dinfo = (int *)t_w.dot_scratch;
    if (hbytes && !(hwork = malloc(hbytes)))
        rc = internal(name, "out of host memory for cuSOLVER's host workspace");
    else if ((rc = solve(dwork, hwork, dinfo)) == 0)
        rc = real_d2h(hinfo, dinfo, sizeof *hinfo);
    if (rc && hwork && !g_dev[dev].failed.load()) {
        /* the solver may have queued work before it failed: it finishes
         * before its host workspace goes */
        cudaError_t e = cudaStreamSynchronize(t_w.stream);
        if (e != cudaSuccess)
            rc = worse(rc, cuda_fail(dev, e, "cudaStreamSynchronize (solver failed)"));
    }
    free(hwork);
    if (dwork && !g_dev[dev].failed.load()) { /* a failed device leaks it: see the top */
        cudaError_t e = cudaFreeAsync(dwork, t_w.stream);
        if (e != cudaSuccess)
            rc = worse(rc, cuda_fail(dev, e, "cudaFreeAsync (solver workspace)"));
    }
    if (rc)
        return rc;
    if (*hinfo < 0) {
        char why[96];
        snprintf(why, sizeof why, "%s rejected argument %d", name, -*hinfo);
        return internal(name, why);
    }
    return 0;
}

int real_syevd(int dtype, int vectors, int n, void *a, int lda, void *w, int *info)
{
    int rc = worker_check("syevd");
    if (rc)
        return rc;
    if (dtype < 0 || dtype > 3 || !info || n < 0 || lda < (n > 1 ? n : 1))
        return internal("syevd", "bad dtype, sizes (lda < max(1, n)) or info");
    if (n == 0) { /* nothing to solve or wait for */
        *info = 0;
        return 0;
    }
    if (!a || !w)
        return internal("syevd", "no matrix or eigenvalues");
    int dev = t_w.dev;
    cusolverEigMode_t job = vectors ? CUSOLVER_EIG_MODE_VECTOR : CUSOLVER_EIG_MODE_NOVECTOR;
    const cudaDataType ta = SOLVER_T[dtype], tw = SOLVER_RT[dtype];
    size_t dbytes = 0, hbytes = 0;
    SK(dev, cusolverDnXsyevd_bufferSize(t_w.solver, t_w.solver_params, job, CUBLAS_FILL_MODE_LOWER, n, ta, a, lda,
                                        tw, w, ta, &dbytes, &hbytes));
    int hinfo = 0;
    rc = solver_run(
        "cusolverDnXsyevd", dbytes, hbytes,
        [&](void *dwork, void *hwork, int *dinfo) {
            SK(dev, cusolverDnXsyevd(t_w.solver, t_w.solver_params, job, CUBLAS_FILL_MODE_LOWER, n, ta, a, lda, tw,
                                     w, ta, dwork, dbytes, hwork, hbytes, dinfo));
            return 0;
        },
        &hinfo);
    if (rc)
        return rc;
    *info = hinfo;
    return 0;
}

/* gesvd: jobu = jobvt = 'S' (the thin U, m×n, and Vᴴ, n×n) or 'N'.
 * Without vectors u and vt are not used: cuSOLVER gets NULL for both, with
 * ldu = m and ldvt = n, which every reading of its argument checks takes
 * (LAPACK asks ldu >= 1 there, some cuSOLVER calls ldu >= max(1, m)). */
int real_gesvd(int dtype, int vectors, int m, int n, void *a, int lda, void *s, void *u, int ldu, void *vt,
               int ldvt, int *info)
{
    int rc = worker_check("gesvd");
    if (rc)
        return rc;
    if (dtype < 0 || dtype > 3 || !info || m < 0 || n < 0 || lda < (m > 1 ? m : 1))
        return internal("gesvd", "bad dtype, sizes (lda < max(1, m)) or info");
    if (m < n)
        return internal("gesvd", "m < n: cuSOLVER's gesvd takes no wide matrix (the caller transposes)");
    if (vectors && (ldu < (m > 1 ? m : 1) || ldvt < (n > 1 ? n : 1)))
        return internal("gesvd", "ldu < max(1, m) or ldvt < max(1, n)");
    if (m == 0 || n == 0) { /* nothing to solve or wait for */
        *info = 0;
        return 0;
    }
    if (!a || !s || (vectors && (!u || !vt)))
        return internal("gesvd", "no matrix, singular values or vectors");
    int dev = t_w.dev;
    const signed char job = vectors ? 'S' : 'N';
    const cudaDataType ta = SOLVER_T[dtype], ts = SOLVER_RT[dtype];
    void *pu = vectors ? u : nullptr, *pvt = vectors ? vt : nullptr;
    const int64_t lu = vectors ? ldu : m, lvt = vectors ? ldvt : n;
    size_t dbytes = 0, hbytes = 0;
    SK(dev, cusolverDnXgesvd_bufferSize(t_w.solver, t_w.solver_params, job, job, m, n, ta, a, lda, ts, s, ta, pu,
                                        lu, ta, pvt, lvt, ta, &dbytes, &hbytes));
    int hinfo = 0;
    rc = solver_run(
        "cusolverDnXgesvd", dbytes, hbytes,
        [&](void *dwork, void *hwork, int *dinfo) {
            SK(dev, cusolverDnXgesvd(t_w.solver, t_w.solver_params, job, job, m, n, ta, a, lda, ts, s, ta, pu, lu,
                                     ta, pvt, lvt, ta, dwork, dbytes, hwork, hbytes, dinfo));
            return 0;
        },
        &hinfo);
    if (rc)
        return rc;
    *info = hinfo;
    return 0;
}

const char *real_last_error(void)
{
    return t_err;
}

const pb_gpu_backend_t real_backend = {
    .name = "cuda",
    .count = real_count,
    .info = real_info,
    .thread_init = real_thread_init,
    .thread_fini = real_thread_fini,
    .alloc = real_alloc,
    .free = real_free,
    .used = real_used,
    .failed = real_failed,
    .set_failed = real_set_failed,
    .import_fd = real_import_fd,
    .unimport = real_unimport,
    .h2d = real_h2d,
    .d2h = real_d2h,
    .zero = real_zero,
    .sync = real_sync,
    .gemm = real_gemm,
    .bias_act = real_bias_act,
    .dz = real_dz,
    .row_sum = real_row_sum,
    .strided = real_strided,
    .dot = real_dot,
    .fz = real_fz,
    .syevd = real_syevd,
    .gesvd = real_gesvd,
    .last_error = real_last_error,
};

} /* namespace */

/* The module's one entry point, found by cuda/gpu.c with dlsym: its name
 * is the version of the table that gpu.h declares (PB_GPU_MODULE_FN). */
extern "C" __attribute__((visibility("default"))) const pb_gpu_backend_t *PB_GPU_MODULE_FN(void)
{
    return &real_backend;
}
