"""clients/python installs as a package, offline, and the installed copy works.

Makes a venv with ``/usr/bin/python3 -m venv --system-site-packages`` (so
it sees Debian's numpy, msgpack and torch), runs ``pip install
--no-build-isolation --no-index`` on a copy of clients/python, then imports
pullbackd from the venv, in a folder outside the repository with no
PYTHONPATH, and talks to a daemon started here.

Exits 77 (skipped), saying why, when venv, pip, setuptools or wheel is
missing (Debian: python3-venv, python3-pip, python3-setuptools,
python3-wheel).

Run: PULLBACKD_BIN=build/daemon/pullbackd /usr/bin/python3 tests/python/test_package.py
"""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "..", "clients", "python")
sys.path.insert(0, HERE)
from daemon_case import DaemonCase  # noqa: E402

PYTHON = "/usr/bin/python3"


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_INDEX_URL")}
    env.update(extra)
    return env


def make_venv(path):
    """Make the venv at path; None, or why it cannot be made here (then the test is skipped)."""
    probe = subprocess.run([PYTHON, "-c", "import setuptools, wheel"], capture_output=True, text=True)
    if probe.returncode != 0:
        return "setuptools or wheel missing for /usr/bin/python3 (Debian: python3-setuptools, python3-wheel)"
    made = subprocess.run([PYTHON, "-m", "venv", "--system-site-packages", path], capture_output=True,
                          text=True, env=clean_env(), timeout=300)
    if made.returncode != 0:
        return ("/usr/bin/python3 -m venv failed (Debian: python3-venv, python3-pip): "
                + (made.stdout + made.stderr).strip()[-300:])
    pip = subprocess.run([os.path.join(path, "bin", "python"), "-m", "pip", "--version"], capture_output=True,
                         text=True, env=clean_env())
    if pip.returncode != 0:
        return "the venv has no pip (Debian: python3-pip): " + pip.stderr.strip()[-300:]
    return None


class PackageTest(DaemonCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.work = WORK
        cls.venv = os.path.join(cls.work, "venv")
        cls.python = os.path.join(cls.venv, "bin", "python")
        # A copy, so that the build's build/ and egg-info never land in the tree.
        cls.src = os.path.join(cls.work, "src")
        shutil.copytree(SOURCE, cls.src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        run = dict(capture_output=True, text=True, env=clean_env(), cwd=cls.work, timeout=300)
        cls.pip = subprocess.run([cls.python, "-m", "pip", "install", "--no-build-isolation", "--no-index",
                                  "--disable-pip-version-check", "--no-cache-dir", cls.src], **run)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, ignore_errors=True)
        super().tearDownClass()

    def venv_python(self, code):
        """Run code with the venv's python, outside the repository; its stdout."""
        got = subprocess.run([self.python, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                             env=clean_env(PULLBACKD_SOCKET=self.path), cwd=self.work, timeout=120)
        self.assertEqual(got.returncode, 0, got.stdout + got.stderr)
        return got.stdout

    def test_1_pip_install_offline(self):
        self.assertEqual(self.pip.returncode, 0, self.pip.stdout + self.pip.stderr)
        self.assertIn("Successfully installed pullbackd", self.pip.stdout)

    def test_1_version_is_the_projects(self):
        import re
        import tomllib
        with open(os.path.join(SOURCE, "pyproject.toml"), "rb") as f:
            ours = tomllib.load(f)["project"]["version"]
        with open(os.path.join(HERE, "..", "..", "meson.build"), encoding="utf-8") as f:
            meson = re.search(r"version:\s*'([^']+)'", f.read()).group(1)
        self.assertEqual(ours, meson, "clients/python/pyproject.toml and meson.build disagree on the version")

    def test_2_installed_copy_is_imported(self):
        out = self.venv_python("""
            import os, sys, pullbackd
            print(os.path.realpath(pullbackd.__file__))
            print(os.path.realpath(sys.prefix))
        """).split("\n")
        self.assertTrue(out[0].startswith(out[1] + os.sep), out)
        self.assertIn("site-packages", out[0])

    def test_3_talks_to_the_daemon(self):
        out = self.venv_python("""
            import numpy as np, pullbackd
            with pullbackd.Client() as c:  # PULLBACKD_SOCKET
                assert c.hello()["protocol"] == 1
                W = np.array([[1.0, 2.0], [3.0, 4.0]]); x = np.array([1.0, -1.0])
                out, tape = c.augmented_forward("fused_dense", {"weight": W, "x": x}, wrt=["x"])
                g = c.reverse(tape, {"y": np.ones(2)})
                assert np.allclose(out["y"], W @ x), out
                assert np.allclose(g["x"], W.T @ np.ones(2)), g
            print("ok")
        """)
        self.assertEqual(out.strip(), "ok")

    def test_4_torch_module_imports_when_torch_does(self):
        has_torch = subprocess.run([self.python, "-c", "import torch"], capture_output=True,
                                   env=clean_env(), cwd=self.work).returncode == 0
        if not has_torch:
            self.skipTest("torch does not import")
        out = self.venv_python("""
            import torch, pullbackd.torch as pt
            W = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64, requires_grad=True)
            x = torch.tensor([1.0, -1.0], dtype=torch.float64)
            pt.fused_dense(W, x).sum().backward()
            assert torch.allclose(W.grad, torch.tensor([[1.0, -1.0], [1.0, -1.0]], dtype=torch.float64)), W.grad
            print("ok")
        """)
        self.assertEqual(out.strip(), "ok")


if __name__ == "__main__":
    WORK = tempfile.mkdtemp(prefix="pbpkg")
    why = make_venv(os.path.join(WORK, "venv"))
    if why:
        shutil.rmtree(WORK, ignore_errors=True)
        print("SKIP:", why, file=sys.stderr)
        sys.exit(77)
    unittest.main()
