/* unit.client: the parts of the C client library that need no daemon.
 *
 * Object helpers and tensors are checked on msgpack built in memory; the
 * socket path chain through setenv/unsetenv; framing, the reply queue and
 * the request encoding over a socketpair whose other end plays the daemon
 * with hand-made msgpack-RPC messages. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pullbackd.h"

/* ---- helpers ----------------------------------------------------------- */

/* Allocations fail on demand: this program links with --wrap=malloc and
 * --wrap=realloc, so the calls of the client library (and of this file, not
 * of msgpack-c's shared library) come here.  A malloc of fail_lo bytes or
 * more and less than fail_hi fails, and so does every realloc while
 * realloc_fails. */
static size_t fail_lo, fail_hi;
static bool realloc_fails;
void *__real_malloc(size_t n);
void *__real_realloc(void *p, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_realloc(void *p, size_t n);

void *__wrap_malloc(size_t n)
{
    return n >= fail_lo && n < fail_hi ? NULL : __real_malloc(n);
}

void *__wrap_realloc(void *p, size_t n)
{
    return realloc_fails ? NULL : __real_realloc(p, n);
}

static void malloc_fails(size_t lo, size_t hi)
{
    fail_lo = lo;
    fail_hi = hi;
}

static void pk_str(msgpack_packer *pk, const char *s)
{
    msgpack_pack_str(pk, strlen(s));
    msgpack_pack_str_body(pk, s, strlen(s));
}

static void write_all(int fd, const void *p, size_t n)
{
    const char *q = p;
    while (n > 0) {
        ssize_t w = write(fd, q, n);
        if (w < 0 && errno == EINTR)
            continue;
        assert_true(w > 0);
        q += w;
        n -= (size_t)w;
    }
}

/* Append [1, msgid, nil, {"n": n}] to sb. */
static void pack_ok(msgpack_sbuffer *sb, uint32_t msgid, int64_t n)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 4);
    msgpack_pack_int(&pk, 1);
    msgpack_pack_uint32(&pk, msgid);
    msgpack_pack_nil(&pk);
    msgpack_pack_map(&pk, 1);
    pk_str(&pk, "n");
    msgpack_pack_int64(&pk, n);
}

/* Append [1, msgid, {"code": code, "message": msg}, nil] to sb. */
static void pack_err(msgpack_sbuffer *sb, uint32_t msgid, const char *code, const char *msg)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 4);
    msgpack_pack_int(&pk, 1);
    msgpack_pack_uint32(&pk, msgid);
    msgpack_pack_map(&pk, 2);
    pk_str(&pk, "code");
    pk_str(&pk, code);
    pk_str(&pk, "message");
    pk_str(&pk, msg);
    msgpack_pack_nil(&pk);
}

static int64_t reply_n(const pb_reply_t *r)
{
    int64_t n = -1;
    assert_null(r->error);
    assert_non_null(r->result);
    assert_int_equal(pb_obj_int(pb_obj_get(r->result, "n"), &n), 0);
    return n;
}

/* A client on one end of a socketpair; *peer gets the other end. */
static pb_client_t *pair_client(int *peer)
{
    int sv[2];
    pb_client_t *c = NULL;
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    assert_int_equal(pb_client_from_fd(sv[0], &c), 0);
    assert_int_equal(pb_client_fd(c), sv[0]);
    *peer = sv[1];
    return c;
}

/* Read one whole msgpack object the client sent from fd. */
static void read_message(int fd, msgpack_unpacker *u, msgpack_unpacked *up)
{
    for (;;) {
        if (msgpack_unpacker_next(u, up) == MSGPACK_UNPACK_SUCCESS)
            return;
        assert_true(msgpack_unpacker_reserve_buffer(u, 4096));
        ssize_t r = read(fd, msgpack_unpacker_buffer(u), msgpack_unpacker_buffer_capacity(u));
        assert_true(r > 0);
        msgpack_unpacker_buffer_consumed(u, (size_t)r);
    }
}

/* Bytes the client has written that peer can read now. */
static size_t drain(int peer)
{
    char buf[65536];
    size_t total = 0;
    ssize_t n;
    while ((n = recv(peer, buf, sizeof buf, MSG_DONTWAIT)) > 0)
        total += (size_t)n;
    assert_true(n == 0 || errno == EAGAIN || errno == EWOULDBLOCK);
    return total;
}

/* c still works and sent nothing since the last message peer read: a
 * hello sent now is the next message there. */
static void hello_is_next(pb_client_t *c, int peer)
{
    msgpack_unpacker u;
    msgpack_unpacked up;
    uint32_t id = 0;

    msgpack_packer *pk = pb_client_begin(c, "hello");
    msgpack_pack_map(pk, 0);
    assert_int_equal(pb_client_send(c, &id), 0);
    assert_true(msgpack_unpacker_init(&u, 4096));
    msgpack_unpacked_init(&up);
    read_message(peer, &u, &up);
    assert_int_equal(up.data.type, MSGPACK_OBJECT_ARRAY);
    assert_int_equal(up.data.via.array.size, 4);
    assert_int_equal(pb_obj_strcmp(&up.data.via.array.ptr[2], "hello"), 0);
    msgpack_unpacked_destroy(&up);
    msgpack_unpacker_destroy(&u);
}

/* ---- object helpers ---------------------------------------------------- */

static void test_obj_path(void **state)
{
    (void)state;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);

    /* {"outputs": {"y": 7, "z": -3}, "devices": [{"name": "cpu"}, {"name": "cuda:0"}],
     *  "f": 2.5, "big": 2^64-1, "t": true} */
    msgpack_pack_map(&pk, 5);
    pk_str(&pk, "outputs");
    msgpack_pack_map(&pk, 2);
    pk_str(&pk, "y");
    msgpack_pack_int(&pk, 7);
    pk_str(&pk, "z");
    msgpack_pack_int(&pk, -3);
    pk_str(&pk, "devices");
    msgpack_pack_array(&pk, 2);
    msgpack_pack_map(&pk, 1);
    pk_str(&pk, "name");
    pk_str(&pk, "cpu");
    msgpack_pack_map(&pk, 1);
    pk_str(&pk, "name");
    pk_str(&pk, "cuda:0");
    pk_str(&pk, "f");
    msgpack_pack_double(&pk, 2.5);
    pk_str(&pk, "big");
    msgpack_pack_uint64(&pk, UINT64_MAX);
    pk_str(&pk, "t");
    msgpack_pack_true(&pk);

    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    assert_int_equal(msgpack_unpack_next(&up, sb.data, sb.size, NULL), MSGPACK_UNPACK_SUCCESS);
    const msgpack_object *root = &up.data;
    int64_t i;
    uint64_t u;
    double d;
    bool b;

    assert_ptr_equal(pb_obj_path(root, ""), root);
    assert_int_equal(pb_obj_int(pb_obj_path(root, "outputs.y"), &i), 0);
    assert_int_equal(i, 7);
    assert_int_equal(pb_obj_int(pb_obj_path(root, "outputs.z"), &i), 0);
    assert_int_equal(i, -3);
    assert_int_equal(pb_obj_uint(pb_obj_path(root, "outputs.z"), &u), -ERANGE);
    assert_ptr_equal(pb_obj_path(root, "outputs"), pb_obj_get(root, "outputs"));
    assert_int_equal(pb_obj_strcmp(pb_obj_path(root, "devices.1.name"), "cuda:0"), 0);
    assert_int_equal(pb_obj_strcmp(pb_obj_path(root, "devices.0.name"), "cpu"), 0);
    assert_true(pb_obj_strcmp(pb_obj_path(root, "devices.0.name"), "cp") > 0);
    assert_true(pb_obj_strcmp(pb_obj_path(root, "devices.0.name"), "cpux") < 0);
    assert_int_not_equal(pb_obj_strcmp(pb_obj_path(root, "outputs.y"), "7"), 0);
    assert_null(pb_obj_path(root, "devices.2.name"));
    assert_null(pb_obj_path(root, "devices.x"));
    assert_null(pb_obj_path(root, "outputs.y.z"));
    assert_null(pb_obj_path(root, "outputs.w"));
    assert_null(pb_obj_path(root, "output"));
    assert_null(pb_obj_path(root, "outputs."));
    assert_null(pb_obj_path(NULL, "outputs"));
    assert_null(pb_obj_get(pb_obj_path(root, "devices"), "name"));

    assert_int_equal(pb_obj_double(pb_obj_get(root, "f"), &d), 0);
    assert_true(d == 2.5);
    assert_int_equal(pb_obj_double(pb_obj_path(root, "outputs.z"), &d), 0);
    assert_true(d == -3.0);
    assert_int_equal(pb_obj_double(pb_obj_get(root, "t"), &d), -EINVAL);
    assert_int_equal(pb_obj_int(pb_obj_get(root, "big"), &i), -ERANGE);
    assert_int_equal(pb_obj_uint(pb_obj_get(root, "big"), &u), 0);
    assert_true(u == UINT64_MAX);
    assert_int_equal(pb_obj_int(pb_obj_get(root, "f"), &i), -EINVAL);
    assert_int_equal(pb_obj_bool(pb_obj_get(root, "t"), &b), 0);
    assert_true(b);
    assert_int_equal(pb_obj_int(NULL, &i), -EINVAL);

    msgpack_unpacked_destroy(&up);
    msgpack_sbuffer_destroy(&sb);
}

/* An empty str: msgpack-c unpacks it with a NULL ptr, which must not reach
 * memcmp (UBSan's nonnull check catches it under build-asan). */
static void test_obj_empty_str(void **state)
{
    (void)state;
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    assert_int_equal(msgpack_unpack_next(&up, "\xa0", 1, NULL), MSGPACK_UNPACK_SUCCESS);
    assert_int_equal(up.data.type, MSGPACK_OBJECT_STR);
    assert_int_equal(pb_obj_strcmp(&up.data, ""), 0);
    assert_true(pb_obj_strcmp(&up.data, "abc") < 0);

    msgpack_object o = { .type = MSGPACK_OBJECT_STR, .via.str = { .size = 0, .ptr = NULL } };
    assert_int_equal(pb_obj_strcmp(&o, ""), 0);
    assert_true(pb_obj_strcmp(&o, "x") < 0);
    msgpack_object_kv kv = { o, o };
    msgpack_object m = { .type = MSGPACK_OBJECT_MAP, .via.map = { .size = 1, .ptr = &kv } };
    assert_ptr_equal(pb_obj_get(&m, ""), &kv.val);
    msgpack_unpacked_destroy(&up);
}

/* ---- tensors ----------------------------------------------------------- */

/* Pack t after `pad` bytes of a str (to move the bin off alignment) and read
 * it back. */
static int tensor_roundtrip(const pb_ctensor_t *t, size_t pad, msgpack_unpacked *up, pb_ctensor_t *out)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    char padding[16] = { 0 };
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 2);
    msgpack_pack_str(&pk, pad);
    msgpack_pack_str_body(&pk, padding, pad);
    pb_pack_tensor(&pk, t);
    /* msgpack_unpack_next references the buffer: keep a copy alive in the
     * zone's lifetime by handing over the sbuffer's bytes. */
    msgpack_unpacked_init(up);
    size_t off = 0;
    assert_int_equal(msgpack_unpack_next(up, sb.data, sb.size, &off), MSGPACK_UNPACK_SUCCESS);
    assert_int_equal(off, sb.size);
    msgpack_zone_push_finalizer(up->zone, free, msgpack_sbuffer_release(&sb));
    return pb_obj_tensor(&up->data.via.array.ptr[1], out);
}

/* pb_pack_into: the key and {name: {buffer, offset}} per target. */
static void test_pack_into(void **state)
{
    (void)state;
    const pb_into_t into[2] = {{"y", 3, 0}, {"weight", 3, 1u << 20}};
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 1);
    pb_pack_into(&pk, into, 2);
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    assert_int_equal(msgpack_unpack_next(&up, sb.data, sb.size, &off), MSGPACK_UNPACK_SUCCESS);
    assert_int_equal(off, sb.size);
    const msgpack_object *m = pb_obj_get(&up.data, "into");
    assert_non_null(m);
    assert_int_equal(m->type, MSGPACK_OBJECT_MAP);
    assert_int_equal(m->via.map.size, 2);
    for (int i = 0; i < 2; i++) {
        const msgpack_object *t = pb_obj_get(m, into[i].name);
        uint64_t b = 0, o = 0;
        assert_non_null(t);
        assert_int_equal(t->via.map.size, 2);
        assert_int_equal(pb_obj_uint(pb_obj_get(t, "buffer"), &b), 0);
        assert_int_equal(pb_obj_uint(pb_obj_get(t, "offset"), &o), 0);
        assert_int_equal(b, into[i].buffer);
        assert_int_equal(o, into[i].offset);
    }
    msgpack_unpacked_destroy(&up);
    msgpack_sbuffer_destroy(&sb);
}

static void test_tensor_roundtrip(void **state)
{
    (void)state;
    msgpack_unpacked up;
    pb_ctensor_t t = { 0 }, g;

    /* f32 2x3, C order, data at an odd offset in the message. */
    const float v32[6] = { 1.5f, -2.0f, 3.25f, 0.0f, -0.0f, 1e-30f };
    t.dtype = "f32";
    t.rank = 2;
    t.shape[0] = 2;
    t.shape[1] = 3;
    t.order = 'C';
    t.data = v32;
    t.nbytes = sizeof v32;
    for (size_t pad = 0; pad < 4; pad++) {
        assert_int_equal(tensor_roundtrip(&t, pad, &up, &g), 0);
        assert_string_equal(g.dtype, "f32");
        assert_int_equal(g.rank, 2);
        assert_int_equal(g.shape[0], 2);
        assert_int_equal(g.shape[1], 3);
        assert_int_equal(g.order, 'C');
        assert_false(g.shm);
        assert_int_equal(g.nbytes, sizeof v32);
        assert_int_equal(pb_ctensor_count(&g), 6);
        assert_memory_equal(g.data, v32, sizeof v32);
        float f[6];
        double d[6];
        assert_int_equal(pb_ctensor_copy_f32(&g, f, 6), 0);
        assert_memory_equal(f, v32, sizeof v32);
        assert_int_equal(pb_ctensor_copy_f64(&g, d, 6), 0);
        for (int k = 0; k < 6; k++)
            assert_true(d[k] == (double)v32[k]);
        assert_int_equal(pb_ctensor_copy_f64(&g, d, 5), -ENOBUFS);
        msgpack_unpacked_destroy(&up);
    }

    /* f64 in F order. */
    const double v64[6] = { 1.0, 2.0, 3.0, 4.0, 5.0, 6.0 };
    t.dtype = "f64";
    t.order = 'F';
    t.shape[0] = 3;
    t.shape[1] = 2;
    t.data = v64;
    t.nbytes = sizeof v64;
    assert_int_equal(tensor_roundtrip(&t, 1, &up, &g), 0);
    assert_string_equal(g.dtype, "f64");
    assert_int_equal(g.order, 'F');
    assert_int_equal(g.shape[0], 3);
    double d6[6];
    float f6[6];
    assert_int_equal(pb_ctensor_copy_f64(&g, d6, 6), 0);
    assert_memory_equal(d6, v64, sizeof v64);
    assert_int_equal(pb_ctensor_copy_f32(&g, f6, 6), 0);
    assert_true(f6[5] == 6.0f);
    msgpack_unpacked_destroy(&up);

    /* c64 vector: two complex values take four slots. */
    const float vc[4] = { 1.0f, -1.0f, 0.5f, 2.0f };
    t.dtype = "c64";
    t.rank = 1;
    t.shape[0] = 2;
    t.order = 0; /* key left out: reads back as C */
    t.data = vc;
    t.nbytes = sizeof vc;
    assert_int_equal(tensor_roundtrip(&t, 0, &up, &g), 0);
    assert_string_equal(g.dtype, "c64");
    assert_int_equal(g.order, 'C');
    assert_int_equal(pb_ctensor_copy_f64(&g, d6, 3), -ENOBUFS);
    assert_int_equal(pb_ctensor_copy_f64(&g, d6, 4), 0);
    assert_true(d6[1] == -1.0 && d6[3] == 2.0);
    msgpack_unpacked_destroy(&up);

    /* Scalar (rank 0) and a zero-size tensor. */
    const double one = 1.0;
    t.dtype = "f64";
    t.rank = 0;
    t.data = &one;
    t.nbytes = sizeof one;
    assert_int_equal(tensor_roundtrip(&t, 0, &up, &g), 0);
    assert_int_equal(g.rank, 0);
    assert_int_equal(pb_ctensor_count(&g), 1);
    msgpack_unpacked_destroy(&up);
    t.rank = 2;
    t.shape[0] = 0;
    t.shape[1] = 5;
    t.data = NULL;
    t.nbytes = 0;
    assert_int_equal(tensor_roundtrip(&t, 0, &up, &g), 0);
    assert_int_equal(pb_ctensor_count(&g), 0);
    assert_int_equal(g.nbytes, 0);
    assert_int_equal(pb_ctensor_copy_f64(&g, NULL, 0), 0);
    msgpack_unpacked_destroy(&up);

    /* A shared-memory tensor. */
    t.dtype = "c128";
    t.rank = 1;
    t.shape[0] = 4;
    t.shm = true;
    t.buffer = 3;
    t.offset = 128;
    assert_int_equal(tensor_roundtrip(&t, 0, &up, &g), 0);
    assert_true(g.shm);
    assert_int_equal(g.buffer, 3);
    assert_int_equal(g.offset, 128);
    assert_int_equal(g.nbytes, 64);
    assert_null(g.data);
    assert_int_equal(pb_ctensor_copy_f64(&g, d6, 6), -EINVAL);
    msgpack_unpacked_destroy(&up);

    /* What pb_obj_tensor refuses. */
    memset(&t, 0, sizeof t);
    t.dtype = "f32";
    t.rank = 1;
    t.shape[0] = 3;
    t.data = v32;
    t.nbytes = 8; /* two values for a shape of three */
    assert_int_equal(tensor_roundtrip(&t, 0, &up, &g), -EINVAL);
    msgpack_unpacked_destroy(&up);
    t.nbytes = 12;
    t.dtype = "f16";
    assert_int_equal(tensor_roundtrip(&t, 0, &up, &g), -EINVAL);
    msgpack_unpacked_destroy(&up);
    t.dtype = "f32";
    t.order = 'X'; /* not packed: 'C'/'F' only, so this one passes */
    assert_int_equal(tensor_roundtrip(&t, 0, &up, &g), 0);
    msgpack_unpacked_destroy(&up);

    /* Hand-made maps for what pb_pack_tensor cannot produce. */
    static const struct {
        const char *what;
        int order_bad, neg_dim, rank17, no_data;
    } bad[] = {
        { "order", 1, 0, 0, 0 },
        { "negative dim", 0, 1, 0, 0 },
        { "rank 17", 0, 0, 1, 0 },
        { "no data", 0, 0, 0, 1 },
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        msgpack_sbuffer sb;
        msgpack_packer pk;
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, bad[k].no_data ? 2 : 4);
        pk_str(&pk, "dtype");
        pk_str(&pk, "f32");
        pk_str(&pk, "shape");
        int rank = bad[k].rank17 ? 17 : 1;
        msgpack_pack_array(&pk, (size_t)rank);
        for (int j = 0; j < rank; j++)
            msgpack_pack_int(&pk, bad[k].neg_dim ? -1 : 1);
        if (!bad[k].no_data) {
            pk_str(&pk, "order");
            pk_str(&pk, bad[k].order_bad ? "K" : "C");
            pk_str(&pk, "data");
            msgpack_pack_bin(&pk, 4);
            msgpack_pack_bin_body(&pk, v32, 4);
        }
        msgpack_unpacked_init(&up);
        assert_int_equal(msgpack_unpack_next(&up, sb.data, sb.size, NULL), MSGPACK_UNPACK_SUCCESS);
        if (pb_obj_tensor(&up.data, &g) != -EINVAL)
            fail_msg("tensor with bad %s accepted", bad[k].what);
        msgpack_unpacked_destroy(&up);
        msgpack_sbuffer_destroy(&sb);
    }
    assert_int_equal(pb_ctensor_itemsize("c128"), 16);
    assert_int_equal(pb_ctensor_itemsize("f16"), 0);
}

/* What the copies refuse, as the header lists it. */
static void test_copy_refused(void **state)
{
    (void)state;
    const double v[4] = { 1, 2, 3, 4 };
    double d[4];
    float f[4];
    pb_ctensor_t t = { .dtype = "f64", .rank = 2, .shape = { 2, 2 }, .data = v, .nbytes = sizeof v };

    assert_int_equal(pb_ctensor_copy_f64(&t, d, 4), 0);
    assert_int_equal(pb_ctensor_copy_f64(&t, d, 3), -ENOBUFS);
    assert_int_equal(pb_ctensor_copy_f64(NULL, d, 4), -EINVAL);
    assert_int_equal(pb_ctensor_copy_f64(&t, NULL, 4), -EINVAL);
    t.nbytes = sizeof v - 1;
    assert_int_equal(pb_ctensor_copy_f64(&t, d, 4), -EINVAL);
    t.nbytes = sizeof v;
    t.data = NULL;
    assert_int_equal(pb_ctensor_copy_f64(&t, d, 4), -EINVAL);
    t.shape[0] = 0; /* nothing to copy: NULL data and out are fine */
    assert_int_equal(pb_ctensor_copy_f64(&t, NULL, 0), 0);
    t.data = v;
    t.shape[0] = 2;
    t.rank = 17;
    assert_int_equal(pb_ctensor_copy_f64(&t, d, 4), -EINVAL);
    t.rank = 2;
    t.shape[0] = UINT64_MAX;
    assert_int_equal(pb_ctensor_copy_f64(&t, d, 4), -EINVAL);
    t.shape[0] = 2;
    t.dtype = "f16";
    assert_int_equal(pb_ctensor_copy_f32(&t, f, 4), -EINVAL);
    t.dtype = "f64";
    t.shm = true;
    assert_int_equal(pb_ctensor_copy_f64(&t, d, 4), -EINVAL);
}

/* PROTOCOL section 2: a str in place of the data bin is the same raw
 * bytes (clients on the old msgpack spec have no bin). */
static void test_tensor_str_data(void **state)
{
    (void)state;
    const float v[2] = { 1.5f, -3.0f };
    for (size_t len = sizeof v; len >= sizeof v - 1; len--) {
        msgpack_sbuffer sb;
        msgpack_packer pk;
        msgpack_unpacked up;
        pb_ctensor_t t;
        float f[2];

        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, 3);
        pk_str(&pk, "dtype");
        pk_str(&pk, "f32");
        pk_str(&pk, "shape");
        msgpack_pack_array(&pk, 1);
        msgpack_pack_int(&pk, 2);
        pk_str(&pk, "data");
        msgpack_pack_str(&pk, len);
        msgpack_pack_str_body(&pk, v, len);
        msgpack_unpacked_init(&up);
        assert_int_equal(msgpack_unpack_next(&up, sb.data, sb.size, NULL), MSGPACK_UNPACK_SUCCESS);
        if (len < sizeof v) {
            assert_int_equal(pb_obj_tensor(&up.data, &t), -EINVAL);
        } else {
            assert_int_equal(pb_obj_tensor(&up.data, &t), 0);
            assert_int_equal(t.nbytes, sizeof v);
            assert_int_equal(pb_ctensor_copy_f32(&t, f, 2), 0);
            assert_memory_equal(f, v, sizeof v);
        }
        msgpack_unpacked_destroy(&up);
        msgpack_sbuffer_destroy(&sb);
    }
}

/* ---- socket path chain ------------------------------------------------- */

static void test_socket_path(void **state)
{
    (void)state;
    char buf[256], small[8];
    char want[64];

    unsetenv("PULLBACKD_SOCKET");
    unsetenv("RUNTIME_DIRECTORY");
    unsetenv("XDG_RUNTIME_DIR");
    snprintf(want, sizeof want, "/tmp/pullbackd-%lu.sock", (unsigned long)getuid());
    assert_int_equal(pb_client_socket_path(buf, sizeof buf), 0);
    assert_string_equal(buf, want);

    setenv("XDG_RUNTIME_DIR", "/run/user/1000", 1);
    assert_int_equal(pb_client_socket_path(buf, sizeof buf), 0);
    assert_string_equal(buf, "/run/user/1000/pullbackd.sock");

    setenv("RUNTIME_DIRECTORY", "/run/pullbackd", 1);
    assert_int_equal(pb_client_socket_path(buf, sizeof buf), 0);
    assert_string_equal(buf, "/run/pullbackd/pullbackd.sock");
    setenv("RUNTIME_DIRECTORY", "/run/a:/run/b", 1);
    assert_int_equal(pb_client_socket_path(buf, sizeof buf), 0);
    assert_string_equal(buf, "/run/a/pullbackd.sock");

    setenv("PULLBACKD_SOCKET", "/srv/pb.sock", 1);
    assert_int_equal(pb_client_socket_path(buf, sizeof buf), 0);
    assert_string_equal(buf, "/srv/pb.sock");

    /* Too small: an error, and the buffer is left alone. */
    memset(small, 'z', sizeof small);
    assert_int_equal(pb_client_socket_path(small, sizeof small), -ENAMETOOLONG);
    assert_int_equal(small[0], 'z');
    assert_int_equal(pb_client_socket_path(buf, 12), -ENAMETOOLONG);
    assert_int_equal(pb_client_socket_path(buf, 13), 0);
    assert_int_equal(pb_client_socket_path(NULL, 13), -EINVAL);

    /* An empty variable counts as unset. */
    setenv("PULLBACKD_SOCKET", "", 1);
    assert_int_equal(pb_client_socket_path(buf, sizeof buf), 0);
    assert_string_equal(buf, "/run/a/pullbackd.sock");
    unsetenv("PULLBACKD_SOCKET");
    unsetenv("RUNTIME_DIRECTORY");
    assert_int_equal(pb_client_socket_path(buf, sizeof buf), 0);
    assert_string_equal(buf, "/run/user/1000/pullbackd.sock");
    unsetenv("XDG_RUNTIME_DIR");

    /* Connecting where nothing listens. */
    pb_client_t *c = NULL;
    assert_int_equal(pb_client_connect("/nonexistent/dir/pb.sock", &c), -ENOENT);
    assert_null(c);
    memset(buf, 'a', sizeof buf - 1);
    buf[sizeof buf - 1] = '\0';
    assert_int_equal(pb_client_connect(buf, &c), -ENAMETOOLONG);
}

/* ---- receiving --------------------------------------------------------- */

static void test_recv_partial(void **state)
{
    (void)state;
    int peer;
    pb_client_t *c = pair_client(&peer);
    pb_reply_t r;
    msgpack_sbuffer sb;

    msgpack_sbuffer_init(&sb);
    pack_ok(&sb, 5, 42);
    /* Every prefix is incomplete: nothing comes back until the last byte. */
    for (size_t i = 0; i + 1 < sb.size; i++) {
        write_all(peer, sb.data + i, 1);
        assert_int_equal(pb_client_recv_timeout(c, &r, 0), -ETIMEDOUT);
        assert_false(pb_client_pending(c));
    }
    write_all(peer, sb.data + sb.size - 1, 1);
    assert_int_equal(pb_client_recv_timeout(c, &r, 1000), 0);
    assert_int_equal(r.msgid, 5);
    assert_int_equal(reply_n(&r), 42);
    assert_null(pb_reply_code(&r));
    assert_null(pb_reply_message(&r));
    pb_reply_free(&r);

    /* A big reply split in two writes. */
    sb.size = 0;
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    size_t big = 300000;
    char *payload = malloc(big);
    assert_non_null(payload);
    for (size_t i = 0; i < big; i++)
        payload[i] = (char)(i * 7);
    msgpack_pack_array(&pk, 4);
    msgpack_pack_int(&pk, 1);
    msgpack_pack_uint32(&pk, 6);
    msgpack_pack_nil(&pk);
    msgpack_pack_bin(&pk, big);
    msgpack_pack_bin_body(&pk, payload, big);
    pack_ok(&sb, 7, 1);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        write_all(peer, sb.data, sb.size / 3);
        usleep(20000);
        write_all(peer, sb.data + sb.size / 3, sb.size - sb.size / 3);
        pb_client_close(c); /* what the child holds, for a clean leak check */
        free(payload);
        msgpack_sbuffer_destroy(&sb);
        _exit(0);
    }
    assert_int_equal(pb_client_recv(c, &r), 0);
    assert_int_equal(r.msgid, 6);
    assert_int_equal(r.result->type, MSGPACK_OBJECT_BIN);
    assert_int_equal(r.result->via.bin.size, big);
    /* Reading on must not disturb the bytes of a reply already out. */
    pb_reply_t r2;
    assert_int_equal(pb_client_recv(c, &r2), 0);
    assert_int_equal(r2.msgid, 7);
    assert_memory_equal(r.result->via.bin.ptr, payload, big);
    pb_reply_free(&r);
    pb_reply_free(&r2);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);

    free(payload);
    msgpack_sbuffer_destroy(&sb);
    close(peer);
    pb_client_close(c);
}

static void test_recv_two_in_one_read(void **state)
{
    (void)state;
    int peer;
    pb_client_t *c = pair_client(&peer);
    pb_reply_t r;
    msgpack_sbuffer sb;

    msgpack_sbuffer_init(&sb);
    pack_ok(&sb, 1, 10);
    pack_err(&sb, 2, "invalid_argument", "inputs.x: bad shape");
    write_all(peer, sb.data, sb.size);

    assert_int_equal(pb_client_recv(c, &r), 0);
    assert_int_equal(r.msgid, 1);
    assert_int_equal(reply_n(&r), 10);
    pb_reply_free(&r);
    /* The second one is already read: no waiting needed. */
    assert_true(pb_client_pending(c));
    assert_int_equal(pb_client_recv_timeout(c, &r, 0), 0);
    assert_int_equal(r.msgid, 2);
    assert_null(r.result);
    assert_non_null(r.error);
    assert_string_equal(pb_reply_code(&r), "invalid_argument");
    assert_string_equal(pb_reply_message(&r), "inputs.x: bad shape");
    pb_reply_free(&r);
    pb_reply_free(&r); /* a cleared reply may be freed again */

    /* End of stream. */
    close(peer);
    assert_int_equal(pb_client_recv(c, &r), -EPIPE);
    assert_int_equal(pb_client_recv(c, &r), -EPIPE);
    msgpack_sbuffer_destroy(&sb);
    pb_client_close(c);
}

static void test_unexpected_msgid_queued(void **state)
{
    (void)state;
    int peer;
    pb_client_t *c = pair_client(&peer);
    pb_reply_t r;
    msgpack_sbuffer sb;

    /* The first request of a fresh client has msgid 1; replies to 99 and 98
     * arrive before its own. */
    msgpack_sbuffer_init(&sb);
    pack_ok(&sb, 99, 990);
    pack_ok(&sb, 98, 980);
    pack_ok(&sb, 1, 10);
    write_all(peer, sb.data, sb.size);

    msgpack_packer *pk = pb_client_begin(c, "hello");
    assert_non_null(pk);
    msgpack_pack_map(pk, 0);
    assert_int_equal(pb_client_call(c, &r), 0);
    assert_int_equal(r.msgid, 1);
    assert_int_equal(reply_n(&r), 10);
    pb_reply_free(&r);

    /* The queued ones come back in arrival order. */
    assert_true(pb_client_pending(c));
    assert_int_equal(pb_client_recv(c, &r), 0);
    assert_int_equal(r.msgid, 99);
    assert_int_equal(reply_n(&r), 990);
    pb_reply_free(&r);

    /* pb_client_wait takes one from the middle of the queue. */
    sb.size = 0;
    pack_ok(&sb, 3, 30);
    pack_ok(&sb, 2, 20);
    write_all(peer, sb.data, sb.size);
    assert_int_equal(pb_client_wait(c, 2, &r), 0);
    assert_int_equal(reply_n(&r), 20);
    pb_reply_free(&r);
    assert_int_equal(pb_client_recv(c, &r), 0);
    assert_int_equal(r.msgid, 98);
    pb_reply_free(&r);
    assert_int_equal(pb_client_recv(c, &r), 0);
    assert_int_equal(r.msgid, 3);
    pb_reply_free(&r);
    assert_false(pb_client_pending(c));

    /* Queued replies left at close are freed by it (valgrind checks). */
    sb.size = 0;
    pack_ok(&sb, 50, 1);
    pack_ok(&sb, 4, 40);
    write_all(peer, sb.data, sb.size);
    assert_int_equal(pb_client_wait(c, 4, &r), 0);
    pb_reply_free(&r);

    msgpack_sbuffer_destroy(&sb);
    close(peer);
    pb_client_close(c);
}

/* A daemon that closes the connection after an error under msgid 0 (a
 * connection past max_connections_per_uid, a parse error): the call that
 * meets the close gets that error as its reply, not -EPIPE, whether its
 * send already failed or it was waiting.  With no such error, -EPIPE. */
static void test_closed_with_reason(void **state)
{
    (void)state;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    pack_err(&sb, 0, "resource_exhausted", "uid 0 has max_connections_per_uid (1) connections open");
    for (int when = 0; when < 3; when++) {
        int peer;
        pb_client_t *c = pair_client(&peer);
        if (when == 0) { /* closed before the request is sent: the send meets EPIPE */
            write_all(peer, sb.data, sb.size);
            close(peer);
        }
        msgpack_packer *pk = pb_client_begin(c, "hello");
        msgpack_pack_map(pk, 0);
        pb_reply_t r;
        if (when == 0) {
            assert_int_equal(pb_client_call(c, &r), 0);
        } else {
            uint32_t id;
            assert_int_equal(pb_client_send(c, &id), 0);
            if (when == 1)
                write_all(peer, sb.data, sb.size);
            close(peer);
            if (when == 2) { /* closed with nothing said */
                assert_int_equal(pb_client_wait(c, id, &r), -EPIPE);
                pb_client_close(c);
                continue;
            }
            assert_int_equal(pb_client_wait(c, id, &r), 0);
        }
        assert_int_equal(r.msgid, 0);
        assert_string_equal(pb_reply_code(&r), "resource_exhausted");
        assert_non_null(strstr(pb_reply_message(&r), "max_connections_per_uid"));
        pb_reply_free(&r);
        pb_client_close(c);
    }
    msgpack_sbuffer_destroy(&sb);
}

static void test_recv_malformed(void **state)
{
    (void)state;
    int peer;
    pb_client_t *c = pair_client(&peer);
    pb_reply_t r;
    msgpack_sbuffer sb;
    msgpack_packer pk;

    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    /* Both error and result nil. */
    msgpack_pack_array(&pk, 4);
    msgpack_pack_int(&pk, 1);
    msgpack_pack_int(&pk, 1);
    msgpack_pack_nil(&pk);
    msgpack_pack_nil(&pk);
    /* A request, not a response. */
    msgpack_pack_array(&pk, 4);
    msgpack_pack_int(&pk, 0);
    msgpack_pack_int(&pk, 1);
    pk_str(&pk, "hello");
    msgpack_pack_array(&pk, 0);
    /* A msgid beyond uint32. */
    msgpack_pack_array(&pk, 4);
    msgpack_pack_int(&pk, 1);
    msgpack_pack_uint64(&pk, 1ull << 32);
    msgpack_pack_nil(&pk);
    msgpack_pack_int(&pk, 0);
    /* Not an array. */
    msgpack_pack_int(&pk, 17);
    /* Then a good one: framing stayed in step. */
    pack_ok(&sb, 8, 80);
    write_all(peer, sb.data, sb.size);
    for (int i = 0; i < 4; i++)
        assert_int_equal(pb_client_recv(c, &r), -EPROTO);
    assert_int_equal(pb_client_recv(c, &r), 0);
    assert_int_equal(reply_n(&r), 80);
    pb_reply_free(&r);

    /* 0xc1 is no msgpack: the stream is lost for good. */
    static const unsigned char junk[] = { 0xc1, 0x94, 0x01 };
    write_all(peer, junk, sizeof junk);
    sb.size = 0;
    pack_ok(&sb, 9, 90);
    write_all(peer, sb.data, sb.size);
    assert_int_equal(pb_client_recv(c, &r), -EPROTO);
    assert_int_equal(pb_client_recv(c, &r), -EPROTO);
    /* Nothing is sent either: no reply could be read. */
    msgpack_packer *hp = pb_client_begin(c, "hello");
    msgpack_pack_map(hp, 0);
    assert_int_equal(pb_client_send(c, NULL), -EPROTO);
    assert_int_equal(drain(peer), 0);

    msgpack_sbuffer_destroy(&sb);
    close(peer);
    pb_client_close(c);
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* A receive with a timeout never gives up before the timeout has passed
 * (it did up to 1 ms early, the rest of a millisecond cut off for poll). */
static void test_recv_timeout_not_early(void **state)
{
    (void)state;
    int peer;
    pb_client_t *c = pair_client(&peer);
    pb_reply_t r;

    for (int i = 0; i < 20; i++) {
        int ms = 1 + i % 3;
        long long t0 = now_ns();
        assert_int_equal(pb_client_recv_timeout(c, &r, ms), -ETIMEDOUT);
        long long took = now_ns() - t0;
        if (took < ms * 1000000LL)
            fail_msg("a timeout of %d ms returned after %lld ns", ms, took);
    }
    close(peer);
    pb_client_close(c);
}

/* ---- big replies ------------------------------------------------------- */

/* Append [1, msgid, nil, [bin, ...]] to sb: nbins bins of len bytes, byte k
 * of bin b being (k * 31 + b + seed) & 0xff. */
static void pack_bins(msgpack_sbuffer *sb, uint32_t msgid, int nbins, size_t len, unsigned seed)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 4);
    msgpack_pack_int(&pk, 1);
    msgpack_pack_uint32(&pk, msgid);
    msgpack_pack_nil(&pk);
    msgpack_pack_array(&pk, (size_t)nbins);
    unsigned char *p = malloc(len);
    assert_non_null(p);
    for (int b = 0; b < nbins; b++) {
        for (size_t k = 0; k < len; k++)
            p[k] = (unsigned char)(k * 31 + (size_t)b + seed);
        msgpack_pack_bin(&pk, len);
        msgpack_pack_bin_body(&pk, p, len);
    }
    free(p);
}

/* r is a pack_bins reply with those arguments, every byte as written. */
static void check_bins(const pb_reply_t *r, uint32_t msgid, int nbins, size_t len, unsigned seed)
{
    assert_int_equal(r->msgid, msgid);
    assert_non_null(r->result);
    assert_int_equal(r->result->type, MSGPACK_OBJECT_ARRAY);
    assert_int_equal(r->result->via.array.size, (uint32_t)nbins);
    for (int b = 0; b < nbins; b++) {
        const msgpack_object *o = &r->result->via.array.ptr[b];
        assert_int_equal(o->type, MSGPACK_OBJECT_BIN);
        assert_int_equal(o->via.bin.size, len);
        const unsigned char *p = (const unsigned char *)o->via.bin.ptr;
        for (size_t k = 0; k < len; k++)
            if (p[k] != (unsigned char)(k * 31 + (size_t)b + seed))
                fail_msg("bin %d byte %zu is %u", b, k, p[k]);
    }
}

static const void *first_bin(const pb_reply_t *r)
{
    return r->result->via.array.ptr[0].via.bin.ptr;
}

/* A thread writes sb to peer: in one go (first 0), or its first `first`
 * bytes one at a time with pauses and then pieces of 4099 bytes.  A
 * thread, not a child: a child exiting with the parent's memory still
 * allocated is a leak to valgrind's memcheck stage. */
typedef struct {
    int peer;
    const msgpack_sbuffer *sb;
    size_t first;
    pthread_t th;
} sb_writer_t;

static void *write_sb(void *arg)
{
    sb_writer_t *w = arg;
    size_t at = 0;
    for (; at < w->first && at < w->sb->size; at++) {
        write_all(w->peer, w->sb->data + at, 1);
        usleep(1000);
    }
    size_t piece = w->first ? 4099 : w->sb->size;
    for (; at < w->sb->size; at += piece)
        write_all(w->peer, w->sb->data + at, w->sb->size - at < piece ? w->sb->size - at : piece);
    return NULL;
}

static void write_start(sb_writer_t *w, int peer, const msgpack_sbuffer *sb, size_t first)
{
    *w = (sb_writer_t){.peer = peer, .sb = sb, .first = first};
    assert_int_equal(pthread_create(&w->th, NULL, write_sb, w), 0);
}

static void write_join(sb_writer_t *w)
{
    assert_int_equal(pthread_join(w->th, NULL), 0);
}

/* A big reply in many small pieces, its header split byte by byte (the
 * client cannot know its length until the bin32 header is all there), two
 * bins (the second length comes only after the first bin's bytes), then
 * small replies in the same stream. */
static void test_recv_big_in_pieces(void **state)
{
    (void)state;
    int peer;
    pb_client_t *c = pair_client(&peer);
    msgpack_sbuffer sb;
    pb_reply_t r;
    const size_t len = (3u << 20) + 12345;

    msgpack_sbuffer_init(&sb);
    pack_bins(&sb, 1, 2, len, 7);
    pack_ok(&sb, 2, 20);
    pack_err(&sb, 3, "internal", "after the big one");
    /* Pieces of 1 byte with pauses over the header, then of 4099 bytes. */
    sb_writer_t w;
    write_start(&w, peer, &sb, 16);
    assert_int_equal(pb_client_recv(c, &r), 0);
    check_bins(&r, 1, 2, len, 7);
    pb_reply_t r2, r3;
    assert_int_equal(pb_client_recv(c, &r2), 0);
    assert_int_equal(r2.msgid, 2);
    assert_int_equal(reply_n(&r2), 20);
    assert_int_equal(pb_client_recv(c, &r3), 0);
    assert_string_equal(pb_reply_message(&r3), "after the big one");
    check_bins(&r, 1, 2, len, 7); /* still intact */
    pb_reply_free(&r);
    pb_reply_free(&r2);
    pb_reply_free(&r3);
    write_join(&w);

    msgpack_sbuffer_destroy(&sb);
    close(peer);
    pb_client_close(c);
}

/* Several replies in one write: small, big, small, big, big, small. */
static void test_recv_big_and_small_in_one_read(void **state)
{
    (void)state;
    int peer;
    pb_client_t *c = pair_client(&peer);
    msgpack_sbuffer sb;
    pb_reply_t r[6];
    const size_t len = (2u << 20) + 1;

    msgpack_sbuffer_init(&sb);
    pack_ok(&sb, 1, 10);
    pack_bins(&sb, 2, 1, len, 1);
    pack_ok(&sb, 3, 30);
    pack_bins(&sb, 4, 1, len, 2);
    pack_bins(&sb, 5, 3, len / 3, 3);
    pack_ok(&sb, 6, 60);
    sb_writer_t w;
    write_start(&w, peer, &sb, 0);
    for (int i = 0; i < 6; i++) {
        assert_int_equal(pb_client_recv(c, &r[i]), 0);
        assert_int_equal(r[i].msgid, (uint32_t)i + 1);
    }
    /* All kept: none was received over another. */
    assert_int_equal(reply_n(&r[0]), 10);
    check_bins(&r[1], 2, 1, len, 1);
    assert_int_equal(reply_n(&r[2]), 30);
    check_bins(&r[3], 4, 1, len, 2);
    check_bins(&r[4], 5, 3, len / 3, 3);
    assert_int_equal(reply_n(&r[5]), 60);
    for (int i = 0; i < 6; i++)
        pb_reply_free(&r[i]);
    write_join(&w);

    msgpack_sbuffer_destroy(&sb);
    close(peer);
    pb_client_close(c);
}

typedef struct {
    int peer;
    const msgpack_sbuffer *sb;
} piece_writer_t;

/* Write sb in pieces of 100000 bytes, pausing after the first three.  A
 * thread, not a child: after fork() every page of ours would be
 * copy-on-write, and faults are what test_recv_big_reuse counts. */
static void *write_pieces(void *arg)
{
    piece_writer_t *w = arg;
    for (size_t at = 0, i = 0; at < w->sb->size; i++) {
        size_t n = w->sb->size - at < 100000 ? w->sb->size - at : 100000;
        write_all(w->peer, w->sb->data + at, n);
        at += n;
        if (i < 3)
            usleep(2000);
    }
    return NULL;
}

static long minor_faults(void)
{
    struct rusage ru;
    assert_int_equal(getrusage(RUSAGE_SELF, &ru), 0);
    return ru.ru_minflt;
}

/* Receive one pack_bins reply sent in pieces; the page faults the receive
 * took into *faults (may be NULL). */
static void recv_bins_faults(pb_client_t *c, int peer, pb_reply_t *r, uint32_t msgid, int nbins,
                             size_t len, unsigned seed, long *faults)
{
    msgpack_sbuffer sb;
    pthread_t th;
    msgpack_sbuffer_init(&sb);
    pack_bins(&sb, msgid, nbins, len, seed);
    piece_writer_t w = { peer, &sb };
    assert_int_equal(pthread_create(&th, NULL, write_pieces, &w), 0);
    long f0 = minor_faults();
    assert_int_equal(pb_client_recv(c, r), 0);
    if (faults != NULL)
        *faults = minor_faults() - f0;
    assert_int_equal(pthread_join(th, NULL), 0);
    check_bins(r, msgid, nbins, len, seed);
    msgpack_sbuffer_destroy(&sb);
}

static void recv_bins(pb_client_t *c, int peer, pb_reply_t *r, uint32_t msgid, int nbins, size_t len,
                      unsigned seed)
{
    recv_bins_faults(c, peer, r, msgid, nbins, len, seed, NULL);
}

/* A reply kept while later big replies arrive stays intact (its buffer is
 * not lent again), and one freed gives its memory to the next big reply. */
static void test_recv_big_reuse(void **state)
{
    (void)state;
    int peer;
    pb_client_t *c = pair_client(&peer);
    pb_reply_t kept, r;
    const size_t len = 5u << 20;

    recv_bins(c, peer, &kept, 1, 1, len, 11);
    uintptr_t kept_at = (uintptr_t)first_bin(&kept);
    for (uint32_t i = 0; i < 4; i++) {
        recv_bins(c, peer, &r, 2 + i, 1, len, 20 + i);
        assert_true((uintptr_t)first_bin(&r) != kept_at);
        pb_reply_free(&r);
    }
    check_bins(&kept, 1, 1, len, 11);

    /* Freed, a buffer is lent again: the same memory, and no fresh pages.
     * Fresh memory faults once per 4 KiB page it touches: once per page of
     * a buffer sized at once, about twice as often when it grows by
     * doubling.  The size is past glibc's largest mmap threshold (32 MiB),
     * so that malloc itself would map fresh pages for each reply. */
    const size_t huge = 36u << 20;
    long faults;
    recv_bins_faults(c, peer, &r, 10, 1, huge, 30, &faults);
    if (faults > (long)(huge / 4096 * 3 / 2))
        fail_msg("%ld page faults for a first reply of %zu bytes", faults, huge);
    uintptr_t at = (uintptr_t)first_bin(&r);
    pb_reply_free(&r);
    recv_bins_faults(c, peer, &r, 11, 1, huge, 31, &faults);
    assert_true((uintptr_t)first_bin(&r) == at);
    if (faults > (long)(huge / 4096 / 8))
        fail_msg("%ld page faults for a reply of %zu bytes into a reused buffer", faults, huge);
    pb_reply_free(&r);
    /* So for a reply whose size is learnt one bin at a time, once it has
     * been seen. */
    recv_bins(c, peer, &r, 12, 3, len / 2, 40);
    pb_reply_free(&r);
    recv_bins(c, peer, &r, 13, 3, len / 2, 41);
    at = (uintptr_t)first_bin(&r);
    pb_reply_free(&r);
    recv_bins(c, peer, &r, 14, 3, len / 2, 42);
    assert_true((uintptr_t)first_bin(&r) == at);
    pb_reply_free(&r);

    /* A kept reply outlives its client. */
    close(peer);
    pb_client_close(c);
    check_bins(&kept, 1, 1, len, 11);
    pb_reply_free(&kept);
}

/* Running out of memory while receiving loses nothing and breaks nothing:
 * the receive says -ENOMEM, and once memory is back the same replies come,
 * whole.  Where it can happen: a big reply's own buffer, the small buffer
 * the bytes after a big reply go back to, a slot in the reply queue. */
static void test_recv_enomem_loses_nothing(void **state)
{
    (void)state;
    int peer;
    pb_client_t *c = pair_client(&peer);
    msgpack_sbuffer sb;
    sb_writer_t w;
    pb_reply_t r, a, b;
    const size_t len = 2u << 20;

    /* A big reply's buffer. */
    msgpack_sbuffer_init(&sb);
    pack_bins(&sb, 1, 1, len, 5);
    write_start(&w, peer, &sb, 0);
    malloc_fails(1u << 20, SIZE_MAX);
    assert_int_equal(pb_client_recv_timeout(c, &r, 5000), -ENOMEM);
    assert_int_equal(pb_client_recv_timeout(c, &r, 0), -ENOMEM);
    malloc_fails(0, 0);
    assert_int_equal(pb_client_recv(c, &r), 0);
    check_bins(&r, 1, 1, len, 5);
    pb_reply_free(&r);
    write_join(&w);

    /* The small buffer after a big reply, while a reply kept (a) holds the
     * old one. */
    sb.size = 0;
    pack_ok(&sb, 2, 20);
    pack_bins(&sb, 3, 1, len, 6);
    pack_ok(&sb, 4, 40);
    write_start(&w, peer, &sb, 0);
    assert_int_equal(pb_client_recv(c, &a), 0);
    assert_int_equal(reply_n(&a), 20);
    malloc_fails(64u << 10, 1u << 20);
    assert_int_equal(pb_client_recv(c, &b), 0);
    malloc_fails(0, 0);
    check_bins(&b, 3, 1, len, 6);
    assert_int_equal(pb_client_recv(c, &r), 0);
    assert_int_equal(reply_n(&r), 40);
    pb_reply_free(&r);
    pb_reply_free(&b);
    pb_reply_free(&a);
    write_join(&w);

    /* A queue slot for a reply read while waiting for another. */
    sb.size = 0;
    pack_ok(&sb, 6, 60);
    pack_ok(&sb, 5, 50);
    write_all(peer, sb.data, sb.size);
    realloc_fails = true;
    assert_int_equal(pb_client_wait(c, 5, &r), -ENOMEM);
    realloc_fails = false;
    assert_int_equal(pb_client_wait(c, 5, &r), 0);
    assert_int_equal(reply_n(&r), 50);
    pb_reply_free(&r);
    assert_int_equal(pb_client_recv_timeout(c, &r, 2000), 0);
    assert_int_equal(reply_n(&r), 60);
    pb_reply_free(&r);

    msgpack_sbuffer_destroy(&sb);
    close(peer);
    pb_client_close(c);
}

/* [1, 1, nil, result] with result `depth` arrays nested in one another,
 * the innermost empty, or (depth 0) an array of n nils. */
static void pack_deep(msgpack_sbuffer *sb, int depth, size_t n)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 4);
    msgpack_pack_int(&pk, 1);
    msgpack_pack_int(&pk, 1);
    msgpack_pack_nil(&pk);
    for (int i = 0; i < depth; i++)
        msgpack_pack_array(&pk, i + 1 < depth ? 1 : 0);
    if (depth == 0) {
        msgpack_pack_array(&pk, n);
        for (size_t i = 0; i < n; i++)
            msgpack_pack_nil(&pk);
    }
}

/* The limits the header states: 32 containers deep, the reply's own array
 * counting, and some 2^20 objects (exactly: for this shape of reply, 2^20
 * - 4 nils in the result); past them -EPROTO, and the connection is lost
 * for receiving and sending. */
static void test_recv_limits(void **state)
{
    (void)state;
    static const struct {
        int depth;
        size_t n;
        bool ok;
    } cases[] = {
        { 31, 0, true },
        { 32, 0, false },
        { 0, (1u << 20) - 4, true },
        { 0, (1u << 20) - 3, false },
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int peer;
        pb_client_t *c = pair_client(&peer);
        msgpack_sbuffer sb;
        sb_writer_t w;
        pb_reply_t r;

        msgpack_sbuffer_init(&sb);
        pack_ok(&sb, 7, 70);
        pack_deep(&sb, cases[k].depth, cases[k].n);
        pack_ok(&sb, 8, 80);
        /* A refused message is refused at its header, which the first 64
         * KiB hold: nothing would read the rest. */
        if (cases[k].ok)
            write_start(&w, peer, &sb, 0);
        else
            write_all(peer, sb.data, sb.size < 65536 ? sb.size : 65536);
        assert_int_equal(pb_client_recv(c, &r), 0);
        assert_int_equal(reply_n(&r), 70);
        pb_reply_free(&r);
        if (cases[k].ok) {
            assert_int_equal(pb_client_recv(c, &r), 0);
            assert_int_equal(r.msgid, 1);
            pb_reply_free(&r);
            assert_int_equal(pb_client_recv(c, &r), 0);
            assert_int_equal(reply_n(&r), 80);
            pb_reply_free(&r);
            write_join(&w);
        } else {
            assert_int_equal(pb_client_recv(c, &r), -EPROTO);
            assert_int_equal(pb_client_recv(c, &r), -EPROTO);
            msgpack_packer *pk = pb_client_begin(c, "hello");
            msgpack_pack_map(pk, 0);
            assert_int_equal(pb_client_send(c, NULL), -EPROTO);
        }
        close(peer);
        pb_client_close(c);
        msgpack_sbuffer_destroy(&sb);
    }
}

/* ---- sending ----------------------------------------------------------- */

/* ---- big tensors sent in place ---------------------------------------- */

typedef struct {
    int fd;
    msgpack_unpacker u;
    msgpack_unpacked up;
    int passed_fd; /* an SCM_RIGHTS fd that came with the bytes, or -1 */
} reader_t;

static void *read_one(void *arg)
{
    reader_t *r = arg;
    r->passed_fd = -1;
    for (;;) {
        if (msgpack_unpacker_next(&r->u, &r->up) == MSGPACK_UNPACK_SUCCESS)
            return NULL;
        if (!msgpack_unpacker_reserve_buffer(&r->u, 1 << 16))
            return NULL;
        union {
            struct cmsghdr h;
            char buf[CMSG_SPACE(sizeof(int))];
        } ctl;
        struct iovec iov = { msgpack_unpacker_buffer(&r->u), msgpack_unpacker_buffer_capacity(&r->u) };
        struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                              .msg_controllen = sizeof ctl.buf };
        ssize_t n = recvmsg(r->fd, &msg, 0);
        if (n <= 0)
            return NULL;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        if (cm && cm->cmsg_type == SCM_RIGHTS)
            memcpy(&r->passed_fd, CMSG_DATA(cm), sizeof(int));
        msgpack_unpacker_buffer_consumed(&r->u, (size_t)n);
    }
}

/* tensors[i]'s data as the peer decoded it from params.inputs["t<i>"]. */
static const msgpack_object *sent_data(const msgpack_object *msg, int i)
{
    char name[8];
    snprintf(name, sizeof name, "t%d", i);
    const msgpack_object *params = &msg->via.array.ptr[3].via.array.ptr[0];
    const msgpack_object *t = pb_obj_get(pb_obj_get(params, "inputs"), name);
    return pb_obj_get(t, "data");
}

/* Tensors of 64 KiB and more go out from the caller's memory: what the
 * peer reads is the message pb_pack_tensor describes, byte for byte, for
 * sizes around the threshold, more than the 16 in-place slots, with an fd
 * passed along; and it is the caller's memory at send time (changed after
 * packing, the peer sees the change). */
static void test_send_in_place(void **state)
{
    (void)state;
    enum { NT = 20 };
    static const size_t sizes[NT] = {8, 65528, 65536, 65544, 1 << 20, 3 << 20, 100, 70000, 65536, 65536,
                                     65536, 65536, 65536, 65536, 65536, 65536, 65536, 65536, 65536, 65536};
    for (int with_fd = 0; with_fd < 2; with_fd++) {
        int peer;
        pb_client_t *c = pair_client(&peer);
        unsigned char *data[NT];
        pb_ctensor_t t[NT];
        for (int i = 0; i < NT; i++) {
            data[i] = malloc(sizes[i]);
            for (size_t k = 0; k < sizes[i]; k++)
                data[i][k] = (unsigned char)(k * 7 + (size_t)i);
            t[i] = (pb_ctensor_t){ .dtype = "f64", .rank = 1, .shape = { sizes[i] / 8 }, .data = data[i],
                                   .nbytes = sizes[i] };
        }
        msgpack_packer *pk = pb_client_begin(c, "forward");
        msgpack_pack_map(pk, 2);
        pb_pack_str(pk, "op");
        pb_pack_str(pk, "tensoradd");
        pb_pack_str(pk, "inputs");
        msgpack_pack_map(pk, NT);
        for (int i = 0; i < NT; i++) {
            char name[8];
            snprintf(name, sizeof name, "t%d", i);
            pb_pack_str(pk, name);
            pb_pack_tensor(pk, &t[i]);
        }
        data[4][12345] ^= 0xff; /* after packing, before sending */
        reader_t r = { .fd = peer };
        assert_true(msgpack_unpacker_init(&r.u, 1 << 16));
        msgpack_unpacked_init(&r.up);
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, read_one, &r), 0);
        uint32_t id;
        int memfd = -1;
        if (with_fd) {
            memfd = dup(STDIN_FILENO);
            assert_int_equal(pb_client_send_with_fd(c, memfd, &id), 0);
        } else {
            assert_int_equal(pb_client_send(c, &id), 0);
        }
        pthread_join(th, NULL);
        assert_int_equal(r.up.data.type, MSGPACK_OBJECT_ARRAY);
        for (int i = 0; i < NT; i++) {
            const msgpack_object *d = sent_data(&r.up.data, i);
            assert_non_null(d);
            assert_int_equal(d->via.bin.size, sizes[i]);
            assert_memory_equal(d->via.bin.ptr, data[i], sizes[i]);
        }
        assert_true(with_fd ? r.passed_fd >= 0 : r.passed_fd < 0);
        if (r.passed_fd >= 0)
            close(r.passed_fd);
        if (memfd >= 0)
            close(memfd);
        msgpack_unpacked_destroy(&r.up);
        msgpack_unpacker_destroy(&r.u);
        for (int i = 0; i < NT; i++)
            free(data[i]);
        close(peer);
        pb_client_close(c);
    }
}

static void test_send_encoding(void **state)
{
    (void)state;
    int peer;
    pb_client_t *c = pair_client(&peer);
    msgpack_unpacker u;
    msgpack_unpacked up;
    uint32_t id = 0, id2 = 0;
    uint64_t v;

    assert_true(msgpack_unpacker_init(&u, 4096));
    msgpack_unpacked_init(&up);

    msgpack_packer *pk = pb_client_begin(c, "release");
    msgpack_pack_map(pk, 1);
    msgpack_pack_str(pk, 4);
    msgpack_pack_str_body(pk, "tape", 4);
    msgpack_pack_uint64(pk, 12345678901ull);
    assert_int_equal(pb_client_send(c, &id), 0);
    assert_int_equal(id, 1);
    read_message(peer, &u, &up);
    const msgpack_object *o = &up.data;
    assert_int_equal(o->type, MSGPACK_OBJECT_ARRAY);
    assert_int_equal(o->via.array.size, 4);
    assert_int_equal(pb_obj_uint(&o->via.array.ptr[0], &v), 0);
    assert_int_equal(v, 0);
    assert_int_equal(pb_obj_uint(&o->via.array.ptr[1], &v), 0);
    assert_int_equal(v, 1);
    assert_int_equal(pb_obj_strcmp(&o->via.array.ptr[2], "release"), 0);
    assert_int_equal(o->via.array.ptr[3].type, MSGPACK_OBJECT_ARRAY);
    assert_int_equal(o->via.array.ptr[3].via.array.size, 1);
    assert_int_equal(pb_obj_uint(pb_obj_path(o, "3.0.tape"), &v), 0);
    assert_true(v == 12345678901ull);

    /* Notification: [2, method, [params]]. */
    pk = pb_client_begin_notify(c, "release");
    msgpack_pack_map(pk, 1);
    pb_pack_kv_str(pk, "tape", "x");
    assert_int_equal(pb_client_send_notify(c), 0);
    read_message(peer, &u, &up);
    o = &up.data;
    assert_int_equal(o->via.array.size, 3);
    assert_int_equal(pb_obj_uint(&o->via.array.ptr[0], &v), 0);
    assert_int_equal(v, 2);
    assert_int_equal(pb_obj_strcmp(pb_obj_path(o, "2.0.tape"), "x"), 0);

    /* Misuse is refused and nothing is written. */
    assert_int_equal(pb_client_send(c, &id), -EINVAL);          /* nothing begun */
    pb_client_begin(c, "hello");
    assert_int_equal(pb_client_send(c, &id), -EINVAL);          /* no params */
    pk = pb_client_begin(c, "hello");
    msgpack_pack_int(pk, 1);
    assert_int_equal(pb_client_send(c, &id), -EINVAL);          /* not a map */
    pk = pb_client_begin(c, "hello");
    msgpack_pack_map(pk, 0);
    msgpack_pack_map(pk, 0);
    assert_int_equal(pb_client_send(c, &id), -EINVAL);          /* two objects */
    pk = pb_client_begin(c, "hello");
    msgpack_pack_map(pk, 1);
    assert_int_equal(pb_client_send(c, &id), -EINVAL);          /* incomplete map */
    pk = pb_client_begin(c, "hello");
    msgpack_pack_map(pk, 0);
    assert_int_equal(pb_client_send_notify(c), -EINVAL);        /* wrong kind */
    assert_null(pb_client_begin(NULL, "hello"));
    assert_null(pb_client_begin(c, NULL));
    /* What a NULL begin gives packs nothing, by every pb_pack_* helper
     * (pb_pack_str and pb_pack_kv_str once dereferenced it). */
    pb_pack_str(pb_client_begin(NULL, "hello"), "x");
    pb_pack_kv_str(NULL, "k", "v");
    pb_pack_tensor(NULL, &(pb_ctensor_t){.dtype = "f64", .rank = 0, .data = "12345678", .nbytes = 8});
    pb_pack_into(NULL, NULL, 0);

    /* Msgids go up; raw bytes go out as they are. */
    pk = pb_client_begin(c, "hello");
    msgpack_pack_map(pk, 0);
    assert_int_equal(pb_client_send(c, &id2), 0);
    assert_true(id2 > id);
    read_message(peer, &u, &up);
    assert_int_equal(pb_obj_uint(&up.data.via.array.ptr[1], &v), 0);
    assert_int_equal(v, id2);
    assert_int_equal(pb_client_send_raw(c, "\x93\x02\xa1m\x90", 5), 0);
    read_message(peer, &u, &up);
    assert_int_equal(up.data.via.array.size, 3);
    assert_int_equal(pb_obj_strcmp(&up.data.via.array.ptr[1], "m"), 0);

    /* SCM_RIGHTS rides along with register_buffer. */
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    pk = pb_client_begin(c, "register_buffer");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "size");
    msgpack_pack_uint32(pk, 4096);
    assert_int_equal(pb_client_send_with_fd(c, pfd[1], &id), 0);
    char buf[256];
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct iovec iov = { .iov_base = buf, .iov_len = sizeof buf };
    struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b,
                          .msg_controllen = sizeof ctl.b };
    ssize_t n = recvmsg(peer, &msg, 0);
    assert_true(n > 0);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    assert_non_null(cm);
    assert_int_equal(cm->cmsg_type, SCM_RIGHTS);
    int got;
    memcpy(&got, CMSG_DATA(cm), sizeof got);
    write_all(got, "k", 1);
    char k = 0;
    assert_int_equal(read(pfd[0], &k, 1), 1);
    assert_int_equal(k, 'k');
    close(got);
    close(pfd[0]);
    close(pfd[1]);

    /* Writing to a closed peer is -EPIPE, without SIGPIPE. */
    close(peer);
    pk = pb_client_begin(c, "hello");
    msgpack_pack_map(pk, 0);
    assert_int_equal(pb_client_send(c, &id), -EPIPE);

    msgpack_unpacked_destroy(&up);
    msgpack_unpacker_destroy(&u);
    pb_client_close(c);
}

/* A packer that keeps the bytes it is given, except a body of 1 MiB or
 * more, which it only notes (never reading it). */
typedef struct {
    msgpack_sbuffer sb;
    size_t big;
} skim_t;

static int skim_write(void *data, const char *buf, size_t len)
{
    skim_t *k = data;
    if (len >= (1u << 20)) {
        k->big += len;
        return 0;
    }
    return msgpack_sbuffer_write(&k->sb, buf, len);
}

/* Tensor data of 4 GiB or more cannot be told in a bin32 header: refused,
 * never cut to 32 bits with all the bytes following.  The data is a sparse
 * mapping that nothing should read. */
static void test_pack_4gib(void **state)
{
    (void)state;
#if SIZE_MAX > UINT32_MAX
    const size_t huge = (size_t)1 << 32;
    void *p = mmap(NULL, huge, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    assert_true(p != MAP_FAILED);
    pb_ctensor_t t = { .dtype = "f32", .rank = 1, .shape = { huge / 4 }, .data = p, .nbytes = huge };

    /* Another packer: nil in place of the data, the map still whole. */
    skim_t k = { .big = 0 };
    msgpack_packer pk;
    msgpack_sbuffer_init(&k.sb);
    msgpack_packer_init(&pk, &k, skim_write);
    pb_pack_tensor(&pk, &t);
    assert_int_equal(k.big, 0);
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    assert_int_equal(msgpack_unpack_next(&up, k.sb.data, k.sb.size, &off), MSGPACK_UNPACK_SUCCESS);
    assert_int_equal(off, k.sb.size);
    assert_int_equal(pb_obj_get(&up.data, "data")->type, MSGPACK_OBJECT_NIL);
    msgpack_unpacked_destroy(&up);

    /* One byte less still fits. */
    k.sb.size = 0;
    t.nbytes = huge - 1;
    pb_pack_tensor(&pk, &t);
    assert_int_equal(k.big, huge - 1);
    assert_true(k.sb.size >= 5);
    assert_memory_equal(k.sb.data + k.sb.size - 5, "\xc6\xff\xff\xff\xff", 5);
    msgpack_sbuffer_destroy(&k.sb);

    /* A client's request: -EMSGSIZE at send, nothing written, and the
     * connection goes on. */
    int peer;
    pb_client_t *c = pair_client(&peer);
    uint32_t id = 0;
    t.nbytes = huge;
    msgpack_packer *cpk = pb_client_begin(c, "forward");
    msgpack_pack_map(cpk, 1);
    pb_pack_str(cpk, "A");
    pb_pack_tensor(cpk, &t);
    assert_int_equal(pb_client_send(c, &id), -EMSGSIZE);
    hello_is_next(c, peer);
    close(peer);
    pb_client_close(c);
    munmap(p, huge);
#else
    skip();
#endif
}

/* A negative fd is refused, and the begun request goes with it as with any
 * failing send: nothing is sent later without its fd. */
static void test_send_fd_refused(void **state)
{
    (void)state;
    int peer;
    pb_client_t *c = pair_client(&peer);
    uint32_t id = 0;

    msgpack_packer *pk = pb_client_begin(c, "register_buffer");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "size");
    msgpack_pack_uint32(pk, 4096);
    assert_int_equal(pb_client_send_with_fd(c, -1, &id), -EBADF);
    assert_int_equal(id, 0);
    assert_int_equal(pb_client_send(c, &id), -EINVAL); /* nothing begun */
    assert_int_equal(pb_client_send_with_fd(NULL, -1, &id), -EBADF);
    hello_is_next(c, peer);
    close(peer);
    pb_client_close(c);
}

/* ---- a send that fails part way ----------------------------------------- */

enum { TORN_REQ = 4 << 20 };

/* The daemon's side of a send that fails part way: once the client's first
 * bytes are there, it writes `what`, then reads nothing until `done` is
 * readable.  Should the client hang (it did when it stopped reading), it
 * reads the request after a while, so that the send returns and the test
 * fails instead of hanging. */
typedef struct {
    int peer, done;
    const msgpack_sbuffer *what;
    pthread_t th;
} interject_t;

static void *interject(void *arg)
{
    interject_t *t = arg;
    struct pollfd pfd = { .fd = t->peer, .events = POLLIN };
    if (poll(&pfd, 1, 10000) != 1)
        return NULL;
    write_all(t->peer, t->what->data, t->what->size);
    pfd = (struct pollfd){ .fd = t->done, .events = POLLIN };
    if (poll(&pfd, 1, 3000) == 1)
        return NULL;
    char buf[65536];
    ssize_t n;
    for (size_t total = 0; total < TORN_REQ && (n = read(t->peer, buf, sizeof buf)) > 0;)
        total += (size_t)n;
    return NULL;
}

/* Send a request of a TORN_REQ-byte tensor while peer writes `what` after
 * the first bytes; the send's result. */
static int send_interjected(pb_client_t *c, int peer, const msgpack_sbuffer *what)
{
    int done[2];
    assert_int_equal(pipe(done), 0);
    interject_t t = { .peer = peer, .done = done[0], .what = what };
    char *big = calloc(1, TORN_REQ);
    assert_non_null(big);
    pb_ctensor_t x = { .dtype = "f64", .rank = 1, .shape = { TORN_REQ / 8 }, .data = big, .nbytes = TORN_REQ };
    msgpack_packer *pk = pb_client_begin(c, "forward");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "x");
    pb_pack_tensor(pk, &x);
    assert_int_equal(pthread_create(&t.th, NULL, interject, &t), 0);
    int rc = pb_client_send(c, NULL);
    write_all(done[1], "", 1);
    assert_int_equal(pthread_join(t.th, NULL), 0);
    close(done[0]);
    close(done[1]);
    free(big);
    return rc;
}

/* A send fails after part of its request is out: when the replies read
 * meanwhile find no memory, and when the daemon sends bytes that are not
 * msgpack (the client then stopped reading and kept writing, which could
 * block forever).  The send says -EIO; nothing more is written, and every
 * later send and receive says -EIO, a reply queued before included. */
static void test_send_torn(void **state)
{
    (void)state;
    for (int junk = 0; junk < 2; junk++) {
        int peer;
        pb_client_t *c = pair_client(&peer);
        msgpack_sbuffer what;
        msgpack_packer pk;
        pb_reply_t r;
        uint32_t id;

        /* A small reply, then the start of one of 2 MiB (more than the
         * small buffer: the client needs the big one to read on), or junk. */
        msgpack_sbuffer_init(&what);
        msgpack_packer_init(&pk, &what, msgpack_sbuffer_write);
        pack_ok(&what, 1, 10);
        if (junk) {
            msgpack_sbuffer_write(&what, "\xc1", 1);
        } else {
            msgpack_pack_array(&pk, 4);
            msgpack_pack_int(&pk, 1);
            msgpack_pack_int(&pk, 2);
            msgpack_pack_nil(&pk);
            msgpack_pack_bin(&pk, 2u << 20);
            char *part = calloc(1, 100000);
            assert_non_null(part);
            msgpack_pack_bin_body(&pk, part, 100000);
            free(part);
            malloc_fails(1u << 20, SIZE_MAX);
        }
        int rc = send_interjected(c, peer, &what);
        malloc_fails(0, 0);
        assert_int_equal(rc, -EIO);
        size_t got = drain(peer);
        assert_true(got > 0 && got < TORN_REQ);

        msgpack_packer *hp = pb_client_begin(c, "hello");
        msgpack_pack_map(hp, 0);
        assert_int_equal(pb_client_send(c, &id), -EIO);
        hp = pb_client_begin_notify(c, "hello");
        msgpack_pack_map(hp, 0);
        assert_int_equal(pb_client_send_notify(c), -EIO);
        assert_int_equal(pb_client_send_raw(c, "\x90", 1), -EIO);
        hp = pb_client_begin(c, "hello");
        msgpack_pack_map(hp, 0);
        assert_int_equal(pb_client_call(c, &r), -EIO);
        assert_false(pb_client_pending(c));
        assert_int_equal(pb_client_recv(c, &r), -EIO);
        assert_int_equal(pb_client_recv_timeout(c, &r, 0), -EIO);
        assert_int_equal(pb_client_wait(c, 1, &r), -EIO);
        assert_int_equal(drain(peer), 0);

        msgpack_sbuffer_destroy(&what);
        close(peer);
        pb_client_close(c);
    }
}

/* Out of memory before the first byte of a request is out: -ENOMEM, the
 * request discarded, the connection as it was (the reply being read when
 * memory ran out comes whole afterwards). */
static void test_send_enomem_first(void **state)
{
    (void)state;
    int peer;
    pb_client_t *c = pair_client(&peer);
    msgpack_sbuffer sb;
    sb_writer_t w;
    pb_reply_t r;
    const size_t len = 2u << 20;

    msgpack_sbuffer_init(&sb);
    pack_ok(&sb, 1, 10);
    pack_bins(&sb, 2, 1, len, 9);
    write_start(&w, peer, &sb, 0);
    assert_int_equal(pb_client_recv(c, &r), 0);
    assert_int_equal(reply_n(&r), 10);
    pb_reply_free(&r);
    /* The big reply waits in the socket: the send reads it first. */
    malloc_fails(1u << 20, SIZE_MAX);
    msgpack_packer *pk = pb_client_begin(c, "release");
    msgpack_pack_map(pk, 0);
    assert_int_equal(pb_client_send(c, NULL), -ENOMEM);
    malloc_fails(0, 0);
    assert_int_equal(drain(peer), 0);
    assert_int_equal(pb_client_send(c, NULL), -EINVAL); /* discarded */
    hello_is_next(c, peer);
    assert_int_equal(pb_client_recv(c, &r), 0);
    check_bins(&r, 2, 1, len, 9);
    pb_reply_free(&r);
    write_join(&w);

    msgpack_sbuffer_destroy(&sb);
    close(peer);
    pb_client_close(c);
}

/* A client that pipelines a big request while the daemon is busy writing
 * big replies must not deadlock: the peer writes all its replies before it
 * reads a byte. */
static void test_pipeline_no_deadlock(void **state)
{
    (void)state;
    int peer;
    pb_client_t *c = pair_client(&peer);
    enum { NREPLY = 64, REPLY_BYTES = 64 * 1024, REQ_BYTES = 8 * 1024 * 1024 };

    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        pb_client_close(c);
        alarm(30);
        msgpack_sbuffer sb;
        msgpack_packer pk;
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        char *blob = calloc(1, REPLY_BYTES);
        for (uint32_t i = 0; i < NREPLY; i++) {
            msgpack_pack_array(&pk, 4);
            msgpack_pack_int(&pk, 1);
            msgpack_pack_uint32(&pk, 1000 + i);
            msgpack_pack_nil(&pk);
            msgpack_pack_bin(&pk, REPLY_BYTES);
            msgpack_pack_bin_body(&pk, blob, REPLY_BYTES);
        }
        write_all(peer, sb.data, sb.size);
        /* Freed before _exit: under valgrind the child's leak check sets
         * its exit status, which the parent reads. */
        free(blob);
        msgpack_sbuffer_destroy(&sb);
        size_t total = 0;
        char buf[65536];
        ssize_t r;
        while ((r = read(peer, buf, sizeof buf)) > 0)
            total += (size_t)r;
        _exit(total > REQ_BYTES ? 0 : 1);
    }

    alarm(30);
    char *big = calloc(1, REQ_BYTES);
    assert_non_null(big);
    pb_ctensor_t t = { .dtype = "f64", .rank = 1, .shape = { REQ_BYTES / 8 },
                       .data = big, .nbytes = REQ_BYTES };
    msgpack_packer *pk = pb_client_begin(c, "forward");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "x");
    pb_pack_tensor(pk, &t);
    assert_int_equal(pb_client_send(c, NULL), 0);
    free(big);
    close(peer);
    for (uint32_t i = 0; i < NREPLY; i++) {
        pb_reply_t r;
        assert_int_equal(pb_client_recv(c, &r), 0);
        assert_int_equal(r.msgid, 1000 + i);
        assert_int_equal(r.result->via.bin.size, REPLY_BYTES);
        pb_reply_free(&r);
    }
    pb_client_close(c);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    alarm(0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_obj_path),
        cmocka_unit_test(test_obj_empty_str),
        cmocka_unit_test(test_tensor_roundtrip),
        cmocka_unit_test(test_tensor_str_data),
        cmocka_unit_test(test_copy_refused),
        cmocka_unit_test(test_pack_into),
        cmocka_unit_test(test_socket_path),
        cmocka_unit_test(test_recv_partial),
        cmocka_unit_test(test_recv_two_in_one_read),
        cmocka_unit_test(test_unexpected_msgid_queued),
        cmocka_unit_test(test_recv_malformed),
        cmocka_unit_test(test_recv_timeout_not_early),
        cmocka_unit_test(test_recv_big_in_pieces),
        cmocka_unit_test(test_recv_big_and_small_in_one_read),
        cmocka_unit_test(test_recv_big_reuse),
        cmocka_unit_test(test_recv_enomem_loses_nothing),
        cmocka_unit_test(test_recv_limits),
        cmocka_unit_test(test_send_encoding),
        cmocka_unit_test(test_send_in_place),
        cmocka_unit_test(test_send_fd_refused),
        cmocka_unit_test(test_pack_4gib),
        cmocka_unit_test(test_send_torn),
        cmocka_unit_test(test_send_enomem_first),
        cmocka_unit_test(test_pipeline_no_deadlock),
        cmocka_unit_test(test_closed_with_reason),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
