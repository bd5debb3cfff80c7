/* The real GPU backend (cuda/gpu.h): the CUDA runtime, cuBLAS and our own
 * kernels for fused_dense.
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
 * its own), two events and an 8 MiB pinned staging buffer, all in
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
 * more.  Anything else is cleared and PB_EINTERNAL.  cuBLAS's
 * ALLOC_FAILED is PB_ENOMEM; its other failures look at the CUDA error
 * underneath the same way.  On a failed device, free and thread_fini only
 * forget their memory (its bytes leave used()) and leak it: a poisoned
 * context can be torn down only by the process's end. */
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
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
};

dev_state g_dev[PB_GPU_MAX_DEVICES];
std::atomic<int> g_count{0};

/* The calling thread's worker state; zero (unbound) in a new thread. */
struct worker_state {
    bool bound;
    int dev;
    cudaStream_t stream;
    cublasHandle_t blas;
    void *workspace;
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

int blas_fail(int dev, cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_ALLOC_FAILED) {
        set_err(what, cublasGetStatusName(s), cublasGetStatusString(s));
        return PB_ENOMEM;
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        int rc = cuda_fail(dev, e, what);
        size_t len = strlen(t_err);
        snprintf(t_err + len, sizeof t_err - len, " [%s]", cublasGetStatusName(s));
        return rc;
    }
    set_err(what, cublasGetStatusName(s), cublasGetStatusString(s));
    return PB_EINTERNAL;
}

#define BK(dev, call)                               \
    do {                                            \
        cublasStatus_t bk_s_ = (call);              \
        if (bk_s_ != CUBLAS_STATUS_SUCCESS)         \
            return blas_fail((dev), bk_s_, #call);  \
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
    if (!d.sizes) {
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
    if (w.workspace)
        (void)cudaFreeAsync(w.workspace, w.stream);
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
    CK(dev, cudaStreamSynchronize(w.stream));
    BK(dev, cublasCreate(&w.blas));
    /* cublasSetStream resets the workspace: stream first. */
    BK(dev, cublasSetStream(w.blas, w.stream));
    BK(dev, cublasSetWorkspace(w.blas, w.workspace, WORKSPACE_BYTES));
    BK(dev, cublasSetMathMode(w.blas, CUBLAS_PEDANTIC_MATH));
    BK(dev, cublasSetPointerMode(w.blas, CUBLAS_POINTER_MODE_HOST));
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

int real_failed(int dev)
{
    return valid_dev(dev) ? (int)g_dev[dev].failed.load() : 1;
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

const char *real_last_error(void)
{
    return t_err;
}

const pb_gpu_backend_t real_backend = {
    "cuda",
    real_count,
    real_info,
    real_thread_init,
    real_thread_fini,
    real_alloc,
    real_free,
    real_used,
    real_failed,
    real_h2d,
    real_d2h,
    real_zero,
    real_sync,
    real_gemm,
    real_bias_act,
    real_dz,
    real_row_sum,
    real_last_error,
};

} /* namespace */

/* The module's one entry point, found by cuda/gpu.c with dlsym. */
extern "C" __attribute__((visibility("default"))) const pb_gpu_backend_t *pb__gpu_real_backend(void)
{
    return &real_backend;
}
