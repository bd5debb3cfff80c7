/* libFuzzer target over the message decoder and request validation: the
 * framing scan, unpacking, the msgpack-RPC envelope, and for every method
 * the same parsing the daemon does (daemon/request.c: params keys, op
 * lookup, tensor decoding, options, wrt, device, each op's validate, the
 * cotangents of reverse against held tapes).  Calls that validate and
 * are cheap (under ~10⁵ flops) are also run, forward and reverse, so odd
 * but valid inputs (zero sizes, rank 16, NaN, every option) reach the
 * kernels too.  Build with clang:
 *   CC=clang meson setup build-fuzz -Dfuzz=true -Db_sanitize=address,undefined -Db_lundef=false
 *   ninja -C build-fuzz tests/fuzz/fuzz_decode
 *   build-fuzz/tests/fuzz/fuzz_decode -max_total_time=60 tests/fuzz/corpus
 * In that build everything the target links (proto/, kernels/, daemon/) is
 * compiled with -fsanitize=fuzzer-no-link (the top-level meson.build), so
 * libFuzzer's coverage counts the decoder, the request checks and the
 * kernels, not only this file.
 * Tensors may say {buffer, offset} (contract section 6): two fake buffers
 * stand in for a connection's table, id 1 (4096 bytes, writable) and id 2
 * (256 bytes, read-only), so buffer inputs and the into targets of
 * forward and reverse are decoded, bounds-checked and written (a write
 * past a checked bound is a heap overflow ASan reports).
 * The seed corpus (tests/fuzz/make_corpus.py) has a valid request for
 * every method and op. */
#include <stdint.h>
#include <string.h>

#include <msgpack.h>

#include "daemon/buffer.h"
#include "daemon/request.h"
#include "kernels/op.h"
#include "proto/codec.h"
#include "proto/wire.h"

#define LIMIT (1u << 20)
#define CHEAP 1e5

/* Tapes the reverse seeds can name: fused_dense f64 (y 3×2), and
 * svd_compact c64 (U 4×3, S 3, Vh 3×3), kept for the whole run. */
static pb_tapedata_t tapes[2];
static bool have_tapes;
static pb_storage_t *fake[2];

static pb_storage_t *fake_find(void *ctx, uint64_t id, bool write, const char *what, pb_err_t *err)
{
    (void)ctx;
    if (id == 1 || (id == 2 && !write))
        return fake[id - 1];
    pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: no such buffer", what);
    return NULL;
}

static const pb_resolver_t resolver = {fake_find, NULL};

static void make_tape(pb_tapedata_t *t, const char *op, pb_dtype_t d, int r0, int c0, int r1, int c1)
{
    pb_call_t c;
    memset(&c, 0, sizeof c);
    c.op = pb_op_find(op, strlen(op));
    c.dtype = d;
    c.order = 'C';
    c.wrt = 1;
    c.taped = true;
    uint64_t s0[2] = {(uint64_t)r0, (uint64_t)c0}, s1[2] = {(uint64_t)r1, (uint64_t)c1};
    pb_tensor_alloc(&c.in[0], d, 2, s0, 'C', true);
    if (r1)
        pb_tensor_alloc(&c.in[1], d, 2, s1, 'C', true);
    pb_call_defaults(&c);
    pb_err_t err;
    if (c.op->validate(&c, &err) || pb_op_run_forward(&c, t, &err))
        __builtin_trap();
    pb_call_clear(&c);
}

static void run_call(pb_call_t *c, pb_call_kind_t kind, const pb_into_t *into)
{
    pb_err_t err;
    if (kind == PB_CALL_CHECK || c->cost >= CHEAP)
        return;
    pb_tapedata_t tape;
    if (pb_op_run_forward(c, kind == PB_CALL_AUGMENTED ? &tape : NULL, &err))
        return;
    for (int i = 0; i < c->op->noutputs; i++)
        if (into[i].storage && pb_into_store(&into[i], &c->out[i], false, &err) != 0)
            __builtin_trap(); /* an output larger than validate said */
    if (kind == PB_CALL_AUGMENTED) { /* the outputs themselves as cotangents */
        pb_tensor_t grad[PB_MAX_IO + 2] = {{0}};
        pb_warnings_t w = {0};
        pb_op_run_reverse(&tape, c->out, grad, 'C', &w, &err);
        for (int i = 0; i < PB_MAX_IO + 2; i++)
            pb_tensor_clear(&grad[i]);
        pb_tapedata_clear(&tape);
    }
}

static void serve(const uint8_t *p, size_t n, const pb_config_t *cfg)
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
    /* [0, msgid, method, [params]] or [2, method, [params]] */
    const msgpack_object *method = NULL, *pa = NULL;
    if (root.type == MSGPACK_OBJECT_ARRAY && root.via.array.size == 4) {
        method = &root.via.array.ptr[2];
        pa = &root.via.array.ptr[3];
    } else if (root.type == MSGPACK_OBJECT_ARRAY && root.via.array.size == 3) {
        method = &root.via.array.ptr[1];
        pa = &root.via.array.ptr[2];
    }
    const msgpack_object *params = NULL;
    if (pa && pa->type == MSGPACK_OBJECT_ARRAY && pa->via.array.size == 1 &&
        pa->via.array.ptr[0].type == MSGPACK_OBJECT_MAP)
        params = &pa->via.array.ptr[0];
    if (params && method->type == MSGPACK_OBJECT_STR) {
        pb_err_t err;
        if (pb__obj_is_str(method, "forward") || pb__obj_is_str(method, "augmented_forward") ||
            pb__obj_is_str(method, "check")) {
            pb_call_kind_t kind = pb__obj_is_str(method, "forward")   ? PB_CALL_FORWARD
                                  : pb__obj_is_str(method, "check") ? PB_CALL_CHECK
                                                                    : PB_CALL_AUGMENTED;
            pb_call_t c;
            memset(&c, 0, sizeof c);
            pb_call_extra_t x = {0};
            if (pb_request_call(cfg, params, msg, &resolver, kind, &c, &x, &err) == 0)
                run_call(&c, kind, x.into);
            pb_call_clear(&c);
            pb_into_clear(x.into, PB_MAX_IO);
        } else if (pb__obj_is_str(method, "reverse")) {
            static const char *const keys[] = {"tape", "cotangents", "keep", "order", "into", "accumulate", NULL};
            char order;
            bool acc;
            if (pb_request_check_keys(params, keys, &err) == 0 && pb_request_order(params, &order, &err) == 0 &&
                pb_request_accumulate(params, &acc, &err) == 0) {
                const msgpack_object *cots = pb__obj_get(params, "cotangents");
                for (int t = 0; t < 2; t++) {
                    const pb_op_t *op = tapes[t].op;
                    pb_tensor_t cot[PB_MAX_IO] = {{0}}, grad[PB_MAX_IO + 2] = {{0}}, gmeta[PB_MAX_IO + 2] = {{0}};
                    pb_into_t into[PB_MAX_IO + 2] = {{0}};
                    pb_warnings_t w = {0};
                    for (int k = 0; k < op->nwrt; k++) { /* as daemon/rpc.c's m_reverse */
                        if (k < op->ninputs)
                            gmeta[k] = tapes[t].in_meta[k];
                        else
                            gmeta[k].dtype = tapes[t].dtype;
                        gmeta[k].order = order;
                    }
                    if (pb_request_cotangents(&tapes[t], cots, msg, &resolver, cot, &err) == 0 &&
                        pb_request_into(pb__obj_get(params, "into"), &resolver, op->wrt_names, op->nwrt,
                                        tapes[t].wrt, gmeta, "gradient", into, &err) == 0 &&
                        pb_op_run_reverse(&tapes[t], cot, grad, order, &w, &err) == 0) {
                        for (int k = 0; k < op->nwrt; k++)
                            if (into[k].storage && grad[k].storage && pb_into_store(&into[k], &grad[k], acc, &err))
                                __builtin_trap();
                    }
                    for (int i = 0; i < PB_MAX_IO; i++)
                        pb_tensor_clear(&cot[i]);
                    for (int i = 0; i < PB_MAX_IO + 2; i++)
                        pb_tensor_clear(&grad[i]);
                    pb_into_clear(into, PB_MAX_IO + 2);
                }
            }
        } else {
            static const char *const none[] = {NULL};
            pb_request_check_keys(params, none, &err);
        }
    }
    msgpack_zone_destroy(&zone);
    pb_storage_unref(msg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static pb_config_t cfg;
    if (!have_tapes) {
        cfg.max_message_bytes = LIMIT;
        cfg.device = (pb_device_t){PB_DEV_CPU, 0};
        make_tape(&tapes[0], "fused_dense", PB_F64, 3, 4, 4, 2);
        make_tape(&tapes[1], "svd_compact", PB_C64, 4, 3, 0, 0);
        fake[0] = pb_storage_new(4096, true);
        fake[1] = pb_storage_new(256, true);
        have_tapes = true;
    }
    size_t off = 0;
    while (off < size) {
        pb_scan_t s;
        pb_scan_reset(&s);
        size_t n;
        if (pb_scan_feed(&s, data + off, size - off, LIMIT, &n) != 1)
            break;
        serve(data + off, n, &cfg);
        off += n;
    }
    return 0;
}
