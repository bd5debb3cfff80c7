"""Python client of pullbackd (wire contract version 1: shared/PROTOCOL.md beside the repository).

numpy arrays go in and come out. A C-contiguous array travels as order "C",
an F-contiguous one as order "F" with its memory as it is (no copy), any
other strided array as a C-contiguous copy; data is always little-endian.
Arrays in replies are read-only views of the received bytes (zero copy);
call ``.copy()`` on one to write to it. Tensors of 64 KiB and more are sent
from the arrays' own memory (sendmsg), and a reply of 1 MiB and more is
received straight into one buffer, which the Client lends again for a
later reply once all the arrays of this one are gone.

Errors from the daemon raise PullbackError carrying the wire code. A Client
is one connection; threads may share it (each call gets its own reply),
and a forked child must make its own.

Shared memory (contract section 6): ``Client.shared_buffer(size)`` makes a
memfd, maps it here and registers it (``register_buffer``, the fd passed
with socket.send_fds); a BufferTensor names values that lie in a buffer
and is sent instead of an array, and ``into={name: (buffer, offset)}``
has outputs or gradients written into a buffer, returned as BufferTensor
(``accumulate=True`` on reverse adds gradients to what is there).

Needs numpy and msgpack (Debian's python3-numpy, python3-msgpack: run it
with /usr/bin/python3, or pip install clients/python into a venv made with
--system-site-packages). ``pullbackd.torch`` has the ops as PyTorch autograd
functions. The guide is docs/python.md.
"""

import array
import mmap
import os
import socket
import struct
import sys
import threading
import warnings
import weakref

import msgpack
import numpy as np

__all__ = [
    "Client", "Tape", "PullbackError", "GaugeWarning", "BufferTensor", "SharedBuffer",
    "socket_path", "encode_tensor", "decode_tensor",
]

_WIRE_DTYPES = {
    np.dtype("<f4"): "f32",
    np.dtype("<f8"): "f64",
    np.dtype("<c8"): "c64",
    np.dtype("<c16"): "c128",
}
_NUMPY_DTYPES = {name: dt for dt, name in _WIRE_DTYPES.items()}


class PullbackError(Exception):
    """An error reply: ``.code`` (wire code), ``.message``, ``.details`` (the other keys)."""

    def __init__(self, code, message, details=None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = dict(details or {})


class GaugeWarning(UserWarning):
    """A reverse whose cotangents had a gauge-dependent part (a reply warning)."""


def socket_path():
    """The daemon's socket path, by the contract's chain (section 1)."""
    env = os.environ
    if env.get("PULLBACKD_SOCKET"):
        return env["PULLBACKD_SOCKET"]
    first = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if first:
        # systemd joins several RuntimeDirectory= entries with ':'; the first is ours
        # (an empty one goes on down the chain, as the daemon and the C client do).
        return os.path.join(first, "pullbackd.sock")
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "pullbackd.sock")
    return f"/tmp/pullbackd-{os.getuid()}.sock"


def _wire_dtype(dtype):
    """The wire name of a dtype given by name ("f64") or as a numpy dtype."""
    if isinstance(dtype, str) and dtype in _NUMPY_DTYPES:
        return dtype
    wire = np.dtype(dtype).newbyteorder("<")
    if wire not in _WIRE_DTYPES:
        raise TypeError(f"pullbackd takes float32, float64, complex64 or complex128, not {dtype}")
    return _WIRE_DTYPES[wire]


class BufferTensor:
    """A tensor whose values lie in a registered shared-memory buffer.

    Sent in place of an array as ``{dtype, shape, order, buffer, offset}``
    (the daemon reads the buffer, no copy); results written into a buffer
    (``into``) come back as one. ``dtype`` is the wire name ("f32", "f64",
    "c64", "c128"); numpy dtypes are accepted too. ``offset`` is in bytes
    and must be a multiple of the element size.
    """

    __slots__ = ("buffer", "offset", "dtype", "shape", "order")

    def __init__(self, buffer, offset, dtype, shape, order="C"):
        self.buffer = buffer.id if isinstance(buffer, SharedBuffer) else int(buffer)
        self.offset = int(offset)
        self.dtype = _wire_dtype(dtype)
        self.shape = tuple(int(d) for d in shape)
        if order not in ("C", "F"):
            raise ValueError(f"order must be 'C' or 'F', not {order!r}")
        self.order = order

    @property
    def nbytes(self):
        n = 1
        for d in self.shape:
            n *= d
        return n * _NUMPY_DTYPES[self.dtype].itemsize

    def wire(self):
        """The wire tensor map."""
        return {"dtype": self.dtype, "shape": list(self.shape), "order": self.order,
                "buffer": self.buffer, "offset": self.offset}

    def __eq__(self, other):
        return isinstance(other, BufferTensor) and self.wire() == other.wire()

    def __repr__(self):
        return (f"BufferTensor(buffer={self.buffer}, offset={self.offset}, dtype={self.dtype!r}, "
                f"shape={self.shape}, order={self.order!r})")


class SharedBuffer:
    """A memfd of ``size`` bytes, mapped here and registered with the daemon.

    Made by ``Client.shared_buffer(size)``. ``id`` is the daemon's buffer
    id. ``array(offset, shape, dtype, order)`` is a writable numpy view of
    its bytes, ``tensor(...)`` the BufferTensor that names them, ``put(offset,
    array)`` copies an array in and returns its BufferTensor, ``view(t)`` is
    the numpy view of a BufferTensor (a result written ``into`` it).
    ``close()`` unregisters and unmaps it; it is also a context manager.
    Do not shrink the file: the daemon then fails every request that
    touches the buffer.
    """

    def __init__(self, client, size, name="pullbackd"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self.mmap = mmap.mmap(fd, size)
            self.id = client.register_buffer(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.client, self.size, self.fd = client, size, fd

    @staticmethod
    def _aligned(offset, dtype):
        """(offset, numpy dtype), checked: the daemon takes a tensor at a multiple of its element size."""
        wire = _wire_dtype(dtype)
        dt = _NUMPY_DTYPES[wire]
        if not isinstance(offset, (int, np.integer)) or offset < 0 or offset % dt.itemsize:
            raise ValueError(f"offset {offset!r} is not a multiple of {dt.itemsize} bytes, the size of a "
                             f"{wire} element: the daemon would refuse it")
        return int(offset), dt

    def array(self, offset, shape, dtype, order="C"):
        """A writable numpy view of the bytes at offset (a multiple of the element size)."""
        offset, dt = self._aligned(offset, dtype)
        shape = tuple(int(d) for d in shape)
        count = 1
        for d in shape:
            count *= d
        return np.frombuffer(self.mmap, dtype=dt, count=count, offset=offset).reshape(shape, order=order)

    def tensor(self, offset, shape, dtype, order="C"):
        """The BufferTensor of the values at offset (a multiple of the element size)."""
        return BufferTensor(self.id, self._aligned(offset, dtype)[0], dtype, shape, order)

    def put(self, offset, value):
        """Copy an array (in its own memory order, C unless F-contiguous) to offset; its BufferTensor."""
        arr = _wire_array(value)
        order = "F" if arr.flags.f_contiguous and not arr.flags.c_contiguous else "C"
        self.array(offset, arr.shape, arr.dtype, order)[...] = arr
        return self.tensor(offset, arr.shape, arr.dtype, order)

    def view(self, tensor):
        """The numpy view of a BufferTensor that lies in this buffer."""
        if tensor.buffer != self.id:
            raise ValueError(f"{tensor!r} is not in buffer {self.id}")
        return self.array(tensor.offset, tensor.shape, tensor.dtype, tensor.order)

    def close(self):
        """Unregister the buffer (if the connection is open) and unmap it here."""
        if self.fd is None:
            return
        try:
            if self.client._sock is not None:
                self.client.unregister_buffer(self.id)
        finally:
            try:
                self.mmap.close()
            except BufferError:
                pass  # numpy views still use it: unmapped when they are gone
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _wire_array(value):
    """value as a numpy array of a wire dtype, little-endian.

    Arrays and buffers (numpy arrays and scalars, memoryviews, array.array,
    tensors) must be float32, float64, complex64 or complex128 (else
    TypeError: the bytes of a bytearray are not numbers); python numbers
    and lists or tuples of ints become float64. A masked array with
    anything masked is refused (np.asarray would drop its mask).
    """
    if isinstance(value, np.ma.MaskedArray) and np.ma.is_masked(value):
        raise TypeError("pullbackd takes no masked arrays: the masked values would be used as data "
                        "(fill them first: a.filled(v))")
    arr = np.asarray(value)
    if isinstance(value, (bool, int, float, complex, list, tuple)) and not isinstance(value, np.generic):
        if arr.dtype.kind in "biu":
            arr = arr.astype(np.float64)
    wire = arr.dtype.newbyteorder("<")
    if wire not in _WIRE_DTYPES:
        raise TypeError(f"pullbackd takes float32, float64, complex64 or complex128 arrays, not {arr.dtype}")
    if arr.dtype != wire:
        arr = arr.astype(wire)  # byteswap; astype keeps the memory layout
    return arr


def encode_tensor(value):
    """The wire tensor map of an array (or of anything np.asarray takes).

    See _wire_array for what it takes; a BufferTensor is sent as the
    buffer and offset it names.
    """
    if isinstance(value, BufferTensor):
        return value.wire()
    arr = _wire_array(value)
    if arr.flags.c_contiguous:
        order, buf = "C", arr
    elif arr.flags.f_contiguous:
        order, buf = "F", arr.T  # the transpose of an F array is C-contiguous over the same bytes
    else:
        order, buf = "C", np.ascontiguousarray(arr)
    return {"dtype": _WIRE_DTYPES[arr.dtype], "shape": list(arr.shape), "order": order, "data": memoryview(buf)}


def decode_tensor(tensor):
    """The numpy array of a wire tensor map: a read-only view of its data.

    A result written into a buffer ({..., buffer, offset}) is a BufferTensor.
    """
    if "buffer" in tensor:
        return BufferTensor(tensor["buffer"], tensor["offset"], tensor["dtype"], tensor["shape"],
                            tensor.get("order", "C"))
    try:
        dtype = _NUMPY_DTYPES[tensor["dtype"]]
    except KeyError:
        raise ValueError(f"reply tensor has unknown dtype {tensor.get('dtype')!r}") from None
    flat = np.frombuffer(tensor["data"], dtype=dtype)
    return flat.reshape(tensor["shape"], order=tensor.get("order", "C"))


def _wire_value(value):
    """An option value as msgpack can send it: complex as [re, im], numpy scalars as python ones."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, complex):
        return [value.real, value.imag]
    if isinstance(value, (list, tuple)):
        return [_wire_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _wire_value(v) for k, v in value.items() if v is not None}
    return value


def _params(**kw):
    """A params map of the keys that are given (not None)."""
    return {k: v for k, v in kw.items() if v is not None}


class _Big:
    """A big tensor's data in a message being packed: _pack sends it from
    its own memory instead of copying it into the packed bytes."""
    __slots__ = ("view",)

    def __init__(self, view):
        self.view = view


def _tensors(arrays):
    """The wire form of name -> array, big tensors last, smallest first.

    The daemon sizes its read buffer from each payload's declared length as
    it comes, so it moves what it has read whenever a later payload needs
    more room: with the biggest tensor last, that is only the smaller ones
    (fused_dense's x, 1 MiB, not its 4 MiB weight).  A map's order means
    nothing else to the daemon."""
    small, big = {}, []
    for name, a in arrays.items():
        t = encode_tensor(a)
        data = t.get("data")
        if isinstance(data, memoryview) and data.nbytes >= _BIG:
            t["data"] = _Big(data)
            big.append((name, t))
        else:
            small[name] = t
    big.sort(key=lambda e: e[1]["data"].view.nbytes)  # stable: equal sizes keep their order
    return {**small, **dict(big)}


def _arrays(tensors):
    return {name: decode_tensor(t) for name, t in tensors.items()}


def _into(into):
    """The wire form of into: name -> (buffer, offset) | BufferTensor | {buffer, offset}."""
    if into is None:
        return None
    out = {}
    for name, target in into.items():
        if isinstance(target, BufferTensor):
            buffer, offset = target.buffer, target.offset
        elif isinstance(target, dict):
            buffer, offset = target["buffer"], target["offset"]
        else:
            buffer, offset = target
        if isinstance(buffer, SharedBuffer):
            buffer = buffer.id
        out[name] = {"buffer": int(buffer), "offset": int(offset)}
    return out


def _handle(tape):
    return tape.handle if isinstance(tape, Tape) else tape


# -- streaming ----------------------------------------------------------------
# Big tensors move without copies of our own: a message holding one is sent
# with sendmsg from the arrays' own memory, and a big reply is received
# straight into one buffer of its announced size, its tensors handed out as
# views of that buffer.  Small messages keep msgpack's C packer/unpacker.

_BIG = 1 << 16         # a bin at least this long is sent / received in place
_BIG_MESSAGE = 1 << 20  # a reply at least this long is decoded without copies
_SLACK = 1 << 16        # received past a message's known end, for the next header
_IOV_MAX = 1024


def _refcounts(buffers):
    """sys.getrefcount of each buffer, as seen from this comprehension."""
    return [sys.getrefcount(b) for b in buffers]


# What _refcounts says of a buffer that only its list refers to.  Measured,
# not assumed: interpreters differ in the references a call borrows.  Any
# memoryview of a buffer (so any reply array, slice or view made from one)
# adds one, through the managed buffer that all views of one export share.
_UNUSED_REFS = _refcounts([np.empty(1, np.uint8)])[0]


class _ReplyBuffers:
    """The big receive buffers of one Client, kept for the next big replies.

    A reply of _BIG_MESSAGE bytes or more is received into one of these
    (np.empty: not zero-filled, as recv_into writes every byte used) and its
    arrays are views of it, so a buffer is taken again only when nothing but
    this list refers to it, and only for a need of at least half its size
    (small replies must not pin big buffers).  At most max_buffers and
    max_bytes are kept, the least recently taken dropped first: dropping a
    buffer in use only forgets it, its views keep it alive until they go.
    Memory freed and mapped again per reply would cost a page fault per 4 KiB
    on every reply; a reused buffer's pages are already there.
    """

    def __init__(self, max_buffers, max_bytes):
        self.max_buffers, self.max_bytes = max_buffers, max_bytes
        self.buffers = []  # np.uint8 arrays, least recently taken first

    def take(self, size):
        """A buffer of at least size bytes, free of views, contents undefined."""
        best = None
        for i, refs in enumerate(_refcounts(self.buffers)):
            n = len(self.buffers[i])
            if refs <= _UNUSED_REFS and size <= n <= 2 * size and (best is None or n < len(self.buffers[best])):
                best = i
        buf = self.buffers.pop(best) if best is not None else np.empty(size, np.uint8)
        if len(buf) > self.max_bytes:
            return buf  # not kept: it would push out all the others
        self.buffers.append(buf)
        held = sum(len(b) for b in self.buffers)
        while self.buffers and (len(self.buffers) > self.max_buffers or held > self.max_bytes):
            held -= len(self.buffers.pop(0))
        return buf

    def clear(self):
        self.buffers.clear()


_MARK = os.urandom(8)  # big data's placeholders in packed bytes start so


def _pack(msg):
    """msg as a list of byte chunks: msgpack's C packer packs it whole, each
    big tensor's data (_Big, made by _tensors) standing in as a 16-byte
    placeholder; the placeholders are then cut out and replaced by a bin32
    header and the array's own memory."""
    bigs = []

    def hook(o):
        if isinstance(o, _Big):
            bigs.append(o.view)
            return _MARK + struct.pack("<Q", len(bigs) - 1)
        raise TypeError(f"cannot send a {type(o).__name__}")

    packed = msgpack.packb(msg, default=hook)
    if not bigs:
        return [packed]
    parts, at = [], 0
    for i, view in enumerate(bigs):
        pos = packed.index(b"\xc4\x10" + _MARK + struct.pack("<Q", i), at)
        parts.append(packed[at:pos] + struct.pack(">BI", 0xc6, view.nbytes))
        parts.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
        at = pos + 18
    parts.append(packed[at:])
    return parts


def _sendmsg_all(sock, parts, fds=None, sent=None):
    """Send every chunk; fds ride (SCM_RIGHTS) with the first bytes.
    sent[0] (a list, when given) counts the bytes out, a failure included."""
    views = [memoryview(p) for p in parts if len(p)]
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    while views:
        n = sock.sendmsg(views[:_IOV_MAX], anc)
        if sent is not None:
            sent[0] += n
        anc = []
        while n and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8,
          0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}
_LEN = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0), 0xd9: (1, 0), 0xda: (2, 0), 0xdb: (4, 0),
        0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1)}  # length bytes, extra type byte
_LEN_FMT = {1: ">B", 2: ">H", 4: ">I"}


def _container(buf, pos, end):
    """The map or array header at buf[pos]: (values per element, elements,
    header bytes), elements None when the header is not all in buf[:end];
    None when no container starts there."""
    b = buf[pos]
    if 0x80 <= b <= 0x9f:
        return (2 if b <= 0x8f else 1), b & 0x0f, 1
    if b in (0xdc, 0xdd, 0xde, 0xdf):
        nlen = 2 if b in (0xdc, 0xde) else 4
        n = struct.unpack_from(_LEN_FMT[nlen], buf, pos + 1)[0] if pos + 1 + nlen <= end else None
        return (2 if b >= 0xde else 1), n, 1 + nlen
    return None


def _scan(buf, pos, end):
    """Walk one msgpack value of buf[pos:end] without decoding it: the end
    offset of the value, or -(bytes needed at least) when it is not all
    there yet.  Payloads are skipped, never read."""
    pending = 1  # values still to walk
    while pending:
        if pos >= end:
            return -(pos + 1)
        b = buf[pos]
        pending -= 1
        box = _container(buf, pos, end)
        if box is not None:
            per, n, size = box
            if n is None:
                return -(pos + size)
            pending += per * n
            pos += size
        elif b <= 0x7f or b >= 0xe0:
            pos += 1
        elif 0xa0 <= b <= 0xbf:
            pos += 1 + (b & 0x1f)
        elif b in _FIXED:
            pos += 1 + _FIXED[b]
        elif b in _LEN:
            nlen, ext = _LEN[b]
            if pos + 1 + nlen > end:
                return -(pos + 1 + nlen)
            n = struct.unpack_from(_LEN_FMT[nlen], buf, pos + 1)[0]
            pos += 1 + nlen + ext + n
        else:
            raise ConnectionError(f"pullbackd sent an invalid msgpack byte 0x{b:02x}")
    return pos if pos <= end else -pos


def _decode_inplace(view):
    """Decode one msgpack value of view (a memoryview) whose big bins become
    read-only memoryviews of it; everything else goes through msgpack."""
    obj, end = _decode_value(view, view.toreadonly(), 0)
    return obj


def _decode_value(view, ro, pos):
    """The value at view[pos] and its end (_decode_inplace).  A function of
    its own, not a closure: a closure that calls itself is a reference cycle,
    which would keep the views alive (and the reply buffer in use) until the
    cyclic garbage collector ran."""
    b = view[pos]
    box = _container(view, pos, len(view))
    if box is not None:
        per, n, size = box
        items = []
        pos += size
        for _ in range(per * n):
            v, pos = _decode_value(view, ro, pos)
            items.append(v)
        return (dict(zip(items[::2], items[1::2])) if per == 2 else items), pos
    if b == 0xc6:  # bin32: the only bin that can reach _BIG
        n = struct.unpack_from(">I", view, pos + 1)[0]
        start = pos + 5
        if n >= _BIG:
            return ro[start:start + n], start + n
    end = _scan(view, pos, len(view))
    return msgpack.unpackb(view[pos:end], raw=False), end


class Tape:
    """A tape the daemon holds for a later reverse.

    Attributes: ``handle`` (the integer handle, below 2**53), ``tape_bytes``, ``client``.
    When garbage-collected before it was consumed or released, it sends a
    ``release`` notification if its connection is still open.
    """

    def __init__(self, client, handle, tape_bytes):
        self.client = client
        self.handle = handle
        self.tape_bytes = tape_bytes
        self._done = False

    def release(self):
        """Release the tape; returns the daemon's ``released`` (False, unsent, once done)."""
        if self._done:
            return False
        return self.client.release(self)

    def __del__(self):
        if not self._done:
            try:
                self.client._release_later(self.handle)
            except Exception:
                pass

    def __repr__(self):
        return f"Tape(handle={self.handle}, tape_bytes={self.tape_bytes})"


_clients = weakref.WeakSet()  # every live Client, for _after_fork_in_child


def _after_fork_in_child():
    for client in list(_clients):
        client._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Client:
    """One connection to pullbackd; a context manager.

    ``path`` defaults to socket_path(); ``timeout`` (seconds) bounds every
    socket operation (None waits forever). A call that stops waiting (a
    timeout, KeyboardInterrupt) gives its reply up: it is dropped when it
    comes, and the tape or buffer it made is released then.

    Threads may share a Client: each call (hello, forward, reverse, ...)
    gets its own reply by msgid, whichever thread reads it. ``send`` and
    ``recv`` share one stream of replies: ``recv`` returns the next one,
    whoever sent it. ``last_warnings`` is the last reverse's, in any
    thread. A Client belongs to the process that made it: in a forked
    child it refuses to write (the parent's stream would be corrupted),
    and collected tapes are not released from there. ``closed`` is true
    once it was closed or its connection broke (the daemon closed it, or
    sent what is not msgpack-RPC); make a new Client then.
    """

    # Big reply buffers kept for reuse per client (see _ReplyBuffers): per
    # client rather than per process because close() can free them; one
    # thread at a time reads (_reading, under _cond).
    reply_buffers = 4
    reply_buffer_bytes = 512 << 20

    def __init__(self, path=None, timeout=None):
        self.path, self.timeout = path, timeout  # what a replacement connects with (pullbackd.torch)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            # Big tensors go out in fewer, larger writes (the kernel caps
            # this at net.core.wmem_max).
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            self._sock.connect(path or socket_path())
        except BaseException:
            self._sock.close()
            raise
        # Received bytes [_rpos, _rend) of _rbuf are not yet decoded.  _rbuf is
        # _small, a bytearray below _BIG_MESSAGE that small messages are
        # decoded from (msgpack copies out of it), or while a big message
        # arrives a memoryview of one of _reply_buffers.
        self._small = self._rbuf = bytearray(1 << 16)
        self._rpos = self._rend = 0
        self._reply_buffers = _ReplyBuffers(self.reply_buffers, self.reply_buffer_bytes)
        # A big message's size is learnt one tensor at a time (a bin's header
        # comes after the bytes of the bin before it), so a reply with several
        # big tensors moved to a bigger buffer per tensor.  The sizes that
        # messages came to, by the need that first made them big, let the
        # next one of the same request (same header) take its size at once.
        self._grown_to = {}
        self._first_need = 0
        self._next_msgid = 1
        self._stash = {}  # msgid -> result or PullbackError, received out of turn
        self._given_up = {}  # msgid -> method of a call that stopped waiting: its reply is dropped
        self._write_lock = threading.Lock()
        self._id_lock = threading.Lock()
        # _stash and _reading: one thread reads the socket (and owns the
        # receive buffers) while the others wait on _cond for their reply
        self._cond = threading.Condition(threading.Lock())
        self._reading = False
        self._pid = os.getpid()
        self._broken = None  # why the connection broke, once it did
        # notifications [method, params] freeing what nothing here holds any
        # more (collected tapes, the tape or buffer of a call given up),
        # sent with the next message
        self._deferred = []
        self.last_warnings = []
        _clients.add(self)

    @property
    def closed(self):
        """True once close() ran or the connection broke; a new Client is then needed."""
        return self._sock is None or self._broken is not None

    def _break(self, why):
        """Note that the connection is unusable (the first reason is kept); returns why."""
        if self._broken is None:
            self._broken = why
        return why

    def _mine(self):
        """Refuse a forked child's use of its parent's connection."""
        if os.getpid() != self._pid:
            raise ConnectionError(f"this Client was made by process {self._pid}: a forked child must make its "
                                  "own (using this one would corrupt the parent's stream)")

    def _forked(self):
        """In a forked child (os.register_at_fork): fresh locks, and the
        child's copy of the parent's socket closed, so that the parent's
        close() reaches the daemon."""
        self._write_lock, self._id_lock = threading.Lock(), threading.Lock()
        self._cond, self._reading = threading.Condition(threading.Lock()), False
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        self._deferred = []

    def close(self):
        """Send any pending tape releases and close the connection."""
        if self._sock is None:
            return
        with self._write_lock:
            try:
                if os.getpid() == self._pid and self._broken is None:
                    self._send_deferred()
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        self._reply_buffers.clear()  # replies still in use keep their own

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- transport -------------------------------------------------------
    def _write(self, msg, fds=None):
        """Send one message, preceded by the releases of collected tapes.

        fds ride as SCM_RIGHTS on the sendmsg that carries the message's first
        bytes; big tensors go out from their own memory (_pack). A failure
        after some bytes went out breaks the connection (the daemon would
        read what comes next as the rest); one before leaves it as it was.
        """
        self._mine()
        if self._sock is None:
            raise ConnectionError("the client is closed")
        parts = _pack(msg)
        with self._write_lock:
            sent = [0]
            try:
                self._send_deferred(sent)
                _sendmsg_all(self._sock, parts, fds, sent)
            except (BrokenPipeError, ConnectionResetError):
                raise  # the daemon is gone: send() breaks it, after reading why
            except OSError as e:
                if sent[0]:
                    self._break(e)
                raise

    def _send_deferred(self, sent=None):
        """Send the deferred notifications; the caller holds the write lock."""
        while self._sock is not None and self._deferred:
            method, params = self._deferred.pop()
            _sendmsg_all(self._sock, [msgpack.packb([2, method, [params]])], None, sent)

    def _notify_later(self, method, params):
        """Send a notification now, or with the next message while a send is under way."""
        if self._sock is None or os.getpid() != self._pid or self._broken is not None:
            return  # a forked child's copy of a parent's tape is the parent's to release
        self._deferred.append((method, params))
        if self._write_lock.acquire(blocking=False):
            try:
                self._send_deferred()
            finally:
                self._write_lock.release()

    def _release_later(self, handle):
        """Release a collected tape now, or with the next message while a send is under way."""
        self._notify_later("release", {"tape": handle})

    def _give_up(self, msgid, method):
        """Stop waiting for msgid (its call timed out or was interrupted): its
        reply is dropped when it comes, and what it made (a tape, a buffer)
        that nothing here will ever name is freed."""
        with self._cond:
            if msgid not in self._stash:
                self._given_up[msgid] = method
                return
            value = self._stash.pop(msgid)
        self._drop(method, value)

    def _drop(self, method, value):
        """Free what the reply of a call given up made."""
        if not isinstance(value, dict):
            return
        if method == "augmented_forward" and isinstance(value.get("tape"), int):
            self._release_later(value["tape"])
        elif method == "register_buffer" and isinstance(value.get("buffer"), int):
            self._notify_later("unregister_buffer", {"buffer": value["buffer"]})

    def _keep(self, got, value):
        """Stash a reply read out of turn; under _cond.  Returns the method
        of a call given up whose reply it is (for _drop, outside _cond)."""
        method = self._given_up.pop(got, None)
        if method is None:
            self._stash[got] = value
        return method

    def send(self, method, params=None, fds=None):
        """Send a request without waiting for its reply; returns its msgid.

        ``fds`` (file descriptors) are passed with it, as register_buffer wants.
        """
        self._mine()
        with self._id_lock:
            msgid = self._next_msgid
            self._next_msgid = (msgid + 1) & 0xFFFFFFFF or 1  # msgid 0 is the daemon's for parse errors
        try:
            self._write([0, msgid, method, [params or {}]], fds)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise self._break(self._why_closed() or e)
        return msgid

    def _why_closed(self):
        """The error the daemon sent under msgid 0 before it closed the
        connection (a connection past max_connections_per_uid, a parse
        error), read from what is left in the socket; None if it sent none."""
        if not self._start_reading(lambda: False):
            return None
        try:
            while True:
                got, value = self._read_reply()
                if got == 0 and isinstance(value, PullbackError):
                    return value
                with self._cond:
                    dropped = self._keep(got, value)
                if dropped:
                    self._drop(dropped, value)
        except (OSError, ValueError):
            return None
        finally:
            self._stop_reading(None, None)

    def notify(self, method, params=None):
        """Send a notification (no reply comes)."""
        try:
            self._write([2, method, [params or {}]])
        except (BrokenPipeError, ConnectionResetError) as e:
            raise self._break(e)

    def _fill(self, need):
        """Receive until at least `need` bytes lie undecoded in the buffer.

        A big message moves into a reply buffer (taken from _reply_buffers)
        of its need, or of the size the last message of the same header
        came to (_grown_to), and again if it outgrows that; smaller needs
        grow the small buffer, which stays below _BIG_MESSAGE so that a big
        message is never left in it.  Reads stop _SLACK past the need in a
        reply buffer, so that what follows a big message (copied back to
        the small buffer) stays short."""
        sock = self._sock  # close() from another thread makes recv_into fail, not this a None
        if sock is None:
            raise ConnectionError("the client is closed")
        have = self._rend - self._rpos
        if self._rpos + need > len(self._rbuf):
            size = need + _SLACK
            if size >= _BIG_MESSAGE:
                if self._rbuf is self._small:
                    self._first_need = need
                    size = max(size, self._grown_to.get(need, 0))
                nb = memoryview(self._reply_buffers.take(size))
            else:
                nb = self._small = bytearray(min(max(size, 2 * len(self._small)), _BIG_MESSAGE - 1))
            nb[:have] = memoryview(self._rbuf)[self._rpos:self._rend]
            self._rbuf, self._rpos, self._rend = nb, 0, have
        view = memoryview(self._rbuf)
        stop = len(view) if self._rbuf is self._small else min(len(view), self._rpos + need + _SLACK)
        while self._rend - self._rpos < need:
            try:
                n = sock.recv_into(view[self._rend:stop])
            except socket.timeout:
                raise  # the bytes read so far stay: a later call goes on from them
            except OSError as e:
                raise self._break(e)
            if n == 0:
                raise self._break(ConnectionError("pullbackd closed the connection"))
            self._rend += n

    def _next_message(self):
        """The next msgpack message off the socket."""
        need = 1
        while True:
            have = self._rend - self._rpos
            if 0 < have < _BIG_MESSAGE and have >= need:
                # Small: msgpack's C unpacker finds the end; the Python scan
                # below only runs when the message is not all here yet.
                try:
                    msg = msgpack.unpackb(memoryview(self._rbuf)[self._rpos:self._rend], raw=False)
                    self._rpos = self._rend = 0
                    return msg
                except msgpack.ExtraData as e:
                    self._rpos = self._rend - len(e.extra)
                    return e.unpacked
                except ValueError:
                    pass  # incomplete: the scan says how many bytes are missing
            if have >= need:
                end = _scan(self._rbuf, self._rpos, self._rend)
                if end >= 0:
                    start, self._rpos = self._rpos, end
                    if end - start >= _BIG_MESSAGE:
                        # The reply's arrays are views of this buffer, which
                        # _reply_buffers lends again once they are all gone;
                        # what follows the message goes back to the small one.
                        buf, rest = memoryview(self._rbuf), memoryview(self._rbuf)[end:self._rend]
                        if len(self._grown_to) >= 16 and self._first_need not in self._grown_to:
                            del self._grown_to[next(iter(self._grown_to))]
                        self._grown_to[self._first_need] = end - start + _SLACK
                        if self._rbuf is self._small or len(rest) > len(self._small):  # never lent twice
                            self._small = bytearray(max(1 << 16, len(rest)))
                        self._small[:len(rest)] = rest
                        self._rbuf, self._rpos, self._rend = self._small, 0, len(rest)
                        return _decode_inplace(buf[start:end])
                    msg = msgpack.unpackb(memoryview(self._rbuf)[start:end], raw=False)
                    if self._rpos == self._rend:
                        self._rpos = self._rend = 0
                    return msg
                need = -end - self._rpos
            self._fill(need)

    def _read_reply(self):
        """The next reply from the socket: (msgid, result or PullbackError)."""
        msg = self._next_message()
        if not (isinstance(msg, list) and len(msg) == 4 and msg[0] == 1):
            raise self._break(ConnectionError(f"pullbackd sent something that is not a response: {msg!r:.100}"))
        _, msgid, error, result = msg
        if error is None:
            return msgid, result
        if not isinstance(error, dict):
            return msgid, PullbackError("internal", repr(error))
        details = {k: v for k, v in error.items() if k not in ("code", "message")}
        return msgid, PullbackError(error.get("code"), error.get("message", ""), details)

    def _start_reading(self, ready):
        """Become the thread that reads the socket, unless ready() (called
        under _cond: the reply wanted is stashed) turns true first; False
        then."""
        with self._cond:
            while self._reading and not ready():
                self._cond.wait()
            if ready():
                return False
            self._reading = True
            return True

    def _stop_reading(self, got, value):
        """Stop reading, stashing the reply read for whoever waits for it."""
        dropped = None
        with self._cond:
            if got is not None:
                dropped = self._keep(got, value)
            self._reading = False
            self._cond.notify_all()
        if dropped:
            self._drop(dropped, value)

    def recv(self):
        """The next reply, in arrival order: (msgid, result or PullbackError)."""
        self._mine()
        got = value = None
        if self._start_reading(lambda: bool(self._stash)):
            try:
                while True:
                    got, value = self._read_reply()
                    with self._cond:
                        dropped = self._given_up.pop(got, None)
                    if not dropped:
                        break
                    self._drop(dropped, value)
            finally:
                self._stop_reading(None, None)
            return got, value
        with self._cond:
            msgid = next(iter(self._stash))
            return msgid, self._stash.pop(msgid)

    def wait(self, msgid):
        """The result for msgid (raises its PullbackError); other replies are kept for recv.

        Threads waiting at once take turns reading the socket; each reply
        read is stashed for its own waiter, who is woken at once."""
        self._mine()
        while self._start_reading(lambda: msgid in self._stash):
            got = value = None
            try:
                got, value = self._read_reply()
            finally:
                mine = got == msgid or got == 0
                self._stop_reading(None if mine else got, value)
            if got == msgid:
                break
            if got == 0 and isinstance(value, PullbackError):
                # parse_error or invalid_request the daemon could not
                # pair; after a parse_error it closes the connection
                raise self._break(value) if value.code == "parse_error" else value
        else:
            with self._cond:
                value = self._stash.pop(msgid)
        if isinstance(value, PullbackError):
            raise value
        return value

    def call(self, method, params=None, fds=None):
        """Send a request and return its result, or raise its PullbackError.

        A call that stops waiting (the client's timeout, KeyboardInterrupt)
        gives its reply up: it is dropped when it comes, and a tape or
        buffer it made is released then."""
        msgid = self.send(method, params, fds)
        try:
            return self.wait(msgid)
        except PullbackError:
            raise  # its reply came
        except BaseException:
            self._give_up(msgid, method)
            raise

    # -- methods ---------------------------------------------------------
    def hello(self):
        """{protocol, version, devices, dtypes, limits}."""
        return self.call("hello")

    def ops(self):
        """The op catalogue: {ops: {name: {inputs, outputs, options, dtypes, devices, wrt}}}."""
        return self.call("ops")

    def stats(self):
        """The daemon's counters (tapes, tape_bytes, connections, ...)."""
        return self.call("stats")

    def forward(self, op, inputs, options=None, device=None, order=None, into=None):
        """The op's outputs (name -> numpy array); no tape is kept.

        Inputs may be BufferTensors. ``into`` maps output names to (buffer,
        offset): those outputs are written there and come back as BufferTensors.
        """
        params = _params(op=op, inputs=_tensors(inputs), options=_wire_value(options),
                         device=device, order=order, into=_into(into))
        return _arrays(self.call("forward", params)["outputs"])

    def augmented_forward(self, op, inputs, wrt, options=None, device=None, scope=None, ttl_s=None,
                          order=None, into=None):
        """(outputs, Tape): the forward, keeping what the gradients of ``wrt`` need (``into`` as forward)."""
        params = _params(op=op, inputs=_tensors(inputs), options=_wire_value(options), device=device,
                         order=order, wrt=list(wrt), scope=scope, ttl_s=ttl_s, into=_into(into))
        result = self.call("augmented_forward", params)
        return _arrays(result["outputs"]), Tape(self, result["tape"], result["tape_bytes"])

    def reverse(self, tape, cotangents, keep=False, order=None, into=None, accumulate=False):
        """The gradients (name -> numpy array) for a Tape or raw handle.

        Consumes the tape unless ``keep``. Reply warnings are issued as
        GaugeWarning and kept in ``self.last_warnings``. ``into`` maps input
        names to (buffer, offset): those gradients are written there (added
        to what is there with ``accumulate``) and come back as BufferTensors.
        """
        params = _params(tape=_handle(tape), cotangents=_tensors(cotangents), keep=keep or None,
                         order=order, into=_into(into), accumulate=accumulate or None)
        result = self.call("reverse", params)
        if isinstance(tape, Tape) and not keep:
            tape._done = True
        self.last_warnings = list(result.get("warnings", []))
        for w in self.last_warnings:
            warnings.warn(w, GaugeWarning, stacklevel=2)
        return _arrays(result["gradients"])

    def release(self, tape):
        """Release a Tape or raw handle; returns whether the daemon held it."""
        released = self.call("release", {"tape": _handle(tape)})["released"]
        if isinstance(tape, Tape):
            tape._done = True
        return released

    def register_buffer(self, fd, size, device=None):
        """Register ``size`` bytes of fd (a memfd or shm file) with the daemon; returns the buffer id.

        The fd is passed with the request (SCM_RIGHTS); the caller keeps its own.  With ``device="cuda:N"``
        fd is GPU memory exported as a file descriptor (a CUDA virtual-memory allocation's
        ``cuMemExportToShareableHandle``, POSIX fd): calls on that GPU then read and write it in place.
        """
        params = {"size": int(size)}
        if device is not None:
            params["device"] = device
        return self.call("register_buffer", params, fds=[fd])["buffer"]

    def unregister_buffer(self, buffer):
        """Drop a buffer (an id or SharedBuffer); requests already sent still see it."""
        buffer = buffer.id if isinstance(buffer, SharedBuffer) else int(buffer)
        return self.call("unregister_buffer", {"buffer": buffer})["unregistered"]

    def shared_buffer(self, size, name="pullbackd"):
        """A new memfd of ``size`` bytes, mapped here and registered: a SharedBuffer."""
        return SharedBuffer(self, size, name)

    def check(self, op, inputs, wrt, options=None, device=None, seed=None):
        """The server's finite-difference check of the op's reverse: {max_rel_err, per_input}."""
        params = _params(op=op, inputs=_tensors(inputs), options=_wire_value(options), device=device,
                         wrt=list(wrt), seed=seed)
        return self.call("check", params)
