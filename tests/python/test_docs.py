"""The python blocks of docs/python.md, run in order in one namespace against
a pullbackd started here ($PULLBACKD_SOCKET points at it), so the guide's
examples stay true. Blocks that use torch are skipped when torch does not
import (the others still run).

Run: PULLBACKD_BIN=build/daemon/pullbackd /usr/bin/python3 tests/python/test_docs.py
"""

import os
import re
import sys
import unittest
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
sys.path.insert(0, HERE)
from daemon_case import DaemonCase  # noqa: E402

GUIDE = os.path.join(ROOT, "docs", "python.md")


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


if __name__ == "__main__":
    unittest.main()
