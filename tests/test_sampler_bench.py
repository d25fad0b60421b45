"""benchmarks/sampler_bench.py's CPU smoke mode (Triton's interpreter, where Triton is installed): it runs,
and against a revision (here HEAD, the same file) it draws the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.benchmark_scripts import BENCHMARKS


def test_the_sampler_benchmark_runs_its_smoke_mode_against_a_revision(tmp_path):
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, str(BENCHMARKS / "sampler_bench.py"), "--out", str(tmp_path), "--smoke",
                          "--rows", "3,5", "--vocab", "3000", "--against", "HEAD"],
                         capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "sampler_bench.json").read_text())
    assert [r["rows"] for r in result["results"]] == [3, 5]
    assert all(r["same_tokens"] == 1.0 for r in result["results"])
    assert all(r["processed"]["same_tokens"] == 1.0 for r in result["results"])  # the two races of sampler.race
