"""examples/grpo_loop.py: two GRPO iterations on the shipped pointer-chase model, on the CPU. The trainer's
replay agrees with the engine's log-probs (float32 rounding), the step moves the policy by far more than
that, and the next iteration agrees again: the update reached the engine (with update_weights, and
through the checkpoint fallback for engines without it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import anyio

from ourobatch import Engine

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"iter (\d+): reward=([\d.]+) max\|ratio-1\|=([\d.e+-]+) policy_change=([\d.e+-]+) "
                  r"rollout_versions=\[([\d, ]*)\] version=(\d+)")


def check(out: str, versions_in_rollouts: bool) -> None:
    rows = [LINE.fullmatch(line) for line in out.strip().splitlines()]
    assert len(rows) == 2 and all(rows), out
    (it1, r1, mis1, moved1, v1, ver1), (it2, r2, mis2, _, v2, ver2) = (m.groups() for m in rows)
    assert (it1, ver1, it2, ver2) == ("1", "1", "2", "2")
    assert 0 <= float(r1) <= 1 and 0 <= float(r2) <= 1
    assert float(moved1) > 1e-2  # the first step changed the policy ...
    assert float(mis1) < 1e-4 and float(mis2) < 1e-4  # ... yet the engine's next rollouts match the trainer
    if versions_in_rollouts:
        assert (v1, v2) == ("0", "1")  # per-token weight_versions: the second batch ran on version 1


def test_grpo_loop_two_iterations():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "grpo_loop.py"), "--iterations", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check(proc.stdout, versions_in_rollouts=True)


def test_grpo_loop_without_update_weights_falls_back_to_a_checkpoint(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import grpo_loop
    finally:
        sys.path.remove(str(ROOT / "examples"))
    monkeypatch.delattr(Engine, "update_weights")
    monkeypatch.setattr(sys, "argv", ["grpo_loop.py", "--iterations", "2", "--prompts", "4"])
    anyio.run(grpo_loop.main, grpo_loop.parse_args())
    check(capsys.readouterr().out, versions_in_rollouts=False)  # a fresh engine restarts at version 0

