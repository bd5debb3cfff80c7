/* The value codec: msgpack objects to tensors and options, and replies
 * back to bytes.
 *
 * Decoding runs on the loop thread over a message that passed the framing
 * scan (wire.h).  A decoded tensor is a view into the message's storage
 * (one reference), so a large input is never copied on the loop.
 *
 * Replies are built in a pb_out_t: small values are packed into one
 * buffer, large bin payloads (tensor data) are referenced in place, with a
 * reference on their storage, and go out as separate iovecs.  The pb_out_t
 * owns its buffer and those references until pb_out_free. */
#ifndef PB_CODEC_H
#define PB_CODEC_H

#include <msgpack.h>
#include <stdbool.h>
#include <string.h>

#include "../kernels/tensor.h"
#include "errors.h"

/* Map lookup by key; NULL when absent or not a map.  Inline over the
 * length-taking form so that a literal key's strlen is folded away: these
 * run several times per request, on the loop thread. */
const msgpack_object *pb__obj_getn(const msgpack_object *map, const char *key, size_t len);
static inline const msgpack_object *pb__obj_get(const msgpack_object *map, const char *key)
{
    return pb__obj_getn(map, key, strlen(key));
}
bool pb__obj_is_strn(const msgpack_object *o, const char *s, size_t len);
static inline bool pb__obj_is_str(const msgpack_object *o, const char *s)
{
    return pb__obj_is_strn(o, s, strlen(s));
}
/* A uint that fits in uint64 (positive fixint or uint). */
bool pb__obj_uint(const msgpack_object *o, uint64_t *v);
/* Handles (tapes, buffers) are integers in [1, PB_HANDLE_MAX], exact in a
 * double: a uint, or a float holding an integer, as JavaScript sends it. */
#define PB_HANDLE_MAX ((UINT64_C(1) << 53) - 1)
bool pb__obj_handle(const msgpack_object *o, uint64_t *v);
/* Any number (int or float). */
bool pb__obj_number(const msgpack_object *o, double *v);
/* True when every byte of a str is valid UTF-8. */
bool pb_utf8_valid(const char *s, size_t len);

/* Where tensors that say {buffer, offset} instead of data find their bytes
 * (contract section 6): the connection's table of registered shared-memory
 * buffers (daemon/buffer.h), or anything else a caller plugs in (the fuzz
 * target's fake buffers).  find returns buffer id's storage, borrowed (the
 * codec takes its own reference), or NULL with err set (what names the
 * argument): an id unknown here, a broken buffer, or, with write, one
 * mapped read-only. */
typedef struct pb_resolver {
    pb_storage_t *(*find)(void *ctx, uint64_t id, bool write, const char *what, pb_err_t *err);
    void *ctx;
} pb_resolver_t;

/* Decode the tensor map o into t, viewing the bytes of msg (which holds
 * the message the object was unpacked from) or, for {dtype, shape, order?,
 * buffer, offset}, of a buffer that res finds (NULL: no buffers, such a
 * tensor is invalid_argument).  what names the argument in errors
 * ("inputs.x").  0 or PB_EINVALID_ARGUMENT / PB_ENOMEM with err. */
int pb_tensor_decode_with(const msgpack_object *o, pb_storage_t *msg, const pb_resolver_t *res, const char *what,
                          pb_tensor_t *t, pb_err_t *err);
/* The same with no buffers. */
int pb_tensor_decode(const msgpack_object *o, pb_storage_t *msg, const char *what, pb_tensor_t *t, pb_err_t *err);

/* bytes bytes at {buffer, offset} (wire objects, NULL when absent) in a
 * buffer res finds: both keys present and non-negative integers, the
 * buffer known (and writable when write), offset a multiple of align, and
 * offset + bytes within the registered size, without overflow.  On
 * success *st gets a new reference on the buffer's storage, *off the
 * offset and *id the buffer id. */
int pb_buffer_view(const pb_resolver_t *res, const msgpack_object *buffer, const msgpack_object *offset, size_t bytes,
                   size_t align, bool write, const char *what, pb_storage_t **st, size_t *off, uint64_t *id,
                   pb_err_t *err);

/* Reply builder. */
#define PB_OUT_MAXSEG 16
typedef struct pb_out {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    int nseg;
    struct pb_out_seg {
        size_t at; /* offset in sb after which this payload goes */
        const void *p;
        size_t len;
        pb_storage_t *hold;
    } seg[PB_OUT_MAXSEG];
} pb_out_t;

void pb_out_init(pb_out_t *o);
void pb_out_free(pb_out_t *o);
void pb_out_strn(pb_out_t *o, const char *s, size_t len);
static inline void pb_out_str(pb_out_t *o, const char *s)
{
    pb_out_strn(o, s, strlen(s)); /* folded for a literal */
}
/* A bin payload from storage s (referenced when large, copied else). */
void pb_out_bin(pb_out_t *o, const void *p, size_t len, pb_storage_t *s);
/* {dtype, shape, order, data} of t in its own order. */
void pb_out_tensor(pb_out_t *o, const pb_tensor_t *t);
/* {dtype, shape, order, buffer, offset}: a result written into a buffer
 * (into); t gives dtype, shape and order (its storage is not read). */
void pb_out_tensor_in_buffer(pb_out_t *o, const pb_tensor_t *t, uint64_t buffer, uint64_t offset);
/* [1, msgid, error, nil] for err. */
void pb_out_error_response(pb_out_t *o, uint32_t msgid, const pb_err_t *err);
/* The start of [1, msgid, nil, <result packed next>]. */
void pb_out_result_header(pb_out_t *o, uint32_t msgid);
/* The iovecs of the whole reply: fills up to max pairs (ptr, len) and
 * returns the count. */
int pb_out_iov(const pb_out_t *o, const void **ptr, size_t *len, int max);
size_t pb_out_size(const pb_out_t *o);

#endif
