"""pullbackd.torch against a pullbackd started here: the daemon's reverse rules
under torch.autograd.gradcheck, backward more than once, tapes released with
the graph, gauge warnings, and a small model trained through a daemon layer
that matches the same model in pure PyTorch.

Exits 77 (skipped), saying why, when torch does not import (Debian:
python3-torch).

Run: PULLBACKD_BIN=build/daemon/pullbackd /usr/bin/python3 tests/python/test_torch.py

gradcheck runs in float64 / complex128 with its default tolerances
(eps 1e-6, atol 1e-5, rtol 1e-3). The training comparison: losses equal to
rtol 1e-12 over 5 SGD steps in float64.
"""

import gc
import os
import subprocess
import sys
import time
import unittest
import unittest.mock
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
sys.path.insert(0, HERE)

try:
    import torch
except Exception as e:  # noqa: BLE001 (ImportError, or a broken install's OSError)
    if __name__ == "__main__":
        print(f"SKIP: torch does not import ({e}); Debian: python3-torch", file=sys.stderr)
        sys.exit(77)
    raise

import pullbackd  # noqa: E402
import pullbackd.torch as pt  # noqa: E402
from daemon_case import DaemonCase, run_in_threads  # noqa: E402

F64, C128 = torch.float64, torch.complex128
ACTS = ["identity", "relu", "leakyrelu", "sigmoid", "tanh", "gelu", "gelu_erf", "silu", "softplus", "elu"]


def rand(*shape, dtype=F64, grad=True, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else hash(shape) % 1000)
    t = torch.randn(*shape, dtype=dtype, generator=g)
    return t.requires_grad_(grad)


def herm(X):
    """The Hermitian part of X: eigh wants a Hermitian A, gradcheck perturbs every entry."""
    return (X + X.mH) / 2


def projector(U):
    """U Uᴴ: invariant under U -> U·(unitary), the gauge of vectors."""
    return U @ U.mH


class TorchCase(DaemonCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.client = pullbackd.Client(cls.path, timeout=60)
        pt.set_default_client(cls.client)

    @classmethod
    def tearDownClass(cls):
        pt.set_default_client(None)
        cls.client.close()
        super().tearDownClass()

    def tapes(self):
        gc.collect()
        self.client.call("hello")  # flushes release notifications deferred while a send was under way
        return self.client.stats()["peer_tapes"]

    def gradcheck(self, fn, inputs, **kw):
        self.assertTrue(torch.autograd.gradcheck(fn, inputs, **kw))


class CatalogueTest(TorchCase):
    def test_every_op_has_a_convenience_with_the_catalogue_outputs(self):
        ops = self.client.ops()["ops"]
        self.assertEqual(set(ops), set(pt.OPS))
        for name, entry in ops.items():
            self.assertEqual(tuple(entry["outputs"]), pt.OPS[name], name)
            self.assertTrue(callable(getattr(pt, name)), name)
            self.assertIn(name, pt.__all__)


class FusedDenseTest(TorchCase):
    def inputs(self, act, vector=False, seed=0):
        """W, x, b with W·x + b away from the kinks of relu, leakyrelu, elu (|z| > 0.05)."""
        while True:
            W, b = rand(3, 4, seed=seed), rand(3, seed=seed + 1)
            x = rand(4, seed=seed + 2) if vector else rand(4, 5, seed=seed + 2)
            z = W @ x + (b if vector else b[:, None])
            if z.abs().min() > 0.05:
                return W, x, b
            seed += 10

    def test_gradcheck_every_activation(self):
        for act in ACTS:
            for vector in (False, True):
                with self.subTest(act=act, vector=vector):
                    W, x, b = self.inputs(act, vector)
                    self.gradcheck(lambda W, x, b: pt.fused_dense(W, x, b, act=act), (W, x, b))

    def test_gradcheck_without_bias_and_only_some_inputs(self):
        W, x, _ = self.inputs("tanh")
        self.gradcheck(lambda W, x: pt.fused_dense(W, x, act="tanh"), (W, x))
        x.requires_grad_(False)
        self.gradcheck(lambda W: pt.fused_dense(W, x, act="tanh"), (W,))

    def test_values_match_torch(self):
        W, x, b = self.inputs("gelu")
        torch_acts = {
            "identity": lambda z: z, "relu": torch.relu,
            "leakyrelu": lambda z: torch.nn.functional.leaky_relu(z, 0.01),
            "sigmoid": torch.sigmoid, "tanh": torch.tanh,
            "gelu": lambda z: torch.nn.functional.gelu(z, approximate="tanh"),
            "gelu_erf": torch.nn.functional.gelu, "silu": torch.nn.functional.silu,
            "softplus": torch.nn.functional.softplus, "elu": torch.nn.functional.elu,
        }
        for act, f in torch_acts.items():
            with self.subTest(act=act):
                ours = pt.fused_dense(W, x, b, act=act)
                ref = f(W @ x + b[:, None])
                torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-13)
                gW, gx, gb = torch.autograd.grad(ours.sin().sum(), (W, x, b))
                rW, rx, rb = torch.autograd.grad(ref.sin().sum(), (W, x, b))
                for a, r in ((gW, rW), (gx, rx), (gb, rb)):
                    torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)

    def test_float32(self):
        W, x, b = (t.detach().float().requires_grad_() for t in self.inputs("sigmoid"))
        y = pt.fused_dense(W, x, b, act="sigmoid")
        self.assertEqual(y.dtype, torch.float32)
        y.sum().backward()
        self.assertEqual(W.grad.dtype, torch.float32)
        ref = torch.sigmoid(W.detach() @ x.detach() + b.detach()[:, None])
        torch.testing.assert_close(y.detach(), ref, rtol=1e-5, atol=1e-6)


class TensorOpsTest(TorchCase):
    def test_gradcheck_tensorcontract_spec(self):
        for dtype in (F64, C128):
            with self.subTest(dtype=dtype):
                A, B = rand(2, 3, 4, dtype=dtype), rand(4, 3, 5, dtype=dtype)
                self.gradcheck(lambda A, B: pt.tensorcontract("ijk,kjl->li", A, B), (A, B))
                ref = torch.einsum("ijk,kjl->li", A, B)
                torch.testing.assert_close(pt.tensorcontract("ijk,kjl->li", A, B), ref, rtol=1e-12, atol=1e-12)

    def test_gradcheck_tensorcontract_axes_conj_alpha_beta(self):
        for dtype in (F64, C128):
            with self.subTest(dtype=dtype):
                A, B, C = rand(3, 4, dtype=dtype), rand(3, 2, dtype=dtype), rand(2, 4, dtype=dtype)
                alpha = torch.tensor(0.7 + (0.2j if dtype == C128 else 0), dtype=dtype, requires_grad=True)
                beta = torch.tensor(-1.3, dtype=F64, requires_grad=True)  # a real parameter

                def f(A, B, C, alpha, beta):
                    return pt.tensorcontract(A, B, C, pA=[[1], [0]], pB=[[0], [1]], pAB=[1, 0],
                                             conjA=True, alpha=alpha, beta=beta)

                self.gradcheck(f, (A, B, C, alpha, beta))
                ref = beta * C + alpha * (A.conj().T @ B).T
                torch.testing.assert_close(f(A, B, C, alpha, beta), ref, rtol=1e-12, atol=1e-12)
                _, _, _, _, gbeta = torch.autograd.grad(f(A, B, C, alpha, beta).abs().sum(), (A, B, C, alpha, beta))
                self.assertEqual(gbeta.dtype, F64)  # a real parameter's gradient is real

    def test_gradcheck_tensoradd_and_tensortrace(self):
        for dtype in (F64, C128):
            with self.subTest(dtype=dtype):
                A, C = rand(2, 3, 4, dtype=dtype), rand(4, 2, 3, dtype=dtype)
                self.gradcheck(lambda A, C: pt.tensoradd(A, C, pA=[2, 0, 1], alpha=2.0, beta=0.5), (A, C))
                T = rand(3, 2, 3, 4, dtype=dtype)
                self.gradcheck(lambda T: pt.tensortrace(T, p=[1, 3], q=[[0], [2]]), (T,))
                torch.testing.assert_close(pt.tensortrace(T, p=[1, 3], q=[[0], [2]]),
                                           torch.einsum("iaib->ab", T), rtol=1e-12, atol=1e-12)


class FactorizationTest(TorchCase):
    """Every factorization under gradcheck, real and complex, with a gauge-invariant loss."""

    # op -> (shape of A, what of its outputs the loss sees: gauge invariant, unique for a generic A)
    CASES = {
        "qr_compact": ((5, 3), lambda Q, R: (Q, R)),
        "qr_full": ((5, 3), lambda Q, R: (Q[:, :3], R)),
        "qr_null": ((5, 3), lambda N: projector(N)),
        "lq_compact": ((3, 5), lambda L, Q: (L, Q)),
        "lq_full": ((3, 5), lambda L, Q: (L, Q[:3])),
        "lq_null": ((3, 5), lambda N: projector(N.mH)),
        "eigh_full": ((4, 4), lambda D, V: (D, V @ torch.diag(D.sin()).to(V.dtype) @ V.mH)),
        "eigh_vals": ((4, 4), lambda D: D),
        "eigh_trunc": ((4, 4), lambda D, V: (D, V @ torch.diag(D).to(V.dtype) @ V.mH)),
        "eig_full": ((4, 4), lambda D, V: (D, V.abs() ** 2)),
        "eig_vals": ((4, 4), lambda D: D),
        "svd_compact": ((5, 3), lambda U, S, Vh: (S, projector(U), (U * S.to(U.dtype)) @ Vh)),
        "svd_full": ((3, 5), lambda U, S, Vh: (S, (U * S.to(U.dtype)) @ Vh[:3])),
        "svd_vals": ((5, 3), lambda S: S),
        "svd_trunc": ((5, 4), lambda U, S, Vh: (S, (U * S.to(U.dtype)) @ Vh)),
        "left_polar": ((5, 3), lambda W, P: (W, P)),
        "right_polar": ((3, 5), lambda P, Wh: (P, Wh)),
    }
    OPTIONS = {"eigh_trunc": {"maxrank": 2}, "svd_trunc": {"maxrank": 2}}

    def test_cases_cover_the_factorizations(self):
        self.assertEqual(set(self.CASES), set(pt.OPS) - {"fused_dense", "tensorcontract", "tensoradd", "tensortrace"})

    def test_gradcheck_every_factorization(self):
        for op, (shape, loss) in self.CASES.items():
            for dtype in (F64, C128):
                with self.subTest(op=op, dtype=dtype):
                    A = rand(*shape, dtype=dtype, seed=7)
                    fn = getattr(pt, op)
                    prep = herm if op.startswith("eigh") else (lambda X: X)
                    opts = self.OPTIONS.get(op, {})

                    def f(A):
                        out = fn(prep(A), **opts)
                        return loss(*out) if isinstance(out, tuple) else loss(out)

                    with warnings.catch_warnings():
                        warnings.simplefilter("error", pullbackd.GaugeWarning)  # the losses are invariant
                        self.gradcheck(f, (A,))

    def test_outputs_are_the_factorization(self):
        A = rand(5, 3, dtype=C128, grad=False)
        Q, R = pt.qr_compact(A)
        torch.testing.assert_close(Q @ R, A, rtol=1e-12, atol=1e-12)
        U, S, Vh = pt.svd_compact(A)
        self.assertEqual(S.dtype, F64)
        torch.testing.assert_close((U * S.to(C128)) @ Vh, A, rtol=1e-12, atol=1e-12)
        D, V = pt.eig_full(A[:3].real.contiguous())
        self.assertEqual(D.dtype, C128)

    def test_gauge_dependent_loss_warns(self):
        A = rand(4, 3, dtype=C128, seed=3)
        U, S, Vh = pt.svd_compact(A)
        with self.assertWarns(pullbackd.GaugeWarning) as w:
            U.imag.sum().backward()  # the phase of each column of U is a gauge
        self.assertIn("gauge", str(w.warning))

    def test_strict_gauge_raises_from_backward(self):
        A = rand(4, 3, dtype=C128, seed=3)
        U, S, Vh = pt.svd_compact(A, strict_gauge=True)
        with self.assertRaises(pullbackd.PullbackError) as e:
            U.imag.sum().backward()
        self.assertEqual(e.exception.code, "gauge_dependent")

    def test_daemon_errors_raise(self):
        with self.assertRaises(pullbackd.PullbackError) as e:
            pt.eigh_full(rand(3, 4))
        self.assertEqual(e.exception.code, "shape_mismatch")


class TapeLifeTest(TorchCase):
    def test_backward_twice_with_retain_graph(self):
        before = self.tapes()
        W, x = rand(3, 4), rand(4, 2)
        y = pt.fused_dense(W, x, act="tanh")
        self.assertEqual(self.tapes(), before + 1)
        y.sum().backward(retain_graph=True)
        g1 = W.grad.clone()
        self.assertEqual(self.tapes(), before + 1)  # kept for the next backward
        y.sum().backward()
        torch.testing.assert_close(W.grad, 2 * g1, rtol=0, atol=0)
        self.assertEqual(self.tapes(), before)  # the graph's saved state is freed: tape released
        with self.assertRaises(RuntimeError):  # PyTorch's own error, not the daemon's
            y.sum().backward()

    def test_tape_released_when_the_graph_is_dropped_unused(self):
        before = self.tapes()
        W = rand(3, 4)
        outs = [pt.svd_compact(W) for _ in range(3)]
        self.assertEqual(self.tapes(), before + 3)
        del outs
        self.assertEqual(self.tapes(), before)

    def test_one_backward_releases_at_once(self):
        before = self.tapes()
        W, x = rand(3, 4), rand(4, 2)
        pt.fused_dense(W, x).sum().backward()
        self.assertEqual(self.tapes(), before)

    def test_no_tape_without_grad(self):
        before = self.tapes()
        W, x = rand(3, 4), rand(4, 2)
        with torch.no_grad():
            y = pt.fused_dense(W, x)
        self.assertFalse(y.requires_grad)
        y2 = pt.fused_dense(W.detach(), x.detach())
        self.assertFalse(y2.requires_grad)
        self.assertEqual(self.tapes(), before)
        torch.testing.assert_close(y, W.detach() @ x.detach(), rtol=1e-12, atol=1e-12)

    def test_wrt_is_exactly_what_requires_grad(self):
        W, x = rand(3, 4), rand(4, 2, grad=False)
        y = pt.fused_dense(W, x)
        self.assertEqual(y.grad_fn.wrt, ["weight"])
        y.sum().backward()
        self.assertIsNone(x.grad)
        self.assertIsNotNone(W.grad)


class OnceDifferentiableTest(TorchCase):
    """The rules are differentiable once, and say so: a second derivative
    raises instead of coming out silently wrong (torch's once_differentiable
    handed the gradients back as constants when the incoming gradient did
    not require grad: a zero Hessian, a gradient penalty that added
    nothing), and so does forward-mode AD (the tangent was dropped)."""

    def test_hessian_and_gradient_penalty_raise(self):
        x = rand(3, 4, grad=False)
        with self.assertRaisesRegex(RuntimeError, "differentiable once"):
            torch.autograd.functional.hessian(lambda W: pt.fused_dense(W, x, act="tanh").sum(), rand(2, 3))
        W = rand(2, 3)
        (g,) = torch.autograd.grad(pt.fused_dense(W, x, act="tanh").sum(), W, create_graph=True)
        with self.assertRaisesRegex(RuntimeError, "differentiable once"):
            (g ** 2).sum().backward()
        A = rand(4, 4)
        with self.assertRaisesRegex(RuntimeError, "differentiable once"):
            torch.autograd.functional.hessian(lambda A: pt.eigh_vals(herm(A)).max(), A)

    def test_first_derivative_with_create_graph_is_right(self):
        W, x = rand(2, 3), rand(3, 4, grad=False)
        (g,) = torch.autograd.grad(pt.fused_dense(W, x, act="tanh").sum(), W, create_graph=True)
        y = torch.tanh(W.detach() @ x)
        torch.testing.assert_close(g.detach(), (1 - y ** 2) @ x.T, rtol=1e-12, atol=1e-13)

    def test_derivatives_through_the_cotangent_raise(self):
        """torch.autograd.functional.jvp differentiates a backward with
        respect to its incoming gradient: that came out zero (a derivative
        that never reached the raising node counted as unused), and so did
        any derivative through a cotangent that requires grad."""
        x = rand(3, 4, grad=False)
        with self.assertRaisesRegex(RuntimeError, "differentiable once"):
            torch.autograd.functional.jvp(lambda W: pt.fused_dense(W, x, act="tanh"), rand(2, 3), rand(2, 3))
        with self.assertRaisesRegex(RuntimeError, "differentiable once"):
            torch.autograd.functional.jvp(pt.svd_vals, rand(3, 3), rand(3, 3))
        A, theta = rand(3, 3), torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
        (gA,) = torch.autograd.grad((pt.svd_vals(A) * theta).sum(), A, create_graph=True)
        with self.assertRaisesRegex(RuntimeError, "differentiable once"):
            torch.autograd.grad(gA.square().sum(), theta, allow_unused=True)

    def test_forward_ad_raises(self):
        import torch.autograd.forward_ad as fwAD
        W, x = rand(2, 3, grad=False), rand(3, 4, grad=False)
        with fwAD.dual_level():
            dual = fwAD.make_dual(W, torch.ones_like(W))
            with self.assertRaisesRegex(RuntimeError, "forward-mode AD tangent"):
                pt.fused_dense(dual, x)

    def test_functorch_transforms_raise(self):
        """vmap and grad hand the op wrapped tensors without storage: a
        clear refusal at the call, not numpy's error about data pointers
        or functorch's about saved tensor hooks."""
        try:
            import functorch
        except ImportError:
            self.skipTest("no functorch")
        W, xs = rand(2, 3, grad=False), rand(5, 3, 4, grad=False)
        with self.assertRaisesRegex(RuntimeError, "input 'x' is a tensor of a functorch transform"):
            functorch.vmap(lambda x: pt.fused_dense(W, x))(xs)
        with self.assertRaisesRegex(RuntimeError, "input 'weight' is a tensor of a functorch transform"):
            functorch.grad(lambda W: pt.fused_dense(W, xs[0]).sum())(W)
        # A plain tensor captured inside a transform is no transform's.
        got = functorch.vmap(lambda s: pt.fused_dense(W, xs[0]).sum() * s)(torch.ones(2, dtype=torch.float64))
        self.assertEqual(got.shape, (2,))

    def test_batched_gradients_raise(self):
        """A batch of incoming gradients (is_grads_batched, a vectorized
        jacobian) is refused with what to use instead, not torch's error
        about a batching rule for detach; unbatched, the same works."""
        A = rand(4, 3)
        eye = torch.eye(3, dtype=torch.float64)
        with self.assertRaisesRegex(RuntimeError, "one gradient at a time"):
            torch.autograd.grad(pt.svd_vals(A), A, eye, is_grads_batched=True)
        with self.assertRaisesRegex(RuntimeError, "vectorize=False"):
            torch.autograd.functional.jacobian(pt.svd_vals, A.detach(), vectorize=True)
        J = torch.autograd.functional.jacobian(pt.svd_vals, A.detach())
        self.assertEqual(J.shape, (3, 4, 3))
        with self.assertRaisesRegex(RuntimeError, "jvp"):
            torch.autograd.functional.jvp(pt.svd_vals, A.detach(), torch.ones_like(A))

    def test_layouts_and_clients_are_checked(self):
        for t in (torch.eye(3, dtype=torch.float64).to_sparse(), torch.eye(3, dtype=torch.float64).to_sparse_csr()):
            with self.assertRaisesRegex(TypeError, "input 'A' has layout .*to_dense"):
                pt.svd_compact(t)
        with self.assertRaisesRegex(TypeError, "client must be a pullbackd.Client, not int"):
            pt.svd_compact(torch.eye(3, dtype=torch.float64), client=5)

    def test_ttl_s_in_the_conveniences(self):
        W, x = rand(2, 3), rand(3, 4, grad=False)
        y = pt.fused_dense(W, x, ttl_s=0.05)
        S = pt.svd_vals(rand(3, 3), ttl_s=0.05)
        time.sleep(1.2)
        for out in (y, S):
            with self.assertRaises(pullbackd.PullbackError) as e:
                out.sum().backward()
            self.assertEqual(e.exception.code, "unknown_tape")


class ReconnectTest(DaemonCase):
    """The default client is made again once its connection broke: after a
    message over max_message_bytes (parse_error, then the daemon closes) it
    used to fail every later call with a bare BrokenPipeError."""
    DAEMON_ARGS = ["--max-message-bytes", "1M"]

    def test_default_client_reconnects_after_the_daemon_closed_it(self):
        # to where the client it replaces was connected, not the default path
        nowhere = os.path.join(os.path.dirname(self.path), "nowhere.sock")
        with unittest.mock.patch.dict(os.environ, {"PULLBACKD_SOCKET": nowhere}):
            pt.set_default_client(pullbackd.Client(self.path, timeout=20))
            try:
                W = rand(2, 3)
                first = pt.default_client()
                big = rand(3, 200000, grad=False)  # 4.8 MB, over the 1 MiB limit
                with self.assertRaises(pullbackd.PullbackError) as e:
                    pt.fused_dense(W, big)
                self.assertEqual(e.exception.code, "parse_error")
                self.assertTrue(first.closed)
                x = rand(3, 4, grad=False)
                y = pt.fused_dense(W, x)
                self.assertIsNot(pt.default_client(), first)
                torch.testing.assert_close(y.detach(), W.detach() @ x, rtol=1e-12, atol=1e-13)
            finally:
                c = pt.default_client()
                pt.set_default_client(None)
                c.close()


class ApiTest(TorchCase):
    def test_call_returns_a_dict(self):
        A = rand(4, 3)
        out = pt.call("svd_compact", {"A": A})
        self.assertEqual(list(out), ["U", "S", "Vh"])
        self.assertTrue(all(t.requires_grad for t in out.values()))
        out = pt.call("fused_dense", {"weight": A.T, "x": A[:, 0]}, {"act": "relu"}, client=self.client)
        self.assertEqual(list(out), ["y"])

    def test_refusals(self):
        with self.assertRaises(TypeError):
            pt.fused_dense(torch.ones(2, 2, dtype=torch.int64), torch.ones(2))
        with self.assertRaises(TypeError):
            pt.fused_dense(torch.ones(2, 2, dtype=torch.float16), torch.ones(2, dtype=torch.float16))

    def test_threads_share_the_default_client(self):
        W = rand(6, 5, grad=False)

        def work(seed):
            for i in range(20):
                x = rand(5, 3, seed=seed * 100 + i)
                y = pt.fused_dense(W, x, act="tanh")
                (gx,) = torch.autograd.grad(y.sum(), x)
                torch.testing.assert_close(y, torch.tanh(W @ x), rtol=1e-12, atol=1e-13)
                torch.testing.assert_close(gx, W.T @ (1 - y.detach() ** 2), rtol=1e-12, atol=1e-13)

        self.assertEqual(run_in_threads(work, 4), [])

    def test_default_client_from_the_environment(self):
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import torch, pullbackd.torch as pt;"
                "A = torch.eye(2, dtype=torch.float64, requires_grad=True);"
                "pt.svd_vals(A).sum().backward(); print(A.grad.tolist())")
        got = subprocess.run([sys.executable, "-c", code, os.path.join(HERE, "..", "..", "clients", "python")],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PULLBACKD_SOCKET": self.path})
        self.assertEqual(got.returncode, 0, got.stderr)
        self.assertEqual(got.stdout.strip(), "[[1.0, 0.0], [0.0, 1.0]]")


class DaemonDense(torch.nn.Module):
    """A dense layer whose forward and backward run in the daemon (x is batch×in, as in torch)."""

    def __init__(self, linear, act):
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.detach().clone())
        self.bias = torch.nn.Parameter(linear.bias.detach().clone())
        self.act = act

    def forward(self, x):
        return pt.fused_dense(self.weight, x.T, self.bias, act=self.act).T


class TrainingTest(TorchCase):
    def test_daemon_model_trains_like_torch(self):
        torch.manual_seed(0)
        l1, l2 = torch.nn.Linear(6, 8).double(), torch.nn.Linear(8, 2).double()
        reference = torch.nn.Sequential(l1, torch.nn.GELU(approximate="tanh"), l2)
        daemon = torch.nn.Sequential(DaemonDense(l1, "gelu"), DaemonDense(l2, "identity"))
        X, Y = torch.randn(16, 6, dtype=F64), torch.randn(16, 2, dtype=F64)
        before = self.tapes()
        losses = {}
        for name, model in (("torch", reference), ("daemon", daemon)):
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            losses[name] = []
            for _ in range(5):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(X), Y)
                loss.backward()
                opt.step()
                losses[name].append(loss.item())
        torch.testing.assert_close(torch.tensor(losses["daemon"]), torch.tensor(losses["torch"]),
                                   rtol=1e-12, atol=0)
        self.assertLess(losses["daemon"][-1], losses["daemon"][0])
        for p, q in zip(daemon.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-11, atol=1e-12)
        del loss
        self.assertEqual(self.tapes(), before)


if __name__ == "__main__":
    unittest.main()
