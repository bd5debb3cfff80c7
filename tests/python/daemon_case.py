"""A unittest base class that starts a private pullbackd for its tests.

The daemon ($PULLBACKD_BIN, else build/daemon/pullbackd) listens on a
socket in a temporary folder; the class's tests reach it at cls.path. It
must exit 0 on SIGTERM at the end, or the class fails.
"""

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import unittest


def run_in_threads(work, n, timeout=60):
    """work(k) for k in range(n), each on a thread of its own; the exceptions
    they raised, and a TimeoutError for each still running after timeout
    seconds in all (a hang fails the test instead of passing it)."""
    errors = []

    def run(k):
        try:
            work(k)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return errors + [TimeoutError(f"{t.name} still running after {timeout} s") for t in threads if t.is_alive()]


def wait_for_socket(path, proc, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pullbackd exited with {proc.returncode}")
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(path)
                return
            except OSError:
                time.sleep(0.01)
    raise RuntimeError("pullbackd did not accept connections")


class DaemonCase(unittest.TestCase):
    DAEMON_ARGS = []  # extra flags for the daemon
    DAEMON_ENV = {}  # extra environment for the daemon

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="pbpy")
        cls.path = os.path.join(cls.dir, "pullbackd.sock")
        binary = os.environ.get("PULLBACKD_BIN", "build/daemon/pullbackd")
        cls.proc = subprocess.Popen([binary, "--socket", cls.path, "--workers", "2", "--log-level", "warning"]
                                    + [str(a) for a in cls.DAEMON_ARGS], env={**os.environ, **cls.DAEMON_ENV})
        try:
            wait_for_socket(cls.path, cls.proc)
        except BaseException:
            cls.proc.kill()
            cls.proc.wait()
            shutil.rmtree(cls.dir)
            raise

    @classmethod
    def tearDownClass(cls):
        cls.proc.terminate()
        try:
            rc = cls.proc.wait(10)
        except subprocess.TimeoutExpired:
            cls.proc.kill()
            rc = cls.proc.wait()
        shutil.rmtree(cls.dir)
        if rc != 0:
            raise AssertionError(f"pullbackd exited with {rc} on SIGTERM, not 0")
