"""Write the fuzz seed corpus: one valid request per method and per op.

Run: /usr/bin/python3 tests/fuzz/make_corpus.py   (rewrites tests/fuzz/corpus/)

Each file is one msgpack-RPC message as a client would send it: small
tensors in both orders and all four dtypes, every option of every op, the
einsum form, the scopes, notifications, and a few messages that stack
several requests back to back. Tensors that lie in shared-memory buffers
({buffer, offset}) and into targets name the fuzz target's two fake
buffers: id 1 (4096 bytes, writable) and id 2 (256 bytes, read-only).
"""

import os
import struct

import msgpack

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")
SIZE = {"f32": 4, "f64": 8, "c64": 8, "c128": 16}


def tensor(dtype, shape, order="C", value=0.5):
    n = 1
    for s in shape:
        n *= s
    comp = n * (2 if dtype.startswith("c") else 1)
    fmt = "<%d%s" % (comp, "f" if dtype in ("f32", "c64") else "d")
    vals = [value + 0.125 * (i % 7) - 0.25 * (i % 3) for i in range(comp)]
    return {"dtype": dtype, "shape": list(shape), "order": order, "data": struct.pack(fmt, *vals)}


def in_buffer(dtype, shape, buffer, offset, order="C"):
    return {"dtype": dtype, "shape": list(shape), "order": order, "buffer": buffer, "offset": offset}


def request(msgid, method, params):
    return msgpack.packb([0, msgid, method, [params]], use_bin_type=True)


def notification(method, params):
    return msgpack.packb([2, method, [params]], use_bin_type=True)


def herm(dtype, n):
    """A real symmetric n×n matrix of the dtype (Hermitian for complex)."""
    vals = [[1.0 / (1 + i + j) + (i == j) for j in range(n)] for i in range(n)]
    flat = [vals[i][j] for j in range(n) for i in range(n)]
    if dtype.startswith("c"):
        flat = [x for v in flat for x in (v, 0.0)]
    fmt = "<%d%s" % (len(flat), "f" if dtype in ("f32", "c64") else "d")
    return {"dtype": dtype, "shape": [n, n], "order": "F", "data": struct.pack(fmt, *flat)}


def main():
    os.makedirs(OUT, exist_ok=True)
    for f in os.listdir(OUT):
        os.remove(os.path.join(OUT, f))
    files = {}
    mid = [0]

    def add(name, data):
        files[name] = data

    def req(method, params):
        mid[0] += 1
        return request(mid[0], method, params)

    for m in ("hello", "ops", "stats", "drain", "shutdown"):
        add(m, req(m, {}))
    add("release", req("release", {"tape": 12345}))
    add("release_notify", notification("release", {"tape": 5}))
    add("reverse", req("reverse", {"tape": 12345, "keep": True, "order": "F",
                                   "cotangents": {"y": tensor("f64", (3, 2))}}))
    add("register_buffer", req("register_buffer", {"size": 4096}))

    # fused_dense: every activation, vector x, bias or not, both orders
    acts = ["identity", "relu", "leakyrelu", "sigmoid", "tanh", "gelu", "gelu_erf", "silu", "softplus", "elu"]
    for i, act in enumerate(acts):
        d = "f32" if i % 2 else "f64"
        o = "F" if i % 3 == 0 else "C"
        inputs = {"weight": tensor(d, (3, 4), o), "x": tensor(d, (4,) if i % 4 == 0 else (4, 2), o)}
        if i % 2 == 0:
            inputs["bias"] = tensor(d, (3,))
        add(f"fused_dense_{act}", req("augmented_forward" if i % 2 else "forward",
                                      {"op": "fused_dense", "inputs": inputs, "options": {"act": act},
                                       "wrt": ["weight", "x", "bias"] if i % 2 == 0 else ["x"],
                                       "scope": "peer", "ttl_s": 30, "device": "cpu"}
                                      if i % 2 else {"op": "fused_dense", "inputs": inputs,
                                                     "options": {"act": act}}))
    add("check_fused_dense", req("check", {"op": "fused_dense", "seed": 3, "wrt": ["weight"],
                                           "inputs": {"weight": tensor("f64", (2, 2)), "x": tensor("f64", (2, 2))}}))

    # tensor ops
    for d in ("f32", "f64", "c64", "c128"):
        add(f"tensorcontract_{d}", req("augmented_forward", {
            "op": "tensorcontract", "wrt": ["A", "B", "C", "alpha", "beta"],
            "inputs": {"A": tensor(d, (2, 3, 4)), "B": tensor(d, (2, 4, 3), "F"), "C": tensor(d, (2, 2))},
            "options": {"pA": [[0], [1, 2]], "pB": [[2, 1], [0]], "pAB": [1, 0], "conjA": True, "conjB": False,
                        "alpha": [0.5, 0.25] if d.startswith("c") else [0.5, 0], "beta": 1.5}}))
        add(f"tensorcontract_spec_{d}", req("forward", {
            "op": "tensorcontract", "inputs": {"A": tensor(d, (2, 3, 4)), "B": tensor(d, (4, 3, 5))},
            "options": {"spec": "abc,cbd->da"}}))
        add(f"tensoradd_{d}", req("forward", {
            "op": "tensoradd", "inputs": {"A": tensor(d, (2, 3, 1)), "C": tensor(d, (3, 2, 1))},
            "options": {"pA": [1, 0, 2], "alpha": 2, "beta": 0.5, "conjA": d.startswith("c")}, "order": "F"}))
        add(f"tensortrace_{d}", req("check", {
            "op": "tensortrace", "wrt": ["A", "alpha"],
            "inputs": {"A": tensor(d, (2, 3, 2, 4))}, "options": {"p": [1, 3], "q": [[0], [2]], "alpha": 1.5}}))
    add("tensoradd_rank0", req("forward", {"op": "tensoradd", "inputs": {"A": tensor("f64", ())}}))
    add("tensoradd_zero", req("forward", {"op": "tensoradd", "inputs": {"A": tensor("c64", (0, 3))}}))

    # factorizations: every op, dtype cycling, every option
    fz = {
        "qr_compact": {"rank_atol": 1e-10, "gauge_atol": 1e-6, "strict_gauge": True},
        "qr_full": {}, "qr_null": {"rank_atol": 0.0}, "lq_compact": {}, "lq_full": {"strict_gauge": False},
        "lq_null": {},
        "eigh_full": {"herm_atol": 1e-8, "degeneracy_atol": 1e-9, "gauge_atol": 1e-7, "strict_gauge": True},
        "eigh_vals": {"herm_atol": 0.1},
        "eigh_trunc": {"maxrank": 2, "atol": 0.1, "rtol": 0.01},
        "eig_full": {"degeneracy_atol": 1e-9}, "eig_vals": {},
        "svd_compact": {"rank_atol": 1e-12, "degeneracy_atol": 1e-12}, "svd_full": {}, "svd_vals": {},
        "svd_trunc": {"maxrank": 1, "atol": 0.0, "rtol": 0.5},
        "left_polar": {}, "right_polar": {},
    }
    dts = ["f32", "f64", "c64", "c128"]
    for i, (op, opts) in enumerate(fz.items()):
        d = dts[i % 4]
        if op.startswith("eigh"):
            A = herm(d, 3)
        elif op.startswith("eig"):
            A = tensor(d, (3, 3))
        elif op == "right_polar":
            A = tensor(d, (2, 3), "F")
        else:
            A = tensor(d, (3, 2), "F" if i % 2 else "C")
        method = ["forward", "augmented_forward", "check"][i % 3]
        params = {"op": op, "inputs": {"A": A}, "options": opts}
        if method != "forward":
            params["wrt"] = ["A"]
        add(f"factor_{op}", req(method, params))

    # several requests in one stream, and a pipelined forward/reverse pair
    add("stream", req("hello", {}) + req("ops", {}) + notification("release", {"tape": 1}) + req("stats", {}))

    # shared-memory buffers: inputs, cotangents and into targets in the fake
    # buffers, accumulate, and the refusals (misaligned, past the end,
    # read-only into, unknown id, overlapping targets)
    add("unregister_buffer", req("unregister_buffer", {"buffer": 1}))
    add("shm_forward", req("forward", {"op": "fused_dense", "inputs": {
        "weight": in_buffer("f64", (3, 4), 1, 0), "x": in_buffer("f64", (4, 2), 1, 96, "F"),
        "bias": in_buffer("f64", (3,), 2, 8)}, "into": {"y": {"buffer": 1, "offset": 1024}}}))
    add("shm_augmented", req("augmented_forward", {"op": "svd_compact", "wrt": ["A"],
        "inputs": {"A": in_buffer("c64", (4, 3), 2, 16)},
        "into": {"U": {"buffer": 1, "offset": 0}, "S": {"buffer": 1, "offset": 512},
                 "Vh": {"buffer": 1, "offset": 1024}}, "order": "F", "accumulate": False}))
    add("shm_reverse", req("reverse", {"tape": 12345, "keep": True, "accumulate": True,
                                       "cotangents": {"y": in_buffer("f64", (3, 2), 2, 0)},
                                       "into": {"weight": {"buffer": 1, "offset": 0}}}))
    add("shm_reverse_svd", req("reverse", {"tape": 1, "order": "F",
                                           "cotangents": {"S": in_buffer("f32", (3,), 1, 4)},
                                           "into": {"A": {"buffer": 1, "offset": 8}}}))
    add("shm_bad", req("forward", {"op": "tensoradd", "inputs": {"A": in_buffer("c128", (2, 2), 1, 8)},
                                   "into": {"C": {"buffer": 2, "offset": 4088}}}))
    add("shm_overlap", req("forward", {"op": "qr_compact", "inputs": {"A": in_buffer("f64", (3, 2), 1, 4000)},
                                       "into": {"Q": {"buffer": 1, "offset": 0}, "R": {"buffer": 1, "offset": 8}}}))
    add("shm_tensortrace", req("check", {"op": "tensortrace", "wrt": ["A"],
                                         "inputs": {"A": in_buffer("f64", (2, 3, 2), 3, 0)}}))

    for name, data in files.items():
        with open(os.path.join(OUT, name + ".msgpack"), "wb") as f:
            f.write(data)
    print(f"{len(files)} seeds in {OUT}")


if __name__ == "__main__":
    main()
