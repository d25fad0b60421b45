"""benchmarks/triton_key.py: without Triton it says what it needs; with Triton (CI installs it) its processes report
the key hashed by the first and stored for the others, and every compile after the first process a cache hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_key.py"


def test_without_triton_it_names_what_it_needs(tmp_path):
    (tmp_path / "triton.py").write_text("raise ImportError('no triton here')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 2 and "needs Triton" in run.stderr
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), "--processes", "1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and "--processes must be >= 2" in run.stderr
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), "--busy", "-1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and "--busy must be >= 0, got -1" in run.stderr


@pytest.mark.parametrize("store,here", [(True, False), (False, False), (False, True)])
def test_with_triton_the_later_processes_read_the_key(tmp_path, store, here):
    pytest.importorskip("triton")  # where Triton is installed (CI installs it)
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--processes", "2", "--busy", "1"]
                         + ([] if store else ["--no-store"]) + (["--hash-here"] if here else []),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "triton_key.json").read_text())["rows"]
    assert [r["key"] for r in rows] == ["hashed", "stored" if store else "hashed"]
    from tests.engine.test_pdl_ptx import KERNELS  # each process compiles every kernel, without and with TMA

    assert len(rows[0]["compiles_s"]) == 2 * len(KERNELS) and "| 2 |" in (tmp_path / "triton_key.md").read_text()
    assert {(r["busy"], r["hashed_in"]) for r in rows} == {(1, "here" if here else "child")}
