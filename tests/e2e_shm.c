/* e2e.shm: shared-memory tensors (contract section 6) from outside, through
 * the C client library, against a daemon this program starts on a
 * temporary socket with --max-buffers-per-connection 4 and
 * --max-buffer-bytes-per-connection 16M.
 *
 * Run as `e2e_shm PATH_TO_PULLBACKD`.  A result computed from buffers is
 * compared byte for byte with the same request sent inline: the same
 * arithmetic on the same values gives the same bits, so the tolerance is
 * zero.  Accumulated gradients are compared with the sums formed here in
 * the dtype's own arithmetic (g + g, v + g), exact as well.  What the
 * daemon holds is read from /proc/PID/maps and /proc/PID/fd. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <linux/magic.h>
#include <sys/socket.h>
#include <sys/vfs.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "pullbackd.h"
#include "test_daemon.h"

static const char *daemon_bin;
static daemon_t dmn; /* the suite's daemon (test_daemon.h) */

#define MAX_BUFFERS 4
#define MIB ((size_t)1 << 20)

/* ---- the daemon ------------------------------------------------------------ */

static pb_client_t *conn(void)
{
    pb_client_t *c = NULL;
    assert_int_equal(pb_client_connect(dmn.sock, &c), 0);
    return c;
}

static bool daemon_alive(void)
{
    int st;
    return waitpid(dmn.pid, &st, WNOHANG) == 0;
}

/* Lines of the daemon's /proc maps that name needle. */
static int count_maps(const char *needle)
{
    char path[64], line[512];
    snprintf(path, sizeof path, "/proc/%d/maps", (int)dmn.pid);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    int n = 0;
    while (fgets(line, sizeof line, f))
        n += strstr(line, needle) != NULL;
    fclose(f);
    return n;
}

/* The daemon's open file descriptors. */
static int count_fds(void)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd", (int)dmn.pid);
    DIR *d = opendir(path);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Wait (up to 3 s) until f() == want; the last value. */
static int settle(int (*f)(void), int want)
{
    int v = f();
    for (int i = 0; i < 300 && v != want; i++) {
        sleep_ms(10);
        v = f();
    }
    return v;
}

static int maps_pbe2e(void) { return count_maps("memfd:pbe2e"); }

/* ---- buffers --------------------------------------------------------------- */

typedef struct {
    int fd;
    unsigned char *p;
    size_t size;
} shm_t;

static shm_t shm_new(size_t size)
{
    shm_t s = {.size = size};
    s.fd = memfd_create("pbe2e", MFD_CLOEXEC);
    assert_true(s.fd >= 0);
    assert_int_equal(ftruncate(s.fd, (off_t)size), 0);
    s.p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd, 0);
    assert_true(s.p != MAP_FAILED);
    return s;
}

static void shm_free(shm_t *s)
{
    if (s->p)
        munmap(s->p, s->size);
    close(s->fd);
    s->p = NULL;
}

/* register_buffer {size}, with fd (< 0: none) on its sendmsg. */
static void reg(pb_client_t *c, int fd, uint64_t size, pb_reply_t *r)
{
    msgpack_packer *pk = pb_client_begin(c, "register_buffer");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "size");
    msgpack_pack_uint64(pk, size);
    uint32_t id;
    assert_int_equal(fd >= 0 ? pb_client_send_with_fd(c, fd, &id) : pb_client_send(c, &id), 0);
    assert_int_equal(pb_client_wait(c, id, r), 0);
}

static uint64_t reg_ok(pb_client_t *c, int fd, uint64_t size)
{
    pb_reply_t r;
    reg(c, fd, size, &r);
    if (r.error)
        fail_msg("register_buffer: %s: %s", pb_reply_code(&r), pb_reply_message(&r));
    uint64_t id = 0;
    assert_int_equal(pb_obj_uint(pb_obj_get(r.result, "buffer"), &id), 0);
    pb_reply_free(&r);
    return id;
}

static void unreg(pb_client_t *c, uint64_t id, pb_reply_t *r)
{
    msgpack_packer *pk = pb_client_begin(c, "unregister_buffer");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "buffer");
    msgpack_pack_uint64(pk, id);
    assert_int_equal(pb_client_call(c, r), 0);
}

static void unreg_ok(pb_client_t *c, uint64_t id)
{
    pb_reply_t r;
    unreg(c, id, &r);
    assert_null(r.error);
    bool b = false;
    assert_int_equal(pb_obj_bool(pb_obj_get(r.result, "unregistered"), &b), 0);
    assert_true(b);
    pb_reply_free(&r);
}

static void expect_error(pb_reply_t *r, const char *code, const char *needle)
{
    if (r->error == NULL)
        fail_msg("expected %s (%s), got a result", code, needle ? needle : "");
    if (strcmp(pb_reply_code(r), code) != 0 || (needle && strstr(pb_reply_message(r), needle) == NULL))
        fail_msg("expected %s with \"%s\", got %s: %s", code, needle ? needle : "", pb_reply_code(r),
                 pb_reply_message(r));
    pb_reply_free(r);
}

static uint64_t stat_of(pb_client_t *c, const char *key)
{
    msgpack_packer *pk = pb_client_begin(c, "stats");
    msgpack_pack_map(pk, 0);
    pb_reply_t r;
    assert_int_equal(pb_client_call(c, &r), 0);
    uint64_t v = 0;
    assert_int_equal(pb_obj_uint(pb_obj_get(r.result, key), &v), 0);
    pb_reply_free(&r);
    return v;
}

/* Wait (up to 3 s) until c is the daemon's only connection and no buffer
 * is mapped: the connections earlier tests closed may still be going
 * when the daemon is busy, and they hold fds and mappings. */
static void quiesce(pb_client_t *c)
{
    for (int i = 0; i < 300; i++) {
        if (stat_of(c, "connections") == 1 && stat_of(c, "buffers") == 0)
            return;
        sleep_ms(10);
    }
    fail_msg("earlier connections did not go away");
}

/* ---- requests -------------------------------------------------------------- */

static size_t itemsize(const char *dtype) { return pb_ctensor_itemsize(dtype); }

/* Values in [-1, 1) from a seed, written as the dtype (complex: re, im). */
static void fill(void *dst, const char *dtype, size_t count, unsigned seed)
{
    size_t comps = count * (dtype[0] == 'c' ? 2 : 1);
    bool single = !strcmp(dtype, "f32") || !strcmp(dtype, "c64");
    uint32_t x = seed * 2654435761u + 12345u;
    for (size_t i = 0; i < comps; i++) {
        x = x * 1664525u + 1013904223u;
        double v = (double)(x >> 8) / (double)(1u << 24) * 2 - 1;
        if (single) {
            float f = (float)v;
            memcpy((char *)dst + i * 4, &f, 4);
        } else {
            memcpy((char *)dst + i * 8, &v, 8);
        }
    }
}

static size_t count_of(int rank, const uint64_t *shape)
{
    size_t n = 1;
    for (int i = 0; i < rank; i++)
        n *= shape[i];
    return n;
}

/* A tensor whose values are the bytes at p, sent inline or as a buffer
 * tensor {buffer, offset} (buffer 0: inline). */
static pb_ctensor_t tensor(const char *dtype, int rank, const uint64_t *shape, char order, const void *p,
                           uint64_t buffer, uint64_t offset)
{
    pb_ctensor_t t = {.dtype = dtype, .rank = rank, .order = order};
    memcpy(t.shape, shape, (size_t)rank * sizeof *shape);
    if (buffer) {
        t.shm = true;
        t.buffer = buffer;
        t.offset = offset;
    } else {
        t.data = p;
        t.nbytes = count_of(rank, shape) * itemsize(dtype);
    }
    return t;
}

typedef struct {
    const char *name;
    pb_ctensor_t t;
} arg_t;

typedef pb_into_t into_t;

/* forward / augmented_forward params. */
typedef struct {
    const char *method;
    const char *op;
    const arg_t *in;
    int nin;
    const char *act;          /* fused_dense's act; NULL: no options */
    const char *const *wrt;   /* NULL-terminated; NULL: none (forward) */
    const into_t *into;
    int ninto;                /* < 0: an empty into map; 0: no into key */
    const char *order;        /* NULL: absent */
    int accumulate;           /* -1: absent */
} call_t;

typedef struct {
    uint64_t tape;
    const arg_t *cot;
    int ncot;
    const into_t *into;
    int ninto;
    const char *order;
    int accumulate;           /* -1: absent */
    bool keep;
} rev_t;

static void pack_args(msgpack_packer *pk, const char *key, const arg_t *a, int n)
{
    pb_pack_str(pk, key);
    msgpack_pack_map(pk, (size_t)n);
    for (int i = 0; i < n; i++) {
        pb_pack_str(pk, a[i].name);
        pb_pack_tensor(pk, &a[i].t);
    }
}

static uint32_t send_call(pb_client_t *c, const call_t *k)
{
    msgpack_packer *pk = pb_client_begin(c, k->method);
    int nw = 0;
    while (k->wrt && k->wrt[nw])
        nw++;
    msgpack_pack_map(pk, 2 + (k->act != NULL) + (k->wrt != NULL) + (k->ninto != 0) + (k->order != NULL) +
                             (k->accumulate >= 0));
    pb_pack_kv_str(pk, "op", k->op);
    pack_args(pk, "inputs", k->in, k->nin);
    if (k->act) {
        pb_pack_str(pk, "options");
        msgpack_pack_map(pk, 1);
        pb_pack_kv_str(pk, "act", k->act);
    }
    if (k->wrt) {
        pb_pack_str(pk, "wrt");
        msgpack_pack_array(pk, (size_t)nw);
        for (int i = 0; i < nw; i++)
            pb_pack_str(pk, k->wrt[i]);
    }
    if (k->ninto)
        pb_pack_into(pk, k->into, k->ninto > 0 ? (size_t)k->ninto : 0);
    if (k->order)
        pb_pack_kv_str(pk, "order", k->order);
    if (k->accumulate >= 0) {
        pb_pack_str(pk, "accumulate");
        if (k->accumulate)
            msgpack_pack_true(pk);
        else
            msgpack_pack_false(pk);
    }
    uint32_t id;
    assert_int_equal(pb_client_send(c, &id), 0);
    return id;
}

static uint32_t send_rev(pb_client_t *c, const rev_t *k)
{
    msgpack_packer *pk = pb_client_begin(c, "reverse");
    msgpack_pack_map(pk, 2 + (k->ninto != 0) + (k->order != NULL) + (k->accumulate >= 0) + k->keep);
    pb_pack_str(pk, "tape");
    msgpack_pack_uint64(pk, k->tape);
    pack_args(pk, "cotangents", k->cot, k->ncot);
    if (k->ninto)
        pb_pack_into(pk, k->into, k->ninto > 0 ? (size_t)k->ninto : 0);
    if (k->order)
        pb_pack_kv_str(pk, "order", k->order);
    if (k->accumulate >= 0) {
        pb_pack_str(pk, "accumulate");
        if (k->accumulate)
            msgpack_pack_true(pk);
        else
            msgpack_pack_false(pk);
    }
    if (k->keep) {
        pb_pack_str(pk, "keep");
        msgpack_pack_true(pk);
    }
    uint32_t id;
    assert_int_equal(pb_client_send(c, &id), 0);
    return id;
}

static void call_ok(pb_client_t *c, uint32_t id, pb_reply_t *r)
{
    assert_int_equal(pb_client_wait(c, id, r), 0);
    if (r->error)
        fail_msg("%s: %s", pb_reply_code(r), pb_reply_message(r));
}

static void call_err(pb_client_t *c, uint32_t id, const char *code, const char *needle)
{
    pb_reply_t r;
    assert_int_equal(pb_client_wait(c, id, &r), 0);
    expect_error(&r, code, needle);
}

static uint64_t tape_of(const pb_reply_t *r)
{
    uint64_t t = 0;
    assert_int_equal(pb_obj_uint(pb_obj_get(r->result, "tape"), &t), 0);
    return t;
}

/* The inline tensor at path of a reply, with at least one byte. */
static pb_ctensor_t inline_at(const pb_reply_t *r, const char *path)
{
    pb_ctensor_t t;
    const msgpack_object *o = pb_obj_path(r->result, path);
    if (o == NULL)
        fail_msg("no %s in the reply", path);
    assert_int_equal(pb_obj_tensor(o, &t), 0);
    assert_false(t.shm);
    assert_true(t.nbytes > 0);
    return t;
}

/* Two inline results hold the same tensor, bit for bit. */
static void same_tensor(const pb_reply_t *a, const pb_reply_t *b, const char *path)
{
    pb_ctensor_t x = inline_at(a, path), y = inline_at(b, path);
    assert_string_equal(x.dtype, y.dtype);
    assert_int_equal(x.rank, y.rank);
    assert_memory_equal(x.shape, y.shape, (size_t)x.rank * sizeof x.shape[0]);
    assert_int_equal(x.order, y.order);
    assert_int_equal(x.nbytes, y.nbytes);
    assert_memory_equal(x.data, y.data, x.nbytes);
}

/* The result at path of got was written into buffer (mapped at base) at
 * offset, and holds what ref (inline) holds at the same path. */
static void in_buffer(const pb_reply_t *got, const pb_reply_t *ref, const char *path, const unsigned char *base,
                      uint64_t buffer, uint64_t offset)
{
    const msgpack_object *o = pb_obj_path(got->result, path);
    if (o == NULL)
        fail_msg("no %s in the reply", path);
    assert_null(pb_obj_get(o, "data"));
    pb_ctensor_t t;
    assert_int_equal(pb_obj_tensor(o, &t), 0);
    assert_true(t.shm);
    assert_int_equal(t.buffer, buffer);
    assert_int_equal(t.offset, offset);
    pb_ctensor_t r = inline_at(ref, path);
    assert_string_equal(t.dtype, r.dtype);
    assert_int_equal(t.rank, r.rank);
    assert_memory_equal(t.shape, r.shape, (size_t)t.rank * sizeof t.shape[0]);
    assert_int_equal(t.order, r.order);
    assert_memory_equal(base + offset, r.data, r.nbytes);
}

/* fused_dense: W out×in, x in×batch, b out, laid into buffer region p at
 * offsets 0, xo and bo (and sent from there when buffer != 0). */
typedef struct {
    const char *dtype;
    uint64_t out, in, batch;
    char xorder;
    size_t xo, bo;
} fdl_t;

static void fd_fill(const fdl_t *f, unsigned char *p, unsigned seed)
{
    fill(p, f->dtype, f->out * f->in, seed);
    fill(p + f->xo, f->dtype, f->in * f->batch, seed + 1);
    fill(p + f->bo, f->dtype, f->out, seed + 2);
}

/* The three inputs of f, from p (buffer 0: inline; else p is the mapping
 * of buffer and the offsets are base + ...). */
static void fd_args(const fdl_t *f, const unsigned char *p, uint64_t buffer, uint64_t base, arg_t a[3])
{
    uint64_t ws[2] = {f->out, f->in}, xs[2] = {f->in, f->batch}, bs[1] = {f->out};
    a[0] = (arg_t){"weight", tensor(f->dtype, 2, ws, 'C', p, buffer, base)};
    a[1] = (arg_t){"x", tensor(f->dtype, 2, xs, f->xorder, p + f->xo, buffer, base + f->xo)};
    a[2] = (arg_t){"bias", tensor(f->dtype, 1, bs, 0, p + f->bo, buffer, base + f->bo)};
}

/* ---- tests ----------------------------------------------------------------- */

/* Inputs read from a buffer give the very bytes the same inputs sent
 * inline give: fused_dense in both dtypes, x in both orders, a tiny call
 * (run on the loop thread) and a larger one (run on a worker). */
static void forward_from_buffer(void **state)
{
    (void)state;
    pb_client_t *c = conn();
    shm_t s = shm_new(MIB);
    uint64_t id = reg_ok(c, s.fd, s.size);
    const char *dtypes[] = {"f64", "f32"};
    const uint64_t sizes[2][3] = {{2, 3, 2}, {48, 64, 40}};
    unsigned seed = 1;
    for (int d = 0; d < 2; d++)
        for (int z = 0; z < 2; z++)
            for (int xo = 0; xo < 2; xo++) {
                fdl_t f = {dtypes[d], sizes[z][0], sizes[z][1], sizes[z][2], xo ? 'F' : 'C', 64 << 10, 128 << 10};
                fd_fill(&f, s.p + 4096, seed++);
                arg_t ai[3], ab[3];
                fd_args(&f, s.p + 4096, 0, 0, ai);
                fd_args(&f, s.p + 4096, id, 4096, ab);
                call_t k = {"forward", "fused_dense", ai, 3, "gelu", NULL, NULL, 0, NULL, -1};
                pb_reply_t ri, rb;
                call_ok(c, send_call(c, &k), &ri);
                k.in = ab;
                call_ok(c, send_call(c, &k), &rb);
                same_tensor(&ri, &rb, "outputs.y");
                pb_reply_free(&ri);
                pb_reply_free(&rb);
            }
    unreg_ok(c, id);
    shm_free(&s);
    pb_client_close(c);
}

/* A factorization from a buffer, and its outputs into the buffer: the
 * bytes of inline requests.  svd_compact c128 (A in F order, S real f64)
 * and qr_compact f32. */
static void factorization(void **state)
{
    (void)state;
    pb_client_t *c = conn();
    shm_t s = shm_new(MIB);
    uint64_t id = reg_ok(c, s.fd, s.size);
    struct {
        const char *op, *dtype;
        char order;
        const char *outs[3];
    } cases[] = {{"svd_compact", "c128", 'F', {"U", "S", "Vh"}}, {"qr_compact", "f32", 'C', {"Q", "R", NULL}}};
    for (int i = 0; i < 2; i++) {
        uint64_t shape[2] = {7, 5};
        fill(s.p + 4096, cases[i].dtype, 35, 40u + (unsigned)i);
        arg_t ai = {"A", tensor(cases[i].dtype, 2, shape, cases[i].order, s.p + 4096, 0, 0)};
        arg_t ab = {"A", tensor(cases[i].dtype, 2, shape, cases[i].order, NULL, id, 4096)};
        call_t k = {"forward", cases[i].op, &ai, 1, NULL, NULL, NULL, 0, NULL, -1};
        pb_reply_t ri, rb, rt;
        call_ok(c, send_call(c, &k), &ri);
        k.in = &ab;
        call_ok(c, send_call(c, &k), &rb);
        into_t into[3];
        int n = 0;
        char paths[3][32];
        for (int o = 0; o < 3 && cases[i].outs[o]; o++, n++) {
            snprintf(paths[o], sizeof paths[o], "outputs.%s", cases[i].outs[o]);
            same_tensor(&ri, &rb, paths[o]);
            into[o] = (into_t){cases[i].outs[o], id, (uint64_t)(256 << 10) + (uint64_t)o * (64 << 10)};
        }
        k.into = into;
        k.ninto = n;
        call_ok(c, send_call(c, &k), &rt);
        for (int o = 0; o < n; o++)
            in_buffer(&rt, &ri, paths[o], s.p, id, into[o].offset);
        pb_reply_free(&ri);
        pb_reply_free(&rb);
        pb_reply_free(&rt);
    }
    unreg_ok(c, id);
    shm_free(&s);
    pb_client_close(c);
}

/* Outputs into a buffer, in both orders; then augmented_forward into a
 * buffer, the client scribbles over that output, and the reverse still
 * uses the tape's own copy. */
static void forward_into(void **state)
{
    (void)state;
    pb_client_t *c = conn();
    shm_t s = shm_new(MIB);
    uint64_t id = reg_ok(c, s.fd, s.size);
    unsigned char *vals = malloc(MIB);
    fdl_t f = {"f64", 48, 64, 40, 'C', 64 << 10, 128 << 10};
    fd_fill(&f, vals, 7);
    arg_t a[3];
    fd_args(&f, vals, 0, 0, a);
    const char *orders[] = {NULL, "F"};
    for (int o = 0; o < 2; o++) {
        call_t k = {"forward", "fused_dense", a, 3, "tanh", NULL, NULL, 0, orders[o], -1};
        pb_reply_t ri, rb;
        call_ok(c, send_call(c, &k), &ri);
        into_t into = {"y", id, 512 << 10};
        k.into = &into;
        k.ninto = 1;
        call_ok(c, send_call(c, &k), &rb);
        in_buffer(&rb, &ri, "outputs.y", s.p, id, into.offset);
        pb_ctensor_t t;
        assert_int_equal(pb_obj_tensor(pb_obj_path(rb.result, "outputs.y"), &t), 0);
        assert_int_equal(t.order, o ? 'F' : 'C');
        pb_reply_free(&ri);
        pb_reply_free(&rb);
    }

    const char *const wrt[] = {"weight", "x", "bias", NULL};
    uint64_t ys[2] = {f.out, f.batch};
    unsigned char ybar[48 * 40 * 8];
    fill(ybar, "f64", f.out * f.batch, 99);
    arg_t cot = {"y", tensor("f64", 2, ys, 'C', ybar, 0, 0)};
    call_t k = {"augmented_forward", "fused_dense", a, 3, "tanh", wrt, NULL, 0, NULL, -1};
    pb_reply_t ai, ab, gi, gb;
    call_ok(c, send_call(c, &k), &ai);
    into_t into = {"y", id, 512 << 10};
    k.into = &into;
    k.ninto = 1;
    call_ok(c, send_call(c, &k), &ab);
    in_buffer(&ab, &ai, "outputs.y", s.p, id, into.offset);
    memset(s.p + into.offset, 0x7f, f.out * f.batch * 8);
    rev_t rv = {tape_of(&ai), &cot, 1, NULL, 0, NULL, -1, false};
    call_ok(c, send_rev(c, &rv), &gi);
    rv.tape = tape_of(&ab);
    call_ok(c, send_rev(c, &rv), &gb);
    same_tensor(&gi, &gb, "gradients.weight");
    same_tensor(&gi, &gb, "gradients.x");
    same_tensor(&gi, &gb, "gradients.bias");
    pb_reply_free(&ai);
    pb_reply_free(&ab);
    pb_reply_free(&gi);
    pb_reply_free(&gb);
    free(vals);
    unreg_ok(c, id);
    shm_free(&s);
    pb_client_close(c);
}

/* The sums accumulate must leave: dst[i] + src[i] in the dtype. */
static void add_as(const char *dtype, unsigned char *dst, const void *src, size_t bytes)
{
    if (!strcmp(dtype, "f32") || !strcmp(dtype, "c64")) {
        for (size_t i = 0; i < bytes / 4; i++) {
            float a, b;
            memcpy(&a, dst + i * 4, 4);
            memcpy(&b, (const char *)src + i * 4, 4);
            a += b;
            memcpy(dst + i * 4, &a, 4);
        }
    } else {
        for (size_t i = 0; i < bytes / 8; i++) {
            double a, b;
            memcpy(&a, dst + i * 8, 8);
            memcpy(&b, (const char *)src + i * 8, 8);
            a += b;
            memcpy(dst + i * 8, &a, 8);
        }
    }
}

/* Gradients into a buffer, in both orders, and with accumulate: twice onto
 * zeros gives 2g, once onto v gives v + g.  Inputs and the cotangent come
 * from the buffer, which the client overwrites after the augmented
 * forward: the tape kept its own copy. */
static void reverse_into(void **state)
{
    (void)state;
    pb_client_t *c = conn();
    shm_t s = shm_new(2 * MIB);
    uint64_t id = reg_ok(c, s.fd, s.size);
    const char *dtypes[] = {"f64", "f32"};
    const char *orders[] = {NULL, "F"};
    const char *const wrt[] = {"weight", "x", "bias", NULL};
    for (int d = 0; d < 2; d++)
        for (int o = 0; o < 2; o++) {
            fdl_t f = {dtypes[d], 24, 32, 16, o ? 'F' : 'C', 16 << 10, 32 << 10};
            unsigned char *in = s.p, *ybar = s.p + (48 << 10);
            fd_fill(&f, in, 20u + (unsigned)(d * 2 + o));
            fill(ybar, f.dtype, f.out * f.batch, 30u + (unsigned)d);
            uint64_t ys[2] = {f.out, f.batch};
            arg_t ai[3], ab[3];
            fd_args(&f, in, 0, 0, ai);
            fd_args(&f, in, id, 0, ab);
            arg_t cot = {"y", tensor(f.dtype, 2, ys, 'C', ybar, 0, 0)};
            arg_t cotb = {"y", tensor(f.dtype, 2, ys, 'C', NULL, id, 48 << 10)};
            call_t k = {"augmented_forward", "fused_dense", ai, 3, "gelu", wrt, NULL, 0, orders[o], -1};
            pb_reply_t r, gi;
            call_ok(c, send_call(c, &k), &r);
            uint64_t ti = tape_of(&r);
            pb_reply_free(&r);
            rev_t rv = {ti, &cot, 1, NULL, 0, orders[o], -1, false};
            call_ok(c, send_rev(c, &rv), &gi); /* the reference */

            k.in = ab;
            call_ok(c, send_call(c, &k), &r);
            uint64_t tb = tape_of(&r);
            pb_reply_free(&r);
            rv.tape = tb;
            rv.cot = &cotb;
            rv.keep = true;
            /* into, in the order asked; bias stays inline */
            const uint64_t wo = 1 * MIB, xo = 1 * MIB + (64 << 10), acc = 1 * MIB + (128 << 10);
            into_t into[2] = {{"weight", id, wo}, {"x", id, xo}};
            rv.into = into;
            rv.ninto = 2;
            call_ok(c, send_rev(c, &rv), &r);
            in_buffer(&r, &gi, "gradients.weight", s.p, id, wo);
            in_buffer(&r, &gi, "gradients.x", s.p, id, xo);
            same_tensor(&r, &gi, "gradients.bias");
            pb_reply_free(&r);
            /* The client's buffer changes; the tape does not. */
            memset(in, 0, 48 << 10);
            /* accumulate twice onto zeros */
            pb_ctensor_t gw = inline_at(&gi, "gradients.weight");
            memset(s.p + acc, 0, gw.nbytes);
            unsigned char *want = calloc(1, gw.nbytes);
            into_t ia = {"weight", id, acc};
            rv.into = &ia;
            rv.ninto = 1;
            rv.accumulate = 1;
            for (int i = 0; i < 2; i++) {
                call_ok(c, send_rev(c, &rv), &r);
                pb_reply_free(&r);
                add_as(f.dtype, want, gw.data, gw.nbytes);
            }
            assert_memory_equal(s.p + acc, want, gw.nbytes);
            /* once onto v */
            fill(s.p + acc, f.dtype, f.out * f.in, 77);
            memcpy(want, s.p + acc, gw.nbytes);
            add_as(f.dtype, want, gw.data, gw.nbytes);
            rv.keep = false;
            call_ok(c, send_rev(c, &rv), &r);
            pb_ctensor_t t;
            assert_int_equal(pb_obj_tensor(pb_obj_path(r.result, "gradients.weight"), &t), 0);
            assert_true(t.shm);
            assert_int_equal(t.order, o ? 'F' : 'C');
            pb_reply_free(&r);
            assert_memory_equal(s.p + acc, want, gw.nbytes);
            free(want);
            pb_reply_free(&gi);
        }
    unreg_ok(c, id);
    shm_free(&s);
    pb_client_close(c);
}

/* accumulate on complex gradients: svd_compact c128, the cotangent of S
 * only (gauge invariant), A's gradient accumulated twice onto zeros. */
static void accumulate_complex(void **state)
{
    (void)state;
    pb_client_t *c = conn();
    shm_t s = shm_new(MIB);
    uint64_t id = reg_ok(c, s.fd, s.size);
    uint64_t shape[2] = {6, 4}, ss[1] = {4};
    fill(s.p, "c128", 24, 5);
    fill(s.p + 4096, "f64", 4, 6);
    arg_t a = {"A", tensor("c128", 2, shape, 'C', NULL, id, 0)};
    arg_t cot = {"S", tensor("f64", 1, ss, 0, NULL, id, 4096)};
    const char *const wrt[] = {"A", NULL};
    call_t k = {"augmented_forward", "svd_compact", &a, 1, NULL, wrt, NULL, 0, NULL, -1};
    pb_reply_t r, g;
    call_ok(c, send_call(c, &k), &r);
    rev_t rv = {tape_of(&r), &cot, 1, NULL, 0, NULL, -1, true};
    pb_reply_free(&r);
    call_ok(c, send_rev(c, &rv), &g);
    pb_ctensor_t ga = inline_at(&g, "gradients.A");
    assert_string_equal(ga.dtype, "c128");
    const uint64_t acc = 64 << 10;
    memset(s.p + acc, 0, ga.nbytes);
    into_t into = {"A", id, acc};
    rv.into = &into;
    rv.ninto = 1;
    rv.accumulate = 1;
    unsigned char want[24 * 16] = {0};
    for (int i = 0; i < 2; i++) {
        call_ok(c, send_rev(c, &rv), &r);
        pb_reply_free(&r);
        add_as("c128", want, ga.data, ga.nbytes);
    }
    assert_memory_equal(s.p + acc, want, ga.nbytes);
    pb_reply_free(&g);
    unreg_ok(c, id);
    shm_free(&s);
    pb_client_close(c);
}

/* Send buf with nfds fds on one sendmsg. */
static void send_fds_raw(pb_client_t *c, const void *buf, size_t n, const int *fds, int nfds)
{
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int) * 32)];
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct iovec iov = {(void *)buf, n};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds) {
        m.msg_control = ctl.b;
        m.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)nfds);
    }
    assert_int_equal(sendmsg(pb_client_fd(c), &m, MSG_NOSIGNAL), (ssize_t)n);
}

/* [type, msgid, method, [{size}]] (type 2: a notification, no msgid). */
static void pack_register(msgpack_sbuffer *sb, int type, uint32_t msgid, uint64_t size)
{
    msgpack_packer pk;
    msgpack_sbuffer_init(sb);
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, type == 2 ? 3 : 4);
    msgpack_pack_int(&pk, type);
    if (type != 2)
        msgpack_pack_uint32(&pk, msgid);
    pb_pack_str(&pk, "register_buffer");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 1);
    pb_pack_str(&pk, "size");
    msgpack_pack_uint64(&pk, size);
}

/* Append to sb (initialised) a request of method with empty params. */
static void pack_plain(msgpack_sbuffer *sb, uint32_t msgid, const char *method)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 4);
    msgpack_pack_int(&pk, 0);
    msgpack_pack_uint32(&pk, msgid);
    pb_pack_str(&pk, method);
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 0);
}

/* Every refusal, each invalid_argument with a message that says why,
 * except the limit (resource_exhausted naming it). */
static void errors(void **state)
{
    (void)state;
    pb_client_t *c = conn();
    shm_t s = shm_new(64 << 10);
    pb_reply_t r;
    /* register_buffer */
    reg(c, -1, 4096, &r);
    expect_error(&r, "invalid_argument", "file descriptor");
    reg(c, s.fd, s.size + 1, &r);
    expect_error(&r, "invalid_argument", "more than the file");
    reg(c, s.fd, 0, &r);
    expect_error(&r, "invalid_argument", "positive");
    msgpack_packer *pk = pb_client_begin(c, "register_buffer");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "size");
    msgpack_pack_int(pk, -8);
    uint32_t mid;
    assert_int_equal(pb_client_send_with_fd(c, s.fd, &mid), 0);
    call_err(c, mid, "invalid_argument", "positive");
    pk = pb_client_begin(c, "register_buffer");
    msgpack_pack_map(pk, 2);
    pb_pack_str(pk, "size");
    msgpack_pack_uint64(pk, 8);
    pb_pack_kv_str(pk, "name", "x");
    assert_int_equal(pb_client_send_with_fd(c, s.fd, &mid), 0);
    call_err(c, mid, "invalid_argument", "unknown key");
    /* Two fds on one register_buffer. */
    int two[2] = {s.fd, s.fd};
    msgpack_sbuffer sb;
    pack_register(&sb, 0, 0xbeef, 4096);
    send_fds_raw(c, sb.data, sb.size, two, 2);
    msgpack_sbuffer_destroy(&sb);
    call_err(c, 0xbeef, "invalid_argument", "one file descriptor");
    /* Not a regular file: a socket. */
    int sp[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sp), 0);
    reg(c, sp[0], 8, &r);
    expect_error(&r, "invalid_argument", "socket");
    close(sp[0]);
    close(sp[1]);
    /* A file of another filesystem (this program, unless the build
     * lives on tmpfs): not a memfd or shm file. */
    int exe = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    struct statfs sf;
    assert_true(exe >= 0);
    assert_int_equal(fstatfs(exe, &sf), 0);
    if (sf.f_type != TMPFS_MAGIC && sf.f_type != HUGETLBFS_MAGIC) {
        reg(c, exe, 8, &r);
        expect_error(&r, "invalid_argument", "not a memfd or shared-memory file");
    }
    close(exe);
    /* Not readable. */
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", s.fd);
    int wo = open(path, O_WRONLY);
    assert_true(wo >= 0);
    reg(c, wo, 8, &r);
    expect_error(&r, "invalid_argument", "reading");
    close(wo);

    /* tensors that name buffers */
    uint64_t id = reg_ok(c, s.fd, s.size);
    fill(s.p, "f64", 8192, 3);
    uint64_t ws[2] = {4, 4}, xs[2] = {4, 2};
    struct {
        uint64_t buffer, offset;
        const char *needle;
    } bad[] = {
        {id + 100, 0, "not registered"},
        {id, s.size, "past the end"},                        /* starts at the end */
        {id, s.size - 64, "past the end"},                   /* runs over the end */
        {id, UINT64_MAX - 7, "past the end"},                /* offset + bytes overflows */
        {id, ((uint64_t)1 << 63) + 8, "past the end"},
        {id, 4, "aligned"},                                  /* 4 is not a multiple of 8 */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        arg_t a[2] = {{"weight", tensor("f64", 2, ws, 0, NULL, bad[i].buffer, bad[i].offset)},
                      {"x", tensor("f64", 2, xs, 0, NULL, id, 1024)}};
        call_t k = {"forward", "fused_dense", a, 2, NULL, NULL, NULL, 0, NULL, -1};
        call_err(c, send_call(c, &k), "invalid_argument", bad[i].needle);
    }
    /* The same offset is fine for a c64 tensor's 8-byte elements but not
     * for c128's 16: the rule is the element size. */
    {
        uint64_t as[2] = {3, 3};
        arg_t a = {"A", tensor("c64", 2, as, 0, NULL, id, 8)};
        call_t k = {"forward", "qr_compact", &a, 1, NULL, NULL, NULL, 0, NULL, -1};
        call_ok(c, send_call(c, &k), &r);
        pb_reply_free(&r);
        a.t.dtype = "c128";
        call_err(c, send_call(c, &k), "invalid_argument", "16 bytes");
    }
    /* hand-made maps: data and buffer; buffer without offset; offset
     * without buffer; a negative offset */
    for (int i = 0; i < 4; i++) {
        pk = pb_client_begin(c, "forward");
        msgpack_pack_map(pk, 2);
        pb_pack_kv_str(pk, "op", "qr_compact");
        pb_pack_str(pk, "inputs");
        msgpack_pack_map(pk, 1);
        pb_pack_str(pk, "A");
        msgpack_pack_map(pk, i == 0 ? 5 : i == 3 ? 4 : 3);
        pb_pack_kv_str(pk, "dtype", "f64");
        pb_pack_str(pk, "shape");
        msgpack_pack_array(pk, 2);
        msgpack_pack_uint64(pk, 2);
        msgpack_pack_uint64(pk, 2);
        if (i == 0) {
            pb_pack_str(pk, "data");
            msgpack_pack_bin_with_body(pk, s.p, 32);
        }
        if (i != 2) {
            pb_pack_str(pk, "buffer");
            msgpack_pack_uint64(pk, id);
        }
        if (i != 1) {
            pb_pack_str(pk, "offset");
            if (i == 3)
                msgpack_pack_int(pk, -8);
            else
                msgpack_pack_uint64(pk, 0);
        }
        assert_int_equal(pb_client_send(c, &mid), 0);
        const char *needles[] = {"not both", "needs offset", "needs buffer", "non-negative"};
        call_err(c, mid, "invalid_argument", needles[i]);
    }

    /* into */
    uint64_t as[2] = {5, 3};
    fill(s.p + 8192, "f64", 15, 8);
    arg_t a = {"A", tensor("f64", 2, as, 0, NULL, id, 8192)};
    struct {
        into_t into[2];
        int n;
        const char *needle;
    } bi[] = {
        {{{"Z", id, 0}}, 1, "no output"},
        {{{"Q", id + 100, 0}}, 1, "not registered"},
        {{{"Q", id, s.size - 64}}, 1, "past the end"},     /* Q is 5×3 f64: 120 bytes */
        {{{"Q", id, UINT64_MAX - 7}}, 1, "past the end"},
        {{{"Q", id, 12}}, 1, "aligned"},
        {{{"Q", id, 0}, {"R", id, 64}}, 2, "overlap"},
    };
    for (size_t i = 0; i < sizeof bi / sizeof bi[0]; i++) {
        call_t k = {"forward", "qr_compact", &a, 1, NULL, NULL, bi[i].into, bi[i].n, NULL, -1};
        call_err(c, send_call(c, &k), "invalid_argument", bi[i].needle);
    }
    {
        into_t ok = {"Q", id, 16384};
        call_t k = {"forward", "qr_compact", &a, 1, NULL, NULL, &ok, 1, NULL, 1};
        call_err(c, send_call(c, &k), "invalid_argument", "accumulate is reverse's");
        k.accumulate = 0; /* false is harmless */
        call_ok(c, send_call(c, &k), &r);
        pb_reply_free(&r);
        k.ninto = -1; /* an empty into map: everything inline */
        call_ok(c, send_call(c, &k), &r);
        assert_non_null(pb_obj_path(r.result, "outputs.Q.data"));
        pb_reply_free(&r);
        /* into on check is an unknown key */
        k.method = "check";
        k.ninto = 1;
        k.accumulate = -1;
        const char *const w[] = {"A", NULL};
        k.wrt = w;
        call_err(c, send_call(c, &k), "invalid_argument", "unknown key");
    }
    /* reverse: into a gradient not in wrt, accumulate without into,
     * accumulate not a bool */
    {
        const char *const w[] = {"A", NULL};
        uint64_t qs[2] = {5, 3};
        fill(s.p + 16384, "f64", 15, 9);
        arg_t cot = {"Q", tensor("f64", 2, qs, 0, NULL, id, 16384)};
        call_t k = {"augmented_forward", "tensoradd", NULL, 0, NULL, w, NULL, 0, NULL, -1};
        arg_t ta[1] = {{"A", tensor("f64", 2, as, 0, NULL, id, 8192)}};
        k.in = ta;
        k.nin = 1;
        call_ok(c, send_call(c, &k), &r);
        uint64_t tape = tape_of(&r);
        pb_reply_free(&r);
        cot.name = "C";
        into_t wrong = {"alpha", id, 0};
        rev_t rv = {tape, &cot, 1, &wrong, 1, NULL, -1, true};
        call_err(c, send_rev(c, &rv), "invalid_argument", "not in the tape's wrt");
        rv.ninto = 0;
        rv.accumulate = 1;
        call_err(c, send_rev(c, &rv), "invalid_argument", "no into");
        into_t ro = {"A", id, 0};
        rv.into = &ro;
        rv.ninto = 1;
        rv.accumulate = -1;
        rv.keep = false;
        call_ok(c, send_rev(c, &rv), &r); /* the tape survived the refusals */
        pb_reply_free(&r);
    }

    /* unregister, then use */
    unreg_ok(c, id);
    arg_t a2 = {"A", tensor("f64", 2, as, 0, NULL, id, 8192)};
    call_t k = {"forward", "qr_compact", &a2, 1, NULL, NULL, NULL, 0, NULL, -1};
    call_err(c, send_call(c, &k), "invalid_argument", "not registered");
    unreg(c, id, &r);
    expect_error(&r, "invalid_argument", "not registered");
    unreg(c, 12345, &r);
    expect_error(&r, "invalid_argument", "not registered");
    pk = pb_client_begin(c, "unregister_buffer");
    msgpack_pack_map(pk, 1);
    pb_pack_kv_str(pk, "buffer", "one");
    assert_int_equal(pb_client_send(c, &mid), 0);
    call_err(c, mid, "invalid_argument", "buffer");
    shm_free(&s);
    pb_client_close(c);
}

/* A read-only fd gives a read-only buffer: fine as an input, refused as
 * into. */
static void read_only(void **state)
{
    (void)state;
    pb_client_t *c = conn();
    shm_t s = shm_new(64 << 10);
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", s.fd);
    int ro = open(path, O_RDONLY);
    assert_true(ro >= 0);
    uint64_t id = reg_ok(c, ro, s.size);
    close(ro);
    uint64_t rw = reg_ok(c, s.fd, s.size);
    fill(s.p, "f64", 15, 10);
    uint64_t as[2] = {5, 3};
    arg_t a = {"A", tensor("f64", 2, as, 0, NULL, id, 0)};
    call_t k = {"forward", "qr_compact", &a, 1, NULL, NULL, NULL, 0, NULL, -1};
    pb_reply_t r;
    call_ok(c, send_call(c, &k), &r);
    pb_reply_free(&r);
    into_t into = {"Q", id, 4096};
    k.into = &into;
    k.ninto = 1;
    call_err(c, send_call(c, &k), "invalid_argument", "read-only");
    into.buffer = rw; /* the same file through a writable fd */
    call_ok(c, send_call(c, &k), &r);
    pb_reply_free(&r);
    unreg_ok(c, id);
    unreg_ok(c, rw);
    shm_free(&s);
    pb_client_close(c);
}

/* At most MAX_BUFFERS per connection and 16 MiB of them
 * (resource_exhausted naming the limit); ids grow and are never reused. */
static void limits(void **state)
{
    (void)state;
    pb_client_t *c = conn();
    shm_t s = shm_new(16 * MIB);
    uint64_t ids[MAX_BUFFERS], last = 0;
    for (int i = 0; i < MAX_BUFFERS; i++) {
        ids[i] = reg_ok(c, s.fd, 4096);
        assert_true(ids[i] > last);
        last = ids[i];
    }
    pb_reply_t r;
    reg(c, s.fd, 4096, &r);
    assert_non_null(r.error);
    assert_string_equal(pb_reply_code(&r), "resource_exhausted");
    assert_int_equal(pb_obj_strcmp(pb_obj_get(r.error, "limit"), "max_buffers_per_connection"), 0);
    pb_reply_free(&r);
    unreg_ok(c, ids[0]);
    uint64_t again = reg_ok(c, s.fd, 4096);
    assert_true(again > last);
    for (int i = 1; i < MAX_BUFFERS; i++)
        unreg_ok(c, ids[i]);
    unreg_ok(c, again);
    /* bytes: 16 MiB in all */
    uint64_t big = reg_ok(c, s.fd, 16 * MIB - 4096);
    reg(c, s.fd, 8192, &r);
    assert_non_null(r.error);
    assert_string_equal(pb_reply_code(&r), "resource_exhausted");
    assert_int_equal(pb_obj_strcmp(pb_obj_get(r.error, "limit"), "max_buffer_bytes_per_connection"), 0);
    pb_reply_free(&r);
    unreg_ok(c, reg_ok(c, s.fd, 4096));
    unreg_ok(c, big);
    /* hello reports both limits */
    msgpack_packer *pk = pb_client_begin(c, "hello");
    msgpack_pack_map(pk, 0);
    assert_int_equal(pb_client_call(c, &r), 0);
    uint64_t v = 0;
    assert_int_equal(pb_obj_uint(pb_obj_path(r.result, "limits.max_buffers_per_connection"), &v), 0);
    assert_int_equal(v, MAX_BUFFERS);
    assert_int_equal(pb_obj_uint(pb_obj_path(r.result, "limits.max_buffer_bytes_per_connection"), &v), 0);
    assert_int_equal(v, 16 * MIB);
    pb_reply_free(&r);
    shm_free(&s);
    pb_client_close(c);
}

/* A buffer belongs to its connection: another cannot read it, write into
 * it or unregister it, and the owner keeps it. */
static void other_connection(void **state)
{
    (void)state;
    pb_client_t *a = conn(), *b = conn();
    shm_t s = shm_new(64 << 10);
    uint64_t id = reg_ok(a, s.fd, s.size);
    fill(s.p, "f64", 15, 11);
    uint64_t as[2] = {5, 3};
    arg_t in = {"A", tensor("f64", 2, as, 0, NULL, id, 0)};
    call_t k = {"forward", "qr_compact", &in, 1, NULL, NULL, NULL, 0, NULL, -1};
    call_err(b, send_call(b, &k), "invalid_argument", "not registered");
    fill(s.p + 4096, "f64", 15, 12);
    arg_t inl = {"A", tensor("f64", 2, as, 0, s.p + 4096, 0, 0)};
    into_t into = {"Q", id, 8192};
    call_t ki = {"forward", "qr_compact", &inl, 1, NULL, NULL, &into, 1, NULL, -1};
    call_err(b, send_call(b, &ki), "invalid_argument", "not registered");
    pb_reply_t r;
    unreg(b, id, &r);
    expect_error(&r, "invalid_argument", "not registered");
    call_ok(a, send_call(a, &k), &r);
    pb_reply_free(&r);
    unreg_ok(a, id);
    shm_free(&s);
    pb_client_close(a);
    pb_client_close(b);
}

/* Closing a connection unmaps its buffers, and no fd is left behind:
 * /proc/PID/maps and /proc/PID/fd come back to what they were. */
static void close_unmaps(void **state)
{
    (void)state;
    pb_client_t *watch = conn();
    quiesce(watch);
    int maps0 = maps_pbe2e(), fds0 = count_fds();
    pb_client_t *c = conn();
    shm_t s[3];
    for (int i = 0; i < 3; i++) {
        s[i] = shm_new(MIB);
        reg_ok(c, s[i].fd, s[i].size);
    }
    assert_int_equal(maps_pbe2e(), maps0 + 3);
    assert_int_equal(count_fds(), fds0 + 1); /* the connection; the memfds were closed once mapped */
    assert_int_equal(stat_of(watch, "buffers"), 3);
    pb_client_close(c);
    assert_int_equal(settle(maps_pbe2e, maps0), maps0);
    assert_int_equal(settle(count_fds, fds0), fds0);
    assert_int_equal(stat_of(watch, "buffers"), 0);
    for (int i = 0; i < 3; i++)
        shm_free(&s[i]);
    pb_client_close(watch);
}

/* fds that come with requests other than register_buffer are closed, never
 * kept for a later one; past 16 waiting, the rest are closed too. */
static void stray_fds(void **state)
{
    (void)state;
    pb_client_t *c = conn();
    quiesce(c);
    int fds0 = count_fds();
    shm_t s = shm_new(4096);
    /* hello with an fd: answered, fd closed */
    msgpack_packer *pk = pb_client_begin(c, "hello");
    msgpack_pack_map(pk, 0);
    uint32_t id;
    assert_int_equal(pb_client_send_with_fd(c, s.fd, &id), 0);
    pb_reply_t r;
    call_ok(c, id, &r);
    pb_reply_free(&r);
    assert_int_equal(count_fds(), fds0);
    /* the next register_buffer, sent without one, does not get it */
    reg(c, -1, 4096, &r);
    expect_error(&r, "invalid_argument", "file descriptor");
    /* 20 fds on one stats request */
    int many[20];
    for (int i = 0; i < 20; i++)
        many[i] = s.fd;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    pack_plain(&sb, 0xcafe, "stats");
    send_fds_raw(c, sb.data, sb.size, many, 20);
    msgpack_sbuffer_destroy(&sb);
    call_ok(c, 0xcafe, &r);
    pb_reply_free(&r);
    assert_int_equal(count_fds(), fds0);
    /* An fd on bytes in the middle of a request (no message begins in
     * them) belongs to no message: closed. */
    msgpack_sbuffer_init(&sb);
    pack_plain(&sb, 0xf00d, "hello");
    send_fds_raw(c, sb.data, 4, NULL, 0);
    sleep_ms(100); /* read apart from the rest */
    send_fds_raw(c, sb.data + 4, sb.size - 4, &s.fd, 1);
    msgpack_sbuffer_destroy(&sb);
    call_ok(c, 0xf00d, &r);
    pb_reply_free(&r);
    assert_int_equal(count_fds(), fds0);
    /* A register_buffer notification registers nothing (it could never
     * learn its id) and keeps no fd. */
    uint64_t before = stat_of(c, "buffers");
    pack_register(&sb, 2, 0, 4096);
    send_fds_raw(c, sb.data, sb.size, &s.fd, 1);
    msgpack_sbuffer_destroy(&sb);
    assert_int_equal(stat_of(c, "buffers"), before);
    assert_int_equal(count_fds(), fds0);
    /* and a proper one still works */
    unreg_ok(c, reg_ok(c, s.fd, 4096));
    assert_int_equal(count_fds(), fds0);
    /* One sendmsg of a register_buffer and the request after it, the fd
     * with both: the register_buffer has it (the last request beginning in
     * the bytes, hello, used to get it, and register_buffer was told none
     * came); and in the other order. */
    for (int order = 0; order < 2; order++) {
        msgpack_sbuffer reg_sb;
        pack_register(&reg_sb, 0, 0xbee0, 4096);
        msgpack_sbuffer_init(&sb);
        if (order == 0)
            msgpack_sbuffer_write(&sb, reg_sb.data, reg_sb.size);
        pack_plain(&sb, 0xbee1, "hello");
        if (order == 1)
            msgpack_sbuffer_write(&sb, reg_sb.data, reg_sb.size);
        msgpack_sbuffer_destroy(&reg_sb);
        send_fds_raw(c, sb.data, sb.size, &s.fd, 1);
        msgpack_sbuffer_destroy(&sb);
        pb_reply_t rr, rh;
        assert_int_equal(pb_client_wait(c, 0xbee0, &rr), 0);
        if (rr.error)
            fail_msg("register_buffer %s hello in one sendmsg: %s", order ? "after" : "before",
                     pb_reply_message(&rr));
        uint64_t bid = 0;
        assert_int_equal(pb_obj_uint(pb_obj_get(rr.result, "buffer"), &bid), 0);
        pb_reply_free(&rr);
        call_ok(c, 0xbee1, &rh);
        pb_reply_free(&rh);
        unreg_ok(c, bid);
        assert_int_equal(count_fds(), fds0);
    }
    shm_free(&s);
    pb_client_close(c);
}

/* A request in flight keeps its mapping after unregister_buffer: a large
 * forward from a buffer, unregistered right behind it, still gives the
 * inline bytes. */
static void unregister_in_flight(void **state)
{
    (void)state;
    pb_client_t *c = conn();
    quiesce(c);
    shm_t s = shm_new(4 * MIB);
    uint64_t id = reg_ok(c, s.fd, s.size);
    fdl_t f = {"f64", 256, 256, 256, 'C', 1 * MIB, 2 * MIB};
    fd_fill(&f, s.p, 14);
    arg_t ab[3], ai[3];
    fd_args(&f, s.p, id, 0, ab);
    fd_args(&f, s.p, 0, 0, ai);
    call_t k = {"forward", "fused_dense", ab, 3, "relu", NULL, NULL, 0, NULL, -1};
    uint32_t fwd = send_call(c, &k);
    msgpack_packer *pk = pb_client_begin(c, "unregister_buffer");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "buffer");
    msgpack_pack_uint64(pk, id);
    uint32_t un;
    assert_int_equal(pb_client_send(c, &un), 0);
    pb_reply_t rb, ru, ri;
    call_ok(c, un, &ru);
    pb_reply_free(&ru);
    call_ok(c, fwd, &rb);
    k.in = ai;
    call_ok(c, send_call(c, &k), &ri);
    same_tensor(&ri, &rb, "outputs.y");
    pb_reply_free(&ri);
    pb_reply_free(&rb);
    assert_int_equal(stat_of(c, "buffers"), 0);
    shm_free(&s);
    pb_client_close(c);
}

/* The client shrinks its file after registering it.  Reading it (on the
 * loop thread for a tiny call, on a worker for a large one) or writing a
 * result into it raises SIGBUS in the daemon: each request fails with
 * invalid_argument, the buffer is refused from then on, the daemon stays
 * up, and another connection is served. */
static void sigbus(void **state)
{
    (void)state;
    pb_client_t *c = conn(), *other = conn();
    for (int big = 0; big < 2; big++) {
        shm_t s = shm_new(4 * MIB);
        uint64_t id = reg_ok(c, s.fd, s.size);
        fdl_t f = big ? (fdl_t){"f64", 256, 256, 256, 'C', 1 * MIB, 2 * MIB} : (fdl_t){"f64", 2, 3, 2, 'C', 64, 128};
        fd_fill(&f, s.p, 15);
        arg_t ab[3];
        fd_args(&f, s.p, id, 0, ab);
        munmap(s.p, s.size); /* or this process would fault too */
        s.p = NULL;
        assert_int_equal(ftruncate(s.fd, 0), 0);
        call_t k = {"forward", "fused_dense", ab, 3, "relu", NULL, NULL, 0, NULL, -1};
        pb_reply_t rs;
        assert_int_equal(pb_client_wait(c, send_call(c, &k), &rs), 0);
        /* with which argument (contract section 5): the first input in it */
        if (rs.error && pb_obj_strcmp(pb_obj_get(rs.error, "arg"), "inputs.weight") != 0)
            fail_msg("the shrunk buffer's error names no input: %s", pb_reply_message(&rs));
        expect_error(&rs, "invalid_argument", "shrank below its registered size");
        assert_true(daemon_alive());
        call_err(c, send_call(c, &k), "invalid_argument", "shrank");
        unreg_ok(c, id);
        shm_free(&s);
    }
    /* into a shrunk buffer */
    shm_t s = shm_new(MIB);
    uint64_t id = reg_ok(c, s.fd, s.size);
    munmap(s.p, s.size);
    s.p = NULL;
    assert_int_equal(ftruncate(s.fd, 0), 0);
    unsigned char vals[15 * 8];
    fill(vals, "f64", 15, 16);
    uint64_t as[2] = {5, 3};
    arg_t a = {"A", tensor("f64", 2, as, 0, vals, 0, 0)};
    into_t into = {"R", id, 4096};
    call_t k = {"forward", "qr_compact", &a, 1, NULL, NULL, &into, 1, NULL, -1};
    pb_reply_t ri;
    assert_int_equal(pb_client_wait(c, send_call(c, &k), &ri), 0);
    if (ri.error && pb_obj_strcmp(pb_obj_get(ri.error, "arg"), "into.R") != 0)
        fail_msg("the shrunk into buffer's error names no target: %s", pb_reply_message(&ri));
    expect_error(&ri, "invalid_argument", "shrank");
    unreg_ok(c, id);
    shm_free(&s);
    /* the daemon is fine, on both connections */
    assert_true(daemon_alive());
    pb_reply_t r;
    k.ninto = 0;
    call_ok(other, send_call(other, &k), &r);
    pb_reply_free(&r);
    call_ok(c, send_call(c, &k), &r);
    pb_reply_free(&r);
    s = shm_new(MIB);
    id = reg_ok(other, s.fd, s.size);
    memcpy(s.p, vals, sizeof vals);
    a.t = tensor("f64", 2, as, 0, NULL, id, 0);
    call_ok(other, send_call(other, &k), &r);
    pb_reply_free(&r);
    unreg_ok(other, id);
    shm_free(&s);
    pb_client_close(c);
    pb_client_close(other);
}

/* A SIGBUS that is not about a buffer (here one sent with kill, which has
 * no fault address) is not swallowed: the handler puts the previous
 * action back and raises it again, and the daemon dies of it.  Under a
 * sanitizer the previous action is the sanitizer's, which reports and
 * aborts (SIGABRT), or exits non-zero without ASAN_OPTIONS=abort_on_error. */
static void foreign_sigbus(void **state)
{
    (void)state;
    daemon_t d;
    static const char *const extra[] = {"--workers", "1", NULL};
    assert_int_equal(daemon_start(&d, daemon_bin, extra), 0);
    pid_t pid = d.pid;
    pb_client_t *c = NULL;
    assert_int_equal(pb_client_connect(d.sock, &c), 0);
    shm_t s = shm_new(4096);
    reg_ok(c, s.fd, s.size); /* the handler is in place from here on */
    assert_int_equal(kill(pid, SIGBUS), 0);
    int st = 0;
    pid_t got = 0;
    for (int t = 0; t < 500 && got == 0; t++) {
        got = waitpid(pid, &st, WNOHANG);
        if (got == 0)
            sleep_ms(10);
    }
    if (got == 0) { /* swallowed: the daemon lives on */
        daemon_stop(&d);
        fail_msg("the daemon survived a SIGBUS that was not about a buffer");
    }
    d.pid = 0; /* reaped: daemon_stop only cleans up */
    daemon_stop(&d);
    pb_client_close(c);
    shm_free(&s);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_UNDEFINED__)
    /* without abort_on_error the sanitizer exits with its exitcode */
    if (WIFEXITED(st) && WEXITSTATUS(st) != 0)
        return;
#endif
    assert_true(WIFSIGNALED(st));
    assert_true(WTERMSIG(st) == SIGBUS || WTERMSIG(st) == SIGABRT);
}

static int setup(void **state)
{
    (void)state;
    static const char *const extra[] = {"--workers", "2", "--max-buffers-per-connection", "4",
                                        "--max-buffer-bytes-per-connection", "16M", NULL};
    return daemon_start(&dmn, daemon_bin, extra) == 0 ? 0 : -1;
}

/* exit 0 on SIGTERM: nothing crashed, nothing leaked under ASan */
static int teardown(void **state)
{
    (void)state;
    return daemon_stop(&dmn);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: e2e_shm PATH_TO_PULLBACKD\n");
        return 2;
    }
    daemon_bin = argv[1];
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(forward_from_buffer), cmocka_unit_test(factorization),
        cmocka_unit_test(forward_into),        cmocka_unit_test(reverse_into),
        cmocka_unit_test(accumulate_complex),  cmocka_unit_test(errors),
        cmocka_unit_test(read_only),           cmocka_unit_test(limits),
        cmocka_unit_test(other_connection),    cmocka_unit_test(close_unmaps),
        cmocka_unit_test(stray_fds),           cmocka_unit_test(unregister_in_flight),
        cmocka_unit_test(sigbus),              cmocka_unit_test(foreign_sigbus),
    };
    return cmocka_run_group_tests_name("e2e.shm", tests, setup, teardown);
}
