"""python.stream: big tensors through the Python client's streaming path.

Tensors of 64 KiB and more leave from the arrays' own memory (sendmsg) and
replies of 1 MiB and more arrive into one buffer whose tensors are handed
out as views; this checks that path byte for byte against numpy, around
its size thresholds, with several big tensors in one message, in F order,
complex, and pipelined between small requests.

Run: PULLBACKD_BIN=build/daemon/pullbackd /usr/bin/python3 tests/python/test_stream.py
"""

import os
import socket
import sys
import time
import unittest

import msgpack
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
sys.path.insert(0, HERE)
import pullbackd  # noqa: E402
from daemon_case import DaemonCase  # noqa: E402


class StreamTest(DaemonCase):
    def setUp(self):
        self.c = pullbackd.Client(self.path, timeout=60)
        self.rng = np.random.default_rng(7)

    def tearDown(self):
        self.c.close()

    def transpose(self, A):
        return self.c.forward("tensoradd", {"A": A}, options={"pA": [1, 0]})["C"]

    def test_sizes_around_thresholds(self):
        # 8 bytes per f64: rows × 8 columns around 64 KiB and 1 MiB of data.
        for n in (1, 1023, 1024, 1025, 131071, 131072, 131073, 200000):
            A = self.rng.standard_normal((n, 8))
            C = self.transpose(A)
            self.assertEqual(C.shape, (8, n))
            np.testing.assert_array_equal(C, A.T)
            self.assertFalse(C.flags.writeable)

    def test_dtypes_and_orders(self):
        for dtype in (np.float32, np.float64, np.complex64, np.complex128):
            A = self.rng.standard_normal((700, 600)).astype(dtype)
            if np.iscomplexobj(A):
                A = A + 1j * self.rng.standard_normal(A.shape).astype(dtype)
            np.testing.assert_array_equal(self.transpose(A), A.T)
            np.testing.assert_array_equal(self.transpose(np.asfortranarray(A)), A.T)
            np.testing.assert_array_equal(self.transpose(A[::2, ::3]), A[::2, ::3].T)

    def test_several_big_tensors_in_both_directions(self):
        n = 600  # W 600² f64: 2.7 MiB; gradients of W and x both big
        W = self.rng.standard_normal((n, n))
        x = self.rng.standard_normal((n, 300))
        b = self.rng.standard_normal(n)
        out, tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x, "bias": b},
                                             wrt=["weight", "x", "bias"], options={"act": "identity"})
        np.testing.assert_allclose(out["y"], W @ x + b[:, None], rtol=1e-12, atol=1e-10)
        dy = self.rng.standard_normal((n, 300))
        g = self.c.reverse(tape, {"y": dy})
        np.testing.assert_allclose(g["weight"], dy @ x.T, rtol=1e-12, atol=1e-10)
        np.testing.assert_allclose(g["x"], W.T @ dy, rtol=1e-12, atol=1e-10)
        np.testing.assert_allclose(g["bias"], dy.sum(axis=1), rtol=1e-12, atol=1e-10)

    def test_several_big_tensors_take_one_buffer(self):
        # Gradients of W and x, 2.7 and 1.4 MiB: the first reply learns the
        # second tensor's size only after the first's bytes and moves to a
        # bigger buffer; the next ones take the size it came to at once.
        n = 600
        W, x = self.rng.standard_normal((n, n)), self.rng.standard_normal((n, 300))
        dy = self.rng.standard_normal((n, 300))
        cache = self.c._reply_buffers
        taken = []
        take = cache.take
        cache.take = lambda size: taken.append(size) or take(size)
        try:
            for k in range(3):
                del taken[:]
                _, tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["weight", "x"])
                del taken[:]
                g = self.c.reverse(tape, {"y": dy})
                self.assertEqual(len(taken), 2 if k == 0 else 1)
                np.testing.assert_allclose(g["weight"], dy @ x.T, rtol=1e-12, atol=1e-10)
                np.testing.assert_allclose(g["x"], W.T @ dy, rtol=1e-12, atol=1e-10)
        finally:
            del cache.take

    def test_big_tensors_go_last_smallest_first(self):
        # The daemon grows its read buffer to each payload's declared end as
        # the payloads come, moving what it has read: the client sends the
        # big tensors last, smallest first, so that only the smaller ones
        # are moved (pullbackd_read_bytes_moved_total).  W (4 MiB) first
        # would move all of W: 4.3 MB here.
        W = self.rng.standard_normal((1024, 512))
        x = self.rng.standard_normal((512, 256))
        b = self.rng.standard_normal(1024)
        self.assertEqual(list(pullbackd._tensors({"weight": W, "x": x, "bias": b})), ["bias", "x", "weight"])
        self.assertEqual(list(pullbackd._tensors({"a": W, "b": W, "c": x})), ["c", "a", "b"])
        before = moved(self.c)
        y = self.c.forward("fused_dense", {"weight": W, "x": x, "bias": b})["y"]
        np.testing.assert_allclose(y, W @ x + b[:, None], rtol=1e-12, atol=1e-10)
        # x itself, the first read (128 KiB) and one read past x (64 KiB).
        self.assertLessEqual(moved(self.c) - before, x.nbytes + 4 * (1 << 16))

    def test_daemon_moves_no_bytes_of_pipelined_big_messages(self):
        # Four 2 MiB requests written back to back: a read stops one read's
        # worth (64 KiB) past the payload it waits for, so what is read past
        # a message and moved to the next one's buffer stays that short, and
        # that buffer's first growth moves at most two reads' worth: 192 KiB
        # a message at most (2.6 MB in all when reads ran on into the room
        # kept after a payload).
        As = [self.rng.standard_normal((512, 512)) for _ in range(4)]
        before = moved(self.c)
        ids = [self.c.send("forward", {"op": "tensoradd", "inputs": {"A": pullbackd.encode_tensor(A)},
                                       "options": {"pA": [1, 0]}}) for A in As]
        for msgid, A in zip(ids, As):
            np.testing.assert_array_equal(pullbackd.decode_tensor(self.c.wait(msgid)["outputs"]["C"]), A.T)
        self.assertLessEqual(moved(self.c) - before, len(As) * 3 * (1 << 16))

    def test_pipelined(self):
        big = self.rng.standard_normal((1000, 700))
        small = self.rng.standard_normal((3, 2))
        ids = []
        for k in range(6):
            A = big if k % 2 else small
            ids.append((self.c.send("forward", {"op": "tensoradd", "inputs": {"A": pullbackd.encode_tensor(A)},
                                                "options": {"pA": [1, 0]}}), A))
        for msgid, A in reversed(ids):  # out of arrival order: stashed, then taken
            C = pullbackd.decode_tensor(self.c.wait(msgid)["outputs"]["C"])
            np.testing.assert_array_equal(C, A.T)

    def test_results_outlive_later_replies(self):
        A = self.rng.standard_normal((512, 512))
        first = self.transpose(A)
        for _ in range(3):
            self.transpose(self.rng.standard_normal((512, 512)))
        np.testing.assert_array_equal(first, A.T)

    def test_reply_buffers_reused_only_when_free(self):
        # Each form a user may keep of reply 1 (the array, a slice, a
        # memoryview, a view through np.asarray) keeps its values while
        # replies 2..5 arrive into the client's reused buffers.
        def reply(k):
            return self.transpose(np.full((1024, 1024), float(k)))

        for keep in (lambda C: C, lambda C: C[3:7, ::2], memoryview, lambda C: np.asarray(C).T):
            kept = keep(reply(1))
            for k in range(2, 6):
                C = reply(k)
                self.assertTrue((np.asarray(C) == k).all())
                del C
            self.assertTrue((np.asarray(kept) == 1).all())
            self.assertLessEqual(len(self.c._reply_buffers.buffers), pullbackd.Client.reply_buffers)

    def test_reply_buffer_refcount(self):
        # The cache's test for "nothing else uses it": every view of a reply
        # shares one managed buffer, which holds exactly one reference.
        cache = self.c._reply_buffers
        C = self.transpose(self.rng.standard_normal((1024, 1024)))
        buf = buffer_of(C)
        self.assertTrue(any(b is buf for b in cache.buffers))
        pos = [i for i, b in enumerate(cache.buffers) if b is buf][0]
        del buf
        views = [C[1:], memoryview(C), np.asarray(C).T, C.reshape(-1)]
        self.assertEqual(pullbackd._refcounts(cache.buffers)[pos], pullbackd._UNUSED_REFS + 1)
        del C
        self.assertEqual(pullbackd._refcounts(cache.buffers)[pos], pullbackd._UNUSED_REFS + 1)
        del views
        self.assertEqual(pullbackd._refcounts(cache.buffers)[pos], pullbackd._UNUSED_REFS)
        if sys.implementation.name == "cpython" and sys.version_info < (3, 14):
            self.assertEqual(pullbackd._UNUSED_REFS, 3)  # list slot, loop variable, argument

    def test_reply_buffers_sized_and_bounded(self):
        big = self.transpose(self.rng.standard_normal((1024, 1024)))
        first = id(buffer_of(big))  # not the buffer: a reference would keep it in use
        del big
        same = self.transpose(self.rng.standard_normal((1024, 1024)))
        self.assertEqual(id(buffer_of(same)), first)  # free again: taken, not allocated
        other = self.transpose(self.rng.standard_normal((1024, 1024)))
        self.assertNotEqual(id(buffer_of(other)), first)  # `same` still uses it
        del same, other
        small = self.transpose(self.rng.standard_normal((256, 1024)))  # 2 MiB: not the 8 MiB ones
        self.assertLess(len(buffer_of(small)), 2 * small.nbytes + (1 << 17))
        held = [self.transpose(self.rng.standard_normal((1024, 1024))) for _ in range(6)]
        cache = self.c._reply_buffers
        self.assertEqual(len(cache.buffers), pullbackd.Client.reply_buffers)
        self.assertIs(cache.buffers[-1], buffer_of(held[-1]))  # the oldest were dropped
        self.c.close()
        self.assertEqual(cache.buffers, [])
        self.assertEqual(held[0].shape, (1024, 1024))


def moved(c):
    """pullbackd_read_bytes_moved_total, from the metrics method."""
    for line in c.call("metrics")["text"].splitlines():
        if line.startswith("pullbackd_read_bytes_moved_total "):
            return float(line.split()[1])
    raise AssertionError("no pullbackd_read_bytes_moved_total in metrics")


def buffer_of(C):
    """The reply buffer a reply array is a view of."""
    while not isinstance(C, memoryview):
        C = C.base
    return C.obj


if __name__ == "__main__":
    unittest.main()
