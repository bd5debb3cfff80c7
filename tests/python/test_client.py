"""Tests of the Python client against a daemon started here.

Run: PULLBACKD_BIN=build/daemon/pullbackd /usr/bin/python3 tests/python/test_client.py

Tolerances: f64 forward and gradients rtol 1e-12 against numpy formulas in
float64; f32 rtol 2e-5 (atol 1e-6) against the same float64 formulas.
"""

import gc
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "clients", "python"))
import pullbackd  # noqa: E402

K = np.sqrt(2 / np.pi)
ACTS = {
    "identity": (lambda z: z, lambda z: np.ones_like(z)),
    "relu": (lambda z: np.maximum(z, 0), lambda z: (z > 0).astype(z.dtype)),
    "sigmoid": (lambda z: 1 / (1 + np.exp(-z)), lambda z: np.exp(-z) / (1 + np.exp(-z)) ** 2),
    "tanh": (np.tanh, lambda z: 1 - np.tanh(z) ** 2),
    "gelu": (
        lambda z: 0.5 * z * (1 + np.tanh(K * (z + 0.044715 * z**3))),
        lambda z: 0.5 * (1 + np.tanh(K * (z + 0.044715 * z**3)))
        + 0.5 * z * (1 - np.tanh(K * (z + 0.044715 * z**3)) ** 2) * K * (1 + 3 * 0.044715 * z**2),
    ),
    "softplus": (lambda z: np.log1p(np.exp(z)), lambda z: 1 / (1 + np.exp(-z))),
    "silu": (lambda z: z / (1 + np.exp(-z)), lambda z: (1 + np.exp(-z) + z * np.exp(-z)) / (1 + np.exp(-z)) ** 2),
    "elu": (lambda z: np.where(z > 0, z, np.expm1(z)), lambda z: np.where(z > 0, 1.0, np.exp(z))),
}
TOL = {np.float64: dict(rtol=1e-12, atol=1e-14), np.float32: dict(rtol=2e-5, atol=1e-6)}


def reference(W, x, b, act, ybar=None):
    W, x = W.astype(np.float64), x.astype(np.float64)
    z = W @ x + (b.astype(np.float64)[:, None] if x.ndim == 2 else b) if b is not None else W @ x
    f, df = ACTS[act]
    y = f(z)
    if ybar is None:
        return y
    dz = ybar * df(z)
    gW = np.outer(dz, x) if x.ndim == 1 else dz @ x.T
    return y, gW, W.T @ dz, dz if x.ndim == 1 else dz.sum(axis=1)


class DaemonTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="pbpy")
        cls.path = os.path.join(cls.dir, "d.sock")
        binary = os.environ.get("PULLBACKD_BIN", "build/daemon/pullbackd")
        cls.proc = subprocess.Popen([binary, "--socket", cls.path, "--log-level", "warning"])
        for _ in range(500):
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect(cls.path)
                s.close()
                break
            except OSError:
                time.sleep(0.01)
        else:
            raise RuntimeError("daemon did not start")

    @classmethod
    def tearDownClass(cls):
        cls.proc.terminate()
        assert cls.proc.wait(10) == 0
        shutil.rmtree(cls.dir)

    def setUp(self):
        self.c = pullbackd.Client(self.path, timeout=20)
        self.rng = np.random.default_rng(7)

    def tearDown(self):
        self.c.close()

    def data(self, dtype, out=3, inn=4, batch=5, vector=False):
        W = self.rng.standard_normal((out, inn)).astype(dtype)
        x = self.rng.standard_normal(inn if vector else (inn, batch)).astype(dtype)
        b = self.rng.standard_normal(out).astype(dtype)
        return W, x, b

    def test_hello_and_ops(self):
        h = self.c.hello()
        self.assertEqual(h["protocol"], 1)
        self.assertIn("cpu", h["devices"])
        for k in ("max_message_bytes", "max_tape_bytes", "max_tapes_per_connection"):
            self.assertIn(k, h["limits"])
        ops = self.c.ops()
        self.assertIn("fused_dense", ops)
        self.assertIn("gelu", ops["fused_dense"]["options"]["act"]["values"])

    def test_forward_matches_numpy(self):
        for dtype in (np.float64, np.float32):
            for act in ACTS:
                for vector in (False, True):
                    for bias in (True, False):
                        W, x, b = self.data(dtype, vector=vector)
                        inputs = {"weight": W, "x": x}
                        if bias:
                            inputs["bias"] = b
                        y = self.c.forward("fused_dense", inputs, options={"act": act})["y"]
                        self.assertEqual(y.dtype, dtype)
                        np.testing.assert_allclose(y, reference(W, x, b if bias else None, act), **TOL[dtype])

    def test_fortran_inputs_and_outputs(self):
        W, x, b = self.data(np.float64)
        Wf, xf = np.asfortranarray(W), np.asfortranarray(x)
        self.assertEqual(pullbackd.encode_tensor(Wf)["order"], "F")
        y = self.c.forward("fused_dense", {"weight": Wf, "x": xf, "bias": b}, options={"act": "gelu"}, order="F")["y"]
        self.assertTrue(y.flags.f_contiguous)
        np.testing.assert_allclose(y, reference(W, x, b, "gelu"), **TOL[np.float64])
        # A strided view is sent as a C copy.
        big = np.zeros((x.shape[0], 2 * x.shape[1]))
        big[:, ::2] = x
        self.assertFalse(big[:, ::2].flags.c_contiguous or big[:, ::2].flags.f_contiguous)
        y2 = self.c.forward("fused_dense", {"weight": W, "x": big[:, ::2], "bias": b},
                            options={"act": "gelu"})["y"]
        np.testing.assert_allclose(y2, reference(W, x, b, "gelu"), **TOL[np.float64])

    def test_reverse_matches_numpy(self):
        for dtype in (np.float64, np.float32):
            for act in ("gelu", "tanh", "softplus", "relu", "silu", "elu"):
                for vector in (False, True):
                    W, x, b = self.data(dtype, vector=vector)
                    ybar = self.rng.standard_normal(3 if vector else (3, 5)).astype(dtype)
                    out, tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x, "bias": b},
                                                         wrt=["weight", "x", "bias"], options={"act": act})
                    g = self.c.reverse(tape, {"y": ybar})
                    y, gW, gx, gb = reference(W, x, b, act, ybar.astype(np.float64))
                    np.testing.assert_allclose(out["y"], y, **TOL[dtype])
                    for name, ref in (("weight", gW), ("x", gx), ("bias", gb)):
                        self.assertEqual(g[name].shape, ref.shape)
                        self.assertEqual(g[name].dtype, dtype)
                        np.testing.assert_allclose(g[name], ref, **TOL[dtype], err_msg=f"{act} {name}")

    def test_errors(self):
        W, x, b = self.data(np.float64)
        cases = [
            ("unknown_op", dict(op="nope", inputs={"weight": W, "x": x})),
            ("invalid_argument", dict(op="fused_dense", inputs={"weight": W.astype(np.complex128), "x": x})),
            ("invalid_argument", dict(op="fused_dense", inputs={"weight": W, "x": x}, options={"act": "swish"})),
            ("invalid_argument", dict(op="fused_dense", inputs={"weight": W, "x": x}, options={"actt": "relu"})),
            ("invalid_argument", dict(op="fused_dense", inputs={"x": x})),
            ("shape_mismatch", dict(op="fused_dense", inputs={"weight": W, "x": x.T})),
            ("shape_mismatch", dict(op="fused_dense", inputs={"weight": W, "x": x, "bias": b[:2]})),
            ("dtype_mismatch", dict(op="fused_dense", inputs={"weight": W, "x": x.astype(np.float32)})),
            ("device_unavailable", dict(op="fused_dense", inputs={"weight": W, "x": x}, device="cuda")),
        ]
        for code, kw in cases:
            with self.assertRaises(pullbackd.PullbackError) as cm:
                self.c.forward(**kw)
            self.assertEqual(cm.exception.code, code, kw)
            self.assertTrue(cm.exception.message)
        p = pullbackd.Client._call_params("fused_dense", {"weight": W, "x": x}, None, None)
        p["bogus"] = 1
        with self.assertRaises(pullbackd.PullbackError) as cm:
            self.c.call("forward", p)
        self.assertEqual(cm.exception.code, "invalid_argument")
        self.assertIn("bogus", cm.exception.message)
        with self.assertRaises(TypeError):
            self.c.forward("fused_dense", {"weight": W.astype(np.int8).view(np.dtype("S1")), "x": x})

    def test_tape_lifecycle(self):
        W, x, b = self.data(np.float64)
        ybar = np.ones((3, 5))
        _, tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x, "bias": b}, wrt=["bias"],
                                           options={"act": "tanh"})
        self.assertEqual(tape.tape_bytes, 3 * 5 * 8)
        with self.assertRaises(pullbackd.PullbackError) as cm:
            self.c.reverse(tape, {"y": ybar.astype(np.float32)})
        self.assertEqual(cm.exception.code, "dtype_mismatch")
        with self.assertRaises(pullbackd.PullbackError) as cm:
            self.c.reverse(tape, {"y": ybar[:2]})
        self.assertEqual(cm.exception.code, "shape_mismatch")
        g1 = self.c.reverse(tape, {"y": ybar}, keep=True)
        g2 = self.c.reverse(tape, {"y": ybar}, keep=True)
        np.testing.assert_array_equal(g1["bias"], g2["bias"])
        self.assertEqual(set(self.c.reverse(tape, {})), {"bias"})  # missing cotangent is zero; consumes
        with self.assertRaises(pullbackd.PullbackError) as cm:
            self.c.reverse(tape.handle, {"y": ybar})
        self.assertEqual(cm.exception.code, "unknown_tape")
        _, t2 = self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"])
        self.assertTrue(t2.release())
        self.assertFalse(self.c.release(t2.handle))

    def test_gc_releases(self):
        before = self.c.stats()["tapes"]
        W, x, b = self.data(np.float64)
        tapes = [self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["weight"])[1] for _ in range(5)]
        self.assertEqual(self.c.stats()["tapes"], before + 5)
        del tapes
        gc.collect()
        self.assertEqual(self.c.stats()["tapes"], before)

    def test_pipelining(self):
        W, x, b = self.data(np.float64)
        ids = {}
        for i in range(200):
            if i % 2:
                ids[self.c.send("hello")] = "hello"
            else:
                ids[self.c.send("forward", pullbackd.Client._call_params(
                    "fused_dense", {"weight": W * i, "x": x}, None, None))] = i
        seen = set()
        for _ in range(200):
            msgid, result = self.c.recv()
            self.assertNotIn(msgid, seen)
            seen.add(msgid)
            what = ids[msgid]
            if what == "hello":
                self.assertEqual(result["protocol"], 1)
            else:
                y = pullbackd.decode_tensor(result["outputs"]["y"])
                np.testing.assert_allclose(y, (W * what) @ x, rtol=1e-12, atol=1e-12)
        self.assertEqual(seen, set(ids))

    def test_scopes(self):
        W, x, b = self.data(np.float64)
        _, conn_tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"])
        _, peer_tape = self.c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"], scope="peer",
                                                ttl_s=30)
        with pullbackd.Client(self.path, timeout=20) as other:
            with self.assertRaises(pullbackd.PullbackError) as cm:
                other.reverse(conn_tape.handle, {"y": np.ones((3, 5))})
            self.assertEqual(cm.exception.code, "unknown_tape")
            g = other.reverse(peer_tape.handle, {"y": np.ones((3, 5))})
            np.testing.assert_allclose(g["x"], W.T @ np.ones((3, 5)), rtol=1e-12)
        conn_tape.release()
        peer_tape.done = True

    def test_check(self):
        W, x, b = self.data(np.float64)
        r = self.c.check("fused_dense", {"weight": W, "x": x, "bias": b}, wrt=["weight", "x", "bias"],
                         options={"act": "gelu"}, seed=3)
        self.assertLess(r["max_rel_err"], 1e-6)
        self.assertEqual(set(r["per_input"]), {"weight", "x", "bias"})


if __name__ == "__main__":
    unittest.main(verbosity=2)
