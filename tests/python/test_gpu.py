"""The daemon's GPU service, through the GPU backend's host fake.

The daemon is started with PULLBACKD_FAKE_CUDA (cuda/fake.h): its GPU
workers, device tapes, budgets and errors run here as they would on a GPU,
and the op code runs through the fake's checks.  The numbers are the fake's
(the CPU's math), so GPU and CPU results must agree to rounding.

Run: PULLBACKD_BIN=build/daemon/pullbackd /usr/bin/python3 tests/python/test_gpu.py
"""

import os
import mmap
import sys
import threading
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "clients", "python"))
import pullbackd  # noqa: E402
from pullbackd import PullbackError  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_case import DaemonCase  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu"))
import parity  # noqa: E402

ACTS = ["identity", "relu", "leakyrelu", "sigmoid", "tanh", "gelu", "gelu_erf", "silu", "softplus", "elu"]
TOL = {np.float64: dict(rtol=1e-12, atol=1e-13), np.float32: dict(rtol=1e-5, atol=1e-6)}


class GpuCase(DaemonCase):
    def setUp(self):
        self.c = pullbackd.Client(self.path, timeout=30)
        self.rng = np.random.default_rng(11)

    def tearDown(self):
        self.c.close()

    def assertCode(self, code, fn, *args, **kw):
        with self.assertRaises(PullbackError) as cm:
            fn(*args, **kw)
        self.assertEqual(cm.exception.code, code, f"{cm.exception}")
        return cm.exception

    def data(self, dtype=np.float64, out=5, inn=4, batch=3, vector=False):
        W = self.rng.standard_normal((out, inn)).astype(dtype)
        x = self.rng.standard_normal(inn if vector else (inn, batch)).astype(dtype)
        b = self.rng.standard_normal(out).astype(dtype)
        return W, x, b

    def device(self, name):
        return next(d for d in self.c.stats()["devices"] if d["name"] == name)

    def wait_for(self, cond, what, timeout=5):
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                self.fail(f"not within {timeout} s: {what}")
            time.sleep(0.01)


class FakeGpu(GpuCase):
    DAEMON_ENV = {"PULLBACKD_FAKE_CUDA": "devices=2,memory=64M"}
    # Requests' reservations past the device's memory: the fake's running
    # out midway is what test_device_memory_exhausted sees.
    DAEMON_ARGS = ["--max-device-tape-bytes", "1M", "--max-device-bytes", "1G"]

    def test_devices_in_hello_ops_and_stats(self):
        h = self.c.hello()
        self.assertEqual(h["devices"], ["cpu", "cuda:0", "cuda:1"])
        self.assertEqual(h["limits"]["max_device_tape_bytes"], 1 << 20)
        ops = self.c.ops()["ops"]
        for name in ("fused_dense", "tensorcontract", "tensoradd", "tensortrace"):
            self.assertEqual(ops[name]["devices"], ["cpu", "cuda"], name)
        self.assertEqual(ops["qr_compact"]["devices"], ["cpu"])
        devs = self.c.stats()["devices"]
        self.assertEqual([d["name"] for d in devs], ["cpu", "cuda:0", "cuda:1"])
        for d in devs[1:]:
            self.assertEqual(d["model"][:8], "fake GPU")
            self.assertEqual(d["memory_bytes"], 64 << 20)
            self.assertEqual((d["used_bytes"], d["tapes"], d["tape_bytes"], d["failed"]), (0, 0, 0, False))

    def test_fused_dense_as_on_the_cpu(self):
        n = 0
        for dtype in (np.float32, np.float64):
            for act in ACTS:
                for order in "CF":
                    vector = act in ("gelu", "relu")
                    W, x, b = self.data(dtype, vector=vector)
                    if order == "F":
                        W = np.asfortranarray(W)
                    yb = self.rng.standard_normal(5 if vector else (5, 3)).astype(dtype)
                    inputs = {"weight": W, "x": x, "bias": b}
                    res = {}
                    for dev in ("cpu", "cuda:1" if n % 2 else "cuda"):
                        y, tape = self.c.augmented_forward("fused_dense", inputs, wrt=["weight", "x", "bias"],
                                                           options={"act": act}, device=dev, order=order)
                        res[dev[:4]] = (y["y"], self.c.reverse(tape, {"y": yb}, order=order))
                    what = f"{dtype.__name__} {act} order {order}"
                    np.testing.assert_allclose(res["cuda"][0], res["cpu"][0], **TOL[dtype], err_msg=what)
                    for k in ("weight", "x", "bias"):
                        self.assertEqual(res["cuda"][1][k].shape, inputs[k].shape)
                        np.testing.assert_allclose(res["cuda"][1][k], res["cpu"][1][k], **TOL[dtype],
                                                   err_msg=f"{what} {k}")
                    y = self.c.forward("fused_dense", inputs, options={"act": act}, device="cuda:0")["y"]
                    np.testing.assert_allclose(y, res["cpu"][0], **TOL[dtype], err_msg=what)
                    n += 1

    def test_parity_sweep(self):
        """tests/gpu/parity.py, which run.sh runs on a real GPU, passes here."""
        self.assertEqual(parity.sweep(self.path), 0)

    def test_check_on_the_gpu(self):
        for dtype, tol in ((np.float64, 1e-6), (np.float32, 1e-2)):
            W, x, b = self.data(dtype)
            r = self.c.check("fused_dense", {"weight": W, "x": x, "bias": b}, wrt=["weight", "x", "bias"],
                             options={"act": "gelu"}, device="cuda")
            self.assertLess(r["max_rel_err"], tol, dtype)

    def test_tensor_ops_check_on_the_gpu(self):
        """The server's finite differences of the tensor ops' rules on cuda."""
        for dtype in (np.float64, np.complex128):
            A = self.rng.standard_normal((2, 3, 4)).astype(dtype)
            B = self.rng.standard_normal((4, 3)).astype(dtype)
            if dtype == np.complex128:
                A = A + 1j * self.rng.standard_normal(A.shape)
            C = np.ones((2, 3, 3), dtype)
            alpha = [0.5, 0.25] if dtype == np.complex128 else 0.5
            cases = [("tensorcontract", {"A": A, "B": B, "C": C}, {"spec": "abc,cd->abd", "alpha": alpha, "beta": 2.0},
                      ["A", "B", "C", "alpha", "beta"]),
                     ("tensoradd", {"A": A}, {"pA": [1, 2, 0], "conjA": True, "alpha": 1.5}, ["A", "alpha"]),
                     ("tensortrace", {"A": A[:, :, :2]}, {"p": [1], "q": [[0], [2]]}, ["A", "alpha"])]
            for op, inputs, options, wrt in cases:
                r = self.c.check(op, inputs, wrt=wrt, options=options, device="cuda")
                self.assertLess(r["max_rel_err"], 1e-6, f"{op} {dtype.__name__}: {r}")
        self.assertEqual(self.device("cuda:0")["used_bytes"], 0)

    def test_eigh_on_the_gpu(self):
        """eigh's rule runs on cuda as on the CPU: check's finite
        differences, its tape (D and V) in device memory, its refusals."""
        for dtype, tol in ((np.float64, 1e-6), (np.complex128, 1e-6), (np.float32, 1e-2)):
            A = self.rng.standard_normal((6, 6)).astype(dtype)
            if dtype == np.complex128:
                A = A + 1j * self.rng.standard_normal(A.shape)
            A = (A + A.conj().T) / 2
            for op in ("eigh_full", "eigh_vals", "eigh_trunc"):
                options = {"maxrank": 3} if op == "eigh_trunc" else {}
                r = self.c.check(op, {"A": A}, wrt=["A"], options=options, device="cuda")
                self.assertLess(r["max_rel_err"], tol, f"{op} {dtype.__name__}: {r}")
        out, tape = self.c.augmented_forward("eigh_full", {"A": A}, wrt=["A"], device="cuda:1")
        d = self.device("cuda:1")
        self.assertEqual((d["tapes"], d["tape_bytes"]), (1, 6 * 6 * 4 + 6 * 4))
        np.testing.assert_allclose((out["V"] * out["D"]) @ out["V"].T, A, atol=1e-5)
        self.c.reverse(tape, {"D": np.ones(6, np.float32)})
        self.assertEqual(self.device("cuda:1")["used_bytes"], 0)
        e = self.assertCode("invalid_argument", self.c.forward, "eigh_full", {"A": np.triu(A) + 1}, device="cuda")
        self.assertIn("not Hermitian", e.message)
        A[2, 3] = np.nan
        self.assertCode("numerical_error", self.c.forward, "eigh_vals", {"A": A}, device="cuda")
        self.assertCode("shape_mismatch", self.c.forward, "eigh_vals", {"A": A[:, :4]}, device="cuda")
        self.assertEqual(self.device("cuda:0")["used_bytes"], 0)

    def test_svd_on_the_gpu(self):
        """The SVD's rule on cuda: tall and wide A (cuSOLVER's gesvd takes
        the wide one transposed), check's finite differences, its tape in
        device memory."""
        for dtype, tol in ((np.float64, 1e-6), (np.complex128, 1e-6), (np.float32, 1e-2)):
            for shape in ((7, 4), (4, 7)):
                A = self.rng.standard_normal(shape).astype(dtype)
                if dtype == np.complex128:
                    A = A + 1j * self.rng.standard_normal(shape)
                for op in ("svd_compact", "svd_vals", "svd_trunc"):
                    options = {"maxrank": 2} if op == "svd_trunc" else {}
                    r = self.c.check(op, {"A": A}, wrt=["A"], options=options, device="cuda")
                    self.assertLess(r["max_rel_err"], tol, f"{op} {dtype.__name__} {shape}: {r}")
                out = self.c.forward("svd_compact", {"A": A}, device="cuda")
                np.testing.assert_allclose((out["U"] * out["S"]) @ out["Vh"], A, atol=1e-5)
                np.testing.assert_allclose(out["S"], np.linalg.svd(A, compute_uv=False), rtol=1e-5)
                for op in ("left_polar", "right_polar"):  # W·P takes m ≥ n, P·Wh m ≤ n
                    if (op == "left_polar") == (shape[0] >= shape[1]):
                        r = self.c.check(op, {"A": A}, wrt=["A"], device="cuda")
                        self.assertLess(r["max_rel_err"], tol, f"{op} {dtype.__name__} {shape}: {r}")
        out, tape = self.c.augmented_forward("svd_compact", {"A": A}, wrt=["A"], device="cuda:1")
        d = self.device("cuda:1")
        self.assertEqual((d["tapes"], d["tape_bytes"]), (1, 4 * (4 * 4 + 4 + 4 * 7)))
        self.c.reverse(tape, {"S": np.ones(4, np.float32)})
        self.assertEqual(self.device("cuda:1")["used_bytes"], 0)

    def test_tapes_live_in_device_memory(self):
        W, x, b = self.data(out=16, inn=16, batch=8)
        y, tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x, "bias": b}, wrt=["weight", "x"],
                                           options={"act": "tanh"}, device="cuda:1")
        # y (16×8) for tanh′, x for W̄, W for x̄.
        self.assertEqual(tape.tape_bytes, 8 * (16 * 8 + 16 * 8 + 16 * 16))
        d = self.device("cuda:1")
        self.assertEqual((d["tapes"], d["tape_bytes"], d["used_bytes"]), (1, tape.tape_bytes, tape.tape_bytes))
        self.assertEqual(self.device("cuda:0")["used_bytes"], 0)
        self.assertEqual(self.c.stats()["tape_bytes"], tape.tape_bytes)
        metrics = self.c.call("metrics")["text"].splitlines()
        for line in (f'pullbackd_tapes{{device="cuda:1",scope="connection"}} 1',
                     f'pullbackd_tape_bytes{{device="cuda:1",scope="connection"}} {tape.tape_bytes}',
                     'pullbackd_tapes{device="cpu",scope="connection"} 0',
                     f'pullbackd_device_memory_bytes{{device="cuda:1"}} {tape.tape_bytes}',
                     'pullbackd_device_failed{device="cuda:1"} 0'):
            self.assertIn(line, metrics)
        self.c.reverse(tape, {"y": np.ones((16, 8))})
        d = self.device("cuda:1")
        self.assertEqual((d["tapes"], d["tape_bytes"], d["used_bytes"]), (0, 0, 0))
        # Released, and dropped with the connection that made it.
        y, tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"], device="cuda:1")
        self.assertTrue(self.c.release(tape))
        self.assertEqual(self.device("cuda:1")["used_bytes"], 0)
        with pullbackd.Client(self.path) as other:
            kept = other.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"], device="cuda:1")
            self.assertGreater(self.device("cuda:1")["used_bytes"], 0)
        self.wait_for(lambda: self.device("cuda:1")["used_bytes"] == 0, "the closed connection's tape freed")
        del kept

    def test_device_tape_budget(self):
        W, x, b = self.data(out=300, inn=300, batch=4)  # W is 703 KiB: one tape fits in 1 MiB
        tapes = [self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"], device="cuda:0")[1]]
        e = self.assertCode("resource_exhausted", self.c.augmented_forward, "fused_dense",
                            {"weight": W, "x": x}, wrt=["x"], device="cuda:0")
        self.assertEqual(e.details.get("limit"), "max_device_tape_bytes")
        self.assertIn("cuda:0", e.message)
        # Another GPU and the CPU have budgets of their own.
        tapes.append(self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"], device="cuda:1")[1])
        tapes.append(self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"], device="cpu")[1])
        for t in tapes:
            self.c.release(t)

    def test_device_memory_exhausted(self):
        W = np.ones((2048, 2048))  # 32 MiB, with x and y past the fake's 64 MiB
        e = self.assertCode("resource_exhausted", self.c.forward, "fused_dense", {"weight": W, "x": np.ones((2048, 2048))},
                            device="cuda:0")
        self.assertEqual(e.details.get("limit"), "device_memory")
        self.assertIn("cuda:0 is out of memory", e.message)
        self.assertEqual(self.device("cuda:0")["used_bytes"], 0)
        self.assertFalse(self.device("cuda:0")["failed"])
        y = self.c.forward("fused_dense", {"weight": W[:4, :4], "x": np.ones((4, 2))}, device="cuda:0")["y"]
        np.testing.assert_array_equal(y, np.full((4, 2), 4.0))

    def test_torch_on_the_gpu(self):
        """pullbackd.torch with device="cuda": CPU tensors here, the rule and its tape on the daemon's GPU."""
        try:
            import torch
        except ImportError:
            self.skipTest("no torch")
        import pullbackd.torch as pbt
        W, x, b = (torch.tensor(a, requires_grad=True) for a in self.data())
        grads = {}
        for dev in ("cpu", "cuda"):
            y = pbt.fused_dense(W, x, b, act="gelu", client=self.c, device=dev)
            if dev == "cuda":
                self.assertEqual(self.device("cuda:0")["tapes"], 1)
            (y * y).sum().backward()
            grads[dev] = [t.grad.clone() for t in (W, x, b)]
            for t in (W, x, b):
                t.grad = None
        for g_cpu, g_gpu in zip(grads["cpu"], grads["cuda"]):
            torch.testing.assert_close(g_gpu, g_cpu, rtol=1e-12, atol=1e-13)
        self.wait_for(lambda: self.device("cuda:0")["tapes"] == 0, "the graph's tape released")
        A = torch.randn(3, 4, 5, dtype=torch.complex128, requires_grad=True)
        B = torch.randn(5, 2, dtype=torch.complex128, requires_grad=True)
        self.assertTrue(torch.autograd.gradcheck(
            lambda a, bb: pbt.tensorcontract(a, bb, spec="abc,cd->abd", client=self.c, device="cuda:1"), (A, B)))

    def test_devices_not_served(self):
        W, x, b = self.data()
        e = self.assertCode("device_unavailable", self.c.forward, "fused_dense", {"weight": W, "x": x},
                            device="cuda:2")
        self.assertIn("2 GPUs (cuda:0 to cuda:1)", e.message)
        self.assertCode("invalid_argument", self.c.forward, "fused_dense", {"weight": W, "x": x}, device="gpu")
        e = self.assertCode("device_unavailable", self.c.forward, "svd_full", {"A": W}, device="cuda")
        self.assertIn("no implementation on this device", e.message)
        e = self.assertCode("device_unavailable", self.c.call, "register_buffer", {"size": 64, "device": "cuda:2"},
                            fds=[os.memfd_create("pb-fake-gpu:2")])
        self.assertIn("cuda:2", e.message)

    def test_into_shared_memory(self):
        W, x, b = self.data()
        with self.c.shared_buffer(4096) as buf:
            yt = buf.tensor(0, (5, 3), np.float64)
            self.c.forward("fused_dense", {"weight": buf.put(512, W), "x": buf.put(1024, x), "bias": b},
                           options={"act": "silu"}, device="cuda:0", into={"y": yt})
            want = self.c.forward("fused_dense", {"weight": W, "x": x, "bias": b}, options={"act": "silu"})["y"]
            np.testing.assert_allclose(buf.view(yt), want, **TOL[np.float64])
            y, tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["weight"], device="cuda:0")
            gt = buf.tensor(2048, (5, 4), np.float64)
            buf.array(2048, (5, 4), np.float64)[...] = 1.0
            self.c.reverse(tape, {"y": np.ones((5, 3))}, into={"weight": gt}, accumulate=True)
            np.testing.assert_allclose(buf.view(gt), 1.0 + np.ones((5, 3)) @ x.T, **TOL[np.float64])


class GpuLanes(GpuCase):
    """Large GPU jobs run one at a time in their GPU's lane; small ones keep flowing beside them."""
    DAEMON_ENV = {"PULLBACKD_FAKE_CUDA": "devices=1"}
    DAEMON_ARGS = ["--gpu-workers", "2", "--gpu-lane-flops", os.environ.get("PB_TEST_LANE_FLOPS", "1G")]

    def test_small_requests_pass_large_ones(self):
        n = 2048  # 2·n³ = 17 Gflop a forward: large, about a second on the fake
        W = np.ones((n, n)) / n
        done = {}

        def large(k):
            with pullbackd.Client(self.path, timeout=120) as c:
                c.forward("fused_dense", {"weight": W, "x": W}, device="cuda")
                done[f"L{k}"] = time.monotonic()

        threads = [threading.Thread(target=large, args=(k,)) for k in (1, 2)]
        for t in threads:
            t.start()
        self.wait_for(lambda: self.c.stats()["requests_in_flight"] >= 2, "both large requests in flight", 60)
        sent = time.monotonic()
        y = self.c.forward("fused_dense", {"weight": np.eye(3), "x": np.ones((3, 2))}, device="cuda")["y"]
        done["S"] = time.monotonic()
        for t in threads:
            t.join(120)
        np.testing.assert_array_equal(y, np.ones((3, 2)))
        self.assertEqual(sorted(done), ["L1", "L2", "S"])
        # Behind a large job the small one would wait for most of it; in a
        # lane of its own it takes a small part of the time to the first
        # large reply.
        self.assertLess(done["S"] - sent, (min(done["L1"], done["L2"]) - sent) / 4,
                        f"the small request took {done['S'] - sent:.3f} s; the large replies came "
                        f"{done['L1'] - sent:.3f} and {done['L2'] - sent:.3f} s after it was sent")


class GpuBuffers(GpuCase):
    """GPU memory passed as a file descriptor (section 6), through the fake: a memfd named
    "pb-fake-gpu:N" plays device N's exported memory, and the test reads it through its own mapping."""
    DAEMON_ENV = {"PULLBACKD_FAKE_CUDA": "devices=2,memory=64M"}

    def gpu_memory(self, dev, size):
        fd = os.memfd_create(f"pb-fake-gpu:{dev}")
        os.ftruncate(fd, size)
        self.addCleanup(os.close, fd)
        return fd, mmap.mmap(fd, size)

    def view(self, mem, offset, shape, dtype=np.float64):
        return np.frombuffer(mem, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)

    def test_in_place(self):
        fd, mem = self.gpu_memory(0, 1 << 16)
        buf = self.c.register_buffer(fd, 1 << 16, device="cuda:0")
        W, x, b = self.data()
        self.view(mem, 0, W.shape)[...] = W
        self.view(mem, 4096, x.shape)[...] = x
        t = lambda off, shape: pullbackd.BufferTensor(buf, off, "f64", shape, "C")  # noqa: E731
        inputs = {"weight": t(0, W.shape), "x": t(4096, x.shape), "bias": b}
        want = self.c.forward("fused_dense", {"weight": W, "x": x, "bias": b}, options={"act": "tanh"})["y"]
        # read in place, the result written in place
        self.c.forward("fused_dense", inputs, options={"act": "tanh"}, device="cuda:0", into={"y": (buf, 8192)})
        np.testing.assert_allclose(self.view(mem, 8192, want.shape), want, **TOL[np.float64])
        # a tape of a GPU buffer's input is the daemon's own: overwriting the buffer after does not change it
        y, tape = self.c.augmented_forward("fused_dense", inputs, wrt=["weight", "x"], options={"act": "tanh"},
                                           device="cuda:0")
        g_want = self.c.reverse(self.c.augmented_forward("fused_dense", {"weight": W, "x": x, "bias": b},
                                                         wrt=["weight", "x"], options={"act": "tanh"})[1],
                                {"y": np.ones((5, 3))})
        self.view(mem, 0, W.shape)[...] = 7.0
        self.view(mem, 4096, x.shape)[...] = 7.0
        self.view(mem, 12288, (5, 3))[...] = 1.0  # the cotangent, in the buffer too
        self.view(mem, 16384, W.shape)[...] = 0.5  # W̄ is added to this
        g = self.c.reverse(tape, {"y": t(12288, (5, 3))}, into={"weight": (buf, 16384)}, accumulate=True)
        np.testing.assert_allclose(self.view(mem, 16384, W.shape), 0.5 + g_want["weight"], **TOL[np.float64])
        np.testing.assert_allclose(g["x"], g_want["x"], **TOL[np.float64])
        # the tensor ops too
        A = self.rng.standard_normal((3, 4, 5))
        self.view(mem, 20480, A.shape)[...] = A
        C = self.c.forward("tensoradd", {"A": t(20480, A.shape)}, options={"pA": [2, 0, 1]}, device="cuda:0")["C"]
        np.testing.assert_array_equal(C, A.transpose(2, 0, 1))
        self.assertTrue(self.c.unregister_buffer(buf))
        self.wait_for(lambda: self.device("cuda:0")["used_bytes"] == 0, "nothing held")

    def test_refusals(self):
        fd0, mem0 = self.gpu_memory(0, 4096)
        buf = self.c.register_buffer(fd0, 4096, device="cuda:0")
        T = pullbackd.BufferTensor(buf, 0, "f64", (2, 2), "C")
        for dev in ("cpu", "cuda:1"):
            e = self.assertCode("invalid_argument", self.c.forward, "fused_dense", {"weight": T, "x": np.ones((2, 1))},
                                device=dev)
            self.assertIn(f"cuda:0's memory, and this runs on {dev}", e.message)
            self.assertEqual(e.details.get("arg"), "inputs.weight")
            e = self.assertCode("invalid_argument", self.c.forward, "fused_dense",
                                {"weight": np.eye(2), "x": np.ones((2, 2))}, device=dev, into={"y": (buf, 0)})
            self.assertIn("into.y", e.message)
        e = self.assertCode("invalid_argument", self.c.check, "fused_dense", {"weight": T, "x": np.ones((2, 1))},
                            wrt=["x"], device="cuda:0")
        self.assertIn("check steps its inputs on the host", e.message)
        y, tape = self.c.augmented_forward("fused_dense", {"weight": np.eye(2), "x": np.ones((2, 2))}, wrt=["x"])
        e = self.assertCode("invalid_argument", self.c.reverse, tape, {"y": T})
        self.assertIn("this runs on cpu", e.message)
        # not an export, another device's, past its size
        plain = os.memfd_create("not-gpu-memory")
        os.ftruncate(plain, 4096)
        self.addCleanup(os.close, plain)
        e = self.assertCode("invalid_argument", self.c.register_buffer, plain, 4096, device="cuda:0")
        self.assertIn("not a CUDA memory export", e.message)
        fd1, _ = self.gpu_memory(1, 4096)
        e = self.assertCode("invalid_argument", self.c.register_buffer, fd1, 4096, device="cuda:0")
        self.assertIn("lives on cuda:1, not cuda:0", e.message)
        e = self.assertCode("invalid_argument", self.c.register_buffer, fd1, 8192, device="cuda:1")
        self.assertIn("more than the exported allocation", e.message)
        self.assertEqual(self.c.register_buffer(fd1, 4096, device="cuda:1"), buf + 1)

    def test_closed_connection_unmaps(self):
        fd, mem = self.gpu_memory(1, 4096)
        with pullbackd.Client(self.path) as other:
            buf = other.register_buffer(fd, 4096, device="cuda:1")
            self.view(mem, 0, (2, 2))[...] = np.eye(2)
            y = other.forward("fused_dense", {"weight": pullbackd.BufferTensor(buf, 0, "f64", (2, 2), "C"),
                                              "x": np.ones((2, 1))}, device="cuda:1")["y"]
            np.testing.assert_array_equal(y, np.ones((2, 1)))
        # the daemon's mapping goes with the connection (the fake would abort on a second unmap)
        self.assertEqual(self.c.hello()["protocol"], 1)


class DeviceCap(GpuCase):
    """A request that may need more device memory than the cap leaves is refused before it runs."""
    DAEMON_ENV = {"PULLBACKD_FAKE_CUDA": "devices=1,memory=64M"}
    DAEMON_ARGS = ["--max-device-bytes", "8M"]

    def test_refused_up_front(self):
        # W, x and y of 2.7 MiB each, and as much again for temporaries: 16.5 MiB.
        W = np.ones((600, 600))
        e = self.assertCode("resource_exhausted", self.c.forward, "fused_dense", {"weight": W, "x": W},
                            device="cuda")
        self.assertEqual(e.details.get("limit"), "max_device_bytes")
        self.assertIn("of max_device_bytes 8388608", e.message)
        self.assertEqual(self.device("cuda:0")["used_bytes"], 0)
        # 2·(2.7 MiB + 9.4 KiB) fits alone; beside a tape that keeps W
        # (2.7 MiB) it does not.
        inputs = {"weight": W, "x": np.ones((600, 1))}
        y, tape = self.c.augmented_forward("fused_dense", inputs, wrt=["x"], device="cuda")
        e = self.assertCode("resource_exhausted", self.c.forward, "fused_dense", inputs, device="cuda")
        self.assertEqual(e.details.get("limit"), "max_device_bytes")
        self.c.release(tape)
        y = self.c.forward("fused_dense", inputs, device="cuda")["y"]
        np.testing.assert_array_equal(y, np.full((600, 1), 600.0))
        # The CPU has no such cap.
        self.c.forward("fused_dense", {"weight": W, "x": W})
        # eigh counts its temporaries too (A's copy, the solver's
        # workspace): 2·(A + V) and 7·A, 14.1 MB at 400²; eigh_vals at
        # 300², 2·A and 7·A, 6.5 MB.
        e = self.assertCode("resource_exhausted", self.c.forward, "eigh_full", {"A": np.eye(400)}, device="cuda")
        self.assertEqual(e.details.get("limit"), "max_device_bytes")
        self.assertIn("may need 14", e.message)
        np.testing.assert_array_equal(self.c.forward("eigh_vals", {"A": np.eye(300)}, device="cuda")["D"], 1.0)


class FailedGpu(GpuCase):
    # A forward without bias is 5 stream calls: the second one fails cuda:0.
    DAEMON_ENV = {"PULLBACKD_FAKE_CUDA": "devices=2,sticky_after=7"}
    DAEMON_ARGS = ["--log-level", "error"]

    def test_a_failed_gpu_serves_nothing_and_the_rest_goes_on(self):
        W, x, b = self.data()
        y, tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["weight"], device="cuda:0")
        e = self.assertCode("device_unavailable", self.c.forward, "fused_dense", {"weight": W, "x": x},
                            device="cuda:0")
        self.assertIn("cuda:0 has failed", e.message)
        self.assertTrue(self.device("cuda:0")["failed"])
        self.assertEqual(self.c.hello()["devices"], ["cpu", "cuda:1"])
        e = self.assertCode("device_unavailable", self.c.forward, "fused_dense", {"weight": W, "x": x},
                            device="cuda:0")
        self.assertIn("has failed", e.message)
        self.assertCode("device_unavailable", self.c.reverse, tape, {"y": np.ones((5, 3))})
        want = W @ x
        np.testing.assert_allclose(self.c.forward("fused_dense", {"weight": W, "x": x})["y"], want,
                                   **TOL[np.float64])
        self.assertTrue(self.c.release(tape))


class SolverFailure(GpuCase):
    # Every cuSOLVER call reports that it did not converge (info 7).
    DAEMON_ENV = {"PULLBACKD_FAKE_CUDA": "solver_info=7"}

    def test_numerical_error_with_info(self):
        A = np.eye(4) + 0.25
        for op in ("eigh_full", "eigh_vals", "svd_compact", "svd_vals", "svd_trunc", "left_polar", "right_polar"):
            e = self.assertCode("numerical_error", self.c.forward, op, {"A": A}, device="cuda")
            self.assertEqual(e.details.get("info"), 7, e.details)
            solver = "dsyevd" if op.startswith("eigh") else "dgesvd"
            self.assertIn(f"cuSOLVER {solver} did not converge (info 7)", e.message)
        np.testing.assert_allclose(self.c.forward("eigh_vals", {"A": A})["D"], [1, 1, 1, 2])
        self.assertEqual(self.device("cuda:0")["used_bytes"], 0)
        self.assertFalse(self.device("cuda:0")["failed"])


class SolverOutOfMemory(GpuCase):
    # Every cuSOLVER call fails for want of memory, the device usable.
    DAEMON_ENV = {"PULLBACKD_FAKE_CUDA": "solver_oom=1"}

    def test_the_failure_is_the_answer(self):
        """A solver that fails inside the op's body is the answer, not the
        zeros its outputs hold (the forward once downloaded them)."""
        A = np.diag([1.0, 2.0, 3.0, 4.0])
        for op in ("eigh_vals", "eigh_full", "eigh_trunc", "svd_vals", "svd_compact", "svd_trunc", "left_polar",
                   "right_polar"):
            for order in "CF":
                e = self.assertCode("resource_exhausted", self.c.forward, op, {"A": A}, order=order, device="cuda")
                self.assertEqual(e.details.get("limit"), "device_memory", e.message)
                self.assertIn("solver_oom", e.message)
        self.assertEqual(self.device("cuda:0")["used_bytes"], 0)
        self.assertFalse(self.device("cuda:0")["failed"])
        np.testing.assert_array_equal(self.c.forward("eigh_vals", {"A": A})["D"], [1, 2, 3, 4])


class UnbindableGpu(GpuCase):
    """A GPU whose workers cannot bind at start is marked failed; the daemon serves the rest."""
    DAEMON_ENV = {"PULLBACKD_FAKE_CUDA": "devices=2,unbindable=1"}
    DAEMON_ARGS = ["--log-level", "error"]

    def test_the_rest_serves(self):
        self.assertEqual(self.c.hello()["devices"], ["cpu", "cuda:0"])
        self.assertTrue(self.device("cuda:1")["failed"])
        W, x, b = self.data()
        e = self.assertCode("device_unavailable", self.c.forward, "fused_dense", {"weight": W, "x": x},
                            device="cuda:1")
        self.assertIn("cuda:1 has failed", e.message)
        for dev in ("cuda:0", "cpu"):
            y = self.c.forward("fused_dense", {"weight": W, "x": x}, device=dev)["y"]
            np.testing.assert_allclose(y, W @ x, **TOL[np.float64])


class SmallGpu(GpuCase):
    """Device memory running out at every point of the tensor ops' forward and reverse."""
    DAEMON_ENV = {"PULLBACKD_FAKE_CUDA": "devices=1,memory=192K"}
    DAEMON_ARGS = ["--max-device-bytes", "1G", "--max-device-tape-bytes", "1G"]

    def test_running_out_anywhere(self):
        # Each request succeeds or is resource_exhausted device_memory and
        # leaves nothing behind, wherever the memory runs out: forwards of
        # growing sizes, and the reverse of one tape beside a second tape
        # that takes more and more of the memory (the reverse once crashed
        # the daemon there: tensorcontract.c's error path cleared a tensor
        # it had not yet initialised).
        def device_memory(e):
            self.assertEqual((e.code, e.details.get("limit")), ("resource_exhausted", "device_memory"), e.message)

        outcomes = set()
        for n in range(6, 16):
            A = self.rng.standard_normal((n, n, 2))
            try:
                y, tape = self.c.augmented_forward("tensorcontract", {"A": A, "B": A.T.copy()}, wrt=["A", "B"],
                                                   options={"spec": "abk,kcd->abcd"}, device="cuda")
                tape.release()
                outcomes.add("forward ok")
            except PullbackError as e:
                device_memory(e)
                outcomes.add("forward out of memory")
            self.assertEqual(self.device("cuda:0")["used_bytes"], 0, n)
        for dtype in (np.float64, np.complex128):
            A = self.rng.standard_normal((8, 8, 2)).astype(dtype)
            B = self.rng.standard_normal((2, 8, 8)).astype(dtype)
            y, tape = self.c.augmented_forward("tensorcontract", {"A": A, "B": B}, wrt=["A", "B", "alpha"],
                                               options={"spec": "abk,kcd->cadb", "alpha": 0.5}, device="cuda")
            held = self.device("cuda:0")["used_bytes"]
            for hog in range(0, 192 << 10, 512):
                try:  # a tape that keeps W (about hog bytes), with little else on the way
                    _, other = self.c.augmented_forward("fused_dense", {"weight": np.zeros((hog // 512 + 1, 64)),
                                                                        "x": np.zeros((64, 1))}, wrt=["x"],
                                                        device="cuda")
                except PullbackError as e:
                    device_memory(e)
                    continue
                try:
                    self.c.reverse(tape, {"C": np.ones((8, 8, 8, 8), dtype)}, keep=True)
                    outcomes.add("reverse ok")
                except PullbackError as e:
                    device_memory(e)
                    outcomes.add("reverse out of memory")
                other.release()
                self.assertEqual(self.device("cuda:0")["used_bytes"], held, f"{dtype.__name__} hog {hog}")
            tape.release()
        self.assertEqual(self.device("cuda:0")["used_bytes"], 0)
        self.assertEqual(outcomes, {"forward ok", "forward out of memory", "reverse ok", "reverse out of memory"})

    def test_eigh_running_out_anywhere(self):
        """eigh's forward and reverse, wherever the device memory runs out:
        an answer, or resource_exhausted device_memory with nothing left."""
        def device_memory(e):
            self.assertEqual((e.code, e.details.get("limit")), ("resource_exhausted", "device_memory"), e.message)

        outcomes = set()
        for dtype in (np.float64, np.complex128):
            for n in range(20, 80, 3):
                A = self.rng.standard_normal((n, n)).astype(dtype)
                if dtype == np.complex128:
                    A = A + 1j * self.rng.standard_normal((n, n))
                A = (A + A.conj().T) / 2
                try:
                    out, tape = self.c.augmented_forward("eigh_full", {"A": A}, wrt=["A"], device="cuda")
                    np.testing.assert_allclose(out["D"], np.linalg.eigvalsh(A), atol=1e-12 * n)
                    outcomes.add("forward ok")
                except PullbackError as e:
                    device_memory(e)
                    outcomes.add("forward out of memory")
                    self.assertEqual(self.device("cuda:0")["used_bytes"], 0, n)
                    continue
                try:
                    # V̄ = V: a cotangent with no gauge part
                    g = self.c.reverse(tape, {"D": np.ones(n), "V": out["V"]})["A"]
                    # Σ D with V̄ = V (no gauge part, and ΔA = V·(I + 0)·Vᴴ): the identity
                    np.testing.assert_allclose(g, np.eye(n), atol=1e-12 * n)
                    outcomes.add("reverse ok")
                except PullbackError as e:
                    device_memory(e)
                    outcomes.add("reverse out of memory")
                    tape.release()
                self.assertEqual(self.device("cuda:0")["used_bytes"], 0, n)
        self.assertEqual(outcomes, {"forward ok", "forward out of memory", "reverse ok", "reverse out of memory"})

    def test_alpha_zero_reads_no_operand(self):
        """alpha = 0: NaN and Inf in A reach nothing, on the GPU as on the CPU (BLAS's rule)."""
        A = np.array([[np.nan, 1.0], [2.0, np.inf]])
        for alpha in (0.0, [0.0, 0.0]):
            for op, inputs, options in (("tensorcontract", {"A": A, "B": np.eye(2)}, {"spec": "ij,jk->ik"}),
                                        ("tensoradd", {"A": A}, {"pA": [1, 0]})):
                if isinstance(alpha, list):
                    inputs = {k: v.astype(np.complex128) for k, v in inputs.items()}
                got = {dev: self.c.forward(op, inputs, options={**options, "alpha": alpha}, device=dev)["C"]
                       for dev in ("cpu", "cuda")}
                np.testing.assert_array_equal(got["cuda"], got["cpu"])
                np.testing.assert_array_equal(got["cuda"], np.zeros((2, 2)))


class NoGpu(GpuCase):
    DAEMON_ENV = {"CUDA_VISIBLE_DEVICES": ""}  # a real GPU, where there is one, hidden

    def test_cpu_only(self):
        self.assertEqual(self.c.hello()["devices"], ["cpu"])
        self.assertEqual(self.c.ops()["ops"]["fused_dense"]["devices"], ["cpu"])
        self.assertEqual([d["name"] for d in self.c.stats()["devices"]], ["cpu"])
        W, x, b = self.data()
        e = self.assertCode("device_unavailable", self.c.forward, "fused_dense", {"weight": W, "x": x},
                            device="cuda")
        self.assertIn("no CUDA devices", e.message)


if __name__ == "__main__":
    unittest.main()
