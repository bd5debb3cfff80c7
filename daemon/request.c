#include "request.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "../cuda/gpu_ops.h"
#include "buffer.h"

#define DEFAULT_TTL_MS 600000u
#define MAX_TTL_S 31536000.0

/* A map key or name the client sent, quoted for an error message ("?"
 * when it is no string) in q (PB_QUOTED). */
static const char *key_text(pb_quoted_t *q, const msgpack_object *k)
{
    return k->type == MSGPACK_OBJECT_STR ? pb_quote(q, k->via.str.ptr, k->via.str.size) : "?";
}

/* names[0..n) (n < 0: up to a NULL) joined with ", " into buf, "none"
 * for no name; cut short where buf ends. */
static const char *join_names(const char *const *names, int n, char *buf, size_t len)
{
    size_t o = 0;
    snprintf(buf, len, "none");
    for (int i = 0; (n < 0 ? names[i] != NULL : i < n) && o < len; i++)
        o += (size_t)snprintf(buf + o, len - o, "%s%s", i ? ", " : "", names[i]);
    return buf;
}

/* Every key of params must be one of allowed, and given once (which of
 * two would count is no guess to leave to the daemon). */
int pb_request_check_keys(const msgpack_object *params, const char *const *allowed, pb_err_t *err)
{
    uint64_t seen = 0; /* by index in allowed (every list is far shorter than 64) */
    for (uint32_t i = 0; i < params->via.map.size; i++) {
        const msgpack_object *k = &params->via.map.ptr[i].key;
        if (k->type != MSGPACK_OBJECT_STR)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "params", "params keys must be strings");
        int j = 0;
        while (allowed[j] && !pb__obj_is_str(k, allowed[j]))
            j++;
        if (!allowed[j]) {
            char list[200];
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "params", "unknown key '%s' in params (expected: %s)",
                              key_text(PB_QUOTED, k), join_names(allowed, -1, list, sizeof list));
        }
        if (seen >> j & 1)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, allowed[j], "params key '%s' is given twice", allowed[j]);
        seen |= (uint64_t)1 << j;
    }
    return 0;
}

int pb_request_device(const msgpack_object *params, pb_device_t dflt, pb_device_t *dev, pb_err_t *err)
{
    const msgpack_object *o = pb__obj_get(params, "device");
    *dev = dflt;
    if (o && (o->type != MSGPACK_OBJECT_STR || pb_device_parse(o->via.str.ptr, o->via.str.size, dev)))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "device", "device must be \"cpu\", \"cuda\" or \"cuda:N\"");
    if (dev->kind == PB_DEV_CPU)
        return 0;
    int n = pb_gpu_count();
    if (n == 0)
        return pb_err_set(err, PB_EDEVICE_UNAVAILABLE, "device",
                          "device cuda:%d is not available: this daemon has no CUDA devices", dev->index);
    if (dev->index >= n)
        return pb_err_set(err, PB_EDEVICE_UNAVAILABLE, "device",
                          "device cuda:%d is not available: this daemon has %d GPU%s (cuda:0 to cuda:%d)", dev->index,
                          n, n == 1 ? "" : "s", n - 1);
    if (pb_gpu->failed(dev->index))
        return pb_err_set(err, PB_EDEVICE_UNAVAILABLE, "device",
                          "device cuda:%d has failed (a sticky CUDA error; the daemon's log says which) and serves "
                          "nothing until the daemon restarts",
                          dev->index);
    return 0;
}

int pb_request_order(const msgpack_object *params, char *order, pb_err_t *err)
{
    const msgpack_object *o = pb__obj_get(params, "order");
    *order = 'C';
    if (o == NULL)
        return 0;
    if (pb__obj_is_str(o, "F"))
        *order = 'F';
    else if (!pb__obj_is_str(o, "C"))
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "order", "order must be \"C\" or \"F\"");
    return 0;
}

/* what = prefix + name, cut to len: the success path must not pay for
 * vsnprintf just to have the argument name ready for an error. */
static void join(char *what, size_t len, const char *prefix, const char *name)
{
    size_t a = strlen(prefix), b = strlen(name);
    if (a >= len)
        a = len - 1;
    if (b >= len - a)
        b = len - a - 1;
    memcpy(what, prefix, a);
    memcpy(what + a, name, b);
    what[a + b] = 0;
}

/* A list of axis numbers; their meaning (a permutation, distinct, < rank)
 * is the op's to check against the shapes.  0, or -1 when malformed. */
static int parse_axes(const msgpack_object *v, int *n, signed char *ax)
{
    if (v->type != MSGPACK_OBJECT_ARRAY || v->via.array.size > PB_MAX_RANK)
        return -1;
    for (uint32_t i = 0; i < v->via.array.size; i++) {
        const msgpack_object *e = &v->via.array.ptr[i];
        if (e->type != MSGPACK_OBJECT_POSITIVE_INTEGER || e->via.u64 >= PB_MAX_RANK)
            return -1;
        ax[i] = (signed char)e->via.u64;
    }
    *n = (int)v->via.array.size;
    return 0;
}

static int parse_options(pb_call_t *c, const msgpack_object *opts, pb_err_t *err)
{
    const pb_op_t *op = c->op;
    if (opts == NULL)
        return 0;
    if (opts->type != MSGPACK_OBJECT_MAP)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "options", "options must be a map");
    for (uint32_t i = 0; i < opts->via.map.size; i++) {
        const msgpack_object *k = &opts->via.map.ptr[i].key, *v = &opts->via.map.ptr[i].val;
        int idx = k->type == MSGPACK_OBJECT_STR ? pb_op_option_index(op, k->via.str.ptr, k->via.str.size) : -1;
        if (idx < 0)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "options", "%s has no option '%s'", op->name,
                              key_text(PB_QUOTED, k));
        const pb_opt_spec_t *sp = &op->options[idx];
        pb_optval_t *ov = &c->opt[idx];
        char arg[64];
        join(arg, sizeof arg, "options.", sp->name);
        if (ov->given)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "option %s given twice", sp->name);
        ov->given = true;
        switch (sp->type) {
        case PB_OPT_STR: {
            bool found = false;
            if (v->type == MSGPACK_OBJECT_STR && sp->values) {
                for (int j = 0; sp->values[j] && !found; j++)
                    if (pb__obj_is_str(v, sp->values[j])) {
                        ov->index = j;
                        found = true;
                    }
            }
            if (!found) {
                char list[256] = "";
                size_t o = 0;
                for (int j = 0; sp->values && sp->values[j] && o < sizeof list; j++)
                    o += (size_t)snprintf(list + o, sizeof list - o, "%s%s", j ? ", " : "", sp->values[j]);
                return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "%s must be one of: %s", sp->name, list);
            }
            break;
        }
        case PB_OPT_BOOL:
            if (v->type != MSGPACK_OBJECT_BOOLEAN)
                return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "%s must be true or false", sp->name);
            ov->b = v->via.boolean;
            break;
        case PB_OPT_INT:
            if (v->type == MSGPACK_OBJECT_POSITIVE_INTEGER && v->via.u64 <= INT64_MAX)
                ov->i = (long long)v->via.u64;
            else if (v->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
                ov->i = v->via.i64;
            else
                return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "%s must be an integer from -2^63 to 2^63-1",
                                  sp->name);
            break;
        case PB_OPT_FLOAT:
            if (!pb__obj_number(v, &ov->re))
                return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "%s must be a number", sp->name);
            break;
        case PB_OPT_SCALAR:
            ov->im = 0;
            if (pb__obj_number(v, &ov->re))
                break;
            if (v->type == MSGPACK_OBJECT_ARRAY && v->via.array.size == 2 &&
                pb__obj_number(&v->via.array.ptr[0], &ov->re) && pb__obj_number(&v->via.array.ptr[1], &ov->im)) {
                ov->cplx = true;
                break;
            }
            return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "%s must be a number or [re, im]", sp->name);
        case PB_OPT_AXES:
            if (parse_axes(v, &ov->nax[0], ov->ax[0]))
                return pb_err_set(err, PB_EINVALID_ARGUMENT, arg,
                                  "%s must be a list of at most 16 axis numbers 0..15", sp->name);
            break;
        case PB_OPT_AXES2:
            if (v->type != MSGPACK_OBJECT_ARRAY || v->via.array.size != 2 ||
                parse_axes(&v->via.array.ptr[0], &ov->nax[0], ov->ax[0]) ||
                parse_axes(&v->via.array.ptr[1], &ov->nax[1], ov->ax[1]))
                return pb_err_set(err, PB_EINVALID_ARGUMENT, arg,
                                  "%s must be two lists of axis numbers 0..15, as [[0, 2], [1]]", sp->name);
            break;
        case PB_OPT_TEXT:
            if (v->type != MSGPACK_OBJECT_STR || v->via.str.size > PB_OPT_TEXT_MAX)
                return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "%s must be a string of at most %d bytes",
                                  sp->name, PB_OPT_TEXT_MAX);
            /* Kept NUL-terminated: a NUL inside would cut it short unseen. */
            if (memchr(v->via.str.ptr, 0, v->via.str.size) || !pb_utf8_valid(v->via.str.ptr, v->via.str.size))
                return pb_err_set(err, PB_EINVALID_ARGUMENT, arg, "%s must be UTF-8 text without NUL bytes, got '%s'",
                                  sp->name, key_text(PB_QUOTED, v));
            memcpy(ov->text, v->via.str.ptr, v->via.str.size);
            ov->text[v->via.str.size] = 0;
            break;
        }
    }
    return 0;
}

static int parse_wrt(pb_call_t *c, const msgpack_object *w, pb_err_t *err)
{
    const pb_op_t *op = c->op;
    if (w == NULL)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "wrt", "missing wrt (the inputs whose gradients reverse will want)");
    if (w->type != MSGPACK_OBJECT_ARRAY)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "wrt", "wrt must be an array of input names");
    for (uint32_t i = 0; i < w->via.array.size; i++) {
        const msgpack_object *n = &w->via.array.ptr[i];
        int k = n->type == MSGPACK_OBJECT_STR ? pb_op_wrt_index(op, n->via.str.ptr, n->via.str.size) : -1;
        if (k < 0) {
            char names[200];
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "wrt",
                              "wrt[%u] '%s' is not a differentiable input of %s (those are: %s)", i,
                              key_text(PB_QUOTED, n), op->name, join_names(op->wrt_names, op->nwrt, names,
                                                                           sizeof names));
        }
        if (c->wrt & (1u << k))
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "wrt", "wrt names %s twice", op->wrt_names[k]);
        if (k < op->ninputs && c->in[k].storage == NULL)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "wrt", "wrt names %s, which was not given in inputs",
                              op->wrt_names[k]);
        c->wrt |= 1u << k;
    }
    return 0;
}

int pb_request_accumulate(const msgpack_object *params, bool *acc, pb_err_t *err)
{
    const msgpack_object *a = pb__obj_get(params, "accumulate");
    *acc = false;
    if (a == NULL)
        return 0;
    if (a->type != MSGPACK_OBJECT_BOOLEAN)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "accumulate", "accumulate must be true or false");
    *acc = a->via.boolean;
    return 0;
}

void pb_into_clear(pb_into_t *v, int n)
{
    for (int i = 0; i < n; i++) {
        pb_storage_unref(v[i].storage);
        memset(&v[i], 0, sizeof v[i]);
    }
}

int pb_request_into(const msgpack_object *into, const pb_resolver_t *res, const char *const *names, int n,
                    unsigned avail, const pb_tensor_t *meta, const char *of, pb_into_t *out, pb_err_t *err)
{
    if (into == NULL)
        return 0;
    if (into->type != MSGPACK_OBJECT_MAP)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "into", "into must be a map from %s names to {buffer, offset}",
                          of);
    for (uint32_t i = 0; i < into->via.map.size; i++) {
        const msgpack_object *k = &into->via.map.ptr[i].key, *v = &into->via.map.ptr[i].val;
        int idx = -1;
        for (int j = 0; j < n && idx < 0 && k->type == MSGPACK_OBJECT_STR; j++)
            if (pb__obj_is_str(k, names[j]))
                idx = j;
        if (idx < 0)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "into", "into names '%s', which is no %s here",
                              key_text(PB_QUOTED, k), of);
        if (!(avail & (1u << idx)))
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "into",
                              "into names %s, but no %s %s comes back here (not in the tape's wrt)", names[idx], of,
                              names[idx]);
        char what[64];
        join(what, sizeof what, "into.", names[idx]);
        if (out[idx].storage)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s given twice", what);
        if (v->type != MSGPACK_OBJECT_MAP)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s must be {buffer, offset}", what);
        for (uint32_t j = 0; j < v->via.map.size; j++) {
            const msgpack_object *vk = &v->via.map.ptr[j].key;
            if (!pb__obj_is_str(vk, "buffer") && !pb__obj_is_str(vk, "offset"))
                return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s must be {buffer, offset}, nothing else", what);
        }
        size_t room;
        if (!pb_shape_count(meta[idx].rank, meta[idx].shape, pb_dtype_size(meta[idx].dtype), NULL, &room))
            return pb_err_set(err, PB_EINTERNAL, what, "%s: the result's size overflows", what);
        pb_into_t t = {0};
        int rc = pb_buffer_view(res, pb__obj_get(v, "buffer"), pb__obj_get(v, "offset"), room,
                                pb_dtype_size(meta[idx].dtype), true, what, &t.storage, &t.offset, &t.buffer, err);
        if (rc)
            return rc;
        t.room = room;
        out[idx] = t;
    }
    /* Two results written over each other would leave whichever came
     * last: refuse it rather than define an order.  Two buffers over one
     * file (a memfd registered twice) are the same bytes. */
    for (int a = 0; a < n; a++)
        for (int b = a + 1; b < n; b++) {
            const pb_into_t *x = &out[a], *y = &out[b];
            if (!pb_shm_same_file(x->storage, y->storage) || !x->room || !y->room ||
                x->offset >= y->offset + y->room || y->offset >= x->offset + x->room)
                continue;
            if (x->buffer == y->buffer)
                return pb_err_set(err, PB_EINVALID_ARGUMENT, "into", "into.%s and into.%s overlap in buffer %llu",
                                  names[a], names[b], (unsigned long long)x->buffer);
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "into",
                              "into.%s and into.%s overlap: buffers %llu and %llu map the same file", names[a],
                              names[b], (unsigned long long)x->buffer, (unsigned long long)y->buffer);
        }
    return 0;
}

/* One body for the real component types: complex values add as their
 * (re, im) pairs. */
#define ADD_INTO(T, dst, src, bytes)                                                                                  \
    do {                                                                                                               \
        T *d_ = (T *)(dst);                                                                                            \
        const T *s_ = (const T *)(src);                                                                                \
        size_t n_ = (bytes) / sizeof(T);                                                                               \
        for (size_t i_ = 0; i_ < n_; i_++)                                                                             \
            d_[i_] += s_[i_];                                                                                          \
    } while (0)

/* Accumulating stores are read-add-writes: two at once into the same bytes
 * (pipelined reverses on two workers, or two connections over one memfd)
 * would lose one's additions.  A lock per 1 MiB of a file (striped, by
 * the file and the offset in it: every registration maps a file from its
 * start), taken one chunk at a time, so that stores into disjoint parts of
 * one buffer (data-parallel gradients) run at once.  A chunk boundary is a
 * multiple of every element size: no element straddles two. */
#define ACC_STRIPES 64
#define ACC_CHUNK ((size_t)1 << 20)
static pthread_mutex_t acc_locks[ACC_STRIPES] = {[0 ... ACC_STRIPES - 1] = PTHREAD_MUTEX_INITIALIZER};

/* Device accumulations into GPU buffers, one at a time: two requests'
 * sums into one buffer must not interleave, and the host path's stripe
 * locks do not cover work that runs on a stream. */
static pthread_mutex_t device_acc_lock = PTHREAD_MUTEX_INITIALIZER;

/* pb_into_store for a target in a GPU buffer, on a worker of its GPU: the
 * result copied in, or added on the device. */
static int into_device(const pb_into_t *in, const pb_tensor_t *t, bool accumulate, pb_err_t *err)
{
    int dev = in->storage->device.index, rc;
    char *dst = (char *)in->storage->ptr + in->offset;
    size_t bytes = pb_tensor_bytes(t);
    if (!accumulate) {
        rc = pb_gpu->h2d(dst, pb_tensor_data(t), bytes);
        if (rc == 0)
            rc = pb_gpu->sync();
    } else {
        void *tmp = NULL;
        rc = pb_gpu->alloc(dev, bytes, &tmp);
        if (rc == 0)
            rc = pb_gpu->h2d(tmp, pb_tensor_data(t), bytes);
        pb_gpu_loop_t L = {.rank = 1, .dim = {pb_tensor_count(t)}, .s = {{1}, {1}, {0}}};
        double one[2] = {1, 0}, zero[2] = {0, 0};
        pthread_mutex_lock(&device_acc_lock);
        if (rc == 0)
            rc = pb_gpu->strided((int)t->dtype, &L, dst, tmp, 0, one, NULL, zero, 1);
        if (rc == 0)
            rc = pb_gpu->sync();
        pthread_mutex_unlock(&device_acc_lock);
        pb_gpu->free(dev, tmp);
    }
    return rc ? pb_gpu_fail(err, rc, dev, "storing a result into a GPU buffer") : 0;
}

int pb_into_store(const pb_into_t *in, const pb_tensor_t *t, bool accumulate, pb_err_t *err)
{
    size_t bytes = pb_tensor_bytes(t);
    if (bytes > in->room)
        return pb_err_set(err, PB_EINTERNAL, NULL, "a result of %zu bytes is larger than the %zu checked in buffer %llu",
                          bytes, in->room, (unsigned long long)in->buffer);
    if (bytes == 0)
        return 0;
    if (in->storage->device.kind == PB_DEV_CUDA)
        return into_device(in, t, accumulate, err);
    char *dst = (char *)in->storage->ptr + in->offset;
    const void *src = pb_tensor_data(t);
    if (!accumulate) {
        memmove(dst, src, bytes); /* a result never aliases a buffer, but memmove costs nothing more */
        return 0;
    }
    uint64_t key = pb_shm_file_key(in->storage);
    bool single = t->dtype == PB_F32 || t->dtype == PB_C64;
    for (size_t done = 0; done < bytes;) {
        size_t at = in->offset + done, room = ACC_CHUNK - at % ACC_CHUNK;
        size_t n = room < bytes - done ? room : bytes - done;
        uint64_t h = (key ^ key >> 29) + at / ACC_CHUNK * 0x9e3779b97f4a7c15ull;
        pthread_mutex_t *lk = &acc_locks[(h ^ h >> 32) % ACC_STRIPES];
        pthread_mutex_lock(lk);
        if (single)
            ADD_INTO(float, dst + done, (const char *)src + done, n);
        else
            ADD_INTO(double, dst + done, (const char *)src + done, n);
        pthread_mutex_unlock(lk);
        done += n;
    }
    return 0;
}

int pb_request_on_device(const pb_storage_t *s, pb_device_t dev, const char *what, pb_err_t *err)
{
    if (s == NULL || s->kind != PB_STORAGE_SHM || s->device.kind != PB_DEV_CUDA ||
        (dev.kind == PB_DEV_CUDA && dev.index == s->device.index))
        return 0;
    char on[16];
    if (dev.kind == PB_DEV_CUDA)
        snprintf(on, sizeof on, "cuda:%d", dev.index);
    else
        snprintf(on, sizeof on, "cpu");
    return pb_err_set(err, PB_EINVALID_ARGUMENT, what,
                      "%s lies in buffer %llu, cuda:%d's memory, and this runs on %s: a GPU buffer serves calls on "
                      "its own GPU",
                      what, (unsigned long long)pb_shm_id(s), s->device.index, on);
}

int pb_request_call(const pb_config_t *cfg, const msgpack_object *params, pb_storage_t *msg, const pb_resolver_t *res,
                    pb_call_kind_t kind, pb_call_t *c, pb_call_extra_t *x, pb_err_t *err)
{
    static const char *const k_fwd[] = {"op", "inputs", "options", "device", "order", "into", "accumulate", NULL};
    static const char *const k_aug[] = {"op",    "inputs", "options", "device",     "order", "into",
                                        "accumulate", "wrt", "scope", "ttl_s", NULL};
    static const char *const k_chk[] = {"op", "inputs", "options", "device", "wrt", "seed", NULL};
    int rc = pb_request_check_keys(params, kind == PB_CALL_FORWARD ? k_fwd : kind == PB_CALL_AUGMENTED ? k_aug : k_chk, err);
    if (rc)
        return rc;
    const msgpack_object *opn = pb__obj_get(params, "op");
    if (opn == NULL || opn->type != MSGPACK_OBJECT_STR)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "op", "op must be the name of an op (see the ops method)");
    c->op = pb_op_find(opn->via.str.ptr, opn->via.str.size);
    if (c->op == NULL)
        return pb_err_set(err, PB_EUNKNOWN_OP, "op", "unknown op '%s' (see the ops method)", key_text(PB_QUOTED, opn));
    const pb_op_t *op = c->op;

    const msgpack_object *in = pb__obj_get(params, "inputs");
    if (in == NULL || in->type != MSGPACK_OBJECT_MAP)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "inputs", "inputs must be a map from input names to tensors");
    for (uint32_t i = 0; i < in->via.map.size; i++) {
        const msgpack_object *k = &in->via.map.ptr[i].key;
        int idx = k->type == MSGPACK_OBJECT_STR ? pb_op_input_index(op, k->via.str.ptr, k->via.str.size) : -1;
        if (idx < 0)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "inputs", "%s has no input '%s'", op->name,
                              key_text(PB_QUOTED, k));
        char what[64];
        join(what, sizeof what, "inputs.", op->inputs[idx].name);
        if (c->in[idx].storage)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "input %s given twice", op->inputs[idx].name);
        if ((rc = pb_tensor_decode_with(&in->via.map.ptr[i].val, msg, res, what, &c->in[idx], err)))
            return rc;
    }
    int first = -1;
    for (int i = 0; i < op->ninputs; i++) {
        char what[64];
        join(what, sizeof what, "inputs.", op->inputs[i].name);
        if (c->in[i].storage == NULL) {
            if (op->inputs[i].required)
                return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "missing required input %s of %s",
                                  op->inputs[i].name, op->name);
            continue;
        }
        if (!(op->dtypes & PB_DTYPE_BIT(c->in[i].dtype)))
            return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "%s does not take dtype %s (input %s)", op->name,
                              pb_dtype_name(c->in[i].dtype), op->inputs[i].name);
        if (first < 0)
            first = i;
        else if (c->in[i].dtype != c->in[first].dtype)
            return pb_err_set(err, PB_EDTYPE_MISMATCH, what, "input %s is %s but %s is %s", op->inputs[i].name,
                              pb_dtype_name(c->in[i].dtype), op->inputs[first].name,
                              pb_dtype_name(c->in[first].dtype));
    }
    c->dtype = c->in[first].dtype;

    if ((rc = parse_options(c, pb__obj_get(params, "options"), err)))
        return rc;
    pb_call_defaults(c);
    for (int i = 0; i < op->noptions; i++) {
        char arg[64];
        join(arg, sizeof arg, "options.", op->options[i].name);
        if (op->options[i].type == PB_OPT_SCALAR && c->opt[i].im != 0 && !pb_dtype_is_complex(c->dtype))
            return pb_err_set(err, PB_EINVALID_ARGUMENT, arg,
                              "%s has a nonzero imaginary part but the inputs are real (%s)", op->options[i].name,
                              pb_dtype_name(c->dtype));
    }

    if ((rc = pb_request_device(params, cfg->device, &c->device, err)))
        return rc;
    if (!(op->devices & (1u << c->device.kind)))
        return pb_err_set(err, PB_EDEVICE_UNAVAILABLE, "device", "%s has no implementation on this device",
                          op->name);
    for (int i = 0; i < op->ninputs; i++) {
        char what[64];
        join(what, sizeof what, "inputs.", op->inputs[i].name);
        if ((rc = pb_request_on_device(c->in[i].storage, c->device, what, err)))
            return rc;
        const pb_storage_t *s = c->in[i].storage;
        if (kind == PB_CALL_CHECK && s && s->device.kind == PB_DEV_CUDA)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, what,
                              "%s lies in a GPU buffer: check steps its inputs on the host, so it takes them inline "
                              "or in host buffers",
                              what);
    }

    if ((rc = pb_request_order(params, &c->order, err)))
        return rc;
    if (kind != PB_CALL_FORWARD && (rc = parse_wrt(c, pb__obj_get(params, "wrt"), err)))
        return rc;
    c->taped = kind != PB_CALL_FORWARD;
    if (kind != PB_CALL_CHECK) {
        bool acc;
        if ((rc = pb_request_accumulate(params, &acc, err)))
            return rc;
        if (acc)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "accumulate",
                              "accumulate is reverse's (gradients added into their into buffers); the outputs of %s "
                              "always replace what their into buffer held",
                              kind == PB_CALL_FORWARD ? "forward" : "augmented_forward");
    }
    if ((rc = op->validate(c, err)))
        return rc;
    if (kind != PB_CALL_CHECK &&
        (rc = pb_request_into(pb__obj_get(params, "into"), res, op->outputs, op->noutputs, (1u << op->noutputs) - 1,
                              c->out_meta, "output", x->into, err)))
        return rc;
    for (int i = 0; i < op->noutputs; i++) {
        char what[64];
        join(what, sizeof what, "into.", op->outputs[i]);
        if ((rc = pb_request_on_device(x->into[i].storage, c->device, what, err)))
            return rc;
    }
    size_t total = 0;
    for (int i = 0; i < op->noutputs; i++) {
        size_t b;
        if (x->into[i].storage)
            continue;
        pb_shape_count(c->out_meta[i].rank, c->out_meta[i].shape, pb_dtype_size(c->out_meta[i].dtype), NULL, &b);
        total += b;
    }
    if (total > cfg->max_message_bytes)
        return pb_err_set(err, PB_ERESOURCE_EXHAUSTED, "max_message_bytes",
                          "the outputs would take %zu bytes, more than max_message_bytes %zu", total,
                          cfg->max_message_bytes);
    x->reply_bytes = total;

    if (kind == PB_CALL_AUGMENTED) {
        const msgpack_object *sc = pb__obj_get(params, "scope"), *ttl = pb__obj_get(params, "ttl_s");
        if (sc && pb__obj_is_str(sc, "peer"))
            x->peer_scope = true;
        else if (sc && !pb__obj_is_str(sc, "connection"))
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "scope", "scope must be \"connection\" or \"peer\"");
        x->ttl_ms = DEFAULT_TTL_MS;
        if (ttl) {
            double v;
            if (!pb__obj_number(ttl, &v) || !(v > 0) || v > MAX_TTL_S)
                return pb_err_set(err, PB_EINVALID_ARGUMENT, "ttl_s",
                                  "ttl_s must be a number of seconds > 0 and at most %.0f", MAX_TTL_S);
            x->ttl_ms = (uint64_t)(v * 1000.0 + 0.5);
            if (x->ttl_ms == 0)
                x->ttl_ms = 1;
        }
    }
    if (kind == PB_CALL_CHECK) {
        const msgpack_object *sd = pb__obj_get(params, "seed");
        if (sd && !pb__obj_uint(sd, &x->seed))
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "seed", "seed must be a non-negative integer");
    }
    return 0;
}

int pb_request_cotangents(const pb_tapedata_t *t, const msgpack_object *cots, pb_storage_t *msg,
                          const pb_resolver_t *res, pb_tensor_t *cot, pb_err_t *err)
{
    const pb_op_t *op = t->op;
    if (cots == NULL)
        return 0;
    if (cots->type != MSGPACK_OBJECT_MAP)
        return pb_err_set(err, PB_EINVALID_ARGUMENT, "cotangents", "cotangents must be a map from output names to tensors");
    for (uint32_t i = 0; i < cots->via.map.size; i++) {
        const msgpack_object *k = &cots->via.map.ptr[i].key;
        int idx = k->type == MSGPACK_OBJECT_STR ? pb_op_output_index(op, k->via.str.ptr, k->via.str.size) : -1;
        if (idx < 0)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, "cotangents", "%s has no output '%s'", op->name,
                              key_text(PB_QUOTED, k));
        char what[64];
        join(what, sizeof what, "cotangents.", op->outputs[idx]);
        if (cot[idx].storage)
            return pb_err_set(err, PB_EINVALID_ARGUMENT, what, "cotangent %s given twice", op->outputs[idx]);
        int rc = pb_tensor_decode_with(&cots->via.map.ptr[i].val, msg, res, what, &cot[idx], err);
        if (rc)
            return rc;
        const pb_tensor_t *m = &t->out_meta[idx];
        char s1[96], s2[96];
        if (cot[idx].dtype != m->dtype)
            return pb_err_set(err, PB_EDTYPE_MISMATCH, what, "cotangent %s is %s but output %s is %s",
                              op->outputs[idx], pb_dtype_name(cot[idx].dtype), op->outputs[idx],
                              pb_dtype_name(m->dtype));
        if (!pb_tensor_same_shape(&cot[idx], m))
            return pb_err_set(err, PB_ESHAPE_MISMATCH, what, "cotangent %s has shape %s but output %s has shape %s",
                              op->outputs[idx], pb_shape_str(&cot[idx], s1, sizeof s1), op->outputs[idx],
                              pb_shape_str(m, s2, sizeof s2));
    }
    return 0;
}
