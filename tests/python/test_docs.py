"""The python blocks of docs/python.md, run in order in one namespace against
a pullbackd started here ($PULLBACKD_SOCKET points at it), so the guide's
examples stay true. Blocks that use torch are skipped when torch does not
import (the others still run).  The c block of docs/c.md is compiled as
the guide says (cc, with $PB_CLIENT_LIB, the client library the build
made) and run against the same daemon; its output must be the guide's
text block.

Run: PULLBACKD_BIN=build/daemon/pullbackd /usr/bin/python3 tests/python/test_docs.py
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
sys.path.insert(0, HERE)
from daemon_case import DaemonCase  # noqa: E402

GUIDE = os.path.join(ROOT, "docs", "python.md")
C_GUIDE = os.path.join(ROOT, "docs", "c.md")


def blocks():
    """(line, code) of each ```python block of the guide."""
    with open(GUIDE, encoding="utf-8") as f:
        text = f.read()
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```$", text, re.S | re.M)]


try:
    import torch  # noqa: F401 (only whether it imports)
    HAS_TORCH = True
except Exception:  # noqa: BLE001
    HAS_TORCH = False


class GuideTest(DaemonCase):
    def test_python_blocks_run(self):
        found = blocks()
        self.assertGreaterEqual(len(found), 4)
        os.environ["PULLBACKD_SOCKET"] = self.path
        namespace = {"__name__": "guide"}
        for line, code in found:
            if "torch" in code and not HAS_TORCH:
                continue
            with self.subTest(line=line), warnings.catch_warnings():
                warnings.simplefilter("error")  # the guide's losses are gauge invariant
                exec(compile(code, f"{GUIDE}:{line}", "exec"), namespace)
        if HAS_TORCH:
            import pullbackd.torch as pt
            pt.default_client().close()

    def test_c_guide_runs(self):
        with open(C_GUIDE, encoding="utf-8") as f:
            text = f.read()
        (prog,) = re.findall(r"^```c\n(.*?)^```$", text, re.S | re.M)
        (want,) = re.findall(r"^```text\n(.*?)^```$", text, re.S | re.M)
        lib = os.environ.get("PB_CLIENT_LIB")
        cc = shutil.which(os.environ.get("CC", "cc"))
        if not lib or not cc or not shutil.which("pkg-config"):
            self.skipTest("needs $PB_CLIENT_LIB (the build sets it), cc and pkg-config")
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "msgpack"], capture_output=True, text=True,
                               check=True).stdout.split()
        with tempfile.TemporaryDirectory() as d:
            src, exe = os.path.join(d, "guide.c"), os.path.join(d, "guide")
            with open(src, "w") as f:
                f.write(prog)
            # The guide's command, with -Wall -Wextra -Werror: its example is kept clean too.
            # $PB_CLIENT_CFLAGS: the sanitizers of an ASan or TSan build's library.
            subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-Werror", *os.environ.get("PB_CLIENT_CFLAGS", "").split(),
                            "-I" + os.path.join(ROOT, "clients", "c"), src, lib, *flags, "-lm", "-o", exe], check=True)
            out = subprocess.run([exe], capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "PULLBACKD_SOCKET": self.path})
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout, want)


if __name__ == "__main__":
    unittest.main()
