"""The factorizations end to end, against numpy.linalg as an independent reference.

Run: PULLBACKD_BIN=build/daemon/pullbackd /usr/bin/python3 tests/python/test_factor.py

Forward values are compared with numpy (LAPACK through another path) in
the contract's gauge; gradients of gauge-invariant losses written with
numpy (singular values, eigenvalues, the polar factor, projectors) with
central differences of those numpy losses in float64/complex128.
Tolerances: f64/c128 forward 1e-10 relative to max|A|, gradients 1e-6
relative to ‖Ā‖·‖V‖; f32/c64 forward 1e-4, gradients 1e-3.
"""

import os
import sys
import unittest
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
sys.path.insert(0, HERE)
import pullbackd  # noqa: E402
from pullbackd import PullbackError  # noqa: E402
from daemon_case import DaemonCase  # noqa: E402

DTYPES = [np.float64, np.complex128, np.float32, np.complex64]
FTOL = {np.float64: 1e-10, np.complex128: 1e-10, np.float32: 1e-4, np.complex64: 1e-4}
GTOL = {np.float64: 1e-6, np.complex128: 1e-6, np.float32: 1e-3, np.complex64: 1e-3}
OPS = ["qr_compact", "qr_full", "qr_null", "lq_compact", "lq_full", "lq_null", "eigh_full", "eigh_vals",
       "eigh_trunc", "eig_full", "eig_vals", "svd_compact", "svd_full", "svd_vals", "svd_trunc", "left_polar",
       "right_polar"]


def cx(dtype):
    return np.issubdtype(dtype, np.complexfloating)


def gauge(V):
    """The contract's gauge: each column's largest-magnitude entry real and positive."""
    V = np.array(V, dtype=np.complex128)
    for j in range(V.shape[1]):
        i = int(np.argmax(np.abs(V[:, j])))
        if abs(V[i, j]) > 0:
            V[:, j] *= np.conj(V[i, j]) / abs(V[i, j])
    return V


class FactorTest(DaemonCase):
    def setUp(self):
        self.c = pullbackd.Client(self.path, timeout=30)
        self.rng = np.random.default_rng(5)

    def tearDown(self):
        self.c.close()

    def rand(self, shape, dtype, order="C"):
        a = self.rng.standard_normal(shape)
        if cx(dtype):
            a = a + 1j * self.rng.standard_normal(shape)
        return np.asarray(a.astype(dtype), order=order)

    def herm(self, n, dtype):
        a = self.rand((n, n), dtype).astype(np.complex128)
        h = (a + a.conj().T) / 2
        return (h if cx(dtype) else h.real).astype(dtype)

    def close(self, got, want, dtype, scale, what):
        err = float(np.max(np.abs(np.asarray(got, dtype=np.complex128) - want))) if np.size(want) else 0.0
        self.assertLessEqual(err / max(scale, 1.0), FTOL[dtype], f"{what}: error {err}")

    def grad_check(self, op, A, loss, dtype, cot, herm=False, options=None, what=""):
        """Ā from the daemon for the cotangents `cot`, against central
        differences of the numpy loss (whose derivative the cotangents are)."""
        _, tape = self.c.augmented_forward(op, {"A": A}, wrt=["A"], options=options)
        g = self.c.reverse(tape, cot)["A"]
        self.assertEqual(g.dtype, np.dtype(dtype))
        self.assertEqual(g.shape, A.shape)
        V = self.rand(A.shape, np.complex128 if cx(dtype) else np.float64)
        if herm:
            V = (V + V.conj().T) / 2
        Ah = A.astype(np.complex128 if cx(dtype) else np.float64)
        h = 1e-5
        fd = (loss(Ah + h * V) - loss(Ah - h * V)) / (2 * h)
        an = float(np.real(np.sum(np.conj(g.astype(np.complex128)) * V)))
        scale = np.linalg.norm(g) * np.linalg.norm(V) + 1e-300
        self.assertLessEqual(abs(an - fd) / scale, GTOL[dtype], f"{what}: reverse {an}, differences {fd}")

    # ---- forward against numpy ----

    def test_forward_against_numpy(self):
        for dtype in DTYPES:
            for m, n in [(7, 5), (6, 6), (5, 8)]:
                A = self.rand((m, n), dtype, "F" if m == 6 else "C")
                An = A.astype(np.complex128)
                s = float(np.max(np.abs(An)))
                k = min(m, n)
                # QR with diag(R) >= 0: unique for full rank
                out = self.c.forward("qr_compact", {"A": A})
                q, r = np.linalg.qr(An)
                ph = np.diag(r) / np.abs(np.diag(r))
                self.close(out["Q"], q * ph, dtype, 1, f"qr Q {dtype} {m}x{n}")
                self.close(out["R"], np.conj(ph)[:, None] * r, dtype, s, f"qr R {dtype}")
                out = self.c.forward("lq_compact", {"A": A})
                q, r = np.linalg.qr(An.conj().T)
                ph = np.diag(r) / np.abs(np.diag(r))
                self.close(out["Q"], (q * ph).conj().T, dtype, 1, f"lq Q {dtype}")
                self.close(out["L"], (np.conj(ph)[:, None] * r).conj().T, dtype, s, f"lq L {dtype}")
                # SVD: values, and U in the contract's gauge (distinct values)
                out = self.c.forward("svd_compact", {"A": A}, order="F")
                u, sv, vh = np.linalg.svd(An, full_matrices=False)
                self.assertEqual(out["S"].dtype, np.dtype(np.float32 if dtype in (np.float32, np.complex64)
                                                          else np.float64))
                self.close(out["S"], sv, dtype, s, f"svd S {dtype}")
                self.close(out["U"], gauge(u), dtype, 1, f"svd U {dtype}")
                self.close(out["U"] * out["S"] @ out["Vh"], An, dtype, s, f"svd USVh {dtype}")
                self.assertTrue(out["U"].flags.f_contiguous)
                self.close(self.c.forward("svd_vals", {"A": A})["S"], sv, dtype, s, "svd_vals")
                full = self.c.forward("svd_full", {"A": A})
                self.assertEqual(full["U"].shape, (m, m))
                self.assertEqual(full["Vh"].shape, (n, n))
                self.close(full["U"].conj().T @ full["U"], np.eye(m), dtype, 1, "svd_full U unitary")
                # null spaces
                N = self.c.forward("qr_null", {"A": A})["N"]
                self.assertEqual(N.shape, (m, m - k))
                self.close(N.conj().T @ An, np.zeros((m - k, n)), dtype, s, "qr_null")
                N = self.c.forward("lq_null", {"A": A})["N"]
                self.assertEqual(N.shape, (n - k, n))
                self.close(An @ N.conj().T, np.zeros((m, n - k)), dtype, s, "lq_null")
                # polar
                op = "left_polar" if m >= n else "right_polar"
                out = self.c.forward(op, {"A": A})
                W = u @ vh
                if m >= n:
                    self.close(out["W"], W, dtype, 1, "left_polar W")
                    self.close(out["W"] @ out["P"], An, dtype, s, "left_polar WP")
                else:
                    self.close(out["Wh"], W, dtype, 1, "right_polar Wh")
                    self.close(out["P"] @ out["Wh"], An, dtype, s, "right_polar PWh")
            # eigh and eig
            H = self.herm(6, dtype)
            out = self.c.forward("eigh_full", {"A": H})
            w, v = np.linalg.eigh(H.astype(np.complex128))
            self.close(out["D"], w, dtype, 1, "eigh D")
            self.close(out["V"], gauge(v), dtype, 1, "eigh V")
            self.close(self.c.forward("eigh_vals", {"A": H})["D"], w, dtype, 1, "eigh_vals")
            A = self.rand((6, 6), dtype)
            out = self.c.forward("eig_full", {"A": A})
            self.assertEqual(out["D"].dtype, np.dtype(np.complex64 if dtype in (np.float32, np.complex64)
                                                      else np.complex128))
            # a real A through numpy's real path too, whose conjugate pairs are exact
            w = np.linalg.eigvals(A.astype(np.complex128 if cx(dtype) else np.float64)).astype(np.complex128)
            w = w[np.lexsort((w.imag, w.real))]
            self.close(out["D"], w, dtype, 1, "eig D (sorted by real, then imaginary part)")
            self.close(A.astype(np.complex128) @ out["V"], out["V"] * out["D"], dtype, 10, "eig AV = VD")
            self.close(np.linalg.norm(out["V"], axis=0), np.ones(6), dtype, 1, "eig unit columns")
            self.close(self.c.forward("eig_vals", {"A": A})["D"], w, dtype, 1, "eig_vals")

    def test_padded_sizes_against_numpy(self):
        """Columns of 512 bytes and more, which LAPACK gets padded (and the
        values-only forwards of svd_vals, eigh_vals and eig_vals, which run
        the drivers without vectors): against numpy, and the gradients of
        svd_vals and eigh_vals against numpy's differences."""
        for dtype in DTYPES:
            n0 = 512 // np.dtype(dtype).itemsize + 3  # f32 131, f64 and c64 67, c128 35
            real = np.float32 if dtype in (np.float32, np.complex64) else np.float64
            for m, n in [(n0, n0 - 4), (n0 - 4, n0)]:
                A = self.rand((m, n), dtype, "F" if m > n else "C")
                An = A.astype(np.complex128)
                s = float(np.max(np.abs(An)))
                out = self.c.forward("qr_compact", {"A": A})
                q, r = np.linalg.qr(An)
                ph = np.diag(r) / np.abs(np.diag(r))
                self.close(out["Q"], q * ph, dtype, n0, f"qr Q {dtype} {m}x{n}")
                self.close(out["R"], np.conj(ph)[:, None] * r, dtype, s * n0, f"qr R {dtype} {m}x{n}")
                out = self.c.forward("lq_compact", {"A": A})
                self.close(out["L"] @ out["Q"], An, dtype, s * n0, f"lq LQ {dtype} {m}x{n}")
                sv = np.linalg.svd(An, compute_uv=False)
                out = self.c.forward("svd_compact", {"A": A})
                self.close(out["S"], sv, dtype, s * n0, f"svd S {dtype} {m}x{n}")
                self.close(out["U"] * out["S"] @ out["Vh"], An, dtype, s * n0, f"svd USVh {dtype} {m}x{n}")
                self.close(self.c.forward("svd_vals", {"A": A})["S"], sv, dtype, s * n0, f"svd_vals {dtype} {m}x{n}")
            H = self.herm(n0, dtype)
            w = np.linalg.eigvalsh(H.astype(np.complex128))
            self.close(self.c.forward("eigh_full", {"A": H})["D"], w, dtype, n0, f"eigh D {dtype}")
            self.close(self.c.forward("eigh_vals", {"A": H})["D"], w, dtype, n0, f"eigh_vals {dtype}")
            A = self.rand((n0, n0), dtype)
            w = np.linalg.eigvals(A.astype(np.complex128 if cx(dtype) else np.float64)).astype(np.complex128)
            w = w[np.lexsort((w.imag, w.real))]
            scale = float(np.max(np.abs(w))) * n0
            out = self.c.forward("eig_full", {"A": A})
            self.close(out["D"], w, dtype, scale, f"eig D {dtype}")
            self.close(A.astype(np.complex128) @ out["V"], out["V"] * out["D"], dtype, scale, f"eig AV = VD {dtype}")
            self.close(self.c.forward("eig_vals", {"A": A})["D"], w, dtype, scale, f"eig_vals {dtype}")
            wts = self.rng.standard_normal(n0 - 4)
            A = self.rand((n0, n0 - 4), dtype)
            self.grad_check("svd_vals", A, lambda X: float(wts @ np.linalg.svd(X, compute_uv=False)), dtype,
                            {"S": wts.astype(real)}, what=f"svd_vals {dtype} padded")
            wts = self.rng.standard_normal(n0)
            self.grad_check("eigh_vals", H, lambda X: float(wts @ np.linalg.eigvalsh((X + X.conj().T) / 2)), dtype,
                            {"D": wts.astype(real)}, herm=True, what=f"eigh_vals {dtype} padded")

    # ---- gradients of gauge-invariant losses written in numpy ----

    def test_gradients_against_numpy(self):
        for dtype in DTYPES:
            A = self.rand((7, 5), dtype)
            w = self.rng.standard_normal(5)
            # svd_vals: L = Σ w_i σ_i
            self.grad_check("svd_vals", A, lambda X: float(w @ np.linalg.svd(X, compute_uv=False)), dtype,
                            {"S": w.astype(np.float32 if dtype in (np.float32, np.complex64) else np.float64)},
                            what=f"svd_vals {dtype}")
            # left_polar: L = Re tr(Cᴴ W)
            C = self.rand((7, 5), dtype).astype(np.complex128 if cx(dtype) else np.float64)

            def polar_loss(X, C=C):
                u, _, vh = np.linalg.svd(X, full_matrices=False)
                return float(np.real(np.sum(np.conj(C) * (u @ vh))))
            self.grad_check("left_polar", A, polar_loss, dtype, {"W": C.astype(dtype)}, what=f"left_polar {dtype}")
            # eigh_vals: L = Σ w_i λ_i (Hermitian directions)
            H = self.herm(5, dtype)
            self.grad_check("eigh_vals", H, lambda X: float(w @ np.linalg.eigvalsh((X + X.conj().T) / 2)), dtype,
                            {"D": w.astype(np.float32 if dtype in (np.float32, np.complex64) else np.float64)},
                            herm=True, what=f"eigh_vals {dtype}")
            # qr_compact: L = Re tr(Cᴴ·Q₁Q₁ᴴ) (a projector: no gauge), ΔQ = (C + Cᴴ)·Q
            S = self.rand((7, 7), dtype).astype(np.complex128 if cx(dtype) else np.float64)

            def proj_loss(X, S=S):
                q, _ = np.linalg.qr(X)
                return float(np.real(np.sum(np.conj(S) * (q @ q.conj().T))))
            q = self.c.forward("qr_compact", {"A": A})["Q"].astype(np.complex128)
            dq = (S + S.conj().T) @ q
            self.grad_check("qr_compact", A, proj_loss, dtype, {"Q": (dq if cx(dtype) else dq.real).astype(dtype)},
                            what=f"qr_compact {dtype}")

    def test_check_method(self):
        for op, A in [("svd_compact", self.rand((6, 4), np.float64)), ("eigh_full", self.herm(5, np.complex128)),
                      ("qr_full", self.rand((6, 4), np.complex128)), ("eig_full", self.rand((5, 5), np.float64)),
                      ("right_polar", self.rand((3, 6), np.complex128))]:
            r = self.c.check(op, {"A": A}, wrt=["A"], seed=3)
            self.assertLessEqual(r["max_rel_err"], 1e-6, op)
            # The step follows the input's size: a correct rule checks at 1e-20 as at 1.
            r = self.c.check(op, {"A": A * 1e-20}, wrt=["A"], seed=3)
            self.assertLessEqual(r["max_rel_err"], 1e-6, f"{op} at 1e-20")
        # A check that fails leaves the connection as it was: it made no
        # tape and takes none from the count (the count once wrapped below
        # zero, and every augmented_forward after was refused).
        with self.assertRaises(PullbackError) as e:
            self.c.check("svd_compact", {"A": np.full((3, 3), np.nan)}, wrt=["A"])
        self.assertEqual(e.exception.code, "numerical_error")
        out, tape = self.c.augmented_forward("svd_vals", {"A": self.rand((4, 3), np.float64)}, wrt=["A"])
        self.assertEqual(self.c.stats()["tapes"], 1)
        self.c.reverse(tape, {"S": np.ones(3)})
        self.assertEqual(self.c.stats()["tapes"], 0)

    def test_svd_vals_rank(self):
        """svd_vals' pullback is the rank-r part, as svd_compact's
        (contract section 4): a cotangent on a singular value at or below
        rank_atol gives nothing.  It used to give U₂·diag(S̄₂)·V₂ᴴ, made of
        whatever null-space bases LAPACK picked: not a function of A."""
        for dtype in DTYPES:
            real = np.float32 if dtype in (np.float32, np.complex64) else np.float64
            tol = 1e-5 if real == np.float32 else 1e-12
            u = self.rand((5, 2), dtype)
            v = self.rand((2, 3), dtype)
            for A, dS in ((u @ v, [1.0, -2.0, 0.75]),             # rank 2 of 3
                          (np.zeros((4, 3), dtype), [1.0, 0.5, 0.25]),  # rank 0
                          (np.outer(np.arange(1, 5), np.ones(3)).astype(dtype), [0.0, 1.0, 1.0])):
                A = np.ascontiguousarray(A)
                dS = np.array(dS, real)
                grads = {}
                for op in ("svd_vals", "svd_compact"):
                    out, tape = self.c.augmented_forward(op, {"A": A}, wrt=["A"])
                    grads[op] = self.c.reverse(tape, {"S": dS})["A"]
                s, = (out["S"],)
                U, _, Vh = np.linalg.svd(A.astype(np.complex128), full_matrices=False)
                r = int(np.sum(s > 1e-3 * max(float(s[0]), 1e-300))) if s[0] > 0 else 0
                want = (U[:, :r] * dS[:r]) @ Vh[:r]
                scale = max(1.0, float(np.max(np.abs(dS))))
                for op, g in grads.items():
                    self.assertLessEqual(float(np.max(np.abs(g - want))), tol * scale * 10,
                                         f"{op} {np.dtype(dtype).name} rank {r}")
            # An explicit rank_atol above a small singular value drops it too.
            B = self.rand((4, 3), dtype)
            U, s, Vh = np.linalg.svd(B.astype(np.complex128), full_matrices=False)
            B = np.ascontiguousarray(((U * [3.0, 1.0, 1e-2]) @ Vh).astype(dtype)) if np.iscomplexobj(B) else \
                np.ascontiguousarray(((U * [3.0, 1.0, 1e-2]) @ Vh).real.astype(dtype))
            U, s, Vh = np.linalg.svd(B.astype(np.complex128), full_matrices=False)
            dS = np.array([1.0, 1.0, 1.0], real)
            for op in ("svd_vals", "svd_compact"):
                out, tape = self.c.augmented_forward(op, {"A": B}, wrt=["A"], options={"rank_atol": 0.1})
                g = self.c.reverse(tape, {"S": dS})["A"]
                self.assertLessEqual(float(np.max(np.abs(g - (U[:, :2] @ Vh[:2])))), tol * 10,
                                     f"{op} {np.dtype(dtype).name} rank_atol 0.1")

    def test_tall_and_wide(self):
        """A tall-skinny A longer than any square matrix LAPACK indexes
        (50000 > 46276 rows): the thin factorizations take it, against
        numpy, and their pullbacks check; those that would make a square
        matrix of its long side say so."""
        m = 50000
        A = self.rand((m, 2), np.float64)
        q, r = np.linalg.qr(A)
        ph = np.sign(np.diag(r))
        out = self.c.forward("qr_compact", {"A": A})
        self.close(out["Q"], q * ph, np.float64, 1.0, "tall Q")
        self.close(out["R"], r * ph[:, None], np.float64, float(np.max(np.abs(r))), "tall R")
        S = np.linalg.svd(A, compute_uv=False)
        for op in ("svd_vals", "svd_compact"):
            self.close(self.c.forward(op, {"A": A})["S"], S, np.float64, float(S[0]), f"tall {op}")
            self.close(self.c.forward(op, {"A": A.T.copy()})["S"], S, np.float64, float(S[0]), f"wide {op}")
        L, Q = (self.c.forward("lq_compact", {"A": A.T.copy()})[k] for k in ("L", "Q"))
        self.close(L @ Q, A.T, np.float64, float(np.max(np.abs(A))), "wide L·Q")
        W, P = (self.c.forward("left_polar", {"A": A})[k] for k in ("W", "P"))
        self.close(W @ P, A, np.float64, float(np.max(np.abs(A))), "tall W·P")
        for op in ("qr_compact", "svd_vals"):
            r = self.c.check(op, {"A": A}, wrt=["A"], seed=3)
            self.assertLessEqual(r["max_rel_err"], 1e-6, f"tall {op}")
        for op, a in (("qr_full", A), ("svd_full", A), ("qr_null", A), ("lq_full", A.T.copy())):
            with self.assertRaises(PullbackError) as e:
                self.c.forward(op, {"A": a})
            self.assertEqual(e.exception.code, "invalid_argument", op)
            self.assertIn("46276", e.exception.message, op)

    def test_trunc_and_tape(self):
        A = self.rand((9, 7), np.float64)
        out, tape = self.c.augmented_forward("svd_trunc", {"A": A}, wrt=["A"], options={"maxrank": 3})
        self.assertEqual(out["U"].shape, (9, 3))
        self.assertEqual(out["S"].shape, (3,))
        self.assertEqual(out["Vh"].shape, (3, 7))
        self.assertEqual(tape.tape_bytes, 8 * (9 * 7 + 7 + 7 * 7))  # the full compact SVD
        g = self.c.reverse(tape, {"S": np.ones(3)})["A"]
        u, s, vh = np.linalg.svd(A, full_matrices=False)
        np.testing.assert_allclose(g, u[:, :3] @ vh[:3], atol=1e-12)
        out = self.c.forward("svd_trunc", {"A": A}, options={"maxrank": 0})
        self.assertEqual(out["U"].shape, (9, 0))
        H = self.herm(6, np.float64)
        out = self.c.forward("eigh_trunc", {"A": H}, options={"maxrank": 2})
        w = np.linalg.eigvalsh(H)
        want = np.sort(w[np.argsort(-np.abs(w))[:2]])
        np.testing.assert_allclose(out["D"], want, atol=1e-12)
        _, tape = self.c.augmented_forward("eigh_vals", {"A": H}, wrt=[])
        self.assertEqual(tape.tape_bytes, 0)
        tape.release()

    def test_gauge_warning_and_strict(self):
        A = self.rand((6, 4), np.complex128)
        out, tape = self.c.augmented_forward("svd_compact", {"A": A}, wrt=["A"])
        dU = np.zeros_like(out["U"])
        dU[:, 0] = 1j * out["U"][:, 0]  # a pure phase rotation of u_1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.c.reverse(tape, {"U": dU})
        self.assertTrue(any("gauge" in str(w.message) for w in caught))
        self.assertTrue(self.c.last_warnings and "svd_compact" in self.c.last_warnings[0])
        _, tape = self.c.augmented_forward("svd_compact", {"A": A}, wrt=["A"], options={"strict_gauge": True})
        with self.assertRaises(PullbackError) as e:
            self.c.reverse(tape, {"U": dU}, keep=True)
        self.assertEqual(e.exception.code, "gauge_dependent")
        # a failed reverse keeps the tape: a gauge-invariant cotangent now works
        g = self.c.reverse(tape, {"S": np.ones(4)})["A"]
        self.assertEqual(g.shape, (6, 4))

    def test_gauge_part_is_ignored(self):
        """A cotangent plus a pure gauge direction (what a change of phases
        moves the vectors along: V·iΘ for eig and eigh, U·iΘ with −iΘ·Vh
        for svd) gives the gradient of the cotangent alone (contract: the
        pullback uses only the gauge-invariant part); for eig of a
        non-normal A too, whose V is not unitary."""
        for op, dtype in (("eig_full", np.complex128), ("eig_full", np.float64), ("eig_full", np.complex64),
                          ("eigh_full", np.complex128), ("svd_compact", np.complex128)):
            A = self.herm(5, dtype) if op == "eigh_full" else self.rand((5, 5), dtype)
            out, _ = self.c.augmented_forward(op, {"A": A}, wrt=["A"])
            name = "U" if op == "svd_compact" else "V"
            V = out[name].astype(np.complex128)
            H = self.rand((5, 5), np.complex128)
            w = self.rng.standard_normal(5)
            theta = np.diag(1j * self.rng.standard_normal(5))
            cdt = out[name].dtype
            # the cotangent of L = Σ w_i Re(v_iᴴ H v_i), which no phase changes
            base = {name: (((H + H.conj().T) @ V) * w).astype(cdt)}
            gauged = {name: (base[name] + V @ theta).astype(cdt)}
            if op == "svd_compact":
                base["Vh"] = np.zeros_like(out["Vh"])
                gauged["Vh"] = (-theta @ out["Vh"]).astype(cdt)
            grads = []
            for cot in (base, gauged):
                _, tape = self.c.augmented_forward(op, {"A": A}, wrt=["A"])
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    grads.append(self.c.reverse(tape, cot)["A"].astype(np.complex128))
            err = np.linalg.norm(grads[1] - grads[0]) / np.linalg.norm(grads[0])
            self.assertLessEqual(err, 1e-10 if cdt == np.complex128 else 1e-4, f"{op} {np.dtype(dtype).name}")

    def test_errors(self):
        def code(op, A, options=None, **kw):
            with self.assertRaises(PullbackError) as e:
                self.c.forward(op, {"A": A}, options=options, **kw)
            return e.exception

        self.assertEqual(code("eigh_full", self.rand((3, 4), np.float64)).code, "shape_mismatch")
        self.assertEqual(code("eig_full", self.rand((4, 3), np.float64)).code, "shape_mismatch")
        e = code("eigh_full", self.rand((4, 4), np.float64))
        self.assertEqual(e.code, "invalid_argument")
        self.assertIn("Hermitian", e.message)
        self.assertEqual(code("left_polar", self.rand((3, 5), np.float64)).code, "shape_mismatch")
        self.assertEqual(code("right_polar", self.rand((5, 3), np.float64)).code, "shape_mismatch")
        self.assertEqual(code("qr_compact", self.rand((2, 2, 2), np.float64)).code, "shape_mismatch")
        for op in OPS:
            A = self.rand((4, 3) if op == "left_polar" else (3, 4) if op == "right_polar" else (4, 4), np.float64)
            A[1, 1] = np.nan
            self.assertEqual(code(op, A).code, "numerical_error", op)
            A[1, 1] = np.inf
            self.assertEqual(code(op, A).code, "numerical_error", op)
        self.assertEqual(code("svd_compact", self.rand((3, 3), np.float64), {"rank_tol": 1}).code,
                         "invalid_argument")
        self.assertEqual(code("svd_trunc", self.rand((3, 3), np.float64), {"maxrank": -1}).code, "invalid_argument")
        self.assertEqual(code("svd_compact", self.rand((3, 3), np.float64), {"rank_atol": -1.0}).code,
                         "invalid_argument")
        # cotangent of S of a complex SVD must be real
        A = self.rand((4, 3), np.complex128)
        _, tape = self.c.augmented_forward("svd_compact", {"A": A}, wrt=["A"])
        with self.assertRaises(PullbackError) as e:
            self.c.reverse(tape, {"S": np.ones(3, dtype=np.complex128)}, keep=True)
        self.assertEqual(e.exception.code, "dtype_mismatch")
        with self.assertRaises(PullbackError) as e:
            self.c.reverse(tape, {"U": np.ones((4, 4), dtype=np.complex128)}, keep=True)
        self.assertEqual(e.exception.code, "shape_mismatch")
        tape.release()

    def test_extreme_values(self):
        # A gradient is homogeneous in A's scale: the same at 1e-300 as at 1
        # and 1e300, in every precision (max|A_ij| once overflowed past
        # 1e154 and the default rank_atol passed every singular value
        # below 1e-47: both gave zero gradients, silently).
        for dtype, scales in [(np.float64, [1e-300, 1e-60, 1e160, 1e300]), (np.complex128, [1e-200, 1e200]),
                              (np.float32, [1e-30, 1e30]), (np.complex64, [1e-25, 1e25])]:
            A = self.rand((5, 3), dtype)
            for op, out in [("qr_compact", "R"), ("lq_compact", "L"), ("svd_compact", "S"), ("left_polar", "W")]:
                X = A if op != "lq_compact" else np.ascontiguousarray(A.T)
                o, tape = self.c.augmented_forward(op, {"A": X}, wrt=["A"])
                cot = np.ones_like(o[out])
                g1 = self.c.reverse(tape, {out: cot})["A"].astype(np.complex128)
                for s in scales:
                    o, tape = self.c.augmented_forward(op, {"A": (X * s).astype(dtype)}, wrt=["A"])
                    gs = self.c.reverse(tape, {out: cot})["A"].astype(np.complex128)
                    # R, L, S are 1-homogeneous (gradient scale-free); W is 0-homogeneous
                    want = g1 / s if out == "W" else g1
                    err = np.max(np.abs(gs - want)) / np.max(np.abs(want))
                    self.assertLessEqual(err, 100 * FTOL[dtype], f"{op} {np.dtype(dtype)} at {s:g}")
        # eigh at 1e160: |A - Aᴴ| is measured without overflow
        with self.assertRaises(PullbackError) as e:
            self.c.forward("eigh_full", {"A": np.array([[1.0, 2.0], [0.0, 1.0]]) * 1e160})
        self.assertEqual(e.exception.code, "invalid_argument")
        self.assertIn("reaches 2e+160", e.exception.message)
        # A finite A whose factors overflow is numerical_error naming the
        # output (it was `internal`: LAPACKE refused LAPACK's own Inf)
        for dtype in DTYPES:
            big = np.finfo(dtype).max
            with self.assertRaises(PullbackError) as e:
                self.c.forward("qr_compact", {"A": np.full((2, 2), big, dtype=dtype)})
            self.assertEqual(e.exception.code, "numerical_error", dtype)
            self.assertIn("output R is not finite", e.exception.message)
            # where the factors fit, qr factors: geqrf's Householder step
            # overflowed from half the largest number (alpha - beta) until
            # A was brought to [1, 2) first
            got = self.c.forward("qr_compact", {"A": np.full((2, 1), 0.6 * big, dtype=dtype)})
            np.testing.assert_allclose(np.abs(got["R"].ravel()), [np.sqrt(2) * 0.6 * float(big)], rtol=1e-6)
            np.testing.assert_allclose(np.abs(got["Q"].ravel()), [np.sqrt(0.5)] * 2, rtol=1e-6)
            with self.assertRaises(PullbackError) as e:
                self.c.forward("svd_vals", {"A": np.full((2, 2), big, dtype=dtype)})
            self.assertEqual(e.exception.code, "numerical_error", dtype)
        # Near the largest number the reverse's sums of singular values
        # overflowed into silently wrong gradients (polar 3% off at half of
        # it): augmented_forward refuses such an A; forward still serves it.
        A = self.rand((5, 3), np.float64) / 10 * np.finfo(np.float64).max
        with self.assertRaises(PullbackError) as e:
            self.c.augmented_forward("left_polar", {"A": A}, wrt=["A"])
        self.assertEqual(e.exception.code, "numerical_error")
        self.assertIn("too near the dtype's largest number", e.exception.message)
        self.assertTrue(np.isfinite(self.c.forward("left_polar", {"A": A})["P"]).all())
        # A gradient that overflows from finite A and cotangents is an
        # error, not Inf/NaN handed back; the tape stays
        o, tape = self.c.augmented_forward("qr_compact", {"A": self.rand((5, 3), np.float64)}, wrt=["A"])
        with self.assertRaises(PullbackError) as e:
            self.c.reverse(tape, {"R": np.full((3, 3), 1e308)}, keep=True)
        self.assertEqual(e.exception.code, "numerical_error")
        self.assertIn("gradient is not finite", e.exception.message)
        self.assertTrue(np.isfinite(self.c.reverse(tape, {"R": np.ones((3, 3))})["A"]).all())
        # A NaN or Inf in a cotangent propagates, in eig too (it was a
        # numerical_error blaming a defective A: LAPACKE refused the NaN)
        _, tape = self.c.augmented_forward("eig_full", {"A": np.diag([1.0, 2.0])}, wrt=["A"])
        for bad in (np.nan, np.inf):
            g = self.c.reverse(tape, {"D": np.array([bad, 0], dtype=np.complex128)}, keep=True)["A"]
            self.assertTrue(np.isnan(g).any(), bad)
        tape.release()

    def test_ops_catalogue(self):
        ops = self.c.ops()["ops"]
        for op in OPS:
            self.assertIn(op, ops)
            self.assertEqual(set(ops[op]["dtypes"]), {"f32", "f64", "c64", "c128"})
            self.assertEqual(ops[op]["wrt"], ["A"])
        self.assertIsNone(ops["svd_compact"]["options"]["rank_atol"]["default"])
        self.assertEqual(ops["svd_trunc"]["options"]["rtol"]["default"], 0.0)
        self.assertEqual(ops["qr_compact"]["outputs"], ["Q", "R"])


FAULT_LIB = os.environ.get("PB_LAPACK_FAULT_LIB", "")


@unittest.skipUnless(os.path.exists(FAULT_LIB), "no PB_LAPACK_FAULT_LIB: the LAPACK failure module was not built")
class LapackFailureTest(DaemonCase):
    """LAPACK drivers that fail, end to end: the daemon runs with
    tests/lapack_fault.c preloaded, whose drivers return the info that
    $PB_LAPACK_FAULT names for calls of a given order n (see that file)."""

    DAEMON_ENV = {
        "LD_PRELOAD": FAULT_LIB,
        # an ASan daemon: the module (which links the ASan runtime) comes first
        "ASAN_OPTIONS": ":".join(filter(None, [os.environ.get("ASAN_OPTIONS"), "verify_asan_link_order=0"])),
        "PB_LAPACK_FAULT": "dgesdd/7=4,zgesdd/7=4,dgesdd/6=4,dgesvd/6=2,zgesdd/6=4,zgesvd/6=2,dsyevd/5=3,"
                           "zheevd/5=3,dgeev/5=5,zgeev/5=5,dgeqrf/9=1",
    }

    def setUp(self):
        self.c = pullbackd.Client(self.path, timeout=30)
        self.rng = np.random.default_rng(11)

    def tearDown(self):
        self.c.close()

    def lapack_error(self, op, A, driver, info):
        with self.assertRaises(PullbackError) as e:
            self.c.forward(op, {"A": A})
        self.assertEqual(e.exception.code, "numerical_error", op)
        self.assertEqual(e.exception.details.get("info"), info, op)
        self.assertIn(driver, e.exception.message)
        self.assertIn("did not converge", e.exception.message)

    def test_gesdd_falls_back_to_gesvd(self):
        for dtype in (np.float64, np.complex128):
            A = self.rng.standard_normal((9, 7)).astype(dtype)
            if cx(dtype):
                A = A + 1j * self.rng.standard_normal((9, 7))
            out = self.c.forward("svd_compact", {"A": A})
            U, S, Vh = np.linalg.svd(A, full_matrices=False)
            np.testing.assert_allclose(out["S"], S, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(out["U"] * out["S"] @ out["Vh"], A, atol=1e-12)
            Ug = gauge(U)
            np.testing.assert_allclose(out["U"], Ug if cx(dtype) else Ug.real, atol=1e-10)

    def test_driver_failures(self):
        for dtype in (np.float64, np.complex128):
            A = self.rng.standard_normal((8, 6)).astype(dtype)
            for op in ("svd_compact", "svd_full", "svd_vals", "svd_trunc", "left_polar"):
                self.lapack_error(op, A, "gesvd", 2)
            self.lapack_error("right_polar", A.T.copy(), "gesvd", 2)
            H = A[:5, :5] + A[:5, :5].conj().T
            self.lapack_error("eigh_full", H, "heevd" if cx(dtype) else "syevd", 3)
            self.lapack_error("eigh_vals", H, "heevd" if cx(dtype) else "syevd", 3)
            self.lapack_error("eig_full", A[:5, :5].copy(), "geev", 5)
            self.lapack_error("eig_vals", A[:5, :5].copy(), "geev", 5)
        self.lapack_error("qr_compact", self.rng.standard_normal((10, 9)), "geqrf", 1)
        # the same daemon still answers other sizes
        A = self.rng.standard_normal((4, 4))
        np.testing.assert_allclose(self.c.forward("svd_vals", {"A": A})["S"], np.linalg.svd(A)[1], rtol=1e-12)


if __name__ == "__main__":
    unittest.main(verbosity=2)
