"""Shared-memory tensors through the Python client (contract section 6),
against a real pullbackd started here.

Run: PULLBACKD_BIN=build/daemon/pullbackd /usr/bin/python3 tests/python/test_shm.py

Results computed from buffers must equal the same calls made with arrays
bit for bit (same arithmetic on the same values); accumulated gradients
must equal the sums numpy forms in the same dtype. Tolerance: none.
"""

import os
import sys
import unittest

import msgpack
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "clients", "python"))
import pullbackd  # noqa: E402
from pullbackd import BufferTensor, PullbackError  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_case import DaemonCase  # noqa: E402

MIB = 1 << 20


def same(a, b):
    """Equal dtype, shape and bytes (NaN-safe, unlike ==)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes(order="A") == b.tobytes(order="A")


class WireShape(unittest.TestCase):
    """What the client sends and how it reads buffer tensors back, without a daemon."""

    def test_encode_decode(self):
        t = BufferTensor(3, 64, np.float32, (2, 5), "F")
        self.assertEqual(pullbackd.encode_tensor(t),
                         {"dtype": "f32", "shape": [2, 5], "order": "F", "buffer": 3, "offset": 64})
        self.assertEqual(t.nbytes, 40)
        back = pullbackd.decode_tensor({"dtype": "f32", "shape": [2, 5], "order": "F", "buffer": 3, "offset": 64})
        self.assertEqual(back, t)
        self.assertEqual(pullbackd._into({"y": (3, 128), "x": t, "b": {"buffer": 4, "offset": 8}}),
                         {"y": {"buffer": 3, "offset": 128}, "x": {"buffer": 3, "offset": 64},
                          "b": {"buffer": 4, "offset": 8}})
        with self.assertRaises(TypeError):
            BufferTensor(1, 0, np.int32, (2,))


class SharedMemory(DaemonCase):
    DAEMON_ARGS = ["--max-buffers-per-connection", 8]

    def setUp(self):
        self.c = pullbackd.Client(self.path, timeout=30)
        self.rng = np.random.default_rng(7)

    def tearDown(self):
        self.c.close()

    def dense(self, dtype, out=24, inp=32, batch=16):
        return {"weight": self.rng.standard_normal((out, inp)).astype(dtype),
                "x": np.asfortranarray(self.rng.standard_normal((inp, batch)).astype(dtype)),
                "bias": self.rng.standard_normal(out).astype(dtype)}

    def put_all(self, sb, arrays, at=0):
        """Each array into sb from offset at on, 4 KiB apart: name -> BufferTensor."""
        out = {}
        for name, a in arrays.items():
            out[name] = sb.put(at, a)
            at += (a.nbytes + 4095) // 4096 * 4096
        return out

    def test_put_takes_what_encode_tensor_takes(self):
        """put converts and refuses as an inline tensor does: a list of
        ints is float64, big-endian bytes are swapped, an int array and a
        masked array are refused (they used to land as int64 and as the
        masked values)."""
        with self.c.shared_buffer(MIB) as sb:
            t = sb.put(0, [[1, 2], [3, 4]])
            self.assertEqual((t.dtype, tuple(t.shape)), ("f64", (2, 2)))
            t = sb.put(4096, np.array([1.5, -2.0], dtype=">f8"))
            self.assertEqual(t.dtype, "f64")
            self.assertEqual(sb.view(t).tolist(), [1.5, -2.0])
            for bad in (np.arange(3), np.ma.masked_array([1.0, 2.0], mask=[0, 1])):
                with self.assertRaises(TypeError):
                    sb.put(8192, bad)

    def test_offsets_are_element_aligned(self):
        """put, array and tensor refuse an offset that is not a multiple of
        the element size, as the daemon would (put(3, ...) wrote the bytes
        and handed back a tensor every request then refused)."""
        with self.c.shared_buffer(MIB) as sb:
            for off, dtype in ((3, np.float64), (4, np.float64), (8, np.complex128), (2, np.float32), (-8, np.float64)):
                with self.assertRaises(ValueError, msg=(off, dtype)):
                    sb.put(off, np.ones(2, dtype=dtype))
                with self.assertRaises(ValueError, msg=(off, dtype)):
                    sb.tensor(off, (2,), dtype)
                with self.assertRaises(ValueError, msg=(off, dtype)):
                    sb.array(off, (2,), dtype)
            t = sb.put(16, np.ones(2, dtype=np.complex128))
            self.assertEqual(self.c.forward("tensoradd", {"A": t})["C"].tolist(), [1, 1])
            t = sb.put(4, np.ones(2, dtype=np.float32))
            self.assertEqual(self.c.forward("tensoradd", {"A": t})["C"].tolist(), [1, 1])

    def test_forward_from_buffer(self):
        with self.c.shared_buffer(MIB) as sb:
            for dtype in (np.float64, np.float32):
                arrays = self.dense(dtype)
                inputs = self.put_all(sb, arrays)
                self.assertEqual(inputs["x"].order, "F")
                want = self.c.forward("fused_dense", arrays, options={"act": "gelu"})["y"]
                got = self.c.forward("fused_dense", inputs, options={"act": "gelu"})["y"]
                self.assertTrue(same(want, got))

    def test_factorization(self):
        a = (self.rng.standard_normal((7, 5)) + 1j * self.rng.standard_normal((7, 5))).astype(np.complex128)
        with self.c.shared_buffer(MIB) as sb:
            want = self.c.forward("svd_compact", {"A": a})
            into = {"U": (sb, 64 << 10), "S": (sb, 128 << 10), "Vh": (sb, 192 << 10)}
            got = self.c.forward("svd_compact", {"A": sb.put(0, a)}, into=into)
            for name in ("U", "S", "Vh"):
                self.assertIsInstance(got[name], BufferTensor)
                self.assertEqual(got[name].offset, into[name][1])
                self.assertTrue(same(want[name], sb.view(got[name])))
            self.assertEqual(got["S"].dtype, "f64")

    def test_into_orders(self):
        arrays = self.dense(np.float64)
        with self.c.shared_buffer(MIB) as sb:
            for order in ("C", "F"):
                want = self.c.forward("fused_dense", arrays, order=order)["y"]
                got = self.c.forward("fused_dense", arrays, order=order, into={"y": (sb.id, 4096)})["y"]
                self.assertEqual(got.order, order)
                self.assertTrue(np.array_equal(want, sb.view(got)))
                self.assertEqual(sb.view(got).flags.f_contiguous, order == "F")

    def test_reverse_into_accumulate(self):
        for dtype in (np.float64, np.float32):
            arrays = self.dense(dtype)
            ybar = self.rng.standard_normal((24, 16)).astype(dtype)
            wrt = ["weight", "x", "bias"]
            _, tape = self.c.augmented_forward("fused_dense", arrays, wrt, options={"act": "tanh"})
            want = self.c.reverse(tape, {"y": ybar}, keep=True)
            with self.c.shared_buffer(MIB) as sb:
                got = self.c.reverse(tape, {"y": sb.put(0, ybar)}, keep=True,
                                     into={"weight": (sb, 64 << 10), "x": (sb, 128 << 10)})
                self.assertTrue(same(want["weight"], sb.view(got["weight"])))
                self.assertTrue(same(want["x"], sb.view(got["x"])))
                self.assertTrue(same(want["bias"], got["bias"]))
                acc = sb.array(256 << 10, want["weight"].shape, dtype)
                acc[...] = 0
                for _ in range(2):
                    r = self.c.reverse(tape, {"y": ybar}, keep=True, into={"weight": (sb, 256 << 10)},
                                       accumulate=True)
                    self.assertIsInstance(r["weight"], BufferTensor)
                self.assertTrue(same(acc, want["weight"] + want["weight"]))
                start = self.rng.standard_normal(acc.shape).astype(dtype)
                acc[...] = start
                self.c.reverse(tape, {"y": ybar}, into={"weight": (sb, 256 << 10)}, accumulate=True)
                self.assertTrue(same(acc, start + want["weight"]))

    def test_accumulate_across_lock_chunks(self):
        """An accumulating store is locked 1 MiB of the file at a time: a
        complex result of 1.6 MB at an offset off the chunk grid adds every
        element, the chunks' edges included."""
        n, off = 100_000, 48
        A = (self.rng.standard_normal(n) + 1j * self.rng.standard_normal(n)).astype(np.complex128)
        with self.c.shared_buffer(4 * MIB) as sb:
            acc = sb.array(off, (n,), np.complex128)
            start = (self.rng.standard_normal(n) + 1j * self.rng.standard_normal(n)).astype(np.complex128)
            acc[...] = start
            _, tape = self.c.augmented_forward("tensoradd", {"A": np.zeros(n, np.complex128)}, ["A"])
            for _ in range(2):  # Ā = C̄ (alpha 1)
                self.c.reverse(tape, {"C": A}, keep=True, into={"A": (sb, off)}, accumulate=True)
            tape.release()
            np.testing.assert_array_equal(acc, start + A + A)

    def test_concurrent_accumulates_leave_the_sum(self):
        """Two reverses into one target with accumulate, pipelined so that
        two workers store at once, leave the sum: the stores are
        read-add-writes, and one used to overwrite the other's (3 of 10
        pairs lost elements).  From two connections too, over two
        registrations of one memfd."""
        n = 1500
        W, x = np.ones((n, n)), np.ones((n, 1))
        other = pullbackd.Client(self.path, timeout=30)
        try:
            with self.c.shared_buffer(n * n * 8) as sb:
                fd2 = os.dup(sb.fd)
                bid2 = other.register_buffer(fd2, n * n * 8)
                os.close(fd2)
                acc = sb.array(0, (n, n), np.float64)
                for trial in range(12):
                    acc[...] = 0
                    tapes = [cl.augmented_forward("fused_dense", {"weight": W, "x": x}, ["weight"])[1]
                             for cl in (self.c, self.c, other)]
                    ids = [self.c.send("reverse", {"tape": t.handle, "cotangents": {"y": pullbackd.encode_tensor(x)},
                                                   "into": {"weight": {"buffer": sb.id, "offset": 0}},
                                                   "accumulate": True}) for t in tapes[:2]]
                    ids.append(other.send("reverse", {"tape": tapes[2].handle,
                                                      "cotangents": {"y": pullbackd.encode_tensor(x)},
                                                      "into": {"weight": {"buffer": bid2, "offset": 0}},
                                                      "accumulate": True}))
                    for t in tapes:
                        t._done = True  # consumed by the reverses
                    for cl, i in zip((self.c, self.c, other), ids):
                        cl.wait(i)
                    lost = int(np.count_nonzero(acc != 3.0))
                    self.assertEqual(lost, 0, f"trial {trial}: {lost} elements lost an addition")
        finally:
            other.close()

    def test_two_registrations_of_one_file_overlap(self):
        """into targets in two buffers over the same memfd are the same bytes:
        overlapping ones are refused as within one buffer."""
        fd = os.memfd_create("pbpy")
        try:
            os.ftruncate(fd, 8192)
            b1, b2 = self.c.register_buffer(fd, 8192), self.c.register_buffer(fd, 4096)
        finally:
            os.close(fd)
        with self.assertRaises(PullbackError) as cm:
            self.c.forward("qr_compact", {"A": np.eye(2)}, into={"Q": (b1, 0), "R": (b2, 16)})
        self.assertEqual(cm.exception.code, "invalid_argument")
        self.assertIn("overlap", cm.exception.message)
        got = self.c.forward("qr_compact", {"A": np.eye(2)}, into={"Q": (b1, 4096), "R": (b2, 0)})
        self.assertEqual(got["R"], BufferTensor(b2, 0, "f64", (2, 2)))

    def test_errors(self):
        with self.assertRaises(PullbackError) as cm:
            self.c.call("register_buffer", {"size": 4096})
        self.assertEqual(cm.exception.code, "invalid_argument")
        self.assertIn("file descriptor", cm.exception.message)
        fd = os.memfd_create("pbpy")
        try:
            os.ftruncate(fd, 4096)
            with self.assertRaises(PullbackError) as cm:
                self.c.register_buffer(fd, 4097)
            self.assertEqual(cm.exception.code, "invalid_argument")
            bid = self.c.register_buffer(fd, 4096)
        finally:
            os.close(fd)  # the daemon keeps its mapping, not the fd
        a = BufferTensor(bid, 4, "f64", (2, 2))
        with self.assertRaises(PullbackError) as cm:
            self.c.forward("qr_compact", {"A": a})
        self.assertIn("aligned", cm.exception.message)
        with self.assertRaises(PullbackError) as cm:
            self.c.forward("qr_compact", {"A": BufferTensor(bid, 4096, "f64", (2, 2))})
        self.assertIn("past the end", cm.exception.message)
        got = self.c.forward("qr_compact", {"A": np.eye(2)}, into={"Q": (bid, 0)})
        self.assertEqual(got["Q"], BufferTensor(bid, 0, "f64", (2, 2)))
        with self.assertRaises(PullbackError) as cm:
            self.c.call("forward", {"op": "qr_compact", "inputs": {"A": pullbackd.encode_tensor(np.eye(2))},
                                    "into": {"Q": {"buffer": bid, "offset": 0}}, "accumulate": True})
        self.assertIn("accumulate", cm.exception.message)
        with self.assertRaises(PullbackError) as cm:
            self.c.forward("qr_compact", {"A": np.eye(2)}, into={"Q": (bid, 0), "R": (bid, 16)})
        self.assertIn("overlap", cm.exception.message)
        self.assertTrue(self.c.unregister_buffer(bid))
        with self.assertRaises(PullbackError) as cm:
            self.c.forward("qr_compact", {"A": BufferTensor(bid, 0, "f64", (2, 2))})
        self.assertIn("not registered", cm.exception.message)
        with self.assertRaises(PullbackError):
            self.c.unregister_buffer(bid)

    def test_register_device(self):
        # Contract section 6: register_buffer {size, device}.  Host memory
        # is "cpu" (or no device); a GPU this daemon lacks is
        # device_unavailable (the key itself was once refused as unknown).
        fd = os.memfd_create("pbpy")
        try:
            os.ftruncate(fd, 4096)
            bid = self.c.wait(self.c.send("register_buffer", {"size": 4096, "device": "cpu"}, fds=[fd]))["buffer"]
            self.assertTrue(self.c.unregister_buffer(bid))
            for dev, code in (("cuda:0", "device_unavailable"), ("cuda", "device_unavailable"),
                              ("gpu", "invalid_argument"), (7, "invalid_argument")):
                with self.assertRaises(PullbackError) as cm:
                    self.c.wait(self.c.send("register_buffer", {"size": 4096, "device": dev}, fds=[fd]))
                self.assertEqual(cm.exception.code, code, dev)
        finally:
            os.close(fd)

    def test_close_unregisters(self):
        before = self.c.stats()["buffers"]
        sb = self.c.shared_buffer(64 << 10)
        self.assertEqual(self.c.stats()["buffers"], before + 1)
        view = sb.array(0, (4,), "f64")  # keeps the local mapping alive past close
        sb.close()
        self.assertEqual(self.c.stats()["buffers"], before)
        self.assertEqual(view.shape, (4,))

    def test_hello_limits(self):
        limits = self.c.hello()["limits"]
        self.assertEqual(limits["max_buffers_per_connection"], 8)
        self.assertIn("max_buffer_bytes_per_connection", limits)
        # What the kernel lets the daemon map, named by the refusals at it.
        most = limits["max_mapped_buffers"]
        self.assertTrue(1 <= most <= 65536, most)
        self.assertEqual(limits["max_mapped_buffers_per_uid"], max(most // 2, 1))


if __name__ == "__main__":
    unittest.main()
