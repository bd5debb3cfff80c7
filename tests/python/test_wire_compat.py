"""Clients that nobody here wrote: handles exact in a double, bytes as str,
and a general-purpose msgpack-RPC implementation (pynvim's) end to end.

Raw requests go through the msgpack module, not the project's client, so
that what is on the wire is exactly what the test says.
"""

import math
import os
import signal
import socket
import tempfile
import time
import unittest

import msgpack
import numpy as np

from daemon_case import DaemonCase

# W (2x2), x (2x2), b (2): the LuxLib seed case.
W = np.array([[0.5, -1.0], [2.0, 0.25]])
X = np.array([[1.0, 2.0], [-0.5, 0.75]])
B = np.array([0.1, -0.2])
YBAR = np.array([[1.0, -1.0], [0.5, 2.0]])


def gelu(z):
    return 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))


def gelu_prime(z):
    k = math.sqrt(2 / math.pi)
    t = np.tanh(k * (z + 0.044715 * z ** 3))
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * k * (1 + 3 * 0.044715 * z * z)


def reference():
    z = W @ X + B[:, None]
    dz = YBAR * gelu_prime(z)
    return gelu(z), {"weight": dz @ X.T, "x": W.T @ dz, "bias": dz.sum(axis=1)}


def tensor(a, data_as_str=False):
    # data_as_str only says what the caller means: a Packer with
    # use_bin_type=False (msgpack's old spec, "raw") packs bytes as str.
    del data_as_str
    raw = np.ascontiguousarray(a, dtype="<f8").tobytes()
    return {"dtype": "f64", "shape": list(a.shape), "data": raw}


def array(t):
    assert t["dtype"] == "f64"
    return np.frombuffer(t["data"], dtype="<f8").reshape(t["shape"])


def read_to_eof(sock, timeout):
    """Every message sock receives until the daemon's EOF (a timeout raises)."""
    sock.settimeout(timeout)
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=0)
    while True:
        data = sock.recv(1 << 20)
        if not data:
            return list(unpacker)
        unpacker.feed(data)


class Raw:
    """One connection that writes msgpack-RPC requests packed as told."""

    def __init__(self, path, use_bin_type=True):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.packer = msgpack.Packer(use_bin_type=use_bin_type)
        self.unpacker = msgpack.Unpacker(raw=False)
        self.msgid = 0

    def call(self, method, params):
        self.msgid += 1
        self.sock.sendall(self.packer.pack([0, self.msgid, method, [params]]))
        while True:
            for msg in self.unpacker:
                self.assert_reply(msg)
                return msg[2], msg[3]
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("daemon closed the connection")
            self.unpacker.feed(data)

    def send_bytes(self, data):
        """Send data as it is; the one reply it gets, decoded strictly
        (raw=False: a str that is not UTF-8 fails)."""
        self.sock.sendall(data)
        unpacker = msgpack.Unpacker(raw=False)
        while True:
            unpacker.feed(self.sock.recv(1 << 16))
            msgs = list(unpacker)
            if msgs:
                (msg,) = msgs
                return msg

    def assert_reply(self, msg):
        assert msg[0] == 1 and msg[1] == self.msgid, msg

    def close(self):
        self.sock.close()


class WireCompatTest(DaemonCase):
    def setUp(self):
        self.raw = Raw(self.path)

    def tearDown(self):
        self.raw.close()

    def augment(self, conn=None, data_as_str=False):
        err, res = (conn or self.raw).call("augmented_forward", {
            "op": "fused_dense", "options": {"act": "gelu"}, "wrt": ["weight", "x", "bias"],
            "inputs": {"weight": tensor(W, data_as_str), "x": tensor(X, data_as_str), "bias": tensor(B, data_as_str)}})
        self.assertIsNone(err)
        return res

    def check_reverse(self, handle, conn=None):
        err, res = (conn or self.raw).call("reverse", {"tape": handle, "cotangents": {"y": tensor(YBAR)}})
        self.assertIsNone(err, err)
        _, want = reference()
        for name, g in want.items():
            np.testing.assert_allclose(array(res["gradients"][name]), g, rtol=1e-13, atol=1e-14, err_msg=name)

    def test_handles_are_exact_in_a_double(self):
        handles = set()
        for _ in range(2000):
            h = self.augment()["tape"]
            self.assertIsInstance(h, int)
            self.assertTrue(1 <= h <= 2 ** 53 - 1, h)
            self.assertEqual(int(float(h)), h)
            handles.add(h)
        self.assertEqual(len(handles), 2000, "a handle was reused")
        # They still look random: the top bits are used, not a counter.
        self.assertGreater(max(handles), 2 ** 50)
        for h in handles:
            self.assertEqual(self.raw.call("release", {"tape": h}), (None, {"released": True}))

    def test_handle_sent_back_as_a_double(self):
        # JavaScript decodes every number into a double and sends one back.
        h = self.augment()["tape"]
        self.check_reverse(float(h))
        err, res = self.raw.call("release", {"tape": float(h)})
        self.assertEqual((err, res), (None, {"released": False}))
        # A double that is no integer is no handle.
        err, _ = self.raw.call("reverse", {"tape": 1.5, "cotangents": {}})
        self.assertEqual(err["code"], "invalid_argument")
        err, _ = self.raw.call("release", {"tape": -1.0})
        self.assertEqual(err["code"], "invalid_argument")

    def test_data_as_str(self):
        # Old-spec clients send every byte string as str: the same bytes.
        old = Raw(self.path, use_bin_type=False)
        try:
            res = self.augment(old, data_as_str=True)
            y, _ = reference()
            np.testing.assert_allclose(array(res["outputs"]["y"]), y, rtol=1e-13)
            err, res2 = old.call("reverse", {"tape": res["tape"], "cotangents": {"y": tensor(YBAR, True)}})
            self.assertIsNone(err, err)
            _, want = reference()
            for name, g in want.items():
                np.testing.assert_allclose(array(res2["gradients"][name]), g, rtol=1e-13, atol=1e-14)
            # A str of the wrong length is refused as a bin would be.
            bad = tensor(W, True)
            bad["data"] = bad["data"][:-1]
            self.assertEqual(old.packer.pack(bad["data"])[0], 0xa0 | 31)  # fixstr: really a str
            err, _ = old.call("forward", {"op": "fused_dense", "inputs": {"weight": bad, "x": tensor(X, True)}})
            self.assertEqual(err["code"], "invalid_argument")
            self.assertIn("bytes", err["message"])
        finally:
            old.close()

    def test_half_close(self):
        # A one-shot client (nc -N, a script) sends its requests, shuts its
        # writing side and reads until EOF: every reply comes first, also
        # those computed on a worker after the shutdown.  The daemon used to
        # close at the EOF and drop them.
        A = np.random.default_rng(2).standard_normal((200, 200))
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(self.path)
        pk = msgpack.Packer()
        sock.sendall(pk.pack([0, 1, "forward", [{"op": "svd_vals", "inputs": {"A": tensor(A)}}]]) +
                     pk.pack([0, 2, "hello", [{}]]) +
                     pk.pack([0, 3, "hello", [{}]])[:5])  # a message never finished: dropped
        sock.shutdown(socket.SHUT_WR)
        replies = {m[1]: m for m in read_to_eof(sock, 30)}
        sock.close()
        self.assertEqual(sorted(replies), [1, 2])
        self.assertIsNone(replies[1][2], replies[1][2])
        np.testing.assert_allclose(np.frombuffer(replies[1][3]["outputs"]["S"]["data"], "<f8"),
                                   np.linalg.svd(A, compute_uv=False), rtol=1e-12)
        self.assertEqual(replies[2][3]["protocol"], 1)
        # The daemon is no worse for it.
        self.assertEqual(self.raw.call("hello", {})[1]["protocol"], 1)

    def test_half_close_with_replies_unread(self):
        # The same client with 4 MB of replies it reads only later: the
        # socket is full when the EOF is seen (the daemon once took "not
        # writable" for "gone" and dropped the request on the worker).
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(self.path)
        pk = msgpack.Packer()
        A = np.random.default_rng(3).standard_normal((300, 300))
        sock.sendall(b"".join([pk.pack([0, 1000, "forward", [{"op": "svd_vals", "inputs": {"A": tensor(A)}}]])] +
                              [pk.pack([0, i, "ops", [{}]]) for i in range(1000)]))
        sock.shutdown(socket.SHUT_WR)
        time.sleep(0.5)
        got = {m[1]: m for m in read_to_eof(sock, 30)}
        sock.close()
        self.assertEqual(sorted(got), list(range(1001)))
        self.assertIsNone(got[1000][2])

    def test_error_messages_are_utf8(self):
        # A name the client sent is quoted in the error: bytes that are not
        # UTF-8, control characters and NUL as \xNN, so the reply stays a
        # valid msgpack str (a strict decoder, raw=False here, used to fail
        # on the whole reply), and a name is never cut at a NUL.
        bad = "\udcff\udcfe"  # the bytes ff fe, through surrogateescape
        pk = msgpack.Packer(unicode_errors="surrogateescape")
        eye = tensor(np.eye(2))
        cases = [
            ("hello", {bad: 1}, "invalid_argument", "unknown key '\\xff\\xfe'"),
            ("forward", {"op": bad}, "unknown_op", "unknown op '\\xff\\xfe'"),
            ("forward", {"op": "qr_compact", "inputs": {"A": dict(eye, dtype=bad)}}, "invalid_argument",
             "unknown dtype '\\xff\\xfe'"),
            ("forward", {"op": "qr_compact", "inputs": {bad: eye}}, "invalid_argument", "no input '\\xff\\xfe'"),
            ("forward", {"op": "qr_compact", "inputs": {"A": eye}, "options": {"a\x00b": 1}}, "invalid_argument",
             "no option 'a\\x00b'"),
            ("hel\x00lo", {}, "unknown_method", "unknown method 'hel\\x00lo'"),
            # A long name is cut before a character, never inside one.
            ("forward", {"op": "é" * 30}, "unknown_op", "unknown op '" + "é" * 20 + "...'"),
            # A text option is UTF-8 without NUL (a NUL cut it short unseen).
            ("forward", {"op": "tensorcontract", "inputs": {"A": eye, "B": eye}, "options": {"spec": "ij,jk" + bad}},
             "invalid_argument", "got 'ij,jk\\xff\\xfe'"),
            ("forward", {"op": "tensorcontract", "inputs": {"A": eye, "B": eye},
                         "options": {"spec": "ij,jk->ik\x00x"}}, "invalid_argument", "without NUL"),
        ]
        for i, (method, params, code, text) in enumerate(cases):
            msg = self.raw.send_bytes(pk.pack([0, 100 + i, method, [params]]))
            self.assertEqual(msg[1], 100 + i)
            self.assertEqual(msg[2]["code"], code, msg)
            self.assertIn(text, msg[2]["message"])

    def test_empty_with_huge_dimensions(self):
        # Empty, with dimensions whose product passes 2^63 (numpy cannot
        # even make such an array): their strides once overflowed, which
        # UBSan reports, and the ASan stage halts on it.
        E = {"dtype": "f64", "shape": [0, 2 ** 40, 2 ** 40], "data": b""}
        err, res = self.raw.call("forward", {"op": "tensortrace", "inputs": {"A": E},
                                             "options": {"p": [0], "q": [[1], [2]]}})
        self.assertIsNone(err, err)
        self.assertEqual(res["outputs"]["C"]["shape"], [0])
        err, res = self.raw.call("augmented_forward", {"op": "tensortrace", "inputs": {"A": E}, "wrt": ["A"],
                                                       "options": {"p": [0], "q": [[1], [2]]}})
        self.assertIsNone(err, err)
        G = {"dtype": "f64", "shape": [0], "data": b""}
        err, res = self.raw.call("reverse", {"tape": res["tape"], "cotangents": {"C": G}})
        self.assertIsNone(err, err)
        self.assertEqual(res["gradients"]["A"]["shape"], E["shape"])
        # Two saturated strides traced against each other are added, too.
        E4 = {"dtype": "f64", "shape": [0] + [2 ** 40] * 4, "data": b""}
        err, res = self.raw.call("forward", {"op": "tensortrace", "inputs": {"A": E4},
                                             "options": {"p": [0], "q": [[1, 3], [2, 4]]}})
        self.assertIsNone(err, err)
        self.assertEqual(res["outputs"]["C"]["shape"], [0])

    def test_vectors_say_the_order_asked_for(self):
        # Contract section 2: results come back in C order unless the params
        # carry order "F".  The factorizations' values (S, D) were built by
        # LAPACK and said "F" either way; a vector is the same bytes in both.
        A = tensor(np.array([[2.0, 1.0], [1.0, 3.0]]))
        for order in (None, "C", "F"):
            for op, vec in (("svd_compact", "S"), ("eigh_full", "D"), ("svd_vals", "S"), ("eig_vals", "D")):
                params = {"op": op, "inputs": {"A": A}}
                if order:
                    params["order"] = order
                err, res = self.raw.call("forward", params)
                self.assertIsNone(err, err)
                for name, t in res["outputs"].items():
                    self.assertEqual(t["order"], order or "C", f"{op} {name} asked {order}")
            params = {"op": "svd_vals", "inputs": {"A": A}, "wrt": ["A"]}
            err, res = self.raw.call("augmented_forward", params)
            self.assertIsNone(err, err)
            params = {"tape": res["tape"], "cotangents": {"S": tensor(np.ones(2))}}
            if order:
                params["order"] = order
            err, res = self.raw.call("reverse", params)
            self.assertIsNone(err, err)
            self.assertEqual(res["gradients"]["A"]["order"], order or "C")

    def test_tensor_key_given_twice(self):
        # {"dtype": "f64", "shape": [1], "data": <8 bytes>, "dtype": "f32"} as input A.
        t = (b"\x84\xa5dtype\xa3f64\xa5shape\x91\x01\xa4data\xc4\x08" + b"\x00" * 8 +
             b"\xa5dtype\xa3f32")
        reply = self.raw.send_bytes(b"\x94\x00\x09\xa7forward\x91\x82\xa2op\xa9tensoradd\xa6inputs\x81\xa1A" + t)
        self.assertEqual(reply[1], 9)
        self.assertEqual(reply[2]["code"], "invalid_argument")
        self.assertIn("'dtype' is given twice", reply[2]["message"])

    def test_params_key_given_twice(self):
        # msgpack maps may repeat a key; which one counts is no guess for
        # the daemon to make: [0, 7, "release", [{"tape": 1, "tape": 2}]].
        reply = self.raw.send_bytes(b"\x94\x00\x07\xa7release\x91\x82\xa4tape\x01\xa4tape\x02")
        self.assertEqual(reply[1], 7)
        self.assertEqual(reply[2]["code"], "invalid_argument")
        self.assertEqual(reply[2]["arg"], "tape")
        self.assertIn("given twice", reply[2]["message"])


class HalfCloseReload(DaemonCase):
    """A half-closed connection whose reply outgrows a cap a reload lowered
    while its request ran still gets its EOF once the reply is written (it
    stayed open for good: nothing looked again after the write)."""

    CONF = os.path.join(tempfile.mkdtemp(prefix="pbconf"), "pullbackd.conf")
    DAEMON_ARGS = ["--config", CONF]

    @classmethod
    def setUpClass(cls):
        with open(cls.CONF, "w") as f:
            f.write("max-queued-bytes-per-connection = 64M\n")
        super().setUpClass()

    def test_eof_after_the_cap_fell(self):
        n = 900
        A = np.random.default_rng(1).standard_normal((n, n))
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(self.path)
        sock.sendall(msgpack.packb([0, 7, "forward", [{"op": "svd_full", "inputs": {"A": tensor(A)}}]]))
        sock.shutdown(socket.SHUT_WR)
        time.sleep(0.05)  # the SVD runs (about a second here)
        with open(self.CONF, "w") as f:
            f.write("max-queued-bytes-per-connection = 1M\n")
        self.proc.send_signal(signal.SIGHUP)
        time.sleep(2)  # the reply (13 MB) is queued when the request ends: the socket is full
        (reply,) = read_to_eof(sock, 20)  # a timeout here is the defect
        sock.close()
        self.assertEqual(reply[1], 7)
        self.assertIsNone(reply[2])
        self.assertEqual(reply[3]["outputs"]["U"]["shape"], [n, n])


class PynvimTest(DaemonCase):
    """pynvim's msgpack-RPC session (Debian's python3-pynvim), as is."""

    def test_seed_case(self):
        try:
            from pynvim.msgpack_rpc import socket_session
        except ImportError:
            raise unittest.SkipTest("python3-pynvim is not installed")
        session = socket_session(self.path)
        # What pynvim's Nvim wrapper would install: errors as exceptions.
        session.error_wrapper = lambda err: RuntimeError(err)
        try:
            hello = session.request("hello", {})
            self.assertEqual(hello["protocol"], 1)
            res = session.request("augmented_forward", {
                "op": "fused_dense", "options": {"act": "gelu"}, "wrt": ["weight", "x", "bias"],
                "inputs": {"weight": tensor(W), "x": tensor(X), "bias": tensor(B)}})
            y, want = reference()
            np.testing.assert_allclose(array(res["outputs"]["y"]), y, rtol=1e-13)
            g = session.request("reverse", {"tape": res["tape"], "cotangents": {"y": tensor(YBAR)}})["gradients"]
            for name, ref in want.items():
                np.testing.assert_allclose(array(g[name]), ref, rtol=1e-13, atol=1e-14, err_msg=name)
            # An error comes back as an msgpack-RPC error, which pynvim raises.
            with self.assertRaises(Exception) as cm:
                session.request("reverse", {"tape": res["tape"], "cotangents": {}})
            self.assertIn("unknown_tape", str(cm.exception))
        finally:
            session.close()


if __name__ == "__main__":
    unittest.main()
