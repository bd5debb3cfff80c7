"""Many client processes sharing one GPU through the daemon (issue 12).

N processes each loop fused_dense augmented_forward + reverse with gelu on
"cuda" at (out, in, batch) = (4096, 4096, 256) f32, through the Python
client; the same total work from one process; and the same requests on the
CPU for a while.  Prints the total throughput of N processes ÷ one process
(goal ≥ 0.9) and GPU ÷ CPU throughput (goal ≥ 10).

  python3 tests/bench/bench_gpu_socket.py SOCKET [N] [--quick]
"""

import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "clients", "python"))
import pullbackd  # noqa: E402

SHAPE = (4096, 4096, 256)


def pairs(path, device, n, seed, ready=None, go=None):
    """n forward+reverse pairs on device; seconds taken."""
    rng = np.random.default_rng(seed)
    out, inn, batch = SHAPE
    W = (rng.standard_normal((out, inn)) / 64).astype(np.float32)
    x = rng.standard_normal((inn, batch)).astype(np.float32)
    b = rng.standard_normal(out).astype(np.float32)
    yb = np.ones((out, batch), np.float32)
    with pullbackd.Client(path, timeout=600) as c:
        y, tape = c.augmented_forward("fused_dense", {"weight": W, "x": x, "bias": b}, wrt=["weight", "x", "bias"],
                                      options={"act": "gelu"}, device=device)
        c.reverse(tape, {"y": yb})  # warm-up
        if ready is not None:
            ready.wait()
            go.wait()
        t0 = time.perf_counter()
        for _ in range(n):
            y, tape = c.augmented_forward("fused_dense", {"weight": W, "x": x, "bias": b},
                                          wrt=["weight", "x", "bias"], options={"act": "gelu"}, device=device)
            c.reverse(tape, {"y": yb})
        return time.perf_counter() - t0


def worker(args):
    path, n, seed, ready, go = args
    return pairs(path, "cuda", n, seed, ready, go)


def main():
    path = sys.argv[1]
    nproc = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 8
    quick = "--quick" in sys.argv
    per = 2 if quick else 10
    one = pairs(path, "cuda", nproc * per, 0)
    with mp.Manager() as m:
        ready, go = m.Barrier(nproc + 1), m.Barrier(nproc + 1)
        with mp.Pool(nproc) as pool:
            res = pool.map_async(worker, [(path, per, k, ready, go) for k in range(nproc)])
            ready.wait()
            t0 = time.perf_counter()
            go.wait()
            res.get()
            many = time.perf_counter() - t0
    cpu = pairs(path, "cpu", 1 if quick else 3, 0)
    cpu_rate, one_rate, many_rate = (1 if quick else 3) / cpu, nproc * per / one, nproc * per / many
    print(f"fused_dense {SHAPE} f32 gelu, aug+rev pairs/s: one process {one_rate:.2f}, {nproc} processes "
          f"{many_rate:.2f} ({many_rate / one_rate:.2f} of one), CPU {cpu_rate:.3f} (GPU/CPU {one_rate / cpu_rate:.1f})")


if __name__ == "__main__":
    main()
