#include "codec.h"

#include <string.h>

const msgpack_object *pb__obj_getn(const msgpack_object *map, const char *key, size_t kl)
{
    if (map == NULL || map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == kl && memcmp(k->via.str.ptr, key, kl) == 0)
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

bool pb__obj_is_strn(const msgpack_object *o, const char *s, size_t l)
{
    return o && o->type == MSGPACK_OBJECT_STR && o->via.str.size == l && memcmp(o->via.str.ptr, s, l) == 0;
}

bool pb__obj_uint(const msgpack_object *o, uint64_t *v)
{
    if (o == NULL || o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return false;
    *v = o->via.u64;
    return true;
}

bool pb__obj_handle(const msgpack_object *o, uint64_t *v)
{
    if (pb__obj_uint(o, v))
        return true;
    /* A JavaScript or Lua client may send a handle back as a double: exact
     * for every handle, which lies in [1, 2^53 - 1]. */
    if (o == NULL || (o->type != MSGPACK_OBJECT_FLOAT64 && o->type != MSGPACK_OBJECT_FLOAT32))
        return false;
    double d = o->via.f64;
    if (!(d >= 0 && d <= (double)PB_HANDLE_MAX) || d != (double)(uint64_t)d)
        return false;
    *v = (uint64_t)d;
    return true;
}

bool pb__obj_number(const msgpack_object *o, double *v)
{
    if (o == NULL)
        return false;
    switch (o->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER: *v = (double)o->via.u64; return true;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: *v = (double)o->via.i64; return true;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: *v = o->via.f64; return true;
    default: return false;
    }
}

bool pb_utf8_valid(const char *str, size_t len)
{
    for (size_t i = 0, n; i < len; i += n)
        if ((n = pb_utf8_char(str + i, len - i)) == 0)
            return false;
    return true;
}

int pb_buffer_view(const pb_resolver_t *res, const msgpack_object *buffer, const msgpack_object *offset, size_t bytes,
                   size_t align, bool write, const char *what, pb_storage_t **st, size_t *off, uint64_t *id,
                   pb_err_t *err)
{
    uint64_t b, o;
    if (buffer == NULL)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: offset needs buffer (the id register_buffer returned)",
                          what);
    if (offset == NULL)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: buffer needs offset (a byte offset into it)", what);
    if (!pb__obj_handle(buffer, &b))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what,
                          "%s: buffer must be the id register_buffer returned (a non-negative integer)", what);
    if (!pb__obj_uint(offset, &o))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: offset must be a non-negative integer (bytes)", what);
    if (res == NULL || res->find == NULL)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what,
                          "%s: no shared-memory buffers are registered here; send the values in data", what);
    pb_storage_t *s = res->find(res->ctx, b, write, what, err);
    if (s == NULL)
        return err ? err->code : PB_EINVALID_ARGUMENT;
    /* Checked in this order so that neither sum can overflow. */
    if (o > s->size || bytes > s->size - o)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what,
                          "%s: %zu bytes at offset %llu run past the end of buffer %llu (%zu bytes registered)", what,
                          bytes, (unsigned long long)o, (unsigned long long)b, s->size);
    if (align > 1 && o % align != 0)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what,
                          "%s: offset %llu is not aligned: offsets must be a multiple of the element size (%zu bytes)",
                          what, (unsigned long long)o, align);
    *st = pb_storage_ref(s);
    *off = (size_t)o;
    *id = b;
    return 0;
}

int pb_tensor_decode(const msgpack_object *o, pb_storage_t *msg, const char *what, pb_tensor_t *t, pb_err_t *err)
{
    return pb_tensor_decode_with(o, msg, NULL, what, t, err);
}

int pb_tensor_decode_with(const msgpack_object *o, pb_storage_t *msg, const pb_resolver_t *res, const char *what,
                          pb_tensor_t *t, pb_err_t *err)
{
    if (o->type != MSGPACK_OBJECT_MAP)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s must be a tensor map {dtype, shape, data}", what);
    static const char *const keys[6] = {"dtype", "shape", "order", "data", "buffer", "offset"};
    const msgpack_object *val[6] = {NULL};
    for (uint32_t i = 0; i < o->via.map.size; i++) {
        const msgpack_object *k = &o->via.map.ptr[i].key, *v = &o->via.map.ptr[i].val;
        int j = 0;
        while (j < 6 && !pb__obj_is_str(k, keys[j]))
            j++;
        if (j < 6 && val[j])
            return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: tensor key '%s' is given twice", what, keys[j]);
        if (j < 6)
            val[j] = v;
        else if (k->type == MSGPACK_OBJECT_STR)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: unknown tensor key '%s'", what,
                              pb_quote(PB_QUOTED, k->via.str.ptr, k->via.str.size));
        else
            return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: tensor keys must be strings", what);
    }
    const msgpack_object *dt = val[0], *shape = val[1], *order = val[2], *data = val[3], *buffer = val[4],
                         *offset = val[5];
    pb_dtype_t d;
    if (dt == NULL || dt->type != MSGPACK_OBJECT_STR)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: dtype must be one of \"f32\", \"f64\", \"c64\", \"c128\"",
                          what);
    if (pb_dtype_parse(dt->via.str.ptr, dt->via.str.size, &d))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what,
                          "%s: unknown dtype '%s' (expected \"f32\", \"f64\", \"c64\" or \"c128\")", what,
                          pb_quote(PB_QUOTED, dt->via.str.ptr, dt->via.str.size));
    if (shape == NULL || shape->type != MSGPACK_OBJECT_ARRAY)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: shape must be an array of non-negative integers",
                          what);
    if (shape->via.array.size > PB_MAX_RANK)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: rank %u is above the maximum of %d", what,
                          shape->via.array.size, PB_MAX_RANK);
    char ord = 'C';
    if (order) {
        if (pb__obj_is_str(order, "C"))
            ord = 'C';
        else if (pb__obj_is_str(order, "F"))
            ord = 'F';
        else
            return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: order must be \"C\" or \"F\"", what);
    }
    pb_tensor_t r = {0};
    r.dtype = d;
    r.rank = (int)shape->via.array.size;
    r.order = ord;
    for (int i = 0; i < r.rank; i++) {
        if (!pb__obj_uint(&shape->via.array.ptr[i], &r.shape[i]))
            return pb_err_set(err, PB_EINVALID_ARGUMENT, what,
                              "%s: shape[%d] must be a non-negative integer", what, i);
    }
    size_t bytes;
    if (!pb_shape_count(r.rank, r.shape, pb_dtype_size(d), NULL, &bytes))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: the product of the shape overflows", what);
    if (buffer || offset) {
        if (data)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, what,
                              "%s: give either data or buffer and offset, not both", what);
        /* Aligned to the element size, the kernels read the mapping in
         * place: a mapping starts on a page. */
        uint64_t id;
        int rc = pb_buffer_view(res, buffer, offset, bytes, pb_dtype_size(d), false, what, &r.storage, &r.offset,
                                &id, err);
        if (rc)
            return rc;
        *t = r;
        return 0;
    }
    /* Clients on the old msgpack spec (Neovim, msgpack's "raw" mode) send
     * every byte string as str: the contract takes it as the same bytes. */
    if (data == NULL || (data->type != MSGPACK_OBJECT_BIN && data->type != MSGPACK_OBJECT_STR))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s: data must be bin (little-endian values)", what);
    const char *ptr = data->type == MSGPACK_OBJECT_BIN ? data->via.bin.ptr : data->via.str.ptr;
    uint32_t len = data->type == MSGPACK_OBJECT_BIN ? data->via.bin.size : data->via.str.size;
    if (len != bytes)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, what,
                          "%s: data holds %u bytes but shape and dtype need %zu", what, len, bytes);
    const char *base = msg->ptr;
    if (len && (ptr < base || ptr + len > base + msg->size))
        return pb_err_set(err, PB_EINTERNAL, what, "%s: data outside the message", what);
    r.storage = pb_storage_ref(msg);
    r.offset = len ? (size_t)(ptr - base) : 0;
    *t = r;
    return 0;
}

void pb_out_init(pb_out_t *o)
{
    msgpack_sbuffer_init(&o->sb);
    msgpack_packer_init(&o->pk, &o->sb, msgpack_sbuffer_write);
    o->nseg = 0;
}

void pb_out_free(pb_out_t *o)
{
    for (int i = 0; i < o->nseg; i++)
        pb_storage_unref(o->seg[i].hold);
    o->nseg = 0;
    msgpack_sbuffer_destroy(&o->sb);
}

void pb_out_strn(pb_out_t *o, const char *s, size_t l)
{
    msgpack_pack_str(&o->pk, l);
    msgpack_pack_str_body(&o->pk, s, l);
}

/* Below this a payload is copied: an iovec costs more than the copy. */
#define PB_OUT_INLINE 16384

void pb_out_bin(pb_out_t *o, const void *p, size_t len, pb_storage_t *s)
{
    msgpack_pack_bin(&o->pk, len);
    if (len < PB_OUT_INLINE || s == NULL || o->nseg == PB_OUT_MAXSEG) {
        msgpack_pack_bin_body(&o->pk, p, len);
        return;
    }
    o->seg[o->nseg++] = (struct pb_out_seg){o->sb.size, p, len, pb_storage_ref(s)};
}

/* A tensor map's first keys, {dtype, shape, order, ...}: nkeys in all. */
static void out_tensor_head(pb_out_t *o, const pb_tensor_t *t, size_t nkeys)
{
    msgpack_pack_map(&o->pk, nkeys);
    pb_out_str(o, "dtype");
    pb_out_str(o, pb_dtype_name(t->dtype));
    pb_out_str(o, "shape");
    msgpack_pack_array(&o->pk, (size_t)t->rank);
    for (int i = 0; i < t->rank; i++)
        msgpack_pack_uint64(&o->pk, t->shape[i]);
    pb_out_str(o, "order");
    pb_out_str(o, t->order == 'F' ? "F" : "C");
}

void pb_out_tensor(pb_out_t *o, const pb_tensor_t *t)
{
    out_tensor_head(o, t, 4);
    pb_out_str(o, "data");
    pb_out_bin(o, pb_tensor_data(t), pb_tensor_bytes(t), t->storage);
}

void pb_out_tensor_in_buffer(pb_out_t *o, const pb_tensor_t *t, uint64_t buffer, uint64_t offset)
{
    out_tensor_head(o, t, 5);
    pb_out_str(o, "buffer");
    msgpack_pack_uint64(&o->pk, buffer);
    pb_out_str(o, "offset");
    msgpack_pack_uint64(&o->pk, offset);
}

void pb_out_error_response(pb_out_t *o, uint32_t msgid, const pb_err_t *err)
{
    msgpack_pack_array(&o->pk, 4);
    msgpack_pack_int(&o->pk, 1);
    msgpack_pack_uint32(&o->pk, msgid);
    int n = 2 + (err->arg[0] != 0) + (err->has_info != 0) + (err->code == PB_ERESOURCE_EXHAUSTED && err->arg[0]);
    msgpack_pack_map(&o->pk, (size_t)n);
    pb_out_str(o, "code");
    pb_out_str(o, pb_strerror_code(err->code));
    pb_out_str(o, "message");
    pb_out_str(o, err->message[0] ? err->message : pb_strerror(err->code));
    if (err->arg[0]) {
        pb_out_str(o, "arg");
        pb_out_str(o, err->arg);
    }
    if (err->code == PB_ERESOURCE_EXHAUSTED && err->arg[0]) {
        pb_out_str(o, "limit");
        pb_out_str(o, err->arg);
    }
    if (err->has_info) {
        pb_out_str(o, "info");
        msgpack_pack_int64(&o->pk, err->info);
    }
    msgpack_pack_nil(&o->pk);
}

void pb_out_result_header(pb_out_t *o, uint32_t msgid)
{
    msgpack_pack_array(&o->pk, 4);
    msgpack_pack_int(&o->pk, 1);
    msgpack_pack_uint32(&o->pk, msgid);
    msgpack_pack_nil(&o->pk);
}

int pb_out_iov(const pb_out_t *o, const void **ptr, size_t *len, int max)
{
    int n = 0;
    size_t at = 0;
    for (int i = 0; i < o->nseg && n + 2 < max; i++) {
        if (o->seg[i].at > at) {
            ptr[n] = o->sb.data + at;
            len[n++] = o->seg[i].at - at;
        }
        ptr[n] = o->seg[i].p;
        len[n++] = o->seg[i].len;
        at = o->seg[i].at;
    }
    if (o->sb.size > at && n < max) {
        ptr[n] = o->sb.data + at;
        len[n++] = o->sb.size - at;
    }
    return n;
}

size_t pb_out_size(const pb_out_t *o)
{
    size_t n = o->sb.size;
    for (int i = 0; i < o->nseg; i++)
        n += o->seg[i].len;
    return n;
}
