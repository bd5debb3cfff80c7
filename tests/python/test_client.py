"""Tests of the Python client: codec and wire shape against a scripted fake
daemon, then everything against a real pullbackd started here.

Run: PULLBACKD_BIN=build/daemon/pullbackd /usr/bin/python3 tests/python/test_client.py

Tolerances, against numpy formulas evaluated in float64 on the same inputs:
f64 rtol 1e-12 (atol 1e-13 for entries near zero); f32 rtol 1e-5 (atol 1e-6).
"""

import gc
import math
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import unittest
from unittest import mock

import msgpack
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "clients", "python"))
import pullbackd  # noqa: E402
from pullbackd import PullbackError  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_case import DaemonCase, run_in_threads  # noqa: E402

TOL = {np.float64: dict(rtol=1e-12, atol=1e-13), np.float32: dict(rtol=1e-5, atol=1e-6)}

_K = math.sqrt(2 / math.pi)
_erf = np.vectorize(math.erf)


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def _gelu_tanh(z):
    return np.tanh(_K * (z + 0.044715 * z**3))


# act name -> (act(z), act'(z)), in float64
ACTS = {
    "identity": (lambda z: z, lambda z: np.ones_like(z)),
    "relu": (lambda z: np.maximum(z, 0), lambda z: (z > 0) * 1.0),
    "leakyrelu": (lambda z: np.where(z > 0, z, 0.01 * z), lambda z: np.where(z > 0, 1.0, 0.01)),
    "sigmoid": (_sigmoid, lambda z: _sigmoid(z) * (1 - _sigmoid(z))),
    "tanh": (np.tanh, lambda z: 1 - np.tanh(z) ** 2),
    "gelu": (lambda z: 0.5 * z * (1 + _gelu_tanh(z)),
             lambda z: 0.5 * (1 + _gelu_tanh(z))
             + 0.5 * z * (1 - _gelu_tanh(z) ** 2) * _K * (1 + 3 * 0.044715 * z**2)),
    "gelu_erf": (lambda z: 0.5 * z * (1 + _erf(z / math.sqrt(2))),
                 lambda z: 0.5 * (1 + _erf(z / math.sqrt(2))) + z * np.exp(-z * z / 2) / math.sqrt(2 * math.pi)),
    "silu": (lambda z: z * _sigmoid(z), lambda z: _sigmoid(z) * (1 + z * (1 - _sigmoid(z)))),
    "softplus": (lambda z: np.logaddexp(0, z), _sigmoid),
    "elu": (lambda z: np.where(z > 0, z, np.expm1(np.minimum(z, 0))), lambda z: np.where(z > 0, 1.0, np.exp(z))),
}


def reference(W, x, b, act, ybar=None):
    """y = act.(W x .+ b), and with ybar the gradients (W̄, x̄, b̄), all in float64."""
    W, x = W.astype(np.float64), x.astype(np.float64)
    z = W @ x
    if b is not None:
        z = z + (b.astype(np.float64) if x.ndim == 1 else b.astype(np.float64)[:, None])
    f, df = ACTS[act]
    if ybar is None:
        return f(z)
    dz = ybar.astype(np.float64) * df(z)
    gW = np.outer(dz, x) if x.ndim == 1 else dz @ x.T
    gb = dz if x.ndim == 1 else dz.sum(axis=1)
    return f(z), gW, W.T @ dz, gb


class CodecTest(unittest.TestCase):
    """encode_tensor / decode_tensor / socket_path, no daemon."""

    def test_c_order(self):
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        t = pullbackd.encode_tensor(a)
        self.assertEqual((t["dtype"], t["shape"], t["order"]), ("f32", [2, 3], "C"))
        self.assertEqual(bytes(t["data"]), a.tobytes())

    def test_f_order_is_not_copied(self):
        a = np.asfortranarray(np.arange(6.0).reshape(2, 3))
        t = pullbackd.encode_tensor(a)
        self.assertEqual((t["dtype"], t["shape"], t["order"]), ("f64", [2, 3], "F"))
        self.assertEqual(bytes(t["data"]), a.tobytes(order="F"))
        self.assertTrue(np.shares_memory(np.asarray(t["data"]), a))
        np.testing.assert_array_equal(pullbackd.decode_tensor({**t, "data": bytes(t["data"])}), a)

    def test_strided_and_big_endian(self):
        a = np.arange(12.0).reshape(3, 4)[:, ::2]
        t = pullbackd.encode_tensor(a)
        self.assertEqual((t["order"], bytes(t["data"])), ("C", np.ascontiguousarray(a).tobytes()))
        big = np.arange(4, dtype=">c16")
        t = pullbackd.encode_tensor(big)
        self.assertEqual((t["dtype"], bytes(t["data"])), ("c128", big.astype("<c16").tobytes()))

    def test_pack_sends_big_data_in_place(self):
        # A request packs whole in C; each big tensor's data is cut out of
        # the packed bytes and sent from the array's own memory, in order:
        # the big tensors last, smallest first (big2, 120 KB, then big1).
        from pullbackd import _pack, _tensors
        big1, big2 = np.arange(20000.0), np.arange(30000, dtype=np.float32).reshape(100, 300)
        small = np.arange(5.0)
        msg = [0, 7, "forward", [{"op": "x", "inputs": _tensors({"a": big1, "s": small, "b": big2}),
                                  "note": "\xc4\x10" + "m" * 16}]]
        parts = _pack(msg)
        self.assertEqual(len(parts), 5)
        self.assertTrue(np.shares_memory(np.asarray(parts[1]), big2))
        self.assertTrue(np.shares_memory(np.asarray(parts[3]), big1))
        got = msgpack.unpackb(b"".join(bytes(p) for p in parts), raw=False)
        ins = got[3][0]["inputs"]
        self.assertEqual(ins["a"]["data"], big1.tobytes())
        self.assertEqual(ins["b"]["data"], big2.tobytes())
        self.assertEqual(ins["s"]["data"], small.tobytes())
        self.assertEqual(got[3][0]["note"], "\xc4\x10" + "m" * 16)
        # Nothing big: one chunk, msgpack's own bytes.
        self.assertEqual(_pack([2, "release", [{"tape": 1}]]), [msgpack.packb([2, "release", [{"tape": 1}]])])
        with self.assertRaises(TypeError):
            _pack([0, 1, "x", [{"bad": object()}]])

    def test_dtypes(self):
        self.assertEqual(pullbackd.encode_tensor([[1, 2], [3, 4]])["dtype"], "f64")
        self.assertEqual(pullbackd.encode_tensor(3)["shape"], [])
        self.assertEqual(pullbackd.encode_tensor([1j])["dtype"], "c128")
        self.assertEqual(pullbackd.encode_tensor(np.zeros(2, np.complex64))["dtype"], "c64")
        for bad in (np.arange(3), np.zeros(2, np.float16), np.zeros(2, np.longdouble), np.array(["a"])):
            with self.assertRaises(TypeError):
                pullbackd.encode_tensor(bad)

    def test_raw_buffers_are_not_numbers(self):
        """Only python numbers and lists are converted from ints: the bytes of
        a buffer (bytearray, memoryview, array.array) are not one float64
        each, and an integer buffer is refused as an integer array is."""
        import array
        raw = np.array([1.0, 2.0]).tobytes()
        for bad in (raw, bytearray(raw), memoryview(raw), array.array("b", [1, 2]), np.int64(3),
                    memoryview(np.arange(3))):
            with self.assertRaises(TypeError, msg=repr(bad)):
                pullbackd.encode_tensor(bad)
        # a buffer of doubles is its doubles
        t = pullbackd.encode_tensor(memoryview(np.array([1.0, 2.0])))
        self.assertEqual((t["dtype"], t["shape"]), ("f64", [2]))
        self.assertEqual(pullbackd.encode_tensor(array.array("d", [1, 2]))["shape"], [2])
        self.assertEqual(pullbackd.encode_tensor((1, 2))["dtype"], "f64")
        self.assertEqual(pullbackd.encode_tensor(True)["dtype"], "f64")

    def test_masked_arrays_are_refused(self):
        """np.asarray drops a mask: a masked value would be used as if it were data."""
        m = np.ma.masked_array([[1.0, 1e300], [1.0, 1.0]], mask=[[0, 1], [0, 0]])
        with self.assertRaisesRegex(TypeError, "masked"):
            pullbackd.encode_tensor(m)
        t = pullbackd.encode_tensor(np.ma.masked_array([1.0, 2.0]))  # nothing masked: its data
        self.assertEqual(bytes(t["data"]), np.array([1.0, 2.0]).tobytes())

    def test_decode(self):
        t = {"dtype": "c64", "shape": [2, 0], "order": "C", "data": b""}
        self.assertEqual(pullbackd.decode_tensor(t).shape, (2, 0))
        a = np.arange(6.0)
        f = pullbackd.decode_tensor({"dtype": "f64", "shape": [2, 3], "order": "F", "data": a.tobytes()})
        self.assertTrue(f.flags.f_contiguous)
        np.testing.assert_array_equal(f, a.reshape(2, 3, order="F"))
        with self.assertRaises(ValueError):
            pullbackd.decode_tensor({"dtype": "i32", "shape": [], "data": b"\0" * 4})

    def test_socket_path_chain(self):
        env = {"PULLBACKD_SOCKET": "/a.sock", "RUNTIME_DIRECTORY": "/run/p:/run/q", "XDG_RUNTIME_DIR": "/x"}
        expected = ["/a.sock", "/run/p/pullbackd.sock", "/x/pullbackd.sock", f"/tmp/pullbackd-{os.getuid()}.sock"]
        for key, want in zip(list(env) + [None], expected):
            with mock.patch.dict(os.environ, env, clear=True):
                self.assertEqual(pullbackd.socket_path(), want)
            env.pop(key, None)
        # An empty first RUNTIME_DIRECTORY entry goes on down the chain, as
        # the daemon and the C client do (it gave the relative "pullbackd.sock").
        with mock.patch.dict(os.environ, {"RUNTIME_DIRECTORY": ":/run/q", "XDG_RUNTIME_DIR": "/x"}, clear=True):
            self.assertEqual(pullbackd.socket_path(), "/x/pullbackd.sock")


class FakeDaemon(threading.Thread):
    """One connection served by `handler(msg)` -> list of replies; keeps what it received."""

    def __init__(self, path, handler):
        super().__init__(daemon=True)
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(path)
        self.listener.listen(1)
        self.handler = handler
        self.received = []
        self.start()

    def run(self):
        conn, _ = self.listener.accept()
        unpacker = msgpack.Unpacker(raw=False)
        with conn:
            while data := conn.recv(65536):
                unpacker.feed(data)
                for msg in unpacker:
                    self.received.append(msg)
                    for reply in self.handler(msg):
                        conn.sendall(msgpack.packb(reply))
        self.listener.close()


class FakeDaemonTest(unittest.TestCase):
    """What the client puts on the wire, and how it pairs replies."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="pbfake")
        self.path = os.path.join(self.dir, "fake.sock")

    def tearDown(self):
        shutil.rmtree(self.dir)

    def serve(self, handler):
        fake = FakeDaemon(self.path, handler)
        return fake, pullbackd.Client(self.path, timeout=5)

    def test_out_of_order_replies(self):
        held = []

        def handler(msg):
            held.append(msg)
            if len(held) < 3:
                return []
            return [[1, m[1], None, {"n": m[1]}] for m in (held[1], held[2], held[0])]

        fake, c = self.serve(handler)
        first, second = c.send("a"), c.send("b")
        self.assertEqual(c.call("c"), {"n": first + 2})  # arrives last; the others are stashed
        self.assertEqual(c.recv(), (second, {"n": second}))
        self.assertEqual(c.recv(), (first, {"n": first}))
        c.close()
        fake.join(5)

    def test_a_waiting_thread_gets_its_reply_at_once(self):
        """A thread whose reply arrived while another thread was reading the
        socket for a slow one gets it at once, not after the slow one."""
        held = []

        def handler(msg):
            if msg[2] == "slow":
                held.append(msg[1])
                return []
            replies = [[1, msg[1], None, {"m": msg[2]}]]
            if msg[2] == "finish":
                replies += [[1, h, None, {"m": "slow"}] for h in held]
            return replies

        fake, c = self.serve(handler)
        slow = []
        reader = threading.Thread(target=lambda: slow.append(c.call("slow")), daemon=True)
        reader.start()
        time.sleep(0.2)  # the reader now blocks on the socket
        for _ in range(3):
            t0 = time.monotonic()
            self.assertEqual(c.call("fast"), {"m": "fast"})
            self.assertLess(time.monotonic() - t0, 1.0)
        self.assertEqual(slow, [])
        self.assertEqual(c.call("finish"), {"m": "finish"})
        reader.join(5)
        self.assertEqual(slow, [{"m": "slow"}])
        c.close()
        fake.join(5)

    def test_a_call_given_up_leaves_nothing_behind(self):
        """A call that times out (or is interrupted) gives its msgid up: its
        late reply is dropped, not kept forever nor handed to recv(), and a
        tape or buffer it made is released (it used to hold its bytes until
        ttl_s, or the buffer until the connection closed)."""
        held = []

        def handler(msg):
            if msg[0] == 2:
                return []
            if msg[2] in ("augmented_forward", "register_buffer"):
                held.append(msg[1])
                return []
            late = [{"outputs": {}, "tape": 7, "tape_bytes": 64}, {"buffer": 9}]
            replies = [[1, h, None, r] for h, r in zip(held, late)] + [[1, msg[1], None, {"m": msg[2]}]]
            held.clear()
            return replies

        fake, c = self.serve(handler)
        c._sock.settimeout(0.2)
        x = np.ones(2)
        with self.assertRaises(socket.timeout):
            c.augmented_forward("fused_dense", {"weight": x[None], "x": x}, wrt=["x"])
        r, w = os.pipe()
        try:
            with self.assertRaises(socket.timeout):
                c.register_buffer(r, 4096)
        finally:
            os.close(r), os.close(w)
        c._sock.settimeout(5)
        self.assertEqual(c.call("finish"), {"m": "finish"})  # reads both late replies first
        self.assertEqual(c._stash, {})
        msgid = c.send("next")
        self.assertEqual(c.recv(), (msgid, {"m": "next"}))
        c.close()
        fake.join(5)
        notes = [m for m in fake.received if m[0] == 2]
        self.assertEqual(sorted(notes), [[2, "release", [{"tape": 7}]], [2, "unregister_buffer", [{"buffer": 9}]]])

    def test_params_on_the_wire(self):
        replies = {
            "forward": {"outputs": {"y": {"dtype": "f64", "shape": [1], "order": "C", "data": b"\0" * 8}}},
            "augmented_forward": {"outputs": {}, "tape": 7, "tape_bytes": 0},
            "reverse": {"gradients": {}, "warnings": ["gauge-dependent part of V: 1e-3"]},
            "error": None,
        }

        def handler(msg):
            if msg[0] != 0:
                return []
            if msg[2] == "error":
                return [[1, msg[1], {"code": "numerical_error", "message": "no", "info": 3}, None]]
            return [[1, msg[1], None, replies[msg[2]]]]

        fake, c = self.serve(handler)
        c.forward("op", {"A": np.ones(2)}, options={"alpha": 1 + 2j, "beta": np.float32(0.5), "p": (np.int64(1),)})
        _, consumed = c.augmented_forward("op", {"A": [1.0]}, wrt=("A",), scope="peer")
        with self.assertWarns(pullbackd.GaugeWarning):
            c.reverse(consumed, {})
        self.assertEqual(c.last_warnings, replies["reverse"]["warnings"])
        _, dropped = c.augmented_forward("op", {"A": [1.0]}, wrt=["A"])
        del consumed, dropped
        gc.collect()
        with self.assertRaises(PullbackError) as cm:
            c.call("error")
        self.assertEqual((cm.exception.code, cm.exception.message, cm.exception.details),
                         ("numerical_error", "no", {"info": 3}))
        c.close()
        fake.join(5)

        sent = [(m[0], m[2] if m[0] == 0 else m[1], m[-1][0]) for m in fake.received]
        fwd = sent[0][2]
        self.assertEqual(set(fwd), {"op", "inputs", "options"})
        self.assertEqual(fwd["options"], {"alpha": [1.0, 2.0], "beta": 0.5, "p": [1]})
        self.assertEqual(fwd["inputs"]["A"]["data"], np.ones(2).tobytes())
        self.assertEqual(set(sent[1][2]), {"op", "inputs", "wrt", "scope"})
        self.assertEqual(sent[2][2], {"tape": 7, "cotangents": {}})  # no keep: false is not sent
        # The collected, unconsumed tape is released by a notification; the consumed one is not.
        self.assertEqual([s for s in sent if s[1] == "release"], [(2, "release", {"tape": 7})])
        self.assertEqual(sum(1 for s in sent if s[0] == 2), 1)


class DaemonTest(DaemonCase):
    """The client against a real daemon on a temporary socket."""

    MAX_TAPES = 64
    DAEMON_ARGS = ["--max-tapes-per-connection", MAX_TAPES]

    def setUp(self):
        self.c = pullbackd.Client(self.path, timeout=20)
        self.rng = np.random.default_rng(7)

    def tearDown(self):
        self.c.close()

    def data(self, dtype=np.float64, out=3, inn=4, batch=5, vector=False):
        W = self.rng.standard_normal((out, inn)).astype(dtype)
        x = self.rng.standard_normal(inn if vector else (inn, batch)).astype(dtype)
        b = self.rng.standard_normal(out).astype(dtype)
        return W, x, b

    def assertCode(self, code, fn, *args, **kw):
        with self.assertRaises(PullbackError) as cm:
            fn(*args, **kw)
        self.assertEqual(cm.exception.code, code, f"{cm.exception} for {args} {kw}")
        self.assertTrue(cm.exception.message)
        return cm.exception

    def test_hello(self):
        h = self.c.hello()
        self.assertEqual(h["protocol"], 1)
        self.assertIsInstance(h["version"], str)
        self.assertIn("cpu", h["devices"])
        self.assertEqual(set(h["dtypes"]), {"f32", "f64", "c64", "c128"})
        for key in ("max_message_bytes", "max_tape_bytes", "max_tape_bytes_per_uid",
                    "max_tapes_per_connection", "max_inflight_per_connection"):
            self.assertIn(key, h["limits"])
        self.assertEqual(h["limits"]["max_tapes_per_connection"], self.MAX_TAPES)

    def test_ops(self):
        fd = self.c.ops()["ops"]["fused_dense"]
        self.assertEqual({k: v["required"] for k, v in fd["inputs"].items()},
                         {"weight": True, "x": True, "bias": False})
        self.assertEqual(fd["outputs"], ["y"])
        self.assertEqual(fd["options"]["act"]["default"], "identity")
        self.assertEqual(set(fd["options"]["act"]["values"]), set(ACTS))
        self.assertEqual(set(fd["dtypes"]), {"f32", "f64"})

    def test_forward_gelu(self):
        for dtype in (np.float32, np.float64):
            for order in ("C", "F"):
                for vector in (False, True):
                    for bias in (False, True):
                        W, x, b = self.data(dtype, vector=vector)
                        if order == "F":
                            W, x = np.asfortranarray(W), np.asfortranarray(x)
                            self.assertEqual(pullbackd.encode_tensor(W)["order"], "F")
                        inputs = {"weight": W, "x": x, **({"bias": b} if bias else {})}
                        y = self.c.forward("fused_dense", inputs, options={"act": "gelu"})["y"]
                        what = f"{dtype.__name__} order {order} vector {vector} bias {bias}"
                        self.assertEqual((y.dtype, y.shape), (dtype, (3,) if vector else (3, 5)), what)
                        self.assertTrue(y.flags.c_contiguous)
                        np.testing.assert_allclose(y, reference(W, x, b if bias else None, "gelu"),
                                                   **TOL[dtype], err_msg=what)

    def test_forward_every_activation(self):
        W, x, b = self.data()
        for act in ACTS:
            y = self.c.forward("fused_dense", {"weight": W, "x": x, "bias": b}, options={"act": act})["y"]
            np.testing.assert_allclose(y, reference(W, x, b, act), **TOL[np.float64], err_msg=act)
        y = self.c.forward("fused_dense", {"weight": W, "x": x})["y"]  # act defaults to identity
        np.testing.assert_allclose(y, W @ x, **TOL[np.float64])

    def test_forward_odd_inputs(self):
        W, x, b = self.data()
        y = self.c.forward("fused_dense", {"weight": W.tolist(), "x": x.tolist()})["y"]  # lists become f64
        np.testing.assert_allclose(y, W @ x, **TOL[np.float64])
        wide = np.zeros((4, 10))
        wide[:, ::2] = x
        y = self.c.forward("fused_dense", {"weight": W.astype(">f8"), "x": wide[:, ::2]})["y"]
        np.testing.assert_allclose(y, W @ x, **TOL[np.float64])
        y = self.c.forward("fused_dense", {"weight": W, "x": np.zeros((4, 0)), "bias": b})["y"]
        self.assertEqual(y.shape, (3, 0))
        x_nan = x.copy()
        x_nan[0, 1] = np.nan
        y = self.c.forward("fused_dense", {"weight": W, "x": x_nan}, options={"act": "tanh"})["y"]
        self.assertTrue(np.isnan(y[:, 1]).all())
        self.assertFalse(np.isnan(np.delete(y, 1, axis=1)).any())

    def test_order_f_outputs(self):
        W, x, b = self.data()
        inputs = {"weight": W, "x": x, "bias": b}
        y_c = self.c.forward("fused_dense", inputs, options={"act": "silu"})["y"]
        y_f = self.c.forward("fused_dense", inputs, options={"act": "silu"}, order="F")["y"]
        self.assertTrue(y_f.flags.f_contiguous and not y_f.flags.c_contiguous)
        np.testing.assert_array_equal(y_f, y_c)
        ybar = self.rng.standard_normal((3, 5))
        out, tape = self.c.augmented_forward("fused_dense", inputs, wrt=["weight", "x", "bias"],
                                             options={"act": "silu"}, order="F")
        self.assertTrue(out["y"].flags.f_contiguous)
        np.testing.assert_array_equal(out["y"], y_c)
        g = self.c.reverse(tape, {"y": np.asfortranarray(ybar)}, order="F")
        ref = dict(zip(("weight", "x", "bias"), reference(W, x, b, "silu", ybar)[1:]))
        for name in ("weight", "x"):
            self.assertTrue(g[name].flags.f_contiguous and not g[name].flags.c_contiguous, name)
        for name, want in ref.items():
            np.testing.assert_allclose(g[name], want, **TOL[np.float64], err_msg=name)

    def test_reverse_matches_numpy(self):
        for dtype in (np.float32, np.float64):
            for act in ("identity", "relu", "leakyrelu", "sigmoid", "tanh", "gelu", "softplus", "silu", "elu"):
                for vector in (False, True):
                    W, x, b = self.data(dtype, vector=vector)
                    ybar = self.rng.standard_normal(3 if vector else (3, 5)).astype(dtype)
                    out, tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x, "bias": b},
                                                         wrt=["weight", "x", "bias"], options={"act": act})
                    self.assertIsInstance(tape.handle, int)
                    g = self.c.reverse(tape, {"y": ybar})
                    y, *grads = reference(W, x, b, act, ybar)
                    what = f"{dtype.__name__} {act} vector {vector}"
                    np.testing.assert_allclose(out["y"], y, **TOL[dtype], err_msg=what)
                    self.assertEqual(set(g), {"weight", "x", "bias"})
                    for name, want in zip(("weight", "x", "bias"), grads):
                        self.assertEqual((g[name].dtype, g[name].shape), (dtype, want.shape), what)
                        np.testing.assert_allclose(g[name], want, **TOL[dtype], err_msg=f"{what} {name}")

    def test_wrt_subset(self):
        W, x, b = self.data()
        ybar = self.rng.standard_normal((3, 5))
        _, tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x, "bias": b}, wrt=["x"],
                                           options={"act": "gelu"})
        self.assertGreater(tape.tape_bytes, 0)
        g = self.c.reverse(tape, {"y": ybar})
        self.assertEqual(set(g), {"x"})
        np.testing.assert_allclose(g["x"], reference(W, x, b, "gelu", ybar)[2], **TOL[np.float64])

    def test_errors(self):
        W, x, b = self.data()
        fwd = self.c.forward
        self.assertCode("unknown_op", fwd, "no_such_op", {"weight": W, "x": x})
        self.assertCode("invalid_argument", fwd, "fused_dense", {"weight": W + 0j, "x": x + 0j})
        self.assertCode("invalid_argument", fwd, "fused_dense", {"weight": W, "x": x}, options={"actt": "relu"})
        self.assertCode("invalid_argument", fwd, "fused_dense", {"weight": W, "x": x}, options={"act": "swish"})
        self.assertCode("invalid_argument", fwd, "fused_dense", {"x": x})
        self.assertCode("shape_mismatch", fwd, "fused_dense", {"weight": W, "x": x.T})
        self.assertCode("shape_mismatch", fwd, "fused_dense", {"weight": W, "x": x, "bias": b[:2]})
        self.assertCode("dtype_mismatch", fwd, "fused_dense", {"weight": W, "x": x.astype(np.float32)})
        params = {"op": "fused_dense", "inputs": {"weight": pullbackd.encode_tensor(W),
                                                  "x": pullbackd.encode_tensor(x)}}
        err = self.assertCode("invalid_argument", self.c.call, "forward", {**params, "bogus": 1})
        self.assertIn("bogus", err.message)
        short = {**params["inputs"]["x"], "data": bytes(params["inputs"]["x"]["data"])[:-8]}
        self.assertCode("invalid_argument", self.c.call, "forward",
                        {**params, "inputs": {"weight": params["inputs"]["weight"], "x": short}})
        self.assertCode("unknown_method", self.c.call, "no_such_method", {})
        self.assertCode("invalid_argument", self.c.call, "release", {"tape": "seven"})
        _, tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"])
        self.c.reverse(tape, {"y": np.ones((3, 5))})
        self.assertCode("unknown_tape", self.c.reverse, tape, {"y": np.ones((3, 5))})
        self.assertEqual(self.c.hello()["protocol"], 1)  # the connection stays usable

    def test_keep_and_failed_reverse(self):
        W, x, b = self.data()
        ybar = self.rng.standard_normal((3, 5))
        _, tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x, "bias": b}, wrt=["weight", "bias"],
                                           options={"act": "tanh"})
        self.assertCode("dtype_mismatch", self.c.reverse, tape, {"y": ybar.astype(np.float32)})
        self.assertCode("shape_mismatch", self.c.reverse, tape, {"y": ybar[:2]})
        # cotangents is required (contract section 3), {} being all zero:
        # without it the reverse is refused and the tape stays.
        with self.assertRaises(pullbackd.PullbackError) as e:
            self.c.call("reverse", {"tape": tape.handle})
        self.assertEqual((e.exception.code, e.exception.details.get("arg")), ("invalid_argument", "cotangents"))
        g1 = self.c.reverse(tape, {"y": ybar}, keep=True)
        g2 = self.c.reverse(tape.handle, {"y": ybar}, keep=True)
        for name in ("weight", "bias"):
            np.testing.assert_array_equal(g1[name], g2[name])
        zero = self.c.reverse(tape, {})  # a missing cotangent is zero; this one consumes
        np.testing.assert_array_equal(zero["bias"], np.zeros(3))
        self.assertCode("unknown_tape", self.c.reverse, tape.handle, {"y": ybar})

    def test_release(self):
        W, x, _ = self.data()
        _, tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"])
        self.assertTrue(tape.release())
        self.assertFalse(tape.release())
        self.assertFalse(self.c.release(tape.handle))
        self.assertCode("unknown_tape", self.c.reverse, tape, {"y": np.ones((3, 5))})

    def wait_alone(self):
        """Wait until the daemon has closed the other tests' connections (and freed their tapes)."""
        deadline = time.monotonic() + 5
        while self.c.stats()["connections"] > 1 and time.monotonic() < deadline:
            time.sleep(0.01)

    def wait_tapes(self, want):
        deadline = time.monotonic() + 2
        while (got := self.c.stats()["tapes"]) != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return got

    def test_gc_releases(self):
        self.wait_alone()
        before = self.c.stats()
        W, x, _ = self.data()
        tapes = [self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["weight"])[1]
                 for _ in range(5)]
        after = self.c.stats()
        self.assertEqual(after["tapes"], before["tapes"] + 5)
        self.assertEqual(after["tape_bytes"], before["tape_bytes"] + sum(t.tape_bytes for t in tapes))
        del tapes
        gc.collect()
        self.assertEqual(self.wait_tapes(before["tapes"]), before["tapes"])

    def test_pipelining(self):
        W, x, _ = self.data()
        expected = {}
        for i in range(200):
            params = {"op": "fused_dense", "inputs": {"weight": pullbackd.encode_tensor(W * i),
                                                      "x": pullbackd.encode_tensor(x)}}
            expected[self.c.send("forward", params)] = i
        self.assertEqual(len(expected), 200)
        seen = set()
        for _ in range(200):
            msgid, result = self.c.recv()
            self.assertNotIn(msgid, seen)
            seen.add(msgid)
            self.assertNotIsInstance(result, PullbackError)
            y = pullbackd.decode_tensor(result["outputs"]["y"])
            np.testing.assert_allclose(y, (W * expected[msgid]) @ x, **TOL[np.float64])
        self.assertEqual(seen, set(expected))
        # A call amid outstanding requests keeps their replies for recv.
        pending = {self.c.send("hello") for _ in range(3)}
        self.assertIn("tapes", self.c.stats())
        self.assertEqual({self.c.recv()[0] for _ in range(3)}, pending)

    def test_undelivered_tapes_are_not_kept(self):
        """A tape whose handle reaches nobody is not kept, in peer scope
        either: an augmented_forward sent as a notification, or one whose
        connection closed before the reply (they used to hold their bytes
        until ttl_s, 600 s by default)."""
        self.wait_alone()
        before, peer_before = self.c.stats()["tapes"], self.c.stats()["peer_tapes"]
        W, x, _ = self.data()
        params = {"op": "fused_dense", "inputs": {"weight": pullbackd.encode_tensor(W),
                                                  "x": pullbackd.encode_tensor(x)},
                  "wrt": ["x"], "scope": "peer"}
        self.c.notify("augmented_forward", params)
        self.assertIn("tapes", self.c.stats())  # after the notification, in order
        self.assertEqual(self.wait_tapes(before), before)
        self.assertEqual(self.c.stats()["peer_tapes"], peer_before)
        A = np.random.default_rng(3).standard_normal((400, 400))
        for _ in range(3):
            other = pullbackd.Client(self.path, timeout=20)
            other.send("augmented_forward", {"op": "svd_compact", "inputs": {"A": pullbackd.encode_tensor(A)},
                                             "wrt": ["A"], "scope": "peer"})
            other.close()  # long before the factorization is done
        deadline = time.monotonic() + 10
        while self.c.stats()["requests_in_flight"] > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(self.wait_tapes(before), before)
        self.assertEqual(self.c.stats()["peer_tapes"], peer_before)

    def test_threads_share_a_client(self):
        """Threads calling one Client get each their own reply (a thread once
        read another's, or one stats() thread broke the stream for all)."""
        W, x, _ = self.data()
        with pullbackd.Client(self.path, timeout=30) as shared:
            def work(k):
                for i in range(100):
                    if k == 0:
                        self.assertIn("tapes", shared.stats())
                        continue
                    y = shared.forward("fused_dense", {"weight": W * (k + i), "x": x})["y"]
                    np.testing.assert_allclose(y, (W * (k + i)) @ x, **TOL[np.float64])
            self.assertEqual(run_in_threads(work, 4), [])
            self.assertFalse(shared.closed)

    def test_a_send_that_wrote_nothing_breaks_nothing(self):
        """register_buffer with a bad fd fails before a byte goes out: the
        connection stays usable and keeps releasing collected tapes."""
        W, x, _ = self.data()
        with pullbackd.Client(self.path, timeout=30) as c:
            bad = os.open(os.devnull, os.O_RDONLY)
            os.close(bad)
            with self.assertRaises(OSError):
                c.register_buffer(bad, 4096)
            self.assertFalse(c.closed)
            before = c.stats()["tapes"]
            _, tape = c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"])
            del tape
            gc.collect()
            c.call("hello")
            self.assertEqual(c.stats()["tapes"], before)

    def test_a_forked_child_leaves_the_parents_connection_alone(self):
        """A child neither writes on its parent's connection nor releases
        the parent's tapes when its copies are collected (a child that
        dropped a copy of a live graph once released the parent's tape)."""
        W, x, _ = self.data()
        with pullbackd.Client(self.path, timeout=30) as c:
            _, tape = c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"])
            other = pullbackd.Client(self.path, timeout=30)
            other.hello()  # accepted by now: counted below
            conns = c.stats()["connections"]
            pid = os.fork()
            if pid == 0:  # the child: collect its copy of the tape, then try to use the client
                code = 0
                try:
                    del tape
                    gc.collect()
                    for use in (c.hello, c.recv, lambda: c.wait(1)):
                        try:
                            use()
                            code = 3
                        except ConnectionError:
                            pass
                    code = code or (0 if c.closed else 4)
                    time.sleep(1.5)  # alive while the parent closes `other`
                finally:
                    os._exit(code)
            # The child's copy of the socket is closed: the parent's close reaches the daemon.
            other.close()
            deadline = time.monotonic() + 1.0
            while c.stats()["connections"] != conns - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            self.assertEqual(c.stats()["connections"], conns - 1)
            _, status = os.waitpid(pid, 0)
            self.assertEqual(os.waitstatus_to_exitcode(status), 0)
            g = c.reverse(tape, {"y": np.ones((3, 5))})
            np.testing.assert_allclose(g["x"], W.T @ np.ones((3, 5)), **TOL[np.float64])

    def test_scopes(self):
        W, x, _ = self.data()
        ybar = np.ones((3, 5))
        _, conn_tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"])
        _, peer_tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"], scope="peer",
                                                ttl_s=30)
        with pullbackd.Client(self.path, timeout=20) as other:
            self.assertCode("unknown_tape", other.reverse, conn_tape.handle, {"y": ybar})
            g = other.reverse(peer_tape, {"y": ybar})
            np.testing.assert_allclose(g["x"], W.T @ ybar, **TOL[np.float64])
        self.assertCode("unknown_tape", self.c.reverse, peer_tape.handle, {"y": ybar})
        g = self.c.reverse(conn_tape, {"y": ybar})  # unharmed by the other connection's attempt
        np.testing.assert_allclose(g["x"], W.T @ ybar, **TOL[np.float64])

    def test_check(self):
        W, x, b = self.data()
        r = self.c.check("fused_dense", {"weight": W, "x": x, "bias": b}, wrt=["weight", "x", "bias"],
                         options={"act": "gelu"}, seed=3)
        self.assertLess(r["max_rel_err"], 1e-6)
        self.assertEqual(set(r["per_input"]), {"weight", "x", "bias"})


if __name__ == "__main__":
    unittest.main(verbosity=2)
