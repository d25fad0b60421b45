"""Runs a script in Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) in a fresh process: the kernels'
launch paths and math on the CPU, where Triton is installed (CI installs it; without it the caller's test is
skipped)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Triton <= 3.6's interpreter turns a scalar into an int with int(array of shape (1,)), which numpy >= 2.4
# refuses (triton-lang/triton#9171, fixed upstream by #9172): a loop bound read from memory fails as "only
# 0-dimensional arrays can be converted to Python scalars". Where the installed interpreter has that line,
# the script's process takes upstream's fix (the scalar squeezed first); nothing else in Triton is touched.
NUMPY_24_SHIM = '''
import numpy as _np
from triton.runtime import interpreter as _interp
_patch = _interp._patch_lang_tensor
def _patch_lang_tensor(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(_np.asarray(self.handle.data).reshape(())))
if "int(self.handle.data))" in __import__("inspect").getsource(_patch):
    _interp._patch_lang_tensor = _patch_lang_tensor
'''


def script_source(script, *argv: str) -> str:
    """Python source that runs a benchmarks/ script as __main__ with argv (its folder on sys.path, as when run
    directly): NUMPY_24_SHIM + it is a `python -c` program for the interpreter."""
    return (f"import runpy, sys\nsys.argv = [{str(script)!r}, *{list(argv)!r}]\n"
            f"sys.path.insert(0, {str(script.parent)!r})\nrunpy.run_path({str(script)!r}, run_name='__main__')\n")


def run_interpreted(script: str, timeout: float = 600) -> None:
    """The script must print "ok" and nothing else; its stderr's tail is the failure message otherwise."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when Triton is imported: a fresh process
    run = subprocess.run([sys.executable, "-c", NUMPY_24_SHIM + script], capture_output=True, text=True, env=env,
                         timeout=timeout)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
