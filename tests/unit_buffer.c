/* unit.buffer: a connection's shared-memory buffers (daemon/buffer.c) on
 * their own: registering memfds, refusing every other kind of file, the
 * per-connection limits, lookup through the resolver, bounds and
 * alignment of views, unregistering, and the byte and mapping counts.
 * The SIGBUS path (a file shrunk under a mapping) needs a daemon's worker
 * to touch it and is tested end to end (e2e.shm). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cmocka.h>

#include "daemon/buffer.h"

#define TMPFS_MAGIC 0x01021994

/* A memfd of size bytes holding 0, 1, 2, ... as bytes. */
static int memfd(size_t size, unsigned flags)
{
    int fd = memfd_create("unit_buffer", MFD_CLOEXEC | flags);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)size), 0);
    unsigned char *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(p != MAP_FAILED);
    for (size_t i = 0; i < size; i++)
        p[i] = (unsigned char)i;
    munmap(p, size);
    return fd;
}

/* fd reopened through /proc with other access flags. */
static int reopen(int fd, int flags)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int r = open(path, flags | O_CLOEXEC);
    assert_true(r >= 0);
    return r;
}

static bool fd_open(int fd)
{
    return fcntl(fd, F_GETFD) >= 0 || errno != EBADF;
}

static void expect(int rc, const pb_err_t *err, int code, const char *arg, const char *msg)
{
    if (rc != code || strcmp(err->arg, arg) != 0 || strstr(err->message, msg) == NULL)
        fail_msg("want %d (%s) '%s'\n  got %d (%s) '%s'", code, arg, msg, rc, err->arg, err->message);
}

static void register_lookup_release(void **state)
{
    (void)state;
    size_t count0, bytes0, count, bytes;
    pb_shm_totals(&count0, &bytes0);
    pb_buffers_t b;
    pb_buffers_init(&b);
    pb_err_t err;
    uint64_t id1 = 0, id2 = 0;
    int fd = memfd(8192, 0);
    assert_int_equal(pb_buffers_register(&b, fd, 5000, 8, 1 << 20, &id1, &err), 0);
    assert_false(fd_open(fd)); /* the table closes the fd: the mapping does not need it */
    assert_int_equal(id1, 1);
    assert_int_equal(pb_buffers_register(&b, memfd(4096, 0), 4096, 8, 1 << 20, &id2, &err), 0);
    assert_int_equal(id2, 2);
    assert_int_equal(b.n, 2);
    assert_int_equal(b.bytes, 5000 + 4096);
    pb_shm_totals(&count, &bytes);
    assert_int_equal(count, count0 + 2);
    assert_int_equal(bytes, bytes0 + 5000 + 4096);

    /* Lookup: the mapping shows the file's bytes, writable. */
    pb_resolver_t res = pb_buffers_resolver(&b);
    pb_storage_t *s = res.find(res.ctx, id1, true, "x", &err);
    assert_non_null(s);
    assert_int_equal(s->kind, PB_STORAGE_SHM);
    assert_int_equal(s->size, 5000);
    assert_int_equal(((unsigned char *)s->ptr)[4999], (unsigned char)4999);
    assert_true(pb_shm_writable(s));
    assert_false(pb_shm_broken(s));
    assert_int_equal(pb_shm_id(s), id1);
    assert_null(res.find(res.ctx, 3, false, "inputs.x", &err));
    expect(err.code, &err, PB_EINVALID_ARGUMENT, "inputs.x", "inputs.x: buffer 3 is not registered on this connection");

    /* A view that a request holds outlives unregistering: the mapping
     * goes at the last reference. */
    pb_storage_t *held = pb_storage_ref(s);
    assert_int_equal(pb_buffers_unregister(&b, id1, &err), 0);
    assert_int_equal(b.n, 1);
    assert_int_equal(b.bytes, 4096);
    assert_null(res.find(res.ctx, id1, false, "x", &err));
    assert_int_equal(((unsigned char *)held->ptr)[100], 100);
    pb_shm_totals(&count, &bytes);
    assert_int_equal(count, count0 + 2);
    pb_storage_unref(held);
    pb_shm_totals(&count, &bytes);
    assert_int_equal(count, count0 + 1);
    assert_int_equal(bytes, bytes0 + 4096);
    expect(pb_buffers_unregister(&b, id1, &err), &err, PB_EINVALID_ARGUMENT, "buffer",
           "buffer 1 is not registered on this connection");

    /* Ids are never reused on a connection, also after destroy. */
    pb_buffers_destroy(&b);
    assert_int_equal(b.n, 0);
    assert_int_equal(b.bytes, 0);
    uint64_t id3 = 0;
    assert_int_equal(pb_buffers_register(&b, memfd(4096, 0), 4096, 8, 1 << 20, &id3, &err), 0);
    assert_int_equal(id3, 3);
    pb_buffers_destroy(&b);
    pb_shm_totals(&count, &bytes);
    assert_int_equal(count, count0);
    assert_int_equal(bytes, bytes0);
}

/* Views through the resolver, as a tensor {buffer, offset} asks for. */
static void bounds(void **state)
{
    (void)state;
    pb_buffers_t b;
    pb_buffers_init(&b);
    pb_err_t err;
    uint64_t id;
    assert_int_equal(pb_buffers_register(&b, memfd(4096, 0), 1000, 8, 1 << 20, &id, &err), 0);
    pb_resolver_t res = pb_buffers_resolver(&b);
    msgpack_object buf = {.type = MSGPACK_OBJECT_POSITIVE_INTEGER, .via.u64 = id};
    msgpack_object off = {.type = MSGPACK_OBJECT_POSITIVE_INTEGER};
    pb_storage_t *st = NULL;
    size_t o;
    uint64_t got;
    /* The last 8 aligned bytes of the registered size (not the page). */
    off.via.u64 = 992;
    assert_int_equal(pb_buffer_view(&res, &buf, &off, 8, 8, false, "x", &st, &o, &got, &err), 0);
    assert_int_equal(o, 992);
    assert_int_equal(got, id);
    pb_storage_unref(st);
    off.via.u64 = 1000;
    assert_int_equal(pb_buffer_view(&res, &buf, &off, 0, 8, false, "x", &st, &o, &got, &err), 0);
    pb_storage_unref(st);
    off.via.u64 = 1000;
    expect(pb_buffer_view(&res, &buf, &off, 8, 8, false, "x", &st, &o, &got, &err), &err, PB_EINVALID_ARGUMENT, "x",
           "8 bytes at offset 1000 run past the end of buffer 1 (1000 bytes registered)");
    off.via.u64 = 996;
    expect(pb_buffer_view(&res, &buf, &off, 8, 4, false, "x", &st, &o, &got, &err), &err, PB_EINVALID_ARGUMENT, "x",
           "run past the end");
    /* Sums that would wrap around are refused, not wrapped. */
    off.via.u64 = UINT64_MAX - 3;
    expect(pb_buffer_view(&res, &buf, &off, 8, 1, false, "x", &st, &o, &got, &err), &err, PB_EINVALID_ARGUMENT, "x",
           "run past the end");
    off.via.u64 = 8;
    expect(pb_buffer_view(&res, &buf, &off, SIZE_MAX, 1, false, "x", &st, &o, &got, &err), &err,
           PB_EINVALID_ARGUMENT, "x", "run past the end");
    off.via.u64 = 12;
    expect(pb_buffer_view(&res, &buf, &off, 8, 8, false, "x", &st, &o, &got, &err), &err, PB_EINVALID_ARGUMENT, "x",
           "offset 12 is not aligned");
    pb_buffers_destroy(&b);
}

/* Only memfds and shm files: anything else is refused before it is mapped,
 * and its fd is closed all the same. */
static void refusals(void **state)
{
    (void)state;
    pb_buffers_t b;
    pb_buffers_init(&b);
    pb_err_t err;
    uint64_t id = 99;
    int sv[2], pp[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    close(sv[1]);
    expect(pb_buffers_register(&b, sv[0], 64, 8, 1 << 20, &id, &err), &err, PB_EINVALID_ARGUMENT, "",
           "the file descriptor is a socket, not a memfd or shared-memory file");
    assert_false(fd_open(sv[0]));
    assert_int_equal(pipe2(pp, O_CLOEXEC), 0);
    close(pp[1]);
    expect(pb_buffers_register(&b, pp[0], 64, 8, 1 << 20, &id, &err), &err, PB_EINVALID_ARGUMENT, "",
           "the file descriptor is a pipe");
    assert_false(fd_open(pp[0]));
    int dn = open("/dev/null", O_RDWR | O_CLOEXEC);
    expect(pb_buffers_register(&b, dn, 64, 8, 1 << 20, &id, &err), &err, PB_EINVALID_ARGUMENT, "",
           "not a memfd or shared-memory file");
    /* A regular file on a disk (the build directory, unless that is tmpfs). */
    struct statfs fs;
    char path[] = "unit_buffer.XXXXXX";
    int df = mkstemp(path);
    assert_true(df >= 0);
    unlink(path);
    assert_int_equal(ftruncate(df, 4096), 0);
    if (fstatfs(df, &fs) == 0 && fs.f_type != TMPFS_MAGIC)
        expect(pb_buffers_register(&b, df, 64, 8, 1 << 20, &id, &err), &err, PB_EINVALID_ARGUMENT, "",
               "another kind of file, not a memfd or shared-memory file");
    else
        close(df);
    /* A memfd, but: a size of 0, a size past the file's end, write-only. */
    expect(pb_buffers_register(&b, memfd(4096, 0), 0, 8, 1 << 20, &id, &err), &err, PB_EINVALID_ARGUMENT, "size",
           "size must be a positive number of bytes");
    expect(pb_buffers_register(&b, memfd(4096, 0), 4097, 8, 1 << 20, &id, &err), &err, PB_EINVALID_ARGUMENT,
           "size", "size 4097 is more than the file's 4096 bytes");
    int m = memfd(4096, 0), wo = reopen(m, O_WRONLY);
    close(m);
    expect(pb_buffers_register(&b, wo, 64, 8, 1 << 20, &id, &err), &err, PB_EINVALID_ARGUMENT, "",
           "not open for reading");
    assert_int_equal(id, 99); /* untouched on error */
    assert_int_equal(b.n, 0);
    assert_int_equal(b.bytes, 0);
    pb_buffers_destroy(&b);
}

/* A read-only fd, or a memfd sealed against writes, is mapped read-only:
 * readable as an input, refused as an into target. */
static void read_only(void **state)
{
    (void)state;
    pb_buffers_t b;
    pb_buffers_init(&b);
    pb_err_t err;
    uint64_t ro, sealed;
    int m = memfd(4096, 0), r = reopen(m, O_RDONLY);
    close(m);
    assert_int_equal(pb_buffers_register(&b, r, 4096, 8, 1 << 20, &ro, &err), 0);
    int s = memfd(4096, MFD_ALLOW_SEALING);
    assert_int_equal(fcntl(s, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW), 0);
    assert_int_equal(pb_buffers_register(&b, s, 4096, 8, 1 << 20, &sealed, &err), 0);
    pb_resolver_t res = pb_buffers_resolver(&b);
    uint64_t ids[] = {ro, sealed};
    for (int i = 0; i < 2; i++) {
        pb_storage_t *st = res.find(res.ctx, ids[i], false, "x", &err);
        assert_non_null(st);
        assert_false(pb_shm_writable(st));
        assert_int_equal(((unsigned char *)st->ptr)[7], 7);
        assert_null(res.find(res.ctx, ids[i], true, "into.y", &err));
        expect(err.code, &err, PB_EINVALID_ARGUMENT, "into.y", "is mapped read-only");
    }
    pb_buffers_destroy(&b);
}

/* The per-connection limits are checked before anything is mapped. */
static void limits(void **state)
{
    (void)state;
    pb_buffers_t b;
    pb_buffers_init(&b);
    pb_err_t err;
    uint64_t id;
    assert_int_equal(pb_buffers_register(&b, memfd(4096, 0), 3000, 2, 5000, &id, &err), 0);
    int fd = memfd(4096, 0);
    expect(pb_buffers_register(&b, fd, 2001, 2, 5000, &id, &err), &err, PB_ERESOURCE_EXHAUSTED,
           "max_buffer_bytes_per_connection", "3000 bytes of buffers registered; 2001 more would pass");
    assert_false(fd_open(fd));
    assert_int_equal(pb_buffers_register(&b, memfd(4096, 0), 2000, 2, 5000, &id, &err), 0);
    assert_int_equal(b.bytes, 5000);
    expect(pb_buffers_register(&b, memfd(4096, 0), 1, 2, 1 << 20, &id, &err), &err, PB_ERESOURCE_EXHAUSTED,
           "max_buffers_per_connection", "holds 2 buffers");
    /* A size that would wrap the sum. */
    expect(pb_buffers_register(&b, memfd(4096, 0), UINT64_MAX, 8, SIZE_MAX, &id, &err), &err, PB_EINVALID_ARGUMENT,
           "size", "size 18446744073709551615 is more than any file could hold");
    expect(pb_buffers_register(&b, memfd(4096, 0), SIZE_MAX / 2, 8, SIZE_MAX / 2, &id, &err), &err,
           PB_ERESOURCE_EXHAUSTED, "max_buffer_bytes_per_connection", "would pass");
    /* Unregistering gives the room back. */
    assert_int_equal(pb_buffers_unregister(&b, 1, &err), 0);
    assert_int_equal(pb_buffers_register(&b, memfd(4096, 0), 3000, 2, 5000, &id, &err), 0);
    assert_int_equal(id, 3);
    pb_buffers_destroy(&b);
}

/* One 4096-byte buffer more in b, which must succeed. */
static void register_page(pb_buffers_t *b)
{
    pb_err_t err;
    uint64_t id;
    assert_int_equal(pb_buffers_register(b, memfd(4096, 0), 4096, 8, 1 << 20, &id, &err), 0);
}

/* The registry stops at half of vm.max_map_count (at most
 * PB_SHM_MAX_MAPPINGS), before the kernel's limit would fail every mmap of
 * the process, and one uid at half of that; past either,
 * resource_exhausted and nothing mapped. */
static void registry_cap(void **state)
{
    (void)state;
    long mmc = 0;
    FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
    if (f) {
        assert_int_equal(fscanf(f, "%ld", &mmc), 1);
        fclose(f);
        assert_int_equal(pb_shm_max_mappings(), mmc / 2 < PB_SHM_MAX_MAPPINGS ? (size_t)mmc / 2 : PB_SHM_MAX_MAPPINGS);
    }
    size_t count, bytes;
    pb_shm_totals(&count, &bytes);
    assert_int_equal(count, 0);
    pb_shm_set_max_mappings(4);
    pb_buffers_t b, other;
    pb_buffers_init(&b);
    pb_buffers_init(&other);
    other.uid = 1;
    pb_err_t err;
    uint64_t id;
    for (int i = 0; i < 2; i++) {
        register_page(&b);
        register_page(&other);
    }
    int fd = memfd(4096, 0);
    expect(pb_buffers_register(&b, fd, 4096, 8, 1 << 20, &id, &err), &err, PB_ERESOURCE_EXHAUSTED,
           "max_mapped_buffers", "over all connections, its most (half of vm.max_map_count");
    assert_false(fd_open(fd));
    size_t now;
    pb_shm_totals(&now, &bytes);
    assert_int_equal(now, 4);
    assert_int_equal(pb_buffers_unregister(&b, 1, &err), 0);
    register_page(&b);
    pb_buffers_destroy(&b);
    pb_buffers_destroy(&other);
    /* One uid maps at most half: another still registers. */
    pb_shm_totals(&count, &bytes);
    assert_int_equal(count, 0);
    pb_shm_set_max_mappings(4);
    assert_int_equal(pb_shm_max_mappings_per_uid(), 2);
    pb_buffers_t u1, u2;
    pb_buffers_init(&u1);
    pb_buffers_init(&u2);
    u1.uid = 1000;
    u2.uid = 1001;
    for (int i = 0; i < 2; i++)
        register_page(&u1);
    fd = memfd(4096, 0);
    expect(pb_buffers_register(&u1, fd, 4096, 8, 1 << 20, &id, &err), &err, PB_ERESOURCE_EXHAUSTED,
           "max_mapped_buffers_per_uid", "uid 1000 already maps 2 shared-memory buffers over its connections, its most (half of the daemon's 4)");
    assert_false(fd_open(fd));
    for (int i = 0; i < 2; i++)
        register_page(&u2);
    expect(pb_buffers_register(&u2, memfd(4096, 0), 4096, 8, 1 << 20, &id, &err), &err, PB_ERESOURCE_EXHAUSTED,
           "max_mapped_buffers", "the daemon already maps 4 shared-memory buffers over all connections"); /* the total binds first */
    pb_buffers_destroy(&u1); /* its room comes back */
    register_page(&u1);
    pb_buffers_destroy(&u1);
    pb_buffers_destroy(&u2);
    pb_shm_totals(&count, &bytes);
    assert_int_equal(count, 0);
    pb_shm_set_max_mappings(0);
    if (mmc)
        assert_int_equal(pb_shm_max_mappings(), mmc / 2 < PB_SHM_MAX_MAPPINGS ? (size_t)mmc / 2 : PB_SHM_MAX_MAPPINGS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(register_lookup_release), cmocka_unit_test(bounds), cmocka_unit_test(refusals),
        cmocka_unit_test(read_only), cmocka_unit_test(limits), cmocka_unit_test(registry_cap),
    };
    return cmocka_run_group_tests_name("unit.buffer", tests, NULL, NULL);
}
