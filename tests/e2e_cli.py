"""e2e.cli: the pullbackctl binary against a private daemon.

Runs the built pullbackctl ($PULLBACKCTL_BIN) for each subcommand and checks
its output, its --json (parsed with the json module) and its exit status:
0 ok, 1 error answered by the daemon, 2 usage, 3 cannot connect, 4
permission denied, 5 connection lost or timed out.  The daemon is
$PULLBACKD_BIN (tests/python/daemon_case.py starts it); tapes are made with
the Python client so that the figures pullbackctl prints can be compared
with what is known to be held.  Statuses 1 and 5 need a daemon that
misbehaves: a small fake server in a thread plays it.

The permission checks run another uid (nobody) and so need root; as
another user they are skipped.
"""

import collections
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "python"))
sys.path.insert(0, os.path.join(HERE, "..", "clients", "python"))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import pullbackd  # noqa: E402
from daemon_case import DaemonCase, wait_for_socket  # noqa: E402

CTL = os.environ.get("PULLBACKCTL_BIN", os.path.join(HERE, "..", "build", "clients", "cli", "pullbackctl"))
DAEMON = os.environ.get("PULLBACKD_BIN", "build/daemon/pullbackd")

# Only what a test sets: the socket chain must not find a daemon of the host.
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if k not in ("PULLBACKD_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")}


def ctl(*args, env=None, user=None, timeout=30):
    """Run pullbackctl; (exit status, stdout, stderr)."""
    e = dict(CLEAN_ENV)
    e.update(env or {})
    kw = {}
    if user is not None:
        kw["user"] = user
    p = subprocess.run([CTL, *args], capture_output=True, text=True, env=e, timeout=timeout, **kw)
    return p.returncode, p.stdout, p.stderr


def make_tapes(client, n, size=3):
    """n tapes of fused_dense (W size×size, x size×2, bias) on client."""
    rng = np.random.default_rng(n)
    tapes = []
    for _ in range(n):
        W, x, b = rng.random((size, size)), rng.random((size, 2)), rng.random(size)
        _, tape = client.augmented_forward("fused_dense", {"weight": W, "x": x, "bias": b},
                                           wrt=["weight", "x", "bias"], options={"act": "gelu"})
        tapes.append(tape)
    return tapes


class Usage(unittest.TestCase):
    """What needs no daemon at all."""

    def test_help(self):
        rc, out, err = ctl("--help")
        self.assertEqual(rc, 0)
        for word in ("status", "tapes", "metrics", "ping", "drain", "shutdown", "--json", "--socket",
                     "Exit status", "Examples", "PULLBACKD_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
            self.assertIn(word, out)
        self.assertEqual(ctl("help")[0], 0)
        rc, out, _ = ctl("--version")
        self.assertEqual(rc, 0)
        self.assertTrue(out.startswith("pullbackctl "))

    def test_usage_errors(self):
        for args in ([], ["frobnicate"], ["status", "extra"], ["--bogus", "status"], ["ping", "-c", "0"],
                     ["ping", "-c", "x"], ["status", "-c", "3"], ["tapes", "--wait"], ["status", "--timeout", "0"],
                     ["status", "--socket"], ["ping", "-i", "-1"]):
            rc, out, err = ctl(*args)
            self.assertEqual(rc, 2, f"{args}: {err}")
            self.assertEqual(out, "", args)
            self.assertTrue(err.startswith("pullbackctl: "), f"{args}: {err}")  # getopt's too, not argv[0]
        # Past the cap the message names the cap, not "a positive number".
        rc, _, err = ctl("status", "--timeout", "31536001")
        self.assertEqual(rc, 2)
        self.assertIn("at most 31536000", err)

    def test_output_not_written(self):
        for args in (["--help"], ["--version"], ["help"]):
            with open("/dev/full", "w") as full:
                p = subprocess.run([CTL, *args], stdout=full, stderr=subprocess.PIPE, text=True, env=CLEAN_ENV)
            self.assertEqual(p.returncode, 5, args)
            self.assertIn("writing the output", p.stderr)

    def test_connect_timeout(self):
        """A daemon that does not accept (stopped; its backlog full) gives
        up within --timeout, exit 5: a health check must not hang."""
        d = tempfile.mkdtemp(prefix="pbctl")
        lis = socket.socket(socket.AF_UNIX)
        waiting = []
        try:
            path = os.path.join(d, "full.sock")
            lis.bind(path)
            lis.listen(0)
            for _ in range(3):
                w = socket.socket(socket.AF_UNIX)
                w.setblocking(False)
                w.connect_ex(path)
                waiting.append(w)
            for json_out in (False, True):
                t0 = time.monotonic()
                rc, out, err = ctl("--socket", path, "-t", "0.5", "ping", "-c", "1", *(["--json"] if json_out else []),
                                   timeout=20)
                self.assertEqual(rc, 5, err)
                self.assertLess(time.monotonic() - t0, 5)
                self.assertIn("not accepted within 0.5 s", err)
                if json_out:
                    self.assertEqual(json.loads(out)["error"]["code"], "timed_out")
        finally:
            for w in waiting:
                w.close()
            lis.close()
            shutil.rmtree(d)

    def test_no_daemon(self):
        d = tempfile.mkdtemp(prefix="pbctl")
        try:
            path = os.path.join(d, "none.sock")
            for cmd in ("status", "tapes", "ping", "drain", "shutdown"):
                rc, out, err = ctl("--socket", path, cmd)
                self.assertEqual(rc, 3, f"{cmd}: {err}")
                self.assertIn(path, err)
            # Through the environment chain too.
            self.assertEqual(ctl("status", env={"PULLBACKD_SOCKET": path})[0], 3)
            # --json: one object on stdout for this failure too.
            rc, out, err = ctl("--socket", path, "--json", "tapes")
            self.assertEqual(rc, 3)
            e = json.loads(out)["error"]
            self.assertEqual(e["code"], "cannot_connect")
            self.assertIn(path, e["message"])
            # A socket file with nobody listening (a daemon that died).
            s = socket.socket(socket.AF_UNIX)
            s.bind(path)
            s.close()
            rc, _, err = ctl("--socket", path, "ping", "-c", "1")
            self.assertEqual(rc, 3, err)
            self.assertIn("refused", err)
        finally:
            shutil.rmtree(d)


class Running(DaemonCase):
    """status, tapes and ping against a daemon that keeps running."""

    def run_json(self, *args, env=None):
        rc, out, err = ctl(*args, "--json", env=env or {"PULLBACKD_SOCKET": self.path})
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.count("\n"), 1, out)
        return json.loads(out)

    def test_socket_chain(self):
        # --socket, then each variable of the chain, first that is set.
        self.assertEqual(ctl("--socket", self.path, "ping", "-c", "1")[0], 0)
        self.assertEqual(ctl("ping", "-c", "1", env={"PULLBACKD_SOCKET": self.path})[0], 0)
        self.assertEqual(ctl("ping", "-c", "1", env={"RUNTIME_DIRECTORY": self.dir + ":/nonexistent"})[0], 0)
        self.assertEqual(ctl("ping", "-c", "1", env={"XDG_RUNTIME_DIR": self.dir})[0], 0)
        # Order: PULLBACKD_SOCKET wins over the others, --socket over all.
        rc, _, err = ctl("ping", "-c", "1", env={"PULLBACKD_SOCKET": "/nonexistent/x.sock",
                                                 "XDG_RUNTIME_DIR": self.dir})
        self.assertEqual(rc, 3)
        self.assertIn("/nonexistent/x.sock", err)
        self.assertEqual(ctl("--socket", self.path, "ping", "-c", "1",
                             env={"PULLBACKD_SOCKET": "/nonexistent/x.sock"})[0], 0)
        rc, out, _ = ctl("status", "--json", env={"RUNTIME_DIRECTORY": self.dir + ":/other"})
        self.assertEqual(json.loads(out)["socket"], os.path.join(self.dir, "pullbackd.sock"))

    def test_status_and_tapes(self):
        with pullbackd.Client(self.path) as c:
            base = self.run_json("status")
            tapes = make_tapes(c, 3)
            held = sum(t.tape_bytes for t in tapes)
            st = self.run_json("status")
            for key in ("socket", "version", "protocol", "limits", "uid", "tapes", "tape_bytes", "peer_tapes",
                        "peer_tape_bytes", "connections", "requests_served", "requests_in_flight",
                        "uptime_s", "devices", "peers"):
                self.assertIn(key, st)
            self.assertEqual(st["socket"], self.path)
            self.assertEqual(st["protocol"], 1)
            self.assertEqual(st["tapes"], base["tapes"] + 3)
            self.assertEqual(st["tape_bytes"], base["tape_bytes"] + held)
            self.assertEqual(st["uid"], os.getuid())
            self.assertEqual(st["peer_tapes"], st["tapes"])  # one uid here
            mine = [p for p in st["peers"] if p["uid"] == os.getuid()]
            self.assertEqual(mine[0]["tapes"], st["tapes"])
            self.assertEqual(mine[0]["tape_bytes"], st["tape_bytes"])
            self.assertGreaterEqual(st["connections"], 2)  # the client above and pullbackctl
            self.assertGreater(st["requests_served"], base["requests_served"])
            self.assertEqual(st["requests_in_flight"], 0)
            self.assertGreater(st["uptime_s"], 0)
            self.assertGreaterEqual(st["uptime_s"], base["uptime_s"])
            self.assertEqual(st["devices"][0]["name"], "cpu")
            self.assertGreater(st["devices"][0]["memory_bytes"], 0)
            self.assertEqual(st["daemon_pid"], self.proc.pid)
            self.assertGreater(st["daemon_rss_bytes"], 0)
            self.assertEqual(st["limits"]["max_tape_bytes"], 4 << 30)

            rc, out, err = ctl("status", env={"PULLBACKD_SOCKET": self.path})
            self.assertEqual(rc, 0, err)
            for word in ("pullbackd", "protocol 1", "uptime", "connections", "requests",
                         "tapes by uid", "devices", "cpu", str(self.proc.pid)):
                self.assertIn(word, out)
            self.assertIn(f"{st['tapes']} held", out)

            t = self.run_json("tapes")
            self.assertEqual((t["tapes"], t["tape_bytes"]), (st["tapes"], st["tape_bytes"]))
            self.assertEqual((t["peer_tapes"], t["peer_tape_bytes"]), (st["peer_tapes"], st["peer_tape_bytes"]))
            self.assertEqual(t["max_tape_bytes_per_uid"], 4 << 30)
            rc, out, err = ctl("tapes", env={"PULLBACKD_SOCKET": self.path})
            self.assertEqual(rc, 0, err)
            self.assertIn("all uids", out)
            self.assertIn(f"uid {os.getuid()}", out)
            self.assertIn(f" {st['tape_bytes']} ", out)
            # A header over each column (the human-readable size had none).
            head, *rows = out.splitlines()
            self.assertEqual(head.split(), ["tapes", "bytes", "size", "limit"])
            self.assertEqual(len(rows[0].split()), 2 + 2 + 2 + 2, rows[0])  # "all uids", 2 counts, "32 B", "4.00 GiB"

            for tape in tapes:
                tape.release()
            t = self.run_json("tapes")
            self.assertEqual((t["tapes"], t["tape_bytes"]), (base["tapes"], base["tape_bytes"]))

    def test_ping(self):
        p = self.run_json("ping", "-c", "3")
        self.assertEqual(p["count"], 3)
        self.assertEqual(len(p["rtt_ms"]), 3)
        self.assertLessEqual(p["min_ms"], p["avg_ms"])
        self.assertLessEqual(p["avg_ms"], p["max_ms"])
        self.assertGreater(p["min_ms"], 0)
        self.assertGreaterEqual(p["connect_ms"], 0)
        self.assertEqual(p["protocol"], 1)
        rc, out, err = ctl("ping", "-c", "2", "-i", "0.01", env={"PULLBACKD_SOCKET": self.path})
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.count("hello seq="), 2)
        self.assertIn("min/avg/max", out)
        self.assertIn("--- 2 of 2 hellos answered", out)
        # A timeout past 2^31 ms (it once overflowed an int) waits as asked.
        self.assertEqual(ctl("--socket", self.path, "-t", "3000000", "ping", "-c", "1")[0], 0)
        self.assertEqual(self.run_json("ping", "-c", "1", "-t", "31536000")["sent"], 1)

    def test_metrics(self):
        with pullbackd.Client(self.path) as c:
            tapes = make_tapes(c, 2)
            held = sum(t.tape_bytes for t in tapes)
            with self.assertRaises(pullbackd.PullbackError):
                c.call("reverse", {"tape": 12345, "cotangents": {}})
            rc, out, err = ctl("metrics", env={"PULLBACKD_SOCKET": self.path})
            self.assertEqual(rc, 0, err)
            check_promtool(self, out)
            m = parse_metrics(out)
            self.assertGreaterEqual(m['pullbackd_requests_total{method="augmented_forward",outcome="ok"}'], 2)
            self.assertEqual(m['pullbackd_requests_total{method="reverse",outcome="unknown_tape"}'], 1)
            self.assertEqual(m['pullbackd_request_duration_seconds_count{method="augmented_forward"}'],
                             m['pullbackd_requests_total{method="augmented_forward",outcome="ok"}'])
            self.assertEqual(m['pullbackd_request_duration_seconds_bucket{method="augmented_forward",le="+Inf"}'],
                             m['pullbackd_request_duration_seconds_count{method="augmented_forward"}'])
            self.assertEqual(m['pullbackd_tapes{device="cpu",scope="connection"}'], 2)
            self.assertEqual(m['pullbackd_tape_bytes{device="cpu",scope="connection"}'], held)
            self.assertEqual(m['pullbackd_tapes{device="cpu",scope="peer"}'], 0)
            self.assertGreaterEqual(m["pullbackd_connections"], 2)
            self.assertEqual(m["pullbackd_buffers"], 0)
            self.assertEqual(m["pullbackd_buffer_bytes"], 0)
            self.assertGreater(m["pullbackd_buffered_bytes"], 0)  # this metrics request's own message
            self.assertGreaterEqual(m["pullbackd_worker_busy_seconds_total"], 0)
            self.assertEqual(m["pullbackd_workers"], 2)
            self.assertGreater(m["pullbackd_uptime_seconds"], 0)
            # The caller is an admin (the daemon's own uid): per-uid figures.
            self.assertEqual(m[f'pullbackd_peer_tapes{{uid="{os.getuid()}"}}'], 2)
            self.assertEqual(m[f'pullbackd_peer_tape_bytes{{uid="{os.getuid()}"}}'], held)
            # An unknown method is counted as "other", not as a new series.
            with self.assertRaises(pullbackd.PullbackError):
                c.call("no_such_method", {})
            m = parse_metrics(ctl("metrics", env={"PULLBACKD_SOCKET": self.path})[1])
            self.assertEqual(m['pullbackd_requests_total{method="other",outcome="unknown_method"}'], 1)
            self.assertNotIn("no_such_method", out)
            j = self.run_json("metrics")
            self.assertTrue(j["text"].startswith("# HELP"))
            for t in tapes:
                t.release()

    def split_counts(self):
        """(steps split, pieces helped) so far, from the daemon's metrics."""
        m = parse_metrics(ctl("metrics", env={"PULLBACKD_SOCKET": self.path})[1])
        return m["pullbackd_split_tasks_total"], m["pullbackd_split_pieces_helped_total"]

    def test_idle_workers_help(self):
        # One large request alone on a 2-worker daemon: its GEMM is split
        # and the idle worker runs pieces of it (kernels/par.h).
        # Whether the woken worker claims a piece before the requesting one
        # has run them all depends on the scheduler: on a loaded 2-core
        # machine (meson runs tests side by side) it may come too late for
        # one request, so the test allows a few tries.
        t0, h0 = self.split_counts()
        rng = np.random.default_rng(5)
        A, B = rng.standard_normal((700, 700)), rng.standard_normal((700, 700))
        with pullbackd.Client(self.path) as c:
            for tries in range(1, 21):
                C = c.forward("tensorcontract", {"A": A, "B": B}, options={"spec": "ij,jk->ik"})["C"]
                np.testing.assert_allclose(C, A @ B, rtol=1e-12, atol=1e-10)
                t1, h1 = self.split_counts()
                if h1 > h0:
                    break
        self.assertGreaterEqual(t1 - t0, 1)
        self.assertGreaterEqual(h1 - h0, 1, f"no piece helped in {tries} requests")

    def test_results_do_not_depend_on_load(self):
        # A request's result is bitwise the same whether the other worker
        # helped with it or was busy with another request (kernels/blas.c):
        # fused_dense f32, whose GEMMs split by rows (batch > out) in one
        # shape and by columns in the other, forward and reverse.

        rng = np.random.default_rng(9)
        cases = []
        for out_, in_, batch in ((256, 512, 1024), (1024, 512, 256)):
            W = rng.standard_normal((out_, in_)).astype(np.float32)
            x = rng.standard_normal((in_, batch)).astype(np.float32)
            b = rng.standard_normal(out_).astype(np.float32)
            cases.append(({"weight": W, "x": x, "bias": b}, rng.standard_normal((out_, batch)).astype(np.float32)))

        def run(c, inputs, ybar):
            out, tape = c.augmented_forward("fused_dense", inputs, wrt=["weight", "x", "bias"],
                                            options={"act": "gelu"})
            g = c.reverse(tape, {"y": ybar})
            return [out["y"], g["weight"], g["x"], g["bias"]]

        def same(got, want, what):
            for name, u, v in zip(("y", "weight_bar", "x_bar", "bias_bar"), got, want):
                bits = [np.ascontiguousarray(a).view(np.uint32) for a in (u, v)]
                self.assertEqual(np.count_nonzero(bits[0] != bits[1]), 0,
                                 f"{what}: elements of {name} (of {u.size}) differ in their bits")

        # The load: two clients sending eigh_vals of a small f32 matrix
        # over and over, two in flight each, so that a job is always
        # queued for the other worker (a worker takes a queued job before
        # it helps; with one in flight each, the gaps between a reply and
        # the next request left it idle, and under ThreadSanitizer idle
        # often enough to help in each of 20 requests).  Nothing of them
        # splits (their GEMMs, GEMVs and copies are under the split
        # sizes), so a piece helped while they run is ours.
        S = rng.standard_normal((160, 160)).astype(np.float32)
        S = S + S.T
        with pullbackd.Client(self.path) as c:
            for i, (inputs, ybar) in enumerate(cases):
                # Alone, until the idle worker ran a piece of it.
                for tries in range(1, 21):
                    _, h0 = self.split_counts()
                    helped = run(c, inputs, ybar)
                    _, h1 = self.split_counts()
                    if h1 > h0:
                        break
                self.assertGreater(h1, h0, f"case {i}: no piece helped in {tries} requests")
                # The other worker busy, until no piece of ours was helped
                # (one may be, in an instant the load leaves it free).
                stop = threading.Event()

                def load():
                    with pullbackd.Client(self.path) as c2:
                        params = {"op": "eigh_vals", "inputs": {"A": pullbackd.encode_tensor(S)}}
                        sent = collections.deque()
                        while not stop.is_set():
                            while len(sent) < 2:
                                sent.append(c2.send("forward", params))
                            c2.wait(sent.popleft())
                        for m in sent:
                            c2.wait(m)

                busy = [threading.Thread(target=load) for _ in range(2)]
                for t in busy:
                    t.start()
                try:
                    time.sleep(0.1)
                    for tries in range(1, 21):
                        _, h0 = self.split_counts()
                        loaded = run(c, inputs, ybar)
                        _, h1 = self.split_counts()
                        same(loaded, helped, f"case {i}")
                        if h1 == h0:
                            break
                finally:
                    stop.set()
                    for t in busy:
                        t.join()
                self.assertEqual(h1, h0, f"case {i}: a piece was helped in each of {tries} requests under load")

    @unittest.skipUnless(os.geteuid() == 0, "needs root to run as another uid")
    def test_socket_mode_denies(self):
        # The daemon's socket is 0660 in a 0700 folder: nobody may not connect.
        rc, out, err = ctl("--socket", self.path, "status", user="nobody")
        self.assertEqual(rc, 4, err)
        self.assertIn("permission denied", err)


def check_promtool(case, text):
    """promtool (Debian's prometheus package) accepts the exposition text."""
    promtool = shutil.which("promtool")
    if promtool is None:
        raise unittest.SkipTest("promtool not installed (Debian package prometheus)")
    p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    case.assertEqual(p.returncode, 0, p.stdout + p.stderr)


def parse_metrics(text):
    """{'name{labels}': value} of every sample line."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        m = re.fullmatch(r"(\S+(?:\{.*\})?) (\S+)", line)
        assert m, line
        out[m.group(1)] = float(m.group(2))
    return out


class MemoryCache(DaemonCase):
    """Large blocks come back from the cache (kernels/mem.h), the cache
    stays under --memory-cache, and idle-trim empties it."""
    DAEMON_ARGS = ["--memory-cache", "64M", "--idle-trim", "1"]

    def metrics(self):
        return parse_metrics(ctl("metrics", env={"PULLBACKD_SOCKET": self.path})[1])

    def test_reuse_cap_and_trim(self):
        rng = np.random.default_rng(3)
        A = rng.standard_normal((1024, 1024))  # 8 MiB in, 8 MiB out
        with pullbackd.Client(self.path) as c:
            for i in range(6):
                C = c.forward("tensoradd", {"A": A}, options={"pA": [1, 0]})["C"]
                np.testing.assert_array_equal(C, A.T)
            m = self.metrics()
            # The first request maps its message buffer and result; the
            # later ones take them from the cache.
            self.assertGreaterEqual(m["pullbackd_memory_cache_hits_total"], 8)
            self.assertLessEqual(m["pullbackd_memory_cache_misses_total"], 6)
            self.assertLessEqual(m["pullbackd_memory_cached_bytes"], 64 << 20)
            self.assertGreater(m["pullbackd_memory_cached_bytes"], 0)
            # More than the cap in flight at once: what comes back past the
            # cap is unmapped.
            big = rng.standard_normal((3000, 3000))  # 69 MiB each way
            C = c.forward("tensoradd", {"A": big}, options={"pA": [1, 0]})["C"]
            np.testing.assert_array_equal(C, big.T)
            self.assertLessEqual(self.metrics()["pullbackd_memory_cached_bytes"], 64 << 20)
        # Idle for idle-trim seconds (the sweep runs every second): emptied.
        # The trim takes the blocks off the cache, then unmaps them one by
        # one off the loop: wait for both counts.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = self.metrics()
            if m["pullbackd_memory_cached_bytes"] == 0 and m["pullbackd_memory_large_bytes"] == 0:
                break
            time.sleep(0.5)
        self.assertEqual(m["pullbackd_memory_cached_bytes"], 0)
        self.assertEqual(m["pullbackd_memory_large_bytes"], 0)


class MemoryCacheReload(DaemonCase):
    """A lower memory-cache in the config file, on reload (SIGHUP), empties
    a cache holding more (on libuv's thread pool, not the loop)."""
    CONF_DIR = tempfile.mkdtemp(prefix="pbmemcap")
    CONF = os.path.join(CONF_DIR, "pullbackd.conf")
    DAEMON_ARGS = ["--config", CONF, "--idle-trim", "0"]  # no idle trim: only the reload empties it

    @classmethod
    def setUpClass(cls):
        with open(cls.CONF, "w") as f:
            f.write("memory-cache = 256M\n")
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        shutil.rmtree(cls.CONF_DIR, ignore_errors=True)

    def metrics(self):
        return parse_metrics(ctl("metrics", env={"PULLBACKD_SOCKET": self.path})[1])

    def test_lower_cap_on_reload(self):
        A = np.random.default_rng(4).standard_normal((1024, 1024))  # 8 MiB each way
        with pullbackd.Client(self.path) as c:
            for _ in range(3):
                np.testing.assert_array_equal(c.forward("tensoradd", {"A": A}, options={"pA": [1, 0]})["C"], A.T)
            self.assertGreater(self.metrics()["pullbackd_memory_cached_bytes"], 4 << 20)
            with open(self.CONF, "w") as f:
                f.write("memory-cache = 4M\n")
            os.kill(self.proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                m = self.metrics()
                if m["pullbackd_memory_cached_bytes"] <= 4 << 20:
                    break
                time.sleep(0.1)
            self.assertLessEqual(m["pullbackd_memory_cached_bytes"], 4 << 20)
            # Still serving, under the new cap.
            np.testing.assert_array_equal(c.forward("tensoradd", {"A": A}, options={"pA": [1, 0]})["C"], A.T)
            self.assertLessEqual(self.metrics()["pullbackd_memory_cached_bytes"], 4 << 20)


class Gpus(DaemonCase):
    """status with GPUs (the backend's host fake): each GPU's model, memory, bytes held, tapes and state."""
    DAEMON_ENV = {"PULLBACKD_FAKE_CUDA": "devices=2,memory=64M,unbindable=1"}
    DAEMON_ARGS = ["--log-level", "error"]

    def test_status_devices(self):
        env = {"PULLBACKD_SOCKET": self.path}
        with pullbackd.Client(self.path) as c:
            y, tape = c.augmented_forward("fused_dense", {"weight": np.ones((4, 4)), "x": np.ones((4, 2))},
                                          wrt=["x"], device="cuda:0")
            rc, out, err = ctl("status", "--json", env=env)
            self.assertEqual(rc, 0, err)
            devs = {d["name"]: d for d in json.loads(out)["devices"]}
            self.assertEqual(set(devs), {"cpu", "cuda:0", "cuda:1"})
            self.assertEqual((devs["cuda:0"]["tapes"], devs["cuda:0"]["used_bytes"]), (1, tape.tape_bytes))
            self.assertTrue(devs["cuda:1"]["failed"])
            rc, out, err = ctl("status", env=env)
            self.assertEqual(rc, 0, err)
            rows = {line.split()[0]: line for line in out.split("devices\n", 1)[1].splitlines()[1:] if line.strip()}
            self.assertRegex(rows["cuda:0"], r"cuda:0 +fake GPU 0 +64\.0 MiB +128 B +1  serving$")
            self.assertIn("FAILED (device_unavailable until a restart)", rows["cuda:1"])
            self.assertRegex(rows["cpu"], r"cpu +- .* +- +-  serving$")


class OpenSocket(DaemonCase):
    """A socket everyone may connect to: the daemon itself refuses admin calls."""

    DAEMON_ARGS = ["--socket-mode", "0666"]

    @unittest.skipUnless(os.geteuid() == 0, "needs root to run as another uid")
    def test_admin_denied(self):
        os.chmod(self.dir, 0o755)
        nobody = pwd.getpwnam("nobody").pw_uid
        rc, out, err = ctl("--socket", self.path, "status", "--json", user="nobody")
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["uid"], nobody)
        for cmd in ("drain", "shutdown"):
            rc, out, err = ctl("--socket", self.path, cmd, "--json", user="nobody")
            self.assertEqual(rc, 4, err)
            self.assertEqual(json.loads(out)["error"]["code"], "permission_denied")
            self.assertIn("permission_denied", err)
        # Per-uid figures are for admins: nobody sees the totals and its own.
        with pullbackd.Client(self.path) as c:
            tapes = make_tapes(c, 1)
            rc, out, err = ctl("--socket", self.path, "status", "--json", user="nobody")
            st = json.loads(out)
            self.assertEqual(st["tapes"], 1)
            self.assertEqual(st["peer_tapes"], 0)
            self.assertEqual([p for p in st["peers"] if p["uid"] != nobody], [])
            rc, out, err = ctl("--socket", self.path, "metrics", user="nobody")
            self.assertEqual(rc, 0, err)
            check_promtool(self, out)
            self.assertNotIn("pullbackd_peer_", out)
            self.assertEqual(parse_metrics(out)['pullbackd_tapes{device="cpu",scope="connection"}'], 1)
            rc, out, err = ctl("--socket", self.path, "status", "--json")
            self.assertEqual([p["uid"] for p in json.loads(out)["peers"]], [os.getuid()])
            tapes[0].release()
        # Still serving new forward calls: nothing was drained.
        with pullbackd.Client(self.path) as c:
            c.forward("fused_dense", {"weight": np.eye(2), "x": np.ones((2, 1))})


class Drain(DaemonCase):
    def test_drain(self):
        with pullbackd.Client(self.path) as c:
            tape = make_tapes(c, 1)[0]
            rc, out, err = ctl("--socket", self.path, "status")
            self.assertRegex(out, r"\nstate +serving\n")
            rc, out, err = ctl("--socket", self.path, "drain")
            self.assertEqual(rc, 0, err)
            self.assertIn("draining", out)
            # status says so (it looked like any daemon's before)
            rc, out, err = ctl("--socket", self.path, "status")
            self.assertRegex(out, r"\nstate +draining \(no new forward calls")
            self.assertEqual(json.loads(ctl("--socket", self.path, "status", "--json")[1])["state"],
                             "draining")
            self.assertEqual(c.stats()["state"], "draining")
            d = json.loads(ctl("--socket", self.path, "drain", "--json")[1])
            self.assertEqual(d, {"socket": self.path, "daemon_pid": self.proc.pid, "draining": True})
            with self.assertRaises(pullbackd.PullbackError) as e:
                c.forward("fused_dense", {"weight": np.eye(2), "x": np.ones((2, 1))})
            self.assertEqual(e.exception.code, "shutting_down")
            self.assertTrue(tape.release())
            # Still answering the admin tool.
            self.assertEqual(ctl("--socket", self.path, "tapes")[0], 0)


class LogOnATerminal(unittest.TestCase):
    """The daemon's log names its levels on a terminal ("pullbackd notice:
    ..."); to a pipe or the journal it keeps the "<N>" prefix the journal
    reads the level from (e2e.service checks those)."""

    def test_level_names(self):
        import pty
        d = tempfile.mkdtemp(prefix="pbtty")
        path = os.path.join(d, "pullbackd.sock")
        master, slave = pty.openpty()
        proc = subprocess.Popen([DAEMON, "--socket", path, "--workers", "1"], stderr=slave)
        os.close(slave)
        try:
            wait_for_socket(path, proc)
            proc.terminate()
            self.assertEqual(proc.wait(10), 0)
            out = b""
            while True:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the terminal's other side is gone
                    break
                if not chunk:
                    break
                out += chunk
            text = out.decode()
            self.assertIn(f"pullbackd notice: listening on {path} (1 worker, ", text)
            self.assertNotIn("<5>", text)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(master)
            shutil.rmtree(d)


class Shutdown(unittest.TestCase):
    def test_shutdown_wait(self):
        d = tempfile.mkdtemp(prefix="pbctl")
        path = os.path.join(d, "pullbackd.sock")
        proc = subprocess.Popen([DAEMON, "--socket", path, "--log-level", "warning"])
        try:
            wait_for_socket(path, proc)
            rc, out, err = ctl("--socket", path, "shutdown", "--wait", "--json", "--timeout", "20")
            self.assertEqual(rc, 0, err)
            j = json.loads(out)
            self.assertTrue(j["shutting_down"])
            self.assertTrue(j["stopped"])
            self.assertGreaterEqual(j["stop_s"], 0)
            self.assertEqual(proc.wait(10), 0)
            self.assertEqual(ctl("--socket", path, "status")[0], 3)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            shutil.rmtree(d)

    def test_shutdown_text(self):
        d = tempfile.mkdtemp(prefix="pbctl")
        path = os.path.join(d, "pullbackd.sock")
        proc = subprocess.Popen([DAEMON, "--socket", path, "--log-level", "warning"])
        try:
            wait_for_socket(path, proc)
            rc, out, err = ctl("--socket", path, "shutdown")
            self.assertEqual(rc, 0, err)
            self.assertIn("shutting down", out)
            self.assertEqual(proc.wait(10), 0)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            shutil.rmtree(d)


class StartupLog(unittest.TestCase):
    def test_blas_line(self):
        """At info level the daemon says which BLAS kernels do its math, and
        whether OPENBLAS_CORETYPE chose them (the environment is left as it
        is: on some processors it is set because older OpenBLAS builds go
        wrong there)."""
        d = tempfile.mkdtemp(prefix="pbctl")
        path = os.path.join(d, "pullbackd.sock")
        proc = subprocess.Popen([DAEMON, "--socket", path, "--log-level", "info"], stderr=subprocess.PIPE, text=True)
        try:
            wait_for_socket(path, proc)
            self.assertEqual(ctl("--socket", path, "shutdown")[0], 0)
            err = proc.communicate(timeout=10)[1]
            self.assertEqual(proc.returncode, 0, err)
            line = [ln for ln in err.splitlines() if "BLAS: " in ln]
            self.assertEqual(len(line), 1, err)
            self.assertIn("OpenBLAS", line[0])
            self.assertIn("kernels for ", line[0])
            forced = os.environ.get("OPENBLAS_CORETYPE")
            if forced:
                self.assertIn(f"(OPENBLAS_CORETYPE={forced})", line[0])
            else:
                self.assertNotIn("OPENBLAS_CORETYPE", line[0])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            shutil.rmtree(d)


class FakeDaemon:
    """A socket server that misbehaves in one chosen way per connection:
    'error' answers every request with an `internal` error, 'close' closes
    without answering, 'silent' reads and never answers, 'garbage' answers
    with bytes that are not msgpack-RPC."""

    def __init__(self, mode):
        self.mode = mode
        self.dir = tempfile.mkdtemp(prefix="pbfake")
        self.path = os.path.join(self.dir, "fake.sock")
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        self.sock.listen(8)
        self.conns = []
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self.one, args=(conn,), daemon=True).start()

    def one(self, conn):
        unp = msgpack.Unpacker(raw=False)
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                unp.feed(data)
                for msg in unp:
                    if self.mode == "close":
                        conn.close()
                        return
                    if self.mode == "error":
                        conn.sendall(msgpack.packb([1, msg[1], {"code": "internal", "message": "fake failure"},
                                                    None]))
                    elif self.mode == "garbage":
                        conn.sendall(msgpack.packb({"not": "a response"}))
        except OSError:
            return

    def close(self):
        self.sock.close()
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass
        shutil.rmtree(self.dir)


class Misbehaving(unittest.TestCase):
    def check(self, mode, args, want, text):
        fake = FakeDaemon(mode)
        try:
            t0 = time.monotonic()
            rc, out, err = ctl("--socket", fake.path, *args)
            self.assertEqual(rc, want, f"{mode} {args}: {err}")
            self.assertIn(text, err)
            self.assertLess(time.monotonic() - t0, 10)
            return out
        finally:
            fake.close()

    def test_error_reply(self):
        for cmd in ("status", "tapes", "ping", "drain", "shutdown"):
            self.check("error", [cmd], 1, "internal: fake failure")
        out = self.check("error", ["status", "--json"], 1, "internal")
        self.assertEqual(json.loads(out), {"error": {"code": "internal", "message": "fake failure"}})

    def test_lost_and_timeout(self):
        self.check("close", ["status"], 5, "closed the connection")
        out = self.check("silent", ["ping", "-c", "2", "--timeout", "0.3"], 5, "no answer within 0.3 s")
        # One hello went out and none came back: no invented times.
        self.assertIn("--- 0 of 1 hellos answered\n", out)
        self.assertNotIn("rtt", out)
        out = self.check("silent", ["ping", "-c", "2", "--timeout", "0.3", "--json"], 5, "no answer")
        got = json.loads(out)
        self.assertEqual((got["sent"], got["count"], got["rtt_ms"], got["error"]["code"]), (1, 0, [], "timed_out"))
        self.assertNotIn("min_ms", got)
        out = self.check("close", ["status", "--json"], 5, "closed the connection")
        self.assertEqual(json.loads(out)["error"]["code"], "connection_lost")
        self.check("garbage", ["tapes"], 5, "pullbackctl")


if __name__ == "__main__":
    unittest.main(verbosity=2)
