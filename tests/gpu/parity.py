"""GPU against CPU through the daemon: every op the daemon serves on "cuda",
every dtype, activation or option set, memory order and wrt subset, the same inputs on
cuda:0 and on the CPU; forward results and gradients must agree to relative
error 1e-12 (f64, c128) and 1e-5 (f32, c64; 1e-4 for the factorizations, as
their issue has it), measured against the largest element.  A factorization
is compared in what its gauge leaves fixed (eigenvalues, V·diag(D)·Vᴴ) and
its gradients for a gauge-invariant loss that no unitary factor makes
constant: Σ_j w_j·v_jᴴ·G·v_j (V̄ = G·V·diag(w), G Hermitian; for the SVD
the same of U's columns and Vh's rows).

Run against a daemon that has a GPU (tests/gpu/run.sh), or one started with
PULLBACKD_FAKE_CUDA (then the agreement is exact).  Prints one line per op
and dtype with the worst error, and exits 1 on any disagreement.

  python3 tests/gpu/parity.py SOCKET
"""

import itertools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "clients", "python"))
import pullbackd  # noqa: E402

TOL = {np.float64: 1e-12, np.float32: 1e-5, np.complex128: 1e-12, np.complex64: 1e-5}
REAL = (np.float32, np.float64)
ALL = REAL + (np.complex64, np.complex128)


def rand(rng, shape, dtype):
    a = rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        a = a + 1j * rng.standard_normal(shape)
    return a.astype(dtype)


def subsets(names):
    return [w for n in range(1, len(names) + 1) for w in itertools.combinations(names, n)]


def tensor_cases(rng, dtype, inputs_of, option_sets, out_shape):
    """Each option set, with and without C (beta), scalars real and complex."""
    cplx = np.issubdtype(dtype, np.complexfloating)
    for k, (opts, order) in enumerate(itertools.product(option_sets, "CF")):
        inputs = inputs_of(order)
        options = dict(opts)
        options["alpha"] = [0.75, -0.5] if cplx and k % 2 else 1.5
        names = list(inputs) + ["alpha"]
        if k % 3:
            inputs["C"] = rand(rng, out_shape, dtype)
            options["beta"] = [0.25, 0.5] if cplx and k % 2 == 0 else -2.0
            names += ["C", "beta"]
        cot = {"C": rand(rng, out_shape, dtype)}
        yield f"{options} order {order}", inputs, options, cot, order, subsets(names)


def rel(a, b):
    scale = max(float(np.max(np.abs(b))) if b.size else 0.0, 1e-300)
    return float(np.max(np.abs(a - b))) / scale if b.size else 0.0


def fused_dense_cases(rng, dtype):
    for act, order, vector, bias, shape in itertools.product(
            ["identity", "relu", "leakyrelu", "sigmoid", "tanh", "gelu", "gelu_erf", "silu", "softplus", "elu"],
            "CF", (False, True), (False, True), ((33, 17, 9), (256, 128, 64))):
        out, inn, batch = shape
        W = rng.standard_normal((out, inn)).astype(dtype)
        if order == "F":
            W = np.asfortranarray(W)
        x = rng.standard_normal(inn if vector else (inn, batch)).astype(dtype)
        inputs = {"weight": W, "x": x}
        if bias:
            inputs["bias"] = rng.standard_normal(out).astype(dtype)
        yb = rng.standard_normal(out if vector else (out, batch)).astype(dtype)
        wrts = subsets(list(inputs))
        yield f"{act} {order} vector={vector} bias={bias} {shape}", inputs, {"act": act}, {"y": yb}, order, wrts


def hermitian(rng, m, dtype):
    a = rand(rng, (m, m), dtype)
    return ((a + a.conj().T) / 2).astype(dtype)


def with_spectrum(rng, m, n, dtype, values, same=False):
    """Q₁·diag(values)·Q₂ᴴ for random orthonormal Q₁ (m×k), Q₂ (n×k; Q₁ when
    same).  A factorization's pullback divides by gaps and (the SVD) by
    the values: spread ones keep the CPU's and the GPU's rounding within
    the bound, where a Gaussian matrix's near-degenerate pairs amplify it
    (by 1e4 in single precision, measured)."""
    k = len(values)
    q1 = np.linalg.qr(rand(rng, (m, k), np.complex128 if np.iscomplexobj(np.zeros(1, dtype)) else np.float64))[0]
    q2 = q1 if same else np.linalg.qr(rand(rng, (n, k), q1.dtype))[0]
    return ((q1 * values) @ q2.conj().T).astype(dtype)


def eigh_view(out):
    """What eigh's gauge leaves fixed: D, and V·diag(D)·Vᴴ (the kept part)."""
    view = {"D": out["D"]}
    if "V" in out:
        V = out["V"].astype(np.complex128)
        view["V·diag(D)·Vᴴ"] = (V * out["D"]) @ V.conj().T
    return view


def eigh_cases(rng, dtype, maxrank=None):
    for m, order in itertools.product((12, 40), "CF"):
        A = with_spectrum(rng, m, m, dtype, np.linspace(-2, 2, m) + 0.01, same=True)
        A = ((A + A.conj().T) / 2).astype(dtype)
        if order == "F":
            A = np.asfortranarray(A)
        G = hermitian(rng, m, dtype)
        dD = rng.standard_normal(m if maxrank is None else min(m, maxrank))

        def cot(out, G=G, dD=dD):
            c = {"D": dD.astype(out["D"].dtype)}
            if "V" in out:  # Σ_j w_j·v_jᴴ·G·v_j / 2: no gauge part
                w = np.linspace(1, 2, out["V"].shape[1])
                c["V"] = (G @ out["V"] * w).astype(dtype)
            return c
        options = {} if maxrank is None else {"maxrank": maxrank}
        yield f"{m}x{m} order {order}", {"A": A}, options, cot, order, [("A",)]


def svd_view(out):
    """What the SVD's gauge leaves fixed: S, U·diag(S)·Vh and U·Uᴴ."""
    view = {"S": out["S"]}
    if "U" in out:
        U, Vh = out["U"].astype(np.complex128), out["Vh"].astype(np.complex128)
        view["U·diag(S)·Vh"] = (U * out["S"]) @ Vh
        view["U·Uᴴ"] = U @ U.conj().T
    return view


def svd_cases(rng, dtype, maxrank=None):
    # (k values spread over [1, 3] leave gaps of 2/k: the pullbacks amplify
    # the drivers' rounding by about k², so k stays small for the bound)
    for (m, n), order in itertools.product(((12, 7), (7, 12), (40, 12), (16, 16)), "CF"):
        A = with_spectrum(rng, m, n, dtype, np.linspace(3, 1, min(m, n)))
        if order == "F":
            A = np.asfortranarray(A)
        G, H = hermitian(rng, m, dtype), hermitian(rng, n, dtype)
        k = min(m, n) if maxrank is None else min(m, n, maxrank)
        dS = rng.standard_normal(k)

        def cot(out, G=G, H=H, dS=dS):
            c = {"S": dS.astype(out["S"].dtype)}
            if "U" in out:  # Σ_j w_j·(u_jᴴ·G·u_j + v_jᴴ·H·v_j) / 2: no gauge part
                w = np.linspace(1, 2, out["U"].shape[1])
                c["U"] = (G @ out["U"] * w).astype(dtype)
                c["Vh"] = (w[:, None] * out["Vh"] @ H).astype(dtype)
            return c
        options = {} if maxrank is None else {"maxrank": maxrank}
        yield f"{m}x{n} order {order}", {"A": A}, options, cot, order, [("A",)]


def polar_cases(rng, dtype, right=False):
    """The polar factors of a full-rank A are unique: compared as they are,
    with random cotangents."""
    for (m, n), order in itertools.product(((12, 7), (16, 16)), "CF"):
        if right:
            m, n = n, m
        A = with_spectrum(rng, m, n, dtype, np.linspace(3, 1, min(m, n)))
        if order == "F":
            A = np.asfortranarray(A)
        names = ("P", "Wh") if right else ("W", "P")
        shapes = ((m, m), (m, n)) if right else ((m, n), (n, n))
        cot = {k: rand(rng, s, dtype) for k, s in zip(names, shapes)}
        yield f"{m}x{n} order {order}", {"A": A}, {}, cot, order, [("A",)]


def sweep(path):
    """The sweep against the daemon at path: 0, or 1 with the disagreements printed."""
    with pullbackd.Client(path, timeout=120) as c:
        return _sweep(c)


def _sweep(c):
    ops = c.ops()["ops"]
    gpu_ops = sorted(name for name, op in ops.items() if "cuda" in op["devices"])
    print("ops on cuda:", ", ".join(gpu_ops) or "none")
    if not gpu_ops:
        print("FAIL: the daemon serves no op on cuda")
        return 1
    rng = np.random.default_rng(2024)
    bad = 0
    def arr(shape, dtype, order):
        a = rand(rng, shape, dtype)
        return np.asfortranarray(a) if order == "F" else a

    def add_cases(rng_, dtype):
        return tensor_cases(rng_, dtype, lambda o: {"A": arr((3, 4, 5), dtype, o)},
                            [{"pA": [2, 0, 1]}, {"pA": [2, 0, 1], "conjA": True}], (5, 3, 4))

    def trace_cases(rng_, dtype):
        return tensor_cases(rng_, dtype, lambda o: {"A": arr((3, 4, 3, 2), dtype, o)},
                            [{"p": [3, 1], "q": [[0], [2]]}, {"p": [3, 1], "q": [[2], [0]], "conjA": True}], (2, 4))

    def contract_cases(rng_, dtype):
        # TensorOperations' own case: A (2,3,4,2,5), B (4,2,3) -> C (5,2,3,3)
        return tensor_cases(rng_, dtype, lambda o: {"A": arr((2, 3, 4, 2, 5), dtype, o), "B": arr((4, 2, 3), dtype, o)},
                            [{"pA": [[1, 3, 4], [0, 2]], "pB": [[1, 0], [2]], "pAB": [2, 1, 3, 0]},
                             {"pA": [[1, 3, 4], [0, 2]], "pB": [[1, 0], [2]], "pAB": [2, 1, 3, 0], "conjA": True,
                              "conjB": True}], (5, 2, 3, 3))

    makers = {"fused_dense": (fused_dense_cases, REAL), "tensoradd": (add_cases, ALL),
              "tensortrace": (trace_cases, ALL), "tensorcontract": (contract_cases, ALL),
              "eigh_full": (eigh_cases, ALL), "eigh_vals": (eigh_cases, ALL),
              "eigh_trunc": (lambda r, d: eigh_cases(r, d, maxrank=5), ALL),
              "svd_compact": (svd_cases, ALL), "svd_vals": (svd_cases, ALL),
              "svd_trunc": (lambda r, d: svd_cases(r, d, maxrank=5), ALL),
              "left_polar": (polar_cases, ALL), "right_polar": (lambda r, d: polar_cases(r, d, right=True), ALL)}
    views = {"eigh_full": eigh_view, "eigh_vals": eigh_view, "eigh_trunc": eigh_view,
             "svd_compact": svd_view, "svd_vals": svd_view, "svd_trunc": svd_view,
             "left_polar": lambda out: out, "right_polar": lambda out: out}
    factor_tol = {np.float64: 1e-12, np.float32: 1e-4, np.complex128: 1e-12, np.complex64: 1e-4}
    for name in gpu_ops:
        if name not in makers:
            print(f"FAIL: {name} is served on cuda and this sweep has no cases for it")
            bad += 1
            continue
        make, dtypes = makers[name]
        view = views.get(name, lambda out: out)
        for dtype in dtypes:
            tol = (factor_tol if name in views else TOL)[dtype]
            worst, n = 0.0, 0
            for what, inputs, options, cot, order, wrts in make(rng, dtype):
                want_y = c.forward(name, inputs, options=options, order=order)
                got_y = c.forward(name, inputs, options=options, order=order, device="cuda")
                if callable(cot):  # built from the CPU's outputs
                    cot = cot(want_y)
                want_v, got_v = view(want_y), view(got_y)
                for k in want_v:
                    e = rel(got_v[k], want_v[k])
                    worst = max(worst, e)
                    if e > tol:
                        bad += 1
                        print(f"FAIL {name} {dtype.__name__} {what}: forward {k} off by {e:.3g}")
                for wrt in wrts:
                    grads = []
                    for dev in ("cpu", "cuda"):
                        _, tape = c.augmented_forward(name, inputs, wrt=list(wrt), options=options, device=dev,
                                                      order=order)
                        grads.append(c.reverse(tape, cot, order=order))
                    for k in wrt:
                        e = rel(grads[1][k], grads[0][k])
                        worst = max(worst, e)
                        if e > tol:
                            bad += 1
                            print(f"FAIL {name} {dtype.__name__} {what} wrt {wrt}: {k} off by {e:.3g}")
                    n += 1
            print(f"{name} {dtype.__name__}: {n} forward+reverse pairs, worst relative error {worst:.3g}")
    print("PASS" if bad == 0 else f"FAIL: {bad} disagreements")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(sweep(sys.argv[1]))
