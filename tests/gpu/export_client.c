/* GPU buffers across processes (issue 14), on a GPU: this process is the
 * client, the daemon another.  It allocates device memory exportable as a
 * POSIX fd (cuMemCreate, cuMemExportToShareableHandle, reached through the
 * runtime's cudaGetDriverEntryPointByVersion), fills W and x there, sends
 * the fd with register_buffer {device: "cuda:0"}, and runs fused_dense on
 * cuda:0 with its inputs in the buffer and y written into it.  The y read
 * back from the device must equal, bit for bit, the y of the same call
 * with W and x inline.  Exits 77 with "no CUDA device" without one.
 *
 *   gpu_export_client SOCKET        (tests/gpu/run.sh starts the daemon) */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pullbackd.h"

#define OUT 64
#define IN 48
#define BATCH 32

static enum cudaDriverEntryPointQueryResult q;
#define GET(sym, ver, fp)                                                                                  \
    (cudaGetDriverEntryPointByVersion(sym, (void **)&(fp), ver, cudaEnableDefault, &q) == cudaSuccess && \
     q == cudaDriverEntryPointSuccess)

static int fail(const char *what)
{
    printf("FAIL: %s\n", what);
    return 1;
}

/* One fused_dense forward on cuda:0: W and x as buffer tensors (buf > 0)
 * or inline (host), y into the buffer at y_at (buf > 0) or back in *y. */
static int forward(pb_client_t *c, uint64_t buf, const double *W, const double *x, double *y, uint64_t y_at)
{
    msgpack_packer *pk = pb_client_begin(c, "forward");
    msgpack_pack_map(pk, buf ? 5 : 4);
    pb_pack_kv_str(pk, "op", "fused_dense");
    pb_pack_kv_str(pk, "device", "cuda:0");
    pb_pack_str(pk, "options");
    msgpack_pack_map(pk, 1);
    pb_pack_kv_str(pk, "act", "gelu");
    pb_pack_str(pk, "inputs");
    msgpack_pack_map(pk, 2);
    pb_ctensor_t w = {.dtype = "f64", .rank = 2, .shape = {OUT, IN}}, xt = {.dtype = "f64", .rank = 2,
                                                                           .shape = {IN, BATCH}};
    if (buf) {
        w.shm = xt.shm = true;
        w.buffer = xt.buffer = buf;
        w.offset = 0;
        xt.offset = sizeof(double) * OUT * IN;
    } else {
        w.data = W, w.nbytes = sizeof(double) * OUT * IN;
        xt.data = x, xt.nbytes = sizeof(double) * IN * BATCH;
    }
    pb_pack_str(pk, "weight");
    pb_pack_tensor(pk, &w);
    pb_pack_str(pk, "x");
    pb_pack_tensor(pk, &xt);
    if (buf)
        pb_pack_into(pk, &(pb_into_t){"y", buf, y_at}, 1);
    pb_reply_t r = {0};
    if (pb_client_call(c, &r) != 0 || pb_reply_code(&r)) {
        printf("forward: %s %s\n", pb_reply_code(&r) ? pb_reply_code(&r) : "no reply",
               pb_reply_message(&r) ? pb_reply_message(&r) : "");
        pb_reply_free(&r);
        return -1;
    }
    pb_ctensor_t out;
    int rc = 0;
    if (!buf && (pb_obj_tensor(pb_obj_path(r.result, "outputs.y"), &out) != 0 ||
                 pb_ctensor_copy_f64(&out, y, OUT * BATCH) != 0))
        rc = -1;
    pb_reply_free(&r);
    return rc;
}

int main(int argc, char **argv)
{
    int n = 0;
    if (argc < 2 || cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no CUDA device%s\n", argc < 2 ? " (and no socket given)" : "");
        return 77;
    }
    PFN_cuMemCreate_v10020 create;
    PFN_cuMemGetAllocationGranularity_v10020 granularity;
    PFN_cuMemExportToShareableHandle_v10020 export_;
    PFN_cuMemAddressReserve_v10020 reserve;
    PFN_cuMemMap_v10020 map;
    PFN_cuMemSetAccess_v10020 access;
    if (cudaSetDevice(0) != cudaSuccess || cudaFree(0) != cudaSuccess || !GET("cuMemCreate", 10020, create) ||
        !GET("cuMemGetAllocationGranularity", 10020, granularity) ||
        !GET("cuMemExportToShareableHandle", 10020, export_) || !GET("cuMemAddressReserve", 10020, reserve) ||
        !GET("cuMemMap", 10020, map) || !GET("cuMemSetAccess", 10020, access))
        return fail("the driver's virtual-memory entry points");
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t g = 0, want = sizeof(double) * (OUT * IN + IN * BATCH + OUT * BATCH);
    if (granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || g == 0)
        return fail("cuMemGetAllocationGranularity");
    size_t size = (want + g - 1) / g * g;
    CUmemGenericAllocationHandle h;
    CUdeviceptr p = 0;
    int fd = -1;
    CUmemAccessDesc ad = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0},
                          .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    if (create(&h, size, &prop, 0) != CUDA_SUCCESS ||
        export_(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS ||
        reserve(&p, size, 0, 0, 0) != CUDA_SUCCESS || map(p, size, 0, h, 0) != CUDA_SUCCESS ||
        access(p, size, &ad, 1) != CUDA_SUCCESS)
        return fail("allocating, exporting and mapping device memory");
    static double W[OUT * IN], x[IN * BATCH], inline_y[OUT * BATCH], buffer_y[OUT * BATCH];
    for (int i = 0; i < OUT * IN; i++)
        W[i] = (double)((i * 37) % 101) / 50.0 - 1.0;
    for (int i = 0; i < IN * BATCH; i++)
        x[i] = (double)((i * 53) % 97) / 40.0 - 1.2;
    if (cudaMemcpy((void *)p, W, sizeof W, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy((char *)p + sizeof W, x, sizeof x, cudaMemcpyHostToDevice) != cudaSuccess)
        return fail("filling the device memory");

    pb_client_t *c;
    if (pb_client_connect(argv[1], &c) != 0)
        return fail("connecting to the daemon");
    msgpack_packer *pk = pb_client_begin(c, "register_buffer");
    msgpack_pack_map(pk, 2);
    pb_pack_str(pk, "size");
    msgpack_pack_uint64(pk, size);
    pb_pack_kv_str(pk, "device", "cuda:0");
    uint32_t id;
    pb_reply_t r = {0};
    uint64_t buf = 0;
    if (pb_client_send_with_fd(c, fd, &id) != 0 || pb_client_wait(c, id, &r) != 0 || pb_reply_code(&r) ||
        pb_obj_uint(pb_obj_get(r.result, "buffer"), &buf) != 0) {
        printf("register_buffer: %s\n", pb_reply_message(&r) ? pb_reply_message(&r) : "no reply");
        return fail("register_buffer on cuda:0");
    }
    pb_reply_free(&r);
    close(fd); /* the daemon's mapping keeps the memory */

    uint64_t y_at = sizeof W + sizeof x;
    if (forward(c, 0, W, x, inline_y, 0) != 0 || forward(c, buf, NULL, NULL, NULL, y_at) != 0)
        return fail("the forwards");
    if (cudaMemcpy(buffer_y, (char *)p + y_at, sizeof buffer_y, cudaMemcpyDeviceToHost) != cudaSuccess)
        return fail("reading y back");
    if (memcmp(inline_y, buffer_y, sizeof buffer_y) != 0)
        return fail("y written into the GPU buffer differs from the inline y");
    pb_client_close(c);
    printf("PASS: fused_dense on cuda:0 with W, x and y in a GPU buffer equals the inline call bit for bit\n");
    return 0;
}
