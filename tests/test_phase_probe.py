"""benchmarks/phase_probe.py's CPU smoke mode (Triton's interpreter, where Triton is installed): the PDL-chain
kernel and the persistent kernel (one program, so its grid barriers pass at once; its tile loop plain and flat)
each compute the chain of GEMM phases that torch computes. On the H200 every run is checked the same way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.benchmark_scripts import BENCHMARKS


def test_the_phase_probe_runs_its_smoke_mode(tmp_path):
    pytest.importorskip("triton")
    from tests.interpreter import NUMPY_24_SHIM, script_source  # Triton 3.6's interpreter with numpy >= 2.4

    code = script_source(BENCHMARKS / "phase_probe.py", "--out", str(tmp_path), "--smoke")
    run = subprocess.run([sys.executable, "-c", NUMPY_24_SHIM + code], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
