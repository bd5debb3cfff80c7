"""python.flood: bounded buffering across connections (issue 15).

Connections that each send most of a large message and stop must not take
the daemon's memory: past --max-buffered-bytes it stops reading from them,
and when nothing can give memory back (nothing in flight, nobody moving
for a second) it answers the connection holding the most
resource_exhausted (naming the limit) and closes it.  Clients within the
limits are slowed down, never refused; replies a client does not read
count against the caps too.  Meanwhile a new client is answered, and once the flood is
gone a legitimate 100 MiB request goes through.  Also the per-uid cap on
open connections, and the heap's trim after --idle-trim seconds idle.  The
resident-memory bound is checked outside ASan
(whose shadow memory and quarantine would blur it).

Run: PULLBACKD_BIN=build/daemon/pullbackd /usr/bin/python3 tests/python/test_flood.py
"""

import os
import select
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
sys.path.insert(0, HERE)
import msgpack  # noqa: E402
import pullbackd  # noqa: E402
from daemon_case import DaemonCase  # noqa: E402

MiB = 1 << 20
CAP = 256 * MiB
# ASan and TSan keep shadow memory and allocators of their own: RSS says little
UNDER_ASAN = "ASAN_OPTIONS" in os.environ or "TSAN_OPTIONS" in os.environ


def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def flood_prefix(nbytes):
    """A forward request whose tensor data declares nbytes: all but the payload."""
    msg = msgpack.packb([0, 1, "forward", [{"op": "tensoradd", "inputs": {
        "A": {"dtype": "f64", "shape": [nbytes // 8], "order": "C", "data": b""}}}]])
    assert msg.endswith(b"\xc4\x00")
    return msg[:-2] + struct.pack(">BI", 0xc6, nbytes)


def read_error(sock, timeout=5.0):
    """The first reply on sock, or None if it closed or stayed silent."""
    sock.settimeout(timeout)
    u = msgpack.Unpacker(raw=False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return None
            u.feed(data)
            for msg in u:
                return msg
    except OSError:
        return None


class Flood(DaemonCase):
    DAEMON_ARGS = ["--max-buffered-bytes", "256M", "--max-buffered-bytes-per-uid", "256M",
                   "--max-message-bytes", "256M"]

    def test_flood(self):
        with pullbackd.Client(self.path, timeout=10) as c:
            limits = c.hello()["limits"]
            self.assertEqual(limits["max_buffered_bytes"], CAP)
            self.assertEqual(limits["max_buffered_bytes_per_uid"], CAP)
            c.forward("tensoradd", {"A": np.ones(1000)})  # warm up
        base = rss(self.proc.pid)
        peak = [base]
        sampling = [True]

        def sample():
            while sampling[0]:
                peak[0] = max(peak[0], rss(self.proc.pid))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        n_flood, send = 5, 200 * MiB
        socks = [socket.socket(socket.AF_UNIX) for _ in range(n_flood)]
        outcome = [None] * n_flood
        chunk = b"\x00" * MiB

        def flood(i):
            s = socks[i]
            s.connect(self.path)
            s.settimeout(2.0)  # a starved sender stalls: give up then
            try:
                s.sendall(flood_prefix(240 * MiB))
                for _ in range(send // MiB):
                    s.sendall(chunk)
                outcome[i] = "sent"
            except socket.timeout:
                outcome[i] = "stalled"
            except OSError:
                outcome[i] = "closed"

        threads = [threading.Thread(target=flood, args=(i,)) for i in range(n_flood)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        # Mid-flood, a new client is answered.
        t0 = time.monotonic()
        with pullbackd.Client(self.path, timeout=10) as c:
            self.assertEqual(c.hello()["protocol"], 1)
            np.testing.assert_array_equal(c.forward("tensoradd", {"A": np.arange(4.0)})["C"], np.arange(4.0))
        self.assertLess(time.monotonic() - t0, 5.0)
        for t in threads:
            t.join(60)
        sampling[0] = False
        sampler.join()
        # The daemon refused some of them, naming the limit: the first
        # after the stalled holder had a window or two to move (seconds
        # under TSan), so look again until one is answered.
        errors = []
        deadline = time.monotonic() + 15
        while not errors and time.monotonic() < deadline:
            for s in socks:
                e = read_error(s, timeout=0.5)
                if e is not None:
                    errors.append(e[2])
        for s in socks:
            s.close()
        self.assertGreaterEqual(len(errors), 1, outcome)
        for e in errors:
            self.assertEqual(e["code"], "resource_exhausted")
            self.assertIn("max_buffered_bytes", e["message"])
        print(f"flood: {n_flood} connections x {send // MiB} MiB: daemon RSS rose by "
              f"{(peak[0] - base) / MiB:.0f} MiB (cap {CAP // MiB} MiB); outcomes {outcome}", file=sys.stderr)
        if not UNDER_ASAN:
            # Unbounded, five 200 MiB messages would be 1 GiB resident.
            self.assertLess(peak[0] - base, CAP + 64 * MiB, f"RSS rose by {(peak[0] - base) / MiB:.0f} MiB")
        if not UNDER_ASAN:
            # The closed connections' buffers go back to the system (on
            # libuv's thread pool, not the loop), long before the idle trim
            # (10 s by default) could have done it.
            deadline = time.monotonic() + 3.0
            while rss(self.proc.pid) - base >= 64 * MiB and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertLess(rss(self.proc.pid) - base, 64 * MiB, "the flood's buffers were not released")
        # The flood is gone: a legitimate 100 MiB request goes through.
        A = np.random.default_rng(1).standard_normal(100 * MiB // 8)
        with pullbackd.Client(self.path, timeout=60) as c:
            np.testing.assert_array_equal(c.forward("tensoradd", {"A": A})["C"], A)
            st = c.stats()
            self.assertEqual(st["connections"], 1)


def request(msgid, method, params):
    return msgpack.packb([0, msgid, method, [params]])


def tensor(a):
    return {"dtype": "f64", "shape": list(a.shape), "order": "C", "data": a.tobytes()}


class OverCapByReplies(DaemonCase):
    """Replies nobody reads count against the caps: a connection holding
    replies takes no new message while a cap is reached.  A runs a slow
    request, then asks for 8 MiB replies it does not read: it stops at the
    cap.  B, a client within the limits, starves meanwhile: it waits for
    A's request in flight, and then, if A's replies still fill the cap, for
    a second in which A's client reads nothing, after which A, holding the
    most, is closed; B is served.  B used to be refused (the holder of the
    largest incomplete message) while the unread replies kept the total
    past the cap."""

    DAEMON_ARGS = ["--max-buffered-bytes", "48M", "--max-buffered-bytes-per-uid", "48M",
                   "--max-queued-bytes-per-connection", "128M"]

    def test_unread_replies_push_nobody_out(self):
        rng = np.random.default_rng(3)
        # A: a slow, data-light request (a 2048^2 SVD: 32 MiB in, a second
        # or more here), then seven outer products whose 8 MiB replies it
        # never reads: 56 MiB of replies asked, past the 48 MiB cap.
        a = socket.socket(socket.AF_UNIX)
        a.connect(self.path)
        a.sendall(request(1, "forward", {"op": "svd_vals", "inputs": {"A": tensor(rng.standard_normal((2048, 2048)))}}))
        v = tensor(np.ones(1024))
        for i in range(7):
            a.sendall(request(2 + i, "forward", {"op": "tensorcontract", "inputs": {"A": v, "B": v},
                                                 "options": {"pA": [[0], []], "pB": [[], [0]], "pAB": [0, 1]}}))
        time.sleep(0.3)
        held = buffered_bytes(self.path)
        self.assertLess(held, 48 * MiB + 16 * MiB, f"{held / MiB:.0f} MiB buffered")
        B = rng.standard_normal(16 * MiB // 8)
        with pullbackd.Client(self.path, timeout=30) as c:
            np.testing.assert_array_equal(c.forward("tensoradd", {"A": B})["C"], B)
        # A: closed if B had to wait for it (it held the most, and its
        # client read nothing for a second), else its replies wait for it;
        # either way what it gets is its replies (in the order they were
        # done: two workers), each once, none an error.
        a.settimeout(10)
        u = msgpack.Unpacker(raw=False)
        replies = []
        while len(replies) < 8:
            try:
                data = a.recv(1 << 20)
            except ConnectionResetError:  # closed with replies unread
                break
            if not data:
                break
            u.feed(data)
            replies.extend(u)
        ids = [r[1] for r in replies]
        self.assertEqual(len(set(ids)), len(ids), ids)
        self.assertLessEqual(set(ids), set(range(1, 9)), ids)
        self.assertTrue(all(r[2] is None for r in replies), [r[2] for r in replies if r[2]])
        a.close()


class WithinTheCapsNeverRefused(DaemonCase):
    """Twelve clients at once, each with a 20 MiB request (its 20 MiB reply
    read), under a 128 MiB per-uid cap: each is served, some after the
    others.  Read buffers sized to their messages filled the cap with
    partial messages, nothing was in flight yet, and the daemon closed the
    largest incomplete message again and again (7 of 12 refused), though
    their clients were still sending."""

    DAEMON_ARGS = ["--max-buffered-bytes", "256M", "--max-buffered-bytes-per-uid", "128M",
                   "--max-message-bytes", "32M"]

    def test_all_served(self):
        A = np.random.default_rng(6).standard_normal(20 * MiB // 8)
        got = {}

        def client(i):
            try:
                with pullbackd.Client(self.path, timeout=60) as c:
                    C = c.forward("tensoradd", {"A": A}, options={"alpha": float(i)})["C"]
                    got[i] = "ok" if np.array_equal(C, i * A) else "wrong"
            except Exception as e:  # noqa: BLE001: reported below
                got[i] = repr(e)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        self.assertEqual(got, {i: "ok" for i in range(12)})


def partial_sender(path, declared, sent):
    """A connection that sent `sent` bytes of a message declaring `declared`."""
    t = socket.socket(socket.AF_UNIX)
    t.connect(path)
    t.sendall(flood_prefix(declared) + b"\0" * sent)
    return t


def assert_refused(test, t):
    """t was answered resource_exhausted naming max_buffered_bytes; closes it."""
    e = read_error(t, timeout=5.0)
    test.assertIsNotNone(e, "neither refused nor served")
    test.assertEqual(e[2]["code"], "resource_exhausted")
    test.assertIn("max_buffered_bytes", e[2]["message"])
    t.close()


def served_meanwhile(test, background, mib, seed):
    """A client's mib MiB tensoradd, served while background(stop) runs in
    a thread (until stop[0]); the seconds it took."""
    stop = [False]
    th = threading.Thread(target=background, args=(stop,))
    th.start()
    try:
        A = np.random.default_rng(seed).standard_normal(mib * MiB // 8)
        t0 = time.monotonic()
        with pullbackd.Client(test.path, timeout=30) as c:
            np.testing.assert_array_equal(c.forward("tensoradd", {"A": A})["C"], A)
        return time.monotonic() - t0
    finally:
        stop[0] = True
        th.join(10)


class TrickleHoldsNobodyOff(DaemonCase):
    """A client that trickles its big message (64 KiB every half second)
    looks like it is still moving, but too slowly to give memory back:
    past a window of a second with less than 1 MiB read from it, it holds
    the most and is refused, and a client waiting for room is served."""

    DAEMON_ARGS = ["--max-buffered-bytes", "128M", "--max-buffered-bytes-per-uid", "128M",
                   "--max-message-bytes", "256M"]

    def test_trickle_refused(self):
        t = partial_sender(self.path, 100 * MiB, 60 * MiB)

        def trickle(stop):
            try:
                while not stop[0]:
                    t.sendall(b"\0" * (64 << 10))
                    time.sleep(0.5)
            except OSError:
                pass

        self.assertLess(served_meanwhile(self, trickle, 40, 8), 10.0)
        assert_refused(self, t)


class NewConnectionsHoldNobodyOff(DaemonCase):
    """T sends 30 of a declared 40 MiB and stops; L, waiting for room, is
    served once T is refused, though a client opens a connection every
    0.4 s and sends it one byte: each new connection counted as moving at
    its first look, and held the decision off for good."""

    DAEMON_ARGS = ["--max-buffered-bytes", "64M", "--max-buffered-bytes-per-uid", "64M",
                   "--max-message-bytes", "256M"]

    def test_refused_all_the_same(self):
        t = partial_sender(self.path, 40 * MiB, 30 * MiB)

        def spoil(stop):
            old = []
            while not stop[0]:
                s = socket.socket(socket.AF_UNIX)
                s.connect(self.path)
                s.sendall(b"\x94")  # the first byte of a message
                old.append(s)
                if len(old) > 3:
                    old.pop(0).close()
                time.sleep(0.4)
            for s in old:
                s.close()

        served_meanwhile(self, spoil, 40, 9)
        assert_refused(self, t)


class HalfClosedWithUnreadReplies(DaemonCase):
    """A client that sends its requests, shuts its writing side and never
    reads holds its replies while its connection waits to close after
    them: it is the one closed when another client needs the room (it was
    passed over, and the other, holding less, refused)."""

    DAEMON_ARGS = ["--max-buffered-bytes", "32M", "--max-buffered-bytes-per-uid", "32M",
                   "--max-queued-bytes-per-connection", "128M"]

    def test_closed_not_the_other(self):
        h = socket.socket(socket.AF_UNIX)
        h.connect(self.path)
        v = tensor(np.ones(1024))
        for i in range(3):  # 3 x 8 MiB replies, not read
            h.sendall(request(1 + i, "forward", {"op": "tensorcontract", "inputs": {"A": v, "B": v},
                                                 "options": {"spec": "i,j->ij"}}))
        h.shutdown(socket.SHUT_WR)
        time.sleep(0.5)
        A = np.random.default_rng(10).standard_normal(16 * MiB // 8)
        with pullbackd.Client(self.path, timeout=20) as c:
            np.testing.assert_array_equal(c.forward("tensoradd", {"A": A})["C"], A)
        h.close()


class RepliesFarBiggerThanRequests(DaemonCase):
    """Eight connections each send one 16 KiB qr_full of a 2048×1 matrix
    (a 32 MiB reply) and read nothing.  Each gets its one request in
    (its message is small), so the replies pass the cap whether or not
    anyone waits for room: the connections holding them close, the most
    first, until what stays is under the cap (they held 407 MB under a
    64 MiB cap, for good)."""

    DAEMON_ARGS = ["--max-buffered-bytes", "64M", "--max-buffered-bytes-per-uid", "64M",
                   "--max-queued-bytes-per-connection", "16M"]

    def test_reclaimed(self):
        req = request(1, "forward", {"op": "qr_full", "inputs": {"A": tensor(np.ones((2048, 1)))}})
        hogs = []
        for _ in range(8):
            h = socket.socket(socket.AF_UNIX)
            h.connect(self.path)
            h.sendall(req)
            hogs.append(h)
        deadline = time.monotonic() + 40  # TSan computes slowly
        held = buffered_bytes(self.path, timeout=40)
        while held > 64 * MiB and time.monotonic() < deadline:
            time.sleep(0.25)
            held = buffered_bytes(self.path, timeout=40)
        self.assertLessEqual(held, 64 * MiB, f"{held / MiB:.0f} MiB buffered")
        A = np.random.default_rng(11).standard_normal(8 * MiB // 8)
        with pullbackd.Client(self.path, timeout=40) as c:
            np.testing.assert_array_equal(c.forward("tensoradd", {"A": A})["C"], A)
        for h in hogs:
            h.close()


class UnreadRepliesOfOneUid(DaemonCase):
    """One uid's connections that never read their replies hold at most
    about twice its per-uid cap (each stops at its share once the cap is
    reached), not max_queued_bytes_per_connection each (24 of them held
    341 MiB under a 32 MiB per-uid cap); another uid is still served."""

    DAEMON_ARGS = ["--max-buffered-bytes", "64M", "--max-buffered-bytes-per-uid", "32M",
                   "--max-queued-bytes-per-connection", "16M", "--socket-mode", "0666"]

    def test_bounded(self):
        a = tensor(np.ones(256))
        req = request(1, "forward", {"op": "tensorcontract", "inputs": {"A": a, "B": a},
                                     "options": {"spec": "i,j->ij"}})  # 512 KiB replies
        hogs = []
        for _ in range(24):
            h = socket.socket(socket.AF_UNIX)
            h.connect(self.path)
            h.setblocking(False)
            try:
                for _ in range(60):
                    h.send(req)
            except BlockingIOError:
                pass
            hogs.append(h)
        time.sleep(1.5)
        held = buffered_bytes(self.path)
        self.assertLess(held, 2 * 32 * MiB, f"{held / MiB:.0f} MiB buffered")
        if os.geteuid() == 0:  # another uid, holding nothing, sends a 4 MiB request
            os.chmod(self.dir, 0o755)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.close(r)
                    os.setgid(65534)
                    os.setuid(65534)
                    x = np.ones(MiB // 2)
                    with pullbackd.Client(self.path, timeout=30) as c:
                        ok = np.array_equal(c.forward("tensoradd", {"A": x})["C"], x)
                    os.write(w, b"ok" if ok else b"wrong")
                    code = 0
                except Exception as e:  # noqa: BLE001: reported by the parent
                    os.write(w, repr(e).encode())
                finally:
                    os._exit(code)
            os.close(w)
            with os.fdopen(r, "rb") as f:
                said = f.read().decode()
            os.waitpid(pid, 0)
            self.assertEqual(said, "ok")
        for h in hogs:
            h.close()


class InFlightOfAClosedConnection(DaemonCase):
    """A request still running for a connection that has closed gives its
    bytes back when it ends: a connection starved meanwhile waits for it
    and is then served, not refused."""

    DAEMON_ARGS = ["--max-buffered-bytes", "48M", "--max-buffered-bytes-per-uid", "48M"]

    def test_waits_for_it(self):
        rng = np.random.default_rng(4)
        a = socket.socket(socket.AF_UNIX)
        a.connect(self.path)
        a.sendall(request(1, "forward", {"op": "svd_vals", "inputs": {"A": tensor(rng.standard_normal((2048, 2048)))}}))
        a.close()
        time.sleep(0.2)  # the SVD (32 MiB in, a second or more) runs
        B = rng.standard_normal(24 * MiB // 8)
        with pullbackd.Client(self.path, timeout=30) as c:
            np.testing.assert_array_equal(c.forward("tensoradd", {"A": B})["C"], B)


class PerUidCapNotBehindAnotherUid(DaemonCase):
    """A connection over its uid's cap (the total far from its own) waits
    only for its own uid's requests in flight: another uid's long request
    gives none of its uid's bytes back.  With nothing of its uid in flight
    the holder of the uid's largest incomplete message is answered at
    once, not after the other uid's request."""

    DAEMON_ARGS = ["--max-buffered-bytes", "1G", "--max-buffered-bytes-per-uid", "48M", "--socket-mode", "0666"]

    @unittest.skipIf(os.geteuid() != 0, "needs root, to connect as a second uid")
    def test_not_behind_another_uid(self):
        os.chmod(self.dir, 0o755)
        rng = np.random.default_rng(5)
        a = socket.socket(socket.AF_UNIX)
        a.connect(self.path)
        # root: a slow, data-light request (a 2048^2 SVD, a second or more).
        a.sendall(request(1, "forward", {"op": "svd_vals", "inputs": {"A": tensor(rng.standard_normal((2048, 2048)))}}))
        time.sleep(0.2)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # uid 65534: one message past its uid's 48 MiB cap
            code = 1
            try:
                os.close(r)
                os.setgid(65534)
                os.setuid(65534)
                b = socket.socket(socket.AF_UNIX)
                b.connect(self.path)
                b.settimeout(5.0)
                try:
                    b.sendall(flood_prefix(64 * MiB) + b"\x00" * (60 * MiB))
                except OSError:
                    pass  # refused (closed) or stalled: the reply says which
                e = read_error(b, timeout=20.0)
                t = time.monotonic()
                os.write(w, msgpack.packb([t, e[2]["code"] if e else None, e[2]["message"] if e else ""]))
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        a.settimeout(60)
        u = msgpack.Unpacker(raw=False)
        reply = None
        while reply is None:
            data = a.recv(1 << 20)
            self.assertTrue(data, "the SVD's connection closed")
            u.feed(data)
            for msg in u:
                reply = msg
        t_svd = time.monotonic()
        a.close()
        _, status = os.waitpid(pid, 0)
        self.assertEqual(status, 0)
        with os.fdopen(r, "rb") as f:
            t_err, code, message = msgpack.unpackb(f.read(), raw=False)
        self.assertIsNone(reply[2], reply[2])
        self.assertEqual(code, "resource_exhausted", message)
        self.assertIn("max_buffered_bytes_per_uid", message)
        self.assertLess(t_err, t_svd, "the refusal waited for another uid's request")


class IdleTrim(DaemonCase):
    """Memory kept for reuse (the large-block cache, kernels/mem.h, and
    glibc's heap) goes back to the system after --idle-trim seconds
    without work."""

    DAEMON_ARGS = ["--idle-trim", "2"]

    @unittest.skipIf(UNDER_ASAN, "the sanitizer's allocator ignores malloc_trim")
    def test_trim(self):
        A = np.random.default_rng(2).standard_normal(100 * MiB // 8)
        with pullbackd.Client(self.path, timeout=60) as c:
            C = c.forward("tensoradd", {"A": A})["C"]
            held = rss(self.proc.pid)  # before the next sweep can trim
            np.testing.assert_array_equal(C, A)
            time.sleep(4.0)
            after = rss(self.proc.pid)
            print(f"idle trim: RSS {held / MiB:.0f} MiB after a 100 MiB request, {after / MiB:.0f} MiB "
                  f"after 4 s idle", file=sys.stderr)
            self.assertLess(after, held - 100 * MiB)
            # Still serving, and the next big request works.
            np.testing.assert_array_equal(c.forward("tensoradd", {"A": A})["C"], A)

    @unittest.skipIf(UNDER_ASAN, "the sanitizer's allocator ignores malloc_trim")
    def test_freed_after_the_trim(self):
        """Blocks freed once the trim has run (a closed connection's tapes)
        go back too: they stayed cached until the workers ran again."""
        W = np.random.default_rng(7).standard_normal((1024, 1024))  # 8 MiB
        c = pullbackd.Client(self.path, timeout=60)
        tapes = [c.augmented_forward("fused_dense", {"weight": W, "x": W}, ["weight", "x"])[1] for _ in range(12)]
        time.sleep(3.5)  # idle: the trim runs, the tapes still held
        before = rss(self.proc.pid)
        for t in tapes:
            t._done = True  # freed by the close, not released one by one
        c.close()
        deadline = time.monotonic() + 6.0
        while rss(self.proc.pid) > before - 150 * MiB and time.monotonic() < deadline:
            time.sleep(0.1)
        after = rss(self.proc.pid)
        print(f"idle trim after close: RSS {before / MiB:.0f} MiB with 12 tapes of 16 MiB, {after / MiB:.0f} MiB "
              f"after", file=sys.stderr)
        self.assertLess(after, before - 150 * MiB)


class ConnectionsPerUid(DaemonCase):
    DAEMON_ARGS = ["--max-connections-per-uid", "3"]

    def test_cap(self):
        time.sleep(0.3)  # the setup's probe connection is closed and gone
        clients = [pullbackd.Client(self.path, timeout=10) for _ in range(3)]
        for c in clients:
            c.hello()
        extra = socket.socket(socket.AF_UNIX)
        extra.connect(self.path)
        e = read_error(extra)
        self.assertIsNotNone(e)
        self.assertEqual(e[2]["code"], "resource_exhausted")
        self.assertIn("max_connections_per_uid", e[2]["message"])
        self.assertEqual(e[2]["limit"], "max_connections_per_uid")
        self.assertEqual(extra.recv(1), b"")  # then closed
        extra.close()
        # The client says so too, not BrokenPipeError, whether its send
        # met the close or its wait did.
        for pause in (0.3, 0):
            c = pullbackd.Client(self.path, timeout=10)
            time.sleep(pause)
            with self.assertRaises(pullbackd.PullbackError) as cm:
                c.hello()
            self.assertEqual(cm.exception.code, "resource_exhausted")
            self.assertEqual(cm.exception.details["limit"], "max_connections_per_uid")
            c.close()
        clients.pop().close()
        time.sleep(0.2)
        with pullbackd.Client(self.path, timeout=10) as c:
            self.assertEqual(c.hello()["limits"]["max_connections_per_uid"], 3)
        for c in clients:
            c.close()


class TwoSlowMessagesWithinTheCap(DaemonCase):
    """Two incomplete messages whose sum fits the cap (12 + 36 of 60 MiB)
    are both read and answered: a read buffer is sized to what its message
    declares, never more on a guess (room kept after a payload counted
    against the cap and had the first closed as holding the largest
    incomplete message)."""
    DAEMON_ARGS = ["--max-buffered-bytes", "60M", "--max-buffered-bytes-per-uid", "60M",
                   "--max-message-bytes", "256M"]

    def test_both_served(self):
        sizes = (12 * MiB, 36 * MiB)
        socks = []
        for n, sent in zip(sizes, (8 * MiB, 1 * MiB)):
            s = socket.socket(socket.AF_UNIX)
            s.connect(self.path)
            s.sendall(flood_prefix(n) + b"\0" * sent)
            socks.append((s, n, sent))
            time.sleep(0.3)
        for s, n, sent in socks:
            self.assertIsNone(read_error(s, 0.5), "a client within the caps was answered early")
        for s, n, sent in socks:
            s.settimeout(30)  # read_error left 0.5 s: too short for a slow daemon's reads
            s.sendall(b"\0" * (n - sent))
        for s, n, sent in socks:
            reply = read_error(s, 30)
            self.assertIsNotNone(reply, "no reply")
            self.assertIsNone(reply[2], reply[2])
            self.assertEqual(reply[3]["outputs"]["C"]["shape"], [n // 8])
            s.close()


def buffered_bytes(path, timeout=10):
    with pullbackd.Client(path, timeout=timeout) as c:
        text = c.call("metrics", {})["text"]
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("pullbackd_buffered_bytes ")))


class RepliesToTinyRequests(DaemonCase):
    """Clients that pipeline tiny requests with large replies (ops: 25 bytes
    in, about 4 KiB out) and do not read: one 64 KiB read used to queue
    400 times its size in replies, past every cap (20 such clients held
    270 MB under a 16 MiB max_buffered_bytes).  Now each connection holds
    to max_queued_bytes_per_connection, plus a read buffer and a batch of
    small replies; nothing is lost, and a client that reads at last gets
    every reply."""

    N, PER = 12, 3000
    DAEMON_ARGS = ["--max-queued-bytes-per-connection", "512K"]

    def test_caps_hold(self):
        socks = []
        for k in range(self.N):
            s = socket.socket(socket.AF_UNIX)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(self.path)
            s.sendall(b"".join(request(i, "ops", {}) for i in range(self.PER)))
            socks.append(s)
        time.sleep(1.0)
        held = buffered_bytes(self.path)  # also: a new client is answered
        self.assertLessEqual(held, self.N * (512 + 128 + 256 + 8) * 1024, f"{held} bytes held")
        for s in socks[1:]:
            s.close()
        s = socks[0]
        s.settimeout(30)
        u = msgpack.Unpacker(raw=False)
        got = set()
        while len(got) < self.PER:
            data = s.recv(1 << 20)
            self.assertTrue(data, f"closed after {len(got)} replies")
            u.feed(data)
            for msg in u:
                self.assertIsNone(msg[2])
                got.add(msg[1])
        self.assertEqual(got, set(range(self.PER)))
        s.close()


class BurstThatIsRead(DaemonCase):
    """A client that writes a burst of requests at once (16 of them, each
    asking for an 8 MiB reply: 128 MiB in all, eight times the per-uid cap)
    while another of its threads reads every reply is within the limits:
    the daemon waits for it to read.  It used to close such a client within
    milliseconds, about every other time, as holding replies its client had
    not read: the replies being written did not count as moving (c307f07).
    (A client that reads only after writing the whole burst cannot be
    served past the caps: it would wait for the daemon to read, the daemon
    for it.)"""

    DAEMON_ARGS = ["--max-buffered-bytes", "32M"]

    def burst(self, n, seed):
        rng = np.random.default_rng(seed)
        W, x = tensor(rng.standard_normal((1024, 8))), tensor(rng.standard_normal((8, 1024)))
        s = socket.socket(socket.AF_UNIX)
        s.connect(self.path)
        s.settimeout(30)
        got, closed = [], []

        def read():
            u = msgpack.Unpacker(raw=False, max_bin_len=64 * MiB)
            try:
                while len(got) < n:
                    data = s.recv(1 << 20)
                    if not data:
                        closed.append(len(got))
                        return
                    u.feed(data)
                    got.extend(u)
            except OSError as e:
                closed.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            s.sendall(b"".join(request(i + 1, "forward", {"op": "fused_dense", "inputs": {"weight": W, "x": x}})
                               for i in range(n)))
        finally:
            reader.join(60)
            s.close()
        self.assertEqual(closed, [], f"closed after {len(got)} replies: {[r[2] for r in got if r[2]]}")
        self.assertEqual(sorted(r[1] for r in got), list(range(1, n + 1)))
        self.assertEqual([r[2] for r in got], [None] * n)
        self.assertEqual({len(r[3]["outputs"]["y"]["data"]) for r in got}, {8 * MiB})

    def test_every_reply_comes(self):
        for k in range(3):
            with self.subTest(burst=k):
                self.burst(16, k)


class CapLoweredByReload(DaemonCase):
    """A reload that lowers --max-buffered-bytes below what is held applies
    at once: a client holding replies it does not read, past the new cap,
    is closed within a few seconds with nothing else happening.  It used to
    stay until some other connection's request came (c307f07)."""

    @classmethod
    def setUpClass(cls):
        cls.confdir = tempfile.mkdtemp(prefix="pbconf")
        cls.conf = os.path.join(cls.confdir, "pullbackd.conf")
        with open(cls.conf, "w") as f:
            f.write("max-buffered-bytes = 256M\n")
        cls.DAEMON_ARGS = ["--config", cls.conf]
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        try:
            super().tearDownClass()
        finally:
            shutil.rmtree(cls.confdir)

    def test_applies_at_the_reload(self):
        rng = np.random.default_rng(8)
        W, x = tensor(rng.standard_normal((1024, 8))), tensor(rng.standard_normal((8, 1024)))
        s = socket.socket(socket.AF_UNIX)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(self.path)
        for i in range(6):  # 48 MiB of replies it does not read
            s.sendall(request(i + 1, "forward", {"op": "fused_dense", "inputs": {"weight": W, "x": x}}))
        deadline = time.monotonic() + 20
        last = -1
        while True:  # until all six replies are queued: 40 MiB and more, and still
            held = buffered_bytes(self.path)
            if held >= 40 * MiB and held == last:
                break
            self.assertLess(time.monotonic(), deadline, f"the replies were never all queued ({held} bytes)")
            last = held
            time.sleep(0.5)
        with open(self.conf, "w") as f:
            f.write("max-buffered-bytes = 16M\n")
        self.proc.send_signal(signal.SIGHUP)
        # Nothing else talks to the daemon now: the reload alone must act
        # (a metrics request would wake it), so the socket is watched for
        # the daemon's end closing.
        p = select.poll()
        p.register(s, select.POLLRDHUP)
        ev = p.poll(8000)
        self.assertTrue(ev and ev[0][1] & (select.POLLRDHUP | select.POLLHUP),
                        "the connection holding 48 MiB is still open 8 s after the cap became 16 MiB")
        held = buffered_bytes(self.path)
        self.assertLess(held, 16 * MiB, f"{held / MiB:.0f} MiB still held after the reload")
        s.close()


if __name__ == "__main__":
    unittest.main()
