"""bench_e2e: what a user of the Python client feels, against what the user
would do instead, measured in the same run (issue 15's figures).

  fused_dense   augmented_forward + reverse (gelu) through the socket with
                pullbackd's Python client ÷ the same in PyTorch in process
                (all its threads), f32 and f64, two sizes; after each small
                size, the floor: two near-empty calls through a worker;
                after each large one, the forward alone inline and with
                its tensors in shared memory, against PyTorch's forward.
  transpose     a 2048² f64 tensoradd transpose sent inline, round trip ÷
                a copy of the same 64 MiB in memory (numpy: the 32 MiB out
                and the 32 MiB back), and ÷ the shared-memory path's round
                trip plus that copy; also against one way's copy alone, and
                against the same bytes through a bare socketpair (the
                floor of any socket transport here) plus the shm trip.
  alone/two     svd_vals of a 1024² f64 matrix (LAPACK, half of it GEMV:
                its GEMVs split too, kernels/blas_lapack.c),
                qr_compact of the same (LAPACK, mostly GEMM), and a 1024³ f64
                tensorcontract (GEMM-bound), alone ÷ two at once on two
                connections.

Starts its own daemon ($PULLBACKD_BIN, else build/daemon/pullbackd) unless
PULLBACKD_SOCKET names a running one.  --quick for a short run.  Run with
/usr/bin/python3 (Debian's numpy, msgpack and torch)."""

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import numpy as np  # noqa: E402
import pullbackd  # noqa: E402
from daemon_case import wait_for_socket  # noqa: E402

QUICK = "--quick" in sys.argv


def best(fn, reps):
    """fn's best time over reps runs, one after another.  Not interleaved
    with the other side of a ratio: PyTorch's BLAS threads stay awake
    after each call, and taking turns with them made the daemon's f32
    (1024, 1024, 256) forward twice as slow (measured)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def bench_fused_dense(c):
    try:
        import torch
    except ImportError:
        print("fused_dense: SKIPPED (no torch)")
        return
    print(f"{'fused_dense aug+rev gelu':32s} {'daemon ms':>10s} {'torch ms':>10s} {'ratio':>7s}")
    for dtype, tdt in ((np.float32, torch.float32), (np.float64, torch.float64)):
        for (n_out, n_in, batch) in ((1024, 1024, 256), (256, 256, 32)):
            rng = np.random.default_rng(0)
            W = rng.standard_normal((n_out, n_in)).astype(dtype)
            x = rng.standard_normal((n_in, batch)).astype(dtype)
            b = rng.standard_normal(n_out).astype(dtype)
            dy = rng.standard_normal((n_out, batch)).astype(dtype)

            def ours():
                out, tape = c.augmented_forward("fused_dense", {"weight": W, "x": x, "bias": b},
                                                wrt=["weight", "x", "bias"], options={"act": "gelu"})
                c.reverse(tape, {"y": dy})

            tW, tx, tb, tdy = (torch.tensor(a, requires_grad=a is not dy) for a in (W, x, b, dy))

            def theirs():
                y = torch.nn.functional.gelu(tW @ tx + tb[:, None])
                gW, gx, gb = torch.autograd.grad(y, (tW, tx, tb), tdy)

            # Best of 10 large (about 0.2 s each side), of 200 small (each
            # call well under a millisecond: the best of a few is mostly the
            # noise of this machine's scheduler, on both sides alike).
            reps = 3 if QUICK else (10 if n_out == 1024 else 200)
            a, t = best(ours, reps), best(theirs, reps)
            name = f"{np.dtype(dtype).name} ({n_out}, {n_in}, {batch})"
            print(f"{name:32s} {a * 1e3:10.2f} {t * 1e3:10.2f} {a / t:7.2f}")
            if n_out == 256:
                small_floor(c, dtype, t)
            else:
                large_split(c, W, x, b, (tW, tx, tb), t)


def large_split(c, W, x, b, tensors, theirs):
    """Where a large case's time goes, measured in the same run: the
    forward alone sent inline, the same forward with its inputs and y in a
    shared buffer (contract section 6: no socket copies), and PyTorch's
    forward without autograd.  inline - shm is what moving the tensors
    through the socket costs."""
    import torch
    tW, tx, tb = tensors
    es = W.dtype.itemsize
    dt = "f32" if es == 4 else "f64"
    sizes = [W.nbytes, x.nbytes, b.nbytes, W.shape[0] * x.shape[1] * es]
    offs = [0]
    for n in sizes:
        offs.append(offs[-1] + (n + 4095) // 4096 * 4096)
    reps = 3 if QUICK else 10
    with c.shared_buffer(offs[-1]) as sb:
        for o, a in zip(offs, (W, x, b)):
            sb.put(o, a)
        ins = {"weight": sb.tensor(offs[0], W.shape, dt), "x": sb.tensor(offs[1], x.shape, dt),
               "bias": sb.tensor(offs[2], b.shape, dt)}
        shm = best(lambda: c.forward("fused_dense", ins, options={"act": "gelu"}, into={"y": (sb, offs[3])}), reps)
    inline = best(lambda: c.forward("fused_dense", {"weight": W, "x": x, "bias": b}, options={"act": "gelu"}), reps)

    def tfwd():
        with torch.no_grad():
            torch.nn.functional.gelu(tW @ tx + tb[:, None])
    tf = best(tfwd, reps)
    print(f"{'  forward alone: inline, shm':32s} {inline * 1e3:10.2f} {tf * 1e3:10.2f} {inline / tf:7.2f}"
          f"  shm {shm * 1e3:.2f} ms, {shm / tf:.2f} of PyTorch's; BLAS kernels: "
          f"{os.environ.get('OPENBLAS_CORETYPE', 'as detected')}")


def small_floor(c, dtype, theirs):
    """What two calls cost here before any arithmetic: a fused_dense of
    64x64x8 (65k flops: past the loop's inline limit, so handed to a worker
    and back, like the (256, 256, 32) calls, with about 2 us of math and a
    16 KiB message).  Measured in the same run: on virtual machines a
    thread wake-up can take tens of microseconds, and a call has four."""
    rng = np.random.default_rng(1)
    W, x, b = (rng.standard_normal(s).astype(dtype) for s in ((64, 64), (64, 8), (64,)))
    one = best(lambda: c.forward("fused_dense", {"weight": W, "x": x, "bias": b}, options={"act": "gelu"}),
               50 if QUICK else 300)
    print(f"{'  floor: two near-empty calls':32s} {2 * one * 1e3:10.2f} {'':10s} {2 * one / theirs:7.2f}"
          f"  (of PyTorch's time above)")


def bench_transpose(c):
    n = 1024 if QUICK else 2048
    A = np.random.default_rng(1).standard_normal((n, n))
    out, back = np.empty_like(A), np.empty_like(A)

    def ours():
        c.forward("tensoradd", {"A": A}, options={"pA": [1, 0]})

    # "A copy of the same 64 MiB in memory" (issue 15): the 32 MiB that go
    # out and the 32 MiB that come back, copied once each into memory
    # already paged in (as bench_shm's memcpy).  Half of it (one 32 MiB
    # copy) is printed too: this bench compared against that before.
    def copy():
        np.copyto(out, A)
        np.copyto(back, out)

    def copy_half():
        np.copyto(out, A)

    # The shared-memory path (contract section 6): A already in a registered
    # buffer, C written into it; plus the copy of the values a user of it
    # still makes, the sum is what inline is held against.
    nbytes = n * n * 8
    with c.shared_buffer(2 * nbytes) as sb:
        sb.put(0, A)
        a_shm = sb.tensor(0, (n, n), "f64")

        def shm():
            c.forward("tensoradd", {"A": a_shm}, options={"pA": [1, 0]}, into={"C": (sb, nbytes)})

        shm()
        np.testing.assert_array_equal(sb.array(nbytes, (n, n), "f64"), A.T)
        s = best(shm, 5)
    a, t, h = best(ours, 5), best(copy, 5), best(copy_half, 5)
    w = socket_floor(A)
    print(f"transpose {n}² f64 inline round trip {a * 1e3:.1f} ms, copy of both ways {t * 1e3:.1f} ms: "
          f"ratio {a / t:.1f}; shm {s * 1e3:.1f} ms: inline/(shm + copy) {a / (s + t):.2f}  "
          f"(against one way's copy, {h * 1e3:.1f} ms: {a / h:.1f} and {a / (s + h):.2f})")
    print(f"  the socket's floor: {A.nbytes >> 20} MiB through a bare socketpair {w * 1e3:.1f} ms a way; "
          f"inline/(shm + both ways) {a / (s + 2 * w):.2f}")


def socket_floor(A):
    """What moving A's bytes through a Unix socket costs here with nothing
    else done: a socketpair with the send buffer the client and daemon set
    (4 MiB), this thread sending from A's memory, another receiving into
    memory already paged in, as the daemon's and the client's buffers are.
    Best time of one way."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for sk in (a, b):
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    dst = memoryview(np.ones(A.nbytes, np.uint8))
    n = A.nbytes

    def receive():
        while True:
            got = 0
            while got < n:
                k = b.recv_into(dst[got:])
                if k == 0:
                    return
                got += k
            b.sendall(b"!")

    rx = threading.Thread(target=receive, daemon=True)
    rx.start()
    src = memoryview(A).cast("B")

    def one_way():
        a.sendall(src)
        a.recv(1)
    t = best(one_way, 10)
    a.close()
    rx.join()
    b.close()
    return t


def bench_alone_two(path, op="svd_vals"):
    n = 512 if QUICK else 1024
    A = np.random.default_rng(2).standard_normal((n, n))
    clients = [pullbackd.Client(path), pullbackd.Client(path)]

    def one(c):
        if op == "tensorcontract":
            c.forward("tensorcontract", {"A": A, "B": A}, options={"spec": "ij,jk->ik"})
        else:
            c.forward(op, {"A": A})

    alone = best(lambda: one(clients[0]), 3)

    def two():
        ts = [threading.Thread(target=one, args=(cl,)) for cl in clients]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    both = best(two, 3)
    for cl in clients:
        cl.close()
    print(f"{op} {n}² f64 alone {alone * 1e3:.0f} ms, two at once {both * 1e3:.0f} ms: "
          f"alone/two {alone / both:.2f}")


def main():
    path = os.environ.get("PULLBACKD_SOCKET")
    proc = None
    if path is None:
        d = tempfile.mkdtemp(prefix="pbbench")
        path = os.path.join(d, "pullbackd.sock")
        binary = os.environ.get("PULLBACKD_BIN", "build/daemon/pullbackd")
        proc = subprocess.Popen([binary, "--socket", path, "--log-level", "warning"])
        wait_for_socket(path, proc)
    try:
        with pullbackd.Client(path) as c:
            bench_fused_dense(c)
            bench_transpose(c)
        bench_alone_two(path, "svd_vals")      # LAPACK, half GEMV: split GEMVs
        bench_alone_two(path, "qr_compact")    # LAPACK, its GEMMs split (kernels/blas_lapack.c)
        bench_alone_two(path, "tensorcontract")  # GEMM-bound: idle workers help
    finally:
        if proc:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
