/* libFuzzer target over the message decoder: framing scan, unpacking,
 * the envelope, tensor decoding, and fused_dense's validation and (for
 * small inputs) its forward.  Build with clang:
 *   CC=clang meson setup build-fuzz -Dfuzz=true -Db_sanitize=address,undefined -Db_lundef=false
 *   ninja -C build-fuzz tests/fuzz/fuzz_decode
 *   build-fuzz/tests/fuzz/fuzz_decode -max_total_time=60 tests/fuzz/corpus */
#include <stdint.h>
#include <string.h>

#include <msgpack.h>

#include "kernels/op.h"
#include "proto/codec.h"
#include "proto/wire.h"

#define LIMIT (1u << 20)

static void serve(const uint8_t *p, size_t n)
{
    pb_storage_t *msg = pb_storage_new(n, false);
    if (msg == NULL)
        return;
    memcpy(msg->ptr, p, n);
    msgpack_zone zone;
    msgpack_zone_init(&zone, 4096);
    msgpack_object root;
    size_t off = 0;
    if (msgpack_unpack(msg->ptr, n, &off, &zone, &root) != MSGPACK_UNPACK_SUCCESS)
        __builtin_trap(); /* the scan said this is one whole message */
    const msgpack_object *params = NULL;
    if (root.type == MSGPACK_OBJECT_ARRAY && root.via.array.size == 4) {
        const msgpack_object *pa = &root.via.array.ptr[3];
        if (pa->type == MSGPACK_OBJECT_ARRAY && pa->via.array.size == 1)
            params = &pa->via.array.ptr[0];
    }
    const msgpack_object *in = pb__obj_get(params, "inputs");
    if (in && in->type == MSGPACK_OBJECT_MAP) {
        pb_call_t c;
        memset(&c, 0, sizeof c);
        c.op = pb_ops[0];
        c.order = 'C';
        bool ok = true;
        for (uint32_t i = 0; i < in->via.map.size && ok; i++) {
            const msgpack_object *k = &in->via.map.ptr[i].key;
            int idx = k->type == MSGPACK_OBJECT_STR ? pb_op_input_index(c.op, k->via.str.ptr, k->via.str.size) : -1;
            pb_err_t err;
            pb_tensor_t t;
            if (pb_tensor_decode(&in->via.map.ptr[i].val, msg, "inputs.x", &t, &err) != 0)
                continue;
            if (idx < 0 || c.in[idx].storage || !(c.op->dtypes & PB_DTYPE_BIT(t.dtype))) {
                pb_tensor_clear(&t);
                continue;
            }
            c.in[idx] = t;
            c.dtype = t.dtype;
        }
        for (int i = 0; i < c.op->ninputs; i++)
            if (c.in[i].storage && c.in[i].dtype != c.dtype)
                ok = false;
        ok = ok && c.in[0].storage && c.in[1].storage;
        pb_call_defaults(&c);
        pb_err_t err;
        if (ok && c.op->validate(&c, &err) == 0 && c.cost < 1e6)
            pb_op_run_forward(&c, NULL, &err);
        pb_call_clear(&c);
    }
    msgpack_zone_destroy(&zone);
    pb_storage_unref(msg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t off = 0;
    while (off < size) {
        pb_scan_t s;
        pb_scan_reset(&s);
        size_t n;
        if (pb_scan_feed(&s, data + off, size - off, LIMIT, &n) != 1)
            break;
        serve(data + off, n);
        off += n;
    }
    return 0;
}
