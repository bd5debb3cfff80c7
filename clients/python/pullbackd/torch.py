"""pullbackd's ops as PyTorch autograd functions.

``call(op, inputs, options=None, client=None)`` runs one op of the daemon on
a dict of CPU tensors and returns a dict of output tensors. When some
inputs require grad (and grad mode is on), it sends ``augmented_forward``
with exactly those inputs in ``wrt``; ``loss.backward()`` then sends
``reverse`` with ``keep: true``, so backward may run more than once on one
graph (``retain_graph=True``, ``torch.autograd.gradcheck``). The tape is
released (a ``release`` notification) as soon as PyTorch frees the graph's
saved state: after a backward without ``retain_graph``, or when the graph
is dropped unused. With no input requiring grad a plain ``forward`` is
sent and no tape is kept.

Named conveniences exist for every op in the catalogue: ``fused_dense``,
``tensorcontract`` (an einsum spec such as ``"ij,jk->ik"``), ``tensoradd``,
``tensortrace``, ``qr_compact`` ... ``right_polar``; they return one tensor
for a single-output op and a tuple in the catalogue's output order
otherwise (``Q, R = qr_compact(A)``, ``U, S, Vh = svd_compact(A)``).

Dtypes: float32, float64, complex64, complex128 (fused_dense is real
only). Complex gradients follow the contract, which is PyTorch's
convention (the gradient G of a complex z has dL = Re Σ conj(G)·dz), so
they pass through unchanged. ``alpha`` and ``beta`` of the tensor ops may
be tensors that require grad. Gauge warnings from ``reverse`` are issued
with ``warnings.warn`` as ``pullbackd.GaugeWarning``; errors raise
``pullbackd.PullbackError``. CPU tensors only.

The default client is one connection per process to the contract's
socket (``$PULLBACKD_SOCKET``, ...), made on first use, and made again in
a forked child or once the connection broke (the daemon restarted, or
closed it after a parse error); see ``default_client`` and
``set_default_client``. Threads may share a client.

The rules are differentiable once: a backward with ``create_graph=True``
(a gradient penalty, ``torch.autograd.functional.hessian``) gives
gradients that raise when differentiated again, and forward-mode AD
(``torch.autograd.forward_ad``, jvp) raises at the call, and so do
functorch's transforms (vmap, grad, jacrev) and a batch of incoming
gradients (``is_grads_batched=True``, ``jacobian(vectorize=True)``).
"""

import os
import re
import threading

import numpy as np
import torch

import pullbackd as _pb

__all__ = [
    "call", "default_client", "set_default_client", "OPS",
    "fused_dense", "tensorcontract", "tensoradd", "tensortrace",
    "qr_compact", "qr_full", "qr_null", "lq_compact", "lq_full", "lq_null",
    "eigh_full", "eigh_vals", "eigh_trunc", "eig_full", "eig_vals",
    "svd_compact", "svd_full", "svd_vals", "svd_trunc", "left_polar", "right_polar",
]

# op -> its outputs, in the catalogue's order (what the conveniences return).
OPS = {
    "fused_dense": ("y",),
    "tensorcontract": ("C",), "tensoradd": ("C",), "tensortrace": ("C",),
    "qr_compact": ("Q", "R"), "qr_full": ("Q", "R"), "qr_null": ("N",),
    "lq_compact": ("L", "Q"), "lq_full": ("L", "Q"), "lq_null": ("N",),
    "eigh_full": ("D", "V"), "eigh_vals": ("D",), "eigh_trunc": ("D", "V"),
    "eig_full": ("D", "V"), "eig_vals": ("D",),
    "svd_compact": ("U", "S", "Vh"), "svd_full": ("U", "S", "Vh"), "svd_vals": ("S",),
    "svd_trunc": ("U", "S", "Vh"),
    "left_polar": ("W", "P"), "right_polar": ("P", "Wh"),
}

_SCALAR_OPTIONS = ("alpha", "beta")  # options that may be differentiable tensors
_TORCH_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)

_default = None
_default_pid = None
_default_lock = threading.Lock()


def default_client():
    """The process's default Client, connected on first use (again if it was closed or its
    connection broke, or in a forked child)."""
    global _default, _default_pid
    with _default_lock:
        if _default is None or _default.closed or _default_pid != os.getpid():
            old = _default
            if old is not None and _default_pid == os.getpid():
                old.close()  # broken: its socket goes
            # a replacement connects where the one it replaces did (set_default_client's path and timeout)
            _default = _pb.Client(old.path, old.timeout) if old is not None else _pb.Client()  # a fork's child never writes on its parent's connection
            _default_pid = os.getpid()
        return _default


def set_default_client(client):
    """Use ``client`` (a pullbackd.Client, or None to reconnect lazily) for calls that name none."""
    global _default, _default_pid
    with _default_lock:
        _default, _default_pid = client, os.getpid()


def _lock(client):
    """The lock that makes one request and its reply on client a unit (dict.setdefault is atomic)."""
    return client.__dict__.setdefault("_torch_call_lock", threading.RLock())


def _to_numpy(name, t):
    """A CPU tensor (or numpy array) as a numpy array the wire codec takes."""
    if isinstance(t, np.ndarray):
        return t
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"input {name!r} must be a torch.Tensor, not {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"input {name!r} has layout {t.layout}: pullbackd.torch takes dense tensors "
                        "(.to_dense() makes one)")
    if t.device.type != "cpu":
        raise ValueError(f"input {name!r} is on {t.device}: pullbackd.torch takes CPU tensors only")
    if t.dtype not in _TORCH_DTYPES:
        raise TypeError(f"input {name!r} is {t.dtype}: pullbackd takes float32, float64, complex64 or complex128")
    return t.detach().resolve_conj().resolve_neg().numpy()


def _to_torch(arr):
    """A reply array (a read-only view of the received bytes) as a tensor of its own."""
    return torch.from_numpy(np.array(arr, copy=True))


def _scalar_value(name, t):
    """A differentiable alpha/beta tensor as the option's wire value (real, or complex as [re, im])."""
    if t.numel() != 1:
        raise ValueError(f"option {name!r} must be a scalar tensor, not of shape {tuple(t.shape)}")
    v = t.detach().resolve_conj().reshape(()).item()
    return complex(v) if t.is_complex() else float(v)


class _Releaser:
    """Held by the graph's saved state; releasing it releases the tape."""

    __slots__ = ("tape",)

    def __init__(self, tape):
        self.tape = tape

    def __del__(self):
        tape = self.tape
        if tape is not None and not tape._done:
            tape._done = True
            try:
                tape.client._release_later(tape.handle)
            except Exception:
                pass


class _Spec:
    """What a call passes to the autograd function beside the tensors, and what it gets back."""

    def __init__(self, client, op, names, options, scalars, ttl_s, device):
        self.client = client
        self.device = device  # the daemon's device the op runs on (None: its default)
        self.op = op
        self.names = names  # input names (then alpha/beta), in the order of the tensors
        self.options = options  # options without the differentiable scalars
        self.scalars = scalars  # names among `names` that are options
        self.ttl_s = ttl_s
        self.out_names = None  # set by forward
        self.releaser = None


def _wire(names, tensors, options, scalars):
    """(inputs, options) as the client sends them: scalar inputs (alpha,
    beta) become options, the rest numpy arrays."""
    inputs, options = {}, dict(options)
    for name, t in zip(names, tensors):
        if name in scalars:
            options[name] = _scalar_value(name, t)
        else:
            inputs[name] = _to_numpy(name, t)
    return inputs, options


try:
    from torch._C import _functions as _torch_functions
    _DelayedError = _torch_functions.DelayedError
except (ImportError, AttributeError):  # not in this torch: a second derivative raises at once instead
    _DelayedError = None

_TWICE = ("pullbackd's rules are differentiable once: a second derivative through pullbackd.torch "
          "(create_graph=True: a gradient penalty, a Hessian; torch.autograd.functional.jvp, which "
          "differentiates a backward) is not supported")


def _once_differentiable(backward):
    """torch's once_differentiable, made strict: with create_graph=True (grad
    mode on in backward) the gradients depend on the inputs even where the
    incoming gradients do not require grad, and torch's version handed them
    back as constants (a Hessian came out zero, a gradient penalty added
    nothing, without an error). Here they come out of a node that raises
    when differentiated, and that node hangs on the inputs (ctx.diff_inputs)
    and on the incoming gradients that require grad too, so that a
    derivative with respect to either reaches it (one with respect to the
    incoming gradient, as torch.autograd.functional.jvp takes, came out
    zero: unused)."""
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled() or all(o is None for o in outputs):
            return outputs
        if _DelayedError is None:
            raise RuntimeError(_TWICE)
        ins = ctx.diff_inputs + tuple(g for g in grads if g is not None and g.requires_grad)
        err = _DelayedError(_TWICE.encode(), len(outputs) + len(ins))

        def alias(o):
            if o is None:
                return None
            o = o.detach()
            o.requires_grad = True
            return o
        return tuple(err(*[alias(o) for o in outputs], *ins)[:len(outputs)])
    return wrapper


def _no_tangents(tensors):
    """Forward-mode AD would drop the tangents silently (forward runs on
    numpy): refuse a dual tensor."""
    fwd = torch.autograd.forward_ad
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and fwd.unpack_dual(t).tangent is not None:
            raise RuntimeError(f"input {name!r} carries a forward-mode AD tangent: pullbackd.torch has reverse "
                               "rules only (no jvp)")


def _transformed(t):
    """Whether t is a tensor of a batching or functorch transform: a
    wrapper without storage of its own, which the wire cannot send.
    functorch's (vmap, grad, jacrev) say so themselves; the batches of
    torch.autograd's own vmap (is_grads_batched, jacobian(vectorize=True)
    in torch 1.13) carry the Batched dispatch key."""
    if not isinstance(t, torch.Tensor):
        return False
    wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    if wrapped is not None and wrapped(t):
        return True
    keys = getattr(torch._C, "_dispatch_keys", None)
    return keys is not None and "Batched" in re.findall(r"\w+", str(keys(t)))


def _no_batched_grads(grads):
    """A batch of incoming gradients (torch.autograd.grad with
    is_grads_batched=True, jacobian(vectorize=True), gradcheck's
    check_batched_grad): refuse it with what to use instead (it failed
    inside torch, "Batching rule not implemented for aten::detach")."""
    if any(_transformed(g) for g in grads):
        raise RuntimeError("pullbackd.torch's backward takes one gradient at a time, not a batch of them: "
                           "use torch.autograd.grad without is_grads_batched (a loop over the batch), "
                           "jacobian(vectorize=False), gradcheck(check_batched_grad=False)")


def _no_functorch(tensors):
    """functorch's transforms (vmap, grad, jacrev ...) hand an op wrapped
    tensors without storage of their own, which the wire cannot send (the
    error was "Cannot access data pointer of Tensor that doesn't have
    storage"): refuse them with what to use instead."""
    for name, t in tensors.items():
        if _transformed(t):
            raise RuntimeError(f"input {name!r} is a tensor of a functorch transform (vmap, grad, jacrev ...): "
                               "pullbackd.torch runs on plain tensors; take gradients with torch.autograd "
                               "(backward, torch.autograd.grad, gradcheck) and batch with a loop or the op's "
                               "own batch dimension")


class _DaemonOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, *tensors):
        inputs, options = _wire(spec.names, tensors, spec.options, spec.scalars)
        wrt = [n for n, need in zip(spec.names, ctx.needs_input_grad[1:]) if need]
        client = spec.client
        with _lock(client):
            outputs, tape = client.augmented_forward(spec.op, inputs, wrt=wrt, options=options or None,
                                                     ttl_s=spec.ttl_s, device=spec.device)
        spec.out_names = list(outputs)
        ctx.spec, ctx.tape, ctx.wrt = spec, tape, wrt
        ctx.in_meta = [(t.dtype, t.shape) for t in tensors]
        # what a second derivative would be taken with respect to (_once_differentiable)
        ctx.diff_inputs = tuple(t for t, need in zip(tensors, ctx.needs_input_grad[1:]) if need)
        ctx.set_materialize_grads(False)
        # The tape goes with the graph's saved state (the pack hook in call takes the releaser):
        # PyTorch frees that after a backward without retain_graph, or with the graph.
        spec.releaser = _Releaser(tape)
        ctx.save_for_backward(torch.empty(0))
        return tuple(_to_torch(outputs[n]) for n in spec.out_names)

    @staticmethod
    @_once_differentiable
    def backward(ctx, *grads):
        ctx.saved_tensors  # raises PyTorch's own error if the graph was freed
        _no_batched_grads(grads)
        spec, tape = ctx.spec, ctx.tape
        cot = {n: _to_numpy(n, g) for n, g in zip(spec.out_names, grads) if g is not None}
        if not cot:
            return (None,) * (1 + len(spec.names))
        with _lock(spec.client):
            got = spec.client.reverse(tape, cot, keep=True)
        result = [None]
        for name, (dtype, shape) in zip(spec.names, ctx.in_meta):
            if name not in got:
                result.append(None)
                continue
            g = _to_torch(got[name])
            if name in spec.scalars:
                if not dtype.is_complex and g.is_complex():
                    g = g.real  # a real parameter's gradient is the real part (the contract sends it so)
                g = g.to(dtype).reshape(shape)
            result.append(g)
        return tuple(result)


def _unpack_hook(packed):
    return packed[0]


def call(op, inputs, options=None, client=None, *, ttl_s=None, device=None):
    """Run ``op`` on ``inputs`` (name -> CPU tensor); a dict of output tensors.

    Differentiable in every input that requires grad; ``options`` are the
    op's options as the contract names them (``alpha``/``beta`` may be
    scalar tensors, differentiable too). ``client`` defaults to
    default_client(). ``ttl_s`` bounds how long the tape waits unused
    (the daemon's default is 600 s). ``device`` is where the daemon runs
    the op: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (None: the daemon's
    default); the tensors stay CPU tensors here, and on a GPU the tape
    stays in the daemon's device memory.
    """
    if client is not None and not isinstance(client, _pb.Client):
        raise TypeError(f"client must be a pullbackd.Client, not {type(client).__name__}")
    client = client or default_client()
    inputs = {k: v for k, v in inputs.items() if v is not None}
    options = {k: v for k, v in (options or {}).items() if v is not None}
    scalars = [k for k in _SCALAR_OPTIONS if isinstance(options.get(k), torch.Tensor)]
    tensors = dict(inputs)
    for k in scalars:
        tensors[k] = options.pop(k)
    for k, v in options.items():
        if isinstance(v, torch.Tensor):
            raise TypeError(f"option {k!r} may not be a tensor")
    _no_tangents(tensors)
    _no_functorch(tensors)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors.values())
    if not needs_grad:
        wire_inputs, wire_options = _wire(list(tensors), list(tensors.values()), options, set(scalars))
        with _lock(client):
            outputs = client.forward(op, wire_inputs, options=wire_options or None, device=device)
        return {k: _to_torch(v) for k, v in outputs.items()}
    names = list(tensors)
    args = [torch.from_numpy(t) if isinstance(t, np.ndarray) else t for t in tensors.values()]
    spec = _Spec(client, op, names, options, set(scalars), ttl_s, device)
    # The tape's releaser rides on the one tensor the function saves, so it lives exactly as long
    # as the graph's saved state: PyTorch drops that after a backward without retain_graph, or
    # with the graph. forward puts the releaser on spec before it saves; the pack hook takes it.
    packed = []

    def pack(t):
        packed.append(True)
        return (t, spec.releaser)

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack_hook):
        outs = _DaemonOp.apply(spec, *args)
    releaser, spec.releaser = spec.releaser, None
    if not packed and outs and outs[0].grad_fn is not None:
        outs[0].grad_fn._pullbackd_releaser = releaser  # no hook ran: keep it with the node itself
    return dict(zip(spec.out_names, outs))


# -- named conveniences ------------------------------------------------


def _outputs(op, got):
    names = OPS[op]
    return got[names[0]] if len(names) == 1 else tuple(got[n] for n in names)


def fused_dense(weight, x, bias=None, act="identity", client=None, *, ttl_s=None, device=None):
    """``act.(weight @ x .+ bias)`` (LuxLib's fused_dense_bias_activation); x is in×batch or a vector.

    act: identity, relu, leakyrelu, sigmoid, tanh, gelu (tanh form), gelu_erf, silu, softplus, elu.
    ``ttl_s`` and ``device``, here and in every convenience, as in ``call``.
    """
    return call("fused_dense", {"weight": weight, "x": x, "bias": bias}, {"act": act}, client, ttl_s=ttl_s,
                device=device)["y"]


def tensorcontract(*operands, spec=None, C=None, pA=None, pB=None, pAB=None, conjA=None, conjB=None,
                   alpha=None, beta=None, client=None, ttl_s=None, device=None):
    """``beta*C + alpha*contract(opA(A), opB(B))`` (TensorOperations' tensorcontract!).

    einsum-like, ``tensorcontract("ij,jk->ik", A, B)`` (no repeated or batch
    letters: the contract's spec), or with the contract's axis lists,
    ``tensorcontract(A, B, pA=[[0], [1]], pB=[[0], [1]])``. ``alpha`` and
    ``beta`` may be scalar tensors that require grad; C is needed when beta
    is nonzero or differentiated.
    """
    if operands and isinstance(operands[0], str):
        spec, operands = operands[0], operands[1:]
    if len(operands) == 3 and C is None:
        operands, C = operands[:2], operands[2]
    if len(operands) != 2:
        raise TypeError("tensorcontract takes [spec,] A, B [, C]")
    A, B = operands
    options = {"spec": spec, "pA": pA, "pB": pB, "pAB": pAB, "conjA": conjA, "conjB": conjB,
               "alpha": alpha, "beta": beta}
    return call("tensorcontract", {"A": A, "B": B, "C": C}, options, client, ttl_s=ttl_s, device=device)["C"]


def tensoradd(A, C=None, *, pA=None, conjA=None, alpha=None, beta=None, client=None, ttl_s=None, device=None):
    """``beta*C + alpha*permute(opA(A), pA)`` (TensorOperations' tensoradd!)."""
    options = {"pA": pA, "conjA": conjA, "alpha": alpha, "beta": beta}
    return call("tensoradd", {"A": A, "C": C}, options, client, ttl_s=ttl_s, device=device)["C"]


def tensortrace(A, C=None, *, p=None, q=None, conjA=None, alpha=None, beta=None, client=None, ttl_s=None,
                device=None):
    """``beta*C + alpha*Σ_k permute(opA(A), p ++ q1 ++ q2)[..., k, k]`` (TensorOperations' tensortrace!).

    ``q = [q1, q2]``: axis q1[i] is traced against q2[i]; ``p`` the free axes in output order.
    """
    options = {"p": p, "q": q, "conjA": conjA, "alpha": alpha, "beta": beta}
    return call("tensortrace", {"A": A, "C": C}, options, client, ttl_s=ttl_s, device=device)["C"]


def _factorization(op):
    def f(A, client=None, *, ttl_s=None, device=None, **options):
        return _outputs(op, call(op, {"A": A}, options, client, ttl_s=ttl_s, device=device))

    outs = ", ".join(OPS[op])
    f.__name__ = f.__qualname__ = op
    f.__doc__ = (f"``{outs} = {op}(A, **options)``: the daemon's {op} (contract section 4), "
                 f"differentiable in A. Options as the contract names them (e.g. gauge_atol, strict_gauge).")
    return f


qr_compact = _factorization("qr_compact")
qr_full = _factorization("qr_full")
qr_null = _factorization("qr_null")
lq_compact = _factorization("lq_compact")
lq_full = _factorization("lq_full")
lq_null = _factorization("lq_null")
eigh_full = _factorization("eigh_full")
eigh_vals = _factorization("eigh_vals")
eigh_trunc = _factorization("eigh_trunc")
eig_full = _factorization("eig_full")
eig_vals = _factorization("eig_vals")
svd_compact = _factorization("svd_compact")
svd_full = _factorization("svd_full")
svd_vals = _factorization("svd_vals")
svd_trunc = _factorization("svd_trunc")
left_polar = _factorization("left_polar")
right_polar = _factorization("right_polar")
