"""Every example script runs on the CPU and prints what it promises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_async_generate():
    out = run_example("async_generate.py")
    assert re.search(r"generated 4 requests: deep_calls=[1-9]\d* deep_rows=\d+", out), out
    assert out.count("finish=length") == 4


def test_streaming():
    out = run_example("streaming.py")
    assert "[early] got 3 tokens, closing the stream" in out
    assert "early-closed request aborted: finished_abort=1" in out
    assert "[full]" in out and "finish=length" in out


def test_rl_collector():
    out = run_example("rl_collector.py")
    assert re.search(r"episodes=16 turns=48 tokens=\d+ mean_logprob=-?\d+\.\d+", out), out
    assert re.search(r"readout loops: loop 2: [\d.]+%, loop 4: [\d.]+%", out), out
    assert re.search(r"engine: deep_calls=[1-9]\d* deep_rows=\d+", out), out


@pytest.mark.parametrize("name", ["quickstart.py"])
def test_other_examples_run(name):
    assert run_example(name).strip()
