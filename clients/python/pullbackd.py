"""Python client of pullbackd (wire contract version 1).

numpy arrays in and out: C-contiguous arrays travel as order "C", Fortran
arrays as order "F" without a copy, anything else is made C-contiguous.
Errors from the daemon are raised as PullbackError carrying the code.

Needs Debian's python3-msgpack and python3-numpy (run with /usr/bin/python3).
"""

import os
import socket
import warnings

import msgpack
import numpy as np

__all__ = ["Client", "Tape", "PullbackError", "GaugeWarning", "socket_path"]

_DTYPES = {
    np.dtype("<f4"): "f32",
    np.dtype("<f8"): "f64",
    np.dtype("<c8"): "c64",
    np.dtype("<c16"): "c128",
}
_NUMPY = {name: dt for dt, name in _DTYPES.items()}


class PullbackError(Exception):
    """An error response: .code (str), .message, .details (other keys)."""

    def __init__(self, code, message, details=None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details or {}


class GaugeWarning(UserWarning):
    """A reverse whose cotangents had a gauge-dependent part."""


def socket_path():
    """The contract's socket path chain (section 1)."""
    env = os.environ
    if env.get("PULLBACKD_SOCKET"):
        return env["PULLBACKD_SOCKET"]
    if env.get("RUNTIME_DIRECTORY"):
        return env["RUNTIME_DIRECTORY"].split(":")[0] + "/pullbackd.sock"
    if env.get("XDG_RUNTIME_DIR"):
        return env["XDG_RUNTIME_DIR"] + "/pullbackd.sock"
    return f"/tmp/pullbackd-{os.getuid()}.sock"


def encode_tensor(value):
    """A tensor map for an array-like; F-ordered arrays go without a copy."""
    a = np.asarray(value)
    if a.dtype.kind in "iub":
        a = a.astype(np.float64)
    dt = a.dtype.newbyteorder("<")
    if dt not in _DTYPES:
        raise TypeError(f"pullbackd takes float32, float64, complex64 or complex128, not {a.dtype}")
    if a.dtype.byteorder == ">":
        a = a.astype(dt)
    if a.flags.c_contiguous:
        order, buf = "C", a
    elif a.flags.f_contiguous:
        order, buf = "F", a.T  # the transpose of an F array is C-contiguous: same bytes
    else:
        order, buf = "C", np.ascontiguousarray(a)
    return {"dtype": _DTYPES[dt], "shape": list(a.shape), "order": order, "data": memoryview(buf).cast("B")}


def decode_tensor(t):
    """A numpy array (read-only view of the reply's bytes) for a tensor map."""
    dt = _NUMPY[t["dtype"]]
    a = np.frombuffer(t["data"], dtype=dt)
    return a.reshape(t["shape"], order=t.get("order", "C"))


def _scalar(v):
    if isinstance(v, complex):
        return [v.real, v.imag]
    return v


class Tape:
    """A tape handle held by the daemon; released when garbage-collected."""

    def __init__(self, client, handle, tape_bytes):
        self.client = client
        self.handle = handle
        self.tape_bytes = tape_bytes
        self.done = False

    def release(self):
        """Release the tape now; returns the daemon's `released`."""
        if self.done:
            return False
        self.done = True
        return self.client.call("release", {"tape": self.handle})["released"]

    def __del__(self):
        try:
            if not self.done and self.client.sock is not None:
                self.done = True
                self.client.notify("release", {"tape": self.handle})
        except Exception:
            pass

    def __repr__(self):
        return f"Tape({self.handle}, tape_bytes={self.tape_bytes})"


class Client:
    """One connection to pullbackd."""

    def __init__(self, path=None, timeout=None):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path or socket_path())
        self.unpacker = msgpack.Unpacker(raw=False, max_buffer_size=2**31 - 1)
        self.next_id = 1
        self.stash = {}
        self.last_warnings = []

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- transport -----------------------------------------------------
    def send(self, method, params=None):
        """Send a request without waiting; returns its msgid."""
        msgid = self.next_id
        self.next_id = (self.next_id + 1) & 0xFFFFFFFF or 1
        self.sock.sendall(msgpack.packb([0, msgid, method, [params or {}]], use_bin_type=True))
        return msgid

    def notify(self, method, params=None):
        self.sock.sendall(msgpack.packb([2, method, [params or {}]], use_bin_type=True))

    def _read_one(self):
        while True:
            for msg in self.unpacker:
                if not (isinstance(msg, list) and len(msg) == 4 and msg[0] == 1):
                    raise PullbackError("internal", f"not a msgpack-RPC response: {msg!r:.80}")
                _, msgid, err, result = msg
                if err is not None:
                    details = {k: v for k, v in err.items() if k not in ("code", "message")}
                    return msgid, PullbackError(err.get("code"), err.get("message", ""), details)
                return msgid, result
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("pullbackd closed the connection")
            self.unpacker.feed(data)

    def recv(self):
        """The next reply: (msgid, result or PullbackError)."""
        if self.stash:
            msgid = next(iter(self.stash))
            return msgid, self.stash.pop(msgid)
        return self._read_one()

    def wait(self, msgid):
        """The reply to msgid (others that arrive first are kept)."""
        while msgid not in self.stash:
            got, value = self._read_one()
            self.stash[got] = value
        value = self.stash.pop(msgid)
        if isinstance(value, PullbackError):
            raise value
        return value

    def call(self, method, params=None):
        return self.wait(self.send(method, params))

    # -- methods -------------------------------------------------------
    def hello(self):
        return self.call("hello")

    def ops(self):
        return self.call("ops")["ops"]

    def stats(self):
        return self.call("stats")

    @staticmethod
    def _call_params(op, inputs, options, device, order=None):
        p = {"op": op, "inputs": {k: encode_tensor(v) for k, v in inputs.items()}}
        if options:
            p["options"] = {k: _scalar(v) for k, v in options.items()}
        if device is not None:
            p["device"] = device
        if order is not None:
            p["order"] = order
        return p

    def forward(self, op, inputs, options=None, device=None, order=None):
        """Outputs of op as numpy arrays; no tape is kept."""
        r = self.call("forward", self._call_params(op, inputs, options, device, order))
        return {k: decode_tensor(v) for k, v in r["outputs"].items()}

    def augmented_forward(self, op, inputs, wrt, options=None, device=None, scope=None, ttl_s=None, order=None):
        """(outputs, Tape) for a later reverse with respect to wrt."""
        p = self._call_params(op, inputs, options, device, order)
        p["wrt"] = list(wrt)
        if scope is not None:
            p["scope"] = scope
        if ttl_s is not None:
            p["ttl_s"] = ttl_s
        r = self.call("augmented_forward", p)
        outputs = {k: decode_tensor(v) for k, v in r["outputs"].items()}
        return outputs, Tape(self, r["tape"], r["tape_bytes"])

    def reverse(self, tape, cotangents, keep=False, order=None):
        """Gradients (numpy) for the tape's wrt set; consumes it unless keep."""
        handle = tape.handle if isinstance(tape, Tape) else tape
        p = {"tape": handle, "cotangents": {k: encode_tensor(v) for k, v in cotangents.items()}}
        if keep:
            p["keep"] = True
        if order is not None:
            p["order"] = order
        r = self.call("reverse", p)
        if isinstance(tape, Tape) and not keep:
            tape.done = True
        self.last_warnings = r.get("warnings", [])
        for w in self.last_warnings:
            warnings.warn(w, GaugeWarning, stacklevel=2)
        return {k: decode_tensor(v) for k, v in r["gradients"].items()}

    def release(self, tape):
        if isinstance(tape, Tape):
            return tape.release()
        return self.call("release", {"tape": tape})["released"]

    def check(self, op, inputs, wrt, options=None, device=None, seed=None):
        p = self._call_params(op, inputs, options, device)
        p["wrt"] = list(wrt)
        if seed is not None:
            p["seed"] = seed
        return self.call("check", p)
