"""Runs a script in Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) in a fresh process: the kernels'
launch paths and math on the CPU, where Triton is installed (CI has none: the caller's test is skipped)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_interpreted(script: str, timeout: float = 600) -> None:
    """The script must print "ok" and nothing else; its stderr's tail is the failure message otherwise."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when Triton is imported: a fresh process
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
