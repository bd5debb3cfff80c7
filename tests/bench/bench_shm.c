/* bench_shm: what shared-memory tensors (contract section 6) save over
 * values sent inline, for a call whose work is small next to its bytes.
 *
 * The call: tensoradd with A an n×n f64 matrix and pA = [1, 0] (C = Aᵀ),
 * one pass over the bytes.  Timed, each the median of several sync round
 * trips on one connection:
 *   inline   A in the request (bin), C in the reply
 *   shm      A in a registered memfd, C written into it (into)
 *   memcpy   the client copying 2·n²·8 bytes in process: what moving the
 *            values costs at the least, once each way, into memory that
 *            is already paged in (as a caller's own output array would
 *            be; a first touch costs a page fault per 4 KiB)
 * Printed: the times, shm ÷ inline (the point of section 6: well below 1
 * for large tensors) and inline ÷ (shm + memcpy).  Every reply is checked
 * (C = Aᵀ at a few entries, for both forms).
 *
 * Usage: bench_shm [--quick] [PULLBACKD_BIN] (else $PULLBACKD_BIN, else the
 * daemon of this build).  n = 256, 1024 and 2048 (--quick: 256, 512). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../test_daemon.h"
#include "bench_util.h"
#include "pullbackd.h"

static daemon_t dmn; /* stopped at the end, or by exit() (test_daemon.h) */

static _Noreturn void die(const char *what, const char *detail)
{
    fprintf(stderr, "bench_shm: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    exit(1);
}

static void reply_ok(pb_client_t *c, uint32_t id, pb_reply_t *r)
{
    if (pb_client_wait(c, id, r) != 0)
        die("connection lost", NULL);
    if (r->error)
        die(pb_reply_code(r), pb_reply_message(r));
}

/* forward tensoradd {A} with pA = [1, 0]; into C at offset (buffer 0: inline). */
static uint32_t send_transpose(pb_client_t *c, const pb_ctensor_t *A, uint64_t buffer, uint64_t offset)
{
    msgpack_packer *pk = pb_client_begin(c, "forward");
    msgpack_pack_map(pk, buffer ? 4 : 3);
    pb_pack_kv_str(pk, "op", "tensoradd");
    pb_pack_str(pk, "inputs");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "A");
    pb_pack_tensor(pk, A);
    pb_pack_str(pk, "options");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "pA");
    msgpack_pack_array(pk, 2);
    msgpack_pack_uint64(pk, 1);
    msgpack_pack_uint64(pk, 0);
    if (buffer)
        pb_pack_into(pk, &(pb_into_t){"C", buffer, offset}, 1);
    uint32_t id;
    if (pb_client_send(c, &id) != 0)
        die("send failed", NULL);
    return id;
}

static void check(const double *a, const double *ct, size_t n, const char *what)
{
    for (size_t k = 0; k < 16; k++) {
        size_t i = (k * 7919) % n, j = (k * 104729) % n;
        if (ct[i * n + j] != a[j * n + i])
            die("wrong transpose", what);
    }
}

static void bench(pb_client_t *c, size_t n, int reps)
{
    size_t bytes = n * n * sizeof(double);
    int fd = memfd_create("bench_shm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)(2 * bytes)) != 0)
        die("memfd", strerror(errno));
    unsigned char *base = mmap(NULL, 2 * bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED)
        die("mmap", strerror(errno));
    double *a = (double *)base, *copy = malloc(2 * bytes);
    if (copy == NULL)
        die("out of memory", NULL);
    for (size_t i = 0; i < n * n; i++)
        a[i] = (double)((i * 2654435761u) % 1000) - 500.0;
    memset(copy, 0, 2 * bytes); /* pages in the memcpy's destination */
    msgpack_packer *pk = pb_client_begin(c, "register_buffer");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "size");
    msgpack_pack_uint64(pk, 2 * bytes);
    uint32_t id;
    pb_reply_t r;
    if (pb_client_send_with_fd(c, fd, &id) != 0)
        die("register_buffer: send", NULL);
    reply_ok(c, id, &r);
    uint64_t buf = 0;
    if (pb_obj_uint(pb_obj_get(r.result, "buffer"), &buf) != 0)
        die("register_buffer: no id", NULL);
    pb_reply_free(&r);

    pb_ctensor_t inl = {.dtype = "f64", .rank = 2, .shape = {n, n}, .data = a, .nbytes = bytes};
    pb_ctensor_t shm = {.dtype = "f64", .rank = 2, .shape = {n, n}, .shm = true, .buffer = buf, .offset = 0};
    double ti[16], ts[16], tm[16];
    for (int k = 0; k < reps; k++) {
        double t0 = now();
        reply_ok(c, send_transpose(c, &inl, 0, 0), &r);
        ti[k] = now() - t0;
        pb_ctensor_t C;
        if (pb_obj_tensor(pb_obj_path(r.result, "outputs.C"), &C) != 0 || C.shm || C.nbytes != bytes)
            die("inline reply: no C", NULL);
        check(a, C.data, n, "inline");
        pb_reply_free(&r);

        t0 = now();
        reply_ok(c, send_transpose(c, &shm, buf, bytes), &r);
        ts[k] = now() - t0;
        if (pb_obj_tensor(pb_obj_path(r.result, "outputs.C"), &C) != 0 || !C.shm || C.offset != bytes)
            die("shm reply: C not in the buffer", NULL);
        check(a, (const double *)(base + bytes), n, "shm");
        pb_reply_free(&r);

        t0 = now();
        memcpy(copy, a, bytes);
        memcpy(copy + n * n, base + bytes, bytes);
        tm[k] = now() - t0;
    }
    double i50 = median(ti, reps), s50 = median(ts, reps), m50 = median(tm, reps);
    printf("tensoradd f64 %4zux%-4zu (%5.1f MiB each way)  inline %8.2f ms  shm %8.2f ms  memcpy %7.2f ms   "
           "shm/inline %.3f   inline/(shm+memcpy) %.2f\n",
           n, n, (double)bytes / (1 << 20), i50 * 1e3, s50 * 1e3, m50 * 1e3, s50 / i50, i50 / (s50 + m50));
    fflush(stdout);
    pk = pb_client_begin(c, "unregister_buffer");
    msgpack_pack_map(pk, 1);
    pb_pack_str(pk, "buffer");
    msgpack_pack_uint64(pk, buf);
    if (pb_client_send(c, &id) != 0)
        die("unregister_buffer: send", NULL);
    reply_ok(c, id, &r);
    pb_reply_free(&r);
    munmap(base, 2 * bytes);
    close(fd);
    free(copy);
}

int main(int argc, char **argv)
{
    bool quick = false;
    const char *bin = getenv("PULLBACKD_BIN");
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            quick = true;
        else
            bin = argv[i];
    }
    if (bin == NULL)
        bin = PB_BENCH_DAEMON;
    int rc = daemon_start(&dmn, bin, NULL);
    if (rc != 0)
        die("cannot start the daemon", strerror(-rc));
    pb_client_t *c = NULL;
    if (pb_client_connect(dmn.sock, &c) != 0)
        die("cannot connect", dmn.sock);
    static const size_t full[] = {256, 1024, 2048}, fast[] = {256, 512};
    const size_t *ns = quick ? fast : full;
    size_t nn = quick ? 2 : 3;
    for (size_t i = 0; i < nn; i++)
        bench(c, ns[i], quick ? 3 : ns[i] >= 2048 ? 5 : 9);
    pb_client_close(c);
    daemon_stop(&dmn);
    return 0;
}
