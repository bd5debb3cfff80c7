"""tensorcontract, tensoradd, tensortrace end to end, against numpy.

Run: PULLBACKD_BIN=build/daemon/pullbackd /usr/bin/python3 tests/python/test_tensorops.py

Forward results are compared with numpy.einsum / transpose evaluated in
complex128 on the same inputs; gradients with a central difference of a
numpy loss L = Re Σ conj(C̄)·C taken in complex128 (the ops are linear in
each input, so the difference is exact up to rounding).  Tolerances
(relative to the largest entry): f64/c128 1e-11, f32/c64 2e-5.
"""

import os
import sys
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
sys.path.insert(0, HERE)
import pullbackd  # noqa: E402
from pullbackd import PullbackError  # noqa: E402
from daemon_case import DaemonCase  # noqa: E402

DTYPES = [np.float32, np.float64, np.complex64, np.complex128]
TOL = {np.float32: 2e-5, np.complex64: 2e-5, np.float64: 1e-11, np.complex128: 1e-11}


def close(test, got, want, dtype, what=""):
    want = np.asarray(want)
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    err = float(np.max(np.abs(np.asarray(got) - want))) / scale if want.size else 0.0
    test.assertLessEqual(err, TOL[dtype], f"{what}: error {err}")


class TensorOpsTest(DaemonCase):
    def setUp(self):
        self.c = pullbackd.Client(self.path, timeout=20)
        self.rng = np.random.default_rng(3)

    def tearDown(self):
        self.c.close()

    def rand(self, shape, dtype, order="C"):
        a = self.rng.standard_normal(shape)
        if np.issubdtype(dtype, np.complexfloating):
            a = a + 1j * self.rng.standard_normal(shape)
        return np.asarray(a, dtype=dtype, order=order)

    def fd_check(self, op, inputs, options, fwd, wrt, dtype):
        """Gradients from the daemon against a numpy central difference of
        L = Re Σ conj(Ḡ)·fwd(inputs, options)."""
        out, tape = self.c.augmented_forward(op, inputs, wrt=wrt, options=options)
        C = out["C"]
        G = self.rand(C.shape, dtype)
        grads = self.c.reverse(tape, {"C": G})
        cx = np.issubdtype(dtype, np.complexfloating)
        hi = {k: np.asarray(v, dtype=np.complex128) for k, v in inputs.items()}
        hopt = dict(options)

        def loss(ins, opt):
            return float(np.real(np.sum(np.conj(G.astype(np.complex128)) * fwd(ins, opt))))

        for name in wrt:
            g = grads[name]
            if name in ("alpha", "beta"):
                val = complex(hopt.get(name, 1.0 if name == "alpha" else 0.0))
                real_only = not cx or not isinstance(options.get(name), complex)
                dirs = [1.0] if real_only else [1.0, 1j]
                an = []
                for d in dirs:
                    o1, o2 = dict(hopt), dict(hopt)
                    o1[name], o2[name] = val + 1e-3 * d, val - 1e-3 * d
                    an.append((loss(hi, o1) - loss(hi, o2)) / 2e-3)
                want = an[0] + (1j * an[1] if len(an) > 1 else 0)
                self.assertEqual(g.shape, ())
                close(self, complex(g) if cx else float(g), want if cx else want.real, dtype, f"{op} grad {name}")
                continue
            V = self.rand(inputs[name].shape, dtype).astype(np.complex128)
            p, m = dict(hi), dict(hi)
            p[name], m[name] = hi[name] + 1e-3 * V, hi[name] - 1e-3 * V
            fd = (loss(p, hopt) - loss(m, hopt)) / 2e-3
            an = float(np.real(np.sum(np.conj(g.astype(np.complex128)) * V)))
            scale = np.linalg.norm(g) * np.linalg.norm(V) + 1e-300
            self.assertLessEqual(abs(an - fd) / scale, 10 * TOL[dtype], f"{op} grad {name}")
            self.assertEqual(g.dtype, np.dtype(dtype))
            self.assertEqual(g.shape, inputs[name].shape)

    def test_contract_spec_vs_einsum(self):
        for dtype in DTYPES:
            cx = np.issubdtype(dtype, np.complexfloating)
            for spec, sa, sb in [("abcd,dce->eab", (2, 3, 4, 5), (5, 4, 6)), ("ij,jk->ik", (3, 4), (4, 2)),
                                 ("abc,c->ba", (2, 3, 4), (4,)), ("a,b->ab", (3,), (2,)), ("ab,ab->", (3, 2), (3, 2))]:
                A = self.rand(sa, dtype, "F")
                B = self.rand(sb, dtype)
                out_shape = np.einsum(spec, A, B).shape
                Cin = self.rand(out_shape, dtype)
                alpha = 0.5 - 0.25j if cx else 0.5
                beta = 1.5 + 1j if cx else 1.5
                for conjA in (False, True) if cx else (False,):
                    opts = {"spec": spec, "alpha": alpha, "beta": beta, "conjA": conjA}

                    def fwd(ins, o, spec=spec):
                        a = np.conj(ins["A"]) if o.get("conjA") else ins["A"]
                        return o["alpha"] * np.einsum(spec, a, ins["B"]) + o["beta"] * ins["C"]

                    got = self.c.forward("tensorcontract", {"A": A, "B": B, "C": Cin}, options=opts)["C"]
                    want = fwd({"A": A.astype(np.complex128), "B": B, "C": Cin}, opts)
                    close(self, got, want if cx else want.real, dtype, f"{spec} {dtype}")
                    self.fd_check("tensorcontract", {"A": A, "B": B, "C": Cin}, opts, fwd,
                                  ["A", "B", "C", "alpha", "beta"], dtype)

    def test_contract_explicit_and_order_F(self):
        # TensorOperations' case: A (2,3,4,2,5), pA = [[1,3,4],[0,2]], B (4,2,3), pB = [[1,0],[2]], pAB = [2,1,3,0]
        A = self.rand((2, 3, 4, 2, 5), np.complex128)
        B = self.rand((4, 2, 3), np.complex128)
        opts = {"pA": [[1, 3, 4], [0, 2]], "pB": [[1, 0], [2]], "pAB": [2, 1, 3, 0], "conjB": True}
        got = self.c.forward("tensorcontract", {"A": A, "B": B}, options=opts, order="F")["C"]
        M = np.einsum("abcde,caf->bdef", A, np.conj(B))
        want = np.transpose(M, [2, 1, 3, 0])
        self.assertEqual(got.shape, (5, 2, 3, 3))
        self.assertTrue(got.flags.f_contiguous)
        close(self, got, want, np.complex128, "explicit")

    def test_add_and_trace(self):
        for dtype in DTYPES:
            cx = np.issubdtype(dtype, np.complexfloating)
            A = self.rand((2, 3, 4, 2, 1), dtype)
            p = [1, 0, 3, 2, 4]
            Cin = self.rand(np.transpose(A, p).shape, dtype, "F")
            opts = {"pA": p, "alpha": (2 - 1j) if cx else 2.0, "beta": -0.5, "conjA": cx}

            def fadd(ins, o):
                a = np.conj(ins["A"]) if o.get("conjA") else ins["A"]
                return o["alpha"] * np.transpose(a, p) + o["beta"] * ins["C"]

            got = self.c.forward("tensoradd", {"A": A, "C": Cin}, options=opts)["C"]
            want = fadd({"A": A.astype(np.complex128), "C": Cin}, opts)
            close(self, got, want if cx else want.real, dtype, "tensoradd")
            self.fd_check("tensoradd", {"A": A, "C": Cin}, opts, fadd, ["A", "C", "alpha", "beta"], dtype)

            A = self.rand((2, 3, 4, 2, 4), dtype)  # double trace: p = [1], q = [[0,2],[3,4]]
            Cin = self.rand((3,), dtype)
            opts = {"p": [1], "q": [[0, 2], [3, 4]], "alpha": 0.75, "beta": (0.5 + 2j) if cx else 0.5}

            def ftr(ins, o):
                # pairs (0, 3) and (2, 4): axes a b c a c, free b
                return o["alpha"] * np.einsum("abcac->b", ins["A"]) + o["beta"] * ins["C"]

            got = self.c.forward("tensortrace", {"A": A, "C": Cin}, options=opts)["C"]
            want = ftr({"A": A.astype(np.complex128), "C": Cin}, opts)
            close(self, got, want if cx else want.real, dtype, "tensortrace")
            self.fd_check("tensortrace", {"A": A, "C": Cin}, opts, ftr, ["A", "C", "alpha", "beta"], dtype)

    def test_alpha_tape_is_minimal(self):
        """The gradient of alpha needs M, the result before alpha and beta:
        the tape keeps M or what makes it, whichever is smaller (a full
        trace kept all of A, 2 MB, for an 8-byte gradient)."""
        for dt in (np.float64, np.complex128):
            it = np.dtype(dt).itemsize
            al = 0.5 + 0.25j if dt == np.complex128 else 0.5
            for (m, k, n) in ((3, 50, 4), (30, 2, 40)):
                A, B = self.rand((m, k), dt), self.rand((k, n), dt)
                G = self.rand((m, n), dt)
                for wrt, want in ((["alpha"], min(m * n, m * k + k * n)), (["A", "alpha"], k * n + min(m * n, m * k)),
                                  (["B", "alpha"], m * k + min(m * n, k * n))):
                    out, tape = self.c.augmented_forward("tensorcontract", {"A": A, "B": B}, wrt,
                                                         options={"spec": "ij,jk->ik", "alpha": al})
                    self.assertEqual(tape.tape_bytes, want * it, f"{dt.__name__} {m}x{k}x{n} wrt {wrt}")
                    close(self, out["C"], al * (A @ B), dt, "C")
                    g = self.c.reverse(tape, {"C": G})
                    close(self, g["alpha"], np.vdot(A @ B, G), dt, f"alpha wrt {wrt}")
                    if "A" in wrt:
                        close(self, g["A"], np.conj(al) * G @ B.conj().T, dt, "A")
            A = self.rand((500, 500), dt)
            out, tape = self.c.augmented_forward("tensortrace", {"A": A}, ["alpha"], options={"q": [[0], [1]]})
            self.assertEqual(tape.tape_bytes, it)
            g = self.c.reverse(tape, {"C": np.array(2.0, dt)})
            close(self, g["alpha"], 2.0 * np.trace(A).real, dt, "trace alpha")  # alpha sent real: ᾱ real
            out, tape = self.c.augmented_forward("tensoradd", {"A": A}, ["alpha"])
            self.assertEqual(tape.tape_bytes, A.nbytes)
            tape.release()
        # the trace kept for the tape takes a pass of its own: the output is
        # forward's, bit for bit (alpha·Σa rounded otherwise, and overflowed
        # where Σ alpha·a does not)
        for A, al in ((self.rand((64, 64), np.float32), 0.37), (np.diag([3e38, 3e38]).astype(np.float32), 0.5)):
            opts = {"q": [[0], [1]], "alpha": al}
            want = self.c.forward("tensortrace", {"A": A}, options=opts)["C"]
            got, tape = self.c.augmented_forward("tensortrace", {"A": A}, ["alpha"], options=opts)
            self.assertEqual(tape.tape_bytes, 4)
            self.assertEqual(got["C"].tobytes(), want.tobytes())
            tape.release()
        # alpha = 0 with M kept: C = beta·C still reads neither A nor M
        A = np.array([[np.nan, 0.0], [0.0, 1.0]])
        out, tape = self.c.augmented_forward("tensorcontract", {"A": A, "B": np.ones((2, 1)), "C": np.ones((2, 1))},
                                             ["alpha"], options={"spec": "ij,jk->ik", "alpha": 0.0, "beta": 0.5})
        self.assertEqual(tape.tape_bytes, 16)
        np.testing.assert_array_equal(out["C"], [[0.5], [0.5]])
        self.assertTrue(np.isnan(self.c.reverse(tape, {"C": np.ones((2, 1))})["alpha"]))
        out, tape = self.c.augmented_forward("tensortrace", {"A": A}, ["alpha"],
                                             options={"q": [[0], [1]], "alpha": 0.0})
        self.assertEqual(float(out["C"]), 0.0)
        self.assertTrue(np.isnan(self.c.reverse(tape, {"C": np.array(1.0)})["alpha"]))

    def test_check_method(self):
        A = self.rand((3, 4), np.complex128)
        B = self.rand((4, 5), np.complex128)
        r = self.c.check("tensorcontract", {"A": A, "B": B}, wrt=["A", "B", "alpha"],
                         options={"spec": "ij,jk->ik", "alpha": 1 + 1j})
        self.assertLess(r["max_rel_err"], 1e-8)
        self.assertEqual(set(r["per_input"]), {"A", "B", "alpha"})
        # Inputs of very different sizes in one output: a step relative to
        # a tiny A drowns in the rounding of the loss C makes, a step of 1
        # passes a tiny A altogether; check takes the better of the two.
        C = self.rand((3, 4), np.float64)
        for scale in (1, 1e-8, 1e-20):
            r = self.c.check("tensoradd", {"A": self.rand((3, 4), np.float64) * scale, "C": C},
                             wrt=["A", "C"], options={"beta": 1.0})
            self.assertLess(r["max_rel_err"], 1e-8, scale)

    def test_ops_catalogue(self):
        ops = self.c.ops()["ops"]
        for name in ("tensorcontract", "tensoradd", "tensortrace"):
            self.assertIn(name, ops)
            self.assertEqual(set(ops[name]["dtypes"]), {"f32", "f64", "c64", "c128"})
            self.assertIn("alpha", ops[name]["wrt"])
        self.assertEqual(ops["tensorcontract"]["options"]["pA"]["type"], "axes2")
        self.assertEqual(ops["tensorcontract"]["options"]["beta"]["default"], 0)

    def test_errors(self):
        A = self.rand((2, 3), np.float64)
        B = self.rand((4, 5), np.float64)
        cases = [
            ({"pA": [[0], [1]], "pB": [[0], [1]]}, "shape_mismatch", "inputs.B"),
            ({"pA": [[0, 0], []], "pB": [[], [0, 1]]}, "invalid_argument", "options.pA"),
            ({"pA": [[0], [1]], "pB": [[1, 0], []]}, "invalid_argument", "options.pB"),
            ({"pA": [[0, 1], []], "pB": [[], [0, 1]], "pAB": [0, 1, 2]}, "invalid_argument", "options.pAB"),
            ({"spec": "ab,bc->ac"}, "shape_mismatch", "inputs.B"),
            ({"spec": "aa,bc->bc"}, "invalid_argument", "options.spec"),
            ({"spec": "ab,cd->abcdab"}, "invalid_argument", "options.spec"),
            ({"spec": "ab,cd->ac"}, "invalid_argument", "options.spec"),
            ({"spec": "ab,cd->abcd", "pAB": [0, 1, 2, 3]}, "invalid_argument", "options.spec"),
            ({"spec": "ab,cd->abcd", "beta": 1.0}, "invalid_argument", "inputs.C"),
            ({"spec": "ab,cd->abcd", "alpha": [1.0, 2.0]}, "invalid_argument", "options.alpha"),
            ({"pA": [[0], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]], "pB": [[0], [1]]},
             "invalid_argument", "options.pA"),
            ({"pA": "nope", "pB": [[0], [1]]}, "invalid_argument", "options.pA"),
        ]
        for opts, code, arg in cases:
            with self.assertRaises(PullbackError) as cm:
                self.c.forward("tensorcontract", {"A": A, "B": B}, options=opts)
            self.assertEqual(cm.exception.code, code, f"{opts}: {cm.exception}")
            self.assertEqual((cm.exception.details or {}).get("arg"), arg, f"{opts}: {cm.exception}")
        with self.assertRaises(PullbackError) as cm:
            self.c.forward("tensorcontract", {"A": A, "B": B, "C": np.zeros((2, 3, 4, 4))},
                           options={"spec": "ab,cd->abcd", "beta": 1.0})
        self.assertEqual(cm.exception.code, "shape_mismatch")
        with self.assertRaises(PullbackError) as cm:
            self.c.forward("tensoradd", {"A": A}, options={"pA": [0, 0]})
        self.assertEqual(cm.exception.code, "invalid_argument")
        with self.assertRaises(PullbackError) as cm:
            self.c.forward("tensortrace", {"A": self.rand((2, 3), np.float64)}, options={"q": [[0], [1]]})
        self.assertEqual(cm.exception.code, "shape_mismatch")
        with self.assertRaises(PullbackError) as cm:
            self.c.forward("tensorcontract", {"A": A, "B": self.rand((4, 5), np.float32)},
                           options={"spec": "ab,cd->abcd"})
        self.assertEqual(cm.exception.code, "dtype_mismatch")

    def test_zero_size_and_rank0(self):
        A = np.zeros((0, 3))
        B = self.rand((3, 2), np.float64)
        got = self.c.forward("tensorcontract", {"A": A, "B": B}, options={"spec": "ij,jk->ik"})["C"]
        self.assertEqual(got.shape, (0, 2))
        A = self.rand((3, 0), np.float64)
        B = np.zeros((0, 2))
        C = self.rand((3, 2), np.float64)
        got = self.c.forward("tensorcontract", {"A": A, "B": B, "C": C}, options={"spec": "ij,jk->ik", "beta": 2.0})
        close(self, got["C"], 2 * C, np.float64, "empty sum")
        s = self.c.forward("tensoradd", {"A": np.array(3.0)}, options={"alpha": 2.0})["C"]
        self.assertEqual(s.shape, ())
        self.assertEqual(float(s), 6.0)

    def test_alpha_zero_reads_no_A(self):
        """alpha = 0 as in BLAS (proto/PROTOCOL.md): A is not read, in all three
        ops alike (tensortrace once gave NaN where the other two gave 0)."""
        A = np.array([[np.nan, 0.0], [0.0, 1.0]])
        C = np.array([[1.0, 2.0], [3.0, 4.0]])
        opts = {"alpha": 0.0, "beta": 0.5}
        got = self.c.forward("tensorcontract", {"A": A, "B": np.eye(2), "C": C}, options=dict(opts, spec="ij,jk->ik"))
        np.testing.assert_array_equal(got["C"], 0.5 * C)
        got = self.c.forward("tensoradd", {"A": A, "C": C}, options=opts)
        np.testing.assert_array_equal(got["C"], 0.5 * C)
        got = self.c.forward("tensortrace", {"A": A, "C": np.array(4.0)}, options=dict(opts, q=[[0], [1]]))
        self.assertEqual(float(got["C"]), 2.0)
        got = self.c.forward("tensortrace", {"A": A}, options={"q": [[0], [1]], "alpha": 0.0})
        self.assertEqual(float(got["C"]), 0.0)
        # nor into the gradients alpha scales, in single precision too (OpenBLAS's
        # small-matrix kernels on AVX-512 machines multiplied NaN by alpha = 0)
        for dt in (np.float32, np.float64):
            out, tape = self.c.augmented_forward("tensorcontract", {"A": A.astype(dt), "B": np.eye(2, dtype=dt)},
                                                 wrt=["B"], options={"spec": "ij,jk->ik", "alpha": 0.0})
            np.testing.assert_array_equal(out["C"], np.zeros((2, 2)))
            np.testing.assert_array_equal(self.c.reverse(tape, {"C": np.ones((2, 2), dt)})["B"], np.zeros((2, 2)))
        # NaN still propagates at any other alpha
        got = self.c.forward("tensortrace", {"A": A}, options={"q": [[0], [1]], "alpha": 1e-300})
        self.assertTrue(np.isnan(float(got["C"])))


if __name__ == "__main__":
    unittest.main(verbosity=2)
